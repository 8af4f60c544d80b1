"""ck.routing.RoutingTrace: contract checks, validation errors, stitching,
per-rank re-layout (pipeline, context-parallel zigzag / contiguous, sequence
parallel, padding), 64k-token sequences, and the codec round trip."""

from __future__ import annotations

import pytest
import torch

from compass_kernels.routing import MissingReason, RoutingTrace, TraceError, ids_dtype
from compass_kernels.testing import make_generator


def make_trace(lens, *, e=16, k=4, layers=(1, 3, 4), mtp=(), seed=0, missing_frac=0.0):
    g = make_generator(seed)
    n = sum(lens)
    cols = len(layers) + len(mtp)
    ids = torch.rand(n, cols, e, generator=g).argsort(-1)[..., :k].to(ids_dtype(e))
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    missing = reason = None
    if missing_frac:
        tok = torch.rand(n, generator=g) < missing_frac
        missing = tok[:, None].expand(n, cols).clone()
        reason = tok.to(torch.uint8) * int(MissingReason.PREFIX_CACHE)
    return RoutingTrace(
        ids,
        cu,
        e,
        layer_ids=list(layers),
        missing=missing,
        missing_reason=reason,
        mtp_layer_ids=list(mtp),
    )


# ----------------------------------------------------------- construction


def test_dtype_is_the_narrowest_that_holds_the_ids():
    assert ids_dtype(256) == torch.uint8 and ids_dtype(257) == torch.int16
    assert ids_dtype(8) == torch.uint8 and ids_dtype(32768) == torch.int16
    with pytest.raises(ValueError, match="num_experts: expected an int in"):
        ids_dtype(32769)
    cu = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="expert_ids: expected dtype int16 for num_experts=300"):
        RoutingTrace(torch.zeros(2, 1, 2, dtype=torch.uint8), cu, 300)
    with pytest.raises(ValueError, match="expert_ids: expected dtype uint8"):
        RoutingTrace(torch.zeros(2, 1, 2, dtype=torch.int64), cu, 64)


def test_constructor_names_bad_arguments():
    ids = torch.zeros(4, 3, 2, dtype=torch.uint8)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="cu_seqlens: expected an int64"):
        RoutingTrace(ids, cu.int(), 8)
    with pytest.raises(ValueError, match="layer_ids: expected 3 entries"):
        RoutingTrace(ids, cu, 8, layer_ids=[0, 1])
    with pytest.raises(ValueError, match="layer_ids: expected strictly increasing"):
        RoutingTrace(ids, cu, 8, layer_ids=[0, 2, 2])
    with pytest.raises(ValueError, match="layer_ids: expected 2 entries .* 1 MTP"):
        RoutingTrace(ids, cu, 8, layer_ids=[0, 1, 2], mtp_layer_ids=[0])
    with pytest.raises(ValueError, match=r"missing: expected shape \[4\] or \[4, 3\]"):
        RoutingTrace(ids, cu, 8, missing=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="missing_reason: given without missing"):
        RoutingTrace(ids, cu, 8, missing_reason=torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="top_k = 2 must be in"):
        RoutingTrace(ids, cu, 1)


def test_missing_defaults_and_counts():
    t = make_trace([5, 3], missing_frac=0.0)
    assert t.num_missing == 0 and t.missing_counts() == {}
    m = torch.zeros(8, dtype=torch.bool)
    m[[1, 6]] = True
    t2 = RoutingTrace(t.expert_ids, t.cu_seqlens, 16, layer_ids=[1, 3, 4], missing=m)
    assert t2.num_missing == 6 and t2.missing_counts() == {"NOT_CAPTURED": 2}
    t2.validate()


# ------------------------------------------------------------- validation


def test_validate_accepts_a_good_trace_and_checks_the_model():
    t = make_trace([5, 9, 1], mtp=(0,), layers=(3, 5, 6))
    assert (
        t.validate(
            moe_layer_ids=[3, 5, 6],
            num_layers=7,
            top_k=4,
            num_experts=16,
            mtp_layer_ids=[0],
            expected_rows=[5, 9, 1],
        )
        is t
    )
    with pytest.raises(TraceError, match=r"layer map: the model's MoE layers are \[3, 4, 5\]"):
        t.validate(moe_layer_ids=[3, 4, 5])
    with pytest.raises(TraceError, match="num_layers=6"):
        t.validate(num_layers=6)
    with pytest.raises(TraceError, match="top_k: the model routes to 8"):
        t.validate(top_k=8)
    with pytest.raises(TraceError, match="MTP layers: the model has"):
        t.validate(mtp_layer_ids=[])
    with pytest.raises(TraceError, match=r"sequence 1: 9 rows, expected 10"):
        t.validate(expected_rows=[5, 10, 1])


