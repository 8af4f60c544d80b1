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
    ids, valid = local.layer(layer_number)   # by global layer number; valid: None or [T]
    res = replay_topk(router_logits, ids, score_function="sigmoid",
                      expert_bias=router.expert_bias, scaling=2.5, valid=valid)
    probs = torch.zeros_like(router_logits).scatter(1, res.expert_ids, res.weights)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from compass_kernels._op import op
from compass_kernels._validate import as_float, should_check
from compass_kernels.routing import _setcode  # noqa: F401  (registers the encode op)
from compass_kernels.routing.trace import MissingReason, RoutingTrace, TraceError, _desc, ids_dtype

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

    ``counts`` is an int64 [6] device tensor: (rows, candidates, overlap_sum,
    exact_rows, rejected_rows, bad_rows). Candidates are the rows with
    ``valid`` True and well-formed ids. Every property is a 0-d device tensor
    computed when read (no host sync until you call ``.item()``); sum
    ``counts`` over layers or micro-batches and wrap the sum in ``ReplayStats``
    to aggregate.

    agreement : mean over candidates of |native top-k ∩ replayed| / top_k
        (1.0 when the trainer would route exactly as the trace; NaN with no
        candidate).
    exact_match : fraction of candidates whose native set equals the replayed set.
    fallback_rows : rows routed natively because missing (valid False) or bad.
    rejected_rows : candidates routed natively by ``min_score_ratio``.
    replace_rate : rejected_rows / candidates (0 without ``min_score_ratio``).
    replayed_rows : rows that used the trace's ids.
    bad_rows : valid rows with an id out of [0, E) or twice (routed natively;
        checked calls (``replay_topk(validate=)``, CPU by default) raise instead).
    """

    __slots__ = ("counts", "top_k")

    def __init__(self, counts: torch.Tensor, top_k: int) -> None:
        self.counts = counts
        self.top_k = top_k

    @property
    def rows(self) -> torch.Tensor:
        """0-d int64: rows routed in the call."""
        return self.counts[0]

    @property
    def agreement(self) -> torch.Tensor:
        """0-d float64: mean |native top-k ∩ replayed| / top_k over candidates."""
        return self.counts[2].to(torch.float64) / (self.counts[1] * self.top_k)

    @property
    def exact_match(self) -> torch.Tensor:
        """0-d float64: fraction of candidates whose native set equals the replayed set."""
        return self.counts[3].to(torch.float64) / self.counts[1]

    @property
    def fallback_rows(self) -> torch.Tensor:
        """0-d int64: rows routed natively because missing or bad."""
        return self.counts[0] - self.counts[1]

    @property
    def rejected_rows(self) -> torch.Tensor:
        """0-d int64: candidates routed natively by ``min_score_ratio``."""
        return self.counts[4]

    @property
    def replayed_rows(self) -> torch.Tensor:
        """0-d int64: rows that used the trace's ids."""
        return self.counts[1] - self.counts[4]

    @property
    def bad_rows(self) -> torch.Tensor:
        """0-d int64: valid rows with an id out of [0, E) or repeated."""
        return self.counts[5]

    @property
    def replace_rate(self) -> torch.Tensor:
        """0-d float64: rejected_rows / candidates."""
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
            "bad_rows": c[5],
        }

    def __repr__(self) -> str:
        return f"ReplayStats({self.as_dict()})"


class ReplayResult(NamedTuple):
    """Result of :func:`replay_topk` (unpacks as a 5-tuple): weights [T, K] in the
    logits' dtype, routing_map [T, E] bool, tokens_per_expert [E] int64, stats
    (:class:`ReplayStats`), expert_ids [T, K] int64."""

    weights: torch.Tensor
    routing_map: torch.Tensor
    tokens_per_expert: torch.Tensor
    stats: ReplayStats
    expert_ids: torch.Tensor


