"""Megatron-core drop-in for the ESPO loss: a ``loss_func`` for ``forward_step``.

Thin plumbing, no arithmetic of its own beyond Megatron's loss scaling:

    def forward_step(data_iterator, model):
        batch = next(data_iterator)        # tokens, labels, position ids, EspoBatch
        out = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
        return out, make_loss_func(batch.espo, num_microbatches=nmb, vocab_size=V)

- ``GPTModel(..., labels=...)`` returns the per-token cross-entropy [b, s],
  computed by Megatron's vocab-parallel cross-entropy over the model's tensor-
  parallel group (all-reduce MAX then SUM of the vocab shards), i.e.
  -log pi(label): the log-probs the loss needs, vocab parallelism included.
  (Sampling temperature: scale the logits in the model's output layer.)
- The loss is ``ck.espo.espo_loss`` over the micro-batch's tokens with the
  global-mini-batch sequence count G (``num_sequences``), so the sum over
  micro-batches and data-parallel ranks of the micro-batch losses is the
  mini-batch loss. Megatron's schedule (forward_step, two-value loss_func)
  multiplies the loss by cp_size / num_microbatches and DDP averages gradients
  over the dp x cp ranks; the returned loss is scaled by num_microbatches *
  dp_size to undo both, so the gradients are those of the mini-batch loss.
- Context parallelism: the CP group of Megatron's parallel state when its size
  is > 1 (each rank's tokens are its slice; group sums and metrics are
  reduced over the group).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from compass_kernels.espo import espo_loss

#: metrics reported to Megatron's logging (0-d device tensors; no host sync)
REPORTED = (
    "loss",
    "clip_frac",
    "dual_clip_frac",
    "ratio_mean",
    "ratio_max",
    "kl_k3",
    "log_ratio_gt_ln2_frac",
    "entropy_mean",
)


@dataclass
class EspoBatch:
    """The RL side of one micro-batch, over its flattened [b * s] tokens (this
    CP rank's slice).

    cu_seqlens : [n+1] int boundaries of the responses in the flattened tokens.
    old_logprobs, old_entropy : [b * s] from the rollout / old policy.
    advantages : [n] per response or [b * s] per token.
    loss_mask : [b * s] bool (False: prompt, padding) or None.
    num_sequences : responses in the global mini-batch (all DP ranks and
        micro-batches): the loss's denominator G.
    """

    cu_seqlens: torch.Tensor
    old_logprobs: torch.Tensor
    old_entropy: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor | None
    num_sequences: int


def _parallel_sizes(dp_size: int | None, cp_group: Any) -> tuple[int, Any]:
    from megatron.core import parallel_state as ps

    if dp_size is None:
        dp_size = ps.get_data_parallel_world_size()
    if cp_group is None and ps.get_context_parallel_world_size() > 1:
        cp_group = ps.get_context_parallel_group()
    return dp_size, cp_group


def espo_loss_func(
    batch: EspoBatch,
    output_tensor: torch.Tensor,
    *,
    num_microbatches: int,
    dp_size: int | None = None,
    cp_group: Any = None,
    **espo_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's two-value ``loss_func``: (scaled loss, metrics to log)."""
    dp_size, cp_group = _parallel_sizes(dp_size, cp_group)
    logprobs = -output_tensor.reshape(-1)
    loss, metrics = espo_loss(
        logprobs,
        batch.old_logprobs,
        batch.old_entropy,
        batch.advantages,
        batch.cu_seqlens,
        batch.loss_mask,
        num_sequences=batch.num_sequences,
        cp_group=cp_group,
        **espo_kwargs,
    )
    report = {f"espo/{key}": metrics[key].detach() for key in REPORTED}
    return loss * (num_microbatches * dp_size), report


def make_loss_func(batch: EspoBatch, **kwargs: Any):
    """``functools.partial(espo_loss_func, batch, **kwargs)``: what forward_step returns."""
    return functools.partial(espo_loss_func, batch, **kwargs)
