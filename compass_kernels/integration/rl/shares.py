"""What each trainer rank receives of a step: its micro-batches, in ``ck.packing``'s
THD layout for its context-parallel rank.

The driver plans the step over ``dp`` ranks (:func:`plan_or_pad`), then
:func:`make_shares` gives every rank the micro-batches of its DP rank, each
packed by ``ck.packing.pack`` (sequences padded to ``Layout.pad_multiple``, cut
in 2 cp chunks, CP rank r keeping chunks r and 2cp-1-r: the one zigzag of the
codebase) with only what the rank reads: the first stage the token ids, the
last stage the loss inputs, every rank the routing rows of its stage's layers
for its context- and sequence-parallel tokens. :func:`local_layout` is that
layout seen from a rank (which token of the micro-batch each local row holds,
its sequence and position, Megatron's ``PackedSeqParams``); the rank and the
driver both derive it from the lengths. :func:`share_bytes` counts the shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compass_kernels.integration.megatron.parallel import Layout, RankInfo

__all__ = [
    "LocalLayout",
    "RankMicroBatch",
    "StepData",
    "full_broadcast_bytes",
    "global_rows",
    "local_layout",
    "local_tokens",
    "make_shares",
    "per_micro_batch",
    "plan_or_pad",
    "share_bytes",
]


@dataclass
class LocalLayout:
    """One CP rank's tokens of a micro-batch, as ``ck.packing.pack`` lays them out.

    packed : the ``ck.packing.PackedBatch`` (its ``packed_seq_params()`` is what the
        model's THD attention and RoPE read).
    src : [T_local] int64 the token's index in the micro-batch's concatenated real
        tokens (-1 for padding).
    seq : [T_local] int64 its sequence (0-based within the micro-batch).
    pos : [T_local] int64 its position in that sequence.
    cu : [n + 1] int64 the sequences' segments in the local rows (ESPO's cu_seqlens).
    """

    packed: Any
    src: torch.Tensor
    seq: torch.Tensor
    pos: torch.Tensor
    cu: torch.Tensor

    @property
    def real(self) -> torch.Tensor:
        """[T_local] bool: the row holds a real token (not padding)."""
        return self.src >= 0


def local_layout(lengths: np.ndarray, pad_multiple: int, cp: int, cp_rank: int) -> LocalLayout:
    """The THD layout (``ck.packing.pack``) of CP rank ``cp_rank``'s tokens of a
    micro-batch whose sequences have ``lengths`` tokens, each padded to a multiple of
    ``pad_multiple``. A sequence of length 0 (a padding micro-batch) is one padded
    segment of ``pad_multiple`` tokens, all padding."""
    import compass_kernels as ck

    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    slots = np.maximum(lengths, 1)  # pack refuses empty sequences: one slot, marked padding
    seq = np.repeat(np.arange(n), slots)
    within = np.arange(int(slots.sum())) - np.repeat(np.cumsum(slots) - slots, slots)
    start = np.cumsum(lengths) - lengths
    src = np.where(within < lengths[seq], start[seq] + within, -1)
    pb = ck.packing.pack(
        {"src": torch.from_numpy(src)},
        slots,
        np.arange(n),
        pad_multiple=pad_multiple,
        cp_size=cp,
        cp_rank=cp_rank,
        pad_values={"src": -1},
    )
    per_rank = torch.from_numpy(pb.padded // cp)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(per_rank, 0)
    return LocalLayout(
        pb,
        pb.tensors["src"],
        torch.repeat_interleave(torch.arange(n), per_rank),
        pb.position_ids,
        cu,
    )


def local_tokens(lengths: np.ndarray, m: int, cp: int, cp_rank: int):
    """(src, seq, pos) of :func:`local_layout` ([T_local] int64 each)."""
    lay = local_layout(lengths, m, cp, cp_rank)
    return lay.src, lay.seq, lay.pos


@dataclass
class RankMicroBatch:
    """One micro-batch as one rank receives it (fields it does not read are None);
    per-token tensors in the rank's THD layout (:func:`local_layout`), 0 at padding.

    lengths : [n] int64 real tokens per sequence (every rank: its layout and mask).
    tokens : [T_local] int64 token ids (first pipeline stage).
    targets, mask : [T_local] next-token ids and loss mask (last stage).
    old_logprobs, old_entropy, advantages : [T_local] float32 (last stage, training;
        None when the rank uses those it kept: the old log-probs / entropy of its
        forward, the advantages of its ``token_advantages``).
    infer_logprobs : [T_local] float32 engine log-probs (last stage, a forward whose
        results stay on the ranks: the rank returns gap sums, not log-probs).
    trace : the routing rows of this stage's MoE layers for this rank's tokens
        (CP zigzag, then the sequence-parallel piece), or None for native routing.
    """

    lengths: torch.Tensor
    tokens: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    old_entropy: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    infer_logprobs: torch.Tensor | None = None
    trace: Any = None

    def nbytes(self) -> int:
        n = 0
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                n += v.numel() * v.element_size()
            elif v is not None:  # a RoutingTrace
                n += sum(t.numel() * t.element_size() for t in _trace_tensors(v))
        return n

    def layout(self, layout: Layout, cp_rank: int) -> LocalLayout:
        """:func:`local_layout` of this micro-batch on CP rank ``cp_rank`` (made once,
        on the rank: the driver does not send it)."""
        got = self.__dict__.get("_layout")
        if got is None or got[0] != (layout.pad_multiple, layout.cp, cp_rank):
            lay = local_layout(self.lengths.numpy(), layout.pad_multiple, layout.cp, cp_rank)
            got = ((layout.pad_multiple, layout.cp, cp_rank), lay)
            self.__dict__["_layout"] = got
        return got[1]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_layout"}


def _trace_tensors(trace: Any) -> list[torch.Tensor]:
    out = [trace.expert_ids, trace.cu_seqlens]
    for name in ("missing", "missing_reason"):
        t = getattr(trace, name, None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out


@dataclass
class StepData:
    """The driver's per-token tensors of a step, sample order over all T tokens."""

    batch: Any  # batch.Batch
    plan: Any  # ck.packing.PackingPlan
    old_logprobs: torch.Tensor | None = None
    old_entropy: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


