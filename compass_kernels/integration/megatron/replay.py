"""Router replay in megatron-core: train routing exactly as the rollout engine did.

:class:`TraceReplay` feeds a ``compass_kernels.routing.RoutingTrace`` to every
MoE layer of a megatron-core model, one micro-batch at a time::

    replay = TraceReplay(model)                  # walks the module tree, patches once
    def forward_step(data_iterator, model):      # any Megatron pipeline schedule
        batch = next(data_iterator)
        with replay.micro_batch(batch["routing"]):   # rows in the router's token order
            output = model(batch["tokens"], batch["position_ids"], None)
        return output, loss_func
    ...
    replay.stats()                               # per-layer agreement, fallback rows

How it works, and why:

- One patch, :func:`apply`: ``TopKRouter.routing`` is replaced by a function
  that, for a router bound to a :class:`TraceReplay`, gates the router's dense
  logits at the trace's expert ids with ``compass_kernels.routing.replay_topk``
  (weights recomputed from the logits, so every replayed expert gets its
  gradient; missing rows routed natively and counted; native-vs-replayed
  agreement counted on the device) and returns Megatron's ``(probs,
  routing_map)``. Routers not bound to a replay run upstream's code unchanged.
  The patch is version-checked (megatron-core 0.16.x or 0.19.x, each release's
  sha256 pinned in :data:`UPSTREAM_SOURCE_SHA256`), idempotent and reversible
  (:func:`revert`). It replaces the whole routing function, so Megatron's
  ``moe_router_fusion`` path (which skips Megatron's own RouterReplay) cannot
  bypass it.
- Routers are found by walking the live module tree for ``MoELayer`` modules
  at every micro-batch (not by position in a global list), keyed by the
  model's global layer number (``layer_number - 1``, 0-based, as vLLM and HF
  number layers). Dense layers have no key; MTP layers are not replayed. A
  rebuilt decoder is rebound at the next micro-batch; an orphan router cannot
  be silently skipped because every forward checks that each bound MoE layer
  consumed its rows exactly once, and raises otherwise.
- State is keyed by model and micro-batch: the ids each layer used in a
  micro-batch's forward are kept, and activation recompute (run inside that
  micro-batch's backward) replays exactly those ids, whatever the schedule
  interleaves in between (no global FIFO). The micro-batch whose backward is
  running is identified by a gradient hook on the model's output.
- Configurations that would bypass or alter replayed routing are refused with
  a clear error (:func:`check_config`): token dropping (capacity factor),
  sinkhorn, forced load balancing, router padding for quantization, CUDA
  graphs over the router, Megatron's own RouterReplay on the same model, a
  router or MoE layer class that overrides the patched methods.

The arithmetic (gating, routing map, agreement) is all in
``compass_kernels.routing.replay_topk``; this module is plumbing.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _pin
from ._pin import SUPPORTED_VERSION_PREFIXES

__all__ = [
    "SUPPORTED_VERSION_PREFIXES",
    "UPSTREAM_SOURCE_SHA256",
    "ReplayError",
    "TraceReplay",
    "applied",
    "apply",
    "check_config",
    "find_moe_routers",
    "revert",
    "upstream_source_sha256",
]

#: megatron-core version -> {upstream function: sha256 of its normalized source}.
#: ``TopKRouter.routing`` is re-implemented around replay_topk; the others are
#: what that re-implementation relies on (the router's forward calls routing,
#: MoELayer.route calls the router, and the gating semantics mapped onto
#: replay_topk's options are topk_routing_with_score_function's). A version
#: without an entry, or any changed function, is refused; after reviewing a new
#: version, pin :func:`upstream_source_sha256`'s output here.
UPSTREAM_SOURCE_SHA256: dict[str, dict[str, str]] = {
    "0.16.1": {
        "TopKRouter.routing": "643e4db8e38762f226fb235f27ff8ebb3fe7fffd02d651c6b4b511235baec68c",
        "TopKRouter.forward": "04fefb168fcf62599067c190e25f9f63955cfaac01e520b25e0f7ea06eb9b2b3",
        "MoELayer.route": "0acc4fc15e82d07a571c5dda67ad7d3ef6abd1ad98094eab010744e27d968545",
        "topk_routing_with_score_function": (
            "ba35df9ce083b3af09f00df2fc67dcb8f0ca38a06a25ed72ed2fde5bbcd9da41"
        ),
    },  # Reviewed against 0.16.1: routing gains "quantile_balancing" and forward gains
    # moe_router_force_biased (both refused by check_config); the score function gains
    # "sqrtsoftplus" (refused per router), precomputed indices and a dense output (not
    # used by MoELayer.route), and computes in fp32 to the end (replay_topk takes fp32 /
    # fp64 logits and computes in their dtype: the same).
    "0.19.2": {
        "TopKRouter.routing": "94354306044a97901073b947c4a7e6a19f7994a42acd915aafc1df23a78da88d",
        "TopKRouter.forward": "a2766e05bc5d1371e8b55630fe92ac48e5f386f3bb23c9463b1440d501e43bac",
        "MoELayer.route": "0acc4fc15e82d07a571c5dda67ad7d3ef6abd1ad98094eab010744e27d968545",
        "topk_routing_with_score_function": (
            "d38accd1acb31d1c78fefefc6156dd73f247552626edb2c37b0451a8b1c90565"
        ),
    },
}


class ReplayError(RuntimeError):
    """Replay cannot be applied faithfully (bad config, missing rows, unconsumed layer)."""


def _version() -> str:
    return _pin.check_version(__name__, ReplayError, "patch")


# ---------------------------------------------------------------------------
# The patch
# ---------------------------------------------------------------------------

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}
# router module -> (TraceReplay, global layer number); weak so dead models drop out.
_BINDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _upstream_functions() -> dict[str, Any]:
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    return {
        "TopKRouter.routing": _ORIGINAL.get("routing", TopKRouter.__dict__.get("routing")),
        "TopKRouter.forward": TopKRouter.__dict__.get("forward"),
        "MoELayer.route": inspect.unwrap(MoELayer.__dict__.get("route")),
        "topk_routing_with_score_function": moe_utils.topk_routing_with_score_function,
    }


def upstream_source_sha256() -> dict[str, str]:
    """{function: sha256} of the installed megatron-core's (unpatched) functions
    the patch depends on (to review and pin in :data:`UPSTREAM_SOURCE_SHA256`)."""
    out = {}
    for name, fn in _upstream_functions().items():
        if fn is None:
            raise ReplayError(f"megatron-core has no {name}")
        out[name] = _pin.source_sha256(fn)
    return out


def _replay_routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
    binding = _BINDINGS.get(self)
    if binding is None:
        return _ORIGINAL["routing"](self, logits, padding_mask)
    replay, layer = binding
    if replay._native:
        return _ORIGINAL["routing"](self, logits, padding_mask)
    return replay._route(self, layer, logits, padding_mask)


def apply() -> bool:
    """Install the patch of ``TopKRouter.routing`` (idempotent).

    Returns
    -------
    bool
        True if this call installed it.

    Raises
    ------
    ReplayError
        If megatron-core is not a pinned version or ``TopKRouter.routing`` has
        changed from the reviewed source.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    with _LOCK:
        if "routing" in _ORIGINAL:
            return False
        version = _version()
        pinned = UPSTREAM_SOURCE_SHA256.get(version)
        if pinned is None:
            raise ReplayError(
                f"no upstream source hashes pinned for megatron-core {version} "
                f"(pinned: {sorted(UPSTREAM_SOURCE_SHA256)}); review the patch, then pin "
                "upstream_source_sha256() in UPSTREAM_SOURCE_SHA256"
            )
        actual = upstream_source_sha256()
        changed = sorted(k for k in pinned if actual.get(k) != pinned[k])
        if changed:
            raise ReplayError(
                f"megatron-core {version}: {changed} are not the functions the replay patch was "
                f"reviewed against (source sha256 {[actual[k] for k in changed]}, pinned "
                f"{[pinned[k] for k in changed]})"
            )
        _ORIGINAL["routing"] = TopKRouter.__dict__["routing"]
        TopKRouter.routing = _replay_routing
        return True


