"""What the router capture in vLLM hands back: one :class:`CapturedSequence` per finished
sequence, the reasons a row holds no routing, and :class:`CaptureError`.

Shared by both capture paths (compass_kernels/integration/vllm/capture.py, the
``hook`` path and the user-side handle; compass_kernels/integration/vllm/routed_experts.py,
the conversion of vLLM's own routed experts). The contract of the result is described
in capture.py's module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compass_kernels.routing import MissingReason

__all__ = [
    "MISSING_NOT_CAPTURED",
    "MISSING_PREEMPTED",
    "MISSING_PREFIX_CACHE",
    "CaptureError",
    "CapturedSequence",
]

# Why a row holds no routing (compass_kernels.routing.MissingReason; 0 = present).
_PRESENT = int(MissingReason.PRESENT)
#: Row served from the prefix cache: this request never computed it.
MISSING_PREFIX_CACHE = int(MissingReason.PREFIX_CACHE)
#: Row of a preempted request: recomputed with different experts than first
#: captured (always), or recomputed at all (under ``recomputed="missing"``).
MISSING_PREEMPTED = int(MissingReason.PREEMPTED)
#: Row never computed for another reason (e.g. KV received from elsewhere).
MISSING_NOT_CAPTURED = int(MissingReason.NOT_CAPTURED)


class CaptureError(RuntimeError):
    """The capture cannot be trusted (a layer did not report, an unsupported engine)."""


def _id_dtype(num_experts: int) -> np.dtype:
    """The trace's id dtype: uint8 up to 256 experts, int16 up to 32768."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise CaptureError(f"num_experts={num_experts} does not fit 16-bit expert ids")


@dataclass
class CapturedSequence:
    """The routing of one finished sequence, as captured (see :meth:`to_trace`).

    Attributes
    ----------
    expert_ids : numpy.ndarray
        ``[num_tokens, num_moe_layers, top_k]``, uint8 (<= 256 experts) or
        int16; logical expert ids. Rows with a nonzero ``reason`` hold no
        routing (content unspecified, never to be read).
    reason : numpy.ndarray
        uint8 ``[num_tokens]``: 0 captured, else why missing
        (``compass_kernels.routing.MissingReason`` values).
    recomputed : numpy.ndarray
        bool ``[num_tokens]``: computed twice (preemption) with the same experts.
    layers : list of int
        Global layer number of each column of ``expert_ids`` (MoE layers only).
    num_experts : int
    num_prompt_tokens, num_output_tokens : int
        ``num_tokens == num_prompt_tokens + num_output_tokens - 1``.
    conflicts : int
        Rows computed twice with different experts (marked missing, PREEMPTED).
    request_id : str
        The engine-internal request id.
    """

    expert_ids: np.ndarray
    reason: np.ndarray
    recomputed: np.ndarray
    layers: list[int]
    num_experts: int
    num_prompt_tokens: int
    num_output_tokens: int
    conflicts: int = 0
    request_id: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    def to_trace(self, *, recomputed: str = "keep"):
        """This sequence as a one-sequence ``compass_kernels.routing.RoutingTrace``.

        Parameters
        ----------
        recomputed : {"keep", "missing"}, default "keep"
            Rows a preempted request computed twice with the same experts:
            ``"keep"`` them, or mark them missing (reason PREEMPTED). Rows
            recomputed with different experts are missing either way.
        """
        if recomputed not in ("keep", "missing"):
            raise ValueError(f"recomputed must be 'keep' or 'missing', got {recomputed!r}")
        from compass_kernels.routing import RoutingTrace

        reason = self.reason.copy()
        if recomputed == "missing":
            reason[self.recomputed & (reason == _PRESENT)] = MISSING_PREEMPTED
        missing = reason != _PRESENT
        n = self.num_tokens
        return RoutingTrace(
            torch.from_numpy(np.ascontiguousarray(self.expert_ids)),
            torch.tensor([0, n], dtype=torch.int64),
            self.num_experts,
            layer_ids=list(self.layers),
            missing=torch.from_numpy(missing) if missing.any() else None,
            missing_reason=torch.from_numpy(reason) if missing.any() else None,
            token_lens=[self.num_prompt_tokens + self.num_output_tokens],
        )
