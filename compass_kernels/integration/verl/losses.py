"""verl policy losses computed by ``ck.espo.espo_loss`` on verl's padded tensors.

verl calls a registered policy loss as ``fn(old_log_prob, log_prob,
advantages, response_mask, loss_agg_mode, config, rollout_is_weights)`` with
[B, L] tensors (L = the micro-batch's response length, padding where
``response_mask`` is 0) and expects ``(loss, metrics)``: the loss already
normalised for the global mini-batch (``config.global_batch_info``: dp_size,
batch_num_tokens, global_batch_size, loss_scale_factor) so that summed
micro-batch gradients, averaged over data-parallel ranks, are the mini-batch's.

How the padded batch meets the kernel (no copy): row i of [B, L] is sequence
i, so ``log_prob.reshape(-1)`` with ``cu_seqlens = [0, L, 2L, ...]`` and
``mask = response_mask`` *is* the packed batch: the kernel skips masked
tokens (they are outside every group, get no loss and a zero gradient), and
the gradient reaches ``log_prob`` through the view. Gathering the valid tokens
into a dense buffer and scattering the gradient back would cost two extra
passes for the same numbers.

Aggregation: the kernel's loss is sum_t w_t f_t(A_t) with w_t = 1/(K_i |g_t|)
(``num_sequences=1``), and f_t (the clipped surrogate, dual clip included) is
positively homogeneous in A: f_t(c A) = c f_t(A) for c >= 0, the clip
decisions unchanged. So every verl aggregation is the kernel run on scaled
advantages A'_t = A_t * rw_t * W_i / w_t, where W_i is verl's weight of a
token of sequence i (``agg_loss``: dp / batch_num_tokens for token-mean, dp for
token-sum, dp / global_batch_size for seq-mean-token-sum (divided by
loss_scale_factor, or L, for -norm), dp / (global_batch_size (n_i + 1e-8)) for
seq-mean-token-mean) and rw_t the rollout importance weight, which verl
multiplies into the per-token loss. For ESPO, seq-mean-token-mean is ESPO's
own three-level mean (sequence, entropy group, token) with the global
sequence count: W_i = dp / global_batch_size, w_t kept.

Metrics: verl's names for its own losses (``actor/pg_clipfrac``,
``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, micro-batch means over the
valid tokens) and ours under ``actor/compass/`` (per entropy group: token
fraction, mean group size, clip fractions low / high, entropy; ratio mean /
max, k3 KL, |log-ratio| > ln 2 fraction), read in one host transfer.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import compass_kernels as ck
from compass_kernels._validate import FLOAT_DTYPES, describe
from compass_kernels.espo import loss_config

from . import probe

__all__ = [
    "AGG_MODES",
    "EspoOptions",
    "compass_espo_loss",
    "compass_grpo_loss",
    "compass_gspo_loss",
    "espo_policy_loss",
    "old_entropy_context",
]

#: every loss_agg_mode of verl 0.9's agg_loss
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)

F64 = torch.float64


@dataclass
class EspoOptions:
    """``compass_espo``'s options (``ck.espo.espo_loss``'s names). ``vocab_size``
    None: read from ``config.model_config.hf_config.vocab_size``."""

    rho: float = 0.2
    alpha: float = 0.02
    clip: float | tuple[float, float] | None = None
    vocab_size: int | None = None
    num_groups: int | None = None
    quantiles: tuple[float, ...] | None = None
    drop_low: bool = False
    ratio_form: str | None = None
    dual_clip: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


#: the options the registered ``compass_espo`` uses (set by ``register(espo=...)``)
ESPO_OPTIONS = EspoOptions()

# (old entropy [B, L], entropy threshold [B, K-1] or None) of the micro-batch whose
# loss is being computed, set by the ppo_loss wrapper of entropy.py.
_OLD_ENTROPY: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor | None] | None] = (
    contextvars.ContextVar("compass_verl_old_entropy", default=None)
)


class old_entropy_context:
    """``with old_entropy_context(old_entropy, threshold):`` makes the registered
    ``compass_espo`` read this micro-batch's old-policy entropy ([B, L], as
    ``old_log_prob``) and, optionally, the entropy-group boundaries of the
    global batch ([B, K-1] rows, all equal, or [K-1])."""

    def __init__(self, old_entropy: torch.Tensor, threshold: torch.Tensor | None = None):
        self.value = (old_entropy, threshold)

    def __enter__(self):
        self._token = _OLD_ENTROPY.set(self.value)
        return self

    def __exit__(self, *exc):
        _OLD_ENTROPY.reset(self._token)


# ---------------------------------------------------------------- helpers


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping) or hasattr(config, "get"):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


def _check_padded(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, extra=()):
    if not isinstance(log_prob, torch.Tensor) or log_prob.dim() != 2:
        raise ValueError(
            "log_prob: expected a [B, L] tensor (verl's padded layout), got "
            + (
                describe(log_prob)
                if isinstance(log_prob, torch.Tensor)
                else type(log_prob).__name__
            )
        )
    shape, dev = tuple(log_prob.shape), log_prob.device
    named = [
        ("old_log_prob", old_log_prob),
        ("advantages", advantages),
        ("response_mask", response_mask),
        *extra,
    ]
    if rollout_is_weights is not None:
        named.append(("rollout_is_weights", rollout_is_weights))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.device != dev:
            raise ValueError(
                f"{name}: expected shape {list(shape)} on {dev} (as log_prob), got {describe(t)}"
            )
    if log_prob.dtype not in FLOAT_DTYPES:
        raise ValueError(f"log_prob: expected a float tensor, got {describe(log_prob)}")


def _sequence_weights(mask: torch.Tensor, loss_agg_mode: str, config: Any, native_espo: bool):
    """verl's weight W_i of one token of sequence i ([B] float64), from agg_loss."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode: expected one of {AGG_MODES}, got {loss_agg_mode!r}")
    info = _get(config, "global_batch_info", {}) or {}
    dp = info.get("dp_size") or 1
    B, L = mask.shape
    n = mask.sum(-1).to(F64)
    if loss_agg_mode == "token-mean":
        bnt = info.get("batch_num_tokens")
        if bnt is None:
            if dp > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            bnt = n.sum()
        return torch.full_like(n, float(dp)) / bnt
    if loss_agg_mode == "token-sum":
        return torch.full_like(n, float(dp))
    gbs = info.get("global_batch_size")
    if gbs is None:
        if dp > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        gbs = (n > 0).sum().to(F64)
    w = torch.full_like(n, float(dp)) / gbs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = info.get("loss_scale_factor") or _get(config, "loss_scale_factor") or L
        return w / scale
    if loss_agg_mode == "seq-mean-token-mean" and not native_espo:
        # verl: int64 count + 1e-8 in the default float dtype (float32: exactly n for n >= 1)
        return w / (mask.sum(-1) + 1e-8).to(F64)
    return w  # seq-mean-token-sum; ESPO's native seq-mean-group-mean-token-mean


