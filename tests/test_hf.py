"""GPT-2 in and out of the Hugging Face format, checked against transformers itself on a random tiny
GPT2LMHeadModel: loading gives its logits, a finetune resumes exactly, an export loads back as
GPT2LMHeadModel. Nothing is downloaded: GPT-2 names are served from a Hugging Face cache the tests
build, with HF_HUB_OFFLINE=1."""
import hashlib
import json
import os
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import forked
import hf
import model as model_module
import prepare
from conftest import REPO, make_corpus, read_metrics, run_train, write_ranks
from model import GPT, GPTConfig

MERGES = [b'th', b'he', b'the', b' t', b'in', b'an']
N_VOCAB = 256 + len(MERGES) + 1  # the bytes, the merges and <|endoftext|>
SEPARATOR = '-' * 40 + '\n'


@pytest.fixture(scope='module')
def bpe_data(root):
    """data_dir with a 'shakespeare' dataset: one text tokenized with a tiny GPT-2-style .tiktoken
    BPE."""
    write_ranks(root / 'tiny.tiktoken', MERGES)
    docs = make_corpus(str(root / 'docs'))
    text = ''.join(open(os.path.join(docs, name)).read() for name in sorted(os.listdir(docs)))
    (root / 'input.txt').write_text(text)
    prepare.prepare('shakespeare', data_dir=str(root / 'data'), input_path=str(root / 'input.txt'),
                    tokenizer=str(root / 'tiny.tiktoken'))
    return str(root / 'data')


@pytest.fixture(scope='module')
def tiny_gpt2(root):
    """A random GPT2LMHeadModel folder as save_pretrained writes it. Every tensor is random,
    LayerNorms and biases too, so a swapped or untransposed tensor shows in the logits."""
    # transformers is imported where it is used: its import takes about 4 s, which every
    # pytest-xdist worker would pay when it collects this file
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=N_VOCAB, n_positions=64, n_embd=64, n_layer=2,
                                       n_head=4))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(root / 'tiny-gpt2'))
    return str(root / 'tiny-gpt2')


def load_ours(source, block_size=64):
    args, state, origin = hf.load_gpt2(source, block_size, N_VOCAB)
    ours = GPT(GPTConfig(**args)).eval()
    ours.load_state_dict(state)
    return ours, origin


def logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return getattr(out, 'logits', out)  # transformers returns an output object, GPT the tensor


