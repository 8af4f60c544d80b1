"""The trainer interface ``compass-rl`` calls (``pack``, ``old_policy_pass``,
``token_advantages``, ``train_step``, ``probe_logprobs``, ``hf_parts``), over a
:class:`~compass_kernels.integration.rl.distributed_trainer.DistributedTrainer`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from compass_kernels.integration.megatron.parallel import Layout
from compass_kernels.integration.rl.distributed_trainer import DistributedTrainer
from compass_kernels.integration.rl.shares import StepData

__all__ = ["LoopAdapter"]


class LoopAdapter:
    """What ``compass-rl`` calls a trainer, run by a :class:`DistributedTrainer`
    on ``layout.world_size`` processes.

    ``pack`` plans the ``dp`` ranks x micro-batches (the driver's packed view is
    for the loop's packing checks); the ranks receive only their shares of it.
    The step's per-token results stay on the ranks: the old-policy passes keep
    their log-probs and entropy there and return gap sums and per-sequence
    entropy maxima, the RL-ZVP token advantages are computed there from
    per-sequence inputs, and the train step reads both. The driver receives
    scalars and [sequences] tensors only; :attr:`rx_bytes` counts what it
    received (pickled replies) per command since ``pack``."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        layout: Layout,
        *,
        lr: float,
        replay: bool = True,
        seed: int = 0,
    ) -> None:
        self.distributed = DistributedTrainer(model_dir, layout, lr=lr, replay=replay, seed=seed)
        self.layout = layout
        self.use_replay = replay
        self.hf_config = self.distributed.hf_config
        self._data: StepData | None = None
        self._old = "replay" if replay else "native"  # the kept forward the loss reads
        self._rx_start: dict[str, int] = {}

    def close(self) -> None:
        self.distributed.close()

    @property
    def rx_bytes(self) -> dict[str, int]:
        """Bytes the driver received from the ranks since ``pack``, per command."""
        now = self.distributed.reply_bytes_total
        return {
            k: v - self._rx_start.get(k, 0) for k, v in now.items() if v > self._rx_start.get(k, 0)
        }

    def pack(self, batch: Any, *, dp_size: int, max_tokens: int):
        from compass_kernels.integration.rl.batch import pack_batch

        if dp_size != self.layout.dp:
            raise ValueError(f"dp_size {dp_size} != the layout's dp {self.layout.dp}")
        # too few sequences for dp x M non-empty micro-batches: padding ones (plan_or_pad)
        self._data = self.distributed.plan(batch, max_tokens)
        pack = pack_batch(batch, self._data.plan)
        self._rx_start = dict(self.distributed.reply_bytes_total)
        return pack

    def old_policy_pass(self, pack: Any) -> dict:
        """Both no-grad passes (replayed and native routing), each kept on the
        ranks. Returns {"replay": replay stats per MoE layer, "gap_replay" /
        "gap_native": GapStats against the engine's log-probs, reduced from the
        ranks' sums}."""
        assert self._data is not None, "pack() first"
        rep = self.distributed.forward(self._data, replay=True, keep="replay")
        nat = self.distributed.forward(self._data, replay=False, keep="native")
        self.bytes_forward = self.distributed.last_bytes["forward_stats"]
        return {"replay": rep["replay"], "gap_replay": rep["gap"], "gap_native": nat["gap"]}

    def token_advantages(
        self,
        pack: Any,
        rewards: torch.Tensor,
        zero_var: torch.Tensor,
        advantages: torch.Tensor,
        *,
        alpha: float,
    ) -> torch.Tensor:
        """RL-ZVP token advantages on the ranks from the old policy's kept entropy
        (:meth:`DistributedTrainer.token_advantages`); returns [n] bool per sequence."""
        assert self._data is not None, "pack() first"
        return self.distributed.token_advantages(
            self._data, self._old, rewards, zero_var, advantages, alpha=alpha
        )

    def train_step(self, pack: Any, *, num_sequences: int, **espo_kwargs: Any) -> dict:
        """One optimizer step on the old policy's kept log-probs, entropy and token
        advantages (nothing per-token is sent)."""
        assert self._data is not None, "pack() first"
        out = self.distributed.train(
            self._data, num_sequences=num_sequences, use_kept=self._old, **espo_kwargs
        )
        sent = self.distributed.last_bytes["train"]
        out["bytes_rank_max"] = max(sent["per_rank"])
        out["bytes_full"] = sent["full"]
        out["bytes_driver_rx"] = sum(self.rx_bytes.values())
        return out

    def probe_logprobs(self, batch: Any) -> torch.Tensor:
        """Replayed log-probs of ``batch``'s masked tokens (sample order)."""
        import compass_kernels as ck

        plan = ck.packing.plan(
            batch.lengths, dp_size=self.layout.dp, max_tokens=max(int(batch.lengths.max()), 1)
        )
        fwd = self.distributed.forward(StepData(batch=batch, plan=plan), replay=True)
        return fwd["logprobs"][batch.mask]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.distributed.hf_state_dict()

    def hf_parts(self):
        """See :meth:`DistributedTrainer.hf_parts` (the loop's layer-by-layer sync)."""
        return self.distributed.hf_parts()

    @property
    def last_sync(self) -> dict:
        return self.distributed.last_sync
