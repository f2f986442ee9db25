"""The modern recipe's switches: rotary positions, QK-norm, ReLU squared, an untied head,
soft-capped logits, zero-initialized projections, Muon beside AdamW and the warmup-stable-decay
schedule. Each does what it says here; exact resume and DDP with all of them on are test_resume.py's
and test_ddp.py's tests, run over RECIPE too."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import hf
import precision
from conftest import ok, read_metrics, run_train, run_trains, torchrun
from model import ACTIVATIONS, GPT, GPTConfig, rotate
from optim import Muon, newton_schulz

# every switch on, Muon's rate and the wsd decay share set apart from their defaults
RECIPE = ['--optimizer=muon', '--muon_lr=0.03', '--pos_emb=rope', '--qk_norm=True',
          '--activation=relu2', '--tie_head=False', '--logit_softcap=15.0', '--zero_init=True',
          '--lr_schedule=wsd', '--wsd_decay_frac=0.5']
SWITCHES = dict(pos_emb='rope', qk_norm=True, activation='relu2', tie_head=False,
                logit_softcap=15.0, zero_init=True)


def tiny_gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32),
                            **kw}))


def test_rope_scores_depend_on_the_offset_only():
    attn = tiny_gpt(pos_emb='rope').blocks[0].attn
    # one query and one key vector at every position
    q, k = torch.randn(2, 1, 1, 1, 16).expand(2, 1, 1, 16, 16).unbind(0)
    # as the model's attention turns them
    q, k = rotate(q, attn.cos, attn.sin), rotate(k, attn.cos, attn.sin)
    scores = (q @ k.transpose(-2, -1))[0, 0]  # (T, T): query i, key j
    for offset in range(-15, 16):  # constant along every diagonal, and not the same on all of them
        diagonal = torch.diagonal(scores, offset)
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-5)
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, -3)[0],
                              atol=1e-3)
    assert ('wpe.weight' not in tiny_gpt(pos_emb='rope').state_dict()
            and 'wpe.weight' in tiny_gpt().state_dict())


def test_rope_turns_queries_and_keys_in_the_forward_by_absolute_position():
    model = tiny_gpt(pos_emb='rope').eval()
    # larger queries and keys than at init: attention far from uniform, so positions show
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(20)
    idx = torch.randint(50, (2, 16))
    logits = model(idx)
    # a prefix gives the logits it has inside the whole sequence: causal, and its tokens keep their
    # offsets
    assert torch.allclose(model(idx[:, :8]), logits[:, :8], atol=1e-6)
    for block in model.blocks:  # the same weights without the rotation: another function
        block.attn.rope = False
    assert not torch.allclose(model(idx), logits, atol=1e-3)


def test_softcap_bounds_logits():
    capped, free = tiny_gpt(logit_softcap=2.0), tiny_gpt()
    for model in (capped, free):
        with torch.no_grad():
            model.wte.weight.mul_(300)  # the tied head: logits far beyond the cap
    idx = torch.randint(0, 50, (2, 16))
    assert free(idx).abs().max() > 20 and capped(idx).abs().max() <= 2
    # the same weights, their logits capped
    assert torch.allclose(capped(idx), 2 * torch.tanh(free(idx) / 2))


def test_zero_init_blocks_start_as_the_identity():
    x = torch.randn(2, 16, 32)
    model = tiny_gpt(zero_init=True, tie_head=False)
    assert all(torch.equal(block(x), x) for block in model.blocks)
    # zero head: uniform prediction
    assert torch.equal(model(torch.randint(0, 50, (2, 16))), torch.zeros(2, 16, 50))
    assert not torch.equal(tiny_gpt().blocks[0](x), x)


def test_untied_head_has_its_own_weight_and_relu2_squares():
    model = tiny_gpt(tie_head=False)
    params = dict(model.named_parameters())
    assert (model.lm_head.weight is not model.wte.weight
            and {'lm_head.weight', 'wte.weight'} <= set(params))
    assert model.num_params() == (sum(p.numel() for p in model.parameters())
                                  - params['wte.weight'].numel()
                                  - params['wpe.weight'].numel())
    x = torch.randn(100)
    assert torch.equal(ACTIVATIONS['relu2'](x), F.relu(x) ** 2)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest_each_at_its_rate():
    model = tiny_gpt(tie_head=False)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'muon', 0.03, 0.9)
    adamw, muon = optimizer.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = [names[id(p)] for g in muon.param_groups for p in g['params']]
    in_adamw = [names[id(p)] for g in adamw.param_groups for p in g['params']]
    assert sorted(in_muon + in_adamw) == sorted(names.values())  # every parameter, once
    assert set(in_muon) == {n for n, p in model.named_parameters() if n.startswith('blocks.')
                            and p.dim() == 2}
    assert {'wte.weight', 'wpe.weight', 'lm_head.weight'} <= set(in_adamw)
    assert ([g['lr'] for g in adamw.param_groups] == [1e-3, 1e-3]
            and muon.param_groups[0]['lr'] == 0.03)
    assert muon.param_groups[0]['momentum'] == 0.9
    # one object to the loop: its groups are theirs, so one scheduler sets each group's rate from
    # its own base, also after a resume, which gives the members new group dicts
    assert optimizer.param_groups == adamw.param_groups + muon.param_groups
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    optimizer.load_state_dict(optimizer.state_dict())
    optimizer.step()
    scheduler.step()
    assert [g['lr'] for opt in (adamw, muon) for g in opt.param_groups] == [0.5e-3, 0.5e-3, 0.015]


@pytest.mark.parametrize('optimizer', ['adamw', 'muon'])
def test_layer_lr_decay_gives_each_depth_its_rate(optimizer):
    """Block i at decay^(n_layer - i), the embeddings (a tied head too) at decay^(n_layer + 1), the
    final norm at 1, for AdamW's rate and Muon's; weight decay as without it; off, the groups are
    the ones older checkpoints hold."""
    model = tiny_gpt()  # 2 blocks, tied head
    n_layer, decay, rates = 2, 0.5, {'adamw': 1e-3, 'muon': 0.03}
    expected = {n: decay ** (n_layer - int(n.split('.')[1]))
                for n, _ in model.named_parameters() if n.startswith('blocks.')}
    expected |= {'wte.weight': decay ** 3, 'wpe.weight': decay ** 3, 'ln_f.weight': 1.0,
                 'ln_f.bias': 1.0}
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {}  # {name: (optimizer, rate, weight decay)}
    for off, layer_lr_decay in ((True, 1.0), (False, decay)):
        members = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), optimizer, 0.03, 0.9,
                                             'float32', layer_lr_decay).optimizers
        kinds = ['adamw', 'muon'][:len(members)]
        found = {names[id(p)]: (kind, g['lr'], g['weight_decay'])
                 for kind, member in zip(kinds, members) for g in member.param_groups
                 for p in g['params']}
        assert sorted(found) == sorted(names.values())  # every parameter, once
        if off:
            groups = found
            assert [len(m.param_groups) for m in members] == [2, 1][:len(members)]
            continue
        for name, (kind, lr, weight_decay) in found.items():
            kind_off, _, weight_decay_off = groups[name]
            assert (kind, weight_decay) == (kind_off, weight_decay_off)
            assert lr == pytest.approx(rates[kind] * expected[name]), name
        assert members[0].param_groups[0]['lr'] == 1e-3  # the rate train.py logs: the full one
        # no empty group: FSDP's optimizer load (set_optimizer_state_dict) refuses more than one
        assert all(g['params'] for member in members for g in member.param_groups)


@pytest.mark.slow
def test_a_run_trains_each_depth_at_its_rate_and_keeps_the_decay_on_resume(tmp_path, data_dir):
    out = str(tmp_path / 'run')
    run_train(out, data_dir, '--layer_lr_decay=0.5', '--decay_lr=False', '--learning_rate=1e-3',
              '--max_iters=2', '--eval_interval=2')
    [adamw] = torch.load(os.path.join(out, 'last.pt'))['optimizer']  # AdamW alone: its state_dict
    # the groups: 1x (the final norm), blocks 1 and 0 at 0.5x and 0.25x (their matrices decayed,
    # the rest not), the embeddings (and the tied head) at 0.125x
    assert [g['lr'] for g in adamw['param_groups']] == pytest.approx(
        [1e-3 * 0.5 ** k for k in (0, 1, 1, 2, 2, 3)])
    result = run_train(out, data_dir, '--init_from=resume', '--layer_lr_decay=0.8',
                       '--max_iters=4', check=False)
    assert result.returncode == 2 and 'layer_lr_decay' in result.stderr, result.stderr


def muon_steps(muon_class, ns_dtype=None, steps=3, nesterov=True):
    """A tiny GPT's blocks' matrices (two layers: each shape twice, batched) after steps of
    muon_class (ns_dtype: ours' Newton-Schulz dtype) on the same seeded gradients, at the recipe's
    rate, momentum 0.9 (with Nesterov's look-ahead unless nesterov=False) and weight decay 0.1."""
    model = tiny_gpt(tie_head=False)
    params = [p for _, p in model.muon_params()]
    dtype = {} if ns_dtype is None else {'ns_dtype': ns_dtype}
    optimizer = muon_class(params, **dtype, lr=0.03, momentum=0.9, weight_decay=0.1,
                           nesterov=nesterov)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return params, optimizer


def test_muon_is_torchs_with_newton_schulz_batched_in_the_dtype_it_names():
    torchs, torch_optimizer = muon_steps(torch.optim.Muon)
    ours, optimizer = muon_steps(Muon, torch.bfloat16)
    assert {p.shape for p in ours} == {(96, 32), (32, 32), (128, 32), (32, 128)} and len(ours) == 8
    # torch's momentum, Nesterov, weight decay and per-shape rate; its bfloat16 Newton-Schulz, one
    # matrix at a time, to bfloat16's rounding of the update (2^-8 of it, times the rate)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(ours, torchs))
    plain = [muon_steps(make, dtype, nesterov=False)[0]  # momentum without the look-ahead
             for make, dtype in ((torch.optim.Muon, None), (Muon, torch.bfloat16))]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(*plain))
    assert not all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(plain[1], ours))
    # its state: a checkpoint of one loads into the other
    assert optimizer.state_dict()['param_groups'] == torch_optimizer.state_dict()['param_groups']
    torch_optimizer.load_state_dict(optimizer.state_dict())
    assert all(torch.equal(torch_optimizer.state[a]['momentum_buffer'],
                           optimizer.state[b]['momentum_buffer']) for a, b in zip(torchs, ours))
    # float32 is float32: a float64 Newton-Schulz's to float32's rounding; bfloat16 misses it by far
    exact, _ = muon_steps(Muon, torch.float64)
    f32, _ = muon_steps(Muon, torch.float32)
    f32_error, bf16_error = (max((a - b).abs().max().item() for a, b in zip(params, exact))
                             for params in (f32, ours))
    assert f32_error < 1e-6 and bf16_error > 1e-4, (f32_error, bf16_error)


