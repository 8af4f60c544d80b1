"""ck.advantages.policies: every rollout-budget policy on fresh random inputs (budget in
samples and in token costs never exceeded, min_n respected, deterministic for a seed),
each policy's semantics (DAPO's refill, GRESO's skip, Knapsack's optimum against brute
force, the pilot size, ours' commits), bad input naming the argument, planted bugs
(tests/mutants.py) that these checks catch, and the simulator's calibration fit."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.advantages import policies as P
from tests.mutants import mutated_module

POLICIES = P.POLICIES


class Bernoulli:
    """Outcomes of prompt k drawn with pass rate p[k] (a seeded stream)."""

    def __init__(self, p: dict[int, float], seed: int) -> None:
        self.p, self.rng = p, np.random.default_rng(seed)
        self.calls: list[dict[int, int]] = []

    def __call__(self, alloc: dict[int, int]) -> dict[int, list[bool]]:
        self.calls.append(dict(alloc))
        return {k: (self.rng.random(n) < self.p[k]).tolist() for k, n in alloc.items()}


def random_step(rng: random.Random, *, tokens: bool):
    nk, ns = rng.randint(0, 12), rng.randint(0, 8)
    ids = rng.sample(range(1000), nk + ns)
    keys, spare = ids[:nk], ids[nk:]
    p = {k: rng.choice([0.0, 1.0, rng.random(), rng.random() * 0.1]) for k in ids}
    cost = np.array([rng.uniform(1, 50) for _ in ids]) if tokens else None
    unit = 1.0 if cost is None else float(cost[:nk].mean()) if nk else 10.0
    budget = rng.choice([0.0, rng.uniform(0, 3) * unit, rng.uniform(0, 12 * max(nk, 1)) * unit])
    return keys, spare, p, cost, budget


def check_budget_and_min_n(mod, name: str, *, seed: int = 0, cases: int = 25) -> None:
    """Over several steps of random inputs: each round fits the budget left (run_step
    raises otherwise), the step's total fits the budget, every sampled prompt has at
    least min_n samples, keys outside the step are never asked for."""
    rng = random.Random(seed)
    for tokens in (False, True):
        for min_n in (2, 3):
            pol = mod.make_policy(name, min_n=min_n, seed=seed)
            for _ in range(cases):
                keys, spare, p, cost, budget = random_step(rng, tokens=tokens)
                draw = Bernoulli(p, rng.randrange(2**31))
                res = mod.run_step(pol, keys, budget, draw, cost=cost, spare=spare)
                c = dict(
                    zip(
                        keys + spare, [1.0] * len(p) if cost is None else cost.tolist(), strict=True
                    )
                )
                spent = sum(n * c[k] for call in draw.calls for k, n in call.items())
                assert spent <= budget + 1e-6 * max(1.0, budget), (name, spent, budget)
                assert res.spent == pytest.approx(spent)
                for k, v in res.outcomes.items():
                    assert k in c
                    assert len(v) >= min_n, (name, k, len(v), min_n)
                assert res.rounds <= 3


def trace(mod, name: str, seed: int) -> list:
    rng = random.Random(123)
    pol = mod.make_policy(name, seed=seed)
    out = []
    for _ in range(8):
        keys, spare, p, cost, budget = random_step(rng, tokens=rng.random() < 0.5)
        draw = Bernoulli(p, rng.randrange(2**31))
        mod.run_step(pol, keys, budget, draw, cost=cost, spare=spare)
        out.append(draw.calls)
    return out


@pytest.mark.parametrize("name", POLICIES)
def test_budget_never_exceeded_and_min_n_respected(name):
    check_budget_and_min_n(P, name)


@pytest.mark.parametrize("name", POLICIES)
def test_deterministic_for_a_seed(name):
    assert trace(P, name, 5) == trace(P, name, 5)


def test_greso_seed_changes_its_choices():
    # the only randomised policy: another seed skips other prompts
    pol = [P.make_policy("greso", seed=s) for s in (0, 1)]
    keys = list(range(200))
    for q in pol:
        for _ in range(3):
            q.observe({k: [True] * 4 for k in keys})
    picks = [set(q.begin(keys, 800)) for q in pol]
    assert picks[0] != picks[1]


# ------------------------------------------------------------------ semantics


def check_dapo_refills_after_zero_variance(mod) -> None:
    keys, spare = list(range(8)), list(range(100, 108))
    pol = mod.make_policy("dapo", n=4)
    first = pol.begin(keys, 4 * 8, spare=spare)
    assert set(first) <= set(keys) and all(n == 4 for n in first.values())
    # every group mixed: nothing to refill, the step ends
    assert pol.more({k: [True, False, True, True] for k in first}, 32 - 4 * len(first)) == {}
    pol = mod.make_policy("dapo", n=4)
    first = pol.begin(keys, 4 * 8, spare=spare)
    sampled = sorted(first)
    outs = {k: [True, False, False, True] for k in sampled}
    outs[sampled[0]] = [True] * 4  # one zero-variance group
    refill = pol.more(outs, 32 - 4 * len(first))
    assert list(refill) == [spare[0]] and refill[spare[0]] == 4  # one fresh spare prompt
    # two more zero-variance groups in the refill round: two more fresh prompts
    pol = mod.make_policy("dapo", n=2, first=0.5)
    first = pol.begin(keys, 2 * 8, spare=spare)
    outs = {k: [False, False] for k in first}
    refill = pol.more(outs, 16 - 2 * len(first))
    assert set(refill) <= set(spare) and len(refill) == min(len(first), (16 - 2 * len(first)) // 2)


def test_dapo_refills_from_spare_only_after_zero_variance_groups():
    check_dapo_refills_after_zero_variance(P)


def skip_rate(mod, history: list[list[bool]], trials: int = 400) -> float:
    """How often GRESO leaves out a key (one of many) whose past groups were ``history``."""
    pol = mod.make_policy("greso", n=2, seed=3, delta=0.0)
    keys = list(range(trials))
    for outs in history:
        pol.observe({k: outs for k in keys})
    got = pol.begin(keys, 2 * trials)
    return 1 - len(got) / trials


def check_greso_skips_by_history(mod) -> None:
    mixed = skip_rate(mod, [[True, False]] * 6)
    short = skip_rate(mod, [[True, False]] * 5 + [[True, True]])
    long = skip_rate(mod, [[True, True]] * 6)
    assert mixed == 0.0
    # 1 - p_e^z, p_e = 0.5: z = 1 skips ~half, z = 6 nearly all
    assert 0.35 < short < 0.65 and long > 0.9, (short, long)
    pol = mod.make_policy("greso", n=2, delta=0.0)
    pol.observe({1: [False] * 3, 2: [True, False, True]})
    assert pol.skip_probability(1) == pytest.approx(0.5) and pol.skip_probability(2) == 0.0


def test_greso_skips_long_zero_variance_history_more_often_than_mixed():
    check_greso_skips_by_history(P)


def test_greso_exploration_probability_adapts():
    pol = P.make_policy("greso", target=0.25, delta=0.1)
    start = dict(pol.p_e)
    pol.observe({k: [True, True] for k in range(10)})  # all easy zero-variance groups
    assert pol.p_e[True] == pytest.approx(start[True] - 0.1)  # explore easy ones less
    assert pol.p_e[False] == pytest.approx(start[False] + 0.1)  # no hard ones: more
    for _ in range(20):
        pol.observe({k: [True, True] for k in range(10)})
    assert pol.p_e[True] == pytest.approx(pol.p_min)


def brute_force(g: np.ndarray, cost: list[int], budget: int, min_n: int) -> float:
    """max sum_i g[i, n_i] over n_i in {0} U [min_n, max_n], sum n_i cost_i <= budget."""
    M = g.shape[1] - 1
    choices = [0, *range(min_n, M + 1)]
    best = 0.0
    for ns in itertools.product(choices, repeat=g.shape[0]):
        if sum(n * c for n, c in zip(ns, cost, strict=True)) <= budget:
            best = max(best, sum(g[i, n] for i, n in enumerate(ns)))
    return best


def gain_table(s, a, M, prior=(1.0, 1.0)) -> np.ndarray:
    """g[i, n] = 1 - E[p^n] - E[(1-p)^n], p ~ Beta(prior + (s, a - s)), in float64."""
    al, be = prior[0] + np.asarray(s), prior[1] + np.asarray(a) - np.asarray(s)
    g = np.zeros((len(al), M + 1))
    for i in range(len(al)):
        for n in range(2, M + 1):
            up = math.prod((al[i] + j) / (al[i] + be[i] + j) for j in range(n))
            down = math.prod((be[i] + j) / (al[i] + be[i] + j) for j in range(n))
            g[i, n] = 1 - up - down
    return g


def check_knapsack_near_brute_force(mod, cases: int = 40) -> None:
    """Knapsack's value is within one min_n block's gain of the brute-force optimum
    (the guarantee of allocate_rollouts' greedy with exchanges)."""
    rng = random.Random(7)
    for _ in range(cases):
        Pn, M, min_n = rng.randint(1, 4), rng.randint(3, 6), rng.randint(2, 3)
        keys = list(range(Pn))
        rates = [rng.choice([0.0, 1.0, rng.random()]) for _ in keys]
        hist = [[rng.random() < q for _ in range(rng.randint(0, 6))] for q in rates]
        pol = mod.make_policy("knapsack", max_n=M, min_n=min_n, decay=1.0)
        pol.observe({k: h for k, h in zip(keys, hist, strict=True) if h})
        s = [sum(h) for h in hist]
        a = [len(h) for h in hist]
        tokens = rng.random() < 0.5
        cost = [rng.randint(1, 3) for _ in keys] if tokens else [1] * Pn
        budget = rng.randint(0, sum(cost) * M)
        got = pol.begin(keys, budget, cost=np.array(cost, float) if tokens else None)
        g = gain_table(s, a, M)
        assert sum(got.get(k, 0) * cost[k] for k in keys) <= budget
        # the history reached the allocator as counted here
        want = ck.advantages.allocate_rollouts(
            torch.tensor(s, dtype=torch.float64),
            torch.tensor(a, dtype=torch.float64),
            budget,
            min_n=min_n,
            max_n=M,
            cost=torch.tensor(cost) if tokens else None,
        )
        assert [got.get(k, 0) for k in keys] == want.tolist()
        value = sum(g[k, got.get(k, 0)] for k in keys)
        opt = brute_force(g, cost, budget, min_n)
        block = max(g[:, min_n])
        assert value >= opt - block - 1e-9, (value, opt, got)
        if not tokens and all(got.get(k, 0) for k in keys):  # unit costs, no skip: exact
            assert value == pytest.approx(opt, abs=1e-9), (value, opt, got)


def test_knapsack_matches_brute_force_within_one_block():
    check_knapsack_near_brute_force(P)


def check_pilot_round_one(mod) -> None:
    keys = list(range(6))
    for k in (2, 3, 5):
        pol = mod.make_policy("pilot", pilot=k)
        assert pol.begin(keys, 100, spare=[10, 11]) == {i: k for i in keys}
    pol = mod.make_policy("pilot", pilot=4)
    first = pol.begin(keys, 48)
    outs = {0: [True, False, True, True], 1: [True, True, False, False]}
    outs.update({i: [False] * 4 for i in keys[2:]})
    commit = pol.more(outs, 48 - 24)
    # Pilot-Commit: the rest to the two mixed prompts, more to the higher variance
    assert set(commit) == {0, 1} and commit[1] > commit[0], commit
    assert sum(commit.values()) <= 24 and first == {i: 4 for i in keys}
    # the default pilot: half the uniform share (N = 8 -> 4, N = 4 -> 2, N = 2 -> min_n)
    for budget, want in ((48, 4), (24, 2), (12, 2)):
        assert mod.make_policy("pilot").begin(keys, budget) == {i: want for i in keys}
    pol = mod.make_policy("pilot", pilot=2, commit="unsolved")
    pol.begin(keys, 20)
    commit = pol.more({0: [True, True], 1: [True, False], 2: [False, False]}, 8)
    assert set(commit) == {2}, commit  # AR3PO: only the prompt without a correct sample


def test_pilot_round_one_is_the_pilot_size_then_commits():
    check_pilot_round_one(P)


def check_ours_commits(mod) -> None:
    """ours: no more samples for a group that is already informative; among all-correct
    pilots, the commit goes to the one whose history says a failure is likely."""
    pol = mod.make_policy("ours", decay=1.0, pilot_share=0.5)
    settled, unsure, mixed = 1, 2, 3
    for _ in range(8):
        pol.observe({settled: [True] * 8, unsure: [True, False] * 4, mixed: [True, False] * 4})
    first = pol.begin([settled, unsure, mixed], 24)
    assert first and all(n >= 2 for n in first.values()) and sum(first.values()) <= 12
    assert first.get(unsure, 0) > first.get(settled, 0)  # the pilot: least settled first
    outs = {settled: [True, True], unsure: [True, True], mixed: [True, False]}
    more = pol.more(outs, 12)
    assert mixed not in more and settled not in more and more.get(unsure, 0) > 0, more
    assert sum(more.values()) <= 6  # round 2 of 3: half of what is left


def test_ours_commits_to_all_same_pilots_likely_to_flip():
    check_ours_commits(P)


def check_ours_beats_uniform(mod) -> None:
    """On a population of spread pass rates, ours finds more informative groups per
    sample than uniform N at the same budget (deterministic: seeded)."""
    rng = np.random.default_rng(0)
    p = dict(enumerate((1 / (1 + np.exp(-rng.normal(0, 2.5, 200)))).tolist()))
    got = {}
    for name in ("uniform", "ours"):
        pol, draw, inf = mod.make_policy(name), Bernoulli(p, 1), 0
        order = np.random.default_rng(2)
        for _ in range(12):
            pick = order.choice(200, 64, replace=False).tolist()
            inf += mod.run_step(pol, pick[:32], 8 * 32, draw, spare=pick[32:]).informative
        got[name] = inf
    assert got["ours"] >= 1.3 * got["uniform"], got


def test_ours_beats_uniform_on_a_spread_population():
    check_ours_beats_uniform(P)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "name, options, arg",
    [
        ("nope", {}, "name"),
        ("uniform", {"bogus": 1}, "bogus"),
        ("uniform", {"min_n": 1}, "min_n"),
        ("uniform", {"n": 1}, "n"),
        ("uniform", {"seed": -1}, "seed"),
        ("uniform", {"n": 2.0}, "n"),
        ("dapo", {"first": 0.0}, "first"),
        ("dapo", {"first": 1.5}, "first"),
        ("greso", {"p_explore": 0.0}, "p_explore"),
        ("greso", {"target": -0.1}, "target"),
        ("greso", {"delta": 2.0}, "delta"),
        ("greso", {"p_min": 0.0}, "p_min"),
        ("knapsack", {"max_n": 1}, "max_n"),
        ("knapsack", {"prior": (0.0, 1.0)}, "prior"),
        ("knapsack", {"prior": (1.0,)}, "prior"),
        ("knapsack", {"decay": 0.0}, "decay"),
        ("pilot", {"pilot": 1}, "pilot"),
        ("pilot", {"commit": "all"}, "commit"),
        ("pilot", {"rounds": 1}, "rounds"),
        ("pilot", {"pilot": 8, "max_n": 4}, "max_n"),
        ("ours", {"pilot_share": 0.0}, "pilot_share"),
        ("ours", {"rounds": 0}, "rounds"),
        ("ours", {"min_value": 1.0}, "min_value"),
        ("ours", {"decay": float("nan")}, "decay"),
        ("ours", {"max_n": 1}, "max_n"),
    ],
)
def test_bad_options_name_the_option(name, options, arg):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        P.make_policy(name, **options)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda p: p.begin([1, 1], 4), "keys"),
        (lambda p: p.begin([1, "a"], 4), "keys"),
        (lambda p: p.begin([1, True], 4), "keys"),
        (lambda p: p.begin([1, 2], 4, spare=[2]), "spare"),
        (lambda p: p.begin([1], -1), "budget"),
        (lambda p: p.begin([1], float("nan")), "budget"),
        (lambda p: p.begin([1], float("inf")), "budget"),
        (lambda p: p.begin([1, 2], 4, cost=np.ones(3)), "cost"),
        (lambda p: p.begin([1, 2], 4, cost=np.array([1.0, 0.0])), "cost"),
        (lambda p: p.begin([1, 2], 4, cost=np.array([1.0, np.nan])), "cost"),
        (lambda p: p.begin([1], 4, cost=np.ones((1, 1))), "cost"),
        (lambda p: p.more({1: [True]}, 1), "more"),
        (lambda p: (p.begin([1], 4), p.more({9: [True]}, 1)), "outcomes"),
        (lambda p: (p.begin([1], 4), p.more({1: [1, 0]}, 1)), "outcomes"),
        (lambda p: (p.begin([1], 4), p.more([True], 1)), "outcomes"),
        (lambda p: (p.begin([1], 4), p.more({1: [True]}, -1)), "remaining"),
        (lambda p: p.observe({1: "yes"}), "outcomes"),
    ],
)
def test_bad_input_names_the_argument(name, call, arg):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        call(P.make_policy(name))


