"""Runs train.py, alone or under torchrun, with test probes that the product itself must not
contain. RANK is torchrun's (0 alone); a probe that writes files writes one per rank, NAME.RANK.
PROBE_COUNT=DIR      counts DDP's gradient all-reduces per rank (a comm hook) into
                     DIR/allreduce.RANK, and writes whether DDP would broadcast buffers in a
                     forward into DIR/buffers.RANK
PROBE_NAN=R:N        makes rank R's loss NaN from its N-th micro-batch on
PROBE_KILL=R:N       SIGKILLs rank R at its N-th micro-batch, on torchrun's first attempt only
PROBE_STEPS=DIR      counts the steps each optimizer class took per rank into DIR/steps.RANK (JSON)
PROBE_ATTENTION=DIR  counts attention calls (one per block forward) with gradients on, in forward
                     and inside a backward (a recomputation), into DIR/attention.RANK (JSON)
PROBE_DTYPES=DIR     writes the dtypes the linear layers returned in training forwards into
                     DIR/dtypes.RANK (JSON)
PROBE_OOM=N          training forwards of more than N windows raise torch.OutOfMemoryError (in
                     attention), as a device too small for them would
PROBE_GRAPHS=DIR     counts the graphs that torch.compile hands to inductor into DIR/graphs.RANK
PROBE_HOLD_SAVE=N[:kernel]  the N-th write of last.pt (torch.save's, or a link to best.pt) stops
                     once its temp file (last.pt.PID.tmp) is whole, before the rename, and says so
                     on stderr (a kill then lands mid-write), until the run hears a stop signal,
                     60 s at most; with ':kernel', a stop heard then runs a kernel of minutes,
                     which gives Python's signal handlers no turn (as a large model's forward
                     would), and says so
PROBE_SAVE_DELAY=S   torch.save waits S seconds before it writes: with async_save, training goes on
                     meanwhile
PROBE_LOGGERS=FILE   stands in for wandb and TensorBoard (the tensorboard package and
                     torch.utils.tensorboard): each call the run makes to them becomes a JSON line
                     in FILE
PROBE_SLEEP=A-B:S    sleeps S seconds in training micro-batches A to B (as compilation or a busy
                     machine would), and says so on stderr as each sleep begins
PROBE_SLEEP_EVAL=S   sleeps S seconds in each evaluation forward, and says so on stderr
PROBE_KILL_EVAL=R    SIGKILLs rank R at its first evaluation forward
PROBE_DATA=R:N:HOW:PATH  at rank R's N-th micro-batch, truncates the file PATH to half its size
                     (HOW=truncate) or rotates the tokens of its second half by 4 bytes, keeping its
                     size and every id in the vocabulary (HOW=rewrite), as a job re-preparing the
                     data under the run would
PROBE_HIDE_DATA=R    rank R finds no dataset (data.open_dataset), as a node whose storage lacks it
PROBE_FSIZE=BYTES    no file this process writes may grow past BYTES (RLIMIT_FSIZE): writes fail
                     with EFBIG, as on a full disk where no small filesystem can be mounted
PROBE_HELD=DIR       at each optimizer step, how many of the weights the run loaded (a
                     checkpoint's 'model', GPT-2's from hf.load_gpt2) are still alive, into
                     DIR/held.RANK (JSON): copied into the model, none should be
PROBE_CUDA_MEMORY=BYTES  from fit_batch's first try (smoke.fit_batch) or the training loop's
                     start (perf.reset_peak_memory), the CUDA allocator may hold at most BYTES of
                     GPU 0, as on a smaller card (set_per_process_memory_fraction)
Always: the GIL changes hands at most once a second unless its holder releases it
(sys.setswitchinterval), so a collective's tensors that gloo's worker thread frees late reach
Python's shutdown unless train.py's exit gives way (distributed.destroy_process_group).
Usage: [torchrun ...] tests/probe.py train.py ARGS..."""
import atexit
import gc
import importlib.machinery
import json
import os
import re
import resource
import runpy
import signal
import sys
import time
import types
import weakref

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
if rank == int(os.environ.get('PROBE_HIDE_DATA', -1)):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data's folder
    import data

    def no_dataset(data_dir, dataset):
        raise data.DataError(f"dataset '{dataset}' has no {data_dir}/{dataset}/meta.json (probe)")
    data.open_dataset = no_dataset
