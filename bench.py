"""
Measure training speed by running train.py as users run it and reading back what it records
(metrics.jsonl, config.json, meta.json): per setting, the median time per iteration after a warm-up,
tokens/s, model FLOPs utilization (MFU) against the peak train.py measured, the whole process's wall
time, what each rank holds, and where one iteration's time goes (train.py's profile_iter). Every
figure printed also goes to a JSON file.

    python bench.py config/tiny.py --batch_size=8
    python bench.py config/tiny.py --compare='--compile=True'
    python bench.py config/tiny.py --nproc=2 --parallel=fsdp --gradient_accumulation_steps=2 \
        --compare=--parallel=ddp
    python bench.py config/tiny.py \
        --reference='cd ../nanoGPT && python train.py config/train_shakespeare_char.py ...'
    python bench.py --loader=out/fineweb --bench_iters=2000  # the train loader of that run's config
    python bench.py --sample=out/tiny --new_tokens=1000  # generate() with the KV cache and without
    python bench.py config/shakespeare_char_fast.py --whole=True --target=1.886 \
        --reference='cd ../nanoGPT && python train.py config/train_shakespeare_char.py ...'

Takes the keys below (one that the measurement asked for never reads is refused); every other
argument goes to train.py as it is (train.py checks it), but the step timing's own (own_settings),
which it refuses. Each run of train.py gets a fresh out_dir in a temporary folder and bench_warmup +
bench_iters iterations, each one logged, then one more that the first round profiles; its one
evaluation (of 1 batch) and checkpoint come after, outside the timed iterations. With compare, a
setting B (the same arguments plus those overrides) runs too; with reference, that shell command
runs as B instead, timed by the lines it prints in nanoGPT's format, "iter N: loss X, time Y ms".
The settings run in turns, A B A B ..., one process each, so that other load on the machine hits
both alike. With loader, no model runs: the batches/s of the train loader a run (its out_dir) used,
built from its config.json in this process, over bench_iters batches. With sample, no training
either: the tokens/s of model.generate() with the KV cache and without it, in turns, in this
process, on the model of a run (its out_dir's last.pt), float32, batch 1, greedy from a 1-token
prompt. With whole, each setting (and the reference) runs as a user runs it, its own iterations,
evaluations and end-of-run extras: the whole process's wall time and, with target, the second its
val loss was first printed at or below target.
"""
import difflib
import glob
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from json import dump, load, loads

from configurator import HELP, ConfigError, configure

# -----------------------------------------------------------------------------
bench_iters = 20  # timed iterations per process
# iterations dropped at the start of every process: one-time work, allocator, loader workers,
# compilation
bench_warmup = 5
rounds = 3  # processes per setting, run in turns with the other setting's
compare = ''  # overrides that make a setting B, e.g. '--compile=True'
# a shell command run as B instead, e.g. nanoGPT's train.py with the same shapes and
# --log_interval=1
reference = ''
# tokens per iteration of the reference; 0: as many as ours (the shapes match)
reference_tokens_per_iter = 0
nproc = 1  # processes per run of train.py, under torchrun
# break one iteration of each setting down (train.py's profile_iter): data, forward, backward, ...
profile = True
# write that iteration's chrome trace (chrome://tracing, ui.perfetto.dev) here; with compare,
# NAME_A.json, NAME_B.json
trace = ''
json = ''  # every figure to this file, the runs' folder beside it; '': bench.json in a temp one
loader = ''  # a run's out_dir: time its train loader alone (is the data path ever the bottleneck?)
sample = ''  # a run's out_dir: time generate() on its model, with the KV cache and without
# run each setting as a user runs it (its own iterations, evaluations and end-of-run extras; no
# bench iterations or profile): the whole process's wall time and, with target, when the val loss
# reached it
whole = False
target = 0.0  # whole: the val loss to time (ours' 'eval N: ...' lines, nanoGPT's 'step N: ...')
new_tokens = 200  # sample: tokens each generate() call adds
# -----------------------------------------------------------------------------
bench_keys = ['bench_iters', 'bench_warmup', 'rounds', 'compare', 'reference',
              'reference_tokens_per_iter', 'nproc', 'profile', 'trace', 'json', 'loader', 'sample',
              'new_tokens', 'whole', 'target']
