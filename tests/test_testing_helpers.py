"""Tests of compass_kernels.testing: tolerances, verbose allclose, bitwise equality, poison."""

from __future__ import annotations

import random
import re

import pytest
import torch

from compass_kernels.testing import (
    TOLERANCES,
    assert_bitwise_equal,
    assert_verbose_allclose,
    empty_poisoned,
    make_generator,
    odd_sizes,
    poison_,
    seeded,
    tolerance,
)

FLOAT_DTYPES = [
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


# ----------------------------------------------------------------------------- tolerance


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_tolerance_table_covers_float_dtypes_and_loosens_with_precision(dtype):
    atol, rtol = tolerance(dtype)
    assert (atol, rtol) == TOLERANCES[dtype]
    assert atol > 0 and rtol > 0
    # rtol must admit half an ulp of the format, or a correctly rounded cast fails.
    assert rtol >= torch.finfo(dtype).eps / 2


def test_tolerance_loosens_as_precision_drops():
    by_precision = [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ]
    rtols = [tolerance(d)[1] for d in by_precision]
    assert rtols == sorted(rtols) and len(set(rtols)) == len(rtols)


def test_tolerance_exact_for_integers_and_bool_complex_uses_real_part():
    assert tolerance(torch.int32) == (0.0, 0.0)
    assert tolerance(torch.bool) == (0.0, 0.0)
    assert tolerance(torch.complex64) == TOLERANCES[torch.float32]
    with pytest.raises(KeyError, match="float8_e4m3fnuz"):
        tolerance(torch.float8_e4m3fnuz)


# ----------------------------------------------------------------------------- verbose allclose


def _failure(actual, expected, **kw) -> str:
    with pytest.raises(AssertionError) as info:
        assert_verbose_allclose(actual, expected, **kw)
    return str(info.value)


def test_allclose_passes_within_tolerance():
    x = torch.linspace(-3, 3, 101, dtype=torch.float32)
    assert_verbose_allclose(x * (1 + 5e-6), x)  # inside the float32 rtol
    assert_verbose_allclose(x.to(torch.bfloat16), x.to(torch.bfloat16))


def test_allclose_reports_first_mismatches_in_row_major_order():
    expected = torch.zeros(4, 5)
    actual = expected.clone()
    bad = [(0, 3), (1, 1), (2, 4), (3, 0)]
    for k, (i, j) in enumerate(bad):
        actual[i, j] = 1.0 + k
    msg = _failure(actual, expected, name="out", max_print=3)
    assert msg.startswith("out: tensors not close ((4, 5) torch.float32)")
    assert "mismatched elements: 4 / 20 (20%)" in msg
    listed = re.findall(r"^  \((\d+), (\d+)\): (\S+), (\S+),", msg, flags=re.M)
    assert [(int(i), int(j)) for i, j, _, _ in listed] == bad[:3]
    assert [(float(a), float(e)) for _, _, a, e in listed] == [(1.0, 0.0), (2.0, 0.0), (3.0, 0.0)]
    assert "max abs diff (finite pairs): 4 at (3, 0)" in msg


def test_allclose_reports_rel_diff_and_respects_explicit_tolerances():
    expected = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    actual = torch.tensor([1.0, 2.2, 4.0], dtype=torch.float64)
    msg = _failure(actual, expected)
    assert "(1,): 2.2, 2, 0.2, 0.1" in msg
    assert "max rel diff (finite pairs): 0.1 at (1,)" in msg
    assert_verbose_allclose(actual, expected, atol=0.0, rtol=0.11)


def test_allclose_nan_mismatch_fails_even_with_huge_tolerance():
    expected = torch.tensor([1.0, 2.0, float("nan")])
    actual = torch.tensor([float("nan"), 2.0, 3.0])
    msg = _failure(actual, expected, atol=1e9, rtol=1e9)
    assert "mismatched elements: 2 / 3" in msg
    assert "actual NaN where expected is not: 1; expected NaN where actual is not: 1" in msg


def test_allclose_nan_equals_nan_only_with_equal_nan():
    x = torch.tensor([1.0, float("nan")])
    msg = _failure(x, x.clone())
    assert "mismatched elements: 1 / 2" in msg and "(1,): nan, nan" in msg
    assert_verbose_allclose(x, x.clone(), equal_nan=True)


def test_allclose_infinity_sign_matters():
    inf = float("inf")
    assert_verbose_allclose(torch.tensor([inf, -inf]), torch.tensor([inf, -inf]))
    msg = _failure(torch.tensor([inf, 0.0]), torch.tensor([-inf, 0.0]), atol=1e9)
    assert "Inf mismatches: 1" in msg and "(0,): inf, -inf" in msg


def test_allclose_shape_and_dtype_mismatch():
    assert "shape mismatch: actual (3,) vs expected (1, 3)" in _failure(
        torch.zeros(3), torch.zeros(1, 3)
    )
    assert "dtype mismatch: actual torch.bfloat16 vs expected torch.float32" in _failure(
        torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)
    )
    ref = torch.rand(64, generator=make_generator(0))
    assert_verbose_allclose(ref.to(torch.bfloat16), ref, check_dtype=False)


