"""The packing planner: sequences -> data-parallel ranks -> micro-batches.

Everything per sequence runs in C++ (csrc/packing/plan_cpu.cpp: padding,
cost, order, LPT with exchange refinement to the lower bound and a
Karmarkar-Karp seed where it is missed, capped LPT or level-fit micro-batches
with first fit where neither fits, and where the balanced ranks leave no plan,
item moves and a feasibility search); this module checks the scalar
arguments, picks the cost coefficients, and wraps the result in a
:class:`Plan` (tensors and statistics built on first access).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from compass_kernels._ext import load
from compass_kernels._validate import INT_DTYPES, as_int, describe

__all__ = ["ModelConfig", "Plan", "cost_coefficients", "plan", "sequence_cost"]


@dataclass(frozen=True)
class ModelConfig:
    """What the attention cost model needs of a transformer (Megatron names).

    ffn_hidden_size is the FFN width one token goes through per expert (MoE:
    the expert's width, ``moe_ffn_hidden_size``); moe_top_k = 0 for a dense
    FFN. num_query_groups (GQA key/value heads) defaults to the attention
    heads; kv_channels (head dim) to hidden_size / heads.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    moe_top_k: int = 0
    num_query_groups: int | None = None
    kv_channels: int | None = None
    shared_expert_ffn_hidden_size: int = 0
    gated_linear_unit: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {v!r}")
        if not (isinstance(self.moe_top_k, int) and self.moe_top_k >= 0):
            raise ValueError(f"ModelConfig.moe_top_k: expected an int >= 0, got {self.moe_top_k!r}")

    @classmethod
    def from_hf(cls, config) -> ModelConfig:
        """From a Hugging Face config (Qwen3-MoE / DeepSeek / Llama field names)."""
        get = lambda *names, default=None: next(  # noqa: E731
            (getattr(config, n) for n in names if getattr(config, n, None) is not None), default
        )
        top_k = get("num_experts_per_tok", "moe_topk", default=0) or 0
        ffn = get("moe_intermediate_size", default=None) if top_k else None
        return cls(
            hidden_size=get("hidden_size"),
            ffn_hidden_size=ffn or get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            moe_top_k=int(top_k),
            num_query_groups=get("num_key_value_heads"),
            kv_channels=get("head_dim"),
            shared_expert_ffn_hidden_size=get("shared_expert_intermediate_size", default=0) or 0,
        )


def cost_coefficients(config: ModelConfig) -> tuple[float, float]:
    """(a, b) with forward FLOPs of one sequence of L tokens = a*L + b*L^2.

    Per layer and token, a counts the projections (Q and O: 2*h*heads*d each;
    K and V: 2*h*groups*d each) and the FFN (gated: 3 matrices of h x ffn, 2
    FLOPs per multiply-add, times top-k experts, plus a shared expert). b counts
    causal attention: QK^T and PV over L^2 / 2 pairs, 2*heads*d FLOPs each.
    Backward is ~2x forward for both terms, so the ratio a/b, which is all the
    balancing uses, is the same for training.
    """
    h, heads = config.hidden_size, config.num_attention_heads
    d = config.kv_channels or h // heads
    groups = config.num_query_groups or heads
    mats = 3 if config.gated_linear_unit else 2
    experts = max(config.moe_top_k, 1)
    proj = 2 * h * heads * d * 2 + 2 * h * groups * d * 2
    ffn = 2 * mats * h * (config.ffn_hidden_size * experts + config.shared_expert_ffn_hidden_size)
    a = float(config.num_layers * (proj + ffn))
    b = float(config.num_layers * 2 * heads * d)
    return a, b


def sequence_cost(lengths, cost: str = "tokens", model_config: ModelConfig | None = None):
    """[n] float64 cost per sequence: L ("tokens"), or a*L + b*L^2 ("attention").
    ``lengths`` a tensor or a NumPy array; the result is of the same kind."""
    if isinstance(lengths, np.ndarray):
        L = lengths.astype(np.float64)
    else:
        L = lengths.to(torch.float64)
    if cost == "tokens":
        return L
    if cost == "attention":
        if model_config is None:
            raise ValueError(
                'cost="attention" needs model_config (a ModelConfig: hidden, FFN, layers, '
                "MoE top-k, heads), which gives its coefficients"
            )
        a, b = cost_coefficients(model_config)
        return L * a + L * L * b
    raise ValueError(f'cost: expected "tokens" or "attention", got {cost!r}')


class Plan:
    """A packing plan: for each data-parallel rank, ``num_micro_batches`` lists of
    sequence indices.

    order : [n] int64, sequence indices rank-major, then micro-batch.
    offsets : [dp_size * num_micro_batches + 1] int64; micro-batch j of rank r
        is ``order[offsets[r*M + j] : offsets[r*M + j + 1]]``.
    lengths : [n] int64, the lengths planned.
    tokens : [n] int64 lengths after padding to pad_multiple (what the cap counts).
    cost : [n] float64, what was balanced.

    The tensors share memory with the planner's NumPy output and are built on
    first access (the planner itself does no per-sequence work in Python).
    """

    def __init__(
        self,
        order: np.ndarray,
        offsets: np.ndarray,
        dp_size: int,
        num_micro_batches: int,
        lengths: np.ndarray,
        pad_multiple: int,
        cost_ab: tuple[float, float],
        max_tokens: int,
        lower_bound: float,
    ):
        self._order = order
        self._offsets = offsets
        self._lengths = lengths
        self._pad = pad_multiple
        self._cost_ab = cost_ab
        self.dp_size = dp_size
        self.num_micro_batches = num_micro_batches
        self.max_tokens = max_tokens
        self._lower_bound = lower_bound
        self.empty_micro_batches = 0  # padding micro-batches a caller added (rl/shares.py)

    @cached_property
    def order(self) -> torch.Tensor:
        return torch.from_numpy(self._order)

    @cached_property
    def offsets(self) -> torch.Tensor:
        return torch.from_numpy(self._offsets)

    @cached_property
    def lengths(self) -> torch.Tensor:
        return torch.from_numpy(self._lengths)

    @cached_property
    def _tokens(self) -> np.ndarray:
        p = self._pad
        return self._lengths if p == 1 else (self._lengths + (p - 1)) // p * p

    @cached_property
    def tokens(self) -> torch.Tensor:
        return torch.from_numpy(self._tokens)

    @cached_property
    def _cost(self) -> np.ndarray:
        a, b = self._cost_ab
        t = self._tokens.astype(np.float64)
        return t * a + t * t * b if b else t * a

    @cached_property
    def cost(self) -> torch.Tensor:
        return torch.from_numpy(self._cost)

    def micro_batch(self, rank: int, j: int) -> torch.Tensor:
        """[m] int64 sequence indices of micro-batch j on ``rank``."""
        if not (0 <= rank < self.dp_size and 0 <= j < self.num_micro_batches):
            raise IndexError(
                f"micro_batch({rank}, {j}): expected rank < {self.dp_size} and "
                f"j < {self.num_micro_batches}"
            )
        k = rank * self.num_micro_batches + j
        return self.order[int(self._offsets[k]) : int(self._offsets[k + 1])]

    def rank_indices(self, rank: int) -> np.ndarray:
        """[m] int64 sequence indices of every micro-batch of ``rank``, in order
        (a view of the plan's NumPy output)."""
        if not 0 <= rank < self.dp_size:
            raise IndexError(f"rank_indices({rank}): expected rank < {self.dp_size}")
        M = self.num_micro_batches
        return self._order[self._offsets[rank * M] : self._offsets[(rank + 1) * M]]

    @cached_property
    def assignment(self) -> list[list[list[int]]]:
        """assignment[rank][micro_batch] = list of sequence indices (ascending)."""
        order = self._order.tolist()  # NumPy's tolist: ~3x faster than torch's
        off = self._offsets.tolist()
        M = self.num_micro_batches
        return [
            [order[off[r * M + j] : off[r * M + j + 1]] for j in range(M)]
            for r in range(self.dp_size)
        ]

    @cached_property
    def stats(self) -> dict[str, float | int | np.ndarray]:
        """Balance and waste of the plan (computed on first access).

        rank_cost / rank_tokens : [dp] per rank; imbalance = max / mean rank
        cost; cv = its std / mean; lower_bound = max(total / dp, largest item
        (group or sequence)); max_over_lower_bound. mb_cost / mb_tokens : [dp, M];
        mb_imbalance = max / mean micro-batch cost; utilization = tokens /
        (dp * M * max_tokens); padding_tokens = tokens added by pad_multiple;
        idle_tokens = sum over ranks of (max rank tokens - rank tokens).
        """
        order = self._order
        off = self._offsets
        k, M = self.dp_size, self.num_micro_batches
        # per-micro-batch sums by segment id (np.add.reduceat is wrong for the empty
        # micro-batches of a padded plan: it returns the next element, or overruns)
        seg = np.repeat(np.arange(k * M), np.diff(off))
        c = np.bincount(seg, weights=self._cost[order], minlength=k * M).reshape(k, M)
        t = np.bincount(seg, weights=self._tokens[order], minlength=k * M)
        t = t.astype(self._tokens.dtype).reshape(k, M)
        rc, rt = c.sum(1), t.sum(1)
        mean = rc.mean()
        total_tokens = int(t.sum())
        return {
            "dp_size": k,
            "num_micro_batches": M,
            "rank_cost": rc,
            "rank_tokens": rt,
            "imbalance": float(rc.max() / mean),
            "cv": float(rc.std() / mean),
            "lower_bound": self._lower_bound,
            "max_over_lower_bound": float(rc.max() / self._lower_bound),
            "mb_cost": c,
            "mb_tokens": t,
            "mb_imbalance": float(c.max() / c.mean()),
            "max_mb_tokens": int(t.max()),
            "utilization": total_tokens / (k * M * self.max_tokens),
            "padding_tokens": total_tokens - int(self._lengths.sum()),
            "idle_tokens": int((rt.max() - rt).sum()),
        }

    def __repr__(self) -> str:
        return (
            f"Plan(n={self._order.size}, dp_size={self.dp_size}, "
            f"num_micro_batches={self.num_micro_batches}, max_tokens={self.max_tokens})"
        )


def _as_int64(name: str, x) -> np.ndarray:
    # The host path works on NumPy arrays (they cross into C++ by DLPack too):
    # a handful of small torch ops here cost more than the whole C++ search
    # when torch's intra-op threads contend with other work on the host.
    if type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1 and x.flags.c_contiguous:
        return x  # the common case, in ~0.2 us
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype not in INT_DTYPES:
            raise ValueError(f"{name}: expected a 1-d integer tensor, got {describe(x)}")
        a = x.detach().cpu().numpy()
    else:
        a = np.asarray(x)
        if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"{name}: expected a 1-d sequence of ints, got {a.dtype}{a.shape}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _positive_int(name: str, v) -> int:
    v = as_int(name, v, lo=1)  # bool refused: dp_size=True is not 1
    if v > 2**63 - 1:
        raise ValueError(f"{name}: expected a positive int below 2^63, got {v}")
    return v


#: the C++ planner's int64 headroom for the padded total (it compares doubled loads)
_TOTAL_LIMIT = (2**63 - 1) // 4


def _scaled(L: np.ndarray, pad: int, max_tokens: int, cost_b: float):
    """None when the padded total fits the planner's int64 headroom (the common case,
    one max); else (padded // g, max_tokens // g, g) with g the lengths' gcd: balancing
    and the cap are the same problem in units of g (exact: every load is a multiple of
    g) for the token cost. Raises naming ``lengths`` where no such g brings it in."""
    if int(L.max()) < _TOTAL_LIMIT // max(L.size, 1) // pad:
        return None
    P = [-(-int(x) // pad) * pad for x in L.tolist()]  # Python ints: no wrap
    total = sum(P)
    if total > 2**63 - 1:
        raise ValueError(f"lengths: the total token count {total} (after padding) overflows int64")
    if total <= _TOTAL_LIMIT:
        return None
    for i, x in enumerate(P):
        if x > max_tokens:
            raise ValueError(
                f"lengths: sequence {i} has {x} tokens (after padding), more than max_tokens = "
                f"{max_tokens}: no micro-batch can hold it"
            )
    g = math.gcd(*P)
    if cost_b != 0.0 or total // g > _TOTAL_LIMIT:
        raise ValueError(
            f"lengths: the total token count {total} (after padding) passes 2^61, the "
            "planner's int64 headroom (it compares doubled loads), and no common factor of "
            'the lengths (with cost="tokens") brings it below'
        )
    return np.array([x // g for x in P], dtype=np.int64), max_tokens // g, g


def plan(
    lengths: torch.Tensor | np.ndarray | Sequence[int],
    *,
    dp_size: int,
    max_tokens: int,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    cost: str = "tokens",
    model_config: ModelConfig | None = None,
    micro_batch_multiple: int = 1,
    equal_samples: bool = False,
    pad_multiple: int = 1,
    refine_iters: int | None = None,
) -> Plan:
    """Assign sequences to data-parallel ranks and micro-batches.

    Parameters
    ----------
    lengths : [n] integer sequence lengths (int32 / int64 tensor on any device, list
        or array); every length >= 1.
    dp_size : data-parallel ranks.
    max_tokens : the token cap of one micro-batch (lengths padded to
        pad_multiple count against it); a longer sequence is an error naming it.
    group_ids : [n] integer ids; sequences of one group go to one rank.
    cost : "tokens" (balance L) or "attention" (a*L + b*L^2, coefficients from
        ``model_config`` via :func:`cost_coefficients`).
    micro_batch_multiple : the micro-batch count per rank is a multiple of this
        (virtual pipeline stages).
    equal_samples : every rank gets the same number of sequences (of groups,
        with group_ids: the groups must then be of one size), differing by at
        most one when dp_size does not divide it.
    pad_multiple : each sequence is padded to a multiple of this (2*cp*tp for
        Megatron THD) before it counts against the cap and the cost.
    refine_iters : cap on refinement steps at the rank level (default 16*dp + 256).

    NaN / Inf policy: lengths and group_ids are integers; the attention cost's
    coefficients and every sequence's cost must be finite (always checked:
    ValueError naming cost_a / cost_b and the sequence whose cost overflows).

    Returns
    -------
    :class:`Plan`: every rank has ``num_micro_batches`` non-empty micro-batches,
    each within max_tokens. Deterministic: the same input gives the same plan.

    Raises
    ------
    ValueError : only where no plan exists (a counting bound, or an exhaustive
        search, says so in the message), or, on inputs too large to search,
        where the search for one gave up (the message says so); and for bad
        arguments, naming them.
    """
    L = _as_int64("lengths", lengths)
    n = L.size
    if not (type(dp_size) is int and 1 <= dp_size < 2**63):
        dp_size = _positive_int("dp_size", dp_size)
    if not (type(max_tokens) is int and 1 <= max_tokens < 2**63):
        max_tokens = _positive_int("max_tokens", max_tokens)
    if type(micro_batch_multiple) is not int or micro_batch_multiple != 1:  # True == 1
        micro_batch_multiple = _positive_int("micro_batch_multiple", micro_batch_multiple)
    if type(pad_multiple) is not int or pad_multiple != 1:
        pad_multiple = _positive_int("pad_multiple", pad_multiple)
    if n == 0:
        raise ValueError("lengths: expected at least one sequence, got none")
    gid = None
    if group_ids is not None:
        gid = _as_int64("group_ids", group_ids)
        if gid.size != n:
            raise ValueError(f"group_ids: expected {n} elements (one per sequence), got {gid.size}")
    if cost == "tokens":
        cost_ab = (1.0, 0.0)
    elif cost == "attention":
        if model_config is None:
            raise ValueError(
                'cost="attention" needs model_config (a ModelConfig: hidden, FFN, layers, '
                "MoE top-k, heads), which gives its coefficients"
            )
        cost_ab = cost_coefficients(model_config)
    else:
        raise ValueError(f'cost: expected "tokens" or "attention", got {cost!r}')
    order = np.empty(n, dtype=np.int64)
    offsets = np.empty(n + 1, dtype=np.int64)
    iters = -1 if refine_iters is None else int(refine_iters)
    scaled = _scaled(L, pad_multiple, max_tokens, cost_ab[1])
    if scaled is None:
        M, lower_bound = _C().plan_cpu(
            L,
            gid,
            dp_size,
            max_tokens,
            micro_batch_multiple,
            bool(equal_samples),
            pad_multiple,
            cost_ab[0],
            cost_ab[1],
            iters,
            order,
            offsets,
        )
    else:  # totals past 2^61: the same plan in units of the lengths' gcd
        Ls, cap, g = scaled
        M, lower_bound = _C().plan_cpu(
            Ls,
            gid,
            dp_size,
            cap,
            micro_batch_multiple,
            bool(equal_samples),
            1,
            cost_ab[0],
            cost_ab[1],
            iters,
            order,
            offsets,
        )
        lower_bound *= g
    return Plan(
        order,
        offsets[: dp_size * M + 1],
        dp_size,
        M,
        L,
        pad_multiple,
        cost_ab,
        max_tokens,
        lower_bound,
    )


_packing_module = None


def _C():
    global _packing_module
    if _packing_module is None:
        _packing_module = load().packing
    return _packing_module
