"""ck.packing.plan's micro-batch phase against plain-Python oracles.

The planner packs each rank's sequences into M micro-batches by LPT (run
interleaved over several ranks at once in C++) or by the level fit (first
fit under the balanced level, the leftovers by LPT under the cap), taking
the first that fits with its heaviest micro-batch within 0.5% of the rank's
bound (the level fit first while LPT misses more often than not), and
refines only where neither is within it. On cases where no refinement
runs, the micro-batches must be exactly the oracle's: same members, heaviest
first (ties by first sequence), each by ascending index. Ranks come from the
plan itself (the rank phase is tested elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest

import compass_kernels as ck
from compass_kernels.packing import reference as ref

TOL = 5e-3  # the planner's micro-batch tolerance (kBinTolerance)


def _desc(seqs, lengths):
    """A rank's sequences by decreasing tokens, ties by index."""
    return sorted(seqs, key=lambda s: (-int(lengths[s]), s))


def _place_least_loaded(s, t, load, bins, cap):
    """One LPT step: s (t tokens) onto the least-loaded bin (ties to the lower
    bin) with room under cap; False if it fits nowhere."""
    ok = [q for q in range(len(load)) if load[q] + t <= cap]
    if not ok:
        return False
    q = min(ok, key=lambda q: (load[q], q))
    load[q] += t
    bins[q].append(s)
    return True


def _lpt(seqs, lengths, nb, cap):
    """LPT onto the least-loaded bin (ties to the lower bin) with room; None
    if a sequence fits nowhere."""
    load = [0] * nb
    bins = [[] for _ in range(nb)]
    for s in _desc(seqs, lengths):
        if not _place_least_loaded(s, int(lengths[s]), load, bins, cap):
            return None
    return bins


