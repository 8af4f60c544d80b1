"""ck.espo.espo_loss: every backend against the float64 reference (loss,
gradients, metrics), the GSPO / GRPO modes against verl's formulas, edge
cases, bad inputs, op registration.

Backends: "torch" (CPU, vectorised), "triton" (the interpreter on CPU tensors
here, or a GPU).
"""

from __future__ import annotations

import math

import pytest
import torch

import compass_kernels as ck
from compass_kernels.espo import loss as espo_mod
from compass_kernels.espo.loss import (
    espo_group_sums_op,
    espo_loss_backward_op,
    espo_loss_forward_op,
    stat_width,
)
from compass_kernels.espo.loss_config import resolve
from compass_kernels.espo.reference_loss import (
    entropy_thresholds_reference,
    espo_loss_reference,
)
from compass_kernels.testing import assert_verbose_allclose, empty_poisoned, make_generator

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


def make_batch(
    n: int,
    seed: int,
    *,
    max_len: int = 40,
    pad: int = 3,
    masked: float = 0.0,
    spread: float = 0.15,
    per_token_adv: bool = False,
    device="cpu",
):
    """A packed batch: sequence lengths 0..max_len (empty sequences included),
    ``pad`` padding tokens after the last, log-ratios ~ N(0, spread) (some
    tokens clip, most do not), entropies in [0, 4) with ties."""
    g = make_generator(seed)
    lengths = torch.randint(0, max_len + 1, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1]) + pad
    old = -torch.rand(total, generator=g) * 4
    lp = old + torch.randn(total, generator=g) * spread
    ent = (torch.rand(total, generator=g) * 40).round() / 10  # ties at the quantile
    adv = torch.randn(total if per_token_adv else n, generator=g)
    mask = torch.rand(total, generator=g) >= masked if masked else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(lp), to(old), to(ent), to(adv), to(cu), to(mask)


CONFIGS = {
    "espo": dict(vocab_size=1000),
    "espo_seq_k3_drop_gspo_form": dict(
        vocab_size=1000, grouping="sequence", num_groups=3, drop_low=True, ratio_form="gspo_token"
    ),
    "espo_quantiles_fixed_clip_dual": dict(
        quantiles=(0.3, 0.6, 0.9), clip=(0.05, 0.08), dual_clip=1.2
    ),
    "gspo": dict(mode="gspo", clip=(0.03, 0.04)),
    "grpo": dict(mode="grpo"),
    "grpo_clip_higher_dual": dict(mode="grpo", clip=(0.1, 0.28), dual_clip=1.15),
}


def _run(backend, batch, cfg, *, dtype=torch.float32, **kw):
    lp, old, ent, adv, cu, mask = batch
    x = lp.detach().to(dtype).requires_grad_()
    loss, metrics = ck.espo.espo_loss(x, old, ent, adv, cu, mask, backend=backend, **cfg, **kw)
    loss.backward()
    return loss, x.grad, metrics


def _reference(batch, cfg, **kw):
    lp, old, ent, adv, cu, mask = batch
    x = lp.detach().cpu().double().requires_grad_()
    loss, metrics = espo_loss_reference(x, old, ent, adv, cu, mask, **cfg, **kw)
    loss.backward()
    return loss, x.grad, metrics


def _compare(got, ref, *, atol=1e-6, rtol=1e-5):
    loss, grad, metrics = got
    rloss, rgrad, rmetrics = ref
    assert_verbose_allclose(
        loss.detach().cpu().double(), rloss.detach(), atol=atol, rtol=rtol, name="loss"
    )
    assert_verbose_allclose(grad.cpu().double(), rgrad, atol=atol * 1e-2, rtol=rtol, name="grad")
    assert set(metrics) == set(rmetrics)
    for key in rmetrics:
        assert_verbose_allclose(
            metrics[key].cpu().double(), rmetrics[key], atol=atol, rtol=rtol, name=key
        )


# ------------------------------------------------------------- vs reference


