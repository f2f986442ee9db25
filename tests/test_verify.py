"""verify.py: a run replayed between two kept checkpoints reproduces what it recorded, bit for bit,
on 1 process and on 2 ranks; an edited weight or logged figure is caught and named; start and end
alone name their run, another folder's are refused."""
import json
import math
import os
import re
import shutil

import pytest
import torch

import forked
from conftest import DEVICES, REPO, ok, read_metrics, run_train, torchrun

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them

ARGS = ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10', '--keep_checkpoints=2',
        '--dropout=0.1', '--ema_decay=0.9']


def verify(run):
    return forked.run('verify.py', f'--out_dir={run}')


def edit_logged_loss(run, step):
    """Moves iteration step's loss in run's metrics.jsonl to the next float (one unit in the last
    place: a changed last decimal digit can round to the same float): (new, old)."""
    with open(os.path.join(run, 'metrics.jsonl')) as f:
        records = [json.loads(line) for line in f]
    [record] = [r for r in records if r['kind'] == 'train' and r['step'] == step]
    logged = record['loss']
    record['loss'] = math.nextafter(logged, math.inf)
    with open(os.path.join(run, 'metrics.jsonl'), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
    return record['loss'], logged


# a GPU's kernels repeat bitwise only with deterministic=True
@pytest.mark.parametrize('device', DEVICES)
def test_a_run_verifies_and_an_edited_weight_and_logged_loss_are_named(tmp_path, data_dir, device):
    run = str(tmp_path / 'run')
    run_train(run, data_dir, *ARGS, f'--device={device}', f'--deterministic={device == "cuda"}')
    result = verify(run)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('reproduced: iterations 11-20, 10 logged step(s)'), \
        result.stdout
    # a weight moved by 1e-6 in the later checkpoint, a logged loss by one unit in the last place
    later = os.path.join(run, 'ckpt-000020.pt')
    ckpt = torch.load(later, weights_only=True)
    ckpt['model']['blocks.1.mlp.c_fc.weight'][0, 0] += 1e-6
    torch.save(ckpt, later)
    edited, logged = edit_logged_loss(run, 15)
    result = verify(run)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"diverged at iteration 15: loss {edited!r} in the run, "
                               f"{logged!r} here"), result.stdout
    assert lines[1] == ('diverged in the state at iteration 20: model.blocks.1.mlp.c_fc.weight '
                        'differs (largest difference 1e-06)'), result.stdout
    assert lines[2] == "this machine matches the run's (hardware and versions in meta.json)"
    # records removed: their figures went uncompared, and the run verified
    with open(os.path.join(run, 'metrics.jsonl')) as f:
        records = [r for r in map(json.loads, f)
                   if (r['kind'], r.get('step')) not in (('train', 13), ('eval', 20))]
    with open(os.path.join(run, 'metrics.jsonl'), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
    result = verify(run)
    assert result.returncode == 1 and result.stdout == (
        f"not verified: {run}/metrics.jsonl lacks record(s) the run's settings write: train 13, "
        f"eval 20\n"), result.stdout


def test_evaluations_and_the_loops_counters_are_compared_too(tmp_path, data_dir):
    run = str(tmp_path / 'run')
    # a first session to 15, evaluated at its end; learning rate 0: the val loss is flat, so the
    # best stays at 10 while the evaluations since it count up
    flat = ['--learning_rate=0', '--checkpoint_interval=5', '--keep_checkpoints=4']
    run_train(run, data_dir, *ARGS, *flat, '--max_iters=15')
    run_train(run, data_dir, *ARGS, *flat, '--init_from=resume')
    # checkpoints written before eval_windows was kept: every replay of them 'diverged'
    for ckpt_path in (f'{run}/ckpt-000005.pt', f'{run}/ckpt-000015.pt'):
        older = torch.load(ckpt_path, weights_only=True)
        del older['eval_windows']
        torch.save(older, ckpt_path)
    # the replay of 6-15 evaluates at 10 and 15 as the run did; that of 11-20 at 20 only, where the
    # run also did at 15: its best so far is not the run's, and not compared
    for start, end, evaluations in ((5, 15, 2), (10, 20, 1)):
        result = forked.run('verify.py', f'--start={run}/ckpt-{start:06d}.pt',
                            f'--end={run}/ckpt-{end:06d}.pt')
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith(f'reproduced: iterations {start + 1}-{end}, 10 logged '
                                        f'step(s) and {evaluations} evaluation(s)'), result.stdout
    run = str(tmp_path / 'moving')
    run_train(run, data_dir, *ARGS, '--checkpoint_interval=5', '--keep_checkpoints=4')
    # the replay evaluates at its last iteration, 15, which the run only saved at: its best so
    # far is not the run's, and not compared
    result = forked.run('verify.py', f'--start={run}/ckpt-000005.pt', f'--end={run}/ckpt-000015.pt')
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('reproduced: iterations 6-15, 10 logged step(s) and 1 '
                                    'evaluation(s)'), result.stdout
    # the evaluation at 20: its logged val loss, and the evaluations without a new best in the
    # checkpoint it wrote
    with open(os.path.join(run, 'metrics.jsonl')) as f:
        records = [json.loads(line) for line in f]
    [evaluation] = [r for r in records if r['kind'] == 'eval' and r['step'] == 20]
    logged = evaluation['val_loss']
    evaluation['val_loss'] = math.nextafter(logged, math.inf)
    with open(os.path.join(run, 'metrics.jsonl'), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
    later = os.path.join(run, 'ckpt-000020.pt')
    ckpt = torch.load(later, weights_only=True)
    ckpt['evals_since_best'] += 1
    torch.save(ckpt, later)
    result = verify(run)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"diverged at iteration 20: val_loss "
                               f"{evaluation['val_loss']!r} in the run, {logged!r} here")
    assert lines[1] == (f"diverged in the state at iteration 20: evals_since_best differs "
                        f"({ckpt['evals_since_best']} in the run, "
                        f"{ckpt['evals_since_best'] - 1} here)"), result.stdout


@pytest.mark.parametrize('device', DEVICES)
def test_a_gpu_run_without_deterministic_drifts_and_says_by_how_much(tmp_path, data_dir, device):
    run = str(tmp_path / 'run')
    run_train(run, data_dir, *ARGS, f'--device={device}')
    if device == 'cpu':  # the verdict reads the run's device in meta.json; the replay's is the CPU
        meta = json.load(open(os.path.join(run, 'meta.json')))
        with open(os.path.join(run, 'meta.json'), 'w') as f:
            json.dump({**meta, 'device': 'cuda:0'}, f)
    edit_logged_loss(run, 15)  # at least this drift, whatever the kernels' order of addition gives
    # and a weight far past any drift: said, not dropped
    later = os.path.join(run, 'ckpt-000020.pt')
    ckpt = torch.load(later, weights_only=True)
    ckpt['model']['wte.weight'][0, 0] += 1000.0
    torch.save(ckpt, later)
    result = verify(run)
    assert result.returncode == 0, result.stdout + result.stderr
    drift = re.fullmatch(r"drifted, as a GPU run without deterministic=True does \(its kernels add "
                         r"in varying order\): the largest relative difference over iterations "
                         r"11-20 is (\S+) in the logged figures, (\S+) \(model.wte.weight\) in the "
                         r"state; train with deterministic=True to verify bitwise\n", result.stdout)
    assert drift and float(drift.group(1)) > 0 and float(drift.group(2)) > 100, result.stdout


def test_a_two_rank_run_verifies_under_torchrun(tmp_path, data_dir):
    run = str(tmp_path / 'run')
    ok(torchrun(run, data_dir, *ARGS, '--gradient_accumulation_steps=2', '--smoke_steps=30'))
    # the smoke test stepped on each rank's next micro-batch from the state it then restored: its
    # first loss, the ranks' mean, is the first iteration's (one micro-batch per rank)
    [smoke] = read_metrics(run, 'smoke')
    assert smoke['first_loss'] == read_metrics(run, 'train')[0]['loss']
    result = verify(run)
    assert result.returncode == 0, result.stderr
    assert 'on 2 process(es)' in result.stderr, result.stderr
    assert result.stdout.startswith('reproduced: iterations 11-20'), result.stdout
    # resumed on one process: its session is replayed on one, from the 2 ranks' checkpoint; a
    # replay from 10 (a copy the resume does not remove) would run 11-20 on one too, where the run
    # had 2
    start, end = os.path.join(run, 'early.pt'), os.path.join(run, 'ckpt-000030.pt')
    shutil.copy(os.path.join(run, 'ckpt-000010.pt'), start)
    run_train(run, data_dir, *ARGS, '--gradient_accumulation_steps=2', '--smoke_steps=30',
              '--init_from=resume', '--max_iters=30')
    result = verify(run)
    assert result.returncode == 0 and 'on 1 process(es)' in result.stderr, result.stderr
    assert result.stdout.startswith('reproduced: iterations 21-30'), result.stdout
    result = forked.run('verify.py', f'--start={start}', f'--end={end}')
    assert result.returncode == 2 and result.stderr == (
        f"error: iterations 11-20 ran on 2 process(es), the session that wrote {end} on 1: name "
        f"checkpoints of sessions on one number of processes\n")


def test_a_span_over_a_session_that_changed_a_setting_is_refused(tmp_path, data_dir):
    run = str(tmp_path / 'run')
    kept = [*ARGS, '--checkpoint_interval=5', '--keep_checkpoints=4']
    run_train(run, data_dir, *kept, '--max_iters=5', '--dtype=float32')
    # dtype left out: 'auto' keeps the run's float32, as a resume does (verify.py refused it)
    run_train(run, data_dir, *kept, '--max_iters=10', '--init_from=resume')
    result = forked.run('verify.py', f'--start={run}/ckpt-000005.pt', f'--end={run}/ckpt-000010.pt')
    assert result.returncode == 0 and result.stdout.startswith('reproduced: iterations 6-10'), \
        result.stdout + result.stderr
    run_train(run, data_dir, *kept, '--max_iters=15', '--init_from=resume', '--learning_rate=1e-2')
    run_train(run, data_dir, *kept, '--init_from=resume')  # the first rate again
    # start's and end's settings are alike, 11-15 ran otherwise: the replay 'diverged' at 11
    end = f'{run}/ckpt-000020.pt'
    result = forked.run('verify.py', f'--start={run}/ckpt-000010.pt', f'--end={end}')
    assert result.returncode == 2 and result.stdout == '' and result.stderr == (
        f"error: iterations 11-15 ran in a session that changed learning_rate on resume, which "
        f"the replay of {end}'s settings would not: name checkpoints of sessions with one set of "
        f"settings\n"), result.stderr
    result = forked.run('verify.py', f'--start={run}/ckpt-000015.pt', f'--end={end}')
    assert result.returncode == 2 and result.stderr == (
        f"error: {run}/ckpt-000015.pt and {end} come from sessions with other settings "
        f"(learning_rate): name two checkpoints of one session\n"), result.stderr


def test_too_few_kept_checkpoints_is_one_line(tmp_path, data_dir):
    run = str(tmp_path / 'run')
    run_train(run, data_dir, '--max_iters=10', '--lr_decay_iters=10')
    result = verify(run)
    assert result.returncode == 2 and result.stderr == (
        f"error: {run} keeps 0 checkpoint(s) (ckpt-ITER.pt): train with keep_checkpoints=2 or "
        f"more, or name --start and --end\n")


def test_start_and_end_alone_verify_their_run_and_another_folders_are_refused(tmp_path, data_dir):
    run = str(tmp_path / 'run')
    run_train(run, data_dir, *ARGS)
    # README's shorthand, as written: out_dir is the checkpoints' folder, not 'out' (which may be
    # another run's), from any working folder
    result = forked.run(os.path.join(REPO, 'verify.py'), '--start=run/ckpt-000010.pt',
                        '--end=run/last.pt', cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('reproduced: iterations 11-20, 10 logged step(s)'), \
        result.stdout
    # another run's checkpoints would replay against this run's records: refused, as are two
    # checkpoints of two folders
    other = str(tmp_path / 'other')
    shutil.copytree(run, other)
    result = forked.run('verify.py', f'--out_dir={run}', f'--start={other}/ckpt-000010.pt',
                        f'--end={other}/ckpt-000020.pt')
    assert result.returncode == 2 and result.stdout == '' and result.stderr == (
        f"error: {other}/ckpt-000010.pt is not in out_dir {run}: name checkpoints of that run's "
        f"folder, or leave out --out_dir (the checkpoints' folder is then the run's)\n")
    result = forked.run('verify.py', f'--start={run}/ckpt-000010.pt',
                        f'--end={other}/ckpt-000020.pt')
    assert result.returncode == 2 and result.stdout == '' and result.stderr == (
        f"error: start {run}/ckpt-000010.pt and end {other}/ckpt-000020.pt are in different "
        f"folders: name two checkpoints of one run's folder\n")
    # a folder was called one in another folder, a missing file a checkpoint with nothing to resume
    result = forked.run('verify.py', f'--start={run}', f'--end={run}/last.pt')
    assert result.returncode == 2 and result.stderr == (
        f"error: start={run} is not a file: name a checkpoint of the run's folder (ckpt-ITER.pt, "
        f"last.pt)\n")
    # train.py refusing the replay (its data is not where the run had it) was 'not verified', exit 1
    end = torch.load(f'{other}/ckpt-000020.pt', weights_only=True)
    end['config']['data_dir'] = str(tmp_path / 'nowhere')
    torch.save(end, f'{other}/ckpt-000020.pt')
    result = verify(other)
    assert (result.returncode == 2 and result.stdout == ''
            and result.stderr.splitlines()[-1].startswith(
                f"error: the replay did not start: dataset 'toy' has no {tmp_path}/nowhere/toy/"
                "meta.json")), result.stderr
    # a damaged line before the last was a traceback; a last one a kill cut short is no record
    with open(f'{other}/metrics.jsonl', 'a') as f:
        f.write('{"kind": "train", "st{"kind": "start"}\n{"kind": "tr')
    result = verify(other)
    assert result.returncode == 2 and result.stdout == '' and re.fullmatch(
        f"error: {other}/metrics.jsonl:[0-9]+ is not a metrics record \\(.*\\): the file is "
        f"damaged; delete that line, then run again\n", result.stderr), result.stderr
    assert sorted(os.listdir(tmp_path)) == ['other', 'run']  # no replay folder left behind
