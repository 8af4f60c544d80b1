"""An exact quantile of float32 values spread over ranks: a radix select over
histograms that the ranks sum (all-reduce), so no rank gathers the values.

:func:`radix_histogram` counts one rank's values for a round, :func:`select_order_statistics`
runs the rounds over any ``histogram(prefixes, shift, bits)`` (summed over the ranks by
its caller), and :func:`distributed_quantiles` turns order statistics into
``torch.quantile``'s linear rule (as ``espo.loss.entropy_thresholds``): the result is
bitwise that of the gathered computation.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "RADIX_ROUNDS",
    "distributed_quantiles",
    "float_keys",
    "key_to_float",
    "radix_histogram",
    "select_order_statistics",
]

#: Radix-select rounds over the 32 key bits: (shift, bits), most significant first.
RADIX_ROUNDS = ((21, 11), (10, 11), (0, 10))


def float_keys(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 keys in [0, 2**32) of float32 values (total order;
    -0.0 just below +0.0)."""
    b = x.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(b >= 0, b + (1 << 31), -1 - b)


def key_to_float(k: int) -> float:
    """The float32 value of a :func:`float_keys` key."""
    b = k - (1 << 31) if k >= (1 << 31) else -1 - k
    return float(torch.tensor([b], dtype=torch.int32).view(torch.float32)[0])


def radix_histogram(
    values: torch.Tensor, prefixes: torch.Tensor, shift: int, bits: int
) -> torch.Tensor:
    """One radix-select round over ``values`` (float, any shape): for each prefix p,
    counts [2**bits] int64 of the keys k (:func:`float_keys`) with
    k >> (shift + bits) == p, by (k >> shift) & (2**bits - 1)."""
    out = torch.zeros(prefixes.numel(), 1 << bits, dtype=torch.int64)
    if values.numel() == 0:
        return out
    keys = float_keys(values.reshape(-1))
    high = keys >> (shift + bits)
    low = (keys >> shift) & ((1 << bits) - 1)
    for i, p in enumerate(prefixes.tolist()):
        out[i] = torch.bincount(low[high == p], minlength=1 << bits)
    return out


def select_order_statistics(histogram: Any, targets: list[int]) -> list[float]:
    """Exact order statistics (0-based ranks ``targets``) of float32 values spread
    over ranks, by a radix select in len(RADIX_ROUNDS) rounds: ``histogram(prefixes,
    shift, bits)`` returns the [len(prefixes), 2**bits] counts summed over ranks
    (:func:`radix_histogram` of each rank's values, added)."""
    prefix = [0] * len(targets)
    rest = list(targets)
    for shift, bits in RADIX_ROUNDS:
        counts = histogram(torch.tensor(prefix, dtype=torch.int64), shift, bits)
        cum = torch.cumsum(counts, 1)
        for i in range(len(targets)):
            b = int(torch.searchsorted(cum[i], torch.tensor(rest[i]), right=True))
            if b >= cum.shape[1]:
                raise RuntimeError(f"order statistic {targets[i]}: only {int(cum[i, -1])} values")
            rest[i] -= int(cum[i, b - 1]) if b > 0 else 0
            prefix[i] = (prefix[i] << bits) | b
    return [key_to_float(p) for p in prefix]


def distributed_quantiles(histogram: Any, n: int, levels: tuple[float, ...]) -> torch.Tensor:
    """torch.quantile's linear rule (as ``espo.loss.entropy_thresholds``) at
    ``levels`` over n values held by the ranks, from two order statistics per
    level (:func:`select_order_statistics`): [Q] float64, equal to the gathered
    computation."""
    q = torch.tensor(levels, dtype=torch.float64)
    if n == 0:
        return torch.full_like(q, float("nan"))
    pos = q * float(max(n - 1, 0))
    lo = pos.floor()
    w = pos - lo
    i_lo = lo.to(torch.int64).clamp(max=n - 1)
    i_hi = pos.ceil().to(torch.int64).clamp(max=n - 1)
    want = sorted(set(i_lo.tolist()) | set(i_hi.tolist()))
    vals = dict(zip(want, select_order_statistics(histogram, want), strict=True))
    v_lo = torch.tensor([vals[i] for i in i_lo.tolist()], dtype=torch.float64)
    v_hi = torch.tensor([vals[i] for i in i_hi.tolist()], dtype=torch.float64)
    return torch.lerp(v_lo, v_hi, w)
