"""Bench: FP8 blockwise quantization (weights 128x128, activations 1x128), the
fused MoE permutation + quantization, and the unpermute combine.

Baselines (the ``speedup`` column) are the vectorized torch a user writes
today, from the engines' own formulas:
- weights: DeepGEMM's / vLLM's ``per_block_cast_to_fp8`` in eager torch
  (zero-pad to a multiple of 128, view as blocks, amax, clamp 1e-4, / 448,
  ``x * (1 / s)``, cast). Full runs add ``vllm`` (vLLM's function itself,
  torch.compile'd as vLLM ships it) when vLLM imports.
- activations: vLLM's ``per_token_group_quant_fp8`` math in eager torch
  (view [M, K/128, 128], amax, clamp 1e-10, / 448, ``x / s``, clamp, cast).
- permutation: ``torch.sort(stable=True)`` of the flat ids, ``index_select``
  of the token rows, the activation quantization above, offsets from
  ``bincount`` + ``cumsum`` (what MoE layers without a fused kernel do).
- unpermute: gather ``y[dst]``, view [M, k, N], multiply by the weights and
  ``sum(1)`` in float32.
Every provider's output is checked bit for bit against the baseline's
(``--check``; the unpermute sums in another order: float tolerance).

Shapes: Qwen3-30B-A3B (hidden 2048, expert FFN 768, 128 experts, top-8) and
DeepSeek-V3 (hidden 7168, expert FFN 2048, 256 experts, top-8). The GPU
column is a bandwidth *model* (bytes over 3.35 TB/s, bench/roofline.py),
not a measurement.
"""

from __future__ import annotations

import torch

import compass_kernels as ck
from bench.harness import Case
from bench.roofline import Model

OP = "fp8"

# (name, N, K): expert weights (w13 = gate+up stacked, w2) and a dense projection.
WEIGHT_SHAPES = [("qwen3_w13", 1536, 2048), ("qwen3_w2", 2048, 768), ("dsv3_w13", 4096, 7168)]
QUICK_WEIGHT_SHAPES = [("qwen3_w2", 2048, 768)]
# (tokens, hidden)
ACT_SHAPES = [(256, 2048), (4096, 2048), (4096, 7168)]
QUICK_ACT_SHAPES = [(256, 2048)]
# (tokens, hidden, experts, top_k)
PERMUTE_SHAPES = [(1024, 2048, 128, 8), (4096, 2048, 128, 8), (2048, 7168, 256, 8)]
QUICK_PERMUTE_SHAPES = [(256, 2048, 128, 8)]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------- baselines


