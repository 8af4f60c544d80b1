"""One trainer rank: its ``GPTModel`` chunk, router replay, optimizer and
Megatron's pipeline schedule, driven by the commands of its process
(:mod:`compass_kernels.integration.rl.rank_processes`).

The rank's model chunk comes from
:mod:`compass_kernels.integration.megatron.parallel`, a
:class:`~compass_kernels.integration.megatron.replay.TraceReplay` binds its
stage's MoE layers, and ``get_forward_backward_func`` runs 1F1B over ``pp``
stages with several micro-batches in flight. Each micro-batch reaches the model
packed (``ck.packing``'s THD layout, :mod:`compass_kernels.integration.rl.shares`):
the model gets ``PackedSeqParams(qkv_format="thd")``, so RoPE is Megatron's
per-sequence THD path and attention the per-sequence THD attention of
:mod:`compass_kernels.integration.megatron.thd_attention`. The last stage's loss
is the vocab-parallel ``fused_linear_espo_loss`` with the global batch's
sequence count and entropy boundaries, scaled as Megatron's schedule and DDP
expect (x num_microbatches x dp: the schedule divides by num_microbatches and
multiplies by cp, DDP averages over dp x cp), so the step does not depend on the
layout.

Per-token results stay here: a forward with ``keep=name`` keeps the log-probs
and entropy on the last stage and returns gap sums and per-sequence entropy
extrema; :meth:`RankWorker.token_advantages` computes and keeps RL-ZVP's token
advantages; ``train(use_kept=name)`` reads both and selects the entropy-group
boundaries among the last stage's ranks (:mod:`compass_kernels.integration.rl.quantile`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from compass_kernels.integration.megatron.parallel import Layout
from compass_kernels.integration.rl.shares import RankMicroBatch

__all__ = ["METRICS", "RankWorker"]

#: ESPO metrics reported per micro-batch (token-weighted means over the batch).
METRICS = ("clip_frac", "ratio_mean", "entropy_mean", "kl_k3")


class RankWorker:
    """One rank: its model chunk, replay, optimizer and Megatron's schedule.

    Runs inside a process where ``torch.distributed`` and Megatron's parallel
    state are initialized with ``layout``
    (:func:`~compass_kernels.integration.rl.rank_processes.rank_main`)."""

    def __init__(
        self,
        hf_config: Any,
        hf_state_dict: dict[str, torch.Tensor],
        layout: Layout,
        *,
        lr: float,
        replay: bool = True,
    ) -> None:
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
        self.tp_group = ps.get_tensor_model_parallel_group() if layout.tp > 1 else None
        self.cp_group = ps.get_context_parallel_group() if layout.cp > 1 else None

    @property
    def layers(self) -> list[int]:
        return self.replay.layers

    # -- one micro-batch ---------------------------------------------------------

    def _local(self, mb: RankMicroBatch):
        return mb.layout(self.layout, self.info.cp)

    def _forward_step(self, use_replay: bool, loss_fn):
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            lay = self._local(mb)
            tokens = mb.tokens[None] if mb.tokens is not None else None
            route = self.replay.micro_batch(mb.trace) if use_replay else self.replay.native()
            prev = model.post_process
            model.post_process = False  # hidden states: the fused path computes log-probs
            try:
                with route:
                    out = model(
                        tokens,
                        lay.pos[None],
                        attention_mask=None,
                        packed_seq_params=lay.packed.packed_seq_params(),
                    )
            finally:
                model.post_process = prev
            return out, functools.partial(loss_fn, mb, lay.cu, lay.real)

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

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(shares),
            model=[self.model],
            num_microbatches=len(shares),
            seq_length=max(self._local(mb).src.numel() for mb in shares),
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

    def forward(
        self, shares: list[RankMicroBatch], replay: bool = True, keep: str | None = None
    ) -> dict:
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
            return {
                "per_mb": [(d["logprobs"], d["entropy"]) for d in out]
                if last and self.info.tp == 0
                else None,
                "replay": counts,
            }
        # the results stay here (the train step reads them); the driver gets sums
        self._kept_shares[keep] = shares
        self.kept_advantages.pop(keep, None)
        self.kept[keep] = [(d["logprobs"], d["entropy"]) for d in out] if last else None
        if not (last and self.info.tp == 0):
            return {"per_mb": None, "replay": counts}
        from compass_kernels.integration.rl.batch import GapSums

        stats = [
            _forward_stats(
                mb, d["logprobs"], d["entropy"], self._local(mb).real, self._local(mb).seq
            )
            for mb, d in zip(shares, out, strict=True)
        ]
        # one reply for all micro-batches: the summed gap, the per-sequence values
        # concatenated in micro-batch order (numpy: a smaller pickle than tensors)
        per_seq = {k: torch.cat([st[k] for st in stats]).numpy() for k in ("ent_max", "ent_min")}
        gap = sum((st["gap"] for st in stats), GapSums())
        return {"per_mb": None, "replay": counts, "stats": {"gap": gap, **per_seq}}

    def entropy_histogram(
        self, keep: str, prefixes: torch.Tensor, shift: int, bits: int
    ) -> torch.Tensor:
        """Radix-select round (:func:`~compass_kernels.integration.rl.quantile.radix_histogram`)
        over the response-token entropies this rank kept (``keep``). Every rank of a
        last stage counts its copy (tensor-parallel ranks hold the same values);
        other stages count nothing."""
        from compass_kernels.integration.rl.quantile import radix_histogram

        kept = self.kept.get(keep)
        if kept is None:
            return torch.zeros(prefixes.numel(), 1 << bits, dtype=torch.int64)
        parts = zip(kept, self._kept_shares[keep], strict=True)
        vals = torch.cat([ent[mb.mask & self._local(mb).real].float() for (_, ent), mb in parts])
        return radix_histogram(vals, prefixes, shift, bits)

    def kept_entropy_quantiles(
        self, keep: str, levels: tuple[float, ...], num_tokens: int
    ) -> torch.Tensor:
        """Exact quantiles (torch.quantile's linear rule, as
        ``espo.loss.entropy_thresholds``) at ``levels`` of the ``num_tokens``
        response-token entropies the last stage kept under ``keep``, by a radix
        select (``quantile.distributed_quantiles``) whose histograms are all-reduced
        over this rank's data x context-parallel group: the ranks of the last
        stage at this tensor-parallel rank, which together hold every response
        token once. Collective over that group: every last-stage rank calls it."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from compass_kernels.integration.rl.quantile import distributed_quantiles

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
        :func:`~compass_kernels.integration.rl.batch.zvp_token_advantages`. Kept
        for :meth:`train` (``use_kept=keep``). Returns {"nonzero": [sum of n_mb]
        bool, the micro-batches' sequences in order (a token here has a nonzero
        advantage), tp rank 0 of a last stage only, else None}."""
        from compass_kernels.integration.rl.batch import zvp_token_advantages

        kept = self.kept.get(keep)
        if not self.info.last_stage:
            return {"nonzero": None}
        if kept is None or per_mb is None or len(per_mb) != len(kept):
            raise RuntimeError(
                f"token_advantages: no kept forward {keep!r} of "
                f"{0 if per_mb is None else len(per_mb)} micro-batches"
            )
        advs, flags = [], []
        for (_, ent), mb, sc in zip(kept, self._kept_shares[keep], per_mb, strict=True):
            lay = self._local(mb)
            adv, nz = zvp_token_advantages(
                ent,
                lay.seq,
                mb.mask & lay.real,
                sc["rewards"],
                sc["zero_var"],
                sc["advantages"],
                alpha=alpha,
                entropy_max=sc["entropy_max"],
            )
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

    def train(
        self,
        shares: list[RankMicroBatch],
        num_sequences: int,
        entropy_threshold: torch.Tensor | None,
        espo_kwargs: dict,
        kept_quantiles: tuple | None = None,
    ) -> dict:
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
            for mb, (lp, ent), kmb, adv in zip(
                shares, kept, self._kept_shares[use], advs, strict=True
            ):
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
                h,
                self.model.output_layer.weight,
                mb.targets,
                mb.old_logprobs,
                mb.old_entropy,
                mb.advantages,
                cu,
                mb.mask & real,
                num_sequences=num_sequences,
                advantages_per_token=True,
                tp_group=self.tp_group,
                cp_group=self.cp_group,
                **kwargs,
            )
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
            ),
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
            self._routes.append(
                {
                    "layer": layer,
                    "ids": ids.to(torch.int16).clone(),
                    "in_flight": len(self.replay._pending) + 1,
                }
            )

        for layer, router in find_moe_routers(self.model).items():
            self._route_hooks.append(router.register_forward_hook(functools.partial(hook, layer)))
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


def _forward_stats(
    mb: RankMicroBatch, lp: torch.Tensor, ent: torch.Tensor, real: torch.Tensor, seq: torch.Tensor
) -> dict:
    """What the driver needs of one micro-batch's forward on this rank: the gap
    sums (:class:`~compass_kernels.integration.rl.batch.GapSums`) of d = lp -
    infer over its response tokens and, per sequence of the micro-batch, the
    max / min response-token entropy of this rank's tokens (-inf / +inf where it
    holds none)."""
    from compass_kernels.integration.rl.batch import GapSums

    assert mb.mask is not None and mb.infer_logprobs is not None  # the last stage holds them
    m = mb.mask & real
    n = mb.lengths.numel()
    e = ent.double()
    emax = torch.full((n,), -math.inf, dtype=torch.float64)
    emin = torch.full((n,), math.inf, dtype=torch.float64)
    emax.scatter_reduce_(0, seq[m], e[m], "amax")
    emin.scatter_reduce_(0, seq[m], e[m], "amin")
    return {"gap": GapSums.of(lp[m], mb.infer_logprobs[m]), "ent_max": emax, "ent_min": emin}
