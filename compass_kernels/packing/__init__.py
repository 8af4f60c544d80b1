"""Length-aware packing (ck.packing): balance variable-length sequences over
data-parallel ranks and micro-batches under a token cap.

- :func:`plan` / :class:`Plan`: the planner (C++ search, csrc/packing).
- :class:`ModelConfig`, :func:`cost_coefficients`: the attention cost model.
- ``reference``: the executable spec (Karmarkar-Karp baseline, plan checks).
"""

from __future__ import annotations

from compass_kernels.packing.planner import (
    ModelConfig,
    Plan,
    cost_coefficients,
    plan,
    sequence_cost,
)

__all__ = ["ModelConfig", "Plan", "cost_coefficients", "plan", "sequence_cost"]
