"""Variable group sizes, as the rollout-budget policies produce them (issue 36): groups
of one, empty groups and odd mixtures of sizes through group_advantages (every mode),
RL-ZVP and ESPO's espo_loss, on the torch backend (float64 by-hand references) and on
Triton (the interpreter on CPU tensors here, a GPU where one is).

A group of one has no within-group baseline: its advantage is exactly 0, it counts as
zero-variance (RL-ZVP then shapes its tokens), nothing is NaN. An empty group cannot be
named by ids (a group is the set of samples sharing an id): ``num_groups`` larger than
the ids present is refused on CPU tensors (ValueError naming it) and a device-side
assert on CUDA (documented in group_advantages).
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.advantages.reference import rl_zvp_reference
from compass_kernels.espo.reference_loss import espo_loss_reference
from compass_kernels.testing import assert_verbose_allclose, make_generator

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
MODES = ("grpo", "dr_grpo", "rloo")
#: odd mixtures: ones, pairs, a long group, sizes the policies produce (2 + commits)
SIZES = [1, 2, 1, 7, 3, 1, 1, 5, 2, 33, 1, 4]


def variable_batch(sizes, seed: int, *, binary: bool = True, device="cpu"):
    """Rewards and shuffled, sparse group ids with the given group sizes."""
    g = make_generator(seed)
    ids = torch.cat(
        [torch.full((s,), 3 * k - 7, dtype=torch.int64) for k, s in enumerate(sizes) if s]
    )
    n = ids.numel()
    r = torch.randint(0, 2, (n,), generator=g).double() if binary else torch.randn(n, generator=g)
    perm = torch.randperm(n, generator=g)
    return r[perm].to(device), ids[perm].to(device)


def by_hand(rewards, ids, mode: str, eps: float = 1e-6, tol: float = 1e-6):
    """float64 advantages and zero-variance flags, a Python loop per group."""
    r, i = rewards.cpu().double().tolist(), ids.cpu().tolist()
    adv, zv = [0.0] * len(r), [False] * len(r)
    for gid in set(i):
        m = [j for j, x in enumerate(i) if x == gid]
        x = [r[j] for j in m]
        c = len(x)
        mean = sum(x) / c
        std = (sum((v - mean) ** 2 for v in x) / (c - 1)) ** 0.5 if c > 1 else 0.0
        zero = c < 2 or std <= tol
        for j in m:
            zv[j] = zero
            if zero:
                continue
            if mode == "grpo":
                adv[j] = (r[j] - mean) / (std + eps)
            elif mode == "dr_grpo":
                adv[j] = r[j] - mean
            else:  # rloo: the mean of the others
                adv[j] = r[j] - (sum(x) - r[j]) / (c - 1)
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(zv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("binary", [True, False])
def test_odd_mixture_of_group_sizes(backend, mode, dtype, binary, backend_device):
    rewards, ids = variable_batch(SIZES, seed=len(SIZES) + binary, binary=binary)
    want, want_zv = by_hand(rewards, ids, mode)
    r = rewards.to(dtype).to(backend_device)
    adv, zv, stats = ck.advantages.group_advantages(
        r, ids.to(backend_device), mode=mode, backend=backend
    )
    assert adv.dtype == dtype and torch.isfinite(adv).all()
    assert torch.equal(zv.cpu(), want_zv)
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    assert_verbose_allclose(adv.cpu().double(), want, name="adv", **tol)
    assert stats.num_groups == len(SIZES)
    assert sorted(stats.counts.tolist()) == sorted(SIZES)
    ones = torch.isin(ids, torch.tensor([3 * k - 7 for k, s in enumerate(SIZES) if s == 1]))
    assert (adv.cpu()[ones] == 0).all() and zv.cpu()[ones].all()  # exactly 0, counted
    single = stats.counts.cpu() == 1
    assert (stats.group_std.cpu()[single] == 0).all() and stats.group_zero_var.cpu()[single].all()
    assert torch.isfinite(stats.group_mean).all() and torch.isfinite(stats.group_std).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_every_group_of_one(backend, mode, backend_device):
    rewards = torch.tensor([0.0, 1.0, 1.0, -2.5, 7.0], device=backend_device)
    ids = torch.tensor([4, 0, 9, 2, 1], device=backend_device)
    adv, zv, stats = ck.advantages.group_advantages(rewards, ids, mode=mode, backend=backend)
    assert adv.tolist() == [0.0] * 5 and zv.all()
    assert stats.counts.tolist() == [1] * 5 and stats.group_std.tolist() == [0.0] * 5
    assert stats.group_mean.tolist() == [1.0, 7.0, -2.5, 0.0, 1.0]  # ids 0, 1, 2, 4, 9
    adv, zv, _ = ck.advantages.group_advantages(rewards, group_size=1, mode=mode, backend=backend)
    assert adv.tolist() == [0.0] * 5 and zv.all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_groups_are_refused_by_num_groups(backend, backend_device):
    if backend_device != "cpu":
        pytest.skip("on CUDA the num_groups check is a device-side assert (documented)")
    rewards, ids = variable_batch([1, 3, 2], seed=1)
    adv, _, stats = ck.advantages.group_advantages(rewards, ids, num_groups=3, backend=backend)
    assert stats.num_groups == 3
    for wrong in (4, 5):  # one or two groups without samples
        with pytest.raises(ValueError, match=r"^num_groups: expected .*distinct group_ids, 3"):
            ck.advantages.group_advantages(rewards, ids, num_groups=wrong, backend=backend)
    empty_r, empty_i = torch.zeros(0), torch.zeros(0, dtype=torch.int64)
    adv, zv, stats = ck.advantages.group_advantages(empty_r, empty_i, num_groups=0, backend=backend)
    assert adv.shape == (0,) and zv.shape == (0,) and stats.num_groups == 0
    with pytest.raises(ValueError, match="^num_groups"):
        ck.advantages.group_advantages(empty_r, empty_i, num_groups=1, backend=backend)


def _sequences(n: int, seed: int, device):
    g = make_generator(seed)
    lengths = torch.randint(1, 12, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    entropy = torch.rand(int(cu[-1]) + 2, generator=g) * 3
    return entropy.to(device), cu.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_zvp_shapes_groups_of_one(backend, backend_device):
    """Groups of one are zero-variance: RL-ZVP gives their tokens alpha * H (reward > 0)
    or -alpha * (max H - H); informative groups' tokens keep their advantage."""
    rewards, ids = variable_batch(SIZES, seed=3)
    adv, zv, _ = ck.advantages.group_advantages(rewards, ids, backend="torch")
    entropy, cu = _sequences(rewards.numel(), 4, "cpu")
    dev = backend_device
    got = ck.advantages.rl_zvp(
        entropy.to(dev),
        cu.to(dev),
        rewards.to(dev),
        zv.to(dev),
        alpha=0.1,
        advantages=adv.to(dev),
        backend=backend,
    )
    want = rl_zvp_reference(entropy, cu, rewards, zv, alpha=0.1, advantages=adv)
    assert torch.isfinite(got).all()
    assert_verbose_allclose(got.cpu(), want.float(), atol=1e-6, rtol=1e-6, name="token_adv")
    counts = {int(i): int((ids == i).sum()) for i in ids.unique()}
    for j in range(rewards.numel()):
        if counts[int(ids[j])] != 1:
            continue
        a, b = int(cu[j]), int(cu[j + 1])
        h = entropy[a:b]
        expect = 0.1 * h if rewards[j] > 0 else -0.1 * (h.max() - h)
        assert_verbose_allclose(got.cpu()[a:b], expect, atol=1e-6, rtol=1e-6, name=f"seq {j}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_token", [False, True])
