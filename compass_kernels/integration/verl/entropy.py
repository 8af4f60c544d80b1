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
import warnings
from typing import Any, cast

import torch

from . import _pin, probe

__all__ = ["OLD_ENTROPY_KEY", "THRESHOLD_KEY", "applied", "patch_old_entropy", "revert_old_entropy"]

OLD_ENTROPY_KEY = "compass_old_entropy"
THRESHOLD_KEY = "compass_entropy_threshold"

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}


def _levels() -> tuple[float, ...]:
    from compass_kernels.espo import loss_config

    from .losses import ESPO_OPTIONS as o

    cfg = loss_config.resolve(
        mode="espo",
        rho=o.rho,
        num_groups=o.num_groups,
        quantiles=o.quantiles,
        drop_low=o.drop_low,
        # the levels only: a placeholder clip spares the vocab check
        clip=o.clip if o.clip is not None else 0.2,
    )
    return cfg.levels


_LOW_PRECISION = ("bfloat16", "bf16", "float16", "fp16", "half")


def _node(config: Any, *keys: str) -> Any:
    """``config[k0][k1]...`` of a (partial) verl config; ``{}`` where a key is absent."""
    for key in keys:
        config = (config.get(key) if config is not None else None) or {}
    return config


def actor_dtype_option(config: Any) -> tuple[str, str] | None:
    """(option, value) of the actor's compute dtype in a verl trainer config, if it is a
    16-bit one (None otherwise): the dtype the old entropy is computed in."""
    actor = _node(config, "actor_rollout_ref", "actor")
    strategy = str(actor.get("strategy") or "fsdp")
    if strategy == "megatron":
        option = "actor_rollout_ref.actor.megatron.dtype"
        value = _node(actor, "megatron").get("dtype") or "bfloat16"
    else:  # verl's FSDP engine computes in mixed_precision.param_dtype (bf16 when unset)
        option = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
        value = _node(actor, "fsdp_config", "mixed_precision").get("param_dtype") or "bf16"
    return (option, str(value)) if str(value) in _LOW_PRECISION else None


def warn_low_precision_entropy(config: Any) -> bool:
    """Warn (True) when ``compass_espo`` runs on an old entropy computed in 16 bits: its
    entropy groups then fall on ties (bf16 puts ~0.93 / 0.07 of the tokens in the groups of
    rho = 0.2 instead of 0.80 / 0.20). The warning names the option that fixes it."""
    if str(_node(config, "actor_rollout_ref", "actor", "policy_loss").get("loss_mode")) != (
        "compass_espo"
    ):
        return False
    low = actor_dtype_option(config)
    if low is None:
        return False
    if low[0].endswith("megatron.dtype"):  # verl/workers/config/engine.py:218
        fix = (
            "verl's Megatron engine accepts only bfloat16 / float16; the FSDP engine with "
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32 computes "
            "it in float32"
        )
    else:
        fix = f"set {low[0]}=fp32 (and reduce_dtype / buffer_dtype fp32)"
    warnings.warn(
        f"compass_espo: the old entropy is computed in {low[1]} ({low[0]}), whose ties skew "
        f"ESPO's entropy groups; {fix}",
        stacklevel=2,
    )
    return True


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
        thr = ck.espo.entropy_thresholds(
            entropy.reshape(-1), cu, response_mask.bool().reshape(-1), levels=levels
        )
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
            if not getattr(self, "_compass_dtype_checked", False):
                self._compass_dtype_checked = True
                warn_low_precision_entropy(self.config)
            old_log_prob, mfu = orig_old(self, batch)
            probe.hit("old_entropy", str(old_log_prob.batch["entropys"].dtype))
            add_old_entropy(
                old_log_prob.batch, old_log_prob.batch["entropys"], batch.batch["response_mask"]
            )
            return old_log_prob, mfu

        def ppo_loss(config, model_output, data, dp_group=None):
            if OLD_ENTROPY_KEY not in data.keys():
                return orig_loss(config, model_output, data, dp_group)
            keys = [OLD_ENTROPY_KEY] + ([THRESHOLD_KEY] if THRESHOLD_KEY in data.keys() else [])
            padded = data.select(*keys).to_padded_tensor()
            threshold = padded[THRESHOLD_KEY] if THRESHOLD_KEY in keys else None
            probe.hit("old_entropy_loss")
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
