"""
Prepare a dataset for training: read the source text, split it into train/val/test
without letting any text leak across splits, tokenize it, and write
DATA_DIR/NAME/{train,val,test}.bin (raw uint16 or uint32 token ids) plus meta.json.

$ python prepare.py pystdlib_char                     # this Python's stdlib source, offline
$ python prepare.py shakespeare_char --input input.txt
$ python prepare.py mydata --input corpus/ --tokenizer gpt2
"""
import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import urllib.request

import numpy as np
import tiktoken
import tiktoken.load

SHAKESPEARE_URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
KNOWN_DATASETS = ('pystdlib_char', 'shakespeare_char', 'shakespeare')
SPLITS = ('train', 'val', 'test')
EOT = '<|endoftext|>'
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class PrepareError(Exception):
    """A user mistake; the one-line message says what is wrong and how to fix it."""


def sha256(text):
    return hashlib.sha256(text.encode('utf-8')).hexdigest()

# -----------------------------------------------------------------------------
# sources: either one text (str) or many documents [(document id, text)]

def decode_utf8(data, where):
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise PrepareError(f'{where} is not UTF-8 (invalid byte at offset {e.start}): '
                           f'convert it first, e.g. iconv -f LATIN1 -t UTF-8 IN > OUT') from None


def read_folder(root, keep_dir=lambda name: True, keep_file=lambda name: True):
    """Every kept file under root as (path relative to root, text), walking in sorted order."""
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if keep_dir(d))
        for filename in sorted(filter(keep_file, filenames)):
            path = os.path.join(dirpath, filename)
            if os.path.isfile(path):
                with open(path, 'rb') as f:
                    docs.append((os.path.relpath(path, root), decode_utf8(f.read(), path)))
    return docs


def is_stdlib_code_dir(name):
    # test packages are left out: they are fixtures and generated data more than code
    return name not in ('site-packages', '__pycache__', 'idle_test') and not name.startswith('test')


def download(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read()
    except Exception as e:
        raise PrepareError(f'could not download {url} ({e}; offline?): '
                           f'pass --input PATH to a local copy') from None


def read_source(name, input_path):
    """Returns (description of the source, text or documents)."""
    if input_path is None:
        if name == 'pystdlib_char':
            root = sysconfig.get_paths()['stdlib']
            docs = read_folder(root, keep_dir=is_stdlib_code_dir, keep_file=lambda f: f.endswith('.py'))
            return f'python stdlib at {root}', docs
        if name in ('shakespeare_char', 'shakespeare'):
            return SHAKESPEARE_URL, decode_utf8(download(SHAKESPEARE_URL), SHAKESPEARE_URL)
        raise PrepareError(f'unknown dataset {name!r}: use one of {", ".join(KNOWN_DATASETS)}, '
                           f'or pass --input PATH to a text file or folder')
    source = os.path.abspath(input_path)
    if os.path.isdir(input_path):
        docs = read_folder(input_path)
        if not docs:
            raise PrepareError(f'input folder {input_path} has no files: put text files in it')
        return source, docs
    if os.path.isfile(input_path):
        with open(input_path, 'rb') as f:
            return source, decode_utf8(f.read(), input_path)
    raise PrepareError(f'input {input_path} does not exist: check the --input path')


def source_sha256(content):
    """Identical input gives an identical hash; a single text hashes like sha256sum of the file."""
    if isinstance(content, str):
        return sha256(content)
    h = hashlib.sha256()
    for doc_id, text in sorted(content):
        data = text.encode('utf-8')
        h.update(f'{doc_id}\0{len(data)}\0'.encode('utf-8') + data)  # lengths keep boundaries unambiguous
    return h.hexdigest()

# -----------------------------------------------------------------------------
# splits: {split: [(document id, text)]}

def split_contiguous(text):
    """One text: contiguous blocks. Val is the last 10% and train ends where it begins, exactly as in nanoGPT,
    so val losses compare: the text just before val shares its scenes and speakers, and holding it out as test
    raised the val loss of nanoGPT's shakespeare_char recipe well above nanoGPT's (docs/design.md).
    So test is the first 5%."""
    n = len(text)
    char_ranges = {'train': (int(0.05 * n), int(0.9 * n)), 'val': (int(0.9 * n), n), 'test': (0, int(0.05 * n))}
    return {split: [(split, text[a:b])] for split, (a, b) in char_ranges.items()}, char_ranges


def split_documents(docs, seed):
    """Many documents: each whole document goes to one split. Exact duplicates are dropped
    first, otherwise a copy in train would make the model look better on val than it is.
    Returns (splits, number of duplicates dropped)."""
    seen, unique = set(), []
    for doc_id, text in sorted(docs):
        digest = sha256(text)
        if digest not in seen:
            seen.add(digest)
            unique.append((doc_id, text))
    if len(unique) < 3:
        raise PrepareError(f'only {len(unique)} distinct documents: need at least 3 (one per split); '
                           f'add files, or pass a single file to split it by position')
    ids = [doc_id for doc_id, _ in unique]
    random.Random(seed).shuffle(ids)
    n_val, n_test = max(1, round(0.1 * len(ids))), max(1, round(0.05 * len(ids)))
    split_ids = {'train': set(ids[n_val + n_test:]), 'val': set(ids[:n_val]), 'test': set(ids[n_val:n_val + n_test])}
    splits = {split: [(i, t) for i, t in unique if i in split_ids[split]] for split in SPLITS}
    check_no_leak(splits)
    return splits, len(docs) - len(unique)


def check_no_leak(splits):
    # a real check rather than assert, which python -O would strip
    for a, b in itertools.combinations(SPLITS, 2):
        shared_ids = {i for i, _ in splits[a]} & {i for i, _ in splits[b]}
        shared_texts = {sha256(t) for _, t in splits[a]} & {sha256(t) for _, t in splits[b]}
        if shared_ids or shared_texts:
            raise RuntimeError(f'bug: splits {a} and {b} share {len(shared_ids)} document ids '
                               f'and {len(shared_texts)} document contents')

# -----------------------------------------------------------------------------
# tokenizers

def char_encoder(chars):
    """str -> array of ids: chars[k] gets id k+1, anything else the unknown id 0."""
    table = np.zeros(0x110000, dtype=np.uint32)  # one slot per unicode code point
    table[[ord(c) for c in chars]] = np.arange(1, len(chars) + 1)
    return lambda text: table[np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)]


