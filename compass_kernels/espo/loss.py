"""ESPO segmented policy loss (``ck.espo.espo_loss``): entropy groups, group
ratios, per-group adaptive clipping and the three-level mean, forward and
backward, on packed varlen batches, with context parallelism.

Two ops per call, each with a torch (CPU: ``reference_loss.py``'s
``*_torch``) and a Triton kernel (GPU: ``triton_loss.py``):
``espo_group_sums`` (phase 1: per (sequence, entropy group) token count, sum
of l - l_old and of entropy) and
``espo_loss_forward`` (phase 2: per-token ratio, clip decision, loss,
d loss / d logprobs, statistics). Between them a context-parallel group
all-reduces the sums (a sequence's tokens are spread over its CP ranks). The
gradient is computed in phase 2 (4 bytes per token written once) and the
backward op ``espo_loss_backward`` scales it: cheaper than re-reading the five
inputs (17+ bytes per token) in a recomputing backward.

The group boundaries (entropy quantiles) come from :func:`entropy_thresholds`,
a sort on the device (no host sync), or from the caller
(``entropy_threshold=``, e.g. computed once over the global mini-batch).

Spec: ``reference_loss.py``; options: ``loss_config.py``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from compass_kernels._op import op
from compass_kernels._validate import (
    FLOAT_DTYPES,
    as_int,
    check_finite,
    check_offsets,
    check_tensor,
    has_no_data,
    should_check,
)
from compass_kernels.espo import loss_config

__all__ = ["espo_loss", "entropy_thresholds", "EspoMetrics"]

# flags shared with the kernels (reference_loss.py, triton_loss.py)
PER_SEQ_THRESHOLDS, TOKEN_GROUPS, DROP_LOW, ADAPTIVE_EPS, GSPO_TOKEN_FORM, ADV_PER_TOKEN = (
    1,
    2,
    4,
    8,
    16,
    32,
)
F64 = torch.float64


def stat_width(num_groups: int) -> int:
    """Columns of a statistics row: clipped-low, clipped-high, dual-clipped per
    group, then loss, loss tokens, sum ratio, sum k3, |log-ratio| > ln 2 count,
    min ratio, max ratio (min / max last: a CP all-reduce takes MIN / MAX there)."""
    return 3 * num_groups + 7


# ---------------------------------------------------------------------- ops


_TRITON = "compass_kernels.espo.triton_loss:"
_TORCH = "compass_kernels.espo.reference_loss:"


@op(
    kernels={
        "torch": _TORCH + "espo_group_sums_torch",
        "triton": _TRITON + "espo_group_sums_triton",
    }
)
def espo_group_sums_op(
    entropy: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None,
    thresholds: torch.Tensor,
    num_groups: int,
    flags: int,
) -> torch.Tensor:
    """Phase 1: per (sequence, entropy group) token count, sum of l - l_old, sum of entropy.

    entropy, logprobs, old_logprobs : [T] float32 | float64 (one dtype).
    cu_seqlens : [n+1] int64. mask : [T] bool or None. thresholds : [K-1] (or
    [n*(K-1)] per sequence) float64 group boundaries. num_groups : K. flags :
    the bit set above (PER_SEQ_THRESHOLDS, TOKEN_GROUPS, ...).
    Returns out [n*K*3] float64.
    """
    n = cu_seqlens.shape[0] - 1
    return torch.empty(n * num_groups * 3, dtype=F64, device=entropy.device)


class EspoForward(NamedTuple):
    """Outputs of :data:`espo_loss_forward_op`."""

    loss: torch.Tensor  # [] logprobs' dtype
    grad: torch.Tensor  # [T] d loss / d logprobs ([0] without need_grad)
    seq_stats: torch.Tensor  # [n * stat_width(K)] float64
    stats: torch.Tensor  # [stat_width(K)] float64


@op(
    kernels={
        "torch": _TORCH + "espo_loss_forward_torch",
        "triton": _TRITON + "espo_loss_forward_triton",
    }
)
def espo_loss_forward_op(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None,
    thresholds: torch.Tensor,
    sums: torch.Tensor,
    num_groups: int,
    flags: int,
    eps_low: float,
    eps_high: float,
    eps_scale: float,
    dual_clip: float,
    log_lo: float,
    log_hi: float,
    inv_num_seqs: float,
    need_grad: bool,
) -> EspoForward:
    """Phase 2: per-token ratio, clip decision, loss, d loss / d logprobs, statistics.

    logprobs, old_logprobs, entropy : [T] float32 | float64. advantages : [n]
    or [T] (flags & ADV_PER_TOKEN). cu_seqlens, mask, thresholds, num_groups,
    flags : as espo_group_sums_op. sums : its output (all-reduced over CP).
    eps_low, eps_high : fixed clip range; eps_scale : alpha / ln V for the
    adaptive range (flags & ADAPTIVE_EPS). dual_clip : c > 1, or 0. log_lo,
    log_hi : the log-ratio clamp. inv_num_seqs : 1 / G of the three-level
    mean. need_grad : write ``grad``.
    """
    n, width = cu_seqlens.shape[0] - 1, stat_width(num_groups)
    dev = logprobs.device
    return EspoForward(
        loss=logprobs.new_empty(()),
        grad=logprobs.new_empty(logprobs.shape[0] if need_grad else 0),
        seq_stats=torch.empty(n * width, dtype=F64, device=dev),
        stats=torch.empty(width, dtype=F64, device=dev),
    )


@op(
    kernels={
        "torch": _TORCH + "espo_loss_backward_torch",
        "triton": _TRITON + "espo_loss_backward_triton",
    }
)
def espo_loss_backward_op(grad_loss: torch.Tensor, grad_coef: torch.Tensor) -> torch.Tensor:
    """out [T] = grad_loss (one element) * grad_coef [T] (the forward's ``grad``)."""
    return torch.empty_like(grad_coef)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])  # EspoForward.grad
    ctx.backend = espo_loss_forward_op.bind(inputs).get("backend")


