"""
Train a GPT. One process:

    python train.py config/tiny.py --batch_size=8

Data parallel on several processes or machines (gloo on CPU, nccl on GPUs):

    torchrun --standalone --nproc_per_node=2 train.py config/tiny.py --gradient_accumulation_steps=2

The defaults below keep nanoGPT's names and meanings; config files and --key=value override them
(configurator.py). Everything a run writes goes to out_dir: config.json, meta.json, train.log,
metrics.jsonl, best.pt (lowest val loss) and last.pt (the latest state, for resuming).
"""
import atexit
import collections
import copy
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import data
import hf
import perf
import prepare
import report
import sample
import tokenizer
from configurator import ConfigError, configure
from model import ACTIVATIONS, GPT, GPTConfig

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out'
eval_interval = 2000
log_interval = 1
eval_iters = 200  # eval batches per split and evaluation (evenly spread windows); 0 = the whole split
always_save_checkpoint = True  # write last.pt at every evaluation; False: only at a new best val loss and at the end
checkpoint_interval = 0  # also write last.pt every this many iterations, without evaluating; 0: only at evaluations
# 'scratch', 'resume' (out_dir/last.pt or resume_from), 'auto' (resume if last.pt exists, else scratch), or GPT-2's
# weights to finetune: 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', or a Hugging Face model folder or .safetensors file
init_from = 'scratch'
resume_from = ''  # a checkpoint to resume from instead of out_dir/last.pt, e.g. out/best.pt
# at the end of the run, with the best weights
test_eval = True  # evaluate them on the test split
sample_tokens = 200  # print a sample of this many tokens; 0: none
write_report = True  # out_dir/report.md and curves.png (also when a run aborts or is stopped by a signal)
# logging services (off by default; imported only when on)
wandb_log = False
wandb_project = 'honestgpt'
wandb_run_name = 'run'
tensorboard_log = False  # event files in out_dir/tensorboard
cost_per_hour = 0.0  # price of one process-hour, for the report's cost estimate; 0 leaves cost out
# data
dataset = 'pystdlib_char'  # a folder of shards under data_dir (prepare.py's, or llm.c's with a meta.json), or a glob
data_dir = 'data'
gradient_accumulation_steps = 40  # global: divided by the number of processes
batch_size = 12  # micro-batch per process
block_size = 1024
num_workers = 1  # loader worker processes per rank; 0 loads in the training process
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
activation = 'gelu'  # the MLP's: 'gelu', 'gelu_tanh' (GPT-2's) or 'relu2' (ReLU squared). GPT-2 weights set it and the shape keys above
pos_emb = 'learned'  # positions: 'learned' (an embedding, GPT-2's) or 'rope' (rotary: relative, no parameters)
qk_norm = False  # RMS-normalize each head's queries and keys before attention
tie_head = True  # the output head shares the token embedding's matrix (GPT-2's); False: the head has its own
logit_softcap = 0.0  # > 0: logits become logit_softcap * tanh(logits / logit_softcap); 0: off
zero_init = False  # attention and MLP output projections (and an untied head) start at zero instead of small noise
# optimizer: 'adamw' for every parameter, or 'muon': Muon for the blocks' matrices and AdamW for the rest
optimizer = 'adamw'
learning_rate = 6e-4  # AdamW's
muon_lr = 0.02  # Muon's base learning rate; the schedule scales it by the same factor as learning_rate
muon_momentum = 0.95
max_iters = 600000  # iterations (optimizer steps attempted, each of gradient_accumulation_steps micro-batches)
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0 disables clipping (the norm is still measured and logged)
# learning rate schedule: linear warmup, decay to min_lr at lr_decay_iters, then flat
decay_lr = True
lr_schedule = 'cosine'  # 'cosine' (nanoGPT's) or 'wsd': warmup, stable (constant), then a linear decay
wsd_decay_frac = 0.2  # wsd: the decay takes this share of the iterations between warmup_iters and lr_decay_iters
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5  # AdamW's floor; Muon's is muon_lr * min_lr / learning_rate
# early stopping and smoke test
patience = 0  # stop after this many evaluations without a new best val loss; 0 never stops early
overfit_one_batch = False  # train on one fixed batch: loss must approach zero if model, loss and optimizer are wired
smoke_test = False  # before the run, overfit one batch for 30 steps and refuse to start if the loss does not fall
# system
device = 'auto'  # 'auto', 'cpu', 'cuda', 'cuda:1', ...
dtype = 'auto'  # 'auto', 'float32', 'bfloat16' or 'float16' (float16 uses a GradScaler)
compile = False  # torch.compile the model
backend = 'auto'  # distributed backend: 'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'
parallel = 'ddp'  # with several processes: 'ddp' (replicate the model) or 'fsdp' (shard weights, grads and optimizer state)
activation_checkpointing = False  # recompute activations in backward, block by block: less memory, more compute
init_scale = 65536.0  # float16 GradScaler's first loss scale
max_consecutive_skips = 20  # abort when float16 overflow skips this many optimizer steps in a row
seed = 1337
deterministic = False  # torch.use_deterministic_algorithms: bitwise repeatable runs where kernels allow
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
defaults = {k: globals()[k] for k in config_keys}


def check(ok, message):
    """A user mistake: one line naming the problem and the fix, exit code 2, nothing written."""
    if not ok:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


try:
    config, config_sources = configure(defaults, sys.argv[1:])
except ConfigError as e:
    check(False, e)
globals().update(config)
check(init_from in ('scratch', 'resume', 'auto') or hf.is_source(init_from),
      f"init_from='{init_from}': use 'scratch', 'resume', 'auto', a GPT-2 name ({', '.join(hf.GPT2_NAMES)}) "
      f"or the path of a Hugging Face model folder or .safetensors file")
