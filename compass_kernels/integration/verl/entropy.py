"""The old policy's entropy, from verl's old-log-prob pass to ``compass_espo``.

verl 0.9's ``RayPPOTrainer._compute_old_log_prob`` always asks the actor for
the entropy (``calculate_entropy=True``), logs its mean as ``actor/entropy``
and drops it (``old_log_prob.batch.pop("entropys")`` in ``fit``). The policy
loss never sees it: verl's loss signature has no entropy argument and its
``ppo_loss`` selects only the fields it knows. :func:`patch_old_entropy`
(pinned, idempotent, reversible) wraps two functions:

1. driver: ``RayPPOTrainer._compute_old_log_prob`` also returns the same
   entropy tensor under :data:`OLD_ENTROPY_KEY` (``fit`` pops only
   "entropys"), so it joins the batch and travels with it, split like
   ``old_log_probs`` into mini- and micro-batches; with ``compass_espo``'s
   entropy groups (K > 1) it adds the group boundaries over the whole batch's
   valid tokens ([B, K-1] float64, :data:`THRESHOLD_KEY`), so every
   micro-batch groups tokens as the global batch does (data-parallel and
   micro-batch invariant). It also hands the entropy to the ``compass_grpo``
   estimator for RL-ZVP.
2. workers: ``verl.workers.utils.losses.ppo_loss`` (and the name
   ``verl.workers.engine_workers`` imported) opens
   ``losses.old_entropy_context`` with the micro-batch's rows of those fields
   around the original, which then calls ``compass_espo`` as any loss.

Cost: no extra forward (verl computes the entropy anyway); the batch carries
one more [B, L_response] float32 tensor (4 bytes per response position,
B*(K-1)*8 bytes of thresholds), sent to the actor workers with the rest of
the update batch and held until the update ends; one quantile (a sort of
the valid tokens' entropy) per step on the driver.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

from . import _pin

__all__ = ["OLD_ENTROPY_KEY", "THRESHOLD_KEY", "applied", "patch_old_entropy", "revert_old_entropy"]

OLD_ENTROPY_KEY = "compass_old_entropy"
THRESHOLD_KEY = "compass_entropy_threshold"

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}


def _levels() -> tuple[float, ...]:
    from compass_kernels.espo import loss_config

    from .losses import ESPO_OPTIONS as o

    cfg = loss_config.resolve(mode="espo", rho=o.rho, num_groups=o.num_groups,
                              quantiles=o.quantiles, drop_low=o.drop_low,
                              # the levels only: a placeholder clip spares the vocab check
                              clip=o.clip if o.clip is not None else 0.2)  # fmt: skip
    return cfg.levels


def add_old_entropy(batch: Any, entropy: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Put the entropy (and the global group boundaries) into ``batch`` (a
    DataProto's ``.batch`` TensorDict or a dict) under our keys."""
    import compass_kernels as ck

    from .advantages import set_old_entropy

    B, L = entropy.shape
    batch[OLD_ENTROPY_KEY] = entropy
    levels = _levels()
    if levels:
        cu = torch.arange(0, B * L + 1, max(L, 1), device=entropy.device)[: B + 1]
        thr = ck.espo.entropy_thresholds(entropy.reshape(-1), cu, response_mask.bool().reshape(-1),
                                         levels=levels)  # fmt: skip
        batch[THRESHOLD_KEY] = thr.reshape(1, -1).expand(B, -1).contiguous()
    set_old_entropy(entropy, response_mask)


def patch_old_entropy() -> bool:
    """Apply both wrappers (idempotent); True if this call applied them.

    Raises
    ------
    VerlVersionError
        If verl is not the reviewed version or a wrapped function changed.
    """
    _pin.check("entropy")
    import verl.workers.engine_workers as engine_workers
    from verl.trainer.ppo import ray_trainer
    from verl.workers.utils import losses as verl_losses

    from .losses import old_entropy_context

    with _LOCK:
        if _ORIGINAL:
            return False
        orig_old = ray_trainer.RayPPOTrainer._compute_old_log_prob
        orig_loss = verl_losses.ppo_loss

        def _compute_old_log_prob(self, batch):
            old_log_prob, mfu = orig_old(self, batch)
            add_old_entropy(old_log_prob.batch, old_log_prob.batch["entropys"],
                            batch.batch["response_mask"])  # fmt: skip
            return old_log_prob, mfu

        def ppo_loss(config, model_output, data, dp_group=None):
            if OLD_ENTROPY_KEY not in data.keys():
                return orig_loss(config, model_output, data, dp_group)
            keys = [OLD_ENTROPY_KEY] + ([THRESHOLD_KEY] if THRESHOLD_KEY in data.keys() else [])
            padded = data.select(*keys).to_padded_tensor()
            threshold = padded[THRESHOLD_KEY] if THRESHOLD_KEY in keys else None
            with old_entropy_context(padded[OLD_ENTROPY_KEY], threshold):
                return orig_loss(config, model_output, data, dp_group)

        cast(Any, _compute_old_log_prob).__wrapped_by_compass__ = orig_old
        cast(Any, ppo_loss).__wrapped_by_compass__ = orig_loss
        _ORIGINAL.update(old=orig_old, loss=orig_loss)
        ray_trainer.RayPPOTrainer._compute_old_log_prob = _compute_old_log_prob  # type: ignore[method-assign]  # the patch (reverted below)
        verl_losses.ppo_loss = ppo_loss
        if engine_workers.ppo_loss is orig_loss:
            engine_workers.ppo_loss = ppo_loss
        return True


def revert_old_entropy() -> bool:
    """Undo :func:`patch_old_entropy`; True if it was applied."""
    with _LOCK:
        if not _ORIGINAL:
            return False
        import verl.workers.engine_workers as engine_workers
        from verl.trainer.ppo import ray_trainer
        from verl.workers.utils import losses as verl_losses

        patched = verl_losses.ppo_loss
        ray_trainer.RayPPOTrainer._compute_old_log_prob = _ORIGINAL["old"]  # type: ignore[method-assign]  # the revert
        verl_losses.ppo_loss = _ORIGINAL["loss"]
        if engine_workers.ppo_loss is patched:
            engine_workers.ppo_loss = _ORIGINAL["loss"]
        _ORIGINAL.clear()
        return True


def applied() -> bool:
    """Whether :func:`patch_old_entropy` is in place."""
    return bool(_ORIGINAL)