def test_newton_schulz_of_a_batch_is_each_matrix_orthogonalized_alone():
    G = torch.randn(3, 48, 16, generator=torch.Generator().manual_seed(0))  # (3, rows, cols): tall
    batched = newton_schulz(G, torch.float32, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert batched.shape == G.shape and batched.dtype == torch.float32
    for g, o in zip(G, batched):
        alone = newton_schulz(g[None], torch.float32, (3.4445, -4.7750, 2.0315), 5, 1e-7)[0]
        assert torch.allclose(o, alone, atol=1e-6)
        # nearly orthogonal: singular values in about (0.5, 1.5), as torch's iteration leaves them
        assert ((torch.linalg.svdvals(o) - 1).abs() < 0.5).all()


def test_muon_dtype_auto_is_bfloat16_where_native_float32_where_emulated_else_the_faster(
        monkeypatch, tmp_path):
    monkeypatch.setenv('HONESTGPT_CACHE', str(tmp_path))
    shapes = [p.shape for _, p in tiny_gpt().muon_params()]
    for capability, dtype in (((9, 0), 'bfloat16'), ((8, 0), 'bfloat16'), ((7, 5), 'float32')):
        monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device: capability)
        assert precision.auto_muon_dtype('cuda', shapes)[0] == dtype
    # a CPU with bfloat16 units (whatever this one has): measured, and the faster kept
    monkeypatch.setattr(precision, 'bfloat16_units', lambda: True)
    monkeypatch.setattr(precision, 'fastest', lambda runs: {'float32': 2e-3, 'bfloat16': 1e-3})
    dtype, how = precision.auto_muon_dtype('cpu', shapes)
    assert dtype == 'bfloat16' and how['seconds'] == {'float32': 2e-3, 'bfloat16': 1e-3}
    # once per machine and shapes: a second run keeps the cached choice
    monkeypatch.setattr(precision, 'fastest', lambda runs: {'float32': 1e-3, 'bfloat16': 2e-3})
    assert precision.auto_muon_dtype('cpu', shapes)[0] == 'bfloat16'
    assert precision.auto_muon_dtype('cpu', shapes[:1])[0] == 'float32'
    # keyed by optim.py, where Newton-Schulz is: an edit there measures again, one to model.py not
    real_source = precision.inspect.getsourcefile
    for edited_file, dtype in ((real_source(GPT), 'bfloat16'),
                               (real_source(precision.newton_schulz), 'float32')):
        edited = tmp_path / os.path.basename(edited_file)
        edited.write_text(open(edited_file).read() + '# an edit\n')
        monkeypatch.setattr(precision.inspect, 'getsourcefile', lambda obj, f=edited_file, e=edited:
                            str(e) if real_source(obj) == f else real_source(obj))
        assert precision.auto_muon_dtype('cpu', shapes)[0] == dtype
        monkeypatch.setattr(precision.inspect, 'getsourcefile', real_source)
    # without bfloat16 units it would be emulated: float32, nothing measured
    monkeypatch.setattr(precision, 'fastest', None)
    monkeypatch.setattr(precision, 'bfloat16_units', lambda: False)
    assert precision.auto_muon_dtype('cpu', shapes) == ('float32', {
        'rule': 'CPU without bfloat16 matmul units: bfloat16 would be emulated'})


