"""THD pack / unpack for Megatron (ck.packing.pack, ck.packing.unpack).

A micro-batch (sequence indices from a :class:`~compass_kernels.packing.Plan`)
becomes Megatron's THD layout: each sequence padded to ``pad_multiple``
(2 * cp * tp), the sequences concatenated, with cu_seqlens, cu_seqlens_padded,
max_seqlen and position ids; with context parallelism each sequence is cut in
2 * cp chunks and CP rank r keeps chunks r and 2cp-1-r (the load-balanced
zigzag Megatron / Transformer Engine expect). :func:`unpack` inverts it.

Sizes come from the host (the plan's lengths): the GPU path never syncs.
Per-token tensors of any dtype and trailing shape (token ids, log-probs,
advantages, masks, routing traces [T, layers, top_k]) move as opaque rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from compass_kernels._op import op
from compass_kernels._validate import as_int, describe

__all__ = ["PackedBatch", "pack", "unpack", "thd_pack_op", "thd_unpack_op", "thd_positions_op"]


_PACK = "compass_kernels.packing."


@op(
    kernels={
        "torch": _PACK + "reference:thd_pack_torch",
        "triton": _PACK + "triton:thd_pack_triton",
    }
)
def thd_pack_op(
    src: torch.Tensor,
    seq_start: torch.Tensor,
    seqlens: torch.Tensor,
    out_offsets: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    fill: int,
    total: int,
) -> torch.Tensor:
    """THD pack of uint8 rows: ``out`` [total, W] uint8, sequence j's local slots
    ``out_offsets[j]:out_offsets[j+1]`` holding its zigzag chunks for ``cp_rank``.

    src : [T, W] uint8 (any dtype's rows viewed as bytes). seq_start, seqlens :
    [m] int64, sequence j's first row in src and its length. out_offsets : [m+1]
    int64 local slot offsets. cp_size, cp_rank : the zigzag split. fill : the
    padding byte. total : local rows (out_offsets[m], a host int).
    """
    return torch.empty((total, src.shape[1]), dtype=src.dtype, device=src.device)


@op(
    kernels={
        "torch": _PACK + "reference:thd_unpack_torch",
        "triton": _PACK + "triton:thd_unpack_triton",
    }
)
def thd_unpack_op(
    packed: torch.Tensor,
    seqlens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out_offsets: torch.Tensor,
    cp_size: int,
    total: int,
) -> torch.Tensor:
    """THD unpack: ``out`` [total, W] uint8, the sequences unpadded in micro-batch order.

    packed : [cp_size * local_tokens, W] uint8 (every rank's rows stacked).
    seqlens : [m] int64. cu_seqlens : [m+1] int64 (unpadded offsets in out).
    out_offsets : [m+1] int64 local padded offsets. total : rows of out.
    """
    return torch.empty((total, packed.shape[1]), dtype=packed.dtype, device=packed.device)


@op(
    kernels={
        "torch": _PACK + "reference:thd_positions_torch",
        "triton": _PACK + "triton:thd_positions_triton",
    }
)
def thd_positions_op(
    out_offsets: torch.Tensor, cp_size: int, cp_rank: int, total: int
) -> torch.Tensor:
    """Position of each local slot in its padded sequence: ``out`` [total] int64.

    out_offsets : [m+1] int64 local slot offsets; cp_size, cp_rank : the zigzag split.
    """
    return torch.empty(total, dtype=torch.int64, device=out_offsets.device)


@dataclass
class PackedBatch:
    """One micro-batch in THD layout, on one context-parallel rank.

    tensors : name -> packed [local_tokens, ...] (input dtype and trailing shape).
    indices : [m] int64 (host) the batch's sequence indices, in packed order.
    seqlens : [m] int64 (host) their lengths; padded : after padding to pad_multiple.
    cu_seqlens, cu_seqlens_padded : [m + 1] int32 on the tensors' device, over the
        whole (un-split) sequences, as Megatron's PackedSeqParams wants them.
    max_seqlen : the largest padded length.
    position_ids : [local_tokens] int64, each token's position in its sequence.
    """

    tensors: dict[str, torch.Tensor]
    indices: np.ndarray
    seqlens: np.ndarray
    padded: np.ndarray
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    pad_multiple: int
    cp_size: int
    cp_rank: int
    local_tokens: int
    total_tokens: int
    _meta: dict[str, torch.Tensor] = field(repr=False)  # device int64 seqlens, cu, out_offsets

    def packed_seq_params(self):
        """Megatron-core's PackedSeqParams (qkv_format="thd") for this micro-batch."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def split(self, unpacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sequence views of an :func:`unpack` result (host sizes: no sync)."""
        return unpacked.split(self.seqlens.tolist())


def _host_ints(name: str, x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(
                f"{name}: expected a host (CPU) tensor, list or array: sizes come from the plan, "
                f"reading them from {x.device} would sync; got {describe(x)}"
            )
        x = x.numpy()
    a = np.asarray(x)
    if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name}: expected a 1-d sequence of ints, got {a.dtype}{list(a.shape)}")
    return a.astype(np.int64, copy=False)


def _fill_byte(name: str, t: torch.Tensor, value) -> int:
    """The byte whose repetition is ``value`` in ``t``'s dtype (0, or all ones)."""
    if value == 0:
        return 0
    size = t.element_size()
    if size == 1 and not t.dtype.is_floating_point:
        v = int(value)
        if t.dtype == torch.bool:
            v = int(bool(value))
        if -128 <= v < 0 or 0 <= v <= 255:
            return v & 0xFF
    elif not t.dtype.is_floating_point and t.dtype != torch.bool and int(value) == -1:
        return 0xFF
    raise ValueError(
        f"pad_values[{name!r}]: expected 0, -1 (integers: all bits set) or a byte value for "
        f"1-byte dtypes, got {value!r} for {t.dtype}"
    )


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(t.shape[0], -1)
    # contiguous() keeps any stride on a size-1 dim ([1] sliced with a step of 2 has
    # stride 2), which a dtype view refuses: a fresh copy has the canonical strides
    if t.stride(-1) != 1 or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":  # pinned: the copy is asynchronous, no host sync
        return t.pin_memory().to(device, non_blocking=True)
    return t


def pack(
    tensors: torch.Tensor | dict[str, torch.Tensor],
    lengths,
    indices,
    *,
    pad_multiple: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    pad_values: dict[str, int] | None = None,
    backend: str | None = None,
) -> PackedBatch:
    """Pack micro-batch ``indices`` of a jagged batch into Megatron's THD layout.

    Parameters
    ----------
    tensors : one tensor or name -> tensor, each [T, ...] (any dtype): the batch's
        tokens, sequence after sequence (sequence i at rows sum(lengths[:i]) ..).
        A single tensor is packed under the name "input".
    lengths : [n] host ints, the batch's sequence lengths (e.g. ``Plan.lengths``).
    indices : [m] host ints, the micro-batch (e.g. ``Plan.micro_batch(rank, j)``).
    pad_multiple : each sequence is padded to a multiple of this; with cp_size > 1
        it must be a multiple of 2 * cp_size (2 * cp * tp for Megatron).
    cp_size, cp_rank : context parallelism: this rank keeps chunks cp_rank and
        2*cp_size-1-cp_rank of each sequence's 2*cp_size chunks.
    pad_values : name -> value written to padding (default 0; -1 or a byte value
        for integer tensors, e.g. 255 to mark uint8 routing rows missing).
    backend : None (default dispatch: "torch" on CPU, "triton" on GPU), "torch" or "triton".

    NaN / Inf policy: values are moved as bytes, never computed with: NaN / Inf
    pass through bit for bit, nothing to check (as for :func:`unpack`).
    """
    if isinstance(tensors, torch.Tensor):
        tensors = {"input": tensors}
    if not tensors:
        raise ValueError("tensors: expected at least one tensor to pack")
    L = _host_ints("lengths", lengths)
    idx = _host_ints("indices", indices)
    n, m = L.size, idx.size
    pad_multiple = as_int("pad_multiple", pad_multiple, lo=1, hi=2**31 - 1)
    cp_size = as_int("cp_size", cp_size, lo=1, hi=2**31 - 1)
    cp_rank = as_int("cp_rank", cp_rank)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected 0 <= cp_rank < cp_size = {cp_size}, got {cp_rank!r}")
    if cp_size > 1 and pad_multiple % (2 * cp_size):
        raise ValueError(
            f"pad_multiple: expected a multiple of 2 * cp_size = {2 * cp_size} (each sequence is "
            f"cut in 2 * cp_size equal chunks), got {pad_multiple}"
        )
    if m == 0:
        raise ValueError("indices: expected at least one sequence in the micro-batch, got none")
    if idx.min() < 0 or idx.max() >= n:
        bad = int(idx[(idx < 0) | (idx >= n)][0])
        raise ValueError(f"indices: expected values in [0, {n}), got {bad}")
    if m > 1 and np.unique(idx).size != m:
        s_idx = np.sort(idx, kind="stable")
        dup = int(s_idx[1:][s_idx[1:] == s_idx[:-1]][0])
        raise ValueError(
            f"indices: sequence {dup} appears more than once (a micro-batch packs each "
            "sequence once)"
        )
    if n and (int(L.min()) < 0 or int(L.max()) >= 2**31):
        i = int(np.argmax((L < 0) | (L >= 2**31)))
        raise ValueError(
            f"lengths: expected 0 <= length < 2^31 (int32 cu_seqlens), got lengths[{i}] = "
            f"{int(L[i])}"
        )
    seqlens = L[idx]
    if (seqlens <= 0).any():
        j = int(np.argmax(seqlens <= 0))
        raise ValueError(
            f"lengths: sequence {int(idx[j])} (micro-batch position {j}) is empty "
            f"(length {int(seqlens[j])}); empty sequences cannot be packed"
        )
    src_cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(L, out=src_cu[1:])
    padded = -(-seqlens // pad_multiple) * pad_multiple
    local = padded // cp_size
    out_offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(local, out=out_offsets[1:])
    cu = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(seqlens, out=cu[1:])
    cu_padded = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(padded, out=cu_padded[1:])
    if cu_padded[-1] >= 2**31:
        raise ValueError(f"indices: {int(cu_padded[-1])} padded tokens overflow int32 cu_seqlens")
    first = next(iter(tensors.values()))
    dev = first.device
    total = int(out_offsets[-1])
    meta = {
        "seq_start": _to_device(src_cu[idx], dev),
        "seqlens": _to_device(seqlens, dev),
        "out_offsets": _to_device(out_offsets, dev),
        "cu": _to_device(cu, dev),
    }
    pad_values = pad_values or {}
    unknown = set(pad_values) - set(tensors)
    if unknown:
        raise ValueError(f"pad_values: names {sorted(unknown)} are not among the tensors")
    packed = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"tensors[{name!r}]: expected a tensor [T, ...], got {t!r}")
        if t.device != dev:
            raise ValueError(f"tensors[{name!r}]: expected a tensor on {dev}, got {describe(t)}")
        if t.shape[0] != src_cu[-1]:
            raise ValueError(
                f"tensors[{name!r}]: expected {int(src_cu[-1])} rows (sum of lengths), "
                f"got {describe(t)}"
            )
        fill = _fill_byte(name, t, pad_values.get(name, 0))
        if t.dim() > 1 and math.prod(t.shape[1:]) == 0:  # zero-width rows: nothing to move
            packed[name] = t.new_empty((total, *t.shape[1:]))
            continue
        rows = thd_pack_op(
            src=_as_rows(t),
            seq_start=meta["seq_start"],
            seqlens=meta["seqlens"],
            out_offsets=meta["out_offsets"],
            cp_size=cp_size,
            cp_rank=cp_rank,
            fill=fill,
            total=total,
            backend=backend,
        )
        packed[name] = rows.view(t.dtype).reshape(total, *t.shape[1:])
    positions = thd_positions_op(
        out_offsets=meta["out_offsets"],
        cp_size=cp_size,
        cp_rank=cp_rank,
        total=total,
        backend=backend,
    )
    return PackedBatch(
        tensors=packed,
        indices=idx,
        seqlens=seqlens,
        padded=padded,
        cu_seqlens=_to_device(cu.astype(np.int32), dev),
        cu_seqlens_padded=_to_device(cu_padded.astype(np.int32), dev),
        max_seqlen=int(padded.max()),
        position_ids=positions,
        pad_multiple=pad_multiple,
        cp_size=cp_size,
        cp_rank=cp_rank,
        local_tokens=total,
        total_tokens=int(cu[-1]),
        _meta=meta,
    )


def unpack(
    packed: torch.Tensor | list[torch.Tensor], batch: PackedBatch, *, backend: str | None = None
) -> torch.Tensor:
    """Invert :func:`pack`: [total_tokens, ...] in ``packed``'s dtype, the micro-batch's
    sequences, unpadded, in packed order (``batch.split`` gives per-sequence views).

    packed : [local_tokens, ...] model output for cp_size = 1; with context
        parallelism every rank's output: a list of cp_size tensors (rank order),
        or their concatenation [cp_size * local_tokens, ...] (an all-gather).

    Differentiable: the gradient of ``packed`` is the pack of the output's
    gradient (zero at padding), for every CP rank. NaN / Inf pass through bit
    for bit (values are moved, never computed with): nothing to check.
    """
    if isinstance(packed, (list, tuple)):
        if len(packed) != batch.cp_size:
            raise ValueError(
                f"packed: expected {batch.cp_size} tensors (one per CP rank), got {len(packed)}"
            )
        packed = torch.cat(list(packed))
    if not isinstance(packed, torch.Tensor) or packed.dim() < 1:
        raise ValueError(f"packed: expected a tensor [tokens, ...], got {packed!r}")
    rows_expected = batch.cp_size * batch.local_tokens
    if packed.shape[0] != rows_expected:
        raise ValueError(
            f"packed: expected {rows_expected} rows (cp_size * local_tokens), "
            f"got {describe(packed)}"
        )
    meta = batch._meta
    if packed.device != meta["seqlens"].device:
        raise ValueError(
            f"packed: expected a tensor on {meta['seqlens'].device}, got {describe(packed)}"
        )
    if packed.requires_grad and torch.is_grad_enabled():
        return _Unpack.apply(packed, batch, backend)
    return _unpack_rows(packed, batch, backend)


def _unpack_rows(packed: torch.Tensor, batch: PackedBatch, backend) -> torch.Tensor:
    meta = batch._meta
    rows = thd_unpack_op(
        packed=_as_rows(packed),
        seqlens=meta["seqlens"],
        cu_seqlens=meta["cu"],
        out_offsets=meta["out_offsets"],
        cp_size=batch.cp_size,
        total=batch.total_tokens,
        backend=backend,
    )
    return rows.view(packed.dtype).reshape(batch.total_tokens, *packed.shape[1:])


class _Unpack(torch.autograd.Function):
    """unpack is a gather; its gradient is the pack of the output gradient (zero
    at padding) for every CP rank, concatenated like the input."""

    @staticmethod
    def forward(ctx, packed, batch, backend):
        ctx.batch, ctx.backend = batch, backend
        return _unpack_rows(packed.detach(), batch, backend)

    @staticmethod
    def backward(ctx, grad):
        b, meta = ctx.batch, ctx.batch._meta
        g = _as_rows(grad)
        parts = [
            thd_pack_op(
                src=g,
                seq_start=meta["cu"][:-1],
                seqlens=meta["seqlens"],
                out_offsets=meta["out_offsets"],
                cp_size=b.cp_size,
                cp_rank=r,
                fill=0,
                total=b.local_tokens,
                backend=ctx.backend,
            )
            for r in range(b.cp_size)
        ]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        return rows.view(grad.dtype).reshape(-1, *grad.shape[1:]), None, None