def test_loads_folder_file_and_openai_layout_with_transformers_logits(tiny_gpt2, tmp_path):
    from transformers import GPT2LMHeadModel
    theirs = GPT2LMHeadModel.from_pretrained(tiny_gpt2).eval()
    idx = torch.randint(0, N_VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    expected = logits(theirs, idx)
    ours, origin = load_ours(tiny_gpt2)
    assert ours.config.activation == 'gelu_tanh' and ours.config.bias and ours.config.n_head == 4
    assert torch.allclose(logits(ours, idx), expected, atol=1e-5, rtol=0)
    weights = os.path.join(tiny_gpt2, 'model.safetensors')
    assert origin == {'init_from': tiny_gpt2, 'weights': weights,
                      'sha256': hashlib.sha256(open(weights, 'rb').read()).hexdigest()}
    # a shorter block_size crops the position embedding: the first positions' logits stay the same
    cropped, _ = load_ours(tiny_gpt2, block_size=16)
    assert cropped.wpe.weight.shape[0] == 16
    assert torch.allclose(logits(cropped, idx[:, :16]), expected[:, :16], atol=1e-5, rtol=0)
    # the single weights file
    single, _ = load_ours(weights)
    assert all(torch.equal(a, b)
               for a, b in zip(single.state_dict().values(), ours.state_dict().values()))
    # OpenAI's layout: pytorch_model.bin, no 'transformer.' prefix, causal-mask buffers, an explicit
    # tied head
    openai = tmp_path / 'openai'
    openai.mkdir()
    shutil.copy(os.path.join(tiny_gpt2, 'config.json'), openai)
    tensors = {k.removeprefix('transformer.'): v for k, v in load_file(weights).items()}
    tensors |= {f'h.{i}.attn.bias': torch.tril(torch.ones(1, 1, 64, 64)) for i in range(2)}
    torch.save(tensors | {'lm_head.weight': tensors['wte.weight']}, openai / 'pytorch_model.bin')
    old, _ = load_ours(str(openai))
    assert all(torch.equal(a, b)
               for a, b in zip(old.state_dict().values(), ours.state_dict().values()))


def test_export_loads_in_transformers_as_gpt2_with_our_logits(tiny_gpt2, tmp_path):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel
    torch.manual_seed(0)
    without_bias = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50,
                                 bias=False)).eval()
    for ours, activation in ((load_ours(tiny_gpt2)[0], 'gelu_new'), (without_bias, 'gelu')):
        folder = str(tmp_path / activation)
        hf.export_gpt2(ours, folder, eot_id=N_VOCAB - 1)
        theirs, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert (type(theirs) is GPT2LMHeadModel and not info['missing_keys']
                and not info['unexpected_keys'])
        assert (theirs.config.activation_function == activation
                and theirs.config.n_positions == ours.config.block_size)
        idx = torch.randint(0, ours.config.vocab_size, (2, ours.config.block_size))
        assert torch.allclose(logits(theirs.eval(), idx), logits(ours, idx), atol=1e-5, rtol=0)
    assert sorted(os.listdir(tmp_path)) == ['gelu', 'gelu_new']  # no temp folder left beside them
    # exported biases of a model without biases are zeros; the export reads back in exactly
    assert not load_file(str(tmp_path / 'gelu' / 'model.safetensors'))[
        'transformer.h.0.mlp.c_fc.bias'].any()
    again = hf.load_gpt2(str(tmp_path / 'gelu_new'), 64, N_VOCAB)[1]
    assert all(torch.equal(again[k], v) for k, v in load_ours(tiny_gpt2)[0].state_dict().items())


def test_export_refuses_what_gpt2_cannot_hold_and_a_used_folder(tiny_gpt2, tmp_path, monkeypatch):
    def refusal(model, folder=str(tmp_path / 'out')):
        with pytest.raises(hf.HFError) as e:
            hf.export_gpt2(model, folder)
        assert '\n' not in str(e.value) and not os.path.exists(tmp_path / 'out')
        return str(e.value)
    used = tmp_path / 'used'
    used.mkdir()
    (used / 'keep.txt').write_text('mine')
    assert 'not an empty folder' in refusal(load_ours(tiny_gpt2)[0], str(used))
    assert os.listdir(used) == ['keep.txt']
    assert 'cannot make' in refusal(load_ours(tiny_gpt2)[0],
                                    str(used / 'keep.txt' / 'sub' / 'export'))
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=20)
    forked = GPT(config)  # a fork that adds a parameter GPT-2 has no place for
    forked.blocks[0].attn.gain = torch.nn.Parameter(torch.ones(16))
    assert 'unexpected: h.0.attn.gain' in refusal(forked)
    untied = GPT(config)
    untied.lm_head.weight = torch.nn.Parameter(untied.wte.weight.detach().clone())
    assert 'output head not tied' in refusal(untied)
    # an activation model.py gains without a name for it in the export's map
    monkeypatch.setitem(model_module.ACTIVATIONS, 'relu2', lambda x: torch.relu(x) ** 2)
    assert "activation='relu2'" in refusal(GPT(GPTConfig(**{**config.__dict__,
                                                            'activation': 'relu2'})))