def test_bfloat16_units_count_only_where_onednn_may_use_them(monkeypatch):
    """AMX or AVX512-BF16 in the CPU, and oneDNN (torch's CPU matmuls) allowed bfloat16:
    ONEDNN_MAX_CPU_ISA=AVX2 caps it below, and bfloat16 is emulated, as on a CPU without them."""
    for amx, avx512_bf16, onednn, usable in ((True, True, True, True),
                                             (True, False, True, True),
                                             (False, True, True, True),
                                             (True, True, False, False),
                                             (False, False, True, False)):
        monkeypatch.setattr(torch.cpu, '_is_amx_tile_supported', lambda: amx)
        monkeypatch.setattr(torch.cpu, '_is_avx512_bf16_supported', lambda: avx512_bf16)
        monkeypatch.setattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported', lambda: onednn)
        assert precision.bfloat16_units() == usable


def test_export_refuses_what_gpt2_cannot_hold():
    for switch, phrase in (({'pos_emb': 'rope'}, "pos_emb='rope'"),
                           ({'qk_norm': True}, 'qk_norm=True'),
                           ({'logit_softcap': 15.0}, 'logit_softcap=15.0')):
        assert phrase in hf.cannot_hold(tiny_gpt(**switch).config)
    assert hf.cannot_hold(tiny_gpt(zero_init=True).config) == []  # an init, not an architecture


