"""
Crash-safe files and the RNG state that exact resume needs.

A checkpoint is a dict of state_dicts, tensors and primitives, written atomically (temp file in
the same folder, flush, fsync, os.replace, fsync of the folder), so a kill at any moment leaves
either the old file or the new one, never half of one. It is read with weights_only=True, so a
checkpoint file cannot run code.

FORMAT numbers the layout; this code reads its own. 4: the embedding and head have padded vocabulary rows and each
rank's RNG state holds its own CUDA device's generator only. Formats 1-3 are refused in one line: their weights
have other shapes. A config key that a checkpoint's code did not have yet takes its default on resume: each new
key defaults to the old behaviour.
"""
import os
import random

import numpy as np
import torch


FORMAT = 4


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
    if ckpt.get('format', 1) < FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {ckpt.get('format', 1)}, written before the vocabulary was "
                              f"padded (format {FORMAT}): finish that run with the honestgpt commit that started it, "
                              f"or start a new out_dir")
    return ckpt


def rng_state(device):
    """Every RNG this process draws from, as plain Python values: they pass through torch.load(weights_only=True)
    and dist.all_gather_object alike. On CUDA only the process's own device's generator, the one its dropout draws
    from: get_rng_state_all() would hold one per visible GPU, and fail to restore where another number is visible."""
    np_state = np.random.get_state()
    return {
        'python': random.getstate(),
        'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
        'torch': torch.get_rng_state().tolist(),
        'cuda': torch.cuda.get_rng_state(device).tolist() if torch.device(device).type == 'cuda' else None,
    }


def set_rng_state(state, device):
    random.setstate(state['python'])
    name, key, *rest = state['numpy']
    np.random.set_state((name, np.array(key, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state['torch'], dtype=torch.uint8))
    if state['cuda'] is not None:
        torch.cuda.set_rng_state(torch.tensor(state['cuda'], dtype=torch.uint8), device)