def tiktoken_encoding(spec, pat_str=GPT2_PAT_STR, expected_sha256=None):
    """'gpt2' or PATH.tiktoken -> (tiktoken Encoding, its meta['tokenizer'] entry)."""
    if spec == 'gpt2':
        try:
            enc = tiktoken.get_encoding('gpt2')
        except Exception:
            raise PrepareError('could not load the gpt2 tokenizer (tiktoken needs a one-time download; offline?): '
                               'put the cached file in TIKTOKEN_CACHE_DIR, or use --tokenizer char') from None
        return enc, {'kind': 'tiktoken', 'encoding': 'gpt2', 'pat_str': GPT2_PAT_STR, 'eot_id': enc.eot_token}
    if not spec.endswith('.tiktoken'):
        raise PrepareError(f'tokenizer {spec!r} not understood: use char, gpt2, or a path to a .tiktoken ranks file')
    path = os.path.abspath(spec)
    if not os.path.isfile(path):
        raise PrepareError(f'tokenizer file {path} not found: check the --tokenizer path')
    with open(path, 'rb') as f:
        ranks_sha256 = hashlib.sha256(f.read()).hexdigest()
    if expected_sha256 not in (None, ranks_sha256):
        raise PrepareError(f'tokenizer file {path} changed since the dataset was prepared: '
                           f'restore it, or re-run prepare.py')
    try:
        # tiktoken caches even local files by path; the hash makes it re-read a stale cached copy
        ranks = tiktoken.load.load_tiktoken_bpe(path, expected_hash=ranks_sha256)
        enc = tiktoken.Encoding(name=os.path.basename(path)[:-len('.tiktoken')], pat_str=pat_str,
                                mergeable_ranks=ranks, special_tokens={EOT: len(ranks)})
    except ValueError as e:
        raise PrepareError(f'tokenizer file {path} is not a tiktoken ranks file ({e}): '
                           f'each line must be "base64(token bytes) rank"') from None
    return enc, {'kind': 'tiktoken', 'encoding': path, 'ranks_sha256': ranks_sha256,
                 'pat_str': pat_str, 'eot_id': enc.eot_token}


def load_tokenizer(meta):
    """meta.json's dict -> (encode: str -> list[int], decode: list[int] -> str)."""
    tok = meta['tokenizer']
    if tok['kind'] == 'char':
        encode_array, itos = char_encoder(tok['chars']), ['\ufffd'] + tok['chars']
        return (lambda s: encode_array(s).tolist()), (lambda ids: ''.join(itos[i] for i in ids))
    enc, _ = tiktoken_encoding(tok['encoding'], tok['pat_str'], tok.get('ranks_sha256'))
    return (lambda s: enc.encode(s, allowed_special={EOT})), enc.decode


def tokenize(splits, enc, eot_after_each_document):
    """Returns ({split: token ids}, meta['tokenizer'] for char or None, vocab_size)."""
    texts = {split: [t for _, t in docs] for split, docs in splits.items()}
    if enc is None:
        # the vocabulary comes from train only: val/test are new text, whose unseen
        # characters the model could not have an id for either
        joined = {split: ''.join(texts[split]) for split in SPLITS}
        chars = sorted(set(joined['train']))
        encode = char_encoder(chars)
        return {split: encode(joined[split]) for split in SPLITS}, {'kind': 'char', 'chars': chars, 'unk_id': 0}, len(chars) + 1
    eot = [enc.eot_token] if eot_after_each_document else []
    tokens = {}
    for split in SPLITS:
        ids = []
        for doc_ids in enc.encode_ordinary_batch(texts[split]):
            ids += doc_ids + eot
        tokens[split] = np.array(ids, dtype=np.uint32)
    return tokens, None, enc.n_vocab

