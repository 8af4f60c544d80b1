"""ESPO and friends (ck.espo): token log-probs and entropy (from logits, or
fused with the lm_head, ``logprobs.py``) and the segmented ESPO / GSPO / GRPO
policy loss (``loss.py``).

Kernels: the ``triton_*`` modules (GPU) and the ``*_torch`` functions of the
``reference_*`` modules (CPU), which also hold the specs.
"""

from __future__ import annotations

from compass_kernels.espo.fused_loss import fused_linear_espo_loss
from compass_kernels.espo.logprobs import (
    IGNORE_INDEX,
    fused_linear_logprobs_entropy,
    token_logprobs_entropy,
)
from compass_kernels.espo.loss import EspoMetrics, entropy_thresholds, espo_loss

__all__ = [
    "IGNORE_INDEX",
    "token_logprobs_entropy",
    "fused_linear_logprobs_entropy",
    "fused_linear_espo_loss",
    "espo_loss",
    "entropy_thresholds",
    "EspoMetrics",
]


def __dir__() -> list[str]:
    """dir(): the public names only (imports and helpers stay attributes, unlisted)."""
    return sorted(__all__)
