"""The set codec's kernels (csrc/routing/codec_cpu.cpp, setcode.h) against a
pure-Python reference of the format: payload bytes bit for bit, both builds
(AVX2 and the x86-64 baseline), every code path (AVX2 row loads with K < 8
and the array tail, the word and direct-store unrank, G > 1 packs, the
bisection path without hints, the OpenMP chunks), missing rows, and errors
naming the row or the pack."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compass_kernels.routing import _setcode, ids_dtype
from compass_kernels.testing import make_generator

IMPLS = [0, 1]  # 0: AVX2 where the CPU has it, 1: the x86-64 baseline


def ref_layout(e: int, k: int) -> tuple[int, int]:
    n = math.comb(e, k)
    g = 1
    while n > 1 and g < 64 and n ** (g + 1) <= 2**64:
        g += 1
    return g, (n**g - 1).bit_length()


def ref_rank(row) -> int:
    return sum(math.comb(int(a), i + 1) for i, a in enumerate(sorted(int(x) for x in row)))


def ref_payload(ids: np.ndarray, e: int, k: int, missing=None) -> bytes:
    """The format, spelled out: rank per row (missing rows: 0), G rows per
    mixed-radix pack, B bits per pack, least significant bit first."""
    n = math.comb(e, k)
    g, b = ref_layout(e, k)
    rows = ids.shape[0]
    ranks = [0 if missing is not None and missing[r] else ref_rank(ids[r]) for r in range(rows)]
    acc = 0
    for p in range(-(-rows // g)):
        v = 0
        for r in reversed(ranks[p * g : (p + 1) * g]):
            v = v * n + r
        acc |= v << (p * b)
    return acc.to_bytes((-(-rows // g) * b + 7) // 8, "little")


def random_sets(rows: int, e: int, k: int, seed: int) -> torch.Tensor:
    """Distinct ids per row, in random order (as a router writes them)."""
    g = make_generator(seed)
    if e <= 64:
        return torch.rand(rows, e, generator=g).argsort(-1)[:, :k].to(ids_dtype(e))
    ids = torch.multinomial(torch.ones(rows, e), k, generator=g)  # without replacement
    return ids.to(ids_dtype(e))


SHAPES = [
    (256, 8),
    (128, 8),
    (256, 5),
    (200, 7),
    (64, 3),
    (160, 6),
    (16, 1),
    (255, 8),
    (8, 2),
    (12, 4),
    (384, 8),
    (300, 3),
    (1024, 6),
    (64, 10),
    (20, 20),
    (67, 50),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e,k", SHAPES)
def test_payload_matches_the_reference_bit_for_bit(e, k, impl):
    rows = 301  # odd: a partial AVX2 tail, a partial unrank batch, a partial pack
    ids = random_sets(rows, e, k, seed=e * 100 + k)
    assert _setcode.layout(e, k) == ref_layout(e, k)
    payload = _setcode.encode_sets(ids, e, impl=impl)
    assert payload == ref_payload(ids.numpy(), e, k)
    back = _setcode.decode_sets(payload, rows, k, e, ids.dtype, impl=impl)
    assert torch.equal(back, ids.sort(-1).values)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e,k", [(256, 8), (128, 8), (384, 8), (8, 2), (96, 5)])
def test_parallel_chunks_round_trip(e, k, impl):
    """More rows than the parallel threshold (2^16), not a multiple of 8 packs:
    the OpenMP chunks meet on byte boundaries and agree with one thread."""
    rows = 70_001
    ids = random_sets(rows, e, k, seed=e + k)
    payload = _setcode.encode_sets(ids, e, impl=impl)
    g, b = ref_layout(e, k)
    head = 997  # the first packs (whole bytes)
    full = head // g * b // 8
    assert payload[:full] == ref_payload(ids[:head].numpy(), e, k)[:full]
    tail_rows = 1003  # the last packs, past the last chunk boundary
    first = (rows - tail_rows) // (8 * g) * (8 * g)  # a byte-aligned pack start
    tail = ref_payload(ids[first:].numpy(), e, k)
    assert payload[first // g * b // 8 :] == tail
    back = _setcode.decode_sets(payload, rows, k, e, ids.dtype, impl=impl)
    assert torch.equal(back, ids.sort(-1).values)
    other = _setcode.encode_sets(ids, e, impl=1 - impl)
    assert other == payload


@pytest.mark.parametrize("impl", IMPLS)
def test_missing_rows_are_coded_as_the_first_k_without_reading_them(impl):
    e, k, rows = 256, 8, 1000
    ids = random_sets(rows, e, k, seed=3)
    g = make_generator(4)
    missing = torch.rand(rows, generator=g) < 0.2
    junk = ids.clone()
    junk[missing] = 7  # duplicates: invalid, but never read
    junk[missing.nonzero()[:3, 0], 0] = 255
    payload = _setcode.encode_sets(junk, e, missing=missing, impl=impl)
    assert payload == ref_payload(ids.numpy(), e, k, missing=missing.numpy())
    back = _setcode.decode_sets(payload, rows, k, e, ids.dtype, impl=impl)
    want = torch.where(missing[:, None], torch.arange(k, dtype=ids.dtype), ids.sort(-1).values)
    assert torch.equal(back, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows,bad", [(50, 49), (70_000, 69_999), (70_000, 33_000), (9, 0)])
def test_bad_rows_are_named_in_every_path(rows, bad, impl):
    e, k = 128, 6
    ids = random_sets(rows, e, k, seed=rows + bad)
    dup = ids.clone()
    dup[bad, 3] = dup[bad, 1]
    with pytest.raises(ValueError, match=rf"ids: expert {int(dup[bad, 1])} twice in row {bad}$"):
        _setcode.encode_sets(dup, e, impl=impl)
    out = ids.clone()
    out[bad, 2] = 200
    msg = rf"ids: expert id 200 out of range \[0, 128\) at row {bad}"
    with pytest.raises(ValueError, match=msg):
        _setcode.encode_sets(out, e, impl=impl)
    neg = ids.to(torch.int16)
    neg[bad, 0] = -1
    with pytest.raises(ValueError, match=rf"expert id -1 out of range \[0, 128\) at row {bad}"):
        _setcode.encode_sets(neg, e, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e,k", [(256, 8), (8, 2), (384, 8)])
def test_corrupted_payload_names_the_pack(e, k, impl):
    rows = 4000
    ids = random_sets(rows, e, k, seed=9)
    payload = bytearray(_setcode.encode_sets(ids, e, impl=impl))
    g, b = ref_layout(e, k)
    pack = 1234 // g
    for i in range(b):  # all ones: past C(E, K)^G
        o = pack * b + i
        payload[o // 8] |= 1 << (o % 8)
    with pytest.raises(ValueError, match=rf"data: pack {pack} holds a value past C\({e}, {k}\)"):
        _setcode.decode_sets(bytes(payload), rows, k, e, ids.dtype, impl=impl)


def test_layout_argument_errors():
    ids = random_sets(10, 64, 4, seed=1)
    with pytest.raises(ValueError, match="impl: expected 0 \\(auto\\) or 1"):
        _setcode.encode_sets(ids, 64, impl=2)
    out = torch.empty(3, dtype=torch.uint8)
    assert _setcode.payload_bytes(10, 64, 4) == 29  # G=3 rows per 58-bit pack, 4 packs
    with pytest.raises(ValueError, match="out: expected 29 bytes, got 3"):
        _setcode.encode_into(ids, 64, out)
    with pytest.raises(ValueError, match="missing: expected size 10"):
        _setcode.encode_sets(ids, 64, missing=torch.zeros(9, dtype=torch.bool))
    with pytest.raises(ValueError, match="data: expected 29 bytes for 10 rows, got 28"):
        _setcode.decode_sets(bytes(28), 10, 4, 64, torch.uint8)


# ------------------------------------------------------ the R12 decode (AVX2)
# uint8 ids, K in {6, 8}, one rank per pack of <= 52 bits: rows unranked 8 at a
# time straight from the payload (codec_cpu.cpp decode_packs_r12); impl=1 runs
# the baseline build's level-by-level unrank on the same input.
R12_SHAPES = [(256, 8), (128, 8), (255, 8), (160, 6), (256, 6), (129, 8)]


def edge_sets(e: int, k: int) -> torch.Tensor:
    """Rows whose rank sits on a level boundary or just below one: {0..k-2, a}
    (rank C(a, k)), the runs {a-k+1..a} (the largest rank below C(a+1, k)), and
    for each lower level m, {0..m-2, a} under the top k-m ids (a level-m
    remainder of exactly C(a, m)), in random order within each row."""
    rows = []
    for a in range(k - 1, e):
        rows.append(list(range(k - 1)) + [a])
        rows.append(list(range(a - k + 1, a + 1)))
    for m in range(2, k):
        top = list(range(e - (k - m), e))
        for a in range(m - 1, e - (k - m)):
            rows.append(list(range(m - 1)) + [a] + top)
    ids = torch.tensor(rows, dtype=torch.uint8)
    order = torch.rand(ids.shape, generator=make_generator(e + k)).argsort(-1)
    return ids.gather(1, order)


def decode_poisoned(payload: bytes, rows: int, k: int, e: int, impl: int) -> torch.Tensor:
    out = torch.full((rows, k), 0xEE, dtype=torch.uint8)  # every byte must be written
    _setcode.decode_into(torch.frombuffer(bytearray(payload), dtype=torch.uint8), e, out, impl=impl)
    return out


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 301, 4099])
@pytest.mark.parametrize("e,k", R12_SHAPES)
def test_r12_decode_matches_the_reference_and_the_level_unrank(e, k, rows):
    assert _setcode.decode_path(e, k, torch.uint8, 0) == "r12"
    assert _setcode.decode_path(e, k, torch.uint8, 1) == "hint"
    assert _setcode.decode_path(e, k, torch.int16, 0) == "hint"
    ids = random_sets(rows, e, k, seed=e * 7 + k * 3 + rows)
    payload = _setcode.encode_sets(ids, e)
    if rows <= 301:
        assert payload == ref_payload(ids.numpy(), e, k)
    want = ids.sort(-1).values
    for impl in (0, 1):
        assert torch.equal(decode_poisoned(payload, rows, k, e, impl), want), impl


@pytest.mark.parametrize("e,k", R12_SHAPES)
def test_r12_decode_of_ranks_on_level_boundaries(e, k):
    ids = edge_sets(e, k)
    rows = ids.shape[0]
    payload = _setcode.encode_sets(ids, e)
    assert payload == ref_payload(ids.numpy(), e, k)
    back = decode_poisoned(payload, rows, k, e, 0)
    assert torch.equal(back, ids.sort(-1).values)
    assert torch.equal(back, decode_poisoned(payload, rows, k, e, 1))


@pytest.mark.parametrize("e,k", [(256, 8), (128, 8), (160, 6)])
@pytest.mark.parametrize("pack", [0, 1234, 4095, 4099, 4100])  # batches; the last, partial one
def test_r12_decode_names_the_corrupted_pack(e, k, pack):
    rows = 4101  # 512 batches of 8, then 5 packs read one by one at the payload's end
    ids = random_sets(rows, e, k, seed=pack)
    payload = bytearray(_setcode.encode_sets(ids, e))
    _, b = ref_layout(e, k)
    for i in range(b):  # all ones: past C(E, K)
        o = pack * b + i
        payload[o // 8] |= 1 << (o % 8)
    msg = rf"data: pack {pack} holds a value past C\({e}, {k}\)"
    for impl in (0, 1):
        with pytest.raises(ValueError, match=msg):
            _setcode.decode_sets(bytes(payload), rows, k, e, torch.uint8, impl=impl)


@pytest.mark.parametrize("impl", [0, 1])
def test_parallel_decode_names_the_first_corrupted_pack(impl):
    """Over 2^16 rows the packs are decoded in chunks of ~2^14 rows taken in
    turn by the threads: with two corrupted chunks the first one is named."""
    e, k, rows = 256, 8, 70_001
    payload = bytearray(_setcode.encode_sets(random_sets(rows, e, k, seed=5), e))
    _, b = ref_layout(e, k)
    for pack in (60_000, 20_003):
        for i in range(b):
            o = pack * b + i
            payload[o // 8] |= 1 << (o % 8)
    prev = _setcode.set_threads(2)
    try:
        with pytest.raises(ValueError, match=r"data: pack 20003 holds a value past"):
            _setcode.decode_sets(bytes(payload), rows, k, e, torch.uint8, impl=impl)
    finally:
        _setcode.set_threads(prev)


def test_decode_impl_argument_is_checked():
    payload = _setcode.encode_sets(random_sets(10, 256, 8, seed=2), 256)
    with pytest.raises(ValueError, match=r"impl: expected 0 \(auto\) or 1 \(baseline x86-64\)"):
        _setcode.decode_sets(payload, 10, 8, 256, torch.uint8, impl=2)
    with pytest.raises(ValueError, match="impl: expected 0 .* got -1"):
        _setcode.decode_path(256, 8, torch.uint8, -1)


# ------------------------------------------------- the encode op, every backend
# The GPU encoder (Triton, compass_kernels/routing/triton_setcode.py) runs here
# in the interpreter on CPU tensors: the payload must equal the pure-Python
# format and the C++ encoder byte for byte.
from compass_kernels.routing.codec import encode as encode_trace  # noqa: E402
from compass_kernels.testing import empty_poisoned  # noqa: E402
from tests.tiers import device_for  # noqa: E402

TRITON = pytest.param("triton", marks=pytest.mark.triton)
ENCODE_BACKENDS = ["cpp", TRITON]


def ref_table(e: int, k: int) -> torch.Tensor:
    sat = 2**64 - 1
    vals = [min(math.comb(a, m), sat) for m in range(1, k + 1) for a in range(e)]
    return torch.tensor([v - 2**64 if v >= 2**63 else v for v in vals], dtype=torch.int64)


def run_encode_op(backend, ids, e, missing=None):
    """The op with poisoned outputs (every byte must be written), on the
    backend's device; the outputs come back on the CPU."""
    rows, k = ids.shape
    dev = device_for(backend)
    outs = (
        empty_poisoned(_setcode.payload_bytes(rows, e, k), torch.uint8, device=dev),
        empty_poisoned(2, torch.int64, device=dev),
        empty_poisoned(k * e, torch.int64, device=dev),
    )
    missing = missing.to(dev) if missing is not None else None
    res = _setcode.encode_sets_op.run(
        ids=ids.to(dev), num_experts=e, missing=missing, backend=backend, out=outs
    )
    return tuple(t.cpu() for t in res)


