"""docs/adding_an_op.md's worked example (``clip`` for group_advantages) is applied
to a scratch copy of the package and the op's test file runs there; the patch
touches at most the 5 places a new argument may (so the count cannot drift)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding_an_op.md"
CAP = "compass_kernels/advantages"
# place -> (file, top-level definitions in it that belong to the place; None: any)
PLACES = {
    "public signature and doc": (f"{CAP}/__init__.py", None),
    "reference": (f"{CAP}/reference.py", {"group_advantages_reference"}),
    "CPU kernel": (f"{CAP}/reference.py", {"group_advantages_torch"}),
    "GPU kernel": (f"{CAP}/triton.py", None),
    "test": ("tests/test_advantages.py", None),
}


def _patch() -> str:
    m = re.search(
        r"<!-- worked-example:begin -->\s*```diff\n(.*?)```\s*<!-- worked-example:end -->",
        DOC.read_text(),
        re.S,
    )
    assert m, f"{DOC}: no worked example between the worked-example markers"
    return m.group(1)


def _changed_lines(patch: str) -> dict[str, set[int]]:
    """file -> lines of the patched file that an added line, or a removal, is at."""
    out: dict[str, set[int]] = {}
    path, line = None, 0
    for row in patch.splitlines():
        if row.startswith("+++ b/"):
            path = row[6:]
            out.setdefault(path, set())
        elif row.startswith("@@"):
            line = int(re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", row).group(1))
        elif row.startswith("+") and not row.startswith("+++"):
            out[path].add(line)
            line += 1
        elif row.startswith("-") and not row.startswith("---"):
            out[path].add(line)
        elif row.startswith(" "):
            line += 1
    return out


def _definition_at(source: str, line: int) -> str:
    """The top-level def / class holding ``line`` (decorators included), or ""."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if start <= line <= node.end_lineno:
                return node.name
    return ""


def _scratch_copy(tmp: Path) -> Path:
    for part in ("compass_kernels", "tests"):
        shutil.copytree(ROOT / part, tmp / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    patch = tmp / "worked_example.patch"
    patch.write_text(_patch())
    proc = subprocess.run(
        ["git", "apply", "-C1", str(patch)], cwd=tmp, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"the worked example no longer applies:\n{proc.stderr}"
    return tmp


def test_worked_example_touches_at_most_five_places(tmp_path):
    root = _scratch_copy(tmp_path)
    places = set()
    for path, lines in _changed_lines(_patch()).items():
        source = (root / path).read_text()
        for line in lines:
            where = _definition_at(source, line)
            hit = [
                p
                for p, (f, defs) in PLACES.items()
                if f == path and (defs is None or where in defs)
            ]
            assert hit, f"{path}:{line} (in {where or 'module level'}) is outside the 5 places"
            places.update(hit)
    assert len(places) <= 5
    assert places == set(PLACES), f"the example should touch every place, got {sorted(places)}"


@pytest.mark.slow
def test_worked_example_passes_the_ops_tests(tmp_path):
    root = _scratch_copy(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        "tests/test_advantages.py",
    ]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "test_clip_bounds_the_advantages" not in tail  # ran and passed (no failure line)
    collected = subprocess.run(
        cmd + ["--collect-only", "-k", "clip"], cwd=root, env=env, capture_output=True, text=True
    )
    assert "test_clip_bounds_the_advantages" in collected.stdout, "the example's test is missing"
