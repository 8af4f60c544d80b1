"""Conformance tests, one per bug class other RL kernel packages
shipped, each named after its class, plus the NaN / Inf and
empty-input policies of issue 21 item 5 (docs/design.md, "Validation and
non-finite values" and "Verification levels")."""

from __future__ import annotations

import pytest
import torch

from compass_kernels import fp8, packing
from compass_kernels.routing import MissingReason, RoutingTrace, TraceError, replay_topk
from compass_kernels.testing import make_generator


def _full(rows, *, e=16, k=4, layers=(1, 3), seed=0):
    g = make_generator(seed)
    ids = torch.rand(rows, len(layers), e, generator=g).argsort(-1)[..., :k].to(torch.uint8)
    return RoutingTrace(ids, torch.tensor([0, rows]), e, layer_ids=list(layers))


def _part(full, lo, hi, token_lens=None):
    return RoutingTrace(
        full.expert_ids[lo:hi].clone(),
        torch.tensor([0, hi - lo]),
        16,
        layer_ids=full.layer_ids,
        token_lens=token_lens,
    )


def test_resume_duplication():
    """The engine returns the whole sequence again on resume; concatenating doubles it."""
    full = _full(8, seed=1)
    first, again = _part(full, 0, 5, [6]), _part(full, 0, 8, [9])
    assert first.stitch(again).seq_lens() == [8]  # compared, not appended
    with pytest.raises(TraceError, match="may hold the whole history again"):
        _part(full, 0, 5).stitch(_part(full, 0, 8))  # no counts: refused, never doubled


def test_truncation_skew():
    """Routes not truncated with the response ids (18,057 rows vs 17,805 tokens)."""
    t = _full(18_057, e=8, k=2, layers=(0,), seed=2)
    with pytest.raises(TraceError, match="has 18057 rows but only 17805 tokens"):
        t.slice(token_lens=[17_805])
    known = RoutingTrace(t.expert_ids, t.cu_seqlens, 8, layer_ids=[0], token_lens=[17_805])
    with pytest.raises(TraceError, match="18057 rows for 17805 tokens"):
        known.validate()


def test_turn_boundary_dummy_row():
    """A placeholder row at a turn boundary never replaced by the next prefill: one
    row too many for the conversation's tokens."""
    full = _full(10, seed=3)
    dummy = torch.zeros(1, 2, 4, dtype=torch.uint8) + torch.arange(4, dtype=torch.uint8)
    rows = torch.cat([full.expert_ids[:4], dummy, full.expert_ids[4:]])
    t = RoutingTrace(rows, torch.tensor([0, 11]), 16, layer_ids=[1, 3], token_lens=[11])
    with pytest.raises(TraceError, match="11 rows for 11 tokens"):
        t.validate()
    with pytest.raises(TraceError, match="has 11 rows but only 11 tokens"):
        RoutingTrace(rows, torch.tensor([0, 11]), 16, layer_ids=[1, 3]).slice(token_lens=[11])


def test_prompt_offset_ignored():
    """A turn's rows start at its prompt offset; ignoring it gives N x rows."""
    full = _full(12, seed=4)
    t1 = _part(full, 0, 5, [6])
    t2 = _part(full, 5, 12, [13])  # prefix omitted: rows of positions 5..11
    s = t1.stitch(t2)
    assert s.seq_lens() == [12] and torch.equal(s.expert_ids, full.expert_ids)
    wrong = _part(full, 5, 12, [8])  # counts that put its start at 0: disagrees, named
    with pytest.raises(TraceError, match="the turns disagree"):
        t1.stitch(wrong)


def test_dtype_locked_by_the_first_turn():
    """Above 256 experts ids need int16; a trace locked to uint8 by its first turn
    must not wrap silently."""
    ids = torch.tensor([[[0, 300]]], dtype=torch.int16)
    with pytest.raises(ValueError, match="expert_ids: expected dtype int16 for num_experts=384"):
        RoutingTrace(ids.to(torch.uint8), torch.tensor([0, 1]), 384)
    t = RoutingTrace(ids, torch.tensor([0, 1]), 384)
    u = RoutingTrace(torch.tensor([[[0, 1]]], dtype=torch.int16), torch.tensor([0, 1]), 384)
    assert u.stitch(t, start=[1]).expert_ids.dtype == torch.int16
    assert RoutingTrace.decode(u.stitch(t, start=[1]).encode()).expert_ids[1, 0].tolist() == [
        0,
        300,
    ]


