"""Executable spec of ck.routing.replay_topk: plain torch, float64, loops where clearer.

Never imported by a fast path; tests and benches compare every backend to it.
Contract: docs/design.md, "Router capture and replay".

Gating functions (the ones Megatron-core's TopKRouter runs), per row t with
router logits z[E], replayed ids r[K], optional expert_bias b[E] (selection only):

- score_function="softmax": s = softmax(z) over all E experts.
  normalize=True  : w_k = exp(z[r_k]) / sum_j exp(z[r_j])   (= s[r_k] / sum_j s[r_j];
                    Megatron's default "top-k then softmax", Qwen3-MoE norm_topk_prob)
  normalize=False : w_k = s[r_k]                            (softmax then top-k, no renorm)
- score_function="sigmoid": s = sigmoid(z) elementwise.
  normalize=True and K > 1: w_k = s[r_k] / (sum_j s[r_j] + 1e-20)   (DeepSeek-V3,
                    Megatron-core's epsilon; with K == 1 the weight stays s[r_0])
  normalize=False : w_k = s[r_k]
- then w *= scaling (moe_router_topk_scaling_factor / routed_scaling_factor).

Native selection (for rows that fall back and for the agreement statistics):
the K largest of ``s + b`` (b = 0 when expert_bias is None), ties to the lower
expert index. The bias never enters a weight.

Per row, status: 0 = replayed the trace's ids; 1 = missing row (valid[t] is
False): native routing; 2 = rejected by ``min_score_ratio``: native routing.
A row is rejected when min_k s[r_k] < min_score_ratio * min_k s[n_k], n the
native top-k (scores s without the bias). ``overlap[t]`` = |native ∩ replayed|
for rows with valid[t] (0 for missing rows).
"""

from __future__ import annotations

import torch

SIGMOID_EPS = 1e-20


def native_topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, K] int64: the K largest of each row of ``scores``, ties to the lower index,
    in descending score order."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :k]


def gate_weights_reference(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    score_function: str = "softmax",
    normalize: bool = True,
    scaling: float = 1.0,
) -> torch.Tensor:
    """[T, K] float64 gating weights of experts ``ids`` [T, K] (int64) from ``logits``
    [T, E], differentiable w.r.t. ``logits`` through torch autograd."""
    z = logits.to(torch.float64)
    k = ids.shape[1]
    if score_function == "softmax":
        if normalize:
            w = torch.softmax(torch.gather(z, 1, ids), dim=-1)
        else:
            w = torch.gather(torch.softmax(z, dim=-1), 1, ids)
    elif score_function == "sigmoid":
        w = torch.gather(torch.sigmoid(z), 1, ids)
        if normalize and k > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + SIGMOID_EPS)
    else:
        raise ValueError(f"score_function: expected 'softmax' or 'sigmoid', got {score_function!r}")
    return w * scaling


def replay_topk_reference(
    router_logits: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    score_function: str = "softmax",
    normalize: bool = True,
    expert_bias: torch.Tensor | None = None,
    scaling: float = 1.0,
    valid: torch.Tensor | None = None,
    min_score_ratio: float | None = None,
):
    """Replay the trace's expert ids on the trainer's router logits.

    Parameters
    ----------
    router_logits : [T, E] float (any float dtype; computed in float64).
    expert_ids : [T, K] integer, the replayed (logical) ids; rows with valid[t]
        False are not read.
    expert_bias : [E] float or None, added to the scores for native selection only.
    valid : [T] bool or None (all rows valid).
    min_score_ratio : None or a float >= 0 (see the module docstring).

    Returns
    -------
    weights : [T, K] float64 (differentiable w.r.t. router_logits).
    routing_map : [T, E] bool, True at the experts used.
    tokens_per_expert : [E] int64, rows routed to each expert.
    ids_used : [T, K] int64, the ids the weights belong to (the trace's ids, or
        the native top-k in descending order for status != 0 rows).
    overlap : [T] int64.  status : [T] int64 (0 replayed, 1 missing, 2 rejected).
    """
    z = router_logits.to(torch.float64)
    t_rows, e = z.shape
    k = expert_ids.shape[1]
    scores = torch.softmax(z, dim=-1) if score_function == "softmax" else torch.sigmoid(z)
    select = scores if expert_bias is None else scores + expert_bias.to(torch.float64)
    native = native_topk_reference(select.detach(), k)
    valid_rows = (
        torch.ones(t_rows, dtype=torch.bool) if valid is None else valid.to("cpu", torch.bool)
    )
    replay = expert_ids.to("cpu", torch.int64)
    native_c = native.to("cpu")
    s_c = scores.detach().to("cpu")
    ids_used = torch.empty(t_rows, k, dtype=torch.int64)
    overlap = torch.zeros(t_rows, dtype=torch.int64)
    status = torch.zeros(t_rows, dtype=torch.int64)
    for t in range(t_rows):
        if not bool(valid_rows[t]):
            status[t] = 1
            ids_used[t] = native_c[t]
            continue
        r = replay[t]
        overlap[t] = len(set(r.tolist()) & set(native_c[t].tolist()))
        if min_score_ratio is not None:
            weakest_native = float(s_c[t, native_c[t]].min())
            weakest_replay = float(s_c[t, r].min())
            if weakest_replay < min_score_ratio * weakest_native:
                status[t] = 2
                ids_used[t] = native_c[t]
                continue
        ids_used[t] = r
    ids_used = ids_used.to(z.device)
    weights = gate_weights_reference(
        router_logits,
        ids_used,
        score_function=score_function,
        normalize=normalize,
        scaling=scaling,
    )
    routing_map = torch.zeros(t_rows, e, dtype=torch.bool, device=z.device)
    routing_map.scatter_(1, ids_used, True)
    tokens_per_expert = routing_map.sum(0, dtype=torch.int64)
    return (
        weights,
        routing_map,
        tokens_per_expert,
        ids_used,
        overlap.to(z.device),
        status.to(z.device),
    )


