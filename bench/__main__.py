"""Command line: ``python -m bench [--quick] [--only NAME] [--out DIR] [--reps N] [--check]``.

Discovers ``bench/bench_*.py``, collects their cases, times them with
`bench.harness`, prints one table, appends rows to ``<out>/results.csv`` and
writes ``<out>/<op>.png``. ``--check`` (for CI) runs every bench in quick mode
with 2 repetitions, verifies that each candidate's output matches the
baseline's, writes no files, and exits 1 on any difference or error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

import torch

from bench import harness

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results"


def discover(bench_dir: Path = BENCH_DIR, package: str = "bench") -> list[ModuleType]:
    """Import and return every ``bench_*.py`` module in `bench_dir`, sorted by name."""
    return [
        importlib.import_module(f"{package}.{p.stem}") for p in sorted(bench_dir.glob("bench_*.py"))
    ]


def op_name(module: ModuleType) -> str:
    """The module's ``OP``, or its name without the ``bench_`` prefix."""
    return getattr(module, "OP", module.__name__.rsplit(".", 1)[-1].removeprefix("bench_"))


def collect(
    modules: list[ModuleType], *, quick: bool, only: list[str] | None
) -> list[harness.Case]:
    """Cases of `modules`; `only` keeps a module by its op name or a case by its name."""
    cases = []
    for m in modules:
        module_selected = not only or op_name(m) in only
        for case in m.cases(quick):
            if module_selected or case.name in only:
                cases.append(case)
    return cases


def main(argv: list[str] | None = None, *, modules: list[ModuleType] | None = None) -> int:
    """Run the benches; return the process exit code."""
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Time each bench's baseline and candidates side by side (bench/bench_*.py).",
    )
    ap.add_argument("--quick", action="store_true", help="small shapes, fewer repetitions")
    ap.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this op (a bench's OP) or case name; repeatable",
    )
    ap.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=DEFAULT_OUT,
        help=f"results directory (default {DEFAULT_OUT})",
    )
    ap.add_argument(
        "--reps",
        metavar="N",
        type=int,
        default=None,
        help="timed samples per provider (default 15, --quick 5, --check 2)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="warmup rounds (default 3)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="CI mode: quick shapes, 2 reps, compare candidates with the baseline",
    )
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = ap.parse_args(argv)

    quick = args.quick or args.check
    reps = args.reps or (2 if args.check else 5 if quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if args.check else 3)
    mods = discover() if modules is None else modules
    cases = collect(mods, quick=quick, only=args.only)
    if not cases:
        print(f"no cases selected (ops: {[op_name(m) for m in mods]})", file=sys.stderr)
        return 2

    print(
        f"# {harness.machine_name()} | torch {torch.__version__} | "
        f"threads {torch.get_num_threads()} | commit {harness.git_commit()} | "
        f"{len(cases)} cases, {reps} reps, interleaved",
        flush=True,
    )
    try:
        rows = harness.run_cases(
            cases, reps=reps, warmup=warmup, check=args.check, progress=not args.no_progress
        )
    except harness.CheckFailure as e:
        print(f"CHECK FAILED\n{e}", file=sys.stderr)
        return 1
    print(harness.format_table(rows))
    if args.check:
        print(f"check OK: {len(cases)} cases, every candidate matches its baseline")
        return 0
    csv_path = harness.append_csv(rows, args.out / "results.csv")
    print(f"appended {sum(not r.error for r in rows)} rows to {csv_path}")
    if not args.no_plot:
        for p in harness.plot_results(rows, args.out):
            print(f"plot: {p}")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
