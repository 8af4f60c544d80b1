"""Evidence of where compass's verl pieces ran, for tests of verl's real (Ray) trainer.

With ``COMPASS_VERL_PROBE_DIR`` set (inherited by the driver, the Ray workers and vLLM's
engine process), each compass entry point appends one line to ``<dir>/<name>.<pid>``
when it runs; :func:`read` counts them. Unset (the default), :func:`hit` is one
environment lookup.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV", "hit", "read"]

#: the variable naming the probe folder
ENV = "COMPASS_VERL_PROBE_DIR"


def hit(name: str, detail: str = "") -> None:
    """Record that ``name`` ran in this process (a no-op unless :data:`ENV` is set)."""
    folder = os.environ.get(ENV)
    if folder:
        with open(Path(folder) / f"{name}.{os.getpid()}", "a") as f:
            f.write(f"{detail}\n")


def read(folder: str | os.PathLike) -> dict[str, dict[int, list[str]]]:
    """{name: {pid: [detail of each call]}} of the probes under ``folder``."""
    out: dict[str, dict[int, list[str]]] = {}
    for path in Path(folder).iterdir():
        name, _, pid = path.name.rpartition(".")
        if name and pid.isdigit():
            out.setdefault(name, {})[int(pid)] = path.read_text().splitlines()
    return out
