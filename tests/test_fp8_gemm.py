"""ck.fp8.grouped_gemm: every backend against the float64 reference.

Backends on CPU tensors: torch (float32 dequantise + matmul) and triton (the interpreter).
Problems come from ck.fp8's reference quantizer, token-packed with empty
experts, 1 / 127 / 128 / 129 tokens, K and N not multiples of 128, both
activation-scale layouts; outputs are poisoned (NaN) before each kernel runs.
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.fp8.grouped_gemm import OUT_DTYPES, grouped_gemm_op
from compass_kernels.testing import empty_poisoned
from tests.fp8_gemm_cases import (
    COUNTS,
    GPU_REL_ERR,
    check_close,
    hopper_accumulation_model,
    make_problem,
    offsets_of,
)
from tests.tiers import device_for

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


def _rel(backend):
    """Tolerance: exact fp32 sums on the CPU, Hopper's FP8 accumulation on a GPU."""
    return GPU_REL_ERR if device_for(backend) == "cuda" else 1e-5


OPERANDS = ("a_q", "a_scales", "b_q", "b_scales", "expert_offsets")  # make_problem's tuple, by name


def _run(args, backend, out_dtype=torch.bfloat16):
    m, n = args[0].shape[0], args[2].shape[1]
    dev = device_for(backend)
    out = empty_poisoned((m, n), out_dtype, dev)
    operands = {n: a.to(dev) for n, a in zip(OPERANDS, args, strict=True)}
    grouped_gemm_op.run(**operands, out_dtype=OUT_DTYPES[out_dtype], backend=backend, out=out)
    return out.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "counts,n,k",
    [(COUNTS, 160, 300), ((5,), 128, 128), ((0, 3, 0), 37, 129), ((0, 0), 64, 256)],
)
def test_matches_reference(backend, out_dtype, counts, n, k):
    args = make_problem(counts, n, k, seed=n + k)
    check_close(_run(args, backend, out_dtype), args, rel_err=_rel(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mn_major_activation_scales(backend):
    args = make_problem((2, 0, 70), 96, 384, seed=3, mn_major=True)
    assert args[1].stride(0) == 1  # column-major [M, K/128]
    check_close(_run(args, backend, torch.float32), args, rel_err=_rel(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_api(backend):
    args = make_problem((1, 9), 40, 200, seed=5)
    dev = device_for(backend)
    on = [a.to(dev) for a in args]
    out = ck.fp8.grouped_gemm(*on, backend=backend)
    assert out.dtype == torch.bfloat16 and out.shape == (10, 40)
    check_close(out.cpu(), args, rel_err=_rel(backend))
    mine = empty_poisoned((10, 40), torch.float32, dev)
    assert ck.fp8.grouped_gemm(*on, out_dtype=torch.float32, backend=backend, out=mine) is mine
    check_close(mine.cpu(), args, rel_err=_rel(backend))


def test_torch_backend_on_a_larger_problem():
    # K = 640 (5 scale blocks), 345 rows in two experts around an empty one.
    args = make_problem((300, 0, 45), 200, 640, seed=9)
    check_close(_run(args, "torch", torch.float32), args)


# ------------------------------------------------------------------ bad input

_GOOD = make_problem((2, 3), 16, 130, seed=1)


def _bad(**change):
    names = ("a_q", "a_scales", "b_q", "b_scales", "expert_offsets")
    args = dict(zip(names, _GOOD, strict=True))
    args.update(change)
    return [args[k] for k in names]


BAD = [
    ({"a_q": _GOOD[0].to(torch.float32)}, "a_q: expected dtype float8_e4m3fn"),
    ({"b_q": _GOOD[2][:, :, :128]}, "b_q: expected K = 130"),
    ({"a_scales": _GOOD[1][:, :1]}, "a_scales: expected shape"),
    ({"b_scales": _GOOD[3].to(torch.float64)}, "b_scales: expected dtype float32"),
    ({"b_scales": _GOOD[3][:, :, :1]}, "b_scales: expected shape"),
    ({"expert_offsets": _GOOD[4].to(torch.int32)}, "expert_offsets: expected dtype int64"),
    # weights and offsets for different expert counts: the weights are blamed (the
    # offsets come from the routing), both counts named
    (
        {"b_q": _GOOD[2][:1], "b_scales": _GOOD[3][:1]},
        r"b_q: expected weights for 2 experts in dim 0 \(expert_offsets has 3 = E \+ 1",
    ),
    ({"expert_offsets": _GOOD[4][:2]}, "b_q: expected weights for 1 experts in dim 0"),
    ({"expert_offsets": _GOOD[4][:1]}, "expert_offsets: expected E . 1 >= 2 elements"),
    ({"expert_offsets": _GOOD[4][None]}, "expert_offsets: expected a 1-d tensor"),
]
BAD_DATA = [
    (torch.tensor([0, 3, 2], dtype=torch.int64), "expert_offsets: expected non-decreasing"),
    (torch.tensor([1, 2, 5], dtype=torch.int64), r"expected expert_offsets\[0\] == 0"),
    (torch.tensor([0, 2, 4], dtype=torch.int64), r"expert_offsets: expected expert_offsets\[-1\]"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,match", BAD)
def test_bad_input_names_the_argument(backend, change, match):
    with pytest.raises(ValueError, match=match):
        ck.fp8.grouped_gemm(*_bad(**change), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offsets,match", BAD_DATA)
def test_bad_offsets_are_rejected(backend, offsets, match):
    with pytest.raises(ValueError, match=match):
        ck.fp8.grouped_gemm(*_bad(expert_offsets=offsets), backend=backend)


def test_bad_out_dtype_and_out():
    with pytest.raises(ValueError, match="out_dtype: expected"):
        ck.fp8.grouped_gemm(*_GOOD, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out: expected dtype bfloat16"):
        ck.fp8.grouped_gemm(*_GOOD, out=torch.empty(5, 16))


def test_offsets_from_counts_helper():
    assert offsets_of((0, 2, 0, 3)).tolist() == [0, 0, 2, 2, 5]


def test_opcheck():
    args = make_problem((3, 0, 2), 24, 140, seed=2)
    # test_schema is left out: torch's schema checker multiplies the inputs,
    # which CPU torch does not implement for float8_e4m3fn (NotImplementedError).
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.compass.fp8_grouped_gemm.default, (*args, 0, None), test_utils=utils
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_layout", ["k_major", "mn_major_tma"])
def test_consumes_permute_quantize_output(backend, scale_layout):
    """ck.fp8.permute_quantize's output (token-packed, int64 offsets, each scale
    layout it produces) feeds the GEMM directly."""
    g = torch.Generator().manual_seed(4)
    tokens, experts, top_k, n, k = 37, 6, 2, 72, 256
    x = torch.randn(tokens, k, generator=g)
    topk = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    p = ck.fp8.permute_quantize(x, topk, experts, scale_layout=scale_layout)
    b_q, b_s = ck.fp8.quantize_blockwise(torch.randn(experts, n, k, generator=g))
    args = (p.q, p.scales, b_q, b_s, p.expert_offsets)
    out = ck.fp8.grouped_gemm(*(a.to(device_for(backend)) for a in args), backend=backend)
    check_close(out.cpu(), args, rel_err=_rel(backend))


# ------------------------------------------------------------------ GPU

#: The GPU test problem (7 experts: empty first / middle / last, 1, 127, 128, 129 rows).
GPU_PROBLEM = dict(counts=COUNTS, n=256, k=512, seed=8)


def _gpu_problem():
    p = GPU_PROBLEM
    return make_problem(p["counts"], p["n"], p["k"], seed=p["seed"])


def test_gpu_tolerance_from_hopper_accumulation_model():
    """The GPU tolerance passes what a correct kernel computes under Hopper's FP8
    accumulation (14-bit partial sums, fp32 promotion every 128 of K) on the exact GPU
    test problem, where an exact-fp32 bound (1e-5) does not, and still fails the
    planted bugs: a dropped K block, swapped block scales."""
    args = _gpu_problem()
    model = hopper_accumulation_model(args)
    check_close(model, args, rel_err=GPU_REL_ERR)
    with pytest.raises(AssertionError, match="outputs off"):
        check_close(model, args, rel_err=1e-5)
    for bug in ("drop_block", "swap_scales"):
        with pytest.raises(AssertionError, match="outputs off"):
            check_close(hopper_accumulation_model(args, bug=bug), args, rel_err=GPU_REL_ERR)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backends_match_reference(backend):
    args = _gpu_problem()
    dev = [t.cuda() for t in args]
    out = empty_poisoned((args[0].shape[0], GPU_PROBLEM["n"]), torch.bfloat16, "cuda")
    grouped_gemm_op.run(
        **dict(zip(OPERANDS, dev, strict=True)), out_dtype=0, backend=backend, out=out
    )
    check_close(out.cpu(), args, rel_err=GPU_REL_ERR)


def test_cutlass_rejects_misaligned_views():
    """A view at an odd byte offset would reach TMA misaligned (CUTLASS skips its own
    per-group checks with device-side shapes): the public API refuses it for the
    CUTLASS backend, naming the argument, before any device work."""
    a_q, a_s, b_q, b_s, off = make_problem((3, 2), 64, 128, seed=1)
    wide = torch.cat([a_q.view(torch.uint8).new_zeros(1, 128), a_q.view(torch.uint8)])
    shifted = wide.view(-1)[1 : 1 + a_q.numel()].view(a_q.shape).view(torch.float8_e4m3fn)
    assert shifted.data_ptr() % 16
    with pytest.raises(ValueError, match=r"a_q: the CUTLASS kernel .* 16-byte aligned"):
        ck.fp8.grouped_gemm(shifted, a_s, b_q, b_s, off, backend="cuda")
    b_shift = torch.cat([b_q.view(torch.uint8).reshape(-1), b_q.new_zeros(16).view(torch.uint8)])
    b_mis = b_shift[8 : 8 + b_q.numel()].view(b_q.shape).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"b_q: the CUTLASS kernel"):
        ck.fp8.grouped_gemm(a_q, a_s, b_mis, b_s, off, backend="cuda")
    # The reference-served backends take the same views.
    ck.fp8.grouped_gemm(shifted.contiguous(), a_s, b_q, b_s, off)
