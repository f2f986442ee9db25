"""compile=True on CPU (inductor, which builds C++ kernels with gcc): a compiled run computes what
an eager one does, and with deterministic=True it is repeatable and resumes bitwise, on more than
one thread and on 2 ranks. Each test compiles (20-40 s of CPU the first time, seconds from
inductor's cache after)."""
import json
import os

import pytest

from conftest import DEVICES, ok, read_metrics, run_train, torchrun

# compilation and training in subprocesses: the 'not slow' tier skips them
pytestmark = pytest.mark.slow

ARGS = ['--compile=True', '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10']
# Tolerance: inductor fuses float32 operations and sums in another order than eager kernels, so
# results differ by rounding: ~1e-7 relative per operation (2e-7 at most in the losses of 40 steps,
# measured), compounded over 20 Adam steps; 1e-4 is far above that and far below what a wrong kernel
# or a missing operation changes (1e-2).
RTOL = 1e-4


def trajectory(out_dir):
    return [(r['step'], r['loss'], r['lr'], r['grad_norm']) for r in read_metrics(out_dir, 'train')]


@pytest.mark.parametrize('device', DEVICES)
def test_compiled_losses_track_eager(tmp_path, data_dir, device):
    eager, compiled = str(tmp_path / 'eager'), str(tmp_path / 'compiled')
    # dropout 0: inductor draws dropout masks its own way; eval_iters=0: every window, so that
    # the last batch of each split is short of windows
    args = [*ARGS, '--dtype=float32', f'--device={device}', '--eval_iters=0']
    # a GPU multiplies float32 in TF32 (train.py allows it): a rounding difference in a fused
    # kernel's output can move an input of the next matmul across a TF32 step (1e-3 relative)
    rtol = RTOL if device == 'cpu' else 1e-3
    run_train(eager, data_dir, *args, '--compile=False')
    run_train(compiled, data_dir, *args, timeout=900, probe=True,
              env={**os.environ, 'PROBE_GRAPHS': str(tmp_path)})
    # inductor compiled the training graph and one evaluation graph (its batches all of one
    # shape), on the device asked for
    assert int(open(tmp_path / 'graphs.0').read()) == 2
    with open(os.path.join(compiled, 'meta.json')) as f:
        assert json.load(f)['device'] == ('cuda:0' if device == 'cuda' else 'cpu')
    for (s1, l1, lr1, g1), (s2, l2, lr2, g2) in zip(trajectory(eager), trajectory(compiled),
                                                    strict=True):
        assert s1 == s2 and lr1 == lr2 and abs(l1 - l2) <= rtol * l1 and abs(g1 - g2) <= rtol * g1
    evals = [[r['val_loss'] for r in read_metrics(run, 'eval')] for run in (eager, compiled)]
    assert len(evals[0]) == 2 and evals[1] == pytest.approx(evals[0], rel=rtol)


def test_deterministic_compiled_run_on_two_ranks_of_two_threads_resumes_bitwise(tmp_path, data_dir):
    # Two ranks of two threads each: one process's run is the same code on world_size 1 (its
    # compiled graph and checkpoint too), so the two ranks test it, and DDP's wrapper beside it.
    # Without deterministic=True, inductor's embedding backward adds rows with atomic adds from both
    # threads, in whichever order they come: two such runs differ by rounding within a few steps,
    # sooner the wider the rows (hence 128). Dropout on: inductor's masks come from seeds it draws
    # from the global RNG, which the checkpoint restores.
    args = [*ARGS, '--deterministic=True', '--dropout=0.1', '--gradient_accumulation_steps=2',
            '--n_embd=128']
    two_threads = {'OMP_NUM_THREADS': '2'}

    # one after another: the first compiles, the second finds its kernels in the cache
    def run(out_dir, *extra):
        ok(torchrun(out_dir, data_dir, *args, *extra, env_extra=two_threads, timeout=900))
    straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
    run(straight, '--keep_checkpoints=2')  # its checkpoint of 10 (after an evaluation) is kept
    run(resumed, '--init_from=resume', f"--resume_from={os.path.join(straight, 'ckpt-000010.pt')}")
    assert trajectory(resumed) == [t for t in trajectory(straight) if t[0] > 10]
    with open(os.path.join(resumed, 'meta.json')) as f:
        assert json.load(f)['hardware']['torch_threads'] == 2  # the runs had the threads to race on