def _backward(ctx, grad_loss, *_):
    (coef,) = ctx.saved_tensors
    # Through the dispatcher: the backward is traced by AOT autograd too (fakes).
    grad = torch.ops.compass.espo_loss_backward(
        grad_loss=grad_loss.reshape(1).contiguous(), grad_coef=coef, backend=ctx.backend
    )
    return espo_loss_forward_op.input_grads(logprobs=grad)


torch.library.register_autograd(
    "compass::espo_loss_forward", _backward, setup_context=_setup_context
)


class _EagerLoss(torch.autograd.Function):
    """The eager twin of the registered autograd (same ops, same backward op):
    the dispatcher's autograd wrapper costs ~0.1-0.8 ms per call on this CPU
    (torch's fill_defaults walks the 19-argument schema quadratically);
    torch.compile goes through torch.ops.compass.espo_loss_forward instead.
    ``args``: the op's arguments by name, ``logprobs`` the one differentiable."""

    @staticmethod
    def forward(ctx, logprobs, backend, args):
        res = espo_loss_forward_op(logprobs=logprobs, **args, backend=backend)
        ctx.save_for_backward(res.grad)
        ctx.backend = backend
        ctx.mark_non_differentiable(res.grad, res.seq_stats, res.stats)
        return tuple(res)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (coef,) = ctx.saved_tensors
        grad = espo_loss_backward_op(
            grad_loss=grad_loss.reshape(1).contiguous(), grad_coef=coef, backend=ctx.backend
        )
        return grad, None, None


# ------------------------------------------------------------- thresholds


_LEVELS: dict[tuple, torch.Tensor] = {}


def _levels(levels: tuple[float, ...], dev: torch.device) -> torch.Tensor:
    if has_no_data():  # fake mode / tracing: a fresh tensor of that mode, never cached
        return torch.tensor(levels, dtype=F64, device=dev)
    t = _LEVELS.get((levels, dev))
    if t is None:
        if len(_LEVELS) > 64:
            _LEVELS.clear()
        t = _LEVELS[(levels, dev)] = torch.tensor(levels, dtype=F64, device=dev)
    return t


