"""The ``compass_grpo`` advantage estimator for verl's ``ADV_ESTIMATOR_REGISTRY``.

verl calls a registered estimator (``algorithm.adv_estimator=compass_grpo``) as
``fn(token_level_rewards=[B, L], response_mask=[B, L], config=AlgoConfig,
index=uids)`` and stores ``(advantages, returns)``, both [B, L]. Here: the
outcome reward of each response (the sum of its token rewards, as verl's
``grpo``), ``ck.advantages.group_advantages`` over the uid groups (GRPO, or
Dr.GRPO when ``algorithm.norm_adv_by_std_in_grpo=False``, or RLOO), broadcast
over the response tokens; optionally RL-ZVP (``ck.advantages.rl_zvp``) token
advantages for groups still zero-variance, from the old policy's entropy that
:mod:`.entropy`'s patch keeps from verl's old-log-prob pass.

Where verl's ``grpo`` and this differ, on purpose: a zero-variance group (all
rewards equal, std <= 1e-6 in float64) and a group of one get exactly 0
(verl: (r - mean) / (std + eps), which is (r / (1 + eps)) for a group of one
and rounding noise / 1e-6 for equal float rewards). Everywhere else they are
equal (the contract test).

verl keeps no metrics from an estimator: the zero-variance mask and counts of
the last call are in :func:`last_stats` for a trainer that logs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import compass_kernels as ck

from . import probe

__all__ = ["ADV_OPTIONS", "AdvOptions", "compute_compass_grpo_advantage", "configure", "last_stats"]


@dataclass
class AdvOptions:
    """mode: "grpo" | "dr_grpo" | "rloo" ("grpo" turns into "dr_grpo" when verl's
    ``algorithm.norm_adv_by_std_in_grpo`` is False); rl_zvp: RL-ZVP token
    advantages for zero-variance groups (needs the old entropy, see
    :mod:`.entropy`); alpha: RL-ZVP's scale; zero_var_tol: a group is
    zero-variance when its std <= this."""

    mode: str = "grpo"
    rl_zvp: bool = False
    alpha: float = 0.1
    zero_var_tol: float = 1e-6


ADV_OPTIONS = AdvOptions()
_LAST: dict[str, Any] = {}
# (old entropy [B, L], response_mask [B, L]) of the batch of the last old-log-prob pass
_ENTROPY: dict[str, torch.Tensor] = {}


def configure(**options: Any) -> None:
    """Set :data:`ADV_OPTIONS` fields (unknown names raise)."""
    for k, v in options.items():
        if not hasattr(ADV_OPTIONS, k):
            raise ValueError(f"advantages option {k!r}: expected one of {list(vars(ADV_OPTIONS))}")
        setattr(ADV_OPTIONS, k, v)
    if ADV_OPTIONS.mode not in ck.advantages.MODES:
        raise ValueError(
            f"mode: expected one of {tuple(ck.advantages.MODES)}, got {ADV_OPTIONS.mode!r}"
        )


def last_stats() -> dict[str, Any]:
    """Of the last call: ``zero_var`` [B] bool (responses of zero-variance groups),
    ``compass/adv/zero_var_frac`` (of groups), ``compass/adv/num_groups``,
    ``compass/adv/num_zero_var_groups``, ``compass/adv/rl_zvp_tokens``."""
    return dict(_LAST)


def set_old_entropy(entropy: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Keep the old policy's entropy of the batch whose advantages come next (the
    entropy patch calls this from verl's old-log-prob pass)."""
    _ENTROPY["entropy"], _ENTROPY["mask"] = entropy, response_mask


def _group_ids(index: Any, n: int, device: torch.device) -> torch.Tensor:
    arr = np.asarray(index, dtype=object) if not isinstance(index, np.ndarray) else index
    if arr.shape != (n,):
        raise ValueError(f"index: expected {n} uids (one per response), got shape {arr.shape}")
    _, inverse = np.unique(arr.astype(str), return_inverse=True)
    return torch.from_numpy(inverse.astype(np.int64)).to(device)


def compute_compass_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator signature: group advantages by ``ck.advantages``.

    Parameters
    ----------
    token_level_rewards : [B, L] float; a response's reward is its row sum.
    response_mask : [B, L] bool or 0/1.
    index : [B] group ids (verl's uids: one per prompt).
    epsilon : added to the group std (GRPO).
    norm_adv_by_std_in_grpo : False: Dr.GRPO (default: ``config``'s, else True).
    config : verl's AlgoConfig (``norm_adv_by_std_in_grpo``).

    Returns
    -------
    (advantages, returns): [B, L] float32, equal (verl's grpo returns both).
    """
    probe.hit("advantage")
    if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"token_level_rewards, response_mask: expected two [B, L] tensors of one shape, got "
            f"{list(token_level_rewards.shape)} and {list(response_mask.shape)}"
        )
    B, L = token_level_rewards.shape
    dev = token_level_rewards.device
    if norm_adv_by_std_in_grpo is None:
        get = getattr(config, "get", None)
        norm_adv_by_std_in_grpo = True if get is None else get("norm_adv_by_std_in_grpo", True)
    mode = ADV_OPTIONS.mode
    if mode == "grpo" and not norm_adv_by_std_in_grpo:
        mode = "dr_grpo"
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid = _group_ids(index, B, dev)
        adv, zero_var, stats = ck.advantages.group_advantages(
            scores, gid, mode=mode, eps=float(epsilon), zero_var_tol=ADV_OPTIONS.zero_var_tol
        )
        mask = response_mask.bool()
        out = adv.to(torch.float32)[:, None] * mask
        zvp_tokens = 0
        if ADV_OPTIONS.rl_zvp:
            out, zvp_tokens = _rl_zvp(out, scores, zero_var, adv, mask)
    _LAST.clear()
    _LAST.update(
        {
            "zero_var": zero_var,
            "compass/adv/num_groups": stats.num_groups,
            "compass/adv/num_zero_var_groups": int(stats.num_zero_var),
            "compass/adv/zero_var_frac": float(stats.zero_var_fraction),
            "compass/adv/rl_zvp_tokens": zvp_tokens,
        }
    )
    return out, out


def _rl_zvp(out, scores, zero_var, adv, mask):
    ent, ent_mask = _ENTROPY.get("entropy"), _ENTROPY.get("mask")
    if ent is None or ent.shape != mask.shape or not torch.equal(ent_mask.bool(), mask):
        raise RuntimeError(
            "compass_grpo with rl_zvp: no old-policy entropy for this batch (apply "
            "compass_kernels.integration.verl.register(old_entropy=True): it keeps the entropy "
            "of verl's old-log-prob pass), or it belongs to another batch (response_mask differs)"
        )
    n = mask.sum(-1)
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(n, 0, out=cu[1:])
    packed = ent.to(mask.device)[mask]  # valid tokens, row after row
    token_adv = ck.advantages.rl_zvp(
        packed, cu, scores, zero_var, alpha=ADV_OPTIONS.alpha, advantages=adv
    )
    out = torch.zeros_like(out)
    out[mask] = token_adv.to(out.dtype)
    return out, int(n[zero_var].sum())
