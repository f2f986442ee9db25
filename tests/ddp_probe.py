"""Runs train.py under torchrun with test probes that the product itself must not contain:
PROBE_COUNT=DIR   counts DDP's gradient all-reduces per rank (a comm hook) into DIR/allreduce.RANK, and writes
                  whether DDP would broadcast buffers in a forward into DIR/buffers.RANK
PROBE_NAN=R:N     makes rank R's loss NaN from its N-th micro-batch on
PROBE_KILL=R:N    SIGKILLs rank R at its N-th micro-batch, on torchrun's first attempt only
PROBE_STEPS=DIR   counts the steps each optimizer class took per rank into DIR/steps.RANK (JSON)
PROBE_SLEEP=A-B:S sleeps S seconds in training micro-batches A to B (as compilation or a busy machine would)
PROBE_DATA=R:N:HOW:PATH  at rank R's N-th micro-batch, truncates the file PATH to half its size (HOW=truncate) or
                  rewrites its second half with other bytes, keeping its size (HOW=rewrite), as a job re-preparing the
                  data under the run would
PROBE_FSIZE=BYTES no file this process writes may grow past BYTES (RLIMIT_FSIZE): writes fail with EFBIG, as on a
                  full disk where no small filesystem can be mounted
Always: the GIL changes hands at most once a second unless its holder releases it (sys.setswitchinterval), so
a collective's tensors that gloo's worker thread frees late reach Python's shutdown unless train.py's exit gives
way (shut_down_process_group).
Usage: torchrun ... tests/ddp_probe.py train.py ARGS..., or python tests/ddp_probe.py train.py ARGS..."""
import atexit
import json
import os
import resource
import runpy
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.setswitchinterval(1.0)
rank = int(os.environ.get('RANK', '0'))
if 'PROBE_FSIZE' in os.environ:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ['PROBE_FSIZE']),) * 2)
micro_batches = 0

if 'PROBE_COUNT' in os.environ:
    allreduces = 0
    ddp_init = DistributedDataParallel.__init__

    def counting_init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)

        def hook(process_group, bucket):
            global allreduces
            allreduces += 1
            return allreduce_hook(process_group, bucket)
        self.register_comm_hook(None, hook)
        open(os.path.join(os.environ['PROBE_COUNT'], f'buffers.{rank}'), 'w').write(str(self.will_sync_module_buffers()))
    DistributedDataParallel.__init__ = counting_init
    atexit.register(lambda: open(os.path.join(os.environ['PROBE_COUNT'], f'allreduce.{rank}'), 'w').write(str(allreduces)))

if 'PROBE_STEPS' in os.environ:
    steps = {}
    register_optimizer_step_post_hook(
        lambda opt, *_: steps.update({type(opt).__name__: steps.get(type(opt).__name__, 0) + 1}))
    atexit.register(lambda: open(os.path.join(os.environ['PROBE_STEPS'], f'steps.{rank}'), 'w').write(json.dumps(steps)))

cross_entropy = F.cross_entropy


def probed_cross_entropy(*args, **kwargs):
    global micro_batches
    loss = cross_entropy(*args, **kwargs)
    if torch.is_grad_enabled():  # training micro-batches only, not evaluation
        micro_batches += 1
        target_rank, at, how, path = os.environ.get('PROBE_DATA', '-1:0::').split(':', 3)
        if rank == int(target_rank) and micro_batches == int(at):
            if how == 'truncate':
                os.truncate(path, os.path.getsize(path) // 2)
            else:
                with open(path, 'r+b') as f:
                    f.seek(os.path.getsize(path) // 2)
                    rest = f.read()
                    f.seek(os.path.getsize(path) // 2)
                    f.write(bytes(255 - b for b in rest))
        span, _, seconds = os.environ.get('PROBE_SLEEP', '0-0:0').partition(':')
        if int(span.split('-')[0]) <= micro_batches <= int(span.split('-')[1]):
            time.sleep(float(seconds))
        for name, action in (('PROBE_NAN', 'nan'), ('PROBE_KILL', 'kill')):
            target_rank, at = map(int, os.environ.get(name, '-1:0').split(':'))
            if rank == target_rank and micro_batches >= at:
                if action == 'nan':
                    loss = loss * float('nan')
                elif os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0':
                    os.kill(os.getpid(), signal.SIGKILL)
    return loss


F.cross_entropy = probed_cross_entropy
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as if train.py were run directly
runpy.run_path(sys.argv[0], run_name='__main__')
