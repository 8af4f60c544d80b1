"""The trainer on real ranks: ``tp * pp * cp * dp`` processes, Megatron's parallel
state and pipeline schedule, router replay per rank, ESPO, each rank fed only its share.

Driver side (the process that runs the rollout engine): :class:`RankedTrainer`
spawns the ranks (gloo on CPU, NCCL where CUDA is available), plans the step's
micro-batches (``ck.packing.plan`` over ``dp`` ranks) and sends each rank
:class:`RankMicroBatch` es holding only what that rank reads
(:func:`make_shares`): its DP rank's micro-batches, its CP rank's zigzag
tokens, the first stage the token ids, the last stage the loss inputs
(targets, mask, old log-probs, entropy, advantages), and every rank the
routing rows of its stage's layers for its context- and sequence-parallel
tokens. :func:`share_bytes` counts them.

Rank side (:class:`RankTrainer`, one per process): the rank's ``GPTModel``
chunk (:mod:`compass_kernels.integration.megatron.parallel`), a
:class:`~compass_kernels.integration.megatron.replay.TraceReplay` of its
stage's MoE layers, and Megatron's ``get_forward_backward_func`` (1F1B over
``pp`` stages with several micro-batches in flight; the CPU shim makes it run
on the CPU). The last stage's loss function is the vocab-parallel
``fused_linear_espo_loss`` with the global batch's sequence count and entropy
boundaries, scaled as Megatron's schedule and DDP expect (x num_microbatches
x dp: the schedule divides by num_microbatches and multiplies by cp, DDP
averages over dp x cp), so the step does not depend on the layout.

Per-token results stay where they are made: a forward with ``keep=name`` leaves
the log-probs and entropy on the last stage and returns gap sums and
per-sequence entropy maxima; :meth:`RankedTrainer.token_advantages` sends
per-sequence RL-ZVP inputs and the ranks compute and keep the token
advantages; ``train(use_kept=name)`` reads both and selects the entropy-group
boundaries among the last stage's ranks (histograms all-reduced). The driver
then receives scalars and [sequences]-sized values only
(:class:`LoopTrainer`, what ``compass-rl`` runs).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compass_kernels.integration.megatron.parallel import Layout, RankInfo

__all__ = [
    "Layout",
    "LoopTrainer",
    "RankMicroBatch",
    "RankTrainer",
    "RankedTrainer",
    "local_tokens",
    "make_shares",
    "plan_or_pad",
    "share_bytes",
]

#: ESPO metrics reported per micro-batch (token-weighted means over the batch).
METRICS = ("clip_frac", "ratio_mean", "entropy_mean", "kl_k3")


# ---------------------------------------------------------------------------
# What one rank receives
# ---------------------------------------------------------------------------


def _padded(lengths: np.ndarray, m: int) -> np.ndarray:
    return np.maximum(-(-lengths // m) * m, m)


def local_tokens(lengths: np.ndarray, m: int, cp: int, cp_rank: int):
    """The tokens of one CP rank of a micro-batch whose sequences have ``lengths``
    tokens, each padded to a multiple of ``m`` and split in 2 * cp chunks
    (zigzag: chunks r and 2cp-1-r), in the order the rank holds them.

    Returns (src, seq, pos): [T_local] int64 each: the token's index in the
    micro-batch's concatenated real tokens (-1 for padding), its sequence
    (0-based within the micro-batch) and its position in that sequence."""
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = _padded(lengths, m)
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    srcs, seqs, poss = [], [], []
    for i, (n, p, s) in enumerate(zip(lengths, padded, start, strict=True)):
        pos = np.arange(p, dtype=np.int64)
        if cp > 1:
            c = p // (2 * cp)
            mirror = 2 * cp - 1 - cp_rank
            pos = np.concatenate([pos[cp_rank * c : (cp_rank + 1) * c],
                                  pos[mirror * c : (mirror + 1) * c]])  # fmt: skip
        srcs.append(np.where(pos < n, s + pos, -1))
        seqs.append(np.full(pos.size, i, dtype=np.int64))
        poss.append(pos)

    def cat(xs: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros(0, dtype=torch.int64)

    return cat(srcs), cat(seqs), cat(poss)


@dataclass
class RankMicroBatch:
    """One micro-batch as one rank receives it (fields it does not read are None).

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

    batch: Any  # trainer.Batch
    plan: Any  # ck.packing.PackingPlan
    old_logprobs: torch.Tensor | None = None
    old_entropy: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


def make_shares(
    data: StepData,
    layout: Layout,
    infos: list[RankInfo],
    stage_layers: list[list[int]],
    *,
    what: str,
    replay: bool = True,
) -> list[list[RankMicroBatch]]:
    """Per rank, its micro-batches (``what``: "forward" or "train"). ``infos`` /
    ``stage_layers``: each rank's coordinates and its stage's MoE layers."""
    batch, plan = data.batch, data.plan
    m = layout.pad_multiple
    offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
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
                mbs.append(_padding_micro_batch(batch, layout, info, layers, what=what,
                                                replay=replay, data_has_old=has_old,
                                                data_has_adv=has_adv))  # fmt: skip
                continue
            lens = batch.lengths[idx]
            src, _, _ = local_tokens(lens, m, layout.cp, info.cp)
            gsrc = torch.from_numpy(np.concatenate([np.arange(offsets[i], offsets[i + 1])
                                                    for i in idx]))  # fmt: skip
            real = src >= 0
            take = functools.partial(_take, real=real, where=gsrc[src.clamp(min=0)])

            mb = RankMicroBatch(lengths=torch.from_numpy(lens.astype(np.int64)))
            if info.first_stage:
                mb.tokens = take(batch.tokens)
            if info.last_stage:
                mb.targets = take(batch.targets)
                mb.mask = take(batch.mask, False)
                if what == "train":
                    for name in ("old_logprobs", "old_entropy", "advantages"):
                        if getattr(data, name) is not None:  # else: kept on the rank
                            setattr(mb, name, take(getattr(data, name)))
                elif what == "forward_stats":
                    mb.infer_logprobs = take(batch.infer_logprobs)
            if replay:
                mb.trace = batch.trace.slice(
                    layers=layers, sequences=idx.tolist(), token_lens=lens, pad_multiple=m,
                    cp_size=layout.cp, cp_rank=info.cp,
                    cp_layout="zigzag" if layout.cp > 1 else None,
                    sp_size=layout.tp, sp_rank=info.tp,
                )  # fmt: skip
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
            ids, torch.tensor([0, rows], dtype=torch.int64), int(tr.num_experts),
            layer_ids=layers, missing=torch.ones(rows, dtype=torch.bool),
            missing_reason=torch.full((rows,), int(MissingReason.PADDING), dtype=torch.uint8),
        )  # fmt: skip
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
    plan = Plan(np.concatenate(order).astype(np.int64), np.asarray(offsets, dtype=np.int64),
                dp, m, one._lengths, one._pad, one._cost_ab, max_tokens,
                one._lower_bound)  # fmt: skip
    plan.empty_micro_batches = dp * m - m_one
    return plan


