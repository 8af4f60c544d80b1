"""The grouped GEMM's argument builder on the GPU (Triton): per-expert problem
shapes and pointer arrays from the expert offsets, on the device.

What the CUTLASS pointer-array grouped GEMM (csrc/fp8/grouped_gemm_sm90.cuh)
reads: ``shapes`` [E, 3] int32 = (M_e, N, K) per expert (CUTLASS's
``GroupProblemShape<Shape<int, int, int>>``) and ``ptrs`` [5, E] int64, the
rows of ``grouped_gemm.PTR_ROWS`` (A, B, SFA, SFB, D addresses of expert e: the base
address plus ``off[e]`` rows, or ``e`` experts, times the byte stride).
Same layout as the CPU builder (``fp8.grouped_args_cpu``, compass/fp8.h:
group_args), which the tests hold it to.

One launch, a fixed grid from E alone, the offsets never leave the device: no
host sync, and the launch (its addresses are kernel arguments) is captured in a
CUDA graph with the GEMM that follows. Runs on CUDA tensors, and on CPU tensors
under ``TRITON_INTERPRET=1`` (tests/test_fp8_gemm_args.py); compiles ahead of
time for sm_90a (tests/test_fp8_gemm_args.py::test_builder_compiles_for_sm90).
"""

from __future__ import annotations

import triton
import triton.language as tl

from compass_kernels._ext import load

__all__ = ["grouped_args_triton", "launch_grouped_args", "aot_variants", "BLOCK", "LAUNCH"]
#: Experts per program (E is 8..384 in MoE models: one or a few programs).
BLOCK = 128
#: Launch options (the sm_90a compile check uses exactly these).
LAUNCH = {"num_warps": 4}


@triton.jit(do_not_specialize=["a", "b", "sfa", "sfb", "d"])
def _grouped_args_kernel(
    off_ptr,
    shapes_ptr,
    ptrs_ptr,
    E,
    a,
    b,
    sfa,
    sfb,
    d,
    a_row,
    b_expert,
    sfa_row,
    sfb_expert,
    d_row,
    N,
    K,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = e < E
    lo = tl.load(off_ptr + e, mask=mask, other=0)
    hi = tl.load(off_ptr + e + 1, mask=mask, other=0)
    ones = tl.full((BLOCK,), 1, tl.int32)
    tl.store(shapes_ptr + 3 * e, (hi - lo).to(tl.int32), mask=mask)
    tl.store(shapes_ptr + 3 * e + 1, ones * N, mask=mask)
    tl.store(shapes_ptr + 3 * e + 2, ones * K, mask=mask)
    # Addresses as int64 sums (the base fits int64; so does every address in the tensor).
    tl.store(ptrs_ptr + 0 * E + e, a + lo * a_row, mask=mask)
    tl.store(ptrs_ptr + 1 * E + e, b + e * b_expert, mask=mask)
    tl.store(ptrs_ptr + 2 * E + e, sfa + lo * sfa_row, mask=mask)
    tl.store(ptrs_ptr + 3 * E + e, sfb + e * sfb_expert, mask=mask)
    tl.store(ptrs_ptr + 4 * E + e, d + lo * d_row, mask=mask)


def kernel_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs):
    """(grid, the kernel's arguments, constexprs): the layout the CPU builder
    reads (csrc/fp8/grouped_args_cpu.cpp: grouped_layout), from metadata only."""
    e = b_q.shape[0]
    args = (
        expert_offsets,
        shapes,
        ptrs,
        e,
        a_q.data_ptr(),
        b_q.data_ptr(),
        a_scales.data_ptr(),
        b_scales.data_ptr(),
        out.data_ptr(),
        a_q.stride(0),  # e4m3: one byte per element
        b_q.stride(0),
        a_scales.stride(0) * 4,
        b_scales.stride(0) * 4,
        out.stride(0) * out.element_size(),
        b_q.shape[1],
        a_q.shape[1],
    )
    return (triton.cdiv(e, BLOCK),), args, {"BLOCK": BLOCK}


def launch_grouped_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs) -> None:
    """The launch alone (the CUTLASS path: its operands were checked by
    ``grouped_gemm``, and the CUTLASS entry checks ``shapes`` / ``ptrs``), on
    the current device and stream."""
    grid, args, meta = kernel_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs)
    _grouped_args_kernel[grid](*args, **meta, **LAUNCH)


def grouped_args_triton(*, a_q, a_scales, b_q, b_scales, expert_offsets, gemm_out, shapes, ptrs):
    """The op's ``triton`` backend (arguments and outputs by name): the C++
    argument checks (the ones the CPU builder and the CUTLASS entry run, naming
    the argument), then the launch."""
    ext = load().fp8
    ext.check_grouped_args(a_q, a_scales, b_q, b_scales, expert_offsets, gemm_out, shapes, ptrs)
    launch_grouped_args(a_q, a_scales, b_q, b_scales, expert_offsets, gemm_out, shapes, ptrs)


def aot_variants() -> list[tuple[object, dict[str, str], dict[str, object], dict[str, int]]]:
    """(kernel, signature, constexprs, launch options) of the one variant the
    wrapper launches (tests/test_fp8_build.py compiles it for sm_90a)."""
    sig = {
        "off_ptr": "*i64",
        "shapes_ptr": "*i32",
        "ptrs_ptr": "*i64",
        "E": "i32",
        "a": "i64",
        "b": "i64",
        "sfa": "i64",
        "sfb": "i64",
        "d": "i64",
        "a_row": "i64",
        "b_expert": "i64",
        "sfa_row": "i64",
        "sfb_expert": "i64",
        "d_row": "i64",
        "N": "i32",
        "K": "i32",
        "BLOCK": "constexpr",
    }
    return [(_grouped_args_kernel, sig, {"BLOCK": BLOCK}, LAUNCH)]
