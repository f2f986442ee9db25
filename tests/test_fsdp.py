"""Sharded training (FSDP2) on CPU (gloo, 2 processes): the same run as DDP, exact resume from
sharded checkpoints, an exported single-file state_dict, and activation checkpointing that
recomputes every block and changes no loss."""
import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import data
import datafiles
import forked
from conftest import ok, read_metrics, run_train, torchrun
from model import GPT, GPTConfig
from test_evaluate import toy_task

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them

SAME = ['--gradient_accumulation_steps=4', '--max_iters=30', '--lr_decay_iters=30',
        '--eval_interval=10', '--dtype=float32']
# FSDP reduce-scatters gradients where one process sums them locally: the same sums in another
# order, so float32 rounding differs (~1e-7 relative per operation, compounded over 30 Adam steps);
# 1e-4 is far above that and far below what one wrong micro-batch or a missed shard would change
# (1e-2).
RTOL = 1e-4


def trajectory(out_dir):
    return [(r['step'], r['loss'], r['lr'], r['grad_norm']) for r in read_metrics(out_dir, 'train')]


def test_fsdp_matches_one_process_resumes_exactly_and_checkpoints_activations(tmp_path, data_dir):
    one, fsdp, split = str(tmp_path / 'one'), str(tmp_path / 'fsdp'), str(tmp_path / 'split')
    # tests/test_ddp.py shows DDP on 2 ranks equals this within the same tolerance; layer-wise rates
    # give the optimizer a group per depth, which the sharded resume must load
    # wsd: stable.pt's shards must outlive later saves
    run_train(one, data_dir, *SAME, '--layer_lr_decay=0.5', '--lr_schedule=wsd')
    # this run alone smoke-tests first (smoke.py): sharded too, the run after it is the run
    # without it
    # the EMA of the weights, sharded too, changes no training loss; shards written in the
    # background (DCP's async_save: a torch.save per tensor, each delayed) while steps go on
    ok(torchrun(fsdp, data_dir, *SAME, '--layer_lr_decay=0.5', '--parallel=fsdp', '--ema_decay=0.8',
                '--lr_schedule=wsd', '--keep_checkpoints=2', '--smoke_steps=30',
                '--async_save=True', probe=True, env_extra={'PROBE_SAVE_DELAY': '0.005'}))
    for (s1, l1, lr1, g1), (s2, l2, lr2, g2) in zip(trajectory(one), trajectory(fsdp), strict=True):
        assert s1 == s2 and lr1 == lr2 and abs(l1 - l2) <= RTOL * l1 and abs(g1 - g2) <= RTOL * g1
    # older shards cleaned up, but those stable.pt (the stable phase's end, 26) and the two kept
    # checkpoints name
    stable = torch.load(os.path.join(fsdp, 'stable.pt'), weights_only=True)['shards']
    folders = sorted(f for f in os.listdir(fsdp) if f.startswith('shards-'))
    assert folders == ['shards-20', 'shards-26', 'shards-30'] and stable == 'shards-26'
    assert sorted(f for f in os.listdir(fsdp) if f.startswith('ckpt-')) == ['ckpt-000020.pt',
                                                                            'ckpt-000030.pt']
    # its shards of 20, written while steps went on, replay it; in its own out_dir, whose files of
    # 26 and 30 move aside at its start with their shards (checkpoint.branch; the logs are cut back
    # to 20 and go on)
    straight = trajectory(fsdp)
    ok(torchrun(fsdp, data_dir, *SAME, '--layer_lr_decay=0.5', '--parallel=fsdp', '--ema_decay=0.8',
                '--lr_schedule=wsd', '--keep_checkpoints=2', '--async_save=True',
                '--init_from=resume', f"--resume_from={os.path.join(fsdp, 'ckpt-000020.pt')}"))
    assert trajectory(fsdp) == straight
    assert sorted(f for f in os.listdir(fsdp) if f.startswith('shards-')) == [
        'shards-20', 'shards-26', 'shards-30']
    assert sorted(os.listdir(os.path.join(fsdp, 'replaced-000020'))) == [
        'best.pt', 'ckpt-000030.pt', 'last.pt', 'shards-26', 'shards-30', 'stable.pt']
    # stop at 14 (after sharded checkpoints at 10 and 14, written in the background) and resume
    # from the shards, the second part with activation checkpointing on: bitwise the uninterrupted
    # run, so neither the resume nor recomputation changes a loss; the EMA's val losses neither
    decayed = [*SAME, '--layer_lr_decay=0.5', '--parallel=fsdp', '--ema_decay=0.8',
               '--lr_schedule=wsd']
    ok(torchrun(split, data_dir, *decayed, '--max_iters=14', '--async_save=True', probe=True,
                env_extra={'PROBE_SAVE_DELAY': '0.005'}))
    ok(torchrun(split, data_dir, *decayed, '--init_from=resume', '--activation_checkpointing=True'))
    assert trajectory(split) == trajectory(fsdp)
    evals = lambda d: [(e['step'], e['val_loss'], e['ema_val_loss'])
                       for e in read_metrics(d, 'eval') if e['step'] % 10 == 0]
    assert evals(split) == evals(fsdp) and all(e[1] != e[2] for e in evals(fsdp))
    # in one process, from the shards of 20: the same run within rounding, and DCP's load without a
    # process group (what it warns about) is meant
    onward = str(tmp_path / 'onward')
    result = run_train(onward, data_dir, *decayed, '--init_from=resume',
                       f"--resume_from={os.path.join(fsdp, 'ckpt-000020.pt')}")
    for (s1, l1, lr1, g1), (s2, l2, lr2, g2) in zip(trajectory(onward), straight[20:], strict=True):
        assert s1 == s2 and lr1 == lr2 and abs(l1 - l2) <= RTOL * l1 and abs(g1 - g2) <= RTOL * g1
    assert 'torch.distributed is disabled' not in result.stderr, result.stderr


