"""Set-up shared by the test modules that import Triton (the triton and sm90 tiers).

Import it first (``# isort: split`` after it): without a CUDA device it sets
``TRITON_INTERPRET=1`` before anything imports triton (conftest does the same;
this keeps ``--noconftest`` runs right), then imports triton, so a missing
triton skips the module, which ``COMPASS_REQUIRE_ALL_TIERS=1`` turns into a
failure. It says where launched kernels run: the CPU interpreter here, the GPU
on a GPU host.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests import aot  # noqa: E402

triton = pytest.importorskip("triton")

#: Triton runs kernels in its CPU interpreter (no GPU here).
INTERPRET = bool(triton.knobs.runtime.interpret)
#: Where the tests put the kernels' tensors.
DEVICE = "cpu" if INTERPRET else "cuda"
#: Marker for modules that launch kernels: they need the interpreter or a GPU.
LAUNCHES = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="needs a CUDA device or TRITON_INTERPRET=1 before triton is imported",
)


def have_tool(tool: str) -> bool:
    """Whether a CUDA binary tool (cuobjdump, nvdisasm, ptxas) is found (tests.aot)."""
    try:
        aot.find_tool(tool)
    except aot.ToolNotFoundError:
        return False
    return True


#: For tests that read SASS or resource usage out of a compiled module.
needs_cuobjdump = pytest.mark.skipif(
    not have_tool("cuobjdump"), reason="cuobjdump not found: pip install nvidia-cuda-cuobjdump"
)
