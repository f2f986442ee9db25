"""Documented run options, each observed end to end: early stopping with patience,
always_save_checkpoint=False, eval_iters=0 (the whole split), and what TensorBoard and wandb
receive."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import datafiles
import perf
import report
from conftest import REPO, RUN_CONFIG, read_metrics, run_train
from model import GPT, GPTConfig

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them


def saves_by_iteration(out_dir):
    """{iteration: 'saved ...' line} from train.log: each save's line follows its iteration's log
    line."""
    saves, iteration = {}, None
    for line in open(os.path.join(out_dir, 'train.log')):
        if line.startswith('iter '):
            iteration = int(line.split()[1].split('/')[0])
        elif line.startswith('saved '):
            saves[iteration] = line.split(' in ')[0]
    return saves


def test_patience_stops_early_and_without_always_save_last_pt_follows_each_best(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    # learning rate 0: the val loss of the first evaluation (at 2) is never beaten, so patience 2
    # stops at 6
    result = run_train(out, data_dir, '--learning_rate=0', '--warmup_iters=0', '--max_iters=20',
                       '--eval_interval=2',
                       '--patience=2', '--always_save_checkpoint=False', '--test_eval=True')
    assert [r['step'] for r in read_metrics(out, 'eval')] == [2, 4, 6]
    assert [r['step'] for r in read_metrics(out, 'train')] == list(range(1, 7))
    assert 'early stop: no better val loss in 2 evaluations since iteration 2' in result.stdout
    # a new best writes both files; the evaluation at 4 writes nothing; the early stop writes
    # last.pt to resume from
    assert saves_by_iteration(out) == {2: 'saved best.pt and last.pt', 6: 'saved last.pt'}
    assert torch.load(os.path.join(out, 'last.pt'), weights_only=True)['iter_num'] == 6
    assert read_metrics(out, 'test')[0]['best_iter'] == 2
    report.write_report(out)
    assert ('Status: **early-stopped**: at iteration 6 of 20'
            in open(os.path.join(out, 'report.md')).read())
    # at this patience there is nothing to do: a resume is refused, auto redoes only the end
    same = ['--learning_rate=0', '--warmup_iters=0', '--max_iters=20', '--eval_interval=2',
            '--patience=2', '--always_save_checkpoint=False']
    result = run_train(out, data_dir, *same, '--init_from=resume', check=False)
    assert result.returncode == 2 and result.stderr == (
        f"error: {out}/last.pt is at iteration 6, 2 evaluations after its best: patience=2 stops "
        f"the run there, leaving nothing to do: raise patience\n")
    result = run_train(out, data_dir, *same, '--init_from=auto')
    assert [r['step'] for r in read_metrics(out, 'train')] == list(range(1, 7))
    assert ('early stop: no better val loss in 2 evaluations since iteration 2\ndone: no '
            'iterations left, all 6 iterations' in result.stdout), result.stdout
    assert [r['step'] for r in read_metrics(out, 'test')] == [6]  # the logs cut back to last.pt's


def test_eval_iters_0_evaluates_the_whole_split(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    result = run_train(out, data_dir, '--eval_iters=0', '--max_iters=2', '--eval_interval=2',
                       '--dtype=float32')
    ckpt = torch.load(os.path.join(out, 'last.pt'), weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.eval()
    # every token of val but the first, predicted once, from windows of block_size tokens (the last
    # one shorter)
    val = data.TokenWindows(datafiles.open_dataset(data_dir, 'toy')[1]['val'], 32)
    tokens = torch.from_numpy(val.read(0, val.num_tokens).astype(np.int64))  # (N,)
    loss_sum = 0.0
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, 32):
            x, y = tokens[start:start + 32], tokens[start + 1:start + 33]  # (<=32,)
            loss_sum += F.cross_entropy(model(x[:len(y)][None])[0], y, reduction='sum').item()
    # the run sums batches, this test windows, in float32: they differ by ~1e-8; one of the ~250
    # windows left out moves the mean by ~1e-5
    assert read_metrics(out, 'eval')[-1]['val_loss'] == pytest.approx(loss_sum / (len(tokens) - 1),
                                                                      rel=1e-6)
    # the train split whole too, said at the start with each split's windows
    train = data.TokenWindows(datafiles.open_dataset(data_dir, 'toy')[1]['train'], 32)
    assert (f"eval_iters=0: every evaluation reads the train split whole "
            f"({math.ceil((train.num_tokens - 1) / 32):,} windows) and val "
            f"({len(range(0, len(tokens) - 1, 32)):,})") in result.stdout


def test_tensorboard_and_wandb_receive_every_number_of_metrics_jsonl(tmp_path, data_dir):
    # tests/probe.py puts recording stand-ins for wandb and TensorBoard in their place: no packages,
    # no network
    out, calls_file = str(tmp_path / 'run'), tmp_path / 'calls.jsonl'
    run_train(out, data_dir, '--tensorboard_log=True', '--wandb_log=True', '--max_iters=4',
              '--eval_interval=2',
              '--test_eval=True', probe=True, env={**os.environ, 'PROBE_LOGGERS': str(calls_file)})
    calls = [json.loads(line) for line in open(calls_file)]
    assert calls[0] == ['SummaryWriter', os.path.join(out, 'tensorboard')]
    name, init = calls[1]
    assert (name == 'wandb.init'
            and (init['project'], init['name'], init['resume']) == ('honestgpt', 'run', 'allow'))
    assert init['config']['max_iters'] == 4 and init['config']['wandb_log'] is True
    expected = {(f"{r['kind']}/{key}", value, r['step']) for r in read_metrics(out)
                for key, value in r.items()
                if key not in ('step', 'time') and type(value) in (int, float)}
    assert {'train/loss', 'eval/val_loss', 'test/test_loss'} <= {tag for tag, _, _ in expected}
    tensorboard = {tuple(call[1:]) for call in calls if call[0] == 'add_scalar'}
    wandb = {(tag, value, call[2]) for call in calls if call[0] == 'wandb.log'
             for tag, value in call[1].items()}
    assert tensorboard == wandb == expected
    # closed at exit, after its last value: a writer's buffered tail is written then
    assert [call[0] for call in calls if call[0] != 'wandb.log'][-2:] == ['add_scalar',
                                                                         'SummaryWriter.close']


def test_threads_and_the_cpus_they_run_on_are_recorded_and_said(tmp_path, data_dir):
    """A run on one CPU (its affinity) takes one thread; the threads key takes more, and two threads
    on one CPU wait for each other: said once, with the fix. meta.json records the threads, the CPUs
    this process may use and how busy other work kept them. The peak FLOP/s measured then is this
    run's only: it reads low. Fresh interpreters: the fork server's torch has its threads set."""
    cpus = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != 'OMP_NUM_THREADS'}

    def run(name, *args):
        cache = tmp_path / f'cache-{name}'  # empty: the peak is measured
        result = subprocess.run([sys.executable, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}',
                                 f"--out_dir={tmp_path / name}", '--max_iters=1',
                                 '--eval_interval=1', *args], cwd=REPO,
                                env=env | {'HONESTGPT_CACHE': str(cache)},
                                capture_output=True, text=True, timeout=300,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus[:1]))
        assert result.returncode == 0, result.stderr
        meta = json.load(open(tmp_path / name / 'meta.json'))
        peak_cached = any(key.startswith('peak ') for key in perf.read_cache(cache / 'perf.json'))
        assert meta['peak_flops']['how'].endswith(
            '' if peak_cached else ' (not cached: other work kept the CPUs busy)')
        return meta['hardware']['torch_threads'], meta['cpus'], result.stderr, peak_cached
    threads, used, stderr, peak_cached = run('affinity')
    assert threads == used['usable'] == 1 and used['busy'] is None and 'warning: ' not in stderr
    assert peak_cached
    threads, used, stderr, peak_cached = run('key', '--threads=2')
    assert threads == 2 and used['usable'] == 1 and 0 <= used['busy'] <= 1
    assert 'warning: 2 threads, but 1 of the 1 CPUs this process may use are free' in stderr
    assert not peak_cached


@pytest.mark.parametrize('args', [['sample.py'], ['evaluate.py', '--tasks=t.jsonl']])
def test_a_mistake_on_a_busy_machine_is_still_one_line(tmp_path, args):
    """Two threads on one CPU: the warning that they wait comes after every check, so a mistake
    (no checkpoint in out_dir) is still its one line."""
    cpus = sorted(os.sched_getaffinity(0))
    result = subprocess.run([sys.executable, *args, f'--out_dir={tmp_path}', '--threads=2'],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus[:1]))
    assert (result.returncode == 2 and result.stderr.count('\n') == 1
            and result.stderr.startswith(f"error: checkpoint {tmp_path}/best.pt does not exist")
            ), result.stderr
