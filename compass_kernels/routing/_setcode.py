"""Set coding of top-k rows (C++: csrc/routing/codec_cpu.cpp, setcode.h).

Each row's K distinct experts of E -> its rank among the C(E, K) subsets
(combinatorial number system); G rows per fixed-width pack of B bits, G the
largest with C(E, K)^G <= 2^64. Decoded rows come back ascending; missing rows
are coded as 0..K-1 (rank 0) without reading their ids.

``impl``: 0 the fastest kernel this CPU runs (AVX2 when present), 1 the
x86-64 baseline (tests run both).
:func:`decode_path` names the unrank a decode runs.

The encode op (:data:`encode_sets_op`, ``torch.ops.compass.encode_sets``) has a
"cpp" and a "triton" backend (routing/triton_setcode.py) writing the same payload
bytes; :func:`encode_device` runs it where the ids live (on a GPU: no host
sync, checks on the device), :func:`check_status` raises on a bad row.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import torch

from compass_kernels._ext import load
from compass_kernels._op import op
from compass_kernels.routing.trace import _desc


def layout(num_experts: int, top_k: int) -> tuple[int, int]:
    """(rows per pack, bits per pack) for E experts, top-k."""
    c = load().routing
    return c.set_code_group(num_experts, top_k), c.set_code_pack_bits(num_experts, top_k)


def set_threads(threads: int) -> int:
    """Threads of the codec kernels (0: OpenMP's default); returns the previous."""
    return load().routing.set_code_threads(threads)


def decode_path(num_experts: int, top_k: int, dtype: torch.dtype, impl: int = 0) -> str:
    """The unrank :func:`decode_into` runs for these arguments: "r12" (uint8
    ids, K in {6, 8}, one rank per pack of <= 52 bits, AVX2), "hint" (the
    level-by-level unrank), "bisect" (no hint tables) or "none" (K == E)."""
    return load().routing.set_code_decode_path(num_experts, top_k, dtype == torch.uint8, impl)


def payload_bytes(rows: int, num_experts: int, top_k: int) -> int:
    """Payload bytes of ``rows`` set-coded rows: ceil(ceil(rows / G) * B / 8), in
    Python ints (exact for any ``rows``: a crafted header's row count cannot wrap
    it); the layout's checks (ValueError) are the C++ ones."""
    if rows < 0:
        raise ValueError(f"rows: expected >= 0, got {rows}")
    group, bits = layout(num_experts, top_k)
    return (-(-rows // group) * bits + 7) // 8


def encode_into(
    ids: torch.Tensor,
    num_experts: int,
    out: torch.Tensor,
    *,
    missing: torch.Tensor | None = None,
    impl: int = 0,
) -> None:
    """ids [rows, K] uint8 | int16 (CPU, contiguous) -> out uint8 [payload_bytes]."""
    load().routing.encode_sets_cpu(ids, num_experts, missing, out, impl)


def decode_into(data: torch.Tensor, num_experts: int, ids: torch.Tensor, *, impl: int = 0) -> None:
    """data uint8 [payload_bytes] -> ids [rows, K] (written in place, rows ascending)."""
    load().routing.decode_sets_cpu(data, num_experts, ids, impl)


def encode_sets(
    ids: np.ndarray | torch.Tensor,
    num_experts: int,
    *,
    missing: torch.Tensor | None = None,
    impl: int = 0,
) -> bytes:
    """ids [..., K] uint8 | int16 (rows any order within) -> payload bytes."""
    t = torch.as_tensor(ids) if not isinstance(ids, torch.Tensor) else ids
    k = t.shape[-1]
    flat = t.reshape(-1, k).contiguous()
    out = torch.empty(payload_bytes(flat.shape[0], num_experts, k), dtype=torch.uint8)
    if missing is not None:
        missing = missing.reshape(-1).contiguous()
    encode_into(flat, num_experts, out, missing=missing, impl=impl)
    return out.numpy().tobytes()


def decode_sets(
    payload: bytes | memoryview,
    rows: int,
    top_k: int,
    num_experts: int,
    dtype: torch.dtype,
    *,
    impl: int = 0,
) -> torch.Tensor:
    """payload -> ids [rows, top_k] of ``dtype`` (each row ascending)."""
    if len(payload):  # read in place (the kernel never writes its input)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "not writable": read only
            data = torch.frombuffer(payload, dtype=torch.uint8)
    else:  # K == E: every row is the full set, nothing stored
        data = torch.empty(0, dtype=torch.uint8)
    ids = torch.empty(rows, top_k, dtype=dtype)
    decode_into(data, num_experts, ids, impl=impl)
    return ids


# ------------------------------------------------------------ the encode op
class Encoded(NamedTuple):
    """Outputs of :data:`encode_sets_op`."""

    payload: torch.Tensor  # [payload_bytes] uint8
    status: torch.Tensor  # [2] int64: bad rows, first bad row or -1
    table: torch.Tensor  # [K * E] int64: the binomial workspace C(a, m) at (m - 1) * E + a


@op(
    kernels={
        "cpp": "routing.encode_sets_op_cpu",
        "triton": "compass_kernels.routing.triton_setcode:encode_sets_triton",
    }
)
def encode_sets_op(ids: torch.Tensor, num_experts: int, missing: torch.Tensor | None) -> Encoded:
    """Set-code ids [rows, K] uint8 | int16 (missing [rows] bool or None). The cpp
    backend raises on a bad row (naming it); the triton one counts it in status, on
    the device."""
    rows, k = ids.shape
    return Encoded(
        payload=ids.new_empty(payload_bytes(int(rows), num_experts, int(k)), dtype=torch.uint8),
        status=ids.new_empty(2, dtype=torch.int64),
        table=ids.new_empty(int(k) * num_experts, dtype=torch.int64),
    )


def encode_device(
    ids: torch.Tensor,
    num_experts: int,
    *,
    missing: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Set-code ``ids`` [rows, K] where they live: (payload, status), both on
    ids' device. On a GPU nothing waits for the device: read ``status`` (e.g.
    :func:`check_status`, one sync) before trusting the payload."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"ids: expected a 2-d tensor [rows, top_k], got {_desc(ids)}")
    ids = ids if ids.is_contiguous() else ids.contiguous()
    if missing is not None:
        missing = missing.reshape(-1)
        missing = missing if missing.is_contiguous() else missing.contiguous()
    res = encode_sets_op(ids=ids, num_experts=int(num_experts), missing=missing, backend=backend)
    return res.payload, res.status


def check_status(status, ids: torch.Tensor, num_experts: int, missing=None) -> None:
    """Raise ValueError naming the first bad row of ``ids`` (as the CPU encoder
    words it) when ``status`` (from the op; host or device) reports one."""
    bad, first = (int(v) for v in status.tolist())
    if bad == 0:
        return
    row = ids[first].tolist()
    for i, a in enumerate(row):
        if not 0 <= a < num_experts:
            raise ValueError(
                f"ids: expert id {a} out of range [0, {num_experts}) at row {first} "
                f"({bad} bad rows)"
            )
        if a in row[:i]:
            raise ValueError(f"ids: expert {a} twice in row {first} ({bad} bad rows)")
    raise ValueError(f"ids: row {first} flagged bad but valid: {row} (internal error)")
