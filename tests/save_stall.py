"""How long training waits for a checkpoint save at GPT-2 124M: best.pt and last.pt written at once
against async_save's host copy and background write (checkpoint.Writer), alternating, 4 trials each,
a step's change to the weights between (each write must hold the values of its save).

    python tests/save_stall.py cuda    # or cpu (docs/benchmarks.md, Checkpoint saves)
"""
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

device = sys.argv[1] if len(sys.argv) > 1 else 'cpu'
model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257,
                      bias=False)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == 'cuda')
for p in model.parameters():
    p.grad = torch.ones_like(p)
optimizer.step()  # AdamW's moments exist
ckpt = {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'iter_num': 1}
folder = tempfile.mkdtemp()
writers = {background: checkpoint.Writer(folder, 0, background, 0) for background in (False, True)}
for trial in range(8):  # the background writer's first copy allocates its buffers
    background = trial % 2 == 1
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    if device == 'cuda':
        torch.cuda.synchronize()
    start = time.perf_counter()
    assert writers[background].write(ckpt, ['best.pt', 'last.pt']) is None
    stall = time.perf_counter() - start
    assert writers[background].wait() is None
    done = time.perf_counter() - start
    saved = torch.load(os.path.join(folder, 'last.pt'), map_location=device, weights_only=True)
    assert all(torch.equal(saved['model'][k], v) for k, v in model.state_dict().items())
    size = os.path.getsize(os.path.join(folder, 'last.pt'))
    print(f"{'background' if background else 'at once   '}: training waits {stall:.3f} s, "
          f"written after {done:.3f} s, {size / 1e9:.2f} GB for both names")
