"""The training side of the reference RL loop: megatron-core on CPU with router
replay and the ESPO loss.

Layout of a step's batch (:class:`Batch`): the n sequences (prompt +
response) concatenated, per-token tensors over all T tokens in sample order:
token ids, next-token targets, the loss mask (response tokens only), the
engine's log-prob of each response token, and the sequence index. The
packing planner (``ck.packing.plan``) assigns sequences to ``dp`` ranks x
micro-batches under a token cap; each micro-batch is packed
(``ck.packing.pack``, THD layout: sequences back to back with cu_seqlens and
per-sequence positions) together with its routing rows
(``RoutingTrace.slice``: the same sequences in the same order, the last token
of each sequence a NO_ROW row) and, once known, its token advantages.

Megatron's local (non-TE) attention takes no PackedSeqParams, so a packed
micro-batch runs as one row of length T_mb with a block-diagonal causal mask;
RoPE depends only on the distance between query and key, so a sequence
attends exactly as it would alone (tested to 3e-6 against transformers).
Data-parallel ranks run one after another in this process: the ESPO loss of
every micro-batch uses the global sequence count G, so the summed gradients
are the mini-batch gradient that DDP would all-reduce. Megatron's pipeline
schedule allocates a CUDA tensor (``forward_backward_no_pipelining``), so the
micro-batch loop is ours, calling ``compass_kernels.integration.megatron.espo``'s loss
function with the scaling of a one-micro-batch schedule.

Log-probs and entropy come from the last hidden states through
``ck.espo.fused_linear_logprobs_entropy`` with the model's output-layer weight
(the model runs with ``post_process`` off, so Megatron builds no logits).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
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
    "Trainer",
    "gap_stats",
    "pack_gap_sums",
    "pack_token_advantages",
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
    attention_mask: torch.Tensor  # [1, 1, T, T] bool, True = masked
    old_logprobs: torch.Tensor | None = None  # the old policy of the loss (training routing)
    old_entropy: torch.Tensor | None = None
    replay_logprobs: torch.Tensor | None = None  # no-grad pass with router replay
    native_logprobs: torch.Tensor | None = None  # no-grad pass with native routing
    advantages: torch.Tensor | None = None

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
    some tokens: a whole batch on the driver, or one rank's share of a micro-batch.

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


def _block_causal_mask(cu: torch.Tensor, total: int) -> torch.Tensor:
    """[1, 1, T, T] bool, True where query t may NOT attend key s (other sequence or future)."""
    lens = cu.diff().to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    if seg.numel() != total:
        raise ValueError(f"cu_seqlens covers {seg.numel()} tokens, the micro-batch has {total}")
    ar = torch.arange(total)
    allowed = (seg[:, None] == seg[None, :]) & (ar[:, None] >= ar[None, :])
    return (~allowed)[None, None]


@dataclass
class PackInfo:
    plan: Any
    micro_batches: list[MicroBatch]
    seconds: float
    lost: int  # sequences of the batch in no micro-batch
    duplicated: int  # sequences in more than one place
    token_mismatch: int  # packed tokens that differ from the batch's after unpack
    stats: dict = field(default_factory=dict)


def pack_gap_sums(pack: PackInfo, name: str) -> GapSums:
    """:class:`GapSums` of the micro-batches' ``name`` log-probs (e.g.
    "replay_logprobs") against the engine's, over their response tokens."""
    total = GapSums()
    for mb in pack.micro_batches:
        m = mb.get("mask")
        total = total + GapSums.of(getattr(mb, name)[m], mb.get("infer_logprobs")[m])
    return total


def pack_token_advantages(pack: PackInfo, rewards: torch.Tensor, zero_var: torch.Tensor,
                          advantages: torch.Tensor, *, alpha: float) -> torch.Tensor:  # fmt: skip
    """RL-ZVP token advantages (:func:`zvp_token_advantages`) of every micro-batch
    from its ``old_entropy``, set as its ``advantages``. ``rewards``, ``zero_var``,
    ``advantages``: [n] per sequence of the batch. Returns [n] bool: the sequence
    has a token with a nonzero advantage."""
    n = int(rewards.numel())
    nonzero = torch.zeros(n, dtype=torch.bool)
    for mb in pack.micro_batches:
        idx = torch.as_tensor(mb.packed.indices, dtype=torch.int64)
        local = torch.full((n,), -1, dtype=torch.int64)
        local[idx] = torch.arange(idx.numel())
        adv, nz = zvp_token_advantages(
            mb.old_entropy, local[mb.get("seq_index")], mb.get("mask"), rewards[idx],
            zero_var[idx], advantages[idx], alpha=alpha,
        )  # fmt: skip
        mb.advantages = adv
        nonzero[idx] |= nz
    return nonzero


