"""RoutingTrace.stitch: a later turn's trace appended to an earlier one (multi-turn,
resume, prefix omission). A method of RoutingTrace (trace.py)."""

from __future__ import annotations

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


def stitch(
    self: RoutingTrace,
    other: RoutingTrace,
    *,
    start=None,
    expected_rows=None,
    max_missing_fraction=None,
) -> RoutingTrace:
    """Append a later turn's trace to this one (multi-turn, resume, prefix omission).

    Sequence i of ``other`` holds the rows of token positions
    ``start[i] .. start[i] + len_i - 1`` of the whole conversation. Its start,
    in this order: ``start[i]`` when given; else, when ``other`` knows its
    token counts (:attr:`has_token_lens`, e.g. from the capture),
    ``other.token_lens[i] - 1 - len_i`` (its rows end at its last input token:
    a turn that returned its whole history starts at 0 and its rows are
    compared, never appended twice); else this trace's end (the rows
    continue), after comparing rows: when the later turn's first rows equal
    this trace's first rows (an engine that returned the whole history
    again), which reading is right cannot be told and :class:`TraceError`
    asks for ``start`` or token counts instead of doubling the rows.

    Where both traces hold a present row for the same position they must be
    the same set (else :class:`TraceError`); a row present in either one is
    present in the result. Positions neither trace covers (a gap before the
    later turn's start, or this trace's own omitted prefix) are an error
    unless accepted by ``max_missing_fraction`` (at most that fraction of the
    result's (token, layer) rows missing, marked or not); they get missing
    rows with reason SHORT. ``expected_rows`` ([n] ints, prompt + generated
    - 1 of the whole conversation) checks the result's length per sequence.

    Both traces must have the same sequences count, experts, top_k and
    layer keys. Returns a new trace (a copy) whose ``token_lens`` are the
    later turn's (rows + 1 when neither trace knows its counts).
    """
    self._check_same_keys(other, "stitch")
    n = self.num_sequences
    if other.num_sequences != n:
        raise TraceError(
            f"stitch: {n} sequences in this trace, {other.num_sequences} in the later turn"
        )
    la, lb = self.seq_lens(), other.seq_lens()
    ta, tb = self.token_lens, other.token_lens
    if start is not None:
        st = _as_int64_vector("start", start, "cpu").tolist()
        if len(st) != n:
            raise TraceError(f"stitch: start has {len(st)} entries for {n} sequences")
    ca, cb = self._cu(), other._cu()
    ida, idb = self.expert_ids, other.expert_ids
    ma, mb = self._missing_mask(), other._missing_mask()
    ra, rb = self._reasons(), other._reasons()
    out_ids, out_m, out_r, lens = [], [], [], []
    n_short = 0
    for i in range(n):
        a0 = ta[i] - 1 - la[i]  # this trace's omitted prefix (positions before its rows)
        if a0 < 0 or tb[i] - 1 - lb[i] < 0:
            which, r_, t_ = (
                ("this trace", la[i], ta[i]) if a0 < 0 else ("the later turn", lb[i], tb[i])
            )
            raise TraceError(
                f"stitch: sequence {i}: {which} has {r_} rows for {t_} tokens (at most tokens - 1)"
            )
        end_a = a0 + la[i]
        a_rows = ida[ca[i] : ca[i + 1]]
        a_m = ma[ca[i] : ca[i + 1]]
        b_ids = idb[cb[i] : cb[i + 1]]
        b_m = mb[cb[i] : cb[i + 1]]
        b_r = rb[cb[i] : cb[i + 1]]
        if start is not None:
            s = st[i]
        elif other.has_token_lens:
            s = tb[i] - 1 - lb[i]
        else:
            s = end_a
            ov = min(la[i], lb[i])
            if a0 == 0 and ov > 0:
                both = ~a_m[:ov] & ~b_m[:ov]
                same = (a_rows[:ov].sort(-1).values == b_ids[:ov].sort(-1).values).all(-1)
                if bool(both.any()) and bool((same | ~both).all()):
                    raise TraceError(
                        f"stitch: sequence {i}: the later turn's first {ov} rows equal this "
                        "trace's first rows: it may hold the whole history again (a resumed "
                        "or multi-turn engine) or continue it by chance. Pass start= (0 "
                        f"for the whole history, {end_a} to continue) or give the traces "
                        "token_lens (the capture's prompt + generated)"
                    )
        if s < 0:
            raise TraceError(f"stitch: sequence {i}: start {s} < 0")
        total = max(end_a, s + lb[i])
        if other.has_token_lens and total > tb[i] - 1:
            raise TraceError(
                f"stitch: sequence {i}: this trace has {end_a} rows (positions), more than "
                f"the later turn's {tb[i]} tokens - 1: the later turn is shorter than the "
                "conversation so far (wrong order, or routes not truncated with the response)"
            )
        ids = torch.zeros((total,) + ida.shape[1:], dtype=ida.dtype, device=self.device)
        m = torch.ones((total, ida.shape[1]), dtype=torch.bool, device=self.device)
        r = torch.full((total,), int(MissingReason.SHORT), dtype=torch.uint8, device=self.device)
        ids[a0:end_a] = a_rows
        m[a0:end_a] = a_m
        r[a0:end_a] = ra[ca[i] : ca[i + 1]]
        ov = min(end_a, s + lb[i]) - max(s, a0)  # positions both traces cover
        if ov > 0:
            lo = max(s, a0)
            both = ~m[lo : lo + ov] & ~b_m[lo - s : lo - s + ov]
            diff = (
                ids[lo : lo + ov].sort(-1).values != b_ids[lo - s : lo - s + ov].sort(-1).values
            ).any(-1) & both
            if bool(diff.any()):
                t, c = (int(x) for x in diff.nonzero()[0])
                raise TraceError(
                    f"stitch: sequence {i}, token {lo + t}, {self._layer_name(c)}: the turns "
                    f"disagree ({ids[lo + t, c].tolist()} vs {b_ids[lo - s + t, c].tolist()})"
                )
        seg = slice(s, s + lb[i])
        take = ~b_m  # later turn's present rows win (identical where both present)
        cur = ids[seg]
        cur[take] = b_ids[take]
        m[seg] = m[seg] & b_m
        # Reason of a still-missing token: the later turn's where it has one, else ours.
        rr = torch.where(b_r != 0, b_r, r[seg])
        rr = torch.where(rr != 0, rr, int(MissingReason.NOT_CAPTURED))
        r[seg] = torch.where(m[seg].any(1), rr, 0).to(torch.uint8)
        covered = torch.zeros(total, dtype=torch.bool)
        covered[a0:end_a] = True
        covered[seg] = True
        gap = total - int(covered.sum())
        if gap and max_missing_fraction is None:
            first = int((~covered).nonzero()[0, 0])
            raise TraceError(
                f"stitch: sequence {i}: {gap} positions from token {first} are in neither "
                f"trace (this one ends at {end_a}, the later turn starts at {s}): no row and "
                "no reason; pass max_missing_fraction= to accept them (reason SHORT)"
            )
        n_short += gap
        out_ids.append(ids)
        out_m.append(m)
        out_r.append(r)
        lens.append(total)
    if expected_rows is not None:
        exp = _as_int64_vector("expected_rows", expected_rows, "cpu").tolist()
        if len(exp) != n:
            raise TraceError(f"stitch: expected_rows has {len(exp)} entries for {n} sequences")
        for i in range(n):
            if lens[i] != exp[i]:
                raise TraceError(
                    f"stitch: sequence {i}: {lens[i]} rows after stitching, expected "
                    f"{exp[i]} (prompt + generated - 1 of the whole conversation)"
                )
    missing: torch.Tensor | None
    reason: torch.Tensor | None
    missing = torch.cat(out_m)
    reason = torch.cat(out_r)
    if max_missing_fraction is not None:
        total_pairs = max(1, missing.numel())
        n_missing = int(missing.sum())
        if n_missing > max_missing_fraction * total_pairs:
            raise TraceError(
                f"stitch: {n_missing} of {total_pairs} (token, layer) rows missing after "
                f"stitching ({n_short} tokens in neither trace), more than "
                f"max_missing_fraction={max_missing_fraction}"
            )
    if not bool(missing.any()):
        missing = reason = None
    tl = [x + 1 for x in lens] if (self.has_token_lens or other.has_token_lens) else None
    return self._with(
        torch.cat(out_ids), _cu_from_lens(lens, self.device), missing, reason, token_lens=tl
    )
