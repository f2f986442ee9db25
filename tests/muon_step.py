"""How long Muon's step takes at GPT-2 124M's matrices (the blocks' 48): torch.optim.Muon
(Newton-Schulz in bfloat16, one matrix at a time) against optim.Muon (batched by shape) in bfloat16
and in float32, in turns, 5 trials of 10 steps each (on a CPU one of one: a step takes seconds),
and the matrix products one step calls.

    python tests/muon_step.py cuda    # or cpu (docs/benchmarks.md, Muon's step)
"""
import os
import statistics
import sys
import time

import torch
from torch.profiler import profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig  # noqa: E402
from optim import Muon  # noqa: E402

device = sys.argv[1] if len(sys.argv) > 1 else 'cpu'
trials, steps = (5, 10) if device == 'cuda' else (1, 1)
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257,
                      bias=False)).to(device)
matrices = [p for _, p in model.muon_params()]
for p in matrices:
    p.grad = torch.randn_like(p)
optimizers = {'torch.optim.Muon, bfloat16': torch.optim.Muon(matrices, lr=0.02),
              'optim.Muon, bfloat16': Muon(matrices, torch.bfloat16, lr=0.02),
              'optim.Muon, float32': Muon(matrices, torch.float32, lr=0.02)}


def sync():
    if device == 'cuda':
        torch.cuda.synchronize()


def products(optimizer):
    """The matrix products (mm, bmm and their fused adds) one step calls."""
    with profile() as prof:
        optimizer.step()
        sync()
    return sum(e.count for e in prof.key_averages() if e.key.split('::')[-1] in
               ('mm', 'addmm', 'bmm', 'baddbmm'))


times = {name: [] for name in optimizers}
for name, optimizer in optimizers.items():  # warm-up: momentum buffers, kernels chosen
    for _ in range(3 if device == 'cuda' else 1):
        optimizer.step()
for trial in range(trials):
    for name, optimizer in optimizers.items():
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        sync()
        times[name].append((time.perf_counter() - start) / steps)
print(f"{len(matrices)} matrices on {device} ({torch.__version__})")
for name, optimizer in optimizers.items():
    print(f"{name}: {1e3 * statistics.median(times[name]):.2f} ms a step (median of {trials}), "
          f"{products(optimizer)} matrix products")
