"""
A dataset's files: its folder (or glob) of shards and meta.json, each shard's header checked against
its size, the shards' fingerprints (sha256 and largest id, cached per folder), and whether a
checkpoint's data is this run's. data.py reads the windows and batches of a dataset found here.
"""
import difflib
import fcntl
import glob
import hashlib
import json
import os
import re
import shlex

import numpy as np

import checkpoint
import perf
import prepare
import tokenizer
from prepare import SHARD

# fineweb_train_000001.bin; llm.c's one-shard datasets: tiny_shakespeare_val.bin
SHARD_NAME = re.compile(r'_(train|val|test)(?:_(\d+))?\.bin$')
# in a shards' folder: each shard's hash and largest token id, and the size and time they were
# taken at
FINGERPRINTS = 'fingerprints.json'


class DataError(Exception):
    pass


def read_shard_header(path):
    """(numpy dtype, number of tokens) of a shard, its header checked against the file's size."""
    size = os.path.getsize(path)
    with open(path, 'rb') as f:
        head = f.read(SHARD.HEADER_BYTES)
    if size < SHARD.HEADER_BYTES:
        raise DataError(f"{path} is {size} bytes, shorter than a shard's {SHARD.HEADER_BYTES}-byte "
                        f"header: prepare or download it again")
    try:
        dtype, num_tokens = SHARD.parse_header(path, head)
    except ValueError as e:  # another format's file, or another version of it
        raise DataError(e) from None
    expected = SHARD.HEADER_BYTES + num_tokens * dtype.itemsize
    if size != expected:
        raise DataError(f"{path} is {size} bytes but its header says {num_tokens} {dtype.name} "
                        f"tokens ({expected} bytes): truncated? prepare or download it again")
    return dtype, num_tokens


def fingerprints(paths):
    """{shard file name: [sha256 of its whole content, its largest token id (-1: none)]}. Both read
    every byte, so each folder keeps them in FINGERPRINTS with the size and modification time of the
    file read and the shard format it was read as, and a shard is read again when one has changed.
    A folder that cannot be written (a cluster's read-only dataset) has them kept in the machine's
    cache instead, by its path: else every start, and every process of it, would read every byte
    again. Any write or copy of a file moves its modification time; an edit that keeps size and
    time both (touch -d) goes unseen."""
    result = {}
    for folder in sorted({os.path.dirname(p) for p in paths}):
        path_id = hashlib.sha256(os.path.realpath(folder).encode()).hexdigest()[:16]
        caches = [os.path.join(folder, FINGERPRINTS),
                  os.path.join(perf.cache_folder(), 'fingerprints', f'{path_id}.json')]
        cached = [perf.read_cache(cache) for cache in caches]
        known, changed = cached[1] | cached[0], False  # the folder's own entries first
        for path in (p for p in paths if os.path.dirname(p) == folder):
            stat, name = os.stat(path), os.path.basename(path)
            read_as = [stat.st_size, stat.st_mtime_ns, SHARD.__name__]
            entries = [c.get(name, []) for c in cached]
            valid = [e for e in entries if e[:3] == read_as and len(e) == 5]
            if valid:  # either cache's: a stale entry in one is no matter
                known[name] = valid[0]
            else:
                with open(path, 'rb') as f:
                    digest = hashlib.file_digest(f, 'sha256').hexdigest()
                dtype, n = read_shard_header(path)
                ids = np.memmap(path, dtype, 'r', SHARD.HEADER_BYTES, (n,)) if n else np.array([-1])
                largest = int(ids.max())
                known[name], changed = read_as + [digest, largest], True
            result[name] = known[name][3:]
        for cache in caches if changed else []:  # the folder's, else (read-only) the machine's
            try:
                os.makedirs(os.path.dirname(cache), exist_ok=True)
                checkpoint.write_json(cache, known)
                break
            except OSError:  # neither can be written: read again next time
                pass
    return result


def prepare_once(data_dir, name):
    """Prepare a built-in dataset (prepare.py, offline) where it is missing. Under torchrun the
    first process of each node calls this, since nodes need not share storage; those that do take
    turns on a lock file and find it prepared by the first. A prepared one takes no lock: a
    read-only data_dir serves it."""
    first_shard = os.path.join(data_dir, name, f'{name}_train_000000.bin')
    if os.path.exists(first_shard):
        return
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock = open(os.path.join(data_dir, f'.{name}.lock'), 'w')
    except OSError as e:  # a file in the way, or a folder that cannot be written
        raise DataError(f"data_dir '{data_dir}' cannot hold datasets ({e.strerror}): set data_dir "
                        f"to a folder that can be written")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(first_shard):
            print(f"preparing the default dataset {name} into {os.path.join(data_dir, name)}",
                  flush=True)
            prepare.prepare(name, data_dir=data_dir)


