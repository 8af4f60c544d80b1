"""Triton kernels of ck.fp8: blockwise quantization, fused MoE permutation, unpermute.

Same contract as the torch backend (spec: ``reference.py``, bit for bit);
outputs are allocated by the caller and written here. The kernels run on
CUDA tensors, on CPU tensors under ``TRITON_INTERPRET=1`` (tests), and
compile ahead of time for sm_90a (tests/test_aot.py).

Bit-exactness choices:
- fp32 -> e4m3 is integer bit arithmetic (:func:`_e4m3_bits`, the same
  round-to-nearest-even as torch's cast after a clamp to +-448), not ``.to(tl.float8e4nv)``: the
  hardware cast (cvt.rn.satfinite) gives the same bits on sm_90, but the
  interpreter's cast does not, and the bit form is what can be tested here.
- divisions are ``tl.math.div_rn`` (IEEE); Triton's ``/`` lowers to the
  approximate div.full.f32 on the GPU, which can move a value across an e4m3
  rounding boundary.
- every kernel compiles with ``enable_fp_fusion=False``: a contracted
  multiply-add (unpermute's combine) would round differently from the CPU.
- bf16 outputs are rounded by bit arithmetic too (round to nearest even).
"""

from __future__ import annotations

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
#: Columns per program of the unpermute kernel.
UNPERMUTE_BLOCK = 512


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
def _quantize_values(x, s, USE_DIV: tl.constexpr):
    if USE_DIV:
        y = tl.math.div_rn(x, s)
    else:
        y = x * tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return _e4m3_bits(y).to(tl.uint8)


