"""The synthetic verifiable task of the reference RL loop, its reward model
stand-in, the reward composition with the advantage-inversion guard, and the
stage-2 penalties.

The task ("class majority"): a prompt is a run of random token ids; its *key*
is ``prompt[-1] % num_classes``. A response (the generated tokens minus a
final stop token) is correct when it has at least ``min_answer`` tokens and at
least ``ceil(pass_fraction * len)`` of them are in the key's class (``id %
num_classes == key``). A uniformly random policy passes a 16-token answer with
probability ~0.37 (4 classes, pass fraction 0.34), so rewards vary within a
group of samples, and some groups still come out all-wrong or all-right by
chance: zero-variance elimination has real work. A policy can learn it (put
mass on the key's class), so the reward curve can move.

Response lengths vary because a fixed random subset of the vocabulary
(``stop_fraction`` of it) are stop tokens, plus the engine's EOS; responses
that reach ``max_new_tokens`` are truncated (the overlong penalty's case).

The reward-model stand-in (:class:`RewardModel`) is a frozen random bag-of-
tokens scorer in [0, 1], uncorrelated with correctness, plus an optional
latency that stands in for a remote reward-model call (what the overlapped
scoring hides behind generation; the overlap itself is measured, never
assumed).

Composition (:func:`compose`): ``R = c * (1 + lam * g) + beta * (p_len +
p_rep)``. With ``lam * g >= 0``, ``beta * |p_len + p_rep| < 1`` a correct
response always scores above an incorrect one; :func:`guard` additionally
enforces it per group (an incorrect reward is capped at the group's lowest
correct reward minus a margin) and counts what it had to change. GRPO
advantages are an increasing affine map of the rewards within a group, so
ordered rewards give ordered advantages: no incorrect response gets a higher
advantage than a correct one of the same group. :func:`count_inversions`
counts the pairs that break this, for any advantages.

The graded pool (``make_prompts(..., task="graded")``, ``compass-rl --task
graded``): the same prompts, each given one of :data:`GRADED_LEVELS` (its own
class count, required fraction and shortest answer), so that a uniformly random
policy's pass probability spans ~0.02-0.93 across the pool instead of being
alike on every prompt; :func:`pass_probability` gives it exactly (what the
unit tests compare sampled pass rates with). Learning moves every level the
same way (more mass on the key's class), the hard levels the slowest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "GRADED_LEVELS",
    "Level",
    "Prompt",
    "RewardModel",
    "Scored",
    "TASKS",
    "TaskConfig",
    "compose",
    "count_inversions",
    "guard",
    "make_prompts",
    "naive_compose",
    "pass_probability",
    "repetition_penalty",
    "stop_tokens",
    "verify",
]


@dataclass(frozen=True)
class TaskConfig:
    """Sizes and constants of the task and its rewards."""

    vocab_size: int
    num_classes: int = 4
    min_prompt: int = 8
    max_prompt: int = 24
    max_new_tokens: int = 32
    stop_fraction: float = 1.0 / 12
    pass_fraction: float = 0.34
    min_answer: int = 4
    # reward composition
    lam: float = 0.5  # weight of the graded score (correct responses only)
    beta: float = 0.2  # weight of the stage-2 penalties (kept < 1/2: |p_len + p_rep| <= 2)
    naive_lam: float = 1.0  # the unguarded composition the inversion count compares with
    guard_margin: float = 0.05
    overlong_cache: int = 8  # DAPO soft-overlong window (cache_len)
    repetition_free: float = 0.2  # repeated-token fraction allowed before the penalty starts
    repetition_span: float = 0.3  # ... and the span over which it ramps to -1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_classes", "min_prompt", "max_new_tokens", "min_answer"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"TaskConfig.{name}: expected a positive int, got {v!r}")
        if self.max_prompt < self.min_prompt:
            raise ValueError(
                f"TaskConfig.max_prompt ({self.max_prompt}) < min_prompt ({self.min_prompt})"
            )
        if not 0.0 <= self.stop_fraction < 0.5:
            raise ValueError(
                f"TaskConfig.stop_fraction: expected in [0, 0.5), got {self.stop_fraction}"
            )
        if not 0 < self.overlong_cache <= self.max_new_tokens:
            raise ValueError(
                f"TaskConfig.overlong_cache: expected in (0, max_new_tokens={self.max_new_tokens}]"
                f", got {self.overlong_cache}"
            )
        if not 0 <= self.beta < 0.5:
            raise ValueError(
                f"TaskConfig.beta: expected in [0, 0.5) (keeps penalties below the correctness "
                f"gap), got {self.beta}"
            )


#: the prompt pools :func:`make_prompts` builds (``compass-rl --task``)
TASKS = ("majority", "graded")


@dataclass(frozen=True)
class Level:
    """One difficulty of the graded pool: a correct answer has at least ``min_answer``
    tokens, at least ``ceil(pass_fraction * len)`` of them in the key's class, the key
    being ``prompt[-1] % num_classes``."""

    min_answer: int
    pass_fraction: float
    num_classes: int


#: The graded pool's levels, easiest first. A uniformly random policy over the tiny
#: model's 1,024 ids (85 of them stop tokens) passes them with probability ~0.93,
#: 0.78, 0.53, 0.32, 0.16, 0.12, 0.05, 0.02 (answers of at most 16 or 32 tokens; exact
#: values: :func:`pass_probability`); answers that run to the length cap (what the
#: tiny model mostly writes) pass them with ~1.0, 0.96, 0.60, 0.37, 0.19, 0.13, 0.04,
#: 0.002 at 16 tokens.
GRADED_LEVELS: tuple[Level, ...] = (
    Level(0, 0.10, 2),
    Level(1, 0.30, 2),
    Level(1, 0.20, 4),
    Level(2, 0.30, 4),
    Level(4, 0.34, 4),
    Level(4, 0.25, 8),
    Level(4, 0.30, 8),
    Level(4, 0.40, 8),
)


@dataclass(frozen=True)
class Prompt:
    """One prompt of the pool: its index (the length predictor's key) and token ids;
    ``level`` (graded pool only) overrides the task's class count, pass fraction and
    shortest answer for this prompt."""

    index: int
    token_ids: tuple[int, ...]
    level: Level | None = None

    @property
    def key(self) -> int:
        return self.token_ids[-1]

    def rule(self, cfg: TaskConfig) -> Level:
        """(min_answer, pass_fraction, num_classes) this prompt is verified with."""
        if self.level is not None:
            return self.level
        return Level(cfg.min_answer, cfg.pass_fraction, cfg.num_classes)


def make_prompts(
    cfg: TaskConfig, count: int, *, seed: int, special: int = 3, task: str = "majority"
) -> list[Prompt]:
    """A deterministic pool of ``count`` prompts (ids in [special, vocab), random lengths).

    ``task="graded"``: the same token ids, each prompt given a level of
    :data:`GRADED_LEVELS` (every level ``count // len(GRADED_LEVELS)`` or one more
    times, in a seeded random order)."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    rng = np.random.default_rng([seed, 1])
    levels: list[Level | None] = [None] * count
    if task == "graded":
        order = np.random.default_rng([seed, 3]).permutation(count)
        levels = [GRADED_LEVELS[int(j) % len(GRADED_LEVELS)] for j in order]
    out = []
    for i in range(count):
        n = int(rng.integers(cfg.min_prompt, cfg.max_prompt + 1))
        ids = rng.integers(special, cfg.vocab_size, size=n)
        out.append(Prompt(i, tuple(int(x) for x in ids), levels[i]))
    return out


def stop_tokens(cfg: TaskConfig, *, seed: int, special: int = 3) -> list[int]:
    """The fixed random set of stop token ids (``stop_fraction`` of the vocabulary)."""
    rng = np.random.default_rng([seed, 2])
    k = int(round(cfg.stop_fraction * cfg.vocab_size))
    if k == 0:
        return []
    return sorted(int(x) for x in rng.choice(np.arange(special, cfg.vocab_size), k, replace=False))


def _answer(response: tuple[int, ...] | list[int], stops: frozenset[int]) -> list[int]:
    resp = list(response)
    if resp and resp[-1] in stops:
        resp = resp[:-1]
    return resp


def verify(cfg: TaskConfig, prompt: Prompt, response, stops: frozenset[int]) -> tuple[bool, int]:
    """(correct, answer length) of one response (the verifiable signal)."""
    ans = _answer(response, stops)
    rule = prompt.rule(cfg)
    if len(ans) < rule.min_answer:
        return False, len(ans)
    key = prompt.key % rule.num_classes
    hits = sum(1 for t in ans if t % rule.num_classes == key)
    return hits >= math.ceil(rule.pass_fraction * len(ans)), len(ans)


def pass_probability(cfg: TaskConfig, prompt: Prompt, stops: frozenset[int] | set[int]) -> float:
    """Exact probability that :func:`verify` passes a response of the uniformly random
    policy: every token uniform over ``[0, cfg.vocab_size)``, the response ending at the
    first token of ``stops`` (kept, then stripped from the answer) or after
    ``cfg.max_new_tokens`` tokens.

    The answer has length L < max_new_tokens with probability q^L (1 - q) (q: the
    non-stop share of the vocabulary), max_new_tokens with q^max_new_tokens; given L,
    its key-class hits are Binomial(L, h) (h: the key class's share of the non-stop
    ids)."""
    stop = [t for t in stops if 0 <= t < cfg.vocab_size]
    if len(set(stop)) >= cfg.vocab_size:
        raise ValueError("stops: expected some non-stop token ids, got the whole vocabulary")
    rule = prompt.rule(cfg)
    key = prompt.key % rule.num_classes
    ids = np.arange(cfg.vocab_size)
    non_stop = np.ones(cfg.vocab_size, dtype=bool)
    non_stop[list(set(stop))] = False
    q = float(non_stop.mean())
    h = float(((ids % rule.num_classes == key) & non_stop).sum() / non_stop.sum())
    total = 0.0
    for length in range(rule.min_answer, cfg.max_new_tokens + 1):
        p_len = q**length * (1.0 - q) if length < cfg.max_new_tokens else q**length
        need = math.ceil(rule.pass_fraction * length)
        p_hits = sum(
            math.comb(length, k) * h**k * (1.0 - h) ** (length - k) for k in range(need, length + 1)
        )
        total += p_len * p_hits
    return total


def repetition_penalty(cfg: TaskConfig, response, stops: frozenset[int]) -> float:
    """In [-1, 0]: 0 while the fraction of repeated tokens is <= repetition_free, then a
    linear ramp to -1 over repetition_span (a degenerate, looping answer)."""
    ans = _answer(response, stops)
    if not ans:
        return 0.0
    repeated = 1.0 - len(set(ans)) / len(ans)
    excess = (repeated - cfg.repetition_free) / cfg.repetition_span
    return -float(min(1.0, max(0.0, excess)))


class RewardModel:
    """Frozen random bag-of-tokens scorer in [0, 1] (a reward-model stand-in).

    ``latency_s`` sleeps per call, standing in for a remote reward-model
    service round trip (a sleep releases the GIL, as waiting on a socket would).
    """

    def __init__(self, vocab_size: int, *, dim: int = 32, seed: int = 0, latency_s: float = 0.0):
        if latency_s < 0:
            raise ValueError(f"latency_s: expected >= 0, got {latency_s}")
        g = torch.Generator().manual_seed(seed + 7919)
        self.emb = torch.randn(vocab_size, dim, generator=g)
        self.w = torch.randn(dim, generator=g) * 4.0
        self.latency_s = latency_s

    def __call__(self, response) -> float:
        if self.latency_s:
            time.sleep(self.latency_s)
        if not len(response):
            return 0.5
        ids = torch.as_tensor(list(response), dtype=torch.int64)
        z = self.emb[ids].mean(0) @ self.w
        return float(torch.sigmoid(z))


@dataclass
class Scored:
    """The reward pieces of one response (what the worker pool returns)."""

    correct: bool
    answer_len: int
    grade: float
    rep_penalty: float
    started: float  # perf_counter at scoring start / end (overlap accounting)
    finished: float


def compose(cfg: TaskConfig, correct, grade, len_penalty, rep_penalty) -> torch.Tensor:
    """Guarded composition, float64 [n]: ``c * (1 + lam * g) + beta * (p_len + p_rep)``.

    Correct responses score >= 1 - 2 * beta > 0 >= any incorrect response's
    score, for grades in [0, 1] and penalties in [-1, 0]."""
    c = torch.as_tensor(correct, dtype=torch.float64)
    g = torch.as_tensor(grade, dtype=torch.float64)
    pen = torch.as_tensor(len_penalty, dtype=torch.float64) + torch.as_tensor(
        rep_penalty, dtype=torch.float64
    )
    return c * (1.0 + cfg.lam * g) + cfg.beta * pen


def naive_compose(cfg: TaskConfig, correct, grade, len_penalty, rep_penalty) -> torch.Tensor:
    """The unguarded sum ``c + naive_lam * g + p_len + p_rep`` (what the guard fixes):
    a well-graded or shorter incorrect answer can outscore a correct one."""
    c = torch.as_tensor(correct, dtype=torch.float64)
    g = torch.as_tensor(grade, dtype=torch.float64)
    pen = torch.as_tensor(len_penalty, dtype=torch.float64) + torch.as_tensor(
        rep_penalty, dtype=torch.float64
    )
    return c + cfg.naive_lam * g + pen


def guard(rewards: torch.Tensor, correct, group_ids, *, margin: float) -> tuple[torch.Tensor, int]:
    """Cap each incorrect reward at (lowest correct reward of its group) - margin.

    Returns (guarded rewards [n] float64, number of rewards the cap changed)."""
    r = rewards.to(torch.float64)
    c = torch.as_tensor(correct, dtype=torch.bool)
    gid = torch.as_tensor(group_ids, dtype=torch.int64)
    _, inv = torch.unique(gid, return_inverse=True)
    big = torch.full((int(inv.max()) + 1 if inv.numel() else 0,), float("inf"), dtype=torch.float64)
    min_correct = big.scatter_reduce(0, inv[c], r[c], reduce="amin", include_self=True)
    cap = min_correct[inv] - margin
    capped = ~c & (r > cap)
    return torch.where(capped, cap, r), int(capped.sum())


def count_inversions(advantages, correct, group_ids, *, tol: float = 1e-9) -> int:
    """Pairs (incorrect i, correct j) of one group with A_i > A_j + tol."""
    a = np.asarray(torch.as_tensor(advantages, dtype=torch.float64))
    c = np.asarray(correct, dtype=bool)
    g = np.asarray(group_ids)
    total = 0
    for gid in np.unique(g):
        sel = g == gid
        bad, good = a[sel & ~c], a[sel & c]
        if bad.size and good.size:
            total += int((bad[:, None] > good[None, :] + tol).sum())
    return total
