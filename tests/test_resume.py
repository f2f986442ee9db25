"""Exact resume and crash safety: an interrupted run, resumed, is the run that was never
interrupted."""
import glob
import json
import os
import random
import shutil
import signal
import time

import pytest
import torch

import checkpoint
import forked
import sample
from conftest import (DEVICES, OLD_ARGS, OLD_CHECKPOINTS, PROBE, RUN_CONFIG, read_metrics,
                      run_train, run_trains, wait_for_stderr)
from model import GPT, GPTConfig
from test_recipe import RECIPE

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them

# dropout, loader workers and gradient accumulation all on: each one has broken someone's resume
HARD = ['--dropout=0.1', '--num_workers=2', '--gradient_accumulation_steps=2', '--max_iters=30',
        '--lr_decay_iters=30', '--eval_interval=10']


def trajectory(out_dir):
    """Per-step (step, loss, lr, grad_norm): what must match bitwise."""
    return [(r['step'], r['loss'], r['lr'], r['grad_norm']) for r in read_metrics(out_dir, 'train')]


# the recipe: Muon beside AdamW, wsd...
@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('recipe', [[], RECIPE], ids=['nanogpt', 'recipe'])
def test_bfloat16_resume_mid_epoch_between_evaluations_is_bitwise(tmp_path, data_dir, recipe,
                                                                 device):
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    # a GPU's kernels repeat bitwise only with deterministic=True (else atomic adds in backward)
    args = [*HARD, *recipe, '--dtype=bfloat16', f'--device={device}',
            f'--deterministic={device == "cuda"}']
    # stop at 14: in the middle of an epoch, between evaluations, after an extra final evaluation
    run_trains(data_dir, (straight, args), (split, [*args, '--max_iters=14']))
    run_train(split, data_dir, *args, '--init_from=resume', probe=True,
              env={**os.environ, 'PROBE_DTYPES': str(tmp_path)})
    # what the linear layers returned after the resume
    assert json.load(open(tmp_path / 'dtypes.0')) == ['bfloat16']
    # so before it too: a float32 part would differ
    assert trajectory(split) == trajectory(straight)
    evals = lambda d: [(r['step'], r['val_loss'])
                       for r in read_metrics(d, 'eval') if r['step'] % 10 == 0]
    assert evals(split) == evals(straight)
    a, b = (torch.load(os.path.join(d, 'last.pt'), weights_only=True) for d in (straight, split))
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    lrs = lambda ckpt: [g['lr'] for state in ckpt['optimizer'] for g in state['param_groups']]
    # each optimizer's groups resumed at their own rate: Muon's is not AdamW's
    assert lrs(a) == lrs(b)
    if recipe:  # Muon's Newton-Schulz dtype, 'auto': the straight run's choice, kept by the resume
        chosen = [json.load(open(os.path.join(d, 'meta.json')))['muon_dtype']
                  for d in (straight, split)]
        assert chosen[1] == {'dtype': chosen[0]['dtype'],
                             'rule': f"'auto' as resolved by the run in {split}/last.pt"}


