"""Build compass_kernels._C with CMake.

Knobs (environment variables):
  COMPASS_CUDA        AUTO (default: CUDA when nvcc is found) | ON | OFF
  COMPASS_CUDA_ARCHS  CUDA architectures for the generic kernels (default "80;90a": A100/L40/H100
                      get the generic kernels; Hopper-only kernels are always sm_90a)
  COMPASS_BUILD_TYPE  Release (default) | RelWithDebInfo | Debug
  CUDACXX / CUDA_HOME where nvcc lives (otherwise PATH, then /usr/local/cuda)
  MAX_JOBS            parallel compile jobs (default: number of CPUs)
  COMPASS_CUTLASS_INCLUDE  CUTLASS headers (default: the nvidia-cutlass wheel, which the
                      build backend, scripts/build_backend.py, adds to an isolated build
                      when nvcc is found); without them the CUTLASS kernel is left out
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# The build backend (pyproject's backend-path) shares how nvcc and CUTLASS are found.
sys.path.insert(0, str(ROOT / "scripts"))
from build_backend import CUTLASS_REQUIREMENT, cuda_mode, cutlass_include, usable_nvcc  # noqa: E402


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        t0 = time.perf_counter()
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = _build_dir(ext.name)
        build_temp.mkdir(parents=True, exist_ok=True)
        lib_dir = build_temp / "lib"

        mode = cuda_mode()
        nvcc, no_cuda = usable_nvcc() if mode != "OFF" else (None, "COMPASS_CUDA=OFF")
        if mode == "ON" and nvcc is None:
            raise RuntimeError(f"COMPASS_CUDA=ON but {no_cuda} (set CUDACXX or CUDA_HOME)")

        args = [
            # a fixed folder: pip hands each build a new out_dir, and a changed
            # output path relinks the module (~30 s with the device code) for nothing
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('COMPASS_BUILD_TYPE', 'Release')}",
            f"-DCOMPASS_CUDA={'ON' if nvcc else 'OFF'}",
            f"-DCOMPASS_CUDA_ARCHS={os.environ.get('COMPASS_CUDA_ARCHS', '80;90a')}",
            f"-DCOMPASS_VERSION={self.distribution.get_version()}",
        ]
        if nvcc:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        cutlass = cutlass_include() if nvcc else None
        # "" clears a path an earlier configure of this build folder cached
        args.append(f"-DCOMPASS_CUTLASS_INCLUDE={cutlass or ''}")
        # The build tools from the Python environment first (pyproject's build
        # requirements), not whatever PATH lists first: with another cmake or
        # ninja the same build folder is regenerated and recompiled from scratch
        # (seen: setup_env's activated venv vs a bare `make build`).
        ninja = _py_tool("ninja", "BIN_DIR", "ninja") or shutil.which("ninja")
        cmake = _py_tool("cmake", "CMAKE_BIN_DIR", "cmake") or shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found: pip install 'cmake>=3.25' (a build requirement)")
        if ninja:
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)

        subprocess.check_call([cmake, str(ROOT), *args], cwd=build_temp)
        subprocess.check_call([cmake, "--build", ".", "--parallel", jobs], cwd=build_temp)
        out_dir.mkdir(parents=True, exist_ok=True)
        so = Path(self.get_ext_fullpath(ext.name)).name
        if (lib_dir / so).resolve() != (out_dir / so).resolve():
            shutil.copy2(lib_dir / so, out_dir / so)
        _check_shared_libstdcxx(Path(self.get_ext_fullpath(ext.name)))
        print(
            f"[compass_kernels] built {ext.name} in {time.perf_counter() - t0:.1f} s "
            f"(CUDA: {'nvcc ' + nvcc if nvcc else 'off'}, MAX_JOBS={jobs})",
            flush=True,
        )
        for line in _build_warnings(no_cuda, nvcc, cutlass):
            print(f"[compass_kernels] WARNING: {line}", flush=True)


def _build_warnings(no_cuda: str | None, nvcc: str | None, cutlass: str | None) -> list[str]:
    """What this build left out and how to get it (printed last in the build log)."""
    if nvcc is None and no_cuda == "COMPASS_CUDA=OFF":
        return ["CUDA kernels not built (COMPASS_CUDA=OFF): CPU kernels only."]
    if nvcc is None:
        return [
            f"CUDA kernels not built: {no_cuda}. CPU kernels only; the Triton kernels need no "
            "build. To get the CUDA kernels, install the CUDA toolkit (13.0; no GPU needed to "
            "build) and reinstall: pip install --force-reinstall --no-deps ."
        ]
    if cutlass is None:
        return [
            "the CUTLASS sm_90a grouped GEMM (ck.fp8.grouped_gemm, backend 'cuda') is not "
            "built: no CUTLASS headers. Its calls raise BackendUnavailableError. To build it, "
            f"reinstall with build isolation (it adds {CUTLASS_REQUIREMENT}), or install that "
            "package, or set COMPASS_CUTLASS_INCLUDE to a CUTLASS include folder."
        ]
    return []


def _build_dir(ext_name: str) -> Path:
    """The CMake/ninja build folder: persistent, so every build after the first is incremental.

    setuptools hands editable installs and wheel builds a fresh temporary
    build_temp, which recompiled everything (the CUTLASS translation units
    included, minutes each) on every `pip install -e .`. One folder per Python
    environment (sys.prefix) under build/ (COMPASS_BUILD_DIR overrides it): `make build`,
    `setup.py build_ext --inplace` and `pip wheel --no-build-isolation` from the
    same venv share it, and ninja rebuilds only what changed.
    """
    if os.environ.get("COMPASS_BUILD_DIR"):
        return Path(os.environ["COMPASS_BUILD_DIR"]).resolve() / ext_name
    tag = hashlib.sha256(os.path.abspath(sys.prefix).encode()).hexdigest()[:10]
    return ROOT / "build" / f"cmake-py{sys.version_info[0]}{sys.version_info[1]}-{tag}" / ext_name


def _check_shared_libstdcxx(so: Path) -> None:
    """Refuse a module that links libstdc++ statically.

    Some toolchains (seen: a wrapper g++ in /opt/gcc on a GPU image, picked up
    through CXX / CUDAHOSTCXX) link libstdc++ into the module. In a process that
    also loads torch's shared libstdc++, a C++ exception thrown by our argument
    checks then crashes the interpreter (SIGSEGV) instead of raising ValueError.
    """
    readelf = shutil.which("readelf")
    if readelf is None:
        raise RuntimeError("readelf (binutils) not found: needed to check how _C links libstdc++")
    dyn = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True)
    if "libstdc++.so" not in dyn.stdout:
        raise RuntimeError(
            f"{so.name} links libstdc++ statically (compiler: CXX={os.environ.get('CXX', 'c++')}, "
            f"CUDAHOSTCXX={os.environ.get('CUDAHOSTCXX', '-')}): C++ errors would crash Python "
            "instead of raising. Build with a compiler that links the shared libstdc++, e.g. "
            "CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++."
        )


def _py_tool(module: str, bin_dir: str, name: str) -> str | None:
    """A build tool a Python package ships (ninja.BIN_DIR, cmake.CMAKE_BIN_DIR), if installed."""
    try:
        path = os.path.join(getattr(importlib.import_module(module), bin_dir), name)
    except (ImportError, AttributeError):
        return None
    return path if os.path.exists(path) else None


setup(
    ext_modules=[CMakeExtension("compass_kernels._C")],
    cmdclass={"build_ext": CMakeBuild},
)