# (E, K, rows): G = 1 over several programs of 64 packs with a partial last
# word; G > 1 (E=8, K=2: 13 rows per 63-bit pack) over several programs; B = 0
# (K == E); int16 ids; K = 50 (a 64-wide id tile); K = 1; E past one chunk of
# the table scan (1024).
ENCODE_CASES = [
    (256, 8, 601),
    (128, 8, 257),
    (8, 2, 3401),
    (20, 20, 37),
    (300, 3, 515),
    (67, 50, 70),
    (64, 10, 299),
    (16, 1, 1031),
    (12, 4, 777),
    (200, 7, 263),
    (384, 8, 255),
    (3, 1, 100),
    (2000, 2, 130),
]


@pytest.mark.parametrize("backend", ENCODE_BACKENDS)
@pytest.mark.parametrize("e,k,rows", ENCODE_CASES)
def test_encode_op_matches_the_format_byte_for_byte(backend, e, k, rows):
    ids = random_sets(rows, e, k, seed=7 * e + k + rows)
    payload, status, table = run_encode_op(backend, ids, e)
    assert bytes(payload.numpy()) == ref_payload(ids.numpy(), e, k)
    assert bytes(payload.numpy()) == _setcode.encode_sets(ids, e)  # the C++ encoder
    assert status.tolist() == [0, -1]
    assert torch.equal(table, ref_table(e, k))