def test_fused_shared_expert_index():
    """A fused shared expert stored at token*(K+S)+k: rows of the wrong width, or an
    id past the routed experts, are refused by name."""
    with pytest.raises(ValueError, match="top_k = 17 must be in"):
        RoutingTrace(torch.zeros(2, 1, 17, dtype=torch.uint8), torch.tensor([0, 2]), 16)
    ids = torch.tensor([[[0, 1, 16]]], dtype=torch.uint8)  # the shared expert as id E
    with pytest.raises(TraceError, match=r"out of range \[0, 16\)"):
        RoutingTrace(ids, torch.tensor([0, 1]), 16).validate()


def test_all_zero_routes():
    """All-zero rows returned for tokens with no routing: duplicates, refused by both codecs."""
    t = RoutingTrace(torch.zeros(3, 2, 4, dtype=torch.uint8), torch.tensor([0, 3]), 16)
    with pytest.raises(TraceError, match="duplicate expert within a row"):
        t.validate()
    for codec in ("set", "raw"):
        with pytest.raises(ValueError):
            t.encode(codec=codec)


def test_async_eos_placeholder():
    """An async-scheduling placeholder (-1 or garbage) must be a marked missing row,
    routed natively; unmarked it is an out-of-range id."""
    ids = torch.tensor([[[1, 2]], [[-1, -1]]], dtype=torch.int16)
    with pytest.raises(TraceError, match="out of range"):
        RoutingTrace(ids, torch.tensor([0, 2]), 300).validate()
    m = torch.tensor([False, True])
    r = m.to(torch.uint8) * int(MissingReason.ASYNC_PLACEHOLDER)
    t = RoutingTrace(ids, torch.tensor([0, 2]), 300, missing=m, missing_reason=r).validate()
    ids1, valid = t.layer(0)
    res = replay_topk(torch.randn(2, 300), ids1, valid=valid)
    assert res.stats.as_dict()["fallback_rows"] == 1


def test_thd_cp_cu_seqlens_padded():
    """THD + CP needs each sequence padded to 2*cp chunks: the slice refuses a pad
    that does not split, and the zigzag layout must be declared."""
    t = _full(13, seed=5)
    with pytest.raises(ValueError, match="pad_multiple: 2 is not a multiple of 4"):
        t.slice(cp_size=2, cp_rank=0, cp_layout="zigzag", pad_multiple=2)
    with pytest.raises(ValueError, match="cp_layout: with cp_size > 1 declare"):
        t.slice(cp_size=2, cp_rank=0, pad_multiple=4)
    a = t.slice(cp_size=2, cp_rank=0, cp_layout="zigzag", pad_multiple=4)
    b = t.slice(cp_size=2, cp_rank=1, cp_layout="zigzag", pad_multiple=4)
    assert a.num_tokens == b.num_tokens == 8  # 14 tokens padded to 16, 4 chunks of 4


# -------------------------------------------------- NaN / Inf and empty inputs


def test_replay_topk_nan_logits_raise_on_cpu_by_default():
    logits = torch.randn(4, 8)
    logits[2, 5] = float("nan")
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    with pytest.raises(ValueError, match="router_logits: expected finite values, got nan at row 2"):
        replay_topk(logits, ids)
    logits[2, 5] = float("inf")
    with pytest.raises(ValueError, match="got inf at row 2, column 5"):
        replay_topk(logits, ids)
    bias = torch.zeros(8)
    bias[1] = float("nan")
    with pytest.raises(ValueError, match="expert_bias: expected finite values"):
        replay_topk(torch.randn(4, 8), ids, score_function="sigmoid", expert_bias=bias)


