"""Per-call host overhead of the op layer (compass_kernels/_op.py), CPU.

``python -m bench.op_overhead [--reps N]`` times, on tiny CPU inputs (the kernel
itself is a few microseconds), the median wall time of one eager call of:

- each public function (checks + the registered op + the torch kernel), with
  the data checks on (the default on CPU) and off (``validate=False``);
- the registered op called eagerly (``op(name=value, ...)``: allocation,
  backend lookup, the kernel);
- the same call through the torch dispatcher (``torch.ops.compass.<name>``);
- ``ck.fp8.grouped_gemm``'s GPU call paths on CPU tensors, the launches
  stubbed (:func:`_grouped_gemm_rows`): the Python host time of a decode call
  with a caller's workspace and ``out=`` (the CUDA-graph path), and without.

Medians of ``--reps`` blocks of 200 calls each; one line per row (``--only TEXT``,
repeatable: the rows whose name contains one). The numbers
before / after a change of the op layer go to docs/perf/op_overhead.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

import compass_kernels as ck
from compass_kernels.advantages import group_advantages_op
from compass_kernels.packing.thd import thd_pack_op


def _time(fn: Callable[[], object], reps: int, inner: int = 200) -> float:
    """Median microseconds per call over ``reps`` blocks of ``inner`` calls."""
    for _ in range(20):
        fn()
    blocks = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        blocks.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(blocks)


def rows() -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    n, gs = 32, 8
    rewards = torch.randn(n, generator=g)
    order, offsets = torch.arange(n), torch.arange(0, n + 1, gs)
    ga = dict(rewards=rewards, order=order, offsets=offsets, mode=0, eps=1e-6, zero_var_tol=1e-6)

    lengths = [5, 7, 3, 9]
    src = torch.randn(sum(lengths), 4, generator=g)
    seq_start = torch.tensor([0, 12])
    seqlens = torch.tensor([5, 3])
    out_off = torch.tensor([0, 8, 12])
    tp = dict(
        src=src.view(torch.uint8),
        seq_start=seq_start,
        seqlens=seqlens,
        out_offsets=out_off,
        cp_size=1,
        cp_rank=0,
        fill=0,
        total=12,
    )

    T, seqs = 256, 8
    lp, old = -torch.rand(T, generator=g), -torch.rand(T, generator=g)
    ent, adv = torch.rand(T, generator=g), torch.randn(seqs, generator=g)
    cu = torch.arange(0, T + 1, T // seqs)
    espo = dict(rho=0.2, alpha=0.1, vocab_size=1000)
    logits, ids = torch.randn(16, 32, generator=g), torch.randint(0, 32, (16,), generator=g)
    top = torch.randn(16, 32, generator=g).argsort(-1)[:, :4]
    x8 = torch.randn(16, 256, generator=g)

    eager = _eager_call
    noop, noop_kw = _noop_op(rewards)
    return {
        **_grouped_gemm_rows(),
        "no-op kernel op, 4 args 2 outputs (eager)": lambda: eager(noop, noop_kw),
        "group_advantages (public)": lambda: ck.advantages.group_advantages(rewards, group_size=gs),
        "group_advantages (public, validate=False)": lambda: ck.advantages.group_advantages(
            rewards, group_size=gs, validate=False
        ),
        "group_advantages op (eager)": lambda: eager(group_advantages_op, ga),
        "group_advantages op (dispatcher)": lambda: torch.ops.compass.group_advantages(
            rewards, order, offsets, 0, 1e-6, 1e-6
        ),
        "thd_pack op (eager)": lambda: eager(thd_pack_op, tp),
        "packing.pack (public)": lambda: ck.packing.pack(src, lengths, [0, 2]),
        "espo_loss (public, no grad)": lambda: _no_grad(
            lambda: ck.espo.espo_loss(lp, old, ent, adv, cu, **espo)
        ),
        "espo_loss (public, validate=False)": lambda: _no_grad(
            lambda: ck.espo.espo_loss(lp, old, ent, adv, cu, validate=False, **espo)
        ),
        "token_logprobs_entropy (public)": lambda: ck.espo.token_logprobs_entropy(logits, ids),
        "replay_topk (public)": lambda: ck.routing.replay_topk(logits, top),
        "fp8.quantize_token_groups (public)": lambda: ck.fp8.quantize_token_groups(x8),
    }


_GG_STUBS: list = []


def _grouped_gemm_rows() -> dict[str, Callable[[], object]]:
    """ck.fp8.grouped_gemm's CUTLASS (``cuda``) and Triton call paths on CPU tensors:
    the public checks, the op, the backend's Python up to its launches, which are
    stubbed (the Triton argument builder and the C++ GEMM entry; the Triton GEMM
    kernel), as are the SM count (132) and the stream handle. Decode-sized: 64
    rows over E = 8 experts, N = 4096, K = 7168 (only shapes are read). The stubs
    stay for the process (this bench only; nothing else here calls the GEMM)."""
    import importlib

    from compass_kernels import _C, _op
    from compass_kernels.fp8.grouped_gemm import grouped_gemm_op

    gg = importlib.import_module("compass_kernels.fp8.grouped_gemm")
    tg = importlib.import_module("compass_kernels.fp8.triton_gemm")
    if not hasattr(_C.fp8, "grouped_gemm_sm90_workspace"):
        return {}  # a build without CUTLASS: no tile heuristic / workspace size
    if not _GG_STUBS:

        def nothing(*args, **kwargs):
            return None

        class Launch:  # kernel[grid](...) of a Triton kernel
            def __getitem__(self, grid):
                return nothing

        tile = _C.fp8.choose_sm90_tile
        gg._cutlass_entry_points = lambda: (nothing, nothing, tile)
        gg._sm_count = lambda index: 132
        tg._grouped_gemm_kernel = Launch()
        _op.cuda_stream = lambda t: 0
        for backend in ("cuda", "triton"):  # the GPU backends' Python, on CPU tensors
            grouped_gemm_op._chosen[(torch.device("cpu"), backend)] = backend
        _GG_STUBS.append(True)
    e, n, k, m = 8, 4096, 7168, 64
    a_q = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    a_s = torch.ones(m, -(-k // 128))
    b_q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn)
    b_s = torch.ones(e, -(-n // 128), -(-k // 128))
    off = torch.arange(0, m + 1, m // e)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    ws = ck.fp8.grouped_gemm_workspace(e, device="cpu")
    ws.gemm_bytes = gg._gemm_region_bytes(e, 132)  # a 132-SM GPU's CUTLASS region
    ws.buffer = torch.empty(gg.GroupedGemmWorkspace.nbytes_for(e, ws.gemm_bytes), dtype=torch.uint8)
    ops = (a_q, a_s, b_q, b_s, off)

    def gemm(backend, **kw):
        return lambda: ck.fp8.grouped_gemm(*ops, backend=backend, validate=False, out=out, **kw)

    return {
        "fp8.grouped_gemm cuda path, workspace= out= (launches stubbed)": gemm(
            "cuda", workspace=ws
        ),
        "fp8.grouped_gemm cuda path, own caches, out= (launches stubbed)": gemm("cuda"),
        "fp8.grouped_gemm triton path, workspace= out= (launch stubbed)": gemm(
            "triton", workspace=ws
        ),
    }


def _noop_op(x: torch.Tensor):
    """An op whose kernel does nothing: the op layer's own cost (allocation of two
    outputs, backend lookup, argument passing), declared with whichever API the
    package has (the annotated function, or the older schema string)."""
    from typing import NamedTuple

    from compass_kernels import _op

    def kernel(*, x, y, a, b, u, v):  # writes nothing
        return None

    name = "bench_noop"
    if name in _op.OPS:
        op = _op.OPS[name]
    elif hasattr(_op, "op"):

        class Pair(NamedTuple):
            u: torch.Tensor
            v: torch.Tensor

        def bench_noop(x: torch.Tensor, y: torch.Tensor, a: int, b: float) -> Pair:
            return Pair(u=torch.empty_like(x), v=torch.empty_like(y))

        bench_noop.__annotations__ = {
            "x": torch.Tensor,
            "y": torch.Tensor,
            "a": int,
            "b": float,
            "return": Pair,
        }
        op = _op.op(kernels={"torch": kernel})(bench_noop)
    else:
        op = _op.register_op(
            name,
            "(Tensor x, Tensor y, int a, float b) -> (Tensor, Tensor)",
            outputs=lambda x, y, a, b: (torch.empty_like(x), torch.empty_like(y)),
            kernels={"torch": lambda *args: None},
        )
    return op, dict(x=x, y=x, a=1, b=0.5)


def _eager_call(op, kwargs: dict):
    """The op called eagerly: by name (the annotated-function ops) or, for the
    older positional declaration, with the values in schema order."""
    if hasattr(op, "params"):
        return op(**kwargs)
    return op(*kwargs.values())


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.op_overhead", description=__doc__)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--only", action="append", default=[], help="time the rows whose name contains it"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    table = {k: v for k, v in rows().items() if not args.only or any(t in k for t in args.only)}
    width = max(len(k) for k in table)
    for name, fn in table.items():
        us = _time(fn, args.reps)
        assert math.isfinite(us)
        print(f"{name:<{width}}  {us:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
