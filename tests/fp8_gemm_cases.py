"""Problems for the ck.fp8.grouped_gemm tests: quantized with ck.fp8's reference
quantizer (1x128 activation groups, 128x128 weight blocks), token-packed by expert."""

from __future__ import annotations

import torch

from compass_kernels.fp8.reference import quantize_reference
from compass_kernels.fp8.reference_gemm import grouped_gemm_abs_reference, grouped_gemm_reference
from tests.triton_interpreter import _imprecise_fp8_dot

# Tokens per expert that break tile logic: empty experts (first, middle, last),
# one token, a tile minus / exactly / plus one (BLOCK_M 64 and 128).
COUNTS = (0, 1, 127, 0, 128, 129, 0)


def offsets_of(counts) -> torch.Tensor:
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(list(counts), dtype=torch.int64).cumsum(0)
    return off


def make_problem(counts, n: int, k: int, seed: int, *, mn_major: bool = False):
    """(a_q, a_scales, b_q, b_scales, expert_offsets) with rows of varied magnitude
    (so scales differ per row and per block)."""
    g = torch.Generator().manual_seed(seed)
    e, m = len(counts), int(sum(counts))
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    w = torch.randn(e, n, k, generator=g) * torch.exp(torch.randn(e, 1, k, generator=g) / 2)
    a_q, a_s = quantize_reference(x, 1, 128, eps=1e-10, use_div=True)
    qs = [quantize_reference(w[i], 128, 128, eps=1e-10) for i in range(e)]
    b_q = torch.stack([q for q, _ in qs])
    b_s = torch.stack([s for _, s in qs])
    if mn_major:  # column-major activation scales (the TMA-friendly layout)
        a_s = a_s.t().contiguous().t()
    return a_q, a_s, b_q, b_s, offsets_of(counts)


def check_close(actual: torch.Tensor, args, *, rel_err: float = 1e-5) -> None:
    """Compare with the float64 reference: an fp32 accumulation errs by at most
    ~rel_err of sum |a||b| (K <= a few thousand), and a bf16 output adds one
    rounding (2^-9 relative, 2^-8 allowed)."""
    ref = grouped_gemm_reference(*args, out_dtype=torch.float64)
    bound = rel_err * grouped_gemm_abs_reference(*args) + 1e-30
    if actual.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    err = (actual.to(torch.float64) - ref).abs()
    bad = ~(err <= bound)  # NaN (an unwritten, poisoned element) is bad
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} outputs off; first at {i}: got "
            f"{actual[tuple(i)].item()}, expected {ref[tuple(i)].item()} (bound "
            f"{bound[tuple(i)].item():.3g})"
        )


#: Relative tolerance (of sum |a||b|) for the GPU kernels: Hopper's FP8 MMA sums
#: each instruction's 32 products into an accumulator of about 14 significant bits
#: and both backends promote to fp32 every 128 of K. Under that model
#: (hopper_accumulation_model, 13 explicit mantissa bits, truncation) the largest
#: error on the GPU test problem is 5.4e-5 of sum |a||b| (2.5e-5 with 14 bits), over
#: the 1e-5 an exact fp32 sum meets; 1e-4 passes it with margin, while a dropped K
#: block or swapped block scales err by 3.6e-3 (median) to 0.18 (max).
GPU_REL_ERR = 1e-4


def hopper_accumulation_model(args, *, mantissa_bits=13, k_per_instruction=32, bug=None):
    """out (float64) of the grouped GEMM as an sm_90 FP8 kernel accumulates it: per MMA
    instruction (32 of K) the exact products are added to a partial accumulator that is
    truncated toward zero to ``mantissa_bits`` explicit bits; every 128 of K the partial
    sum is scaled and added to an fp32 accumulator (promotion). ``bug`` plants a fault:
    "drop_block" (the last K block skipped) or "swap_scales" (activation scales of the
    first two K blocks swapped)."""
    a_q, a_s, b_q, b_s, offsets = args
    m, k = a_q.shape
    e, n, _ = b_q.shape
    kb = -(-k // 128)
    # One K block's partial sum, instruction by instruction: the interpreter's model of
    # wgmma accumulating into its own register (no promotion inside the block).
    cfg = {"mantissa_bits": mantissa_bits, "k_per_instruction": k_per_instruction}
    a = a_q.to(torch.float64)
    b = b_q.to(torch.float64)
    sa = a_s.to(torch.float32).clone()
    if bug == "swap_scales" and kb > 1:
        sa[:, [0, 1]] = sa[:, [1, 0]]
    col_block = torch.arange(n) // 128
    out = torch.zeros(m, n, dtype=torch.float32)
    for g in range(e):
        r0, r1 = int(offsets[g]), int(offsets[g + 1])
        if r0 == r1:
            continue
        acc = torch.zeros(r1 - r0, n, dtype=torch.float32)
        for blk in range(kb):
            if bug == "drop_block" and blk == kb - 1:
                continue
            k0, k1 = blk * 128, min(k, blk * 128 + 128)
            zero = torch.zeros(r1 - r0, n, dtype=torch.float32)
            partial = _imprecise_fp8_dot(a[r0:r1, k0:k1], b[g, :, k0:k1].T, zero, 2**30, cfg)
            scale = sa[r0:r1, blk, None] * b_s[g, col_block, blk].to(torch.float32)[None, :]
            acc = acc + partial * scale
        out[r0:r1] = acc
    return out.to(torch.float64)
