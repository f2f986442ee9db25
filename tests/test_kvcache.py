"""generate() with the KV cache against the uncached path: the same tokens, one new token per
decoding step, and a window past block_size recomputed as the uncached path computes it."""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES
from model import GPT, GPTConfig

BLOCK = 16


def sharp_gpt(**kw):
    """A random GPT whose attention and positions matter: at the usual init (std 0.02) attention is
    near uniform, and tokens decoded at the wrong positions still came out the same."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=50, n_layer=2, n_head=2, n_embd=32,
                          **kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 2 / p.size(1) ** 0.5)
    return model


@pytest.mark.parametrize('kw',
                         [dict(pos_emb='learned'),
                          dict(pos_emb='rope', qk_norm=True, logit_softcap=15.0)],
                         ids=['learned', 'rope-qk_norm-softcap'])
@pytest.mark.parametrize('prompt_len', [5, BLOCK + 4], ids=['prompt-in-block', 'prompt-past-block'])
@pytest.mark.parametrize('device', DEVICES)
def test_cached_tokens_equal_uncached_greedy_and_sampled(kw, prompt_len, device):
    # float32, 2 prompts, 30 new tokens: the short prompt decodes up to block_size and then slides
    # past it
    model = sharp_gpt(**kw).to(device)
    # (2, prompt_len)
    prompts = torch.randint(0, 50, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    prompts = prompts.to(device)
    greedy = [model.generate(prompts, 30, top_k=1, use_cache=use_cache)
              for use_cache in (True, False)]
    assert torch.equal(*greedy)
    sampled = [model.generate(prompts, 30, temperature=0.8, top_k=10,
                              generator=torch.Generator(device).manual_seed(2),
                              use_cache=use_cache) for use_cache in (True, False)]
    assert torch.equal(*sampled) and not torch.equal(sampled[0], greedy[0])


@pytest.mark.parametrize('pos_emb', ['learned', 'rope'])
def test_each_decoding_step_runs_one_new_token_until_the_window_slides(pos_emb):
    model = sharp_gpt(pos_emb=pos_emb)
    # tokens each forward of the first block ran, with and without the cache
    lengths = {True: [], False: []}
    for use_cache in (True, False):
        hook = model.blocks[0].register_forward_hook(
            lambda block, args, out: lengths[use_cache].append(args[0].size(1)))
        model.generate(torch.zeros(2, 5, dtype=torch.long), 15, top_k=1, use_cache=use_cache)
        hook.remove()
    # the prompt once, a token per step up to block_size; then every window has moved and is
    # computed anew
    assert lengths[True] == [5] + [1] * (BLOCK - 5) + [BLOCK] * 3
    assert lengths[False] == list(range(5, BLOCK + 1)) + [BLOCK] * 3


def test_cached_attention_runs_in_float32_under_bfloat16_on_cpu(monkeypatch):
    model = sharp_gpt(pos_emb='rope')
    seen, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, 'scaled_dot_product_attention',
                        lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype, k.size(2)))
                        or sdpa(q, k, v, **kw))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, top_k=1)
    # 2 layers: the prompt's 3 keys, then 4, 5, 6 as each decoding step adds one
    assert seen == [(torch.float32,) * 3 + (keys,) for keys in (3, 4, 5, 6) for _ in range(2)]


def test_cache_is_used_in_train_mode_with_activation_checkpointing():
    # generate() in train mode goes through the checkpointed blocks: they must get the cache too
    # (dropout 0)
    model = sharp_gpt(pos_emb='rope').train()
    model.activation_checkpointing = True
    prompt = torch.zeros(1, 5, dtype=torch.long)
    assert torch.equal(model.generate(prompt, 20, top_k=1),
                       model.generate(prompt, 20, top_k=1, use_cache=False))
