"""Executable spec of ck.advantages: plain torch, float64, written for clarity.

Never imported by a fast path; tests and benches compare every backend to it.
Math: docs/design.md, "Group advantages and zero-variance elimination".
"""

from __future__ import annotations

import torch

MODES = ("grpo", "dr_grpo", "rloo")


def group_advantages_reference(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mode: str = "grpo",
    eps: float = 1e-6,
    zero_var_tol: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample advantages within groups of samples of the same prompt.

    Parameters
    ----------
    rewards : [n] float tensor.
    group_ids : [n] integer tensor; samples with equal ids form a group.
    mode : "grpo" (A = (R - mean) / (std + eps), std unbiased), "dr_grpo"
        (A = R - mean) or "rloo" (A = R - mean of the other samples).
    eps, zero_var_tol : a group is zero-variance when it has one sample or its
        unbiased std (float64) is <= zero_var_tol; its advantages are 0.

    Returns
    -------
    adv : [n] float64.  zero_var : [n] bool.
    group_mean, group_std : [G] float64, groups in increasing id order (std of a
        group of one is 0).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    r = rewards.detach().to(torch.float64).cpu()
    ids = group_ids.cpu()
    adv = torch.zeros_like(r)
    zero_var = torch.zeros(r.shape, dtype=torch.bool)
    means, stds = [], []
    for gid in torch.unique(ids).tolist():
        members = (ids == gid).nonzero().flatten()
        x = r[members]
        c = x.numel()
        mean = x.sum() / c
        std = (
            torch.sqrt(((x - mean) ** 2).sum() / (c - 1))
            if c >= 2
            else torch.zeros((), dtype=torch.float64)
        )
        zero = c < 2 or bool(std <= zero_var_tol)
        means.append(mean)
        stds.append(std)
        zero_var[members] = zero
        if zero:
            continue
        if mode == "grpo":
            adv[members] = (x - mean) / (std + eps)
        elif mode == "dr_grpo":
            adv[members] = x - mean
        else:
            adv[members] = torch.stack([x[k] - (x.sum() - x[k]) / (c - 1) for k in range(c)])
    as_vec = lambda v: torch.stack(v) if v else torch.zeros(0, dtype=torch.float64)
    return adv, zero_var, as_vec(means), as_vec(stds)


def rl_zvp_reference(
    entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    *,
    alpha: float = 0.1,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """RL-ZVP (arXiv 2509.21880) token advantages for zero-variance groups.

    For sequence i (tokens cu_seqlens[i]:cu_seqlens[i+1]) in a zero-variance
    group: A_t = alpha * H_t if rewards[i] > 0, else -alpha * (max_k H_k - H_t),
    with H the (detached) entropy. Other sequences get ``advantages[i]`` on every
    token (0 when ``advantages`` is None); tokens past cu_seqlens[-1] get 0.
    Returns [T] float64.

    Non-finite inputs (IEEE semantics, defined here so the spec is total):
    a NaN reward is not > 0 (negative branch); the max over a sequence holding
    a NaN entropy is NaN, so every token of a negative zero-variance sequence
    becomes NaN, and only the NaN token of a positive one; an entropy of +inf
    gives -inf / NaN there the same way. The kernels match this spec for finite
    inputs only (C++ std::max and CUDA fmaxf drop NaN, so they differ);
    ``ck.advantages.rl_zvp`` rejects non-finite entropy and rewards where it
    checks (CPU tensors by default, CUDA with validate=True).
    """
    h = entropy.detach().to(torch.float64).cpu()
    out = torch.zeros_like(h)
    cu = cu_seqlens.cpu().tolist()
    for i in range(len(cu) - 1):
        seg = slice(cu[i], cu[i + 1])
        if bool(zero_var[i]):
            if cu[i + 1] == cu[i]:
                continue
            if float(rewards[i]) > 0:
                out[seg] = alpha * h[seg]
            else:
                out[seg] = -alpha * (h[seg].max() - h[seg])
        elif advantages is not None:
            out[seg] = float(advantages[i])
    return out


def overlong_penalty_reference(
    lengths: torch.Tensor, *, max_len: int, cache_len: int
) -> torch.Tensor:
    """DAPO overlong penalty per response: 0 if L <= max_len - cache_len,
    ((max_len - cache_len) - L) / cache_len in between, -1 past max_len. [n] float64."""
    out = []
    for length in lengths.cpu().tolist():
        if length <= max_len - cache_len:
            out.append(0.0)
        elif length <= max_len:
            out.append(((max_len - cache_len) - length) / cache_len)
        else:
            out.append(-1.0)
    return torch.tensor(out, dtype=torch.float64)


# ------------------------------------------------------------------ kernels
# The ops' CPU backend ("torch"): vectorised, any float dtype, the kernel
# calling convention of compass_kernels._op (arguments, then the outputs,
# written in place). The loops above are the readable spec they are tested
# against.


def _segments(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, segment number of each position) of a cu_seqlens-style vector."""
    counts = offsets.diff()
    seg = torch.repeat_interleave(torch.arange(counts.numel(), device=offsets.device), counts)
    return counts, seg


def group_advantages_torch(
    *, rewards, order, offsets, mode, eps, zero_var_tol, adv, zero_var, group_mean, group_std
) -> None:
    """``group_advantages`` op: members of group g are ``order[offsets[g]:offsets[g+1]]``;
    mode 0 grpo, 1 dr_grpo, 2 rloo. Statistics in float64."""
    counts, seg = _segments(offsets)
    g = counts.numel()
    x = rewards[order].to(torch.float64)
    c = counts.to(torch.float64)
    sums = torch.zeros(g, dtype=torch.float64).index_add_(0, seg, x)
    m = sums / c
    d = x - m[seg]
    ss = torch.zeros(g, dtype=torch.float64).index_add_(0, seg, d * d)
    s = torch.where(counts >= 2, (ss / (c - 1).clamp(min=1)).sqrt(), 0.0)
    zv = (counts < 2) | (s <= zero_var_tol)
    if mode == 0:
        a = d / (s[seg] + eps)
    elif mode == 1:
        a = d
    else:
        a = x - (sums[seg] - x) / (c[seg] - 1)
    a = torch.where(zv[seg], 0.0, a)
    adv[order] = a.to(adv.dtype)
    zero_var[order] = zv[seg]
    group_mean.copy_(m)
    group_std.copy_(s)


def rl_zvp_torch(*, entropy, cu_seqlens, rewards, zero_var, advantages, alpha, out) -> None:
    """``rl_zvp`` op: token advantages of the sequences cu_seqlens delimits; tokens
    past cu_seqlens[-1] get 0. Computed in float64, written in out's dtype."""
    counts, seq = _segments(cu_seqlens)
    end = seq.numel()
    h = entropy[:end].to(torch.float64)
    n = counts.numel()
    mx = torch.full((n,), -torch.inf, dtype=torch.float64)
    mx.scatter_reduce_(0, seq, h, "amax")
    pos = rewards.to(torch.float64)[seq] > 0
    zvp = torch.where(pos, alpha * h, -alpha * (mx[seq] - h))
    other = 0.0 if advantages is None else advantages.to(torch.float64)[seq]
    out[:end] = torch.where(zero_var[seq], zvp, other).to(out.dtype)
    out[end:] = 0


# ------------------------------------------------------- adaptive rollout budgets


def rollout_gain_table(a: torch.Tensor, b: torch.Tensor, max_n: int) -> torch.Tensor:
    """g[i, n] = 1 - E[p^n] - E[(1-p)^n] for p ~ Beta(a_i, b_i), n = 0..max_n; [P, max_n+1]
    float64. g[:, 0] = g[:, 1] = 0 (no group, or a group of one, is never informative).

    Summed from the increments D(n) = E[p^n (1-p)] + E[(1-p)^n p] = (E[p^n] b +
    E[(1-p)^n] a) / (a + b + n), all positive: no cancellation for confident
    posteriors. E[p^n] = prod_{j<n} (a + j) / (a + b + j)."""
    d = _increments(a.to(torch.float64), b.to(torch.float64), max_n)  # D(0..max_n-1)
    g = torch.zeros(d.shape[0], max_n + 1, dtype=torch.float64)
    if max_n >= 2:
        g[:, 2:] = d[:, 1:].cumsum(1)
    return g


def allocate_rollouts_reference(
    successes: torch.Tensor,
    attempts: torch.Tensor,
    budget: int,
    *,
    min_n: int = 2,
    max_n: int = 64,
    cost: torch.Tensor | None = None,
    prior: tuple[float, float] = (1.0, 1.0),
    required: torch.Tensor | None = None,
    repair_rounds: int = 4,
    min_gain: float = 1e-12,
) -> tuple[torch.Tensor, float, float]:
    """Samples per prompt under a budget: the spec of ``ck.advantages.allocate_rollouts``.

    Returns (n [P] int64, expected informative groups, LP upper bound on the optimum).
    ``cost`` [P] int64 >= 1 (None: 1); ``required`` [P] bool: prompts given at least min_n.

    Each prompt is a chain of items in non-increasing gain per cost: the block
    0 -> min_n (gain g(min_n), cost min_n * c), then one sample at a time (gain
    g(n+1) - g(n), cost c); ratios are clamped non-increasing along the chain.
    Forced blocks first; then every item by decreasing ratio (ties: prompt,
    then position), taken if its predecessor was, it fits and its gain > 0.
    Then up to ``repair_rounds`` exchanges: the unallocated prompt whose block,
    paid for by dropping the lowest-ratio increments of others (reverse greedy
    order), adds the most gain (> min_gain) gets it.
    """
    m, M = min_n, max_n
    P = successes.shape[0]
    s = successes.to(torch.float64)
    a = prior[0] + s
    b = prior[1] + (attempts.to(torch.float64) - s)
    c = torch.ones(P, dtype=torch.int64) if cost is None else cost.to(torch.int64)
    req = torch.zeros(P, dtype=torch.bool) if required is None else required.to(torch.bool)
    g = rollout_gain_table(a, b, M)
    cf = c.to(torch.float64)
    block = (g[:, m] / (m * cf))[:, None]
    d = _increments(a, b, M)[:, m:] / cf[:, None]  # D(n) itself, not a difference of sums
    ratio = torch.cat([block, d], 1).cummin(1).values  # [P, K]
    K = M - m + 1
    item_cost = torch.cat([(m * c)[:, None], c[:, None].expand(P, K - 1)], 1)
    taken = [1 if bool(req[i]) else 0 for i in range(P)]
    spent = int((m * c)[req].sum())
    value = float((ratio[:, 0] * (m * cf))[req].sum())
    if spent > budget:
        raise ValueError(f"budget: {budget} is below what min_n = {m} needs ({spent})")
    order = torch.sort(-ratio.flatten(), stable=True).indices.tolist()
    R, C = ratio.tolist(), item_cost.tolist()
    upper = None
    for idx in order:
        i, k = divmod(idx, K)
        if taken[i] != k or not R[i][k] > 0:
            continue
        if spent + C[i][k] > budget:
            if upper is None:
                upper = value + R[i][k] * (budget - spent)
            continue
        spent += C[i][k]
        value += R[i][k] * C[i][k]
        taken[i] = k + 1
    if upper is None:
        upper = value
    cl = c.tolist()
    for _ in range(repair_rounds if upper != value else 0):
        left = budget - spent
        cands = [j for j in range(P) if taken[j] == 0 and R[j][0] > 0]
        max_need = max([m * cl[j] - left for j in cands], default=0)
        if max_need <= 0:
            break
        held, seq, freed, loss = list(taken), [], [0], [0.0]
        while freed[-1] < max_need:
            tails = [(R[i][held[i] - 1], -i) for i in range(P) if held[i] > 1]
            if not tails:
                break
            r, neg_i = min(tails)
            i = -neg_i
            seq.append(i)
            freed.append(freed[-1] + cl[i])
            loss.append(loss[-1] + r * cl[i])
            held[i] -= 1
        best = (0.0, -1, 0)
        for j in cands:
            need = m * cl[j] - left
            kk = next((q for q, f in enumerate(freed) if f >= need), None)
            if kk is None:
                continue
            net = R[j][0] * (m * cl[j]) - loss[kk]
            if net > best[0] and net > min_gain:
                best = (net, j, kk)
        net, j, kk = best
        if j < 0:
            break
        for q in range(kk):
            taken[seq[q]] -= 1
        taken[j] = 1
        spent += m * cl[j] - freed[kk]
        value += net
    n = torch.tensor([0 if t == 0 else m + t - 1 for t in taken], dtype=torch.int64)
    return n, value, max(upper, value)


def _increments(a: torch.Tensor, b: torch.Tensor, max_n: int) -> torch.Tensor:
    """D(n) for n = 0..max_n-1, [P, max_n] float64 (see rollout_gain_table)."""
    s = (a + b)[:, None]
    j = torch.arange(max_n, dtype=torch.float64)
    ones = torch.ones(a.shape[0], 1, dtype=torch.float64)
    ep = torch.cat([ones, ((a[:, None] + j) / (s + j)).cumprod(1)[:, :-1]], 1)  # E[p^j]
    eq = torch.cat([ones, ((b[:, None] + j) / (s + j)).cumprod(1)[:, :-1]], 1)
    return (ep * b[:, None] + eq * a[:, None]) / (s + j)
