"""
What a training run may refuse, and each 'auto' it resolves, settled before anything is built or
written, so that train.py's setup reads as the recipe. settings() checks the command's settings;
start() finds the weights the run starts from (a checkpoint, GPT-2's or none), checks that a resume
continues the run it names, that out_dir holds no other run or dataset and that the model fits the
device, resolves the dtypes, measures the peak FLOP/s MFU is measured against and describes the
session for meta.json. A refusal is one line naming the problem and the fix, exit code 2
(exits.check); a run that stops here has written nothing.
"""
import dataclasses
import json
import os
import sys

import torch

import checkpoint
import datafiles
import evaluate
import hf
import perf
import precision
import runlog
import tokenizer
from configurator import ConfigError, configure
from distributed import busy_warning, gather
from exits import check
from model import GPT, GPTConfig
from optim import OPTIMIZERS
from runlog import log

CHOICES = {'dtype': ('auto', *precision.DTYPES), 'muon_dtype': ('auto', 'float32', 'bfloat16'),
           'backend': ('auto', 'nccl', 'gloo'), 'parallel': ('ddp', 'fsdp'),
           'optimizer': OPTIMIZERS, 'lr_schedule': ('cosine', 'wsd'),
           'best_by': ('val_loss', 'acc_norm')}
AT_LEAST_ONE = ('eval_interval', 'log_interval', 'gradient_accumulation_steps', 'batch_size',
                'max_iters', 'max_consecutive_skips', 'init_scale')  # every other number: >= 0


# what only training reads: eval_only evaluates the starting weights, takes no step and writes
# nothing
TRAINING_KEYS = ('max_iters', 'eval_interval', 'log_interval', 'always_save_checkpoint',
                 'checkpoint_interval', 'keep_checkpoints', 'async_save', 'test_eval',
                 'sample_tokens', 'write_report', 'wandb_log', 'tensorboard_log', 'cost_per_hour',
                 'profile_iter', 'num_workers', 'dropout', 'learning_rate', 'muon_lr',
                 'muon_momentum', 'weight_decay', 'beta1', 'beta2', 'grad_clip', 'layer_lr_decay',
                 'decay_lr', 'lr_schedule', 'wsd_decay_frac', 'warmup_iters', 'lr_decay_iters',
                 'min_lr', 'patience', 'overfit_one_batch', 'smoke_steps',
                 'activation_checkpointing')


def unread(c, ddp=True):
    """{key: (the setting that reads it, the flag that sets that)} of the keys c never reads; ddp:
    whether it runs under torchrun (a resume compares as if it did)."""
    keys = {}
    if not ddp:  # one process: no process group (parallel, which a resume compares, is kept)
        keys['backend'] = ('torchrun', 'torchrun --standalone --nproc_per_node=N')
    if c['eval_only']:
        keys |= dict.fromkeys(TRAINING_KEYS, ('training', '--eval_only=False'))
    if c['optimizer'] != 'muon':
        keys |= dict.fromkeys(('muon_lr', 'muon_momentum', 'muon_dtype'),
                              ("optimizer='muon'", '--optimizer=muon'))
    if not c['decay_lr']:  # a constant rate
        keys |= dict.fromkeys(('lr_schedule', 'wsd_decay_frac', 'warmup_iters', 'lr_decay_iters',
                               'min_lr'), ('decay_lr', '--decay_lr=True'))
    elif c['lr_schedule'] != 'wsd':
        keys['wsd_decay_frac'] = ("lr_schedule='wsd'", '--lr_schedule=wsd')
    if c['dtype'] in ('float32', 'bfloat16'):  # 'auto' may be float16 (a GPU without bfloat16)
        keys |= dict.fromkeys(('init_scale', 'max_consecutive_skips'),
                              ("dtype='float16'", '--dtype=float16'))
    if not c['wandb_log']:
        keys |= dict.fromkeys(('wandb_project', 'wandb_run_name'),
                              ('wandb_log', '--wandb_log=True'))
    if not c['eval_tasks']:
        keys['eval_tasks_examples'] = ('eval_tasks', '--eval_tasks=TASK.jsonl')
    return keys