def wsd_factor(step, warmup=5, decay_iters=30, frac=0.5, min_factor=0.1):
    """The warmup-stable-decay schedule written out for these tests: warmup, flat, linear to
    min_factor, flat."""
    decay_start = decay_iters - frac * (decay_iters - warmup)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(min_factor,
               1.0 - (1.0 - min_factor) * max(0.0, step - decay_start)
               / (decay_iters - decay_start))


@pytest.mark.slow
def test_muon_on_two_ranks_tracks_one_process(tmp_path, data_dir):
    """Not test_ddp's equality over 30 steps: Muon orthogonalizing in bfloat16 (torch's dtype, set
    here whatever 'auto' picks on this CPU), where the float32 rounding by which two ranks' gradient
    sums differ from one process's flips last bits, and training amplifies the flips (measured on
    this run: on a Xeon with AMX the loss 1e-6 apart at step 5 and 1e-3 by step 15; on an
    AVX512-BF16 EPYC the gradient norm 3e-6 apart at step 3, 7e-5 at step 4 and 1e-2 by step 13;
    with AdamW the same run stays at 1e-7). So the first three steps within test_ddp's RTOL, where
    gradients not all-reduced or a lost micro-batch already show at 1e-2, and the evaluations within
    1%."""
    from test_ddp import SAME, close
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    run_train(one, data_dir, *SAME, *RECIPE, '--muon_dtype=bfloat16')
    ok(torchrun(two, data_dir, *SAME, *RECIPE, '--muon_dtype=bfloat16'))
    steps1, steps2 = read_metrics(one, 'train'), read_metrics(two, 'train')
    assert [s['lr'] for s in steps1] == [s['lr'] for s in steps2] and len(steps1) == 30
    for s1, s2 in zip(steps1[:3], steps2[:3]):
        assert close(s1['loss'], s2['loss']) and close(s1['grad_norm'], s2['grad_norm']), (s1, s2)
    for e1, e2 in zip(read_metrics(one, 'eval'), read_metrics(two, 'eval'), strict=True):
        assert abs(e1['val_loss'] - e2['val_loss']) < 0.01 * e1['val_loss']


