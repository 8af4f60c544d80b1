"""The planner's first step: sequences by decreasing tokens, ties by index (the
order every later phase relies on). Each of its paths is forced by the size
and the token range that select it, and checked against NumPy's stable
argsort; the 64-bit key paths are also checked through plan() (ungrouped plan
== the singleton-group plan, whose items are ordered by an independent sort).

Paths (sort_tokens_desc in csrc/packing/plan_cpu.cpp): keys (top - tokens)
<< ib | index, ib = bits of n - 1, kb = bits of the token range; 32-bit keys
where kb + ib <= 32, 64-bit where <= 64, else (sequence, tokens) pairs. A
counting sort where the range needs more than one 8-bit digit, is at most 8
per sequence and under 2^17; else an LSD radix sort in 8-bit digits (one or
more passes); n <= 64 or a single value: a comparison sort or none.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels._ext import load

C = load().packing

COMPARE, COUNT, RADIX, PAIRS = 0, 1, 2, 3


def _tokens(n: int, lo: int, hi: int, seed: int, ties: int = 0) -> np.ndarray:
    """n values in [lo, hi] with both ends present; ties > 0: drawn from that
    many distinct values (many equal tokens, so the index tie-break matters)."""
    rng = np.random.default_rng(seed)
    if ties:
        pool = rng.integers(lo, hi + 1, ties, dtype=np.int64)
        t = pool[rng.integers(0, ties, n)]
    else:
        t = rng.integers(lo, hi + 1, n, dtype=np.int64)
    t[rng.integers(0, n)] = lo
    t[rng.integers(0, n)] = hi
    return t


# (n, lo, hi, ties, path, key width)
CASES = {
    "compare-32": (57, 1, 10**6, 0, COMPARE, 32),
    "one-value": (1000, 777, 777, 0, COMPARE, 32),
    "single": (1, 5, 5, 0, COMPARE, 32),
    "radix-32-one-pass": (1001, 100, 300, 0, RADIX, 32),
    "radix-32-two-passes": (4099, 100, 65536, 0, RADIX, 32),
    "radix-32-three-passes-ties": (1003, 0, (1 << 21) - 1, 97, RADIX, 32),
    "count-32": (5001, 100, 3100, 0, COUNT, 32),
    "count-32-ties": (8192, 1, 65536, 301, COUNT, 32),
    "count-64": (70001, 1, (1 << 16) + 7, 0, COUNT, 64),
    "radix-64": (3001, 1, 1 << 40, 0, RADIX, 64),
    "radix-64-ties": (777, 1 << 30, (1 << 30) + (1 << 28), 41, RADIX, 64),
    "pairs": (101, 0, 1 << 62, 0, PAIRS, 0),
    "pairs-ties": (300, 0, (1 << 62) - 1, 13, PAIRS, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sort_paths_match_a_stable_argsort(name):
    n, lo, hi, ties, path, width = CASES[name]
    t = _tokens(n, lo, hi, seed=len(name), ties=ties)
    order = torch.full((n,), -1, dtype=torch.int64)  # poisoned
    got = C.sort_tokens_desc_cpu(torch.from_numpy(t), order)
    assert tuple(got) == (path, width), f"{name}: took path {got}, meant {(path, width)}"
    # decreasing tokens, ties by increasing index; -t cannot overflow (t >= 0)
    np.testing.assert_array_equal(order.numpy(), np.argsort(-t, kind="stable"))


def test_sort_hook_rejects_bad_input():
    with pytest.raises(ValueError, match="tokens: expected values >= 0"):
        C.sort_tokens_desc_cpu(torch.tensor([3, -1]), torch.empty(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="order"):
        C.sort_tokens_desc_cpu(torch.tensor([3, 1]), torch.empty(3, dtype=torch.int64))


@pytest.mark.parametrize(
    "n,dp,lo,hi,ties",
    [
        (3001, 16, 1, 1 << 40, 0),  # 64-bit radix keys
        (777, 8, 1 << 30, (1 << 30) + (1 << 28), 41),  # 64-bit radix keys, ties
        (70001, 64, 1, (1 << 16) + 7, 0),  # 64-bit counting-sort keys
        (5001, 32, 100, 3100, 0),  # 32-bit counting sort
        (1003, 8, 1, (1 << 21) - 1, 97),  # 32-bit radix, three passes
    ],
)
def test_wide_and_narrow_keys_plan_like_the_group_path(n, dp, lo, hi, ties):
    """The ungrouped plan reads its items from sort_tokens_desc; singleton
    groups order the same items by order_desc over the group costs. Equal
    plans: the sort gave the same order on every path."""
    lengths = _tokens(n, lo, hi, seed=n, ties=ties)
    kw = dict(dp_size=dp, max_tokens=4 * hi)
    a = ck.packing.plan(lengths, **kw)
    b = ck.packing.plan(lengths, group_ids=np.arange(n) * 2 + 1, **kw)
    assert a.num_micro_batches == b.num_micro_batches
    assert torch.equal(a.order, b.order) and torch.equal(a.offsets, b.offsets)
