"""Bench: group advantages (GRPO / Dr.GRPO / RLOO) and RL-ZVP token advantages.

Baselines are what RL frameworks commonly run today, written here from the
math (not copied): a Python dict from group id to sample indices and a loop
over groups computing mean/std with torch (the verl / OpenRLHF pattern), and a
per-sequence Python loop for RL-ZVP. Candidates are the public API
``compass_kernels.advantages`` with default dispatch (``backend=None``).

Shapes are RL batch shapes: (prompts, samples per prompt) in {(32, 8),
(128, 16), (512, 16), (1024, 32)}; RL-ZVP over 256..2048 responses with
lognormal lengths capped at 16k tokens. Rewards are binary with a per-prompt
pass rate drawn from Beta(0.5, 0.5), so (as in real math/code RL batches) a
sizeable fraction of groups is all-0 or all-1, i.e. zero-variance.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from bench.harness import Case
from bench.roofline import Model

OP = "advantages"

GROUP_SHAPES = ((32, 8), (128, 16), (512, 16), (1024, 32))
QUICK_GROUP_SHAPES = ((32, 8), (128, 16))
ZVP_SEQUENCES = (256, 512, 1024, 2048)
QUICK_ZVP_SEQUENCES = (64, 256)
ZVP_SAMPLES_PER_PROMPT = 16
MAX_LEN, QUICK_MAX_LEN = 16384, 4096

# float32 outputs from a float64 (candidate) vs float32 (baseline) computation;
# |adv| <= sqrt(G) here, so this is a few ulps.
ATOL, RTOL = 1e-5, 1e-5


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- baselines


def group_advantages_loop(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mode: str = "grpo",
    eps: float = 1e-6,
    zero_var_tol: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Framework-style baseline: dict of group id -> indices, then one loop per group.

    Parameters
    ----------
    rewards : torch.Tensor
        [n] float32 scores, one per sample.
    group_ids : torch.Tensor
        [n] int64 prompt id of each sample.
    mode : str
        ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``.
    eps, zero_var_tol : float
        GRPO's std epsilon; a group with one sample or std <= zero_var_tol is
        zero-variance and gets advantage 0.

    Returns
    -------
    adv : torch.Tensor
        [n] float32.
    zero_var : torch.Tensor
        [n] bool.
    """
    index: dict[int, list[int]] = defaultdict(list)
    for i, uid in enumerate(group_ids.tolist()):
        index[uid].append(i)
    adv = torch.zeros_like(rewards)
    zero_var = torch.zeros(rewards.shape, dtype=torch.bool, device=rewards.device)
    for members in index.values():
        idx = torch.tensor(members, device=rewards.device)
        scores = rewards[idx]
        if len(members) < 2:
            zero_var[idx] = True
            continue
        mean = torch.mean(scores)
        std = torch.std(scores)
        if std.item() <= zero_var_tol:
            zero_var[idx] = True
            continue
        if mode == "grpo":
            adv[idx] = (scores - mean) / (std + eps)
        elif mode == "dr_grpo":
            adv[idx] = scores - mean
        elif mode == "rloo":
            others_mean = (scores.sum() - scores) / (len(members) - 1)
            adv[idx] = scores - others_mean
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return adv, zero_var


def rl_zvp_loop(
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    *,
    alpha: float = 0.1,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """Baseline RL-ZVP: one Python iteration per response.

    Parameters
    ----------
    entropy : torch.Tensor
        [T] float32 per-token entropy of all responses, packed.
    cu_seqlens : torch.Tensor
        [n+1] int64 response boundaries.
    rewards : torch.Tensor
        [n] float32.
    zero_var : torch.Tensor
        [n] bool.
    alpha : float
        RL-ZVP scale.
    advantages : torch.Tensor, optional
        [n] float32 broadcast to the tokens of non-zero-variance responses.

    Returns
    -------
    torch.Tensor
        [T] float32 token advantages.
    """
    token_adv = torch.zeros_like(entropy)
    bounds = cu_seqlens.tolist()
    zv, r = zero_var.tolist(), rewards.tolist()
    adv = advantages.tolist() if advantages is not None else None
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        if s == e:
            continue
        if zv[i]:
            h = entropy[s:e].detach()
            token_adv[s:e] = alpha * h if r[i] > 0 else -alpha * (h.max() - h)
        elif adv is not None:
            token_adv[s:e] = adv[i]
    return token_adv


# ----------------------------------------------------------------------------- inputs


def binary_rewards(prompts: int, samples: int, g: torch.Generator) -> torch.Tensor:
    """[prompts * samples] float32 0/1 rewards, samples of a prompt contiguous."""
    # sin^2(pi U / 2) with U uniform is exactly Beta(1/2, 1/2) (the arcsine law).
    pass_rate = torch.sin(0.5 * math.pi * torch.rand(prompts, 1, generator=g)) ** 2
    u = torch.rand(prompts, samples, generator=g)
    return (u < pass_rate).to(torch.float32).reshape(-1)


def lognormal_lengths(n: int, max_len: int, g: torch.Generator) -> torch.Tensor:
    """[n] int64 response lengths, lognormal (median ~ max_len / 16), in [1, max_len]."""
    z = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(max_len / 16) + 1.0 * z)
    return lengths.round().clamp_(1, max_len).to(torch.int64)