def test_empty_inputs_name_the_users_argument():
    q, s = fp8.quantize_blockwise(torch.randn(128, 0))  # K = 0: empty outputs (issue 30)
    assert q.shape == (128, 0) and s.shape == (1, 0)
    q, s = fp8.quantize_token_groups(torch.randn(0, 256))  # zero rows: empty outputs
    assert q.shape == (0, 256) and s.shape[0] == 0
    packed = packing.pack(torch.randn(4, 0), [2, 2], [0, 1])  # zero-width rows pack
    assert next(iter(packed.tensors.values())).shape == (4, 0)


# ------------------------------------------------ packing and advantages classes


def test_flops_balancing_vs_the_token_cap():
    """Balancing the attention FLOPs a*L + b*L^2 (quadratic: one long sequence
    outweighs many short ones) must never pack the short ones past the token cap."""
    import numpy as np

    from compass_kernels.packing import ModelConfig
    from compass_kernels.packing import reference as pref

    cfg = ModelConfig(hidden_size=64, ffn_hidden_size=64, num_layers=2, num_attention_heads=4)
    a, b = packing.cost_coefficients(cfg)
    assert b * 1000 > 2 * a  # at 1000 tokens the quadratic term dominates: FLOPs != tokens
    # one rank's worth: a 1000-token sequence beside 40 of 50 tokens; by FLOPs the
    # short ones together weigh less than the long one, by tokens twice as much
    lengths = [1000] + [50] * 40
    for kw in ({}, {"pad_multiple": 8}, {"micro_batch_multiple": 2}):
        p = packing.plan(
            lengths, dp_size=1, max_tokens=1000, cost="attention", model_config=cfg, **kw
        )
        pref.check_plan(p, lengths, dp_size=1, max_tokens=1000, **kw)
        assert p.stats["max_mb_tokens"] <= 1000
    rng = np.random.default_rng(21)
    for trial in range(40):  # long-tailed batches at tight caps, with and without groups
        n, dp = int(rng.integers(4, 40)), int(rng.integers(1, 5))
        lens = np.clip(rng.lognormal(5.0, 1.2, n), 1, 4000).astype(np.int64)
        cap = int(lens.max() * rng.choice([1, 1.3, 2]))
        gids = rng.integers(0, max(dp, n // 3), n) if trial % 2 else None
        pad = int(rng.choice([1, 4]))
        cap = -(-cap // pad) * pad
        try:
            p = packing.plan(
                lens,
                dp_size=dp,
                max_tokens=cap,
                cost="attention",
                model_config=cfg,
                group_ids=gids,
                pad_multiple=pad,
            )
        except ValueError as e:  # only a refusal that names why
            assert "dp_size" in str(e) or "no plan" in str(e), str(e)
            continue
        pref.check_plan(p, lens, dp_size=dp, max_tokens=cap, group_ids=gids, pad_multiple=pad)


def test_empty_rank():
    """Fewer sequences (or groups) than ranks x micro-batches: a refusal naming the
    real reason, never a crash, a rank without work or an empty micro-batch."""
    with pytest.raises(ValueError, match="need at least dp_size = 4 sequences .* got 3"):
        packing.plan([5, 6, 7], dp_size=4, max_tokens=100)
    with pytest.raises(ValueError, match="group_ids: need at least dp_size = 4 groups .* got 2"):
        packing.plan([5] * 8, dp_size=4, max_tokens=100, group_ids=[0] * 4 + [1] * 4)
    # two sequences per rank but three micro-batches needed by the cap
    with pytest.raises(ValueError, match="no plan exists.*need M >= 3"):
        packing.plan([100] * 4, dp_size=2, max_tokens=100, micro_batch_multiple=3)
    with pytest.raises(ValueError, match="lengths: expected at least one sequence"):
        packing.plan([], dp_size=2, max_tokens=100)
    # exactly one sequence per rank: planned, every micro-batch non-empty
    p = packing.plan([100, 1, 1, 1], dp_size=4, max_tokens=100)
    assert all(len(mb) == 1 for mbs in p.assignment for mb in mbs)
    # the cap needs 2 micro-batches on whichever rank gets two long sequences; the
    # other rank, whose tokens fit in one, is split so that it has 2 non-empty ones
    lens = [60, 60, 61, 1]
    p = packing.plan(lens, dp_size=2, max_tokens=100)
    from compass_kernels.packing import reference as pref

    pref.check_plan(p, lens, dp_size=2, max_tokens=100)
    assert p.num_micro_batches == 2


def test_dynamic_sampling_mask_per_group():
    """The dynamic-sampling (zero-variance) mask is a property of a group: every
    rollout of a group is kept or dropped together, whatever the order of the
    rollouts; seven identical winners and a loser are kept with non-zero
    advantages, eight identical winners are dropped whole (RL-ZVP takes them)."""
    from compass_kernels import advantages
    from compass_kernels.advantages import reference as aref

    g = make_generator(21)
    rewards = torch.cat(
        [
            torch.tensor([1.0] * 7 + [0.0]),  # group 0: informative, kept whole
            torch.ones(8),  # group 1: seven+one identical winners, dropped whole
            torch.tensor([0.5, 0.5 + 1e-9, 0.5, 0.5]),  # group 2: within zero_var_tol
            torch.tensor([0.0, 1.0, 0.0, 0.0]),  # group 3: one winner: kept
            torch.tensor([2.0]),  # group 4: a group of one: dropped
        ]
    )
    gids = torch.tensor([0] * 8 + [1] * 8 + [2] * 4 + [3] * 4 + [4])
    perm = torch.randperm(rewards.numel(), generator=g)  # rollouts arrive interleaved
    r, gid = rewards[perm], gids[perm] * 7 + 3  # ids need not be 0..G-1
    adv, zero_var, stats = advantages.group_advantages(r, gid)
    want = torch.tensor([False, True, True, False, True])
    assert torch.equal(stats.group_zero_var, want)
    assert torch.equal(zero_var, want[gids[perm]])  # per rollout = its group's flag
    assert bool((adv[zero_var] == 0).all()) and bool((adv[~zero_var] != 0).all())
    # RL-ZVP gives token advantages exactly to the dropped groups' rollouts
    lens = torch.randint(1, 5, (r.numel(),), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    ent = torch.rand(int(cu[-1]), generator=g) + 0.1
    tok = advantages.rl_zvp(ent, cu, r, zero_var, advantages=adv)
    want_tok = aref.rl_zvp_reference(ent, cu, r, want[gids[perm]], advantages=adv)
    torch.testing.assert_close(tok.double(), want_tok, rtol=1e-6, atol=1e-7)
    seq = torch.repeat_interleave(torch.arange(r.numel()), lens)
    dropped = zero_var[seq]
    assert bool((tok[dropped] != 0).any()) and torch.equal(tok[~dropped], adv[seq][~dropped])


# ------------------------------------------------ NaN / Inf policy, every public op
# (the table: docs/validation.md, "Metadata and data checks"). On CPU tensors every float input
# that the policy says must be finite is checked by default and the error names
# the argument; where the policy leaves values unchecked, the output is what it
# says.


def _nan_at(t: torch.Tensor, idx, value=float("nan")) -> torch.Tensor:
    t = t.clone()
    t[idx] = value
    return t


def _nan_cases():
    from compass_kernels import advantages, espo

    g = make_generator(7)
    x8 = torch.randn(8, generator=g)
    cu = torch.tensor([0, 3, 6])
    ent, lp = torch.rand(6, generator=g), -torch.rand(6, generator=g)
    zv = torch.tensor([True, False])
    logits, tgt = torch.randn(4, 10, generator=g), torch.tensor([1, 2, 3, 4])
    hid, w = torch.randn(4, 8, generator=g), torch.randn(10, 8, generator=g)
    adv2 = torch.randn(2, generator=g)
    cu4 = torch.tensor([0, 2, 4])
    wt = torch.randn(128, 128, generator=g)
    ids = torch.zeros(128, 2, dtype=torch.int64)
    aq, asc = fp8.quantize_token_groups(torch.randn(6, 128, generator=g))
    bq, bsc = fp8.quantize_blockwise(torch.randn(2, 16, 128, generator=g))
    off = torch.tensor([0, 4, 6])
    succ, att = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0])
    inf = float("inf")
    alloc, fused_lp = advantages.allocate_rollouts, espo.fused_linear_logprobs_entropy

    def loss(*a):
        return espo.espo_loss(*a, vocab_size=10)

    return {
        "group_advantages.rewards": (
            "rewards",
            lambda: advantages.group_advantages(_nan_at(x8, 3), group_size=4),
        ),
        "rl_zvp.entropy": ("entropy", lambda: advantages.rl_zvp(_nan_at(ent, 4), cu, adv2, zv)),
        "rl_zvp.rewards": (
            "rewards",
            lambda: advantages.rl_zvp(ent, cu, _nan_at(adv2, 1, inf), zv),
        ),
        "allocate_rollouts.successes": ("successes", lambda: alloc(_nan_at(succ, 0), att, 8)),
        "allocate_rollouts.attempts": ("attempts", lambda: alloc(succ, _nan_at(att, 1, inf), 8)),
        "allocate_rollouts.cost": (
            "cost",
            lambda: alloc(succ, att, 8, cost=torch.tensor([1.0, inf])),
        ),
        "allocate_rollouts.budget": ("budget", lambda: alloc(succ, att, float("nan"))),
        "token_logprobs_entropy.logits": (
            "logits",
            lambda: espo.token_logprobs_entropy(_nan_at(logits, (1, 2)), tgt),
        ),
        "token_logprobs_entropy.+inf": (
            "logits",
            lambda: espo.token_logprobs_entropy(_nan_at(logits, (1, 2), inf), tgt),
        ),
        "fused_linear_logprobs_entropy.hidden": (
            "hidden",
            lambda: fused_lp(_nan_at(hid, (0, 0)), w, tgt),
        ),
        "fused_linear_logprobs_entropy.weight": (
            "weight",
            lambda: fused_lp(hid, _nan_at(w, (9, 7), inf), tgt),
        ),
        "espo_loss.logprobs": ("logprobs", lambda: loss(_nan_at(lp, 2), lp, ent, adv2, cu)),
        "espo_loss.old_logprobs": ("old_logprobs", lambda: loss(lp, _nan_at(lp, 5), ent, adv2, cu)),
        "espo_loss.old_entropy": (
            "old_entropy",
            lambda: loss(lp, lp, _nan_at(ent, 0, inf), adv2, cu),
        ),
        "espo_loss.advantages": ("advantages", lambda: loss(lp, lp, ent, _nan_at(adv2, 0), cu)),
        "fused_linear_espo_loss.hidden": (
            "hidden",
            lambda: espo.fused_linear_espo_loss(
                _nan_at(hid, (3, 1)), w, tgt, lp[:4], ent[:4], adv2, cu4
            ),
        ),
        "fused_linear_espo_loss.advantages": (
            "advantages",
            lambda: espo.fused_linear_espo_loss(
                hid, w, tgt, lp[:4], ent[:4], _nan_at(adv2, 1), cu4
            ),
        ),
        "quantize_blockwise.w": ("w", lambda: fp8.quantize_blockwise(_nan_at(wt, (5, 5)))),
        "quantize_token_groups.x": (
            "x",
            lambda: fp8.quantize_token_groups(_nan_at(wt, (0, 127), -inf)),
        ),
        "permute_quantize.x": ("x", lambda: fp8.permute_quantize(_nan_at(wt, (9, 9)), ids, 4)),
        "grouped_gemm.a_scales": (
            "a_scales",
            lambda: fp8.grouped_gemm(aq, _nan_at(asc, (2, 0)), bq, bsc, off),
        ),
        "grouped_gemm.b_scales": (
            "b_scales",
            lambda: fp8.grouped_gemm(aq, asc, bq, _nan_at(bsc, (1, 0, 0), inf), off),
        ),
        "replay_topk.router_logits": (
            "router_logits",
            lambda: replay_topk(_nan_at(logits, (2, 5)), tgt[:, None]),
        ),
    }


_NAN_CASES = sorted(_nan_cases())


@pytest.mark.parametrize("case", _NAN_CASES)
def test_nan_inf_checked_on_cpu_by_default(case):
    name, call = _nan_cases()[case]
    with pytest.raises(ValueError, match=rf"^{name}: expected (a )?finite"):
        call()


def test_moe_mlp_nan_inf_policy():
    g = make_generator(3)
    x = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]])
    w = torch.softmax(torch.randn(6, 2, generator=g), 1)
    w13, s13 = fp8.quantize_blockwise(torch.randn(2, 256, 128, generator=g).to(torch.bfloat16))
    w2, s2 = fp8.quantize_blockwise(torch.randn(2, 128, 128, generator=g).to(torch.bfloat16))
    for name, args in (
        ("hidden", (_nan_at(x, (1, 1)), ids, w, w13, s13, w2, s2)),
        ("topk_weights", (x, ids, _nan_at(w, (0, 1)), w13, s13, w2, s2)),
        ("w13_scale", (x, ids, w, w13, _nan_at(s13, (1, 0, 0)), w2, s2)),
        ("w2_scale", (x, ids, w, w13, s13, w2, _nan_at(s2, (0, 0, 0), float("inf")))),
    ):
        with pytest.raises(ValueError, match=rf"^{name}: expected finite"):
            fp8.moe_mlp(*args)


