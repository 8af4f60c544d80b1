"""compass-rl's stage 0 on a rollout-budget policy (``rl/budget_stage.py``,
``--budget-policy``): the rounds driver on fake outcomes (no engines): the budget is
enforced, a policy's bad request names it, rounds merge into one group per prompt,
the loop's per-step columns and prompts.csv."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from compass_kernels.integration.rl import loop
from compass_kernels.integration.rl.budget_stage import count_informative, run_budget_rounds


class Scripted:
    """A policy that asks what it is told, round by round, and records what it saw."""

    name = "scripted"

    def __init__(self, rounds):
        self.rounds = list(rounds)
        self.seen: list = []
        self.remaining: list[float] = []
        self.observed = None

    def begin(self, keys, budget, *, cost=None, spare=()):
        self.seen.append(("begin", list(keys), budget, cost, list(spare)))
        return self.rounds.pop(0)

    def more(self, outcomes, remaining):
        self.seen.append(("more", {k: list(v) for k, v in outcomes.items()}))
        self.remaining.append(remaining)
        return self.rounds.pop(0) if self.rounds else {}

    def observe(self, outcomes):
        self.observed = outcomes


def _env(rates: dict[int, float], seed: int = 0):
    """generate(): Bernoulli outcomes per prompt; records every request."""
    rng = np.random.default_rng(seed)
    calls: list = []

    def generate(requests, round_):
        calls.append((dict(requests), round_))
        return [
            (k, bool(rng.random() < rates[k]), (k, round_, j))
            for k, n in requests.items()
            for j in range(n)
        ]

    return generate, calls


def test_rounds_merge_into_one_group_per_prompt():
    gen, calls = _env({0: 1.0, 1: 0.0, 2: 0.5, 7: 1.0})
    pol = Scripted([{0: 2, 1: 2}, {1: 3, 7: 1}, {0: 1}])
    res = run_budget_rounds(pol, [0, 1, 2], 12, gen, spare=[7], max_rounds=3)
    assert calls == [({0: 2, 1: 2}, 0), ({1: 3, 7: 1}, 1), ({0: 1}, 2)]
    assert res.outcomes == {0: [True] * 3, 1: [False] * 5, 7: [True]}
    assert res.rounds == 3 and res.samples == 9 and res.spent == 9
    assert pol.remaining == [8, 4]  # the budget left after each round
    assert pol.seen[0] == ("begin", [0, 1, 2], 12, None, [7])
    assert pol.seen[2][1] == {0: [True, True], 1: [False] * 5, 7: [True]}  # all so far
    assert pol.observed == res.outcomes
    assert [p[:2] for p in res.payloads] == [(0, 0)] * 2 + [(1, 0)] * 2 + [(1, 1)] * 3 + [
        (7, 1),
        (0, 2),
    ]
    assert res.informative == 0


def test_max_rounds_and_an_empty_request_end_the_step():
    gen, calls = _env({0: 0.5, 1: 0.5})
    pol = Scripted([{0: 1}, {0: 1}, {0: 1}, {0: 1}])
    res = run_budget_rounds(pol, [0, 1], 10, gen, max_rounds=2)
    assert len(calls) == 2 and res.rounds == 2 and len(pol.remaining) == 1
    gen, calls = _env({0: 0.5, 1: 0.5})
    pol = Scripted([{0: 2, 1: 0}, {}, {0: 5}])
    res = run_budget_rounds(pol, [0, 1], 10, gen)
    assert calls == [({0: 2}, 0)] and res.rounds == 1  # zero counts are no request
    assert pol.observed == res.outcomes and set(res.outcomes) == {0}


def test_informative_counts_merged_groups():
    assert count_informative({0: [True, False], 1: [True], 2: [False, False], 3: []}) == 1
    gen, _ = _env({0: 1.0, 1: 0.0})
    # prompt 0 then gets a failure from a second environment draw: merged, it is informative
    outs = iter([True, True, False])

    def generate(requests, round_):
        return [(k, next(outs), None) for k, n in requests.items() for _ in range(n)]

    res = run_budget_rounds(Scripted([{0: 2}, {0: 1}]), [0, 1], 4, generate)
    assert res.outcomes == {0: [True, True, False]} and res.informative == 1


def test_budget_is_enforced_in_samples_and_cost_units():
    gen, calls = _env({0: 0.5, 1: 0.5, 5: 0.5})
    with pytest.raises(ValueError, match="budget policy 'scripted': round 0 asked for 9"):
        run_budget_rounds(Scripted([{0: 5, 1: 4}]), [0, 1], 8, gen)
    with pytest.raises(ValueError, match="round 1 asked for 3 .* with 2 of the budget left"):
        run_budget_rounds(Scripted([{0: 3, 1: 3}, {1: 3}]), [0, 1], 8, gen)
    assert calls == [({0: 3, 1: 3}, 0)]  # nothing over budget was generated
    cost = np.array([10.0, 2.0, 5.0])  # keys 0, 1 then spare 5
    res = run_budget_rounds(Scripted([{0: 1, 1: 5}, {5: 2}]), [0, 1], 30, gen, cost=cost, spare=[5])
    assert res.spent == 30 and res.samples == 8
    with pytest.raises(ValueError, match=r"round 1 asked for 12 \(3 samples\) with 10 of"):
        run_budget_rounds(
            Scripted([{0: 1, 1: 5}, {5: 2, 1: 1}]), [0, 1], 30, gen, cost=cost, spare=[5]
        )


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ({9: 1}, "asked for prompt 9, which is neither"),
        ({0: -1}, "asked -1 samples of prompt 0"),
        ({0: 1.5}, "asked 1.5 samples"),
        ({0: True}, "asked True samples"),
        ([(0, 2)], "returned list, expected a dict"),
    ],
)
def test_bad_requests_name_the_policy(request_, match):
    gen, calls = _env({0: 0.5, 1: 0.5})
    with pytest.raises(ValueError, match=match) as err:
        run_budget_rounds(Scripted([request_]), [0, 1], 8, gen)
    assert "'scripted'" in str(err.value) and calls == []


def test_driver_rejects_bad_arguments():
    gen, _ = _env({0: 0.5})
    for kwargs, match in (
        (dict(spare=[0]), "distinct"),
        (dict(max_rounds=0), "max_rounds"),
        (dict(cost=np.array([1.0, 2.0])), "cost: expected 1"),
        (dict(cost=np.array([0.0])), "cost: expected 1"),
    ):
        with pytest.raises(ValueError, match=match):
            run_budget_rounds(Scripted([{0: 1}]), [0], 4, gen, **kwargs)
    with pytest.raises(ValueError, match="budget"):
        run_budget_rounds(Scripted([{0: 1}]), [0], float("nan"), gen)


def test_generate_must_return_every_sample():
    def short(requests, round_):
        return []

    with pytest.raises(RuntimeError, match="returned 0 samples for 2"):
        run_budget_rounds(Scripted([{0: 2}]), [0], 4, short)


def _args(*extra: str) -> argparse.Namespace:
    return loop.build_parser().parse_args(["--pool", "12", "--prompts", "4", "--n", "2", *extra])


def _fake_state(policy, args, rates):
    """LoopState with a fake rollout: Bernoulli correctness per prompt, 3-token responses."""
    from compass_kernels.integration.rl import task as T
    from compass_kernels.integration.rl.rollout import RoundTiming
    from compass_kernels.packing.schedule import LengthPredictor

    rng = np.random.default_rng(1)
    cfg = T.TaskConfig(vocab_size=64)
    pool = T.make_prompts(cfg, args.pool, seed=0, task="graded")

    def run_round(requests, *, round):
        samples = [
            SimpleNamespace(
                prompt=p,
                round=round,
                response=(1, 2, 3),
                score=SimpleNamespace(correct=bool(rng.random() < rates[p.index])),
            )
            for p, n in requests
            for _ in range(n)
        ]
        return samples, RoundTiming(requests=len(samples), tokens=3 * len(samples))

    rollout = SimpleNamespace(run_round=run_round, predictor=LengthPredictor(default=3.0))
    state = loop.LoopState(
        args, np.random.default_rng(0), pool, cfg, rollout, None, None, [], None, policy
    )
    return state, pool


def test_loop_stage0_policy_columns_and_prompts_csv(tmp_path):
    args = _args("--budget-policy", "uniform", "--spare", "3")
    rates = dict.fromkeys(range(12), 0.5)
    pol = Scripted([{}, {}])
    state, pool = _fake_state(pol, args, rates)
    chosen = pool[:4]
    keys = [p.index for p in chosen]
    spare_seen = []

    def begin(k, budget, *, cost=None, spare=()):
        spare_seen.append(list(spare))
        return {keys[0]: 3, keys[1]: 1, spare[0]: 4}

    pol.begin = begin
    row: dict = {"step": 1}
    samples, timing = loop._stage0_policy(state, chosen, row)
    sp = spare_seen[0]
    assert len(sp) == 3 and not set(sp) & set(keys)
    assert len(samples) == 8 and timing.requests == 8
    assert row["budget"] == 8 and row["budget_spent"] == 8 and row["rounds"] == 1
    assert row["alloc_samples"] == 8 and row["skipped_prompts"] == 2 and row["spare_prompts"] == 1
    assert row["allocate"] == "policy:uniform"
    got = {int(k): v for k, v in row["prompt_outcomes"].items()}
    assert {k: v[0] for k, v in got.items()} == {keys[0]: 3, keys[1]: 1, sp[0]: 4}
    loop.write_prompt_outcomes(tmp_path / "prompts.csv", [row])
    lines = (tmp_path / "prompts.csv").read_text().splitlines()
    assert lines[0] == "step,prompt,attempts,correct" and len(lines) == 4
    for line in lines[1:]:
        step, key, attempts, correct = map(int, line.split(","))
        assert step == 1 and got[key] == [attempts, correct]
    # the spare prompts come from their own stream: the same for every policy
    state2, _ = _fake_state(Scripted([{}]), args, rates)
    assert [p.index for p in loop._spare_prompts(state2, chosen)] == sp


def test_loop_stage0_policy_token_budget():
    args = _args("--budget-policy", "uniform", "--budget-unit", "tokens", "--spare", "0")
    state, pool = _fake_state(Scripted([{}]), args, dict.fromkeys(range(12), 0.5))
    for p in pool[:2]:
        state.rollout.predictor.observe(p.index, 10)
    state.rollout.predictor.end_step()
    seen = []

    def begin(keys, budget, *, cost=None, spare=()):
        seen.append((budget, cost.tolist()))
        return {keys[0]: 1}

    state.policy.begin = begin
    row: dict = {}
    loop._stage0_policy(state, pool[:4], row)
    budget, cost = seen[0]
    assert cost[:2] == [10, 10] and budget == 2 * sum(cost)  # --n x predicted tokens
    assert row["budget_spent"] == 10


def test_cli_budget_policy_arguments():
    for argv, match in (
        (["--budget-policy", "ours", "--allocate", "samples"], "two stage-0 drivers"),
        (["--budget-policy", "ours", "--max-rounds", "0"], "--max-rounds must be >= 1"),
        (["--spare", "9"], r"--spare must be in \[0, --pool - --prompts = 8\]"),
    ):
        with pytest.raises(SystemExit, match=match):
            loop._check_args(_args(*argv))
    loop._check_args(_args("--budget-policy", "dapo", "--task", "graded"))
    defaults = loop.build_parser().parse_args([])
    assert defaults.budget_policy is None and defaults.task == "majority"  # unchanged default