folder = None  # the runs' temporary folder, once made
TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')
ITER_LINE = re.compile(r'^iter (\d+): loss [^,]*, time ([\d.]+) ?ms', re.M)  # nanoGPT's log line
# an evaluation's val loss: ours', nanoGPT's
VAL_LINE = re.compile(r'^(?:eval \d+: train [\d.]+, val'
                      r'|step \d+: train loss [\d.]+, val loss) ([\d.]+)')


def stop(message, code=2):
    """A mistake in the arguments (exit code 2: nothing measured, so the runs' folder goes too) or a
    run that failed (1: its log stays): one line, or the run's last lines."""
    if code == 2 and folder:
        shutil.rmtree(folder)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def is_bench_key(arg):
    """Whether an argument is bench.py's: one of its keys, or a misspelt one (train.py's keys are
    not near them)."""
    key = arg[2:].partition('=')[0]
    return arg.startswith('--') and (key in bench_keys
                                     or difflib.get_close_matches(key, bench_keys, cutoff=0.8))


try:
    bench_args = [a for a in sys.argv[1:] if is_bench_key(a) or a in HELP]
    globals().update(configure({k: globals()[k] for k in bench_keys}, bench_args,
                               minimums=dict.fromkeys(('bench_iters', 'bench_warmup', 'rounds',
                                                       'nproc', 'new_tokens'), 1))[0])
except ConfigError as e:
    stop(e)
if compare and reference:
    stop("compare and reference are both set: give one, a setting B (compare) or a command to run "
         "as B (reference)")
if sum(map(bool, (loader, sample, whole))) > 1:
    stop("more than one of loader, sample and whole is set: give one")
if whole and nproc > 1:
    stop(f"whole runs train.py in one process, not nproc={nproc}: time torchrun's command as a "
         f"--reference instead")
# what each measurement reads of bench.py's keys (json: every one): a key given to one that never
# reads it would be taken, and change nothing
READS = {'the step timing': {'bench_iters', 'bench_warmup', 'rounds', 'compare', 'reference',
                             'reference_tokens_per_iter', 'nproc', 'profile', 'trace'},
         '--whole=True': {'rounds', 'compare', 'reference', 'target'},
         '--loader=OUT_DIR': {'bench_iters', 'bench_warmup'},
         '--sample=OUT_DIR': {'new_tokens', 'rounds', 'bench_warmup'}}
mode = ('--whole=True' if whole else '--loader=OUT_DIR' if loader else '--sample=OUT_DIR'
        if sample else 'the step timing')
for key in [arg[2:].partition('=')[0] for arg in bench_args]:
    if key not in READS[mode] | {'json', 'loader', 'sample', 'whole'}:
        stop(f"{key} is read by {' and '.join(m for m in READS if key in READS[m])} only, not by "
             f"{mode}: drop it")
if reference_tokens_per_iter and not reference:
    stop("reference_tokens_per_iter is read only with a reference: add --reference=COMMAND, or "
         "drop it")
if trace and not (profile and nproc == 1):
    stop(f"trace={trace} writes the profile of one process: add --profile=True and --nproc=1, or "
         f"drop it")
train_args = [a for a in sys.argv[1:] if not is_bench_key(a)]
if (loader or sample) and train_args:  # they rebuild what the run used, from its out_dir
    stop(f"{'loader' if loader else 'sample'} reads a run's out_dir and takes no train.py "
         f"arguments: drop {shlex.join(train_args)}")
for key, path in (('json', json), ('trace', trace)):  # known before the runs, not after them
    parent = os.path.dirname(os.path.abspath(path))
    writable = os.path.isdir(parent) and os.access(parent, os.W_OK)
    if path and (os.path.isdir(path) or not writable):
        stop(f"{key}={path} is a folder, or in one that does not exist or cannot be written: name "
             f"a file in a folder of yours")


def own_settings(out_dir, iters, profile_iter):
    """The train.py keys the step timing sets itself: each iteration logged, nothing else run."""
    return dict(out_dir=out_dir, max_iters=iters, eval_interval=iters + 1, eval_iters=1,
                log_interval=1, checkpoint_interval=0, eval_only=False, test_eval=False,
                sample_tokens=0, write_report=False, wandb_log=False, tensorboard_log=False,
                smoke_steps=0, profile_iter=profile_iter)


