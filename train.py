"""
Train a GPT. One process:

    python train.py config/tiny.py --batch_size=8

Data parallel on several processes or machines (gloo on CPU, nccl on GPUs):

    torchrun --standalone --nproc_per_node=2 train.py config/tiny.py --batch_size=8 \
        --gradient_accumulation_steps=2

The defaults below keep nanoGPT's names and meanings; config files and --key=value override them
(configurator.py). A run writes to out_dir: config.json, meta.json, train.log, metrics.jsonl,
best.pt (the best evaluation by best_by: the lowest val loss, the EMA's where there is one), last.pt
(the latest state, for resuming), report.md and curves.png.
"""
import dataclasses
import gc
import itertools
import math
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.profiler import record_function

import checkpoint
import data
import distributed
import evaluate
import exits
import perf
import precision
import preflight
import runlog
import sample
import smoke
from configurator import fail
from distributed import gather
from exits import abort, check
from model import GPT
from runlog import log, record

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out'
eval_interval = 2000
log_interval = 1
eval_iters = 200  # eval batches per split and evaluation, evenly spread; 0: the whole split
# True: print the starting weights' (GPT-2's, a checkpoint's) train and val loss, then exit; no
# step, nothing written
eval_only = False
always_save_checkpoint = True  # last.pt at every evaluation; False: only at a new best and the end
checkpoint_interval = 0  # also write last.pt every this many iterations, without evaluating; 0: off
# > 0: also keep the latest this many checkpoints of evaluations and checkpoint_interval, named by
# iteration (ckpt-ITER.pt; a link to last.pt's file where they hold one state); 0: none
keep_checkpoints = 0
# True: a save copies the state to host memory and a background thread writes it while training
# goes on (parallel='fsdp': DCP's async_save); the next save, a stop and the end wait for it
async_save = False
# 'scratch', 'resume' (out_dir/last.pt or resume_from), 'auto' (out_dir/last.pt if there is one,
# else resume_from if given, else scratch), or GPT-2's weights: 'gpt2', 'gpt2-medium', 'gpt2-large',
# 'gpt2-xl', a Hugging Face folder or .safetensors file
init_from = 'scratch'
resume_from = ''  # a checkpoint to resume instead of out_dir/last.pt: out/best.pt, out/stable.pt
test_eval = True  # at the end, evaluate the best weights on the test split
sample_tokens = 200  # at the end, print a sample of this many tokens from the best weights; 0: none
write_report = True  # out_dir/report.md and curves.png, also when a run aborts or a signal stops it
wandb_log = False  # Weights & Biases (imported only when on)
wandb_project = 'honestgpt'
wandb_run_name = 'run'
tensorboard_log = False  # event files in out_dir/tensorboard
cost_per_hour = 0.0  # price of one process-hour, for the report's cost estimate; 0 leaves cost out
profile_iter = 0  # > 0: profile that iteration: out_dir/trace.json, and its phases in metrics.jsonl
# multiple-choice tasks scored at every evaluation (evaluate.py): .jsonl files, HellaSwag's or
# {"context", "choices", "answer"}, comma-separated; '' for none
eval_tasks = ''
eval_tasks_examples = 500  # the first this many examples of each task file; 0: all of them
best_by = 'val_loss'  # best.pt by 'val_loss' (lowest) or 'acc_norm' (highest, eval_tasks' mean)
# data
dataset = 'pystdlib_char'  # a folder of shards under data_dir (prepare.py's, or llm.c's), or a glob
data_dir = 'data'
gradient_accumulation_steps = 40  # global: divided by the number of processes
batch_size = 12  # micro-batch per process
# True: at start, halve batch_size until a step fits in memory, raising gradient_accumulation_steps
# to keep the global batch (smoke.fit_batch); config.json and the checkpoints record what it found
fit_batch = False
block_size = 1024
num_workers = 1  # loader worker processes per rank; 0 loads in the training process
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
activation = 'gelu'  # the MLP's: 'gelu', 'gelu_tanh' (GPT-2's) or 'relu2' (ReLU squared)
pos_emb = 'learned'  # 'learned' (an embedding, GPT-2's) or 'rope' (rotary: relative, no weights)
qk_norm = False  # RMS-normalize each head's queries and keys before attention
tie_head = True  # the output head shares the token embedding's matrix (GPT-2's); False: its own
logit_softcap = 0.0  # > 0: logits become logit_softcap * tanh(logits / logit_softcap); 0: off
zero_init = False  # output projections (and an untied head) start at zero instead of small noise
# optimizer
optimizer = 'adamw'  # 'adamw', or 'muon': Muon for the blocks' matrices and AdamW for the rest
learning_rate = 6e-4  # AdamW's
muon_lr = 0.02  # Muon's base rate; the schedule scales it by the same factor as learning_rate
muon_momentum = 0.95
muon_dtype = 'auto'  # Newton-Schulz's dtype: 'auto', 'float32', 'bfloat16' (precision.py)
# > 0: also keep an exponential moving average of the weights, ema = decay * ema + (1 - decay) * w
# after each optimizer step that ran; it is evaluated beside them and picks best.pt; 0: off
ema_decay = 0.0
layer_lr_decay = 1.0  # < 1, for fine-tuning: block i's rates x decay^(n_layer - i) (GPT.lr_scale)
max_iters = 600000  # optimizer steps attempted, of gradient_accumulation_steps micro-batches each
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0 disables clipping (the norm is still measured and logged)
# learning rate schedule: linear warmup, decay to min_lr at lr_decay_iters, then flat
decay_lr = True
lr_schedule = 'cosine'  # 'cosine' (nanoGPT's) or 'wsd': warmup, stable (then stable.pt), decay
wsd_decay_frac = 0.2  # wsd: the decay's share of the iterations between warmup and lr_decay_iters
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5  # AdamW's floor; Muon's is muon_lr * min_lr / learning_rate
# early stopping and checks
patience = 0  # stop after this many evaluations without a new best (best_by); 0 never stops early
overfit_one_batch = False  # train on one fixed batch: its loss must approach zero if all is wired
smoke_steps = 30  # steps on one batch before a new run, at most, to lower its loss 10%; 0: off
# system
# 'auto' (cuda:LOCAL_RANK if there is a GPU, else cpu), 'cpu', 'cuda', 'cuda:N' (one process)
device = 'auto'
dtype = 'auto'  # 'auto', 'float32', 'bfloat16' or 'float16' (float16 uses a GradScaler)
compile = False  # torch.compile the model
backend = 'auto'  # distributed backend: 'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'
parallel = 'ddp'  # several processes: 'ddp' (replicas), 'fsdp' (weights, grads, optimizer sharded)
activation_checkpointing = False  # recompute activations in backward, block by block: less memory
init_scale = 65536.0  # float16 GradScaler's first loss scale
max_consecutive_skips = 20  # abort when float16 overflow skips this many optimizer steps in a row
seed = 1337
threads = 0  # torch's CPU threads per process; 0: its own count, capped by a container's CPU quota
deterministic = False  # torch.use_deterministic_algorithms: bitwise repeatable where kernels allow
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
defaults = {k: globals()[k] for k in config_keys}
ddp = 'RANK' in os.environ  # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
rank = int(os.environ.get('RANK', 0))
local_rank = int(os.environ.get('LOCAL_RANK', 0))
world_size = int(os.environ.get('WORLD_SIZE', 1))
master = rank == 0  # as runlog's: rank 0 alone writes files and logs
config, config_sources, model_config = preflight.settings(defaults, sys.argv[1:], world_size, ddp)
globals().update(config)
# the checkpoint a resume continues, read, and out_dir checked: a refused run prepares no dataset
resuming, ckpt_path, ckpt = preflight.resume_point(config)
sharded = ddp and parallel == 'fsdp'

