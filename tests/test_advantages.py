"""ck.advantages: every backend against the float64 reference, bad inputs, op registration.

Backends: "torch" (the vectorised reference, CPU tensors) and "triton" (CUDA
tensors; CPU tensors under the interpreter, marker triton), both against the
loop-level spec in reference.py. More Triton tests: test_advantages_triton.py.
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels import _dispatch
from compass_kernels._ext import BackendUnavailableError, triton_interpreting
from compass_kernels.advantages import (
    MODES,
    _groups_from_ids,
    group_advantages_op,
    rl_zvp_op,
)
from compass_kernels.advantages.reference import (
    group_advantages_reference,
    overlong_penalty_reference,
    rl_zvp_reference,
)
from compass_kernels.testing import assert_verbose_allclose, empty_poisoned, make_generator

# -------------------------------------------------------------- inputs


def make_groups(num_groups: int, seed: int, *, max_size: int = 9, device="cpu"):
    """Rewards with shuffled, sparse group ids and a mix of group kinds: binary
    (often zero-variance), continuous, constant 0.1 (exactly zero-variance in
    float64 only if computed carefully), and groups of one."""
    g = make_generator(seed)
    sizes = torch.randint(1, max_size + 1, (num_groups,), generator=g)
    ids = torch.randperm(10 * num_groups + 7, generator=g)[:num_groups] * 3 - 5
    rewards, group_ids = [], []
    for k in range(num_groups):
        size = int(sizes[k])
        kind = k % 4
        if kind == 0:
            r = torch.randint(0, 2, (size,), generator=g).float()
        elif kind == 1:
            r = torch.randn(size, generator=g) * 3
        elif kind == 2:
            r = torch.full((size,), 0.1)
        else:
            r = torch.rand(size, generator=g).round(decimals=1)
        rewards.append(r)
        group_ids.append(torch.full((size,), int(ids[k]), dtype=torch.int64))
    perm = torch.randperm(int(sizes.sum()), generator=g)
    return torch.cat(rewards)[perm].to(device), torch.cat(group_ids)[perm].to(device)


def make_sequences(n: int, seed: int, *, max_len: int = 40, pad: int = 3, device="cpu"):
    g = make_generator(seed)
    lengths = torch.randint(0, max_len + 1, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1]) + pad
    entropy = torch.rand(total, generator=g) * 5
    rewards = torch.randint(0, 2, (n,), generator=g).float() - 0.5 * (torch.arange(n) % 3 == 0)
    zero_var = torch.rand(n, generator=g) < 0.6
    adv = torch.randn(n, generator=g)
    to = lambda *ts: [t.to(device) for t in ts]
    return to(entropy, cu, rewards, zero_var, adv)


TRITON = pytest.param("triton", marks=pytest.mark.triton)


def cpu_backends():
    """Backends every machine runs: torch (CPU tensors) and Triton, on CUDA tensors
    where a GPU is and in the interpreter on CPU tensors where none is (see
    :func:`backend_device`)."""
    return ["torch", TRITON]


# -------------------------------------------------------- group advantages


@pytest.mark.parametrize("backend", [None, TRITON])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_groups", [1, 7, 37, 131])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_advantages_matches_reference(mode, num_groups, dtype, backend):
    rewards, ids = make_groups(num_groups, seed=num_groups)
    rewards = rewards.to(dtype)
    adv, zero_var, stats = ck.advantages.group_advantages(rewards, ids, mode=mode, backend=backend)
    ref_adv, ref_zv, ref_mean, ref_std = group_advantages_reference(rewards, ids, mode=mode)
    assert adv.dtype == dtype and zero_var.dtype == torch.bool
    assert torch.equal(zero_var, ref_zv)
    assert_verbose_allclose(adv, ref_adv.to(dtype), name="adv")
    assert_verbose_allclose(stats.group_mean, ref_mean, atol=1e-12, rtol=1e-12, name="mean")
    assert_verbose_allclose(stats.group_std, ref_std, atol=1e-12, rtol=1e-12, name="std")
    assert torch.equal(stats.group_ids, torch.unique(ids))
    assert stats.num_groups == num_groups


def _per_group_by_hand(rewards: torch.Tensor, ids: torch.Tensor, tol: float):
    """Per group, in increasing id order, straight from the samples (a Python loop
    over ids, nothing shared with the library or the reference): id, count,
    mean, unbiased std, zero-variance flag."""
    rows = []
    for gid in sorted(set(ids.tolist())):
        x = [float(r) for r, i in zip(rewards.tolist(), ids.tolist(), strict=True) if i == gid]
        c, mean = len(x), sum(x) / len(x)
        std = (sum((v - mean) ** 2 for v in x) / (c - 1)) ** 0.5 if c > 1 else 0.0
        rows.append((gid, c, mean, std, c < 2 or std <= tol))
    return rows


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_stats_per_group_with_shuffled_ids(backend, seed, backend_device):
    """GroupStats row k describes the k-th smallest id, whatever the order of the
    samples: ids are shuffled, sparse, negative, and groups come in every kind."""
    rewards, ids = make_groups(41, seed=100 + seed, device=backend_device)
    tol = 1e-6
    _, zero_var, stats = ck.advantages.group_advantages(
        rewards, ids, zero_var_tol=tol, backend=backend
    )
    rows = _per_group_by_hand(rewards.cpu(), ids.cpu(), tol)
    assert len(rows) == stats.num_groups == 41
    assert stats.group_ids.tolist() == [r[0] for r in rows]
    assert stats.counts.dtype == torch.int64 and stats.counts.tolist() == [r[1] for r in rows]
    assert_verbose_allclose(
        stats.group_mean.cpu(),
        torch.tensor([r[2] for r in rows], dtype=torch.float64),
        atol=1e-12,
        rtol=1e-12,
        name="mean",
    )
    assert_verbose_allclose(
        stats.group_std.cpu(),
        torch.tensor([r[3] for r in rows], dtype=torch.float64),
        atol=1e-12,
        rtol=1e-12,
        name="std",
    )
    flags = [r[4] for r in rows]
    assert 0 < sum(flags) < len(flags), "need both kinds of group"
    assert stats.group_zero_var.tolist() == flags
    # The per-sample flag is the per-group flag of the sample's id.
    by_id = {r[0]: r[4] for r in rows}
    assert zero_var.tolist() == [by_id[i] for i in ids.tolist()]
    # Summaries: counted here, not from group_zero_var.
    assert int(stats.num_zero_var) == sum(flags)
    assert abs(float(stats.zero_var_fraction) - sum(flags) / len(flags)) <= 1e-15  # a mean


def test_group_stats_with_group_size():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0, 3.0, 4.0])
    _, _, stats = ck.advantages.group_advantages(rewards, group_size=3)
    assert stats.group_ids is None and stats.num_groups == 3
    assert stats.counts.tolist() == [3, 3, 3]
    assert stats.group_zero_var.tolist() == [False, False, False]
    _, _, stats = ck.advantages.group_advantages(rewards[3:6], group_size=1)
    assert stats.group_zero_var.tolist() == [True] * 3 and int(stats.num_zero_var) == 3


def _ids_layout(layout: str, seed: int, num_groups: int = 61):
    """Rewards and ids: sorted runs, shuffled ids, or ids spread over a wide range."""
    rewards, ids = make_groups(num_groups, seed=seed, max_size=40)
    if layout == "sorted":
        order = torch.sort(ids, stable=True).indices
        rewards, ids = rewards[order], ids[order]
    elif layout == "wide":
        ids = ids * 1_000_003
    return rewards, ids


@pytest.mark.parametrize("layout", ["sorted", "shuffled", "wide"])
def test_group_ids_path_through_the_public_api(layout):
    """GroupStats from group ids: counts, per-group zero-variance flags (via
    each group's first member) and ids agree with a by-hand computation."""
    rewards, ids = _ids_layout(layout, seed=11)
    tol = 1e-6
    _, zero_var, stats = ck.advantages.group_advantages(rewards, ids, zero_var_tol=tol)
    rows = _per_group_by_hand(rewards, ids, tol)
    assert stats.group_ids.tolist() == [r[0] for r in rows]
    assert stats.counts.tolist() == [r[1] for r in rows]
    assert stats.group_zero_var.tolist() == [r[4] for r in rows]
    assert int(stats.num_zero_var) == sum(r[4] for r in rows)


@pytest.mark.parametrize("layout", ["sorted", "shuffled", "wide"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=str)
def test_group_ids_path_rejects_non_finite_rewards(layout, bad):
    rewards, ids = _ids_layout(layout, seed=5)
    rewards[17] = bad
    with pytest.raises(ValueError, match="rewards: expected finite values.* at index 17"):
        ck.advantages.group_advantages(rewards, ids)


@pytest.mark.parametrize("backend", [None, TRITON])
@pytest.mark.parametrize("layout", ["sorted", "shuffled", "wide"])
def test_num_groups_is_checked(backend, layout):
    rewards, ids = _ids_layout(layout, seed=9)
    groups = int(torch.unique(ids).numel())
    adv, _, stats = ck.advantages.group_advantages(rewards, ids, num_groups=groups, backend=backend)
    assert stats.num_groups == groups
    assert_verbose_allclose(adv, group_advantages_reference(rewards, ids)[0].float())
    for wrong in (groups - 1, groups + 1):
        with pytest.raises(ValueError, match=f"num_groups: expected .* {groups}, got {wrong}"):
            ck.advantages.group_advantages(rewards, ids, num_groups=wrong, backend=backend)
    with pytest.raises(ValueError, match="num_groups: expected a non-negative int"):
        ck.advantages.group_advantages(rewards, ids, num_groups=-1)
    with pytest.raises(ValueError, match="num_groups: only with group_ids"):
        ck.advantages.group_advantages(rewards, group_size=1, num_groups=groups)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("mode", list(MODES))
def test_group_kernel_writes_every_output(backend, mode, backend_device):
    """Outputs are poisoned before the kernel: any element it skips shows up.
    Groups of 1..70: fewer samples than a warp's lanes, and more than two passes."""
    rewards, ids = make_groups(53, seed=3, max_size=70, device=backend_device)
    order, offsets, _ = _groups_from_ids(ids)
    n, groups = rewards.numel(), offsets.numel() - 1
    out = (
        empty_poisoned(n, torch.float32, backend_device),
        empty_poisoned(n, torch.bool, backend_device),
        empty_poisoned(groups, torch.float64, backend_device),
        empty_poisoned(groups, torch.float64, backend_device),
    )
    group_advantages_op.run(
        rewards=rewards,
        order=order,
        offsets=offsets,
        mode=MODES[mode],
        eps=1e-6,
        zero_var_tol=1e-6,
        backend=backend,
        out=out,
    )
    out = tuple(t.cpu() for t in out)
    ref_adv, ref_zv, ref_mean, ref_std = group_advantages_reference(rewards, ids, mode=mode)
    assert torch.equal(out[1], ref_zv)
    assert_verbose_allclose(out[0], ref_adv.float(), name="adv")
    assert_verbose_allclose(out[2], ref_mean, atol=1e-12, rtol=1e-12)
    assert_verbose_allclose(out[3], ref_std, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", cpu_backends())
def test_public_api_dispatches_to_each_backend(backend, backend_device):
    """The public functions with an explicit backend agree with the reference."""
    rewards, ids = make_groups(23, seed=13, device=backend_device)
    adv, zero_var, stats = ck.advantages.group_advantages(
        rewards, ids, mode="rloo", backend=backend
    )
    assert adv.device.type == backend_device
    ref_adv, ref_zv, ref_mean, _ = group_advantages_reference(rewards, ids, mode="rloo")
    assert torch.equal(zero_var.cpu(), ref_zv)
    assert_verbose_allclose(adv.cpu(), ref_adv.float(), name="adv")
    assert_verbose_allclose(stats.group_mean.cpu(), ref_mean, atol=1e-12, rtol=1e-12)
    entropy, cu, r, zv, a = make_sequences(19, seed=13, device=backend_device)
    out = ck.advantages.rl_zvp(entropy, cu, r, zv, advantages=a, backend=backend)
    ref = rl_zvp_reference(entropy, cu, r, zv, advantages=a)
    assert_verbose_allclose(out.cpu(), ref.float())


def test_group_size_layout_equals_group_ids():
    g = make_generator(11)
    rewards = torch.randint(0, 3, (19 * 8,), generator=g).float()
    a1, z1, s1 = ck.advantages.group_advantages(rewards, group_size=8)
    a2, z2, s2 = ck.advantages.group_advantages(rewards, torch.arange(19).repeat_interleave(8))
    assert torch.equal(a1, a2) and torch.equal(z1, z2)
    assert torch.equal(s1.group_mean, s2.group_mean) and s1.group_ids is None


def test_zero_variance_is_exact_and_uses_tolerance():
    # 0.1 is not representable: a naive float32 mean/std can give std ~1e-9 > 0.
    rewards = torch.tensor([0.1] * 7 + [1.0, 1.0 + 1e-7, 1.0] + [2.0, 2.0 + 1e-3])
    ids = torch.tensor([0] * 7 + [1] * 3 + [2] * 2)
    adv, zero_var, stats = ck.advantages.group_advantages(rewards, ids)
    assert stats.group_zero_var.tolist() == [True, True, False]
    assert torch.all(adv[:10] == 0)  # exactly 0, not 1e-7 / 1e-6 noise amplified
    _, zv_strict, _ = ck.advantages.group_advantages(rewards, ids, zero_var_tol=0.0)
    assert zv_strict[:10].tolist() == [True] * 7 + [False] * 3


def test_groups_of_one_and_empty_batch():
    adv, zero_var, stats = ck.advantages.group_advantages(
        torch.tensor([3.0, 5.0]), torch.tensor([1, 2])
    )
    assert adv.tolist() == [0.0, 0.0] and zero_var.all()
    assert stats.group_std.tolist() == [0.0, 0.0]
    adv, zero_var, stats = ck.advantages.group_advantages(
        torch.zeros(0), torch.zeros(0, dtype=torch.int64)
    )
    assert adv.shape == (0,) and zero_var.shape == (0,) and stats.num_groups == 0


def test_half_precision_rewards_are_computed_in_float32():
    rewards, ids = make_groups(17, seed=5)
    adv, _, _ = ck.advantages.group_advantages(rewards.bfloat16(), ids)
    ref, _, _, _ = group_advantages_reference(rewards.bfloat16(), ids)
    assert adv.dtype == torch.float32
    assert_verbose_allclose(adv, ref.float(), name="adv")


def test_outputs_never_require_grad():
    rewards = torch.tensor([1.0, 0.0, 1.0], requires_grad=True)
    adv, _, _ = ck.advantages.group_advantages(rewards, group_size=3)
    assert not adv.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(rewards=torch.ones(4), group_ids=torch.zeros(3, dtype=torch.int64)),
            "group_ids: expected 4",
        ),
        (
            dict(rewards=torch.tensor([1.0, float("nan")]), group_size=2),
            "rewards: expected finite.*index 1",
        ),
        (dict(rewards=torch.tensor([1.0, float("inf")]), group_size=2), "rewards: expected finite"),
        (dict(rewards=torch.ones(4, dtype=torch.int64), group_size=2), "rewards: expected dtype"),
        (dict(rewards=torch.ones(2, 2), group_size=2), "rewards: expected a 1-d"),
        (dict(rewards=torch.ones(4), group_ids=torch.zeros(4)), "group_ids: expected dtype"),
        (dict(rewards=torch.ones(5), group_size=2), "does not divide"),
        (dict(rewards=torch.ones(4), group_size=0), "group_size: expected a positive int"),
        (dict(rewards=torch.ones(4)), "exactly one of group_ids"),
        (dict(rewards=torch.ones(4), group_size=2, mode="ppo"), "mode: expected one of"),
        (dict(rewards=torch.ones(4), group_size=2, eps=-1.0), "eps and zero_var_tol"),
    ],
)
def test_group_advantages_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ck.advantages.group_advantages(**kwargs)


