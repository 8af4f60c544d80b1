"""vLLM 0.33 / 0.34's routed-experts outputs converted by the "vllm" capture path, and
the engine configuration that turns that capture on (no vLLM needed: the outputs are
built the way those releases' code builds them, its source pinned by hash)."""

from __future__ import annotations

import base64
import io
import types

import numpy as np
import pytest
import torch

from compass_kernels.integration.megatron._pin import text_sha256
from compass_kernels.integration.vllm import _pin
from compass_kernels.integration.vllm import capture as rc
from compass_kernels.routing import MissingReason

# vllm/utils/serial_utils.py::numpy2base64, verbatim (the same in 0.32, 0.33 and 0.34:
# the test below checks it against the pins); it encodes OpenAI-style responses'
# routed_experts.
NUMPY2BASE64 = '''def numpy2base64(array: np.ndarray) -> str:
    """Encode a NumPy array using its `.npy` representation."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return pybase64.b64encode(buffer.getbuffer()).decode("ascii")'''


def _vllm_numpy2base64():
    ns = {"np": np, "io": io, "pybase64": base64}  # pybase64 is a faster drop-in of base64
    exec(NUMPY2BASE64, ns)
    return ns["numpy2base64"]


def test_numpy2base64_is_the_pinned_source():
    for version in ("0.32.0", "0.33.0", "0.34.0"):
        assert _pin.PINS[version]["numpy2base64"] == text_sha256(NUMPY2BASE64)


def _vllm_dtype(num_experts: int) -> np.dtype:
    # RoutedExpertsCapturer.__init__ (0.32 - 0.34): "uint8" if num_experts <= 256 else "uint16"
    return np.dtype("uint8" if num_experts <= 256 else "uint16")


def _engine_rows(rng, n, num_layers, moe_layers, top_k, num_experts, dtype, chunks=3):
    """What vLLM hands over: rows [n, all hidden layers, top_k] (dense layers' rows never
    written: zeros), from per-step chunks concatenated at finish
    (RequestState._new_completion_output), and the reference MoE-layer ids."""
    ref = (
        np.stack(
            [np.stack([rng.permutation(num_experts)[:top_k] for _ in moe_layers]) for _ in range(n)]
        )
        if n
        else np.zeros((0, len(moe_layers), top_k), dtype=np.int64)
    )
    full = np.zeros((n, num_layers, top_k), dtype=dtype)
    full[:, moe_layers, :] = ref.astype(dtype)
    cuts = (
        sorted(
            rng.choice(
                np.arange(1, max(n, 2)), size=min(chunks, max(n - 1, 0)), replace=False
            ).tolist()
        )
        if n > 1
        else []
    )
    parts = np.split(full, cuts)
    return np.concatenate(parts, axis=0), ref


def _output(routed, num_prompt, num_out, request_id="r0"):
    comp = types.SimpleNamespace(index=0, token_ids=list(range(num_out)), routed_experts=routed)
    return types.SimpleNamespace(
        request_id=request_id,
        finished=True,
        prompt_token_ids=list(range(num_prompt)),
        outputs=[comp],
    )


def _capture(layers, top_k, num_experts, prompt_start=0):
    cap = rc.RoutingCapture(
        None, "vllm", {"layers": layers, "top_k": top_k, "num_experts": num_experts}
    )
    cap.prompt_start = prompt_start
    return cap


@pytest.mark.parametrize(
    "num_experts,dtype_name,encode",
    [
        (60, None, False),  # uint8: <= 256 experts
        (256, None, True),
        (300, None, False),  # uint16
        (513, None, True),
        (97, "int32", False),  # the device buffer's dtype (OpenAI protocol's third)
        (97, "int32", True),
    ],
)
def test_routed_experts_formats_convert_to_a_validated_trace(num_experts, dtype_name, encode):
    rng = np.random.default_rng(num_experts + 7 * encode)
    num_layers, moe_layers, top_k = 7, [1, 2, 4, 6], 3  # layers 0, 3, 5 dense
    num_prompt, num_out = 13, 6
    n = num_prompt + num_out - 1
    dtype = np.dtype(dtype_name) if dtype_name else _vllm_dtype(num_experts)
    routed, ref = _engine_rows(rng, n, num_layers, moe_layers, top_k, num_experts, dtype)
    value = _vllm_numpy2base64()(routed) if encode else routed
    if encode:
        assert isinstance(value, str)
    cap = _capture(moe_layers, top_k, num_experts)
    (trace,) = cap.collect([_output(value, num_prompt, num_out)])
    want_dtype = torch.uint8 if num_experts <= 256 else torch.int16
    assert trace.expert_ids.dtype == want_dtype
    assert trace.layer_ids.tolist() == moe_layers
    assert trace.num_missing == 0
    assert trace.token_lens == [num_prompt + num_out]
    torch.testing.assert_close(trace.expert_ids.to(torch.int64), torch.from_numpy(ref))
    # the public function (e.g. for a response's base64 field) gives the same trace
    again = rc.trace_from_routed_experts(
        value,
        layers=moe_layers,
        top_k=top_k,
        num_experts=num_experts,
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_out,
    )
    assert again == trace