# -----------------------------------------------------------------------------
# processes, devices and data
try:  # the device, deterministic kernels when asked, and under torchrun the process group
    device, device_type = distributed.setup(device, local_rank if ddp else None, deterministic,
                                            backend, threads)
except ValueError as e:  # may differ between nodes: every rank that fails says so
    fail(f"rank {rank}: {e}" if ddp else e)
cpus = distributed.cpu_use()  # how busy other work keeps the machine, before this process's own
# micro-batches per optimizer step on this rank
accum_steps = gradient_accumulation_steps // world_size
global_batch = batch_size * gradient_accumulation_steps  # windows per optimizer step, all ranks
# per split and evaluation (0: all), whatever micro-batches fit_batch splits them into (a resume:
# the run's, from preflight)
eval_windows = eval_iters * batch_size

def samplers(batch_size):
    """The train sampler and the evaluation loaders, in micro-batches of batch_size (fit_batch may
    lower it): the same windows a step and an evaluation."""
    train_sampler = data.TrainSampler(splits['train'].num_tokens, block_size, batch_size,
                                      global_batch, seed, rank, world_size)
    # a sharded forward is a collective: every rank must run as many eval batches as the others
    eval_samplers = {s: data.EvalSampler(w.num_tokens, block_size, batch_size, eval_windows, rank,
                                         world_size, sharded) for s, w in splits.items()}
    eval_loaders = {s: data.make_loader(splits[s], sampler, 0, seed, device_type == 'cuda')
                    for s, sampler in eval_samplers.items()}
    return train_sampler, eval_loaders

