"""Distributed data parallel on CPU (gloo, 2 processes; one process on each device present): the
same run as one process, and no hangs."""
import json
import os
import re
import shlex
import socket

import pytest
import torch

import data
import forked
import sample
from conftest import (DEVICES, REPO, RUN_CONFIG, ok, read_metrics, run_train, torchrun,
                      torchrun_script)
from test_recipe import RECIPE

pytestmark = pytest.mark.slow  # training runs in subprocesses: the 'not slow' tier skips them

# dropout 0 so one process and two ranks compute the same function; 4 micro-batches per step in
# total
SAME = ['--gradient_accumulation_steps=4', '--max_iters=30', '--lr_decay_iters=30',
        '--eval_interval=10', '--dtype=float32']
# Tolerance: two ranks sum gradients in another order than one process (all-reduce of per-rank
# sums), so float32 results differ by rounding only: ~1e-7 relative per operation, compounded
# through 30 Adam steps on a 30k-parameter model; 1e-4 relative is far above that and far below any
# real divergence (one wrong or missing micro-batch changes losses at the 1e-2 level).
RTOL = 1e-4


def close(a, b):
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


def assert_same_run(one, two):
    steps1, steps2 = read_metrics(one, 'train'), read_metrics(two, 'train')
    assert [s['step'] for s in steps1] == [s['step'] for s in steps2] == list(range(1, 31))
    for s1, s2 in zip(steps1, steps2):
        assert (s1['lr'] == s2['lr'] and close(s1['loss'], s2['loss'])
                and close(s1['grad_norm'], s2['grad_norm'])), (s1, s2)
    evals1, evals2 = read_metrics(one, 'eval'), read_metrics(two, 'eval')
    assert [e['step'] for e in evals1] == [e['step'] for e in evals2]
    assert all(close(e1['val_loss'], e2['val_loss']) for e1, e2 in zip(evals1, evals2))
    # an fsdp run's last.pt names its shards: sample.py's loader gathers them
    p1, p2 = (sample.load_model(os.path.join(run, 'last.pt'), 'cpu')[0].state_dict()
              for run in (one, two))
    assert all(torch.allclose(p1[k], p2[k], rtol=RTOL, atol=1e-6) for k in p1)


# the recipe's model and schedule with AdamW; Muon under DDP: test_recipe.py
@pytest.mark.parametrize('recipe', [[], [*RECIPE, '--optimizer=adamw']], ids=['nanogpt', 'recipe'])
def test_two_ranks_equal_one_process_and_skip_sync_between_boundaries(tmp_path, data_dir, recipe):
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    run_train(one, data_dir, *SAME, *recipe)
    result = ok(torchrun(two, data_dir, *SAME, *recipe, probe=True,
                         env_extra={'PROBE_COUNT': str(tmp_path)}))
    assert '4 x 8 x 32' in result.stdout  # tokens per step printed, global accumulation kept
    assert 'Warning' not in result.stderr  # none per rank: DDP's broadcast_buffers is deprecated
    assert_same_run(one, two)
    # 2 micro-batches per rank per step, 1 bucket (a 30k-parameter model): one gradient all-reduce
    # per optimizer step, none on the non-boundary micro-batch
    counts = [int(open(tmp_path / f'allreduce.{r}').read()) for r in range(2)]
    assert counts == [30, 30]
    # and no buffer broadcast in any forward: rope's tables are buffers, the same on every rank
    assert [open(tmp_path / f'buffers.{r}').read() for r in range(2)] == ['False', 'False']


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('parallel', ['ddp', 'fsdp'])
def test_one_process_under_torchrun_is_the_run_without_it(tmp_path, data_dir, parallel, device):
    """torchrun --nproc_per_node=1, as on a one-GPU machine: the group on nccl (a GPU) or gloo (a
    CPU), the model in DDP's or FSDP's wrapper, and the same run as one process without torchrun."""
    one, under = str(tmp_path / 'one'), str(tmp_path / 'torchrun')
    # deterministic on a GPU: its kernels' atomic adds would make even two identical runs differ
    args = [*SAME, f'--parallel={parallel}', f'--device={device}',
            f'--deterministic={device == "cuda"}']
    run_train(one, data_dir, *args)
    ok(torchrun(under, data_dir, *args, nproc=1, probe=True,
                env_extra={'PROBE_COUNT': str(tmp_path)}))
    assert_same_run(one, under)
    meta = json.load(open(os.path.join(under, 'meta.json')))
    assert meta['world_size'] == 1 and meta['backend'] == ('nccl' if device == 'cuda' else 'gloo')
    assert meta['device'] == ('cuda:0' if device == 'cuda' else 'cpu')
    assert json.load(open(os.path.join(one, 'meta.json')))['backend'] is None
    # the wrapper was there: DDP's gradient all-reduce once per step, FSDP's shards in the
    # checkpoint
    if parallel == 'ddp':
        assert open(tmp_path / 'allreduce.0').read() == '30'
    else:
        assert 'shards' in torch.load(os.path.join(under, 'last.pt'), weights_only=True)


