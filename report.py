"""
A run's report, rebuilt from its out_dir alone (metrics.jsonl, config.json, meta.json, and the
iteration last.pt holds), so it works for finished, early-stopped, aborted and killed runs alike:

    python report.py out/tiny    # writes out/tiny/report.md and out/tiny/curves.png

With train.py's write_report on (the default), runlog.finish calls write_report(out_dir) when a run
ends, aborts or stops for a signal.
"""
import json
import math
import os
import shlex
import statistics
import sys

from configurator import HELP, fail, print_help


RUN_FILES = ('metrics.jsonl', 'config.json', 'meta.json')
# grad norm > 5x the median of up to 100 previous steps
SPIKE_FACTOR, SPIKE_WINDOW, SPIKE_MIN_HISTORY = 5, 100, 10
LEAK_BELOW = 0.05  # val this far (relative) below train at the last eval: suspicious
LEAK_TRACKS = 0.002  # val this close (relative) to train at every eval: suspicious too
RISE = 0.02  # train and val loss this far (relative) above the best evaluation's: diverging


class ReportError(Exception):
    """A run file that cannot be read; the one-line message names it and the fix."""


def read_records(path):
    """The records of a run's metrics.jsonl. A kill mid-write leaves a last line without its
    newline: that record never happened. ReportError for any other line that is not a record."""
    records = []
    with open(path, 'rb') as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b'\n'):
                break
            try:
                record = json.loads(line.decode('utf-8'))
                ok = isinstance(record, dict) and 'kind' in record
                problem = None if ok else repr(record)[:80]
            except ValueError as e:  # UnicodeDecodeError is one
                problem = str(e)
            if problem is not None:
                raise ReportError(f"{path}:{number} is not a metrics record ({problem}): the file "
                                  f"is damaged; delete that line, then run again")
            records.append(record)
    return records


def read_json(path):
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except ValueError as e:  # UnicodeDecodeError is one
        raise ReportError(f"{path} is not JSON ({e}): the file is damaged; restore it, or resume "
                          f"the run, which writes it again") from None


def read_run(out_dir):
    return (read_records(os.path.join(out_dir, 'metrics.jsonl')),
            read_json(os.path.join(out_dir, 'config.json')),
            read_json(os.path.join(out_dir, 'meta.json')))


def loss_text(loss):
    return f"{loss:.4f} ({loss / math.log(2):.3f} bits/token)"


def last_event(records):
    """The last train, eval, test, abort or stop record, or None: a test or abort record ends the
    run only if no training record follows it (a later resume)."""
    return next((r for r in reversed(records)
                 if r['kind'] in ('train', 'eval', 'test', 'abort', 'stop')), None)


def status(records, max_iters):
    """(one word, the rest of the sentence)."""
    end = last_event(records)
    smoke = next((r for r in reversed(records) if r['kind'] == 'smoke'), None)
    if end is None and smoke and not smoke['passed']:  # smoke.py's line, exit 2, before a step
        return 'failed', ("its smoke test, before the first step: the settings do not learn on one "
                          "batch (train.log's error line says why)")
    if end is None or end['kind'] in ('train', 'eval'):
        last_step = max((r['step'] for r in records if 'step' in r), default=0)
        return 'incomplete', (f"the run did not finish (killed or still running?) at iteration "
                              f"{last_step}")
    if end['kind'] == 'abort':
        return 'aborted', f"at iteration {end['step']}: {end['message']}"
    if end['kind'] == 'stop':  # ended: at max_iters or an early stop (older runs: max_iters)
        ended = end.get('ended', end['step'] == max_iters)
        left = "its end (test split, sample) left" if ended else "resume it"
        return 'stopped', (f"by {end['signal']} at iteration {end['step']} of {max_iters}: last.pt "
                           f"holds it, {left}")
    return ('early-stopped' if end['step'] < max_iters else 'finished',
            f"at iteration {end['step']} of {max_iters}")


