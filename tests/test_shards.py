"""Shards in llm.c's format: written and read back, llm.c's own layout read, bad headers refused in
one line, and training on many shards: exact resume across shard boundaries, DDP as one process, a
resume after shards changed refused."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

import data
import datafiles
import forked
import prepare
import tokenizer
from conftest import (epoch_batches, gpt2_shards, llmc_shard, make_corpus, ok, read_metrics,
                      run_train, run_trains, torchrun)


def all_windows_match(ds, tokens, block_size):
    return all(torch.equal(ds[s][0], torch.from_numpy(tokens[s:s + block_size].astype(np.int64)))
               and torch.equal(ds[s][1],
                               torch.from_numpy(tokens[s + 1:s + block_size + 1].astype(np.int64)))
               for s in range(len(tokens) - block_size))


@pytest.mark.parametrize('dtype', [np.uint16, np.uint32])
def test_shard_writer_round_trip(tmp_path, dtype):
    tokens = (np.arange(30) * 40_009 % (2**16 if dtype == np.uint16 else 2**17)).astype(np.uint32)
    writer = prepare.ShardWriter(tmp_path, 'x', 'train', dtype, shard_size=7)
    for piece in np.split(tokens, [3, 3, 20]):  # appends of any size, an empty one too
        writer.append(piece)
    writer.close()
    assert writer.files == [f'x_train_{i:06d}.bin' for i in range(5)]
    headers = [np.fromfile(tmp_path / f, dtype=np.int32, count=3).tolist() for f in writer.files]
    magic, version = (20240520, 1) if dtype == np.uint16 else (20240801, 7)
    assert headers == [[magic, version, n] for n in (7, 7, 7, 7, 2)]
    ds = data.TokenWindows([tmp_path / f for f in writer.files], block_size=4)
    assert ds.dtype == dtype and ds.num_tokens == 30
    # windows inside a shard and across one or two boundaries
    assert all_windows_match(ds, tokens, 4)


@pytest.mark.skipif(not os.path.isdir('/proc/self/fd'), reason='counts open files in /proc')
def test_reading_many_shards_keeps_no_file_open(tmp_path):
    # a file (or memmap) kept per shard read would hold 50 descriptors here; FineWeb100B's 1,030
    # shards would exceed the usual limit of 1024
    tokens = np.arange(1000) * 7 % 50257
    paths = [tmp_path / f'd_train_{i:06d}.bin' for i in range(50)]
    for i, path in enumerate(paths):
        llmc_shard(path, tokens[20 * i:20 * i + 20])
    ds = data.TokenWindows(paths, block_size=8)
    open_files = len(os.listdir('/proc/self/fd'))
    assert all_windows_match(ds, tokens, 8)
    assert len(os.listdir('/proc/self/fd')) == open_files


def test_llmc_shards_with_a_written_meta_are_a_dataset(tmp_path):
    folder = tmp_path / 'fineweb10B'
    folder.mkdir()
    rng = np.random.default_rng(0)
    streams = {'val': rng.integers(0, 50257, 300), 'train': rng.integers(0, 50257, 1000)}
    llmc_shard(folder / 'fineweb_val_000000.bin', streams['val'])
    # out of order on purpose
    llmc_shard(folder / 'fineweb_train_000002.bin', streams['train'][600:])
    llmc_shard(folder / 'fineweb_train_000001.bin', streams['train'][:600])
    (folder / 'meta.json').write_text(json.dumps({'vocab_size': 50257, 'tokenizer': 'gpt2'}))
    for dataset in ('fineweb10B', 'fineweb10B/fineweb_*.bin'):
        meta, shards = datafiles.open_dataset(str(tmp_path), dataset)
        assert meta == {'vocab_size': 50257, 'tokenizer': {'kind': 'tiktoken', 'encoding': 'gpt2'},
                        'name': 'fineweb10B'}
        assert {s: [os.path.basename(p) for p in paths] for s, paths in shards.items()} == {
            'val': ['fineweb_val_000000.bin'],
            'train': ['fineweb_train_000001.bin', 'fineweb_train_000002.bin']}
        for split, tokens in streams.items():
            assert all_windows_match(data.TokenWindows(shards[split], 64), tokens, 64)
    with pytest.raises(data.DataError,
                       match=r'has no val shards .*: widen the glob, or add them$'):
        datafiles.open_dataset(str(tmp_path), 'fineweb10B/fineweb_train_*.bin')
    # a key of its own in a written meta.json is no prepare.py record (a KeyError at start)
    (folder / 'meta.json').write_text(json.dumps({'vocab_size': 50257, 'tokenizer': 'gpt2',
                                                  'splits': {'train': {'tokens': 1000}}}))
    assert data.open_splits(str(tmp_path), 'fineweb10B', 64)[2]['documents'] == {}
    # llm.c's one-shard datasets, named without an index, were refused; a glob of every file met
    # meta.json and fingerprints.json, and was refused
    folder = tmp_path / 'tinyshakespeare'
    folder.mkdir()
    llmc_shard(folder / 'tiny_shakespeare_val.bin', streams['val'])
    llmc_shard(folder / 'tiny_shakespeare_train.bin', streams['train'])
    (folder / 'meta.json').write_text(json.dumps({'vocab_size': 50257, 'tokenizer': 'gpt2'}))
    (folder / datafiles.FINGERPRINTS).write_text('{}')
    for dataset in ('tinyshakespeare', 'tinyshakespeare/*'):
        _, shards = datafiles.open_dataset(str(tmp_path), dataset)
        assert {s: [os.path.basename(p) for p in paths] for s, paths in shards.items()} == {
            'val': ['tiny_shakespeare_val.bin'], 'train': ['tiny_shakespeare_train.bin']}


def test_a_token_id_past_meta_json_s_vocab_size_is_refused_when_the_data_opens(tmp_path,
                                                                              monkeypatch):
    """A hand-written meta.json with too small a vocab_size would fail in the model's embedding (on
    a GPU, a device-side assert); the largest id of each shard is kept with its hash, and
    open_splits names it."""
    folder = tmp_path / 'hand'
    folder.mkdir()
    llmc_shard(folder / 'd_val_000000.bin', list(range(40)))
    llmc_shard(folder / 'd_train_000000.bin', list(range(60)) * 2)
    (folder / 'meta.json').write_text('{"vocab_size": 50, "tokenizer": "gpt2"}')
    too_small = "d_train_000000.bin holds token id 59 but the dataset's meta.json has vocab_size 50"
    with pytest.raises(data.DataError, match=too_small):
        data.open_splits(str(tmp_path), 'hand', 8)
    # the id, from the cache
    (folder / 'meta.json').write_text('{"vocab_size": 60, "tokenizer": "gpt2"}')
    digests, hash_file = [], hashlib.file_digest
    def file_digest(f, algorithm):
        digests.append(os.path.basename(f.name))
        return hash_file(f, algorithm)
    monkeypatch.setattr(datafiles.hashlib, 'file_digest', file_digest)
    assert data.open_splits(str(tmp_path), 'hand', 8)[1]['train'].largest_ids == [59]
    assert digests == []
    # a shard format of another name (a fork's) reads each file anew: the cached id was another
    # format's reading
    monkeypatch.setattr(datafiles, 'SHARD', type('OtherShard', (prepare.LlmcShard,), {}))
    data.open_splits(str(tmp_path), 'hand', 8)
    assert sorted(digests) == ['d_train_000000.bin', 'd_val_000000.bin']


def test_a_dataset_folder_that_cannot_be_written_has_its_shards_read_once(tmp_path, monkeypatch):
    """A cluster's read-only dataset: its fingerprints are kept in the machine's cache. Each start
    read every shard whole twice (the first process of a node, then every process), FineWeb's
    20 GB among them."""
    folder = tmp_path / 'ro'
    folder.mkdir()
    llmc_shard(folder / 'd_val_000000.bin', list(range(40)))
    llmc_shard(folder / 'd_train_000000.bin', list(range(60)) * 2)
    (folder / 'meta.json').write_text('{"vocab_size": 60, "tokenizer": "gpt2"}')
    (folder / datafiles.FINGERPRINTS).mkdir()  # cannot be written, even by root
    monkeypatch.setenv('HONESTGPT_CACHE', str(tmp_path / 'cache'))
    digests, hash_file = [], hashlib.file_digest
    def file_digest(f, algorithm):
        digests.append(os.path.basename(f.name))
        return hash_file(f, algorithm)
    monkeypatch.setattr(datafiles.hashlib, 'file_digest', file_digest)
    first = data.open_splits(str(tmp_path), 'ro', 8)[2]
    assert sorted(digests) == ['d_train_000000.bin', 'd_val_000000.bin']
    assert len(os.listdir(tmp_path / 'cache' / 'fingerprints')) == 1
    assert data.open_splits(str(tmp_path), 'ro', 8)[2] == first and len(digests) == 2
    # a shard written anew is read again
    llmc_shard(folder / 'd_val_000000.bin', list(range(41)))
    data.open_splits(str(tmp_path), 'ro', 8)
    assert digests[2:] == ['d_val_000000.bin']


def test_dataset_mistakes_are_one_line(tmp_path):
    def error(dataset):
        with pytest.raises(data.DataError) as e:
            meta, shards = datafiles.open_dataset(str(tmp_path), dataset)
            [data.TokenWindows(paths, 8) for paths in shards.values()]
        assert '\n' not in str(e.value)
        return str(e.value)
    good = list(range(100))
    cases = {'magic': (dict(magic=20240521), 'magic 20240521, expected 20240520 or 20240801'),
             'version': (dict(version=2), 'shard version 2, this code reads version 1'),
             'uint32': (dict(magic=20240801, version=7, dtype=np.uint16), 'truncated')}
    for name, (kwargs, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / 'meta.json').write_text('{"vocab_size": 100, "tokenizer": "gpt2"}')
        llmc_shard(tmp_path / name / 'd_val_000000.bin', good)
        llmc_shard(tmp_path / name / 'd_train_000000.bin', good, **kwargs)
        assert message in error(name) and 'd_train_000000.bin' in error(name)
    path = tmp_path / 'magic' / 'd_train_000000.bin'
    llmc_shard(path, good)
    with open(path, 'r+b') as f:
        f.truncate(1024 + 150)
    assert ('is 1174 bytes but its header says 100 uint16 tokens (1224 bytes): truncated?'
            in error('magic'))
    with open(path, 'r+b') as f:
        f.truncate(1000)
    assert 'shorter than a shard' in error('magic')
    os.remove(path)
    # its meta.json is hand-written: prepare.py would refuse to replace the folder
    assert error('magic').endswith("has no train shards (files like NAME_train_000000.bin in "
                                   f"{tmp_path / 'magic'}): download them, or add them")
    meta = json.loads((tmp_path / 'magic' / 'meta.json').read_text())
    (tmp_path / 'magic' / 'meta.json').write_text(json.dumps(meta | {'source_sha256': '0' * 64}))
    assert ("has no train shards (files like NAME_train_000000.bin in "
            f"{tmp_path / 'magic'}): run python prepare.py magic --data_dir {tmp_path} again (with "
            "the --input it had, if any), or download them") in error('magic')
    (tmp_path / 'magic' / 'notes.bin').write_bytes(b'')
    assert 'notes.bin is not named like NAME_SPLIT_000000.bin' in error('magic')
    (tmp_path / 'old').mkdir()
    (tmp_path / 'old' / 'meta.json').write_text('{"vocab_size": 100, "tokenizer": "gpt2", '
                                                '"name": "old"}')
    np.zeros(10, np.uint16).tofile(tmp_path / 'old' / 'train.bin')
    assert ('prepared by an older prepare.py (train.bin, no shards): run python prepare.py old '
            f'--data_dir {tmp_path} again' in error('old'))
    # downloaded shards without a meta.json: prepare.py would refuse to replace their folder
    (tmp_path / 'fineweb').mkdir()
    llmc_shard(tmp_path / 'fineweb' / 'f_train_000000.bin', list(range(40)))
    assert error('fineweb').startswith(f"dataset 'fineweb' has shards but no {tmp_path}/fineweb/"
                                       "meta.json: write it, e.g.")
    # a hand-written meta.json cannot give a char vocabulary: the end-of-run sample would need its
    # characters
    for entry in ('"char"', '{"kind": "char"}'):
        (tmp_path / 'old' / 'meta.json').write_text('{"vocab_size": 100, "tokenizer": %s}' % entry)
        assert 'names a char tokenizer without its characters' in error('old')
    with pytest.raises(tokenizer.TokenizerError,
                       match="the char tokenizer's characters are missing"):
        tokenizer.load({'kind': 'char'})
    # tracebacks, or a typo read as a file name
    for entry in ('5', '{"kind": "tiktoken"}', '"gpt3"', '{"encoding": "gpt2"}',
                  '{"kind": "char", "chars": 5}'):
        (tmp_path / 'old' / 'meta.json').write_text('{"vocab_size": 100, "tokenizer": %s}' % entry)
        assert error('old').endswith(f'meta.json has tokenizer {entry}: write "gpt2" or the path '
                                     f'of a .tiktoken ranks file')
    (tmp_path / 'old' / 'meta.json').write_text('{"vocab_size": 100, "tokenizer": "gpt2",}')
    assert ('meta.json is not valid JSON (Expecting property name' in error('old')
            and ': fix it' in error('old'))
    (tmp_path / 'nometa').mkdir()
    assert 'has no' in error('nometa') and '"vocab_size": 50257' in error('nometa')
    assert 'no files match' in error('nometa/*.bin')
    for meta, message in (('5', 'lacks vocab_size and tokenizer'),
                          ('{"vocab_size": "223", "tokenizer": "gpt2"}',
                           "has vocab_size '223': write"),
                          ('{"vocab_size": 0, "tokenizer": "gpt2"}', 'has vocab_size 0: write')):
        (tmp_path / 'old' / 'meta.json').write_text(meta)
        assert message in error('old')
    with pytest.raises(data.DataError,
                       match="data_dir '.*' cannot hold datasets .*: set data_dir to a"):
        datafiles.prepare_once(str(tmp_path / 'old' / 'meta.json'), 'pystdlib_char')


def test_a_folder_of_the_shards_of_two_datasets_is_refused(tmp_path):
    (tmp_path / 'a.txt').write_text('first corpus\n' * 300)
    (tmp_path / 'b.txt').write_text('another corpus entirely\n' * 300)
    a = prepare.prepare('a', data_dir=str(tmp_path), input_path=str(tmp_path / 'a.txt'))
    b = prepare.prepare('b', data_dir=str(tmp_path), input_path=str(tmp_path / 'b.txt'))
    # another dataset's shard, whose ids mean other characters, was read as part of this one
    shutil.copy(os.path.join(b, 'b_train_000000.bin'), a)
    with pytest.raises(data.DataError, match=rf"^{a} holds the shards of 2 datasets \(a, b\): "
                                             "move those of the others away$"):
        data.open_splits(str(tmp_path), 'a', 8)
    # a glob takes the files it names
    assert set(data.open_splits(str(tmp_path), 'a/a_*.bin', 8)[1]) == {'train', 'val', 'test'}


def test_a_split_of_one_token_is_named(tmp_path):
    (tmp_path / 'd').mkdir()
    (tmp_path / 'd' / 'meta.json').write_text('{"vocab_size": 100, "tokenizer": "gpt2"}')
    llmc_shard(tmp_path / 'd' / 'd_train_000000.bin', list(range(100)))
    llmc_shard(tmp_path / 'd' / 'd_val_000000.bin', [7])
    with pytest.raises(data.DataError, match="^dataset 'd' has a val split of 1 token"):
        data.open_splits(str(tmp_path), 'd', 8)


def test_a_prepared_default_dataset_takes_no_lock(tmp_path):
    # a shared, read-only data_dir serves it: the lock file was opened for writing first
    folder = tmp_path / 'pystdlib_char'
    folder.mkdir()
    (folder / 'pystdlib_char_train_000000.bin').write_bytes(b'')
    datafiles.prepare_once(str(tmp_path), 'pystdlib_char')
    assert os.listdir(tmp_path) == ['pystdlib_char']


def test_data_change_names_the_shards():
    ident = {'name': 'd', 'source_sha256': 'abc', 'vocab_size': 9, 'tokenizer': {'kind': 'char'},
             'shards': [['d_train_000000.bin', 10, 'f0'], ['d_val_000000.bin', 5, 'f1']]}
    assert datafiles.data_change(ident, ident, {}) == ''
    grown = {**ident,
             'shards': [['d_train_000000.bin', 10, 'f0'], ['d_train_000001.bin', 3, 'f2'],
                        ['d_val_000000.bin', 5, 'f9']]}
    other = 'was trained on other data '
    assert (datafiles.data_change(ident, grown, {})
            == other + '(shards added d_train_000001.bin; changed d_val_000000.bin)')
    assert (datafiles.data_change(grown, ident, {})
            == other + '(shards removed d_train_000001.bin; changed d_val_000000.bin)')
    assert (datafiles.data_change(ident, {**ident, 'vocab_size': 10}, {})
            == other + '(its vocab_size differ)')
    # a ranks file compares by its content, not its path: a dataset moved or prepared again
    bpe = {**ident, 'tokenizer': {'kind': 'tiktoken', 'encoding': '/a/d.tiktoken',
                                  'ranks_sha256': 'e3b0'}}
    moved = {**bpe, 'tokenizer': {**bpe['tokenizer'], 'encoding': '/b/d.tiktoken'}}
    assert datafiles.data_change(bpe, moved, {}) == ''
    assert datafiles.data_change(bpe, {**moved, 'tokenizer': {**moved['tokenizer'],
                                                              'ranks_sha256': 'ffff'}}, {}) == (
        other + '(its tokenizer differ)')
    # a checkpoint of a dataset prepared before shards (the first of format 3): another split rule
    before_shards = {k: v for k, v in ident.items() if k != 'shards'}
    assert 'prepared before shards' in datafiles.data_change(before_shards, ident, {})


def test_data_change_checks_the_head_fingerprint_older_checkpoints_recorded(tmp_path):
    # format 3 (and format 4 at first) recorded the sha256 of a shard's first 4096 bytes, 16 digits
    path = tmp_path / 'd_train_000000.bin'

    def dataset(tokens):  # (identity, splits) of a one-shard dataset
        llmc_shard(path, tokens)
        splits = {'train': data.TokenWindows([path], 4)}
        return {'name': 'd', 'shards': splits['train'].shards}, splits
    tokens = np.arange(3000) % 50  # a header of 256 int32, then 2 bytes a token: 1536 in 4096 bytes
    current, splits = dataset(tokens)
    head = hashlib.sha256(path.read_bytes()[:4096]).hexdigest()[:16]
    recorded = {'name': 'd', 'shards': [['d_train_000000.bin', 3000, head]]}
    assert datafiles.data_change(recorded, current, splits) == ''
    tokens[2000] = 7  # past the first 4096 bytes: unseen, as by the code that took the fingerprint
    assert datafiles.data_change(recorded, *dataset(tokens)) == ''
    tokens[1000] = 7  # within them
    assert (datafiles.data_change(recorded, *dataset(tokens))
            == 'was trained on other data (shards changed d_train_000000.bin)')


# -----------------------------------------------------------------------------
# training on shards: subprocess runs, left out of the 'not slow' tier

@pytest.fixture(scope='module')
def sharded_dir(tmp_path_factory):
    """The toy corpus in shards of 5,000 tokens (train: 9 of them) and no test split, as
    FineWeb's."""
    root = tmp_path_factory.mktemp('sharded')
    out_dir = prepare.prepare('toy', data_dir=str(root), input_path=make_corpus(str(root / 'src')),
                              shard_size=5000)
    for name in os.listdir(out_dir):
        if '_test_' in name:
            os.remove(os.path.join(out_dir, name))
    return str(root)