def entropy_thresholds(
    old_entropy: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    levels: tuple[float, ...],
    per_sequence: bool = False,
    cp_group=None,
) -> torch.Tensor:
    """Entropy group boundaries: the quantiles at ``levels`` (linear
    interpolation, as ``torch.quantile``) of the valid tokens' entropy, over
    the batch ([Q] float64) or per sequence ([n, Q] float64; rows of sequences
    without valid tokens are unused). With ``cp_group`` the quantile is over the
    tokens of every rank of the group (entropies all-gathered; every rank must
    hold the same number of tokens, as Megatron's CP split gives).

    A device sort, no host sync. Valid tokens: before cu_seqlens[-1] and mask.
    """
    e = old_entropy.detach().to(F64)
    total, n, dev = e.shape[0], cu_seqlens.shape[0] - 1, e.device
    cu = cu_seqlens.to(torch.int64)
    valid = torch.arange(total, device=dev) < cu[-1]
    if mask is not None:
        valid &= mask
    x = torch.where(valid, e, math.inf)
    q = _levels(tuple(levels), dev)  # cached: no host-to-device copy per call
    if not per_sequence:
        if cp_group is not None:
            x = _all_gather(x, cp_group)
        srt = torch.sort(x).values
        nv = torch.isfinite(srt).sum()
        return _interpolate(srt, torch.zeros((), dtype=torch.int64, device=dev), nv, q)
    # sequence id per token (padding after cu[n] gets n); output_size: no host sync.
    # (torch.searchsorted took ~20 ms for 256 tokens on a loaded 2-core host.)
    counts = torch.cat([cu.diff(), (total - cu[-1]).reshape(1)])
    seq = torch.repeat_interleave(torch.arange(n + 1, device=dev), counts, output_size=total)
    key = torch.where(valid, seq, n)
    if cp_group is not None:
        x, key = _all_gather(x, cp_group), _all_gather(key, cp_group)
    order = torch.sort(x, stable=True).indices
    order = order[torch.sort(key[order], stable=True).indices]
    counts = torch.zeros(n + 1, dtype=torch.int64, device=e.device)
    counts.index_add_(0, key, torch.ones_like(key))
    nv = counts[:n]
    start = torch.cumsum(counts, 0)[:n] - nv
    return _interpolate(x[order], start[:, None], nv[:, None], q[None, :])


def _interpolate(srt, start, nv, q):
    """torch.quantile's linear rule on sorted runs starting at ``start`` of ``nv`` values."""
    pos = q * (nv - 1).clamp(min=0).to(F64)
    lo = pos.floor()
    w = pos - lo
    last = max(srt.shape[0] - 1, 0)
    i_lo = (start + lo.to(torch.int64)).clamp(max=last)
    i_hi = (start + pos.ceil().to(torch.int64)).clamp(max=last)
    if srt.shape[0] == 0:
        return torch.full(
            torch.broadcast_shapes(i_lo.shape, w.shape), math.nan, dtype=F64, device=srt.device
        )
    return torch.lerp(srt[i_lo], srt[i_hi], w)


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = t.new_empty((dist.get_world_size(group) * t.shape[0],))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


# ---------------------------------------------------------------- metrics


