"""ck.fp8 compile-level checks for sm_90a without a GPU: every Triton variant
the wrappers launch (no spills, no approximate division, no fused
multiply-add in the combine), and the grouped GEMM's argument builder. The
quantize / permute kernels and the argument builder are Triton only (the
CUTLASS GEMM's checks: test_fp8_gemm_cutlass.py)."""

from __future__ import annotations

from tests import triton_tier  # noqa: F401  (TRITON_INTERPRET before triton; triton required)

# isort: split

import pytest

from tests import aot

pytestmark = pytest.mark.sm90


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


def test_grouped_gemm_argument_builder_compiles_for_sm90():
    """The CUTLASS path's device-side argument builder (fp8/triton_args.py), as
    launched: no spills, a handful of registers, int64 address arithmetic."""
    from compass_kernels.fp8 import triton_args

    (art,) = [
        aot.compile_triton(k, sig, const, **opts)
        for k, sig, const, opts in triton_args.aot_variants()
    ]
    aot.assert_no_spills(art.resource_usage)
    aot.assert_registers_at_most(art.resource_usage, 64)
    assert "st.global" in art.ptx
    assert "mad.lo.s64" in art.ptx or "mul.lo.s64" in art.ptx
