"""Bench: the ESPO segmented policy loss (``ck.espo.espo_loss``), forward + backward.

What is timed: from per-token log-probs (requiring grad), old log-probs, old
entropy, per-sequence advantages and cu_seqlens to the loss and d loss /
d logprobs (``loss.backward()``), on a packed batch of RL responses
(lognormal lengths, 256 sequences, 64k tokens; quick: 32 / 4k).

Baselines (the ``speedup`` column is against the first):

- ``torch (packed)``: the strongest simple implementation on packed tokens,
  vectorized torch with autograd, float32 like the frameworks: per-token
  sequence ids (``repeat_interleave``), the (1 - rho) entropy quantile
  (``torch.quantile``), segment sums per (sequence, group) with ``index_add_``,
  gathers back, the clipped objective and the three-level mean; written here
  from the math (no framework has ESPO).
- ``torch (padded, verl-style)``: the same loss on [B, L] padded tensors as
  verl's ``core_algos`` writes its losses (masked sums along the sequence
  dim); its inputs are padded once outside the timing (as verl holds them).
  For mode="grpo" / "gspo" it is verl's ``compute_policy_loss_vanilla`` (with
  ``loss_agg_mode="seq-mean-token-mean"``) / ``compute_policy_loss_gspo``
  formulas.
- ``compass``: the public API (default backend, validation as by default).

The ``overhead`` case times one tiny call (8 sequences, 256 tokens) through
each layer: the two raw torch kernels with prepared arguments (the floor), the
public API without gradient, and with forward + backward.

GPU: the H100 model column counts the bytes the fused path must move (see
``_model``): a lower bound, never a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from bench.harness import Case
from bench.roofline import Model

OP = "espo_loss"
SHAPES = ((256, 65536),)  # (sequences, tokens)
QUICK_SHAPES = ((32, 4096),)
RHO, ALPHA, VOCAB = 0.2, 0.02, 151936
# float32 providers vs each other: per-token gradients are ~1/(G |g|) ~ 1e-5
ATOL, RTOL = 1e-9, 1e-4


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(sequences: int, tokens: int, device: str, seed: int = 0):
    """Packed RL batch: lognormal lengths scaled to ``tokens`` in total."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.empty(sequences).log_normal_(0.0, 1.0, generator=g)
    lengths = (raw / raw.sum() * tokens).floor().long().clamp(min=1)
    lengths[-1] += tokens - int(lengths.sum())
    cu = torch.zeros(sequences + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    old = -torch.empty(tokens).exponential_(1.0, generator=g)
    lp = old + 0.1 * torch.randn(tokens, generator=g)
    ent = torch.empty(tokens).exponential_(0.5, generator=g)
    adv = torch.randn(sequences, generator=g)
    return tuple(t.to(device) for t in (lp, old, ent, adv, cu))


# ------------------------------------------------------------------ baselines


def espo_torch_packed(lp, old, ent, adv, cu, *, mode="espo", clip=0.2):
    """ESPO (Eq. 9 ratio, adaptive eps) / GRPO / GSPO on packed tokens, vectorized torch."""
    T, n = lp.shape[0], cu.shape[0] - 1
    seq = torch.repeat_interleave(torch.arange(n, device=lp.device), cu.diff(), output_size=T)
    d = lp - old
    if mode == "grpo":
        ratio = torch.exp(torch.clamp(d, -20.0, 20.0))
        a = adv[seq]
        f = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
        cnt = torch.zeros(n, device=lp.device).index_add_(0, seq, torch.ones_like(d))
        return -(f / cnt[seq]).sum() / n
    K = 2 if mode == "espo" else 1
    if K == 2:
        thr = torch.quantile(ent.double(), 1.0 - RHO).float()
        gid = seq * 2 + (ent > thr).long()
    else:
        gid = seq
    z = torch.zeros(n * K, device=lp.device)
    cnt = z.index_add(0, gid, torch.ones_like(d))
    mean_d = z.index_add(0, gid, d.detach()) / cnt.clamp(min=1)
    if mode == "espo":
        eps = (ALPHA / math.log(VOCAB)) * z.index_add(0, gid, ent) / cnt.clamp(min=1)
        low = high = eps[gid]
        ratio = torch.exp(torch.clamp(mean_d[gid] + d, -20.0, 20.0))
    else:  # gspo-token
        low, high = 3e-4, 4e-4
        ratio = torch.exp(torch.clamp(mean_d[gid] + lp - lp.detach(), max=10.0))
    a = adv[seq]
    f = torch.minimum(ratio * a, torch.clamp(ratio, 1 - low, 1 + high) * a)
    groups = (cnt.view(n, K) > 0).sum(1).to(lp.dtype)
    return -(f / (groups[seq] * cnt[gid])).sum() / n


def pad(lp, old, ent, adv, cu):
    n = cu.shape[0] - 1
    lengths = cu.diff()
    L = int(lengths.max())
    pos = torch.arange(L, device=lp.device)
    mask = pos[None, :] < lengths[:, None]
    idx = (cu[:-1, None] + pos[None, :]).clamp(max=lp.shape[0] - 1)
    return idx, mask, adv[:, None].expand(n, L)


def espo_torch_padded(lp, old, ent, idx, mask, adv, *, mode="espo", clip=0.2):
    """The same loss on [B, L] padded tensors (verl's core_algos style)."""
    log_prob, old_log_prob, entropy = lp[idx], old[idx], ent[idx]
    m = mask.to(log_prob.dtype)
    d = log_prob - old_log_prob
    if mode == "grpo":  # verl compute_policy_loss_vanilla + seq-mean-token-mean
        ratio = torch.exp(torch.clamp(d, min=-20.0, max=20.0))
        pg1 = -adv * ratio
        pg2 = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
        pg = torch.maximum(pg1, pg2)
        return ((pg * m).sum(-1) / m.sum(-1)).mean()
    if mode == "gspo":  # verl compute_policy_loss_gspo
        kl_seq = (d * m).sum(-1) / m.sum(-1).clamp(min=1)
        ratio = torch.exp(
            torch.clamp(log_prob - log_prob.detach() + kl_seq.detach()[:, None], max=10.0)
        )
        pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - 3e-4, 1 + 4e-4))
        return ((pg * m).sum(-1) / m.sum(-1)).mean()
    thr = torch.quantile(entropy[mask].double(), 1.0 - RHO).float()
    high = (entropy > thr) & mask
    total = torch.zeros_like(m)
    groups = torch.zeros(m.shape[0], device=m.device)
    for gm in (mask & ~high, high):
        g = gm.to(m.dtype)
        cnt = g.sum(-1, keepdim=True)
        mean_d = (d.detach() * g).sum(-1, keepdim=True) / cnt.clamp(min=1)
        eps = (ALPHA / math.log(VOCAB)) * (entropy * g).sum(-1, keepdim=True) / cnt.clamp(min=1)
        ratio = torch.exp(torch.clamp(mean_d + d, -20.0, 20.0))
        f = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
        total = total + f * g / cnt.clamp(min=1)
        groups = groups + (cnt[:, 0] > 0).to(m.dtype)
    return -(total.sum(-1) / groups.clamp(min=1)).sum() / m.shape[0]


