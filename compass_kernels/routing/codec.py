"""Lossless, versioned serialization of a RoutingTrace.

Layout (little-endian), version 1:

    header (64 bytes):
      magic  b"CKRT" | version u16 | codec u8 (0 raw, 1 set) | flags u8 (bit 0: has missing)
      num_experts u32 | top_k u16 | reserved u16 | num_moe_layers u32 | num_mtp_layers u32
      num_sequences u64 | num_rows u64 | body_bytes u64 | payload_bytes u64
      crc32 u32 of the body | reserved u32
    body:
      layer_ids int64[num_moe_layers] | mtp_layer_ids int64[num_mtp_layers]
      cu_seqlens int64[num_sequences + 1]
      if has missing: missing bit mask (np.packbits of [num_rows, layers], little bit
        order) | missing_reason uint8[num_rows]
      payload (payload_bytes): codec 0 = the ids array as stored (uint8 / int16 LE),
        missing rows holding 0..top_k-1; codec 1 = set coding (csrc/routing/codec_cpu.cpp):
        each row's set as its rank among the C(E, K) subsets, G rows per fixed-width
        pack (G the largest with C(E, K)^G <= 2^64), ceil(log2 C(E, K)^G) bits per pack.

Missing rows are not information and a row is a set: decode returns missing
rows as 0..top_k-1 and (codec "set") every row ascending, so
``decode(encode(t)) == t.canonical(sort=codec == "set")`` bit for bit.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from compass_kernels.routing.trace import RoutingTrace, TraceError, ids_dtype

MAGIC = b"CKRT"
VERSION = 1
CODECS = {"raw": 0, "set": 1}
_HEADER = struct.Struct("<4sHBBIHHIIQQQQII")
assert _HEADER.size == 64


def _payload_raw(ids: np.ndarray) -> bytes:
    return ids.astype(ids.dtype.newbyteorder("<"), copy=False).tobytes()


def encode(trace: RoutingTrace, *, codec: str = "raw", backend: str | None = None) -> bytes:
    """``backend``: None = where the trace lives (codec "set" on a GPU: the CUDA
    encoder, :func:`_encode_set_on_device`); "cpp" / "cuda" / "cuda-emulated"
    (tests) force the set encoder's backend."""
    code = CODECS.get(codec)
    if code is None:
        raise ValueError(f"codec: expected one of {tuple(CODECS)}, got {codec!r}")
    if code == 1 and (backend is not None or trace.device.type != "cpu"):
        return _encode_set_on_device(trace, backend)
    # raw: missing rows hold 0..K-1 in the payload; set: the kernel codes them as
    # rank 0 (= 0..K-1) without reading them, so no canonical copy of the ids.
    t = trace.canonical(sort=False) if trace.missing is not None and code == 0 else trace
    ids = t.expert_ids.cpu().contiguous()
    n_rows, n_cols, k = ids.shape
    parts = [
        t.layer_ids.numpy().astype("<i8").tobytes(),
        t.mtp_layer_ids.numpy().astype("<i8").tobytes(),
        t.cu_seqlens.cpu().numpy().astype("<i8").tobytes(),
    ]
    has_missing = t.missing is not None
    if has_missing:
        parts.append(np.packbits(t.missing.cpu().numpy().reshape(-1), bitorder="little").tobytes())
        parts.append(t.missing_reason.cpu().numpy().tobytes())
    prefix = b"".join(parts)
    if code == 0:
        payload = _payload_raw(ids.numpy())
        n_payload = len(payload)
    else:
        from compass_kernels.routing import _setcode

        n_payload = _setcode.payload_bytes(n_rows * n_cols, t.num_experts, k)
    # one buffer: header | prefix | payload, the set kernel writing in place
    buf = bytearray(_HEADER.size + len(prefix) + n_payload)
    start = _HEADER.size + len(prefix)
    buf[_HEADER.size : start] = prefix
    if code == 0:
        buf[start:] = payload
    else:  # also with K == E (0 bytes): the kernel checks the ids
        from compass_kernels.routing import _setcode

        missing = t.missing.cpu().reshape(-1).contiguous() if has_missing else None
        out = (
            torch.frombuffer(buf, dtype=torch.uint8, offset=start, count=n_payload)
            if n_payload
            else torch.empty(0, dtype=torch.uint8)
        )
        _setcode.encode_into(ids.view(-1, k), t.num_experts, out, missing=missing)
    body = memoryview(buf)[_HEADER.size :]
    _HEADER.pack_into(buf, 0, *_header_fields(t, code, n_rows, k, body, n_payload))
    body.release()
    return bytes(buf)


def _header_fields(t: RoutingTrace, code: int, n_rows: int, k: int, body, n_payload: int) -> tuple:
    """The header's values for ``body`` (prefix | payload) of trace ``t``."""
    return (
        MAGIC, VERSION, code, int(t.missing is not None), t.num_experts, k, 0, t.num_moe_layers,
        t.num_mtp_layers, t.num_sequences, n_rows, len(body), n_payload, zlib.crc32(body), 0,
    )  # fmt: skip


def _pack(t: RoutingTrace, code: int, prefix: bytes, payload: bytes, n_rows: int, k: int) -> bytes:
    body = prefix + payload
    return _HEADER.pack(*_header_fields(t, code, n_rows, k, body, len(payload))) + body


