"""bench.py run as users run it on the toy dataset, its JSON figures checked against each other and
against the model's shapes; the reference mode against a fake nanoGPT; perf's peaks."""
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import perf
import forked
from conftest import DEVICES, REPO, RUN_CONFIG, gpt2_shards, read_metrics, run_train
from model import GPT, GPTConfig

QUICK = ['--rounds=1', '--dtype=float32']
QUICK_STEPS = ['--bench_iters=5', '--bench_warmup=2']  # the step timing's (whole runs: their own)


def run_bench(tmp_path, data_dir, *overrides, env=None, whole=False):
    """bench.py on tests/run_config.py; its JSON report."""
    report = tmp_path / 'bench.json'
    cmd = [sys.executable, 'bench.py', RUN_CONFIG, f'--data_dir={data_dir}', *QUICK,
           *(['--whole=True'] if whole else QUICK_STEPS), f'--json={report}', *overrides]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, (f"bench.py failed ({result.returncode}):\n{result.stdout}\n"
                                    f"{result.stderr}")
    assert f"all figures: {report}" in result.stdout
    report = json.loads(report.read_text())
    for r in range(1, report['rounds'] + 1):  # a line as each run ends, not only at the end
        assert all(f"round {r}/{report['rounds']}, {name}: " in result.stdout
                   for name in report['settings'])
    return report


def toy_params(data_dir):
    """The parameters of the GPT that train.py builds from tests/run_config.py on the toy data (tied
    head once)."""
    run_config = {}
    exec(open(RUN_CONFIG).read(), run_config)
    shape = {k: run_config[k] for k in ('n_layer', 'n_head', 'n_embd', 'block_size')}
    vocab_size = json.load(open(os.path.join(data_dir, 'toy', 'meta.json')))['vocab_size']
    model = GPT(GPTConfig(**shape, bias=False, vocab_size=vocab_size))  # bias: train.py's default
    return model, list(model.parameters())


def check_setting(s, iters, tokens_per_iter, flops_per_token):
    """One setting's figures agree with its per-iteration times and with each other."""
    seconds = [t for run in s['runs'] for t in run['seconds']]
    assert len(seconds) == iters * len(s['runs']) and all(t > 0 for t in seconds)
    assert s['ms_per_iter'] == pytest.approx(statistics.median(seconds) * 1e3)
    assert s['tokens_per_sec'] == pytest.approx(s['tokens_per_iter'] / statistics.median(seconds))
    assert s['tokens_per_iter'] == tokens_per_iter
    assert s['flops_per_token'] == pytest.approx(flops_per_token)
    assert s['achieved_flops'] == pytest.approx(flops_per_token * s['tokens_per_sec'])
    assert s['peak_flops'] > 0 and s['dtype'] == 'float32'
    # measured here, or a GPU's datasheet
    assert s['peak_how'].startswith('measured: ') or s['device'].startswith('cuda')
    assert s['mfu'] == pytest.approx(s['achieved_flops'] / (s['peak_flops'] * s['world_size']))
    for run in s['runs']:  # the whole process holds every iteration, the warm-up's included
        assert run['wall_seconds'] > run['first_seconds'] + sum(run['seconds'])