@pytest.mark.parametrize("backend", ENCODE_BACKENDS)
def test_encode_op_codes_missing_rows_as_rank_0_without_reading_them(backend):
    e, k, rows = 256, 8, 700
    ids = random_sets(rows, e, k, seed=11)
    missing = torch.rand(rows, generator=make_generator(12)) < 0.25
    junk = ids.clone()
    junk[missing] = 7  # duplicates and, below, out of range: never read
    junk[missing.nonzero()[:5, 0], 2] = 255
    payload, status, _ = run_encode_op(backend, junk, e, missing)
    assert bytes(payload.numpy()) == ref_payload(ids.numpy(), e, k, missing=missing.numpy())
    assert status.tolist() == [0, -1]


@pytest.mark.triton
@pytest.mark.parametrize(
    "e,k,dtype",
    [(128, 6, torch.uint8), (300, 3, torch.int16), (8, 2, torch.uint8), (67, 50, torch.uint8)],
)
def test_gpu_encoder_flags_bad_rows_on_the_device(e, k, dtype):
    """Status counts every bad row and keeps the first (an unsigned atomic min
    over programs); check_status names it as the C++ encoder does."""
    rows = 1500
    ids = random_sets(rows, e, k, seed=e + k).to(dtype)
    bad = ids.clone()
    bad[1203, 1] = bad[1203, 0]  # a duplicate
    bad[911, k - 1] = e  # out of range (the first bad row)
    bad[1400, 0] = e + 1 if dtype == torch.int16 else 255
    if dtype == torch.int16:
        bad[1450, 0] = -3  # negative
    dev = device_for("triton")
    payload, status = _setcode.encode_device(bad.to(dev), e, backend="triton")
    assert status.tolist() == [4 if dtype == torch.int16 else 3, 911]
    with pytest.raises(ValueError, match=rf"ids: expert id {e} out of range \[0, {e}\) at row 911"):
        _setcode.check_status(status, bad, e)
    with pytest.raises(ValueError, match=r"at row 911$"):
        _setcode.encode_sets(bad, e)  # the C++ encoder names the same row
    only_dup = ids.clone()
    only_dup[1203, 1] = only_dup[1203, 0]
    _, status = _setcode.encode_device(only_dup.to(dev), e, backend="triton")
    assert status.tolist() == [1, 1203]
    with pytest.raises(ValueError, match=rf"ids: expert {int(ids[1203, 0])} twice in row 1203"):
        _setcode.check_status(status, only_dup, e)
    # a bad row in a missing row is not read
    _, status = _setcode.encode_device(
        only_dup.to(dev), e, backend="triton", missing=(torch.arange(rows) == 1203).to(dev)
    )
    assert status.tolist() == [0, -1]


