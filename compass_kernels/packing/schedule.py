"""Length-aware rollout scheduling (ck.packing.schedule).

Rollout time is set by the longest responses: a long-tailed length
distribution leaves engines idle while a few sequences finish. This module

- predicts each request's response length (:class:`LengthPredictor`): from the
  prompt's past lengths, from its siblings already finished in this step
  (responses to one prompt have similar lengths), with a fallback for new
  prompts;
- orders and places requests (:func:`longest_first`, :func:`lpt_assign`), and
  over-provisions groups with partial-rollout carry-over
  (:func:`over_provision`);
- simulates rollout makespan (:func:`simulate`) on engines whose token
  throughput depends on the number of running sequences and their KV memory,
  to compare FIFO, random and length-aware submission with the lower bound.

Host-side Python: a few thousand requests per step, once per step.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from compass_kernels._validate import as_float, as_int

__all__ = [
    "EngineModel",
    "LengthPredictor",
    "Request",
    "SimResult",
    "SubmissionPlan",
    "record_rollout",
    "submission_plan",
    "longest_first",
    "lpt_assign",
    "compare_policies",
    "over_provision",
    "round_robin",
    "simulate",
    "synthetic_workload",
]


# ------------------------------------------------------------------ predictor


class LengthPredictor:
    """Per-prompt response-length predictor.

    predict(p) = geometric mean of the lengths of p's siblings finished in the
    current step when there are any (weight ``sibling_weight`` against the
    history), else the geometric mean of p's last ``history`` lengths, else the
    fallback: the arithmetic mean of the last 4096 lengths observed (``default``
    before any). A running request is never predicted shorter than what it has
    already generated (``predict(..., generated=)``).

    Geometric means: lengths are long-tailed (roughly lognormal), so the log
    scale averages them without letting one long sample dominate. The
    fallback is the arithmetic mean on purpose (not a median): a prompt never
    seen carries no per-prompt signal, and its prediction feeds token budgets
    (``ck.advantages.token_costs``), where the sum of expected lengths is what
    the budget spends; the median of a long-tailed distribution under-counts it.
    """

    def __init__(self, *, history: int = 8, sibling_weight: float = 0.75, default: float = 2048.0):
        history = as_int("history", history, lo=1)
        sibling_weight = as_float("sibling_weight", sibling_weight)
        if not 0.0 <= sibling_weight <= 1.0:
            raise ValueError(f"sibling_weight: expected in [0, 1], got {sibling_weight}")
        default = as_float("default", default)
        if default < 1:
            raise ValueError(f"default: expected a length >= 1, got {default}")
        self.history = history
        self.sibling_weight = sibling_weight
        self.default = default
        self._past: dict[Hashable, deque] = {}  # last `history` log-lengths per prompt
        self._past_mean: dict[Hashable, float] = {}
        self._step: dict[Hashable, list[float]] = {}  # [sum of logs, count] this step
        self._all: deque = deque(maxlen=4096)
        self._fallback: float | None = None

    def observe(self, prompt: Hashable, length: float) -> None:
        """A response to ``prompt`` finished with ``length`` tokens in this step (a
        finite number >= 1: NaN / Inf would poison every later prediction)."""
        length = as_float("length", length)
        if length < 1:
            raise ValueError(f"length: expected >= 1, got {length}")
        acc = self._step.setdefault(prompt, [0.0, 0])
        acc[0] += math.log(length)
        acc[1] += 1
        self._all.append(length)
        self._fallback = None

    def end_step(self) -> None:
        """Fold this step's lengths into each prompt's history."""
        for prompt, (total, count) in self._step.items():
            past = self._past.setdefault(prompt, deque(maxlen=self.history))
            past.extend([total / count] * int(count))  # count: an int kept as a float
            self._past_mean[prompt] = float(np.mean(past))
        self._step.clear()

    def fallback(self) -> float:
        """The estimate for a prompt never seen: the mean of the last 4096 recorded
        lengths, or ``default``."""
        if self._fallback is None:
            self._fallback = float(np.mean(self._all)) if self._all else self.default
        return self._fallback

    def predict(self, prompt: Hashable, generated: int = 0) -> float:
        """Predicted response length (tokens, float) of ``prompt`` that has ``generated`` so far."""
        past = self._past_mean.get(prompt)
        acc = self._step.get(prompt)
        if acc:
            est = acc[0] / acc[1]
            if past is not None:
                w = self.sibling_weight
                est = w * est + (1 - w) * past
            guess = math.exp(est)
        elif past is not None:
            guess = math.exp(past)
        else:
            guess = self.fallback()
        return max(guess, float(generated) + 1.0)

    def predict_many(self, prompts: Sequence[Hashable]) -> np.ndarray:
        """[len(prompts)] float64 array of :meth:`predict` for each prompt."""
        return np.array([self.predict(p) for p in prompts], dtype=np.float64)


# ------------------------------------------------------------------- policies


def longest_first(predicted: Sequence[float] | np.ndarray) -> np.ndarray:
    """Submission order: longest predicted first (stable for ties)."""
    return np.argsort(-np.asarray(predicted, dtype=np.float64), kind="stable")


def lpt_assign(predicted: Sequence[float] | np.ndarray, num_engines: int) -> list[list[int]]:
    """Requests -> engines: longest predicted first onto the engine with the least
    predicted work (LPT); each engine's list is in submission order (longest first)."""
    if num_engines < 1:
        raise ValueError(f"num_engines: expected >= 1, got {num_engines}")
    p = np.asarray(predicted, dtype=np.float64)
    heap = [(0.0, e) for e in range(num_engines)]
    out: list[list[int]] = [[] for _ in range(num_engines)]
    for i in longest_first(p):
        load, e = heapq.heappop(heap)
        out[e].append(int(i))
        heapq.heappush(heap, (load + p[i], e))
    return out