try:
    data_meta, splits, dataset_id = data.open_splits(data_dir, dataset, block_size, local_rank == 0)
    train_sampler, eval_loaders = samplers(batch_size)
except data.DataError as e:  # on every rank (data.agree): a node's data may differ from rank 0's
    fail(f"rank {rank}: {e}" if ddp else e)
if 'test' not in splits and test_eval:
    log(f"dataset '{dataset}' has no test split: the test evaluation is skipped")
    test_eval = False  # config.json keeps what was asked

# -----------------------------------------------------------------------------
# the model and optimizer: weights from a checkpoint, GPT-2's or a random init; precision; the
# schedule
# the same data on every rank; the tasks; the checkpoint or GPT-2's weights, checked; the dtypes;
# the peak FLOP/s
init = preflight.start(config, config_sources, defaults, model_config,
                       (resuming, ckpt_path, ckpt), data_meta, dataset_id, splits, device, sharded,
                       cpus)
model_config, dtype, muon_dtype = init.model_config, init.dtype, init.muon_dtype
eval_windows = init.eval_windows  # a fit_batch run's, resumed with its steps split otherwise
autocast = precision.autocast(device_type, dtype)

# the shape GPT-2's weights may have set
log(f"building the model: {model_config.n_layer} layers, {model_config.n_head} heads, "
    f"{model_config.n_embd} wide, block {block_size}, vocab {model_config.vocab_size}")
torch.manual_seed(seed)  # the same initial weights on every rank
model = GPT(model_config)
if init.pretrained_state is not None:
    model.load_state_dict(init.pretrained_state)
    init.pretrained_state = None  # a second copy in host memory all run long: gigabytes at GPT-2 XL
model.activation_checkpointing = activation_checkpointing
# the moving average starts at the initial weights: an update now copies them (and counts one, so
# that every later update averages)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema_decay)) if ema_decay else None
if ema:
    ema.update_parameters(model)
for module in [model] + ([ema.module] if ema else []):
    if sharded:  # FSDP moves each block to the device as it shards it: no rank holds it whole there
        module.fully_shard(precision.DTYPES[dtype], device_type)
    else:
        module.to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2),
                                       config['optimizer'], muon_lr, muon_momentum, muon_dtype,
                                       layer_lr_decay)
min_lr_factor = min_lr / learning_rate if learning_rate > 0 else 0.0
decay_start = lr_decay_iters - wsd_decay_frac * (lr_decay_iters - warmup_iters)  # wsd's

def lr_factor(opt_step):
    """The schedule as a multiple of each group's base rate, a function of real optimizer steps
    only: linear warmup, then cosine (nanoGPT's) or constant-then-linear (wsd) decay to min_lr at
    lr_decay_iters, then flat."""
    if not decay_lr:
        return 1.0
    if opt_step < warmup_iters:
        return (opt_step + 1) / (warmup_iters + 1)
    if opt_step > lr_decay_iters:
        return min_lr_factor
    if lr_schedule == 'wsd':
        return 1.0 - (1.0 - min_lr_factor) * max(0.0, opt_step - decay_start) / (
            lr_decay_iters - decay_start)
    coeff = 0.5 * (1.0 + math.cos(math.pi * (opt_step - warmup_iters)
                                  / (lr_decay_iters - warmup_iters)))
    return min_lr_factor + coeff * (1.0 - min_lr_factor)

# each group from its own base rate
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=dtype == 'float16')

