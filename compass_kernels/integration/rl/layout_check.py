"""The layout-invariance check: one training step of a fixed batch on a parallel
layout against the same step in one process (the test harness of
``tests/integration/test_ranks.py`` and ``make test-ranks``).

:func:`synthetic_batch` builds a deterministic batch (random prompts and
responses, a routing trace of random expert sets, advantages); :func:`run_step`
runs a forward pass and one optimizer step on a layout and returns what the
comparison needs: the forward log-probs, loss, grad norm, the updated weights
under HF names, the replay statistics and the bytes each rank received.
:func:`driver_bytes` (``python -m compass_kernels.integration.rl.layout_check``)
counts what the driver receives from the ranks in ``compass-rl``'s step, with the
per-token results kept on the ranks against gathering them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compass_kernels.integration.megatron.parallel import Layout

__all__ = ["StepResult", "compare", "driver_bytes", "run_step", "synthetic_batch"]


def synthetic_batch(
    hf_config: Any, *, num_sequences: int = 8, seed: int = 0, min_len: int = 6, max_len: int = 24
):
    """(Batch, per-token advantages): ``num_sequences`` sequences of random
    length in [min_len, max_len] (prompt 3..5 tokens), uniform random expert
    sets per MoE layer, advantages of both signs per prompt group of 2."""
    from compass_kernels.integration.rl.batch import Batch
    from compass_kernels.routing import RoutingTrace

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    V, L = int(hf_config.vocab_size), int(hf_config.num_hidden_layers)
    E, K = int(hf_config.num_experts), int(hf_config.num_experts_per_tok)
    lengths = rng.integers(min_len, max_len + 1, num_sequences).astype(np.int64)
    prompts = rng.integers(3, 6, num_sequences).astype(np.int64)
    toks, tgts, masks, seq = [], [], [], []
    for i, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        ids = torch.randint(0, V, (int(n),), generator=g)
        tgt = torch.zeros(int(n), dtype=torch.int64)
        tgt[:-1] = ids[1:]
        m = torch.zeros(int(n), dtype=torch.bool)
        m[p - 1 : n - 1] = True
        toks.append(ids)
        tgts.append(tgt)
        masks.append(m)
        seq.append(torch.full((int(n),), i, dtype=torch.int64))
    rows = int((lengths - 1).sum())
    ids = torch.stack(
        [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]) for _ in range(rows)]
    ).to(torch.uint8)
    cu = torch.zeros(num_sequences + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.from_numpy(lengths - 1), 0)
    trace = RoutingTrace(ids, cu, E, layer_ids=range(L))
    mask = torch.cat(masks)
    batch = Batch(
        lengths=lengths,
        prompt_lens=prompts,
        tokens=torch.cat(toks),
        targets=torch.cat(tgts),
        mask=mask,
        infer_logprobs=torch.zeros(mask.shape[0]),
        seq_index=torch.cat(seq),
        trace=trace,
    )
    seq_adv = torch.randn(num_sequences, generator=g)
    adv = torch.where(mask, seq_adv[batch.seq_index], 0.0)
    return batch, adv


@dataclass
class StepResult:
    layout: Layout
    logprobs: torch.Tensor  # forward (replay) log-probs, sample order
    entropy: torch.Tensor
    loss: float
    grad_norm: float
    weights: dict[str, torch.Tensor]  # HF names, after the step
    replay: dict[int, dict]
    bytes_per_rank: list[int]
    bytes_full: int
    seconds: float
    parts_equal: bool = False  # hf_parts() (layer by layer) == hf_state_dict(), bitwise
    sync: dict | None = None  # DistributedTrainer.last_sync of that gather


def run_step(
    model_dir: Any,
    layout: Layout,
    batch: Any,
    advantages: torch.Tensor,
    *,
    old: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_tokens: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    timeout: float = 300.0,
) -> StepResult:
    """Forward, then one step on ``layout`` (old log-probs / entropy: ``old``, else
    the forward's own). ``max_tokens`` caps a micro-batch (several per rank)."""
    import time

    from compass_kernels.integration.rl.distributed_trainer import DistributedTrainer

    t0 = time.perf_counter()
    trainer = DistributedTrainer(model_dir, layout, lr=lr, seed=seed, timeout=timeout)
    try:
        data = trainer.plan(batch, max_tokens)
        fwd = trainer.forward(data)
        old_lp, old_ent = old if old is not None else (fwd["logprobs"], fwd["entropy"])
        data.old_logprobs, data.old_entropy, data.advantages = old_lp, old_ent, advantages
        m = trainer.train(data, num_sequences=batch.num_sequences)
        sent = trainer.last_bytes["train"]
        weights = trainer.hf_state_dict()
        # the layer-by-layer gather (the weight sync's): the same tensors, one part a time
        by_part: dict[str, torch.Tensor] = {}
        for _, part in trainer.hf_parts():
            by_part.update(part)
        parts_equal = set(by_part) == set(weights) and all(
            torch.equal(by_part[k], v) for k, v in weights.items()
        )
        sync = dict(trainer.last_sync)
    finally:
        trainer.close()
    return StepResult(
        layout,
        fwd["logprobs"],
        fwd["entropy"],
        m["loss"],
        m["grad_norm"],
        weights,
        m["replay"],
        sent["per_rank"],
        sent["full"],
        time.perf_counter() - t0,
        parts_equal,
        sync,
    )


def compare(a: StepResult, b: StepResult) -> dict[str, float]:
    """Relative differences of b from a: loss, grad norm, forward log-probs
    (max abs), updated weights (max over tensors of ||b - a|| / ||a||)."""
    w = 0.0
    for k, v in a.weights.items():
        d = (b.weights[k].double() - v.double()).norm() / v.double().norm().clamp(min=1e-30)
        w = max(w, float(d))
    return {
        "loss_rel": abs(b.loss - a.loss) / max(abs(a.loss), 1e-30),
        "grad_norm_rel": abs(b.grad_norm - a.grad_norm) / max(abs(a.grad_norm), 1e-30),
        "logprobs_max_abs": float((b.logprobs - a.logprobs).abs().max()),
        "weights_rel": w,
    }


def driver_bytes(
    model_dir: Any, layout: Layout, batch: Any, *, max_tokens: int = 512, seed: int = 0
) -> dict:
    """Bytes the driver receives from the ranks (pickled replies) in one step of
    ``compass-rl`` on ``batch``: "kept" (``LoopAdapter``: the old-policy passes
    kept on the ranks, RL-ZVP there, train on the kept values) and "gathered"
    (both passes' per-token log-probs and entropy gathered, the train step on
    driver-sent tensors: what the loop did before), per command and in total.
    Rewards, groups of 4 and zero-variance flags are synthetic (``seed``)."""
    from compass_kernels.integration.rl.loop_adapter import LoopAdapter

    g = torch.Generator().manual_seed(seed)
    n = batch.num_sequences
    batch.infer_logprobs = torch.where(batch.mask, -torch.rand(batch.num_tokens, generator=g), 0.0)
    rewards = torch.randn(n, generator=g)
    zero_var = (torch.arange(n) // 4) % 2 == 0
    adv = torch.where(zero_var, 0.0, torch.randn(n, generator=g))
    trainer = LoopAdapter(model_dir, layout, lr=1e-3, seed=seed)
    try:
        pack = trainer.pack(batch, dp_size=layout.dp, max_tokens=max_tokens)
        trainer.old_policy_pass(pack)
        trainer.token_advantages(pack, rewards, zero_var, adv, alpha=0.1)
        trainer.train_step(pack, num_sequences=n)
        kept = dict(trainer.rx_bytes)
        r, data = trainer.distributed, trainer._data  # reply sizes do not depend on the weights
        assert data is not None  # set by pack()
        start = dict(r.reply_bytes_total)
        rep = r.forward(data, replay=True)
        r.forward(data, replay=False)
        data.old_logprobs, data.old_entropy = rep["logprobs"], rep["entropy"]
        data.advantages = torch.where(batch.mask, adv[batch.seq_index], 0.0)
        r.train(data, num_sequences=n)
        gathered = {
            k: v - start.get(k, 0) for k, v in r.reply_bytes_total.items() if v > start.get(k, 0)
        }
    finally:
        trainer.close()
    return {
        "layout": layout.as_dict(),
        "sequences": n,
        "tokens": batch.num_tokens,
        "response_tokens": int(batch.mask.sum()),
        "micro_batches": pack.stats["micro_batches"],
        "kept": kept,
        "kept_total": sum(kept.values()),
        "gathered": gathered,
        "gathered_total": sum(gathered.values()),
    }


def _main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    from transformers import AutoConfig

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe

    p = argparse.ArgumentParser(
        description="Bytes the driver receives per compass-rl step "
        "(the tiny default model, a synthetic batch)."
    )
    p.add_argument("--seqs", type=int, default=48, help="sequences")
    p.add_argument("--len", type=int, nargs=2, default=(15, 44), help="min / max tokens")
    p.add_argument("--max-tokens", type=int, default=512, help="token cap of a micro-batch")
    for name in ("tp", "pp", "ep", "cp", "dp"):
        p.add_argument(f"--{name}", type=int, default=1)
    args = p.parse_args(argv)
    path = cached_tiny_qwen3_moe()
    batch, _ = synthetic_batch(
        AutoConfig.from_pretrained(path),
        num_sequences=args.seqs,
        min_len=args.len[0],
        max_len=args.len[1],
    )
    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, dp=args.dp)
    print(json.dumps(driver_bytes(path, layout, batch, max_tokens=args.max_tokens)))


if __name__ == "__main__":
    _main()
