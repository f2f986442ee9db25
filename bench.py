"""
Measure training speed: train.py's optimizer step on the same data, model and settings, timed after a
warm-up, with model FLOPs utilization (MFU) and a profiler breakdown of one step; under torchrun, the
memory each rank holds, to compare DDP's replicas with FSDP's shards.

    python bench.py config/tiny.py --batch_size=8
    python bench.py config/tiny.py --compare='--dtype=bfloat16 --compile=True'
    torchrun --standalone --nproc_per_node=2 bench.py config/tiny.py --parallel=fsdp --gradient_accumulation_steps=2

Takes every train.py key, so any training config works unchanged, plus the bench keys below. With
compare, a second setting B (the same config plus those overrides) is built next to A and both are
timed in alternating rounds, A B A B ..., so that other load on the machine hits both alike.
"""
import ast
import atexit
import json
import os
import shlex
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, record_function

import data
import perf
from configurator import ConfigError, configure
from model import GPT, GPTConfig

bench_iters = 20  # timed optimizer steps per setting
bench_warmup = 5  # untimed optimizer steps first, the first included: compilation, allocator, loader workers
profile = True  # break one more optimizer step down with torch.profiler
trace = ''  # write that step's chrome trace (chrome://tracing, ui.perfetto.dev) here; with compare, NAME_A.json and NAME_B.json
compare = ''  # overrides for a second setting B, e.g. '--compile=True': timed interleaved with A
bench_keys = ['bench_iters', 'bench_warmup', 'profile', 'trace', 'compare']
ROUNDS = 10  # A B alternations: short rounds, so that a spell of other load on the machine hits both settings
PHASES = ('data', 'forward', 'backward', 'optimizer')


