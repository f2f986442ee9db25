"""
Devices, processes and collectives: which device a process uses and how many CPU threads, how
processes join a group under torchrun, the DDP wrapper, and the collectives every rank reaches at
the same points (a sum, a flag, a gather).
"""
import atexit
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def resolve_device(device, local_rank=None, cuda_count=None):
    """(device, type) for a device setting; local_rank is None for one process. A CUDA device
    always has an index, since torch.cuda.set_device('cuda') raises: 'auto' and 'cuda' are
    cuda:LOCAL_RANK (cuda:0 for one process); under torchrun each rank takes its own GPU, so an
    explicit index there is refused. cuda_count: the GPUs this process sees (tests pass it; None
    asks torch). ValueError names the fix for a device this code cannot use."""
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == 'auto':
        device = 'cuda' if cuda_count else 'cpu'
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ('cpu', 'cuda'):
        raise ValueError(f"device='{device}' is not supported: use device=cpu, cuda, cuda:N or "
                         f"auto")
    if parsed.type == 'cpu':
        return 'cpu', 'cpu'
    if not cuda_count:
        raise ValueError(f"device='{device}' but CUDA is not available here: use device=cpu")
    if parsed.index is not None and local_rank is not None:
        raise ValueError(f"device='{device}' under torchrun: each process takes the GPU of its "
                         f"local rank, so use device=cuda (CUDA_VISIBLE_DEVICES chooses which "
                         f"GPUs)")
    index = parsed.index if parsed.index is not None else local_rank or 0
    if index >= cuda_count:
        raise ValueError(f"device='{device}' needs GPU {index} but this process sees {cuda_count}: "
                         f"use cuda:0 to cuda:{cuda_count - 1}, or as many processes per node as "
                         f"GPUs")
    return f'cuda:{index}', 'cuda'


def group_backend(device, backend):
    """(backend, device_id) for init_process_group: nccl on CUDA and gloo on a CPU for
    backend='auto'. An nccl group is bound to this rank's GPU: unbound, its first collective
    (data.py's barrier) runs on GPU rank % GPUs per node, one another process owns on a node that
    runs fewer processes than it has GPUs. ValueError: nccl on a CPU."""
    if backend == 'auto':
        backend = 'nccl' if torch.device(device).type == 'cuda' else 'gloo'
    if backend == 'nccl' and torch.device(device).type != 'cuda':
        raise ValueError(f"backend='nccl' runs on CUDA GPUs, not on device='{device}': use "
                         f"backend=gloo or auto")
    return backend, torch.device(device) if backend == 'nccl' else None


def init_process_group(device, backend):
    """Join torchrun's group on group_backend's backend, bound to device under nccl. torchrun keeps
    its store across --max-restarts, so each attempt's addresses get a prefix a restarted group
    cannot confuse with the dead one's. The timeout is 30 minutes (gloo's default): NCCL's 10 would
    end ranks waiting for rank 0's save of a large model. At exit, on every path, the group is
    destroyed (destroy_process_group)."""
    store, _, _ = next(dist.rendezvous('env://'))
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    backend, device_id = group_backend(device, backend)
    dist.init_process_group(backend=backend, store=store, rank=int(os.environ['RANK']),
                            world_size=int(os.environ['WORLD_SIZE']), device_id=device_id,
                            timeout=datetime.timedelta(minutes=30))
    atexit.register(destroy_process_group)


def destroy_process_group():
    """At exit: a pause, then the group's end. gloo's threads free a finished collective's tensors
    after the caller moved on, and such a thread taking the GIL at interpreter shutdown aborts the
    process."""
    time.sleep(0.1)
    dist.destroy_process_group()


