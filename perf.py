"""
Speed: the peak FLOP/s that MFU is measured against, memory, the speedometer (tokens/s, MFU,
utilization, the time left) and where an iteration's time goes (a profiled iteration's phases).
Model FLOPs per token: GPT.flops_per_token(). The dtype a run trains in, and autocast: precision.py.
Devices, processes and collectives: distributed.py.

Measurements are taken once per machine and cached in ~/.cache/honestgpt/perf.json (HONESTGPT_CACHE
names another folder), keyed by the processor, torch version and thread count: the same speed then
reads as the same MFU in every run on a machine, and start-up pays for a measurement only once.
"""
import collections
import contextlib
import fcntl
import functools
import json
import os
import re
import resource
import sys
import time

import torch
import torch.distributed as dist

import checkpoint
from distributed import cpus_busy

# Dense (not sparse) peak FLOP/s from NVIDIA's datasheets, with float32 accumulation, keyed by the
# exact name torch.cuda.get_device_name gives (llm.c's llmc/mfu.h matches the same way): a substring
# would let 'NVIDIA L40' take the L4's figure. Columns: bfloat16, float16 tensor cores, float32 as
# TF32 tensor cores (train.py allows TF32). A GPU or dtype not listed (no bfloat16 before Ampere) is
# measured instead.
GPU_PEAKS = {  # name: (bfloat16, float16, float32)
    'NVIDIA B200': (2250e12, 2250e12, 1125e12),
    'NVIDIA H200': (989e12, 989e12, 495e12),
    'NVIDIA H100 80GB HBM3': (989e12, 989e12, 495e12),  # SXM
    'NVIDIA H100 PCIe': (756e12, 756e12, 378e12),
    'NVIDIA A100-SXM4-80GB': (312e12, 312e12, 156e12),
    'NVIDIA A100-SXM4-40GB': (312e12, 312e12, 156e12),
    'NVIDIA A100 80GB PCIe': (312e12, 312e12, 156e12),
    'NVIDIA A100-PCIE-40GB': (312e12, 312e12, 156e12),
    'NVIDIA A10': (125e12, 125e12, 62.5e12),
    'NVIDIA L40S': (362e12, 362e12, 183e12),
    'NVIDIA L40': (181e12, 181e12, 90.5e12),
    'NVIDIA L4': (121e12, 121e12, 60e12),
    'NVIDIA GeForce RTX 4090': (165e12, 165e12, 82.6e12),
    'NVIDIA GeForce RTX 3090': (71e12, 71e12, 35.6e12),
    'Tesla T4': (None, 65e12, 8.1e12),
    'Tesla V100-SXM2-16GB': (None, 125e12, 15.7e12),
    'Tesla V100-SXM2-32GB': (None, 125e12, 15.7e12),
}


@functools.cache
def cpu_name():
    """The processor's model name, its bfloat16 matmul units, the vector kernels torch runs on it
    and a cap set on oneDNN's (which runs the matmuls): what decides CPU speed per dtype."""
    name = 'unknown CPU'
    try:
        with open('/proc/cpuinfo') as f:
            name = next((line.split(':', 1)[1].strip() for line in f
                         if line.startswith('model name')), name)
    except OSError:
        pass
    units = [unit for unit, present in (('amx', torch.cpu._is_amx_tile_supported()),
                                        ('avx512_bf16', torch.cpu._is_avx512_bf16_supported()))
             if present]
    kernels = torch.backends.cpu.get_cpu_capability()
    cap = os.environ.get('ONEDNN_MAX_CPU_ISA') or os.environ.get('DNNL_MAX_CPU_ISA')
    return (f"{name} ({', '.join(units) or 'no bf16 units'}; {kernels} kernels"
            f"{f'; oneDNN up to {cap}' if cap else ''})")