def global_rows(batch: Any, idx: np.ndarray, layout: Layout, cp_rank: int) -> torch.Tensor:
    """[T_local] int64: the batch token (sample order) each row of CP rank ``cp_rank``
    holds in micro-batch ``idx`` (``ck.packing.pack`` of the token indices), -1 at
    padding."""
    import compass_kernels as ck

    pb = ck.packing.pack(
        {"row": torch.arange(batch.num_tokens)},
        batch.lengths,
        idx,
        pad_multiple=layout.pad_multiple,
        cp_size=layout.cp,
        cp_rank=cp_rank,
        pad_values={"row": -1},
    )
    return pb.tensors["row"]


def make_shares(
    data: StepData,
    layout: Layout,
    infos: list[RankInfo],
    stage_layers: list[list[int]],
    *,
    what: str,
    replay: bool = True,
) -> list[list[RankMicroBatch]]:
    """Per rank, its micro-batches (``what``: "forward", "forward_stats" or "train").
    ``infos`` / ``stage_layers``: each rank's coordinates and its stage's MoE layers."""
    import compass_kernels as ck

    batch, plan = data.batch, data.plan
    m = layout.pad_multiple
    shares: list[list[RankMicroBatch]] = []
    for info, layers in zip(infos, stage_layers, strict=True):
        mbs = []
        for j in range(plan.num_micro_batches):
            idx = plan.micro_batch(info.dp, j).numpy()
            if idx.size == 0:
                # fewer sequences than dp x micro-batches: a zero-token micro-batch
                # (one sequence of length 0, padded to the layout's minimum) keeps
                # the schedule's collectives in step and adds 0 to loss and grads
                has_old, has_adv = data.old_logprobs is not None, data.advantages is not None
                mbs.append(
                    _padding_micro_batch(
                        batch,
                        layout,
                        info,
                        layers,
                        what=what,
                        replay=replay,
                        data_has_old=has_old,
                        data_has_adv=has_adv,
                    )
                )
                continue
            lens = batch.lengths[idx]
            wanted: dict[str, torch.Tensor] = {}
            if info.first_stage:
                wanted["tokens"] = batch.tokens
            if info.last_stage:
                wanted["targets"], wanted["mask"] = batch.targets, batch.mask
                if what == "train":
                    for name in ("old_logprobs", "old_entropy", "advantages"):
                        if getattr(data, name) is not None:  # else: kept on the rank
                            wanted[name] = getattr(data, name)
                elif what == "forward_stats":
                    wanted["infer_logprobs"] = batch.infer_logprobs
            mb = RankMicroBatch(lengths=torch.from_numpy(lens.astype(np.int64)))
            if wanted:  # the THD pack of this CP rank's tokens, 0 (False) at padding
                pb = ck.packing.pack(
                    wanted, batch.lengths, idx, pad_multiple=m, cp_size=layout.cp, cp_rank=info.cp
                )
                for name, t in pb.tensors.items():
                    setattr(mb, name, t)
            if replay:
                mb.trace = batch.trace.slice(
                    layers=layers,
                    sequences=idx.tolist(),
                    token_lens=lens,
                    pad_multiple=m,
                    cp_size=layout.cp,
                    cp_rank=info.cp,
                    cp_layout="zigzag" if layout.cp > 1 else None,
                    sp_size=layout.tp,
                    sp_rank=info.tp,
                )
            mbs.append(mb)
        shares.append(mbs)
    return shares


