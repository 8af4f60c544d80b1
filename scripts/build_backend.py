"""The PEP 517 build backend: setuptools', plus the CUTLASS headers when CUDA is built.

pyproject.toml names this module (``backend-path = ["scripts"]``). It changes one
thing: when the build will compile the CUDA kernels (nvcc found, COMPASS_CUDA not
OFF) and no CUTLASS headers are at hand (COMPASS_CUTLASS_INCLUDE unset, no
importable ``cutlass_library``), the build asks its frontend for
``nvidia-cutlass`` (the headers ship in that wheel), so `pip install .` with the
default build isolation gets the CUTLASS sm_90a kernels with no variable set. A
machine without nvcc asks for nothing more than the static build requirements.

setup.py shares :func:`find_nvcc` and :func:`cutlass_include`, so the two agree
on whether CUDA is built and where the headers are.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

try:
    from setuptools import build_meta as _setuptools
    from setuptools.build_meta import *  # noqa: F403  (the PEP 517 hooks we do not change)
except ModuleNotFoundError:
    # scripts/setup_env.sh imports the helpers below (CUTLASS_REQUIREMENT, cuda_mode,
    # usable_nvcc) before anything is installed: a fresh Python 3.12 venv has no
    # setuptools. A build frontend installs it (build-system.requires) before any hook.
    _setuptools = None


def _backend():
    if _setuptools is None:
        raise RuntimeError(
            "scripts/build_backend.py: setuptools is not installed; a PEP 517 frontend "
            "installs pyproject.toml's build-system.requires first (pip install setuptools)"
        )
    return _setuptools


#: The CUTLASS release the sm_90a kernels are built and tested with (headers only;
#: the wheel's Python dependencies come along into the isolated build environment
#: and are not used).
CUTLASS_REQUIREMENT = "nvidia-cutlass==4.2.0.0"


def find_nvcc() -> str | None:
    """The nvcc the build uses: CUDACXX, then $CUDA_HOME/bin, PATH, /usr/local/cuda/bin."""
    for cand in (
        os.environ.get("CUDACXX"),
        os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
        shutil.which("nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


#: The oldest CUDA toolkit that can build the kernels at all (sm_90a needs 12.0); the
#: one built and tested is 13.0.
MIN_CUDA = (12, 0)


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) from ``nvcc --version``, None if it does not run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return (int(m[1]), int(m[2])) if m else None


def usable_nvcc() -> tuple[str | None, str | None]:
    """(nvcc, why not): the nvcc AUTO / ON builds with, or None and the reason."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None, "no nvcc found (CUDACXX, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin)"
    version = nvcc_version(nvcc)
    if version is None:
        return None, f"{nvcc} --version does not run"
    if version < MIN_CUDA:
        return None, (
            f"{nvcc} is CUDA {version[0]}.{version[1]}; the kernels need CUDA "
            f"{MIN_CUDA[0]}.{MIN_CUDA[1]} or newer (built and tested: 13.0)"
        )
    return nvcc, None


def cuda_mode() -> str:
    """COMPASS_CUDA: AUTO (default: CUDA when nvcc is found), ON or OFF."""
    mode = os.environ.get("COMPASS_CUDA", "AUTO").upper()
    if mode not in ("AUTO", "ON", "OFF"):
        raise RuntimeError(f"COMPASS_CUDA must be AUTO, ON or OFF, got {mode!r}")
    return mode


def cutlass_include() -> str | None:
    """The CUTLASS include folder: COMPASS_CUTLASS_INCLUDE, else the nvidia-cutlass wheel's."""
    if os.environ.get("COMPASS_CUTLASS_INCLUDE"):
        return os.environ["COMPASS_CUTLASS_INCLUDE"]
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return str(inc) if (inc / "cutlass" / "cutlass.h").exists() else None


def _cutlass_requirements() -> list[str]:
    if cuda_mode() == "OFF" or usable_nvcc()[0] is None or cutlass_include() is not None:
        return []
    return [CUTLASS_REQUIREMENT]


def get_requires_for_build_wheel(config_settings=None):
    return _backend().get_requires_for_build_wheel(config_settings) + _cutlass_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _backend().get_requires_for_build_editable(config_settings) + _cutlass_requirements()
