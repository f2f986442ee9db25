"""
Replay a run between two of its checkpoints on this machine and compare, bit for bit, what the
run recorded:

    python verify.py --out_dir=out/tiny    # its last two kept checkpoints (keep_checkpoints >= 2)
    python verify.py --start=out/tiny/ckpt-000030.pt --end=out/tiny/last.pt  # out_dir: their folder

It resumes from start with the settings of the session that wrote end (its checkpoint holds them;
start's must match) in a temporary folder, under torchrun with the run's number of processes where
it had several, trains to end's iteration, and compares what each step and evaluation computed
with the run's metrics.jsonl, then every entry of end's checkpoint but its config and times. One
verdict: reproduced, or the first divergence and what differs between the run's machine (its
meta.json) and this one. Exit code 0 when reproduced (or, for a GPU run without
deterministic=True, which cannot repeat bitwise, when it only drifted), 1 when not, 2 for bad
input.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

import checkpoint
import report
import sample
from configurator import ConfigError, configure, fail

# -----------------------------------------------------------------------------
# the run's folder: config.json, meta.json, metrics.jsonl, its checkpoints; not given, that of
# start and end where they are
out_dir = 'out'
start = ''  # the checkpoint to replay from, in out_dir; '' the second-latest kept (ckpt-ITER.pt)
end = ''  # the checkpoint to replay to, in out_dir; '' the latest kept one
# -----------------------------------------------------------------------------
# the replay's own: a temporary folder, no extras at its end, no loggers
REPLAY = {'test_eval': False, 'sample_tokens': 0, 'write_report': False, 'keep_checkpoints': 0,
          'wandb_log': False, 'tensorboard_log': False, 'profile_iter': 0, 'smoke_steps': 0}
# what a replay computes again: each train record's FIGURES, an eval record's all but NOT_FIGURES
FIGURES = ('loss', 'grad_norm', 'lr', 'scale', 'skipped_total', 'epoch')
NOT_FIGURES = ('kind', 'step', 'time', 'seconds')
# a checkpoint's entries that say where, when and by what code it was written, not what state it
# holds (an older format's dataset record is shorter; the replay's resume checks the data itself)
WHERE_AND_WHEN = ('config', 'eval_windows', 'log_bytes', 'train_seconds', 'shards', 'migrated',
                  'dataset', 'tasks')
# what no kernel's order of addition can change: a difference there is no drift
COUNTERS = ('iter_num', 'scheduler', 'scaler', 'sampler', 'rng')
# the loop's counters an evaluation sets (checkpoint.Progress.new_best)
BEST = ('best_val_loss', 'best_acc_norm', 'best_iter', 'evals_since_best')


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(f"cannot read {path} ({e}): point out_dir at a run's folder")


def run_records(run_dir):
    """The records of a run's metrics.jsonl."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    try:  # as report.py reads them: a last line a kill cut short never happened
        return report.read_records(path)
    except OSError as e:
        fail(f"cannot read {path} ({e.strerror}): point out_dir at a run's folder")
    except report.ReportError as e:
        fail(e)


def computed(records, first, last):
    """{(step, kind): {figure: value}} of the train and eval records of steps first..last: what a
    replay computes again (a train record's FIGURES; an eval record's losses, accuracies, bests)."""
    found = {}
    for r in records:
        if r['kind'] == 'train' and first <= r['step'] <= last:
            found[r['step'], 'train'] = {f: r.get(f) for f in FIGURES}
        elif r['kind'] == 'eval' and first <= r['step'] <= last:
            found[r['step'], 'eval'] = {f: v for f, v in r.items() if f not in NOT_FIGURES}
    return found


def same(a, b):
    """Whether two logged figures are the same number: two NaNs are (a skipped float16 step's)."""
    return a == b or (a != a and b != b)


def first_divergence(run, replay):
    """(step, figure, run's value, replay's value) of the first figure that differs, or None."""
    for key in sorted(replay):
        for figure, value in replay[key].items():
            if key in run and not same(run[key].get(figure), value):
                return key[0], figure, run[key].get(figure), value
    return None


def largest_drift(run, replay):
    """The largest relative difference of any number over the replayed records."""
    pairs = [(run[k][f], v) for k in replay if k in run for f, v in replay[k].items()]
    return max((abs(a - b) / max(abs(a), 1e-30) for a, b in pairs  # floats, not inf or NaN
                if isinstance(a, float) and isinstance(b, float) and math.isfinite(a - b)),
               default=0.0)


