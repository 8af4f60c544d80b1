"""Bench and model: the FP8 grouped expert GEMM (``ck.fp8.grouped_gemm``).

Two parts.

1. A model (no GPU here; every GPU figure below is a roofline model, never a
   measurement): for the expert GEMMs of DeepSeek-V3 (hidden 7168, expert
   FFN 2048, 256 experts, top-8) and Qwen3-MoE (235B-A22B: 4096 / 1536, 128
   experts, top-8; 30B-A3B: 2048 / 768, 128 experts, top-8), at decode and
   prefill token counts, under skewed routing: FLOPs, HBM bytes (fp8
   operands, fp32 scales, bf16 output), the H100-SXM roofline time, and,
   computed exactly from the routed counts, the rows that padding every
   expert to 128 rows adds (DeepGEMM's contiguous layout, vLLM's
   sorted_token_ids with BLOCK_M 128) against the rows our token-packed
   kernel materializes (none) and the rows its tiles compute (the masked
   tail of each expert's last tile, BLOCK_M 64 at decode, 128 at prefill).
   ``python -m bench.bench_fp8_gemm`` prints it.

   Routing: each token picks top-k distinct experts, sampled without
   replacement from expert popularities ``softmax(z)``, ``z ~ N(0, sigma^2)``
   (sigma = 1: the busiest experts get ~5-10x the mean load, as measured
   imbalance in unbalanced MoE layers), fixed seed.

2. Timed cases (``python -m bench``, CPU here): ``ck.fp8.grouped_gemm`` on
   CPU tensors (its ``torch`` backend) against the vectorized torch a user
   would write (dequantize with ``repeat_interleave`` of the scales, one fp32
   matmul per non-empty expert: MKL), at reduced expert-GEMM shapes. The CPU
   backend is that same algorithm, so the ratio measures the public API's
   overhead (checks, dispatch), not a kernel; ``--check`` compares outputs.
"""

from __future__ import annotations

import math

import torch

from bench.harness import Case
from bench.roofline import H100_SXM, Model

OP = "fp8_grouped_gemm"

#: (name, hidden, expert FFN width, experts, top-k)
MODELS = (
    ("deepseek-v3", 7168, 2048, 256, 8),
    ("qwen3-235b-a22b", 4096, 1536, 128, 8),
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
)
#: Tokens per GEMM call (one rank, before top-k): decode batches and prefill chunks.
TOKENS = (16, 128, 512, 4096, 16384)
SIGMA = 1.0
SEED = 0