def test_load_errors_are_one_line(tiny_gpt2, tmp_path, monkeypatch):
    def refusal(source, block_size=64, vocab_size=N_VOCAB):
        with pytest.raises(hf.HFError) as e:
            hf.load_gpt2(source, block_size, vocab_size)
        assert '\n' not in str(e.value)
        return str(e.value)
    assert 'know 263 tokens, the dataset 65' in refusal(tiny_gpt2, vocab_size=65)
    assert 'block_size=128 exceeds the 64 positions' in refusal(tiny_gpt2, block_size=128)
    (tmp_path / 'empty').mkdir()
    assert 'needs config.json and model.safetensors' in refusal(str(tmp_path / 'empty'))
    broken = tmp_path / 'broken'
    shutil.copytree(tiny_gpt2, broken)
    tensors = load_file(str(broken / 'model.safetensors'))
    del tensors['transformer.h.1.mlp.c_fc.bias']
    save_file(tensors, str(broken / 'model.safetensors'), metadata={'format': 'pt'})
    assert 'missing: h.1.mlp.c_fc.bias' in refusal(str(broken))
    config = json.load(open(broken / 'config.json')) | {'activation_function': 'relu',
                                                        'layer_norm_epsilon': 1e-6}
    json.dump(config, open(broken / 'config.json', 'w'))
    assert "layer_norm_epsilon=1e-06; activation_function='relu'" in refusal(str(broken))
    # a config.json that is not GPT-2's: damaged, or a train.py run's beside a lone .safetensors
    (broken / 'config.json').write_text('{bad')
    assert refusal(str(broken)).startswith(f"cannot read {broken}/config.json (Expecting")
    lone = tmp_path / 'run' / 'model.safetensors'
    lone.parent.mkdir()
    shutil.copy(os.path.join(tiny_gpt2, 'model.safetensors'), lone)
    json.dump({'n_head': {'value': 4, 'source': 'default'}}, open(lone.parent / 'config.json', 'w'))
    assert refusal(str(lone)) == (
        f"{lone.parent}/config.json is not a Hugging Face GPT-2 config.json (a dict whose n_head "
        f"is a positive integer): put the weights in a folder with their own config.json")
    # a lone file: its width (64) gives no head count; GPT-2's own widths do
    os.remove(lone.parent / 'config.json')
    assert refusal(str(lone)) == (
        f"{lone} has no config.json beside it to give its head count, and its width 64 is none of "
        f"GPT-2's: put its config.json in its folder")
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(vocab_size=N_VOCAB, n_positions=8, n_embd=768, n_layer=1,
                               n_head=12)).save_pretrained(str(tmp_path / 'wide'))
    args, _, _ = hf.load_gpt2(str(tmp_path / 'wide' / 'model.safetensors'), None, None)
    assert args['n_head'] == 12
    os.remove(tmp_path / 'wide' / 'config.json')
    assert hf.load_gpt2(str(tmp_path / 'wide' / 'model.safetensors'), None, None)[0] == args
    monkeypatch.setitem(sys.modules, 'huggingface_hub', None)  # as if not installed
    assert 'pip install huggingface_hub' in refusal('gpt2')


def fake_hub_cache(home, name, folder):
    """HF_HOME with folder's files cached as the hub's `name`, laid out as huggingface_hub lays out
    its cache."""
    commit = '0' * 40
    repo = home / 'hub' / f'models--{name}'
    (repo / 'refs').mkdir(parents=True)
    (repo / 'refs' / 'main').write_text(commit)
    shutil.copytree(folder, repo / 'snapshots' / commit)
    return str(home)


def trajectory(out_dir):
    return [(r['step'], r['loss'], r['lr'], r['grad_norm']) for r in read_metrics(out_dir, 'train')]