def _encode_set_on_device(t: RoutingTrace, backend: str | None) -> bytes:
    """Codec "set" where the ids live: the encode op's kernel (on a GPU,
    csrc/routing/codec.cu: ranks, packing and the id checks on the device), then
    ONE device-to-host copy of status | cu_seqlens | missing | reasons | payload
    (the sync that returning bytes needs); the CRC32 of the body on the host."""
    from compass_kernels.routing import _setcode

    n_rows, n_cols, k = t.expert_ids.shape
    ids = t.expert_ids.reshape(-1, k)
    has_missing = t.missing is not None
    missing = t.missing.reshape(-1) if has_missing else None
    payload, status = _setcode.encode_device(ids, t.num_experts, missing=missing, backend=backend)
    parts = [status.view(torch.uint8), t.cu_seqlens.to(torch.int64).contiguous().view(torch.uint8)]
    if has_missing:
        parts += [missing.contiguous().view(torch.uint8), t.missing_reason.contiguous()]
    parts.append(payload)
    host = torch.cat(parts).cpu().numpy()  # the one sync
    bad, first = (int(v) for v in host[:16].view("<i8"))
    if bad:  # error path: reads the bad row (another sync)
        _setcode.check_status(torch.tensor([bad, first]), ids, t.num_experts)
    off = 16 + 8 * (t.num_sequences + 1)
    prefix = [
        t.layer_ids.cpu().numpy().astype("<i8").tobytes(),
        t.mtp_layer_ids.cpu().numpy().astype("<i8").tobytes(),
        host[16:off].tobytes(),
    ]
    if has_missing:
        nbits = n_rows * n_cols
        prefix.append(np.packbits(host[off : off + nbits], bitorder="little").tobytes())
        prefix.append(host[off + nbits : off + nbits + n_rows].tobytes())
        off += nbits + n_rows
    return _pack(t, 1, b"".join(prefix), host[off:].tobytes(), n_rows, k)


def decode(data: bytes, *, device=None) -> RoutingTrace:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: expected bytes, got {type(data).__name__}")
    data = memoryview(data).cast("B")  # no copy: slices below are views
    if len(data) < _HEADER.size:
        raise TraceError(
            f"decode: {len(data)} bytes is shorter than the {_HEADER.size}-byte header"
        )
    (magic, version, code, flags, experts, k, _, n_moe, n_mtp, n_seq, n_rows, body_len,
     payload_len, crc, _) = _HEADER.unpack_from(data)  # fmt: skip
    if bytes(magic) != MAGIC:
        raise TraceError(f"decode: bad magic {magic!r}, expected {MAGIC!r} (not a RoutingTrace)")
    if version != VERSION:
        raise TraceError(f"decode: format version {version}, this build reads version {VERSION}")
    if code not in CODECS.values():
        raise TraceError(f"decode: unknown codec id {code}")
    body = data[_HEADER.size :]
    if len(body) != body_len:
        raise TraceError(f"decode: body is {len(body)} bytes, the header says {body_len}")
    if zlib.crc32(body) != crc:
        raise TraceError("decode: checksum mismatch (the trace is corrupted)")
    n_cols = n_moe + n_mtp
    off = 0

    def take(nbytes: int) -> bytes:
        nonlocal off
        if off + nbytes > len(body):
            raise TraceError("decode: truncated body")
        chunk = body[off : off + nbytes]
        off += nbytes
        return chunk

    layer_ids = torch.from_numpy(np.frombuffer(take(8 * n_moe), "<i8").astype(np.int64))
    mtp = torch.from_numpy(np.frombuffer(take(8 * n_mtp), "<i8").astype(np.int64))
    cu = torch.from_numpy(np.frombuffer(take(8 * (n_seq + 1)), "<i8").astype(np.int64))
    missing = reason = None
    if flags & 1:
        nbits = n_rows * n_cols
        bits = np.frombuffer(take((nbits + 7) // 8), np.uint8)
        m = np.unpackbits(bits, count=nbits, bitorder="little").astype(bool)
        missing = torch.from_numpy(m.reshape(n_rows, n_cols).copy())
        reason = torch.from_numpy(np.frombuffer(take(n_rows), np.uint8).copy())
    payload = take(payload_len)
    if off != len(body):
        raise TraceError(f"decode: {len(body) - off} trailing bytes after the payload")
    dt = ids_dtype(experts)
    if code == 0:
        npdt = np.dtype(np.uint8) if dt == torch.uint8 else np.dtype("<i2")
        want = n_rows * n_cols * k * npdt.itemsize
        if len(payload) != want:
            raise TraceError(f"decode: raw payload is {len(payload)} bytes, expected {want}")
        ids_np = np.frombuffer(payload, npdt).astype(npdt.newbyteorder("="))
        ids = torch.from_numpy(ids_np.reshape(n_rows, n_cols, k).copy())
    else:
        from compass_kernels.routing import _setcode

        want = _setcode.payload_bytes(n_rows * n_cols, experts, k)
        if len(payload) != want:
            raise TraceError(f"decode: set payload is {len(payload)} bytes, expected {want}")
        try:
            ids = _setcode.decode_sets(payload, n_rows * n_cols, k, experts, dt)
        except ValueError as err:
            raise TraceError(f"decode: {err}") from None
        ids = ids.reshape(n_rows, n_cols, k)
    tr = RoutingTrace(
        ids, cu, experts, layer_ids=layer_ids, missing=missing, missing_reason=reason,
        mtp_layer_ids=mtp,
    )  # fmt: skip
    return tr if device is None else tr.to(device)