check(activation in ACTIVATIONS, f"activation='{activation}': use one of {', '.join(ACTIVATIONS)}")
check(dtype in ('auto', 'float32', 'bfloat16', 'float16'), f"dtype='{dtype}': use 'auto', 'float32', 'bfloat16' or 'float16'")
check(backend in ('auto', 'nccl', 'gloo'), f"backend='{backend}': use 'auto', 'nccl' or 'gloo'")
check(parallel in ('ddp', 'fsdp'), f"parallel='{parallel}': use 'ddp' or 'fsdp'")
check(checkpoint_interval >= 0, f"checkpoint_interval={checkpoint_interval} must be 0 (only at evaluations) or positive")
for key in ('eval_interval', 'log_interval', 'gradient_accumulation_steps', 'batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'max_iters'):
    check(config[key] > 0, f"{key}={config[key]} must be positive")
check(n_embd % n_head == 0, f"n_embd={n_embd} is not a multiple of n_head={n_head}: change one of them")
check(0 <= dropout < 1, f"dropout={dropout} must be in [0, 1)")
check(not decay_lr or lr_decay_iters > warmup_iters, f"lr_decay_iters={lr_decay_iters} must exceed warmup_iters={warmup_iters}")
check(pos_emb in ('learned', 'rope'), f"pos_emb='{pos_emb}': use 'learned' or 'rope'")
check(pos_emb == 'learned' or (n_embd // n_head) % 2 == 0, f"pos_emb='rope' turns pairs of dimensions: make the head size n_embd/n_head={n_embd // n_head} even")
check(logit_softcap >= 0, f"logit_softcap={logit_softcap} must be 0 (off) or positive")
check(optimizer in ('adamw', 'muon'), f"optimizer='{optimizer}': use 'adamw' or 'muon'")
check(lr_schedule in ('cosine', 'wsd'), f"lr_schedule='{lr_schedule}': use 'cosine' or 'wsd'")
check(0 < wsd_decay_frac <= 1, f"wsd_decay_frac={wsd_decay_frac} must be in (0, 1]")
for key, package in (('tensorboard_log', 'tensorboard'), ('wandb_log', 'wandb')):
    check(not config[key] or importlib.util.find_spec(package), f"{key}=True needs the {package} package: pip install {package}, or set {key}=False")
if deterministic:
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # must be set before cuBLAS starts

# -----------------------------------------------------------------------------
# processes and devices: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
ddp = 'RANK' in os.environ  # several processes, replicated (DDP) or sharded (FSDP)
sharded = ddp and parallel == 'fsdp'
if sharded:  # a second of imports that only sharded runs need
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
master = rank == 0
try:
    device, device_type = perf.resolve_device(device, local_rank)
except ValueError as e:
    check(False, e)
if device_type == 'cuda':
    torch.cuda.set_device(device)
check(gradient_accumulation_steps % world_size == 0,
      f"gradient_accumulation_steps={gradient_accumulation_steps} is not divisible by the {world_size} processes: "
      f"make it a multiple of {world_size} so the global batch stays the same")
accum_steps = gradient_accumulation_steps // world_size  # micro-batches per optimizer step on this rank


def shut_down_process_group():
    """Runs at exit, on every path. The pause comes first: gloo's worker threads free a finished collective's
    tensors after the caller has moved on, which takes the GIL, and a thread that takes the GIL while Python shuts
    down aborts the process ("terminate called without an active exception", pytorch/pytorch#190489). A last barrier is no cure: gloo's barrier keeps the collectives before it alive
    until its own thread frees it."""
    time.sleep(0.1)
    dist.destroy_process_group()


if ddp:
    # torchrun keeps its store across --max-restarts; without a per-attempt prefix, a restarted group can
    # read the dead attempt's addresses and fail to connect
    store, _, _ = next(dist.rendezvous('env://'))
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend=(('nccl' if device_type == 'cuda' else 'gloo') if backend == 'auto' else backend),
                            store=store, rank=rank, world_size=world_size)
    atexit.register(shut_down_process_group)  # on every exit path

if device_type == 'cuda':
    torch.set_float32_matmul_precision('high')  # TF32 tensor cores for what autocast leaves in float32
if deterministic:
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def log(message, stream=sys.stdout):
    """Rank 0 prints; once the run directory exists, train.log gets the same line."""
    if master:
        print(message, file=stream, flush=True)
        if log_file:
            log_file.write(message + '\n')
            log_file.flush()


log_file = None

# -----------------------------------------------------------------------------
# data
dataset_dir = os.path.join(data_dir, dataset)
# a shard, not meta.json: a folder of the older layout (train.bin) has a meta.json and is prepared again too
if dataset == 'pystdlib_char' and not os.path.exists(os.path.join(dataset_dir, f'{dataset}_train_000000.bin')):
    if master:
        log(f"preparing the default dataset {dataset} from this Python's standard library into {dataset_dir}")
        try:
            prepare.prepare(dataset, data_dir=data_dir)
        except prepare.PrepareError as e:
            check(False, e)
    if ddp:
        dist.barrier()
pin_memory = device_type == 'cuda'
try:
    data_meta, shard_paths = data.open_dataset(data_dir, dataset)
    splits = {s: data.TokenWindows(paths, block_size) for s, paths in shard_paths.items()}
    train_sampler = data.TrainSampler(splits['train'].num_tokens, block_size, batch_size, batch_size * gradient_accumulation_steps,
                                      seed, rank, world_size)
    # sharded weights are gathered in each forward: every rank must run as many eval batches as the others
    eval_loaders = {s: data.make_loader(splits[s], data.EvalSampler(splits[s].num_tokens, block_size, batch_size,
                                                                    eval_iters * batch_size, rank, world_size, sharded),
                                        0, seed, pin_memory) for s in splits}
except data.DataError as e:
    check(False, e)
if 'test' not in splits and test_eval:
    log(f"dataset '{dataset}' has no test split: the test evaluation is skipped")
    test_eval = False  # config.json keeps what was asked

# -----------------------------------------------------------------------------
# where the weights come from: a checkpoint, GPT-2's weights, or a random init
ckpt_path = resume_from or os.path.join(out_dir, 'last.pt')
resuming = init_from == 'resume' or (init_from == 'auto' and os.path.exists(ckpt_path))
pretrained_state = None
if resuming:
    try:
        ckpt = checkpoint.load(ckpt_path)
    except checkpoint.CheckpointError as e:
        check(False, e)
else:  # a new run must not overwrite a checkpoint; a run stopped before its first one may start again
    check(init_from == 'auto' or not any(os.path.exists(os.path.join(out_dir, f)) for f in ('last.pt', 'best.pt')),
          f"out_dir '{out_dir}' already holds a checkpoint: resume it with init_from=resume (or auto), or pick a new out_dir")
pretrained = ckpt.get('pretrained') if resuming else None  # {'init_from', 'weights', 'sha256'} of a GPT-2 start
if init_from not in ('scratch', 'resume', 'auto'):
    try:
        pretrained_args, pretrained_state, pretrained = hf.load_gpt2(init_from, block_size, data_meta['vocab_size'])
    except hf.HFError as e:
        check(False, e)
check(not pretrained or (pos_emb, qk_norm, tie_head, logit_softcap) == ('learned', False, True, 0.0),
      "GPT-2's weights have learned positions, a tied head, no QK-norm and no soft-cap: leave pos_emb, qk_norm, tie_head "
      "and logit_softcap at their defaults to finetune them")
if pretrained:  # the shape comes from the weights, on resume too; config.json and checkpoints record it resolved
    weights_args = ckpt['model_args'] if resuming else pretrained_args
    shape = {k: weights_args[k] for k in ('n_layer', 'n_head', 'n_embd', 'bias', 'activation')}
    config |= shape
    config_sources |= dict.fromkeys(shape, f"weights of {pretrained['init_from']}")
    globals().update(shape)

# -----------------------------------------------------------------------------
# model, precision, optimizer, schedule
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias, activation=activation,
                  vocab_size=data_meta['vocab_size'], dropout=dropout, pos_emb=pos_emb, qk_norm=qk_norm, tie_head=tie_head,
                  logit_softcap=logit_softcap, zero_init=zero_init)
dtype_how = {'rule': 'set in the config'}
if dtype == 'auto' and resuming and 'dtype' in ckpt:  # a resume continues in the dtype the run chose, whatever is measured now
    dtype, dtype_how = ckpt['dtype'], {'rule': f"dtype='auto' as resolved by the run resumed from {ckpt_path}"}
if dtype == 'auto':  # rank 0 decides (by measuring, on some CPUs) and every rank trains in its choice
    log("choosing the dtype for dtype='auto'")
    choice = [perf.auto_dtype(device, model_args, batch_size) if master else None]
    if ddp:
        dist.broadcast_object_list(choice)
    dtype, dtype_how = choice[0]
    check(dtype in ('float32', 'bfloat16', 'float16'), f"HONESTGPT_AUTO_DTYPE={dtype}: use float32, bfloat16 or float16")
check(not (sharded and dtype == 'float16'), "parallel='fsdp' trains in float32 or bfloat16: set dtype=bfloat16")
# torch 2.13's Muon steps FSDP2's sharded matrices without an error, but not to the update it gives the whole matrix
check(not (sharded and optimizer == 'muon'), "optimizer='muon' does not work with parallel='fsdp' (Muon orthogonalizes whole "
                                             "matrices, FSDP shards them): use parallel='ddp' or optimizer='adamw'")
if dtype == 'float16' and device_type == 'cpu':
    slowdown, ms16, ms32 = perf.float16_slowdown(device, n_embd, batch_size * block_size)
    if slowdown > 1.5:
        log(f"warning: dtype=float16 on this CPU is emulated: an MLP matmul of this model took {ms16:.1f} ms in float16 "
            f"against {ms32:.1f} ms in float32 ({slowdown:.0f}x slower): use dtype=bfloat16 or float32", sys.stderr)
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

log(f"building the model: {n_layer} layers, {n_head} heads, {n_embd} wide, block {block_size}, vocab {model_args['vocab_size']}")
torch.manual_seed(seed)  # the same initial weights on every rank
model = GPT(GPTConfig(**model_args))
if pretrained_state is not None:
    model.load_state_dict(pretrained_state)
model = model.to(device)
model.activation_checkpointing = activation_checkpointing
if sharded:
    model.fully_shard(ptdtype)
optimizers = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), optimizer, muon_lr, muon_momentum)
min_lr_factor = min_lr / learning_rate if learning_rate > 0 else 0.0
decay_start = lr_decay_iters - wsd_decay_frac * (lr_decay_iters - warmup_iters) if lr_schedule == 'wsd' else warmup_iters


