"""compass_kernels: kernels for reinforcement learning on large Mixture-of-Experts models.

Capabilities are subpackages (``ck.advantages`` ...); ``ck.info()`` says what
was built and what can run here.
"""

from __future__ import annotations

from compass_kernels import advantages, fp8
from compass_kernels._info import info

__version__ = "0.1.0"
__all__ = ["advantages", "fp8", "info", "__version__"]