def test_float32_resume_after_evaluation_and_from_best_is_bitwise(tmp_path, data_dir):
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    args = [*HARD, '--dtype=float32', '--ema_decay=0.8']  # the EMA of the weights resumes too
    # the split run stops right after the evaluation at 20
    run_trains(data_dir, (straight, args), (split, [*args, '--max_iters=20']))
    best_at_20 = str(tmp_path / 'best_at_20.pt')
    shutil.copy(os.path.join(split, 'best.pt'), best_at_20)
    run_train(split, data_dir, *args, '--init_from=resume')
    assert trajectory(split) == trajectory(straight)
    a, b = (torch.load(os.path.join(d, 'last.pt'), weights_only=True) for d in (straight, split))
    for weights in ('model', 'ema'):
        assert all(torch.equal(a[weights][k], b[weights][k]) for k in a[weights])
    evals = lambda d: [(e['step'], e['val_loss'], e['ema_val_loss'])
                       for e in read_metrics(d, 'eval')]
    assert evals(split) == evals(straight)
    # best.pt by the EMA's val loss, not the raw weights'
    records = read_metrics(straight, 'eval')
    assert all(e['best_val_loss'] == min(f['ema_val_loss'] for f in records[:i + 1])
               for i, e in enumerate(records))
    best = torch.load(os.path.join(straight, 'best.pt'), weights_only=True)
    raw, averaged = [e[1] for e in evals(straight)], [e[2] for e in evals(straight)]
    assert best['best_val_loss'] == min(averaged) != min(raw)
    # sample.py and evaluate.py load the EMA, or with raw_weights the trained weights
    for raw, weights in ((False, 'ema'), (True, 'model')):
        loaded = sample.load_model(os.path.join(straight, 'best.pt'), 'cpu', raw)[0].state_dict()
        assert all(torch.equal(v, best[weights][('module.' if weights == 'ema' else '') + k])
                   for k, v in loaded.items())
    # and they say which
    exported = forked.run('sample.py', f"--ckpt={os.path.join(straight, 'best.pt')}",
                          f"--export={tmp_path / 'exported.pt'}")
    assert f"(iteration {best['iter_num']}, the EMA of its weights) to" in exported.stderr
    # any checkpoint resumes, here a best.pt into a new out_dir; the logs a run stopped before its
    # first checkpoint left there (a smoke test that failed) are no part of it: they stayed
    from_best = str(tmp_path / 'from_best')
    os.makedirs(from_best)
    with open(os.path.join(from_best, 'metrics.jsonl'), 'w') as f:
        f.write('{"kind": "train", "step": 3, "loss": 9.0, "lr": 0.1, "grad_norm": 1.0}\n')
    run_train(from_best, data_dir, *args, '--init_from=resume', f'--resume_from={best_at_20}')
    assert trajectory(from_best) == [t for t in trajectory(straight) if t[0] > 20]
    # init_from=auto with a resume_from: the first run starts from it, the same command again from
    # out_dir's own last.pt (a scheduler's restart redoes nothing)
    auto = str(tmp_path / 'auto')
    run_train(auto, data_dir, *args, '--max_iters=25', '--init_from=auto',
              f'--resume_from={best_at_20}')
    run_train(auto, data_dir, *args, '--init_from=auto', f'--resume_from={best_at_20}')
    assert trajectory(auto) == [t for t in trajectory(straight) if t[0] > 20]


@pytest.mark.parametrize('device', DEVICES)
def test_kept_checkpoints_are_the_latest_k_and_each_replays_the_run_written_in_the_background(
        tmp_path, data_dir, device):
    run, replay = str(tmp_path / 'run'), str(tmp_path / 'replay')
    args = ['--max_iters=40', '--lr_decay_iters=40', '--eval_interval=10', '--keep_checkpoints=2',
            '--dropout=0.1', '--ema_decay=0.9', f'--device={device}',
            f'--deterministic={device == "cuda"}']
    # written in the background from a copy taken at the save, while 0.2 s of steps go on: what a
    # resume needs, nothing later
    run_train(run, data_dir, *args, '--async_save=True', probe=True,
              env={**os.environ, 'PROBE_SAVE_DELAY': '0.2'})
    assert sorted(f for f in os.listdir(run) if f.startswith('ckpt-')) == ['ckpt-000030.pt',
                                                                           'ckpt-000040.pt']
    assert os.path.samefile(os.path.join(run, 'ckpt-000040.pt'), os.path.join(run, 'last.pt'))
    # the earlier replays the run to the later, bitwise, the EMA of the weights too
    run_train(replay, data_dir, *args, '--init_from=resume',
              f"--resume_from={os.path.join(run, 'ckpt-000030.pt')}")
    assert trajectory(replay) == [t for t in trajectory(run) if t[0] > 30]
    # map_location: a background write holds host copies, a write at once the GPU's tensors
    a, b = (torch.load(path, map_location='cpu', weights_only=True)
            for path in (os.path.join(run, 'ckpt-000040.pt'), os.path.join(replay, 'last.pt')))
    for weights in ('model', 'ema'):
        assert all(torch.equal(a[weights][k], b[weights][k]) for k in a[weights])


def start_train(out_dir, data_dir, *overrides, hold_save=None):
    """train.py under tests/probe.py; hold_save=N: its N-th write of last.pt stops before the
    rename."""
    env = {**os.environ, 'PROBE_HOLD_SAVE': str(hold_save)} if hold_save else None
    return forked.Process(PROBE, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}',
                          f'--out_dir={out_dir}', *overrides, env=env)