def _padding_micro_batch(
    batch: Any,
    layout: Layout,
    info: RankInfo,
    layers: list[int],
    *,
    what: str,
    replay: bool,
    data_has_old: bool = True,
    data_has_adv: bool = True,
) -> RankMicroBatch:
    """A micro-batch of no real token: ``lengths == [0]``, i.e. one sequence of
    ``layout.pad_multiple`` padding tokens (each CP rank its zigzag pair, each SP
    rank its piece), mask all False, its routing rows all missing (PADDING, so
    they route natively and leave the replay statistics)."""
    from compass_kernels.routing import MissingReason, RoutingTrace

    n = layout.pad_multiple // layout.cp  # this CP rank's tokens
    mb = RankMicroBatch(lengths=torch.zeros(1, dtype=torch.int64))
    if info.first_stage:
        mb.tokens = torch.zeros(n, dtype=batch.tokens.dtype)
    if info.last_stage:
        mb.targets = torch.zeros(n, dtype=batch.targets.dtype)
        mb.mask = torch.zeros(n, dtype=torch.bool)
        if what == "train":
            if data_has_adv:  # else the rank's kept advantages (zeros here)
                mb.advantages = torch.zeros(n)
            if data_has_old:
                mb.old_logprobs = torch.zeros(n)
                mb.old_entropy = torch.zeros(n)
        elif what == "forward_stats":
            mb.infer_logprobs = torch.zeros(n)
    if replay:
        tr = batch.trace
        rows = n // layout.tp  # the sequence-parallel piece
        k = int(tr.top_k)
        ids = torch.arange(k, dtype=tr.expert_ids.dtype).expand(rows, len(layers), k).clone()
        mb.trace = RoutingTrace(
            ids,
            torch.tensor([0, rows], dtype=torch.int64),
            int(tr.num_experts),
            layer_ids=layers,
            missing=torch.ones(rows, dtype=torch.bool),
            missing_reason=torch.full((rows,), int(MissingReason.PADDING), dtype=torch.uint8),
        )
    return mb


def plan_or_pad(lengths: np.ndarray, dp: int, max_tokens: int, *, empty: str = "pad") -> Any:
    """``ck.packing.plan(lengths, dp_size=dp, max_tokens=max_tokens)``, or, where it
    refuses for too few sequences and ``empty == "pad"``, a plan with empty
    micro-batches: the one-rank plan's M micro-batches dealt round-robin to the dp
    ranks (rank r gets micro-batches r, r + dp, ...), every rank
    ceil(M / dp) of them, the missing ones empty (run as padding micro-batches).
    The plan object carries ``empty_micro_batches`` (0 for the planner's own)."""
    import compass_kernels as ck
    from compass_kernels.packing.planner import Plan

    if empty not in ("pad", "error"):
        raise ValueError(f"empty must be 'pad' or 'error', got {empty!r}")
    try:
        plan = ck.packing.plan(lengths, dp_size=dp, max_tokens=max_tokens)
        plan.empty_micro_batches = 0
        return plan
    except ValueError as err:  # KernelArgumentError is a ValueError
        too_few = "same number" in str(err) or "need at least dp_size" in str(err)
        if empty == "error" or not too_few:
            raise
        one = ck.packing.plan(lengths, dp_size=1, max_tokens=max_tokens)
    m_one = one.num_micro_batches
    m = -(-m_one // dp)
    parts = [one.micro_batch(0, j).numpy() for j in range(m_one)]
    order, offsets = [], [0]
    for r in range(dp):
        for j in range(m):
            src = j * dp + r
            if src < m_one:
                order.append(parts[src])
            offsets.append(offsets[-1] + (parts[src].size if src < m_one else 0))
    plan = Plan(
        np.concatenate(order).astype(np.int64),
        np.asarray(offsets, dtype=np.int64),
        dp,
        m,
        one._lengths,
        one._pad,
        one._cost_ab,
        max_tokens,
        one._lower_bound,
    )
    plan.empty_micro_batches = dp * m - m_one
    return plan


def share_bytes(shares: list[list[RankMicroBatch]]) -> list[int]:
    """Bytes of tensors each rank received."""
    return [sum(mb.nbytes() for mb in mbs) for mbs in shares]


def full_broadcast_bytes(data: StepData, what: str) -> int:
    """Bytes of the step's tensors and trace if every rank received all of them."""
    b = data.batch
    n = sum(t.numel() * t.element_size() for t in (b.tokens, b.targets, b.mask))
    n += b.lengths.size * 8
    n += sum(t.numel() * t.element_size() for t in _trace_tensors(b.trace))
    if what == "train":
        n += 3 * b.num_tokens * 4
    return n


def per_micro_batch(
    plan: Any, dp_rank: int, values: np.ndarray, sizes: list[int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(sequence indices, values) of each non-padding micro-batch of rank ``dp_rank``
    from one rank reply's per-sequence ``values``, concatenated over its micro-batches
    in order (``sizes``: each micro-batch's count there; a padding one has 1)."""
    for j, piece in enumerate(np.split(values, np.cumsum(sizes)[:-1])):
        idx = plan.micro_batch(dp_rank, j)
        if idx.numel():  # else a padding micro-batch
            yield idx, torch.from_numpy(piece)