@pytest.mark.slow
def test_gpt2_by_name_from_the_cache_finetunes_and_resumes_exactly(root, bpe_data, tiny_gpt2,
                                                                   tmp_path):
    env = {**os.environ, 'HF_HUB_OFFLINE': '1',
           'HF_HOME': fake_hub_cache(tmp_path / 'home', 'gpt2', tiny_gpt2)}
    args = ['--init_from=gpt2', '--dataset=shakespeare', '--dropout=0.1', '--block_size=32',
            '--max_iters=6', '--lr_decay_iters=6', '--eval_interval=3']
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    held = {run: tmp_path / f'held-{run}' for run in ('start', 'resume')}
    for folder in held.values():
        folder.mkdir()
    started = run_train(straight, bpe_data, *args, probe=True,
                        env={**env, 'PROBE_HELD': str(held['start'])})
    # the weights' shape, not 32
    assert 'building the model: 2 layers, 4 heads, 64 wide' in started.stdout
    run_train(split, bpe_data, *args, '--max_iters=3', env=env)
    # resume as a user does: init_from changes, the shape keys stay unset (the config still says
    # n_embd=32)
    run_train(split, bpe_data, *[a for a in args if not a.startswith('--init_from')],
              '--init_from=resume', probe=True, env={**env, 'PROBE_HELD': str(held['resume'])})
    assert trajectory(split) == trajectory(straight) and len(trajectory(split)) == 6
    # GPT-2's weights and the checkpoint's, once in the model, are let go before the first step
    # (the smoke test's): a second copy in host memory on every rank, gigabytes at GPT-2 XL
    for folder in held.values():
        counts = json.load(open(folder / 'held.0'))
        assert counts['loaded'] > 0 and counts['alive'] and not any(counts['alive']), counts
    a = torch.load(os.path.join(straight, 'last.pt'), weights_only=True)
    b = torch.load(os.path.join(split, 'last.pt'), weights_only=True)
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    cached = os.path.join(env['HF_HOME'], 'hub', 'models--gpt2', 'snapshots', '0' * 40,
                          'model.safetensors')
    record = {'init_from': 'gpt2', 'weights': cached,
              'sha256': hashlib.sha256(open(cached, 'rb').read()).hexdigest()}
    assert a['pretrained'] == b['pretrained'] == record
    assert json.load(open(os.path.join(split, 'meta.json')))['pretrained'] == record
    assert a['model_args'] | {'dropout': 0.1} == {'n_layer': 2, 'n_head': 4, 'n_embd': 64,
                                                  'block_size': 32, 'bias': True,
                                                  'activation': 'gelu_tanh', 'vocab_size': N_VOCAB,
                                                  'dropout': 0.1, 'pos_emb': 'learned',
                                                  'qk_norm': False, 'tie_head': True,
                                                  'logit_softcap': 0.0, 'zero_init': False}
    config = json.load(open(os.path.join(straight, 'config.json')))
    assert (config['n_embd'] == {'value': 64, 'source': 'weights of gpt2'}
            and config['bias']['value'] is True)


@pytest.mark.slow
def test_nanogpt_finetune_config_runs_unchanged(bpe_data, tiny_gpt2, tmp_path):
    config = os.path.join(REPO, 'config', 'finetune_shakespeare.py')
    cmd = ['train.py', config, f'--data_dir={bpe_data}', f'--out_dir={tmp_path / "out"}']
    # as written (gpt2-xl), offline and without a cache: one line that says how to get the files
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'HF_HOME': str(tmp_path / 'empty_home')}
    result = forked.run(*cmd, env=env, timeout=120)
    assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
    assert ("'gpt2-xl' are not in the Hugging Face cache" in result.stderr
            and 'init_from=FOLDER' in result.stderr)
    assert not os.path.exists(tmp_path / 'out')
    # without HF_HUB_OFFLINE, the Hub out of reach: one line at once, not the Hub's retries (about
    # 25 s of them, a line each)
    env = {**env, 'HF_HUB_OFFLINE': '0', 'HF_ENDPOINT': 'http://127.0.0.1:9'}
    result = forked.run(*cmd, env=env, timeout=120)
    assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
    assert "'gpt2-xl' are not in the Hugging Face cache" in result.stderr
    assert not os.path.exists(tmp_path / 'out')
    result = forked.run(*cmd, '--init_from=gtp2', timeout=120)
    assert (result.returncode == 2
            and result.stderr.startswith("error: init_from='gtp2': use 'scratch'")), result.stderr
    # from the tiny folder, at learning rate 0 (which the smoke test would rightly stop: off): it
    # trains, and the weights it holds are the folder's
    result = forked.run(*cmd, f'--init_from={tiny_gpt2}', '--block_size=32', '--max_iters=2',
                        '--device=cpu', '--dtype=float32', '--num_workers=0', '--learning_rate=0.0',
                        '--smoke_steps=0', timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r['step'] for r in read_metrics(str(tmp_path / 'out'), 'train')] == [1, 2]
    saved = torch.load(tmp_path / 'out' / 'last.pt', weights_only=True)['model']
    assert all(torch.equal(saved[k], v)
               for k, v in load_ours(tiny_gpt2, block_size=32)[0].state_dict().items())