@pytest.mark.parametrize("what", ["range", "duplicate", "reason", "cu", "mtp_dup"])
def test_validate_names_sequence_layer_and_token(what):
    t = make_trace([5, 9, 4], layers=(3, 5, 6), mtp=(0,), missing_frac=0.2, seed=3)
    ids = t.expert_ids.clone()
    missing, reason, cu = t.missing.clone(), t.missing_reason.clone(), t.cu_seqlens.clone()
    row = 5 + 7  # sequence 1, token 7
    missing[row] = False
    reason[row] = 0
    if what == "range":
        ids[row, 1, 2] = 16
        match = r"out of range \[0, 16\) at sequence 1, token 7 \(row 12\), layer 5"
    elif what == "duplicate":
        ids[row, 2, 3] = ids[row, 2, 0]
        match = r"duplicate expert within a row at sequence 1, token 7 \(row 12\), layer 6"
    elif what == "mtp_dup":
        ids[row, 3, 1] = ids[row, 3, 0]
        match = r"duplicate .* sequence 1, token 7 \(row 12\), MTP layer 0"
    elif what == "reason":
        reason[row] = int(MissingReason.PREEMPTED)
        match = r"missing_reason: 2 at sequence 1, token 7 \(row 12\) but the token has no"
    else:
        cu[2] = 3
        match = "cu_seqlens: decreasing at sequence 1"
    bad = RoutingTrace(
        ids, cu, 16, layer_ids=[3, 5, 6], missing=missing, missing_reason=reason, mtp_layer_ids=[0]
    )
    with pytest.raises(TraceError, match=match):
        bad.validate()
    flag = bad.validate(raise_on_error=False)
    assert flag.dtype == torch.bool and not bool(flag)


def test_missing_rows_are_not_checked_and_fraction_limit():
    t = make_trace([6, 6], missing_frac=0.5, seed=2)
    ids = t.expert_ids.clone()
    r = int(t.missing[:, 0].nonzero()[0, 0])
    ids[r] = 255  # garbage in a missing row is fine
    t2 = RoutingTrace(
        ids,
        t.cu_seqlens,
        16,
        layer_ids=[1, 3, 4],
        missing=t.missing,
        missing_reason=t.missing_reason,
    )
    t2.validate()
    with pytest.raises(TraceError, match="more than max_missing_fraction=0.01"):
        t2.validate(max_missing_fraction=0.01)


def test_uint8_at_256_experts_and_int16_above():
    for e in (256, 300):
        t = make_trace([3, 4], e=e, k=8, seed=e)
        t.validate()
        if e == 300:
            ids = t.expert_ids.clone()
            ids[2, 0, 0] = -1
            with pytest.raises(TraceError, match="out of range"):
                RoutingTrace(ids, t.cu_seqlens, e, layer_ids=[1, 3, 4]).validate()


# ------------------------------------------------------------------ stitch