def revert() -> bool:
    """Restore upstream's ``TopKRouter.routing`` (idempotent); bound routers are unbound.

    Raises
    ------
    ReplayError
        If someone else replaced the method after :func:`apply` (left alone).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    with _LOCK:
        if "routing" not in _ORIGINAL:
            return False
        if TopKRouter.__dict__.get("routing") is not _replay_routing:
            raise ReplayError("TopKRouter.routing was replaced by someone else after apply()")
        TopKRouter.routing = _ORIGINAL.pop("routing")
        _BINDINGS.clear()
        return True


def applied() -> bool:
    """Whether the patch is installed."""
    return "routing" in _ORIGINAL


# ---------------------------------------------------------------------------
# Walking the model, checking its configuration
# ---------------------------------------------------------------------------


def find_moe_routers(model: torch.nn.Module) -> dict[int, Any]:
    """{global 0-based layer number: router} of the decoder MoE layers of ``model``.

    Walks the live module tree (stopping at each ``MoELayer``, whose experts
    are not visited) and skips ``MultiTokenPredictionBlock`` subtrees.

    Raises
    ------
    ReplayError
        If two MoE layers report the same layer number.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    found: dict[int, Any] = {}
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        if isinstance(module, MoELayer):
            router = module.router
            number = getattr(router, "layer_number", None)
            if number is None:
                raise ReplayError(f"MoE layer {name or '<root>'} has no layer number")
            key = int(number) - 1
            if key in found:
                raise ReplayError(f"two MoE layers report global layer number {key} ({name})")
            found[key] = router
            continue
        if isinstance(module, MultiTokenPredictionBlock):
            continue  # MTP layers: keyed apart, never replayed from decoder rows
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def check_config(config: Any, where: str = "model") -> None:
    """Refuse megatron-core settings under which replayed routing would be bypassed or altered.

    Raises
    ------
    ReplayError
        Naming the setting.
    """
    refusals = [
        (
            getattr(config, "moe_expert_capacity_factor", None) is not None,
            "moe_expert_capacity_factor (token dropping would drop replayed assignments)",
        ),
        (
            getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn",
            "moe_router_load_balancing_type='sinkhorn' (a different routing function)",
        ),
        (
            getattr(config, "moe_router_load_balancing_type", None) == "quantile_balancing",
            "moe_router_load_balancing_type='quantile_balancing' (routes by per-expert "
            "quantile thresholds, not the top-k the replay forces)",
        ),
        (
            bool(getattr(config, "moe_router_force_load_balancing", False)),
            "moe_router_force_load_balancing (random logits)",
        ),
        (
            getattr(config, "moe_router_force_biased", None) is not None,
            "moe_router_force_biased (random bias added to the logits)",
        ),
        (
            bool(getattr(config, "moe_router_padding_for_quantization", False))
            or bool(getattr(config, "moe_router_padding_for_fp8", False)),
            "moe_router_padding_for_quantization (pads the routing map with extra experts)",
        ),
        (
            getattr(config, "cuda_graph_impl", "none") != "none"
            or bool(getattr(config, "enable_cuda_graph", False))
            or bool(getattr(config, "external_cuda_graph", False)),
            "cuda_graph_impl / enable_cuda_graph / external_cuda_graph (a captured CUDA graph "
            "replays the routing it recorded, not the trace)",
        ),
        (
            bool(getattr(config, "moe_enable_routing_replay", False)),
            "moe_enable_routing_replay (Megatron's own RouterReplay on the same routers)",
        ),
    ]
    bad = [what for hit, what in refusals if hit]
    if bad:
        raise ReplayError(f"{where}: replay refuses {'; '.join(bad)}")


