"""ck.routing's Triton kernels (replay, the set encoder) compile for sm_90 ahead of
time (the variants the wrappers launch for DeepSeek-V3 and Qwen3-MoE shapes) with
no register spills."""

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
def test_set_encoder_compiles_without_spills():
    """The set encoder's Triton kernels (routing/triton_setcode.py) as launched
    for DeepSeek-V3 (E=256, K=8, uint8 ids, missing rows), Qwen3-MoE (E=128,
    K=8) and a G > 1 layout (E=8, K=2; int16 ids): no spills; the status
    atomics and the table gathers are global memory operations."""
    from compass_kernels.routing import triton_setcode as ts

    arts = [aot.compile_triton(k, sig, const, **opts) for k, sig, const, opts in ts.aot_variants()]
    assert len(arts) == 4
    for art in arts:
        aot.assert_no_spills(art.resource_usage)
        aot.assert_registers_at_most(art.resource_usage, 255)
    assert "atom.global" in arts[1].ptx and "ld.global" in arts[1].ptx
