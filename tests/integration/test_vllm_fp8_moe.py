"""ck.fp8.moe_mlp as vLLM modular-kernel experts (compass_kernels/integration/vllm/fp8_moe.py),
run through vLLM's own FusedMoEKernel (no-DP/EP prepare/finalize) on CPU, against
vLLM's own CPU fused-MoE kernel on the dequantized weights in the same
[E, 2I, H] / [E, H, I] layout: the layouts (gate rows then up rows, w2
orientation, scale_inv blocks, top-k weights on the output) agree."""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck

# vLLM is imported by the tests (the `layer` fixture skips without it), not at collection:
# under `-m "not vllm"` (make test-py312, no vLLM for 3.12) the module is deselected.
pytestmark = [pytest.mark.integration, pytest.mark.vllm]

E, H, INTER, TOKENS, TOP_K = 6, 256, 192, 37, 2


def _moe_config():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=E,
        experts_per_token=TOP_K,
        hidden_dim=H,
        intermediate_size=INTER,
        num_local_experts=E,
        num_logical_experts=E,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
    )


@pytest.fixture(scope="module")
def layer():
    pytest.importorskip("vllm")
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(torch.bfloat16)
    w13_q, w13_s = ck.fp8.quantize_blockwise(w13)  # vLLM's w13_weight, w13_weight_scale_inv
    w2_q, w2_s = ck.fp8.quantize_blockwise(w2)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(TOKENS, E, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    return x, ids.to(torch.int32), weights, w13_q, w13_s, w2_q, w2_s


def _vllm_cpu_moe(x, ids, weights, w13, w2):
    """vLLM's own CPU fused MoE (unquantized, bf16 weights in its layout)."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    out = torch.empty_like(x)
    cpu_fused_moe(
        out,
        x,
        cpu_prepack_moe_weight(w13, "vec"),
        cpu_prepack_moe_weight(w2, "vec"),
        None,
        None,
        weights,
        ids,
        "silu",
        "vec",
    )
    return out


def _ours(layer):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from compass_kernels.integration.vllm.fp8_moe import CompassFp8Experts, make_kernel

    x, ids, weights, w13_q, w13_s, w2_q, w2_s = layer
    kernel = make_kernel(CompassFp8Experts.for_layer(_moe_config(), w13_s, w2_s))
    return kernel.apply(
        x,
        w13_q,
        w2_q,
        weights,
        ids,
        MoEActivation.SILU,
        global_num_experts=E,
        expert_map=None,
        apply_router_weight_on_input=False,
    )


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_agrees_with_vllm_cpu_fused_moe(layer):
    x, ids, weights, w13_q, w13_s, w2_q, w2_s = layer
    out = _ours(layer)
    assert out.shape == x.shape and out.dtype == x.dtype
    w13 = ck.fp8.dequantize(w13_q, w13_s, out_dtype=torch.bfloat16)
    w2 = ck.fp8.dequantize(w2_q, w2_s, out_dtype=torch.bfloat16)
    theirs = _vllm_cpu_moe(x, ids, weights, w13, w2)
    # vLLM's bf16 path vs our FP8 activations (1x128 e4m3): a few percent.
    assert _rel(out, theirs) < 0.06
    # The comparison can fail: with gate and up swapped in vLLM's layout it does.
    swapped = torch.cat([w13[:, INTER:], w13[:, :INTER]], 1)
    assert _rel(out, _vllm_cpu_moe(x, ids, weights, swapped, w2)) > 0.3
    # And it is the same function as ck.fp8.moe_mlp called directly (bitwise).
    assert torch.equal(out, ck.fp8.moe_mlp(x, ids, weights, w13_q, w13_s, w2_q, w2_s))


def test_unsupported_configurations_raise(layer):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    from compass_kernels.integration.vllm.fp8_moe import CompassFp8Experts

    x, ids, weights, w13_q, w13_s, w2_q, w2_s = layer
    experts = CompassFp8Experts.for_layer(_moe_config(), w13_s, w2_s)
    out = torch.empty_like(x)
    common = dict(
        output=out,
        hidden_states=x,
        w1=w13_q,
        w2=w2_q,
        topk_weights=weights,
        topk_ids=ids,
        global_num_experts=E,
        a1q_scale=None,
        a2_scale=None,
        workspace13=None,
        workspace2=None,
        expert_tokens_meta=None,
    )
    with pytest.raises(NotImplementedError, match="expert_map"):
        experts.apply(
            **common,
            activation=MoEActivation.SILU,
            expert_map=torch.arange(E),
            apply_router_weight_on_input=False,
        )
    with pytest.raises(NotImplementedError, match="apply_router_weight_on_input"):
        experts.apply(
            **common,
            activation=MoEActivation.SILU,
            expert_map=None,
            apply_router_weight_on_input=True,
        )
    with pytest.raises(NotImplementedError, match="SiLU"):
        experts.apply(
            **common,
            activation=MoEActivation.GELU,
            expert_map=None,
            apply_router_weight_on_input=False,
        )
    with pytest.raises(ValueError, match="block_shape"):
        quant = fp8_w8a8_moe_quant_config(w13_s, w2_s, block_shape=[64, 64])
        CompassFp8Experts(_moe_config(), quant)
    assert experts.workspace_shapes(TOKENS, 2 * INTER, H, TOP_K, E, E, None, MoEActivation.SILU)[
        2
    ] == (TOKENS, H)