def weight_quant_torch(w: torch.Tensor):
    """per_block_cast_to_fp8's math, eager torch."""
    n, k = w.shape
    pn, pk = -(-n // 128) * 128, -(-k // 128) * 128
    padded = torch.zeros(pn, pk, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    view = padded.view(pn // 128, 128, pk // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    q = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return q.view(pn, pk)[:n, :k].contiguous().view(torch.uint8), sf.view(pn // 128, pk // 128)


def act_quant_torch(x: torch.Tensor):
    """per_token_group_quant_fp8's math (vLLM's CUDA kernel), eager torch."""
    m, k = x.shape
    g = x.view(m, k // 128, 128).float()
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    s = amax / 448.0
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(m, k).view(torch.uint8), s.view(m, k // 128)


def permute_torch(x: torch.Tensor, ids: torch.Tensor, experts: int):
    k = ids.shape[1]
    flat = ids.reshape(-1)
    src = torch.sort(flat, stable=True).indices
    rows = x.index_select(0, src // k)
    q, s = act_quant_torch(rows)
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=x.device)
    offsets[1:] = torch.bincount(flat, minlength=experts).cumsum(0)
    return q, s, offsets, src


def unpermute_torch(y: torch.Tensor, dst: torch.Tensor, w: torch.Tensor):
    m, k = w.shape
    return (y[dst].view(m, k, -1).float() * w[..., None]).sum(1).to(y.dtype)


# --------------------------------------------------------------------- cases


def weight_case(name: str, n: int, k: int, device: str, with_vllm: bool) -> Case:
    w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)

    def ours():
        q, s = ck.fp8.quantize_blockwise(w)
        return q.view(torch.uint8), s

    providers = {"torch": lambda: weight_quant_torch(w), "compass": ours}
    if with_vllm:
        fn = _vllm_block_cast()
        if fn is not None:
            providers["vllm"] = lambda: _as_bytes(fn(w, [128, 128], use_ue8m0=False))
    scales = -(-n // 128) * -(-k // 128)
    return Case(
        name=f"quantize_blockwise_{name}",
        shape={"N": n, "K": k},
        providers=providers,
        baseline="torch",
        device=device,
        atol=0.0,
        rtol=0.0,
        model=Model(bytes=n * k * (2 + 1) + 4 * scales),
    )


def act_case(m: int, k: int, device: str) -> Case:
    x = torch.randn(m, k, device=device).to(torch.bfloat16)

    def ours():
        q, s = ck.fp8.quantize_token_groups(x)
        return q.view(torch.uint8), s

    return Case(
        name="quantize_token_groups",
        shape={"M": m, "K": k},
        providers={"torch": lambda: act_quant_torch(x), "compass": ours},
        baseline="torch",
        device=device,
        atol=0.0,
        rtol=0.0,
        model=Model(bytes=m * k * (2 + 1) + 4 * m * (k // 128)),
    )


def permute_case(m: int, hidden: int, experts: int, top_k: int, device: str) -> Case:
    g = torch.Generator().manual_seed(m + experts)
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16).to(device)
    ids = torch.rand(m, experts, generator=g).topk(top_k, dim=1).indices.to(device)

    def ours():
        p = ck.fp8.permute_quantize(x, ids, experts)
        return p.q.view(torch.uint8), p.scales, p.expert_offsets, p.src_index

    slots = m * top_k
    # read x once (k rows per token come from cache), ids; write rows, scales, indices.
    model = Model(
        bytes=m * hidden * 2
        + slots * 8
        + slots * hidden
        + slots * (hidden // 128) * 4
        + slots * 16
        + (experts + 1) * 8,
        kernels=3,
    )
    return Case(
        name="permute_quantize",
        shape={"M": m, "K": hidden, "E": experts, "k": top_k},
        providers={"torch": lambda: permute_torch(x, ids, experts), "compass": ours},
        baseline="torch",
        device=device,
        atol=0.0,
        rtol=0.0,
        model=model,
    )


def unpermute_case(m: int, hidden: int, experts: int, top_k: int, device: str) -> Case:
    g = torch.Generator().manual_seed(m)
    ids = torch.rand(m, experts, generator=g).topk(top_k, dim=1).indices
    dst = ck.fp8.permute_quantize(torch.zeros(m, 128), ids, experts).dst_index.to(device)
    y = torch.randn(m * top_k, hidden, generator=g).to(torch.bfloat16).to(device)
    w = torch.rand(m, top_k, generator=g).to(device)
    return Case(
        name="unpermute",
        shape={"M": m, "N": hidden, "k": top_k},
        providers={
            "torch": lambda: unpermute_torch(y, dst, w),
            "compass": lambda: ck.fp8.unpermute(y, dst, w),
        },
        baseline="torch",
        device=device,
        model=Model(bytes=m * top_k * (hidden * 2 + 12) + m * hidden * 2),
    )


def _as_bytes(out):
    q, s = out
    return q.view(torch.uint8), s


def _vllm_block_cast():
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except Exception:  # noqa: BLE001 - an optional provider; any import failure means absent
        return None
    return per_block_cast_to_fp8


def cases(quick: bool) -> list[Case]:
    """All cases of this bench; `quick` keeps one small shape per op (CI, ``--check``)."""
    device = _device()
    out = [
        weight_case(n, a, b, device, not quick)
        for n, a, b in (QUICK_WEIGHT_SHAPES if quick else WEIGHT_SHAPES)
    ]
    out += [act_case(m, k, device) for m, k in (QUICK_ACT_SHAPES if quick else ACT_SHAPES)]
    perm = QUICK_PERMUTE_SHAPES if quick else PERMUTE_SHAPES
    out += [permute_case(*s, device) for s in perm]
    out += [unpermute_case(*s, device) for s in perm]
    return out
