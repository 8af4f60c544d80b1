"""Options of ``ck.espo.espo_loss``, resolved once into a :class:`LossConfig`.

Shared by the public op (compass_kernels/espo/loss.py) and its reference
(reference_loss.py): both read the same resolved numbers, so a default can
never differ between the spec and the kernels. Pure Python, no tensors.

Modes (docs/design.md, "ESPO segmented loss"; exact by configuration):

- ``"espo"``: entropy groups inside each sequence (K=2 at the (1-rho) quantile
  of the old policy's entropy by default), group ratio s_g = exp(mean_g(l -
  l_old)), token ratio ``ratio_form="espo"`` (Eq. 9: sg[s_g] * r_t, the
  default) or ``"gspo_token"`` (value s_g, gradient through l_t), clip range
  per group eps_g = alpha * mean_g(entropy) / ln|V| unless ``clip`` fixes it.
  The log of the token ratio is clamped to [-20, 20] (as verl clamps PPO's log
  ratio), which only matters for runaway ratios.
- ``"gspo"``: one group per sequence, GSPO-token ratio, fixed eps (default
  (3e-4, 4e-4), the GSPO paper's), log ratio clamped to <= 10: verl's
  ``compute_policy_loss_gspo`` (seq-mean-token-mean).
- ``"grpo"``: one token per group (value r_t), fixed eps (default 0.2), log
  ratio clamped to [-20, 20], seq-mean-token-mean: verl's
  ``compute_policy_loss_vanilla`` with ``loss_agg_mode="seq-mean-token-mean"``;
  ``dual_clip=c`` is its dual-clip (clip_ratio_c) for negative advantages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from compass_kernels._validate import as_bool, as_float, as_float_tuple, as_int, is_scalar_like

MODES = ("espo", "gspo", "grpo")
RATIO_FORMS = ("espo", "gspo_token")
GROUPINGS = ("global", "sequence")
#: Most entropy groups per sequence (the kernels keep per-group counters in registers).
MAX_GROUPS = 8

# ratio-form codes shared with the kernels (reference_loss.py, triton_loss.py)
FORM_ESPO, FORM_GSPO_TOKEN = 0, 1


@dataclass(frozen=True)
class LossConfig:
    """Resolved options. ``levels``: quantile levels of the group boundaries
    (K - 1 of them); ``eps_low``/``eps_high`` None means adaptive per group."""

    mode: str
    ratio_form: str
    token_groups: bool  # grpo: every token its own group
    levels: tuple[float, ...]
    per_sequence: bool
    drop_low: bool
    eps_low: float | None
    eps_high: float | None
    alpha: float
    log_vocab: float  # ln|V| (nan when unused)
    dual_clip: float  # 0: off
    log_lo: float
    log_hi: float

    @property
    def num_groups(self) -> int:
        return len(self.levels) + 1

    @property
    def adaptive(self) -> bool:
        return self.eps_low is None

    @property
    def form_code(self) -> int:
        return FORM_ESPO if self.ratio_form == "espo" else FORM_GSPO_TOKEN


def _clip_pair(clip, default) -> tuple[float, float] | None:
    if clip is None:
        clip = default
    if clip is None:
        return None
    if isinstance(clip, int | float):
        clip = (float(clip), float(clip))
    if not (isinstance(clip, tuple | list) and len(clip) == 2):
        raise ValueError(f"clip: expected a float or a (low, high) pair, got {clip!r}")
    low, high = float(clip[0]), float(clip[1])
    if not (0.0 <= low < 1.0 and 0.0 <= high and math.isfinite(high)):
        raise ValueError(f"clip: expected 0 <= low < 1 and 0 <= high < inf, got ({low}, {high})")
    return low, high


def normalize(rho, alpha, clip, vocab_size, num_groups, quantiles, drop_low, dual_clip):
    """The numeric options as plain Python values (hashable: the config cache's key):
    NumPy / torch scalars and 0-d arrays -> int / float, a 1-d array or list ->
    a tuple (quantiles, a clip pair); bool refused for numbers, numbers for
    drop_low. Range checks are :func:`resolve`'s."""
    rho = as_float("rho", rho)
    alpha = as_float("alpha", alpha)
    if clip is not None:
        if is_scalar_like(clip):
            clip = as_float("clip", clip)
        else:
            try:
                pair = as_float_tuple("clip", clip)
            except TypeError:  # OptionTypeError: not a sequence at all
                pair = ()
            if len(pair) != 2:
                raise ValueError(f"clip: expected a float or a (low, high) pair, got {clip!r}")
            clip = pair
    if vocab_size is not None:
        vocab_size = as_int("vocab_size", vocab_size)
    if num_groups is not None:
        num_groups = as_int("num_groups", num_groups)
    if quantiles is not None:
        quantiles = as_float_tuple("quantiles", quantiles)
    if dual_clip is not None:
        dual_clip = as_float("dual_clip", dual_clip)
    return (
        rho,
        alpha,
        clip,
        vocab_size,
        num_groups,
        quantiles,
        as_bool("drop_low", drop_low),
        dual_clip,
    )


def resolve(
    *,
    mode: str = "espo",
    rho: float = 0.2,
    alpha: float = 0.02,
    clip=None,
    vocab_size: int | None = None,
    grouping: str = "global",
    num_groups: int | None = None,
    quantiles=None,
    drop_low: bool = False,
    ratio_form: str | None = None,
    dual_clip: float | None = None,
) -> LossConfig:
    """Validate the options of ``espo_loss`` and resolve the mode's defaults."""
    rho, alpha, clip, vocab_size, num_groups, quantiles, drop_low, dual_clip = normalize(
        rho, alpha, clip, vocab_size, num_groups, quantiles, drop_low, dual_clip
    )
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping: expected one of {GROUPINGS}, got {grouping!r}")
    if dual_clip is not None and not (dual_clip > 1.0 and math.isfinite(dual_clip)):
        raise ValueError(f"dual_clip: expected a finite value > 1 (clip_ratio_c), got {dual_clip}")
    dual = float(dual_clip) if dual_clip is not None else 0.0
    if mode != "espo":
        if ratio_form is not None or num_groups is not None or quantiles is not None or drop_low:
            raise ValueError(
                f"mode={mode!r} fixes the grouping and ratio form: ratio_form, num_groups, "
                "quantiles and drop_low apply to mode='espo' only"
            )
        pair = _clip_pair(clip, (3e-4, 4e-4) if mode == "gspo" else 0.2)
        assert pair is not None  # the default is a number
        grpo = mode == "grpo"
        return LossConfig(
            mode=mode,
            ratio_form="gspo_token",
            token_groups=grpo,
            levels=(),
            per_sequence=False,
            drop_low=False,
            eps_low=pair[0],
            eps_high=pair[1],
            alpha=float(alpha),
            log_vocab=math.nan,
            dual_clip=dual,
            log_lo=-20.0 if grpo else -math.inf,
            log_hi=20.0 if grpo else 10.0,
        )
    form = "espo" if ratio_form is None else ratio_form
    if form not in RATIO_FORMS:
        raise ValueError(f"ratio_form: expected one of {RATIO_FORMS}, got {ratio_form!r}")
    if quantiles is not None and num_groups is not None:
        raise ValueError("pass at most one of num_groups and quantiles")
    if quantiles is not None:
        levels = tuple(float(q) for q in quantiles)
        if (
            not levels
            or any(not 0.0 < q < 1.0 for q in levels)
            or list(levels) != sorted(set(levels))
        ):
            raise ValueError(
                f"quantiles: expected strictly increasing levels in (0, 1), got {quantiles!r}"
            )
    elif num_groups is not None:
        if not (isinstance(num_groups, int) and 1 <= num_groups <= MAX_GROUPS):
            raise ValueError(
                f"num_groups: expected an int in [1, {MAX_GROUPS}], got {num_groups!r}"
            )
        levels = tuple(k / num_groups for k in range(1, num_groups))
    else:
        if not 0.0 < rho < 1.0:
            raise ValueError(f"rho: expected a fraction in (0, 1), got {rho}")
        levels = (1.0 - float(rho),)
    if len(levels) + 1 > MAX_GROUPS:
        raise ValueError(f"quantiles: at most {MAX_GROUPS - 1} boundaries, got {len(levels)}")
    if drop_low and not levels:
        raise ValueError("drop_low: needs at least two groups")
    pair = _clip_pair(clip, None)
    if pair is None:
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha: expected a finite value > 0, got {alpha}")
        if not (isinstance(vocab_size, int) and vocab_size >= 2):
            raise ValueError(
                f"vocab_size: expected an int >= 2 (the clip range is alpha * entropy / "
                f"ln|V|), got {vocab_size!r}"
            )
    return LossConfig(
        mode="espo",
        ratio_form=form,
        token_groups=False,
        levels=levels,
        per_sequence=grouping == "sequence",
        drop_low=bool(drop_low),
        eps_low=None if pair is None else pair[0],
        eps_high=None if pair is None else pair[1],
        alpha=float(alpha),
        log_vocab=math.log(vocab_size) if pair is None else math.nan,
        dual_clip=dual,
        log_lo=-20.0,
        log_hi=20.0,
    )
