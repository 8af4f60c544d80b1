"""The vocabulary of a routing trace: its error, the reasons a row is missing, the id
dtype, and the small host helpers the trace modules share (re-exported by trace.py)."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence

import torch

MAX_EXPERTS = 32768  # int16 holds ids up to 32767


class TraceError(ValueError):
    """A trace that breaks the contract; the message names sequence, layer and token."""


class MissingReason(enum.IntEnum):
    """Why a row (token) holds no routing. Stored per token as uint8 (0 = present)."""

    PRESENT = 0
    PREFIX_CACHE = 1  # prefix-cache hit: KV reused, the router never ran for it
    PREEMPTED = 2  # request preempted; rows lost (vLLM drops them) or recomputed unrecorded
    KV_TRANSFER = 3  # KV received from elsewhere (P/D disaggregation, KV offload)
    ASYNC_PLACEHOLDER = 4  # async-scheduling placeholder token (e.g. EOS placeholder)
    NOT_CAPTURED = 5  # no engine recorded this row (a gap between stitched turns, other)
    PADDING = 6  # a padding token added by RoutingTrace.slice (pad_policy="missing")
    NO_ROW = 7  # the token was never an engine input (a sequence's last token), see slice
    SHORT = 8  # an input token the trace has no row for (a short capture, an omitted
    #            prefix, a gap between stitched turns): only where a caller accepted it
    #            by name (max_missing_fraction=), see slice and stitch


def ids_dtype(num_experts: int) -> torch.dtype:
    """The trace dtype for ``num_experts``: uint8 up to 256 experts, int16 up to 32768."""
    if not (isinstance(num_experts, int) and 1 <= num_experts <= MAX_EXPERTS):
        raise ValueError(f"num_experts: expected an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    return torch.uint8 if num_experts <= 256 else torch.int16


def _as_int64_vector(name: str, v, device=None) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-d integer tensor, got {v.dtype}{list(v.shape)}")
        t = v.to(torch.int64)
    else:
        t = torch.as_tensor(list(v), dtype=torch.int64)
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a sequence of ints")
    return t if device is None else t.to(device)


def _cu_from_lens(lens: Sequence[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    if lens:
        torch.cumsum(torch.as_tensor(list(lens), dtype=torch.int64), 0, out=cu[1:])
    return cu.to(device)


def _bisect_right(a: list[int], x: int) -> int:
    return bisect.bisect_right(a, x)


def _dn(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{_dn(t.dtype)}{list(t.shape)} on {t.device}"
    return type(t).__name__
