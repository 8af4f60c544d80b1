"""Write report.md and report.json for a GPU run (scripts/gpu_check.sh).

Reads, from the run's folder, whatever is there (a cut run has less):
results.jsonl (one line per phase: status, rc, seconds, timeout; older runs:
steps.txt), junit*.xml (each test's outcome), timing.json (bench/gpu_timing.py)
or, when the timing phase was cut, the rows it had appended to timing.jsonl,
bench/results.csv (each bench row, when the full bench ran) and the device facts
(facts.json, written by the runbook's first phase with ``--facts PATH``; queried
here when absent). It never fails for a missing or half-written file: the report
of a cut run is the point. The report is the only source of GPU numbers the
project states (docs/gpu_runs/).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path


def _device() -> dict:
    info: dict = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(
                gpu=p.name,
                sm=f"{p.major}.{p.minor}",
                sms=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1),
            )
    except Exception as e:  # the report must still be written
        info["torch_error"] = repr(e)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        q = "driver_version,clocks.max.sm,clocks.max.mem,power.limit"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        info["nvidia_smi"] = dict(
            zip(q.split(","), (s.strip() for s in out.split(",")), strict=False)
        )
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = repr(e)
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
        info["nvcc"] = out.strip().splitlines()[-1] if out else None
    except OSError:
        info["nvcc"] = None
    return info


_FIRST = ("op", "backend", "shape", "ms")


def _tests(junit: Path) -> list[dict]:
    if not junit.exists():
        return []
    rows = []
    for case in ET.parse(junit).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = el.get("message") or ""
                message = msg.splitlines()[0][:300] if msg else ""
                break
        rows.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    return rows


def _jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a line cut mid-write is left out)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _safe(fn, default):
    try:
        return fn()
    except Exception as e:  # a half-written file: the report goes on without it
        print(f"gpu_report: {e!r}", file=sys.stderr)
        return default


def main(folder: str) -> int:
    d = Path(folder)
    steps = []
    for r in _jsonl(d / "results.jsonl"):
        steps.append(
            {
                "step": r.get("phase"),
                "status": r.get("status"),
                "rc": r.get("rc"),
                "seconds": r.get("seconds"),
                "timeout_s": r.get("timeout_s"),
                "dry": r.get("dry", False),
            }
        )
    if not steps and (d / "steps.txt").exists():
        for line in (d / "steps.txt").read_text().splitlines():
            name, rc, secs = line.split()
            steps.append({"step": name, "rc": int(rc), "seconds": int(secs)})
    tests = []
    for junit in sorted(d.glob("junit*.xml")):
        tests += _safe(lambda j=junit: _tests(j), [])
    timing_json = d / "timing.json"
    timing = _safe(lambda: json.loads(timing_json.read_text())["rows"], None)
    if not timing:
        timing = _jsonl(d / "timing.jsonl")
    bench_csv = d / "bench" / "results.csv"
    bench = list(csv.DictReader(bench_csv.open())) if bench_csv.exists() else []
    facts = d / "facts.json"
    device = _safe(lambda: json.loads(facts.read_text()), None) if facts.exists() else None
    device = device or _device()
    dry = any(s.get("dry") for s in steps)
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    report = {
        "device": device,
        "steps": steps,
        "test_counts": counts,
        "tests": tests,
        "bench": bench,
        "timing": timing,
    }
    report["dry"] = dry
    report["failed"] = any(s["rc"] != 0 for s in steps) or any(
        t["outcome"] in ("failed", "error") for t in tests
    )
    tmp = d / ".report.json.tmp"  # whole or absent: a cut never leaves half a report
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(d / "report.json")

    title = f"# GPU run {device.get('date_utc', '?')} on {device.get('gpu', '?')}"
    if dry:
        title = "# DRY RUN (no GPU; every phase stubbed; no number here is a measurement)"
    md = [title, ""]
    md += ["| fact | value |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in device.items()]
    md += [
        "",
        "## Phases (in the order they ran)",
        "",
        "| phase | status | rc | seconds | timeout s |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {s['step']} | {s.get('status', '')} | {s['rc']} | {s['seconds']} | "
        f"{s.get('timeout_s', '')} |"
        for s in steps
    ]
    md += ["", "## Tests", "", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())), ""]
    bad = [t for t in tests if t["outcome"] in ("failed", "error")]
    gpu_tests = [t for t in tests if "gpu" in t["test"] and t["outcome"] != "skipped"]
    if bad:
        md += ["Failures:", ""] + [f"- `{t['test']}`: {t['message']}" for t in bad] + [""]
    md += ["GPU tests:", ""] + [f"- `{t['test']}`: {t['outcome']}" for t in gpu_tests] + [""]
    skipped = [t for t in tests if t["outcome"] == "skipped"]
    if skipped:
        md += ["Skipped:", ""] + [f"- `{t['test']}`: {t['message']}" for t in skipped] + [""]
    if bench:
        cols = [
            "op",
            "provider",
            "shape",
            "median_s",
            "iqr_s",
            "ratio_vs_baseline",
            "peak_mem_bytes",
            "h100_model_s",
        ]
        md += [
            "## Bench (measured on this GPU, CUDA events)",
            "",
            "| " + " | ".join(cols) + " |",
            "|" + "---|" * len(cols),
        ]
        md += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in bench]
    if timing:
        cols = sorted(
            {k for r in timing for k in r},
            key=lambda k: (_FIRST.index(k) if k in _FIRST else len(_FIRST), k),
        )
        md += [
            "",
            "## Timing (measured on this GPU, CUDA events, L2 flushed; bench/gpu_timing.py)",
            "",
            "| " + " | ".join(cols) + " |",
            "|" + "---|" * len(cols),
        ]
        md += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in timing]
    tmp = d / ".report.md.tmp"
    tmp.write_text("\n".join(md) + "\n")
    tmp.replace(d / "report.md")
    print("\n".join(md))
    failed = any(s["rc"] != 0 for s in steps) or bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--facts":  # the runbook's first phase
        Path(sys.argv[2]).write_text(json.dumps(_device(), indent=1) + "\n")
        sys.exit(0)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
