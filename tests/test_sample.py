"""sample.py on a finished tiny run: seeded, greedy at top_k=1, prompts from files, clean errors."""
import json
import os
import pickle
import types

import pytest
import torch

import forked
import sample
import tokenizer
from conftest import DEVICES, REPO, run_train, write_ranks
from model import GPT, GPTConfig

SEPARATOR = '-' * 40 + '\n'


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory, data_dir):
    out = str(tmp_path_factory.mktemp('sample') / 'run')
    run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10')
    return out


def run_sample(*args):
    return forked.run('sample.py', *args, timeout=120)


@pytest.mark.parametrize('device', DEVICES)
def test_seed_decides_the_samples(run_dir, device):
    # sample i is drawn with seed + i: the second sample of --seed=1 is the first of --seed=2, in
    # another process
    args = [f'--out_dir={run_dir}', '--max_new_tokens=30', f'--device={device}']
    seed_1 = run_sample(*args, '--seed=1', '--num_samples=2')
    seed_2 = run_sample(*args, '--seed=2', '--num_samples=1')
    assert seed_1.returncode == 0, seed_1.stderr
    assert f" on {'cuda:0' if device == 'cuda' else 'cpu'} " in seed_1.stderr
    first, second = seed_1.stdout.split(SEPARATOR)[:2]
    assert seed_2.stdout == second + SEPARATOR and first != second
    # an empty prompt starts where documents do: a newline for a char tokenizer
    assert first.startswith('\n')


def test_an_empty_prompt_starts_where_the_datasets_documents_do(run_dir, data_dir):
    # a BPE dataset of one text cut by position holds no end-of-text: the sample started from that
    # token, which the model never saw as input
    ckpt = torch.load(os.path.join(run_dir, 'best.pt'), weights_only=True)
    with open(os.path.join(data_dir, 'toy', 'meta.json')) as f:
        splits = json.load(f)['splits']
    assert ckpt['dataset']['documents'] == {s: v['documents'] for s, v in splits.items()}
    assert min(ckpt['dataset']['documents'].values()) > 1
    bpe = types.SimpleNamespace(start='<|endoftext|>')
    assert sample.empty_prompt(bpe, ckpt['dataset']) == '<|endoftext|>'
    one_text = {**ckpt['dataset'], 'documents': {'train': 1, 'val': 1, 'test': 1}}
    assert sample.empty_prompt(bpe, one_text) == '\n'
    assert sample.empty_prompt(bpe, {}) == '<|endoftext|>'  # older checkpoints, llm.c's data


