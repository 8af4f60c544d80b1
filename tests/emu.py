"""The "cuda-emulated" backend: our plain CUDA kernels run on CPU tensors.

``compass_kernels._C_emu`` holds the kernels of ``csrc/*/*.cu`` (those listed
in ``cmake/emu.cmake``) compiled with the host compiler and executed by the
SIMT emulator in ``csrc/emu`` (docs/emulation.md): one fiber per CUDA thread,
warps in lockstep at every collective, blocks one after another, with checks
a GPU does not give (out-of-bounds global accesses, divergent barriers,
shuffles of inactive lanes, shared-memory races). It exposes the same host
entry points as the CUDA backend of ``_C`` (the stream argument is ignored),
taking CPU tensors as the emulated device memory.

Tests only: dispatch never chooses it (compass_kernels._dispatch.TEST_BACKENDS);
``backend="cuda-emulated"`` on CPU tensors asks for it by name.

- :func:`install`: adds the "cuda-emulated" backend to every registered op
  whose CUDA entry point _C_emu has (tests/conftest.py and ck.info() call it).
- :func:`call` (``"routing.encode_sets_cuda"``, args...): run an
  emulated entry point; a failed check raises an :class:`EmulationError`
  subclass whose message names kernel, block, thread, address and, when
  ``addr2line`` is installed, the source line.
- :func:`evidence`: which kernels and entry points are emulated (ck.info()).
- :func:`mutant` (tests): route :func:`call` to a planted-bug build of the
  kernels, to show the tests catch it.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from compass_kernels._ext import BackendUnavailableError

BACKEND = "cuda-emulated"

_ERRORS = (
    "EmulationError",
    "OutOfBoundsError",
    "BarrierError",
    "InactiveLaneError",
    "SharedMemoryRaceError",
    "UninitializedSharedMemoryError",
    "LaunchError",
)
_mutant: str | None = None


@functools.cache
def load() -> ModuleType:
    """Import compass_kernels._C_emu, or raise with how to build it."""
    try:
        from compass_kernels import _C_emu
    except ImportError as err:
        raise BackendUnavailableError(
            "the cuda-emulated backend (compass_kernels._C_emu) is not built or failed to load "
            f"({err}); it is built with the CPU module by GCC unless COMPASS_EMU=OFF"
        ) from err
    return _C_emu


def available() -> bool:
    try:
        load()
    except BackendUnavailableError:
        return False
    return True


def __getattr__(name: str) -> Any:
    """The error classes of _C_emu (EmulationError and its subclasses)."""
    if name in _ERRORS:
        return getattr(load(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def entry_point(qualified: str) -> Callable[..., Any]:
    """The raw emulated entry point ``"<capability>.<name>"`` (current mutant, if any)."""
    capability, name = qualified.split(".")
    mod = load()
    sub = getattr(mod, capability)
    if _mutant is not None:
        sub = getattr(getattr(mod.mutants, capability), _mutant)
    return getattr(sub, name)


class EmulatedKernel:
    """An op backend: ``kernel(*args, *outputs[, stream])`` runs the emulated
    CUDA entry point ``qualified`` (the op layer's calling convention)."""

    def __init__(self, qualified: str) -> None:
        self.qualified = qualified

    def __call__(self, *args: Any) -> Any:
        return call(self.qualified, *args)

    def __repr__(self) -> str:
        return f"EmulatedKernel({self.qualified!r})"


def install() -> list[str]:
    """Register "cuda-emulated" on every op whose "cuda" kernel _C_emu also has.

    Idempotent; returns the ops that have it. Nothing is registered when _C_emu
    is not built (dispatch then says the op has no such backend)."""
    from compass_kernels._op import OPS

    if not available():
        return []
    mod, names = load(), []
    for name, op in OPS.items():
        spec = op._specs.get("cuda")
        if not isinstance(spec, str) or ":" in spec:
            continue
        capability, _, entry = spec.partition(".")
        if hasattr(getattr(mod, capability, None), entry):
            if BACKEND not in op.backends:
                op.add_backend(BACKEND, EmulatedKernel(spec), positional=True)
            names.append(name)
    return names


def call(qualified: str, *args: Any) -> Any:
    """Run the emulated entry point ``qualified`` (e.g. "routing.encode_sets_cuda")."""
    fn = entry_point(qualified)
    err_cls = load().EmulationError
    try:
        return fn(*args)
    except err_cls as err:
        raise type(err)(symbolize(str(err))) from None


_CODE = re.compile(r" \[code: (?P<path>\S+)\+(?P<offset>0x[0-9a-f]+)\]")


def symbolize(message: str) -> str:
    """Replace a report's ``[code: lib+0x...]`` with the source line (addr2line)."""
    match = _CODE.search(message)
    tool = shutil.which("addr2line")
    if match is None or tool is None:
        return message
    try:
        out = subprocess.run(
            [tool, "-C", "-i", "-f", "-e", match["path"], match["offset"]],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return message
    # -i: the innermost inlined frame comes first, its file:line on the second line
    if len(out) < 2 or out[1].startswith("??"):
        return message
    line = re.sub(r" \(discriminator \d+\)", "", out[1])
    line = line[line.find("csrc/") :] if "csrc/" in line else line
    return message[: match.start()] + f" at {line}" + message[match.end() :]


@contextlib.contextmanager
def mutant(name: str) -> Iterator[None]:
    """Within the block, :func:`call` runs the kernels with planted bug ``name``."""
    global _mutant
    known = {m for names in mutants().values() for m in names}
    if name not in known:
        raise ValueError(f"unknown mutant {name!r}; built: {sorted(known)}")
    previous, _mutant = _mutant, name
    try:
        yield
    finally:
        _mutant = previous


def mutants() -> dict[str, list[str]]:
    """The planted-bug builds compiled into _C_emu, per capability (cmake/emu.cmake)."""
    mod = load().mutants
    return {
        cap: sorted(n for n in dir(getattr(mod, cap)) if not n.startswith("_"))
        for cap in dir(mod)
        if not cap.startswith("_") and isinstance(getattr(mod, cap), ModuleType)
    }


def evidence() -> dict[str, Any]:
    """What runs under emulation here: kernels, entry points, work done so far."""
    if not available():
        return {"built": False, "kernels": [], "entry_points": [], "stats": {}}
    mod = load()
    capabilities = [
        cap
        for cap in dir(mod)
        if isinstance(getattr(mod, cap), ModuleType) and cap not in ("mutants", "selftest")
    ]
    entries = [
        f"{cap}.{name}"
        for cap in capabilities
        for name in dir(getattr(mod, cap))
        if name.endswith("_cuda")
    ]
    kernels = [k for k in mod.kernels() if "emu_selftest" not in k]
    return {"built": True, "kernels": kernels, "entry_points": entries, "stats": dict(mod.stats())}
