"""Reference (the executable spec) of ck.espo's token log-probs and entropy.

Plain torch in float64, written for clarity; the ops' CPU backend (float32,
vectorised, ``*_torch``) is at the end.
docs/design.md (ESPO): temperature T scales the logits first; l_t = log softmax(z_t
/ T)[y_t]; e_t = -sum_v p_v log p_v over the full vocabulary, with 0 log 0 = 0
(a -inf logit is a masked token with p = 0). Gradients come from autograd in
float64.
"""

from __future__ import annotations

import torch

#: A target equal to this is a masked token (Hugging Face's / torch's ignore_index).
IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "token_logprobs_entropy_reference",
    "fused_linear_logprobs_entropy_reference",
    "token_logprobs_entropy_torch",
    "token_logprobs_entropy_bwd_torch",
    "logprobs_tile_stats_torch",
]


def token_logprobs_entropy_reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy of each row, in float64.

    Parameters
    ----------
    logits : [T, V] float (any dtype; computed in float64, differentiable).
    targets : [T] integer token ids in [0, V), or IGNORE_INDEX (-100): log-prob 0,
        no gradient (any other id outside [0, V) gives NaN).
    temperature : float > 0.

    Returns
    -------
    logp : [T] float64, log p(targets[t]) under softmax(logits[t] / temperature).
    entropy : [T] float64, -sum_v p_v log p_v (terms with p_v = 0 count 0).
    """
    x = logits.to(torch.float64) / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    y = targets.to(torch.int64)
    ok = (y >= 0) & (y < x.shape[-1])
    logp = logp_all.gather(-1, torch.where(ok, y, 0)[:, None]).squeeze(-1)
    # IGNORE_INDEX: 0 (no gradient); any other target outside [0, V): NaN
    masked = torch.where(y == IGNORE_INDEX, 0.0, float("nan")).to(logp.dtype)
    logp = torch.where(ok, logp, masked)
    p = logp_all.exp()
    # where(): 0 * -inf would be NaN for masked (-inf) logits; 0 log 0 = 0.
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp, entropy


def fused_linear_logprobs_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from hidden states [T, H] and the lm_head weight [V, H]: logits = hidden @ weight.T,
    in float64 (differentiable in both)."""
    logits = hidden.to(torch.float64) @ weight.to(torch.float64).T
    return token_logprobs_entropy_reference(logits, targets, temperature)


# ---------------------------------------------------------------------------
# The torch backend of the log-prob ops (CPU tensors): vectorised over a block
# of rows at a time, float32, the Triton kernels' state and formulas. With raw
# logits z, inv_t = 1 / temperature, m = max z (raw units) and d_j = (z_j - m)
# * inv_t clamped at -200 (a masked -inf logit gives exp = 0 and d * exp = 0):
# s = sum exp(d_j), a = sum exp(d_j) d_j (<= 0); lse = m * inv_t + log s,
# H = log s - a / s (relative to the max: no cancellation for logits of any
# sign), log p_y = (z_y - m) * inv_t - log s (z_y - m exact near the max).
# Calling convention of every backend: the op's arguments, then its outputs,
# written in place.

_MIN_EXP = -200.0
_ROWS_ELEMS = 1 << 22  # float32 temporaries per block of rows (16 MiB)


