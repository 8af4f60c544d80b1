"""compass_kernels as a drop-in for verl (>= 0.9, reviewed against 0.9.1).

One call per process (the driver and every Ray worker: verl imports the
modules named in ``VERL_USE_EXTERNAL_MODULES`` wherever it is imported, so
``VERL_USE_EXTERNAL_MODULES=compass_kernels.integration.verl.plugin`` does it
everywhere)::

    from compass_kernels.integration import verl as ck_verl
    ck_verl.register()   # losses + advantage estimator (registries only, no patch)
    ck_verl.register(old_entropy=True, balancing=True)   # + the two reversible patches

Pieces (docs/design.md, "verl"; examples/verl/ for the config overrides):

- :mod:`.losses`: ``compass_grpo`` / ``compass_gspo`` / ``compass_espo`` in
  verl's ``POLICY_LOSS_REGISTRY`` (verl's signature, padded [B, L] tensors,
  every ``loss_agg_mode``, ``rollout_is_weights``), computed by ``ck.espo``;
  :func:`espo_policy_loss` for direct use.
- :mod:`.advantages`: estimator ``compass_grpo`` in ``ADV_ESTIMATOR_REGISTRY``
  (GRPO / Dr.GRPO / RLOO by ``ck.advantages``, zero-variance groups, RL-ZVP).
- :mod:`.entropy`: carries the old policy's entropy from verl's old-log-prob
  pass to ``compass_espo`` (a pinned, reversible patch).
- :mod:`.balancing`: verl's ``get_seqlen_balanced_partitions`` and
  ``rearrange_micro_batches`` by ``ck.packing.plan``; patch / revert.
- :mod:`.replay`: verl's ``routed_experts`` -> validated ``RoutingTrace`` and
  our Megatron replay per micro-batch.

Importing this package never imports verl; every entry point checks the
installed verl (:mod:`._pin`) and fails loudly on a version it was not
reviewed against.
"""

from __future__ import annotations

import threading

from . import _pin
from ._pin import VerlVersionError
from .losses import (
    AGG_MODES,
    ESPO_OPTIONS,
    EspoOptions,
    compass_espo_loss,
    compass_grpo_loss,
    compass_gspo_loss,
    espo_policy_loss,
    old_entropy_context,
)

__all__ = [
    "AGG_MODES",
    "ESPO_OPTIONS",
    "EspoOptions",
    "LOSS_NAMES",
    "ADVANTAGE_NAME",
    "VerlVersionError",
    "compass_espo_loss",
    "compass_grpo_loss",
    "compass_gspo_loss",
    "espo_policy_loss",
    "old_entropy_context",
    "register",
    "registered",
    "unregister",
]

#: the names ``register`` puts into verl's POLICY_LOSS_REGISTRY
LOSS_NAMES = {
    "compass_grpo": compass_grpo_loss,
    "compass_gspo": compass_gspo_loss,
    "compass_espo": compass_espo_loss,
}
#: the name of the advantage estimator in verl's ADV_ESTIMATOR_REGISTRY
ADVANTAGE_NAME = "compass_grpo"

_LOCK = threading.Lock()


def register(
    *,
    old_entropy: bool = False,
    balancing: bool = False,
    replay: bool = False,
    espo: EspoOptions | dict | None = None,
    advantages: dict | None = None,
) -> None:
    """Put compass's losses and advantage estimator into verl's registries.

    Idempotent: a second call re-registers the same functions (and applies the
    patches asked for, themselves idempotent). A name verl already holds for
    another function raises (never silently replaced).

    Parameters
    ----------
    old_entropy : also apply :func:`.entropy.patch_old_entropy` (needed by
        ``compass_espo`` inside verl's trainer; driver and workers).
    balancing : also apply :func:`.balancing.patch_seqlen_balancing`.
    replay : also apply :func:`.replay.patch_megatron_engine` (Megatron workers).
    espo : options of ``compass_espo`` (:class:`EspoOptions` or its fields).
    advantages : options of the ``compass_grpo`` estimator
        (:data:`.advantages.ADV_OPTIONS` fields: mode, rl_zvp, alpha, ...).

    Raises
    ------
    VerlVersionError
        verl missing, older than 0.9, not reviewed, or a pinned function changed.
    """
    _pin.check("losses")
    _pin.check("advantages")
    from verl.trainer.ppo import core_algos

    from . import advantages as adv_mod
    from . import losses

    with _LOCK:
        if espo is not None:
            opts = espo if isinstance(espo, EspoOptions) else EspoOptions(**espo)
            for k, v in vars(opts).items():
                setattr(losses.ESPO_OPTIONS, k, v)
        if advantages is not None:
            adv_mod.configure(**advantages)
        table = core_algos.POLICY_LOSS_REGISTRY
        for name, fn in LOSS_NAMES.items():
            held = table.get(name)
            if held is not None and held is not fn:
                raise ValueError(f"verl's POLICY_LOSS_REGISTRY already holds {name!r}: {held}")
        est = core_algos.ADV_ESTIMATOR_REGISTRY.get(ADVANTAGE_NAME)
        if est is not None and est is not adv_mod.compute_compass_grpo_advantage:
            raise ValueError(
                f"verl's ADV_ESTIMATOR_REGISTRY already holds {ADVANTAGE_NAME!r}: {est}"
            )
        for name, fn in LOSS_NAMES.items():
            core_algos.register_policy_loss(name)(fn)
        core_algos.register_adv_est(ADVANTAGE_NAME)(adv_mod.compute_compass_grpo_advantage)
    if old_entropy:
        from .entropy import patch_old_entropy

        patch_old_entropy()
    if balancing:
        from .balancing import patch_seqlen_balancing

        patch_seqlen_balancing()
    if replay:
        from .replay import patch_megatron_engine

        patch_megatron_engine()


def registered() -> bool:
    """Whether every compass name is in verl's registries (imports verl)."""
    from verl.trainer.ppo import core_algos

    from .advantages import compute_compass_grpo_advantage

    return all(core_algos.POLICY_LOSS_REGISTRY.get(n) is f for n, f in LOSS_NAMES.items()) and (
        core_algos.ADV_ESTIMATOR_REGISTRY.get(ADVANTAGE_NAME) is compute_compass_grpo_advantage
    )


def unregister() -> None:
    """Remove compass's names from verl's registries and revert every patch."""
    from verl.trainer.ppo import core_algos

    from .balancing import revert_seqlen_balancing
    from .entropy import revert_old_entropy

    with _LOCK:
        for name, fn in LOSS_NAMES.items():
            if core_algos.POLICY_LOSS_REGISTRY.get(name) is fn:
                del core_algos.POLICY_LOSS_REGISTRY[name]
        from .advantages import compute_compass_grpo_advantage

        if core_algos.ADV_ESTIMATOR_REGISTRY.get(ADVANTAGE_NAME) is compute_compass_grpo_advantage:
            del core_algos.ADV_ESTIMATOR_REGISTRY[ADVANTAGE_NAME]
    revert_old_entropy()
    revert_seqlen_balancing()
    import sys

    if "compass_kernels.integration.verl.replay" in sys.modules:
        sys.modules["compass_kernels.integration.verl.replay"].revert_megatron_engine()
