"""RoutingTrace: the routing of one batch of sequences, recorded at inference,
replayed at training. Contract: docs/design.md, "Router capture and replay"."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from compass_kernels.routing import _trace_slice, _trace_stitch, _trace_validate

# The vocabulary lives in _trace_common; every name stays importable from here
# (``compass_kernels.routing.trace.X``), MAX_EXPERTS and _bisect_right as explicit re-exports.
from compass_kernels.routing._trace_common import MAX_EXPERTS as MAX_EXPERTS
from compass_kernels.routing._trace_common import (
    MissingReason,
    TraceError,
    _as_int64_vector,
    _cu_from_lens,
    _desc,
    _dn,
    ids_dtype,
)
from compass_kernels.routing._trace_common import _bisect_right as _bisect_right

__all__ = ["MissingReason", "RoutingTrace", "TraceError", "ids_dtype"]


class RoutingTrace:
    """Per-token routing of a batch of sequences, jagged (packed) like varlen attention.

    Parameters
    ----------
    expert_ids : [total_tokens, num_layers_stored, top_k], uint8 when
        num_experts <= 256 else int16 (see :func:`ids_dtype`; any other dtype is
        an error, never a silent wrap). LOGICAL expert ids (before any EPLB
        remap to physical slots). Row t of sequence i is the routing used when
        token t of sequence i was the model's input: a finished sequence of
        prompt + generated = N tokens has N - 1 rows (its last token was never
        an input). Order within a row is free (a set); rows marked missing are
        never read and may hold anything.
        ``num_layers_stored = len(layer_ids) + len(mtp_layer_ids)``: columns
        [0, len(layer_ids)) are the decoder's MoE layers, the remaining columns
        the MTP layers.
    cu_seqlens : [n + 1] int64 row offsets of the n sequences (0, non-decreasing,
        last == total_tokens), on the same device as expert_ids.
    num_experts : routed experts per MoE layer (E).
    layer_ids : [num_moe_layers] int64, strictly increasing: the model's GLOBAL
        (0-based) decoder layer number of each MoE column. Dense layers have no
        column (DeepSeek-V3: layer_ids = 3..60). Default: 0..num_moe_layers-1,
        i.e. every layer is MoE. Kept on the CPU.
    missing : None (no row missing), or bool [total_tokens] (whole token) or
        [total_tokens, num_layers_stored] (per token and layer): True where the
        row holds no routing. Explicit: a missing row is never zeros or stale.
    missing_reason : None or uint8 [total_tokens] of :class:`MissingReason`
        values, nonzero exactly at tokens with a missing column. Default when
        ``missing`` is given: NOT_CAPTURED at those tokens.
    mtp_layer_ids : [num_mtp_layers] int64 MTP depth indices (0, 1, ...), keyed
        apart from decoder layer numbers: MTP routers are never replayed from
        decoder rows nor the reverse, and :meth:`slice` drops them unless asked.
    token_lens : None or [n] ints (host), each sequence's token count (prompt +
        generated of the whole conversation so far), from the capture or the
        caller. The rows of sequence i are the routing of token positions
        ``token_lens[i] - 1 - rows_i .. token_lens[i] - 2``: they end at the
        last input token. ``rows_i == token_lens[i] - 1`` is a complete
        sequence; fewer rows are an omitted prefix (a later turn to
        :meth:`stitch`) or a short capture; more rows are never valid.
        Default: ``rows + 1`` (the trace is complete; :attr:`has_token_lens`
        is False and :meth:`stitch` compares rows to find a later turn's start).

    Row-count contract (checked by default by :meth:`validate`, :meth:`slice`,
    :meth:`stitch` and the Megatron ``TraceReplay``): every input token of a
    sequence has a row, or a row marked missing with the reason the engine gave.
    A token the trace has no row for (short by ``token_lens - 1 - rows``) is an
    error unless the caller accepts it by name, ``max_missing_fraction=``; then
    it gets a missing row with reason ``SHORT``. A row count above
    ``token_lens - 1`` (duplicated turns, routes not truncated with the response)
    is always an error.

    Attributes
    ----------
    expert_ids, cu_seqlens, num_experts, layer_ids, mtp_layer_ids, missing
    ([total_tokens, num_layers_stored] bool, or None), missing_reason ([total_tokens]
    uint8, or None), top_k, num_sequences, num_tokens (= total rows),
    num_moe_layers, num_mtp_layers, token_lens (host list), has_token_lens.

    Construction checks shapes, dtypes and devices only (no host sync); call
    :meth:`validate` for the data checks (on by default in the replay patch).
    """

    def __init__(
        self,
        expert_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        num_experts: int,
        *,
        layer_ids=None,
        missing: torch.Tensor | None = None,
        missing_reason: torch.Tensor | None = None,
        mtp_layer_ids=None,
        token_lens=None,
    ) -> None:
        """Wrap ``expert_ids`` [total_tokens, num_layers_stored, top_k] (uint8, or int16
        above 256 experts) and ``cu_seqlens`` [n + 1] int64 as a trace of n sequences;
        the arguments are those of the class. Checks shapes, dtypes and devices (raises
        ValueError naming the argument); no host sync, no copy of ``expert_ids``."""
        want = ids_dtype(num_experts)
        if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 3:
            raise ValueError(
                "expert_ids: expected a 3-d tensor [total_tokens, num_moe_layers, top_k], got "
                + _desc(expert_ids)
            )
        if expert_ids.dtype != want:
            raise ValueError(
                f"expert_ids: expected dtype {_dn(want)} for num_experts={num_experts} "
                f"(uint8 up to 256 experts, int16 above), got {_desc(expert_ids)}"
            )
        n_rows, n_cols, k = expert_ids.shape
        if not 1 <= k <= num_experts:
            raise ValueError(f"expert_ids: top_k = {k} must be in [1, num_experts={num_experts}]")
        dev = expert_ids.device
        if (
            not isinstance(cu_seqlens, torch.Tensor)
            or cu_seqlens.dim() != 1
            or cu_seqlens.dtype != torch.int64
            or cu_seqlens.numel() < 1
        ):
            raise ValueError(f"cu_seqlens: expected an int64 [n+1] tensor, got {_desc(cu_seqlens)}")
        if cu_seqlens.device != dev:
            raise ValueError(f"cu_seqlens: expected a tensor on {dev}, got {_desc(cu_seqlens)}")
        mtp = _as_int64_vector("mtp_layer_ids", [] if mtp_layer_ids is None else mtp_layer_ids)
        n_moe = n_cols - mtp.numel()
        if n_moe < 0:
            raise ValueError(
                f"mtp_layer_ids: {mtp.numel()} MTP layers but expert_ids has only {n_cols} columns"
            )
        lids = _as_int64_vector(
            "layer_ids", range(n_moe) if layer_ids is None else layer_ids, "cpu"
        )
        if lids.numel() != n_moe:
            raise ValueError(
                f"layer_ids: expected {n_moe} entries (expert_ids columns {n_cols} - "
                f"{mtp.numel()} MTP layers), got {lids.numel()}"
            )
        if n_moe and (bool((lids[1:] <= lids[:-1]).any()) or int(lids[0]) < 0):
            raise ValueError(
                f"layer_ids: expected strictly increasing ids >= 0, got {lids.tolist()}"
            )
        if mtp.numel() and (bool((mtp[1:] <= mtp[:-1]).any()) or int(mtp[0]) < 0):
            raise ValueError(
                f"mtp_layer_ids: expected strictly increasing ids >= 0, got {mtp.tolist()}"
            )
        if missing is not None:
            if not isinstance(missing, torch.Tensor) or missing.dtype != torch.bool:
                raise ValueError(f"missing: expected a bool tensor, got {_desc(missing)}")
            if missing.device != dev:
                raise ValueError(f"missing: expected a tensor on {dev}, got {_desc(missing)}")
            if tuple(missing.shape) == (n_rows,):
                missing = missing[:, None].expand(n_rows, n_cols).contiguous()
            elif tuple(missing.shape) != (n_rows, n_cols):
                raise ValueError(
                    f"missing: expected shape [{n_rows}] or [{n_rows}, {n_cols}] "
                    f"(total_tokens[, layers]), got {_desc(missing)}"
                )
            if missing_reason is None:
                missing_reason = missing.any(1).to(torch.uint8) * int(MissingReason.NOT_CAPTURED)
        if missing_reason is not None:
            if missing is None:
                raise ValueError("missing_reason: given without missing (the mask is explicit)")
            if (
                not isinstance(missing_reason, torch.Tensor)
                or missing_reason.dtype != torch.uint8
                or tuple(missing_reason.shape) != (n_rows,)
            ):
                raise ValueError(
                    f"missing_reason: expected uint8 [{n_rows}] (one MissingReason per token), "
                    f"got {_desc(missing_reason)}"
                )
            if missing_reason.device != dev:
                raise ValueError(
                    f"missing_reason: expected a tensor on {dev}, got {_desc(missing_reason)}"
                )
        self.expert_ids = expert_ids
        self.cu_seqlens = cu_seqlens
        self.num_experts = num_experts
        self.layer_ids = lids
        self.mtp_layer_ids = mtp
        self.missing = missing
        self.missing_reason = missing_reason
        self._cu_host: list[int] | None = None
        self._token_lens: torch.Tensor | None = None
        if token_lens is not None:
            tl = _as_int64_vector("token_lens", token_lens, "cpu")
            if tl.numel() != cu_seqlens.numel() - 1:
                raise ValueError(
                    f"token_lens: expected {cu_seqlens.numel() - 1} entries (one per "
                    f"sequence), got {tl.numel()}"
                )
            if tl.numel() and int(tl.min()) < 1:
                raise ValueError(f"token_lens: expected counts >= 1, got {tl.tolist()}")
            self._token_lens = tl

    # ------------------------------------------------------------ basics
    @property
    def top_k(self) -> int:
        """K, experts per token (expert_ids.shape[2])."""
        return self.expert_ids.shape[2]

    @property
    def num_tokens(self) -> int:
        """Total rows over all sequences (expert_ids.shape[0])."""
        return self.expert_ids.shape[0]

    @property
    def num_sequences(self) -> int:
        """n, the number of sequences (len(cu_seqlens) - 1)."""
        return self.cu_seqlens.numel() - 1

    @property
    def num_moe_layers(self) -> int:
        """Decoder MoE columns (len(layer_ids))."""
        return self.layer_ids.numel()

    @property
    def num_mtp_layers(self) -> int:
        """MTP columns (len(mtp_layer_ids))."""
        return self.mtp_layer_ids.numel()

    @property
    def device(self) -> torch.device:
        """The device of expert_ids, cu_seqlens and missing."""
        return self.expert_ids.device

    @property
    def num_missing(self) -> int:
        """Missing (token, layer) rows, decoder and MTP columns together (a host sync on GPU)."""
        return 0 if self.missing is None else int(self.missing.sum())

    def missing_counts(self) -> dict[str, int]:
        """{reason name: tokens} for tokens with a missing row (a host sync on GPU)."""
        if self.missing_reason is None:
            return {}
        counts = torch.bincount(self.missing_reason.to(torch.int64), minlength=len(MissingReason))
        return {
            MissingReason(i).name: int(c)
            for i, c in enumerate(counts.tolist())
            if i and c and i < len(MissingReason)
        }

    def seq_lens(self) -> list[int]:
        """Rows per sequence (host list, cached)."""
        cu = self._cu()
        return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]

    @property
    def has_token_lens(self) -> bool:
        """True when the token counts were given (capture, caller, decode), not defaulted."""
        return self._token_lens is not None

    @property
    def token_lens(self) -> list[int]:
        """Tokens per sequence (host list): as given, else rows + 1 (complete)."""
        if self._token_lens is not None:
            return self._token_lens.tolist()
        return [r + 1 for r in self.seq_lens()]

    def _cu(self) -> list[int]:
        if self._cu_host is None:
            self._cu_host = self.cu_seqlens.tolist()
        return self._cu_host

    def to(self, device) -> RoutingTrace:
        """A copy with every tensor (expert_ids, cu_seqlens, missing, missing_reason) on
        ``device``; layer keys stay on the CPU."""

        def mv(t):
            return None if t is None else t.to(device)

        return RoutingTrace(
            self.expert_ids.to(device),
            self.cu_seqlens.to(device),
            self.num_experts,
            layer_ids=self.layer_ids,
            missing=mv(self.missing),
            missing_reason=mv(self.missing_reason),
            mtp_layer_ids=self.mtp_layer_ids,
            token_lens=self._token_lens,
        )

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(sequences={self.num_sequences}, tokens={self.num_tokens}, "
            f"moe_layers={self.layer_ids.tolist()}, mtp_layers={self.mtp_layer_ids.tolist()}, "
            f"top_k={self.top_k}, num_experts={self.num_experts}, device={self.device})"
        )

    def __eq__(self, other) -> bool:
        """Same shape, keys and present rows (as sets are compared elementwise:
        same order); missing rows compare by mask and reason only."""
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        if (
            self.num_experts != other.num_experts
            or self.expert_ids.shape != other.expert_ids.shape
            or not torch.equal(self.layer_ids, other.layer_ids)
            or not torch.equal(self.mtp_layer_ids, other.mtp_layer_ids)
            or not torch.equal(self.cu_seqlens.cpu(), other.cu_seqlens.cpu())
            or self.token_lens != other.token_lens
        ):
            return False
        ma, mb = self._missing_mask(), other._missing_mask()
        if not torch.equal(ma.cpu(), mb.cpu()):
            return False
        ra, rb = self._reasons(), other._reasons()
        if not torch.equal(ra.cpu(), rb.cpu()):
            return False
        same = self.expert_ids.cpu() == other.expert_ids.cpu()
        return bool((same.all(-1) | ma.cpu()).all())

    __hash__ = None  # type: ignore[assignment]

    def _missing_mask(self) -> torch.Tensor:
        if self.missing is not None:
            return self.missing
        return torch.zeros(self.expert_ids.shape[:2], dtype=torch.bool, device=self.device)

    def _reasons(self) -> torch.Tensor:
        if self.missing_reason is not None:
            return self.missing_reason
        return torch.zeros(self.num_tokens, dtype=torch.uint8, device=self.device)

    def canonical(self, *, sort: bool = True) -> RoutingTrace:
        """A copy whose missing rows hold 0..top_k-1 and, with ``sort`` (default), every
        row ascending: ``decode(encode(t)) == t.canonical()`` for the default "set" codec,
        ``t.canonical(sort=False)`` for ``codec="raw"``. expert_ids keep their dtype."""
        if self.missing is not None:  # a select, no boolean indexing (no device sync)
            fill = torch.arange(self.top_k, device=self.device).to(self.expert_ids.dtype)
            ids = torch.where(self.missing[..., None], fill.view(1, 1, -1), self.expert_ids)
        else:
            ids = self.expert_ids.clone()
        if sort:
            ids = ids.sort(dim=-1).values
        return self._with(
            ids, self.cu_seqlens, self.missing, self.missing_reason, token_lens=self._token_lens
        )

    def _with(
        self, ids, cu, missing, reason, layer_ids=None, mtp=None, token_lens=None
    ) -> RoutingTrace:
        return RoutingTrace(
            ids,
            cu,
            self.num_experts,
            layer_ids=self.layer_ids if layer_ids is None else layer_ids,
            missing=missing,
            missing_reason=reason,
            mtp_layer_ids=self.mtp_layer_ids if mtp is None else mtp,
            token_lens=token_lens,
        )

    def column(self, layer_id: int, *, mtp: bool = False) -> int:
        """The column of global decoder layer ``layer_id`` (or MTP depth with
        ``mtp=True``). Raises naming the layer when the trace has no column for
        it (a dense layer, another pipeline stage, or the wrong key space)."""
        keys = self.mtp_layer_ids if mtp else self.layer_ids
        hit = (keys == int(layer_id)).nonzero()
        if hit.numel() == 0:
            what = "MTP layer" if mtp else "layer"
            raise TraceError(
                f"{what} {layer_id}: the trace has no column for it (its "
                f"{'MTP ' if mtp else 'MoE '}layers are {keys.tolist()}; dense layers and "
                "other pipeline stages have none)"
            )
        col = int(hit[0, 0])
        return col + self.num_moe_layers if mtp else col

    def layer(self, layer_id: int, *, mtp: bool = False):
        """(expert_ids [T, K], valid [T] bool or None) of one layer, as
        :func:`replay_topk` takes them: looked up by the global layer number,
        never by position (no dense-layer offset to get wrong). Views, no copy."""
        c = self.column(layer_id, mtp=mtp)
        valid = None if self.missing is None else ~self.missing[:, c]
        return self.expert_ids[:, c], valid

    # ------------------------------------------------------------ validation
    validate = _trace_validate.validate

    _CHECKS = (
        "cu_seqlens",
        "range",
        "duplicate",
        "reason",
        "expected_rows",
        "too_many_rows",
        "short",
        "missing_fraction",
    )

    _row_counts = _trace_validate._row_counts
    _flags = _trace_validate._flags
    _where = _trace_validate._where
    _layer_name = _trace_validate._layer_name
    _raise = _trace_validate._raise
    _extra_no_row = _trace_validate._extra_no_row

    # ------------------------------------------------------------ pieces
    def sequence(self, i: int) -> RoutingTrace:
        """The trace of sequence ``i`` alone (a view, no copy)."""
        n = self.num_sequences
        if not (isinstance(i, int) and -n <= i < n):
            raise IndexError(f"sequence: index {i} out of range for {n} sequences")
        i %= n
        cu = self._cu()
        a, b = cu[i], cu[i + 1]
        return self._with(
            self.expert_ids[a:b],
            torch.tensor([0, b - a], dtype=torch.int64, device=self.device),
            None if self.missing is None else self.missing[a:b],
            None if self.missing_reason is None else self.missing_reason[a:b],
            token_lens=None if self._token_lens is None else self._token_lens[i : i + 1],
        )

    def sequences(self, index: Sequence[int]) -> RoutingTrace:
        """The sequences ``index`` (in that order) as one trace (a copy)."""
        cu = self._cu()
        n = self.num_sequences
        rows, lens, picked = [], [], []
        for i in index:
            if not -n <= i < n:
                raise IndexError(f"sequences: index {i} out of range for {n} sequences")
            i %= n
            rows.append(torch.arange(cu[i], cu[i + 1], dtype=torch.int64))
            lens.append(cu[i + 1] - cu[i])
            picked.append(i)
        src = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        tl = None if self._token_lens is None else self._token_lens[picked]
        return self._gather(
            src, torch.zeros_like(src, dtype=torch.uint8), lens, None, token_lens=tl
        )

    @staticmethod
    def concat(traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """Sequences of several traces (same keys) as one trace, in order."""
        if not traces:
            raise ValueError("concat: expected at least one trace")
        first = traces[0]
        for t in traces[1:]:
            first._check_same_keys(t, "concat")
        ids = torch.cat([t.expert_ids for t in traces])
        lens = [n for t in traces for n in t.seq_lens()]
        cu = _cu_from_lens(lens, first.device)
        missing: torch.Tensor | None
        reason: torch.Tensor | None
        if any(t.missing is not None for t in traces):
            missing = torch.cat([t._missing_mask() for t in traces])
            reason = torch.cat([t._reasons() for t in traces])
        else:
            missing = reason = None
        tl = None
        if any(t.has_token_lens for t in traces):
            tl = [x for t in traces for x in t.token_lens]
        return first._with(ids, cu, missing, reason, token_lens=tl)

    def _check_same_keys(self, other: RoutingTrace, what: str) -> None:
        if not isinstance(other, RoutingTrace):
            raise TypeError(f"{what}: expected a RoutingTrace, got {type(other).__name__}")
        if other.num_experts != self.num_experts or other.top_k != self.top_k:
            raise TraceError(
                f"{what}: num_experts/top_k differ: {self.num_experts}/{self.top_k} vs "
                f"{other.num_experts}/{other.top_k}"
            )
        if not torch.equal(other.layer_ids, self.layer_ids) or not torch.equal(
            other.mtp_layer_ids, self.mtp_layer_ids
        ):
            raise TraceError(
                f"{what}: layer keys differ: {self.layer_ids.tolist()} (MTP "
                f"{self.mtp_layer_ids.tolist()}) vs {other.layer_ids.tolist()} (MTP "
                f"{other.mtp_layer_ids.tolist()})"
            )
        if other.device != self.device:
            raise TraceError(f"{what}: traces on {self.device} and {other.device}")

    # ------------------------------------------------------------ multi-turn
    stitch = _trace_stitch.stitch

    # ------------------------------------------------------------ re-layout
    slice_plan = _trace_slice.slice_plan
    _check_short = _trace_slice._check_short
    slice = _trace_slice.slice
    _gather = _trace_slice._gather

    # ------------------------------------------------------------ codec
    def encode(self, *, codec: str = "set", backend: str | None = None) -> bytes:
        """Serialize losslessly: a versioned header (shape, experts, layer keys,
        CRC32), then the payload. ``codec="set"`` (default) stores each row's
        set in ceil(log2 C(E, K)) bits or less (E=256, K=8: 49 bits vs 64 for
        uint8); ``"raw"`` the ids as stored. Rows are sets: "set" keeps no
        order within a row (decode returns rows ascending). Format:
        compass_kernels/routing/codec.py. On a GPU, "set" runs the CUDA encoder
        (checks on the device) and copies only the compact payload to the host
        (one sync); ``backend`` forces the encoder ("cpp", "cuda"). NaN / Inf
        policy: a trace holds integers only (ids, counts): nothing to check;
        every id is range- and duplicate-checked on every codec."""
        from compass_kernels.routing import codec as _codec

        return _codec.encode(self, codec=codec, backend=backend)

    @staticmethod
    def decode(data: bytes, *, device=None) -> RoutingTrace:
        """Inverse of :meth:`encode`: ``decode(encode(t, codec=c)) ==
        t.canonical(sort=c == "set")`` bit for bit (missing rows hold
        0..top_k-1). Raises :class:`TraceError` on a bad header, version,
        checksum or payload."""
        from compass_kernels.routing import codec as _codec

        return _codec.decode(data, device=device)
