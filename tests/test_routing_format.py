"""The RoutingTrace byte format (compass_kernels/routing/codec.py): version 2's
header inside the CRC, version-1 payloads still decoded (fixtures written by
the version-1 encoder), every decode failure a TraceError naming the field, the
raw codec checking ids like the set codec, token counts round-tripped, and
E = 32,767 / 32,768 through every RoutingTrace method."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import pytest
import torch

from compass_kernels.routing import MissingReason, RoutingTrace, TraceError, replay_topk
from compass_kernels.routing import codec as fmt
from compass_kernels.routing.reference import replay_topk_reference
from compass_kernels.testing import make_generator

FIXTURES = Path(__file__).parent / "fixtures"


def v1_recipe(e: int) -> RoutingTrace:
    """The trace tests/fixtures/routing_trace_v1_e{e}_{codec}.bin were encoded from
    (by the version-1 encoder): a formula, no RNG, so it cannot drift."""
    lens, cols, k = [5, 0, 7], 3, 4
    n = sum(lens)
    t = torch.arange(n).view(n, 1, 1)
    c = torch.arange(cols).view(1, cols, 1)
    j = torch.arange(k).view(1, 1, k)
    ids = (t * 7 + c * 3 + j * (e // k)) % e
    miss = torch.zeros(n, cols, dtype=torch.bool)
    miss[2, 1] = True
    miss[9] = True
    reason = torch.zeros(n, dtype=torch.uint8)
    reason[2] = int(MissingReason.PREEMPTED)
    reason[9] = int(MissingReason.PREFIX_CACHE)
    return RoutingTrace(
        ids.to(torch.uint8 if e <= 256 else torch.int16),
        torch.tensor([0, 5, 5, 12]),
        e,
        layer_ids=[3, 5],
        mtp_layer_ids=[0],
        missing=miss,
        missing_reason=reason,
    )


def reseal_v1(data: bytes) -> bytes:
    """A version-1 payload whose body CRC is made right again (header unchanged)."""
    buf = bytearray(data)
    struct.pack_into("<I", buf, 56, zlib.crc32(bytes(buf[64:])))
    return bytes(buf)


def reseal(buf: bytearray) -> bytes:
    """A version-2 payload with its CRC (header with the field zeroed, then body) redone."""
    buf[56:60] = b"\0\0\0\0"
    struct.pack_into("<I", buf, 56, zlib.crc32(bytes(buf)))
    return bytes(buf)


@pytest.mark.parametrize("e", [256, 300])
@pytest.mark.parametrize("codec", ["set", "raw"])
def test_version_1_payloads_still_decode(e, codec):
    data = (FIXTURES / f"routing_trace_v1_e{e}_{codec}.bin").read_bytes()
    assert struct.unpack_from("<H", data, 4)[0] == 1
    d = RoutingTrace.decode(data)
    assert d == v1_recipe(e).canonical(sort=codec == "set")
    assert not d.has_token_lens
    # and re-encoded as version 2, bit-exact through the new format
    again = d.encode(codec=codec)
    assert struct.unpack_from("<H", again, 4)[0] == fmt.VERSION == 2
    assert RoutingTrace.decode(again) == d


def test_every_header_byte_is_inside_the_checksum():
    t = v1_recipe(256)
    t = RoutingTrace(
        t.expert_ids,
        t.cu_seqlens,
        256,
        layer_ids=[3, 5],
        mtp_layer_ids=[0],
        missing=t.missing,
        missing_reason=t.missing_reason,
        token_lens=[6, 1, 9],
    )
    for codec in ("set", "raw"):
        data = t.encode(codec=codec)
        assert RoutingTrace.decode(data) == t.canonical(sort=codec == "set")
        for byte in range(64):
            for bit in (0, 3, 7):
                bad = bytearray(data)
                bad[byte] ^= 1 << bit
                with pytest.raises(TraceError):  # never another valid trace
                    RoutingTrace.decode(bytes(bad))


def test_header_tampering_was_silent_in_version_1_and_is_named_now():
    # Version 1 covers only the body: a flipped num_experts decoded into another
    # valid trace. The version-1 reader now checks every header field it can.
    data = (FIXTURES / "routing_trace_v1_e300_raw.bin").read_bytes()
    for experts, match in (
        (0, "num_experts 0 outside"),
        (40_000, "num_experts 40000 outside"),
        (3, "top_k 4 outside"),
    ):
        bad = bytearray(data)
        struct.pack_into("<I", bad, 8, experts)
        with pytest.raises(TraceError, match=match):
            RoutingTrace.decode(bytes(bad))
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 32, 13)  # num_rows
    with pytest.raises(TraceError, match="header's sizes .* need a"):
        RoutingTrace.decode(bytes(bad))
    bad = bytearray(data)
    bad[7] = 0x80  # unknown flag
    with pytest.raises(TraceError, match="unknown flags 0x80 for format version 1"):
        RoutingTrace.decode(bytes(bad))
    bad = bytearray(data)
    bad[6] = 7
    with pytest.raises(TraceError, match="unknown codec id 7"):
        RoutingTrace.decode(bytes(bad))


def test_v1_body_faults_are_trace_errors_naming_the_field():
    data = bytearray((FIXTURES / "routing_trace_v1_e256_raw.bin").read_bytes())
    body = 64
    cases = {
        "layer_ids": (body + 0, 9, "layer_ids: expected strictly increasing"),
        "cu_seqlens": (body + 24 + 8, 7, r"cu_seqlens \[0, 7, 5, 12\]"),
        "reason": (body + 24 + 32 + 5 + 3, 3, "missing_reason 3 at row 3 does not match"),
    }
    for _name, (at, value, match) in cases.items():
        bad = bytearray(data)
        bad[at] = value
        with pytest.raises(TraceError, match=match):
            RoutingTrace.decode(reseal_v1(bytes(bad)))
    # a raw payload row with a repeated expert (the set codec cannot express one)
    bad = bytearray(data)
    payload = len(data) - 12 * 3 * 4
    bad[payload + 1] = bad[payload]
    with pytest.raises(TraceError, match="decode: duplicate expert within a row at sequence 0"):
        RoutingTrace.decode(reseal_v1(bytes(bad)))


def test_raw_codec_checks_ids_like_the_set_codec():
    zeros = RoutingTrace(torch.zeros(3, 2, 4, dtype=torch.uint8), torch.tensor([0, 3]), 16)
    for codec in ("set", "raw"):  # all-zero rows: expert 0 four times
        with pytest.raises(ValueError, match="twice|duplicate expert"):
            zeros.encode(codec=codec)
    ids = torch.tensor([[[0, 1, 2, 17]]], dtype=torch.uint8)
    oob = RoutingTrace(ids, torch.tensor([0, 1]), 17)
    with pytest.raises(TraceError, match=r"encode: expert id out of range \[0, 17\)"):
        oob.encode(codec="raw")
    # missing rows are never read (and come back as 0..K-1)
    m = torch.ones(3, 2, dtype=torch.bool)
    ok = RoutingTrace(zeros.expert_ids, zeros.cu_seqlens, 16, missing=m)
    assert RoutingTrace.decode(ok.encode(codec="raw")) == ok


def test_token_lens_round_trip():
    t = v1_recipe(300)
    for tl in (None, [6, 1, 8]):
        x = RoutingTrace(
            t.expert_ids,
            t.cu_seqlens,
            300,
            layer_ids=[3, 5],
            mtp_layer_ids=[0],
            missing=t.missing,
            missing_reason=t.missing_reason,
            token_lens=tl,
        )
        for codec in ("set", "raw"):
            d = RoutingTrace.decode(x.encode(codec=codec))
            assert d.has_token_lens == (tl is not None) and d == x.canonical(sort=codec == "set")


def _big_e_trace(e: int, k: int, rows=(3, 4), seed=0) -> RoutingTrace:
    g = make_generator(seed)
    n = sum(rows)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n * 2)])
    ids[0, 0] = e - 1  # the largest id
    ids[1, :2] = torch.tensor([e - 1, 0])
    cu = torch.tensor([0, rows[0], n])
    return RoutingTrace(ids.view(n, 2, k).to(torch.int16), cu, e, layer_ids=[0, 2])


@pytest.mark.parametrize("e", [32_767, 32_768])
@pytest.mark.parametrize("k", [4, 8])
def test_largest_expert_counts_work_in_every_method(e, k):
    t = _big_e_trace(e, k, seed=e + k)
    assert t.validate() is t  # E = 32768: no int16 wrap of the bound
    for codec in ("set", "raw"):
        d = RoutingTrace.decode(t.encode(codec=codec))
        assert d == t.canonical(sort=codec == "set")
    assert (math.comb(e, k) >= 2**64) == bool(fmt._wide_bits(e, k))  # K=8: the wide layout
    s = t.slice(layers=[2])
    assert s.num_tokens == 9 and torch.equal(s.expert_ids[:3], t.expert_ids[:3, 1:])
    assert t.stitch(t, start=[0, 0]) == t
    assert RoutingTrace.concat([t, t]).sequences([1]).num_tokens == 4
    bad = t.expert_ids.clone()
    bad[2, 1, 0] = -1
    with pytest.raises(TraceError, match=rf"out of range \[0, {e}\) at sequence 0, token 2"):
        RoutingTrace(bad, t.cu_seqlens, e, layer_ids=[0, 2]).validate()
    with pytest.raises(ValueError, match="out of range"):
        RoutingTrace(bad, t.cu_seqlens, e, layer_ids=[0, 2]).encode(codec="set")
    ids, _ = t.layer(0)
    logits = torch.randn(ids.shape[0], e, generator=make_generator(1))
    res = replay_topk(logits, ids)
    w, *_ = replay_topk_reference(logits.double(), ids.to(torch.int64))
    torch.testing.assert_close(res.weights.double(), w, rtol=1e-5, atol=1e-6)
    assert torch.equal(res.expert_ids, ids.to(torch.int64))


def test_wide_set_payload_names_a_corrupted_row():
    t = _big_e_trace(32_768, 8)
    buf = bytearray(t.encode(codec="set"))
    buf[-1] ^= 0x40  # the last row's last id: now not ascending / out of order
    with pytest.raises(TraceError, match="set payload row 13 is not 8 distinct ascending"):
        RoutingTrace.decode(reseal(buf))
