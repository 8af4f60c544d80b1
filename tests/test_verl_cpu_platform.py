"""compass's CPU platform for verl (compass_kernels/integration/cpu/verl_platform.py) in
this process: what it changes, that it changes nothing on a pin mismatch, that
deactivate() restores everything; the install the `verl` extra pins; the recipe script's
CPU overrides; the warning for a 16-bit old entropy. verl's real trainer on this platform:
tests/integration/test_verl_trainer.py."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/install_verl.sh)")

ROOT = Path(__file__).resolve().parents[1]
PLATFORM = "compass_kernels.integration.cpu.verl_platform"
PLUGIN = "compass_kernels.integration.cpu.verl_plugin"


def _verl_pins() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]["verl"]


def test_installed_versions_are_the_verl_extra_pins():
    wrong = []
    for pin in _verl_pins():
        name, version = pin.split("==")
        try:
            got = md.version(name)
        except md.PackageNotFoundError:
            got = None
        if got != version:
            wrong.append((name, got, version))
    assert not wrong, f"installed != pyproject's verl extra (scripts/install_verl.sh): {wrong}"


def test_main_ppo_starts_and_composes_the_cpu_recipe_config():
    """`python -m verl.trainer.main_ppo` imports and composes its Hydra config (omegaconf
    2.4.0 made every released hydra-core fail here) with the CPU overrides."""
    from compass_kernels.integration.cpu.verl_platform import CONFIG_OVERRIDES

    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES=PLUGIN, PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job", *CONFIG_OVERRIDES],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "use_v1: false" in out.stdout
    assert "param_dtype: fp32" in out.stdout


def test_the_recipe_script_carries_every_cpu_override():
    from compass_kernels.integration.cpu.verl_platform import CONFIG_OVERRIDES

    script = (ROOT / "examples" / "verl" / "run_qwen3_moe_compass.sh").read_text()
    missing = [o for o in CONFIG_OVERRIDES if o not in script]
    assert not missing, missing


@pytest.fixture
def platform():
    """The platform module, activated, deactivated afterwards."""
    import importlib

    import verl.utils.distributed as vd
    from verl.plugin.platform import platform_manager as pm

    before = (
        pm._current_platform,
        vd.initialize_global_process_group_ray,
        list(sys.meta_path),
        {
            k: os.environ.get(k)
            for k in ("VERL_ENGINE_DEVICE", "VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE")
        },
    )
    mod = importlib.import_module(PLATFORM)
    mod.activate()
    yield mod, before
    mod.deactivate()


@pytest.mark.vllm  # activation presents vllm-cpu's distribution as vllm (none on 3.12)
def test_activate_makes_verl_see_a_cpu_and_deactivate_restores(platform):
    import verl.utils.distributed as vd
    from verl.plugin.platform import get_platform
    from verl.plugin.platform import platform_manager as pm
    from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device

    mod, before = platform
    assert mod.active()
    assert get_device_name() == "cpu" and get_nccl_backend() == "gloo"
    assert get_platform().is_ipc_supported() is False
    assert get_platform().ray_resource_name() == "GPU"
    dev = get_torch_device()
    assert dev.get_device_name() == "CPU" and dev.memory_allocated() == 0
    assert dev.synchronize is not None and dev.current_device() == "cpu"
    assert md.version("vllm") == md.version("vllm-cpu") + "+cpu"
    assert os.environ["VERL_ENGINE_DEVICE"] == "cuda"
    assert vd.initialize_global_process_group_ray.__wrapped_by_compass__ is before[1]
    mod.deactivate()
    assert not mod.active()
    assert pm._current_platform is before[0]
    assert vd.initialize_global_process_group_ray is before[1]
    assert sys.meta_path == before[2]
    assert {k: os.environ.get(k) for k in before[3]} == before[3]
    assert "cpu" not in pm.PlatformRegistry.registered_names()
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")


def test_a_changed_upstream_function_is_refused_and_nothing_changes(platform, monkeypatch):
    import verl.utils.distributed as vd
    from verl.plugin.platform import platform_manager as pm

    mod, before = platform
    mod.deactivate()
    name = "verl.utils.distributed:initialize_global_process_group_ray"
    monkeypatch.setitem(mod.UPSTREAM_SOURCE_SHA256, name, "0" * 64)
    with pytest.raises(mod.VerlVersionError, match="initialize_global_process_group_ray changed"):
        mod.activate()
    assert not mod.active()
    assert pm._current_platform is before[0]
    assert vd.initialize_global_process_group_ray is before[1]
    assert sys.meta_path == before[2]
    assert {k: os.environ.get(k) for k in before[3]} == before[3]


@pytest.mark.vllm
def test_the_weight_update_is_replaced_when_verls_rollout_utils_is_imported(platform):
    """The class is patched at definition (vLLM's engine process imports it after verl)."""
    pytest.importorskip("vllm")
    from verl.workers.rollout.vllm_rollout import utils

    mod, _ = platform
    fn = utils.vLLMColocateWorkerExtension.update_weights_from_ipc
    assert hasattr(fn, "__wrapped_by_compass__")
    mod.deactivate()
    assert not hasattr(
        utils.vLLMColocateWorkerExtension.update_weights_from_ipc, "__wrapped_by_compass__"
    )


def test_after_import_hook_runs_once_at_definition(tmp_path, monkeypatch):
    import importlib

    mod = importlib.import_module(PLATFORM)
    (tmp_path / "compass_hook_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    mod._when_imported("compass_hook_probe", lambda m: seen.append(m.VALUE))
    try:
        import compass_hook_probe  # noqa: F401

        assert seen == [1]
    finally:
        sys.modules.pop("compass_hook_probe", None)
        for f in mod._STATE.pop("import_hooks", []):
            sys.meta_path.remove(f)


@pytest.mark.parametrize(
    ("actor", "warned"),
    [
        ({"strategy": "fsdp", "fsdp_config": {"mixed_precision": None}}, True),
        ({"strategy": "fsdp", "fsdp_config": {"mixed_precision": {"param_dtype": "fp32"}}}, False),
        ({"strategy": "megatron", "megatron": {"dtype": "bfloat16"}}, True),
    ],
)
def test_a_16_bit_old_entropy_warns_naming_the_option(actor, warned):
    from omegaconf import OmegaConf

    from compass_kernels.integration.verl.entropy import warn_low_precision_entropy

    cfg = OmegaConf.create(
        {"actor_rollout_ref": {"actor": {**actor, "policy_loss": {"loss_mode": "compass_espo"}}}}
    )
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert warn_low_precision_entropy(cfg) is warned
    if warned:
        assert len(w) == 1
        assert "fsdp_config.mixed_precision.param_dtype=fp32" in str(w[0].message)
        if actor["strategy"] == "megatron":
            assert "Megatron engine accepts only bfloat16 / float16" in str(w[0].message)
    else:
        assert not w
    cfg.actor_rollout_ref.actor.policy_loss.loss_mode = "vanilla"
    assert warn_low_precision_entropy(cfg) is False
