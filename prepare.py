"""
Prepare a dataset for training: stream the source documents, split them into train/val/test without
letting any text leak across splits, tokenize them in parallel, and write DATA_DIR/NAME/ as shards
in llm.c's format (NAME_train_000000.bin, ...: a header of 256 int32, then uint16 or uint32 token
ids) plus meta.json. Memory stays bounded whatever the corpus size: documents are read, tokenized
and written a batch at a time. It reads top to bottom as the data flows: source -> split ->
tokenizer fit on train -> encode -> write.

$ python prepare.py pystdlib_char                     # this Python's stdlib source, offline
$ python prepare.py shakespeare_char --input input.txt
$ python prepare.py mydata --input corpus/ --tokenizer gpt2
$ python prepare.py code --input src/ --tokenizer bpe:8192     # a BPE learned on the train split
$ python prepare.py web --input dump.jsonl.gz --text_key text --tokenizer gpt2 --num_proc 8
"""
import argparse
import collections
import fcntl
import gzip
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
import urllib.request
import zlib

import numpy as np

import tokenizer
from configurator import fail

SHAKESPEARE_URL = ('https://raw.githubusercontent.com/karpathy/char-rnn/master/data/'
                   'tinyshakespeare/input.txt')
KNOWN_DATASETS = ('pystdlib_char', 'shakespeare_char', 'shakespeare')
DATA_DIR = 'data'  # --data_dir's default, and train.py's
SPLITS = ('train', 'val', 'test')
# text per task sent to a tokenizer process: large enough that pickling costs little
BATCH_BYTES = 1 << 20
VAL_FRACTION, TEST_FRACTION = 0.10, 0.05
# the most train text a BPE learns from: bounds its memory (docs/design.md)
BPE_SAMPLE_BYTES = 1_000_000_000


class PrepareError(Exception):
    """A user mistake; the one-line message says what is wrong and how to fix it."""

# -----------------------------------------------------------------------------
# source: items (id, raw bytes, kind, split, offset) read lazily. kind says how a tokenizer process
# gets the text out; a single text's pieces come with their split (by position) and offset in the
# file, a document with None, 0

def decode_utf8(raw, where, offset=0):
    """A file's bytes (from offset in it) as text; bytes no UTF-8 text file holds are refused."""
    if offset == 0 and raw[:2] in (b'\xff\xfe', b'\xfe\xff'):  # text, with NULs: not binary
        raise PrepareError(f'{where} is UTF-16 (its byte-order mark), not UTF-8: convert it '
                           f'first, e.g. iconv -f UTF-16 -t UTF-8 IN > OUT')
    # no text file holds one, in any 8-bit encoding; a valid UTF-8 one is binary (a .tar) or
    # UTF-16 without its mark, every other byte a NUL
    if b'\0' in raw:
        raise PrepareError(f'{where} is binary or UTF-16, not UTF-8 text (a NUL byte at offset '
                           f'{offset + raw.index(0)}): leave it out of --input, or convert UTF-16 '
                           f'first, e.g. iconv -f UTF-16LE -t UTF-8 IN > OUT')
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        raise PrepareError(f'{where} is not UTF-8 (invalid byte at offset {offset + e.start}): '
                           f'convert it first, e.g. iconv -f LATIN1 -t UTF-8 IN > OUT') from None


