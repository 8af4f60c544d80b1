"""The build: ck.info() tells the truth, and the sm_90a code in compass_kernels._C
is what we think it is (compile-level checks, no GPU needed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import compass_kernels as ck
from compass_kernels import _C, aot

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


@pytest.mark.sm90
@needs_cuda_build
def test_sm90a_kernels_are_built_without_spills():
    usage = aot.resource_usage(_C.__file__, arch="sm_90a")
    names = {re.search(r"(group_kernel|zvp_kernel)I(\w+?)E", k).group(0) for k in usage}
    # 2 reward dtypes for the group kernel; 2 x 2 (rewards, advantages) for RL-ZVP
    assert names == {
        "group_kernelIfE", "group_kernelIdE",
        "zvp_kernelIffE", "zvp_kernelIfdE", "zvp_kernelIdfE", "zvp_kernelIddE",
    }  # fmt: skip
    aot.assert_no_spills(usage)
    aot.assert_registers_at_most(usage, 64)


@pytest.mark.sm90
@needs_cuda_build
def test_sm90a_sass_has_the_expected_math():
    """Statistics in float64 (DADD/DFMA), warp-shuffle reductions, no device asserts."""
    usage = aot.resource_usage(_C.__file__, arch="sm_90a")
    group = next(k for k in usage if "group_kernelIfE" in k)
    sass = aot.sass_of(_C.__file__, function=group)
    aot.assert_sass_contains(sass, r"\bDADD\b", kernel=group)
    aot.assert_sass_contains(sass, r"SHFL\.BFLY", kernel=group)
    assert "__assertfail" not in sass, "device assert in a hot kernel: build with -DNDEBUG"
