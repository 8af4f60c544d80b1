"""The CUTLASS backend's host side (compass_kernels/fp8/grouped_gemm.py): the
per-shape caches that keep a call to two C++ entries, checked on the CPU (the
caches hold tensors of whatever device the operands are on)."""

from __future__ import annotations

import importlib

import pytest
import torch

from compass_kernels import _C

# the module (ck.fp8.grouped_gemm is the function of the same name)
gg = importlib.import_module("compass_kernels.fp8.grouped_gemm")

BUILT_WITH_CUDA = bool(_C.build_info()["cuda"])
pytestmark = pytest.mark.skipif(
    not BUILT_WITH_CUDA, reason="compass_kernels._C was built without CUDA (COMPASS_CUDA=OFF)"
)


def _operands(rows: int, experts: int, n: int, k: int = 256):
    a_q = torch.empty(rows, k, dtype=torch.float8_e4m3fn)
    b_q = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn)
    return a_q, b_q


@pytest.fixture(autouse=True)
def _fresh_cache():
    gg._BUFFERS.clear()
    yield
    gg._BUFFERS.clear()


def test_buffers_are_reused_per_shape_and_stream():
    a_q, b_q = _operands(1000, 7, 512)
    shapes, ptrs, ws, tile = gg.cutlass_launch_args(a_q, b_q, 0, 132)
    assert tile == _C.fp8.choose_sm90_tile(1000, 7, 512, 132)
    assert shapes.shape == (7, 3) and shapes.dtype == torch.int32
    assert ptrs.shape == (len(gg.PTR_ROWS), 7) and ptrs.dtype == torch.int64
    assert ws.dtype == torch.uint8
    assert ws.numel() == _C.fp8.grouped_gemm_sm90_workspace(tile, 7, 132)
    # another token count with the same tile, another K: the same buffers
    a2, b2 = _operands(999, 7, 512, k=128)
    again = gg.cutlass_launch_args(a2, b2, 0, 132)
    assert all(x is y for x, y in zip(again[:3], (shapes, ptrs, ws), strict=True))
    assert _C.fp8.choose_sm90_tile(100000, 7, 512, 132) != tile
    # another stream, expert count, tile or SM count: other buffers
    big = _operands(100000, 7, 512, k=16)[0]
    for args in (
        (a_q, b_q, 1, 132),
        (a_q, _operands(1000, 9, 512)[1], 0, 132),
        (big, b_q, 0, 132),
        (a_q, b_q, 0, 114),
    ):
        other = gg.cutlass_launch_args(*args)
        assert not any(x is y for x, y in zip(other[:3], (shapes, ptrs, ws), strict=True)), args
    assert len(gg._BUFFERS) == 5


def test_tile_follows_the_heuristic_for_every_token_count():
    _, b_q = _operands(1, 256, 4096)
    for rows in (0, 1, 128, 16384, 16385, 131072):
        a_q, _ = _operands(rows, 256, 4096, k=16)
        assert gg.cutlass_launch_args(a_q, b_q, 0, 132)[3] == _C.fp8.choose_sm90_tile(
            rows, 256, 4096, 132
        )