# ----------------------------------------------------------------- RL-ZVP


@pytest.mark.parametrize("backend", [None, TRITON])
@pytest.mark.parametrize("n", [1, 7, 37, 131])
@pytest.mark.parametrize("with_adv", [False, True])
def test_rl_zvp_matches_reference(n, with_adv, backend):
    entropy, cu, rewards, zero_var, adv = make_sequences(n, seed=n)
    adv = adv if with_adv else None
    out = ck.advantages.rl_zvp(
        entropy, cu, rewards, zero_var, alpha=0.1, advantages=adv, backend=backend
    )
    ref = rl_zvp_reference(entropy, cu, rewards, zero_var, alpha=0.1, advantages=adv)
    assert out.dtype == torch.float32
    assert_verbose_allclose(out, ref.float(), name="token_adv")


@pytest.mark.parametrize("backend", cpu_backends())
def test_rl_zvp_kernel_writes_every_output(backend, backend_device):
    entropy, cu, rewards, zero_var, adv = make_sequences(29, seed=2, pad=17, device=backend_device)
    out = empty_poisoned(entropy.numel(), torch.float32, backend_device)
    rl_zvp_op.run(
        entropy=entropy,
        cu_seqlens=cu,
        rewards=rewards,
        zero_var=zero_var,
        advantages=adv.double(),
        alpha=0.25,
        backend=backend,
        out=out,
    )
    ref = rl_zvp_reference(entropy, cu, rewards, zero_var, alpha=0.25, advantages=adv.double())
    assert_verbose_allclose(out.cpu(), ref.float())


