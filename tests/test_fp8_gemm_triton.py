"""The Triton FP8 grouped GEMM beyond the shared backend tests (tests/test_fp8_gemm.py):
its persistent device-side schedule, its fp32 promotion under Hopper's
reduced-precision fp8 accumulation (emulated in the interpreter), and its
sm_90a code (FP8 wgmma / QGMMA, no spills, shared memory within the limit).
"""

from __future__ import annotations

from tests.triton_tier import INTERPRET

# isort: split

import pytest
import torch

from compass_kernels.fp8 import triton_gemm as tg
from compass_kernels.fp8.reference_gemm import (
    grouped_gemm_abs_reference,
    grouped_gemm_reference,
)
from compass_kernels.testing import assert_bitwise_equal, empty_poisoned
from tests import aot
from tests.fp8_gemm_cases import COUNTS, check_close, make_problem, offsets_of
from tests.tiers import INTERPRETER_ONLY

pytestmark = pytest.mark.triton


def _launch(args, *, out_dtype=1, **kw):
    m, n = args[0].shape[0], args[2].shape[1]
    out = empty_poisoned((m, n), torch.float32 if out_dtype else torch.bfloat16)
    names = ("a_q", "a_scales", "b_q", "b_scales", "expert_offsets")
    tg.grouped_gemm_triton(
        **dict(zip(names, args, strict=True)), out_dtype=out_dtype, out=out, **kw
    )
    return out


@pytest.mark.skipif(not INTERPRET, reason=INTERPRETER_ONLY)
@pytest.mark.parametrize("block_m", [64, 128])
def test_persistent_schedule_any_grid(block_m):
    """One program walking every tile, a few programs striding, and more programs
    than tiles (the extra ones exit at once) all give the same bits."""
    args = make_problem(COUNTS, 130, 200, seed=11)
    outs = [_launch(args, block_m=block_m, num_programs=p) for p in (1, 4, 1000)]
    check_close(outs[0], args)
    for o in outs[1:]:
        assert_bitwise_equal(o, outs[0])


def test_block_m_heuristic():
    assert tg.choose_block_m(8 * 256, 256) == 64  # decode: 8 tokens per expert
    assert tg.choose_block_m(64 * 256, 256) == 64
    assert tg.choose_block_m(64 * 256 + 1, 256) == 128  # prefill
    with pytest.raises(ValueError, match="block_m: expected one of"):
        _launch(make_problem((2,), 16, 128, seed=0), block_m=32)


# ---------------------------------------------- reduced-precision accumulation


# A problem whose scales are constant along K (so a kernel without promotion is
# mathematically exact and differs only in accumulation precision), K = 4096:
# 32 K blocks of wgmma accumulation.
def _uniform_scale_problem():
    g = torch.Generator().manual_seed(7)
    counts, n, k = (3, 70), 64, 4096
    m, e, kb = sum(counts), len(counts), k // 128

    def fp8(*shape):
        return (torch.randn(*shape, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)

    a_s = (torch.rand(m, 1, generator=g) + 0.5).expand(m, kb).contiguous()
    b_s = (torch.rand(e, 1, 1, generator=g) + 0.5).expand(e, 1, kb).contiguous()
    return fp8(m, k), a_s, fp8(e, n, k), b_s, offsets_of(counts)


def _max_error(out, args):
    """max |out - exact| / sum |a||b|: 1e-8 for exact fp32 sums; measured with the
    emulation on: 1.1e-5 with promotion every 128 of K, 3.0e-4 without."""
    ref = grouped_gemm_reference(*args, out_dtype=torch.float64)
    return float(((out.double() - ref).abs() / grouped_gemm_abs_reference(*args)).max())


PROMOTED_BOUND = 4e-5  # the per-128 promotion's error under the 14-bit model, with margin


@pytest.mark.skipif(not INTERPRET, reason=INTERPRETER_ONLY)
def test_promotion_survives_reduced_precision_accumulation():
    from tests import triton_interpreter

    args = _uniform_scale_problem()
    exact = {p: _max_error(_launch(args, block_m=64, promote=p), args) for p in (True, False)}
    with triton_interpreter.fp8_imprecise_accumulation():
        hopper = {p: _max_error(_launch(args, block_m=64, promote=p), args) for p in (True, False)}
    # Without the emulation both variants are exact to fp32 rounding...
    assert exact[True] < 1e-6 and exact[False] < 1e-6, exact
    # ...with it, the promoted kernel stays accurate and the unpromoted one fails.
    assert hopper[True] < PROMOTED_BOUND, hopper
    assert hopper[False] > 3 * PROMOTED_BOUND, hopper


# ------------------------------------------------------------------- sm_90a


@pytest.fixture(scope="module")
def compiled():
    return [aot.compile_triton(k, sig, const, **opts) for k, sig, const, opts in tg.aot_variants()]


@pytest.mark.sm90
def test_sm90_uses_fp8_wgmma(compiled):
    for art in compiled:
        assert "wgmma.mma_async" in art.ptx and ".e4m3.e4m3" in art.ptx, art.name
        aot.assert_sass_contains(art.sass, r"QGMMA\.", kernel=art.name)


@pytest.mark.sm90
def test_sm90_no_spills_and_shared_within_limit(compiled):
    for art in compiled:
        usage = art.resource_usage
        aot.assert_no_spills(usage)
        assert usage["shared_launch"] <= 232448, (art.name, usage["shared_launch"])
        print(f"{art.name}: {usage['registers']} registers, {usage['shared_launch']} B shared")
