"""Structure-aware fuzzing of the routing-trace codec's header (ck.routing.codec.decode).

Each case starts from a valid blob, sets header fields to extreme values (0, 1,
powers of two +- 1, near 2^63, the field's maximum), optionally re-derives the
body length, and always recomputes the CRC: the damage reaches the size checks
behind the checksum. ``decode`` must raise :class:`TraceError` or return a trace,
never another exception, and never allocate more than a small multiple of the
blob. The fuzz loop runs in a child process under an address-space limit
(RLIMIT_AS: the interpreter's size + 1 GiB), so an unbounded allocation fails
there as a MemoryError / RuntimeError instead of swapping the host.
"""

from __future__ import annotations

import os
import random
import resource
import struct
import subprocess
import sys
import time
import zlib

import pytest
import torch

from compass_kernels.routing import RoutingTrace
from compass_kernels.routing.codec import _CRC_AT, _HEADER, decode, encode
from compass_kernels.routing.trace import TraceError

# header fields: (index in _HEADER, name, bits)
FIELDS = [
    (1, "version", 16),
    (2, "codec", 8),
    (3, "flags", 8),
    (4, "num_experts", 32),
    (5, "top_k", 16),
    (7, "num_moe_layers", 32),
    (8, "num_mtp_layers", 32),
    (9, "num_sequences", 64),
    (10, "num_rows", 64),
    (11, "body_bytes", 64),
    (12, "payload_bytes", 64),
]


def extremes(bits: int) -> list[int]:
    top = 2**bits - 1
    vals = {
        0,
        1,
        2,
        3,
        7,
        8,
        63,
        64,
        255,
        256,
        2**16 - 1,
        2**31,
        2**32 - 1,
        2**32,
        2**53 + 1,
        2**61,
        2**62,
        2**63 - 8,
        2**63 - 1,
        2**63,
        2**64 - 8,
        top,
    }
    return sorted(v for v in vals if v <= top)


def seal(fields: list, body: bytes) -> bytes:
    """A version-2 blob with ``fields`` and a valid CRC over header and body."""
    f = list(fields)
    f[13] = 0
    head = bytearray(_HEADER.pack(*f))
    head[_CRC_AT : _CRC_AT + 4] = b"\0\0\0\0"
    f[13] = zlib.crc32(body, zlib.crc32(head))
    return _HEADER.pack(*f) + body


