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


def matmul_seconds(a, b):
    start = time.perf_counter()
    a @ b
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - start


def measure_flops(device, dtype):
    """Best FLOP/s of a square matmul. The size doubles until one product takes 10 ms (or n = 8192), large
    enough to reach the hardware's peak yet quick where a dtype is emulated; then the best of as many
    products as fit in half a second, so that a spell of other load on the machine does not lower the peak."""
    n = 256
    while True:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        if min(matmul_seconds(a, b) for _ in range(3)) > 0.01 or n == 8192:  # the first also warms up
            break
        n *= 2
    times = [matmul_seconds(a, b)]
    while sum(times) < 0.5:
        times.append(matmul_seconds(a, b))
    return 2 * n**3 / min(times), f"measured: {n}x{n} {str(dtype).removeprefix('torch.')} matmul, best of {len(times)}"


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