class EspoMetrics(Mapping):
    """The loss's metrics as float64 device tensors (0-d, or [K] per entropy group),
    computed from the kernels' statistics when read (a call pays for none):

    loss (the whole loss, over a CP group too), tokens, loss_tokens,
    group_token_frac [K], entropy_mean, group_entropy_mean [K], clip_frac,
    clip_frac_low [K], clip_frac_high [K] (clipped tokens of the group /
    tokens of the group), dual_clip_frac, ratio_mean, ratio_min, ratio_max
    (token ratio s_t over the tokens in the loss), kl_k3 (mean of
    exp(d) - 1 - d, d = l - l_old), ppo_kl (-mean d),
    log_ratio_gt_ln2_frac. A fraction of no tokens is 0."""

    KEYS = (
        "loss",
        "tokens",
        "loss_tokens",
        "group_token_frac",
        "entropy_mean",
        "group_entropy_mean",
        "clip_frac",
        "clip_frac_low",
        "clip_frac_high",
        "dual_clip_frac",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "kl_k3",
        "ppo_kl",
        "log_ratio_gt_ln2_frac",
    )

    def __init__(self, stats: torch.Tensor, sums: torch.Tensor, num_groups: int) -> None:
        self.stats, self.sums, self.num_groups = stats, sums, num_groups
        self._cache: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.KEYS)

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.KEYS:
            raise KeyError(key)
        if key not in self._cache:
            self._cache.update(self._compute())
        return self._cache[key]

    def _compute(self) -> dict[str, torch.Tensor]:
        K, s = self.num_groups, self.stats
        per_group = self.sums.view(-1, K, 3).sum(0)
        tokens_k, entropy_k, d_sum = per_group[:, 0], per_group[:, 2], per_group[:, 1].sum()
        tokens = tokens_k.sum()
        one = lambda x: x.clamp(min=1.0)  # noqa: E731
        low, high, dual = s[0:K], s[K : 2 * K], s[2 * K : 3 * K]
        loss, in_loss, ratio_sum, k3_sum, big, rmin, rmax = s[3 * K : 3 * K + 7].unbind()
        # k3 and the ln 2 count are per valid token; they are summed over every valid token
        return {
            "loss": loss,
            "tokens": tokens,
            "loss_tokens": in_loss,
            "group_token_frac": tokens_k / one(tokens),
            "entropy_mean": entropy_k.sum() / one(tokens),
            "group_entropy_mean": entropy_k / one(tokens_k),
            "clip_frac": (low.sum() + high.sum()) / one(in_loss),
            "clip_frac_low": low / one(tokens_k),
            "clip_frac_high": high / one(tokens_k),
            "dual_clip_frac": dual.sum() / one(in_loss),
            "ratio_mean": ratio_sum / one(in_loss),
            "ratio_min": torch.where(in_loss > 0, rmin, 0.0),
            "ratio_max": torch.where(in_loss > 0, rmax, 0.0),
            "kl_k3": k3_sum / one(tokens),
            "ppo_kl": -d_sum / one(tokens),
            "log_ratio_gt_ln2_frac": big / one(tokens),
        }


# ------------------------------------------------------------- public API


# The resolved options, cached by name (every option a keyword: nothing positional to
# keep in step with loss_config.resolve's signature).
_config = functools.lru_cache(maxsize=64)(loss_config.resolve)


_EMPTY: dict[torch.device, torch.Tensor] = {}


def _empty_f64(dev: torch.device) -> torch.Tensor:
    t = _EMPTY.get(dev)
    if t is None:
        t = _EMPTY[dev] = torch.empty(0, dtype=F64, device=dev)
    return t


