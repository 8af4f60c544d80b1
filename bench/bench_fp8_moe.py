"""Bench and model: the FP8 MoE expert layer (``ck.fp8.moe_mlp``).

Two parts.

1. A model (no GPU here; every GPU figure is a roofline model, never a
   measurement) of the whole routed-expert layer of DeepSeek-V3 (hidden 7168,
   expert FFN 2048, 256 experts, top-8) and Qwen3-MoE (235B-A22B: 4096 / 1536,
   128 experts, top-8; 30B-A3B: 2048 / 768, 128 experts, top-8) at decode and
   prefill token counts, under the skewed routing of ``bench_fp8_gemm``
   (softmax(N(0, 1)) expert popularity, fixed seed): FLOPs of both grouped
   GEMMs, HBM bytes of the five stages (permute + quantize, gate/up GEMM,
   SiLU-mul + requantize, down GEMM, weighted unpermute), the H100-SXM roofline
   time, and, computed exactly from the routed counts, the rows that padding
   every expert to 128 rows adds and the modelled time that costs.
   ``python -m bench.bench_fp8_moe`` prints it.

2. Timed cases (``python -m bench``, CPU here): ``ck.fp8.moe_mlp`` (cpp
   backend) against **vectorized torch** doing the same FP8 math (1x128
   activation quantization in torch, used experts' weights dequantized per
   call, one fp32 matmul per used expert, SiLU-mul, requantize, down matmul,
   the weighted rows summed over top-k), at reduced layer shapes. ``--check``
   compares their outputs.
"""

from __future__ import annotations

import math

import torch

from bench.bench_fp8_gemm import MODELS, SEED, SIGMA, TOKENS, gemm_model, padded_rows, route_counts
from bench.harness import Case
from bench.roofline import H100_SXM, Model

OP = "fp8_moe_mlp"


def layer_model(
    tokens: int, hidden: int, ffn: int, counts: torch.Tensor, *, extra_rows: int = 0
) -> Model:
    """Bytes and FLOPs of the layer for routed ``counts`` (+ ``extra_rows`` of
    padding computed and moved as if real): the two GEMMs (``gemm_model``),
    plus the activation stages: permute + quantize reads bf16 x and writes fp8
    rows + fp32 scales; SiLU-mul reads the bf16 [P, 2I] and writes fp32 [P, I]
    that the requantizer reads and writes as fp8 + scales; unpermute reads the
    bf16 [P, H] and writes bf16 [T, H]."""
    rows = int(counts.sum()) + extra_rows
    used = int((counts > 0).sum())
    up = gemm_model(rows, 2 * ffn, hidden, used)
    down = gemm_model(rows, hidden, ffn, used)
    hb, ib = math.ceil(hidden / 128), math.ceil(ffn / 128)
    permute = tokens * hidden * 2 + rows * (hidden + hb * 4)
    silu = rows * 2 * ffn * 2 + rows * ffn * 4 * 2 + rows * (ffn + ib * 4)
    unpermute = rows * hidden * 2 + tokens * hidden * 2
    return Model(
        bytes=up.bytes + down.bytes + permute + silu + unpermute,
        flops=up.flops + down.flops,
        precision="fp8",
        kernels=6,
    )


def model_rows() -> list[dict]:
    out = []
    for name, hidden, ffn, experts, top_k in MODELS:
        for tokens in TOKENS:
            counts = route_counts(tokens, experts, top_k)
            rows = int(counts.sum())
            pad = padded_rows(counts, 128)
            m = layer_model(tokens, hidden, ffn, counts)
            mp = layer_model(tokens, hidden, ffn, counts, extra_rows=pad)
            out.append(
                {
                    "model": name,
                    "tokens": tokens,
                    "rows": rows,
                    "experts_used": int((counts > 0).sum()),
                    "max_rows": int(counts.max()),
                    "gflop": m.flops / 1e9,
                    "mbytes": m.bytes / 1e6,
                    "weight_mb": int((counts > 0).sum()) * 3 * hidden * ffn / 1e6,
                    "h100_us": m.seconds(H100_SXM) * 1e6,
                    "bound": m.bound(H100_SXM),
                    "pad128_rows": pad,
                    "pad128_pct": 100.0 * pad / rows,
                    "pad128_gflop": 2.0 * pad * 3 * hidden * ffn / 1e9,
                    "pad128_h100_us": mp.seconds(H100_SXM) * 1e6,
                }
            )
    return out


