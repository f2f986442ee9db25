"""
Performance facts that train.py and bench.py rely on: which dtype 'auto' trains in, the peak FLOP/s that
MFU is measured against, and peak memory. Model FLOPs per token: GPT.flops_per_token().

Measurements are taken once per machine and cached in ~/.cache/honestgpt/perf.json (HONESTGPT_CACHE
names another folder), keyed by the processor, torch version and thread count: the same speed then
reads as the same MFU in every run on a machine, and start-up pays for a measurement only once.
"""
import functools
import hashlib
import inspect
import json
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

from model import GPT, GPTConfig

# Dense (not sparse) peak FLOP/s from NVIDIA's datasheets, with float32 accumulation: bfloat16,
# float16 tensor cores, and float32 as TF32 tensor cores where the GPU has them (train.py allows TF32).
# First substring match wins: 'H100 PCIe' before 'H100', 'A100' before 'A10', 'L40S' before 'L4'.
# A dtype a GPU lacks (no bfloat16 before Ampere) is measured instead.
GPU_PEAKS = [  # name, bfloat16, float16, float32
    ('H100 PCIe', 756e12, 756e12, 378e12),
    ('H100', 989e12, 989e12, 495e12),
    ('H200', 989e12, 989e12, 495e12),
    ('B200', 2250e12, 2250e12, 1125e12),
    ('A100', 312e12, 312e12, 156e12),
    ('A10', 125e12, 125e12, 62.5e12),
    ('L40S', 362e12, 362e12, 183e12),
    ('L4', 121e12, 121e12, 60e12),
    ('A6000', 155e12, 155e12, 77.4e12),
    ('4090', 165e12, 165e12, 82.6e12),
    ('3090', 71e12, 71e12, 35.6e12),
    ('T4', None, 65e12, 8.1e12),
    ('V100', None, 125e12, 15.7e12),
]
MEASURE_TOKENS = 8192  # tokens per timed forward+backward when choosing a dtype: enough for the model's real matmul shapes


@functools.cache
def cpu_name():
    """The processor's model name and its bfloat16 matmul units: what decides CPU speed per dtype."""
    name = 'unknown CPU'
    try:
        with open('/proc/cpuinfo') as f:
            name = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), name)
    except OSError:
        pass
    units = [unit for unit, present in (('amx', torch.cpu._is_amx_tile_supported()),
                                        ('avx512_bf16', torch.cpu._is_avx512_bf16_supported())) if present]
    return f"{name} ({', '.join(units) or 'no bf16 units'})"


