"""Triton kernel of ck.fp8.grouped_gemm: token-packed FP8 grouped GEMM, blockwise scales.

Same contract as the torch backend and CUTLASS (spec: ``reference_gemm.py``);
the output is allocated by the caller and written here. Runs on CUDA tensors,
on CPU tensors under ``TRITON_INTERPRET=1`` (tests), and compiles ahead of
time for sm_90a (tests/test_fp8_gemm_triton.py: FP8 wgmma in the PTX).

Design:

- Token-packed: expert e's rows are ``[offsets[e], offsets[e+1])`` with no
  padding between experts. A tile never crosses an expert; an expert's last
  row tile is masked (loads return 0, stores are skipped), so 128-row padding
  (DeepGEMM's contiguous layout, vLLM's sorted_token_ids) is never materialized
  or computed beyond the one partial tile per expert.
- Persistent schedule computed on the device, no host sync: every program
  loads the E+1 offsets, forms per-expert row-tile counts and their inclusive
  prefix sum, and walks tiles ``pid, pid + P, ...`` below the total; a tile's
  expert is found by a search of the prefix sums (a vectorized count of the
  experts whose tiles all precede it). Zero-token experts own no tiles;
  programs beyond the last tile exit at once. The grid is sized from shapes
  only (SM count, or the tile bound ``(ceil(M/BM) + E) * ceil(N/BN)``), so the
  launch is CUDA-graph safe.
- Numerics: for each 128 of K a fresh ``tl.dot`` (fp8 x fp8, on sm_90 a wgmma
  chain whose accumulator keeps ~14 bits over those 128) is scaled by
  ``a_scale[row] * b_scale[n-block]`` and added to an fp32 accumulator
  (promotion every 128 of K, DeepGEMM's recipe); the result is cast to bf16
  (or kept fp32) once at the end.
- BLOCK_K is 128, the scale block, so each K step has one activation scale per
  row and one weight scale per tile (BLOCK_N divides 128). K and N need not be
  multiples of 128: the tails are masked, and the partial last block uses its
  own scale, as the quantizer's ragged blocks do.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["grouped_gemm_triton", "choose_block_m", "aot_variants", "LAUNCH", "BLOCK_N"]

#: Output columns per tile; divides 128 so a tile reads one weight scale per K block.
#: 64, not 128: with the fresh per-K-block dot and the fp32 accumulator both
#: live, 64x128 and 128x128 tiles reach ptxas' 255-register cap and spill on
#: sm_90 (measured with tests.aot, ptxas 13: 300-700 B of spills).
BLOCK_N = 64
#: Launch options per BLOCK_M (tests/test_fp8_gemm_triton.py compiles exactly
#: these: no spills, 3 pipelined stages of (BM + BN) x 128 fp8 operands, 48 KB
#: (BM 64, one warpgroup) / 72 KB (BM 128, two warpgroups) of shared memory).
LAUNCH = {64: {"num_warps": 4, "num_stages": 3}, 128: {"num_warps": 8, "num_stages": 3}}
#: Programs per launch in the interpreter (odd, so programs own several tiles
#: each and the persistent loop's stride is exercised).
INTERPRETER_PROGRAMS = 3


def choose_block_m(rows: int, num_experts: int) -> int:
    """Rows per tile from the mean tokens per expert (shapes only, no sync).

    Decode-sized groups (<= 64 tokens per expert on average) waste up to half of
    a 128-row tile on the masked tail; 64-row tiles halve that. Larger groups
    take 128-row tiles, which double the reuse of every weight tile loaded."""
    return 64 if rows <= 64 * num_experts else 128


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    off_ptr,
    out_ptr,
    N,
    K,
    E,
    stride_am,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    E_BLOCK: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PROMOTE: tl.constexpr,
    ALIGNED: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 128
    tl.static_assert(128 % BLOCK_N == 0, "a tile must lie in one 128-column weight block")
    if ALIGNED:
        # Row strides (and base pointers, checked by the wrapper) are multiples
        # of 16 bytes: without this hint Triton cannot prove 16-byte vectors,
        # loads the fp8 tiles byte by byte, cannot pipeline them with cp.async,
        # and holds 64x128 pointer tensors in registers (measured: 255
        # registers and 1.1 KB of spills per thread on sm_90 without it).
        stride_am = tl.multiple_of(stride_am, 16)
        stride_be = tl.multiple_of(stride_be, 16)
        stride_bn = tl.multiple_of(stride_bn, 16)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # The schedule: row tiles per expert and their inclusive prefix sum.
    eidx = tl.arange(0, E_BLOCK)
    lo = tl.load(off_ptr + eidx, mask=eidx < E, other=0)
    hi = tl.load(off_ptr + eidx + 1, mask=eidx < E, other=0)
    # int32 tile counts (rows < 2^31): the persistent loop's tile // n_tiles is
    # then a 32-bit divide, not the ~70-instruction div.s64 routine
    m_tiles = ((hi - lo + BLOCK_M - 1) // BLOCK_M).to(tl.int32)
    tile_end = tl.cumsum(m_tiles, 0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    total = tl.sum(m_tiles, 0) * n_tiles
    ks = tl.arange(0, BLOCK_K)
    for tile in range(pid, total, nprog):
        mt = tile // n_tiles
        nt = tile % n_tiles
        # Search: the expert owning row tile mt is the number of experts whose
        # tiles all end at or before it (empty experts end where the previous did).
        e = tl.sum((tile_end <= mt).to(tl.int32), 0)
        sel = eidx == e
        first = tl.sum(tl.where(sel, tile_end - m_tiles, 0), 0)
        row0 = tl.sum(tl.where(sel, lo, 0), 0) + (mt - first) * BLOCK_M
        row_end = tl.sum(tl.where(sel, hi, 0), 0)
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < row_end
        cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        # Loads of the tail tile read clamped (valid) rows and columns instead of
        # masking them: an unmasked load is pipelined with cp.async (a masked fp8
        # load is not, measured on sm_90), and the extra rows' results are
        # never stored.
        rows_in = tl.minimum(rows, row_end - 1)
        cols_in = tl.minimum(cols, N - 1).to(tl.int64)
        e64 = e.to(tl.int64)
        a_rows = a_ptr + rows_in[:, None] * stride_am
        b_cols = b_ptr + e64 * stride_be + cols_in[None, :] * stride_bn
        sa_rows = as_ptr + rows_in * stride_asm
        sb_blk = bs_ptr + e64 * stride_bse + ((nt * BLOCK_N) // 128) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k = kb * BLOCK_K + ks
            if EVEN_K:
                a = tl.load(a_rows + k[None, :])
                b = tl.load(b_cols + k[:, None])
            else:  # the last K block is partial: zeros past K
                a = tl.load(a_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
                b = tl.load(b_cols + k[:, None], mask=(k < K)[:, None], other=0.0)
            if PROMOTE:
                sa = tl.load(sa_rows + kb * stride_ask)
                sb = tl.load(sb_blk + kb * stride_bsk)
                acc += tl.dot(a, b) * (sa[:, None] * sb)
            else:
                # Test-only: no promotion (the dot accumulates in place over all
                # of K); correct only when the scales are constant along K.
                acc = tl.dot(a, b, acc)
        if not PROMOTE:
            sa0 = tl.load(sa_rows)
            acc = acc * (sa0[:, None] * tl.load(sb_blk))
        o = out_ptr + rows[:, None] * stride_om + cols[None, :]
        if OUT_BF16:
            tl.store(o, acc.to(tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])
        else:
            tl.store(o, acc, mask=row_ok[:, None] & col_ok[None, :])


def _aligned(a_q: torch.Tensor, b_q: torch.Tensor) -> bool:
    """Whether every fp8 row starts on a 16-byte boundary (the kernel's vector hint)."""
    return (
        a_q.data_ptr() % 16 == 0
        and b_q.data_ptr() % 16 == 0
        and a_q.stride(0) % 16 == 0
        and b_q.stride(0) % 16 == 0
        and b_q.stride(1) % 16 == 0
    )


def _e_block(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


def grouped_gemm_triton(
    *,
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: int,
    out: torch.Tensor,
    workspace: torch.Tensor | None = None,
    workspace_shapes: torch.Tensor | None = None,
    workspace_ptrs: torch.Tensor | None = None,
    block_m: int | None = None,
    num_programs: int | None = None,
    promote: bool = True,
) -> None:
    """Launch the kernel (``kernel(*args, *outputs)`` convention); writes ``out``.

    ``out_dtype``: 0 bfloat16, 1 float32 (``out``'s dtype). ``block_m``: rows per
    tile (64 | 128; default :func:`choose_block_m`). ``num_programs``: grid size
    (default: SM count on CUDA, :data:`INTERPRETER_PROGRAMS` in the interpreter;
    never more than the tile bound). ``promote=False`` is the test-only variant
    without fp32 promotion (scales must then be constant along K). The
    ``workspace*`` arguments are the CUTLASS backend's: this kernel needs no
    scratch (its schedule is computed per program), so a call allocates nothing.
    """
    m, k = a_q.shape
    e, n, _ = b_q.shape
    bm = choose_block_m(m, e) if block_m is None else block_m
    if bm not in LAUNCH:
        raise ValueError(f"block_m: expected one of {tuple(LAUNCH)}, got {bm}")
    if out.dtype != (torch.bfloat16 if out_dtype == 0 else torch.float32):
        raise ValueError(f"out: dtype {out.dtype} does not match out_dtype code {out_dtype}")
    bound = (triton.cdiv(m, bm) + e) * triton.cdiv(n, BLOCK_N)
    if bound == 0 or m == 0:
        return
    if num_programs is None:
        dev = a_q.device
        num_programs = _sm_count(dev.index or 0) if dev.type == "cuda" else INTERPRETER_PROGRAMS
    grid = (max(1, min(num_programs, bound)),)
    _grouped_gemm_kernel[grid](
        a_q,
        a_scales,
        b_q,
        b_scales,
        expert_offsets,
        out,
        n,
        k,
        e,
        a_q.stride(0),
        a_scales.stride(0),
        a_scales.stride(1),
        b_q.stride(0),
        b_q.stride(1),
        b_scales.stride(0),
        b_scales.stride(1),
        b_scales.stride(2),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=BLOCK_N,
        E_BLOCK=_e_block(e),
        OUT_BF16=out_dtype == 0,
        PROMOTE=promote,
        ALIGNED=_aligned(a_q, b_q),
        EVEN_K=k % 128 == 0,
        **LAUNCH[bm],
    )


def aot_variants(num_experts: int = 256) -> list[tuple[object, dict, dict, dict]]:
    """(kernel, signature, constexprs, launch options) of each variant the wrapper
    launches (both tile heights, bf16 output), for ahead-of-time compilation."""
    sig = {
        "a_ptr": "*fp8e4nv",
        "as_ptr": "*fp32",
        "b_ptr": "*fp8e4nv",
        "bs_ptr": "*fp32",
        "off_ptr": "*i64",
        "out_ptr": "*bf16",
        "N": "i32",
        "K": "i32",
        "E": "i32",
        "stride_am": "i64",
        "stride_asm": "i64",
        "stride_ask": "i64",
        "stride_be": "i64",
        "stride_bn": "i64",
        "stride_bse": "i64",
        "stride_bsn": "i64",
        "stride_bsk": "i64",
        "stride_om": "i64",
        "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr",
        "E_BLOCK": "constexpr",
        "OUT_BF16": "constexpr",
        "PROMOTE": "constexpr",
        "ALIGNED": "constexpr",
        "EVEN_K": "constexpr",
    }
    out = []
    for bm, opts in LAUNCH.items():
        const = {
            "BLOCK_M": bm,
            "BLOCK_N": BLOCK_N,
            "E_BLOCK": _e_block(num_experts),
            "OUT_BF16": True,
            "PROMOTE": True,
            "ALIGNED": True,
            "EVEN_K": True,
        }
        # As a launch with aligned tensors specializes them (the wrapper's ALIGNED).
        aligned = ("a_ptr", "b_ptr", "out_ptr", "stride_am", "stride_be", "stride_bn")
        out.append((_grouped_gemm_kernel, sig, const, {**opts, "divisible_by_16": aligned}))
    return out
