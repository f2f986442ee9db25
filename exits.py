"""
How a run ends before its last iteration, each way in one line and with its own exit code: a mistake
in the settings (check(): exit 2, said by rank 0, in train.log too once the run folder is open); a
fault the ranks agree on (abort(): exit 1, an abort record and the report; a save that failed, data
changed under the run, a non-finite loss, float16 overflows); a stop signal, Ctrl-C or SIGTERM (exit
128 + its number, once last.pt holds the step under way); out of memory or another rank lost
(sys.excepthook: one line instead of a traceback, exit 1). configurator.fail is the same refusal for
scripts before a run exists. runlog.py keeps the run's records.
"""
import math
import os
import re
import signal
import sys
import time

import torch

import perf
import report
import runlog
from configurator import fail, tell_torchrun
from distributed import any_rank, gather, sum_over_ranks
from runlog import finish, log, record

# SIGINT (Ctrl-C) or SIGTERM (a cluster's notice), once catch_stop_signals() has run
stop_signal = None


def check(ok, message):
    """A mistake in the settings, the same on every rank: rank 0 says it in one line (in
    train.log too, once the run folder is open); all exit 2. The other ranks wait for torchrun to
    stop them: one that exited first would have torchrun stop rank 0 before it spoke."""
    if ok:
        return
    if not runlog.master:
        # torchrun's SIGTERM ends this rank at once, also once catch_stop_signals() would have it
        # save first (a failed smoke test): else torchrun waits 30 s, then kills it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(60)
        sys.exit(2)
    if runlog.files:
        runlog.files['train.log'].write(f"error: {message}\n")
        runlog.files['train.log'].flush()
    fail(message)


def abort(step, message):
    """Stop the run now, exit code 1, with an abort record, the message and the report. Every rank
    calls it at the same point, having decided on the same reduced values."""
    # torchrun sends SIGTERM to the ranks left once one has exited: this one is stopping already,
    # and catch_stop_signals' handler would announce a save that never comes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record({'kind': 'abort', 'step': step, 'message': message})
    log(f"error: {message}", sys.stderr)
    tell_torchrun(f"error: {message}")
    finish()
    sys.exit(1)


def agree(step, loss_sum, accum, grad_norm, fault, writer, device):
    """After a step's backward, before the optimizer steps: one all-reduce of this rank's loss_sum
    (over its micro-batches) and of whether this rank got a stop signal, met a data fault (fault:
    the loader's message, or None) or has a failed background save, then one host sync. Changed
    data or a failed save on any rank ends the run here on every rank. Returns the mean loss over
    every rank's micro-batches (accum: their count, all ranks'), the gradient norm, and whether a
    rank was asked to stop."""
    flags = torch.tensor([stop_signal is not None, fault is not None,
                          writer.failed() is not None], device=device).float()
    loss_sum, stops, faults, failed_saves = sum_over_ranks(torch.cat([loss_sum.view(1), flags]))
    synced = torch.stack([loss_sum / accum, grad_norm.float(), stops, faults, failed_saves])
    loss, grad_norm, stops, faults, failed_saves = synced.tolist()
    if failed_saves:
        unsaved(writer.wait(), step, writer, device)
    if faults:
        data_fault(step, next(m for m in gather(fault) if m), writer)
    return loss, grad_norm, stops


def non_finite(step, loss, grad_norm, lr, rank_loss, starts):
    """The line a non-finite loss or gradient norm ends the run with: the values, and the windows
    (start positions in the train split) of the batches that produced them: of the ranks whose own
    loss (rank_loss, over their micro-batches, whose windows are starts) is not finite, else every
    rank's. Every rank calls it: a gather."""
    ranks = gather((math.isfinite(rank_loss.item()), starts))
    culprits = [s for finite, windows in ranks if not finite for s in windows]
    starts = culprits or [s for _, windows in ranks for s in windows]
    what = 'loss' if not math.isfinite(loss) else 'gradient norm'
    return (f"non-finite {what} at iteration {step}: loss {loss}, lr {lr:.3e}, grad norm "
            f"{grad_norm}, batch windows (start positions in the train split) "
            f"{starts[:16]}{' ...' if len(starts) > 16 else ''}; the last checkpoints are "
            f"untouched: lower learning_rate or raise warmup_iters, then resume with "
            f"--init_from=auto (it starts again where none was written)")


def overflowed(skips, step, scale):
    """The line a streak of float16 overflows (each a step the GradScaler skipped) ends the run
    with."""
    return (f"float16 gradients overflowed {skips} optimizer steps in a row (up to iteration "
            f"{step}, loss scale now {scale:g}): the model diverged or float16's range is too "
            f"small for it; use dtype=bfloat16 or float32, or lower learning_rate, then resume "
            f"with --init_from=auto")