def test_espo_loss_on_prompts_of_different_group_sizes(backend, per_token, backend_device):
    """espo_loss on a packed batch whose prompts have 1, 4, 2, 1, 3 sequences: advantages
    from group_advantages (groups of one: 0) or RL-ZVP per token; matches the float64
    reference, is finite, and a group of one's tokens get no gradient unless RL-ZVP
    shapes them."""
    sizes = [1, 4, 2, 1, 3]
    g = make_generator(8)
    ids = torch.cat([torch.full((s,), k) for k, s in enumerate(sizes)])
    n = ids.numel()
    rewards = torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0])
    assert rewards.numel() == n
    adv, zv, _ = ck.advantages.group_advantages(rewards, ids, backend="torch")
    entropy, cu = _sequences(n, 9, "cpu")
    T = entropy.numel()
    old = -torch.rand(T, generator=g) * 3
    lp = old + torch.randn(T, generator=g) * 0.1
    if per_token:
        adv_in = ck.advantages.rl_zvp(entropy, cu, rewards, zv, alpha=0.1, advantages=adv)
    else:
        adv_in = adv.float()
    dev = backend_device
    x = lp.detach().to(dev).requires_grad_()
    loss, metrics = ck.espo.espo_loss(
        x,
        old.to(dev),
        entropy.to(dev),
        adv_in.to(dev),
        cu.to(dev),
        vocab_size=1000,
        advantages_per_token=per_token,
        backend=backend,
    )
    loss.backward()
    xr = lp.detach().double().requires_grad_()
    rloss, rmetrics = espo_loss_reference(
        xr, old, entropy, adv_in, cu, None, vocab_size=1000, advantages_per_token=per_token
    )
    rloss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert_verbose_allclose(loss.detach().cpu().double(), rloss.detach(), atol=1e-6, rtol=1e-5)
    assert_verbose_allclose(x.grad.cpu().double(), xr.grad, atol=1e-8, rtol=1e-5, name="grad")
    for key in rmetrics:
        assert_verbose_allclose(
            metrics[key].cpu().double(), rmetrics[key], atol=1e-6, rtol=1e-5, name=key
        )
    for j in (0, 7):  # the two groups of one
        a, b = int(cu[j]), int(cu[j + 1])
        grad = x.grad.cpu()[a:b]
        if per_token:
            assert (grad != 0).any()  # RL-ZVP shaped them
        else:
            assert (grad == 0).all() and adv[j] == 0