class Greedy(P.BudgetPolicy):
    """A broken policy: twice the budget."""

    name = "greedy"

    def _begin(self):
        return {k: 2 * int(self.budget) for k in self.keys[:1]}


def test_run_step_refuses_a_policy_over_budget_naming_it():
    with pytest.raises(ValueError, match="policy 'greedy': asked for 8 of the 4 budget left"):
        P.run_step(Greedy(), [1, 2], 4, Bernoulli({1: 0.5, 2: 0.5}, 0))
    with pytest.raises(ValueError, match="^draw: returned 1 outcomes for key 1, asked 2"):
        P.run_step(P.make_policy("uniform", n=2), [1], 2, lambda a: {1: [True]})


def test_run_step_counts_groups_of_merged_rounds():
    pol = P.make_policy("pilot", pilot=2, commit="zero_variance")
    res = P.run_step(pol, [1, 2], 8, lambda a: {k: [k == 1] * n for k, n in a.items()})
    assert res.groups == 2 and res.informative == 0 and res.samples == 8
    assert res.outcomes == {1: [True] * 4, 2: [False] * 4} and res.rounds == 2


def test_exported_from_ck_advantages():
    assert ck.advantages.make_policy is P.make_policy and ck.advantages.POLICIES == POLICIES
    assert ck.advantages.policies is P and ck.advantages.run_step is P.run_step