def test_rl_zvp_accepts_int32_offsets_and_half_entropy():
    entropy, cu, rewards, zero_var, _ = make_sequences(9, seed=4)
    out = ck.advantages.rl_zvp(entropy.bfloat16(), cu.int(), rewards, zero_var)
    ref = rl_zvp_reference(entropy.bfloat16(), cu, rewards, zero_var)
    assert_verbose_allclose(out, ref.float())


def test_rl_zvp_chains_with_group_advantages():
    """The intended pipeline: advantages + zero-variance flag -> token advantages."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    adv, zero_var, _ = ck.advantages.group_advantages(rewards, group_size=2)
    cu = torch.tensor([0, 2, 5, 6, 8, 9, 12])
    entropy = torch.arange(12, dtype=torch.float32)
    out = ck.advantages.rl_zvp(entropy, cu, rewards, zero_var, advantages=adv)
    assert zero_var.tolist() == [True, True, False, False, True, True]
    # group 0 all correct: alpha * H; group 2 all wrong: -alpha * (max H - H)
    expected = [0.0, 0.1, 0.2, 0.3, 0.4, adv[2], adv[3], adv[3], 0.0, -0.2, -0.1, 0.0]
    assert_verbose_allclose(out, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        (torch.tensor([1, 3, 5]), "cu_seqlens: expected cu_seqlens\\[0\\] == 0"),
        (torch.tensor([0, 3, 2]), "cu_seqlens: expected non-decreasing.*cu_seqlens\\[1\\] = 3"),
        (torch.tensor([0, 3, 11]), "cu_seqlens: expected cu_seqlens\\[-1\\] <= 10"),
        (torch.tensor([0.0, 3.0, 5.0]), "cu_seqlens: expected dtype"),
        (torch.tensor([0, 3, 5, 7]), "rewards: expected 3 elements"),
    ],
)
def test_rl_zvp_bad_offsets(cu, match):
    with pytest.raises(ValueError, match=match):
        ck.advantages.rl_zvp(torch.rand(10), cu, torch.ones(2), torch.ones(2, dtype=torch.bool))


def test_rl_zvp_bad_input():
    cu = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="zero_var: expected dtype bool"):
        ck.advantages.rl_zvp(torch.rand(5), cu, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="alpha: expected >= 0"):
        ck.advantages.rl_zvp(
            torch.rand(5), cu, torch.ones(2), torch.ones(2, dtype=torch.bool), alpha=float("nan")
        )
    with pytest.raises(ValueError, match="advantages: expected 2 elements"):
        ck.advantages.rl_zvp(
            torch.rand(5),
            cu,
            torch.ones(2),
            torch.ones(2, dtype=torch.bool),
            advantages=torch.ones(3),
        )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_rl_zvp_rejects_non_finite_entropy_and_rewards(bad):
    entropy, cu, rewards, zero_var, adv = make_sequences(9, seed=6, pad=4)
    end = int(cu[-1])
    h = entropy.clone()
    h[end - 2] = bad
    with pytest.raises(
        ValueError,
        match=rf"entropy: expected finite values, got {bad} at index "
        rf"{end - 2}",
    ):
        ck.advantages.rl_zvp(h, cu, rewards, zero_var)
    r = rewards.clone()
    r[5] = bad
    with pytest.raises(ValueError, match=rf"rewards: expected finite values, got {bad} at index 5"):
        ck.advantages.rl_zvp(entropy, cu, r, zero_var, advantages=adv)
    # Padding tokens (past cu_seqlens[-1]) are never read: anything goes there.
    h = entropy.clone()
    h[end:] = bad
    out = ck.advantages.rl_zvp(h, cu, rewards, zero_var)
    assert_verbose_allclose(out, rl_zvp_reference(h, cu, rewards, zero_var).float())
    # validate=False is the documented opt-out: no check, no error.
    r[5] = bad
    ck.advantages.rl_zvp(entropy, cu, r, zero_var, validate=False)
    if triton_interpreting():
        ck.advantages.rl_zvp(entropy, cu, r, zero_var, validate=False, backend="triton")


def test_rl_zvp_reference_defines_non_finite_inputs():
    cu = torch.tensor([0, 3, 6, 9])
    h = torch.tensor([1.0, float("nan"), 2.0, 1.0, float("nan"), 2.0, 1.0, float("inf"), 2.0])
    rewards = torch.tensor([-1.0, 1.0, float("nan")])
    out = rl_zvp_reference(h, cu, rewards, torch.ones(3, dtype=torch.bool), alpha=0.5)
    assert torch.isnan(out[0:3]).all()  # negative: max is NaN, every token NaN
    assert out[3].item() == 0.5 and torch.isnan(out[4]) and out[5].item() == 1.0  # positive
    # NaN reward: not > 0, negative branch; max is +inf: -inf, and NaN at the inf token.
    assert out[6].item() == float("-inf") and torch.isnan(out[7]) and out[8] == float("-inf")


# ------------------------------------------------------- overlong penalty


def test_overlong_penalty_matches_reference_at_boundaries():
    max_len, cache_len = 100, 20
    lengths = torch.tensor([0, 79, 80, 81, 90, 99, 100, 101, 5000])
    out = ck.advantages.overlong_penalty(lengths, max_len=max_len, cache_len=cache_len)
    ref = overlong_penalty_reference(lengths, max_len=max_len, cache_len=cache_len)
    assert_verbose_allclose(out, ref.float())
    assert out.tolist()[:3] == [0.0, 0.0, 0.0] and out[-2:].tolist() == [-1.0, -1.0]


def test_overlong_penalty_bad_input():
    with pytest.raises(ValueError, match="cache_len: expected an int in"):
        ck.advantages.overlong_penalty(torch.tensor([3]), max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="lengths: expected dtype"):
        ck.advantages.overlong_penalty(torch.tensor([3.0]), max_len=10, cache_len=2)


# ------------------------------------------------ dispatch and registration


def test_dispatch_never_falls_back():
    with pytest.raises(BackendUnavailableError, match="has no 'cuda' backend"):
        ck.advantages.group_advantages(torch.ones(2), group_size=2, backend="cuda")
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        _dispatch.resolve(torch.device("cpu"), "cuda", available=("torch", "cuda"))
    with pytest.raises(ValueError, match="backend: expected one of"):
        ck.advantages.group_advantages(torch.ones(2), group_size=2, backend="numpy")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _dispatch.reset()  # decisions are cached per process; the env is read on first use
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        _dispatch.resolve(torch.device("cpu"), "triton")


def test_opcheck_registered_ops():
    rewards, ids = make_groups(13, seed=8)
    order, offsets, _ = _groups_from_ids(ids)
    torch.library.opcheck(
        torch.ops.compass.group_advantages.default, (rewards, order, offsets, 0, 1e-6, 1e-6)
    )
    entropy, cu, r, zv, adv = make_sequences(11, seed=8)
    torch.library.opcheck(torch.ops.compass.rl_zvp.default, (entropy, cu, r, zv, adv, 0.1))
    torch.library.opcheck(torch.ops.compass.rl_zvp.default, (entropy, cu, r, zv, None, 0.1))


def test_registered_op_traces_under_torch_compile():
    import torch._dynamo

    assert not torch._dynamo.config.disable, "dynamo is off here (a live vLLM engine?)"
    entropy, cu, r, zv, adv = make_sequences(11, seed=9)
    fn = torch.compile(
        lambda *a: torch.ops.compass.rl_zvp(*a, 0.1) * 2.0, backend="eager", fullgraph=True
    )
    ref = rl_zvp_reference(entropy, cu, r, zv, advantages=adv) * 2.0
    assert_verbose_allclose(fn(entropy, cu, r, zv, adv), ref.float())


# ------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton"])
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_group_advantages(backend, mode):
    rewards, ids = make_groups(301, seed=21, max_size=70, device="cuda")
    adv, zero_var, stats = ck.advantages.group_advantages(rewards, ids, mode=mode, backend=backend)
    ref_adv, ref_zv, ref_mean, _ = group_advantages_reference(rewards, ids, mode=mode)
    assert torch.equal(zero_var.cpu(), ref_zv)
    assert_verbose_allclose(adv.cpu(), ref_adv.float(), name="adv")
    assert_verbose_allclose(stats.group_mean.cpu(), ref_mean, atol=1e-12, rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton"])
def test_gpu_rl_zvp(backend):
    entropy, cu, rewards, zero_var, adv = make_sequences(257, seed=22, max_len=3000, device="cuda")
    out = empty_poisoned(entropy.numel(), torch.float32, "cuda")
    rl_zvp_op.run(
        entropy=entropy,
        cu_seqlens=cu,
        rewards=rewards,
        zero_var=zero_var,
        advantages=adv,
        alpha=0.1,
        backend=backend,
        out=out,
    )
    ref = rl_zvp_reference(entropy, cu, rewards, zero_var, alpha=0.1, advantages=adv)
    assert_verbose_allclose(out.cpu(), ref.float())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton"])
def test_gpu_group_ids_with_num_groups_never_syncs(backend):
    """With num_groups the whole group_ids path stays on the device: CUDA's sync
    debug mode turns any host sync into an error."""
    rewards, ids = make_groups(301, seed=23, max_size=70, device="cuda")
    num_groups = int(torch.unique(ids).numel())
    ck.advantages.group_advantages(rewards, ids, num_groups=num_groups, backend=backend)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adv, zero_var, stats = ck.advantages.group_advantages(
            rewards, ids, num_groups=num_groups, backend=backend
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_adv, ref_zv, ref_mean, _ = group_advantages_reference(rewards, ids)
    assert torch.equal(zero_var.cpu(), ref_zv)
    assert_verbose_allclose(adv.cpu(), ref_adv.float(), name="adv")
    assert_verbose_allclose(stats.group_mean.cpu(), ref_mean, atol=1e-12, rtol=1e-12)
