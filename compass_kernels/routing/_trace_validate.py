"""RoutingTrace.validate and its checks: the fused device counters and, for a failing
trace, the host search for the first offender. Methods of RoutingTrace (trace.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from compass_kernels.routing._trace_common import (
    MissingReason,
    TraceError,
    _as_int64_vector,
    _bisect_right,
)

if TYPE_CHECKING:
    from compass_kernels.routing.trace import RoutingTrace


def validate(
    self: RoutingTrace,
    *,
    moe_layer_ids=None,
    num_layers: int | None = None,
    top_k: int | None = None,
    num_experts: int | None = None,
    mtp_layer_ids=None,
    expected_rows=None,
    max_missing_fraction: float | None = None,
    raise_on_error: bool = True,
):
    """Check the trace against the contract and, when given, against the model.

    Data checks run on the trace's device as a few fused reductions into one
    small counter vector; the only host sync is one read of that vector. A
    failing trace then pays for locating the first offender.

    Checks: cu_seqlens (0, non-decreasing, last == total rows); every present
    id in [0, num_experts); no expert twice within a present row;
    missing_reason nonzero exactly on tokens with a missing column and a known
    MissingReason; and, when given: ``moe_layer_ids`` (the model's MoE layer
    numbers, e.g. found by walking its modules) equal to ``layer_ids``;
    ``num_layers`` > every layer id; ``top_k`` / ``num_experts`` equal to the
    model's; ``mtp_layer_ids`` equal; ``expected_rows`` ([n] ints: rows each
    sequence must have, i.e. prompt + generated - 1).

    Row counts, always: no sequence has more rows than ``token_lens - 1``.
    By default (``max_missing_fraction=None``) every input token has a row or a
    row the engine marked missing with its reason: no sequence has fewer rows
    than ``token_lens - 1``, no token is marked ``SHORT``, and at most one token
    per sequence (its last) is ``NO_ROW``. With ``max_missing_fraction=f`` (a
    caller accepting short traces by name) those are allowed as long as the
    missing (token, layer) rows, marked or short, are at most ``f`` of
    ``max(rows, token_lens - 1)`` summed over sequences, times the layers.

    Returns self, or with ``raise_on_error=False`` a 0-d bool device tensor
    (True = valid) without any host sync (model metadata checks still raise).

    Raises :class:`TraceError` naming the sequence, the global layer number
    (or MTP index) and the token position within the sequence.
    """
    # Metadata against the model: host values only, no sync.
    if num_experts is not None and num_experts != self.num_experts:
        raise TraceError(
            f"num_experts: the model has {num_experts} experts, the trace {self.num_experts}"
        )
    if top_k is not None and top_k != self.top_k:
        raise TraceError(f"top_k: the model routes to {top_k} experts, the trace {self.top_k}")
    if moe_layer_ids is not None:
        model = _as_int64_vector("moe_layer_ids", moe_layer_ids, "cpu")
        if not torch.equal(model, self.layer_ids):
            mine, theirs = set(self.layer_ids.tolist()), set(model.tolist())
            raise TraceError(
                "layer map: the model's MoE layers are "
                f"{model.tolist()}, the trace's {self.layer_ids.tolist()} (trace-only: "
                f"{sorted(mine - theirs)}, model-only: {sorted(theirs - mine)})"
            )
    if num_layers is not None and self.num_moe_layers and int(self.layer_ids[-1]) >= num_layers:
        raise TraceError(
            f"layer map: trace layer {int(self.layer_ids[-1])} >= the model's "
            f"num_layers={num_layers}"
        )
    if mtp_layer_ids is not None:
        model = _as_int64_vector("mtp_layer_ids", mtp_layer_ids, "cpu")
        if not torch.equal(model, self.mtp_layer_ids):
            raise TraceError(
                f"MTP layers: the model has {model.tolist()}, the trace "
                f"{self.mtp_layer_ids.tolist()}"
            )
    n = self.num_sequences
    exp = None
    if expected_rows is not None:
        exp = _as_int64_vector("expected_rows", expected_rows, self.device)
        if exp.numel() != n:
            raise TraceError(f"expected_rows: {exp.numel()} entries for {n} sequences")
    if max_missing_fraction is not None and not (
        isinstance(max_missing_fraction, (int, float)) and 0 <= max_missing_fraction <= 1
    ):
        raise ValueError(
            f"max_missing_fraction: expected a number in [0, 1], got {max_missing_fraction!r}"
        )
    if exp is not None and raise_on_error and self.device.type == "cpu":
        # Row counts first where that is free (host tensors): a trace whose rows
        # are not the batch's (a crafted 2^40-row header) is refused before the
        # per-id checks read, or allocate for, its rows.
        cu, got = self.cu_seqlens, self.cu_seqlens.diff()
        if int(cu[0]) == 0 and int(cu[-1]) == self.num_tokens and not bool((got < 0).any()):
            if not torch.equal(got, exp):
                i = int((got != exp).nonzero()[0, 0])
                raise TraceError(
                    f"sequence {i}: {int(got[i])} rows, expected {int(exp[i])} "
                    "(prompt + generated - 1)"
                )
    flags = self._flags(expected_rows=exp, max_missing_fraction=max_missing_fraction)
    if not raise_on_error:
        return (flags == 0).all()
    counts = flags.tolist()  # the one host sync
    if not any(counts):
        return self
    self._raise(counts, expected_rows=exp, max_missing_fraction=max_missing_fraction)
    raise AssertionError("unreachable")  # pragma: no cover


def _row_counts(self: RoutingTrace):
    """(rows [n], tokens - 1 [n], absent [n], unmarked [] ) on the device: absent =
    positions before the rows (short by token_lens), unmarked = absent + SHORT tokens
    + NO_ROW tokens past one per sequence. No sync."""
    dev = self.device
    cu = self.cu_seqlens
    rows = cu.diff()
    want = rows if self._token_lens is None else self._token_lens.to(dev) - 1
    absent = (want - rows).clamp(min=0)
    unmarked = absent.sum()
    if self.missing_reason is not None:
        reason = self.missing_reason
        unmarked = unmarked + (reason == int(MissingReason.SHORT)).sum()
        no_row = (reason == int(MissingReason.NO_ROW)).to(torch.int64)
        cs = torch.zeros(self.num_tokens + 1, dtype=torch.int64, device=dev)
        torch.cumsum(no_row, 0, out=cs[1:])
        cuc = cu.clamp(0, self.num_tokens)
        per_seq = cs[cuc[1:]] - cs[cuc[:-1]]
        unmarked = unmarked + (per_seq - 1).clamp(min=0).sum()
    return rows, want, absent, unmarked


def _flags(self: RoutingTrace, expected_rows=None, max_missing_fraction=None) -> torch.Tensor:
    """int64 [8] counts of violations per check (:attr:`_CHECKS`), on device, no sync."""
    cu = self.cu_seqlens
    ids = self.expert_ids
    zero = torch.zeros((), dtype=torch.int64, device=self.device)
    present = ~self._missing_mask()
    bad_cu = (
        (cu[0] != 0).to(torch.int64)
        + (cu[1:] < cu[:-1]).sum()
        + (cu[-1] != self.num_tokens).to(torch.int64)
    )
    if ids.dtype == torch.uint8:
        oob = ids >= self.num_experts if self.num_experts < 256 else None
    elif self.num_experts > torch.iinfo(ids.dtype).max:  # E = 32768: every int16 >= 0 fits
        oob = ids < 0  # (and never ``ids >= 32768``: the constant would wrap in int16)
    else:
        oob = (ids < 0) | (ids >= self.num_experts)
    bad_range = zero if oob is None else (oob.any(-1) & present).sum()
    if self.top_k > 1:
        s = ids.sort(dim=-1).values
        dup = ((s[..., 1:] == s[..., :-1]).any(-1) & present).sum()
    else:
        dup = zero
    if self.missing is not None:
        reason = self.missing_reason
        assert reason is not None  # set whenever missing is (__init__)
        any_missing = self.missing.any(1)
        bad_reason = (((reason != 0) != any_missing) | (reason >= len(MissingReason))).sum()
    else:
        bad_reason = zero
    if expected_rows is not None:
        bad_rows = (cu.diff() != expected_rows).sum()
    else:
        bad_rows = zero
    rows, want, absent, unmarked = self._row_counts()
    too_many = (rows > want).sum()
    if max_missing_fraction is None:
        short, over = unmarked, zero
    else:
        cols = self.expert_ids.shape[1]
        total = torch.maximum(rows, want).sum().clamp(min=1) * cols
        n_missing = self._missing_mask().sum() + absent.sum() * cols
        short, over = zero, (n_missing > max_missing_fraction * total).to(torch.int64)
    return torch.stack([bad_cu, bad_range, dup, bad_reason, bad_rows, too_many, short, over])


def _where(self: RoutingTrace, token: int, col: int | None = None) -> str:
    cu = self.cu_seqlens.tolist()
    seq = max(0, _bisect_right(cu, token) - 1)
    while seq + 1 < len(cu) and cu[seq + 1] <= token:
        seq += 1
    s = f"sequence {seq}, token {token - cu[seq]} (row {token})"
    if col is not None:
        s += ", " + self._layer_name(col)
    return s


def _layer_name(self: RoutingTrace, col: int) -> str:
    if col < self.num_moe_layers:
        return f"layer {int(self.layer_ids[col])}"
    return f"MTP layer {int(self.mtp_layer_ids[col - self.num_moe_layers])}"


def _raise(self: RoutingTrace, counts, *, expected_rows, max_missing_fraction) -> None:
    cu = self.cu_seqlens.cpu()
    if counts[0]:
        if int(cu[0]) != 0:
            raise TraceError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(cu[0])}")
        dec = (cu[1:] < cu[:-1]).nonzero()
        if dec.numel():
            i = int(dec[0, 0])
            raise TraceError(
                f"cu_seqlens: decreasing at sequence {i}: {int(cu[i])} > {int(cu[i + 1])}"
            )
        raise TraceError(f"cu_seqlens: last offset {int(cu[-1])} != total rows {self.num_tokens}")
    ids = self.expert_ids.cpu().to(torch.int64)
    present = ~self._missing_mask().cpu()
    if counts[1]:
        bad = ((ids < 0) | (ids >= self.num_experts)).any(-1) & present
        t, c = (int(x) for x in bad.nonzero()[0])
        raise TraceError(
            f"expert id out of range [0, {self.num_experts}) at {self._where(t, c)}: "
            f"{ids[t, c].tolist()} ({int(counts[1])} bad rows)"
        )
    if counts[2]:
        s = ids.sort(-1).values
        bad = (s[..., 1:] == s[..., :-1]).any(-1) & present
        t, c = (int(x) for x in bad.nonzero()[0])
        raise TraceError(
            f"duplicate expert within a row at {self._where(t, c)}: {ids[t, c].tolist()} "
            f"({int(counts[2])} bad rows)"
        )
    if counts[3]:
        assert self.missing is not None and self.missing_reason is not None  # counted
        reason = self.missing_reason.cpu()
        anym = self.missing.cpu().any(1)
        bad = ((reason != 0) != anym) | (reason >= len(MissingReason))
        t = int(bad.nonzero()[0, 0])
        raise TraceError(
            f"missing_reason: {int(reason[t])} at {self._where(t)} but the token has "
            f"{'a' if bool(anym[t]) else 'no'} missing row (reason must be a nonzero "
            "MissingReason exactly where a row is missing)"
        )
    if counts[4]:
        got = cu.diff()
        exp = expected_rows.cpu()
        i = int((got != exp).nonzero()[0, 0])
        raise TraceError(
            f"sequence {i}: {int(got[i])} rows, expected {int(exp[i])} (prompt + generated - 1)"
        )
    rows, want, absent, _ = (x.cpu() for x in self._row_counts())
    if counts[5]:
        i = int((rows > want).nonzero()[0, 0])
        raise TraceError(
            f"sequence {i}: {int(rows[i])} rows for {int(want[i]) + 1} tokens (token_lens; "
            "at most tokens - 1: the last token is never an input). Rows twice (a resumed "
            "or multi-turn sequence whose engine returned its whole history, stitched "
            "again) or routes not truncated with the response"
        )
    if counts[6]:
        if bool((absent > 0).any()):
            i = int((absent > 0).nonzero()[0, 0])
            raise TraceError(
                f"sequence {i}: {int(rows[i])} rows for {int(want[i]) + 1} tokens "
                f"(token_lens): {int(absent[i])} input tokens have no row and no reason "
                "(a short capture, or a later turn's omitted prefix: stitch the turns); "
                "pass max_missing_fraction= to accept them"
            )
        assert self.missing_reason is not None  # counted: missing is set
        reason = self.missing_reason.cpu()
        short = (reason == int(MissingReason.SHORT)).nonzero()
        t = int(short[0, 0]) if short.numel() else self._extra_no_row(reason)
        raise TraceError(
            f"{self._where(t)}: no row for an input token (reason "
            f"{MissingReason(int(reason[t])).name}; {int(counts[6])} tokens short in all; "
            "only a sequence's last token has none); pass max_missing_fraction= to accept them"
        )
    total = int(torch.maximum(rows, want).sum()) * self.expert_ids.shape[1]
    n_missing = self.num_missing + int(absent.sum()) * self.expert_ids.shape[1]
    raise TraceError(
        f"missing rows: {n_missing} of {total} (token, layer) rows are missing, "
        f"more than max_missing_fraction={max_missing_fraction} ({self.missing_counts()}"
        + (f", {int(absent.sum())} tokens short of token_lens" if int(absent.sum()) else "")
        + ")"
    )


def _extra_no_row(self: RoutingTrace, reason: torch.Tensor) -> int:
    """The first NO_ROW token of a sequence with more than one (host)."""
    cu = self._cu()
    for i in range(len(cu) - 1):
        hit = (reason[cu[i] : cu[i + 1]] == int(MissingReason.NO_ROW)).nonzero()
        if hit.numel() > 1:
            return cu[i] + int(hit[0, 0])
    raise AssertionError("no extra NO_ROW token")  # pragma: no cover