def settings(defaults, argv, world_size, ddp):
    """(config, where each key came from, GPTConfig) of the command line over train.py's defaults,
    with every setting checked on its own and against the others; ddp: under torchrun."""
    try:
        config, sources = configure(defaults, argv, CHOICES, dict.fromkeys(AT_LEAST_ONE, 1))
        model_config = GPTConfig(**{f.name: config[f.name] for f in dataclasses.fields(GPTConfig)
                                    if f.name in config})
    except (ConfigError, ValueError) as e:  # the model's shape too
        check(False, e)
    c = config
    cpus = os.cpu_count() or 1  # each worker a process: thousands of them exhaust the memory
    check(c['num_workers'] <= cpus, f"num_workers={c['num_workers']} is more than this machine's "
          f"{cpus} CPUs: use at most {cpus} (0 loads in the training process)")
    # a path that is not there: else the line listed what it is meant to be
    a_path = os.sep in c['init_from'] or c['init_from'].endswith('.safetensors')
    check(c['init_from'] in ('scratch', 'resume', 'auto') or hf.is_source(c['init_from']),
          f"init_from='{c['init_from']}'{' does not exist' if a_path else ''}: use 'scratch', "
          f"'resume', 'auto', a GPT-2 name ({', '.join(hf.GPT2_NAMES)}) or the path of a Hugging "
          f"Face model folder or .safetensors file")
    check(not c['resume_from'] or c['init_from'] in ('resume', 'auto'),
          f"resume_from='{c['resume_from']}' is read only by init_from=resume or auto, and "
          f"init_from='{c['init_from']}' ignores it: add --init_from=resume, or leave resume_from "
          f"out")
    check(c['best_by'] == 'val_loss' or c['eval_tasks'],
          "best_by='acc_norm' needs eval_tasks: name the task files")
    check(not c['decay_lr'] or c['lr_decay_iters'] > c['warmup_iters'],
          f"lr_decay_iters={c['lr_decay_iters']} must exceed warmup_iters={c['warmup_iters']}")
    # learning_rate=0 trains nothing whatever min_lr is: train.py's schedule then stays at 0
    check(not c['decay_lr'] or c['learning_rate'] == 0 or c['min_lr'] <= c['learning_rate'],
          f"min_lr={c['min_lr']} is above learning_rate={c['learning_rate']}: the decay would "
          f"raise the rate to it: use a min_lr of at most learning_rate, or decay_lr=False")
    check(0 < c['wsd_decay_frac'] <= 1, f"wsd_decay_frac={c['wsd_decay_frac']} must be in (0, 1]")
    check(0 < c['layer_lr_decay'] <= 1,
          f"layer_lr_decay={c['layer_lr_decay']} must be in (0, 1]: 1 is off")
    check(c['profile_iter'] <= c['max_iters'],
          f"profile_iter={c['profile_iter']} is past max_iters={c['max_iters']}, so no iteration "
          f"would be profiled: use one of 1 to {c['max_iters']} (0: off)")
    check(c['smoke_steps'] != 1, "smoke_steps=1 compares a loss with itself (each step's loss "
          "comes before its update): use 0 (off) or at least 2")
    check(c['ema_decay'] < 1, f"ema_decay={c['ema_decay']} must be in [0, 1): 0 is off, 1 would "
          f"never move from the initial weights")
    betas = c['beta1'], c['beta2'], c['muon_momentum']
    check(all(0 <= b < 1 for b in betas),
          f"beta1={betas[0]}, beta2={betas[1]} and muon_momentum={betas[2]} must each be in [0, 1)")
    # numpy's seed is below 2**32, and checkpoint.seed_rngs seeds each rank with seed + rank
    check(c['seed'] + world_size <= 2**32,
          f"seed={c['seed']} is too large: numpy's RNG takes seeds below 2**32, and rank r seeds "
          f"seed + r: use a seed of at most {2**32 - world_size}")
    accum = c['gradient_accumulation_steps']
    check(accum % world_size == 0,
          f"gradient_accumulation_steps={accum} is not divisible by the {world_size} processes: "
          f"make it a multiple of {world_size} so the global batch stays the same")
    check(not (ddp and c['parallel'] == 'fsdp' and c['fit_batch']),
          "fit_batch tries each rank's forward alone, and under parallel='fsdp' a forward needs "
          "every rank: set batch_size by hand, or use parallel='ddp'")
    # torch 2.13's Muon steps FSDP2's sharded matrices without an error, but not to the update of
    # the whole matrix
    check(not (ddp and c['parallel'] == 'fsdp' and c['optimizer'] == 'muon'),
          "optimizer='muon' does not work with parallel='fsdp' (Muon orthogonalizes whole "
          "matrices, FSDP shards them): use parallel='ddp' or optimizer='adamw'")
    # a key typed on the command line that the run never reads: a sweep over muon_lr with
    # optimizer='adamw' trains one run again and again. Said, not refused: a command built from a
    # base list may carry one (and a config file may serve several settings: not said)
    for key, (reader, flag) in unread(c, ddp).items():
        if sources[key] == 'command line':
            log(f"warning: {key}={c[key]!r} is read only with {reader}, so this run ignores it: "
                f"add {flag}, or leave {key} out")
    missing = runlog.missing_package(c)  # tensorboard_log's or wandb_log's
    check(not missing, missing)
    return config, sources, model_config


