"""The FP8 MoE expert layer around the grouped GEMM (``ck.fp8.moe_mlp``).

One function for the routed-expert MLP of a block-FP8 MoE model (DeepSeek-V3,
Qwen3-MoE) in vLLM's weight layout:

    permute + 1x128 quantize (ck.fp8.permute_quantize)
    -> gate/up grouped GEMM   [P, 2I] bf16   (ck.fp8.grouped_gemm, w13)
    -> SiLU(gate) * up in fp32, requantized 1x128 (ck.fp8.quantize_token_groups)
    -> down grouped GEMM      [P, H] bf16    (ck.fp8.grouped_gemm, w2)
    -> unpermute with the top-k weights, fp32 accumulation (ck.fp8.unpermute)

P = tokens * top_k rows, token-packed by expert (no padding). Forward only
(FP8 inference: rollouts). Every stage is one registered op: torch on CPU,
Triton on CUDA, the GEMMs also CUTLASS ("cuda"); ``backend=`` selects the
chain ("cuda" picks CUTLASS for the GEMMs, Triton for the other stages,
their one GPU backend); on CUDA no stage syncs the host (output sizes follow
from shapes).

Intermediate roundings are fixed, as the engines fix them (vLLM's fused_moe
writes bf16 intermediate caches): the gate/up and down GEMMs write bf16 on
every backend (the CUTLASS kernel writes only bf16), so backends differ only in
float32 summation order. Spec: ``reference_moe.py``.

SiLU-and-mul is a torch expression between two ops (one read of the bf16
gate/up rows, one fp32 write the quantizer reads): on a GPU it moves
``P * I * 10`` bytes, 0.1-1% of the expert weights a decode step streams
(DeepSeek-V3: P = 1024, I = 2048 -> 21 MB vs ~4 GB of fp8 weights read by
the layer's used experts); a fused SiLU-mul-quantize kernel would remove it.
"""

from __future__ import annotations

import torch

from compass_kernels import fp8 as _fp8
from compass_kernels._validate import (
    check_finite,
    check_offsets,
    check_tensor,
    describe,
    should_check,
)

__all__ = ["moe_mlp", "grouped_mlp", "check_moe_weights"]

_HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8 = (torch.float8_e4m3fn,)
_F32 = (torch.float32,)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_moe_weights(
    w13_weight: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    hidden_size: int | None = None,
    hidden_name: str = "hidden",
) -> tuple[int, int, int]:
    """Check vLLM's block-FP8 expert layout; returns (E, H, I).

    w13_weight [E, 2I, H] e4m3fn (rows [0, I) gate = w1, [I, 2I) up = w3),
    w13_scale [E, ceil(2I/128), ceil(H/128)] float32 (vLLM's
    ``w13_weight_scale_inv``), w2_weight [E, H, I] e4m3fn, w2_scale
    [E, ceil(H/128), ceil(I/128)] float32.
    """
    check_tensor("w13_weight", w13_weight, ndim=3, dtypes=_FP8)
    dev = w13_weight.device
    e, two_i, h = w13_weight.shape
    if e < 1 or two_i < 2 or two_i % 2 or h < 1:
        raise ValueError(
            "w13_weight: expected [E, 2I, H] with E >= 1, an even 2I >= 2 and H >= 1 "
            f"(gate rows then up rows), got {describe(w13_weight)}"
        )
    if hidden_size is not None and h != hidden_size:
        raise ValueError(
            f"w13_weight: expected H = {hidden_size} ({hidden_name}.shape[1]) in dim 2, got "
            f"{describe(w13_weight)}"
        )
    inter = two_i // 2
    check_tensor("w2_weight", w2_weight, ndim=3, dtypes=_FP8, device=dev)
    if tuple(w2_weight.shape) != (e, h, inter):
        raise ValueError(
            f"w2_weight: expected shape [{e}, {h}, {inter}] = [E, H, I] (from "
            f"w13_weight [E, 2I, H]), got {describe(w2_weight)}"
        )
    for name, s, rows, cols in (
        ("w13_scale", w13_scale, two_i, h),
        ("w2_scale", w2_scale, h, inter),
    ):
        check_tensor(name, s, ndim=3, dtypes=_F32, device=dev)
        want = (e, _cdiv(rows, 128), _cdiv(cols, 128))
        if tuple(s.shape) != want:
            raise ValueError(
                f"{name}: expected shape {list(want)} (128x128 blocks of the "
                f"weight), got {describe(s)}"
            )
    return e, h, inter


