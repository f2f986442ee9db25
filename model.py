"""
A GPT language model: token + position embeddings, pre-norm transformer blocks with causal
self-attention (PyTorch's scaled_dot_product_attention) and an MLP, and a tied output head.
GPTConfig's defaults are GPT-2's architecture; its other switches are what fast small-GPT trainers
use: rotary positions, QK-norm, ReLU squared, an untied head, soft-capped logits and
zero-initialized output projections. forward returns the logits, or with targets the cross-entropy
loss, computed inside the model so that torch.compile fuses it with the output head instead of
materializing float32 logits of B x T x vocab.
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from optim import Muon, Optimizers


@dataclass
class GPTConfig:
    block_size: int = 256
    # the tokenizer's; the embedding and head have padded_vocab(vocab_size) rows
    vocab_size: int = 65
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    # bias in Linears and LayerNorms, like GPT-2; False is a bit better and faster
    bias: bool = True
    activation: str = 'gelu'  # the MLP's nonlinearity, a key of ACTIVATIONS
    # 'learned': a trained vector per position (GPT-2); 'rope': rotary, no parameters
    pos_emb: str = 'learned'
    # RMS-normalize each head's queries and keys: attention logits cannot blow up
    qk_norm: bool = False
    # the output head is the token embedding's matrix (GPT-2); False: a matrix of its own
    tie_head: bool = True
    # > 0: logits = cap * tanh(logits / cap), within (-cap, cap); 0: unbounded
    logit_softcap: float = 0.0
    # output projections (and an untied head) start at zero: every block starts as the identity
    zero_init: bool = False

    def __post_init__(self):
        """The one check of a model's shape, for every script: ValueError names the setting and the
        fix."""
        for key in ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd'):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}={getattr(self, key)} must be positive")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}: "
                             f"change one of them")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation='{self.activation}': use one of {', '.join(ACTIVATIONS)}")
        if self.pos_emb not in ('learned', 'rope'):
            raise ValueError(f"pos_emb='{self.pos_emb}': use 'learned' or 'rope'")
        if self.pos_emb == 'rope' and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"pos_emb='rope' turns pairs of dimensions: make the head size "
                             f"n_embd/n_head={self.n_embd // self.n_head} even")
        if self.logit_softcap < 0:
            raise ValueError(f"logit_softcap={self.logit_softcap} must be 0 (off) or positive")


ACTIVATIONS = {
    'gelu': F.gelu,  # exact (erf), nanoGPT's choice
    # the tanh approximation GPT-2 was trained with
    'gelu_tanh': partial(F.gelu, approximate='tanh'),
    # ReLU squared (Primer, So et al. 2021): sparse and cheap
    'relu2': lambda x: F.relu(x).square(),
}


def padded_vocab(vocab_size):
    """Rows of the embedding and the head: the vocabulary rounded up to a multiple of 64, as nanoGPT
    pads GPT-2's 50257 to 50304, so the head's matmul has GPU-friendly dimensions. The padding rows
    are never predicted: forward cuts them off the logits, so they are never sampled and never enter
    a loss."""
    return -(-vocab_size // 64) * 64


def rotary_tables(block_size, head_size):
    """cos and sin of position t times frequency 10000^(-2i/head_size): each
    (block_size, head_size // 2)."""
    freqs = 10000.0 ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), freqs)  # (block_size, hs/2)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotary position embedding (Su et al. 2021): each pair (x1[i], x2[i]) of x: (B, nh, T, hs)
    turns by the angle of its position, so a query-key dot product depends on their positions only
    through the offset."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, nh, T, hs/2)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)  # (B, nh, T, hs)