def _check_replay_args(
    router_logits, expert_ids, score_function, expert_bias, valid, min_score_ratio, scaling
):
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
    if min_score_ratio is not None and not (
        as_float("min_score_ratio", min_score_ratio, finite=False) >= 0
    ):
        raise ValueError(f"min_score_ratio: expected None or a float >= 0, got {min_score_ratio!r}")
    if as_float("scaling", scaling, finite=False) != float(scaling):  # NaN
        raise ValueError(f"scaling: expected a finite float, got {scaling!r}")


def _check_finite_rows(name: str, t: torch.Tensor) -> None:
    """Raise naming the first row of ``t`` [T, E] holding NaN / Inf (one reduction
    when all are finite)."""
    t = t.detach()  # a float of a requires-grad tensor warns; the check needs no graph
    if t.numel() == 0 or math.isfinite(float(t.sum(dtype=torch.float64))):
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: expected finite values, got {float(t[r, c])} at row {r}, column {c} "
            f"({int(bad.any(1).sum())} rows with NaN / Inf)"
        )


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
    validate: bool | None = None,
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
        unchecked on GPU unless validate=True; checked on CPU by default).
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
    validate : raise on a malformed valid row (an id out of range or twice)
        and on non-finite logits, as ``_validate.should_check`` says: None
        (default) on CPU tensors (no sync to pay), not on CUDA (one host sync);
        True everywhere; False never; never on fake / meta tensors or while
        tracing. Unchecked, malformed rows are routed natively and counted in
        ``stats.bad_rows`` (never read out of bounds).

    NaN / Inf policy: ``router_logits`` must be finite: where checked, a
    :class:`ValueError` naming the first bad row; unchecked, a row with a NaN /
    Inf logit gives NaN weights for that row (as any torch router would), other
    rows are unaffected. ``expert_bias``
    follows the same policy.
    backend : None (default dispatch: "torch" on CPU, "triton" on GPU), "torch"
        or "triton".

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
    _check_replay_args(
        router_logits, expert_ids, score_function, expert_bias, valid, min_score_ratio, scaling
    )
    z = router_logits
    if z.dtype not in (torch.float32, torch.float64):
        z = z.float()  # the kernels compute in float32; weights come back in bf16/fp16
    if not z.is_contiguous():
        z = z.contiguous()
    ids = expert_ids if expert_ids.is_contiguous() else expert_ids.contiguous()
    bias = expert_bias
    if bias is not None:
        bias = bias.detach()
        if bias.dtype != z.dtype:
            bias = bias.to(z.dtype)
        if not bias.is_contiguous():
            bias = bias.contiguous()
    if valid is not None and not valid.is_contiguous():
        valid = valid.contiguous()
    ratio = -1.0 if min_score_ratio is None else float(min_score_ratio)
    args = dict(
        logits=z,
        expert_ids=ids,
        expert_bias=bias,
        valid=valid,
        score_function=SCORE_FUNCTIONS[score_function],
        normalize=bool(normalize),
        scaling=float(scaling),
        min_score_ratio=ratio,
    )
    if z.requires_grad and torch.is_grad_enabled():  # the op and its registered autograd
        w, rmap, tpe, counts, used = torch.ops.compass.replay_topk(**args, backend=backend)
    else:
        w, rmap, tpe, counts, used = replay_topk_op(**args, backend=backend)
    k = ids.shape[1]
    if should_check(validate, z, ids):
        _check_finite_rows("router_logits", z)
        if bias is not None:
            _check_finite_rows("expert_bias", bias.reshape(1, -1))
        # Bad rows are read from the counter (free on CPU, a sync on a GPU).
        _raise_bad_rows(counts, ids, valid, z.shape[1])
    if w.dtype != router_logits.dtype:
        w = w.to(router_logits.dtype)
    return ReplayResult(w, rmap, tpe, ReplayStats(counts, k), used)


