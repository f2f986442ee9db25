"""
Precision: the dtype a run trains in ('auto': by a GPU's compute capability; on a CPU by whether it
has bfloat16 matmul units and, with them, by timing the model in float32 and bfloat16), the dtype of
Muon's Newton-Schulz, the autocast context every forward runs in, and the warning for float16
emulated on a CPU. Peak FLOP/s, MFU and the speedometer: perf.py.

What is timed to choose is timed once per machine, shape and model.py (optim.py for Muon) and cached
with perf.cached (in perf.json): every run on a machine then chooses alike, and start-up pays for a
timing only once.
"""
import functools
import hashlib
import inspect
import json
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
# torch's Muon's defaults: Newton-Schulz's coefficients, steps and epsilon
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

from distributed import gather
from model import GPT, GPTConfig
from optim import newton_schulz
from perf import cached, machine

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
# a timed forward+backward when choosing a dtype: enough tokens (rows) for the model's real matmul
# shapes, and at most MEASURE_FLOPS of work (or 64 tokens, past ~500M parameters), so that a large
# model on a small CPU is timed in seconds, not minutes (GPT-2's 12 x 1024: 30 s a call, 2 cores)
MEASURE_TOKENS = 8192
MEASURE_FLOPS = 2e11


def bfloat16_units():
    """Whether bfloat16 matmuls can run on this CPU's bfloat16 units: it has AMX or AVX512-BF16, and
    oneDNN, which runs torch's CPU matmuls, may use bfloat16 (ONEDNN_MAX_CPU_ISA=AVX2 caps it
    below: bfloat16 is then emulated, as on a CPU without the units; docs/benchmarks.md caps it so,
    to time an AVX2-only CPU)."""
    return ((torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cuda_autocast_dtype(capability):
    """The dtype 'auto' trains in on a GPU of this compute capability (major, minor): bfloat16 from
    Ampere (8.0) on, float16 with the GradScaler before. torch.cuda.is_bf16_supported() also says
    True on a V100 or T4, which only emulate bfloat16 (slowly), unless asked with
    including_emulation=False."""
    return 'bfloat16' if capability[0] >= 8 else 'float16'


def autocast(device_type, dtype):
    """The context every forward runs in: autocast to bfloat16 or float16 (weights, gradients and
    optimizer state stay float32), nothing for float32."""
    return nullcontext() if dtype == 'float32' else torch.autocast(device_type, DTYPES[dtype])


def fastest(runs, rounds=3, budget=0.0):
    """{name: seconds of the fastest call of runs[name]()}, the runs called in turns (A B A B ...)
    so that other load hits each alike, after a round that warms up: rounds rounds, and more while
    the timed calls have taken less than budget seconds (short calls: more chances at a quiet
    one)."""
    best = dict.fromkeys(runs, float('inf'))
    round, spent = 0, 0.0
    while round <= rounds or spent < budget:
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if round:
                best[name] = min(best[name], time.perf_counter() - start)
                spent += time.perf_counter() - start
        round += 1
    return best


def step_seconds(model_args, batch_size, device, dtypes):
    """{dtype name: seconds of one forward+backward} of a fresh GPT of this shape on a micro-batch
    capped at MEASURE_TOKENS and MEASURE_FLOPS (in windows shorter than block_size if need be: a
    token's matmuls are the same, and attention runs in float32 either way on a CPU). The global
    RNG (dropout's, the weights') is left as it was."""
    with torch.random.fork_rng(devices=[]):
        model = GPT(GPTConfig(**model_args)).to(device)
        tokens = min(batch_size * model_args['block_size'], MEASURE_TOKENS,
                     max(64, int(MEASURE_FLOPS / model.flops_per_token())))
        T = min(model_args['block_size'], tokens)
        idx = torch.arange(tokens // T * T, device=device).view(-1, T) % model_args['vocab_size']

        def step(name):
            with autocast(torch.device(device).type, name):
                loss = model(idx, idx)
            loss.backward()
            model.zero_grad(set_to_none=True)
        return fastest({name: functools.partial(step, name) for name in dtypes})


def resolve_dtype(dtype, device, model_args, batch_size, resumed=None):
    """(dtype name, how it was chosen: a dict for meta.json) a script runs in, the same on every
    rank. 'auto' keeps the dtype of the run a resume continues (resumed: (checkpoint path, its
    dtype)), whatever is measured now; otherwise rank 0 chooses (auto_dtype) for every rank.
    ValueError: HONESTGPT_AUTO_DTYPE names no dtype."""
    dtype, how = resolve(dtype, lambda: auto_dtype(device, model_args, batch_size), resumed)
    if dtype not in DTYPES:
        raise ValueError(f"HONESTGPT_AUTO_DTYPE={dtype}: use float32, bfloat16 or float16")
    return dtype, how


def resolve(value, choose, resumed):
    """(value, how it was chosen) for a setting that may be 'auto': as set; or the choice of the run
    a resume continues (resumed: (checkpoint path, its choice)); or choose()'s on rank 0, for every
    rank."""
    if value != 'auto':
        return value, {'rule': 'set in the config'}
    if resumed:
        return resumed[1], {'rule': f"'auto' as resolved by the run in {resumed[0]}"}
    first_rank = not dist.is_initialized() or dist.get_rank() == 0
    return tuple(gather(choose() if first_rank else None)[0])


def auto_dtype(device, model_args, batch_size):
    """(dtype name, how it was chosen: a dict for meta.json) for dtype='auto'. CUDA: bfloat16 where
    supported, else float16. CPU: float32 unless the CPU has bfloat16 matmul units; with them,
    whichever of the two trained this model's shape faster here, measured once per machine, shape
    and model.py. Wide matmuls gain from bfloat16 units, small ones lose to the casts.
    HONESTGPT_AUTO_DTYPE forces the choice (the tests use it to run either way on one machine)."""
    forced = os.environ.get('HONESTGPT_AUTO_DTYPE')
    if forced:
        return forced, {'rule': 'forced by HONESTGPT_AUTO_DTYPE'}
    if torch.device(device).type == 'cuda':
        capability = torch.cuda.get_device_capability(device)
        return cuda_autocast_dtype(capability), {'rule': f"CUDA compute capability "
                                                         f"{capability[0]}.{capability[1]}: "
                                                         f"bfloat16 from 8.0 on, else float16"}
    if not bfloat16_units():
        return 'float32', {'rule': 'CPU without bfloat16 matmul units: bfloat16 would be emulated, '
                                   'many times slower'}
    shape = {k: model_args[k] for k in sorted(model_args) if k != 'dropout'}
    key = f"step {machine(device)} {code_hash(GPT)} {json.dumps(shape)} batch {batch_size}"
    seconds = cached(key,
                     lambda: {'seconds': step_seconds(model_args, batch_size, device,
                                                      ('float32', 'bfloat16'))})
    dtype = min(seconds['seconds'], key=seconds['seconds'].get)
    return dtype, {'rule': 'the faster of float32 and bfloat16 for this model, measured '
                           '(forward+backward seconds)', **seconds}


def code_hash(obj):
    """The contents of the file that defines obj, hashed, for the keys of cached choices: an edit to
    the model (model.py) or to newton_schulz (optim.py) can change which dtype is faster."""
    path = inspect.getsourcefile(obj)
    with open(path, 'rb') as f:
        return f"{os.path.basename(path)} {hashlib.sha256(f.read()).hexdigest()[:12]}"


def auto_muon_dtype(device, shapes):
    """(dtype name, how it was chosen) for Muon's Newton-Schulz under muon_dtype='auto'; shapes: its
    matrices'. CUDA: bfloat16 (torch's Muon's) from compute capability 8.0, float32 below. CPU:
    float32 without bfloat16 matmul units, where bfloat16 is emulated; with them, whichever was
    faster for Muon's Newton-Schulz iteration on a matrix of each shape, measured once per machine,
    shapes and optim.py (small matrices can lose to the casts)."""
    if torch.device(device).type == 'cuda':
        capability = torch.cuda.get_device_capability(device)
        dtype = 'bfloat16' if capability >= (8, 0) else 'float32'
        return dtype, {'rule': f"CUDA compute capability {capability[0]}.{capability[1]}: "
                               f"bfloat16 from 8.0 on, else float32"}
    if not bfloat16_units():
        return 'float32', {'rule': 'CPU without bfloat16 matmul units: bfloat16 would be emulated'}
    shapes = sorted(set(map(tuple, shapes)))
    matrices = [torch.full((1, *shape), 0.5, device=device) for shape in shapes]

    def step(dtype):
        for matrix in matrices:
            newton_schulz(matrix, DTYPES[dtype], (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                          DEFAULT_NS_STEPS, EPS)
    seconds = cached(f"newton-schulz {machine(device)} {code_hash(newton_schulz)} {shapes}",
                     lambda: {'seconds': fastest({name: functools.partial(step, name)
                                                  for name in ('float32', 'bfloat16')})})
    dtype = min(seconds['seconds'], key=seconds['seconds'].get)
    return dtype, {'rule': "the faster of float32 and bfloat16 for Newton-Schulz on Muon's "
                           "matrices, measured (seconds)", **seconds}


def float16_warning(device, model_config, batch_size):
    """A warning line when float16 is emulated on this CPU ('' when it is not, and on a GPU): CPUs
    have no float16 matmul units. Measured on a (tokens, C) x (C, 4C) product, the MLP's of a
    micro-batch, in float16 and float32."""
    if torch.device(device).type != 'cpu':
        return ''
    slow, fast = float16_float32_seconds(batch_size * model_config.block_size, model_config.n_embd)
    if slow < 1.5 * fast:
        return ''
    return (f"warning: dtype=float16 on this CPU is emulated: an MLP matmul of this model took "
            f"{slow * 1e3:.3g} ms in float16 against {fast * 1e3:.3g} ms in float32 "
            f"({slow / fast:.0f}x slower): use dtype=bfloat16 or float32")


def float16_float32_seconds(tokens, n_embd):
    """The fastest seconds of the MLP's (tokens, C) x (C, 4C) product in float16 and in float32,
    timed in turns: other work on the machine slows both alike."""
    a, b = torch.full((tokens, n_embd), 0.5), torch.full((n_embd, 4 * n_embd), 0.25)
    a16, b16 = a.half(), b.half()
    best = fastest({'float16': lambda: a16 @ b16, 'float32': lambda: a @ b}, rounds=1, budget=0.1)
    return best['float16'], best['float32']
