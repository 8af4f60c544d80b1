"""ck.fp8 compile-level checks for sm_90a without a GPU: the CUDA kernels in
_C (no spills, register budgets that keep two 256-thread CTAs per SM, the
integer e4m3 conversion and IEEE division in the SASS) and every Triton
variant the wrappers launch (no spills, no approximate division, no fused
multiply-add in the combine)."""

from __future__ import annotations

from tests import triton_tier  # noqa: F401  (TRITON_INTERPRET before triton; triton required)

# isort: split

import pytest

from compass_kernels import _C
from tests import aot

pytestmark = pytest.mark.sm90

BUILT_WITH_CUDA = bool(_C.build_info()["cuda"])
needs_cuda_build = pytest.mark.skipif(
    not BUILT_WITH_CUDA, reason="compass_kernels._C was built without CUDA (COMPASS_CUDA=OFF)"
)


def _fp8_usage():
    usage = aot.resource_usage(_C.__file__, arch="sm_90a")
    return {k: v for k, v in usage.items() if "3fp8" in k}


@needs_cuda_build
def test_fp8_cuda_kernels_are_built_without_spills():
    usage = _fp8_usage()
    kinds = {
        kind
        for k in usage
        for kind in ("quantize_block_kernel", "quantize_group_kernel", "permute_rank_kernel",
                     "permute_scan_kernel", "permute_scatter_kernel", "unpermute_kernel")
        if kind in k
    }  # fmt: skip
    assert len(kinds) == 6, kinds
    # 3 dtypes x 2 conventions x 2 tilings; 2 id dtypes x (rank + 3 scatter); scan; 2 unpermute
    assert len(usage) == 12 + 8 + 1 + 2, sorted(usage)
    aot.assert_no_spills(usage)
    # __launch_bounds__(256, 2): a 128x128 block held in registers, two CTAs per SM.
    aot.assert_registers_at_most({k: v for k, v in usage.items() if "block" in k}, 128)
    aot.assert_registers_at_most({k: v for k, v in usage.items() if "block" not in k}, 64)


@needs_cuda_build
def test_fp8_sass_has_ieee_division_and_no_asserts():
    usage = _fp8_usage()
    group = next(k for k in usage if "quantize_group_kernelINS_8fp8_math8Bf16BitsELb1E" in k)
    sass = aot.sass_of(_C.__file__, function=group)
    # x / s is IEEE (prec-div): a reciprocal estimate refined by FFMA, with the
    # slow-path call; a fast approximate division would be a bare MUFU.RCP + FMUL.
    aot.assert_sass_contains(sass, r"MUFU\.RCP", kernel=group)
    aot.assert_sass_contains(sass, r"SHFL\.BFLY", kernel=group)
    assert "__assertfail" not in sass


def test_fp8_triton_variants_compile_for_sm90():
    from compass_kernels.fp8 import triton as kt

    arts = [aot.compile_triton(k, sig, const, **opts) for k, sig, const, opts in kt.aot_variants()]
    assert len(arts) == 9  # 4 quantize, rank, offsets scan + offsets, scatter, unpermute
    for art in arts:
        aot.assert_no_spills(art.resource_usage)
        aot.assert_registers_at_most(art.resource_usage, 255)
        # div_rn is IEEE division; '/' would lower to div.full.f32 (approximate).
        assert "div.full.f32" not in art.ptx
    quant = arts[0].ptx
    assert "div.rn.f32" in quant, "scale = amax / 448 must be IEEE division"
    unpermute = arts[-1].ptx
    assert "fma.rn.f32" not in unpermute, "the combine must not contract into FMA"