def test_unchecked_values_give_what_the_policy_says():
    """Where the policy does not check (validate=False, or values only moved),
    a non-finite input reaches exactly the outputs it feeds, no others."""
    from compass_kernels import advantages

    r = _nan_at(torch.randn(8), 5)
    adv, zv, _ = advantages.group_advantages(r, group_size=4, validate=False)
    assert bool(adv[4:].isnan().all()) and bool(adv[:4].isfinite().all())
    assert zv.tolist() == [False] * 8
    ent = _nan_at(torch.rand(7), 1)
    cu, zv2 = torch.tensor([0, 3, 7]), torch.tensor([True, True])
    tok = advantages.rl_zvp(ent, cu, torch.tensor([-1.0, -1.0]), zv2, validate=False)
    assert bool(tok[3:].isfinite().all())  # the other sequence is untouched
    # pack / unpack move values: NaN / Inf pass through bit for bit
    x = _nan_at(torch.randn(7, 3), (4, 1))
    x[0, 0] = float("-inf")
    b = packing.pack(x, [3, 4], [1, 0], pad_multiple=4)
    back = packing.unpack(b.tensors["input"], b)
    assert torch.equal(back.view(torch.int32), torch.cat([x[3:], x[:3]]).view(torch.int32))
    # dequantize is an unchecked helper: a NaN scale gives NaN in its block only
    q, s = fp8.quantize_blockwise(torch.randn(256, 130))
    out = fp8.dequantize(q, _nan_at(s, (1, 1)))
    assert bool(out[128:, 128:].isnan().all()) and int(out.isnan().sum()) == 128 * 2
    # grouped_gemm, validate=False: a NaN weight scale spoils exactly its 128x128 block
    g = make_generator(9)
    aq, asc = fp8.quantize_token_groups(torch.randn(5, 256, generator=g))
    bq, bsc = fp8.quantize_blockwise(torch.randn(1, 256, 256, generator=g))
    off = torch.tensor([0, 5])
    out = fp8.grouped_gemm(
        aq, asc, bq, _nan_at(bsc, (0, 1, 0)), off, out_dtype=torch.float32, validate=False
    )
    assert bool(out[:, 128:].isnan().all()) and bool(out[:, :128].isfinite().all())
    # -inf logits are masked tokens, not errors
    logits = _nan_at(torch.randn(3, 5), (0, 4), float("-inf"))
    from compass_kernels import espo

    logp, _ = espo.token_logprobs_entropy(logits, torch.tensor([0, 1, 2]))
    assert bool(logp.isfinite().all())
