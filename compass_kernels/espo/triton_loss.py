"""Triton kernels of the ESPO segmented loss (``ck.espo.espo_loss``).

Same contract as the torch backend (``reference_loss.py``, which holds the
spec too): outputs are allocated by the caller and written here.
They run on CUDA tensors, on CPU tensors under ``TRITON_INTERPRET=1`` (tests),
and compile ahead of time for sm_90a (tests/test_aot.py via
:func:`aot_variants`).

A grid of (sequence, split) for both phases: program (i, j) takes the
BLOCK-token chunks j, j + S, j + 2S, ... of sequence i with int64 offsets (S
from the token count per sequence, known on the host: 64k tokens in 8
sequences is 8 x 32 programs of one chunk, not 8 of 32; no grid or int32
limit) and writes a partial row; :func:`_combine_kernel` folds the S partial
rows of each sequence in a fixed order. Per-group accumulators are [BLOCK, KP]
tiles selected by a one-hot of the token's bucket (KP: K rounded up to a power
of two). Float64 arithmetic throughout, as in the torch backend: the clip decision compares ratios
against 1 +- 3e-4 (GSPO), where float32 rounding would flip tokens. Fixed
reduction trees: deterministic, no atomics.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from compass_kernels._validate import check_tensor

__all__ = [
    "espo_group_sums_triton",
    "espo_loss_forward_triton",
    "espo_loss_backward_triton",
    "BLOCK",
    "LAUNCH",
]

#: Tokens per chunk: RL responses are 100s to 10k+ tokens; 256 float64 lanes
#: keep 4 warps busy without idling most lanes on short sequences.
BLOCK = 256
#: Elements per program of the backward (a streaming multiply), and per step
#: of the loop that zeroes the padding's gradient.
BACKWARD_BLOCK = 1024
#: Sequences per step of the final reduction: three [32, 3K+7 -> pow2] float64
#: tiles fit in registers (with 256 rows ptxas spilled ~0.5 KB per thread).
REDUCE_BLOCK = 32
LAUNCH = {"num_warps": 4}
_FLAG_PER_SEQ, _FLAG_TOKEN, _FLAG_DROP, _FLAG_ADAPTIVE, _FLAG_GSPO, _FLAG_ADV_TOK = (
    1,
    2,
    4,
    8,
    16,
    32,
)


def _f64_bits(x: float) -> int:
    """float64 ``x`` as int64 bits: Triton passes Python floats as fp32 scalars,
    and the clip bounds must stay float64 (bitcast back in the kernel)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@triton.jit
def _f64(bits):
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _bucket(e, thr_ptr, row, Q: tl.constexpr):
    b = tl.zeros(e.shape, dtype=tl.int32)
    for k in tl.static_range(Q):
        thr = tl.load(thr_ptr + row * Q + k)
        b += (e > thr).to(tl.int32)
    return b


