"""Length-aware rollout submission for vLLM (ck.packing.schedule wired in).

One call per rollout step::

    from compass_kernels.packing.schedule import LengthPredictor
    from compass_kernels.integration.vllm.rollout import generate_length_aware

    predictor = LengthPredictor()          # keep it across steps
    result = generate_length_aware(llm, prompts, params, prompt_keys=keys,
                                   predictor=predictor)
    result.outputs                         # vLLM's RequestOutputs, in the caller's order

``prompt_keys`` names each request's prompt (the n samples of one prompt
share a key: they are predicted alike, and their lengths inform each other).
The step's requests go to vLLM longest predicted first, then the observed
lengths update the predictor (:func:`compass_kernels.packing.schedule.record_rollout`).

Two ways to make vLLM run that order:

- ``mode="priority"``: the engine was started with
  ``scheduling_policy="priority"``; each request gets its position in our order
  as its priority (vLLM runs lower values first; ties by arrival). Prompts stay
  in the caller's order.
- ``mode="order"``: any engine (first come, first served, vLLM's default):
  the prompts are submitted in our order and the outputs put back.

What vLLM actually ran is readable from its per-request metrics when the
engine keeps them (``disable_log_stats=False``): :func:`scheduled_order`
sorts the requests by the engine-core timestamp of their first scheduling.
vLLM is never imported here: the engine and its outputs are passed in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from compass_kernels.packing.schedule import (
    LengthPredictor,
    SubmissionPlan,
    record_rollout,
    submission_plan,
)

__all__ = ["RolloutResult", "engine_policy", "generate_length_aware", "scheduled_order"]


@dataclass
class RolloutResult:
    """outputs: vLLM's RequestOutputs in the caller's order; plan: the order and
    priorities used; lengths: tokens generated per request (first completion)."""

    outputs: list[Any]
    plan: SubmissionPlan
    lengths: list[int]


def engine_policy(llm: Any) -> str:
    """The scheduling policy of a ``vllm.LLM`` ("fcfs" or "priority")."""
    return str(llm.llm_engine.vllm_config.scheduler_config.policy)


def generate_length_aware(
    llm: Any,
    prompts: Sequence[Any],
    sampling_params: Any,
    *,
    prompt_keys: Sequence[Hashable],
    predictor: LengthPredictor,
    mode: str = "priority",
    update: bool = True,
    **generate_kwargs: Any,
) -> RolloutResult:
    """Generate ``prompts`` with vLLM, longest predicted response first.

    Parameters
    ----------
    llm : vllm.LLM
    prompts : what ``llm.generate`` takes (strings, token-id dicts, ...), one per request.
    sampling_params : one ``SamplingParams`` or one per request (caller's order).
    prompt_keys : one hashable per request, shared by the samples of one prompt.
    predictor : the :class:`LengthPredictor` kept across steps.
    mode : "priority" (needs ``scheduling_policy="priority"``) or "order".
    update : feed the observed lengths to ``predictor`` and end its step.
    generate_kwargs : passed to ``llm.generate`` (e.g. ``use_tqdm``).
    """
    n = len(prompts)
    if len(prompt_keys) != n:
        raise ValueError(f"prompt_keys: expected {n} keys (one per prompt), got {len(prompt_keys)}")
    if mode not in ("priority", "order"):
        raise ValueError(f'mode: expected "priority" or "order", got {mode!r}')
    per_request = isinstance(sampling_params, Sequence)
    if per_request and len(sampling_params) != n:
        raise ValueError(
            f"sampling_params: expected one or {n} (one per prompt), got {len(sampling_params)}"
        )
    if "priority" in generate_kwargs:
        raise ValueError("priority: set by generate_length_aware (its plan's priorities)")
    plan = submission_plan(prompt_keys, predictor)
    if mode == "priority":
        policy = engine_policy(llm)
        if policy != "priority":
            raise ValueError(
                'mode="priority" needs an engine started with scheduling_policy="priority", '
                f'this one schedules "{policy}" (or use mode="order")'
            )
        outputs = list(
            llm.generate(list(prompts), sampling_params, priority=plan.priority, **generate_kwargs)
        )
    else:
        order = plan.order.tolist()
        params = [sampling_params[i] for i in order] if per_request else sampling_params
        ran = llm.generate([prompts[i] for i in order], params, **generate_kwargs)
        outputs = [None] * n
        for pos, i in enumerate(order):
            outputs[i] = ran[pos]
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    if update:
        record_rollout(predictor, prompt_keys, [max(v, 1) for v in lengths])
    return RolloutResult(outputs=outputs, plan=plan, lengths=lengths)


def scheduled_order(outputs: Sequence[Any]) -> list[int]:
    """Indices of ``outputs`` by the time vLLM first scheduled each request
    (``RequestOutput.metrics.scheduled_ts``, engine-core monotonic time; ties,
    requests admitted in the same step, by index). Needs an engine started with
    ``disable_log_stats=False`` (otherwise vLLM keeps no per-request metrics)."""
    ts = []
    for i, o in enumerate(outputs):
        m = getattr(o, "metrics", None)
        if m is None or not getattr(m, "scheduled_ts", 0.0):
            raise ValueError(
                f"outputs[{i}] carries no scheduling timestamp: start the engine with "
                "disable_log_stats=False"
            )
        ts.append((m.scheduled_ts, i))
    return [i for _, i in sorted(ts)]
