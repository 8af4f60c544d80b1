"""Megatron grouped-MLP hook: the experts' forward in FP8 through ``ck.fp8.grouped_mlp``.

Megatron's experts modules (``SequentialMLP``, ``TEGroupedMLP``) are called as
``experts(permuted_local_hidden_states [P, H], tokens_per_expert [E],
permuted_probs [P]) -> (output [P, H], bias)``, rows grouped by local expert
(the token dispatcher permutes and combines). :func:`apply` patches one such
module instance so that, **under no_grad**, that call runs the block-FP8 path
the rollout engine runs (``compass_kernels/integration/vllm/fp8_moe.py``): the module's expert
weights quantized 128x128 into vLLM's layout (``w13`` [E, 2I, H] = each
expert's ``linear_fc1`` rows, gate then up, as Megatron's GLU chunks them;
``w2`` [E, H, I] = ``linear_fc2``), 1x128 activations, token-packed grouped
GEMMs. Use: the old-policy log-prob pass of RL, recomputed with the rollout's
FP8 numerics. With gradients enabled (the training forward) the module's own
forward runs: the FP8 path has no backward.

The FP8 weights are cached per module and re-quantized when any expert
weight changed (its version counter, bumped by the optimizer's in-place
update, or a new tensor). ``revert`` undoes the patch; ``apply`` is idempotent.
Supported: gated SiLU experts without bias (``gated_linear_unit=True``,
``activation_func=F.silu``, ``add_bias_linear=False``); anything else raises
at :func:`apply`. The arithmetic lives in ``compass_kernels.fp8``.
"""

from __future__ import annotations

import types

import torch

import compass_kernels as ck

__all__ = ["apply", "revert", "is_applied", "fp8_weights"]

_STATE = "_compass_fp8_moe"


def _expert_weights(module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fc1 [2I, H], fc2 [H, I]) per local expert of a SequentialMLP or TEGroupedMLP."""
    if hasattr(module, "local_experts"):  # SequentialMLP
        return [(m.linear_fc1.weight, m.linear_fc2.weight) for m in module.local_experts]
    if hasattr(module, "linear_fc1") and hasattr(module.linear_fc1, "weight0"):  # TEGroupedMLP
        n = module.num_local_experts
        return [
            (getattr(module.linear_fc1, f"weight{i}"), getattr(module.linear_fc2, f"weight{i}"))
            for i in range(n)
        ]
    raise TypeError(
        f"module: expected a Megatron SequentialMLP or TEGroupedMLP, got {type(module).__name__}"
    )


def _check_config(module) -> None:
    cfg = module.config
    if not cfg.gated_linear_unit or cfg.activation_func is not torch.nn.functional.silu:
        raise ValueError(
            "module.config: expected gated SiLU experts (gated_linear_unit=True, "
            f"activation_func=F.silu), got {cfg.activation_func}"
        )
    if cfg.add_bias_linear:
        raise ValueError("module.config: expected experts without bias (add_bias_linear=False)")


def fp8_weights(module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13, w13_scale, w2, w2_scale) of the module's experts in vLLM's block-FP8
    layout, quantized from the weights as they are now (cached until they change)."""
    weights = _expert_weights(module)
    key = tuple((id(a), a._version, id(b), b._version) for a, b in weights)
    cache = getattr(module, _STATE).get("cache")
    if cache is None or cache[0] != key:
        with torch.no_grad():
            w13 = torch.stack([a.detach() for a, _ in weights])
            w2 = torch.stack([b.detach() for _, b in weights])
            # Quantize what the forward uses (bf16 in training), never an fp32 master.
            q13, s13 = ck.fp8.quantize_blockwise(w13)
            q2, s2 = ck.fp8.quantize_blockwise(w2)
        cache = (key, (q13, s13, q2, s2))
        getattr(module, _STATE)["cache"] = cache
    return cache[1]


def _forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    state = getattr(self, _STATE)
    if torch.is_grad_enabled():
        return state["forward"](permuted_local_hidden_states, tokens_per_expert, permuted_probs)
    x = permuted_local_hidden_states
    probs = permuted_probs.to(torch.float32)
    if self.config.moe_apply_probs_on_input:
        x = (probs.unsqueeze(-1) * x).to(x.dtype)
        probs = None
    counts = torch.as_tensor(tokens_per_expert).to(device=x.device, dtype=torch.int64)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    y = ck.fp8.grouped_mlp(x, offsets, *fp8_weights(self))
    if probs is not None:  # Megatron scales fc2's input by the probs: the same as its output
        y = y.float() * probs.unsqueeze(-1)
    return y.to(x.dtype), None


def apply(module) -> None:
    """Patch one experts module instance (idempotent)."""
    if is_applied(module):
        return
    _expert_weights(module)
    _check_config(module)
    setattr(module, _STATE, {"forward": module.forward, "cache": None})
    module.forward = types.MethodType(_forward, module)


def revert(module) -> None:
    """Undo :func:`apply` (no-op on an unpatched module)."""
    state = getattr(module, _STATE, None)
    if state is None:
        return
    module.forward = state["forward"]
    delattr(module, _STATE)


def is_applied(module) -> bool:
    return getattr(module, _STATE, None) is not None
