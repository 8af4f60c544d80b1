"""The verl versions this adapter was written against, and the upstream
functions it relies on, pinned by source fingerprint (as the Megatron patches
pin megatron-core, ``compass_kernels/integration/megatron/_pin.py``).

A verl older than :data:`MIN_VERSION`, a version without an entry in
:data:`UPSTREAM_SOURCE_SHA256`, or any pinned function whose source changed is
refused with :class:`VerlVersionError` naming it: the adapter claims equality
with these functions (losses, advantages), calls them (balancing), or wraps
them (the old-entropy patch). After reviewing a new verl, pin
:func:`upstream_source_sha256`'s output here. Imports verl only when a check runs.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from compass_kernels.integration.megatron._pin import source_sha256

__all__ = [
    "MIN_VERSION",
    "UPSTREAM_SOURCE_SHA256",
    "VerlVersionError",
    "check",
    "foreign_patch",
    "upstream_source_sha256",
    "verl_version",
]

#: oldest verl with the registries, ``global_batch_info`` and ``rollout_is_weights`` used here
MIN_VERSION = (0, 9)


class VerlVersionError(RuntimeError):
    """verl is missing, too old, not reviewed, or a pinned upstream function changed."""


#: what each piece relies on: "module:qualname"
PINNED: dict[str, tuple[str, ...]] = {
    "losses": (
        "verl.trainer.ppo.core_algos:agg_loss",
        "verl.trainer.ppo.core_algos:compute_policy_loss_vanilla",
        "verl.trainer.ppo.core_algos:compute_policy_loss_gspo",
        "verl.trainer.ppo.core_algos:register_policy_loss",
        "verl.workers.utils.losses:ppo_loss",
    ),
    "advantages": (
        "verl.trainer.ppo.core_algos:compute_grpo_outcome_advantage",
        "verl.trainer.ppo.core_algos:register_adv_est",
        "verl.trainer.ppo.ray_trainer:compute_advantage",
    ),
    "balancing": (
        "verl.utils.seqlen_balancing:get_seqlen_balanced_partitions",
        "verl.utils.seqlen_balancing:karmarkar_karp",
        "verl.utils.seqlen_balancing:rearrange_micro_batches",
        "verl.workers.engine.utils:prepare_micro_batches",
    ),
    "entropy": (
        "verl.trainer.ppo.ray_trainer:RayPPOTrainer._compute_old_log_prob",
        "verl.workers.utils.losses:ppo_loss",
    ),
    "replay": (
        "verl.utils.megatron.router_replay_utils:align_r3_router_replay_data",
        "verl.workers.engine.megatron.transformer_impl:MegatronEngine.forward_step",
        "verl.workers.utils.padding:left_right_2_no_padding",
    ),
}

#: verl version -> {"module:qualname": sha256 of its normalized source}
UPSTREAM_SOURCE_SHA256: dict[str, dict[str, str]] = {
    "0.9.1": {},  # filled below from _PINS_0_9_1 (kept apart for a readable diff)
}


def verl_version() -> str:
    """The installed verl's version; raises :class:`VerlVersionError` without verl."""
    try:
        import verl
    except ImportError as e:
        raise VerlVersionError(
            "compass_kernels.integration.verl needs verl >= 0.9 (pip install verl==0.9.1 "
            "--no-deps; scripts/setup_env.sh installs the `verl` extra's list)"
        ) from e
    return str(getattr(verl, "__version__", "unknown"))


