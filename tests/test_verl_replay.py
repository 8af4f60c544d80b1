"""verl's routed_experts -> RoutingTrace (validated, compact codec, per-rank
slice) and the MegatronEngine patch's contract (pinned, reversible, refuses
verl's own replay alongside). The replay itself in real megatron-core:
tests/integration/test_verl_replay_megatron.py."""

from __future__ import annotations

import pytest
import torch

from compass_kernels.integration.verl import replay as rp
from compass_kernels.routing import MissingReason, TraceError
from tests.verl_helpers import verl  # noqa: F401  (the verl import guard)

pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/setup_env.sh)")

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

pytestmark = pytest.mark.integration

E, K, LAYERS = 16, 3, [1, 3, 4]


def verl_routes(seed, B=5, P=6, R=7):
    """A rollout batch as verl holds it: left-padded prompts, right-padded
    responses, routed_experts [B, P+R, layers, K] int64 beside input_ids
    (distinct ids per row, zeros on padding and on each sequence's last token)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, P + 1, (B,), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        attn[i, P - p_len[i] : P + r_len[i]] = 1
    routes = torch.stack(
        [
            torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(len(LAYERS))])
            for _ in range(B * (P + R))
        ]
    ).view(B, P + R, len(LAYERS), K)
    routes[attn == 0] = 0
    last = P + r_len - 1
    routes[torch.arange(B), last] = 0  # the last token was never a rollout input
    return routes, attn


def test_routed_experts_to_trace():
    routes, attn = verl_routes(1)
    trace = rp.routed_experts_to_trace(routes, attn, num_experts=E, moe_layer_ids=LAYERS)
    lens = attn.sum(-1)
    # tokens - 1 rows per sequence (the row-count contract): the last token's row
    # (never a rollout input) is dropped, the token counts kept
    assert trace.seq_lens() == (lens - 1).tolist() and trace.token_lens == lens.tolist()
    assert trace.expert_ids.dtype == torch.uint8 and trace.layer_ids.tolist() == LAYERS
    keep = attn.bool().clone()
    keep[torch.arange(attn.shape[0]), attn.cumsum(-1).argmax(-1)] = False  # each last token
    assert torch.equal(trace.expert_ids.long(), routes[keep])
    assert trace.missing_reason is None or int((trace.missing_reason != 0).sum()) == 0
    # verl's nested layout (left_right_2_no_padding) gives the same trace
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    td = tu.get_tensordict(
        {
            "input_ids": torch.ones_like(attn),
            "attention_mask": attn,
            "position_ids": pos,
            "response_mask": attn[:, 6:],
            "routed_experts": routes,
        }
    )
    nested = left_right_2_no_padding(td)["routed_experts"]
    assert nested.is_nested
    assert rp.routed_experts_to_trace(nested, num_experts=E, moe_layer_ids=LAYERS) == trace


def test_placeholders_codec_and_errors():
    routes, attn = verl_routes(2)
    first = attn.argmax(-1)
    routes[0, first[0]] = 0  # a prompt row the engine did not return (zero fill)
    trace = rp.routed_experts_to_trace(routes, attn, num_experts=E, moe_layer_ids=LAYERS)
    assert int(trace.missing_reason[0]) == MissingReason.NOT_CAPTURED
    with pytest.raises(TraceError, match="sequence 0, token 0 repeats an expert"):
        rp.routed_experts_to_trace(
            routes, attn, num_experts=E, moe_layer_ids=LAYERS, placeholders="error"
        )
    bad = routes.clone()
    bad[1, first[1], 0, 0] = E
    with pytest.raises(TraceError, match=r"ids must be in \[0, 16\)"):
        rp.routed_experts_to_trace(bad, attn, num_experts=E)
    with pytest.raises(ValueError, match="attention_mask: expected"):
        rp.routed_experts_to_trace(routes, None, num_experts=E)
    blob = trace.encode()
    assert type(trace).decode(blob).canonical(sort=True) == trace.canonical(sort=True)
    assert len(blob) < routes[attn.bool()].to(torch.int32).numel() * 4 / 4  # >= 4x under int32


@pytest.mark.parametrize(("tp", "cp", "sp"), [(1, 1, False), (2, 2, True), (2, 1, True)])
def test_micro_batch_trace_follows_verl_thd_packing(tp, cp, sp):
    routes, attn = verl_routes(3, B=6)
    trace = rp.routed_experts_to_trace(routes, attn, num_experts=E, moe_layer_ids=LAYERS)
    align = tp * cp * 2 if cp > 1 else tp
    mb = [4, 1, 3]
    padded = sum(-(-trace.token_lens[i] // align) * align for i in mb)
    rows = []
    for cp_rank in range(cp):
        for tp_rank in range(tp if sp else 1):
            local = rp.micro_batch_trace(
                trace,
                sequences=mb,
                layers=[3, 4],
                tp_size=tp,
                cp_size=cp,
                cp_rank=cp_rank,
                sequence_parallel=sp,
                tp_rank=tp_rank,
            )
            assert local.layer_ids.tolist() == [3, 4]
            rows.append(local.num_tokens)
    assert sum(rows) == padded and len(set(rows)) == 1


def test_engine_patch_pinned_reversible_and_exclusive():
    from verl.workers.engine.megatron import transformer_impl as ti

    orig = ti.MegatronEngine.forward_step
    assert rp.patch_megatron_engine()
    try:
        assert not rp.patch_megatron_engine()
        assert ti.MegatronEngine.forward_step is not orig

        class Engine:  # verl's R3 switched on as well
            engine_config = type("C", (), {"router_replay": type("R", (), {"mode": "R3"})()})()

        with pytest.raises(rp.ReplayConflict, match="router_replay.mode='R3'"):
            ti.MegatronEngine.forward_step(Engine(), iter([]), None, None, None)
    finally:
        assert rp.revert_megatron_engine()
    assert ti.MegatronEngine.forward_step is orig
