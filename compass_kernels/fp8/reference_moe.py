"""Plain-torch reference of ``ck.fp8.moe_mlp``: the oracle every backend is tested against.

Written for clarity (a loop over tokens and their experts), never imported by a
fast path. Weights are dequantized (``q * scale`` per 128x128 block, ragged
edges as partial blocks); the arithmetic is float32.

For token t and its j-th expert e = topk_ids[t, j] (vLLM's layout: w13 rows
[0, I) are the gate W1, rows [I, 2I) the up projection W3; w2 is [H, I]):

    a      = Qa(x[t])                       1x128 activation quantization
    g, u   = R(a @ W1[e].T), R(a @ W3[e].T) R: rounding to bfloat16
    y      = R(Qa(silu(g) * u) @ W2[e].T)
    out[t] = sum_j w[t, j] * y_j            float32, in j order

``Qa`` quantizes and dequantizes 1x128 groups with ck.fp8's activation
convention (``reference.quantize_reference``, ``x / s``, eps 1e-10) and ``R``
is the bf16 rounding of the grouped GEMM's output: the quantization points of
the kernels, so a backend differs from this only by float32 summation order
(and the rare bf16 / e4m3 rounding flips that order causes). With
``quantize_activations=False`` both ``Qa`` and ``R`` are the identity: the
float32 MoE with the FP8 weights dequantized, against which the activation
quantization error itself is measured.
"""

from __future__ import annotations

import torch

from compass_kernels.fp8.reference import dequantize_reference, quantize_reference

__all__ = ["moe_mlp_reference"]


def _qa(x: torch.Tensor) -> torch.Tensor:
    """1x128 quantize + dequantize of one row (float32)."""
    q, s = quantize_reference(x.reshape(1, -1), 1, 128, eps=1e-10, use_div=True)
    return dequantize_reference(q, s, 1, 128).reshape(-1)


def moe_mlp_reference(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """The module docstring's math; returns [T, H] float32 (CPU).

    Parameters: as ``ck.fp8.moe_mlp`` (hidden [T, H], topk_ids / topk_weights
    [T, k], w13_weight [E, 2I, H] e4m3fn, w13_scale [E, ceil(2I/128),
    ceil(H/128)], w2_weight [E, H, I] e4m3fn, w2_scale [E, ceil(H/128),
    ceil(I/128)]).
    """
    e, two_i, h = w13_weight.shape
    inter = two_i // 2
    ids = topk_ids.cpu().to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise ValueError(f"topk_ids: expected expert ids in [0, {e})")
    x = hidden.cpu().to(torch.float32)
    wts = topk_weights.cpu().to(torch.float32)
    w13 = [
        dequantize_reference(w13_weight[i].cpu(), w13_scale[i].cpu(), 128, 128) for i in range(e)
    ]
    w2 = [dequantize_reference(w2_weight[i].cpu(), w2_scale[i].cpu(), 128, 128) for i in range(e)]

    def qa(v):
        return _qa(v) if quantize_activations else v

    def r(v):
        return v.to(torch.bfloat16).to(torch.float32) if quantize_activations else v

    out = torch.zeros(x.shape[0], h, dtype=torch.float32)
    for t in range(x.shape[0]):
        a = qa(x[t])
        for j in range(ids.shape[1]):
            ex = int(ids[t, j])
            gu = r(w13[ex] @ a)
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            y = r(w2[ex] @ qa(act))
            out[t] = out[t] + wts[t, j] * y
    return out
