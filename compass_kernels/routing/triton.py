"""Triton kernels of ck.routing: replay_topk forward and backward.

Same contract as the torch backend (spec and torch kernels: ``reference.py``;
design: docs/design.md, "Replay"); outputs are allocated by the caller and
written here (tokens_per_expert and counts are cleared here, then accumulated
with integer atomics: exact, so deterministic). The kernels run on CUDA
tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests), and compile
ahead of time for sm_90a (tests/test_aot.py).

One program per BLOCK_T rows, the whole expert dimension in one tile
(BLOCK_E = next power of two >= E, up to 1024): native top-k is K rounds of a
row argmax (ties to the lower index), gathers of the replayed ids' logits are
indexed loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

__all__ = ["replay_topk_triton", "replay_topk_backward_triton", "LAUNCH"]

#: Launch options of both kernels (tests/test_aot.py compiles with exactly these).
LAUNCH = {"num_warps": 4}
#: Logit elements per program tile (BLOCK_T * BLOCK_E). 4096 spilled the
#: E = 256 forward under Triton 3.6 (ptxas 12.8: 168 registers, 16 B spilled);
#: 2048 spilled it under 3.7.1 (torch 2.13's pin: 128 registers, 8 B spilled);
#: 1024 compiles spill-free under 3.6, 3.7.1 and 3.9 at <= 128 registers
#: (tests/test_routing_aot.py, make test-triton36, make test-py312). The kernel
#: reads each logit once: a smaller tile only means more programs.
TILE = 1024
MAX_EXPERTS = 1024


def _blocks(e: int, k: int) -> tuple[int, int, int]:
    be = triton.next_power_of_2(max(e, 16))
    bk = triton.next_power_of_2(max(k, 2))
    bt = max(1, min(64, TILE // be))
    return bt, be, bk


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _scores(z, zmax, sumexp, SCORE: tl.constexpr):
    if SCORE == 0:
        s = tl.exp(z - zmax[:, None]) / sumexp[:, None]
    else:
        s = 1.0 / (1.0 + tl.exp(-z))
    return s


@triton.jit(do_not_specialize=["scaling", "ratio"])
def _replay_fwd_kernel(
    z_ptr,
    ids_ptr,
    bias_ptr,
    valid_ptr,
    w_ptr,
    map_ptr,
    tpe_ptr,
    counts_ptr,
    used_ptr,
    T,
    E,
    K,
    scaling,
    ratio,
    SCORE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_RATIO: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    m2 = rmask[:, None] & cmask[None, :]
    mk = rmask[:, None] & kmask[None, :]
    zrow = z_ptr + rows[:, None] * E
    z = tl.load(zrow + cols[None, :], mask=m2, other=float("-inf"))
    acc_ty = z.dtype
    zmax = tl.max(z, axis=1)
    zmax = tl.where(rmask, zmax, 0.0)
    if SCORE == 0:
        sumexp = tl.sum(tl.where(m2, tl.exp(z - zmax[:, None]), 0.0), axis=1)
        sumexp = tl.where(rmask, sumexp, 1.0)
    else:
        sumexp = tl.zeros([BLOCK_T], dtype=acc_ty) + 1.0
    s = _scores(z, zmax, sumexp, SCORE)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
        sel = s + b[None, :]
    else:
        sel = s
    sel = tl.where(m2, sel, float("-inf"))
    # Native top-k: K rounds of a row argmax, ties to the lower index. A NaN score
    # ranks as +inf (torch.sort puts NaN first; only a +inf bias, unchecked, tells
    # the two apart): without it tl.max drops the NaN, no column equals the max
    # of an all-NaN row, and the row read expert BLOCK_E, past its end.
    sel = tl.where(sel != sel, float("inf"), sel)
    nat = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for r in range(0, K):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), axis=1)
        nat = tl.where(kk[None, :] == r, idx.to(tl.int64)[:, None], nat)
        sel = tl.where(cols[None, :] == idx[:, None], float("-inf"), sel)
    if HAS_VALID:
        cand = (tl.load(valid_ptr + rows, mask=rmask, other=0) != 0) & rmask
    else:
        cand = rmask
    rep = tl.load(ids_ptr + rows[:, None] * K + kk[None, :], mask=mk & cand[:, None], other=0)
    rep = rep.to(tl.int64)
    bad_slot = ((rep < 0) | (rep >= E)) & kmask[None, :]
    in_native = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int1)
    for q in range(0, K):
        rq = tl.sum(tl.where(kk[None, :] == q, rep, 0), axis=1)
        nq = tl.sum(tl.where(kk[None, :] == q, nat, 0), axis=1)
        bad_slot = bad_slot | ((rep == rq[:, None]) & (kk[None, :] > q) & kmask[None, :])
        in_native = in_native | (rep == nq[:, None])
    bad = (tl.max(bad_slot.to(tl.int32), axis=1) > 0) & cand
    ok = cand & ~bad
    rep = tl.where(bad_slot, 0, rep)
    overlap = tl.sum((in_native & kmask[None, :]).to(tl.int64), axis=1)
    inf = float("inf")
    if HAS_RATIO:
        zr = tl.load(zrow + rep, mask=mk & ok[:, None], other=0.0)
        zn = tl.load(zrow + nat, mask=mk, other=0.0)
        sr = tl.where(kmask[None, :], _scores(zr, zmax, sumexp, SCORE), inf)
        sn = tl.where(kmask[None, :], _scores(zn, zmax, sumexp, SCORE), inf)
        # NaN-propagating minima: a NaN score rejects the replay, as in torch
        accept = tl.reduce(sr, 1, _min_nan) >= ratio * tl.reduce(sn, 1, _min_nan)
        use = ok & accept
    else:
        use = ok
    u = tl.where(use[:, None], rep, nat)
    zu = tl.load(zrow + u, mask=mk, other=float("-inf"))
    if SCORE == 0:
        if NORMALIZE:
            shift = tl.max(zu, axis=1)
            shift = tl.where(rmask, shift, 0.0)
            num = tl.where(mk, tl.exp(zu - shift[:, None]), 0.0)
            den = tl.sum(num, axis=1)
        else:
            num = tl.where(mk, tl.exp(zu - zmax[:, None]), 0.0)
            den = sumexp
    else:
        num = tl.where(mk, 1.0 / (1.0 + tl.exp(-zu)), 0.0)
        if NORMALIZE:  # Megatron-core: normalised only when K > 1
            den = tl.where(K > 1, tl.sum(num, axis=1) + 1e-20, 1.0)
        else:
            den = tl.zeros([BLOCK_T], dtype=acc_ty) + 1.0
    den = tl.where(rmask, den, 1.0)
    w = num / den[:, None] * scaling
    out_k = rows[:, None] * K + kk[None, :]
    tl.store(w_ptr + out_k, w.to(w_ptr.dtype.element_ty), mask=mk)
    tl.store(used_ptr + out_k, u, mask=mk)
    # The routing map by scatter: the tile cleared, then True stored at the K used
    # ids of each row (distinct: a replay with a repeated id is rejected above).
    # The barrier orders the two stores within the program (bar.sync makes the
    # clear visible to every thread first); tokens_per_expert takes one integer
    # atomic per (row, slot): exact, so deterministic.
    tl.store(map_ptr + rows[:, None] * E + cols[None, :], tl.zeros_like(m2), mask=m2)
    tl.debug_barrier()
    mu = mk & (u < E)  # an id past E (only a -inf bias can pick one) stays in its row
    tl.store(map_ptr + rows[:, None] * E + u, tl.full([BLOCK_T, BLOCK_K], 1, tl.int1), mask=mu)
    tl.atomic_add(tpe_ptr + u, tl.full([BLOCK_T, BLOCK_K], 1, tl.int64), mask=mu)
    n_rows = tl.sum(rmask.to(tl.int64), axis=0)
    n_cand = tl.sum(ok.to(tl.int64), axis=0)
    n_overlap = tl.sum(tl.where(ok, overlap, 0), axis=0)
    n_exact = tl.sum((ok & (overlap == K)).to(tl.int64), axis=0)
    n_rej = tl.sum((ok & ~use).to(tl.int64), axis=0)
    n_bad = tl.sum(bad.to(tl.int64), axis=0)
    tl.atomic_add(counts_ptr + 0, n_rows)
    tl.atomic_add(counts_ptr + 1, n_cand)
    tl.atomic_add(counts_ptr + 2, n_overlap)
    tl.atomic_add(counts_ptr + 3, n_exact)
    tl.atomic_add(counts_ptr + 4, n_rej)
    tl.atomic_add(counts_ptr + 5, n_bad)


@triton.jit(do_not_specialize=["scaling"])
def _replay_bwd_kernel(
    g_ptr,
    z_ptr,
    used_ptr,
    out_ptr,
    T,
    E,
    K,
    scaling,
    SCORE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    m2 = rmask[:, None] & cmask[None, :]
    mk = rmask[:, None] & kmask[None, :]
    zrow = z_ptr + rows[:, None] * E
    u = tl.load(used_ptr + rows[:, None] * K + kk[None, :], mask=mk, other=0)
    g = tl.load(g_ptr + rows[:, None] * K + kk[None, :], mask=mk, other=0.0)
    zu = tl.load(zrow + u, mask=mk, other=float("-inf"))
    if SCORE == 0:
        if NORMALIZE:
            shift = tl.where(rmask, tl.max(zu, axis=1), 0.0)
            num = tl.where(mk, tl.exp(zu - shift[:, None]), 0.0)
            den = tl.sum(num, axis=1)
            den = tl.where(rmask, den, 1.0)
            w0 = num / den[:, None]
            dot = tl.sum(g * w0, axis=1)
            gu = w0 * (g - dot[:, None])
            dense = tl.zeros([BLOCK_T, BLOCK_E], dtype=gu.dtype)
        else:
            z = tl.load(zrow + cols[None, :], mask=m2, other=float("-inf"))
            zmax = tl.where(rmask, tl.max(z, axis=1), 0.0)
            p = tl.where(m2, tl.exp(z - zmax[:, None]), 0.0)
            sumexp = tl.where(rmask, tl.sum(p, axis=1), 1.0)
            p = p / sumexp[:, None]
            w0 = tl.where(mk, tl.exp(zu - zmax[:, None]), 0.0) / sumexp[:, None]
            dot = tl.sum(g * w0, axis=1)
            gu = w0 * (g - dot[:, None])
            dense = -p * dot[:, None]
    else:
        sg = tl.where(mk, 1.0 / (1.0 + tl.exp(-zu)), 0.0)
        ds = sg * (1.0 - sg)
        if NORMALIZE:
            den = tl.where(rmask, tl.sum(sg, axis=1) + 1e-20, 1.0)
            dot = tl.sum(g * (sg / den[:, None]), axis=1)
            gu = tl.where(K > 1, (g - dot[:, None]) / den[:, None] * ds, g * ds)
        else:
            gu = g * ds
        dense = tl.zeros([BLOCK_T, BLOCK_E], dtype=gu.dtype)
    grad = dense
    for q in range(0, K):
        uq = tl.sum(tl.where(kk[None, :] == q, u, 0), axis=1)
        gq = tl.sum(tl.where(kk[None, :] == q, gu, 0.0), axis=1)
        grad = tl.where(cols[None, :].to(tl.int64) == uq[:, None], gq[:, None], grad)
    grad = grad * scaling
    tl.store(
        out_ptr + rows[:, None] * E + cols[None, :], grad.to(out_ptr.dtype.element_ty), mask=m2
    )


def _check_common(logits: torch.Tensor, k: int) -> None:
    if logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"logits: expected dtype float32 | float64, got {logits.dtype}")
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits: expected a contiguous 2-d tensor, got {list(logits.shape)}")
    if logits.shape[1] > MAX_EXPERTS:
        raise ValueError(
            f"logits: the Triton kernel supports up to {MAX_EXPERTS} experts, got {logits.shape[1]}"
        )
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"expert_ids: top_k = {k} must be in [1, {logits.shape[1]}]")


def replay_topk_triton(
    *,
    logits,
    expert_ids,
    expert_bias,
    valid,
    score_function,
    normalize,
    scaling,
    min_score_ratio,
    weights,
    routing_map,
    tokens_per_expert,
    counts,
    ids_used,
) -> None:
    """The kernel of ``compass::replay_topk`` (arguments as in csrc/routing/routing_api.h)."""
    t, e = logits.shape
    k = expert_ids.shape[1]
    _check_common(logits, k)
    for name, x, shape in (
        ("expert_ids", expert_ids, (t, k)),
        ("weights", weights, (t, k)),
        ("routing_map", routing_map, (t, e)),
        ("ids_used", ids_used, (t, k)),
        ("tokens_per_expert", tokens_per_expert, (e,)),
        ("counts", counts, (6,)),
    ):
        if tuple(x.shape) != shape or not x.is_contiguous() or x.device != logits.device:
            raise ValueError(
                f"{name}: expected a contiguous {list(shape)} tensor on {logits.device}"
            )
    tokens_per_expert.zero_()
    counts.zero_()
    if t == 0:
        return
    bt, be, bk = _blocks(e, k)
    dummy = logits
    _replay_fwd_kernel[(triton.cdiv(t, bt),)](
        logits,
        expert_ids,
        dummy if expert_bias is None else expert_bias,
        dummy if valid is None else valid,
        weights,
        routing_map,
        tokens_per_expert,
        counts,
        ids_used,
        t,
        e,
        k,
        float(scaling),
        float(max(min_score_ratio, 0.0)),
        SCORE=int(score_function),
        NORMALIZE=bool(normalize),
        HAS_BIAS=expert_bias is not None,
        HAS_VALID=valid is not None,
        HAS_RATIO=min_score_ratio >= 0,
        BLOCK_T=bt,
        BLOCK_E=be,
        BLOCK_K=bk,
        **LAUNCH,
    )


def replay_topk_backward_triton(
    *, grad_weights, logits, ids_used, score_function, normalize, scaling, grad_logits
) -> None:
    """The kernel of ``compass::replay_topk_backward``."""
    t, e = logits.shape
    k = ids_used.shape[1]
    _check_common(logits, k)
    if t == 0:
        return
    bt, be, bk = _blocks(e, k)
    _replay_bwd_kernel[(triton.cdiv(t, bt),)](
        grad_weights,
        logits,
        ids_used,
        grad_logits,
        t,
        e,
        k,
        float(scaling),
        SCORE=int(score_function),
        NORMALIZE=bool(normalize),
        BLOCK_T=bt,
        BLOCK_E=be,
        BLOCK_K=bk,
        **LAUNCH,
    )


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of the variants the wrappers
    launch for DeepSeek-V3 (E=256, K=8) and Qwen3-MoE (E=128, K=8) shapes, float32
    logits and uint8 ids (tests/test_aot.py compiles exactly these)."""
    fwd_sig = {
        "z_ptr": "*fp32",
        "ids_ptr": "*u8",
        "bias_ptr": "*fp32",
        "valid_ptr": "*i1",
        "w_ptr": "*fp32",
        "map_ptr": "*i1",
        "tpe_ptr": "*i64",
        "counts_ptr": "*i64",
        "used_ptr": "*i64",
        "T": "i64",
        "E": "i32",
        "K": "i32",
        "scaling": "fp32",
        "ratio": "fp32",
        "SCORE": "constexpr",
        "NORMALIZE": "constexpr",
        "HAS_BIAS": "constexpr",
        "HAS_VALID": "constexpr",
        "HAS_RATIO": "constexpr",
        "BLOCK_T": "constexpr",
        "BLOCK_E": "constexpr",
        "BLOCK_K": "constexpr",
    }
    bwd_sig = {
        "g_ptr": "*fp32",
        "z_ptr": "*fp32",
        "used_ptr": "*i64",
        "out_ptr": "*fp32",
        "T": "i64",
        "E": "i32",
        "K": "i32",
        "scaling": "fp32",
        "SCORE": "constexpr",
        "NORMALIZE": "constexpr",
        "BLOCK_T": "constexpr",
        "BLOCK_E": "constexpr",
        "BLOCK_K": "constexpr",
    }
    out = []
    for e, k, score, bias in ((256, 8, 1, True), (128, 8, 0, False)):
        bt, be, bk = _blocks(e, k)
        const = {
            "SCORE": score,
            "NORMALIZE": True,
            "HAS_BIAS": bias,
            "HAS_VALID": True,
            "HAS_RATIO": False,
            "BLOCK_T": bt,
            "BLOCK_E": be,
            "BLOCK_K": bk,
        }
        out.append((_replay_fwd_kernel, fwd_sig, const, LAUNCH))
        bconst = {"SCORE": score, "NORMALIZE": True, "BLOCK_T": bt, "BLOCK_E": be, "BLOCK_K": bk}
        out.append((_replay_bwd_kernel, bwd_sig, bconst, LAUNCH))
    return out