class Trainer:
    """A megatron-core ``GPTModel`` (float32, CPU) with router replay and an optimizer.

    Parameters
    ----------
    hf_config : transformers config of the checkpoint.
    hf_state_dict : its weights (HF names).
    lr : AdamW learning rate.
    replay : train with router replay (False: the ``--no-replay`` ablation).
    seed : Megatron's RNG seed.
    """

    def __init__(
        self,
        hf_config: Any,
        hf_state_dict: dict[str, torch.Tensor],
        *,
        lr: float = 1e-3,
        replay: bool = True,
        seed: int = 0,
    ) -> None:
        from compass_kernels.integration.cpu import megatron as megatron_cpu
        from compass_kernels.integration.megatron.convert import build_megatron_model
        from compass_kernels.integration.megatron.replay import TraceReplay

        megatron_cpu.init_single_process_gloo(seed=seed)
        self.hf_config = hf_config
        self.model = build_megatron_model(hf_config, hf_state_dict)
        self.vocab_size = int(hf_config.vocab_size)
        self.replay = TraceReplay(self.model)
        self.use_replay = replay
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0
        )

    def close(self) -> None:
        self.replay.remove()

    # -- weights ---------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainer's weights under HF checkpoint names (float32 copies)."""
        from compass_kernels.integration.megatron.convert import megatron_to_hf

        sd = {
            k: v.detach().clone()
            for k, v in self.model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }
        return megatron_to_hf(sd, self.hf_config)

    # -- packing -----------------------------------------------------------------

    def pack(self, batch: Batch, *, dp_size: int, max_tokens: int) -> PackInfo:
        """Plan ranks x micro-batches under the token cap and pack every micro-batch."""
        t0 = time.perf_counter()
        plan = ck.packing.plan(batch.lengths, dp_size=dp_size, max_tokens=max_tokens)
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
                        attention_mask=_block_causal_mask(pb.cu_seqlens, pb.local_tokens),
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

    # -- forward -----------------------------------------------------------------

    @contextlib.contextmanager
    def _hidden_only(self) -> Iterator[None]:
        """Run the GPTModel without its output layer (the fused path computes log-probs)."""
        prev = self.model.post_process
        self.model.post_process = False
        try:
            yield
        finally:
            self.model.post_process = prev

    def _routing(self, mb: MicroBatch, replay: bool):
        return self.replay.micro_batch(mb.trace) if replay else self.replay.native()

    def _logprobs(
        self, mb: MicroBatch, *, replay: bool, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = mb.get("tokens")[None]
        pos = mb.packed.position_ids[None]
        with self._hidden_only(), self._routing(mb, replay):
            hidden = self.model(tokens, pos, attention_mask=mb.attention_mask)
        hidden = hidden.reshape(tokens.shape[1], -1)
        weight = self.model.output_layer.weight
        return ck.espo.fused_linear_logprobs_entropy(
            hidden, weight, mb.get("targets"), with_entropy=with_entropy
        )

    def old_policy_pass(self, pack: PackInfo) -> dict:
        """No-grad passes before the update, per micro-batch: log-probs and entropy
        with router replay and with native routing (the side-by-side gap); the
        old policy of the loss is the one training routes with (replay unless
        ``--no-replay``). Returns {"replay": the replay stats per MoE layer,
        "gap_replay" / "gap_native": :class:`GapStats` of each pass against the
        engine's log-probs} (as ``LoopTrainer.old_policy_pass``)."""
        self.model.eval()
        self.replay.reset_stats()
        with torch.no_grad():
            for mb in pack.micro_batches:
                rep = self._logprobs(mb, replay=True, with_entropy=True)
                nat = self._logprobs(mb, replay=False, with_entropy=True)
                mb.replay_logprobs, mb.native_logprobs = rep[0], nat[0]
                mb.old_logprobs, mb.old_entropy = rep if self.use_replay else nat
        return {
            "replay": {layer: st.as_dict() for layer, st in self.replay.stats().items()},
            "gap_replay": pack_gap_sums(pack, "replay_logprobs").stats(),
            "gap_native": pack_gap_sums(pack, "native_logprobs").stats(),
        }

    def token_advantages(self, pack: PackInfo, rewards: torch.Tensor, zero_var: torch.Tensor,
                         advantages: torch.Tensor, *, alpha: float) -> torch.Tensor:  # fmt: skip
        """RL-ZVP token advantages into every micro-batch (see
        :func:`pack_token_advantages`); returns the per-sequence nonzero flags."""
        return pack_token_advantages(pack, rewards, zero_var, advantages, alpha=alpha)

    # -- update ------------------------------------------------------------------

    def train_step(self, pack: PackInfo, *, num_sequences: int, **espo_kwargs: Any) -> dict:
        """One optimizer step over every micro-batch of every rank (ESPO loss)."""
        from compass_kernels.integration.megatron.espo import EspoBatch, make_loss_func

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.replay.reset_stats()
        total_loss = 0.0
        sums: dict[str, float] = {}
        tokens = 0
        for mb in pack.micro_batches:
            if mb.advantages is None or mb.old_logprobs is None:
                raise RuntimeError("train_step: run old_policy_pass and set advantages first")
            lp, _ = self._logprobs(mb, replay=self.use_replay, with_entropy=False)
            espo = EspoBatch(
                cu_seqlens=mb.packed.cu_seqlens,
                old_logprobs=mb.old_logprobs,
                old_entropy=mb.old_entropy,
                advantages=mb.advantages,
                loss_mask=mb.get("mask"),
                num_sequences=num_sequences,
            )
            loss_func = make_loss_func(
                espo,
                num_microbatches=1,
                dp_size=1,
                vocab_size=self.vocab_size,
                advantages_per_token=True,
                **espo_kwargs,
            )
            loss, report = loss_func(-lp)
            loss.backward()
            total_loss += float(loss.detach())
            n = int(mb.get("mask").sum())
            tokens += n
            for key, value in report.items():
                sums[key] = sums.get(key, 0.0) + float(value) * n
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        out = {k.split("/", 1)[-1]: v / max(tokens, 1) for k, v in sums.items()}
        out["loss"] = total_loss
        out["grad_norm"] = grad_norm
        out["replay"] = {layer: st.as_dict() for layer, st in self.replay.stats().items()}
        return out