def fit_read(evals):
    """One line on under- or overfitting, from the train and val losses at the evaluations."""
    if len(evals) < 2:
        return "too few evaluations to tell under- from overfitting"
    best = min(range(len(evals)), key=lambda i: evals[i]['val_loss'])
    since_best = len(evals) - 1 - best
    if since_best >= 2 and evals[-1]['train_loss'] < evals[best]['train_loss']:
        return (f"overfitting from iteration {evals[best]['step']}: val loss was lowest there and "
                f"stayed above it for the {since_best} evaluations since, while train loss kept "
                f"falling")
    last, lowest = evals[-1], evals[best]
    rose = all(last[key] > (1 + RISE) * lowest[key] for key in ('train_loss', 'val_loss'))
    if since_best >= 2 and rose:
        return (f"diverging from iteration {lowest['step']}: val loss was lowest there, and train "
                f"and val loss have both risen more than {RISE:.0%} since: lower learning_rate "
                f"(expected with overfit_one_batch, which fits one batch, not the splits)")
    if since_best == 0 and evals[-1]['train_loss'] < evals[-2]['train_loss']:
        return ("underfitting: train and val loss are both still falling at the last evaluation: "
                "train longer")
    return (f"fitting: val loss stopped improving at iteration {evals[best]['step']} without a "
            f"sustained rise")


def leakage(evals, train):
    """What in the losses suggests that val text also occurs in train, or None. That val tracks
    train counts only after the train split's first epoch (train records' 'epoch'): until the model
    has seen train text once, it is as new as val text, and the two track each other on any large
    corpus."""
    last = evals[-1]
    if last['val_loss'] < (1 - LEAK_BELOW) * last['train_loss']:
        return (f"val loss sits {last['train_loss'] - last['val_loss']:.4f} below train loss at "
                f"the last evaluation: check that val text does not also occur in train")
    seen = next((r['step'] for r in train if r.get('epoch', 0) > 0), math.inf)  # older runs: none
    later = [e for e in evals if e['step'] >= seen]
    if len(later) >= 3 and all(abs(e['val_loss'] - e['train_loss']) < LEAK_TRACKS * e['train_loss']
                               for e in later):
        return (f"val loss tracks train loss within {LEAK_TRACKS:.1%} at every evaluation after "
                f"the first epoch (from iteration {later[0]['step']}): check that val text does "
                f"not also occur in train")
    return None


def wall_seconds(records):
    """(seconds, what they are), or None without timestamps. A run that completed: its last 'test'
    record's total_seconds, the figure of train.log's done line (test records carry no time, so
    timestamps would miss the last save). Otherwise the sum over (re)starts of the time from each
    start record to the last timed record before the next start: the time between a kill and its
    resume is not counted."""
    end = last_event(records)
    if end and end['kind'] == 'test':
        return (end['total_seconds'], "the training loop's in every session, evaluations and "
                                      "saves included, as train.log's done line says")
    spans = sessions(records)
    if not spans:
        return None
    return sum(s for s, _ in spans), "from each session's start to its last timed record"


def sessions(records, world_size=1):
    """[(seconds, processes)] of each session with timestamps: from its start record to its last
    timed record before the next start (the time between a kill and its resume is not counted), on
    the processes its start record names (older runs' name none: world_size)."""
    spans = [[world_size, []]]  # records before any start record: an older run's
    for r in records:
        if r['kind'] == 'start':
            spans.append([r.get('world_size', world_size), []])
        if r.get('time') is not None:
            spans[-1][1].append(r['time'])
    return [(max(times) - min(times), n) for n, times in spans if times]


def grad_spikes(train):
    """Steps whose grad norm exceeds SPIKE_FACTOR x the median of the previous logged steps;
    float16-skipped steps are left out (their norm is inf by design and they are counted on their
    own)."""
    norms, spikes = [], []
    for r in train:
        if r.get('skipped'):
            continue
        if (len(norms) >= SPIKE_MIN_HISTORY
                and r['grad_norm'] > SPIKE_FACTOR * statistics.median(norms[-SPIKE_WINDOW:])):
            spikes.append(r['step'])
        norms.append(r['grad_norm'])
    return spikes


