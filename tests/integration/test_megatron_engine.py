"""megatron-core on CPU: the shim, the HF <-> Megatron converter, logits vs transformers,
forward + backward, and the two-process gloo launcher."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from compass_kernels.integration.cpu import megatron as shim  # noqa: E402
from compass_kernels.integration.megatron._pin import installed_version  # noqa: E402
from compass_kernels.integration.megatron.convert import (  # noqa: E402
    build_megatron_model,
    hf_to_megatron,
    megatron_to_hf,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mcore_model(megatron_cpu, hf_parts):
    cfg, _, sd = hf_parts
    return build_megatron_model(cfg, sd)


def _random_batch(vocab, batch=2, seq=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    return ids, pos


def _targets():
    """(owner, attr, original) of every patch target, read without going through the shim."""
    import importlib

    out = {}
    for p in shim.PATCHES:
        owner = importlib.import_module(p.module)
        if p.owner:
            owner = getattr(owner, p.owner)
        out[p.name] = (owner, p.attr)
    return out


def _current(owner, attr):
    return (
        owner.__dict__.get(attr, "<missing>")
        if isinstance(owner, type)
        else getattr(owner, attr, "<missing>")
    )


def test_shim_apply_and_revert_are_idempotent(monkeypatch):
    names = [p.name for p in shim.PATCHES]
    was_applied = shim.applied()
    targets = _targets()
    try:
        shim.revert()
        assert shim.applied() == []
        assert shim.revert() == []
        originals = {n: _current(*targets[n]) for n in names}
        # Upstream as shipped: without TE, te_general_gemm undefined (0.16) or None (0.19:
        # upstream now defines the fallback itself); CUDA calls in place.
        import megatron.core

        te_shipped = "<missing>" if installed_version().startswith("0.16.") else None
        assert originals["te_general_gemm"] == te_shipped
        assert "torch.cuda.current_device()" in __import__("inspect").getsource(
            originals["router_gating"]
        )

        assert shim.apply() == names
        assert shim.apply() == []
        assert shim.applied() == names
        for n in names:
            if n in ("alltoall_stream", "te_general_gemm"):
                continue  # values, not functions
            assert _current(*targets[n]) is not originals[n], n
        from megatron.core.transformer.moe import moe_utils

        assert moe_utils.te_general_gemm is None

        assert shim.revert() == list(reversed(names))
        assert shim.revert() == []
        for n in names:
            assert _current(*targets[n]) is originals[n], n
        assert _current(moe_utils, "te_general_gemm") == te_shipped

        with shim.patched():
            assert shim.applied() == names
        assert shim.applied() == []

        # A changed upstream function fails loudly and leaves everything untouched.
        changed = dataclasses.replace(shim.PATCHES[1], fingerprint=("a line upstream lacks",))
        monkeypatch.setattr(shim, "PATCHES", (shim.PATCHES[0], changed, *shim.PATCHES[2:]))
        with pytest.raises(shim.ShimError, match="rope_get_emb.*changed"):
            shim.apply()
        assert shim.applied() == []
        assert _current(*targets["router_gating"]) is originals["router_gating"]
        monkeypatch.undo()

        monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
        with pytest.raises(shim.ShimError, match="0.17.0"):
            shim.apply()
        monkeypatch.undo()
        # 0.19 appends the short hash of the git repository enclosing its install (a
        # venv inside a checkout): a local label, the release's pins still apply
        release = installed_version()
        monkeypatch.setattr(megatron.core, "__version__", f"{release}+f506257")
        assert shim.check_version() == release
        assert shim.apply() == names
        shim.revert()
        monkeypatch.undo()
    finally:
        shim.revert()
        if was_applied:
            shim.apply()


def test_shim_refuses_an_upstream_source_it_was_not_pinned_against(monkeypatch):
    import inspect

    import megatron.core
    from megatron.core.transformer.moe.router import Router

    was_applied = shim.applied()
    try:
        shim.revert()
        version = installed_version()
        pinned = shim.UPSTREAM_SOURCE_SHA256[version]
        assert shim.upstream_source_hashes() == pinned  # the installed version is pinned
        shim.apply()
        assert shim.upstream_source_hashes() == pinned  # hashes upstream's, not ours
        shim.revert()

        # One added line in Router.gating's source (as a new upstream release would).
        real_getsource = inspect.getsource
        original_gating = Router.__dict__["gating"]

        def getsource(obj):
            text = real_getsource(obj)
            return text + "        logits = logits * 1\n" if obj is original_gating else text

        monkeypatch.setattr(inspect, "getsource", getsource)
        with pytest.raises(shim.ShimError) as exc:
            shim.apply()
        msg = str(exc.value)
        assert msg.startswith("patch router_gating: upstream ")
        assert f"Router.gating in megatron-core {version} is not the function" in msg
        assert f"pinned {pinned['router_gating']}" in msg
        assert "source sha256 " in msg and "UPSTREAM_SOURCE_SHA256" in msg
        assert shim.applied() == [] and Router.__dict__["gating"] is original_gating
        monkeypatch.undo()

        # A 0.16.x release nobody reviewed: refused before anything is patched.
        monkeypatch.setattr(megatron.core, "__version__", "0.16.9")
        pins = re.escape(str(sorted(shim.UPSTREAM_SOURCE_SHA256)))
        with pytest.raises(
            shim.ShimError,
            match=r"no upstream source hashes pinned for "
            rf"megatron-core 0\.16\.9 \(pinned: {pins}\)",
        ):
            shim.apply()
        assert shim.applied() == []
        monkeypatch.undo()
    finally:
        shim.revert()
        if was_applied:
            shim.apply()


def test_single_process_init_is_idempotent(megatron_cpu):
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    state = tensor_parallel.get_cuda_rng_tracker().get_states()
    megatron_cpu.init_single_process_gloo(seed=123)  # already initialized: a no-op
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert parallel_state.model_parallel_is_initialized()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_expert_model_parallel_world_size() == 1
    after = tensor_parallel.get_cuda_rng_tracker().get_states()
    assert state.keys() == after.keys()
    assert all(torch.equal(state[k], after[k]) for k in state)  # not re-seeded
    assert "router_gating" in megatron_cpu.applied()


def test_converter_round_trip_is_exact(hf_parts, mcore_model):
    cfg, hf_model, sd = hf_parts
    mc = hf_to_megatron(sd, cfg)
    back = megatron_to_hf(mc, cfg)
    assert set(back) == set(sd)
    for key in sd:
        assert back[key].dtype == sd[key].dtype and torch.equal(back[key], sd[key]), key

    # The model's own state dict (with _extra_state entries) converts back exactly too.
    model_sd = mcore_model.state_dict()
    params = {k for k in model_sd if not k.endswith("_extra_state")}
    assert params == set(mc)
    from_model = megatron_to_hf(model_sd, cfg)
    assert all(torch.equal(from_model[k], sd[k]) for k in sd)

    # transformers' fused expert layout: same Megatron weights, and back.
    fused = {k: v for k, v in hf_model.state_dict().items() if "rotary" not in k}
    mc_fused = hf_to_megatron(fused, cfg)
    assert set(mc_fused) == set(mc) and all(torch.equal(mc_fused[k], mc[k]) for k in mc)
    back_fused = megatron_to_hf(mc_fused, cfg, fused_experts=True)
    assert set(back_fused) == set(fused)
    assert all(torch.equal(back_fused[k], fused[k]) for k in fused)


def test_converter_rejects_bad_weights(hf_parts):
    cfg, _, sd = hf_parts
    missing = dict(sd)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="hf_state_dict.*layers.1.self_attn.k_norm"):
        hf_to_megatron(missing, cfg)
    wrong = dict(sd)
    wrong["model.layers.0.mlp.gate.weight"] = torch.zeros(7, 128)
    with pytest.raises(ValueError, match=r"mlp.gate.weight.*\(7, 128\)"):
        hf_to_megatron(wrong, cfg)
    extra = dict(sd, **{"model.layers.0.surprise": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected keys"):
        hf_to_megatron(extra, cfg)


def test_logits_match_transformers(hf_parts, mcore_model):
    cfg, hf_model, _ = hf_parts
    ids, pos = _random_batch(cfg.vocab_size)
    with torch.no_grad():
        ours = mcore_model(ids, pos, attention_mask=None)
        ref = hf_model(ids).logits
    assert ours.shape == ref.shape == (2, 40, cfg.vocab_size)
    assert ours.dtype == torch.float32
    diff = (ours - ref).abs().max()
    assert diff <= 1e-5, float(diff)


def test_forward_backward_on_cpu(hf_parts, mcore_model):
    cfg, _, _ = hf_parts
    ids, pos = _random_batch(cfg.vocab_size, seq=64, seed=1)
    mcore_model.train()
    mcore_model.zero_grad(set_to_none=True)
    try:
        logits = mcore_model(ids, pos, attention_mask=None)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        assert torch.isfinite(loss)
        grads = {n: p.grad for n, p in mcore_model.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        for layer in range(cfg.num_hidden_layers):
            prefix = f"decoder.layers.{layer}.mlp."
            assert grads[prefix + "router.weight"].abs().sum() > 0, layer
            for e in range(cfg.num_experts):
                for fc in ("linear_fc1", "linear_fc2"):
                    g = grads[f"{prefix}experts.local_experts.{e}.{fc}.weight"]
                    assert g.abs().sum() > 0, (layer, e, fc)
    finally:
        mcore_model.zero_grad(set_to_none=True)
        mcore_model.eval()


def _all_reduce_worker(rank, world_size, base):
    """Runs in each spawned process: a world all-reduce and a tensor-parallel one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    t = torch.tensor([float(base + rank)])
    dist.all_reduce(t)
    tp = torch.tensor([float(rank + 1)])
    dist.all_reduce(tp, group=parallel_state.get_tensor_model_parallel_group())
    return {
        "rank": dist.get_rank(),
        "world": float(t.item()),
        "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "tp_sum": float(tp.item()),
    }


def test_two_process_launcher_all_reduce():
    results = shim.run_distributed(
        _all_reduce_worker,
        world_size=2,
        args=(10,),
        megatron={"tensor_model_parallel_size": 2},
        timeout=150,
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["world"] for r in results] == [21.0, 21.0]  # 10 + 11
    assert [r["tp_size"] for r in results] == [2, 2]
    assert [r["tp_rank"] for r in results] == [0, 1]
    assert [r["tp_sum"] for r in results] == [3.0, 3.0]


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        shim.run_distributed(_all_reduce_worker, world_size=0)
    with pytest.raises(TypeError, match="args"):
        shim.run_distributed(_all_reduce_worker, args=[1])
    with pytest.raises(TypeError, match="fn"):
        shim.run_distributed("not callable")
