"""
What a checkpoint holds and how it is restored, side by side, and files that survive a kill at any
moment.

A checkpoint is a dict of state_dicts, tensors and plain values: state() builds it, resume() applies
it. Files are written atomically (temp file in the same folder, flush, fsync, os.replace, fsync of
the folder), so a kill leaves the old file or the new one, never half of one, and read with
weights_only=True, so a checkpoint cannot run code. One state saved under two names (best.pt and
last.pt at a new best) is one file with two names (hard links; a copy where the filesystem has
none): written once, each name replaced alone. In fsdp mode every rank writes its part of the
weights and optimizer state to out_dir/shards-ITER/ with torch.distributed.checkpoint, and the .pt
file, written after, points there (with async_save, DCP's async_save writes the shards in a thread,
and the .pt waits for them).

FORMAT numbers the layout; this code writes its own. 4: the embedding and head have padded
vocabulary rows, one optimizer and scheduler state, each rank's RNG state holds its own CUDA
device's generator only (the first format-4 files hold a scheduler state per optimizer). Format 3
and those are migrated on load (migrate); formats 1 and 2 are refused in one line. A config key or
loop counter that a checkpoint's code did not have yet takes its default on resume: each new key
defaults to the old behaviour.
"""
import contextlib
import copy
import dataclasses
import glob
import json
import math
import os
import pickle
import random
import re
import shutil
import sys
import threading
import warnings

import numpy as np
import torch

import distributed
from model import GPT, GPTConfig

FORMAT = 4
# train.py's keys that may change on resume: how long, how often to evaluate, log and save, where to
# write, speed knobs, the start's and end's extras, and the learning-rate schedule and clipping from
# here on (how a user recovers from a blow-up; past steps keep their rates). Any other change is
# refused: it would be another run.
RESUMABLE = {'out_dir', 'data_dir', 'init_from', 'resume_from', 'eval_only', 'max_iters',
             'eval_interval', 'log_interval', 'eval_iters', 'always_save_checkpoint',
             'checkpoint_interval', 'patience', 'num_workers', 'compile', 'device', 'backend',
             'threads', 'keep_checkpoints', 'async_save', 'max_consecutive_skips',
             'activation_checkpointing', 'profile_iter', 'tensorboard_log', 'wandb_log',
             'wandb_project', 'wandb_run_name', 'cost_per_hour', 'smoke_steps', 'test_eval',
             'sample_tokens', 'write_report', 'eval_tasks', 'eval_tasks_examples', 'learning_rate',
             'muon_lr', 'decay_lr', 'lr_schedule', 'wsd_decay_frac', 'warmup_iters',
             'lr_decay_iters', 'min_lr', 'grad_clip'}

# what the weights (and the EMA's) are, and what they were trained on: eval_only may change only the
# other keys (dropout: evaluation runs none)
WEIGHTS_KEYS = ({f.name for f in dataclasses.fields(GPTConfig)} - {'dropout', 'zero_init'}
                | {'ema_decay', 'dataset'})


@dataclasses.dataclass
class Progress:
    """The training loop's counters: saved in every checkpoint and restored whole on resume."""
    iter_num: int = 0  # optimizer iterations done, float16's skipped ones included
    best_val_loss: float = float('inf')
    best_acc_norm: float = -math.inf  # for best_by='acc_norm': an acc_norm of 0 can be the best
    best_iter: int = 0  # where best.pt was written; 0: not yet
    evals_since_best: int = 0  # for patience
    skipped_steps: int = 0  # float16 overflows the scaler skipped
    consecutive_skips: int = 0
    train_seconds: float = 0.0  # wall time trained in all sessions, as of the last save

    def new_best(self, val_loss, acc_norm, best_by):
        """Whether an evaluation's val loss (lowest wins) or acc_norm (highest), as best_by says,
        is a new best; the best, its iteration and evals_since_best follow."""
        if best_by == 'val_loss':
            improved = val_loss < self.best_val_loss
        else:
            improved = acc_norm > self.best_acc_norm
        if improved:
            self.best_val_loss, self.best_acc_norm = val_loss, acc_norm
            self.best_iter = self.iter_num
        self.evals_since_best = 0 if improved else self.evals_since_best + 1
        return improved

    def out_of_patience(self, patience):
        """Whether patience (> 0) evaluations have passed without a new best: the run stops."""
        return patience > 0 and self.evals_since_best >= patience


class CheckpointError(Exception):
    pass


