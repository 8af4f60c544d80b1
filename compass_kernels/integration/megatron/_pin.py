"""What the two megatron-core patches share (``integration.cpu.megatron``, the CPU shim,
and ``integration.megatron.replay``, the router replay patch): the version range both were written
against, its check, and the source fingerprint each pins the upstream
functions it replaces by. Imports megatron-core only when a check runs."""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from typing import Any

#: megatron-core release lines the patches were reviewed against: 0.16.x (the last
#: line for Python 3.10 / 3.11) and 0.19.x (the newest; Python >= 3.12). Within a
#: line, each exact release still needs its source hashes pinned by the patch.
SUPPORTED_VERSION_PREFIXES = ("0.16.", "0.19.")


def installed_version() -> str:
    """megatron-core's release, e.g. "0.19.2". 0.19 appends ``+<short hash>`` of whatever
    git repository encloses its install (a venv inside a checkout: that checkout's HEAD)
    to ``__version__``; that local label says nothing about megatron and is dropped."""
    import megatron.core

    return str(getattr(megatron.core, "__version__", "unknown")).split("+", 1)[0]


def check_version(owner: str, error: type[Exception], what: str) -> str:
    """The installed megatron-core version; raises ``error`` naming ``owner``
    (a module) and ``what`` it must review when the version is outside
    :data:`SUPPORTED_VERSION_PREFIXES`."""
    version = installed_version()
    if not version.startswith(SUPPORTED_VERSION_PREFIXES):
        lines = " and ".join(f"{p}x" for p in SUPPORTED_VERSION_PREFIXES)
        raise error(
            f"{owner} supports megatron-core {lines}, found {version}; review the {what} "
            "before widening the range"
        )
    return version


def source_sha256(obj: Any) -> str:
    """sha256 of ``obj``'s source, dedented, trailing spaces and blank lines dropped
    (so re-indentation or a file moved within the package does not count as a
    change; any change of code, comments or docstrings does)."""
    return text_sha256(inspect.getsource(obj))


def text_sha256(source: str) -> str:
    """:func:`source_sha256` of source text (the vLLM pins hash source read from files,
    compass_kernels.integration.vllm._pin)."""
    lines = [ln.rstrip() for ln in textwrap.dedent(source).splitlines() if ln.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