def moe_mlp(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    validate: bool | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert SwiGLU MLP with block-FP8 weights: ``sum_j w[t,j] * MLP_{e[t,j]}(x[t])``.

    Parameters
    ----------
    hidden : [T, H] bfloat16 | float16 | float32 tokens.
    topk_ids : [T, k] int32 | int64 expert ids in [0, E) (logical ids).
    topk_weights : [T, k] floating, the combine weights (already normalized
        or scaled as the model's router wants; applied as given).
    w13_weight, w13_scale, w2_weight, w2_scale : vLLM's block-FP8 layout, see
        :func:`check_moe_weights` (``MLP_e(x) = W2_e (silu(W1_e x) * (W3_e x))``).
    validate : check the ids' range and finiteness of ``hidden``, as
        ``_validate.should_check`` says (CPU by default; CUDA with
        validate=True, host syncs; False never; never while tracing).
        NaN / Inf policy: ``hidden``, ``topk_weights`` and the weight scales
        must be finite: checked on CPU tensors unless validate=False (no sync),
        on CUDA with validate=True (host syncs); unchecked, a non-finite value
        gives NaN / Inf in the outputs of the tokens it reaches (a weight scale:
        every token routed to that expert), never an error or a read out of bounds.
    backend : None (torch on CPU, cuda on CUDA: CUTLASS GEMMs), "torch", "cuda"
        or "triton" (CUDA tensors, or CPU tensors in the interpreter); used by
        every stage ("cuda": the GEMMs; the other stages run Triton). The
        CUTLASS GEMM needs H % 16 == 0, I % 16 == 0.
    out : [T, H] in ``hidden``'s dtype to write.

    Returns
    -------
    [T, H] in ``hidden``'s dtype: each token's expert outputs (bf16) combined in
    float32 in top-k order (unfused multiply-add), cast once to hidden's dtype.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=_HIDDEN_DTYPES)
    if hidden.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "hidden: moe_mlp is forward-only (FP8 inference) and gives no gradient; call it "
            "under torch.no_grad() or pass a detached tensor"
        )
    t, h = hidden.shape
    dev = hidden.device
    e, _, inter = check_moe_weights(w13_weight, w13_scale, w2_weight, w2_scale, hidden_size=h)
    if w13_weight.device != dev:
        raise ValueError(
            f"w13_weight: expected a tensor on {dev} (hidden's device), got {describe(w13_weight)}"
        )
    check_tensor(
        "topk_ids",
        topk_ids,
        ndim=2,
        dtypes=(torch.int32, torch.int64),
        size=t,
        size_what="one row per token of hidden",
        device=dev,
    )
    check_tensor(
        "topk_weights", topk_weights, ndim=2, device=dev, dtypes=_HIDDEN_DTYPES + (torch.float64,)
    )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: expected shape {list(topk_ids.shape)} (topk_ids'), got "
            f"{describe(topk_weights)}"
        )
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(hidden.dtype,), device=dev)
        if tuple(out.shape) != (t, h):
            raise ValueError(f"out: expected shape [{t}, {h}], got {describe(out)}")
    if should_check(validate, hidden, topk_weights, w13_scale, w2_scale):
        for name, x in (
            ("topk_weights", topk_weights),
            ("w13_scale", w13_scale),
            ("w2_scale", w2_scale),
        ):
            check_finite(name, x.detach().reshape(-1))
    try:
        p = _fp8.permute_quantize(hidden, topk_ids, e, validate=validate, backend=_stage(backend))
    except ValueError as err:  # permute_quantize names its argument x; this function's is hidden
        if str(err).startswith("x: "):
            raise ValueError(f"hidden: {str(err)[3:]}") from None
        raise
    y = _experts(
        p.q, p.scales, p.expert_offsets, w13_weight, w13_scale, w2_weight, w2_scale, inter, backend
    )
    # bf16 tokens: combine straight from the bf16 expert outputs into a bf16
    # result; other dtypes combine the widened outputs into float32, cast once.
    y = y if hidden.dtype == torch.bfloat16 else y.float()
    w = topk_weights.detach().to(torch.float32).contiguous()
    direct = out is not None and out.dtype == y.dtype
    res = _fp8.unpermute_op(
        y=y,
        dst_index=p.dst_index,
        topk_weights=w,
        backend=_stage(backend),
        out=out if direct else None,
    )
    if direct:
        assert out is not None  # direct: out was given
        return out
    if out is not None:
        return out.copy_(res)
    return res.to(hidden.dtype)