def _candidate(fn_name: str) -> Callable[..., Any]:
    """``compass_kernels.advantages.<fn_name>``, or a callable that raises why not."""
    try:
        from compass_kernels import advantages as ck_adv

        return getattr(ck_adv, fn_name)
    except (ImportError, AttributeError) as e:
        msg = f"compass_kernels.advantages.{fn_name} unavailable: {e}"

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(msg)

        return missing


# ----------------------------------------------------------------------------- cases


def group_advantages_case(prompts: int, samples: int, mode: str, device: str) -> Case:
    """One `Case` for group advantages at (prompts, samples) in `mode`."""
    g = torch.Generator().manual_seed(prompts * 1000 + samples)
    rewards = binary_rewards(prompts, samples, g).to(device)
    group_ids = torch.arange(prompts, device=device).repeat_interleave(samples)
    group_advantages = _candidate("group_advantages")

    def by_ids() -> tuple[torch.Tensor, torch.Tensor]:
        adv, zero_var, _ = group_advantages(rewards, group_ids, mode=mode)
        return adv, zero_var

    def by_group_size() -> tuple[torch.Tensor, torch.Tensor]:
        adv, zero_var, _ = group_advantages(rewards, group_size=samples, mode=mode)
        return adv, zero_var

    return Case(
        name=f"group_advantages_{mode}",
        shape={"prompts": prompts, "samples": samples},
        providers={
            "python_loop": lambda: group_advantages_loop(rewards, group_ids, mode=mode),
            "compass(group_ids)": by_ids,
            "compass(group_size)": by_group_size,
        },
        baseline="python_loop",
        device=device,
        atol=ATOL,
        rtol=RTOL,
        # The kernel's own traffic: per sample read reward (4 B) + its index in
        # `order` (8 B), write adv (4 B) + zero_var (1 B); per group offsets and
        # mean/std. The second and third passes over a group hit L1/L2. The
        # Python-side sort / unique of the group_ids path is not in the model.
        model=Model(bytes=17 * rewards.numel() + 24 * prompts, precision="fp64"),
    )


def rl_zvp_case(sequences: int, max_len: int, device: str) -> Case:
    """One `Case` for RL-ZVP over `sequences` responses of lognormal lengths."""
    g = torch.Generator().manual_seed(sequences)
    samples = ZVP_SAMPLES_PER_PROMPT
    prompts = sequences // samples
    rewards = binary_rewards(prompts, samples, g)
    group_ids = torch.arange(prompts).repeat_interleave(samples)
    advantages, zero_var = group_advantages_loop(rewards, group_ids, mode="grpo")
    lengths = lognormal_lengths(sequences, max_len, g)
    cu_seqlens = torch.zeros(sequences + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    total = int(cu_seqlens[-1])
    entropy = torch.empty(total).exponential_(2.0, generator=g)
    entropy, cu_seqlens, rewards, zero_var, advantages = (
        t.to(device) for t in (entropy, cu_seqlens, rewards, zero_var, advantages)
    )
    rl_zvp = _candidate("rl_zvp")
    args = (entropy, cu_seqlens, rewards, zero_var)
    return Case(
        name="rl_zvp",
        shape={"seqs": sequences, "tokens": total},
        providers={
            "python_loop": lambda: rl_zvp_loop(*args, alpha=0.1, advantages=advantages),
            "compass": lambda: rl_zvp(*args, alpha=0.1, advantages=advantages),
        },
        baseline="python_loop",
        device=device,
        atol=ATOL,
        rtol=RTOL,
        # read entropy + write token advantages (the max pass re-reads a
        # sequence of <= 64 KiB from L2), plus per-sequence scalars.
        model=Model(bytes=8 * total + 25 * sequences),
    )


def cases(quick: bool) -> list[Case]:
    """All cases of this bench; `quick` keeps a few small ones (CI, ``--check``)."""
    device = _device()
    out: list[Case] = []
    if quick:
        out += [group_advantages_case(p, s, "grpo", device) for p, s in QUICK_GROUP_SHAPES]
        out += [group_advantages_case(32, 8, m, device) for m in ("dr_grpo", "rloo")]
        out += [rl_zvp_case(n, QUICK_MAX_LEN, device) for n in QUICK_ZVP_SEQUENCES]
        return out
    for mode in ("grpo", "dr_grpo", "rloo"):
        out += [group_advantages_case(p, s, mode, device) for p, s in GROUP_SHAPES]
    out += [rl_zvp_case(n, MAX_LEN, device) for n in ZVP_SEQUENCES]
    return out
