"""Bench: group advantages (GRPO / Dr.GRPO / RLOO) and RL-ZVP token advantages.

Every case's baseline (the ``speedup`` column) is the strongest simple
implementation a user would write: **vectorized torch**, float32 like the
frameworks (a few tensor ops, no Python loop over groups or samples):

- ``group_size`` layout: ``rewards.view(-1, G)`` and ``torch.std_mean`` over
  dim 1 (TRL's GRPOTrainer computes its advantages this way).
- ``group_ids`` layout (ids in any order): segment sums with ``torch.bincount``
  (ids are small non-negative ints here; measured faster than ``index_add_`` or
  ``scatter_reduce`` on this CPU), a gather back per sample. ``torch_unique``
  is the same with ``torch.unique(return_inverse=True)`` first, which works for
  any id values, as ``compass`` does.
- RL-ZVP: per-sequence max with ``torch.segment_reduce``, then one fused
  ``addcmul`` over the tokens of per-sequence coefficients expanded with
  ``repeat_interleave``.

Other providers:

- ``verl_loop`` (framework): verl's GRPO / RLOO outcome-advantage algorithm
  (verl/trainer/ppo/core_algos.py, compute_grpo_outcome_advantage and
  compute_rloo_outcome_advantage) re-expressed here from its formula: a dict of
  group id -> scores, then a Python loop over the samples. Its zero-variance
  flag is the one verl's DAPO group filter uses (group std == 0). Only at sizes
  where one call takes well under a second.
- ``python_loop`` (RL-ZVP only; naive reference): one Python iteration per
  response. No framework implements RL-ZVP.
- ``compass(...)``: the public API ``compass_kernels.advantages`` with default
  dispatch and validation (``backend=None``, ``validate=True``);
  ``compass(group_ids,num_groups)`` passes the number of prompts, which the
  caller knows, so the CUDA path never syncs the host.

The ``overhead`` case times one tiny call (32 x 8) through each layer: the raw
compiled kernel (its Python binding, arguments prepared once), the
``torch.ops.compass`` op, and the public API with and without validation and
with ``group_ids``; ``vs base`` is then the host overhead above the kernel.

Shapes are RL batch shapes: (prompts, samples per prompt) in {(32, 8),
(128, 16), (512, 16), (1024, 32), (8192, 16)}; group ids grouped (samples of a
prompt contiguous) and shuffled; RL-ZVP over 256..2048 responses with
lognormal lengths capped at 16k tokens. Rewards are binary with a per-prompt
pass rate drawn from Beta(0.5, 0.5), so (as in real math/code RL batches) a
sizeable fraction of groups is all-0 or all-1, i.e. zero-variance.

Semantics: on these inputs (binary rewards, groups of >= 8) every provider
computes the same thing, which ``--check`` verifies. They differ elsewhere:
verl gives a group of one mean 0 and std 1 and flags only std == 0, the torch
baselines decide zero variance in float32, compass in float64 with
``zero_var_tol`` (reference.py is the spec).
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

GROUP_SHAPES = ((32, 8), (128, 16), (512, 16), (1024, 32), (8192, 16))
QUICK_GROUP_SHAPES = ((32, 8), (128, 16))
ZVP_SEQUENCES = (256, 512, 1024, 2048)
QUICK_ZVP_SEQUENCES = (64, 256)
ZVP_SAMPLES_PER_PROMPT = 16
MAX_LEN, QUICK_MAX_LEN = 16384, 4096
# verl's loop is per sample in Python (~10 us each): run it up to this many samples.
VERL_MAX_SAMPLES = 8192
OVERHEAD_SHAPE = (32, 8)

# float32 outputs from a float64 (candidate) vs float32 (baseline) computation;
# |adv| <= sqrt(G) here, so this is a few ulps.
ATOL, RTOL = 1e-5, 1e-5


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- baselines

Adv = tuple[torch.Tensor, torch.Tensor]


def _finish(
    d: torch.Tensor, std: torch.Tensor, count: Any, zero: torch.Tensor, mode: str, eps: float
) -> torch.Tensor:
    """Advantages from deviations ``d = r - mean`` (per sample), zero-variance masked."""
    if mode == "grpo":
        adv = d / (std + eps)
    elif mode == "dr_grpo":
        adv = d
    elif mode == "rloo":  # r - mean of the others = (r - mean) * c / (c - 1)
        adv = d * (count / (count - 1))
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return adv.masked_fill(zero, 0.0) if adv is d else adv.masked_fill_(zero, 0.0)


def group_advantages_torch(
    rewards: torch.Tensor,
    group_size: int,
    *,
    mode: str = "grpo",
    eps: float = 1e-6,
    zero_var_tol: float = 1e-6,
) -> Adv:
    """Vectorized torch, groups of ``group_size`` consecutive samples (``view(-1, G)``).

    Returns ``(adv [n] float32, zero_var [n] bool)``; a group of one or with
    unbiased std <= zero_var_tol (float32) gets advantage 0.
    """
    x = rewards.view(-1, group_size)
    if group_size > 1:
        std, mean = torch.std_mean(x, dim=1, keepdim=True)
        zero = std <= zero_var_tol
    else:  # groups of one: zero-variance
        std, mean, zero = torch.zeros_like(x), x, torch.ones_like(x, dtype=torch.bool)
    adv = _finish(x - mean, std, group_size, zero, mode, eps)
    return adv.view(-1), zero.expand(-1, group_size).reshape(-1)


def group_advantages_torch_ids(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mode: str = "grpo",
    eps: float = 1e-6,
    zero_var_tol: float = 1e-6,
    any_ids: bool = False,
) -> Adv:
    """Vectorized torch over ``group_ids`` in any order: segment sums by ``bincount``.

    The ids must be small non-negative ints (one bin per id value up to the
    largest), unless ``any_ids``: then ``torch.unique(return_inverse=True)``
    maps them to 0..G-1 first (a sort). Same outputs as `group_advantages_torch`.
    """
    if any_ids:
        _, ids, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    else:
        ids, counts = group_ids, torch.bincount(group_ids)
    mean = torch.bincount(ids, weights=rewards, minlength=counts.numel()) / counts
    d = rewards - mean[ids]
    m2 = torch.bincount(ids, weights=d * d, minlength=counts.numel())
    std = (m2 / (counts - 1)).sqrt_()
    zero = ((counts < 2) | (std <= zero_var_tol))[ids]
    if mode == "grpo":
        return _finish(d, std[ids], None, zero, mode, eps), zero
    return _finish(d, None, counts[ids], zero, mode, eps), zero  # type: ignore[arg-type]


def group_advantages_verl(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, mode: str = "grpo", eps: float = 1e-6
) -> Adv:
    """verl's outcome-advantage algorithm, re-expressed (not copied) from its formula.

    Source: verl/trainer/ppo/core_algos.py, ``compute_grpo_outcome_advantage``
    (``mode="grpo"``; ``"dr_grpo"`` is its ``norm_adv_by_std_in_grpo=False``)
    and ``compute_rloo_outcome_advantage`` (``mode="rloo"``): a dict from group
    id to the list of its scores; a group of one gets mean 0 and std 1; then
    one Python iteration per sample. The zero-variance flag is what verl's
    DAPO group filter (``filter_groups``) keeps out: groups whose std is 0.
    """
    scores = rewards.clone()
    index = group_ids.tolist()
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean: dict[int, torch.Tensor] = {}
    id2std: dict[int, torch.Tensor] = {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, members in id2score.items():
        if len(members) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            group = torch.stack(members)
            id2mean[idx], id2std[idx] = torch.mean(group), torch.std(group)
    for i in range(scores.shape[0]):
        k = index[i]
        if mode == "grpo":
            scores[i] = (scores[i] - id2mean[k]) / (id2std[k] + eps)
        elif mode == "dr_grpo":
            scores[i] = scores[i] - id2mean[k]
        elif mode == "rloo":
            c = len(id2score[k])
            if c > 1:
                scores[i] = scores[i] * c / (c - 1) - id2mean[k] * c / (c - 1)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    zero_var = torch.tensor([bool(id2std[k] == 0) for k in index], dtype=torch.bool)
    return scores, zero_var


def group_advantages_loop(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mode: str = "grpo",
    eps: float = 1e-6,
    zero_var_tol: float = 1e-6,
) -> Adv:
    """Naive reference (not timed): dict of group id -> indices, one torch step per group.

    Same semantics as compass (group of one or std <= zero_var_tol: advantage 0).
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


