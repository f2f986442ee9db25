"""Unit tests: the model's contract, the samplers' coverage and sharding, the configurator's errors,
older checkpoints migrated."""
import contextlib
import copy
import errno
import fcntl
import functools
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import checkpoint
import data
import datafiles
import distributed
import evaluate
import exits
import perf
import precision
import preflight
import prepare
import runlog
from configurator import ConfigError, configure
from conftest import DEVICES, OLD_CHECKPOINTS, REPO, epoch_batches
from model import GPT, GPTConfig


def tiny_gpt(**kw):
    return GPT(GPTConfig(**{**dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32),
                            **kw}))


def test_forward_contract():
    model = tiny_gpt()
    logits = model(torch.randint(0, 50, (3, 16)))
    assert logits.shape == (3, 16, 50) and logits.dtype == torch.float32
    # shorter than block_size is fine
    assert model(torch.randint(0, 50, (2, 5))).shape == (2, 5, 50)
    with pytest.raises(ValueError, match='block_size'):
        model(torch.randint(0, 50, (1, 17)))


def test_attention_runs_in_float32_under_bfloat16_on_cpu(monkeypatch):
    model = tiny_gpt()
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, 'scaled_dot_product_attention',
                        lambda q, k, v, **kw: (seen.append((q.dtype, k.dtype, v.dtype))
                                               or sdpa(q, k, v, **kw)))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        logits = model(torch.randint(0, 50, (2, 16)))
    assert logits.dtype == torch.bfloat16 and seen == [(torch.float32,) * 3] * model.config.n_layer
    seen.clear()
    model(torch.randint(0, 50, (2, 16)))  # float32 stays float32
    assert seen == [(torch.float32,) * 3] * model.config.n_layer


def test_causal_and_tied():
    model = tiny_gpt().eval()
    idx = torch.randint(0, 50, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 50
    a, b = model(idx), model(changed)
    assert torch.equal(a[0, :10], b[0, :10])  # positions before 10 cannot see token 10
    assert not torch.equal(a[0, 10:], b[0, 10:])
    assert model.lm_head.weight is model.wte.weight


def test_init_and_param_groups():
    model = tiny_gpt(bias=True)
    proj = model.blocks[0].mlp.c_proj.weight.std().item()
    assert abs(proj - 0.02 / math.sqrt(2 * 2)) < 0.004  # residual projections scaled down
    assert torch.all(model.blocks[0].attn.c_attn.bias == 0)
    [adamw] = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95)).optimizers
    decay, no_decay = adamw.param_groups
    decay_ids = {id(p) for p in decay['params']}
    assert id(model.blocks[0].attn.c_attn.weight) in decay_ids
    assert id(model.wte.weight) not in decay_ids and id(model.wpe.weight) not in decay_ids
    assert (id(model.blocks[0].ln_1.weight) not in decay_ids
            and id(model.blocks[0].attn.c_attn.bias) not in decay_ids)
    assert decay['weight_decay'] == 0.1 and no_decay['weight_decay'] == 0.0


@pytest.fixture
def token_file(tmp_path):
    """A split of 1000 tokens in shards of 300, 0, 450 and 250: windows cross shard boundaries."""
    tokens = np.arange(1000, dtype=np.uint16) % 7
    paths = [tmp_path / f'x_train_{i:06d}.bin' for i in range(4)]
    for path, piece in zip(paths, np.split(tokens, [300, 300, 750])):
        path.write_bytes(prepare.SHARD.header(len(piece), np.uint16) + piece.tobytes())
    return paths, tokens


@pytest.mark.parametrize('world_size', [1, 2, 3])
def test_eval_covers_every_token_once(token_file, world_size):
    path, tokens = token_file
    ds = data.TokenWindows(path, 64)
    seen = []  # (position of the predicted token, its value)
    for rank in range(world_size):
        for batch in data.EvalSampler(ds.num_tokens, 64, 4, 0, rank, world_size):
            assert len(batch) == 4  # full: a compiled model compiles one batch shape
            for start in batch:
                x, y, _ = ds[start]
                for i, target in enumerate(y.tolist()):
                    if target != data.IGNORE_INDEX:
                        seen.append(start + 1 + i)
                        assert target == tokens[start + 1 + i] and x[i] == tokens[start + i]
    # every token but the first is a target exactly once
    assert sorted(seen) == list(range(1, 1000))
    # a rank left without windows has no batch, not an empty one (a window, two ranks)
    assert list(data.EvalSampler(65, 64, 4, 0, 1, 2)) == []


def test_eval_cap_is_fixed_and_spread(token_file):
    path, _ = token_file
    first = [s for b in data.EvalSampler(1000, 10, 4, max_windows=8) for s in b]
    again = [s for b in data.EvalSampler(1000, 10, 4, max_windows=8) for s in b]
    assert first == again and len(first) == 8 and first[0] == 0 and first[-1] == 990


def test_a_loader_worker_hands_over_each_batch_as_one_tensor(token_file):
    """Each tensor a worker returns costs the training process a socket connection: a batch comes
    over as one tensor, and Batches gives back its windows' x, y and starts."""
    windows = data.TokenWindows(token_file[0], 8)
    sampler = data.EvalSampler(windows.num_tokens, 8, 4, 0)  # the last batch ends in empty windows
    loader = data.make_loader(windows, sampler, 1, 0, False)
    assert isinstance(next(iter(loader)), torch.Tensor)
    for (x, y, starts), batch in zip(data.Batches(loader, 4), sampler, strict=True):
        expected = default_collate([windows[start] for start in batch])
        assert all(torch.equal(a, b) for a, b in zip((x, y, starts), expected, strict=True))


def test_train_shards_union_equals_one_process():
    one = data.TrainSampler(5000, 16, batch_size=8, global_batch=32, seed=3)
    ranks = [data.TrainSampler(5000, 16, batch_size=8, global_batch=32, seed=3, rank=r,
                               world_size=2)
             for r in range(2)]
    one_batches, rank_batches = epoch_batches(one, 0), [epoch_batches(s, 0) for s in ranks]
    steps = len(one_batches) // 4
    assert steps > 0 and all(len(b) == 2 * steps for b in rank_batches)
    # an optimizer step = 4 micro-batches on 1 process, 2 on each of 2 ranks
    for step in range(steps):
        single = sorted(s for b in one_batches[4 * step:4 * step + 4] for s in b)
        sharded = sorted(s for r in range(2) for b in rank_batches[r][2 * step:2 * step + 2]
                         for s in b)
        assert single == sharded
    assert not set(sum(rank_batches[0], [])) & set(sum(rank_batches[1], []))
    assert epoch_batches(one, 0) != epoch_batches(one, 1)  # reshuffled each epoch


def test_train_sampler_resumes_at_next_unseen_batch():
    straight = data.TrainSampler(3000, 16, batch_size=4, global_batch=4, seed=1)
    it = iter(straight)
    consumed = []
    for _ in range(100):  # crosses epoch boundaries (about 46 batches an epoch)
        consumed.append(next(it))
        straight.mark_consumed()
    state = straight.state_dict()
    expected = [next(it) for _ in range(30)]
    resumed = data.TrainSampler(3000, 16, batch_size=4, global_batch=4, seed=1)
    resumed.load_state_dict(state)
    assert state['epoch'] == 2 and [b for _, b in zip(range(30), resumed)] == expected


def test_train_sampler_resumes_on_another_number_of_ranks():
    two = [data.TrainSampler(5000, 16, batch_size=4, global_batch=16, seed=2, rank=r, world_size=2)
           for r in range(2)]
    for sampler in two:  # 3 optimizer steps of 2 micro-batches per rank
        for _ in range(6):
            sampler.mark_consumed()
    one = data.TrainSampler(5000, 16, batch_size=4, global_batch=16, seed=2)
    one.load_state_dict(two[0].state_dict())
    resumed = iter(one)
    # one process: 4 micro-batches a step
    next_step = sorted(s for _ in range(4) for s in next(resumed))
    expected = sorted(s for sampler in two for b in itertools.islice(iter(sampler), 2) for s in b)
    assert next_step == expected  # the 4th optimizer step's windows, whoever runs it


