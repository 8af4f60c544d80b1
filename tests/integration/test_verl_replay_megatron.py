"""verl's routed_experts replayed by compass in real megatron-core on CPU
(gloo, world size 1, the tiny Qwen3-MoE): the routers use exactly the rollout's
experts; verl's own replay patch and compass's cannot both be on."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/setup_env.sh)")

from compass_kernels.integration.megatron import replay as mr  # noqa: E402
from compass_kernels.integration.megatron.convert import build_megatron_model, load_hf_state_dict  # noqa: E402
from compass_kernels.integration.verl import replay as rp  # noqa: E402

pytestmark = pytest.mark.integration

_E, _K, _LAYERS = 8, 2, [0, 1, 2]


@pytest.fixture(scope="module")
def model(megatron_cpu, tiny_moe_path):
    from transformers import AutoConfig

    return build_megatron_model(
        AutoConfig.from_pretrained(tiny_moe_path), load_hf_state_dict(tiny_moe_path)
    )


def test_verl_routes_are_replayed_exactly(model):
    g = torch.Generator().manual_seed(0)
    S = 23
    attn = torch.ones(1, S, dtype=torch.long)
    routes = torch.stack(
        [torch.stack([torch.randperm(_E, generator=g)[:_K] for _ in _LAYERS]) for _ in range(S)]
    )[None]  # [1, S, layers, K], as verl holds a rollout's routed_experts
    trace = rp.routed_experts_to_trace(routes, attn, num_experts=_E, moe_layer_ids=_LAYERS)
    local = rp.micro_batch_trace(trace, layers=_LAYERS)
    maps, handles = {}, []
    for layer, router in mr.find_moe_routers(model).items():
        handles.append(
            router.register_forward_hook(
                lambda m, a, out, _l=layer: maps.__setitem__(_l, out[1].clone())
            )
        )
    replay = mr.TraceReplay(model)
    try:
        ids = torch.randint(0, 1000, (1, S), generator=g)
        with torch.no_grad(), replay.micro_batch(local):
            model(ids, torch.arange(S)[None], attention_mask=None)
        stats = {layer: st.as_dict() for layer, st in replay.stats().items()}
    finally:
        replay.remove()
        for h in handles:
            h.remove()
    for col, layer in enumerate(_LAYERS):
        want = torch.zeros(S, _E, dtype=torch.bool).scatter_(1, routes[0, :, col], True)
        assert torch.equal(maps[layer][:-1], want[:-1]), layer  # the last row routes natively
        assert stats[layer]["fallback_rows"] == 1


def test_verl_router_replay_patch_and_compass_refuse_each_other(model):
    """Both replace TopKRouter.routing: whichever comes second, compass refuses."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    mr.revert()
    saved = {
        k: TopKRouter.__dict__.get(k) for k in ("routing", "__init__", "_router_replay_patched")
    }
    saved_cfg = TransformerConfig.__init__

    def restore():
        for k, v in saved.items():
            if v is None:
                if k in TopKRouter.__dict__:
                    delattr(TopKRouter, k)
            else:
                setattr(TopKRouter, k, v)
        TransformerConfig.__init__ = saved_cfg
        if "_verl_router_patched" in TransformerConfig.__dict__:
            del TransformerConfig._verl_router_patched

    try:
        apply_router_replay_patch()  # verl's R3 first: compass refuses a changed routing
        with pytest.raises(mr.ReplayError, match="routing"):
            mr.TraceReplay(model)
        restore()
        mr.apply()  # compass first, verl's patch after: the next bind refuses
        apply_router_replay_patch()
        with pytest.raises(mr.ReplayError, match="routing"):
            mr.TraceReplay(model)
        with pytest.raises(mr.ReplayError, match="replaced by someone else"):
            mr.revert()
    finally:
        if mr.applied():
            TopKRouter.routing = mr._replay_routing  # take verl's patch off ours, then revert ours
            mr.revert()
        restore()