def test_sigkill_at_random_moments_and_mid_write_then_auto_resume(tmp_path, data_dir):
    args = ['--max_iters=100', '--lr_decay_iters=100', '--eval_interval=3', '--dropout=0.1',
            '--n_embd=128', '--n_layer=4', '--init_from=auto']
    straight, killed = str(tmp_path / 'straight'), str(tmp_path / 'killed')
    run_train(straight, data_dir, *args)
    rng = random.Random(0)
    for attempt in range(4):  # kill, resume with init_from=auto, kill again...
        # the last two sessions write in the background (async_save) while training goes on
        background = [f'--async_save={attempt >= 2}']
        # in the middle of the session's second write of last.pt: its temp file is complete
        if attempt % 2 == 0:
            proc = start_train(killed, data_dir, *args, *background, hold_save=2)
            # a session resumed near the end (after a late random kill) may finish before its second
            # write: the loop's check below then ends it
            wait_for_stderr(proc, 'probe: holding the write of', or_finish=True)
        else:  # anywhere: start-up, a step, an evaluation, a save
            proc = start_train(killed, data_dir, *args, *background)
            time.sleep(rng.uniform(2.0, 7.0))
        if proc.poll() is not None:  # finished before a kill landed: nothing left to interrupt
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if attempt % 2 == 0:  # the kill landed mid-write: last.pt is still the save before
            held = max(glob.glob(os.path.join(killed, 'last.pt.*.tmp')), key=os.path.getmtime)
            being_saved = torch.load(held, weights_only=True)['iter_num']  # whole, not renamed
            if attempt < 2:  # written at once: training waited for it
                assert being_saved == trajectory(killed)[-1][0]
            # saves come at every evaluation (3 iterations) and at max_iters (100, 1 after 99)
            assert (torch.load(os.path.join(killed, 'last.pt'), weights_only=True)['iter_num']
                    == (being_saved - 1) // 3 * 3)
        for name in ('best.pt', 'last.pt'):  # whatever is on disk after a kill loads
            path = os.path.join(killed, name)
            if os.path.exists(path):
                torch.load(path, weights_only=True)
    run_train(killed, data_dir, *args)  # the last resume runs to the end
    assert trajectory(killed) == trajectory(straight)  # every step once, same numbers
    # a killed write's temp file (its own PID) was removed
    assert not glob.glob(os.path.join(killed, '*.tmp'))
    assert logged_steps(killed) == list(range(1, 101))


def logged_steps(out_dir):
    return [int(line.split()[1].split('/')[0]) for line in open(os.path.join(out_dir, 'train.log'))
            if line.startswith('iter ')]


@pytest.mark.slow
def test_a_run_folder_moved_after_a_kill_resumes_with_each_step_logged_once(tmp_path, data_dir):
    # killed holding its second write of last.pt (iteration 6): the logs run past last.pt (iteration
    # 3); the folder is then moved, as to another disk, and resumed there: the steps after iteration
    # 3 are redone and logged once
    args = ['--max_iters=12', '--lr_decay_iters=12', '--eval_interval=3']
    killed, moved = str(tmp_path / 'killed'), str(tmp_path / 'moved')
    proc = start_train(killed, data_dir, *args, hold_save=2)
    wait_for_stderr(proc, 'probe: holding the write of')
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert logged_steps(killed) == list(range(1, 7))
    shutil.move(killed, moved)
    run_train(moved, data_dir, *args, '--init_from=resume')
    assert logged_steps(moved) == list(range(1, 13))
    assert [r['step'] for r in read_metrics(moved, 'train')] == list(range(1, 13))


def test_a_resume_from_last_pt_moves_a_later_kept_checkpoint_aside(tmp_path, data_dir):
    # always_save_checkpoint=False: the evaluation at 6, no better than 3's (learning rate 0),
    # writes ckpt-000006.pt alone, and a kill at 7 leaves last.pt at 3. The resume, at another rate,
    # replaces 4-6: that checkpoint stayed beside it, and a --resume_from of it mixed the two
    # continuations in the logs
    run = str(tmp_path / 'run')
    # float32: 'auto' times training forwards, which the probe would count
    args = ['--max_iters=12', '--lr_decay_iters=12', '--eval_interval=3', '--keep_checkpoints=4',
            '--always_save_checkpoint=False', '--dtype=float32']
    proc = forked.Process(PROBE, 'train.py', RUN_CONFIG, f'--data_dir={data_dir}',
                          f'--out_dir={run}', *args, '--learning_rate=0',
                          env={**os.environ, 'PROBE_SLEEP': '7-7:60'})
    wait_for_stderr(proc, 'probe: rank 0 sleeps in micro-batch 7')
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert sorted(f for f in os.listdir(run) if f.endswith('.pt')) == [
        'best.pt', 'ckpt-000003.pt', 'ckpt-000006.pt', 'last.pt']
    result = run_train(run, data_dir, *args, '--init_from=resume')
    assert (f"moved ckpt-000006.pt (6) into {run}/replaced-000003: the continuation after "
            f"iteration 3 this session replaces") in result.stdout, result.stdout
    assert os.listdir(os.path.join(run, 'replaced-000003')) == ['ckpt-000006.pt']
    assert [r['step'] for r in read_metrics(run, 'train')] == list(range(1, 13))


def test_a_resume_whose_best_weights_no_file_holds_tests_the_last_and_says_so(tmp_path, data_dir):
    out, source, branch = (str(tmp_path / name) for name in ('run', 'source', 'branch'))
    run_train(out, data_dir, '--max_iters=20', '--lr_decay_iters=20', '--eval_interval=10',
              '--checkpoint_interval=5', '--keep_checkpoints=4')
    # iteration 15's state alone, in a folder of its own: its best, 10, is in no file there; made
    # a val loss the session's evaluation at 16 cannot beat
    os.makedirs(source)
    ckpt = torch.load(os.path.join(out, 'ckpt-000015.pt'), weights_only=True)
    torch.save({**ckpt, 'best_val_loss': 0.0}, os.path.join(source, 'at15.pt'))
    result = run_train(branch, data_dir, '--max_iters=16', '--lr_decay_iters=20',
                       '--eval_interval=10', '--init_from=resume',
                       f'--resume_from={source}/at15.pt', '--test_eval=True', '--sample_tokens=4')
    assert not os.path.exists(os.path.join(branch, 'best.pt'))
    [test] = read_metrics(branch, 'test')
    assert test['best_iter'] == 10 and test['tested_iter'] == 16
    weights = 'the last weights (out_dir has no best.pt of iteration 10)'
    assert f' with {weights}; ' in result.stdout
    assert f'\na sample from {weights}:\n' in result.stdout  # the sample took them too
    # the same command again: out_dir now holds a run of its own, whose logs the other folder's
    # checkpoint would mix with another session's
    result = run_train(branch, data_dir, '--max_iters=16', '--lr_decay_iters=20',
                       '--eval_interval=10', '--init_from=resume',
                       f'--resume_from={source}/at15.pt', '--test_eval=True', check=False)
    assert result.returncode == 2 and result.stderr == (
        f"error: out_dir '{branch}' already holds a checkpoint: resume it (init_from=resume or "
        f"auto), or use another\n")


def test_refuses_mismatched_or_corrupt_checkpoints(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    run_train(out, data_dir, '--max_iters=10', '--lr_decay_iters=10', '--eval_interval=10')
    result = run_train(out, data_dir, '--init_from=resume', '--max_iters=20', '--n_layer=3',
                       check=False)
    assert result.returncode != 0 and 'n_layer=2 there, 3 here' in result.stderr
    assert result.stderr.count('\n') == 1 and 'Traceback' not in result.stderr
    # a different dataset (same name, other content) is refused by its hash
    import prepare
    from conftest import make_corpus
    other_data = str(tmp_path / 'other_data')
    prepare.prepare('toy', data_dir=other_data,
                    input_path=make_corpus(str(tmp_path / 'src'), seed=5))
    result = run_train(out, other_data, '--init_from=resume', '--max_iters=20', check=False)
    assert (result.returncode != 0 and 'trained on other data' in result.stderr
            and 'Traceback' not in result.stderr)
    # a checkpoint cannot run code: a pickled callable is refused, not called
    last = os.path.join(out, 'last.pt')
    good = torch.load(last, weights_only=True)
    marker = tmp_path / 'pwned'

    class Evil:
        def __reduce__(self):
            return (os.system, (f'touch {marker}',))
    torch.save({**good, 'evil': Evil()}, last)
    result = run_train(out, data_dir, '--init_from=resume', '--max_iters=20', check=False)
    assert result.returncode != 0 and 'unreadable' in result.stderr and not marker.exists()
    # a truncated file: one line naming it
    torch.save(good, last)
    with open(last, 'r+b') as f:
        f.truncate(os.path.getsize(last) // 2)
    result = run_train(out, data_dir, '--init_from=resume', '--max_iters=20', check=False)
    assert (result.returncode != 0 and result.stderr.count('\n') == 1
            and 'Traceback' not in result.stderr)
    assert last in result.stderr and 'unreadable' in result.stderr


# what the commit that wrote each of conftest.OLD_CHECKPOINTS logged resuming it with OLD_ARGS, its
# recipe's and --max_iters=10 --eval_interval=4: the train losses of steps 3-10, then the val losses
# at 4, 8 and 10
OLD_CODE_LOSSES = {
    'format3': [3.242905855178833, 3.224449396133423, 3.234220504760742, 3.221320867538452,
                3.2130682468414307, 3.2043983936309814, 3.2132318019866943, 3.21250057220459,
                3.2297593979608443, 3.219838581387959, 3.214699457562159],
    'format3_recipe': [3.2288172245025635, 3.2322704792022705, 3.2344651222229004,
                       3.23478627204895, 3.2204177379608154, 3.223973512649536,
                       3.2263312339782715, 3.2170379161834717, 3.2315335349431114,
                       3.2223088097950767, 3.217033022925967],
    'format4_first_recipe': [3.230401039123535, 3.2325475215911865, 3.2380332946777344,
                             3.240044593811035, 3.2231554985046387, 3.2259697914123535,
                             3.2275524139404297, 3.2260332107543945, 3.2353958250984314,
                             3.227235824342758, 3.222620282854353]}


@pytest.mark.parametrize('name, recipe', [('format3', []), ('format3_recipe', RECIPE),
                                          ('format4_first_recipe', RECIPE)])
def test_an_older_checkpoint_resumes_migrated_and_its_losses_continue_as_with_its_code(
        tmp_path, data_dir, name, recipe):
    path, migrated = OLD_CHECKPOINTS[name]
    out = tmp_path / 'old'
    out.mkdir()
    shutil.copy(path, out / 'last.pt')
    result = run_train(str(out), data_dir, *OLD_ARGS, *recipe, '--init_from=resume',
                       '--max_iters=10', '--eval_interval=4')
    line = f"migrated {out / 'last.pt'} from {migrated}"
    assert result.stdout.count('migrated') == 1 and line in result.stdout.splitlines()
    assert line in (out / 'train.log').read_text().splitlines()
    if recipe:  # written when torch's own Muon ran Newton-Schulz in bfloat16: it goes on so
        assert json.load(open(out / 'meta.json'))['muon_dtype']['dtype'] == 'bfloat16'
    # the run goes on as the old code went on from the same file, to rounding: not bitwise by
    # promise, since the head's matmuls have other shapes (64 rows, not 26), which a BLAS may split
    # otherwise
    losses = ([r['loss'] for r in read_metrics(out, 'train')]
              + [r['val_loss'] for r in read_metrics(out, 'eval')])
    assert losses == pytest.approx(OLD_CODE_LOSSES[name], rel=1e-5)
    # written as every save is, in this code's format; the padding rows, never used, are as the file
    # held them (zeros, from format 3), and their moments zero
    last = torch.load(out / 'last.pt', weights_only=True)
    assert last['format'] == checkpoint.FORMAT and last['iter_num'] == 10
    held = checkpoint.load(path)['model']
    assert all(torch.equal(last['model'][k][26:], held[k][26:])
               for k in ('wte.weight', 'lm_head.weight'))
    model = GPT(GPTConfig(**last['model_args']))
    optimizer = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), last['config']['optimizer'])
    optimizer.load_state_dict(last['optimizer'])
    assert not any(optimizer.state[p][k][26:].any() for k in ('exp_avg', 'exp_avg_sq')
                   for p in (model.wte.weight, model.lm_head.weight))
    # sample.py and evaluate.py read the old file itself; samples are in its vocabulary: the
    # characters and the unknown id's U+FFFD
    result = forked.run('sample.py', f'--ckpt={path}', '--num_samples=1', '--max_new_tokens=50')
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"migrated {path} from {migrated}\n")
    text = result.stdout.split('\n' + '-' * 40)[0]
    assert len(text) == 51 and set(text) <= {'\ufffd', *last['dataset']['tokenizer']['chars']}
    tasks = tmp_path / 'tasks.jsonl'
    tasks.write_text('{"context": "the cat", "choices": [" sees", " xq"], "answer": 0}\n')
    result = forked.run('evaluate.py', f'--ckpt={path}', f'--tasks={tasks}')
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"migrated {path} from {migrated}\n")
    assert result.stdout.startswith(f"{tasks}: 1 examples")