def state_drift(expected, replayed, keys):
    """(difference, name) of the tensor under keys that differs most, relative to the replay's
    largest value in it; (0.0, '') where none differs. inf where the replay lacks it, shapes it
    otherwise or holds a NaN apart from the run's: no order of addition does that."""
    largest = (0.0, '')
    for key in keys:
        a, b = leaves(expected.get(key), key), leaves(replayed.get(key), key)
        for name, ran in a.items():
            here = b.get(name)
            if not (isinstance(ran, torch.Tensor) and ran.is_floating_point()):
                continue
            if not isinstance(here, torch.Tensor) or here.shape != ran.shape:
                drift = math.inf
            elif torch.allclose(ran, here, rtol=0, atol=0, equal_nan=True):
                continue
            else:
                ran, here = ran.double(), here.double()
                drift = ((ran - here).abs().max() / here.abs().max().clamp(min=1e-30)).item()
            largest = max(largest, (math.inf if math.isnan(drift) else drift, name))
    return largest


def leaves(state, prefix):
    """{name: value} of every tensor and plain value in a nested state (dicts, lists, tuples)."""
    if isinstance(state, dict):
        pairs = state.items()
    elif isinstance(state, (list, tuple)):
        pairs = enumerate(state)
    else:
        return {prefix: state}
    found = {}
    for key, value in pairs:
        found |= leaves(value, f"{prefix}.{key}")
    return found


def state_difference(expected, replayed, keys):
    """'' when two checkpoints hold the same values under keys, else the first that differs (a
    tensor: by how much)."""
    for key in keys:
        a, b = leaves(expected.get(key), key), leaves(replayed.get(key), key)
        for name in list(a) + [name for name in b if name not in a]:
            ran, here = a.get(name), b.get(name)
            if name not in a or name not in b:
                return f"{name} is in {'the run' if name in a else 'the replay'} only"
            if isinstance(ran, torch.Tensor) and isinstance(here, torch.Tensor):
                if ran.shape != here.shape:
                    return f"{name} is shaped {list(ran.shape)} in the run, {list(here.shape)} here"
                if not torch.equal(ran, here):
                    diff = (ran.double() - here.double()).abs().max().item()
                    return f"{name} differs (largest difference {diff:.3g})"
            elif (isinstance(ran, torch.Tensor) or isinstance(here, torch.Tensor)
                  or not same(ran, here)):
                return f"{name} differs ({ran!r} in the run, {here!r} here)"
    return ''


def gathered(path, ckpt):
    """A checkpoint's entries with its weights in place: a sharded run's gathered model (its
    optimizer state and EMA stay in the shards)."""
    if 'shards' not in ckpt:
        return ckpt
    return {**ckpt, 'model': sample.load_model(path, 'cpu', raw_weights=True)[0].state_dict()}


def machine_differences(run_meta, replay_meta):
    """Lines naming what differs between the run's machine and software and the replay's."""
    lines = []
    for group in ('hardware', 'versions'):
        ran, here = run_meta.get(group, {}), replay_meta.get(group, {})
        for key in sorted(set(ran) | set(here)):
            if ran.get(key) != here.get(key):
                lines.append(f"  {group} {key}: {ran.get(key)!r} in the run, "
                             f"{here.get(key)!r} here")
    return lines


def missing_records(records, settings, first, last):
    """The records of iterations first+1..last that settings, those of the session that reached
    last, write for certain ('train 13', 'eval 20'), missing from records. Only from that session's
    start: an earlier one may have logged less often."""
    logged = {(r['step'], r['kind']) for r in records if r['kind'] in ('train', 'eval')}
    session_start = max([r['step'] for r in records if r['kind'] == 'start' and r['step'] < last],
                        default=first)
    return [f"{kind} {step}" for step in range(max(first, session_start) + 1, last + 1)
            for kind, every in (('train', settings['log_interval']),
                                ('eval', settings['eval_interval']))
            if step % every == 0 and (step, kind) not in logged]


# settings that may differ between the two checkpoints' sessions: where things are, how long
FREE = {'out_dir', 'data_dir', 'init_from', 'resume_from', 'max_iters'}


