"""The build: ck.info() tells the truth, and the sm_90a code in compass_kernels._C
is what we think it is (compile-level checks, no GPU needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import compass_kernels as ck
from compass_kernels import _C
from tests import aot

BUILT_WITH_CUDA = bool(_C.build_info()["cuda"])
needs_cuda_build = pytest.mark.skipif(
    not BUILT_WITH_CUDA, reason="compass_kernels._C was built without CUDA (COMPASS_CUDA=OFF)"
)


def test_info_tells_the_truth():
    d = ck.info()
    assert d["version"] == ck.__version__ == d["compiled"]["version"]
    assert d["compiled"]["loaded"] and d["backends"]["cpp"]
    gpu = torch.cuda.is_available()
    assert d["cuda_device"]["usable"] == gpu
    assert d["backends"]["cuda"] == (gpu and BUILT_WITH_CUDA)
    if not gpu:
        assert d["cuda_device"]["count"] == 0 and d["cuda_device"]["reason"]
    interpreting = d["triton"]["interpreting"]
    assert d["backends"]["triton"] == (d["triton"]["installed"] and (gpu or interpreting))


def test_info_command_prints_json():
    out = subprocess.run(
        [sys.executable, "-m", "compass_kernels", "info", "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    d = json.loads(out)
    assert d["compiled"]["loaded"] is True and d["version"] == ck.__version__


@needs_cuda_build
def test_cuda_runtime_is_static():
    """Import works without a driver because cudart is linked in, not loaded."""
    ldd = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True).stdout
    assert "libcudart" not in ldd and "libcuda.so" not in ldd, ldd


def test_libstdcxx_is_shared():
    """A statically linked libstdc++ makes every C++ argument error crash Python in a
    process that also loads torch's (seen on a GPU image; setup.py refuses such a build)."""
    dyn = subprocess.run(
        ["readelf", "-d", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert "libstdc++.so" in dyn, dyn


@pytest.mark.sm90
@needs_cuda_build
def test_sm90a_kernels_are_built_without_spills():
    if not _C.build_info()["cutlass_include"]:  # a failure under COMPASS_REQUIRE_ALL_TIERS=1
        pytest.skip("built without CUTLASS headers (pip install --no-deps nvidia-cutlass)")
    usage = aot.resource_usage(_C.__file__, arch="sm_90a")
    aot.assert_no_spills(usage)  # every kernel of _C (per-kernel budgets: each capability's tests)
    names = " ".join(usage)
    # _C's device code is the CUTLASS grouped GEMM (its layout kernel and the GEMM);
    # every other GPU kernel is Triton
    assert "fill_group_layouts" in names, sorted(usage)
    assert not any("encode_kernel" in k or "grouped_args_kernel" in k for k in usage), sorted(usage)


@pytest.mark.sm90
@needs_cuda_build
def test_sm90a_kernels_have_no_device_asserts():
    """-DNDEBUG always: a device assert makes ptxas serialize wgmma (C7510)."""
    usage = aot.resource_usage(_C.__file__, arch="sm_90a")
    for name in usage:
        assert "__assertfail" not in aot.sass_of(_C.__file__, function=name), name


def _nvcc() -> str | None:
    for cand in (
        shutil.which("nvcc"),
        os.path.join(os.environ.get("CUDA_HOME", ""), "bin/nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.mark.sm90
@needs_cuda_build
def test_cutlass_headers_from_the_wheel_compile_for_sm90a(tmp_path):
    """The build found CUTLASS (nvidia-cutlass wheel), and its headers compile
    for sm_90a with this nvcc into Hopper's fp8 convert instruction."""
    include = _C.build_info()["cutlass_include"]
    if not include:  # a failure under COMPASS_REQUIRE_ALL_TIERS=1 (tests/conftest.py)
        pytest.skip("built without CUTLASS headers (pip install --no-deps nvidia-cutlass)")
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "probe.cu"
    src.write_text(
        "#include <cutlass/numeric_types.h>\n"
        "__global__ void to_e4m3(const float* x, cutlass::float_e4m3_t* y, int n) {\n"
        "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  if (i < n) y[i] = cutlass::float_e4m3_t(x[i]);\n"
        "}\n"
    )
    cubin = tmp_path / "probe.cubin"
    cmd = [
        nvcc,
        "-std=c++17",
        "-DNDEBUG",
        "-arch=sm_90a",
        "-cubin",
        f"-I{include}",
        "-o",
        str(cubin),
        str(src),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    aot.assert_sass_contains(aot.sass_of(cubin), r"F2FP\.SATFINITE\.E4M3", kernel="to_e4m3")
