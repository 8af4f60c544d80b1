"""What ``compass-rl`` writes after its steps: steps.csv, the steps.png plot, the title and
the closing log-prob gap summary (the per-step terminal table is console.py's)."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Any

import numpy as np


def write_csv(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """steps.csv: one row per step, ``columns`` in order (docs/rl_columns.md)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in columns})


def title(args: argparse.Namespace, hf_config: Any) -> str:
    return (
        f"compass-rl: Qwen3-MoE {hf_config.num_hidden_layers}L x {hf_config.num_experts}E "
        f"top-{hf_config.num_experts_per_tok}, {args.prompts} prompts x N={args.n}, "
        f"rollout {args.rollout_dtype} / train fp32, replay "
        f"{'off' if args.no_replay else 'on'}, sync {args.sync}"
    )


def plot(rows: list[dict[str, Any]], path: Path, *, title: str = "") -> None:
    """steps.png: rewards, zero-variance rates by stage, log-prob gap, time per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for a in ax.flat:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a = ax[0, 0]
    a.plot(steps, [r["reward_mean"] for r in rows], "o-", label="reward (guarded)")
    a.plot(steps, [r["accuracy"] for r in rows], "s-", label="accuracy")
    a.set_title("reward")
    a.set_xlabel("step")
    a.legend()
    a = ax[0, 1]
    stages = (
        ("zv_initial", "initial"),
        ("zv_resample", "after resample"),
        ("zv_penalty", "after penalties"),
        ("zv_rlzvp", "after RL-ZVP"),
    )
    for key, label in stages:
        a.plot(steps, [r[key] for r in rows], "o-", label=label)
    a.set_title("zero-variance groups (fraction)")
    a.set_xlabel("step")
    a.legend()
    a = ax[1, 0]
    a.semilogy(steps, [r["gap_replay"] for r in rows], "o-", label="mean |d|, replay")
    a.semilogy(steps, [r["gap_native"] for r in rows], "s-", label="mean |d|, native")
    a.semilogy(steps, [max(r["k3_replay"], 1e-12) for r in rows], "o--", label="k3, replay")
    a.semilogy(steps, [max(r["k3_native"], 1e-12) for r in rows], "s--", label="k3, native")
    a.set_title("train (fp32) vs rollout log-probs")
    a.set_xlabel("step")
    a.legend()
    a = ax[1, 1]
    phases = (
        ("t_generate", "generate"),
        ("t_reward_tail", "reward tail"),
        ("t_pack", "pack"),
        ("t_old", "old-policy pass"),
        ("t_train", "train"),
        ("t_sync", "sync"),
        ("t_probe", "probe"),
    )
    bottom = np.zeros(len(rows))
    for key, label in phases:
        v = np.array([r[key] for r in rows])
        a.bar(steps, v, bottom=bottom, label=label)
        bottom += v
    a.set_title("time per phase (s)")
    a.set_xlabel("step")
    a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary(rows: list[dict[str, Any]], args: argparse.Namespace, file: Any = None) -> None:
    if not rows or args.quiet:
        return
    g_rep = np.mean([r["gap_replay"] for r in rows])
    g_nat = np.mean([r["gap_native"] for r in rows])
    k_rep = np.mean([r["k3_replay"] for r in rows])
    k_nat = np.mean([r["k3_native"] for r in rows])
    print(
        f"\nlog-prob gap, trainer (fp32) vs rollout ({args.rollout_dtype}), mean over "
        f"{len(rows)} steps:\n"
        f"  {'':16}{'mean |d|':>12}{'k3 KL':>12}\n"
        f"  {'router replay':16}{g_rep:>12.3e}{k_rep:>12.3e}\n"
        f"  {'native routing':16}{g_nat:>12.3e}{k_nat:>12.3e}\n"
        f"  (training used {'native routing (--no-replay)' if args.no_replay else 'replay'})",
        file=file,
    )
