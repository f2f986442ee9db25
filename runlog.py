"""
A run's records in out_dir, written by rank 0 alone: train.log (every line the run printed), metrics.jsonl (one
JSON record per event: start, train, eval, test, memory, abort, stop, ...), config.json (each key, its value and
where it came from), meta.json (command, git SHA, seed, versions, hardware, data), and TensorBoard event files and
Weights & Biases when asked. log() prints a line and keeps it; record() keeps a metrics record everywhere it goes.
Until open_run() there is nothing to keep: a run that stops at a mistake writes nothing.
"""
import glob
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

import checkpoint
import perf

LOGS = ('metrics.jsonl', 'train.log')
master = True  # rank 0: train.py sets it; the other ranks print and write nothing
files = {}  # LOGS, open for appending once open_run() has run
tensorboard = None  # a SummaryWriter when asked
wandb = None  # the wandb module when asked


def log(message, stream=sys.stdout):
    """Rank 0 prints; once the run folder is open, train.log gets the same line."""
    if master:
        print(message, file=stream, flush=True)
        if files:
            files['train.log'].write(message + '\n')
            files['train.log'].flush()


def record(entry):
    """One metrics.jsonl line (entry: a dict with 'kind' and 'step'); its numbers also go to TensorBoard and wandb
    as KIND/KEY at that step."""
    if not master:
        return
    files['metrics.jsonl'].write(json.dumps(entry) + '\n')
    files['metrics.jsonl'].flush()
    numbers = {f"{entry['kind']}/{k}": v for k, v in entry.items()
               if k not in ('step', 'time') and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if tensorboard:
        for name, value in numbers.items():
            tensorboard.add_scalar(name, value, entry['step'])
    if wandb:
        wandb.log(numbers, step=entry['step'])


def log_bytes():
    """How far each log has got: a checkpoint records it, and a resume cuts the logs back to it."""
    return {name: f.tell() for name, f in files.items()}


def open_run(out_dir, keep_bytes, config, tensorboard_log, wandb_project='', wandb_run_name=''):
    """Create out_dir (raises OSError if it cannot be written) and open the logs for appending. keep_bytes: what
    the checkpoint a run resumes from had logged; what came after is cut, since those steps are redone (None: keep
    all, a run's first session or one resumed from another folder; {}: cut all, a new run in a folder a run stopped
    before its first checkpoint left). Temp files a killed save left are dropped: never read, safe to remove."""
    global tensorboard, wandb
    os.makedirs(out_dir, exist_ok=True)
    for name in LOGS:
        path = os.path.join(out_dir, name)
        if keep_bytes is not None and os.path.exists(path):
            os.truncate(path, min(os.path.getsize(path), keep_bytes.get(name, 0)))
        files[name] = open(path, 'a')
    for path in glob.glob(os.path.join(glob.escape(out_dir), '*.tmp')):
        os.remove(path)
    if tensorboard_log:
        from torch.utils.tensorboard import SummaryWriter
        tensorboard = SummaryWriter(os.path.join(out_dir, 'tensorboard'))
    if wandb_project:
        import wandb as wandb_module
        wandb = wandb_module
        wandb.init(project=wandb_project, name=wandb_run_name, config=config, resume='allow')


def write_json(path, obj):
    checkpoint.atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + '\n').encode()))


def write_config(out_dir, config, sources, resolved):
    """config.json: each key's value and source (default, a config file, the command line, the weights), and what
    'auto' settings resolved to."""
    write_json(os.path.join(out_dir, 'config.json'),
               {k: {'value': config[k], 'source': sources[k]} for k in config} | {'resolved': resolved})


def write_meta(out_dir, run):
    """meta.json: what this session of the run is (run: seed, dtype, device, data, ...) and the code, software
    and machine it ran on."""
    sha, dirty = git_state()
    write_json(os.path.join(out_dir, 'meta.json'), {
        'command': sys.argv, 'start_time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), 'git_sha': sha, 'git_dirty': dirty,
        **run,
        'versions': {'python': platform.python_version(), 'torch': torch.__version__, 'numpy': np.__version__,
                     **{p: importlib.metadata.version(p) for p in ('tiktoken', 'safetensors')}},
        'hardware': {'platform': platform.platform(), 'cpu': perf.cpu_name(), 'cpu_count': os.cpu_count(),
                     'torch_threads': torch.get_num_threads(),
                     'cuda_devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
    })


def git_state():
    """(commit SHA, whether the work tree has uncommitted changes) of this code, or ('unknown', None)."""
    repo = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        status = subprocess.run(['git', 'status', '--porcelain'], cwd=repo, capture_output=True, text=True).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        return 'unknown', None
