"""Shared fixtures: a small generated corpus, prepared once, and a way to run train.py as users
do."""
import atexit
import base64
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

import forked

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# measurements that train.py caches per machine (peak FLOP/s, the dtype 'auto' picks) go to a folder
# of this session's, inherited by every train.py the tests start: the user's ~/.cache stays
# untouched, and the folder is removed when the session ends
if 'HONESTGPT_CACHE' not in os.environ:
    os.environ['HONESTGPT_CACHE'] = tempfile.mkdtemp(prefix='honestgpt-cache-')
    atexit.register(shutil.rmtree, os.environ['HONESTGPT_CACHE'], ignore_errors=True)
# one thread in every process the tests start: the test models gain nothing from a second, tests run
# some runs side by side, and a run resumed on another thread count sums in another order (bitwise
# comparisons need the same count)
os.environ['OMP_NUM_THREADS'] = '1'
sys.path.insert(0, REPO)
RUN_CONFIG = os.path.join(REPO, 'tests', 'run_config.py')
# the devices an end-to-end test whose meaning carries to a GPU runs on: the CPU, and CUDA where a
# GPU is present; `pytest -m cuda` runs the GPU half alone (tests/gpu_check.sh does)
DEVICES = ['cpu', pytest.param('cuda', marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason='no CUDA GPU here')])]
PROBE = os.path.join(REPO, 'tests', 'probe.py')
# last.pt of older commits, on make_corpus's corpus: python train.py tests/run_config.py OLD_ARGS
# --max_iters=2 --eval_interval=2, with test_recipe.RECIPE for *_recipe (Muon beside AdamW: two
# optimizers; an untied head). Format 3 (77e6651): before the vocabulary was padded; the first
# format 4 (45facc9): a scheduler state per optimizer. Each with what its migration says.
OLD_ARGS = ['--lr_decay_iters=2', '--warmup_iters=1', '--dtype=float32', '--n_layer=1',
            '--n_embd=16', '--n_head=2', '--block_size=8']
FROM_FORMAT3 = ("format 3: vocabulary rows padded 26 -> 64 in the embedding, the head and AdamW's "
                "moments; one LR scheduler state")
OLD_CHECKPOINTS = {name: (os.path.join(REPO, 'tests', 'fixtures', f'{name}_last.pt'), migrated)
                   for name, migrated in [
                       ('format3', FROM_FORMAT3), ('format3_recipe', FROM_FORMAT3),
                       ('format4_first_recipe', "format 4: one LR scheduler state")]}
FORKED_TORCHRUN = os.path.join(REPO, 'tests', 'forked_torchrun.py')


def make_corpus(folder, num_docs=40, seed=0):
    """Documents of structured pseudo-English: learnable, so val loss must fall within a few dozen
    steps."""
    rng = random.Random(seed)
    subjects = ['the cat', 'a dog', 'my friend', 'the king', 'our ship', 'her song']
    verbs = ['sees', 'loves', 'finds', 'keeps', 'sends', 'hears']
    objects = ['the moon.', 'a small bird.', 'the old road.', 'two red apples.', 'the sea.',
               'his letter.']
    os.makedirs(folder, exist_ok=True)
    for d in range(num_docs):
        lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
                 for _ in range(rng.randint(30, 60))]
        with open(os.path.join(folder, f'doc{d:03d}.txt'), 'w') as f:
            f.write('\n'.join(lines) + '\n')
    return folder


def llmc_shard(path, tokens, magic=20240520, version=1, dtype=np.uint16):
    """A shard as llm.c's dev/data/data_common.py write_datafile writes it: 256 int32 (magic,
    version, token count, zeros), then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(tokens)
    with open(path, 'wb') as f:
        f.write(header.tobytes())
        f.write(np.array(tokens, dtype=dtype).tobytes())


def gpt2_shards(folder, train_tokens, val_tokens=10_000):
    """A dataset folder of seeded random GPT-2 ids, as FineWeb's shards and meta.json would hold:
    GPT-2's vocabulary and tokenizer name, without its files."""
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    name = os.path.basename(folder)
    llmc_shard(os.path.join(folder, f'{name}_val_000000.bin'), rng.integers(0, 50257, val_tokens))
    train = rng.integers(0, 50257, train_tokens)
    llmc_shard(os.path.join(folder, f'{name}_train_000000.bin'), train)
    with open(os.path.join(folder, 'meta.json'), 'w') as f:
        f.write('{"vocab_size": 50257, "tokenizer": "gpt2"}')


def write_ranks(path, merges):
    """A tiny GPT-2-style BPE as a local .tiktoken ranks file: the 256 bytes, then the merges in
    order."""
    lines = [f'{base64.b64encode(bytes([i])).decode()} {i}' for i in range(256)]
    lines += [f'{base64.b64encode(m).decode()} {256 + k}' for k, m in enumerate(merges)]
    path.write_text('\n'.join(lines) + '\n')


