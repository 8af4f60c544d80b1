"""Argument checks shared by every public op. Each error names the argument and
what was expected (dtype, shape, device, range)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

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
    t = t.detach()  # a float of a requires-grad tensor warns; the check needs no graph
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


# ------------------------------------------------------------ option normalisers
# Options arrive as Python numbers, NumPy scalars, 0-d (scalar) or 1-d (tuple)
# NumPy arrays and torch tensors: each public function normalises them ONCE at
# its boundary to plain Python values (hashable, no device), so the rest of the
# library (config caches, C++ bindings, kernels) sees ints, floats and tuples.
# bool is refused where a number is meant (dp_size=True is a bug, not 1).


class OptionTypeError(TypeError, ValueError):
    """An option of the wrong type: both a TypeError and a ValueError (the
    library's checks raised either before the normalisers; both still match)."""


def _scalar(name: str, v: object, what: str) -> object:
    """``v`` as a Python scalar: NumPy scalars and 0-d arrays / tensors unwrapped."""
    if isinstance(v, torch.Tensor):
        if v.dim() != 0:
            raise ValueError(f"{name}: expected {what}, got a tensor of shape {list(v.shape)}")
        if v.dtype == torch.bool:
            raise OptionTypeError(f"{name}: expected {what}, got a bool tensor")
        return v.item()
    if type(v).__module__ == "numpy":  # NumPy scalar or array (NumPy not imported here)
        a: Any = v  # a NumPy value: no NumPy types without importing NumPy
        if getattr(a, "ndim", 0) != 0:
            raise ValueError(f"{name}: expected {what}, got an array of shape {list(a.shape)}")
        if a.dtype.kind == "b":
            raise OptionTypeError(f"{name}: expected {what}, got a NumPy bool")
        return a.item()
    return v


def as_int(name: str, v: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """An integer option as a Python int: int, NumPy integer, 0-d integer array
    or tensor; bool and floats refused (``2.0`` for a count is a bug). ``lo`` /
    ``hi``: inclusive bounds, named in the error."""
    if type(v) is not int:
        s = _scalar(name, v, "an int")
        if isinstance(s, bool) or not isinstance(s, int):
            raise OptionTypeError(f"{name}: expected an int, got {v!r} ({type(v).__name__})")
        v = s
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None:
            assert lo is not None  # one of the bounds is set here
            want = {0: "a non-negative int", 1: "a positive int"}.get(lo, f"an int >= {lo}")
        else:
            want = f"an int in [{'-inf' if lo is None else lo}, {hi}]"
        raise ValueError(f"{name}: expected {want}, got {v}")
    return v


def as_float(name: str, v: object, *, finite: bool = True) -> float:
    """A real option as a Python float: int, float, NumPy number, 0-d real array
    or tensor; bool and complex refused; NaN and +-Inf refused unless ``finite=False``
    (the caller's range check then sees them)."""
    if type(v) is not float:
        s = _scalar(name, v, "a number")
        if isinstance(s, bool) or not isinstance(s, int | float):
            raise OptionTypeError(f"{name}: expected a number, got {v!r} ({type(v).__name__})")
        v = float(s)
    if finite and not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    return v


def as_float_tuple(name: str, v: object, *, length: int | None = None) -> tuple[float, ...]:
    """A sequence of reals (tuple, list, 1-d NumPy array or tensor) as a tuple of
    finite Python floats; ``length``: the exact count expected."""
    if isinstance(v, torch.Tensor) or type(v).__module__ == "numpy":
        arr: Any = v  # a tensor or a NumPy array (NumPy not imported here)
        if getattr(arr, "ndim", None) != 1:
            raise ValueError(
                f"{name}: expected a 1-d sequence of numbers, got shape {list(arr.shape)}"
            )
        v = arr.tolist()
    if isinstance(v, str | bytes) or not isinstance(v, Sequence):
        raise OptionTypeError(f"{name}: expected a sequence of numbers, got {type(v).__name__}")
    if length is not None and len(v) != length:
        raise ValueError(f"{name}: expected {length} numbers, got {len(v)}")
    return tuple(as_float(f"{name}[{i}]", x) for i, x in enumerate(v))


def is_scalar_like(v: object) -> bool:
    """Whether ``v`` is one number (Python, NumPy scalar, 0-d array or tensor)."""
    if isinstance(v, torch.Tensor) or type(v).__module__ == "numpy":
        return getattr(v, "ndim", 0) == 0
    return isinstance(v, int | float)


def as_bool(name: str, v: object) -> bool:
    """A flag as a Python bool: bool, NumPy bool, 0-d bool array / tensor (not 0 / 1)."""
    if type(v) is bool:
        return v
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == torch.bool:
        return bool(v.item())
    a: Any = v  # maybe a NumPy value (NumPy not imported here)
    if type(a).__module__ == "numpy" and getattr(a, "ndim", 1) == 0 and a.dtype.kind == "b":
        return bool(v)
    raise OptionTypeError(f"{name}: expected a bool, got {v!r} ({type(v).__name__})")
