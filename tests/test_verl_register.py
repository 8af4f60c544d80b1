"""verl register() (issue 30): every option checked before any global state changes
(a bad call names the option and leaves the previous options, registries and patches
intact), NumPy-typed options normalised, and the pin check refusing another
plugin's patch of a pinned upstream function (``functools.wraps`` hashes as the
upstream source), naming it."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from compass_kernels.integration import verl as cv
from compass_kernels.integration.verl import _pin, losses
from compass_kernels.integration.verl import advantages as adv_mod
from tests.verl_helpers import core_algos


@pytest.fixture(autouse=True)
def _clean():
    espo0 = dataclasses.replace(losses.ESPO_OPTIONS)
    adv0 = dataclasses.replace(adv_mod.ADV_OPTIONS)
    cv.unregister()
    yield
    cv.unregister()
    for k, v in vars(espo0).items():
        setattr(losses.ESPO_OPTIONS, k, v)
    for k, v in vars(adv0).items():
        setattr(adv_mod.ADV_OPTIONS, k, v)


def _state():
    return (
        dataclasses.replace(losses.ESPO_OPTIONS),
        dataclasses.replace(adv_mod.ADV_OPTIONS),
        cv.registered(),
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"espo": {"rho": 1.5}}, "espo.rho: expected a fraction in"),
        ({"espo": {"num_groups": 12}}, r"espo.num_groups: expected an int in \[1, 8\]"),
        ({"espo": {"num_groups": True}}, "espo.num_groups: expected an int"),
        ({"espo": {"quantiles": (0.8, 0.2)}}, "espo.quantiles: expected strictly increasing"),
        ({"espo": {"clip": (0.5, -1.0)}}, "espo.clip: expected 0 <= low < 1"),
        ({"espo": {"alpha": float("nan")}}, "espo.alpha: expected a finite number"),
        ({"espo": {"ratio_form": "ppo"}}, "espo.ratio_form: expected one of"),
        ({"espo": {"dual_clip": 0.5}}, "espo.dual_clip: expected a finite value > 1"),
        ({"espo": {"vocab_size": 1}}, "espo.vocab_size: expected an int >= 2"),
        ({"espo": {"rh0": 0.2}}, r"espo: unknown option\(s\) \['rh0'\]"),
        ({"espo": {"extra": {"grouping": "tokens"}}}, "espo.grouping: expected one of"),
        ({"espo": {"extra": {"mode": "grpo"}}}, r"espo.extra: \['mode'\] are not espo_loss"),
        ({"advantages": {"mode": "ppo"}}, "advantages.mode: expected one of"),
        ({"advantages": {"alpha": -1.0}}, "advantages.alpha: expected a finite value >= 0"),
        ({"advantages": {"rl_zvp": 1}}, "advantages.rl_zvp: expected a bool"),
        ({"advantages": {"tol": 1}}, r"advantages: unknown option\(s\) \['tol'\]"),
        ({"old_entropy": "yes"}, "old_entropy: expected a bool"),
    ],
)
def test_bad_option_raises_naming_it_and_keeps_the_previous_state(kwargs, match):
    cv.register(espo={"rho": 0.3, "vocab_size": 500}, advantages={"alpha": 0.2})
    before = _state()
    with pytest.raises((ValueError, TypeError), match=match):
        cv.register(**kwargs)
    assert _state() == before  # options, registries: as the last good call left them
    assert losses.ESPO_OPTIONS.rho == 0.3 and adv_mod.ADV_OPTIONS.alpha == 0.2


def test_bad_first_call_registers_nothing():
    with pytest.raises(ValueError, match="espo.rho"):
        cv.register(espo={"rho": 0.0})
    assert not cv.registered()
    assert "compass_espo" not in core_algos.POLICY_LOSS_REGISTRY


def test_numpy_options_are_normalised_once():
    cv.register(
        espo={
            "quantiles": np.array([0.3, 0.7]),
            "clip": np.array([0.1, 0.2]),
            "vocab_size": np.int64(1000),
            "drop_low": np.bool_(True),
        },
        advantages={"alpha": np.float32(0.5), "rl_zvp": np.bool_(False)},
    )
    o = losses.ESPO_OPTIONS
    assert o.quantiles == (0.3, 0.7) and o.clip == (0.1, 0.2)
    assert type(o.vocab_size) is int and o.drop_low is True
    assert type(adv_mod.ADV_OPTIONS.alpha) is float and adv_mod.ADV_OPTIONS.rl_zvp is False


def test_wrapped_upstream_is_refused_naming_the_plugin(monkeypatch):
    """Another plugin's functools.wraps patch of a pinned function hashes as upstream
    (inspect follows __wrapped__); the pin check finds it and names it."""
    original = core_algos.compute_policy_loss_vanilla

    @functools.wraps(original)
    def other_plugins_patch(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(core_algos, "compute_policy_loss_vanilla", other_plugins_patch)
    assert (
        _pin.upstream_source_sha256("losses")[
            "verl.trainer.ppo.core_algos:compute_policy_loss_vanilla"
        ]
        == _pin.UPSTREAM_SOURCE_SHA256["0.9.1"][
            "verl.trainer.ppo.core_algos:compute_policy_loss_vanilla"
        ]
    )  # the source pin alone cannot see it
    with pytest.raises(
        cv.VerlVersionError,
        match="patched by another plugin "
        r"\(other_plugins_patch at .*test_verl_register.py",
    ):
        cv.register()
    assert not cv.registered()


def test_wrapped_layer_below_is_found_too(monkeypatch):
    """A patch two layers down (a wraps chain whose top looks like verl's own code)."""
    original = core_algos.agg_loss

    @functools.wraps(original)
    def inner(*a, **k):
        return original(*a, **k)

    top = functools.partial(inner)  # no __code__: only the __wrapped__ chain finds inner
    top.__wrapped__ = inner
    monkeypatch.setattr(core_algos, "agg_loss", top)
    assert "inner at" in _pin.foreign_patch("verl.trainer.ppo.core_algos:agg_loss")


def test_own_patches_are_not_foreign():
    cv.register(old_entropy=True, balancing=True)
    for piece in ("entropy", "balancing", "losses", "advantages"):
        for name in _pin.PINNED[piece]:
            assert _pin.foreign_patch(name) is None, name
    cv.register(old_entropy=True, balancing=True)  # idempotent over our own patches
