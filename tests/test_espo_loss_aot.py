"""The ESPO loss's Triton kernels compile ahead of time for sm_90a without a
GPU (tests.aot): every variant the wrappers launch for the default
ESPO, GSPO and GRPO configurations, with no register spills, float64
arithmetic kept in float64."""

from __future__ import annotations

from tests import triton_tier  # noqa: F401  (TRITON_INTERPRET before triton; triton required)

# isort: split

import pytest

from tests import aot

pytestmark = pytest.mark.sm90


@pytest.fixture(scope="module")
def artifacts():
    from compass_kernels.espo import triton_loss

    return [
        aot.compile_triton(k, sig, const, **opts)
        for k, sig, const, opts in triton_loss.aot_variants()
    ]


def test_every_variant_compiles_for_sm90a(artifacts):
    assert len(artifacts) == 10
    names = {a.name for a in artifacts}
    assert names == {"_sums_kernel", "_forward_kernel", "_reduce_kernel", "_backward_kernel"}
    for art in artifacts:
        assert art.arch == 90 and ".target sm_90a" in art.ptx


def test_no_spills_and_float64_math(artifacts):
    for art in artifacts:
        aot.assert_no_spills(art.resource_usage)
        aot.assert_registers_at_most(art.resource_usage, 255)
    forward = [a for a in artifacts if a.name == "_forward_kernel"]
    for art in forward:
        # the ratio and clip decision in float64 (exp through libdevice's f64 path)
        assert "fma.rn.f64" in art.ptx or "add.rn.f64" in art.ptx or "add.f64" in art.ptx
        assert "setp.lt.f64" in art.ptx or "setp.gt.f64" in art.ptx


@pytest.fixture(scope="module")
def cuda_usage():
    from compass_kernels._ext import load

    C = load()
    if not C.build_info()["cuda"]:  # a failure under COMPASS_REQUIRE_ALL_TIERS=1
        pytest.skip("compass_kernels._C was built without CUDA (COMPASS_CUDA=OFF or no nvcc)")
    usage = aot.resource_usage(C.__file__, arch="sm_90a")
    return C, {k: v for k, v in usage.items() if "4espo" in k}


def test_cuda_kernels_are_built_for_sm90a_without_spills(cuda_usage):
    """Every template variant the launcher instantiates: 2 dtypes x KMax in {1, 2, 8}
    for the two phases, 2 dtypes for the reduction and the backward."""
    _, usage = cuda_usage
    kinds = {}
    for k in usage:
        for kind in ("sums_kernel", "forward_kernel", "reduce_kernel", "backward_kernel"):
            if kind in k:
                kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds == {"sums_kernel": 6, "forward_kernel": 6, "reduce_kernel": 2,
                     "backward_kernel": 2}  # fmt: skip
    aot.assert_no_spills(usage)
    # K <= 2 (the default ESPO, GSPO, GRPO): <= 96 registers, 2+ blocks of 256 per SM.
    small = {k: v for k, v in usage.items() if "Li8E" not in k}
    aot.assert_registers_at_most(small, 96)
    aot.assert_registers_at_most(usage, 168)


def test_cuda_forward_sass_is_float64_with_shuffle_trees(cuda_usage):
    C, usage = cuda_usage
    fwd = next(k for k in usage if "forward_kernelIfLi2E" in k)
    sass = aot.sass_of(C.__file__, function=fwd)
    aot.assert_sass_contains(sass, r"\bD(ADD|FMA|MUL)\b", kernel=fwd)
    aot.assert_sass_contains(sass, r"SHFL\.BFLY", kernel=fwd)
    assert "__assertfail" not in sass
