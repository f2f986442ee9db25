"""
Token windows over a split's shards, and the samplers that decide which windows a rank sees.

- A dataset is a folder with meta.json and shards in llm.c's format named NAME_SPLIT_000000.bin
  (modded-nanogpt's names), as prepare.py writes them or as llm.c and modded-nanogpt publish them,
  or a glob of such files: datafiles.py finds and checks them.
- TokenWindows: a split's shards, read as one token stream. A window is named by its start position
  in that stream: x = tokens[s : s+T], y = tokens[s+1 : s+T+1], across a shard boundary if it falls
  there.
- TrainSampler: each epoch, a random offset and a permutation drawn from (seed + epoch) alone,
  so every rank computes the same order, takes its own shard (perm[rank::world_size]) and any
  position can be reached in O(1) on resume. The loop, not the sampler's iterator, says what was
  consumed: loader workers prefetch ahead.
- EvalSampler: non-overlapping windows 0, T, 2T, ... that predict every token of the split
  exactly once; the last window is partial and its padding targets are ignored (-100), as are
  those of the empty windows that fill the last batch.
"""
import atexit
import functools
import os
import random
import signal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from datafiles import DataError, fingerprints, open_dataset, prepare_once, read_shard_header
from distributed import gather
from prepare import SHARD, PrepareError

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
# an eval window with no targets: pads a rank's batches without counting anything twice
EMPTY_WINDOW = -1


def open_splits(data_dir, dataset, block_size, first_on_node=True):
    """(meta, {split: TokenWindows}, identity) of a run's dataset; identity is what the ranks
    compare and a checkpoint records (its name, source, vocabulary, tokenizer and every shard's
    fingerprint). The first process of each node prepares the default dataset on first use and
    hashes new shards while the others wait. Where any rank cannot open the data, every rank
    raises DataError (agree): none is left waiting in a collective that rank never reaches."""
    problem = None
    if first_on_node:
        try:
            if dataset == 'pystdlib_char':
                prepare_once(data_dir, dataset)
            fingerprints([p for paths in open_dataset(data_dir, dataset)[1].values()
                          for p in paths])
        except (DataError, PrepareError) as e:
            problem = str(e)
    agree(problem)  # the others wait for the hashes here
    try:
        meta, splits = open_windows(data_dir, dataset, block_size)
    except DataError as e:
        problem = str(e)
    agree(problem)
    identity = {'name': meta['name'], 'source_sha256': meta.get('source_sha256'),
                'vocab_size': meta['vocab_size'], 'tokenizer': meta['tokenizer'],
                # the documents of each split of prepare.py's (sample.empty_prompt); of a
                # hand-written meta.json's (llm.c's shards): unknown
                'documents': ({s: v.get('documents') for s, v in meta['splits'].items()}
                              if 'source_sha256' in meta else {}),
                'shards': [shard for s in splits.values() for shard in s.shards]}
    return meta, splits, identity


def agree(problem):
    """Every rank's problem opening the data (None: none), gathered: if any rank has one, a
    DataError on every rank, with its own or the first failed rank's."""
    failed = [(rank, p) for rank, p in enumerate(gather(problem)) if p]
    if failed:
        raise DataError(problem or f"rank {failed[0][0]} cannot open the data: {failed[0][1]}")


def open_windows(data_dir, dataset, block_size):
    """(meta, {split: TokenWindows}) of a dataset, each split checked for what the model needs."""
    meta, shard_paths = open_dataset(data_dir, dataset)
    splits = {s: TokenWindows(paths, block_size) for s, paths in shard_paths.items()}
    for split, windows in splits.items():
        if windows.num_tokens < 2:
            raise DataError(f"dataset '{dataset}' has a {split} split of {windows.num_tokens} "
                            f"token(s), nothing to predict: prepare it from more text")
        # an id past the vocabulary would fail in the model, or on a GPU assert
        for path, largest in zip(windows.paths, windows.largest_ids):
            if largest >= meta['vocab_size']:
                raise DataError(f"{path} holds token id {largest} but the dataset's meta.json has "
                                f"vocab_size {meta['vocab_size']}: set it to the tokenizer's "
                                f"vocabulary size")
    return meta, splits