def test_checkpoints_that_cannot_be_migrated_and_a_newer_format_are_refused(tmp_path, data_dir):
    # format 2 (a format-3 file relabelled: the number is what is refused), and one newer than this
    # code's
    out = tmp_path / 'old'
    out.mkdir()
    old = torch.load(OLD_CHECKPOINTS['format3'][0], weights_only=True)
    torch.save({**old, 'format': 2}, out / 'last.pt')
    result = run_train(str(out), data_dir, *OLD_ARGS, '--init_from=resume', '--max_iters=4',
                       check=False)
    assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
    assert 'has format 2, written before datasets were shards' in result.stderr
    assert os.listdir(out) == ['last.pt']  # nothing written
    result = forked.run('sample.py', f'--ckpt={out / "last.pt"}')
    assert result.returncode == 2 and 'has format 2' in result.stderr
    run_train(str(tmp_path / 'new'), data_dir, '--max_iters=2', '--lr_decay_iters=2',
              '--warmup_iters=1', '--eval_interval=2')
    last = tmp_path / 'new' / 'last.pt'
    torch.save({**torch.load(last, weights_only=True), 'format': 99}, last)
    result = run_train(str(tmp_path / 'new'), data_dir, '--max_iters=4', '--init_from=resume',
                       check=False)
    assert result.returncode == 2 and 'has format 99, newer than this code' in result.stderr


