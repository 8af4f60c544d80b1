"""Lossless, versioned serialization of a RoutingTrace.

Layout (little-endian), version 2:

    header (64 bytes):
      magic  b"CKRT" | version u16 | codec u8 (0 raw, 1 set) | flags u8 (bit 0: has
      missing, bit 1: has token_lens)
      num_experts u32 | top_k u16 | reserved u16 | num_moe_layers u32 | num_mtp_layers u32
      num_sequences u64 | num_rows u64 | body_bytes u64 | payload_bytes u64
      crc32 u32 of the header (this field zero) then the body | reserved u32
    body:
      layer_ids int64[num_moe_layers] | mtp_layer_ids int64[num_mtp_layers]
      cu_seqlens int64[num_sequences + 1]
      if has token_lens: token_lens int64[num_sequences]
      if has missing: missing bit mask (np.packbits of [num_rows, layers], little bit
        order) | missing_reason uint8[num_rows]
      payload (payload_bytes): codec 0 = the ids array as stored (uint8 / int16 LE),
        missing rows holding 0..top_k-1; codec 1 = set coding (csrc/routing/codec_cpu.cpp):
        each row's set as its rank among the C(E, K) subsets, G rows per fixed-width
        pack (G the largest with C(E, K)^G <= 2^64), ceil(log2 C(E, K)^G) bits per pack;
        where C(E, K) >= 2^64 (e.g. E = 32768, K = 8) each row's ids ascending in
        ceil(log2 E) bits each, packed little-endian (:func:`_wide_bits`).

Version 1 (still decoded): the same header with the CRC over the body only, flags
bit 0 only (no token_lens). Every decode failure raises :class:`TraceError`
naming the field; both codecs check the ids (in range, no expert twice in a
present row) on encode, and raw payloads again on decode.

Missing rows are not information and a row is a set: decode returns missing
rows as 0..top_k-1 and (codec "set") every row ascending, so
``decode(encode(t)) == t.canonical(sort=codec == "set")`` bit for bit.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib

import numpy as np
import torch

from compass_kernels.routing.trace import (
    MAX_EXPERTS,
    MissingReason,
    RoutingTrace,
    TraceError,
    ids_dtype,
)

MAGIC = b"CKRT"
VERSION = 2
READS = (1, 2)  # format versions decode() reads
CODECS = {"raw": 0, "set": 1}
_HEADER = struct.Struct("<4sHBBIHHIIQQQQII")
assert _HEADER.size == 64
_CRC_AT = 56  # byte offset of the crc32 field
_FLAG_MISSING, _FLAG_TOKEN_LENS = 1, 2
_INT64_MAX = 2**63 - 1


@functools.lru_cache(maxsize=64)
def _wide_bits(num_experts: int, top_k: int) -> int:
    """Bits per id of the set codec's wide layout, or 0 where set ranks fit 64 bits."""
    if math.comb(num_experts, top_k) < 2**64:
        return 0
    return max(1, (num_experts - 1).bit_length())


def _set_payload_bytes(rows: int, num_experts: int, top_k: int) -> int:
    b = _wide_bits(num_experts, top_k)
    if b:
        return (rows * top_k * b + 7) // 8
    from compass_kernels.routing import _setcode

    return _setcode.payload_bytes(rows, num_experts, top_k)


def _encode_wide(ids: torch.Tensor, num_experts: int, missing) -> bytes:
    """[rows, K] ids -> each row ascending, ceil(log2 E) bits per id (missing rows 0..K-1)."""
    k = ids.shape[1]
    b = _wide_bits(num_experts, k)
    a = ids.to(torch.int64).sort(-1).values
    if missing is not None:
        a = torch.where(missing.reshape(-1, 1), torch.arange(k), a)
    bits = ((a.reshape(-1, 1) >> torch.arange(b)) & 1).to(torch.uint8).numpy().reshape(-1)
    return np.packbits(bits, bitorder="little").tobytes()


