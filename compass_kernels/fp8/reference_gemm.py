"""Plain-torch reference of ``ck.fp8.grouped_gemm``: the oracle every backend is tested against.

Written for clarity (one float64 matmul per expert); the op's CPU backend
(``grouped_gemm_torch``, float32) is at the end.

Math (docs/design.md, "FP8 grouped GEMM"): rows ``[offsets[e], offsets[e+1])`` of the token-packed
activations belong to expert ``e`` (no padding between experts); with the
dequantized operands (``compass_kernels.fp8.reference.dequantize_reference``:
``q * scale`` per 1x128 activation group and per 128x128 weight block, ragged
edges as partial blocks)

    out[m, n] = sum_k A[m, k] * B[e, n, k]      for m in expert e's rows.

The sum is taken in float64 here (stricter than the float32 the kernels
accumulate in, so a kernel's error is measured against the exact value of the
quantized problem), then cast to ``out_dtype``.
"""

from __future__ import annotations

import torch

from compass_kernels.fp8.reference import dequantize_reference

__all__ = ["grouped_gemm_reference", "grouped_gemm_abs_reference", "grouped_gemm_torch"]


def _check_offsets(expert_offsets: torch.Tensor, num_experts: int, rows: int) -> list[int]:
    off = [int(v) for v in expert_offsets.cpu()]
    if len(off) != num_experts + 1:
        raise ValueError(f"expert_offsets: expected {num_experts + 1} elements, got {len(off)}")
    if off[0] != 0 or off[-1] != rows or any(b < a for a, b in zip(off, off[1:], strict=False)):
        raise ValueError(f"expert_offsets: expected 0 = o[0] <= ... <= o[E] = {rows}, got {off}")
    return off


def grouped_gemm_reference(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize, then one float64 matmul per expert.

    Parameters
    ----------
    a_q : [M, K] float8_e4m3fn, token-packed rows sorted by expert.
    a_scales : [M, ceil(K/128)] float32, any strides (K-major or MN-major).
    b_q : [E, N, K] float8_e4m3fn.
    b_scales : [E, ceil(N/128), ceil(K/128)] float32.
    expert_offsets : [E+1] int64, 0 = o[0] <= ... <= o[E] = M.
    out_dtype : dtype of the result (float64 keeps the exact sums).

    Returns
    -------
    out : [M, N] ``out_dtype``.
    """
    m, _ = a_q.shape
    e, n, _ = b_q.shape
    off = _check_offsets(expert_offsets, e, m)
    a = dequantize_reference(a_q.cpu(), a_scales.cpu(), 1, 128).to(torch.float64)
    out = torch.zeros(m, n, dtype=torch.float64)
    for i in range(e):
        if off[i + 1] > off[i]:
            w = dequantize_reference(b_q[i].cpu(), b_scales[i].cpu(), 128, 128).to(torch.float64)
            out[off[i] : off[i + 1]] = a[off[i] : off[i + 1]] @ w.T
    return out.to(out_dtype)


def grouped_gemm_abs_reference(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
) -> torch.Tensor:
    """``sum_k |A[m, k]| * |B[e, n, k]|`` in float64: the scale of each output's
    rounding error (a float32 accumulation of K products errs by at most
    ~K * 2^-24 of this), for tolerances that do not depend on cancellation."""
    return grouped_gemm_reference(
        a_q.abs(), a_scales.abs(), b_q.abs(), b_scales.abs(), expert_offsets, torch.float64
    )


def grouped_gemm_torch(
    *,
    a_q,
    a_scales,
    b_q,
    b_scales,
    expert_offsets,
    out_dtype,
    out,
    workspace=None,
    workspace_shapes=None,
    workspace_ptrs=None,
) -> None:
    """``fp8_grouped_gemm`` op on CPU tensors (the ``torch`` backend): dequantise
    in float32 (activations once, each expert's weight when it has rows), one
    float32 matmul per expert, written to ``out`` [M, N] (``out_dtype`` 0
    bfloat16, 1 float32). The workspace arguments are the CUTLASS backend's
    (ignored: this backend's float32 temporaries are torch's, CPU only).
    Offsets are read on the host (checked by the public function unless
    validate=False)."""
    m, k = a_q.shape
    e, n, _ = b_q.shape
    if m == 0 or n == 0:
        return
    off = expert_offsets.tolist()
    a = a_q.to(torch.float32) * a_scales.repeat_interleave(128, dim=1)[:, :k]
    for i in range(e):
        lo, hi = off[i], off[i + 1]
        if hi > lo:
            sb = b_scales[i].repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)
            w = b_q[i].to(torch.float32) * sb[:, :k]
            out[lo:hi] = a[lo:hi] @ w.T  # float32 sums, rounded once to out's dtype
