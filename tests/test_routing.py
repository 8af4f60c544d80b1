"""ck.routing.replay_topk: every backend against the float64 reference, gradients,
ties, bad inputs, op registration.

Backends: "torch" (the vectorised reference, CPU tensors) and "triton"
(interpreter on CPU tensors, or a GPU where one is), both against the
loop-level spec. Outputs are poisoned before each kernel runs.
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.routing import (
    SCORE_FUNCTIONS,
    ReplayStats,
    replay_topk,
    replay_topk_backward_op,
    replay_topk_op,
)
from compass_kernels.routing.reference import gate_weights_reference, replay_topk_reference
from compass_kernels.testing import (
    assert_bitwise_equal,
    assert_verbose_allclose,
    empty_poisoned,
    make_generator,
)

TRITON = pytest.param("triton", marks=pytest.mark.triton)
BACKENDS = ["torch", TRITON]


@pytest.fixture
def dev(backend_device) -> str:
    return backend_device


def make_case(
    t,
    e,
    k,
    seed,
    *,
    dtype=torch.float64,
    valid_frac=0.8,
    native_frac=0.3,
    ids_dtype=torch.int64,
    bias=False,
):
    """Logits, replayed ids (a mix of the native top-k, perturbed and random sets),
    valid mask and bias."""
    g = make_generator(seed)
    z = torch.randn(t, e, generator=g, dtype=torch.float64) * 2
    b = torch.randn(e, generator=g, dtype=torch.float64) * 0.05 if bias else None
    native = torch.topk(torch.softmax(z, -1), k).indices
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    keep = torch.rand(t, generator=g) < native_frac
    ids[keep] = native[keep]
    valid = torch.rand(t, generator=g) < valid_frac
    return z.to(dtype), ids.to(ids_dtype), valid, None if b is None else b.to(dtype)


def expected_counts(t, k, overlap, status, valid):
    cand = valid
    return [
        t,
        int(cand.sum()),
        int(overlap[cand].sum()),
        int(((overlap == k) & cand).sum()),
        int((status == 2).sum()),
        0,
    ]


def run_op(backend, dev, z, ids, bias, valid, sf, norm, scaling, ratio):
    t, e = z.shape
    k = ids.shape[1]
    out = [
        empty_poisoned((t, k), z.dtype, dev),
        empty_poisoned((t, e), torch.bool, dev),
        empty_poisoned(e, torch.int64, dev),
        empty_poisoned(6, torch.int64, dev),
        empty_poisoned((t, k), torch.int64, dev),
    ]
    mv = lambda x: None if x is None else x.to(dev)  # noqa: E731
    return replay_topk_op.run(
        logits=z.to(dev),
        expert_ids=ids.to(dev),
        expert_bias=mv(bias),
        valid=mv(valid),
        score_function=SCORE_FUNCTIONS[sf],
        normalize=norm,
        scaling=scaling,
        min_score_ratio=-1.0 if ratio is None else ratio,
        backend=backend,
        out=out,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "sf,norm,bias,ratio",
    [
        ("softmax", True, False, None),
        ("softmax", False, False, 0.5),
        ("sigmoid", True, True, None),
        ("sigmoid", False, True, 0.7),
    ],
)
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 67, 8), (70, 256, 8), (9, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_replay_matches_reference(backend, dev, sf, norm, bias, ratio, t, e, k, dtype):
    z, ids, valid, b = make_case(
        t,
        e,
        k,
        seed=t * 1000 + e + k,
        dtype=dtype,
        bias=bias,
        ids_dtype=torch.uint8 if e <= 256 else torch.int16,
    )
    scaling = 2.5
    w, rmap, tpe, counts, used = run_op(backend, dev, z, ids, b, valid, sf, norm, scaling, ratio)
    rw, rmap_ref, rtpe, rused, overlap, status = replay_topk_reference(
        z,
        ids,
        score_function=sf,
        normalize=norm,
        expert_bias=b,
        scaling=scaling,
        valid=valid,
        min_score_ratio=ratio,
    )
    assert_bitwise_equal(used.cpu(), rused)
    assert_bitwise_equal(rmap.cpu(), rmap_ref)
    assert_bitwise_equal(tpe.cpu(), rtpe)
    assert counts.cpu().tolist() == expected_counts(t, k, overlap, status, valid)
    atol, rtol = (1e-12, 1e-12) if dtype == torch.float64 else (2e-6, 2e-5)
    assert_verbose_allclose(w.cpu().double(), rw.detach(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "sf,norm", [("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False)]
)
@pytest.mark.parametrize("t,e,k", [(13, 40, 4), (5, 8, 1), (6, 300, 3)])
def test_replay_gradient_matches_reference(backend, dev, sf, norm, t, e, k):
    """d loss / d logits of every backend vs torch autograd of the float64
    reference, with replayed experts the native router would not pick."""
    z, ids, valid, b = make_case(t, e, k, seed=7 * t + e, native_frac=0.0, bias=sf == "sigmoid")
    z = z.to(dev).requires_grad_(True)
    ids_d = ids.to(dev)
    res = replay_topk(
        z,
        ids_d,
        score_function=sf,
        normalize=norm,
        scaling=1.7,
        expert_bias=None if b is None else b.to(dev),
        backend=backend,
    )
    gw = torch.randn(t, k, generator=make_generator(3), dtype=torch.float64).to(dev)
    (res.weights * gw).sum().backward()
    zr = z.detach().cpu().clone().requires_grad_(True)
    ref = gate_weights_reference(zr, ids, score_function=sf, normalize=norm, scaling=1.7)
    (ref * gw.cpu()).sum().backward()
    # The interpreter evaluates float64 in float64; on a GPU the Triton kernel's exp and
    # sums run in float32 (measured on the H100: max relative difference 2.8e-8).
    tol = dict(atol=1e-12, rtol=1e-10) if z.device.type == "cpu" else dict(atol=1e-8, rtol=1e-6)
    assert_verbose_allclose(z.grad.cpu(), zr.grad, **tol)
    # The replayed experts outside the native top-k get gradient (not zero;
    # softmax over a single selected logit is the constant 1).
    native = torch.topk(torch.softmax(zr.detach(), -1), k).indices
    outside = torch.zeros(t, e, dtype=torch.bool).scatter_(1, ids, True)
    outside.scatter_(1, native, False)
    if outside.any() and not (sf == "softmax" and norm and k == 1):
        assert (z.grad.cpu()[outside] != 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_kernel_writes_every_element(backend, dev):
    """The backward op on poisoned outputs, dense (softmax, no renorm) and sparse."""
    t, e, k = 37, 70, 6
    z, ids, _, _ = make_case(t, e, k, seed=11)
    g = torch.randn(t, k, dtype=torch.float64, generator=make_generator(12))
    for sf, norm in (("softmax", False), ("sigmoid", True), ("softmax", True)):
        out = empty_poisoned((t, e), torch.float64, dev)
        replay_topk_backward_op.run(
            grad_weights=g.to(dev),
            logits=z.to(dev),
            ids_used=ids.to(dev),
            score_function=SCORE_FUNCTIONS[sf],
            normalize=norm,
            scaling=0.5,
            backend=backend,
            out=out,
        )
        zr = z.clone().requires_grad_(True)
        (
            gate_weights_reference(zr, ids, score_function=sf, normalize=norm, scaling=0.5) * g
        ).sum().backward()
        assert_verbose_allclose(out.cpu(), zr.grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_native_ties_go_to_the_lower_index(backend, dev):
    """Integer-valued logits tie often; every missing row routes natively and the
    chosen set (and its order) must follow the lower-index rule on every backend."""
    t, e, k = 23, 70, 8
    g = make_generator(5)
    z = torch.randint(-2, 3, (t, e), generator=g).double()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    valid = torch.zeros(t, dtype=torch.bool)
    for sf in ("softmax", "sigmoid"):
        _, rmap, _, counts, used = run_op(backend, dev, z, ids, None, valid, sf, True, 1.0, None)
        _, _, _, rused, _, _ = replay_topk_reference(z, ids, score_function=sf, valid=valid)
        assert_bitwise_equal(used.cpu(), rused)
        assert counts.cpu().tolist() == [t, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigmoid_top1_is_not_normalized(backend, dev):
    """Megatron-core normalises sigmoid weights only when top_k > 1."""
    z, ids, _, _ = make_case(9, 16, 1, seed=2)
    w = run_op(backend, dev, z, ids, None, None, "sigmoid", True, 1.0, None)[0]
    assert_verbose_allclose(w.cpu(), torch.sigmoid(z).gather(1, ids), atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_agreement_is_one_when_trace_is_native(backend, dev):
    z, _, _, b = make_case(40, 64, 6, seed=9, bias=True)
    sel = torch.sigmoid(z) + b
    ids = torch.topk(sel, 6).indices.flip(-1)  # same sets, other order
    res = replay_topk(
        z.to(dev), ids.to(dev), score_function="sigmoid", expert_bias=b.to(dev), backend=backend
    )
    d = res.stats.as_dict()
    assert d["agreement"] == 1.0 and d["exact_match"] == 1.0 and d["fallback_rows"] == 0
    assert float(res.stats.agreement) == 1.0 and int(res.stats.replayed_rows) == 40
    ids2 = ids.clone()
    ids2[:, 0] = torch.topk(sel, 7).indices[:, 6]  # one expert off in every row
    res2 = replay_topk(
        z.to(dev), ids2.to(dev), score_function="sigmoid", expert_bias=b.to(dev), backend=backend
    )
    assert res2.stats.as_dict()["agreement"] == pytest.approx(5 / 6)
    assert res2.stats.as_dict()["exact_match"] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ids_raise_naming_the_row(backend, dev):
    z, ids, _, _ = make_case(12, 16, 4, seed=4)
    # validate=True: always checked on CPU; on a GPU the check is a host sync, opt-in.
    bad = ids.clone()
    bad[5, 2] = bad[5, 0]
    with pytest.raises(ValueError, match=r"expert_ids: expert \d+ twice in row 5"):
        replay_topk(z.to(dev), bad.to(dev), backend=backend, validate=True)
    bad = ids.clone()
    bad[7, 1] = 16
    with pytest.raises(
        ValueError, match=r"expert_ids: expert id 16 out of range \[0, 16\) at row 7"
    ):
        replay_topk(z.to(dev), bad.to(dev), backend=backend, validate=True)
    # A bad row marked missing is never read.
    valid = torch.ones(12, dtype=torch.bool)
    valid[7] = False
    res = replay_topk(z.to(dev), bad.to(dev), valid=valid.to(dev), backend=backend)
    assert int(res.stats.fallback_rows) == 1


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_kernels_count_bad_rows_without_reading_out_of_bounds(backend, dev):
    """The kernels never index with a bad id: the row is routed natively and
    counted (the public API then raises on CPU tensors, see above)."""
    if backend == "triton" and dev == "cpu" and not ck.routing.triton:
        pytest.skip("no triton")
    z, ids, _, _ = make_case(12, 40, 4, seed=4)
    ids[3, 1] = 200
    ids[8, 0] = ids[8, 3]
    _, _, _, counts, used = run_op(backend, dev, z, ids, None, None, "softmax", True, 1.0, None)
    assert counts.cpu().tolist()[5] == 2 and counts.cpu().tolist()[1] == 10
    native = torch.topk(torch.softmax(z, -1), 4).indices
    assert torch.equal(used.cpu()[3], native[3]) and torch.equal(used.cpu()[8], native[8])


def test_bad_arguments_name_the_argument():
    z = torch.randn(5, 8)
    ids = torch.zeros(5, 2, dtype=torch.int64)
    ids[:, 1] = 1
    cases = [
        ((z[0], ids), {}, "router_logits: expected a 2-d tensor"),
        ((z.int(), ids), {}, "router_logits: expected dtype"),
        ((z, ids.float()), {}, "expert_ids: expected dtype"),
        ((z, ids[:4]), {}, "expert_ids: expected 5 rows"),
        ((z, torch.zeros(5, 9, dtype=torch.int64)), {}, "top_k = 9 must be in"),
        ((z, ids), {"score_function": "relu"}, "score_function: expected"),
        ((z, ids), {"expert_bias": torch.zeros(7)}, r"expert_bias: expected shape \[8\]"),
        ((z, ids), {"valid": torch.ones(5)}, "valid: expected a bool tensor"),
        ((z, ids), {"valid": torch.ones(4, dtype=torch.bool)}, r"valid: expected shape \[5\]"),
        ((z, ids), {"min_score_ratio": -1.0}, "min_score_ratio: expected"),
        ((z, ids), {"scaling": float("nan")}, "scaling: expected a finite"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            replay_topk(*args, **kw)


def test_half_logits_and_weights_dtype():
    z, ids, valid, _ = make_case(20, 32, 4, seed=8, dtype=torch.float32)
    zb = z.bfloat16().requires_grad_(True)
    res = replay_topk(zb, ids, valid=valid)
    assert res.weights.dtype == torch.bfloat16
    res.weights.float().sum().backward()
    assert zb.grad is not None and zb.grad.dtype == torch.bfloat16
    ref = replay_topk_reference(zb.detach(), ids, valid=valid)[0]
    assert_verbose_allclose(res.weights.double(), ref, atol=1e-2, rtol=1e-2)


def test_stats_aggregate_and_properties():
    z, ids, valid, _ = make_case(50, 32, 4, seed=10)
    r1 = replay_topk(z, ids, valid=valid, min_score_ratio=0.9)
    r2 = replay_topk(z, ids, valid=valid)
    total = ReplayStats(r1.stats.counts + r2.stats.counts, 4)
    d = total.as_dict()
    assert d["rows"] == 100 and d["fallback_rows"] == 2 * int((~valid).sum())
    assert d["replayed_rows"] == 100 - d["fallback_rows"] - d["rejected_rows"]
    assert 0 < r1.stats.as_dict()["replace_rate"] <= 1 and r2.stats.as_dict()["replace_rate"] == 0
    assert r1.stats.replace_rate.dtype == torch.float64 and r1.stats.replace_rate.dim() == 0


def test_reference_gradcheck():
    z, ids, _, _ = make_case(4, 6, 3, seed=1)
    for sf in ("softmax", "sigmoid"):
        for norm in (True, False):

            def f(x, sf=sf, norm=norm):
                return gate_weights_reference(
                    x, ids, score_function=sf, normalize=norm, scaling=1.3
                )

            torch.autograd.gradcheck(f, (z.clone().requires_grad_(True),))


def test_opcheck_and_compile():
    z, ids, valid, b = make_case(9, 16, 4, seed=6, dtype=torch.float32, bias=True)
    args = (z.requires_grad_(True), ids, b, valid, 1, True, 2.0, 0.5)
    torch.library.opcheck(torch.ops.compass.replay_topk.default, args)
    g = torch.randn(9, 4)
    torch.library.opcheck(
        torch.ops.compass.replay_topk_backward.default, (g, z.detach(), ids, 0, False, 2.0)
    )

    def f(x):
        r = replay_topk(x, ids, valid=valid, score_function="sigmoid", expert_bias=b)
        return r.weights.sum() + r.tokens_per_expert.sum()

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.allclose(compiled(z.detach()), f(z.detach()))
    # With grad: compiled and eager both go through the registered autograd.
    x1, x2 = z.detach().clone().requires_grad_(True), z.detach().clone().requires_grad_(True)
    compiled(x1).backward()
    f(x2).backward()
    assert x1.grad is not None and torch.allclose(x1.grad, x2.grad)
    assert (x1.grad != 0).any()


# ------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton"])
@pytest.mark.parametrize("sf,bias", [("sigmoid", True), ("softmax", False)])
def test_gpu_replay_matches_reference_without_host_sync(backend, sf, bias):
    """DeepSeek-V3 / Qwen3 shapes on the device: outputs vs the float64 reference,
    gradients vs autograd of the reference, and no host sync anywhere in the
    forward, backward or the statistics (CUDA sync debug mode raises on one)."""
    t, e, k = 1000, 256 if bias else 128, 8
    z, ids, valid, b = make_case(
        t, e, k, seed=31, dtype=torch.float32, bias=bias, ids_dtype=torch.uint8
    )
    zc = z.cuda().requires_grad_(True)
    args = dict(
        score_function=sf,
        expert_bias=None if b is None else b.cuda(),
        scaling=2.5,
        valid=valid.cuda(),
        min_score_ratio=0.3,
    )
    g = torch.randn(t, k, device="cuda")
    ids_c = ids.cuda()  # the copy to the device is the caller's, outside the checked region
    replay_topk(zc, ids_c, **args, backend=backend)  # warm up (compiles, caches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = replay_topk(zc, ids_c, **args, backend=backend)
        (res.weights * g).sum().backward()
        agreement = res.stats.agreement
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rw, rmap, rtpe, rused, overlap, status = replay_topk_reference(
        z, ids, score_function=sf, expert_bias=b, scaling=2.5, valid=valid, min_score_ratio=0.3
    )
    assert torch.equal(res.expert_ids.cpu(), rused) and torch.equal(res.routing_map.cpu(), rmap)
    assert torch.equal(res.tokens_per_expert.cpu(), rtpe)
    assert res.stats.counts.cpu().tolist() == expected_counts(t, k, overlap, status, valid)
    assert_verbose_allclose(res.weights.cpu().double(), rw.detach(), atol=2e-6, rtol=2e-5)
    zr = z.clone().requires_grad_(True)
    ref = gate_weights_reference(zr, rused, score_function=sf, scaling=2.5)
    (ref * g.cpu().double()).sum().backward()
    assert_verbose_allclose(zc.grad.cpu().double(), zr.grad, atol=1e-5, rtol=1e-4)
    assert 0 <= float(agreement) <= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_wide_int16_ids(backend, dev):
    """T = 0 writes the (zeroed) counters; E = 300 experts with int16 ids (10 per lane)."""
    z = torch.randn(0, 16, dtype=torch.float64)
    ids = torch.zeros(0, 4, dtype=torch.uint8)
    w, rmap, tpe, counts, used = run_op(
        backend, dev, z, ids, None, None, "softmax", True, 1.0, None
    )
    assert w.shape == (0, 4) and counts.cpu().tolist() == [0] * 6 and tpe.cpu().eq(0).all()
    z, ids, valid, _ = make_case(11, 300, 6, seed=13, ids_dtype=torch.int16)
    w, rmap, tpe, counts, used = run_op(
        backend, dev, z, ids, None, valid, "sigmoid", True, 1.0, None
    )
    rw, rmap_ref, rtpe, rused, overlap, status = replay_topk_reference(
        z, ids, score_function="sigmoid", valid=valid
    )
    assert torch.equal(used.cpu(), rused) and torch.equal(tpe.cpu(), rtpe)
    assert_verbose_allclose(w.cpu(), rw.detach(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", [TRITON])
def test_gpu_kernel_limits_are_errors(backend, dev):
    z = torch.randn(3, 1100, dtype=torch.float64)
    ids = torch.stack([torch.arange(4)] * 3)
    with pytest.raises(ValueError, match="up to 1024 experts"):
        run_op(backend, dev, z, ids, None, None, "softmax", True, 1.0, None)
