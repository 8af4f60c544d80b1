"""RoutingTrace: the routing of one batch of sequences, recorded at inference,
replayed at training. Contract: docs/design.md, "Router capture and replay"."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import torch

__all__ = ["MissingReason", "RoutingTrace", "TraceError", "ids_dtype"]

MAX_EXPERTS = 32768  # int16 holds ids up to 32767


class TraceError(ValueError):
    """A trace that breaks the contract; the message names sequence, layer and token."""


class MissingReason(enum.IntEnum):
    """Why a row (token) holds no routing. Stored per token as uint8 (0 = present)."""

    PRESENT = 0
    PREFIX_CACHE = 1  # prefix-cache hit: KV reused, the router never ran for it
    PREEMPTED = 2  # request preempted; rows lost (vLLM drops them) or recomputed unrecorded
    KV_TRANSFER = 3  # KV received from elsewhere (P/D disaggregation, KV offload)
    ASYNC_PLACEHOLDER = 4  # async-scheduling placeholder token (e.g. EOS placeholder)
    NOT_CAPTURED = 5  # no engine recorded this row (a gap between stitched turns, other)
    PADDING = 6  # a padding token added by RoutingTrace.slice (pad_policy="missing")
    NO_ROW = 7  # the token was never an engine input (a sequence's last token), see slice
    SHORT = 8  # an input token the trace has no row for (a short capture, an omitted
    #            prefix, a gap between stitched turns): only where a caller accepted it
    #            by name (max_missing_fraction=), see slice and stitch


def ids_dtype(num_experts: int) -> torch.dtype:
    """The trace dtype for ``num_experts``: uint8 up to 256 experts, int16 up to 32768."""
    if not (isinstance(num_experts, int) and 1 <= num_experts <= MAX_EXPERTS):
        raise ValueError(f"num_experts: expected an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    return torch.uint8 if num_experts <= 256 else torch.int16


def _as_int64_vector(name: str, v, device=None) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-d integer tensor, got {v.dtype}{list(v.shape)}")
        t = v.to(torch.int64)
    else:
        t = torch.as_tensor(list(v), dtype=torch.int64)
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a sequence of ints")
    return t if device is None else t.to(device)


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
    def validate(
        self,
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

    def _row_counts(self):
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

    def _flags(self, expected_rows=None, max_missing_fraction=None) -> torch.Tensor:
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

    def _where(self, token: int, col: int | None = None) -> str:
        cu = self.cu_seqlens.tolist()
        seq = max(0, _bisect_right(cu, token) - 1)
        while seq + 1 < len(cu) and cu[seq + 1] <= token:
            seq += 1
        s = f"sequence {seq}, token {token - cu[seq]} (row {token})"
        if col is not None:
            s += ", " + self._layer_name(col)
        return s

    def _layer_name(self, col: int) -> str:
        if col < self.num_moe_layers:
            return f"layer {int(self.layer_ids[col])}"
        return f"MTP layer {int(self.mtp_layer_ids[col - self.num_moe_layers])}"

    def _raise(self, counts, *, expected_rows, max_missing_fraction) -> None:
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
            raise TraceError(
                f"cu_seqlens: last offset {int(cu[-1])} != total rows {self.num_tokens}"
            )
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

    def _extra_no_row(self, reason: torch.Tensor) -> int:
        """The first NO_ROW token of a sequence with more than one (host)."""
        cu = self._cu()
        for i in range(len(cu) - 1):
            hit = (reason[cu[i] : cu[i + 1]] == int(MissingReason.NO_ROW)).nonzero()
            if hit.numel() > 1:
                return cu[i] + int(hit[0, 0])
        raise AssertionError("no extra NO_ROW token")  # pragma: no cover

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

    def stitch(
        self, other: RoutingTrace, *, start=None, expected_rows=None, max_missing_fraction=None
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
                    f"stitch: sequence {i}: {which} has {r_} rows for {t_} tokens (at most "
                    "tokens - 1)"
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
            r = torch.full(
                (total,), int(MissingReason.SHORT), dtype=torch.uint8, device=self.device
            )
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

    # ------------------------------------------------------------ re-layout
    def slice_plan(
        self,
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
            raise ValueError(
                f"cp_layout: expected 'zigzag', 'contiguous' or None, got {cp_layout!r}"
            )
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

    def _check_short(self, seqs, rows, tl, short, max_missing_fraction) -> None:
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
        self,
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
        self, src, kind, seg_lens, cols, *, pad_policy="missing", keys=None, token_lens=None
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


def _cu_from_lens(lens: Sequence[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    if lens:
        torch.cumsum(torch.as_tensor(list(lens), dtype=torch.int64), 0, out=cu[1:])
    return cu.to(device)


def _bisect_right(a: list[int], x: int) -> int:
    import bisect

    return bisect.bisect_right(a, x)


def _dn(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{_dn(t.dtype)}{list(t.shape)} on {t.device}"
    return type(t).__name__
