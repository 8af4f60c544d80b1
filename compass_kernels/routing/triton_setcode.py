"""The set-code encoder on the GPU (Triton): ids [rows, K] (uint8 | int16) -> the
payload of codec "set", byte for byte what the CPU encoder writes
(csrc/routing/codec_cpu.cpp; the format: csrc/routing/setcode.h).

Two launches on the current stream, no host sync:

1. ``_table_kernel`` (one program): the binomial table C(a, m), m in [1, K],
   a in [0, E), saturated at 2^64 - 1, into ``table`` (int64 [K * E], the op's
   workspace output) at (m - 1) * E + a: level 1 is C(a, 1) = a, level m the
   exclusive prefix sum of level m - 1 (C(a, m) = sum_{b < a} C(b, m - 1)),
   saturating, in chunks of the E axis with a carry; and status = (0 bad rows,
   first bad row = -1).
2. ``_encode_kernel``: a program owns PACKS = 64 consecutive packs, so its bits
   [q0 B, (q0 + 64) B) are exactly B 64-bit words starting on a word. For each
   of the G rows of its packs it ranks the row (r = sum_i C(a_i, 1 + #{j : a_j <
   a_i}): no sort; the row is valid iff every id is in [0, E) and the below
   counts sum to K (K - 1) / 2) and folds it into the pack value v = r_0 + N (r_1
   + ...). The B words are then the column sums of a [64 packs, 64 words]
   matrix holding each pack's low part (v << o) at its first word and its high
   part (v >> (64 - o)) at the next one (bits never overlap: sum = or), written
   as bytes (the payload's length is any byte count). A bad row counts in
   status[0] and its index goes to status[1] (one atomic add and one unsigned
   atomic min per program that has one: the first bad row); it is coded as rank
   0; missing rows are coded as rank 0 without being read.

The CRC of the trace header is computed on the host over the body once the
payload is there (compass_kernels/routing/codec.py): returning bytes needs the
one device-to-host copy anyway. Runs on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (tests/test_routing_codec.py); compiles ahead of time for
sm_90a (tests/test_routing_codec.py::test_triton_encoder_compiles_for_sm90).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import triton
import triton.language as tl

from compass_kernels._ext import load

__all__ = ["encode_sets_triton", "launch_encode", "aot_variants", "PACKS", "TABLE_BLOCK", "LAUNCH"]

#: Packs per program of the encode kernel: 64, so that a program's bits are whole words.
PACKS = 64
#: Chunk of the E axis the table kernel scans at a time.
TABLE_BLOCK = 1024
#: Launch options of both kernels (the sm_90a compile check uses exactly these).
LAUNCH = {"num_warps": 4}

_SAT = 0xFFFFFFFFFFFFFFFF


@triton.jit
def _sat_add(a, b):
    s = a + b
    return tl.where(s < a, 0xFFFFFFFFFFFFFFFF, s)


@triton.jit
def _table_kernel(table_ptr, status_ptr, E, K, BLOCK: tl.constexpr):
    tab = table_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    tl.store(status_ptr, 0)
    tl.store(status_ptr + 1, -1)  # no bad row
    for c in range(0, tl.cdiv(E, BLOCK)):  # level 1: C(a, 1) = a
        a = c * BLOCK + tl.arange(0, BLOCK)
        tl.store(tab + a, a.to(tl.uint64), mask=a < E)
    for m in range(2, K + 1):
        tl.debug_barrier()  # level m - 1 is in memory before any thread reads it
        prev = tab + (m - 2) * E  # K * E <= 2^22: int32 offsets
        cur = tab + (m - 1) * E
        carry = tl.zeros((), tl.uint64)
        for c in range(0, tl.cdiv(E, BLOCK)):
            a = c * BLOCK + tl.arange(0, BLOCK)
            # exclusive scan of prev = inclusive scan of prev shifted by one
            xs = tl.load(prev + a - 1, mask=(a >= 1) & (a < E), other=0)
            inc = tl.associative_scan(xs, 0, _sat_add)
            run = _sat_add(carry, inc)
            tl.store(cur + a, run, mask=a < E)
            carry = tl.max(run, 0)  # non-decreasing: the last one; lanes past E repeat it


@triton.jit(do_not_specialize=["n"])
def _encode_kernel(
    ids_ptr,
    missing_ptr,
    table_ptr,
    out_ptr,
    status_ptr,
    rows,
    packs,
    nbytes,
    E,
    K,
    n,
    G,
    B,
    HAS_MISSING: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKS: tl.constexpr,
):
    tab = table_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    q0 = tl.program_id(0).to(tl.int64) * PACKS
    p = q0 + tl.arange(0, PACKS).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    kmask = cols < K
    nn = n.to(tl.uint64)
    v = tl.zeros((PACKS,), tl.uint64)
    n_bad = tl.zeros((), tl.int64)
    first_bad = tl.full((), 0x7FFFFFFFFFFFFFFF, tl.int64)
    for gg in range(0, G):  # v = r_0 + N (r_1 + N (...)): the last row of a pack first
        r = p * G + (G - 1 - gg)
        live = (p < packs) & (r < rows)
        if HAS_MISSING:
            live &= tl.load(missing_ptr + r, mask=live, other=1) == 0
        base = ids_ptr + r * K
        x = tl.load(base[:, None] + cols[None, :], mask=live[:, None] & kmask[None, :], other=0)
        x = x.to(tl.int32)
        in_range = tl.sum(((x < 0) | (x >= E)) & kmask[None, :], 1) == 0
        below = tl.zeros((PACKS, BLOCK_K), tl.int32)
        for j in range(0, K):  # re-read column j (cached) rather than a [P, K, K] tile
            xj = tl.load(base + j, mask=live, other=0).to(tl.int32)
            below += (xj[:, None] < x).to(tl.int32)
        below_sum = tl.sum(tl.where(kmask[None, :], below, 0), 1)
        ok = in_range & (below_sum == K * (K - 1) // 2)
        use = live & ok
        idx = below.to(tl.int64) * E + x
        c = tl.load(tab + idx, mask=use[:, None] & kmask[None, :], other=0)
        rank = tl.sum(c, 1)
        v = v * nn + tl.where(use, rank, 0)
        bad = live & ~ok
        n_bad += tl.sum(bad.to(tl.int64), 0)
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad, r, 0x7FFFFFFFFFFFFFFF), 0))
    tl.atomic_add(status_ptr, n_bad, mask=n_bad > 0)
    st = status_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    tl.atomic_min(st + 1, first_bad.to(tl.uint64), mask=n_bad > 0)
    if B > 0:  # K == E: only the checks
        # pack j of the program starts at bit j B: word w0 = j B / 64, offset o
        bit = tl.arange(0, PACKS).to(tl.int64) * B
        w0 = bit // 64
        o = (bit % 64).to(tl.uint64)
        w = tl.arange(0, 64).to(tl.int64)
        low = tl.where(w[None, :] == w0[:, None], (v << o)[:, None], 0)
        spill = (o.to(tl.int64) + B) > 64
        high = (v >> ((64 - o) & 63))[:, None]
        high = tl.where((w[None, :] == w0[:, None] + 1) & spill[:, None], high, 0)
        words = tl.sum(low + high, 0)  # [64]; the first B are this program's
        sh = (tl.arange(0, 8) * 8).to(tl.uint64)
        byte = ((words[:, None] >> sh[None, :]) & 0xFF).to(tl.uint8)
        at = (q0 * B) // 8 + w[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(out_ptr + at, byte, mask=(w[:, None] < B) & (at < nbytes))


def launch_args(ids, num_experts, missing, payload, status, table, layout):
    """(table grid, table args, encode grid, encode args, encode constexprs)."""
    group, bits, n = layout
    rows, k = ids.shape
    packs = -(-rows // group)
    enc = (
        ids,
        missing if missing is not None else ids,  # never read without HAS_MISSING
        table,
        payload,
        status,
        rows,
        packs,
        payload.numel(),
        num_experts,
        k,
        n if group > 1 else 0,  # G = 1: v = 0 * n + r_0 (N may pass 2^63)
        group,
        bits,
    )
    meta = {
        "HAS_MISSING": missing is not None,
        "BLOCK_K": triton.next_power_of_2(max(k, 2)),
        "PACKS": PACKS,
    }
    return (1,), (table, status, num_experts, k), (triton.cdiv(packs, PACKS),), enc, meta


def launch_encode(ids, num_experts, missing, payload, status, table, layout) -> None:
    """The two launches alone (arguments already checked; ``layout`` = (rows per
    pack, bits per pack, C(E, K))), on the current device and stream."""
    tgrid, targs, egrid, eargs, meta = launch_args(
        ids, num_experts, missing, payload, status, table, layout
    )
    block = min(TABLE_BLOCK, triton.next_power_of_2(max(num_experts, 16)))
    _table_kernel[tgrid](*targs, BLOCK=block, **LAUNCH)
    if egrid[0] > 0:
        _encode_kernel[egrid](*eargs, **meta, **LAUNCH)


def encode_sets_triton(*, ids, num_experts, missing, payload, status, table) -> None:
    """The encode op's ``triton`` backend (compass_kernels/routing/_setcode.py:
    encode_sets_op; arguments and outputs by name): the C++ argument checks (the
    CPU backend's, naming the argument), then the two launches. Bad rows are
    counted in ``status`` on the device (read it, e.g. ``_setcode.check_status``,
    before trusting the payload)."""
    layout = load().routing.check_encode_sets(ids, num_experts, missing, payload, status, table)
    launch_encode(ids, num_experts, missing, payload, status, table, layout)


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of the variants the wrapper
    launches for DeepSeek-V3 (E=256, K=8, uint8 ids, missing rows), Qwen3-MoE
    (E=128, K=8) and int16 ids with G > 1 (E=300, K=3): the table kernel, then
    the encode kernel per shape (tests/test_routing_aot.py compiles exactly these)."""
    table_sig = {
        "table_ptr": "*i64",
        "status_ptr": "*i64",
        "E": "i32",
        "K": "i32",
        "BLOCK": "constexpr",
    }
    out = [(_table_kernel, table_sig, {"BLOCK": 256}, LAUNCH)]
    for k, ids, missing in ((8, "*u8", True), (8, "*u8", False), (3, "*i16", False)):
        sig = {
            "ids_ptr": ids,
            "missing_ptr": "*i1",
            "table_ptr": "*i64",
            "out_ptr": "*u8",
            "status_ptr": "*i64",
            "rows": "i64",
            "packs": "i64",
            "nbytes": "i64",
            "E": "i32",
            "K": "i32",
            "n": "i64",
            "G": "i32",
            "B": "i32",
            "HAS_MISSING": "constexpr",
            "BLOCK_K": "constexpr",
            "PACKS": "constexpr",
        }
        const = {"HAS_MISSING": missing, "BLOCK_K": triton.next_power_of_2(k), "PACKS": PACKS}
        out.append((_encode_kernel, sig, const, LAUNCH))
    return out