def test_overfit_one_batch_on_two_ranks_is_one_processs_run(tmp_path, data_dir):
    # each rank took its own first micro-batch: two ranks trained on other windows than one process
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    args = [*SAME, '--overfit_one_batch=True', '--max_iters=3', '--eval_interval=3']
    run_train(one, data_dir, *args)
    ok(torchrun(two, data_dir, *args))
    steps1, steps2 = read_metrics(one, 'train'), read_metrics(two, 'train')
    assert len(steps1) == len(steps2) == 3
    assert all(close(s1['loss'], s2['loss']) for s1, s2 in zip(steps1, steps2)), (steps1, steps2)


def test_two_nodes_on_loopback(tmp_path, data_dir):
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    run_train(one, data_dir, *SAME)
    nodes = []
    for node_rank in range(2):
        args = ['--nnodes=2', f'--node_rank={node_rank}', '--rdzv_backend=c10d',
                f'--rdzv_endpoint=127.0.0.1:{port}',
                '--rdzv_id=loopback', '--master_addr=127.0.0.1', f'--master_port={port}']
        nodes.append(forked.Process('-m', 'torch.distributed.run', *args, '--nproc_per_node=1',
                                    'train.py', RUN_CONFIG, f'--data_dir={data_dir}',
                                    f'--out_dir={two}', *SAME))
    outputs = [''.join(p.communicate(timeout=300)) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), outputs
    assert_same_run(one, two)


def test_ddp_elastic_restart_resumes_exactly(tmp_path, data_dir):
    # dropout: each rank's RNG state must travel
    args = [*SAME, '--dropout=0.1', '--num_workers=1', '--init_from=auto', '--ema_decay=0.9']
    straight, elastic = str(tmp_path / 'straight'), str(tmp_path / 'elastic')
    # the straight run alone smoke-tests first (smoke.py): on 2 ranks too, the run after it is the
    # run without it
    ok(torchrun(straight, data_dir, *args, '--smoke_steps=10'))
    fields = lambda d: [(r['step'], r['loss'], r['lr'], r['grad_norm'])
                        for r in read_metrics(d, 'train')]
    # rank 1 dies at its 50th micro-batch (iteration 25), after the checkpoint at 20; torchrun
    # restarts the group, which resumes with init_from=auto (a resume between evaluations on 2
    # ranks: test_interrupt's SIGTERM test)
    result = ok(torchrun(elastic, data_dir, *args, probe=True, env_extra={'PROBE_KILL': '1:50'},
                         torchrun_args=['--standalone', '--max-restarts=1']))
    assert 'resuming from' in result.stdout
    # rank 0, left in the collective, says so in one line instead of gloo's traceback
    assert ('error: rank 0 lost another rank at iteration 25 (' in result.stderr
            and 'Traceback' not in result.stderr), result.stderr
    assert fields(elastic) == fields(straight)
    a, b = (torch.load(os.path.join(d, 'last.pt'), weights_only=True) for d in (straight, elastic))
    assert all(torch.equal(a['ema'][k], b['ema'][k]) for k in a['ema'])  # its weights and count
    # seed + rank: the ranks' dropout masks differ (seeded alike, both runs above would agree)
    assert a['rng'][0]['torch'] != a['rng'][1]['torch']