@pytest.mark.parametrize("backend", ENCODE_BACKENDS)
def test_encode_op_argument_errors_name_the_argument(backend):
    ids = random_sets(10, 64, 4, seed=1).to(device_for(backend))
    op = _setcode.encode_sets_op
    outs = op.outputs(ids=ids, num_experts=64, missing=None)
    good = dict(ids=ids, num_experts=64, missing=None, backend=backend)
    with pytest.raises(ValueError, match=r"payload: expected size 29"):
        op.run(**good, out=outs._replace(payload=outs.payload[:3]))
    with pytest.raises(ValueError, match=r"table: expected size 256 \(top_k \* num_experts\)"):
        op.run(**good, out=outs._replace(table=outs.table[:5]))
    with pytest.raises(ValueError, match=r"ids: expected dtype uint8 \| int16, got int32"):
        op.run(**(good | {"ids": ids.int()}), out=outs)
    with pytest.raises(ValueError, match="missing: expected size 10"):
        bad = torch.zeros(9, dtype=torch.bool, device=ids.device)
        op.run(**(good | {"missing": bad}), out=outs)
    with pytest.raises(ValueError, match=r"C\(num_experts, top_k\) < 2\^64"):
        big = outs._replace(
            payload=ids.new_empty(0, dtype=torch.uint8),
            table=ids.new_empty(16 * 1024, dtype=torch.int64),
        )
        op.run(
            ids=ids.new_zeros(2, 16, dtype=torch.int16),
            num_experts=1024,
            missing=None,
            backend=backend,
            out=big,
        )
    with pytest.raises(ValueError, match=r"ids: expected a 2-d tensor"):
        _setcode.encode_device(ids.view(-1), 64, backend=backend)


