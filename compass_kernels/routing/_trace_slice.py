"""RoutingTrace re-layout: the slice of one training rank (sequences, layers, padding,
CP / SP split) and the row gather behind it. Methods of RoutingTrace (trace.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from compass_kernels.routing._trace_common import (
    MissingReason,
    TraceError,
    _as_int64_vector,
    _cu_from_lens,
)

if TYPE_CHECKING:
    from compass_kernels.routing.trace import RoutingTrace


def slice_plan(
    self: RoutingTrace,
    *,
    sequences: Sequence[int] | None = None,
    token_lens=None,
    pad_multiple: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: str | None = None,
    sp_size: int = 1,
    sp_rank: int = 0,
    max_missing_fraction: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The token-side plan of :meth:`slice` (host tensors, no layer selection).

    Returns (src, kind, seg_lens): for each local token of this rank, in
    order, ``src`` int64 = its row in this trace (-1 when it has none) and
    ``kind`` uint8 = 0 (a trace row), MissingReason.NO_ROW (the sequence's
    last token), MissingReason.SHORT (an input token the trace has no row
    for: only with ``max_missing_fraction``, see :meth:`slice`) or
    MissingReason.PADDING; seg_lens
    = local tokens per sequence (sequences cut by the sequence-parallel
    slice keep only their piece; sequences with no local token keep 0).
    """
    cu = self._cu()
    n = self.num_sequences
    seqs = list(range(n)) if sequences is None else [int(i) for i in sequences]
    for i in seqs:
        if not 0 <= i < n:
            raise IndexError(f"sequences: index {i} out of range for {n} sequences")
    rows = [cu[i + 1] - cu[i] for i in seqs]
    own = self.token_lens
    starts = [own[i] - 1 - r for i, r in zip(seqs, rows, strict=True)]  # omitted prefix
    for j, i in enumerate(seqs):
        if starts[j] < 0:
            raise TraceError(
                f"sequence {i}: {rows[j]} rows for {own[i]} tokens (the trace's token_lens; "
                "at most tokens - 1)"
            )
    if token_lens is None:
        tl = [own[i] for i in seqs]
    else:
        tl = _as_int64_vector("token_lens", token_lens, "cpu").tolist()
        if len(tl) != len(seqs):
            raise ValueError(
                f"token_lens: expected {len(seqs)} entries (one per sequence), got {len(tl)}"
            )
    for j, (r, t) in enumerate(zip(rows, tl, strict=True)):
        if t - 1 < starts[j] + r:
            raise TraceError(
                f"token_lens: sequence {seqs[j]} has {r} rows but only {t} tokens in "
                "the training batch (rows are tokens minus the last: token_lens must be "
                "> rows; routes not truncated with the response?)"
            )
    short = [t - 1 - r for r, t in zip(rows, tl, strict=True)]
    if any(short):
        self._check_short(seqs, rows, tl, short, max_missing_fraction)
    for name, size, rank in (("cp", cp_size, cp_rank), ("sp", sp_size, sp_rank)):
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"{name}_size: expected a positive int, got {size!r}")
        if not (isinstance(rank, int) and 0 <= rank < size):
            raise ValueError(f"{name}_rank: expected an int in [0, {size}), got {rank!r}")
    if not (isinstance(pad_multiple, int) and pad_multiple >= 1):
        raise ValueError(f"pad_multiple: expected a positive int, got {pad_multiple!r}")
    if cp_size > 1:
        if cp_layout not in ("zigzag", "contiguous"):
            raise ValueError(
                "cp_layout: with cp_size > 1 declare how sequences were split, 'zigzag' "
                "(Megatron's load-balanced THD split, chunks r and 2*cp-1-r) or "
                f"'contiguous' (chunk r); got {cp_layout!r}"
            )
        chunks = 2 * cp_size if cp_layout == "zigzag" else cp_size
        if pad_multiple % chunks:
            raise ValueError(
                f"pad_multiple: {pad_multiple} is not a multiple of {chunks} "
                f"({'2*' if cp_layout == 'zigzag' else ''}cp_size for the {cp_layout} split)"
            )
    elif cp_layout not in (None, "zigzag", "contiguous"):
        raise ValueError(f"cp_layout: expected 'zigzag', 'contiguous' or None, got {cp_layout!r}")
    srcs, kinds, seg = [], [], []
    for j, i in enumerate(seqs):
        padded = -(-tl[j] // pad_multiple) * pad_multiple
        pos = torch.arange(padded, dtype=torch.int64)
        if cp_size > 1:
            if cp_layout == "zigzag":
                c = padded // (2 * cp_size)
                pos = torch.cat(
                    [
                        pos[cp_rank * c : (cp_rank + 1) * c],
                        pos[(2 * cp_size - 1 - cp_rank) * c : (2 * cp_size - cp_rank) * c],
                    ]
                )
            else:
                c = padded // cp_size
                pos = pos[cp_rank * c : (cp_rank + 1) * c]
        a0 = starts[j]
        has_row = (pos >= a0) & (pos < a0 + rows[j])
        kind = torch.where(
            has_row,
            0,
            torch.where(
                pos < tl[j] - 1,
                int(MissingReason.SHORT),
                torch.where(pos < tl[j], int(MissingReason.NO_ROW), int(MissingReason.PADDING)),
            ),
        ).to(torch.uint8)
        src = torch.where(has_row, pos - a0 + cu[i], -1)
        srcs.append(src)
        kinds.append(kind)
        seg.append(pos.numel())
    src = torch.cat(srcs) if srcs else torch.zeros(0, dtype=torch.int64)
    kind = torch.cat(kinds) if kinds else torch.zeros(0, dtype=torch.uint8)
    if sp_size > 1:
        total = src.numel()
        if total % sp_size:
            raise ValueError(
                f"sp_size: this rank's {total} packed tokens do not split into {sp_size} "
                "sequence-parallel pieces (pad each sequence to a multiple of cp*sp, "
                "pad_multiple)"
            )
        piece = total // sp_size
        lo, hi = sp_rank * piece, (sp_rank + 1) * piece
        src, kind = src[lo:hi], kind[lo:hi]
        new_seg, acc = [], 0
        for s in seg:
            a, b = max(acc, lo), min(acc + s, hi)
            new_seg.append(max(0, b - a))
            acc += s
        seg = new_seg
    return src, kind, seg


def _check_short(self: RoutingTrace, seqs, rows, tl, short, max_missing_fraction) -> None:
    """Raise unless the caller accepted the input tokens without a row by name."""
    if max_missing_fraction is None:
        j = next(j for j, x in enumerate(short) if x)
        raise TraceError(
            f"sequence {seqs[j]}: {rows[j]} rows for {tl[j]} tokens (rows must be tokens "
            f"- 1): {short[j]} input tokens ({sum(short)} over the batch) have no row and "
            "would be routed natively without a mark; pass max_missing_fraction= to "
            "accept them (reason SHORT)"
        )
    if not (isinstance(max_missing_fraction, (int, float)) and 0 <= max_missing_fraction <= 1):
        raise ValueError(
            f"max_missing_fraction: expected a number in [0, 1], got {max_missing_fraction!r}"
        )
    marked = 0
    if self.missing_reason is not None:
        cu = self._cu()
        per_tok = self.missing_reason.cpu() != 0
        marked = sum(int(per_tok[cu[i] : cu[i + 1]].sum()) for i in seqs)
    inputs = max(1, sum(t - 1 for t in tl))
    if sum(short) + marked > max_missing_fraction * inputs:
        raise TraceError(
            f"missing rows: {sum(short)} input tokens short of a row and {marked} marked "
            f"missing, of {inputs}: more than max_missing_fraction={max_missing_fraction}"
        )


def slice(
    self: RoutingTrace,
    *,
    layers: Iterable[int] | None = None,
    include_mtp: bool = False,
    sequences: Sequence[int] | None = None,
    token_lens=None,
    pad_multiple: int = 1,
    pad_policy: str = "missing",
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: str | None = None,
    sp_size: int = 1,
    sp_rank: int = 0,
    max_missing_fraction: float | None = None,
) -> RoutingTrace:
    """The part of the trace one training rank uses, in its packed token order.

    Parameters
    ----------
    layers : global layer numbers this rank's pipeline stage holds (e.g.
        ``range(first, last + 1)``); dense layers among them are ignored
        (they have no column). None: every decoder MoE layer.
    include_mtp : keep the MTP columns (default: dropped, never replayed).
    sequences : the sequences of the micro-batch in packed order (default all).
    token_lens : [len(sequences)] the trainer's token count per sequence
        (default: the trace's :attr:`token_lens`, rows + 1 unless known). The
        last token gets a missing row, reason NO_ROW. Rows must be at most
        ``token_lens - 1`` (else :class:`TraceError`: e.g. routes not
        truncated with the response).
    max_missing_fraction : None (default): every input token must have a row
        (``token_lens - 1 == rows``, the trace's own omitted prefix counted as
        missing); a short trace raises :class:`TraceError` naming the
        sequence. A float f: accept short traces as long as the input tokens
        without a row, marked by the engine or short, are at most f of all
        input tokens of the selected sequences; short tokens get missing rows,
        reason SHORT (routed natively; ``TraceReplay`` needs the same opt-in).
    pad_multiple : each sequence is padded to a multiple of this (Megatron
        THD packing with CP: 2*cp*tp for zigzag). Padding tokens get rows per
        ``pad_policy``: "missing" (marked missing, reason PADDING: replay
        routes them natively and counts them) or "fixed" (present rows
        holding experts 0..top_k-1, a deterministic routing).
    cp_size, cp_rank, cp_layout : context-parallel split of each padded
        sequence; ``cp_layout`` must be declared when cp_size > 1: "zigzag"
        (2*cp chunks, rank r holds chunks r and 2*cp-1-r, Megatron / TE THD)
        or "contiguous" (cp chunks, rank r holds chunk r).
    sp_size, sp_rank : sequence-parallel split of the rank's packed tokens
        (after CP) into sp contiguous equal pieces (the router of a
        sequence-parallel MoE layer sees piece sp_rank).

    Returns a new trace (a copy) with one row per local token of this rank
    in order, cu_seqlens = local tokens per sequence (0 for a sequence with
    no local token), only the selected layers' columns, int64 offsets.
    """
    if pad_policy not in ("missing", "fixed"):
        raise ValueError(f"pad_policy: expected 'missing' or 'fixed', got {pad_policy!r}")
    src, kind, seg = self.slice_plan(
        sequences=sequences,
        token_lens=token_lens,
        pad_multiple=pad_multiple,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout,
        sp_size=sp_size,
        sp_rank=sp_rank,
        max_missing_fraction=max_missing_fraction,
    )
    if layers is None:
        cols = list(range(self.num_moe_layers))
    else:
        want = {int(x) for x in layers}
        cols = [c for c, lid in enumerate(self.layer_ids.tolist()) if lid in want]
    mtp = self.mtp_layer_ids if include_mtp else self.mtp_layer_ids[:0]
    if include_mtp:
        cols += list(range(self.num_moe_layers, self.num_moe_layers + self.num_mtp_layers))
    lids = self.layer_ids[[c for c in cols if c < self.num_moe_layers]]
    return self._gather(src, kind, seg, cols, pad_policy=pad_policy, keys=(lids, mtp))


def _gather(
    self: RoutingTrace,
    src,
    kind,
    seg_lens,
    cols,
    *,
    pad_policy="missing",
    keys=None,
    token_lens=None,
) -> RoutingTrace:
    dev = self.device
    idx = src.clamp(min=0).to(dev)
    ids = self.expert_ids.index_select(0, idx)
    missing = self._missing_mask().index_select(0, idx) if self.missing is not None else None
    reason = self._reasons().index_select(0, idx) if self.missing is not None else None
    if cols is not None and cols != list(range(self.expert_ids.shape[1])):
        cidx = torch.as_tensor(cols, dtype=torch.int64, device=dev)
        ids = ids.index_select(1, cidx)
        missing = None if missing is None else missing.index_select(1, cidx)
    nrows, ncols = ids.shape[:2]
    # Decisions on the host plan (``kind`` is a CPU tensor): no device sync.
    synth_h = kind != 0
    if pad_policy == "fixed":
        pad_h = kind == int(MissingReason.PADDING)
        if bool(pad_h.any()):
            fill = torch.arange(self.top_k, device=dev).to(ids.dtype).view(1, 1, -1)
            ids = torch.where(pad_h.to(dev)[:, None, None], fill, ids)
            synth_h = synth_h & ~pad_h
    if bool(synth_h.any()) or missing is not None:
        synth = synth_h.to(dev)
        if missing is None:
            missing = torch.zeros(nrows, ncols, dtype=torch.bool, device=dev)
            reason = torch.zeros(nrows, dtype=torch.uint8, device=dev)
        assert reason is not None  # set with missing
        missing = missing | synth[:, None]
        reason = torch.where(synth, kind.to(dev), reason)
        # a token whose missing columns were all dropped is present now
        reason = torch.where(missing.any(1), reason, 0).to(torch.uint8)
    lids, mtp = (None, None) if keys is None else keys
    return self._with(
        ids,
        _cu_from_lens(seg_lens, dev),
        missing,
        reason,
        layer_ids=lids,
        mtp=mtp,
        token_lens=token_lens,
    )
