"""The build backend (scripts/build_backend.py): what an isolated `pip install .` asks
for, and which nvcc it builds with. No compiler runs: nvcc is a stub script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build_backend as bb  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


def test_pyproject_names_the_backend():
    build = (ROOT / "pyproject.toml").read_text().split("[build-system]")[1].split("\n[")[0]
    assert 'build-backend = "build_backend"' in build and 'backend-path = ["scripts"]' in build
    assert "cutlass" not in build.split("requires")[1].split("\n")[0]  # CPU-only: not asked


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    def make(release: str) -> Path:
        nvcc = tmp_path / "bin" / "nvcc"
        nvcc.parent.mkdir(exist_ok=True)
        nvcc.write_text(
            f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n"
        )
        nvcc.chmod(0o755)
        monkeypatch.setenv("CUDACXX", str(nvcc))
        return nvcc

    for var in ("COMPASS_CUDA", "COMPASS_CUTLASS_INCLUDE"):
        monkeypatch.delenv(var, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        bb.importlib.util, "find_spec", lambda n, *a: None if n == "cutlass_library" else real(n)
    )
    return make


def test_nvcc_without_cutlass_headers_asks_for_nvidia_cutlass(fake_nvcc, monkeypatch):
    nvcc = fake_nvcc("13.0")
    assert bb.usable_nvcc() == (str(nvcc), None)
    assert bb._cutlass_requirements() == [bb.CUTLASS_REQUIREMENT]
    monkeypatch.setenv("COMPASS_CUTLASS_INCLUDE", "/opt/cutlass/include")
    assert bb._cutlass_requirements() == []
    monkeypatch.delenv("COMPASS_CUTLASS_INCLUDE")
    monkeypatch.setenv("COMPASS_CUDA", "OFF")
    assert bb._cutlass_requirements() == []


def test_an_nvcc_too_old_for_sm90a_is_not_used(fake_nvcc):
    fake_nvcc("11.8")
    nvcc, why = bb.usable_nvcc()
    assert nvcc is None and "CUDA 11.8" in why and "12.0 or newer" in why
    assert bb._cutlass_requirements() == []


def test_bad_cuda_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("COMPASS_CUDA", "maybe")
    with pytest.raises(RuntimeError, match="COMPASS_CUDA must be AUTO, ON or OFF"):
        bb.cuda_mode()
