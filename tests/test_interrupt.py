"""Preemption as clusters and terminals deliver it: SIGTERM or Ctrl-C ends the run after the step
under way with a whole last.pt, and the resumed run is bitwise the run that was never
interrupted."""
import contextlib
import fcntl
import json
import os
import signal
import time

import pytest
import torch

import forked
from conftest import (PROBE, RUN_CONFIG, ok, read_metrics, run_trains, torchrun, torchrun_started,
                      wait_for_stderr)

# training runs in subprocesses: the 'not slow' tier skips them; signals reach fresh interpreters,
# as users' runs are (forking(): runs no signal reaches, and torchrun, which passes a signal on)
pytestmark = [pytest.mark.slow, pytest.mark.fresh]

# dropout and loader workers on: the RNG streams and the loader position must both survive the stop
ARGS = ['--max_iters=200', '--lr_decay_iters=200', '--eval_interval=100', '--dropout=0.1',
        '--num_workers=1']


def trajectory(out_dir):
    return [(r['step'], r['loss'], r['lr'], r['grad_norm']) for r in read_metrics(out_dir, 'train')]


def reached(out_dir, step):
    """Whether metrics.jsonl has a training record at or past step."""
    try:
        with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
            return any(json.loads(line).get('step', 0) >= step for line in f if line.endswith('\n')
                       and '"train"' in line)
    except FileNotFoundError:
        return False


