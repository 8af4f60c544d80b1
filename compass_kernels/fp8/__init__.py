"""FP8 (e4m3fn) blockwise quantization and the fused MoE token permutation (ck.fp8).

- :func:`quantize_blockwise`: weights [N, K] (or [E, N, K]) in 128x128 blocks,
  the convention of vLLM's ``per_block_cast_to_fp8`` / DeepGEMM (floor 1e-4,
  ``x * (1 / s)``): what vLLM's block-FP8 models load as ``weight`` +
  ``weight_scale_inv``.
- :func:`quantize_token_groups`: activations [M, K] in 1x128 groups, the
  convention of vLLM's CUDA ``per_token_group_fp8_quant`` (floor 1e-10,
  ``x / s``), scales K-major, MN-major or TMA-aligned MN-major (DeepGEMM).
- :func:`permute_quantize` / :func:`unpermute`: a stable sort of the top-k
  slots by expert (no per-expert padding, int64 offsets) with the 1x128
  quantization of the permuted rows in the same pass, and the inverse with the
  top-k weighted combine. No host sync on the GPU path.
- :func:`dequantize`.

Every backend (torch on CPU, Triton on GPU) gives the bits of ``reference.py``.
Conventions and layouts: docs/design.md, section "FP8".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from compass_kernels._op import op
from compass_kernels._validate import (
    as_float,
    as_int,
    check_finite,
    check_tensor,
    describe,
    should_check,
)
from compass_kernels.fp8.grouped_gemm import (  # noqa: F401  (ck.fp8.grouped_gemm)
    GroupedGemmWorkspace,
    grouped_gemm,
    grouped_gemm_workspace,
)

__all__ = [
    "quantize_blockwise",
    "quantize_token_groups",
    "dequantize",
    "grouped_gemm",
    "grouped_gemm_workspace",
    "GroupedGemmWorkspace",
    "moe_mlp",
    "grouped_mlp",
    "permute_quantize",
    "unpermute",
    "PermutedTokens",
    "SCALE_LAYOUTS",
    "WEIGHT_EPS",
    "ACTIVATION_EPS",
]

#: Scale tensor layouts (all are logical [rows/br, cols/bc] float32 tensors):
#: "k_major" row-major (vLLM ``weight_scale_inv``, its default activation
#: scales); "mn_major" column-major (vLLM ``column_major_scales``);
#: "mn_major_tma" column-major with the column stride rounded up to 4 floats
#: (DeepGEMM's TMA-aligned activation scales, vLLM ``tma_aligned_scales``).
SCALE_LAYOUTS = {"k_major": 0, "mn_major": 1, "mn_major_tma": 2}
#: Scale floors: vLLM's per_block_cast_to_fp8 (DeepGEMM) clamps block amax at
#: 1e-4; vLLM's per_token_group_fp8_quant starts its amax at eps = 1e-10.
WEIGHT_EPS = 1e-4
ACTIVATION_EPS = 1e-10
TILE = 128
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _alloc_scales(rows: int, cols: int, layout: int, device) -> torch.Tensor:
    if layout == 1:
        return torch.empty(cols, rows, dtype=torch.float32, device=device).t()
    if layout == 2:
        aligned = -(-rows // 4) * 4
        return torch.empty_strided((rows, cols), (1, aligned), dtype=torch.float32, device=device)
    return torch.empty(rows, cols, dtype=torch.float32, device=device)


class Quantized(NamedTuple):
    """Outputs of :data:`quantize_op` (unpacks as ``q, scales``)."""

    q: torch.Tensor  # x's shape, float8_e4m3fn
    scales: torch.Tensor  # [ceil(R / br), ceil(C / bc)] float32, scale_layout's strides


@op(
    kernels={
        "torch": "compass_kernels.fp8.reference:quantize_torch",
        "triton": "compass_kernels.fp8.triton:quantize_triton",
    },
    name="fp8_quantize",
)
def quantize_op(
    x: torch.Tensor,
    block_rows: int,
    block_cols: int,
    eps: float,
    ue8m0: bool,
    use_div: bool,
    scale_layout: int,
) -> Quantized:
    """Blockwise FP8 quantization of x [R, C] float32 | bfloat16 | float16."""
    rows, cols = x.shape
    nb, kb = -(-rows // block_rows), -(-cols // block_cols)
    return Quantized(
        q=torch.empty_like(x, dtype=torch.float8_e4m3fn, memory_format=torch.contiguous_format),
        scales=_alloc_scales(nb, kb, scale_layout, x.device),
    )


def workspace_size(slots: int, num_experts: int) -> int:
    """int32 elements of the permutation's workspace (reference.py: permute_quantize_torch)."""
    chunks = -(-slots // 256)
    return slots + 2 * chunks * num_experts


class Permuted(NamedTuple):
    """Outputs of :data:`permute_op`."""

    q: torch.Tensor  # [M*k, C] float8_e4m3fn, rows in expert order
    scales: torch.Tensor  # [M*k, ceil(C / 128)] float32
    expert_offsets: torch.Tensor  # [E+1] int64
    src_index: torch.Tensor  # [M*k] int64
    dst_index: torch.Tensor  # [M*k] int64
    workspace: torch.Tensor  # int32 [workspace_size(M*k, E)]


@op(
    kernels={
        "torch": "compass_kernels.fp8.reference:permute_quantize_torch",
        "triton": "compass_kernels.fp8.triton:permute_quantize_triton",
    },
    name="fp8_permute_quantize",
)
def permute_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    eps: float,
    ue8m0: bool,
    scale_layout: int,
) -> Permuted:
    """The top-k slots of x [M, C] sorted by expert (stably), quantized 1x128."""
    slots = topk_ids.shape[0] * topk_ids.shape[1]
    cols, dev = x.shape[1], x.device
    i64 = torch.int64
    return Permuted(
        q=torch.empty(slots, cols, dtype=torch.float8_e4m3fn, device=dev),
        scales=_alloc_scales(slots, -(-cols // TILE), scale_layout, dev),
        expert_offsets=torch.empty(num_experts + 1, dtype=i64, device=dev),
        src_index=torch.empty(slots, dtype=i64, device=dev),
        dst_index=torch.empty(slots, dtype=i64, device=dev),
        workspace=torch.empty(workspace_size(slots, num_experts), dtype=torch.int32, device=dev),
    )


@op(
    kernels={
        "torch": "compass_kernels.fp8.reference:unpermute_torch",
        "triton": "compass_kernels.fp8.triton:unpermute_triton",
    },
    name="fp8_unpermute",
)
def unpermute_op(
    y: torch.Tensor, dst_index: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """out [M, C] (y's dtype) = sum_j w[t, j] * y[dst_index[t*k + j]]."""
    return torch.empty(topk_weights.shape[0], y.shape[1], dtype=y.dtype, device=y.device)


# ------------------------------------------------------------- public API


def _layout(scale_layout: str) -> int:
    code = SCALE_LAYOUTS.get(scale_layout)
    if code is None:
        raise ValueError(
            f"scale_layout: expected one of {tuple(SCALE_LAYOUTS)}, got {scale_layout!r}"
        )
    return code


def _check_eps(eps: float) -> float:
    eps = as_float("eps", eps)
    if not 1e-30 <= eps <= 1.0:
        raise ValueError(
            "eps: expected a float in [1e-30, 1] (the scale floor of an all-zero block), "
            f"got {eps!r}"
        )
    return float(eps)


def _input(
    name: str, x: torch.Tensor, ndim: tuple[int, ...], *, empty_cols: bool = False
) -> torch.Tensor:
    check_tensor(name, x, dtypes=_INPUT_DTYPES)
    if x.dim() not in ndim:
        dims = " or ".join(map(str, ndim))
        raise ValueError(f"{name}: expected a {dims}-d tensor, got {describe(x)}")
    if x.requires_grad:
        x = x.detach()
    if x.dim() >= 2 and x.shape[-1] == 0 and not empty_cols:  # no column to scale
        raise ValueError(f"{name}: expected at least one column, got {describe(x)}")
    if x.dim() >= 2 and x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x


def quantize_blockwise(
    w: torch.Tensor,
    *,
    block: tuple[int, int] = (TILE, TILE),
    eps: float = WEIGHT_EPS,
    ue8m0: bool = False,
    scale_layout: str = "k_major",
    validate: bool | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blockwise FP8 quantization of a weight (vLLM block-FP8 layout).

    Parameters
    ----------
    w : [N, K] or [E, N, K] float32 | bfloat16 | float16 (experts stacked);
        quantize the bf16 values the trainer holds, never an fp32 master.
        N, K need not be multiples of 128: edge blocks are partial (as zero
        padding would give, and as vLLM's per_block_cast_to_fp8 does).
    block : (128, 128) (the Triton kernels' block; the torch backend (CPU) and
        the reference take any).
    eps : floor of a block's amax (1e-4: per_block_cast_to_fp8 / DeepGEMM).
    ue8m0 : round each scale up to a power of two (DeepGEMM's UE8M0 scales).
    scale_layout : "k_major" (vLLM's weight_scale_inv), "mn_major", "mn_major_tma".
    validate : check that w is finite (an error names the first inf/NaN), as
        ``_validate.should_check`` says: None (default) on CPU tensors, not on
        CUDA (a host sync); True everywhere; False never; never on fake / meta
        tensors or while tracing. Unchecked inf/NaN give an unspecified block.
        NaN / Inf policy: w must be finite (ValueError naming w and the
        element where checked); unchecked, only the blocks holding a
        non-finite value are unspecified, every other block is exact.

    Returns
    -------
    q : w's shape, float8_e4m3fn, ``q = e4m3(w * (1 / s))`` (RNE, saturating).
    scales : [ceil(N/128), ceil(K/128)] (or [E, ...]) float32, ``w ~ q * s``
        (the engines' ``weight_scale_inv``).
    """
    w = _input("w", w, (2, 3), empty_cols=True)
    br, bc = _block(block)
    layout = _layout(scale_layout)
    eps = _check_eps(eps)
    if w.numel() == 0:  # no experts, rows or columns: empty q and scales, no launch
        if w.dim() == 2:
            return tuple(
                quantize_op.outputs(
                    x=w,
                    block_rows=br,
                    block_cols=bc,
                    eps=eps,
                    ue8m0=ue8m0,
                    use_div=False,
                    scale_layout=layout,
                )
            )
        nb, kb = -(-w.shape[1] // br), -(-w.shape[2] // bc)
        q = torch.empty_like(w, dtype=torch.float8_e4m3fn, memory_format=torch.contiguous_format)
        return q, torch.empty((w.shape[0], nb, kb), dtype=torch.float32, device=w.device)
    if should_check(validate, w):
        check_finite("w", w)
    try:
        opts = dict(
            block_rows=br,
            block_cols=bc,
            eps=eps,
            ue8m0=bool(ue8m0),
            use_div=False,
            scale_layout=layout,
            backend=backend,
        )
        if w.dim() == 3:
            outs = [quantize_op(x=e, **opts) for e in w]
            return torch.stack([o.q for o in outs]), torch.stack([o.scales for o in outs])
        return tuple(quantize_op(x=w, **opts))
    except ValueError as err:  # the kernel names its argument x; this function's is w
        msg = str(err)
        if msg.startswith("x: "):
            raise ValueError("w: " + msg[3:]) from None
        raise


def _block(block) -> tuple[int, int]:
    if isinstance(block, torch.Tensor) or type(block).__module__ == "numpy":
        block = block.tolist() if getattr(block, "ndim", 0) == 1 else block
    if not (isinstance(block, tuple | list) and len(block) == 2):
        raise ValueError(f"block: expected a pair of positive ints, got {block!r}")
    br, bc = as_int("block[0]", block[0]), as_int("block[1]", block[1])
    if br < 1 or bc < 1:
        raise ValueError(f"block: expected a pair of positive ints, got {block!r}")
    return br, bc


def quantize_token_groups(
    x: torch.Tensor,
    *,
    group_size: int = TILE,
    eps: float = ACTIVATION_EPS,
    ue8m0: bool = False,
    scale_layout: str = "k_major",
    validate: bool | None = None,
    backend: str | None = None,
    **renamed,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 FP8 quantization of activations (vLLM / DeepGEMM layout).

    Parameters
    ----------
    x : [M, K] float32 | bfloat16 | float16. K need not be a multiple of 128
        (the last group is partial); the engines' GEMMs require it.
    group_size : columns per scale group, 128 (the CUDA / Triton kernels' group).
        (Named ``group_size`` as everywhere else; ``group=`` is a TypeError.)
    eps : amax floor (1e-10: vLLM's per_token_group_fp8_quant).
    ue8m0 : power-of-two scales.
    scale_layout : "k_major" [M, K/128] row-major; "mn_major" column-major;
        "mn_major_tma" column-major with column stride ceil(M / 4) * 4 (DeepGEMM).
    validate : as in :func:`quantize_blockwise` (NaN / Inf policy too: x must
        be finite; unchecked, only the 1x128 groups holding one are unspecified).

    Returns
    -------
    q : [M, K] float8_e4m3fn, ``q = e4m3(x / s)`` (RNE, saturating).
    scales : [M, ceil(K/128)] float32 in ``scale_layout``.
    """
    if renamed:
        name = next(iter(renamed))
        hint = " (renamed group_size)" if name == "group" else ""
        raise TypeError(f"quantize_token_groups(): unexpected keyword argument {name!r}{hint}")
    x = _input("x", x, (2,), empty_cols=True)
    group_size = as_int("group_size", group_size, lo=1)
    layout = _layout(scale_layout)
    eps = _check_eps(eps)
    if x.numel() == 0:  # no tokens or no columns: empty q and scales, no launch
        return tuple(
            quantize_op.outputs(
                x=x,
                block_rows=1,
                block_cols=group_size,
                eps=eps,
                ue8m0=ue8m0,
                use_div=True,
                scale_layout=layout,
            )
        )
    if should_check(validate, x):
        check_finite("x", x)
    res = quantize_op(
        x=x,
        block_rows=1,
        block_cols=group_size,
        eps=eps,
        ue8m0=bool(ue8m0),
        use_div=True,
        scale_layout=layout,
        backend=backend,
    )
    return tuple(res)


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    block: tuple[int, int] = (TILE, TILE),
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q * s`` per block in float32, then cast to ``out_dtype``.

    q : [R, C] or [E, R, C] float8_e4m3fn; scales : [ceil(R/br), ceil(C/bc)]
    (or [E, ...]) float32, any layout; block : (br, bc), (1, 128) for token groups.
    One fused elementwise expression in torch (an off-hot-path helper: quality
    checks, weight round trips), exact in float32. NaN / Inf policy: nothing is
    checked; a NaN / Inf scale or a NaN encoding in q gives NaN / Inf in the
    elements of its block only.
    """
    check_tensor("q", q, dtypes=(torch.float8_e4m3fn,))
    check_tensor("scales", scales, dtypes=(torch.float32,), device=q.device)
    br, bc = _block(block)
    rows, cols = q.shape[-2:]
    want = (*q.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"scales: expected shape {list(want)} for q {describe(q)} and block "
            f"({br}, {bc}), got {describe(scales)}"
        )
    s = scales.repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]
    return (q.to(torch.float32) * s).to(out_dtype)


@dataclass(slots=True)
class PermutedTokens:
    """Output of :func:`permute_quantize` (all on the input's device).

    q : [M*k, K] float8_e4m3fn, rows in expert order (no padding).
    scales : [M*k, ceil(K/128)] float32 in the requested layout.
    expert_offsets : [E+1] int64; expert e owns rows [offsets[e], offsets[e+1]).
    src_index : [M*k] int64, row p holds slot src_index[p] = t*k + j (token t = src // k).
    dst_index : [M*k] int64, slot t*k + j is row dst_index[t*k + j].
    """

    q: torch.Tensor
    scales: torch.Tensor
    expert_offsets: torch.Tensor
    src_index: torch.Tensor
    dst_index: torch.Tensor


def permute_quantize(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    eps: float = ACTIVATION_EPS,
    ue8m0: bool = False,
    scale_layout: str = "k_major",
    validate: bool | None = None,
    backend: str | None = None,
) -> PermutedTokens:
    """Sort the top-k slots by expert (stable) and quantize the permuted rows (1x128).

    Parameters
    ----------
    x : [M, K] float32 | bfloat16 | float16 hidden states.
    topk_ids : [M, k] int32 | int64 expert ids in [0, num_experts).
    num_experts : E (the CUDA path takes up to 1024).
    eps, ue8m0, scale_layout : as in :func:`quantize_token_groups` (same bits).
    validate : check ids in range and x finite (``should_check``: CPU by
        default, CUDA with validate=True, a host sync): unchecked out-of-range ids
        are dropped (dst_index -1, no row; offsets[E] counts the rest, rows
        past it are unwritten). NaN / Inf policy: x must be finite (ValueError
        naming x where checked); unchecked, the rows of a token holding one
        get unspecified values in its 1x128 groups, no other row changes.

    Returns
    -------
    :class:`PermutedTokens`. Three launches on the GPU, no host sync: the
    output size M*k is known in advance.
    """
    x = _input("x", x, (2,))
    check_tensor(
        "topk_ids",
        topk_ids,
        ndim=2,
        dtypes=(torch.int32, torch.int64),
        size=x.shape[0],
        size_what="one row per token of x",
        device=x.device,
    )
    if not (isinstance(num_experts, int) and num_experts >= 1):
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    layout = _layout(scale_layout)
    eps = _check_eps(eps)
    ids = topk_ids.contiguous()
    if should_check(validate, x, ids):
        check_finite("x", x)
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= num_experts:
                raise ValueError(
                    f"topk_ids: expected expert ids in [0, {num_experts}), got values in "
                    f"[{int(lo)}, {int(hi)}]"
                )
    p = permute_op(
        x=x,
        topk_ids=ids,
        num_experts=num_experts,
        eps=eps,
        ue8m0=bool(ue8m0),
        scale_layout=layout,
        backend=backend,
    )
    return PermutedTokens(p.q, p.scales, p.expert_offsets, p.src_index, p.dst_index)


def unpermute(
    y: torch.Tensor,
    dst_index: torch.Tensor | PermutedTokens,
    topk_weights: torch.Tensor,
    *,
    validate: bool | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Combine expert outputs back per token: ``out[t] = sum_j w[t,j] * y[dst[t*k+j]]``.

    y : [P, N] float32 | bfloat16 expert outputs in permuted order (P >= max dst + 1).
    dst_index : [M*k] int64 (or the :class:`PermutedTokens` it comes from); -1 = dropped.
    topk_weights : [M, k] float (computed in float32).
    Returns [M, N] in y's dtype (float32 accumulation in j order, unfused
    multiply-add: the same bits on every backend). Deterministic: a gather per
    token, no atomics. validate: check dst_index in [-1, P)
    (``should_check``: CPU by default; CUDA with validate=True, a host sync;
    unchecked out-of-range indices there are undefined).
    NaN / Inf policy: y and topk_weights are not checked (a weighted gather,
    like torch's): a non-finite value reaches exactly the tokens that gather it.
    """
    check_tensor("y", y, ndim=2, dtypes=(torch.float32, torch.bfloat16))
    if isinstance(dst_index, PermutedTokens):
        dst_index = dst_index.dst_index
    check_tensor(
        "topk_weights",
        topk_weights,
        ndim=2,
        dtypes=_INPUT_DTYPES + (torch.float64,),
        device=y.device,
    )
    m, k = topk_weights.shape
    check_tensor(
        "dst_index",
        dst_index,
        ndim=1,
        dtypes=(torch.int64,),
        size=m * k,
        size_what="tokens * top_k = topk_weights.numel()",
        device=y.device,
    )
    if y.requires_grad:
        y = y.detach()
    if y.shape[1] > 1 and y.stride(1) != 1:
        y = y.contiguous()
    w = topk_weights.detach().to(torch.float32).contiguous()
    dst = dst_index.contiguous()
    if should_check(validate, y, dst) and dst.numel():
        lo, hi = torch.aminmax(dst)
        if int(lo) < -1 or int(hi) >= y.shape[0]:
            raise ValueError(
                f"dst_index: expected values in [-1, {y.shape[0]}) (rows of y), "
                f"got values in [{int(lo)}, {int(hi)}]"
            )
    return unpermute_op(y=y, dst_index=dst, topk_weights=w, backend=backend)


# The MoE layer composes the ops above (imported last: it uses this module).
from compass_kernels.fp8.moe import grouped_mlp, moe_mlp  # noqa: E402, F401


def __dir__() -> list[str]:
    """dir(): the public names only (imports and helpers stay attributes, unlisted)."""
    return sorted(__all__)