@triton.jit
def _sums_kernel(
    e_ptr,
    l_ptr,
    lo_ptr,
    cu_ptr,
    mask_ptr,
    thr_ptr,
    sums_ptr,
    S,
    K: tl.constexpr,
    KP: tl.constexpr,
    PER_SEQ: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    ks = tl.arange(0, KP)
    row = i if PER_SEQ else i * 0
    acc_c = tl.zeros([BLOCK, KP], dtype=tl.float64)
    acc_d = tl.zeros([BLOCK, KP], dtype=tl.float64)
    acc_e = tl.zeros([BLOCK, KP], dtype=tl.float64)
    j = tl.program_id(1).to(tl.int64)
    for base in range(start + j * BLOCK, end, S * BLOCK):
        idx = base + lanes
        m = idx < end
        if HAS_MASK:
            m = m & (tl.load(mask_ptr + idx, mask=m, other=0) != 0)
        e = tl.load(e_ptr + idx, mask=m, other=0.0).to(tl.float64)
        d = tl.load(l_ptr + idx, mask=m, other=0.0).to(tl.float64) - tl.load(
            lo_ptr + idx, mask=m, other=0.0
        ).to(tl.float64)
        b = _bucket(e, thr_ptr, row, K - 1)
        hit = (b[:, None] == ks[None, :]) & m[:, None]
        acc_c += tl.where(hit, 1.0, 0.0)
        acc_d += tl.where(hit, d[:, None], 0.0)
        acc_e += tl.where(hit, e[:, None], 0.0)
    out = sums_ptr + (i * S + j) * (K * 3) + ks * 3
    keep = ks < K
    tl.store(out, tl.sum(acc_c, axis=0), mask=keep)
    tl.store(out + 1, tl.sum(acc_d, axis=0), mask=keep)
    tl.store(out + 2, tl.sum(acc_e, axis=0), mask=keep)


@triton.jit
def _forward_kernel(
    l_ptr,
    lo_ptr,
    e_ptr,
    adv_ptr,
    cu_ptr,
    mask_ptr,
    thr_ptr,
    sums_ptr,
    grad_ptr,
    rows_ptr,
    S,
    eps_low_bits,
    eps_high_bits,
    eps_scale_bits,
    dual_bits,
    log_lo_bits,
    log_hi_bits,
    inv_g_bits,
    K: tl.constexpr,
    KP: tl.constexpr,
    FLAGS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    PER_SEQ: tl.constexpr = (FLAGS & 1) != 0
    TOKEN: tl.constexpr = (FLAGS & 2) != 0
    DROP: tl.constexpr = (FLAGS & 4) != 0
    ADAPTIVE: tl.constexpr = (FLAGS & 8) != 0
    GSPO: tl.constexpr = (FLAGS & 16) != 0
    ADV_TOK: tl.constexpr = (FLAGS & 32) != 0
    W: tl.constexpr = 3 * K + 7
    i = tl.program_id(0).to(tl.int64)
    eps_low, eps_high = _f64(eps_low_bits), _f64(eps_high_bits)
    eps_scale, dual_c = _f64(eps_scale_bits), _f64(dual_bits)
    log_lo, log_hi, inv_g = _f64(log_lo_bits), _f64(log_hi_bits), _f64(inv_g_bits)
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    ks = tl.arange(0, KP)
    row = i if PER_SEQ else i * 0
    srow = sums_ptr + i * (K * 3)
    cnt_k = tl.load(srow + ks * 3, mask=ks < K, other=0.0)
    if TOKEN:
        groups = tl.maximum(tl.sum(cnt_k, axis=0), 1.0)
    else:
        present = cnt_k > 0
        if DROP:
            present = present & (ks >= 1)
        groups = tl.maximum(tl.sum(tl.where(present, 1.0, 0.0), axis=0), 1.0)
    if not ADV_TOK:
        a_seq = tl.load(adv_ptr + i).to(tl.float64)
    acc_loss = tl.zeros([BLOCK], dtype=tl.float64)
    acc_tok = tl.zeros([BLOCK], dtype=tl.float64)
    acc_ratio = tl.zeros([BLOCK], dtype=tl.float64)
    acc_k3 = tl.zeros([BLOCK], dtype=tl.float64)
    acc_big = tl.zeros([BLOCK], dtype=tl.float64)
    acc_min = tl.full([BLOCK], float("inf"), dtype=tl.float64)
    acc_max = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
    acc_low = tl.zeros([BLOCK, KP], dtype=tl.float64)
    acc_high = tl.zeros([BLOCK, KP], dtype=tl.float64)
    acc_dual = tl.zeros([BLOCK, KP], dtype=tl.float64)
    j = tl.program_id(1).to(tl.int64)
    for base in range(start + j * BLOCK, end, S * BLOCK):
        idx = base + lanes
        inside = idx < end
        valid = inside
        if HAS_MASK:
            valid = valid & (tl.load(mask_ptr + idx, mask=inside, other=0) != 0)
        e = tl.load(e_ptr + idx, mask=valid, other=0.0).to(tl.float64)
        d = tl.load(l_ptr + idx, mask=valid, other=0.0).to(tl.float64) - tl.load(
            lo_ptr + idx, mask=valid, other=0.0
        ).to(tl.float64)
        acc_k3 += tl.where(valid, tl.exp(d) - 1.0 - d, 0.0)
        acc_big += tl.where(valid & (tl.abs(d) > 0.69314718055994530942), 1.0, 0.0)
        if TOKEN:
            b = tl.zeros([BLOCK], dtype=tl.int32)
        else:
            b = _bucket(e, thr_ptr, row, K - 1)
        in_loss = valid
        if DROP:
            in_loss = in_loss & (b > 0)
        cnt = tl.load(srow + b * 3, mask=in_loss, other=1.0)
        if TOKEN:
            mg = d
        else:
            mg = tl.load(srow + b * 3 + 1, mask=in_loss, other=0.0) / cnt
        if ADAPTIVE:
            eps = eps_scale * (tl.load(srow + b * 3 + 2, mask=in_loss, other=0.0) / cnt)
            el = eps
            eh = eps
        else:
            el = eps_low
            eh = eps_high
        if ADV_TOK:
            a = tl.load(adv_ptr + idx, mask=in_loss, other=0.0).to(tl.float64)
        else:
            a = tl.zeros([BLOCK], dtype=tl.float64) + a_seq
        if GSPO:
            log_s = mg
        else:
            log_s = mg + d
        clamped = (log_s < log_lo) | (log_s > log_hi)
        # NaN-propagating clamps (tl.maximum's default drops NaN): a NaN log-ratio
        # gives a NaN ratio, loss and gradient, not exp(log_lo)
        s = tl.exp(
            tl.minimum(
                tl.maximum(log_s, log_lo, propagate_nan=tl.PropagateNan.ALL),
                log_hi,
                propagate_nan=tl.PropagateNan.ALL,
            )
        )
        c = tl.minimum(
            tl.maximum(s, 1.0 - el, propagate_nan=tl.PropagateNan.ALL),
            1.0 + eh,
            propagate_nan=tl.PropagateNan.ALL,
        )
        o1 = s * a
        o2 = c * a
        clipped = o2 < o1
        f = tl.where(clipped, o2, o1)
        floor = dual_c * a
        dual = (
            tl.where(a < 0.0, 1, 0) * tl.where(f < floor, 1, 0) * tl.where(dual_c > 0.0, 1, 0)
        ) != 0
        f = tl.where(dual, floor, f)
        g = tl.where(clipped | dual | clamped, 0.0, a * s)
        if TOKEN:
            w = inv_g / groups
        else:
            w = inv_g / (groups * cnt)
        acc_loss += tl.where(in_loss, -w * f, 0.0)
        acc_tok += tl.where(in_loss, 1.0, 0.0)
        acc_ratio += tl.where(in_loss, s, 0.0)
        acc_min = tl.minimum(
            acc_min, tl.where(in_loss, s, float("inf")), propagate_nan=tl.PropagateNan.ALL
        )
        acc_max = tl.maximum(
            acc_max, tl.where(in_loss, s, float("-inf")), propagate_nan=tl.PropagateNan.ALL
        )
        hit = (b[:, None] == ks[None, :]) & in_loss[:, None]
        acc_low += tl.where(hit & (clipped & (a < 0.0))[:, None], 1.0, 0.0)
        acc_high += tl.where(hit & (clipped & (a > 0.0))[:, None], 1.0, 0.0)
        acc_dual += tl.where(hit & dual[:, None], 1.0, 0.0)
        if NEED_GRAD:
            gt = tl.where(in_loss, -w * g, 0.0)
            tl.store(grad_ptr + idx, gt.to(grad_ptr.dtype.element_ty), mask=inside)
    out = rows_ptr + (i * S + j) * W
    keep = ks < K
    tl.store(out + ks, tl.sum(acc_low, axis=0), mask=keep)
    tl.store(out + K + ks, tl.sum(acc_high, axis=0), mask=keep)
    tl.store(out + 2 * K + ks, tl.sum(acc_dual, axis=0), mask=keep)
    tl.store(out + 3 * K, tl.sum(acc_loss, axis=0))
    tl.store(out + 3 * K + 1, tl.sum(acc_tok, axis=0))
    tl.store(out + 3 * K + 2, tl.sum(acc_ratio, axis=0))
    tl.store(out + 3 * K + 3, tl.sum(acc_k3, axis=0))
    tl.store(out + 3 * K + 4, tl.sum(acc_big, axis=0))
    tl.store(out + 3 * K + 5, tl.reduce(acc_min, 0, _min_nan))
    tl.store(out + 3 * K + 6, tl.reduce(acc_max, 0, _max_nan))


@triton.jit
def _combine_kernel(
    part_ptr,
    out_ptr,
    S,
    W: tl.constexpr,
    WP: tl.constexpr,
    MINMAX: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Program i: row i of out from the S partial rows i*S .. i*S+S-1, summed in a
    # fixed order (the last two columns NaN-propagating min / max with MINMAX).
    i = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WP)
    parts = tl.arange(0, BLOCK_S).to(tl.int64)
    acc_sum = tl.zeros([BLOCK_S, WP], dtype=tl.float64)
    acc_min = tl.full([BLOCK_S, WP], float("inf"), dtype=tl.float64)
    acc_max = tl.full([BLOCK_S, WP], float("-inf"), dtype=tl.float64)
    for base in range(0, S, BLOCK_S):
        p = base + parts
        m = (p < S)[:, None] & (cols < W)[None, :]
        x = tl.load(part_ptr + (i * S + p)[:, None] * W + cols[None, :], mask=m, other=0.0)
        acc_sum += x
        if MINMAX:
            acc_min = tl.minimum(
                acc_min, tl.where(m, x, float("inf")), propagate_nan=tl.PropagateNan.ALL
            )
            acc_max = tl.maximum(
                acc_max, tl.where(m, x, float("-inf")), propagate_nan=tl.PropagateNan.ALL
            )
    out = tl.sum(acc_sum, axis=0)
    if MINMAX:
        out = tl.where(
            cols == W - 2,
            tl.reduce(acc_min, 0, _min_nan),
            tl.where(cols == W - 1, tl.reduce(acc_max, 0, _max_nan), out),
        )
    tl.store(out_ptr + i * W + cols, out, mask=cols < W)


@triton.jit
def _reduce_kernel(
    rows_ptr,
    cu_ptr,
    stats_ptr,
    loss_ptr,
    grad_ptr,
    n,
    T,
    K: tl.constexpr,
    WP: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,
):
    # One program: the batch statistics from the per-sequence rows in a fixed
    # order, the loss, and zero gradients for the padding after cu[n].
    W: tl.constexpr = 3 * K + 7
    cols = tl.arange(0, WP)
    seqs = tl.arange(0, BLOCK).to(tl.int64)
    acc_sum = tl.zeros([BLOCK, WP], dtype=tl.float64)
    acc_min = tl.full([BLOCK, WP], float("inf"), dtype=tl.float64)
    acc_max = tl.full([BLOCK, WP], float("-inf"), dtype=tl.float64)
    for base in range(0, n, BLOCK):
        i = base + seqs
        m = (i < n)[:, None] & (cols < W)[None, :]
        x = tl.load(rows_ptr + i[:, None] * W + cols[None, :], mask=m, other=0.0)
        acc_sum += x
        acc_min = tl.minimum(
            acc_min, tl.where(m, x, float("inf")), propagate_nan=tl.PropagateNan.ALL
        )
        acc_max = tl.maximum(
            acc_max, tl.where(m, x, float("-inf")), propagate_nan=tl.PropagateNan.ALL
        )
    total = tl.sum(acc_sum, axis=0)
    out = tl.where(
        cols == W - 2,
        tl.reduce(acc_min, 0, _min_nan),
        tl.where(cols == W - 1, tl.reduce(acc_max, 0, _max_nan), total),
    )
    tl.store(stats_ptr + cols, out, mask=cols < W)
    loss = tl.sum(tl.where(cols == 3 * K, total, 0.0), axis=0)
    tl.store(loss_ptr, loss.to(loss_ptr.dtype.element_ty))
    if NEED_GRAD:
        tail = tl.load(cu_ptr + n)
        lanes = tl.arange(0, TAIL_BLOCK).to(tl.int64)
        for base in range(tail, T, TAIL_BLOCK):
            idx = base + lanes
            tl.store(
                grad_ptr + idx,
                tl.zeros([TAIL_BLOCK], dtype=grad_ptr.dtype.element_ty),
                mask=idx < T,
            )


@triton.jit
def _backward_kernel(g_ptr, coef_ptr, out_ptr, T, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < T
    g = tl.load(g_ptr)
    tl.store(out_ptr + idx, g * tl.load(coef_ptr + idx, mask=m, other=0.0), mask=m)


# ----------------------------------------------------------------- wrappers

_REAL = (torch.float32, torch.float64)


def _check(name, t, dtypes, device, size=None, what="") -> None:
    check_tensor(name, t, ndim=1, dtypes=dtypes, size=size, size_what=what, device=device)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _pow2(k: int) -> int:
    return 1 << max(k - 1, 0).bit_length()


#: Programs the split aims for (about 4 per SM of an H100 / H200: 132 SMs).
SPLIT_PROGRAMS = 512
#: Partial rows per step of _combine_kernel.
COMBINE_BLOCK = 32


def _splits(total: int, n: int) -> int:
    """Programs per sequence: one per BLOCK-token chunk of the mean sequence,
    capped so the grid is about SPLIT_PROGRAMS (host ints only: no sync)."""
    chunks = -(-total // (max(n, 1) * BLOCK))
    return max(1, min(chunks, -(-SPLIT_PROGRAMS // max(n, 1))))


def _combine(part, out, n, s, width, minmax) -> None:
    _combine_kernel[(n,)](
        part, out, s, W=width, WP=_pow2(width), MINMAX=minmax, BLOCK_S=COMBINE_BLOCK, **LAUNCH
    )


def _common(ref, cu_seqlens, mask, thresholds, num_groups, flags):
    device, total = ref.device, ref.shape[0]
    _check("cu_seqlens", cu_seqlens, (torch.int64,), device)
    n = cu_seqlens.shape[0] - 1
    if n < 0:
        raise ValueError("cu_seqlens: expected at least one element (n+1)")
    if mask is not None:
        _check("mask", mask, (torch.bool,), device, total, "one per token")
    if not 1 <= num_groups <= 8:
        raise ValueError(f"num_groups: expected 1..8, got {num_groups}")
    if flags & _FLAG_TOKEN and num_groups != 1:
        raise ValueError(f"num_groups: token groups (grpo) take 1 bucket, got {num_groups}")
    q = num_groups - 1
    want = n * q if flags & _FLAG_PER_SEQ else q
    _check("thresholds", thresholds, (torch.float64,), device, want, "group boundaries")
    return n


def espo_group_sums_triton(
    *, entropy, logprobs, old_logprobs, cu_seqlens, mask, thresholds, num_groups, flags, out
) -> None:
    """Phase 1: out [n*K*3] float64 = per (sequence, group) count, sum of
    l - l_old, sum of entropy (reference_loss.espo_group_sums_torch)."""
    _check("entropy", entropy, _REAL, None)
    device, total = entropy.device, entropy.shape[0]
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs)):
        _check(name, t, (entropy.dtype,), device, total, "one per token")
    n = _common(entropy, cu_seqlens, mask, thresholds, num_groups, flags)
    _check("out", out, (torch.float64,), device, n * num_groups * 3, "n x K x 3")
    if n == 0:
        return
    s = _splits(total, n)
    part = out if s == 1 else torch.empty(n * s * num_groups * 3, dtype=out.dtype, device=device)
    _sums_kernel[(n, s)](
        entropy,
        logprobs,
        old_logprobs,
        cu_seqlens,
        mask if mask is not None else cu_seqlens,
        thresholds,
        part,
        s,
        K=num_groups,
        KP=_pow2(num_groups),
        PER_SEQ=bool(flags & _FLAG_PER_SEQ),
        HAS_MASK=mask is not None,
        BLOCK=BLOCK,
        **LAUNCH,
    )
    if s > 1:
        _combine(part, out, n, s, num_groups * 3, False)


def espo_loss_forward_triton(
    *,
    logprobs,
    old_logprobs,
    entropy,
    advantages,
    cu_seqlens,
    mask,
    thresholds,
    sums,
    num_groups,
    flags,
    eps_low,
    eps_high,
    eps_scale,
    dual_clip,
    log_lo,
    log_hi,
    inv_num_seqs,
    need_grad,
    loss,
    grad,
    seq_stats,
    stats,
) -> None:
    """Phase 2 (COMPASS_ESPO_FORWARD_ARGS): loss [] , grad [T] (or [0]),
    seq_stats [n*(3K+7)], stats [3K+7], all written here."""
    _check("logprobs", logprobs, _REAL, None)
    device, total = logprobs.device, logprobs.shape[0]
    for name, t in (("old_logprobs", old_logprobs), ("entropy", entropy)):
        _check(name, t, (logprobs.dtype,), device, total, "one per token")
    n = _common(logprobs, cu_seqlens, mask, thresholds, num_groups, flags)
    adv_n = total if flags & _FLAG_ADV_TOK else n
    _check("advantages", advantages, (logprobs.dtype,), device, adv_n, "advantages")
    K, width = num_groups, 3 * num_groups + 7
    _check("sums", sums, (torch.float64,), device, n * K * 3, "n x K x 3")
    _check("grad", grad, (logprobs.dtype,), device, total if need_grad else 0, "tokens")
    _check("seq_stats", seq_stats, (torch.float64,), device, n * width, "n x (3K + 7)")
    _check("stats", stats, (torch.float64,), device, width, "3K + 7")
    if loss.numel() != 1 or loss.dtype != logprobs.dtype:
        raise ValueError(f"loss: expected one {logprobs.dtype} element, got {loss.shape}")
    if not (inv_num_seqs > 0 and log_lo <= log_hi):
        raise ValueError(
            f"inv_num_seqs > 0 and log_lo <= log_hi expected, got "
            f"{inv_num_seqs}, {log_lo}, {log_hi}"
        )
    grad_arg = grad if need_grad else logprobs  # unread without NEED_GRAD
    if n > 0:
        bits = [
            _f64_bits(x)
            for x in (eps_low, eps_high, eps_scale, dual_clip, log_lo, log_hi, inv_num_seqs)
        ]
        s = _splits(total, n)
        part = (
            seq_stats
            if s == 1
            else torch.empty(n * s * width, dtype=seq_stats.dtype, device=device)
        )
        _forward_kernel[(n, s)](
            logprobs,
            old_logprobs,
            entropy,
            advantages,
            cu_seqlens,
            mask if mask is not None else cu_seqlens,
            thresholds,
            sums,
            grad_arg,
            part,
            s,
            *bits,
            K=K,
            KP=_pow2(K),
            FLAGS=int(flags),
            HAS_MASK=mask is not None,
            NEED_GRAD=bool(need_grad),
            BLOCK=BLOCK,
            **LAUNCH,
        )
        if s > 1:
            _combine(part, seq_stats, n, s, width, True)
    _reduce_kernel[(1,)](
        seq_stats,
        cu_seqlens,
        stats,
        loss,
        grad_arg,
        n,
        total,
        K=K,
        WP=_pow2(width),
        NEED_GRAD=bool(need_grad),
        BLOCK=REDUCE_BLOCK,
        TAIL_BLOCK=BACKWARD_BLOCK,
        **LAUNCH,
    )


def espo_loss_backward_triton(*, grad_loss, grad_coef, out) -> None:
    """out = grad_loss * grad_coef (grad_loss one element)."""
    _check("grad_coef", grad_coef, _REAL, None)
    if grad_loss.numel() != 1 or grad_loss.dtype != grad_coef.dtype:
        raise ValueError(
            f"grad_loss: expected one {grad_coef.dtype} element, got "
            f"{grad_loss.dtype}{list(grad_loss.shape)}"
        )
    _check("out", out, (grad_coef.dtype,), grad_coef.device, grad_coef.shape[0], "tokens")
    total = grad_coef.shape[0]
    if total == 0:
        return
    _backward_kernel[(triton.cdiv(total, BACKWARD_BLOCK),)](
        grad_loss, grad_coef, out, total, BLOCK=BACKWARD_BLOCK, **LAUNCH
    )


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of the variants the
    wrappers launch for the default ESPO, GSPO and GRPO configurations in
    float32 (tests/test_aot.py compiles exactly these)."""
    sums_sig = {
        "e_ptr": "*fp32",
        "l_ptr": "*fp32",
        "lo_ptr": "*fp32",
        "cu_ptr": "*i64",
        "mask_ptr": "*i1",
        "thr_ptr": "*fp64",
        "sums_ptr": "*fp64",
        "S": "i32",
        "K": "constexpr",
        "KP": "constexpr",
        "PER_SEQ": "constexpr",
        "HAS_MASK": "constexpr",
        "BLOCK": "constexpr",
    }
    fwd_sig = {
        "l_ptr": "*fp32",
        "lo_ptr": "*fp32",
        "e_ptr": "*fp32",
        "adv_ptr": "*fp32",
        "cu_ptr": "*i64",
        "mask_ptr": "*i1",
        "thr_ptr": "*fp64",
        "sums_ptr": "*fp64",
        "grad_ptr": "*fp32",
        "rows_ptr": "*fp64",
        "S": "i32",
        "eps_low_bits": "i64",
        "eps_high_bits": "i64",
        "eps_scale_bits": "i64",
        "dual_bits": "i64",
        "log_lo_bits": "i64",
        "log_hi_bits": "i64",
        "inv_g_bits": "i64",
        "K": "constexpr",
        "KP": "constexpr",
        "FLAGS": "constexpr",
        "HAS_MASK": "constexpr",
        "NEED_GRAD": "constexpr",
        "BLOCK": "constexpr",
    }
    red_sig = {
        "rows_ptr": "*fp64",
        "cu_ptr": "*i64",
        "stats_ptr": "*fp64",
        "loss_ptr": "*fp32",
        "grad_ptr": "*fp32",
        "n": "i32",
        "T": "i64",
        "K": "constexpr",
        "WP": "constexpr",
        "NEED_GRAD": "constexpr",
        "BLOCK": "constexpr",
        "TAIL_BLOCK": "constexpr",
    }
    comb_sig = {
        "part_ptr": "*fp64",
        "out_ptr": "*fp64",
        "S": "i32",
        "W": "constexpr",
        "WP": "constexpr",
        "MINMAX": "constexpr",
        "BLOCK_S": "constexpr",
    }
    bwd_sig = {
        "g_ptr": "*fp32",
        "coef_ptr": "*fp32",
        "out_ptr": "*fp32",
        "T": "i64",
        "BLOCK": "constexpr",
    }
    out = []
    # (K, flags): espo default (adaptive eps, per-sequence advantages), gspo, grpo
    for K, flags in ((2, _FLAG_ADAPTIVE), (1, _FLAG_GSPO), (1, _FLAG_GSPO | _FLAG_TOKEN)):
        out.append(
            (
                _sums_kernel,
                sums_sig,
                {"K": K, "KP": _pow2(K), "PER_SEQ": False, "HAS_MASK": True, "BLOCK": BLOCK},
                LAUNCH,
            )
        )
        out.append(
            (
                _forward_kernel,
                fwd_sig,
                {
                    "K": K,
                    "KP": _pow2(K),
                    "FLAGS": flags,
                    "HAS_MASK": True,
                    "NEED_GRAD": True,
                    "BLOCK": BLOCK,
                },
                LAUNCH,
            )
        )
        out.append(
            (
                _reduce_kernel,
                red_sig,
                {
                    "K": K,
                    "WP": _pow2(3 * K + 7),
                    "NEED_GRAD": True,
                    "BLOCK": REDUCE_BLOCK,
                    "TAIL_BLOCK": BACKWARD_BLOCK,
                },
                LAUNCH,
            )
        )
    for w, minmax in ((6, False), (13, True)):  # K = 2: group sums, forward rows
        out.append(
            (
                _combine_kernel,
                comb_sig,
                {"W": w, "WP": _pow2(w), "MINMAX": minmax, "BLOCK_S": COMBINE_BLOCK},
                LAUNCH,
            )
        )
    out.append((_backward_kernel, bwd_sig, {"BLOCK": BACKWARD_BLOCK}, LAUNCH))
    return out