@pytest.mark.parametrize("backend", ["cpp", TRITON])
def test_trace_encoded_on_the_device_path_decodes_bit_exact(backend):
    """codec.encode's device path (the op where the ids live, one copy of
    status | cu_seqlens | missing | reasons | payload, CRC on the host) writes
    the same bytes as the CPU path, missing rows included."""
    from tests.test_routing_trace import skewed_trace

    t = skewed_trace(211, 3, 256, 8, seed=5).to(device_for(backend))
    assert t.missing is not None
    data = encode_trace(t, codec="set", backend=backend)
    assert data == t.encode(codec="set")  # the CPU path
    d = type(t).decode(data)
    assert torch.equal(d.expert_ids, t.canonical(sort=True).expert_ids.cpu())
    bad = t.expert_ids.clone()
    row = int((~t.missing[:, 1]).nonzero()[5, 0])
    bad[row, 1, 3] = bad[row, 1, 0]
    t_bad = type(t)(
        bad,
        t.cu_seqlens,
        t.num_experts,
        layer_ids=t.layer_ids,
        missing=t.missing,
        missing_reason=t.missing_reason,
    )
    with pytest.raises(ValueError, match=rf"twice in row {row * 3 + 1}\b"):
        encode_trace(t_bad, codec="set", backend=backend)