def prepare_command(name, data_dir, args=''):
    """The prepare.py command line that writes dataset name where a run with data_dir looks."""
    if os.path.normpath(data_dir) != prepare.DATA_DIR:
        args += f' --data_dir {shlex.quote(data_dir)}'
    return f"python prepare.py {name}{args}"


def open_dataset(data_dir, dataset):
    """(meta, {split: [shard paths]}) of a dataset: a folder under data_dir, or a glob of shard
    files under data_dir whose folder holds meta.json. The splits come from the file names; test may
    be missing (FineWeb's shards have none), train and val may not. A hand-written meta.json needs
    only vocab_size and tokenizer (gpt2 or PATH.tiktoken, a relative path inside the folder); a char
    vocabulary comes only from prepare.py. The meta returned names a ranks file by its absolute
    path, checked against the sha256 that prepare.py recorded."""
    path = os.path.join(data_dir, dataset)
    globbed = any(c in dataset for c in '*?[')
    if globbed:
        files = sorted(f for f in glob.glob(path) if f.endswith('.bin'))  # not meta.json
        if not files:
            raise DataError(f"no files match dataset='{dataset}' in {data_dir}: check the pattern")
        folder = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    else:
        folder, files = path, sorted(glob.glob(os.path.join(glob.escape(path), '*.bin')))
    meta_path = os.path.join(folder, 'meta.json')
    shards_named = any(SHARD_NAME.search(os.path.basename(f)) for f in files)
    if shards_named and not os.path.exists(meta_path):  # downloaded: prepare.py would not replace
        raise DataError(f"dataset '{dataset}' has shards but no {meta_path}: write it, e.g. "
                        f"{{\"vocab_size\": 50257, \"tokenizer\": \"gpt2\"}} for GPT-2's ids")
    if not os.path.exists(meta_path):
        prepared = sorted(os.path.basename(os.path.dirname(p))
                          for p in glob.glob(os.path.join(glob.escape(data_dir), '*', 'meta.json')))
        # a prepared one, or one prepare.py makes (train.py prepares pystdlib_char itself); none
        # for a name prepare.py makes: the name is right, its files are missing
        close = [] if dataset in prepare.KNOWN_DATASETS else difflib.get_close_matches(
            dataset, prepared + list(prepare.KNOWN_DATASETS), n=1, cutoff=0.6)
        hint = (f"did you mean '{close[0]}'? " if close else '') + \
            (f"{data_dir} holds {', '.join(prepared)}; " if prepared else '')
        if dataset in prepare.KNOWN_DATASETS:  # prepare.py downloads the text, or finds it here
            offline = '' if dataset == 'pystdlib_char' else '; offline: --input PATH'
            how = f"{prepare_command(dataset, data_dir)} (or set data_dir{offline})"
        else:
            how = (f"{prepare_command(dataset, data_dir, ' --input PATH')} (or set data_dir); for "
                   f"downloaded shards write it, e.g. {{\"vocab_size\": 50257, \"tokenizer\": "
                   f"\"gpt2\"}}")
        raise DataError(f"dataset '{dataset}' has no {meta_path}: {hint}run {how}")
    try:
        with open(meta_path, encoding='utf-8') as f:
            meta = json.load(f)
    except ValueError as e:
        raise DataError(f"{meta_path} is not valid JSON ({e}): fix it") from None
    missing = [k for k in ('vocab_size', 'tokenizer')
               if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise DataError(f"{meta_path} lacks {' and '.join(missing)}: add them, e.g. "
                        f"{{\"vocab_size\": 50257, \"tokenizer\": \"gpt2\"}}")
    if type(meta['vocab_size']) is not int or meta['vocab_size'] < 1:
        raise DataError(f"{meta_path} has vocab_size {meta['vocab_size']!r}: write the tokenizer's "
                        f"vocabulary size as a whole number, e.g. 50257")
    entry = meta['tokenizer']
    if (entry == 'char' or isinstance(entry, dict) and entry.get('kind') == 'char'
            and 'chars' not in entry):
        raise DataError(f"{meta_path} names a char tokenizer without its characters, which only "
                        f"prepare.py writes: prepare the dataset with prepare.py, or name \"gpt2\" "
                        f"or a .tiktoken path")
    if isinstance(entry, str):  # a hand-written meta.json: 'gpt2' or a .tiktoken path
        entry = {'kind': 'tiktoken', 'encoding': entry}
    if not readable_tokenizer(entry):
        raise DataError(f"{meta_path} has tokenizer {json.dumps(meta['tokenizer'])[:60]}: write "
                        f"\"gpt2\" or the path of a .tiktoken ranks file")
    try:  # a ranks file that is missing or changed would give the ids another meaning
        meta['tokenizer'] = tokenizer.resolve(entry, folder)
    except tokenizer.TokenizerError as e:
        raise DataError(str(e)) from None
    meta.setdefault('name', os.path.basename(folder))
    shards = {}
    for f in files:
        match = SHARD_NAME.search(os.path.basename(f))
        if match is None and os.path.basename(f) in ('train.bin', 'val.bin', 'test.bin'):
            raise DataError(f"{folder} was prepared by an older prepare.py (train.bin, no shards): "
                            f"run {prepare_command(meta['name'], data_dir)} again (with the "
                            f"--input it had, if any)")
        if match is None:
            raise DataError(f"{f} is not named like NAME_SPLIT_000000.bin (or NAME_SPLIT.bin) with "
                            f"SPLIT train, val or test: rename it or narrow the dataset's glob")
        shards.setdefault(match.group(1), []).append((int(match.group(2) or 0), f))
    # one dataset's shards: another's copied in would be read with this one's vocabulary
    names = sorted({SHARD_NAME.sub('', os.path.basename(f)) for f in files})
    if len(names) > 1 and not globbed:
        raise DataError(f"{folder} holds the shards of {len(names)} datasets ({few(names)}): move "
                        f"those of the others away")
    for split in ('train', 'val'):
        if split not in shards:
            if globbed:
                fix = "widen the glob, or add them"
            elif 'source_sha256' in meta:  # prepare.py's: it writes the folder again
                fix = (f"run {prepare_command(meta['name'], data_dir)} again (with the --input it "
                       f"had, if any), or download them")
            else:  # a hand-written meta.json: prepare.py replaces no folder it did not write
                fix = "download them, or add them"
            raise DataError(f"dataset '{dataset}' has no {split} shards (files like "
                            f"NAME_{split}_000000.bin in {folder}): {fix}")
    return meta, {split: [f for _, f in sorted(files)] for split, files in shards.items()}


def readable_tokenizer(entry):
    """Whether a meta.json's tokenizer entry (a hand-written one made a dict) is one tokenizer.load
    reads: prepare.py's char vocabulary, GPT-2's, or a .tiktoken ranks file's."""
    if not isinstance(entry, dict):
        return False
    if entry.get('kind') == 'char':
        return isinstance(entry.get('chars'), list)
    encoding = entry.get('encoding')
    return (entry.get('kind') == 'tiktoken' and isinstance(encoding, str)
            and (encoding == 'gpt2' or encoding.endswith('.tiktoken')))


def few(names):
    """The first three of a list of names, for a message."""
    return ', '.join(names[:3]) + (' ...' if len(names) > 3 else '')


def head_fingerprint(path):
    """The fingerprint checkpoints took before shards were hashed whole (format 3, and format 4 at
    first): the sha256 of a shard's first 4096 bytes (header and first tokens), 16 hex digits."""
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read(4096)).hexdigest()[:16]