def route_counts(
    tokens: int, experts: int, top_k: int, *, sigma: float = SIGMA, seed: int = SEED
) -> torch.Tensor:
    """Tokens per expert [E] (int64) after top-k routing with skewed popularity."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=g, dtype=torch.float64) * sigma, 0)
    picks = torch.multinomial(probs.expand(tokens, experts), top_k, replacement=False, generator=g)
    return torch.bincount(picks.reshape(-1), minlength=experts)


def padded_rows(counts: torch.Tensor, block: int) -> int:
    """Rows added by rounding every non-empty expert up to a multiple of ``block``."""
    return int(((counts + block - 1) // block * block - counts).sum())


def gemm_model(rows: int, n: int, k: int, experts_used: int) -> Model:
    """FLOPs and HBM bytes of one grouped GEMM over ``rows`` routed rows: fp8 A
    read once, each used expert's fp8 weights read once (unused experts are not
    read), fp32 scales, bf16 output."""
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    bytes_ = rows * k + rows * kb * 4 + experts_used * (n * k + nb * kb * 4) + rows * n * 2
    return Model(bytes=bytes_, flops=2.0 * rows * n * k, precision="fp8")


def model_rows() -> list[dict]:
    """One row per (model, GEMM, tokens): the quantities the module docstring lists."""
    out = []
    for name, hidden, ffn, experts, top_k in MODELS:
        for tokens in TOKENS:
            counts = route_counts(tokens, experts, top_k)
            rows, used = int(counts.sum()), int((counts > 0).sum())
            block_m = 64 if rows <= 64 * experts else 128  # triton_gemm.choose_block_m
            for gemm, n, k in (("gate_up", 2 * ffn, hidden), ("down", hidden, ffn)):
                m = gemm_model(rows, n, k, used)
                pad128 = padded_rows(counts, 128)
                out.append(
                    {
                        "model": name,
                        "gemm": gemm,
                        "tokens": tokens,
                        "rows": rows,
                        "experts_used": used,
                        "max_rows": int(counts.max()),
                        "gflop": m.flops / 1e9,
                        "mbytes": m.bytes / 1e6,
                        "h100_us": m.seconds(H100_SXM) * 1e6,
                        "bound": m.bound(H100_SXM),
                        "pad128_rows": pad128,
                        "pad128_pct": 100.0 * pad128 / rows,
                        "tile_rows_computed": rows + padded_rows(counts, block_m),
                        "block_m": block_m,
                        # Padding to 128 rows costs its extra MMA work and its extra
                        # activation / output bytes (a model, like the rest).
                        "pad128_h100_us": gemm_model(rows + pad128, n, k, used).seconds(H100_SXM)
                        * 1e6,
                    }
                )
    return out


def model_table() -> str:
    head = (
        f"{'model':<16}{'gemm':<8}{'tokens':>7}{'rows':>8}{'used':>5}{'max':>6}"
        f"{'GFLOP':>9}{'MB':>9}{'H100 us':>9}{'bound':>8}{'pad128':>8}{'pad %':>7}"
        f"{'pad us':>8}{'BM':>4}{'tile rows':>10}"
    )
    lines = [
        "FP8 grouped GEMM: H100-SXM roofline MODEL (not measured); skewed routing "
        f"(sigma={SIGMA}, seed={SEED}); pad128 = rows added by 128-row padding (exact)",
        head,
    ]
    for r in model_rows():
        lines.append(
            f"{r['model']:<16}{r['gemm']:<8}{r['tokens']:>7}{r['rows']:>8}{r['experts_used']:>5}"
            f"{r['max_rows']:>6}{r['gflop']:>9.2f}{r['mbytes']:>9.1f}{r['h100_us']:>9.1f}"
            f"{r['bound']:>8}{r['pad128_rows']:>8}{r['pad128_pct']:>7.1f}"
            f"{r['pad128_h100_us']:>8.1f}{r['block_m']:>4}{r['tile_rows_computed']:>10}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------- timed cases


def torch_grouped_gemm(a_q, a_scales, b_q, b_scales, offsets):
    """The vectorized-torch baseline: dequantize the activations once and each
    used expert's weights (scales broadcast with repeat_interleave), one fp32
    matmul (MKL) per non-empty expert, bf16 out. Unused experts cost nothing."""
    m, k = a_q.shape
    n = b_q.shape[1]
    a = a_q.to(torch.float32) * a_scales.repeat_interleave(128, 1)[:, :k]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    bounds = offsets.tolist()
    for e in range(b_q.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            s = b_scales[e].repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            w = b_q[e].to(torch.float32) * s
            out[lo:hi] = (a[lo:hi] @ w.T).to(torch.bfloat16)
    return out


def _problem(tokens: int, experts: int, top_k: int, n: int, k: int):
    from compass_kernels import fp8

    counts = route_counts(tokens, experts, top_k)
    rows = int(counts.sum())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(experts, n, k, generator=g) * 0.05
    a_q, a_s = fp8.quantize_token_groups(x)
    b_q, b_s = fp8.quantize_blockwise(w)
    off = torch.zeros(experts + 1, dtype=torch.int64)
    off[1:] = counts.cumsum(0)
    return a_q, a_s, b_q, b_s, off


def gemm_case(tokens: int, experts: int, top_k: int, n: int, k: int) -> Case:
    import compass_kernels as ck

    args = _problem(tokens, experts, top_k, n, k)
    rows, used = args[0].shape[0], int((args[4].diff() > 0).sum())
    return Case(
        name=OP,
        shape={"tokens": tokens, "experts": experts, "top_k": top_k, "n": n, "k": k},
        providers={
            "torch": lambda: torch_grouped_gemm(*args),
            "compass": lambda: ck.fp8.grouped_gemm(*args),
        },
        baseline="torch",
        atol=1e-2,
        rtol=2e-2,
        model=gemm_model(rows, n, k, used),
    )


#: Reduced expert GEMMs (CPU-sized): (tokens, experts, top_k, N, K).
SHAPES = ((16, 64, 8, 512, 1024), (128, 64, 8, 512, 1024), (512, 32, 8, 768, 1024))
QUICK_SHAPES = ((8, 16, 4, 160, 384),)


def cases(quick: bool) -> list[Case]:
    return [gemm_case(*s) for s in (QUICK_SHAPES if quick else SHAPES)]


if __name__ == "__main__":
    print(model_table())
