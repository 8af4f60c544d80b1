"""sm_90a compile checks of the code that actually launches (tests.aot.launched_variants).

Each op's Triton backend is called at the op's typical and largest shapes
(tests/launch_plans.py; meta tensors, so T x V past 2^31 costs nothing) with
the launches recorded instead of run; each launch is compiled with the
specialization Triton's JIT gives those arguments (its own binder: integers
equal to 1 made constants, multiples of 16 marked divisible, i32 below 2^31
else i64, 16-byte aligned pointers). On that code: no spills, a register
budget, the vector width of the main loads / stores, no 64-bit integer divide.
Runs under the venv's Triton and under 3.6 (``make test-triton36``).
"""

from __future__ import annotations

from tests.triton_tier import triton

# isort: split

import pytest
import triton.language as tl

from tests import aot
from tests.triton_tier import needs_cuobjdump

pytestmark = [pytest.mark.sm90, needs_cuobjdump]

#: register budget per module (4 warps: <= 128 keeps >= 4 programs per SM)
BUDGET = {
    "espo.triton_logprobs": 96,
    "routing.triton": 128,
    "fp8.triton_gemm": 255,
    # the permute rank kernel: 168 under Triton 3.8 (torch 2.14, make test-py312), <= 160 under
    # 3.6 / 3.9; spill-free under all three
    "fp8.triton": 168,
    "espo.triton_loss": 160,
    "advantages.triton": 96,
    "packing.triton": 128,
    "routing.triton_setcode": 128,
    "fp8.triton_args": 64,
}


@pytest.fixture(scope="module", params=sorted(BUDGET))
def variants(request):
    return request.param, aot.launched_variants(request.param)


def test_launched_variants_compile_without_spills(variants):
    module, vs = variants
    assert vs, module
    for v in vs:
        usage = v.artifacts.resource_usage
        assert usage["arch"] == "sm_90a"
        try:
            aot.assert_no_spills(usage)
            aot.assert_registers_at_most(usage, BUDGET[module])
        except AssertionError as exc:
            raise AssertionError(f"{module} {v.case} ({v.specialization}): {exc}") from None


def test_no_64_bit_integer_divide(variants):
    module, vs = variants
    bad = [
        f"{v.case}: {aot.divides_64(v.artifacts.ptx)}"
        for v in vs
        if aot.divides_64(v.artifacts.ptx)
    ]
    assert not bad, f"{module}: div/rem.s64 in {bad}"


def test_logprobs_main_loads_and_stores_are_128_bit():
    vs = aot.launched_variants("espo.triton_logprobs")
    for v in vs:
        w = aot.global_access_widths(v.artifacts.ptx)
        # the unmasked aligned body: 2 x v4.b32 per 2048 bf16, 4 per 2048 fp32
        want = 2 if "bfloat16" in v.case else 4
        assert w["ld"].get(128, 0) >= want, f"{v.case}: loads {w['ld']}"
        if v.name == "_bwd_kernel":
            assert w["st"].get(128, 0) >= want, f"{v.case}: stores {w['st']}"
        aot.assert_sass_contains(v.sass, r"LDG\.E\.128", kernel=f"{v.name} ({v.case})")


def test_logprobs_specialization_is_the_calls():
    vs = {v.case: v for v in aot.launched_variants("espo.triton_logprobs")}
    qwen = vs["forward T=4096 V=151936 bfloat16 entropy=True"].specialization
    odd = vs["forward T=4096 V=50257 bfloat16 entropy=True"].specialization
    assert "V:i32/16" in qwen and "stride_row:i32/16" in qwen and "logits_ptr:*bf16/16" in qwen
    assert " V:i32 " in odd and "stride_row:i32 " in odd
    # T x V = 2.49e9 > 2^31: the row offsets are int64 inside the kernel, the
    # arguments (V, the row stride) stay i32
    big = vs["forward T=16384 V=151936 bfloat16 entropy=True"].specialization
    assert big == qwen


def test_routing_covers_256_and_384_experts():
    vs = aot.launched_variants("routing.triton")
    cases = {v.case for v in vs}
    assert {"replay E=256 K=8 T=8192", "replay E=384 K=8 T=8192"} <= cases
    e384 = next(v for v in vs if v.case == "replay E=384 K=8 T=8192")
    assert e384.launch.kwargs["BLOCK_E"] == 512