def _take(t: torch.Tensor, fill: float | int = 0, *, real: torch.Tensor,
          where: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """t at this rank's tokens (``where``), ``fill`` at its padding."""
    out = torch.full(real.shape, fill, dtype=t.dtype)
    out[real] = t[where[real]]
    return out


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


# ---------------------------------------------------------------------------
# The rank
# ---------------------------------------------------------------------------


class RankTrainer:
    """One rank: its model chunk, replay, optimizer and Megatron's schedule.

    Runs inside a process where ``torch.distributed`` and Megatron's parallel
    state are initialized with ``layout`` (see :func:`_rank_main`)."""

    def __init__(self, hf_config: Any, hf_state_dict: dict[str, torch.Tensor], layout: Layout,
                 *, lr: float, replay: bool = True) -> None:  # fmt: skip
        from megatron.core import parallel_state as ps

        from compass_kernels.integration.megatron.parallel import build_rank_model, rank_info
        from compass_kernels.integration.megatron.replay import TraceReplay

        self.layout = layout
        self.hf_config = hf_config
        self.model = build_rank_model(hf_config, hf_state_dict, layout)
        self.info = rank_info()
        self.replay = TraceReplay(self.model)
        self.use_replay = replay
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0
        )
        self.kept: dict[str, Any] = {}  # forward results kept on the rank, by name
        self.kept_advantages: dict[str, Any] = {}  # token advantages from them, by name
        self._kept_shares: dict[str, Any] = {}
        self._kept_real: dict[str, Any] = {}
        self.tp_group = ps.get_tensor_model_parallel_group() if layout.tp > 1 else None
        self.cp_group = ps.get_context_parallel_group() if layout.cp > 1 else None

    @property
    def layers(self) -> list[int]:
        return self.replay.layers

    # -- one micro-batch ---------------------------------------------------------

    def _masks(self, mb: RankMicroBatch):
        """(attention mask [1, 1, T, T * cp] True = masked, RoPE positions or None,
        ESPO cu_seqlens [n+1], real-token flags [T]) of this rank's tokens."""
        lay, m = self.layout, self.layout.pad_multiple
        lens = mb.lengths.numpy()
        src, seq, pos = local_tokens(lens, m, lay.cp, self.info.cp)
        if lay.cp > 1:
            keys = [local_tokens(lens, m, lay.cp, r) for r in range(lay.cp)]
            kseq = torch.cat([k[1] for k in keys])
            kpos = torch.cat([k[2] for k in keys])
        else:
            kseq, kpos = seq, pos
        allowed = (seq[:, None] == kseq[None, :]) & (kpos[None, :] <= pos[:, None])
        counts = torch.bincount(seq, minlength=lens.size)
        cu = torch.zeros(lens.size + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(counts, 0)
        return (~allowed)[None, None], (pos if lay.cp > 1 else None), cu, src >= 0

    def _real_seq(self, mb: RankMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(real-token flags [T_local] bool, sequence within the micro-batch [T_local])."""
        src, seq, _ = local_tokens(mb.lengths.numpy(), self.layout.pad_multiple,
                                   self.layout.cp, self.info.cp)  # fmt: skip
        return src >= 0, seq

    def _forward_step(self, use_replay: bool, loss_fn):
        from compass_kernels.integration.cpu import megatron as megatron_cpu

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            mask, positions, cu, real = self._masks(mb)
            tokens = mb.tokens[None] if mb.tokens is not None else None
            pos_ids = torch.arange(mask.shape[2])[None]
            route = self.replay.micro_batch(mb.trace) if use_replay else self.replay.native()
            rope = (megatron_cpu.cp_token_positions(positions) if positions is not None
                    else _null())  # fmt: skip
            prev = model.post_process
            model.post_process = False  # hidden states: the fused path computes log-probs
            try:
                with route, rope:
                    out = model(tokens, pos_ids, attention_mask=mask)
            finally:
                model.post_process = prev
            return out, functools.partial(loss_fn, mb, cu, real)

        return forward_step

    def _hidden_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.layout.tp > 1:
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region,
            )

            # forward: all-gather the sequence pieces; backward: keep this rank's
            # piece (the fused loss already sums d hidden over the vocab shards).
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return hidden.reshape(-1, hidden.shape[-1])

    def _run(self, shares: list[RankMicroBatch], forward_step, *, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        nmb = len(shares)
        seq_len = max(int(_padded(mb.lengths.numpy(), self.layout.pad_multiple).sum())
                      for mb in shares) // self.layout.cp  # fmt: skip
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(shares),
            model=[self.model],
            num_microbatches=nmb,
            seq_length=seq_len,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _replay_counts(self, shares: list[RankMicroBatch], use_replay: bool) -> dict[int, list]:
        """{layer: counts} of this rank's routers, padding rows taken out of ``rows``."""
        from compass_kernels.routing import MissingReason

        pads = 0
        for mb in shares:
            if use_replay and mb.trace is not None and mb.trace.missing_reason is not None:
                pads += int((mb.trace.missing_reason == int(MissingReason.PADDING)).sum())
        out = {}
        for layer, st in self.replay.stats().items():
            c = st.counts.clone()
            c[0] -= pads
            out[layer] = c.tolist()
        return out

    # -- commands ----------------------------------------------------------------

    def forward(self, shares: list[RankMicroBatch], replay: bool = True,
                keep: str | None = None) -> dict:  # fmt: skip
        """No-grad passes (replayed or native routing): per micro-batch, the last
        stage's log-probs and entropy of its tokens (tp rank 0 returns them).

        With ``keep`` (a name), the last stage keeps them under that name (a later
        :meth:`train` reads them as the old policy's) and returns per micro-batch
        only :func:`_forward_stats`: gap sums against ``infer_logprobs`` and each
        sequence's response-entropy max / min."""
        import compass_kernels as ck

        def loss_fn(mb, cu, real, hidden):
            h = self._hidden_rows(hidden)
            lp, ent = ck.espo.fused_linear_logprobs_entropy(
                h, self.model.output_layer.weight, mb.targets, tp_group=self.tp_group
            )
            return h.new_zeros(()), {"logprobs": lp, "entropy": ent}

        self.model.eval()
        self.replay.reset_stats()
        with torch.no_grad():
            out = self._run(shares, self._forward_step(replay, loss_fn), forward_only=True)
        last = self.info.last_stage
        counts = self._replay_counts(shares, replay) if replay else {}
        if keep is None:  # the driver gathers every token's log-prob and entropy
            return {"per_mb": [(d["logprobs"], d["entropy"]) for d in out]
                    if last and self.info.tp == 0 else None, "replay": counts}  # fmt: skip
        # the results stay here (the train step reads them); the driver gets sums
        self._kept_shares[keep] = shares
        self._kept_real[keep] = [self._real_seq(mb)[0] for mb in shares]
        self.kept_advantages.pop(keep, None)
        self.kept[keep] = [(d["logprobs"], d["entropy"]) for d in out] if last else None
        if not (last and self.info.tp == 0):
            return {"per_mb": None, "replay": counts}
        from compass_kernels.integration.rl.trainer import GapSums

        stats = [_forward_stats(mb, d["logprobs"], d["entropy"], *self._real_seq(mb))
                 for mb, d in zip(shares, out, strict=True)]  # fmt: skip
        # one reply for all micro-batches: the summed gap, the per-sequence values
        # concatenated in micro-batch order (numpy: a smaller pickle than tensors)
        per_seq = {k: torch.cat([st[k] for st in stats]).numpy() for k in ("ent_max", "ent_min")}
        gap = sum((st["gap"] for st in stats), GapSums())
        return {"per_mb": None, "replay": counts, "stats": {"gap": gap, **per_seq}}

    def entropy_histogram(self, keep: str, prefixes: torch.Tensor, shift: int,
                          bits: int) -> torch.Tensor:  # fmt: skip
        """Radix-select round over the response-token entropies this rank kept
        (``keep``): for each prefix p, counts [2**bits] int64 of the keys k
        (:func:`float_keys`) with k >> (shift + bits) == p, by (k >> shift) &
        (2**bits - 1). Every rank of a last stage counts its copy (tensor-parallel
        ranks hold the same values); other stages count nothing."""
        out = torch.zeros(prefixes.numel(), 1 << bits, dtype=torch.int64)
        kept = self.kept.get(keep)
        if kept is None:
            return out
        parts = zip(kept, self._kept_shares[keep], self._kept_real[keep], strict=True)
        vals = torch.cat([ent[mb.mask & real].float() for (_, ent), mb, real in parts])
        if vals.numel() == 0:
            return out
        keys = float_keys(vals)
        high = keys >> (shift + bits)
        low = (keys >> shift) & ((1 << bits) - 1)
        for i, p in enumerate(prefixes.tolist()):
            sel = low[high == p]
            out[i] = torch.bincount(sel, minlength=1 << bits)
        return out

    def kept_entropy_quantiles(self, keep: str, levels: tuple[float, ...],
                               num_tokens: int) -> torch.Tensor:  # fmt: skip
        """Exact quantiles (torch.quantile's linear rule, as
        ``espo.loss.entropy_thresholds``) at ``levels`` of the ``num_tokens``
        response-token entropies the last stage kept under ``keep``, by a radix
        select (:func:`distributed_quantiles`) whose histograms are all-reduced
        over this rank's data x context-parallel group: the ranks of the last
        stage at this tensor-parallel rank, which together hold every response
        token once. Collective over that group: every last-stage rank calls it."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group(with_context_parallel=True)

        def histogram(prefixes: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
            h = self.entropy_histogram(keep, prefixes, shift, bits)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(h, group=group)
            return h

        return distributed_quantiles(histogram, num_tokens, tuple(levels))

    def token_advantages(self, keep: str, per_mb: list[dict] | None, alpha: float) -> dict:
        """RL-ZVP token advantages of the response tokens this rank kept (``keep``),
        from the kept entropy and, per micro-batch, its sequences' ``rewards``,
        ``zero_var``, ``advantages`` and ``entropy_max`` ([n_mb] each: the whole
        sequence's max, reduced over the CP ranks by the driver), by
        :func:`~compass_kernels.integration.rl.trainer.zvp_token_advantages`. Kept
        for :meth:`train` (``use_kept=keep``). Returns {"nonzero": [sum of n_mb]
        bool, the micro-batches' sequences in order (a token here has a nonzero
        advantage), tp rank 0 of a last stage only, else None}."""
        from compass_kernels.integration.rl.trainer import zvp_token_advantages

        kept = self.kept.get(keep)
        if not self.info.last_stage:
            return {"nonzero": None}
        if kept is None or per_mb is None or len(per_mb) != len(kept):
            raise RuntimeError(f"token_advantages: no kept forward {keep!r} of "
                               f"{0 if per_mb is None else len(per_mb)} micro-batches")  # fmt: skip
        advs, flags = [], []
        for (_, ent), mb, sc in zip(kept, self._kept_shares[keep], per_mb, strict=True):
            real, seq = self._real_seq(mb)
            adv, nz = zvp_token_advantages(
                ent, seq, mb.mask & real, sc["rewards"], sc["zero_var"], sc["advantages"],
                alpha=alpha, entropy_max=sc["entropy_max"],
            )  # fmt: skip
            advs.append(adv)
            flags.append(nz)
        self.kept_advantages[keep] = advs
        return {"nonzero": torch.cat(flags).numpy() if self.info.tp == 0 else None}

    def kept_values(self, keep: str) -> dict:
        """The per-token tensors kept under ``keep`` (checks only: the driver never
        needs them): {"per_mb": [(log-probs, entropy, token advantages or None)]}
        from tp rank 0 of a last stage, else None."""
        kept = self.kept.get(keep)
        if kept is None or self.info.tp != 0:
            return {"per_mb": None}
        adv = self.kept_advantages.get(keep) or [None] * len(kept)
        return {"per_mb": [(lp, ent, a) for (lp, ent), a in zip(kept, adv, strict=True)]}

    def train(self, shares: list[RankMicroBatch], num_sequences: int,
              entropy_threshold: torch.Tensor | None, espo_kwargs: dict,
              kept_quantiles: tuple | None = None) -> dict:  # fmt: skip
        """One optimizer step over this rank's micro-batches (ESPO). With
        ``kept_quantiles`` = (levels, response tokens of the batch), the last
        stage's ranks first compute the entropy-group boundaries from the
        entropy kept under ``use_kept`` (:meth:`kept_entropy_quantiles`)."""
        import compass_kernels as ck
        from compass_kernels.integration.megatron.parallel import clip_grads, finalize_grads

        nmb = len(shares)
        dp = self.layout.dp
        kwargs = dict(espo_kwargs)
        use = kwargs.pop("use_kept", None)
        if use is not None and self.info.last_stage:
            kept = self.kept.get(use)
            if kept is None or len(kept) != nmb:
                raise RuntimeError(f"train: no kept forward {use!r} of {nmb} micro-batches")
            advs = self.kept_advantages.get(use) or [None] * nmb
            for mb, (lp, ent), kmb, adv in zip(shares, kept, self._kept_shares[use], advs,
                                               strict=True):  # fmt: skip
                if not torch.equal(mb.lengths, kmb.lengths):
                    raise RuntimeError(f"train: kept forward {use!r} is of another batch")
                mb.old_logprobs, mb.old_entropy = lp, ent
                if mb.advantages is None:
                    if adv is None:
                        raise RuntimeError(f"train: no advantages sent or kept under {use!r}")
                    mb.advantages = adv
        if kept_quantiles is not None and self.info.last_stage:
            entropy_threshold = self.kept_entropy_quantiles(use, *kept_quantiles)
        if entropy_threshold is not None:
            kwargs["entropy_threshold"] = entropy_threshold

        def loss_fn(mb, cu, real, hidden):
            h = self._hidden_rows(hidden)
            loss, metrics, _, _ = ck.espo.fused_linear_espo_loss(
                h, self.model.output_layer.weight, mb.targets, mb.old_logprobs,
                mb.old_entropy, mb.advantages, cu, mb.mask & real, num_sequences=num_sequences,
                advantages_per_token=True, tp_group=self.tp_group, cp_group=self.cp_group,
                **kwargs,
            )  # fmt: skip
            report = {"loss": metrics["loss"].detach()}
            report.update({k: metrics[k].detach() for k in METRICS})
            return loss * (nmb * dp), report

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.replay.reset_stats()
        out = self._run(shares, self._forward_step(self.use_replay, loss_fn), forward_only=False)
        finalize_grads(self.model)
        norm = clip_grads(self.model, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        keep = self.info.last_stage and self.info.tp == 0 and self.info.cp == 0
        return {
            "per_mb": [{k: float(v) for k, v in d.items()} for d in out] if keep else None,
            "grad_norm": norm,
            "replay": self._replay_counts(shares, self.use_replay) if self.use_replay else {},
            # a list: a smaller pickle than a tensor
            "entropy_threshold": (
                entropy_threshold.tolist() if keep and entropy_threshold is not None else None
            ),  # fmt: skip
        }

    # -- route recording (tests: the ids each MoE layer used, per forward) ----------

    def record_routes(self, on: bool) -> int:
        """Start (``on``) or stop recording, per router forward, the expert ids the
        layer dispatched with (its ``routing_map``) and how many micro-batches were
        in flight on this stage (forwarded, backward not finished). Returns the
        number of routers hooked."""
        for h in getattr(self, "_route_hooks", []):
            h.remove()
        self._route_hooks = []
        self._routes: list[dict] = []
        if not on:
            return 0
        from compass_kernels.integration.megatron.replay import find_moe_routers

        def hook(layer, module, args, output):
            if torch._C._current_graph_task_id() != -1:
                return  # a recompute inside backward: not a forward of the schedule
            routing_map = output[1]
            k = int(module.topk)
            ids = routing_map.nonzero()[:, 1].reshape(-1, k)  # row-major: sorted per token
            self._routes.append({"layer": layer, "ids": ids.to(torch.int16).clone(),
                                 "in_flight": len(self.replay._pending) + 1})  # fmt: skip

        for layer, router in find_moe_routers(self.model).items():
            self._route_hooks.append(
                router.register_forward_hook(functools.partial(hook, layer)))  # fmt: skip
        return len(self._route_hooks)

    def recorded_routes(self) -> list[dict]:
        """The records since :meth:`record_routes` (call order), then cleared."""
        out, self._routes = list(getattr(self, "_routes", [])), []
        return out

    def weights(self, part: str | int | None = None) -> dict[str, torch.Tensor]:
        """This rank's owned share of the full model (Megatron names, TP-gathered),
        or of one ``part`` of it ("embedding", a decoder layer number, "final")."""
        from compass_kernels.integration.megatron.parallel import gathered_megatron_params

        return gathered_megatron_params(self.model, part)


def float_keys(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 keys in [0, 2**32) of float32 values (total order;
    -0.0 just below +0.0)."""
    b = x.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(b >= 0, b + (1 << 31), -1 - b)


def key_to_float(k: int) -> float:
    """The float32 value of a :func:`float_keys` key."""
    b = k - (1 << 31) if k >= (1 << 31) else -1 - k
    return float(torch.tensor([b], dtype=torch.int32).view(torch.float32)[0])


#: Radix-select rounds over the 32 key bits: (shift, bits), most significant first.
RADIX_ROUNDS = ((21, 11), (10, 11), (0, 10))


def select_order_statistics(histogram: Any, targets: list[int]) -> list[float]:
    """Exact order statistics (0-based ranks ``targets``) of float32 values spread
    over ranks, by a radix select in len(RADIX_ROUNDS) rounds: ``histogram(prefixes,
    shift, bits)`` returns the [len(prefixes), 2**bits] counts summed over ranks
    (see :meth:`RankTrainer.entropy_histogram`)."""
    prefix = [0] * len(targets)
    rest = list(targets)
    for shift, bits in RADIX_ROUNDS:
        counts = histogram(torch.tensor(prefix, dtype=torch.int64), shift, bits)
        cum = torch.cumsum(counts, 1)
        for i in range(len(targets)):
            b = int(torch.searchsorted(cum[i], torch.tensor(rest[i]), right=True))
            if b >= cum.shape[1]:
                raise RuntimeError(f"order statistic {targets[i]}: only {int(cum[i, -1])} values")
            rest[i] -= int(cum[i, b - 1]) if b > 0 else 0
            prefix[i] = (prefix[i] << bits) | b
    return [key_to_float(p) for p in prefix]


def distributed_quantiles(histogram: Any, n: int, levels: tuple[float, ...]) -> torch.Tensor:
    """torch.quantile's linear rule (as ``espo.loss.entropy_thresholds``) at
    ``levels`` over n values held by the ranks, from two order statistics per
    level (:func:`select_order_statistics`): [Q] float64, equal to the gathered
    computation."""
    q = torch.tensor(levels, dtype=torch.float64)
    if n == 0:
        return torch.full_like(q, float("nan"))
    pos = q * float(max(n - 1, 0))
    lo = pos.floor()
    w = pos - lo
    i_lo = lo.to(torch.int64).clamp(max=n - 1)
    i_hi = pos.ceil().to(torch.int64).clamp(max=n - 1)
    want = sorted(set(i_lo.tolist()) | set(i_hi.tolist()))
    vals = dict(zip(want, select_order_statistics(histogram, want), strict=True))
    v_lo = torch.tensor([vals[i] for i in i_lo.tolist()], dtype=torch.float64)
    v_hi = torch.tensor([vals[i] for i in i_hi.tolist()], dtype=torch.float64)
    return torch.lerp(v_lo, v_hi, w)


def _forward_stats(mb: RankMicroBatch, lp: torch.Tensor, ent: torch.Tensor,
                   real: torch.Tensor, seq: torch.Tensor) -> dict:  # fmt: skip
    """What the driver needs of one micro-batch's forward on this rank: the gap
    sums (:class:`~compass_kernels.integration.rl.trainer.GapSums`) of d = lp -
    infer over its response tokens and, per sequence of the micro-batch, the
    max / min response-token entropy of this rank's tokens (-inf / +inf where it
    holds none)."""
    import math

    from compass_kernels.integration.rl.trainer import GapSums

    m = mb.mask & real
    n = mb.lengths.numel()
    e = ent.double()
    emax = torch.full((n,), -math.inf, dtype=torch.float64)
    emin = torch.full((n,), math.inf, dtype=torch.float64)
    emax.scatter_reduce_(0, seq[m], e[m], "amax")
    emin.scatter_reduce_(0, seq[m], e[m], "amin")
    return {"gap": GapSums.of(lp[m], mb.infer_logprobs[m]), "ent_max": emax, "ent_min": emin}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, layout: Layout, model_dir: str, lr: float,
               replay: bool, seed: int, cmd_q: Any, res_q: Any) -> None:  # fmt: skip
    import torch.distributed as dist
    from transformers import AutoConfig

    from compass_kernels.integration.cpu import megatron as megatron_cpu
    from compass_kernels.integration.megatron.convert import load_hf_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    trainer = None
    try:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)  # fmt: skip
        megatron_cpu.apply()
        megatron_cpu._init_megatron_parallel(seed, **layout.megatron_sizes())
        hf_config = AutoConfig.from_pretrained(model_dir)
        trainer = RankTrainer(hf_config, load_hf_state_dict(model_dir), layout, lr=lr,
                              replay=replay)  # fmt: skip
        res_q.put((rank, "ready", (trainer.info, trainer.layers)))
        while True:
            cmd, args = cmd_q.get()
            if cmd == "stop":
                break
            t0 = time.perf_counter()
            result = getattr(trainer, cmd)(*args)
            res_q.put((rank, cmd, (result, time.perf_counter() - t0)))
    except BaseException:  # noqa: BLE001 - reported to the driver, then the rank exits
        res_q.put((rank, "error", traceback.format_exc()))
    finally:
        from megatron.core import parallel_state as ps

        if trainer is not None:
            trainer.replay.remove()
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