def _row_blocks(rows: int, vocab: int):
    step = max(1, _ROWS_ELEMS // max(vocab, 1))
    for r0 in range(0, rows, step):
        yield slice(r0, min(rows, r0 + step))


def _stats(x, m, inv_t: float, with_entropy: bool):
    """(m, s, a) of rows x [R, V] float32 merged into a state whose max is m [R]
    (-inf: nothing yet); returns the new max and the tile's (s, a) relative to it."""
    m_new = torch.maximum(m, x.amax(dim=1)) if x.shape[1] else m
    m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
    d = ((x - m_safe[:, None]) * inv_t).clamp_(min=_MIN_EXP)
    e = torch.exp(d)
    s = e.sum(dim=1)
    a = (e * d).sum(dim=1) if with_entropy else torch.zeros_like(s)
    return m_new, m_safe, s, a


def token_logprobs_entropy_torch(
    *, logits, targets, temperature, with_entropy, logp, entropy, row_max, log_norm
) -> None:
    """``token_logprobs_entropy`` op: logp, entropy (NaN unless with_entropy),
    row_max (m, raw units) and log_norm (log s) [T] float32, lse = m / T + log s.
    A target of IGNORE_INDEX gives log-prob 0; any other target outside [0, V)
    gives NaN (the public function rejects it on CPU unless validate=False)."""
    t, v = logits.shape
    inv_t = 1.0 / temperature
    for r in _row_blocks(t, v):
        x = logits[r].to(torch.float32)
        m0 = torch.full((x.shape[0],), float("-inf"))
        m, m_safe, s, a = _stats(x, m0, inv_t, with_entropy)
        log_s = torch.log(s)
        y = targets[r]
        ok = (y >= 0) & (y < v)
        xt = x.gather(1, torch.where(ok, y, 0)[:, None])[:, 0] if v else torch.zeros_like(s)
        lp = ((xt - m) * inv_t - log_s).clamp(max=0.0)
        lp = torch.where(ok, lp, torch.where(y == IGNORE_INDEX, 0.0, float("nan")))
        row_max[r] = m
        log_norm[r] = log_s
        logp[r] = lp
        entropy[r] = (log_s - a / s).clamp(min=0.0) if with_entropy else float("nan")


def logprobs_tile_stats_torch(
    *, logits, targets, vocab_start, temperature, with_entropy, state_in, state_out
) -> None:
    """``logprobs_tile_stats`` op: fold the vocab tile ``logits`` [T, V_tile]
    (vocab ids vocab_start ..) into the online state ``state_in`` [4, T] float32
    = (m, s, a, target logit: kept where the target is not in this tile),
    written to ``state_out`` (which may be ``state_in``: the fused path updates
    in place)."""
    t, v = logits.shape
    inv_t = 1.0 / temperature
    for r in _row_blocks(t, v):
        x = logits[r].to(torch.float32)
        m_in, s_in, a_in, xt = state_in[:, r]
        m, m_safe, s, a = _stats(x, m_in, inv_t, with_entropy)
        d = ((m_in - m_safe) * inv_t).clamp(min=_MIN_EXP)  # the state moves to the new max
        c = torch.exp(d)
        y = targets[r] - vocab_start
        mine = (y >= 0) & (y < v)
        if v:
            xt = torch.where(mine, x.gather(1, torch.where(mine, y, 0)[:, None])[:, 0], xt)
        new = torch.stack([m, c * s_in + s, c * (a_in + s_in * d) + a, xt])
        state_out[:, r] = new  # after every read: state_out may be state_in (in place)


def token_logprobs_entropy_bwd_torch(
    *,
    logits,
    targets,
    row_max,
    log_norm,
    entropy,
    grad_logprob,
    grad_entropy,
    temperature,
    vocab_start,
    grad_logits,
) -> None:
    """``token_logprobs_entropy_bwd`` op: grad_logits [T, V] (logits' dtype) of
    g_l log p_y + g_h H: -p_j (g_l + g_h (log p_j + H)) / T off the target, the
    target's g_l (1 - p_y) written as -g_l expm1(log p_y) (exact for p_y near 1).
    Float32 throughout, rounded once at the store; IGNORE_INDEX targets get no
    log-prob gradient; vocab_start offsets the targets (a vocab shard)."""
    t, v = logits.shape
    inv_t = 1.0 / temperature
    for r in _row_blocks(t, v):
        x = logits[r].to(torch.float32)
        y_raw = targets[r]
        n = x.shape[0]
        gl = grad_logprob[r] if grad_logprob is not None else torch.zeros(n)
        gl = torch.where(y_raw == IGNORE_INDEX, 0.0, gl)
        gh = grad_entropy[r] if grad_entropy is not None else torch.zeros(n)
        h = entropy[r] if grad_entropy is not None else torch.zeros(n)
        d = ((x - row_max[r, None]) * inv_t - log_norm[r, None]).clamp_(min=_MIN_EXP)
        p = torch.exp(d)
        g = -p * (gl[:, None] + gh[:, None] * (d + h[:, None]))
        y = y_raw - vocab_start
        hit = ((y >= 0) & (y < v)).nonzero()[:, 0]
        if hit.numel():
            yy = y[hit]
            dy, py = d[hit, yy], p[hit, yy]
            g[hit, yy] = -gl[hit] * torch.expm1(dy) - py * gh[hit] * (dy + h[hit])
        grad_logits[r] = g * inv_t