def lr_factor(opt_step):
    """The schedule as a multiple of each group's base rate, a function of real optimizer steps only: linear warmup,
    then cosine (nanoGPT's) or constant-then-linear (wsd) decay to min_lr at lr_decay_iters, then flat."""
    if not decay_lr:
        return 1.0
    if opt_step < warmup_iters:
        return (opt_step + 1) / (warmup_iters + 1)
    if opt_step > lr_decay_iters:
        return min_lr_factor
    if lr_schedule == 'wsd':
        return 1.0 - (1.0 - min_lr_factor) * max(0.0, opt_step - decay_start) / (lr_decay_iters - decay_start)
    coeff = 0.5 * (1.0 + math.cos(math.pi * (opt_step - warmup_iters) / (lr_decay_iters - warmup_iters)))
    return min_lr_factor + coeff * (1.0 - min_lr_factor)


schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_factor) for opt in optimizers]
configured_lrs = [s.base_lrs for s in schedulers]  # each group's base rate in this config: AdamW's, Muon's
scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=dtype == 'float16')

# -----------------------------------------------------------------------------
# resume: everything that decides the rest of the run comes from the checkpoint
# except what may change on resume: how long, how often to evaluate/log/save, where to write, speed knobs, the
# end-of-run extras, and the LR schedule and clipping from here on (how a user recovers from a blow-up; past steps
# keep their LR)
RESUMABLE = {'out_dir', 'data_dir', 'init_from', 'resume_from', 'max_iters', 'eval_interval', 'log_interval', 'eval_iters',
             'always_save_checkpoint', 'checkpoint_interval', 'patience', 'num_workers', 'compile', 'device', 'backend',
             'max_consecutive_skips', 'activation_checkpointing', 'smoke_test', 'tensorboard_log', 'cost_per_hour',
             'test_eval', 'sample_tokens', 'write_report',
             'learning_rate', 'muon_lr', 'decay_lr', 'lr_schedule', 'wsd_decay_frac', 'warmup_iters', 'lr_decay_iters', 'min_lr', 'grad_clip',
             'wandb_log', 'wandb_project', 'wandb_run_name'}
