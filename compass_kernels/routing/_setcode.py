"""Set coding of top-k rows (C++: csrc/routing/codec_cpu.cpp).

Each row's K distinct experts of E -> its rank among the C(E, K) subsets
(combinatorial number system); G rows per fixed-width pack of B bits, G the
largest with C(E, K)^G <= 2^64. Decoded rows come back ascending.
"""

from __future__ import annotations

import numpy as np
import torch

from compass_kernels._ext import load


def layout(num_experts: int, top_k: int) -> tuple[int, int]:
    """(rows per pack, bits per pack) for E experts, top-k."""
    c = load().routing
    return c.set_code_group(num_experts, top_k), c.set_code_pack_bits(num_experts, top_k)


def payload_bytes(rows: int, num_experts: int, top_k: int) -> int:
    return load().routing.set_code_bytes(rows, num_experts, top_k)


def encode_sets(ids: np.ndarray | torch.Tensor, num_experts: int) -> bytes:
    """ids [..., K] uint8 | int16 (rows any order within) -> payload bytes."""
    t = torch.as_tensor(ids) if not isinstance(ids, torch.Tensor) else ids
    k = t.shape[-1]
    flat = t.reshape(-1, k).contiguous()
    out = torch.empty(payload_bytes(flat.shape[0], num_experts, k), dtype=torch.uint8)
    load().routing.encode_sets_cpu(flat, num_experts, out)
    return out.numpy().tobytes()


def decode_sets(payload: bytes, rows: int, top_k: int, num_experts: int,
                dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """payload -> ids [rows, top_k] of ``dtype`` (each row ascending)."""
    if len(payload):
        data = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
    else:  # K == E: every row is the full set, nothing stored
        data = torch.empty(0, dtype=torch.uint8)
    ids = torch.empty(rows, top_k, dtype=dtype)
    load().routing.decode_sets_cpu(data, num_experts, ids)
    return ids
