"""Test tiers and global setup.

- TRITON_INTERPRET=1 is set here, before anything imports triton, when no CUDA
  device is present: Triton kernels then run on CPU tensors in the interpreter,
  and the test-only fix of the interpreter's dot/cast builders is applied.
- Markers (pyproject.toml): gpu (auto-skipped without a device), triton,
  emulated (the CUDA kernels under the SIMT emulator), sm90, integration,
  slow. Select tiers with -m, e.g. `-m "not integration"`.
"""

from __future__ import annotations

import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
# `make test` and CI install every tier: there a missing dependency fails
# instead of skipping (tests/fixtures/engines.py honours the same switch).
REQUIRE_ALL_TIERS = os.environ.get("COMPASS_REQUIRE_ALL_TIERS") == "1"

pytest_plugins = ["tests.fixtures.engines"]


def pytest_collection_modifyitems(config, items):
    if REQUIRE_ALL_TIERS and not HAS_TRITON:
        raise pytest.UsageError("COMPASS_REQUIRE_ALL_TIERS=1 but triton is not installed")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none here)")
    skip_triton = pytest.mark.skip(reason="triton is not installed: pip install -e '.[triton]'")
    from compass_kernels import _emu

    _emu.install()  # the "cuda-emulated" backend of every op whose CUDA kernels it has
    if REQUIRE_ALL_TIERS and not _emu.available():
        raise pytest.UsageError(
            "COMPASS_REQUIRE_ALL_TIERS=1 but compass_kernels._C_emu is not built"
        )
    skip_emulated = pytest.mark.skip(reason="compass_kernels._C_emu is not built (COMPASS_EMU=OFF)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "triton" in item.keywords and not HAS_TRITON:
            item.add_marker(skip_triton)
        if "emulated" in item.keywords and not _emu.available():
            item.add_marker(skip_emulated)
    # Engines last: a live vLLM engine pins the process's threads and turns
    # torch.compile off until it shuts down, which must not leak into unit tests.
    items.sort(key=lambda item: "integration" in item.keywords)


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_fixed():
    """Apply the interpreter fix for the whole session when interpreting."""
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        from compass_kernels import triton_interpreter

        triton_interpreter.apply()
    yield
