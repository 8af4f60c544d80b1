"""Router replay in verl's Megatron workers with compass's trace and replay.

verl's rollout (vLLM, ``rollout.enable_rollout_routing_replay``) returns
``routed_experts``: per token of prompt + response, the top-k expert ids of
every MoE layer, padded [B, S, num_moe_layers, top_k] beside ``input_ids``
(nested [B, j, layers, top_k] after ``left_right_2_no_padding``). Here:

- :func:`routed_experts_to_trace`: -> a validated ``ck.routing.RoutingTrace``
  (narrowest dtype, global MoE layer numbers, ids range-checked before the
  cast). A sequence's last token was never a rollout input: its row is dropped
  (the trace keeps tokens - 1 rows and the token counts; that token routes
  natively), never replayed from verl's zero placeholder; rows whose
  ids repeat within the row (verl's zero fill for routes the engine did not
  return, e.g. prefix-cache hits) are marked missing (``NOT_CAPTURED``) and
  counted, or refused with ``placeholders="error"``.
- Transport: ``trace.encode()`` / ``RoutingTrace.decode`` (the set codec) in
  place of the int tensor (4-8 bytes per id in verl's batch).
- :func:`micro_batch_trace`: the rows one Megatron rank's routers see for a
  micro-batch: verl's THD packing (each sequence padded to tp*cp*2 with CP,
  tp without; zigzag CP split; sequence-parallel split over TP), this pipeline
  stage's layers, via ``RoutingTrace.slice``.
- :func:`patch_megatron_engine` / :func:`revert_megatron_engine`: wrap
  ``MegatronEngine.forward_step`` (source pinned) so each micro-batch's forward
  runs inside ``megatron_replay.TraceReplay.micro_batch`` of that model chunk
  (recompute-safe: the replay keys its state by micro-batch).

Coexistence with verl's own R3 (``actor.megatron.router_replay.mode=R3``):
both replace ``TopKRouter.routing``, so they cannot both be on, and neither
wins silently: the wrapped ``forward_step`` refuses an engine whose
``router_replay.mode`` is not "disabled" (:class:`ReplayConflict`), and
compass's ``megatron_replay.apply`` refuses a routing function whose source
is not upstream's (verl's patch applied first) as ``TraceReplay`` refuses a
router whose routing was replaced after it (verl's patch applied later). To
switch: ``router_replay.mode=disabled`` and ``rollout.enable_rollout_routing_replay=True``
(verl still brings the routes), then :func:`patch_megatron_engine`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, cast

import torch

from compass_kernels.routing import MissingReason, RoutingTrace, TraceError, ids_dtype

from . import _pin

__all__ = [
    "ReplayConflict",
    "micro_batch_trace",
    "patch_megatron_engine",
    "revert_megatron_engine",
    "routed_experts_to_trace",
]


class ReplayConflict(RuntimeError):
    """verl's own router replay and compass's are both switched on."""


def _packed(routed_experts: torch.Tensor, attention_mask: torch.Tensor | None):
    """(rows [T, layers, k], lens [n]) from verl's padded or nested routes."""
    if routed_experts.is_nested:
        lens = (
            cast(Any, routed_experts).offsets().diff()
        )  # a nested tensor's (untyped).to(torch.int64).cpu()
        return routed_experts.values(), lens
    if routed_experts.dim() != 4:
        raise ValueError(
            "routed_experts: expected [B, S, num_moe_layers, top_k] (or nested [B, j, layers, "
            f"top_k]), got {routed_experts.dtype}{list(routed_experts.shape)}"
        )
    if attention_mask is None or attention_mask.shape != routed_experts.shape[:2]:
        raise ValueError(
            f"attention_mask: expected [B, S] = {list(routed_experts.shape[:2])} with padded "
            f"routed_experts, got {None if attention_mask is None else list(attention_mask.shape)}"
        )
    mask = attention_mask.bool().to(routed_experts.device)
    return routed_experts[mask], mask.sum(-1).to(torch.int64).cpu()


