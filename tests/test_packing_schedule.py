"""ck.packing.schedule: the length predictor, the submission policies and the
rollout makespan simulator (hand-checked times, lower bound, preemption), and
that length-aware submission beats FIFO and random on a long-tailed workload."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest

from compass_kernels.packing import schedule as S


def test_predictor_history_siblings_fallback():
    p = S.LengthPredictor(history=4, sibling_weight=0.5, default=777)
    assert p.predict("new") == 777  # nothing observed yet
    for v in (100, 400):
        p.observe("a", v)
    # this step's siblings only: their geometric mean
    assert p.predict("a") == pytest.approx(200.0)
    p.end_step()
    assert p.predict("a") == pytest.approx(200.0)  # history now
    p.observe("a", 800)  # a sibling finished this step: blend 0.5 / 0.5 in log space
    assert p.predict("a") == pytest.approx(math.exp(0.5 * math.log(800) + 0.5 * math.log(200)))
    assert p.predict("a", generated=5000) == 5001  # never below what it already generated
    # new prompts: the mean of every length seen (100, 400, 800)
    assert p.predict("b") == pytest.approx(1300 / 3)
    with pytest.raises(ValueError, match="length: expected >= 1"):
        p.observe("a", 0)


def test_predictor_history_is_bounded():
    p = S.LengthPredictor(history=2)
    for v in (10, 1000, 1000):
        p.observe("x", v)
        p.end_step()
    assert p.predict("x") == pytest.approx(1000.0)


def test_longest_first_and_lpt():
    pred = [5, 50, 1, 20, 20, 7]
    assert S.longest_first(pred).tolist() == [1, 3, 4, 5, 0, 2]
    engines = S.lpt_assign(pred, 2)
    assert sorted(sum(engines, [])) == list(range(6))
    loads = [sum(pred[i] for i in e) for e in engines]
    assert sorted(loads) == [51, 52]  # LPT: {50, 1} and {20, 20, 7, 5}
    for e in engines:  # each queue longest first
        assert [pred[i] for i in e] == sorted((pred[i] for i in e), reverse=True)
    with pytest.raises(ValueError, match="num_engines"):
        S.lpt_assign(pred, 0)


def test_over_provision():
    assert S.over_provision(64, extra=0.25) == 80
    assert S.over_provision(64, extra=0.25, carried=10) == 70
    assert S.over_provision(10, extra=0.0, carried=20) == 0
    with pytest.raises(ValueError):
        S.over_provision(0)


def test_simulator_times_by_hand():
    m = S.EngineModel(step_s=1.0, per_seq_s=0.5, max_seqs=2, kv_tokens=10_000)
    reqs = [S.Request("a", 10, 4), S.Request("b", 10, 2), S.Request("c", 10, 3)]
    r = S.simulate(reqs, [[0, 1, 2]], m)
    # a and b run together (2 steps at 2 s), then a and c (2 steps at 2 s), then c (1 step, 1.5 s)
    assert r.done_at.tolist() == [8.0, 4.0, 9.5]
    assert r.makespan == 9.5 and r.preemptions == 0
    assert r.lower_bound == max(4 * 1.5, 9 / (2 / 2.0))
    two = S.simulate(reqs, [[0], [1, 2]], m)
    # engine 0: a alone, 4 steps of 1.5 s; engine 1: b and c together 2 steps, then c
    assert two.finish.tolist() == [6.0, 5.5]
    assert two.idle_fraction == pytest.approx((6.0 - 5.5) / 6.0 / 2)


def test_simulator_preempts_when_kv_is_full():
    m = S.EngineModel(step_s=1.0, per_seq_s=0.0, max_seqs=4, kv_tokens=30)
    reqs = [S.Request(i, 5, 10) for i in range(3)]
    r = S.simulate(reqs, [[0, 1, 2]], m)
    assert r.preemptions > 0
    assert (r.done_at > 0).all() and r.makespan >= r.lower_bound
    with pytest.raises(ValueError, match=r"requests\[0\]: expected .* kv_tokens = 30"):
        S.simulate([S.Request(0, 25, 10)], [[0]], m)


@pytest.mark.parametrize("seed", [0, 1])
def test_length_aware_beats_fifo_and_random(seed):
    reqs, pred = S.synthetic_workload(128, 8, seed)
    m = S.EngineModel(max_seqs=32, kv_tokens=2_000_000)
    res = S.compare_policies(reqs, pred, 8, m, seed=seed)
    ours = res["ours"]
    for name in ("fifo", "random"):
        assert ours.makespan < res[name].makespan, (name, res[name].makespan, ours.makespan)
        assert res[name].makespan >= res[name].lower_bound
    assert ours.makespan >= ours.lower_bound
    # every request finished, under every policy
    for r in res.values():
        assert (r.done_at > 0).all()


def test_reorder_hook_sees_pending_queue():
    seen = []

    def reorder(i, pending):
        assert isinstance(pending, deque)
        seen.append((i, list(pending)))

    m = S.EngineModel(step_s=1.0, per_seq_s=0.0, max_seqs=1, kv_tokens=100)
    S.simulate([S.Request(0, 1, 2), S.Request(0, 1, 3)], [[0, 1]], m, reorder=reorder)
    assert seen == [(0, [1]), (1, [])]
    assert np.isfinite(m.step_time(3))


def test_submission_plan_and_record_rollout():
    from compass_kernels.packing.schedule import record_rollout, submission_plan

    pred = S.LengthPredictor(default=100.0)
    record_rollout(pred, ["a", "a", "b"], [500, 700, 50])
    plan = submission_plan(["b", "a", "c", "a"], pred)
    # a: geometric mean of 500 and 700; c (new): mean of every length seen; b: 50
    assert plan.predicted[1] == pytest.approx((500 * 700) ** 0.5)
    assert plan.predicted[2] == pytest.approx((500 + 700 + 50) / 3)
    assert plan.order.tolist() == [1, 3, 2, 0]  # ties (the two a's) in input order
    assert plan.priority == [3, 0, 2, 1]  # each request's position in the order
    # a request already this long is never predicted shorter
    assert submission_plan(["b"], pred, generated=[900]).predicted[0] == 901
    with pytest.raises(ValueError, match="generated: expected 2 values"):
        submission_plan(["a", "b"], pred, generated=[1])
    with pytest.raises(ValueError, match="lengths: expected 2 values"):
        record_rollout(pred, ["a", "b"], [3])


def test_generate_length_aware_checks_the_engine():
    """mode="priority" refuses an engine that schedules first come, first
    served (vLLM would ignore the priorities); bad arguments name themselves.
    No vLLM needed: the engine is a stand-in."""
    from types import SimpleNamespace

    from compass_kernels.integration.vllm.rollout import generate_length_aware

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(policy="fcfs"))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg))
    pred = S.LengthPredictor()
    with pytest.raises(ValueError, match="needs an engine started with scheduling_policy"):
        generate_length_aware(llm, ["x"], None, prompt_keys=["k"], predictor=pred)
    with pytest.raises(ValueError, match="prompt_keys: expected 1 keys"):
        generate_length_aware(llm, ["x"], None, prompt_keys=[], predictor=pred)
    with pytest.raises(ValueError, match='mode: expected "priority" or "order"'):
        generate_length_aware(llm, ["x"], None, prompt_keys=["k"], predictor=pred, mode="fifo")