def atomic_write(path, write):
    """write(f) fills a binary file object; path appears complete or not at all (in_place)."""
    def write_synced(tmp):
        with open(tmp, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    in_place(path, write_synced)


def in_place(path, make):
    """make(tmp) makes a temp file, which then replaces path, durably: path is the old file or the
    new, never half of one. The temp file is this process's own (processes may write one path at
    once) and in the same folder (os.replace is atomic only within one filesystem); one that fails
    (a full disk) is removed: it would hold the space a retry needs."""
    tmp = f'{path}.{os.getpid()}.tmp'
    # a killed process's temp file of this name may be a link to a checkpoint: unlinked, never
    # truncated
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    try:
        make(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)  # the rename, durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_file(source, path):
    """path becomes a second name of the file source, atomically (a hard link made beside path, then
    renamed over it): one state written once for best.pt and last.pt. Where the filesystem has no
    hard links, a copy."""
    try:
        in_place(path, lambda tmp: os.link(source, tmp))
    except OSError:
        with open(source, 'rb') as f:
            atomic_write(path, lambda out: shutil.copyfileobj(f, out))


def write_json(path, obj):
    """obj as indented JSON in path, atomically: config.json, meta.json and the caches others may
    read."""
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + '\n').encode()))


class KeepWriteError:
    """A file for torch.save that keeps the OSError of its writes: torch.save reports a full disk
    only as a RuntimeError ('unexpected pos ...') that names no cause."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def save_file(obj, path):
    """torch.save(obj) to path, atomically; a failed write raises its OSError (errno ENOSPC for a
    full disk)."""
    def write(f):
        kept = KeepWriteError(f)
        try:
            torch.save(obj, kept)
        except RuntimeError:
            if kept.error:
                raise kept.error from None
            raise
    atomic_write(path, write)


def load(path, resumable=False):
    """A checkpoint file's dict, in this code's format; resumable: it must hold a run's whole state,
    not only weights. An older one comes back migrated, with 'migrated': the line that says so, for
    the caller to print (train.py on rank 0, sample.py to stderr)."""
    try:
        with warnings.catch_warnings():  # torch's on the pickle protocol of a file it then refuses
            warnings.filterwarnings('ignore', message='Detected pickle protocol')
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist, so there is nothing to resume (a "
                              f"run stopped before its first checkpoint starts again with "
                              f"init_from=scratch or auto): check out_dir / resume_from")
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if isinstance(e, pickle.UnpicklingError):  # its first line: advice to load unsafely
            first_line = "not a torch.save file of tensors and plain values"
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt: "
                              f"{first_line}): use another file (train.py: resume_from=PATH), or "
                              f"start a new out_dir")
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not a checkpoint: pass the "
                              f"best.pt or last.pt of a run")
    if ckpt.get('format', 1) > FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {ckpt['format']}, newer than this "
                              f"code's {FORMAT}: update honestgpt (git pull) to resume it")
    # every format's checkpoints and exports hold model_args: without it (a bare state_dict), a dict
    # with no 'format' is not format 1
    if 'model_args' not in ckpt:
        raise CheckpointError(f"{path} is not a train.py checkpoint (a dict without model_args, "
                              f"such as a bare state_dict): pass the best.pt or last.pt of a run")
    if migrated := migrate(ckpt, path):
        ckpt['migrated'] = migrated
    if 'shards' in ckpt:
        check_shards(path, ckpt['shards'])
    if resumable and 'scheduler' not in ckpt:
        raise CheckpointError(f"checkpoint {path} holds weights only (sample.py --export writes "
                              f"those), no training state to resume: resume from a run's last.pt, "
                              f"best.pt or stable.pt")
    return ckpt


def check_shards(path, shards):
    """A sharded run's checkpoint at path keeps its weights in the folder shards beside it: that
    folder must hold DCP's metadata and every file it names, whole (a copy of last.pt alone, or a
    copy cut short, would fail inside DCP's load with a traceback per rank)."""
    import torch.distributed.checkpoint as dcp  # imported only for sharded checkpoints: ~1 s
    folder = os.path.join(os.path.dirname(path), shards)
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
        ends = {}  # {file: the end of its last tensor}
        for info in metadata.storage_data.values():
            file = info.relative_path
            ends[file] = max(ends.get(file, 0), info.offset + info.length)
        for name, end in ends.items():
            if os.path.getsize(os.path.join(folder, name)) < end:
                raise OSError(f"{name} is cut short")
    except Exception as e:  # a missing or unreadable .metadata or file; a foreign folder
        raise CheckpointError(f"{path} keeps its weights in {folder}, which is missing or "
                              f"incomplete ({e}): copy that folder beside it whole, or use "
                              f"another checkpoint")


