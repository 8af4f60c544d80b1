"""Bench: rollout-budget policies side by side (ck.advantages.policies), simulated, and
allocate_rollouts timed.

Simulator (``python -m bench.bench_budget``): a population of prompts whose pass rates
drift as a simulated policy learns; each step a batch of prompts (the keys) and as many
spare prompts (drawn for DAPO's refill, GRESO's larger batch, ``ours``) are rolled out by
every policy of :data:`compass_kernels.advantages.policies.POLICIES` through
:func:`compass_kernels.advantages.policies.run_step` (3 rounds at most) at the same
budget: N x batch samples, or a token budget, N x the predicted tokens of the batch
(costs from a LengthPredictor fed with the run's own samples). Outcomes are common
random numbers: the j-th sample of prompt i at step t is the same draw for every policy,
so the policies differ only in what they ask for.

A prompt's pass rate is sigmoid(skill_t - difficulty_i), skill rising linearly over the
run; its responses are lognormal around a typical length that grows with difficulty.
Informative group: a success and a failure among all of the prompt's samples of the
step. Reported per population, budget kind and policy (mean of seeds): informative
groups, per generated token, and the ratio to uniform per generated token (mean and the
lowest seed). Populations: ``uniform_p`` (pass rates spread over (0, 1)), ``early``
(most prompts hard), ``mid``, ``late`` (most prompts solved or unsolvable), and with
``--calibrate PATH`` ``calibrated``: fitted to a recorded trajectory (:func:`calibrate`).

Trajectory file (``--calibrate``): CSV with a header, or JSON (a list of objects, or an
object of column lists), columns ``step`` (int), ``prompt`` (any id), ``attempts``
(samples of that prompt at that step, int >= 1), ``correct`` (of them, int in [0,
attempts]); one row per prompt and step it was sampled (compass-rl's real-loop bench
writes it). The fit: logit p = gain * step / (last step) - difficulty_prompt, maximum
likelihood with a N(0, 3^2) prior on each difficulty (prompts always or never solved
stay finite); the simulated population bootstraps the fitted difficulties (+ N(0, 0.25)
jitter) and spans the recorded drift over its steps. ``--ablation``: ``ours`` without the
spare prompts, with min_n = 4, in one round (:data:`ABLATIONS`).

Timed cases (``python -m bench --only budget``): allocate_rollouts on P prompts against
the reference (torch gain table, sorted items, the greedy in Python): the same
allocation (decayed, non-integer histories: no exact ties).
``python -m bench.bench_budget --speed``: best and median time of the C++ entry point
at 10,000 prompts, max_n = 64, budgets 2-32 samples per prompt.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
import torch

from bench.harness import Case

OP = "budget"
STEPS = 50
SEEDS = (0, 1, 2)
BUDGETS = ("samples", "tokens")
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
#: options of each policy in the simulator (the rest: its defaults)
OPTIONS: dict[str, dict] = {}


# ------------------------------------------------------------------ calibration


def load_trajectory(path: Path) -> dict[str, np.ndarray]:
    """The columns step, prompt, attempts, correct of a trajectory file (CSV or JSON,
    see the module docstring) as arrays; prompt ids become 0..P-1 (``prompt``)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() == ".json" or text.lstrip()[:1] in "[{":
        data = json.loads(text)
        if isinstance(data, dict):
            rows = [dict(zip(data, vals, strict=True)) for vals in zip(*data.values(), strict=True)]
        else:
            rows = list(data)
    else:
        rows = list(csv.DictReader(text.splitlines()))
    need = ("step", "prompt", "attempts", "correct")
    if not rows:
        raise ValueError(f"calibrate: {path} has no rows")
    missing = [c for c in need if c not in rows[0]]
    if missing:
        raise ValueError(f"calibrate: {path} lacks the column(s) {missing} (needs {need})")
    ids: dict[str, int] = {}
    out = {c: [] for c in need}
    for j, r in enumerate(rows):
        try:
            step, att, cor = int(r["step"]), int(r["attempts"]), int(r["correct"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"calibrate: row {j} of {path}: {e}") from None
        if att < 1 or not 0 <= cor <= att:
            raise ValueError(
                f"calibrate: row {j} of {path}: expected attempts >= 1 and 0 <= correct <= "
                f"attempts, got attempts={att}, correct={cor}"
            )
        out["step"].append(step)
        out["prompt"].append(ids.setdefault(str(r["prompt"]), len(ids)))
        out["attempts"].append(att)
        out["correct"].append(cor)
    return {c: np.asarray(v, dtype=np.int64) for c, v in out.items()}


def calibrate(path: Path, *, iters: int = 200, prior_sd: float = 3.0):
    """(difficulty [P], gain) fitted to a trajectory file: logit p(prompt i, step t) =
    gain * (t - t0) / (t1 - t0) - difficulty_i, binomial maximum likelihood with a
    N(0, prior_sd^2) prior on the difficulties, by alternating Newton steps."""
    d = load_trajectory(path)
    t = d["step"].astype(np.float64)
    span = max(t.max() - t.min(), 1.0)
    x = (t - t.min()) / span
    i, n, k = d["prompt"], d["attempts"].astype(np.float64), d["correct"].astype(np.float64)
    P = int(i.max()) + 1
    diff, gain = np.zeros(P), 0.0
    lam = 1.0 / prior_sd**2
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(gain * x - diff[i])))
        w = n * p * (1 - p)
        # d: per-prompt Newton (d/d diff of the log-likelihood: -(k - n p))
        g_d = np.bincount(i, -(k - n * p), P) - lam * diff
        h_d = np.bincount(i, w, P) + lam
        diff = diff + g_d / h_d
        p = 1.0 / (1.0 + np.exp(-(gain * x - diff[i])))
        w = n * p * (1 - p)
        g_g, h_g = float(((k - n * p) * x).sum()), float((w * x * x).sum()) + 1e-9
        step = g_g / h_g
        gain += step
        if abs(step) < 1e-10 and np.abs(g_d / h_d).max() < 1e-10:
            break
    return diff, gain


