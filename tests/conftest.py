"""Test tiers and global setup.

- TRITON_INTERPRET=1 is set here, before anything imports triton, when no CUDA
  device is present: Triton kernels then run on CPU tensors in the interpreter,
  and the test-only fix of the interpreter's dot/cast builders is applied.
- Markers (pyproject.toml): gpu (auto-skipped without a device), triton, sm90,
  integration, slow. Select tiers with -m, e.g. `-m "not integration"`.
- COMPASS_REQUIRE_ALL_TIERS=1 (`make test`, CI): every skip, of a test or of a
  whole module (a module-level ``pytest.importorskip``), fails the run unless
  tests/tiers.py allows its reason on this machine ("no CUDA device" on a CPU
  machine, "interpreter only" on a GPU machine). One hook does it for every
  skip, wherever it comes from.
- At the end, pytest prints passed / skipped / failed per tier (tests/tiers.py);
  with COMPASS_TIER_REPORT=<path> the same counts are written there as JSON.
"""

from __future__ import annotations

import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from tests.tiers import (  # noqa: E402
    NO_CUDA_DEVICE,
    OUTCOMES,
    TIERS,
    device_for,
    skip_allowed,
    skip_reason,
    tier_of,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
# `make test` and CI install every tier: there a missing dependency fails
# instead of skipping (tests/fixtures/engines.py honours the same switch).
REQUIRE_ALL_TIERS = os.environ.get("COMPASS_REQUIRE_ALL_TIERS") == "1"

pytest_plugins = ["tests.fixtures.engines"]


@pytest.fixture
def backend_device(backend) -> str:
    """The device the parametrized ``backend`` runs on here (tests.tiers.device_for)."""
    return device_for(backend)


def pytest_collection_modifyitems(config, items):
    if REQUIRE_ALL_TIERS and not HAS_TRITON:
        raise pytest.UsageError("COMPASS_REQUIRE_ALL_TIERS=1 but triton is not installed")
    skip_gpu = pytest.mark.skip(reason=NO_CUDA_DEVICE)
    skip_triton = pytest.mark.skip(reason="triton is not installed: pip install -e '.[triton]'")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "triton" in item.keywords and not HAS_TRITON:
            item.add_marker(skip_triton)
    # Engines last: a live vLLM engine pins the process's threads and turns
    # torch.compile off until it shuts down, which must not leak into unit tests.
    items.sort(key=lambda item: "integration" in item.keywords)


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_fixed():
    """Apply the interpreter fix for the whole session when interpreting."""
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        from tests import triton_interpreter

        triton_interpreter.apply()
    yield


# ------------------------------------------------------ process-wide state a test leaks

# What an engine start, compass-rl's loop or an import hook changes for the whole
# process: a unit test that leaves one changed turns later tests' torch.compile off or
# runs them on an activated platform (CI once failed three tests far from the cause).
_PROCESS_ENV = (
    "TORCHDYNAMO_DISABLE",
    "TORCH_COMPILE_DISABLE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_TARGET_DEVICE",
    "VERL_ENGINE_DEVICE",
    "VERL_USE_EXTERNAL_MODULES",
)


def _process_state() -> dict[str, object]:
    import sys

    state: dict[str, object] = {k: os.environ.get(k) for k in _PROCESS_ENV}
    dynamo = sys.modules.get("torch._dynamo")
    state["torch._dynamo.config.disable"] = dynamo is not None and dynamo.config.disable
    platform = sys.modules.get("compass_kernels.integration.cpu.verl_platform")
    state["verl CPU platform active"] = platform is not None and platform.active()
    return state


@pytest.fixture(autouse=True)
def _no_leaked_process_state(request):
    """Fail the unit test that leaves process-wide state changed (engines are exempt:
    the integration tier runs last and shares module-scoped engines)."""
    before = _process_state()
    yield
    if "integration" in request.keywords:
        return
    after = _process_state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if changed:
        pytest.fail(f"left process-wide state changed (before, after): {changed}", pytrace=False)


# ------------------------------------------------------ skips that cannot pass silently


def _forbid_skip(report, where: str) -> None:
    """Turn a skip ``report`` into a failure unless tests/tiers.py allows it here."""
    if not (REQUIRE_ALL_TIERS and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report.longrepr)
    if skip_allowed(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{where} was skipped, and COMPASS_REQUIRE_ALL_TIERS=1 allows no skip but the "
        f"ones tests/tiers.py lists for this machine.\n  reason: {reason}\n"
        "Install what the tier needs (scripts/setup_env.sh), or run without "
        "COMPASS_REQUIRE_ALL_TIERS to let it skip."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _forbid_skip(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level pytest.importorskip / pytest.skip(allow_module_level=True)
    # skips the whole module at collection time: no test report ever sees it.
    outcome = yield
    _forbid_skip(outcome.get_result(), f"collecting {collector.nodeid}")


# ------------------------------------------------------------ counts per tier

_FINAL: dict[str, tuple[str, str]] = {}  # nodeid -> (tier, outcome)


def pytest_runtest_logreport(report):
    # A test is failed if any phase failed, skipped if setup or call skipped,
    # passed if its call passed (teardown errors count as failures). An xfail
    # (expected failure that failed) counts as passed: it did what it declares.
    tier = tier_of(report.keywords)
    prev = _FINAL.get(report.nodeid, (tier, None))[1]
    if report.failed:
        _FINAL[report.nodeid] = (tier, "failed")
    elif hasattr(report, "wasxfail") and prev is None:
        _FINAL[report.nodeid] = (tier, "passed")
    elif report.skipped and prev != "failed":
        _FINAL[report.nodeid] = (tier, "skipped")
    elif report.when == "call" and report.passed and prev is None:
        _FINAL[report.nodeid] = (tier, "passed")


def pytest_collectreport(report):
    if report.failed or report.skipped:  # a whole module that did not collect
        outcome = "failed" if report.failed else "skipped"
        _FINAL[f"collect::{report.nodeid}"] = ("collection", outcome)


def tier_counts() -> dict[str, dict[str, int]]:
    """{tier: {passed, skipped, failed}} for every tier (zeros included)."""
    counts = {t: dict.fromkeys(OUTCOMES, 0) for t in (*TIERS, "other", "collection")}
    for tier, outcome in _FINAL.values():
        counts[tier][outcome] += 1
    return counts


def pytest_terminal_summary(terminalreporter):
    counts = tier_counts()
    tr = terminalreporter
    tr.section("tests per tier")
    tr.write_line(f"{'tier':<12}{'passed':>8}{'skipped':>9}{'failed':>8}")
    for tier, c in counts.items():
        if tier == "collection" and not any(c.values()):
            continue
        tr.write_line(f"{tier:<12}{c['passed']:>8}{c['skipped']:>9}{c['failed']:>8}")
    tr.write_line(
        f"(COMPASS_REQUIRE_ALL_TIERS={'1' if REQUIRE_ALL_TIERS else '0'}, "
        f"CUDA device: {'yes' if HAS_GPU else 'no'})"
    )
    path = os.environ.get("COMPASS_TIER_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(
                {"require_all_tiers": REQUIRE_ALL_TIERS, "gpu": HAS_GPU, "tiers": counts},
                f,
                indent=1,
            )
