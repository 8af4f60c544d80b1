"""ck.advantages: every backend against the float64 reference, bad inputs, op registration.

Triton-backend tests live in test_advantages_triton.py; the GPU tests here run
wherever a CUDA device is (marker gpu). The CUDA kernels also run here without
a GPU, under the SIMT emulator (backend "cuda-emulated", marker emulated).
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels import _dispatch, _emu
from compass_kernels._ext import BackendUnavailableError, dl, load, triton_interpreting
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


EMULATED = pytest.param("cuda-emulated", marks=pytest.mark.emulated)


def cpu_backends():
    """Backends every machine runs: C++ (CPU tensors), Triton, on CUDA tensors
    where a GPU is and in the interpreter on CPU tensors where none is (see
    :func:`backend_device`), and the CUDA kernels under the emulator (CPU tensors)."""
    return ["cpp", pytest.param("triton", marks=pytest.mark.triton), EMULATED]


@pytest.fixture
def backend_device(backend) -> str:
    """The device ``backend`` runs on here: Triton on CUDA tensors when a GPU is
    present (the interpreter, and so Triton on CPU tensors, is off there)."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


# -------------------------------------------------------- group advantages


@pytest.mark.parametrize("backend", [None, EMULATED])
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
    _, zero_var, stats = ck.advantages.group_advantages(rewards, ids, zero_var_tol=tol,
                                                        backend=backend)  # fmt: skip
    rows = _per_group_by_hand(rewards.cpu(), ids.cpu(), tol)
    assert len(rows) == stats.num_groups == 41
    assert stats.group_ids.tolist() == [r[0] for r in rows]
    assert stats.counts.dtype == torch.int64 and stats.counts.tolist() == [r[1] for r in rows]
    assert_verbose_allclose(stats.group_mean.cpu(), torch.tensor([r[2] for r in rows],
                            dtype=torch.float64), atol=1e-12, rtol=1e-12, name="mean")  # fmt: skip
    assert_verbose_allclose(stats.group_std.cpu(), torch.tensor([r[3] for r in rows],
                            dtype=torch.float64), atol=1e-12, rtol=1e-12, name="std")  # fmt: skip
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
    """Rewards and ids for each path of the cpp backend's fused group_ids call:
    sorted runs; shuffled ids in a compact range (by value); shuffled ids in a
    range wider than max(n, 65536) (a stable sort and the gather kernel)."""
    rewards, ids = make_groups(num_groups, seed=seed, max_size=40)
    if layout == "sorted":
        order = torch.sort(ids, stable=True).indices
        rewards, ids = rewards[order], ids[order]
    elif layout == "wide":
        ids = ids * 1_000_003
    elif layout == "uint8":
        ids = (ids + 5).to(torch.uint8)  # make_groups: ids >= -5, < 30 * 61
        ids = torch.unique(ids, return_inverse=True)[1].to(torch.uint8)
    elif layout == "int32":
        ids = ids.to(torch.int32)
    return rewards, ids