def test_fp8_quantize_reads_and_writes_128_bit():
    for v in aot.launched_variants("fp8.triton"):
        if v.name in ("_quantize_block_kernel", "_quantize_groups_kernel"):
            w = aot.global_access_widths(v.artifacts.ptx)
            # bf16 in (8 per access: 32 per thread in 32 x 128, twice 16 in the
            # block kernel's two passes), e4m3 bytes out (16 per access)
            assert w["ld"].get(128, 0) >= 4 and w["st"].get(128, 0) >= 2, f"{v.case}: {w}"


def test_fp8_quantizers_convert_in_hardware_without_per_element_division():
    """The e4m3 conversion is the sm_89+ instruction (two values per F2FP), and
    IEEE divisions are per row (scale, reciprocal), not per element: the row
    tile's divisions stay at its rows per thread (4 of 32 in the 1 x 128
    kernel, 1 + 1 per 128 x 128 block, 2 per 16-group step of the scatter)."""
    most = {"_quantize_groups_kernel": 4, "_quantize_block_kernel": 2, "_permute_scatter_kernel": 4}
    seen = set()
    for v in aot.launched_variants("fp8.triton"):
        if v.name not in most:
            continue
        seen.add(v.name)
        where = f"{v.name} ({v.case})"
        aot.assert_sass_contains(v.sass, r"F2FP\.SATFINITE\.E4M3", kernel=where)
        divs = v.artifacts.ptx.count("div.rn.f32")
        assert 0 < divs <= most[v.name], f"{where}: {divs} div.rn.f32"
        if v.name == "_permute_scatter_kernel":  # the row stored to k = 8 slots, 16 B each
            assert aot.global_access_widths(v.artifacts.ptx)["st"].get(128, 0) >= 8, where
    assert seen == set(most)


def test_grouped_gemm_uses_wgmma_and_wide_loads():
    for v in aot.launched_variants("fp8.triton_gemm"):
        aot.assert_sass_contains(v.sass, r"QGMMA\.", kernel=f"{v.name} ({v.case})")
        assert aot.global_access_widths(v.artifacts.ptx)["ld"].get(128, 0) > 0 or (
            "cp.async" in v.artifacts.ptx
        ), v.case


# ------------------------------------------------------- the tooling itself


@triton.jit
def _spec_kernel(x_ptr, one, sixteen, big, odd, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * (one + sixteen + big + odd))


def test_specialization_follows_tritons_rules():
    import torch

    x = torch.empty(64, device="meta")
    with aot.record_launches(execute=False) as launches:
        _spec_kernel[(1,)](x, 1, 48, 2**31 + 16, 7, BLOCK=64)
    assert len(launches) == 1 and launches[0].name == "_spec_kernel"
    signature, constexprs, attrs, _ = aot.specialization_of(launches[0])
    assert signature["one"] == "constexpr" and constexprs[(1,)] == 1
    assert signature["sixteen"] == "i32" and attrs[(2,)] == [["tt.divisibility", 16]]
    assert signature["big"] == "i64" and attrs[(3,)] == [["tt.divisibility", 16]]
    assert signature["odd"] == "i32" and not attrs.get((4,))
    assert attrs[(0,)] == [["tt.divisibility", 16]]  # a torch allocation: 16-byte aligned


def test_record_launches_restores_and_can_execute():
    import torch

    from tests.triton_tier import DEVICE

    x = torch.ones(64, device=DEVICE)
    with aot.record_launches(execute=True) as launches:
        _spec_kernel[(1,)](x, 1, 0, 0, 0, BLOCK=64)
    assert len(launches) == 1 and bool((x == 1).all())
    _spec_kernel[(1,)](x, 1, 1, 0, 0, BLOCK=64)  # no longer recorded: runs
    assert len(launches) == 1 and bool((x == 2).all())


def test_access_width_and_divide_parsers():
    ptx = (
        "ld.global.v4.b32 {%r1,...}, [%rd1];\n ld.global.b16 %rs1, [%rd2];\n"
        "st.global.v2.f32 [%rd3], {%f1, %f2};\n div.s64 %rd4, %rd5, %rd6;\n rem.u64 %rd7;"
    )
    assert aot.global_access_widths(ptx) == {"ld": {128: 1, 16: 1}, "st": {64: 1}}
    assert aot.divides_64(ptx) == 2