@pytest.mark.slow
def test_float16_overflow_skips_both_optimizers_and_the_wsd_schedule_waits(tmp_path, data_dir):
    out = str(tmp_path / 'fp16')
    # one process under the probe, which counts each optimizer's real steps; the scale backs off
    # from 2^26 by skips
    ok(torchrun(out, data_dir, *RECIPE, '--dtype=float16', f'--init_scale={2.0 ** 26}',
                '--max_iters=50', '--lr_decay_iters=30', probe=True, nproc=1,
                env_extra={'PROBE_STEPS': str(tmp_path)}))
    steps = read_metrics(out, 'train')
    skipped = [s['skipped'] for s in steps]
    real_steps = sum(not s for s in skipped)
    assert 5 <= sum(skipped) and real_steps > 30 and all(math.isfinite(s['loss']) for s in steps)
    steps_taken = json.load(open(tmp_path / 'steps.0'))  # both stepped, or neither
    assert (steps_taken['AdamW'], steps_taken['Muon']) == (real_steps, real_steps)
    taken = 0
    # the lr of each iteration follows the real steps before it: warmup, flat, linear decay, flat
    for s in steps:
        assert s['lr'] == pytest.approx(3e-3 * wsd_factor(taken), rel=1e-12), (s, taken)
        taken += not s['skipped']
    ckpt = torch.load(os.path.join(out, 'last.pt'), weights_only=True)
    assert ckpt['scheduler']['last_epoch'] == real_steps
    adamw, muon = ckpt['optimizer']
    assert ([g['lr'] for g in adamw['param_groups']]
            == pytest.approx([3e-3 * wsd_factor(real_steps)] * 2))
    # Muon's own base rate
    assert muon['param_groups'][0]['lr'] == pytest.approx(0.03 * wsd_factor(real_steps))


@pytest.mark.slow
def test_a_finished_run_trains_further_without_warming_up_again(tmp_path, data_dir):
    """Two ways on: a cosine run whose max_iters alone is raised goes on at min_lr; a wsd run
    resumed from stable.pt (its state at the stable phase's end) with a longer schedule stays at the
    peak rate, then cools down anew. Raising lr_decay_iters on a cosine run instead puts the rate
    back up the curve, as README says."""
    cosine, wsd = str(tmp_path / 'cosine'), str(tmp_path / 'wsd')
    # 40 iterations
    run_trains(data_dir, (cosine, []), (wsd, ['--lr_schedule=wsd', '--wsd_decay_frac=0.5']))
    run_train(cosine, data_dir, '--init_from=resume', '--max_iters=50')
    lrs = [r['lr'] for r in read_metrics(cosine, 'train')]
    assert lrs[40:] == [pytest.approx(3e-4)] * 10  # min_lr, as at the end of the first session
    # wsd: warmup 5, stable to iteration 22.5 of lr_decay_iters=40, then linear to min_lr
    stable = torch.load(os.path.join(wsd, 'stable.pt'), weights_only=True)
    assert stable['iter_num'] == 23 and stable['scheduler']['last_epoch'] == 23
    longer = str(tmp_path / 'longer')
    run_train(longer, data_dir, '--lr_schedule=wsd', '--wsd_decay_frac=0.5', '--init_from=resume',
              f"--resume_from={os.path.join(wsd, 'stable.pt')}", '--max_iters=80',
              '--lr_decay_iters=80')
    lrs = [r['lr'] for r in read_metrics(longer, 'train')]  # iterations 24 to 80
    assert lrs[:19] == [3e-3] * 19 and 3e-4 < lrs[20] < 3e-3 and lrs[-1] < 6e-4  # cooled down anew
    # the straight wsd run had decayed by then: the longer one had not
    assert [r['lr'] for r in read_metrics(wsd, 'train')][30] < 3e-3
    # README's command, in the run's own folder: the files of the cooldown it replaces move aside
    # at once (a stop before the first save resumes stable.pt again), and the run is the longer one
    result = run_train(wsd, data_dir, '--lr_schedule=wsd', '--wsd_decay_frac=0.5',
                       '--init_from=resume', f"--resume_from={os.path.join(wsd, 'stable.pt')}",
                       '--max_iters=80', '--lr_decay_iters=80')
    assert (f"moved best.pt (40), last.pt (40) into {wsd}/replaced-000023: the continuation "
            f"after iteration 23 this session replaces" in result.stdout)
    def figures(run):
        return [(r['step'], r['loss'], r['lr']) for r in read_metrics(run, 'train')]
    assert figures(wsd)[23:] == figures(longer)