def test_train_sampler_holds_an_epoch_as_one_tensor_and_yields_its_batches_in_order():
    # 250k windows an epoch
    big = data.TrainSampler(4_000_000, 16, batch_size=8, global_batch=8, seed=0)
    tracemalloc.start()
    next(iter(big))
    # Python objects only: a tensor's memory is not traced
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1e6, (f'{peak / 1e6:.1f} MB of Python objects for one batch: the epoch was built '
                        f'as lists')
    small = data.TrainSampler(3000, 16, batch_size=4, global_batch=8, seed=1, rank=1, world_size=2)
    small.load_state_dict({'epoch': 1, 'position': 40})  # the 5th batch of this rank in epoch 1
    expected = epoch_batches(small, 1)[5:] + epoch_batches(small, 2) + epoch_batches(small, 3)[:3]
    assert list(itertools.islice(iter(small), len(expected))) == expected


def test_train_sampler_rejects_tiny_split():
    with pytest.raises(data.DataError, match='fewer than one optimizer step'):
        data.TrainSampler(100, 32, batch_size=8, global_batch=8, seed=0)


DEFAULTS = {'batch_size': 12, 'learning_rate': 6e-4, 'compile': False, 'device': 'auto',
            'out_dir': 'out'}


def test_configure_file_then_overrides(tmp_path):
    cfg = tmp_path / 'c.py'
    cfg.write_text("import math\nbatch_size = 4\nlearning_rate = 1\n")
    config, sources = configure(DEFAULTS,
                                [str(cfg), '--batch_size=8', '--device=cuda:1', '--out_dir=2024'])
    assert config == {'batch_size': 8, 'learning_rate': 1.0, 'compile': False, 'device': 'cuda:1',
                      'out_dir': '2024'}
    assert sources == {'batch_size': 'command line', 'learning_rate': str(cfg),
                       'compile': 'default', 'device': 'command line', 'out_dir': 'command line'}
    # as nanoGPT's, a file sees the settings before it, and may import functions
    derived = tmp_path / 'd.py'
    derived.write_text("from math import sqrt\nlearning_rate = sqrt(4) * learning_rate\n"
                       "batch_size = batch_size // 2\n")
    config, sources = configure(DEFAULTS, ['--batch_size=8', str(cfg), str(derived)])
    assert config['learning_rate'] == 2.0 and config['batch_size'] == 2
    assert sources['learning_rate'] == sources['batch_size'] == str(derived)
    assert sources['device'] == 'default'
    # a key set to its default is set there; a key given a function is refused, not passed over
    derived.write_text("compile = False\ndevice = print\n")
    with pytest.raises(ConfigError, match="device=<built-in function print> has type "):
        configure(DEFAULTS, [str(derived)])
    derived.write_text("compile = False\n")
    assert configure(DEFAULTS, [str(derived)])[1]['compile'] == str(derived)
    # keys another file sets, run by this one (nanoGPT's configurator runs files so): they were lost
    derived.write_text(f"exec(open({str(cfg)!r}).read())\ndevice = 'cpu'\n")
    config, sources = configure(DEFAULTS, [str(derived)])
    assert config['batch_size'] == 4 and sources['batch_size'] == str(derived)


@pytest.mark.parametrize('argv, message', [
    (['--batch_sise=8'], "unknown config key 'batch_sise': did you mean batch_size"),
    (['--batch_size=8.5'], "batch_size=8.5 has type float, expected int"),
    (['--compile=yes'], "cannot parse --compile=yes: write True or False$"),
    (['--batch_size=abc'], "cannot parse --batch_size=abc: write int like the default 12$"),
    (['--compile=1'], "compile=1 has type int, expected bool"),
    (['--batch_size'], "has no value"),
    (['nonsense'], "nor a --key=value override$"),
    (['missing.py'], "cannot read config file missing.py"),
])
def test_configure_errors(argv, message):
    with pytest.raises(ConfigError, match=message.replace('.', r'\.')):
        configure(DEFAULTS, argv)


def test_a_model_no_device_holds_is_refused_with_its_count_before_it_is_built(monkeypatch,
                                                                               capsys):
    """preflight.check_fits counts one block n_layer times: the whole model's count, each shape's
    parts included, and a typo's 100,000 layers answered at once (the meta device built them for
    minutes)."""
    monkeypatch.setattr(preflight.perf, 'device_memory', lambda device: 2**10)
    shape = dict(n_head=2, n_embd=16, block_size=8, vocab_size=20)
    for config in (GPTConfig(n_layer=3, **shape),
                   GPTConfig(n_layer=2, bias=True, tie_head=False, pos_emb='rope', qk_norm=True,
                             **shape),
                   GPTConfig(n_layer=100_000, **shape)):
        with pytest.raises(SystemExit):
            preflight.check_fits(config, 'cpu', False)
        if config.n_layer < 100_000:
            count = sum(p.numel() for p in GPT(config).parameters())
            assert f"error: the model's {count:,} parameters need " in capsys.readouterr().err
    assert "more than cpu's 0.0 GiB" in capsys.readouterr().err


def test_a_config_file_named_without_py_is_suggested(tmp_path):
    tiny = os.path.join(REPO, 'config', 'tiny')
    with pytest.raises(ConfigError) as refusal:
        configure(DEFAULTS, [tiny])
    assert str(refusal.value).endswith(f"override: did you mean {tiny}.py?")
    # a run's folder, as report.py takes it: sample.py's, evaluate.py's and verify.py's is out_dir
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'metrics.jsonl').write_text('')
    with pytest.raises(ConfigError) as refusal:
        configure(DEFAULTS, [str(run)])
    assert str(refusal.value).endswith(f"override: did you mean --out_dir={run}?")
    with pytest.raises(ConfigError) as refusal:  # another folder: no such guess
        configure(DEFAULTS, [str(tmp_path)])
    assert str(refusal.value).endswith("nor a --key=value override")


@pytest.mark.parametrize('argv, message', [
    (['--device=tpu'], "device='tpu': use 'auto', 'cpu' or 'cuda'"),
    (['--out_dir=x'], "out_dir='x': use 'out'"),  # one allowed value: no 'or'
    (['--batch_size=0'], "batch_size=0 must be at least 1"),
    # no number is, named or not
    (['--learning_rate=-0.1'], "learning_rate=-0.1 must not be negative"),
    # 1e999 parses as inf (a config file may also write float('nan')): no run can use either
    (['--learning_rate=1e999'], "learning_rate=inf is not finite: use a finite number, like the "
     "default 0.0006"),
])
def test_configure_checks_allowed_and_least_values_after_every_source(tmp_path, argv, message):
    limits = {'choices': {'device': ('auto', 'cpu', 'cuda'), 'out_dir': ('out',)},
              'minimums': {'batch_size': 1}}
    cfg = tmp_path / 'c.py'
    cfg.write_text("batch_size = 0\n")  # a config file's value a later override fixes is fine
    assert configure(DEFAULTS, [str(cfg), '--batch_size=2'], **limits)[0]['batch_size'] == 2
    with pytest.raises(ConfigError, match=f'^{re.escape(message)}$'):
        configure(DEFAULTS, argv, **limits)


def test_configure_file_that_exits_is_an_error(tmp_path):
    # sys.exit() in a config file ended the script with its code, silently (0: as if it had run)
    cfg = tmp_path / 'c.py'
    cfg.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match=f"^config file {re.escape(str(cfg))} failed: "
                                          f"SystemExit: 0$"):
        configure(DEFAULTS, [str(cfg)])


def test_configure_file_unknown_key(tmp_path):
    cfg = tmp_path / 'c.py'
    cfg.write_text("learnig_rate = 1e-3\n")
    with pytest.raises(ConfigError,
                       match="unknown config key 'learnig_rate': did you mean learning_rate"):
        configure(DEFAULTS, [str(cfg)])


def test_auto_dtype_is_timed_once_per_model_py(tmp_path, monkeypatch):
    import precision
    monkeypatch.setenv('HONESTGPT_CACHE', str(tmp_path))
    monkeypatch.delenv('HONESTGPT_AUTO_DTYPE', raising=False)
    monkeypatch.setattr(precision, 'bfloat16_units', lambda: True)  # so that it times on any CPU
    timed = []
    monkeypatch.setattr(precision, 'step_seconds', lambda *args: timed.append(args)
                        or {'float32': 2.0, 'bfloat16': 1.0})
    args = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50, dropout=0.0,
                bias=False)
    assert (precision.auto_dtype('cpu', args, 4)[0] == precision.auto_dtype('cpu', args, 4)[0]
            == 'bfloat16')
    assert len(timed) == 1  # the second run read the cache
    edited = tmp_path / 'model.py'
    edited.write_text(open(precision.inspect.getsourcefile(GPT)).read() + '# an edit\n')
    monkeypatch.setattr(precision.inspect, 'getsourcefile', lambda obj: str(edited))
    precision.auto_dtype('cpu', args, 4)
    assert len(timed) == 2  # an edited model is timed again


