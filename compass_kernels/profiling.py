"""NVTX ranges for Nsight Systems / Nsight Compute, behind one switch.

Off by default. Turn on with the environment variable ``COMPASS_NVTX=1``
(read once, at import) or at run time with ``set_enabled(True)``.

- Off: every entry point returns after one boolean test; no range name is
  formatted, no module is imported, nothing is pushed.
- On: ranges go to the ``nvtx`` package when it is importable (it works with or
  without a GPU, and is a no-op unless a profiler is attached); otherwise to
  ``torch.cuda.nvtx`` when CUDA is available (on a CPU build torch.cuda.nvtx
  raises, so it is never called there); otherwise nothing happens. Nothing
  here raises on a CPU-only machine.

Ranges go to NVTX's default domain, so ``nsys`` shows them on the thread's
NVTX row and ``ncu --nvtx --nvtx-include "name/"`` can filter on them without
a domain prefix. See docs/profiling.md.

Examples
--------
>>> from compass_kernels import profiling
>>> with profiling.nvtx_range("espo.loss"):
...     pass
>>> @profiling.nvtx_decorator()           # range "<module>.<qualname>"
... def step():
...     pass
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar, overload

__all__ = [
    "ENV_VAR",
    "is_enabled",
    "set_enabled",
    "backend_name",
    "nvtx_range",
    "nvtx_decorator",
    "nvtx_push",
    "nvtx_pop",
]

ENV_VAR = "COMPASS_NVTX"

F = TypeVar("F", bound=Callable[..., Any])


def _env_enabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class _State:
    """Module state, one object so that the hot check is one attribute load."""

    __slots__ = ("enabled", "backend")

    def __init__(self) -> None:
        self.enabled: bool = _env_enabled()
        # (name, push(msg), pop()) once resolved; None until the first range
        # while enabled, so an off switch never imports nvtx or touches CUDA.
        self.backend: tuple[str, Callable[[str], Any], Callable[[], Any]] | None = None


_state = _State()
_local = threading.local()  # per-thread depth of ranges pushed by nvtx_push


def _noop_push(msg: str) -> None:
    return None


def _noop_pop() -> None:
    return None


def _resolve_backend() -> tuple[str, Callable[[str], Any], Callable[[], Any]]:
    try:
        import nvtx  # the NVIDIA package; a no-op without a profiler attached

        return ("nvtx", nvtx.push_range, nvtx.pop_range)
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            cuda_nvtx = torch.cuda.nvtx
            return ("torch.cuda.nvtx", cuda_nvtx.range_push, cuda_nvtx.range_pop)
    except Exception:  # a broken torch install must not break profiling calls
        pass
    return ("none", _noop_push, _noop_pop)


def _backend() -> tuple[str, Callable[[str], Any], Callable[[], Any]]:
    b = _state.backend
    if b is None:
        b = _state.backend = _resolve_backend()
    return b


def is_enabled() -> bool:
    """Return whether NVTX ranges are emitted."""
    return _state.enabled


def set_enabled(enabled: bool) -> None:
    """Switch NVTX ranges on or off at run time (overrides ``COMPASS_NVTX``).

    Switch between steps, not inside open ranges: ranges already open stay
    open when switched off (context managers and decorators still close the
    ranges they opened).
    """
    _state.enabled = bool(enabled)


def backend_name() -> str:
    """Return where ranges go when enabled: ``"nvtx"``, ``"torch.cuda.nvtx"`` or ``"none"``."""
    return _backend()[0]


def _caller_name(depth: int) -> str:
    frame = sys._getframe(depth + 1)
    module = frame.f_globals.get("__name__", "?")
    code = frame.f_code
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"


def nvtx_push(name: str) -> None:
    """Open an NVTX range named `name` on this thread (no-op when disabled).

    Pair with `nvtx_pop`. Prefer `nvtx_range` / `nvtx_decorator`, which pair
    themselves; push/pop is for ranges that span callbacks or hooks.
    """
    if not _state.enabled:
        return
    _backend()[1](name)
    _local.depth = getattr(_local, "depth", 0) + 1


def nvtx_pop() -> None:
    """Close the innermost range opened by `nvtx_push` on this thread.

    A no-op when disabled, and when this thread has no open `nvtx_push` range
    (e.g. the switch was turned on between a push and its pop).
    """
    if not _state.enabled:
        return
    depth = getattr(_local, "depth", 0)
    if depth <= 0:
        return
    _backend()[2]()
    _local.depth = depth - 1


class _NullRange:
    """Shared, reusable no-op context manager returned while disabled."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_RANGE = _NullRange()


class _Range:
    __slots__ = ("name", "pop")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pop: Callable[[], Any] | None = None

    def __enter__(self) -> None:
        _, push, pop = _backend()
        push(self.name)
        self.pop = pop  # pop exactly what was pushed, even if switched off meanwhile

    def __exit__(self, *exc: object) -> None:
        if self.pop is not None:
            self.pop()
            self.pop = None


def nvtx_range(name: str | None = None) -> _Range | _NullRange:
    """Return a context manager that wraps a block in an NVTX range.

    Parameters
    ----------
    name : str, optional
        Range name. Defaults to the caller's ``module.qualname`` (computed only
        when enabled).

    Returns
    -------
    context manager
        A shared no-op object when disabled.
    """
    if not _state.enabled:
        return _NULL_RANGE
    return _Range(name if name is not None else _caller_name(1))


@overload
def nvtx_decorator(name: F) -> F: ...
@overload
def nvtx_decorator(name: str | None = None) -> Callable[[F], F]: ...
def nvtx_decorator(name: str | F | None = None) -> Callable[[F], F] | F:
    """Decorate a function so each call runs inside an NVTX range.

    The switch is checked at every call, so `set_enabled` affects functions
    decorated before it; when off a call costs one extra Python frame and a
    boolean test.

    Parameters
    ----------
    name : str, optional
        Range name. Defaults to ``f"{fn.__module__}.{fn.__qualname__}"``, built
        once at decoration (never per call).

    Returns
    -------
    callable
        The decorator; ``@nvtx_decorator`` without parentheses also works.

    Examples
    --------
    >>> @nvtx_decorator()
    ... def pack(x):
    ...     return x
    """
    if callable(name):
        return nvtx_decorator()(name)

    def decorate(fn: F) -> F:
        range_name = name if name is not None else f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _state.enabled:
                return fn(*args, **kwargs)
            _, push, pop = _backend()
            push(range_name)
            try:
                return fn(*args, **kwargs)
            finally:
                pop()

        wrapper.nvtx_name = range_name  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
