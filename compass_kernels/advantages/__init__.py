"""Group advantages, zero-variance elimination and RL-ZVP (ck.advantages).

The template every op copies: public functions here (checks, dispatch,
torch.library registration with fake kernels), kernels in csrc/advantages
(C++ and CUDA) and ``triton.py``, the spec in ``reference.py``.

None of these ops is differentiable: rewards carry no gradient and RL-ZVP uses
the detached entropy, so outputs never require grad.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compass_kernels import _dispatch
from compass_kernels._ext import cuda_stream, dl, dl_opt, load
from compass_kernels._validate import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_finite,
    check_offsets,
    check_tensor,
    describe,
)

__all__ = ["GroupStats", "group_advantages", "rl_zvp", "overlong_penalty", "MODES"]

MODES = {"grpo": 0, "dr_grpo": 1, "rloo": 2}


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics from :func:`group_advantages` (all on the rewards' device).

    group_ids : [G] the id of each group (increasing), or None with ``group_size``.
    counts : [G] int64 samples per group.
    group_mean, group_std : [G] float64 (unbiased std; 0 for a group of one).
    group_zero_var : [G] bool.
    """

    group_ids: torch.Tensor | None
    counts: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    group_zero_var: torch.Tensor

    @property
    def num_groups(self) -> int:
        return self.counts.numel()

    @property
    def num_zero_var(self) -> torch.Tensor:
        return self.group_zero_var.sum()

    @property
    def zero_var_fraction(self) -> torch.Tensor:
        return self.group_zero_var.to(torch.float64).mean()


# ------------------------------------------------------------------ kernels


def _group_kernel(backend, rewards, order, offsets, mode, eps, tol, out=None):
    """Run one backend; ``out`` = (adv, zero_var, mean, std) to write into (tests poison it)."""
    n, groups = rewards.numel(), offsets.numel() - 1
    if out is None:
        out = (
            torch.empty_like(rewards),
            torch.empty(n, dtype=torch.bool, device=rewards.device),
            torch.empty(groups, dtype=torch.float64, device=rewards.device),
            torch.empty(groups, dtype=torch.float64, device=rewards.device),
        )
    adv, zero_var, mean, std = out
    if backend == "triton":
        from compass_kernels.advantages.triton import group_advantages_triton

        group_advantages_triton(rewards, order, offsets, mode, eps, tol, *out)
        return out
    args = [dl(rewards), dl(order), dl(offsets), mode, eps, tol,
            dl(adv), dl(zero_var), dl(mean), dl(std)]  # fmt: skip
    if backend == "cpp":
        load().advantages.group_advantages_cpu(*args)
    else:
        load().advantages.group_advantages_cuda(*args, cuda_stream(rewards))
    return out


def _zvp_kernel(backend, entropy, cu_seqlens, rewards, zero_var, advantages, alpha, out=None):
    if out is None:
        out = torch.empty_like(entropy)
    if backend == "triton":
        from compass_kernels.advantages.triton import rl_zvp_triton

        rl_zvp_triton(entropy, cu_seqlens, rewards, zero_var, advantages, alpha, out)
        return out
    args = [dl(entropy), dl(cu_seqlens), dl(rewards), dl(zero_var), dl_opt(advantages),
            alpha, dl(out)]  # fmt: skip
    if backend == "cpp":
        load().advantages.rl_zvp_cpu(*args)
    else:
        load().advantages.rl_zvp_cuda(*args, cuda_stream(entropy))
    return out


# ------------------------------------------------------- torch.library ops