def _level_fit(seqs, lengths, nb, cap):
    """First fit under the level ceil(tokens / nb) + 0.5%, then the sequences
    that fit under no level by LPT under the cap; None if one fits nowhere
    or a bin stays empty."""
    total = sum(int(lengths[s]) for s in seqs)
    level = -(-total // nb)
    level = min(cap, level + int(level * TOL))
    under = [level] * nb
    load = [0] * nb
    bins = [[] for _ in range(nb)]
    left = []
    for s in _desc(seqs, lengths):
        t = int(lengths[s])
        q = next((q for q in range(nb) if under[q] >= t), None)
        if q is None:
            left.append(s)
            continue
        under[q] -= t
        load[q] += t
        bins[q].append(s)
    for s in left:
        if not _place_least_loaded(s, int(lengths[s]), load, bins, cap):
            return None
    return None if any(not b for b in bins) else bins


def _ordered(bins, lengths):
    """Micro-batches as the plan writes them: heaviest first, ties by first
    sequence, each ascending."""
    out = [sorted(b) for b in bins]
    return sorted(out, key=lambda b: (-sum(int(lengths[s]) for s in b), b[0]))


def _within_tolerance(bins, lengths):
    loads = [sum(int(lengths[s]) for s in b) for b in bins]
    lb = max(-(-sum(loads) // len(bins)), max(int(lengths[s]) for b in bins for s in b))
    return max(loads) <= lb + int(lb * TOL)


LANES, PROBE = 4, 16  # the planner's kLanes and kLptProbe


def _choices(ranks, lengths, nb, cap):
    """The planner's choice per rank (ranks: each rank's sequences), or None
    where it refines (neither packing within the tolerance). Ranks go in
    groups of LANES; a group tries the level fit first while LPT has failed
    or missed the tolerance on more ranks than it met it on, unless a rank
    of the group is a probe (index % PROBE == 0); the first choice is taken
    if it fits within the tolerance, else the second if it does. Also
    returns how each rank was packed: "lpt", "level first", "level" (LPT
    tried first found no room) or "level, lpt over" (LPT tried first fit
    over the tolerance)."""
    met = missed = 0
    out, how = [], []
    for g0 in range(0, len(ranks), LANES):
        group = range(g0, min(g0 + LANES, len(ranks)))
        level_first = missed > met and not any(r % PROBE == 0 for r in group)
        for r in group:
            lpt, level = (
                _lpt(ranks[r], lengths, nb, cap),
                _level_fit(ranks[r], lengths, nb, cap),
            )
            ok = {
                k: b is not None and _within_tolerance(b, lengths)
                for k, b in (("lpt", lpt), ("level", level))
            }
            if level_first and ok["level"]:
                out.append(level), how.append("level first")
                continue
            met += ok["lpt"]
            missed += not ok["lpt"]
            if ok["lpt"]:
                out.append(lpt), how.append("lpt")
            elif ok["level"]:
                out.append(level), how.append("level" if lpt is None else "level, lpt over")
            else:
                out.append(None), how.append(None)
    return out, how


@pytest.mark.parametrize("dp", [1, 3, 4, 5, 9])
def test_micro_batches_are_lpt(dp):
    """Many short sequences per micro-batch: LPT fits every rank within the
    tolerance, so each rank's micro-batches are exactly LPT's. dp = 1, 3, 5, 9
    leave lanes of the last interleaved group empty; ranks hold different
    counts (the lanes' ragged ends)."""
    g = np.random.default_rng(50 + dp)
    n = dp * int(g.integers(300, 420))
    lengths = g.integers(1, 120, n).astype(np.int64)
    cap = int(g.choice([3000, 4000, 6000]))
    p = ck.packing.plan(lengths, dp_size=dp, max_tokens=cap)
    ref.check_plan(p, lengths, dp_size=dp, max_tokens=cap)
    nb = p.num_micro_batches
    assert nb >= 4
    for r, mbs in enumerate(p.assignment):
        seqs = [s for mb in mbs for s in mb]
        want = _lpt(seqs, lengths, nb, cap)
        assert want is not None and _within_tolerance(want, lengths), "case must not refine"
        assert mbs == _ordered(want, lengths), f"rank {r}"


@pytest.mark.parametrize(
    ("n", "dp", "seed"),
    [(4096, 16, 1), (3000, 11, 3), (6000, 23, 5), (3000, 8, 7), (2900, 7, 12), (900, 12, 21)],
)
def test_tight_micro_batches_are_the_level_fit(n, dp, seed):
    """Bimodal lengths (75-420 per rank) filling ~97% of M micro-batches of
    65536: LPT finds no room for a late long sequence on any rank, and each
    rank's micro-batches are exactly the level fit's (run interleaved over
    ranks in C++: up to 32 micro-batches by whole-row compares, rows of 8, 16
    and 32; 36 and 40 (dp = 8, 7) by trees; dp = 7, 11 and 23 leave lanes of
    the last group empty)."""
    lengths = ref.bimodal_lengths(n, seed)
    cap = 65536
    p = ck.packing.plan(lengths, dp_size=dp, max_tokens=cap)
    ref.check_plan(p, lengths, dp_size=dp, max_tokens=cap)
    nb = p.num_micro_batches
    for r, mbs in enumerate(p.assignment):
        seqs = [s for mb in mbs for s in mb]
        assert _lpt(seqs, lengths, nb, cap) is None, "case must make LPT fail"
        want = _level_fit(seqs, lengths, nb, cap)
        assert want is not None and _within_tolerance(want, lengths), "case must not refine"
        assert mbs == _ordered(want, lengths), f"rank {r}"


@pytest.mark.parametrize(
    ("n", "dp", "seed"),
    [(1536, 12, 4), (2560, 20, 5), (1700, 13, 11), (600, 16, 617), (256, 8, 264)],
)
def test_micro_batches_take_the_first_packing_within_tolerance(n, dp, seed):
    """Bimodal lengths, ~130 per rank: on some ranks LPT fits but leaves its
    heaviest micro-batch over the tolerance (too few short sequences to level
    the long ones) while the level fit is within it; the planner then takes
    the level fit, and after enough such ranks tries the level fit first.
    Every rank not left to refinement is exactly the oracle's choice."""
    lengths = ref.bimodal_lengths(n, seed)
    cap = 65536
    p = ck.packing.plan(lengths, dp_size=dp, max_tokens=cap)
    ref.check_plan(p, lengths, dp_size=dp, max_tokens=cap)
    ranks = [[s for mb in mbs for s in mb] for mbs in p.assignment]
    want, how = _choices(ranks, lengths, p.num_micro_batches, cap)
    assert "level, lpt over" in how, "case must have LPT fit over the tolerance"
    assert how.count(None) <= dp // 4, "case must leave most ranks unrefined"
    nb = p.num_micro_batches
    for r, mbs in enumerate(p.assignment):
        if want[r] is not None:
            assert mbs == _ordered(want[r], lengths), f"rank {r} ({how[r]})"
            continue
        # refined: from the better of the packings that fit, never worse
        tops = [
            max(sum(int(lengths[s]) for s in b) for b in bins)
            for bins in (_lpt(ranks[r], lengths, nb, cap), _level_fit(ranks[r], lengths, nb, cap))
            if bins is not None
        ]
        assert max(sum(int(lengths[s]) for s in mb) for mb in mbs) <= min(tops), f"rank {r}"
