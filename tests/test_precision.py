"""Mixed precision that never lies: float16 skips do not advance the LR, and every dtype learns."""
import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

import forked
import precision
from conftest import DEVICES, REPO, RUN_CONFIG, read_metrics, run_train, run_trains
from model import GPTConfig

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them


@pytest.mark.parametrize('device', DEVICES)
def test_float16_skipped_steps_do_not_advance_the_schedule(tmp_path, data_dir, device):
    out = str(tmp_path / 'fp16')
    # overflows until the scale backs off
    run_train(out, data_dir, '--dtype=float16', f'--init_scale={2.0 ** 26}', f'--device={device}',
              '--ema_decay=0.9')
    steps = read_metrics(out, 'train')
    skipped = [s['skipped'] for s in steps]
    assert 5 <= sum(skipped) < len(steps) and skipped[0]
    assert steps[-1]['skipped_total'] == sum(skipped)
    for before, after in zip(steps, steps[1:]):
        if before['skipped']:
            # no LR progress, lower scale
            assert after['lr'] == before['lr'] and after['scale'] < before['scale']
    real_steps = sum(not s for s in skipped)
    ckpt = torch.load(os.path.join(out, 'last.pt'), weights_only=True)
    # scheduler steps == optimizer steps that ran
    assert ckpt['scheduler']['last_epoch'] == real_steps
    assert ckpt['optimizer'][0]['state'][0]['step'].item() == real_steps
    # the EMA took in the initial weights, then each step that ran
    assert ckpt['ema']['n_averaged'].item() == 1 + real_steps


def test_float16_consecutive_skips_abort(tmp_path, data_dir):
    out = str(tmp_path / 'fp16')
    result = run_train(out, data_dir, '--dtype=float16', f'--init_scale={2.0 ** 100}',
                       '--max_consecutive_skips=3', check=False)
    assert result.returncode != 0 and 'overflowed 3 optimizer steps in a row' in result.stderr
    assert [r['step'] for r in read_metrics(out, 'abort')] == [3]


def test_every_dtype_learns_like_float32(tmp_path, data_dir):
    final, first_norm = {}, {}
    for dtype in ('float32', 'bfloat16', 'float16'):
        out = str(tmp_path / dtype)
        run_train(out, data_dir, f'--dtype={dtype}', probe=True,
                  env={**os.environ, 'PROBE_DTYPES': str(tmp_path)})
        # linear layers' outputs: autocast in effect
        assert json.load(open(tmp_path / 'dtypes.0')) == [dtype]
        evals = read_metrics(out, 'eval')
        assert evals[-1]['val_loss'] < evals[0]['val_loss']
        final[dtype] = evals[-1]['val_loss']
        first_norm[dtype] = read_metrics(out, 'train')[0]['grad_norm']
    assert abs(final['bfloat16'] - final['float32']) < 0.05 * final['float32'], final
    assert abs(final['float16'] - final['float32']) < 0.02 * final['float32'], final
    # the same first step's gradient: float16's unscaled before it is clipped and logged (clipped
    # scaled, it was 65,536 times larger, and AdamW learned on regardless)
    assert first_norm['float16'] == pytest.approx(first_norm['float32'], rel=0.02), first_norm


def test_float16_resume_is_exact(tmp_path, data_dir):
    args = ['--dtype=float16', f'--init_scale={2.0 ** 24}', '--max_iters=30', '--lr_decay_iters=30',
            '--eval_interval=10']
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    run_trains(data_dir, (straight, args), (split, [*args, '--max_iters=12']))
    run_train(split, data_dir, *args, '--init_from=resume')
    fields = lambda d: [(r['step'], r['loss'], r['lr'], r['grad_norm'], r['scale'], r['skipped'])
                        for r in read_metrics(d, 'train')]
    assert fields(split) == fields(straight)
    assert any(r['skipped'] for r in read_metrics(straight, 'train'))  # the scaler's state mattered


