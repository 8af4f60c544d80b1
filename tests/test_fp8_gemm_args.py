"""The grouped-GEMM argument builder (per-expert problem shapes and pointer
arrays from the expert offsets): its CPU backend and its Triton kernel
(compass_kernels/fp8/triton_args.py, in the interpreter on CPU tensors),
against addresses computed here from the tensors, with planted bugs."""

from __future__ import annotations

import pytest
import torch

from compass_kernels.fp8.grouped_gemm import PTR_ROWS, grouped_args_op
from compass_kernels.testing import assert_bitwise_equal, empty_poisoned
from tests.tiers import device_for

BACKENDS = ["cpp", pytest.param("triton", marks=pytest.mark.triton)]


def _operands(counts, n=48, k=256, out_dtype=torch.bfloat16, seed=0, device="cpu"):
    """Tensors of the right shapes and strides (values are never read), some
    of them strided views, so every byte stride enters the addresses."""
    g = torch.Generator().manual_seed(seed)
    e, m, kb = len(counts), int(sum(counts)), -(-k // 128)
    a_q = torch.empty(m, k + 32, dtype=torch.float8_e4m3fn, device=device)[:, :k]  # padded rows
    a_s = torch.rand(kb, m, generator=g).to(device).t()  # MN-major
    b_q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
    b_s = torch.rand(e, -(-n // 128), kb, generator=g).to(device)
    off = torch.zeros(e + 1, dtype=torch.int64)
    off[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    out = torch.empty(m, n + 8, dtype=out_dtype, device=device)[:, :n]
    return a_q, a_s, b_q, b_s, off.to(device), out


def _expected(a_q, a_s, b_q, b_s, off, out):
    e = b_q.shape[0]
    off = off.cpu()
    lo = off[:-1]
    shapes = torch.stack(
        [off.diff(), torch.full((e,), b_q.shape[1]), torch.full((e,), a_q.shape[1])], 1
    ).to(torch.int32)
    ex = torch.arange(e)
    rows = {
        "a": a_q.data_ptr() + lo * a_q.stride(0),
        "b": b_q.data_ptr() + ex * b_q.stride(0),
        "a_scales": a_s.data_ptr() + lo * a_s.stride(0) * 4,
        "b_scales": b_s.data_ptr() + ex * b_s.stride(0) * 4,
        "out": out.data_ptr() + lo * out.stride(0) * out.element_size(),
    }
    return shapes, torch.stack([rows[r] for r in PTR_ROWS])


NAMES = ("a_q", "a_scales", "b_q", "b_scales", "expert_offsets", "gemm_out")  # _operands', by name


def _run(args, backend):
    e, dev = args[2].shape[0], args[0].device
    outs = (
        empty_poisoned((e, 3), torch.int32, device=dev),
        empty_poisoned((5, e), torch.int64, device=dev),
    )
    res = grouped_args_op.run(**dict(zip(NAMES, args, strict=True)), backend=backend, out=outs)
    return [t.cpu() for t in res]


# More experts than one program of the builder (128), empty ones first, in
# the middle and last; fresh random counts.
COUNTS = [
    [5],
    [0, 3, 0, 0, 7, 0],
    [(i * 7) % 5 if i % 9 else 0 for i in range(130)],
    torch.randint(0, 40, (257,), generator=torch.Generator().manual_seed(3)).tolist(),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", COUNTS, ids=len)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_builder_matches_addresses(backend, counts, out_dtype):
    args = _operands(counts, out_dtype=out_dtype, device=device_for(backend))
    shapes, ptrs = _run(args, backend)
    want_shapes, want_ptrs = _expected(*args)
    assert_bitwise_equal(shapes, want_shapes)
    assert_bitwise_equal(ptrs, want_ptrs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_builder_checks_arguments(backend):
    dev = device_for(backend)
    args = _operands([2, 3], device=dev)
    kw = dict(zip(NAMES, args, strict=True))
    shapes = torch.empty(2, 3, dtype=torch.int32, device=dev)
    ptrs = torch.empty(5, 2, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="shapes: expected dtype int32"):
        grouped_args_op.run(**kw, backend=backend, out=(shapes.long(), ptrs))
    with pytest.raises(ValueError, match="ptrs: expected size 5"):
        grouped_args_op.run(**kw, backend=backend, out=(shapes, ptrs[:4]))
    with pytest.raises(ValueError, match=r"b_q: expected size 256 \(K = a_q.shape\[1\]\)"):
        grouped_args_op.run(
            **(kw | {"b_q": args[2][:, :, :100]}), backend=backend, out=(shapes, ptrs)
        )
    if backend != "cpp":  # the GPU builder never reads offsets on the host (no sync)
        return
    with pytest.raises(ValueError, match=r"expert_offsets: expected expert_offsets\[-1\]"):
        grouped_args_op.run(
            **(kw | {"expert_offsets": torch.tensor([0, 2, 4])}),
            backend=backend,
            out=(shapes, ptrs),
        )


# Planted bugs in the Triton builder (tests/mutants.py): each must fail
# test_builder_matches_addresses.
MUTANTS = {
    # the last expert of the grid left unwritten (poisoned)
    "guard_off_by_one": ("mask = e < E", "mask = e < E - 1"),
    # M_e = off[e + 1]: the end, not the count
    "count_is_the_end": ("(hi - lo).to(tl.int32)", "hi.to(tl.int32)"),
    # the output's rows stepped with the activations' byte stride
    "d_with_a_stride": ("d + lo * d_row", "d + lo * a_row"),
    # the scale stride in elements, not bytes (wrapper side)
    "sfa_stride_in_elements": ("a_scales.stride(0) * 4,", "a_scales.stride(0),"),
}


@pytest.mark.triton
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_triton_builder_catches_planted_bugs(mutant):
    from compass_kernels.fp8 import triton_args
    from tests.mutants import planted

    old, new = MUTANTS[mutant]
    with planted(grouped_args_op, "triton", triton_args, "grouped_args_triton", old=old, new=new):
        with pytest.raises(AssertionError):
            for counts in COUNTS[1:3]:
                test_builder_matches_addresses("triton", counts, torch.bfloat16)
    test_builder_matches_addresses("triton", COUNTS[2], torch.bfloat16)  # restored
