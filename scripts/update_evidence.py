"""Collect GPU evidence from the committed runs (docs/gpu_runs/*/report.json)
into compass_kernels/gpu_evidence.json, which ck.info() reports per op and backend.

Convention: a gpu-tier test named ``test_gpu_<op>[...<backend>...]`` is
evidence for (op, backend). Run after committing a new docs/gpu_runs/ report:
    python scripts/update_evidence.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("cuda", "triton")


def collect(runs_dir: Path) -> dict:
    out: dict = {}
    for report in sorted(runs_dir.glob("*/report.json")):
        data = json.loads(report.read_text())
        dev = data["device"]
        run = {"run": report.parent.name, "date": dev.get("date_utc", "")[:10]}
        run |= {k: dev.get(k) for k in ("torch", "triton")} | {"device": dev.get("gpu")}
        for t in data["tests"]:
            m = re.search(r"::test_gpu_(\w+?)(?:\[(.*)\])?$", t["test"])
            if not m or t["outcome"] == "skipped":
                continue
            op, params = m.group(1), (m.group(2) or "").split("-")
            backend = next((b for b in BACKENDS if b in params), None)
            if backend is None:
                continue
            entry = out.setdefault(op, {}).setdefault(backend, {})
            r = entry.setdefault(run["run"], {**run, "passed": 0, "failed": 0})
            r["passed" if t["outcome"] == "passed" else "failed"] += 1
    return {op: {b: list(runs.values()) for b, runs in bs.items()} for op, bs in out.items()}


def main() -> int:
    evidence = collect(ROOT / "docs" / "gpu_runs")
    path = ROOT / "compass_kernels" / "gpu_evidence.json"
    path.write_text(json.dumps(evidence, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}: {sum(len(b) for b in evidence.values())} (op, backend) pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
