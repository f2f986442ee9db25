"""Faults from the machine, not the user: a full disk while saving, an out_dir that cannot be
written, the data changed under a running job, met in training or in an evaluation. Each ends in one
line that says what happened and what to do, with the right exit code, no temp file, every
checkpoint whole, and, once the fault is fixed, a resume that is bitwise the run that never met it.
Where the machine lets a test mount a small filesystem (tmpfs, as root) the disk is really full or
read-only; elsewhere the fault is made at the same call (tests/probe.py)."""
import contextlib
import fcntl
import glob
import os
import re
import runpy
import shutil
import subprocess

import numpy as np
import pytest
import torch

import forked
from conftest import PROBE, RUN_CONFIG, llmc_shard, read_metrics, run_train, torchrun
from data import EvalSampler

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them

ARGS = ['--max_iters=30', '--lr_decay_iters=30', '--eval_interval=10', '--dropout=0.1',
        '--write_report=True', '--test_eval=True']


def trajectory(out_dir):
    return [(r['step'], r['loss'], r['lr'], r['grad_norm']) for r in read_metrics(out_dir, 'train')]


def evaluations(out_dir):
    return ([(r['step'], r['train_loss'], r['val_loss']) for r in read_metrics(out_dir, 'eval')],
            [r['test_loss'] for r in read_metrics(out_dir, 'test')])


@contextlib.contextmanager
def tmpfs(path, options):
    """A filesystem of our own at path while the test needs it; yields whether it could be
    mounted."""
    path.mkdir()
    mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(['umount', '-l', str(path)], check=True)


def probed_train(out_dir, data_dir, *args, **probes):
    return forked.run(PROBE, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}',
                      f'--out_dir={out_dir}', *args, env={**os.environ, **probes})


def error_line(result):
    errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and 'Traceback' not in result.stderr, result.stderr
    return errors[0]


def whole_checkpoints(out_dir):
    """The iteration of each checkpoint in out_dir, every one of them loaded; and no temp file
    left."""
    assert not glob.glob(os.path.join(out_dir, '*.tmp'))
    return {name: torch.load(os.path.join(out_dir, name), weights_only=True)['iter_num']
            for name in ('best.pt', 'last.pt') if os.path.exists(os.path.join(out_dir, name))}


@pytest.fixture(scope='module')
def straight(tmp_path_factory, data_dir):
    """The run that meets no fault."""
    out = str(tmp_path_factory.mktemp('straight') / 'run')
    run_train(out, data_dir, *ARGS)
    return out


def test_a_full_disk_ends_the_run_in_one_line_and_a_resume_after_freeing_space_is_exact(
        tmp_path, data_dir, straight):
    # a checkpoint of this model is ~0.35 MB: best.pt and last.pt (one file, two names) fit at
    # iteration 10, a second state beside them does not
    with tmpfs(tmp_path / 'disk', 'size=600k') as mounted:
        out = str(tmp_path / 'disk' / 'run')
        # without a mount: each file stops at 200 KB
        probes = {} if mounted else {'PROBE_FSIZE': str(200_000)}
        result = probed_train(out, data_dir, *ARGS, **probes)
        assert result.returncode == 1
        error = error_line(result)
        at = 20 if mounted else 10
        assert error.startswith(
            f"error: saving best.pt and last.pt at iteration {at} failed "
            f"({'No space left on device' if mounted else 'File too large'})"), error
        assert f'free space in {out}, then run again with init_from=auto' in error
        assert whole_checkpoints(out) == ({'best.pt': 10, 'last.pt': 10} if mounted else {})
        if mounted:  # warned before the save that failed
            assert any(line.startswith(f'warning: {out} has')
                       for line in result.stderr.splitlines())
        assert [r['step'] for r in read_metrics(out, 'abort')] == [at]
        if mounted:
            subprocess.run(['mount', '-o', 'remount,size=20m', str(tmp_path / 'disk')], check=True)
        run_train(out, data_dir, *ARGS, '--init_from=auto')
        assert trajectory(out) == trajectory(straight)


