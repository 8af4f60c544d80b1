"""The CUTLASS sm_90a grouped GEMM on a GPU, in its own process in the GPU runbook
(scripts/gpu_check.sh runs `-m cutlass` with CUDA_LAUNCH_BLOCKING=1, so a fault is
reported at the call that made it and cannot poison the other GPU tests): expert
counts on both sides of the workspace's alignment (3, 4, 7, 300), empty experts,
M = 0, and the C++ alignment checks behind the public API's."""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.fp8.grouped_gemm import grouped_gemm_op
from compass_kernels.testing import empty_poisoned
from tests.fp8_gemm_cases import GPU_REL_ERR, check_close, make_problem

pytestmark = [pytest.mark.gpu, pytest.mark.cutlass]

CASES = {
    "E3": (5, 64, 3),
    "E4": (130, 1, 0, 64),
    "E7": (0, 1, 127, 0, 128, 129, 0),
    "E300": tuple((i * 7) % 5 for i in range(300)),
    "zero_token_experts": (0, 0, 200, 0),
    "M0": (0, 0, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n,k", [(256, 512), (136, 144)])
def test_cutlass_matches_reference(case, n, k):
    args = make_problem(CASES[case], n, k, seed=len(CASES[case]) + n)
    dev = [t.cuda() for t in args]
    out = empty_poisoned((args[0].shape[0], n), torch.bfloat16, "cuda")
    names = ("a_q", "a_scales", "b_q", "b_scales", "expert_offsets")
    grouped_gemm_op.run(**dict(zip(names, dev, strict=True)), out_dtype=0, backend="cuda", out=out)
    torch.cuda.synchronize()
    check_close(out.cpu(), args, rel_err=GPU_REL_ERR)


def test_cutlass_public_api_default_backend():
    args = make_problem(CASES["E7"], 256, 512, seed=3)
    out = ck.fp8.grouped_gemm(*[t.cuda() for t in args])
    check_close(out.cpu(), args, rel_err=GPU_REL_ERR)


def test_cutlass_cpp_checks_misaligned_views():
    """The C++ entry point refuses a misaligned operand itself (the raw op skips the
    public API's check), before CUTLASS sees it."""
    a_q, a_s, b_q, b_s, off = (t.cuda() for t in make_problem((3, 2), 64, 128, seed=1))
    wide = torch.zeros(a_q.numel() + 16, dtype=torch.uint8, device="cuda")
    shifted = wide[1 : 1 + a_q.numel()].view(a_q.shape).view(torch.float8_e4m3fn)
    shifted.copy_(a_q)
    out = torch.empty(5, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="a_q: the CUTLASS kernel needs a 16-byte aligned"):
        grouped_gemm_op.run(
            a_q=shifted,
            a_scales=a_s,
            b_q=b_q,
            b_scales=b_s,
            expert_offsets=off,
            out_dtype=0,
            backend="cuda",
            out=out,
        )
    torch.cuda.synchronize()  # the context is still usable


def test_cutlass_path_is_sync_free_and_replays_in_a_cuda_graph():
    """The Triton argument builder + the GEMM: no host sync (sync debug mode
    "error"), and captured once in a CUDA graph, a replay with new offsets
    (same E, M) computes the new grouping (the builder reads them on the device)."""
    a, b = make_problem((5, 64, 3), 256, 512, seed=4), make_problem((0, 70, 2), 256, 512, seed=4)
    dev = [t.cuda() for t in a]
    out = torch.empty(a[0].shape[0], 256, dtype=torch.bfloat16, device="cuda")
    names = ("a_q", "a_scales", "b_q", "b_scales", "expert_offsets")
    kw = dict(zip(names, dev, strict=True), out_dtype=0, backend="cuda", out=out)
    grouped_gemm_op.run(**kw)  # warm: compile, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm_op.run(**kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm_op.run(**kw)
    for args in (b, a):
        for t, src in zip(dev, args, strict=True):
            t.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(out.cpu(), args, rel_err=GPU_REL_ERR)
