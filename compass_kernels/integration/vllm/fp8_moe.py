"""vLLM FP8 MoE path: ``ck.fp8.moe_mlp`` as vLLM modular-kernel experts.

:class:`CompassFp8Experts` is a ``FusedMoEExpertsModular`` (vLLM >= 0.32,
``vllm/model_executor/layers/fused_moe/modular_kernel.py``) for block-FP8
checkpoints (DeepSeek-V3, Qwen3-MoE-FP8): weights ``w13_weight`` [E, 2I, H]
(gate rows then up rows) and ``w2_weight`` [E, H, I] in float8_e4m3fn with
their 128x128 ``*_weight_scale_inv`` blocks, activations quantized 1x128
dynamically inside the experts (``expects_unquantized_inputs``: the prepare
step hands over bf16 hidden states, as vLLM's CPU FP8 experts take them).
The experts apply the top-k weights and reduce (``TopKWeightAndReduceNoOP``
finalize), like vLLM's CPU and Triton fused experts.

Put together with vLLM's own no-DP/EP prepare/finalize::

    experts = CompassFp8Experts.for_layer(moe_config, w13_scale, w2_scale)
    kernel = make_kernel(experts)
    out = kernel.apply(hidden, w13, w2, topk_weights, topk_ids, MoEActivation.SILU,
                       global_num_experts=E, expert_map=None,
                       apply_router_weight_on_input=False)

On CUDA tensors every stage runs on the GPU (CUTLASS grouped GEMMs, no host
sync); on CPU tensors the torch references run (tests). Supported: SiLU-and-mul,
no expert parallelism (ids are the layer's own experts), router weights
applied on the output. Anything else raises, naming what is unsupported.
All arithmetic lives in ``compass_kernels.fp8``.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    RoutingMethodType,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
    MoEPrepareAndFinalizeNoDPEPModular,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)

import compass_kernels as ck

__all__ = ["CompassFp8Experts", "make_kernel", "BLOCK_SHAPE"]

BLOCK_SHAPE = [128, 128]


class CompassFp8Experts(mk.FusedMoEExpertsModular):
    """Block-FP8 W8A8 (128x128 weights, dynamic 1x128 activations) experts
    running ``ck.fp8.moe_mlp``: token-packed grouped GEMMs, no per-expert padding."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        from compass_kernels.integration.vllm import _pin

        # the modular-kernel interface implemented here, as reviewed (vllm/_pin.py)
        _pin.check("fp8_moe", RuntimeError, who="CompassFp8Experts")
        super().__init__(moe_config, quant_config)
        if list(quant_config.block_shape or []) != BLOCK_SHAPE:
            raise ValueError(
                f"quant_config: expected block_shape {BLOCK_SHAPE} (128x128 weight blocks), got "
                f"{quant_config.block_shape}"
            )

    @classmethod
    def for_layer(
        cls, moe_config: FusedMoEConfig, w13_scale: torch.Tensor, w2_scale: torch.Tensor
    ) -> CompassFp8Experts:
        """Experts for one layer from its ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``."""
        quant = fp8_w8a8_moe_quant_config(w13_scale, w2_scale, block_shape=BLOCK_SHAPE)
        return cls(moe_config, quant)

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # permute + 1x128 quantization is the first stage of moe_mlp

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # CUDA: the GPU kernels; CPU: the torch references

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return not moe_parallel_config.use_ep

    @staticmethod
    def _supports_quant_scheme(
        weight_key: QuantKey | None, activation_key: QuantKey | None
    ) -> bool:
        return (weight_key, activation_key) == (kFp8Static128BlockSym, kFp8Dynamic128Sym)

    @staticmethod
    def _supports_routing_method(routing_method: RoutingMethodType, weight_key, activation_key):
        return True  # takes top-k ids and weights, whatever routed them

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        return True

    def workspace_shapes(
        self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation
    ):
        return (0,), (0,), (M, K)  # moe_mlp allocates its own intermediates

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # moe_mlp's unpermute weights and reduces

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        if activation != MoEActivation.SILU:
            raise NotImplementedError(f"CompassFp8Experts: SiLU-and-mul only, got {activation}")
        if expert_map is not None:
            raise NotImplementedError("CompassFp8Experts: no expert parallelism (expert_map)")
        if apply_router_weight_on_input:
            raise NotImplementedError(
                "CompassFp8Experts: router weights are applied on the output "
                "(apply_router_weight_on_input=True is not supported)"
            )
        if a1q_scale is not None:
            raise ValueError("a1q_scale: CompassFp8Experts quantizes its own inputs (got scales)")
        ck.fp8.moe_mlp(
            hidden_states, topk_ids, topk_weights, w1, self.w1_scale, w2, self.w2_scale, out=output
        )


def make_kernel(experts: CompassFp8Experts) -> mk.FusedMoEKernel:
    """vLLM's modular kernel: its no-DP/EP prepare/finalize around our experts."""
    return mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