def resume_command(meta, has_last, settings=None, ended=False):
    """train.py's command to continue the run: from out_dir's last.pt if there is one (whatever the
    run itself started from), else init_from=auto, which redoes the run from scratch or from its
    resume_from. settings ({key: value}) replace the command's own --key=... (a resumed run's
    command holds those of its resume). ended: last.pt holds the training's end (max_iters or an
    early stop), which init_from=resume refuses (nothing to train) and auto takes to do the end
    (test split, sample) a stop left."""
    settings = settings or {}
    dropped = ['init_from', 'resume_from'] if has_last else ['init_from']
    args = [a for a in meta['command'][1:]
            if not a.startswith(tuple(f'--{k}=' for k in dropped + list(settings)))]
    world_size = meta.get('world_size', 1)
    launcher = (['python'] if world_size == 1
                else ['torchrun', '--standalone', f'--nproc_per_node={world_size}'])
    return shlex.join(launcher + [meta['command'][0], *args,
                                  f"--init_from={'resume' if has_last and not ended else 'auto'}",
                                  *(f'--{k}={v}' for k, v in settings.items())])


def train_further(config, out_dir, skipped):
    """A finished run's (settings for resume_command, the sentence before it), as README's Resume
    says: a schedule not yet at min_lr goes on along it; one that has decayed stays at min_lr,
    since raising lr_decay_iters would put the rate back up; a wsd run cools down anew from
    stable.pt. skipped: the optimizer steps float16 skipped, which the schedule does not count."""
    max_iters, decay_iters = config['max_iters']['value'], config['lr_decay_iters']['value']
    how = "Train further (from the directory it was started in)"
    if not config['decay_lr']['value']:
        return {'max_iters': 2 * max_iters}, f"{how}:"
    steps = max_iters - skipped
    if decay_iters > steps:
        return ({'max_iters': max_iters + min(max_iters, decay_iters - steps)},
                f"{how}; the learning rate goes on along its schedule, which reaches min_lr at "
                f"lr_decay_iters={decay_iters} optimizer steps ({steps} taken):")
    stable_here = os.path.exists(os.path.join(out_dir, 'stable.pt'))
    if config['lr_schedule']['value'] == 'wsd' and stable_here:
        # the command's own out_dir: it runs where the run was started, not where report.py is
        stable = os.path.join(config['out_dir']['value'], 'stable.pt')
        return ({'resume_from': stable, 'max_iters': 2 * max_iters,
                 'lr_decay_iters': 2 * max_iters},
                f"{how} from stable.pt, written where the decay began (the iterations since are "
                f"redone): a longer schedule stays at the peak rate, then cools down anew; from "
                f"last.pt the rate would stay at min_lr:")
    return ({'max_iters': 2 * max_iters},
            f"{how}; the learning rate reached min_lr at lr_decay_iters={decay_iters} and stays "
            f"there (raising lr_decay_iters too would put it back up, a second warm-up: val loss "
            f"rises before it falls again):")


def task_names(evals):
    """The multiple-choice tasks an evaluation scored (train.py's eval_tasks): eval records hold
    TASK/acc_norm."""
    return [k.removesuffix('/acc_norm') for k in (evals[-1] if evals else {})
            if k.endswith('/acc_norm')]