# ------------------------------------------------------------------ planted bugs

#: (policy, the edit, the check that must fail on the mutant)
PLANTS = [
    (
        "uniform",
        ("if n > 0 and c <= left + 1e-9:", "if n > 0:"),
        lambda m: check_budget_and_min_n(m, "uniform"),
    ),
    (
        "dapo",
        ("if len(outcomes.get(k, ())) and len(set(outcomes[k])) == 1", "if outcomes.get(k)"),
        check_dapo_refills_after_zero_variance,
    ),
    (
        "greso",
        (
            "return 1.0 - self.p_e[self.hist.last[key]] ** z",
            "return self.p_e[self.hist.last[key]] ** z",
        ),
        check_greso_skips_by_history,
    ),
    (
        "knapsack",
        (
            "min_n=self.min_n,\n            max_n=self.max_n,",
            "min_n=2,\n            max_n=self.max_n,",
        ),
        lambda m: check_budget_and_min_n(m, "knapsack"),
    ),
    (
        "knapsack",
        ("torch.from_numpy(s),\n", "torch.from_numpy(s * 0),\n"),
        check_knapsack_near_brute_force,
    ),
    (
        "pilot",
        ("pilots = [(k, n) for k in self.keys]", "pilots = [(k, n + 1) for k in self.keys]"),
        check_pilot_round_one,
    ),
    (
        "pilot",
        ('"variance": p * (1 - p),', '"variance": 1.0 - p * (1 - p),'),
        check_pilot_round_one,
    ),
    (
        "ours",
        ("gain[all_ok] = 1.0 - up[all_ok]", "gain[all_ok] = 1.0 - down[all_ok]"),
        check_ours_commits,
    ),
    (
        "ours",
        ("continue  # this prompt's next item does not fit: its chain stops", "pass"),
        lambda m: check_budget_and_min_n(m, "ours"),
    ),
]


