"""The Triton quantizers' x / s without a per-element division (fp8/triton.py
``_quotient``: one reciprocal per group, two fma corrections, scales below
2^-64 rescaled) against IEEE division, bit for bit, on the fp32 quotient."""

from __future__ import annotations

from tests.triton_tier import DEVICE, triton

# isort: split

import pytest
import torch
import triton.language as tl

from compass_kernels.fp8.triton import _quotient
from compass_kernels.testing import assert_bitwise_equal, make_generator


@triton.jit
def _quotient_kernel(x_ptr, s_ptr, y_ptr, B: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(s_ptr + i + tl.arange(0, 1))
    x = tl.load(x_ptr + i * B + tl.arange(0, B)[None, :])
    tl.store(y_ptr + i * B + tl.arange(0, B)[None, :], _quotient(x, s))


@pytest.mark.triton
def test_quotient_is_ieee_division_at_tiny_scales():
    """The fp32 quotient itself (before e4m3), bit for bit vs IEEE division, 2^20
    pairs: x / s log-uniform in 2^-12..2^9 (random signs) at the smallest
    scales eps >= 1e-30 allows (1e-30 / 448 .. 2^9 times that: unscaled, the
    residual is subnormal and ~1e-4 of these quotients come out one ulp off),
    and at normal scales 2^-60..2^60 (half the rows each)."""
    g = make_generator(43)
    rows, width = 256, 4096
    tiny = torch.full((rows // 2,), 1e-30 / 448) * torch.exp2(
        9 * torch.rand(rows // 2, generator=g)
    )
    normal = (torch.rand(rows // 2, generator=g) + 1) * torch.exp2(
        torch.randint(-60, 60, (rows // 2,), generator=g).float()
    )
    s = torch.cat([tiny, normal]).float()
    q = torch.exp2(torch.rand(rows, width, generator=g, dtype=torch.float64) * 21 - 12)
    q = torch.where(torch.rand(rows, width, generator=g) < 0.5, -q, q)
    x = (q * s[:, None].double()).float()
    y = torch.empty_like(x, device=DEVICE)
    _quotient_kernel[(rows,)](x.to(DEVICE), s.to(DEVICE), y, B=width)
    assert_bitwise_equal(y.cpu(), x / s[:, None], name="x / s")