def _real(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.requires_grad:
        t = t.detach()
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def espo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    old_entropy: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    mode: str = "espo",
    rho: float = 0.2,
    alpha: float = 0.02,
    clip: float | tuple[float, float] | None = None,
    vocab_size: int | None = None,
    num_sequences: int | None = None,
    grouping: str = "global",
    num_groups: int | None = None,
    quantiles: tuple[float, ...] | None = None,
    drop_low: bool = False,
    ratio_form: str | None = None,
    dual_clip: float | None = None,
    entropy_threshold: torch.Tensor | None = None,
    advantages_per_token: bool | None = None,
    cp_group=None,
    validate: bool | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, EspoMetrics]:
    """ESPO (arXiv 2512.00499) clipped policy loss on a packed batch; also
    GSPO-token and PPO/GRPO clipping, exactly as verl defines them.

    Parameters
    ----------
    logprobs : [T] float (bf16/fp16 computed in float32), the current policy's
        log-prob of each token; the loss is differentiable with respect to it.
    old_logprobs, old_entropy : [T] float, the old (rollout) policy's log-prob
        and full-distribution entropy per token (no gradient).
    advantages : [n] per sequence, or [T] per token (``advantages_per_token``
        says which when n == T).
    cu_seqlens : [n+1] int32 | int64 sequence boundaries (cu[0] == 0,
        non-decreasing, cu[-1] <= T; tokens after cu[-1] are padding: no loss,
        zero gradient).
    mask : optional [T] bool, False for tokens outside the loss (prompt, pad).
    mode : "espo" | "gspo" | "grpo" (loss_config.py: what each fixes).
    rho : fraction of high-entropy tokens (the boundary is the (1 - rho) quantile).
    alpha, vocab_size : adaptive clip range eps_g = alpha * mean_g(entropy) / ln(vocab_size).
    clip : fixed eps (a float, or (eps_low, eps_high) for clip-higher) instead of
        adaptive; defaults: gspo (3e-4, 4e-4), grpo 0.2.
    num_sequences : G, the loss's sequence denominator: the number of sequences
        of the global mini-batch (all DP ranks and micro-batches) so that summed
        micro-batch gradients equal the mini-batch's; default len(cu_seqlens) - 1.
    grouping : "global" (quantile over the batch) | "sequence" (per sequence).
    num_groups, quantiles : K equal-mass entropy buckets, or explicit quantile
        levels of the boundaries (instead of rho).
    drop_low : leave the lowest-entropy group out of the loss.
    ratio_form : "espo" (Eq. 9: sg[s_g] * r_t, default) | "gspo_token".
    dual_clip : c > 1: dual-clip for negative advantages (loss <= -c A).
    entropy_threshold : [K-1] float boundaries to use instead of the batch's quantile.
    cp_group : a torch.distributed group of the context-parallel ranks that hold
        parts of the same sequences: thresholds, group sums and metrics are
        reduced over it; the returned loss is this rank's part (its gradient
        is exact), ``metrics["loss"]`` the whole.
    validate : check cu_seqlens and finite inputs (``_validate.should_check``):
        None (default) on CPU tensors, not on CUDA (a host sync); True
        everywhere; False never; never on fake / meta tensors or while tracing.
        NaN / Inf policy: logprobs, old_logprobs, old_entropy (tokens before
        cu_seqlens[-1]) and advantages must be finite (ValueError naming the
        argument and index where checked); unchecked, the loss, its gradient and
        the metrics are NaN. Padding tokens past cu_seqlens[-1] are never read.
    backend : None (torch on CPU, triton on CUDA), "torch" or "triton".

    Returns
    -------
    loss : 0-d tensor (float32, float64 for float64 logprobs).
    metrics : :class:`EspoMetrics` (device tensors, no host sync).
    """
    cfg, total, dev, n, adv_tok, mask, G, R, lp, old, ent, adv, cu = _check_inputs(
        logprobs,
        old_logprobs,
        old_entropy,
        advantages,
        cu_seqlens,
        mask,
        mode=mode,
        rho=rho,
        alpha=alpha,
        clip=clip,
        vocab_size=vocab_size,
        num_sequences=num_sequences,
        grouping=grouping,
        num_groups=num_groups,
        quantiles=quantiles,
        drop_low=drop_low,
        ratio_form=ratio_form,
        dual_clip=dual_clip,
        advantages_per_token=advantages_per_token,
        validate=validate,
    )
    K = 1 if cfg.token_groups else cfg.num_groups
    flags = (TOKEN_GROUPS if cfg.token_groups else 0) | (DROP_LOW if cfg.drop_low else 0)
    flags |= (ADAPTIVE_EPS if cfg.adaptive else 0) | (ADV_PER_TOKEN if adv_tok else 0)
    flags |= GSPO_TOKEN_FORM if cfg.ratio_form == "gspo_token" else 0
    if K == 1:
        thr = _empty_f64(dev)
    elif entropy_threshold is not None:
        _check_threshold(entropy_threshold, K, dev)
        thr = entropy_threshold.detach().to(F64).contiguous()
    else:
        thr = entropy_thresholds(
            ent, cu, mask, levels=cfg.levels, per_sequence=cfg.per_sequence, cp_group=cp_group
        )
        thr = thr.reshape(-1)
        flags |= PER_SEQ_THRESHOLDS if cfg.per_sequence else 0
    lp_data = lp.detach()
    sums = espo_group_sums_op(
        entropy=ent,
        logprobs=lp_data,
        old_logprobs=old,
        cu_seqlens=cu,
        mask=mask,
        thresholds=thr,
        num_groups=K,
        flags=flags,
        backend=backend,
    )
    if cp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(sums, group=cp_group)
    need_grad = lp.requires_grad and torch.is_grad_enabled()
    el, eh = (0.0, 0.0) if cfg.adaptive else (cfg.eps_low, cfg.eps_high)
    scale = cfg.alpha / cfg.log_vocab if cfg.adaptive else 0.0
    args = dict(
        old_logprobs=old,
        entropy=ent,
        advantages=adv,
        cu_seqlens=cu,
        mask=mask,
        thresholds=thr,
        sums=sums,
        num_groups=K,
        flags=flags,
        eps_low=el,
        eps_high=eh,
        eps_scale=scale,
        dual_clip=cfg.dual_clip,
        log_lo=cfg.log_lo,
        log_hi=cfg.log_hi,
        inv_num_seqs=1.0 / max(G, 1),
        need_grad=need_grad,
    )
    if need_grad and torch.compiler.is_compiling():
        loss, _, _, stats = torch.ops.compass.espo_loss_forward(
            logprobs=lp, **args, backend=backend
        )
    elif need_grad:
        loss, _, _, stats = _EagerLoss.apply(lp, backend, args)
    else:
        loss, _, _, stats = espo_loss_forward_op(logprobs=lp, **args, backend=backend)
    if cp_group is not None:
        stats = _reduce_stats(stats, K, cp_group)
    return loss, EspoMetrics(stats, sums, K)