class TokenWindows(Dataset):
    """A split's shards read as one token stream. Shard i holds stream positions [offsets[i],
    offsets[i+1])."""

    def __init__(self, paths, block_size):
        self.paths, self.block_size = list(paths), block_size
        headers = [read_shard_header(p) for p in self.paths]
        if len({dtype for dtype, _ in headers}) > 1:
            raise DataError(f"the shards of {os.path.dirname(self.paths[0])} mix uint16 and uint32 "
                            f"tokens: prepare them again")
        self.dtype = headers[0][0]
        facts = fingerprints(self.paths)  # {name: [sha256, largest token id]}
        names = [os.path.basename(p) for p in self.paths]
        self.shards = [[name, n, facts[name][0]] for name, (_, n) in zip(names, headers)]
        self.largest_ids = [facts[name][1] for name in names]
        self.offsets = np.cumsum([0] + [n for _, n in headers])
        self.num_tokens = int(self.offsets[-1])
        # what every read checks: a shard truncated or rewritten under a running job fails the read,
        # not the model
        self.stats = [(s.st_size, s.st_mtime_ns) for s in map(os.stat, self.paths)]

    def read(self, start, stop):
        """Tokens [start, stop) of the stream: one slice of a shard, or pieces of several across
        boundaries."""
        pieces = []
        while start < stop:
            # empty shards are never picked
            i = int(np.searchsorted(self.offsets, start, side='right')) - 1
            end = min(stop, int(self.offsets[i + 1]))
            # opened for this read alone: a file kept open per shard would exhaust the descriptor
            # limit (often 1024) on a dataset of a thousand shards; open, fstat, pread and close
            # cost ~6 us a window (docs/design.md)
            fd = os.open(self.paths[i], os.O_RDONLY)
            try:
                stat = os.fstat(fd)
                if (stat.st_size, stat.st_mtime_ns) != self.stats[i]:
                    raise DataError(f"{self.paths[i]} changed while the run was reading it (its "
                                    f"size or modification time is not what it was when the run "
                                    f"opened it)")
                pieces.append(SHARD.read(fd, self.dtype, int(start - self.offsets[i]), end - start))
            finally:
                os.close(fd)
            start = end
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getitem__(self, start):
        if start == EMPTY_WINDOW:
            chunk = torch.zeros(1, dtype=torch.long)  # no targets
        else:
            chunk = torch.from_numpy(self.read(start, min(start + self.block_size + 1,
                                                          self.num_tokens))
                                     .astype(np.int64))
        x = torch.zeros(self.block_size, dtype=torch.long)
        y = torch.full((self.block_size,), IGNORE_INDEX, dtype=torch.long)
        x[:len(chunk) - 1] = chunk[:-1]  # short: the split's last window, or an empty one
        y[:len(chunk) - 1] = chunk[1:]
        return x, y, start