def _clip_pair(config: Any) -> tuple[float, float]:
    """verl's (clip_ratio_low, clip_ratio_high), each defaulting to clip_ratio."""
    ratio = _get(config, "clip_ratio", 0.2)
    return float(_get(config, "clip_ratio_low", ratio)), float(
        _get(config, "clip_ratio_high", ratio)
    )


def _check_weights(rw: torch.Tensor) -> None:
    # Folding rw into the advantages needs rw >= 0 (a negative weight would flip the clip).
    if bool((rw < 0).any()):
        raise ValueError("rollout_is_weights: expected non-negative weights, got a negative one")


def _metrics(m, mode: str, K: int, counts: torch.Tensor | None) -> dict[str, float]:
    """verl's metric names plus ours, from EspoMetrics, in one host transfer."""
    names = [
        "clip_frac",
        "ppo_kl",
        "dual_clip_frac",
        "ratio_mean",
        "ratio_max",
        "kl_k3",
        "log_ratio_gt_ln2_frac",
    ]
    vals = [m[k].reshape(1).to(F64) for k in names]
    per_group = ["group_token_frac", "clip_frac_low", "clip_frac_high", "group_entropy_mean"]
    vals += [m[k].reshape(-1).to(F64) for k in per_group]
    if counts is not None:  # tokens per (sequence, group) of non-empty groups: mean size per group
        nonempty = (counts > 0).sum(0).clamp(min=1)
        vals.append(counts.sum(0).to(F64) / nonempty)
    flat = torch.cat(vals).tolist()
    out = {
        "actor/pg_clipfrac": flat[0],
        "actor/ppo_kl": flat[1],
        "actor/pg_clipfrac_lower": flat[2] if mode != "gspo" else 0.0,
    }
    for i, k in enumerate(names[3:], start=3):
        out[f"actor/compass/{k}"] = flat[i]
    base = len(names)
    for j, k in enumerate(per_group):
        row = flat[base + j * K : base + (j + 1) * K]
        for g, v in enumerate(row):
            out[f"actor/compass/{k}/g{g}" if K > 1 else f"actor/compass/{k}"] = v
    if counts is not None:
        row = flat[base + len(per_group) * K :]
        for g, v in enumerate(row):
            out[f"actor/compass/group_size/g{g}" if K > 1 else "actor/compass/group_size"] = v
    return out


