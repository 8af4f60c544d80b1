"""compass-rl's graded prompt pool (``task.make_prompts(task="graded")``, ``--task graded``):
per-prompt levels, the exact pass probability of a uniformly random policy against a
sampled one, and the span of difficulties. Fast, no engines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from compass_kernels.integration.rl import task as T

CFG = T.TaskConfig(vocab_size=1024, max_new_tokens=16, overlong_cache=4)


def _random_response(rng: np.random.Generator, cfg: T.TaskConfig, stops: frozenset[int]):
    """The uniformly random policy: ids uniform over the vocabulary until a stop token
    (kept) or max_new_tokens."""
    ids = rng.integers(0, cfg.vocab_size, size=cfg.max_new_tokens)
    out = []
    for t in ids.tolist():
        out.append(t)
        if t in stops:
            break
    return tuple(out)


def test_graded_pool_keeps_the_ids_and_balances_the_levels():
    plain = T.make_prompts(CFG, 40, seed=3)
    graded = T.make_prompts(CFG, 40, seed=3, task="graded")
    assert [p.token_ids for p in plain] == [p.token_ids for p in graded]
    assert all(p.level is None for p in plain)
    counts = {lv: sum(p.level == lv for p in graded) for lv in T.GRADED_LEVELS}
    assert set(counts.values()) == {40 // len(T.GRADED_LEVELS)}  # 40 = 5 x 8 levels
    assert T.make_prompts(CFG, 40, seed=3, task="graded") == graded  # deterministic
    assert [p.level for p in T.make_prompts(CFG, 40, seed=4, task="graded")] != [
        p.level for p in graded
    ]
    with pytest.raises(ValueError, match="task: expected one of"):
        T.make_prompts(CFG, 4, seed=0, task="hard")


def test_verify_uses_the_prompt_level():
    stops = frozenset({999})
    lv = T.Level(min_answer=2, pass_fraction=0.5, num_classes=8)
    prompt = T.Prompt(0, (5, 6, 7, 11), lv)  # key 11 % 8 = 3
    assert T.verify(CFG, prompt, (3, 11, 1, 2, 999), stops) == (True, 4)  # 2 of 4 in class 3
    assert T.verify(CFG, prompt, (3, 1, 2, 4, 999), stops) == (False, 4)  # 1 of 4
    assert T.verify(CFG, prompt, (3, 999), stops) == (False, 1)  # shorter than min_answer
    # the same answer under the task's own rule (4 classes, key 11 % 4 = 3, 0.34, >= 4)
    plain = T.Prompt(0, (5, 6, 7, 11))
    assert T.verify(CFG, plain, (3, 7, 1, 2, 999), stops) == (True, 4)
    assert T.verify(CFG, plain, (3, 1, 2, 4, 999), stops) == (False, 4)
    assert plain.rule(CFG) == T.Level(CFG.min_answer, CFG.pass_fraction, CFG.num_classes)


def test_pass_probability_by_hand():
    """Two ids, one a stop token, answers of at most 2 tokens, 1 class: a response is
    'stop' (answer 0), 'a stop' (1) or 'a a' (2), probabilities 1/2, 1/4, 1/4."""
    cfg = T.TaskConfig(vocab_size=2, max_new_tokens=2, overlong_cache=1, min_answer=1)
    stops = frozenset({1})
    for lv, want in (
        (T.Level(0, 0.0, 1), 1.0),
        (T.Level(1, 0.0, 1), 0.5),
        (T.Level(2, 0.0, 1), 0.25),
        (T.Level(1, 1.0, 2), 0.0),  # key 0 % 2 = 0: id 0 hits; key 1: no non-stop id hits
    ):
        got = T.pass_probability(cfg, T.Prompt(0, (1,), lv), stops)
        assert got == pytest.approx(want), lv
    # key 0 of 2 classes: the one non-stop id (0) is in the key's class: always a hit
    assert T.pass_probability(cfg, T.Prompt(0, (0,), T.Level(1, 1.0, 2)), stops) == 0.5
    with pytest.raises(ValueError, match="stops"):
        T.pass_probability(cfg, T.Prompt(0, (0,)), frozenset({0, 1}))


@pytest.mark.parametrize("max_new", [16, 32])
def test_pass_probability_matches_sampling(max_new):
    """The exact probability against 4,000 sampled random responses per level (and the
    default rule): within 4.5 standard errors."""
    cfg = T.TaskConfig(vocab_size=1024, max_new_tokens=max_new, overlong_cache=4)
    stops = frozenset(T.stop_tokens(cfg, seed=0))
    rng = np.random.default_rng([max_new, 7])
    prompts = [T.Prompt(i, (17 + i,), lv) for i, lv in enumerate(T.GRADED_LEVELS)]
    prompts.append(T.Prompt(99, (21,)))
    draws = 4000
    for p in prompts:
        exact = T.pass_probability(cfg, p, stops)
        hits = sum(
            T.verify(cfg, p, _random_response(rng, cfg, stops), stops)[0] for _ in range(draws)
        )
        se = math.sqrt(max(exact * (1 - exact), 1e-4) / draws)
        assert abs(hits / draws - exact) < 4.5 * se, (p.level, hits / draws, exact)


@pytest.mark.parametrize("max_new", [16, 32])
def test_graded_levels_span_difficulty(max_new):
    """A uniformly random policy passes the easiest level ~0.93 of the time and the
    hardest ~0.02, levels strictly ordered; the task's single rule sits at one value."""
    cfg = T.TaskConfig(vocab_size=1024, max_new_tokens=max_new, overlong_cache=4)
    stops = frozenset(T.stop_tokens(cfg, seed=0))
    pool = T.make_prompts(cfg, 64, seed=0, task="graded")
    rates = np.array([T.pass_probability(cfg, p, stops) for p in pool])
    assert rates.min() < 0.025 and rates.max() > 0.9
    by_level = [
        np.mean([r for p, r in zip(pool, rates, strict=True) if p.level == lv])
        for lv in T.GRADED_LEVELS
    ]
    assert all(a > b for a, b in zip(by_level, by_level[1:], strict=False)), by_level
    # at least 5 of 8 levels give a random policy's group of 4 an even chance of being
    # informative (both outcomes), against the single rule's one pass rate for all
    informative = [1 - r**4 - (1 - r) ** 4 for r in by_level]
    assert sum(x > 0.2 for x in informative) >= 5
    plain = [T.pass_probability(cfg, p, stops) for p in T.make_prompts(cfg, 64, seed=0)]
    assert max(plain) - min(plain) < 0.05


def test_learning_the_key_class_raises_every_level():
    """A policy that puts more mass on the key's class passes every level more often (what
    training moves): the exact probability with the key class's share raised."""
    cfg = T.TaskConfig(vocab_size=1024, max_new_tokens=16, overlong_cache=4)
    stops = frozenset(T.stop_tokens(cfg, seed=0))
    rng = np.random.default_rng(0)
    for i, lv in enumerate(T.GRADED_LEVELS):
        p = T.Prompt(i, (40 + i,), lv)
        key = p.key % lv.num_classes
        base = T.pass_probability(cfg, p, stops)
        hits = 0
        for _ in range(1500):  # half the tokens from the key's class, the rest uniform
            resp = list(_random_response(rng, cfg, stops))
            body = resp[:-1] if resp and resp[-1] in stops else resp
            body = [t - t % lv.num_classes + key if j % 2 == 0 else t for j, t in enumerate(body)]
            body = [t if t not in stops and t < 1024 else key for t in body]
            hits += T.verify(cfg, p, tuple(body + resp[len(body) :]), stops)[0]
        assert hits / 1500 >= base - 0.03, (lv, hits / 1500, base)
        if base < 0.9:
            assert hits / 1500 > base + 0.05, (lv, hits / 1500, base)