@pytest.mark.slow
@pytest.mark.parametrize('device', DEVICES)
def test_bench_compares_two_settings_with_speed_mfu_memory_and_profile(tmp_path, data_dir, device):
    # B trains the same model on the same batches, loaded in a worker process: the same losses,
    # another speed (deterministic on a GPU, whose atomic adds would make even two identical runs
    # differ)
    report = run_bench(tmp_path, data_dir, '--compare=--num_workers=1',
                       f"--trace={tmp_path / 'iteration.json'}", f'--device={device}',
                       f'--deterministic={device == "cuda"}')
    a, b = report['settings']['A'], report['settings']['B']
    assert a['device'] == b['device'] == ('cuda:0' if device == 'cuda' else 'cpu')
    model, params = toy_params(data_dir)
    for s in (a, b):
        # batch_size x block_size of run_config
        check_setting(s, 5, 8 * 32, model.flops_per_token())
    # + profiled
    assert (a['runs'][0]['losses'] == b['runs'][0]['losses']
            and len(a['runs'][0]['losses']) == 2 + 5 + 1)
    assert report['ratio']['of'] == 'B/A'
    assert report['ratio']['tokens_per_sec'] == pytest.approx(b['tokens_per_sec']
                                                              / a['tokens_per_sec'])
    # what the one process holds after its first step: float32 weights and grads, AdamW's two
    # moments and a step count per tensor
    replica = sum(p.numel() for p in params) * 4 / 2**20
    held = a['memory_ranks'][0]
    assert (held['weights_mb'], held['grads_mb']) == pytest.approx((replica, replica))
    assert held['optimizer_mb'] == pytest.approx(2 * replica + 4 * len(params) / 2**20)
    # a CPU's peak is the whole process's (at least Python and torch), a GPU's the allocator's
    assert held['peak_mb'] > (100 if device == 'cpu' else 3 * replica)
    for name in ('A', 'B'):
        profile = report['profile'][name]
        ms = profile['ms']  # a GPU's: the time of the kernels each phase launched
        assert all(ms[phase] > 0 for phase in ('forward', 'backward', 'optimizer'))
        assert ms['data'] > 0 or device == 'cuda'  # a GPU's: the batch's copy, if anything
        assert ms['other'] >= 0  # the phases' spans do not overlap
        assert sum(ms.values()) == pytest.approx(profile['iteration_ms'])
        events = {e.get('name', '')
                  for e in json.load(open(tmp_path / f'iteration_{name}.json'))['traceEvents']}
        assert {'data', 'forward', 'backward', 'optimizer', 'Optimizer.step#AdamW.step'} <= events
        assert any(e.startswith('autograd::engine::evaluate_function') for e in events)
        with open(os.path.join(report['settings'][name]['runs'][0]['out_dir'], 'train.log')) as f:
            said = [line for line in f if line.startswith('profiled iteration 8: data ')]
        assert len(said) == 1 and said[0].rstrip().endswith('trace.json'), said


FAKE_NANOGPT = '''
import time
# nanoGPT's log lines; the first two iterations are slow, as compilation and warm-up make them
print("tokens per iteration will be: 512")
for it, ms in enumerate([100, 100, 20, 30, 25, 35, 20]):
    time.sleep(ms / 1e3)
    print(f"iter {it}: loss {4.2 - it / 10:.4f}, time {ms:.2f}ms, mfu -100.00%")
'''


@pytest.mark.slow
def test_bench_against_a_reference_command_in_rounds(tmp_path, data_dir):
    fake = tmp_path / 'fake_nanogpt.py'
    fake.write_text(FAKE_NANOGPT)
    report = run_bench(tmp_path, data_dir, f'--reference={sys.executable} {fake}',
                       '--reference_tokens_per_iter=512', '--rounds=2', '--profile=False')
    ours, ref = report['settings']['A'], report['settings']['reference']
    model, _ = toy_params(data_dir)
    check_setting(ours, 5, 8 * 32, model.flops_per_token())
    assert len(ref['runs']) == 2 and all(run['iters'] == 7 for run in ref['runs'])
    # warm-up dropped
    assert ([run['seconds'] for run in ref['runs']]
            == [pytest.approx([0.020, 0.030, 0.025, 0.035, 0.020])] * 2)
    assert ref['ms_per_iter'] == pytest.approx(25) and ref['first_seconds'] == pytest.approx(0.1)
    assert ref['tokens_per_sec'] == pytest.approx(512 / 0.025)
    assert all(run['wall_seconds'] >= 0.33 for run in ref['runs'])  # it slept that long
    ratio = report['ratio']
    assert (ratio['of'] == 'A/reference'
            and ratio['tokens_per_sec'] == pytest.approx(ours['tokens_per_sec'] / (512 / 0.025)))
    assert ratio['rounds'] == pytest.approx([tokens / (512 / 0.025)
                                             for tokens in ours['round_tokens_per_sec']])