def _check_router(router: Any, layer: int) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401
    from megatron.core.transformer.moe.router import TopKRouter

    if not isinstance(router, TopKRouter):
        raise ReplayError(
            f"layer {layer}: router {type(router).__name__} is not a TopKRouter; replay "
            "cannot patch its routing"
        )
    if type(router).routing is not _replay_routing:
        raise ReplayError(
            f"layer {layer}: {type(router).__name__} overrides routing(); the replay patch "
            "would be bypassed"
        )
    check_config(router.config, f"layer {layer}")


# ---------------------------------------------------------------------------
# Replay state
# ---------------------------------------------------------------------------


@dataclass
class _MicroBatch:
    key: int
    ids: dict[int, torch.Tensor]  # layer -> [T, K] trace ids (forward)
    valid: dict[int, torch.Tensor | None]  # layer -> [T] bool or None
    num_tokens: int
    used: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> ids used (int64)
    forward_calls: dict[int, int] = field(default_factory=dict)
    recompute_calls: dict[int, int] = field(default_factory=dict)
    forward_done: bool = False
    backward_started: bool = False


class TraceReplay:
    """Replay routing traces in every MoE layer of one megatron-core model (chunk).

    Parameters
    ----------
    model : torch.nn.Module
        The module the schedule calls (a ``GPTModel``, or a wrapper around it:
        DDP, Float16Module). One pipeline stage / virtual chunk per instance.
    validate : bool, default True
        Validate each micro-batch's trace against the model (layer keys,
        top-k, experts; ids in range, no duplicates; row counts, see
        ``max_missing_fraction``) before replaying it: one small host sync per
        micro-batch. ``validate=False`` is the explicit opt-out.
    min_score_ratio : float, optional
        Passed to ``replay_topk``: replay a row only if its weakest replayed
        score is >= ratio x the weakest native top-k score.
    record : bool, default False
        Keep every (phase, micro-batch, layer, ids used) in :attr:`history`
        (tests, debugging).
    max_missing_fraction : float, optional
        With ``validate``, the row-count contract of ``RoutingTrace.validate``:
        by default every token the routers see has a row or a row the engine
        marked missing (at most one ``NO_ROW`` token per sequence, its last; no
        ``SHORT`` token, no sequence short of its ``token_lens``). A float f
        accepts short traces (e.g. sliced with the same ``max_missing_fraction``)
        while at most f of the (token, layer) rows are missing, marked or short.

    Raises
    ------
    ReplayError
        If the model has no MoE layer, or a refused configuration.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        validate: bool = True,
        min_score_ratio: float | None = None,
        record: bool = False,
        max_missing_fraction: float | None = None,
    ) -> None:
        apply()
        self._model_ref = weakref.ref(model)
        self.validate = validate
        self.min_score_ratio = min_score_ratio
        self.record = record
        self.max_missing_fraction = max_missing_fraction
        self.history: list[tuple[str, int, int, torch.Tensor]] = []
        self._routers: dict[int, Any] = {}
        self._bind()
        self._next_key = 0
        self._open: _MicroBatch | None = None
        self._backward: _MicroBatch | None = None
        self._pending: dict[int, _MicroBatch] = {}  # forward done, backward not finished
        self._counts: dict[int, torch.Tensor] = {}
        self._native = 0
        self._hooks = [
            model.register_forward_pre_hook(self._pre_forward),
            model.register_forward_hook(self._post_forward),
        ]

    # -- binding ---------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        model = self._model_ref()
        if model is None:
            raise ReplayError("the model of this TraceReplay was garbage-collected")
        return model

    @property
    def layers(self) -> list[int]:
        """Global layer numbers of the MoE layers replayed (this stage's)."""
        return sorted(self._routers)

    def _bind(self) -> None:
        routers = find_moe_routers(self.model)
        if not routers:
            raise ReplayError("the model has no MoE layer (no TopKRouter under a MoELayer)")
        for layer, router in routers.items():
            _check_router(router, layer)
        for router in list(self._routers.values()):
            if _BINDINGS.get(router, (None,))[0] is self:
                del _BINDINGS[router]
        for layer, router in routers.items():
            other = _BINDINGS.get(router)
            if other is not None and other[0] is not self:
                raise ReplayError(f"layer {layer}: its router is bound to another TraceReplay")
            _BINDINGS[router] = (self, layer)
        self._routers = routers
        first = next(iter(routers.values()))
        self.top_k = int(first.topk)
        self.num_experts = int(first.config.num_moe_experts)

    def remove(self) -> None:
        """Unbind the routers and remove the hooks (the class patch stays; see :func:`revert`)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for router in self._routers.values():
            if _BINDINGS.get(router, (None,))[0] is self:
                del _BINDINGS[router]
        self._routers = {}
        self._pending.clear()

    @contextlib.contextmanager
    def native(self) -> Iterator[None]:
        """Forwards inside this context route natively (an explicit opt-out, e.g. for
        evaluation); outside it, a forward without :meth:`micro_batch` raises."""
        if self._open is not None:
            raise ReplayError("native() inside micro_batch()")
        self._native += 1
        try:
            yield
        finally:
            self._native -= 1

    # -- micro-batches -----------------------------------------------------------

    @contextlib.contextmanager
    def micro_batch(self, trace: Any, *, order: str = "sbh") -> Iterator[int]:
        """Replay ``trace`` in the one model forward run inside this context.

        Parameters
        ----------
        trace : compass_kernels.routing.RoutingTrace
            This micro-batch's routing, already sliced for this rank
            (``trace.slice``): exactly this stage's MoE layers, one row per
            token the routers see.
        order : {"sbh", "bsh"}, default "sbh"
            Row order of ``trace``. Megatron's routers see tokens as
            [sequence, batch] flattened (``"sbh"``; with batch size 1 — packed
            sequences — that is simply the packed order). ``"bsh"``: rows are
            batch-major (sequence after sequence, all of equal length) and are
            reordered here.

        Yields
        ------
        int
            The micro-batch key (its backward is matched to it automatically).
        """
        if self._open is not None or self._native:
            raise ReplayError("micro_batch() cannot be nested (nor opened inside native())")
        if order not in ("sbh", "bsh"):
            raise ValueError(f"order must be 'sbh' or 'bsh', got {order!r}")
        self._release_finished()
        self._bind()  # the live tree: a rebuilt decoder is bound here
        mb = self._prepare(trace, order)
        self._open = mb
        try:
            yield mb.key
            if not mb.forward_done:
                raise ReplayError(
                    f"micro-batch {mb.key}: no forward of the model ran inside micro_batch()"
                )
        finally:
            self._open = None

    def _prepare(self, trace: Any, order: str) -> _MicroBatch:
        from compass_kernels.routing import RoutingTrace

        if not isinstance(trace, RoutingTrace):
            raise TypeError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
        layers = self.layers
        trace_layers = [int(x) for x in trace.layer_ids]
        if trace_layers != layers:
            raise ReplayError(
                f"trace layer_ids {trace_layers} != this model's MoE layers {layers} "
                "(slice the trace for this pipeline stage; dense layers have no rows)"
            )
        if self.validate:
            trace.validate(
                moe_layer_ids=layers,
                top_k=self.top_k,
                num_experts=self.num_experts,
                max_missing_fraction=self.max_missing_fraction,
            )
        elif trace.top_k != self.top_k or trace.num_experts != self.num_experts:
            raise ReplayError(
                f"trace (top_k {trace.top_k}, {trace.num_experts} experts) does not match the "
                f"model (top_k {self.top_k}, {self.num_experts} experts)"
            )
        n = trace.num_tokens
        missing = trace.missing
        grouped = [layer for layer, r in self._routers.items() if r.config.moe_router_group_topk]
        if grouped and (
            self.min_score_ratio is not None or (missing is not None and missing.any())
        ):
            # replay_topk's native selection (missing rows, min_score_ratio) is plain top-k:
            # it would not be the group-limited routing these layers use natively.
            raise ReplayError(
                f"layers {grouped} use group-limited routing (moe_router_group_topk); native "
                "fallback for missing rows or min_score_ratio would ignore the groups"
            )
        perm = None
        if order == "bsh":
            lens = trace.seq_lens()
            if len(set(lens)) > 1:
                raise ReplayError(f"order='bsh' needs sequences of equal length, got {lens}")
            b, s = len(lens), (lens[0] if lens else 0)
            perm = torch.arange(n, device=trace.expert_ids.device).view(b, s).t().reshape(-1)
        ids = {}
        valid: dict[int, torch.Tensor | None] = {}
        for layer in layers:
            ids[layer], valid[layer] = trace.layer(layer)  # by global number, never position
            if perm is not None:
                ids[layer] = ids[layer][perm]
                v = valid[layer]
                valid[layer] = None if v is None else v[perm]
        key = self._next_key
        self._next_key += 1
        return _MicroBatch(key=key, ids=ids, valid=valid, num_tokens=n)

    def _release_finished(self) -> None:
        """Drop micro-batches whose backward has run (it has, once another one starts)."""
        for key in [k for k, mb in self._pending.items() if mb.backward_started]:
            if self._backward is not None and self._backward.key == key:
                self._backward = None
            del self._pending[key]

    # -- hooks -------------------------------------------------------------------

    def _pre_forward(self, module: Any, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1 or self._native:
            return  # a recompute inside backward re-enters submodules, never the top model
        if self._open is None:
            raise ReplayError(
                "the model ran outside TraceReplay.micro_batch(): its routing would not be "
                "replayed (call replay.remove() to train without replay)"
            )
        if self._open.forward_done:
            raise ReplayError(f"micro-batch {self._open.key}: a second forward in one context")

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1 or self._native:
            return
        mb = self._open
        if mb is None:
            return
        unconsumed = [layer for layer in self.layers if mb.forward_calls.get(layer, 0) != 1]
        if unconsumed:
            detail = {layer: mb.forward_calls.get(layer, 0) for layer in unconsumed}
            raise ReplayError(
                f"micro-batch {mb.key}: MoE layers {unconsumed} did not consume their trace rows "
                f"exactly once (calls: {detail}); an orphan router or a skipped layer"
            )
        mb.forward_done = True
        out = output
        if isinstance(out, (tuple, list)):
            out = next((t for t in out if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self._pending[mb.key] = mb
            ref = weakref.ref(self)
            out.register_hook(lambda grad, key=mb.key: _on_backward(ref, key))
        # No graph (eval / no_grad): nothing to recompute; rows are dropped now.

    def _enter_backward(self, key: int) -> None:
        mb = self._pending.get(key)
        if mb is None:
            raise ReplayError(f"backward of micro-batch {key}, whose replay state is gone")
        # Backward calls do not overlap: one that starts means every earlier one finished.
        for other in [k for k, m in self._pending.items() if m.backward_started and m is not mb]:
            del self._pending[other]
        mb.backward_started = True
        self._backward = mb

    # -- routing -----------------------------------------------------------------

    def _route(self, router: Any, layer: int, logits: torch.Tensor, padding_mask: Any):
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        from compass_kernels.routing import replay_topk

        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            mb = self._backward
            if mb is None:
                raise ReplayError(
                    f"layer {layer}: router recomputed in a backward the replay did not see "
                    "start (the model output's gradient hook never ran)"
                )
            if layer not in mb.used:
                raise ReplayError(
                    f"layer {layer}: recompute of micro-batch {mb.key} before forward"
                )
            ids, valid = mb.used[layer], None
            mb.recompute_calls[layer] = mb.recompute_calls.get(layer, 0) + 1
        else:
            mb = self._open
            if mb is None:
                raise ReplayError(
                    f"layer {layer}: routed outside TraceReplay.micro_batch() (the router was "
                    "called without the model's forward)"
                )
            ids, valid = mb.ids[layer], mb.valid[layer]
            mb.forward_calls[layer] = mb.forward_calls.get(layer, 0) + 1

        config = router.config
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, config.num_moe_experts)
        if logits.shape[0] != mb.num_tokens:
            raise ReplayError(
                f"layer {layer}, micro-batch {mb.key}: the router sees {logits.shape[0]} tokens "
                f"({seq_length} x {bsz}), the trace has {mb.num_tokens} rows"
            )
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = router.apply_z_loss(logits, padding_mask=padding_mask)
        if ids.device != logits.device:
            ids = ids.to(logits.device, non_blocking=True)
            valid = None if valid is None else valid.to(logits.device, non_blocking=True)
        sigmoid = router.score_function == "sigmoid"
        if router.score_function not in ("softmax", "sigmoid"):
            raise ReplayError(f"layer {layer}: score function {router.score_function!r}")
        res = replay_topk(
            logits,
            ids,
            score_function=router.score_function,
            # softmax: pre-softmax = softmax over all experts, no renormalization;
            # sigmoid: Megatron always renormalizes the top-k (when k > 1).
            normalize=(router.topk > 1) if sigmoid else not config.moe_router_pre_softmax,
            expert_bias=router.expert_bias if sigmoid else None,
            scaling=float(config.moe_router_topk_scaling_factor or 1.0),
            valid=valid,
            min_score_ratio=None if in_backward else self.min_score_ratio,
        )
        used = res.expert_ids
        probs = torch.zeros_like(logits).scatter(1, used, res.weights.to(logits.dtype))
        routing_map = res.routing_map
        if not in_backward:
            mb.used[layer] = used.detach()
            counts = self._counts.get(layer)
            c = res.stats.counts
            self._counts[layer] = c.detach().clone() if counts is None else counts + c
        if self.record:
            self.history.append(("recompute" if in_backward else "forward", mb.key, layer, used))

        if router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled():
            # Load-balancing losses see the routing actually used (the replayed map).
            _, scores = compute_routing_scores_for_aux_loss(
                logits,
                router.topk,
                router.score_function,
                fused=config.moe_router_fusion,
                padding_mask=padding_mask,
            )
            masked = padding_mask is not None
            probs = router._apply_aux_loss(probs, scores, routing_map, with_padding_mask=masked)
            probs = router._apply_seq_aux_loss(
                probs, scores, routing_map, seq_length, bsz, with_padding_mask=masked
            )
            probs = router._apply_global_aux_loss(
                probs, scores, routing_map, with_padding_mask=masked
            )
        router._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map

    # -- results -------------------------------------------------------------------

    def stats(self) -> dict[int, Any]:
        """{layer: ReplayStats} summed over the forwards since the last :meth:`reset_stats`."""
        from compass_kernels.routing import ReplayStats

        return {layer: ReplayStats(c, self.top_k) for layer, c in sorted(self._counts.items())}

    def reset_stats(self) -> None:
        self._counts = {}

    def reset(self) -> None:
        """Drop every micro-batch's state (e.g. after a step whose backward never ran)."""
        self._pending.clear()
        self._backward = None
        self._counts = {}

    def pending(self) -> list[int]:
        """Keys of micro-batches whose forward ran and whose backward has not finished."""
        return sorted(self._pending)


def _on_backward(ref: Any, key: int) -> None:
    replay = ref()
    if replay is not None:
        replay._enter_backward(key)