def _decode_wide(payload, rows: int, k: int, num_experts: int, dtype) -> torch.Tensor:
    b = _wide_bits(num_experts, k)
    bits = np.unpackbits(np.frombuffer(payload, np.uint8), count=rows * k * b, bitorder="little")
    weights = (1 << np.arange(b, dtype=np.int64))[None, :]
    ids = torch.from_numpy((bits.reshape(-1, b).astype(np.int64) * weights).sum(1))
    ids = ids.reshape(rows, k)
    bad = (ids >= num_experts).any(1)
    if k > 1:
        bad |= (ids[:, 1:] <= ids[:, :-1]).any(1)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise TraceError(
            f"decode: set payload row {r} is not {k} distinct ascending experts < {num_experts}: "
            f"{ids[r].tolist()} (corrupted payload)"
        )
    return ids.to(dtype)


def _check_ids(t: RoutingTrace, what: str) -> None:
    """Range and no-duplicate checks of the present rows, as the set encoder makes them."""
    counts = t._flags()[:4].tolist()
    counts[0] = counts[3] = 0  # cu_seqlens and reasons are checked elsewhere
    if any(counts):
        try:
            t._raise(counts + [0] * 4, expected_rows=None, max_missing_fraction=None)
        except TraceError as err:
            raise TraceError(f"{what}: {err}") from None


def _payload_raw(ids: np.ndarray) -> bytes:
    return ids.astype(ids.dtype.newbyteorder("<"), copy=False).tobytes()


def encode(trace: RoutingTrace, *, codec: str = "raw", backend: str | None = None) -> bytes:
    """``backend``: None = where the trace lives (codec "set" on a GPU: the Triton
    encoder, :func:`_encode_set_on_device`); "cpp" / "triton" (on CPU tensors:
    the interpreter, tests) force the set encoder's backend. Raises ``ValueError`` (a
    :class:`TraceError` for the ids) naming the first bad row."""
    code = CODECS.get(codec)
    if code is None:
        raise ValueError(f"codec: expected one of {tuple(CODECS)}, got {codec!r}")
    wide = code == 1 and _wide_bits(trace.num_experts, trace.top_k)
    if code == 1 and not wide and (backend is not None or trace.device.type != "cpu"):
        return _encode_set_on_device(trace, backend)
    if backend not in (None, "cpp") and code == 0:
        raise ValueError(f"backend: codec 'raw' runs on the host, got backend={backend!r}")
    if code == 0 or wide:  # the set kernel checks its rows itself
        _check_ids(trace, "encode")
    # raw: missing rows hold 0..K-1 in the payload; set: the kernel codes them as
    # rank 0 (= 0..K-1) without reading them, so no canonical copy of the ids.
    t = trace.canonical(sort=False) if trace.missing is not None and code == 0 else trace
    ids = t.expert_ids.cpu().contiguous()
    n_rows, n_cols, k = ids.shape
    prefix = b"".join(_prefix_parts(t, t.cu_seqlens.cpu().numpy()))
    if code == 0:
        payload = _payload_raw(ids.numpy())
        n_payload = len(payload)
    elif wide:
        m = t.missing.cpu().reshape(-1) if t.missing is not None else None
        payload = _encode_wide(ids.view(-1, k), t.num_experts, m)
        n_payload = len(payload)
    else:
        n_payload = _set_payload_bytes(n_rows * n_cols, t.num_experts, k)
    # one buffer: header | prefix | payload, the set kernel writing in place
    buf = bytearray(_HEADER.size + len(prefix) + n_payload)
    start = _HEADER.size + len(prefix)
    buf[_HEADER.size : start] = prefix
    if code == 0 or wide:
        buf[start:] = payload
    else:  # also with K == E (0 bytes): the kernel checks the ids
        from compass_kernels.routing import _setcode

        missing = t.missing.cpu().reshape(-1).contiguous() if t.missing is not None else None
        out = (
            torch.frombuffer(buf, dtype=torch.uint8, offset=start, count=n_payload)
            if n_payload
            else torch.empty(0, dtype=torch.uint8)
        )
        _setcode.encode_into(ids.view(-1, k), t.num_experts, out, missing=missing)
    _seal(buf, t, code, n_rows, k, n_payload)
    return bytes(buf)


