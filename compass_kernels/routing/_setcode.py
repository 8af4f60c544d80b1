"""Set coding of top-k rows (C++: csrc/routing/codec_cpu.cpp, setcode.h).

Each row's K distinct experts of E -> its rank among the C(E, K) subsets
(combinatorial number system); G rows per fixed-width pack of B bits, G the
largest with C(E, K)^G <= 2^64. Decoded rows come back ascending; missing rows
are coded as 0..K-1 (rank 0) without reading their ids.

``impl``: 0 the fastest kernel this CPU runs (AVX2 when present), 1 the
x86-64 baseline (tests run both).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from compass_kernels._ext import load


def layout(num_experts: int, top_k: int) -> tuple[int, int]:
    """(rows per pack, bits per pack) for E experts, top-k."""
    c = load().routing
    return c.set_code_group(num_experts, top_k), c.set_code_pack_bits(num_experts, top_k)


def set_threads(threads: int) -> int:
    """Threads of the codec kernels (0: OpenMP's default); returns the previous."""
    return load().routing.set_code_threads(threads)


def payload_bytes(rows: int, num_experts: int, top_k: int) -> int:
    return load().routing.set_code_bytes(rows, num_experts, top_k)


def encode_into(ids: torch.Tensor, num_experts: int, out: torch.Tensor, *,
                missing: torch.Tensor | None = None, impl: int = 0) -> None:  # fmt: skip
    """ids [rows, K] uint8 | int16 (CPU, contiguous) -> out uint8 [payload_bytes]."""
    load().routing.encode_sets_cpu(ids, num_experts, missing, out, impl)


def decode_into(data: torch.Tensor, num_experts: int, ids: torch.Tensor, *, impl: int = 0) -> None:
    """data uint8 [payload_bytes] -> ids [rows, K] (written in place, rows ascending)."""
    load().routing.decode_sets_cpu(data, num_experts, ids, impl)


def encode_sets(ids: np.ndarray | torch.Tensor, num_experts: int, *,
                missing: torch.Tensor | None = None, impl: int = 0) -> bytes:  # fmt: skip
    """ids [..., K] uint8 | int16 (rows any order within) -> payload bytes."""
    t = torch.as_tensor(ids) if not isinstance(ids, torch.Tensor) else ids
    k = t.shape[-1]
    flat = t.reshape(-1, k).contiguous()
    out = torch.empty(payload_bytes(flat.shape[0], num_experts, k), dtype=torch.uint8)
    if missing is not None:
        missing = missing.reshape(-1).contiguous()
    encode_into(flat, num_experts, out, missing=missing, impl=impl)
    return out.numpy().tobytes()


def decode_sets(payload: bytes | memoryview, rows: int, top_k: int, num_experts: int,
                dtype: torch.dtype, *, impl: int = 0) -> torch.Tensor:  # fmt: skip
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
