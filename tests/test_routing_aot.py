"""ck.routing's Triton kernels compile for sm_90 ahead of time (the variants the
wrappers launch for DeepSeek-V3 and Qwen3-MoE shapes) with no register spills."""

from __future__ import annotations

from tests import triton_tier  # noqa: F401  (TRITON_INTERPRET before triton; triton required)

# isort: split

import pytest

from tests import aot
from tests.triton_tier import needs_cuobjdump

pytestmark = pytest.mark.sm90


@needs_cuobjdump
def test_routing_kernels_compile_without_spills():
    from compass_kernels.routing import triton as kt

    variants = kt.aot_variants()
    arts = [aot.compile_triton(k, sig, const, **opts) for k, sig, const, opts in variants]
    assert len(arts) == 4
    for art in arts:
        aot.assert_no_spills(art.resource_usage)
        aot.assert_registers_at_most(art.resource_usage, 255)
    # the gather of replayed logits is an indexed global load, no local memory
    assert "ld.global" in arts[0].ptx and "atom.global" in arts[0].ptx


@needs_cuobjdump
def test_codec_cuda_kernels_are_built_without_spills():
    """csrc/routing/codec.cu in _C (sm_90a): the table kernel and every (dtype,
    top_k) encode instantiation present; no spills, no stack or local memory
    (the generic K <= 64 kernel re-reads the row instead of a local array)."""
    from compass_kernels._ext import has_cuda_kernels, load

    if not has_cuda_kernels():
        pytest.skip("built without CUDA")
    usage = aot.resource_usage(load().__file__, arch="sm_90a")
    enc = {k: v for k, v in usage.items() if "encode_kernel" in k and "routing" in k}
    table = [k for k in usage if "table_kernel" in k and "routing" in k]
    assert len(enc) == 2 * 6 and len(table) == 1  # uint8/int16 x K in {1, 2, 4, 6, 8, any}
    aot.assert_no_spills(enc)
    aot.assert_registers_at_most(enc, 64)
    aot.assert_no_spills({k: usage[k] for k in table})
