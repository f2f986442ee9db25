"""tokenizer.py and prepare.py --tokenizer bpe:N: a BPE learned on train alone, deterministic,
round-tripping every document; a changed ranks file refused; the Hugging Face files encoding as
ours; GPT-2's export needing no files; and a run on a learned BPE that trains, samples and
exports."""
import base64
import json
import os
import random

import numpy as np
import pytest
import torch

import checkpoint
import data
import datafiles
import forked
import prepare
import tokenizer
from conftest import make_corpus, run_train, write_ranks
from model import GPT, GPTConfig
from test_prepare import folder_snapshot, read_meta, read_split, run_cli

SEPARATOR = '-' * 40 + '\n'
# strings only one split holds, repeated so often that a BPE learned on that split would merge their
# pairs first
ONLY_IN = {'train': ' wywywywy', 'val': ' zqzqzqzq', 'test': ' xjxjxjxj'}


def write_split_docs(folder, n=40, seed=1337):
    """n documents of pseudo-English, each with its split's own string 30 times, and characters of 1
    to 4 bytes: the split of the k-th distinct document is DocumentSplitter's, so it is known before
    prepare.py runs."""
    splitter, rng = prepare.DocumentSplitter(seed), random.Random(0)
    words = ['the', 'cat', 'sees', 'a', 'small', 'bird', 'on', 'old', 'road', 'café', 'naïve',
             '☃', '𝄞']
    texts = {}
    for k in range(n):
        split = splitter(k)  # distinct digests: the split of the k-th document in file-name order
        body = ' '.join(rng.choice(words) for _ in range(200))
        texts[f'doc{k:02d}.txt'] = (split, f'{body}{ONLY_IN[split] * 30}\n\t  {k} {body[:50]}\n')
    os.makedirs(folder, exist_ok=True)
    for name, (_, text) in texts.items():
        with open(os.path.join(folder, name), 'w', encoding='utf-8') as f:
            f.write(text)
    return texts


def ranks_of(out_dir):
    with open(os.path.join(out_dir, read_meta(out_dir)['tokenizer']['encoding'])) as f:
        return [base64.b64decode(line.split()[0]) for line in f]


def documents_of(ids, eot_id):
    """A split's ids cut into documents after each end-of-text."""
    ends = np.flatnonzero(ids == eot_id).tolist()
    return [ids[a + 1:b].tolist() for a, b in zip([-1] + ends, ends)]


def test_bpe_learns_train_alone_and_round_trips_every_document(tmp_path):
    texts = write_split_docs(tmp_path / 'docs')
    out_dir = prepare.prepare('b', data_dir=tmp_path / 'data', input_path=tmp_path / 'docs',
                              tokenizer='bpe:300')
    meta, ranks = read_meta(out_dir), ranks_of(out_dir)
    assert len(ranks) == 299 and meta['vocab_size'] == 300 and meta['tokenizer']['eot_id'] == 299
    assert any(b'wy' in token for token in ranks), 'the train-only string is learned'
    assert not any(pair in token for token in ranks
                   for pair in (b'zq', b'qz', b'xj', b'jx')), 'val or test text learned'
    trained = meta['tokenizer']['trained']  # a corpus this small is learned whole
    assert (trained['vocab_size_asked'] == 300
            and trained['documents'] == meta['splits']['train']['documents'])
    assert trained['bytes'] == sum(len(t.encode())
                                   for split, t in texts.values() if split == 'train')
    tok = tokenizer.load(meta['tokenizer'], out_dir)
    for split in prepare.SPLITS:
        ids = read_split(out_dir, split)
        expected = sorted(t for s, t in texts.values() if s == split)
        decoded = sorted(tok.decode(doc) for doc in documents_of(ids, tok.eot_id))
        assert decoded == expected, f'{split}: each document decodes to itself'
        assert meta['splits'][split]['bytes'] == sum(len(t.encode()) for t in expected)
    val_bytes_per_token = meta['splits']['val']['bytes'] / meta['splits']['val']['tokens']
    assert (meta['val_bytes_per_token'] == round(val_bytes_per_token, 4)
            and 1.5 < val_bytes_per_token < 4)


