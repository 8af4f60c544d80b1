"""ck.fp8.grouped_gemm with a caller's workspace (ck.fp8.grouped_gemm_workspace).

CPU: results with a workspace equal those without on every backend (fresh
random problems, odd sizes, the float64 reference); bad workspaces raise a
ValueError naming ``workspace`` before any kernel runs; the workspace's layout
and its CUTLASS region's size (the CUDA build's host-side size function); and
the CUTLASS backend's whole Python call path (public checks, the op, the
backend, its two entry points stubbed) run on CPU tensors under the profiler's
memory accounting: with ``out=`` and ``workspace=`` nothing is allocated, and
the entry points receive the workspace's own buffers.

GPU (marked gpu, auto-skipped without a device): CUDA-graph capture and replay
with a caller workspace on the cuda (CUTLASS) and triton backends, the replay
equal to an eager call after new inputs are copied into the captured buffers;
torch.cuda.memory_allocated unchanged by a call with a workspace and out=.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import compass_kernels as ck
from compass_kernels import _C, _op
from compass_kernels.fp8.grouped_gemm import grouped_gemm_op
from compass_kernels.testing import empty_poisoned
from tests.fp8_gemm_cases import GPU_REL_ERR, check_close, make_problem
from tests.tiers import device_for

gg = importlib.import_module("compass_kernels.fp8.grouped_gemm")
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
BUILT_WITH_CUTLASS = hasattr(_C.fp8, "grouped_gemm_sm90_workspace")


def _rel(backend):
    return GPU_REL_ERR if device_for(backend) == "cuda" else 1e-5


def _random_counts(gen: torch.Generator, experts: int) -> tuple[int, ...]:
    """Token counts per expert, some empty, odd sizes around the 64 / 128-row tiles."""
    choices = torch.tensor([0, 1, 3, 63, 64, 65, 127, 129])
    return tuple(int(c) for c in choices[torch.randint(0, 8, (experts,), generator=gen)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_workspace_gives_the_same_result(backend, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    experts = int(torch.randint(2, 7, (1,), generator=gen))
    n, k = (40, 200) if seed == 0 else (72, 136)
    args = make_problem(_random_counts(gen, experts), n, k, seed=seed + 17)
    dev = device_for(backend)
    on = [a.to(dev) for a in args]
    ws = ck.fp8.grouped_gemm_workspace(experts + 3, device=dev)  # a capacity above E
    for out_dtype in (torch.bfloat16, torch.float32):
        plain = ck.fp8.grouped_gemm(*on, out_dtype=out_dtype, backend=backend)
        out = empty_poisoned((args[0].shape[0], n), out_dtype, dev)
        got = ck.fp8.grouped_gemm(*on, out_dtype=out_dtype, backend=backend, workspace=ws, out=out)
        assert got is out
        check_close(out.cpu(), args, rel_err=_rel(backend))
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
        fresh = ck.fp8.grouped_gemm(*on, out_dtype=out_dtype, backend=backend, workspace=ws)
        torch.testing.assert_close(fresh, plain, rtol=0, atol=0)


def _problem(experts=3, dev="cpu"):
    return [a.to(dev) for a in make_problem((2, 0, 5)[:experts] + (1,) * (experts - 3), 16, 128, 1)]


def test_bad_workspaces_raise_naming_workspace():
    on = _problem()
    with pytest.raises(
        ValueError, match="workspace: holds buffers for up to 2 experts, the call has 3"
    ):
        ck.fp8.grouped_gemm(*on, workspace=ck.fp8.grouped_gemm_workspace(2, device="cpu"))
    with pytest.raises(ValueError, match="workspace: expected a ck.fp8.GroupedGemmWorkspace"):
        ck.fp8.grouped_gemm(*on, workspace=torch.empty(4096, dtype=torch.uint8))
    ws = ck.fp8.grouped_gemm_workspace(3, device="cpu")
    for buf in (ws.buffer.view(torch.int32), ws.buffer[:-128], ws.buffer[::2]):
        bad = gg.GroupedGemmWorkspace(buf, 3, 0)
        with pytest.raises(ValueError, match="workspace: expected its buffer to be a contiguous"):
            ck.fp8.grouped_gemm(*on, workspace=bad)
    meta = gg.GroupedGemmWorkspace(
        torch.empty(ws.buffer.numel(), dtype=torch.uint8, device="meta"), 3, 0
    )
    with pytest.raises(
        ValueError, match=r"workspace: expected a workspace on cpu \(a_q's device\)"
    ):
        ck.fp8.grouped_gemm(*on, workspace=meta)
    for num in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_experts: expected a positive int"):
            ck.fp8.grouped_gemm_workspace(num, device="cpu")
    with pytest.raises(ValueError, match="device: expected a cpu or cuda device"):
        ck.fp8.grouped_gemm_workspace(3, device="meta")


def test_workspace_layout_views_are_disjoint_and_cached():
    ws = ck.fp8.grouped_gemm_workspace(5, device="cpu")
    assert ws.buffer.dtype == torch.uint8 and ws.gemm_bytes == 0
    assert ws.buffer.numel() == gg.GroupedGemmWorkspace.nbytes_for(5, 0) == 256 + 128
    for e in (1, 3, 5):
        shapes, ptrs, gemm = ws.views(e)
        assert ws.views(e)[0] is shapes  # kept per E: no views made on the next call
        assert shapes.shape == (e, 3) and shapes.dtype == torch.int32 and shapes.is_contiguous()
        assert ptrs.shape == (5, e) and ptrs.dtype == torch.int64 and ptrs.is_contiguous()
        spans = sorted(
            (
                t.storage_offset() * t.element_size(),
                (t.storage_offset() + t.numel()) * t.element_size(),
            )
            for t in (ptrs, shapes, gemm)
        )
        assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:], strict=False)), spans
        assert all(lo % 128 == 0 for lo, _ in spans)
        assert spans[-1][1] <= ws.buffer.numel()


@pytest.mark.skipif(not BUILT_WITH_CUTLASS, reason="compass_kernels._C was built without CUTLASS")
@pytest.mark.parametrize("sms", [78, 114, 132])
def test_cutlass_region_serves_every_tile_and_fewer_experts(sms):
    """The region is sized at capacity for the largest tile configuration; every
    call with E <= capacity (either tile) fits in it, after the pointer arrays
    and shapes (the layout: csrc/fp8/sm90_workspace.h)."""
    for cap in (1, 7, 8, 256, 300):
        region = gg._gemm_region_bytes(cap, sms)
        for e in sorted({1, max(1, cap // 2), cap}):
            for tile in range(gg._NUM_TILES):
                assert _C.fp8.grouped_gemm_sm90_workspace(tile, e, sms) <= region, (cap, e, tile)
        total = gg.GroupedGemmWorkspace.nbytes_for(cap, region)
        assert total >= region + 52 * cap and total % 128 == 0


def _cutlass_path_on_cpu(monkeypatch):
    """The cuda backend's Python path on CPU tensors: dispatch pinned to it, the SM
    count, the stream and the two entry points (Triton builder, C++ GEMM) stubbed
    by recorders. Returns the list of recorded (entry, args)."""
    calls: list[tuple[str, tuple]] = []
    _, _, tile = gg._cutlass_entry_points() if BUILT_WITH_CUTLASS else (None, None, None)
    if tile is None:
        pytest.skip("compass_kernels._C was built without CUTLASS (the tile heuristic)")
    entries = (lambda *a: calls.append(("args", a)), lambda *a: calls.append(("gemm", a)), tile)
    monkeypatch.setattr(gg, "_cutlass_entry_points", lambda: entries)
    monkeypatch.setattr(gg, "_sm_count", lambda index: 132)
    monkeypatch.setattr(_op, "cuda_stream", lambda t: 0)
    monkeypatch.setitem(grouped_gemm_op._chosen, (torch.device("cpu"), "cuda"), "cuda")
    monkeypatch.setitem(grouped_gemm_op._kernels, "cuda", grouped_gemm_op._load("cuda"))
    return calls


def _allocated_bytes(fn) -> list[tuple[str, int]]:
    """(op, bytes) of every CPU allocation ``fn`` makes (the profiler's memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]


def test_cutlass_call_with_workspace_and_out_allocates_nothing(monkeypatch):
    calls = _cutlass_path_on_cpu(monkeypatch)
    on = _problem(5)
    m, n = on[0].shape[0], on[2].shape[1]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    ws = ck.fp8.grouped_gemm_workspace(8, device="cpu")
    ws.gemm_bytes = gg._gemm_region_bytes(8, 132)  # a CUDA device's region, on the CPU
    ws.buffer = torch.empty(gg.GroupedGemmWorkspace.nbytes_for(8, ws.gemm_bytes), dtype=torch.uint8)

    def call():
        return ck.fp8.grouped_gemm(*on, backend="cuda", validate=False, workspace=ws, out=out)

    call()  # the views for E = 5 are made once and kept in the workspace
    calls.clear()
    monkeypatch.setattr(gg, "_BUFFERS", {})  # a path using the backend's caches would allocate
    assert _allocated_bytes(call) == []
    assert [c[0] for c in calls] == ["args", "gemm"]
    shapes, ptrs, gemm = ws.views(5)
    built, run = calls[0][1], calls[1][1]
    assert built[5] is out and built[6] is shapes and built[7] is ptrs
    assert run[6] is out and run[8] is shapes and run[9] is ptrs and run[10] is gemm
    # a workspace whose CUTLASS region is too small is refused before any launch
    calls.clear()
    small = gg.GroupedGemmWorkspace(ws.buffer[: gg.GroupedGemmWorkspace.nbytes_for(8, 0)], 8, 0)
    with pytest.raises(ValueError, match="workspace: the CUTLASS tile configuration"):
        ck.fp8.grouped_gemm(*on, backend="cuda", workspace=small, out=out)
    assert calls == []


def test_cutlass_call_without_workspace_allocates_its_caches_once(monkeypatch):
    """The contrast that shows the probe sees allocations: the first call without a
    workspace allocates the per-shape buffers (and the output without out=)."""
    _cutlass_path_on_cpu(monkeypatch)
    monkeypatch.setattr(gg, "_BUFFERS", {})
    on = _problem(5)
    first = _allocated_bytes(lambda: ck.fp8.grouped_gemm(*on, backend="cuda", validate=False))
    assert sum(b for _, b in first) >= gg._workspace_bytes(0, 5, 132)


@pytest.mark.triton
def test_triton_call_with_workspace_and_out_allocates_nothing_on_the_op_path(monkeypatch):
    """Up to the Triton launch (stubbed: the interpreter copies its arguments), the
    triton backend's path allocates nothing with workspace= and out=."""
    tg = importlib.import_module("compass_kernels.fp8.triton_gemm")
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(grid)

    monkeypatch.setattr(tg, "_grouped_gemm_kernel", Kernel())
    on = _problem(4)
    out = torch.empty(on[0].shape[0], on[2].shape[1], dtype=torch.bfloat16)
    ws = ck.fp8.grouped_gemm_workspace(4, device="cpu")

    def call():
        return ck.fp8.grouped_gemm(*on, backend="triton", validate=False, workspace=ws, out=out)

    call()
    assert _allocated_bytes(call) == [] and len(launches) == 2


# ------------------------------------------------------------------------- GPU


def _gpu_problem(counts, n, k, seed):
    return [t.cuda() for t in make_problem(counts, n, k, seed=seed)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=pytest.mark.cutlass), "triton"])