# Planted bugs in the Triton encoder (tests/mutants.py): each must fail a test above.
CODEC_MUTANTS = {
    # the table as an inclusive scan: C(a, m) off by one level
    "table_scan_inclusive": (
        "format",
        "tl.load(prev + a - 1, mask=(a >= 1) & (a < E)",
        "tl.load(prev + a, mask=(a < E)",
    ),
    # the high part of a pack that straddles two words dropped
    "straddling_pack_high_part_dropped": (
        "format",
        "words = tl.sum(low + high, 0)",
        "words = tl.sum(low, 0)",
    ),
    # the last word of each program's block not written (left poisoned)
    "last_word_dropped": (
        "format",
        "mask=(w[:, None] < B) & (at < nbytes)",
        "mask=(w[:, None] < B - 1) & (at < nbytes)",
    ),
    # a row with an expert twice passes as valid
    "dup_check_off": (
        "bad_rows",
        "ok = in_range & (below_sum == K * (K - 1) // 2)",
        "ok = in_range",
    ),
    # a signed atomic min on status[1] = -1 (no bad row) never moves
    "first_bad_row_signed_min": (
        "bad_rows",
        "tl.atomic_min(st + 1, first_bad.to(tl.uint64)",
        "tl.atomic_min(status_ptr + 1, first_bad",
    ),
    # missing rows read (their junk ids flagged, their ranks coded)
    "missing_rows_read": (
        "missing",
        "live &= tl.load(missing_ptr + r, mask=live, other=1) == 0",
        "live &= live",
    ),
}


@pytest.mark.triton
@pytest.mark.parametrize("mutant", list(CODEC_MUTANTS))
def test_triton_encoder_catches_planted_bugs(mutant):
    from compass_kernels.routing import triton_setcode
    from tests.mutants import planted

    test, old, new = CODEC_MUTANTS[mutant]
    op = _setcode.encode_sets_op
    with planted(op, "triton", triton_setcode, "encode_sets_triton", old=old, new=new):
        with pytest.raises(AssertionError):
            if test == "format":
                test_encode_op_matches_the_format_byte_for_byte("triton", 256, 8, 601)
                test_encode_op_matches_the_format_byte_for_byte("triton", 8, 2, 3401)
            elif test == "bad_rows":
                test_gpu_encoder_flags_bad_rows_on_the_device(128, 6, torch.uint8)
            else:
                test_encode_op_codes_missing_rows_as_rank_0_without_reading_them("triton")
    test_encode_op_matches_the_format_byte_for_byte("triton", 8, 2, 3401)  # restored


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(256, 8), (128, 8), (384, 8), (8, 2)])
def test_gpu_encoder_matches_the_cpu_encoder_without_host_sync(e, k):
    rows = 100_003
    ids = random_sets(rows, e, k, seed=e * k)
    want = _setcode.encode_sets(ids, e)
    dev = ids.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        payload, status = _setcode.encode_device(dev, e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert status.tolist() == [0, -1]
    assert bytes(payload.cpu().numpy()) == want
