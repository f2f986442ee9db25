"""
A run's records in out_dir, written by rank 0 alone: train.log (every line the run printed),
metrics.jsonl (one JSON record per event: start, train, eval, test, memory, abort, stop, ...),
config.json (each key, its value and where it came from), meta.json (command, git SHA, seed,
versions, hardware, data), and TensorBoard event files and Weights & Biases when asked. log() prints
a line and keeps it; record() keeps a metrics record everywhere it goes. Until start() nothing is
kept: a run that stops at a mistake writes nothing. How a run ends before its last iteration:
exits.py.
"""
import atexit
import errno
import fcntl
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

import checkpoint
import distributed
import perf
import report

LOGS = ('metrics.jsonl', 'train.log')
# rank 0 (torchrun sets RANK; one process is rank 0): the other ranks print and write nothing
master = int(os.environ.get('RANK', 0)) == 0
run_dir, with_report = None, False  # set by start()
files = {}  # LOGS, open for appending once start() has run
early_lines = []  # logged before start() opened train.log: it begins with them
tensorboard = None  # a SummaryWriter when asked
wandb = None  # the wandb module when asked
lock_file = None  # out_dir/.lock, held while the run goes on (lock)


def log(message, stream=None):
    """Rank 0 prints (on stdout, or stream: sys.stderr), and train.log gets the same line: once
    the run folder is open, or when it opens (a refused run writes nothing)."""
    if master:
        print(message, file=stream or sys.stdout, flush=True)
        if files:
            files['train.log'].write(message + '\n')
            files['train.log'].flush()
        elif run_dir is None:
            early_lines.append(message)