@dataclasses.dataclass
class Start:
    """Where a run starts, and what it settled on the way."""
    tasks: dict  # evaluate.read_tasks' of eval_tasks
    tasks_digest: str  # evaluate.tasks_digest's of them: every checkpoint keeps it
    pretrained: dict | None  # {'init_from', 'weights', 'sha256'} of a GPT-2 start, on resume too
    pretrained_state: dict | None  # GPT-2's weights, for a start from them
    model_config: GPTConfig  # the vocabulary's size, and the shape GPT-2's weights set
    dtype: str
    muon_dtype: str
    peak_flops: float  # per process, for MFU (NaN on ranks other than 0, which log nothing)
    session: dict  # what this session is, for meta.json and its first lines
    eval_windows: int  # per split and evaluation (0: all), as the run that a resume continues had


def resume_point(c):
    """Whether the run resumes, the checkpoint it continues (or would: init_from='auto') and, on
    resume, its contents; out_dir checked for it. Before the data opens: a refused run prepares no
    dataset first."""
    last = os.path.join(c['out_dir'], 'last.pt')
    if c['init_from'] == 'auto':  # the command a scheduler repeats: out_dir's own last.pt once
        # there is one, else the resume_from it was given (which must exist), else scratch
        ckpt_path = last if os.path.exists(last) else c['resume_from'] or last
        resuming = os.path.exists(last) or bool(c['resume_from'])
    else:
        ckpt_path = c['resume_from'] or last
        resuming = c['init_from'] == 'resume'
    ckpt = None
    if resuming:
        try:
            ckpt = checkpoint.load(ckpt_path, resumable=True)
        except checkpoint.CheckpointError as e:
            check(False, e)
    # a checkpoint of another folder into an out_dir of its own run would mix the two runs' logs
    elsewhere = resuming and (os.path.realpath(os.path.dirname(os.path.abspath(ckpt_path)))
                              != os.path.realpath(c['out_dir']))
    if not c['eval_only']:  # which writes nothing
        check_out_dir(c['out_dir'], (resuming or c['init_from'] == 'auto') and not elsewhere,
                      os.path.join(c['data_dir'], c['dataset']))
        # rank 0's, whose runlog.start takes the lock once all is built (ranks looking at once
        # would each see the others' look)
        busy = runlog.in_use(c['out_dir']) if runlog.master else ''
        check(not busy, busy)
    return resuming, ckpt_path, ckpt