if fit_batch:  # micro-batches that fit: found now, or by the run a resume continues (preflight)
    if not resuming:
        config['batch_size'], config['gradient_accumulation_steps'] = smoke.fit_batch(
            batch_size, gradient_accumulation_steps, splits['train'], autocast,
            dict(model=model, optimizer=optimizer, scaler=scaler), device)
        config_sources.update(dict.fromkeys(('batch_size', 'gradient_accumulation_steps'),
                                            f"fit_batch, from batch_size={batch_size}"))
    batch_size = config['batch_size']
    gradient_accumulation_steps = config['gradient_accumulation_steps']
    accum_steps = gradient_accumulation_steps // world_size  # global_batch is kept
    train_sampler, eval_loaders = samplers(batch_size)
# python, numpy, torch on every device: dropout masks differ per rank
checkpoint.seed_rngs(seed + rank)
# what a checkpoint holds the state of (checkpoint.state), and what a resume restores
# (checkpoint.resume)
parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
             sampler=train_sampler)
if ema:
    parts['ema'] = ema  # its weights, and how many steps it has averaged (n_averaged)

# -----------------------------------------------------------------------------
# resume (everything that decides the rest of the run comes from the checkpoint), the wrappers,
# the run folder
progress = checkpoint.Progress()  # the loop's counters: a checkpoint saves and restores them whole
if resuming:
    try:  # a shard damaged in place: every rank raises it (DCP's load gathers the ranks' errors)
        progress = checkpoint.resume(ckpt, ckpt_path, parts, rank, world_size, device, eval_only)
    except checkpoint.CheckpointError as e:
        check(False, e)
start_iter = progress.iter_num
# rank 0's files (and in fsdp mode every rank's shards): written at once or, with async_save, in
# the background (last_saved: the iteration last.pt holds)
writer = checkpoint.Writer(out_dir, keep_checkpoints, async_save, progress.iter_num, master,
                           sharded)
seconds_before = progress.train_seconds
raw_model = model  # the plain GPT whose state_dict is saved: no '_orig_mod.' or 'module.' prefixes
if compile:
    model = torch.compile(model)
eval_model = model  # evaluation needs no gradient sync: the compiled model without the DDP wrapper
ema_eval_model = (torch.compile(ema.module) if compile else ema.module) if ema else None
if ddp and not sharded:  # buffers (rope's tables) are not broadcast in every forward: none changes
    model = distributed.data_parallel(model, [local_rank] if device_type == 'cuda' else None)
run_record = {'config': config, 'model_args': dataclasses.asdict(model_config),
              'dataset': dataset_id, 'pretrained': init.pretrained, 'dtype': dtype,
              'muon_dtype': muon_dtype, 'eval_windows': eval_windows,
              'tasks': init.tasks_digest}  # in every checkpoint
# the run folder: created only now that the config, data and checkpoint are known to be good; an
# out_dir that cannot be written stops every rank here
if not eval_only:
    unwritable = runlog.start(out_dir, (ckpt_path, ckpt) if resuming else None, config,
                              config_sources, init.session, raw_model.num_params(),
                              raw_model.flops_per_token())
    check(not unwritable, unwritable)
del ckpt  # restored: kept, its weights (on a GPU its optimizer state too) would be held twice
# out of memory anywhere, or another rank lost: one line instead of a traceback (exit code 1),
# naming the iteration under way: the loop's step, then its evaluation and saves; else the last
step = progress.iter_num
sys.excepthook = lambda *exc: exits.explain_failure(exc, step, batch_size, block_size, dtype,
                                                    device)

def split_loss(split, model):
    """model's mean loss over a split's evaluation windows. A shard changed under the run ends the
    run here on every rank, before anything is saved."""
    try:
        return evaluate.loss(model, eval_loaders[split], device, autocast, f"eval {split}")
    except data.DataError as e:  # every rank raises it, having met in evaluate.loss's all-reduce
        exits.data_fault(progress.iter_num, e, writer)

if eval_only:  # nanoGPT's: the weights as they start, evaluated once and printed
    exits.stop_at_once()  # nothing to save: Ctrl-C ends it at once, without a traceback
    losses = {split: split_loss(split, eval_model) for split in ('train', 'val')}
    ema_loss = ''
    if ema:  # what chose best.pt
        ema_val_loss = split_loss('val', ema_eval_model)
        ema_loss = f", EMA val {ema_val_loss:.4f}"
    accuracy, _ = evaluate.score_tasks(ema_eval_model if ema else eval_model, init.tasks,
                                       batch_size, device, autocast, rank, world_size)
    log(f"eval only, iteration {progress.iter_num}: train {losses['train']:.4f}, val "
        f"{losses['val']:.4f}{ema_loss}{evaluate.tasks_line(accuracy, 'EMA ' if ema else '')}")
    sys.exit(0)