def test_resumed_run_reports_this_session_and_the_total(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    quick = ['--lr_decay_iters=20', '--eval_interval=10']
    run_train(out, data_dir, *quick, '--max_iters=10')
    first = read_metrics(out, 'test')[0]['wall_seconds']
    run_train(out, data_dir, *quick, '--max_iters=20', '--init_from=resume')
    test = read_metrics(out, 'test')[-1]
    assert test['total_seconds'] > test['wall_seconds'] and test['total_seconds'] >= first
    done = [l for l in open(os.path.join(out, 'train.log')).read().splitlines()
            if l.startswith('done:')][-1]
    assert done.startswith('done: iterations 11-20 in ') and 'all 20 iterations in ' in done


def test_training_further_says_each_changed_setting_and_readme_s_command_keeps_the_schedule(
        tmp_path, data_dir):
    """README's Resume: to train further, run the run's own command again (meta.json's) with
    --init_from=resume and the keys to change; a resume lists every setting that differs from the
    checkpoint's run, so one left out (a schedule key given on the first command line) is seen."""
    out = str(tmp_path / 'run')
    run_train(out, data_dir, '--max_iters=10', '--lr_decay_iters=10', '--warmup_iters=2',
              '--eval_interval=10')
    shutil.copytree(out, tmp_path / 'copy')
    command = json.load(open(os.path.join(out, 'meta.json')))['command']
    further = forked.run(*command, '--init_from=resume', '--max_iters=16')
    assert further.returncode == 0, further.stderr
    assert ("settings changed since the checkpoint's run: max_iters 10 -> 16 (command line)\n"
            in further.stdout)
    lrs = [r['lr'] for r in read_metrics(out, 'train')]
    assert lrs[10:] == [3e-4] * 6  # past lr_decay_iters: on at min_lr, no second warm-up
    # without the first command's overrides, the schedule changes, and the resume says how
    result = run_train(str(tmp_path / 'copy'), data_dir, '--init_from=resume', '--max_iters=16')
    changed = next(line for line in result.stdout.splitlines()
                   if line.startswith('settings changed'))
    assert (f"lr_decay_iters 10 -> 40 ({RUN_CONFIG})" in changed
            and f"warmup_iters 2 -> 5 ({RUN_CONFIG})" in changed), changed