def add_calibrated(path: Path) -> str:
    """Register the population fitted to ``path`` as ``calibrated``; returns its name."""
    diff, gain = calibrate(path)
    POPULATIONS["calibrated"] = (
        lambda g, n: g.choice(diff, n) + g.normal(0.0, 0.25, n),
        0.0,
        float(gain),
    )
    return "calibrated"


# ------------------------------------------------------------------ simulator


class _World:
    """One population and seed: difficulties, typical lengths, the batches, and the
    common random numbers of every (step, prompt, sample)."""

    def __init__(self, population: str, seed: int, prompts: int, batch: int, spare: int):
        make, self.skill0, self.gain = POPULATIONS[population]
        g = np.random.default_rng([seed, 1])
        self.diff = make(g, prompts)
        self.typical = np.exp(5.5 + 0.25 * self.diff.clip(-6, 6) + g.normal(0, 0.3, prompts))
        self.seed, self.prompts, self.batch, self.spare = seed, prompts, batch, spare
        order = np.random.default_rng([seed, 2])
        self.picks = [order.choice(prompts, batch + spare, replace=False) for _ in range(STEPS)]

    def step_draws(self, t: int, width: int = 64):
        r = np.random.default_rng([self.seed, 3, t])
        return r.random((self.prompts, width)), r.normal(0.0, 0.3, (self.prompts, width))


def simulate(
    population: str,
    policy: str,
    *,
    budget: str = "samples",
    seed: int = 0,
    prompts: int = 512,
    batch: int = 128,
    spare: int = 128,
    n: int = 8,
    steps: int = STEPS,
    world: _World | None = None,
    use_spare: bool = True,
    options: dict | None = None,
) -> dict[str, float]:
    """One run: totals of samples, tokens, groups and informative groups over ``steps``
    (``use_spare`` False: the policy sees no spare prompts; ``options``: the policy's,
    else :data:`OPTIONS`)."""
    import compass_kernels as ck
    from compass_kernels.packing.schedule import LengthPredictor

    if budget not in BUDGETS:
        raise ValueError(f"budget: expected one of {BUDGETS}, got {budget!r}")
    w = world or _World(population, seed, prompts, batch, spare)
    opts = OPTIONS.get(policy, {}) if options is None else options
    pol = ck.advantages.make_policy(policy, seed=seed, **opts)
    pred = LengthPredictor(default=float(np.median(w.typical)))
    tot = dict(samples=0, tokens=0.0, informative=0, groups=0, inf_samples=0)
    for t in range(steps):
        skill = w.skill0 + w.gain * t / max(steps - 1, 1)
        pick = w.picks[t % len(w.picks)]
        keys, spare_keys = pick[: w.batch].tolist(), pick[w.batch :].tolist()
        spare_keys = spare_keys if use_spare else []
        pool = keys + spare_keys
        u, z = w.step_draws(t)
        pos: dict[int, int] = {}
        lengths: list[tuple[int, np.ndarray]] = []

        def draw(alloc, u=u, z=z, pos=pos, lengths=lengths, skill=skill):
            out = {}
            for k, m in alloc.items():
                a = pos.get(k, 0)
                if a + m > u.shape[1]:
                    raise ValueError(
                        f"simulate: {policy} drew > {u.shape[1]} samples of one prompt"
                    )
                p = 1.0 / (1.0 + np.exp(-(skill - w.diff[k])))
                out[k] = (u[k, a : a + m] < p).tolist()
                lengths.append((k, np.maximum(w.typical[k] * np.exp(z[k, a : a + m]), 1.0)))
                pos[k] = a + m
            return out

        if budget == "samples":
            cost, b = None, float(n * len(keys))
        else:
            c = ck.advantages.token_costs(pred, pool).numpy().astype(np.float64)
            cost, b = c, float(n * c[: len(keys)].sum())
        res = ck.advantages.run_step(pol, keys, b, draw, cost=cost, spare=spare_keys)
        for k, ls in lengths:
            for v in ls.tolist():
                pred.observe(k, int(v))
            tot["tokens"] += float(ls.astype(np.int64).sum())
        pred.end_step()
        tot["samples"] += res.samples
        tot["informative"] += res.informative
        tot["groups"] += res.groups
        tot["inf_samples"] += sum(len(v) for v in res.outcomes.values() if 0 < sum(v) < len(v))
    tot["per_sample"] = tot["informative"] / max(tot["samples"], 1)
    tot["per_1k_tokens"] = 1000.0 * tot["informative"] / max(tot["tokens"], 1)
    tot["inf_group_size"] = tot["inf_samples"] / max(tot["informative"], 1)
    return tot


