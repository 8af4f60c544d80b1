"""The compiled module compass_kernels._C and the boundary helpers around it.

Tensors cross into C++ as borrowed DLPack capsules: csrc never includes torch,
so one wheel serves any torch version.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch
from torch.utils.dlpack import to_dlpack


class BackendUnavailableError(RuntimeError):
    """A requested backend was not built or cannot run here; the message says how to get it."""


@functools.cache
def load() -> ModuleType:
    """Import compass_kernels._C, or raise with how to build it."""
    try:
        from compass_kernels import _C  # type: ignore[attr-defined]  # compiled, no stub
    except ImportError as err:
        raise BackendUnavailableError(
            "compass_kernels._C (the C++/CUDA kernels) is not built or failed to load "
            f"({err}). Build it with `pip install -e .` (or `pip install .`) from the repo root."
        ) from err
    return _C


def dl(t: torch.Tensor):
    """A borrowed DLPack capsule of ``t`` (entry points also take tensors directly)."""
    return to_dlpack(t)


def cuda_stream(t: torch.Tensor) -> int:
    """The raw handle of the current stream on ``t``'s device (CUDA entry points take it).
    torch's C-level getter: no Stream object is built (this runs once per launch)."""
    return torch._C._cuda_getCurrentRawStream(t.device.index)


@functools.cache
def has_cuda_kernels() -> bool:
    """Whether _C holds the CUDA kernels (fixed per process; cached: it is on every dispatch)."""
    try:
        return bool(load().build_info()["cuda"])
    except BackendUnavailableError:
        return False


@functools.cache
def compiled_cuda_archs() -> tuple[str, ...]:
    """The CUDA archs the generic kernels were built for, e.g. ("80", "90a")."""
    archs = load().build_info().get("cuda_archs", "")
    return tuple(a for a in archs.replace(";", ",").split(",") if a)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
