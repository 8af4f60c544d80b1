"""ck.packing.plan plans whenever a plan exists: against an exhaustive-search
oracle on small random inputs, every refusal is proven infeasible and every
plan honours every constraint (the token cap, groups on one rank, equal
micro-batch counts per rank, micro_batch_multiple, equal_samples).

The oracle (plain Python, written from the contract, not from the planner):
a plan exists iff some partition of the items (groups, or sequences) into
dp_size ranks has an M, a multiple of micro_batch_multiple, with every rank
packable into at most M bins of max_tokens (then, holding at least M
sequences, into exactly M non-empty ones: split bins) and holding at least M
sequences; with equal_samples, item counts per rank differ by at most one.
Ranks are interchangeable, so partitions are enumerated as set partitions
into exactly dp_size blocks; a rank's fewest bins is the exact bitmask
dynamic program of bin packing.
"""

from __future__ import annotations

import numpy as np
import pytest

import compass_kernels as ck
from compass_kernels.packing import reference as ref


def _fewest_bins(tokens: list[int], cap: int) -> list[int]:
    """For every subset (bitmask) of the sequences, the fewest bins of cap
    that hold it: dp[mask] = the least (bins, fill of the last bin) over the
    last sequence added, exact for bin packing."""
    n = len(tokens)
    dp = [(0, cap)] + [None] * ((1 << n) - 1)
    for mask in range(1, 1 << n):
        best = None
        for i in range(n):
            if mask >> i & 1:
                bins, fill = dp[mask ^ (1 << i)]
                cand = (
                    (bins, fill + tokens[i]) if fill + tokens[i] <= cap else (bins + 1, tokens[i])
                )
                best = cand if best is None or cand < best else best
        dp[mask] = best
    return [d[0] for d in dp]


def _set_partitions(g: int, k: int):
    """Assignments of items 0..g-1 to k interchangeable non-empty blocks."""
    block = [0] * g

    def rec(i: int, used: int):
        if g - i < k - used:
            return
        if i == g:
            yield list(block)
            return
        for b in range(min(used + 1, k)):
            block[i] = b
            yield from rec(i + 1, max(used, b + 1))

    yield from rec(0, 0)


