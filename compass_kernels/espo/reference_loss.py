"""Executable spec of ``ck.espo.espo_loss``: plain torch, float64, a loop per
sequence and per group, gradients by autograd through the formula.

Never imported by a fast path; tests and benches compare every backend to it.
Math: docs/design.md, "ESPO segmented loss" (arXiv 2512.00499, Eqs. 8-10); the options
and the modes' defaults are resolved by ``loss_config.resolve`` (shared with
the kernels' wrapper, so both read the same numbers).

Per valid token t of sequence i (valid: before cu_seqlens[-1] and mask[t]):
d_t = l_t - l_old_t. Tokens split into entropy groups g (bucket = number of
boundaries q_k with e_t > q_k; q_k the quantile of e at level k over the valid
tokens of the batch, or of the sequence); empty groups are dropped, and with
``drop_low`` the lowest bucket too. m_g = mean_g(d) (no gradient).

- token ratio s_t: ``ratio_form="espo"``: exp(sg[m_g] + d_t) (Eq. 9, value
  s_g * r_t); ``"gspo_token"``: exp(sg[m_g] + l_t - sg[l_t]) (value s_g); in
  mode grpo every token is its own group (value r_t). Its log is clamped to
  [log_lo, log_hi] (torch.clamp: no gradient outside).
- eps: fixed (eps_low, eps_high), or eps_g = alpha * mean_g(e) / ln|V|.
- f_t = min(s_t A_t, clip(s_t, 1 - eps_low, 1 + eps_high) A_t); with
  ``dual_clip`` c and A_t < 0: max(f_t, c A_t).
- loss = -(1/G) sum_i (1/K_i) sum_g (1/|g|) sum_{t in g} f_t, G =
  num_sequences (default: len(cu_seqlens) - 1), K_i = groups of sequence i.
"""

from __future__ import annotations

import math

import torch

from compass_kernels.espo.loss_config import resolve


def entropy_thresholds_reference(
    old_entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None,
    levels: tuple[float, ...],
    *,
    per_sequence: bool = False,
) -> torch.Tensor:
    """Group boundaries: torch.quantile (linear) of the valid tokens' entropy at
    ``levels``, over the batch ([Q] float64) or per sequence ([n, Q] float64;
    a sequence with no valid token gets NaN, never read)."""
    e = old_entropy.detach().double().cpu()
    cu = cu_seqlens.cpu().tolist()
    n = len(cu) - 1
    valid = _valid(e.numel(), cu, mask)
    q = torch.tensor(levels, dtype=torch.float64)
    if not per_sequence:
        return torch.quantile(e[valid], q) if bool(valid.any()) else torch.full_like(q, math.nan)
    out = torch.full((n, len(levels)), math.nan, dtype=torch.float64)
    for i in range(n):
        seg = e[cu[i] : cu[i + 1]][valid[cu[i] : cu[i + 1]]]
        if seg.numel():
            out[i] = torch.quantile(seg, q)
    return out


def _valid(total: int, cu: list[int], mask: torch.Tensor | None) -> torch.Tensor:
    valid = torch.zeros(total, dtype=torch.bool)
    valid[: cu[-1]] = True
    if mask is not None:
        valid &= mask.cpu().bool()
    return valid