def model_table() -> str:
    head = (
        f"{'model':<16}{'tokens':>7}{'rows':>8}{'used':>5}{'max':>6}{'GFLOP':>9}"
        f"{'MB':>9}{'wt MB':>8}{'H100 us':>9}{'bound':>8}{'pad128':>8}{'pad %':>7}"
        f"{'pad GF':>8}{'pad us':>8}"
    )
    lines = [
        "FP8 MoE layer (moe_mlp: permute+quant, gate/up, SiLU-mul+quant, down, unpermute): "
        f"H100-SXM roofline MODEL (not measured); skewed routing (sigma={SIGMA}, seed={SEED}); "
        "pad128 = rows 128-row padding adds (exact), pad us = modelled time with them",
        head,
    ]
    for r in model_rows():
        lines.append(
            f"{r['model']:<16}{r['tokens']:>7}{r['rows']:>8}{r['experts_used']:>5}"
            f"{r['max_rows']:>6}{r['gflop']:>9.2f}{r['mbytes']:>9.1f}{r['weight_mb']:>8.1f}"
            f"{r['h100_us']:>9.1f}{r['bound']:>8}{r['pad128_rows']:>8}{r['pad128_pct']:>7.1f}"
            f"{r['pad128_gflop']:>8.2f}{r['pad128_h100_us']:>8.1f}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------- timed cases


def _quant_dequant_rows(x: torch.Tensor) -> torch.Tensor:
    """1x128 e4m3 quantize + dequantize in vectorized torch (K % 128 == 0), the
    activation convention (amax floor 1e-10, ``x / s``)."""
    t, k = x.shape
    g = x.float().view(t, k // 128, 128)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * s).view(t, k)


def _dequant_weight(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """128x128 blocks times their scales by broadcasting (N, K % 128 == 0)."""
    n, k = q.shape
    blocks = q.float().view(n // 128, 128, k // 128, 128) * s[:, None, :, None]
    return blocks.view(n, k)


def torch_moe_mlp(x, ids, weights, w13, s13, w2, s2):
    """The vectorized-torch baseline (same FP8 math as ck.fp8.moe_mlp): one
    argsort of the slots, per used expert a dequantize and two fp32 matmuls,
    bf16 intermediates, the weighted rows written back in slot order and
    summed over top-k."""
    t, k = ids.shape
    inter = w13.shape[1] // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    a = _quant_dequant_rows(x)
    ys = torch.empty(t * k, x.shape[1], dtype=torch.float32)
    lo = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        slots = order[lo : lo + c]
        lo += c
        tok = slots // k
        gu = (a[tok] @ _dequant_weight(w13[e], s13[e]).T).to(torch.bfloat16).float()
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = (_quant_dequant_rows(act) @ _dequant_weight(w2[e], s2[e]).T).to(torch.bfloat16)
        ys[slots] = y.float() * weights.reshape(-1)[slots, None]
    return ys.view(t, k, -1).sum(1).to(x.dtype)


def _layer(tokens: int, hidden: int, ffn: int, experts: int, top_k: int):
    from compass_kernels import fp8

    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(experts, generator=g, dtype=torch.float64) * SIGMA, 0)
    ids = torch.multinomial(probs.expand(tokens, experts), top_k, replacement=False, generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), 1)
    w13_q, w13_s = fp8.quantize_blockwise(torch.randn(experts, 2 * ffn, hidden, generator=g) * 0.03)
    w2_q, w2_s = fp8.quantize_blockwise(torch.randn(experts, hidden, ffn, generator=g) * 0.05)
    return x, ids, w, w13_q, w13_s, w2_q, w2_s


def moe_case(tokens: int, hidden: int, ffn: int, experts: int, top_k: int) -> Case:
    import compass_kernels as ck

    args = _layer(tokens, hidden, ffn, experts, top_k)
    counts = torch.bincount(args[1].reshape(-1), minlength=experts)
    return Case(
        name=OP,
        shape={"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k},
        providers={
            "torch": lambda: torch_moe_mlp(*args),
            "compass": lambda: ck.fp8.moe_mlp(*args),
        },
        baseline="torch",
        atol=3e-2,
        rtol=5e-2,
        model=layer_model(tokens, hidden, ffn, counts),
    )


#: Reduced layers (CPU-sized): (tokens, hidden, expert FFN, experts, top_k).
SHAPES = ((16, 1024, 512, 64, 8), (128, 1024, 512, 64, 8), (512, 1024, 384, 32, 8))
QUICK_SHAPES = ((8, 256, 128, 16, 4),)


def cases(quick: bool) -> list[Case]:
    return [moe_case(*s) for s in (QUICK_SHAPES if quick else SHAPES)]


if __name__ == "__main__":
    print(model_table())
