"""Length-aware packing (ck.packing): balance variable-length sequences over
data-parallel ranks and micro-batches under a token cap.

- :func:`plan` / :class:`Plan`: the planner (C++ search, csrc/packing).
- :class:`ModelConfig`, :func:`cost_coefficients`: the attention cost model.
- :func:`pack` / :func:`unpack` / :class:`PackedBatch`: Megatron THD layout
  (padding, cu_seqlens, position ids, context-parallel zigzag), C++ / CUDA /
  Triton kernels.
- ``schedule``: length-aware rollout scheduling (response-length predictor,
  longest-first / LPT submission order, makespan simulator).
- ``reference``: the executable spec (Karmarkar-Karp baseline, plan checks,
  pack / unpack one sequence at a time).
"""

from __future__ import annotations

from compass_kernels.packing import schedule
from compass_kernels.packing.planner import (
    ModelConfig,
    Plan,
    cost_coefficients,
    plan,
    sequence_cost,
)
from compass_kernels.packing.thd import PackedBatch, pack, unpack

__all__ = [
    "ModelConfig",
    "PackedBatch",
    "Plan",
    "cost_coefficients",
    "pack",
    "plan",
    "schedule",
    "sequence_cost",
    "unpack",
]


def __dir__() -> list[str]:
    """dir(): the public names only (imports and helpers stay attributes, unlisted)."""
    return sorted(__all__)