def _check_inputs(
    logprobs,
    old_logprobs,
    old_entropy,
    advantages,
    cu_seqlens,
    mask,
    *,
    mode,
    rho,
    alpha,
    clip,
    vocab_size,
    num_sequences,
    grouping,
    num_groups,
    quantiles,
    drop_low,
    ratio_form,
    dual_clip,
    advantages_per_token,
    validate,
    rows=None,
    device=None,
):
    """espo_loss's input checks: metadata (shapes, dtypes, devices, options) always,
    data (cu_seqlens offsets, finite values) where ``should_check(validate)`` says.
    ``logprobs`` None: not yet computed (check_loss_inputs), ``rows`` tokens on
    ``device``; lp is then None."""
    rho, alpha, clip, vocab_size, num_groups, quantiles, drop_low, dual_clip = (
        loss_config.normalize(
            rho, alpha, clip, vocab_size, num_groups, quantiles, drop_low, dual_clip
        )
    )
    cfg = _config(
        mode=mode,
        rho=rho,
        alpha=alpha,
        clip=clip,
        vocab_size=vocab_size,
        grouping=grouping,
        num_groups=num_groups,
        quantiles=quantiles,
        drop_low=drop_low,
        ratio_form=ratio_form,
        dual_clip=dual_clip,
    )
    if logprobs is not None:
        check_tensor("logprobs", logprobs, ndim=1, dtypes=FLOAT_DTYPES)
        total, dev = logprobs.shape[0], logprobs.device
    else:
        total, dev = rows, device
    per_tok = "one per token = len(logprobs)"
    for name, t in (("old_logprobs", old_logprobs), ("old_entropy", old_entropy)):
        check_tensor(
            name, t, ndim=1, dtypes=FLOAT_DTYPES, size=total, size_what=per_tok, device=dev
        )
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected at least 1 element (n+1), got 0")
    n = cu_seqlens.shape[0] - 1
    check_tensor("advantages", advantages, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    adv_tok = _advantages_layout(advantages.shape[0], n, total, advantages_per_token)
    if mask is not None:
        check_tensor(
            "mask", mask, ndim=1, dtypes=(torch.bool,), size=total, size_what=per_tok, device=dev
        )
        mask = mask if mask.is_contiguous() else mask.contiguous()
    G = n if num_sequences is None else as_int("num_sequences", num_sequences, lo=1)
    R = F64 if logprobs is not None and logprobs.dtype == F64 else torch.float32
    lp = None
    if logprobs is not None:
        lp = logprobs if logprobs.dtype == R else logprobs.to(R)
        lp = lp if lp.is_contiguous() else lp.contiguous()
    old, ent, adv = _real(old_logprobs, R), _real(old_entropy, R), _real(advantages, R)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)
    cu = cu if cu.is_contiguous() else cu.contiguous()
    if should_check(validate, *(t for t in (lp, old, ent, adv, cu) if t is not None)):
        check_offsets("cu_seqlens", cu, total, exact=False)
        tokens = torch.arange(total, device=dev) < cu[-1]
        for name, t in (("logprobs", lp), ("old_logprobs", old), ("old_entropy", ent)):
            if t is not None:
                check_finite(name, torch.where(tokens, t.detach(), 0))
        check_finite("advantages", torch.where(tokens, adv, 0) if adv_tok else adv)
    return cfg, total, dev, n, adv_tok, mask, G, R, lp, old, ent, adv, cu


