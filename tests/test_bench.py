"""bench.py run as users run it on the toy dataset, its printed figures checked against each other; perf's peaks."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import perf
from conftest import REPO, RUN_CONFIG, ok, torchrun_script
from model import GPT, GPTConfig


def run_bench(data_dir, *overrides):
    cmd = [sys.executable, 'bench.py', RUN_CONFIG, f'--data_dir={data_dir}', '--bench_iters=5', '--bench_warmup=2', '--dtype=float32', *overrides]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"bench.py failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


def sections(stdout):
    """{'A': text, 'B': text}: each setting's block of lines."""
    return dict(re.findall(r'^(A|B): (.*?)(?=^\n|\Z)', stdout, re.M | re.S))


def number(pattern, text):
    return float(re.search(pattern, text).group(1).replace(',', ''))


def check_setting(text, flops_per_token):
    median, fastest = number(r'median ([\d.]+)', text), number(r'min ([\d.]+) over 5 steps', text)
    assert 0 < fastest <= median
    tokens_per_step, tokens_per_sec = number(r'([\d,]+) tokens per step', text), number(r'tokens/s: ([\d,]+)', text)
    # tokens/s comes from the median step, printed rounded to 0.1 ms
    assert tokens_per_step / (median + 0.05) * 1e3 - 1 <= tokens_per_sec <= tokens_per_step / (median - 0.05) * 1e3 + 1
    assert number(r'model FLOPs/token: ([\d.]+)M', text) == pytest.approx(flops_per_token / 1e6, abs=0.01)
    achieved = number(r'achieved ([\d.]+) GFLOP/s', text)
    assert achieved == pytest.approx(flops_per_token * tokens_per_sec / 1e9, rel=0.02, abs=0.01)
    mfu, peak = number(r'MFU: ([\d.]+)%', text), number(r'of ([\d.]+) GFLOP/s peak per process \(measured: \d+x\d+ float32 matmul', text)
    # MFU comes from unrounded values; achieved and peak are printed to 0.01 and 0.1 GFLOP/s (a peak measured while
    # the host was starved was once 0.1, so that rounding alone moved MFU by 15%)
    assert 100 * (achieved - 0.005) / (peak + 0.05) - 0.05 <= mfu <= 100 * (achieved + 0.005) / (peak - 0.05) + 0.05
    shares = re.search(r'profile of one step \([\d.]+ ms\): data ([\d.]+)%, forward ([\d.]+)%, backward ([\d.]+)%, '
                       r'optimizer ([\d.]+)%, other (-?[\d.]+)%', text).groups()
    shares = [float(s) for s in shares]
    assert all(s >= 0 for s in shares) and shares[1] > 0 and shares[2] > 0
    assert sum(shares) == pytest.approx(100, abs=0.3)
    return tokens_per_sec, tokens_per_step / fastest, number(r'loss ([\d.]+) after 7 steps', text)


def toy_model(data_dir):
    """The GPT that bench.py builds from tests/run_config.py on the toy data."""
    run_config = {}
    exec(open(RUN_CONFIG).read(), run_config)
    shape = {k: run_config[k] for k in ('n_layer', 'n_head', 'n_embd', 'block_size')}
    vocab_size = json.load(open(os.path.join(data_dir, 'toy', 'meta.json')))['vocab_size']
    return GPT(GPTConfig(**shape, bias=False, vocab_size=vocab_size))  # bias: train.py's default


def test_bench_compares_two_settings_with_speed_mfu_and_profile(tmp_path, data_dir):
    # B trains the same model on the same batches, loaded in a worker process: the same losses, another speed
    stdout = run_bench(data_dir, '--compare=--num_workers=1', f"--trace={tmp_path / 'step.json'}")
    a, b = sections(stdout)['A'], sections(stdout)['B']
    assert 'num_workers=0' in a and 'num_workers=1' in b
    (a_median, a_fastest, a_loss), (b_median, b_fastest, b_loss) = (check_setting(s, toy_model(data_dir).flops_per_token()) for s in (a, b))
    assert a_loss == b_loss
    assert number(r'tokens/s B/A: ([\d.]+)', stdout) == pytest.approx(b_median / a_median, rel=0.01)
    assert number(r'fastest steps: ([\d.]+)', stdout) == pytest.approx(b_fastest / a_fastest, rel=0.05)  # ms rounded to 0.1
    assert number(r'peak memory: rank 0 ([\d,]+) MB', stdout) > 0
    for name in ('step_A.json', 'step_B.json'):
        events = {e.get('name') for e in json.load(open(tmp_path / name))['traceEvents']}
        assert {'data', 'forward', 'backward', 'optimizer'} <= events


