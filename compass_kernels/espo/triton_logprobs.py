"""Triton kernels of ck.espo's token log-probs and entropy.

Same contract as the torch backend (the spec is ``reference_logprobs.py``;
the float32 state and formulas are stated there, above the torch kernels):
outputs are allocated by the caller and written here. They run on CUDA
tensors, on CPU tensors under ``TRITON_INTERPRET=1`` (tests), and compile
ahead of time for sm_90 (``aot_variants``).

One program per token row, looping over the vocabulary in BLOCK-wide chunks
with the float32 online state (m, s, a): the row is read once in the forward
and once in the backward, any V works (151,936 included), and the grid is the
token count on axis 0 (up to 2^31 - 1 programs: no 65,535 limit of axes 1/2),
with int64 row offsets (T * V passes 2^31 at 65,536 x 32,768). Each row is
read as a masked head up to the next 16-byte boundary, an unmasked aligned
body (128-bit loads / stores: 8 bf16 or 4 fp32 per access, for any V and row
stride) and a masked tail (docs/design.md, "ESPO log-probs and entropy").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from compass_kernels._validate import check_tensor

__all__ = [
    "token_logprobs_entropy_triton",
    "token_logprobs_entropy_bwd_triton",
    "logprobs_tile_stats_triton",
    "BLOCK",
    "LAUNCH",
    "aot_variants",
]

#: Vocabulary chunk per loop iteration: 2048 fp32 = 8 KiB per row in registers
#: over 4 warps (16 values per thread); wide enough to saturate HBM with one
#: program per row, small enough not to spill.
BLOCK = 2048
#: Launch options of every kernel here (tests/test_espo_logprobs_triton.py compiles with these).
LAUNCH = {"num_warps": 4}
_MIN_EXP = -200.0  # reference_logprobs._MIN_EXP


_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
#: _MIN_EXP in base-2 units (exp(-200) = 2^(-200 log2 e): 0 in float32 either way).
_MIN_EXP2 = tl.constexpr(_MIN_EXP * 1.4426950408889634)


@triton.jit
def _lane_stats(x, m, s, a, scale, ENT: tl.constexpr):
    """Fold one chunk x [LANES, VEC] float32 (-inf in masked elements) into the
    per-lane state m, s, a [LANES]: each lane (a row of x, all in one thread) keeps
    its own online max, so the loop has no cross-thread reduction (no shuffle, no
    barrier); the lanes are merged once per row (_merge_lanes). Base 2: with
    dd = (x - m) scale (scale = log2 e / T), s = sum 2^dd and a = sum 2^dd dd
    (exp2 is one MUFU.EX2, flush-to-zero: terms below 2^-126 of the lane max are 0)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    # Only -inf so far: shift by 0 instead (every term is then 2^-288 = 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # NaN-propagating clamps (the default tl.maximum is PTX max.f32, which drops
    # NaN): a NaN logit, or a +inf one (inf - inf), makes s NaN, hence NaN
    # log-prob and entropy for the row, as the torch backend gives.
    d = tl.maximum((m - m_safe) * scale, _MIN_EXP2, propagate_nan=tl.PropagateNan.ALL)
    c = tl.exp2(d)
    if ENT:
        a = c * (a + s * d)
    s = c * s
    dd = tl.maximum(
        (x - m_safe[:, None]) * scale, _MIN_EXP2, propagate_nan=tl.PropagateNan.ALL
    )  # x - m exact near the max
    e = tl.exp2(dd)
    s += tl.sum(e, axis=1)
    if ENT:
        a += tl.sum(e * dd, axis=1)
    return m_new, s, a


@triton.jit
def _merge_lanes(m, s, a, scale):
    """The row's (max, sum, entropy sum) from the per-lane state of _lane_stats:
    one cross-thread reduction per row; a in natural-log units (sum e^d d)."""
    mx = tl.max(m, axis=0)
    m_safe = tl.where(mx == float("-inf"), 0.0, mx)
    d = tl.maximum((m - m_safe) * scale, _MIN_EXP2, propagate_nan=tl.PropagateNan.ALL)
    c = tl.exp2(d)
    return mx, tl.sum(c * s, axis=0), tl.sum(c * (a + s * d), axis=0) * _LN2


