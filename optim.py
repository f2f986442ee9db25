"""
The optimizers GPT.configure_optimizers builds beside torch's AdamW: Muon (torch.optim.Muon with its
Newton-Schulz iteration batched by shape, in the dtype the device computes fast) and Optimizers,
which steps, schedules and saves several optimizers as one.
"""
import torch
from torch.optim._muon import _adjust_lr  # private, and the same in torch 2.11 to 2.15

OPTIMIZERS = ('adamw', 'muon')  # what GPT.configure_optimizers builds


class Optimizers(torch.optim.Optimizer):
    """Several optimizers as one: train.py zero-grads, unscales, steps, schedules and saves it
    without counting them. Its param_groups are the members' own group dicts, so a learning rate set
    here, by one LR scheduler, is theirs, each group keeping its own base rate; its state is theirs,
    merged. Both are gathered again after a step (a member adds a parameter's state at its first
    step) and a load (a member's load_state_dict replaces its group dicts; checkpoint.load_weights
    calls gather after FSDP's). Its state_dict is the list of theirs."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        super().__init__([group for opt in optimizers for group in opt.param_groups], {})

    def gather(self):
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]
        self.state = {p: state for opt in self.optimizers for p, state in opt.state.items()}

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()
        self.gather()

    def state_dict(self):
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, state_dict):
        for opt, state in zip(self.optimizers, state_dict, strict=True):
            opt.load_state_dict(state)
        self.gather()


def newton_schulz(G, dtype, coefficients, steps, eps):
    """G: (n, rows, cols), n matrices of one shape -> (n, rows, cols) in dtype, each orthogonalized:
    torch's Muon's quintic iteration (torch.optim._muon._zeropower_via_newtonschulz) on all n at
    once, three batched products per step instead of 3n, in dtype rather than always bfloat16."""
    a, b, c = coefficients
    X = G.to(dtype)  # (n, rows, cols)
    tall = G.size(-2) > G.size(-1)
    if tall:  # the Gram matrix of the shorter side is the smaller product
        X = X.mT  # (n, cols, rows)
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        A = X @ X.mT  # (n, short, short)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A A
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return X.mT if tall else X


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its settings, momentum, Nesterov, decoupled weight decay, learning-rate
    adjustment and state_dict) with the Newton-Schulz iteration in ns_dtype, on the matrices of each
    shape at once, and its other ops on all the matrices at once (torch._foreach_*). torch's runs
    Newton-Schulz in bfloat16, one matrix at a time: a CPU without bfloat16 units emulates that,
    many times slower than float32 (docs/benchmarks.md), so train.py's muon_dtype='auto' picks
    float32 there. Its parameters are float32 (train.py's weights, under autocast or not): foreach
    ops round a scalar to a lower-precision parameter's dtype, where torch's per-matrix ones do
    not."""

    def __init__(self, params, ns_dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # torch's: momentum buffers made here
            if not params:  # no gradients yet (the foreach ops take no empty lists)
                continue
            lr, momentum = group['lr'], group['momentum']
            # torch's momentum with Nesterov's look-ahead, and its decoupled weight decay: each op
            # on all the matrices at once (on a GPU one launch, not one per matrix: at small shapes
            # the step's time is mostly the host's launching, docs/benchmarks.md)
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            nesterov = group['nesterov']
            updates = torch._foreach_lerp(grads, buffers, momentum) if nesterov else buffers
            torch._foreach_mul_(params, 1 - lr * group['weight_decay'])
            by_shape = {}  # {shape: indices of the updates of that shape}
            for i, update in enumerate(updates):
                by_shape.setdefault(update.shape, []).append(i)
            for shape, indices in by_shape.items():
                stacked = torch.stack([updates[i] for i in indices])  # (n, rows, cols)
                orthogonal = newton_schulz(stacked, self.ns_dtype, group['ns_coefficients'],
                                           group['ns_steps'], group['eps'])
                # in the parameters' dtype, as torch's add_ computes it: one launch for all n
                torch._foreach_add_([params[i] for i in indices],
                                    orthogonal.to(params[indices[0]].dtype).unbind(),
                                    alpha=-_adjust_lr(lr, group['adjust_lr_fn'], shape))