def over_provision(num_groups: int, *, extra: float = 0.25, carried: int = 0) -> int:
    """Groups to submit so that ``num_groups`` finish early: ``extra`` more
    (rounded up), less the groups carried over unfinished from the last step
    (partial rollout: they resume where they stopped and count first)."""
    if num_groups < 1 or extra < 0 or carried < 0:
        raise ValueError(
            f"num_groups >= 1, extra >= 0, carried >= 0 expected, got {num_groups}, {extra}, "
            f"{carried}"
        )
    return max(0, math.ceil(num_groups * (1 + extra)) - carried)


# ------------------------------------------------- engine-facing submission API


@dataclass(frozen=True)
class SubmissionPlan:
    """How to submit one rollout step's requests to an inference engine.

    order : [n] int64, request indices, longest predicted first (ties: input
        order). Submit in this order to an engine that schedules first come,
        first served (vLLM's default policy).
    priority : [n] ints, per request in input order: its position in
        ``order``. vLLM with ``scheduling_policy="priority"`` runs the lowest
        value first (ties by arrival): ``llm.generate(prompts, params,
        priority=plan.priority)`` keeps the caller's order and runs ours.
    predicted : [n] float64, the predicted response lengths.
    """

    order: np.ndarray
    priority: list[int]
    predicted: np.ndarray


def submission_plan(
    prompt_keys: Sequence[Hashable],
    predictor: LengthPredictor,
    generated: Sequence[int] | None = None,
) -> SubmissionPlan:
    """Longest-predicted-first submission for requests ``prompt_keys`` (one key
    per request; the n samples of one prompt share its key).

    ``generated``: tokens each request already produced (partial rollout
    carry-over), a floor under its prediction.
    """
    n = len(prompt_keys)
    if generated is not None and len(generated) != n:
        raise ValueError(f"generated: expected {n} values (one per request), got {len(generated)}")
    if generated is None:
        predicted = predictor.predict_many(prompt_keys)
    else:
        predicted = np.array(
            [predictor.predict(k, int(g)) for k, g in zip(prompt_keys, generated, strict=True)],
            dtype=np.float64,
        )
    order = longest_first(predicted)
    priority = np.empty(n, dtype=np.int64)
    priority[order] = np.arange(n)
    return SubmissionPlan(order=order, priority=priority.tolist(), predicted=predicted)


