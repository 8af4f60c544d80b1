"""Reference (the executable spec) of ck.espo's token log-probs and entropy.

Plain torch in float64, written for clarity, never imported by a fast path.
DESIGN.md (ESPO): temperature T scales the logits first; l_t = log softmax(z_t
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
