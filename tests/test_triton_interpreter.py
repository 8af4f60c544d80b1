"""The test-only fix of the Triton interpreter (tests.triton_interpreter).

What is shown, against oracles that do not use torch's or NumPy's conversions:

- casts fp32 -> bf16 / fp16 / float8_e4m3fn / float8_e5m2 and int32 -> bf16
  inside a kernel equal round-to-nearest-even computed with integer bit
  arithmetic (:func:`rne_bits`), bit for bit, on every tie (midpoint between two
  neighbouring codes of the target format), both neighbours of each tie,
  subnormals, values past the format's range (e4m3fn saturates to +-448, the
  IEEE formats overflow to +-inf), +-0, +-inf and NaN; upcasts to fp32 equal
  the value decoded from the bits (:func:`decode_bits`);
- tl.dot on bf16 / fp16 / fp8 / fp32 (input_precision="ieee") operands: exact
  (bitwise equal to an integer-exact sum) on inputs where every fp32 partial sum
  is exact, so no accumulation order can change the answer, over a wide range
  of exponents; within the fp32 accumulation bound ``K * 2**-24 * (|A| @ |B|)``
  of the float64 product for a K loop over odd, masked sizes;
- the opt-in emulation of Hopper's reduced-precision fp8 accumulation
  (``fp8_imprecise_accumulation``): a K-loop fp8 GEMM without promotion
  deviates beyond a bound, the same GEMM promoting to fp32 per K block (or with
  ``max_num_imprecise_acc``) stays within it;
- a kernel calling a @triton.jit helper (tl.sum) leaves triton.language as it
  found it (unfixed, the interpreter leaves its patches installed, which breaks
  a later ahead-of-time compile in the same process);
- without the fix the known bugs are there (so we notice when Triton fixes
  them upstream: that test then skips with a message saying the fix can be
  dropped for that version), with it they are gone;
- apply / revert are idempotent and restore the original builders exactly, and
  the fix refuses loudly to patch interpreter internals it does not recognise.
"""

from __future__ import annotations

from tests.triton_tier import triton

# isort: split

import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter as _interp

from compass_kernels.testing import assert_bitwise_equal
from tests import triton_interpreter
from tests.tiers import INTERPRETER_ONLY

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton.knobs.runtime.interpret, reason=INTERPRETER_ONLY),
]

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _interpreter_fixed(on: bool):
    was = triton_interpreter.is_applied()
    (triton_interpreter.apply if on else triton_interpreter.revert)()
    yield
    (triton_interpreter.apply if was else triton_interpreter.revert)()


@pytest.fixture
def fixed():
    """The fix applied for the test; the previous state restored after."""
    yield from _interpreter_fixed(True)


@pytest.fixture
def unfixed():
    """The original interpreter for the test; the previous state restored after."""
    yield from _interpreter_fixed(False)