def migrate(ckpt, path):
    """An older checkpoint (path's) in this code's layout, in place; returns the line that says what
    changed, or '' where nothing did. Each change is mechanical: format 3's embedding, head and
    AdamW's moments of them gain the padding rows, and each rank's CUDA RNG states (one per visible
    GPU) become its own device's; the LR scheduler states of format 3 and the first format 4 (one
    per optimizer) become one. Formats 1 and 2, and a format-3 fsdp run's shards, are refused."""
    version = ckpt.get('format', 1)
    if version < 3:
        raise CheckpointError(f"checkpoint {path} has format {version}, written before datasets "
                              f"were shards: no dataset this code reads is the one it trained on "
                              f"(its documents were split by an older rule): finish that run with "
                              f"the honestgpt commit that started it, or start a new out_dir")
    if version == 3 and 'shards' in ckpt:
        raise CheckpointError(f"checkpoint {path} has format 3 and its weights in "
                              f"{ckpt['shards']}/, sharded in their shapes before the vocabulary "
                              f"was padded: finish that run with the honestgpt commit that started "
                              f"it, or start a new out_dir")
    changes = []
    if version == 3:
        changes.append(pad_vocabulary(ckpt))
        on_gpus = any(state['cuda'] for state in ckpt['rng'])
        for rank, state in enumerate(ckpt['rng']):
            # rank r drew from cuda:LOCAL_RANK: r modulo the GPUs of a node, with a process per GPU
            state['cuda'] = state['cuda'][rank % len(state['cuda'])] if on_gpus else None
        changes += ["each rank keeps its own GPU's RNG state"] if on_gpus else []
    if isinstance(ckpt.get('scheduler'), list):
        # a LambdaLR per optimizer, all stepped together: the same counts, then each group's values
        schedulers = ckpt['scheduler']
        ckpt['scheduler'] = schedulers[0] | {k: [v for s in schedulers for v in s[k]]
                                             for k in ('base_lrs', '_last_lr', 'lr_lambdas')}
        changes.append("one LR scheduler state")
    if 'muon_dtype' not in ckpt:  # written when torch's own Muon ran Newton-Schulz, in bfloat16
        ckpt['muon_dtype'] = 'bfloat16'
    ckpt['format'] = FORMAT
    return f"migrated {path} from format {version}: {'; '.join(changes)}" if changes else ''


def pad_vocabulary(ckpt):
    """Format 3's embedding and head, and AdamW's moments of them, padded to this code's rows;
    returns what was done, in words."""
    # this code's shapes and the optimizers' order of parameters, on the meta device: no memory
    with torch.device('meta'):
        model = GPT(GPTConfig(**ckpt['model_args']))
        optimizer = model.configure_optimizers(0.0, 0.0, (0.9, 0.95), ckpt['config']['optimizer'])
    vocab_size, rows = ckpt['model_args']['vocab_size'], model.wte.weight.size(0)

    def pad(t):
        # zeros, not the init's random values (no RNG draw): no token id looks a padding row up
        # and forward cuts its logit off, so its gradient, moments and updates all stay zero
        return torch.cat((t, t.new_zeros(rows - t.size(0), *t.shape[1:])))
    for name in ('wte.weight', 'lm_head.weight'):
        ckpt['model'][name] = pad(ckpt['model'][name])
    padded = (model.wte.weight, model.lm_head.weight)  # one parameter when tied
    for opt, saved in zip(optimizer.optimizers, ckpt['optimizer'], strict=True):
        params = [p for group in opt.param_groups for p in group['params']]  # the state's numbers
        for i, state in saved['state'].items():
            if any(params[i] is p for p in padded):
                state.update({k: pad(state[k]) for k in ('exp_avg', 'exp_avg_sq')})
    return (f"vocabulary rows padded {vocab_size} -> {rows} in the embedding, the head and AdamW's "
            f"moments")


