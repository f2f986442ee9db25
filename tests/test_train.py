"""End-to-end: train.py run as users run it, on a small generated corpus, checked through its files."""
import hashlib
import json
import math
import os

import torch

from conftest import read_metrics, run_train


def test_run_learns_and_records_everything(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    result = run_train(out, data_dir, '--max_iters=60', '--lr_decay_iters=60', '--eval_interval=20')
    evals = read_metrics(out, 'eval')
    assert [e['step'] for e in evals] == [20, 40, 60]
    vocab_size = json.load(open(os.path.join(data_dir, 'toy', 'meta.json')))['vocab_size']
    assert evals[0]['val_loss'] < math.log(vocab_size)  # better than uniform
    assert evals[-1]['val_loss'] < evals[0]['val_loss'] - 0.3  # and still falling
    assert evals[-1]['best_val_loss'] == min(e['val_loss'] for e in evals)
    steps = read_metrics(out, 'train')
    assert [s['step'] for s in steps] == list(range(1, 61))
    for s in steps:
        assert {'loss', 'lr', 'grad_norm', 'tokens_per_sec'} <= s.keys() and math.isfinite(s['loss']) and s['tokens_per_sec'] > 0
    assert steps[0]['lr'] < steps[5]['lr'] and steps[-1]['lr'] < steps[20]['lr']  # warmup, then decay
    test = read_metrics(out, 'test')[0]
    assert test['best_iter'] == min(evals, key=lambda e: e['val_loss'])['step'] and math.isfinite(test['test_loss'])
    assert 'best val loss' in result.stdout and 'test loss' in result.stdout
    # the run directory: resolved config with sources, run metadata, state_dict-only checkpoints
    config = json.load(open(os.path.join(out, 'config.json')))
    assert config['max_iters'] == {'value': 60, 'source': 'command line'}
    assert config['n_layer']['source'].endswith('run_config.py') and config['beta1']['source'] == 'default'
    meta = json.load(open(os.path.join(out, 'meta.json')))
    assert {'git_sha', 'git_dirty', 'command', 'versions', 'hardware', 'seed', 'start_time'} <= meta.keys()
    assert meta['versions']['torch'] == torch.__version__
    log = open(os.path.join(out, 'train.log')).read()
    assert log.strip().splitlines() == [line for line in result.stdout.strip().splitlines() if not line.startswith('preparing')]
    best = torch.load(os.path.join(out, 'best.pt'), weights_only=True)
    last = torch.load(os.path.join(out, 'last.pt'), weights_only=True)
    assert last['iter_num'] == 60 and best['iter_num'] == test['best_iter']
    assert not any(k.startswith(('module.', '_orig_mod.')) for k in last['model'])


def test_overfit_one_batch(tmp_path, data_dir):
    out = str(tmp_path / 'overfit')
    result = run_train(out, data_dir, '--overfit_one_batch=True', '--max_iters=150', '--decay_lr=False',
                       '--learning_rate=1e-2', '--eval_interval=150', '--log_interval=10')
    losses = [s['loss'] for s in read_metrics(out, 'train')]
    assert losses[0] > 2.0 and losses[-1] < 0.1, losses
    assert 'overfit one batch: loss' in result.stdout


def sha(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def test_nan_aborts_with_context_and_keeps_checkpoints(tmp_path, data_dir):
    out = str(tmp_path / 'nan')
    run_train(out, data_dir)
    before = {name: sha(os.path.join(out, name)) for name in ('best.pt', 'last.pt')}
    # resume with an absurd learning rate (allowed on resume: it is how a user recovers from a blow-up)
    result = run_train(out, data_dir, '--init_from=resume', '--max_iters=80', '--learning_rate=1e9',
                       '--lr_decay_iters=1000', '--eval_interval=5', check=False)
    assert result.returncode != 0
    error = [line for line in result.stderr.splitlines() if line.startswith('error:')]
    assert len(error) == 1 and 'Traceback' not in result.stderr
    for word in ('non-finite', 'iteration 4', 'lr ', 'grad norm', 'batch windows'):
        assert word in error[0], error[0]
    assert {name: sha(os.path.join(out, name)) for name in before} == before
    abort = read_metrics(out, 'abort')
    assert len(abort) == 1 and abort[0]['step'] > 40


def test_bad_config_and_missing_data_create_nothing(tmp_path, data_dir):
    out = tmp_path / 'never'
    for args in (['--batch_sise=4'], ['--dataset=nope'], ['--n_embd=30', '--n_head=4'], ['--dtype=fp8'],
                 ['--block_size=100000']):
        result = run_train(str(out), data_dir, *args, check=False)
        assert result.returncode != 0 and 'Traceback' not in result.stderr, result.stderr
        assert result.stderr.strip().count('\n') == 0 and result.stderr.startswith('error:'), result.stderr
        assert not out.exists()


def test_existing_run_is_not_overwritten(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20')
    before = sha(os.path.join(out, 'last.pt')), sha(os.path.join(out, 'metrics.jsonl'))
    result = run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20', check=False)
    assert result.returncode != 0 and 'already holds a run' in result.stderr
    assert (sha(os.path.join(out, 'last.pt')), sha(os.path.join(out, 'metrics.jsonl'))) == before