@triton.jit
def _quantize_block_kernel(
    x_ptr, q_ptr, s_ptr, rows, cols, xs, qs, ss0, ss1, eps,
    UE8M0: tl.constexpr, USE_DIV: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    RB: tl.constexpr,
):  # fmt: skip
    """One program per BR x BC block (weights: 128 x 128), RB rows at a time: a
    whole block live at once spills (ptxas: 2 KB with 4 warps); the second
    pass re-reads the block from L2 (32 KB of bf16), not HBM."""
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
    sb = tl.full([RB, BC], 0.0, tl.float32) + s
    for r0 in range(0, BR, RB):
        r = i * BR + r0 + tl.arange(0, RB).to(tl.int64)
        m = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(x_ptr + r[:, None] * xs + c[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(q_ptr + r[:, None] * qs + c[None, :], _quantize_values(x, sb, USE_DIV), mask=m)


@triton.jit
def _quantize_row_groups(x_ptr, row, cols, q_ptr, qrow, s_ptr, srow, ss1, eps,
                         UE8M0: tl.constexpr, USE_DIV: tl.constexpr, NG: tl.constexpr,
                         BC: tl.constexpr):  # fmt: skip
    """Row ``row`` of x in groups of BC columns -> row ``qrow`` of q / ``srow`` of scales."""
    g = tl.arange(0, NG).to(tl.int64)
    c = g[:, None] * BC + tl.arange(0, BC).to(tl.int64)[None, :]
    m = c < cols
    x = tl.load(x_ptr + row + c, mask=m, other=0.0).to(tl.float32)
    s = _block_scale(_amax(x, 1), eps, UE8M0)
    tl.store(s_ptr + srow + g * ss1, s, mask=g * BC < cols)
    sb = tl.zeros([NG, BC], tl.float32) + s[:, None]
    tl.store(q_ptr + qrow + c, _quantize_values(x, sb, USE_DIV), mask=m)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, rows, cols, xs, qs, ss0, ss1, eps,
    UE8M0: tl.constexpr, USE_DIV: tl.constexpr, NG: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """One program per row (activations: 1 x 128 groups, NG >= groups per row)."""
    r = tl.program_id(0).to(tl.int64)
    _quantize_row_groups(x_ptr, r * xs, cols, q_ptr, r * qs, s_ptr, r * ss0, ss1, eps,
                         UE8M0, USE_DIV, NG, BC)  # fmt: skip


@triton.jit
def _permute_rank_kernel(ids_ptr, slots, experts, rank_ptr, counts_ptr,
                         CHUNK: tl.constexpr, EP: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
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
def _permute_scan_kernel(counts_ptr, base_ptr, chunks, experts, offsets_ptr,
                         CB: tl.constexpr, EB: tl.constexpr):  # fmt: skip
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
    x_ptr, xs, cols, ids_ptr, k, experts, rank_ptr, base_ptr, offsets_ptr,
    q_ptr, qs, s_ptr, ss0, ss1, src_ptr, dst_ptr, eps,
    UE8M0: tl.constexpr, NG: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program per slot: its row, the index maps, the quantized row."""
    slot = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    if (e >= 0) & (e < experts):
        chunk = slot // CHUNK
        p = (
            tl.load(offsets_ptr + e)
            + tl.load(base_ptr + chunk * experts + e)
            + tl.load(rank_ptr + slot)
        )
        tl.store(src_ptr + p, slot)
        tl.store(dst_ptr + slot, p)
        _quantize_row_groups(x_ptr, (slot // k) * xs, cols, q_ptr, p * qs, s_ptr, p * ss0, ss1,
                             eps, UE8M0, True, NG, BC)  # fmt: skip
    else:  # unchecked bad id: dropped, no row written
        tl.store(dst_ptr + slot, -1)


@triton.jit
def _unpermute_kernel(y_ptr, ys, cols, dst_ptr, w_ptr, k, out_ptr,
                      OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    cm = c < cols
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(k):
        p = tl.load(dst_ptr + t * k + j) + tl.zeros([BLOCK], tl.int64)
        w = tl.load(w_ptr + t * k + j)
        keep = p >= 0
        y = tl.load(y_ptr + p * ys + c, mask=cm & keep, other=0.0).to(tl.float32)
        acc = tl.where(keep, acc + w * y, acc)
    if OUT_BF16:
        u = acc.to(tl.int32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        bits = tl.where(nan, (u >> 16) | 0x40, rounded)
        tl.store(out_ptr + t * cols + c, bits.to(tl.int16), mask=cm)
    else:
        tl.store(out_ptr + t * cols + c, acc, mask=cm)


# ------------------------------------------------------------------ wrappers


def _groups_pow2(cols: int) -> int:
    return triton.next_power_of_2(max(1, triton.cdiv(cols, TILE)))


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
    if block_rows == TILE:
        grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
        _quantize_block_kernel[grid](
            *args, float(eps), UE8M0=bool(ue8m0), USE_DIV=bool(use_div), BR=TILE, BC=TILE,
            RB=BLOCK_ROWS_PER_STEP, **LAUNCH,
        )  # fmt: skip
    else:
        _quantize_groups_kernel[(rows,)](
            *args, float(eps), UE8M0=bool(ue8m0), USE_DIV=bool(use_div),
            NG=_groups_pow2(cols), BC=TILE, **LAUNCH,
        )  # fmt: skip


def permute_quantize_triton(
    *, x, topk_ids, num_experts, eps, ue8m0, scale_layout, q, scales, expert_offsets, src_index,
    dst_index, workspace,
) -> None:  # fmt: skip
    """The fused permutation + 1x128 quantization (argument contract:
    reference.py, permute_quantize_torch)."""
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
    _permute_scatter_kernel[(slots,)](
        x, x.stride(0), cols, topk_ids, k, num_experts, rank, base, expert_offsets,
        q.view(torch.uint8), q.stride(0), scales, scales.stride(0), scales.stride(1),
        src_index, dst_index, float(eps),
        UE8M0=bool(ue8m0), NG=_groups_pow2(cols), BC=TILE, CHUNK=CHUNK, **LAUNCH,
    )  # fmt: skip


def permute_offsets_triton(
    counts, chunks, num_experts, base, expert_offsets, *, scan_chunks=SCAN_CHUNKS,
    scan_experts=SCAN_EXPERTS,
) -> None:  # fmt: skip
    """The permutation's offsets from per-chunk expert counts: ``base`` [chunks, E]
    int32, the exclusive prefix over chunks per expert, and ``expert_offsets``
    [E+1] int64, the exclusive prefix over experts of the totals (both written).

    counts : [chunks * E] int32 (row-major [chunks, E]). Two launches: a scan of
    ceil(E / scan_experts) programs (parallel over experts, scan_chunks chunks a
    step), then one program over the E totals."""
    grid = (triton.cdiv(num_experts, scan_experts),)
    _permute_scan_kernel[grid](counts, base, chunks, num_experts, expert_offsets,
                               CB=scan_chunks, EB=scan_experts, **LAUNCH)  # fmt: skip
    _permute_offsets_kernel[(1,)](expert_offsets, num_experts,
                                  EP=triton.next_power_of_2(num_experts), **LAUNCH)  # fmt: skip


def unpermute_triton(*, y, dst_index, topk_weights, out) -> None:
    """out[t] = sum_j w[t, j] * y[dst_index[t*k + j]] (fp32, j order, no FMA)."""
    m, k = topk_weights.shape
    cols = y.shape[1]
    if m == 0 or cols == 0:
        return
    bf16 = out.dtype == torch.bfloat16
    grid = (m, triton.cdiv(cols, UNPERMUTE_BLOCK))
    _unpermute_kernel[grid](
        y, y.stride(0), cols, dst_index, topk_weights, k, out.view(torch.int16) if bf16 else out,
        OUT_BF16=bf16, BLOCK=UNPERMUTE_BLOCK, **LAUNCH,
    )  # fmt: skip


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of each variant the wrappers
    launch with bf16 inputs and the default flags (tests/test_aot.py compiles them)."""
    quant = {
        "x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "rows": "i64", "cols": "i64",
        "xs": "i64", "qs": "i64", "ss0": "i64", "ss1": "i64", "eps": "fp32",
        "UE8M0": "constexpr", "USE_DIV": "constexpr",
    }  # fmt: skip
    out = []
    for ue8m0 in (False, True):  # the weight sync's scales, DeepGEMM's UE8M0 scales
        block = quant | {"BR": "constexpr", "BC": "constexpr", "RB": "constexpr"}
        const = {"UE8M0": ue8m0, "USE_DIV": False, "BR": TILE, "BC": TILE,
                 "RB": BLOCK_ROWS_PER_STEP}  # fmt: skip
        out.append((_quantize_block_kernel, block, const, LAUNCH))
        groups = quant | {"NG": "constexpr", "BC": "constexpr"}
        out.append((_quantize_groups_kernel, groups,
                    {"UE8M0": ue8m0, "USE_DIV": True, "NG": 64, "BC": TILE}, LAUNCH))  # fmt: skip
    rank = {"ids_ptr": "*i32", "slots": "i64", "experts": "i64", "rank_ptr": "*i32",
            "counts_ptr": "*i32", "CHUNK": "constexpr", "EP": "constexpr",
            "SUB": "constexpr"}  # fmt: skip
    out.append((_permute_rank_kernel, rank, {"CHUNK": CHUNK, "EP": 256, "SUB": RANK_STEP}, LAUNCH))
    scan = {"counts_ptr": "*i32", "base_ptr": "*i32", "chunks": "i64", "experts": "i64",
            "offsets_ptr": "*i64", "CB": "constexpr", "EB": "constexpr"}  # fmt: skip
    out.append((_permute_scan_kernel, scan, {"CB": SCAN_CHUNKS, "EB": SCAN_EXPERTS}, LAUNCH))
    offs = {"offsets_ptr": "*i64", "experts": "i64", "EP": "constexpr"}
    out.append((_permute_offsets_kernel, offs, {"EP": 256}, LAUNCH))
    scatter = {
        "x_ptr": "*bf16", "xs": "i64", "cols": "i64", "ids_ptr": "*i32", "k": "i64",
        "experts": "i64", "rank_ptr": "*i32", "base_ptr": "*i32", "offsets_ptr": "*i64",
        "q_ptr": "*u8", "qs": "i64", "s_ptr": "*fp32", "ss0": "i64", "ss1": "i64",
        "src_ptr": "*i64", "dst_ptr": "*i64", "eps": "fp32", "UE8M0": "constexpr",
        "NG": "constexpr", "BC": "constexpr", "CHUNK": "constexpr",
    }  # fmt: skip
    out.append((_permute_scatter_kernel, scatter,
                {"UE8M0": False, "NG": 64, "BC": TILE, "CHUNK": CHUNK}, LAUNCH))  # fmt: skip
    unperm = {
        "y_ptr": "*bf16", "ys": "i64", "cols": "i64", "dst_ptr": "*i64", "w_ptr": "*fp32",
        "k": "i64", "out_ptr": "*i16", "OUT_BF16": "constexpr", "BLOCK": "constexpr",
    }  # fmt: skip
    out.append((_unpermute_kernel, unperm, {"OUT_BF16": True, "BLOCK": UNPERMUTE_BLOCK}, LAUNCH))
    return out