def test_auto_dtype_times_a_large_model_on_a_bounded_batch(monkeypatch):
    # GPT-2 124M's 12 x 1024 windows took 30 s a call on 2 cores, 8 calls: minutes before a run's
    # first line. The timed batch stays within MEASURE_FLOPS (and windows within MEASURE_TOKENS)
    import precision
    shapes = []

    def forward(self, idx, targets=None):  # records the batch instead of computing it
        shapes.append(tuple(idx.shape))
        return self.lm_head.weight.sum()
    monkeypatch.setattr(precision.GPT, 'forward', forward)

    def timed_batch(batch_size, **shape):
        args = dict(dict(n_layer=2, n_head=4, vocab_size=65, dropout=0.0, bias=False), **shape)
        shapes.clear()
        precision.step_seconds(args, batch_size, 'cpu', ('float32',))
        (B, T), = set(shapes)
        assert B * T * GPT(GPTConfig(**args)).flops_per_token() <= precision.MEASURE_FLOPS
        return B, T
    # 12 x 1024 windows of this 2-layer model would be 6 times MEASURE_FLOPS (GPT-2's 12 layers: 38)
    B, T = timed_batch(12, n_embd=768, block_size=1024)
    assert T == 1024 and B * T >= 1000
    # a long block: a shorter window (a token's matmuls are the same), not 100,000 tokens
    assert timed_batch(1, n_embd=64, block_size=100_000) == (1, 1296)
    assert timed_batch(12, n_embd=64, block_size=64) == (12, 64)  # a small model: its micro-batch


def test_processes_that_measure_at_once_take_turns_and_agree(tmp_path, monkeypatch):
    # four runs started together ask for one figure, each of which would measure another value:
    # the first measures, the others wait for it and read its figure (dtype='auto' then agrees)
    monkeypatch.setenv('HONESTGPT_CACHE', str(tmp_path))
    measured = tmp_path / 'measured'

    def ask(answers):
        def measure():
            with open(measured, 'a') as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(0.3)  # long enough for the others to arrive meanwhile
            return {'pid': os.getpid()}
        answers.put(perf.cached('key', measure)['pid'])
    context = multiprocessing.get_context('fork')
    answers = context.Queue()
    processes = [context.Process(target=ask, args=(answers,)) for _ in range(4)]
    for process in processes:
        process.start()
    pids = [answers.get(timeout=60) for _ in processes]
    for process in processes:
        process.join()
    assert len(set(pids)) == 1 and len(measured.read_text().split()) == 1
    # a process stopped while it holds the lock holds up the others for a while, not for ever
    with open(tmp_path / 'perf.json.lock', 'a') as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        start = time.time()
        with perf.locked(held.name, wait=0.5):
            assert 0.5 <= time.time() - start < 5

    def no_locks(*args):
        raise OSError(errno.ENOLCK, 'No locks available')
    monkeypatch.setattr(perf.fcntl, 'flock', no_locks)  # some NFS mounts: measured all the same
    assert perf.cached('another key', lambda: {'pid': os.getpid()})['pid'] == os.getpid()


def test_resolve_dtype_keeps_a_resumed_choice_and_refuses_a_forced_nonsense(monkeypatch):
    import precision
    args = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50, dropout=0.0,
                bias=False)
    monkeypatch.setattr(precision, 'auto_dtype', lambda *a: ('bfloat16', {'rule': 'measured'}))
    assert (precision.resolve_dtype('float16', 'cpu', args, 4)
            == ('float16', {'rule': 'set in the config'}))
    assert precision.resolve_dtype('auto', 'cpu', args, 4) == ('bfloat16', {'rule': 'measured'})
    # a resume continues in the run's dtype even where a measurement now would choose another
    dtype, how = precision.resolve_dtype('auto', 'cpu', args, 4, ('out/last.pt', 'float32'))
    assert dtype == 'float32' and 'out/last.pt' in how['rule']
    monkeypatch.setattr(precision, 'auto_dtype',
                        lambda *a: ('fp8', {'rule': 'forced by HONESTGPT_AUTO_DTYPE'}))
    with pytest.raises(ValueError,
                       match='HONESTGPT_AUTO_DTYPE=fp8: use float32, bfloat16 or float16'):
        precision.resolve_dtype('auto', 'cpu', args, 4)


def test_usable_cpus_are_the_affinity_capped_by_every_cgroup_quota_above(tmp_path):
    """A container's CPU quota (cgroup v2's cpu.max) may sit on this process's group or any above
    it; a quota of 1.5 CPUs is 1 whole CPU, 'max' is none."""
    affinity = len(os.sched_getaffinity(0))
    root = tmp_path / 'cgroup'
    (root / 'job' / 'step').mkdir(parents=True)
    proc = tmp_path / 'proc_cgroup'
    proc.write_text('0::/job/step\n')
    (root / 'cpu.max').write_text('max 100000\n')
    assert distributed.usable_cpus(str(root), str(proc)) == affinity
    (root / 'job' / 'cpu.max').write_text('150000 100000\n')
    (root / 'job' / 'step' / 'cpu.max').write_text('max 100000\n')
    assert distributed.usable_cpus(str(root), str(proc)) == 1
    proc.write_text('12:cpu,cpuacct:/job\n')  # cgroup v1 only: no quota read
    assert distributed.usable_cpus(str(root), str(proc)) == affinity


def test_threads_are_the_key_s_else_torch_s_own_count_capped_by_a_container_s_quota(monkeypatch):
    """torch's own count: OMP_NUM_THREADS where set (torchrun sets 1), else its affinity's cores,
    which a cgroup quota (usable_cpus) does not cap; more threads than the machine's CPUs are
    refused."""
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv('OMP_NUM_THREADS')
        monkeypatch.setattr(distributed.os, 'cpu_count', lambda: 8)
        with pytest.raises(ValueError, match="threads=9 is more than this machine's 8 CPUs"):
            distributed.set_threads(9)
        for own, usable, threads in ((4, 8, 4), (4, 2, 2)):
            torch.set_num_threads(own)
            monkeypatch.setattr(distributed, 'usable_cpus', lambda: usable)
            distributed.set_threads(0)
            assert torch.get_num_threads() == threads
        distributed.set_threads(3)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv('OMP_NUM_THREADS', '4')  # asked for: past the quota too
        torch.set_num_threads(4)
        distributed.set_threads(0)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_how_busy_other_work_keeps_the_cpus_is_measured_from_proc_stat(tmp_path, monkeypatch):
    stat = tmp_path / 'stat'
    cpus = sorted(os.sched_getaffinity(0))
    # ticks: user nice system idle iowait irq softirq steal; each CPU 3/4 busy between the reads
    rows = lambda busy, idle: ''.join(f'cpu{c} {busy} 0 0 {idle} 0 0 0 0\n' for c in cpus)
    stat.write_text('cpu  0 0 0 0 0 0 0 0\n' + rows(100, 100))
    monkeypatch.setattr(perf.time, 'sleep', lambda s: stat.write_text(rows(175, 125)))
    monkeypatch.setattr(distributed, 'usable_cpus', lambda: len(cpus))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert (distributed.cpu_use(stat=str(stat))
                == {'usable': len(cpus), 'busy': 0.75 * len(cpus)})
        # a stat that leaves out a CPU this process may use counts the CPUs it lists
        stat.write_text('cpu  0 0 0 0 0 0 0 0\n' + rows(100, 100).split('\n', 1)[1])
        assert distributed.cpu_use(stat=str(stat))['busy'] == 0.75 * (len(cpus) - 1)
        # one that lists none of them (numbered otherwise) measures nothing: not 0 busy
        stat.write_text(rows(100, 100).replace('cpu', 'cpu1000'))
        assert distributed.cpu_use(stat=str(stat))['busy'] is None
        torch.set_num_threads(1)  # one thread waits for no other: nothing to measure
        assert distributed.cpu_use(stat=str(stat)) == {'usable': len(cpus), 'busy': None}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize('threads, usable, busy, fix', [
    (2, 2, 0.9, 1), (8, 8, 6.0, 2), (2, 2, 0.3, None), (1, 2, 5.0, None), (4, 8, 3.0, None),
    (8, 2, 0.0, 2), (2, 2, None, None)])