def plot_curves(train, evals, path, title, log_interval):
    # here: train.py imports this module, and a run stopped at start-up should not pay 0.8 s for it
    import matplotlib
    matplotlib.use('Agg')  # files only, no display
    import matplotlib.pyplot as plt
    tasks = task_names(evals)
    if tasks:  # loss, accuracy, learning rate
        fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 8), height_ratios=[3, 1, 2])
    else:
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=[3, 1])
    ax_loss, ax_lr = axes[0], axes[-1]
    ax_loss.plot([r['step'] for r in train], [r['loss'] for r in train], lw=0.8, alpha=0.5,
                 label=(f'train (every {log_interval} iterations)' if log_interval > 1
                        else 'train (every iteration)'))
    curves = [('train_loss', 'train (eval)'), ('val_loss', 'val (eval)')]
    if evals and evals[-1].get('ema_val_loss') is not None:  # ema_decay
        curves.append(('ema_val_loss', 'val of the EMA weights (eval)'))
    for key, label in curves:
        ax_loss.plot([e['step'] for e in evals], [e[key] for e in evals], 'o-', label=label)
    ax_loss.set(ylabel='loss (nats/token)', title=title)
    ax_loss.legend()
    for task in tasks:  # accuracy beside its chance level, where an evaluation scored it
        scored = [e for e in evals if f'{task}/acc_norm' in e]
        line, = axes[1].plot([e['step'] for e in scored], [e[f'{task}/acc_norm'] for e in scored],
                             'o-', label=task)
        axes[1].axhline(evals[-1][f'{task}/chance'], ls='--', color=line.get_color(), lw=0.8,
                        label=f'{task}: chance')
    if tasks:
        axes[1].set(ylabel='acc_norm')
        axes[1].legend()
    ax_lr.plot([r['step'] for r in train], [r['lr'] for r in train])
    ax_lr.set(xlabel='iteration', ylabel='learning rate')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def config_lines(config):
    settings = {k: v for k, v in config.items() if k != 'resolved'}
    lines = ["## Config", "",
             f"Resolved: device {config['resolved']['device']}, dtype "
             f"{config['resolved']['dtype']}. "
             "Values set by a config file or the command line are in bold.", "",
             "| key | value | source |", "|---|---|---|"]
    for key, entry in settings.items():
        value = repr(entry['value']).replace('|', '\\|')
        lines.append(f"| {key} | {value if entry['source'] == 'default' else f'**{value}**'} | "
                     f"{entry['source']} |")
    return lines


def windows_of(coverage):
    """(windows taken, the split's) as words: '8 of its 1,743 windows' (eval_iters' sample), or
    'all its 1,743 windows'."""
    taken, split = coverage
    return f"{'all' if taken == split else f'{taken:,} of'} its {split:,} windows"


def loss_lines(evals, train, test, split_rule):
    if not evals:
        return ["## Loss", "", "- no evaluation yet"]
    best_val = min(evals, key=lambda e: e['val_loss'])
    best_train = min(evals, key=lambda e: e['train_loss'])
    last = evals[-1]
    lines = ["## Loss", "",
             f"- last evaluation (iteration {last['step']}): train "
             f"{loss_text(last['train_loss'])}, val {loss_text(last['val_loss'])}, "
             f"gap (val - train) {last['val_loss'] - last['train_loss']:+.4f}",
             f"- best val loss {loss_text(best_val['val_loss'])} at iteration {best_val['step']}; "
             f"best train loss {loss_text(best_train['train_loss'])} at iteration "
             f"{best_train['step']}"]
    if last.get('ema_val_loss') is not None:  # ema_decay: best.pt holds the EMA's weights
        best_ema = min(evals, key=lambda e: e['ema_val_loss'])
        held = f" of iteration {test['best_iter']}" if test else ''  # by best_by: maybe not these
        lines.append(f"- the EMA of the weights: val {loss_text(last['ema_val_loss'])} at the last "
                     f"evaluation, best {loss_text(best_ema['ema_val_loss'])} at iteration "
                     f"{best_ema['step']}; best.pt holds the EMA{held}, which sample.py and "
                     f"evaluate.py use")
    if test and test.get('test_loss') is not None:
        tested = test.get('tested_iter', test['best_iter'])  # older runs' records lack it
        whose = 'the best' if tested == test['best_iter'] else 'the last'
        windows = f" on {windows_of(test['test_windows'])}" if test.get('test_windows') else ''
        lines.append(f"- test loss {loss_text(test['test_loss'])}{windows} with {whose} weights "
                     f"(iteration {tested})")
        if (test['test_loss'] < (1 - LEAK_BELOW) * best_val['val_loss']
                and split_rule.startswith('contiguous')):
            lines.append("- test loss sits well below val loss: with a single text, test is its "
                         "first 5% and val its last 10%, so they are different text, and the "
                         "opening of a text can be easier; compare val losses between runs, not "
                         "test with val")
    for task in task_names(evals):  # its best of the evaluations that scored it (eval_tasks may
        # change on resume)
        best = max((e for e in evals if f'{task}/acc_norm' in e),
                   key=lambda e: e[f'{task}/acc_norm'])
        examples = last.get(f'{task}/examples')  # older runs' records lack it
        whose = " (the EMA's weights)" if last.get('ema_val_loss') is not None else ''
        lines.append(f"- {task}{whose}: acc {last[f'{task}/acc']:.4f}, acc_norm "
                     f"{last[f'{task}/acc_norm']:.4f} at the last evaluation, best acc_norm "
                     f"{best[f'{task}/acc_norm']:.4f} at iteration {best['step']} (chance "
                     f"{last[f'{task}/chance']:.4f}"
                     f"{f'; {examples} examples' if examples else ''})")
    lines.append(f"- read: {fit_read(evals)}")
    leak = leakage(evals, train)
    return lines + ([f"- **possible leakage**: {leak}"] if leak else [])


