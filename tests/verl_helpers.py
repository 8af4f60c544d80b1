"""Shared pieces of the verl tests (tests/test_verl_*.py): the verl import
(a missing verl fails under COMPASS_REQUIRE_ALL_TIERS like any missing tier),
verl's ActorConfig, random padded batches, and a float64 ESPO oracle on
padded tensors aggregated by verl's own ``agg_loss``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Apex.*")
verl = pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/setup_env.sh)")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

F64 = torch.float64


def actor_config(**kw) -> ActorConfig:
    """verl's ActorConfig with the fields the losses read."""
    base = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False)
    base.update(kw)
    return ActorConfig(**base)


def padded_batch(g: torch.Generator, B: int, L: int, *, dtype=F64, spread=0.3, empty_row=True):
    """old_log_prob, log_prob (leaf), advantages (per sequence, broadcast), mask [B, L]
    (a random prefix of each row; one fully masked row), rollout weights > 0."""
    old = -torch.rand(B, L, generator=g, dtype=F64) * 3
    lp = old + torch.randn(B, L, generator=g, dtype=F64) * spread
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, L).contiguous()
    lens = torch.randint(1, L + 1, (B,), generator=g)
    if empty_row:
        lens[B // 2] = 0
    mask = torch.arange(L)[None, :] < lens[:, None]
    rw = torch.rand(B, L, generator=g, dtype=F64) * 1.5 + 0.1
    return old.to(dtype), lp.to(dtype), adv.to(dtype), mask, rw.to(dtype)


def espo_oracle(
    old, lp, adv, mask, ent, rw, loss_agg_mode, global_info, *, rho, alpha, vocab, thr=None
):
    """ESPO per token on [B, L] in float64 (loops, autograd through lp), then
    aggregated by verl's agg_loss; seq-mean-token-mean is ESPO's own mean."""
    B, L = lp.shape
    e = ent.double()
    valid = e[mask]
    if thr is None:
        thr = torch.quantile(valid, 1 - rho)
    f = torch.zeros(B, L, dtype=F64)
    w_native = torch.zeros(B, L, dtype=F64)
    for i in range(B):
        idx = mask[i].nonzero().flatten()
        if idx.numel() == 0:
            continue
        hi = e[i, idx] > thr
        groups = [idx[~hi], idx[hi]]
        groups = [gr for gr in groups if gr.numel()]
        for gr in groups:
            d = lp[i, gr] - old[i, gr].double()
            s = torch.exp(torch.clamp(d.detach().mean() + d, -20, 20))
            eps = alpha * float(e[i, gr].mean()) / math.log(vocab)
            a = adv[i, gr].double()
            val = torch.minimum(s * a, torch.clamp(s, 1 - eps, 1 + eps) * a)
            f = f.index_put((torch.full_like(gr, i), gr), val)
            w_native[i, gr] = 1.0 / (len(groups) * gr.numel())
    pg = -f * (rw.double() if rw is not None else 1.0)
    if loss_agg_mode == "seq-mean-token-mean":
        dp = global_info.get("dp_size", 1)
        gbs = global_info.get("global_batch_size") or float((mask.sum(-1) > 0).sum())
        return (pg * w_native).sum() / gbs * dp
    return core_algos.agg_loss(pg, mask, loss_agg_mode, **global_info)