def _stage(backend: str | None) -> str | None:
    """The backend of a stage with one GPU backend (Triton): ``"cuda"`` names
    the GEMMs' CUTLASS kernel; those stages then take their default."""
    return None if backend == "cuda" else backend


def _experts(a_q, a_scales, offsets, w13, s13, w2, s2, inter, backend):
    """The stages between the permutation and the combine: [P, H] fp8 rows in
    expert order -> [P, H] bf16 expert outputs. The caller checked the inputs
    (or opted out): the stages check nothing again."""
    gate_up = _fp8.grouped_gemm(a_q, a_scales, w13, s13, offsets, validate=False, backend=backend)
    act = torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
    h_q, h_s = _fp8.quantize_token_groups(act, validate=False, backend=_stage(backend))
    return _fp8.grouped_gemm(h_q, h_s, w2, s2, offsets, validate=False, backend=backend)


def grouped_mlp(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    validate: bool | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The expert MLPs on rows already grouped by expert (Megatron's experts
    interface: its token dispatcher permutes and combines).

    Parameters
    ----------
    x : [P, H] bfloat16 | float16 | float32, expert e's rows are
        ``[expert_offsets[e], expert_offsets[e+1])`` (no padding).
    expert_offsets : [E+1] int64, 0 = o[0] <= ... <= o[E] = P.
    w13_weight, w13_scale, w2_weight, w2_scale : as :func:`moe_mlp`.
    validate, backend : as :func:`moe_mlp` (validate also checks the offsets).
        NaN / Inf policy: x and the weight scales must be finite, checked as in
        :func:`moe_mlp`; unchecked, a non-finite value spoils the rows it reaches.

    Returns
    -------
    [P, H] bfloat16: ``MLP_e(x[p])`` for each row p of expert e, with the
    quantization points of :func:`moe_mlp` (1x128 x, bf16 gate/up, 1x128
    SiLU-mul, bf16 out), so ``unpermute(grouped_mlp(...))`` is :func:`moe_mlp`
    bit for bit.
    """
    check_tensor("x", x, ndim=2, dtypes=_HIDDEN_DTYPES)
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "x: grouped_mlp is forward-only (FP8 inference) and gives no gradient; call it "
            "under torch.no_grad() or pass a detached tensor"
        )
    e, _, inter = check_moe_weights(
        w13_weight, w13_scale, w2_weight, w2_scale, hidden_size=x.shape[1], hidden_name="x"
    )
    if w13_weight.device != x.device:
        raise ValueError(
            f"w13_weight: expected a tensor on {x.device} (x's device), got {describe(w13_weight)}"
        )
    check_tensor(
        "expert_offsets",
        expert_offsets,
        ndim=1,
        dtypes=(torch.int64,),
        size=e + 1,
        size_what="E + 1",
        device=x.device,
    )
    if should_check(validate, x, expert_offsets, w13_scale, w2_scale):
        check_offsets("expert_offsets", expert_offsets, x.shape[0], exact=True)
        check_finite("w13_scale", w13_scale.reshape(-1))
        check_finite("w2_scale", w2_scale.reshape(-1))
    a_q, a_s = _fp8.quantize_token_groups(x, validate=validate, backend=_stage(backend))
    return _experts(
        a_q, a_s, expert_offsets, w13_weight, w13_scale, w2_weight, w2_scale, inter, backend
    )