# what the checkpoint must have been trained on: a resume after shards were added or changed is refused
dataset_id = {'name': data_meta['name'], 'source_sha256': data_meta.get('source_sha256'), 'vocab_size': data_meta['vocab_size'],
              'tokenizer': data_meta['tokenizer'], 'shards': [shard for s in splits.values() for shard in s.shards]}
iter_num, best_val_loss, best_iter, evals_since_best, skipped_steps, consecutive_skips = 0, float('inf'), 0, 0, 0, 0
seconds_before = 0.0  # training wall time of the sessions before this one (None: unknown, an older checkpoint)


def restore(module, ckpt, ckpt_path, with_optimizer):
    """Load weights (and optimizer states) from a checkpoint: in the file itself, or in fsdp mode in the folder of
    shards it points to, which every rank reads its own part of."""
    if 'shards' not in ckpt:
        module.load_state_dict(ckpt['model'])
        if with_optimizer:
            for opt, state in zip(optimizers, ckpt['optimizer'], strict=True):
                opt.load_state_dict(state)
        return
    state = {'model': get_model_state_dict(module)}
    if with_optimizer:
        state['optimizer'] = get_optimizer_state_dict(module, optimizers)
    dcp.load(state, checkpoint_id=os.path.join(os.path.dirname(ckpt_path), ckpt['shards']))
    set_model_state_dict(module, state['model'])
    if with_optimizer:
        set_optimizer_state_dict(module, optimizers, state['optimizer'])


if resuming:
    # a key this checkpoint's code did not have yet counts as its default, which keeps the behaviour of that code
    changed = [f"{k}={ckpt['config'].get(k, defaults[k])!r} there, {config[k]!r} here" for k in config
               if k not in RESUMABLE and ckpt['config'].get(k, defaults[k]) != config[k]]
    check(not changed, f"{ckpt_path} was trained with other settings ({'; '.join(changed)}): "
                       f"use the checkpoint's values or start a new out_dir")
    data_change = data.data_change(ckpt['dataset'], dataset_id)
    check(not data_change, f"{ckpt_path} was trained on other data ({data_change}): prepare the data it recorded or start a new out_dir")
    restore(model, ckpt, ckpt_path, with_optimizer=True)
    for scheduler, state, base_lrs in zip(schedulers, ckpt['scheduler'], configured_lrs, strict=True):
        scheduler.load_state_dict(state)
        scheduler.base_lrs = base_lrs  # the schedule of this config, each group from its own base rate, not the saved one
        for group, base_lr in zip(scheduler.optimizer.param_groups, base_lrs):
            group['lr'] = base_lr * lr_factor(scheduler.last_epoch)
    scaler.load_state_dict(ckpt['scaler'])
    train_sampler.load_state_dict(ckpt['sampler'])
    iter_num, best_val_loss, best_iter, evals_since_best = ckpt['iter_num'], ckpt['best_val_loss'], ckpt['best_iter'], ckpt['evals_since_best']
    skipped_steps, consecutive_skips = ckpt['skipped_steps'], ckpt['consecutive_skips']
    seconds_before = ckpt.get('train_seconds')
    check(iter_num < max_iters or init_from == 'auto',
          f"{ckpt_path} is at iteration {iter_num}: max_iters={max_iters} leaves nothing to do: raise max_iters "
          f"(past lr_decay_iters={lr_decay_iters} the learning rate stays at min_lr: raise lr_decay_iters too to decay over the longer run)")
start_iter = iter_num


def reduce_sum(t):
    if ddp:
        dist.all_reduce(t)  # every rank calls this the same number of times: all take the same branches
    return t