FAKE_NANOGPT_EVALS = '''
import time
# nanoGPT's evaluation lines, unflushed as nanoGPT's are: bench.py's runs print as they go
print("step 0: train loss 4.1000, val loss 4.2000")
time.sleep(1.0)
print("step 10: train loss 2.9000, val loss 3.0000")
'''


@pytest.mark.slow
def test_bench_whole_runs_time_the_process_and_the_val_loss_against_a_reference(tmp_path, data_dir):
    fake = tmp_path / 'fake_nanogpt.py'
    fake.write_text(FAKE_NANOGPT_EVALS)
    # without PYTHONUNBUFFERED from here: bench.py sets it for the runs it times
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONUNBUFFERED'}
    whole = ['--target=3.5', f'--reference={sys.executable} {fake}', '--max_iters=6',
             '--eval_interval=3', '--eval_iters=2', '--lr_decay_iters=6']
    report = run_bench(tmp_path, data_dir, *whole, env=env, whole=True)
    ours, ref = report['settings']['A'], report['settings']['reference']
    for run in ours['runs']:  # its evaluations, as train.py recorded them, in order
        recorded = read_metrics(run['out_dir'], 'eval')
        assert [round(r['val_loss'], 4) for r in recorded] == [val for _, val in run['evals']]
        assert [r['step'] for r in recorded] == [3, 6]
        stamps = [t for t, _ in run['evals']]
        assert 0 < stamps[0] < stamps[1] < run['wall_seconds']
        reached = next((t for t, val in run['evals'] if val <= 3.5), None)
        assert run['target_seconds'] == reached
    for run in ref['runs']:  # each line stamped as it was printed: the second after the sleep
        assert [val for _, val in run['evals']] == [4.2, 3.0]
        first, second = (t for t, _ in run['evals'])
        assert first + 0.5 < run['target_seconds'] == second <= run['wall_seconds']
    assert ref['wall_seconds'] == statistics.median(run['wall_seconds'] for run in ref['runs'])
    assert report['wall_speed_ratios'] == pytest.approx(
        [b['wall_seconds'] / a['wall_seconds'] for a, b in zip(ours['runs'], ref['runs'])])
    # the runs' checkpoints gone: a big model's take gigabytes a round
    assert all(not list(Path(run['out_dir']).glob('*.pt')) for run in ours['runs'])
    # a mistake train.py finds after printing a line of its own: still its one line, exit code 2
    result = subprocess.run([sys.executable, 'bench.py', RUN_CONFIG, f'--data_dir={data_dir}',
                             '--whole=True', *whole, '--dtype=auto'],
                            cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, 'HONESTGPT_AUTO_DTYPE': 'f64'})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == "error: HONESTGPT_AUTO_DTYPE=f64: use float32, bfloat16 or float16\n"


