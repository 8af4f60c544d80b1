"""ck.info(): what was built and what can run on this machine, truthfully."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

import torch

from compass_kernels import _emu
from compass_kernels._ext import BackendUnavailableError, load, triton_interpreting


def _triton() -> dict[str, Any]:
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False, "version": None, "interpreting": False}
    return {"installed": True, "version": version, "interpreting": triton_interpreting()}


def info() -> dict[str, Any]:
    """Version, compiled backends and archs, CUDA device usability, Triton state, and
    which CUDA kernels run under the emulator ("emulated" evidence, tests only).

    Returns a dict; ``python -m compass_kernels info`` prints it.
    """
    from compass_kernels import __version__

    out: dict[str, Any] = {
        "version": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    try:
        C = load()
        build = dict(C.build_info())
        count, reason = C.cuda_devices()
        out["compiled"] = {"loaded": True, **build}
    except BackendUnavailableError as err:
        build, count, reason = {"cuda": False}, 0, "compiled module not loaded"
        out["compiled"] = {"loaded": False, "error": str(err)}
    torch_cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(0) if torch_cuda else None
    out["cuda_device"] = {
        "usable": bool(torch_cuda and count > 0),
        "count": count,
        "name": torch.cuda.get_device_name(0) if torch_cuda else None,
        "capability": "sm_{}{}".format(*capability) if capability else None,
        "reason": reason or (None if torch_cuda else "torch sees no CUDA device"),
    }
    triton = _triton()
    out["triton"] = triton
    gpu = out["cuda_device"]["usable"]
    out["backends"] = {
        "cpp": out["compiled"]["loaded"],
        "cuda": bool(build.get("cuda")) and gpu,
        "triton": triton["installed"] and (gpu or triton["interpreting"]),
        "cuda-emulated": _emu.available(),
    }
    out["emulated"] = _emu.evidence()
    return out


def format_info(d: dict[str, Any] | None = None) -> str:
    d = d or info()
    lines = []
    for key, value in d.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {v}" for k, v in value.items())
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
