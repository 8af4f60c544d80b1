"""Causal attention over THD-packed sequences for megatron-core's local (non
Transformer Engine) layer specs: the core attention of the trainer ranks.

Megatron's packed-sequence attention is Transformer Engine's
``TEDotProductAttention`` (flash / cuDNN varlen kernels over
``PackedSeqParams(qkv_format="thd")``, CP through their zigzag ring); the local
``DotProductAttention`` the CPU runs refuses both packed sequences and context
parallelism. :class:`ThdDotProductAttention` takes the same ``PackedSeqParams``
(the ``cu_seqlens_q_padded`` of ``ck.packing.PackedBatch.packed_seq_params()``)
and runs the local ``DotProductAttention`` once per sequence, so every query
sees only its own sequence's keys:

- cp = 1: each sequence's rows are one contiguous block; Megatron's causal mask
  of that block (``get_default_causal_mask``), no mask of ours.
- cp > 1: this rank holds two zigzag chunks of each sequence. Keys and values
  are all-gathered over the CP group (the gradient reduce-scattered back:
  the all-gather variant of CP attention), put back in sequence order by
  ``ck.packing.unpack`` and each sequence's queries get a [2c, P] causal mask
  from their positions (``PackedBatch.position_ids``): the one zigzag is
  ``ck.packing``'s. A mask remains because the local attention has no varlen
  kernel for two query chunks; it is per sequence, never [T, T * cp].
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import torch

__all__ = ["ThdDotProductAttention"]


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward: the sum of every rank's
    gradient of this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ws = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.ws = group, dist.get_rank(group), ws
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.ws, dim=0)[ctx.rank].contiguous(), None


@functools.lru_cache(maxsize=64)
def _cp_layout(cu_padded: tuple[int, ...], cp: int, rank: int):
    """(order [sum P] int64: the all-gathered row holding each token of the padded
    sequences in sequence order; masks: per sequence [1, 1, 2c, P] bool, True =
    masked, of this rank's queries), from ``ck.packing``'s layout of sequences of
    the padded lengths (each already a multiple of 2 cp)."""
    import compass_kernels as ck

    padded = np.diff(np.asarray(cu_padded, dtype=np.int64))
    n = padded.size
    pb = ck.packing.pack(
        torch.empty(int(padded.sum()), 0),
        padded,
        np.arange(n),
        pad_multiple=2 * cp,
        cp_size=cp,
        cp_rank=rank,
    )
    order = ck.packing.unpack(torch.arange(cp * pb.local_tokens), pb)
    local = np.concatenate([[0], np.cumsum(padded // cp)])
    masks = []
    for i in range(n):
        qpos = pb.position_ids[local[i] : local[i + 1]]
        kpos = torch.arange(int(padded[i]))
        masks.append((kpos[None, :] > qpos[:, None])[None, None])
    return order, tuple(masks)


def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class ThdDotProductAttention(torch.nn.Module):
    """Megatron's local ``DotProductAttention``, per packed sequence (see the module
    doc). Built as the spec's ``core_attention`` (the same arguments); called with
    ``packed_seq_params`` of ``qkv_format="thd"`` and no attention mask; query,
    key, value [t, heads, head_dim] (THD, Megatron squeezes the batch dim);
    returns [t, 1, heads * head_dim]."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        local = copy.copy(config)
        local.context_parallel_size = 1  # upstream's local attention refuses CP
        self.inner = _dot_product_attention()(local, *args, **kwargs)
        self.config = config
        self.cp_group = ps.get_context_parallel_group()

    @property
    def cp_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.cp_group)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        import torch.distributed as dist

        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError(
                "ThdDotProductAttention: expected packed_seq_params with qkv_format='thd' "
                "(micro-batches packed by ck.packing.pack), got "
                f"{None if packed_seq_params is None else packed_seq_params.qkv_format!r}"
            )
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "ThdDotProductAttention: the sequences come from cu_seqlens; "
                "expected no attention_mask / attention_bias"
            )
        cu_t = packed_seq_params.cu_seqlens_q_padded
        if cu_t is None:
            cu_t = packed_seq_params.cu_seqlens_q
        cu = tuple(int(x) for x in cu_t.tolist())
        cp = self.cp_size
        if query.dim() != 3 or query.shape[0] * cp != cu[-1]:
            raise ValueError(
                f"ThdDotProductAttention: query must be [t, heads, dim] with t * cp = "
                f"{cu[-1]} (cu_seqlens_q_padded[-1]), got {tuple(query.shape)} at cp {cp}"
            )
        outs = []
        if cp == 1:
            for lo, hi in zip(cu[:-1], cu[1:], strict=True):
                q, k, v = (x[lo:hi].unsqueeze(1) for x in (query, key, value))
                outs.append(self.inner(q, k, v, None, attn_mask_type=attn_mask_type))
            return torch.cat(outs)
        order, masks = _cp_layout(cu, cp, dist.get_rank(self.cp_group))
        key = _GatherSeq.apply(key, self.cp_group).index_select(0, order)
        value = _GatherSeq.apply(value, self.cp_group).index_select(0, order)
        lo = 0
        for i, mask in enumerate(masks):
            hi = lo + mask.shape[2]
            k, v = (x[cu[i] : cu[i + 1]].unsqueeze(1) for x in (key, value))
            q = query[lo:hi].unsqueeze(1)
            outs.append(self.inner(q, k, v, mask, attn_mask_type=attn_mask_type))
            lo = hi
        return torch.cat(outs)
