"""Tests of compass_kernels.profiling: the COMPASS_NVTX switch, no-op when off, names."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import pytest
import torch

from compass_kernels import profiling


class Recorder:
    """A fake NVTX backend that records pushes and pops."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []

    def backend(self):
        return (
            "recorder",
            lambda msg: self.events.append(("push", msg)),
            lambda: self.events.append(("pop", None)),
        )


@pytest.fixture
def restore_state():
    enabled, backend = profiling._state.enabled, profiling._state.backend
    yield profiling._state
    profiling._state.enabled, profiling._state.backend = enabled, backend
    profiling._local.depth = 0


@pytest.fixture
def rec(restore_state):
    r = Recorder()
    restore_state.backend = r.backend()
    return r


def _import_state(env_value: str | None) -> bool:
    """Whether profiling.py, imported in a fresh interpreter with COMPASS_NVTX=env_value,
    is enabled. Loaded by path (not via the package) to also check that importing
    it pulls in neither torch nor nvtx."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('prof', {profiling.__file__!r})\n"
        "p = importlib.util.module_from_spec(spec); spec.loader.exec_module(p)\n"
        "assert 'torch' not in sys.modules and 'nvtx' not in sys.modules\n"
        "print(p.is_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != profiling.ENV_VAR}
    if env_value is not None:
        env[profiling.ENV_VAR] = env_value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


def test_env_switch_read_at_import(monkeypatch, restore_state):
    for value, expected in (("1", True), ("0", False), ("", False), ("true", True)):
        monkeypatch.setenv(profiling.ENV_VAR, value)
        importlib.reload(profiling)
        assert profiling.is_enabled() is expected, value
    monkeypatch.delenv(profiling.ENV_VAR)
    importlib.reload(profiling)
    assert profiling.is_enabled() is False


def test_env_switch_in_a_fresh_process():
    assert _import_state("1") is True
    assert _import_state(None) is False


def test_set_enabled(rec):
    profiling.set_enabled(True)
    assert profiling.is_enabled()
    with profiling.nvtx_range("a"):
        pass
    profiling.set_enabled(False)
    assert not profiling.is_enabled()
    with profiling.nvtx_range("b"):
        pass
    assert rec.events == [("push", "a"), ("pop", None)]


def test_off_is_a_noop(rec, monkeypatch):
    profiling.set_enabled(False)
    rec_backend = profiling._state.backend
    profiling._state.backend = None

    def forbidden(*args, **kwargs):
        raise AssertionError("must not be called while disabled")

    monkeypatch.setattr(profiling, "_caller_name", forbidden)  # no name formatting
    monkeypatch.setattr(profiling, "_resolve_backend", forbidden)  # no nvtx / CUDA lookup
    ctx = profiling.nvtx_range()
    assert ctx is profiling.nvtx_range("x")  # one shared object, nothing allocated
    with ctx:
        pass
    profiling.nvtx_push("p")
    profiling.nvtx_pop()

    @profiling.nvtx_decorator()
    def f(a, *, b):
        return a + b

    assert f(1, b=2) == 3
    assert profiling._state.backend is None
    assert rec.events == [] and rec_backend is not None


def test_off_overhead_is_small(restore_state):
    profiling.set_enabled(False)

    @profiling.nvtx_decorator()
    def f():
        return None

    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        with profiling.nvtx_range():
            pass
        f()
    per_iter = (time.perf_counter() - t0) / n
    assert per_iter < 20e-6  # typically ~0.3 us; a generous bound against a loaded machine


def test_default_names_are_module_and_qualname(rec):
    profiling.set_enabled(True)

    @profiling.nvtx_decorator()
    def decorated():
        return 5

    @profiling.nvtx_decorator
    def bare():
        return 6

    class Layer:
        @profiling.nvtx_decorator()
        def forward(self):
            with profiling.nvtx_range():
                pass

    assert decorated() == 5 and bare() == 6
    Layer().forward()
    here = f"{__name__}.test_default_names_are_module_and_qualname.<locals>"
    assert [m for kind, m in rec.events if kind == "push"] == [
        f"{here}.decorated",
        f"{here}.bare",
        f"{here}.Layer.forward",
        f"{here}.Layer.forward",  # nvtx_range() names its caller
    ]
    assert decorated.nvtx_name == f"{here}.decorated" and decorated.__name__ == "decorated"


def test_explicit_name_and_pop_on_exception(rec):
    profiling.set_enabled(True)

    @profiling.nvtx_decorator("custom")
    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        boom()
    with pytest.raises(ValueError), profiling.nvtx_range("block"):
        raise ValueError
    assert rec.events == [("push", "custom"), ("pop", None), ("push", "block"), ("pop", None)]


def test_range_pops_what_it_pushed_across_a_toggle(rec):
    profiling.set_enabled(True)
    with profiling.nvtx_range("r"):
        profiling.set_enabled(False)
    profiling.set_enabled(False)
    assert rec.events == [("push", "r"), ("pop", None)]


def test_push_pop_balance(rec):
    profiling.set_enabled(True)
    profiling.nvtx_pop()  # nothing open on this thread: no stray pop
    profiling.nvtx_push("outer")
    profiling.nvtx_push("inner")
    profiling.nvtx_pop()
    profiling.nvtx_pop()
    profiling.nvtx_pop()
    assert rec.events == [("push", "outer"), ("push", "inner"), ("pop", None), ("pop", None)]


def test_on_without_gpu_does_not_raise(restore_state):
    profiling.set_enabled(True)
    profiling._state.backend = None
    name = profiling.backend_name()
    if not torch.cuda.is_available():
        assert name in ("nvtx", "none")
    with profiling.nvtx_range("real"):
        profiling.nvtx_push("x")
        profiling.nvtx_pop()

    @profiling.nvtx_decorator()
    def f():
        return 1

    assert f() == 1


def test_backend_fallbacks(restore_state, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # makes `import nvtx` raise ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    profiling.set_enabled(True)
    profiling._state.backend = None
    assert profiling.backend_name() == "none"  # never touches torch.cuda.nvtx on a CPU build
    with profiling.nvtx_range("cpu-only"):
        pass
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    profiling._state.backend = None
    assert profiling.backend_name() == "torch.cuda.nvtx"
