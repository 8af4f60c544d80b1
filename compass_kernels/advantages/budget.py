"""Adaptive rollout budgets: each prompt's sample count from its history (ck.advantages).

A group of n samples whose rewards all agree carries no GRPO gradient. With
prompt i's pass rate p ~ Beta(prior + successes, prior + failures), n samples
give a group that is *informative* (at least one success and one failure) with
probability g_i(n) = 1 - E[p^n] - E[(1-p)^n]. :func:`allocate_rollouts` picks
n_i in {0} U [min_n, max_n] maximising sum_i g_i(n_i) under a sample or token
budget; :class:`RolloutAllocator` keeps the history, decides success for graded
rewards, and re-explores prompts skipped for too long. docs/design.md, "Rollout
budgets", has the algorithm and its guarantee; ``reference.allocate_rollouts_reference`` is
the spec, the C++ entry point (csrc/advantages/budget_cpu.cpp) the fast path.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from compass_kernels._ext import load
from compass_kernels._validate import (
    FLOAT_DTYPES,
    INT_DTYPES,
    OptionTypeError,
    _scalar,
    as_float_tuple,
    as_int,
    check_tensor,
)

__all__ = [
    "AllocationStats",
    "RolloutAllocator",
    "allocate_rollouts",
    "informative_probability",
    "token_costs",
]

_COUNT_DTYPES = tuple(INT_DTYPES) + tuple(FLOAT_DTYPES)


@dataclass(frozen=True)
class AllocationStats:
    """What :func:`allocate_rollouts` achieved (``return_stats=True``).

    expected : expected informative groups, sum_i g_i(n_i).
    upper_bound : an upper bound on the optimum (the LP relaxation); the
        allocation is within ``upper_bound - expected`` of the best possible.
    spent : budget used (samples, or cost units), <= budget.
    skipped : prompts given 0 samples.
    """

    expected: float
    upper_bound: float
    spent: int
    skipped: int


#: the allocator's int64 headroom: sum_i max_n * cost_i must stay below it
_SPEND_LIMIT = 2**62


def _as_int(name: str, value: object, lo: int) -> int:
    return as_int(name, value, lo=lo)


def _budget(budget: object) -> int:
    if type(budget) is int and budget >= 0:
        return budget
    if type(budget) is not float:
        s = _scalar("budget", budget, "a number")
        if isinstance(s, bool) or not isinstance(s, int | float):
            raise OptionTypeError(f"budget: expected a number, got {type(budget).__name__}")
        budget = s
    if not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"budget: expected a finite value >= 0, got {budget}")
    return int(math.floor(budget))  # exact for any finite float (Python ints)


def _clamp_budget(b: int, c: torch.Tensor, max_n: int) -> int:
    """The budget the C++ allocator gets: ``min(budget, sum_i max_n * cost_i)`` (a
    budget past what every prompt at max_n costs buys nothing more: the same
    allocation), in Python ints; raises naming ``cost`` when that total itself
    passes 2^62 (the allocator's int64 arithmetic)."""
    P = c.numel()
    if P == 0:
        return min(b, 0)
    cmax = int(c.max())
    if cmax * max_n * P < _SPEND_LIMIT:  # the common case: no exact sum needed
        full = int(c.sum()) * max_n
    else:
        full = sum(c.tolist()) * max_n
        if full >= _SPEND_LIMIT:
            raise ValueError(
                f"cost: sum(cost) x max_n = {full} passes 2^62, the allocator's int64 range "
                f"(largest cost {cmax} at prompt {int(c.argmax())}); use coarser cost units"
            )
    return min(b, full)


def _costs(cost: torch.Tensor | None, P: int) -> torch.Tensor:
    if cost is None:
        return torch.ones(P, dtype=torch.int64)
    check_tensor(
        "cost",
        cost,
        ndim=1,
        dtypes=_COUNT_DTYPES,
        size=P,
        size_what="one per prompt",
        device=torch.device("cpu"),
    )
    if cost.dtype.is_floating_point:
        bad = ~torch.isfinite(cost)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"cost: expected finite values, got {float(cost[i])} at prompt {i}")
        if P and bool((cost < 1).any()):
            i = int((cost < 1).nonzero()[0])
            raise ValueError(
                f"cost: expected >= 1 per sample (whole units, e.g. tokens), got "
                f"{float(cost[i])} at prompt {i}"
            )
        if P and float(cost.max()) >= _SPEND_LIMIT:
            i = int(cost.argmax())
            raise ValueError(f"cost: {float(cost[i])} at prompt {i} passes 2^62 (int64 cost units)")
        return torch.ceil(cost).to(torch.int64)
    return cost.to(torch.int64).contiguous()


