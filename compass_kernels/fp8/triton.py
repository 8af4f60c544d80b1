"""Triton kernels of ck.fp8: blockwise quantization, fused MoE permutation, unpermute.

Same contract as the torch backend (spec: ``reference.py``, bit for bit);
outputs are allocated by the caller and written here. The kernels run on
CUDA tensors, on CPU tensors under ``TRITON_INTERPRET=1`` (tests), and
compile ahead of time for sm_90a (tests/test_aot.py).

Bit-exactness choices:
- fp32 -> e4m3: on sm_89+ the hardware cast (``.to(tl.float8e4nv)``:
  cvt.rn.satfinite.e4m3x2.f32, RNE, saturating at +-448, NaN -> 0x7F: the
  reference's bits), chosen per device by :func:`hw_e4m3`; elsewhere, and in the
  interpreter (whose cast is not the hardware's), integer bit arithmetic
  (:func:`_e4m3_bits`, torch's RNE after a clamp to +-448), which the CPU tests
  check on every tie.
- IEEE divisions (``tl.math.div_rn``; Triton's ``/`` lowers to the approximate
  div.full.f32) only per group: the scale amax / 448 and its reciprocal r.
  ``x * (1/s)`` is then one multiply; ``x / s`` is x r plus two fma
  corrections by the residual x - s q (:func:`_quotient`), the correctly
  rounded quotient, bit for bit (tests/test_fp8_quotient.py).
- every kernel compiles with ``enable_fp_fusion=False``: a contracted
  multiply-add (unpermute's combine) would round differently from the CPU.
- bf16 outputs are rounded by bit arithmetic too (round to nearest even).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "quantize_triton",
    "permute_quantize_triton",
    "permute_offsets_triton",
    "unpermute_triton",
    "aot_variants",
]

#: Launch options of every kernel here (tests/test_aot.py compiles with these).
LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}
#: Slots per chunk of the permutation (as the CUDA kernels: the workspace layout).
CHUNK = 256
#: Slots compared per step of the rank kernel.
RANK_STEP = 16
#: The offsets scan's tile: chunks per step x experts per program (8 int32 = one
#: 32-byte sector per tile row).
SCAN_CHUNKS = 256
SCAN_EXPERTS = 8
#: Columns per group / block.
TILE = 128
#: Rows per step of the 128x128 weight-block kernel.
BLOCK_ROWS_PER_STEP = 32
#: Columns per program of the unpermute kernel (at most; 16 per thread: 2 x 128-bit
#: loads of bf16 per slot row).
UNPERMUTE_BLOCK = 2048
#: top-k up to which the unpermute kernel unrolls its slot loop (k a constexpr).
UNPERMUTE_MAX_K = 64
#: Rows per program of the 1 x 128 kernel (one group wide: 32 x 128 = 32 per thread).
GROUP_ROWS = 32
#: Groups of 128 per step of the permute scatter (2048 columns: 16 per thread).
SCATTER_GROUPS = 16
#: Scatter programs per SM (grid-stride over the tokens) and on the interpreter.
SCATTER_PER_SM = 8
INTERPRETER_PROGRAMS = 3


@triton.jit
def _e4m3_bits(y):
    """fp32 tensor -> e4m3fn bits (int32 0..255): RNE, saturating, subnormals kept."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    n = a - (120 << 23)
    normal = (n + 0x7FFFF + ((n >> 20) & 1)) >> 20
    # |x| + 2^14 has an ulp of 2^-9: the add rounds to the e4m3 subnormal grid.
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    r = tl.where(a < 0x3C800000, sub, normal)
    r = tl.where(a >= 0x43E00000, 0x7E, r)
    r = tl.where(a > 0x7F800000, 0x7F, r)
    return sign | r