def _raise_bad_rows(counts, ids, valid, e) -> None:
    """Raise naming the first malformed valid row (one host sync; free on CPU)."""
    if int(counts[5]) == 0:
        return
    x = ids.to(torch.int64)
    oob = ((x < 0) | (x >= e)).any(-1)
    srt = x.sort(-1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(-1)
    bad = oob | dup
    if valid is not None:
        bad &= valid
    t = int(bad.nonzero()[0, 0])
    row = x[t].tolist()
    if bool(oob[t]):
        v = next(v for v in row if not 0 <= v < e)
        raise ValueError(f"expert_ids: expert id {v} out of range [0, {e}) at row {t}: {row}")
    v = next(v for v in row if row.count(v) > 1)
    raise ValueError(f"expert_ids: expert {v} twice in row {t}: {row}")


# ---------------------------------------------------------------------- ops
# One declaration per op (compass_kernels/_op.py): torch.ops.compass.<name>,
# its fake (the output allocator), the backend table and the dispatch.


class ReplayOutputs(NamedTuple):
    """Outputs of :data:`replay_topk_op`."""

    weights: torch.Tensor  # [T, K] logits' dtype
    routing_map: torch.Tensor  # [T, E] bool
    tokens_per_expert: torch.Tensor  # [E] int64
    counts: torch.Tensor  # [6] int64 (ReplayStats)
    ids_used: torch.Tensor  # [T, K] int64


@op(
    kernels={
        "torch": "compass_kernels.routing.reference:replay_topk_torch",
        "triton": "compass_kernels.routing.triton:replay_topk_triton",
    }
)
def replay_topk_op(
    logits: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_bias: torch.Tensor | None,
    valid: torch.Tensor | None,
    score_function: int,
    normalize: bool,
    scaling: float,
    min_score_ratio: float,
) -> ReplayOutputs:
    """Gate weights at the replayed experts (see :func:`replay_topk`).

    logits : [T, E] float32 | float64. expert_ids : [T, K] integer. expert_bias :
    [E] (logits' dtype) or None. valid : [T] bool or None. score_function :
    SCORE_FUNCTIONS code. min_score_ratio : -1 for none.
    """
    e = logits.shape[1]
    return ReplayOutputs(
        weights=torch.empty_like(expert_ids, dtype=logits.dtype),
        routing_map=torch.empty_like(logits, dtype=torch.bool),
        tokens_per_expert=logits.new_empty(e, dtype=torch.int64),
        counts=logits.new_empty(6, dtype=torch.int64),
        ids_used=torch.empty_like(expert_ids, dtype=torch.int64),
    )


@op(
    kernels={
        "torch": "compass_kernels.routing.reference:replay_topk_backward_torch",
        "triton": "compass_kernels.routing.triton:replay_topk_backward_triton",
    },
    output="grad_logits",
)
def replay_topk_backward_op(
    grad_weights: torch.Tensor,
    logits: torch.Tensor,
    ids_used: torch.Tensor,
    score_function: int,
    normalize: bool,
    scaling: float,
) -> torch.Tensor:
    """d loss / d logits [T, E] from the gate weights' gradient [T, K] (logits' dtype)."""
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    args = replay_topk_op.bind(inputs)
    ctx.backend = args.get("backend")
    ctx.save_for_backward(args["logits"], ReplayOutputs._make(output).ids_used)
    ctx.score_function, ctx.normalize = args["score_function"], args["normalize"]
    ctx.scaling = args["scaling"]


def _backward(ctx, grad_w, *_):
    logits, used = ctx.saved_tensors
    g = grad_w
    if g.dtype != logits.dtype:
        g = g.to(logits.dtype)
    if not g.is_contiguous():
        g = g.contiguous()
    # Through the dispatcher: under torch.compile / AOT the inputs are fake tensors.
    grad = torch.ops.compass.replay_topk_backward(
        grad_weights=g,
        logits=logits,
        ids_used=used,
        score_function=ctx.score_function,
        normalize=ctx.normalize,
        scaling=ctx.scaling,
        backend=ctx.backend,
    )
    return replay_topk_op.input_grads(logits=grad)


torch.library.register_autograd("compass::replay_topk", _backward, setup_context=_setup_context)


def __dir__() -> list[str]:
    """dir(): the public names only (imports and helpers stay attributes, unlisted)."""
    return sorted(__all__)