def _run(
    mode,
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    config,
    rollout_is_weights,
    old_entropy=None,
    espo: EspoOptions | None = None,
    entropy_threshold=None,
    vocab_size=None,
):
    probe.hit(f"loss_{mode}")
    extra = () if old_entropy is None else (("old_entropy", old_entropy),)
    _check_padded(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, extra)
    B, L = log_prob.shape
    dev = log_prob.device
    mask = response_mask.bool()
    R = F64 if log_prob.dtype == F64 else torch.float32
    native = mode == "espo" and loss_agg_mode == "seq-mean-token-mean"
    scale = _sequence_weights(mask, loss_agg_mode, config, native)[:, None].expand(B, L)
    cu = torch.arange(0, B * L + 1, max(L, 1), device=dev, dtype=torch.int64)[: B + 1]
    flat_mask = mask.reshape(-1)
    kwargs: dict[str, Any] = {}
    counts = None
    if mode == "espo":
        o = espo or ESPO_OPTIONS
        options = dict(
            mode="espo",
            rho=o.rho,
            alpha=o.alpha,
            clip=o.clip,
            vocab_size=vocab_size,
            num_groups=o.num_groups,
            quantiles=o.quantiles,
            drop_low=o.drop_low,
            ratio_form=o.ratio_form,
            dual_clip=o.dual_clip,
        )
        cfg = loss_config.resolve(**options)
        ent = old_entropy.detach().reshape(-1)
        K = cfg.num_groups
        if K > 1:
            if entropy_threshold is None:
                thr = ck.espo.entropy_thresholds(ent, cu, flat_mask, levels=cfg.levels)
            else:
                if entropy_threshold.shape[-1] != K - 1:
                    raise ValueError(
                        f"entropy_threshold: expected {K - 1} boundaries per row (num_groups - 1), "
                        f"got shape {list(entropy_threshold.shape)} (driver and workers must use "
                        "the same compass_espo options)"
                    )
                thr = entropy_threshold.detach().reshape(-1, K - 1)[0].to(F64)
            bucket = (ent.to(F64)[:, None] > thr[None, :]).sum(-1).view(B, L)
        else:
            thr, bucket = None, torch.zeros(B, L, dtype=torch.int64, device=dev)
        # tokens per (sequence, group): the group sizes (metrics; 1/w_t for non-native modes)
        counts = torch.zeros(B, K, dtype=torch.int64, device=dev)
        counts.scatter_add_(1, bucket, mask.to(torch.int64))
        if not native:
            in_loss = counts > 0
            if cfg.drop_low:
                in_loss[:, 0] = False
            k_i = in_loss.sum(-1, keepdim=True)
            scale = scale * (k_i * counts.gather(1, bucket)).to(F64)
        kwargs = dict(**options, entropy_threshold=thr, **o.extra)
    else:
        K = 1
        ent = torch.zeros(B * L, dtype=R, device=dev)  # fixed clip: entropy only feeds metrics
        scale = scale * mask.sum(-1, keepdim=True).to(F64)  # undo the kernel's 1/n_i
        kwargs = dict(mode=mode, clip=_clip_pair(config))
        if mode == "grpo":
            c = float(_get(config, "clip_ratio_c", 3.0))
            if not c > 1.0:
                raise ValueError(f"config.clip_ratio_c: expected > 1 (dual-clip PPO), got {c}")
            kwargs["dual_clip"] = c
    if rollout_is_weights is not None:
        rw = rollout_is_weights.detach().to(F64)
        _check_weights(rw)
        scale = scale * rw
    adv = (advantages.detach().to(F64) * scale).to(R).reshape(-1)
    loss, m = ck.espo.espo_loss(
        log_prob.reshape(-1),
        old_log_prob.reshape(-1),
        ent,
        adv,
        cu,
        flat_mask,
        num_sequences=1,
        advantages_per_token=True,
        **kwargs,
    )
    return loss, _metrics(m, mode, K, counts if mode != "grpo" else None)