def policies() -> tuple[str, ...]:
    from compass_kernels.advantages.policies import POLICIES

    return POLICIES


def run_all(seeds=SEEDS, steps: int = STEPS, populations=None) -> list[dict]:
    """Every population x budget kind x policy x seed: one row each (ratios to uniform
    of the same population, budget kind and seed)."""
    rows = []
    for pop in populations or list(POPULATIONS):
        for s in seeds:
            world = _World(pop, s, 512, 128, 128)
            for kind in BUDGETS:
                base = None
                for pol in policies():
                    r = simulate(pop, pol, budget=kind, seed=s, steps=steps, world=world)
                    base = base or r
                    r.update(
                        population=pop,
                        budget=kind,
                        policy=pol,
                        seed=s,
                        vs_uniform=r["informative"] / max(base["informative"], 1),
                        per_token_vs_uniform=r["per_1k_tokens"] / max(base["per_1k_tokens"], 1e-12),
                    )
                    rows.append(r)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Mean over seeds per (population, budget, policy), with the lowest seed's ratio."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["population"], r["budget"], r["policy"]), []).append(r)
    for (pop, kind, pol), rs in groups.items():
        m = {k: float(np.mean([x[k] for x in rs])) for k in NUMERIC}
        m.update(
            population=pop,
            budget=kind,
            policy=pol,
            seed="mean",
            min_per_token_vs_uniform=min(x["per_token_vs_uniform"] for x in rs),
            seeds=len(rs),
        )
        out.append(m)
    return out


NUMERIC = (
    "samples",
    "tokens",
    "groups",
    "informative",
    "per_sample",
    "per_1k_tokens",
    "inf_group_size",
    "vs_uniform",
    "per_token_vs_uniform",
)


#: ``--ablation``: ours without what it borrows (name: (use_spare, options))
ABLATIONS = {
    "ours": (True, {}),
    "ours, keys only (no spare)": (False, {}),
    "ours, min_n = 4": (True, {"min_n": 4}),
    "ours, 1 round (knapsack on keys + spare)": (True, {"rounds": 1}),
}


def ablation(seeds=SEEDS, steps: int = STEPS, budget: str = "samples", populations=None) -> str:
    """Per population, ours and its ablations: informative groups per generated token
    relative to uniform N (mean of seeds, the lowest seed), and their group size."""
    lines = [
        "| population | variant | per token vs uniform | lowest seed | informative group size |",
        "|---|---|---|---|---|",
    ]
    for pop in populations or list(POPULATIONS):
        worlds = {s: _World(pop, s, 512, 128, 128) for s in seeds}
        base = {
            s: simulate(pop, "uniform", budget=budget, seed=s, steps=steps, world=w)
            for s, w in worlds.items()
        }
        for name, (use_spare, opts) in ABLATIONS.items():
            ratios, sizes = [], []
            for s, w in worlds.items():
                r = simulate(
                    pop,
                    "ours",
                    budget=budget,
                    seed=s,
                    steps=steps,
                    world=w,
                    use_spare=use_spare,
                    options=opts,
                )
                ratios.append(r["per_1k_tokens"] / base[s]["per_1k_tokens"])
                sizes.append(r["inf_group_size"])
            lines.append(
                f"| {pop} | {name} | {np.mean(ratios):.3f} | {min(ratios):.3f} "
                f"| {np.mean(sizes):.2f} |"
            )
    return "\n".join(lines)


