"""Triton kernels of ck.advantages: group advantages and RL-ZVP token advantages.

Same contract as the torch backend (the spec and the torch kernels are in
``reference.py``); outputs are allocated by the caller and written here. The
kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``
(tests), and compile ahead of time for sm_90a (tests/test_aot.py).

Both ops are memory-bound segment reductions over at most a few million
elements, so the design goal is determinism and no host syncs, not peak
bandwidth: one program per segment, looping over BLOCK-sized chunks so a
segment of any length works, no atomics.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import torch
import triton
import triton.language as tl

from compass_kernels._validate import check_tensor

__all__ = [
    "group_advantages_triton",
    "rl_zvp_triton",
    "GROUP_BLOCK",
    "ZVP_BLOCK",
    "GROUP_LAUNCH",
    "ZVP_LAUNCH",
]

#: Members per chunk of the group loop. Groups are typically 8-64 rollouts, so a
#: larger block would mostly be masked-off lanes; 256 float64 values per
#: program-iteration keep 4 warps busy without wasting registers on tiny groups.
GROUP_BLOCK = 256
#: Tokens per chunk of the RL-ZVP loops (float32, sequences up to ~64k tokens).
ZVP_BLOCK = 1024

#: Launch options of each kernel (tests/test_aot.py compiles with exactly these).
#: ``maxnreg`` on the group kernel: without a register budget in the PTX, the
#: ptxas of CUDA 12.8 (bundled with triton 3.6) picks 32-40 registers for this
#: float64 kernel and spills 4-8 B (measured on an H100: 32 registers, 4 B spill
#: stores/loads for fp64 RLOO); with ``.maxnreg 64`` it uses 48-56 and spills
#: nothing, with ptxas 12.8 and 13.x alike. 64 x 128 threads still fits 8 CTAs
#: per SM, plenty for a memory-bound segment reduction.
GROUP_LAUNCH = {"num_warps": 4, "maxnreg": 64}
ZVP_LAUNCH = {"num_warps": 4}


def _f64_bits(x: float) -> int:
    """The bits of float64 ``x`` as an int64.

    Triton passes Python floats as fp32 scalars; eps and the zero-variance
    tolerance must stay float64 (the spec compares std <= tol in float64), so
    they travel as int64 bits and are bitcast back inside the kernel. This
    avoids allocating a device tensor for two scalars.
    """
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


# The bits arguments are not value-specialized (a bit pattern equal to 1 would
# otherwise become a constexpr); small values still arrive as i32, hence the
# widening to int64 before the bitcast.
@triton.jit(do_not_specialize=["eps_bits", "tol_bits"])
def _group_advantages_kernel(
    r_ptr,
    order_ptr,
    offsets_ptr,
    adv_ptr,
    zero_var_ptr,
    mean_ptr,
    std_ptr,
    eps_bits,
    tol_bits,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    count = end - start
    eps = eps_bits.to(tl.int64).to(tl.float64, bitcast=True)
    tol = tol_bits.to(tl.int64).to(tl.float64, bitcast=True)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    # An empty group (allowed: offsets are only non-decreasing) gets mean 0, std 0.
    cf = tl.maximum(count, 1).to(tl.float64)

    # Two-pass float64 mean / M2: exact enough that a group of identical rewards
    # (e.g. 0.1 repeated) gives M2 == 0, which a one-pass E[x^2]-E[x]^2 does not;
    # a fixed reduction tree per program keeps it deterministic.
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for base in range(start, end, BLOCK):
        idx = base + lanes
        m = idx < end
        i = tl.load(order_ptr + idx, mask=m, other=0)
        acc += tl.load(r_ptr + i, mask=m, other=0.0).to(tl.float64)
    mean = tl.sum(acc, axis=0) / cf

    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for base in range(start, end, BLOCK):
        idx = base + lanes
        m = idx < end
        i = tl.load(order_ptr + idx, mask=m, other=0)
        d = tl.load(r_ptr + i, mask=m, other=0.0).to(tl.float64) - mean
        acc += tl.where(m, d * d, 0.0)
    m2 = tl.sum(acc, axis=0)

    many = count >= 2
    std = tl.where(many, tl.sqrt(m2 / tl.maximum(cf - 1.0, 1.0)), 0.0)
    zero = (count < 2) | (std <= tol)
    tl.store(mean_ptr + g, mean)
    tl.store(std_ptr + g, std)

    if MODE == 0:  # GRPO
        scale = 1.0 / tl.where(zero, 1.0, std + eps)
    elif MODE == 1:  # Dr.GRPO
        scale = 1.0
    else:  # RLOO: r - (sum - r) / (c - 1) == (r - mean) * c / (c - 1)
        scale = cf / tl.maximum(cf - 1.0, 1.0)
    zero_lanes = (lanes * 0 + zero.to(tl.int64)) != 0
    for base in range(start, end, BLOCK):
        idx = base + lanes
        m = idx < end
        i = tl.load(order_ptr + idx, mask=m, other=0)
        r = tl.load(r_ptr + i, mask=m, other=0.0).to(tl.float64)
        a = tl.where(zero_lanes, 0.0, (r - mean) * scale)
        tl.store(adv_ptr + i, a.to(adv_ptr.dtype.element_ty), mask=m)
        tl.store(zero_var_ptr + i, zero_lanes, mask=m)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rl_zvp_kernel(
    h_ptr,
    cu_ptr,
    r_ptr,
    zero_var_ptr,
    adv_ptr,
    out_ptr,
    alpha,
    n,
    T,
    HAS_ADV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    if pid < n:
        # One program per sequence.
        start = tl.load(cu_ptr + pid)
        end = tl.load(cu_ptr + pid + 1)
        if tl.load(zero_var_ptr + pid) != 0:
            hmax = tl.full([BLOCK], float("-inf"), tl.float32)
            for base in range(start, end, BLOCK):
                idx = base + lanes
                h = tl.load(h_ptr + idx, mask=idx < end, other=float("-inf"))
                hmax = tl.maximum(
                    hmax, h, propagate_nan=tl.PropagateNan.ALL
                )  # a NaN entropy: NaN max, as torch
            top = tl.reduce(hmax, 0, _max_nan)
            positive = tl.load(r_ptr + pid) > 0
            for base in range(start, end, BLOCK):
                idx = base + lanes
                m = idx < end
                h = tl.load(h_ptr + idx, mask=m, other=0.0)
                out = tl.where(positive, alpha * h, -alpha * (top - h))
                tl.store(out_ptr + idx, out, mask=m)
        else:
            if HAS_ADV:
                value = tl.load(adv_ptr + pid).to(tl.float32)
            else:
                value = 0.0
            fill = tl.zeros([BLOCK], dtype=tl.float32) + value
            for base in range(start, end, BLOCK):
                idx = base + lanes
                tl.store(out_ptr + idx, fill, mask=idx < end)
    else:
        # Tail programs: chunk (pid - n) of [0, T), zeroing the tokens past cu[n].
        # One program per chunk rather than one looping program: no host read of
        # cu[n], and a long padded tail is cleared in parallel; chunks wholly
        # before cu[n] store nothing.
        tail = tl.load(cu_ptr + n)
        idx = (pid - n) * BLOCK + lanes
        tl.store(out_ptr + idx, tl.zeros([BLOCK], dtype=tl.float32), mask=(idx >= tail) & (idx < T))


def _check(name, t, dtypes, device, size=None, what="") -> None:
    """Shared argument checks, plus contiguity: the kernels index flat memory."""
    check_tensor(name, t, ndim=1, dtypes=dtypes, size=size, size_what=what, device=device)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


_REAL = (torch.float32, torch.float64)


def group_advantages_triton(
    *,
    rewards: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    mode: int,
    eps: float,
    zero_var_tol: float,
    adv: torch.Tensor,
    zero_var: torch.Tensor,
    group_mean: torch.Tensor,
    group_std: torch.Tensor,
    block: int = GROUP_BLOCK,
) -> None:
    """Per-group mean/std and per-sample advantages, written into the given outputs
    (every argument by name, as the op passes them).

    Parameters
    ----------
    rewards : [n] float32 | float64, contiguous.
    order : [n] int64, a permutation of 0..n-1; group g's members are
        ``order[offsets[g]:offsets[g+1]]``.
    offsets : [G+1] int64, ``offsets[0] == 0``, non-decreasing, ``offsets[G] == n``.
    mode : 0 GRPO ``(r - mean) / (std + eps)``, 1 Dr.GRPO ``r - mean``, 2 RLOO
        ``r - (sum - r) / (c - 1)``.
    eps : float, added to std in GRPO.
    zero_var_tol : float; a group is zero-variance when ``c < 2`` or its
        unbiased std (float64, two-pass) is ``<= zero_var_tol``; its
        advantages are exactly 0.
    adv : [n] output, dtype of ``rewards``.
    zero_var : [n] bool output.
    group_mean, group_std : [G] float64 outputs (an empty group gets 0, 0).
    block : int
        Members per loop chunk (a power of two); any group size works.

    Notes
    -----
    Offsets and order are trusted (no host sync to check them): the public
    ``ck.advantages.group_advantages`` builds them.
    """
    _check("rewards", rewards, _REAL, None)
    device = rewards.device
    _check("offsets", offsets, (torch.int64,), device)
    n, groups = rewards.numel(), offsets.numel() - 1
    if groups < 0:
        raise ValueError("offsets: expected at least one element (G+1)")
    per_reward, per_group = "one per reward", "one per group = len(offsets) - 1"
    _check("order", order, (torch.int64,), device, n, per_reward)
    _check("adv", adv, (rewards.dtype,), device, n, per_reward)
    _check("zero_var", zero_var, (torch.bool,), device, n, per_reward)
    _check("group_mean", group_mean, (torch.float64,), device, groups, per_group)
    _check("group_std", group_std, (torch.float64,), device, groups, per_group)
    if mode not in (0, 1, 2):
        raise ValueError(f"mode: expected 0 (grpo), 1 (dr_grpo) or 2 (rloo), got {mode!r}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 16, got {block}")
    if groups == 0:
        return
    _group_advantages_kernel[(groups,)](
        rewards,
        order,
        offsets,
        adv,
        zero_var,
        group_mean,
        group_std,
        _f64_bits(eps),
        _f64_bits(zero_var_tol),
        MODE=mode,
        BLOCK=block,
        **GROUP_LAUNCH,
    )


def rl_zvp_triton(
    *,
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    advantages: torch.Tensor | None,
    alpha: float,
    out: torch.Tensor,
    block: int = ZVP_BLOCK,
) -> None:
    """RL-ZVP token advantages, written into ``out``.

    Parameters
    ----------
    entropy : [T] float32 (the caller upcasts).
    cu_seqlens : [n+1] int64, ``cu[0] == 0``, non-decreasing, ``cu[n] <= T``.
    rewards : [n] float32 | float64.
    zero_var : [n] bool.
    advantages : [n] float32 | float64, or None.
    alpha : float.
    out : [T] float32 output. For sequence i and its tokens t: if zero_var[i],
        ``alpha * H_t`` when rewards[i] > 0 else ``-alpha * (max H - H_t)``
        (max over the sequence); otherwise ``advantages[i]`` (0 if None).
        Tokens ``t >= cu[n]`` get 0.
    block : int
        Tokens per loop chunk (a power of two); any sequence length works.
    """
    _check("entropy", entropy, (torch.float32,), None)
    device = entropy.device
    _check("cu_seqlens", cu_seqlens, (torch.int64,), device)
    n, tokens = cu_seqlens.numel() - 1, entropy.numel()
    if n < 0:
        raise ValueError("cu_seqlens: expected at least one element (n+1)")
    per_seq = "one per sequence = len(cu_seqlens) - 1"
    _check("rewards", rewards, _REAL, device, n, per_seq)
    _check("zero_var", zero_var, (torch.bool,), device, n, per_seq)
    _check("out", out, (torch.float32,), device, tokens, "one per token = len(entropy)")
    if advantages is not None:
        _check("advantages", advantages, _REAL, device, n, per_seq)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block: expected a power of two >= 16, got {block}")
    grid = n + triton.cdiv(tokens, block)
    if grid == 0:
        return
    _rl_zvp_kernel[(grid,)](
        entropy,
        cu_seqlens,
        rewards,
        zero_var,
        advantages if advantages is not None else rewards,  # unread when HAS_ADV=False
        out,
        float(alpha),
        n,
        tokens,
        HAS_ADV=advantages is not None,
        BLOCK=block,
        **ZVP_LAUNCH,
    )


def aot_variants() -> Sequence[
    tuple[object, Mapping[str, str], Mapping[str, object], Mapping[str, object]]
]:
    """(kernel, signature, constexprs, launch options) of each variant the wrappers
    above launch, for ahead-of-time compilation (tests/test_aot.py compiles
    exactly these, with the options the launcher uses)."""
    group_sig = {
        "r_ptr": "*fp32",
        "order_ptr": "*i64",
        "offsets_ptr": "*i64",
        "adv_ptr": "*fp32",
        "zero_var_ptr": "*i1",
        "mean_ptr": "*fp64",
        "std_ptr": "*fp64",
        "eps_bits": "i64",
        "tol_bits": "i64",
        "MODE": "constexpr",
        "BLOCK": "constexpr",
    }
    zvp_sig = {
        "h_ptr": "*fp32",
        "cu_ptr": "*i64",
        "r_ptr": "*fp32",
        "zero_var_ptr": "*i1",
        "adv_ptr": "*fp32",
        "out_ptr": "*fp32",
        "alpha": "fp32",
        "n": "i32",
        "T": "i64",
        "HAS_ADV": "constexpr",
        "BLOCK": "constexpr",
    }
    fp64 = {"r_ptr": "*fp64", "adv_ptr": "*fp64"}
    out = []
    for mode in (0, 1, 2):
        for io in ({}, fp64):
            const = {"MODE": mode, "BLOCK": GROUP_BLOCK}
            out.append((_group_advantages_kernel, group_sig | io, const, GROUP_LAUNCH))
    for has_adv in (True, False):
        for io in ({}, fp64):
            const = {"HAS_ADV": has_adv, "BLOCK": ZVP_BLOCK}
            out.append((_rl_zvp_kernel, zvp_sig | io, const, ZVP_LAUNCH))
    return out