def test_bpe_is_the_same_for_any_num_proc_and_run_and_samples_within_its_bound(tmp_path,
                                                                               monkeypatch):
    write_split_docs(tmp_path / 'docs')
    # tasks of 2 documents: both processes tokenize some
    monkeypatch.setattr(prepare, 'BATCH_BYTES', 2048)
    # about half the train split: a sample is drawn
    monkeypatch.setattr(prepare, 'BPE_SAMPLE_BYTES', 20_000)
    runs = [prepare.prepare('b', data_dir=tmp_path / d, input_path=tmp_path / 'docs',
                            tokenizer='bpe:400', num_proc=num_proc)
            for d, num_proc in [('a', 1), ('b', 2), ('c', 2)]]
    assert folder_snapshot(runs[0]) == folder_snapshot(runs[1]) == folder_snapshot(runs[2])
    assert sorted(os.listdir(runs[0])) == ['b.tiktoken', 'b_test_000000.bin', 'b_train_000000.bin',
                                           'b_val_000000.bin', 'meta.json']
    trained = read_meta(runs[0])['tokenizer']['trained']
    assert (0 < trained['bytes'] <= 20_000
            and 0 < trained['documents'] < read_meta(runs[0])['splits']['train']['documents'])
    assert trained['sample_rule'].startswith('train documents whose content digest < 0.')


def test_a_changed_or_missing_ranks_file_is_refused_in_one_line(tmp_path):
    out_dir = prepare.prepare('b', data_dir=tmp_path, input_path=make_corpus(str(tmp_path / 'src')),
                              tokenizer='bpe:300')
    meta, _ = datafiles.open_dataset(str(tmp_path), 'b')
    path = os.path.join(out_dir, 'b.tiktoken')
    assert (meta['tokenizer']['encoding']
            == path), 'resolved inside the dataset folder, wherever it was prepared'
    with open(path, 'a') as f:
        f.write(f"{base64.b64encode(b'xyz').decode()} {meta['tokenizer']['eot_id']}\n")
    assert_refused(tmp_path, path,
                   'changed since the dataset was prepared: restore it, or re-run prepare.py')
    os.remove(path)
    assert_refused(tmp_path, path, 'not found: restore it, or prepare the dataset again')


def assert_refused(data_dir, path, message):
    with pytest.raises(data.DataError, match=message) as e:
        datafiles.open_dataset(str(data_dir), 'b')
    assert '\n' not in str(e.value) and path in str(e.value)


def test_bad_bpe_sizes_are_one_line_errors(tmp_path):
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    result = run_cli('x', '--input', 'good.txt', '--tokenizer', 'bpe:256', cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count('\n') == 1
    assert 'must be a whole number from 257' in result.stderr and not (tmp_path / 'data').exists()
    for spec in ('bpe:', 'bpe:1e4', 'bpe:-300', f'bpe:{2 ** 32}'):
        with pytest.raises(prepare.PrepareError, match='must be a whole number from 257'):
            prepare.given_tokenizer(spec)


def test_a_bpe_asked_for_more_ids_than_the_text_merges_says_so(tmp_path):
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    result = run_cli('x', '--input', 'good.txt', '--tokenizer', 'bpe:70000', cwd=tmp_path)
    vocab_size = read_meta(tmp_path / 'data' / 'x')['vocab_size']
    assert result.returncode == 0 and vocab_size < 70_000, result.stderr
    assert result.stdout.startswith(
        f"wrote data/x: vocab_size {vocab_size} (BPE learned on 255 bytes of train; {vocab_size} "
        f"ids of the 70,000 asked: the text has no more merges), "), result.stdout
    # all the ids asked: nothing to say
    result = run_cli('y', '--input', 'good.txt', '--tokenizer', 'bpe:260', cwd=tmp_path)
    assert result.stdout.startswith(
        "wrote data/y: vocab_size 260 (BPE learned on 255 bytes of train), "), result.stdout


@pytest.mark.parametrize('kind', ['char', 'learned', 'hand-made'])
def test_hugging_face_files_encode_and_decode_as_ours(tmp_path, kind):
    from tokenizers import Tokenizer as HFTokenizer
    text = 'the cat sees café ☃ 𝄞\n\n\t  x  <|endoftext|> 12 unseen: Ω\ufffd'
    # U+FFFD a character of the vocabulary: the unknown id keeps a name of its own
    if kind == 'char':
        tok = tokenizer.char(sorted(set('the cat sees café\n\t 12\ufffd')))
    elif kind == 'learned':
        texts = write_split_docs(tmp_path / 'docs')
        out_dir = prepare.prepare('b', data_dir=tmp_path / 'data', input_path=tmp_path / 'docs',
                                  tokenizer='bpe:300')
        tok = tokenizer.load(read_meta(out_dir)['tokenizer'], out_dir)
        text += ''.join(t for _, t in texts.values())
    else:
        # 'abcd' is a token that merging never reaches (bc first, then no pair is a token): tiktoken
        # takes a piece that is a token whole; and '  ' merges two spaces that GPT-2's split keeps
        # apart
        write_ranks(tmp_path / 'edge.tiktoken', [b'bc', b'ab', b'cd', b'abcd', b'  ', b' a'])
        tok = tokenizer.ranks_file(str(tmp_path / 'edge.tiktoken'))
        text = 'abcd x  abcd'
        assert tok.encode(text) == [259, 32, 120, 32, 261, 256, 100]
    theirs = HFTokenizer.from_str(tok.hf_files()['tokenizer.json'])
    ids = theirs.encode(text).ids
    assert (ids == tok.encode(text) and (0 in ids) == (kind == 'char')
            and (tok.eot_id in ids) == (kind == 'learned'))
    # ours shows the unknown id as U+FFFD, a character here too
    known = [i for i in ids if kind != 'char' or i != 0]
    assert theirs.decode(known, skip_special_tokens=False) == tok.decode(known)


def test_export_of_a_gpt2_tokenized_run_needs_no_tokenizer_files(tmp_path):
    # a run on FineWeb's shards: its tokenizer is GPT-2's, whose files tiktoken would download, and
    # this is offline
    model_args = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=50257)
    model = GPT(GPTConfig(**model_args))
    checkpoint.save_file({'format': checkpoint.FORMAT, 'model': model.state_dict(),
                          'model_args': model_args, 'config': {}, 'iter_num': 0,
                          'dataset': {'tokenizer': {'kind': 'tiktoken', 'encoding': 'gpt2'}}},
                         str(tmp_path / 'best.pt'))
    proxy = 'http://127.0.0.1:9'
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / 'empty_cache'),
               HTTPS_PROXY=proxy, HTTP_PROXY=proxy, https_proxy=proxy, http_proxy=proxy)
    export = tmp_path / 'hf'
    result = forked.run('sample.py', f'--out_dir={tmp_path}', f'--export_hf={export}', env=env,
                        timeout=120)
    assert result.returncode == 0, result.stderr
    assert "AutoTokenizer.from_pretrained('gpt2')" in result.stderr
    config = json.loads((export / 'config.json').read_text())
    assert config['eos_token_id'] == config['bos_token_id'] == 50256
    assert sorted(os.listdir(export)) == ['config.json', 'model.safetensors']


