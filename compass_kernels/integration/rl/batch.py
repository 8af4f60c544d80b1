"""The step's batch as the reference RL loop's driver sees it, and the per-token
statistics both the driver and the trainer ranks (``rl/rank_worker.py``) compute.

Layout of a step's batch (:class:`Batch`): the n sequences (prompt +
response) concatenated, per-token tensors over all T tokens in sample order:
token ids, next-token targets, the loss mask (response tokens only), the
engine's log-prob of each response token, and the sequence index.
:func:`pack_batch` plans ``dp`` ranks x micro-batches under a token cap
(``ck.packing.plan``) and packs each (``ck.packing.pack``, THD layout) with its
routing rows (``RoutingTrace.slice``), checking that nothing was lost, duplicated
or mixed up; the ranks receive only their shares of that plan.

:class:`GapSums` (trainer vs engine log-prob gaps as additive sums) and
:func:`zvp_token_advantages` (RL-ZVP token advantages of a share of the sequences
given each sequence's maximum entropy) are the one copy of that math: the ranks
run them on what they hold, tests on gathered tensors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import compass_kernels as ck
from compass_kernels.routing import RoutingTrace

__all__ = [
    "Batch",
    "GapStats",
    "GapSums",
    "MicroBatch",
    "PackInfo",
    "gap_stats",
    "pack_batch",
    "zvp_token_advantages",
]


@dataclass
class Batch:
    """One step's sequences as per-token tensors in sample order (see module doc)."""

    lengths: np.ndarray  # [n] int64 tokens per sequence (prompt + response)
    prompt_lens: np.ndarray  # [n]
    tokens: torch.Tensor  # [T] int64
    targets: torch.Tensor  # [T] int64 (0 where there is no next token)
    mask: torch.Tensor  # [T] bool: the position predicts a response token
    infer_logprobs: torch.Tensor  # [T] float32: engine log-prob of the target (0 off-mask)
    seq_index: torch.Tensor  # [T] int64
    trace: RoutingTrace  # all sequences, rows = lengths - 1

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @staticmethod
    def from_samples(samples: Sequence[Any]) -> Batch:
        """From rollout samples (``compass_kernels.integration.rl.rollout.Sample``) with traces."""
        toks, tgts, masks, lps, seq = [], [], [], [], []
        lengths, plens = [], []
        for i, s in enumerate(samples):
            p, r = len(s.prompt.token_ids), len(s.response)
            if r == 0:
                raise ValueError(f"sample {i}: empty response (nothing to train on)")
            ids = torch.tensor(s.tokens, dtype=torch.int64)
            n = ids.numel()
            tgt = torch.zeros(n, dtype=torch.int64)
            tgt[:-1] = ids[1:]
            m = torch.zeros(n, dtype=torch.bool)
            m[p - 1 : n - 1] = True
            lp = torch.zeros(n, dtype=torch.float32)
            lp[p - 1 : n - 1] = torch.from_numpy(s.logprobs)
            if s.trace is None or s.trace.num_tokens != n - 1:
                rows = None if s.trace is None else s.trace.num_tokens
                raise ValueError(
                    f"sample {i}: routing trace with {rows} rows, expected {n - 1} "
                    "(prompt + response - 1)"
                )
            toks.append(ids)
            tgts.append(tgt)
            masks.append(m)
            lps.append(lp)
            seq.append(torch.full((n,), i, dtype=torch.int64))
            lengths.append(n)
            plens.append(p)
        return Batch(
            lengths=np.array(lengths, dtype=np.int64),
            prompt_lens=np.array(plens, dtype=np.int64),
            tokens=torch.cat(toks),
            targets=torch.cat(tgts),
            mask=torch.cat(masks),
            infer_logprobs=torch.cat(lps),
            seq_index=torch.cat(seq),
            trace=RoutingTrace.concat([s.trace for s in samples]),
        )


@dataclass
class MicroBatch:
    """One packed micro-batch of one data-parallel rank."""

    rank: int
    index: int
    packed: Any  # ck.packing.PackedBatch
    trace: RoutingTrace  # rows in packed token order

    def get(self, name: str) -> torch.Tensor:
        return self.packed.tensors[name]