def throughput_lines(records, train, config, meta):
    lines = ["## Throughput", ""]
    if train:
        lines.append(f"- median {statistics.median(r['tokens_per_sec'] for r in train):,.0f} "
                     f"tokens/s")
    mfus = [r['mfu'] for r in train if r.get('mfu') is not None]
    if mfus:
        lines.append(f"- median MFU {statistics.median(mfus):.1%}")
    busy = [r['utilization'] for r in train if r.get('utilization') is not None]
    if busy:  # perf.Speedometer.utilization says what it is on each device
        what = ("the GPU's busy share (NVML) at each log line on rank 0"
                if config['resolved']['device'].startswith('cuda') else
                "rank 0's CPU time over the wall time of torch's threads, per log interval")
        lines.append(f"- mean utilization {statistics.mean(busy):.0%}: {what}")
    mems = [r['peak_mem_mb'] for r in train if r.get('peak_mem_mb') is not None]
    if mems:
        what = ("the CUDA allocator's peak on rank 0"
                if config['resolved']['device'].startswith('cuda') else
                "rank 0's peak resident set (the whole process: Python, torch, data; loader "
                "workers not included)")
        lines.append(f"- peak memory {max(mems):,.0f} MB by the last training log line: {what}")
    wall = wall_seconds(records)
    if wall is None:
        return lines + ["- wall time unknown: metrics.jsonl has no timestamps"]
    seconds, what = wall
    # each session on its own processes: a resume may run on another number
    spans = sessions(records, meta.get('world_size', 1))
    timed = sum(s for s, _ in spans)
    processes = sum(s * n for s, n in spans) / timed if timed else meta.get('world_size', 1)
    counts = sorted({n for s, n in spans if s}) or [meta.get('world_size', 1)]
    held = (f"{counts[0]} process(es)" if len(counts) == 1
            else f"{' and '.join(map(str, counts))} processes by session")
    compute_hours = seconds / 3600 * processes
    lines.append(f"- wall time {seconds / 3600:.2f} h ({seconds:,.0f} s), {what}; "
                 f"{compute_hours:.2f} compute hours ({held})")
    evals = [r.get('seconds') for r in records if r['kind'] == 'eval']
    if evals and None not in evals and seconds > 0:  # timed (older runs' are not)
        lines.append(f"- {len(evals)} evaluation(s): {sum(evals):,.1f} s, "
                     f"{sum(evals) / seconds:.1%} of the wall time (eval_interval, eval_iters, "
                     f"eval_tasks)")
    cost_per_hour = config.get('cost_per_hour', {}).get('value')
    if cost_per_hour:
        lines.append(f"- estimated cost {compute_hours * cost_per_hour:,.2f} ({cost_per_hour} per "
                     f"compute hour)")
    return lines