@pytest.mark.slow
def test_resume_across_shard_boundaries_is_bitwise_and_refused_after_shards_changed(tmp_path,
                                                                                    sharded_dir):
    from test_resume import HARD, trajectory
    meta, shards = datafiles.open_dataset(sharded_dir, 'toy')
    train = data.TokenWindows(shards['train'], 32)
    assert len(shards['train']) >= 8 and 'test' not in shards
    # the resumed part, steps 15-30 of 2 micro-batches each, reads a window across two shards
    resumed = [s for b in epoch_batches(data.TrainSampler(train.num_tokens, 32, 8, 16, 1337),
                                        0)[28:60]
               for s in b]
    assert any(np.searchsorted(train.offsets, s, 'right')
               != np.searchsorted(train.offsets, s + 32, 'right')
               for s in resumed)
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    args = [*HARD, '--dtype=float32', '--test_eval=True']
    run_trains(sharded_dir, (straight, args), (split, [*args, '--max_iters=14']))
    result = run_train(split, sharded_dir, *args, '--init_from=resume')
    assert "dataset 'toy' has no test split: the test evaluation is skipped" in result.stdout
    assert trajectory(split) == trajectory(straight)
    a = torch.load(os.path.join(straight, 'last.pt'), weights_only=True)['model']
    b = torch.load(os.path.join(split, 'last.pt'), weights_only=True)['model']
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the same bytes copied with new modification times: hashed again, and the resume goes on
    copied = tmp_path / 'copied' / 'toy'
    copied.mkdir(parents=True)
    for name in os.listdir(os.path.join(sharded_dir, 'toy')):
        shutil.copyfile(os.path.join(sharded_dir, 'toy', name), copied / name)
    run_train(split, str(tmp_path / 'copied'), *args, '--init_from=resume', '--max_iters=31')
    # a shard added, then one token changed at the end of a shard, its size kept: each refused in
    # one line
    changed_data = str(tmp_path / 'changed')
    shutil.copytree(sharded_dir, changed_data)
    val = os.path.join(changed_data, 'toy', 'toy_val_000000.bin')
    added = os.path.join(changed_data, 'toy', 'toy_train_000099.bin')
    llmc_shard(added, [1] * 100)
    assert_refused(split, changed_data, args, 'added toy_train_000099.bin')
    os.remove(added)
    with open(val, 'r+b') as f:
        f.seek(-2, os.SEEK_END)
        last = int.from_bytes(f.read(2), 'little')
        f.seek(-2, os.SEEK_END)
        f.write(((last + 1) % meta['vocab_size']).to_bytes(2, 'little'))
    assert_refused(split, changed_data, args, 'changed toy_val_000000.bin')