@dataclass
class GapStats:
    """Train-vs-inference log-prob gap over response tokens (d = l_train - l_infer)."""

    mean_abs: float
    k3: float  # mean of exp(d) - 1 - d (k3 estimate of KL(infer || train))
    frac_gt_ln2: float  # fraction of tokens with |d| > ln 2
    max_abs: float
    tokens: int


@dataclass
class GapSums:
    """Additive partial sums of the gap d = l_train - l_infer over some tokens (one
    rank's, one micro-batch's): ``a + b`` is the sums over both token sets, and
    :meth:`stats` the :class:`GapStats` of all of them. Sums in float64."""

    tokens: int = 0
    abs_sum: float = 0.0  # sum |d|
    k3_sum: float = 0.0  # sum expm1(d) - d
    gt_ln2: int = 0  # count |d| > ln 2
    max_abs: float = 0.0  # max |d| (0 over no token)

    @staticmethod
    def of(train_lp: torch.Tensor, infer_lp: torch.Tensor) -> GapSums:
        """Sums over the tokens of ``train_lp`` / ``infer_lp`` ([N] float each)."""
        if train_lp.shape != infer_lp.shape or train_lp.dim() != 1:
            raise ValueError(
                f"train_lp / infer_lp: expected two [N] tensors, got {tuple(train_lp.shape)} "
                f"and {tuple(infer_lp.shape)}"
            )
        d = train_lp.double() - infer_lp.double()
        a = d.abs()
        return GapSums(
            tokens=int(d.numel()),
            abs_sum=float(a.sum()),
            k3_sum=float((torch.expm1(d) - d).sum()),
            gt_ln2=int((a > math.log(2)).sum()),
            max_abs=float(a.max()) if d.numel() else 0.0,
        )

    def __add__(self, other: GapSums) -> GapSums:
        return GapSums(
            self.tokens + other.tokens,
            self.abs_sum + other.abs_sum,
            self.k3_sum + other.k3_sum,
            self.gt_ln2 + other.gt_ln2,
            max(self.max_abs, other.max_abs),
        )

    def stats(self) -> GapStats:
        """Means over the tokens summed (NaN, 0 tokens where there were none)."""
        n = self.tokens
        if n == 0:
            return GapStats(float("nan"), float("nan"), float("nan"), float("nan"), 0)
        return GapStats(self.abs_sum / n, self.k3_sum / n, self.gt_ln2 / n, self.max_abs, n)


def gap_stats(train_lp: torch.Tensor, infer_lp: torch.Tensor) -> GapStats:
    """:class:`GapStats` of d = train_lp - infer_lp ([N] float each), in float64."""
    return GapSums.of(train_lp, infer_lp).stats()


