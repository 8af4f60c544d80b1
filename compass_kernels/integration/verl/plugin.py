"""Import hook for verl: ``VERL_USE_EXTERNAL_MODULES=compass_kernels.integration.verl.plugin``.

verl imports the modules named in that variable whenever ``verl`` itself is
imported, in the driver and in every Ray worker (set it in the environment
the job's processes inherit, or in ``ray_kwargs.ray_init.runtime_env.env_vars``),
so this runs :func:`compass_kernels.integration.verl.register` everywhere,
configured by the environment (errors raise: a job never runs half-registered):

- ``COMPASS_VERL_PATCHES``: comma list of ``old_entropy`` (needed by
  ``compass_espo`` and RL-ZVP), ``balancing``, ``replay`` (Megatron
  workers); default none.
- ``COMPASS_VERL_ESPO``: ``compass_espo`` options, ``key=value`` comma list
  (rho, alpha, clip, vocab_size, num_groups, drop_low, ratio_form, dual_clip).
- ``COMPASS_VERL_ADV``: estimator options (mode, rl_zvp, alpha, zero_var_tol).
"""

from __future__ import annotations

import os

from compass_kernels.integration.verl import EspoOptions, register

__all__ = ["parse_options"]

_PATCHES = ("old_entropy", "balancing", "replay")


def _value(text: str):
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if t.lower() == "none":
        return None
    if ":" in t:  # a (low, high) pair, e.g. clip=0.2:0.28
        return tuple(float(x) for x in t.split(":"))
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    return t


def parse_options(text: str, variable: str) -> dict:
    """``"a=1,b=x"`` -> {"a": 1, "b": "x"}; a malformed item raises naming ``variable``."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{variable}: expected key=value items, got {item!r}")
        out[key.strip()] = _value(val)
    return out


def _activate() -> None:
    patches = [
        p.strip() for p in os.environ.get("COMPASS_VERL_PATCHES", "").split(",") if p.strip()
    ]
    bad = [p for p in patches if p not in _PATCHES]
    if bad:
        raise ValueError(f"COMPASS_VERL_PATCHES: unknown {bad}, expected some of {_PATCHES}")
    espo = parse_options(os.environ.get("COMPASS_VERL_ESPO", ""), "COMPASS_VERL_ESPO")
    adv = parse_options(os.environ.get("COMPASS_VERL_ADV", ""), "COMPASS_VERL_ADV")
    register(
        old_entropy="old_entropy" in patches,
        balancing="balancing" in patches,
        replay="replay" in patches,
        espo=EspoOptions(**espo) if espo else None,
        advantages=adv or None,
    )


_activate()