try:
    settings = {'A': train_args} | ({'B': train_args + shlex.split(compare)} if compare else {})
except ValueError as e:  # an unclosed quote
    stop(f"compare={compare!r} cannot be split into arguments ({e}): quote it as a shell would")
# given on the command line, one of the step timing's own keys would do nothing
given = {arg[2:].partition('=')[0] for args in settings.values() for arg in args}
if not (loader or sample or whole) and (taken := sorted(given & own_settings('', 0, 0).keys())):
    stop(f"the step timing sets {', '.join(taken)} itself: drop "
         f"{'it' if len(taken) == 1 else 'them'}, or time the whole process with --whole=True")
names = list(settings) + (['reference'] if reference else [])
# loader and sample run nothing: a folder only for their default json; the runs' beside json's
folder = None if (loader or sample) and json else tempfile.mkdtemp(
    prefix='bench-', dir=os.path.dirname(os.path.abspath(json)) if json else None)
json = json or os.path.join(folder, 'bench.json')


def train_argv(args, out_dir, iters, profile_iter):
    """train.py's command line: the arguments given, then the bench's own, which win over a
    config file's."""
    return [TRAIN, *args,
            *(f'--{k}={v}' for k, v in own_settings(out_dir, iters, profile_iter).items())]


def run(command, log_path, shell=False):
    """(wall seconds, output, [(seconds since the start, line)]) of a command, start-up included:
    stdout and stderr as one, each line stamped as it came, all of it in log_path. A mistake
    train.py reports (exit code 2) is one line, passed on as it is."""
    start, stamped = time.perf_counter(), []
    # unbuffered: each line comes as it is printed, not when a buffer fills
    with subprocess.Popen(command, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=os.environ | {'PYTHONUNBUFFERED': '1'}) as process:
        for line in process.stdout:
            stamped.append((time.perf_counter() - start, line))
    seconds, output = time.perf_counter() - start, ''.join(line for _, line in stamped)
    with open(log_path, 'w') as f:
        f.writelines(f"{t:8.2f} {line}" for t, line in stamped)
    last_line = output.strip().splitlines()[-1] if output.strip() else ''
    if process.returncode == 2 and not shell and last_line.startswith('error: '):
        stop(last_line.removeprefix('error: '))
    if process.returncode:
        last_lines = '\n'.join(output.strip().splitlines()[-5:])
        stop(f"{command if shell else 'train.py'} failed with exit code {process.returncode}; its "
             f"output ends:\n{last_lines}\n(all of it in {log_path})", 1)
    return seconds, output, stamped


def read_json(path):
    with open(path) as f:
        return load(f)


def remove_checkpoints(out_dir):
    """A run's checkpoints, gone: a big model's take gigabytes a run."""
    paths = glob.glob(os.path.join(out_dir, '*.pt')) + glob.glob(os.path.join(out_dir, 'shards-*'))
    for path in paths:
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def run_ours(name, round):
    """One run of train.py: its iteration times after the warm-up and what it recorded. The first
    round also profiles the iteration after the timed ones."""
    out_dir = os.path.join(folder, f'{name}{round}')
    launcher = [sys.executable] + (['-m', 'torch.distributed.run', '--standalone',
                                    f'--nproc_per_node={nproc}'] if nproc > 1 else [])
    iters = bench_warmup + bench_iters + 1
    profile_iter = iters if profile and round == 1 and nproc == 1 else 0
    wall_seconds, _, _ = run(launcher + train_argv(settings[name], out_dir, iters, profile_iter),
                             out_dir + '.log')
    remove_checkpoints(out_dir)
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        records = [loads(line) for line in f]
    meta = read_json(os.path.join(out_dir, 'meta.json'))
    used = {k: v['value'] for k, v in read_json(os.path.join(out_dir, 'config.json')).items()
            if k != 'resolved'}
    train = [r for r in records if r['kind'] == 'train']
    # one per iteration
    times = [r['time'] for r in records if r['kind'] == 'start'] + [r['time'] for r in train]
    seconds = [end - start for start, end in zip(times, times[1:])]
    peak = meta['peak_flops']['per_process']
    if profile_iter and trace:
        shutil.copy(os.path.join(out_dir, 'trace.json'),
                    f"{os.path.splitext(trace)[0]}_{name}.json" if compare else trace)
    return {'seconds': seconds[bench_warmup:-1], 'first_seconds': seconds[0],
            'wall_seconds': wall_seconds, 'losses': [r['loss'] for r in train],
            'memory_ranks': next(r['ranks'] for r in records if r['kind'] == 'memory'),
            'profile_ms': next((r['ms'] for r in records if r['kind'] == 'profile'), None),
            'tokens_per_iter': (used['gradient_accumulation_steps'] * used['batch_size']
                                * used['block_size']),
            # train.py's MFU is tokens/s * FLOPs per token / (peak * processes): its FLOPs per
            # token, read back
            'flops_per_token': (train[-1]['mfu'] * peak * meta['world_size']
                                / train[-1]['tokens_per_sec']),
            'peak_flops': peak, 'peak_how': meta['peak_flops']['how'],
            'world_size': meta['world_size'], 'device': meta['device'], 'dtype': meta['dtype'],
            'dtype_choice': meta['dtype_choice'], 'cpu': meta['hardware']['cpu'],
            'torch': meta['versions']['torch'], 'compile': used['compile'], 'out_dir': out_dir}