def rl_zvp_torch(
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    *,
    alpha: float = 0.1,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """Vectorized torch RL-ZVP: ``A_t = a_i * H_t + b_i`` for the tokens of sequence i.

    Zero-variance, reward > 0: (alpha, 0); zero-variance otherwise:
    (alpha, -alpha * max H); other sequences: (0, advantages[i] or 0). The
    per-sequence max is one ``segment_reduce``, the token pass one ``addcmul``
    of ``repeat_interleave``-expanded coefficients. One host sync (cu_seqlens[-1]).
    """
    lengths = cu_seqlens.diff()
    used = int(cu_seqlens[-1])
    h = entropy[:used]
    hmax = torch.segment_reduce(h, "max", lengths=lengths, unsafe=True)
    a = torch.where(zero_var, alpha, 0.0)
    other = advantages.to(torch.float32) if advantages is not None else 0.0
    b = torch.where(zero_var, torch.where(rewards > 0, 0.0, -alpha * hmax), other)
    out = torch.zeros_like(entropy)
    a_t = a.repeat_interleave(lengths, output_size=used)
    b_t = b.repeat_interleave(lengths, output_size=used)
    torch.addcmul(b_t, a_t, h, out=out[:used])
    return out


def rl_zvp_loop(
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    *,
    alpha: float = 0.1,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive reference RL-ZVP: one Python iteration per response.

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
        return _raiser(f"compass_kernels.advantages.{fn_name} unavailable: {e}")


def _raiser(msg: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(msg)

    return missing


def _group_model(n: int, groups: int) -> Model:
    # The kernel's own traffic: per sample read reward (4 B) + its index in
    # `order` (8 B), write adv (4 B) + zero_var (1 B); per group offsets and
    # mean/std. The second and third passes over a group hit L1/L2. The
    # Python-side sort / unique of the group_ids path is not in the model.
    return Model(bytes=17 * n + 24 * groups, precision="fp64")


# ----------------------------------------------------------------------------- cases


def group_advantages_case(prompts: int, samples: int, mode: str, device: str) -> Case:
    """Group advantages at (prompts, samples) in `mode`, ``group_size`` layout."""
    g = torch.Generator().manual_seed(prompts * 1000 + samples)
    rewards = binary_rewards(prompts, samples, g).to(device)
    group_ids = torch.arange(prompts, device=device).repeat_interleave(samples)
    group_advantages = _candidate("group_advantages")

    def by_group_size() -> Adv:
        adv, zero_var, _ = group_advantages(rewards, group_size=samples, mode=mode)
        return adv, zero_var

    providers: dict[str, Callable[[], Any]] = {
        "torch": lambda: group_advantages_torch(rewards, samples, mode=mode),
        "compass(group_size)": by_group_size,
    }
    if rewards.numel() <= VERL_MAX_SAMPLES:
        providers["verl_loop"] = lambda: group_advantages_verl(rewards, group_ids, mode=mode)
    return Case(
        name=f"group_advantages_{mode}",
        shape={"prompts": prompts, "samples": samples},
        providers=providers,
        baseline="torch",
        device=device,
        atol=ATOL,
        rtol=RTOL,
        model=_group_model(rewards.numel(), prompts),
    )


def group_ids_case(prompts: int, samples: int, shuffled: bool, device: str) -> Case:
    """GRPO with ``group_ids``: grouped (prompt-major) or shuffled sample order."""
    g = torch.Generator().manual_seed(prompts * 1000 + samples + shuffled)
    rewards = binary_rewards(prompts, samples, g)
    group_ids = torch.arange(prompts).repeat_interleave(samples)
    if shuffled:
        perm = torch.randperm(rewards.numel(), generator=g)
        rewards, group_ids = rewards[perm], group_ids[perm]
    rewards, group_ids = rewards.to(device), group_ids.to(device)
    group_advantages = _candidate("group_advantages")

    def by_ids(num_groups: int | None = None) -> Adv:
        adv, zero_var, _ = group_advantages(rewards, group_ids, num_groups=num_groups)
        return adv, zero_var

    providers: dict[str, Callable[[], Any]] = {
        "torch": lambda: group_advantages_torch_ids(rewards, group_ids),
        "compass(group_ids)": by_ids,
        # the number of prompts is known to the caller: no host sync on CUDA
        "compass(group_ids,num_groups)": lambda: by_ids(prompts),
        "torch_unique": lambda: group_advantages_torch_ids(rewards, group_ids, any_ids=True),
    }
    if rewards.numel() <= VERL_MAX_SAMPLES:
        providers["verl_loop"] = lambda: group_advantages_verl(rewards, group_ids)
    return Case(
        name=f"group_advantages_grpo_ids_{'shuffled' if shuffled else 'grouped'}",
        shape={"prompts": prompts, "samples": samples},
        providers=providers,
        baseline="torch",
        device=device,
        atol=ATOL,
        rtol=RTOL,
        model=_group_model(rewards.numel(), prompts),
    )


def _raw_group_kernel(rewards: torch.Tensor, group_size: int) -> Callable[[], Adv]:
    """The CPU kernel called directly (``group_advantages_op.kernel("torch")``),
    arguments prepared once: the floor the other overhead rows are measured against.
    A moved entry point makes this provider raise (an ERROR row; ``--check``
    fails) naming what to update here, never a silently missing row."""
    n = rewards.numel()
    args = dict(
        rewards=rewards,
        order=torch.arange(n),
        offsets=torch.arange(0, n + 1, group_size),
        mode=0,
        eps=1e-6,
        zero_var_tol=1e-6,
    )
    try:
        from compass_kernels.advantages import group_advantages_op

        outs = group_advantages_op.outputs(**args)._asdict()
        fn = group_advantages_op.kernel("torch")
        fn(**args, **outs)
    except Exception as e:  # noqa: BLE001 - any failure is reported in the row
        return _raiser(
            "bench: the raw CPU kernel (compass_kernels.advantages.group_advantages_op"
            f'.kernel("torch")) failed: {type(e).__name__}: {e}; update '
            "bench/bench_advantages.py::_raw_group_kernel"
        )

    def call() -> Adv:
        fn(**args, **outs)
        return outs["adv"], outs["zero_var"]

    return call


def overhead_case() -> Case:
    """Host overhead per call on a tiny CPU input, layer by layer (``vs base``)."""
    prompts, samples = OVERHEAD_SHAPE
    g = torch.Generator().manual_seed(7)
    rewards = binary_rewards(prompts, samples, g)
    n = rewards.numel()
    group_ids = torch.arange(prompts).repeat_interleave(samples)
    order, offsets = torch.arange(n), torch.arange(0, n + 1, samples)
    group_advantages = _candidate("group_advantages")

    def op() -> Adv:
        adv, zv, _, _ = torch.ops.compass.group_advantages(
            rewards=rewards, order=order, offsets=offsets, mode=0, eps=1e-6, zero_var_tol=1e-6
        )
        return adv, zv

    def api(**kw: Any) -> Callable[[], Adv]:
        def call() -> Adv:
            adv, zv, _ = group_advantages(rewards, **kw)
            return adv, zv

        return call

    return Case(
        name="overhead",
        shape={"prompts": prompts, "samples": samples},
        providers={
            "kernel (raw binding)": _raw_group_kernel(rewards, samples),
            "torch.ops.compass": op,
            "api(group_size, validate=False)": api(group_size=samples, validate=False),
            "api(group_size)": api(group_size=samples),
            "api(group_ids)": api(group_ids=group_ids),
        },
        baseline="kernel (raw binding)",
        device="cpu",
        atol=ATOL,
        rtol=RTOL,
    )


def rl_zvp_case(sequences: int, max_len: int, device: str) -> Case:
    """One `Case` for RL-ZVP over `sequences` responses of lognormal lengths."""
    g = torch.Generator().manual_seed(sequences)
    samples = ZVP_SAMPLES_PER_PROMPT
    prompts = sequences // samples
    rewards = binary_rewards(prompts, samples, g)
    advantages, zero_var = group_advantages_torch(rewards, samples)
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
            "torch": lambda: rl_zvp_torch(*args, alpha=0.1, advantages=advantages),
            "compass": lambda: rl_zvp(*args, alpha=0.1, advantages=advantages),
            "python_loop (naive)": lambda: rl_zvp_loop(*args, alpha=0.1, advantages=advantages),
        },
        baseline="torch",
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
    shapes = QUICK_GROUP_SHAPES if quick else GROUP_SHAPES
    out: list[Case] = [overhead_case()]
    out += [group_advantages_case(p, s, "grpo", device) for p, s in shapes]
    for shuffled in (False, True):
        out += [group_ids_case(p, s, shuffled, device) for p, s in shapes]
    mode_shapes = shapes[:1] if quick else shapes
    for mode in ("dr_grpo", "rloo"):
        out += [group_advantages_case(p, s, mode, device) for p, s in mode_shapes]
    zvp = (QUICK_ZVP_SEQUENCES, QUICK_MAX_LEN) if quick else (ZVP_SEQUENCES, MAX_LEN)
    out += [rl_zvp_case(n, zvp[1], device) for n in zvp[0]]
    return out