def test_nan_on_one_rank_ends_both_promptly(tmp_path, data_dir):
    out = str(tmp_path / 'nan')
    # a rank left waiting in a collective would wait for gloo's timeout (30 minutes): torchrun's
    # timeout fails the test
    result = torchrun(out, data_dir, *SAME, probe=True, env_extra={'PROBE_NAN': '1:13'},
                      timeout=300)
    assert result.returncode != 0
    assert 'SIGABRT' not in result.stderr  # both ranks exit with 1, neither aborts at exit
    # rank 1's 13th micro-batch is in step 7
    assert 'non-finite loss at iteration 7' in result.stderr
    # rank 0's record: the loss summed over the ranks (else rank 0 saw only the gradient's norm)
    [abort] = read_metrics(out, 'abort')
    assert abort['step'] == 7 and abort['message'].startswith('non-finite loss at iteration 7')
    # the windows of rank 1's micro-batches 13 and 14, which made it (rank 0's were named)
    with open(os.path.join(data_dir, 'toy', 'meta.json')) as f:
        train_tokens = json.load(f)['splits']['train']['tokens']
    rank_1 = iter(data.TrainSampler(train_tokens, 32, 8, 32, 1337, rank=1, world_size=2))
    windows = [w for _, batch in zip(range(14), rank_1) for w in batch][-16:]
    assert f"batch windows (start positions in the train split) {windows};" in abort['message']


def test_a_rank_lost_in_an_evaluation_is_named_with_its_iteration(tmp_path, data_dir):
    # rank 1 dies in the evaluation at 20, or in eval_only's of the checkpoint at 10: rank 0 said
    # iteration 21, 11
    out = str(tmp_path / 'run')
    ok(torchrun(out, data_dir, *SAME, '--max_iters=10'))
    for more, iteration in ((['--max_iters=20'], 20), (['--eval_only=True'], 10)):
        result = torchrun(out, data_dir, *SAME, '--init_from=resume', *more, probe=True,
                          env_extra={'PROBE_KILL_EVAL': '1'}, timeout=300)
        assert result.returncode != 0
        assert f'error: rank 0 lost another rank at iteration {iteration} (' in result.stderr, \
            result.stderr


def test_readme_s_multi_process_command_runs_as_written(tmp_path, data_dir):
    """README's first torchrun command, with only the data, out_dir and length made test-sized."""
    readme = open(os.path.join(REPO, 'README.md')).read()
    command = next(line for line in readme.splitlines()
                   if line.startswith('    torchrun --standalone'))
    launcher, options, script = shlex.split(command), [], []
    for arg in launcher[1:]:
        (script if script or arg.endswith('.py') else options).append(arg)
    out = str(tmp_path / 'run')
    nproc = int(options.pop().removeprefix('--nproc_per_node='))
    result = ok(torchrun_script(*script, f'--data_dir={data_dir}', '--dataset=toy',
                                f'--out_dir={out}', '--max_iters=2', '--eval_interval=2',
                                '--eval_iters=1', '--sample_tokens=0', nproc=nproc,
                                torchrun_args=options))
    # README: a step still sees config/tiny.py's 16 windows of 128 tokens
    assert '2,048 tokens per iteration (2 x 8 x 128)' in result.stdout
    assert json.load(open(os.path.join(out, 'meta.json')))['world_size'] == 2
    assert [r['step'] for r in read_metrics(out, 'eval')] == [2]


