"""Trial steps before a run's first, each undone afterwards (every part of the run and every RNG put
back as it was), so the run from its first real step is the run without them.

- The smoke test: a few optimizer steps on one fixed batch, through the loop's own step, must lower
  that batch's loss. A model that cannot learn (a detached loss, a learning rate of 0) fails it in
  seconds, before hours are spent.
- fit_batch: the largest micro-batch that fits in memory, halving from batch_size, the global batch
  kept by raising accumulation."""
import math
import time

import torch
from torch.utils.data import default_collate

import checkpoint
import data
import distributed
import exits
import runlog

SMOKE_DROP = 0.1  # the rule: the last step's loss at most (1 - SMOKE_DROP) x the first's


def smoke_test(steps, train_step, train_split, parts, device):
    """Optimizer steps on this rank's next train batch (read without moving the sampler) through
    the loop's train_step (train.py's: a micro-batch's loss, gradient norm and windows), at each
    group's base rate, the schedule's peak (warmup's first rates would move nothing), until the
    loss the ranks agree on has fallen by SMOKE_DROP or is not finite: at most steps of them.
    parts: what a checkpoint holds the state of (train.py), restored afterwards with the RNGs; the
    EMA is left out, as no step touches it. Passing, a line and a 'smoke' record, and False;
    failing, the same, then exit code 2 on every rank (they agree on the losses, so on when to
    stop). A stop signal on any rank ends it after the step under way on every rank: True, the
    state restored."""
    optimizer, scaler = parts['optimizer'], parts['scaler']
    batch = data.next_batch(train_split, parts['sampler'])
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def step():  # one micro-batch per rank: accumulating it would only repeat it
        loss, _, _ = train_step(iter([batch]), accum=1)
        scaler.step(optimizer)
        scaler.update()
        # the ranks' mean loss, and whether a stop signal reached any of them
        stop = torch.tensor([float(exits.stop_signal is not None)], device=loss.device)
        loss_sum, stops = distributed.sum_over_ranks(torch.cat([loss.view(1), stop])).tolist()
        return loss_sum / world_size, stops > 0

    runlog.log(f"smoke test: up to {steps} steps on one batch before the first, until its loss "
               f"falls {SMOKE_DROP:.0%} (smoke_steps=0 skips it)")
    start = time.time()
    parts = {name: part for name, part in parts.items() if name != 'ema'}  # no copy of it
    saved = checkpoint.snapshot(parts, device)
    for group, base_lr in zip(optimizer.param_groups, parts['scheduler'].base_lrs):
        group['lr'] = base_lr
    losses = []
    while True:
        loss, stopped = step()
        losses.append(loss)
        # passing early: a model that learns shows it in a few steps, and a large model's step is
        # long; failing early: a non-finite loss cannot come back
        if (stopped or len(losses) == steps or not math.isfinite(loss)
                or loss <= (1 - SMOKE_DROP) * losses[0]):
            break
    checkpoint.restore(parts, saved, device)
    first, last, seconds = losses[0], losses[-1], time.time() - start
    if stopped:  # every rank: they agree on it
        runlog.log(f"smoke test: a stop signal after {len(losses)} steps; the run stops before "
                   f"its first step")
        return True
    passed = last <= (1 - SMOKE_DROP) * first  # a NaN fails too
    runlog.record({'kind': 'smoke', 'step': 0, 'steps': len(losses), 'max_steps': steps,
                   'first_loss': first, 'last_loss': last, 'seconds': seconds, 'passed': passed})
    line = (f"smoke test: {len(losses)} steps on one batch took its loss from {first:.4f} to "
            f"{last:.4f} in {seconds:.1f} s")
    if passed:
        runlog.log(f"{line}: it learns; the run starts from the state before it")
        return False
    why = "this model does not learn (a loss detached from the weights, a learning rate of 0?)"
    if not math.isfinite(last):
        why = "it is not finite at the full learning rate: lower learning_rate"
    exits.check(False, f"{line}, not below {1 - SMOKE_DROP:.0%} of it: {why}; smoke_steps=0 skips "
                       f"the test")


def try_step(size, train_split, autocast, model, optimizer, device):
    """fit_batch's trial: a forward, backward and optimizer step of size windows, on the model
    unwrapped (a rank out of memory must not leave the others in a collective). Without the
    GradScaler: its per-step record outlives a restore, and an overflow would skip the step whose
    optimizer state this must allocate."""
    x, y, _ = default_collate([train_split[start] for start in range(size)])
    with autocast:
        loss = model(x.to(device), y.to(device))
    loss.backward()
    optimizer.step()


def fit_batch(batch_size, accum, train_split, autocast, parts, device):
    """(batch_size, accum): the largest micro-batch, halving from batch_size, with which try_step
    runs out of memory on no rank, with accum raised to keep a step's windows. Each try is undone
    (parts and the RNGs restored). An odd size or 1 that runs out of memory ends the run with a
    line, exit 2."""
    first = batch_size
    while True:
        saved = checkpoint.snapshot(parts, device)
        failed = False
        try:
            try_step(batch_size, train_split, autocast, parts['model'], parts['optimizer'],
                     device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not exits.out_of_memory(e):
                raise
            failed = True
        parts['optimizer'].zero_grad(set_to_none=True)
        checkpoint.restore(parts, saved, device)
        del saved
        if torch.device(device).type == 'cuda':
            torch.cuda.empty_cache()  # the failed try's blocks, for the next
        if not distributed.any_rank(failed, device):
            break
        exits.check(batch_size % 2 == 0, f"fit_batch: batch_size={batch_size} runs out of memory "
                    f"and cannot be halved: use a smaller block_size or model, dtype=bfloat16, or "
                    f"activation_checkpointing=True")
        batch_size, accum = batch_size // 2, accum * 2
    if batch_size < first:
        runlog.log(f"fit_batch: batch_size={first} runs out of memory, {batch_size} fits: "
                   f"micro-batches of {batch_size}, gradient_accumulation_steps={accum} (the same "
                   f"windows a step)")
    else:
        runlog.log(f"fit_batch: batch_size={first} fits")
    return batch_size, accum
