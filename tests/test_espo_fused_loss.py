"""ck.espo.fused_linear_espo_loss (lm_head + log-probs + entropy + ESPO / GSPO /
GRPO loss; grad-in-forward and recompute strategies) vs the float64 reference:
fused_linear_logprobs_entropy_reference -> espo_loss_reference (+ entropy
bonus), gradients w.r.t. hidden and weight by autograd in float64. Packed
batches with odd sizes, a padding tail, masked tokens, chunks that cut
sequences (grpo) or hold several whole sequences (espo / gspo)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.espo.logprobs import mixed_addmm_supported, mixed_mm_supported
from compass_kernels.espo.reference_logprobs import fused_linear_logprobs_entropy_reference
from compass_kernels.espo.reference_loss import espo_loss_reference
from compass_kernels.testing import assert_verbose_allclose, make_generator

TOL = {"atol": 2e-5, "rtol": 1e-4}  # float32 GEMMs and statistics vs float64


def make_batch(lengths, tail, hidden, vocab, seed, per_token_adv=False, dtype=torch.float32):
    g = make_generator(seed)
    total = sum(lengths) + tail
    h = (torch.randn(total, hidden, generator=g) * 1.5).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) * 3).to(dtype)
    y = torch.randint(0, vocab, (total,), generator=g)
    with torch.no_grad():
        lp, ent = fused_linear_logprobs_entropy_reference(h, w, y)
    # old policy near the current one: ratios around 1, some clipped on both sides
    old = (lp + torch.randn(total, generator=g) * 0.15).float()
    old_ent = (ent + torch.rand(total, generator=g) * 0.3).float()
    n = len(lengths)
    adv = torch.randn(total if per_token_adv else n, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.rand(total, generator=g) > 0.15
    return h, w, y, old, old_ent, adv, cu, mask


def reference(h, w, y, old, old_ent, adv, cu, mask, entropy_coef, temperature, opts):
    hh = h.detach().double().requires_grad_()
    ww = w.detach().double().requires_grad_()
    lp, ent = fused_linear_logprobs_entropy_reference(hh, ww, y, temperature)
    loss, _ = espo_loss_reference(lp, old, old_ent, adv, cu, mask, **opts)
    if entropy_coef:
        n, total = cu.numel() - 1, y.numel()
        cl = cu.tolist()
        wt = torch.zeros(total, dtype=torch.float64)
        for i in range(n):
            seg = torch.zeros(total, dtype=torch.bool)
            seg[cl[i] : cl[i + 1]] = True
            seg &= mask
            if seg.any():
                wt[seg] = 1.0 / (n * int(seg.sum()))
        loss = loss - entropy_coef * (ent * wt).sum()
    loss.backward()
    return loss.detach(), lp.detach(), ent.detach(), hh.grad, ww.grad


CASES = [
    # lengths, padding tail, H, V, token_chunk, options
    ((7, 13, 1, 9), 3, 17, 301, 8, {"mode": "grpo"}),  # chunks cut sequences
    ((5, 11, 4), 0, 9, 517, 3, {"mode": "grpo", "clip": (0.2, 0.28), "dual_clip": 3.0}),
    ((6, 9, 4, 12, 3), 2, 11, 257, 16, {"mode": "espo", "clip": 0.1}),
    ((6, 9, 4, 12, 3), 2, 11, 257, 12, {"mode": "espo", "grouping": "sequence"}),
    ((10, 3, 8), 1, 13, 129, 11, {"mode": "gspo", "clip": (0.05, 0.06)}),
    ((4, 17), 0, 7, 1031, 17, {"mode": "espo", "num_groups": 3, "drop_low": True}),
]


@pytest.mark.parametrize("strategy", ["grad_in_forward", "recompute"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, strategy):
    lengths, tail, hidden, vocab, chunk, opts = CASES[case]
    per_tok = case == 1
    h, w, y, old, old_ent, adv, cu, mask = make_batch(
        lengths, tail, hidden, vocab, seed=case, per_token_adv=per_tok
    )
    coef = 0.01 if case % 2 == 0 else 0.0
    temp = 0.9 if case == 2 else 1.0
    ref_opts = dict(opts)
    if opts["mode"] == "espo" and "clip" not in opts:
        ref_opts["vocab_size"] = vocab
    ref_loss, ref_lp, ref_ent, ref_dh, ref_dw = reference(
        h,
        w,
        y,
        old,
        old_ent,
        adv,
        cu,
        mask,
        coef,
        temp,
        dict(ref_opts, advantages_per_token=per_tok),
    )
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, metrics, lp, ent = ck.espo.fused_linear_espo_loss(
        hq,
        wq,
        y,
        old,
        old_ent,
        adv,
        cu,
        mask,
        entropy_coef=coef,
        temperature=temp,
        strategy=strategy,
        token_chunk=chunk,
        advantages_per_token=per_tok,
        **opts,
    )
    (loss * 3.0).backward()  # a non-unit upstream gradient: the stored grads scale
    assert_verbose_allclose(lp, ref_lp.float(), name="logprobs", **TOL)
    assert_verbose_allclose(ent, ref_ent.float(), name="entropy", **TOL)
    assert_verbose_allclose(loss.double(), ref_loss, name="loss", atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(hq.grad, 3 * ref_dh.float(), name="d_hidden", **TOL)
    assert_verbose_allclose(wq.grad, 3 * ref_dw.float(), name="d_weight", **TOL)
    assert float(metrics["tokens"]) == float(mask[: int(cu[-1])].sum())
    if coef:
        assert "entropy_loss_term" in metrics


def test_bf16_grad_in_forward():
    h, w, y, old, old_ent, adv, cu, mask = make_batch(
        (9, 14), 1, 16, 300, seed=7, dtype=torch.bfloat16
    )
    ref_loss, _, _, ref_dh, ref_dw = reference(
        h, w, y, old, old_ent, adv, cu, mask, 0.0, 1.0, {"mode": "grpo"}
    )
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _, _, _ = ck.espo.fused_linear_espo_loss(
        hq, wq, y, old, old_ent, adv, cu, mask, mode="grpo", token_chunk=5
    )
    loss.backward()
    assert hq.grad.dtype == torch.bfloat16 and wq.grad.dtype == torch.bfloat16
    assert_verbose_allclose(loss.double(), ref_loss, name="loss", atol=1e-5, rtol=1e-4)
    assert_verbose_allclose(hq.grad.float(), ref_dh.float(), name="d_hidden", atol=1e-4, rtol=2e-2)
    assert_verbose_allclose(wq.grad.float(), ref_dw.float(), name="d_weight", atol=1e-4, rtol=2e-2)


def test_frozen_weight_and_auto_strategy():
    """Only hidden requires grad; "auto" falls back to recompute for an espo
    sequence longer than token_chunk and gives the same gradient."""
    h, w, y, old, old_ent, adv, cu, mask = make_batch((3, 20), 0, 8, 100, seed=3)
    grads = []
    for chunk in (32, 8):  # 32: grad_in_forward; 8: the 20-token sequence does not fit
        hq = h.clone().requires_grad_()
        loss, _, _, _ = ck.espo.fused_linear_espo_loss(
            hq, w, y, old, old_ent, adv, cu, mask, mode="espo", clip=0.2, token_chunk=chunk
        )
        loss.backward()
        grads.append(hq.grad)
    assert_verbose_allclose(grads[0], grads[1], name="d_hidden auto", **TOL)


def test_bad_inputs():
    h, w, y, old, old_ent, adv, cu, mask = make_batch((3, 20), 0, 8, 100, seed=4)
    f = ck.espo.fused_linear_espo_loss
    args = (h, w, y, old, old_ent, adv, cu, mask)
    with pytest.raises(ValueError, match="strategy"):
        f(*args, strategy="fast")
    with pytest.raises(ValueError, match="grad_in_forward"):
        f(*args, mode="espo", clip=0.2, token_chunk=8, strategy="grad_in_forward")
    with pytest.raises(ValueError, match="token_chunk"):
        f(*args, mode="grpo", token_chunk=0)
    with pytest.raises(ValueError, match="mode"):
        f(*args, mode="ppo")
    with pytest.raises(ValueError, match="old_logprobs"):
        f(h, w, y, old[:-1], old_ent, adv, cu, mask, mode="grpo")
    with pytest.raises(ValueError, match="weight"):
        f(h, w[:, :-1], y, old, old_ent, adv, cu, mask, mode="grpo")
    with pytest.raises(ValueError, match="targets"):
        f(h, w, y + 100, old, old_ent, adv, cu, mask, mode="grpo")
    with pytest.raises(ValueError, match="entropy_coef"):
        f(*args, mode="grpo", entropy_coef=float("nan"))
    with pytest.raises(TypeError, match="unexpected"):
        f(*args, mode="grpo", epsilon=0.2)


@pytest.mark.parametrize("strategy", ["grad_in_forward", "recompute"])
def test_loss_inputs_checked_before_any_gemm_without_running_the_loss(strategy, monkeypatch):
    """Bad loss inputs raise before the first GEMM (check_loss_inputs), and the
    check itself runs no ESPO loss kernel: metadata errors (a wrong length, a
    bad cu_seqlens dtype) and, on the CPU by default, data errors (non-finite
    advantages, bad offsets)."""
    from compass_kernels.espo import fused_loss

    h, w, y, old, old_ent, adv, cu, mask = make_batch((3, 20), 0, 8, 100, seed=4)
    f = ck.espo.fused_linear_espo_loss
    mixed_mm_supported(h.device)
    mixed_addmm_supported(h.device)
    bad_adv = adv.clone()
    bad_adv[1] = float("nan")
    bad_cu = cu.clone()
    bad_cu[1] = cu[-1] + 1
    cases = [
        ("old_entropy", dict(old_entropy=old_ent[:-1])),
        ("cu_seqlens", dict(cu_seqlens=cu.float())),
        ("advantages", dict(advantages=bad_adv)),
        ("cu_seqlens", dict(cu_seqlens=bad_cu)),
    ]
    ran = []

    def reached(*a, **k):
        ran.append(1)
        raise AssertionError("the loss or a GEMM ran before the input check")

    for fn in ("espo_loss", "fused_linear_logprobs_entropy", "_grad_in_forward"):
        monkeypatch.setattr(fused_loss, fn, reached)
    base = dict(old_logprobs=old, old_entropy=old_ent, advantages=adv, cu_seqlens=cu, mask=mask)
    for i, (name, bad) in enumerate(cases):
        kw = base | bad
        call = (
            h,
            w,
            y,
            kw["old_logprobs"],
            kw["old_entropy"],
            kw["advantages"],
            kw["cu_seqlens"],
            kw["mask"],
        )
        if i < 2:  # metadata: no GEMM recorded (a dispatch mode skips data checks)
            with _MatmulDtypes() as rec, pytest.raises(ValueError, match=name):
                f(*call, mode="grpo", strategy=strategy)
            assert rec.calls == [], (name, rec.calls)
        else:  # data, checked on the CPU by default
            with pytest.raises(ValueError, match=name):
                f(*call, mode="grpo", strategy=strategy)
    assert ran == []


def test_second_backward_refused():
    h, w, y, old, old_ent, adv, cu, mask = make_batch((5, 6), 0, 8, 50, seed=5)
    hq = h.clone().requires_grad_()
    loss, _, _, _ = ck.espo.fused_linear_espo_loss(
        hq, w, y, old, old_ent, adv, cu, mask, mode="grpo"
    )
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        loss.backward()


def test_grpo_matches_liger():
    """mode="grpo" equals Liger-Kernel's LigerFusedLinearGRPOLoss (loss_type
    "grpo", seq-mean-token-mean; a bench dependency installed by setup_env.sh)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    seqs, seq_len, hidden, vocab = 3, 11, 13, 211
    h, w, y, old, old_ent, adv, cu, _ = make_batch([seq_len] * seqs, 0, hidden, vocab, seed=9)
    mask = torch.ones(seqs, seq_len)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    liger = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        compiled=False,
        loss_type="grpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        chunk_size=1,
    )
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref, _ = liger(
        hl.view(seqs, seq_len, hidden),
        wl,
        y.view(seqs, seq_len),
        mask,
        adv,
        old_per_token_logps=old.view(seqs, seq_len),
    )
    ref.backward()
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _, _, _ = ck.espo.fused_linear_espo_loss(
        hq, wq, y, old, old_ent, adv, cu, mask.view(-1).bool(), mode="grpo", token_chunk=8
    )
    loss.backward()
    assert_verbose_allclose(loss, ref.float(), name="loss", atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(hq.grad, hl.grad, name="d_hidden", **TOL)
    assert_verbose_allclose(wq.grad, wl.grad, name="d_weight", **TOL)


def test_no_grad_forward_only():
    """Under no_grad only the logits GEMM runs; loss and log-probs are unchanged."""
    h, w, y, old, old_ent, adv, cu, mask = make_batch((5, 6, 2), 1, 8, 70, seed=6)
    ref_loss, ref_lp, _, _, _ = reference(
        h, w, y, old, old_ent, adv, cu, mask, 0.0, 1.0, {"mode": "grpo"}
    )
    with torch.no_grad():
        loss, _, lp, _ = ck.espo.fused_linear_espo_loss(
            h.requires_grad_(), w, y, old, old_ent, adv, cu, mask, mode="grpo"
        )
    assert loss.grad_fn is None
    assert_verbose_allclose(loss.double(), ref_loss, name="loss", atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(lp, ref_lp.float(), name="logprobs", **TOL)


# --------------------------------------------- no host read of cu_seqlens

_SYNCING = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_host_plan_reads_no_tensor(monkeypatch):
    """With cu_seqlens_host the espo chunk plan reads no tensor on the host:
    every tensor -> host conversion (a sync on a GPU) raises during the call,
    and the results equal the call that plans from cu_seqlens itself."""
    h, w, y, old, old_ent, adv, cu, mask = make_batch((6, 9, 4, 12, 3), 2, 11, 257, seed=12)
    f = ck.espo.fused_linear_espo_loss
    kw = {
        "mode": "espo",
        "clip": 0.1,
        "strategy": "grad_in_forward",
        "token_chunk": 16,
        "validate": False,
    }
    hq = h.clone().requires_grad_()
    ref_loss, _, ref_lp, _ = f(hq, w, y, old, old_ent, adv, cu, mask, **kw)
    ref_loss.backward()
    cu_host = [0, 6, 15, 19, 31, 34]

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host read Tensor.{name} during the call")

        return method

    with monkeypatch.context() as m:
        for name in _SYNCING:
            m.setattr(torch.Tensor, name, refuse(name))
        hq2 = h.clone().requires_grad_()
        loss, _, lp, _ = f(hq2, w, y, old, old_ent, adv, cu, mask, cu_seqlens_host=cu_host, **kw)
        loss.backward()
        # the patch does catch a host read: planning from cu_seqlens needs one
        with pytest.raises(AssertionError, match="host read"):
            f(h, w, y, old, old_ent, adv, cu, mask, **kw)
    assert torch.equal(loss, ref_loss) and torch.equal(lp, ref_lp)
    assert torch.equal(hq2.grad, hq.grad)


def test_device_cu_seqlens_without_host_copy_is_refused():
    """A cu_seqlens that is not on the CPU (meta stands in for CUDA here) and
    no cu_seqlens_host: a clear error, never a host read; given the host copy
    the device tensor is not read."""
    from compass_kernels.espo.fused_loss import _host_offsets

    cu = torch.tensor([0, 3, 7], device="meta")
    with pytest.raises(ValueError, match="cu_seqlens_host: required with cu_seqlens on meta"):
        _host_offsets(cu, None, 7, None)
    assert _host_offsets(cu, np.array([0, 3, 7]), 7, None) == [0, 3, 7]
    assert _host_offsets(cu, torch.tensor([0, 3, 7], dtype=torch.int32), 7, False) == [0, 3, 7]


def test_bad_cu_seqlens_host():
    h, w, y, old, old_ent, adv, cu, mask = make_batch((3, 5), 0, 8, 50, seed=13)
    f = ck.espo.fused_linear_espo_loss
    args = (h, w, y, old, old_ent, adv, cu, mask)
    for bad, what in (
        ([0, 3], "expected 3 offsets"),
        ([0, 5, 3], "non-decreasing"),
        ([1, 3, 8], "non-decreasing"),
        ([0, 3, 9], "at most 8"),
        ([0, 4, 8], "values of cu_seqlens"),
        ([[0, 3, 8]], "1-d sequence of ints"),
        ([0.0, 3.0, 8.0], "1-d sequence of ints"),
    ):
        with pytest.raises(ValueError, match=f"cu_seqlens_host: .*{what}"):
            f(*args, mode="espo", clip=0.2, cu_seqlens_host=bad)
    with pytest.raises(ValueError, match="cu_seqlens_host: expected a host"):
        f(*args, mode="espo", clip=0.2, cu_seqlens_host=torch.tensor([0, 3, 8], device="meta"))


# ------------------------------------- vocab tensor parallelism (gloo, TP=2)

TP_CASE = ((7, 13, 1, 9), 3, 17, 302)  # lengths, tail, H, V (two shards of 151)
TP_RUNS = (  # (options, strategy, token_chunk, bf16 inputs with grad_gemm_dtype="input")
    ({"mode": "grpo"}, "grad_in_forward", 8, False),
    ({"mode": "espo", "clip": 0.1}, "grad_in_forward", 16, False),
    ({"mode": "grpo"}, "recompute", 8, False),
    ({"mode": "grpo"}, "grad_in_forward", 8, True),
    ({"mode": "espo", "clip": 0.1}, "recompute", 8, True),
)


class _GemmCount:
    """Counts aten matmuls (mm, addmm) while active."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in (
                    torch.ops.aten.mm,
                    torch.ops.aten.addmm,
                    torch.ops.aten.addmm_,
                ):
                    counter.n += 1
                return func(*args, **(kwargs or {}))

        self.n = 0
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _run_tp(rank, world, group, opts, strategy, chunk, bf16):
    lengths, tail, hidden, vocab = TP_CASE
    dtype = torch.bfloat16 if bf16 else torch.float32
    h, w, y, old, old_ent, adv, cu, mask = make_batch(
        lengths, tail, hidden, vocab, seed=21, dtype=dtype
    )
    shard = vocab // world
    hq = h.clone().requires_grad_()
    wq = w[rank * shard : (rank + 1) * shard].clone().requires_grad_()
    # the mixed-mm probes (one 2 x 2 mm / addmm per process, cached) run before the count
    mixed_mm_supported(h.device)
    mixed_addmm_supported(h.device)
    with _GemmCount() as count:
        loss, _, lp, ent = ck.espo.fused_linear_espo_loss(
            hq,
            wq,
            y,
            old,
            old_ent,
            adv,
            cu,
            mask,
            entropy_coef=0.01,
            temperature=0.9,
            strategy=strategy,
            token_chunk=chunk,
            tp_group=group,
            grad_gemm_dtype="input" if bf16 else "auto",
            **opts,
        )
        (loss * 2.0).backward()
    return {
        "loss": loss.detach(),
        "lp": lp,
        "ent": ent,
        "dh": hq.grad,
        "dw": wq.grad,
        "gemms": count.n,
    }


def _tp_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out = [_run_tp(rank, world, dist.group.WORLD, *run) for run in TP_RUNS]
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_vocab_tensor_parallel_two_gloo_ranks_equal_one_process(tmp_path):
    """TP=2 (gloo, two processes) equals one process for grad_in_forward (grpo
    and espo) and recompute; grad_in_forward stays at 3 GEMMs per chunk under
    TP (the recompute path at 4). Also bf16 inputs with bf16 gradient GEMMs
    (within the bf16 tolerances: each rank rounds its partial d_hidden)."""
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_tp_worker, args=(world, f"file://{tmp_path}/store", str(tmp_path)), nprocs=world)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    total = sum(TP_CASE[0]) + TP_CASE[1]
    for i, (opts, strategy, chunk, bf16) in enumerate(TP_RUNS):
        one = _run_tp(0, 1, None, opts, strategy, chunk, bf16)
        name = f"{opts['mode']} {strategy}{' bf16' if bf16 else ''}"
        for r in range(world):
            got = parts[r][i]
            for key in ("loss", "lp", "ent", "dh"):
                if bf16 and key == "dh":
                    _close_bf16(got[key], one[key], f"{name} rank {r} {key}")
                    continue
                assert_verbose_allclose(got[key], one[key], name=f"{name} rank {r} {key}", **TOL)
        d_weight = torch.cat([parts[r][i]["dw"] for r in range(world)])
        if bf16:
            assert d_weight.dtype == torch.bfloat16
            _close_bf16(d_weight, one["dw"], f"{name} d_weight shards")
        else:
            assert_verbose_allclose(d_weight, one["dw"], name=f"{name} d_weight shards", **TOL)
        chunks = math.ceil(total / chunk) if opts["mode"] == "grpo" else None
        if strategy == "grad_in_forward" and chunks is not None:
            assert parts[0][i]["gemms"] == one["gemms"] == 3 * chunks
        if strategy == "recompute":  # 4 GEMMs per (token chunk, vocab chunk) tile
            assert parts[0][i]["gemms"] == one["gemms"] == 4 * math.ceil(total / chunk)


# ------------------------------- gradient GEMM operand dtype (grad_gemm_dtype)

#: bf16 inputs, gradient GEMMs on bf16 operands ("input"), vs float64 from the
#: same bf16 values: the float32 d logits tile rounded once to bf16 (2^-9
#: relative), on the CPU the GEMM product rounded to bf16 (2^-9) and the final
#: store of d_hidden / d_weight in bf16 (2^-9): per element within 2e-2 of the
#: reference's scale, in norm within 1e-2.
BF16_REL = 2e-2
BF16_NORM = 1e-2


def _close_bf16(got, ref, name):
    got, ref = got.double(), ref.double()
    scale = float(ref.abs().max())
    assert_verbose_allclose(got, ref, name=name, atol=BF16_REL * scale, rtol=BF16_REL)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < BF16_NORM, f"{name}: relative error in norm {rel:.2e} >= {BF16_NORM}"


class _MatmulDtypes:
    """Records (overload name, operand dtypes) of aten mm / addmm while active;
    with ``emulate_mixed`` also runs torch.mm(out_dtype=float32) on the CPU
    (float32 GEMM of the half operands: what a CUDA mixed mm computes, up to
    the summation order) so the CUDA branch is exercised here."""

    def __init__(self, emulate_mixed=False):
        self.emulate = emulate_mixed

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self
        mm_dtype = (torch.ops.aten.mm.dtype, torch.ops.aten.mm.dtype_out)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.overloadpacket in (
                    torch.ops.aten.mm,
                    torch.ops.aten.addmm,
                    torch.ops.aten.addmm_,
                ):
                    mats = args[:2] if func.overloadpacket is torch.ops.aten.mm else args[1:3]
                    rec.calls.append((func._overloadname, tuple(m.dtype for m in mats)))
                    if rec.emulate and func in mm_dtype:
                        r = torch.mm(args[0].float(), args[1].float())
                        return kwargs["out"].copy_(r) if "out" in kwargs else r
                    if rec.emulate and func is torch.ops.aten.addmm.dtype_out:
                        # in-place float32 accumulation: acc + (float32 GEMM of half operands)
                        r = args[0].float() + torch.mm(args[1].float(), args[2].float())
                        return kwargs["out"].copy_(r)
                return func(*args, **kwargs)

        self.calls = []
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


BF16_CASES = [  # case index into CASES, strategy
    (0, "grad_in_forward"),  # grpo, chunks cut sequences, entropy bonus
    (0, "recompute"),
    (2, "grad_in_forward"),  # espo, temperature 0.9, entropy bonus
    (2, "recompute"),
    (4, "grad_in_forward"),  # gspo
]


@pytest.mark.parametrize(("case", "strategy"), BF16_CASES)
def test_bf16_input_grad_gemms_match_reference(case, strategy):
    """bf16 hidden / weight with grad_gemm_dtype="input" (the CUDA default):
    loss, log-probs and entropy as tight as float32 (the logits GEMM is exact
    in the bf16 inputs), gradients within the bf16 tolerances above."""
    lengths, tail, hidden, vocab, chunk, opts = CASES[case]
    h, w, y, old, old_ent, adv, cu, mask = make_batch(
        lengths, tail, hidden, vocab, seed=40 + case, dtype=torch.bfloat16
    )
    coef = 0.01 if case % 2 == 0 else 0.0
    temp = 0.9 if case == 2 else 1.0
    ref_loss, ref_lp, _, ref_dh, ref_dw = reference(
        h, w, y, old, old_ent, adv, cu, mask, coef, temp, opts
    )
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    with _MatmulDtypes() as rec:
        loss, _, lp, _ = ck.espo.fused_linear_espo_loss(
            hq,
            wq,
            y,
            old,
            old_ent,
            adv,
            cu,
            mask,
            entropy_coef=coef,
            temperature=temp,
            strategy=strategy,
            token_chunk=chunk,
            grad_gemm_dtype="input",
            **opts,
        )
        (loss * 3.0).backward()
    assert hq.grad.dtype == torch.bfloat16 and wq.grad.dtype == torch.bfloat16
    assert_verbose_allclose(lp, ref_lp.float(), name="logprobs", **TOL)
    assert_verbose_allclose(loss.double(), ref_loss, name="loss", atol=1e-5, rtol=1e-4)
    _close_bf16(hq.grad, 3 * ref_dh, "d_hidden")
    _close_bf16(wq.grad, 3 * ref_dw, "d_weight")
    assert any(d == (torch.bfloat16, torch.bfloat16) for _, d in rec.calls)


def _gemm_dtypes(strategy, option, emulate_mixed=False, dtype=torch.bfloat16):
    h, w, y, old, old_ent, adv, cu, mask = make_batch(
        (7, 13, 1, 9), 3, 17, 301, seed=50, dtype=dtype
    )
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    mixed_mm_supported(h.device)  # the probe's mm (cached) runs before the record
    mixed_addmm_supported(h.device)
    with _MatmulDtypes(emulate_mixed) as rec:
        loss, _, _, _ = ck.espo.fused_linear_espo_loss(
            hq,
            wq,
            y,
            old,
            old_ent,
            adv,
            cu,
            mask,
            mode="grpo",
            strategy=strategy,
            token_chunk=8,
            grad_gemm_dtype=option,
        )
        loss.backward()
    return rec.calls, (h, w, y, old, old_ent, adv, cu, mask), hq.grad, wq.grad


@pytest.mark.parametrize("strategy", ["grad_in_forward", "recompute"])
def test_grad_gemm_operand_dtypes(strategy):
    """The gradient GEMMs' operands are what grad_gemm_dtype says: bf16 for
    "input"; float32 for "fp32" and for "auto" on the CPU. On the CPU (no
    mixed mm) the logits GEMMs take float32 copies. 33 tokens, chunks of 8: 5
    chunks; recompute: 5 token tiles x 1 vocab tile."""
    bf, f32 = (torch.bfloat16,) * 2, (torch.float32,) * 2
    logits = 5 if strategy == "grad_in_forward" else 10  # recompute: forward + backward
    for option, grad_ops in (("input", bf), ("fp32", f32), ("auto", f32)):
        calls, *_ = _gemm_dtypes(strategy, option)
        dts = [d for _, d in calls]
        assert len(dts) == logits + 10, (option, calls)
        assert dts.count(bf) == (10 if grad_ops == bf else 0), (option, calls)
        assert dts.count(f32) == logits + (10 if grad_ops == f32 else 0), (option, calls)


@pytest.mark.parametrize("strategy", ["grad_in_forward", "recompute"])
def test_mixed_mm_branch_emulated(strategy, monkeypatch):
    """The CUDA branch (torch.mm(out_dtype=float32) of bf16 operands, probed
    at run time) on the CPU with that overload emulated: every GEMM (logits
    too) takes bf16 operands through mm.dtype_out, and the gradients match the
    float64 reference (no product rounding: tighter than the CPU branch)."""
    from compass_kernels.espo import logprobs

    monkeypatch.setitem(logprobs._MIXED_MM, "cpu", True)
    calls, batch, dh, dw = _gemm_dtypes(strategy, "input", emulate_mixed=True)
    assert {c for c, _ in calls} == {"dtype_out"}, calls
    assert all(d == (torch.bfloat16, torch.bfloat16) for _, d in calls), calls
    _, _, _, ref_dh, ref_dw = reference(*batch, 0.0, 1.0, {"mode": "grpo"})
    _close_bf16(dh, ref_dh, "d_hidden")
    _close_bf16(dw, ref_dw, "d_weight")


@pytest.mark.parametrize("strategy", ["grad_in_forward", "recompute"])
def test_mixed_addmm_branch_emulated(strategy, monkeypatch):
    """The CUDA branch with torch.addmm(acc, g, x, out_dtype=float32, out=acc)
    (float32 accumulation of d_weight / d_hidden in place, no float32 product
    temporary) emulated on the CPU: every accumulating gradient GEMM goes
    through addmm.dtype_out on bf16 operands, no plain add of a product, and
    the gradients match the float64 reference."""
    from compass_kernels.espo import logprobs

    monkeypatch.setitem(logprobs._MIXED_MM, "cpu", True)
    monkeypatch.setitem(logprobs._MIXED_ADDMM, "cpu", True)
    calls, batch, dh, dw = _gemm_dtypes(strategy, "input", emulate_mixed=True)
    assert {c for c, _ in calls} == {"dtype_out"}, calls
    assert all(d == (torch.bfloat16, torch.bfloat16) for _, d in calls), calls
    assert "in place" in logprobs.grad_gemm_info("input", torch.bfloat16, torch.device("cpu"))
    _, _, _, ref_dh, ref_dw = reference(*batch, 0.0, 1.0, {"mode": "grpo"})
    _close_bf16(dh, ref_dh, "d_hidden")
    _close_bf16(dw, ref_dw, "d_weight")


def test_mixed_mm_probe_on_cpu():
    """CPU torch 2.13 has no mm(out_dtype): the probe says so, and the auto
    choice on the CPU is float32 operands."""
    from compass_kernels.espo import logprobs

    cpu = torch.device("cpu")
    assert logprobs.mixed_mm_supported(cpu) is False
    assert logprobs.mixed_addmm_supported(cpu) is False
    assert logprobs.resolve_grad_gemm_dtype("auto", torch.bfloat16, cpu) == torch.float32
    assert logprobs.resolve_grad_gemm_dtype("input", torch.bfloat16, cpu) == torch.bfloat16
    assert logprobs.resolve_grad_gemm_dtype("input", torch.float32, cpu) == torch.float32
    assert "bfloat16 product" in logprobs.grad_gemm_info("input", torch.bfloat16, cpu)
    h, w, y, old, old_ent, adv, cu, mask = make_batch((3, 5), 0, 8, 50, seed=51)
    with pytest.raises(ValueError, match="grad_gemm_dtype: expected one of"):
        ck.espo.fused_linear_espo_loss(
            h, w, y, old, old_ent, adv, cu, mask, mode="grpo", grad_gemm_dtype="bf16"
        )
    with pytest.raises(ValueError, match="grad_gemm_dtype"):
        ck.espo.fused_linear_logprobs_entropy(h, w, y, grad_gemm_dtype=torch.bfloat16)


@pytest.mark.parametrize("strategy", ["grad_in_forward", "recompute"])
def test_small_target_gradient_survives_bf16(strategy):
    """A token whose target probability is ~1 - 1e-4: its d logits are
    coef * (p - onehot), ~1e-4 at the target. Formed in float32 and rounded
    once to bf16 it survives; rounding p to bf16 first (1 - 1e-4 -> 1.0)
    would zero the target term and leave d_hidden of that token wrong by
    O(1). The token's d_hidden row matches the float64 reference within the
    bf16 tolerance."""
    g = make_generator(60)
    total, hidden, vocab, hot = 6, 16, 64, 3
    w = torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden)
    y = torch.randint(0, vocab, (total,), generator=g)
    h = torch.randn(total, hidden, generator=g)
    # the hot token: logits of its target ~13 above the rest (p_target ~ 1 - 1e-4)
    w[y[hot]] *= 3.0
    h[hot] = w[y[hot]] / w[y[hot]].norm() ** 2 * 13.0
    h, w = h.to(torch.bfloat16), w.to(torch.bfloat16)
    with torch.no_grad():
        lp, ent = fused_linear_logprobs_entropy_reference(h, w, y)
    miss = float(-torch.expm1(lp[hot]))
    assert 2e-5 < miss < 5e-4, miss  # 1 - p_target
    cu = torch.tensor([0, total], dtype=torch.int32)
    old, old_ent, adv = lp.float(), ent.float(), torch.tensor([1.0])
    _, _, _, ref_dh, _ = reference(h, w, y, old, old_ent, adv, cu, None, 0.0, 1.0, {"mode": "grpo"})
    hq = h.clone().requires_grad_()
    loss, _, _, _ = ck.espo.fused_linear_espo_loss(
        hq,
        w,
        y,
        old,
        old_ent,
        adv,
        cu,
        None,
        mode="grpo",
        strategy=strategy,
        grad_gemm_dtype="input",
    )
    loss.backward()
    row, ref_row = hq.grad[hot].double(), ref_dh[hot]
    # the target term coef * (p - 1) w_y is most of this row
    coef = -1.0 / total
    target_term = coef * -miss * w[y[hot]].double()
    assert float(target_term.norm()) > 0.5 * float(ref_row.norm())
    rel = float((row - ref_row).norm() / ref_row.norm())
    assert rel < BF16_NORM * 2, f"hot token d_hidden: relative error {rel:.2e}"


@pytest.mark.parametrize("emulate_mixed", [False, True])
def test_fused_logprobs_bf16_input_tiles(emulate_mixed, monkeypatch):
    """fused_linear_logprobs_entropy (the recompute backward) with bf16 inputs
    and grad_gemm_dtype="input" over several token x vocab tiles (the first
    tile of each sum writes, the others accumulate in float32), on the CPU
    branch and on the emulated CUDA branch, vs float64."""
    from compass_kernels.espo import logprobs

    if emulate_mixed:
        monkeypatch.setitem(logprobs._MIXED_MM, "cpu", True)
    logprobs.mixed_mm_supported(torch.device("cpu"))  # the probe's mm runs before the record
    logprobs.mixed_addmm_supported(torch.device("cpu"))
    g = make_generator(70)
    total, hidden, vocab = 23, 19, 211
    h = (torch.randn(total, hidden, generator=g) * 1.5).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) * 3).to(torch.bfloat16)
    y = torch.randint(0, vocab, (total,), generator=g)
    gl, gh = torch.randn(total, generator=g), torch.randn(total, generator=g) * 0.1
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    ref_lp, ref_ent = fused_linear_logprobs_entropy_reference(hh, ww, y, 0.8)
    ((ref_lp * gl.double()).sum() + (ref_ent * gh.double()).sum()).backward()
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    with _MatmulDtypes(emulate_mixed) as rec:
        lp, ent = ck.espo.fused_linear_logprobs_entropy(
            hq, wq, y, temperature=0.8, token_chunk=7, vocab_chunk=33, grad_gemm_dtype="input"
        )
        ((lp * gl).sum() + (ent * gh).sum()).backward()
    tiles = math.ceil(total / 7) * math.ceil(vocab / 33)
    bf = (torch.bfloat16, torch.bfloat16)
    assert sum(d == bf for _, d in rec.calls) == (4 if emulate_mixed else 2) * tiles, rec.calls
    assert_verbose_allclose(lp, ref_lp.detach().float(), name="logprobs", **TOL)
    _close_bf16(hq.grad, hh.grad, "d_hidden")
    _close_bf16(wq.grad, ww.grad, "d_weight")