def allocate_rollouts(
    successes: torch.Tensor,
    attempts: torch.Tensor,
    budget: int | float,
    *,
    min_n: int = 2,
    max_n: int = 64,
    cost: torch.Tensor | None = None,
    prior: Sequence[float] = (1.0, 1.0),
    allow_skip: bool = True,
    required: torch.Tensor | None = None,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, AllocationStats]:
    """Samples per prompt maximising the expected number of informative groups.

    Parameters
    ----------
    successes, attempts : [P] integer or float (CPU) per-prompt history: the
        successes among ``attempts`` past samples (floats allow decayed counts);
        0 <= successes <= attempts.
    budget : total samples (``cost`` None) or total cost units (e.g. tokens),
        >= 0, any finite size (Python int / float, NumPy or 0-d tensor); a float is
        rounded down. A budget above sum_i max_n * cost_i (all prompts at max_n)
        is clamped to it: the allocation is the same, ``spent`` <= that total.
    min_n, max_n : a sampled prompt gets n in [min_n, max_n]; min_n >= 2 (a
        group of one is never informative).
    cost : [P] cost per sample of each prompt (e.g. predicted response tokens,
        :func:`token_costs`), >= 1; floats are rounded up to whole units. None: 1.
    prior : (alpha, beta) of the Beta prior on every pass rate, > 0.
    allow_skip : False: every prompt gets at least min_n (budget permitting,
        else ValueError).
    required : [P] bool, prompts that get at least min_n even when skipping is
        allowed (exploration; :class:`RolloutAllocator` sets it).
    return_stats : also return :class:`AllocationStats`.

    NaN / Inf policy: successes, attempts, cost, budget and prior must be
    finite; always checked (a CPU op: no sync to avoid), ValueError naming the
    argument and the first bad prompt.

    Returns
    -------
    n : [P] int64, each in {0} U [min_n, max_n], sum(n * cost) <= budget.

    The objective sum_i 1 - E[p_i^n_i] - E[(1-p_i)^n_i], p_i ~ Beta(alpha +
    successes_i, beta + attempts_i - successes_i), is a knapsack with one
    non-concave step per prompt (0 -> min_n); the greedy with an exchange
    repair solves it within ``upper_bound - expected`` (< one group), exactly
    for unit costs without skipping (docs/design.md, "Rollout budgets").
    """
    check_tensor("successes", successes, ndim=1, dtypes=_COUNT_DTYPES, device=torch.device("cpu"))
    P = successes.shape[0]
    check_tensor(
        "attempts",
        attempts,
        ndim=1,
        dtypes=_COUNT_DTYPES,
        size=P,
        size_what="one per prompt",
        device=torch.device("cpu"),
    )
    min_n = _as_int("min_n", min_n, 2)
    max_n = _as_int("max_n", max_n, min_n)
    b = _budget(budget)
    pa, pb = as_float_tuple("prior", prior, length=2)
    if not (pa > 0 and pb > 0):
        raise ValueError(f"prior: expected two finite values > 0, got {prior!r}")
    c = _costs(cost, P)
    b = _clamp_budget(b, c, max_n)
    if required is None:
        req = torch.full((P,), not allow_skip, dtype=torch.bool)
    else:
        check_tensor(
            "required",
            required,
            ndim=1,
            dtypes=(torch.bool,),
            size=P,
            size_what="one per prompt",
            device=torch.device("cpu"),
        )
        req = required.contiguous() if allow_skip else torch.ones(P, dtype=torch.bool)
    out = torch.empty(P, dtype=torch.int64)
    value, upper, spent = load().advantages.allocate_rollouts_cpu(
        successes.to(torch.float64).contiguous(),
        attempts.to(torch.float64).contiguous(),
        c,
        req,
        b,
        min_n,
        max_n,
        pa,
        pb,
        out,
    )
    if not return_stats:
        return out
    return out, AllocationStats(value, upper, spent, int((out == 0).sum()))