def start(config, sources, defaults, model_config, resume, data_meta, dataset_id, splits, device,
          sharded, cpus):
    """The run's Start: the same data on every rank; eval_tasks read; its checkpoint (resume:
    resume_point's) or GPT-2's weights, checked against the settings and the data; GPT-2's shape
    written into config and sources; dtype and muon_dtype resolved; rank 0's peak FLOP/s; the
    session's record (cpus: distributed.cpu_use's, taken before the run's own work)."""
    c = config
    dataset_ids = gather(dataset_id)  # every rank's
    check(dataset_ids.count(dataset_id) == len(dataset_ids),
          f"the ranks see different data in {c['data_dir']}/{c['dataset']}: every node needs the "
          f"same prepared dataset (shared storage, or the same files on each)")
    tasks = {}
    try:  # training needs no tokenizer: the tasks and the end-of-run sample do
        if c['eval_tasks']:
            tok = tokenizer.load(data_meta['tokenizer'])
            tasks = evaluate.read_tasks(c['eval_tasks'], tok.encode, c['block_size'],
                                        c['eval_tasks_examples'], tok.unknown)
    except (evaluate.TaskError, tokenizer.TokenizerError) as e:
        check(False, e)
    tasks_digest = evaluate.tasks_digest(tasks)
    resuming, ckpt_path, ckpt = resume
    pretrained = ckpt['pretrained'] if resuming else None
    pretrained_state = None
    if not resuming and c['init_from'] not in ('scratch', 'auto'):
        try:
            pretrained_args, pretrained_state, pretrained = hf.load_gpt2(
                c['init_from'], c['block_size'], data_meta['vocab_size'])
        except hf.HFError as e:
            check(False, e)
    model_config = dataclasses.replace(model_config, vocab_size=data_meta['vocab_size'])
    if pretrained:  # the shape comes from the weights, on resume too; config.json records it
        shape = {k: (ckpt['model_args'] if resuming else pretrained_args)[k] for k in hf.SHAPE_KEYS}
        config.update(shape)
        sources.update(dict.fromkeys(shape, f"weights of {pretrained['init_from']}"))
        model_config = dataclasses.replace(model_config, **shape)
        lacking = hf.cannot_hold(model_config)
        check(not lacking,
              f"GPT-2's weights cannot have {', '.join(lacking)}: leave those keys at the defaults")
    check_fits(model_config, device, sharded)
    # the micro-batches its run found, not the command's: eval_only, which takes no step, may
    # evaluate in others
    fitted = c['fit_batch'] and not c['eval_only']
    eval_windows = c['eval_iters'] * c['batch_size']
    if resuming and fitted:
        ran = ckpt['config']['batch_size'] * ckpt['config']['gradient_accumulation_steps']
        asked = c['batch_size'] * c['gradient_accumulation_steps']
        check(asked == ran, f"{ckpt_path} took {ran} windows a step (batch_size x "
              f"gradient_accumulation_steps), this command {asked}: use the run's, or a new "
              f"out_dir")
        # the val windows best.pt is chosen over: eval_iters batches of the batch_size its first
        # command asked for, which this one may split otherwise, and verify.py's replay, taking
        # the found one, does (a checkpoint older than eval_windows lacks them)
        if ckpt.get('eval_windows') and ckpt['config']['eval_iters']:
            eval_windows = c['eval_iters'] * (ckpt['eval_windows'] // ckpt['config']['eval_iters'])
        for key in ('batch_size', 'gradient_accumulation_steps'):
            config[key] = ckpt['config'][key]
            sources[key] = f"fit_batch, as the run in {ckpt_path} found it"
    if resuming:
        # a key neither run reads (muon_dtype under AdamW) changes nothing: it may come or go
        unread_by_both = unread(config).keys() & unread(defaults | ckpt['config']).keys()
        why = (checkpoint.why_not_resume(ckpt, config, defaults, unread_by_both, tasks_digest)
               or datafiles.data_change(ckpt['dataset'], dataset_id, splits))
        check(not why,
              f"{ckpt_path} {why}: use the checkpoint's settings and data, or a new out_dir")
        # the same parallel='fsdp' run, resumed on one process, wrote its whole state: DCP's load
        # fills shards, and a whole state would need translating into them (not built)
        check(not sharded or 'shards' in ckpt,
              f"{ckpt_path} holds the whole state, as one process writes it: parallel='fsdp' on "
              f"several processes resumes the shards that such a run writes: resume this one on "
              f"one process")
        # fit_batch: settings() checked the command's count, not the one the run found, which
        # rounded down could give a rank no micro-batch
        if fitted:
            found = config['gradient_accumulation_steps']
            processes = (torch.distributed.get_world_size() if torch.distributed.is_initialized()
                         else 1)
            check(found % processes == 0,
                  f"{ckpt_path}'s run found micro-batches of {config['batch_size']}, {found} a "
                  f"step (fit_batch), which {processes} processes cannot share: resume on a "
                  f"number of processes that divides {found}")
        # auto, the command a scheduler repeats: run again on its finished run (at max_iters, or
        # out of patience), it redoes the end (the test split, the sample, the report) a kill may
        # have cut short
        auto = c['init_from'] == 'auto'
        check(ckpt['iter_num'] < c['max_iters'] or c['eval_only']  # which takes no step
              or (auto and ckpt['iter_num'] == c['max_iters']),
              f"{ckpt_path} is at iteration {ckpt['iter_num']}: max_iters={c['max_iters']} "
              f"leaves nothing to do: raise max_iters (README, Resume, says what the learning rate "
              f"does then)")
        progress = checkpoint.Progress(evals_since_best=ckpt.get('evals_since_best', 0))
        check(auto or c['eval_only'] or not progress.out_of_patience(c['patience']),
              f"{ckpt_path} is at iteration {ckpt['iter_num']}, {progress.evals_since_best} "
              f"evaluations after its best: patience={c['patience']} stops the run there, leaving "
              f"nothing to do: raise patience")

    if c['eval_iters'] == 0:  # train's loss too, a mere check of the fit: on large data, hours
        windows = {s: -(-(splits[s].num_tokens - 1) // c['block_size']) for s in ('train', 'val')}
        log(f"eval_iters=0: every evaluation reads the train split whole ({windows['train']:,} "
            f"windows) and val ({windows['val']:,}); eval_iters=N reads N batches of each")
    resumed = (ckpt_path, ckpt) if resuming else None
    settled = dtypes(c, model_config, resumed, device, sharded)
    dtype, _, muon_dtype, _ = settled  # and how each was chosen, for the session's record
    peak_flops, peak_how = float('nan'), ''
    # MFU's denominator: a known GPU's datasheet, else measured (once a machine); eval_only takes
    # no step to divide
    if runlog.master and not c['eval_only']:
        # a CPU that other work keeps busy measures low: not cached
        busy = device == 'cpu' and bool(busy_warning(torch.get_num_threads(), cpus))
        peak_flops, peak_how = perf.peak_flops(
            device, precision.DTYPES[dtype], busy=busy,
            announce=lambda: log("measuring this machine's peak FLOP/s for MFU (once per machine "
                                 "and dtype: cached)"))
    session = session_record(c, sources, defaults, (data_meta, dataset_id), device, cpus, resumed,
                             pretrained, settled, tasks_digest)
    session['peak_flops'] = {'per_process': peak_flops, 'how': peak_how}
    return Start(tasks, tasks_digest, pretrained, pretrained_state, model_config, dtype,
                 muon_dtype, peak_flops, session, eval_windows)


def check_out_dir(out_dir, may_hold_a_checkpoint, dataset_dir):
    """Refuses an out_dir that cannot be a run's folder: none named, a file (or under one), the
    dataset's folder or one in it (prepare.py replaces that folder whole), or a folder that holds a
    checkpoint (unless the run may resume it), a dataset (the run's meta.json would replace the
    dataset's) or another program's config.json (a Hugging Face model's: the run's would replace
    it)."""
    check(out_dir, "out_dir is empty: name a folder (a new one is created)")
    above = os.path.abspath(out_dir)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    what = 'a file' if above == os.path.abspath(out_dir) else f"under a file, {above}"
    check(os.path.isdir(above), f"out_dir '{out_dir}' is {what}: name a folder (a new one is "
                                f"created)")
    inside = os.path.realpath(out_dir) + os.sep
    check(not inside.startswith(os.path.realpath(dataset_dir) + os.sep),
          f"out_dir '{out_dir}' is in the dataset's folder {dataset_dir}, which prepare.py "
          f"replaces whole: use a folder of its own")
    holds_one = any(os.path.exists(os.path.join(out_dir, f)) for f in ('last.pt', 'best.pt'))
    check(may_hold_a_checkpoint or not holds_one,
          f"out_dir '{out_dir}' already holds a checkpoint: resume it (init_from=resume or auto), "
          f"or use another")
    files = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    check(not any(datafiles.SHARD_NAME.search(f) or f == datafiles.FINGERPRINTS for f in files),
          f"out_dir '{out_dir}' holds a dataset (its shards or {datafiles.FINGERPRINTS}), whose "
          f"meta.json a run would overwrite: use another out_dir")
    check('config.json' not in files or runs_config(os.path.join(out_dir, 'config.json')),
          f"out_dir '{out_dir}' holds a config.json that is not a train.py run's (a Hugging Face "
          f"model's?), which the run's would replace: use another out_dir")


def runs_config(path):
    """Whether the config.json at path is a train.py run's (of any commit): it names out_dir."""
    try:
        with open(path) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(settings, dict) and 'out_dir' in settings


def check_fits(model_config, device, sharded):
    """Refuses a model no device holds, which would fail at its first allocation with a traceback:
    its float32 weights and gradients alone (an fsdp rank its share), fewer bytes than any training
    step needs, against the device's memory."""
    # the blocks are alike: one is built and counted n_layer times (the meta device built 3,000 of
    # them in 20 s, a typo's 100,000 in minutes)
    with torch.device('meta'):
        one_block = GPT(dataclasses.replace(model_config, n_layer=1))
    block_params = sum(p.numel() for p in one_block.blocks[0].parameters())
    num_params = (sum(p.numel() for p in one_block.parameters())
                  + (model_config.n_layer - 1) * block_params)
    ranks = torch.distributed.get_world_size() if sharded else 1
    need, held = 8 * num_params / ranks, perf.device_memory(device)
    check(need <= held,
          f"the model's {num_params:,} parameters need {need / 2**30:,.1f} GiB for their float32 "
          f"weights and gradients alone{' per rank' if sharded else ''}, more than {device}'s "
          f"{held / 2**30:,.1f} GiB: make it smaller (n_layer, n_embd; the dataset's vocab_size is "
          f"{model_config.vocab_size})")


def session_record(config, sources, defaults, data, device, cpus, resumed, pretrained, settled,
                   tasks):
    """What this session is, for meta.json and its first lines: its seed, dtypes (settled: dtypes()'
    four, each with how 'auto' chose it), device, processes and CPUs (cpus: distributed.cpu_use's),
    its start (GPT-2's weights; the checkpoint resumed, resumed: (path, checkpoint), and the
    settings the command changes; tasks: evaluate.tasks_digest's) and its data (data: the
    dataset's meta and id)."""
    c, (data_meta, dataset_id) = config, data
    dtype, dtype_how, muon_dtype, muon_dtype_how = settled
    ddp = torch.distributed.is_initialized()
    return {
        'seed': c['seed'], 'dtype': dtype, 'dtype_choice': dtype_how,
        'muon_dtype': {'dtype': muon_dtype, **muon_dtype_how} if muon_dtype_how else None,
        'device': device, 'world_size': torch.distributed.get_world_size() if ddp else 1,
        'cpus': cpus, 'backend': torch.distributed.get_backend() if ddp else None,
        'pretrained': pretrained,
        'resumed_from': f"{resumed[0]} at iteration {resumed[1]['iter_num']}" if resumed else None,
        # a resume says what it changes: a key left out of the command can change the schedule
        'changed_on_resume': {k: [old, new, sources[k]] for k, (old, new)
                              in checkpoint.changed_settings(resumed[1], config, defaults,
                                                             tasks).items()
                              if k not in ('init_from', 'resume_from')} if resumed else None,
        'dataset': {**dataset_id, 'tokenizer': data_meta['tokenizer']['kind'],
                    'dir': c['data_dir'], 'split_rule': data_meta.get('split_rule', '')}}


def dtypes(config, model_config, resumed, device, sharded):
    """(dtype, how it was chosen, muon_dtype, how): as set; or kept from the run a resume continues
    (resumed: (its path, its checkpoint)); or for 'auto' rank 0's choice, for every rank."""
    c = config
    # 'auto' there: never chosen (muon_dtype of an AdamW run, which eval_only may evaluate as Muon)
    kept = {key: (resumed[0], resumed[1][key]) if resumed and resumed[1][key] != 'auto' else None
            for key in ('dtype', 'muon_dtype')}
    if c['dtype'] == 'auto' and not resumed:
        log("choosing the dtype for dtype='auto'")
    try:
        dtype, dtype_how = precision.resolve_dtype(c['dtype'], device,
                                                   dataclasses.asdict(model_config),
                                                   c['batch_size'], kept['dtype'])
    except ValueError as e:  # HONESTGPT_AUTO_DTYPE names no dtype
        check(False, e)
    check(not (sharded and dtype == 'float16'), "parallel='fsdp' trains in float32 or bfloat16, "
          "not float16 (dtype='auto' picks it below compute capability 8.0): use dtype=bfloat16, "
          "or float32 on such a GPU")
    if dtype == 'float16':
        warning = precision.float16_warning(device, model_config, c['batch_size'])
        if warning:
            log(warning, sys.stderr)
    muon_dtype, muon_dtype_how = c['muon_dtype'], None
    if c['optimizer'] == 'muon':
        if muon_dtype == 'auto' and not resumed:
            log("choosing Muon's Newton-Schulz dtype for muon_dtype='auto'")
        with torch.device('meta'):  # the shapes of Muon's matrices, without their memory
            shapes = [p.shape for _, p in GPT(model_config).muon_params()]
        muon_dtype, muon_dtype_how = precision.resolve(
            muon_dtype, lambda: precision.auto_muon_dtype(device, shapes), kept['muon_dtype'])
    return dtype, dtype_how, muon_dtype, muon_dtype_how
