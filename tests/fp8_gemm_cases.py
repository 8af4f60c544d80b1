"""Problems for the ck.fp8.grouped_gemm tests: quantized with ck.fp8's reference
quantizer (1x128 activation groups, 128x128 weight blocks), token-packed by expert."""

from __future__ import annotations

import torch

from compass_kernels.fp8.reference import quantize_reference
from compass_kernels.fp8.reference_gemm import grouped_gemm_abs_reference, grouped_gemm_reference

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
