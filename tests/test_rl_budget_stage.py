"""compass-rl's stage 0 on a rollout-budget policy (``--budget-policy``; the loop's
``_stage0_policy`` on ``ck.advantages.policies.run_step``) on fake rollouts (no engines):
the budget is enforced, a policy's bad request names it, rounds merge into one group per
prompt, spare prompts, the per-step columns and prompts.csv, every policy of the
interface within the budget."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

import compass_kernels as ck
from compass_kernels.integration.rl import loop


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
        self.observed = {k: list(v) for k, v in outcomes.items()}


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


def _run(policy, rates=None, *extra):
    """_stage0_policy on pool[:4] (keys 0-3 of a 12-prompt pool), 3 spare prompts."""
    args = _args("--budget-policy", "uniform", "--spare", "3", *extra)
    state, pool = _fake_state(policy, args, rates or dict.fromkeys(range(12), 0.5))
    calls: list = []
    inner = state.rollout.run_round

    def run_round(requests, *, round):
        calls.append(([(p.index, n) for p, n in requests], round))
        return inner(requests, round=round)

    state.rollout.run_round = run_round
    spare = [p.index for p in loop._spare_prompts(_fake_state(None, args, {})[0], pool[:4])]
    row: dict = {"step": 1}
    samples, _ = loop._stage0_policy(state, pool[:4], row)
    return row, samples, calls, spare


def test_rounds_merge_into_one_group_per_prompt():
    rates = {k: 1.0 if k % 2 == 0 else 0.0 for k in range(12)}
    spare = _run(Scripted([{}]))[3]
    sp = spare[0]
    pol = Scripted([{0: 2, 1: 2}, {1: 2, sp: 1}, {0: 1}])
    row, samples, calls, _ = _run(pol, rates)  # budget 2 x 4 = 8: 4, 3, then 1 left
    assert calls == [([(0, 2), (1, 2)], 0), ([(1, 2), (sp, 1)], 1), ([(0, 1)], 2)]
    assert [s.round for s in samples] == [0] * 4 + [1] * 3 + [2]
    assert pol.remaining == [4, 1]
    assert pol.seen[0][:4] == ("begin", [0, 1, 2, 3], 8, None)
    assert pol.seen[0][4] == spare
    assert pol.seen[2][1] == {0: [True, True], 1: [False] * 4, sp: [sp % 2 == 0]}
    want = {0: [True] * 3, 1: [False] * 4, sp: [sp % 2 == 0]}
    assert pol.observed == want
    assert row["rounds"] == 3 and row["budget_spent"] == 8 and row["budget"] == 8
    assert row["alloc_samples"] == 4 and row["skipped_prompts"] == 2 and row["spare_prompts"] == 1
    assert row["prompt_outcomes"] == {str(k): [len(v), sum(v)] for k, v in want.items()}


def test_max_rounds_and_an_empty_request_end_the_step():
    pol = Scripted([{0: 1}, {0: 1}, {0: 1}, {0: 1}])
    row, _, calls, _ = _run(pol, None, "--max-rounds", "2")
    assert len(calls) == 2 and row["rounds"] == 2 and len(pol.remaining) == 1
    pol = Scripted([{0: 2}, {}, {0: 5}])
    row, _, calls, _ = _run(pol)
    assert len(calls) == 1 and row["rounds"] == 1 and set(pol.observed) == {0}
    assert row["skipped_prompts"] == 3 and row["spare_prompts"] == 0


@pytest.mark.parametrize(
    ("rounds", "match"),
    [
        ([{0: 5, 1: 4}], "policy 'scripted': asked for 9 of the 8 budget left"),
        ([{0: 3, 1: 3}, {1: 3}], "policy 'scripted': asked for 3 of the 2 budget left"),
        ([{99: 1}], "policy 'scripted': asked for key 99, not in keys or spare"),
        ([{0: -1}], "policy 'scripted': asked for -1 samples of key 0"),
    ],
)
def test_bad_requests_name_the_policy(rounds, match):
    with pytest.raises(ValueError, match=match):
        _run(Scripted(rounds))


def test_nothing_over_budget_is_generated():
    pol = Scripted([{0: 3, 1: 3}, {1: 3}])
    args = _args("--budget-policy", "uniform", "--spare", "3")
    state, pool = _fake_state(pol, args, dict.fromkeys(range(12), 0.5))
    calls: list = []
    inner = state.rollout.run_round

    def run_round(requests, *, round):
        calls.append(round)
        return inner(requests, round=round)

    state.rollout.run_round = run_round
    with pytest.raises(ValueError, match="budget left"):
        loop._stage0_policy(state, pool[:4], {})
    assert calls == [0]


@pytest.mark.parametrize("name", ck.advantages.policies.POLICIES)
@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_every_policy_stays_within_the_budget(name, unit):
    """Each policy of the interface for 6 steps on prompts of pass rates 0-1: its
    rounds never spend more than the step's budget, the columns recount, and every
    sampled prompt's attempts are what was generated."""
    args = _args("--budget-policy", name, "--spare", "4", "--budget-unit", unit)
    rates = {k: k / 11 for k in range(12)}
    policy = ck.advantages.policies.make_policy(name)
    state, pool = _fake_state(policy, args, rates)
    rng = np.random.default_rng(3)
    for step in range(6):
        chosen = [pool[int(i)] for i in rng.choice(12, 4, replace=False)]
        row: dict = {"step": step}
        samples, timing = loop._stage0_policy(state, chosen, row)
        assert row["budget_spent"] <= row["budget"] + 1e-6
        if unit == "samples":
            assert row["budget"] == 8 and len(samples) == row["budget_spent"]
        counts: dict[str, list[int]] = {}
        for s in samples:
            c = counts.setdefault(str(s.prompt.index), [0, 0])
            c[0] += 1
            c[1] += int(s.score.correct)
        assert counts == row["prompt_outcomes"] and timing.requests == len(samples)
        assert 1 <= row["rounds"] <= args.max_rounds
        for s in samples:  # the token budget's predictor learns the lengths
            state.rollout.predictor.observe(s.prompt.index, len(s.response))
        state.rollout.predictor.end_step()