@pytest.mark.slow
def test_default_dataset_of_the_older_layout_is_prepared_again(tmp_path):
    old = tmp_path / 'data' / 'pystdlib_char'
    old.mkdir(parents=True)
    (old / 'meta.json').write_text('{"vocab_size": 100, "tokenizer": {"kind": "char", "chars": '
                                   '["a"]}}')
    np.zeros(10, np.uint16).tofile(old / 'train.bin')
    result = run_train(str(tmp_path / 'out'), str(tmp_path / 'data'), '--dataset=pystdlib_char',
                       '--max_iters=1', '--eval_interval=1', '--eval_iters=1')
    assert 'preparing the default dataset pystdlib_char' in result.stdout
    assert (os.path.exists(old / 'pystdlib_char_train_000000.bin')
            and not os.path.exists(old / 'train.bin'))


def assert_refused(out_dir, data_dir, args, change):
    result = run_train(out_dir, data_dir, *args, '--init_from=resume', '--max_iters=40',
                       check=False)
    assert result.returncode == 2 and result.stderr.count('\n') == 1
    assert f'was trained on other data (shards {change})' in result.stderr


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_shards(tmp_path, sharded_dir):
    from test_ddp import SAME, assert_same_run
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    run_train(one, sharded_dir, *SAME)
    ok(torchrun(two, sharded_dir, *SAME))
    assert_same_run(one, two)


