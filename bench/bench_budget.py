"""Bench: adaptive rollout budgets (ck.advantages.allocate_rollouts), simulated and timed.

Simulator (``python -m bench.bench_budget``): a population of prompts whose pass
rates drift as a simulated policy learns, 50 steps; each step a batch of prompts
(recurring every few steps) is rolled out under the same budget by

- ``uniform``: N samples per prompt;
- ``resample``: the loop's reactive zero-variance elimination at equal budget:
  3/4 of the budget uniformly, the rest resamples zero-variance groups N at a time;
- ``alloc``: RolloutAllocator (history, Beta prior, exploration after 4 skips)
  under the sample budget N x batch;
- ``alloc_tok``: the same under a token budget (N x predicted tokens of the batch,
  costs from a LengthPredictor).

A prompt's pass rate is sigmoid(skill_t - difficulty_i) with skill rising linearly
(the same drift for every policy, so they see the same prompts); its responses
are lognormal around a typical length that grows with difficulty. Informative
group: at least one success and one failure (a non-zero GRPO gradient). Reported
per population: informative groups, per sample and per 1,000 tokens, and the
ratio to uniform. Populations: ``uniform_p`` (pass rates spread over (0, 1)),
``early`` (most prompts hard), ``mid``, ``late`` (most prompts solved or
unsolvable).

Timed cases (``python -m bench --only budget``): allocate_rollouts on P prompts
against the reference (torch gain table, sorted items, the greedy in Python):
the same allocation (decayed, non-integer histories: no exact ties).
``python -m bench.bench_budget --speed``: best and median time of the C++ entry
point at 10,000 prompts, max_n = 64, budgets 2-32 samples per prompt.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
import torch

from bench.harness import Case

OP = "budget"
STEPS = 50
POPULATIONS = {  # name: (difficulty sampler, skill at step 0, skill gain over the run)
    "uniform_p": (lambda g, n: g.normal(0.0, 2.5, n), 0.0, 0.0),
    "early": (lambda g, n: g.normal(2.5, 1.5, n), 0.0, 1.5),
    "mid": (lambda g, n: g.normal(0.0, 2.0, n), 0.0, 1.5),
    "late": (
        lambda g, n: np.where(g.random(n) < 0.5, g.normal(-5.0, 1.5, n), g.normal(5.0, 1.5, n)),
        0.0,
        1.0,
    ),
}


def simulate(
    population: str,
    policy: str,
    *,
    seed: int = 0,
    prompts: int = 512,
    batch: int = 128,
    n: int = 8,
    steps: int = STEPS,
) -> dict[str, float]:
    """One run: totals of samples, tokens and informative groups over ``steps``."""
    import compass_kernels as ck
    from compass_kernels.packing.schedule import LengthPredictor

    make, skill0, gain = POPULATIONS[population]
    g = np.random.default_rng([seed, 1])
    diff = make(g, prompts)
    typical = np.exp(5.5 + 0.25 * diff.clip(-6, 6) + g.normal(0, 0.3, prompts))  # tokens
    order_rng = np.random.default_rng([seed, 2])  # same batches for every policy
    out_rng = np.random.default_rng([seed, 3, POLICIES.index(policy)])  # str hash: per process
    ra = ck.advantages.RolloutAllocator(min_n=2, max_n=4 * n, explore_after=4, decay=0.7)
    pred = LengthPredictor(default=float(np.median(typical)))
    tot = dict(samples=0, tokens=0, informative=0, groups=0)
    for t in range(steps):
        skill = skill0 + gain * t / max(steps - 1, 1)
        idx = order_rng.choice(prompts, batch, replace=False)
        p = 1.0 / (1.0 + np.exp(-(skill - diff[idx])))
        keys = idx.tolist()
        budget = n * batch
        if policy == "alloc":
            counts = ra.allocate(keys, budget).numpy()
        elif policy == "alloc_tok":
            cost = ck.advantages.token_costs(pred, keys)
            counts = ra.allocate(keys, n * int(cost.sum()), cost=cost).numpy()
        elif policy == "resample":
            counts = np.full(batch, (3 * n) // 4)
        else:
            counts = np.full(batch, n)
        succ = out_rng.binomial(counts, p)
        if policy == "resample":
            left = budget - int(counts.sum())
            for j in np.flatnonzero((succ == 0) | (succ == counts)):
                if left < n:
                    break
                succ[j] += out_rng.binomial(n, p[j])
                counts[j] += n
                left -= n
        lengths = [
            typical[i] * np.exp(out_rng.normal(0, 0.3, k)) for i, k in zip(idx, counts, strict=True)
        ]
        for i, k, s, ls in zip(keys, counts.tolist(), succ.tolist(), lengths, strict=True):
            if k:
                ra.observe([i] * k, [True] * s + [False] * (k - s))
                for v in ls:
                    pred.observe(i, max(int(v), 1))
        pred.end_step()
        tot["samples"] += int(counts.sum())
        tot["tokens"] += int(sum(float(ls.sum()) for ls in lengths))
        tot["informative"] += int(((succ > 0) & (succ < counts)).sum())
        tot["groups"] += int((counts > 0).sum())
    tot["per_sample"] = tot["informative"] / max(tot["samples"], 1)
    tot["per_1k_tokens"] = 1000.0 * tot["informative"] / max(tot["tokens"], 1)
    return tot


POLICIES = ("uniform", "resample", "alloc", "alloc_tok")


def table(
    seeds=(0, 1, 2), steps: int = STEPS, csv_path: Path | None = None, plot_path: Path | None = None
) -> str:
    """Every population x policy, mean over seeds; ratios to uniform. Writes the rows
    to ``csv_path`` and the chart (:func:`plot`) to ``plot_path`` when given."""
    rows = []
    for pop in POPULATIONS:
        base = None
        for pol in POLICIES:
            runs = [simulate(pop, pol, seed=s, steps=steps) for s in seeds]
            r = {k: float(np.mean([x[k] for x in runs])) for k in runs[0]}
            base = base or r
            r.update(
                population=pop,
                policy=pol,
                vs_uniform=r["informative"] / base["informative"],
                per_token_vs_uniform=r["per_1k_tokens"] / base["per_1k_tokens"],
            )
            rows.append(r)
    cols = (
        "population",
        "policy",
        "samples",
        "tokens",
        "informative",
        "per_sample",
        "per_1k_tokens",
        "vs_uniform",
        "per_token_vs_uniform",
    )
    lines = [" ".join(f"{c:>20}" for c in cols)]
    for r in rows:
        lines.append(
            " ".join(f"{r[c]:>20.4g}" if isinstance(r[c], float) else f"{r[c]:>20}" for c in cols)
        )
    if csv_path is not None:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    if plot_path is not None:
        plot(rows, plot_path, steps=steps)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, *, steps: int = STEPS) -> Path:
    """``path`` (PNG): per population, each policy's informative groups relative to
    uniform N at equal budget, per sample (left) and per generated token (right);
    the dashed line is uniform, the dotted one the late-population goal (1.2x per token)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pops = list(dict.fromkeys(r["population"] for r in rows))
    pols = [p for p in POLICIES if p != "uniform"]
    width = 0.8 / len(pols)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, title in (
        (axes[0], "vs_uniform", "informative groups vs uniform N"),
        (axes[1], "per_token_vs_uniform", "informative groups per token vs uniform N"),
    ):
        for j, pol in enumerate(pols):
            ys = [
                next(r[key] for r in rows if r["population"] == pop and r["policy"] == pol)
                for pop in pops
            ]
            xs = [i + (j - (len(pols) - 1) / 2) * width for i in range(len(pops))]
            bars = ax.bar(xs, ys, width, label=pol)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(pops)), pops)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[1].axhline(1.2, color="grey", linestyle=":", linewidth=1, label="goal (late)")
    axes[0].set_ylabel("ratio to uniform N (equal budget)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"allocate_rollouts simulator: {steps} steps, mean of seeds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _inputs(P: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.where(
        torch.rand(P, generator=g) < 0.8,
        torch.rand(P, generator=g) * 0.04,
        torch.rand(P, generator=g),
    )
    p = torch.where(torch.rand(P, generator=g) < 0.5, p, 1 - p)
    att = torch.rand(P, generator=g, dtype=torch.float64) * 24  # decayed counts
    s = att * p.double()
    return s, att


def _late_inputs(P: int, seed: int = 0, attempts: int = 16):
    """Late-training histories: ``attempts`` samples each, 80% of pass rates within
    0.04 of 0 or 1 (integer counts)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.where(
        torch.rand(P, generator=g) < 0.8,
        torch.rand(P, generator=g) * 0.04,
        torch.rand(P, generator=g),
    )
    p = torch.where(torch.rand(P, generator=g) < 0.5, p, 1 - p)
    att = torch.full((P,), float(attempts), dtype=torch.float64)
    return torch.binomial(att, p.double()), att


def speed_table(P: int = 10000, max_n: int = 64, budgets=(2, 4, 8, 16, 32), reps: int = 300) -> str:
    """Best and median time of the raw C++ entry point (no argument checks), unit
    costs, on late-training and decayed histories, per budget (samples per prompt).
    The host is shared: report both, and compare only runs of one session."""
    import statistics
    import time

    import compass_kernels as ck

    f = ck._ext.load().advantages.allocate_rollouts_cpu
    c = torch.ones(P, dtype=torch.int64)
    req = torch.zeros(P, dtype=torch.bool)
    out = torch.empty(P, dtype=torch.int64)
    lines = [f"allocate_rollouts_cpu, P = {P}, max_n = {max_n}, {reps} calls per case"]
    for name, (s, att) in (("late", _late_inputs(P)), ("decayed", _inputs(P))):
        for bpp in budgets:
            for _ in range(5):
                f(s, att, c, req, bpp * P, 2, max_n, 1.0, 1.0, out)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                f(s, att, c, req, bpp * P, 2, max_n, 1.0, 1.0, out)
                ts.append(time.perf_counter() - t0)
            lines.append(
                f"{name:8s} budget {bpp:3d} / prompt: best {min(ts) * 1e3:.3f} ms, "
                f"median {statistics.median(ts) * 1e3:.3f} ms"
            )
    return "\n".join(lines)


def cases(quick: bool) -> list:
    import compass_kernels as ck
    from compass_kernels.advantages.reference import allocate_rollouts_reference

    out = []
    for P in (64, 300) if quick else (1000, 10000):
        s, att = _inputs(P)
        budget = 8 * P
        out.append(
            Case(
                name=OP,
                shape={"prompts": P, "budget": budget},
                providers={
                    "reference": lambda s=s, a=att, b=budget: allocate_rollouts_reference(
                        s, a, b, min_n=2, max_n=64
                    )[0],
                    "compass": lambda s=s, a=att, b=budget: ck.advantages.allocate_rollouts(
                        s, a, b, min_n=2, max_n=64
                    ),
                },
                baseline="reference",
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "budget.csv")
    ap.add_argument("--plot", type=Path, default=Path(__file__).parent / "results" / "budget.png")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    ap.add_argument(
        "--speed",
        action="store_true",
        help="time allocate_rollouts at 10,000 prompts (speed_table)",
    )
    args = ap.parse_args()
    if args.speed:
        print(speed_table())
        return
    plot_path = None if args.no_plot else args.plot
    print(table(steps=args.steps, csv_path=args.csv, plot_path=plot_path))
    print(f"csv: {args.csv}" + ("" if plot_path is None else f"\nplot: {plot_path}"))


if __name__ == "__main__":
    main()