# ------------------------------------------------------------------ kernels
# The ops' CPU backend ("torch"): vectorised, in the logits' dtype (float32 or
# float64), the kernel calling convention of compass_kernels._op (arguments,
# then the outputs, written in place). replay_topk_reference above is the
# readable spec they are tested against.


def _gate(
    z: torch.Tensor, used: torch.Tensor, score_function: int, normalize: bool, scaling: float
) -> torch.Tensor:
    """[T, K] weights of experts ``used`` from logits ``z`` (score 0 softmax, 1 sigmoid)."""
    zu = torch.gather(z, 1, used)
    if score_function == 0:
        w = torch.softmax(zu, dim=-1) if normalize else torch.gather(z.softmax(-1), 1, used)
    else:
        w = torch.sigmoid(zu)
        if normalize and used.shape[1] > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + SIGMOID_EPS)
    return w * scaling


def replay_topk_torch(
    *,
    logits,
    expert_ids,
    expert_bias,
    valid,
    score_function,
    normalize,
    scaling,
    min_score_ratio,
    weights,
    routing_map,
    tokens_per_expert,
    counts,
    ids_used,
) -> None:
    """``replay_topk`` op: rows with a malformed replayed id (out of [0, E) or twice)
    are routed natively and counted in counts[5]; counts = (rows, replay
    candidates, their overlap with the native top-k, exact matches, rejected
    by the ratio, bad rows)."""
    t, e = logits.shape
    k = expert_ids.shape[1]
    z = logits.detach()
    s = z.softmax(-1) if score_function == 0 else z.sigmoid()
    sel = s if expert_bias is None else s + expert_bias
    native = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    cand = torch.ones(t, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    rep = expert_ids.to(torch.int64)
    srt = rep.sort(-1).values
    bad = ((rep < 0) | (rep >= e)).any(-1) | (srt[:, 1:] == srt[:, :-1]).any(-1)
    bad &= cand
    ok = cand & ~bad
    rep = torch.where(ok[:, None], rep, native)
    overlap = (rep[:, :, None] == native[:, None, :]).any(-1).sum(-1)
    use = ok
    if min_score_ratio >= 0:
        weakest = lambda ids: torch.gather(s, 1, ids).min(-1).values  # noqa: E731
        use = ok & (weakest(rep) >= min_score_ratio * weakest(native))
    used = torch.where(use[:, None], rep, native)
    ids_used.copy_(used)
    weights.copy_(_gate(z, used, score_function, normalize, scaling))
    routing_map.zero_().scatter_(1, used, True)
    tokens_per_expert.copy_(routing_map.sum(0))
    counts.copy_(
        torch.stack(
            [
                torch.tensor(t),
                ok.sum(),
                overlap[ok].sum(),
                (ok & (overlap == k)).sum(),
                (ok & ~use).sum(),
                bad.sum(),
            ]
        )
    )


def replay_topk_backward_torch(
    *, grad_weights, logits, ids_used, score_function, normalize, scaling, grad_logits
) -> None:
    """``replay_topk_backward`` op: d loss / d logits [T, E] of the gate weights."""
    z, u, g = logits, ids_used, grad_weights
    zu = torch.gather(z, 1, u)
    dense = torch.zeros_like(z)
    if score_function == 0:
        if normalize:
            w0 = zu.softmax(-1)
        else:
            p = z.softmax(-1)
            w0 = torch.gather(p, 1, u)
        dot = (g * w0).sum(-1, keepdim=True)
        gu = w0 * (g - dot)
        if not normalize:
            dense = -p * dot
    else:
        sg = zu.sigmoid()
        ds = sg * (1 - sg)
        if normalize and u.shape[1] > 1:
            den = sg.sum(-1, keepdim=True) + SIGMOID_EPS
            gu = (g - (g * sg / den).sum(-1, keepdim=True)) / den * ds
        else:
            gu = g * ds
    grad_logits.copy_(dense.scatter_(1, u, gu) * scaling)
