"""
Performance accounting shared by train.py and bench.py: the training dtype 'auto' resolves to, the
peak FLOP/s that MFU is measured against, and peak memory. Model FLOPs per token: GPT.flops_per_token().
"""
import functools
import resource
import sys
import time

import torch

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


def auto_dtype(device_type):
    """What dtype='auto' trains in: the fastest dtype that keeps training stable on this device."""
    if device_type == 'cuda':
        return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float16'
    # bf16 pays off only where the CPU has bf16 matmul units; elsewhere it is emulated and slow
    return 'bfloat16' if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported() else 'float32'


def best_seconds(a, b):
    """The fastest of a @ b repeated for 20 ms, after a warm-up (every train.py start measures: keep it short)."""
    times = []
    while len(times) < 2 or sum(times) < 0.02:
        start = time.perf_counter()
        a @ b
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def measure_flops(device, dtype):
    """The best FLOP/s of square matmuls. Every timing bounds the peak from below, so take the best over sizes
    (small ones run from cache), over the layouts a Linear multiplies in (forward x W^T, backward dY W and dY^T X:
    an emulated dtype's speed differs tenfold between them) and over repeats (other load slows only some).
    Sizes double from 128 until the fastest layout takes 10 ms per product, or up to 8192."""
    best, n = (0.0, 0), 128
    while True:
        # no torch.randn: the values do not change the speed, and the global RNG (dropout's) must stay untouched
        a, b = torch.full((n, n), 0.5, device=device, dtype=dtype), torch.full((n, n), 0.25, device=device, dtype=dtype)
        fastest = min(best_seconds(x, y) for x, y in ((a, b.T), (a, b), (a.T, b)))
        best = max(best, (2 * n**3 / fastest, n))
        if fastest > 0.01 or n == 8192:
            name = str(dtype).removeprefix('torch.')
            return best[0], f"measured: {best[1]}x{best[1]} {name} matmul, the fastest of 3 layouts and sizes 128 to {n}"
        n *= 2


@functools.cache  # one peak per process: settings compared in one run are rated against the same number
def peak_flops(device, dtype):
    """(FLOP/s, how it was obtained) for a torch dtype: the datasheet on known GPUs, else measured here."""
    if torch.device(device).type == 'cuda':
        name = torch.cuda.get_device_name(device)
        peaks = next((peaks for gpu, *peaks in GPU_PEAKS if gpu in name), [None] * 3)
        peak = dict(zip((torch.bfloat16, torch.float16, torch.float32), peaks))[dtype]
        if peak:
            return peak, f"table: {name}"
    return measure_flops(device, dtype)


def peak_memory_mb(device):
    """The CUDA allocator's peak, or on CPU the process's peak resident set (all it ever held, not one model's)."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == 'darwin' else 2**10)
