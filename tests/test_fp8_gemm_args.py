"""The grouped-GEMM argument builder (per-expert problem shapes and pointer
arrays from the expert offsets): its CPU twin and its CUDA kernel run by the
emulator, against addresses computed here from the tensors, with planted bugs."""

from __future__ import annotations

import pytest
import torch

from compass_kernels.fp8.grouped_gemm import PTR_ROWS, grouped_args_op
from compass_kernels.testing import assert_bitwise_equal, empty_poisoned
from tests import emu as _emu

BACKENDS = ["cpp", pytest.param("cuda-emulated", marks=pytest.mark.emulated)]


def _operands(counts, n=48, k=256, out_dtype=torch.bfloat16, seed=0):
    """Tensors of the right shapes and strides (values are never read), some
    of them strided views, so every byte stride enters the addresses."""
    g = torch.Generator().manual_seed(seed)
    e, m, kb = len(counts), int(sum(counts)), -(-k // 128)
    a_q = torch.empty(m, k + 32, dtype=torch.float8_e4m3fn)[:, :k]  # padded rows
    a_s = torch.rand(kb, m, generator=g).t()  # MN-major
    b_q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn)
    b_s = torch.rand(e, -(-n // 128), kb, generator=g)
    off = torch.zeros(e + 1, dtype=torch.int64)
    off[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    out = torch.empty(m, n + 8, dtype=out_dtype)[:, :n]
    return a_q, a_s, b_q, b_s, off, out


def _expected(a_q, a_s, b_q, b_s, off, out):
    e = b_q.shape[0]
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
    e = args[2].shape[0]
    outs = (empty_poisoned((e, 3), torch.int32), empty_poisoned((5, e), torch.int64))
    return grouped_args_op.run(**dict(zip(NAMES, args, strict=True)), backend=backend, out=outs)


# More experts than one block of the builder (128 threads), empty ones first,
# in the middle and last.
COUNTS = [
    [5],
    [0, 3, 0, 0, 7, 0],
    [(i * 7) % 5 if i % 9 else 0 for i in range(130)],
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", COUNTS, ids=len)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_builder_matches_addresses(backend, counts, out_dtype):
    args = _operands(counts, out_dtype=out_dtype)
    shapes, ptrs = _run(args, backend)
    want_shapes, want_ptrs = _expected(*args)
    assert_bitwise_equal(shapes, want_shapes)
    assert_bitwise_equal(ptrs, want_ptrs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_builder_checks_arguments(backend):
    args = _operands([2, 3])
    kw = dict(zip(NAMES, args, strict=True))
    shapes, ptrs = torch.empty(2, 3, dtype=torch.int32), torch.empty(5, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="shapes: expected dtype int32"):
        grouped_args_op.run(**kw, backend=backend, out=(shapes.long(), ptrs))
    with pytest.raises(ValueError, match="ptrs: expected size 5"):
        grouped_args_op.run(**kw, backend=backend, out=(shapes, ptrs[:4]))
    if backend != "cpp":  # the CUDA builder never reads offsets on the host (no sync)
        return
    with pytest.raises(ValueError, match=r"expert_offsets: expected expert_offsets\[-1\]"):
        grouped_args_op.run(**(kw | {"expert_offsets": torch.tensor([0, 2, 4])}),
                            backend=backend, out=(shapes, ptrs))  # fmt: skip


# Planted bugs (tests/test_fp8_gemm_args.mutants.cmake): each must fail
# test_builder_matches_addresses.
MUTANTS = {
    "fp8_gemm_args_guard_off_by_one": (_emu.OutOfBoundsError, "'expert_offsets'"),
    "fp8_gemm_args_runs_to_end": (AssertionError, None),
}


@pytest.mark.emulated
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_emulated_builder_catches_planted_bugs(mutant):
    error, match = MUTANTS[mutant]
    with _emu.mutant(mutant), pytest.raises(error, match=match):
        test_builder_matches_addresses("cuda-emulated", COUNTS[2], torch.bfloat16)