# -----------------------------------------------------------------------------

def prepare(name, data_dir='data', input_path=None, tokenizer=None, seed=1337):
    """Write data_dir/name/{train,val,test}.bin and meta.json; returns data_dir/name."""
    if not name or name.startswith('.') or '/' in name or os.sep in name:
        raise PrepareError(f'dataset name {name!r} must be a plain folder name, like my_data')
    tokenizer = tokenizer or ('gpt2' if name == 'shakespeare' else 'char')
    # load the tokenizer before reading anything, so a bad --tokenizer fails fast
    enc, tokenizer_meta = (None, None) if tokenizer == 'char' else tiktoken_encoding(tokenizer)
    source, content = read_source(name, input_path)
    if not any(t.strip() for t in ([content] if isinstance(content, str) else [t for _, t in content])):
        raise PrepareError(f'input {source} is empty or only whitespace: point --input at some text')

    if isinstance(content, str):
        splits, char_ranges = split_contiguous(content)
        duplicates_dropped = 0
        split_rule = 'contiguous: test [0, 0.05n), train [0.05n, 0.9n), val [0.9n, n) characters'
    else:
        splits, duplicates_dropped = split_documents(content, seed)
        char_ranges = None
        split_rule = f'documents: seeded shuffle (seed {seed}), 10% val, 5% test, exact duplicates dropped'
    tokens, char_meta, vocab_size = tokenize(splits, enc, eot_after_each_document=char_ranges is None)
    tokenizer_meta = tokenizer_meta or char_meta

    split_meta = {}
    for split in SPLITS:
        if len(tokens[split]) == 0:
            raise PrepareError(f'the {split} split has no tokens: the input is too small, give it more text')
        split_meta[split] = {'tokens': len(tokens[split]), 'documents': len(splits[split])}
        if enc is None:
            split_meta[split]['unknown_chars'] = int((tokens[split] == 0).sum())
        if char_ranges:
            split_meta[split]['char_range'] = list(char_ranges[split])
    dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    meta = {
        'name': name, 'tokenizer': tokenizer_meta, 'vocab_size': vocab_size, 'dtype': np.dtype(dtype).name,
        'splits': split_meta, 'source': source, 'source_sha256': source_sha256(content),
        'split_rule': split_rule, 'seed': seed, 'duplicates_dropped': duplicates_dropped,
    }

    # build the dataset in a temp folder beside the target and swap it in at the end,
    # so a failed run never leaves a half-written dataset or destroys the previous one
    out_dir = os.path.join(data_dir, name)
    os.makedirs(data_dir, exist_ok=True)
    work_dir = tempfile.mkdtemp(prefix=f'.{name}.', dir=data_dir)
    try:
        new_dir = os.path.join(work_dir, name)
        os.mkdir(new_dir)
        for split in SPLITS:
            tokens[split].astype(dtype).tofile(os.path.join(new_dir, f'{split}.bin'))
        with open(os.path.join(new_dir, 'meta.json'), 'w', encoding='utf-8') as f:
            json.dump(meta, f, indent=2, ensure_ascii=False)
        if os.path.exists(out_dir):
            os.replace(out_dir, os.path.join(work_dir, 'old'))
        os.replace(new_dir, out_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description='Tokenize a text dataset into train/val/test .bin files.')
    parser.add_argument('name', help=f'dataset name: {", ".join(KNOWN_DATASETS)}, or any name with --input')
    parser.add_argument('--input', dest='input_path', help='a text file (split by position) or a folder (split by file)')
    parser.add_argument('--tokenizer', help='char, gpt2 or PATH.tiktoken (default: gpt2 for shakespeare, else char)')
    parser.add_argument('--data_dir', default='data', help='where the dataset folder is written')
    parser.add_argument('--seed', type=int, default=1337, help='seed of the document shuffle')
    args = parser.parse_args(argv)
    try:
        out_dir = prepare(args.name, args.data_dir, args.input_path, args.tokenizer, args.seed)
    except PrepareError as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(out_dir, 'meta.json'), encoding='utf-8') as f:
        meta = json.load(f)
    print(f"wrote {out_dir}: vocab_size {meta['vocab_size']} ({meta['tokenizer']['kind']}), {meta['dtype']}, "
          f"{meta['duplicates_dropped']} duplicate documents dropped")
    for split, s in meta['splits'].items():
        unknown = f", {s['unknown_chars']:,} unknown chars" if 'unknown_chars' in s else ''
        print(f"  {split:5s} {s['tokens']:>12,} tokens {s['documents']:>6,} documents{unknown}")


if __name__ == '__main__':
    main()