_lib = torch.library.Library("compass", "FRAGMENT")
_lib.define(
    "group_advantages(Tensor rewards, Tensor order, Tensor offsets, int mode, float eps, "
    "float zero_var_tol) -> (Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "rl_zvp(Tensor entropy, Tensor cu_seqlens, Tensor rewards, Tensor zero_var, "
    "Tensor? advantages, float alpha) -> Tensor"
)


def _group_op(rewards, order, offsets, mode, eps, tol):
    backend = _dispatch.resolve(rewards.device, None)
    return _group_kernel(backend, rewards, order, offsets, mode, eps, tol)


def _zvp_op(entropy, cu_seqlens, rewards, zero_var, advantages, alpha):
    backend = _dispatch.resolve(entropy.device, None)
    return _zvp_kernel(backend, entropy, cu_seqlens, rewards, zero_var, advantages, alpha)


for _key in ("CPU", "CUDA"):
    _lib.impl("group_advantages", _group_op, _key)
    _lib.impl("rl_zvp", _zvp_op, _key)


@torch.library.register_fake("compass::group_advantages")
def _group_fake(rewards, order, offsets, mode, eps, tol):
    groups = offsets.shape[0] - 1
    return (
        torch.empty_like(rewards),
        rewards.new_empty(rewards.shape, dtype=torch.bool),
        rewards.new_empty((groups,), dtype=torch.float64),
        rewards.new_empty((groups,), dtype=torch.float64),
    )


@torch.library.register_fake("compass::rl_zvp")
def _zvp_fake(entropy, cu_seqlens, rewards, zero_var, advantages, alpha):
    return torch.empty_like(entropy)


# ------------------------------------------------------------- public API


def _groups_from_ids(group_ids: torch.Tensor):
    """(order, offsets, unique ids, counts): members of each group made contiguous
    by a stable sort. One host sync (the number of groups)."""
    sorted_ids, order = torch.sort(group_ids.to(torch.int64), stable=True)
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=group_ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order, offsets, unique, counts


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    mode: str = "grpo",
    eps: float = 1e-6,
    zero_var_tol: float = 1e-6,
    validate: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, GroupStats]:
    """Group-relative advantages and the zero-variance flag, per sample.

    Parameters
    ----------
    rewards : [n] float16 | bfloat16 | float32 | float64 (half types computed as float32).
    group_ids : [n] integer ids (any order); samples with equal ids form a group.
    group_size : instead of ``group_ids``: groups are consecutive runs of this size.
    mode : "grpo" | "dr_grpo" | "rloo" (see ``reference.group_advantages_reference``).
    eps : added to the std in "grpo".
    zero_var_tol : a group is zero-variance when it has one sample or its
        unbiased std, computed in float64, is <= this; its advantages are exactly 0.
    validate : check rewards are finite (one host sync).
    backend : None (default dispatch), "cpp", "cuda" or "triton".

    Returns
    -------
    adv : [n] float32 (float64 for float64 rewards).
    zero_var : [n] bool, True for samples of zero-variance groups.
    stats : :class:`GroupStats`.
    """
    check_tensor("rewards", rewards, ndim=1, dtypes=FLOAT_DTYPES)
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {tuple(MODES)}, got {mode!r}")
    if not (eps >= 0 and zero_var_tol >= 0):
        raise ValueError(f"eps and zero_var_tol: expected >= 0, got {eps} and {zero_var_tol}")
    n = rewards.shape[0]
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids (a tensor) or group_size (an int)")
    if group_ids is not None:
        check_tensor("group_ids", group_ids, ndim=1, dtypes=INT_DTYPES, size=n,
                     size_what="one id per reward", device=rewards.device)  # fmt: skip
        order, offsets, unique, counts = _groups_from_ids(group_ids)
    else:
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
        if n % group_size:
            raise ValueError(f"group_size: {group_size} does not divide len(rewards) = {n}")
        order = torch.arange(n, device=rewards.device)
        offsets = torch.arange(0, n + 1, group_size, device=rewards.device)
        unique, counts = None, torch.full((n // group_size,), group_size, device=rewards.device)
    if validate:
        check_finite("rewards", rewards)
    r = rewards.detach()
    r = (r if r.dtype == torch.float64 else r.to(torch.float32)).contiguous()
    chosen = _dispatch.resolve(r.device, backend)
    if backend is None:
        adv, zero_var, mean, std = torch.ops.compass.group_advantages(
            r, order, offsets, MODES[mode], eps, zero_var_tol)  # fmt: skip
    else:
        adv, zero_var, mean, std = _group_kernel(
            chosen, r, order, offsets, MODES[mode], eps, zero_var_tol)  # fmt: skip
    group_zero_var = zero_var[order[offsets[:-1]]]
    return adv, zero_var, GroupStats(unique, counts, mean, std, group_zero_var)


def rl_zvp(
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    *,
    alpha: float = 0.1,
    advantages: torch.Tensor | None = None,
    validate: bool = True,
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
        and rewards are finite (host syncs). With validate=False, non-finite
        inputs give backend-dependent results (see ``rl_zvp_reference``).

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
    check_tensor("zero_var", zero_var, ndim=1, dtypes=(torch.bool,), size=n, size_what=what,
                 device=dev)  # fmt: skip
    if advantages is not None:
        check_tensor("advantages", advantages, ndim=1, dtypes=FLOAT_DTYPES, size=n,
                     size_what=what, device=dev)  # fmt: skip
    if not alpha >= 0:
        raise ValueError(f"alpha: expected >= 0, got {alpha}")
    cu = cu_seqlens.to(torch.int64).contiguous()
    if validate:
        check_offsets("cu_seqlens", cu, entropy.shape[0], exact=False)
        # Non-finite values make the backends disagree (std::max / fmaxf drop NaN,
        # the reference propagates it); padding tokens past cu_seqlens[-1] are not read.
        tokens = torch.arange(entropy.shape[0], device=dev) < cu[-1]
        check_finite("entropy", torch.where(tokens, entropy.detach(), 0))
        check_finite("rewards", rewards)
    h = entropy.detach().to(torch.float32).contiguous()
    r = rewards.detach()
    r = (r if r.dtype == torch.float64 else r.to(torch.float32)).contiguous()
    a = None
    if advantages is not None:
        a = advantages.detach()
        a = (a if a.dtype == torch.float64 else a.to(torch.float32)).contiguous()
    zv = zero_var.contiguous()
    chosen = _dispatch.resolve(dev, backend)
    if backend is None:
        return torch.ops.compass.rl_zvp(h, cu, r, zv, a, float(alpha))
    return _zvp_kernel(chosen, h, cu, r, zv, a, float(alpha))


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO overlong reward shaping per response, [n] float32 on ``lengths``' device.

    0 if L <= max_len - cache_len; ((max_len - cache_len) - L) / cache_len in
    between; -1 past max_len. Elementwise, so plain torch is already one fused
    pass per op; no custom kernel.
    """
    check_tensor("lengths", lengths, ndim=1, dtypes=INT_DTYPES)
    if not (isinstance(max_len, int) and max_len > 0):
        raise ValueError(f"max_len: expected a positive int, got {max_len!r}")
    if not (isinstance(cache_len, int) and 0 < cache_len <= max_len):
        raise ValueError(f"cache_len: expected an int in (0, max_len={max_len}], got {cache_len!r}")
    length = lengths.to(torch.float64)
    soft = float(max_len - cache_len)
    ramp = (soft - length) / cache_len
    penalty = torch.where(length <= soft, 0.0, torch.where(length <= max_len, ramp, -1.0))
    return penalty.to(torch.float32)
