"""Rollout-budget policies behind one interface (ck.advantages.policies).

A step of GRPO-style training rolls out the prompts of a batch; a group (all samples
of one prompt in the step) whose verifiable outcomes all agree carries no gradient.
Each policy here decides, under a budget of samples or of cost units (predicted
tokens), how many samples each prompt gets, in up to a few rounds, seeing this
step's outcomes between rounds. The interface (``BudgetPolicy``):

- ``begin(keys, budget, cost=None, spare=())`` -> {key: samples}: round 1;
- ``more(outcomes, remaining)`` -> {key: extra samples}: a later round given every
  outcome of the step so far ({} ends the step);
- ``observe(outcomes)``: the step's outcomes, history for the next steps.

:func:`run_step` is the driver (checks the budget, runs the rounds, counts the
informative groups); ``bench/bench_budget.py`` simulates every policy at one budget.
The policies (:data:`POLICIES`, built by :func:`make_policy`):

- ``uniform``: N samples per prompt;
- ``dapo``: DAPO's dynamic sampling (arXiv 2503.14476) at a fixed budget;
- ``greso``: GRESO's pre-rollout skip of predicted zero-variance prompts (arXiv 2506.02177);
- ``knapsack``: Knapsack RL's per-prompt budgets (arXiv 2509.25849), one round;
- ``pilot``: pilot-then-commit, the commit as AR3PO's adaptive rollout (arXiv 2509.25808);
- ``ours``: history posterior + pilot + knapsack commit over this step's outcomes.

Host-side planning in plain Python / NumPy (a step has hundreds of prompts); the
knapsack rounds reuse :func:`compass_kernels.advantages.budget.allocate_rollouts`.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from compass_kernels._validate import as_float, as_float_tuple, as_int

__all__ = [
    "POLICIES",
    "BudgetPolicy",
    "Outcomes",
    "StepResult",
    "make_policy",
    "run_step",
    "UniformPolicy",
    "DapoPolicy",
    "GresoPolicy",
    "KnapsackPolicy",
    "PilotPolicy",
    "OursPolicy",
]

#: prompt key -> the verifiable outcome (correct?) of each of its samples this step
Outcomes = dict[int, list[bool]]

POLICIES = ("uniform", "dapo", "greso", "knapsack", "pilot", "ours")


# ----------------------------------------------------------------- checks


def _key(name: str, k: object) -> int:
    if isinstance(k, bool | np.bool_) or not isinstance(k, int | np.integer):
        raise ValueError(f"{name}: expected int prompt keys, got {k!r} ({type(k).__name__})")
    return int(k)


def _keys(name: str, keys: Sequence[int]) -> list[int]:
    if isinstance(keys, str | bytes | Mapping) or not hasattr(keys, "__iter__"):
        raise ValueError(f"{name}: expected a sequence of int keys, got {type(keys).__name__}")
    out = [_key(name, k) for k in keys]
    if len(set(out)) != len(out):
        dup = next(k for k in out if out.count(k) > 1)
        raise ValueError(f"{name}: expected distinct keys, got {dup} twice")
    return out


def _amount(name: str, v: object) -> float:
    x = as_float(name, v)
    if x < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {x}")
    return x


def _fraction(name: str, v: object, *, lo_open: bool = True, hi: float = 1.0) -> float:
    x = as_float(name, v)
    if not ((x > 0 if lo_open else x >= 0) and x <= hi):
        lo = "(0" if lo_open else "[0"
        raise ValueError(f"{name}: expected a number in {lo}, {hi}], got {x}")
    return x


def _prior(v: object) -> tuple[float, float]:
    a, b = as_float_tuple("prior", v, length=2)
    if not (a > 0 and b > 0):
        raise ValueError(f"prior: expected two finite values > 0, got {v!r}")
    return a, b


# ----------------------------------------------------------------- history


class _History:
    """Per-key decayed (successes, attempts) and the zero-variance streak.

    On each observation of a key its past counts are multiplied by ``decay`` (as
    :class:`compass_kernels.advantages.RolloutAllocator`); ``streak`` counts the
    consecutive most recent steps in which the key's group was zero-variance and
    ``last`` is the outcome of the latest such group (True: all correct)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.counts: dict[int, tuple[float, float]] = {}
        self.streak: dict[int, int] = {}
        self.last: dict[int, bool] = {}

    def update(self, outcomes: Outcomes) -> None:
        for k, outs in outcomes.items():
            n, s = len(outs), int(sum(outs))
            if n == 0:
                continue
            old_s, old_a = self.counts.get(k, (0.0, 0.0))
            self.counts[k] = (old_s * self.decay + s, old_a * self.decay + n)
            if s == 0 or s == n:
                self.streak[k] = self.streak.get(k, 0) + 1
                self.last[k] = s == n
            else:
                self.streak[k] = 0

    def arrays(self, keys: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        h = np.array([self.counts.get(k, (0.0, 0.0)) for k in keys], dtype=np.float64)
        h = h.reshape(len(keys), 2)
        return h[:, 0].copy(), h[:, 1].copy()


def _moments(alpha: np.ndarray, beta: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """[P, m + 1] E[p^j] and E[(1-p)^j], j = 0..m, p ~ Beta(alpha, beta)."""
    j = np.arange(m, dtype=np.float64)[None, :]
    a, b = alpha[:, None], beta[:, None]
    up = np.cumprod((a + j) / (a + b + j), axis=1)
    down = np.cumprod((b + j) / (a + b + j), axis=1)
    one = np.ones((alpha.shape[0], 1))
    return np.hstack([one, up]), np.hstack([one, down])


def _fit_order(items: Sequence[tuple[int, int]], cost: Mapping[int, float], budget: float):
    """{key: n} of ``items`` (key, n) taken in order while their cost fits ``budget``."""
    out: dict[int, int] = {}
    left = budget
    for k, n in items:
        c = n * cost[k]
        if n > 0 and c <= left + 1e-9:
            out[k] = out.get(k, 0) + n
            left -= c
    return out


# ----------------------------------------------------------------- interface


class BudgetPolicy(ABC):
    """A rollout-budget policy: round 1 (:meth:`begin`), later rounds (:meth:`more`) that
    see this step's outcomes, and the step's end (:meth:`observe`).

    Parameters
    ----------
    min_n : samples of any prompt sampled in a step: at least this many (>= 2; a
        group of one is never informative).
    seed : seed of the policy's random choices (``greso``; the others are
        deterministic): the same seed and inputs give the same allocations.

    Budgets are in samples when ``cost`` is None, else in cost units: ``cost[i]`` is
    the predicted cost (tokens) of one sample of prompt i, keys first, then spare.
    Every answer is a dict {key: samples > 0} whose sum of samples x cost is at most
    the budget (``begin``) or ``remaining`` (``more``).
    """

    name = "base"

    def __init__(self, *, min_n: int = 2, seed: int = 0) -> None:
        self.min_n = as_int("min_n", min_n, lo=2)
        self.seed = as_int("seed", seed, lo=0)
        tag = POLICIES.index(self.name) if self.name in POLICIES else len(POLICIES)
        self.rng = np.random.default_rng([self.seed, tag])
        self.keys: list[int] = []
        self.spare: list[int] = []
        self.cost: dict[int, float] = {}
        self.budget = 0.0
        self.round = 0

    # the three calls of the interface -----------------------------------
    def begin(
        self,
        keys: Sequence[int],
        budget: float,
        *,
        cost: np.ndarray | Sequence[float] | None = None,
        spare: Sequence[int] = (),
    ) -> dict[int, int]:
        """Round 1 of a step: samples per prompt (keys or spare); absent = not sampled.

        Parameters
        ----------
        keys : this step's prompts (distinct ints).
        budget : samples (``cost`` None) or cost units, finite, >= 0.
        cost : None, or one cost per sample of each prompt, len(keys) + len(spare)
            entries (keys first), finite, > 0.
        spare : extra prompts the policy may draw (distinct, none of ``keys``).
        """
        self.keys = _keys("keys", keys)
        self.spare = _keys("spare", spare)
        both = set(self.keys) & set(self.spare)
        if both:
            raise ValueError(f"spare: expected keys not in keys, got {min(both)} in both")
        self.budget = _amount("budget", budget)
        pool = self.keys + self.spare
        if cost is None:
            c = np.ones(len(pool))
        else:
            c = np.asarray(cost, dtype=np.float64)
            if c.ndim != 1 or c.shape[0] != len(pool):
                raise ValueError(
                    f"cost: expected {len(pool)} entries (len(keys) + len(spare)), got shape "
                    f"{list(c.shape)}"
                )
            if c.size and not (np.isfinite(c).all() and (c > 0).all()):
                i = int(np.flatnonzero(~(np.isfinite(c) & (c > 0)))[0])
                raise ValueError(f"cost: expected finite values > 0, got {c[i]} at {i}")
        self.unit = cost is None
        self.cost = dict(zip(pool, c.tolist(), strict=True))
        self.round = 1
        self.taken: dict[int, int] = {}
        out = self._clean(self._begin())
        self._count(out)
        return out

    def more(self, outcomes: Mapping[int, Sequence[bool]], remaining: float) -> dict[int, int]:
        """Extra samples per prompt after a round, given every outcome of this step so
        far (``outcomes``: key -> one bool per sample) and the budget left; {} ends
        the step."""
        if self.round == 0:
            raise ValueError("more: call begin first")
        outs = self._outcomes(outcomes)
        remaining = _amount("remaining", remaining)
        self.round += 1
        out = self._clean(self._more(outs, remaining))
        self._count(out)
        return out

    def observe(self, outcomes: Mapping[int, Sequence[bool]]) -> None:
        """End of step: all of the step's outcomes (key -> one bool per sample)."""
        self._observe(self._outcomes(outcomes, step=False))
        self.round = 0

    # what a policy implements -------------------------------------------
    @abstractmethod
    def _begin(self) -> dict[int, int]: ...

    def _more(self, outcomes: Outcomes, remaining: float) -> dict[int, int]:
        return {}

    def _observe(self, outcomes: Outcomes) -> None:
        return None

    # helpers --------------------------------------------------------------
    def _outcomes(self, outcomes: Mapping[int, Sequence[bool]], step: bool = True) -> Outcomes:
        if not isinstance(outcomes, Mapping):
            raise ValueError(
                f"outcomes: expected a dict key -> list of bools, got {type(outcomes).__name__}"
            )
        out: Outcomes = {}
        for k, v in outcomes.items():
            k = _key("outcomes", k)
            if step and k not in self.cost:
                raise ValueError(f"outcomes: key {k} is not one of this step's keys or spare")
            if isinstance(v, str | bytes) or not hasattr(v, "__iter__"):
                raise ValueError(f"outcomes: expected a list of bools for key {k}")
            vals = []
            for x in v:
                if not isinstance(x, bool | np.bool_):
                    raise ValueError(f"outcomes: expected bools for key {k}, got {x!r}")
                vals.append(bool(x))
            out[k] = vals
        return out

    def _clean(self, alloc: Mapping[int, int]) -> dict[int, int]:
        # the budget is the driver's check (run_step): a policy's bug is refused there
        return {int(k): int(n) for k, n in alloc.items() if n > 0}

    def _count(self, alloc: Mapping[int, int]) -> None:
        for k, n in alloc.items():
            self.taken[k] = self.taken.get(k, 0) + n

    def _uniform_n(self, keys: Sequence[int], budget: float) -> int:
        """N of a uniform split of ``budget`` over ``keys`` (>= min_n)."""
        total = sum(self.cost[k] for k in keys)
        n = int(math.floor(budget / total + 1e-9)) if total > 0 else 0
        return max(n, self.min_n)


# ----------------------------------------------------------------- uniform


class UniformPolicy(BudgetPolicy):
    """``uniform``: N samples for every prompt of the batch, one round (GRPO's default).

    Parameters
    ----------
    n : samples per prompt; None (default): the budget split evenly, floor(budget /
        sum of the keys' costs) (>= min_n). Keys are served in order while their N
        fit; spare prompts are never drawn.
    min_n, seed : as :class:`BudgetPolicy`.
    """

    name = "uniform"

    def __init__(self, *, n: int | None = None, min_n: int = 2, seed: int = 0) -> None:
        super().__init__(min_n=min_n, seed=seed)
        self.n = None if n is None else as_int("n", n, lo=self.min_n)

    def _begin(self) -> dict[int, int]:
        n = self.n or self._uniform_n(self.keys, self.budget)
        return _fit_order([(k, n) for k in self.keys], self.cost, self.budget)


# ----------------------------------------------------------------- DAPO


class DapoPolicy(BudgetPolicy):
    """``dapo``: DAPO's dynamic sampling (Yu et al., arXiv 2503.14476) at a fixed budget.

    DAPO over-samples: it rolls out N per prompt, drops the groups whose outcomes all
    agree and keeps drawing fresh prompts until the batch holds enough informative
    groups. At a fixed budget, as we read it: round 1 gives N to the first keys,
    within ``first`` of the budget; each later round counts the zero-variance groups
    of the previous round and draws as many fresh prompts (``spare``, then the keys
    not sampled in round 1, in order), N each, while the budget lasts. No zero-variance
    group: no refill (the rest of the budget is not spent).

    Parameters
    ----------
    n : group size N; None: the budget split evenly over the keys (as ``uniform``).
    first : share of the budget for round 1, in (0, 1] (1: DAPO refills nothing).
    min_n, seed : as :class:`BudgetPolicy`.
    """

    name = "dapo"

    def __init__(
        self, *, n: int | None = None, first: float = 0.75, min_n: int = 2, seed: int = 0
    ) -> None:
        super().__init__(min_n=min_n, seed=seed)
        self.n = None if n is None else as_int("n", n, lo=self.min_n)
        self.first = _fraction("first", first)

    def _begin(self) -> dict[int, int]:
        self.group_n = self.n or self._uniform_n(self.keys, self.budget)
        out = _fit_order(
            [(k, self.group_n) for k in self.keys], self.cost, self.budget * self.first
        )
        self.last_round = set(out)
        self.fresh = [k for k in self.spare + self.keys if k not in out]
        return out

    def _more(self, outcomes: Outcomes, remaining: float) -> dict[int, int]:
        drop = sum(
            1 for k in self.last_round if len(outcomes.get(k, ())) and len(set(outcomes[k])) == 1
        )
        out: dict[int, int] = {}
        left = remaining
        while drop > 0 and self.fresh:
            k = self.fresh[0]
            c = self.group_n * self.cost[k]
            if c > left + 1e-9:
                break
            self.fresh.pop(0)
            out[k] = self.group_n
            left -= c
            drop -= 1
        self.last_round = set(out)
        return out


# ----------------------------------------------------------------- GRESO


class GresoPolicy(BudgetPolicy):
    """``greso``: GRESO's pre-rollout filter (Zheng et al., arXiv 2506.02177).

    A prompt whose group was zero-variance in each of its last z observed steps is
    skipped before rollout with probability 1 - p_e^z, where the exploration
    probability p_e is kept separately for easy (last zero-variance group all
    correct) and hard (all wrong) prompts. After each step p_e moves by ``delta``:
    down when that kind's share of the step's groups is above ``target`` / 2, up
    otherwise, within [``p_min``, 1] (as we read the paper's adaptive exploration).
    The budget of skipped keys goes to the spare prompts (filtered the same way, in
    order): GRESO's larger rollout batch. One round, N per sampled prompt.

    Parameters
    ----------
    n : group size N; None: the budget split evenly over the keys (as ``uniform``).
    p_explore : initial p_e of both kinds, in (0, 1].
    target : target share of zero-variance groups in a step, in [0, 1].
    delta : step of the p_e adaptation, in [0, 1].
    p_min : lowest p_e, in (0, 1].
    min_n, seed : as :class:`BudgetPolicy`.
    """

    name = "greso"

    def __init__(
        self,
        *,
        n: int | None = None,
        p_explore: float = 0.5,
        target: float = 0.25,
        delta: float = 0.01,
        p_min: float = 0.05,
        min_n: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__(min_n=min_n, seed=seed)
        self.n = None if n is None else as_int("n", n, lo=self.min_n)
        p0 = _fraction("p_explore", p_explore)
        self.target = _fraction("target", target, lo_open=False)
        self.delta = _fraction("delta", delta, lo_open=False)
        self.p_min = _fraction("p_min", p_min)
        self.p_e = {True: max(p0, self.p_min), False: max(p0, self.p_min)}
        self.hist = _History(1.0)

    def skip_probability(self, key: int) -> float:
        """1 - p_e^z for a key whose last z observed groups were zero-variance."""
        z = self.hist.streak.get(key, 0)
        if z == 0:
            return 0.0
        return 1.0 - self.p_e[self.hist.last[key]] ** z

    def _begin(self) -> dict[int, int]:
        n = self.n or self._uniform_n(self.keys, self.budget)
        pool = self.keys + self.spare
        u = self.rng.random(len(pool))
        kept = [k for k, x in zip(pool, u.tolist(), strict=True) if x >= self.skip_probability(k)]
        return _fit_order([(k, n) for k in kept], self.cost, self.budget)

    def _observe(self, outcomes: Outcomes) -> None:
        groups = [v for v in outcomes.values() if v]
        if groups:
            for easy in (True, False):
                kind = sum(1 for v in groups if all(v) == easy and len(set(v)) == 1)
                share = kind / len(groups)
                step = -self.delta if share > self.target / 2 else self.delta
                self.p_e[easy] = min(1.0, max(self.p_min, self.p_e[easy] + step))
        self.hist.update(outcomes)


# ----------------------------------------------------------------- knapsack


class KnapsackPolicy(BudgetPolicy):
    """``knapsack``: Knapsack RL's per-prompt budgets (Li et al., arXiv 2509.25849).

    Each prompt's samples are a knapsack item: value = the probability that its group
    is informative, 1 - E[p^n] - E[(1-p)^n] with p ~ Beta(prior + decayed history),
    cost = n x the cost of one sample; the greedy by value per cost (with the exchange
    repair and the certified bound of
    :func:`compass_kernels.advantages.allocate_rollouts`) picks n in {0} U [min_n,
    max_n] per key. One round, keys only (the paper's value also weighs the gradient's
    size; as we read it for this metric, the informative probability alone).

    Parameters
    ----------
    max_n : most samples of one prompt, >= min_n.
    prior : (alpha, beta) of the Beta prior, > 0.
    decay : history decay per observation of a prompt, in (0, 1].
    min_n, seed : as :class:`BudgetPolicy`.
    """

    name = "knapsack"

    def __init__(
        self,
        *,
        max_n: int = 32,
        prior: Sequence[float] = (1.0, 1.0),
        decay: float = 0.7,
        min_n: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__(min_n=min_n, seed=seed)
        self.max_n = as_int("max_n", max_n, lo=self.min_n)
        self.prior = _prior(prior)
        self.hist = _History(_fraction("decay", decay))

    def _begin(self) -> dict[int, int]:
        import torch

        from compass_kernels.advantages.budget import allocate_rollouts

        if not self.keys:
            return {}
        s, a = self.hist.arrays(self.keys)
        c = np.array([self.cost[k] for k in self.keys])
        n = allocate_rollouts(  # return_stats False: a tensor
            torch.from_numpy(s),
            torch.from_numpy(a),
            # integer cost units, rounded up: the allocation never overspends
            self.budget if self.unit else math.floor(self.budget),
            min_n=self.min_n,
            max_n=self.max_n,
            cost=None if self.unit else torch.from_numpy(np.ceil(c - 1e-9).clip(min=1)),
            prior=self.prior,
        )
        assert isinstance(n, torch.Tensor)
        return dict(zip(self.keys, n.tolist(), strict=True))

    def _observe(self, outcomes: Outcomes) -> None:
        self.hist.update(outcomes)


# ----------------------------------------------------------------- pilot


class PilotPolicy(BudgetPolicy):
    """``pilot``: Pilot-Commit (Kim et al., arXiv 2605.26606), AR3PO's adaptive rollout
    (Zhang et al., arXiv 2509.25808) as an option.

    Round 1 (the pilot) gives ``pilot`` samples to every key (in order, while they fit).
    Later rounds commit the budget left (an equal share per round still to come) to the
    prompts the pilot flags, never past ``max_n`` samples of one prompt:

    - ``commit="variance"`` (Pilot-Commit): the prompts whose outcomes so far have
      a non-zero empirical variance, in proportion to it (p_hat (1 - p_hat)); prompts
      whose pilot outcomes all agree (near-solved or too hard) are evicted. As we read
      the paper: one pilot size for every key, the share per prompt by its variance;
    - ``"unsolved"`` (AR3PO): the prompts with no correct sample yet, evenly (prompts
      that got a correct response stop being sampled);
    - ``"zero_variance"``: the prompts whose outcomes so far all agree, evenly.

    Parameters
    ----------
    pilot : samples per key in round 1, >= min_n; None (default): half the uniform
        share of the budget (``N // 2`` for a budget of N per prompt), at least min_n, so
        the commit round always has budget to spend (a pilot of N spends it all).
    commit : "variance" | "unsolved" | "zero_variance".
    rounds : the rounds the policy plans for, >= 2 (2: the pilot and one commit).
    max_n : most samples of one prompt in a step, >= pilot.
    min_n, seed : as :class:`BudgetPolicy`.
    """

    name = "pilot"

    def __init__(
        self,
        *,
        pilot: int | None = None,
        commit: str = "variance",
        rounds: int = 2,
        max_n: int = 32,
        min_n: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__(min_n=min_n, seed=seed)
        self.pilot = None if pilot is None else as_int("pilot", pilot, lo=self.min_n)
        if commit not in ("variance", "unsolved", "zero_variance"):
            raise ValueError(
                f"commit: expected 'variance', 'unsolved' or 'zero_variance', got {commit!r}"
            )
        self.commit = commit
        self.rounds = as_int("rounds", rounds, lo=2)
        self.max_n = as_int("max_n", max_n, lo=self.pilot or self.min_n)

    def _begin(self) -> dict[int, int]:
        n = self.pilot
        if n is None:
            n = max(self.min_n, self._uniform_n(self.keys, self.budget) // 2)
        pilots = [(k, n) for k in self.keys]
        return _fit_order(pilots, self.cost, self.budget)

    def _more(self, outcomes: Outcomes, remaining: float) -> dict[int, int]:
        if self.round > self.rounds:
            return {}
        share = remaining / (self.rounds - self.round + 1)
        weight: dict[int, float] = {}
        for k in self.keys:
            v = outcomes.get(k)
            if not v or self.taken.get(k, 0) >= self.max_n:
                continue
            p = sum(v) / len(v)
            w = {
                "variance": p * (1 - p),
                "unsolved": float(p == 0),
                "zero_variance": float(p in (0.0, 1.0)),
            }[self.commit]
            if w > 0:
                weight[k] = w
        if not weight:
            return {}
        total = sum(w * self.cost[k] for k, w in weight.items())
        items = []
        for k, w in weight.items():
            m = max(int(math.floor(share * w / total + 1e-9)), 1)
            items.append((k, min(m, self.max_n - self.taken.get(k, 0))))
        return _fit_order(items, self.cost, share)


# ----------------------------------------------------------------- ours


class OursPolicy(BudgetPolicy):
    """``ours``: a history posterior, a pilot round and knapsack commits on this step's
    outcomes, over the keys and the spare prompts.

    Each prompt's pass rate has a Beta posterior: ``prior`` + its decayed history
    (as :class:`compass_kernels.advantages.RolloutAllocator`) + this step's outcomes
    so far. Every round is a greedy knapsack by value per cost over all prompts of
    the step (keys and ``spare`` alike), where the value of m more samples is the
    probability that they make the prompt's group informative:

    - not sampled yet: 1 - E[p^m] - E[(1-p)^m], m >= min_n (Knapsack RL's value);
    - sampled, all correct so far: 1 - E[p^m] (a failure flips it); all wrong:
      1 - E[(1-p)^m];
    - sampled and already informative: 0 (more samples add no informative group).

    Round 1 spends ``pilot_share`` of the budget, which buys mostly groups of min_n
    (the pilot: the first block has the best value per cost) on the prompts whose
    posterior is least settled; each later round spends an equal share of what is left
    over the rounds to come, so the commits land on the pilots that came out all-same
    but whose posterior (history + pilot) still says a flip is likely, and on fresh
    prompts where those are worth more. Items below ``min_value`` per sample are
    never bought. Keys come before spare prompts on ties (stable order).

    Parameters
    ----------
    pilot_share : share of the budget for round 1, in (0, 1].
    rounds : the rounds the policy plans for (the driver's max_rounds), >= 1.
    max_n : most samples of one prompt in a step, >= min_n.
    prior : (alpha, beta) of the Beta prior, > 0.
    decay : history decay per observation of a prompt, in (0, 1].
    min_value : least value (probability of an informative group gained) per sample
        worth buying, in [0, 1).
    min_n, seed : as :class:`BudgetPolicy`.
    """

    name = "ours"

    def __init__(
        self,
        *,
        pilot_share: float = 0.5,
        rounds: int = 3,
        max_n: int = 32,
        prior: Sequence[float] = (0.5, 0.5),
        decay: float = 0.9,
        min_value: float = 0.0,
        min_n: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__(min_n=min_n, seed=seed)
        self.pilot_share = _fraction("pilot_share", pilot_share)
        self.rounds = as_int("rounds", rounds, lo=1)
        self.max_n = as_int("max_n", max_n, lo=self.min_n)
        self.prior = _prior(prior)
        self.hist = _History(_fraction("decay", decay))
        mv = as_float("min_value", min_value)
        if not 0.0 <= mv < 1.0:
            raise ValueError(f"min_value: expected a number in [0, 1), got {mv}")
        self.min_value = mv

    def _begin(self) -> dict[int, int]:
        share = self.budget if self.rounds == 1 else self.budget * self.pilot_share
        return self._knapsack({}, share)

    def _more(self, outcomes: Outcomes, remaining: float) -> dict[int, int]:
        if self.round > self.rounds:
            return {}
        return self._knapsack(outcomes, remaining / (self.rounds - self.round + 1))

    def _observe(self, outcomes: Outcomes) -> None:
        self.hist.update(outcomes)

    def _knapsack(self, outcomes: Outcomes, budget: float) -> dict[int, int]:
        pool = self.keys + self.spare
        if not pool or budget <= 0:
            return {}
        s, a = self.hist.arrays(pool)
        k_now = np.array([len(outcomes.get(k, ())) for k in pool], dtype=np.float64)
        s_now = np.array([sum(outcomes.get(k, ())) for k in pool], dtype=np.float64)
        alpha = self.prior[0] + s + s_now
        beta = self.prior[1] + (a - s) + (k_now - s_now)
        M = self.max_n
        up, down = _moments(alpha, beta, M)
        # gain[i, m] = value of m more samples of prompt i (m = 0..M)
        fresh = k_now == 0
        all_ok = (k_now > 0) & (s_now == k_now)
        all_bad = (k_now > 0) & (s_now == 0)
        gain = np.zeros_like(up)
        gain[fresh] = 1.0 - up[fresh] - down[fresh]
        gain[all_ok] = 1.0 - up[all_ok]
        gain[all_bad] = 1.0 - down[all_bad]
        room = np.maximum(M - k_now, 0).astype(np.int64)
        heap: list[tuple[float, int, int, int]] = []  # (-ratio, order, prompt, m to reach)
        cost = np.array([self.cost[k] for k in pool])
        for i in range(len(pool)):
            first = self.min_n if fresh[i] else 1
            if room[i] >= first and gain[i, first] > 0:
                r = gain[i, first] / (first * cost[i])
                if gain[i, first] / first >= self.min_value:
                    heap.append((-r, i, i, first))
        heapq.heapify(heap)
        got = np.zeros(len(pool), dtype=np.int64)
        left = budget
        while heap:
            _, _, i, m = heapq.heappop(heap)
            step = m - got[i]
            c = step * cost[i]
            if c > left + 1e-9:
                continue  # this prompt's next item does not fit: its chain stops
            got[i] = m
            left -= c
            if m < room[i]:
                d = gain[i, m + 1] - gain[i, m]
                if d > 0 and d >= self.min_value:
                    heapq.heappush(heap, (-d / cost[i], i, i, m + 1))
        return {k: int(g) for k, g in zip(pool, got.tolist(), strict=True) if g}


# ----------------------------------------------------------------- factory, driver

_CLASSES: dict[str, type[BudgetPolicy]] = {
    "uniform": UniformPolicy,
    "dapo": DapoPolicy,
    "greso": GresoPolicy,
    "knapsack": KnapsackPolicy,
    "pilot": PilotPolicy,
    "ours": OursPolicy,
}


def make_policy(name: str, **options: object) -> BudgetPolicy:
    """A fresh policy by name (one of :data:`POLICIES`) with its options (keywords of
    its class: :class:`UniformPolicy`, :class:`DapoPolicy`, :class:`GresoPolicy`,
    :class:`KnapsackPolicy`, :class:`PilotPolicy`, :class:`OursPolicy`); an unknown
    name or option raises ValueError naming it."""
    cls = _CLASSES.get(name)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"name: expected one of {POLICIES}, got {name!r}")
    import inspect

    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    bad = sorted(set(options) - allowed)
    if bad:
        raise ValueError(f"{bad[0]}: not an option of policy {name!r} (options: {sorted(allowed)})")
    return cls(**options)  # type: ignore[arg-type]


@dataclass
class StepResult:
    """What :func:`run_step` saw in one step.

    outcomes : key -> every outcome of the step (rounds merged).
    samples : samples generated. spent : budget used (samples, or cost units).
    rounds : rounds run. informative : groups with a correct and an incorrect sample.
    groups : prompts sampled at least once.
    """

    outcomes: Outcomes = field(default_factory=dict)
    samples: int = 0
    spent: float = 0.0
    rounds: int = 0
    informative: int = 0
    groups: int = 0


def run_step(
    policy: BudgetPolicy,
    keys: Sequence[int],
    budget: float,
    draw: Callable[[dict[int, int]], Mapping[int, Sequence[bool]]],
    *,
    cost: np.ndarray | Sequence[float] | None = None,
    spare: Sequence[int] = (),
    max_rounds: int = 3,
) -> StepResult:
    """One step of ``policy``: begin, up to ``max_rounds - 1`` more rounds, observe.

    ``draw({key: n})`` generates the samples and returns their outcomes {key: [bool] * n}
    (e.g. the rollout engine plus the verifier). Every round's samples x cost must fit
    the budget left: a policy that asks for more raises ValueError naming it.
    """
    max_rounds = as_int("max_rounds", max_rounds, lo=1)
    budget = _amount("budget", budget)
    pool = list(keys) + list(spare)
    c = dict(
        zip(pool, ([1.0] * len(pool) if cost is None else np.asarray(cost).tolist()), strict=True)
    )
    res = StepResult()
    left = budget
    alloc = policy.begin(keys, budget, cost=cost, spare=spare)
    while alloc:
        res.rounds += 1
        spend = 0.0
        for k, n in alloc.items():
            if k not in c:
                raise ValueError(f"policy {policy.name!r}: asked for key {k}, not in keys or spare")
            if n < 0:
                raise ValueError(f"policy {policy.name!r}: asked for {n} samples of key {k}")
            spend += n * c[k]
        if spend > left + 1e-6 * max(1.0, budget):
            raise ValueError(
                f"policy {policy.name!r}: asked for {spend:g} of the {left:g} budget left"
            )
        got = draw(dict(alloc))
        for k, n in alloc.items():
            v = list(got[k])
            if len(v) != n:
                raise ValueError(f"draw: returned {len(v)} outcomes for key {k}, asked {n}")
            res.outcomes.setdefault(k, []).extend(bool(x) for x in v)
            res.samples += n
        res.spent += spend
        left -= spend
        if res.rounds >= max_rounds:
            break
        alloc = policy.more(res.outcomes, max(left, 0.0))
    policy.observe(res.outcomes)
    for v in res.outcomes.values():
        if v:
            res.groups += 1
            res.informative += int(0 < sum(v) < len(v))
    return res
