"""ck.info(): what was built and what can run on this machine, truthfully."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import platform
import re
import textwrap
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
}


def evidence() -> dict[str, dict[str, list[str]]]:
    """Per registered op and backend, the evidence that it computes the right thing:
    reference-tested on CPU, interpreter-run, compiled for an arch, or
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
    usable = bool(torch_cuda and count > 0)
    driver = _driver()
    out["cuda_device"] = {
        "usable": usable,
        "count": count,
        "name": torch.cuda.get_device_name(0) if torch_cuda else None,
        "capability": "sm_{}{}".format(*capability) if capability else None,
        "driver_cuda": driver.get("cuda"),
        "reason": None if usable else _no_gpu_reason(build, driver, torch_cuda, reason),
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


def _version(code: int | None) -> str | None:
    """CUDA's integer version (13000) as text ("13.0")."""
    return None if not code else f"{code // 1000}.{code % 1000 // 10}"


def _driver() -> dict[str, Any]:
    """The NVIDIA driver as the CUDA driver API sees it (no torch, no runtime):
    ``{"loaded": bool, "cuda": "13.0" | None, "init": CUresult | None, "devices": int}``."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {"loaded": False, "cuda": None, "init": None, "devices": 0}
    version = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(version))
    init = lib.cuInit(0)
    devices = ctypes.c_int(0)
    if init == 0:
        lib.cuDeviceGetCount(ctypes.byref(devices))
    return {"loaded": True, "cuda": _version(version.value), "init": init, "devices": devices.value}


def _no_gpu_reason(build: dict, driver: dict, torch_cuda: bool, runtime_reason: str) -> str:
    """Why no CUDA kernel can run here, every cause that applies, most basic first:
    no driver, no device, a driver older than the runtime, a CPU-only torch, a build
    without CUDA kernels."""
    reasons = []
    runtime = _version(build.get("cudart_version"))
    if not driver["loaded"]:
        reasons.append("no NVIDIA driver (libcuda.so.1 not found)")
    elif driver["init"] == 100 or (driver["init"] == 0 and driver["devices"] == 0):
        reasons.append(f"no CUDA device (driver for CUDA {driver['cuda']} sees none)")
    elif (
        runtime
        and driver["cuda"]
        and int(driver["cuda"].split(".")[0]) < int(runtime.split(".")[0])
    ):
        reasons.append(
            f"NVIDIA driver supports CUDA {driver['cuda']}, older than the CUDA {runtime} runtime "
            f"compass_kernels was built with: update the driver"
        )
    elif driver["init"] not in (0, None):
        reasons.append(f"the CUDA driver failed to initialize (cuInit error {driver['init']})")
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    elif not torch_cuda and not reasons:
        reasons.append(f"torch (CUDA {torch.version.cuda}) sees no CUDA device")
    if not build.get("cuda"):
        reasons.append("compass_kernels was built without CUDA kernels (no nvcc at build time)")
    elif not reasons and runtime_reason:
        reasons.append(runtime_reason)
    return "; ".join(reasons) or "unknown"


_OPENMP = {201511: "4.5", 201811: "5.0", 202011: "5.1", 202111: "5.2"}


def _build_lines(c: dict[str, Any]) -> list[str]:
    if not c.get("loaded"):
        return [f"  not loaded: {c.get('error')}"]
    openmp = c.get("openmp")
    omp = None if openmp is None else _OPENMP.get(openmp, openmp)
    lines = [f"  C++       {c['cxx_compiler']}, OpenMP {omp}, {c['omp_max_threads']} threads"]
    if c["cuda"]:
        archs = ", ".join(f"sm_{a}" for a in c["cuda_archs"].split(",") if a)
        lines.append(
            f"  CUDA      nvcc {c['nvcc_version']} (runtime {_version(c['cudart_version'])}, "
            f"static), {archs}"
        )
        lines.append(
            f"  CUTLASS   {c['cutlass_version']} (sm_90a FP8 grouped GEMM)"
            if c.get("cutlass_version")
            else "  CUTLASS   not built (no headers at build time): ck.fp8.grouped_gemm's cuda "
            "backend is missing"
        )
    else:
        lines.append(
            "  CUDA      not built (no nvcc at build time): install the CUDA toolkit and "
            "reinstall from source"
        )
    return lines


def _backend_lines(d: dict[str, Any]) -> list[str]:
    gpu, triton, backends = d["cuda_device"], d["triton"], d["backends"]
    why_not: dict[str, str] = {
        "cpp": "compiled module not loaded",
        "cuda": "not built" if not d["compiled"].get("cuda") else "no usable GPU (see GPU)",
        "triton": "not installed (pip install triton)"
        if not triton["installed"]
        else "no usable GPU; TRITON_INTERPRET=1 runs it on CPU tensors",
    }
    how = {
        "torch": "the plain-torch reference, any device",
        "cpp": "CPU tensors",
        "cuda": f"CUDA tensors on {gpu['name']}",
        "triton": "CPU tensors, interpreter (TRITON_INTERPRET=1)"
        if triton["interpreting"] and not gpu["usable"]
        else "CUDA tensors",
    }
    lines = []
    for name, ok in backends.items():
        state = (
            f"yes: {how.get(name, 'usable')}" if ok else f"no: {why_not.get(name, 'unavailable')}"
        )
        lines.append(f"  {name:<14}{state}")
    return lines


def format_info(d: dict[str, Any] | None = None, verbose: bool = False) -> str:
    """``python -m compass_kernels info``: at most 25 lines (version, build, backends
    usable here, GPU status with its reason); ``verbose`` adds every key and the per-op
    evidence."""
    d = d or info()
    if verbose:
        return _format_all(d)
    gpu = d["cuda_device"]
    lines = [
        f"compass_kernels {d['version']} (Python {d['python']}, torch {d['torch']})",
        "build:",
        *_build_lines(d["compiled"]),
        "backends usable here:",
        *_backend_lines(d),
        (
            f"GPU: {gpu['count']} x {gpu['name']} ({gpu['capability']})"
            if gpu["usable"]
            else f"GPU: none usable: {gpu['reason']}"
        ),
        f"ops: {len(d['evidence'])} registered; per-op evidence: python -m compass_kernels "
        "info --verbose (or --json)",
    ]
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="    ") for line in lines)


def _format_all(d: dict[str, Any]) -> str:
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


#: Column order of the README's status matrix (backends present in some op's evidence;
#: others follow by name).
MATRIX_BACKENDS = ("torch", "cpp", "cuda", "triton")
_GPU_RUN = re.compile(
    r"run on a GPU: (?:NVIDIA )?(\S+).*?, (\d{4}-\d\d-\d\d), (\d+) passed / (\d+) failed"
)


def _status_cell(levels: list[str] | None) -> str:
    """The strongest evidence of one (op, backend), in one word or phrase: a passing
    GPU run ("ran on H100 2026-11-23", the latest), "interpreter",
    "compiled", "reference-tested", "not built"; "-" where the op has no such backend."""
    if levels is None:
        return "-"
    runs = [m for m in map(_GPU_RUN.match, levels) if m and int(m[3]) > 0 and m[4] == "0"]
    if runs:
        latest = max(runs, key=lambda m: m[2])
        return f"ran on {latest[1]} {latest[2]}"
    for word, key in (
        ("interpreter", "interpreter-run"),
        ("compiled", "compiled for"),
        ("reference-tested", "reference-tested"),
        ("reference", "the plain-torch reference"),
        ("not built", "not built"),
    ):
        if any(lv.startswith(key) for lv in levels):
            return word
    return "-"


def status_matrix(evidence: dict[str, dict[str, list[str]]] | None = None) -> str:
    """The README's status matrix (markdown): one row per registered op, one column per
    backend any op has (in :data:`MATRIX_BACKENDS` order), each cell the strongest
    evidence that the backend computes the op right (:func:`_status_cell`), from
    :func:`evidence`.
    ``scripts/readme_matrix.py --write`` puts it in README.md; tests/test_readme.py
    checks the two agree."""
    evidence = evidence if evidence is not None else globals()["evidence"]()
    present = {b for per in evidence.values() for b in per}
    columns = [b for b in MATRIX_BACKENDS if b in present]
    columns += sorted(present - set(MATRIX_BACKENDS))
    lines = [
        "| op | " + " | ".join(f"`{b}`" for b in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for op, per in evidence.items():
        cells = [_status_cell(per.get(b)) for b in columns]
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