def train_defaults():
    """train.py's defaults, read from its source (importing it would start a run): the constants above config_keys."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')) as f:
        assigns = [(node.targets[0].id, node.value) for node in ast.parse(f.read()).body
                   if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)]
    names = [name for name, _ in assigns]
    return {name: ast.literal_eval(value) for name, value in assigns[:names.index('config_keys')]}


defaults = train_defaults() | {k: globals()[k] for k in bench_keys}
try:
    config, _ = configure(defaults, sys.argv[1:])
    configs = {'A': config}
    if config['compare']:
        configs['B'] = configure(defaults, sys.argv[1:] + shlex.split(config['compare']))[0]
except ConfigError as e:
    sys.exit(f"error: {e}")
globals().update({k: config[k] for k in bench_keys})
for cfg in configs.values():  # the checks train.py makes on these keys
    if cfg['parallel'] not in ('ddp', 'fsdp') or cfg['backend'] not in ('auto', 'nccl', 'gloo'):
        sys.exit(f"error: parallel='{cfg['parallel']}', backend='{cfg['backend']}': use parallel 'ddp' or 'fsdp', "
                 f"backend 'auto', 'nccl' or 'gloo'")

# under torchrun every rank builds and times the same settings; rank 0 alone prints and writes the trace
distributed = 'RANK' in os.environ
rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if distributed else (0, 0, 1)
on_cuda = config['device'].startswith('cuda') or (config['device'] == 'auto' and torch.cuda.is_available())
if distributed:
    if on_cuda:
        torch.cuda.set_device(local_rank)  # collectives and FSDP's mesh use the current device: one GPU per rank
    dist.init_process_group(backend=config['backend'] if config['backend'] != 'auto' else 'nccl' if on_cuda else 'gloo')
    # on every exit path, errors too; the pause hands gloo's threads the GIL first (see shut_down_process_group in train.py)
    atexit.register(lambda: (time.sleep(0.1), dist.destroy_process_group()))
say = print if rank == 0 else lambda *args: None


def build(cfg):
    """One setting as train.py builds it: returns (step, info); step() runs one optimizer step and returns its loss."""
    device = cfg.device if cfg.device != 'auto' else 'cuda' if torch.cuda.is_available() else 'cpu'
    device = f'cuda:{local_rank}' if distributed and device.startswith('cuda') else device  # as train.py: one GPU per rank
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'
    dataset_dir = os.path.join(cfg.data_dir, cfg.dataset)
    if not os.path.exists(os.path.join(dataset_dir, 'meta.json')):
        sys.exit(f"error: dataset '{cfg.dataset}' is not prepared in {dataset_dir}: run python prepare.py {cfg.dataset} (or set data_dir)")
    with open(os.path.join(dataset_dir, 'meta.json')) as f:
        meta = json.load(f)
    dtype = cfg.dtype if cfg.dtype != 'auto' else perf.auto_dtype(device, dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size, bias=cfg.bias, vocab_size=meta['vocab_size'], dropout=cfg.dropout), cfg.batch_size)[0]
    sharded = distributed and cfg.parallel == 'fsdp'
    if sharded and dtype == 'float16':
        sys.exit("error: parallel='fsdp' trains in float32 or bfloat16: set dtype=bfloat16")
    if cfg.gradient_accumulation_steps % world_size:
        sys.exit(f"error: gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible by the {world_size} "
                 f"processes: make it a multiple of {world_size}")
    accum_steps = cfg.gradient_accumulation_steps // world_size
    autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))
    if device_type == 'cuda':
        torch.set_float32_matmul_precision('high')  # as train.py: TF32 for what autocast leaves in float32
    windows = data.TokenWindows(os.path.join(dataset_dir, 'train.bin'), meta['dtype'], cfg.block_size)
    try:
        sampler = data.TrainSampler(windows.num_tokens, cfg.block_size, cfg.batch_size,
                                    cfg.batch_size * cfg.gradient_accumulation_steps, cfg.seed, rank, world_size)
    except data.DataError as e:
        sys.exit(f"error: {e}")
    batches = data.endless_batches(windows, sampler, cfg.num_workers, cfg.seed + rank, device_type == 'cuda')
    torch.manual_seed(cfg.seed)
    raw_model = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size, bias=cfg.bias,
                              vocab_size=meta['vocab_size'], dropout=cfg.dropout)).to(device)
    raw_model.activation_checkpointing = cfg.activation_checkpointing
    if sharded:
        raw_model.fully_shard(getattr(torch, dtype))
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if distributed and not sharded:
        model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)
    torch.manual_seed(cfg.seed + rank)  # as train.py: the same initial weights everywhere, dropout masks per rank
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2))
    scaler = torch.amp.GradScaler(device_type, init_scale=cfg.init_scale, enabled=dtype == 'float16')

    @contextmanager
    def phase(name, sync):
        with record_function(name):
            yield
            if sync:  # CUDA kernels run behind the host: wait, so the range holds the device's work
                torch.cuda.synchronize(device)

    def step(sync_phases=False):
        sync = sync_phases and device_type == 'cuda'
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(accum_steps):
            with phase('data', sync):
                x, y, _ = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if sharded:  # as train.py: gradients are reduced on the last micro-batch only
                model.set_requires_gradient_sync(micro_step == accum_steps - 1)
            elif distributed:
                model.require_backward_grad_sync = micro_step == accum_steps - 1
            with phase('forward', sync), autocast:
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                loss_sum += loss.detach()
            with phase('backward', sync):
                scaler.scale(loss / accum_steps).backward()
        with phase('optimizer', sync):
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float('inf'))
            grad_norm = grad_norm.full_tensor() if sharded else grad_norm
            if distributed:
                dist.all_reduce(loss_sum)
            loss_mean, _ = torch.stack([loss_sum / cfg.gradient_accumulation_steps, grad_norm.float()]).tolist()  # train.py's sync
            scaler.step(optimizer)
            scaler.update()
        if device_type == 'cuda':  # the clock must see the finished step, not its launch
            torch.cuda.synchronize(device)
        return loss_mean

    def state_mb():
        """MB of weights, gradients and optimizer state this rank holds: FSDP's shards, or DDP's full replicas."""
        local = lambda tensors: sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors) / 2**20
        return {'weights': local(raw_model.parameters()), 'grads': local(p.grad for p in raw_model.parameters() if p.grad is not None),
                'AdamW': local(v for s in optimizer.state.values() for v in s.values())}

    info = SimpleNamespace(device=device, dtype=dtype, flops_per_token=raw_model.flops_per_token(), params=raw_model.num_params(),
                           tokens_per_step=cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps,
                           parallel=cfg.parallel if distributed else 'one process', state_mb=state_mb)
    return step, info


def timed(step, n):
    """(seconds, loss) of each of n optimizer steps."""
    results = []
    for _ in range(n):
        start = time.perf_counter()
        loss = step()
        results.append((time.perf_counter() - start, loss))
    return results


def breakdown(step, device, trace_path):
    """Milliseconds of one optimizer step per phase, and 'other' (zero_grad, the profiler, idle): what the step's wall time leaves."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith('cuda') else [])
    with torch.profiler.profile(activities=activities) as prof:
        with record_function('step'):
            step(sync_phases=True)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    ms = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages() if e.key in PHASES + ('step',)}
    return {**{p: ms[p] for p in PHASES}, 'other': ms['step'] - sum(ms[p] for p in PHASES)}, ms['step']