def changed_settings(ckpt, config, defaults, tasks=None):
    """{key: (the checkpoint's run's value, this config's)} of the settings that differ. A key the
    checkpoint's code did not have yet was at its default there. dtype and muon_dtype compare as
    the checkpoint's run resolved them: 'auto' here keeps that (preflight.dtypes), and 'float32'
    here continues a run whose 'auto' chose float32. eval_tasks and eval_tasks_examples compare
    as the examples they score where the checkpoint keeps their digest (tasks: this config's,
    evaluate.tasks_digest's): a task file moved is no change, one edited in place is."""
    def theirs(k):
        if k in ('dtype', 'muon_dtype') and ckpt.get(k, 'auto') != 'auto':
            return config[k] if config[k] == 'auto' else ckpt[k]
        if k in ('eval_tasks', 'eval_tasks_examples') and tasks and 'tasks' in ckpt:
            if ckpt['tasks'] == tasks:
                return config[k]
            if k == 'eval_tasks' and ckpt['config'].get(k) == config[k]:
                return f"{config[k]} (other examples then)"
        return ckpt['config'].get(k, defaults[k])
    return {k: (theirs(k), config[k]) for k in config if theirs(k) != config[k]}


def why_not_resume(ckpt, config, defaults, unread=(), tasks=None):
    """Why this config may not resume the checkpoint ('was trained with other settings (...)'), or
    ''. unread: keys neither run reads (preflight.unread's), which may change. What measures the
    best so far may not: eval_iters (the val windows) under best_by='val_loss', the examples the
    tasks score under 'acc_norm' (tasks: evaluate.tasks_digest's; a checkpoint from before the
    digest: eval_tasks' paths and eval_tasks_examples): a best.pt chosen over two measures would be
    chosen by the change. eval_only, which loads only the weights and evaluates them, may change
    all but WEIGHTS_KEYS."""
    by_tasks = config['best_by'] == 'acc_norm'
    if by_tasks and not config['eval_only'] and tasks and ckpt.get('tasks', tasks) != tasks:
        return ("scored other task examples than eval_tasks does here (best_by='acc_norm' chose "
                "its best.pt by them)")
    chooses_best = ('eval_tasks', 'eval_tasks_examples') if by_tasks else ('eval_iters',)

    def fixed(key):
        if config['eval_only']:
            return key in WEIGHTS_KEYS
        return key not in RESUMABLE or key in chooses_best
    changed = [f"{k}={old!r} there, {new!r} here"
               for k, (old, new) in changed_settings(ckpt, config, defaults, tasks).items()
               if fixed(k) and k not in unread]
    return f"was trained with other settings ({'; '.join(changed)})" if changed else ''


# -----------------------------------------------------------------------------
# the state: built here, applied here

# parts: the run's objects whose state_dicts a checkpoint holds, by name (torchtitan's and DCP's app
# state): 'model' (the plain GPT, not its compiled or DDP wrapper), 'optimizer', 'scheduler',
# 'scaler', 'sampler', and under ema_decay 'ema' (an AveragedModel: the weights' moving average,
# n_averaged)
OTHER_PARTS = ('scheduler', 'scaler', 'sampler')


def state(parts, rng, progress, run, shards=None):
    """The checkpoint: weights and optimizer state (in fsdp mode, the name of the shards folder that
    holds them), the schedule, the loss scale, the data position, every rank's RNG state (rng, in
    rank order), the loop's counters (progress: a Progress) and what the run is (run: config,
    model_args, dataset, dtype, ...)."""
    weights = {'shards': shards} if shards else {
        'model': parts['model'].state_dict(), 'optimizer': parts['optimizer'].state_dict(),
        **({'ema': parts['ema'].state_dict()} if 'ema' in parts else {})}
    return {'format': FORMAT, **run, **dataclasses.asdict(progress), **weights,
            **{name: parts[name].state_dict() for name in OTHER_PARTS}, 'rng': rng}


def resume(ckpt, path, parts, rank, world_size, device, weights_only=False):
    """Apply a checkpoint to a run built from the same config; returns the loop's counters (a
    Progress) it holds: one added after its code was written (best_acc_norm) keeps its default.
    The LR schedule is this config's: each group's base rate comes from the config,
    not the file, so a lowered learning_rate applies from here on. RNG states are restored only on
    the number of processes that wrote them. weights_only (eval_only): the weights, the EMA's and
    the counters, built from a config that may differ but in WEIGHTS_KEYS."""
    optimizer, scheduler = parts['optimizer'], parts['scheduler']
    load_weights(ckpt, path, parts['model'], None if weights_only else optimizer, parts.get('ema'))
    names = [field.name for field in dataclasses.fields(Progress)]
    progress = Progress(**{name: ckpt[name] for name in names if name in ckpt})
    if progress.best_iter == 0:  # no best yet: older checkpoints held 0.0, which an acc_norm of 0
        progress.best_acc_norm = -math.inf  # never beat
    if weights_only:
        return progress
    configured = scheduler.base_lrs
    for name in OTHER_PARTS:
        parts[name].load_state_dict(ckpt[name])
    scheduler.base_lrs = configured
    for group, base_lr, factor in zip(optimizer.param_groups, configured, scheduler.lr_lambdas):
        group['lr'] = base_lr * factor(scheduler.last_epoch)
    if len(ckpt['rng']) == world_size:
        set_rng_state(ckpt['rng'][rank], device)
    return progress


