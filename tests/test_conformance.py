"""Conformance tests, one per bug class the peers shipped (../shared/ANCHORS.md,
"Bug classes peers shipped"), each named after its class, plus the NaN / Inf and
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
    return RoutingTrace(full.expert_ids[lo:hi].clone(), torch.tensor([0, hi - lo]), 16,
                        layer_ids=full.layer_ids, token_lens=token_lens)  # fmt: skip


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
    with pytest.raises(
        ValueError, match=r"^w: expected at least one column, got float32\[128, 0\]"
    ):
        fp8.quantize_blockwise(torch.randn(128, 0))
    q, s = fp8.quantize_token_groups(torch.randn(0, 256))  # zero rows: empty outputs
    assert q.shape == (0, 256) and s.shape[0] == 0
    packed = packing.pack(torch.randn(4, 0), [2, 2], [0, 1])  # zero-width rows pack
    assert next(iter(packed.tensors.values())).shape == (4, 0)
