"""Group advantages, zero-variance elimination and RL-ZVP (ck.advantages).

The template every op copies: public functions here (checks, dispatch,
torch.library registration with fake kernels), the GPU kernels in
``triton.py``, the spec and the CPU kernels (plain torch) in ``reference.py``.

None of these ops is differentiable: rewards carry no gradient and RL-ZVP uses
the detached entropy, so outputs never require grad.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

from compass_kernels._op import op
from compass_kernels._validate import (
    FLOAT_DTYPES,
    INT_DTYPES,
    as_float,
    as_int,
    check_finite,
    check_offsets,
    check_tensor,
    describe,
    has_no_data,
    should_check,
)

__all__ = [
    "GroupStats",
    "group_advantages",
    "rl_zvp",
    "overlong_penalty",
    "MODES",
    # adaptive rollout budgets (budget.py)
    "AllocationStats",
    "RolloutAllocator",
    "allocate_rollouts",
    "informative_probability",
    "token_costs",
    # rollout-budget policies behind one interface (policies.py)
    "policies",
    "BudgetPolicy",
    "POLICIES",
    "StepResult",
    "make_policy",
    "run_step",
]

MODES = {"grpo": 0, "dr_grpo": 1, "rloo": 2}


class GroupStats:
    """Per-group statistics from :func:`group_advantages` (all on the rewards' device).

    group_ids : [G] the id of each group (increasing), or None with ``group_size``.
    counts : [G] int64 samples per group.
    group_mean, group_std : [G] float64 (unbiased std; 0 for a group of one).
    group_zero_var : [G] bool.
    Everything is computed or sliced when read: the call never pays for it.
    """

    __slots__ = (
        "group_ids",
        "group_mean",
        "group_std",
        "_offsets",
        "_zero_var",
        "_order",
        "_group_size",
    )

    def __init__(self, group_ids, group_mean, group_std, offsets, zero_var, order, group_size):
        self.group_ids, self.group_mean, self.group_std = group_ids, group_mean, group_std
        self._offsets, self._zero_var = offsets, zero_var
        self._order, self._group_size = order, group_size  # order None: the group_size layout

    @property
    def counts(self) -> torch.Tensor:
        """[G] int64 samples per group."""
        return self._offsets.diff()

    @property
    def group_zero_var(self) -> torch.Tensor:
        """[G] bool: the group's rewards have (near) zero variance."""
        if self._order is None:
            return self._zero_var[:: self._group_size]
        return self._zero_var[self._order[self._offsets[:-1]]]

    def __repr__(self) -> str:
        return (
            f"GroupStats(num_groups={self.num_groups}, group_ids={self.group_ids}, "
            f"group_mean={self.group_mean}, group_std={self.group_std})"
        )

    @property
    def num_groups(self) -> int:
        """G, a host int."""
        return self.counts.numel()

    @property
    def num_zero_var(self) -> torch.Tensor:
        """0-d int64 device tensor: zero-variance groups."""
        return self.group_zero_var.sum()

    @property
    def zero_var_fraction(self) -> torch.Tensor:
        """0-d float64 device tensor: num_zero_var / num_groups."""
        return self.group_zero_var.to(torch.float64).mean()


# ---------------------------------------------------------------------- ops
# One declaration per op (compass_kernels/_op.py): torch.ops.compass.<name>,
# its fake (the output allocator), the backend table and the dispatch.


class GroupAdvantages(NamedTuple):
    """Outputs of :data:`group_advantages_op`."""

    adv: torch.Tensor  # [n] rewards' dtype
    zero_var: torch.Tensor  # [n] bool
    group_mean: torch.Tensor  # [G] float64
    group_std: torch.Tensor  # [G] float64


@op(
    kernels={
        "torch": "compass_kernels.advantages.reference:group_advantages_torch",
        "triton": "compass_kernels.advantages.triton:group_advantages_triton",
    }
)
def group_advantages_op(
    rewards: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    mode: int,
    eps: float,
    zero_var_tol: float,
) -> GroupAdvantages:
    """Per-group statistics and per-sample advantages over a grouping plan.

    rewards : [n] float32 | float64, contiguous.
    order : [n] int64, a permutation of 0..n-1: group g's members are
        ``order[offsets[g]:offsets[g+1]]``.
    offsets : [G+1] int64, offsets[0] == 0, non-decreasing, offsets[G] == n.
    mode : 0 GRPO ``(r - mean) / (std + eps)``, 1 Dr.GRPO ``r - mean``, 2 RLOO.
    eps : added to the std in GRPO.
    zero_var_tol : a group is zero-variance when it has < 2 members or its
        unbiased float64 std is <= this; its advantages are exactly 0.

    Returns adv [n] (rewards' dtype), zero_var [n] bool, group_mean and
    group_std [G] float64. The body allocates them (also the fake): the cheapest
    torch factories per call (empty_like(dtype=) 1.4 us, empty(Size, ...) 3.5 us).
    """
    groups, dev = len(offsets) - 1, rewards.device
    return GroupAdvantages(
        adv=torch.empty_like(rewards),
        zero_var=torch.empty_like(rewards, dtype=torch.bool),
        group_mean=torch.empty(groups, dtype=torch.float64, device=dev),
        group_std=torch.empty(groups, dtype=torch.float64, device=dev),
    )


@op(
    kernels={
        "torch": "compass_kernels.advantages.reference:rl_zvp_torch",
        "triton": "compass_kernels.advantages.triton:rl_zvp_triton",
    }
)
def rl_zvp_op(
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    advantages: torch.Tensor | None,
    alpha: float,
) -> torch.Tensor:
    """RL-ZVP token advantages.

    entropy : [T] float32. cu_seqlens : [n+1] int64, cu[0] == 0, non-decreasing,
    cu[n] <= T. rewards : [n] float32 | float64. zero_var : [n] bool.
    advantages : [n] float32 | float64 or None (0). alpha : the scale.
    Returns out [T] float32 (tokens past cu[n] get 0).
    """
    return torch.empty_like(entropy)


# ------------------------------------------------------------- public API


def _groups_from_ids(group_ids: torch.Tensor, num_groups: int | None = None):
    """(order, offsets, unique ids): members of each group made contiguous, stably.

    A stable sort and a scan on the ids' device; the number of groups costs one
    host sync unless ``num_groups`` is given, which is then checked: at once on
    CPU tensors, on CUDA on the device (``torch._assert_async``: a mismatch is a
    device-side assert, never a wrong answer)."""
    n = group_ids.shape[0]
    dev = group_ids.device
    sorted_ids, order = torch.sort(group_ids.to(torch.int64), stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=dev)  # a group starts here
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=starts[1:])
    group_of = starts.cumsum(0).sub_(1)  # group number of each sorted position
    if num_groups is None or (dev.type == "cpu" and not has_no_data(group_ids)):
        groups = int(group_of[-1]) + 1 if n else 0  # the one host sync (free on CPU)
        _expect_num_groups(num_groups, groups)
    else:
        groups = num_groups
        found = group_of[-1] + 1 if n else torch.zeros((), dtype=torch.int64, device=dev)
        torch._assert_async(found == groups, _NUM_GROUPS_MISMATCH)
    # offsets[g] = first sorted position of group g; every other position goes
    # to a scratch slot (index groups), overwritten with n afterwards.
    offsets = torch.empty(groups + 1, dtype=torch.int64, device=dev)
    target = torch.where(starts & (group_of < groups), group_of, groups)
    offsets.scatter_(0, target, torch.arange(n, device=dev))
    offsets[groups:].fill_(n)  # a slice fill: no host scalar copied to the device (no sync)
    unique = sorted_ids[offsets[:groups]]
    return order, offsets, unique


