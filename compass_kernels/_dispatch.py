"""Backend choice for every op: one rule, no silent fallbacks.

- CPU tensor  -> "cpp" (compiled C++/OpenMP kernels in compass_kernels._C).
- CUDA tensor -> "cuda" (compiled CUDA kernels) or "triton"; the default is
  "cuda" and can be changed with COMPASS_CUDA_BACKEND=triton or per call.
- "triton" on CPU tensors runs only under the Triton interpreter
  (TRITON_INTERPRET=1 set before triton is imported): that is how the Triton
  kernels are tested without a GPU.
- "cuda-emulated" (CPU tensors, explicit only; tests): the CUDA kernels run by
  the SIMT emulator (compass_kernels._emu, docs/emulation.md).

A backend that is missing raises BackendUnavailableError naming the build flag;
it never falls back to a slower path.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from compass_kernels._ext import BackendUnavailableError, has_cuda_kernels, triton_interpreting

BACKENDS = ("cpp", "cuda", "triton", "cuda-emulated")


def default_cuda_backend() -> str:
    value = os.environ.get("COMPASS_CUDA_BACKEND", "cuda")
    if value not in ("cuda", "triton"):
        raise ValueError(f"COMPASS_CUDA_BACKEND must be 'cuda' or 'triton', got {value!r}")
    return value


def resolve(device: torch.device, backend: str | None) -> str:
    """The backend that will run an op on ``device``; raises if it cannot run there."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if device.type == "cpu":
        backend = backend or "cpp"
        if backend == "cuda":
            raise ValueError("backend='cuda' needs CUDA tensors, got tensors on cpu")
        if backend == "cuda-emulated":
            from compass_kernels import _emu

            _emu.load()  # BackendUnavailableError says how to build it
        if backend == "triton" and not triton_interpreting():
            raise BackendUnavailableError(
                "backend='triton' on CPU tensors runs only in the Triton interpreter: set "
                "TRITON_INTERPRET=1 before importing triton (tests do this in conftest.py)"
            )
    elif device.type == "cuda":
        backend = backend or default_cuda_backend()
        if backend in ("cpp", "cuda-emulated"):
            raise ValueError(f"backend={backend!r} needs CPU tensors, got tensors on cuda")
        if backend == "cuda" and not has_cuda_kernels():
            raise BackendUnavailableError(
                "the CUDA kernels were not compiled into compass_kernels._C: rebuild with nvcc "
                "on PATH (COMPASS_CUDA=ON), or pass backend='triton' / set "
                "COMPASS_CUDA_BACKEND=triton"
            )
    else:
        raise ValueError(f"unsupported device {device}: expected cpu or cuda tensors")
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise BackendUnavailableError(
            "backend='triton' needs the triton package: pip install 'compass_kernels[triton]'"
        )
    return backend