def record_rollout(
    predictor: LengthPredictor,
    prompt_keys: Sequence[Hashable],
    lengths: Sequence[int],
    *,
    end_step: bool = True,
) -> None:
    """After a rollout: feed each request's observed response length (tokens
    generated, >= 1) to ``predictor`` and, by default, close the step (the
    lengths join each prompt's history)."""
    if len(lengths) != len(prompt_keys):
        raise ValueError(
            f"lengths: expected {len(prompt_keys)} values (one per request), got {len(lengths)}"
        )
    for key, length in zip(prompt_keys, lengths, strict=True):
        predictor.observe(key, int(length))
    if end_step:
        predictor.end_step()


# ------------------------------------------------------------------ simulator


@dataclass(frozen=True)
class EngineModel:
    """One inference engine: a decode step of R running sequences takes
    ``step_s + per_seq_s * R`` seconds and advances each by one token (memory-
    bound decode: weights read once per step, KV per sequence). At most
    ``max_seqs`` run at once and their KV (prompt + generated tokens) fits in
    ``kv_tokens``; a sequence that would overflow it is preempted (newest
    first) and recomputed later, losing its progress, as vLLM does."""

    step_s: float = 0.02
    per_seq_s: float = 1e-4
    max_seqs: int = 256
    kv_tokens: int = 1_000_000

    def step_time(self, running: int) -> float:
        """Seconds of one decode step with ``running`` sequences."""
        return self.step_s + self.per_seq_s * running


@dataclass
class Request:
    prompt: Hashable
    prompt_len: int
    length: int  # true response length (unknown to the scheduler)
    group: int = 0


@dataclass
class SimResult:
    makespan: float
    finish: np.ndarray  # [engines] time each engine went idle
    idle_fraction: float  # mean over engines of (makespan - finish) / makespan
    lower_bound: float
    preemptions: int
    done_at: np.ndarray  # [requests] completion time


def _run_engine(
    queue: list[int], reqs: Sequence[Request], model: EngineModel, done_at, reorder=None
) -> tuple[float, int]:
    """Event-driven: between events every running sequence advances the same
    number of steps. Returns (finish time, preemptions)."""
    t, preempt = 0.0, 0
    pending = deque(queue)
    running: list[list[int]] = []  # [request, generated]
    hold = False  # after a preemption, admit nothing until a sequence finishes
    while pending or running:
        kv = sum(reqs[i].prompt_len + g for i, g in running)
        while pending and len(running) < model.max_seqs and not (hold and running):
            i = pending[0]
            if kv + reqs[i].prompt_len + 1 > model.kv_tokens and running:
                break
            pending.popleft()
            running.append([i, 0])
            kv += reqs[i].prompt_len
        R = len(running)
        left = min(reqs[i].length - g for i, g in running)
        room = (model.kv_tokens - kv) // R  # steps until the KV is full
        steps = min(left, room)
        if steps <= 0:  # preempt the newest: back to the queue front, progress lost
            i, _ = running.pop()
            pending.appendleft(i)
            preempt += 1
            hold = True
            continue
        t += steps * model.step_time(R)
        for r in running:
            r[1] += steps
        still = []
        for i, g in running:
            if g >= reqs[i].length:
                done_at[i] = t
                hold = False
                if reorder is not None:
                    reorder(i, pending)
            else:
                still.append([i, g])
        running = still
    return t, preempt