def causal_attention(q, k, v, dropout_p):
    """PyTorch's fused attention (flash or memory-efficient kernels), each position attending to
    itself and the positions before it. q: (B, nh, T, hs), k, v: (B, nh, Tk, hs) -> (B, nh, T, hs),
    in q's dtype; Tk > T only in generate's decoding step, one query after the cached keys, which
    sees them all: no mask, where is_causal would let it see the first key only. One device quirk:
    on a CPU, bfloat16 attention runs in float32, because PyTorch's CPU flash-attention kernel was
    3x slower in bfloat16 (its backward most) at head size 32 on an AVX512-BF16 CPU, where the
    matmuls around it gain 2x (docs/design.md)."""
    upcast = q.device.type == 'cpu' and q.dtype == torch.bfloat16  # the CPU quirk
    dtype = torch.float32 if upcast else q.dtype
    # autocast would cast them back
    with torch.autocast('cpu', enabled=False) if upcast else nullcontext():
        y = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                           dropout_p=dropout_p, is_causal=q.size(2) == k.size(2))
    return y.to(q.dtype)


class KVCache:
    """One attention layer's keys and values of the tokens generate() has run, so that each new
    token is computed alone against them: a prefill puts up to block_size tokens in, then every
    decoding step adds one."""

    def __init__(self):
        self.k = self.v = None  # (B, nh, tokens so far, hs)

    @property
    def pos(self):
        """Tokens held: the position of the next one."""
        return 0 if self.k is None else self.k.size(2)

    def add(self, k, v):
        """k, v: (B, nh, T, hs) of the next T tokens -> the keys and values of every token held,
        (B, nh, pos + T, hs)."""
        assert self.pos == 0 or k.size(2) == 1, (
            "after the prefill one token at a time: no cached key is masked")
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)  # (B, nh, pos + T, hs)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)  # (B, nh, pos + T, hs)
        return self.k, self.v


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qk_norm = config.qk_norm
        self.rope = config.pos_emb == 'rope'
        if self.rope:  # not in the state_dict: computed from the config
            cos, sin = rotary_tables(config.block_size, config.n_embd // config.n_head)
            self.register_buffer('cos', cos, persistent=False)  # (block_size, hs/2)
            self.register_buffer('sin', sin, persistent=False)  # (block_size, hs/2)
        # q, k, v in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache=None):
        B, T, C = x.size()
        # x's first position: generate's decoding steps start later
        start = cache.pos if cache is not None else 0
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        # cast back: CUDA autocast runs rms_norm in float32 (torch >= 2.12), v stays in bfloat16
        if self.qk_norm:
            q = F.rms_norm(q, (q.size(-1),)).to(v.dtype)  # (B, nh, T, hs), unit RMS per head
            k = F.rms_norm(k, (k.size(-1),)).to(v.dtype)  # (B, nh, T, hs)
        if self.rope:  # in q's dtype: SDPA needs q, k and v in one dtype under autocast
            cos, sin = (self.cos[start:start + T].to(q.dtype),
                        self.sin[start:start + T].to(q.dtype))  # (T, hs/2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # (B, nh, T, hs)
        # generate: the earlier tokens' keys and values, cached, join this token's
        if cache is not None:
            k, v = cache.add(k, v)  # (B, nh, start + T, hs)
        # dropout_p must be 0 in eval: SDPA does not look at self.training
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.act = ACTIVATIONS[config.activation]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(padded_vocab(config.vocab_size), config.n_embd)
        self.wpe = (nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == 'learned'
                    else None)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, padded_vocab(config.vocab_size), bias=False)
        if config.tie_head:
            # weight tying: one matrix embeds and un-embeds tokens
            self.lm_head.weight = self.wte.weight
        # recompute each block's activations in backward: less memory, more compute
        self.activation_checkpointing = False
        self.init_weights()

    def init_weights(self):
        # GPT-2's init: N(0, 0.02) everywhere, zero biases, and residual projections scaled by
        # 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth. zero_init
        # starts the residual projections at zero instead (each block adds nothing until it has
        # learned something, modded-nanogpt), and an untied head too: the first logits are all zero,
        # a uniform prediction, loss ln(vocab_size).
        for name, p in self.named_parameters():
            if self.config.zero_init and (name.endswith('c_proj.weight')
                                          or name == 'lm_head.weight'):
                nn.init.zeros_(p)
            elif name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif name.endswith('weight') and p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith('bias'):
                nn.init.zeros_(p)
            else:  # LayerNorm gains
                nn.init.ones_(p)

    def num_params(self, non_embedding=True):
        """Parameter count; the embeddings (lookups, no matmul) are left out by default, as in
        GPT-2's papers, except a token embedding tied to the head, which is also a weight."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= ((self.wpe.weight.numel() if self.wpe is not None else 0)
                  + (0 if self.config.tie_head else self.wte.weight.numel()))
        return n

    def forward(self, idx, targets=None, reduction='mean', caches=None):
        """idx: LongTensor (B, T) of token ids with T <= block_size. Without targets: the logits (B,
        T, vocab_size), in the autocast dtype under autocast. With targets (B, T), -100 where
        nothing is predicted: the float32 cross-entropy over the predicted positions, their mean or
        (reduction='sum') their sum. With caches (generate's KVCache per block): idx follows the
        cached tokens; the logits are its last position's only, (B, 1, vocab_size)."""
        B, T = idx.size()
        start = caches[0].pos if caches else 0  # idx's first position
        if start + T > self.config.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size "
                             f"{self.config.block_size}")
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            # (B, T, C) + (T, C)
            x = x + self.wpe(torch.arange(start, start + T, device=idx.device))
        x = self.drop(x)  # (B, T, C)
        for block, cache in zip(self.blocks, caches or [None] * len(self.blocks)):
            # the recomputation in backward replays the dropout masks exactly
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, cache, use_reentrant=False)  # (B, T, C)
            else:
                x = block(x, cache)  # (B, T, C)
        if caches:  # generate samples from the last position: the head runs on it alone
            x = x[:, -1:]  # (B, 1, C)
        # padding cut off
        logits = self.lm_head(self.ln_f(x))[..., :self.config.vocab_size]  # (B, T, vocab_size)
        # smooth, unlike clipping: gradients still flow near the cap
        if self.config.logit_softcap > 0:
            logits = (self.config.logit_softcap
                      * torch.tanh(logits / self.config.logit_softcap))  # (B, T, vocab_size)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                               reduction=reduction)  # ()

    def fully_shard(self, dtype, device_type):
        """FSDP2 (needs a process group): each block, then the root (embeddings, final norm, tied
        head), owns a 1/world_size shard. Weights are gathered in dtype; master weights stay
        float32. The mesh is built for the device in use: FSDP's default mesh is the machine's
        accelerator, CUDA on a GPU host even with device=cpu."""
        # imported only by sharded runs: ~1 s
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
        # gradients are reduced, and accumulated between syncs, in float32 as under DDP
        # (torchtitan's default): bfloat16 accumulation over micro-batches loses precision that DDP
        # keeps
        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in self.blocks:
            fully_shard(block, mesh=mesh, mp_policy=precision)
        fully_shard(self, mesh=mesh, mp_policy=precision)

    def configure_optimizers(self, weight_decay, learning_rate, betas, optimizer='adamw',
                             muon_lr=0.02, muon_momentum=0.95, muon_dtype='bfloat16',
                             layer_lr_decay=1.0):
        """The optimizer train.py steps, schedules and saves. 'adamw': AdamW for every parameter. It
        decays the Linear matrices only: no biases, LayerNorm gains or embeddings (the token
        embedding may be the tied head: decaying it shrinks rare tokens' rows); fused: one kernel
        for all parameters, on CUDA and CPU alike. 'muon': Muon (torch's, its Newton-Schulz in
        muon_dtype) for the blocks' 2-D matrices, where its orthogonalized update is made for (not
        the embeddings, whose rows are looked up one by one, nor the head), at its own base rate
        muon_lr, and AdamW at learning_rate for the rest. c_attn's fused (3C, C) matrix is
        orthogonalized as one, q, k and v together (modded-nanogpt splits them), and torch's Muon
        scales each matrix's rate by sqrt(max(1, rows / cols)): sqrt(3) x muon_lr for c_attn, 2x for
        c_fc, 1x for the projections. layer_lr_decay < 1 gives each depth its own groups, at
        lr_scale's multiple of both rates; the groups at 1x come first (train.py logs group 0's
        rate). Another optimizer goes here: build it, add it to the list, its name to optim.py's
        OPTIMIZERS and its keys to train.py."""
        assert optimizer in ('adamw', 'muon'), f"configure_optimizers has no {optimizer!r}: add it"
        def decays(name, p):
            return p.dim() >= 2 and not name.startswith(('wte.', 'wpe.'))
        muon = self.muon_params() if optimizer == 'muon' else []
        muon_names = {n for n, _ in muon}
        adamw = [(n, p) for n, p in self.named_parameters() if n not in muon_names]
        scale = {n: self.lr_scale(n, layer_lr_decay) for n, _ in self.named_parameters()}
        scales = sorted(set(scale.values()), reverse=True)  # 1 (the final norm's) first, by depth
        groups = [{'params': [p for n, p in adamw if decays(n, p) == decayed and scale[n] == s],
                   'weight_decay': weight_decay if decayed else 0.0, 'lr': learning_rate * s}
                  for s in scales for decayed in (True, False)]
        if layer_lr_decay < 1:  # no empty groups (FSDP's optimizer load takes one at most); off,
            groups = [g for g in groups if g['params']]  # the two that older checkpoints hold
        optimizers = [torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)]
        if optimizer == 'muon':
            groups = [{'params': [p for n, p in muon if scale[n] == s], 'lr': muon_lr * s}
                      for s in scales if any(scale[n] == s for n, _ in muon)]
            optimizers.append(Muon(groups, getattr(torch, muon_dtype), lr=muon_lr,
                                   weight_decay=weight_decay, momentum=muon_momentum))
        return Optimizers(optimizers)

    def lr_scale(self, name, layer_lr_decay):
        """A parameter's multiple of its optimizer's rate under layer-wise decay, for fine-tuning:
        the layers nearest the output adapt most. Block i's: decay^(n_layer - i); the embeddings'
        (a tied head's too: it is the token embedding): decay^(n_layer + 1); the final norm's and an
        untied head's: 1."""
        if name.startswith('blocks.'):
            return layer_lr_decay ** (self.config.n_layer - int(name.split('.')[1]))
        if name.startswith(('wte.', 'wpe.')):
            return layer_lr_decay ** (self.config.n_layer + 1)
        return 1.0

    def muon_params(self):
        """[(name, parameter)] of the blocks' 2-D matrices: Muon's, under optimizer='muon'."""
        return [(n, p) for n, p in self.named_parameters()
                if n.startswith('blocks.') and p.dim() == 2]

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L T C."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
                 use_cache=True):
        """idx: (B, T) prompt ids -> (B, T + max_new_tokens): the prompt, then generate_tokens'."""
        return torch.cat([idx, *self.generate_tokens(idx, max_new_tokens, temperature, top_k,
                                                     generator, use_cache)], dim=1)

    @torch.inference_mode()  # no graph: the cache would keep every step's, growing with the square
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
                        use_cache=True):
        """idx: (B, T) prompt ids; yields each new token, (B, 1), as it is drawn (sample.py prints
        them as they come). Call model.eval() first. Each token is drawn from the logits of the last
        block_size tokens at positions 0, 1, ..., as nanoGPT does. use_cache=False recomputes all of
        them for every token (nanoGPT's way). With the cache, a prefill computes them once, keeping
        each layer's keys and values, and then each new token is computed alone against those (a
        decoding step). Past block_size the window slides by a token per step, and no cached key or
        value stays valid: with learned positions every token's position changes, and with rope too
        each token's hidden state from the second layer on was computed seeing tokens that have left
        the window. Each step then prefills the last block_size tokens again, which is what
        use_cache=False computes, so both give the same tokens and the cache gains nothing."""
        block_size = self.config.block_size
        caches = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(idx[:, -block_size:])  # (B, <=block_size, vocab_size)
            elif caches is None or caches[0].pos == block_size:
                # the prompt, or a window that slides: prefill
                caches = [KVCache() for _ in self.blocks]
                logits = self(idx[:, -block_size:], caches=caches)  # (B, 1, vocab_size)
            else:  # decode: the token drawn last, at the position after the cached ones
                logits = self(idx[:, -1:], caches=caches)  # (B, 1, vocab_size)
            logits = logits[:, -1, :].float() / temperature  # (B, vocab_size)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
            yield idx_next
