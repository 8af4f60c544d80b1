"""Router replay in real megatron-core on CPU (gloo, world size 1), tiny Qwen3-MoE weights.

Traces come from a transformers forward of the same weights (the rollout
engine's routing), from perturbed router weights, or are random expert sets
the native router would not pick.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from compass_kernels.integration.megatron import replay as mr  # noqa: E402
from compass_kernels.integration.megatron._pin import installed_version  # noqa: E402
from compass_kernels.integration.megatron.convert import build_megatron_model, load_hf_state_dict  # noqa: E402
from compass_kernels.routing import MissingReason, RoutingTrace  # noqa: E402

pytestmark = pytest.mark.integration

_E, _K, _LAYERS = 8, 2, [0, 1, 2]


@pytest.fixture(scope="module")
def model(megatron_cpu, hf_parts):
    cfg, _, sd = hf_parts
    return build_megatron_model(cfg, sd)


@pytest.fixture
def replay(model):
    r = mr.TraceReplay(model, record=True)
    yield r
    r.remove()


def _tokens(seq, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    return ids, torch.arange(seq).expand(batch, seq)


def _trace(ids, layers=_LAYERS, missing=None, reason=None, seqs=1):
    """RoutingTrace of ``ids`` [T, L, K] (int), ``seqs`` equal-length sequences."""
    t = ids.shape[0]
    cu = torch.arange(0, t + 1, t // seqs, dtype=torch.int64)
    return RoutingTrace(
        ids.to(torch.uint8),
        cu,
        _E,
        layer_ids=layers,
        missing=missing,
        missing_reason=reason,
    )


def _random_sets(t, layers, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [torch.stack([torch.randperm(_E, generator=g)[:_K] for _ in range(t)]) for _ in layers],
        dim=1,
    )


def _hf_trace_ids(hf_model, ids):
    """[B*S, layers, K] top-k ids of a transformers forward (batch-major rows)."""
    with torch.no_grad():
        out = hf_model(ids, output_router_logits=True)
    return torch.stack([torch.topk(lg, _K, dim=-1).indices for lg in out.router_logits], dim=1)


class _RouterSpy:
    """Per layer: the routing map each router returned, its logits and their gradient."""

    def __init__(self, model):
        self.maps, self.probs, self.logits, self.grads, self.handles = {}, {}, {}, {}, []
        for layer, router in mr.find_moe_routers(model).items():
            self.handles.append(router.register_forward_hook(self._hook(layer)))
            original = router.gating

            def gating(inp, _orig=original, _layer=layer):
                out = _orig(inp)
                if out.requires_grad:
                    self.logits[_layer] = out
                    out.register_hook(lambda g, _l=_layer: self.grads.__setitem__(_l, g))
                return out

            router.gating = gating
            self.handles.append((router, "gating"))

    def _hook(self, layer):
        def hook(module, args, output):
            self.probs[layer] = output[0].detach().clone()
            self.maps[layer] = output[1].detach().clone()

        return hook

    def remove(self):
        for h in self.handles:
            if isinstance(h, tuple):
                del h[0].gating
            else:
                h.remove()


def _as_map(ids):
    """[T, K] ids -> [T, E] bool."""
    return torch.zeros(ids.shape[0], _E, dtype=torch.bool).scatter_(1, ids.long(), True)


def test_patch_is_idempotent_reversible_and_version_checked(megatron_cpu, monkeypatch):
    import megatron.core
    from megatron.core.transformer.moe.router import TopKRouter

    version = installed_version()  # each supported release has its own pins
    was = mr.applied()
    try:
        mr.revert()
        original = TopKRouter.__dict__["routing"]
        assert mr.upstream_source_sha256() == mr.UPSTREAM_SOURCE_SHA256[version]
        assert mr.apply() is True and mr.apply() is False
        assert TopKRouter.__dict__["routing"] is not original
        assert mr.upstream_source_sha256() == mr.UPSTREAM_SOURCE_SHA256[version]  # upstream's
        assert mr.revert() is True and mr.revert() is False
        assert TopKRouter.__dict__["routing"] is original

        pinned = dict(mr.UPSTREAM_SOURCE_SHA256[version])
        monkeypatch.setitem(
            mr.UPSTREAM_SOURCE_SHA256, version, dict(pinned, **{"MoELayer.route": "0" * 64})
        )
        with pytest.raises(mr.ReplayError, match=r"\['MoELayer.route'\] are not the functions"):
            mr.apply()
        assert not mr.applied() and TopKRouter.__dict__["routing"] is original
        monkeypatch.undo()

        monkeypatch.setattr(megatron.core, "__version__", "0.16.9")
        with pytest.raises(mr.ReplayError, match=r"no upstream source hashes pinned.*0\.16\.9"):
            mr.apply()
        monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
        with pytest.raises(mr.ReplayError, match="0.17.0"):
            mr.apply()
        monkeypatch.undo()
    finally:
        if was:
            mr.apply()


def test_replay_forces_exactly_the_trace_experts(model, replay):
    ids, pos = _tokens(37, seed=1)
    trace_ids = _random_sets(37, _LAYERS, seed=2)
    spy = _RouterSpy(model)
    tokens_seen = {}
    handles = []
    for layer in mr.find_moe_routers(model):
        moe = model.decoder.layers[layer].mlp
        for e, expert in enumerate(moe.experts.local_experts):

            def count(mod, args, _k=(layer, e)):
                tokens_seen[_k] = tokens_seen.get(_k, 0) + args[0].shape[0]

            handles.append(expert.register_forward_pre_hook(count))
    try:
        with torch.no_grad(), replay.micro_batch(_trace(trace_ids)):
            model(ids, pos, attention_mask=None)
    finally:
        spy.remove()
        for h in handles:
            h.remove()
    for col, layer in enumerate(_LAYERS):
        assert torch.equal(spy.maps[layer], _as_map(trace_ids[:, col])), layer
        wanted = torch.bincount(trace_ids[:, col].reshape(-1), minlength=_E)
        got = torch.tensor([tokens_seen.get((layer, e), 0) for e in range(_E)])
        assert torch.equal(got, wanted), (layer, got, wanted)
    # Random sets disagree with the native router: agreement well below 1.
    for layer, st in replay.stats().items():
        d = st.as_dict()
        assert d["rows"] == 37 and d["fallback_rows"] == 0
        assert d["agreement"] < 0.6, (layer, d)


def test_gradients_reach_the_router_through_replayed_experts(model, replay):
    ids, pos = _tokens(29, seed=3)
    trace_ids = _random_sets(29, _LAYERS, seed=4)
    spy = _RouterSpy(model)
    model.train()
    model.zero_grad(set_to_none=True)
    try:
        with replay.micro_batch(_trace(trace_ids)):
            logits = model(ids, pos, attention_mask=None)
        logits.float().pow(2).mean().backward()
        for col, layer in enumerate(_LAYERS):
            grad = spy.grads[layer].reshape(-1, _E)
            chosen = _as_map(trace_ids[:, col])
            # top-k softmax: only the replayed experts' logits get gradient, each of them does.
            assert (grad[~chosen] == 0).all(), layer
            assert (grad[chosen] != 0).all(), layer
            router = mr.find_moe_routers(model)[layer]
            assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    finally:
        spy.remove()
        model.zero_grad(set_to_none=True)
        model.eval()


def test_agreement_is_one_for_the_same_weights_and_lower_otherwise(hf_parts, model, replay):
    _, hf_model, _ = hf_parts
    ids, pos = _tokens(48, seed=5, batch=2)
    same = _hf_trace_ids(hf_model, ids)  # batch-major rows
    with torch.no_grad():
        with replay.native():
            native = model(ids, pos, attention_mask=None)
        with replay.micro_batch(_trace(same, seqs=2), order="bsh"):
            replayed = model(ids, pos, attention_mask=None)
    for layer, st in replay.stats().items():
        d = st.as_dict()
        assert d["agreement"] == 1.0 and d["exact_match"] == 1.0 and d["rows"] == 96, layer
    # Replaying the model's own routing changes nothing.
    # (float32 rounding of the kernel's softmax vs torch's, through three layers)
    assert (replayed - native).abs().max() <= 1e-5

    drifted = copy.deepcopy(hf_model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(6)
        for layer in drifted.model.layers:
            w = layer.mlp.gate.weight
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=g))
    other = _hf_trace_ids(drifted, ids)
    replay.reset_stats()
    with torch.no_grad(), replay.micro_batch(_trace(other, seqs=2), order="bsh"):
        changed = model(ids, pos, attention_mask=None)
    agreements = [st.as_dict()["agreement"] for st in replay.stats().values()]
    assert all(0.3 < a < 1.0 for a in agreements), agreements
    assert (changed - native).abs().max() > 1e-3


def test_activation_recompute_replays_the_same_ids_under_interleaving(megatron_cpu, hf_parts):
    cfg, _, sd = hf_parts
    model = build_megatron_model(
        cfg, sd, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ).train()
    replay = mr.TraceReplay(model, record=True)
    try:
        batches = [_tokens(21, seed=7 + i) for i in range(2)]
        traces = [_trace(_random_sets(21, _LAYERS, seed=9 + i)) for i in range(2)]
        outs = []
        for (ids, pos), trace in zip(batches, traces, strict=True):  # 1F1B-like: F0 F1 B0 B1
            with replay.micro_batch(trace):
                outs.append(model(ids, pos, attention_mask=None))
        assert replay.pending() == [0, 1]
        outs[0].float().pow(2).mean().backward()
        outs[1].float().pow(2).mean().backward()
        fwd = {(mb, layer): ids for phase, mb, layer, ids in replay.history if phase == "forward"}
        rec = [(mb, layer, ids) for phase, mb, layer, ids in replay.history if phase != "forward"]
        assert sorted((mb, layer) for mb, layer, _ in rec) == sorted(fwd)  # each layer, once
        assert [mb for mb, _, _ in rec] == [0] * 3 + [1] * 3  # in backward order
        for mb, layer, ids in rec:
            assert torch.equal(ids, fwd[(mb, layer)]), (mb, layer)
            assert torch.equal(_as_map(ids), _as_map(traces[mb].expert_ids[:, layer]))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}
        assert all(g.abs().sum() > 0 for g in grads.values())

        # Same micro-batches without recompute: identical router gradients.
        plain = build_megatron_model(cfg, sd).train()
        plain_replay = mr.TraceReplay(plain)
        for (ids, pos), trace in zip(batches, traces, strict=True):
            with plain_replay.micro_batch(trace):
                plain(ids, pos, attention_mask=None).float().pow(2).mean().backward()
        for n, p in plain.named_parameters():
            if n in grads:
                assert torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-7), n
        plain_replay.remove()
    finally:
        replay.remove()


def test_missing_rows_fall_back_to_native_routing(hf_parts, model, replay):
    _, hf_model, _ = hf_parts
    ids, pos = _tokens(30, seed=11)
    trace_ids = _random_sets(30, _LAYERS, seed=12)
    native = _hf_trace_ids(hf_model, ids)
    missing = torch.zeros(30, dtype=torch.bool)
    missing[:10] = True  # e.g. a prefix-cache hit
    reason = torch.where(missing, int(MissingReason.PREFIX_CACHE), 0).to(torch.uint8)
    spy = _RouterSpy(model)
    try:
        with torch.no_grad(), replay.micro_batch(_trace(trace_ids, missing=missing, reason=reason)):
            model(ids, pos, attention_mask=None)
    finally:
        spy.remove()
    for col, layer in enumerate(_LAYERS):
        assert torch.equal(spy.maps[layer][:10], _as_map(native[:10, col]))
        assert torch.equal(spy.maps[layer][10:], _as_map(trace_ids[10:, col]))
        assert replay.stats()[layer].as_dict()["fallback_rows"] == 10


def test_dense_first_layer_keys_layers_by_global_number(megatron_cpu, hf_parts):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from compass_kernels.integration.megatron.convert import megatron_config_from_hf

    cfg, _, _ = hf_parts
    config = megatron_config_from_hf(cfg, moe_layer_freq=[0, 1, 1])
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=1024,
        max_sequence_length=256,
        position_embedding_type="rope",
    ).eval()
    replay = mr.TraceReplay(model)
    try:
        assert replay.layers == [1, 2]
        assert sorted(mr.find_moe_routers(model)) == [1, 2]
        ids, pos = _tokens(19, seed=13)
        wrong = _trace(_random_sets(19, [0, 1], seed=14), layers=[0, 1])
        with pytest.raises(mr.ReplayError, match=r"layer_ids \[0, 1\] != .* \[1, 2\]"):
            with replay.micro_batch(wrong):
                pass
        trace_ids = _random_sets(19, [1, 2], seed=15)
        spy = _RouterSpy(model)
        try:
            with torch.no_grad(), replay.micro_batch(_trace(trace_ids, layers=[1, 2])):
                model(ids, pos, attention_mask=None)
        finally:
            spy.remove()
        assert sorted(spy.maps) == [1, 2]
        assert torch.equal(spy.maps[1], _as_map(trace_ids[:, 0]))  # column 0 = layer 1
        assert torch.equal(spy.maps[2], _as_map(trace_ids[:, 1]))
    finally:
        replay.remove()


def test_refuses_configs_that_bypass_or_alter_replay(model):
    config = model.config
    for name, value in (
        ("moe_expert_capacity_factor", 1.0),
        ("moe_router_load_balancing_type", "sinkhorn"),
        ("moe_router_force_load_balancing", True),
        ("moe_router_padding_for_quantization", True),
        ("cuda_graph_impl", "local"),
        ("moe_enable_routing_replay", True),
    ):
        old = getattr(config, name)
        setattr(config, name, value)
        try:
            with pytest.raises(mr.ReplayError, match=f"replay refuses .*{name}"):
                mr.TraceReplay(model)
        finally:
            setattr(config, name, old)

    from megatron.core.transformer.moe.router import TopKRouter

    class CustomRouter(TopKRouter):
        def routing(self, logits, padding_mask=None):
            return super().routing(logits, padding_mask)

    router = model.decoder.layers[1].mlp.router
    router.__class__ = CustomRouter
    try:
        with pytest.raises(mr.ReplayError, match="layer 1: CustomRouter overrides routing"):
            mr.TraceReplay(model)
    finally:
        router.__class__ = TopKRouter


def test_fused_router_flag_does_not_bypass_replay(model, replay):
    """Megatron's moe_router_fusion skips its own RouterReplay; ours replaces the whole
    routing function, so the trace is still replayed (no TE needed on this path)."""
    ids, pos = _tokens(17, seed=16)
    trace_ids = _random_sets(17, _LAYERS, seed=17)
    model.config.moe_router_fusion = True
    spy = _RouterSpy(model)
    try:
        with torch.no_grad(), replay.micro_batch(_trace(trace_ids)):
            model(ids, pos, attention_mask=None)
    finally:
        spy.remove()
        model.config.moe_router_fusion = False
    for col, layer in enumerate(_LAYERS):
        assert torch.equal(spy.maps[layer], _as_map(trace_ids[:, col]))


def test_every_forward_checks_every_layer_consumed_its_rows(model, replay):
    ids, pos = _tokens(13, seed=18)
    trace = _trace(_random_sets(13, _LAYERS, seed=19))
    with pytest.raises(mr.ReplayError, match="outside TraceReplay.micro_batch"):
        with torch.no_grad():
            model(ids, pos, attention_mask=None)

    # A layer whose MoE block is skipped (as an orphan router would be) is caught.
    moe = model.decoder.layers[2].mlp
    moe.forward = lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None)
    try:
        with pytest.raises(mr.ReplayError, match=r"MoE layers \[2\] did not consume"):
            with torch.no_grad(), replay.micro_batch(trace):
                model(ids, pos, attention_mask=None)
    finally:
        del moe.forward

    # Too few rows for the tokens the routers see.
    short = _trace(_random_sets(12, _LAYERS, seed=20))
    with pytest.raises(mr.ReplayError, match="sees 13 tokens .* trace has 12 rows"):
        with torch.no_grad(), replay.micro_batch(short):
            model(ids, pos, attention_mask=None)
    with pytest.raises(mr.ReplayError, match="no forward of the model ran"):
        with replay.micro_batch(trace):
            pass


def test_rebuilt_router_is_rebound_at_the_next_micro_batch(model, replay):
    from megatron.core.transformer.moe.router import TopKRouter

    layer = model.decoder.layers[0].mlp
    old = layer.router
    from types import SimpleNamespace

    groups = SimpleNamespace(
        tp=old.tp_group, cp=old.cp_group, tp_cp=old.tp_cp_group, tp_dp_cp=old.tp_dp_cp_group
    )
    fresh = TopKRouter(config=model.config, pg_collection=groups)
    fresh.set_layer_number(old.layer_number)
    fresh.load_state_dict(old.state_dict())
    layer.router = fresh  # e.g. a rebuilt decoder: the bound router is now an orphan
    try:
        ids, pos = _tokens(11, seed=21)
        trace_ids = _random_sets(11, _LAYERS, seed=22)
        spy = _RouterSpy(model)
        try:
            with torch.no_grad(), replay.micro_batch(_trace(trace_ids)):
                model(ids, pos, attention_mask=None)
        finally:
            spy.remove()
        assert torch.equal(spy.maps[0], _as_map(trace_ids[:, 0]))
    finally:
        layer.router = old


def test_bad_traces_are_rejected_before_replay(model, replay):
    from compass_kernels.routing import TraceError

    ids, pos = _tokens(9, seed=23)
    dup = _random_sets(9, _LAYERS, seed=24)
    dup[4, 1] = torch.tensor([3, 3])  # the same expert twice in one row of layer 1
    with pytest.raises(TraceError, match="layer 1"):
        with torch.no_grad(), replay.micro_batch(_trace(dup)):
            model(ids, pos, attention_mask=None)
    wide = RoutingTrace(
        _random_sets(9, _LAYERS, seed=25).to(torch.int16),
        torch.tensor([0, 9]),
        300,
        layer_ids=_LAYERS,
    )
    with pytest.raises(TraceError, match="num_experts: the model has 8 experts, the trace 300"):
        with torch.no_grad(), replay.micro_batch(wide):
            model(ids, pos, attention_mask=None)
    with pytest.raises(TypeError, match="RoutingTrace"):
        with replay.micro_batch(dup):
            pass
    assert replay.pending() == []


def test_mtp_layers_are_not_replayed_from_decoder_rows(megatron_cpu, hf_parts):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    from compass_kernels.integration.megatron.convert import megatron_config_from_hf

    cfg, _, _ = hf_parts
    config = megatron_config_from_hf(cfg, mtp_num_layers=1)
    spec = get_gpt_layer_local_spec(
        num_experts=_E, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=1024,
        max_sequence_length=256,
        position_embedding_type="rope",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    ).eval()

    v016 = installed_version().startswith("0.16.")
    # the MTP layer's decoder layer: transformer_layer (0.16), mtp_model_layer (0.19)
    mtp_layer = model.mtp.layers[0]
    mtp_router = (mtp_layer.transformer_layer if v016 else mtp_layer.mtp_model_layer).mlp.router
    # 0.16 numbers it right after the decoder (an i+offset map would hit it), 0.19 from 1
    # within the MTP block (the number of decoder layer 0): keyed by number, either collides
    assert mtp_router.layer_number == (4 if v016 else 1)
    replay = mr.TraceReplay(model)
    try:
        assert replay.layers == [0, 1, 2]
        assert mr._BINDINGS.get(mtp_router) is None
        ids, _ = _tokens(10, seed=26)
        pos = torch.arange(10).unsqueeze(0)
        with torch.no_grad(), replay.micro_batch(_trace(_random_sets(10, _LAYERS, seed=27))):
            model(ids, pos, attention_mask=None, labels=ids)  # the MTP router routes natively
        assert sorted(replay.stats()) == _LAYERS
        with pytest.raises(mr.ReplayError, match=r"layer_ids \[0, 1, 2, 3\]"):
            with replay.micro_batch(_trace(_random_sets(10, [0, 1, 2, 3], seed=28), [0, 1, 2, 3])):
                pass
    finally:
        replay.remove()


def _pipeline_stage(rank, world_size, path):
    """One stage of a 2-stage, 4-layer pipeline (run in a spawned gloo process)."""
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from transformers import AutoConfig

    from compass_kernels.integration.megatron.convert import megatron_config_from_hf

    config = megatron_config_from_hf(
        AutoConfig.from_pretrained(path),
        num_layers=4,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=_E, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    torch.manual_seed(0)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=1024,
        max_sequence_length=256,
        position_embedding_type="rope",
        pre_process=rank == 0,
        post_process=rank == 1,
    ).train()
    replay = mr.TraceReplay(model, record=True)
    seq = 12
    full = _random_sets(seq, range(4), seed=29)  # the whole model's trace, on both ranks
    # seq tokens, seq - 1 rows (the last token is never an engine input: NO_ROW, native)
    rows = seq - 1
    trace = RoutingTrace(
        full[:rows].to(torch.uint8), torch.tensor([0, rows]), _E, layer_ids=range(4)
    )
    local = trace.slice(layers=replay.layers, token_lens=[seq])  # this stage's columns only
    ids, pos = _tokens(seq, seed=30)
    if rank == 0:
        with replay.micro_batch(local):
            hidden = model(ids, pos, attention_mask=None)
        dist.send(hidden.detach().contiguous(), 1)
        grad = torch.empty_like(hidden)
        dist.recv(grad, 1)
        hidden.backward(grad)
    else:
        hidden = torch.empty(seq, 1, config.hidden_size)
        dist.recv(hidden, 0)
        hidden.requires_grad_(True)
        model.set_input_tensor(hidden)
        with replay.micro_batch(local):
            out = model(ids, pos, attention_mask=None)
        out.float().pow(2).mean().backward()
        dist.send(hidden.grad.contiguous(), 0)
    forced = all(
        torch.equal(_as_map(used[:rows]), _as_map(full[:rows, layer]))
        for phase, _, layer, used in replay.history
    )
    router_grads = [float(p.grad.abs().sum()) for n, p in model.named_parameters() if "router" in n]
    return replay.layers, [int(x) for x in local.layer_ids], forced, router_grads


def test_two_stage_pipeline_keys_layers_by_global_number(tiny_moe_path):
    results = mr_run_distributed(_pipeline_stage, (str(tiny_moe_path),))
    (layers0, cols0, forced0, grads0), (layers1, cols1, forced1, grads1) = results
    assert (layers0, cols0) == ([0, 1], [0, 1]) and (layers1, cols1) == ([2, 3], [2, 3])
    assert forced0 and forced1
    assert len(grads0) == len(grads1) == 2 and all(g > 0 for g in grads0 + grads1)


def mr_run_distributed(fn, args):
    from compass_kernels.integration.cpu import megatron as shim

    return shim.run_distributed(
        fn, 2, args=args, megatron={"pipeline_model_parallel_size": 2}, timeout=280
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # Qwen3: softmax over the top-k logits
        {"moe_router_pre_softmax": True},  # softmax over all experts, no renormalization
        {"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5},
    ],
    ids=["softmax-topk", "softmax-pre", "sigmoid-scaled"],
)
def test_replayed_gating_equals_upstream_for_its_own_routing(megatron_cpu, hf_parts, overrides):
    """Replaying the native routing reproduces upstream's probs for each gating config
    (the config -> replay_topk option mapping is right)."""
    cfg, _, sd = hf_parts
    model = build_megatron_model(cfg, sd, **overrides)
    replay = mr.TraceReplay(model)
    ids, pos = _tokens(23, seed=31)
    spy = _RouterSpy(model)
    try:
        with torch.no_grad():
            with replay.native():
                model(ids, pos, attention_mask=None)
            native_probs = dict(spy.probs)
            native = torch.stack(
                [spy.maps[layer].nonzero()[:, 1].view(-1, _K) for layer in _LAYERS], dim=1
            )
            with replay.micro_batch(_trace(native)):
                model(ids, pos, attention_mask=None)
    finally:
        spy.remove()
        replay.remove()
    for layer in _LAYERS:
        assert torch.allclose(spy.probs[layer], native_probs[layer], atol=1e-6, rtol=0), layer
        assert replay.stats()[layer].as_dict()["exact_match"] == 1.0


def test_group_limited_routing_refuses_native_fallback(model, replay):
    ids, pos = _tokens(8, seed=32)
    missing = torch.zeros(8, dtype=torch.bool)
    missing[0] = True
    reason = torch.where(missing, int(MissingReason.PREFIX_CACHE), 0).to(torch.uint8)
    trace = _trace(_random_sets(8, _LAYERS, seed=33), missing=missing, reason=reason)
    config = model.config
    old = (config.moe_router_num_groups, config.moe_router_group_topk)
    config.moe_router_num_groups, config.moe_router_group_topk = 4, 2
    try:
        with pytest.raises(mr.ReplayError, match="group-limited routing"):
            with replay.micro_batch(trace):
                pass
        full = _trace(_random_sets(8, _LAYERS, seed=34))  # no missing row: replayed as is
        with torch.no_grad(), replay.micro_batch(full):
            model(ids, pos, attention_mask=None)
    finally:
        config.moe_router_num_groups, config.moe_router_group_topk = old


def _megatron_cp_split(batch: dict) -> dict:
    """Megatron's own zigzag split of a [1, seq] batch over the CP group. 0.19 adds the
    per-document split (TE's, when ``cu_seqlens`` is given) and a hybrid-CP switch:
    ``cu_seqlens=None`` selects the whole-sequence zigzag that 0.16 always does."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if installed_version().startswith("0.16."):
        return get_batch_on_this_cp_rank(batch)
    return get_batch_on_this_cp_rank(dict(batch, cu_seqlens=None), is_hybrid_cp=False)


def _cp_rank(rank, world_size, path):
    """One rank of a cp=2 group (spawned gloo process): Megatron's own zigzag
    split of the batch (get_batch_on_this_cp_rank) and the trace's zigzag slice
    for this rank must line up token for token, and replay must force exactly
    those rows. Attention and RoPE run over the local tokens (the model's config
    keeps cp=1: CP attention needs Transformer Engine, and upstream's RoPE
    slicing pins memory); replay only touches the per-token MoE routers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from transformers import AutoConfig

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        return pos_emb  # the config says cp=1: RoPE over the local tokens, like attention

    rope.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank  # a spawned process: no undo
    cp_rank = ps.get_context_parallel_rank()
    assert ps.get_context_parallel_world_size() == 2
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = build_megatron_model(cfg, load_hf_state_dict(path))
    seq = 16
    full = _random_sets(seq, _LAYERS, seed=31)  # the rollout's routing of the 16 tokens
    # rows for the 15 input tokens; the last token's (position 15) is NO_ROW, native
    trace = RoutingTrace(
        full[: seq - 1].to(torch.uint8), torch.tensor([0, seq - 1]), _E, layer_ids=_LAYERS
    )
    ids, pos = _tokens(seq, seed=32)
    batch = _megatron_cp_split({"tokens": ids.clone(), "position_ids": pos.clone()})
    mine = batch["position_ids"][0]  # the global token positions Megatron gave this rank
    cut = dict(token_lens=[seq], pad_multiple=4, cp_size=2, cp_rank=cp_rank)
    local = trace.slice(**cut, cp_layout="zigzag")
    wrong = trace.slice(**cut, cp_layout="contiguous")
    replay = mr.TraceReplay(model, record=True)
    try:
        with torch.no_grad(), replay.micro_batch(local):
            model(batch["tokens"], batch["position_ids"], attention_mask=None)
        keep = mine < seq - 1  # tokens with a row
        forced = [
            torch.equal(_as_map(used[keep]), _as_map(full[mine[keep], layer]))
            for _, _, layer, used in replay.history
        ]
    finally:
        replay.remove()
    want = full[mine[keep]].to(torch.uint8)
    return (
        cp_rank,
        mine.tolist(),
        local.num_tokens,
        forced,
        torch.equal(local.expert_ids[keep], want),
        torch.equal(wrong.expert_ids[keep], want),
    )


def test_context_parallel_ranks_replay_exactly_their_zigzag_slice(tiny_moe_path):
    from compass_kernels.integration.cpu import megatron as shim

    results = shim.run_distributed(
        _cp_rank,
        2,
        args=(str(tiny_moe_path),),
        megatron={"context_parallel_size": 2},
        timeout=280,
    )
    by_rank = {r[0]: r for r in results}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[0][1] == [0, 1, 2, 3, 12, 13, 14, 15]  # chunks 0 and 3 of 4
    assert by_rank[1][1] == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2
    for _, _, n_local, forced, zigzag_ok, contiguous_ok in results:
        assert n_local == 8
        assert len(forced) == len(_LAYERS) and all(forced)  # every MoE layer, its rows
        assert zigzag_ok and not contiguous_ok  # the two layouts are not mixed up