def resolve_device(device, local_rank=0):
    """'auto' -> cuda if there is one, else cpu; under torchrun each rank takes its own GPU. Returns (device, type);
    ValueError names the fix for a device this code cannot use."""
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if local_rank and device.startswith('cuda'):
        device = f'cuda:{local_rank}'
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        device_type = 'unknown'
    if device_type not in ('cpu', 'cuda'):
        raise ValueError(f"device='{device}' is not supported: use device=cpu, cuda, cuda:N or auto")
    if device_type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"device='{device}' but CUDA is not available here: use device=cpu")
    if device_type == 'cuda' and (torch.device(device).index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device='{device}' but this machine has {torch.cuda.device_count()} GPU(s): "
                         f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device, device_type


def machine(device):
    """The cache key's machine part: a measurement holds for this processor, torch build and thread count."""
    if torch.device(device).type == 'cuda':
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def read_cache(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # no cache yet, or a broken one: measure again
        return {}


def cached(key, measure):
    """measure()'s JSON-able result, stored under key in the cache file; 'cached' says which run measured it. Processes
    that measure at once keep the first result written, so runs started together agree (a resume needs the same dtype)."""
    folder = os.environ.get('HONESTGPT_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'honestgpt'))
    path = os.path.join(folder, 'perf.json')
    if key in read_cache(path):
        return read_cache(path)[key] | {'cached': path}
    entry = measure() | {'measured_at': time.strftime('%Y-%m-%dT%H:%M:%S%z')}
    entries = read_cache(path)
    if key in entries:  # another process measured meanwhile: its figure stands
        return entries[key] | {'cached': path}
    entries[key] = entry
    try:
        os.makedirs(folder, exist_ok=True)
        with open(f'{path}.{os.getpid()}.tmp', 'w') as f:  # a whole file or none: another process may read it now
            json.dump(entries, f, indent=1)
        os.replace(f'{path}.{os.getpid()}.tmp', path)
    except OSError:
        pass  # a read-only home: measure again next time
    return entry | {'cached': None}


# -----------------------------------------------------------------------------
# the dtype 'auto' trains in

def step_seconds(model_args, batch_size, device, dtypes, rounds=3):
    """{dtype name: seconds of one forward+backward} of a fresh GPT of this shape on a micro-batch capped at
    MEASURE_TOKENS, dtypes timed in turns (A B A B ...) so that other load hits each alike; the fastest round counts.
    The global RNG (dropout's, the weights') is left as it was."""
    with torch.random.fork_rng(devices=[]):
        model = GPT(GPTConfig(**model_args)).to(device)
        T = model_args['block_size']
        idx = torch.arange(max(1, min(batch_size, MEASURE_TOKENS // T)) * T, device=device).view(-1, T) % model_args['vocab_size']
        best = {name: float('inf') for name in dtypes}
        for round in range(rounds + 1):  # round 0 warms up
            for name in dtypes:
                start = time.perf_counter()
                with torch.autocast(torch.device(device).type, getattr(torch, name), enabled=name != 'float32'):
                    logits = model(idx)
                F.cross_entropy(logits.view(-1, logits.size(-1)).float(), idx.view(-1)).backward()
                model.zero_grad(set_to_none=True)
                if round:
                    best[name] = min(best[name], time.perf_counter() - start)
    return best


def auto_dtype(device, model_args, batch_size):
    """(dtype name, how it was chosen: a dict for meta.json) for dtype='auto'. CUDA: bfloat16 where supported, else
    float16. CPU: float32 unless the CPU has bfloat16 matmul units; with them, whichever of the two trained this
    model's shape faster here, measured once per machine, shape and model.py. Wide matmuls gain from bfloat16 units,
    small ones lose to the casts. HONESTGPT_AUTO_DTYPE forces the choice (the tests use it to run either way on one
    machine)."""
    forced = os.environ.get('HONESTGPT_AUTO_DTYPE')
    if forced:
        return forced, {'rule': 'forced by HONESTGPT_AUTO_DTYPE'}
    if torch.device(device).type == 'cuda':
        return ('bfloat16', {'rule': 'CUDA with bfloat16'}) if torch.cuda.is_bf16_supported() else ('float16', {'rule': 'CUDA without bfloat16'})
    if not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        return 'float32', {'rule': 'CPU without bfloat16 matmul units: bfloat16 would be emulated, many times slower'}
    shape = {k: model_args[k] for k in sorted(model_args) if k != 'dropout'}
    # model.py's contents are part of the key: an edit to the model can change which dtype is faster
    with open(inspect.getsourcefile(GPT), 'rb') as f:
        code = hashlib.sha256(f.read()).hexdigest()[:12]
    seconds = cached(f"step {machine(device)} model.py {code} {json.dumps(shape)} batch {batch_size}",
                     lambda: {'seconds': step_seconds(model_args, batch_size, device, ('float32', 'bfloat16'))})
    dtype = min(seconds['seconds'], key=seconds['seconds'].get)
    return dtype, {'rule': 'the faster of float32 and bfloat16 for this model, measured (forward+backward seconds)', **seconds}


def float16_slowdown(device, n_embd, tokens):
    """How many times longer a (tokens, C) x (C, 4C) product, an MLP's, takes in float16 than in float32: CPUs have
    no float16 matmul units and emulate it. (ratio, float16 ms, float32 ms)."""
    a16, b16 = torch.full((tokens, n_embd), 0.5, dtype=torch.float16), torch.full((n_embd, 4 * n_embd), 0.25, dtype=torch.float16)
    slow, fast = best_seconds(a16, b16, 0.05), best_seconds(a16.float(), b16.float(), 0.05)
    return slow / fast, slow * 1e3, fast * 1e3


# -----------------------------------------------------------------------------
# peak FLOP/s, for MFU

def best_seconds(a, b, budget):
    """The fastest of a @ b repeated for budget seconds, after a warm-up."""
    times = []
    while len(times) < 2 or sum(times) < budget:
        start = time.perf_counter()
        a @ b
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def measure_flops(device, dtype, budget=0.1):
    """The best FLOP/s of square matmuls. Every timing bounds the peak from below, so take the best over sizes
    (small ones run from cache), over the layouts a Linear multiplies in (forward x W^T, backward dY W and dY^T X:
    an emulated dtype's speed differs tenfold between them) and over repeats (other load slows only some).
    Sizes double from 128 until the fastest layout takes 10 ms per product, or up to 8192."""
    best, n = (0.0, 0), 128
    while True:
        # no torch.randn: the values do not change the speed, and the global RNG (dropout's) must stay untouched
        a, b = torch.full((n, n), 0.5, device=device, dtype=dtype), torch.full((n, n), 0.25, device=device, dtype=dtype)
        fastest = min(best_seconds(x, y, budget) for x, y in ((a, b.T), (a, b), (a.T, b)))
        best = max(best, (2 * n**3 / fastest, n))
        if fastest > 0.01 or n == 8192:
            name = str(dtype).removeprefix('torch.')
            return best[0], f"measured: {best[1]}x{best[1]} {name} matmul, the fastest of 3 layouts and sizes 128 to {n}"
        n *= 2


def peak_flops(device, dtype):
    """(FLOP/s, how it was obtained) for a torch dtype: the datasheet on known GPUs, else measured once per machine."""
    if torch.device(device).type == 'cuda':
        name = torch.cuda.get_device_name(device)
        peaks = next((peaks for gpu, *peaks in GPU_PEAKS if gpu in name), [None] * 3)
        peak = dict(zip((torch.bfloat16, torch.float16, torch.float32), peaks))[dtype]
        if peak:
            return peak, f"table: {name}"
    entry = cached(f"peak {machine(device)} {dtype}", lambda: dict(zip(('flops', 'how'), measure_flops(device, dtype))))
    return entry['flops'], entry['how'] + (f" (cached in {entry['cached']})" if entry['cached'] else '')


def peak_memory_mb(device):
    """The CUDA allocator's peak, or on CPU the process's peak resident set (all it ever held, not one model's)."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == 'darwin' else 2**10)