def test_threads_beyond_the_free_cpus_are_said_once_with_the_fix(threads, usable, busy, fix):
    warning = distributed.busy_warning(threads, {'usable': usable, 'busy': busy})
    if fix is None:
        assert warning == ''
    else:
        assert warning.startswith(f'warning: {threads} threads, but ')
        assert warning.endswith(f'use --threads={fix}, or wait until the machine is free')


def test_a_missing_config_file_names_config_s_files_and_the_closest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the repo's root, as the scripts run
    (tmp_path / 'config').mkdir()
    (tmp_path / 'config' / 'tiny.py').write_text('')
    (tmp_path / 'mine').mkdir()
    (tmp_path / 'mine' / 'big.py').write_text('')
    for missing, hint in (('tinny.py', "did you mean config/tiny.py? config/ holds tiny.py"),
                          ('mine/bigg.py', "did you mean mine/big.py? mine/ holds big.py; "
                                           "config/ holds tiny.py")):
        with pytest.raises(ConfigError) as e:
            configure({'n': 1}, [missing])
        assert str(e.value) == (f"cannot read config file {missing}: No such file or directory "
                                f"({hint})")
    monkeypatch.chdir(tmp_path / 'mine')
    with pytest.raises(ConfigError, match=r'\(no config file is in nowhere/\)$'):
        configure({'n': 1}, ['nowhere/x.py'])


def test_a_misspelt_dataset_names_the_closest_prepared_one(tmp_path):
    for name in ('shakespeare_char', 'toy'):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'meta.json').write_text('{"vocab_size": 65, "tokenizer": "gpt2"}')
    with pytest.raises(data.DataError, match=f"did you mean 'shakespeare_char'\\? {tmp_path} holds "
                                             f"shakespeare_char, toy; run python prepare.py "
                                             f"shakespear_char"):
        datafiles.open_dataset(str(tmp_path), 'shakespear_char')
    with pytest.raises(data.DataError, match="did you mean 'pystdlib_char'\\? .* run python "
                                             "prepare.py pystdlib_chr"):  # one prepare.py makes
        datafiles.open_dataset(str(tmp_path), 'pystdlib_chr')


def test_a_missing_dataset_s_prepare_command_writes_where_the_run_looks(tmp_path, monkeypatch):
    # a name prepare.py makes is no misspelling: no other name is offered
    missing = tmp_path / 'no dir'
    with pytest.raises(data.DataError) as e:
        datafiles.open_dataset(str(missing), 'shakespeare_char')
    assert 'did you mean' not in str(e.value)
    # it downloads the text
    assert (f"run python prepare.py shakespeare_char --data_dir '{missing}' (or set data_dir; "
            f"offline: --input PATH)" in str(e.value))
    monkeypatch.chdir(tmp_path)  # prepare.py's default data_dir needs no --data_dir
    for data_dir in ('data', './data/'):
        with pytest.raises(data.DataError, match=r"run python prepare.py shakespeare_char \(or set "
                                                 r"data_dir; offline"):
            datafiles.open_dataset(data_dir, 'shakespeare_char')
    with pytest.raises(data.DataError, match=r"run python prepare.py mine --input PATH \(or set "
                                             r"data_dir\); for downloaded shards write it"):
        datafiles.open_dataset('data', 'mine')


def test_times_left_read_in_one_set_of_units():
    import runlog
    assert [runlog.duration(s) for s in (42, 89.6, 90, 3000, 5399, 5400, 36000, 259200, 3.2e8)] == [
        '42 s', '90 s', '1.5 min', '50.0 min', '90.0 min', '1.5 h', '10.0 h', '3.0 days',
        '3,703.7 days']


def test_the_done_line_says_whose_val_loss_best_pt_has(capsys, monkeypatch):
    # under ema_decay best_val_loss is the EMA's val loss; the eval lines show the raw weights' too
    monkeypatch.setattr(runlog, 'files', {name: io.StringIO() for name in runlog.LOGS})
    progress = checkpoint.Progress(iter_num=40, best_iter=20, best_val_loss=2.5, best_acc_norm=0.75)
    figures = {'ema': True, 'test_loss': None, 'tested_iter': 20, 'wall_seconds': 10.0,
               'eval_seconds': 2.0, 'save_seconds': 1.0, 'total_seconds': 10.0}
    runlog.done(progress, 'acc_norm', figures, 0)
    assert ("best acc_norm (the EMA of the weights) 0.7500 at iteration 20, val loss (the EMA of "
            "the weights) 2.5000 there;" in capsys.readouterr().out)
    # the test loss: with the best weights, or where no file held them the last
    # on how many of the split's windows: eval_iters' sample, or all of them
    tested = {**figures, 'test_loss': 2.0, 'test_windows': (8, 1743)}
    runlog.done(progress, 'acc_norm', tested, 0)
    assert (" 2.5000 there, test loss 2.0000 (2.885 bits/token) on 8 of its 1,743 windows with the "
            "best weights;" in capsys.readouterr().out)
    runlog.done(progress, 'acc_norm', {**tested, 'test_windows': (1743, 1743)}, 0)
    assert " on all its 1,743 windows with" in capsys.readouterr().out
    runlog.done(progress, 'acc_norm', {**tested, 'tested_iter': 40}, 0)
    assert (" with the last weights (out_dir has no best.pt of iteration 20);"
            in capsys.readouterr().out)


def test_long_steps_show_progress_as_lines_in_a_log_and_a_bar_on_a_terminal(capsys, monkeypatch):
    import runlog
    assert list(runlog.progress(range(4), 'eval val', every=3600)) == [0, 1, 2, 3]
    assert capsys.readouterr().out == ''  # quick: nothing
    assert list(runlog.progress(range(4), 'eval val', every=0)) == [0, 1, 2, 3]
    assert capsys.readouterr().out == ''.join(f'eval val: {i}/4 in 0 s\n' for i in range(1, 5))
    monkeypatch.setattr(sys.stdout, 'isatty', lambda: True)
    list(runlog.progress(range(2), 'tasks', every=0))
    assert capsys.readouterr().out == ('\rtasks: [##########          ] 1/2, 0 s'
                                       '\rtasks: [####################] 2/2, 0 s\n')


def padded_with_zeros(new, old):
    """new holds old's rows bit for bit, then rows of zeros (none where the shapes are the same)."""
    new, old = new.flatten(), old.flatten()
    return torch.equal(new[:len(old)], old) and not new[len(old):].any()


@pytest.mark.parametrize('name', OLD_CHECKPOINTS)
def test_an_older_checkpoint_migrates_to_this_code_s_layout_and_computes_what_it_did(name,
                                                                                     data_dir):
    path, migrated = OLD_CHECKPOINTS[name]
    with open(path, 'rb') as f:
        raw = f.read()
    old, new = torch.load(path, weights_only=True), checkpoint.load(path, resumable=True)
    with open(path, 'rb') as f:
        assert f.read() == raw  # migrated in memory: the file stays the old code's
    assert new['format'] == checkpoint.FORMAT
    assert new['migrated'] == f"migrated {path} from {migrated}"
    # this code's shapes (load_state_dict checks them): the old rows bit for bit, zeros below them
    model = GPT(GPTConfig(**new['model_args']))
    model.load_state_dict(new['model'])
    assert all(padded_with_zeros(new['model'][k], v) for k, v in old['model'].items())
    # the optimizers' state likewise, each moment in its parameter's shape
    optimizer = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), new['config']['optimizer'])
    optimizer.load_state_dict(new['optimizer'])
    assert all(v.shape == p.shape for p, state in optimizer.state.items() for k, v in state.items()
               if k != 'step')
    assert all(padded_with_zeros(n['state'][i][k], v)
               for o, n in zip(old['optimizer'], new['optimizer'], strict=True)
               for i, state in o['state'].items() for k, v in state.items())
    # one scheduler: each group's rate in the optimizers' order, at the step the old ones were at
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scheduler.load_state_dict(new['scheduler'])
    saved_lrs = [group['lr'] for state in new['optimizer'] for group in state['param_groups']]
    old_lrs = [lr for state in old['scheduler'] for lr in state['_last_lr']]
    assert scheduler.last_epoch == 2 and scheduler.get_last_lr() == saved_lrs == old_lrs
    assert [state['cuda'] for state in new['rng']] == [None]  # written on a CPU
    # the val loss the old code recorded at iteration 2 (its best), on the shards it recorded (as
    # its code fingerprinted them); to rounding, as the head's matmul has other shapes
    _, splits, identity = data.open_splits(data_dir, 'toy', model.config.block_size)
    assert datafiles.data_change(new['dataset'], identity, splits) == '' and old['best_iter'] == 2
    batch_size, eval_iters = new['config']['batch_size'], new['config']['eval_iters']
    windows = data.EvalSampler(splits['val'].num_tokens, model.config.block_size, batch_size,
                               eval_iters * batch_size)
    loader = data.make_loader(splits['val'], windows, 0, 0, False)
    val_loss = evaluate.loss(model, loader, 'cpu', precision.autocast('cpu', 'float32'))
    assert val_loss == pytest.approx(old['best_val_loss'], rel=1e-6)