def _fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], lp: torch.Tensor):
    def call():
        x = lp.detach().requires_grad_()
        loss = fn(x)
        loss.backward()
        return loss.detach(), x.grad

    return call


def _model(tokens: int, sequences: int) -> Model:
    """Fused path on a GPU, float32 tokens: thresholds (a radix sort of
    float64 keys: ~4 passes over 8 B read + 8 B written), group sums (read
    e, l, l_old: 12 B), forward (read l, l_old, e: 12 B, write grad: 4 B),
    backward (read 4, write 4), per-sequence rows; 7 kernels."""
    per_token = 64 + 12 + 16 + 8
    return Model(bytes=per_token * tokens + 200 * sequences, kernels=7)


def loss_case(mode: str, sequences: int, tokens: int, device: str) -> Case:
    lp, old, ent, adv, cu = make_batch(sequences, tokens, device, seed=sequences)
    idx, mask, adv_p = pad(lp, old, ent, adv, cu)
    from compass_kernels.espo import espo_loss

    kw: dict[str, Any] = {"mode": mode}
    if mode == "espo":
        kw |= {"rho": RHO, "alpha": ALPHA, "vocab_size": VOCAB}
    elif mode == "grpo":
        kw["clip"] = 0.2
    return Case(
        name=f"espo_loss[{mode}]",
        shape={"seqs": sequences, "tokens": tokens},
        providers={
            "torch (packed)": _fwd_bwd(
                lambda x: espo_torch_packed(x, old, ent, adv, cu, mode=mode), lp
            ),
            "torch (padded, verl-style)": _fwd_bwd(
                lambda x: espo_torch_padded(x, old, ent, idx, mask, adv_p, mode=mode), lp
            ),
            "compass": _fwd_bwd(lambda x: espo_loss(x, old, ent, adv, cu, **kw)[0], lp),
        },
        baseline="torch (packed)",
        device=device,
        atol=ATOL,
        rtol=RTOL,
        model=_model(tokens, sequences),
    )