def run_smoke_test(steps=30):
    """Overfit this rank's first train batch for a few steps, then put weights and RNG back as they were:
    a model, loss or optimizer that is not wired up fails here in seconds instead of after hours."""
    initial_weights, initial_rng = copy.deepcopy(model.state_dict()), checkpoint.rng_state()
    x, y, _ = torch.utils.data.default_collate([splits['train'][s] for s in train_sampler.epoch_starts(0)[:batch_size].tolist()])
    x, y = x.to(device), y.to(device)
    smoke_optimizers = model.configure_optimizers(0.0, learning_rate, (beta1, beta2), optimizer, muon_lr, muon_momentum)
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with autocast:
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        for opt in smoke_optimizers:
            opt.step()
        losses.append(loss.detach())
    model.load_state_dict(initial_weights)
    checkpoint.set_rng_state(initial_rng)
    first, final = (reduce_sum(torch.stack([losses[0], losses[-1]]).float()) / world_size).tolist()
    return {'kind': 'smoke_test', 'step': iter_num, 'steps': steps, 'first_loss': first, 'final_loss': final,
            'passed': final < 0.7 * first}


smoke_result = run_smoke_test() if smoke_test and not resuming else None
if smoke_result and not smoke_result['passed']:
    check(False, f"smoke test failed: one batch overfit for {smoke_result['steps']} steps only went from loss "
                 f"{smoke_result['first_loss']:.4f} to {smoke_result['final_loss']:.4f}: check learning_rate, or the "
                 f"model and loss if you changed them; nothing was written")

raw_model = model  # the plain GPT whose state_dict is saved: no '_orig_mod.' or 'module.' prefixes
if compile:
    model = torch.compile(model)
eval_model = model  # evaluation needs no gradient sync: the compiled model without the DDP wrapper
if ddp and not sharded:
    # no buffer broadcast in every forward (DDP's default): the only buffers are rope's tables, computed from the
    # config alike on every rank, and a broadcast would be a collective on the micro-batches that must not sync
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None, broadcast_buffers=False)
# every RNG in play: dropout masks differ per rank; a resume continues each rank's own streams
random.seed(seed + rank)
np.random.seed(seed + rank)
torch.manual_seed(seed + rank)  # every device, CUDA included
if resuming and len(ckpt['rng']) == world_size:
    checkpoint.set_rng_state(ckpt['rng'][rank])

# -----------------------------------------------------------------------------
# the run directory: created only now that the config, data and checkpoint are known to be good
if master:
    log("measuring this machine's peak FLOP/s for MFU (once per machine and dtype: cached)")
peak_flops, peak_how = perf.peak_flops(device, ptdtype) if master else (float('nan'), '')
if ddp:
    dist.barrier()  # every rank has made its start checks before rank 0 writes anything they look at
metrics_file = tb_writer = run_meta = None


def git_state():
    repo = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(['git', 'status', '--porcelain'], cwd=repo, capture_output=True, text=True).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return 'unknown', None


def json_bytes(obj):
    return (json.dumps(obj, indent=2) + '\n').encode()


if master:
    os.makedirs(out_dir, exist_ok=True)
    same_run = resuming and os.path.realpath(ckpt['out_dir']) == os.path.realpath(out_dir)
    for name in ('metrics.jsonl', 'train.log'):  # drop what was logged after the checkpoint: those steps are redone
        path = os.path.join(out_dir, name)
        if os.path.exists(path) and (not resuming or same_run):
            os.truncate(path, min(os.path.getsize(path), ckpt['log_bytes'][name] if resuming else 0))
    for name in ('best.pt.tmp', 'last.pt.tmp'):  # half-written by a killed run: never read, safe to drop
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    log_file = open(os.path.join(out_dir, 'train.log'), 'a')
    metrics_file = open(os.path.join(out_dir, 'metrics.jsonl'), 'a')
    if tensorboard_log:
        from torch.utils.tensorboard import SummaryWriter
        tb_writer = SummaryWriter(os.path.join(out_dir, 'tensorboard'))
    if wandb_log:
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, config=config, resume='allow')
    sha, dirty = git_state()
    run_meta = {
        'command': sys.argv, 'start_time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), 'git_sha': sha, 'git_dirty': dirty,
        'seed': seed, 'dtype': dtype, 'dtype_choice': dtype_how, 'device': device, 'world_size': world_size,
        'resumed_from': f"{ckpt_path} at iteration {iter_num}" if resuming else None, 'pretrained': pretrained,
        'peak_flops': {'per_process': peak_flops, 'how': peak_how},
        'versions': {'python': platform.python_version(), 'torch': torch.__version__, 'numpy': np.__version__,
                     'tiktoken': importlib.metadata.version('tiktoken'), 'safetensors': importlib.metadata.version('safetensors')},
        'hardware': {'platform': platform.platform(), 'cpu': perf.cpu_name(), 'cpu_count': os.cpu_count(),
                     'torch_threads': torch.get_num_threads(),
                     'cuda_devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
        'dataset': {**dataset_id, 'tokenizer': dataset_id['tokenizer']['kind'], 'dir': dataset_dir, 'split_rule': data_meta.get('split_rule', '')},
    }
    checkpoint.atomic_write(os.path.join(out_dir, 'meta.json'), lambda f: f.write(json_bytes(run_meta)))
    checkpoint.atomic_write(os.path.join(out_dir, 'config.json'), lambda f: f.write(json_bytes(
        {k: {'value': config[k], 'source': config_sources[k]} for k in config} | {'resolved': {'device': device, 'dtype': dtype}})))


def record(entry):
    if master:
        metrics_file.write(json.dumps(entry) + '\n')
        metrics_file.flush()
        numbers = {f"{entry['kind']}/{k}": v for k, v in entry.items()
                   if k not in ('step', 'time') and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if tb_writer:
            for name, value in numbers.items():
                tb_writer.add_scalar(name, value, entry['step'])
        if wandb_log:
            wandb.log(numbers, step=entry['step'])


tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
record({'kind': 'start', 'step': iter_num, 'time': time.time()})
start_point = (f"resuming from {ckpt_path} at iteration {iter_num}" if resuming else
               f"starting from {pretrained['weights'] if pretrained else 'scratch'}")
log(f"{start_point}: "
    f"{raw_model.num_params() / 1e6:.2f}M parameters, {device} {dtype}, {world_size} process(es), "
    f"{tokens_per_iter:,} tokens per iteration ({gradient_accumulation_steps} x {batch_size} x {block_size})")
log(f"MFU is measured against {peak_flops / 1e9:,.1f} GFLOP/s per process ({peak_how})")
if resuming and len(ckpt['rng']) != world_size:
    log(f"the checkpoint was written by {len(ckpt['rng'])} process(es): the data continues where it stopped, but dropout "
        f"draws new random streams, so this is not bitwise the run that would have continued")
if smoke_result:
    record(smoke_result)
    log(f"smoke test passed: one batch overfit for {smoke_result['steps']} steps, loss {smoke_result['first_loss']:.4f} "
        f"-> {smoke_result['final_loss']:.4f}")

# -----------------------------------------------------------------------------
# evaluation, checkpoints, and the ways a run ends early


def evaluate(split):
    """Mean loss over the split's evaluation windows, every target token counted once across ranks."""
    eval_model.eval()
    with torch.inference_mode():
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
        for x, y, _ in eval_loaders[split]:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                logits = eval_model(x)
            sums[0] += F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1), reduction='sum')
            sums[1] += (y != data.IGNORE_INDEX).sum()
        loss_sum, count = reduce_sum(sums).tolist()
    eval_model.train()
    return loss_sum / count