def test_checkpoints_that_cannot_be_migrated_are_refused_in_one_line(tmp_path):
    old = torch.load(OLD_CHECKPOINTS['format3'][0], weights_only=True)
    refusals = [({**old, 'format': 2}, 'has format 2, written before datasets were shards'),
                ({**old, 'shards': 'shards-2'}, 'has format 3 and its weights in shards-2/')]
    for ckpt, message in refusals:
        torch.save(ckpt, tmp_path / 'last.pt')
        with pytest.raises(checkpoint.CheckpointError, match=message) as e:
            checkpoint.load(str(tmp_path / 'last.pt'))
        assert '\n' not in str(e.value)


def test_files_that_are_not_checkpoints_are_refused_in_one_line(tmp_path):
    # a model's weights alone (pytorch_model.bin) were called a format 1 checkpoint; torch's refusal
    # of a file that is no pickle of tensors opens with its advice to load it unsafely
    torch.save({'wte.weight': torch.zeros(2, 2)}, tmp_path / 'weights.bin')
    (tmp_path / 'notes.pt').write_text('not a checkpoint')
    for name, message in (('weights.bin', 'is not a train.py checkpoint (a dict without '
                           'model_args, such as a bare state_dict): pass the best.pt or last.pt'),
                          ('notes.pt', 'is unreadable (truncated or corrupt: not a torch.save '
                           'file of tensors and plain values): use another file')):
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(message)) as e:
            checkpoint.load(str(tmp_path / name))
        assert '\n' not in str(e.value) and 'weights_only' not in str(e.value)


def test_a_step_faster_than_the_peak_has_it_measured_again_once_a_run_then_raised(monkeypatch):
    """Measuring takes seconds: once a run, on a CPU; after that, and on a GPU (its datasheet), the
    interval's own FLOP/s is the peak. MFU never passes 100%."""
    measured = []
    monkeypatch.setattr(perf, 'peak_flops', lambda device, dtype, beaten: measured.append(beaten)
                        or (2 * beaten, 'measured again'))
    for device in ('cpu', 'cuda:0'):
        measured.clear()
        speed = perf.Speedometer(0, 10, 1, 1000, 1e3, 1e3, 1, device, torch.float32)
        speed.since -= 1.0  # 1,000 tokens of 1e3 FLOPs in a second: 1e6 FLOP/s, past the 1e3 peak
        interval = speed.interval(1)
        mfu, new_peak = interval['mfu'], interval['new_peak']
        if device == 'cpu':
            assert measured and new_peak == (2 * measured[0], 'measured again') and mfu == 0.5
        else:
            assert not measured and new_peak[1] == "a training step's, at iteration 1" and mfu == 1
        speed.since -= 0.01  # 100x faster: past the new peak too
        interval = speed.interval(2)
        mfu, new_peak = interval['mfu'], interval['new_peak']
        assert len(measured) == (device == 'cpu') and mfu == 1
        assert new_peak[1] == "a training step's, at iteration 2"


def test_an_evaluation_feeds_the_model_one_batch_shape_also_past_an_unreadable_batch(token_file):
    """A compiled model compiles a second graph for a second shape: every evaluation batch is full,
    and a batch that cannot be read (a shard changed under the run) becomes an empty one of the same
    shape, which counts nothing; the DataError comes after the batches."""
    import evaluate

    class Unreadable(data.TokenWindows):
        def __getitem__(self, start):
            if start == 8 * 4:  # the second batch's first window
                raise data.DataError('shard changed')
            return super().__getitem__(start)
    unreadable = Unreadable(token_file[0], 8)  # 125 windows: a last batch of 1, then 3 empty
    model, shapes = tiny_gpt(block_size=8), []
    model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    loader = data.make_loader(unreadable, data.EvalSampler(unreadable.num_tokens, 8, 4, 0), 0, 0,
                              False)
    with pytest.raises(data.DataError, match='shard changed'):
        evaluate.loss(model, loader, 'cpu', contextlib.nullcontext())
    assert len(shapes) == 32 and set(shapes) == {(4, 8)}


def test_evaluations_and_task_scores_say_how_far_they_have_got(token_file, capsys, monkeypatch):
    """evaluate.loss and evaluate.score go through runlog.progress (a line every 10 s; here, at
    once)."""
    import evaluate
    import runlog
    monkeypatch.setattr(evaluate, 'progress', functools.partial(runlog.progress, every=0))
    windows = data.TokenWindows(token_file[0], 8)
    loader = data.make_loader(windows, data.EvalSampler(windows.num_tokens, 8, 4, 0), 0, 0, False)
    model = tiny_gpt(block_size=8)
    evaluate.loss(model, loader, 'cpu', contextlib.nullcontext(), 'eval val')
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f'eval val: {i}/{len(loader)} in 0 s' for i in range(1, len(loader) + 1)]
    examples = [evaluate.Example([[1, 2, 3], [1, 2, 4]], [1, 1], 0)] * 3
    evaluate.score(model, examples, 2, 'cpu', contextlib.nullcontext())
    assert capsys.readouterr().out.splitlines() == ['tasks: 1/2 in 0 s', 'tasks: 2/2 in 0 s']


def test_git_state_is_the_checkout_s_commit_and_whether_anything_changed(tmp_path):
    def git(*args):
        result = subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *args],
                                cwd=tmp_path, capture_output=True, text=True, check=True)
        return result.stdout.strip()
    assert runlog.git_state(str(tmp_path)) == ('unknown', None)  # not a repository
    git('init', '-q')
    (tmp_path / 'train.py').write_text('x = 1\n')
    git('add', '.')
    git('commit', '-qm', 'one')
    assert runlog.git_state(str(tmp_path)) == (git('rev-parse', 'HEAD'), False)
    (tmp_path / 'train.py').write_text('x = 2\n')  # an edit
    assert runlog.git_state(str(tmp_path)) == (git('rev-parse', 'HEAD'), True)
    git('checkout', '-q', 'train.py')
    (tmp_path / 'model.py').write_text('')  # a file git does not track yet
    assert runlog.git_state(str(tmp_path)) == (git('rev-parse', 'HEAD'), True)


def test_a_profiled_iteration_warns_of_nothing():
    """torch 2.11 warns on a profiler's first start that each cycle's events are cleared: a line in
    every profiled run's log that means nothing for the one cycle profiled. A fresh interpreter: the
    warning is shown once per process."""
    code = ("import torch, perf\n"
            "profiler = perf.start_profiler('cpu')\n"
            "with torch.profiler.record_function('forward'):\n"
            "    torch.ones(64, 64) @ torch.ones(64, 64)\n"
            "print(perf.stop_profiler(profiler, 'cpu', None)['forward'] > 0)\n")
    result = subprocess.run([sys.executable, '-W', 'error::UserWarning', '-c', code],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, 'True\n'), result.stderr


def test_fit_batch_halves_until_a_step_fits_keeps_the_global_batch_and_undoes_each_try(
        capsys, monkeypatch):
    import smoke
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    parts = dict(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                 scaler=torch.amp.GradScaler('cpu', enabled=False))
    before, rng, tried, fits = copy.deepcopy(model.state_dict()), torch.get_rng_state(), [], 3

    def try_step(size, *data):  # a step, then out of memory above `fits`: a GPU's or a CPU's
        tried.append(size)
        model(torch.randn(size, 4)).square().sum().backward()
        parts['optimizer'].step()
        if size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if size > fits:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                               "2147483648 bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(smoke, 'try_step', try_step)
    fit = lambda size, accum: smoke.fit_batch(size, accum, None, None, parts, 'cpu')
    assert fit(16, 2) == (2, 16) and tried == [16, 8, 4, 2]
    assert 'fit_batch: batch_size=16 runs out of memory, 2 fits' in capsys.readouterr().out
    # every try undone: the weights, the optimizer's state, the gradients and the RNG
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not parts['optimizer'].state and model.weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)
    fits = 2  # 12, 6, then 3: odd, it cannot be halved
    with pytest.raises(SystemExit) as exit_code:
        fit(12, 1)
    assert exit_code.value.code == 2 and 'batch_size=3 runs out of memory and cannot be halved' in \
        capsys.readouterr().err

    def broken(size, *data):  # any other error is not out of memory: it propagates
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(smoke, 'try_step', broken)
    with pytest.raises(RuntimeError, match='shapes'):
        fit(4, 1)


