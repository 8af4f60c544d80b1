"""Bench: THD pack (ck.packing.pack) of one micro-batch against what users write.

The inputs are what an RL training step packs per micro-batch: token ids
(int64), old log-probs and advantages (float32), loss mask (bool) and the
routing trace of a MoE model (uint8 [T, 48 layers, 8] = 384 B per token),
from a batch of lognormal-length sequences; the micro-batch is every other
sequence; each sequence padded to 2*cp*tp = 8 (cp = 2, tp = 2) and split
zigzag for CP rank 0, or cp = 1. Every provider returns the same packed
tensors and position ids (``--check`` compares them exactly).

Baselines (written from their technique, not copied):

- ``index_select``: a gather index over the padded layout built with NumPy
  (pads point at an appended zero row), one ``index_select`` per tensor: the
  strongest simple vectorized torch path.
- ``boolean_mask``: a zero-filled output and a boolean scatter
  ``out[valid] = x.index_select(0, rows)`` per tensor (unpad / repad style).
- ``python_pad_loop (verl)``: per sequence, slice, pad with ``torch.cat``,
  split chunks for CP, then one ``torch.cat`` (verl / Megatron's sequence
  packing utilities work sequence by sequence like this).

``compass.pack``: the public API (metadata, cu_seqlens, position ids and
every tensor; the torch backend on CPU, Triton on GPU).
"""

from __future__ import annotations

import numpy as np
import torch

import compass_kernels as ck
from bench.harness import Case
from bench.roofline import Model
from compass_kernels.packing import reference as ref

OP = "packing_pack"
SHAPES = ((64, 1), (64, 2), (256, 2))  # (sequences in the batch, cp)
QUICK_SHAPES = ((16, 2),)
TP = 2
LAYERS, TOP_K = 48, 8


def make_inputs(n: int, quick: bool):
    lengths = ref.lognormal_lengths(n, n) // (64 if quick else 8) + 1
    T = int(lengths.sum())
    g = torch.Generator().manual_seed(n)
    tensors = {
        "ids": torch.randint(0, 150000, (T,), generator=g),
        "old_logprobs": -torch.rand(T, generator=g),
        "advantages": torch.randn(T, generator=g),
        "mask": torch.rand(T, generator=g) < 0.9,
        "routing": torch.randint(0, 255, (T, LAYERS, TOP_K), generator=g, dtype=torch.uint8),
    }
    return lengths, tensors, list(range(0, n, 2))


def _gather_index(lengths, idx, pad, cp, rank, pad_row):
    """[T_out] source row of each packed slot (pad_row for padding), positions."""
    L = np.asarray(lengths)
    starts = np.concatenate([[0], np.cumsum(L)])[idx]
    seqlens = L[idx]
    padded = -(-seqlens // pad) * pad
    local = padded // cp
    seq_of = np.repeat(np.arange(len(idx)), local)
    u = np.arange(local.sum()) - np.repeat(np.cumsum(local) - local, local)
    if cp == 1:
        pos = u
    else:
        c = (local // 2)[seq_of]
        pos = np.where(u < c, rank * c + u, (2 * cp - 1 - rank) * c + (u - c))
    rows = np.where(pos < seqlens[seq_of], starts[seq_of] + pos, pad_row)
    return torch.from_numpy(rows), torch.from_numpy(pos)


def index_select_pack(tensors, lengths, idx, pad, cp, rank):
    T = int(np.sum(lengths))
    rows, pos = _gather_index(lengths, idx, pad, cp, rank, T)
    out = {}
    for k, x in tensors.items():
        ext = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
        out[k] = ext.index_select(0, rows)
    return out, pos


def boolean_mask_pack(tensors, lengths, idx, pad, cp, rank):
    rows, pos = _gather_index(lengths, idx, pad, cp, rank, -1)
    valid = rows >= 0
    src_rows = rows[valid]
    out = {}
    for k, x in tensors.items():
        o = x.new_zeros((rows.numel(), *x.shape[1:]))
        o[valid] = x.index_select(0, src_rows)
        out[k] = o
    return out, pos


def python_loop_pack(tensors, lengths, idx, pad, cp, rank):
    starts = np.concatenate([[0], np.cumsum(lengths)])
    out = {}
    pos_parts = []
    for k, x in tensors.items():
        parts = []
        for i in idx:
            L = int(lengths[i])
            P = -(-L // pad) * pad
            seq = torch.cat([x[starts[i] : starts[i] + L], x.new_zeros((P - L, *x.shape[1:]))])
            if cp == 1:
                chunks = [(0, P)]
            else:
                c = P // (2 * cp)
                chunks = [
                    (rank * c, (rank + 1) * c),
                    ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c),
                ]
            for a, b in chunks:
                parts.append(seq[a:b])
                if k == "ids":
                    pos_parts.append(torch.arange(a, b))
        out[k] = torch.cat(parts)
    return out, torch.cat(pos_parts)


def ours(tensors, lengths, idx, pad, cp, rank):
    b = ck.packing.pack(tensors, lengths, idx, pad_multiple=pad, cp_size=cp, cp_rank=rank)
    return b.tensors, b.position_ids


def case(n: int, cp: int, quick: bool) -> Case:
    lengths, tensors, idx = make_inputs(n, quick)
    pad = 2 * cp * TP
    args = (tensors, lengths, idx, pad, cp, 0)
    packed_rows = sum(-(-int(lengths[i]) // pad) * pad for i in idx) // cp
    row_bytes = sum(x[0].numel() * x.element_size() for x in tensors.values())
    return Case(
        name=OP,
        shape={"seqs": len(idx), "tokens": packed_rows, "cp": cp},
        providers={
            "index_select": lambda: index_select_pack(*args),
            "compass.pack": lambda: ours(*args),
            "boolean_mask": lambda: boolean_mask_pack(*args),
            "python_pad_loop (verl)": lambda: python_loop_pack(*args),
        },
        baseline="index_select",
        device="cpu",
        # read the kept rows, write the packed ones and the position ids; a launch per tensor
        model=Model(bytes=2 * packed_rows * row_bytes + 8 * packed_rows, kernels=len(tensors) + 1),
    )


def cases(quick: bool) -> list[Case]:
    return [case(n, cp, quick) for n, cp in (QUICK_SHAPES if quick else SHAPES)]