def test_a_failed_background_save_ends_the_run_at_the_next_step_in_one_line(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    # each file stops at 200 KB: the save at iteration 10 fails in its thread while training goes
    # on, and the first step after it has ended ends the run, before the next save at 20
    result = probed_train(out, data_dir, *ARGS, '--async_save=True', PROBE_FSIZE=str(200_000))
    assert result.returncode == 1
    error = error_line(result)
    assert error.startswith("error: saving best.pt and last.pt at iteration 10 failed (File too "
                            "large): the files on disk are whole"), error
    assert whole_checkpoints(out) == {}
    [abort] = read_metrics(out, 'abort')
    assert 10 < abort['step'] < 20


@pytest.mark.parametrize('background', [False, True], ids=['at_once', 'background'])
def test_a_full_disk_under_fsdp_ends_every_rank_in_one_line(tmp_path, data_dir, background):
    out, logs = str(tmp_path / 'run'), str(tmp_path / 'logs')
    # each file stops at 200 KB: the ranks' shards of iteration 10 fail in DCP's save (in its
    # thread with async_save, and the first step after it ends the run). Each rank's output to a
    # file of its own, apart from torchrun's report (a traceback)
    result = torchrun(out, data_dir, *ARGS, '--parallel=fsdp', '--gradient_accumulation_steps=2',
                      '--dtype=float32', f'--async_save={background}', probe=True, timeout=120,
                      env_extra={'PROBE_FSIZE': str(200_000)},
                      torchrun_args=['--standalone', f'--log-dir={logs}', '--redirects=3'])
    assert result.returncode == 1
    stderr = [open(path).read() for path in
              sorted(glob.glob(os.path.join(logs, '*', 'attempt_0', '*', 'stderr.log')))]
    # rank 0 says it: the first rank whose write failed with an OSError
    assert len(stderr) == 2 and stderr[1] == '' and re.fullmatch(
        r"error: saving best.pt and last.pt at iteration 10 failed \(File too large, rank [01]\): "
        r"the files on disk are whole; free space in .*, then run again with init_from=auto\n",
        stderr[0]), stderr
    assert whole_checkpoints(out) == {}
    # nor a folder of the failed save's shards: a retry on a still-full disk left one more each time
    assert not glob.glob(os.path.join(out, 'shards-*'))
    [abort] = read_metrics(out, 'abort')
    assert 10 < abort['step'] < 20 if background else abort['step'] == 10


def test_an_out_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path, data_dir):
    with tmpfs(tmp_path / 'ro', 'size=1m,ro') as mounted:
        # no read-only filesystem to be had: a file where a folder must go fails the same call
        if not mounted:
            (tmp_path / 'ro' / 'file').write_text('')
        out = str(tmp_path / 'ro' / ('run' if mounted else 'file/run'))
        result = run_train(out, data_dir, *ARGS, check=False)
        assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
        assert result.stderr == (
            f"error: out_dir '{out}' cannot be written (Read-only file system): pick a writable "
            f"out_dir\n" if mounted else f"error: out_dir '{out}' is under a file, "
            f"{tmp_path}/ro/file: name a folder (a new one is created)\n")
        assert not os.path.exists(out)