def test_stitch_continues_fills_gaps_and_checks_overlap():
    a = make_trace([4, 6], seed=1)
    full = make_trace([10, 12], seed=2)
    # Turn 1 = the first 4 / 6 rows of the conversation, turn 2 the rest.
    first = full.sequences([0, 1])
    t1 = RoutingTrace.concat([_rows(first, 0, 0, 4), _rows(first, 1, 0, 6)])
    t2 = RoutingTrace.concat([_rows(first, 0, 4, 10), _rows(first, 1, 6, 12)])
    s = t1.stitch(t2, expected_rows=[10, 12])
    assert s == full and s.num_missing == 0
    # Prefix omission with a gap: turn 2 starts 2 rows later. The gap has no row and
    # no reason: an error unless accepted by name, then SHORT rows.
    t2b = RoutingTrace.concat([_rows(first, 0, 6, 10), _rows(first, 1, 8, 12)])
    with pytest.raises(TraceError, match="stitch: sequence 0: 2 positions from token 4 are in"):
        t1.stitch(t2b, start=[6, 8])
    with pytest.raises(TraceError, match="more than max_missing_fraction=0.1"):
        t1.stitch(t2b, start=[6, 8], max_missing_fraction=0.1)
    s2 = t1.stitch(t2b, start=[6, 8], max_missing_fraction=0.2)
    assert s2.seq_lens() == [10, 12] and s2.missing_counts() == {"SHORT": 4}
    assert s2.num_missing == 4 * 3
    with pytest.raises(TraceError, match=r"no row for an input token \(reason SHORT"):
        s2.validate()
    s2.validate(max_missing_fraction=0.2)
    # Overlap that agrees is fine; one that disagrees names sequence, token and layer.
    t2c = RoutingTrace.concat([_rows(first, 0, 2, 10), _rows(first, 1, 6, 12)])
    assert t1.stitch(t2c, start=[2, 6]) == full
    ids = t2c.expert_ids.clone()
    ids[1, 2] = torch.tensor([15, 14, 13, 12], dtype=torch.uint8)
    bad = RoutingTrace(ids, t2c.cu_seqlens, 16, layer_ids=[1, 3, 4])
    with pytest.raises(
        TraceError, match="stitch: sequence 0, token 3, layer 4: the turns disagree"
    ):
        t1.stitch(bad, start=[2, 6])
    with pytest.raises(TraceError, match="sequence 1: 12 rows after stitching, expected 13"):
        t1.stitch(t2, expected_rows=[10, 13])
    with pytest.raises(TraceError, match="stitch: 2 sequences in this trace, 1"):
        t1.stitch(t2.sequence(0))
    with pytest.raises(TraceError, match="layer keys differ"):
        t1.stitch(make_trace([6, 6], layers=(0, 1, 2)))
    assert a.num_sequences == 2


def _rows(trace, seq, lo, hi):
    s = trace.sequence(seq)
    return RoutingTrace(
        s.expert_ids[lo:hi].clone(),
        torch.tensor([0, hi - lo]),
        s.num_experts,
        layer_ids=s.layer_ids,
    )


# ---------------------------------------------------------------- re-layout


