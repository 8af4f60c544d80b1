"""ck.packing.plan's rank phase (sort, items, LPT over ranks, refinement,
each rank's sequences): two of its paths checked against each other, and the
rank assignment pinned where its speed-ups promised the same plans.

- Singleton groups: group_ids that put every sequence in a group of its own
  (ids increasing with the index) take the group path (groups ordered by id,
  then by decreasing cost; ranks' sequences from a sequence -> rank map),
  which must give exactly the ungrouped plan (ranks' sequences read from
  their member lists), on the bench's lengths and on token ranges up to 2^40
  (the radix sort's extra passes).
- Pins: which rank each sequence lands on, hashed, as the planner gave before
  its rank phase was sped up (best_exchange's early stop, tournament trees,
  fewer swap candidates, LPT and by_rank rewritten): the speed-ups were meant
  to change no plan. A deliberate change of the rank phase updates the pins
  (print them with ``_fingerprint``).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.packing import reference as ref
from compass_kernels.packing.planner import ModelConfig

CFG = ModelConfig(
    hidden_size=4096, ffn_hidden_size=1536, num_layers=48, num_attention_heads=32, moe_top_k=8
)
OPTIONS = {
    "tokens": {},
    "attention": {"cost": "attention", "model_config": CFG},
    "equal": {"equal_samples": True},
}


@pytest.mark.parametrize("dist", ["lognormal", "bimodal"])
@pytest.mark.parametrize(
    "n,dp",
    [(1000, 8), (4099, 64), (8192, 8), (20000, 128), (65536, 256)],
)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_singleton_groups_give_the_ungrouped_plan(dist, n, dp, option):
    """(96+ sequences per rank: the snake sweep; 64+ ranks.)"""
    lengths = ref.DISTRIBUTIONS[dist](n, n + 1)
    kw = dict(dp_size=dp, max_tokens=65536, **OPTIONS[option])
    a = ck.packing.plan(lengths, **kw)
    b = ck.packing.plan(lengths, group_ids=np.arange(n) * 3 + 5, **kw)
    assert a.num_micro_batches == b.num_micro_batches
    assert torch.equal(a.order, b.order) and torch.equal(a.offsets, b.offsets)


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


@pytest.mark.parametrize(
    "n,dp,lo,hi,ties",
    [
        (3001, 16, 1, 1 << 40, 0),  # five 8-bit radix passes
        (777, 8, 1 << 30, (1 << 30) + (1 << 28), 41),  # ties
        (70001, 64, 1, (1 << 16) + 7, 0),  # three passes, 70k sequences
        (5001, 32, 100, 3100, 0),
        (1003, 8, 1, (1 << 21) - 1, 97),
        (57, 4, 1, 10**6, 0),  # a comparison sort (n <= 64)
    ],
)
def test_wide_token_ranges_plan_like_the_group_path(n, dp, lo, hi, ties):
    """The ungrouped plan reads its items from the sort of the tokens;
    singleton groups order the same items by group id, then by group cost.
    Equal plans: the sort gave decreasing tokens, ties by index, on every
    range."""
    lengths = _tokens(n, lo, hi, seed=n, ties=ties)
    kw = dict(dp_size=dp, max_tokens=4 * hi)
    a = ck.packing.plan(lengths, **kw)
    b = ck.packing.plan(lengths, group_ids=np.arange(n) * 2 + 1, **kw)
    assert a.num_micro_batches == b.num_micro_batches
    assert torch.equal(a.order, b.order) and torch.equal(a.offsets, b.offsets)


def _fingerprint(plan, n: int) -> str:
    rank = np.empty(n, dtype=np.int64)
    for r, mbs in enumerate(plan.assignment):
        for mb in mbs:
            rank[mb] = r
    return hashlib.sha256(rank.tobytes()).hexdigest()[:16]


PINS = {
    ("lognormal", 4096, 64, "tokens"): "9d2a0f49e328d09e",
    ("lognormal", 4096, 64, "attention"): "83fbbe16ff86024c",
    ("lognormal", 4096, 64, "equal"): "22f693b57783d5a9",
    ("lognormal", 16384, 128, "tokens"): "8891085322ecf7ad",
    ("lognormal", 16384, 128, "attention"): "a052b99347e0e7ac",
    ("lognormal", 16384, 128, "equal"): "bfe7dbd052dcc21b",
    ("lognormal", 65536, 256, "tokens"): "0857f043d13deb5e",
    ("lognormal", 65536, 256, "attention"): "19f99c338aaf057d",
    ("lognormal", 65536, 256, "equal"): "f7061d8c8b1dd4b7",
    ("bimodal", 4096, 64, "tokens"): "a1d78d9bacbb09d1",
    ("bimodal", 4096, 64, "attention"): "99aeab34fb29d8a7",
    ("bimodal", 4096, 64, "equal"): "7c24ce50844bdbab",
    ("bimodal", 16384, 128, "tokens"): "4237e09e7789dafb",
    ("bimodal", 16384, 128, "attention"): "b28cc444250b80dc",
    ("bimodal", 16384, 128, "equal"): "f0d8ec6aa5a57887",
    ("bimodal", 65536, 256, "tokens"): "50e358e079a0ce21",
    ("bimodal", 65536, 256, "attention"): "c006763de9f88896",
    ("bimodal", 65536, 256, "equal"): "5d253b03ea397641",
}


@pytest.mark.parametrize("key", list(PINS), ids=lambda k: "-".join(map(str, k)))
def test_rank_assignment_pinned(key):
    dist, n, dp, option = key
    lengths = ref.DISTRIBUTIONS[dist](n, n + dp)
    p = ck.packing.plan(lengths, dp_size=dp, max_tokens=65536, **OPTIONS[option])
    assert _fingerprint(p, n) == PINS[key]
