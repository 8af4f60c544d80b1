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
    assert len(artifacts) == 12
    names = {a.name for a in artifacts}
    assert names == {
        "_sums_kernel",
        "_forward_kernel",
        "_combine_kernel",
        "_reduce_kernel",
        "_backward_kernel",
    }
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