def test_a_second_run_into_an_out_dir_in_use_is_refused_in_one_line(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    run_train(out, data_dir, *ARGS)
    logged = open(os.path.join(out, 'metrics.jsonl')).read()
    # this process holds the lock, as a run still training there (a scheduler's first start) does
    with open(os.path.join(out, '.lock'), 'a') as held:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = run_train(out, data_dir, *ARGS, '--init_from=auto', check=False)
        assert result.returncode == 2 and result.stderr == (
            f"error: out_dir '{out}' is in use: another run writes there now (it holds "
            f"{out}/.lock): let it end, or use another out_dir\n")
        assert 'building the model' not in result.stdout, result.stdout  # refused before it
        assert open(os.path.join(out, 'metrics.jsonl')).read() == logged
    # let go (as when that run ends, however it ends): auto redoes the end
    result = run_train(out, data_dir, *ARGS, '--init_from=auto')
    assert 'done: no iterations left' in result.stdout


def test_a_lock_another_run_held_is_said_after_that_run_ends(tmp_path, monkeypatch):
    # the lock was held when the run tried it and let go before the line was made: the run went
    # on without it, writing no logs
    import runlog
    for name in ('run_dir', 'with_report'):  # open_run sets them
        monkeypatch.setattr(runlog, name, getattr(runlog, name))
    monkeypatch.setattr(runlog, 'lock', lambda out_dir: False)
    assert runlog.open_run(str(tmp_path), None, {'write_report': False}, {}, {}) == (
        f"out_dir '{tmp_path}' is in use: another run writes there now (it holds "
        f"{tmp_path}/.lock): let it end, or use another out_dir")


def test_an_out_dir_that_is_a_file_is_refused_before_anything_is_built(tmp_path, data_dir):
    out = tmp_path / 'notes'
    out.write_text('mine')
    result = run_train(str(out), data_dir, *ARGS, check=False)
    assert result.returncode == 2 and result.stderr == (
        f"error: out_dir '{out}' is a file: name a folder (a new one is created)\n")
    assert 'building the model' not in result.stdout and out.read_text() == 'mine'
    # nor one a run cannot own: none, under a file, in the dataset's folder (prepare.py replaces
    # it whole), a Hugging Face model's folder (its config.json would be replaced)
    model = tmp_path / 'model'
    model.mkdir()
    (model / 'config.json').write_text('{"model_type": "gpt2", "n_head": 4}')
    for out, why in (('', "out_dir is empty: name a folder"),
                     (f'{out}/run', f"out_dir '{out}/run' is under a file, {out}: name a folder"),
                     (f'{data_dir}/toy/run', f"out_dir '{data_dir}/toy/run' is in the dataset's "
                                             f"folder {data_dir}/toy, which prepare.py replaces"),
                     (str(model), f"out_dir '{model}' holds a config.json that is not a train.py "
                                  f"run's")):
        result = run_train(out, data_dir, *ARGS, check=False)
        assert result.returncode == 2 and result.stderr.startswith(f"error: {why}"), result.stderr
        assert result.stderr.count('\n') == 1 and 'building the model' not in result.stdout
    assert sorted(os.listdir(model)) == ['config.json']
    assert not os.path.exists(f'{data_dir}/toy/run')


# in the training process the change is met at the next read; a loader worker has read ahead.
# Truncated: while the save of 10 is still written in the background (async_save, torch.save
# delayed 2 s): the line names the iteration last.pt holds once it is whole
@pytest.mark.parametrize('how, workers, met_at, refused_for, background', [
    ('truncate', 0, [14], 'but its header says', True),  # the size no longer fits its header
    ('rewrite', 1, [14, 15, 16, 17],
     'was trained on other data (shards changed toy_train_000000.bin)', False)])
def test_data_changed_under_the_run_ends_it_in_one_line_and_a_resume_on_restored_data_is_exact(
        tmp_path, data_dir, straight, how, workers, met_at, refused_for, background):
    data = tmp_path / 'data'
    shutil.copytree(os.path.join(data_dir, 'toy'), data / 'toy')
    shard = str(data / 'toy' / 'toy_train_000000.bin')
    shutil.copy2(shard, tmp_path / 'backup.bin')
    out = str(tmp_path / 'run')
    # changed during iteration 13, read again at 14: the run stops there, last.pt holds iteration 10
    delay = {'PROBE_SAVE_DELAY': '2'} if background else {}
    result = probed_train(out, str(data), *ARGS, f'--num_workers={workers}',
                          f'--async_save={background}', PROBE_DATA=f'0:13:{how}:{shard}', **delay)
    assert result.returncode == 1
    error = error_line(result)
    assert error.startswith(f'error: {shard} changed while the run was reading it'), error
    assert error.endswith('restore the data and resume from last.pt (iteration 10), or start a new '
                          'out_dir')
    assert whole_checkpoints(out) == {'best.pt': 10, 'last.pt': 10}
    [abort] = read_metrics(out, 'abort')
    assert abort['step'] in met_at and os.path.exists(os.path.join(out, 'report.md'))
    # changed data is refused at the resume; on the same data again the run goes on as if nothing
    # had happened
    refused = run_train(out, str(data), *ARGS, '--init_from=resume', check=False)
    assert (refused.returncode == 2 and refused.stderr.count('\n') == 1
            and refused_for in refused.stderr)
    shutil.copy2(tmp_path / 'backup.bin', shard)
    run_train(out, str(data), *ARGS, f'--num_workers={workers}', '--init_from=resume')
    assert trajectory(out) == trajectory(straight)


def test_one_rank_meets_changed_data_and_every_rank_stops_at_that_step(tmp_path, data_dir):
    data = tmp_path / 'data'
    shutil.copytree(os.path.join(data_dir, 'toy'), data / 'toy')
    shard = str(data / 'toy' / 'toy_train_000000.bin')
    out = str(tmp_path / 'run')
    result = torchrun(out, str(data), *ARGS, '--gradient_accumulation_steps=2', probe=True,
                      timeout=120, env_extra={'PROBE_DATA': f'1:13:truncate:{shard}'})
    assert result.returncode != 0 and 'SIGABRT' not in result.stderr
    said = [line for line in result.stderr.splitlines()
            if line.startswith(f'error: {shard} changed')]
    assert len(said) == 1, result.stderr  # by rank 0; torchrun's summary repeats it, last
    # rank 1 truncates the shard in its step-13 forward; rank 0 may not have read its step-13 batch
    # yet (the ranks meet only at the step's all-reduce), so the first read to fail is rank 0's in
    # step 13 or either's in step 14
    assert [r['step'] for r in read_metrics(out, 'abort')] in ([13], [14])
    assert whole_checkpoints(out) == {'best.pt': 10, 'last.pt': 10}


CHANGED = ('changed while the run was reading it (its size or modification time is not what it was '
           'when the run opened it): restore the data and resume from last.pt')


# training reads no val or test shard: the next evaluation meets the change, and saves nothing
@pytest.mark.parametrize('split, at, met_at, last, resume', [
    ('val', 13, 20, 10, '--init_from=resume'),  # between the evaluations at 10 and 20
    ('test', 25, 30, 30, '--init_from=auto')])  # after the last save, before the test evaluation
def test_data_changed_under_an_evaluation_ends_the_run_in_one_line_and_a_resume_is_exact(
        tmp_path, data_dir, straight, split, at, met_at, last, resume):
    data = tmp_path / 'data'
    shutil.copytree(os.path.join(data_dir, 'toy'), data / 'toy')
    shard = str(data / 'toy' / f'toy_{split}_000000.bin')
    shutil.copy2(shard, tmp_path / 'backup.bin')
    out = str(tmp_path / 'run')
    result = probed_train(out, str(data), *ARGS, PROBE_DATA=f'0:{at}:truncate:{shard}')
    assert result.returncode == 1
    assert error_line(result) == (f'error: {shard} {CHANGED} (iteration {last}), or start a new '
                                  f'out_dir')
    assert [r['step'] for r in read_metrics(out, 'abort')] == [met_at]
    # nothing saved after the change: the straight run's checkpoints up to it, whole
    assert whole_checkpoints(out) == ({'best.pt': 10, 'last.pt': 10} if split == 'val'
                                      else whole_checkpoints(straight))
    shutil.copy2(tmp_path / 'backup.bin', shard)
    run_train(out, str(data), *ARGS, resume)
    assert trajectory(out) == trajectory(straight)
    assert evaluations(out) == evaluations(straight)


def val_shard_of_rank_1(folder):
    """The val shard of a dataset folder cut in two where rank 0's evaluation windows end (2 ranks,
    run_config's settings); returns the second shard, which only rank 1 reads."""
    config = runpy.run_path(RUN_CONFIG)
    first, second = (os.path.join(folder, f'toy_val_00000{i}.bin') for i in (0, 1))
    tokens = np.fromfile(first, dtype=np.uint16, offset=1024)
    starts = [EvalSampler(len(tokens), config['block_size'], config['batch_size'],
                          config['eval_iters'] * config['batch_size'], rank, 2).batches
              for rank in (0, 1)]
    cut = int(max(map(max, starts[0]))) + config['block_size'] + 1  # past rank 0's last window
    assert max(map(max, starts[1])) >= cut
    llmc_shard(first, tokens[:cut])
    llmc_shard(second, tokens[cut:])
    return second


# fsdp: every forward is a collective, so rank 1 runs one in place of the batch it cannot read
@pytest.mark.parametrize('parallel', ['ddp', 'fsdp'])
def test_a_val_shard_only_rank_1_reads_changes_and_every_rank_stops_at_the_evaluation(
        tmp_path, data_dir, parallel):
    data = tmp_path / 'data'
    shutil.copytree(os.path.join(data_dir, 'toy'), data / 'toy')
    shard = val_shard_of_rank_1(data / 'toy')
    shutil.copy2(shard, tmp_path / 'backup.bin')
    args = [*ARGS, '--gradient_accumulation_steps=2', f'--parallel={parallel}']
    straight, out = str(tmp_path / 'straight'), str(tmp_path / 'run')
    # one micro-batch a step per rank: rank 1 truncates the shard in iteration 13. Rank 0 never
    # reads it and must stop all the same; a rank left waiting in a collective fails the timeout.
    # Each rank's output goes to a file of its own, apart from torchrun's report (a traceback)
    logs = str(tmp_path / 'logs')
    result = torchrun(out, str(data), *args, probe=True, timeout=120,
                      env_extra={'PROBE_DATA': f'1:13:truncate:{shard}'},
                      torchrun_args=['--standalone', f'--log-dir={logs}', '--redirects=3'])
    assert result.returncode == 1
    stderr = [open(path).read() for path in
              sorted(glob.glob(os.path.join(logs, '*', 'attempt_0', '*', 'stderr.log')))]
    # rank 0 says it for both: nothing else, though torchrun stops it once rank 1 has exited
    assert stderr == [f'error: {shard} {CHANGED} (iteration 10), or start a new out_dir\n',
                      ''], stderr
    assert [r['step'] for r in read_metrics(out, 'abort')] == [20]
    assert whole_checkpoints(out) == {'best.pt': 10, 'last.pt': 10}
    shutil.copy2(tmp_path / 'backup.bin', shard)
    for run, resume in ((straight, []), (out, ['--init_from=resume'])):
        result = torchrun(run, str(data), *args, *resume)
        assert result.returncode == 0, result.stderr
    assert trajectory(out) == trajectory(straight)
    assert evaluations(out) == evaluations(straight)