def feasible(
    lengths, *, dp_size, max_tokens, group_ids=None, micro_batch_multiple=1, equal_samples=False
) -> bool:
    """Whether any plan exists (exhaustive; n up to ~10)."""
    tokens = [int(x) for x in lengths]
    n = len(tokens)
    if group_ids is None:
        items = [[i] for i in range(n)]
    else:
        by_id: dict[int, list[int]] = {}
        for i, g in enumerate(group_ids):
            by_id.setdefault(int(g), []).append(i)
        items = list(by_id.values())
    bins = _fewest_bins(tokens, max_tokens)
    for block in _set_partitions(len(items), dp_size):
        masks, counts = [0] * dp_size, [0] * dp_size
        for item, b in zip(items, block, strict=True):
            counts[b] += 1
            for i in item:
                masks[b] |= 1 << i
        if equal_samples and max(counts) - min(counts) > 1:
            continue
        lo = max(bins[m] for m in masks)
        hi = min(bin(m).count("1") for m in masks)
        m = -(-lo // micro_batch_multiple) * micro_batch_multiple
        if m <= hi:
            return True
    return False


def small_case(seed: int, micro_batch_multiple: int, equal: float = 0.3) -> tuple[np.ndarray, dict]:
    """Small random inputs where the balanced ranks often leave some rank
    short of sequences: a few long sequences (over half the cap) among short
    ones, 1-4 ranks, groups, equal samples (with probability ``equal``)."""
    g = np.random.default_rng(seed)
    dp = int(g.integers(1, 5))
    n = int(g.integers(dp, 10))
    cap = 100
    long = g.random(n) < g.uniform(0.0, 0.7)
    lengths = np.where(long, g.integers(51, cap + 1, n), g.integers(1, 51, n)).astype(np.int64)
    kw = dict(dp_size=dp, max_tokens=cap, micro_batch_multiple=micro_batch_multiple)
    if g.random() < 0.3:
        kw["group_ids"] = g.integers(0, max(dp, n // 2) + 1, n)
        if len(set(kw["group_ids"].tolist())) < dp:
            kw["group_ids"] = np.arange(n) % dp
    kw["equal_samples"] = bool(g.random() < equal) and "group_ids" not in kw
    return lengths, kw


def _outcome(lengths, kw):
    """The planner's plan, or its refusal message (ValueError)."""
    try:
        return ck.packing.plan(lengths, **kw), None
    except ValueError as e:
        return None, str(e)


def sweep(seeds, micro_batch_multiple: int, equal: float = 0.3) -> dict:
    """Counts over small_case(seed): planned, refused, refused with a plan
    existing (must be 0); every plan checked against the contract."""
    out = {"planned": 0, "refused": 0, "refused_feasible": []}
    for seed in seeds:
        lengths, kw = small_case(seed, micro_batch_multiple, equal)
        p, why = _outcome(lengths, kw)
        if p is not None:
            ref.check_plan(p, lengths, **kw)
            out["planned"] += 1
            continue
        out["refused"] += 1
        assert "no plan exists" in why or "need at least dp_size" in why, why
        if feasible(lengths, **kw):
            out["refused_feasible"].append(seed)
    return out


@pytest.mark.parametrize("mbm", [1, 2, 3])
def test_every_refusal_is_infeasible_and_every_plan_valid(mbm):
    """500 small random cases per micro_batch_multiple: plans pass
    check_plan; each refusal says no plan exists, and the oracle agrees."""
    counts = sweep(range(500 * mbm, 500 * mbm + 500), mbm)
    assert counts["refused_feasible"] == [], counts
    assert counts["refused"] > 20 and counts["planned"] > 100, counts  # the sweep tests both


@pytest.mark.parametrize("mbm", [1, 2])
def test_equal_samples_are_planned_by_the_search(mbm):
    """equal_samples fixes every rank's count, so no item moves: each
    balanced-ranks failure that has a plan is rescued by the search alone
    (the planner before the search refused 5 feasible cases here).
    """
    counts = sweep(range(200_000, 200_400), mbm, equal=1.0)
    assert counts["refused_feasible"] == [], counts


@pytest.mark.parametrize("mbm", [1, 2])
def test_planner_agrees_with_the_oracle(mbm):
    """The other direction on the same kind of cases: a plan whenever the
    oracle finds one (so also where the balanced ranks leave some rank short)."""
    for seed in range(100_000 + 300 * mbm, 100_000 + 300 * mbm + 300):
        lengths, kw = small_case(seed, mbm)
        p, why = _outcome(lengths, kw)
        assert (p is not None) == feasible(lengths, **kw), (seed, why)


def test_a_long_sequence_alone_on_its_rank():
    """One long rollout: cost balance puts it alone on its rank while the
    other rank needs two micro-batches; a short sequence moves to it."""
    lengths = [100, 40, 40, 40]  # balanced: {100} and {40, 40, 40} (2 micro-batches)
    p = ck.packing.plan(lengths, dp_size=2, max_tokens=100)
    ref.check_plan(p, lengths, dp_size=2, max_tokens=100)
    assert p.num_micro_batches == 2


def test_micro_batch_multiple_needs_a_rank_with_more_sequences():
    """micro_batch_multiple = 2 (virtual pipeline): every rank needs two
    micro-batches, so two sequences, where balance alone gives one rank a
    single long sequence."""
    lengths = [90, 40, 30, 20]  # balanced: {90} and {40, 30, 20}
    p = ck.packing.plan(lengths, dp_size=2, max_tokens=100, micro_batch_multiple=2)
    ref.check_plan(p, lengths, dp_size=2, max_tokens=100, micro_batch_multiple=2)
    assert p.num_micro_batches == 2


def test_refusals_state_the_reason():
    """A counting bound: 3 sequences over half the cap need 3 micro-batches,
    so 2 per rank over 2 ranks, so 4 sequences; an exhausted search: groups
    that cannot be split evenly."""
    with pytest.raises(
        ValueError, match=r"no plan exists .* need M >= 2 micro-batches per rank.* at most 1"
    ):
        ck.packing.plan([900, 900, 900], dp_size=2, max_tokens=1000)
    with pytest.raises(
        ValueError, match=r"no plan exists .* each group on one rank: an exhaustive"
    ):
        ck.packing.plan([60, 60, 60, 1, 1], dp_size=2, max_tokens=100, group_ids=[0, 0, 0, 1, 1])


if __name__ == "__main__":
    for mbm in (1, 2):
        c = sweep(range(2000), mbm)
        print(
            f"micro_batch_multiple={mbm}: {c['planned']} planned, {c['refused']} refused, "
            f"{len(c['refused_feasible'])} of those feasible"
        )
