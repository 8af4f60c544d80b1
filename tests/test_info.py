"""`python -m compass_kernels info`: short by default, the true reason when no GPU is
usable, the per-op evidence on request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import compass_kernels as ck
from compass_kernels import _info


def _run(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "compass_kernels", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def test_info_is_at_most_25_lines_and_says_what_matters():
    out = _run("info")
    lines = out.splitlines()
    assert len(lines) <= 25, out
    assert lines[0].startswith(f"compass_kernels {ck.__version__} ")
    for key in ("build:", "C++", "CUDA", "backends usable here:", "GPU:", "--verbose"):
        assert key in out, (key, out)
    if not torch.cuda.is_available():
        gpu = next(line for line in lines if line.startswith("GPU:"))
        assert "none usable: " in gpu and "insufficient" not in out, out


def test_verbose_and_json_keep_the_per_op_evidence():
    verbose = _run("info", "--verbose")
    d = json.loads(_run("info", "--json"))
    assert set(d["evidence"]) == set(ck.info()["evidence"])
    for op, backends in d["evidence"].items():
        for backend in backends:
            assert f"{op} [{backend}]:" in verbose


def _build(cuda: bool = True) -> dict:
    return {"cuda": cuda, "cudart_version": 13000 if cuda else None}


def _driver(loaded=True, cuda="13.0", init=0, devices=1) -> dict:
    return {"loaded": loaded, "cuda": cuda, "init": init, "devices": devices}


@pytest.mark.parametrize(
    "build, driver, expected",
    [
        (_build(), _driver(loaded=False, cuda=None, init=None, devices=0), "no NVIDIA driver"),
        (_build(), _driver(init=100, devices=0), "no CUDA device"),
        (_build(), _driver(devices=0), "no CUDA device"),
        (_build(), _driver(cuda="12.8"), "older than the CUDA 13.0 runtime"),
        (_build(), _driver(init=999), "cuInit error 999"),
        (_build(cuda=False), _driver(), "built without CUDA kernels"),
    ],
)
def test_no_gpu_reason_names_the_cause(build, driver, expected):
    reason = _info._no_gpu_reason(build, driver, False, "CUDA driver version is insufficient")
    assert expected in reason, reason
    assert "insufficient" not in reason, reason  # the runtime's misleading text is not the cause


def test_cpu_only_torch_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    reason = _info._no_gpu_reason(_build(), _driver(), False, "")
    assert f"torch {torch.__version__} is a CPU-only build" in reason


def test_a_new_enough_driver_is_not_blamed():
    """Driver 13.2 with runtime 13.0 (minor-version compatibility): not the cause."""
    reason = _info._no_gpu_reason(_build(), _driver(cuda="13.2"), False, "")
    assert "older" not in reason and "driver" not in reason, reason