def test_allclose_integers_exact_beyond_float64_precision():
    big = 2**62
    a = torch.tensor([big, 5], dtype=torch.int64)
    assert_verbose_allclose(a, a.clone())
    assert "mismatched elements: 1 / 2" in _failure(a, a + torch.tensor([1, 0]))


def test_allclose_uses_dtype_tolerance_by_default():
    x = torch.ones(8, dtype=torch.bfloat16)
    assert_verbose_allclose(x + 2**-7, x)  # one bf16 ulp at 1.0: within bf16 tolerance
    y = torch.ones(8, dtype=torch.float32)
    _failure(y + 2**-7, y)  # the same gap in float32 is a bug


# ----------------------------------------------------------------------------- bitwise


def test_bitwise_equal_distinguishes_signed_zero_and_reports_bits():
    a = torch.tensor([0.0, 1.0, -0.0])
    assert_bitwise_equal(a, a.clone())
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(a, torch.tensor([0.0, 1.0, 0.0]), name="codec")
    msg = str(info.value)
    assert "codec: bitwise mismatch in 1 / 3 elements" in msg
    assert "(2,): actual -0.0 (0x80000000), expected 0.0 (0x00000000)" in msg


def test_bitwise_equal_dtype_and_noncontiguous():
    x = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    assert_bitwise_equal(x.t(), x.t().contiguous())
    with pytest.raises(AssertionError, match="dtype mismatch"):
        assert_bitwise_equal(x, x.to(torch.int32))
    y = x.t().clone()
    y[3, 2] = 99
    with pytest.raises(AssertionError, match=r"\(3, 2\): actual 99"):
        assert_bitwise_equal(y, x.t())


# ----------------------------------------------------------------------------- poison


def _forgetful_kernel(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A buggy 'kernel': doubles x but never writes the last element."""
    out[:-1] = 2 * x[:-1]
    return out


def test_poison_makes_unwritten_float_elements_detectable():
    x = torch.zeros(37)  # reference output is all zeros: an unpoisoned buffer would hide the bug
    ref = 2 * x
    assert_verbose_allclose(_forgetful_kernel(x, torch.zeros(37)), ref)  # bug hidden
    out = _forgetful_kernel(x, empty_poisoned(37, torch.float32))
    msg = _failure(out, ref)
    assert "(36,): nan, 0" in msg


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.complex64])
def test_poison_float_is_nan(dtype):
    t = poison_(torch.zeros(5, dtype=dtype))
    vals = t if dtype.is_complex else t.to(torch.float32)
    assert bool(torch.isnan(vals).all())


@pytest.mark.parametrize(
    "dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16]
)
def test_poison_int_is_max_value(dtype):
    t = empty_poisoned((2, 3), dtype)
    assert t.shape == (2, 3) and t.dtype == dtype
    assert bool((t == torch.iinfo(dtype).max).all())


def test_poison_bool_is_0xff_and_caught_bitwise_even_where_reference_true():
    ref = torch.tensor([True, False, True])
    out = empty_poisoned(3, torch.bool)
    assert out.view(torch.uint8).tolist() == [0xFF] * 3
    out[1] = False  # the kernel wrote only element 1; element 0 and 2 should be True
    with pytest.raises(AssertionError, match=r"bitwise mismatch in 2 / 3"):
        assert_bitwise_equal(out, ref)
    out[0], out[2] = True, True
    assert_bitwise_equal(out, ref)


def test_poison_noncontiguous_view_in_place():
    base = torch.zeros(4, 6)
    view = base[:, ::2]
    assert poison_(view) is view
    assert bool(torch.isnan(base[:, ::2]).all()) and bool((base[:, 1::2] == 0).all())


# ----------------------------------------------------------------------------- seeding, sizes


def test_seeded_is_reproducible_and_restores_state():
    with seeded(123):
        a, ra = torch.rand(4), random.random()
    with seeded(123):
        b, rb = torch.rand(4), random.random()
    assert torch.equal(a, b) and ra == rb
    torch.manual_seed(7)
    random.seed(7)
    with seeded(999):
        torch.rand(100)
        random.random()
    after_t, after_r = torch.rand(3), random.random()
    torch.manual_seed(7)
    random.seed(7)
    assert torch.equal(after_t, torch.rand(3)) and after_r == random.random()


def test_make_generator_is_local_and_deterministic():
    g1, g2 = make_generator(5), make_generator(5)
    assert torch.equal(torch.rand(8, generator=g1), torch.rand(8, generator=g2))
    assert not torch.equal(torch.rand(8, generator=make_generator(6)), torch.rand(8, generator=g1))


def test_odd_sizes():
    sizes = odd_sizes()
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert {1, 7, 37, 131, 257}.issubset(sizes)
    assert any(s > 1024 for s in sizes)
    assert odd_sizes(256) == [s for s in sizes if s <= 256] and max(odd_sizes(256)) == 255
    sizes.append(-1)
    assert -1 not in odd_sizes()
