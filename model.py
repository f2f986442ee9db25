"""
A GPT language model: token + position embeddings, pre-norm transformer blocks with causal
self-attention (PyTorch's scaled_dot_product_attention) and an MLP, and a tied output head.
The loss lives in train.py; the model maps token ids to logits and nothing else.
"""
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 65
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # bias in Linears and LayerNorms, like GPT-2; False is a bit better and faster
    activation: str = 'gelu'  # the MLP's nonlinearity, a key of ACTIVATIONS


ACTIVATIONS = {
    'gelu': F.gelu,  # exact (erf), nanoGPT's choice
    'gelu_tanh': partial(F.gelu, approximate='tanh'),  # the tanh approximation GPT-2 was trained with
}


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        # dropout_p must be 0 in eval: SDPA does not look at self.training
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)  # (B, nh, T, hs)
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
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}: pick n_embd as a multiple of n_head")
        if config.activation not in ACTIVATIONS:
            raise ValueError(f"activation='{config.activation}' is unknown: use one of {', '.join(ACTIVATIONS)}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix embeds and un-embeds tokens
        self.activation_checkpointing = False  # recompute each block's activations in backward: less memory, more compute
        self.init_weights()

    def init_weights(self):
        # GPT-2's init: N(0, 0.02) everywhere, zero biases, and residual projections scaled by
        # 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif name.endswith('weight') and p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith('bias'):
                nn.init.zeros_(p)
            else:  # LayerNorm gains
                nn.init.ones_(p)

    def num_params(self, non_embedding=True):
        """Parameter count; the position embedding is left out by default, as in GPT-2's papers
        (the token embedding is tied to the head, so it counts as a weight)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx):
        """idx: LongTensor (B, T) of token ids with T <= block_size.
        Returns logits: (B, T, vocab_size), float (the autocast dtype under autocast)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)  # (B, T, C); replays dropout masks exactly
            else:
                x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)

    def fully_shard(self, dtype):
        """FSDP2 (needs a process group): each block, then the root (embeddings, final norm, tied head), owns a
        1/world_size shard. Weights are gathered and gradients reduced in dtype; master weights stay float32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # imported only by sharded runs: ~1 s
        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for block in self.blocks:
            fully_shard(block, mp_policy=precision)
        fully_shard(self, mp_policy=precision)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """AdamW with weight decay on the Linear matrices only: none on biases, LayerNorm gains or the embeddings
        (the token embedding is also the tied head: decaying it shrinks rare tokens' rows). Fused: one kernel for
        all parameters, on CUDA and CPU alike."""
        def decays(name, p):
            return p.dim() >= 2 and not name.startswith(('wte.', 'wpe.'))
        params = list(self.named_parameters())  # tied weights appear once
        groups = [{'params': [p for n, p in params if decays(n, p)], 'weight_decay': weight_decay},
                  {'params': [p for n, p in params if not decays(n, p)], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L T C."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd

    @torch.inference_mode()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """idx: (B, T) prompt ids -> (B, T + max_new_tokens). Call model.eval() first."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]  # (B, <=block_size)
            logits = self(idx_cond)[:, -1, :].float() / temperature  # (B, vocab_size)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