exits.catch_stop_signals()  # Ctrl-C or SIGTERM: save last.pt after the step under way, then exit

# -----------------------------------------------------------------------------
# the training loop, in named parts: the step, logging, evaluation and saving, stopping
batches = data.TrainBatches(splits['train'], train_sampler, num_workers, seed + rank,
                            device_type == 'cuda')
micro_batches = batches
if overfit_one_batch:  # one batch, one process's first on every rank (so any count is the same
    # run), taken without moving the run's sampler: a resume takes it again
    one_process = data.TrainSampler(splits['train'].num_tokens, block_size, batch_size,
                                    global_batch, seed)
    micro_batches = itertools.repeat(data.next_batch(splits['train'], one_process))
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
speed = perf.Speedometer(progress.iter_num, max_iters, accum_steps, tokens_per_iter,
                         raw_model.flops_per_token(), init.peak_flops, world_size, device,
                         precision.DTYPES[dtype])

def train_step(micro_batches, accum=accum_steps):
    """One optimizer step's gradients, from the next accum micro_batches: zero_grad, then per
    micro-batch forward (autocast), loss / accum and backward, synced across ranks on the last
    micro-batch only; then unscale and clip. Returns this rank's loss summed over its micro-batches
    and the gradient norm, on device, and the batches' window starts. The speedometer's clock gets
    the synced end times of the session's first two micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum, starts = torch.zeros((), device=device), []
    for micro_step in range(accum):
        with record_function('data'):
            x, y, batch_starts = next(micro_batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        starts += batch_starts.tolist()
        # DDP decides in the forward whether the backward syncs: set before it (FSDP has its own
        # switch)
        if sharded:
            model.set_requires_gradient_sync(micro_step == accum - 1)
        elif isinstance(model, DDP):
            model.require_backward_grad_sync = micro_step == accum - 1
        with record_function('forward'), autocast:
            # the loss, not the logits: no B x T x vocab tensor outlives the forward
            loss = model(x, y)
        with record_function('backward'):
            scaler.scale(loss / accum).backward()
        loss_sum += loss.detach()
        if len(speed.clock) < 2:
            loss.item()  # waits for the device: the time is the micro-batch's, not its launch
            speed.clock.append(time.time())
    scaler.unscale_(optimizer)  # clip true gradients, not scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float('inf'))
    return loss_sum, grad_norm.full_tensor() if sharded else grad_norm, starts

def log_step(figures, profiler):
    """The profiled iteration's phases, the memory each rank holds (once), then the train line and
    record (runlog.train)."""
    if profiler:
        trace = os.path.join(out_dir, 'trace.json') if master else None
        ms = perf.stop_profiler(profiler, device_type, trace)
        record({'kind': 'profile', 'step': progress.iter_num, 'ms': ms})
        log(f"profiled iteration {progress.iter_num}: "
            f"{', '.join(f'{phase} {t:.1f} ms' for phase, t in ms.items())}; its trace: {trace}")
    if progress.iter_num == start_iter + 1:  # a gather: every rank gets here
        record({'kind': 'memory', 'step': progress.iter_num,
                'ranks': gather(perf.memory_held(raw_model, optimizer, device))})
    runlog.train(progress.iter_num, figures, speed, log_interval)

def evaluate_and_choose_saves():
    """Train and val loss (and the EMA's val loss), each task's accuracy, the best so far (by
    best_by: the EMA's val loss when there is one), and which files to write: best.pt at a new best,
    last.pt at every evaluation (without always_save_checkpoint only with a new best.pt, so that
    init_from=auto resumes from there). Returns those names and the seconds it took."""
    start = time.time()
    train_loss, val_loss = split_loss('train', eval_model), split_loss('val', eval_model)
    ema_val_loss = split_loss('val', ema_eval_model) if ema else None
    # the weights best.pt is chosen by: the EMA's when there is one
    accuracy, acc_norm = evaluate.score_tasks(ema_eval_model if ema else eval_model, init.tasks,
                                              batch_size, device, autocast, rank, world_size)
    if ema and sharded:  # FSDP leaves the root's weights gathered after a forward: the EMA's
        ema.module.reshard()  # next update must reach the shards
    improved = progress.new_best(val_loss if ema_val_loss is None else ema_val_loss, acc_norm,
                                 best_by)
    seconds = time.time() - start
    runlog.evaluation(progress, {'train_loss': train_loss, 'val_loss': val_loss,
                                 'ema_val_loss': ema_val_loss, **evaluate.task_fields(accuracy),
                                 'seconds': seconds},
                      evaluate.tasks_line(accuracy, 'EMA ' if ema else ''), best_by, improved)
    if improved:
        return ['best.pt', 'last.pt'], seconds
    return ['last.pt'] if always_save_checkpoint else [], seconds

def save(names, rng):
    """Write names (best.pt before last.pt: a kill in between never leaves last.pt ahead of best.pt)
    once the last background write has ended; a save that failed on any rank (a full disk) ends
    every rank here, with every file on disk whole. Logs and returns the seconds it took."""
    assert rng is not None, "an iteration that saves gathers the RNG states: add it to rng's line"
    start = time.time()
    # the last background write, on every rank (and rank 0's removals) before new shards
    exits.unsaved(writer.wait(), progress.iter_num, writer, device)
    progress.train_seconds = seconds_before + time.time() - t_start
    failed = checkpoint.save(names, out_dir, parts, rng, progress,
                             run_record | {'log_bytes': runlog.log_bytes()}, sharded, writer)
    exits.unsaved(failed, progress.iter_num, writer, device)
    seconds = time.time() - start
    log(f"saved {' and '.join(names)} in {seconds:.2f} s"
        f"{' (a copy, written in the background)' if async_save else ''}")
    return seconds

smoke_stopped = False  # a stop signal during the smoke test: the run stops before its first step
if smoke_steps and progress.iter_num == 0:  # steps on one batch must lower its loss; all undone
    smoke_stopped = smoke.smoke_test(smoke_steps, train_step, splits['train'], parts, device)
    speed.clock.clear()  # its micro-batches and time are not the run's
    speed.restart(progress.iter_num)
perf.reset_peak_memory(device)  # the loop's peak, not the smoke test's or the FLOP/s measurement's
t_start, eval_seconds, save_seconds, first_loss = time.time(), 0.0, 0.0, None
if smoke_stopped:  # as the loop stops: last.pt (here the state before the first step), then exit
    save(['last.pt'], gather(checkpoint.rng_state(device)))
    exits.exit_on_signal(progress.iter_num, False, world_size, writer, device)
while progress.iter_num < max_iters and not progress.out_of_patience(patience):
    # the step
    step = progress.iter_num + 1  # the iteration under way
    lr = optimizer.param_groups[0]['lr']  # AdamW's, learning_rate's schedule
    profiler = perf.start_profiler(device_type) if step == profile_iter else None
    loss_sum, grad_norm, starts = train_step(micro_batches)
    loss, grad_norm, stops = exits.agree(step, loss_sum, gradient_accumulation_steps, grad_norm,
                                         batches.fault, writer, device)
    skipped = scaler.is_enabled() and not math.isfinite(grad_norm)  # float16: the scaler skips it
    if not math.isfinite(loss) or not (math.isfinite(grad_norm) or skipped):
        abort(step, exits.non_finite(step, loss, grad_norm, lr, loss_sum, starts))
    first_loss = loss if first_loss is None else first_loss  # for overfit_one_batch's last line
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    with record_function('optimizer'):
        scaler.step(optimizer)
    scaler.update()  # lowers the scale after an overflow
    if not skipped:
        scheduler.step()  # the schedule counts optimizer steps that really happened
        if ema:
            ema.update_parameters(raw_model)
    progress.iter_num += 1
    progress.skipped_steps += 1 if skipped else 0
    progress.consecutive_skips = progress.consecutive_skips + 1 if skipped else 0
    if progress.consecutive_skips >= max_consecutive_skips:  # the scaler can't back off more: stop
        abort(progress.iter_num, exits.overflowed(progress.consecutive_skips, progress.iter_num,
                                                  scaler.get_scale()))

    evaluating = progress.iter_num % eval_interval == 0 or progress.iter_num == max_iters
    interval = checkpoint_interval and progress.iter_num % checkpoint_interval == 0
    opt_step = scheduler.last_epoch  # optimizer steps taken; stable_end: wsd's decay begins
    stable_end = lr_schedule == 'wsd' and lr_factor(opt_step) < 1 and lr_factor(opt_step - 1) == 1
    # right after the step, where a resume restores them; a collective, so only where a save may
    # follow
    rng = (gather(checkpoint.rng_state(device)) if evaluating or interval or stops or stable_end
           else None)

    # logging
    log_step({'loss': loss, 'lr': lr, 'grad_norm': grad_norm, 'skipped': skipped,
              'skipped_total': progress.skipped_steps, 'scale': scale,
              'epoch': train_sampler.epoch}, profiler)

    # evaluation and saving
    saves, eval_took = evaluate_and_choose_saves() if evaluating else ([], 0.0)
    eval_seconds += eval_took
    stopping_early = evaluating and progress.out_of_patience(patience)
    run_ends = progress.iter_num == max_iters or stops or stopping_early
    if (run_ends or interval) and 'last.pt' not in saves:
        saves.append('last.pt')
    if stable_end:
        saves.append('stable.pt')  # the stable phase's end: resume_from it to cool down anew, later
    if keep_checkpoints and (evaluating or interval):
        saves.append(f"ckpt-{progress.iter_num:06d}.pt")
    if saves:
        save_seconds += save(saves, rng)
    if evaluating or saves:
        speed.restart(progress.iter_num)  # evaluation and save time is not training throughput

    # stopping
    if stops:  # every rank saw the same count: all saved above and stop here
        exits.exit_on_signal(progress.iter_num, progress.iter_num == max_iters or stopping_early,
                             world_size, writer, device)
    if stopping_early:
        break

# -----------------------------------------------------------------------------
# the end: the best weights on the test split, a sample, the report
if progress.out_of_patience(patience):  # stopped now, or before the end init_from=auto redoes
    what = 'val loss' if best_by == 'val_loss' else best_by
    log(f"early stop: no better {what} in {patience} evaluations since iteration "
        f"{progress.best_iter}")
exits.unsaved(writer.wait(), progress.iter_num, writer, device)
# a stop heard in this session's last evaluation or save (at max_iters or an early stop) leaves
# the end (test split, sample) to init_from=auto, which does only that
trained = progress.iter_num > start_iter
exits.stop_at_once()  # a long sample or test split must not hold off a cluster's SIGTERM
if trained and distributed.any_rank(exits.stop_signal is not None, device):
    exits.exit_on_signal(progress.iter_num, True, world_size, writer, device)
session_seconds = time.time() - t_start
if overfit_one_batch and first_loss is not None:  # None: a finished run resumed, no step taken
    log(f"overfit one batch: loss {first_loss:.4f} -> {loss:.4f}"
        f"{f' (iterations {start_iter + 1}-{progress.iter_num})' if start_iter else ''}")
best = os.path.join(out_dir, 'best.pt')
# last.pt holds the trained weights: now load the best, where a file holds them (a resume from
# another checkpoint may have found none: checkpoint.branch)
tested_iter = progress.iter_num  # the weights the test split and the sample take
held = (checkpoint.saved_state(best) or {}).get('iter_num')
if progress.best_iter > 0 and held == progress.best_iter and (test_eval or sample_tokens):
    checkpoint.load_weights(checkpoint.load(best), best, raw_model, ema=ema)
    tested_iter = progress.best_iter
best_model = ema.module if ema else raw_model  # the weights best.pt was chosen by
test_loss = split_loss('test', ema_eval_model if ema else eval_model) if test_eval else None
weights = runlog.done(progress, best_by, {
    'ema': bool(ema), 'test_loss': test_loss, 'tested_iter': tested_iter,
    'test_windows': eval_loaders['test'].batch_sampler.coverage if test_eval else None,
    'wall_seconds': session_seconds, 'eval_seconds': eval_seconds, 'save_seconds': save_seconds,
    'total_seconds': seconds_before + session_seconds}, start_iter)
if sample_tokens and (master or sharded):  # a sharded model's forward needs every rank
    sample.run_end_sample(best_model, weights, dataset_id, sample_tokens, seed, device, autocast,
                          sharded)
runlog.finish()
# the interpreter's exit would run a full collection over every object left, torch's modules' among
# them (0.6-0.8 s on a CPU): nothing there needs it (runlog closes the logs at exit)
gc.freeze()