# ------------------------------------------------------------ public losses


def compass_grpo_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``vanilla`` PPO/GRPO clipped loss (clip_ratio_low / _high, dual clip
    clip_ratio_c, ratio log clamped to [-20, 20]) by ``ck.espo`` (mode "grpo").

    Parameters
    ----------
    old_log_prob, log_prob, advantages : [B, L] float (log_prob carries the gradient).
    response_mask : [B, L] bool or 0/1, the tokens in the loss.
    loss_agg_mode : one of :data:`AGG_MODES`, normalised by ``config.global_batch_info``.
    config : verl's ActorConfig (or a mapping with its fields); None: clip 0.2, c = 3.
    rollout_is_weights : optional [B, L] float >= 0 multiplying each token's loss.

    Returns
    -------
    (loss 0-d float32 (float64 for float64 log_prob), metrics dict of floats)
    """
    return _run(
        "grpo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def compass_gspo_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``gspo`` loss (GSPO-token: sequence ratio, token gradient, log
    ratio clamped to <= 10, clip_ratio_low / _high) by ``ck.espo`` (mode
    "gspo"). Arguments and returns as :func:`compass_grpo_loss`."""
    return _run(
        "gspo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
    )


def _vocab_size(config: Any, given: int | None) -> int | None:
    if given is not None:
        return given
    model = _get(config, "model_config")
    hf = _get(model, "hf_config") if model is not None else None
    return getattr(hf, "vocab_size", None) if hf is not None else None


def espo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    old_entropy: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    vocab_size: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    options: EspoOptions | None = None,
    entropy_threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ESPO (arXiv 2512.00499) on verl's padded tensors: ``ck.espo.espo_loss`` on
    the valid tokens of each row.

    With ``loss_agg_mode="seq-mean-token-mean"`` (ESPO's own mean: sequences,
    entropy groups, tokens) and ``config=None`` it equals ``ck.espo.espo_loss``
    on the packed valid tokens with ``num_sequences`` = rows with a valid token;
    ``config.global_batch_info`` makes the denominators the global mini-batch's.
    Other modes weight each token as verl's ``agg_loss`` does (groups still set
    the ratio and the clip range).

    Parameters
    ----------
    old_log_prob, log_prob, advantages, old_entropy : [B, L] float; old_entropy is
        the old policy's full-distribution entropy per token (no gradient).
    response_mask : [B, L] bool or 0/1.
    vocab_size : |V| for the adaptive clip range (default: the config's model).
    rollout_is_weights : optional [B, L] float >= 0.
    options : :class:`EspoOptions` (default: the registered ``compass_espo``'s).
    entropy_threshold : [K-1] (or [B, K-1], equal rows) group boundaries of the
        global batch; default: the quantiles of this batch's valid tokens.

    Returns
    -------
    (loss 0-d tensor, metrics dict of floats)
    """
    return _run(
        "espo",
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        old_entropy=old_entropy,
        espo=options,
        entropy_threshold=entropy_threshold,
        vocab_size=_vocab_size(
            config, vocab_size if vocab_size is not None else (options or ESPO_OPTIONS).vocab_size
        ),
    )


def compass_espo_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """The registered ``compass_espo``: :func:`espo_policy_loss` with the old
    entropy (and the global batch's group boundaries) of the micro-batch set by
    :class:`old_entropy_context`, which the ppo_loss wrapper of
    ``compass_kernels.integration.verl.entropy`` opens. Without it: a clear error."""
    ctx = _OLD_ENTROPY.get()
    if ctx is None:
        raise RuntimeError(
            "compass_espo: no old-policy entropy for this micro-batch. Call "
            "compass_kernels.integration.verl.register(old_entropy=True) (it patches verl's "
            "old-log-prob pass and ppo_loss to carry it), or wrap the call in "
            "old_entropy_context(old_entropy)"
        )
    old_entropy, threshold = ctx
    return espo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        old_entropy,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
        entropy_threshold=threshold,
    )