def test_prompt_start_rows_are_missing_not_zeros():
    rng = np.random.default_rng(3)
    num_prompt, num_out, skip, num_experts = 11, 4, 5, 40
    n = num_prompt + num_out - 1
    routed, ref = _engine_rows(rng, n - skip, 4, [1, 3], 2, num_experts, np.dtype("uint8"))
    seq = rc.sequence_from_routed_experts(
        _vllm_numpy2base64()(routed),
        layers=[1, 3],
        top_k=2,
        num_experts=num_experts,
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_out,
        prompt_start=skip,
    )
    assert (seq.reason[:skip] == int(MissingReason.NOT_CAPTURED)).all()
    assert (seq.reason[skip:] == 0).all()
    np.testing.assert_array_equal(seq.expert_ids[skip:].astype(np.int64), ref)
    trace = seq.to_trace()
    assert trace.num_missing == skip * 2  # rows x MoE layers
    # a capture started with the same prompt_start reads the same rows
    (t2,) = _capture([1, 3], 2, num_experts, prompt_start=skip).collect(
        [_output(routed, num_prompt, num_out)]
    )
    assert t2 == trace


def test_bad_routed_experts_are_refused_naming_what_is_wrong():
    rng = np.random.default_rng(5)
    routed, _ = _engine_rows(rng, 9, 4, [1, 2], 2, 16, np.dtype("uint8"))
    kw = dict(layers=[1, 2], top_k=2, num_experts=16, num_prompt_tokens=6, num_output_tokens=4)
    rc.sequence_from_routed_experts(routed, **kw)  # the good one passes
    with pytest.raises(rc.CaptureError, match="shape"):
        rc.sequence_from_routed_experts(routed[:-1], **kw)  # a row short: not padded
    with pytest.raises(rc.CaptureError, match="shape"):
        rc.sequence_from_routed_experts(routed[:, :, :1], **kw)
    with pytest.raises(rc.CaptureError, match=r"dtype float32"):
        rc.sequence_from_routed_experts(routed.astype(np.float32), **kw)
    with pytest.raises(rc.CaptureError, match=r"\[rows, layers, top_k\]"):
        rc.sequence_from_routed_experts(routed[:, 0, :], **kw)
    bad = routed.copy()
    bad[4, 2, 1] = 16  # one id past the experts
    with pytest.raises(rc.CaptureError, match=r"outside \[0, 16\)"):
        rc.sequence_from_routed_experts(bad, **kw)
    neg = routed.astype(np.int32)
    neg[0, 1, 0] = -1
    with pytest.raises(rc.CaptureError, match=r"outside \[0, 16\)"):
        rc.sequence_from_routed_experts(neg, **kw)
    with pytest.raises(rc.CaptureError, match="layers"):
        rc.sequence_from_routed_experts(routed, **{**kw, "layers": [1, 4]})
    with pytest.raises(rc.CaptureError, match="base64"):
        rc.sequence_from_routed_experts("not base64 at all!", **kw)
    with pytest.raises(rc.CaptureError, match="base64"):
        rc.sequence_from_routed_experts(base64.b64encode(b"raw int32 bytes").decode(), **kw)
    with pytest.raises(rc.CaptureError, match="numpy array"):
        rc.sequence_from_routed_experts(routed.tolist(), **kw)
    with pytest.raises(rc.CaptureError, match="prompt_start"):
        rc.sequence_from_routed_experts(routed, **kw, prompt_start=7)
    with pytest.raises(rc.CaptureError, match="no routed_experts"):
        _capture([1, 2], 2, 16).collect([_output(None, 6, 4)])