def test_auto_dtype_is_measured_on_cpu_and_can_be_forced(tmp_path, data_dir):
    out = str(tmp_path / 'auto')
    # the suite may run with it set
    unforced = {k: v for k, v in os.environ.items() if k != 'HONESTGPT_AUTO_DTYPE'}
    run_train(out, data_dir, '--dtype=auto', '--device=cpu', '--max_iters=2', '--eval_interval=2',
              env=unforced)
    meta = json.load(open(os.path.join(out, 'meta.json')))
    choice = meta['dtype_choice']
    if precision.bfloat16_units():
        # bfloat16 units: both timed on this model's shape, the faster one trains
        assert (set(choice['seconds']) == {'float32', 'bfloat16'}
                and meta['dtype'] == min(choice['seconds'], key=choice['seconds'].get))
    else:
        assert meta['dtype'] == 'float32' and 'emulated' in choice['rule']
    assert (json.load(open(os.path.join(out, 'config.json')))['resolved']
            == {'device': 'cpu', 'dtype': meta['dtype']})
    # the switch that runs the suite either way on any machine
    for forced in ('float32', 'bfloat16'):
        out = str(tmp_path / forced)
        run_train(out, data_dir, '--dtype=auto', '--device=cpu', '--max_iters=2',
                  '--eval_interval=2', env={**os.environ, 'HONESTGPT_AUTO_DTYPE': forced})
        assert json.load(open(os.path.join(out, 'meta.json')))['dtype'] == forced


def test_float16_on_cpu_warns_with_the_measured_slowdown(tmp_path, data_dir, monkeypatch):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=32, vocab_size=64)
    monkeypatch.setattr(precision, 'float16_float32_seconds', lambda tokens, n_embd: (0.012, 1e-3))
    emulated = precision.float16_warning('cpu', config, 8)
    assert 'emulated' in emulated and '(12x slower)' in emulated
    assert 'use dtype=bfloat16' in emulated
    assert precision.float16_warning('cuda:0', config, 8) == ''
    # float16 as fast as float32: AVX512-FP16 (Sapphire Rapids) runs it natively
    monkeypatch.setattr(precision, 'float16_float32_seconds', lambda tokens, n_embd: (1e-3, 1e-3))
    assert precision.float16_warning('cpu', config, 8) == ''
    monkeypatch.undo()
    # train.py says it, once, where float16 is clearly emulated, and not where it is clearly native
    # the run's micro-batch and width
    float16, float32 = precision.float16_float32_seconds(8 * 32, 128)
    slowdown = float16 / float32
    result = run_train(str(tmp_path / 'fp16'), data_dir, '--dtype=float16', '--device=cpu',
                       '--n_embd=128', '--max_iters=1', '--eval_interval=1')
    warning = [line for line in result.stderr.splitlines()
               if line.startswith('warning: dtype=float16 on this CPU')]
    if slowdown > 3 or slowdown < 1.2:  # between, the run's own may fall either side of 1.5
        assert len(warning) == (slowdown > 3), (slowdown, result.stderr)


def test_fit_batch_halves_to_what_fits_keeps_the_global_batch_and_resumes(tmp_path, data_dir):
    fitted, by_hand = str(tmp_path / 'fitted'), str(tmp_path / 'by_hand')
    # dropout: each trial's masks draw from the RNG, which must come back; float16: the GradScaler
    # must be as before (a dtype given: 'auto' on a CPU with bfloat16 units times forwards of the
    # configured batch)
    args = ['--dropout=0.1', '--max_iters=6', '--eval_interval=3', '--dtype=float16',
            '--keep_checkpoints=2']
    fit = ['--batch_size=16', '--gradient_accumulation_steps=1', '--fit_batch=True']
    small_device = {**os.environ, 'PROBE_OOM': '4'}  # more than 4 windows run out of memory
    result = run_train(fitted, data_dir, *args, *fit, '--max_iters=3', probe=True, env=small_device)
    config = json.load(open(os.path.join(fitted, 'config.json')))
    assert config['batch_size'] == {'value': 4, 'source': 'fit_batch, from batch_size=16'}
    assert config['gradient_accumulation_steps']['value'] == 4
    assert ("fit_batch: batch_size=16 runs out of memory, 4 fits: micro-batches of 4"
            in result.stdout)
    # a resume keeps what the run found, and refuses another global batch
    result = run_train(fitted, data_dir, *args, *fit, '--batch_size=32', '--init_from=resume',
                       check=False)
    assert result.returncode == 2 and 'took 16 windows a step' in result.stderr, result.stderr
    # another split of it evaluates the run's val windows still (it evaluated 32, and chose
    # best.pt over two measures)
    run_train(fitted, data_dir, *args, *fit, '--batch_size=8', '--gradient_accumulation_steps=2',
              '--init_from=resume', probe=True, env=small_device)
    # the trials left nothing behind: the run is the run given those micro-batches by hand
    # evaluating eval_iters batches of the command's 16 windows, whatever the device holds
    run_train(by_hand, data_dir, *args, '--batch_size=4', '--gradient_accumulation_steps=4',
              '--eval_iters=16')
    steps = [[(r['step'], r['loss'], r['grad_norm']) for r in read_metrics(d, 'train')]
             for d in (fitted, by_hand)]
    assert steps[0] == steps[1] and len(steps[0]) == 6
    evals = [[(r['step'], r['val_loss']) for r in read_metrics(d, 'eval')]
             for d in (fitted, by_hand)]
    assert evals[0] == evals[1] and len(evals[0]) == 2
    # verify.py replays it with the micro-batches found, and the windows the run evaluated (its
    # replay was refused: the found batch_size gave other windows)
    result = forked.run('verify.py', f'--out_dir={fitted}')
    assert result.returncode == 0 and result.stdout.startswith('reproduced: iterations 4-6'), (
        result.stdout + result.stderr)