class TrainSampler(Sampler):
    """Yields batches (lists of window starts) for one rank, forever, epoch after epoch.
    Each epoch is cut to a whole number of optimizer steps (global_batch windows, all ranks), so
    an optimizer step never straddles epochs and 1 process and N ranks see the same windows per
    step."""

    def __init__(self, num_tokens, block_size, batch_size, global_batch, seed, rank=0,
                 world_size=1):
        self.num_tokens, self.block_size, self.batch_size = num_tokens, block_size, batch_size
        self.global_batch, self.seed, self.rank, self.world_size = (global_batch, seed, rank,
                                                                    world_size)
        fewest_windows = (num_tokens - block_size) // block_size  # with the largest offset
        if fewest_windows < global_batch:
            raise DataError(f"the train split ({num_tokens} tokens) holds {max(fewest_windows, 0)} "
                            f"windows of block_size={block_size}, fewer than one optimizer step "
                            f"needs ({global_batch} = batch_size x gradient_accumulation_steps): "
                            f"lower those or use more text")
        self.epoch, self.position = 0, 0  # the next batch the loop will consume

    def _epoch_layout(self, epoch):
        g = torch.Generator().manual_seed(self.seed + epoch)
        # new window boundaries each epoch
        offset = int(torch.randint(self.block_size, (1,), generator=g))
        n = (self.num_tokens - 1 - offset) // self.block_size
        return g, offset, n, n // self.global_batch * self.global_batch  # windows kept this epoch

    def epoch_starts(self, epoch):
        """This rank's window starts of an epoch, in order, as one int64 tensor: 8 bytes a window,
        where lists of Python ints take about 50 (over half a GB per rank for FineWeb10B at
        block_size 1024)."""
        g, offset, n, kept = self._epoch_layout(epoch)
        perm = torch.randperm(n, generator=g)[:kept]
        return offset + perm[self.rank::self.world_size] * self.block_size

    def __iter__(self):
        epoch, position = self.epoch, self.position
        while True:
            batches = self.epoch_starts(epoch).view(-1, self.batch_size)
            # indexed: iterating a tensor would unbind it into a tensor per row
            for i in range(position, len(batches)):
                yield batches[i].tolist()
            epoch, position = epoch + 1, 0

    @functools.cache  # asked once per micro-batch: draw the epoch's offset once
    def batches_in_epoch(self, epoch):
        return self._epoch_layout(epoch)[3] // (self.world_size * self.batch_size)

    def mark_consumed(self):
        self.position += 1
        if self.position == self.batches_in_epoch(self.epoch):
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self):
        # position in windows consumed by all ranks: a resume on another number of ranks continues
        # at the same place
        return {'epoch': self.epoch, 'position': self.position * self.batch_size * self.world_size}

    def load_state_dict(self, state):
        self.epoch, self.position = (state['epoch'],
                                     state['position'] // (self.batch_size * self.world_size))


class EvalSampler(Sampler):
    """Batches of window starts covering the split once; max_windows > 0 keeps that many windows
    evenly spread over the split (the same ones at every evaluation). Rank r takes windows
    r::world_size. Every batch is full: the last is filled with empty windows (start -1: no
    targets), never with real ones, so that a compiled model compiles one shape (a second, for a
    short last batch, took 12 s at the first evaluation on an H200). equal_batches gives every rank
    as many batches (sharded models need it), by more empty windows."""

    def __init__(self, num_tokens, block_size, batch_size, max_windows=0, rank=0, world_size=1,
                 equal_batches=False):
        starts = torch.arange(0, num_tokens - 1, block_size)
        split_windows = len(starts)
        if 0 < max_windows < len(starts):
            # float64: float32's 24 bits rounded indices of 2**24 windows and more past the last
            spread = torch.linspace(0, len(starts) - 1, max_windows, dtype=torch.float64)
            starts = starts[spread.round().long().unique()]
        self.coverage = (len(starts), split_windows)  # all ranks' windows of the split's
        shard = starts[rank::world_size]
        windows = -(-len(starts) // world_size) if equal_batches else len(shard)
        padded_len = -(-windows // batch_size) * batch_size
        shard = torch.cat([shard, torch.full((padded_len - len(shard),), EMPTY_WINDOW)])
        self.batch_size = batch_size
        # a rank left without windows (fewer than ranks, no equal_batches) has no batch
        self.batches = shard.split(batch_size) if len(shard) else ()

    def __iter__(self):
        return (b.tolist() for b in self.batches)

    def __len__(self):
        return len(self.batches)


def seed_worker(worker_id):
    # Ctrl-C reaches the whole process group, and torchrun passes SIGTERM to it: the training
    # process decides when to stop (after the step under way) and then shuts its workers down; a
    # worker that died first would fail that step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # DataLoader seeds torch in each worker from the loader's generator; numpy and random follow it
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def make_loader(dataset, batch_sampler, num_workers, seed, pin_memory):
    # the loader's own generator: creating an iterator must not draw from the global RNG (dropout's)
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                      pin_memory=pin_memory, worker_init_fn=seed_worker, collate_fn=pack,
                      generator=torch.Generator().manual_seed(seed))


def next_batch(windows, sampler):
    """This rank's next train batch, read without moving sampler: x (B, T), y (B, T), starts (B).
    The smoke test steps on it; overfit_one_batch trains on it alone (a resume reads it again)."""
    return default_collate([windows[start] for start in next(iter(sampler))])


def pack(windows):
    """[(x, y, start)] of B windows -> one int64 tensor of x (B*T), y (B*T) and the starts (B). A
    loader worker hands each tensor to the training process through a socket connection of its own
    (torch's file_descriptor sharing): one tensor a batch, not three, loads 1.4x the windows per
    second (docs/benchmarks.md). Batches unpacks it."""
    x, y, starts = default_collate(windows)  # (B, T), (B, T), (B,)
    return torch.cat([x.flatten(), y.flatten(), starts])


def unpack(batch, block_size):
    """pack's tensor -> x (B, T), y (B, T), starts (B): views of it."""
    size = (len(batch) // (2 * block_size + 1)) * block_size  # B * T
    return (batch[:size].view(-1, block_size), batch[size:2 * size].view(-1, block_size),
            batch[2 * size:])


class Batches:
    """A loader's batches, through which a shard that changed under the run (DataError) does not
    escape: an empty batch (no targets) takes the place of each batch that cannot be read, and fault
    keeps the first message. The rank that meets it still joins every collective (the step's
    all-reduce, a sharded model's forwards), and the ranks stop together where they agree on it
    (train.py, evaluate.loss)."""

    def __init__(self, loader, batch_size):
        self.batches, self.fault = iter(loader), None
        self.block_size = loader.dataset.block_size
        self.empty = unpack(pack([loader.dataset[EMPTY_WINDOW]] * batch_size), self.block_size)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return unpack(next(self.batches), self.block_size)
        except DataError as e:  # from a loader worker, the original message is the last line
            worker_prefix = f'{DataError.__module__}.DataError: '
            message = str(e).strip().splitlines()[-1].removeprefix(worker_prefix)
            self.fault = self.fault or message
            return self.empty


class TrainBatches(Batches):
    """The train batches of one rank, forever, each marked consumed as the loop takes it: loader
    workers prefetch ahead, so the sampler's own position runs ahead of training. Workers ignore
    SIGINT and SIGTERM (seed_worker) and are shut down the DataLoader's own way at exit, before
    multiprocessing would terminate() them (atexit runs the last registered first)."""

    def __init__(self, windows, sampler, num_workers, seed, pin_memory):
        loader = make_loader(windows, sampler, num_workers, seed, pin_memory)
        super().__init__(loader, sampler.batch_size)
        self.sampler = sampler
        if num_workers > 0:
            atexit.register(self.batches._shutdown_workers)

    def __next__(self):
        batch = super().__next__()
        if batch is not self.empty:
            self.sampler.mark_consumed()
        return batch