@pytest.mark.parametrize(
    "policy, edit, check", PLANTS, ids=[f"{p[0]}-{i}" for i, p in enumerate(PLANTS)]
)
def test_a_planted_bug_fails_a_check(policy, edit, check):
    check(P)  # the real module passes
    mutant = mutated_module(P, *edit)
    # a check's assertion, or run_step's budget check (ValueError naming the policy)
    with pytest.raises((AssertionError, ValueError)):
        check(mutant)


# ------------------------------------------------------------------ the simulator's fit


def test_calibrate_recovers_difficulty_and_drift(tmp_path):
    from bench import bench_budget as B

    rng = np.random.default_rng(0)
    diff = rng.normal(0.0, 1.0, 40)
    gain, T = 2.0, 12
    rows = []
    for t in range(T):
        for i in range(40):
            p = 1 / (1 + np.exp(-(gain * t / (T - 1) - diff[i])))
            rows.append(dict(step=t, prompt=f"q{i}", attempts=16, correct=int(rng.binomial(16, p))))
    path = tmp_path / "traj.json"
    path.write_text(json.dumps(rows))
    d, g = B.calibrate(path)
    assert g == pytest.approx(gain, abs=0.3)
    assert np.corrcoef(d, diff)[0, 1] > 0.95
    csv_path = tmp_path / "traj.csv"
    csv_path.write_text(
        "step,prompt,attempts,correct\n"
        + "".join(f"{r['step']},{r['prompt']},{r['attempts']},{r['correct']}\n" for r in rows)
    )
    d2, g2 = B.calibrate(csv_path)
    assert g2 == pytest.approx(g) and np.allclose(d2, d)


def test_calibrate_bad_file_names_the_problem(tmp_path):
    from bench import bench_budget as B

    bad = tmp_path / "bad.csv"
    bad.write_text("step,prompt,attempts\n0,a,4\n")
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['correct'\]"):
        B.calibrate(bad)
    bad.write_text("step,prompt,attempts,correct\n0,a,4,5\n")
    with pytest.raises(ValueError, match="row 0"):
        B.calibrate(bad)


@pytest.mark.parametrize("budget", ["samples", "tokens"])
def test_simulator_runs_every_policy_within_budget(budget):
    from bench import bench_budget as B

    rows = [
        B.simulate("mid", p, budget=budget, steps=3, prompts=64, batch=16, spare=16)
        for p in POLICIES
    ]
    for r in rows:
        assert 0 < r["samples"] <= 3 * 8 * 16 or budget == "tokens"
        assert 0 <= r["informative"] <= r["groups"] and r["tokens"] > 0
