"""Planted bugs in Triton kernels: a copy of a kernel module with one edit,
swapped in as an op's backend for the length of a ``with`` block.

    with planted(encode_sets_op, "triton", triton_setcode, "encode_sets_triton",
                 old="ok = in_range & (below_sum", new="ok = in_range | (below_sum"):
        ...  # a test that must now fail

The copy is written to a temporary file and imported from there (Triton reads
a kernel's source from its file); ``old`` must occur exactly once in the
module, so an edit of the kernel that moves it fails loudly here instead of
planting nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

__all__ = ["mutated_module", "planted"]


def mutated_module(module: ModuleType, old: str, new: str) -> ModuleType:
    """A fresh copy of ``module`` with the one occurrence of ``old`` replaced by ``new``."""
    src = inspect.getsource(module)
    count = src.count(old)
    if count != 1:
        raise AssertionError(f"{module.__name__}: expected {old!r} once, found it {count} times")
    tmp = Path(tempfile.mkdtemp(prefix="compass_mutant_"))
    name = f"{module.__name__.rpartition('.')[2]}_mutant"
    path = tmp / f"{name}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses / triton look the module up by name
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(name, None)
    return mod


@contextlib.contextmanager
def planted(
    op, backend: str, module: ModuleType, wrapper: str, *, old: str, new: str
) -> Iterator[ModuleType]:
    """``op``'s ``backend`` runs ``wrapper`` of a mutated copy of ``module`` inside."""
    mod = mutated_module(module, old, new)
    spec = op._specs[backend]
    op.add_backend(backend, getattr(mod, wrapper))
    try:
        yield mod
    finally:
        op.add_backend(backend, spec)
