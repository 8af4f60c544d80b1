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

from compass_kernels._validate import as_bool, as_float

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

    Every option and every pin is checked before anything global changes: a bad
    call raises (naming the option) and leaves the previous options, registries
    and patches as they were.

    Raises
    ------
    VerlVersionError
        verl missing, older than 0.9, not reviewed, a pinned function changed, or
        patched by another plugin (named).
    ValueError / TypeError
        an invalid option, named (``espo.rho``, ``advantages.mode``, ...).
    """
    given = (("old_entropy", old_entropy), ("balancing", balancing), ("replay", replay))
    flags = {n: as_bool(n, v) for n, v in given}
    new_espo = None if espo is None else _checked_espo(espo)
    new_adv = None if advantages is None else _checked_advantages(advantages)
    for piece in (
        "losses",
        "advantages",
        *(
            p
            for p in ("entropy", "balancing", "replay")
            if flags["old_entropy" if p == "entropy" else p]
        ),
    ):
        _pin.check(piece)
    from verl.trainer.ppo import core_algos

    from . import advantages as adv_mod
    from . import losses

    with _LOCK:
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
        if new_espo is not None:  # every check above passed: now the global state
            for k, v in vars(new_espo).items():
                setattr(losses.ESPO_OPTIONS, k, v)
        if new_adv is not None:
            for k, v in vars(new_adv).items():
                setattr(adv_mod.ADV_OPTIONS, k, v)
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


def _checked_espo(espo: EspoOptions | dict) -> EspoOptions:
    """``register(espo=)`` resolved and normalised (NumPy values -> Python) into a new
    EspoOptions, or ValueError / TypeError naming the option; nothing global touched."""
    import dataclasses
    import inspect

    import compass_kernels as ck
    from compass_kernels.espo import loss_config

    if isinstance(espo, EspoOptions):
        given = {f.name: getattr(espo, f.name) for f in dataclasses.fields(EspoOptions)}
    elif isinstance(espo, dict):
        given = dict(espo)
    else:
        raise TypeError(f"espo: expected EspoOptions or a dict, got {type(espo).__name__}")
    fields = [f.name for f in dataclasses.fields(EspoOptions)]
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ValueError(f"espo: unknown option(s) {unknown} (expected some of {fields})")
    o = EspoOptions(**given)
    extra = o.extra if isinstance(o.extra, dict) else {}
    try:
        rho, alpha, clip, vocab, ng, q, drop, dual = loss_config.normalize(
            o.rho,
            o.alpha,
            o.clip,
            o.vocab_size,
            o.num_groups,
            o.quantiles,
            o.drop_low,
            o.dual_clip,
        )
        # vocab_size None: read from the model's config at the loss; 2 stands in here
        loss_config.resolve(
            mode="espo",
            rho=rho,
            alpha=alpha,
            clip=clip,
            vocab_size=2 if vocab is None else vocab,
            num_groups=ng,
            quantiles=q,
            drop_low=drop,
            ratio_form=o.ratio_form,
            dual_clip=dual,
            grouping=extra.get("grouping", "global"),
        )
    except (ValueError, TypeError) as err:
        raise type(err)(f"espo.{err}") from None
    if not isinstance(o.extra, dict):
        raise TypeError(f"espo.extra: expected a dict, got {type(o.extra).__name__}")
    params = inspect.signature(ck.espo.espo_loss).parameters
    fixed = {"mode", "entropy_threshold", "num_sequences", "advantages_per_token"}  # the loss's
    allowed = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - set(fields) - fixed
    bad = sorted(set(o.extra) - allowed)
    if bad:
        raise ValueError(
            f"espo.extra: {bad} are not espo_loss options here (allowed: {sorted(allowed)})"
        )
    return EspoOptions(
        rho=rho,
        alpha=alpha,
        clip=clip,
        vocab_size=vocab,
        num_groups=ng,
        quantiles=q,
        drop_low=drop,
        ratio_form=o.ratio_form,
        dual_clip=dual,
        extra=dict(o.extra),
    )


def _checked_advantages(advantages: dict):
    """``register(advantages=)`` checked into a new AdvOptions (nothing global touched)."""
    import dataclasses

    import compass_kernels as ck

    from .advantages import ADV_OPTIONS, AdvOptions

    if not isinstance(advantages, dict):
        raise TypeError(f"advantages: expected a dict, got {type(advantages).__name__}")
    fields = [f.name for f in dataclasses.fields(AdvOptions)]
    unknown = sorted(set(advantages) - set(fields))
    if unknown:
        raise ValueError(f"advantages: unknown option(s) {unknown} (expected some of {fields})")
    o = dataclasses.replace(ADV_OPTIONS, **advantages)
    if o.mode not in ck.advantages.MODES:
        raise ValueError(
            f"advantages.mode: expected one of {tuple(ck.advantages.MODES)}, got {o.mode!r}"
        )
    o.rl_zvp = as_bool("advantages.rl_zvp", o.rl_zvp)
    for name in ("alpha", "zero_var_tol"):
        v = as_float(f"advantages.{name}", getattr(o, name))
        if v < 0:
            raise ValueError(f"advantages.{name}: expected a finite value >= 0, got {v}")
        setattr(o, name, v)
    return o


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
