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


SHAPES = [(256, 8), (128, 8), (256, 5), (200, 7), (64, 3), (160, 6), (16, 1), (255, 8),
          (8, 2), (12, 4), (384, 8), (300, 3), (1024, 6), (64, 10), (20, 20), (67, 50)]  # fmt: skip


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