def test_bad_config_ends_every_rank(tmp_path, data_dir):
    for args, message in ((['--batch_sise=4'], "unknown config key 'batch_sise'"),
                          (['--gradient_accumulation_steps=3'],
                           'not divisible by the 2 processes')):
        result = torchrun(str(tmp_path / 'bad'), data_dir, *args, timeout=120)
        lines = result.stderr.splitlines()
        # said once, by rank 0; then by torchrun's summary, its last lines, below its own traceback
        assert result.returncode != 0 and sum(line.startswith('error: ') for line in lines) == 1
        assert message in lines[-2] and 'traceback : error: ' in lines[-2], result.stderr
        assert not (tmp_path / 'bad').exists()


def test_a_failed_smoke_test_ends_every_rank_at_once(tmp_path, data_dir):
    # rank 1 waits for torchrun's SIGTERM, which the stop-signal handler took for a stop to save
    # at: torchrun waited 30 s, then killed it
    result = torchrun(str(tmp_path / 'run'), data_dir, '--gradient_accumulation_steps=2',
                      '--smoke_steps=5', '--learning_rate=1e-7', '--min_lr=1e-8', timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
    assert result.returncode != 0 and len(errors) == 1 and 'smoke test' in errors[0], result.stderr
    assert 'forcefully exiting' not in result.stderr, result.stderr


def test_a_fit_batch_resume_that_processes_cannot_share_is_refused(tmp_path, data_dir):
    # what a run found comes back on resume: one micro-batch of 16 a step, which 2 processes cannot
    # share (its count, rounded down, was 0 a rank: steps of no data, loss 0)
    out = str(tmp_path / 'run')
    fit = ['--fit_batch=True', '--max_iters=2', '--eval_interval=2']
    run_train(out, data_dir, *fit, '--batch_size=16', '--gradient_accumulation_steps=1')
    result = torchrun(out, data_dir, *fit, '--batch_size=8', '--gradient_accumulation_steps=2',
                      '--init_from=resume', '--max_iters=4', timeout=120)
    assert result.returncode != 0 and ("run found micro-batches of 16, 1 a step (fit_batch), which "
                                       "2 processes cannot share") in result.stderr, result.stderr
    assert [r['step'] for r in read_metrics(out, 'train')] == [1, 2]


@pytest.mark.parametrize('rank', [0, 1])
def test_a_rank_without_the_data_ends_every_rank_in_one_line(tmp_path, data_dir, rank):
    # rank 0 fails hashing (the first of its node), rank 1 after: neither may leave the other in a
    # collective, which then failed with a traceback of gloo's
    result = torchrun(str(tmp_path / 'run'), data_dir, '--gradient_accumulation_steps=2',
                      probe=True, env_extra={'PROBE_HIDE_DATA': str(rank)}, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
    assert result.returncode != 0 and len(errors) == 2, result.stderr
    assert sorted(line[:50] for line in errors) == sorted([
        f"error: rank {rank}: dataset 'toy' has no {data_dir}"[:50],
        f"error: rank {1 - rank}: rank {rank} cannot open the data: dataset 'toy'"[:50]])
    assert not re.search(r'(train|data|preflight|distributed)\.py", line', result.stderr)
    assert not (tmp_path / 'run').exists()


def test_resume_on_another_number_of_processes_continues_the_data(tmp_path, data_dir):
    # 1 process to 10, 2 ranks to 20, 1 process to 30: the same windows per step as the run that was
    # never stopped, so the same losses up to the summation order (RTOL); a step that took other
    # windows moves them by 1e-2
    one, mixed = str(tmp_path / 'one'), str(tmp_path / 'mixed')
    run_train(one, data_dir, *SAME)
    run_train(mixed, data_dir, *SAME, '--max_iters=10')
    result = ok(torchrun(mixed, data_dir, *SAME, '--max_iters=20', '--init_from=resume'))
    # new dropout streams: said
    assert 'the checkpoint was written by 1 process(es)' in result.stdout
    run_train(mixed, data_dir, *SAME, '--init_from=resume')
    assert_same_run(one, mixed)
