"""Triton kernels of ck.packing: THD pack, unpack and position ids.

Same contract as the torch backend (spec and torch kernels in ``reference.py``;
design: docs/design.md, "THD pack / unpack"): rows are opaque
bytes (uint8 [T, W]); the wrappers view them as the widest integer unit that
divides the row and both base addresses, so one kernel serves every dtype.
Each program moves a tile of BLOCK units: ROWS rows x COLS units (a wide row
alone, BLOCK units a step; narrow rows many at once). The sequence, position
and source row are computed once per row, not per unit: two scalar binary
searches over the m + 1 offsets (``steps`` = bit length of m halvings) bound
the block's sequences, then each row searches only that span (usually none).
No host sync: every size arrives from the host plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

__all__ = ["thd_pack_triton", "thd_unpack_triton", "thd_positions_triton", "BLOCK", "LAUNCH"]

#: Units (8/4/2/1 bytes) per program: 1024 x 8 B = 8 KiB in flight per program.
BLOCK = 1024
LAUNCH = {"num_warps": 4}
_UNITS = ((8, torch.int64, "i64"), (4, torch.int32, "i32"), (2, torch.int16, "i16"))


@triton.jit
def _find(off_ptr, lo, hi, row, steps):
    """j in [lo, hi) with off[j] <= row < off[j + 1], given off[lo] <= row < off[hi]
    (row scalar or vector; ``steps`` >= ceil(log2(hi - lo)) halvings)."""
    for _ in range(steps):
        mid = (lo + hi) // 2
        go = tl.load(off_ptr + mid) <= row
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _block_segments(off_ptr, m, steps, r0, rows, total, ROWS: tl.constexpr):
    """Sequence of each of the rows [r0, r0 + ROWS) (clamped to total): two scalar
    searches bound the block's sequences to [j0, j1], then each row searches only
    that span (no step when the block lies in one sequence)."""
    last = tl.minimum(r0 + ROWS, total) - 1
    zero = r0 * 0  # a tensor, as the loop carries (0 and m may be constexprs)
    j0 = _find(off_ptr, zero, zero + m, r0, steps)
    if ROWS == 1:
        j = j0 + tl.zeros([ROWS], tl.int64)
    else:
        j1 = _find(off_ptr, j0, zero + m, last, steps)
        span = j1 - j0
        k = span * 0  # ceil(log2(j1 - j0 + 1)) halvings
        for _ in range(steps):
            k += (span > 0).to(k.dtype)
            span = span // 2
        lo = j0 + tl.zeros([ROWS], tl.int64)
        j = _find(off_ptr, lo, lo + (j1 + 1 - j0), tl.minimum(rows, last), k)
    return j


@triton.jit
def _zigzag_position(u, local, cp, rank):
    c = local // 2
    mirrored = tl.where(u < c, rank * c + u, (2 * cp - 1 - rank) * c + (u - c))
    return tl.where(cp == 1, u, mirrored)


@triton.jit
def _pack_kernel(
    src_ptr,
    start_ptr,
    len_ptr,
    off_ptr,
    out_ptr,
    m,
    steps,
    upr,
    cp,
    rank,
    fill,
    total,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Output rows [r0, r0 + ROWS), COLS units of each at a time: the sequence,
    position and source row are per row (no per-unit search or divide)."""
    r0 = tl.program_id(0).to(tl.int64) * ROWS
    row = r0 + tl.arange(0, ROWS).to(tl.int64)
    live = row < total
    j = _block_segments(off_ptr, m, steps, r0, row, total, ROWS)
    o0 = tl.load(off_ptr + j)
    o1 = tl.load(off_ptr + j + 1)
    p = _zigzag_position((row - o0).to(tl.int32), (o1 - o0).to(tl.int32), cp, rank)
    valid = live & (p < tl.load(len_ptr + j))
    src_row = (tl.load(start_ptr + j) + p) * upr
    out_row = row * upr
    cols = tl.arange(0, COLS).to(tl.int64)
    for c0 in range(0, upr, COLS):
        c = c0 + cols
        cm = c[None, :] < upr
        x = tl.load(src_ptr + src_row[:, None] + c[None, :], mask=valid[:, None] & cm, other=0)
        x = tl.where(valid[:, None], x, fill.to(x.dtype))
        tl.store(out_ptr + out_row[:, None] + c[None, :], x, mask=live[:, None] & cm)


