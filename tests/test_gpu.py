"""Every decision the CUDA paths make, checked on a CPU: CI has no GPU, so each decision is a small
function tested with the values a GPU host would give it (device counts, compute capabilities,
device names), and torch's own checks are called where they run without CUDA."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.cuda._utils import _get_device_index

import checkpoint
import distributed
import perf
import precision
from model import GPT, GPTConfig, padded_vocab


@pytest.mark.parametrize('device, local_rank, gpus, expected', [
    ('auto', None, 0, 'cpu'), ('cpu', 3, 8, 'cpu'),
    # one process
    ('auto', None, 1, 'cuda:0'), ('cuda', None, 2, 'cuda:0'), ('cuda:1', None, 2, 'cuda:1'),
    ('auto', 0, 8, 'cuda:0'), ('cuda', 3, 8, 'cuda:3'),  # torchrun: each rank its local rank's GPU
])
def test_a_cuda_device_always_has_an_index(device, local_rank, gpus, expected):
    resolved, device_type = distributed.resolve_device(device, local_rank, cuda_count=gpus)
    assert resolved == expected and device_type == torch.device(expected).type
    # what torch.cuda.set_device(resolved) checks first: 'cuda' alone raises here
    if device_type == 'cuda':
        assert (_get_device_index(torch.device(resolved), optional=False)
                == torch.device(expected).index)


@pytest.mark.parametrize('device, local_rank, gpus, message', [
    ('cuda', None, 0, 'CUDA is not available'), ('cuda:2', None, 2, 'sees 2'),
    ('cuda', 2, 2, 'sees 2'), ('cuda:1', 0, 2, 'under torchrun'), ('mps', None, 0, 'not supported'),
    ('gpu', None, 1, 'not supported'),
])
def test_a_device_this_code_cannot_use_is_refused(device, local_rank, gpus, message):
    with pytest.raises(ValueError, match=message):
        distributed.resolve_device(device, local_rank, cuda_count=gpus)


def test_setup_makes_each_rank_s_own_gpu_current_before_it_joins_the_group(monkeypatch):
    """Under torchrun on a host with 4 GPUs, local rank 2 makes cuda:2 current (by index: 'cuda'
    alone raises in set_device), allows TF32, then joins the group on CUDA; a CPU process touches no
    CUDA call."""
    calls = []
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 4)
    monkeypatch.setattr(torch.cuda, 'set_device',
                        lambda device: calls.append(('set_device', device)))
    monkeypatch.setattr(torch, 'set_float32_matmul_precision',
                        lambda p: calls.append(('matmul', p)))
    monkeypatch.setattr(distributed, 'init_process_group',
                        lambda *args: calls.append(('group', *args)))
    assert distributed.setup('auto', 2, False, 'auto', 1) == ('cuda:2', 'cuda')
    assert calls == [('set_device', 'cuda:2'), ('matmul', 'high'), ('group', 'cuda:2', 'auto')]
    calls.clear()
    assert distributed.setup('cpu', None, False, 'auto', 1) == ('cpu', 'cpu') and calls == []


@pytest.mark.parametrize('device, backend, expected', [
    ('cuda:3', 'auto', ('nccl', torch.device('cuda:3'))),
    ('cuda:3', 'nccl', ('nccl', torch.device('cuda:3'))),
    ('cuda:3', 'gloo', ('gloo', None)), ('cpu', 'auto', ('gloo', None)),
])
def test_an_nccl_group_is_bound_to_the_rank_s_own_gpu(device, backend, expected):
    assert distributed.group_backend(device, backend) == expected


def test_nccl_on_a_cpu_is_refused_with_the_fix():
    # else torch's 'device_id parameter must be an accelerator with an index'
    with pytest.raises(ValueError, match=r"^backend='nccl' runs on CUDA GPUs, not on device='cpu': "
                                         r"use backend=gloo or auto$"):
        distributed.group_backend('cpu', 'nccl')


def test_rng_state_holds_and_restores_only_this_process_s_gpu(monkeypatch):
    """A process draws dropout from its own device's generator; get_rng_state_all() would save one
    per visible GPU and fail to restore where another number is visible (here: 8 GPUs, the process
    on cuda:5)."""
    asked, restored = [], []
    states = {f'cuda:{i}': torch.full((16,), i, dtype=torch.uint8) for i in range(8)}
    monkeypatch.setattr(torch.cuda, 'get_rng_state', lambda device: asked.append(str(device))
                        or states[str(device)])
    monkeypatch.setattr(torch.cuda, 'set_rng_state',
                        lambda state, device: restored.append((str(device), state)))
    for name in ('get_rng_state_all', 'set_rng_state_all', 'manual_seed_all'):
        monkeypatch.setattr(torch.cuda, name,
                            lambda *a, name=name: pytest.fail(f'{name} touches every GPU'))
    state = checkpoint.rng_state('cuda:5')
    assert asked == ['cuda:5'] and state['cuda'] == [5] * 16
    checkpoint.set_rng_state(state, 'cuda:5')
    assert [d for d, _ in restored] == ['cuda:5'] and restored[0][1].tolist() == [5] * 16
    # a CPU process asks no GPU
    assert checkpoint.rng_state('cpu')['cuda'] is None and asked == ['cuda:5']


@pytest.mark.parametrize('gpu, capability, dtype', [
    # bfloat16 emulated
    ('P100', (6, 0), 'float16'), ('V100', (7, 0), 'float16'), ('T4', (7, 5), 'float16'),
    ('A100', (8, 0), 'bfloat16'), ('A10/RTX 3090', (8, 6), 'bfloat16'),
    ('L4/L40/RTX 4090', (8, 9), 'bfloat16'), ('H100', (9, 0), 'bfloat16'),
    ('B200', (10, 0), 'bfloat16'),
])
def test_auto_dtype_on_a_gpu_follows_its_compute_capability(gpu, capability, dtype):
    assert precision.cuda_autocast_dtype(capability) == dtype


def test_a_gpu_s_utilization_is_nvml_s_and_its_idle_line_names_the_host(monkeypatch):
    speed = perf.Speedometer(0, 100, 1, 1000, 1e3, 1e15, 1, 'cuda:0', torch.bfloat16)
    monkeypatch.setattr(torch.cuda, 'utilization', lambda device: 37)
    monkeypatch.setattr(time, 'time', lambda: speed.since + 1.0)  # each interval 1 s
    # the first interval is left out; three idle ones are 3 s, not yet the 5 s a stretch needs
    for step in range(1, 7):
        interval = speed.interval(step)
        assert interval['utilization'] == 0.37
        assert bool(interval['idle_warning']) == (step == 6), interval['idle_warning']
    assert interval['idle_warning'].startswith(
        "the GPU was busy less than 50% of the time for 5 log intervals in a row (5 s), 37% in "
        "the last: it waits for the host")
    assert not speed.interval(7)['idle_warning']  # once a run

    def no_nvml(device):
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")
    monkeypatch.setattr(torch.cuda, 'utilization', no_nvml)
    assert speed.interval(8)['utilization'] is None  # not shown, not a failure


def test_peak_table_matches_the_exact_gpu_name_and_records_the_entry(monkeypatch):
    # substrings nest ('L4' in 'L40' in 'L40S', 'A10' in 'A100', 'H100' in 'H100 PCIe'): each GPU
    # gets its own row
    expected = {'NVIDIA L4': 121e12, 'NVIDIA L40': 181e12, 'NVIDIA L40S': 362e12,
                'NVIDIA A10': 125e12, 'NVIDIA A100-SXM4-80GB': 312e12, 'NVIDIA H100 PCIe': 756e12,
                'NVIDIA H100 80GB HBM3': 989e12}
    for name, peak in expected.items():
        assert perf.table_peak(name, torch.bfloat16) == peak
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device: name)
        assert perf.peak_flops('cuda:0', torch.bfloat16, announce=pytest.fail) == (
            peak, f"datasheet: {name}, bfloat16 dense")  # read, not measured: nothing to announce
    assert perf.table_peak('NVIDIA H100 80GB HBM3', torch.float32) == 495e12  # TF32, dense
    # a GPU not listed, or a dtype it lacks, is measured rather than guessed from a similar name
    assert perf.table_peak('NVIDIA L4 something new', torch.bfloat16) is None
    assert perf.table_peak('Tesla T4', torch.bfloat16) is None


def test_padded_vocabulary_rows_are_never_predicted_sampled_or_counted():
    config = GPTConfig(block_size=16, vocab_size=65, n_layer=1, n_head=2, n_embd=32)
    model = GPT(config).eval()
    assert padded_vocab(65) == 128 and padded_vocab(50257) == 50304 and padded_vocab(64) == 64
    assert model.wte.weight.shape == model.lm_head.weight.shape == (128, 32)
    with torch.no_grad():  # make the padding rows win every argmax if they were ever looked at
        model.wte.weight[65:] = 100 * model.ln_f.weight
    idx = torch.randint(0, 65, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 65)
    targets = torch.randint(0, 65, (2, 16))
    targets[0, :5] = -100  # nothing predicted there
    assert torch.allclose(model(idx, targets),
                          F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    total = model(idx, targets, reduction='sum')
    assert torch.allclose(total,
                          F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction='sum'))
    # 27 predicted tokens at about ln(65) each: a padding row in the softmax would add ~1e3
    assert total < 27 * 10
    sampled = model.generate(idx[:, :2], 20, temperature=2.0,
                             generator=torch.Generator().manual_seed(0))
    assert sampled.max() < 65


def test_qk_norm_hands_attention_one_dtype_when_autocast_runs_rms_norm_in_float32(monkeypatch):
    """CUDA autocast (torch >= 2.12, pytorch#188955) runs rms_norm in float32 while v stays
    bfloat16; simulated here on the CPU, where autocast leaves rms_norm alone."""
    rms_norm, sdpa, seen = F.rms_norm, F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, 'rms_norm', lambda x, shape: rms_norm(x.float(), shape))
    monkeypatch.setattr(F, 'scaled_dot_product_attention',
                        lambda q, k, v, **kw: (seen.append({q.dtype, k.dtype, v.dtype})
                                               or sdpa(q, k, v, **kw)))
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32,
                          qk_norm=True))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        model(torch.randint(0, 50, (2, 16)))
    assert len(seen) == 2 and all(len(dtypes) == 1 for dtypes in seen)


def test_fsdp_builds_its_mesh_for_the_device_in_use_and_reduces_in_float32(monkeypatch, tmp_path):
    """On a GPU host FSDP's default mesh is CUDA even for a device=cpu run; the accelerator is faked
    here."""
    monkeypatch.setattr(torch._C, '_get_accelerator', lambda: torch.device('cuda'))
    dist.init_process_group('gloo', init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = GPT(GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=2, n_embd=16))
        model.fully_shard(torch.bfloat16, 'cpu')
        assert {p.device_mesh.device_type for p in model.parameters()} == {'cpu'}
        policy = model._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_loss_compiled_with_the_model_equals_eager():
    """forward(idx, targets) puts the cross-entropy inside the compiled graph, where inductor fuses
    it with the head. Float32 on one thread: fused kernels sum in another order, so agreement is to
    rounding (1e-5)."""
    torch.manual_seed(0)
    eager = GPT(GPTConfig(block_size=16, vocab_size=65, n_layer=1, n_head=2, n_embd=32,
                          logit_softcap=15.0))
    twin = GPT(eager.config)
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin)
    idx, targets = torch.randint(0, 65, (4, 16)), torch.randint(0, 65, (4, 16))
    targets[:, :3] = -100
    losses = [m(idx, targets) for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=0)
    grads = [dict(m.named_parameters()) for m in (eager, twin)]
    assert all(torch.allclose(grads[0][k].grad, grads[1][k].grad, rtol=1e-4, atol=1e-6)
               for k in grads[0])


def test_phase_times_on_cuda_count_backward_kernels_launched_from_the_autograd_thread():
    """On CUDA the autograd engine runs backward's ops on its own device thread, so the caller's
    'backward' range has no children with kernels; each op's kernels go to the range open when it
    started, on any thread. Times in microseconds, as torch.profiler's events give them."""
    from types import SimpleNamespace

    def event(name, start, end, self_device_us=0.0, thread=1):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CPU, thread=thread,
                               time_range=SimpleNamespace(start=start, end=end),
                               self_device_time_total=self_device_us,
                               device_time_total=self_device_us)
    events = [event('data', 0, 10), event('forward', 10, 100), event('aten::mm', 20, 30, 3000),
              event('backward', 100, 200, 100),  # the loss scaling it launches itself
              event('aten::mm', 120, 130, 5000, thread=2),
              event('aten::add_', 150, 151, 500, thread=2),
              event('optimizer', 200, 300), event('aten::_fused_adamw_', 210, 220, 2000),
              event('aten::zero_', 305, 306, 700)]  # outside every range
    expected = {'data': 0.0, 'forward': 3.0, 'backward': 5.6, 'optimizer': 2.0, 'other': 0.7}
    assert perf.phase_times(events, 'cuda') == pytest.approx(expected)