if 'PROBE_CUDA_MEMORY' in os.environ:  # not before: a GPU missing from perf.GPU_PEAKS is measured
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # perf's folder
    import perf
    import smoke
    reset_peak_memory, fit_batch = perf.reset_peak_memory, smoke.fit_batch

    def cap(device):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(int(os.environ['PROBE_CUDA_MEMORY']) / total,
                                                   device)

    def reset_and_cap(device):
        reset_peak_memory(device)
        cap(device)

    def cap_and_fit(*args):  # fit_batch's arguments, the device last
        cap(args[-1])
        return fit_batch(*args)
    perf.reset_peak_memory, smoke.fit_batch = reset_and_cap, cap_and_fit
micro_batches = 0


def write_at_exit(variable, name, content):
    """At exit, DIR/name.RANK (DIR from the environment variable) gets content() as text."""
    atexit.register(lambda: open(os.path.join(os.environ[variable], f'{name}.{rank}'), 'w')
                    .write(content()))


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
        open(os.path.join(os.environ['PROBE_COUNT'],
                          f'buffers.{rank}'), 'w').write(str(self.will_sync_module_buffers()))
    DistributedDataParallel.__init__ = counting_init
    write_at_exit('PROBE_COUNT', 'allreduce', lambda: str(allreduces))

if 'PROBE_STEPS' in os.environ:
    steps = {}
    register_optimizer_step_post_hook(
        lambda opt, *_: steps.update({type(opt).__name__: steps.get(type(opt).__name__, 0) + 1}))
    write_at_exit('PROBE_STEPS', 'steps', lambda: json.dumps(steps))

if 'PROBE_ATTENTION' in os.environ:
    attention_calls = {'forward': 0, 'backward': 0}
    attention = F.scaled_dot_product_attention

    def counting_attention(*args, **kwargs):
        if torch.is_grad_enabled():  # training, not evaluation or sampling
            attention_calls['backward' if torch._C._current_graph_task_id() != -1
                            else 'forward'] += 1
        return attention(*args, **kwargs)
    F.scaled_dot_product_attention = counting_attention
    write_at_exit('PROBE_ATTENTION', 'attention', lambda: json.dumps(attention_calls))

if 'PROBE_OOM' in os.environ:
    unlimited_attention = F.scaled_dot_product_attention

    def attention_out_of_memory_above(q, *args, **kwargs):  # q: (B, n_head, T, head size)
        if torch.is_grad_enabled() and q.size(0) > int(os.environ['PROBE_OOM']):
            raise torch.OutOfMemoryError("CUDA out of memory (PROBE_OOM)")
        return unlimited_attention(q, *args, **kwargs)
    F.scaled_dot_product_attention = attention_out_of_memory_above

if 'PROBE_DTYPES' in os.environ:
    linear_dtypes, linear = set(), F.linear

    def recording_linear(*args, **kwargs):
        out = linear(*args, **kwargs)
        if torch.is_grad_enabled():  # training, not evaluation
            linear_dtypes.add(str(out.dtype).removeprefix('torch.'))
        return out
    F.linear = recording_linear  # what nn.Linear.forward calls
    write_at_exit('PROBE_DTYPES', 'dtypes', lambda: json.dumps(sorted(linear_dtypes)))

if 'PROBE_GRAPHS' in os.environ:
    # torch.compile(backend='inductor') calls inductor.compile_fx
    import torch._inductor.compile_fx as inductor
    graphs, compile_fx = [], inductor.compile_fx

    def counting_compile_fx(*args, **kwargs):
        graphs.append(1)
        return compile_fx(*args, **kwargs)
    inductor.compile_fx = counting_compile_fx
    write_at_exit('PROBE_GRAPHS', 'graphs', lambda: str(len(graphs)))

if 'PROBE_HELD' in os.environ:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hf's folder
    import hf
    loaded, alive = [], []  # weak references to the loaded weights; the count alive at each step
    torch_load, load_gpt2 = torch.load, hf.load_gpt2

    def recording_load(*args, **kwargs):
        ckpt = torch_load(*args, **kwargs)
        if isinstance(ckpt, dict) and isinstance(ckpt.get('model'), dict):
            loaded.extend(weakref.ref(t) for t in ckpt['model'].values())
        return ckpt

    def recording_load_gpt2(*args, **kwargs):
        model_args, state, pretrained = load_gpt2(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in state.values())
        return model_args, state, pretrained

    def count_alive(*_):
        gc.collect()
        alive.append(sum(ref() is not None for ref in loaded))
    torch.load, hf.load_gpt2 = recording_load, recording_load_gpt2
    register_optimizer_step_post_hook(count_alive)
    write_at_exit('PROBE_HELD', 'held', lambda: json.dumps({'loaded': len(loaded),
                                                             'alive': alive}))

