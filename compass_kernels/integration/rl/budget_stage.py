"""Stage 0 of ``compass-rl --budget-policy``: a rollout-budget policy's rounds, one step.

The driver of the policy interface (``ck.advantages.policies``: ``begin``, ``more``,
``observe``) on the loop's side, written against an abstract ``generate`` so that it
runs without engines in the tests:

1. ``policy.begin(keys, budget, cost=, spare=)``: samples per prompt of round 1;
2. after each round, ``policy.more(outcomes, remaining)`` with every outcome of the
   step so far; ``{}`` (or nothing left to ask) ends the step, and it is called at most
   ``max_rounds - 1`` times;
3. ``policy.observe(outcomes)`` with all of the step's outcomes.

Every request is checked before anything is generated: only this step's prompts and
spare prompts, whole non-negative sample counts, and the samples x cost of all rounds
within the budget (samples when ``cost`` is None, else cost units: the loop's predicted
tokens per sample); a policy that breaks one gets a ValueError naming it. A prompt's
group is all of its samples of the step, rounds merged (any size, 0 and 1 included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["BudgetStep", "count_informative", "run_budget_rounds"]

#: slack of the budget comparison (cost units are whole tokens or samples)
_EPS = 1e-9


@dataclass
class BudgetStep:
    """What one step's rounds produced."""

    outcomes: dict[int, list[bool]]  # prompt key -> correct? of each sample, rounds merged
    payloads: list[Any]  # what ``generate`` returned for each sample, in generation order
    requested: list[dict[int, int]] = field(default_factory=list)  # per round
    spent: float = 0.0  # samples x cost of every round

    @property
    def rounds(self) -> int:
        return len(self.requested)

    @property
    def samples(self) -> int:
        return sum(len(v) for v in self.outcomes.values())

    @property
    def informative(self) -> int:
        return count_informative(self.outcomes)


def count_informative(outcomes: dict[int, list[bool]]) -> int:
    """Groups with at least one correct and one incorrect sample."""
    return sum(1 for v in outcomes.values() if any(v) and not all(v))


def _check_request(
    name: str, request: Any, allowed: set[int], cost: dict[int, float], left: float, round_: int
) -> tuple[dict[int, int], float]:
    if not isinstance(request, dict):
        raise ValueError(
            f"budget policy {name!r}: round {round_} returned {type(request).__name__}, "
            "expected a dict prompt key -> samples"
        )
    clean: dict[int, int] = {}
    for key, n in request.items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(
                f"budget policy {name!r}: round {round_} asked {n!r} samples of prompt {key!r}, "
                "expected a whole number >= 0"
            )
        if int(key) not in allowed or isinstance(key, bool):
            raise ValueError(
                f"budget policy {name!r}: round {round_} asked for prompt {key!r}, which is "
                "neither one of this step's prompts nor a spare one"
            )
        if n:
            clean[int(key)] = int(n)
    spend = float(sum(n * cost[k] for k, n in clean.items()))
    if spend > left + _EPS:
        raise ValueError(
            f"budget policy {name!r}: round {round_} asked for {spend:g} "
            f"({sum(clean.values())} samples) with {left:g} of the budget left"
        )
    return clean, spend


def run_budget_rounds(
    policy: Any,
    keys: Sequence[int],
    budget: float,
    generate: Callable[[dict[int, int], int], list[tuple[int, bool, Any]]],
    *,
    cost: np.ndarray | None = None,
    spare: Sequence[int] = (),
    max_rounds: int = 3,
) -> BudgetStep:
    """Run one step of ``policy`` (see the module docstring).

    Parameters
    ----------
    policy : BudgetPolicy
        ``begin`` / ``more`` / ``observe`` of ``ck.advantages.policies``.
    keys : sequence of int
        This step's prompts.
    budget : float
        Samples (``cost`` None) or cost units for the whole step.
    generate : callable (requests, round) -> list of (key, correct, payload)
        Generates ``requests[key]`` samples of each prompt (round 0, 1, ...) and returns
        one triple per sample.
    cost : array of float, optional
        ``len(keys) + len(spare)`` costs of one sample (keys first), > 0.
    spare : sequence of int
        Extra prompts the policy may draw.
    max_rounds : int
        Rounds at most (``more`` is called at most ``max_rounds - 1`` times).
    """
    name = str(getattr(policy, "name", type(policy).__name__))
    keys = [int(k) for k in keys]
    spare = [int(k) for k in spare]
    if len(set(keys + spare)) != len(keys) + len(spare):
        raise ValueError("keys, spare: expected distinct prompt keys")
    if not (isinstance(max_rounds, int) and max_rounds >= 1):
        raise ValueError(f"max_rounds: expected an int >= 1, got {max_rounds!r}")
    if not (np.isfinite(budget) and budget >= 0):
        raise ValueError(f"budget: expected a finite number >= 0, got {budget!r}")
    everyone = keys + spare
    if cost is None:
        unit = dict.fromkeys(everyone, 1.0)
    else:
        c = np.asarray(cost, dtype=np.float64)
        if c.shape != (len(everyone),) or not np.all(np.isfinite(c)) or np.any(c <= 0):
            raise ValueError(
                f"cost: expected {len(everyone)} finite costs > 0 (keys then spare), got "
                f"shape {c.shape}"
            )
        unit = dict(zip(everyone, c.tolist(), strict=True))
    allowed = set(everyone)
    step = BudgetStep(outcomes={}, payloads=[])
    request = policy.begin(keys, budget, cost=cost, spare=spare)
    for round_ in range(max_rounds):
        if round_:
            request = policy.more(
                {k: list(v) for k, v in step.outcomes.items()}, budget - step.spent
            )
        clean, spend = _check_request(name, request, allowed, unit, budget - step.spent, round_)
        if not clean:
            break
        got = generate(clean, round_)
        asked = sum(clean.values())
        if len(got) != asked:
            raise RuntimeError(f"generate: returned {len(got)} samples for {asked} requested")
        step.requested.append(clean)
        step.spent += spend
        for key, correct, payload in got:
            step.outcomes.setdefault(int(key), []).append(bool(correct))
            step.payloads.append(payload)
    policy.observe({k: list(v) for k, v in step.outcomes.items()})
    return step