def espo_loss_reference(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    old_entropy: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    num_sequences: int | None = None,
    entropy_threshold: torch.Tensor | None = None,
    advantages_per_token: bool | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ESPO / GSPO-token / GRPO clipped policy loss, float64.

    Parameters: those of ``ck.espo.espo_loss`` (options: mode, rho, alpha, clip,
    vocab_size, grouping, num_groups, quantiles, drop_low, ratio_form,
    dual_clip). ``logprobs`` [T] may require grad: the returned loss (0-d
    float64, on the CPU) is differentiable with respect to it.

    Returns (loss, metrics): metrics are detached float64 tensors, named as in
    ``ck.espo.espo_loss`` (fractions of 0 tokens are 0).
    """
    cfg = resolve(**options)
    dev_l = logprobs.cpu().double()  # keeps the graph to logprobs
    lo = old_logprobs.detach().cpu().double()
    e = old_entropy.detach().cpu().double()
    a = advantages.detach().cpu().double()
    cu = cu_seqlens.cpu().tolist()
    n, total = len(cu) - 1, dev_l.numel()
    per_token = a.numel() == total if advantages_per_token is None else advantages_per_token
    G = n if num_sequences is None else num_sequences
    valid = _valid(total, cu, mask)
    K = 1 if cfg.token_groups else cfg.num_groups
    if K > 1:
        thr = (
            entropy_threshold.detach().cpu().double()
            if entropy_threshold is not None
            else entropy_thresholds_reference(
                e, cu_seqlens, mask, cfg.levels, per_sequence=cfg.per_sequence
            )
        )
    f64 = torch.float64
    loss = torch.zeros((), dtype=f64)
    tokens_k = torch.zeros(K, dtype=f64)
    entropy_k = torch.zeros(K, dtype=f64)
    clip_low_k, clip_high_k, dual_k = (torch.zeros(K, dtype=f64) for _ in range(3))
    ratios: list[torch.Tensor] = []
    d_all = (dev_l.detach() - lo)[valid]
    for i in range(n):
        idx = torch.arange(cu[i], cu[i + 1])
        idx = idx[valid[cu[i] : cu[i + 1]]]
        if idx.numel() == 0:
            continue
        if K > 1:
            row = thr[i] if cfg.per_sequence else thr
            bucket = (e[idx, None] > row[None, :]).sum(1)
        else:
            bucket = torch.zeros(idx.numel(), dtype=torch.int64)
        for k in range(K):
            tokens_k[k] += (bucket == k).sum()
            entropy_k[k] += e[idx][bucket == k].sum()
        if cfg.token_groups:
            groups = [(0, idx[j : j + 1]) for j in range(idx.numel())]
        else:
            ks = [k for k in range(K) if not (cfg.drop_low and k == 0)]
            groups = [(k, idx[bucket == k]) for k in ks if bool((bucket == k).any())]
        for k, tok in groups:
            l_t = dev_l[tok]
            d = l_t - lo[tok]
            m = d.detach().mean()
            if cfg.ratio_form == "espo":
                log_s = m + d
            else:
                log_s = m + l_t - l_t.detach()
            s = torch.exp(torch.clamp(log_s, cfg.log_lo, cfg.log_hi))
            if cfg.adaptive:
                el = eh = cfg.alpha * float(e[tok].mean()) / cfg.log_vocab
            else:
                assert cfg.eps_low is not None and cfg.eps_high is not None  # fixed clip
                el, eh = cfg.eps_low, cfg.eps_high
            adv = a[tok] if per_token else a[i].expand(tok.numel())
            o1, o2 = s * adv, torch.clamp(s, 1.0 - el, 1.0 + eh) * adv
            f = torch.minimum(o1, o2)
            clipped = (o2 < o1).detach()
            clip_high_k[k] += (clipped & (adv > 0)).sum()
            clip_low_k[k] += (clipped & (adv < 0)).sum()
            if cfg.dual_clip > 0:
                floor = cfg.dual_clip * adv
                dual = (adv < 0) & (f.detach() < floor)
                dual_k[k] += dual.sum()
                f = torch.where(adv < 0, torch.maximum(f, floor), f)
            loss = loss - f.sum() / (G * len(groups) * tok.numel())
            ratios.append(s.detach())
    ratio = torch.cat(ratios) if ratios else torch.zeros(0, dtype=f64)
    valid_n = max(int(valid.sum()), 1)
    in_loss = max(ratio.numel(), 1)
    frac = lambda x, c: x / torch.clamp(c, min=1.0)  # noqa: E731
    metrics = {
        "loss": loss.detach(),
        "tokens": tokens_k.sum(),
        "loss_tokens": torch.tensor(float(ratio.numel()), dtype=f64),
        "group_token_frac": tokens_k / max(float(tokens_k.sum()), 1.0),
        "entropy_mean": entropy_k.sum() / valid_n,
        "group_entropy_mean": frac(entropy_k, tokens_k),
        "clip_frac": (clip_low_k.sum() + clip_high_k.sum()) / in_loss,
        "clip_frac_low": frac(clip_low_k, tokens_k),
        "clip_frac_high": frac(clip_high_k, tokens_k),
        "dual_clip_frac": dual_k.sum() / in_loss,
        "ratio_mean": ratio.sum() / in_loss,
        "ratio_min": ratio.min() if ratio.numel() else torch.zeros((), dtype=f64),
        "ratio_max": ratio.max() if ratio.numel() else torch.zeros((), dtype=f64),
        "kl_k3": (torch.exp(d_all) - 1.0 - d_all).sum() / valid_n,
        "ppo_kl": -d_all.sum() / valid_n,
        "log_ratio_gt_ln2_frac": (d_all.abs() > math.log(2.0)).sum().double() / valid_n,
    }
    return loss, metrics


# ---------------------------------------------------------------------------
# The torch backend of the ESPO loss ops (CPU tensors): vectorised over tokens
# (index_add per (sequence, bucket)), float64 statistics. Calling convention of
# every backend: the op's arguments, then its outputs, written in place. Flags
# and the statistics row: compass_kernels/espo/loss.py (PER_SEQ_THRESHOLDS ..,
# stat_width).

_PER_SEQ, _TOKEN_GROUPS, _DROP_LOW, _ADAPTIVE, _GSPO_TOKEN, _ADV_PER_TOKEN = 1, 2, 4, 8, 16, 32
F64 = torch.float64


def _tokens(cu_seqlens, mask, total: int):
    """(sequence id [T] (n for padding), valid [T]) of the packed batch."""
    n = cu_seqlens.shape[0] - 1
    t = torch.arange(total)
    seq = (torch.searchsorted(cu_seqlens, t, right=True) - 1).clamp(max=n)
    valid = t < cu_seqlens[-1]
    if mask is not None:
        valid &= mask
    return seq, valid


def _buckets(e64, seq, thresholds, num_groups: int, flags: int):
    q = num_groups - 1
    if q == 0:
        return torch.zeros(e64.shape[0], dtype=torch.int64)
    thr = thresholds.view(-1, q)
    rows = thr[seq.clamp(max=thr.shape[0] - 1)] if flags & _PER_SEQ else thr  # n >= 1
    return (e64[:, None] > rows).sum(dim=1)


def espo_group_sums_torch(
    *, entropy, logprobs, old_logprobs, cu_seqlens, mask, thresholds, num_groups, flags, out
) -> None:
    """``espo_group_sums`` op: sums [n, K, 3] float64 = per (sequence, entropy
    bucket) over the valid tokens: count, sum (l - l_old), sum entropy, in ``out``."""
    n, K = cu_seqlens.shape[0] - 1, num_groups
    if n == 0:
        return
    seq, valid = _tokens(cu_seqlens, mask, entropy.shape[0])
    e = entropy.to(F64)
    b = _buckets(e, seq, thresholds, K, flags)
    d = logprobs.to(F64) - old_logprobs.to(F64)
    idx = (seq * K + b)[valid]
    acc = torch.zeros(n * K, 3, dtype=F64)
    acc.index_add_(0, idx, torch.stack([torch.ones_like(d), d, e], dim=1)[valid])
    out.copy_(acc.reshape(-1))


def espo_loss_forward_torch(
    *,
    logprobs,
    old_logprobs,
    entropy,
    advantages,
    cu_seqlens,
    mask,
    thresholds,
    sums,
    num_groups,
    flags,
    eps_low,
    eps_high,
    eps_scale,
    dual_clip,
    log_lo,
    log_hi,
    inv_num_seqs,
    need_grad,
    loss,
    grad,
    seq_stats,
    stats,
) -> None:
    """``espo_loss_forward`` op: the loss (0-d, logprobs' dtype), d loss / d l
    per token (``grad`` [T], or [0] when not need_grad; 0 off the loss),
    seq_stats [n, 3K + 7] and stats [3K + 7] float64 (loss.py: stat_width)."""
    n, K, total = cu_seqlens.shape[0] - 1, num_groups, logprobs.shape[0]
    width = 3 * K + 7
    if need_grad:
        grad.zero_()
    if n == 0:  # no sequence: no loss, the ratio extremes' identities
        stats.zero_()
        stats[-2:] = torch.tensor([math.inf, -math.inf], dtype=F64)
        loss.zero_()
        return
    seq, valid = _tokens(cu_seqlens, mask, total)
    token_groups = bool(flags & _TOKEN_GROUPS)
    b = (
        torch.zeros(total, dtype=torch.int64)
        if token_groups
        else _buckets(entropy.to(F64), seq, thresholds, K, flags)
    )
    # per (sequence, group): count, mean d, s_g, clip range, weight
    s3 = sums.view(n, K, 3)
    cnt = s3[..., 0]
    if token_groups:
        groups = cnt[:, 0]
    else:
        first = 1 if flags & _DROP_LOW else 0
        groups = (cnt[:, first:] > 0).sum(dim=1).to(F64)
    m_g = s3[..., 1] / cnt
    adaptive = bool(flags & _ADAPTIVE)
    eps = eps_scale * (s3[..., 2] / cnt) if adaptive else None
    weight = inv_num_seqs / (groups[:, None] * (1.0 if token_groups else cnt))

    i = seq.clamp(max=n - 1)
    in_loss = valid & ~((b == 0) & bool(flags & _DROP_LOW))
    d = logprobs.to(F64) - old_logprobs.to(F64)
    r = torch.exp(d)
    gm, gw = m_g[i, b], weight[i, b]
    log_s = d if token_groups else gm if flags & _GSPO_TOKEN else gm + d
    clamped = (log_s < log_lo) | (log_s > log_hi)
    value = r if token_groups else torch.exp(gm) if flags & _GSPO_TOKEN else torch.exp(gm) * r
    s = torch.where(clamped, torch.exp(log_s.clamp(log_lo, log_hi)), value)
    a = advantages.to(F64)
    a = a if flags & _ADV_PER_TOKEN else a[i]
    el = eps[i, b] if eps is not None else torch.full_like(s, eps_low)  # None: fixed clip
    eh = eps[i, b] if eps is not None else torch.full_like(s, eps_high)
    c = torch.minimum(torch.maximum(s, 1.0 - el), 1.0 + eh)
    o1, o2 = s * a, c * a
    clipped = o2 < o1
    f = torch.where(clipped, o2, o1)
    dual = (a < 0) & (f < dual_clip * a) if dual_clip > 0.0 else torch.zeros_like(clipped)
    f = torch.where(dual, dual_clip * a, f)
    g_tok = torch.where(clipped | dual | clamped, 0.0, a * s)

    row = torch.zeros(n + 1, width, dtype=F64)  # row n: padding, dropped below
    ones = torch.ones_like(d)
    vi, li = seq[valid], seq[in_loss]
    row[:, 3 * K + 3].index_add_(0, vi, (r - 1.0 - d)[valid])
    row[:, 3 * K + 4].index_add_(0, vi, (d.abs() > math.log(2.0)).to(F64)[valid])
    row[:, 3 * K].index_add_(0, li, (-gw * f)[in_loss])
    row[:, 3 * K + 1].index_add_(0, li, ones[in_loss])
    row[:, 3 * K + 2].index_add_(0, li, s[in_loss])
    flat = row.view(-1)
    for col0, hit in ((0, clipped & (a < 0)), (K, clipped & (a > 0)), (2 * K, dual)):
        sel = in_loss & hit
        flat.index_add_(0, seq[sel] * width + col0 + b[sel], ones[sel])
    rmin = torch.full((n + 1,), math.inf, dtype=F64).scatter_reduce_(0, li, s[in_loss], "amin")
    rmax = torch.full((n + 1,), -math.inf, dtype=F64).scatter_reduce_(0, li, s[in_loss], "amax")
    row[:, 3 * K + 5], row[:, 3 * K + 6] = rmin, rmax
    row = row[:n]
    seq_stats.copy_(row.reshape(-1))
    stats.copy_(
        torch.cat(
            [row[:, : 3 * K + 5].sum(dim=0), rmin[:n].amin().reshape(1), rmax[:n].amax().reshape(1)]
        )
    )
    loss.copy_(stats[3 * K])  # no host read
    if need_grad:
        grad.copy_(torch.where(in_loss, -gw * g_tok, 0.0))


def espo_loss_backward_torch(*, grad_loss, grad_coef, out) -> None:
    """``espo_loss_backward`` op: out [T] = grad_loss (1 element) * grad_coef."""
    torch.mul(grad_coef, grad_loss.reshape(()), out=out)
