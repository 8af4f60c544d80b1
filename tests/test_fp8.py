"""ck.fp8 quantization: every backend bit for bit against the reference, the e4m3
conversion over every tie and boundary, layouts, bad inputs, op registration.

Backends: torch (CPU, vectorised), Triton (interpreter on CPU tensors without
a GPU, marker triton; CUDA tensors on a device). The permutation is in
test_fp8_permute.py.
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.fp8 import quantize_op
from compass_kernels.fp8.reference import (
    dequantize_reference,
    quantize_reference,
    to_e4m3,
)
from compass_kernels.testing import assert_bitwise_equal, make_generator, poison_

TRITON = pytest.param("triton", marks=pytest.mark.triton)
BACKENDS = ["torch", TRITON]
LAYOUTS = list(ck.fp8.SCALE_LAYOUTS)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.cpu()


def dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major CPU copy (strides of size-1 dims included)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.cpu())


def make_weight(rows, cols, dtype, seed, device="cpu"):
    """Gaussian weights with per-row magnitudes spanning 2^-12..2^4 (blocks of
    very different scales), an all-zero block, and a block of exact zeros and
    tiny values (scale at the floor)."""
    g = make_generator(seed)
    row_scale = torch.exp2(torch.randint(-12, 5, (rows, 1), generator=g))
    w = torch.randn(rows, cols, generator=g) * row_scale
    if rows > 128 and cols > 128:
        w[:128, 128:256] = 0
    if rows > 2:
        w[-2:, :] = 1e-7
    return w.to(dtype).to(device)


def run_quantize(x, block_rows, eps, ue8m0, use_div, layout, backend):
    """Through the op with poisoned outputs: an element a kernel skips shows."""
    code = ck.fp8.SCALE_LAYOUTS[layout]
    args = dict(
        x=x,
        block_rows=block_rows,
        block_cols=128,
        eps=eps,
        ue8m0=ue8m0,
        use_div=use_div,
        scale_layout=code,
    )
    q, s = quantize_op.outputs(**args)
    poison_(q)
    poison_(s)
    return quantize_op.run(**args, backend=backend, out=(q, s))


# --------------------------------------------------------- e4m3 conversion


def conversion_cases() -> torch.Tensor:
    """fp32 values in [-448, 448]: every finite bf16, every e4m3 value, the exact
    midpoints between neighbours (ties: half must go down, half up), each
    midpoint +- 1 ulp, the subnormal grid and its midpoints, random fp32 bits."""
    all16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = [all16.float()]
    e4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[torch.isfinite(e4)].unique()
    mid = (e4[1:].double() + e4[:-1].double()) / 2  # exact in fp32: 5 significant bits
    mid = mid.float()
    vals += [
        e4,
        mid,
        torch.nextafter(mid, torch.tensor(float("inf"))),
        torch.nextafter(mid, torch.tensor(float("-inf"))),
    ]
    sub = torch.arange(0, 17, dtype=torch.float32) * 2.0**-10  # grid and midpoints
    vals += [sub, -sub, torch.tensor([2.0**-6, 2.0**-7, 1e-30, 1e-45, 447.9, 447.99, 448.0])]
    g = make_generator(5)
    r = torch.randint(0, 0x43E00000, (20000,), generator=g, dtype=torch.int32).view(torch.float32)
    vals.append(torch.cat([r, -r]))
    v = torch.cat(vals)
    return v[torch.isfinite(v) & (v.abs() <= 448)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_e4m3_conversion_every_tie_and_boundary(backend, backend_device):
    """Rows of 128 whose first element is 448: the scale is exactly 1, so each
    value is converted as is (x / 1). Torch's own cast (RNE, then our clamp) is
    the oracle for the hand-written bit conversion of each backend."""
    v = conversion_cases()
    per_row = 127
    n = -(-v.numel() // per_row) * per_row
    v = torch.cat([v, torch.zeros(n - v.numel())]).reshape(-1, per_row)
    x = torch.cat([torch.full((v.shape[0], 1), 448.0), v], dim=1)
    if backend == "triton":  # interpreter cost: a subset that still holds every tie
        x = torch.cat([x[:40], x[-200:]])
    q, s = run_quantize(x.to(backend_device), 1, 1e-10, False, True, "k_major", backend)
    assert torch.equal(s.cpu(), torch.ones_like(s.cpu()))
    assert_bitwise_equal(bits(q), to_e4m3(x).view(torch.uint8), name="q")


def test_e4m3_reference_is_round_to_nearest_even():
    """The oracle itself, from first principles: ties of neighbours go to the
    even mantissa, values past 448 saturate, the subnormal step is 2^-9."""
    x = torch.tensor([1.0 + 1 / 16, 1.0 + 3 / 16, 2.0**-9 * 0.5, 2.0**-9 * 1.5, 460.0, -1e6])
    assert to_e4m3(x).float().tolist() == [1.0, 1.25, 0.0, 2.0**-8, 448.0, -448.0]


# ------------------------------------------------------------ quantization


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 129), (128, 128), (200, 300), (300, 131)])
def test_weight_blocks_match_reference(backend, dtype, shape, backend_device):
    w = make_weight(*shape, dtype, seed=shape[0] * 7 + shape[1])
    q, s = run_quantize(w.to(backend_device), 128, 1e-4, False, False, "k_major", backend)
    rq, rs = quantize_reference(w, 128, 128, eps=1e-4)
    assert_bitwise_equal(s.cpu(), rs, name="scales")
    assert_bitwise_equal(bits(q), rq.view(torch.uint8), name="q")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_flags_and_layouts(backend, ue8m0, layout, backend_device):
    w = make_weight(257, 390, torch.bfloat16, seed=11)
    q, s = run_quantize(w.to(backend_device), 128, 1e-4, ue8m0, False, layout, backend)
    rq, rs = quantize_reference(w, 128, 128, eps=1e-4, ue8m0=ue8m0)
    assert_bitwise_equal(dense(s), rs, name="scales")
    assert_bitwise_equal(bits(q), rq.view(torch.uint8), name="q")
    if ue8m0:
        m, _ = torch.frexp(rs)
        assert torch.all(m == 0.5), "UE8M0 scales are powers of two"


# Every dtype at every shape; flags and layouts rotate so each pairing appears.
GROUP_CASES = [
    (dtype, i % 2 == 1, LAYOUTS[(i // 2) % 3], shape)
    for i, (dtype, shape) in enumerate(
        (d, s) for d in DTYPES for s in [(1, 128), (5, 7), (33, 384), (61, 300)]
    )
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "ue8m0", "layout", "shape"), GROUP_CASES)
def test_token_groups_match_reference(backend, dtype, ue8m0, layout, shape, backend_device):
    x = make_weight(*shape, dtype, seed=shape[0] + shape[1])
    x[0] = 0  # a zero row: every group at the floor
    q, s = run_quantize(x.to(backend_device), 1, 1e-10, ue8m0, True, layout, backend)
    rq, rs = quantize_reference(x, 1, 128, eps=1e-10, ue8m0=ue8m0, use_div=True)
    assert_bitwise_equal(dense(s), rs, name="scales")
    assert_bitwise_equal(bits(q), rq.view(torch.uint8), name="q")


def near_ties(amaxes=(3.0, 0.3, 11.0, 1.7)) -> torch.Tensor:
    """Rows of 128: amax first, then e4m3 midpoints times the row's scale
    amax / 448 (inexact), so x / s and x * (1 / s) straddle rounding boundaries."""
    e4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[torch.isfinite(e4) & (e4 > 0)].unique()
    mid = ((e4[1:].double() + e4[:-1].double()) / 2).float()
    pad = torch.zeros(127 - mid.numel())
    rows = [torch.cat([torch.tensor([a]), mid * (torch.tensor(a) / 448), pad]) for a in amaxes]
    return torch.stack(rows)


def test_division_and_reciprocal_conventions_differ():
    """The two conventions are not interchangeable near rounding boundaries:
    each op uses its engine's (blockwise: x * (1/s), token groups: x / s)."""
    x = near_ties()
    q_div, _ = quantize_reference(x, 1, 128, eps=1e-10, use_div=True)
    q_rcp, _ = quantize_reference(x, 1, 128, eps=1e-10, use_div=False)
    assert (q_div.view(torch.uint8) != q_rcp.view(torch.uint8)).sum() > 20
    q = ck.fp8.quantize_token_groups(x)[0]
    assert torch.equal(q.view(torch.uint8), q_div.view(torch.uint8))
    w = near_ties((3.0,) * 128)  # one 128x128 block, every row at amax 3
    q_rcp, _ = quantize_reference(w, 128, 128, eps=1e-4, use_div=False)
    q_div, _ = quantize_reference(w, 128, 128, eps=1e-4, use_div=True)
    assert (q_div.view(torch.uint8) != q_rcp.view(torch.uint8)).sum() > 20
    assert torch.equal(ck.fp8.quantize_blockwise(w)[0].view(torch.uint8), q_rcp.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_max_in_any_row(backend, backend_device):
    """Eight 128x128 blocks, the max of block j in row 17 j (every row residue
    mod 8: the CUDA kernel's 8 warps each hold one), and a negative max."""
    g = make_generator(8)
    w = torch.rand(128, 8 * 128, generator=g) * 2 - 1
    for j in range(8):
        w[17 * j, 128 * j + 5 * j] = (-1) ** j * (50.0 + j)
    q, s = run_quantize(w.to(backend_device), 128, 1e-4, False, False, "k_major", backend)
    rq, rs = quantize_reference(w, 128, 128, eps=1e-4)
    assert_bitwise_equal(dense(s), rs, name="scales")
    assert_bitwise_equal(bits(q), rq.view(torch.uint8), name="q")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_div", [False, True])
def test_near_ties_per_convention(backend, use_div, backend_device):
    x = near_ties()
    q, s = run_quantize(x.to(backend_device), 1, 1e-10, False, use_div, "k_major", backend)
    rq, rs = quantize_reference(x, 1, 128, eps=1e-10, use_div=use_div)
    assert_bitwise_equal(dense(s), rs, name="scales")
    assert_bitwise_equal(bits(q), rq.view(torch.uint8), name="q")


def test_scale_layout_strides():
    """K-major is row-major, MN-major column-major, TMA-aligned pads columns to 4."""
    x = torch.randn(10, 300)
    assert ck.fp8.quantize_token_groups(x)[1].stride() == (3, 1)
    assert ck.fp8.quantize_token_groups(x, scale_layout="mn_major")[1].stride() == (1, 10)
    assert ck.fp8.quantize_token_groups(x, scale_layout="mn_major_tma")[1].stride() == (1, 12)
    s = ck.fp8.quantize_blockwise(torch.randn(300, 260), scale_layout="mn_major")[1]
    assert s.shape == (3, 3) and s.stride() == (1, 3)


def test_zero_blocks_and_floor():
    """An all-zero block gets scale eps / 448 and zero bytes (no NaN from 0 / 0)."""
    w = torch.zeros(130, 260, dtype=torch.bfloat16)
    w[129, 259] = 3.0
    q, s = ck.fp8.quantize_blockwise(w)
    floor = torch.tensor(1e-4, dtype=torch.float32) / 448
    assert torch.equal(s[0], floor.expand(3)) and torch.equal(s[1, :2], floor.expand(2))
    assert s[1, 2] == torch.tensor(3.0) / 448
    assert int(q.view(torch.uint8)[:129].abs().sum()) == 0
    assert q[129, 259].float() == 448.0


def test_3d_weights_quantize_per_expert():
    w = make_weight(3 * 200, 260, torch.bfloat16, seed=4).reshape(3, 200, 260)
    q, s = ck.fp8.quantize_blockwise(w)
    assert q.shape == w.shape and s.shape == (3, 2, 3)
    for e in range(3):
        rq, rs = quantize_reference(w[e], 128, 128, eps=1e-4)
        assert torch.equal(q[e].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s[e], rs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_round_trip(dtype):
    w = make_weight(200, 300, dtype, seed=9)
    q, s = ck.fp8.quantize_blockwise(w, scale_layout="mn_major")
    deq = ck.fp8.dequantize(q, s)
    assert torch.equal(deq, dequantize_reference(q, s.contiguous(), 128, 128))
    wf = w.float()
    # Half an e4m3 ulp: 2^-4 relative for normals, 2^-10 * scale in the subnormals.
    # (1 + 2^-20): q is rounded from x * fl(1 / s), not x / s.
    step = dequantize_reference(torch.ones_like(q), s.contiguous(), 128, 128)
    bound = torch.maximum(wf.abs() * 2.0**-4, step * 2.0**-10) * (1 + 2.0**-20)
    assert torch.all((deq - wf).abs() <= bound)
    assert ck.fp8.dequantize(q, s, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    x = make_weight(9, 260, dtype, seed=1)
    qx, sx = ck.fp8.quantize_token_groups(x)
    deq = ck.fp8.dequantize(qx, sx, block=(1, 128))
    assert torch.equal(deq, dequantize_reference(qx, sx, 1, 128))


def test_strided_input_rows():
    """A row-strided view (a slice of a wider tensor) needs no copy and gives the same bits."""
    big = make_weight(200, 512, torch.bfloat16, seed=2)
    view = big[:, 50:350]
    assert view.stride() == (512, 1)
    q, s = ck.fp8.quantize_blockwise(view)
    rq, rs = quantize_reference(view.contiguous(), 128, 128, eps=1e-4)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


# ------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("backend", [None, TRITON])
def test_non_finite_input_is_an_error(bad, backend):
    w = torch.randn(150, 140, dtype=torch.bfloat16)
    w[131, 7] = bad
    match = r"w: expected finite values, got .* at (index 18347|\[131, 7\])"
    with pytest.raises(ValueError, match=match):
        ck.fp8.quantize_blockwise(w, backend=backend)
    x = torch.randn(5, 140)
    x[3, 139] = bad
    with pytest.raises(ValueError, match=r"x: expected finite values"):
        ck.fp8.quantize_token_groups(x, backend=backend)


def test_bad_arguments_name_the_argument():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"w: expected dtype float32 \| bfloat16 \| float16"):
        ck.fp8.quantize_blockwise(w.int())
    with pytest.raises(ValueError, match=r"w: expected a 2 or 3-d tensor"):
        ck.fp8.quantize_blockwise(w[0])
    with pytest.raises(ValueError, match=r"eps: expected a float in \[1e-30, 1\]"):
        ck.fp8.quantize_blockwise(w, eps=0.0)
    with pytest.raises(ValueError, match=r"scale_layout: expected one of"):
        ck.fp8.quantize_token_groups(w, scale_layout="row")
    with pytest.raises(ValueError, match=r"block: expected a pair of positive ints"):
        ck.fp8.quantize_blockwise(w, block=(0, 128))
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor"):
        ck.fp8.quantize_token_groups([1.0])
    with pytest.raises(ValueError, match=r"scales: expected shape \[1, 1\]"):
        ck.fp8.dequantize(ck.fp8.quantize_blockwise(w)[0], torch.ones(2, 1))


def test_torch_backend_takes_any_block():
    """The Triton kernels take the engine blocks (1, 128) and (128, 128) only;
    the torch backend (CPU) and the reference take any."""
    x = torch.randn(8, 64)
    q, s = ck.fp8.quantize_blockwise(x, block=(3, 64))
    rq, rs = quantize_reference(x, 3, 64, eps=1e-4)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


# -------------------------------------------------------------- registration


def test_opcheck_registered_op():
    x = make_weight(130, 260, torch.bfloat16, seed=6)
    for args in [(x, 128, 128, 1e-4, False, False, 0), (x, 1, 128, 1e-10, True, True, 2)]:
        torch.library.opcheck(torch.ops.compass.fp8_quantize.default, args)


def test_registered_op_traces_under_torch_compile():
    import torch._dynamo

    assert not torch._dynamo.config.disable, "dynamo is off here (a live vLLM engine?)"
    x = make_weight(33, 260, torch.bfloat16, seed=7)
    fn = torch.compile(
        lambda t: ck.fp8.quantize_token_groups(t * 2.0, scale_layout="mn_major_tma"),
        backend="eager",
        fullgraph=True,
    )
    q, s = fn(x)
    rq, rs = quantize_reference(x * 2.0, 1, 128, eps=1e-10, use_div=True)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert s.stride() == (1, 36)


# ------------------------------------------- division without a division


def division_rows(seed: int) -> torch.Tensor:
    """float32 rows of 128 whose x / s lands on an e4m3 midpoint and one ulp
    either side of it (x = RN(m * s), its neighbours; random signs), the row's
    amax first: amaxes spread over 2^-100..2^100, and rows 40..47 tiny (amax
    1e-30..1e-18 with eps 1e-30: scales below 2^-64, the rescaled path), in
    the middle 32-row tile (mixed) while the other tiles are all normal."""
    g = make_generator(seed)
    e4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[torch.isfinite(e4) & (e4 > 0)].unique()
    mid = ((e4[1:].double() + e4[:-1].double()) / 2).float()
    rows = []
    for i in range(72):
        if 40 <= i < 48:
            amax = 10.0 ** (-30 + 12 * torch.rand((), generator=g).item())
        else:
            amax = 2.0 ** (200 * torch.rand((), generator=g).item() - 100)
        a = torch.tensor(amax, dtype=torch.float32)
        s = a / 448
        v = mid * s
        up = torch.nextafter(v, torch.tensor(float("inf")))
        cand = torch.cat([v, up, torch.nextafter(v, torch.tensor(0.0))])
        cand = cand[cand.abs() < a]
        pick = cand[torch.randint(0, cand.numel(), (127,), generator=g)]
        sign = torch.where(torch.rand(127, generator=g) < 0.5, -1.0, 1.0)
        rows.append(torch.cat([a.reshape(1), pick * sign]))
    return torch.stack(rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quotient_without_division_is_div_rn(backend, backend_device):
    """The kernels' x / s from one reciprocal per group and two fma corrections
    gives the correctly rounded quotient's e4m3 bytes at every midpoint and its
    neighbours, at scales from 2^-108 to 2^91 (the reference divides)."""
    x = division_rows(41)
    q, s = run_quantize(x.to(backend_device), 1, 1e-30, False, True, "k_major", backend)
    rq, rs = quantize_reference(x, 1, 128, eps=1e-30, use_div=True)
    assert_bitwise_equal(dense(s), rs, name="scales")
    assert_bitwise_equal(bits(q), rq.view(torch.uint8), name="q")
    # the same rows as one 128-wide block column of 128 x 128 blocks, both conventions
    w = torch.cat([x, division_rows(42)[:56]])
    w[64:] /= 2.0**40  # the second block: scale < 2^-64
    for use_div in (True, False):
        q, s = run_quantize(w.to(backend_device), 128, 1e-30, False, use_div, "k_major", backend)
        rq, rs = quantize_reference(w, 128, 128, eps=1e-30, use_div=use_div)
        assert_bitwise_equal(dense(s), rs, name="scales")
        assert_bitwise_equal(bits(q), rq.view(torch.uint8), name=f"q use_div={use_div}")
