"""Backend choice for every op: one rule, no silent fallbacks.

- CPU tensor  -> "torch" (the op's plain-torch reference) for GPU-native ops,
  "cpp" (compiled C++ in compass_kernels._C) for host-side work (route codec,
  the grouped GEMM's argument builder).
- CUDA tensor -> the op's one GPU backend, "triton" or "cuda" (compiled CUDA /
  CUTLASS). An op with both (the FP8 grouped GEMM) defaults to "cuda";
  COMPASS_CUDA_BACKEND=triton or backend= picks the other.
- "triton" on CPU tensors runs only under the Triton interpreter
  (TRITON_INTERPRET=1 set before triton is imported): that is how the Triton
  kernels are tested without a GPU.

Each op declares which backends it has (compass_kernels._op.Op); a backend the
op lacks, or one that was not built or cannot run here, raises
BackendUnavailableError naming the op, the backend and how to get it. Each op
caches the answer per (device, backend): the call path only looks it up.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from compass_kernels._ext import (
    BackendUnavailableError,
    compiled_cuda_archs,
    has_cuda_kernels,
    triton_interpreting,
)

BACKENDS = ("torch", "cpp", "cuda", "triton")


def default_cuda_backend() -> str:
    value = os.environ.get("COMPASS_CUDA_BACKEND", "cuda")
    if value not in ("cuda", "triton"):
        raise ValueError(f"COMPASS_CUDA_BACKEND must be 'cuda' or 'triton', got {value!r}")
    return value


# Callers cache resolve()'s answers (each Op keeps one dict, registered here):
# the environment (COMPASS_CUDA_BACKEND, TRITON_INTERPRET) is read on the first
# dispatch of a key, both being process-level settings. reset() forgets (tests).
_CACHES: list[dict] = []


def register_cache(cache: dict) -> None:
    """A cache of resolve() results that reset() must clear."""
    _CACHES.append(cache)


def reset() -> None:
    """Forget cached decisions, e.g. after changing COMPASS_CUDA_BACKEND."""
    for cache in _CACHES:
        cache.clear()


def resolve(
    device: torch.device,
    backend: str | None,
    *,
    op: str = "this op",
    available: tuple[str, ...] = BACKENDS,
) -> str:
    """The backend that will run ``op`` on ``device``; raises if it cannot run there."""
    return _resolve(device.type, device.index, backend, op, available)


def _resolve(dev_type, dev_index, backend, op, available) -> str:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend is not None and backend not in available:
        raise BackendUnavailableError(
            f"{op} has no {backend!r} backend (it has {', '.join(available)})"
        )
    if dev_type == "cpu":
        backend = backend or ("torch" if "torch" in available else "cpp")
        if backend == "cuda":
            raise ValueError("backend='cuda' needs CUDA tensors, got tensors on cpu")
        if backend == "triton" and not triton_interpreting():
            raise BackendUnavailableError(
                f"{op}: backend='triton' on CPU tensors runs only in the Triton interpreter: set "
                "TRITON_INTERPRET=1 before importing triton (tests do this in conftest.py)"
            )
    elif dev_type == "cuda":
        if backend is None:
            gpu = [b for b in ("cuda", "triton") if b in available]
            backend = gpu[0] if len(gpu) == 1 else default_cuda_backend()
        if backend in ("cpp", "torch"):
            raise ValueError(f"backend={backend!r} needs CPU tensors, got tensors on cuda")
    else:
        raise ValueError(f"unsupported device {dev_type}: expected cpu or cuda tensors")
    if backend not in available:  # the default for this device
        raise BackendUnavailableError(
            f"{op} has no {backend!r} backend (it has {', '.join(available)}): pass backend=..."
            + (" or set COMPASS_CUDA_BACKEND" if dev_type == "cuda" else "")
        )
    if backend == "cuda":
        if not has_cuda_kernels():
            raise BackendUnavailableError(
                f"{op}: the CUDA kernels were not compiled into compass_kernels._C: rebuild with "
                "nvcc on PATH (COMPASS_CUDA=ON), or pass backend='triton' / set "
                "COMPASS_CUDA_BACKEND=triton"
            )
        _check_arch(op, dev_index)
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise BackendUnavailableError(
            f"{op}: backend='triton' needs the triton package: "
            "pip install 'compass_kernels[triton]'"
        )
    return backend


def can_run_arch(capability: tuple[int, int], archs: tuple[str, ...]) -> bool:
    """Whether a build for ``archs`` (CMake style: "80", "90a", "86-real", "90-virtual")
    has code a device of ``capability`` runs: SASS of the same major and a minor
    <= the device's ('a' variants only on their exact SM), or PTX of an SM <= the
    device's (JIT-compiled by the driver)."""
    dev = capability[0] * 10 + capability[1]
    for a in archs:
        base, _, kind = a.partition("-")
        specific = base.endswith("a")
        sm = int(base.rstrip("af"))
        sass = kind in ("", "real")
        ptx = kind in ("", "virtual") and not specific
        if sass and (sm == dev if specific else (sm // 10 == dev // 10 and sm <= dev)):
            return True
        if ptx and sm <= dev:
            return True
    return False


def _check_arch(op: str, dev_index: int | None) -> None:
    index = torch.cuda.current_device() if dev_index is None else dev_index
    cap = torch.cuda.get_device_capability(index)
    archs = compiled_cuda_archs()
    if not can_run_arch(cap, archs):
        raise BackendUnavailableError(
            f"{op}: compass_kernels._C was built for CUDA archs {', '.join(archs)}, which cannot "
            f"run on cuda:{index} (sm_{cap[0]}{cap[1]}); rebuild with "
            f"COMPASS_CUDA_ARCHS='{cap[0]}{cap[1]}' (or pass backend='triton')"
        )