def overhead_case() -> Case:
    """Host overhead of one tiny call, layer by layer (CPU)."""
    from compass_kernels.espo import espo_loss
    from compass_kernels.espo.loss import (
        ADAPTIVE_EPS,
        entropy_thresholds,
        espo_group_sums_op,
        espo_loss_forward_op,
    )

    lp, old, ent, adv, cu = make_batch(8, 256, "cpu", seed=3)
    thr = entropy_thresholds(ent, cu, levels=(1 - RHO,))
    scale = ALPHA / math.log(VOCAB)
    sums_k = espo_group_sums_op.kernel("torch")
    fwd_k = espo_loss_forward_op.kernel("torch")
    sums_args = dict(
        entropy=ent,
        logprobs=lp,
        old_logprobs=old,
        cu_seqlens=cu,
        mask=None,
        thresholds=thr,
        num_groups=2,
        flags=ADAPTIVE_EPS,
    )
    sums = espo_group_sums_op.outputs(**sums_args)
    args = dict(
        logprobs=lp,
        old_logprobs=old,
        entropy=ent,
        advantages=adv,
        cu_seqlens=cu,
        mask=None,
        thresholds=thr,
        sums=sums,
        num_groups=2,
        flags=ADAPTIVE_EPS,
        eps_low=0.0,
        eps_high=0.0,
        eps_scale=scale,
        dual_clip=0.0,
        log_lo=-20.0,
        log_hi=20.0,
        inv_num_seqs=1.0 / 8,
        need_grad=True,
    )
    outs = espo_loss_forward_op.outputs(**args)._asdict()

    def raw():
        sums_k(**sums_args, out=sums)
        fwd_k(**args, **outs)
        return outs["loss"].double()

    kw = {"rho": RHO, "alpha": ALPHA, "vocab_size": VOCAB}

    def api_no_grad():
        with torch.no_grad():
            return espo_loss(lp, old, ent, adv, cu, **kw)[0].double()

    def api_fwd_bwd():
        x = lp.detach().requires_grad_()
        loss = espo_loss(x, old, ent, adv, cu, **kw)[0]
        loss.backward()
        return loss.detach().double()

    return Case(
        name="overhead",
        shape={"seqs": 8, "tokens": 256},
        providers={
            "kernels (raw bindings)": raw,
            "api (no grad)": api_no_grad,
            "api (fwd+bwd)": api_fwd_bwd,
        },
        baseline="kernels (raw bindings)",
        device="cpu",
        atol=1e-7,
        rtol=1e-6,
    )


def cases(quick: bool) -> list[Case]:
    device = _device()
    shapes = QUICK_SHAPES if quick else SHAPES
    out = [overhead_case()]
    for mode in ("espo", "grpo", "gspo"):
        out += [loss_case(mode, s, t, device) for s, t in shapes]
    return out