def run_reference(round):
    """One run of the reference command: the times of its iterations after the warm-up, from its log
    lines."""
    log_path = os.path.join(folder, f'reference{round}.log')
    wall_seconds, output, _ = run(reference, log_path, shell=True)
    ms = [float(t) for _, t in ITER_LINE.findall(output)]
    if len(ms) <= bench_warmup:  # exit code 1, so that its log stays
        stop(f"the reference printed {len(ms)} lines like 'iter N: loss X, time Y ms' (its output: "
             f"{log_path}), and the first bench_warmup={bench_warmup} are dropped: run it with "
             f"--log_interval=1 and enough iterations (nanoGPT: "
             f"--max_iters={bench_warmup + bench_iters - 1})", 1)
    return {'seconds': [t / 1e3 for t in ms[bench_warmup:]], 'first_seconds': ms[0] / 1e3,
            'wall_seconds': wall_seconds, 'iters': len(ms),
            # A ran first
            'tokens_per_iter': reference_tokens_per_iter or runs['A'][-1]['tokens_per_iter']}


def summary(setting_runs):
    """A setting's figures over all its runs: the median iteration and each round's tokens/s; for
    ours, the MFU."""
    first, tokens_per_iter = setting_runs[0], setting_runs[0]['tokens_per_iter']
    median = statistics.median(s for run in setting_runs for s in run['seconds'])
    result = {'tokens_per_iter': tokens_per_iter, 'ms_per_iter': median * 1e3,
              'tokens_per_sec': tokens_per_iter / median,
              'round_tokens_per_sec': [tokens_per_iter / statistics.median(run['seconds'])
                                       for run in setting_runs],
              'wall_seconds': statistics.median(run['wall_seconds'] for run in setting_runs),
              'first_seconds': statistics.median(run['first_seconds'] for run in setting_runs),
              'runs': setting_runs}
    if 'peak_flops' in first:  # train.py's
        result |= {k: first[k] for k in ('device', 'dtype', 'dtype_choice', 'world_size', 'compile',
                                         'cpu', 'torch', 'flops_per_token', 'memory_ranks')}
        # the same in every round, unless a round ran faster than the peak and measured it again
        highest = max(setting_runs, key=lambda run: run['peak_flops'])
        result |= {k: highest[k] for k in ('peak_flops', 'peak_how')}
        result['achieved_flops'] = first['flops_per_token'] * result['tokens_per_sec']
        result['mfu'] = result['achieved_flops'] / (highest['peak_flops'] * first['world_size'])
    return result