def unsaved(failed, step, writer, device):
    """End the run on every rank at step if a save failed on any (failed: this rank's (names,
    iteration, why), or None; writer: the run's checkpoint.Writer), with every file on disk
    whole."""
    if any_rank(failed, device):
        writer.wait()  # a background write in flight ends first
        writer.remove_unnamed_shards()  # the failed save's, left halfway (a full disk)
        names, iter_num, why = failed or (['last.pt'], step, None)  # (None: another rank's)
        why = why or 'on another rank'
        has_last = os.path.exists(os.path.join(writer.out_dir, 'last.pt'))
        held = f" (last.pt holds iteration {writer.last_saved})" if has_last else ''
        abort(step, f"saving {' and '.join(names)} at iteration {iter_num} failed ({why}): the "
                    f"files on disk are whole; free space in {writer.out_dir}, then run again "
                    f"with init_from=auto{held}")


def data_fault(step, fault, writer):
    """End the run on every rank, once they agree that one of them could not read a shard because
    it changed under the run (in a training micro-batch or an evaluation): what happened, and what
    to do."""
    writer.wait()  # a write in flight ends first: last.pt then holds the iteration named
    abort(step, f"{fault}: restore the data and resume from last.pt (iteration "
                f"{writer.last_saved}), or start a new out_dir")


def explain_failure(exc, step, batch_size, block_size, dtype, device):
    """sys.excepthook: two failures get one line instead of a traceback, and the exit code stays 1.
    Out of memory says what to change, with an abort record (no report: plotting needs memory this
    process may not get; python report.py OUT_DIR writes it later). A collective that another rank
    left (killed, or out of memory itself) says so on each rank left. Any other exception keeps its
    traceback."""
    exc_type, value, tb = exc
    if lost_a_rank(value):
        # torchrun stops this process next: the stop handler would announce a save that never comes
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # the error's first sentence, without the source file gloo names
        why = re.sub(r'^\[[^]]*\] ', '', ' '.join(str(value).split())).split('. ')[0][:200]
        record({'kind': 'abort', 'step': step, 'message': 'lost another rank'})
        sys.stderr.write(f"error: rank {os.environ.get('RANK', 0)} lost another rank at "
                         f"iteration {step} ({why or type(value).__name__}): the rank that failed "
                         f"first says why (torchrun: \"Root Cause\"); the checkpoints are intact: "
                         f"init_from=auto resumes\n")
        return
    if not out_of_memory(value):
        return sys.__excepthook__(exc_type, value, tb)
    record({'kind': 'abort', 'step': step, 'message': 'out of memory'})
    log(f"error: out of memory at iteration {step} with batch_size={batch_size}, "
        f"block_size={block_size} ({perf.peak_memory_mb(device):,.0f} MB at peak): lower "
        f"batch_size and raise gradient_accumulation_steps by the same factor (the tokens per "
        f"iteration stay){', or use dtype=bfloat16' if dtype == 'float32' else ''}; the "
        f"checkpoints are intact", sys.stderr)


def lost_a_rank(error):
    """Whether an exception is gloo's (a RuntimeError that names its transport) for a peer that is
    gone: not its timeout, which a rank that skipped a collective also causes, and whose traceback
    shows where. (NCCL's survivors wait in the kernel until torchrun stops them.)"""
    return 'gloo/transport/' in str(error) and 'Timed out' not in str(error)


def out_of_memory(error):
    """Whether an exception is a failed allocation: CUDA's OutOfMemoryError, or a CPU's."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def catch_stop_signals():
    """From now on SIGINT and SIGTERM set stop_signal, and the loop saves last.pt after the step
    under way and exits; a Ctrl-C after either kills the process at once (every checkpoint on disk
    is whole, written atomically)."""
    def request_stop(signum, frame):
        global stop_signal
        if stop_signal is None:
            stop_signal = signum
            # a handler runs only between Python's bytecodes, not inside a long kernel (a large
            # model's forward): the next Ctrl-C gets the default action, which ends the process
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            # os.write: print() may be in the middle of a line, and a handler must not re-enter it
            if runlog.master:
                again = f" (Ctrl-C{' again' if signum == signal.SIGINT else ''} to stop at once)"
                os.write(2, f"\n{signal.Signals(signum).name}: saving last.pt after the iteration "
                            f"under way, then stopping{again}\n".encode())
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def stop_at_once():
    """From now on (a run's end: the test split, the sample, the report, nothing left to save)
    SIGINT and SIGTERM take their default action and end the process at once: last.pt holds the
    run, and init_from=auto redoes the end. A stop heard before is stop_signal's, for the caller."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def exit_on_signal(step, ended, world_size, writer, device):
    """The run stops for a signal (on any rank) once last.pt holds step (writer: the run's
    checkpoint.Writer, whose write in flight ends first): a stop record, the line that says how to
    resume (where the training ended, ended: at max_iters or an early stop, init_from=auto, which
    does the end a stop left), the report, and exit code 128 + the signal's number."""
    unsaved(writer.wait(), step, writer, device)
    signum = stop_signal or signal.SIGTERM  # a rank stopping for another's signal
    name = signal.Signals(signum).name
    record({'kind': 'stop', 'step': step, 'time': time.time(), 'signal': name, 'ended': ended})
    if runlog.master:  # run_dir is rank 0's
        resume = report.resume_command({'command': sys.argv, 'world_size': world_size}, True,
                                       ended=ended)
        log(f"stopped by {name} at iteration {step}: {os.path.join(runlog.run_dir, 'last.pt')} "
            f"holds it; resume with: {resume}")
    finish()
    sys.exit(128 + signum)