_NUM_GROUPS_MISMATCH = "num_groups: does not equal the number of distinct group_ids"


def _expect_num_groups(num_groups: int | None, groups: int) -> None:
    if num_groups is not None and num_groups != groups:
        raise ValueError(
            f"num_groups: expected the number of distinct group_ids, {groups}, got {num_groups}"
        )


# (n, group_size, device) -> (order, offsets): the identity plan of the
# group_size layout, built once per shape (internal, never handed to users).
_PLANS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _size_plan(n: int, group_size: int, device: torch.device):
    key = (n, group_size, device)
    if has_no_data():  # fake mode / tracing: tensors of that mode, never cached
        return torch.arange(n, device=device), torch.arange(0, n + 1, group_size, device=device)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 64:
            _PLANS.clear()
        plan = _PLANS[key] = (
            torch.arange(n, device=device),
            torch.arange(0, n + 1, group_size, device=device),
        )
    return plan


def _check_magnitude(rewards: torch.Tensor) -> None:
    """float64 rewards whose group sums or squared deviations would overflow float64
    (|r| near 1e308 turned into NaN advantages): refused, naming the bound. The
    statistics sum n values and n squares of deviations up to 2 max|r|, so
    max|r| <= sqrt(DBL_MAX / (4 n)) keeps every sum finite. Lower precisions
    cannot reach it (computed in float64)."""
    n = rewards.numel()
    if rewards.dtype != torch.float64 or n == 0:
        return
    bound = math.sqrt(sys.float_info.max / (4 * n))
    amax = float(rewards.abs().max())
    if amax > bound:
        i = int(rewards.abs().argmax())
        raise ValueError(
            f"rewards: |rewards[{i}]| = {amax:g} overflows the float64 group statistics "
            f"(sums of squares; at most {bound:.3g} for {n} rewards): rescale the rewards"
        )


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    num_groups: int | None = None,
    mode: str = "grpo",
    eps: float = 1e-6,
    zero_var_tol: float = 1e-6,
    validate: bool | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, GroupStats]:
    """Group-relative advantages and the zero-variance flag, per sample.

    Parameters
    ----------
    rewards : [n] float16 | bfloat16 | float32 | float64 (half types computed as float32).
    group_ids : [n] integer ids (any order); samples with equal ids form a group.
        On CUDA, grouping by ids needs one host sync (the number of groups)
        unless ``num_groups`` is given; the ``group_size`` layout needs none.
    group_size : instead of ``group_ids``: groups are consecutive runs of this size.
    num_groups : with ``group_ids``, the number of distinct ids if known (e.g.
        prompts in the batch): the CUDA path then never syncs the host. It is
        checked: a mismatch raises on CPU and is a device-side assert on CUDA.
    mode : "grpo" | "dr_grpo" | "rloo" (see ``reference.group_advantages_reference``).
    eps : added to the std in "grpo".
    zero_var_tol : a group is zero-variance when it has one sample or its
        unbiased std, computed in float64, is <= this; its advantages are exactly 0.
    validate : check that rewards are finite (``_validate.should_check``): None
        (default) on CPU tensors, not on CUDA (a host sync); True everywhere;
        False never; never on fake / meta tensors or while tracing.
        NaN / Inf policy: rewards must be finite (ValueError naming the first
        bad index where checked); unchecked, a non-finite reward gives NaN
        advantages, a NaN mean / std and zero_var False for its group only.
    backend : None (default dispatch), "torch" (CPU) or "triton" (CUDA).

    Returns
    -------
    adv : [n] float32 (float64 for float64 rewards).
    zero_var : [n] bool, True for samples of zero-variance groups.
    stats : :class:`GroupStats`.
    """
    check_tensor("rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES)
    code = MODES.get(mode)
    if code is None:
        raise ValueError(f"mode: expected one of {tuple(MODES)}, got {mode!r}")
    eps, zero_var_tol = as_float("eps", eps), as_float("zero_var_tol", zero_var_tol)
    if not (eps >= 0 and zero_var_tol >= 0):
        raise ValueError(f"eps and zero_var_tol: expected >= 0, got {eps} and {zero_var_tol}")
    n = rewards.shape[0]
    dev = rewards.device
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids (a tensor) or group_size (an int)")
    if group_ids is not None:
        check_tensor(
            "group_ids",
            group_ids,
            ndim=1,
            dtypes=INT_DTYPES,
            size=n,
            size_what="one id per reward",
            device=dev,
        )
        if num_groups is not None:
            num_groups = as_int("num_groups", num_groups, lo=0)
        order, offsets, unique = _groups_from_ids(group_ids, num_groups)
    else:
        if num_groups is not None:
            raise ValueError("num_groups: only with group_ids (group_size implies it)")
        group_size = as_int("group_size", group_size, lo=1)
        if n % group_size:
            raise ValueError(f"group_size: {group_size} does not divide len(rewards) = {n}")
        order, offsets = _size_plan(n, group_size, dev)
        unique = None
    if should_check(validate, rewards):
        check_finite("rewards", rewards)
        _check_magnitude(rewards)
    r = _real(rewards)
    res = group_advantages_op(
        rewards=r,
        order=order,
        offsets=offsets,
        mode=code,
        eps=float(eps),
        zero_var_tol=float(zero_var_tol),
        backend=backend,
    )
    layout = (None, group_size) if group_ids is None else (order, 0)
    stats = GroupStats(unique, res.group_mean, res.group_std, offsets, res.zero_var, *layout)
    return res.adv, res.zero_var, stats


def rl_zvp(
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    *,
    alpha: float = 0.1,
    advantages: torch.Tensor | None = None,
    validate: bool | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """RL-ZVP token advantages (arXiv 2509.21880) for groups still zero-variance.

    Parameters
    ----------
    entropy : [T] float (detached; computed in float32), tokens of all responses packed.
    cu_seqlens : [n+1] int32 | int64 response boundaries, cu_seqlens[0] == 0,
        non-decreasing, cu_seqlens[-1] <= T (tokens after it are padding, get 0).
    rewards : [n] float; the sign picks the branch.
    zero_var : [n] bool, e.g. from :func:`group_advantages`.
    alpha : scale, 0.1 in the paper.
    advantages : optional [n] float per-sequence advantages broadcast to the
        tokens of the other sequences (0 when None).
    validate : check cu_seqlens, and that entropy (tokens before cu_seqlens[-1])
        and rewards are finite (``_validate.should_check``): None (default) on
        CPU tensors, not on CUDA (host syncs); True everywhere; False never;
        never on fake / meta tensors or while tracing; malformed cu_seqlens on
        an unchecked CUDA call are undefined behaviour, as for any varlen kernel. NaN / Inf policy:
        entropy (up to cu_seqlens[-1]) and rewards must be finite (ValueError
        naming the argument where checked); unchecked, non-finite values give
        backend-dependent values in their own sequence's tokens only (see
        ``rl_zvp_reference``); ``advantages`` is broadcast as given.

    Returns
    -------
    token_adv : [T] float32. For a zero-variance sequence i with reward > 0,
    alpha * H_t; otherwise -alpha * (max over the sequence of H - H_t).
    """
    check_tensor("entropy", entropy, ndim=1, dtypes=FLOAT_DTYPES)
    dev = entropy.device
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    if cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens: expected at least 1 element (n+1), got {describe(cu_seqlens)}"
        )
    n = cu_seqlens.numel() - 1
    what = "one per sequence = len(cu_seqlens) - 1"
    check_tensor(
        "rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES, size=n, size_what=what, device=dev
    )
    check_tensor(
        "zero_var", zero_var, ndim=1, dtypes=(torch.bool,), size=n, size_what=what, device=dev
    )
    if advantages is not None:
        check_tensor(
            "advantages",
            advantages,
            ndim=1,
            dtypes=FLOAT_DTYPES,
            size=n,
            size_what=what,
            device=dev,
        )
    alpha = as_float("alpha", alpha, finite=False)
    if not alpha >= 0:
        raise ValueError(f"alpha: expected >= 0, got {alpha}")
    cu = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    cu = cu.contiguous()
    if should_check(validate, entropy, cu, rewards):
        check_offsets("cu_seqlens", cu, entropy.shape[0], exact=False)
        # Non-finite values make the backends disagree (Triton's max drops NaN,
        # the reference propagates it); padding tokens past cu_seqlens[-1] are not read.
        tokens = torch.arange(entropy.shape[0], device=dev) < cu[-1]
        check_finite("entropy", torch.where(tokens, entropy.detach(), 0))
        check_finite("rewards", rewards)
    h = _real(entropy, torch.float32)
    r = _real(rewards)
    a = None if advantages is None else _real(advantages)
    return rl_zvp_op(
        entropy=h,
        cu_seqlens=cu,
        rewards=r,
        zero_var=zero_var.contiguous(),
        advantages=a,
        alpha=float(alpha),
        backend=backend,
    )


def _real(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Detached, contiguous, float32 (or float64 kept) without copying when already so."""
    if t.requires_grad:
        t = t.detach()
    want = dtype or (torch.float64 if t.dtype == torch.float64 else torch.float32)
    if t.dtype != want:
        t = t.to(want)
    return t if t.is_contiguous() else t.contiguous()


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO overlong reward shaping per response, [n] float32 on ``lengths``' device.

    0 if L <= max_len - cache_len; ((max_len - cache_len) - L) / cache_len in
    between; -1 past max_len. Elementwise, so plain torch is already one fused
    pass per op; no custom kernel.
    """
    check_tensor("lengths", lengths, ndim=1, dtypes=INT_DTYPES)
    max_len = as_int("max_len", max_len, lo=1)
    cache_len = as_int("cache_len", cache_len)
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len: expected an int in (0, max_len={max_len}], got {cache_len!r}")
    length = lengths.to(torch.float64)
    soft = float(max_len - cache_len)
    ramp = (soft - length) / cache_len
    penalty = torch.where(length <= soft, 0.0, torch.where(length <= max_len, ramp, -1.0))
    return penalty.to(torch.float32)


from compass_kernels.advantages import policies  # noqa: E402
from compass_kernels.advantages.budget import (  # noqa: E402  (after the ops it sits beside)
    AllocationStats,
    RolloutAllocator,
    allocate_rollouts,
    informative_probability,
    token_costs,
)
from compass_kernels.advantages.policies import (  # noqa: E402
    POLICIES,
    BudgetPolicy,
    StepResult,
    make_policy,
    run_step,
)


def __dir__() -> list[str]:
    """dir(): the public names only (imports and helpers stay attributes, unlisted)."""
    return sorted(__all__)