def gather_rng():
    """Each rank's RNG state, in rank order: a DDP resume restores every rank's dropout stream."""
    if not ddp:
        return [checkpoint.rng_state()]
    states = [None] * world_size
    dist.all_gather_object(states, checkpoint.rng_state())
    return states


def save_checkpoint(names, rng):
    """Write names (best.pt and/or last.pt), each atomically. In fsdp mode every rank first writes its shards
    to shards-ITER/; the .pt file that points there is written after, so a folder counts only once complete."""
    start = time.time()
    if sharded:
        shards = f'shards-{iter_num}'
        dcp.save({'model': get_model_state_dict(model), 'optimizer': get_optimizer_state_dict(model, optimizers)},
                 checkpoint_id=os.path.join(out_dir, shards))
    if master:
        state = {
            'format': checkpoint.FORMAT, 'dtype': dtype, 'scheduler': [s.state_dict() for s in schedulers], 'scaler': scaler.state_dict(),
            'sampler': train_sampler.state_dict(), 'rng': rng, 'iter_num': iter_num, 'best_val_loss': best_val_loss,
            'best_iter': best_iter, 'evals_since_best': evals_since_best, 'skipped_steps': skipped_steps,
            'consecutive_skips': consecutive_skips, 'config': config, 'model_args': model_args, 'dataset': dataset_id,
            'pretrained': pretrained, 'seed': seed, 'out_dir': out_dir,
            'log_bytes': {'metrics.jsonl': metrics_file.tell(), 'train.log': log_file.tell()},
            'train_seconds': None if seconds_before is None else seconds_before + time.time() - t_start,
        }
        state |= {'shards': shards} if sharded else {'model': raw_model.state_dict(), 'optimizer': [o.state_dict() for o in optimizers]}
        for name in names:
            checkpoint.save(state, os.path.join(out_dir, name))
        if sharded:  # shard folders that neither best.pt nor last.pt points to any more
            in_use = {checkpoint.load(os.path.join(out_dir, n))['shards'] for n in ('best.pt', 'last.pt')
                      if os.path.exists(os.path.join(out_dir, n))}
            for folder in os.listdir(out_dir):
                if folder.startswith('shards-') and folder not in in_use:
                    shutil.rmtree(os.path.join(out_dir, folder))
    return time.time() - start


def finish_report():
    if master and write_report:
        report.write_report(out_dir)
        log(f"report: {os.path.join(out_dir, 'report.md')} and curves.png")


def abort(step, message):
    """Stop the run now, exit code 1: every rank got here on the same reduced values; checkpoints stay as they were."""
    record({'kind': 'abort', 'step': step, 'message': message})
    log(f"error: {message}", sys.stderr)
    finish_report()
    sys.exit(1)


def explain_out_of_memory(exc_type, exc, tb):
    if not (issubclass(exc_type, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)):
        return sys.__excepthook__(exc_type, exc, tb)
    record({'kind': 'abort', 'step': iter_num + 1, 'message': 'out of memory'})
    # no report here: plotting needs memory this process may not get (python report.py OUT_DIR writes it later)
    log(f"error: out of memory at iteration {iter_num + 1} with batch_size={batch_size}, block_size={block_size} "
        f"({perf.peak_memory_mb(device):,.0f} MB at peak): lower batch_size and raise gradient_accumulation_steps by the "
        f"same factor (the tokens per iteration stay){', or use dtype=bfloat16' if dtype == 'float32' else ''}; "
        f"the checkpoints are intact", sys.stderr)


sys.excepthook = explain_out_of_memory  # one clear line instead of a traceback; the exit code stays 1
stop_signal = None  # SIGINT (Ctrl-C) or SIGTERM (a cluster's notice): save last.pt after the step under way, then exit


def request_stop(signum, frame):
    global stop_signal
    if signum == signal.SIGINT and stop_signal == signal.SIGINT:
        os._exit(130)  # a second Ctrl-C: at once; every checkpoint on disk is whole, each was written atomically
    if stop_signal is None:
        stop_signal = signum
        if master:  # os.write: print() may be in the middle of a line, and a signal handler must not re-enter it
            os.write(2, f"\n{signal.Signals(signum).name}: saving last.pt after the iteration under way, then stopping"
                        f"{' (Ctrl-C again to stop at once)' if signum == signal.SIGINT else ''}\n".encode())


