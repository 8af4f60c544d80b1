"""Argument checks shared by every public op. Each error names the argument and
what was expected (dtype, shape, device, range)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def should_check(validate: bool | None, *tensors: object) -> bool:
    """Whether an op runs its data checks (finite values, offsets, ids in range):
    the one rule every public op follows.

    - ``validate=False``: never (the opt-out, on every device);
    - never while tracing (torch.compile) or when a tensor is fake / meta, or a
      dispatch mode is active: there is no data to read (not even with
      ``validate=True``);
    - ``validate=True``: always otherwise (on CUDA a host sync, asked for);
    - ``validate=None`` (the default): on CPU tensors (host memory: no sync),
      not on CUDA tensors (the GPU path never syncs by default).

    The device is that of the first tensor among ``tensors``.
    """
    if validate is False:
        return False
    if validate is not None and validate is not True:
        raise TypeError(f"validate: expected True, False or None, got {validate!r}")
    if has_no_data(*tensors):
        return False
    if validate:
        return True
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device.type == "cpu"
    raise TypeError("should_check: needs at least one tensor")


def has_no_data(*tensors: object) -> bool:
    """True while tracing (torch.compile), under a dispatch mode (FakeTensorMode,
    make_fx) or when a tensor is fake / meta: no data to read, kernels never run."""
    return torch.compiler.is_compiling() or is_symbolic(tensors)


def is_symbolic(values) -> bool:
    """Whether a call must go through the dispatcher: a tensor that is not a plain
    tensor with data (FakeTensor, meta, another subclass), or an active
    TorchDispatchMode (FakeTensorMode, make_fx)."""
    if is_in_torch_dispatch_mode():
        return True
    for a in values:
        if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or a.is_meta):
            return True
    return False


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " | ".join(str(d).removeprefix("torch.") for d in dtypes)


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    size: int | None = None,
    size_what: str = "",
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check one tensor argument; returns it. ``size`` is the expected length of dim 0."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got {describe(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {describe(t)}")
    if size is not None and t.shape[0] != size:
        what = f" ({size_what})" if size_what else ""
        raise ValueError(f"{name}: expected {size} elements in dim 0{what}, got {describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {describe(t)}")
    return t


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise if ``t`` holds NaN or Inf, naming the first bad index (``index i``,
    or ``[i, j, ...]`` for an n-d tensor; one host sync).

    Fast path: a float64 sum is finite iff every element is (NaN and Inf
    propagate; float32/half values cannot overflow a float64 sum), one
    reduction instead of isfinite + any. Only a bad tensor pays for the search.
    """
    if math.isfinite(float(t.sum(dtype=torch.float64))):
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        where = f"index {idx[0]}" if t.dim() == 1 else f"{idx}"
        raise ValueError(
            f"{name}: expected finite values, got {t[tuple(idx)].item()} at {where} "
            f"({int(bad.sum())} non-finite of {t.numel()})"
        )


def check_offsets(name: str, offsets: torch.Tensor, total: int, *, exact: bool) -> None:
    """Check a cu_seqlens-style int64 vector on its own device with one host sync:
    offsets[0] == 0, non-decreasing, offsets[-1] == total (exact) or <= total."""
    first, last = offsets[0], offsets[-1]
    decreasing = (offsets[1:] < offsets[:-1]).any()  # False for a single element
    end_bad = (last != total) if exact else (last > total)
    flags = torch.stack([first != 0, decreasing, end_bad]).tolist()
    if flags[0]:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {int(first)}")
    if flags[1]:
        i = int((offsets[1:] < offsets[:-1]).nonzero()[0, 0])
        raise ValueError(
            f"{name}: expected non-decreasing values, got {name}[{i}] = {int(offsets[i])} > "
            f"{name}[{i + 1}] = {int(offsets[i + 1])}"
        )
    if flags[2]:
        rel = "==" if exact else "<="
        raise ValueError(f"{name}: expected {name}[-1] {rel} {total}, got {int(last)}")