def test_best_is_the_lowest_val_loss_or_the_highest_acc_norm_and_never_a_nan():
    progress = checkpoint.Progress()
    for step, val_loss, acc_norm, improved in ((10, 2.0, 0.3, True), (20, 2.5, 0.9, False),
                                               (30, float('nan'), 0.9, False),
                                               (40, 1.5, 0.1, True)):
        progress.iter_num = step
        assert progress.new_best(val_loss, acc_norm, 'val_loss') == improved
    assert (progress.best_val_loss, progress.best_iter, progress.evals_since_best) == (1.5, 40, 0)
    progress = checkpoint.Progress()
    for step, acc_norm, improved in ((10, 0.3, True), (20, 0.2, False), (30, float('nan'), False)):
        progress.iter_num = step
        assert progress.new_best(1.0 / step, acc_norm, 'acc_norm') == improved
    assert (progress.best_acc_norm, progress.best_iter, progress.evals_since_best) == (0.3, 10, 2)
    assert progress.best_val_loss == 0.1  # the val loss of the best by acc_norm, for the logs


def test_the_smoke_test_ends_at_the_first_step_that_decides_it(capsys, monkeypatch):
    """It passes at the first loss 10% below the first, fails at once on a non-finite one, and
    otherwise takes every step it may."""
    import smoke
    metrics = io.StringIO()
    monkeypatch.setattr(runlog, 'files', {'metrics.jsonl': metrics, 'train.log': io.StringIO()})
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.01)
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler,
                 scaler=torch.amp.GradScaler('cpu', enabled=False),
                 sampler=data.TrainSampler(10_000, 8, 2, 2, seed=0))
    windows = {start: (torch.zeros(8), torch.zeros(8), start) for start in range(10_000)}

    def run(losses, steps):  # the losses the steps return, in turn: how many steps it took
        taken = []
        def train_step(micro_batches, accum):
            # the sampler's next batch, which it still yields: reading it moved nothing
            assert accum == 1 and next(micro_batches)[2].tolist() == next(iter(parts['sampler']))
            taken.append(optimizer.param_groups[0]['lr'])
            return torch.tensor(losses[len(taken) - 1]), None, []
        smoke.smoke_test(steps, train_step, windows, parts, 'cpu')
        return taken
    # at the schedule's peak, the group's base rate; then the schedule's rate again
    assert run([4.0, 3.9, 3.5, 3.0], 30) == [0.1] * 3
    assert optimizer.param_groups[0]['lr'] == pytest.approx(0.001)
    assert 'smoke test: 3 steps on one batch took its loss from 4.0000 to 3.5000' in \
        capsys.readouterr().out
    passed = json.loads(metrics.getvalue())
    assert (passed['steps'], passed['max_steps'], passed['passed']) == (3, 30, True)
    nan = float('nan')
    for losses, steps, why in (([4.0, nan, 3.0], 2, 'not finite at the full learning rate'),
                               ([4.0] * 5, 5, 'this model does not learn')):
        with pytest.raises(SystemExit) as exit_code:
            run(losses, 5)
        error = capsys.readouterr().err
        assert exit_code.value.code == 2 and f'smoke test: {steps} steps on one batch' in error
        assert why in error