def test_max_bytes_rule_fits_a_full_batch_in_vllms_store():
    # vLLM's store: object = one hash block's rows (block x layers x top_k x itemsize),
    # num_slots = max_bytes // object (BlockObjectStore); a full batch needs
    # max_num_seqs x ceil(max_model_len / block) objects.
    for layers, top_k, experts, seqs, length, block in [
        (48, 8, 128, 64, 4097, 16),
        (61, 8, 257, 7, 100, 32),
        (2, 1, 4, 1, 1, 16),
    ]:
        mb = rc.routed_experts_max_bytes(
            num_hidden_layers=layers,
            top_k=top_k,
            num_experts=experts,
            max_num_seqs=seqs,
            max_model_len=length,
            block_size=block,
        )
        obj = block * layers * top_k * (1 if experts <= 256 else 2)
        need = seqs * -(-length // block)
        assert mb // obj == need and mb % obj == 0
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_num_seqs"):
            rc.routed_experts_max_bytes(
                num_hidden_layers=2, top_k=1, num_experts=4, max_num_seqs=bad, max_model_len=8
            )


def _kwargs(**over):
    base = dict(
        num_hidden_layers=4,
        top_k=2,
        num_experts=300,
        max_num_seqs=8,
        max_model_len=1000,
        block_size=16,
    )
    base.update(over)
    return base


def test_engine_kwargs_use_the_aux_output_config_or_the_shorthand():
    kw = rc.routed_experts_engine_kwargs(**_kwargs(), aux_output_config=True, seed=3)
    mb = rc.routed_experts_max_bytes(**_kwargs())
    assert kw["aux_output_config"] == {"enable_return_routed_experts": True, "max_bytes": mb}
    assert kw["enable_prefix_caching"] is True and kw["seed"] == 3
    assert "enable_return_routed_experts" not in kw
    assert (kw["max_num_seqs"], kw["max_model_len"], kw["block_size"]) == (8, 1000, 16)
    short = rc.routed_experts_engine_kwargs(**_kwargs(), aux_output_config=False)
    assert short["enable_return_routed_experts"] is True and "aux_output_config" not in short
    explicit = rc.routed_experts_engine_kwargs(**_kwargs(), max_bytes=4096, aux_output_config=True)
    assert explicit["aux_output_config"]["max_bytes"] == 4096
    with pytest.raises(ValueError, match="max_bytes"):
        rc.routed_experts_engine_kwargs(**_kwargs(), max_bytes=0, aux_output_config=True)
    args = rc.routed_experts_cli_args(**_kwargs(), aux_output_config=True)
    assert args[0] == "--aux-output-config" and f'"max_bytes": {mb}' in args[1]
    assert args[-1] == "--enable-prefix-caching"
    assert rc.routed_experts_cli_args(**_kwargs(), aux_output_config=False)[0] == (
        "--enable-return-routed-experts"
    )


@pytest.mark.parametrize(
    "over,match",
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
        ({"prefill_context_parallel_size": 4}, "prefill_context_parallel_size=4"),
        ({"enable_prefix_caching": False}, "enable_prefix_caching=False"),
        (
            {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}},
            "NixlConnector",
        ),
        (
            {
                "kv_transfer_config": types.SimpleNamespace(
                    kv_connector="MultiConnector",
                    kv_connector_extra_config={
                        "connectors": [
                            {"kv_connector": "LMCacheConnectorV1"},
                            {"kv_connector": "MooncakeConnector"},
                        ]
                    },
                )
            },
            "MooncakeConnector",
        ),
    ],
)
def test_what_vllm_refuses_is_refused_before_the_engine_starts(over, match):
    with pytest.raises(ValueError, match=match):
        rc.routed_experts_engine_kwargs(**_kwargs(), aux_output_config=True, **over)


def test_allowed_configs_pass_and_mrv1_is_refused(monkeypatch):
    ok = {
        "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1"},
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 1,
    }
    rc.routed_experts_engine_kwargs(**_kwargs(), aux_output_config=True, **ok)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        rc.check_routed_experts_config({})


def test_refused_connectors_are_vllms_list():
    # the names in VllmConfig._verify_aux_output_compatibility (pinned, 0.32 - 0.34)
    assert rc.REFUSED_KV_CONNECTORS == (
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "MoRIIOConnector",
        "MooncakeConnector",
    )


def test_hook_path_on_vllm_034_is_refused_pointing_at_vllms_capture(monkeypatch):
    files = {"_version.py": "__version__ = version = '0.34.0'\n"}
    monkeypatch.setattr(_pin, "installed_sources", lambda: ("0.34.0", files.get))
    monkeypatch.setattr(_pin, "_CHECKED", {})
    monkeypatch.setattr(_pin, "_INSTALLED_HASHES", {})
    with pytest.raises(rc.CaptureError, match=r"found vLLM 0\.34\.0.*mode='vllm'"):
        rc._check_vllm_version()