def identity(key, value):
    """A dataset id's entry as two runs' data compare: a ranks file by its sha256, not its path,
    which a dataset moved or prepared again changes."""
    if key == 'tokenizer' and isinstance(value, dict) and 'ranks_sha256' in value:
        return {k: v for k, v in value.items() if k != 'encoding'}
    return value


def data_change(recorded, current, splits):
    """Why a checkpoint's data (its recorded dataset id) is not this run's ('was trained on other
    data (...)'), or '' when it is the same. splits: this run's TokenWindows by split, whose files
    give a head_fingerprint where the checkpoint recorded one: its data is checked as its code
    did."""
    if 'shards' not in recorded:  # the same source prepared now puts other documents in train
        return ("was trained on a dataset prepared before shards, whose documents were split by an "
                "older rule: no dataset this code prepares is that one")
    differ = [k for k in recorded
              if k != 'shards' and identity(k, recorded[k]) != identity(k, current.get(k))]
    if differ:
        return f"was trained on other data (its {', '.join(differ)} differ)"
    paths = {os.path.basename(p): p for windows in splits.values() for p in windows.paths}
    by_head = {name for name, _, fp in recorded['shards'] if len(fp) == 16}  # not all 64 digits
    before = {name: (tokens, fp) for name, tokens, fp in recorded['shards']}
    now = {name: (tokens, head_fingerprint(paths[name]) if name in by_head else fp)
           for name, tokens, fp in current['shards']}
    changes = [f"{what} {few(names)}"
               for what, names in (('added', sorted(now.keys() - before.keys())),
                                   ('removed', sorted(before.keys() - now.keys())),
                                   ('changed', sorted(n for n in before.keys() & now.keys()
                                                      if before[n] != now[n])))
               if names]
    return f"was trained on other data (shards {'; '.join(changes)})" if changes else ''