def _prefix_parts(t: RoutingTrace, cu_host: np.ndarray, missing_parts=None) -> list[bytes]:
    """layer keys | cu_seqlens | token_lens (if known) | missing mask + reasons."""
    parts = [
        t.layer_ids.cpu().numpy().astype("<i8").tobytes(),
        t.mtp_layer_ids.cpu().numpy().astype("<i8").tobytes(),
        np.asarray(cu_host).astype("<i8").tobytes(),
    ]
    if t.has_token_lens:
        parts.append(np.asarray(t.token_lens, dtype="<i8").tobytes())
    if t.missing is not None:
        assert t.missing_reason is not None  # set whenever missing is
        if missing_parts is None:
            bits = t.missing.cpu().numpy().reshape(-1)
            missing_parts = [
                np.packbits(bits, bitorder="little").tobytes(),
                t.missing_reason.cpu().numpy().tobytes(),
            ]
        parts += missing_parts
    return parts


def _seal(buf: bytearray, t: RoutingTrace, code: int, n_rows: int, k: int, n_payload: int) -> None:
    """Write the header into ``buf[:64]``, its CRC32 covering the header and the body."""
    flags = (_FLAG_MISSING if t.missing is not None else 0) | (
        _FLAG_TOKEN_LENS if t.has_token_lens else 0
    )
    fields = [
        MAGIC,
        VERSION,
        code,
        flags,
        t.num_experts,
        k,
        0,
        t.num_moe_layers,
        t.num_mtp_layers,
        t.num_sequences,
        n_rows,
        len(buf) - _HEADER.size,
        n_payload,
        0,
        0,
    ]
    _HEADER.pack_into(buf, 0, *fields)
    view = memoryview(buf)
    fields[13] = zlib.crc32(view)  # crc field still 0: the header is covered too
    view.release()
    _HEADER.pack_into(buf, 0, *fields)


def _encode_set_on_device(t: RoutingTrace, backend: str | None) -> bytes:
    """Codec "set" where the ids live: the encode op's kernel (on a GPU, Triton,
    routing/triton_setcode.py: ranks, packing and the id checks on the device), then
    ONE device-to-host copy of status | cu_seqlens | missing | reasons | payload
    (the sync that returning bytes needs); the CRC32 on the host."""
    from compass_kernels.routing import _setcode

    n_rows, n_cols, k = t.expert_ids.shape
    ids = t.expert_ids.reshape(-1, k)
    missing = t.missing.reshape(-1) if t.missing is not None else None
    payload, status = _setcode.encode_device(ids, t.num_experts, missing=missing, backend=backend)
    cu = t.cu_seqlens.to(torch.int64)
    if cu.stride(-1) != 1:  # a size-1 tensor keeps any stride through contiguous()
        cu = cu.clone(memory_format=torch.contiguous_format)
    parts = [status.view(torch.uint8), cu.view(torch.uint8)]
    if missing is not None:
        assert t.missing_reason is not None  # set whenever missing is
        parts += [missing.contiguous().view(torch.uint8), t.missing_reason.contiguous()]
    parts.append(payload)
    host = torch.cat(parts).cpu().numpy()  # the one sync
    bad, first = (int(v) for v in host[:16].view("<i8"))
    if bad:  # error path: reads the bad row (another sync)
        _setcode.check_status(torch.tensor([bad, first]), ids, t.num_experts)
    off = 16 + 8 * (t.num_sequences + 1)
    cu_host = host[16:off].view("<i8")
    missing_parts = None
    if missing is not None:
        nbits = n_rows * n_cols
        missing_parts = [
            np.packbits(host[off : off + nbits], bitorder="little").tobytes(),
            host[off + nbits : off + nbits + n_rows].tobytes(),
        ]
        off += nbits + n_rows
    prefix = b"".join(_prefix_parts(t, cu_host, missing_parts))
    body = host[off:].tobytes()
    buf = bytearray(_HEADER.size) + prefix + body
    _seal(buf, t, 1, n_rows, k, len(body))
    return bytes(buf)