def held_mb(text):
    """{rank: (weights, grads, AdamW, total)} from a setting's 'rank R holds' lines."""
    lines = re.findall(r'rank (\d+) holds: weights ([\d,.]+) MB, grads ([\d,.]+) MB, AdamW ([\d,.]+) MB; total ([\d,.]+) MB', text)
    return {int(r): tuple(float(x.replace(',', '')) for x in mb) for r, *mb in lines}


@pytest.mark.slow
def test_bench_under_torchrun_shows_fsdp_holding_a_shard_per_rank(data_dir):
    # fsdp and ddp on 2 ranks, and 1 process, take the same global batches: the same losses (printed to 4 decimals)
    result = ok(torchrun_script(['bench.py'], f'--data_dir={data_dir}', '--bench_iters=3', '--bench_warmup=2', '--profile=False', '--dtype=float32',
                                '--parallel=fsdp', '--gradient_accumulation_steps=2', '--compare=--parallel=ddp'))
    fsdp, ddp = sections(result.stdout)['A'], sections(result.stdout)['B']
    assert ', fsdp, ' in fsdp and ', ddp, ' in ddp and '2 process(es)' in result.stdout
    one_process = sections(run_bench(data_dir, '--bench_iters=3', '--profile=False', '--gradient_accumulation_steps=2'))['A']
    losses = [number(r'loss ([\d.]+) after 5 steps', text) for text in (fsdp, ddp, one_process)]
    assert losses == pytest.approx([losses[2]] * 3, abs=2e-4)
    # what each rank holds, from the model's shapes: a DDP replica is all of it, an FSDP rank its dim-0 chunk
    params = list(toy_model(data_dir).parameters())  # the tied head appears once
    replica = sum(p.numel() for p in params) * 4 / 2**20
    rows = lambda p, r: max(0, min(-(-p.size(0) // 2), p.size(0) - r * -(-p.size(0) // 2)))
    shard = [sum(rows(p, r) * p[0].numel() for p in params) * 4 / 2**20 for r in (0, 1)]
    fsdp_mb, ddp_mb = held_mb(fsdp), held_mb(ddp)
    for r in (0, 1):  # weights, grads, AdamW (two moments, plus a 4-byte step count per tensor)
        assert ddp_mb[r][:3] == pytest.approx((replica, replica, 2 * replica), abs=0.006)
        assert fsdp_mb[r][:3] == pytest.approx((shard[r], shard[r], 2 * shard[r]), abs=0.006)
    assert set(fsdp_mb) == set(ddp_mb) == {0, 1}
    peaks = re.search(r'peak memory: rank 0 ([\d,]+) MB, rank 1 ([\d,]+) MB', result.stdout).groups()
    assert all(float(mb.replace(',', '')) > 100 for mb in peaks)  # at least Python and torch


def test_peak_flops_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv('HONESTGPT_CACHE', str(tmp_path))
    flops, how = perf.peak_flops.__wrapped__('cpu', torch.float32)
    assert flops > 1e7 and re.fullmatch(r'measured: (\d+)x\1 float32 matmul, the fastest of 3 layouts and sizes 128 to \d+', how)
    # the next run on this machine reads the same figure: the same speed gives the same MFU
    assert perf.peak_flops.__wrapped__('cpu', torch.float32) == (flops, f"{how} (cached in {tmp_path / 'perf.json'})")


def test_peak_flops_table_takes_the_gpu_whose_name_matches_first(monkeypatch):
    # substrings nest ('A10' in 'A100', 'L4' in 'L40S', 'H100' in 'H100 PCIe'): each GPU must get its own row
    expected = {'NVIDIA A100-SXM4-80GB': 312e12, 'NVIDIA A10': 125e12, 'NVIDIA L40S': 362e12, 'NVIDIA L4': 121e12,
                'NVIDIA H100 PCIe': 756e12, 'NVIDIA H100 80GB HBM3': 989e12}
    for name, peak in expected.items():
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device: name)
        assert perf.peak_flops.__wrapped__('cuda', torch.bfloat16) == (peak, f"table: {name}")
    assert perf.peak_flops.__wrapped__('cuda', torch.float32)[0] == pytest.approx(989e12 / 2, rel=0.01)  # TF32, dense