_LOSS_DEFAULTS = {k: p.default for k, p in inspect.signature(espo_loss).parameters.items()}


def check_loss_inputs(
    rows: int,
    device: torch.device,
    old_logprobs,
    old_entropy,
    advantages,
    cu_seqlens,
    mask=None,
    *,
    entropy_threshold=None,
    validate=None,
    cp_group=None,
    backend=None,
    **options,
):
    """Check espo_loss's inputs for a batch of ``rows`` tokens on ``device``
    whose logprobs are not computed yet (the fused lm_head paths): the same
    errors as espo_loss, without running it. Metadata checks launch no kernel;
    data checks (cu_seqlens offsets, finite values) run where
    ``should_check(validate)`` says (CPU by default, a GPU with validate=True)."""
    del cp_group, backend  # accepted as espo_loss does; nothing to check without data
    names = (
        "mode",
        "rho",
        "alpha",
        "clip",
        "vocab_size",
        "num_sequences",
        "grouping",
        "num_groups",
        "quantiles",
        "drop_low",
        "ratio_form",
        "dual_clip",
        "advantages_per_token",
    )
    unknown = set(options) - set(names)
    if unknown:
        raise TypeError(f"check_loss_inputs: unexpected keyword argument(s) {sorted(unknown)}")
    kw = {k: options.get(k, _LOSS_DEFAULTS[k]) for k in names}
    cfg = _check_inputs(
        None,
        old_logprobs,
        old_entropy,
        advantages,
        cu_seqlens,
        mask,
        **kw,
        validate=validate,
        rows=rows,
        device=device,
    )[0]
    K = 1 if cfg.token_groups else cfg.num_groups
    if K > 1 and entropy_threshold is not None:
        _check_threshold(entropy_threshold, K, device)


def _check_threshold(entropy_threshold: torch.Tensor, K: int, device: torch.device) -> None:
    """A given entropy_threshold: the K - 1 group boundaries (espo_loss, check_loss_inputs)."""
    check_tensor(
        "entropy_threshold",
        entropy_threshold,
        ndim=1,
        dtypes=FLOAT_DTYPES,
        size=K - 1,
        size_what="num_groups - 1 boundaries",
        device=device,
    )


def _advantages_layout(size: int, n: int, total: int, per_token: bool | None) -> bool:
    if per_token is None:
        if size == n == total:
            raise ValueError(
                f"advantages: {size} elements is both one per sequence and one per token; pass "
                "advantages_per_token=True or False"
            )
        if size not in (n, total):
            raise ValueError(
                f"advantages: expected {n} elements (one per sequence) or {total} (one per "
                f"token), got {size}"
            )
        return size == total
    want = total if per_token else n
    if size != want:
        what = "one per token" if per_token else "one per sequence"
        raise ValueError(f"advantages: expected {want} elements ({what}), got {size}")
    return bool(per_token)


def _reduce_stats(stats: torch.Tensor, K: int, group) -> torch.Tensor:
    """All-reduce the statistics over a CP group: SUM, then MIN of (min, -max)."""
    import torch.distributed as dist

    w = stat_width(K)
    sums = stats[: w - 2].clone()
    extremes = torch.stack([stats[w - 2], -stats[w - 1]])
    dist.all_reduce(sums, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=group)
    return torch.cat([sums, extremes[:1], -extremes[1:]])