if 'PROBE_HOLD_SAVE' in os.environ:
    torch_save, last_writes = torch.save, []

    def hold_last(name, f=None):
        if re.fullmatch(r'.*/last\.pt\.\d+\.tmp', name):
            last_writes.append(name)
            at, _, then = os.environ['PROBE_HOLD_SAVE'].partition(':')
            if len(last_writes) == int(at):
                if f:  # the temp file holds the whole checkpoint; the rename has not happened
                    f.flush()
                print(f'probe: holding the write of {name}', file=sys.stderr, flush=True)
                stop_heard = lambda: sys.modules['exits'].stop_signal is not None
                deadline = time.time() + 60
                while time.time() < deadline and not stop_heard():
                    time.sleep(0.01)
                if stop_heard() and then == 'kernel':
                    n = 3072  # about 120 products of n x n (n^3 multiply-adds each): minutes
                    matrix = torch.full((n, n), 1 / n)
                    print('probe: in a long kernel', file=sys.stderr, flush=True)
                    torch.linalg.matrix_power(matrix, 2 ** 62 - 1)

    def holding_save(obj, f, *args, **kwargs):
        torch_save(obj, f, *args, **kwargs)
        hold_last(getattr(getattr(f, 'f', f), 'name', ''), f)  # checkpoint.save_file wraps the file

    def holding_link(source, path, *args, **kwargs):
        os_link(source, path, *args, **kwargs)
        hold_last(path)
    torch.save, os_link, os.link = holding_save, os.link, holding_link

if 'PROBE_SAVE_DELAY' in os.environ:
    undelayed_save = torch.save

    def delayed_save(*args, **kwargs):
        time.sleep(float(os.environ['PROBE_SAVE_DELAY']))
        undelayed_save(*args, **kwargs)
    torch.save = delayed_save

if 'PROBE_LOGGERS' in os.environ:
    def log_call(*call):
        with open(os.environ['PROBE_LOGGERS'], 'a') as f:
            f.write(json.dumps(call) + '\n')

    def fake_module(name, **attributes):
        module = types.ModuleType(name)
        # what importlib.util.find_spec returns
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(attributes)
        sys.modules[name] = module

    class SummaryWriter:
        def __init__(self, log_dir):
            log_call('SummaryWriter', log_dir)

        def add_scalar(self, tag, value, step):
            log_call('add_scalar', tag, value, step)

        def close(self):
            log_call('SummaryWriter.close')
    fake_module('tensorboard')
    fake_module('torch.utils.tensorboard', SummaryWriter=SummaryWriter)
    fake_module('wandb', init=lambda **kwargs: log_call('wandb.init', kwargs),
                log=lambda data, step: log_call('wandb.log', data, step))

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
                # after the header, at a token
                half = 1024 + (os.path.getsize(path) // 2 - 1024) // 4 * 4
                with open(path, 'r+b') as f:
                    f.seek(half)
                    rest = f.read()
                    f.seek(half)
                    f.write(rest[4:] + rest[:4])
        span, _, seconds = os.environ.get('PROBE_SLEEP', '0-0:0').partition(':')
        if int(span.split('-')[0]) <= micro_batches <= int(span.split('-')[1]):
            print(f"probe: rank {rank} sleeps in micro-batch {micro_batches}", file=sys.stderr,
                  flush=True)
            time.sleep(float(seconds))
        for name, action in (('PROBE_NAN', 'nan'), ('PROBE_KILL', 'kill')):
            target_rank, at = map(int, os.environ.get(name, '-1:0').split(':'))
            if rank == target_rank and micro_batches >= at:
                if action == 'nan':
                    loss = loss * float('nan')
                elif os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0':
                    os.kill(os.getpid(), signal.SIGKILL)
    elif 'PROBE_SLEEP_EVAL' in os.environ:
        print(f"probe: rank {rank} sleeps in an evaluation", file=sys.stderr, flush=True)
        time.sleep(float(os.environ['PROBE_SLEEP_EVAL']))
    elif os.environ.get('PROBE_KILL_EVAL') == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
    return loss


# only when asked: torch.compile traces the loss (in GPT.forward), and it cannot guard on a function
# of this script, whose module train.py's replaces as __main__
if any(name in os.environ
       for name in ('PROBE_NAN', 'PROBE_KILL', 'PROBE_DATA', 'PROBE_SLEEP', 'PROBE_SLEEP_EVAL',
                    'PROBE_KILL_EVAL')):
    F.cross_entropy = probed_cross_entropy
sys.argv = sys.argv[1:]
# as if train.py were run directly
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name='__main__')
