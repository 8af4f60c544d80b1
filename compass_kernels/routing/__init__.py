"""Router capture and replay (ck.routing): the trace, its codec and re-layout,
and the fused replay of recorded expert ids on the trainer's router logits.

Contract (docs/design.md, "Router capture and replay"):

- :class:`RoutingTrace` holds, per token of a batch of sequences (packed, with
  int64 ``cu_seqlens``), the top-k LOGICAL expert ids of every MoE layer,
  ``expert_ids[total_tokens, num_moe_layers (+ num_mtp_layers), top_k]``, dtype
  uint8 when num_experts <= 256 else int16 (up to 32768 experts).
- Columns are keyed by the model's GLOBAL layer number (``layer_ids``), MoE
  layers only: dense layers have no column and shift nothing. MTP layers are
  keyed apart (``mtp_layer_ids``, their own 0-based depth index) and are
  dropped by :meth:`RoutingTrace.slice` unless asked for.
- Row t of a sequence is the routing used when token t was the model's
  input: a finished sequence of prompt + generated = N tokens has N - 1 rows.
- Rows not computed by the engine are marked missing (``missing`` bool mask,
  ``missing_reason`` per token: :class:`MissingReason`), never zeros or
  stale. Replay routes a missing row natively and counts it.
- Multi-turn: :meth:`RoutingTrace.stitch` appends a later turn's trace.

Typical training use, per MoE layer and micro-batch::

    local = trace.slice(layers=stage_layers, sequences=mb, cp_size=2, cp_rank=r,
                        cp_layout="zigzag", pad_multiple=4)   # once per micro-batch
    local.validate(moe_layer_ids=stage_moe_layers)            # one host sync
    col = list(local.layer_ids).index(layer_number)
    ids = local.expert_ids[:, col]                             # [tokens, top_k]
    valid = ~local.missing[:, col] if local.missing is not None else None
    res = replay_topk(router_logits, ids, score_function="sigmoid",
                      expert_bias=router.expert_bias, scaling=2.5, valid=valid)
    probs = torch.zeros_like(router_logits).scatter(1, res.expert_ids, res.weights)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compass_kernels.routing.trace import MissingReason, RoutingTrace, TraceError, ids_dtype

__all__ = [
    "MissingReason",
    "ReplayResult",
    "ReplayStats",
    "RoutingTrace",
    "TraceError",
    "ids_dtype",
    "replay_topk",
    "SCORE_FUNCTIONS",
]

SCORE_FUNCTIONS = {"softmax": 0, "sigmoid": 1}
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_IDS = (torch.uint8, torch.int16, torch.int32, torch.int64)


class ReplayStats:
    """Replay statistics of one :func:`replay_topk` call, kept on the logits' device.

    ``counts`` is an int64 [5] device tensor: (rows, replay_candidates,
    overlap_sum, exact_rows, rejected_rows), where replay_candidates are the rows
    with ``valid`` True. Every property is a 0-d device tensor computed when
    read (no host sync until you call ``.item()``); sum ``counts`` over layers
    or micro-batches and wrap the sum in ``ReplayStats`` to aggregate.

    agreement : mean over candidate rows of |native top-k ∩ replayed| / top_k
        (1.0 when the trainer would route exactly as the trace; NaN with no
        candidate row).
    exact_match : fraction of candidate rows whose native set equals the replayed set.
    fallback_rows : rows routed natively because missing (valid False).
    rejected_rows : candidate rows routed natively by ``min_score_ratio``.
    replace_rate : rejected_rows / candidate rows (0 without ``min_score_ratio``).
    replayed_rows : rows that used the trace's ids.
    """

    __slots__ = ("counts", "top_k")

    def __init__(self, counts: torch.Tensor, top_k: int) -> None:
        self.counts = counts
        self.top_k = top_k

    @property
    def rows(self) -> torch.Tensor:
        return self.counts[0]

    @property
    def agreement(self) -> torch.Tensor:
        return self.counts[2].to(torch.float64) / (self.counts[1] * self.top_k)

    @property
    def exact_match(self) -> torch.Tensor:
        return self.counts[3].to(torch.float64) / self.counts[1]

    @property
    def fallback_rows(self) -> torch.Tensor:
        return self.counts[0] - self.counts[1]

    @property
    def rejected_rows(self) -> torch.Tensor:
        return self.counts[4]

    @property
    def replayed_rows(self) -> torch.Tensor:
        return self.counts[1] - self.counts[4]

    @property
    def replace_rate(self) -> torch.Tensor:
        return self.counts[4].to(torch.float64) / self.counts[1].clamp(min=1)

    def as_dict(self) -> dict[str, float]:
        """Host floats (one host sync)."""
        c = self.counts.tolist()
        cand = c[1]
        return {
            "rows": c[0],
            "agreement": c[2] / (cand * self.top_k) if cand else float("nan"),
            "exact_match": c[3] / cand if cand else float("nan"),
            "fallback_rows": c[0] - c[1],
            "rejected_rows": c[4],
            "replayed_rows": c[1] - c[4],
            "replace_rate": c[4] / cand if cand else 0.0,
        }

    def __repr__(self) -> str:
        return f"ReplayStats({self.as_dict()})"


class ReplayResult(NamedTuple):
    """Result of :func:`replay_topk` (unpacks as a 5-tuple; the first four are
    (weights, routing_map, tokens_per_expert, stats))."""

    weights: torch.Tensor
    routing_map: torch.Tensor
    tokens_per_expert: torch.Tensor
    stats: ReplayStats
    expert_ids: torch.Tensor


def _check_replay_args(router_logits, expert_ids, score_function, expert_bias, valid,
                       min_score_ratio, scaling):  # fmt: skip
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise ValueError(
            "router_logits: expected a 2-d tensor [tokens, num_experts], got "
            + _desc(router_logits)
        )
    if router_logits.dtype not in _FLOAT:
        raise ValueError(
            "router_logits: expected dtype float16 | bfloat16 | float32 | float64, got "
            + _desc(router_logits)
        )
    t, e = router_logits.shape
    dev = router_logits.device
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        raise ValueError(
            f"expert_ids: expected a 2-d tensor [tokens, top_k], got {_desc(expert_ids)}"
        )
    if expert_ids.dtype not in _IDS:
        raise ValueError(
            f"expert_ids: expected dtype uint8 | int16 | int32 | int64, got {_desc(expert_ids)}"
        )
    if expert_ids.shape[0] != t:
        raise ValueError(
            f"expert_ids: expected {t} rows (one per router_logits row), got {_desc(expert_ids)}"
        )
    k = expert_ids.shape[1]
    if not 1 <= k <= e:
        raise ValueError(f"expert_ids: top_k = {k} must be in [1, num_experts = {e}]")
    if expert_ids.device != dev:
        raise ValueError(f"expert_ids: expected a tensor on {dev}, got {_desc(expert_ids)}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function: expected 'softmax' or 'sigmoid', got {score_function!r}")
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or expert_bias.dtype not in _FLOAT:
            raise ValueError(
                f"expert_bias: expected a float tensor [{e}], got {_desc(expert_bias)}"
            )
        if tuple(expert_bias.shape) != (e,) or expert_bias.device != dev:
            raise ValueError(
                f"expert_bias: expected shape [{e}] (num_experts) on {dev}, got "
                + _desc(expert_bias)
            )
    if valid is not None:
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
            raise ValueError(f"valid: expected a bool tensor [{t}], got {_desc(valid)}")
        if tuple(valid.shape) != (t,) or valid.device != dev:
            raise ValueError(f"valid: expected shape [{t}] (tokens) on {dev}, got {_desc(valid)}")
    if min_score_ratio is not None and not (float(min_score_ratio) >= 0):
        raise ValueError(f"min_score_ratio: expected None or a float >= 0, got {min_score_ratio!r}")
    if not isinstance(scaling, (int, float)) or not (float(scaling) == float(scaling)):
        raise ValueError(f"scaling: expected a finite float, got {scaling!r}")


def replay_topk(
    router_logits: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    score_function: str = "softmax",
    normalize: bool = True,
    expert_bias: torch.Tensor | None = None,
    scaling: float = 1.0,
    valid: torch.Tensor | None = None,
    min_score_ratio: float | None = None,
    backend: str | None = None,
) -> ReplayResult:
    """Gate the router's logits at the replayed experts, in one pass, for one MoE layer.

    Parameters
    ----------
    router_logits : [T, E] float16 | bfloat16 | float32 | float64, the trainer's
        router logits (requires_grad as usual). Computed in float32 (float64
        for float64 input).
    expert_ids : [T, K] uint8 | int16 | int32 | int64: the trace's LOGICAL ids
        for this layer (e.g. ``trace.expert_ids[:, col]``), distinct within a
        row, in [0, E) (validate the trace first: rows with valid True are read
        unchecked on GPU, ids outside [0, E) there are undefined behaviour; the
        CPU kernel raises).
    score_function : "softmax" | "sigmoid" (Megatron's moe_router_score_function).
    normalize : softmax: True = softmax over the K selected logits (top-k then
        softmax, Qwen3 norm_topk_prob), False = softmax over all E then take K;
        sigmoid: True = divide by (sum of the K scores + 1e-20) when K > 1
        (DeepSeek-V3), False = raw sigmoid scores.
    expert_bias : [E] float or None: added to the scores for NATIVE selection
        only (DeepSeek-V3 aux-free balancing); never enters a weight.
    scaling : multiplies every weight (moe_router_topk_scaling_factor).
    valid : [T] bool or None: False marks a missing trace row; it is routed
        natively (the K largest of score + bias, ties to the lower index) and
        counted in ``stats.fallback_rows``.
    min_score_ratio : None, or replay a row only when the smallest score of its
        replayed experts is >= ratio * the smallest score of the native top-k
        (scores without bias); other rows are routed natively and counted in
        ``stats.rejected_rows`` / ``stats.replace_rate``.
    backend : None (default dispatch) or an explicit backend name.

    Returns
    -------
    ReplayResult(weights, routing_map, tokens_per_expert, stats, expert_ids):
    weights : [T, K] router_logits' dtype, gating weight of ``expert_ids[t, k]``,
        differentiable w.r.t. router_logits: the gradient reaches the logit of
        every replayed expert, including ones the native top-k would not pick.
    routing_map : [T, E] bool, True at the K experts each row uses.
    tokens_per_expert : [E] int64, rows routed to each expert (for the
        load-balancing loss), on the device.
    stats : :class:`ReplayStats` (device tensors, no host sync).
    expert_ids : [T, K] int64, the ids each row used (the trace's, or the
        native top-k in descending score order for fallback / rejected rows);
        scatter ``weights`` at these to build Megatron's dense probs [T, E].

    No host sync on any device path. Per-call host overhead: bench/bench_routing.py.
    """
    _check_replay_args(router_logits, expert_ids, score_function, expert_bias, valid,
                       min_score_ratio, scaling)  # fmt: skip
    return _replay_torch(
        router_logits, expert_ids, score_function=score_function, normalize=bool(normalize),
        expert_bias=expert_bias, scaling=float(scaling), valid=valid,
        min_score_ratio=min_score_ratio,
    )  # fmt: skip


def _replay_torch(router_logits, expert_ids, *, score_function, normalize, expert_bias,
                  scaling, valid, min_score_ratio) -> ReplayResult:  # fmt: skip
    """The unfused torch path (gather + softmax + scatter): the bench baseline."""
    acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    z = router_logits.to(acc)
    t, e = z.shape
    k = expert_ids.shape[1]
    with torch.no_grad():
        scores = torch.softmax(z, -1) if score_function == "softmax" else torch.sigmoid(z)
        sel = scores if expert_bias is None else scores + expert_bias.to(acc)
        native = torch.topk(sel, k, dim=-1).indices
        replay = expert_ids.to(torch.int64)
        if valid is not None:
            replay = torch.where(valid[:, None], replay, native)
        overlap = (replay[:, :, None] == native[:, None, :]).any(-1).sum(-1)
        cand = torch.ones(t, dtype=torch.bool, device=z.device) if valid is None else valid
        use = cand
        if min_score_ratio is not None:
            weak_r = torch.gather(scores, 1, replay).amin(-1)
            weak_n = torch.gather(scores, 1, native).amin(-1)
            use = cand & (weak_r >= float(min_score_ratio) * weak_n)
        ids = torch.where(use[:, None], replay, native)
        counts = torch.stack(
            [
                torch.tensor(t, device=z.device),
                cand.sum(),
                (overlap * cand).sum(),
                ((overlap == k) & cand).sum(),
                (cand & ~use).sum(),
            ]
        ).to(torch.int64)
        routing_map = torch.zeros(t, e, dtype=torch.bool, device=z.device).scatter_(1, ids, True)
        tokens_per_expert = routing_map.sum(0, dtype=torch.int64)
    if score_function == "softmax":
        if normalize:
            w = torch.softmax(torch.gather(z, 1, ids), -1)
        else:
            w = torch.gather(torch.softmax(z, -1), 1, ids)
    else:
        w = torch.gather(torch.sigmoid(z), 1, ids)
        if normalize and k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        w = w * scaling
    return ReplayResult(
        w.to(router_logits.dtype), routing_map, tokens_per_expert, ReplayStats(counts, k), ids
    )


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"
    return type(t).__name__
