"""
Crash-safe files and the RNG state that exact resume needs.

A checkpoint is a dict of state_dicts, tensors and primitives, written atomically (temp file in
the same folder, flush, fsync, os.replace, fsync of the folder), so a kill at any moment leaves
either the old file or the new one, never half of one. It is read with weights_only=True, so a
checkpoint file cannot run code.

FORMAT numbers the layout. 1: the first; 2: adds 'format', 'train_seconds', 'dtype' (what 'auto' resolved to) and 'pretrained';
3: 'optimizer' and 'scheduler' are lists, one state per optimizer (AdamW, then Muon if used). A config key that a
checkpoint's code did not have yet takes its default on resume: each new key defaults to the old behaviour.
"""
import os
import random

import numpy as np
import torch


FORMAT = 3


class CheckpointError(Exception):
    pass


def atomic_write(path, write):
    """write(f) fills a binary file object; path appears complete or not at all."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = path + '.tmp'  # same folder: os.replace is atomic only within one filesystem
    with open(tmp, 'wb') as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(folder, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(obj, path):
    atomic_write(path, lambda f: torch.save(obj, f))


def load(path):
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist, so there is nothing to resume (a run stopped before its "
                              f"first checkpoint starts again with init_from=scratch or auto): check out_dir / resume_from")
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated or corrupt: {first_line}): "
                              f"resume from another file with resume_from=PATH, or start a new out_dir")
    if ckpt.get('format', 1) > FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {ckpt['format']}, newer than this code's {FORMAT}: "
                              f"update honestgpt (git pull) to resume it")
    return ckpt


def rng_state():
    """Every RNG in play on this process, as plain Python values: they pass through
    torch.load(weights_only=True) and dist.all_gather_object alike."""
    np_state = np.random.get_state()
    return {
        'python': random.getstate(),
        'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
        'torch': torch.get_rng_state().tolist(),
        'cuda': [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state):
    random.setstate(state['python'])
    name, key, *rest = state['numpy']
    np.random.set_state((name, np.array(key, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state['torch'], dtype=torch.uint8))
    if state['cuda']:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state['cuda']])
