"""ESPO fused loss and its building blocks (ck.espo).

Token log-probs and entropy (from logits or fused with the lm_head) live in
``logprobs.py``; the entropy-grouped policy loss in its own module.
"""

from compass_kernels.espo.logprobs import (
    fused_linear_logprobs_entropy,
    token_logprobs_entropy,
)

__all__ = ["token_logprobs_entropy", "fused_linear_logprobs_entropy"]
