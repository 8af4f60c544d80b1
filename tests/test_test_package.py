"""The test-suite imports its own helpers (``tests.tiers``) even with a foreign
top-level ``tests`` package installed (verl's wheel ships one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tests_is_a_regular_package():
    """A namespace folder (no __init__.py) loses to any installed regular package."""
    import tests

    assert tests.__file__ is not None, "tests/ must have an __init__.py"
    assert Path(tests.__file__).resolve().parent == ROOT / "tests"


def test_a_foreign_tests_package_does_not_shadow_ours(tmp_path):
    """A fake site-packages with a regular ``tests`` package on PYTHONPATH, as an
    installed verl puts one: collecting a module that imports ``tests.tiers``
    still works."""
    foreign = tmp_path / "site" / "tests"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("FOREIGN = True\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    probe = textwrap.dedent(
        """
        import sys
        import tests
        assert getattr(tests, "FOREIGN", False), "the fake package is not importable"
        """
    )
    # the fake really is importable from outside the repo (else the check proves nothing)
    subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, check=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "-p",
            "no:cacheprovider",
            "tests/test_tiers.py",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "error" not in out.stdout.lower().splitlines()[-1], out.stdout[-3000:]
