"""End-to-end: train.py run as users run it, on a small generated corpus, checked through its
files."""
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import forked
import perf
import preflight
from conftest import DEVICES, PROBE, REPO, RUN_CONFIG, ok, read_metrics, run_train
from model import GPT, GPTConfig


@pytest.mark.parametrize('device', DEVICES)
def test_run_learns_and_records_everything(tmp_path, data_dir, device):
    out = str(tmp_path / 'run')
    result = run_train(out, data_dir, '--max_iters=60', '--lr_decay_iters=60', '--eval_interval=20',
                       '--test_eval=True', '--sample_tokens=20', f'--device={device}')
    evals = read_metrics(out, 'eval')
    assert [e['step'] for e in evals] == [20, 40, 60]
    vocab_size = json.load(open(os.path.join(data_dir, 'toy', 'meta.json')))['vocab_size']
    assert evals[0]['val_loss'] < math.log(vocab_size)  # better than uniform
    assert evals[-1]['val_loss'] < evals[0]['val_loss'] - 0.3  # and still falling
    assert evals[-1]['best_val_loss'] == min(e['val_loss'] for e in evals)
    steps = read_metrics(out, 'train')
    assert [s['step'] for s in steps] == list(range(1, 61))
    for s in steps:
        assert ({'loss', 'lr', 'grad_norm', 'tokens_per_sec'} <= s.keys()
                and math.isfinite(s['loss']) and s['tokens_per_sec'] > 0)
    # warmup, then decay
    assert steps[0]['lr'] < steps[5]['lr'] and steps[-1]['lr'] < steps[20]['lr']
    # how busy the device was; a GPU's from NVML, where nvidia-ml-py is (the GPU image has it)
    if device == 'cpu' or importlib.util.find_spec('pynvml'):
        busy = [s['utilization'] for s in steps]
        assert min(busy) >= 0 and max(busy) > 0
    test = read_metrics(out, 'test')[0]
    assert (test['best_iter'] == min(evals, key=lambda e: e['val_loss'])['step']
            and math.isfinite(test['test_loss']))
    # the save and evaluation costs are measured, inside the run's time: the evaluations' is the
    # sum of each eval record's
    assert 0 < test['save_seconds'] < test['wall_seconds']
    assert 0 < test['eval_seconds'] == pytest.approx(sum(e['seconds'] for e in evals))
    assert all(e['seconds'] > 0 and steps[e['step'] - 1]['time'] < e['time'] for e in evals)
    assert test['eval_seconds'] + test['save_seconds'] < test['wall_seconds']
    assert (f"(evaluations {test['eval_seconds'] / test['wall_seconds']:.1%} and checkpoint saves "
            in result.stdout)
    assert ('best val loss' in result.stdout and 'test loss' in result.stdout
            and 'a sample from the best weights' in result.stdout)
    # the run directory: resolved config with sources, run metadata, state_dict-only checkpoints
    config = json.load(open(os.path.join(out, 'config.json')))
    assert config['max_iters'] == {'value': 60, 'source': 'command line'}
    assert (config['n_layer']['source'].endswith('run_config.py')
            and config['beta1']['source'] == 'default')
    meta = json.load(open(os.path.join(out, 'meta.json')))
    assert ({'git_sha', 'git_dirty', 'command', 'versions', 'hardware', 'seed', 'start_time'}
            <= meta.keys())
    assert meta['versions']['torch'] == torch.__version__
    # this checkout's commit, and whether it has changes (test_units: a repository made for it)
    git = [subprocess.run(['git', *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
           for args in (['rev-parse', 'HEAD'], ['status', '--porcelain'])]
    assert (meta['git_sha'], meta['git_dirty']) == (git[0], bool(git[1]))
    if device == 'cuda':  # dtype='auto' from Ampere on; the card, its datasheet peak, its software
        gpu = meta['hardware']['gpu']
        assert meta['device'] == 'cuda:0' and meta['dtype'] == 'bfloat16'
        listed = gpu['name'] in perf.GPU_PEAKS  # a card the table lacks is measured
        peak_how = f"datasheet: {gpu['name']}," if listed else 'measured: '
        assert meta['peak_flops']['how'].startswith(peak_how)
        for key in ('name', 'capability', 'memory_mb', 'driver', 'cuda', 'cudnn', 'nccl'):
            assert gpu[key], gpu
    else:
        assert meta['hardware']['gpu'] is None
    # before the smoke test, the least time an iteration and the run take at the peak
    model_args = torch.load(os.path.join(out, 'last.pt'), weights_only=True)['model_args']
    tokens = math.prod(config[k]['value']
                       for k in ('gradient_accumulation_steps', 'batch_size', 'block_size'))
    # (meta.json's peak may have been raised since: the line's own)
    line = re.search(r"against ([\d.,]+) GFLOP/s per process .*at it an iteration takes at least "
                     r"([\d.e+-]+) s, the 60 left", result.stdout)
    peak, least = (float(value.replace(',', '')) for value in line.groups())
    assert least == pytest.approx(GPT(GPTConfig(**model_args)).flops_per_token() * tokens
                                  / (peak * 1e9), rel=0.01)
    log = open(os.path.join(out, 'train.log')).read().strip().splitlines()
    # warnings go to stderr and the log; the rest of the log is stdout's, from its first line (the
    # start-up lines, logged before the run folder opened, too)
    warnings = [line for line in log if line.startswith('warning: ')]
    assert all(line in result.stderr for line in warnings)
    assert [line for line in log if line not in warnings] == result.stdout.strip().splitlines()
    assert any(line.startswith('building the model') for line in log)
    best = torch.load(os.path.join(out, 'best.pt'), weights_only=True)
    last = torch.load(os.path.join(out, 'last.pt'), weights_only=True)
    assert last['iter_num'] == 60 and best['iter_num'] == test['best_iter']
    assert not any(k.startswith(('module.', '_orig_mod.')) for k in last['model'])


@pytest.mark.slow
def test_overfit_one_batch(tmp_path, data_dir):
    out = str(tmp_path / 'overfit')
    result = run_train(out, data_dir, '--overfit_one_batch=True', '--max_iters=150',
                       '--decay_lr=False', '--learning_rate=1e-2', '--eval_interval=150',
                       '--log_interval=10')
    losses = [s['loss'] for s in read_metrics(out, 'train')]
    assert losses[0] > 2.0 and losses[-1] < 0.1, losses
    assert 'overfit one batch: loss' in result.stdout


@pytest.mark.slow
def test_an_overfit_run_resumes_on_its_batch_and_a_finished_one_started_again_ends_cleanly(
        tmp_path, data_dir):
    # init_from=auto on a finished run takes no step: no losses for the overfit line, which is left
    # out
    out, straight = str(tmp_path / 'again'), str(tmp_path / 'straight')
    args = ('--overfit_one_batch=True', '--decay_lr=False', '--eval_interval=3', '--init_from=auto')
    assert 'overfit one batch: loss' in run_train(out, data_dir, *args, '--max_iters=3').stdout
    again = run_train(out, data_dir, *args, '--max_iters=3')
    assert 'overfit one batch' not in again.stdout
    assert 'done: no iterations left, all 3 iterations in ' in again.stdout
    # fewer iterations than it ran is another run's command: refused, as by init_from=resume, with
    # nothing written
    files = {name: sha(os.path.join(out, name)) for name in os.listdir(out)}
    for init_from in ('auto', 'resume'):
        refused = run_train(out, data_dir, *args, '--max_iters=2', f'--init_from={init_from}',
                            check=False)
        assert refused.returncode == 2 and 'is at iteration 3: max_iters=2 leaves nothing to do' \
            in refused.stderr, refused.stderr
    assert {name: sha(os.path.join(out, name)) for name in os.listdir(out)} == files
    # its batch is read without moving the sampler: resumed, it trains on the same one
    run_train(out, data_dir, *args, '--max_iters=6')
    run_train(straight, data_dir, *args, '--max_iters=6')
    losses = [[r['loss'] for r in read_metrics(d, 'train')] for d in (out, straight)]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def sha(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


@pytest.mark.slow
def test_nan_aborts_with_context_and_keeps_checkpoints(tmp_path, data_dir):
    out = str(tmp_path / 'nan')
    run_train(out, data_dir)
    before = {name: sha(os.path.join(out, name)) for name in ('best.pt', 'last.pt')}
    # the resumed run's first micro-batch (iteration 41) gives a NaN loss, on an iteration with an
    # evaluation and a save due: the run must stop before either
    result = run_train(out, data_dir, '--init_from=resume', '--max_iters=80', '--eval_interval=1',
                       '--checkpoint_interval=1',
                       check=False, probe=True, env={**os.environ, 'PROBE_NAN': '0:1'})
    assert result.returncode != 0
    assert {name: sha(os.path.join(out, name)) for name in before} == before
    error = [line for line in result.stderr.splitlines() if line.startswith('error:')]
    assert len(error) == 1 and 'Traceback' not in result.stderr
    for words in ('non-finite loss at iteration 41', 'lr ', 'grad norm', 'batch windows',
                  'then resume with --init_from=auto'):
        assert words in error[0], error[0]
    assert ([r['step'] for r in read_metrics(out, 'abort')] == [41]
            and read_metrics(out, 'eval')[-1]['step'] == 40)


def test_bad_config_and_missing_data_create_nothing(tmp_path, data_dir):
    out = tmp_path / 'never'
    # a model no machine holds: a traceback from its first allocation, without the check
    for args, says in ((['--batch_sise=4'], 'batch_sise'), (['--dataset=nope'], 'nope'),
                       (['--block_size=100000'], 'block_size'), (['--ema_decay=1'], 'ema_decay'),
                       (['--n_embd=1048576', '--n_head=1'], 'parameters need')):
        result = run_train(str(out), data_dir, *args, check=False)
        assert result.returncode != 0 and 'Traceback' not in result.stderr, result.stderr
        assert (result.stderr.strip().count('\n') == 0 and result.stderr.startswith('error:')
                and says in result.stderr), result.stderr
        assert not out.exists()


@pytest.mark.parametrize('script, key', [
    ('train.py', "batch_size = 12  # micro-batch per process"), ('sample.py', "num_samples = 3"),
    ('evaluate.py', "max_examples = 0"), ('verify.py', "end = ''"), ('bench.py', "rounds = "),
    ('report.py', None)])
def test_help_prints_the_docstring_and_the_settings_and_writes_nothing(tmp_path, script, key):
    # the settings as the script declares them, with what each means; report.py has none
    for flag in ('--help', '-h'):
        result = forked.run(script, 'config/tiny.py', flag, '--out_dir=' + str(tmp_path / 'o'),
                            timeout=60)
        assert result.returncode == 0 and result.stderr == '', result.stderr
        with open(os.path.join(REPO, script)) as f:
            first_line = f.read().split('"""')[1].strip().splitlines()[0]
        assert result.stdout.startswith(first_line)
        assert (key in result.stdout) if key else 'Settings' not in result.stdout
        assert os.listdir(tmp_path) == []


def test_eval_only_prints_the_starting_weights_losses_and_writes_nothing(tmp_path, data_dir):
    # nanoGPT's key (its config/eval_gpt2*.py set it): a checkpoint's losses as its run logged them
    out = tmp_path / 'run'
    ema = '--ema_decay=0.9'  # its val loss too, which chose best.pt
    run_train(str(out), data_dir, '--max_iters=6', '--lr_decay_iters=6', '--eval_interval=6', ema)
    logged = read_metrics(str(out), 'eval')[-1]
    files = lambda: {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out)}
    before = files()
    # a finished run: no step left to take, none taken
    result = run_train(str(out), data_dir, '--init_from=resume', '--eval_only=True', ema)
    assert (f"eval only, iteration 6: train {logged['train_loss']:.4f}, val "
            f"{logged['val_loss']:.4f}, EMA val {logged['ema_val_loss']:.4f}\n") in result.stdout
    assert files() == before
    # a closer look, as nanoGPT takes one: other training settings, other windows; not another shape
    result = run_train(str(out), data_dir, '--init_from=resume', '--eval_only=True', ema,
                       '--eval_iters=0', '--batch_size=4', '--dropout=0.1', '--beta2=0.9',
                       '--optimizer=muon', '--dtype=float16', '--fit_batch=True')
    assert 'eval only, iteration 6: train ' in result.stdout and files() == before
    assert ("warning: dropout=0.1 is read only with training, so this run ignores it: add "
            "--eval_only=False, or leave dropout out") in result.stdout
    result = run_train(str(out), data_dir, '--init_from=resume', '--eval_only=True', ema,
                       '--n_embd=64', check=False)
    assert result.returncode == 2 and 'n_embd=32 there, 64 here' in result.stderr
    fresh = tmp_path / 'fresh'
    result = run_train(str(fresh), data_dir, '--eval_only=True')
    assert 'eval only, iteration 0: train ' in result.stdout and not fresh.exists()


def test_a_refused_run_prepares_no_default_dataset_first(tmp_path):
    # the default dataset is prepared by the first run that needs it (seconds to minutes), not by
    # one that is refused for its checkpoint or out_dir anyway
    data, out = tmp_path / 'data', tmp_path / 'out'

    def refused(init_from, says):
        result = run_train(str(out), str(data), '--dataset=pystdlib_char', init_from, check=False)
        assert result.returncode == 2 and says in result.stderr, result.stdout + result.stderr
        assert not data.exists() and result.stdout == ''
    refused('--init_from=resume', 'nothing to resume')
    out.mkdir()
    (out / 'last.pt').write_bytes(b'')
    refused('--init_from=scratch', 'already holds a checkpoint')


def test_an_out_dir_that_holds_a_dataset_is_refused(tmp_path, data_dir):
    # a run there wrote its meta.json over the dataset's
    dataset = tmp_path / 'toy'
    shutil.copytree(os.path.join(data_dir, 'toy'), dataset)

    def files():  # but fingerprints.json, the data's cache, which opening the data may write
        return {f.name: f.read_bytes() for f in dataset.iterdir() if f.name != 'fingerprints.json'}
    before = files()
    # the run's own dataset's folder, which prepare.py replaces whole, or another dataset's
    result = run_train(str(dataset), str(tmp_path), check=False)
    assert result.returncode == 2 and result.stderr == (
        f"error: out_dir '{dataset}' is in the dataset's folder {dataset}, which prepare.py "
        f"replaces whole: use a folder of its own\n")
    other = tmp_path / 'other'
    shutil.copytree(dataset, other)
    result = run_train(str(other), str(tmp_path), check=False)
    assert result.returncode == 2 and result.stderr == (
        f"error: out_dir '{other}' holds a dataset (its shards or fingerprints.json), whose "
        f"meta.json a run would overwrite: use another out_dir\n")
    assert files() == before


@pytest.fixture(scope='module')
def run_20(tmp_path_factory, data_dir):
    """A finished 20-iteration run, read and never changed by the tests that share it."""
    out = str(tmp_path_factory.mktemp('run20') / 'run')
    run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20')
    return out


def test_a_forked_run_is_the_run_of_a_fresh_interpreter(tmp_path, data_dir):
    # run_train forks a server that has imported torch (tests/forked.py): the same run in a fresh
    # `python train.py`, with dropout and a loader worker, so that the RNG streams and the worker
    # process are compared too
    args = ['--max_iters=20', '--lr_decay_iters=20', '--dropout=0.1', '--num_workers=1']
    assert forked.FRESH or forked.forks(os.environ), "run_train would start a fresh interpreter"
    forked_run, fresh = str(tmp_path / 'forked'), str(tmp_path / 'fresh')
    run_train(forked_run, data_dir, *args)
    # warnings on, as a developer runs it: a log file left to the garbage collector would say so
    result = ok(subprocess.run([sys.executable, '-W', 'default', 'train.py', RUN_CONFIG,
                                f'--data_dir={data_dir}', f'--out_dir={fresh}', *args],
                               cwd=REPO, capture_output=True, text=True, timeout=300))
    assert 'ResourceWarning' not in result.stderr, result.stderr
    for kind, keys in (('train', ('step', 'loss', 'lr', 'grad_norm')),
                       ('eval', ('step', 'val_loss'))):
        records = [[[r[k] for k in keys] for r in read_metrics(run, kind)]
                   for run in (forked_run, fresh)]
        assert records[0] == records[1] and len(records[0]) > 0, kind
    weights = [torch.load(os.path.join(run, 'last.pt'), weights_only=True)['model']
               for run in (forked_run, fresh)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    commands = [json.load(open(os.path.join(run, 'meta.json')))['command'][:2]
                for run in (forked_run, fresh)]
    assert commands[0] == commands[1] == ['train.py', RUN_CONFIG]


@pytest.mark.slow
def test_existing_run_is_not_overwritten(run_20, data_dir):
    before = sha(os.path.join(run_20, 'last.pt')), sha(os.path.join(run_20, 'metrics.jsonl'))
    result = run_train(run_20, data_dir, '--max_iters=20', '--lr_decay_iters=20', check=False)
    assert result.returncode == 2 and 'already holds a checkpoint' in result.stderr
    assert (sha(os.path.join(run_20, 'last.pt')),
            sha(os.path.join(run_20, 'metrics.jsonl'))) == before


@pytest.mark.parametrize('key, package',
                         [('tensorboard_log', 'tensorboard'), ('wandb_log', 'wandb')])
def test_missing_logging_package_is_a_one_line_error(tmp_path, data_dir, key, package):
    if importlib.util.find_spec(package):
        pytest.skip(f'{package} is installed here')
    result = run_train(str(tmp_path / 'run'), data_dir, f'--{key}=True', check=False)
    assert result.returncode != 0 and result.stderr == (f"error: {key}=True needs the {package} "
                                                        f"package: pip install {package}, or set "
                                                        f"{key}=False\n")
    assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_nanogpt_config_runs_unchanged(tmp_path, data_dir):
    # nanoGPT's own shakespeare_char config file, shrunk from the command line to test size
    out = str(tmp_path / 'nano')
    cmd = ['config/shakespeare_char.py', '--dataset=toy', '--n_layer=1', '--n_head=2',
           '--n_embd=16', '--block_size=16', '--batch_size=4', '--max_iters=4',
           '--lr_decay_iters=4', '--warmup_iters=1', '--eval_interval=2', '--eval_iters=2']
    result = forked.run('train.py', *cmd, f'--data_dir={data_dir}', f'--out_dir={out}')
    assert result.returncode == 0, result.stderr
    config = json.load(open(os.path.join(out, 'config.json')))
    assert config['dropout'] == {'value': 0.2, 'source': 'config/shakespeare_char.py'}
    assert (os.path.exists(os.path.join(out, 'best.pt'))
            and os.path.exists(os.path.join(out, 'last.pt')))


# the first case in a fresh interpreter: nothing printed while importing adds to the one line (the
# imports are the same whatever the mistake); the others forked, as most runs of the suite
@pytest.mark.parametrize('args, message', [
    pytest.param(['--device=mps'],
                 "error: device='mps' is not supported: use device=cpu, cuda, cuda:N or auto",
                 marks=pytest.mark.fresh),
    (['--device=cuda'], "error: device='cuda' but CUDA is not available here: use device=cpu"),
    (['--checkpoint_interval=-1'], "error: checkpoint_interval=-1 must not be negative"),
    # each worker a process: thousands of them took the machine's memory
    (['--num_workers=100000'], f"error: num_workers=100000 is more than this machine's "
                               f"{os.cpu_count()} CPUs: use at most {os.cpu_count()} (0 loads in "
                               f"the training process)"),
    (['--lr_schedule=linear'], "error: lr_schedule='linear': use 'cosine' or 'wsd'"),
    # a negative clip flips the gradients
    (['--grad_clip=-1'], "error: grad_clip=-1.0 must not be negative"),
    (['--beta1=2'], "error: beta1=2.0, beta2=0.95 and muon_momentum=0.95 must each be in [0, 1)"),
    # auto starts from a resume_from it was given: a missing one is not a run from scratch
    (['--init_from=auto', '--resume_from=nope.pt'],
     "error: checkpoint nope.pt does not exist, so there is nothing to resume (a run stopped "
     "before its first checkpoint starts again with init_from=scratch or auto): check out_dir / "
     "resume_from"),
    # numpy's RNG takes no seed from 2**32: a traceback after the model was built
    (['--seed=4294967296'], "error: seed=4294967296 is too large: numpy's RNG takes seeds below "
     "2**32, and rank r seeds seed + r: use a seed of at most 4294967295"),
    # a floor above the peak: the decay would raise the rate
    (['--min_lr=1e-2'], "error: min_lr=0.01 is above learning_rate=0.003: the decay would raise "
     "the rate to it: use a min_lr of at most learning_rate, or decay_lr=False"),
    # past the run's end: nothing would be profiled
    (['--profile_iter=41'], "error: profile_iter=41 is past max_iters=40, so no iteration would be "
     "profiled: use one of 1 to 40 (0: off)"),
    # a scratch run would ignore it and train from random weights
    (['--resume_from=x/last.pt'], "error: resume_from='x/last.pt' is read only by init_from=resume "
     "or auto, and init_from='scratch' ignores it: add --init_from=resume, or leave resume_from "
     "out"),
    # thousands of OpenMP threads ended in a traceback from a fork that could not start
    (['--threads=100000'], f"error: threads=100000 is more than this machine's {os.cpu_count()} "
     f"CPUs: use at most {os.cpu_count()}, or 0 for torch's own count"),
    # a path with a typo
    (['--init_from=nowhere/model'], "error: init_from='nowhere/model' does not exist: use "
     "'scratch', 'resume', 'auto', a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or the "
     "path of a Hugging Face model folder or .safetensors file"),
])
def test_mistakes_are_one_line_exit_2_nothing_written(tmp_path, data_dir, args, message):
    if args == ['--device=cuda'] and torch.cuda.is_available():
        pytest.skip('this machine has CUDA')
    result = run_train(str(tmp_path / 'never'), data_dir, *args, check=False)
    assert result.returncode == 2 and result.stderr == message + '\n'
    assert not (tmp_path / 'never').exists()


@pytest.mark.slow
def test_a_key_typed_that_the_run_never_reads_is_said_and_may_go_on_resume(tmp_path, data_dir):
    # a sweep over --muon_lr with optimizer='adamw' would train one run again and again; a config
    # file serves several settings (shakespeare_char_fast.py's Muon keys under --optimizer=adamw)
    config = tmp_path / 'muon.py'
    config.write_text("muon_lr = 0.05\nwsd_decay_frac = 0.5\n")
    out = str(tmp_path / 'run')
    result = run_train(out, data_dir, str(config), '--dtype=float32', '--init_scale=1024',
                       '--muon_dtype=float32', '--max_iters=2', '--eval_interval=2',
                       '--backend=gloo')
    warnings = [line for line in result.stdout.splitlines() if line.startswith('warning:')]
    assert warnings == [
        "warning: backend='gloo' is read only with torchrun, so this run ignores it: add torchrun "
        "--standalone --nproc_per_node=N, or leave backend out",
        "warning: muon_dtype='float32' is read only with optimizer='muon', so this run ignores it: "
        "add --optimizer=muon, or leave muon_dtype out",
        "warning: init_scale=1024.0 is read only with dtype='float16', so this run ignores it: add "
        "--dtype=float16, or leave init_scale out"]
    assert warnings[1] in open(os.path.join(out, 'train.log')).read()
    # as the line says: left out, they change nothing, and the resume goes on
    run_train(out, data_dir, '--dtype=float32', '--init_from=resume', '--max_iters=4',
              '--eval_interval=2')
    assert [r['step'] for r in read_metrics(out, 'train')] == [1, 2, 3, 4]


def test_unread_names_the_keys_each_setting_leaves_unread():
    base = {'optimizer': 'muon', 'decay_lr': True, 'lr_schedule': 'wsd', 'dtype': 'auto',
            'wandb_log': True, 'eval_tasks': 'task.jsonl', 'eval_only': False}
    assert preflight.unread(base) == {}  # 'auto' may be float16
    assert set(preflight.unread(base | {'optimizer': 'adamw'})) == {
        'muon_lr', 'muon_momentum', 'muon_dtype'}
    assert preflight.unread(base | {'lr_schedule': 'cosine'}) == {
        'wsd_decay_frac': ("lr_schedule='wsd'", '--lr_schedule=wsd')}
    assert set(preflight.unread(base | {'decay_lr': False})) == {
        'lr_schedule', 'wsd_decay_frac', 'warmup_iters', 'lr_decay_iters', 'min_lr'}
    for dtype in ('float32', 'bfloat16'):
        assert set(preflight.unread(base | {'dtype': dtype})) == {'init_scale',
                                                                   'max_consecutive_skips'}
    assert set(preflight.unread(base | {'wandb_log': False})) == {'wandb_project',
                                                                  'wandb_run_name'}
    assert set(preflight.unread(base | {'eval_tasks': ''})) == {'eval_tasks_examples'}
    assert preflight.unread(base | {'eval_only': True})['max_iters'] == ('training',
                                                                          '--eval_only=False')


@pytest.mark.slow
def test_zero_learning_rate_without_warmup_runs(tmp_path, data_dir):
    out = str(tmp_path / 'lr0')
    run_train(out, data_dir, '--learning_rate=0', '--warmup_iters=0', '--max_iters=3',
              '--eval_interval=3')
    assert [r['lr'] for r in read_metrics(out, 'train')] == [0.0, 0.0, 0.0]


@pytest.fixture(scope='module')
def short_run(tmp_path_factory, data_dir):
    """One run that the tests of its log lines and records share: 30 iterations of 2
    micro-batches."""
    out = str(tmp_path_factory.mktemp('short') / 'run')
    return out, run_train(out, data_dir, '--max_iters=30', '--lr_decay_iters=30',
                          '--eval_interval=30', '--gradient_accumulation_steps=2')


@pytest.mark.slow
def test_start_up_says_what_it_does_and_how_long_the_run_will_take(short_run):
    lines = short_run[1].stdout.splitlines()
    first_iter = next(i for i, l in enumerate(lines) if l.startswith('iter 1/'))
    assert any(l.startswith('building the model') for l in lines[:first_iter])
    # 2 micro-batches per step: the second one's time is known within the first step
    estimate = next(l for l in lines[:first_iter] if l.startswith('a micro-batch after the first '
                                                                  'took'))
    assert ('s per iteration' in estimate
            and re.search(r', \d+ s for the 29 left$', estimate)), estimate
    # the train lines' ETA in the same units as the estimate: seconds for a run of seconds
    assert re.search(r', ETA \d+ s$',
                     next(l for l in lines if l.startswith('iter 1/'))), lines[first_iter]


@pytest.mark.slow
def test_live_log_line(short_run):
    out, result = short_run
    line = next(l for l in result.stdout.splitlines() if l.startswith('iter 5/30'))
    for part in ('loss', 'lr', 'grad norm', 'tok/s', 'MFU', 'util', 'mem', 'MB', 'ETA'):
        assert part in line, line
    record = read_metrics(out, 'train')[4]
    assert 0 < record['mfu'] < 1 and record['peak_mem_mb'] > 0 and record['utilization'] > 0
    assert f"util {record['utilization']:.0%}," in line


@pytest.mark.slow
def test_eta_is_the_mean_of_the_last_ten_intervals_without_the_first(short_run):
    """The session's first interval holds one-time work (compilation, warm-up): the ETA starts from
    the estimate (the second micro-batch's time) and then follows the mean time per iteration of the
    last 10 intervals, so a slow spell moves it at once, by its share of those intervals."""
    steps = read_metrics(short_run[0], 'train')
    estimate = read_metrics(short_run[0], 'estimate')[0]['seconds_per_iter']
    tokens_per_iter = 2 * 8 * 32
    # each record's own interval: one iteration
    seconds = [tokens_per_iter / r['tokens_per_sec'] for r in steps]
    assert steps[0]['eta_seconds'] == pytest.approx(29 * estimate, rel=1e-6)
    for k in range(1, 30):
        recent = seconds[max(1, k - 9):k + 1]
        assert steps[k]['eta_seconds'] == pytest.approx((30 - steps[k]['step']) * sum(recent)
                                                        / len(recent), rel=1e-6, abs=1e-9)


@pytest.mark.slow
def test_one_time_work_in_the_first_micro_batch_is_left_out_of_estimate_and_eta(tmp_path, data_dir):
    """What compilation does to the first micro-batch (here: 3 s of sleep in its loss,
    tests/probe.py) must not reach the start-up estimate or the ETA; the step itself takes
    milliseconds."""
    out = str(tmp_path / 'slow_start')
    result = forked.run(PROBE, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}', f'--out_dir={out}',
                        '--max_iters=6', '--eval_interval=6',
                        env={**os.environ, 'PROBE_SLEEP': '1-1:3'})
    assert result.returncode == 0, result.stderr
    assert read_metrics(out, 'estimate')[0]['seconds_per_iter'] < 1
    # 3 s x 5 iterations left, were it in
    assert all(r['eta_seconds'] < 5 for r in read_metrics(out, 'train')[1:])


@pytest.mark.slow
def test_a_device_left_idle_is_said_once_with_the_likely_cause(tmp_path, data_dir):
    """Each train record carries how busy the device was over its interval; on a CPU, the process's
    CPU time over the wall time of torch's threads. A run whose device stays idle for 3 log
    intervals and 5 s (here a 1 s wait in each of iterations 3 to 9, as a slow loader would make,
    tests/probe.py) says so once, with the likely cause."""
    out = str(tmp_path / 'idle')
    result = forked.run(PROBE, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}', f'--out_dir={out}',
                        '--max_iters=9', '--eval_interval=9',
                        env={**os.environ, 'PROBE_SLEEP': '3-9:1'})
    assert result.returncode == 0, result.stderr
    assert all(r['utilization'] < 0.5 for r in read_metrics(out, 'train')[2:])  # steps take ms
    said = [line for line in result.stdout.splitlines() if 'of the time for' in line]
    assert len(said) == 1 and re.fullmatch(
        r"torch's 1 thread\(s\) were busy less than 50% of the time for [5-7] log intervals in a "
        r"row \([5-7] s\), \d+% in the last: (other work keeps [\d.]+ CPUs busy|its threads "
        r"wait, for the data loader \(raise num_workers\) or the disk)", said[0]), result.stdout


@pytest.mark.slow
@pytest.mark.parametrize('device', DEVICES)
def test_the_smoke_test_changes_nothing_after_it_and_stops_a_model_that_cannot_learn(tmp_path,
                                                                                     data_dir,
                                                                                     device):
    """Before the first step of a run from scratch: steps on one batch must lower its loss; then the
    run, dropout's masks and float16's loss scale included, is bitwise the run without it. Not on
    resume. A model that cannot learn (a learning rate of 0) ends in one line, exit code 2, no
    checkpoint."""
    off, on = str(tmp_path / 'off'), str(tmp_path / 'on')
    # float16 from a scale that overflows: the smoke steps lower it, and it must come back
    args = ['--max_iters=6', '--eval_interval=3', '--dropout=0.1', '--dtype=float16',
            f'--init_scale={2.0 ** 40}', f'--device={device}',
            f'--deterministic={device == "cuda"}']
    run_train(off, data_dir, *args)
    result = run_train(on, data_dir, *args, '--smoke_steps=60', '--write_report=True')
    losses = [[r['loss'] for r in read_metrics(d, 'train')] for d in (off, on)]
    assert losses[0] == losses[1]
    ckpts = [torch.load(os.path.join(d, 'last.pt'), weights_only=True) for d in (off, on)]
    assert all(torch.equal(ckpts[0]['model'][k], v) for k, v in ckpts[1]['model'].items())
    [smoke] = read_metrics(on, 'smoke')
    # it passes at the first step whose loss has fallen 10%: here after float16's skipped steps
    # (about 24 from 2^40), long before the 60 allowed
    assert smoke['passed'] and 2 <= smoke['steps'] < 60 and smoke['max_steps'] == 60
    assert smoke['last_loss'] <= 0.9 * smoke['first_loss']
    assert smoke['first_loss'] == losses[1][0]  # its batch is the first step's, its state too
    line = (f"smoke test: {smoke['steps']} steps on one batch took its loss from "
            f"{smoke['first_loss']:.4f} to {smoke['last_loss']:.4f} in")
    assert line in result.stdout and line in open(os.path.join(on, 'train.log')).read()
    assert (f"Smoke test: passed, {smoke['steps']} steps on one batch"
            in open(os.path.join(on, 'report.md')).read())
    resumed = run_train(on, data_dir, *args, '--smoke_steps=10', '--init_from=resume',
                        '--max_iters=9')
    assert 'smoke test' not in resumed.stdout and len(read_metrics(on, 'smoke')) == 1
    bad = str(tmp_path / 'bad')
    # without dropout: the same loss at every step
    result = run_train(bad, data_dir, *args, '--smoke_steps=5', '--learning_rate=0',
                       '--dropout=0.0', '--dtype=float32', check=False)
    [error] = result.stderr.strip().splitlines()
    assert result.returncode == 2 and re.fullmatch(
        r"error: smoke test: 5 steps on one batch took its loss from ([\d.]+) to \1 in [\d.]+ s, "
        r"not below 90% of it: this model does not learn \(a loss detached from the weights, a "
        r"learning rate of 0\?\); smoke_steps=0 skips the test", error), result.stderr
    assert error in open(os.path.join(bad, 'train.log')).read()
    assert not [f for f in os.listdir(bad) if f.endswith('.pt')]


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_starts_again(tmp_path, data_dir):
    out = tmp_path / 'run'
    out.mkdir()
    # what a run killed at start-up leaves
    (out / 'metrics.jsonl').write_text('{"kind": "start", "step": 0, "time": 0}\n')
    result = run_train(str(out), data_dir, '--init_from=resume', '--max_iters=2', check=False)
    assert (result.returncode == 2
            and 'does not exist, so there is nothing to resume' in result.stderr)
    assert 'init_from=scratch or auto' in result.stderr
    run_train(str(out), data_dir, '--max_iters=2', '--eval_interval=2')  # scratch reuses it
    assert ([r['kind'] for r in read_metrics(str(out))][0] == 'start'
            and len(read_metrics(str(out), 'start')) == 1)