@triton.jit
def _unpack_kernel(
    packed_ptr,
    cu_ptr,
    off_ptr,
    out_ptr,
    m,
    steps,
    upr,
    cp,
    rows_per_rank,
    total,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Unpacked rows [r0, r0 + ROWS): per row its sequence (via cu), its packed
    rank / row (one 32-bit divide per row), then COLS units at a time."""
    r0 = tl.program_id(0).to(tl.int64) * ROWS
    row = r0 + tl.arange(0, ROWS).to(tl.int64)
    live = row < total
    j = _block_segments(cu_ptr, m, steps, r0, row, total, ROWS)
    p = (row - tl.load(cu_ptr + j)).to(tl.int32)
    o0 = tl.load(off_ptr + j)
    local = (tl.load(off_ptr + j + 1) - o0).to(tl.int32)
    c = tl.maximum(local // 2, 1)
    q = p // c
    within = p - q * c
    r = tl.where(q < cp, q, 2 * cp - 1 - q)
    u = tl.where(q < cp, within, c + within)
    r = tl.where(cp == 1, 0, r)
    u = tl.where(cp == 1, p, u)
    src_row = (r * rows_per_rank + o0 + u) * upr
    out_row = row * upr
    cols = tl.arange(0, COLS).to(tl.int64)
    for c0 in range(0, upr, COLS):
        cc = c0 + cols
        mask = live[:, None] & (cc[None, :] < upr)
        x = tl.load(packed_ptr + src_row[:, None] + cc[None, :], mask=mask, other=0)
        tl.store(out_ptr + out_row[:, None] + cc[None, :], x, mask=mask)


@triton.jit
def _positions_kernel(off_ptr, out_ptr, m, steps, cp, rank, total, BLOCK: tl.constexpr):
    i0 = tl.program_id(0).to(tl.int64) * BLOCK
    i = i0 + tl.arange(0, BLOCK)
    mask = i < total
    j = _block_segments(off_ptr, m, steps, i0, i, total, BLOCK)
    o0 = tl.load(off_ptr + j)
    o1 = tl.load(off_ptr + j + 1)
    tl.store(out_ptr + i, _zigzag_position(i - o0, o1 - o0, cp, rank), mask=mask)


def _unit(w: int, *tensors: torch.Tensor) -> tuple[int, torch.dtype]:
    bits = w
    for t in tensors:
        bits |= t.data_ptr()
    for size, dtype, _ in _UNITS:
        if bits % size == 0:
            return size, dtype
    return 1, torch.uint8


def _fill_unit(byte: int, size: int) -> int:
    v = int.from_bytes(bytes([byte]) * size, "little", signed=True)
    return v if size > 1 else byte


def _tile(upr: int) -> tuple[int, int]:
    """(rows, units per row) of a program's tile: BLOCK units, a row's units
    contiguous (wide rows: one row per program, BLOCK units a step)."""
    cols = min(triton.next_power_of_2(upr), BLOCK)
    return BLOCK // cols, cols


def _steps(m: int) -> int:
    return max(1, int(m).bit_length())


def _check(rows: torch.Tensor, name: str) -> None:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"{name}: expected contiguous uint8 [T, W] rows, got {rows.dtype}")


def thd_pack_triton(
    *, src, seq_start, seqlens, out_offsets, cp_size, cp_rank, fill, total, out, tile=None
):
    """THD pack (spec: reference.py, thd_pack_torch): ``out`` [total, W] written in place.
    ``tile``: (rows, units) per program instead of the default (tests)."""
    _check(src, "src")
    _check(out, "out")
    w, m = src.shape[1], seqlens.numel()
    if total == 0 or w == 0:
        return
    size, dtype = _unit(w, src, out)
    upr = w // size
    rows, cols = tile or _tile(upr)
    _pack_kernel[(triton.cdiv(total, rows),)](
        src.view(dtype),
        seq_start,
        seqlens,
        out_offsets,
        out.view(dtype),
        m,
        _steps(m),
        upr,
        cp_size,
        cp_rank,
        _fill_unit(fill, size),
        total,
        ROWS=rows,
        COLS=cols,
        **LAUNCH,
    )


def thd_unpack_triton(*, packed, seqlens, cu_seqlens, out_offsets, cp_size, total, out, tile=None):
    """THD unpack: ``out`` [total, W], the sequences unpadded in micro-batch order."""
    _check(packed, "packed")
    _check(out, "out")
    w, m = packed.shape[1], seqlens.numel()
    if total == 0 or w == 0:
        return
    size, dtype = _unit(w, packed, out)
    upr = w // size
    rows, cols = tile or _tile(upr)
    _unpack_kernel[(triton.cdiv(total, rows),)](
        packed.view(dtype),
        cu_seqlens,
        out_offsets,
        out.view(dtype),
        m,
        _steps(m),
        upr,
        cp_size,
        packed.shape[0] // cp_size,
        total,
        ROWS=rows,
        COLS=cols,
        **LAUNCH,
    )


def thd_positions_triton(*, out_offsets, cp_size, cp_rank, total, out, block=BLOCK):
    """Position of each packed token in its padded sequence: ``out`` [total] int64."""
    m = out_offsets.numel() - 1
    if total == 0:
        return
    grid = (triton.cdiv(total, block),)
    _positions_kernel[grid](
        out_offsets, out, m, _steps(m), cp_size, cp_rank, total, BLOCK=block, **LAUNCH
    )


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of each variant the wrappers
    launch, for ahead-of-time compilation (tests/test_aot.py)."""
    out = []
    # (unit, rows, cols): hidden states (8 KiB rows: one row, 128-bit accesses),
    # ids / advantages (8 B), log-probs (4 B), routing rows (6 B), masks (1 B).
    for ty, rows, cols in (
        ("i64", 1, BLOCK),
        ("i64", BLOCK, 1),
        ("i32", BLOCK, 1),
        ("i16", BLOCK // 4, 4),
        ("u8", BLOCK, 1),
    ):
        pack = {
            "src_ptr": f"*{ty}",
            "start_ptr": "*i64",
            "len_ptr": "*i64",
            "off_ptr": "*i64",
            "out_ptr": f"*{ty}",
            "m": "i64",
            "steps": "i32",
            "upr": "i64",
            "cp": "i64",
            "rank": "i64",
            "fill": "i64",
            "total": "i64",
            "ROWS": "constexpr",
            "COLS": "constexpr",
        }
        unpack = {
            "packed_ptr": f"*{ty}",
            "cu_ptr": "*i64",
            "off_ptr": "*i64",
            "out_ptr": f"*{ty}",
            "m": "i64",
            "steps": "i32",
            "upr": "i64",
            "cp": "i64",
            "rows_per_rank": "i64",
            "total": "i64",
            "ROWS": "constexpr",
            "COLS": "constexpr",
        }
        const = {"ROWS": rows, "COLS": cols}
        # a real launch specializes 16-byte aligned pointers and a units-per-row % 16 == 0
        opts = LAUNCH | {"divisible_by_16": ("src_ptr", "out_ptr", "upr")} if cols > 1 else LAUNCH
        out.append((_pack_kernel, pack, const, opts))
        opts = opts if cols == 1 else LAUNCH | {"divisible_by_16": ("packed_ptr", "out_ptr", "upr")}
        out.append((_unpack_kernel, unpack, const, opts))
    pos = {
        "off_ptr": "*i64",
        "out_ptr": "*i64",
        "m": "i64",
        "steps": "i32",
        "cp": "i64",
        "rank": "i64",
        "total": "i64",
        "BLOCK": "constexpr",
    }
    out.append((_positions_kernel, pos, {"BLOCK": BLOCK}, LAUNCH))
    return out
