"""The RL loop's task, reward composition and advantage-inversion guard
(compass_kernels/integration/rl/task.py): fast, no engines."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.integration.rl import task as T

CFG = T.TaskConfig(vocab_size=1024)


def _groups(seed, groups=16, size=6):
    g = torch.Generator().manual_seed(seed)
    gid = torch.arange(groups).repeat_interleave(size)
    perm = torch.randperm(gid.numel(), generator=g)
    gid = gid[perm] * 3 + 11  # shuffled, non-contiguous ids
    correct = torch.rand(gid.numel(), generator=g) < 0.4
    grade = torch.rand(gid.numel(), generator=g, dtype=torch.float64)
    len_pen = -torch.rand(gid.numel(), generator=g, dtype=torch.float64)
    rep_pen = -torch.rand(gid.numel(), generator=g, dtype=torch.float64)
    return gid, correct, grade, len_pen, rep_pen


def _brute_inversions(adv, correct, gid, tol=1e-9):
    n = len(adv)
    return sum(
        1
        for i, j in itertools.product(range(n), range(n))
        if gid[i] == gid[j] and not correct[i] and correct[j] and adv[i] > adv[j] + tol
    )


@pytest.mark.parametrize("seed", range(5))
def test_count_inversions_matches_brute_force(seed):
    gid, correct, *_ = _groups(seed)
    adv = torch.randn(gid.numel(), generator=torch.Generator().manual_seed(seed + 100))
    got = T.count_inversions(adv, correct.numpy(), gid.numpy())
    assert got == _brute_inversions(adv.tolist(), correct.tolist(), gid.tolist())
    assert got > 0  # random advantages do invert pairs


@pytest.mark.parametrize("seed", range(5))
def test_guard_orders_every_group(seed):
    gid, correct, grade, len_pen, rep_pen = _groups(seed)
    # the unguarded sum lets incorrect responses outscore correct ones
    naive = T.naive_compose(CFG, correct, grade, len_pen, rep_pen)
    guarded, changed = T.guard(naive, correct, gid, margin=0.05)
    assert changed > 0
    assert torch.equal(guarded[correct], naive[correct])  # correct rewards untouched
    changed_mask = guarded != naive
    assert int(changed_mask.sum()) == changed and not changed_mask[correct].any()
    for g in gid.unique():
        sel = gid == g
        good, bad = guarded[sel & correct], guarded[sel & ~correct]
        if good.numel() and bad.numel():
            assert bad.max() <= good.min() - 0.05 + 1e-12
    adv_naive, _, _ = ck.advantages.group_advantages(naive, gid)
    adv, _, _ = ck.advantages.group_advantages(guarded, gid)
    assert T.count_inversions(adv_naive, correct, gid) > 0
    assert T.count_inversions(adv, correct, gid) == 0


@pytest.mark.parametrize("seed", range(5))
def test_composition_is_ordered_by_construction(seed):
    gid, correct, grade, len_pen, rep_pen = _groups(seed)
    r = T.compose(CFG, correct, grade, len_pen, rep_pen)
    assert r[correct].min() > r[~correct].max()
    guarded, changed = T.guard(r, correct, gid, margin=CFG.guard_margin)
    assert changed == 0 and torch.equal(guarded, r)
    adv, _, _ = ck.advantages.group_advantages(r, gid)
    assert T.count_inversions(adv, correct, gid) == 0


def test_guard_leaves_groups_without_a_correct_response_alone():
    r = torch.tensor([0.3, 0.9, 0.1, 2.0], dtype=torch.float64)
    correct = torch.tensor([False, False, True, False])
    gid = torch.tensor([0, 0, 1, 1])
    out, changed = T.guard(r, correct, gid, margin=0.1)
    assert out.tolist() == pytest.approx([0.3, 0.9, 0.1, 0.0]) and changed == 1


def test_verify_and_penalties():
    stops = frozenset({999})
    prompt = T.Prompt(0, (5, 6, 7, 9))  # key 9 % 4 = 1
    cls1 = [13, 17, 21, 25, 29, 33]  # all in class 1
    assert T.verify(CFG, prompt, tuple(cls1) + (999,), stops) == (True, 6)  # stop token dropped
    assert T.verify(CFG, prompt, (12, 16, 20, 24, 28, 32), stops) == (False, 6)
    need = math.ceil(CFG.pass_fraction * 9)
    mixed = cls1[:need] + [12] * (9 - need)
    assert T.verify(CFG, prompt, tuple(mixed), stops)[0]
    mixed = cls1[: need - 1] + [12] * (10 - need)
    assert not T.verify(CFG, prompt, tuple(mixed), stops)[0]
    assert T.verify(CFG, prompt, (13, 17, 999), stops) == (False, 2)  # too short to judge
    assert T.repetition_penalty(CFG, tuple(range(20)), stops) == 0.0
    assert T.repetition_penalty(CFG, (5,) * 20, stops) == -1.0
    half = tuple(range(10)) + tuple(range(10))  # 50% repeated: (0.5 - 0.2) / 0.3 = 1
    assert T.repetition_penalty(CFG, half, stops) == pytest.approx(-1.0)
    quarter = tuple(range(15)) + tuple(range(5))  # 25% repeated
    assert T.repetition_penalty(CFG, quarter, stops) == pytest.approx(-(0.05 / 0.3))


def test_random_policy_rewards_vary():
    # a uniform policy over the vocabulary passes some answers, fails others
    stops = frozenset(T.stop_tokens(CFG, seed=0))
    prompts = T.make_prompts(CFG, 32, seed=0)
    rng = np.random.default_rng(0)
    passed = [
        T.verify(CFG, p, tuple(rng.integers(3, 1024, size=16).tolist()), stops)[0]
        for p in prompts
        for _ in range(8)
    ]
    rate = float(np.mean(passed))
    assert 0.15 < rate < 0.6, rate
    assert len(stops) == round(CFG.stop_fraction * 1024)
    assert T.make_prompts(CFG, 32, seed=0) == prompts  # deterministic
    assert all(CFG.min_prompt <= len(p.token_ids) <= CFG.max_prompt for p in prompts)


def test_reward_model_is_deterministic_and_bounded():
    rm = T.RewardModel(1024, seed=3)
    a = rm((1, 2, 3, 4))
    assert a == T.RewardModel(1024, seed=3)((1, 2, 3, 4))
    scores = [rm(tuple(range(i, i + 10))) for i in range(0, 1000, 50)]
    assert all(0.0 <= s <= 1.0 for s in scores) and np.std(scores) > 0.05
    with pytest.raises(ValueError, match="latency_s"):
        T.RewardModel(1024, latency_s=-1)


def test_task_config_rejects_bad_values():
    with pytest.raises(ValueError, match="beta"):
        T.TaskConfig(vocab_size=1024, beta=0.6)
    with pytest.raises(ValueError, match="max_prompt"):
        T.TaskConfig(vocab_size=1024, min_prompt=10, max_prompt=5)
    with pytest.raises(ValueError, match="overlong_cache"):
        T.TaskConfig(vocab_size=1024, overlong_cache=64)
    with pytest.raises(ValueError, match="vocab_size"):
        T.TaskConfig(vocab_size=0)


def test_cli_rejects_bad_arguments(tmp_path):
    from compass_kernels.integration.rl import loop

    parser = loop.build_parser()
    for argv, match in (
        (["--n", "1"], "--n must be >= 2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--prompts", "9", "--pool", "8"], r"--prompts \(9\) > --pool \(8\)"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--resample-budget", "-1"], "--resample-budget must be >= 0"),
    ):
        with pytest.raises(SystemExit, match=match):
            loop._check_args(parser.parse_args(argv))
    with pytest.raises(SystemExit, match="no config.json"):
        loop._model_dir(parser.parse_args(["--model-dir", str(tmp_path)]))
    loop._check_args(parser.parse_args([]))  # the defaults are valid
