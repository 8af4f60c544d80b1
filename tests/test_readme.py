"""README.md is a user's page that tells the truth: every ```python block runs as it
stands in a fresh interpreter outside the source tree and prints what its ``# ->``
comments say; the status matrix is the one ``ck.info()["evidence"]`` generates; the
files it links exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import compass_kernels

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 20
#: Modules a block may need beyond compass_kernels and torch: the block is in the
#: integration tier when it imports one (the engines take a while to start).
ENGINES = ("vllm", "megatron", "transformers")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block."""
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    ]


def expected_output(code: str) -> list[str]:
    """The lines a block says it prints: the text after each ``# -> `` in order (on
    the print's line or on a comment line of its own)."""
    return [line.split("# -> ", 1)[1].rstrip() for line in code.splitlines() if "# -> " in line]


def _engines(code: str) -> list[str]:
    return [e for e in ENGINES if re.search(rf"^\s*(from|import) {e}\b", code, re.M)]


def _param(lineno: int, code: str):
    engines = _engines(code)
    marks = [pytest.mark.integration, pytest.mark.slow] if engines else []
    marks += [pytest.mark.vllm] if "vllm" in engines else []
    return pytest.param(lineno, code, id=f"README.md:{lineno}", marks=marks)


BLOCKS = python_blocks(README.read_text())


def test_readme_has_a_block_per_capability():
    text = README.read_text()
    for pkg in ("ck.advantages", "ck.espo", "ck.routing", "ck.packing", "ck.fp8"):
        assert any(pkg in code or pkg.split(".")[1] in code for _, code in BLOCKS), pkg
    assert "DESIGN.md" not in text and "docs/semantics.md" in text


@pytest.mark.parametrize("lineno, code", [_param(n, c) for n, c in BLOCKS])
def test_python_block_runs_standalone_and_prints_what_it_says(lineno, code, tmp_path):
    for engine in _engines(code):
        pytest.importorskip(engine)
    lines = code.rstrip("\n").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md:{lineno}: {len(lines)} lines (at most {MAX_LINES})"
    expected = expected_output(code)
    assert expected, f"README.md:{lineno}: no '# -> output' comment"
    script = tmp_path / "block.py"
    script.write_text(code)
    # Fresh interpreter, cwd outside the tree; the compass_kernels under test first.
    env = {**os.environ, "PYTHONPATH": str(Path(compass_kernels.__file__).parents[1])}
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # vLLM logs to stdout by default
    env.pop("PYTHONSTARTUP", None)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    where = f"README.md:{lineno}"
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-4000:]}"
    # no warning raised at the package's lines ("<path>/compass_kernels/x.py:12: UserWarning")
    ours = re.findall(r"^.*compass_kernels/\S+\.py:\d+: \w*Warning.*$", proc.stderr, re.M)
    assert not ours, f"{where} prints the package's warnings:\n" + "\n".join(ours)
    out = [line.rstrip() for line in proc.stdout.splitlines()]
    assert out == expected, f"{where} printed\n{proc.stdout}\nbut its comments say\n" + "\n".join(
        expected
    )


def test_status_matrix_is_the_generated_one():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import readme_matrix
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    why = readme_matrix.complete_build()
    if why:
        pytest.skip(f"the matrix is generated from a build with CUDA: {why}")
    from compass_kernels._info import status_matrix

    assert readme_matrix.readme_matrix() == status_matrix(), (
        "README.md's status matrix is stale: run `python scripts/readme_matrix.py --write`"
    )


def test_status_cells_are_one_word_or_a_dated_run():
    from compass_kernels._info import _status_cell

    runs = [
        "run on a GPU: NVIDIA H100 80GB HBM3, 2026-11-23, 3 passed / 0 failed (a)",
        "run on a GPU: NVIDIA H100 80GB HBM3, 2026-11-25, 2 passed / 0 failed (b)",
        "run on a GPU: NVIDIA H100 80GB HBM3, 2026-11-26, 2 passed / 1 failed (c)",
    ]
    assert (
        _status_cell(["compiled for sm_80, sm_90a (SASS ...)", *runs]) == "ran on H100 2026-11-25"
    )
    assert _status_cell(runs[2:] + ["interpreter-run on CPU"]) == "interpreter"
    assert _status_cell(["interpreter-run on CPU", "AOT-compiled for sm_90"]) == "interpreter"
    assert _status_cell(["reference-tested on CPU"]) == "reference-tested"
    assert _status_cell(None) == "-"
    cells = re.findall(r"\| ([^|`]+?) (?=\|)", README.read_text().split("status-matrix")[1])
    assert all(len(c) <= 24 for c in cells), [c for c in cells if len(c) > 24]


def test_relative_links_exist():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    links += re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    missing = [p for p in links if "://" not in p and not (ROOT / p).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_engine_blocks_are_detected():
    """The engine blocks really are in the integration tier (else CI-fast runs start engines)."""
    engine_blocks = [code for _, code in BLOCKS if _engines(code)]
    assert len(engine_blocks) >= 2
    assert importlib.util.find_spec("compass_kernels.integration") is not None


def test_rl_table_has_the_columns_compass_rl_writes():
    """The README's RL table is steps.md of a `make rl` run (scripts/readme_rl.py)."""
    from compass_kernels.integration.rl.console import markdown_table

    text = README.read_text()
    table = text.split("<!-- rl-table:", 1)[1].split("<!-- /rl-table -->", 1)[0]
    header = markdown_table([]).splitlines()[0]
    assert header in table.splitlines(), "regenerate: make rl && python scripts/readme_rl.py rl_out"
