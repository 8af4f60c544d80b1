"""The skip guard and the per-tier summary of tests/conftest.py, on planted test files.

Each case runs pytest in a subprocess on a small file written here, with this
repository's conftest loaded as a plugin (``-p tests.conftest``), once with
COMPASS_REQUIRE_ALL_TIERS=1 and once without.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers import (
    HAS_GPU,
    INTERPRETER_ONLY,
    NO_CUDA_DEVICE,
    TIERS,
    skip_allowed,
    tier_of,
)

ROOT = Path(__file__).resolve().parents[1]

# The skip reason that is legitimate on this machine, and the one that is not.
TRUE_HERE, FALSE_HERE = (
    (INTERPRETER_ONLY, NO_CUDA_DEVICE) if HAS_GPU else (NO_CUDA_DEVICE, INTERPRETER_ONLY)
)

PLANTED = {
    "test_planted_ok.py": """
def test_ok():
    pass
""",
    "test_planted_skip.py": """
import pytest

def test_runs():
    pass

@pytest.mark.triton
def test_planted_skip():
    pytest.skip("some package is not installed")
""",
    "test_planted_module_skip.py": """
import pytest

pytest.importorskip("compass_no_such_module")

def test_never_collected():
    pass
""",
    "test_planted_allowed.py": f"""
import pytest

@pytest.mark.gpu
def test_skip_true_here():
    pytest.skip({TRUE_HERE!r})

@pytest.mark.xfail(reason="expected", strict=True)
def test_xfail():
    assert False
""",
    "test_planted_wrong_reason.py": f"""
import pytest

def test_skip_false_here():
    pytest.skip({FALSE_HERE!r})
""",
}


def _run(tmp_path: Path, files: list[str], *, require: bool) -> tuple[int, str, dict]:
    for name in files:
        (tmp_path / name).write_text(PLANTED[name])
    report = tmp_path / f"tiers-{int(require)}.json"
    env = {k: v for k, v in os.environ.items() if k != "COMPASS_REQUIRE_ALL_TIERS"}
    env |= {"PYTHONPATH": str(ROOT), "COMPASS_TIER_REPORT": str(report)}
    if require:
        env["COMPASS_REQUIRE_ALL_TIERS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.conftest",
        "-p",
        "no:cacheprovider",
        "-rA",
        "--rootdir",
        str(tmp_path),
        *[str(tmp_path / f) for f in files],
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    counts = json.loads(report.read_text())["tiers"] if report.exists() else {}
    return proc.returncode, out, counts


@pytest.mark.parametrize(
    "planted", ["test_planted_skip.py", "test_planted_module_skip.py"], ids=["test", "module"]
)
def test_planted_skip_fails_only_under_the_switch(tmp_path, planted):
    files = ["test_planted_ok.py", planted]
    rc, out, counts = _run(tmp_path, files, require=False)
    assert rc == 0, out
    assert "failed" not in out.splitlines()[-1], out
    rc, out, counts = _run(tmp_path, files, require=True)
    assert rc == (1 if planted == "test_planted_skip.py" else 2), out  # 2: collection error
    assert "COMPASS_REQUIRE_ALL_TIERS=1 allows no skip" in out, out
    reason = (
        "some package is not installed"
        if planted == "test_planted_skip.py"
        else ("could not import 'compass_no_such_module'")
    )
    assert f"reason: {reason}" in out, out
    if planted == "test_planted_skip.py":
        assert counts["triton"] == {"passed": 0, "skipped": 0, "failed": 1}, counts
        assert counts["other"]["passed"] == 2, counts
    else:
        assert counts["collection"]["failed"] == 1, counts


def test_allowed_reasons_pass_only_where_true(tmp_path):
    rc, out, counts = _run(tmp_path, ["test_planted_allowed.py"], require=True)
    assert rc == 0, out
    assert counts["gpu"] == {"passed": 0, "skipped": 1, "failed": 0}, counts
    # The same wording is no excuse where it is false (a GPU test skipped for
    # "no CUDA device" on a machine that has one is a broken set-up).
    rc, out, counts = _run(tmp_path, ["test_planted_wrong_reason.py"], require=True)
    assert rc == 1, out
    assert counts["other"]["failed"] == 1, counts


def test_summary_prints_counts_per_tier(tmp_path):
    rc, out, _ = _run(tmp_path, ["test_planted_skip.py", "test_planted_allowed.py"], require=False)
    assert rc == 0, out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if "tests per tier" in ln)
    rows = lines[head + 2 : head + 3 + len(TIERS)]  # every tier, then other
    table = {ln.split()[0]: ln.split()[1:] for ln in rows}
    assert table["triton"] == ["0", "1", "0"], out
    assert table["gpu"] == ["0", "1", "0"], out
    assert table["other"] == ["2", "0", "0"], out  # an xfail did what it declares: passed


def test_skip_allowed_and_tier_of():
    assert skip_allowed(TRUE_HERE) and skip_allowed("Skipped: " + TRUE_HERE)
    assert not skip_allowed(FALSE_HERE)
    assert not skip_allowed("cuobjdump not found")
    assert tier_of({"sm90", "gpu"}) == "gpu" and tier_of({"test_x"}) == "other"