def markdown(summary: list[dict]) -> str:
    """The summary as a markdown table."""
    head = (
        "| population | budget | policy | samples | tokens | informative | per 1k tokens "
        "| informative group size | informative vs uniform | per token vs uniform "
        "| lowest seed |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in summary:
        lines.append(
            f"| {r['population']} | {r['budget']} | {r['policy']} | {r['samples']:.0f} "
            f"| {r['tokens']:.0f} | {r['informative']:.0f} | {r['per_1k_tokens']:.4f} "
            f"| {r['inf_group_size']:.2f} | {r['vs_uniform']:.3f} "
            f"| {r['per_token_vs_uniform']:.3f} | {r['min_per_token_vs_uniform']:.3f} |"
        )
    return "\n".join(lines)


def table(
    seeds=SEEDS,
    steps: int = STEPS,
    csv_path: Path | None = None,
    plot_path: Path | None = None,
    populations=None,
) -> str:
    """Run everything (:func:`run_all`), write the per-seed and mean rows to
    ``csv_path`` and the chart (:func:`plot`) to ``plot_path`` when given; return the
    markdown table of the means."""
    rows = run_all(seeds, steps, populations)
    summary = summarise(rows)
    if csv_path is not None:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        cols = ("population", "budget", "policy", "seed", *NUMERIC, "min_per_token_vs_uniform")
        with open(csv_path, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            wr.writeheader()
            wr.writerows(rows + summary)
    if plot_path is not None:
        plot(summary, plot_path, steps=steps, seeds=len(seeds))
    return markdown(summary)


def plot(summary: list[dict], path: Path, *, steps: int = STEPS, seeds: int = 3) -> Path:
    """``path`` (PNG): per budget kind (panels) and population (groups of bars), each
    policy's informative groups per generated token relative to uniform N at the same
    budget (bar: mean of seeds; the tick: the lowest seed); dashed: uniform, dotted:
    the goal (1.3x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pops = list(dict.fromkeys(r["population"] for r in summary))
    pols = [p for p in policies() if p != "uniform"]
    width = 0.8 / len(pols)
    fig, axes = plt.subplots(1, len(BUDGETS), figsize=(14, 4.8), sharey=True)
    for ax, kind in zip(axes, BUDGETS, strict=True):
        for j, pol in enumerate(pols):
            rs = [
                next(
                    r
                    for r in summary
                    if r["population"] == pop and r["policy"] == pol and r["budget"] == kind
                )
                for pop in pops
            ]
            xs = [i + (j - (len(pols) - 1) / 2) * width for i in range(len(pops))]
            ys = [r["per_token_vs_uniform"] for r in rs]
            lo = [r["per_token_vs_uniform"] - r["min_per_token_vs_uniform"] for r in rs]
            bars = ax.bar(xs, ys, width, label=pol, yerr=[lo, [0] * len(lo)], capsize=2)
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.axhline(1.3, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(pops)), pops)
        ax.set_title(
            f"{kind} budget: informative groups per generated token vs uniform N", fontsize=9
        )
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("ratio to uniform N (same budget)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(
        f"rollout-budget policies: {steps} steps, mean of {seeds} seeds (tick: lowest seed)",
        fontsize=10,
    )
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
    ap.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds 0..N-1 (default 3)")
    ap.add_argument("--calibrate", type=Path, metavar="PATH", help="trajectory file (CSV/JSON)")
    ap.add_argument("--only", action="append", metavar="POPULATION", help="repeatable")
    ap.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "budget.csv")
    ap.add_argument("--plot", type=Path, default=Path(__file__).parent / "results" / "budget.png")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    ap.add_argument("--ablation", action="store_true", help="ours without spare / rounds")
    ap.add_argument(
        "--speed",
        action="store_true",
        help="time allocate_rollouts at 10,000 prompts (speed_table)",
    )
    args = ap.parse_args()
    if args.speed:
        print(speed_table())
        return
    if args.calibrate is not None:
        add_calibrated(args.calibrate)
    if args.steps > STEPS:
        ap.error(f"--steps: at most {STEPS}")
    plot_path = None if args.no_plot else args.plot
    seeds = tuple(range(args.seeds))
    if args.ablation:
        print(ablation(seeds, args.steps, populations=args.only))
        return
    print(table(seeds, args.steps, args.csv, plot_path, args.only))
    print(f"csv: {args.csv}" + ("" if plot_path is None else f"\nplot: {plot_path}"))


if __name__ == "__main__":
    main()