@pytest.mark.parametrize("layout", ["sorted", "shuffled", "wide", "int32", "uint8"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_group_ids_path_writes_every_output(layout, mode, dtype):
    """The cpp backend's one-call group_ids path (plan and advantages), on poisoned
    worst-case buffers: the first G entries of every per-group output, and every
    per-sample output, equal the reference; nothing past G is touched."""
    rewards, ids = _ids_layout(layout, seed=len(layout) + MODES[mode])
    rewards = rewards.to(dtype)
    n = rewards.numel()
    adv, zv = empty_poisoned(n, dtype), empty_poisoned(n, torch.bool)
    stats, index = empty_poisoned(2 * n, torch.float64), empty_poisoned(3 * n + 1, torch.int64)
    stats_before, index_before = stats.clone(), index.clone()
    groups = load().advantages.group_advantages_ids_cpu(
        rewards, ids, MODES[mode], 1e-6, 1e-6, adv, zv, stats, index
    )
    mean, std = stats[:groups], stats[n : n + groups]
    unique, first = index[:groups], index[n : n + groups]
    offsets = index[2 * n : 2 * n + groups + 1]
    ref_adv, ref_zv, ref_mean, ref_std = group_advantages_reference(rewards, ids, mode=mode)
    ref_unique, inverse, ref_counts = torch.unique(ids.long(), return_inverse=True,
                                                   return_counts=True)  # fmt: skip
    assert groups == ref_unique.numel()
    assert torch.equal(zv, ref_zv)
    assert_verbose_allclose(adv, ref_adv.to(dtype), name="adv")
    assert_verbose_allclose(mean, ref_mean, atol=1e-12, rtol=1e-12, name="mean")
    assert_verbose_allclose(std, ref_std, atol=1e-12, rtol=1e-12, name="std")
    assert torch.equal(unique, ref_unique)
    assert offsets[0] == 0 and torch.equal(offsets.diff(), ref_counts)
    ref_first = torch.tensor([int((inverse == g).nonzero()[0]) for g in range(groups)])
    assert torch.equal(first, ref_first)
    # nothing past G is written
    for part, before, width in ((stats, stats_before, n), (index, index_before, n)):
        for k in range(part.numel() // width):
            tail = slice(k * width + groups + (1 if k == 2 else 0), (k + 1) * width)
            assert _as_bits(part[tail]) == _as_bits(before[tail])


def _as_bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", ["sorted", "shuffled", "wide"])
def test_fused_group_ids_path_through_the_public_api(layout):
    """GroupStats from the fused path: counts, per-group zero-variance flags (via
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
def test_fused_group_ids_path_rejects_non_finite_rewards(layout, bad):
    rewards, ids = _ids_layout(layout, seed=5)
    rewards[17] = bad
    with pytest.raises(ValueError, match="rewards: expected finite values.* at index 17"):
        ck.advantages.group_advantages(rewards, ids)


@pytest.mark.parametrize("backend", [None, EMULATED])
@pytest.mark.parametrize("layout", ["sorted", "shuffled", "wide"])
def test_num_groups_is_checked(backend, layout):
    rewards, ids = _ids_layout(layout, seed=9)
    groups = int(torch.unique(ids).numel())
    if backend is not None:
        _emu.install()
    adv, _, stats = ck.advantages.group_advantages(rewards, ids, num_groups=groups,
                                                   backend=backend)  # fmt: skip
    assert stats.num_groups == groups
    assert_verbose_allclose(adv, group_advantages_reference(rewards, ids)[0].float())
    for wrong in (groups - 1, groups + 1):
        with pytest.raises(ValueError, match=f"num_groups: expected .* {groups}, got {wrong}"):
            ck.advantages.group_advantages(rewards, ids, num_groups=wrong, backend=backend)
    with pytest.raises(ValueError, match="num_groups: expected a non-negative int"):
        ck.advantages.group_advantages(rewards, ids, num_groups=-1)
    with pytest.raises(ValueError, match="num_groups: only with group_ids"):
        ck.advantages.group_advantages(rewards, group_size=1, num_groups=groups)


def test_fused_group_ids_boundary_names_arguments():
    C = load().advantages
    r, ids = torch.rand(6), torch.tensor([3, 1, 3, 1, 2, 2])
    outs = lambda n=6: [torch.empty(n), torch.empty(n, dtype=torch.bool),
                        torch.empty(2 * n, dtype=torch.float64),
                        torch.empty(3 * n + 1, dtype=torch.int64)]  # fmt: skip
    with pytest.raises(ValueError, match="group_ids: expected size 6"):
        C.group_advantages_ids_cpu(r, ids[:5], 0, 1e-6, 1e-6, *outs())
    with pytest.raises(ValueError, match="group_ids: expected dtype"):
        C.group_advantages_ids_cpu(r, ids.float(), 0, 1e-6, 1e-6, *outs())
    bad = outs()
    bad[3] = torch.empty(18, dtype=torch.int64)
    with pytest.raises(ValueError, match="index: expected size 19"):
        C.group_advantages_ids_cpu(r, ids, 0, 1e-6, 1e-6, *bad)
    bad = outs()
    bad[2] = torch.empty(12, dtype=torch.float32)
    with pytest.raises(ValueError, match="stats: expected dtype float64"):
        C.group_advantages_ids_cpu(r, ids, 0, 1e-6, 1e-6, *bad)
    with pytest.raises(ValueError, match="mode: expected 0"):
        C.group_advantages_ids_cpu(r, ids, 7, 1e-6, 1e-6, *outs())


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
    group_advantages_op.run((rewards, order, offsets, MODES[mode], 1e-6, 1e-6), backend, out)
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
        torch.zeros(0), torch.zeros(0, dtype=torch.int64))  # fmt: skip
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


def test_cpp_boundary_rejects_bad_plans():
    """The C++ entry checks its own arguments: a bad plan is an error, not a crash."""
    C = load()
    r = torch.ones(4)
    outs_for = lambda groups: [torch.empty(4), torch.empty(4, dtype=torch.bool),
                               torch.empty(groups, dtype=torch.float64),
                               torch.empty(groups, dtype=torch.float64)]  # fmt: skip
    outs = outs_for(2)
    good_order, good_off = torch.arange(4), torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="offsets: expected non-decreasing.*offsets\\[1\\] = 3"):
        C.advantages.group_advantages_cpu(dl(r), dl(good_order), dl(torch.tensor([0, 3, 1, 4])),
                                          0, 1e-6, 1e-6, *[dl(o) for o in outs_for(3)])  # fmt: skip
    cases = [
        (good_order, torch.tensor([0, 2, 5]), "offsets: expected offsets\\[0\\] == 0"),
        (torch.tensor([0, 1, 2, 9]), good_off, "order: expected indices in \\[0, 4\\)"),
        (good_order.int(), good_off, "order: expected dtype int64"),
    ]
    for order, off, match in cases:
        with pytest.raises(ValueError, match=match):
            C.advantages.group_advantages_cpu(dl(r), dl(order), dl(off), 0, 1e-6, 1e-6,
                                              *[dl(o) for o in outs])  # fmt: skip
    with pytest.raises(ValueError, match="adv: expected dtype float32"):
        bad = [torch.empty(4, dtype=torch.float64)] + outs[1:]
        C.advantages.group_advantages_cpu(dl(r), dl(good_order), dl(good_off), 0, 1e-6, 1e-6,
                                          *[dl(o) for o in bad])  # fmt: skip


# ----------------------------------------------------------------- RL-ZVP


@pytest.mark.parametrize("backend", [None, EMULATED])
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
    rl_zvp_op.run((entropy, cu, rewards, zero_var, adv.double(), 0.25), backend, (out,))
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
        ck.advantages.rl_zvp(torch.rand(5), cu, torch.ones(2), torch.ones(2, dtype=torch.bool),
                             alpha=float("nan"))  # fmt: skip
    with pytest.raises(ValueError, match="advantages: expected 2 elements"):
        ck.advantages.rl_zvp(torch.rand(5), cu, torch.ones(2), torch.ones(2, dtype=torch.bool),
                             advantages=torch.ones(3))  # fmt: skip


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_rl_zvp_rejects_non_finite_entropy_and_rewards(bad):
    entropy, cu, rewards, zero_var, adv = make_sequences(9, seed=6, pad=4)
    end = int(cu[-1])
    h = entropy.clone()
    h[end - 2] = bad
    with pytest.raises(ValueError, match=rf"entropy: expected finite values, got {bad} at index "
                       rf"{end - 2}"):  # fmt: skip
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
    # The C++ (CPU) kernel checks for free whatever validate says; on other
    # backends validate=False is the documented opt-out: no check, no error.
    r[5] = bad
    with pytest.raises(ValueError, match="rewards: expected finite values"):
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


def test_cpp_boundary_rejects_bad_offsets_without_python_checks():
    C = load()
    h, r, zv, out = torch.rand(5), torch.ones(2), torch.ones(2, dtype=torch.bool), torch.empty(5)
    with pytest.raises(ValueError, match="cu_seqlens: expected cu_seqlens\\[-1\\] <= 5.*got 9"):
        C.advantages.rl_zvp_cpu(
            dl(h), dl(torch.tensor([0, 2, 9])), dl(r), dl(zv), None, 0.1, dl(out)
        )


@pytest.mark.emulated
def test_cuda_boundary_checks_arguments_under_emulation():
    """The CUDA entry points run the same argument checks as the C++ ones."""
    r, order, off = torch.ones(4), torch.arange(4), torch.tensor([0, 2, 4])
    f64 = dict(dtype=torch.float64)
    outs = [torch.empty(4, **f64), torch.empty(4, dtype=torch.bool),
            torch.empty(2, **f64), torch.empty(2, **f64)]  # fmt: skip
    with pytest.raises(ValueError, match="adv: expected dtype float32"):
        _emu.call("advantages.group_advantages_cuda", r, order, off, 0, 1e-6, 1e-6, *outs)
    h, cu, zv = torch.ones(5, **f64), torch.tensor([0, 2, 5]), torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="entropy: expected dtype float32"):
        _emu.call("advantages.rl_zvp_cuda", h, cu, torch.ones(2), zv, None, 0.1, torch.empty(5))


@pytest.mark.emulated
def test_cuda_boundary_bad_plan_is_an_out_of_bounds_access_under_emulation():
    """The CUDA entries do not read index data on the host (that would sync): a bad
    plan is a silent wild access on a GPU, and the emulator names it."""
    r, off = torch.ones(4), torch.tensor([0, 2, 4])
    outs = [torch.empty(4), torch.empty(4, dtype=torch.bool),
            torch.empty(2, dtype=torch.float64), torch.empty(2, dtype=torch.float64)]  # fmt: skip
    where = r"::group_kernel<float>, block \(0,0,0\), thread \(\d+,0,0\)"
    what = r"byte offset 36 of 'rewards' \(float32\[4\]\), 16 bytes at 0x[0-9a-f]+, past its end"
    with pytest.raises(_emu.OutOfBoundsError, match=f"global read of 4 bytes .*{where}: {what}"):
        bad_order = torch.tensor([0, 1, 2, 9])
        _emu.call("advantages.group_advantages_cuda", r, bad_order, off, 0, 1e-6, 1e-6, *outs)
    h, zv, out = torch.rand(5), torch.ones(2, dtype=torch.bool), torch.empty(5)
    bad_cu = torch.tensor([0, 2, 9])
    with pytest.raises(
        _emu.OutOfBoundsError, match=r"read .*::zvp_kernel<float, float>.*'entropy'"
    ):
        _emu.call("advantages.rl_zvp_cuda", h, bad_cu, torch.ones(2), zv, None, 0.1, out)


# Planted bugs (cmake/emu.cmake builds each into _C_emu.mutants): every one must
# fail one of the tests above under the emulated CUDA backend. The first two
# passed every test (the sm_90a compile checks included) before the emulator.
MUTANTS = {
    "stride16": ("group", "AssertionError", None),
    "tail_not_cleared": ("zvp", "AssertionError", None),
    "group_guard_off_by_one": ("group", "OutOfBoundsError", "read of 8 bytes .*'offsets'"),
    "idle_lanes_exit": ("group", "InactiveLaneError", "__shfl_xor_sync .* which has exited"),
    "idle_threads_exit": ("zvp", "InactiveLaneError", "__shfl_xor_sync .* which has exited"),
    "block_max_no_barrier": ("zvp", "UninitializedSharedMemoryError", "static shared memory"),
}


@pytest.mark.emulated
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_emulated_backend_catches_planted_bugs(mutant):
    test, error, match = MUTANTS[mutant]
    expected = AssertionError if error == "AssertionError" else getattr(_emu, error)
    with _emu.mutant(mutant), pytest.raises(expected, match=match):
        if test == "group":
            test_group_kernel_writes_every_output("cuda-emulated", "grpo", "cpu")
        else:
            test_rl_zvp_kernel_writes_every_output("cuda-emulated", "cpu")


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
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        ck.advantages.group_advantages(torch.ones(2), group_size=2, backend="cuda")
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
    torch.library.opcheck(torch.ops.compass.group_advantages.default,
                          (rewards, order, offsets, 0, 1e-6, 1e-6))  # fmt: skip
    entropy, cu, r, zv, adv = make_sequences(11, seed=8)
    torch.library.opcheck(torch.ops.compass.rl_zvp.default, (entropy, cu, r, zv, adv, 0.1))
    torch.library.opcheck(torch.ops.compass.rl_zvp.default, (entropy, cu, r, zv, None, 0.1))


def test_registered_op_traces_under_torch_compile():
    import torch._dynamo

    assert not torch._dynamo.config.disable, "dynamo is off here (a live vLLM engine?)"
    entropy, cu, r, zv, adv = make_sequences(11, seed=9)
    fn = torch.compile(lambda *a: torch.ops.compass.rl_zvp(*a, 0.1) * 2.0, backend="eager",
                       fullgraph=True)  # fmt: skip
    ref = rl_zvp_reference(entropy, cu, r, zv, advantages=adv) * 2.0
    assert_verbose_allclose(fn(entropy, cu, r, zv, adv), ref.float())


# ------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_group_advantages(backend, mode):
    rewards, ids = make_groups(301, seed=21, max_size=70, device="cuda")
    adv, zero_var, stats = ck.advantages.group_advantages(rewards, ids, mode=mode, backend=backend)
    ref_adv, ref_zv, ref_mean, _ = group_advantages_reference(rewards, ids, mode=mode)
    assert torch.equal(zero_var.cpu(), ref_zv)
    assert_verbose_allclose(adv.cpu(), ref_adv.float(), name="adv")
    assert_verbose_allclose(stats.group_mean.cpu(), ref_mean, atol=1e-12, rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_rl_zvp(backend):
    entropy, cu, rewards, zero_var, adv = make_sequences(257, seed=22, max_len=3000, device="cuda")
    out = empty_poisoned(entropy.numel(), torch.float32, "cuda")
    rl_zvp_op.run((entropy, cu, rewards, zero_var, adv, 0.1), backend, (out,))
    ref = rl_zvp_reference(entropy, cu, rewards, zero_var, alpha=0.1, advantages=adv)
    assert_verbose_allclose(out.cpu(), ref.float())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
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