def sample_blobs() -> list[bytes]:
    """Valid blobs of every layout: raw, set, set with K == E (0 bytes a row), the
    wide set layout, missing rows, token_lens, MTP columns, int16 ids."""
    g = torch.Generator().manual_seed(0)

    def trace(rows, cols, e, k, missing=False, token_lens=False, mtp=0):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows * cols)])
        ids = ids.reshape(rows, cols, k).to(torch.uint8 if e <= 256 else torch.int16)
        cu = torch.tensor([0, rows // 2, rows], dtype=torch.int64)
        m = (torch.arange(rows) % 3 == 0) if missing else None
        tl = [rows // 2 + 1, rows - rows // 2 + 1] if token_lens else None
        return RoutingTrace(
            ids, cu, e, missing=m, token_lens=tl, mtp_layer_ids=list(range(mtp)) or None
        )

    out = []
    for codec in ("raw", "set"):
        out += [
            encode(trace(7, 2, 8, 2), codec=codec),
            encode(trace(5, 1, 8, 8), codec=codec),  # K == E
            encode(trace(6, 2, 16, 4, missing=True, token_lens=True), codec=codec),
            encode(trace(4, 3, 300, 6, mtp=1), codec=codec),  # int16 ids
        ]
    out.append(encode(trace(3, 1, 4096, 40), codec="set"))  # the wide layout
    return out


def crafted_blobs() -> list[bytes]:
    """Self-consistent headers (body length, CRC, cu_seqlens agree) whose row count is
    extreme: the cases a size check must bound by the payload, not by the CRC."""
    out = []
    for rows in (2**20, 2**35, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1):
        for e, k, codec in ((8, 8, 1), (64, 64, 1), (8, 2, 1), (8, 2, 0), (300, 300, 1)):
            for flags in (0, 1):
                cu = struct.pack("<qq", 0, rows if rows < 2**63 else -1)
                body = struct.pack("<q", 0) + cu  # one layer, one sequence
                fields = [b"CKRT", 2, codec, flags, e, k, 0, 1, 0, 1, rows, len(body), 0, 0, 0]
                out.append(seal(fields, body))
    return out


def mutations(seed: int, count: int):
    rng = random.Random(seed)
    bases = sample_blobs()
    for _ in range(count):
        blob = rng.choice(bases)
        f = list(_HEADER.unpack_from(blob))
        body = blob[_HEADER.size :]
        for idx, _name, bits in rng.sample(FIELDS, rng.choice((1, 1, 2, 3))):
            f[idx] = rng.choice(extremes(bits))
        if rng.random() < 0.3:  # damage the body's length too (truncate / extend)
            body = body[: rng.randrange(len(body) + 1)] + bytes(rng.choice((0, 8, 64)))
        if rng.random() < 0.7:  # keep body_bytes consistent: reach the deeper checks
            f[11] = len(body)
        yield seal(f, body)


def _bounded(tr: RoutingTrace, blob: bytes) -> None:
    """Every tensor of a decoded trace holds at most 64 bytes per blob byte + 4 KiB."""
    limit = 64 * len(blob) + 4096
    for t in (tr.expert_ids, tr.cu_seqlens, tr.missing, tr.missing_reason, tr.layer_ids):
        if t is not None:
            n = t.untyped_storage().nbytes()
            assert n <= limit, f"decode allocated {n} bytes for a {len(blob)}-byte blob"


def run_fuzz(seed: int = 0, count: int = 3000) -> dict[str, int]:
    seen = {"trace": 0, "TraceError": 0}
    for blob in list(crafted_blobs()) + list(mutations(seed, count)):
        try:
            tr = decode(blob)
        except TraceError:
            seen["TraceError"] += 1
            continue
        except Exception as exc:  # what the fuzzer hunts
            raise AssertionError(
                f"decode raised {type(exc).__name__}: {exc} on header "
                f"{_HEADER.unpack_from(blob)} (+{len(blob) - 64} body bytes)"
            ) from exc
        _bounded(tr, blob)
        seen["trace"] += 1
    return seen


def _child() -> None:
    """The fuzz loop under an address-space cap (run as a script by the test)."""
    with open("/proc/self/statm") as fh:
        vsz = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = vsz + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    t0 = time.perf_counter()
    seen = run_fuzz(
        int(os.environ.get("FUZZ_SEED", "0")), int(os.environ.get("FUZZ_COUNT", "3000"))
    )
    print(f"fuzz ok {seen} in {time.perf_counter() - t0:.2f}s", flush=True)


def test_fuzz_header_fields_bounded_time_and_memory():
    """~3,000 structure-aware mutations + the crafted extreme headers: only TraceError or
    a bounded trace, within seconds, under a 1 GiB address-space cap."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120
    )
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fuzz ok" in r.stdout
    assert took < 60, f"fuzz took {took:.1f}s"


def test_fuzz_reaches_both_outcomes():
    """The mutations are not all rejected by one early check: some decode, most fail
    with TraceError (a fuzzer that only hits the magic check would find nothing)."""
    seen = run_fuzz(1, 400)
    assert seen["trace"] >= 1 and seen["TraceError"] >= 100, seen


def test_issue_88_byte_blob_full_set_layout_allocates_nothing_per_row():
    """The issue's case: top_k == num_experts (0 payload bytes a row), 2^40 rows, a valid
    CRC: 88 bytes. decode returns the implied ids as a broadcast view (every row is
    0..K-1), O(K) memory; a consumer's row-count check then refuses it."""
    body = struct.pack("<qqq", 0, 0, 2**40)
    blob = seal([b"CKRT", 2, 1, 0, 64, 64, 0, 1, 0, 1, 2**40, len(body), 0, 0, 0], body)
    assert len(blob) == 88
    tr = decode(blob)
    assert tr.num_tokens == 2**40 and tr.top_k == 64
    assert tr.expert_ids.untyped_storage().nbytes() == 64
    assert tr.expert_ids[2**40 - 1, 0].tolist() == list(range(64))
    with pytest.raises(ValueError, match="rows"):
        tr.validate(expected_rows=[10])


def test_full_set_layout_round_trip_and_device_argument():
    ids = torch.arange(4, dtype=torch.uint8).flip(0).expand(5, 2, 4).contiguous()
    t = RoutingTrace(ids, torch.tensor([0, 2, 5]), 4)
    got = decode(encode(t, codec="set"), device="cpu")
    assert got == t.canonical(sort=True)
    assert got.expert_ids.untyped_storage().nbytes() == 4


@pytest.mark.parametrize(
    "field, value, match",
    [
        (10, 2**63, "num_rows"),  # past int64: cu_seqlens cannot hold it
        (10, 2**64 - 1, "num_rows"),
        (9, 2**63 - 1, "num_sequences"),
        (7, 2**32 - 1, "num_moe_layers"),
        (12, 2**63 + 5, "payload_bytes"),
        (4, 2**32 - 1, "num_experts"),
        (5, 2**16 - 1, "top_k"),
    ],
)
def test_extreme_field_names_the_field(field, value, match):
    """Sizes near the int64 limit: a TraceError naming the field, never TypeError /
    RuntimeError from a wrapped product (the issue's second case)."""
    blob = sample_blobs()[0]  # raw, 7 rows x 2 layers, K = 2
    f = list(_HEADER.unpack_from(blob))
    f[field] = value
    with pytest.raises(TraceError, match=match):
        decode(seal(f, blob[_HEADER.size :]))


def test_set_payload_near_int64_is_exact_not_wrapped():
    """rows x bits near 2^63 in the set layout: the expected payload size is exact (the
    C++ set_code_bytes wrapped it), so the header is refused."""
    from compass_kernels.routing import _setcode

    group, bits = _setcode.layout(8, 2)
    rows = 2**61  # 2^61 / 13 packs x 63 bits: past int64 in the C++ product
    assert _setcode.payload_bytes(rows, 8, 2) == (-(-rows // group) * bits + 7) // 8
    body = struct.pack("<qqq", 0, 0, rows)
    blob = seal([b"CKRT", 2, 1, 0, 8, 2, 0, 1, 0, 1, rows, len(body), 0, 0, 0], body)
    with pytest.raises(TraceError, match="payload_bytes"):
        decode(blob)


if __name__ == "__main__":
    _child()
