"""CPU-side cost of one CUTLASS grouped-GEMM call's host path, measured without a GPU.

What runs on the host per ``grouped_gemm(..., backend="cuda")`` call, up to the
two C++ entries, is timed here on CPU tensors (same Python, same pybind
layer; CUDA tensors add the caching allocator's device path to each
allocation, and the C++ entries add the CUDA launches, not measured):

- ``prep_before``: the argument preparation as it was (entry-point lookup,
  two ``torch.empty`` for the builder's outputs, the tile heuristic call, a
  workspace ``torch.empty``; the workspace size was already cached);
- ``prep_after``: ``cutlass_launch_args`` on a cache hit (what it is now);
- ``entry_8_views``: one C++ entry taking 8 tensors (``grouped_args_cpu`` at
  E = 1, so its own work is nil): pybind + 8 DLPack conversions + the argument
  checks; ``entry_floor``: a pybind entry with ints only (``choose_sm90_tile``).
  (entry_8_views - entry_floor) / 8 is one tensor argument's cost; the call
  passes 18 (8 + 10) of them.

Usage: python scripts/cutlass_host_time.py  (prints one line per quantity, us)
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch

from compass_kernels._ext import load

gg = importlib.import_module("compass_kernels.fp8.grouped_gemm")
E, N, K, ROWS, SMS = 256, 4096, 7168, 16384 * 8, 132  # DeepSeek-V3 gate/up, 16k tokens


def per_call_us(fn, n: int = 20000, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time of ``n`` calls, in microseconds."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(out)


def main() -> None:
    ext = load().fp8
    a_q = torch.empty(ROWS, K, dtype=torch.float8_e4m3fn)
    b_q = torch.empty(E, N, 16, dtype=torch.float8_e4m3fn)  # only shapes are read

    def prep_before():
        x = load().fp8
        if not hasattr(x, "grouped_gemm_sm90_cuda"):
            raise RuntimeError("needs a CUDA build of _C (the workspace size)")
        torch.empty((E, 3), dtype=torch.int32, device=a_q.device)
        torch.empty((5, E), dtype=torch.int64, device=a_q.device)
        tile = x.choose_sm90_tile(a_q.shape[0], E, N, SMS)
        torch.empty(gg._workspace_bytes(tile, E, SMS), dtype=torch.uint8, device=a_q.device)

    def prep_after():
        gg._cutlass_entry_points()
        gg.cutlass_launch_args(a_q, b_q, 0, SMS)

    # grouped_args_cpu with one expert: 8 views converted and checked, no work
    m, k, n = 16, 128, 128
    views = (
        torch.zeros(m, k, dtype=torch.float8_e4m3fn),
        torch.ones(m, 1),
        torch.zeros(1, n, k, dtype=torch.float8_e4m3fn),
        torch.ones(1, 1, 1),
        torch.tensor([0, m]),
        torch.empty(m, n, dtype=torch.bfloat16),
        torch.empty(1, 3, dtype=torch.int32),
        torch.empty(5, 1, dtype=torch.int64),
    )

    rows = {
        "prep_before": per_call_us(prep_before),
        "prep_after": per_call_us(prep_after),
        "entry_8_views": per_call_us(lambda: ext.grouped_args_cpu(*views)),
        "entry_floor": per_call_us(lambda: ext.choose_sm90_tile(ROWS, E, N, SMS)),
    }
    rows["per_view"] = (rows["entry_8_views"] - rows["entry_floor"]) / 8
    for name, us in rows.items():
        print(f"{name:<14} {us:8.3f} us")


if __name__ == "__main__":
    main()
