"""Diagnostic: why does one fused-linear call take different times in different
bench cases? (``python -m bench.diag_espo_spread SCENARIO [--reps N]``)

Times ``ck.espo.fused_linear_espo_loss(mode="grpo")`` (grad-in-forward, fwd +
bwd) at the bench shape (T=8192, H=1024, V=32768) in a fresh process, either
alone or interleaved with a neighbour provider of bench_espo_logprobs (torch
eager, the 3-GEMM floor), and prints per call:

- wall seconds, process CPU seconds (user + system, all threads),
- minor page faults (``getrusage``),
- run-queue wait of this process's threads (``/proc/self/task/*/schedstat``
  field 2: time runnable but not running, i.e. waiting for a core that
  another process holds),
- the 1-minute load average.

wall ~= cpu / threads + runqueue wait / threads: a call that is slower only
because neighbours took the cores shows the same CPU seconds and a larger wait.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.bench_espo_logprobs import _Problem, proc_snapshot

SCENARIOS = ("alone", "after_eager", "after_floor", "eager", "floor")


def measure(name: str, fn) -> dict:
    a = proc_snapshot()
    fn()
    b = proc_snapshot()
    wall, cpu, sys_s, minflt, wait = (y - x for x, y in zip(a, b, strict=True))
    row = dict(
        provider=name,
        wall=wall,
        cpu=cpu,
        sys=sys_s,
        minflt=int(minflt),
        runq_wait=wait,
        load1=os.getloadavg()[0],
    )
    print(
        f"{name:12s} wall {wall:6.2f} s  cpu {cpu:6.2f} s (sys {sys_s:5.2f})  "
        f"minflt {int(minflt):8d}  runq wait {wait:6.2f} s  load1 {row['load1']:.2f}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=SCENARIOS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--strategy", default="grad_in_forward")
    ap.add_argument("--shape", default="8,1024,1024,32768", help="seqs,seq_len,H,V")
    args = ap.parse_args()
    p = _Problem(*(int(x) for x in args.shape.split(",")))
    ours = p.ours("grpo", args.strategy)
    neighbour = {"after_eager": p.eager("grpo"), "after_floor": p.floor()}.get(args.scenario)
    if args.scenario in ("eager", "floor"):
        ours = {"eager": p.eager("grpo"), "floor": p.floor()}[args.scenario]
    print(f"scenario {args.scenario}, threads {torch.get_num_threads()}, shape {p.shape}")
    measure("warmup", ours)
    for _ in range(args.reps):
        if neighbour is not None:
            measure(args.scenario.removeprefix("after_"), neighbour)
        measure("ours", ours)


if __name__ == "__main__":
    main()