def simulate(
    requests: Sequence[Request],
    assignment: Sequence[Sequence[int]],
    model: EngineModel = EngineModel(),
    *,
    reorder=None,
) -> SimResult:
    """Run each engine's queue (``assignment[e]``, in submission order).

    ``reorder(i, pending)``: called when request i finishes, may reorder the
    engine's pending deque in place (sibling-aware re-prediction).

    Lower bound: max(the longest request decoded alone, the total tokens over
    every engine at its best throughput max_seqs / step_time(max_seqs)).
    """
    for i, r in enumerate(requests):
        if r.length < 1 or r.prompt_len + r.length > model.kv_tokens:
            raise ValueError(
                f"requests[{i}]: expected 1 <= length and prompt_len + length <= kv_tokens = "
                f"{model.kv_tokens}, got prompt_len {r.prompt_len}, length {r.length}"
            )
    done_at = np.zeros(len(requests))
    finished: list[float] = []
    pre = 0
    for queue in assignment:
        f, p = _run_engine(list(queue), requests, model, done_at, reorder)
        finished.append(f)
        pre += p
    finish = np.array(finished)
    makespan = float(finish.max())
    total = sum(r.length for r in requests)
    best_rate = model.max_seqs / model.step_time(model.max_seqs)
    lb = max(
        max(r.length for r in requests) * model.step_time(1), total / (len(assignment) * best_rate)
    )
    idle = float(np.mean((makespan - finish) / makespan)) if makespan > 0 else 0.0
    return SimResult(makespan, finish, idle, lb, pre, done_at)


def round_robin(order: Iterable[int], num_engines: int) -> list[list[int]]:
    """Request i of ``order`` to engine i % num_engines (how a FIFO front end spreads load)."""
    out: list[list[int]] = [[] for _ in range(num_engines)]
    for k, i in enumerate(order):
        out[k % num_engines].append(int(i))
    return out


# ------------------------------------------------------- workloads, comparison


def synthetic_workload(
    num_prompts: int,
    samples: int,
    seed: int,
    *,
    mu: float = 8.0,
    sigma: float = 1.1,
    sibling_sigma: float = 0.3,
    new_fraction: float = 0.25,
    history_steps: int = 2,
) -> tuple[list[Request], LengthPredictor]:
    """An RL rollout step: ``num_prompts`` prompts x ``samples`` responses.

    Each prompt has a typical length (lognormal(mu, sigma)); its responses
    scatter around it (lognormal, ``sibling_sigma``); lengths are clipped to
    100..65536. The returned predictor has seen ``history_steps`` earlier
    steps of every prompt but a ``new_fraction`` of new ones."""
    g = np.random.default_rng(seed)
    typical = np.exp(g.normal(mu, sigma, num_prompts))
    clip = lambda x: np.clip(x, 100, 65536).astype(np.int64)  # noqa: E731
    pred = LengthPredictor()
    new = g.random(num_prompts) < new_fraction
    for _ in range(history_steps):
        for p in np.flatnonzero(~new):
            for v in clip(typical[p] * np.exp(g.normal(0, sibling_sigma, samples))):
                pred.observe(int(p), int(v))
        pred.end_step()
    prompt_len = clip(np.exp(g.normal(6, 0.5, num_prompts)))
    reqs = []
    for p in range(num_prompts):
        for v in clip(typical[p] * np.exp(g.normal(0, sibling_sigma, samples))):
            reqs.append(Request(p, int(prompt_len[p]), int(v), group=p))
    return reqs, pred


def compare_policies(
    requests: Sequence[Request],
    predictor: LengthPredictor,
    num_engines: int,
    model: EngineModel = EngineModel(),
    seed: int = 0,
) -> dict[str, SimResult]:
    """FIFO (dataset order, round robin), random (shuffled, round robin) and ours:
    LPT across engines on predicted lengths, longest predicted first, queues
    re-ordered as siblings finish (their lengths sharpen the prediction)."""
    n = len(requests)
    out = {
        "fifo": simulate(requests, round_robin(range(n), num_engines), model),
        "random": simulate(
            requests, round_robin(np.random.default_rng(seed).permutation(n), num_engines), model
        ),
    }
    prompts = [r.prompt for r in requests]
    assignment = lpt_assign(predictor.predict_many(prompts), num_engines)

    def reorder(i: int, pending: deque) -> None:
        prompt = requests[i].prompt
        predictor.observe(prompt, requests[i].length)
        if pending:
            items = sorted(pending, key=lambda j: -predictor.predict(requests[j].prompt))
            pending.clear()
            pending.extend(items)

    out["ours"] = simulate(requests, assignment, model, reorder=reorder)
    predictor.end_step()
    return out
