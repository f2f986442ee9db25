"""The smoke test: before a run's first step, a few optimizer steps on one fixed batch, through the
loop's own step, must lower that batch's loss. A model that cannot learn (a detached loss, a
learning rate of 0) fails it in seconds, before hours are spent. Then every part of the run and
every RNG is put back as it was, so the run from its first real step is the run without it."""
import math
import time

import checkpoint
import runlog

SMOKE_DROP = 0.1  # the rule: the last step's loss at most (1 - SMOKE_DROP) x the first's


def smoke_test(steps, step, batch, parts, device):
    """steps calls of step(batch) (one optimizer step; returns the loss the ranks agree on before
    it) at each group's base rate, the schedule's peak (warmup's first rates would move nothing);
    parts: what a checkpoint holds the state of (train.py), restored afterwards with the RNGs.
    Passing, a line and a 'smoke' record; failing, the same, then exit code 2 on every rank (they
    agree on the losses)."""
    runlog.log(f"smoke test: {steps} steps on one batch before the first (smoke_steps=0 skips it)")
    start = time.time()
    saved = checkpoint.snapshot(parts, device)
    optimizer, scheduler = parts['optimizer'], parts['scheduler']
    for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs):
        group['lr'] = base_lr
    losses = []
    for _ in range(steps):
        losses.append(step(batch))
    checkpoint.restore(parts, saved, device)
    first, last, seconds = losses[0], losses[-1], time.time() - start
    passed = last <= (1 - SMOKE_DROP) * first  # a NaN fails too
    runlog.record({'kind': 'smoke', 'step': 0, 'steps': steps, 'first_loss': first,
                   'last_loss': last, 'seconds': seconds, 'passed': passed})
    line = (f"smoke test: {steps} steps on one batch took its loss from {first:.4f} to {last:.4f} "
            f"in {seconds:.1f} s")
    if passed:
        runlog.log(f"{line}: it learns; the run starts from the state before it")
        return
    why = "this model does not learn (a loss detached from the weights, a learning rate of 0?)"
    if not math.isfinite(last):
        why = "it is not finite at the full learning rate: lower learning_rate"
    runlog.check(False, f"{line}, not below {1 - SMOKE_DROP:.0%} of it: {why}; smoke_steps=0 skips "
                        f"the test")
