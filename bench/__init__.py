"""Benchmarks: ``python -m bench`` runs every ``bench/bench_*.py``.

Each bench module exposes ``cases(quick: bool) -> list[harness.Case]`` and
optionally ``OP = "name"`` (used by ``--only``; defaults to the module name
without the ``bench_`` prefix). See `bench.harness` for the method.
"""

from bench.harness import Case, Row, run_case, run_cases

__all__ = ["Case", "Row", "run_case", "run_cases"]