def _parse(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


#: "module:qualname" -> the upstream object a patch of ours replaced (checked in its stead)
ORIGINALS: dict[str, Any] = {}


def resolve(name: str) -> Any:
    """The upstream object named ``"module:qualname"`` (the original where we patched it)."""
    if name in ORIGINALS:
        return ORIGINALS[name]
    module, qual = name.split(":")
    obj: Any = importlib.import_module(module)
    for attr in qual.split("."):
        obj = getattr(obj, attr)
    return getattr(obj, "__wrapped_by_compass__", obj)


def foreign_patch(name: str) -> str | None:
    """Where another plugin's patch of ``"module:qualname"`` lives, or None.

    The pin hashes source, and ``inspect.getsource`` follows ``__wrapped__``: a
    ``functools.wraps`` patch by another plugin hashes as the upstream function.
    So the object verl holds (the original we keep where we patched it) and every
    ``__wrapped__`` layer below it must be code from verl's own package; anything
    else (a wrapper, or a replacement that is not the pinned function) is named."""
    import verl

    if name in ORIGINALS:
        obj = ORIGINALS[name]
    else:
        module, qual = name.split(":")
        obj = importlib.import_module(module)
        for attr in qual.split("."):
            obj = getattr(obj, attr)
        obj = getattr(obj, "__wrapped_by_compass__", obj)
    root = os.path.dirname(os.path.abspath(verl.__file__)) + os.sep
    seen: set[int] = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        fn = getattr(obj, "__func__", obj)  # bound / class methods
        code = getattr(fn, "__code__", None)
        if code is not None and not os.path.abspath(code.co_filename).startswith(root):
            return f"{code.co_name} at {code.co_filename}:{code.co_firstlineno}"
        obj = getattr(obj, "__wrapped__", None)
    return None


def upstream_source_sha256(piece: str | None = None) -> dict[str, str]:
    """{"module:qualname": sha256} of the installed verl's pinned functions
    (of one piece, or all), unwrapped where our patches wrapped them."""
    names = PINNED[piece] if piece else sorted({n for v in PINNED.values() for n in v})
    return {n: source_sha256(resolve(n)) for n in names}


def check(piece: str) -> str:
    """Refuse a verl this piece was not reviewed against; returns its version.

    Raises
    ------
    VerlVersionError
        verl missing or older than 0.9, a version without pins, a pinned
        function of ``piece`` whose source changed, or one another plugin
        wrapped or replaced (:func:`foreign_patch`; named).
    """
    version = verl_version()
    if _parse(version)[:2] < MIN_VERSION:
        raise VerlVersionError(
            f"compass_kernels.integration.verl needs verl >= 0.9, found {version}"
        )
    pins = UPSTREAM_SOURCE_SHA256.get(version)
    if not pins:
        raise VerlVersionError(
            f"verl {version} was not reviewed for compass_kernels.integration.verl (reviewed: "
            f"{sorted(UPSTREAM_SOURCE_SHA256)}); review the {piece} adapter against it, then pin "
            "_pin.upstream_source_sha256()'s output in _pin.UPSTREAM_SOURCE_SHA256"
        )
    changed = [n for n, sha in upstream_source_sha256(piece).items() if pins.get(n) != sha]
    if changed:
        where = [f"{n} is {o}" for n in changed if (o := foreign_patch(n)) is not None]
        raise VerlVersionError(
            f"verl {version}: upstream {', '.join(changed)} changed (source sha256 differs from "
            f"the pin); the compass {piece} adapter relies on it: review before use"
            + (f" (not verl's own code: {'; '.join(where)})" if where else "")
        )
    # Same source is not enough: inspect follows __wrapped__, so a functools.wraps
    # patch by another plugin hashes as the upstream function it wraps.
    for n in PINNED[piece]:
        other = foreign_patch(n)
        if other is not None:
            raise VerlVersionError(
                f"verl {version}: upstream {n} is patched by another plugin ({other}); the "
                f"compass {piece} adapter will not replace or build on another plugin's patch "
                "(remove that plugin's patch, or do not enable both)"
            )
    return version


_PINS_0_9_1: dict[str, str] = {
    "verl.trainer.ppo.core_algos:agg_loss": (
        "1d27453038bb7848e57ba3708d3e9958e1a6390b7075690221cbd1db0df7db4a"
    ),
    "verl.trainer.ppo.core_algos:compute_grpo_outcome_advantage": (
        "33ac9296ef15e2666578b18a5ff0765ff80d1fbea0d9ca5150a42c7a9acbdad6"
    ),
    "verl.trainer.ppo.core_algos:compute_policy_loss_gspo": (
        "cee338c670a780a5e4de80ada79bca2846dac6db41edbf772c9a388733ced376"
    ),
    "verl.trainer.ppo.core_algos:compute_policy_loss_vanilla": (
        "133f12573585daec6fcf6d72d8cd512f213adfc79b97a8dcd538382f94123a35"
    ),
    "verl.trainer.ppo.core_algos:register_adv_est": (
        "3bee795548693dff9a44c6bf05973e58f0f502f647c226ff69da47044037d6b8"
    ),
    "verl.trainer.ppo.core_algos:register_policy_loss": (
        "6e0488d73208cb15b14c2a677f1dd536c4d414d21424f5ca435bdbd0a8f3e756"
    ),
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._compute_old_log_prob": (
        "e9963f74e22f57673ab5a15e732ff65365a28ee3428ea5764517b31db83c8fff"
    ),
    "verl.trainer.ppo.ray_trainer:compute_advantage": (
        "1d89c189aa9e6c94c926c34f76c809d8bff235afa7743a72e48b66843903fff0"
    ),
    "verl.utils.megatron.router_replay_utils:align_r3_router_replay_data": (
        "7f50b12dd2153ffdbbde0e6086a5400ba1179fa6100980a0d246177567b5920f"
    ),
    "verl.utils.seqlen_balancing:get_seqlen_balanced_partitions": (
        "48364abfcde9db3163e563edb16a0d4a27e7adacae7848421f8cd55e0aaea169"
    ),
    "verl.utils.seqlen_balancing:karmarkar_karp": (
        "8b816e583abbd03992459ba0a9a9b7d43c1b1b7540f8d36091a44097ea5b51c5"
    ),
    "verl.utils.seqlen_balancing:rearrange_micro_batches": (
        "03e1db554dc22855a76c228ef1c47a6c5b151b64a753fe9f4ae5035ae41c24e5"
    ),
    "verl.workers.engine.utils:prepare_micro_batches": (
        "801cfa4ab4317815b3e68a329a499a73685037d54c8f21ebf7607682a2e2ace6"
    ),
    "verl.workers.engine.megatron.transformer_impl:MegatronEngine.forward_step": (
        "49eec34ca9c9b342d4dd9aada53a870cb2d5e0c3d4e62f9179ad1d5d3425f325"
    ),
    "verl.workers.utils.losses:ppo_loss": (
        "2ceca5ede4148d8128349e63bfe212767ccd8a8747f7811140f1efb35e40e7b7"
    ),
    "verl.workers.utils.padding:left_right_2_no_padding": (
        "22a29de002db0b37f7e79cc3006ee6a692755e29de8aaf262b5392420fec8da5"
    ),
}
UPSTREAM_SOURCE_SHA256["0.9.1"] = _PINS_0_9_1