@triton.jit
def _to_e4m3(y, HW_E4M3: tl.constexpr):
    """fp32 -> e4m3fn bytes (uint8): RNE, saturating at +-448, subnormals kept.
    HW_E4M3: the hardware conversion (cvt.rn.satfinite.e4m3x2.f32, two values
    per instruction, sm_89+: the same bits; NaN -> 0x7F); else bit arithmetic."""
    if HW_E4M3:
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return _e4m3_bits(y).to(tl.uint8)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(x, axis):
    """max |x| along axis, NaN if any is (tl.max drops NaN: PTX max.f32)."""
    return tl.reduce(tl.abs(x), axis, _max_nan)


@triton.jit
def _block_scale(amax, eps, UE8M0: tl.constexpr):
    # NaN-propagating floor: a NaN / inf amax keeps a NaN / inf scale (reference.py)
    s = tl.math.div_rn(tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL), 448.0)
    if UE8M0:
        b = s.to(tl.int32, bitcast=True)
        e = (b >> 23) + ((b & 0x7FFFFF) != 0).to(tl.int32)
        finite = (b & 0x7F800000) != 0x7F800000
        s = tl.where(finite, (e << 23).to(tl.float32, bitcast=True), s)
    return s


@triton.jit
def _div_by(x, s, r):
    """x / s rounded to nearest even (= div_rn) from r = div_rn(1, s), with no
    division: q0 = x * r is within 1.5 ulp; a residual x - s * q (exact in one
    fma) times r corrects it to a faithful q1, a second step to the correctly
    rounded quotient (Markstein's theorem: r correctly rounded, q1 faithful).
    Holds while the residuals do not underflow: s >= 2^-64 (smaller scales
    are rescaled, see _quantize_bytes); s = inf / NaN (a non-finite block)
    gives unspecified bytes, as the NaN policy allows. The sign is x's: the
    quotient's sign, a zero's included."""
    q = x * r
    q = tl.fma(tl.fma(-s, q, x), r, q)
    q = tl.fma(tl.fma(-s, q, x), r, q)
    # the sign of x (s > 0): x = -0 gives -0 + (+0) = +0 above, div_rn gives -0
    qb = q.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return (qb | (x.to(tl.int32, bitcast=True) & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _quotient(x, s):
    """div_rn(x, s[:, None]) for x [A, B] fp32, s [A] > 0, with one division per row.
    A scale below 2^-64 (eps < ~1e-17, an all-tiny group): x and s scaled by
    2^64 (exact: the same quotient) so the residuals of _div_by stay normal;
    one multiply per element, no branch (a tile-uniform branch would double
    the code for a case of tiny eps only)."""
    k = tl.where(s < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
    sk = s * k
    r = tl.math.div_rn(tl.full(sk.shape, 1.0, tl.float32), sk)
    return _div_by(x * k[:, None], sk[:, None], r[:, None])


@triton.jit
def _quantize_bytes(x, s, UE8M0: tl.constexpr, USE_DIV: tl.constexpr, HW_E4M3: tl.constexpr):
    """e4m3 bytes of x [A, B] fp32 with per-row scales s [A]: e4m3(x * div_rn(1, s))
    (USE_DIV=False) or e4m3(div_rn(x, s)) (USE_DIV=True), the reference's bits;
    one IEEE division per row (the reciprocal), none per element."""
    if USE_DIV and not UE8M0:
        y = _quotient(x, s)
    else:
        # a power-of-two scale (UE8M0): 1 / s is exact, x * (1 / s) == x / s
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        y = x * r[:, None]
    return _to_e4m3(y, HW_E4M3)


@triton.jit
def _quantize_block_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    xs,
    qs,
    ss0,
    ss1,
    eps,
    UE8M0: tl.constexpr,
    USE_DIV: tl.constexpr,
    HW_E4M3: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    RB: tl.constexpr,
):
    """One program per BR x BC block (weights: 128 x 128), RB rows at a time: a
    whole block live at once spills (ptxas: 2 KB with 4 warps); the second
    pass re-reads the block from L2 (32 KB of bf16), not HBM. The scale and its
    reciprocal once per block."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    c = j * BC + tl.arange(0, BC).to(tl.int64)
    amax = tl.zeros([BC], tl.float32)
    for r0 in range(0, BR, RB):
        r = i * BR + r0 + tl.arange(0, RB).to(tl.int64)
        m = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(x_ptr + r[:, None] * xs + c[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, _amax(x, 0), propagate_nan=tl.PropagateNan.ALL)
    s = _block_scale(tl.reduce(amax, 0, _max_nan), eps, UE8M0)
    tl.store(s_ptr + i * ss0 + j * ss1, s)
    sv = tl.zeros([RB], tl.float32) + s
    for r0 in range(0, BR, RB):
        r = i * BR + r0 + tl.arange(0, RB).to(tl.int64)
        m = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(x_ptr + r[:, None] * xs + c[None, :], mask=m, other=0.0).to(tl.float32)
        qb = _quantize_bytes(x, sv, UE8M0, USE_DIV, HW_E4M3)
        tl.store(q_ptr + r[:, None] * qs + c[None, :], qb, mask=m)


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    xs,
    qs,
    ss0,
    ss1,
    eps,
    UE8M0: tl.constexpr,
    USE_DIV: tl.constexpr,
    HW_E4M3: tl.constexpr,
    RT: tl.constexpr,
    BC: tl.constexpr,
):
    """One program per RT rows x one group of BC columns (activations: 1 x 128
    groups): each tile row is a group, 128-bit loads of 8 bf16 per thread, the
    group's amax in-thread + 4 shuffles, one scale and reciprocal per group."""
    r = tl.program_id(0).to(tl.int64) * RT + tl.arange(0, RT).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    c = j * BC + tl.arange(0, BC).to(tl.int64)
    m = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * xs + c[None, :], mask=m, other=0.0).to(tl.float32)
    s = _block_scale(_amax(x, 1), eps, UE8M0)
    tl.store(s_ptr + r * ss0 + j * ss1, s, mask=r < rows)
    tl.store(
        q_ptr + r[:, None] * qs + c[None, :], _quantize_bytes(x, s, UE8M0, USE_DIV, HW_E4M3), mask=m
    )


@triton.jit
def _permute_rank_kernel(
    ids_ptr,
    slots,
    experts,
    rank_ptr,
    counts_ptr,
    CHUNK: tl.constexpr,
    EP: tl.constexpr,
    SUB: tl.constexpr,
):
    """Per chunk: each slot's rank among the chunk's earlier slots of its expert
    (CHUNK x SUB comparisons per step: a CHUNK x CHUNK tile at once spills), and
    the chunk's per-expert counts (a histogram)."""
    chunk = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CHUNK)
    s = chunk * CHUNK + lanes
    e = tl.load(ids_ptr + s, mask=s < slots, other=-1).to(tl.int64)
    valid = (e >= 0) & (e < experts)
    e = tl.where(valid, e, -1)
    rank = tl.zeros([CHUNK], tl.int32)
    for b in range(0, CHUNK, SUB):
        cols = b + tl.arange(0, SUB)
        sc = chunk * CHUNK + cols
        ec = tl.load(ids_ptr + sc, mask=sc < slots, other=-1).to(tl.int64)
        same = (e[:, None] == ec[None, :]) & (cols[None, :] < lanes[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    tl.store(rank_ptr + s, rank, mask=valid)
    counts = tl.histogram(tl.where(valid, e, 0).to(tl.int32), EP, mask=valid)
    ex = tl.arange(0, EP).to(tl.int64)
    tl.store(counts_ptr + chunk * experts + ex, counts, mask=ex < experts)


@triton.jit
def _permute_scan_kernel(
    counts_ptr, base_ptr, chunks, experts, offsets_ptr, CB: tl.constexpr, EB: tl.constexpr
):
    """One program per EB experts: per expert, the exclusive prefix of its chunk
    counts, CB chunks per step (a [CB, EB] tile scanned with tl.cumsum along the
    chunks, plus the carry of the steps before); the expert's total goes to
    offsets[1 + e] (turned into offsets by _permute_offsets_kernel). The counts
    are [chunks, experts] row-major: each tile row is EB contiguous ints."""
    ex = tl.program_id(0).to(tl.int64) * EB + tl.arange(0, EB).to(tl.int64)
    em = ex < experts
    rows = tl.arange(0, CB).to(tl.int64)
    carry = tl.zeros([EB], tl.int32)
    for c0 in range(0, chunks, CB):
        c = c0 + rows
        m = (c[:, None] < chunks) & em[None, :]
        at = c[:, None] * experts + ex[None, :]
        n = tl.load(counts_ptr + at, mask=m, other=0)
        tl.store(base_ptr + at, tl.cumsum(n, axis=0) - n + carry[None, :], mask=m)
        carry += tl.sum(n, axis=0)
    tl.store(offsets_ptr + 1 + ex, carry.to(tl.int64), mask=em)


@triton.jit
def _permute_offsets_kernel(offsets_ptr, experts, EP: tl.constexpr):
    """One program: offsets[1:] = inclusive prefix of the per-expert totals, offsets[0] = 0."""
    ex = tl.arange(0, EP).to(tl.int64)
    em = ex < experts
    total = tl.load(offsets_ptr + 1 + ex, mask=em, other=0)
    tl.store(offsets_ptr + 1 + ex, tl.cumsum(total, axis=0), mask=em)
    tl.store(offsets_ptr + ex, tl.zeros([EP], tl.int64), mask=ex == 0)


@triton.jit
def _permute_scatter_kernel(
    x_ptr,
    xs,
    cols,
    ids_ptr,
    tokens,
    k,
    experts,
    rank_ptr,
    base_ptr,
    offsets_ptr,
    q_ptr,
    qs,
    s_ptr,
    ss0,
    ss1,
    src_ptr,
    dst_ptr,
    eps,
    UE8M0: tl.constexpr,
    HW_E4M3: tl.constexpr,
    KP: tl.constexpr,
    GB: tl.constexpr,
    BC: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Token rows t = pid, pid + programs, ... (a grid sized for the GPU): the
    rows of its k slots (KP >= k lanes at once), then per GB groups of its row:
    read and quantize once, store the fp8 bytes and scales to all k rows (one
    [KP, GB, BC] store)."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    g = tl.arange(0, GB).to(tl.int64)
    lane = tl.arange(0, BC).to(tl.int64)
    j = tl.arange(0, KP).to(tl.int64)
    for t in range(pid, tokens, nprog):
        slot = t * k + j
        e = tl.load(ids_ptr + slot, mask=j < k, other=-1).to(tl.int64)
        ok = (e >= 0) & (e < experts)
        p = (
            tl.load(offsets_ptr + e, mask=ok, other=0)
            + tl.load(base_ptr + (slot // CHUNK) * experts + e, mask=ok, other=0)
            + tl.load(rank_ptr + slot, mask=ok, other=0)
        )
        tl.store(src_ptr + p, slot, mask=ok)
        # an unchecked bad id: dropped (dst -1), no row written
        tl.store(dst_ptr + slot, tl.where(ok, p, -1), mask=j < k)
        for c0 in range(0, cols, GB * BC):
            gc = c0 // BC + g
            c = gc[:, None] * BC + lane[None, :]
            m = c < cols
            x = tl.load(x_ptr + t * xs + c, mask=m, other=0.0).to(tl.float32)
            s = _block_scale(_amax(x, 1), eps, UE8M0)
            qb = _quantize_bytes(x, s, UE8M0, True, HW_E4M3)
            sm = ok[:, None] & (gc * BC < cols)[None, :]
            tl.store(
                s_ptr + p[:, None] * ss0 + gc[None, :] * ss1,
                s[None, :] + tl.zeros([KP, GB], tl.float32),
                mask=sm,
            )
            qm = ok[:, None, None] & m[None, :, :]
            tl.store(
                q_ptr + p[:, None, None] * qs + c[None, :, :],
                qb[None, :, :] + tl.zeros([KP, GB, BC], tl.uint8),
                mask=qm,
            )


@triton.jit
def _unpermute_kernel(
    y_ptr,
    ys,
    cols,
    dst_ptr,
    w_ptr,
    out_ptr,
    K: tl.constexpr,
    OUT_BF16: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t, c-block] = sum_j w[t, j] y[dst[t k + j], c-block], j in order. One
    program per token and BLOCK columns; the K slots unrolled (K constexpr): their
    2 x K scalar index / weight loads and every row's masked loads are independent,
    issued together. EVEN (cols % BLOCK == 0): the column mask is dropped, the row
    loads are predicated only on the slot being kept (dst >= 0)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < cols
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        p = tl.load(dst_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j)
        keep = (p + tl.zeros([BLOCK], tl.int64)) >= 0  # one value: one predicate
        row = y_ptr + tl.maximum(p, 0) * ys
        if EVEN:
            m = keep
        else:
            m = cm & keep
        y = tl.load(row + c, mask=m, other=0.0).to(tl.float32)
        acc = tl.where(keep, acc + w * y, acc)
    out = out_ptr + t * cols + c
    if OUT_BF16:
        u = acc.to(tl.int32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        bits = tl.where(nan, (u >> 16) | 0x40, rounded).to(tl.int16)
    else:
        bits = acc
    if EVEN:
        tl.store(out, bits)
    else:
        tl.store(out, bits, mask=cm)


# ------------------------------------------------------------------ wrappers


def hw_e4m3(device: torch.device) -> bool:
    """Whether kernels on ``device`` convert to e4m3 with the hardware instruction
    (sm_89+; ``meta``: the sm_90a code tests/aot.py compiles); the interpreter
    (CPU tensors) takes the bit arithmetic, whose bits the tests check."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "meta"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, per_sm: int) -> int:
    """Programs of a grid-stride launch: ``per_sm`` per SM (H100 SXM's 132 for meta
    tensors, the sm_90a plans; INTERPRETER_PROGRAMS on the CPU)."""
    if device.type == "cuda":
        return _sm_count(device.index or 0) * per_sm
    return 132 * per_sm if device.type == "meta" else INTERPRETER_PROGRAMS


def quantize_triton(
    *,
    x: torch.Tensor,
    block_rows: int,
    block_cols: int,
    eps: float,
    ue8m0: bool,
    use_div: bool,
    scale_layout: int,
    q: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Blockwise quantization into ``q`` (float8_e4m3fn) and ``scales`` (float32,
    any strides: the layout is the caller's). Blocks (1, 128) or (128, 128);
    x [R, C] float32 | bfloat16 | float16 with unit column stride."""
    if block_cols != TILE or block_rows not in (1, TILE):
        raise ValueError(
            f"block: the Triton kernels support (1, 128) and (128, 128), got ({block_rows}, "
            f"{block_cols})"
        )
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return
    if x.stride(1) != 1 and cols > 1:
        raise ValueError(f"x: expected unit stride along the last dim, got strides {x.stride()}")
    qb = q.view(torch.uint8)
    args = (x, qb, scales, rows, cols, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1))
    flags = {"UE8M0": bool(ue8m0), "USE_DIV": bool(use_div), "HW_E4M3": hw_e4m3(x.device)}
    if block_rows == TILE:
        grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
        _quantize_block_kernel[grid](
            *args,
            float(eps),
            **flags,
            BR=TILE,
            BC=TILE,
            RB=BLOCK_ROWS_PER_STEP,
            **LAUNCH,
        )
    else:
        # row tiles on grid axis 0 (up to 2^31 - 1; axis 1 stops at 65,535)
        grid = (triton.cdiv(rows, GROUP_ROWS), triton.cdiv(cols, TILE))
        _quantize_groups_kernel[grid](
            *args,
            float(eps),
            **flags,
            RT=GROUP_ROWS,
            BC=TILE,
            **LAUNCH,
        )


def permute_quantize_triton(
    *,
    x,
    topk_ids,
    num_experts,
    eps,
    ue8m0,
    scale_layout,
    q,
    scales,
    expert_offsets,
    src_index,
    dst_index,
    workspace,
    num_programs=None,
) -> None:
    """The fused permutation + 1x128 quantization (argument contract:
    reference.py, permute_quantize_torch). ``num_programs``: the scatter's
    grid (default: SCATTER_PER_SM per SM; tests force a grid-stride loop)."""
    m, k = topk_ids.shape
    slots, cols = m * k, x.shape[1]
    chunks = triton.cdiv(slots, CHUNK)
    ep = triton.next_power_of_2(num_experts)
    rank = workspace[:slots]
    counts = workspace[slots : slots + chunks * num_experts]
    base = workspace[slots + chunks * num_experts :]
    if chunks:
        _permute_rank_kernel[(chunks,)](
            topk_ids,
            slots,
            num_experts,
            rank,
            counts,
            CHUNK=CHUNK,
            EP=ep,
            SUB=RANK_STEP,
            **LAUNCH,
        )
    permute_offsets_triton(counts, chunks, num_experts, base, expert_offsets)
    if slots == 0:
        return
    if num_programs is None:
        num_programs = _programs(x.device, SCATTER_PER_SM)
    gb = min(SCATTER_GROUPS, triton.next_power_of_2(max(1, triton.cdiv(cols, TILE))))
    _permute_scatter_kernel[(max(1, min(num_programs, m)),)](
        x,
        x.stride(0),
        cols,
        topk_ids,
        m,
        k,
        num_experts,
        rank,
        base,
        expert_offsets,
        q.view(torch.uint8),
        q.stride(0),
        scales,
        scales.stride(0),
        scales.stride(1),
        src_index,
        dst_index,
        float(eps),
        UE8M0=bool(ue8m0),
        HW_E4M3=hw_e4m3(x.device),
        KP=triton.next_power_of_2(k),
        GB=gb,
        BC=TILE,
        CHUNK=CHUNK,
        **LAUNCH,
    )


def permute_offsets_triton(
    counts,
    chunks,
    num_experts,
    base,
    expert_offsets,
    *,
    scan_chunks=SCAN_CHUNKS,
    scan_experts=SCAN_EXPERTS,
) -> None:
    """The permutation's offsets from per-chunk expert counts: ``base`` [chunks, E]
    int32, the exclusive prefix over chunks per expert, and ``expert_offsets``
    [E+1] int64, the exclusive prefix over experts of the totals (both written).

    counts : [chunks * E] int32 (row-major [chunks, E]). Two launches: a scan of
    ceil(E / scan_experts) programs (parallel over experts, scan_chunks chunks a
    step), then one program over the E totals."""
    grid = (triton.cdiv(num_experts, scan_experts),)
    _permute_scan_kernel[grid](
        counts, base, chunks, num_experts, expert_offsets, CB=scan_chunks, EB=scan_experts, **LAUNCH
    )
    _permute_offsets_kernel[(1,)](
        expert_offsets, num_experts, EP=triton.next_power_of_2(num_experts), **LAUNCH
    )


def unpermute_triton(*, y, dst_index, topk_weights, out) -> None:
    """out[t] = sum_j w[t, j] * y[dst_index[t*k + j]] (fp32, j order, no FMA)."""
    m, k = topk_weights.shape
    cols = y.shape[1]
    if m == 0 or cols == 0:
        return
    if k > UNPERMUTE_MAX_K:
        raise ValueError(f"topk_weights: expected at most {UNPERMUTE_MAX_K} columns (k), got {k}")
    bf16 = out.dtype == torch.bfloat16
    block = min(UNPERMUTE_BLOCK, max(TILE, triton.next_power_of_2(cols)))
    grid = (m, triton.cdiv(cols, block))
    _unpermute_kernel[grid](
        y,
        y.stride(0),
        cols,
        dst_index,
        topk_weights,
        out.view(torch.int16) if bf16 else out,
        K=k,
        OUT_BF16=bf16,
        EVEN=cols % block == 0,
        BLOCK=block,
        **LAUNCH,
    )


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of each variant the wrappers
    launch with bf16 inputs and the default flags (tests/test_aot.py compiles them)."""
    quant = {
        "x_ptr": "*bf16",
        "q_ptr": "*u8",
        "s_ptr": "*fp32",
        "rows": "i64",
        "cols": "i64",
        "xs": "i64",
        "qs": "i64",
        "ss0": "i64",
        "ss1": "i64",
        "eps": "fp32",
        "UE8M0": "constexpr",
        "USE_DIV": "constexpr",
        "HW_E4M3": "constexpr",
    }
    out = []
    for ue8m0 in (False, True):  # the weight sync's scales, DeepGEMM's UE8M0 scales
        block = quant | {"BR": "constexpr", "BC": "constexpr", "RB": "constexpr"}
        const = {
            "UE8M0": ue8m0,
            "USE_DIV": False,
            "HW_E4M3": True,
            "BR": TILE,
            "BC": TILE,
            "RB": BLOCK_ROWS_PER_STEP,
        }
        out.append((_quantize_block_kernel, block, const, LAUNCH))
        groups = quant | {"RT": "constexpr", "BC": "constexpr"}
        out.append(
            (
                _quantize_groups_kernel,
                groups,
                {"UE8M0": ue8m0, "USE_DIV": True, "HW_E4M3": True, "RT": GROUP_ROWS, "BC": TILE},
                LAUNCH,
            )
        )
    rank = {
        "ids_ptr": "*i32",
        "slots": "i64",
        "experts": "i64",
        "rank_ptr": "*i32",
        "counts_ptr": "*i32",
        "CHUNK": "constexpr",
        "EP": "constexpr",
        "SUB": "constexpr",
    }
    out.append((_permute_rank_kernel, rank, {"CHUNK": CHUNK, "EP": 256, "SUB": RANK_STEP}, LAUNCH))
    scan = {
        "counts_ptr": "*i32",
        "base_ptr": "*i32",
        "chunks": "i64",
        "experts": "i64",
        "offsets_ptr": "*i64",
        "CB": "constexpr",
        "EB": "constexpr",
    }
    out.append((_permute_scan_kernel, scan, {"CB": SCAN_CHUNKS, "EB": SCAN_EXPERTS}, LAUNCH))
    offs = {"offsets_ptr": "*i64", "experts": "i64", "EP": "constexpr"}
    out.append((_permute_offsets_kernel, offs, {"EP": 256}, LAUNCH))
    scatter = {  # i32 sizes and strides, as launched (tests/launch_plans.py)
        "x_ptr": "*bf16",
        "xs": "i32",
        "cols": "i32",
        "ids_ptr": "*i32",
        "tokens": "i32",
        "k": "i32",
        "experts": "i32",
        "rank_ptr": "*i32",
        "base_ptr": "*i32",
        "offsets_ptr": "*i64",
        "q_ptr": "*u8",
        "qs": "i32",
        "s_ptr": "*fp32",
        "ss0": "i32",
        "ss1": "i32",
        "src_ptr": "*i64",
        "dst_ptr": "*i64",
        "eps": "fp32",
        "UE8M0": "constexpr",
        "HW_E4M3": "constexpr",
        "KP": "constexpr",
        "GB": "constexpr",
        "BC": "constexpr",
        "CHUNK": "constexpr",
    }
    out.append(
        (
            _permute_scatter_kernel,
            scatter,
            {
                "UE8M0": False,
                "HW_E4M3": True,
                "KP": 8,
                "GB": SCATTER_GROUPS,
                "BC": TILE,
                "CHUNK": CHUNK,
            },
            LAUNCH,
        )
    )
    unperm = {
        "y_ptr": "*bf16",
        "ys": "i64",
        "cols": "i64",
        "dst_ptr": "*i64",
        "w_ptr": "*fp32",
        "out_ptr": "*i16",
        "K": "constexpr",
        "OUT_BF16": "constexpr",
        "EVEN": "constexpr",
        "BLOCK": "constexpr",
    }
    out.append(
        (
            _unpermute_kernel,
            unperm,
            {"K": 8, "OUT_BF16": True, "EVEN": True, "BLOCK": UNPERMUTE_BLOCK},
            LAUNCH,
        )
    )
    return out