def progress(items, label, total=None, every=10.0):
    """items (total of them: len(items) if not given), passed through, while rank 0 says how far it
    has got once they take long: nothing for the first `every` seconds, then every `every` seconds a
    line (log()) or, on a terminal, a bar redrawn in place. No host sync: it counts what it hands
    on."""
    total = len(items) if total is None else total
    start = last = time.time()
    terminal = master and sys.stdout.isatty()
    try:
        for done, item in enumerate(items, 1):
            yield item
            if master and time.time() - last >= every:
                last = time.time()
                if terminal:
                    bar = '#' * (20 * done // total)
                    print(f"\r{label}: [{bar:<20}] {done}/{total}, {last - start:.0f} s", end='',
                          flush=True)
                else:
                    log(f"{label}: {done}/{total} in {last - start:.0f} s")
    finally:
        if terminal and last > start:
            print()  # the redrawn line ends, also where the loop did not


def log_pieces(pieces):
    """log() of one message given in pieces as they come (a sample's text, token by token)."""
    for piece in pieces:
        if master:
            print(piece, end='', flush=True)
            if files:
                files['train.log'].write(piece)
    log('')


def record(entry):
    """One metrics.jsonl line (entry: a dict with 'kind' and 'step'); its numbers also go to
    TensorBoard and wandb as KIND/KEY at that step; none before start() (eval_only's run)."""
    if not (master and files):
        return
    files['metrics.jsonl'].write(json.dumps(entry) + '\n')
    files['metrics.jsonl'].flush()
    numbers = {f"{entry['kind']}/{k}": v for k, v in entry.items()
               if k not in ('step', 'time') and isinstance(v, (int, float))
               and not isinstance(v, bool)}
    if tensorboard:
        for name, value in numbers.items():
            tensorboard.add_scalar(name, value, entry['step'])
    if wandb:
        wandb.log(numbers, step=entry['step'])


def duration(seconds):
    """A time left as a person reads it, in the same units wherever the log says one: s, min, h or
    days."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 72 * 3600 else f"{seconds / 86400:,.1f} days"


def log_bytes():
    """How far each log has got: a checkpoint records it, and a resume cuts the logs back to it."""
    return {name: f.tell() for name, f in files.items()}


def missing_package(config):
    """The line that says a logger config asks for (tensorboard_log, wandb_log) is not installed, or
    '': preflight.settings asks before start() writes anything."""
    for key, package in (('tensorboard_log', 'tensorboard'), ('wandb_log', 'wandb')):
        if config[key] and not importlib.util.find_spec(package):
            return (f"{key}=True needs the {package} package: pip install {package}, or set "
                    f"{key}=False")
    return ''


def start(out_dir, resumed, config, sources, session, num_params, flops_per_token):
    """Every rank calls it once the settings, data and checkpoint are known to be good. Rank 0
    creates out_dir, opens the logs for appending, writes config.json (with the device and dtype
    'auto' resolved to) and meta.json (session: seed, dtype, device, data, ...), and starts
    TensorBoard and wandb where config asks. Returns '' once that is done, after the 'start' record
    and the lines that say what this session is. An out_dir that cannot be written on rank 0:
    nothing is announced, and every rank returns a line that says so (rank 0's names the error), for
    train.py to stop them all with, together. resumed: (path, checkpoint) of the one the run
    resumes from, or None."""
    unwritable = open_run(out_dir, resumed, config, sources, session) if master else None
    if distributed.any_rank(unwritable, session['device']):
        return unwritable or "out_dir cannot be written on rank 0"
    announce(session, config, resumed, num_params, flops_per_token)
    return ''


def open_run(out_dir, resumed, config, sources, session):
    """Rank 0's part of start(): returns None, or the line that says out_dir cannot be written.
    Resumed from a checkpoint in out_dir (wherever the folder was when it was written: it may have
    been moved), the logs keep what it had logged and lose what came after, since those steps are
    redone; otherwise they are cut whole: out_dir holds no checkpoint then (preflight refuses one
    of another folder into a used out_dir), so they are of a run stopped before its first one (a
    smoke test that failed), which this one is not. Temp files a killed save left are dropped:
    never read, safe to remove. Resumed from a checkpoint of out_dir, checkpoint.branch makes its
    checkpoints those of the run as it now goes on."""
    global run_dir, with_report, tensorboard, wandb
    run_dir, with_report = out_dir, config['write_report']
    here = resumed and os.path.realpath(os.path.dirname(resumed[0])) == os.path.realpath(out_dir)
    keep_bytes = resumed[1]['log_bytes'] if here else {}
    try:
        os.makedirs(out_dir, exist_ok=True)
        if not lock(out_dir):
            return held_by_another(out_dir)
        if here:  # last.pt too: a kill may leave a kept checkpoint or stable.pt past it
            moved, replaced = checkpoint.branch(out_dir, *resumed)
            if moved:
                log(f"moved {', '.join(moved)} into {os.path.join(out_dir, replaced)}: the "
                    f"continuation after iteration {resumed[1]['iter_num']} this session replaces")
        cut_logs(out_dir, keep_bytes)
        for name in LOGS:
            files[name] = open(os.path.join(out_dir, name), 'a')
        atexit.register(close_logs)  # on every way out: a file left to the garbage collector warns
        files['train.log'].write(''.join(line + '\n' for line in early_lines))
        for path in glob.glob(os.path.join(glob.escape(out_dir), '*.tmp')):
            os.remove(path)
        settings = {k: {'value': config[k], 'source': sources[k]} for k in config}
        resolved = {'device': session['device'], 'dtype': session['dtype']}
        checkpoint.write_json(os.path.join(out_dir, 'config.json'),
                              settings | {'resolved': resolved})
        write_meta(out_dir, session)
        if config['tensorboard_log']:
            from torch.utils.tensorboard import SummaryWriter
            tensorboard = SummaryWriter(os.path.join(out_dir, 'tensorboard'))
    except OSError as e:
        return f"out_dir '{out_dir}' cannot be written ({e.strerror or e}): pick a writable out_dir"
    if config['wandb_log'] and config['wandb_project']:
        import wandb as wandb_module
        wandb = wandb_module
        wandb.init(project=config['wandb_project'], name=config['wandb_run_name'], config=config,
                   resume='allow')


def lock(out_dir):
    """Whether this process now holds out_dir's lock, for as long as it runs: no other run writes
    there meanwhile (a scheduler's second start, torchrun workers a killed agent left). A POSIX
    lock: the process's own, not its forked loader workers', and gone with it however it ends."""
    global lock_file
    lock_file = open(os.path.join(out_dir, '.lock'), 'a')
    atexit.register(lock_file.close)  # at exit, after the logs (registered before them)
    return lock_taken(lock_file)


def in_use(out_dir):
    """The line that says another process holds out_dir's lock (lock's), or ''. Looked at before
    anything is built (preflight), so that a scheduler's second start is one line; lock() takes it
    for good. Opened without creating it: a run refused later leaves no file."""
    try:
        fd = os.open(os.path.join(out_dir, '.lock'), os.O_WRONLY)
    except OSError:  # none yet (or out_dir is no folder: preflight says so)
        return ''
    with os.fdopen(fd, 'w') as f:  # closed: the lock taken to look is let go
        return '' if lock_taken(f) else held_by_another(out_dir)


def held_by_another(out_dir):
    return (f"out_dir '{out_dir}' is in use: another run writes there now (it holds "
            f"{os.path.join(out_dir, '.lock')}): let it end, or use another out_dir")


def lock_taken(f):
    """Whether this process now holds the POSIX lock of the open file f."""
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:  # held by another process; a filesystem without locks holds none
        return e.errno not in (errno.EACCES, errno.EAGAIN)
    return True


def cut_logs(out_dir, keep_bytes):
    """Cuts each log in out_dir to keep_bytes[name] bytes (0 where it names none)."""
    for name in LOGS:
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            os.truncate(path, min(os.path.getsize(path), keep_bytes.get(name, 0)))


def close_logs():
    for f in files.values():
        f.close()
    files.clear()  # a line logged after this is printed only
    if tensorboard:  # its last events are buffered until then
        tensorboard.close()


def announce(session, config, resumed, num_params, flops_per_token):
    """The 'start' record, and the lines that say what this session is (session: meta.json's): where
    it starts from, the model's size, the device, dtype and processes, the tokens per iteration, and
    the peak FLOP/s that MFU is measured against, with the least time the iterations left can take
    at it (before the smoke test: a CPU given GPT-2's shape learns it is years at once); what was
    migrated of a checkpoint of an older format; what a resume on another number of processes
    cannot restore."""
    step = resumed[1]['iter_num'] if resumed else 0
    # changed: the settings this session's command changed from the checkpoint's (verify.py)
    record({'kind': 'start', 'step': step, 'time': time.time(),
            'world_size': session['world_size'],
            'changed': sorted(session['changed_on_resume'] or {})})
    pretrained, peak = session['pretrained'], session['peak_flops']
    start_point = f"resuming from {session['resumed_from']}" if resumed else \
        f"starting from {pretrained['weights'] if pretrained else 'scratch'}"
    accum, batch, block = (config[k]
                           for k in ('gradient_accumulation_steps', 'batch_size', 'block_size'))
    log(f"{start_point}: {num_params / 1e6:.2f}M parameters, {session['device']} "
        f"{session['dtype']}, {session['world_size']} process(es), {accum * batch * block:,} "
        f"tokens per iteration ({accum} x {batch} x {block})")
    # every process at its peak: no iteration is faster
    least = (flops_per_token * accum * batch * block
             / (peak['per_process'] * session['world_size']))
    left = config['max_iters'] - step
    at_least = (f"; at it an iteration takes at least {least:.3g} s, the {left:,} left at least "
                f"{duration(least * left)}" if left > 0 else '')  # none: a finished run's end
    log(f"MFU is measured against {peak['per_process'] / 1e9:,.1f} GFLOP/s per process "
        f"({peak['how']}){at_least}")
    if resumed and 'migrated' in resumed[1]:  # from an older format, by checkpoint.load
        log(resumed[1]['migrated'])
    if busy := distributed.busy_warning(torch.get_num_threads(), session['cpus']):
        log(busy, sys.stderr)
    if resumed:
        changed = [f"{k} {old!r} -> {new!r} ({source})"
                   for k, (old, new, source) in session['changed_on_resume'].items()]
        log(f"settings changed since the checkpoint's run: {', '.join(changed) or 'none'}")
    if resumed and len(resumed[1]['rng']) != session['world_size']:
        log(f"the checkpoint was written by {len(resumed[1]['rng'])} process(es): the data "
            f"continues where it stopped, but dropout draws new random streams, so this is not "
            f"bitwise the run that would have continued")


def train(step, figures, speed, log_interval):
    """After each iteration: once, the start-up estimate (speed: the run's perf.Speedometer); every
    log_interval iterations and at the last, the 'train' record of the step's figures (loss, lr,
    grad_norm, skips, scale, epoch) with the speed since the last line and the time left, and its
    line; a step that beat the peak FLOP/s measured at start, and an idle device, each a line."""
    seconds_per_iter, left = speed.startup_estimate(), speed.max_iters - step
    if seconds_per_iter is not None:
        estimate(step, seconds_per_iter, speed.accum_steps, left)
    if step % log_interval and step != speed.max_iters:
        return
    interval = speed.interval(step)
    if interval['new_peak']:  # MFU is against it from here on
        new_peak(step, *interval['new_peak'])
    entry = {'kind': 'train', 'step': step, 'time': time.time(), **figures,
             **{k: interval[k] for k in ('tokens_per_sec', 'mfu', 'utilization', 'eta_seconds')},
             'peak_mem_mb': perf.peak_memory_mb(speed.device)}
    record(entry)
    utilization, eta = entry['utilization'], entry['eta_seconds']
    log(f"iter {step}/{speed.max_iters}: loss {entry['loss']:.4f}, lr {entry['lr']:.3e}, "
        f"grad norm {entry['grad_norm']:.3f}, {entry['tokens_per_sec']:,.0f} tok/s, "
        f"MFU {entry['mfu']:.1%}, {'' if utilization is None else f'util {utilization:.0%}, '}"
        f"mem {entry['peak_mem_mb']:,.0f} MB, ETA {'?' if eta is None else duration(eta)}"
        f"{', step skipped (float16 overflow)' if entry['skipped'] else ''}")
    if interval['idle_warning']:  # advice, not a fault of the run
        log(interval['idle_warning'])


def evaluation(progress, figures, tasks_line, best_by, improved):
    """At each evaluation: the 'eval' record of its figures (train_loss, val_loss, ema_val_loss, the
    tasks' accuracies, the seconds it took), best_val_loss and val_bits_per_token, and its line
    with the best so far by best_by (progress: the run's checkpoint.Progress). tasks_line:
    evaluate.tasks_line's; improved: this evaluation set the best."""
    train_loss, val_loss, ema_val = (figures['train_loss'], figures['val_loss'],
                                     figures['ema_val_loss'])
    record({'kind': 'eval', 'step': progress.iter_num, 'time': time.time(), **figures,
            'best_val_loss': progress.best_val_loss, 'val_bits_per_token': val_loss / math.log(2)})
    best = progress.best_val_loss if best_by == 'val_loss' else progress.best_acc_norm
    log(f"eval {progress.iter_num}: train {train_loss:.4f}, val {val_loss:.4f} "
        f"(gap {val_loss - train_loss:+.4f})"
        f"{'' if ema_val is None else f', EMA val {ema_val:.4f}'}"
        f"{tasks_line}, best {best:.4f} at {progress.best_iter}"
        f"{' *saved best.pt' if improved else ''}")


def estimate(step, seconds_per_iter, accum_steps, left):
    """Once, from the session's first micro-batches (perf.Speedometer.startup_estimate): the
    'estimate' record and the line that says how long the left iterations will take."""
    record({'kind': 'estimate', 'step': step, 'seconds_per_iter': seconds_per_iter})
    log(f"a micro-batch after the first took {seconds_per_iter / accum_steps:.2f} s: about "
        f"{seconds_per_iter:.2f} s per iteration, {duration(seconds_per_iter * left)} for the "
        f"{left} left")


def new_peak(step, flops, how):
    """A step ran faster than the peak FLOP/s measured at start, which other work on the machine had
    slowed: the 'peak' record, a line, and meta.json's peak_flops (what MFU is measured against from
    here on)."""
    record({'kind': 'peak', 'step': step, 'flops': flops, 'how': how})
    log(f"iteration {step} ran faster than the peak FLOP/s measured at start (other work was "
        f"running then): measured again, {flops / 1e9:,.1f} GFLOP/s per process ({how}); MFU is "
        f"against it from here on")
    if master:
        path = os.path.join(run_dir, 'meta.json')
        with open(path) as f:
            meta = json.load(f)
        checkpoint.write_json(path, meta | {'peak_flops': {'per_process': flops, 'how': how}})


def done(progress, best_by, figures, first_iter):
    """The end of a run that completed: the 'test' record and the line that sums it up. The record
    holds the step, best_iter and best_by (best.pt's iteration and what chose it), best_val_loss
    (its val loss) and best_acc_norm (its tasks' mean acc_norm, best_by='acc_norm'), from progress
    (the run's checkpoint.Progress), and the figures: ema (whether those are the EMA's), test_loss
    or None, test_windows (how many windows it took of how many in the split: eval_iters') and
    tested_iter (the iteration of the weights it and the sample took), wall_seconds
    and the eval_seconds and save_seconds within it, of this session, and total_seconds of every
    session. first_iter: the iteration this session started from (0 unless it resumed). Returns
    the words that name the weights tested ('the best weights'), for the sample's line."""
    test = {'kind': 'test', 'step': progress.iter_num, 'best_iter': progress.best_iter,
            'best_by': best_by, 'best_val_loss': progress.best_val_loss,
            'best_acc_norm': progress.best_acc_norm if best_by == 'acc_norm' else None, **figures}
    record(test)
    step, seconds, test_loss = test['step'], test['wall_seconds'], test['test_loss']
    every_session = f"all {step} iterations in {test['total_seconds']:.0f} s over every session"
    if not first_iter:
        sessions = f"{step} iterations in {seconds:.0f} s"
    elif first_iter == step:  # a finished run started again: only its end was redone
        sessions = f"no iterations left, {every_session}"
    else:
        sessions = f"iterations {first_iter + 1}-{step} in {seconds:.0f} s, {every_session}"
    weights = 'the best weights' if test['tested_iter'] == test['best_iter'] else 'the last weights'
    if test['tested_iter'] != test['best_iter'] and test['best_iter']:
        weights += f" (out_dir has no best.pt of iteration {test['best_iter']})"
    tested = '' if test_loss is None else \
        (f", test loss {test_loss:.4f} ({test_loss / math.log(2):.3f} bits/token) on "
         f"{report.windows_of(test['test_windows'])} with {weights}")
    whose = ' (the EMA of the weights)' if test['ema'] else ''
    best = (f"best val loss{whose} {test['best_val_loss']:.4f} at iteration {test['best_iter']}"
            if test['best_by'] == 'val_loss' else
            f"best acc_norm{whose} {test['best_acc_norm']:.4f} at iteration {test['best_iter']}, "
            f"val loss{whose} {test['best_val_loss']:.4f} there")
    log(f"done: {sessions} (evaluations {test['eval_seconds'] / seconds:.1%} and checkpoint "
        f"saves {test['save_seconds'] / seconds:.1%} of this session), {best}{tested}; "
        f"checkpoints in {run_dir}")
    return weights


def finish():
    """report.md and curves.png, rebuilt from the run's files (report.py), when asked."""
    if master and with_report:
        try:
            report.write_report(run_dir)
        except OSError as e:
            # a full disk: the run's files are whole, and python report.py OUT_DIR writes it later
            return log(f"no report ({e.strerror}): python report.py {run_dir} writes it once there "
                       f"is room")
        except report.ReportError as e:  # a line damaged outside this run (an earlier session's)
            return log(f"no report: {e} (python report.py {run_dir})")
        log(f"report: {os.path.join(run_dir, 'report.md')} and curves.png")


def write_meta(out_dir, run):
    """meta.json: what this session of the run is (run: seed, dtype, device, data, ...) and the
    code, software and machine it ran on."""
    sha, dirty = git_state()
    checkpoint.write_json(os.path.join(out_dir, 'meta.json'), {
        'command': sys.argv, 'start_time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), 'git_sha': sha,
        'git_dirty': dirty, **run,
        'versions': {'python': platform.python_version(), 'torch': torch.__version__,
                     'numpy': np.__version__,
                     **{p: importlib.metadata.version(p) for p in ('tiktoken', 'safetensors')}},
        'hardware': {'platform': platform.platform(), 'cpu': perf.cpu_name(),
                     'cpu_count': os.cpu_count(), 'torch_threads': torch.get_num_threads(),
                     'cuda_devices': [torch.cuda.get_device_name(i)
                                      for i in range(torch.cuda.device_count())],
                     'gpu': perf.gpu_info(run['device'])},
    })


def git_state(repo=os.path.dirname(os.path.abspath(__file__))):
    """(commit SHA, whether the work tree has uncommitted or untracked changes) of the code in repo
    (this code's, by default), or ('unknown', None) outside a git repository."""
    try:
        sha = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        status = subprocess.run(['git', 'status', '--porcelain'], cwd=repo, capture_output=True,
                                text=True).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        return 'unknown', None