def test_gpu_graph_capture_and_replay_with_a_workspace(backend):
    """Captured with a caller workspace and out: no host sync while capturing (sync
    debug mode "error"), no allocation; replayed after new inputs (same E, M) are
    copied into the captured buffers, the output equals an eager call's."""
    a = make_problem((5, 64, 3, 0), 256, 512, seed=4)
    b = make_problem((0, 70, 1, 1), 256, 512, seed=5)
    dev = [t.cuda() for t in a]
    ws = ck.fp8.grouped_gemm_workspace(4, device=dev[0].device)
    out = torch.empty(a[0].shape[0], 256, dtype=torch.bfloat16, device="cuda")

    def call():
        return ck.fp8.grouped_gemm(*dev, backend=backend, workspace=ws, out=out)

    call()  # warm: compile, the tile cache, the workspace's views
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        call()
    for args in (b, a):
        for t, src in zip(dev, args, strict=True):
            t.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = ck.fp8.grouped_gemm(*[t.clone() for t in dev], backend=backend)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        check_close(out.cpu(), args, rel_err=GPU_REL_ERR)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=pytest.mark.cutlass), "triton"])
def test_gpu_call_with_workspace_and_out_allocates_no_device_memory(backend):
    dev = _gpu_problem((3, 0, 129, 1, 64, 2, 0), 256, 512, seed=7)
    ws = ck.fp8.grouped_gemm_workspace(8, device="cuda")
    out = torch.empty(dev[0].shape[0], 256, dtype=torch.bfloat16, device="cuda")
    ck.fp8.grouped_gemm(*dev, backend=backend, workspace=ws, out=out)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    allocs, before = stats["allocation.all.allocated"], torch.cuda.memory_allocated()
    ck.fp8.grouped_gemm(*dev, backend=backend, workspace=ws, out=out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs
    eager = ck.fp8.grouped_gemm(*dev, backend=backend)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