@pytest.mark.slow
def test_bench_sample_mode_times_generate_with_and_without_the_cache(tmp_path, data_dir):
    # 40 new tokens from 1 at block_size 32: decoding, then a sliding window; greedy, so both give
    # the same tokens
    run = str(tmp_path / 'run')
    run_train(run, data_dir, '--max_iters=20', '--lr_decay_iters=20', '--pos_emb=rope')
    report, tmp = tmp_path / 'bench.json', tmp_path / 'tmp'
    tmp.mkdir()
    result = forked.run('bench.py', f'--sample={run}', '--new_tokens=40', '--rounds=2',
                        '--bench_warmup=2', f'--json={report}', timeout=120,
                        env={**os.environ, 'TMPDIR': str(tmp)})
    assert result.returncode == 0, result.stderr
    assert not os.listdir(tmp), 'an empty runs folder: json names where the figures go'
    no_run = forked.run('bench.py', f'--sample={tmp_path}', '--new_tokens=40')
    assert no_run.returncode == 2 and no_run.stderr == (f"error: sample={tmp_path}: no last.pt "
                                                        f"there: pass the out_dir of a train.py "
                                                        f"run\n")
    report = json.loads(report.read_text())['sample']
    model, _ = toy_params(data_dir)
    assert (report['model_args'] == {**vars(model.config), 'pos_emb': 'rope'}
            and report['new_tokens'] == 40)
    assert report['same_tokens'] is True and report['device'] == 'cpu'
    for name in ('cached', 'uncached'):
        s = report[name]
        assert len(s['seconds']) == 2 and all(t > 0 for t in s['seconds'])
        assert s['tokens_per_sec'] == pytest.approx(40 / statistics.median(s['seconds']))
        assert s['round_tokens_per_sec'] == pytest.approx([40 / t for t in s['seconds']])
    assert report['ratio'] == pytest.approx(report['cached']['tokens_per_sec']
                                            / report['uncached']['tokens_per_sec'])


def test_bench_mistakes_fail_in_one_line(tmp_path):
    # its own keys before any run; train.py's in train.py's words, from the first run
    for args, message in ((['--bench_itres=5'],
                           "unknown config key 'bench_itres': did you mean bench_iters"),
                          (['--batch_sise=4'],
                           "unknown config key 'batch_sise': did you mean batch_size"),
                          (['--compare=--compile=True', '--reference=true'],
                           "compare and reference are both set"),
                          (['--sample=out', '--loader=out'], "more than one of loader, sample and"),
                          (['--whole=True', '--loader=out'], "more than one of loader, sample and"),
                          (['--whole=True', '--nproc=2'], "whole runs train.py in one process"),
                          # each measured without them, silently
                          (['--target=1.886'],
                           "target is read by --whole=True only, not by the step timing"),
                          (['--whole=True', '--bench_iters=5'], "bench_iters is read by the step "
                           "timing and --loader=OUT_DIR only, not by --whole=True: drop it"),
                          (['--loader=out', '--compare=--compile=True'], "compare is read by the "
                           "step timing and --whole=True only, not by --loader=OUT_DIR"),
                          (['--reference_tokens_per_iter=8'],
                           "reference_tokens_per_iter is read only with a reference"),
                          (['--profile=False', f'--trace={tmp_path}/t.json'],
                           f"trace={tmp_path}/t.json writes the profile of one process"),
                          (['--sample=out', '--new_tokens=0'], "new_tokens=0 must be at least 1"),
                          (['--sample=out'],
                           "sample reads a run's out_dir and takes no train.py arguments"),
                          ([f"--json={tmp_path}/no/b.json"],
                           f"json={tmp_path}/no/b.json is a folder, or in one that does not exist"),
                          ([f'--trace={tmp_path}'], f"trace={tmp_path} is a folder"),
                          (["--compare='"], "compare=\"'\" cannot be split into arguments"),
                          # train.py's own refusal: init_from is passed on, not made 'scratch'
                          (['--init_from=nowhere'], "init_from='nowhere': use 'scratch'"),
                          # taken, and overridden by the bench's own
                          (['--max_iters=1000', '--compare=--eval_only=True'], "the step timing "
                           "sets eval_only, max_iters itself: drop them, or time the whole process "
                           "with --whole=True")):
        result = subprocess.run([sys.executable, 'bench.py', RUN_CONFIG, *args], cwd=REPO,
                                capture_output=True, text=True)
        assert (result.returncode == 2
                and 'round 1/' not in result.stdout), result.stdout + result.stderr
        assert result.stderr.startswith(f"error: {message}") and result.stderr.count('\n') == 1
    # found after the runs' folder was made: it goes too
    (tmp_path / 'damaged').mkdir()
    (tmp_path / 'damaged' / 'config.json').write_text('{')  # a traceback, and the folder stayed
    for run, message in (('none', "no config.json there (No such file or directory)"),
                         ('damaged', "damaged/config.json is not the config.json of a train.py "
                                     "run (JSONDecodeError: ")):
        result = subprocess.run([sys.executable, 'bench.py', f"--loader={tmp_path / run}"],
                                cwd=REPO, env={**os.environ, 'TMPDIR': str(tmp_path)},
                                capture_output=True, text=True)
        assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
        assert message in result.stderr
        assert not list(tmp_path.glob('bench-*'))