# ------------------------------------------------------------------------- kernels


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * K + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + kk[:, None] * N + rn[None, :],
            mask=(kk[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype)
    y.view(BITS[y.element_size()]).fill_(-1)  # poison: all-ones bits
    block = 1024
    _cast_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
    return y


def _matmul(a: torch.Tensor, b: torch.Tensor, *, bk: int = 16) -> torch.Tensor:
    (m, k), n = a.shape, b.shape[1]
    c = torch.full((m, n), float("nan"))
    prec = "ieee" if a.dtype == torch.float32 else None
    grid = (triton.cdiv(m, 32), triton.cdiv(n, 16))
    _matmul_kernel[grid](a, b, c, m, n, k, BM=32, BN=16, BK=bk, PRECISION=prec)
    return c


# ------------------------------------------------------------------- cast inputs


def _codes(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 8/16-bit float format, as float64, sorted, unique."""
    width = torch.finfo(dtype).bits
    bits = torch.arange(2**width, dtype=torch.int64)
    bits = bits.to(torch.uint8 if width == 8 else torch.int16)
    values = bits.view(dtype).to(torch.float64)
    return torch.unique(values[torch.isfinite(values)])


def cast_inputs(dtype: torch.dtype) -> torch.Tensor:
    """fp32 inputs that pin down rounding and range handling of fp32 -> ``dtype``.

    For each pair of neighbouring finite codes of ``dtype`` (so every binade,
    subnormals included): the exact midpoint (a tie: nearest-even decides) and
    the fp32 neighbours of that midpoint. Past the largest code: the tie to the
    next (absent) code, far overflow, inf. Plus fp32 subnormals, +-0 and NaN.
    Midpoints of 8- and 16-bit formats are exact in fp32.
    """
    v = _codes(dtype)
    v = v[v >= 0]
    big = v[-1] + (v[-1] - v[-2])  # where the next code would be
    mids = torch.cat([(v[:-1] + v[1:]) / 2, ((v[-1] + big) / 2).reshape(1)]).to(torch.float32)
    assert torch.equal(mids.to(torch.float64)[:-1], (v[:-1] + v[1:]) / 2), "midpoints not exact"
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    specials = torch.tensor(
        # fmt: off
        [
            0.0,
            float("inf"),
            float("nan"),
            2.0**-149,
            3 * 2.0**-149,
            2.0**-126 - 2.0**-149,
            float(big),
            float(big) * 4,
            3.0e38,
            torch.finfo(torch.float32).max,
        ],
        # fmt: on
        dtype=torch.float32,
    )
    pos = torch.cat([v.to(torch.float32), mids, up, down, specials])
    return torch.cat([pos, -pos])


CAST_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


# ------------------------------------------------------------------------ oracles
# Integer bit arithmetic only: no torch / NumPy float conversion decides a result.

#: name -> (exponent bits, mantissa bits, bias, has inf). float8_e4m3fn has no
#: inf: S.1111.111 is NaN and overflow saturates to the largest code S.1111.110.
FORMATS = {
    torch.bfloat16: (8, 7, 127, True),
    torch.float16: (5, 10, 15, True),
    torch.float8_e4m3fn: (4, 3, 7, False),
    torch.float8_e5m2: (5, 2, 15, True),
}


def _float_parts(x: torch.Tensor):
    """(sign, significand, exponent, nan, inf) of fp32 / fp64 ``x``: |x| = sig * 2**exp."""
    ebits, p = (8, 23) if x.dtype == torch.float32 else (11, 52)
    b = x.contiguous().view(torch.int32 if p == 23 else torch.int64).to(torch.int64)
    b = b & 0xFFFFFFFF if p == 23 else b
    sign, e_field = (b >> (ebits + p)) & 1, (b >> p) & ((1 << ebits) - 1)
    man = b & ((1 << p) - 1)
    sig = torch.where(e_field > 0, man | (1 << p), man)
    exp = torch.where(e_field > 0, e_field, 1) - ((1 << (ebits - 1)) - 1) - p
    top = e_field == (1 << ebits) - 1
    return sign, sig, exp, top & (man != 0), top & (man == 0)


def _bit_length(v: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative int64 values below 2**62 (0 -> 0)."""
    length = torch.zeros_like(v)
    for k in range(62):
        length += (v >> k) > 0
    return length


def rne_bits(sign, sig, exp, dtype, *, nan=None, inf=None) -> torch.Tensor:
    """Round (-1)**sign * sig * 2**exp to nearest even in ``dtype``; its bits (int64).

    Overflow: +-inf for the IEEE formats, the largest finite code for
    float8_e4m3fn (which also takes inf there); NaN gives the quiet NaN code.
    """
    ebits, p, bias, has_inf = FORMATS[dtype]
    width = 1 + ebits + p
    emin = 1 - bias
    top = sig.clamp(min=1)
    t = exp + _bit_length(top) - 1  # floor(log2 |x|)
    qe = torch.maximum(t, torch.full_like(t, emin)) - p  # quantum: 2**qe
    sh = qe - exp
    shc = sh.clamp(1, 62)
    q = sig >> shc
    rem = sig - (q << shc)
    half = torch.ones_like(shc) << (shc - 1)
    n = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(torch.int64)
    n = torch.where(sh <= 0, sig << (-sh).clamp(min=0), torch.where(sh > 62, 0, n))
    carry = n >= (1 << (p + 1))
    n, qe = torch.where(carry, n >> 1, n), qe + carry.to(torch.int64)
    bits = (qe + p + bias - 1) * (1 << p) + n  # normal and subnormal alike
    bits = torch.where(sig == 0, 0, bits)
    if has_inf:
        big = ((1 << ebits) - 1) << p  # the inf code
    else:
        big = (1 << (ebits + p)) - 2  # S.1111.110: 448 for e4m3fn
    bits = bits.clamp(max=big)
    if inf is not None:
        bits = torch.where(inf, big, bits)
    bits = bits | (sign << (width - 1))
    if nan is not None:
        qnan = (((1 << ebits) - 1) << p) | (1 << (p - 1)) if has_inf else (1 << (width - 1)) - 1
        bits = torch.where(nan, qnan, bits)
    return bits


def oracle_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 / fp64 or integer ``x`` rounded to nearest even in ``dtype``, as a ``dtype`` tensor."""
    if x.is_floating_point():
        sign, sig, exp, nan, inf = _float_parts(x)
        bits = rne_bits(sign, sig, exp, dtype, nan=nan, inf=inf)
    else:
        v = x.to(torch.int64)
        bits = rne_bits((v < 0).to(torch.int64), v.abs(), torch.zeros_like(v), dtype)
    width = torch.finfo(dtype).bits
    signed = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)
    return signed.to(BITS[width // 8]).view(dtype)


def decode_bits(y: torch.Tensor) -> torch.Tensor:
    """The exact value of every element of 8/16-bit float ``y``, as float64."""
    ebits, p, bias, has_inf = FORMATS[y.dtype]
    width = 1 + ebits + p
    b = y.view(BITS[width // 8]).to(torch.int64) & ((1 << width) - 1)
    sign, e_field, man = b >> (width - 1), (b >> p) & ((1 << ebits) - 1), b & ((1 << p) - 1)
    sig = torch.where(e_field > 0, man | (1 << p), man).to(torch.float64)
    value = torch.ldexp(sig, (torch.where(e_field > 0, e_field, 1) - bias - p).to(torch.float64))
    top = e_field == (1 << ebits) - 1
    if has_inf:
        value = torch.where(top & (man == 0), float("inf"), value)
        value = torch.where(top & (man != 0), float("nan"), value)
    else:
        value = torch.where(top & (man == (1 << p) - 1), float("nan"), value)
    return torch.where(sign == 1, -value, value)


def assert_cast_equal(actual: torch.Tensor, expected: torch.Tensor, *, name: str) -> None:
    """Bitwise equal, except that any NaN matches any NaN (payloads are not specified)."""
    nan_a, nan_e = torch.isnan(actual.float()), torch.isnan(expected.float())
    assert_bitwise_equal(nan_a, nan_e, name=f"{name} NaN positions")
    assert_bitwise_equal(actual[~nan_a], expected[~nan_e], name=name)


# ------------------------------------------------------------------------- casts


@pytest.mark.parametrize("dtype", CAST_DTYPES, ids=str)
def test_oracle_pins_down_the_semantics(dtype):
    """The oracle's rounding, range handling and decoding, on hand-checked cases
    (so the tests below do not rest on an oracle that is itself wrong)."""
    ebits, p, bias, has_inf = FORMATS[dtype]
    tie_even = 1 + 2.0**-p + 2.0 ** -(p + 1)  # halfway between 1 + u and 1 + 2u
    x = torch.tensor([1.0, 1 + 2.0 ** -(p + 1), tie_even, -1.5, 2.0 ** (1 - bias - p), 0.0])
    got = decode_bits(oracle_cast(x, dtype)).tolist()
    assert got == [1.0, 1.0, 1 + 2.0 ** (1 - p), -1.5, 2.0 ** (1 - bias - p), 0.0]
    largest = {
        torch.bfloat16: 3.3895313892515355e38,
        torch.float16: 65504.0,
        torch.float8_e4m3fn: 448.0,
        torch.float8_e5m2: 57344.0,
    }[dtype]
    assert decode_bits(oracle_cast(torch.tensor([largest]), dtype)).item() == largest
    big = oracle_cast(torch.tensor([largest * 1.5, float("inf"), float("nan")]), dtype)
    tops = decode_bits(big)
    if has_inf:
        assert tops[:2].tolist() == [float("inf")] * 2
    else:
        assert tops[:2].tolist() == [448.0, 448.0]
    assert bool(torch.isnan(tops[2]))
    # Every code decodes and re-encodes to itself.
    codes = _codes(dtype)
    assert torch.equal(decode_bits(oracle_cast(codes.float(), dtype)), codes)


@pytest.mark.parametrize("dtype", CAST_DTYPES, ids=str)
def test_cast_from_fp32_matches_the_integer_oracle(fixed, dtype):
    x = cast_inputs(dtype)
    expected = oracle_cast(x, dtype)
    # The input set really contains ties that round down to an even code (a
    # truncating or round-half-up converter would disagree on these).
    ties_down = (decode_bits(expected) < x.double()) & (x > 0) & torch.isfinite(x)
    assert int(ties_down.sum()) > 100
    assert_cast_equal(_cast(x, dtype), expected, name=f"fp32 -> {dtype}")


def test_cast_from_int_to_bf16_matches_the_integer_oracle(fixed):
    # Unfixed, the interpreter stores the integer itself as the bf16 bit pattern.
    # 257 and 1000 are not bf16 values: they test rounding (257 is a tie).
    x = torch.tensor(
        [-300, -17, -1, 0, 1, 3, 5, 17, 255, 257, 448, 1000, 2**24 + 2**16 + 1, -(2**31)],
        dtype=torch.int32,
    )
    expected = oracle_cast(x, torch.bfloat16)
    assert decode_bits(expected)[9].item() == 256.0  # the tie went to even
    assert_cast_equal(_cast(x, torch.bfloat16), expected, name="int32 -> bf16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cast_from_fp64_rounds_once(fixed, dtype):
    # Just above a tie of `dtype` by less than half an fp32 ulp: a conversion
    # through fp32 (torch's) lands on the tie and rounds to even, i.e. down; one
    # rounding (the GPU's cvt.rn.bf16.f64 / cvt.rn.f16.f64) goes up.
    p = FORMATS[dtype][1]
    g = torch.Generator().manual_seed(7)
    ties = 1 + (2 * torch.randint(0, 2**p // 2, (64,), generator=g) + 1).double() * 2.0 ** -(p + 1)
    ties = ties * 2.0 ** torch.randint(-10, 10, (64,), generator=g).double()
    x = torch.cat(
        [
            ties * (1 + 2.0**-40),
            ties * (1 - 2.0**-40),
            ties,
            torch.randn(256, generator=g, dtype=torch.float64) * 100,
        ]
    )
    x = torch.cat([x, -x])
    expected = oracle_cast(x, dtype)
    assert not torch.equal(expected, x.float().to(dtype)), "no double-rounding case in the input"
    assert_cast_equal(_cast(x, dtype), expected, name=f"fp64 -> {dtype}")


@triton.jit
def _cast_rtz_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtz"), mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cast_round_toward_zero(fixed, dtype):
    # Expected: the largest-magnitude code of `dtype` not above |x|, found by
    # search in the sorted list of all its finite codes (inf stays inf).
    x = cast_inputs(dtype)
    x = x[~torch.isnan(x)]
    codes = _codes(dtype)
    codes = codes[codes >= 0]
    mag = x.abs().to(torch.float64)
    below = codes[(torch.searchsorted(codes, mag, right=True) - 1).clamp(min=0)]
    below = torch.where(torch.isinf(mag), mag, below.abs())  # codes hold -0.0 as zero
    expected = torch.copysign(below, x.to(torch.float64)).to(dtype)
    y = torch.empty(x.shape, dtype=dtype)
    _cast_rtz_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert_bitwise_equal(y, expected, name=f"fp32 -> {dtype} rtz")


@pytest.mark.parametrize("dtype", CAST_DTYPES, ids=str)
def test_upcast_to_fp32_is_exact(fixed, dtype):
    width = torch.finfo(dtype).bits
    v = torch.arange(2**width, dtype=torch.int64).to(BITS[width // 8]).view(dtype)  # every code
    expected = decode_bits(v)
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no inf (it saturates to 448)
        assert bool(torch.isinf(expected).any())
    got = _cast(v, torch.float32).to(torch.float64)  # fp32 -> fp64 is exact
    nan = torch.isnan(expected)
    assert_bitwise_equal(torch.isnan(got), nan, name=f"{dtype} -> fp32 NaN positions")
    assert_bitwise_equal(got[~nan], expected[~nan], name=f"{dtype} -> fp32")


# -------------------------------------------------------------------------- dots

DOT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DOT_DTYPES, ids=str)
def test_dot_exact_where_every_partial_sum_is_exact(fixed, dtype):
    # Entries k/4 with |k| <= 7: exact in every format here (e4m3 included);
    # products are multiples of 1/16 below 4, sums of 37 of them stay far below
    # 2**20, so every fp32 partial sum is exact in any order: the only correct
    # answer is the integer sum (of the entries times 4), bit for bit.
    g = torch.Generator().manual_seed(1)
    a_int = torch.randint(-7, 8, (19, 37), generator=g)
    b_int = torch.randint(-7, 8, (37, 23), generator=g)
    a, b = (a_int / 4).to(dtype), (b_int / 4).to(dtype)
    expected = ((a_int @ b_int).to(torch.float64) / 16).to(torch.float32)  # integer-exact
    assert_bitwise_equal(_matmul(a, b), expected, name=f"{dtype} dot")


def _exact_dot_inputs(dtype, seed, m=32, k=16, n=16):
    """Operands m x k and k x n whose entries are j * 2**e, |j| <= 7, e in [-3, 3]:
    exact in every format here (e5m2 and e4m3 included), and wide enough in
    exponent that a decoding error of the stored bits (the bf16 bug) shows.
    Products are multiples of 2**-6 below 2**12; sums of 16 stay below 2**16,
    so every fp32 partial sum is exact in any order. Returns (a, b, a_int,
    b_int, scale): a = a_int * 2**-3 elementwise-scaled, as integer tensors."""
    g = torch.Generator().manual_seed(seed)

    def side(rows, cols):
        j = torch.randint(-7, 8, (rows, cols), generator=g)
        e = torch.randint(0, 7, (rows, cols), generator=g)  # 2**(e - 3)
        return j << e  # the value times 2**3, an integer

    a_int, b_int = side(m, k), side(k, n)
    to = lambda v: (v.to(torch.float64) / 8).to(dtype)
    return to(a_int), to(b_int), a_int, b_int


@pytest.mark.parametrize("dtype", DOT_DTYPES, ids=str)
def test_single_dot_is_exact_over_a_wide_exponent_range(fixed, dtype):
    a, b, a_int, b_int = _exact_dot_inputs(dtype, seed=2)
    assert torch.equal(
        decode_bits(a) * 8 if dtype in FORMATS else a.double() * 8, a_int.double()
    )  # the operands really are those integers
    exact = a_int @ b_int  # int64: the product times 2**6, no rounding anywhere
    expected = (exact.to(torch.float64) / 64).to(torch.float32)  # exact: |exact| < 2**24
    assert int(exact.abs().max()) < 2**24
    assert_bitwise_equal(_matmul(a, b), expected, name=f"{dtype} dot")


@pytest.mark.parametrize("dtype", DOT_DTYPES, ids=str)
def test_dot_k_loop_within_fp32_accumulation_bound(fixed, dtype):
    # Odd, masked sizes and a K loop: the accumulation order differs from any
    # single BLAS call, so compare with the float64 product under the standard
    # bound for K fp32 additions, |err| <= K * 2**-24 * (|A| @ |B|) (+ one
    # rounding of the result), elementwise.
    g = torch.Generator().manual_seed(3)
    m, k, n = 37, 53, 23
    a = (torch.randn(m, k, generator=g) * 2).to(dtype)
    b = (torch.randn(k, n, generator=g) * 2).to(dtype)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    expected = a64 @ b64
    bound = (k + 1) * 2.0**-24 * (a64.abs() @ b64.abs())
    err = (_matmul(a, b, bk=16).to(torch.float64) - expected).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{dtype} dot: error {err.flatten()[worst].item():.3e} > bound "
        f"{bound.flatten()[worst].item():.3e} at flat index {worst}"
    )


# ----------------------------------------------------------------- the bug itself


@triton.jit
def _row_sum_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    # tl.sum is itself a @triton.jit helper (triton.language.standard).
    tl.store(y_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, BLOCK)), axis=0))


def _language_namespaces() -> dict:
    return {
        "tl": tl,
        "tl.core": tl.core,
        "tl.math": tl.math,
        "tl.tensor": tl.core.tensor,
        "tl.dtype": tl.core.dtype,
        "tl.condition": tl.core.condition,
    }


@pytest.fixture
def language_restored():
    """Put triton.language back exactly as it was (the unfixed leak changes it)."""
    saved = {k: dict(vars(h)) for k, h in _language_namespaces().items()}
    yield
    for label, holder in _language_namespaces().items():
        now = vars(holder)
        for name in [n for n in now if n not in saved[label]]:
            delattr(holder, name)
        for name, value in saved[label].items():
            if now.get(name, object()) is not value:
                setattr(holder, name, value)


def _leaked_names(before: dict) -> list[str]:
    return sorted(
        f"{label}.{name}"
        for label, holder in _language_namespaces().items()
        for name, value in vars(holder).items()
        if before[label].get(name, object()) is not value
    )


def _unfixed_bug_report() -> list[str]:
    """Which of the known interpreter bugs the current interpreter shows."""
    bugs = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        x = cast_inputs(dtype)
        x = x[~torch.isnan(x)]
        bits = BITS[dtype.itemsize]
        bad = _cast(x, dtype).view(bits) != oracle_cast(x, dtype).view(bits)
        if bool(bad.any()):
            bugs.append(f"fp32 -> {dtype}: {int(bad.sum())} / {bad.numel()} wrong")
    a, b, a_int, b_int = _exact_dot_inputs(torch.bfloat16, seed=4)
    expected = ((a_int @ b_int).to(torch.float64) / 64).to(torch.float32)
    err = (_matmul(a, b) - expected).abs().max().item()
    if err != 0:
        bugs.append(f"bf16 dot: max error {err:.3e}")
    before = {k: dict(vars(h)) for k, h in _language_namespaces().items()}
    x, y = torch.arange(16, dtype=torch.float32), torch.full((1,), float("nan"))
    _row_sum_kernel[(1,)](x, y, BLOCK=16)
    assert y.item() == 120.0
    leaked = _leaked_names(before)
    if leaked:
        bugs.append(f"helper call left {len(leaked)} patches, e.g. {leaked[:3]}")
    return bugs


KNOWN_BUGS = 5


def test_fix_is_needed_and_removes_the_bugs(unfixed, language_restored):
    bugs = _unfixed_bug_report()
    triton_interpreter.apply()
    assert _unfixed_bug_report() == [], "bugs left with the fix applied"
    if len(bugs) < KNOWN_BUGS:
        # Not a failure: Triton fixed (some of) these upstream. The fix stays
        # correct; this says which parts of it may be dropped for this version.
        pytest.skip(
            f"triton {triton.__version__}'s interpreter no longer shows every known bug "
            f"(still present: {bugs or 'none'}); parts of tests.triton_interpreter "
            "may be unnecessary for this version"
        )


def test_helper_calls_leave_triton_language_unchanged(fixed):
    before = {k: dict(vars(h)) for k, h in _language_namespaces().items()}
    x, y = torch.arange(16, dtype=torch.float32), torch.full((1,), float("nan"))
    _row_sum_kernel[(1,)](x, y, BLOCK=16)
    assert y.item() == 120.0
    assert _leaked_names(before) == []


# ------------------------------------------------------------ apply / revert state


def _current() -> dict:
    """The objects now installed at every attribute the fix replaces."""
    out = {}
    for key in triton_interpreter.PATCHED_ATTRIBUTES:
        owner, name = key.split(".") if "." in key else (None, key)
        holder = getattr(_interp, owner) if owner else _interp
        out[key] = vars(holder)[name]
    return out


def test_apply_revert_idempotent_and_exact(unfixed):
    originals = _current()
    assert not triton_interpreter.is_applied()
    triton_interpreter.revert()  # reverting an unpatched interpreter is a no-op
    assert _current() == originals

    triton_interpreter.apply()
    patched = _current()
    assert triton_interpreter.is_applied()
    assert all(patched[k] is not originals[k] for k in originals)
    triton_interpreter.apply()  # second apply: no double wrapping
    assert _current() == patched

    triton_interpreter.revert()
    assert not triton_interpreter.is_applied()
    assert all(_current()[k] is originals[k] for k in originals)

    triton_interpreter.apply()
    assert triton_interpreter.is_applied()
    x = torch.tensor([1.00390625], dtype=torch.float32)  # a bf16 tie: 1 + 2**-8
    assert_bitwise_equal(_cast(x, torch.bfloat16), oracle_cast(x, torch.bfloat16))


def test_apply_fails_loudly_when_internals_are_missing(monkeypatch):
    monkeypatch.delattr(_interp.InterpreterBuilder, "create_dot")
    with pytest.raises(RuntimeError, match=rf"triton {triton.__version__}.*create_dot"):
        triton_interpreter.apply()


def test_apply_fails_loudly_when_a_signature_changed(monkeypatch):
    monkeypatch.setattr(
        _interp.InterpreterBuilder, "cast_impl", lambda self, src, dst_type, extra: None
    )
    with pytest.raises(RuntimeError, match=r"cast_impl has parameters .*extra"):
        triton_interpreter.apply()


# ------------------------------------------------ Hopper fp8 accumulation emulation


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PROMOTE: tl.constexpr,
):
    # One output tile, K loop. PROMOTE: 0 = accumulate in the dot (acc = dot(a, b, acc)),
    # 1 = explicit fp32 promotion per block (acc += dot(a, b)), 2 = the same
    # through max_num_imprecise_acc=BK.
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + (k0 + rk)[:, None] * BN + rn[None, :])
        if PROMOTE == 0:
            acc = tl.dot(a, b, acc)
        elif PROMOTE == 1:
            acc += tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


FP8_K = 4096


def _fp8_gemm(a, b, promote: int) -> torch.Tensor:
    c = torch.full((a.shape[0], b.shape[1]), float("nan"))
    _fp8_gemm_kernel[(1,)](a, b, c, FP8_K, BM=a.shape[0], BN=b.shape[1], BK=32, PROMOTE=promote)
    return c


@pytest.fixture(scope="module")
def fp8_operands():
    # Positive values: the sum grows over K, as in a GEMM with a large K
    # (4096 = 128 wgmma instructions), where a 14-bit accumulator loses most.
    g = torch.Generator().manual_seed(9)
    a = (torch.rand(64, FP8_K, generator=g) * 1.5 + 0.5).to(torch.float8_e4m3fn)
    b = (torch.rand(FP8_K, 32, generator=g) * 1.5 + 0.5).to(torch.float8_e4m3fn)
    exact = decode_bits(a) @ decode_bits(b)  # float64: products exact, error ~1e-16
    return a, b, exact


def _rel_err(c, exact) -> float:
    return float(((c.to(torch.float64) - exact).abs() / exact.abs()).max())


#: Max relative error allowed of an FP8 GEMM with fp32 accumulation here. Promoted
#: per 32-element instruction, each partial loses < 2**-13 of itself: < 2**-13
#: overall; 128 unpromoted steps lose ~64 * 2**-14 on average (measured ~4e-3).
FP8_BOUND = 2.0**-12


def test_fp8_imprecise_accumulation_fails_a_gemm_without_promotion(fixed, fp8_operands):
    a, b, exact = fp8_operands
    # Off (the default): every variant is fp32-accurate.
    for promote in (0, 1, 2):
        assert _rel_err(_fp8_gemm(a, b, promote), exact) < 2.0**-20, promote
    with triton_interpreter.fp8_imprecise_accumulation():
        no_promotion = _rel_err(_fp8_gemm(a, b, 0), exact)
        promoted = _rel_err(_fp8_gemm(a, b, 1), exact)
        via_option = _rel_err(_fp8_gemm(a, b, 2), exact)
    assert no_promotion > 4 * FP8_BOUND, f"unpromoted fp8 GEMM error {no_promotion:.2e}"
    assert promoted < FP8_BOUND, f"promoted fp8 GEMM error {promoted:.2e}"
    assert via_option < FP8_BOUND, f"max_num_imprecise_acc GEMM error {via_option:.2e}"
    assert promoted > 2.0**-20  # the per-instruction truncation is really modelled
    # Truncation toward zero: the unpromoted result is biased low.
    assert bool((_fp8_gemm(a, b, 0) <= exact.float()).all())
    # And the interpreter is back to normal after the context.
    assert _rel_err(_fp8_gemm(a, b, 0), exact) < 2.0**-20


def test_fp8_imprecise_accumulation_leaves_other_dots_alone(fixed):
    g = torch.Generator().manual_seed(10)
    a = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    plain = _matmul(a, b)
    with triton_interpreter.fp8_imprecise_accumulation(mantissa_bits=3):
        assert_bitwise_equal(_matmul(a, b), plain, name="bf16 dot under the fp8 emulation")


def test_fp8_imprecise_accumulation_arguments(fixed):
    opts = _interp.interpreter_builder.options
    with pytest.raises(ValueError, match=r"mantissa_bits must be in \[1, 23\]"):
        with triton_interpreter.fp8_imprecise_accumulation(mantissa_bits=0):
            pass
    with triton_interpreter.fp8_imprecise_accumulation():
        assert _interp.interpreter_builder.options.max_num_imprecise_acc_default == 2**30
        with pytest.raises(RuntimeError, match="already active"):
            with triton_interpreter.fp8_imprecise_accumulation():
                pass
    assert _interp.interpreter_builder.options is opts
    triton_interpreter.revert()
    with pytest.raises(RuntimeError, match=r"needs triton_interpreter.apply\(\) first"):
        with triton_interpreter.fp8_imprecise_accumulation():
            pass