def write_report(out_dir):
    """Write out_dir/report.md and out_dir/curves.png from the run's files."""
    records, config, meta = read_run(out_dir)
    train, evals = ([r for r in records if r['kind'] == 'train'],
                    [r for r in records if r['kind'] == 'eval'])
    test = next((r for r in reversed(records) if r['kind'] == 'test'), None)
    word, detail = status(records, config['max_iters']['value'])
    lines = [f"# {out_dir}", "", f"Status: **{word}**: {detail}", ""]
    for smoke in (r for r in records if r['kind'] == 'smoke'):  # before the first step (smoke.py)
        verdict = 'passed' if smoke['passed'] else 'FAILED'
        losses = f"{smoke['first_loss']:.4f} -> {smoke['last_loss']:.4f}"
        lines += [f"Smoke test: {verdict}, {smoke['steps']} steps on one batch, loss {losses} in "
                  f"{smoke['seconds']:.1f} s", ""]
    lines += config_lines(config) + [""]
    split_rule = meta.get('dataset', {}).get('split_rule', '')
    lines += (loss_lines(evals, train, test, split_rule) + [""]
              + throughput_lines(records, train, config, meta) + [""])

    spikes = grad_spikes(train)
    listed = (f", at iterations "
              f"{', '.join(map(str, spikes[:5]))}{', ...' if len(spikes) > 5 else ''}"
              if spikes else "")
    lines += ["## Instabilities", "",
              f"- float16 steps skipped: {train[-1].get('skipped_total', 0) if train else 0}",
              f"- gradient-norm spikes (> {SPIKE_FACTOR}x the running median): "
              f"{len(spikes)}{listed}"]
    if word == 'aborted':
        lines.append(f"- aborted {detail}")

    has_last = os.path.exists(os.path.join(out_dir, 'last.pt'))
    lines += ["", "## Files", ""]
    lines += [f"- {name}: {os.path.join(out_dir, name)}" for name in ('best.pt', 'last.pt')
              if os.path.exists(os.path.join(out_dir, name))]
    if word == 'finished':  # nothing left to do at this max_iters: the command must raise it
        skipped = train[-1].get('skipped_total', 0) if train else 0
        settings, how = train_further(config, out_dir, skipped)
        command = resume_command(meta, has_last, settings)
    elif word == 'early-stopped' and has_last:  # nor at this patience (auto redoes the end)
        command = resume_command(meta, has_last, {'patience': 2 * config['patience']['value']})
        how = "Train on past the early stop (from the directory it was started in), more patient:"
    else:
        end = last_event(records)
        ended = word == 'stopped' and end.get('ended', end['step'] == config['max_iters']['value'])
        command = resume_command(meta, has_last, ended=ended)
        what = 'Resume the run' if has_last else 'No last.pt yet: redo the run'
        # a kill comes after the last save: the resume starts from there, not the last record
        import checkpoint  # torch: here alone, for python report.py's other paths' sake
        held = (checkpoint.saved_state(os.path.join(out_dir, 'last.pt')) or {}).get('iter_num')
        if held is not None:
            what += f" from last.pt's iteration {held}"
        how = f"{what} (from the directory it was started in):"
        if word == 'failed':
            how = "Change what train.log's error line names, then redo the run:"
    lines += ["- curves: curves.png", "", how, "", f"    {command}", ""]
    with open(os.path.join(out_dir, 'report.md'), 'w') as f:
        f.write('\n'.join(lines))
    plot_curves(train, evals, os.path.join(out_dir, 'curves.png'),
                f"{os.path.basename(os.path.normpath(out_dir))}: {word}",
                config['log_interval']['value'])


if __name__ == '__main__':
    if any(arg in HELP for arg in sys.argv[1:]):
        print_help(settings=False)
    run_dir = sys.argv[-1].removeprefix('--out_dir=')  # as sample.py and verify.py take it, too
    if len(sys.argv) != 2 or not run_dir:
        fail("usage: python report.py OUT_DIR (or --out_dir=OUT_DIR)")
    missing = [name for name in RUN_FILES if not os.path.isfile(os.path.join(run_dir, name))]
    if missing:
        fail(f"{run_dir} has no {missing[0]}: pass the out_dir of a train.py run")
    try:
        write_report(run_dir)
    except ReportError as e:
        fail(e)
    except OSError as e:  # a run folder that cannot be read or written, as on a read-only mount
        fail(f"{e.filename}: {e.strerror}: report.py reads the run's files and writes report.md "
             f"and curves.png beside them; pass a copy of the folder it can read and write")
    print(f"wrote {os.path.join(run_dir, 'report.md')} and {os.path.join(run_dir, 'curves.png')}")