signal.signal(signal.SIGINT, request_stop)
signal.signal(signal.SIGTERM, request_stop)

# -----------------------------------------------------------------------------
# training loop
def record_memory():
    """What each rank holds after the session's first optimizer step, MB: weights, gradients and optimizer state
    (an fsdp rank its shards, a ddp rank full replicas), and its peak memory so far. Every rank must call it."""
    def mb(tensors):  # a DTensor's own part is its to_local()
        return sum((t.to_local() if sharded and isinstance(t, torch.distributed.tensor.DTensor) else t).nbytes
                   for t in tensors) / 2**20
    held = {'weights_mb': mb(raw_model.parameters()), 'grads_mb': mb(p.grad for p in raw_model.parameters() if p.grad is not None),
            'optimizer_mb': mb(v for opt in optimizers for state in opt.state.values() for v in state.values() if torch.is_tensor(v)),
            'peak_mb': perf.peak_memory_mb(device)}
    ranks = [held] * world_size
    if ddp:
        dist.all_gather_object(ranks, held)
    record({'kind': 'memory', 'step': iter_num, 'ranks': ranks})


train_batches = data.endless_batches(splits['train'], train_sampler, num_workers, seed + rank, pin_memory)


fixed_batch = next(train_batches) if overfit_one_batch else None
t_start = t_last = time.time()
iters_since_log, first_loss, save_seconds_total = 0, None, 0.0
iter_seconds = collections.deque(maxlen=20)  # seconds per iteration over recent log intervals, for the ETA
while iter_num < max_iters:
    lr = optimizers[0].param_groups[0]['lr']  # AdamW's, learning_rate's schedule
    model.zero_grad(set_to_none=True)  # every optimizer's parameters
    loss_sum = torch.zeros((), device=device)
    batch_starts = []
    for micro_step in range(accum_steps):
        x, y, starts = fixed_batch if overfit_one_batch else next(train_batches)
        if not overfit_one_batch:
            train_sampler.mark_consumed()
        batch_starts += starts.tolist()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # reduce gradients on the last micro-batch only; set before the forward, where DDP reads it
        if sharded:
            model.set_requires_gradient_sync(micro_step == accum_steps - 1)
        elif ddp:
            model.require_backward_grad_sync = micro_step == accum_steps - 1
        with autocast:
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss_sum += loss.detach()
        scaler.scale(loss / accum_steps).backward()
        if iter_num == start_iter and micro_step == 0:  # a big model on a CPU: say how long it will take, once
            loss.item()  # waits for the device: the time is the micro-batch's, not its launch
            first_seconds = time.time() - t_start
            log(f"the first micro-batch took {first_seconds:.2f} s: about {first_seconds * accum_steps:.2f} s per iteration, "
                f"{first_seconds * accum_steps * (max_iters - iter_num) / 3600:.2f} h for the {max_iters - iter_num} left")
    for opt in optimizers:
        scaler.unscale_(opt)  # clip true gradients, not scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float('inf'))
    if sharded:  # the norm over all shards
        grad_norm = grad_norm.full_tensor()
    # one all-reduce for the loss and for a stop signal on any rank, one host sync for the checks below
    loss_sum, stops = reduce_sum(torch.stack([loss_sum, torch.full((), float(stop_signal is not None), device=device)]))
    loss_mean, grad_norm_value, stops = torch.stack([loss_sum / gradient_accumulation_steps, grad_norm.float(), stops]).tolist()
    if not math.isfinite(loss_mean) or not (math.isfinite(grad_norm_value) or scaler.is_enabled()):
        message = (f"non-finite {'loss' if not math.isfinite(loss_mean) else 'gradient norm'} at iteration {iter_num + 1}: "
                   f"loss {loss_mean}, lr {lr:.3e}, grad norm {grad_norm_value}, batch windows (start positions in the "
                   f"train split) {batch_starts[:16]}{' ...' if len(batch_starts) > 16 else ''}; the last checkpoints are "
                   f"untouched: lower learning_rate or raise warmup_iters, then resume")
        abort(iter_num + 1, message)
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    # float16 gradients overflowed somewhere: skip every optimizer's step, decided once on the norm over all parameters
    # (each scaler.step would decide per optimizer, and one could step while another skips)
    skipped = scaler.is_enabled() and not math.isfinite(grad_norm_value)
    if not skipped:
        for opt, scheduler in zip(optimizers, schedulers):
            scaler.step(opt)
            scheduler.step()  # the schedule counts optimizer steps that really happened
    scaler.update()  # lowers the scale after an overflow
    skipped_steps, consecutive_skips = skipped_steps + skipped, (consecutive_skips + 1) * skipped
    iter_num += 1
    if iter_num == start_iter + 1:
        record_memory()
    if consecutive_skips >= max_consecutive_skips:
        message = (f"float16 gradients overflowed {consecutive_skips} optimizer steps in a row (up to iteration {iter_num}, "
                   f"loss scale now {scaler.get_scale():g}): the model diverged or float16's range is too small for it; "
                   f"use dtype=bfloat16 or float32, or lower learning_rate, then resume")
        abort(iter_num, message)
    iters_since_log += 1
    first_loss = first_loss if first_loss is not None else loss_mean
    evaluating = iter_num % eval_interval == 0 or iter_num == max_iters
    saving = (checkpoint_interval and iter_num % checkpoint_interval == 0) or stops
    rng_after_step = gather_rng() if evaluating or saving else None

    if iter_num % log_interval == 0 or iter_num == max_iters:
        elapsed = time.time() - t_last
        tokens_per_sec = iters_since_log * tokens_per_iter / elapsed
        mfu = tokens_per_sec * raw_model.flops_per_token() / (peak_flops * world_size)
        peak_mem_mb = perf.peak_memory_mb(device)
        if iter_num - iters_since_log == start_iter:  # the session's first interval: warm-up, compilation
            first_interval = elapsed / iters_since_log
        else:
            iter_seconds.append(elapsed / iters_since_log)
        eta = (max_iters - iter_num) * statistics.median(iter_seconds or [first_interval])  # a slow spell moves a median little
        record({'kind': 'train', 'step': iter_num, 'time': time.time(), 'loss': loss_mean, 'lr': lr, 'grad_norm': grad_norm_value,
                'tokens_per_sec': tokens_per_sec, 'mfu': mfu, 'peak_mem_mb': peak_mem_mb, 'eta_seconds': eta, 'skipped': skipped,
                'skipped_total': skipped_steps, 'scale': scale, 'epoch': train_sampler.epoch})
        log(f"iter {iter_num}/{max_iters}: loss {loss_mean:.4f}, lr {lr:.3e}, grad norm {grad_norm_value:.3f}, "
            f"{tokens_per_sec:,.0f} tok/s, MFU {mfu:.1%}, mem {peak_mem_mb:,.0f} MB, ETA {eta / 60:.1f} min"
            f"{', step skipped (float16 overflow)' if skipped else ''}")
        t_last, iters_since_log = time.time(), 0

    saves, stopping_early = [], False
    if evaluating:
        train_loss, val_loss = evaluate('train'), evaluate('val')
        improved = val_loss < best_val_loss
        if improved:
            best_val_loss, best_iter, evals_since_best = val_loss, iter_num, 0
        else:
            evals_since_best += 1
        record({'kind': 'eval', 'step': iter_num, 'train_loss': train_loss, 'val_loss': val_loss,
                'best_val_loss': best_val_loss, 'val_bits_per_token': val_loss / math.log(2)})
        log(f"eval {iter_num}: train {train_loss:.4f}, val {val_loss:.4f} (gap {val_loss - train_loss:+.4f}), "
            f"best {best_val_loss:.4f} at {best_iter}{' *saved best.pt' if improved else ''}")
        stopping_early = patience > 0 and evals_since_best >= patience
        # best.pt before last.pt: a kill in between leaves last.pt older, never ahead of best.pt. Without
        # always_save_checkpoint, last.pt still follows every new best, so init_from=auto resumes from there.
        saves = ['best.pt'] * improved + ['last.pt'] * (always_save_checkpoint or improved or iter_num == max_iters or stopping_early)
    if saving and 'last.pt' not in saves:
        saves.append('last.pt')
    if saves:
        save_seconds = save_checkpoint(saves, rng_after_step)
        save_seconds_total += save_seconds
        log(f"saved {' and '.join(saves)} in {save_seconds:.2f} s")
        if ddp:
            dist.barrier()
    if stops:  # every rank saw the same count: all save above and stop here
        name = signal.Signals(stop_signal or signal.SIGTERM).name
        record({'kind': 'stop', 'step': iter_num, 'time': time.time(), 'signal': name})
        log(f"stopped by {name} at iteration {iter_num}: {os.path.join(out_dir, 'last.pt')} holds it; resume with: "
            f"{report.resume_command(run_meta, True) if master else ''}")
        finish_report()
        sys.exit(128 + (stop_signal or signal.SIGTERM))
    if stopping_early:
        log(f"early stop: no better val loss in {patience} evaluations since iteration {best_iter}")
        break
    if evaluating or saves:
        t_last, iters_since_log = time.time(), 0  # evaluation and save time is not training throughput