@triton.jit
def _merge_state(m0, s0, a0, m1, s1, a1, inv_t):
    """Two online states (m, s = sum e^d, a = sum e^d d, d = (x - m) / T) as one."""
    mx = tl.maximum(m0, m1)
    m_safe = tl.where(mx == float("-inf"), 0.0, mx)
    d0 = tl.maximum((m0 - m_safe) * inv_t, -200.0, propagate_nan=tl.PropagateNan.ALL)
    d1 = tl.maximum((m1 - m_safe) * inv_t, -200.0, propagate_nan=tl.PropagateNan.ALL)
    c0 = tl.exp(d0)
    c1 = tl.exp(d1)
    return mx, c0 * s0 + c1 * s1, c0 * (a0 + s0 * d0) + c1 * (a1 + s1 * d1)


@triton.jit
def _aligned_split(base, V, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """A row at element offset ``base`` of an aligned tensor: the head length h
    (< VEC) that brings ``base + h`` to a multiple of VEC (16 bytes), the aligned
    body start, and the body's whole-BLOCK length."""
    h = tl.minimum((VEC - (base & (VEC - 1))) & (VEC - 1), V).to(tl.int32)
    body = tl.multiple_of(base + h, VEC)
    n_full = (V - h) // BLOCK * BLOCK
    return h, body, n_full


@triton.jit
def _row_stats(
    logits_ptr, base, V, inv_t, ENT: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr
):
    """(m, s, a) of the row at ``logits_ptr + base``, V elements (a in natural-log
    units). Each step is a [BLOCK / VEC, VEC] tile, a lane of VEC contiguous
    elements per tile row: the body loads are unmasked and 16-byte aligned
    (ld.global.v4 when the tensor starts on 16 bytes, as every torch allocation
    does); the < VEC head and < BLOCK tail are masked."""
    LANES: tl.constexpr = BLOCK // VEC
    cols = tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    scale = inv_t * _LOG2E
    m = tl.full([LANES], float("-inf"), tl.float32)
    s = tl.zeros([LANES], tl.float32)
    a = tl.zeros([LANES], tl.float32)
    h, body, n_full = _aligned_split(base, V, VEC, BLOCK)
    if h > 0:
        x = tl.load(logits_ptr + base + cols, mask=cols < h, other=float("-inf"))
        m, s, a = _lane_stats(x.to(tl.float32), m, s, a, scale, ENT)
    for v0 in range(0, n_full, BLOCK):
        x = tl.load(logits_ptr + body + v0 + cols).to(tl.float32)
        m, s, a = _lane_stats(x, m, s, a, scale, ENT)
    rest = V - h - n_full
    if rest > 0:
        x = tl.load(logits_ptr + body + n_full + cols, mask=cols < rest, other=float("-inf"))
        m, s, a = _lane_stats(x.to(tl.float32), m, s, a, scale, ENT)
    return _merge_lanes(m, s, a, scale)


@triton.jit
def _fwd_kernel(
    logits_ptr,
    targets_ptr,
    logp_ptr,
    entropy_ptr,
    max_ptr,
    log_norm_ptr,
    stride_row,
    V,
    inv_t,
    ENT: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * stride_row
    row_ptr = logits_ptr + base
    m, s, a = _row_stats(logits_ptr, base, V, inv_t, ENT, BLOCK, VEC)
    log_s = tl.log(s)
    y = tl.load(targets_ptr + row)
    ok = (y >= 0) & (y < V)
    xt = tl.load(row_ptr + tl.where(ok, y, 0)).to(tl.float32)  # never outside the row
    lp = tl.minimum(
        (xt - m) * inv_t - log_s, 0.0, propagate_nan=tl.PropagateNan.ALL
    )  # never positive; NaN stays
    # the ignore index (-100): 0; any other target outside [0, V): NaN (the policy)
    lp = tl.where(ok, lp, tl.where(y == -100, 0.0, float("nan")))
    tl.store(max_ptr + row, m)
    tl.store(log_norm_ptr + row, log_s)
    tl.store(logp_ptr + row, lp)
    if ENT:
        tl.store(
            entropy_ptr + row, tl.maximum(log_s - a / s, 0.0, propagate_nan=tl.PropagateNan.ALL)
        )
    else:
        tl.store(entropy_ptr + row, float("nan"))


@triton.jit
def _tile_kernel(
    logits_ptr,
    targets_ptr,
    state_in_ptr,
    state_out_ptr,
    stride_row,
    T,
    V,
    vocab_start,
    inv_t,
    ENT: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * stride_row
    row_ptr = logits_ptr + base
    m = tl.load(state_in_ptr + row)
    s = tl.load(state_in_ptr + T + row)
    a = tl.load(state_in_ptr + 2 * T + row)
    xt = tl.load(state_in_ptr + 3 * T + row)
    y = tl.load(targets_ptr + row) - vocab_start
    mine = (y >= 0) & (y < V)
    xt_here = tl.load(row_ptr + tl.where(mine, y, 0)).to(tl.float32)
    xt = tl.where(mine, xt_here, xt)
    m1, s1, a1 = _row_stats(logits_ptr, base, V, inv_t, ENT, BLOCK, VEC)
    m, s, a = _merge_state(m, s, a, m1, s1, a1, inv_t)
    tl.store(state_out_ptr + row, m)
    tl.store(state_out_ptr + T + row, s)
    tl.store(state_out_ptr + 2 * T + row, a)
    tl.store(state_out_ptr + 3 * T + row, xt)


@triton.jit
def _bwd_kernel(
    logits_ptr,
    targets_ptr,
    max_ptr,
    log_norm_ptr,
    entropy_ptr,
    gl_ptr,
    gh_ptr,
    grad_ptr,
    stride_row,
    stride_grad,
    V,
    vocab_start,
    inv_t,
    HAS_GL: tl.constexpr,
    HAS_GH: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    SAME_ALIGN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m = tl.load(max_ptr + row)
    log_s = tl.load(log_norm_ptr + row)
    y_raw = tl.load(targets_ptr + row)
    y = y_raw - vocab_start
    gl = tl.load(gl_ptr + row) if HAS_GL else 0.0
    gl = tl.where(y_raw == -100, 0.0, gl)  # the ignore index: no log-prob gradient
    if HAS_GH:
        gh = tl.load(gh_ptr + row)
        h = tl.load(entropy_ptr + row)
    else:
        gh = 0.0
        h = 0.0
    # Same split as the forward: aligned unmasked body, masked head and tail.
    base = row * stride_row
    gbase = row * stride_grad
    head, body, n_full = _aligned_split(base, V, VEC, BLOCK)
    gbody = gbase + head
    if SAME_ALIGN:  # stride_grad = stride_row (mod VEC): the logits' head aligns grad too
        gbody = tl.multiple_of(gbody, VEC)
    if head > 0:
        _bwd_chunk(
            logits_ptr + base, grad_ptr + gbase, 0, head, y, m, log_s, gl, gh, h, inv_t, True, BLOCK
        )
    for v0 in range(0, n_full, BLOCK):
        _bwd_chunk(
            logits_ptr + body + v0,
            grad_ptr + gbody + v0,
            head + v0,
            BLOCK,
            y,
            m,
            log_s,
            gl,
            gh,
            h,
            inv_t,
            False,
            BLOCK,
        )
    rest = V - head - n_full
    if rest > 0:
        _bwd_chunk(
            logits_ptr + body + n_full,
            grad_ptr + gbody + n_full,
            head + n_full,
            rest,
            y,
            m,
            log_s,
            gl,
            gh,
            h,
            inv_t,
            True,
            BLOCK,
        )


@triton.jit
def _bwd_chunk(
    x_ptr, g_ptr, idx0, n, y, m, log_s, gl, gh, h, inv_t, MASKED: tl.constexpr, BLOCK: tl.constexpr
):
    """grad of the n <= BLOCK elements at x_ptr (vocab index idx0 + i) into g_ptr."""
    cols = tl.arange(0, BLOCK)
    if MASKED:
        z = tl.load(x_ptr + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    else:
        z = tl.load(x_ptr + cols).to(tl.float32)
    d = tl.maximum(
        (z - m) * inv_t - log_s, -200.0, propagate_nan=tl.PropagateNan.ALL
    )  # z - m exact near the max
    p = tl.exp(d)
    # float32 until the store: the one-hot is added to the float32 softmax term.
    g = -p * (gl + gh * (d + h))
    g = tl.where(idx0 + cols == y, g + gl, g)
    g = (g * inv_t).to(g_ptr.dtype.element_ty)
    if MASKED:
        tl.store(g_ptr + cols, g, mask=cols < n)
    else:
        tl.store(g_ptr + cols, g)


# ------------------------------------------------------------------ wrappers

_LOGITS = (torch.float32, torch.bfloat16)


def _check_logits(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, ndim=2, dtypes=_LOGITS)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected a contiguous vocab dimension, got strides {t.stride()}")


def _check_rows(name: str, t: torch.Tensor, rows: int, dtype: torch.dtype, device) -> None:
    check_tensor(
        name, t, ndim=1, dtypes=(dtype,), size=rows, size_what="one per token", device=device
    )
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def _vec(t: torch.Tensor) -> int:
    """Elements per 16-byte load (8 bf16, 4 fp32)."""
    return 16 // t.element_size()


def _inv_t(temperature: float) -> float:
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature: expected a finite value > 0, got {temperature}")
    return 1.0 / temperature


def token_logprobs_entropy_triton(
    *,
    logits,
    targets,
    temperature,
    with_entropy,
    logp,
    entropy,
    row_max,
    log_norm,
    block: int = BLOCK,
) -> None:
    """Forward: logp, entropy (NaN unless with_entropy), row_max, log_norm [T] float32
    written in place (lse = row_max + log_norm, of logits / temperature).

    logits [T, V] float32 | bfloat16 (vocab dim contiguous); targets [T] int64 in
    [0, V) (trusted: the public API checks them on CPU)."""
    _check_logits("logits", logits)
    rows, dev = logits.shape[0], logits.device
    _check_rows("targets", targets, rows, torch.int64, dev)
    outs = (("logp", logp), ("entropy", entropy), ("row_max", row_max), ("log_norm", log_norm))
    for name, t in outs:
        _check_rows(name, t, rows, torch.float32, dev)
    if rows == 0:
        return
    _fwd_kernel[(rows,)](
        logits,
        targets,
        logp,
        entropy,
        row_max,
        log_norm,
        logits.stride(0),
        logits.shape[1],
        _inv_t(temperature),
        ENT=bool(with_entropy),
        BLOCK=block,
        VEC=_vec(logits),
        **LAUNCH,
    )


def logprobs_tile_stats_triton(
    *,
    logits,
    targets,
    vocab_start,
    temperature,
    with_entropy,
    state_in,
    state_out,
    block: int = BLOCK,
) -> None:
    """One vocab tile of the online statistics (reference_logprobs.logprobs_tile_stats_torch)."""
    _check_logits("logits", logits)
    rows, dev = logits.shape[0], logits.device
    _check_rows("targets", targets, rows, torch.int64, dev)
    for name, t in (("state_in", state_in), ("state_out", state_out)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), size=4, device=dev)
        if t.shape[1] != rows or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous [4, {rows}] tensor, got {t.shape}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start: expected >= 0, got {vocab_start}")
    if rows == 0:
        return
    _tile_kernel[(rows,)](
        logits,
        targets,
        state_in,
        state_out,
        logits.stride(0),
        rows,
        logits.shape[1],
        vocab_start,
        _inv_t(temperature),
        ENT=bool(with_entropy),
        BLOCK=block,
        VEC=_vec(logits),
        **LAUNCH,
    )


def token_logprobs_entropy_bwd_triton(
    *,
    logits,
    targets,
    row_max,
    log_norm,
    entropy,
    grad_logprob,
    grad_entropy,
    temperature,
    vocab_start,
    grad_logits,
    block: int = BLOCK,
) -> None:
    """Backward: grad_logits [T, V] (logits' dtype, or bfloat16 for float32
    logits: the fused path's d logits rounded once at the store) written in place."""
    _check_logits("logits", logits)
    rows, dev = logits.shape[0], logits.device
    _check_rows("targets", targets, rows, torch.int64, dev)
    _check_rows("row_max", row_max, rows, torch.float32, dev)
    _check_rows("log_norm", log_norm, rows, torch.float32, dev)
    _check_rows("entropy", entropy, rows, torch.float32, dev)
    for name, t in (("grad_logprob", grad_logprob), ("grad_entropy", grad_entropy)):
        if t is not None:
            _check_rows(name, t, rows, torch.float32, dev)
    gdt = (logits.dtype, torch.bfloat16) if logits.dtype == torch.float32 else (logits.dtype,)
    check_tensor("grad_logits", grad_logits, ndim=2, dtypes=gdt, device=dev)
    if grad_logits.shape != logits.shape or (logits.shape[1] > 1 and grad_logits.stride(1) != 1):
        raise ValueError(
            f"grad_logits: expected shape {tuple(logits.shape)} with a contiguous vocab "
            f"dimension, got {tuple(grad_logits.shape)} strides {grad_logits.stride()}"
        )
    if vocab_start < 0:
        raise ValueError(f"vocab_start: expected >= 0, got {vocab_start}")
    if rows == 0:
        return
    vec = _vec(logits)
    _bwd_kernel[(rows,)](
        logits,
        targets,
        row_max,
        log_norm,
        entropy,
        grad_logprob if grad_logprob is not None else entropy,  # unread when HAS_GL=False
        grad_entropy if grad_entropy is not None else entropy,
        grad_logits,
        logits.stride(0),
        grad_logits.stride(0),
        logits.shape[1],
        vocab_start,
        _inv_t(temperature),
        HAS_GL=grad_logprob is not None,
        HAS_GH=grad_entropy is not None,
        BLOCK=block,
        VEC=vec,
        SAME_ALIGN=(grad_logits.stride(0) - logits.stride(0)) % vec == 0,
        **LAUNCH,
    )


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of every variant the wrappers
    launch, for ahead-of-time compilation for sm_90. The logits / grad pointers are
    compiled 16-byte aligned (what Triton specializes for a torch allocation); the
    strides and V are not (any vocab, any row stride): the body loads must be
    128-bit from the kernel's own split, not from a lucky V % 16 == 0."""
    aligned = LAUNCH | {"divisible_by_16": ("logits_ptr",)}
    aligned_bwd = LAUNCH | {"divisible_by_16": ("logits_ptr", "grad_ptr")}
    out: list[tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]] = []
    for dt in ("fp32", "bf16"):
        fwd = {
            "logits_ptr": f"*{dt}",
            "targets_ptr": "*i64",
            "logp_ptr": "*fp32",
            "entropy_ptr": "*fp32",
            "max_ptr": "*fp32",
            "log_norm_ptr": "*fp32",
            "stride_row": "i64",
            "V": "i32",
            "inv_t": "fp32",
            "ENT": "constexpr",
            "BLOCK": "constexpr",
            "VEC": "constexpr",
        }
        tile = {
            "logits_ptr": f"*{dt}",
            "targets_ptr": "*i64",
            "state_in_ptr": "*fp32",
            "state_out_ptr": "*fp32",
            "stride_row": "i64",
            "T": "i64",
            "V": "i32",
            "vocab_start": "i64",
            "inv_t": "fp32",
            "ENT": "constexpr",
            "BLOCK": "constexpr",
            "VEC": "constexpr",
        }
        bwd = {
            "logits_ptr": f"*{dt}",
            "targets_ptr": "*i64",
            "max_ptr": "*fp32",
            "log_norm_ptr": "*fp32",
            "entropy_ptr": "*fp32",
            "gl_ptr": "*fp32",
            "gh_ptr": "*fp32",
            "grad_ptr": f"*{dt}",
            "stride_row": "i64",
            "stride_grad": "i64",
            "V": "i32",
            "vocab_start": "i64",
            "inv_t": "fp32",
            "HAS_GL": "constexpr",
            "HAS_GH": "constexpr",
            "BLOCK": "constexpr",
            "VEC": "constexpr",
            "SAME_ALIGN": "constexpr",
        }
        vec = 4 if dt == "fp32" else 8
        for ent in (True, False):
            out.append((_fwd_kernel, fwd, {"ENT": ent, "BLOCK": BLOCK, "VEC": vec}, aligned))
            out.append((_tile_kernel, tile, {"ENT": ent, "BLOCK": BLOCK, "VEC": vec}, aligned))
        # float32 logits tiles also store their d logits straight to bf16 (fused path)
        grads = ("fp32", "bf16") if dt == "fp32" else ("bf16",)
        for gdt in grads:
            for gl, gh in ((True, True), (True, False), (False, True)):
                const = {"HAS_GL": gl, "HAS_GH": gh, "BLOCK": BLOCK, "VEC": vec, "SAME_ALIGN": True}
                out.append((_bwd_kernel, bwd | {"grad_ptr": f"*{gdt}"}, const, aligned_bwd))
    return out
