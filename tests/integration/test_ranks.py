"""The trainer on real ranks (``compass_kernels.integration.rl.ranks``): the
parallel layout does not change the step.

For a fixed batch (8 sequences, several micro-batches per rank) and seed, each
layout's forward log-probs, step-1 loss, global grad norm and updated weights
(gathered to HF names) equal the one-process step within 1e-4 relative
(float32). Each layout runs as real processes (gloo on 127.0.0.1) with
Megatron's parallel_state and its pipeline schedule. The two-process layouts
that together cover every mechanism (pp2: the 1F1B schedule and p2p; ep2 x
tp2: sequence parallelism, vocab-parallel ESPO, the expert all-to-all) run
always; every layout runs with COMPASS_TEST_RANKS=all (``make test-ranks``),
which CI's time budget leaves out (30-60 s each on 2 cores).

Also, without processes: each rank's share holds exactly its tokens (CP
zigzag as Megatron splits, every token once over the ranks) and fewer bytes
than a full broadcast.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from compass_kernels.integration.megatron_parallel import Layout, RankInfo  # noqa: E402

pytestmark = pytest.mark.integration

ALL = os.environ.get("COMPASS_TEST_RANKS", "") == "all"
ALWAYS = ("pp2", "ep2xtp2")
LAYOUTS = {
    "dp2": Layout(dp=2),
    "tp2": Layout(tp=2),
    "pp2": Layout(pp=2),
    "ep2": Layout(ep=2, dp=2),  # experts split over the two data-parallel ranks
    "cp2": Layout(cp=2),
    "tp2xdp2": Layout(tp=2, dp=2),
    "pp2xdp2": Layout(pp=2, dp=2),
    "ep2xtp2": Layout(ep=2, tp=2),  # experts split over the two tensor-parallel ranks
}
TOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoConfig

    from compass_kernels.integration.rl.layout_check import run_step, synthetic_batch
    from compass_kernels.integration.tiny_moe import cached_tiny_qwen3_moe

    path = cached_tiny_qwen3_moe(num_hidden_layers=4)  # 4 layers, 8 experts: every layout fits
    cfg = AutoConfig.from_pretrained(path)
    batch, adv = synthetic_batch(cfg, num_sequences=8, seed=3)
    ref = run_step(path, Layout(), batch, adv, max_tokens=64)
    return path, cfg, batch, adv, ref


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_step_equals_one_process(setup, name):
    if name not in ALWAYS and not ALL:
        pytest.skip("set COMPASS_TEST_RANKS=all (make test-ranks) to run every layout")
    from compass_kernels.integration.rl.layout_check import compare, run_step

    path, _, batch, adv, ref = setup
    got = run_step(path, LAYOUTS[name], batch, adv, old=(ref.logprobs, ref.entropy),
                   max_tokens=64)  # fmt: skip
    d = compare(ref, got)
    assert d["loss_rel"] < TOL and d["grad_norm_rel"] < TOL, d
    assert d["logprobs_max_abs"] < 1e-4, d
    assert d["weights_rel"] < TOL, d
    assert set(got.weights) == set(ref.weights)
    # the step moved the weights: the comparison is not of two untouched models
    moved = max(float((ref.weights[k] - got.weights[k]).abs().max()) for k in ref.weights)
    assert ref.loss != 0.0 and ref.grad_norm > 0 and moved < 1e-3
    # replay statistics summed over ranks equal one process's (padding rows excluded)
    for layer, st in ref.replay.items():
        assert got.replay[layer]["rows"] == st["rows"]
        assert got.replay[layer]["replayed_rows"] == st["replayed_rows"]
        assert abs(got.replay[layer]["agreement"] - st["agreement"]) < 1e-9
    assert len(got.bytes_per_rank) == LAYOUTS[name].world_size


def _infos(layout: Layout) -> list[RankInfo]:
    """Megatron's default rank order (tp fastest, then cp, dp, pp)."""
    out = []
    for r in range(layout.world_size):
        tp = r % layout.tp
        cp = (r // layout.tp) % layout.cp
        dp = (r // (layout.tp * layout.cp)) % layout.dp
        pp = r // (layout.tp * layout.cp * layout.dp)
        out.append(RankInfo(r, tp, pp, cp, dp, 0, 0, pp == 0, pp == layout.pp - 1))
    return out


@pytest.mark.parametrize("name", ["dp2", "cp2", "pp2xdp2", "tp2xdp2"])
def test_each_rank_receives_its_share_only(name):
    from transformers import AutoConfig

    import compass_kernels as ck
    from compass_kernels.integration.rl.layout_check import synthetic_batch
    from compass_kernels.integration.rl.ranks import (
        StepData,
        full_broadcast_bytes,
        local_tokens,
        make_shares,
        share_bytes,
    )
    from compass_kernels.integration.tiny_moe import cached_tiny_qwen3_moe

    layout = LAYOUTS[name]
    cfg = AutoConfig.from_pretrained(cached_tiny_qwen3_moe(num_hidden_layers=4))
    batch, adv = synthetic_batch(cfg, num_sequences=8, seed=4)
    plan = ck.packing.plan(batch.lengths, dp_size=layout.dp, max_tokens=64)
    data = StepData(batch, plan, torch.randn(batch.num_tokens), torch.rand(batch.num_tokens), adv)
    infos = _infos(layout)
    per_stage = 4 // layout.pp
    layers = [list(range(i.pp * per_stage, (i.pp + 1) * per_stage)) for i in infos]
    shares = make_shares(data, layout, infos, layers, what="train")
    seen = torch.zeros(batch.num_tokens, dtype=torch.int64)
    offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
    for info, mbs in zip(infos, shares, strict=True):
        for j, mb in enumerate(mbs):
            idx = plan.micro_batch(info.dp, j).numpy()
            assert mb.lengths.tolist() == batch.lengths[idx].tolist()
            assert (mb.tokens is not None) == info.first_stage
            assert (mb.advantages is not None) == info.last_stage
            assert [int(x) for x in mb.trace.layer_ids] == layers[info.rank]
            src, _, pos = local_tokens(batch.lengths[idx], layout.pad_multiple, layout.cp, info.cp)
            gidx = torch.from_numpy(np.concatenate([np.arange(offsets[i], offsets[i + 1])
                                                    for i in idx]))  # fmt: skip
            real = src >= 0
            if info.last_stage:
                assert torch.equal(mb.targets[real], batch.targets[gidx[src[real]]])
                assert torch.equal(mb.advantages[real], adv[gidx[src[real]]])
                assert not mb.mask[~real].any()
                if info.tp == 0:
                    seen[gidx[src[real]]] += 1
    assert torch.equal(seen, torch.ones_like(seen))  # every token on exactly one (dp, cp) rank
    sent = share_bytes(shares)
    full = full_broadcast_bytes(data, "train")
    if layout.tp == 1:
        assert max(sent) < full, (sent, full)


def test_cp_split_is_megatrons_zigzag():
    """local_tokens' CP split is the routing trace's zigzag slice, which the replay
    tests check against Megatron's get_batch_on_this_cp_rank."""
    from compass_kernels.integration.rl.ranks import local_tokens
    from compass_kernels.routing import RoutingTrace

    lengths = np.array([9, 17, 4], dtype=np.int64)
    rows = int((lengths - 1).sum())
    ids = torch.zeros(rows, 1, 2, dtype=torch.uint8)
    ids[:, 0, 1] = 1
    cu = torch.zeros(4, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.from_numpy(lengths - 1), 0)
    trace = RoutingTrace(ids, cu, 8)
    for r in range(2):
        src, seq, pos = local_tokens(lengths, 4, 2, r)
        want, kind, _ = trace.slice_plan(token_lens=lengths, pad_multiple=4, cp_size=2,
                                         cp_rank=r, cp_layout="zigzag")  # fmt: skip
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        rows_of = torch.where(src >= 0, src - torch.from_numpy(starts)[seq] + cu[seq], -1)
        has_row = (src >= 0) & (pos < torch.from_numpy(lengths - 1)[seq])
        assert torch.equal(torch.where(has_row, rows_of, -1), want)