def usable_cpus(cgroup_root='/sys/fs/cgroup', proc_cgroup='/proc/self/cgroup'):
    """The CPUs this process may use: its affinity, capped by a container's CPU quota (cgroup v2's
    cpu.max, 'QUOTA PERIOD' or 'max PERIOD', of this process's group and those above it), whole CPUs
    only. torch's default thread count follows the affinity but not the quota."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open(proc_cgroup) as f:
            group = next(line[3:].strip('/\n') for line in f if line.startswith('0::'))
    except (OSError, StopIteration):  # no cgroup v2
        return cpus
    parts = group.split('/') if group else []
    for depth in range(len(parts) + 1):
        try:
            with open(os.path.join(cgroup_root, *parts[:depth], 'cpu.max')) as f:
                quota, period = f.read().split()
        except (OSError, ValueError):
            continue
        # threads past the quota are throttled: a fraction of a CPU does not count
        if quota != 'max':
            cpus = min(cpus, max(1, int(quota) // int(period)))
    return cpus


def set_threads(threads):
    """torch's CPU threads in this process: threads where it is above 0, else torch's own count
    (OMP_NUM_THREADS where it is set, as torchrun sets 1; else the physical cores of its affinity)
    capped by a container's CPU quota, which torch does not see (usable_cpus). ValueError: more
    threads than the machine has CPUs, which only wait for each other (and, thousands of them,
    crash the process)."""
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise ValueError(f"threads={threads} is more than this machine's {cpus} CPUs: use at "
                         f"most {cpus}, or 0 for torch's own count")
    if not threads:
        threads = torch.get_num_threads()
        threads = threads if os.environ.get('OMP_NUM_THREADS') else min(threads, usable_cpus())
    torch.set_num_threads(threads)


def cpu_use(seconds=0.2, stat='/proc/stat'):
    """What meta.json records of the CPUs as a process starts, before its own work: the CPUs it may
    use, and how many of them other work keeps busy (stat's busy time over `seconds`; None with one
    thread, which cannot wait for another, or where there is no /proc/stat)."""
    cpus = {'usable': usable_cpus(), 'busy': None}
    if torch.get_num_threads() == 1:
        return cpus
    return cpus | {'busy': cpus_busy(seconds, stat)}


def cpus_busy(seconds=0.2, stat='/proc/stat'):
    """How many of this process's CPUs were busy over the next seconds, while it sleeps (stat's
    busy time), or None where there is no /proc/stat or it lists none of them."""
    def times():  # {cpu: (all time, idle time)} in clock ticks
        with open(stat) as f:
            rows = [line.split() for line in f if line[:3] == 'cpu' and line[3].isdigit()]
        return {int(r[0][3:]): (sum(map(int, r[1:])), int(r[4]) + int(r[5])) for r in rows}
    try:
        before = times()
        time.sleep(seconds)
        after = times()
    except (OSError, ValueError, IndexError):
        return None
    # a CPU of the affinity that stat leaves out (a container's own view of it) is left out too
    listed = os.sched_getaffinity(0) & before.keys() & after.keys()
    if not listed:  # none of them: unknown, not 0 busy
        return None
    busy = [1 - (after[c][1] - before[c][1]) / (after[c][0] - before[c][0])
            for c in listed if after[c][0] > before[c][0]]
    return round(sum(busy), 2)


def busy_warning(threads, cpus):
    """A line when torch's threads outnumber the CPUs that other work leaves free (cpus: cpu_use()),
    or ''. Threads that wait for a CPU spin: a run can be many times slower."""
    free = max(1, math.floor(cpus['usable'] - (cpus['busy'] or 0) + 0.5))
    if threads <= free:
        return ''
    return (f"warning: {threads} threads, but {free} of the {cpus['usable']} CPUs this process may "
            f"use are free ({cpus['busy'] or 0:.1f} busy with other work): threads that wait for a "
            f"CPU spin, many times slower: use --threads={free}, or wait until the machine is free")


def setup(device, local_rank, deterministic, backend, threads):
    """This process's (device, device type), made ready: resolve_device's choice, torch's CPU
    threads (set_threads), the current CUDA device (with TF32 tensor cores for what autocast leaves
    in float32), deterministic kernels when asked, and under torchrun (local_rank not None) the
    process group joined. ValueError: a device this code cannot use."""
    device, device_type = resolve_device(device, local_rank)
    set_threads(threads)
    if device_type == 'cuda':
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision('high')
    if deterministic:
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # before cuBLAS starts
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if local_rank is not None:
        init_process_group(device, backend)
    return device, device_type


def data_parallel(model, device_ids):
    """model wrapped in DDP without the buffer broadcast DDP makes in every forward, where it
    would be a collective in the micro-batches that must not sync. torch 2.11 to 2.15 (README)
    differ here, and only here: the version is read, not DDP's signature, which a wrapper of
    DDP.__init__ (the tests' probe) hides."""
    if torch.__version__ >= '2.13':  # adds forward_sync_buffers, deprecates broadcast_buffers
        return DDP(model, device_ids=device_ids, forward_sync_buffers=False)  # synced once, here
    # 2.11 and 2.12: never synced, which holds for rope's tables: every rank computed the same
    return DDP(model, device_ids=device_ids, broadcast_buffers=False)


def sum_over_ranks(values):
    """values, a tensor on this process's device, summed over the ranks in place (alone: as they
    are). Every rank calls it at the same points."""
    if dist.is_initialized():
        dist.all_reduce(values)
    return values


def any_rank(flag, device):
    """Whether flag is true on any rank. Every rank calls it at the same points."""
    return bool(sum_over_ranks(torch.tensor(float(bool(flag)), device=device)).item())


def gather(obj):
    """obj of every rank, in rank order (alone: [obj]). Every rank calls it at the same points."""
    if not dist.is_initialized():
        return [obj]
    objs = [obj] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs
