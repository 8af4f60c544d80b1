"""The compass_grpo estimator in verl's ADV_ESTIMATOR_REGISTRY: equal to verl's
grpo / Dr.GRPO / rloo where they overlap (groups of >= 2 with distinct
rewards), exactly 0 for zero-variance groups and groups of one, RL-ZVP from
the old entropy the entropy patch keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.advantages.reference import rl_zvp_reference
from compass_kernels.integration import verl as cv
from compass_kernels.integration.verl import advantages as adv_mod
from tests.verl_helpers import core_algos

pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/setup_env.sh)")

from verl.trainer.config import AlgoConfig  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _registered():
    cv.register()
    yield
    cv.unregister()


def _rollouts(g, groups=5, n=4, L=9, zero_var=()):
    B = groups * n
    uid = np.array([f"prompt-{i // n}" for i in range(B)], dtype=object)
    perm = torch.randperm(B, generator=g)  # verl's batch is not grouped contiguously
    lens = torch.randint(1, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None, :] < lens[:, None]
    score = torch.randint(0, 3, (B,), generator=g).double() + torch.rand(
        B, generator=g, dtype=torch.float64
    )
    for z in zero_var:
        score[z * n : (z + 1) * n] = 1.0
    rewards = torch.zeros(B, L, dtype=torch.float32)
    rewards[torch.arange(B), lens - 1] = score.float()  # outcome reward at the last token
    return rewards[perm], mask[perm], uid[perm.numpy()]


@pytest.mark.parametrize("norm", [True, False], ids=["grpo", "dr_grpo"])
def test_equals_verl_grpo(norm):
    g = torch.Generator().manual_seed(int(norm))
    rewards, mask, uid = _rollouts(g)
    fn = core_algos.get_adv_estimator_fn("compass_grpo")
    cfg = AlgoConfig(norm_adv_by_std_in_grpo=norm)
    ours, ret = fn(token_level_rewards=rewards, response_mask=mask, config=cfg, index=uid)
    ref, _ = core_algos.compute_grpo_outcome_advantage(
        rewards, mask, uid, norm_adv_by_std_in_grpo=norm
    )
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-6)
    assert ret is ours
    assert ours[~mask].eq(0).all()


def test_equals_verl_rloo():
    g = torch.Generator().manual_seed(2)
    rewards, mask, uid = _rollouts(g)
    adv_mod.configure(mode="rloo")
    try:
        ours, _ = core_algos.get_adv_estimator_fn("compass_grpo")(
            token_level_rewards=rewards, response_mask=mask, config=AlgoConfig(), index=uid
        )
    finally:
        adv_mod.configure(mode="grpo")
    ref, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask, uid, config=AlgoConfig())
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-6)


def test_zero_variance_and_singletons_are_exactly_zero():
    g = torch.Generator().manual_seed(3)
    rewards, mask, uid = _rollouts(g, zero_var=(1, 3))
    uid = uid.copy()
    uid[0] = "alone"  # a group of one
    ours, _ = cv.advantages.compute_compass_grpo_advantage(rewards, mask, uid, config=AlgoConfig())
    stats = adv_mod.last_stats()
    zv = stats["zero_var"]
    zero_groups = {u for u in uid if u in ("prompt-1", "prompt-3", "alone")}
    expect = torch.tensor([u in zero_groups for u in uid])
    # prompt-0 lost a member to "alone": still non-zero-variance unless its rewards are equal
    assert zv[expect].all()
    assert ours[zv].eq(0).all()
    assert stats["compass/adv/num_groups"] == 6
    assert stats["compass/adv/num_zero_var_groups"] >= 3
    assert ours[~zv].abs().sum() > 0


def test_rl_zvp_uses_the_old_entropy():
    g = torch.Generator().manual_seed(4)
    rewards, mask, uid = _rollouts(g, zero_var=(0, 2))
    ent = torch.rand(mask.shape, generator=g) * 3
    adv_mod.configure(rl_zvp=True, alpha=0.1)
    try:
        with pytest.raises(RuntimeError, match="register\\(old_entropy=True\\)"):
            adv_mod._ENTROPY.clear()
            cv.advantages.compute_compass_grpo_advantage(rewards, mask, uid)
        adv_mod.set_old_entropy(ent, mask)
        ours, _ = cv.advantages.compute_compass_grpo_advantage(rewards, mask, uid)
    finally:
        adv_mod.configure(rl_zvp=False)
        adv_mod._ENTROPY.clear()
    scores = rewards.sum(-1)
    seq_adv, zv, _ = ck.advantages.group_advantages(
        scores, torch.from_numpy(np.unique(uid.astype(str), return_inverse=True)[1]), mode="grpo"
    )
    lens = mask.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    ref = rl_zvp_reference(
        ent[mask].double(), cu, scores.double(), zv, alpha=0.1, advantages=seq_adv.double()
    )
    torch.testing.assert_close(ours[mask].double(), ref, rtol=1e-5, atol=1e-6)
    assert ours[~mask].eq(0).all()
    assert ours[zv].abs().sum() > 0  # the zero-variance groups now carry a signal
    assert adv_mod.last_stats()["compass/adv/rl_zvp_tokens"] == int(lens[zv].sum())