def small_parts():
    """A run's parts (checkpoint.state's) around a 2 x 2 linear layer."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return dict(model=model, optimizer=optimizer,
                scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                scaler=torch.amp.GradScaler('cpu', enabled=False),
                sampler=data.TrainSampler(10_000, 8, 2, 2, seed=0))


def test_one_state_saved_under_two_names_is_written_once_and_each_name_replaced_alone(
        tmp_path, monkeypatch):
    parts = small_parts()
    rng, out = [checkpoint.rng_state('cpu')], str(tmp_path)
    best, last = tmp_path / 'best.pt', tmp_path / 'last.pt'

    def save(names, iter_num):
        progress = checkpoint.Progress(iter_num=iter_num)
        writer = checkpoint.Writer(out, keep=0, background=False, last_saved=0)
        assert checkpoint.save(names, out, parts, rng, progress, {}, False, writer) is None
    save(['best.pt', 'last.pt'], 10)
    assert os.path.samefile(best, last)  # one file, two names
    save(['last.pt'], 20)  # replaces its name only: best.pt keeps iteration 10
    assert not os.path.samefile(best, last)
    assert [torch.load(p, weights_only=True)['iter_num'] for p in (best, last)] == [10, 20]
    # a filesystem without hard links: a copy
    def no_links(*args):
        raise OSError(18, 'Invalid cross-device link')  # EXDEV
    monkeypatch.setattr(os, 'link', no_links)
    save(['best.pt', 'last.pt'], 30)
    assert not os.path.samefile(best, last) and best.read_bytes() == last.read_bytes()
    assert not list(tmp_path.glob('*.tmp'))


def test_a_save_warns_when_the_disk_holds_less_than_two_more_checkpoints(tmp_path, monkeypatch,
                                                                         capsys):
    parts = small_parts()
    writer = checkpoint.Writer(str(tmp_path), keep=0, background=False, last_saved=0)

    def save_with_free(free):
        monkeypatch.setattr(shutil, 'disk_usage', lambda path: shutil._ntuple_diskusage(
            10 * free, 9 * free, free))
        assert checkpoint.save(['best.pt'], str(tmp_path), parts, [checkpoint.rng_state('cpu')],
                               checkpoint.Progress(iter_num=20), {}, False, writer) is None
        return capsys.readouterr().err
    # an fsdp run's last.pt points to its shards: they are the checkpoint's size, not the file
    torch.save({'iter_num': 10, 'shards': 'shards-10'}, tmp_path / 'last.pt')
    (tmp_path / 'shards-10').mkdir()
    (tmp_path / 'shards-10' / '__0_0.distcp').write_bytes(bytes(3 * 2**20))
    assert save_with_free(5 * 2**20).startswith(
        f"warning: {tmp_path} has 5 MB free and a checkpoint takes 3 MB: free space before a "
        f"save fails")
    assert save_with_free(7 * 2**20) == ''


def test_shards_folders_no_checkpoint_names_go_and_an_unreadable_checkpoint_keeps_them(tmp_path):
    for folder in ('shards-10', 'shards-20'):
        (tmp_path / folder).mkdir()
    writer = checkpoint.Writer(str(tmp_path), keep=0, background=False, last_saved=0)
    (tmp_path / 'last.pt').write_bytes(b'PK cut short')  # a truncated file may name shards-10
    assert writer.write({'iter_num': 20, 'shards': 'shards-20'}, ['best.pt']) is None
    assert sorted(p.name for p in tmp_path.glob('shards-*')) == ['shards-10', 'shards-20']
    # a whole last.pt, holding its state itself: shards-10 is no checkpoint's, shards-20 best.pt's
    assert writer.write({'iter_num': 30, 'model': torch.zeros(2)}, ['last.pt']) is None
    assert [p.name for p in tmp_path.glob('shards-*')] == ['shards-20']


def test_what_chooses_best_pt_may_not_change_on_resume():
    defaults = {'best_by': 'val_loss', 'eval_tasks': 'a.jsonl', 'eval_tasks_examples': 500,
                'eval_iters': 200, 'eval_only': False, 'n_embd': 64}
    ckpt = {'config': defaults}
    assert checkpoint.why_not_resume(ckpt, {**defaults, 'eval_tasks': 'b.jsonl'}, defaults) == ''
    # the val loss of other windows
    assert checkpoint.why_not_resume(ckpt, {**defaults, 'eval_iters': 20}, defaults) == (
        "was trained with other settings (eval_iters=200 there, 20 here)")
    # eval_only chooses nothing, and loads only the weights, whose shape may not change
    eval_only = {**defaults, 'eval_only': True}
    assert checkpoint.why_not_resume(ckpt, {**eval_only, 'eval_iters': 20}, defaults) == ''
    assert checkpoint.why_not_resume(ckpt, {**eval_only, 'n_embd': 32}, defaults) == (
        "was trained with other settings (n_embd=64 there, 32 here)")
    # best_by='acc_norm': the best so far is the tasks' mean acc_norm
    by_tasks = {**defaults, 'best_by': 'acc_norm'}
    ckpt = {'config': by_tasks}
    assert checkpoint.why_not_resume(ckpt, {**by_tasks, 'eval_tasks_examples': 100}, defaults) == (
        "was trained with other settings (eval_tasks_examples=500 there, 100 here)")
    assert checkpoint.why_not_resume(ckpt, {**by_tasks, 'eval_iters': 20}, defaults) == ''
    # a checkpoint that keeps the digest of the examples scored: their contents count, not the
    # path (a task file edited in place was resumed, and best.pt chosen across the two)
    ckpt = {'config': by_tasks, 'tasks': 'digest-a'}
    moved = {**by_tasks, 'eval_tasks': '/elsewhere/a.jsonl'}
    assert checkpoint.why_not_resume(ckpt, moved, defaults, tasks='digest-a') == ''
    assert checkpoint.changed_settings(ckpt, moved, defaults, 'digest-a') == {}  # nor said changed
    assert checkpoint.changed_settings(ckpt, by_tasks, defaults, 'digest-b') == {  # edited in place
        'eval_tasks': ('a.jsonl (other examples then)', 'a.jsonl')}
    assert checkpoint.why_not_resume(ckpt, by_tasks, defaults, tasks='digest-b') == (
        "scored other task examples than eval_tasks does here (best_by='acc_norm' chose its "
        "best.pt by them)")
    assert checkpoint.why_not_resume(ckpt, {**eval_only, 'best_by': 'acc_norm'}, defaults,
                                     tasks='digest-b') == ''


def test_a_dtype_compares_on_resume_as_the_checkpoints_run_resolved_it():
    defaults = {'best_by': 'val_loss', 'eval_only': False, 'dtype': 'auto', 'muon_dtype': 'auto'}
    # trained with --dtype=float32 (an AdamW run: muon_dtype never chosen), resumed without it:
    # 'auto' keeps the checkpoint's dtype, and the resume was refused
    ckpt = {'config': {**defaults, 'dtype': 'float32'}, 'dtype': 'float32', 'muon_dtype': 'auto'}
    assert checkpoint.why_not_resume(ckpt, defaults, defaults) == ''
    # trained with 'auto', which chose float32 and bfloat16: the same, set
    ckpt = {'config': defaults, 'dtype': 'float32', 'muon_dtype': 'bfloat16'}
    same = {**defaults, 'dtype': 'float32', 'muon_dtype': 'bfloat16'}
    assert checkpoint.why_not_resume(ckpt, same, defaults) == ''
    assert checkpoint.why_not_resume(ckpt, {**defaults, 'dtype': 'bfloat16'}, defaults) == (
        "was trained with other settings (dtype='float32' there, 'bfloat16' here)")


def test_a_resume_from_an_earlier_checkpoint_moves_the_continuation_it_replaces_aside(tmp_path):
    def save(path, iter_num, best_iter, best_val_loss, shards=None):
        torch.save({'iter_num': iter_num, 'best_iter': best_iter, 'best_val_loss': best_val_loss,
                    **({'shards': shards} if shards else {})}, path)
        return torch.load(path, weights_only=True)
    run = tmp_path / 'run'
    run.mkdir()
    # a wsd run to 40: its best at 30, stable.pt at 33, kept checkpoints of 20 and 40, sharded; a
    # kept one of 45 whose shards a move cut short took already
    stable = save(run / 'stable.pt', 33, 30, 1.5, 'shards-33')
    save(run / 'ckpt-000020.pt', 20, 20, 1.7, 'shards-20')
    save(run / 'ckpt-000045.pt', 45, 40, 1.2, 'shards-45')
    for name in ('best.pt', 'last.pt', 'ckpt-000040.pt'):
        save(run / name, 40, 40, 1.2, 'shards-40')
    for folder in ('shards-20', 'shards-33', 'shards-40'):
        (run / folder).mkdir()
    (run / 'notes.pt').write_bytes(b'not a checkpoint')
    torch.save({'wte.weight': torch.zeros(2)}, run / 'ckpt-000050.pt')  # a bare state_dict
    # from stable.pt: the later files move aside with their shards, last.pt is stable.pt's state;
    # no file holds 30, so there is no best.pt
    moved, replaced = checkpoint.branch(str(run), str(run / 'stable.pt'), stable)
    assert moved == ['best.pt (40)', 'last.pt (40)', 'ckpt-000040.pt (40)', 'ckpt-000045.pt (45)']
    assert replaced == 'replaced-000033'
    assert sorted(p.name for p in run.iterdir()) == [
        'ckpt-000020.pt', 'ckpt-000050.pt', 'last.pt', 'notes.pt', 'replaced-000033', 'shards-20',
        'shards-33', 'stable.pt']
    assert sorted(p.name for p in (run / replaced).iterdir()) == [
        'best.pt', 'ckpt-000040.pt', 'ckpt-000045.pt', 'last.pt', 'shards-40']
    assert os.path.samefile(run / 'last.pt', run / 'stable.pt')
    # from the best itself, kept: it is best.pt too; a second move from 30 goes to a folder of its
    # own
    kept = save(run / 'ckpt-000030.pt', 30, 30, 1.5)
    (run / 'replaced-000030').symlink_to(tmp_path / 'nowhere')
    moved, replaced = checkpoint.branch(str(run), str(run / 'ckpt-000030.pt'), kept)
    assert moved == ['last.pt (33)', 'stable.pt (33)'] and replaced == 'replaced-000030.1'
    assert os.path.samefile(run / 'best.pt', run / 'ckpt-000030.pt')
    assert os.path.samefile(run / 'last.pt', run / 'ckpt-000030.pt')
    assert (run / replaced / 'shards-33').is_dir()
    # from 20: what the session from 30 wrote moves aside too
    assert checkpoint.branch(str(run), str(run / 'ckpt-000020.pt'), save(
        run / 'ckpt-000020.pt', 20, 20, 1.7, 'shards-20')) == (
        ['best.pt (30)', 'last.pt (30)', 'ckpt-000030.pt (30)'], 'replaced-000020')


def test_a_background_write_copies_tied_weights_once_and_reports_any_failure(tmp_path):
    from model import GPT, GPTConfig
    state = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)).state_dict()
    buffers = {}
    copy = checkpoint.host_copy({'model': state}, {}, buffers)['model']
    # the tied head: two names over one tensor's memory, copied once, shared still
    assert (copy['wte.weight'].untyped_storage().data_ptr()
            == copy['lm_head.weight'].untyped_storage().data_ptr())
    assert copy['wte.weight'].data_ptr() != state['wte.weight'].data_ptr()
    # the next copy into the same buffers, with the values of then
    state['wte.weight'].add_(1)
    again = checkpoint.host_copy({'model': state}, buffers, {})['model']
    assert all(again[k].data_ptr() == copy[k].data_ptr() and torch.equal(again[k], state[k])
               for k in state)
    writer = checkpoint.Writer(str(tmp_path), keep=0, background=True, last_saved=0)
    # not a full disk: an error torch.save raises for a value it cannot pickle
    assert writer.write({'iter_num': 10, 'x': lambda: 0}, ['last.pt']) is None
    names, iter_num, why = writer.wait()
    assert names == ['last.pt'] and iter_num == 10 and why and writer.last_saved == 0
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize('device', DEVICES[1:])
def test_a_background_write_of_gpu_tensors_holds_their_values_at_the_save(tmp_path, device):
    state = {'weight': torch.zeros(2**20, device=device), 'iter_num': 1}
    writer = checkpoint.Writer(str(tmp_path), keep=0, background=True, last_saved=0)
    # the first write allocates the pinned buffers (which can wait for the GPU); the second reuses
    for value in (1, 2):
        torch.cuda._sleep(2 * 10**9)  # the GPU busy for about a second: the copies land after it
        state['weight'].add_(1)
        assert writer.write(state, ['last.pt']) is None
        state['weight'].add_(10)  # the next step's change
        assert writer.wait() is None
        saved = torch.load(tmp_path / 'last.pt', weights_only=True)['weight']
        assert torch.equal(saved, torch.full((2**20,), float(value)))
        state['weight'].sub_(10)


def test_kept_checkpoints_count_only_those_up_to_the_one_written(tmp_path):
    for iteration in (100, 300, 400):  # 300 and 400: a run's that was resumed from 100
        (tmp_path / f'ckpt-{iteration:06d}.pt').write_bytes(b'')
    (tmp_path / 'ckpt-best.pt').write_bytes(b'')  # not a kept checkpoint's name
    writer = checkpoint.Writer(str(tmp_path), keep=1, background=False, last_saved=0)
    assert writer.write({'iter_num': 200}, ['last.pt', 'ckpt-000200.pt']) is None
    assert sorted(os.listdir(tmp_path)) == ['ckpt-000200.pt', 'ckpt-000300.pt', 'ckpt-000400.pt',
                                            'ckpt-best.pt', 'last.pt']
    assert writer.last_saved == 200


def test_a_shards_folder_that_any_checkpoint_file_names_is_kept(tmp_path):
    # a copy a user made (cp last.pt mine-20.pt) names shards-20: removing it lost its weights
    for folder in ('shards-10', 'shards-20', 'shards-30'):
        (tmp_path / folder).mkdir()
    torch.save({'iter_num': 20, 'shards': 'shards-20'}, tmp_path / 'mine-20.pt')
    # a .pt that is no checkpoint, which torch cannot read weights-only, names none: once it kept
    # every folder for the rest of the run
    torch.save(torch.nn.Linear(2, 2), tmp_path / 'model.pt')
    writer = checkpoint.Writer(str(tmp_path), keep=0, background=False, last_saved=0)
    assert writer.write({'iter_num': 30, 'shards': 'shards-30'}, ['last.pt']) is None
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith('shards-')) == ['shards-20',
                                                                                'shards-30']
    # the run's own checkpoint unreadable (what could it name?): every folder is kept
    (tmp_path / 'shards-10').mkdir()
    (tmp_path / 'best.pt').write_bytes(b'not a checkpoint')
    assert writer.write({'iter_num': 40, 'shards': 'shards-30'}, ['last.pt']) is None
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith('shards-')) == ['shards-10',
                                                                                'shards-20',
                                                                                'shards-30']


def test_a_save_where_no_shards_folder_is_reads_no_checkpoint(tmp_path, monkeypatch):
    # a run without fsdp: its kept checkpoints are not loaded after every save to look for names
    torch.save({'iter_num': 10}, tmp_path / 'ckpt-000010.pt')
    loads, torch_load = [], torch.load

    def counting_load(*args, **kwargs):
        loads.append(args[0])
        return torch_load(*args, **kwargs)
    monkeypatch.setattr(torch, 'load', counting_load)
    writer = checkpoint.Writer(str(tmp_path), keep=2, background=False, last_saved=0)
    assert writer.write({'iter_num': 20}, ['last.pt', 'ckpt-000020.pt']) is None
    assert loads == []


def test_only_a_gone_peer_is_a_lost_rank_and_a_timeout_keeps_its_traceback():
    # gloo's own lines (torch 2.13): test_ddp's elastic restart meets the first for real; the
    # second is a rank waiting in a collective another rank skipped, whose traceback says where
    gloo = '[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/'
    assert exits.lost_a_rank(RuntimeError(
        f"{gloo}pair.cc:537] Read error [127.0.0.1]:910: Connection reset by peer. This is "
        f"typically caused by a remote worker hanging or bugs in the application."))
    assert not exits.lost_a_rank(RuntimeError(
        f"{gloo}unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"))
    assert not exits.lost_a_rank(RuntimeError('Connection reset by peer'))  # not a collective's


def test_verify_names_the_records_the_last_session_wrote_for_certain():
    import verify
    settings = {'log_interval': 1, 'eval_interval': 5}
    # sessions from 0 (logging each step), 12 (every 4th) and 15 (each step again)
    records = ([{'kind': 'start', 'step': s} for s in (0, 12, 15)]
               + [{'kind': 'train', 'step': s} for s in (*range(1, 13), 16, 20)]
               + [{'kind': 'eval', 'step': s} for s in (5, 20)])
    # 13 to 15 were another session's, which logged every 4th; 17 to 19 this one's
    assert verify.missing_records(records, settings, 10, 20) == ['train 17', 'train 18', 'train 19']
    assert verify.missing_records(records, settings, 5, 10) == ['eval 10']


def test_verify_state_drift_is_relative_and_no_nan_or_missing_tensor_passes_as_drift():
    import verify
    run = {'model': {'w': torch.tensor([1.0, 2.0]), 'b': torch.tensor([math.nan, 1.0])}}
    assert verify.state_drift(run, run, ['model']) == (0.0, '')
    replay = {'model': {'w': torch.tensor([1.0, 2.5]), 'b': torch.tensor([math.nan, 1.0])}}
    assert verify.state_drift(run, replay, ['model']) == (0.2, 'model.w')
    # a NaN the replay lacks hid behind max() as no difference at all
    replay['model']['b'] = torch.tensor([1.0, 1.0])
    assert verify.state_drift(run, replay, ['model']) == (math.inf, 'model.b')
    del replay['model']['b']
    assert verify.state_drift(run, replay, ['model']) == (math.inf, 'model.b')


def test_evaluation_windows_are_spread_over_splits_of_2_to_the_24_windows_and_more():
    # float32's spacing rounded the last index past the end: FineWeb10B's train split at block 512
    windows = 2**24 + 4  # the last index, 2**24 + 3, is no float32
    sampler = data.EvalSampler(windows + 1, 1, 8, max_windows=8)
    starts = torch.cat(sampler.batches)
    assert len(starts) == 8 and starts[0] == 0 and starts[-1] == windows - 1


def test_an_acc_norm_of_0_at_the_first_evaluation_is_the_best_so_far():
    # best_acc_norm started at 0: no best.pt, and 'best acc_norm 0.0000 at iteration 0'
    progress = checkpoint.Progress(iter_num=5)
    assert progress.new_best(2.5, 0.0, 'acc_norm') and progress.best_iter == 5
    # a checkpoint written before held 0.0, and a resume took it back: no best yet is -inf
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=16))
    older = {'model': model.state_dict(), 'iter_num': 10, 'best_iter': 0, 'best_acc_norm': 0.0}
    parts = {'model': model, 'optimizer': None, 'scheduler': None}
    resumed = checkpoint.resume(older, 'last.pt', parts, 0, 1, 'cpu', weights_only=True)
    assert resumed.best_acc_norm == -math.inf and resumed.iter_num == 10


def test_a_file_is_synced_before_its_rename_and_the_folder_after(tmp_path, monkeypatch):
    # SIGKILL loses nothing the kernel holds; a power cut loses what was never fsynced: no kill
    # test sees a dropped fsync
    calls, fsync, replace = [], os.fsync, os.replace

    def synced(fd):
        calls.append(('fsync', os.readlink(f'/proc/self/fd/{fd}')))  # the file or folder synced
        fsync(fd)

    def replaced(source, path):
        calls.append(('replace', path))
        replace(source, path)
    monkeypatch.setattr(os, 'fsync', synced)
    monkeypatch.setattr(os, 'replace', replaced)
    path = str(tmp_path / 'last.pt')
    checkpoint.atomic_write(path, lambda f: f.write(b'state'))
    assert [kind for kind, _ in calls] == ['fsync', 'replace', 'fsync']
    assert calls[0][1].endswith('.tmp') and calls[1][1] == path and calls[2][1] == str(tmp_path)


def test_a_loaded_optimizers_groups_are_its_members_own():
    # the scheduler sets rates on Optimizers.param_groups: after a load replaced the members'
    # group dicts, stale copies took a resume's changed rate, which the first step then missed
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=16))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'muon', muon_dtype='float32')
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    members = [group for member in opt.optimizers for group in member.param_groups]
    assert len(opt.param_groups) == len(members) == 3  # AdamW decayed and not, Muon
    assert all(a is b for a, b in zip(opt.param_groups, members))


def test_evaluation_runs_without_dropout_and_gives_the_model_back_training(token_file):
    # in train mode heavy dropout makes the loss another each time; only bitwise resume noticed,
    # through the random numbers it drew
    windows = data.TokenWindows(token_file[0], 16)
    loader = data.make_loader(windows, data.EvalSampler(windows.num_tokens, 16, 4), 0, 0, False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=8,
                          dropout=0.5))
    losses = {evaluate.loss(model, loader, 'cpu', contextlib.nullcontext()) for _ in range(3)}
    assert len(losses) == 1 and model.training
    with torch.no_grad():  # by hand, dropout off
        x = torch.stack([windows[s][0] for b in loader.batch_sampler for s in b if s >= 0])
        y = torch.stack([windows[s][1] for b in loader.batch_sampler for s in b if s >= 0])
        model.eval()
        assert losses.pop() == pytest.approx(model(x, y).item(), rel=1e-5)