def measure_loader():
    """Windows/s of the train loader of the run in out_dir loader, from its config.json, timed over
    bench_iters batches after bench_warmup."""
    path = os.path.join(loader, 'config.json')
    try:
        used = {k: v['value'] for k, v in read_json(path).items() if k != 'resolved'}
        block_size, batch_size, num_workers, seed, data_dir, dataset, accum = (used[k] for k in (
            'block_size', 'batch_size', 'num_workers', 'seed', 'data_dir', 'dataset',
            'gradient_accumulation_steps'))
    except OSError as e:
        stop(f"loader={loader}: no config.json there ({e.strerror}): pass the out_dir of a "
             f"train.py run")
    except (ValueError, AttributeError, KeyError, TypeError) as e:  # not JSON, or not train.py's
        stop(f"loader={loader}: {path} is not the config.json of a train.py run "
             f"({type(e).__name__}: {e}): pass the out_dir of one")
    # torch: imported only in the modes that need it, so a mistake in the arguments fails at once
    import data
    import datafiles
    from perf import cpu_name
    try:
        _, shards = datafiles.open_dataset(data_dir, dataset)
        train = data.TokenWindows(shards['train'], block_size)
        sampler = data.TrainSampler(train.num_tokens, block_size, batch_size, batch_size * accum,
                                    seed)
    except data.DataError as e:
        stop(e)
    batches = data.TrainBatches(train, sampler, num_workers, seed, pin_memory=False)
    for _ in range(bench_warmup):
        next(batches)
    start = time.perf_counter()
    for _ in range(bench_iters):
        next(batches)
    seconds = time.perf_counter() - start
    result = {'batches': bench_iters, 'seconds': seconds,
              'windows_per_sec': bench_iters * batch_size / seconds,
              'tokens_per_sec': bench_iters * batch_size * block_size / seconds,
              'batch_size': batch_size, 'block_size': block_size, 'num_workers': num_workers,
              'train_shards': len(shards['train']), 'train_tokens': train.num_tokens}
    print(f"loader on {cpu_name()}: {result['windows_per_sec']:,.0f} windows/s "
          f"({result['tokens_per_sec']:,.0f} tokens/s), {bench_iters} batches of {batch_size} x "
          f"{block_size} with num_workers={num_workers} from {len(shards['train'])} train "
          f"shard(s), {train.num_tokens:,} tokens")
    with open(json, 'w') as f:
        dump({'command': sys.argv, 'cpu': cpu_name(), 'loader': result}, f, indent=1)
    print(f"all figures: {json}")


def measure_sampling():
    """Tokens/s of model.generate() for new_tokens tokens, with the cache and without, one after the
    other in each of `rounds` rounds, after an untimed warm-up of bench_warmup tokens each. Greedy:
    both must give the same tokens."""
    import torch

    import checkpoint
    import sample as sample_py  # its load_model: prefixes stripped, an fsdp run's shards gathered
    from distributed import resolve_device, set_threads
    from perf import cpu_name
    path = os.path.join(sample, 'last.pt')
    if not os.path.isfile(path):
        stop(f"sample={sample}: no last.pt there: pass the out_dir of a train.py run")
    device = resolve_device('auto')[0]
    set_threads(0)  # as sample.py sets them
    try:
        model, saved = sample_py.load_model(path, device)
    except checkpoint.CheckpointError as e:
        stop(e)
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)  # (1, 1)
    load_average = os.getloadavg()[0]
    seconds, tokens = {'cached': [], 'uncached': []}, {}
    for name in seconds:
        model.generate(prompt, bench_warmup, top_k=1, use_cache=name == 'cached')
    for round in range(rounds):
        # A B B A ...: a drift in the load hits both alike
        for name in list(seconds)[::1 if round % 2 == 0 else -1]:
            start = time.perf_counter()
            # tolist() waits for a GPU to finish
            tokens[name] = model.generate(prompt, new_tokens, top_k=1,
                                          use_cache=name == 'cached').tolist()
            seconds[name].append(time.perf_counter() - start)
    result = {name: {'seconds': s, 'tokens_per_sec': new_tokens / statistics.median(s),
                     'round_tokens_per_sec': [new_tokens / t for t in s]}
              for name, s in seconds.items()}
    ratio = result['cached']['tokens_per_sec'] / result['uncached']['tokens_per_sec']
    shape = saved['model_args']
    result |= {'new_tokens': new_tokens, 'model_args': shape, 'device': device, 'ratio': ratio,
               'same_tokens': tokens['cached'] == tokens['uncached'],
               'load_average_before': load_average}
    print(f"sampling on {cpu_name()}, torch {torch.__version__}, {device} float32: {new_tokens} "
          f"new tokens, batch 1, {shape['n_layer']} layers, {shape['n_head']} heads, "
          f"{shape['n_embd']} wide, block {shape['block_size']}, vocab {shape['vocab_size']}; "
          f"median of {rounds} rounds, load average {load_average:.2f} before them")
    for name in seconds:
        per_round = result[name]['round_tokens_per_sec']
        print(f"{name}: {result[name]['tokens_per_sec']:,.1f} tokens/s (rounds "
              f"{min(per_round):,.1f}-{max(per_round):,.1f})")
    print(f"cached/uncached: {ratio:.2f}; the same tokens: {result['same_tokens']}")
    with open(json, 'w') as f:
        dump({'command': sys.argv, 'cpu': cpu_name(), 'torch': torch.__version__, 'sample': result},
             f, indent=1)
    print(f"all figures: {json}")


