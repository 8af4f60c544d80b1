"""Test tiers: which skips are legitimate, and the per-tier counts CI prints.

Under ``COMPASS_REQUIRE_ALL_TIERS=1`` (``make test``, CI) a skipped test or a
skipped module fails the run (tests/conftest.py turns the skip into a failure)
unless its reason starts with one of :data:`ALLOWED_SKIPS` *and* that reason is
true on this machine:

- :data:`NO_CUDA_DEVICE`: the test needs a CUDA device and there is none;
- :data:`INTERPRETER_ONLY`: the test exercises the Triton CPU interpreter, which
  this process does not run because a GPU is present (conftest only sets
  ``TRITON_INTERPRET=1`` without one); those tests run on every CPU machine.

Everything else (a missing package, a missing tool, a build without CUDA) is a
broken set-up there, not a reason to pass. Use the constants as skip reasons
(``pytest.skip(NO_CUDA_DEVICE)``, ``skipif(..., reason=INTERPRETER_ONLY)``).
"""

from __future__ import annotations

import torch

HAS_GPU = torch.cuda.is_available()

NO_CUDA_DEVICE = "needs a CUDA device (none here)"
INTERPRETER_ONLY = (
    "needs the Triton CPU interpreter, which runs only on machines without a GPU "
    "(TRITON_INTERPRET=1 is set by conftest when torch sees no CUDA device)"
)

#: reason prefix -> whether that reason may be accepted on this machine.
ALLOWED_SKIPS = {
    NO_CUDA_DEVICE: lambda: not HAS_GPU,
    INTERPRETER_ONLY: lambda: HAS_GPU,
}

#: Tier of a test: its first marker in this order, else "other".
TIERS = ("gpu", "triton", "sm90", "integration", "slow")
OUTCOMES = ("passed", "skipped", "failed")


def device_for(backend: str | None) -> str:
    """The device a backend's tensors go to in the tests: Triton runs on CUDA tensors
    where a GPU is (the interpreter, and so Triton on CPU tensors, is off there);
    everything else here on CPU tensors."""
    return "cuda" if backend == "triton" and HAS_GPU else "cpu"


def skip_allowed(reason: str) -> bool:
    """Whether a skip with this reason is legitimate here under COMPASS_REQUIRE_ALL_TIERS=1."""
    reason = reason.removeprefix("Skipped: ").strip()
    return any(reason.startswith(p) and ok() for p, ok in ALLOWED_SKIPS.items())


def skip_reason(longrepr) -> str:
    """The reason of a skip report (``longrepr`` is ``(path, lineno, reason)``)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def tier_of(keywords) -> str:
    """The tier of a test from its keywords (marker names)."""
    return next((t for t in TIERS if t in keywords), "other")
