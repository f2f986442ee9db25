import gzip
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import prepare
import tokenizer
from conftest import write_ranks

PREPARE_PY = os.path.abspath(prepare.__file__)


def read_meta(out_dir):
    with open(os.path.join(out_dir, 'meta.json'), encoding='utf-8') as f:
        return json.load(f)


def read_split(out_dir, split):
    """A split's tokens: its shards' tokens after their 1024-byte headers, concatenated."""
    meta = read_meta(out_dir)
    return np.concatenate([np.fromfile(os.path.join(out_dir, f), dtype=meta['dtype'],
                                       offset=prepare.SHARD.HEADER_BYTES)
                           for f in meta['splits'][split]['shards']])


def folder_snapshot(folder):
    return {name: open(os.path.join(folder, name), 'rb').read()
            for name in sorted(os.listdir(folder))}


def run_cli(*args, cwd, env=None):
    return subprocess.run([sys.executable, PREPARE_PY, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def run_patched(patch, *args, cwd):
    """prepare.py's command line in a python that first runs patch (code, with os, signal and
    prepare imported): a stop or a kill where a test wants it."""
    code = "import os, signal, sys, prepare\n" + patch + "prepare.main(sys.argv[1:])\n"
    return subprocess.run([sys.executable, '-c', code, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, 'PYTHONPATH': os.path.dirname(PREPARE_PY)})


def write_docs(folder, n=30):
    """n distinct documents, each tagged [doc NN], plus two exact copies of doc 03 (one nested)."""
    rng = random.Random(0)
    texts = {}
    for i in range(n):
        body = ' '.join(rng.choice(['alpha', 'beta', 'gamma', 'delta']) for _ in range(20))
        texts[f'doc{i:02d}.txt'] = f'[doc {i:02d}] 0123456789 {body}\n'
    texts['zz_copy_of_03.txt'] = texts['doc03.txt']
    texts['sub/copy_of_03.txt'] = texts['doc03.txt']
    for rel, text in texts.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding='utf-8')
    return texts


def doc_tags(out_dir, split):
    decode = tokenizer.load(read_meta(out_dir)['tokenizer']).decode
    return re.findall(r'\[doc (\d\d)\]', decode(read_split(out_dir, split).tolist()))


def test_folder_splits_are_disjoint_duplicates_dropped_and_tools_files_left_out(tmp_path):
    texts = write_docs(tmp_path / 'docs')
    # a copy saved by Windows' Notepad (a byte-order mark, CRLF), a blank line after it: it went
    # to a split of its own
    (tmp_path / 'docs' / 'windows_copy_of_05.txt').write_bytes(
        b'\xef\xbb\xbf' + texts['doc05.txt'].replace('\n', '\r\n').encode() + b'\r\n')
    # a repository's binary files, which would be refused as text
    for rel in ('.git/objects/ab/cdef', '__pycache__/doc00.cpython-311.pyc', 'sub/.DS_Store'):
        (tmp_path / 'docs' / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / 'docs' / rel).write_bytes(b'x\x9c\x00binary')
    out_dir = prepare.prepare('docs', data_dir=tmp_path / 'data', input_path=tmp_path / 'docs')
    meta = read_meta(out_dir)
    assert meta['duplicates_dropped'] == 3
    # the first block of 20 documents holds exactly 2 val and 1 test; of the last 10, this seed put
    # 1 in val
    assert ({s: meta['splits'][s]['documents'] for s in prepare.SPLITS}
            == {'train': 26, 'val': 3, 'test': 1})
    tags = {s: doc_tags(out_dir, s) for s in prepare.SPLITS}
    all_tags = tags['train'] + tags['val'] + tags['test']
    # each document exactly once, copies of 03 included
    assert sorted(all_tags) == [f'{i:02d}' for i in range(30)]
    for split, docs in tags.items():
        assert docs == sorted(docs), 'documents within a split are in sorted-id order'
        assert len(docs) == meta['splits'][split]['documents']
    assert meta['splits']['train']['unknown_chars'] == 0
    assert meta['source'] == str(tmp_path / 'docs')
    assert (meta['split_rule'].startswith('documents: in blocks of 20 distinct documents, a seeded '
                                          'permutation (seed 1337)'))


def test_folder_split_is_deterministic_seeded_and_the_same_for_any_num_proc(tmp_path, monkeypatch):
    write_docs(tmp_path / 'docs')
    # tasks of 2 documents: both processes tokenize some
    monkeypatch.setattr(prepare, 'BATCH_BYTES', 256)
    runs = [prepare.prepare('docs', data_dir=tmp_path / d, input_path=tmp_path / 'docs', seed=seed,
                            num_proc=num_proc)
            for d, seed, num_proc in [('a', 1, 1), ('b', 1, 2), ('c', 2, 1)]]
    assert folder_snapshot(runs[0]) == folder_snapshot(runs[1])
    assert doc_tags(runs[0], 'val') != doc_tags(runs[2], 'val')
    assert read_meta(runs[0])['source_sha256'] == read_meta(runs[2])['source_sha256']


def test_char_vocab_is_fit_on_train_only(tmp_path):
    text = list('abc abc\n' * 125)  # n = 1000: test [0, 50), train [50, 900), val [900, 1000)
    text[10:13] = 'WWW'  # only in test
    text[950:954] = 'VVVV'  # only in val
    text = ''.join(text)
    (tmp_path / 'in.txt').write_text(text, encoding='utf-8')
    result = run_cli('t', '--input', 'in.txt', '--data_dir', 'data', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ('4 unknown chars' in result.stdout
            and "characters that train never holds" in result.stdout)
    out_dir = str(tmp_path / 'data' / 't')
    meta = read_meta(out_dir)
    assert meta['tokenizer']['chars'] == ['\n', ' ', 'a', 'b', 'c']
    assert meta['tokenizer']['unk_id'] == 0 and meta['vocab_size'] == 6
    assert [meta['splits'][s]['unknown_chars'] for s in prepare.SPLITS] == [0, 4, 3]
    test_ids, val_ids = read_split(out_dir, 'test'), read_split(out_dir, 'val')
    assert np.flatnonzero(test_ids == 0).tolist() == [10, 11, 12]
    assert np.flatnonzero(val_ids == 0).tolist() == [50, 51, 52, 53]
    tok = tokenizer.load(meta['tokenizer'])
    assert tok.encode('abW') == [3, 4, 0]
    assert tok.decode(val_ids.tolist()) == text[900:].replace('V', '\ufffd')


def test_single_file_contiguous_split(tmp_path):
    rng = random.Random(0)
    text = ''.join(rng.choice('abcdefghij \n') for _ in range(1003))
    (tmp_path / 'in.txt').write_text(text, encoding='utf-8')
    out_dir = prepare.prepare('t', data_dir=tmp_path / 'data', input_path=tmp_path / 'in.txt')
    meta = read_meta(out_dir)
    decode = tokenizer.load(meta['tokenizer']).decode
    expected = {'test': (0, 50), 'train': (50, 902), 'val': (902, 1003)}
    for split, (a, b) in expected.items():
        assert decode(read_split(out_dir, split).tolist()) == text[a:b]
        assert meta['splits'][split] == {'tokens': b - a, 'documents': 1, 'bytes': b - a,
                                         'unknown_chars': 0, 'byte_range': [a, b],
                                         'shards': [f't_{split}_000000.bin']}
    assert meta['source_sha256'] == hashlib.sha256(text.encode()).hexdigest()
    assert meta['split_rule'].startswith('contiguous')
    assert meta['dtype'] == 'uint16' and meta['duplicates_dropped'] == 0


def test_bpe_from_local_tiktoken_file(tmp_path, monkeypatch):
    # tiktoken caches even local files
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', str(tmp_path / 'cache'))
    ranks = tmp_path / 'tiny.tiktoken'
    write_ranks(ranks, [b'th', b'he', b'the'])
    docs = {f'd{i}.txt': f'the theme of the other {i} ' * (i + 1) for i in range(5)}
    (tmp_path / 'docs').mkdir()
    for name, text in docs.items():
        (tmp_path / 'docs' / name).write_text(text)
    out_dir = prepare.prepare('b', data_dir=tmp_path / 'data', input_path=tmp_path / 'docs',
                              tokenizer=str(ranks))
    meta = read_meta(out_dir)
    # a copy beside the shards, named relative to them: the dataset moves whole
    copy = os.path.join(out_dir, 'b.tiktoken')
    assert open(copy, 'rb').read() == ranks.read_bytes()
    assert meta['tokenizer'] == {'kind': 'tiktoken', 'encoding': 'b.tiktoken',
                                 'ranks_sha256': hashlib.sha256(ranks.read_bytes()).hexdigest(),
                                 'pat_str': tokenizer.GPT2_PAT_STR, 'eot_id': 259}
    assert meta['vocab_size'] == 260 and 'unknown_chars' not in meta['splits']['train']
    tok = tokenizer.load(meta['tokenizer'], out_dir)
    assert tok.encode('the') == [258]
    id_of = {text: name for name, text in docs.items()}
    seen, n_text_tokens = [], 0
    for split in prepare.SPLITS:
        ids = read_split(out_dir, split).tolist()
        assert (len(ids) == meta['splits'][split]['tokens']
                and ids[-1] == 259), 'each document ends with eot'
        ends = [k for k, t in enumerate(ids) if t == 259]
        split_docs = [tok.decode(ids[a + 1:b]) for a, b in zip([-1] + ends, ends)]
        assert len(split_docs) == meta['splits'][split]['documents']
        names = [id_of[t] for t in split_docs]
        assert names == sorted(names)
        seen += names
        n_text_tokens += len(ids) - len(ends)
    assert sorted(seen) == sorted(docs)
    assert 258 in read_split(out_dir, 'train')
    assert n_text_tokens < sum(len(t.encode()) for t in docs.values()), 'merges were used'

    # the file given changed: the dataset keeps its copy
    write_ranks(ranks, [b'th', b'he'])
    assert tokenizer.load(meta['tokenizer'], out_dir).encode('the') == [258]
    # the copy changed: refused
    shutil.copy(ranks, copy)
    with pytest.raises(tokenizer.TokenizerError, match='changed since'):
        tokenizer.load(meta['tokenizer'], out_dir)
    # prepared again from the changed file: neither meta nor tiktoken's cache may go stale
    out_dir = prepare.prepare('b', data_dir=tmp_path / 'data', input_path=tmp_path / 'docs',
                              tokenizer=str(ranks))
    assert tokenizer.load(read_meta(out_dir)['tokenizer'], out_dir).encode('the') == [256, ord('e')]
    assert read_meta(out_dir)['tokenizer']['eot_id'] == 258


def test_prepare_imports_no_torch():
    """Preparing data needs numpy and a tokenizer, not torch, whose import would add about 2 s to
    every prepare.py command (and to each of these tests)."""
    check = (f"import sys; sys.path.insert(0, {os.path.dirname(PREPARE_PY)!r}); import prepare; "
             f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, '-c', check], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout == '[]\n', result.stderr


def test_gpt2_offline_fails_with_one_line_hint(tmp_path):
    (tmp_path / 'f.txt').write_text('hello world ' * 100)
    (tmp_path / 'cache').mkdir()
    proxy = 'http://127.0.0.1:9'
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / 'cache'),
               HTTPS_PROXY=proxy, HTTP_PROXY=proxy, https_proxy=proxy, http_proxy=proxy)
    result = run_cli('x', '--input', 'f.txt', '--tokenizer', 'gpt2', cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith('error: ')
    # README's offline route: a gpt2.tiktoken ranks file written once online
    assert ('use --tokenizer gpt2.tiktoken' in result.stderr and 'README.md' in result.stderr
            and '--tokenizer char' in result.stderr)
    assert not (tmp_path / 'data').exists()


@pytest.mark.parametrize('args, expected', [
    (['x', '--input', 'missing.txt'], 'does not exist'),
    (['x', '--input', os.devnull], f'input {os.devnull} is neither a file nor a folder'),
    (['x', '--input', 'empty.txt'], 'empty'),
    (['x', '--input', 'blank.txt'], 'only whitespace'),
    (['x', '--input', 'empty_dir'], 'has no files'),
    (['x', '--input', 'latin1.txt'],
     r'latin1.txt is not UTF-8 \(invalid byte at offset 3\).*iconv'),
    # Windows' 'Unicode' text (PowerShell's > too) holds NULs, and was called binary
    (['x', '--input', 'utf16.txt'], r'^error: utf16.txt is UTF-16 \(its byte-order mark\), not '
     r'UTF-8: convert it first, e.g. iconv -f UTF-16 -t UTF-8 IN > OUT$'),
    # iconv was the advice
    (['x', '--input', 'code'],
     r'^error: logo.png is binary or UTF-16, not UTF-8 text \(a NUL byte at offset 8\): leave '
     r'it out of --input, or convert UTF-16 first, e.g. iconv -f UTF-16LE -t UTF-8 IN > OUT$'),
    # valid UTF-8, every other byte a NUL: it was trained on as text
    (['x', '--input', 'utf16le.txt'], r'utf16le.txt is binary or UTF-16, not UTF-8 text \(a NUL '
     r'byte at offset 1\)'),
    (['x', '--input', 'tiny.txt'], 'split has no tokens'),
    # it did nothing: a text file has no fields
    (['x', '--input', 'good.txt', '--text_key', 'body'], r'--text_key names a field of .jsonl and '
     r'.parquet records, and .*good.txt holds none: drop --text_key$'),
    (['x', '--input', 'two_docs'], 'only 2 distinct documents'),
    (['x', '--input', 'good.txt', '--tokenizer', 'bpe'], "tokenizer 'bpe' not understood"),
    # a file given, no dataset's: nothing to prepare again
    (['x', '--input', 'good.txt', '--tokenizer', 'nope.tiktoken'],
     'nope.tiktoken not found: check the path$'),
    # tiktoken's panics on these killed the tokenizer processes, and prepare.py waited forever
    (['x', '--input', 'good.txt', '--tokenizer', 'partial.tiktoken'],
     r"partial.tiktoken lacks 242 of the 243 single bytes UTF-8 text holds \(e.g. b'\\x00'\)"),
    (['x', '--input', 'good.txt', '--tokenizer', 'shared.tiktoken'],
     r'shared.tiktoken is not a tiktoken ranks file \(two tokens have the same rank\)'),
    (['x', '--input', 'good.txt', '--tokenizer', 'negative.tiktoken'],
     r'negative.tiktoken is not a tiktoken ranks file \(rank -1 is outside 0 to 2\*\*32 - 2\)'),
    (['unknown_name'], 'pystdlib_char.*--input'),
    (['x', '--input', 'good.txt', '--num_proc', '-1'], 'num_proc=-1 must be from 1 to the'),
    # refused as the message says, not read as num_proc=None (every CPU)
    (['x', '--input', 'good.txt', '--num_proc', '0'], 'num_proc=0 must be from 1 to the'),
    # a pool of that many processes never started, and prepare.py waited
    (['x', '--input', 'good.txt', '--num_proc', '100000'],
     f'num_proc=100000 must be from 1 to the {os.cpu_count()} CPUs of this machine'),
    # JSON Lines named .json: trained on as JSON text
    (['x', '--input', 'records.json'], r"^error: input records.json is JSON: prepare.py reads "
     r"records from .jsonl \(JSON Lines\) and .parquet files: rename JSON Lines to .jsonl, or "
     r"convert an array first, e.g. jq -c '.\[\]' IN > OUT.jsonl$"),
    (['x', '--input', 'null.jsonl'],
     "null.jsonl:2 has 'text': null, not a string: fix or drop that record"),
    (['x', '--input', 'number.jsonl'], "number.jsonl:1 has 'text': 42, not a string"),
    (['x', '--input', 'surrogate.jsonl'], r"surrogate.jsonl:1 holds a lone surrogate '\\ud800'"),
    (['x', '--input', 'latin1.jsonl'],
     r'latin1.jsonl:1 is not UTF-8 \(invalid byte at offset 13\).*iconv'),
    # the field was there: the line was cut short, or began with a byte-order mark
    (['x', '--input', 'cut.jsonl'],
     r"cut.jsonl:2 is not valid JSON \(.*\): fix or drop that line$"),
    (['x', '--input', 'bom.jsonl'], r"bom.jsonl:1 is not valid JSON \(Unexpected UTF-8 BOM"),
    (['x', '--input', 'deep.jsonl'], r"deep.jsonl:1 is not valid JSON \(maximum recursion depth"),
    # train.py would read it as a glob
    (['web*', '--input', 'good.txt'], "dataset name 'web\\*' must be a plain folder name"),
    # a folder's file skipped, unsaid
    (['x', '--input', 'linked'], r"linked/gone.txt is a link \(to .*missing.txt\) that leads to "
     r"no file: fix or remove it$"),
    (['x', '--input', 'truncated.jsonl.gz'], 'truncated.jsonl.gz is not a readable gzip file'),
    (['x', '--input', 'corrupt.jsonl.gz'], 'corrupt.jsonl.gz is not a readable gzip file'),
    (['x', '--input', 'good.txt', '--seed', 'abc'],
     r"invalid int value: 'abc' \(python prepare.py --help"),
    ([], 'the following arguments are required: name'),
    (['x', '--input', 'good.txt', '--data_dir', 'good.txt'],
     r'data_dir good.txt cannot be made or written \(File exists\)'),
    # preparing replaces data_dir/NAME whole: what prepare.py did not write there is kept
    (['two_docs', '--input', 'good.txt', '--data_dir', '.'],
     r'./two_docs exists and is not a dataset prepare.py wrote'),
    (['two_docs', '--input', 'two_docs/a', '--data_dir', '.'],
     r'input two_docs/a is in ./two_docs, the folder this dataset replaces'),
    # a second run would have read the first one's shards as text
    (['x', '--input', 'code', '--data_dir', 'code/data'],
     r'code/data/x is inside the input folder code: pass a --data_dir outside it'),
    # it was read as the default, char
    (['x', '--input', 'good.txt', '--tokenizer', ''], "tokenizer '' not understood"),
    # refused after the folders were made: all of them go again
    (['x', '--input', 'tiny.txt', '--data_dir', 'new/deeper/data'], 'split has no tokens'),
])
def test_user_errors_exit_2_with_one_line(tmp_path, args, expected):
    (tmp_path / 'empty.txt').write_bytes(b'')
    (tmp_path / 'blank.txt').write_text(' \n\t\n')
    (tmp_path / 'empty_dir').mkdir()
    (tmp_path / 'latin1.txt').write_bytes('caf\u00e9 au lait'.encode('latin-1'))
    (tmp_path / 'tiny.txt').write_text('abc')
    (tmp_path / 'two_docs').mkdir()
    (tmp_path / 'two_docs' / 'a').write_text('one')
    (tmp_path / 'two_docs' / 'b').write_text('two')
    (tmp_path / 'two_docs' / 'c').write_text('one')
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    (tmp_path / 'utf16.txt').write_bytes(('some text\n' * 20).encode('utf-16'))
    (tmp_path / 'utf16le.txt').write_bytes(('some text\n' * 20).encode('utf-16-le'))
    (tmp_path / 'code').mkdir()
    (tmp_path / 'code' / 'm.py').write_text('x = 1\n')
    (tmp_path / 'code' / 'logo.png').write_bytes(b'\x89PNG\r\n\x1a\n\0\0\0\rIHDR')
    (tmp_path / 'partial.tiktoken').write_text('YQ== 0\n')  # b'a' alone
    (tmp_path / 'shared.tiktoken').write_text('YQ== 0\nYg== 0\n')
    (tmp_path / 'negative.tiktoken').write_text('YQ== -1\n')
    (tmp_path / 'null.jsonl').write_text('{"text": "a"}\n{"text": null}\n')
    (tmp_path / 'number.jsonl').write_text('{"text": 42}\n')
    (tmp_path / 'records.json').write_text('{"text": "a record"}\n' * 20)
    (tmp_path / 'surrogate.jsonl').write_text('{"text": "half \\ud800 a character"}\n')
    (tmp_path / 'latin1.jsonl').write_bytes('{"text": "caf\u00e9"}\n'.encode('latin-1'))
    (tmp_path / 'cut.jsonl').write_text('{"text": "a"}\n{"text": "b\n')
    (tmp_path / 'bom.jsonl').write_text('\ufeff{"text": "a"}\n', encoding='utf-8')
    # a traceback before
    (tmp_path / 'deep.jsonl').write_text('{"text": "a", "x": ' + '[' * 10**5 + ']' * 10**5 + '}\n')
    (tmp_path / 'linked').mkdir()
    (tmp_path / 'linked' / 'a.txt').write_text('a document\n')
    (tmp_path / 'linked' / 'gone.txt').symlink_to(tmp_path / 'missing.txt')
    records = gzip.compress(b''.join(b'{"text": "record %d"}\n' % i for i in range(1000)))
    (tmp_path / 'truncated.jsonl.gz').write_bytes(records[:len(records) // 2])
    (tmp_path / 'corrupt.jsonl.gz').write_bytes(records[:100]
                                                + bytes(b ^ 0xff for b in records[100:200])
                                                + records[200:])

    def tree():  # every file and folder, with its bytes
        return {path: path.is_file() and path.read_bytes() for path in tmp_path.rglob('*')}
    before = tree()
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith('error: ')
    assert re.search(expected, result.stderr)
    assert not (tmp_path / 'data').exists()
    assert tree() == before


def test_a_full_disk_is_one_line(tmp_path):
    # a traceback and exit code 1
    (tmp_path / 'big.txt').write_text('a text that fills more than the disk has\n' * 20000)
    result = subprocess.run(
        [sys.executable, PREPARE_PY, 'x', '--input', 'big.txt'], cwd=tmp_path, text=True,
        capture_output=True, timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)))
    assert result.returncode == 2 and re.fullmatch(
        r"error: prepare.py stopped: File too large; the old dataset is kept: free space, fix the "
        r"file's permissions, or pass --data_dir PATH on another disk\n", result.stderr)
    assert not (tmp_path / 'data').exists()  # made by this run, and removed


def test_a_tokenizer_process_that_dies_of_a_panic_is_an_error_not_a_hang():
    # tiktoken's panics are BaseExceptions: a pool process died of one, and its result never came
    code = ("import prepare\n"
            "class Panic(BaseException): pass\n"
            "def job(text, digest): raise Panic('no entry found for key')\n"
            "list(prepare.processed([('doc', b'text', 'text', None, 0)], 2, job))\n")
    result = subprocess.run([sys.executable, '-c', code], cwd=os.path.dirname(PREPARE_PY),
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode == 1 and 'RuntimeError: Panic in a tokenizer process: no entry found '
                                       'for key' in result.stderr), result.stderr


def test_failing_rerun_leaves_existing_dataset_untouched(tmp_path, monkeypatch):
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    (tmp_path / 'bad.txt').write_bytes(b'\xff\xfe bad')
    assert run_cli('x', '--input', 'good.txt', cwd=tmp_path).returncode == 0
    before = folder_snapshot(tmp_path / 'data' / 'x')
    result = run_cli('x', '--input', 'bad.txt', cwd=tmp_path)
    assert result.returncode == 2 and 'Traceback' not in result.stderr
    assert folder_snapshot(tmp_path / 'data' / 'x') == before

    def fail_while_writing(*args, **kwargs):  # a crash in the middle of writing the new dataset
        raise OSError('disk full')
    monkeypatch.setattr(prepare.json, 'dump', fail_while_writing)
    (tmp_path / 'other.txt').write_text('other text entirely\n' * 20)
    with pytest.raises(OSError, match='disk full'):
        prepare.prepare('x', data_dir=tmp_path / 'data', input_path=tmp_path / 'other.txt')
    assert folder_snapshot(tmp_path / 'data' / 'x') == before
    assert os.listdir(tmp_path / 'data') == ['x'], 'no temp folders left behind'


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_preparing_leaves_the_dataset_before_it_and_no_temp_folder(tmp_path, signum):
    # the signal as a cluster or a terminal sends it, while two tokenizer processes work (the
    # pool's shutdown hung at times); a stop just after the old dataset moved aside puts it back
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    (tmp_path / 'other.txt').write_text('other text entirely\n' * 200000)  # 4 batches
    assert run_cli('x', '--input', 'good.txt', cwd=tmp_path).returncode == 0
    before = folder_snapshot(tmp_path / 'data' / 'x')
    # Ctrl-C's handler as a terminal's python has it: a test's workers start processes ignoring it
    patch = ("signal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "append = prepare.ShardWriter.append\n"
             "def stopped(self, tokens):\n"
             f"    os.kill(os.getpid(), {int(signum)})\n"
             "    append(self, tokens)\n"
             "prepare.ShardWriter.append = stopped\n")
    for _ in range(3):
        result = run_patched(patch, 'x', '--input', 'other.txt', '--num_proc', '2', cwd=tmp_path)
        assert result.returncode == 128 + signum and result.stderr == (
            f"prepare.py: stopped by {signal.Signals(signum).name}: a dataset is replaced whole or "
            f"not at all\n")
        assert folder_snapshot(tmp_path / 'data' / 'x') == before
        assert os.listdir(tmp_path / 'data') == ['x'], 'no temp folders left behind'


def test_a_stop_between_the_two_renames_puts_the_old_dataset_back(tmp_path, monkeypatch):
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    out = prepare.prepare('x', data_dir=tmp_path / 'data', input_path=tmp_path / 'good.txt')
    before = folder_snapshot(out)
    replace = os.replace

    def stop_after_moving_aside(source, target):
        replace(source, target)
        if os.path.basename(target) == '.old':
            raise KeyboardInterrupt
    monkeypatch.setattr(prepare.os, 'replace', stop_after_moving_aside)
    (tmp_path / 'other.txt').write_text('other text entirely\n' * 20)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare('x', data_dir=tmp_path / 'data', input_path=tmp_path / 'other.txt')
    assert folder_snapshot(out) == before and os.listdir(tmp_path / 'data') == ['x']


@pytest.mark.parametrize('kill', ['writing', 'between the renames'])
def test_what_a_killed_prepare_left_goes_with_the_next_run(tmp_path, kill):
    # SIGKILL (the OOM killer's) runs no handler: the temp folder stays, its partial shards
    # gigabytes at scale, and between the two renames it holds the old dataset. The next run finds
    # its lock free: the folder goes, the dataset comes back, also when that run is refused.
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    (tmp_path / 'other.txt').write_text('other text entirely\n' * 20)
    (tmp_path / 'empty.txt').write_text('\n')
    assert run_cli('x', '--input', 'good.txt', cwd=tmp_path).returncode == 0
    data, before = tmp_path / 'data', folder_snapshot(tmp_path / 'data' / 'x')
    patch = ("prepare.ShardWriter.append = lambda *args: os.kill(os.getpid(), signal.SIGKILL)\n"
             if kill == 'writing' else
             "replace = os.replace\n"
             "def killed(source, target):\n"
             "    replace(source, target)\n"
             "    if os.path.basename(target) == '.old':\n"
             "        os.kill(os.getpid(), signal.SIGKILL)\n"
             "prepare.os.replace = killed\n")
    result = run_patched(patch, 'x', '--input', 'other.txt', cwd=tmp_path)
    assert result.returncode == -signal.SIGKILL, result.stderr
    [left] = [name for name in os.listdir(data) if name.startswith('.x.')]
    assert os.path.exists(data / 'x') == (kill == 'writing')
    result = run_cli('x', '--input', 'empty.txt', cwd=tmp_path)
    assert result.returncode == 2 and 'is empty or only whitespace' in result.stderr
    assert f"removed {os.path.join('data', left)}, left by a prepare.py that was killed" in (
        result.stdout)
    assert os.listdir(data) == ['x'] and folder_snapshot(data / 'x') == before


def test_a_dataset_named_as_the_temp_folder_s_entries_is_prepared_again(tmp_path):
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    for name in ('old', 'old', 'lock', 'lock'):  # the second run replaces the first's
        prepare.prepare(name, data_dir=tmp_path / 'data', input_path=tmp_path / 'good.txt')
    assert sorted(os.listdir(tmp_path / 'data')) == ['lock', 'old']


def test_a_killed_run_of_a_dotted_name_is_its_own(tmp_path):
    # x.y's temp folder, killed between the renames, starts as x's would: .x. + y.SUFFIX
    stale = tmp_path / '.x.y.abcd1234'
    (stale / '.old').mkdir(parents=True)
    (stale / '.lock').write_text('')
    prepare.claim_work_dir(str(tmp_path), 'x')[1].close()
    assert not (tmp_path / 'x').exists() and stale.exists()
    prepare.claim_work_dir(str(tmp_path), 'x.y')[1].close()
    assert (tmp_path / 'x.y').is_dir() and not stale.exists()


def test_a_running_prepare_s_folder_is_left_to_it(tmp_path):
    (tmp_path / 'empty.txt').write_text('\n')
    (tmp_path / 'data').mkdir()
    work_dir, lock = prepare.claim_work_dir(str(tmp_path / 'data'), 'x')  # this process's run
    for held in (True, False):
        result = run_cli('x', '--input', 'empty.txt', cwd=tmp_path)
        assert result.returncode == 2 and os.path.isdir(work_dir) == held, result.stdout
        lock.close()


def test_a_dataset_prepared_again_with_its_own_ranks_file_keeps_a_copy(tmp_path):
    # the dataset named the file by path: the swap deleted it with the old folder, and the new
    # dataset could not be opened
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    result = run_cli('x', '--input', 'good.txt', '--tokenizer', 'bpe:260', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ranks = (tmp_path / 'data' / 'x' / 'x.tiktoken').read_bytes()
    result = run_cli('x', '--input', 'good.txt', '--tokenizer', 'data/x/x.tiktoken',
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    meta = read_meta(tmp_path / 'data' / 'x')
    assert meta['tokenizer']['encoding'] == 'x.tiktoken'
    assert (tmp_path / 'data' / 'x' / 'x.tiktoken').read_bytes() == ranks
    assert tokenizer.load(meta['tokenizer'], str(tmp_path / 'data' / 'x')).vocab_size == 260


def test_an_empty_folder_is_prepared_into(tmp_path):
    # refused as 'not a dataset prepare.py wrote', though replacing it loses nothing; the default
    # dataset's auto-prepare failed on one too
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    (tmp_path / 'data' / 'x').mkdir(parents=True)
    result = run_cli('x', '--input', 'good.txt', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert 'meta.json' in os.listdir(tmp_path / 'data' / 'x')


def test_successful_rerun_replaces_dataset(tmp_path):
    (tmp_path / 'a.txt').write_text('first text\n' * 20)
    (tmp_path / 'b.txt').write_text('second text\n' * 30)
    prepare.prepare('x', data_dir=tmp_path / 'data', input_path=tmp_path / 'a.txt')
    out_dir = prepare.prepare('x', data_dir=tmp_path / 'data', input_path=tmp_path / 'b.txt')
    assert read_meta(out_dir)['source'] == str(tmp_path / 'b.txt')
    assert os.listdir(tmp_path / 'data') == ['x']


def test_cli_prints_summary(tmp_path):
    (tmp_path / 'good.txt').write_text('some good text\n' * 20)
    result = run_cli('x', '--input', 'good.txt', '--data_dir', 'out', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert 'out/x' in result.stdout and 'vocab_size' in result.stdout and 'train' in result.stdout
    assert sorted(os.listdir(tmp_path / 'out' / 'x')) == ['meta.json', 'x_test_000000.bin',
                                                          'x_train_000000.bin', 'x_val_000000.bin']


def test_pystdlib_char(tmp_path):
    out_dir = prepare.prepare('pystdlib_char', data_dir=tmp_path)
    meta = read_meta(out_dir)
    assert meta['source'].startswith('python stdlib at ')
    assert meta['tokenizer']['kind'] == 'char' and meta['dtype'] == 'uint16'
    for split in prepare.SPLITS:
        assert meta['splits'][split]['tokens'] == len(read_split(out_dir, split)) > 0
    assert meta['splits']['train']['documents'] > 10 * meta['splits']['test']['documents'] > 0
    _, _, reader = prepare.source_items('pystdlib_char', None, 'text', None)
    dirs = {name for path in reader.files
            for name in os.path.relpath(path, reader.root).split('/')[:-1]}
    assert (dirs
            and not any(d in ('site-packages', '__pycache__', 'idle_test') or d.startswith('test')
                        for d in dirs))
    documents = sum(meta['splits'][s]['documents'] for s in prepare.SPLITS)
    assert documents + meta['duplicates_dropped'] == len(reader.files)


def test_a_linked_folder_is_read_and_each_folder_once(tmp_path):
    # os.walk left linked folders out, unsaid; followed, a link to a folder above would loop
    texts = write_docs(tmp_path / 'docs')
    (tmp_path / 'input').mkdir()
    (tmp_path / 'input' / 'linked').symlink_to(tmp_path / 'docs')
    (tmp_path / 'input' / 'linked_again').symlink_to(tmp_path / 'docs')
    (tmp_path / 'docs' / 'up').symlink_to(tmp_path / 'input')
    meta = read_meta(prepare.prepare('d', data_dir=tmp_path / 'data',
                                     input_path=tmp_path / 'input'))
    assert sum(meta['splits'][s]['documents'] for s in prepare.SPLITS) == 30
    assert meta['duplicates_dropped'] == len(texts) - 30  # write_docs' own copies only


def test_jsonl_and_gzip_records_split_like_the_same_documents_in_files(tmp_path, monkeypatch):
    texts = write_docs(tmp_path / 'docs')
    # tasks of 2 documents: both processes tokenize some
    monkeypatch.setattr(prepare, 'BATCH_BYTES', 256)
    records = [json.dumps({'id': k, 'body': texts[name]}) for k, name in enumerate(sorted(texts))]
    (tmp_path / 'docs.jsonl').write_text('\n'.join(records) + '\n\n')  # a blank line is no record
    with gzip.open(tmp_path / 'docs.JSONL.gz', 'wt') as f:  # any case: it was trained on as text
        f.write('\n'.join(records) + '\n')
    outs = [prepare.prepare('d', data_dir=tmp_path / f'out_{name}', input_path=tmp_path / name,
                            text_key=key, num_proc=2)
            for name, key in (('docs.jsonl', 'body'), ('docs.JSONL.gz', 'body'), ('docs', None))]
    for split in prepare.SPLITS:  # the same distinct documents in the same order: the same splits
        assert (read_split(outs[0], split).tolist() == read_split(outs[1], split).tolist()
                == read_split(outs[2], split).tolist())
    meta = read_meta(outs[0])
    assert (meta['duplicates_dropped'] == 2
            and sorted(doc_tags(outs[0], 'train') + doc_tags(outs[0], 'val')
                       + doc_tags(outs[0], 'test')) == [f'{i:02d}' for i in range(30)])
    result = run_cli('x', '--input', 'docs.jsonl', cwd=tmp_path)  # --text_key defaults to 'text'
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "docs.jsonl:1 is not a JSON object with a 'text' field: pass --text_key" in result.stderr


def test_parquet_without_pyarrow_is_one_line(tmp_path):
    try:
        import pyarrow  # noqa: F401
        pytest.skip('pyarrow is installed: the error for its absence cannot show')
    except ImportError:
        pass
    (tmp_path / 'd.parquet').write_bytes(b'PAR1')
    result = run_cli('x', '--input', 'd.parquet', cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert 'd.parquet is parquet, which needs pyarrow: pip install pyarrow' in result.stderr


def test_parquet_records_split_like_the_same_records_in_jsonl(tmp_path):
    pa = pytest.importorskip('pyarrow')
    import pyarrow.parquet
    texts = write_docs(tmp_path / 'docs')
    bodies = [texts[name] for name in sorted(texts)]
    pyarrow.parquet.write_table(pa.table({'id': list(range(len(bodies))), 'body': bodies}),
                                tmp_path / 'docs.parquet')
    (tmp_path / 'docs.jsonl').write_text(''.join(json.dumps({'body': b}) + '\n' for b in bodies))
    outs = [prepare.prepare('d', data_dir=tmp_path / f'out_{name}', input_path=tmp_path / name,
                            text_key='body')
            for name in ('docs.parquet', 'docs.jsonl')]
    for split in prepare.SPLITS:
        assert read_split(outs[0], split).tolist() == read_split(outs[1], split).tolist()
    assert read_meta(outs[0])['duplicates_dropped'] == 2
    result = run_cli('x', '--input', 'docs.parquet', cwd=tmp_path)  # --text_key defaults to 'text'
    assert (result.returncode == 2
            and "docs.parquet has no column 'text' (it has id, body)" in result.stderr)


def test_small_shards_hold_the_same_tokens(tmp_path, monkeypatch):
    rng = random.Random(0)
    text = ''.join(rng.choice('abcdefghij \n') for _ in range(5000))
    (tmp_path / 'in.txt').write_text(text, encoding='utf-8')
    # many pieces, cut at newlines, tokenized by 2 processes
    monkeypatch.setattr(prepare, 'BATCH_BYTES', 512)
    one = prepare.prepare('t', data_dir=tmp_path / 'one', input_path=tmp_path / 'in.txt',
                          num_proc=1)
    many = prepare.prepare('t', data_dir=tmp_path / 'many', input_path=tmp_path / 'in.txt',
                           shard_size=1000, num_proc=2)
    meta = read_meta(many)
    # 4250 tokens
    assert meta['splits']['train']['shards'] == [f't_train_{i:06d}.bin' for i in range(5)]
    for split in prepare.SPLITS:
        assert read_split(one, split).tolist() == read_split(many, split).tolist()
        counts = [int(np.fromfile(os.path.join(many, f), dtype=np.int32, count=3)[2])
                  for f in meta['splits'][split]['shards']]
        assert counts[:-1] == [1000] * (len(counts) - 1) and 0 < counts[-1] <= 1000
    decode = tokenizer.load(meta['tokenizer']).decode
    assert decode(read_split(many, 'train').tolist()) == text[250:4500]


def write_jsonl_corpus(path, megabytes):
    rng = random.Random(0)
    words = [''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    size = 0
    with open(path, 'w') as f:
        while size < megabytes * 1e6:
            line = json.dumps({'text': ' '.join(rng.choices(words, k=rng.randint(100, 600)))
                                       + '.'}) + '\n'
            f.write(line)
            size += len(line)


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """A prepare that held the corpus would grow by several bytes per character (text, code points,
    ids): 50 MB more text, 250 MB or more; one that read ahead of its tokenizers (Pool.imap) by the
    50 MB of text. Streaming holds at most 2 x num_proc tasks of about 1 MB of text and their ids,
    so the peak rises towards that bound, by well under 25 MB, and the set of document digests grows
    by ~70 bytes per document (23,000 more here: 1.6 MB)."""
    peaks = []
    for megabytes in (10, 60):
        corpus = tmp_path / f'c{megabytes}.jsonl'
        write_jsonl_corpus(corpus, megabytes)
        measure = ('import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, '
                   'capture_output=True); '
                   # KB: the largest process
                   'print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)')
        result = subprocess.run([sys.executable, '-c', measure, sys.executable, PREPARE_PY, 'c',
                                 '--input', str(corpus),
                                 '--data_dir', str(tmp_path / f'd{megabytes}'), '--num_proc', '2'],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        peaks.append(int(result.stdout) / 1024)
    assert peaks[1] - peaks[0] < 25, (f'peak RSS {peaks[0]:.0f} MB on 10 MB, {peaks[1]:.0f} MB on '
                                      f'60 MB')


def test_pieces_of_a_text_without_newlines_cut_between_characters(tmp_path, monkeypatch):
    text = 'héllo wörld ☃ 𝄞 ' * 50  # characters of 1 to 4 bytes, no newline
    (tmp_path / 'in.txt').write_text(text, encoding='utf-8')
    monkeypatch.setattr(prepare, 'BATCH_BYTES', 7)
    progress = prepare.Progress('test', 0)
    size = os.path.getsize(tmp_path / 'in.txt')
    pieces = [piece.decode('utf-8')
              for _, piece in prepare.text_chunks(tmp_path / 'in.txt', 0, size, progress)]
    assert ''.join(pieces) == text and len(pieces) > 100


@pytest.mark.parametrize('line', [
    '    return self.value_{} ',  # indented code: '\n   ' is one piece, ' return' the next
    'Привет мир, глава\n',  # '\n\n' is one piece
    '\u3000\u3000第{}章\r',  # ideographic spaces, CRLF
])
def test_pieces_of_a_text_split_into_gpt2s_pretokens_as_the_whole_text_does(tmp_path, monkeypatch,
                                                                              line):
    # a cut after a newline split a whitespace run, and a BPE dataset's shards over 1 MiB
    # (BATCH_BYTES) were not the tokenizer's encoding of the text
    import regex  # tiktoken's
    text = ''.join(line.format(i) + '\n' for i in range(300))
    (tmp_path / 'in.txt').write_bytes(text.encode())
    monkeypatch.setattr(prepare, 'BATCH_BYTES', 200)
    progress = prepare.Progress('test', 0)
    size = os.path.getsize(tmp_path / 'in.txt')
    pieces = [piece.decode() for _, piece in prepare.text_chunks(tmp_path / 'in.txt', 0, size,
                                                                 progress)]
    assert ''.join(pieces) == text and len(pieces) > 20
    split = regex.compile(tokenizer.GPT2_PAT_STR).findall
    assert [p for piece in pieces for p in split(piece)] == split(text)