def run_whole(name, round):
    """One run as a user runs it: the whole process's wall time, each evaluation's val loss with the
    second it was printed, and the first second at which it was at most target."""
    out_dir = os.path.join(folder, f'{name}{round}')
    command = reference if name == 'reference' else [sys.executable, TRAIN, *settings[name],
                                                     f'--out_dir={out_dir}']
    wall_seconds, _, stamped = run(command, out_dir + '.log', shell=name == 'reference')
    remove_checkpoints(out_dir)
    evals = [(t, float(match[1])) for t, line in stamped if (match := VAL_LINE.match(line))]
    return {'wall_seconds': wall_seconds, 'evals': evals, 'out_dir': out_dir,
            'target_seconds': next((t for t, val in evals if val <= target), None)}


def measure_whole():
    """The settings' whole processes in turns, rounds times: wall time, val loss, time to target;
    with two settings, the first's speed over the other's, round by round."""
    print(f"{len(names)} setting(s) run whole, {rounds} round(s) in turns; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; runs in {folder}")
    runs = {name: [] for name in names}
    for round in range(1, rounds + 1):
        for name in names:
            run = run_whole(name, round)
            runs[name].append(run)
            last = f", last val {run['evals'][-1][1]:.4f}" if run['evals'] else ''
            reached = (f", val <= {target} at {run['target_seconds']:.1f} s"
                       if run['target_seconds'] is not None else f", val {target} not reached")
            print(f"round {round}/{rounds}, {name}: the process {run['wall_seconds']:.1f} s{last}"
                  + (reached if target else ''), flush=True)
    import torch  # here: a mistake in the arguments fails at once
    from perf import cpu_name
    report = {'command': sys.argv, 'cpu': cpu_name(), 'torch': torch.__version__, 'rounds': rounds,
              'target': target, 'settings': {name: {'runs': runs[name]} for name in names}}
    for name, setting in report['settings'].items():
        for key in ('wall_seconds', 'target_seconds'):
            times = [run[key] for run in runs[name]]
            setting[key] = statistics.median(times) if None not in times else None
    if len(names) == 2:  # how many times as fast the first is: the other's seconds over its own
        first, other = names
        for key in ('wall_seconds', 'target_seconds'):
            pairs = [(a[key], b[key]) for a, b in zip(runs[first], runs[other])]
            if all(a is not None and b is not None for a, b in pairs):
                ratios = [b / a for a, b in pairs]
                report[f"{key.removesuffix('_seconds')}_speed_ratios"] = ratios
                medians = [report['settings'][name][key] for name in names]
                what = 'whole process' if key == 'wall_seconds' else f'to val {target}'
                print(f"{what}: {first} {medians[0]:.1f} s, {other} {medians[1]:.1f} s (medians); "
                      f"{first} {statistics.median(ratios):.2f}x as fast (rounds "
                      + ', '.join(f'{r:.2f}' for r in ratios) + ')')
    print(f"on {report['cpu']}, torch {report['torch']}")
    with open(json, 'w') as f:
        dump(report, f, indent=1)
    print(f"all figures: {json}")


if loader:
    measure_loader()
    sys.exit(0)
if sample:
    measure_sampling()
    sys.exit(0)
if whole:
    measure_whole()
    sys.exit(0)
load_average = os.getloadavg()[0]
print(f"{len(names)} setting(s), {rounds} round(s) of {bench_warmup} + {bench_iters} iterations, "
      f"{nproc} process(es) per run; load average {load_average:.2f} on {os.cpu_count()} CPUs "
      f"before the runs; runs in {folder}")