def routed_experts_to_trace(
    routed_experts: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    num_experts: int,
    moe_layer_ids=None,
    placeholders: str = "missing",
    validate: bool = True,
) -> RoutingTrace:
    """verl's ``routed_experts`` -> a validated ``RoutingTrace`` (one sequence per row).

    Parameters
    ----------
    routed_experts : [B, S, L, K] integer ids aligned with ``input_ids`` (padded,
        then ``attention_mask`` [B, S] selects each row's tokens), or nested
        [B, j, L, K] over the valid tokens.
    num_experts : routed experts per MoE layer (sets the trace dtype).
    moe_layer_ids : the L global layer numbers of the MoE layers (default 0..L-1).
    placeholders : "missing" (rows with a repeated id, verl's zero fill, are
        marked missing, reason NOT_CAPTURED) or "error" (such rows raise).
    validate : run ``RoutingTrace.validate`` (range, duplicates, keys).

    Returns
    -------
    RoutingTrace with tokens - 1 rows per sequence (the last token's row is
    dropped: it routes natively) and ``token_lens`` the sequences' token counts.
    """
    if placeholders not in ("missing", "error"):
        raise ValueError(f"placeholders: expected 'missing' or 'error', got {placeholders!r}")
    if routed_experts.dtype.is_floating_point or routed_experts.dtype == torch.bool:
        raise ValueError(f"routed_experts: expected integer ids, got {routed_experts.dtype}")
    rows, lens = _packed(routed_experts, attention_mask)
    T, L, K = rows.shape
    lo, hi = (int(rows.min()), int(rows.max())) if T else (0, 0)
    if lo < 0 or hi >= num_experts:
        raise TraceError(
            f"routed_experts: ids must be in [0, {num_experts}), got range [{lo}, {hi}] "
            "(physical EPLB slots instead of logical experts, or the wrong num_experts?)"
        )
    ids = rows.to(ids_dtype(num_experts)).contiguous()
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu[1:])
    dev = ids.device
    reason = torch.zeros(T, dtype=torch.uint8, device=dev)
    if K > 1:
        srt = rows.sort(-1).values
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1).any(-1)  # [T]
        if placeholders == "error" and bool(dup.any()):
            t = int(dup.nonzero()[0, 0])
            seq = int(torch.searchsorted(cu, torch.tensor(t), right=True)) - 1
            raise TraceError(
                f"routed_experts: sequence {seq}, token {t - int(cu[seq])} repeats an expert "
                "within its top-k (a placeholder row, not a routing)"
            )
        reason[dup] = MissingReason.NOT_CAPTURED
    # verl's routes have a row for every token, the last one included (its
    # routing is never trained on: nothing follows it). The trace keeps
    # tokens - 1 rows per sequence and the token counts (ck.routing's row-count
    # contract); the last token routes natively in the replay.
    keep = torch.ones(T, dtype=torch.bool, device=dev)
    keep[(cu[1:][lens > 0] - 1).to(dev)] = False
    rows_kept = (lens - 1).clamp(min=0)
    cu_kept = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(rows_kept, 0, out=cu_kept[1:])
    ids, reason = ids[keep], reason[keep]
    missing = reason != 0
    trace = RoutingTrace(
        ids,
        cu_kept.to(dev),
        num_experts,
        layer_ids=moe_layer_ids,
        missing=missing if bool(missing.any()) else None,
        missing_reason=reason if bool(missing.any()) else None,
        token_lens=lens,
    )
    if validate:
        trace.validate(num_experts=num_experts, top_k=K)
    return trace


def micro_batch_trace(
    trace: RoutingTrace,
    *,
    sequences=None,
    layers=None,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: str = "zigzag",
    sequence_parallel: bool = False,
    tp_rank: int = 0,
) -> RoutingTrace:
    """The rows one Megatron rank's routers see for a micro-batch, in their order.

    verl packs a micro-batch THD: each sequence padded to a multiple of
    ``tp*cp*2`` (zigzag CP) or ``tp*cp`` (contiguous) or ``tp`` (no CP), split
    over CP ranks, then over TP ranks when ``sequence_parallel``. Padding rows
    are missing (routed natively, counted). ``layers``: this pipeline stage's
    global layer numbers (None: all). ``sequences``: the micro-batch's rows of
    ``trace`` (None: all)."""
    factor = 2 if cp_layout == "zigzag" and cp_size > 1 else 1
    align = tp_size * cp_size * factor
    lens = trace.token_lens if sequences is None else [trace.token_lens[i] for i in sequences]
    return trace.slice(
        layers=layers,
        sequences=sequences,
        token_lens=lens,
        pad_multiple=align,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout if cp_size > 1 else None,
        sp_size=tp_size if sequence_parallel else 1,
        sp_rank=tp_rank if sequence_parallel else 0,
    )


# ------------------------------------------------------------ engine patch

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}
_REPLAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model chunk -> TraceReplay


def _rank_layout(engine) -> dict[str, Any]:
    from megatron.core import parallel_state as mpu

    tf = engine.tf_config
    return dict(
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        sequence_parallel=bool(getattr(tf, "sequence_parallel", False)),
    )


def patch_megatron_engine(*, num_experts: int | None = None, moe_layer_ids=None) -> bool:
    """Replay each micro-batch's ``routed_experts`` with compass's Megatron replay
    in verl's ``MegatronEngine`` (idempotent; True if this call patched).

    Raises
    ------
    VerlVersionError
        verl not reviewed, or ``MegatronEngine.forward_step`` changed.
    """
    _pin.check("replay")
    from verl.workers.engine.megatron import transformer_impl as ti

    from compass_kernels.integration.megatron import replay as megatron_replay

    with _LOCK:
        if _ORIGINAL:
            return False
        orig = ti.MegatronEngine.forward_step

        def forward_step(
            self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func
        ):
            mode = self.engine_config.router_replay.mode
            if mode != "disabled":
                raise ReplayConflict(
                    f"verl's router replay (router_replay.mode={mode!r}) and compass's replay both "
                    "patch TopKRouter.routing; set router_replay.mode=disabled (keep "
                    "rollout.enable_rollout_routing_replay=True) or revert_megatron_engine()"
                )
            batch = next(batch_iter)
            routes = batch.get("routed_experts", None)
            if routes is None:
                return orig(
                    self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func
                )
            replay = _REPLAYS.get(model)
            if replay is None:
                replay = _REPLAYS[model] = megatron_replay.TraceReplay(model)
            experts = num_experts or int(self.tf_config.num_moe_experts)
            trace = routed_experts_to_trace(
                routes, num_experts=experts, moe_layer_ids=moe_layer_ids
            )
            local = micro_batch_trace(trace, layers=replay.layers, **_rank_layout(self))
            with replay.micro_batch(local):
                return orig(
                    self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func
                )

        cast(Any, forward_step).__wrapped_by_compass__ = orig
        _ORIGINAL["forward_step"] = orig
        ti.MegatronEngine.forward_step = forward_step  # type: ignore[method-assign]  # the patch (reverted below)
        return True


def revert_megatron_engine() -> bool:
    """Undo :func:`patch_megatron_engine`; True if it was applied."""
    with _LOCK:
        if not _ORIGINAL:
            return False
        from verl.workers.engine.megatron import transformer_impl as ti

        ti.MegatronEngine.forward_step = _ORIGINAL.pop("forward_step")  # type: ignore[method-assign]  # the revert
        _REPLAYS.clear()
        return True