def load_weights(ckpt, path, model, optimizer=None, ema=None):
    """The weights (and the optimizer state, and the EMA's weights) of a checkpoint: from the file,
    or in fsdp mode from the shards folder it points to, of which every rank reads its own part."""
    if 'shards' not in ckpt:
        model.load_state_dict(ckpt['model'])
        if optimizer:
            optimizer.load_state_dict(ckpt['optimizer'])
        if ema:
            ema.load_state_dict(ckpt['ema'])
        return
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)
    # before the first optimizer step (a stop in the smoke test) the fresh optimizer is the state:
    # DCP's state_dict would give it one (a step at rate 0) and then find none in the shards
    stepped = optimizer is not None and ckpt['scheduler']['last_epoch'] > 0
    sharded = sharded_state(model, optimizer if stepped else None, ema)
    load_shards(sharded, path, ckpt['shards'])
    set_model_state_dict(model, sharded['model'])
    if ema:
        set_model_state_dict(ema, sharded['ema'])
    if stepped:
        set_optimizer_state_dict(model, optimizer.optimizers, sharded['optimizer'])
        optimizer.gather()  # the members' load_state_dict gave them new group dicts


def load_shards(state, path, shards):
    """DCP's load of state (its tensors, filled in place) from the shards folder of the checkpoint
    at path. In one process (a sharded run resumed or sampled there) DCP warns that it has no
    process group: that is meant, and the warning is dropped."""
    import torch.distributed.checkpoint as dcp  # imported only for sharded checkpoints: ~1 s
    folder = os.path.join(os.path.dirname(path), shards)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', message='torch.distributed is disabled')
            dcp.load(state, checkpoint_id=folder)
    # a damaged file, whole in size (check_shards passed it): DCP gathers every rank's errors into
    # one CheckpointException (a BaseException), which each rank raises, also in one process
    except dcp.api.CheckpointException as e:
        first = next(iter(e.failures.values()))[0]  # failures: {rank: (its error, traceback)}
        why = f"{type(first).__name__}: {(str(first).strip().splitlines() or [''])[0][:120]}"
        raise CheckpointError(f"{path} keeps its weights in {folder}, which cannot be read "
                              f"({why}): use another checkpoint") from None


def sharded_state(model, optimizer=None, ema=None):
    """This rank's part of an FSDP model's weights (and optimizer state, and the EMA's weights), as
    DCP reads and writes it."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)
    return ({'model': get_model_state_dict(model)}
            | ({'optimizer': get_optimizer_state_dict(model, optimizer.optimizers)}
               if optimizer else {})
            | ({'ema': get_model_state_dict(ema)} if ema else {}))


def kept_checkpoints(out_dir, up_to=None):
    """The checkpoints keep_checkpoints keeps (ckpt-ITER.pt), oldest first; up_to: those of
    iterations up to it only (later ones are a run's that was resumed from before them)."""
    kept = {}
    for path in glob.glob(os.path.join(glob.escape(out_dir), 'ckpt-*.pt')):
        match = re.fullmatch(r'ckpt-(\d+)\.pt', os.path.basename(path))
        if match and (up_to is None or int(match[1]) <= up_to):
            kept[int(match[1])] = path
    return [kept[iteration] for iteration in sorted(kept)]


def saved_state(path):
    """A checkpoint file's loop counters (a dict of Progress's fields and 'shards'), read
    memory-mapped, or None where it is missing, unreadable or no checkpoint of a run."""
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    except Exception:  # missing, truncated, not a torch.save file: holds no iteration of a run
        return None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get('iter_num'), int)):
        return None  # a bare state_dict, an export's weights
    names = [field.name for field in dataclasses.fields(Progress)] + ['shards']
    return {name: ckpt.get(name) for name in names}