def wait_for_step(out_dir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if reached(out_dir, step):
            return
        time.sleep(0.05)
    raise AssertionError(f"{out_dir} never reached step {step}")


def start(cmd, env=None):
    # a session of its own, as a terminal's foreground job: killpg reaches the loader workers as
    # Ctrl-C does
    return forked.Process(*cmd, env=env, new_session=True)


@contextlib.contextmanager
def forking():
    """Runs started inside fork as the suite's other runs do (tests/forked.py): about 3 CPU-seconds
    of imports fewer a process. For those no signal reaches (the straight runs, the resumes), and
    torchrun and its ranks: torchrun's handler passes the signal on, as a fresh one's does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forked, 'FRESH', os.environ.get('HONESTGPT_TEST_FRESH') == '1')
        yield


def train_cmd(out_dir, data_dir, *args):
    return ['train.py', RUN_CONFIG, f'--data_dir={data_dir}', f'--out_dir={out_dir}', *args]


def test_sigterm_ctrl_c_and_sigkill_then_resume_bitwise(tmp_path, data_dir):
    # SIGTERM: a cluster's notice; SIGINT to the process group: Ctrl-C; SIGKILL: no notice, so only
    # what checkpoint_interval saved between evaluations (every 25 iterations, evaluations every
    # 100) survives. The straight run and the three interrupted ones run side by side, then the
    # three resumes.
    cases = {signal.SIGTERM: (143, 60, []), signal.SIGINT: (130, 90, []),
             signal.SIGKILL: (-9, 130, ['--checkpoint_interval=25'])}
    straight = str(tmp_path / 'straight')
    with forking():
        procs = {None: start(train_cmd(straight, data_dir, *ARGS))}
    outs = {signum: str(tmp_path / signal.Signals(signum).name) for signum in cases}
    procs |= {signum: start(train_cmd(outs[signum], data_dir, *ARGS, *extra))
              for signum, (_, _, extra) in cases.items()}
    waiting, deadline = dict(cases), time.time() + 120
    # signal each run as soon as it passes its step: they all run at once
    while waiting and time.time() < deadline:
        for signum in list(waiting):
            if reached(outs[signum], waiting[signum][1]):
                if signum == signal.SIGINT:
                    # Ctrl-C reaches the whole group: the training process and its workers
                    procs[signum].send_signal(signum, group=True)
                else:
                    # a cluster's SIGTERM goes to the job's main process
                    procs[signum].send_signal(signum)
                del waiting[signum]
        time.sleep(0.02)
    assert not waiting, waiting
    for signum, (code, at, extra) in cases.items():
        out, proc = outs[signum], procs[signum]
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == code, stderr
        last = torch.load(os.path.join(out, 'last.pt'), weights_only=True)
        if signum == signal.SIGKILL:
            assert (last['iter_num'] % 25 == 0 and last['iter_num'] > 100
                    and not read_metrics(out, 'stop'))
        else:
            stop = read_metrics(out, 'stop')
            assert (len(stop) == 1 and stop[0]['signal'] == signal.Signals(signum).name
                    and stop[0]['step'] > at)
            assert last['iter_num'] == stop[0]['step'] == trajectory(out)[-1][0]
            line = next(l for l in stdout.splitlines()
                        if l.startswith(f"stopped by {signal.Signals(signum).name}"))
            resume = line.split('resume with: ')[1]
            assert (resume.startswith('python train.py')
                    and resume.endswith('--init_from=resume')), line
    with forking():
        resumes = [start(train_cmd(outs[signum], data_dir, *ARGS, *extra, '--init_from=resume'))
                   for signum, (_, _, extra) in cases.items()]
    for proc in [procs[None], *resumes]:
        stderr = proc.communicate(timeout=300)[1]
        assert proc.returncode == 0, stderr
    for out in outs.values():
        assert trajectory(out) == trajectory(straight)


@pytest.mark.parametrize('first', [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_after_a_stop_signal_exits_at_once_with_whole_checkpoints(tmp_path, data_dir,
                                                                          first):
    out = str(tmp_path / 'run')
    # the third write of last.pt (iteration 3) stops before its rename (tests/probe.py): the first
    # signal waits for an iteration that does not end, however fast this CPU, and the Ctrl-C comes
    # once the first has been heard, in a kernel of minutes where no Python handler can run
    proc = start([PROBE, *train_cmd(out, data_dir, *ARGS, '--checkpoint_interval=1')],
                 env={**os.environ, 'PROBE_HOLD_SAVE': '3:kernel'})
    wait_for_stderr(proc, 'probe: holding the write of')
    proc.send_signal(first, group=first == signal.SIGINT)
    wait_for_stderr(proc, f'{first.name}: saving last.pt after the iteration under way')
    wait_for_stderr(proc, 'probe: in a long kernel')
    proc.send_signal(signal.SIGINT, group=True)
    proc.communicate(timeout=30)
    # no save-and-stop: killed by the Ctrl-C at once (a shell says 130)
    assert proc.returncode == -signal.SIGINT and not read_metrics(out, 'stop')
    # whole, and the one before the write that was under way
    assert torch.load(os.path.join(out, 'last.pt'), weights_only=True)['iter_num'] == 2


# FSDP: its shards of iteration 0 hold no optimizer state, which a resume must not look for
@pytest.mark.parametrize('ranks', [1, 2])
def test_a_stop_during_the_smoke_test_stops_the_run_before_its_first_step(tmp_path, data_dir,
                                                                          ranks):
    # its first micro-batches take 2 s each (a large model's take minutes): SIGTERM, sent as it
    # begins, ends it after its first step with last.pt holding the state before it (the smoke
    # step undone); the resume takes the smoke test and is the run never stopped
    out, straight = str(tmp_path / 'run'), str(tmp_path / 'straight')
    iters = 30 if ranks == 1 else 6
    # float32: dtype='auto' would time forwards, and the probe count them, before the smoke test
    args = [*ARGS, '--smoke_steps=30', f'--max_iters={iters}', f'--lr_decay_iters={iters}',
            '--dtype=float32']
    if ranks == 1:
        proc = start([PROBE, *train_cmd(out, data_dir, *args)],
                     env={**os.environ, 'PROBE_SLEEP': '1-3:2'})
    else:
        args += ['--parallel=fsdp', '--gradient_accumulation_steps=2']
        with forking():  # the signal goes to torchrun, which passes it on
            proc = torchrun_started(PROBE, *train_cmd(out, data_dir, *args),
                                    env_extra={'PROBE_SLEEP': '1-1:2'})
    for rank in range(ranks):  # in its first micro-batch, with its handlers: a rank still
        wait_for_stderr(proc, f'probe: rank {rank} sleeps in micro-batch 1')  # starting dies
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    # torchrun says the signal ended it
    assert proc.returncode != 0 if ranks == 2 else proc.returncode == 143, stderr
    assert 'smoke test: a stop signal after 1 steps' in stdout, stdout
    assert torch.load(os.path.join(out, 'last.pt'), weights_only=True)['iter_num'] == 0
    assert [r['step'] for r in read_metrics(out, 'stop')] == [0]
    assert not read_metrics(out, 'train') and not read_metrics(out, 'smoke')
    with forking():
        if ranks == 1:
            run_trains(data_dir, (out, [*args, '--init_from=resume']), (straight, args))
        else:
            ok(torchrun(out, data_dir, *args, '--init_from=resume'))
            ok(torchrun(straight, data_dir, *args))
    assert [r['passed'] for r in read_metrics(out, 'smoke')] == [True]
    assert trajectory(out) == trajectory(straight) and len(trajectory(out)) == iters


def test_a_stop_after_the_last_step_leaves_the_end_to_init_from_auto(tmp_path, data_dir):
    # SIGTERM while the last evaluation's save of last.pt is held (tests/probe.py): the run stops
    # there, not after its test split and sample, and the command it prints is init_from=auto's
    # (resume refuses a run at max_iters), which does only the end
    out = str(tmp_path / 'run')
    args = [*ARGS, '--max_iters=10', '--lr_decay_iters=10', '--eval_interval=10',
            '--test_eval=True', '--sample_tokens=8', '--write_report=True']
    proc = start([PROBE, *train_cmd(out, data_dir, *args)],
                 env={**os.environ, 'PROBE_HOLD_SAVE': '1'})
    wait_for_stderr(proc, 'probe: holding the write of')
    # a run holds out_dir's lock while it goes on: a second run there would be refused
    with open(os.path.join(out, '.lock'), 'a') as lock, pytest.raises(OSError):
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert [r['step'] for r in read_metrics(out, 'stop')] == [10] and not read_metrics(out, 'test')
    resume = stdout.split('resume with: ')[1].splitlines()[0]
    assert resume.endswith(' --init_from=auto'), resume
    assert 'last.pt holds it, its end (test split, sample) left' in open(
        os.path.join(out, 'report.md')).read()
    with forking():
        end = start(train_cmd(out, data_dir, *args, '--init_from=auto'))
    stdout, stderr = end.communicate(timeout=120)
    assert end.returncode == 0, stderr
    assert len(read_metrics(out, 'test')) == 1 and len(trajectory(out)) == 10


def test_a_stop_during_the_end_ends_the_process_at_once(tmp_path, data_dir):
    # the end saves nothing: a sample of a billion tokens must not hold off a cluster's SIGTERM
    out = str(tmp_path / 'run')
    args = [*ARGS, '--max_iters=8', '--lr_decay_iters=8', '--eval_interval=8',
            '--sample_tokens=1000000000']
    proc = start(train_cmd(out, data_dir, *args))
    log, deadline = os.path.join(out, 'train.log'), time.time() + 120
    while not (os.path.exists(log) and 'done: ' in open(log).read()):  # then the sample
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM


def test_ctrl_c_ends_an_eval_only_run_at_once(tmp_path, data_dir):
    # nothing to save: the process ends as Ctrl-C ends a program (it printed a KeyboardInterrupt
    # traceback of 50 lines)
    out = str(tmp_path / 'run')
    with forking():
        ok(forked.run(*train_cmd(out, data_dir, *ARGS, '--max_iters=2', '--eval_interval=2')))
    proc = start([PROBE, *train_cmd(out, data_dir, *ARGS, '--eval_only=True',
                                    '--init_from=resume')],
                 env={**os.environ, 'PROBE_SLEEP_EVAL': '60'})
    wait_for_stderr(proc, 'probe: rank 0 sleeps in an evaluation')
    proc.send_signal(signal.SIGINT, group=True)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT and 'Traceback' not in stderr, stderr


def test_a_stop_at_an_early_stop_leaves_the_end_to_init_from_auto(tmp_path, data_dir):
    # learning_rate 0: the evaluation at 10 is no better than 5's, and patience=1 ends the run
    # there. A SIGTERM while that save is held stops the run as at max_iters: its end (test split,
    # sample) is init_from=auto's, which does only that. It went on to the end
    out = str(tmp_path / 'run')
    args = [*ARGS, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=5', '--patience=1',
            '--learning_rate=0', '--test_eval=True', '--write_report=True']
    proc = start([PROBE, *train_cmd(out, data_dir, *args)],
                 env={**os.environ, 'PROBE_HOLD_SAVE': '2'})
    wait_for_stderr(proc, 'probe: holding the write of')
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert [r['step'] for r in read_metrics(out, 'stop')] == [10] and not read_metrics(out, 'test')
    assert stdout.split('resume with: ')[1].splitlines()[0].endswith(' --init_from=auto')
    with forking():
        end = start(train_cmd(out, data_dir, *args, '--init_from=auto'))
    stdout, stderr = end.communicate(timeout=120)
    assert end.returncode == 0 and 'early stop: no better val loss' in stdout, stderr
    assert len(read_metrics(out, 'test')) == 1 and trajectory(out)[-1][0] == 10
    # a SIGTERM in that step: the command printed, and report.md's, were init_from=resume's, which
    # refuses a run out of patience
    out = str(tmp_path / 'step')
    # float32: 'auto' may time training forwards, which the probe would count
    proc = start([PROBE, *train_cmd(out, data_dir, *args, '--dtype=float32')],
                 env={**os.environ, 'PROBE_SLEEP': '10-10:3'})
    wait_for_stderr(proc, 'probe: rank 0 sleeps in micro-batch 10')
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert stdout.split('resume with: ')[1].splitlines()[0].endswith(' --init_from=auto')
    report = open(os.path.join(out, 'report.md')).read()
    assert 'last.pt holds it, its end (test split, sample) left' in report, report
    assert report.split('\n    ')[-1].strip().endswith(' --init_from=auto'), report


def test_two_ranks_stop_together_on_sigterm_and_resume_bitwise(tmp_path, data_dir):
    # the stop near 40, an evaluation at 100 in the resumed part
    args = [*ARGS, '--gradient_accumulation_steps=2', '--max_iters=120', '--lr_decay_iters=120']
    straight, stopped = str(tmp_path / 'straight'), str(tmp_path / 'stopped')
    with forking():  # torchrun and its ranks: its signal handling is torchrun's own
        proc = torchrun_started(*train_cmd(stopped, data_dir, *args))
    wait_for_step(stopped, 40, proc)
    # to torchrun, as a cluster does: it passes SIGTERM on to every rank
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    # torchrun reports the signal with a traceback of its own; the ranks end without one, rank 0
    # saying how to resume
    assert proc.returncode != 0, stderr
    assert 'train.py", line' not in stderr and 'exits.py", line' not in stderr, stderr
    assert 'stopped by SIGTERM at iteration' in stdout, stdout
    stop = read_metrics(stopped, 'stop')
    assert len(stop) == 1, stdout + stderr
    assert (torch.load(os.path.join(stopped, 'last.pt'), weights_only=True)['iter_num']
            == stop[0]['step'])
    with forking():
        ok(torchrun(stopped, data_dir, *args, '--init_from=resume'))
        ok(torchrun(straight, data_dir, *args))
    assert trajectory(stopped) == trajectory(straight)
