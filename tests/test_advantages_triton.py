"""Triton kernels of ck.advantages against the float64 reference.

Runs on CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, no GPU) or
on CUDA tensors where a GPU is. Outputs are poisoned (NaN / 0xFF bytes) before
each launch, so an element a kernel forgot to write fails the comparison.
Sizes are odd (n = 1, 7, 37, 131), with groups of one, empty groups, exact
zero-variance groups (0.1 repeated), groups and sequences longer than BLOCK,
and a padded tail past cu_seqlens[-1].
"""

from __future__ import annotations

from tests.triton_tier import DEVICE, LAUNCHES

# isort: split

import pytest
import torch

from compass_kernels.advantages.reference import (
    MODES,
    group_advantages_reference,
    rl_zvp_reference,
)
from compass_kernels.advantages.triton import (
    group_advantages_triton,
    rl_zvp_triton,
)
from compass_kernels.testing import (
    assert_bitwise_equal,
    assert_verbose_allclose,
    empty_poisoned,
)

pytestmark = [
    pytest.mark.triton,
    LAUNCHES,
]

# float64 statistics: two-pass sums in another order than the reference's.
STATS_TOL = {"atol": 1e-12, "rtol": 1e-12}


def _groups(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets) with groups in increasing id order, members contiguous."""
    order = torch.sort(group_ids, stable=True).indices
    counts = torch.bincount(group_ids)
    counts = counts[counts > 0]
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets


def _run_groups(rewards, order, offsets, mode, *, eps=1e-6, tol=1e-6, block=None):
    n, groups = rewards.numel(), offsets.numel() - 1
    dev = torch.device(DEVICE)
    outs = (
        empty_poisoned(n, rewards.dtype, dev),
        empty_poisoned(n, torch.bool, dev),
        empty_poisoned(groups, torch.float64, dev),
        empty_poisoned(groups, torch.float64, dev),
    )
    kw = {} if block is None else {"block": block}
    adv, zero_var, group_mean, group_std = outs
    group_advantages_triton(
        rewards=rewards.to(dev),
        order=order.to(dev),
        offsets=offsets.to(dev),
        mode=mode,
        eps=eps,
        zero_var_tol=tol,
        adv=adv,
        zero_var=zero_var,
        group_mean=group_mean,
        group_std=group_std,
        **kw,
    )
    return tuple(t.cpu() for t in outs)


def _rewards(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards and group ids: random groups, plus (when n allows) a group of one
    and an exactly zero-variance group of 0.1s."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(1, n // 5), (n,), generator=g)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    if n >= 7:
        ids[-1] = n  # a group of one
        ids[:4] = n + 1  # four identical rewards: zero variance
        rewards[:4] = 0.1
    return rewards.to(dtype), ids


def _check_groups(rewards, ids, mode_name, outs, *, eps=1e-6, tol=1e-6):
    adv, zero_var, mean, std = outs
    r_adv, r_zero, r_mean, r_std = group_advantages_reference(
        rewards, ids, mode=mode_name, eps=eps, zero_var_tol=tol
    )
    assert_bitwise_equal(zero_var, r_zero, name="zero_var")
    assert_verbose_allclose(mean, r_mean, name="group_mean", **STATS_TOL)
    assert_verbose_allclose(std, r_std, name="group_std", **STATS_TOL)
    # The kernel and the reference both compute in float64 and round once to the
    # output dtype: equal up to one unit in the last place of that dtype.
    ulp = torch.finfo(adv.dtype).eps
    assert_verbose_allclose(
        adv, r_adv.to(adv.dtype), name=f"adv ({mode_name})", atol=1e-12, rtol=2 * ulp
    )
    # Zero-variance members get exactly +0.0.
    zeros = torch.zeros(int(r_zero.sum()), dtype=adv.dtype)
    assert_bitwise_equal(adv[r_zero], zeros, name="adv of zero-variance groups")


# ---------------------------------------------------------------- group advantages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [1, 7, 37, 131])
@pytest.mark.parametrize("mode", [0, 1, 2], ids=MODES)
def test_group_advantages_matches_reference(mode, n, dtype):
    rewards, ids = _rewards(n, dtype, seed=n + 10 * mode)
    order, offsets = _groups(ids)
    outs = _run_groups(rewards, order, offsets, mode, block=16)
    _check_groups(rewards, ids, MODES[mode], outs)
    if n >= 7:
        assert bool(outs[1][:4].all()) and bool(outs[1][-1]), "0.1 x4 and the single not flagged"


@pytest.mark.parametrize("mode", [0, 2], ids=["grpo", "rloo"])
def test_group_larger_than_block(mode):
    # One group of 600 with the default block (256): three chunks, the last partial;
    # and 131 members with block 16 (nine chunks).
    g = torch.Generator().manual_seed(5)
    for n, block in ((600, None), (131, 16)):
        rewards = torch.rand(n, generator=g) * 3
        ids = torch.zeros(n, dtype=torch.int64)
        order, offsets = _groups(ids)
        _check_groups(
            rewards, ids, MODES[mode], _run_groups(rewards, order, offsets, mode, block=block)
        )


def test_any_member_order_and_empty_groups():
    # The contract only asks for each group's members to be contiguous in
    # `order`; groups may be empty (repeated offsets) -> mean 0, std 0.
    g = torch.Generator().manual_seed(6)
    n = 37
    rewards = torch.randn(n, generator=g)
    order = torch.randperm(n, generator=g)
    offsets = torch.tensor([0, 0, 5, 6, 6, 20, 37, 37], dtype=torch.int64)
    ids = torch.empty(n, dtype=torch.int64)
    nonempty = []
    for k in range(offsets.numel() - 1):
        lo, hi = int(offsets[k]), int(offsets[k + 1])
        ids[order[lo:hi]] = k
        if hi > lo:
            nonempty.append(k)
    adv, zero_var, mean, std = _run_groups(rewards, order, offsets, 0)
    empty = [k for k in range(offsets.numel() - 1) if k not in nonempty]
    assert_bitwise_equal(mean[empty], torch.zeros(len(empty), dtype=torch.float64))
    assert_bitwise_equal(std[empty], torch.zeros(len(empty), dtype=torch.float64))
    _check_groups(rewards, ids, "grpo", (adv, zero_var, mean[nonempty], std[nonempty]))


def test_zero_var_tol_and_eps_are_float64():
    # Two rewards 0 and 2**-19: std = 2**-19.5 exactly rounded in float64. With
    # tol == std the group is zero-variance, with the next float64 below it is
    # not; a tolerance rounded to fp32 would land on the same side both times.
    rewards = torch.tensor([0.0, 2.0**-19], dtype=torch.float64)
    ids = torch.zeros(2, dtype=torch.int64)
    order, offsets = _groups(ids)
    std = torch.tensor([0.0, 2.0**-19], dtype=torch.float64).std()
    below = torch.nextafter(std, torch.tensor(0.0, dtype=torch.float64))
    _, zv_at, _, s = _run_groups(rewards, order, offsets, 0, tol=float(std))
    _, zv_below, _, _ = _run_groups(rewards, order, offsets, 0, tol=float(below))
    assert_bitwise_equal(s, std.reshape(1))
    assert bool(zv_at.all()) and not bool(zv_below.any())
    # eps enters in float64 too: (r - mean) / (std + eps) with an eps fp32 cannot hold.
    eps = 1e-7 + 2.0**-80
    outs = _run_groups(rewards, order, offsets, 0, eps=eps, tol=0.0)
    _check_groups(rewards, ids, "grpo", outs, eps=eps, tol=0.0)
    assert_verbose_allclose(outs[0], (rewards - rewards.mean()) / (std + eps), atol=0, rtol=4e-16)


def test_group_advantages_argument_errors():
    r = torch.zeros(4)
    order, offsets = torch.arange(4), torch.tensor([0, 4])
    adv, zv = torch.empty(4), torch.empty(4, dtype=torch.bool)
    stats = dict(
        group_mean=torch.empty(1, dtype=torch.float64),
        group_std=torch.empty(1, dtype=torch.float64),
    )
    kw = dict(
        rewards=r,
        order=order,
        offsets=offsets,
        mode=0,
        eps=1e-6,
        zero_var_tol=1e-6,
        adv=adv,
        zero_var=zv,
        **stats,
    )
    with pytest.raises(ValueError, match=r"adv: expected dtype float32, got float64\[4\]"):
        group_advantages_triton(**(kw | {"adv": adv.double()}))
    with pytest.raises(
        ValueError, match=r"group_mean: expected 2 elements in dim 0 \(one per group"
    ):
        group_advantages_triton(**(kw | {"offsets": torch.tensor([0, 2, 4])}))
    with pytest.raises(ValueError, match=r"mode: expected 0 \(grpo\), 1 \(dr_grpo\) or 2 \(rloo\)"):
        group_advantages_triton(**(kw | {"mode": 3}))
    with pytest.raises(ValueError, match=r"block: expected a power of two"):
        group_advantages_triton(**kw, block=24)


# ------------------------------------------------------------------------- RL-ZVP


def _zvp_case(n: int, seed: int, *, tail: int, long_seq: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 9, (n,), generator=g)
    if n >= 3:
        lengths[1] = 0  # an empty sequence
    if long_seq:
        lengths[-1] = long_seq
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    T = int(cu[-1]) + tail
    entropy = torch.rand(T, generator=g) * 4
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    rewards[::3] = 0.0  # reward 0 takes the "not > 0" branch
    zero_var = torch.rand(n, generator=g) < 0.6
    return entropy, cu, rewards, zero_var


def _run_zvp(entropy, cu, rewards, zero_var, advantages, alpha, *, block=None):
    dev = torch.device(DEVICE)
    out = empty_poisoned(entropy.numel(), torch.float32, dev)
    adv = None if advantages is None else advantages.to(dev)
    kw = {} if block is None else {"block": block}
    rl_zvp_triton(
        entropy=entropy.to(dev),
        cu_seqlens=cu.to(dev),
        rewards=rewards.to(dev),
        zero_var=zero_var.to(dev),
        advantages=adv,
        alpha=alpha,
        out=out,
        **kw,
    )
    return out.cpu()


def _check_zvp(out, entropy, cu, rewards, zero_var, advantages, alpha):
    ref = rl_zvp_reference(entropy, cu, rewards, zero_var, alpha=alpha, advantages=advantages)
    # fp32 math (alpha rounded to fp32, one product / difference): a few ulp of max H.
    assert_verbose_allclose(out, ref.to(torch.float32), name="rl_zvp", atol=4e-6, rtol=1e-6)
    # Broadcast advantages and the tail are copies, not arithmetic: bit-exact.
    exact = torch.ones(entropy.numel(), dtype=torch.bool)
    for i in range(cu.numel() - 1):
        if bool(zero_var[i]):
            exact[int(cu[i]) : int(cu[i + 1])] = False
    assert_bitwise_equal(out[exact], ref.to(torch.float32)[exact], name="copied tokens")


@pytest.mark.parametrize("adv_dtype", [None, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [1, 7, 37])
def test_rl_zvp_matches_reference(n, adv_dtype):
    entropy, cu, rewards, zero_var = _zvp_case(n, seed=n, tail=5)
    g = torch.Generator().manual_seed(100 + n)
    advantages = None
    if adv_dtype is not None:
        advantages = torch.randn(n, generator=g, dtype=torch.float64).to(adv_dtype)
    out = _run_zvp(entropy, cu, rewards.to(torch.float32), zero_var, advantages, 0.1, block=16)
    _check_zvp(out, entropy, cu, rewards.to(torch.float32), zero_var, advantages, 0.1)


def test_rl_zvp_long_sequence_max_in_last_chunk():
    # A zero-variance sequence of 1500 tokens (two chunks of the default block)
    # whose entropy maximum is its very last token, and a negative reward: every
    # token depends on that maximum.
    entropy, cu, rewards, zero_var = _zvp_case(3, seed=7, tail=0, long_seq=1500)
    last = int(cu[-1]) - 1
    entropy[last] = 10.0
    zero_var[-1], rewards[-1] = True, -1.0
    out = _run_zvp(entropy, cu, rewards, zero_var, None, 0.25)
    _check_zvp(out, entropy, cu, rewards, zero_var, None, 0.25)
    assert out[last].item() == 0.0


def test_rl_zvp_tail_and_no_sequences():
    # T > cu[n]: padding tokens get exactly 0, across several tail chunks.
    entropy, cu, rewards, zero_var = _zvp_case(7, seed=8, tail=70)
    out = _run_zvp(entropy, cu, rewards, zero_var, torch.ones(7), 0.1, block=16)
    _check_zvp(out, entropy, cu, rewards, zero_var, torch.ones(7), 0.1)
    assert_bitwise_equal(out[int(cu[-1]) :], torch.zeros(70))
    # n = 0: every token is tail.
    empty = torch.zeros(0)
    out = _run_zvp(
        torch.rand(19),
        torch.zeros(1, dtype=torch.int64),
        empty,
        torch.zeros(0, dtype=torch.bool),
        None,
        0.1,
        block=16,
    )
    assert_bitwise_equal(out, torch.zeros(19))


def test_rl_zvp_argument_errors():
    h, cu = torch.rand(5), torch.tensor([0, 2, 5])
    r, zv, out = torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.empty(5)
    kw = dict(entropy=h, cu_seqlens=cu, rewards=r, zero_var=zv, advantages=None, alpha=0.1, out=out)
    with pytest.raises(ValueError, match=r"entropy: expected dtype float32, got float64"):
        rl_zvp_triton(**(kw | {"entropy": h.double()}))
    with pytest.raises(
        ValueError, match=r"zero_var: expected 2 elements in dim 0 \(one per sequence"
    ):
        rl_zvp_triton(**(kw | {"zero_var": zv[:1]}))
    with pytest.raises(ValueError, match=r"out: expected a contiguous tensor, got strides \(2,\)"):
        rl_zvp_triton(**(kw | {"out": torch.empty(10)[::2]}))