@pytest.mark.slow
def test_a_run_on_a_learned_bpe_trains_samples_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # 4 s to import: only here
    data_dir = str(tmp_path / 'data')
    prepare.prepare('toy', data_dir=data_dir, input_path=make_corpus(str(tmp_path / 'src')),
                    tokenizer='bpe:400')
    out = str(tmp_path / 'run')
    result = run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10',
                       '--sample_tokens=8')
    assert 'a sample from the best weights:\n<|endoftext|>' in result.stdout
    sample = lambda *args: forked.run('sample.py', f'--out_dir={out}', *args, timeout=120)
    greedy = sample('--start=the cat', '--top_k=1', '--num_samples=1', '--max_new_tokens=24',
                    '--dtype=float32')
    assert greedy.returncode == 0 and greedy.stdout.startswith('the cat'), greedy.stderr
    export = str(tmp_path / 'hf')
    assert sample(f'--export_hf={export}').returncode == 0
    ours = tokenizer.load(read_meta(os.path.join(data_dir, 'toy'))['tokenizer'],
                          os.path.join(data_dir, 'toy'))
    # the ids would mean other tokens: refused
    with open(os.path.join(data_dir, 'toy', 'toy.tiktoken'), 'a') as f:
        f.write(f"{base64.b64encode(b'xyz').decode()} {ours.eot_id}\n")
    refused = run_train(str(tmp_path / 'run2'), data_dir, '--max_iters=1', check=False)
    assert (refused.returncode == 2 and refused.stderr.count('\n') == 1
            and 'changed since' in refused.stderr)
    theirs, their_tokenizer = (AutoModelForCausalLM.from_pretrained(export).eval(),
                               AutoTokenizer.from_pretrained(export))
    assert (their_tokenizer.encode('the cat sees a small bird.\n')
            == ours.encode('the cat sees a small bird.\n'))
    assert their_tokenizer.eos_token_id == ours.eot_id == ours.vocab_size - 1
    generated = theirs.generate(torch.tensor([their_tokenizer.encode('the cat')]),
                                max_new_tokens=24, do_sample=False)
    assert greedy.stdout == their_tokenizer.decode(generated[0]) + '\n' + SEPARATOR
