"""
Token windows over a memmapped split file, and the samplers that decide which windows a rank
sees. A window is named by its start position in the split: x = tokens[s : s+T], y = tokens[s+1 : s+T+1].

- TrainSampler: each epoch, a random offset and a permutation drawn from (seed + epoch) alone,
  so every rank computes the same order, takes its own shard (perm[rank::world_size]) and any
  position can be reached in O(1) on resume. The loop, not the sampler's iterator, says what was
  consumed: loader workers prefetch ahead.
- EvalSampler: non-overlapping windows 0, T, 2T, ... that predict every token of the split
  exactly once; the last window is partial and its padding targets are ignored (-100).
"""
import atexit
import functools
import os
import random
import signal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
EMPTY_WINDOW = -1  # an eval window with no targets: pads a rank's batches without counting anything twice


class DataError(Exception):
    pass


class TokenWindows(Dataset):

    def __init__(self, path, dtype, block_size):
        self.path, self.dtype, self.block_size = path, np.dtype(dtype), block_size
        self.num_tokens = os.path.getsize(path) // self.dtype.itemsize
        self.tokens = None  # opened lazily, once per process: a memmap must not be pickled into workers

    def __getitem__(self, start):
        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=self.dtype, mode='r')
        if start == EMPTY_WINDOW:
            chunk = torch.zeros(1, dtype=torch.long)  # no targets
        else:
            chunk = torch.from_numpy(self.tokens[start:start + self.block_size + 1].astype(np.int64))
        x = torch.zeros(self.block_size, dtype=torch.long)
        y = torch.full((self.block_size,), IGNORE_INDEX, dtype=torch.long)
        x[:len(chunk) - 1] = chunk[:-1]  # short: the split's last window, or an empty one
        y[:len(chunk) - 1] = chunk[1:]
        return x, y, start


class TrainSampler(Sampler):
    """Yields batches (lists of window starts) for one rank, forever, epoch after epoch.
    Each epoch is cut to a whole number of optimizer steps (global_batch windows, all ranks), so
    an optimizer step never straddles epochs and 1 process and N ranks see the same windows per step."""

    def __init__(self, num_tokens, block_size, batch_size, global_batch, seed, rank=0, world_size=1):
        self.num_tokens, self.block_size, self.batch_size = num_tokens, block_size, batch_size
        self.global_batch, self.seed, self.rank, self.world_size = global_batch, seed, rank, world_size
        fewest_windows = (num_tokens - block_size) // block_size  # with the largest offset
        if fewest_windows < global_batch:
            raise DataError(f"the train split ({num_tokens} tokens) holds {max(fewest_windows, 0)} windows of "
                            f"block_size={block_size}, fewer than one optimizer step needs ({global_batch} = "
                            f"batch_size x gradient_accumulation_steps): lower those or use more text")
        self.epoch, self.position = 0, 0  # the next batch the loop will consume

    def _epoch_layout(self, epoch):
        g = torch.Generator().manual_seed(self.seed + epoch)
        offset = int(torch.randint(self.block_size, (1,), generator=g))  # new window boundaries each epoch
        n = (self.num_tokens - 1 - offset) // self.block_size
        return g, offset, n, n // self.global_batch * self.global_batch  # windows kept this epoch

    def epoch_batches(self, epoch):
        g, offset, n, kept = self._epoch_layout(epoch)
        perm = torch.randperm(n, generator=g)[:kept]
        starts = offset + perm[self.rank::self.world_size] * self.block_size
        return starts.view(-1, self.batch_size).tolist()

    def __iter__(self):
        epoch, position = self.epoch, self.position
        while True:
            yield from self.epoch_batches(epoch)[position:]
            epoch, position = epoch + 1, 0

    @functools.cache  # asked once per micro-batch: draw the epoch's offset once
    def batches_in_epoch(self, epoch):
        return self._epoch_layout(epoch)[3] // (self.world_size * self.batch_size)

    def mark_consumed(self):
        self.position += 1
        if self.position == self.batches_in_epoch(self.epoch):
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self):
        # position in windows consumed by all ranks: a resume on another number of ranks continues at the same place
        return {'epoch': self.epoch, 'position': self.position * self.batch_size * self.world_size}

    def load_state_dict(self, state):
        self.epoch, self.position = state['epoch'], state['position'] // (self.batch_size * self.world_size)


class EvalSampler(Sampler):
    """Batches of window starts covering the split once; max_windows > 0 keeps that many windows
    evenly spread over the split (the same ones at every evaluation). Rank r takes windows r::world_size.
    equal_batches gives every rank the same batches count and sizes (sharded models need it) by adding
    empty windows (start -1: no targets), never by repeating real ones."""

    def __init__(self, num_tokens, block_size, batch_size, max_windows=0, rank=0, world_size=1, equal_batches=False):
        if num_tokens < 2:
            raise DataError(f"a split of {num_tokens} token(s) has nothing to predict: use more text")
        starts = torch.arange(0, num_tokens - 1, block_size)
        if 0 < max_windows < len(starts):
            starts = starts[torch.linspace(0, len(starts) - 1, max_windows).round().long().unique()]
        shard = starts[rank::world_size]
        if equal_batches:
            per_rank = -(-len(starts) // world_size)
            padded_len = -(-per_rank // batch_size) * batch_size
            shard = torch.cat([shard, torch.full((padded_len - len(shard),), EMPTY_WINDOW)])
        self.batches = shard.split(batch_size)

    def __iter__(self):
        return (b.tolist() for b in self.batches)

    def __len__(self):
        return len(self.batches)


def seed_worker(worker_id):
    # Ctrl-C reaches the whole process group, and torchrun passes SIGTERM to it: the training process decides when
    # to stop (after the step under way) and then shuts its workers down; a worker that died first would fail that step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # DataLoader seeds torch in each worker from the loader's generator; numpy and random follow it
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def make_loader(dataset, batch_sampler, num_workers, seed, pin_memory):
    # the loader's own generator: creating an iterator must not draw from the global RNG (dropout's)
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers, pin_memory=pin_memory,
                      worker_init_fn=seed_worker,
                      generator=torch.Generator().manual_seed(seed))


def endless_batches(dataset, batch_sampler, num_workers, seed, pin_memory):
    """An iterator over a TrainSampler's batches. Its workers ignore SIGINT and SIGTERM (seed_worker), so at exit
    they are shut down the DataLoader's own way, before multiprocessing would terminate() them: atexit runs the
    last registered first."""
    batches = iter(make_loader(dataset, batch_sampler, num_workers, seed, pin_memory))
    if num_workers > 0:
        atexit.register(batches._shutdown_workers)
    return batches