@pytest.mark.slow
def test_bench_loader_mode_reads_windows(tmp_path, sharded_dir):
    run = str(tmp_path / 'run')
    run_train(run, sharded_dir, '--max_iters=1', '--eval_interval=1', '--batch_size=4')
    out = tmp_path / 'loader.json'
    result = forked.run('bench.py', f'--loader={run}', '--bench_iters=50', f'--json={out}',
                        timeout=120)
    assert result.returncode == 0, result.stderr
    # the run's own loader: its batch size and shards
    report = json.loads(out.read_text())['loader']
    assert report['batches'] == 50 and report['windows_per_sec'] > 0 and report['batch_size'] == 4
    assert report['train_shards'] == len(datafiles.open_dataset(sharded_dir, 'toy')[1]['train']) > 1
    assert 'windows/s' in result.stdout


@pytest.mark.slow
def test_gpt2_vocabulary_shards_train_offline_without_the_tokenizer(tmp_path):
    """FineWeb's shards name GPT-2's tokenizer, which tiktoken downloads once; an offline GPU node
    without its cache still trains. Only the end-of-run sample needs it (skipped in one line, also
    by every rank of an FSDP run, where sampling is a collective); eval_tasks, which must encode
    text, is refused before anything is written."""
    data = str(tmp_path / 'data')
    gpt2_shards(os.path.join(data, 'fineweb'), 20_000, 2_000)
    (tmp_path / 'task.jsonl').write_text('{"context": "a", "choices": ["b", "c"], "answer": 0}\n')
    proxy = 'http://127.0.0.1:9'  # nothing answers there: offline
    offline = {'TIKTOKEN_CACHE_DIR': str(tmp_path / 'empty_cache'), 'HTTPS_PROXY': proxy,
               'HTTP_PROXY': proxy, 'https_proxy': proxy, 'http_proxy': proxy}
    args = ['--dataset=fineweb', '--max_iters=2', '--eval_interval=2', '--eval_iters=1',
            '--sample_tokens=8', '--gradient_accumulation_steps=2']
    runs = {'one': run_train(str(tmp_path / 'one'), data, *args, env={**os.environ, **offline}),
            'fsdp': ok(torchrun(str(tmp_path / 'fsdp'), data, *args, '--parallel=fsdp',
                                env_extra=offline))}
    for name, result in runs.items():
        assert [r['step'] for r in read_metrics(str(tmp_path / name), 'train')] == [1, 2]
        assert result.stdout.count("no sample: could not load the gpt2 tokenizer") == 1, name
    refused = run_train(str(tmp_path / 'tasks'), data, *args,
                        f"--eval_tasks={tmp_path / 'task.jsonl'}", env={**os.environ, **offline},
                        check=False)
    assert refused.returncode == 2
    assert refused.stderr.startswith('error: could not load the gpt2 tokenizer')
    assert not os.path.exists(tmp_path / 'tasks')
