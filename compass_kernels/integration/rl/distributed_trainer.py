"""The trainer on real ranks, driver side: ``tp * pp * cp * dp`` rank processes
(:mod:`compass_kernels.integration.rl.rank_processes`), each fed only its share
of the step (:mod:`compass_kernels.integration.rl.shares`), their answers
reduced here.

:class:`DistributedTrainer` plans the step's micro-batches (``ck.packing.plan``
over ``dp`` ranks), sends each rank its micro-batches, and turns the ranks'
replies into the step's results: per-token log-probs and entropy in sample
order (:meth:`~DistributedTrainer.forward`), or, with the results kept on the
ranks, gap statistics and per-sequence entropy extrema; RL-ZVP's per-sequence
flags (:meth:`~DistributedTrainer.token_advantages`); the train step's loss,
metrics, global grad norm and replay statistics; the trained weights under HF
names, whole or part by part.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from compass_kernels.integration.megatron.parallel import Layout, RankInfo
from compass_kernels.integration.rl.rank_processes import RankError, RankProcesses
from compass_kernels.integration.rl.rank_worker import METRICS
from compass_kernels.integration.rl.shares import (
    RankMicroBatch,
    StepData,
    full_broadcast_bytes,
    global_rows,
    make_shares,
    per_micro_batch,
    plan_or_pad,
    share_bytes,
)

__all__ = ["DistributedTrainer"]


class DistributedTrainer:
    """The driver's handle on ``layout.world_size`` trainer processes.

    Parameters
    ----------
    model_dir : HF checkpoint folder every rank loads (its own slices).
    layout : the parallel sizes.
    lr : AdamW learning rate.
    replay : train with router replay (False: the ``--no-replay`` ablation).
    seed : Megatron's RNG seed.
    timeout : seconds to wait for any one command on all ranks.
    device : where the ranks run (``rank_processes.DEVICES``).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        layout: Layout,
        *,
        lr: float = 1e-3,
        replay: bool = True,
        seed: int = 0,
        timeout: float = 600.0,
        device: str = "cpu",
    ) -> None:
        from transformers import AutoConfig

        self.model_dir = str(Path(model_dir))
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.layout = layout.check(self.hf_config)
        self.use_replay = replay
        self.vocab_size = int(self.hf_config.vocab_size)
        self.ranks = RankProcesses(
            self.model_dir,
            self.layout,
            lr=lr,
            replay=replay,
            seed=seed,
            timeout=timeout,
            device=device,
        )
        self.infos: list[RankInfo] = [v[0] for v in self.ranks.ready]
        self.stage_layers: list[list[int]] = [v[1] for v in self.ranks.ready]
        self.last_bytes: dict[str, Any] = {}
        self._kept: dict[str, Any] = {}  # name -> the plan of the forward kept under it
        self._kept_seq_max: dict[str, torch.Tensor] = {}  # name -> [n] response entropy max
        self._kept_adv: set[str] = set()  # names the ranks hold token advantages under

    @property
    def last_reply_bytes(self) -> dict[str, list[int]]:
        """Per command, what each rank sent back for its last call (pickled bytes)."""
        return self.ranks.last_reply_bytes

    @property
    def reply_bytes_total(self) -> dict[str, int]:
        """Per command, the bytes all ranks sent back since the start."""
        return self.ranks.reply_bytes_total

    def _command(self, cmd: str, per_rank_args: list[tuple]) -> list[Any]:
        return self.ranks.command(cmd, per_rank_args)

    def _everyone(self, cmd: str, *args: Any) -> list[Any]:
        return self._command(cmd, [args] * len(self.ranks))

    def close(self) -> None:
        self.ranks.close()

    # -- steps -----------------------------------------------------------------------

    def plan(self, batch: Any, max_tokens: int, *, empty: str = "pad") -> StepData:
        """The step's packing plan over ``layout.dp`` ranks (``ck.packing.plan``).

        ``empty``: what to do when the planner cannot give every rank the same
        number of non-empty micro-batches (fewer sequences than dp x micro-batches):
        "pad" (default) plans on one rank and deals its micro-batches out over the
        dp ranks, the ranks short of micro-batches running zero-token padding ones
        (they keep the schedule's collectives in step and add 0 to loss and
        gradients); "error" re-raises the planner's error."""
        return StepData(
            batch=batch, plan=plan_or_pad(batch.lengths, self.layout.dp, max_tokens, empty=empty)
        )

    def _scatter(self, data: StepData, what: str, replay: bool) -> list[list[RankMicroBatch]]:
        shares = make_shares(
            data, self.layout, self.infos, self.stage_layers, what=what, replay=replay
        )
        sent = share_bytes(shares)
        self.last_bytes[what] = {"per_rank": sent, "full": full_broadcast_bytes(data, what)}
        return shares

    def _assemble(self, data: StepData, results: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropy in sample order from the last stages."""
        batch, plan = data.batch, data.plan
        T = batch.num_tokens
        lp, ent = torch.zeros(T), torch.zeros(T)
        seen = torch.zeros(T, dtype=torch.int64)
        for info, res in zip(self.infos, results, strict=True):
            if res["per_mb"] is None:
                continue
            for j, (l_mb, e_mb) in enumerate(res["per_mb"]):
                idx = plan.micro_batch(info.dp, j).numpy()
                if idx.size == 0:
                    continue  # a padding micro-batch
                rows = global_rows(batch, idx, self.layout, info.cp)
                real = rows >= 0
                where = rows[real]
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
        driver receives only: ``gap`` (a :class:`~compass_kernels.integration.rl.batch.GapStats`
        of d = log-prob - engine log-prob over the response tokens; needs
        ``batch.infer_logprobs``) and, per sequence (sample order), ``seq_entropy_max``
        / ``seq_entropy_min`` [n] float64 of its response tokens (RL-ZVP's inputs)."""
        if keep is None:
            shares = self._scatter(data, "forward", replay)
            results = self._command("forward", [(s, replay) for s in shares])
            lp, ent = self._assemble(data, results)
            return {"logprobs": lp, "entropy": ent, "replay": self._replay_dicts(results)}
        shares = self._scatter(data, "forward_stats", replay)
        results = self._command("forward", [(s, replay, keep) for s in shares])
        self._kept[keep] = data.plan
        self._kept_adv.discard(keep)  # the ranks dropped advantages kept under this name
        out = self._reduce_stats(data, shares, results)
        self._kept_seq_max[keep] = out["seq_entropy_max"]
        return {**out, "replay": self._replay_dicts(results)}

    def _reduce_stats(
        self, data: StepData, shares: list[list[RankMicroBatch]], results: list[dict]
    ) -> dict:
        import math

        from compass_kernels.integration.rl.batch import GapSums

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
            for idx, hi in per_micro_batch(data.plan, info.dp, st["ent_max"], sizes):
                emax[idx] = torch.maximum(emax[idx], hi)
            for idx, lo in per_micro_batch(data.plan, info.dp, st["ent_min"], sizes):
                emin[idx] = torch.minimum(emin[idx], lo)
        return {"gap": total.stats(), "seq_entropy_max": emax, "seq_entropy_min": emin}

    def token_advantages(
        self,
        data: StepData,
        keep: str,
        rewards: torch.Tensor,
        zero_var: torch.Tensor,
        advantages: torch.Tensor,
        *,
        alpha: float,
    ) -> torch.Tensor:
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
        assert plan is not None  # a kept forward's plan
        n = data.batch.num_sequences
        for name, t in (("rewards", rewards), ("zero_var", zero_var), ("advantages", advantages)):
            if t.shape != (n,):
                raise ValueError(f"{name}: expected [{n}] (one per sequence), got {tuple(t.shape)}")
        emax = self._kept_seq_max[keep]
        args, sent = [], []
        for info in self.infos:
            per_mb = None
            if info.last_stage:
                per_mb = []
                for j in range(plan.num_micro_batches):
                    idx = plan.micro_batch(info.dp, j)
                    if idx.numel() == 0:  # a padding micro-batch: one empty sequence
                        per_mb.append(
                            {
                                "rewards": rewards.new_zeros(1),
                                "zero_var": torch.zeros(1, dtype=torch.bool),
                                "advantages": advantages.new_zeros(1),
                                "entropy_max": emax.new_zeros(1),
                            }
                        )
                        continue
                    per_mb.append(
                        {
                            "rewards": rewards[idx],
                            "zero_var": zero_var[idx],
                            "advantages": advantages[idx],
                            "entropy_max": emax[idx],
                        }
                    )
            args.append((keep, per_mb, float(alpha)))
            sent.append(sum(t.numel() * t.element_size() for d in per_mb or [] for t in d.values()))
        self.last_bytes["token_advantages"] = {"per_rank": sent}
        results = self._command("token_advantages", args)
        nonzero = torch.zeros(n, dtype=torch.bool)
        for info, (_, per_mb, _), res in zip(self.infos, args, results, strict=True):
            if res["nonzero"] is None:
                continue
            sizes = [d["rewards"].numel() for d in per_mb]
            for idx, nz in per_micro_batch(plan, info.dp, res["nonzero"], sizes):
                nonzero[idx] |= nz
        self._kept_adv.add(keep)
        return nonzero

    def kept_values(self, data: StepData, keep: str) -> dict:
        """Checks only (it gathers what the step keeps on the ranks): the log-probs,
        entropy and token advantages kept under ``keep``, sample order [T] each
        (advantages None before :meth:`token_advantages`)."""
        if self._kept.get(keep) is not data.plan:
            raise ValueError(f"kept_values: keep={keep!r} names no forward of this plan")
        results = self._everyone("kept_values", keep)

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
        (``RankWorker.kept_entropy_quantiles``). The result's ``entropy_threshold``
        is the boundaries the loss used ([Q] float64 or None)."""
        from compass_kernels.espo import loss_config
        from compass_kernels.espo.loss import entropy_thresholds

        cfg = loss_config.resolve(
            **{k: v for k, v in espo_kwargs.items() if k not in ("entropy_threshold", "use_kept")},
            vocab_size=self.vocab_size,
        )
        thr = espo_kwargs.pop("entropy_threshold", None)
        use = espo_kwargs.get("use_kept")
        if (data.old_logprobs is None) != (data.old_entropy is None) or (
            data.old_logprobs is None and use is None
        ):
            raise ValueError(
                "train: give data.old_logprobs and old_entropy, or use_kept=<name> "
                "of a forward(keep=<name>) of this batch"
            )
        if use is not None and self._kept.get(use) is not data.plan:
            raise ValueError(f"train: use_kept={use!r} names no forward of this step's plan")
        if data.advantages is None and use not in self._kept_adv:
            raise ValueError(
                "train: give data.advantages, or use_kept=<name> after "
                "token_advantages(data, <name>, ...)"
            )
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
        results = self._command(
            "train", [(s, num_sequences, thr, espo_kwargs, kept_q) for s in shares]
        )
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
        out: dict[str, Any] = {k: v / max(tokens, 1) for k, v in sums.items()}
        out["loss"] = loss
        out["grad_norm"] = results[0]["grad_norm"]
        # the entropy-group boundaries the loss used ([Q]; None: one group)
        thr = next(
            (r["entropy_threshold"] for r in results if r["entropy_threshold"] is not None), None
        )
        out["entropy_threshold"] = None if thr is None else torch.tensor(thr, dtype=torch.float64)
        out["replay"] = self._replay_dicts(results)
        return out

    def record_routes(self, on: bool = True) -> list[int]:
        """Every rank records (``on``) the expert ids its MoE layers dispatch with,
        per forward (see ``RankWorker.record_routes``); returns routers hooked per
        rank."""
        return self._everyone("record_routes", on)

    def recorded_routes(self) -> list[list[dict]]:
        """Per rank, its route records in call order ({layer, ids [rows, k] int16,
        in_flight})."""
        return self._everyone("recorded_routes")

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
            got = _merge_owned(self._everyone("weights", part))
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

        return megatron_to_hf(_merge_owned(self._everyone("weights")), self.hf_config)


def _merge_owned(shares: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One dict of the ranks' owned tensors; a name two ranks own is an error."""
    full: dict[str, torch.Tensor] = {}
    for share in shares:
        for k, v in share.items():
            if k in full:
                raise RankError(f"two ranks own {k}")
            full[k] = v
    return full