def walk_files(root, keep_dir=lambda name: True, keep_file=lambda name: True):
    """Every kept file under root, walking in sorted order, into linked folders too (each folder
    once: a link to a folder above would loop); a broken link is refused."""
    seen = {os.path.realpath(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        kept = []
        for name in sorted(filter(keep_dir, dirnames)):
            real = os.path.realpath(os.path.join(dirpath, name))
            if real not in seen:
                seen.add(real)
                kept.append(name)
        dirnames[:] = kept
        for filename in sorted(filter(keep_file, filenames)):
            path = os.path.join(dirpath, filename)
            if os.path.isfile(path):
                yield path
            elif not os.path.exists(path):  # to nothing, or to a link back
                raise PrepareError(f'{path} is a link (to {os.readlink(path)}) that leads to no '
                                   f'file: fix or remove it')


def is_stdlib_code_dir(name):
    # test packages are left out: they are fixtures and generated data more than code
    return name not in ('site-packages', '__pycache__', 'idle_test') and not name.startswith('test')


def is_hidden_or_cache(name):
    # a folder given as --input may be a repository: .git's objects and caches are no one's text
    return name.startswith('.') or name == '__pycache__'


def is_records_file(path):
    return path.lower().endswith(('.jsonl', '.jsonl.gz', '.parquet'))  # DATA.JSONL too


class Reader:
    """The documents of a list of files, read lazily, as items (id, raw bytes, kind, split, offset):
    kind says how a tokenizer process gets the text out of the bytes. bytes_done says how far it got
    in bytes on disk."""

    def __init__(self, files, root, text_key):
        self.files, self.root, self.text_key = files, root, text_key
        self.total_bytes = sum(os.path.getsize(p) for p in files)
        self.bytes_done = 0

    def __iter__(self):
        done = 0
        for path in self.files:
            rel = os.path.relpath(path, self.root) if self.root else os.path.basename(path)
            with open(path, 'rb') as raw:
                if path.lower().endswith('.parquet'):
                    for k, text in enumerate(parquet_texts(path, self.text_key)):
                        yield f'{rel}:{k}', text.encode('utf-8'), 'record', None, 0
                elif is_records_file(path):
                    lines = gzip_lines(raw, path) if path.lower().endswith('.gz') else raw
                    for k, line in enumerate(lines):
                        self.bytes_done = done + raw.tell()
                        if line.strip():
                            yield f'{rel}:{k + 1}', line, f'json:{self.text_key}', None, 0
                else:
                    yield rel, raw.read(), 'text', None, 0
            done += os.path.getsize(path)
            self.bytes_done = done


def gzip_lines(raw, path):
    try:
        yield from gzip.open(raw)
    except (OSError, EOFError, zlib.error) as e:  # not gzip, truncated, corrupt
        raise PrepareError(f'{path} is not a readable gzip file ({e}): compress or download it '
                           f'again') from None


def parquet_texts(path, text_key):
    try:
        import pyarrow.parquet
    except ImportError:
        raise PrepareError(f'{path} is parquet, which needs pyarrow: pip install pyarrow, or '
                           f'convert it to .jsonl') from None
    records = pyarrow.parquet.ParquetFile(path)
    if text_key not in records.schema_arrow.names:
        raise PrepareError(f'{path} has no column {text_key!r} (it has '
                           f'{", ".join(records.schema_arrow.names)}): pass --text_key NAME of the '
                           f'column that holds the text')
    # the default 65,536 rows: GBs of long documents
    for batch in records.iter_batches(batch_size=1024, columns=[text_key]):
        yield from (t or '' for t in batch.column(0).to_pylist())


# Unicode's White_Space: what GPT-2's pre-tokenizer (tokenizer.GPT2_PAT_STR, Rust's regex) calls
# \s, which Python's re widens (to '\x1c'-'\x1f')
WHITE_SPACE = '\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000'
# before the last character of a whitespace run that another character follows: the pre-tokenizer
# ends a piece there (the run's rest is one, that last character goes alone or, a space, with the
# word after it), so both sides of a cut there split as the whole text does; a cut after a newline
# could split a piece ('\n   ' before indented code, '\n\n') in two
CLEAN_CUT = re.compile(f'.*(?=[{WHITE_SPACE}][^{WHITE_SPACE}])', re.DOTALL)


def text_chunks(path, start, end, progress):
    """The bytes [start, end) of a file as (offset, piece) of about BATCH_BYTES each, tokenized one
    by one: cut where GPT-2's pre-tokenizer splits (CLEAN_CUT), or else after the last newline, or
    else where a character starts, so no character is ever cut in two."""
    with open(path, 'rb') as f:
        f.seek(start)
        rest = b''
        while start < end:
            block = rest + f.read(min(BATCH_BYTES, end - start))
            start += len(block) - len(rest)
            cut = len(block) if start >= end else clean_cut(block)
            rest = block[cut:]
            progress.bytes_done = start - len(rest)
            if cut:
                yield progress.bytes_done - cut, block[:cut]


def clean_cut(block):
    """Where text_chunks cuts a block of bytes: CLEAN_CUT's place, or else after its last newline,
    or else where a character starts (no character is longer than 4 bytes: one starts in the last
    4). surrogateescape: a byte that is no UTF-8 comes back as it was, for decode_utf8 to name."""
    text = block[:char_boundary(block, max(len(block) - 4, 0))].decode('utf-8', 'surrogateescape')
    clean = CLEAN_CUT.match(text)
    if clean and clean.end():
        return len(text[:clean.end()].encode('utf-8', 'surrogateescape'))
    return block.rfind(b'\n') + 1 or char_boundary(block, max(len(block) - 4, 0))


def char_boundary(raw, i):
    """The first position at or after i where a UTF-8 character starts in the bytes raw."""
    while i < len(raw) and raw[i] & 0xC0 == 0x80:  # continuation bytes are 10xxxxxx
        i += 1
    return i


def position_bounds(path):
    """A single text's split by position: test the first 5%, val the last 10% of its bytes, and
    train what is between, each bound moved forward to the next character. Val is the last 10% and
    train ends where it begins, exactly as in nanoGPT, so val losses compare: the text just before
    val shares its scenes and speakers, and holding it out as test raised the val loss of nanoGPT's
    shakespeare_char recipe well above nanoGPT's (docs/design.md)."""
    n = os.path.getsize(path)
    with open(path, 'rb') as f:
        def bound(fraction):
            f.seek(int(fraction * n))
            return int(fraction * n) + char_boundary(f.read(4), 0)
        a, b = bound(TEST_FRACTION), bound(1 - VAL_FRACTION)
    return {'test': (0, a), 'train': (a, b), 'val': (b, n)}


def source_items(name, input_path, text_key, work_dir):
    """(description, single text path or None, Reader of documents or None) for a dataset's
    source."""
    if input_path is None:
        if name == 'pystdlib_char':
            root = sysconfig.get_paths()['stdlib']
            files = list(walk_files(root, keep_dir=is_stdlib_code_dir,
                                    keep_file=lambda f: f.endswith('.py')))
            return f'python stdlib at {root}', None, Reader(files, root, text_key)
        if name in ('shakespeare_char', 'shakespeare'):
            path = os.path.join(work_dir, 'input.txt')
            with open(path, 'wb') as f:
                f.write(download(SHAKESPEARE_URL))
            return SHAKESPEARE_URL, path, None
        raise PrepareError(f'unknown dataset {name!r}: use one of {", ".join(KNOWN_DATASETS)}, '
                           f'or pass --input PATH to a text file, folder, .jsonl(.gz) or .parquet')
    input_path = os.fspath(input_path)
    source = os.path.abspath(input_path)
    if os.path.isdir(input_path):
        files = list(walk_files(input_path, keep_dir=lambda d: not is_hidden_or_cache(d),
                                keep_file=lambda f: not is_hidden_or_cache(f)))
        if not files:
            raise PrepareError(f'input folder {input_path} has no files (hidden ones and '
                               f'__pycache__ are left out): put text files in it')
        return source, None, Reader(files, input_path, text_key)
    if os.path.isfile(input_path):
        if is_records_file(input_path):
            return source, None, Reader([input_path], None, text_key)
        if input_path.lower().endswith('.json'):  # its records would be trained on as JSON text
            raise PrepareError(f'input {input_path} is JSON: prepare.py reads records from .jsonl '
                               f'(JSON Lines) and .parquet files: rename JSON Lines to .jsonl, or '
                               f"convert an array first, e.g. jq -c '.[]' IN > OUT.jsonl")
        return source, input_path, None
    if os.path.exists(input_path):  # a device, a pipe
        raise PrepareError(f'input {input_path} is neither a file nor a folder: point --input at '
                           f'text files')
    raise PrepareError(f'input {input_path} does not exist: check the --input path')


def download(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read()
    except Exception as e:
        raise PrepareError(f'could not download {url} ({e}; offline?): '
                           f'pass --input PATH to a local copy') from None


def read_source(text_path, reader, progress, source_hash):
    """The source's items, in order; source_hash (a hashlib object) gets its bytes: a single text's,
    or the ids, lengths and bytes of its documents."""
    if text_path:
        for split, (a, b) in position_bounds(text_path).items():
            for offset, chunk in text_chunks(text_path, a, b, progress):
                source_hash.update(chunk)
                yield text_path, chunk, 'text', split, offset
        return
    for item in reader:
        doc_id, raw = item[:2]
        # lengths keep boundaries unambiguous
        source_hash.update(f'{doc_id}\0{len(raw)}\0'.encode('utf-8') + raw)
        progress.bytes_done = reader.bytes_done
        yield item

# -----------------------------------------------------------------------------
# split: a single text's by position (position_bounds), documents' in order as they come

class DocumentSplitter:
    """Splits of documents in the order they come, drawn in blocks of 20 distinct documents: a
    permutation from (seed, block) puts 2 in val, 1 in test, 17 in train. No list of all documents
    is needed, every block holds exactly 10% val and 5% test, so 20 documents make three splits.
    Copies (process_batch's digest: line endings, a byte-order mark and surrounding whitespace
    aside) are dropped (None), otherwise a copy in train would make the model look better on val
    than it is. seen holds a Python int per distinct document: about 70 bytes each (69.5 measured
    with tracemalloc over a million)."""
    BLOCK = ['val'] * 2 + ['test'] + ['train'] * 17

    def __init__(self, seed):
        self.seed, self.seen, self.items = seed, set(), 0

    def __call__(self, digest):
        self.items += 1
        if digest in self.seen:
            return None
        block, slot = divmod(len(self.seen), len(self.BLOCK))
        self.seen.add(digest)
        if slot == 0:
            self.layout = random.Random(f'{self.seed}/{block}').sample(self.BLOCK, len(self.BLOCK))
        return self.layout[slot]


def split_rule(documents, seed):
    if documents:
        return (f'documents: in blocks of 20 distinct documents, a seeded permutation (seed '
                f'{seed}) puts 2 in val, 1 in test, 17 in train; copies dropped (line endings, '
                f'a byte-order mark and surrounding whitespace aside)')
    return 'contiguous: test [0, 0.05n), train [0.05n, 0.9n), val [0.9n, n) bytes'

# -----------------------------------------------------------------------------
# encode: tokenizer processes run a job on every item, a batch at a time: one batch of items in, per
# item (content digest, split or None for a document, has text, bytes of text, the job's result) out

worker = {}  # this process's job(text, digest), set once by init_worker


def init_worker(job):
    # the parent alone handles a stop (main): a terminal's Ctrl-C reaches the whole process group,
    # and the pool ends its processes with SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    worker['job'] = job


def process_batch(batch):
    out = []
    for doc_id, raw, kind, split, offset in batch:
        if kind.startswith('json:'):
            key = kind[5:]
            try:
                record = json.loads(decode_utf8(raw, doc_id))
            # cut short, a byte-order mark, or nested past Python's stack (RecursionError)
            except (ValueError, RecursionError) as e:
                raise PrepareError(f'{doc_id} is not valid JSON ({e}): fix or drop that '
                                   f'line') from None
            if not isinstance(record, dict) or key not in record:
                raise PrepareError(f'{doc_id} is not a JSON object with a {key!r} field: '
                                   f'pass --text_key NAME of the field that holds the text')
            text = record[key]
            if not isinstance(text, str):
                raise PrepareError(f'{doc_id} has {key!r}: {json.dumps(text)[:40]}, not a string: '
                                   f'fix or drop that record')
            try:
                encoded = text.encode('utf-8')
            except UnicodeEncodeError as e:  # JSON's \ud800 escapes can name half a character
                raise PrepareError(f'{doc_id} holds a lone surrogate {text[e.start]!r}, which is '
                                   f'not text: fix or drop that record') from None
        elif kind == 'record':  # a parquet record's text: any character, NUL too, is its own
            text, encoded = raw.decode('utf-8'), raw
        else:
            text, encoded = decode_utf8(raw, doc_id, offset), raw
        # a copy saved with Windows' or old Macs' line endings, a byte-order mark or other
        # whitespace around it is the same document: DocumentSplitter drops it, not puts it in
        # another split
        same = text.replace('\r\n', '\n').replace('\r', '\n').lstrip('\ufeff').strip()
        digest = int.from_bytes(hashlib.blake2b(same.encode('utf-8'), digest_size=8).digest(),
                                'little')
        out.append((digest, split, bool(text) and not text.isspace(), len(encoded),
                    worker['job'](text, digest)))
    return out


def process_batch_in_pool(batch):
    """process_batch in a tokenizer process of a pool: an exception that is not an Exception (a
    panic in tiktoken's Rust) would end the process unreported, and the pool would wait for its
    result forever; it comes back as a RuntimeError."""
    try:
        return process_batch(batch)
    except Exception:
        raise
    except BaseException as e:
        raise RuntimeError(f'{type(e).__name__} in a tokenizer process: {e}') from None


def batched(items):
    """Items grouped into lists of about BATCH_BYTES of raw text."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(item[1])
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def processed(items, num_proc, job):
    """process_batch over batches of items, in order, whatever num_proc: the output does not depend
    on it. At most 2 x num_proc batches are in flight, so reading never runs ahead of tokenizing
    (Pool.imap would read it all). The processes are forked: job, a closure over a tokenizer too,
    reaches them without pickling."""
    if num_proc == 1:
        init_worker(job)
        for batch in batched(items):
            yield from process_batch(batch)
        return
    pool = multiprocessing.get_context('fork').Pool(num_proc, init_worker, (job,))
    try:
        pending = collections.deque()
        for batch in batched(items):
            pending.append(pool.apply_async(process_batch_in_pool, (batch,)))
            if len(pending) >= 2 * num_proc:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
    finally:  # also after an error or a stop: the processes end their batches (a second or two)
        # not Pool.terminate: it kills processes that may be sending a result, and then waits
        # forever for the result queue's lock such a process held
        pool.close()
        pool.join()


class Progress:
    """One line on stderr at most once a second: documents, tokens, MB/s, ETA."""

    def __init__(self, what, total_bytes):
        self.what, self.total_bytes = what, total_bytes
        self.bytes_done = self.documents = self.tokens = 0
        self.start = self.last = time.time()

    def update(self, documents, tokens):
        self.documents += documents
        self.tokens += tokens
        now = time.time()
        if now - self.last >= 1:
            self.last = now
            rate = self.bytes_done / (now - self.start)
            eta = (self.total_bytes - self.bytes_done) / rate if rate else float('inf')
            print(f'{self.what}: {self.documents:,} documents, {self.tokens:,} tokens, '
                  f'{self.bytes_done / 1e6:,.0f} of {self.total_bytes / 1e6:,.0f} MB, '
                  f'{rate / 1e6:.1f} MB/s, ETA {eta:.0f} s', file=sys.stderr, flush=True)


def run_pass(what, text_path, reader, num_proc, job, splitter, source_hash=None):
    """One streaming pass over the source, job(text, digest) run on every item by num_proc
    processes: per item, in order, (split, has text, bytes of text, the job's result), split None
    for a copy of a document."""
    progress = Progress(what, os.path.getsize(text_path) if text_path else reader.total_bytes)
    items = read_source(text_path, reader, progress, source_hash or hashlib.sha256())
    for digest, split, has_text, text_bytes, result in processed(items, num_proc, job):
        # not a character set's size
        progress.update(1, len(result) if isinstance(result, np.ndarray) else 0)
        yield split or splitter(digest), has_text, text_bytes, result


# -----------------------------------------------------------------------------
# the tokenizer: given, or fit on the train split alone (val and test are new text: the model must
# not have seen it, its vocabulary included)

def given_tokenizer(spec):
    """--tokenizer's value -> (the Tokenizer, or None for one fit on the train split, the BPE
    vocabulary asked)."""
    if spec == 'char':
        return None, 0
    if spec.startswith('bpe:'):
        if not spec[4:].isdigit() or not 257 <= int(spec[4:]) < 2 ** 32:
            raise PrepareError(f'tokenizer {spec!r}: the vocabulary size after bpe: must be a '
                               f'whole number from 257 (256 bytes and end-of-text) to 2**32 - 1 '
                               f'(uint32 ids), e.g. bpe:8192')
        return None, int(spec[4:])
    if spec == 'gpt2':
        try:
            return tokenizer.gpt2(), 0
        except tokenizer.TokenizerError:  # a dataset, unlike a run, can take README's offline route
            raise PrepareError("could not load the gpt2 tokenizer (tiktoken needs a one-time "
                               "download; offline?): use --tokenizer gpt2.tiktoken, GPT-2's "
                               "ranks written once where tiktoken can download (README.md, "
                               "Finetune GPT-2), or --tokenizer char") from None
    if not spec.endswith('.tiktoken'):
        raise PrepareError(f'tokenizer {spec!r} not understood: use char, gpt2, bpe:VOCAB_SIZE '
                           f'(e.g. bpe:8192) or a path to a .tiktoken ranks file')
    return tokenizer.ranks_file(os.path.abspath(spec)), 0


def copy_ranks(path, folder, name):
    """The .tiktoken ranks file at path copied beside the shards, as NAME.tiktoken (a learned
    BPE's name); returns its Tokenizer. The dataset then moves whole to another machine, and a later
    change to the file given (another dataset's BPE, prepared again) leaves it as it was."""
    shutil.copyfile(path, os.path.join(folder, f'{name}.tiktoken'))
    return tokenizer.ranks_file(f'{name}.tiktoken', folder)


def collect_chars(text, digest):
    return ''.join(set(text))


def train_chars(text_path, reader, num_proc, seed):
    """The character tokenizer of the train split's characters, at most all of unicode."""
    chars = set()
    for split, _, _, found in run_pass('pass 1/2, characters', text_path, reader, num_proc,
                                       collect_chars, DocumentSplitter(seed)):
        if split == 'train':
            chars.update(found)
    return tokenizer.char(sorted(chars))


def train_bpe(vocab_size, text_path, reader, num_proc, seed, folder, name):
    """A BPE learned on the train split's documents (a single text's pieces), written to
    folder/NAME.tiktoken; returns the Tokenizer. The sample: every train document whose content
    digest, uniform over 2**64, falls below BPE_SAMPLE_BYTES / the source's size on disk times
    2**64, so it is spread over the corpus and the same for any num_proc; all of train when the
    source is smaller. A compressed source holds more text than its size: the sample also ends
    before the document that would take it past BPE_SAMPLE_BYTES."""
    source_bytes = os.path.getsize(text_path) if text_path else reader.total_bytes
    fraction = min(BPE_SAMPLE_BYTES / max(source_bytes, 1), 1.0)
    sample = {'documents': 0, 'bytes': 0}

    def sampled(text, digest):
        return text if digest < fraction * 2**64 else None

    def train_texts():
        for split, _, text_bytes, text in run_pass('pass 1/2, BPE sample', text_path, reader,
                                                   num_proc, sampled, DocumentSplitter(seed)):
            if split == 'train' and text is not None:
                if sample['bytes'] + text_bytes > BPE_SAMPLE_BYTES:
                    return
                sample['documents'] += 1
                sample['bytes'] += text_bytes
                yield text
    tokenizer.train_bpe(train_texts(), vocab_size, os.path.join(folder, f'{name}.tiktoken'))
    tok = tokenizer.ranks_file(f'{name}.tiktoken', folder)
    tok.entry['trained'] = {
        'vocab_size_asked': vocab_size,
        'trainer': f"rustbpe {importlib.metadata.version('rustbpe')}",
        **sample,
        'sample_rule': f'train documents whose content digest < {fraction:.6g} x 2**64, '
                       f'at most {BPE_SAMPLE_BYTES:,} bytes'}
    return tok

# -----------------------------------------------------------------------------
# write: each split's ids appended to its shards, then meta.json

class LlmcShard:
    """llm.c's token shard, the format llm.c and modded-nanogpt publish FineWeb in: a header of 256
    int32 (magic, version, number of tokens), then the ids, uint16 (GPT-2's vocabulary) or uint32.
    Shards are written here and read by data.py through SHARD, so another format with a fixed-size
    header, then the ids, is a class with these members (docs/design.md)."""
    HEADER_BYTES = 256 * 4  # where the ids begin
    LAYOUTS = {'uint16': (20240520, 1), 'uint32': (20240801, 7)}  # llm.c's gpt-2 and llama-3 ones

    @staticmethod
    def header(num_tokens, dtype):
        """The header's bytes for a shard of num_tokens ids of dtype."""
        header = np.zeros(LlmcShard.HEADER_BYTES // 4, dtype=np.int32)
        header[:3] = *LlmcShard.LAYOUTS[np.dtype(dtype).name], num_tokens
        return header.tobytes()

    @staticmethod
    def parse_header(path, head):
        """(numpy dtype, number of tokens) from the first HEADER_BYTES of the shard at path;
        ValueError, naming path and the fix, for another layout."""
        magic, version, num_tokens = (int(v) for v in np.frombuffer(head[:12], dtype=np.int32))
        versions = {m: (v, dtype) for dtype, (m, v) in LlmcShard.LAYOUTS.items()}
        if magic not in versions:
            raise ValueError(f"{path} is not a token shard (magic {magic}, expected 20240520 or "
                             f"20240801 as llm.c writes): point the dataset at shard files, or "
                             f"prepare it again")
        if version != versions[magic][0]:
            raise ValueError(f"{path} has shard version {version}, this code reads version "
                             f"{versions[magic][0]} for magic {magic}: prepare it again with this "
                             f"prepare.py")
        return np.dtype(versions[magic][1]), num_tokens

    @staticmethod
    def read(fd, dtype, start, count):
        """count ids of dtype from position start of the open shard fd."""
        raw = os.pread(fd, count * dtype.itemsize, LlmcShard.HEADER_BYTES + start * dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype)


SHARD = LlmcShard  # the format this writes and data.py reads


class ShardWriter:
    """A split's tokens appended to NAME_SPLIT_000000.bin, NAME_SPLIT_000001.bin, ... of shard_size
    tokens each (the last one shorter). The header's token count is written when a shard is
    complete."""

    def __init__(self, folder, name, split, dtype, shard_size):
        self.folder, self.name, self.split, self.dtype, self.shard_size = (
            folder, name, split, np.dtype(dtype), shard_size)
        self.files, self.file, self.count = [], None, 0

    def append(self, tokens):
        while len(tokens):
            if self.file is None:
                self.file = open(os.path.join(
                    self.folder, f'{self.name}_{self.split}_{len(self.files):06d}.bin'), 'wb')
                self.file.write(SHARD.header(0, self.dtype))
            piece, tokens = (tokens[:self.shard_size - self.count],
                             tokens[self.shard_size - self.count:])
            self.file.write(piece.astype(self.dtype).tobytes())
            self.count += len(piece)
            if self.count == self.shard_size:
                self.close()

    def close(self):
        if self.file is not None:
            self.file.seek(0)
            self.file.write(SHARD.header(self.count, self.dtype))
            self.file.close()
            self.files.append(os.path.basename(self.file.name))
            self.file, self.count = None, 0


def splits_meta(counts, writers, text_path, char_level):
    """meta.json's splits: each one's counts, shard files and, for a single text, byte range."""
    splits = {}
    for split in SPLITS:
        if counts[split]['tokens'] == 0:
            raise PrepareError(f'the {split} split has no tokens: the input is too small, give it '
                               f'more text'
                               + ('' if text_path else ' or documents (20 make one of each)'))
        splits[split] = {**counts[split], 'shards': writers[split].files}
        if not char_level:
            del splits[split]['unknown_chars']
        if text_path:
            splits[split]['byte_range'] = list(position_bounds(text_path)[split])
    return splits


def replaced(out_dir, input_path):
    """Refuses to prepare into out_dir where that would destroy what is not a dataset prepare.py
    wrote (its meta.json holds source_sha256; an older prepare.py's, train.bin beside it): a
    dataset is replaced whole, so a folder of the user's files there, downloaded shards or the input
    itself would be lost. An empty folder is replaced."""
    target = os.path.realpath(out_dir)
    if input_path is not None:
        source = os.path.realpath(input_path)
        if source == target or source.startswith(target + os.sep):
            raise PrepareError(f'input {input_path} is in {out_dir}, the folder this dataset '
                               f'replaces: move the input out of it, or pick another name')
        # a second run would read the first one's shards
        if os.path.isdir(source) and target.startswith(source + os.sep):
            raise PrepareError(f'{out_dir} is inside the input folder {input_path}: pass a '
                               f'--data_dir outside it')
    if not os.path.lexists(out_dir):
        return
    try:
        empty = os.path.isdir(out_dir) and not os.listdir(out_dir)
    except OSError:  # a folder that cannot be read
        empty = False
    if empty:  # nothing to lose: made by hand (mkdir), or left empty
        return
    try:
        with open(os.path.join(out_dir, 'meta.json'), encoding='utf-8') as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = None
    older = os.path.exists(os.path.join(out_dir, 'train.bin'))  # datafiles says: prepare again
    if not (isinstance(meta, dict) and ('source_sha256' in meta or older)):
        raise PrepareError(f'{out_dir} exists and is not a dataset prepare.py wrote (no meta.json '
                           f'with source_sha256), which preparing would replace: move it away, '
                           f'or pick another name')


def prepare(name, data_dir=DATA_DIR, input_path=None, tokenizer=None, seed=1337, text_key=None,
            num_proc=None, shard_size=100_000_000):
    """Write data_dir/name/ (shards and meta.json); returns data_dir/name."""
    # train.py reads *?[ in its dataset as a glob
    if not name or name.startswith('.') or any(c in name for c in '/*?[' + os.sep):
        raise PrepareError(f'dataset name {name!r} must be a plain folder name, like my_data')
    if not 0 < shard_size < 2**31:
        raise PrepareError(f'shard_size={shard_size} must be between 1 and 2**31-1 (the header '
                           f'holds an int32)')
    cpus = os.cpu_count() or 1
    num_proc = cpus if num_proc is None else num_proc
    if not 1 <= num_proc <= cpus:  # more only wait for a CPU; thousands never start
        raise PrepareError(f'num_proc={num_proc} must be from 1 to the {cpus} CPUs of this '
                           f'machine (tokenizer processes)')
    if tokenizer is None:
        tokenizer = 'gpt2' if name == 'shakespeare' else 'char'
    # before reading anything, so a bad --tokenizer fails fast
    tok, bpe_vocab_size = given_tokenizer(tokenizer)

    # build the dataset in a temp folder beside the target and swap it in at the end,
    # so a failed run never leaves a half-written dataset or destroys the previous one
    out_dir = os.path.join(data_dir, name)
    replaced(out_dir, input_path)
    # the first folder of data_dir's path that is missing: a refused run removes what it made
    made, folder = None, os.path.abspath(data_dir)
    while not os.path.lexists(folder):
        made, folder = folder, os.path.dirname(folder)
    try:
        os.makedirs(data_dir, exist_ok=True)
        work_dir, lock = claim_work_dir(data_dir, name)
        # the dataset replaced, until the end (a dot: no dataset's name)
        old_dir = os.path.join(work_dir, '.old')
    except OSError as e:  # a file in the way, or no permission
        raise PrepareError(f'data_dir {data_dir} cannot be made or written ({e.strerror}): pass '
                           f'--data_dir PATH of a folder that can be written') from None
    try:
        source, text_path, reader = source_items(name, input_path, text_key or 'text', work_dir)
        if text_key and not any(map(is_records_file, reader.files if reader else [])):
            raise PrepareError(f'--text_key names a field of .jsonl and .parquet records, and '
                               f'{source} holds none: drop --text_key')
        documents = text_path is None
        new_dir = os.path.join(work_dir, name)
        os.mkdir(new_dir)
        if tokenizer == 'char':
            tok = train_chars(text_path, reader, num_proc, seed)
        elif bpe_vocab_size:
            tok = train_bpe(bpe_vocab_size, text_path, reader, num_proc, seed, new_dir, name)
        elif tokenizer.endswith('.tiktoken'):
            tok = copy_ranks(tokenizer, new_dir, name)
        dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32

        writers = {split: ShardWriter(new_dir, name, split, dtype, shard_size) for split in SPLITS}
        counts = {split: {'tokens': 0, 'documents': 0, 'bytes': 0, 'unknown_chars': 0}
                  for split in SPLITS}
        splitter, source_hash, has_any_text = DocumentSplitter(seed), hashlib.sha256(), False

        # ids in the shards' dtype: half the bytes to send back and hold, for uint16
        def encode(text, digest):
            return tok.ids(text, dtype, end_of_document=documents)
        for split, has_text, text_bytes, tokens in run_pass('tokenizing', text_path, reader,
                                                            num_proc, encode, splitter,
                                                            source_hash):
            has_any_text |= has_text
            if split is None:
                continue
            writers[split].append(tokens)
            c = counts[split]
            c['tokens'] += len(tokens)
            c['bytes'] += text_bytes
            # a single text's chunks make one document per split
            if documents or c['documents'] == 0:
                c['documents'] += 1
            if tokenizer == 'char':
                c['unknown_chars'] += int(np.count_nonzero(tokens == 0))
        for writer in writers.values():
            writer.close()

        if not has_any_text:
            raise PrepareError(f'input {source} is empty or only whitespace: point --input at some '
                               f'text')
        if documents and len(splitter.seen) < 3:
            raise PrepareError(f'only {len(splitter.seen)} distinct documents: need at least 3 '
                               f'(one per split); add files, or pass a single file to split it by '
                               f'position')
        splits = splits_meta(counts, writers, text_path, tokenizer == 'char')
        meta = {
            'name': name, 'tokenizer': tok.entry, 'vocab_size': tok.vocab_size,
            'dtype': np.dtype(dtype).name, 'splits': splits,
            'val_bytes_per_token': round(splits['val']['bytes'] / splits['val']['tokens'], 4),
            'source': source, 'source_sha256': source_hash.hexdigest(),
            'split_rule': split_rule(documents, seed), 'seed': seed,
            'duplicates_dropped': splitter.items - len(splitter.seen), 'shard_size': shard_size,
        }
        with open(os.path.join(new_dir, 'meta.json'), 'w', encoding='utf-8') as f:
            json.dump(meta, f, indent=2, ensure_ascii=False)
        if os.path.exists(out_dir):
            os.replace(out_dir, old_dir)
        os.replace(new_dir, out_dir)
    except BaseException:  # Ctrl-C and SIGTERM too (main): the previous dataset or none, whole
        if os.path.exists(old_dir) and not os.path.lexists(out_dir):  # stopped between the two
            os.replace(old_dir, out_dir)
        shutil.rmtree(work_dir, ignore_errors=True)
        if made:
            shutil.rmtree(made, ignore_errors=True)
        raise
    finally:
        lock.close()
    shutil.rmtree(work_dir, ignore_errors=True)
    return out_dir


def claim_work_dir(data_dir, name):
    """(a new temp folder in data_dir to build dataset name in, the open file of its lock, held
    until it is closed). A POSIX lock: the tokenizer processes forked from this one do not hold it,
    and it ends with the process, however it ends. So the folders of killed runs (SIGKILL: their
    partial shards, gigabytes at scale) are those whose lock is free: they go first, and a dataset
    one had moved aside, between the two renames, is put back."""
    prefix = f'.{name}.'  # then mkdtemp's suffix, without a dot: '.x.' + 'y.SUFFIX' is x.y's
    stale_dirs = [os.path.join(data_dir, entry) for entry in os.listdir(data_dir)
                  if entry.startswith(prefix) and '.' not in entry[len(prefix):]]
    for stale in stale_dirs:
        try:  # 'r+': a folder whose run has not made its lock yet is not stale
            with open(os.path.join(stale, '.lock'), 'r+') as held:
                fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a prepare.py at work
            continue
        out_dir, old_dir = os.path.join(data_dir, name), os.path.join(stale, '.old')
        if os.path.isdir(old_dir) and not os.path.lexists(out_dir):
            os.replace(old_dir, out_dir)
        shutil.rmtree(stale, ignore_errors=True)
        print(f"removed {stale}, left by a prepare.py that was killed")
    work_dir = tempfile.mkdtemp(prefix=f'.{name}.', dir=data_dir)
    lock = open(os.path.join(work_dir, '.lock'), 'w')
    fcntl.lockf(lock, fcntl.LOCK_EX)
    return work_dir, lock


def stopped(signum, frame):
    raise KeyboardInterrupt(signum)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description='Tokenize a text dataset into train/val/test shards.')
    parser.add_argument('name',
                        help=f'dataset name: {", ".join(KNOWN_DATASETS)}, or any name with --input')
    parser.add_argument('--input', dest='input_path',
                        help='a text file (split by position), a folder (split by document), '
                             '.jsonl, .jsonl.gz or .parquet')
    parser.add_argument('--tokenizer', help='char, gpt2, PATH.tiktoken, or bpe:VOCAB_SIZE to learn '
                                            'a BPE on the train split (default: gpt2 for '
                                            'shakespeare, else char)')
    parser.add_argument('--data_dir', default=DATA_DIR,
                        help='where the dataset folder is written (default: %(default)s)')
    parser.add_argument('--seed', type=int, default=1337,
                        help='seed of the split of documents (default: %(default)s)')
    parser.add_argument('--text_key', help='the field that holds the text in .jsonl and .parquet '
                                           'records (default: text)')
    parser.add_argument('--num_proc', type=int, default=os.cpu_count(),
                        help='tokenizer processes (default: the %(default)s CPUs)')
    parser.add_argument('--shard_size', type=int, default=100_000_000,
                        help='tokens per shard file (default: %(default)s)')
    parser.error = lambda message: fail(f"{message} (python prepare.py --help lists the arguments)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, stopped)  # as Ctrl-C: prepare removes its temp folder
    try:
        out_dir = prepare(args.name, args.data_dir, args.input_path, args.tokenizer, args.seed,
                          args.text_key, args.num_proc, args.shard_size)
    except (PrepareError, tokenizer.TokenizerError) as e:
        fail(e)
    except OSError as e:  # a full disk, a file that cannot be read
        where = f" ({e.filename})" if e.filename else ''
        fail(f"prepare.py stopped: {e.strerror or e}{where}; the old dataset is kept: free space, "
             f"fix the file's permissions, or pass --data_dir PATH on another disk")
    except KeyboardInterrupt as e:
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"prepare.py: stopped by {signal.Signals(signum).name}: a dataset is replaced whole "
              f"or not at all", file=sys.stderr)
        sys.exit(128 + signum)
    with open(os.path.join(out_dir, 'meta.json'), encoding='utf-8') as f:
        meta = json.load(f)
    trained = meta['tokenizer'].get('trained')
    kind = (f"BPE learned on {trained['bytes']:,} bytes of train" if trained
            else meta['tokenizer']['kind'])
    if trained and meta['vocab_size'] < trained['vocab_size_asked']:  # rustbpe stops, no error
        kind += (f"; {meta['vocab_size']:,} ids of the {trained['vocab_size_asked']:,} asked: the "
                 f"text has no more merges")
    print(f"wrote {out_dir}: vocab_size {meta['vocab_size']} ({kind}), {meta['dtype']}, "
          f"{meta['val_bytes_per_token']} bytes/token on val, {meta['duplicates_dropped']} "
          f"duplicate documents dropped")
    for split, s in meta['splits'].items():
        unknown = f", {s['unknown_chars']:,} unknown chars" if 'unknown_chars' in s else ''
        print(f"  {split:5s} {s['tokens']:>12,} tokens {s['documents']:>6,} documents in "
              f"{len(s['shards'])} shard(s){unknown}")
    if any(s.get('unknown_chars') for s in meta['splits'].values()):
        print("  unknown chars: characters that train never holds; the vocabulary is train's "
              "alone, so they are the unknown id 0 (its loss counts, as any token's)")


if __name__ == '__main__':
    main()
