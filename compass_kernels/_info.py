"""ck.info(): what was built and what can run on this machine, truthfully."""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

import torch

from compass_kernels._ext import BackendUnavailableError, load, triton_interpreting


def _triton() -> dict[str, Any]:
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False, "version": None, "interpreting": False}
    return {"installed": True, "version": version, "interpreting": triton_interpreting()}


# What each kind of backend is verified by, without a GPU (see docs/design.md,
# "Verification levels"); GPU runs come from the committed reports.
_STATIC_EVIDENCE = {
    "torch": ["the plain-torch reference: tested against the loop-level spec on CPU"],
    "cpp": ["reference-tested on CPU"],
    "triton": ["interpreter-run on CPU", "AOT-compiled for sm_90 (ptxas spills checked)"],
    "cuda": ["compiled for {archs} (SASS and ptxas resources checked)"],
    "cuda-emulated": ["emulated on CPU (SIMT emulation of the .cu source)"],
}


def evidence() -> dict[str, dict[str, list[str]]]:
    """Per registered op and backend, the evidence that it computes the right thing:
    reference-tested on CPU, interpreter-run, emulated, compiled for an arch, or
    run on a GPU (date, device, tests passed: from docs/gpu_runs via
    compass_kernels/gpu_evidence.json)."""
    from compass_kernels._ext import compiled_cuda_archs, has_cuda_kernels
    from compass_kernels._op import OPS

    gpu = json.loads((Path(__file__).parent / "gpu_evidence.json").read_text())
    archs = "sm_" + ", sm_".join(compiled_cuda_archs()) if has_cuda_kernels() else None
    out: dict[str, dict[str, list[str]]] = {}
    for name, op in OPS.items():
        if name.startswith("test_only_"):
            continue
        per = out[name] = {}
        for backend in op.backends:
            levels = [lv.format(archs=archs) for lv in _STATIC_EVIDENCE.get(backend, [])]
            if backend == "cuda" and archs is None:
                levels = ["not built (COMPASS_CUDA=OFF or no nvcc)"]
            if backend == "cuda" and "cuda-emulated" in op.backends:
                levels += _STATIC_EVIDENCE["cuda-emulated"]
            for run in gpu.get(name, {}).get(backend, []):
                tests = f"{run['passed']} passed / {run['failed']} failed"
                levels.append(
                    f"run on a GPU: {run['device']}, {run['date']}, {tests} ({run['run']})"
                )
            per[backend] = levels
    return out


def info() -> dict[str, Any]:
    """Version, compiled backends and archs, CUDA device usability, Triton state, and
    the evidence per op and backend.

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
        "torch": True,
        "cpp": out["compiled"]["loaded"],
        "cuda": bool(build.get("cuda")) and gpu,
        "triton": triton["installed"] and (gpu or triton["interpreting"]),
    }
    out["evidence"] = evidence()
    return out


def format_info(d: dict[str, Any] | None = None) -> str:
    d = d or info()
    lines = []
    for key, value in d.items():
        if key == "evidence":
            lines.append("evidence:")
            for op, backends in value.items():
                for backend, levels in backends.items():
                    lines.append(f"  {op} [{backend}]:")
                    lines.extend(f"    - {lv}" for lv in levels)
        elif isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {v}" for k, v in value.items())
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
