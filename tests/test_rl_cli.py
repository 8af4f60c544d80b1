"""compass-rl's command line and console (no engines: fast): every option shows its
default, the engines' output goes to <out>/engines.log and its tail to the terminal on
failure, the per-step markdown table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(log), mode], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
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
        "step": 1, "reward_mean": 0.0981, "accuracy": 0.104, "zv_initial": 0.625,
        "zv_resample": 0.625, "zv_penalty": 0.125, "zv_rlzvp": 0.0, "inversions_naive": 1,
        "inversions_guard": 0, "tokens": 1444, "pack_utilization": 0.705,
        "routing_agreement": 0.99606, "gap_replay": 8.33e-3, "gap_native": 1.87e-2,
        "k3_replay": 5.54e-5, "k3_native": 2.14e-3, "probe_gap_before": 0.1805,
        "probe_gap": 7.3e-3, "t_rollout": 1.1, "t_old": 0.4, "t_train": 0.5, "t_sync": 0.1,
        "overlap_s": 0.96, "t_score_busy": 1.0,
    }  # fmt: skip
    lines = console.markdown_table([row]).splitlines()
    pipes = [len(re.findall(r"(?<!\\)\|", line)) for line in lines]
    assert pipes == [14, 14, 14], pipes
    assert lines[2] == (
        "| 1 | 0.098 | 0.10 | 0.62 / 0.62 / 0.12 / 0 | 1 / 0 | 1444 | 0.70 | 0.996 | "
        "8.3e-3 / 1.9e-2 | 5.5e-5 / 2.1e-3 | 0.18 / 7.3e-3 | 1.1 / 0.4 / 0.5 / 0.10 | "
        "0.96 of 1.00 |"
    )
