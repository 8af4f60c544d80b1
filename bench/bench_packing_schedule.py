"""Bench: length-aware rollout scheduling (ck.packing.schedule), simulated.

Not a timing bench (``cases`` is empty): the rollout makespan of one RL step
on several inference engines is simulated (EngineModel: a decode step of R
sequences takes 20 ms + 0.1 ms * R, at most 64 running, 2M KV tokens per
engine) for three submission policies on a long-tailed workload (prompt
typical length lognormal mu 8, sigma 1.1; responses scattered around it,
sigma 0.3; clipped 100..65536; a quarter of the prompts new):

- ``fifo``: dataset order, round robin over engines;
- ``random``: shuffled, round robin;
- ``ours``: predicted lengths (history, siblings, fallback), LPT across
  engines, longest predicted first, queues re-ordered as siblings finish.

``python -m bench.bench_packing_schedule`` prints makespan, idle fraction,
preemptions and the lower bound per policy, and by how much ours wins.
"""

from __future__ import annotations

from compass_kernels.packing import schedule as S

OP = "packing_schedule"
WORKLOADS = ((64, 8, 4), (256, 16, 8), (512, 16, 16))  # (prompts, samples, engines)
MODEL = S.EngineModel(step_s=0.02, per_seq_s=1e-4, max_seqs=64, kv_tokens=2_000_000)


def cases(quick: bool) -> list:
    return []


def table(workloads=WORKLOADS, seeds=(0, 1)) -> str:
    lines = [
        f"{'prompts':>7} {'samples':>7} {'engines':>7} {'seed':>4} {'policy':>7} "
        f"{'makespan_s':>10} {'idle':>6} {'preempt':>7} {'vs_LB':>6} {'ours_wins':>9}"
    ]
    for prompts, samples, engines in workloads:
        for seed in seeds:
            reqs, pred = S.synthetic_workload(prompts, samples, seed)
            res = S.compare_policies(reqs, pred, engines, MODEL, seed=seed)
            for name, r in res.items():
                win = r.makespan / res["ours"].makespan
                lines.append(
                    f"{prompts:7d} {samples:7d} {engines:7d} {seed:4d} {name:>7} "
                    f"{r.makespan:10.1f} {r.idle_fraction:6.3f} {r.preemptions:7d} "
                    f"{r.makespan / r.lower_bound:6.3f} {win:8.2f}x"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
