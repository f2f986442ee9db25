"""Faults from the machine, not the user: a full disk while saving, an out_dir that cannot be written, the
data changed under a running job. Each ends in one line that says what happened and what to do, with the right
exit code, no temp file, every checkpoint whole, and, once the fault is fixed, a resume that is bitwise the
run that never met it. Where the machine lets a test mount a small filesystem (tmpfs, as root) the disk is
really full or read-only; elsewhere the fault is made at the same call (tests/probe.py)."""
import contextlib
import glob
import os
import shutil
import subprocess

import pytest
import torch

import forked
from conftest import PROBE, RUN_CONFIG, read_metrics, run_train, torchrun

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them

ARGS = ['--max_iters=30', '--lr_decay_iters=30', '--eval_interval=10', '--dropout=0.1', '--write_report=True']


def trajectory(out_dir):
    return [(r['step'], r['loss'], r['lr'], r['grad_norm']) for r in read_metrics(out_dir, 'train')]


@contextlib.contextmanager
def tmpfs(path, options):
    """A filesystem of our own at path while the test needs it; yields whether it could be mounted."""
    path.mkdir()
    mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(['umount', '-l', str(path)], check=True)


def probed_train(out_dir, data_dir, *args, **probes):
    return forked.run(PROBE, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}', f'--out_dir={out_dir}', *args,
                      env={**os.environ, **probes})


def error_line(result):
    errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and 'Traceback' not in result.stderr, result.stderr
    return errors[0]


def whole_checkpoints(out_dir):
    """The iteration of each checkpoint in out_dir, every one of them loaded; and no temp file left."""
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
    # a checkpoint of this model is ~0.35 MB: best.pt and last.pt fit at iteration 10, a third file does not
    with tmpfs(tmp_path / 'disk', 'size=900k') as mounted:
        out = str(tmp_path / 'disk' / 'run')
        # without a mount: each file stops at 200 KB
        probes = {} if mounted else {'PROBE_FSIZE': str(200_000)}
        result = probed_train(out, data_dir, *ARGS, **probes)
        assert result.returncode == 1
        error = error_line(result)
        at = 20 if mounted else 10
        assert error.startswith(f"error: saving best.pt and last.pt at iteration {at} failed "
                                f"({'No space left on device' if mounted else 'File too large'})"), error
        assert f'free space in {out}, then run again with init_from=auto' in error
        assert whole_checkpoints(out) == ({'best.pt': 10, 'last.pt': 10} if mounted else {})
        if mounted:  # warned before the save that failed
            assert any(line.startswith(f'warning: {out} has') for line in result.stderr.splitlines())
        assert [r['step'] for r in read_metrics(out, 'abort')] == [at]
        if mounted:
            subprocess.run(['mount', '-o', 'remount,size=20m', str(tmp_path / 'disk')], check=True)
        run_train(out, data_dir, *ARGS, '--init_from=auto')
        assert trajectory(out) == trajectory(straight)


def test_an_out_dir_that_cannot_be_written_is_refused_in_one_line(tmp_path, data_dir):
    with tmpfs(tmp_path / 'ro', 'size=1m,ro') as mounted:
        # no read-only filesystem to be had: a file where a folder must go fails the same call
        if not mounted:
            (tmp_path / 'ro' / 'file').write_text('')
        out = str(tmp_path / 'ro' / ('run' if mounted else 'file/run'))
        result = run_train(out, data_dir, *ARGS, check=False)
        assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
        why = 'Read-only file system' if mounted else 'Not a directory'
        assert result.stderr == f"error: out_dir '{out}' cannot be written ({why}): pick a writable out_dir\n"
        assert not os.path.exists(out)


# in the training process the change is met at the next read; a loader worker has read ahead
@pytest.mark.parametrize('how, workers, met_at, refused_for', [
    ('truncate', 0, [14], 'but its header says'),  # the shard's size no longer fits its header
    ('rewrite', 1, [14, 15, 16, 17], 'was trained on other data (shards changed toy_train_000000.bin)')])
def test_data_changed_under_the_run_ends_it_in_one_line_and_a_resume_on_restored_data_is_exact(
        tmp_path, data_dir, straight, how, workers, met_at, refused_for):
    data = tmp_path / 'data'
    shutil.copytree(os.path.join(data_dir, 'toy'), data / 'toy')
    shard = str(data / 'toy' / 'toy_train_000000.bin')
    shutil.copy2(shard, tmp_path / 'backup.bin')
    out = str(tmp_path / 'run')
    # changed during iteration 13, read again at 14: the run stops there, last.pt holds iteration 10
    result = probed_train(out, str(data), *ARGS, f'--num_workers={workers}',
                          PROBE_DATA=f'0:13:{how}:{shard}')
    assert result.returncode == 1
    error = error_line(result)
    assert error.startswith(f'error: {shard} changed while the run was reading it'), error
    assert error.endswith('restore the data and resume from last.pt (iteration 10), or start a new out_dir')
    assert whole_checkpoints(out) == {'best.pt': 10, 'last.pt': 10}
    [abort] = read_metrics(out, 'abort')
    assert abort['step'] in met_at and os.path.exists(os.path.join(out, 'report.md'))
    # changed data is refused at the resume; on the same data again the run goes on as if nothing had happened
    refused = run_train(out, str(data), *ARGS, '--init_from=resume', check=False)
    assert refused.returncode == 2 and refused.stderr.count('\n') == 1 and refused_for in refused.stderr
    shutil.copy2(tmp_path / 'backup.bin', shard)
    run_train(out, str(data), *ARGS, f'--num_workers={workers}', '--init_from=resume')
    assert trajectory(out) == trajectory(straight)


def test_one_rank_meets_changed_data_and_every_rank_stops_at_that_step(tmp_path, data_dir):
    data = tmp_path / 'data'
    shutil.copytree(os.path.join(data_dir, 'toy'), data / 'toy')
    shard = str(data / 'toy' / 'toy_train_000000.bin')
    out = str(tmp_path / 'run')
    result = torchrun(out, str(data), *ARGS, '--gradient_accumulation_steps=2', probe=True, timeout=120,
                      env_extra={'PROBE_DATA': f'1:13:truncate:{shard}'})
    assert result.returncode != 0 and 'SIGABRT' not in result.stderr
    assert result.stderr.count(f'error: {shard} changed while the run was reading it') == 1, result.stderr
    # rank 1 truncates the shard in its step-13 forward; rank 0 may not have read its step-13 batch yet (the
    # ranks meet only at the step's all-reduce), so the first read to fail is rank 0's in step 13 or either's
    # in step 14
    assert [r['step'] for r in read_metrics(out, 'abort')] in ([13], [14])
    assert whole_checkpoints(out) == {'best.pt': 10, 'last.pt': 10}