def _positions(trace, sequences, token_lens, pad, cp, layout, rank, sp=1, sp_rank=0):
    """By hand: (sequence, position) of every local token, in order."""
    out = []
    for j, i in enumerate(sequences):
        padded = -(-token_lens[j] // pad) * pad
        pos = list(range(padded))
        if cp > 1 and layout == "zigzag":
            c = padded // (2 * cp)
            pos = (
                pos[rank * c : (rank + 1) * c] + pos[(2 * cp - 1 - rank) * c : (2 * cp - rank) * c]
            )
        elif cp > 1:
            c = padded // cp
            pos = pos[rank * c : (rank + 1) * c]
        out += [(i, p) for p in pos]
    piece = len(out) // sp
    return out[sp_rank * piece : (sp_rank + 1) * piece]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp,sp", [(1, 1), (2, 1), (2, 2), (4, 1), (1, 2)])
def test_slice_gives_each_rank_exactly_its_tokens(layout, cp, sp):
    lens = [5, 9, 1, 14, 0]
    t = make_trace(lens, layers=(1, 3, 4, 7), mtp=(0,), missing_frac=0.1, seed=cp * 10 + sp)
    seqs = [3, 0, 2, 1]
    token_lens = [lens[i] + 1 for i in seqs]
    pad = 2 * cp * sp if layout == "zigzag" else cp * sp
    cu = t.cu_seqlens.tolist()
    seen = set()
    for rank in range(cp):
        for sr in range(sp):
            s = t.slice(
                layers=range(3, 8),
                sequences=seqs,
                pad_multiple=pad,
                cp_size=cp,
                cp_rank=rank,
                cp_layout=layout if cp > 1 else None,
                sp_size=sp,
                sp_rank=sr,
            )
            s.validate()
            assert s.layer_ids.tolist() == [3, 4, 7] and s.num_mtp_layers == 0
            want = _positions(t, seqs, token_lens, pad, cp, layout, rank, sp, sr)
            assert s.num_tokens == len(want)
            reason = s._reasons()
            for row, (i, p) in enumerate(want):
                seen.add((i, p))
                if p < lens[i]:
                    src = cu[i] + p
                    assert torch.equal(s.expert_ids[row], t.expert_ids[src, 1:4])
                    assert torch.equal(s._missing_mask()[row], t._missing_mask()[src, 1:4])
                elif p == lens[i]:
                    assert int(reason[row]) == MissingReason.NO_ROW and s.missing[row].all()
                else:
                    assert int(reason[row]) == MissingReason.PADDING and s.missing[row].all()
    # Every token of every padded sequence is on exactly one rank.
    total = sum(-(-tl // pad) * pad for tl in token_lens)
    assert len(seen) == total


def test_zigzag_and_contiguous_differ_and_must_be_declared():
    t = make_trace([15], seed=5)
    z = t.slice(cp_size=2, cp_rank=0, cp_layout="zigzag", pad_multiple=4)
    c = t.slice(cp_size=2, cp_rank=0, cp_layout="contiguous", pad_multiple=4)
    assert not torch.equal(z.expert_ids, c.expert_ids)
    with pytest.raises(ValueError, match="cp_layout: with cp_size > 1 declare"):
        t.slice(cp_size=2, cp_rank=0, pad_multiple=4)
    with pytest.raises(ValueError, match="pad_multiple: 2 is not a multiple of 4"):
        t.slice(cp_size=2, cp_rank=0, cp_layout="zigzag", pad_multiple=2)
    with pytest.raises(ValueError, match="sp_size: this rank's 7 packed tokens"):
        make_trace([6]).slice(sp_size=2)
    with pytest.raises(ValueError, match="cp_rank: expected an int in"):
        t.slice(cp_size=2, cp_rank=2, cp_layout="zigzag", pad_multiple=4)
    with pytest.raises(TraceError, match="token_lens: sequence 0 has 15 rows but only 10"):
        t.slice(token_lens=[10])


def test_slice_padding_policies_and_mtp():
    t = make_trace([5], mtp=(0, 1), seed=6)
    fixed = t.slice(pad_multiple=8, pad_policy="fixed", include_mtp=True)
    assert fixed.num_mtp_layers == 2 and fixed.expert_ids.shape == (8, 5, 4)
    assert fixed.expert_ids[6:].tolist() == [[[0, 1, 2, 3]] * 5] * 2
    assert fixed.missing_counts() == {"NO_ROW": 1}
    fixed.validate()
    miss = t.slice(pad_multiple=8)
    assert miss.missing_counts() == {"NO_ROW": 1, "PADDING": 2}
    with pytest.raises(ValueError, match="pad_policy: expected 'missing' or 'fixed'"):
        t.slice(pad_policy="zeros")


def test_slice_layers_of_a_pipeline_stage_only():
    # DeepSeek-V3-like: layers 0-2 dense, 3..9 MoE; stage 1 holds layers 5..9.
    t = make_trace([4, 4], layers=range(3, 10), seed=7)
    s = t.slice(layers=range(5, 10))
    assert s.layer_ids.tolist() == [5, 6, 7, 8, 9]
    assert torch.equal(s.expert_ids[:4], t.expert_ids[:4, 2:])
    s0 = t.slice(layers=range(0, 5))  # dense 0-2 have no column: 3, 4 only
    assert s0.layer_ids.tolist() == [3, 4]


def test_64k_token_sequences_use_int64_offsets():
    n = 65_541
    e, k = 256, 8
    g = make_generator(0)
    base = torch.randint(0, e, (2 * n, 1, 1), generator=g)
    ids = ((base + torch.arange(k) * 31) % e).to(torch.uint8)  # distinct within a row
    cu = torch.tensor([0, n, 2 * n], dtype=torch.int64)
    t = RoutingTrace(ids, cu, e, layer_ids=[61])
    t.validate(expected_rows=[n, n])
    s = t.slice(sequences=[1], cp_size=2, cp_rank=1, cp_layout="zigzag", pad_multiple=4)
    padded = -(-(n + 1) // 4) * 4
    c = padded // 4
    assert s.num_tokens == padded // 2 and s.cu_seqlens.dtype == torch.int64
    assert torch.equal(s.expert_ids[:c], ids[n + c : n + 2 * c])
    d = RoutingTrace.decode(t.encode(codec="raw"))
    assert d == t


# -------------------------------------------------------------------- codec


def skewed_trace(rows, layers, e, k, seed, *, missing_frac=0.02):
    """Rows drawn without replacement from a Zipf-like expert popularity."""
    g = make_generator(seed)
    pop = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 0.8
    pop = pop[torch.randperm(e, generator=g)]
    ids = torch.multinomial(pop.expand(rows * layers, e), k, generator=g)
    ids = ids.reshape(rows, layers, k).to(ids_dtype(e))
    cu = torch.tensor([0, rows // 3, rows], dtype=torch.int64)
    tok = torch.rand(rows, generator=g) < missing_frac
    missing = tok[:, None].expand(rows, layers).clone()
    reason = tok.to(torch.uint8) * int(MissingReason.PREEMPTED)
    return RoutingTrace(
        ids, cu, e, layer_ids=range(3, 3 + layers), missing=missing, missing_reason=reason
    )


@pytest.mark.parametrize(
    "e,k", [(256, 8), (128, 8), (8, 2), (300, 6), (16, 16), (3, 1), (64, 1), (160, 8)]
)
@pytest.mark.parametrize("codec", ["set", "raw"])
def test_codec_round_trip_is_bit_exact(e, k, codec):
    t = skewed_trace(257, 3, e, k, seed=e + k)
    data = t.encode(codec=codec)
    d = RoutingTrace.decode(data)
    want = t.canonical(sort=codec == "set")
    assert torch.equal(d.expert_ids, want.expert_ids)  # bitwise, every row
    assert torch.equal(d.missing, want.missing) and torch.equal(d.missing_reason, t.missing_reason)
    assert torch.equal(d.cu_seqlens, t.cu_seqlens) and d.layer_ids.tolist() == [3, 4, 5]
    d.validate()
    assert RoutingTrace.decode(d.encode(codec=codec)).expert_ids.equal(d.expert_ids)


def test_set_codec_size_is_within_5_percent_of_the_bound():
    import math

    from compass_kernels.routing import _setcode

    for e, k in ((256, 8), (128, 8), (384, 8), (160, 8), (8, 2), (64, 6), (16, 4), (3, 1)):
        group, bits = _setcode.layout(e, k)
        bound = math.log2(math.comb(e, k))
        assert bits / group <= bound * 1.05 + 1e-9, (e, k, bits / group, bound)
        rows = 10_000
        assert _setcode.payload_bytes(rows, e, k) <= math.ceil(rows * bound * 1.05 / 8) + 8
    assert _setcode.layout(256, 8) == (1, 49)


def test_codec_rejects_corruption_and_bad_versions():
    t = skewed_trace(50, 2, 64, 4, seed=1)
    data = bytearray(t.encode())
    with pytest.raises(TraceError, match="checksum mismatch"):
        bad = bytearray(data)
        bad[-3] ^= 0x10
        RoutingTrace.decode(bytes(bad))
    with pytest.raises(TraceError, match="bad magic"):
        RoutingTrace.decode(b"XXXX" + bytes(data[4:]))
    with pytest.raises(TraceError, match="format version 9"):
        RoutingTrace.decode(bytes(data[:4]) + (9).to_bytes(2, "little") + bytes(data[6:]))
    with pytest.raises(TraceError, match="shorter than the 64-byte header"):
        RoutingTrace.decode(bytes(data[:10]))
    with pytest.raises(TraceError, match="body is"):
        RoutingTrace.decode(bytes(data[:-1]))
    with pytest.raises(ValueError, match="codec: expected one of"):
        t.encode(codec="zstd")


def test_set_codec_errors_name_the_row():
    from compass_kernels.routing import _setcode

    ids = torch.tensor([[0, 1], [2, 2]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="ids: expert 2 twice in row 1"):
        _setcode.encode_sets(ids, 8)
    with pytest.raises(ValueError, match=r"ids: expert id 9 out of range \[0, 8\) at row 0"):
        _setcode.encode_sets(torch.tensor([[9, 1]], dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="C\\(num_experts, top_k\\) < 2\\^64"):
        _setcode.layout(1024, 16)


def test_layer_lookup_by_global_number_not_position():
    t = make_trace([4, 3], layers=(3, 5, 9), mtp=(0,), missing_frac=0.3, seed=12)
    ids, valid = t.layer(5)
    assert torch.equal(ids, t.expert_ids[:, 1]) and torch.equal(valid, ~t.missing[:, 1])
    ids_mtp, _ = t.layer(0, mtp=True)
    assert torch.equal(ids_mtp, t.expert_ids[:, 3])
    with pytest.raises(TraceError, match=r"layer 0: the trace has no column .*\[3, 5, 9\]"):
        t.layer(0)  # a dense layer (or MTP depth 0 asked as a decoder layer)
    with pytest.raises(TraceError, match="MTP layer 1: the trace has no column"):
        t.layer(1, mtp=True)
    stage = t.slice(layers=range(5, 10))
    assert stage.column(9) == 1
    with pytest.raises(TraceError, match="layer 3: the trace has no column"):
        stage.layer(3)
    assert make_trace([2]).layer(3)[1] is None


# ------------------------------------------------- row-count contract (issue 21)


def _conversation(rows, *, seed=0, e=16, k=4):
    """One sequence's full trace of ``rows`` rows (rows + 1 tokens)."""
    return make_trace([rows], e=e, k=k, seed=seed)


def _turn(full, lo, hi, *, token_lens=None):
    s = _rows(full, 0, lo, hi)
    return (
        s
        if token_lens is None
        else RoutingTrace(
            s.expert_ids, s.cu_seqlens, s.num_experts, layer_ids=s.layer_ids, token_lens=token_lens
        )
    )


def test_resumed_sequence_is_never_doubled():
    # Issue example: a resumed request whose engine returns its whole history again
    # (8 rows for 9 tokens) stitched onto the first segment (7 rows): 15 rows for 9 tokens.
    full = _conversation(8, seed=11)
    first, again = _turn(full, 0, 7), _turn(full, 0, 8)
    with pytest.raises(TraceError, match="stitch: sequence 0: the later turn's first 7 rows"):
        first.stitch(again)  # no counts: the overlap is seen and refused, never appended
    assert first.stitch(again, start=[0]) == full
    # With the capture's token counts the start is known: the rows are compared, not doubled.
    a = _turn(full, 0, 7, token_lens=[8])
    b = _turn(full, 0, 8, token_lens=[9])
    s = a.stitch(b)
    assert s.seq_lens() == [8] and s.token_lens == [9] and s.validate() is s
    # A 15-row trace for 9 tokens (stitched the old way) is refused everywhere.
    doubled = RoutingTrace.concat([first, again]).sequences([0])
    doubled = RoutingTrace(
        torch.cat([first.expert_ids, again.expert_ids]),
        torch.tensor([0, 15]),
        16,
        layer_ids=[1, 3, 4],
        token_lens=[9],
    )
    with pytest.raises(TraceError, match="sequence 0: 15 rows for 9 tokens"):
        doubled.validate()
    with pytest.raises(TraceError, match="sequence 0: 15 rows for 9 tokens"):
        doubled.slice()
    with pytest.raises(TraceError, match="has 15 rows but only 9 tokens"):
        RoutingTrace(doubled.expert_ids, doubled.cu_seqlens, 16, layer_ids=[1, 3, 4]).slice(
            token_lens=[9]
        )


def test_three_whole_history_turns_give_the_conversation_once():
    # Issue example: three turns each returning the whole conversation (6, 13, 19 rows)
    # concatenated give 38 rows for 20 tokens.
    full = _conversation(19, seed=12)
    t1, t2, t3 = _turn(full, 0, 6), _turn(full, 0, 13), _turn(full, 0, 19)
    with pytest.raises(TraceError, match="may hold the whole history again"):
        t1.stitch(t2)
    naive = torch.cat([t.expert_ids for t in (t1, t2, t3)])
    naive = RoutingTrace(naive, torch.tensor([0, 38]), 16, layer_ids=[1, 3, 4], token_lens=[20])
    with pytest.raises(TraceError, match="sequence 0: 38 rows for 20 tokens"):
        naive.validate()
    c1, c2, c3 = (_turn(full, 0, r, token_lens=[r + 1]) for r in (6, 13, 19))
    s = c1.stitch(c2).stitch(c3)
    assert s == RoutingTrace(
        full.expert_ids, full.cu_seqlens, 16, layer_ids=[1, 3, 4], token_lens=[20]
    )
    # Prefix omission with counts: turn 2 returns only its new rows (7 .. 12).
    p2 = _turn(full, 6, 13, token_lens=[14])
    assert c1.stitch(p2).stitch(c3).seq_lens() == [19]
    # A later turn's rows that disagree with the earlier ones name the token.
    bad = full.expert_ids.clone()
    bad[3, 0] = torch.tensor([15, 14, 13, 12], dtype=torch.uint8)
    wrong = RoutingTrace(bad[:13], torch.tensor([0, 13]), 16, layer_ids=[1, 3, 4], token_lens=[14])
    with pytest.raises(TraceError, match="sequence 0, token 3, layer 1: the turns disagree"):
        c1.stitch(wrong)
    # A later turn shorter than the conversation so far.
    with pytest.raises(TraceError, match="the later turn is shorter than the conversation"):
        c2.stitch(c1)


def test_short_trace_raises_unless_accepted_by_name():
    # Issue example: 17,804 rows for 18,058 tokens (254 short).
    full = make_trace([17_804], e=8, k=2, layers=(0,), seed=13)
    with pytest.raises(TraceError, match="sequence 0: 17804 rows for 18058 tokens"):
        full.slice(token_lens=[18_058])
    known = RoutingTrace(full.expert_ids, full.cu_seqlens, 8, layer_ids=[0], token_lens=[18_058])
    with pytest.raises(TraceError, match="sequence 0: 17804 rows for 18058 tokens .* 253 input"):
        known.validate()
    with pytest.raises(TraceError, match="sequence 0: 17804 rows for 18058 tokens"):
        known.slice()
    assert not bool(known.validate(raise_on_error=False))
    with pytest.raises(TraceError, match="more than max_missing_fraction=0.01"):
        known.validate(max_missing_fraction=0.01)
    assert known.validate(max_missing_fraction=0.02) is known
    with pytest.raises(TraceError, match="253 input tokens short of a row"):
        full.slice(token_lens=[18_058], max_missing_fraction=0.01)
    local = full.slice(token_lens=[18_058], max_missing_fraction=0.02)
    assert local.missing_counts() == {"SHORT": 253, "NO_ROW": 1}
    # The sliced trace keeps the opt-in visible: validate (and TraceReplay) need it too.
    with pytest.raises(TraceError, match=r"token 17804 \(row 17804\): no row .*reason SHORT"):
        local.validate()
    local.validate(max_missing_fraction=0.02)
    # The trace's own omitted prefix is short too (rows end at the last input token).
    tail = RoutingTrace(
        full.expert_ids[4:], torch.tensor([0, 17_800]), 8, layer_ids=[0], token_lens=[17_805]
    )
    with pytest.raises(TraceError, match="4 input tokens have no row"):
        tail.validate()
    s = tail.slice(max_missing_fraction=0.001)
    assert s.missing_counts() == {"SHORT": 4, "NO_ROW": 1}
    assert torch.equal(s.expert_ids[4:17_804], full.expert_ids[4:])


def test_token_lens_travel_with_the_trace():
    t = RoutingTrace(
        make_trace([3, 5]).expert_ids,
        torch.tensor([0, 3, 8]),
        16,
        layer_ids=[1, 3, 4],
        token_lens=[4, 7],
    )
    assert t.has_token_lens and t.token_lens == [4, 7]
    assert t.sequence(1).token_lens == [7] and t.sequences([1, 0]).token_lens == [7, 4]
    assert RoutingTrace.concat([t, make_trace([2])]).token_lens == [4, 7, 3]
    assert t.canonical().token_lens == [4, 7] and t.to("cpu").token_lens == [4, 7]
    assert not make_trace([2]).has_token_lens and make_trace([2]).token_lens == [3]
    with pytest.raises(ValueError, match="token_lens: expected 2 entries"):
        RoutingTrace(t.expert_ids, t.cu_seqlens, 16, layer_ids=[1, 3, 4], token_lens=[4])
    with pytest.raises(ValueError, match="token_lens: expected counts >= 1"):
        RoutingTrace(t.expert_ids, t.cu_seqlens, 16, layer_ids=[1, 3, 4], token_lens=[0, 7])
    # more than one NO_ROW token in a sequence: a short sliced trace made by hand
    m = torch.zeros(8, dtype=torch.bool)
    m[[6, 7]] = True
    r = m.to(torch.uint8) * int(MissingReason.NO_ROW)
    hand = RoutingTrace(
        t.expert_ids, t.cu_seqlens, 16, layer_ids=[1, 3, 4], missing=m, missing_reason=r
    )
    with pytest.raises(TraceError, match=r"sequence 1, token 3 \(row 6\): no row .*NO_ROW"):
        hand.validate()