def same_file(a, b):
    """Whether two paths name one file (a link, another spelling); a missing one names none."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def branch(out_dir, path, ckpt):
    """A resume from path, a checkpoint of out_dir (last.pt, stable.pt, best.pt, a kept one):
    out_dir's checkpoints of later iterations, and a best.pt not of path's best evaluation, belong
    to the continuation this session replaces (its log records are cut, as on every resume); after
    a kill, a kept checkpoint an evaluation wrote without last.pt (always_save_checkpoint=False),
    or stable.pt, may be past last.pt. They move, with the shards folders only they name, into
    out_dir/replaced-ITER/ (ITER: path's), out of the way of init_from=auto, sample.py and
    verify.py, and kept. last.pt becomes a second name of path (a stop before the first save
    resumes it again), and best.pt of a checkpoint of its best evaluation where one is kept.
    Returns the names moved, each with its iteration, and that folder's name."""
    def is_best(saved):  # the state at path's best evaluation: its iteration and its val loss
        return saved and (saved['iter_num'], saved['best_val_loss']) == (ckpt['best_iter'],
                                                                         ckpt['best_val_loss'])
    names = ['best.pt', 'last.pt', 'stable.pt'] + [os.path.basename(p)
                                                   for p in kept_checkpoints(out_dir)]
    files = {name: saved_state(os.path.join(out_dir, name)) for name in names}
    stale = []
    for name, saved in files.items():
        later = saved and saved['iter_num'] > ckpt['iter_num']
        other_best = saved and name == 'best.pt' and not is_best(saved)
        if (later or other_best) and not same_file(os.path.join(out_dir, name), path):
            stale.append(name)
    replaced = unused_name(out_dir, f"replaced-{ckpt['iter_num']:06d}") if stale else ''
    if stale:
        os.mkdir(os.path.join(out_dir, replaced))
    for name in stale:  # the files, then their shards: a kill between leaves no file without them
        os.replace(os.path.join(out_dir, name), os.path.join(out_dir, replaced, name))
    kept_shards = {saved['shards'] for name, saved in files.items() if saved and name not in stale}
    for folder in {files[name]['shards'] for name in stale} - kept_shards - {None}:
        with contextlib.suppress(FileNotFoundError):  # moved by a move a kill cut short
            os.replace(os.path.join(out_dir, folder), os.path.join(out_dir, replaced, folder))
    best, last = os.path.join(out_dir, 'best.pt'), os.path.join(out_dir, 'last.pt')
    if not same_file(path, last):
        link_file(path, last)
    if ckpt['best_iter'] and not os.path.exists(best):
        for name in (os.path.basename(path), f"ckpt-{ckpt['best_iter']:06d}.pt", 'stable.pt'):
            if is_best(saved_state(os.path.join(out_dir, name))):
                link_file(os.path.join(out_dir, name), best)
                break
    return [f"{name} ({files[name]['iter_num']})" for name in stale], replaced


def shards_named(path):
    """The shards folder a checkpoint file points to, or None where the file holds the state
    itself (or another object: a user's .pt): read memory-mapped (torch.save's zip format, every
    version's here), so a whole state is not read for it. Raises where torch cannot read it."""
    ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    return ckpt.get('shards') if isinstance(ckpt, dict) else None


def save(names, out_dir, parts, rng, progress, run, sharded, writer):
    """Write each of names (best.pt, last.pt, ...) into out_dir, holding state(), through writer
    (Writer: at once, or in the background). Every rank calls it: in fsdp mode each first writes its
    shards to shards-ITER/, and only then does rank 0 write the files that point there, so a shards
    folder counts only once complete. Returns None, or what failed on this rank: (names, iteration,
    why: a full disk's 'No space left on device'), for the ranks to agree on before any goes on. A
    failed write leaves every file on disk whole. The last background write must have ended on every
    rank (train.py waits and agrees first): its shards and rank 0's removals."""
    try:
        shards = shards_written = None
        if sharded:
            import torch.distributed.checkpoint as dcp
            shards = distributed.gather(unused_name(out_dir, f"shards-{progress.iter_num}"))[0]
            folder = os.path.join(out_dir, shards)
            state_now = sharded_state(parts['model'], parts['optimizer'], parts.get('ema'))
            try:
                if writer.background:  # copied to host memory now, written by DCP's thread
                    shards_written = dcp.async_save(state_now, checkpoint_id=folder,
                                                    process_group=writer.group)
                else:
                    dcp.save(state_now, checkpoint_id=folder)
            except dcp.api.CheckpointException as e:  # a BaseException, raised on every rank
                return names, progress.iter_num, reason(e)
        elif not writer.master:  # rank 0 writes the whole state
            return None
        last = os.path.join(out_dir, 'last.pt')
        # one new checkpoint (the other names link to it), with room to spare; a warning that
        # cannot be worked out is left out, not taken for a failed save
        if writer.master and os.path.exists(last):
            with contextlib.suppress(OSError):
                size, free = stored_bytes(last), shutil.disk_usage(out_dir).free
                if free < 2 * size:
                    print(f"warning: {out_dir} has {free / 2**20:,.0f} MB free and a checkpoint "
                          f"takes {size / 2**20:,.0f} MB: free space before a save fails",
                          file=sys.stderr)
        return writer.write(state(parts, rng, progress, run, shards), names, shards_written)
    except (OSError, CheckpointError) as e:
        return names, progress.iter_num, reason(e)


def stored_bytes(path):
    """A checkpoint's bytes on disk: its file and, in fsdp mode, the shards folder it names (the
    file alone is a pointer there)."""
    shards = (saved_state(path) or {}).get('shards')
    folder = os.path.join(os.path.dirname(path), shards) if shards else None
    in_folder = (sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file())
                 if folder and os.path.isdir(folder) else 0)
    return os.path.getsize(path) + in_folder


