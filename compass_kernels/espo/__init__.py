"""ESPO and friends (ck.espo): the segmented ESPO / GSPO / GRPO policy loss.

Public functions here; kernels in csrc/espo (C++ and CUDA) and
``triton_loss.py``; the spec in ``reference_loss.py``.
"""

from __future__ import annotations

from compass_kernels.espo.loss import EspoMetrics, entropy_thresholds, espo_loss

__all__ = ["espo_loss", "entropy_thresholds", "EspoMetrics"]