def test_top_k_1_is_greedy_with_a_prompt_file(run_dir, tmp_path):
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('the cat ')
    result = run_sample(f'--out_dir={run_dir}', f'--start=FILE:{prompt}', '--top_k=1',
                        '--num_samples=1', '--max_new_tokens=12', '--device=cpu',
                        '--dtype=float32')  # the reference below computes in float32
    assert result.returncode == 0, result.stderr
    assert 'not in the vocabulary' not in result.stderr
    ckpt = torch.load(os.path.join(run_dir, 'best.pt'), weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.eval()
    tok = tokenizer.load(ckpt['dataset']['tokenizer'])
    idx = torch.tensor([tok.encode('the cat ')])
    with torch.no_grad():
        for _ in range(12):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    assert result.stdout == tok.decode(idx[0].tolist()) + '\n' + SEPARATOR


def test_prompt_characters_the_vocabulary_lacks_are_refused_in_one_line(run_dir, tmp_path):
    # the corpus is lower-case: 13 characters unknown, the first ten named. They were sampled as
    # the unknown id 0, with a warning
    result = run_sample(f'--out_dir={run_dir}', '--start=€uro {€} ABCDEFGHIJ',
                        '--num_samples=1', '--max_new_tokens=1', '--device=cpu')
    assert result.returncode == 2 and result.stdout == ''
    assert result.stderr == ("error: the prompt holds characters the vocabulary lacks: '€', '{', "
                             "'}', 'A', 'B', 'C', 'D', 'E', 'F', 'G' and 3 more: write it with the "
                             "dataset's characters (its meta.json's tokenizer 'chars')\n")
    # a prompt file's CRLF line endings are '\n' for a vocabulary without '\r' (a lone '\r' is no
    # line ending here: it was read as one), and kept for one with it (a CRLF corpus's: dropped)
    prompt = tmp_path / 'crlf.txt'
    prompt.write_bytes(b'the cat\r\n')
    result = run_sample(f'--out_dir={run_dir}', f'--start=FILE:{prompt}', '--num_samples=1',
                        '--max_new_tokens=1', '--device=cpu')
    assert result.returncode == 0 and result.stdout.startswith('the cat\n'), result.stderr
    prompt.write_bytes(b'the\rcat\n')
    result = run_sample(f'--out_dir={run_dir}', f'--start=FILE:{prompt}', '--num_samples=1',
                        '--max_new_tokens=1', '--device=cpu')
    assert result.returncode == 2 and "the prompt holds characters the vocabulary lacks: '\\r'" \
        in result.stderr, result.stderr
    # a vocabulary with '\r' and no '\n': read as '\n', the '\r' was refused
    ckpt = torch.load(os.path.join(run_dir, 'best.pt'), weights_only=True)
    chars = ckpt['dataset']['tokenizer']['chars']
    swapped = {next(c for c in chars if c not in 'the cat\n'): '\r', '\n': '\x01'}
    ckpt['dataset']['tokenizer']['chars'] = [swapped.get(c, c) for c in chars]
    torch.save(ckpt, tmp_path / 'crlf.pt')
    prompt.write_bytes(b'the cat\r')
    result = run_sample(f'--ckpt={tmp_path / "crlf.pt"}', f'--start=FILE:{prompt}',
                        '--num_samples=1', '--max_new_tokens=1', '--device=cpu')
    assert result.returncode == 0, result.stderr


def test_the_default_prompt_is_sampled_where_train_has_no_newline(run_dir, tmp_path):
    # the default prompt, '\n', was refused as a character the vocabulary lacks: a one-line
    # corpus's (here its newline's place in the vocabulary given to another character)
    ckpt = torch.load(os.path.join(run_dir, 'best.pt'), weights_only=True)
    chars = ckpt['dataset']['tokenizer']['chars']
    ckpt['dataset']['tokenizer']['chars'] = ['\x01' if c == '\n' else c for c in chars]
    torch.save(ckpt, tmp_path / 'flat.pt')
    result = run_sample(f'--ckpt={tmp_path / "flat.pt"}', '--num_samples=1',
                        '--max_new_tokens=3', '--device=cpu')
    assert result.returncode == 0, result.stderr


@pytest.mark.fresh
def test_missing_checkpoint_is_a_one_line_error(tmp_path):
    result = run_sample(f'--out_dir={tmp_path}')
    assert result.returncode == 2 and result.stdout == ''
    assert (result.stderr.startswith('error: checkpoint')
            and result.stderr.count('\n') == 1), result.stderr


@pytest.mark.parametrize('args, message', [
    (['--temperature=0'], "temperature=0.0 must be at least 1e-6: for greedy decoding use top_k=1"),
    # 0 in float32: the logits over it were NaNs, and torch.multinomial a traceback
    (['--temperature=1e-300'], "temperature=1e-300 must be at least 1e-6"),
    (['--seed=18446744073709551615', '--num_samples=2'],
     "seed=18446744073709551615 is too large: sample i draws with seed + i, which must be below "
     "2**64"),
    # a segmentation fault
    (['--threads=100000'], f"threads=100000 is more than this machine's {os.cpu_count()} CPUs"),
    # export_hf was left undone, with exit code 0
    (['--export=w.pt', '--export_hf=hf'], "export and export_hf are both set: give one"),
    # a byte that is not UTF-8 on the command line (Python's surrogate escape)
    (['--start=caf\udce9'], "the prompt holds '\\udce9', which is not text: pass it in UTF-8"),
    (['--ckpt=text.pt'], "checkpoint text.pt is unreadable (truncated or corrupt: not a torch.save "
                         "file of tensors and plain values)"),
    # torch warned on its pickle protocol, in two more lines
    (['--ckpt=pickle.pt'], "checkpoint pickle.pt is unreadable (truncated or corrupt: not a "
                           "torch.save"),
    # not an old format's checkpoint, as it was called
    (['--ckpt=dict.pt'], "dict.pt is not a train.py checkpoint (a dict without model_args"),
])
def test_mistakes_are_one_line_with_exit_2_and_write_nothing(tmp_path, args, message):
    (tmp_path / 'text.pt').write_text('not a checkpoint\n')
    (tmp_path / 'pickle.pt').write_bytes(pickle.dumps({'model': 1}, protocol=4))
    torch.save({'iter_num': 1}, tmp_path / 'dict.pt')
    before = sorted(os.listdir(tmp_path))
    result = forked.run(os.path.join(REPO, 'sample.py'), f'--out_dir={tmp_path}', *args,
                        cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2 and result.stdout == '', result.stderr
    assert (result.stderr.startswith(f"error: {message}")
            and result.stderr.count('\n') == 1), result.stderr
    assert sorted(os.listdir(tmp_path)) == before


def test_export_writes_only_a_new_file_which_sample_reads_and_train_refuses_to_resume(
        run_dir, data_dir, tmp_path):
    def refused(result, words):
        return result.returncode == 2 and words in result.stderr and result.stderr.count('\n') == 1

    best = os.path.join(run_dir, 'best.pt')
    before = open(best, 'rb').read()
    assert refused(run_sample(f'--out_dir={run_dir}', f'--export={best}'),
                   'exists: name a new file')
    assert refused(run_sample(f'--out_dir={run_dir}', f"--export={tmp_path / 'no' / 'w.pt'}"),
                   'its folder does not exist')
    # a folder no one may write in (even root: /proc), and a folder named as the checkpoint
    assert refused(run_sample(f'--out_dir={run_dir}', '--export=/proc/w.pt'),
                   'cannot write /proc/w.pt (')
    assert refused(run_sample(f'--ckpt={run_dir}'),
                   f'checkpoint {run_dir} is a folder: set out_dir')
    assert open(best, 'rb').read() == before and not (tmp_path / 'no').exists()
    exported = str(tmp_path / 'w.pt')
    assert run_sample(f'--out_dir={run_dir}', f'--export={exported}').returncode == 0
    assert run_sample(f'--ckpt={exported}', '--num_samples=1', '--max_new_tokens=5').returncode == 0
    result = run_train(str(tmp_path / 'next'), data_dir, '--init_from=resume',
                       f'--resume_from={exported}', check=False)
    assert refused(result, 'holds weights only') and not (tmp_path / 'next').exists()
    torch.save([1, 2], tmp_path / 'list.pt')
    assert refused(run_sample(f"--ckpt={tmp_path / 'list.pt'}"), 'holds a list, not a checkpoint')


def test_prefixed_checkpoint_loads(run_dir, tmp_path):
    best = os.path.join(run_dir, 'best.pt')
    ckpt = torch.load(best, weights_only=True)
    # as saved from a torch.compile'd model
    ckpt['model'] = {'_orig_mod.' + k: v for k, v in ckpt['model'].items()}
    torch.save(ckpt, tmp_path / 'compiled.pt')
    loaded, reference = (sample.load_model(str(tmp_path / 'compiled.pt'), 'cpu')[0],
                         sample.load_model(best, 'cpu')[0])
    assert all(torch.equal(a, b)
               for a, b in zip(loaded.state_dict().values(), reference.state_dict().values()))


def test_a_sample_leaves_the_global_rng_and_train_mode_and_builds_no_graph(run_dir):
    model, saved = sample.load_model(os.path.join(run_dir, 'best.pt'), 'cpu')
    tok = tokenizer.load(saved['dataset']['tokenizer'])
    model.train()
    rng, inference = torch.get_rng_state(), []
    hook = model.register_forward_hook(
        lambda module, args, out: inference.append(torch.is_inference_mode_enabled()))
    text = ''.join(sample.sample_pieces(model, tok, 'the ', 20, 1.0, 200, 7, 'cpu'))
    hook.remove()
    # a graph would keep every step's, the KV cache's too: memory growing with the tokens' square
    assert len(inference) == 20 and all(inference)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert text.startswith('the ') and len(text) == 24
    assert text == ''.join(sample.sample_pieces(model, tok, 'the ', 20, 1.0, 200, 7, 'cpu'))


def test_a_sample_comes_token_by_token_in_whole_characters(run_dir, tmp_path):
    """sample.py and train.py print the pieces as the tokens are drawn. A character tokenizer gives
    a piece per token; a byte-level BPE's token can end inside a UTF-8 character, which waits for
    the next."""
    model, saved = sample.load_model(os.path.join(run_dir, 'best.pt'), 'cpu')
    tok = tokenizer.load(saved['dataset']['tokenizer'])
    pieces = list(sample.sample_pieces(model, tok, 'the ', 20, 1.0, 200, 7, 'cpu'))
    text = ''.join(pieces)
    ids = model.generate(torch.tensor([tok.encode('the ')]), 20, 1.0, 200,
                         torch.Generator().manual_seed(7))
    # a piece per new character, but the unknown id's U+FFFD, which waits like a cut one
    assert pieces[0] == 'the ' and text == tok.decode(ids[0].tolist())
    assert len(pieces) == 1 + sum(c != '\ufffd' for c in text[4:]) + 1
    write_ranks(tmp_path / 'bytes.tiktoken', [])  # 256 byte tokens, then end-of-text
    tok = tokenizer.ranks_file(str(tmp_path / 'bytes.tiktoken'))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32))
    # the high bytes of one character, whole, and cut: é (2 bytes), € (3 bytes)
    with torch.no_grad():
        model.lm_head.weight[0xc3] += 0.5
    pieces = list(sample.sample_pieces(model, tok, 'é', 300, 2.0, None, 1, 'cpu'))
    ids = model.generate(torch.tensor([tok.encode('é')]), 300, 2.0, None,
                         torch.Generator().manual_seed(1))
    assert ''.join(pieces) == tok.decode(ids[0].tolist())
    assert len(pieces) < 1 + 300 + 1  # some tokens ended inside a character and waited
    assert not any(piece.endswith('\ufffd') for piece in pieces[:-1])