print(f"A: train.py {shlex.join(train_args)}" + (f"\nB: A {compare}" if compare else '') +
      (f"\nreference: {reference}" if reference else ''), flush=True)
runs = {name: [] for name in names}
for round in range(1, rounds + 1):
    for name in names:  # a line per run: a run can take minutes (a large model, compilation)
        runs[name].append(run_reference(round) if name == 'reference' else run_ours(name, round))
        print(f"round {round}/{rounds}, {name}: "
              f"{statistics.median(runs[name][-1]['seconds']) * 1e3:.1f} "
              f"ms/iter, the process {runs[name][-1]['wall_seconds']:.0f} s", flush=True)
results = {name: summary(runs[name]) for name in names}
report = {'command': sys.argv, 'cpu': runs['A'][0]['cpu'], 'torch': runs['A'][0]['torch'],
          'cpu_count': os.cpu_count(), 'load_average_before': load_average,
          'bench_iters': bench_iters, 'bench_warmup': bench_warmup, 'rounds': rounds,
          'nproc': nproc, 'settings': results}
if len(names) == 2:  # B over A, or ours over the reference
    over, under = ('A', 'reference') if reference else ('B', 'A')
    per_round = [a / b for a, b in zip(results[over]['round_tokens_per_sec'],
                                       results[under]['round_tokens_per_sec'])]
    report['ratio'] = {'of': f'{over}/{under}',
                       'tokens_per_sec': (results[over]['tokens_per_sec']
                                          / results[under]['tokens_per_sec']),
                       'rounds': per_round}
profiles = {name: runs[name][0]['profile_ms'] for name in settings if runs[name][0]['profile_ms']}
if profiles:
    report['profile'] = {name: {'iteration_ms': sum(ms.values()), 'ms': ms,
                                'shares': {p: t / sum(ms.values()) for p, t in ms.items()}}
                         for name, ms in profiles.items()}

print(f"\non {report['cpu']}, torch {report['torch']}: median of {rounds} x {bench_iters} "
      f"iterations per setting")
for name, r in results.items():
    print(f"{name}: {r['ms_per_iter']:.1f} ms/iter, {r['tokens_per_sec']:,.0f} tokens/s (rounds "
          f"{min(r['round_tokens_per_sec']):,.0f}-{max(r['round_tokens_per_sec']):,.0f}) at "
          f"{r['tokens_per_iter']:,} tokens/iter; whole process {r['wall_seconds']:.1f} s, first "
          f"iteration {r['first_seconds']:.2f} s")
    if name == 'reference':
        continue
    print(f"   {r['device']} {r['dtype']}, {'compiled' if r['compile'] else 'eager'}, "
          f"{r['world_size']} process(es): MFU {r['mfu']:.1%}, {r['achieved_flops'] / 1e9:,.2f} "
          f"GFLOP/s ({r['flops_per_token'] / 1e6:,.2f} MFLOP/token) of "
          f"{r['peak_flops'] / 1e9:,.1f} per process ({r['peak_how']}); loss "
          f"{r['runs'][0]['losses'][-1]:.4f} at iteration {len(r['runs'][0]['losses'])}")
    for rank, held in enumerate(r['memory_ranks']):
        print(f"   rank {rank} holds weights {held['weights_mb']:,.2f} MB, grads "
              f"{held['grads_mb']:,.2f} MB, optimizer state {held['optimizer_mb']:,.2f} MB; peak "
              f"memory {held['peak_mb']:,.0f} MB after the first iteration")
    if name in report.get('profile', {}):
        p = report['profile'][name]
        print(f"   profile of one iteration ({p['iteration_ms']:.1f} ms): "
              + ', '.join(f"{k} {v:.1%}" for k, v in p['shares'].items()))
if 'ratio' in report:
    ratio = report['ratio']
    print(f"tokens/s {ratio['of']}: {ratio['tokens_per_sec']:.3f} (rounds "
          f"{min(ratio['rounds']):.3f}-{max(ratio['rounds']):.3f})")
if profile and nproc > 1:
    print(f"no profile: it needs one process, and this ran {nproc} (nproc=1 profiles)")
with open(json, 'w') as f:
    dump(report, f, indent=1)
print(f"all figures: {json}")