def run_folder(config, sources):
    """The run's folder: out_dir, or where no --out_dir is given, that of the checkpoints named. A
    run's metrics.jsonl and meta.json are its own: a checkpoint of another folder is refused, as
    another run's would replay against this one's records."""
    named = [config[k] for k in ('start', 'end') if config[k]]
    for key in ('start', 'end'):
        if config[key] and not os.path.isfile(config[key]):
            fail(f"{key}={config[key]} is not a file: name a checkpoint of the run's folder "
                 f"(ckpt-ITER.pt, last.pt)")
    if not named:
        return config['out_dir']
    folders = {os.path.realpath(os.path.dirname(os.path.abspath(p))) for p in named}
    if len(folders) > 1:
        fail(f"start {config['start']} and end {config['end']} are in different folders: name "
             f"two checkpoints of one run's folder")
    if sources['out_dir'] == 'default':
        return os.path.dirname(named[0]) or '.'
    if folders != {os.path.realpath(config['out_dir'])}:
        fail(f"{named[0]} is not in out_dir {config['out_dir']}: name checkpoints of that run's "
             f"folder, or leave out --out_dir (the checkpoints' folder is then the run's)")
    return config['out_dir']


def main(config, sources):
    run_dir = run_folder(config, sources)
    run_meta = read_json(os.path.join(run_dir, 'meta.json'))
    kept = checkpoint.kept_checkpoints(run_dir)
    if not (config['start'] and config['end']) and len(kept) < 2:
        fail(f"{run_dir} keeps {len(kept)} checkpoint(s) (ckpt-ITER.pt): train with "
             f"keep_checkpoints=2 or more, or name --start and --end")
    # absolute: the replay runs in this script's folder
    start_path, end_path = (os.path.abspath(p) for p in (config['start'] or kept[-2],
                                                          config['end'] or kept[-1]))
    try:
        start_ckpt, end_ckpt = (checkpoint.load(p, resumable=True) for p in (start_path, end_path))
    except checkpoint.CheckpointError as e:
        fail(e)
    first, last = start_ckpt['iter_num'], end_ckpt['iter_num']
    if first >= last:
        fail(f"{start_path} (iteration {first}) is not before {end_path} (iteration {last}): "
             f"name an earlier start")
    settings = end_ckpt['config']  # the settings of the session that wrote end, not the latest's
    # as a resume compares them (dtype: as the run resolved it); a key start's code lacked differs
    changed = sorted(k for k in checkpoint.changed_settings(start_ckpt, settings,
                                                             dict.fromkeys(settings),
                                                             end_ckpt.get('tasks'))
                     if k not in FREE)
    if changed:
        fail(f"{start_path} and {end_path} come from sessions with other settings "
             f"({', '.join(changed)}): name two checkpoints of one session")
    records = run_records(run_dir)
    run_figures = computed(records, first + 1, last)
    # one gone from its metrics.jsonl would leave its figures uncompared
    if missing := missing_records(records, settings, first, last):
        print(f"not verified: {run_dir}/metrics.jsonl lacks record(s) the run's settings write: "
              f"{', '.join(missing)}")
        sys.exit(1)
    # a state per process: the end's session's, which may have resumed start on another count; a
    # session between them on another count, or one that changed settings on resume (and a later
    # one changed them back), cannot be replayed with the end's
    world_size = len(end_ckpt['rng'])
    starts = [(r['step'], r.get('world_size', world_size),  # older runs' records lack both
               sorted(set(r.get('changed', ())) - FREE)) for r in records if r['kind'] == 'start']
    for (step, count, changed), (next_step, *_) in zip(starts, starts[1:] + [(math.inf,)]):
        span = f"iterations {max(step, first) + 1}-{min(next_step, last)}"
        if step < last and next_step > first and count != world_size:
            fail(f"{span} ran on {count} process(es), the session that wrote {end_path} on "
                 f"{world_size}: name checkpoints of sessions on one number of processes")
        if first <= step < last and changed:
            fail(f"{span} ran in a session that changed {', '.join(changed)} on resume, which the "
                 f"replay of {end_path}'s settings would not: name checkpoints of sessions with "
                 f"one set of settings")
    replay_parent = os.path.dirname(os.path.abspath(run_dir))  # beside the run: /tmp may be small
    with tempfile.TemporaryDirectory(prefix='verify-', dir=replay_parent) as replay_dir:
        resume_from = start_path
        if 'shards' not in start_ckpt:  # a second name: a run still training may remove the first
            resume_from = os.path.join(replay_dir, 'start.pt')
            checkpoint.link_file(start_path, resume_from)
        replay_settings = {**settings, **REPLAY, 'out_dir': replay_dir, 'init_from': 'resume',
                           'resume_from': resume_from, 'max_iters': last}
        args = [f"--{key}={value}" for key, value in replay_settings.items()]
        launcher = [sys.executable]
        if world_size > 1:
            launcher += ['-m', 'torch.distributed.run', '--standalone',
                         f"--nproc_per_node={world_size}"]
        print(f"replaying iterations {first + 1}-{last} of {run_dir} on {world_size} process(es)",
              file=sys.stderr)
        train_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')
        replay = subprocess.run([*launcher, train_py, *args], capture_output=True, text=True)
        if replay.returncode != 0:
            lines = replay.stderr.splitlines()
            errors = [line for line in lines if line.startswith('error:')] or lines[-1:] or ['']
            if replay.returncode == 2 and errors[0].startswith('error: '):  # nothing replayed
                fail(f"the replay did not start: {errors[0].removeprefix('error: ')}")
            print(f"not verified: the replay failed ({errors[0]})")
            sys.exit(1)
        replay_figures = computed(run_records(replay_dir), first + 1, last)
        replay_meta = read_json(os.path.join(replay_dir, 'meta.json'))
        replayed_path = os.path.join(replay_dir, 'last.pt')
        replayed = gathered(replayed_path, checkpoint.load(replayed_path))
        expected = gathered(end_path, end_ckpt)
    counters = state_difference(expected, replayed, COUNTERS)
    # the rest may drift on a GPU. The replay evaluates every eval_interval and at its end; the
    # run did also where a session of it ended (at its max_iters), and not at last where it only
    # saved there: its best so far then differs from the replay's
    evaluated = {step for step, kind in run_figures if kind == 'eval'}
    same_evaluations = evaluated == {step for step in range(first + 1, last + 1)
                                     if step % settings['eval_interval'] == 0 or step == last}
    skipped = WHERE_AND_WHEN + COUNTERS + (() if same_evaluations else BEST)
    rest = [key for key in {**expected, **replayed} if key not in skipped]
    for figures in [] if same_evaluations else [*run_figures.values(), *replay_figures.values()]:
        figures.pop('best_val_loss', None)  # the eval records' best so far
    weights = state_difference(expected, replayed, rest)
    compared = [key for key in replay_figures if key in run_figures]
    steps = sum(kind == 'train' for _, kind in compared)
    divergence = first_divergence(run_figures, replay_figures)
    if not steps:
        print(f"not verified: {run_dir}/metrics.jsonl holds no train record of iterations "
              f"{first + 1}-{last}")
        sys.exit(1)
    state = 'the gathered weights and the rest' if 'shards' in end_ckpt else 'the state'
    if divergence is None and not counters and not weights:
        print(f"reproduced: iterations {first + 1}-{last}, {steps} logged step(s) and "
              f"{len(compared) - steps} evaluation(s), every figure they computed equal (loss, "
              f"gradient norm, learning rate, ...), and {state} equal to {end_path}'s")
        return
    on_gpu = str(run_meta.get('device', '')).startswith('cuda')
    drift, drifted = state_drift(expected, replayed, rest)
    if on_gpu and not settings.get('deterministic') and not counters and math.isfinite(drift):
        print(f"drifted, as a GPU run without deterministic=True does (its kernels add in varying "
              f"order): the largest relative difference over iterations {first + 1}-{last} is "
              f"{largest_drift(run_figures, replay_figures):.3g} in the logged figures, "
              f"{drift:.3g}{f' ({drifted})' if drifted else ''} in the state; train with "
              f"deterministic=True to verify bitwise")
        return
    if divergence:
        step, figure, ran, here = divergence
        size = ''
        if all(isinstance(value, (int, float)) for value in (ran, here)):
            size = f" (relative difference {abs(ran - here) / max(abs(ran), 1e-30):.3g})"
        print(f"diverged at iteration {step}: {figure} {ran!r} in the run, {here!r} here{size}")
    for difference in (counters, weights):
        if difference:
            print(f"diverged in the state at iteration {last}: {difference}")
    lines = machine_differences(run_meta, replay_meta)
    print("what differs from the run's machine:" if lines else
          "this machine matches the run's (hardware and versions in meta.json)")
    for line in lines:
        print(line)
    sys.exit(1)


if __name__ == '__main__':
    defaults = {'out_dir': out_dir, 'start': start, 'end': end}
    try:
        main(*configure(defaults, sys.argv[1:]))
    except ConfigError as e:
        fail(e)