# -----------------------------------------------------------------------------
# the end: the best weights on the test split, a sample, the report
session_seconds = time.time() - t_start
if overfit_one_batch:
    log(f"overfit one batch: loss {first_loss:.4f} -> {loss_mean:.4f}")
# last.pt holds the trained weights (written above); only now load the best ones
if best_iter > 0 and (test_eval or sample_tokens):
    restore(raw_model, checkpoint.load(os.path.join(out_dir, 'best.pt')), os.path.join(out_dir, 'best.pt'), with_optimizer=False)
test_loss = evaluate('test') if test_eval else None
record({'kind': 'test', 'step': iter_num, 'best_iter': best_iter, 'best_val_loss': best_val_loss, 'test_loss': test_loss,
        'wall_seconds': session_seconds, 'save_seconds': save_seconds_total,
        'total_seconds': None if seconds_before is None else seconds_before + session_seconds})
if start_iter:
    total = f"{seconds_before + session_seconds:.0f} s" if seconds_before is not None else "a time unknown (an older checkpoint)"
    sessions = f"iterations {start_iter + 1}-{iter_num} in {session_seconds:.0f} s, all {iter_num} iterations in {total} over every session"
else:
    sessions = f"{iter_num} iterations in {session_seconds:.0f} s"
log(f"done: {sessions} (checkpoint saves {save_seconds_total / session_seconds:.1%} of this session), "
    f"best val loss {best_val_loss:.4f} at iteration {best_iter}" +
    (f", test loss {test_loss:.4f} ({test_loss / math.log(2):.3f} bits/token) with the best weights" if test_eval else '') +
    f"; checkpoints in {out_dir}")
if sample_tokens:
    try:
        tok = tokenizer.load(data_meta['tokenizer'])
    except tokenizer.TokenizerError as e:
        log(f"no sample: {e}")
    else:
        if master or sharded:  # a sharded model's forward needs every rank
            with autocast:
                text = sample.sample_text(raw_model, tok, tok.start, sample_tokens, 0.8, 200, seed, device)
            log(f"a sample from the best weights:\n{text}")
finish_report()