# (backend, n): the Triton interpreter costs ~1 ms per program-iteration, so it
# stops at 7 sequences here (longer and more sequences: the 65,536-token and
# poisoned-output tests).
CASES = [(b, n) for b in BACKENDS for n in (1, 7)] + [("torch", 37)]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(
    ("backend", "n"),
    [
        pytest.param(b.values[0], n, marks=b.marks) if not isinstance(b, str) else (b, n)
        for b, n in CASES
    ],
)
def test_matches_reference(backend, config, n, backend_device):
    batch = make_batch(n, seed=n, masked=0.2 if n > 1 else 0.0, device=backend_device)
    _compare(_run(backend, batch, CONFIGS[config]), _reference(batch, CONFIGS[config]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", ["espo", "grpo_clip_higher_dual"])
def test_per_token_advantages_and_float64(backend, config, backend_device):
    batch = make_batch(13, seed=5, per_token_adv=True, masked=0.1, device=backend_device)
    got = _run(backend, batch, CONFIGS[config], dtype=torch.float64)
    assert got[0].dtype == torch.float64 and got[1].dtype == torch.float64
    _compare(got, _reference(batch, CONFIGS[config]), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequences_longer_than_a_block_and_many_groups(backend, backend_device):
    """Sequences of 0..700 tokens: several chunks of 256 per program / block,
    tails, 8 entropy groups (the most the kernels hold in registers)."""
    batch = make_batch(9, seed=11, max_len=700, pad=300, masked=0.3, device=backend_device)
    cfg = dict(vocab_size=151936, num_groups=8, grouping="sequence")
    _compare(_run(backend, batch, cfg), _reference(batch, cfg))


def test_bfloat16_logprobs_get_bfloat16_gradients():
    batch = make_batch(11, seed=3)
    lp = batch[0].bfloat16().requires_grad_()
    loss, _ = ck.espo.espo_loss(lp, *batch[1:], vocab_size=1000)
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16
    ref_batch = (lp.detach().float(),) + batch[1:]
    rloss, rgrad, _ = _reference(ref_batch, dict(vocab_size=1000))
    assert_verbose_allclose(loss.detach().double(), rloss.detach(), atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(lp.grad, rgrad.bfloat16(), atol=1e-5, rtol=1e-2)


@pytest.mark.parametrize("dual", [None, 1.5])
def test_reference_gradcheck(dual):
    """GRPO has no stop-gradient: the reference's autograd gradient is the
    derivative of its loss (finite differences). (ESPO and GSPO-token stop the
    gradient through s_g by definition, so theirs is a surrogate, checked
    against verl's GSPO in test_modes_equal_verl.)"""
    lp, old, ent, adv, cu, mask = make_batch(5, seed=7, max_len=8, spread=0.4)
    x = lp.double().requires_grad_()
    cfg = dict(mode="grpo", dual_clip=dual)
    fn = lambda t: espo_loss_reference(t, old, ent, adv, cu, **cfg)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-7, atol=1e-6)
    assert float(espo_loss_reference(x, old, ent, adv, cu, **cfg)[1]["clip_frac"]) > 0


# ------------------------------------------------- thresholds and groups


@pytest.mark.parametrize("per_sequence", [False, True])
def test_thresholds_equal_torch_quantile(per_sequence):
    """The thresholds (a sort on the tensors' device) are torch.quantile's values
    bit for bit: a token at the boundary lands in the same group."""
    lp, old, ent, adv, cu, mask = make_batch(17, seed=2, masked=0.3, max_len=90)
    cu[-3] = cu[-4]  # an empty sequence: NaN row, never read
    levels = (0.0, 0.25, 0.5, 0.8, 1.0)
    got = ck.espo.entropy_thresholds(ent, cu, mask, levels=levels, per_sequence=per_sequence)
    ref = entropy_thresholds_reference(ent, cu, mask, levels, per_sequence=per_sequence)
    got = got.reshape(ref.shape)
    keep = ~torch.isnan(ref)
    assert keep.any() and (per_sequence == bool((~keep).any()))
    assert torch.equal(got[keep], ref[keep])


def test_high_group_is_the_top_rho_fraction():
    """rho = 0.2 over 1000 distinct entropies: exactly the 200 highest are high."""
    total = 1000
    ent = torch.randperm(total).float() / 100
    cu = torch.tensor([0, 400, 1000])
    z = torch.zeros(total)
    _, metrics = ck.espo.espo_loss(z, z, ent, torch.ones(2), cu, vocab_size=100, rho=0.2)
    assert metrics["group_token_frac"].tolist() == pytest.approx([0.8, 0.2], abs=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_groups_sequences_and_masks(backend, backend_device):
    """A sequence whose tokens all sit in one entropy group (K_i = 1), an empty
    sequence, a fully masked one, padding: no NaN, zero gradient where no loss."""
    cu = torch.tensor([0, 4, 4, 9, 12])
    total = 15
    ent = torch.tensor([0.1, 0.1, 0.2, 0.1, 3.0, 3.1, 0.5, 2.9, 0.2, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0])
    g = make_generator(1)
    old = -torch.rand(total, generator=g)
    lp = old + 0.1 * torch.randn(total, generator=g)
    mask = torch.ones(total, dtype=torch.bool)
    mask[9:12] = False
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    batch = tuple(t.to(backend_device) for t in (lp, old, ent, adv, cu, mask))
    for cfg in (dict(vocab_size=100), dict(vocab_size=100, drop_low=True), dict(mode="grpo")):
        got = _run(backend, batch, cfg)
        _compare(got, _reference(batch, cfg))
        grad = got[1].cpu()
        assert torch.isfinite(grad).all() and torch.isfinite(got[0]).all()
        assert (grad[9:] == 0).all()  # masked sequence and padding


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sequences_and_no_valid_tokens(backend, backend_device):
    dev = backend_device
    z = torch.zeros(4, device=dev)
    loss, metrics = ck.espo.espo_loss(
        z.clone().requires_grad_(),
        z,
        z,
        torch.zeros(0, device=dev),
        torch.zeros(1, dtype=torch.int64, device=dev),
        vocab_size=10,
        backend=backend,
    )
    assert float(loss) == 0.0 and float(metrics["tokens"]) == 0.0
    assert float(metrics["ratio_min"]) == 0.0 and float(metrics["clip_frac"]) == 0.0
    mask = torch.zeros(4, dtype=torch.bool, device=dev)
    x = z.clone().requires_grad_()
    cu = torch.tensor([0, 2, 4], device=dev)
    loss, _ = ck.espo.espo_loss(
        x, z, z, torch.ones(2, device=dev), cu, mask, vocab_size=10, backend=backend
    )
    loss.backward()
    assert float(loss) == 0.0 and torch.equal(x.grad.cpu(), torch.zeros(4))


# ------------------------------------------------- modes vs verl's formulas


def _padded(batch):
    lp, old, ent, adv, cu, mask = batch
    n = cu.numel() - 1
    L = int((cu[1:] - cu[:-1]).max())
    idx = torch.zeros(n, L, dtype=torch.int64)
    valid = torch.zeros(n, L, dtype=torch.bool)
    for i in range(n):
        k = int(cu[i + 1] - cu[i])
        idx[i, :k] = torch.arange(int(cu[i]), int(cu[i + 1]))
        valid[i, :k] = True
    return idx, valid


def _verl_vanilla(log_prob, old_log_prob, advantages, response_mask, low, high, clip_ratio_c):
    """verl core_algos.compute_policy_loss_vanilla + agg_loss("seq-mean-token-mean"),
    written from its formulas ([B, L] padded)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    m = response_mask.double()
    clipfrac = (torch.gt(pg_losses2, pg_losses1).double() * m).sum() / m.sum()
    seq = (pg_losses * m).sum(-1) / m.sum(-1)
    return seq.mean(), clipfrac


def _verl_gspo(log_prob, old_log_prob, advantages, response_mask, low, high):
    """verl core_algos.compute_policy_loss_gspo, written from its formulas."""
    negative_approx_kl = log_prob - old_log_prob
    m = response_mask.double()
    seq_lengths = m.sum(-1).clamp(min=1)
    kl_seq = (negative_approx_kl * m).sum(-1) / seq_lengths
    log_ratio = log_prob - log_prob.detach() + kl_seq.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = (torch.gt(pg_losses2, pg_losses1).double() * m).sum() / m.sum()
    return ((pg_losses * m).sum(-1) / m.sum(-1)).mean(), clipfrac


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "gspo"])
def test_modes_equal_verl(mode, backend, backend_device):
    """mode="grpo" / "gspo" give verl's PPO (dual-clip, clip-higher,
    seq-mean-token-mean) and GSPO losses, gradients and clip fractions."""
    g = make_generator(4)
    n = 23
    lengths = torch.randint(1, 60, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1])
    old = -torch.rand(total, generator=g) * 3
    spread = 0.3 if mode == "grpo" else 0.005
    lp = old + torch.randn(total, generator=g) * spread
    adv = torch.randn(n, generator=g)
    batch = (lp, old, torch.rand(total), adv, cu, None)
    low, high = (0.2, 0.28) if mode == "grpo" else (3e-4, 4e-4)
    idx, valid = _padded(batch)
    x = lp.double().requires_grad_()
    a = adv.double()[:, None].expand_as(idx)
    if mode == "grpo":
        ref, clipfrac = _verl_vanilla(x[idx], old.double()[idx], a, valid, low, high, 3.0)
    else:
        ref, clipfrac = _verl_gspo(x[idx], old.double()[idx], a, valid, low, high)
    ref.backward()
    dev = backend_device
    y = lp.to(dev).double().requires_grad_()
    kw = dict(mode=mode, clip=(low, high), backend=backend)
    if mode == "grpo":
        kw["dual_clip"] = 3.0
    loss, metrics = ck.espo.espo_loss(
        y, old.to(dev), torch.rand(total, device=dev), adv.to(dev), cu.to(dev), **kw
    )
    loss.backward()
    assert 0.05 < float(clipfrac) < 0.95, "the batch must clip some tokens and not others"
    assert_verbose_allclose(loss.detach().cpu(), ref.detach(), atol=1e-12, rtol=1e-10)
    assert_verbose_allclose(y.grad.cpu(), x.grad, atol=1e-14, rtol=1e-9)
    assert_verbose_allclose(metrics["clip_frac"].cpu(), clipfrac, atol=1e-15, rtol=0)


def test_espo_with_one_group_and_gspo_form_is_gspo():
    """The extremes: ESPO with a single entropy group, the GSPO-token ratio and
    GSPO's fixed clip is GSPO."""
    batch = make_batch(19, seed=9, spread=0.001)
    a = _run("torch", batch, dict(num_groups=1, ratio_form="gspo_token", clip=(3e-4, 4e-4)))
    b = _run("torch", batch, dict(mode="gspo"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert float(a[2]["clip_frac"]) > 0


def test_num_sequences_makes_micro_batches_sum_to_the_batch():
    """DP / gradient accumulation: with the global sequence count and the global
    threshold, the micro-batches' losses and gradients add up to the batch's."""
    lp, old, ent, adv, cu, _ = make_batch(12, seed=21, pad=0)
    thr = ck.espo.entropy_thresholds(ent, cu, levels=(0.8,))
    whole = _run(
        "torch", (lp, old, ent, adv, cu, None), dict(vocab_size=500), entropy_threshold=thr
    )
    split = int(cu[5])
    parts = []
    for sl, seqs in ((slice(0, split), slice(0, 5)), (slice(split, None), slice(5, None))):
        c = cu[seqs.start : (seqs.stop or 12) + 1] - cu[seqs.start]
        batch = (lp[sl], old[sl], ent[sl], adv[seqs], c, None)
        parts.append(
            _run("torch", batch, dict(vocab_size=500), entropy_threshold=thr, num_sequences=12)
        )
    assert_verbose_allclose(parts[0][0] + parts[1][0], whole[0], atol=1e-7, rtol=1e-6)
    assert_verbose_allclose(torch.cat([parts[0][1], parts[1][1]]), whole[1], atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_65536_token_sequence(backend, backend_device):
    """One sequence of 2^16 tokens (Liger's Triton loss crashes at L >= 65536):
    int64 offsets, a block / program looping over it, no grid limit."""
    T = 1 << 16
    g = make_generator(0)
    old = -torch.rand(T, generator=g)
    lp = old + 0.01 * torch.randn(T, generator=g)
    ent = torch.rand(T, generator=g)
    cu = torch.tensor([0, T])
    batch = tuple(t.to(backend_device) for t in (lp, old, ent, torch.tensor([0.7]), cu))
    got = _run(backend, batch + (None,), dict(vocab_size=151936))
    _compare(got, _reference(batch + (None,), dict(vocab_size=151936)), atol=1e-7)


# ------------------------------------------------------- poisoned outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", ["espo_seq_k3_drop_gspo_form", "grpo_clip_higher_dual"])
def test_kernels_write_every_output(backend, config, backend_device):
    """Outputs poisoned (NaN) before each kernel: an element it skips shows up."""
    dev = backend_device
    lp, old, ent, adv, cu, mask = make_batch(
        21, seed=8, max_len=300, pad=37, masked=0.2, device=dev
    )
    cfg = resolve(**CONFIGS[config])
    K = 1 if cfg.token_groups else cfg.num_groups
    flags = (
        (espo_mod.TOKEN_GROUPS if cfg.token_groups else 0)
        | (espo_mod.DROP_LOW if cfg.drop_low else 0)
        | (espo_mod.ADAPTIVE_EPS if cfg.adaptive else 0)
        | (espo_mod.GSPO_TOKEN_FORM if cfg.ratio_form == "gspo_token" else 0)
    )
    if K > 1:
        thr = ck.espo.entropy_thresholds(
            ent, cu, mask, levels=cfg.levels, per_sequence=cfg.per_sequence
        ).reshape(-1)
        flags |= espo_mod.PER_SEQ_THRESHOLDS if cfg.per_sequence else 0
    else:
        thr = torch.zeros(0, dtype=torch.float64, device=dev)
    n, total, width = cu.numel() - 1, lp.numel(), stat_width(K)
    sums = empty_poisoned(n * K * 3, torch.float64, dev)
    sums_args = dict(
        entropy=ent,
        logprobs=lp,
        old_logprobs=old,
        cu_seqlens=cu,
        mask=mask,
        thresholds=thr,
        num_groups=K,
        flags=flags,
    )
    espo_group_sums_op.run(**sums_args, backend=backend, out=sums)
    ref_sums = espo_group_sums_op.run(**_on_cpu(sums_args), backend="torch")
    assert_verbose_allclose(sums.cpu(), ref_sums, atol=1e-9, rtol=1e-12, name="sums")
    el, eh = (0.0, 0.0) if cfg.adaptive else (cfg.eps_low, cfg.eps_high)
    args = dict(
        logprobs=lp,
        old_logprobs=old,
        entropy=ent,
        advantages=adv,
        cu_seqlens=cu,
        mask=mask,
        thresholds=thr,
        sums=sums,
        num_groups=K,
        flags=flags,
        eps_low=el,
        eps_high=eh,
        eps_scale=cfg.alpha / cfg.log_vocab if cfg.adaptive else 0.0,
        dual_clip=cfg.dual_clip,
        log_lo=cfg.log_lo,
        log_hi=cfg.log_hi,
        inv_num_seqs=1.0 / n,
        need_grad=True,
    )
    f32, f64 = torch.float32, torch.float64
    outs = (
        empty_poisoned((), f32, dev),
        empty_poisoned(total, f32, dev),
        empty_poisoned(n * width, f64, dev),
        empty_poisoned(width, f64, dev),
    )
    outs = espo_loss_forward_op.run(**args, backend=backend, out=outs)
    ref = espo_loss_forward_op.run(**_on_cpu(args), backend="torch")
    for name in ref._fields:
        assert_verbose_allclose(
            getattr(outs, name).cpu(), getattr(ref, name), atol=1e-7, rtol=1e-6, name=name
        )
    rloss, rgrad, _ = _reference((lp, old, ent, adv, cu, mask), CONFIGS[config])
    assert_verbose_allclose(outs[0].cpu().double(), rloss.detach(), atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(outs[1].cpu().double(), rgrad, atol=1e-8, rtol=1e-5)
    out = empty_poisoned(total, torch.float32, dev)
    g = torch.tensor([2.5], device=dev)
    espo_loss_backward_op.run(grad_loss=g, grad_coef=outs.grad, backend=backend, out=out)
    assert_verbose_allclose(out.cpu(), 2.5 * outs[1].cpu(), atol=0, rtol=0)


def _on_cpu(args: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# ------------------------------------------------------------ bad inputs


def _good():
    lp, old, ent, adv, cu, _ = make_batch(3, seed=1, max_len=5, pad=2)
    return dict(
        logprobs=lp,
        old_logprobs=old,
        old_entropy=ent,
        advantages=adv,
        cu_seqlens=cu,
        vocab_size=100,
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(logprobs=torch.zeros(3, 2)), "logprobs: expected a 1-d"),
        (dict(logprobs=torch.zeros(4, dtype=torch.int64)), "logprobs: expected dtype"),
        (dict(old_logprobs=torch.zeros(1)), "old_logprobs: expected .* elements in dim 0"),
        (dict(old_entropy=None), "old_entropy: expected a torch.Tensor"),
        (dict(cu_seqlens=torch.tensor([0.0, 1.0])), "cu_seqlens: expected dtype"),
        (dict(advantages=torch.zeros(2)), "advantages: expected 3 elements .* or"),
        (dict(vocab_size=None), "vocab_size: expected an int >= 2"),
        (dict(vocab_size=1), "vocab_size: expected an int >= 2"),
        (dict(mode="ppo"), "mode: expected one of"),
        (dict(rho=1.0), "rho: expected a fraction in \\(0, 1\\)"),
        (dict(clip=(0.2, 0.3, 0.4)), "clip: expected a float or a \\(low, high\\) pair"),
        (dict(clip=1.5), "clip: expected 0 <= low < 1"),
        (dict(dual_clip=0.5), "dual_clip: expected a finite value > 1"),
        (dict(quantiles=(0.9, 0.5)), "quantiles: expected strictly increasing"),
        (dict(num_groups=9), "num_groups: expected an int in \\[1, 8\\]"),
        (dict(grouping="token"), "grouping: expected one of"),
        (dict(ratio_form="ppo"), "ratio_form: expected one of"),
        (dict(mode="gspo", drop_low=True), "mode='gspo' fixes the grouping"),
        (dict(num_sequences=0), "num_sequences: expected a positive int"),
        (dict(mask=torch.ones(3, dtype=torch.bool)), "mask: expected .* elements in dim 0"),
        (dict(entropy_threshold=torch.zeros(2)), "entropy_threshold: expected 1 elements"),
    ],
)
def test_bad_input(change, match):
    kw = _good() | change
    total = kw["logprobs"].shape[0]
    if "mask" in change and change["mask"].shape[0] == total:
        pytest.fail("the bad mask must have a wrong length")
    with pytest.raises((ValueError, TypeError), match=match):
        ck.espo.espo_loss(**kw)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("cu_seqlens", torch.tensor([0, 3, 2, 5]), "cu_seqlens: expected non-decreasing"),
        ("cu_seqlens", torch.tensor([1, 2, 3, 4]), "cu_seqlens: expected cu_seqlens\\[0\\] == 0"),
        ("cu_seqlens", torch.tensor([0, 3, 5, 99]), "cu_seqlens: expected cu_seqlens\\[-1\\] <="),
        ("logprobs", "nan", "logprobs: expected finite values"),
        ("old_entropy", "inf", "old_entropy: expected finite values"),
        ("advantages", "nan", "advantages: expected finite values"),
    ],
)
def test_bad_data_is_an_error_on_cpu_backends(backend, field, value, match):
    kw = _good()
    if isinstance(value, str):
        t = kw[field].clone()
        t[1] = float(value)
        value = t
    kw[field] = value
    with pytest.raises(ValueError, match=match):
        ck.espo.espo_loss(**kw, backend=backend)


def test_advantages_layout_must_be_said_when_ambiguous():
    z = torch.zeros(3)
    cu = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="advantages: 3 elements is both one per sequence"):
        ck.espo.espo_loss(z, z, z, z, cu, vocab_size=10)
    for per_token in (True, False):
        loss, _ = ck.espo.espo_loss(
            z, z, z, torch.ones(3), cu, vocab_size=10, advantages_per_token=per_token
        )
        assert float(loss) == pytest.approx(-1.0)


# ----------------------------------------------------- registration


def test_opcheck_registered_ops():
    lp, old, ent, adv, cu, mask = make_batch(6, seed=12, masked=0.2)
    thr = ck.espo.entropy_thresholds(ent, cu, mask, levels=(0.8,))
    sums_args = dict(
        entropy=ent,
        logprobs=lp,
        old_logprobs=old,
        cu_seqlens=cu,
        mask=mask,
        thresholds=thr,
        num_groups=2,
        flags=8,
    )
    torch.library.opcheck(torch.ops.compass.espo_group_sums.default, (), sums_args)
    sums = espo_group_sums_op(**sums_args)
    x = lp.clone().requires_grad_()
    args = dict(
        logprobs=x,
        old_logprobs=old,
        entropy=ent,
        advantages=adv,
        cu_seqlens=cu,
        mask=mask,
        thresholds=thr,
        sums=sums,
        num_groups=2,
        flags=8,
        eps_low=0.0,
        eps_high=0.0,
        eps_scale=0.003,
        dual_clip=0.0,
        log_lo=-20.0,
        log_hi=20.0,
        inv_num_seqs=1.0 / 6,
        need_grad=True,
    )
    torch.library.opcheck(torch.ops.compass.espo_loss_forward.default, (), args)
    torch.library.opcheck(
        torch.ops.compass.espo_loss_backward.default,
        (),
        dict(grad_loss=torch.ones(1), grad_coef=torch.randn(lp.numel())),
    )


def test_traces_under_torch_compile():
    import torch._dynamo

    assert not torch._dynamo.config.disable, "dynamo is off here (a live vLLM engine?)"
    lp, old, ent, adv, cu, _ = make_batch(5, seed=13)

    def step(x):
        loss, metrics = ck.espo.espo_loss(x, old, ent, adv, cu, vocab_size=1000)
        return loss * 2.0

    x = lp.clone().requires_grad_()
    out = torch.compile(step, backend="eager", fullgraph=True)(x)
    out.backward()
    rloss, rgrad, _ = _reference((lp, old, ent, adv, cu, None), dict(vocab_size=1000))
    assert_verbose_allclose(out.detach().double(), 2 * rloss.detach(), atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(x.grad.double(), 2 * rgrad, atol=1e-8, rtol=1e-5)


def test_no_grad_skips_the_gradient():
    lp, old, ent, adv, cu, _ = make_batch(5, seed=14)
    x = lp.clone().requires_grad_()
    with torch.no_grad():
        loss, _ = ck.espo.espo_loss(x, old, ent, adv, cu, vocab_size=1000)
    assert not loss.requires_grad
    rloss, _, _ = _reference((lp, old, ent, adv, cu, None), dict(vocab_size=1000))
    assert math.isclose(float(loss), float(rloss), rel_tol=1e-5, abs_tol=1e-7)


# ------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gpu_matches_reference(backend, config):
    """On a device: long and empty sequences, masks, both dtypes of the default path.
    grpo (every token its own group) makes the float64 reference loop per token: at
    257 x 3000 (372k tokens) it took 338 s on the CPU, so grpo gets 17 sequences of
    up to 600 tokens (~5k tokens, several 256-token chunks per sequence still; the
    reference then takes ~7 s on a loaded 2-core CPU)."""
    n, max_len = (17, 600) if CONFIGS[config].get("mode") == "grpo" else (257, 3000)
    batch = make_batch(n, seed=31, max_len=max_len, pad=129, masked=0.1, device="cuda")
    _compare(_run(backend, batch, CONFIGS[config]), _reference(batch, CONFIGS[config]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton"])
def test_gpu_path_never_syncs_the_host(backend):
    """The default CUDA path (thresholds, sums, forward, metrics) runs with the
    host-sync guard on: no .item(), no data-dependent shapes."""
    lp, old, ent, adv, cu, mask = make_batch(64, seed=32, max_len=500, masked=0.1, device="cuda")
    x = lp.clone().requires_grad_()
    # first call: per-process caches (quantile levels on the device) are built
    ck.espo.espo_loss(x, old, ent, adv, cu, mask, vocab_size=151936, backend=backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = ck.espo.espo_loss(
            x, old, ent, adv, cu, mask, vocab_size=151936, backend=backend
        )
        loss.backward()
        _ = metrics["clip_frac_high"] + metrics["kl_k3"]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rloss, rgrad, _ = _reference((lp, old, ent, adv, cu, mask), dict(vocab_size=151936))
    assert_verbose_allclose(loss.detach().cpu().double(), rloss.detach(), atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(x.grad.cpu().double(), rgrad, atol=1e-8, rtol=1e-5)