# nanoGPT's config/eval_gpt2.py, as it is
EVAL_GPT2 = """# evaluate the base gpt2
# n_layer=12, n_head=12, n_embd=768
# 124M parameters
batch_size = 8
eval_iters = 500 # use more iterations to get good estimate
eval_only = True
wandb_log = False
init_from = 'gpt2'
"""


@pytest.mark.slow
def test_nanogpt_eval_gpt2_config_runs_unchanged(bpe_data, tiny_gpt2, tmp_path):
    config = tmp_path / 'eval_gpt2.py'
    config.write_text(EVAL_GPT2)
    env = {**os.environ, 'HF_HUB_OFFLINE': '1',
           'HF_HOME': fake_hub_cache(tmp_path / 'home', 'gpt2', tiny_gpt2)}
    out = tmp_path / 'out'
    result = forked.run('train.py', str(config), f'--data_dir={bpe_data}', '--dataset=shakespeare',
                        '--block_size=32', '--device=cpu', f'--out_dir={out}', env=env,
                        timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r'^eval only, iteration 0: train \d+\.\d{4}, val \d+\.\d{4}$', result.stdout,
                     re.M), result.stdout
    assert not out.exists()


@pytest.mark.slow
def test_export_of_a_trained_run_generates_greedily_like_sample_py(data_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = str(tmp_path / 'run')
    run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10')
    export = str(tmp_path / 'hf')
    sample = lambda *args: forked.run('sample.py', f'--out_dir={out}', *args, timeout=120)
    assert sample(f'--export_hf={export}').returncode == 0
    again = sample(f'--export_hf={export}')  # never over an existing export
    assert (again.returncode == 2 and again.stderr.count('\n') == 1
            and 'not an empty folder' in again.stderr)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(export).st_mode & 0o777 == 0o777 & ~umask  # as save_pretrained's: readable
    assert all(os.stat(os.path.join(export, name)).st_mode & 0o777 == 0o666 & ~umask
               for name in os.listdir(export))  # model.safetensors too, not its owner's alone
    unwritable = sample('--export_hf=/proc/hf')
    assert (unwritable.returncode == 2 and unwritable.stderr.startswith(
        'error: cannot write in /proc (') and unwritable.stderr.endswith(
        '): pick another path\n')), unwritable.stderr
    greedy = sample('--top_k=1', '--num_samples=1', '--max_new_tokens=24', '--dtype=float32')
    assert greedy.returncode == 0, greedy.stderr
    theirs = AutoModelForCausalLM.from_pretrained(export).eval()
    # the character vocabulary, exported beside the weights
    their_tokenizer = AutoTokenizer.from_pretrained(export)
    generated = theirs.generate(torch.tensor([their_tokenizer.encode('\n')]), max_new_tokens=24,
                                do_sample=False)
    assert greedy.stdout == their_tokenizer.decode(generated[0]) + '\n' + SEPARATOR