def test_the_peak_memory_of_training_starts_after_start_up(monkeypatch):
    reset = []
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda device: reset.append(device))
    perf.reset_peak_memory('cpu')
    perf.reset_peak_memory('cuda:1')
    assert reset == ['cuda:1']


@pytest.mark.parametrize('line, version', [
    ('NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023',
     '535.104.05'),
    ('NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs)',
     '580.159.04'),
    ('something else', None)])
def test_the_driver_version_is_read_from_the_kernel_module_s_file(tmp_path, line, version):
    (tmp_path / 'version').write_text(line + '\nGCC version:  gcc version 12.2.0\n')
    assert perf.nvidia_driver(str(tmp_path / 'version')) == version
    assert perf.nvidia_driver(str(tmp_path / 'missing')) is None


def test_meta_json_s_gpu_record_names_the_card_driver_and_libraries(monkeypatch):
    from types import SimpleNamespace
    props = SimpleNamespace(name='NVIDIA H100 80GB HBM3', major=9, minor=0,
                            total_memory=81559 * 2**20)
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda device: props)
    monkeypatch.setattr(torch.cuda.nccl, 'version', lambda: (2, 27, 7))
    monkeypatch.setattr(dist, 'is_nccl_available', lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, 'version', lambda: 91900)
    monkeypatch.setattr(torch.version, 'cuda', '13.0')
    monkeypatch.setattr(perf, 'nvidia_driver', lambda: '580.159.04')
    assert perf.gpu_info('cuda:0') == {
        'name': 'NVIDIA H100 80GB HBM3', 'capability': '9.0', 'memory_mb': 81559,
        'driver': '580.159.04', 'cuda': '13.0', 'cudnn': 91900, 'nccl': '2.27.7'}
    assert perf.gpu_info('cpu') is None
