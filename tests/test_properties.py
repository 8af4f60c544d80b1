"""Property-based tests of every public API (issue 21 item 7), with hypothesis.

Hypothesis draws the shapes (0, 1, odd), dtypes, strides (non-contiguous views)
and where non-finite values go; the values themselves come from a torch
generator seeded by hypothesis (random floats, not adversarial ties at a
quantile or a tolerance boundary). Each property's outcome is the reference
module's answer, or an error (ValueError / TypeError, TraceError for traces)
whose message names one of the function's arguments: never a crash or a hang.
Large shapes run on the meta device (shapes only, no data). Bounded:
derandomized, a few dozen examples per property, the file in well under a
minute on two CPU cores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import compass_kernels as ck
from compass_kernels.advantages import reference as aref
from compass_kernels.espo import reference_logprobs as lref
from compass_kernels.espo import reference_loss as sref
from compass_kernels.fp8 import reference as fref
from compass_kernels.fp8 import reference_gemm as gref
from compass_kernels.packing import reference as pref
from compass_kernels.routing import RoutingTrace, TraceError
from compass_kernels.routing import reference as rref

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(SETTINGS, max_examples=12)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _strided(x: torch.Tensor, step: int) -> torch.Tensor:
    """The same values as ``x`` in a view with stride ``step`` along dim 0 (step 1:
    x itself), so that kernels see non-contiguous inputs."""
    if step == 1 or x.dim() == 0:
        return x
    big = torch.empty((x.shape[0] * step, *x.shape[1:]), dtype=x.dtype)
    big[::step] = x
    return big[::step]


def _poison(x: torch.Tensor, where: int | None, value: float) -> torch.Tensor:
    """x with one element (flat index ``where`` mod numel) set to value."""
    if where is None or x.numel() == 0:
        return x
    x = x.clone()
    x.view(-1)[where % x.numel()] = value
    return x


def _names_an_argument(err: Exception, names: tuple[str, ...]) -> None:
    msg = str(err)
    assert any(n in msg for n in names), f"error names none of {names}: {msg!r}"


NONFINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
SEEDS = st.integers(0, 2**31 - 1)
STEPS = st.sampled_from([1, 2, 3])


# ------------------------------------------------------------- ck.advantages


@SETTINGS
@given(
    groups=st.lists(st.integers(1, 6), min_size=0, max_size=8),
    mode=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    id_dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
    ties=st.booleans(),
    step=STEPS,
    bad=st.none() | st.integers(0, 100),
    bad_value=NONFINITE,
    seed=SEEDS,
)
def test_group_advantages(groups, mode, dtype, id_dtype, ties, step, bad, bad_value, seed):
    g = _gen(seed)
    n = sum(groups)
    gids = torch.repeat_interleave(
        torch.arange(len(groups)), torch.tensor(groups, dtype=torch.int64)
    )
    gids = gids[torch.randperm(n, generator=g)] * 3 + 1
    r = torch.randint(0, 2, (n,), generator=g).to(dtype) if ties else torch.randn(n, generator=g)
    r = _poison(r.to(dtype), bad, bad_value)
    ids = _strided(gids.to(id_dtype), step)
    rewards = _strided(r, step)
    try:
        adv, zv, stats = ck.advantages.group_advantages(rewards, ids, mode=mode)
    except ValueError as e:
        assert bad is not None and n > 0
        _names_an_argument(e, ("rewards",))
        return
    assert bad is None or n == 0
    ra, rz, rm, rs = aref.group_advantages_reference(r.float(), gids, mode=mode)
    assert torch.equal(zv, rz)
    torch.testing.assert_close(adv.double(), ra, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.group_mean, rm, rtol=1e-12, atol=1e-12)
    assert stats.num_groups == len(groups)


@SETTINGS
@given(
    n=st.integers(0, 12),
    group_size=st.integers(-1, 5),
    seed=SEEDS,
)
def test_group_advantages_group_size(n, group_size, seed):
    r = torch.randn(n, generator=_gen(seed))
    try:
        adv, zv, _ = ck.advantages.group_advantages(r, group_size=group_size)
    except ValueError as e:
        assert group_size <= 0 or n % group_size
        _names_an_argument(e, ("group_size",))
        return
    gids = torch.arange(n) // group_size
    ra, rz, _, _ = aref.group_advantages_reference(r, gids)
    assert torch.equal(zv, rz)
    torch.testing.assert_close(adv.double(), ra, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(
    lens=st.lists(st.integers(0, 7), min_size=0, max_size=6),
    pad=st.integers(0, 3),
    with_adv=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    cu_dtype=st.sampled_from([torch.int32, torch.int64]),
    step=STEPS,
    bad=st.none() | st.integers(0, 100),
    bad_value=NONFINITE,
    seed=SEEDS,
)
def test_rl_zvp(lens, pad, with_adv, dtype, cu_dtype, step, bad, bad_value, seed):
    g = _gen(seed)
    n = len(lens)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    total = int(cu[-1]) + pad
    ent = _poison(torch.rand(total, generator=g).to(dtype), bad, bad_value)
    rewards = torch.randn(n, generator=g)
    zv = torch.rand(n, generator=g) < 0.5
    adv = torch.randn(n, generator=g) if with_adv else None
    try:
        out = ck.advantages.rl_zvp(
            _strided(ent, step), cu.to(cu_dtype), rewards, _strided(zv, step), advantages=adv
        )
    except ValueError as e:
        assert bad is not None and (bad % max(total, 1)) < int(cu[-1])
        _names_an_argument(e, ("entropy",))
        return
    want = aref.rl_zvp_reference(ent.float(), cu, rewards, zv, advantages=adv)
    if bad is not None and total:  # a non-finite padding token: never read, output 0
        assert (bad % total) >= int(cu[-1])
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(
    lens=st.lists(st.integers(0, 40), max_size=10),
    max_len=st.integers(-1, 30),
    cache_len=st.integers(-1, 30),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16]),
)
def test_overlong_penalty(lens, max_len, cache_len, dtype):
    x = torch.tensor(lens, dtype=dtype)
    try:
        out = ck.advantages.overlong_penalty(x, max_len=max_len, cache_len=cache_len)
    except ValueError as e:
        assert not (max_len > 0 and 0 < cache_len <= max_len)
        _names_an_argument(e, ("max_len", "cache_len"))
        return
    want = aref.overlong_penalty_reference(x, max_len=max_len, cache_len=cache_len)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-7)


@SETTINGS
@given(
    p=st.integers(0, 8),
    budget=st.integers(0, 80) | st.floats(-5, 80) | st.just(float("nan")),
    min_n=st.integers(1, 4),
    extra=st.integers(-1, 6),
    allow_skip=st.booleans(),
    with_cost=st.booleans(),
    seed=SEEDS,
)
def test_allocate_rollouts(p, budget, min_n, extra, allow_skip, with_cost, seed):
    g = _gen(seed)
    att = torch.randint(0, 9, (p,), generator=g).double()
    succ = torch.floor(att * torch.rand(p, generator=g))
    cost = torch.randint(1, 5, (p,), generator=g) if with_cost else None
    max_n = min_n + extra
    try:
        n = ck.advantages.allocate_rollouts(
            succ, att, budget, min_n=min_n, max_n=max_n, cost=cost, allow_skip=allow_skip
        )
    except ValueError as e:
        _names_an_argument(e, ("budget", "min_n", "max_n", "allow_skip"))
        return
    assert min_n >= 2 and max_n >= min_n and math.isfinite(budget) and budget >= 0
    c = torch.ones(p, dtype=torch.int64) if cost is None else cost
    assert int((n * c).sum()) <= math.floor(budget)
    assert bool(((n == 0) | ((n >= min_n) & (n <= max_n))).all())
    if not allow_skip:
        assert bool((n >= min_n).all())


# --------------------------------------------------------------- ck.espo


@SETTINGS
@given(
    t=st.integers(0, 9),
    v=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    step=STEPS,
    temperature=st.sampled_from([1.0, 0.7, 2.5]),
    ignore=st.booleans(),
    masked=st.booleans(),
    bad=st.none() | st.integers(0, 10_000),
    bad_value=st.sampled_from([float("nan"), float("inf")]),
    seed=SEEDS,
)
def test_token_logprobs_entropy(
    t, v, dtype, step, temperature, ignore, masked, bad, bad_value, seed
):
    g = _gen(seed)
    x = (torch.randn(t, v, generator=g) * 3).to(dtype)
    if masked and v > 1:  # some -inf (masked) entries, never a whole row
        x[:, 0] = float("-inf")
    x = _poison(x, bad, bad_value)
    y = torch.randint(0, v, (t,), generator=g)
    if ignore and t:
        y[0] = ck.espo.IGNORE_INDEX
    if masked and v > 1:
        y[y == 0] = min(1, v - 1)
    logits = _strided(x, step)  # rows strided, the vocab dimension contiguous
    try:
        logp, ent = ck.espo.token_logprobs_entropy(logits, y, temperature=temperature)
    except ValueError as e:
        assert bad is not None and t > 0
        _names_an_argument(e, ("logits",))
        return
    assert bad is None or t == 0
    rl, re_ = lref.token_logprobs_entropy_reference(x, y, temperature)
    tol = 1e-5 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(logp.double(), rl, rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double(), re_, rtol=tol, atol=tol)


@FEW
@given(
    t=st.integers(0, 7),
    h=st.integers(1, 9),
    v=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    step=STEPS,
    bad=st.none() | st.integers(0, 1000),
    seed=SEEDS,
)
def test_fused_linear_logprobs_entropy(t, h, v, dtype, step, bad, seed):
    g = _gen(seed)
    hid = _poison(torch.randn(t, h, generator=g).to(dtype), bad, float("nan"))
    w = torch.randn(v, h, generator=g).to(dtype)
    y = torch.randint(0, v, (t,), generator=g)
    hid_s = _strided(hid, step)
    try:
        logp, ent = ck.espo.fused_linear_logprobs_entropy(hid_s, w, y)
    except ValueError as e:
        assert bad is not None and t > 0
        _names_an_argument(e, ("hidden",))
        return
    rl, re_ = lref.fused_linear_logprobs_entropy_reference(hid, w, y)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logp.double(), rl, rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double(), re_, rtol=tol, atol=tol)


@SETTINGS
@given(
    lens=st.lists(st.integers(0, 6), min_size=0, max_size=5),
    pad=st.integers(0, 2),
    mode=st.sampled_from(["espo", "gspo", "grpo"]),
    with_mask=st.booleans(),
    per_token=st.booleans(),
    step=STEPS,
    bad=st.none() | st.integers(0, 1000),
    seed=SEEDS,
)
def test_espo_loss(lens, pad, mode, with_mask, per_token, step, bad, seed):
    g = _gen(seed)
    n = len(lens)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    total = int(cu[-1]) + pad
    lp = -torch.rand(total, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(total, generator=g, dtype=torch.float64)
    ent = _poison(torch.rand(total, generator=g, dtype=torch.float64), bad, float("nan"))
    adv = torch.randn(total if per_token else n, generator=g, dtype=torch.float64)
    mask = torch.rand(total, generator=g) < 0.8 if with_mask else None
    kw = dict(mode=mode, vocab_size=50, advantages_per_token=per_token)
    x = _strided(lp, step).detach().requires_grad_()  # a strided leaf
    try:
        loss, metrics = ck.espo.espo_loss(
            x, _strided(old, step), _strided(ent, step), adv, cu, mask, **kw
        )
    except ValueError as e:
        assert bad is not None and total and (bad % total) < int(cu[-1])
        _names_an_argument(e, ("old_entropy",))
        return
    if bad is not None and total:  # padding past cu[-1]: never read
        assert (bad % total) >= int(cu[-1])
        ent = ent.nan_to_num(0.0)
    xr = lp.clone().requires_grad_()
    rloss, _ = sref.espo_loss_reference(xr, old, ent, adv, cu, mask, **kw)
    torch.testing.assert_close(loss.detach().double(), rloss.detach(), rtol=1e-9, atol=1e-12)
    if rloss.requires_grad:  # (no token in the loss: a constant 0)
        loss.backward()
        rloss.backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-9, atol=1e-12)


@FEW
@given(
    lens=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    h=st.integers(1, 8),
    v=st.integers(2, 30),
    mode=st.sampled_from(["espo", "gspo", "grpo"]),
    seed=SEEDS,
)
def test_fused_linear_espo_loss(lens, h, v, mode, seed):
    """The fused loss equals espo_loss on the log-probs and entropy of the same head."""
    g = _gen(seed)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    t = int(cu[-1])
    hid = torch.randn(t, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (t,), generator=g)
    old = -torch.rand(t, generator=g, dtype=torch.float64)
    oent = torch.rand(t, generator=g, dtype=torch.float64)
    adv = torch.randn(len(lens), generator=g, dtype=torch.float64)
    try:
        loss, _ = ck.espo.fused_linear_espo_loss(hid, w, y, old, oent, adv, cu, mode=mode)
    except ValueError as e:  # dtypes the fused head does not take: named
        _names_an_argument(e, ("hidden", "weight"))
        return
    rl, _ = lref.fused_linear_logprobs_entropy_reference(hid, w, y)
    rloss, _ = sref.espo_loss_reference(rl, old, oent, adv, cu, mode=mode, vocab_size=v)
    torch.testing.assert_close(loss.detach().double(), rloss.detach(), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------ ck.packing


@SETTINGS
@given(
    lens=st.lists(st.integers(-1, 60), min_size=0, max_size=12),
    dp=st.integers(1, 4),
    cap=st.integers(1, 120),
    groups=st.none() | st.integers(1, 6),
    mbm=st.integers(1, 3),
    pad=st.sampled_from([1, 2, 4]),
    cost=st.sampled_from(["tokens", "attention"]),
    kind=st.sampled_from(["list", "int64", "int32", "strided", "numpy"]),
    seed=SEEDS,
)
def test_plan(lens, dp, cap, groups, mbm, pad, cost, kind, seed):
    n = len(lens)
    gids = None if groups is None else [i % groups for i in range(n)]
    x = {
        "list": lambda: lens,
        "int64": lambda: torch.tensor(lens, dtype=torch.int64),
        "int32": lambda: torch.tensor(lens, dtype=torch.int32),
        "strided": lambda: _strided(torch.tensor(lens, dtype=torch.int64), 2),
        "numpy": lambda: np.array(lens, dtype=np.int64),
    }[kind]()
    cfg = ck.packing.ModelConfig(64, 64, 2, 4)
    try:
        p = ck.packing.plan(
            x,
            dp_size=dp,
            max_tokens=cap,
            group_ids=gids,
            cost=cost,
            model_config=cfg,
            micro_batch_multiple=mbm,
            pad_multiple=pad,
        )
    except ValueError as e:
        _names_an_argument(e, ("lengths", "group_ids", "dp_size", "max_tokens"))
        return
    pref.check_plan(
        p,
        lens,
        dp_size=dp,
        max_tokens=cap,
        group_ids=gids,
        micro_batch_multiple=mbm,
        pad_multiple=pad,
    )


@FEW
@given(n=st.integers(1, 5000), dp=st.integers(1, 64), seed=SEEDS)
def test_plan_large(n, dp, seed):
    """Large-but-cheap batches: planned within the cap, or refused naming why."""
    lens = pref.lognormal_lengths(n, seed % 1000)
    cap = int(lens.max())
    try:
        p = ck.packing.plan(lens, dp_size=dp, max_tokens=cap)
    except ValueError as e:
        _names_an_argument(e, ("lengths", "dp_size"))
        assert n < dp * 2 or "no plan" in str(e) or "dp_size" in str(e)
        return
    assert p.stats["max_mb_tokens"] <= cap and p.order.numel() == n


@SETTINGS
@given(
    lens=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    pick=st.lists(st.integers(0, 5), min_size=0, max_size=6, unique=True),
    cp=st.sampled_from([1, 2]),
    pad_k=st.integers(1, 3),
    width=st.sampled_from([(), (3,), (2, 2), (0,)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]),
    step=STEPS,
    bad=st.none() | st.integers(0, 1000),
    seed=SEEDS,
)
# one row sliced with a step: contiguous() keeps its stride 2, which a byte view refused
@example(lens=[1], pick=[0], cp=1, pad_k=1, width=(), dtype=torch.float32, step=2, bad=None, seed=0)
def test_pack_unpack(lens, pick, cp, pad_k, width, dtype, step, bad, seed):
    g = _gen(seed)
    total = sum(lens)
    x = (torch.randn(total, *width, generator=g) * 50).to(dtype)
    if dtype.is_floating_point:
        x = _poison(x, bad, float("nan"))  # moved bit for bit
    pad = 2 * cp * pad_k
    idx = [i for i in pick if i < len(lens)]
    try:
        b = ck.packing.pack(
            _strided(x, step), lens, idx, pad_multiple=pad, cp_size=cp, cp_rank=cp - 1
        )
    except ValueError as e:
        assert not idx or any(lens[i] == 0 for i in idx)
        _names_an_argument(e, ("indices", "lengths"))
        return
    want = pref.pack_reference(x, lens, idx, pad_multiple=pad, cp_size=cp, cp_rank=cp - 1)
    got = b.tensors["input"]
    assert got.shape == want["packed"].shape
    assert torch.equal(got.view(torch.uint8), want["packed"].view(torch.uint8))
    assert torch.equal(b.cu_seqlens_padded, want["cu_seqlens_padded"])
    assert torch.equal(b.position_ids, want["position_ids"])
    ranks = [
        ck.packing.pack(x, lens, idx, pad_multiple=pad, cp_size=cp, cp_rank=r) for r in range(cp)
    ]
    back = ck.packing.unpack([r.tensors["input"] for r in ranks], ranks[0])
    start = np.concatenate([[0], np.cumsum(lens)])
    ref = torch.cat([x[start[i] : start[i + 1]] for i in idx])
    assert torch.equal(back.view(torch.uint8), ref.view(torch.uint8))


# ---------------------------------------------------------------- ck.fp8


@SETTINGS
@given(
    rows=st.integers(0, 300),
    cols=st.integers(0, 300),
    experts=st.none() | st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    ue8m0=st.booleans(),
    step=STEPS,
    bad=st.none() | st.integers(0, 10**6),
    bad_value=NONFINITE,
    seed=SEEDS,
)
def test_quantize_blockwise(rows, cols, experts, dtype, ue8m0, step, bad, bad_value, seed):
    g = _gen(seed)
    shape = (rows, cols) if experts is None else (experts, rows, cols)
    w = _poison((torch.randn(*shape, generator=g) * 10).to(dtype), bad, bad_value)
    ws = w[..., ::step] if step > 1 and cols else w  # strided along K
    try:
        q, s = ck.fp8.quantize_blockwise(ws, ue8m0=ue8m0)
    except ValueError as e:
        assert (
            cols == 0
            or (step > 1 and "unit stride" in str(e))
            or (bad is not None and ws.numel() and not bool(ws.isfinite().all()))
        ), str(e)
        assert str(e).startswith("w: ")
        return

    def stack(x):
        return x if x.dim() == 3 else x[None]

    for qe, se, src in zip(stack(q), stack(s), stack(ws), strict=True):
        rq, rs = fref.quantize_reference(src, 128, 128, eps=ck.fp8.WEIGHT_EPS, ue8m0=ue8m0)
        assert torch.equal(qe.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(se, rs)
        assert torch.equal(ck.fp8.dequantize(qe, se), fref.dequantize_reference(rq, rs, 128, 128))


@SETTINGS
@given(
    rows=st.integers(0, 40),
    cols=st.integers(0, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    step=STEPS,
    bad=st.none() | st.integers(0, 10**6),
    seed=SEEDS,
)
def test_quantize_token_groups(rows, cols, dtype, step, bad, seed):
    x = _poison((torch.randn(rows, cols, generator=_gen(seed)) * 4).to(dtype), bad, float("inf"))
    xs = _strided(x, step)
    try:
        q, s = ck.fp8.quantize_token_groups(xs)
    except ValueError as e:
        assert cols == 0 or (bad is not None and rows > 0)
        _names_an_argument(e, ("x",))
        return
    rq, rs = fref.quantize_reference(x, 1, 128, eps=ck.fp8.ACTIVATION_EPS, use_div=True)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@SETTINGS
@given(
    m=st.integers(0, 9),
    k=st.integers(1, 3),
    e=st.integers(1, 5),
    cols=st.sampled_from([1, 128, 130]),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
    out_of_range=st.booleans(),
    seed=SEEDS,
)
def test_permute_quantize_unpermute(m, k, e, cols, id_dtype, out_of_range, seed):
    g = _gen(seed)
    x = torch.randn(m, cols, generator=g)
    ids = torch.randint(0, e, (m, k), generator=g)
    if out_of_range and m:
        ids[m // 2, 0] = e
    try:
        p = ck.fp8.permute_quantize(x, ids.to(id_dtype), e)
    except ValueError as err:
        assert out_of_range and m
        _names_an_argument(err, ("topk_ids",))
        return
    rq, rs, roff, rsrc, rdst = fref.permute_quantize_reference(x, ids, e, eps=ck.fp8.ACTIVATION_EPS)
    assert torch.equal(p.q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(p.scales, rs)
    assert torch.equal(p.expert_offsets, roff) and torch.equal(p.dst_index, rdst)
    y = torch.randn(m * k, 5, generator=g)
    w = torch.rand(m, k, generator=g)
    out = ck.fp8.unpermute(y, p, w)
    assert torch.equal(out, fref.unpermute_reference(y, p.dst_index, w))


@FEW
@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    n=st.sampled_from([1, 8, 37, 128]),
    k=st.sampled_from([16, 128, 129]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    bad_offsets=st.booleans(),
    seed=SEEDS,
)
def test_grouped_gemm(counts, n, k, out_dtype, bad_offsets, seed):
    g = _gen(seed)
    m, e = sum(counts), len(counts)
    aq, asc = ck.fp8.quantize_token_groups(torch.randn(m, k, generator=g))
    bq, bsc = ck.fp8.quantize_blockwise(torch.randn(e, n, k, generator=g) / k**0.5)
    off = torch.tensor([0, *np.cumsum(counts).tolist()], dtype=torch.int64)
    if bad_offsets:
        off[-1] += 1
    try:
        out = ck.fp8.grouped_gemm(aq, asc, bq, bsc, off, out_dtype=out_dtype)
    except ValueError as err:
        assert bad_offsets
        _names_an_argument(err, ("expert_offsets",))
        return
    want = gref.grouped_gemm_reference(aq, asc, bq, bsc, off, out_dtype=torch.float32)
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


@FEW
@given(
    t=st.integers(0, 6),
    e=st.integers(1, 3),
    k=st.integers(1, 2),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=SEEDS,
)
def test_moe_mlp(t, e, k, dtype, seed):
    from compass_kernels.fp8.reference_moe import moe_mlp_reference

    g = _gen(seed)
    h, inter = 128, 128
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = (
        torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        if t and k <= e
        else torch.randint(0, e, (t, k), generator=g)
    )
    w = torch.softmax(torch.randn(t, k, generator=g), 1)
    w13, s13 = ck.fp8.quantize_blockwise(
        (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(torch.bfloat16)
    )
    w2, s2 = ck.fp8.quantize_blockwise(
        (torch.randn(e, h, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    )
    out = ck.fp8.moe_mlp(x, ids, w, w13, s13, w2, s2)
    ref = moe_mlp_reference(x, ids, w, w13, s13, w2, s2)
    assert out.shape == x.shape and out.dtype == dtype
    err = (out.float() - ref).abs()
    bound = 2.0**-7 * ref.abs() + 0.02 * ref.pow(2).mean(1, keepdim=True).sqrt() + 1e-6
    assert bool((err <= bound).all())


@FEW
@given(
    experts=st.integers(1, 64),
    rows=st.integers(0, 1 << 16),
    cols=st.integers(1, 1 << 14),
)
def test_fp8_shapes_on_meta(experts, rows, cols):
    """Large shapes through the meta device: the output shapes of the real op."""
    w = torch.empty(experts, rows, cols, dtype=torch.bfloat16, device="meta")
    q, s = ck.fp8.quantize_blockwise(w)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (experts, -(-rows // 128), -(-cols // 128))
    x = torch.empty(rows, cols, dtype=torch.bfloat16, device="meta")
    q, s = ck.fp8.quantize_token_groups(x)
    assert q.shape == x.shape and s.shape[0] == rows and s.shape[-1] == -(-cols // 128)


# ------------------------------------------------------------ ck.routing


@SETTINGS
@given(
    t=st.integers(0, 9),
    e=st.integers(1, 40),
    k=st.integers(1, 8),
    score=st.sampled_from(["softmax", "sigmoid"]),
    normalize=st.booleans(),
    with_valid=st.booleans(),
    id_dtype=st.sampled_from([torch.uint8, torch.int16, torch.int32, torch.int64]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    step=STEPS,
    bad=st.none() | st.integers(0, 1000),
    seed=SEEDS,
)
def test_replay_topk(t, e, k, score, normalize, with_valid, id_dtype, dtype, step, bad, seed):
    g = _gen(seed)
    k = min(k, e)
    z = _poison(torch.randn(t, e, generator=g).to(dtype), bad, float("nan"))
    ids = torch.rand(t, e, generator=g).argsort(-1)[:, :k].to(id_dtype)
    valid = torch.rand(t, generator=g) < 0.7 if with_valid else None
    zs = _strided(z, step)
    try:
        res = ck.routing.replay_topk(
            zs, _strided(ids, step), score_function=score, normalize=normalize, valid=valid
        )
    except ValueError as err:
        assert bad is not None and t > 0
        _names_an_argument(err, ("router_logits",))
        return
    w, rmap, tpe, used, _, _ = rref.replay_topk_reference(
        z, ids, score_function=score, normalize=normalize, valid=valid
    )
    tol = 1e-5 if dtype != torch.bfloat16 else 1e-2
    torch.testing.assert_close(
        res.weights.double(), w.to(res.weights.dtype).double(), rtol=tol, atol=tol
    )
    assert torch.equal(res.routing_map, rmap) and torch.equal(res.tokens_per_expert, tpe)
    assert torch.equal(res.expert_ids, used)


@SETTINGS
@given(
    lens=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    e=st.sampled_from([2, 8, 16, 255, 256, 300, 32767, 32768]),
    k=st.integers(1, 8),
    layers=st.integers(1, 3),
    codec=st.sampled_from(["set", "raw"]),
    corrupt=st.none() | st.integers(0, 10**6),
    seed=SEEDS,
)
def test_trace_encode_decode(lens, e, k, layers, codec, corrupt, seed):
    g = _gen(seed)
    k = min(k, e)
    rows = sum(lens)
    dtype = torch.uint8 if e <= 256 else torch.int16
    ids = (
        torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows * layers)])
        if rows
        else torch.zeros(0, k, dtype=torch.int64)
    )
    ids = ids.reshape(rows, layers, k).to(dtype)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    t = RoutingTrace(ids, cu, e)
    data = t.encode(codec=codec)
    if corrupt is not None:
        b = bytearray(data)
        b[corrupt % len(b)] ^= 1 << (corrupt % 8)
        try:
            d = RoutingTrace.decode(bytes(b))
        except TraceError:
            return
        raise AssertionError(f"a flipped bit decoded silently: {d}")
    d = RoutingTrace.decode(data)
    want = t.canonical(sort=codec == "set")
    assert torch.equal(d.expert_ids, want.expert_ids) and torch.equal(d.cu_seqlens, t.cu_seqlens)
    assert d.num_experts == e


@settings(SETTINGS, max_examples=20)
@given(data=st.binary(min_size=0, max_size=200))
def test_trace_decode_garbage(data):
    """Any bytes: a trace or a TraceError (TypeError only for a non-bytes object)."""
    try:
        RoutingTrace.decode(data)
    except TraceError:
        pass


def test_error_is_named_for_wrong_types():
    """Non-tensor arguments: TypeError / ValueError naming the argument."""
    calls = {
        "rewards": lambda: ck.advantages.group_advantages([1.0, 2.0], group_size=1),
        "logits": lambda: ck.espo.token_logprobs_entropy("x", torch.zeros(1, dtype=torch.int64)),
        "w": lambda: ck.fp8.quantize_blockwise(3.0),
        "router_logits": lambda: ck.routing.replay_topk(None, torch.zeros(1, 1)),
        "lengths": lambda: ck.packing.plan("abc", dp_size=1, max_tokens=4),
    }
    for name, call in calls.items():
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        _names_an_argument(info.value, (name,))


@FEW
@given(t=st.integers(0, 1 << 16), v=st.integers(1, 1 << 18), e=st.integers(1, 512))
def test_large_shapes_on_meta(t, v, e):
    """Vocab-sized log-probs, batch-sized advantages and routing on the meta device."""
    logits = torch.empty(t, v, dtype=torch.bfloat16, device="meta")
    y = torch.empty(t, dtype=torch.int64, device="meta")
    logp, ent = ck.espo.token_logprobs_entropy(logits, y)
    assert logp.shape == ent.shape == (t,) and logp.dtype == torch.float32
    r = torch.empty(t, device="meta")
    adv, zv, _ = ck.advantages.group_advantages(r, group_size=1)
    assert adv.shape == zv.shape == (t,)
    k = min(8, e)
    res = ck.routing.replay_topk(
        torch.empty(t, e, device="meta"), torch.empty(t, k, dtype=torch.int64, device="meta")
    )
    assert res.weights.shape == (t, k) and res.routing_map.shape == (t, e)


@SETTINGS
@given(
    lens=st.lists(st.integers(0, 8), min_size=0, max_size=5),
    pad=st.integers(0, 2),
    levels=st.lists(st.floats(0, 1), min_size=1, max_size=3).map(lambda v: tuple(sorted(v))),
    per_sequence=st.booleans(),
    with_mask=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    step=STEPS,
    seed=SEEDS,
)
def test_entropy_thresholds(lens, pad, levels, per_sequence, with_mask, dtype, step, seed):
    g = _gen(seed)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    total = int(cu[-1]) + pad
    ent = torch.rand(total, generator=g).to(dtype)
    mask = torch.rand(total, generator=g) < 0.7 if with_mask else None
    got = ck.espo.entropy_thresholds(
        _strided(ent, step), cu, mask, levels=levels, per_sequence=per_sequence
    )
    want = sref.entropy_thresholds_reference(ent, cu, mask, levels, per_sequence=per_sequence)
    assert got.shape == want.shape
    keep = ~want.isnan()  # rows of sequences without valid tokens are unused
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-12, atol=1e-12)


@SETTINGS
@given(
    p=st.integers(0, 6),
    max_n=st.integers(0, 12),
    prior=st.tuples(st.floats(0.1, 5), st.floats(0.1, 5)),
    seed=SEEDS,
)
def test_informative_probability(p, max_n, prior, seed):
    g = _gen(seed)
    att = torch.randint(0, 20, (p,), generator=g).double()
    succ = torch.floor(att * torch.rand(p, generator=g))
    n = torch.randint(0, max_n + 1, (p,), generator=g)
    got = ck.advantages.informative_probability(succ, att, n, prior=prior)
    assert got.shape == (p,)
    for i in range(p):  # 1 - E[p^n] - E[(1-p)^n] by the Beta moments, in float64
        a, b, k = prior[0] + float(succ[i]), prior[1] + float(att[i] - succ[i]), int(n[i])
        ep = math.prod((a + j) / (a + b + j) for j in range(k))
        eq = math.prod((b + j) / (a + b + j) for j in range(k))
        want = 0.0 if k <= 1 else 1 - ep - eq
        assert abs(float(got[i]) - want) <= 1e-12


@SETTINGS
@given(
    lens=st.lists(st.integers(-3, 10**6), min_size=0, max_size=6),
    cost=st.sampled_from(["tokens", "attention", "flops"]),
    kind=st.sampled_from(["tensor", "numpy"]),
)
def test_sequence_cost(lens, cost, kind):
    cfg = ck.packing.ModelConfig(128, 256, 2, 4)
    x = torch.tensor(lens, dtype=torch.int64) if kind == "tensor" else np.array(lens, np.int64)
    try:
        c = ck.packing.sequence_cost(x, cost, cfg)
    except ValueError as e:
        assert cost == "flops"
        _names_an_argument(e, ("cost",))
        return
    a, b = ck.packing.cost_coefficients(cfg) if cost == "attention" else (1.0, 0.0)
    want = [a * v + b * v * v for v in lens]
    assert np.allclose(np.asarray(c, dtype=np.float64), want, rtol=1e-15, atol=0)


@SETTINGS
@given(
    lens=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    short=st.lists(st.integers(-1, 2), min_size=4, max_size=4),
    max_missing=st.none() | st.sampled_from([0.0, 0.5, 1.0]),
    seed=SEEDS,
)
def test_trace_row_count_contract(lens, short, max_missing, seed):
    """token_lens vs rows: more rows than tokens - 1 always raise, fewer raise unless
    accepted by name; an accepted trace validates."""
    g = _gen(seed)
    rows = sum(lens)
    ids = (
        torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(rows)])
        if rows
        else torch.zeros(0, 2, dtype=torch.int64)
    )
    ids = ids.reshape(rows, 1, 2).to(torch.uint8)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    tok = [n + 1 + s for n, s in zip(lens, short, strict=False)]
    kw = {} if max_missing is None else {"max_missing_fraction": max_missing}
    try:
        t = RoutingTrace(ids, cu, 16, token_lens=tok)
        t.validate(**kw)
    except (TraceError, ValueError) as e:
        over = any(n > tk - 1 for n, tk in zip(lens, tok, strict=False))
        under = any(n < tk - 1 for n, tk in zip(lens, tok, strict=False))
        assert over or under
        _names_an_argument(e, ("token_lens", "rows", "tokens", "max_missing_fraction"))
        return
    assert all(n <= tk - 1 for n, tk in zip(lens, tok, strict=False))
    if not max_missing:  # short rows only where accepted by name
        assert all(n == tk - 1 for n, tk in zip(lens, tok, strict=False))


@FEW
@given(
    t=st.integers(0, 5),
    e=st.integers(1, 3),
    k=st.integers(1, 2),
    bad_scale=st.booleans(),
    seed=SEEDS,
)
def test_grouped_mlp_is_moe_mlp_unpermuted(t, e, k, bad_scale, seed):
    """unpermute(grouped_mlp(permuted rows)) is moe_mlp bit for bit."""
    g = _gen(seed)
    h = inter = 128
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.softmax(torch.randn(t, k, generator=g), 1)
    w13, s13 = ck.fp8.quantize_blockwise(
        (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(torch.bfloat16)
    )
    w2, s2 = ck.fp8.quantize_blockwise(
        (torch.randn(e, h, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    )
    if bad_scale:
        s2 = _poison(s2, seed, float("nan"))
    p = ck.fp8.permute_quantize(x, ids, e)
    rows = x[p.src_index // k]
    try:
        y = ck.fp8.grouped_mlp(rows, p.expert_offsets, w13, s13, w2, s2)
    except ValueError as err:
        assert bad_scale
        _names_an_argument(err, ("w2_scale",))
        return
    assert not bad_scale
    out = ck.fp8.unpermute(y, p, w)
    assert torch.equal(out, ck.fp8.moe_mlp(x, ids, w, w13, s13, w2, s2))


@SETTINGS
@given(
    rounds=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=1, max_size=4),
    explore_after=st.none() | st.integers(1, 3),
    seed=SEEDS,
)
def test_rollout_allocator(rounds, explore_after, seed):
    """Allocate / observe rounds: every allocation within the budget and the [min_n, max_n]
    rule; the history counts exactly what was observed."""
    g = _gen(seed)
    alloc = ck.advantages.RolloutAllocator(min_n=2, max_n=6, explore_after=explore_after)
    seen: dict[int, list[float]] = {}
    for p, budget in rounds:
        keys = list(range(p))
        n = alloc.allocate(keys, budget)
        assert int(n.sum()) <= budget and bool(((n == 0) | ((n >= 2) & (n <= 6))).all())
        sample_keys = [key for key, c in zip(keys, n.tolist(), strict=True) for _ in range(c)]
        scores = (torch.rand(len(sample_keys), generator=g) < 0.5).tolist()
        alloc.observe(sample_keys, scores)
        for key, sc in zip(sample_keys, scores, strict=True):
            h = seen.setdefault(key, [0.0, 0.0])
            h[0] += float(sc)
            h[1] += 1.0
    keys = sorted(seen)
    s, a = alloc.history(keys)
    assert s.tolist() == [seen[key][0] for key in keys]
    assert a.tolist() == [seen[key][1] for key in keys]