def informative_probability(
    successes: torch.Tensor,
    attempts: torch.Tensor,
    n: torch.Tensor,
    *,
    prior: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """[P] float64: g_i(n_i) = 1 - E[p^n_i] - E[(1-p)^n_i], p ~ Beta(alpha + s_i, beta + f_i),
    the probability that n_i samples of prompt i give an informative group (0 for n_i <= 1).

    Vectorised in torch (a [P, max n] table); for reporting, not the allocator's hot path.
    """
    from compass_kernels.advantages.reference import rollout_gain_table

    n = torch.as_tensor(n, dtype=torch.int64)
    if n.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    s = successes.to(torch.float64)
    g = rollout_gain_table(
        prior[0] + s, prior[1] + attempts.to(torch.float64) - s, max(int(n.max()), 1)
    )
    return g.gather(1, n.clamp(min=0)[:, None])[:, 0]


def token_costs(predictor, prompt_keys: Sequence[Hashable]) -> torch.Tensor:
    """[P] int64: predicted response tokens per sample of each prompt, rounded up, from a
    ``ck.packing.schedule.LengthPredictor`` (history, else its running fallback): the
    ``cost`` of a token budget. The allocation then feeds the same predictor's
    submission order (``ck.packing.schedule.submission_plan`` over the repeated keys)."""
    pred = torch.from_numpy(predictor.predict_many(list(prompt_keys)))
    # geometric means of whole lengths land a few ulps off them: 30 stays 30
    return (pred - 1e-6).ceil().clamp(min=1).to(torch.int64)


class RolloutAllocator:
    """Per-prompt history and the allocation policy of a training run (stateful helper).

    Parameters
    ----------
    min_n, max_n, prior : as :func:`allocate_rollouts`.
    explore_after : a prompt given 0 samples at this many consecutive
        allocations gets min_n at the next one (skipping-free exploration: its
        history can go stale as the policy learns). Forced prompts are served
        longest-skipped first, as far as the budget allows. None: never.
    decay : on each observation of a prompt its past counts are multiplied by
        this (1: plain counts; < 1 forgets old outcomes as the policy moves).
    success_threshold : a sample is a success when its verifiable score is >=
        this (binary correctness: 0.5; graded verifiable scores in [0, 1], e.g.
        the fraction of unit tests passed: the pass mark). Shaping terms
        (length / repetition penalties, reward-model grades) are not part of
        the verifiable score.

    Prompts are any hashable keys. ``allocate(keys, budget)`` returns n per key;
    ``observe(keys, scores)`` records one score per sample.
    """

    def __init__(
        self,
        *,
        min_n: int = 2,
        max_n: int = 64,
        prior: tuple[float, float] = (1.0, 1.0),
        explore_after: int | None = 4,
        decay: float = 1.0,
        success_threshold: float = 0.5,
    ) -> None:
        _as_int("min_n", min_n, 2)
        _as_int("max_n", max_n, min_n)
        if explore_after is not None:
            _as_int("explore_after", explore_after, 1)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay: expected in (0, 1], got {decay}")
        if not math.isfinite(success_threshold):
            raise ValueError(f"success_threshold: expected a finite value, got {success_threshold}")
        self.min_n, self.max_n, self.prior = min_n, max_n, tuple(prior)
        self.explore_after, self.decay, self.success_threshold = (
            explore_after,
            decay,
            success_threshold,
        )
        self._hist: dict[Hashable, list[float]] = {}  # key -> [successes, attempts]
        self._skipped: dict[Hashable, int] = {}  # consecutive allocations at 0
        self.last: AllocationStats | None = None

    def history(self, keys: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """(successes, attempts) [P] float64 of ``keys`` (0, 0 for unseen keys)."""
        h = [self._hist.get(k, (0.0, 0.0)) for k in keys]
        t = torch.tensor(h, dtype=torch.float64).reshape(len(keys), 2)
        return t[:, 0].contiguous(), t[:, 1].contiguous()

    def allocate(
        self, keys: Sequence[Hashable], budget: int | float, *, cost: torch.Tensor | None = None
    ) -> torch.Tensor:
        """n [P] int64 for ``keys`` under ``budget`` (see :func:`allocate_rollouts`);
        ``self.last`` holds its :class:`AllocationStats`."""
        keys = list(keys)
        s, a = self.history(keys)
        c = _costs(cost, len(keys))
        required = torch.zeros(len(keys), dtype=torch.bool)
        if self.explore_after is not None:
            streak = [self._skipped.get(k, 0) for k in keys]
            due = sorted(
                (i for i, v in enumerate(streak) if v >= self.explore_after),
                key=lambda i: (-streak[i], i),
            )
            left = _budget(budget)
            for i in due:  # longest-skipped first, as far as the budget allows
                need = self.min_n * int(c[i])
                if need <= left:
                    required[i] = True
                    left -= need
        n, self.last = allocate_rollouts(
            s,
            a,
            budget,
            min_n=self.min_n,
            max_n=self.max_n,
            cost=c,
            prior=self.prior,
            required=required,
            return_stats=True,
        )
        for k, v in zip(keys, n.tolist(), strict=True):
            self._skipped[k] = self._skipped.get(k, 0) + 1 if v == 0 else 0
        return n

    def observe(self, keys: Sequence[Hashable], scores) -> None:
        """Record one verifiable score per sample (``keys[j]`` is sample j's prompt):
        a success when score >= success_threshold (bools: True)."""
        keys = list(keys)
        sc = torch.as_tensor(scores)
        if sc.ndim != 1 or sc.shape[0] != len(keys):
            raise ValueError(
                f"scores: expected one per key ({len(keys)}), got shape {tuple(sc.shape)}"
            )
        if sc.dtype.is_floating_point and not bool(torch.isfinite(sc).all()):
            raise ValueError("scores: expected finite values")
        ok = sc if sc.dtype == torch.bool else sc.to(torch.float64) >= self.success_threshold
        per: dict[Hashable, list[int]] = {}
        for k, v in zip(keys, ok.tolist(), strict=True):
            acc = per.setdefault(k, [0, 0])
            acc[0] += int(v)
            acc[1] += 1
        for k, (succ, att) in per.items():
            old = self._hist.get(k, (0.0, 0.0))
            self._hist[k] = [old[0] * self.decay + succ, old[1] * self.decay + att]