@pytest.mark.slow
def test_bench_under_torchrun_shows_fsdp_holding_a_shard_per_rank(tmp_path, data_dir):
    report = run_bench(tmp_path, data_dir, '--nproc=2', '--bench_iters=3', '--profile=False',
                       '--parallel=fsdp', '--gradient_accumulation_steps=2',
                       '--compare=--parallel=ddp', env={**os.environ, 'OMP_NUM_THREADS': '1'})
    fsdp, ddp = report['settings']['A'], report['settings']['B']
    assert fsdp['world_size'] == ddp['world_size'] == 2 and 'profile' not in report
    model, params = toy_params(data_dir)
    for s in (fsdp, ddp):
        check_setting(s, 3, 2 * 8 * 32, model.flops_per_token())
    # the same global batches: the same losses, up to the order of the reductions
    assert fsdp['runs'][0]['losses'] == pytest.approx(ddp['runs'][0]['losses'], rel=1e-4)
    # what each rank holds, from the model's shapes: a DDP replica is all of it, an FSDP rank its
    # dim-0 chunk
    replica = sum(p.numel() for p in params) * 4 / 2**20
    rows = lambda p, r: max(0, min(-(-p.size(0) // 2), p.size(0) - r * -(-p.size(0) // 2)))
    shard = [sum(rows(p, r) * p[0].numel() for p in params) * 4 / 2**20 for r in (0, 1)]
    step_counts = 4 * len(params) / 2**20  # AdamW's float32 step count per tensor, on every rank
    assert len(fsdp['memory_ranks']) == len(ddp['memory_ranks']) == 2
    for r in (0, 1):
        held_fsdp, held_ddp = fsdp['memory_ranks'][r], ddp['memory_ranks'][r]
        assert ((held_ddp['weights_mb'], held_ddp['grads_mb'], held_ddp['optimizer_mb'])
                == pytest.approx((replica, replica, 2 * replica + step_counts)))
        assert ((held_fsdp['weights_mb'], held_fsdp['grads_mb'], held_fsdp['optimizer_mb'])
                == pytest.approx((shard[r], shard[r], 2 * shard[r] + step_counts)))
        assert held_fsdp['peak_mb'] > 100 and held_ddp['peak_mb'] > 100  # at least Python and torch


def test_peak_flops_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv('HONESTGPT_CACHE', str(tmp_path))
    # random matrices (a GPU multiplies constant ones faster), not from the global RNG (dropout's)
    operands, best_seconds = [], perf.best_seconds

    def recording_best_seconds(a, b, budget):
        operands.append((a, b))
        return best_seconds(a, b, budget)
    monkeypatch.setattr(perf, 'best_seconds', recording_best_seconds)
    rng = torch.get_rng_state()
    announced = []  # preflight says why the run pauses, only when it does
    flops, how = perf.peak_flops('cpu', torch.float32, announce=lambda: announced.append(1))
    assert announced == [1] and flops > 1e7
    assert torch.equal(torch.get_rng_state(), rng)
    assert operands and all(x.std() > 0.5 and y.std() > 0.5 for x, y in operands)
    assert re.fullmatch(r'measured: (\d+)x\1 float32 matmul, the fastest of 3 layouts and sizes '
                        r'128 to \d+, at [-\d]+T[:\d]+[-+]\d+', how)
    # the next run on this machine reads the same figure: the same speed gives the same MFU
    assert (perf.peak_flops('cpu', torch.float32, announce=lambda: announced.append(2))
            == (flops, f"{how} (cached in {tmp_path / 'perf.json'})")) and announced == [1]


def test_a_peak_measured_on_a_busy_cpu_serves_its_run_only(tmp_path, monkeypatch):
    """Measured while other work held the CPUs, a peak reads low: cached, it made every later run's
    MFU too high until a step beat it. The next run measures again, and caches a quiet one."""
    monkeypatch.setenv('HONESTGPT_CACHE', str(tmp_path))
    announced = []
    for run in (1, 2):
        flops, how = perf.peak_flops('cpu', torch.float32, busy=True,
                                     announce=lambda: announced.append(run))
        assert how.endswith(' (not cached: other work kept the CPUs busy)') and flops > 1e7
    assert announced == [1, 2] and perf.read_cache(tmp_path / 'perf.json') == {}
    perf.peak_flops('cpu', torch.float32, announce=lambda: announced.append(3))
    assert announced == [1, 2, 3] and len(perf.read_cache(tmp_path / 'perf.json')) == 1


@pytest.mark.slow
def test_a_step_faster_than_the_cached_peak_has_it_measured_again(tmp_path, data_dir):
    """A peak measured while other work ran is too low, and was cached for good: MFU read 1301%. A
    step that beats it has it measured again (at least that step's FLOP/s), cached, and named in
    meta.json."""
    env = {**os.environ, 'HONESTGPT_CACHE': str(tmp_path / 'cache')}
    run_train(str(tmp_path / 'first'), data_dir, '--max_iters=1', '--eval_interval=1',
              '--dtype=float32', env=env)
    cache = tmp_path / 'cache' / 'perf.json'
    entries = json.loads(cache.read_text())
    (key,) = [k for k in entries if k.startswith('peak ')]
    entries[key]['flops'] = 1e3  # as if measured on a machine busy to a standstill
    cache.write_text(json.dumps(entries))
    out = str(tmp_path / 'run')
    result = run_train(out, data_dir, '--max_iters=6', '--eval_interval=6', '--dtype=float32',
                       env=env)
    assert all(0 < r['mfu'] <= 1 for r in read_metrics(out, 'train'))
    (peak,) = read_metrics(out, 'peak')
    assert peak['step'] == 1 and peak['flops'] > 1e7 and 'ran faster than the peak' in result.stdout
    assert json.loads(cache.read_text())[key]['flops'] == peak['flops']
    meta = json.load(open(os.path.join(out, 'meta.json')))
    assert meta['peak_flops'] == {'per_process': peak['flops'], 'how': peak['how']}
    assert re.search(r'3 layouts.*, at [-\d]+T', peak['how'])  # how and when


@pytest.mark.slow
@pytest.mark.parametrize('device', DEVICES)
def test_mfu_of_a_training_step_lies_between_0_and_100_percent(tmp_path, device):
    """MFU, the model's FLOP/s over the device's peak: past 100% one of them is wrong. GPT-2
    124M's shape on a GPU (against its datasheet peak, bfloat16), a small model with GPT-2's
    vocabulary on a CPU (against the peak measured here)."""
    gpt2_shards(str(tmp_path / 'data' / 'gpt2_tokens'), 200_000)
    if device == 'cuda':
        shape = ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024',
                 '--dtype=bfloat16']
    else:
        shape = ['--n_layer=2', '--n_head=2', '--n_embd=64', '--block_size=64', '--dtype=float32']
    out = str(tmp_path / 'run')
    run_train(out, str(tmp_path / 'data'), '--dataset=gpt2_tokens', *shape, '--batch_size=8',
              '--max_iters=6', '--eval_interval=6', f'--device={device}')
    mfu = [r['mfu'] for r in read_metrics(out, 'train')][1:]  # the first holds one-time work
    assert len(mfu) == 5 and all(0 < m < 1 for m in mfu), mfu
