"""The GPU runbook (scripts/gpu_check.sh) in a dry run on the CPU (`make gpu-check-dry`):
every phase stubbed, a fake time budget, cuts injected at every phase, after a time
(SIGTERM) and by SIGKILL (the device tool's hard stop). Proves the phase order, the
timeouts of the time left, and that a cut run still leaves a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~1 min on a loaded 2-core host: 11 runs of the runbook

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["facts", "build", "triton", "timing", "cutlass", "cuda", "full"]
PYTEST_PHASES = ["triton", "cutlass", "cuda", "full"]


def _run(tmp_path: Path, **env) -> tuple[int, list[dict], dict, float]:
    out = tmp_path / "run"
    e = dict(
        os.environ,
        PYTHON=sys.executable,
        GPU_CHECK_DRY="1",
        GPU_CHECK_BUDGET_S="30",
        GPU_CHECK_RESERVE_S="1",
        GPU_CHECK_MIN_PHASE_S="0.2",
        GPU_CHECK_STUB_S="0.05",
        GPU_CHECK_BUNDLE=str(tmp_path / "bundle"),
    )
    e.update({k: str(v) for k, v in env.items()})
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out)],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    wall = time.monotonic() - t0
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().startswith("# DRY RUN"), proc.stdout[-2000:]
    return proc.returncode, results, report, wall


def _status(results):
    return {r["phase"]: r["status"] for r in results}


def test_dry_run_order_timeouts_and_report(tmp_path):
    rc, results, report, _ = _run(tmp_path)
    assert rc == 0
    # build is recorded when awaited (after the Triton phase it overlapped with)
    assert [r["phase"] for r in results] == [
        "facts",
        "triton",
        "build",
        "timing",
        "cutlass",
        "cuda",
        "full",
    ]
    assert set(_status(results).values()) == {"passed"}
    build, triton = results[2], results[1]
    assert build["at_s"] - build["seconds"] < triton["at_s"] - triton["seconds"] + 0.05
    # each phase's timeout is the time left (budget - reserve - elapsed), shrinking
    limits = [r["timeout_s"] for r in results if r["phase"] != "build"]
    assert limits == sorted(limits, reverse=True) and limits[0] <= 29
    for r in results:
        if r["phase"] in PYTEST_PHASES:
            assert "-o timeout_method=thread" in r["cmd"] and "--timeout 60" in r["cmd"]
            assert "--junitxml=" in r["cmd"] and " -v " in r["cmd"]
    assert report["dry"] is True and report["failed"] is False
    assert report["test_counts"] == {"passed": 4}  # one junit per pytest phase
    assert [t["op"] for t in report["timing"]] == ["dry_op_0", "dry_op_1", "dry_op_2"]
    bundle = tmp_path / "bundle"
    assert sorted(p.name for p in bundle.iterdir()) == [
        "report.json",
        "report.md",
        "results.jsonl",
        "run.tgz",
    ]


@pytest.mark.parametrize("phase", PHASES, ids=[f"at_{p}_start" for p in PHASES])
def test_cut_at_each_phase_leaves_a_report(tmp_path, phase):
    rc, results, report, _ = _run(tmp_path, GPU_CHECK_CUT_PHASE=phase)
    assert rc == 143
    st = _status(results)
    k = PHASES.index(phase)
    assert st[phase] == "cut"
    for before in PHASES[:k]:
        # the build runs in the background until the timing phase waits for it
        want = "cut" if before == "build" and phase == "triton" else "passed"
        assert st[before] == want, (before, st)
    for after in PHASES[k + 1 :]:
        assert st[after] == "not run", (after, st)
    assert report["failed"] is True
    assert {s["step"] for s in report["steps"]} == set(PHASES)


def test_sigterm_mid_timing_keeps_the_rows_so_far(tmp_path):
    rc, results, report, wall = _run(
        tmp_path, GPU_CHECK_STUB_HANG="timing", GPU_CHECK_CUT_AFTER_S=8
    )
    assert rc == 143 and wall < 15
    st = _status(results)
    assert st["timing"] == "cut" and st["cutlass"] == "not run"
    assert [t["op"] for t in report["timing"]] == ["dry_op_0"]  # written before it stuck


def test_sigkill_leaves_the_last_phase_report(tmp_path):
    """SIGKILL runs no trap: the report written after the last finished phase stays."""
    rc, results, report, _ = _run(tmp_path, GPU_CHECK_STUB_HANG="cutlass", GPU_CHECK_KILL_AFTER_S=8)
    assert rc == -9 or rc == 137
    assert [r["phase"] for r in results] == ["facts", "triton", "build", "timing"]
    assert [s["step"] for s in report["steps"]] == ["facts", "triton", "build", "timing"]
    assert len(report["timing"]) == 3


def test_a_hung_phase_times_out_at_the_time_left(tmp_path):
    """A phase stuck past the budget is stopped at the time left; the phases after it
    are skipped (no time) and the report is still written within the budget."""
    rc, results, report, wall = _run(tmp_path, GPU_CHECK_STUB_HANG="triton", GPU_CHECK_BUDGET_S=4)
    st = _status(results)
    assert rc != 0 and wall < 4 + 6  # the budget + the final report, on a loaded host
    assert st["triton"] == "timeout" and results[1]["rc"] == 124
    assert all(st[p] == "skipped" for p in ("timing", "cutlass", "cuda", "full")), st
    assert report["failed"] is True