def unused_name(out_dir, name):
    """name, or name.K, the first that out_dir lacks: DCP writes its files in place, and after a
    resume from an earlier checkpoint into the same out_dir, a later one may name shards-ITER."""
    taken, k = name, 0
    while os.path.lexists(os.path.join(out_dir, taken)):
        k += 1
        taken = f"{name}.{k}"
    return taken


def reason(error):
    """Why a write failed, in a few words: an OSError's (a full disk: 'No space left on device'); of
    DCP's CheckpointException (its failures: {rank: (error, traceback)}), the first rank's with an
    OSError (torch.save's own error can hide one), else the first rank's."""
    if getattr(error, 'failures', None):
        _, rank, first = min((not isinstance(e, OSError), rank, e)
                             for rank, (e, _) in error.failures.items())
        return f"{reason(first)}, rank {rank}"
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)


def host_copy(state, buffers, copies):
    """state with every tensor copied to host memory, tensors that share their memory (a tied head's
    two names) still shared: what a background write reads while training changes the originals.
    Into the last copy's buffer of the same tensor where there is one (buffers, {view: tensor}; the
    copies made go into copies): a fresh host allocation costs more than the copy. A GPU's tensors
    go to pinned buffers, without waiting (the caller synchronizes once)."""
    if isinstance(state, torch.Tensor):
        view = (state.device, state.untyped_storage().data_ptr(), state.storage_offset(),
                state.dtype, state.shape, state.stride())
        if view not in copies:
            buffer = buffers.pop(view, None)
            if buffer is None:
                buffer = torch.empty(state.shape, dtype=state.dtype, pin_memory=state.is_cuda)
            copies[view] = buffer.copy_(state.detach(), non_blocking=state.is_cuda)
        return copies[view]
    if isinstance(state, dict):
        return {key: host_copy(value, buffers, copies) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(host_copy(value, buffers, copies) for value in state)
    return state


class Writer:
    """A rank's checkpoint files in out_dir: rank 0 (master) writes each state once under its first
    name and links it under the others, then removes the kept checkpoints beyond keep, and the
    shards folders no checkpoint names; in fsdp mode (sharded) every rank has written its shards
    first. With background (async_save), in a thread from a host copy of the state while training
    goes on, one at a time: the next write waits for the last, and so does the interpreter's exit
    (the thread is not a daemon); the host copy's buffers are kept for the next (a copy of the state
    in host memory, for the run). last_saved: the iteration last.pt holds. Every rank builds its
    Writer at the same point: in fsdp mode with background, it makes a process group."""

    def __init__(self, out_dir, keep, background, last_saved, master=True, sharded=False):
        self.out_dir, self.keep, self.background = out_dir, keep, background
        self.last_saved, self.master = last_saved, master
        self.thread, self.failure = None, None
        self.buffers = {}  # {view: host tensor}: the last host copy's (host_copy)
        # DCP's background write gathers across ranks in its thread: a group of its own, never the
        # one training's collectives run on, and on the CPU (gloo), as DCP's async_save requires
        self.group = (torch.distributed.new_group(backend='gloo') if background and sharded
                      else None)

    def write(self, ckpt, names, shards_written=None):
        """None, or what failed, (names, iteration, why): this write, or in the background the last
        one (this one's failure comes from failed() or wait() later). shards_written: DCP's
        async_save's future, which the write waits for."""
        failed = self.wait()
        if failed:
            return failed
        if not self.background:
            return self._write(ckpt, names)
        copies = {}
        copy = host_copy(ckpt, self.buffers, copies)
        self.buffers = copies  # a tensor gone since the last copy frees its buffer
        if any(view[0].type == 'cuda' for view in copies):
            torch.cuda.synchronize()  # the copies are whole before training changes the originals
        self.thread = threading.Thread(target=self._write_in_background,
                                       args=(copy, names, shards_written))
        self.thread.start()
        return None

    def _write(self, ckpt, names):
        if not self.master:
            return None
        try:
            first = os.path.join(self.out_dir, names[0])
            save_file(ckpt, first)
            for name in names[1:]:  # the same state: the same file, by another name
                link_file(first, os.path.join(self.out_dir, name))
        except (OSError, CheckpointError) as e:
            return names, ckpt['iter_num'], reason(e)
        if 'last.pt' in names:
            self.last_saved = ckpt['iter_num']
        if self.keep:  # the oldest, once the newest is whole
            for path in kept_checkpoints(self.out_dir, up_to=ckpt['iter_num'])[:-self.keep]:
                with contextlib.suppress(OSError):  # one left behind harms nothing
                    os.remove(path)
        # also after a resume on one process, which writes its state into the file
        self.remove_unnamed_shards()
        return None

    def remove_unnamed_shards(self):
        """Rank 0 removes the shards folders no checkpoint file in out_dir names (every .pt counts,
        a copy a user made too): those of older saves, and of a save that failed halfway."""
        if not self.master:
            return
        own = [os.path.join(self.out_dir, name) for name in ('best.pt', 'last.pt', 'stable.pt')]
        with contextlib.suppress(OSError):  # one left behind harms nothing
            folders = {f for f in os.listdir(self.out_dir) if f.startswith('shards-')}
            if not folders:  # not an fsdp run's folder: no checkpoint need be read
                return
            for path in glob.glob(os.path.join(glob.escape(self.out_dir), '*.pt')):
                try:
                    folders.discard(shards_named(path))
                except Exception:
                    # unreadable: one of the run's own checkpoints may name any folder, so all are
                    # kept; another .pt (a user's object, a damaged copy) names none
                    if path in own + kept_checkpoints(self.out_dir):
                        return
            for folder in folders:
                shutil.rmtree(os.path.join(self.out_dir, folder), ignore_errors=True)

    def _write_in_background(self, ckpt, names, shards_written):
        try:
            if shards_written is not None:  # every rank's shards (DCP's last step gathers them)
                shards_written.result()
            self.failure = self._write(ckpt, names)
        except BaseException as e:  # any error, not only a full disk's: the run must hear of it
            self.failure = names, ckpt['iter_num'], reason(e)

    def failed(self):
        """Why the background write failed, once it has ended (without waiting); else None."""
        if self.thread is None or self.thread.is_alive():
            return None
        return self.failure

    def wait(self):
        """Waits for the background write; None, or why it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        failure, self.failure = self.failure, None
        return failure


# -----------------------------------------------------------------------------
# random number generators

def seed_rngs(seed):
    """Seed every RNG the run draws from: python's, numpy's and torch's on every device."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CUDA's generators too


def snapshot(parts, device):
    """Every part's state and this process's RNG states, copied (on the device: no host round
    trip; a model's weights take their size again meanwhile): what restore puts back."""
    return {'parts': copy.deepcopy({name: part.state_dict() for name, part in parts.items()}),
            'rng': rng_state(device)}


def restore(parts, saved, device):
    """Every part and this process's RNGs as snapshot found them."""
    for name, part in parts.items():
        part.load_state_dict(saved['parts'][name])
    set_rng_state(saved['rng'], device)


def rng_state(device):
    """Every RNG this process draws from, as plain Python values: they pass through
    torch.load(weights_only=True) and dist.all_gather_object alike. On CUDA only the process's own
    device's generator, the one its dropout draws from: get_rng_state_all() would hold one per
    visible GPU, and fail to restore where another number is visible."""
    np_state = np.random.get_state()
    return {
        'python': random.getstate(),
        'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
        'torch': torch.get_rng_state().tolist(),
        'cuda': (torch.cuda.get_rng_state(device).tolist() if torch.device(device).type == 'cuda'
                 else None),
    }


def set_rng_state(state, device):
    random.setstate(state['python'])
    name, key, *rest = state['numpy']
    np.random.set_state((name, np.array(key, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state['torch'], dtype=torch.uint8))
    if state['cuda'] is not None:
        torch.cuda.set_rng_state(torch.tensor(state['cuda'], dtype=torch.uint8), device)