@pytest.fixture(scope='session', autouse=True)
def stop_forked_runs():
    """Runs a failed test left going end with the session, which would otherwise wait for them."""
    yield
    forked.stop_all()


@pytest.fixture(autouse=True)
def fresh_interpreters(request, monkeypatch):
    """A test marked fresh starts each run as a fresh interpreter (tests/forked.py says what forking
    cannot show)."""
    if request.node.get_closest_marker('fresh'):
        monkeypatch.setattr(forked, 'FRESH', True)


@pytest.fixture(autouse=True)
def import_time_env_undone():
    """Import-time variables a library sets while a test imports it (scikit-learn sets KMP_ ones)
    are undone after the test, so that later tests' runs still fork (tests/forked.py)."""
    before = forked.import_time_env(os.environ)
    yield
    for key in forked.import_time_env(os.environ).keys() - before.keys():
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    import prepare
    root = tmp_path_factory.mktemp('data')
    prepare.prepare('toy', data_dir=str(root), input_path=make_corpus(str(root / 'toy_src')))
    return str(root)


@pytest.fixture(scope='module')
def root(tmp_path_factory, request):
    """A folder for what a test module shares, with tiktoken's cache of local files (.tiktoken BPEs
    made by the tests) kept inside it, also for the processes the tests start."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp(request.module.__name__)
        mp.setenv('TIKTOKEN_CACHE_DIR', str(path / 'tiktoken_cache'))
        yield path


def run_train(out_dir, data_dir, *overrides, check=True, env=None, timeout=300, probe=False):
    """python train.py tests/run_config.py --data_dir=... --out_dir=... OVERRIDES, from the repo
    root (forked.py says how); under tests/probe.py if probe."""
    script = [PROBE, 'train.py'] if probe else ['train.py']
    result = forked.run(*script, RUN_CONFIG, f'--data_dir={data_dir}', f'--out_dir={out_dir}',
                        *overrides, env=env, timeout=timeout)
    return ok(result) if check else result


def run_trains(data_dir, *runs):
    """Several independent train.py runs side by side, each (out_dir, [overrides]): on two cores two
    one-thread runs take the time of one."""
    procs = [forked.Process('train.py', RUN_CONFIG, f'--data_dir={data_dir}',
                            f'--out_dir={out_dir}', *overrides)
             for out_dir, overrides in runs]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout + stderr


def epoch_batches(sampler, epoch):
    """A TrainSampler's batches of an epoch, as lists of window starts."""
    return sampler.epoch_starts(epoch).view(-1, sampler.batch_size).tolist()


def read_metrics(out_dir, kind=None):
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if kind is None or r['kind'] == kind]


def torchrun(out_dir, data_dir, *overrides, probe=False, **kwargs):
    """train.py (under tests/probe.py if probe) under torchrun, as users run it."""
    script = [PROBE, 'train.py'] if probe else ['train.py']
    return torchrun_script(*script, RUN_CONFIG, f'--data_dir={data_dir}', f'--out_dir={out_dir}',
                           *overrides, **kwargs)


def torchrun_started(*args, nproc=2, env_extra=None, torchrun_args=()):
    """torchrun SCRIPT ARGS (args) on nproc processes, CPU and gloo unless ARGS say --device=cuda,
    started (a forked.Process in a session of its own: a signal to it is a cluster's)."""
    env = {**os.environ, **(env_extra or {})}
    # its workers are forks too, where the launcher would be one (their settings are the server's)
    forks = forked.forks(env)
    launcher = [FORKED_TORCHRUN] if forks else ['-m', 'torch.distributed.run']
    if forks:
        env[forked.SOCKET_ENV] = forked.server_socket()
    return forked.Process(*launcher, *(torchrun_args or ['--standalone']),
                          f'--nproc_per_node={nproc}', *args, env=env, new_session=True)


def torchrun_script(*args, timeout=300, **kwargs):
    """torchrun_started's run, waited for."""
    proc = torchrun_started(*args, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    # on a timeout torchrun is stopped; its workers, in sessions of their own, run to their end
    finally:
        if proc.poll() is None:
            proc.kill()  # the whole process group
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def wait_for_stderr(proc, text, timeout=120, or_finish=False):
    """Wait until a started run (a forked.Process) has written text to its stderr. or_finish: a run
    that ends without writing it is no failure; returns whether it wrote it."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline and text not in open(proc.paths[1]).read():
        time.sleep(0.02)
    written = text in open(proc.paths[1]).read()
    assert written or (or_finish and proc.poll() == 0), f"the run never wrote {text!r} to stderr"
    return written


def ok(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return result