def zvp_token_advantages(
    entropy: torch.Tensor,
    seq: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    zero_var: torch.Tensor,
    advantages: torch.Tensor,
    *,
    alpha: float,
    entropy_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RL-ZVP token advantages (``ck.advantages.rl_zvp``) of the response tokens of
    some tokens: one rank's share of a micro-batch, or a whole gathered batch.

    entropy : [T] float old-policy entropy (read as float32, as rl_zvp does).
    seq : [T] int64 sequence of each token, in 0..n-1 (any order).
    mask : [T] bool response tokens (the others get 0).
    rewards, advantages : [n] float; zero_var : [n] bool (rl_zvp's per-sequence inputs).
    entropy_max : [n] float, each sequence's largest response-token entropy over
        all of its tokens, for callers that hold only some of a sequence's tokens
        (a context-parallel rank); None: the tokens here are whole sequences.

    rl_zvp's one per-sequence statistic is that max (the negative branch
    -alpha * (max_k H_k - H_t)). Given ``entropy_max``, each sequence's segment
    gets one extra token holding it, so rl_zvp's own max is the global one
    (>= every local value, and exact: a max is order-free), and the extra
    tokens are dropped: the result equals rl_zvp over the whole sequences
    bitwise.

    Returns (token advantages [T] float32, 0 off the mask; nonzero [n] bool:
    the sequence has a token here with a nonzero advantage)."""
    import compass_kernels as ck

    n = int(rewards.numel())
    pos = mask.nonzero().reshape(-1)
    s = seq[pos]
    order = torch.argsort(s, stable=True)
    pos, s = pos[order], s[order]
    h = entropy[pos].float()
    counts = torch.bincount(s, minlength=n)
    if counts.numel() != n:
        raise ValueError(
            f"seq: expected values in 0..{n - 1} (n = len(rewards)), got {int(s.max())}"
        )
    extra = None
    if entropy_max is not None:
        if entropy_max.shape != (n,):
            raise ValueError(f"entropy_max: expected [{n}], got {tuple(entropy_max.shape)}")
        at = torch.cumsum(counts, 0) + torch.arange(n)  # each segment's extra slot
        extra = torch.zeros(h.numel() + n, dtype=torch.bool)
        extra[at] = True
        aug = torch.empty(h.numel() + n, dtype=torch.float32)
        # a sequence with no token here: its extra token is the whole segment, unread
        aug[extra] = torch.where(counts > 0, entropy_max.float(), 0.0)
        aug[~extra] = h
        h, counts = aug, counts + 1
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(counts, 0)
    tok = ck.advantages.rl_zvp(h, cu, rewards, zero_var, alpha=alpha, advantages=advantages)
    if extra is not None:
        tok = tok[~extra]
    out = torch.zeros(entropy.shape[0], dtype=torch.float32)
    out[pos] = tok
    nonzero = torch.zeros(n, dtype=torch.bool)
    nonzero.index_put_((s,), tok != 0, accumulate=True)
    return out, nonzero


@dataclass
class PackInfo:
    plan: Any
    micro_batches: list[MicroBatch]
    seconds: float
    lost: int  # sequences of the batch in no micro-batch
    duplicated: int  # sequences in more than one place
    token_mismatch: int  # packed tokens that differ from the batch's after unpack
    stats: dict = field(default_factory=dict)


def pack_batch(batch: Batch, plan: Any) -> PackInfo:
    """Pack every micro-batch of ``plan`` (a ``ck.packing`` plan of ``batch``'s
    sequences; an empty micro-batch of a padded plan is left out) with its routing rows;
    counts what the packing lost, duplicated or mixed up (the loop's packing checks:
    each must be 0)."""
    t0 = time.perf_counter()
    tensors = {
        "tokens": batch.tokens,
        "targets": batch.targets,
        "mask": batch.mask,
        "infer_logprobs": batch.infer_logprobs,
        "seq_index": batch.seq_index,
    }
    mbs = []
    seen = np.zeros(batch.num_sequences, dtype=np.int64)
    mismatch = 0
    for r in range(plan.dp_size):
        for j in range(plan.num_micro_batches):
            idx = plan.micro_batch(r, j).numpy()
            if idx.size == 0:
                continue
            seen[idx] += 1
            pb = ck.packing.pack(tensors, batch.lengths, idx)
            trace = batch.trace.slice(sequences=idx.tolist(), token_lens=batch.lengths[idx])
            # The packed sequences are exactly the batch's (nothing lost, moved or mixed up).
            back = ck.packing.unpack(pb.tensors["tokens"], pb)
            want = torch.cat([batch.tokens[batch.seq_index == i] for i in idx])
            mismatch += int((back != want).sum())
            sid = pb.tensors["seq_index"]
            expect = torch.repeat_interleave(
                torch.as_tensor(idx), torch.as_tensor(batch.lengths[idx])
            )
            mismatch += int((sid != expect).sum())
            mbs.append(
                MicroBatch(
                    rank=r,
                    index=j,
                    packed=pb,
                    trace=trace,
                )
            )
    st = plan.stats
    stats = {
        "dp_size": plan.dp_size,
        "micro_batches": plan.num_micro_batches,
        "utilization": float(st["utilization"]),
        "imbalance": float(st["imbalance"]),
        "max_mb_tokens": int(st["max_mb_tokens"]),
    }
    return PackInfo(
        plan=plan,
        micro_batches=mbs,
        seconds=time.perf_counter() - t0,
        lost=int((seen == 0).sum()),
        duplicated=int((seen > 1).sum()),
        token_mismatch=mismatch,
        stats=stats,
    )