def per_rank(value):
    """value from every rank, in rank order."""
    if not distributed:
        return [value]
    values = [None] * world_size
    dist.all_gather_object(values, value)
    return values


# other processes competing for the cores slow every step (and the peak measurement): say how busy the machine is
say(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs with load average {os.getloadavg()[0]:.2f} "
    f"before this run; {world_size} process(es); A: {' '.join(sys.argv[1:])}" + (f"; B: A {compare}" if compare else ''))
runs = {}
for name, cfg in configs.items():  # all built before any is timed: every setting is in memory at once
    cfg = SimpleNamespace(**cfg)
    step, info = build(cfg)
    peak, how = perf.peak_flops(info.device, getattr(torch, info.dtype))
    first = timed(step, 1)[0][0]
    timed(step, bench_warmup - 1)
    runs[name] = SimpleNamespace(cfg=cfg, step=step, info=info, peak=peak, how=how, first=first, steps=[])
chunk = max(1, bench_iters // ROUNDS)
while len(runs['A'].steps) < bench_iters:
    for run in runs.values():
        run.steps += timed(run.step, min(chunk, bench_iters - len(run.steps)))

for name, run in runs.items():
    cfg, info = run.cfg, run.info
    run.seconds = [s for s, _ in run.steps]
    run.tokens_per_sec = info.tokens_per_step / statistics.median(run.seconds)
    run.fastest_tokens_per_sec = info.tokens_per_step / min(run.seconds)
    achieved = info.flops_per_token * run.tokens_per_sec
    say(f"\n{name}: {info.device} {info.dtype}, {'compiled' if cfg.compile else 'eager'}, {info.params / 1e6:.2f}M parameters, "
        f"{info.parallel}, {info.tokens_per_step:,} tokens per step ({cfg.gradient_accumulation_steps} x {cfg.batch_size} x "
        f"{cfg.block_size}), num_workers={cfg.num_workers}; loss {run.steps[-1][1]:.4f} after {bench_warmup + len(run.seconds)} steps")
    say(f"  first step: {run.first:.2f} s{' (includes compilation)' if cfg.compile else ''}")
    say(f"  ms/step: median {statistics.median(run.seconds) * 1e3:.1f}, min {min(run.seconds) * 1e3:.1f} over {len(run.seconds)} steps")
    say(f"  tokens/s: {run.tokens_per_sec:,.0f}")
    say(f"  model FLOPs/token: {info.flops_per_token / 1e6:.2f}M; achieved {achieved / 1e9:.2f} GFLOP/s")
    say(f"  MFU: {achieved / (run.peak * world_size):.1%} of {run.peak / 1e9:.1f} GFLOP/s peak per process ({run.how})")
    for r, mb in enumerate(per_rank(info.state_mb())):
        say(f"  rank {r} holds: weights {mb['weights']:,.2f} MB, grads {mb['grads']:,.2f} MB, AdamW {mb['AdamW']:,.2f} MB; "
            f"total {sum(mb.values()):,.2f} MB")
    if profile:
        trace_path = f"{os.path.splitext(trace)[0]}_{name}.json" if trace and compare else trace
        phase_ms, step_ms = breakdown(run.step, info.device, trace_path if rank == 0 else '')
        say(f"  profile of one step ({step_ms:.1f} ms): " + ', '.join(f"{p} {ms / step_ms:.1%}" for p, ms in phase_ms.items()))
peaks = per_rank(perf.peak_memory_mb(runs['A'].info.device))
say("\npeak memory: " + ', '.join(f"rank {r} {mb:,.0f} MB" for r, mb in enumerate(peaks)) +
    (" (each process held both settings: compare memory in separate runs)" if compare else ''))
if compare:
    ratio = runs['B'].tokens_per_sec / runs['A'].tokens_per_sec
    fastest = runs['B'].fastest_tokens_per_sec / runs['A'].fastest_tokens_per_sec
    say(f"tokens/s B/A: {ratio:.3f} (B is {abs(ratio - 1):.1%} {'faster' if ratio > 1 else 'slower'}); fastest steps: {fastest:.3f}")
