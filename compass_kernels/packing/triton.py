"""Triton kernels of ck.packing: THD pack, unpack and position ids.

Same contract as the C++ / CUDA entry points in csrc/packing (layout in
csrc/include/compass/packing.h, spec in ``reference.py``): rows are opaque
bytes (uint8 [T, W]); the wrappers view them as the widest integer unit that
divides the row and both base addresses, so one kernel serves every dtype.
Each program moves BLOCK units; the row's sequence is a binary search over
the m + 1 offsets (``steps`` = bit length of m halvings). No host sync: every
size arrives from the host plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["thd_pack_triton", "thd_unpack_triton", "thd_positions_triton", "BLOCK", "LAUNCH"]

#: Units (8/4/2/1 bytes) per program: 1024 x 8 B = 8 KiB in flight per program.
BLOCK = 1024
LAUNCH = {"num_warps": 4}
_UNITS = ((8, torch.int64, "i64"), (4, torch.int32, "i32"), (2, torch.int16, "i16"))


@triton.jit
def _segment(off_ptr, m, steps, row, mask, BLOCK: tl.constexpr):
    # j with off[j] <= row < off[j + 1]
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.zeros([BLOCK], tl.int64) + m
    for _ in range(steps):
        mid = (lo + hi) // 2
        go = tl.load(off_ptr + mid, mask=mask, other=0) <= row
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _zigzag_position(u, local, cp, rank):
    c = local // 2
    mirrored = tl.where(u < c, rank * c + u, (2 * cp - 1 - rank) * c + (u - c))
    return tl.where(cp == 1, u, mirrored)


@triton.jit
def _pack_kernel(src_ptr, start_ptr, len_ptr, off_ptr, out_ptr, m, steps, upr, cp, rank, fill,
                 units, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < units
    row = i // upr
    e = i - row * upr
    j = _segment(off_ptr, m, steps, row, mask, BLOCK)
    o0 = tl.load(off_ptr + j, mask=mask, other=0)
    o1 = tl.load(off_ptr + j + 1, mask=mask, other=0)
    p = _zigzag_position(row - o0, o1 - o0, cp, rank)
    valid = mask & (p < tl.load(len_ptr + j, mask=mask, other=0))
    s = tl.load(start_ptr + j, mask=mask, other=0)
    x = tl.load(src_ptr + (s + p) * upr + e, mask=valid, other=0)
    tl.store(out_ptr + i, tl.where(valid, x, fill.to(x.dtype)), mask=mask)


@triton.jit
def _unpack_kernel(packed_ptr, cu_ptr, off_ptr, out_ptr, m, steps, upr, cp, rows_per_rank, units,
                   BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < units
    row = i // upr
    e = i - row * upr
    j = _segment(cu_ptr, m, steps, row, mask, BLOCK)
    p = row - tl.load(cu_ptr + j, mask=mask, other=0)
    local = tl.load(off_ptr + j + 1, mask=mask, other=0) - tl.load(off_ptr + j, mask=mask, other=0)
    c = tl.maximum(local // 2, 1)
    q = p // c
    within = p - q * c
    r = tl.where(q < cp, q, 2 * cp - 1 - q)
    u = tl.where(q < cp, within, c + within)
    r = tl.where(cp == 1, 0, r)
    u = tl.where(cp == 1, p, u)
    src = (r * rows_per_rank + tl.load(off_ptr + j, mask=mask, other=0) + u) * upr + e
    tl.store(out_ptr + i, tl.load(packed_ptr + src, mask=mask, other=0), mask=mask)


@triton.jit
def _positions_kernel(off_ptr, out_ptr, m, steps, cp, rank, total, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    j = _segment(off_ptr, m, steps, i, mask, BLOCK)
    o0 = tl.load(off_ptr + j, mask=mask, other=0)
    o1 = tl.load(off_ptr + j + 1, mask=mask, other=0)
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


def _steps(m: int) -> int:
    return max(1, int(m).bit_length())


def _check(rows: torch.Tensor, name: str) -> None:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"{name}: expected contiguous uint8 [T, W] rows, got {rows.dtype}")


def thd_pack_triton(src, seq_start, seqlens, out_offsets, cp_size, cp_rank, fill, total, out):
    """THD pack (see csrc/packing/packing_api.h): ``out`` [total, W] written in place."""
    _check(src, "src")
    _check(out, "out")
    w, m = src.shape[1], seqlens.numel()
    if total == 0 or w == 0:
        return
    size, dtype = _unit(w, src, out)
    upr = w // size
    units = total * upr
    grid = (triton.cdiv(units, BLOCK),)
    _pack_kernel[grid](
        src.view(dtype), seq_start, seqlens, out_offsets, out.view(dtype), m, _steps(m), upr,
        cp_size, cp_rank, _fill_unit(fill, size), units, BLOCK=BLOCK, **LAUNCH,
    )  # fmt: skip


def thd_unpack_triton(packed, seqlens, cu_seqlens, out_offsets, cp_size, total, out):
    """THD unpack: ``out`` [total, W], the sequences unpadded in micro-batch order."""
    _check(packed, "packed")
    _check(out, "out")
    w, m = packed.shape[1], seqlens.numel()
    if total == 0 or w == 0:
        return
    size, dtype = _unit(w, packed, out)
    upr = w // size
    units = total * upr
    grid = (triton.cdiv(units, BLOCK),)
    _unpack_kernel[grid](
        packed.view(dtype), cu_seqlens, out_offsets, out.view(dtype), m, _steps(m), upr, cp_size,
        packed.shape[0] // cp_size, units, BLOCK=BLOCK, **LAUNCH,
    )  # fmt: skip


def thd_positions_triton(out_offsets, cp_size, cp_rank, total, out):
    """Position of each packed token in its padded sequence: ``out`` [total] int64."""
    m = out_offsets.numel() - 1
    if total == 0:
        return
    grid = (triton.cdiv(total, BLOCK),)
    _positions_kernel[grid](out_offsets, out, m, _steps(m), cp_size, cp_rank, total, BLOCK=BLOCK,
                            **LAUNCH)  # fmt: skip


def aot_variants() -> list[tuple[object, dict[str, str], dict[str, object], dict[str, int]]]:
    """(kernel, signature, constexprs, launch options) of each variant the wrappers
    launch, for ahead-of-time compilation (tests/test_aot.py)."""
    out = []
    for _, _, ty in (*_UNITS, (1, torch.uint8, "u8")):
        pack = {"src_ptr": f"*{ty}", "start_ptr": "*i64", "len_ptr": "*i64", "off_ptr": "*i64",
                "out_ptr": f"*{ty}", "m": "i64", "steps": "i32", "upr": "i64", "cp": "i64",
                "rank": "i64", "fill": "i64", "units": "i64", "BLOCK": "constexpr"}  # fmt: skip
        unpack = {"packed_ptr": f"*{ty}", "cu_ptr": "*i64", "off_ptr": "*i64",
                  "out_ptr": f"*{ty}", "m": "i64", "steps": "i32", "upr": "i64", "cp": "i64",
                  "rows_per_rank": "i64", "units": "i64", "BLOCK": "constexpr"}  # fmt: skip
        out.append((_pack_kernel, pack, {"BLOCK": BLOCK}, LAUNCH))
        out.append((_unpack_kernel, unpack, {"BLOCK": BLOCK}, LAUNCH))
    pos = {"off_ptr": "*i64", "out_ptr": "*i64", "m": "i64", "steps": "i32", "cp": "i64",
           "rank": "i64", "total": "i64", "BLOCK": "constexpr"}  # fmt: skip
    out.append((_positions_kernel, pos, {"BLOCK": BLOCK}, LAUNCH))
    return out
