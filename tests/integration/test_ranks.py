"""The trainer on real ranks (``compass_kernels.integration.rl.distributed_trainer``): the
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

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from compass_kernels.integration.megatron.parallel import Layout, layout_rank_infos  # noqa: E402

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

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe
    from compass_kernels.integration.rl.layout_check import run_step, synthetic_batch

    path = cached_tiny_qwen3_moe(num_hidden_layers=4)  # 4 layers, 8 experts: every layout fits
    cfg = AutoConfig.from_pretrained(path)
    batch, adv = synthetic_batch(cfg, num_sequences=8, seed=3)
    ref = run_step(path, Layout(), batch, adv, max_tokens=64)
    return path, cfg, batch, adv, ref


@pytest.mark.slow
# CI's share (the layouts in ALWAYS) is collected by default; COMPASS_TEST_RANKS=all
# (`make test-ranks`) collects every layout. Selection at collection, not a skip.
@pytest.mark.parametrize("name", [n for n in LAYOUTS if ALL or n in ALWAYS])
def test_layout_step_equals_one_process(setup, name):
    from compass_kernels.integration.rl.layout_check import compare, run_step

    path, _, batch, adv, ref = setup
    got = run_step(path, LAYOUTS[name], batch, adv, old=(ref.logprobs, ref.entropy), max_tokens=64)
    d = compare(ref, got)
    report = os.environ.get("COMPASS_RANKS_REPORT")  # docs/perf/ranks.md's table
    if report:
        with open(report, "a") as f:
            f.write(
                json.dumps(
                    {
                        "layout": name,
                        **d,
                        "bytes_per_rank": got.bytes_per_rank,
                        "bytes_full": got.bytes_full,
                        "sync": got.sync,
                        "seconds": got.seconds,
                    }
                )
                + "\n"
            )
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
    # the weight sync's layer-by-layer gather: the same tensors, at most one layer at a time
    assert got.parts_equal
    assert got.sync["parts"] == 4 + 2  # embedding, 4 layers, final
    assert got.sync["peak_part_bytes"] < got.sync["total_bytes"] / 3, got.sync


@pytest.mark.parametrize("name", ["dp2", "cp2", "pp2xdp2", "tp2xdp2"])
def test_each_rank_receives_its_share_only(name):
    from transformers import AutoConfig

    import compass_kernels as ck
    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe
    from compass_kernels.integration.rl.layout_check import synthetic_batch
    from compass_kernels.integration.rl.shares import (
        StepData,
        full_broadcast_bytes,
        local_tokens,
        make_shares,
        share_bytes,
    )

    layout = LAYOUTS[name]
    cfg = AutoConfig.from_pretrained(cached_tiny_qwen3_moe(num_hidden_layers=4))
    batch, adv = synthetic_batch(cfg, num_sequences=8, seed=4)
    plan = ck.packing.plan(batch.lengths, dp_size=layout.dp, max_tokens=64)
    data = StepData(batch, plan, torch.randn(batch.num_tokens), torch.rand(batch.num_tokens), adv)
    infos = layout_rank_infos(layout)
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
            gidx = torch.from_numpy(
                np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
            )
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
    from compass_kernels.integration.rl.shares import local_tokens
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
        want, kind, _ = trace.slice_plan(
            token_lens=lengths, pad_multiple=4, cp_size=2, cp_rank=r, cp_layout="zigzag"
        )
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        rows_of = torch.where(src >= 0, src - torch.from_numpy(starts)[seq] + cu[seq], -1)
        has_row = (src >= 0) & (pos < torch.from_numpy(lengths - 1)[seq])
        assert torch.equal(torch.where(has_row, rows_of, -1), want)


def _expected_ids(batch, plan, layout: Layout, info, j: int, layer: int):
    """(ids [rows, k] sorted, has_row [rows] bool): the global trace's rows of
    micro-batch j of this rank for ``layer``, in the order its router sees its
    tokens (CP zigzag, then its sequence-parallel piece), computed from the
    global trace without make_shares."""
    from compass_kernels.integration.rl.shares import local_tokens

    idx = plan.micro_batch(info.dp, j).numpy()
    lens = batch.lengths[idx]
    src, seq, pos = local_tokens(lens, layout.pad_multiple, layout.cp, info.cp)
    piece = src.numel() // layout.tp
    sl = slice(info.tp * piece, (info.tp + 1) * piece)
    src, seq, pos = src[sl], seq[sl], pos[sl]
    gseq = torch.from_numpy(idx)[seq]
    full_len = torch.from_numpy(batch.lengths)[gseq]
    has_row = (src >= 0) & (pos < full_len - 1)
    cu = batch.trace.cu_seqlens
    rows = torch.where(has_row, cu[gseq] + pos, 0)
    col = [int(x) for x in batch.trace.layer_ids].index(layer)
    ids = batch.trace.expert_ids[rows, col, :].to(torch.int64).sort(dim=-1).values
    return ids, has_row


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "pp2xcp2", "pp2xtp2"] if ALL else ["pp2"])
def test_replayed_ids_per_micro_batch_under_1f1b(setup, name):
    """Under Megatron's 1F1B schedule with several micro-batches in flight, every
    MoE layer of every stage dispatched, in each micro-batch's forward (no-grad
    pass and training step), exactly the trace's rows of that micro-batch for its
    tokens (the ids recorded by a hook on each router, not by the replay)."""
    from compass_kernels.integration.rl.distributed_trainer import DistributedTrainer

    layout = {"pp2": Layout(pp=2), "pp2xcp2": Layout(pp=2, cp=2), "pp2xtp2": Layout(pp=2, tp=2)}[
        name
    ]
    path, _, batch, adv, ref = setup
    trainer = DistributedTrainer(path, layout, timeout=300)
    try:
        data = trainer.plan(batch, max_tokens=40)  # 4+ micro-batches: several in flight
        nmb = data.plan.num_micro_batches
        assert nmb >= 3, nmb
        assert all(n == 2 for n in trainer.record_routes(True))  # 4 MoE layers over 2 stages
        trainer.forward(data)
        fwd_routes = trainer.recorded_routes()
        data.old_logprobs, data.old_entropy, data.advantages = ref.logprobs, ref.entropy, adv
        trainer.train(data, num_sequences=batch.num_sequences)
        train_routes = trainer.recorded_routes()
    finally:
        trainer.close()
    for phase, per_rank in (("forward", fwd_routes), ("train", train_routes)):
        max_flight = 0
        for info, layers, recs in zip(trainer.infos, trainer.stage_layers, per_rank, strict=True):
            assert sorted({r["layer"] for r in recs}) == layers, (phase, info)
            for layer in layers:
                mine = [r for r in recs if r["layer"] == layer]
                assert len(mine) == nmb, (phase, info, layer, len(mine))  # one per micro-batch
                for j, rec in enumerate(mine):  # Megatron forwards micro-batches in order
                    want, has_row = _expected_ids(batch, data.plan, layout, info, j, layer)
                    got = rec["ids"].to(torch.int64)
                    assert got.shape[0] == has_row.numel(), (phase, info, layer, j)
                    assert has_row.any()
                    bad = (got[has_row] != want[has_row]).any(-1)
                    assert not bad.any(), (phase, info.rank, layer, j, int(bad.sum()))
                    max_flight = max(max_flight, rec["in_flight"])
        # 1F1B: the first stage forwards micro-batch 1 before micro-batch 0's backward
        assert max_flight == (2 if phase == "train" else 1), (phase, max_flight)


def test_distributed_quantiles_equal_the_gathered_ones():
    """The radix select over ranks' histograms gives exactly entropy_thresholds'
    quantiles of the gathered values (ties, -0.0 / +0.0, tiny negatives, one value)."""
    from compass_kernels.espo.loss import entropy_thresholds
    from compass_kernels.integration.rl.quantile import distributed_quantiles, float_keys

    g = torch.Generator().manual_seed(0)
    levels = (0.2, 0.5, 0.8)
    cases = [
        torch.rand(997, generator=g) * 5,
        torch.randint(0, 4, (301,), generator=g).float() / 3,  # many ties
        torch.tensor([0.0, -0.0, -1e-7, 3.0, 2.5, 2.5]),
        torch.tensor([1.25]),
    ]
    for vals in cases:
        vals = vals.float()
        parts = torch.tensor_split(vals, 3)  # three "ranks"

        def hist(prefixes, shift, bits, parts=parts):
            out = torch.zeros(prefixes.numel(), 1 << bits, dtype=torch.int64)
            for p in parts:
                k = float_keys(p)
                high, low = k >> (shift + bits), (k >> shift) & ((1 << bits) - 1)
                for i, pre in enumerate(prefixes.tolist()):
                    out[i] += torch.bincount(low[high == pre], minlength=1 << bits)
            return out

        got = distributed_quantiles(hist, vals.numel(), levels)
        cu = torch.tensor([0, vals.numel()])
        want = entropy_thresholds(vals, cu, levels=levels).reshape(-1)
        assert torch.equal(got, want), (got, want)


def test_padding_micro_batch_share():
    """Fewer sequences than dp x micro-batches: the planner's refusal becomes a
    plan with empty micro-batches (or its error with empty="error"), and an empty
    micro-batch's share is one zero-length sequence: mask all False, every routing
    row missing as PADDING, on every rank of the layout."""
    from transformers import AutoConfig

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe
    from compass_kernels.integration.rl.layout_check import synthetic_batch
    from compass_kernels.integration.rl.shares import StepData, make_shares, plan_or_pad
    from compass_kernels.routing import MissingReason

    cfg = AutoConfig.from_pretrained(cached_tiny_qwen3_moe(num_hidden_layers=4))
    batch, adv = synthetic_batch(cfg, num_sequences=3, seed=5, min_len=20, max_len=24)
    with pytest.raises(ValueError, match="same number|need at least"):
        plan_or_pad(batch.lengths, 2, 30, empty="error")
    plan = plan_or_pad(batch.lengths, 2, 30)
    assert plan.num_micro_batches == 2 and plan.empty_micro_batches == 1
    got = sorted(int(i) for r in range(2) for j in range(2) for i in plan.micro_batch(r, j))
    assert got == [0, 1, 2]  # every sequence once
    # its statistics count the empty micro-batch as 0 (np.add.reduceat gave the next one's)
    tokens = [
        [
            plan.micro_batch(r, j).numel() and int(batch.lengths[plan.micro_batch(r, j)].sum())
            for j in range(2)
        ]
        for r in range(2)
    ]
    assert plan.stats["mb_tokens"].tolist() == tokens and 0 in sum(tokens, [])
    assert plan.stats["rank_tokens"].sum() == batch.lengths.sum()
    layout = Layout(cp=2, tp=2, dp=2)
    data = StepData(batch, plan, torch.randn(batch.num_tokens), torch.rand(batch.num_tokens), adv)
    infos = layout_rank_infos(layout)
    shares = make_shares(data, layout, infos, [[0, 1, 2, 3]] * len(infos), what="train")
    empty = [
        (info, mbs[j])
        for info, mbs in zip(infos, shares, strict=True)
        for j in range(2)
        if plan.micro_batch(info.dp, j).numel() == 0
    ]
    assert len(empty) == layout.tp * layout.cp  # the ranks of the short DP replica
    for _, mb in empty:
        assert mb.lengths.tolist() == [0]
        n = layout.pad_multiple // layout.cp
        assert mb.tokens.shape == (n,) and not mb.mask.any() and not mb.advantages.any()
        tr = mb.trace
        assert tr.num_tokens == n // layout.tp and bool(tr.missing.all())
        assert bool((tr.missing_reason == int(MissingReason.PADDING)).all())
        tr.validate(moe_layer_ids=[0, 1, 2, 3], top_k=tr.top_k, num_experts=tr.num_experts)


@pytest.mark.slow
def test_empty_micro_batch_step_equals_one_process(setup):
    """ep2 x dp2 with 3 sequences: one DP replica runs a padding micro-batch
    through the expert all-to-all (which spans both DP ranks, so skipping it
    would hang); the step equals the one-process step of the same batch."""
    from compass_kernels.integration.rl.layout_check import compare, run_step, synthetic_batch

    path, cfg, _, _, _ = setup
    batch, adv = synthetic_batch(cfg, num_sequences=3, seed=5, min_len=20, max_len=24)
    ref = run_step(path, Layout(), batch, adv, max_tokens=30)
    got = run_step(
        path, Layout(ep=2, dp=2), batch, adv, old=(ref.logprobs, ref.entropy), max_tokens=30
    )
    d = compare(ref, got)
    assert d["loss_rel"] < TOL and d["grad_norm_rel"] < TOL and d["weights_rel"] < TOL, d
    assert d["logprobs_max_abs"] < 1e-4, d
    for layer, st in ref.replay.items():  # padding rows are not counted
        assert got.replay[layer]["rows"] == st["rows"]


@pytest.mark.slow
def test_old_policy_stays_on_the_ranks(setup):
    """forward(keep=...) returns gap sums and per-sequence entropy max / min only;
    they equal those of the gathered log-probs, and train(use_kept=...) (old
    log-probs and entropy never leave the ranks; entropy-group boundaries by the
    distributed select) equals the one-process step."""
    from compass_kernels.integration.rl.batch import gap_stats
    from compass_kernels.integration.rl.distributed_trainer import DistributedTrainer

    path, _, batch, adv, ref = setup
    noise = 0.3 * torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(1))
    batch = dataclasses.replace(
        batch, infer_logprobs=torch.where(batch.mask, ref.logprobs + noise, 0.0)
    )
    trainer = DistributedTrainer(path, Layout(cp=2), timeout=300)
    try:
        data = trainer.plan(batch, 64)
        full = trainer.forward(data)
        full_bytes = trainer.last_reply_bytes["forward"]
        lean = trainer.forward(data, keep="old")
        lean_bytes = trainer.last_reply_bytes["forward"]
        data.advantages = adv
        m = trainer.train(data, num_sequences=batch.num_sequences, use_kept="old")
    finally:
        trainer.close()
    mask = batch.mask
    want = gap_stats(full["logprobs"][mask], batch.infer_logprobs[mask])
    gap = lean["gap"]
    assert gap.tokens == want.tokens
    for k in ("mean_abs", "k3", "frac_gt_ln2", "max_abs"):
        assert getattr(gap, k) == pytest.approx(getattr(want, k), rel=1e-9, abs=1e-12), k
    for i in range(batch.num_sequences):
        e = full["entropy"][(batch.seq_index == i) & mask].double()
        assert float(lean["seq_entropy_max"][i]) == float(e.max())
        assert float(lean["seq_entropy_min"][i]) == float(e.min())
    # per rank: sums and per-sequence values (O(sequences)), never per-token tensors
    assert "logprobs" not in lean and "entropy" not in lean
    assert max(lean_bytes) < min(full_bytes), (lean_bytes, full_bytes)
    assert abs(m["loss"] - ref.loss) / abs(ref.loss) < TOL, (m["loss"], ref.loss)
    assert abs(m["grad_norm"] - ref.grad_norm) / ref.grad_norm < TOL