def decode(data: bytes | bytearray | memoryview, *, device=None) -> RoutingTrace:
    """bytes (format version 1 or 2) -> RoutingTrace; :class:`TraceError` naming the
    field on any bad byte (the CRC first: a tampered header fails it in version 2)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: expected bytes, got {type(data).__name__}")
    data = memoryview(data).cast("B")  # no copy: slices below are views
    if len(data) < _HEADER.size:
        raise TraceError(
            f"decode: {len(data)} bytes is shorter than the {_HEADER.size}-byte header"
        )
    (
        magic,
        version,
        code,
        flags,
        experts,
        k,
        _,
        n_moe,
        n_mtp,
        n_seq,
        n_rows,
        body_len,
        payload_len,
        crc,
        _,
    ) = _HEADER.unpack_from(data)
    if bytes(magic) != MAGIC:
        raise TraceError(f"decode: bad magic {bytes(magic)!r}, expected {MAGIC!r} (not a trace)")
    if version not in READS:
        raise TraceError(
            f"decode: format version {version}, this build reads versions {list(READS)}"
        )
    body = data[_HEADER.size :]
    if len(body) != body_len:
        raise TraceError(f"decode: body is {len(body)} bytes, the header says {body_len}")
    if version == 1:
        got = zlib.crc32(body)
    else:
        head = bytearray(data[: _HEADER.size])
        head[_CRC_AT : _CRC_AT + 4] = b"\0\0\0\0"
        got = zlib.crc32(body, zlib.crc32(head))
    if got != crc:
        raise TraceError(
            "decode: checksum mismatch (the trace is corrupted"
            + (")" if version > 1 else "; version 1 covers the body only)")
        )
    # Header fields, checked before anything is allocated from them (a version-1
    # header is outside its CRC).
    if code not in CODECS.values():
        raise TraceError(f"decode: unknown codec id {code} (known: {CODECS})")
    known = _FLAG_MISSING | (_FLAG_TOKEN_LENS if version > 1 else 0)
    if flags & ~known:
        raise TraceError(f"decode: unknown flags {flags:#x} for format version {version}")
    if not 1 <= experts <= MAX_EXPERTS:
        raise TraceError(f"decode: num_experts {experts} outside [1, {MAX_EXPERTS}]")
    if not 1 <= k <= experts:
        raise TraceError(f"decode: top_k {k} outside [1, num_experts={experts}]")

    # Every size below is a Python int (no wrap) and is bounded by the body's actual
    # length field by field before anything is allocated from it.
    def over(field: str, value: int, need: int, what: str) -> None:
        if need > body_len:
            raise TraceError(
                f"decode: {field} {value} needs {what} of {need} bytes, the body has {body_len}"
            )

    n_cols = n_moe + n_mtp
    over("num_moe_layers + num_mtp_layers", n_cols, 8 * n_cols, "layer keys")
    over(
        "num_sequences",
        n_seq,
        8 * (n_seq + 1) + (8 * n_seq if flags & _FLAG_TOKEN_LENS else 0),
        "cu_seqlens / token_lens",
    )
    over("payload_bytes", payload_len, payload_len, "a payload")
    if n_rows > _INT64_MAX:
        raise TraceError(f"decode: num_rows {n_rows} exceeds int64 (cu_seqlens is int64)")
    nbits = n_rows * n_cols
    if flags & _FLAG_MISSING:
        over("num_rows", n_rows, (nbits + 7) // 8 + n_rows, "a missing mask and reasons")
    n_ids = nbits * k
    if n_ids > _INT64_MAX:
        raise TraceError(
            f"decode: num_rows x layers x top_k = {n_rows} x {n_cols} x {k} = {n_ids} ids "
            "exceeds int64 indexing"
        )
    prefix_len = 8 * (n_cols + n_seq + 1) + (8 * n_seq if flags & _FLAG_TOKEN_LENS else 0)
    if flags & _FLAG_MISSING:
        prefix_len += (nbits + 7) // 8 + n_rows
    if prefix_len + payload_len != body_len:
        raise TraceError(
            f"decode: the header's sizes (layers {n_moe}+{n_mtp}, sequences {n_seq}, rows "
            f"{n_rows}, payload {payload_len}) need a {prefix_len + payload_len}-byte body, "
            f"got {body_len}"
        )
    dt = ids_dtype(experts)
    if code == 0:
        want = n_ids * (1 if dt == torch.uint8 else 2)
    else:
        try:  # exact in Python ints whatever the row count
            want = _set_payload_bytes(nbits, experts, k)
        except ValueError as err:
            raise TraceError(f"decode: num_experts / top_k: {err}") from None
    if payload_len != want:
        kind = "raw" if code == 0 else "set"
        raise TraceError(
            f"decode: payload_bytes {payload_len} for a {kind} payload of {n_rows} rows x "
            f"{n_cols} layers, expected {want}"
        )
    # Decoded ids are now bounded by the payload (raw: 1 byte per id; set: >= 1 bit
    # per row, <= 64 ids of 2 bytes) except where the layout stores nothing per row
    # (codec "set", top_k == num_experts: every row is the full set): those ids
    # are a broadcast view of 0..K-1, never allocated per row.
    implied = code == 1 and want == 0 and n_ids > 0
    off = 0

    def take(nbytes: int):
        nonlocal off
        chunk = body[off : off + nbytes]
        off += nbytes
        return chunk

    def int64s(name: str, count: int) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(take(8 * count), "<i8").astype(np.int64))

    layer_ids = int64s("layer_ids", n_moe)
    mtp = int64s("mtp_layer_ids", n_mtp)
    cu = int64s("cu_seqlens", n_seq + 1)
    token_lens = int64s("token_lens", n_seq) if flags & _FLAG_TOKEN_LENS else None
    cu_np = cu.numpy()
    if cu_np[0] != 0 or (np.diff(cu_np) < 0).any() or cu_np[-1] != n_rows:
        raise TraceError(
            f"decode: cu_seqlens {cu_np[:8].tolist()}... is not 0, non-decreasing, {n_rows}"
        )
    missing = reason = None
    if flags & _FLAG_MISSING:
        bits = np.frombuffer(take((nbits + 7) // 8), np.uint8)
        m = np.unpackbits(bits, count=nbits, bitorder="little").astype(bool)
        missing = torch.from_numpy(m.reshape(n_rows, n_cols).copy())
        reason = torch.from_numpy(np.frombuffer(take(n_rows), np.uint8).copy())
        bad = ((reason != 0) != missing.any(1)) | (reason >= len(MissingReason))
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            raise TraceError(
                f"decode: missing_reason {int(reason[r])} at row {r} does not match its missing "
                "mask (or is no MissingReason)"
            )
    payload = take(payload_len)
    if implied:  # on the target device at once: .to() would materialise the view
        at = torch.device("cpu") if device is None else torch.device(device)
        ids = torch.arange(k, dtype=dt, device=at).expand(n_rows, n_cols, k)
        if at.type != "cpu":
            cu = cu.to(at)
            missing, reason = (None if x is None else x.to(at) for x in (missing, reason))
    elif code == 0:
        npdt = np.dtype(np.uint8) if dt == torch.uint8 else np.dtype("<i2")
        ids_np = np.frombuffer(payload, npdt).astype(npdt.newbyteorder("="))
        ids = torch.from_numpy(ids_np.reshape(n_rows, n_cols, k).copy())
    elif _wide_bits(experts, k):
        ids = _decode_wide(payload, n_rows * n_cols, k, experts, dt).reshape(n_rows, n_cols, k)
    else:
        from compass_kernels.routing import _setcode

        try:
            ids = _setcode.decode_sets(payload, n_rows * n_cols, k, experts, dt)
        except ValueError as err:
            raise TraceError(f"decode: {err}") from None
        ids = ids.reshape(n_rows, n_cols, k)
    try:
        tr = RoutingTrace(
            ids,
            cu,
            experts,
            layer_ids=layer_ids,
            missing=missing,
            missing_reason=reason,
            mtp_layer_ids=mtp,
            token_lens=token_lens,
        )
    except ValueError as err:  # layer keys, token_lens: named by the constructor
        raise TraceError(f"decode: {err}") from None
    if code == 0:
        _check_ids(tr, "decode")
    return tr if device is None or implied else tr.to(device)