class RankError(RuntimeError):
    """A rank failed (the message holds its traceback) or did not answer in time."""


@dataclass
class _Replies:
    values: list[Any]
    seconds: float
    bytes_sent: list[int] = field(default_factory=list)


class RankedTrainer:
    """The driver's handle on ``layout.world_size`` trainer processes.

    Parameters
    ----------
    model_dir : HF checkpoint folder every rank loads (its own slices).
    layout : the parallel sizes.
    lr : AdamW learning rate.
    replay : train with router replay (False: the ``--no-replay`` ablation).
    seed : Megatron's RNG seed.
    timeout : seconds to wait for any one command on all ranks.
    """

    def __init__(self, model_dir: str | os.PathLike, layout: Layout, *, lr: float = 1e-3,
                 replay: bool = True, seed: int = 0, timeout: float = 600.0) -> None:  # fmt: skip
        import torch.multiprocessing as mp
        from transformers import AutoConfig

        from compass_kernels.integration.cpu.megatron import find_free_port

        self.model_dir = str(Path(model_dir))
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.layout = layout.check(self.hf_config)
        self.use_replay = replay
        self.timeout = timeout
        self.vocab_size = int(self.hf_config.vocab_size)
        self.last_reply_bytes: dict[str, list[int]] = {}
        self.reply_bytes_total: dict[str, int] = {}  # per command, since the start
        ctx = mp.get_context("spawn")
        world = layout.world_size
        self._res = ctx.Queue()
        self._cmds = [ctx.Queue() for _ in range(world)]
        port = find_free_port()
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    world,
                    port,
                    layout,
                    self.model_dir,
                    lr,
                    replay,
                    seed,
                    self._cmds[r],
                    self._res,
                ),
                daemon=True,
            )  # fmt: skip
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        ready = self._collect("ready")
        self.infos: list[RankInfo] = [v[0] for v in ready.values]
        self.stage_layers: list[list[int]] = [v[1] for v in ready.values]
        self.last_bytes: dict[str, Any] = {}
        self._kept: dict[str, Any] = {}  # name -> the plan of the forward kept under it
        self._kept_seq_max: dict[str, torch.Tensor] = {}  # name -> [n] response entropy max
        self._kept_adv: set[str] = set()  # names the ranks hold token advantages under

    # -- plumbing ------------------------------------------------------------------

    def _collect(self, cmd: str) -> _Replies:
        import queue

        t0 = time.perf_counter()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout
        while len(out) < len(self._procs):
            try:
                rank, what, value = self._res.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} exited" if dead else f"no answer in {self.timeout} s"
                    raise RankError(f"{cmd}: {why}") from None
                continue
            if what == "error":
                self.close()
                raise RankError(f"rank {rank} failed during {cmd}:\n{value}")
            if what != cmd:
                self.close()
                raise RankError(f"rank {rank} answered {what!r} to {cmd!r}")
            out[rank] = value
        values = [out[r] for r in range(len(self._procs))]
        # what each rank sent back (pickled, as the queue carries it)
        self.last_reply_bytes[cmd] = [len(pickle.dumps(v[0])) if cmd != "ready" else 0
                                      for v in values]  # fmt: skip
        self.reply_bytes_total[cmd] = (self.reply_bytes_total.get(cmd, 0)
                                       + sum(self.last_reply_bytes[cmd]))  # fmt: skip
        return _Replies(values, time.perf_counter() - t0)

    def _command(self, cmd: str, per_rank_args: list[tuple]) -> list[Any]:
        for q, args in zip(self._cmds, per_rank_args, strict=True):
            q.put((cmd, args))
        return [v[0] for v in self._collect(cmd).values]

    def close(self) -> None:
        for q, p in zip(self._cmds, self._procs, strict=True):
            if p.is_alive():
                try:
                    q.put(("stop", ()))
                except (ValueError, OSError):
                    pass
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    # -- steps -----------------------------------------------------------------------

    def plan(self, batch: Any, max_tokens: int, *, empty: str = "pad") -> StepData:
        """The step's packing plan over ``layout.dp`` ranks (``ck.packing.plan``).

        ``empty``: what to do when the planner cannot give every rank the same
        number of non-empty micro-batches (fewer sequences than dp x micro-batches):
        "pad" (default) plans on one rank and deals its micro-batches out over the
        dp ranks, the ranks short of micro-batches running zero-token padding ones
        (:func:`_padding_micro_batch`: they keep the schedule's collectives in step
        and add 0 to loss and gradients); "error" re-raises the planner's error."""
        return StepData(batch=batch, plan=plan_or_pad(batch.lengths, self.layout.dp,
                                                      max_tokens, empty=empty))  # fmt: skip

    def _scatter(self, data: StepData, what: str, replay: bool) -> list[list[RankMicroBatch]]:
        shares = make_shares(data, self.layout, self.infos, self.stage_layers, what=what,
                             replay=replay)  # fmt: skip
        sent = share_bytes(shares)
        self.last_bytes[what] = {"per_rank": sent, "full": full_broadcast_bytes(data, what)}
        return shares

    def _assemble(self, data: StepData, results: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropy in sample order from the last stages."""
        batch, plan, lay = data.batch, data.plan, self.layout
        T = batch.num_tokens
        lp, ent = torch.zeros(T), torch.zeros(T)
        seen = torch.zeros(T, dtype=torch.int64)
        offsets = np.concatenate([[0], np.cumsum(batch.lengths)])
        for info, res in zip(self.infos, results, strict=True):
            if res["per_mb"] is None:
                continue
            for j, (l_mb, e_mb) in enumerate(res["per_mb"]):
                idx = plan.micro_batch(info.dp, j).numpy()
                if idx.size == 0:
                    continue  # a padding micro-batch (see _padding_micro_batch)
                src, _, _ = local_tokens(batch.lengths[idx], lay.pad_multiple, lay.cp, info.cp)
                gsrc = torch.from_numpy(np.concatenate([np.arange(offsets[i], offsets[i + 1])
                                                        for i in idx]))  # fmt: skip
                real = src >= 0
                where = gsrc[src[real]]
                lp[where] = l_mb[real]
                ent[where] = e_mb[real]
                seen[where] += 1
        if not bool((seen == 1).all()):
            raise RankError(f"{int((seen != 1).sum())} tokens were returned by no rank or twice")
        return lp, ent

    def forward(self, data: StepData, *, replay: bool = True, keep: str | None = None) -> dict:
        """No-grad pass over the step's batch: per-token log-probs and entropy
        (sample order) and the replay statistics summed over ranks.

        With ``keep`` (a name), the log-probs and entropy stay on the last-stage
        ranks under that name (``train(use_kept=name)`` reads them) and the
        driver receives only: ``gap`` (a :class:`~compass_kernels.integration.rl.trainer.GapStats`
        of d = log-prob - engine log-prob over the response tokens; needs
        ``batch.infer_logprobs``) and, per sequence (sample order), ``seq_entropy_max``
        / ``seq_entropy_min`` [n] float64 of its response tokens (RL-ZVP's inputs)."""
        if keep is None:
            shares = self._scatter(data, "forward", replay)
            results = self._command("forward", [(s, replay) for s in shares])
            lp, ent = self._assemble(data, results)
            return {"logprobs": lp, "entropy": ent,
                    "replay": self._replay_dicts(results)}  # fmt: skip
        shares = self._scatter(data, "forward_stats", replay)
        results = self._command("forward", [(s, replay, keep) for s in shares])
        self._kept[keep] = data.plan
        self._kept_adv.discard(keep)  # the ranks dropped advantages kept under this name
        out = self._reduce_stats(data, shares, results)
        self._kept_seq_max[keep] = out["seq_entropy_max"]
        return {**out, "replay": self._replay_dicts(results)}

    def _reduce_stats(self, data: StepData, shares: list[list[RankMicroBatch]],
                      results: list[dict]) -> dict:  # fmt: skip
        import math

        from compass_kernels.integration.rl.trainer import GapSums

        n_seq = data.batch.num_sequences
        emax = torch.full((n_seq,), -math.inf, dtype=torch.float64)
        emin = torch.full((n_seq,), math.inf, dtype=torch.float64)
        total = GapSums()
        for info, mbs, res in zip(self.infos, shares, results, strict=True):
            st = res.get("stats")
            if st is None:
                continue
            total = total + st["gap"]
            sizes = [mb.lengths.numel() for mb in mbs]
            for idx, hi in _per_micro_batch(data.plan, info.dp, st["ent_max"], sizes):
                emax[idx] = torch.maximum(emax[idx], hi)
            for idx, lo in _per_micro_batch(data.plan, info.dp, st["ent_min"], sizes):
                emin[idx] = torch.minimum(emin[idx], lo)
        return {"gap": total.stats(), "seq_entropy_max": emax, "seq_entropy_min": emin}

    def token_advantages(self, data: StepData, keep: str, rewards: torch.Tensor,
                         zero_var: torch.Tensor, advantages: torch.Tensor, *,
                         alpha: float) -> torch.Tensor:  # fmt: skip
        """RL-ZVP token advantages computed on the last-stage ranks from the entropy
        of ``forward(data, keep=keep)`` and kept there for ``train(use_kept=keep)``
        (the driver builds no per-token advantages).

        rewards, advantages : [n] float (sample order; the float dtype rl_zvp gets).
        zero_var : [n] bool, the sequence's group has zero reward variance.
        alpha : rl_zvp's scale.

        Each rank receives, per micro-batch, its sequences' rewards, zero_var,
        advantages and response-entropy max ([n_mb] each; the max is the one
        per-sequence statistic of rl_zvp, reduced over the ranks by that forward:
        exact, a max is order-free). Returns [n] bool: the sequence has a token
        with a nonzero advantage (OR over its CP ranks)."""
        plan = data.plan
        if self._kept.get(keep) is not plan:
            raise ValueError(f"token_advantages: keep={keep!r} names no forward of this plan")
        n = data.batch.num_sequences
        for name, t in (("rewards", rewards), ("zero_var", zero_var),
                        ("advantages", advantages)):  # fmt: skip
            if t.shape != (n,):
                raise ValueError(f"{name}: expected [{n}] (one per sequence), got "
                                 f"{tuple(t.shape)}")  # fmt: skip
        emax = self._kept_seq_max[keep]
        args, sent = [], []
        for info in self.infos:
            per_mb = None
            if info.last_stage:
                per_mb = []
                for j in range(plan.num_micro_batches):
                    idx = plan.micro_batch(info.dp, j)
                    if idx.numel() == 0:  # a padding micro-batch: one empty sequence
                        per_mb.append({"rewards": rewards.new_zeros(1),
                                       "zero_var": torch.zeros(1, dtype=torch.bool),
                                       "advantages": advantages.new_zeros(1),
                                       "entropy_max": emax.new_zeros(1)})  # fmt: skip
                        continue
                    per_mb.append({"rewards": rewards[idx], "zero_var": zero_var[idx],
                                   "advantages": advantages[idx],
                                   "entropy_max": emax[idx]})  # fmt: skip
            args.append((keep, per_mb, float(alpha)))
            sent.append(sum(t.numel() * t.element_size() for d in per_mb or [] for t in d.values()))
        self.last_bytes["token_advantages"] = {"per_rank": sent}
        results = self._command("token_advantages", args)
        nonzero = torch.zeros(n, dtype=torch.bool)
        for info, (_, per_mb, _), res in zip(self.infos, args, results, strict=True):
            if res["nonzero"] is None:
                continue
            sizes = [d["rewards"].numel() for d in per_mb]
            for idx, nz in _per_micro_batch(plan, info.dp, res["nonzero"], sizes):
                nonzero[idx] |= nz
        self._kept_adv.add(keep)
        return nonzero

    def kept_values(self, data: StepData, keep: str) -> dict:
        """Checks only (it gathers what the step keeps on the ranks): the log-probs,
        entropy and token advantages kept under ``keep``, sample order [T] each
        (advantages None before :meth:`token_advantages`)."""
        if self._kept.get(keep) is not data.plan:
            raise ValueError(f"kept_values: keep={keep!r} names no forward of this plan")
        results = self._command("kept_values", [(keep,) for _ in self._procs])

        def pick(r: dict, a: int, b: int) -> dict:
            return {"per_mb": None if r["per_mb"] is None else [(t[a], t[b]) for t in r["per_mb"]]}

        lp, ent = self._assemble(data, [pick(r, 0, 1) for r in results])
        out = {"logprobs": lp, "entropy": ent, "advantages": None}
        if keep in self._kept_adv:
            out["advantages"] = self._assemble(data, [pick(r, 2, 2) for r in results])[0]
        return out

    def _replay_dicts(self, results: list[dict]) -> dict[int, dict]:
        from compass_kernels.routing import ReplayStats

        top_k = int(self.hf_config.num_experts_per_tok)
        total: dict[int, torch.Tensor] = {}
        for res in results:
            for layer, c in res["replay"].items():
                t = torch.tensor(c, dtype=torch.int64)
                total[layer] = total[layer] + t if layer in total else t
        return {layer: ReplayStats(c, top_k).as_dict() for layer, c in sorted(total.items())}

    def train(self, data: StepData, *, num_sequences: int, **espo_kwargs: Any) -> dict:
        """One optimizer step. ``data`` holds the old log-probs, entropy and
        advantages (sample order), or ``use_kept=name`` names a ``forward(keep=name)``
        of this plan whose log-probs / entropy the ranks read (and, with
        ``data.advantages`` None, the token advantages of ``token_advantages(data,
        name, ...)``). The entropy-group boundaries are the global batch's: from
        the driver's entropy, or, kept, selected among the last-stage ranks
        (:meth:`RankTrainer.kept_entropy_quantiles`). The result's
        ``entropy_threshold`` is the boundaries the loss used ([Q] float64 or None)."""
        from compass_kernels.espo import loss_config
        from compass_kernels.espo.loss import entropy_thresholds

        cfg = loss_config.resolve(**{k: v for k, v in espo_kwargs.items()
                                     if k not in ("entropy_threshold", "use_kept")},
                                  vocab_size=self.vocab_size)  # fmt: skip
        thr = espo_kwargs.pop("entropy_threshold", None)
        use = espo_kwargs.get("use_kept")
        if (data.old_logprobs is None) != (data.old_entropy is None) or (
            data.old_logprobs is None and use is None
        ):
            raise ValueError("train: give data.old_logprobs and old_entropy, or use_kept=<name> "
                             "of a forward(keep=<name>) of this batch")  # fmt: skip
        if use is not None and self._kept.get(use) is not data.plan:
            raise ValueError(f"train: use_kept={use!r} names no forward of this step's plan")
        if data.advantages is None and use not in self._kept_adv:
            raise ValueError("train: give data.advantages, or use_kept=<name> after "
                             "token_advantages(data, <name>, ...)")  # fmt: skip
        kept_q = None
        if thr is None and cfg.num_groups > 1 and not cfg.per_sequence and not cfg.token_groups:
            m = data.batch.mask
            if data.old_entropy is None:  # kept on the ranks: they select it among themselves
                kept_q = (tuple(cfg.levels), int(m.sum()))
            else:
                ent = data.old_entropy[m]
                cu = torch.tensor([0, ent.numel()], dtype=torch.int64)
                thr = entropy_thresholds(ent, cu, levels=cfg.levels).reshape(-1)
        shares = self._scatter(data, "train", self.use_replay)
        results = self._command("train", [(s, num_sequences, thr, espo_kwargs, kept_q)
                                          for s in shares])  # fmt: skip
        return self._reduce_train(data, results)

    def _reduce_train(self, data: StepData, results: list[dict]) -> dict:
        batch, plan = data.batch, data.plan
        loss, tokens = 0.0, 0
        sums = dict.fromkeys(METRICS, 0.0)
        for info, res in zip(self.infos, results, strict=True):
            if res["per_mb"] is None:
                continue
            for j, rep in enumerate(res["per_mb"]):
                idx = plan.micro_batch(info.dp, j)
                n = int(sum(int(batch.mask[batch.seq_index == int(i)].sum()) for i in idx))
                loss += rep["loss"]
                tokens += n
                for k in METRICS:
                    sums[k] += rep[k] * n
        norms = {round(r["grad_norm"], 9) for r in results}
        if len(norms) != 1:
            raise RankError(f"ranks disagree on the global grad norm: {sorted(norms)}")
        out = {k: v / max(tokens, 1) for k, v in sums.items()}
        out["loss"] = loss
        out["grad_norm"] = results[0]["grad_norm"]
        # the entropy-group boundaries the loss used ([Q]; None: one group)
        thr = next((r["entropy_threshold"] for r in results
                    if r["entropy_threshold"] is not None), None)  # fmt: skip
        out["entropy_threshold"] = None if thr is None else torch.tensor(thr, dtype=torch.float64)
        out["replay"] = self._replay_dicts(results)
        return out

    def record_routes(self, on: bool = True) -> list[int]:
        """Every rank records (``on``) the expert ids its MoE layers dispatch with,
        per forward (see :meth:`RankTrainer.record_routes`); returns routers hooked
        per rank."""
        return self._command("record_routes", [(on,) for _ in self._procs])

    def recorded_routes(self) -> list[list[dict]]:
        """Per rank, its route records in call order ({layer, ids [rows, k] int16,
        in_flight})."""
        return self._command("recorded_routes", [() for _ in self._procs])

    def hf_parts(self):
        """The trained weights under HF names, one part at a time (embedding, each
        decoder layer, final norm / head; ``megatron_convert.megatron_parts``):
        yields (part, {HF name: tensor}), gathering each part from the ranks that
        own it only when asked, so the driver holds one part at a time.
        :attr:`last_sync` then has ``parts``, ``peak_part_bytes`` (the largest part's
        HF bytes) and ``total_bytes``."""
        from compass_kernels.integration.megatron.convert import (
            megatron_part_to_hf,
            megatron_parts,
        )

        self.last_sync = {"parts": 0, "peak_part_bytes": 0, "total_bytes": 0}
        for part in megatron_parts(self.hf_config):
            got: dict[str, torch.Tensor] = {}
            for share in self._command("weights", [(part,) for _ in self._procs]):
                for k, v in share.items():
                    if k in got:
                        raise RankError(f"two ranks own {k}")
                    got[k] = v
            hf = megatron_part_to_hf(got, self.hf_config, part)
            del got
            n = sum(t.numel() * t.element_size() for t in hf.values())
            self.last_sync["parts"] += 1
            self.last_sync["total_bytes"] += n
            self.last_sync["peak_part_bytes"] = max(self.last_sync["peak_part_bytes"], n)
            yield part, hf

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights under HF names, gathered from the ranks."""
        from compass_kernels.integration.megatron.convert import megatron_to_hf

        parts = self._command("weights", [() for _ in self._procs])
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                if k in full:
                    raise RankError(f"two ranks own {k}")
                full[k] = v
        return megatron_to_hf(full, self.hf_config)


# ---------------------------------------------------------------------------
# The loop's trainer interface over the ranks
# ---------------------------------------------------------------------------


def _per_micro_batch(plan: Any, dp_rank: int, values: np.ndarray,
                     sizes: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """(sequence indices, values) of each non-padding micro-batch of rank ``dp_rank``
    from one rank reply's per-sequence ``values``, concatenated over its micro-batches
    in order (``sizes``: each micro-batch's count there; a padding one has 1)."""
    for j, piece in enumerate(np.split(values, np.cumsum(sizes)[:-1])):
        idx = plan.micro_batch(dp_rank, j)
        if idx.numel():  # else a padding micro-batch
            yield idx, torch.from_numpy(piece)


class LoopTrainer:
    """What ``compass-rl`` calls a trainer (``pack``, ``old_policy_pass``,
    ``token_advantages``, ``train_step``, ``probe_logprobs``, ``hf_state_dict``),
    run by :class:`RankedTrainer` on ``layout.world_size`` processes.

    ``pack`` plans the ``dp`` ranks x micro-batches (the driver's packed view is
    for the loop's packing checks); the ranks receive only their shares of it
    (:func:`make_shares`). The step's per-token results stay on the ranks: the
    old-policy passes keep their log-probs and entropy there and return gap sums
    and per-sequence entropy maxima, the RL-ZVP token advantages are computed
    there from per-sequence inputs, and the train step reads both. The driver
    receives scalars and [sequences] tensors only; :attr:`rx_bytes` counts what
    it received (pickled replies) per command since ``pack``."""

    def __init__(self, model_dir: str | os.PathLike, layout: Layout, *, lr: float,
                 replay: bool = True, seed: int = 0) -> None:  # fmt: skip
        self.ranked = RankedTrainer(model_dir, layout, lr=lr, replay=replay, seed=seed)
        self.layout = layout
        self.use_replay = replay
        self.hf_config = self.ranked.hf_config
        self._data: StepData | None = None
        self._old = "replay" if replay else "native"  # the kept forward the loss reads
        self._rx_start: dict[str, int] = {}

    def close(self) -> None:
        self.ranked.close()

    @property
    def rx_bytes(self) -> dict[str, int]:
        """Bytes the driver received from the ranks since ``pack``, per command."""
        now = self.ranked.reply_bytes_total
        return {k: v - self._rx_start.get(k, 0) for k, v in now.items()
                if v > self._rx_start.get(k, 0)}  # fmt: skip

    def pack(self, batch: Any, *, dp_size: int, max_tokens: int):
        from compass_kernels.integration.rl.trainer import pack_batch

        if dp_size != self.layout.dp:
            raise ValueError(f"dp_size {dp_size} != the layout's dp {self.layout.dp}")
        # too few sequences for dp x M non-empty micro-batches: padding ones (plan_or_pad)
        self._data = self.ranked.plan(batch, max_tokens)
        pack = pack_batch(batch, self._data.plan)
        self._rx_start = dict(self.ranked.reply_bytes_total)
        return pack

    def old_policy_pass(self, pack: Any) -> dict:
        """Both no-grad passes (replayed and native routing), each kept on the
        ranks. Returns {"replay": replay stats per MoE layer, "gap_replay" /
        "gap_native": GapStats against the engine's log-probs, reduced from the
        ranks' sums}."""
        rep = self.ranked.forward(self._data, replay=True, keep="replay")
        nat = self.ranked.forward(self._data, replay=False, keep="native")
        self.bytes_forward = self.ranked.last_bytes["forward_stats"]
        return {"replay": rep["replay"], "gap_replay": rep["gap"], "gap_native": nat["gap"]}

    def token_advantages(self, pack: Any, rewards: torch.Tensor, zero_var: torch.Tensor,
                         advantages: torch.Tensor, *, alpha: float) -> torch.Tensor:  # fmt: skip
        """RL-ZVP token advantages on the ranks from the old policy's kept entropy
        (:meth:`RankedTrainer.token_advantages`); returns [n] bool per sequence."""
        return self.ranked.token_advantages(self._data, self._old, rewards, zero_var,
                                            advantages, alpha=alpha)  # fmt: skip

    def train_step(self, pack: Any, *, num_sequences: int, **espo_kwargs: Any) -> dict:
        """One optimizer step on the old policy's kept log-probs, entropy and token
        advantages (nothing per-token is sent)."""
        out = self.ranked.train(self._data, num_sequences=num_sequences, use_kept=self._old,
                                **espo_kwargs)  # fmt: skip
        sent = self.ranked.last_bytes["train"]
        out["bytes_rank_max"] = max(sent["per_rank"])
        out["bytes_full"] = sent["full"]
        out["bytes_driver_rx"] = sum(self.rx_bytes.values())
        return out

    def probe_logprobs(self, batch: Any) -> torch.Tensor:
        """Replayed log-probs of ``batch``'s masked tokens (sample order)."""
        import compass_kernels as ck

        plan = ck.packing.plan(batch.lengths, dp_size=self.layout.dp,
                               max_tokens=max(int(batch.lengths.max()), 1))  # fmt: skip
        fwd = self.ranked.forward(StepData(batch=batch, plan=plan), replay=True)
        return fwd["logprobs"][batch.mask]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.ranked.hf_state_dict()

    def hf_parts(self):
        """See :meth:`RankedTrainer.hf_parts` (the loop's layer-by-layer sync)."""
        return self.ranked.hf_parts()

    @property
    def last_sync(self) -> dict:
        return self.ranked.last_sync