# CUDA's allocator alone can be capped (PROBE_CUDA_MEMORY): real out-of-memory errors, on a GPU
@pytest.mark.parametrize('device', DEVICES[1:])
def test_fit_batch_on_a_small_gpu_finds_a_size_equal_to_it_given_by_hand(tmp_path, data_dir,
                                                                         device):
    fitted, by_hand = str(tmp_path / 'fitted'), str(tmp_path / 'by_hand')
    args = ['--n_embd=128', '--dtype=float32', '--max_iters=4', '--eval_interval=4',
            '--gradient_accumulation_steps=1', f'--device={device}', '--deterministic=True']
    # capped at 256 MiB, as on a small card: 1024 windows need ~700 MB
    result = run_train(fitted, data_dir, *args, '--batch_size=1024', '--fit_batch=True', probe=True,
                       env={**os.environ, 'PROBE_CUDA_MEMORY': str(256 * 2**20)})
    config = json.load(open(os.path.join(fitted, 'config.json')))
    size = config['batch_size']['value']
    assert size < 1024 and config['batch_size']['source'] == 'fit_batch, from batch_size=1024'
    assert config['gradient_accumulation_steps']['value'] * size == 1024
    assert f"fit_batch: batch_size=1024 runs out of memory, {size} fits" in result.stdout
    run_train(by_hand, data_dir, *args, f'--batch_size={size}',
              f'--gradient_accumulation_steps={1024 // size}')
    steps = [[(r['step'], r['loss'], r['grad_norm']) for r in read_metrics(d, 'train')]
             for d in (fitted, by_hand)]
    assert steps[0] == steps[1] and len(steps[0]) == 4


@pytest.mark.parametrize('device', DEVICES)
def test_out_of_memory_is_one_clear_message(tmp_path, data_dir, device):
    out = str(tmp_path / 'oom')
    args = ['--batch_size=1000', '--n_embd=128', '--dtype=float32',  # the limits are for float32
            f'--device={device}']
    if device == 'cuda':  # the allocator capped at 256 MiB, as on a small card: it needs ~700 MB
        result = run_train(out, data_dir, *args, probe=True, check=False,
                           env={**os.environ, 'PROBE_CUDA_MEMORY': str(256 * 2**20)})
    else:
        # address space: enough to start, too little for this batch's activations. Start-up takes
        # what a bare `import torch` maps (0.6 GB for a CPU build, 3 GB for a CUDA build: its GPU
        # libraries) and 0.3 GB more
        status = "import torch; print(open('/proc/self/status').read())"
        bare = subprocess.run([sys.executable, '-c', status], capture_output=True, text=True,
                              check=True).stdout
        limit = int(re.search(r'VmPeak:\s+(\d+) kB', bare).group(1)) * 2**10 + 800 * 2**20

        def cap_memory():
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        result = subprocess.run([sys.executable, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}',
                                 f'--out_dir={out}', *args], cwd=REPO, capture_output=True,
                                text=True, preexec_fn=cap_memory, timeout=300)
    assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith('error:')]
    assert (len(error) == 1 and 'out of memory at iteration' in error[0]
            and 'batch_size=1000' in error[0]), result.stderr
    assert 'gradient_accumulation_steps' in error[0]
    assert len(read_metrics(out, 'abort')) == 1
    # nothing half-written
    assert not [f for f in os.listdir(out) if f.endswith('.pt') or f.endswith('.tmp')]