def test_fsdp_ema_updates_its_shards_after_an_evaluation_that_saves_nothing(tmp_path, data_dir):
    # learning_rate 0: no evaluation after the first is better, so none saves (a save would reshard
    # the EMA's weights that its evaluation gathered); a task scored on the EMA's weights is its
    # last forward there
    out = str(tmp_path / 'fsdp')
    result = ok(torchrun(out, data_dir, *SAME, '--parallel=fsdp', '--ema_decay=0.8',
                         '--learning_rate=0', '--always_save_checkpoint=False', '--max_iters=4',
                         '--lr_decay_iters=4', '--warmup_iters=1', '--eval_interval=1',
                         f"--eval_tasks={toy_task(tmp_path / 'toy_task.jsonl')}",
                         '--write_report=True'))
    evals = read_metrics(out, 'eval')
    assert [e['step'] for e in evals] == [1, 2, 3, 4] and all(e['toy_task/examples'] == 13
                                                             for e in evals)
    # the EMA's accuracy, said to be: it stood unnamed beside the trained weights' val loss
    assert ', EMA toy_task acc_norm ' in result.stdout
    assert "- toy_task (the EMA's weights): acc " in open(os.path.join(out, 'report.md')).read()


def test_a_resume_on_one_process_removes_the_shards_no_checkpoint_names(tmp_path, data_dir):
    out = str(tmp_path / 'fsdp')
    args = [*SAME, '--parallel=fsdp', '--keep_checkpoints=1', '--always_save_checkpoint=False']
    ok(torchrun(out, data_dir, *args, '--max_iters=20'))
    assert sorted(f for f in os.listdir(out) if f.startswith('shards-')) == ['shards-20']
    # a shard damaged in place, its size kept: one line, not DCP's traceback
    damaged = str(tmp_path / 'damaged')
    shutil.copytree(out, damaged)
    shard = os.path.join(damaged, 'shards-20', '__0_0.distcp')
    with open(shard, 'r+b') as f:
        f.write(bytes(os.path.getsize(shard)))
    result = run_train(damaged, data_dir, *args, '--init_from=resume', check=False)
    assert result.returncode == 2 and result.stderr.startswith(
        f"error: {damaged}/last.pt keeps its weights in {damaged}/shards-20, which cannot be "
        f"read (UnpicklingError: "), result.stderr
    assert result.stderr.count('\n') == 1
    # one process writes its state into the files: best.pt, last.pt and the kept checkpoint of 30
    # name no folder, and the run's last write removes shards-20
    run_train(out, data_dir, *args, '--init_from=resume')
    assert torch.load(os.path.join(out, 'best.pt'), weights_only=True)['iter_num'] == 30
    assert not [f for f in os.listdir(out) if f.startswith('shards-')]
    # such a whole state is not DCP's shards: on several processes again, one line, not a traceback
    # from every rank's load_state_dict into sharded parameters
    result = torchrun(out, data_dir, *args, '--init_from=resume', '--max_iters=40', timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
    assert (result.returncode != 0 and len(errors) == 1
            and 'holds the whole state, as one process writes it' in errors[0]), result.stderr
    assert not re.search(r'(train|checkpoint|preflight)\.py", line', result.stderr)


def test_exported_state_dict_gives_the_runs_own_val_loss(tmp_path, data_dir):
    out = str(tmp_path / 'fsdp')
    # with an EMA, sample.py gathers the EMA's shards: the raw weights' are gathered in test_ddp.py
    ok(torchrun(out, data_dir, *SAME, '--parallel=fsdp', '--max_iters=10', '--lr_decay_iters=10',
                '--ema_decay=0.8'))
    exported = str(tmp_path / 'plain.pt')
    result = forked.run('sample.py', f'--ckpt={out}/last.pt', f'--export={exported}')
    assert result.returncode == 0 and 'is disabled' not in result.stderr, result.stderr
    sampled = forked.run('sample.py', f'--ckpt={exported}', '--num_samples=1', '--max_new_tokens=5')
    # the exported file is a checkpoint sample.py reads
    assert sampled.returncode == 0, sampled.stderr
    ckpt = torch.load(exported, weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.eval()
    cfg = ckpt['config']
    val = data.TokenWindows(datafiles.open_dataset(data_dir, 'toy')[1]['val'], cfg['block_size'])
    sampler = data.EvalSampler(val.num_tokens, cfg['block_size'], cfg['batch_size'],
                               cfg['eval_iters'] * cfg['batch_size'])
    loss_sum, count = 0.0, 0
    with torch.inference_mode():
        for batch in sampler:
            x, y, _ = torch.utils.data.default_collate([val[s] for s in batch])
            loss_sum += F.cross_entropy(model(x).view(-1, ckpt['model_args']['vocab_size']),
                                        y.view(-1), reduction='sum').item()
            count += (y != data.IGNORE_INDEX).sum().item()
    # recomputed with a plain GPT: the same windows, the same sums
    assert abs(loss_sum / count - read_metrics(out, 'eval')[-1]['ema_val_loss']) < 1e-5
    # last.pt copied without its shards folder, or with a shard cut short: one line each, from
    # sample.py as from a resume, before anything is built
    alone, cut = str(tmp_path / 'alone'), str(tmp_path / 'cut')
    os.makedirs(alone)
    shutil.copy(os.path.join(out, 'last.pt'), alone)
    shutil.copytree(out, cut)
    shards = os.path.join(cut, torch.load(f'{cut}/last.pt', weights_only=True)['shards'])
    shard = os.path.join(shards, sorted(f for f in os.listdir(shards) if f.endswith('.distcp'))[0])
    os.truncate(shard, os.path.getsize(shard) // 2)
    for run, why in ((alone, 'No such file'), (cut, 'is cut short')):
        for result in (forked.run('sample.py', f'--ckpt={run}/last.pt'),
                       run_train(run, data_dir, *SAME, '--parallel=fsdp', '--ema_decay=0.8',
                                 '--init_from=resume', check=False)):
            assert result.returncode == 2 and result.stderr.startswith(
                f"error: {run}/last.pt keeps its weights in {run}/shards-"), result.stderr
            assert why in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


def test_activation_checkpointing_recomputes_every_block_and_changes_no_loss(tmp_path, data_dir):
    # a dtype given: 'auto' on a CPU with bfloat16 units times forwards of its own, which the probe
    # would count
    args = ['--dropout=0.1', '--max_iters=10', '--lr_decay_iters=10', '--eval_interval=10',
            '--dtype=float32']
    runs = {'plain': [], 'checkpointed': ['--activation_checkpointing=True']}
    for name, extra in runs.items():  # tests/probe.py counts attention calls, one per block forward
        os.makedirs(tmp_path / name)
        run_train(str(tmp_path / name / 'run'), data_dir, *args, *extra, probe=True,
                  env={**os.environ, 'PROBE_ATTENTION': str(tmp_path / name)})
    calls = {name: json.load(open(tmp_path / name / 'attention.0')) for name in runs}
    # 2 blocks x 10 micro-batches: each block's forward runs again inside the backward, and only
    # when checkpointing
    assert calls == {'plain': {'forward': 20, 'backward': 0},
                     'checkpointed': {'forward': 20, 'backward': 20}}
    # dropout on: the recomputation replays the same masks
    assert (trajectory(str(tmp_path / 'checkpointed' / 'run'))
            == trajectory(str(tmp_path / 'plain' / 'run')))


def test_fsdp_refuses_float16_and_muon_before_writing_anything(tmp_path, data_dir):
    # float16 asked, or chosen by dtype='auto' (as on a GPU before compute capability 8.0)
    for args, message in ((['--dtype=auto'],
                           "error: parallel='fsdp' trains in float32 or bfloat16, not float16"),
                          (['--optimizer=muon'],
                           "error: optimizer='muon' does not work with parallel='fsdp'")):
        result = torchrun(str(tmp_path / 'never'), data_dir, '--parallel=fsdp',
                          '--gradient_accumulation_steps=2', *args, timeout=120,
                          env_extra={'HONESTGPT_AUTO_DTYPE': 'float16'})
        assert result.returncode != 0 and message in result.stderr, result.stderr
        # said once, not once per rank (torchrun's summary repeats it, last)
        assert sum(line.startswith(message) for line in result.stderr.splitlines()) == 1
        assert not (tmp_path / 'never').exists()