def table_peak(gpu_name, dtype):
    """The datasheet peak of this exact GPU name in a torch dtype, or None."""
    peaks = GPU_PEAKS.get(gpu_name, (None, None, None))
    return dict(zip((torch.bfloat16, torch.float16, torch.float32), peaks))[dtype]


def machine(device):
    """The cache key's machine part: a measurement holds for this processor, torch build and thread
    count."""
    if torch.device(device).type == 'cuda':
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def nvidia_driver(version_file='/proc/driver/nvidia/version'):
    """The NVIDIA driver's version ('580.159.04'), from its kernel module's file, or None."""
    try:
        with open(version_file) as f:
            match = re.search(r'Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s', f.readline())
    except OSError:
        return None
    return match.group(1) if match else None


def gpu_info(device):
    """What meta.json records of the GPU a process trains on (None on a CPU): its name, compute
    capability and memory, the driver, and the CUDA, cuDNN and NCCL versions this torch runs on."""
    if torch.device(device).type != 'cuda':
        return None
    props = torch.cuda.get_device_properties(device)
    nccl = '.'.join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
    return {'name': props.name, 'capability': f"{props.major}.{props.minor}",
            'memory_mb': props.total_memory / 2**20, 'driver': nvidia_driver(),
            'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(), 'nccl': nccl}


def read_cache(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # no cache yet, or a broken one: measure again
        return {}


def cache_folder():
    """Where what is the same on every run of a machine is kept (perf.json; the fingerprints of
    datasets that cannot be written): HONESTGPT_CACHE, or ~/.cache/honestgpt."""
    return os.environ.get('HONESTGPT_CACHE',
                          os.path.join(os.path.expanduser('~'), '.cache', 'honestgpt'))


def cached(key, measure, again=False, store=True):
    """measure()'s JSON-able result, stored under key in the cache file; 'cached' says which run
    measured it (None: this one). Processes that get here at once take turns (a lock beside the
    file): the first measures, the others read its result, so runs started together agree (a
    resume needs the same dtype) and none is timed while another measures. again: measure anew and
    replace what is stored; store=False: a measurement for this run only."""
    path = os.path.join(cache_folder(), 'perf.json')
    with locked(path + '.lock'):
        entries = read_cache(path)
        if key in entries and not again:
            return entries[key] | {'cached': path}
        entries[key] = measure() | {'measured_at': time.strftime('%Y-%m-%dT%H:%M:%S%z')}
        if not store:
            return entries[key] | {'cached': None}
        try:
            checkpoint.write_json(path, entries)  # atomic: a reader never sees half a file
        except OSError:
            pass  # a read-only home: measure again next time
    return entries[key] | {'cached': None}


@contextlib.contextmanager
def locked(path, wait=60.0):
    """An exclusive lock on the file path (created, with its folder) for the with block; the
    kernel releases it if the process dies. None where it cannot be created (a read-only home) or
    taken (a file system without locks), or after wait seconds: a process stopped while it held
    the lock (Ctrl-Z) must not hold up every run on the machine."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path, 'a')
    except OSError:
        yield
        return
    with lock:
        deadline = time.time() + wait
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    break
                time.sleep(0.05)
            except OSError:  # a file system without locks (some NFS mounts): go on without one
                break
        yield


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


def measure_flops(device, dtype, budget=0.02, last_budget=0.15):
    """The best FLOP/s of square matmuls. Every timing bounds the peak from below, so take the best
    over sizes (small ones run from cache), over the layouts a Linear multiplies in (forward x W^T,
    backward dY W and dY^T X: an emulated dtype's speed differs tenfold between them) and over
    repeats, each layout timed for budget seconds. Sizes double from 128 until the fastest layout
    takes 10 ms per product, or up to 8192; that last size, where the peak usually is (AMX reaches
    it after tens of ms), is timed for last_budget seconds. 0.8-1.0 s on a 2-core Xeon: a first run
    waits for it (docs/benchmarks.md)."""
    best, n = (0.0, 0), 128
    # random values, from a generator of its own: a GPU multiplies constant data faster (it draws
    # less power, so it clocks down less), and the global RNG (dropout's) must stay untouched
    generator = torch.Generator(device).manual_seed(0)
    while True:
        a, b = (torch.randn((n, n), device=device, dtype=dtype, generator=generator)
                for _ in range(2))
        layouts = ((a, b.T), (a, b), (a.T, b))
        fastest = min(best_seconds(x, y, budget) for x, y in layouts)
        last = fastest > 0.01 or n == 8192
        if last:
            fastest = min(fastest, *(best_seconds(x, y, last_budget) for x, y in layouts))
        best = max(best, (2 * n**3 / fastest, n))
        if last:
            name = str(dtype).removeprefix('torch.')
            return best[0], (f"measured: {best[1]}x{best[1]} {name} matmul, the fastest of 3 "
                             f"layouts and sizes 128 to {n}")
        n *= 2


def peak_flops(device, dtype, beaten=0.0, announce=lambda: None, busy=False):
    """(FLOP/s, how and when it was obtained) for a torch dtype: the datasheet on known GPUs, else
    measured once per machine. beaten: the FLOP/s a training step achieved, above the cached peak,
    which was then measured while other work ran: it is measured again, raised to at least beaten,
    and cached anew. busy: other work holds the CPUs this process's threads need
    (distributed.busy_warning), so a measurement now reads low: it serves this run only, and the
    next run measures again. announce() is called just before a measurement, which takes
    seconds."""
    if torch.device(device).type == 'cuda':
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name, dtype)
        if peak:
            return peak, f"datasheet: {name}, {str(dtype).removeprefix('torch.')} dense"

    def measure():
        announce()
        flops, how = measure_flops(device, dtype)
        raised = (f"; a training step's {beaten / 1e9:,.1f} GFLOP/s, above it" if beaten > flops
                  else '')
        return {'flops': max(flops, beaten), 'how': how + raised}
    entry = cached(f"peak {machine(device)} {dtype}", measure, again=beaten > 0, store=not busy)
    where = (f" (cached in {entry['cached']})" if entry['cached'] else
             ' (not cached: other work kept the CPUs busy)' if busy else '')
    return entry['flops'], f"{entry['how']}, at {entry['measured_at']}{where}"


def reset_peak_memory(device):
    """The CUDA allocator's peak counts from here: start-up's allocations (the peak FLOP/s
    measurement) are not training's. A CPU process's resident peak cannot be reset."""
    if torch.device(device).type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device):
    """The CUDA allocator's peak, or on CPU the process's peak resident set (all it ever held, not
    one model's)."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / (2**20 if sys.platform == 'darwin' else 2**10))


def device_memory(device):
    """Bytes of memory the device has in all: a GPU's, or on CPU the machine's RAM (a container's
    limit may be lower)."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def memory_held(model, optimizer, device):
    """What this process holds, MB: weights, gradients and optimizer state (an FSDP rank its shards,
    a DDP rank full replicas: a DTensor's own part is its to_local()), and its peak memory so
    far."""
    def mb(tensors):
        return sum(getattr(t, 'to_local', lambda: t)().nbytes for t in tensors) / 2**20
    params = list(model.parameters())
    return {'weights_mb': mb(params), 'grads_mb': mb(p.grad for p in params if p.grad is not None),
            'optimizer_mb': mb(v for state in optimizer.state.values() for v in state.values()
                               if torch.is_tensor(v)),
            'peak_mb': peak_memory_mb(device)}


# -----------------------------------------------------------------------------
# training speed, and the time left

IDLE_BUSY = 0.5  # below it for IDLE_INTERVALS log intervals and IDLE_SECONDS: a run says why
IDLE_INTERVALS = 3
IDLE_SECONDS = 5.0


class Speedometer:
    """Tokens/s, MFU and how busy the device was over each log interval, and the time left:
    before the second interval, the start-up estimate from the second micro-batch (the first holds
    one-time work: compilation); then the mean time per iteration over the last 10 intervals (the
    session's first, with its one-time work, left out). MFU never passes 100%: an interval faster
    than the peak has it measured again on a CPU, once a run (peak_flops: seconds), and raised to
    the interval's FLOP/s where that is still above it."""

    def __init__(self, iter_num, max_iters, accum_steps, tokens_per_iter, flops_per_token,
                 peak_flops, processes, device, dtype):
        """accum_steps: micro-batches per iteration on a rank; peak_flops: per process (NaN where
        MFU is not shown); device and dtype: where the peak is measured again."""
        self.first_iter, self.max_iters, self.accum_steps = iter_num, max_iters, accum_steps
        self.tokens_per_iter, self.flops_per_token = tokens_per_iter, flops_per_token
        self.peak_flops, self.processes, self.device, self.dtype = (
            peak_flops, processes, device, dtype)
        self.measured_again = torch.device(device).type == 'cuda'  # a GPU's peak: its datasheet's
        # the synced end times of the session's first two micro-batches (train.py's step)
        self.clock = []
        self.estimate = None  # seconds per iteration, once the clock has two times
        self.recent = collections.deque(maxlen=10)  # (seconds, iterations) of the last intervals
        self.threads = torch.get_num_threads()
        self.idle = []  # the seconds of the idle intervals in a row so far; None once said
        self.restart(iter_num)

    def restart(self, iter_num):
        """The next interval starts now: evaluation and save time is not training throughput."""
        self.since, self.since_iter, self.cpu_since = time.time(), iter_num, time.process_time()

    def startup_estimate(self):
        """Seconds per iteration from the second micro-batch, once it has run; None before and
        after."""
        if self.estimate is not None or len(self.clock) < 2:
            return None
        self.estimate = (self.clock[1] - self.clock[0]) * self.accum_steps
        return self.estimate

    def utilization(self, elapsed):
        """The device's busy share over the interval, or None. A GPU's: NVML's share of its last
        sample period (1/6 to 1 s) in which a kernel ran (torch.cuda.utilization), None without
        nvidia-ml-py. A CPU's: this process's CPU time over the wall time of torch's threads (its
        other threads, the loader's pinning one, can take it past 1)."""
        if torch.device(self.device).type != 'cuda':
            return (time.process_time() - self.cpu_since) / (elapsed * self.threads)
        try:
            return torch.cuda.utilization(self.device) / 100
        except Exception:  # ModuleNotFoundError without nvidia-ml-py; NVMLError without NVML
            return None

    def idle_warning(self, busy, elapsed):
        """The line a run says once when its device stays idle: below IDLE_BUSY for IDLE_INTERVALS
        log intervals in a row and IDLE_SECONDS of training (the session's first interval left
        out: milliseconds-long intervals judge nothing alone), with the likely cause; else ''."""
        if self.idle is None or self.since_iter == self.first_iter:
            return ''
        if busy is None or busy >= IDLE_BUSY:
            self.idle = []
            return ''
        self.idle.append(elapsed)
        if len(self.idle) < IDLE_INTERVALS or sum(self.idle) < IDLE_SECONDS:
            return ''
        stretch = f"{len(self.idle)} log intervals in a row ({sum(self.idle):.0f} s)"
        self.idle = None
        if torch.device(self.device).type == 'cuda':
            return (f"the GPU was busy less than {IDLE_BUSY:.0%} of the time for {stretch}, "
                    f"{busy:.0%} in the last: it waits for the host, for the data loader (raise "
                    f"num_workers), for other work on the CPUs, or on micro-batches too small "
                    f"(raise batch_size)")
        other = cpus_busy()  # while this process sleeps: other work, and its loader workers
        cause = (f"other work keeps {other:.1f} CPUs busy" if other is not None and other >= 0.5
                 else "its threads wait, for the data loader (raise num_workers) or the disk")
        return (f"torch's {self.threads} thread(s) were busy less than {IDLE_BUSY:.0%} of the time "
                f"for {stretch}, {busy:.0%} in the last: {cause}")

    def interval(self, iter_num):
        """The interval ending at iter_num: tokens_per_sec, mfu, eta_seconds (None before an
        estimate), utilization (None where unknown), new_peak ((FLOP/s, how) or None) and
        idle_warning ('' or, once, a line); the next interval starts now."""
        elapsed, iters = time.time() - self.since, iter_num - self.since_iter
        utilization = self.utilization(elapsed)
        idle_warning = self.idle_warning(utilization, elapsed)
        if self.since_iter > self.first_iter:
            self.recent.append((elapsed, iters))
        per_iter = sum(s for s, _ in self.recent) / sum(n for _, n in self.recent) if self.recent \
            else self.estimate
        tokens_per_sec = iters * self.tokens_per_iter / elapsed
        achieved = tokens_per_sec * self.flops_per_token / self.processes  # per process
        new_peak = None
        if achieved > self.peak_flops:  # the peak was measured while other work ran
            if not self.measured_again:
                new_peak = peak_flops(self.device, self.dtype, beaten=achieved)
                self.measured_again = True
            else:
                new_peak = achieved, f"a training step's, at iteration {iter_num}"
            self.peak_flops = new_peak[0]
        self.restart(iter_num)
        return {'tokens_per_sec': tokens_per_sec, 'mfu': achieved / self.peak_flops,
                'eta_seconds': None if per_iter is None else (self.max_iters - iter_num) * per_iter,
                'utilization': utilization, 'new_peak': new_peak, 'idle_warning': idle_warning}


# -----------------------------------------------------------------------------
# where an iteration's time goes

PHASES = ('data', 'forward', 'backward', 'optimizer')  # train.py's record_function labels


def start_profiler(device_type):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # one cycle: acc_events changes nothing but torch 2.11's warning that each cycle is cleared
    profiler = torch.profiler.profile(activities=activities, acc_events=True)
    profiler.start()
    return profiler


def stop_profiler(profiler, device_type, trace_path):
    """{phase: ms} of the profiled iteration; its chrome trace (chrome://tracing, ui.perfetto.dev)
    goes to trace_path, if one is given."""
    profiler.stop()
    if trace_path:
        profiler.export_chrome_trace(trace_path)
    return phase_times(profiler.events(), device_type)


def phase_times(events, device_type):
    """{phase: ms} of a profiled iteration from torch.profiler's events, by train.py's labelled
    ranges. On a CPU, the wall time of each range. On CUDA, where kernels run after their launch,
    the device time of the kernels launched while each range was open, on any thread: backward's ops
    run on the autograd engine's own thread there, outside the caller's range, so each op's kernels
    (its self device time: each kernel once) go to the range its start falls in. 'other': the rest
    of the iteration's wall time (CPU) or of its kernels' time (CUDA)."""
    cpu_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    phases = [e for e in cpu_events if e.name in PHASES]  # the calling thread's labelled ranges
    ms = dict.fromkeys(PHASES, 0.0)
    if device_type != 'cuda':
        for phase in phases:
            ms[phase.name] += phase.cpu_time_total / 1e3
        wall = (max(e.time_range.end for e in cpu_events)
                - min(e.time_range.start for e in cpu_events))
        return ms | {'other': max(0.0, wall / 1e3 - sum(ms.values()))}
    other = 0.0
    for event in cpu_events:
        within = [p.name for p in phases
                  if p.time_range.start <= event.time_range.start < p.time_range.end]
        if within:
            ms[within[0]] += event.self_device_time_total / 1e3
        else:
            other += event.self_device_time_total / 1e3
    return ms | {'other': other}
