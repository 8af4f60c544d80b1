"""Declared CPU support for megatron-core 0.16.x and 0.19.x (gloo).

megatron-core's MoE ``GPTModel`` runs on CPU except for a handful of calls that
assume CUDA. :func:`apply` replaces exactly those, and :func:`revert` puts the
originals back. Every patched function is CPU-aware: it takes the CPU path only
when CUDA is unavailable (or the tensors involved live on the CPU) and otherwise
calls the upstream function unchanged.

The patches (see :data:`PATCHES`):

``router_gating``
    ``Router.gating`` moves CPU router weights to ``torch.cuda.current_device()``.
``rope_get_emb``
    ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``.
``rng_get_state`` / ``rng_set_state`` / ``rng_tracker_add``
    The CUDA RNG tracker (dropout forks) reads and writes CUDA generator state;
    on CPU the tracked states are CPU generator states.
``memory_buffer``
    ``GlobalMemoryBuffer.get_tensor`` (the scratch tensor of the local
    ``DotProductAttention``) allocates on ``torch.cuda.current_device()``.
``causal_mask``
    ``get_default_causal_mask`` (as bound in ``fused_softmax``, used when no
    attention mask is passed) builds the mask on ``"cuda"``.
``alltoall_stream`` / ``alltoall_dtoh``
    ``MoEAlltoAllTokenDispatcher`` creates a ``torch.cuda.Stream`` at
    construction and copies its split sizes device-to-host on it.
``te_general_gemm``
    ``moe_utils`` references ``te_general_gemm`` but defines it only when
    Transformer Engine imports; without TE it is defined as ``None`` (the
    upstream fallback path is then a plain ``torch.mm``).
``schedules_torch`` / ``p2p_torch`` / ``mappings_torch`` / ``layers_torch``
    The pipeline schedules (``get_forward_backward_func``'s functions) count
    tokens in ``torch.zeros(..., device="cuda")``, the p2p communicator
    allocates shape and receive buffers on ``torch.cuda.current_device()`` and
    calls ``torch.cuda.synchronize()``, and the tensor-parallel mappings
    (sequence-parallel gathers / reduce-scatters, the expert all-to-all) and
    the sequence-parallel linear's backward allocate their outputs there. The
    name ``torch`` of those four modules
    is bound to a stand-in that forwards everything to ``torch`` except that a
    CUDA device becomes the CPU and ``torch.cuda.synchronize`` is a no-op
    (nothing else in the modules changes; the functions that use it are pinned).
``rope_cp_rank``
    ``get_pos_emb_on_this_cp_rank`` (as bound in ``rotary_pos_embedding``)
    moves its index to CUDA; on CPU the same selection with a CPU index (packed
    THD sequences do not call it: their RoPE is Megatron's per-sequence THD path).

Before patching, each upstream function is checked to exist and to still
contain the source lines the patch was written against; if not,
:class:`ShimError` is raised naming the function, rather than patching
something that has changed. The megatron-core version must be 0.16.x or 0.19.x,
with the exact release's source hashes pinned (:data:`UPSTREAM_SOURCE_SHA256`).

Model settings that the shim assumes: local layer specs
(``get_gpt_layer_local_spec``), ``SequentialMLP`` experts
(``moe_grouped_gemm=False``), ``use_cpu_initialization=True``,
``add_bias_linear=False``, no fusions. Process groups: ``cpu/process_groups.py`` (re-exported).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..megatron import _pin
from ..megatron._pin import SUPPORTED_VERSION_PREFIXES
from .process_groups import (
    destroy_single_process_gloo,
    find_free_port,
    init_single_process_gloo,
    run_distributed,
)

__all__ = [
    "PATCHES",
    "SUPPORTED_VERSION_PREFIXES",
    "UPSTREAM_SOURCE_SHA256",
    "ShimError",
    "apply",
    "applied",
    "check_version",
    "destroy_single_process_gloo",
    "find_free_port",
    "init_single_process_gloo",
    "patched",
    "revert",
    "run_distributed",
    "upstream_source_hashes",
]


_MISSING = object()
_LOCK = threading.Lock()


class ShimError(RuntimeError):
    """An upstream function the shim patches is missing or has changed."""


def _cpu_only() -> bool:
    return not torch.cuda.is_available()


class _CpuStreamPlaceholder:
    """Stands in for the class-level ``torch.cuda.Stream`` of the alltoall dispatcher."""

    def __repr__(self) -> str:
        return "<CPU placeholder for MoEAlltoAllTokenDispatcher.cuda_dtoh_stream>"


# ---------------------------------------------------------------------------
# Replacement factories: each takes the upstream object and returns the patch.
# ---------------------------------------------------------------------------


def _make_router_gating(original: Callable) -> Callable:
    from megatron.core.transformer.moe import router as router_mod

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        if not (_cpu_only() and self.weight.device.type == "cpu"):
            return original(self, input)
        router_dtype = input.dtype
        if self.config.moe_router_dtype == "fp32":
            router_dtype = torch.float32
        elif self.config.moe_router_dtype == "fp64":
            router_dtype = torch.float64
        return router_mod.router_gating_linear(input, self.weight, self.bias, router_dtype)

    return gating


def _make_rope_get_emb(original: Callable) -> Callable:
    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if not (_cpu_only() and self.inv_freq.device.type == "cpu"):
            return original(self, max_seq_len, offset)
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]

    return get_emb


def _make_rng_get_state(original: Callable) -> Callable:
    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        if not _cpu_only():
            return original(device=device, clone=clone, graph_safe=graph_safe)
        if graph_safe:
            raise ShimError("graph-safe (cudagraphable) RNG states are not supported on CPU")
        return torch.get_rng_state()

    return _get_cuda_rng_state


def _make_rng_set_state(original: Callable) -> Callable:
    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        if not _cpu_only():
            return original(new_state, device=device, graph_safe=graph_safe)
        if graph_safe:
            raise ShimError("graph-safe (cudagraphable) RNG states are not supported on CPU")
        torch.set_rng_state(new_state)

    return _set_cuda_rng_state


def _make_rng_tracker_add(original: Callable) -> Callable:
    def add(self, name, seed):
        if not _cpu_only():
            return original(self, name, seed)
        if self.use_cudagraphable_rng:
            raise ShimError("use_cudagraphable_rng=True is not supported on CPU")
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    return add


def _make_memory_buffer_get_tensor(original: Callable) -> Callable:
    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        if not _cpu_only():
            return original(self, tensor_shape, dtype, name, mem_alloc_context)
        required_len = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype), None)
        if buf is None or buf.numel() < required_len:
            with (mem_alloc_context or contextlib.nullcontext)():
                buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buf
        return buf[0:required_len].view(*tensor_shape)

    return get_tensor


def _make_causal_mask(original: Callable) -> Callable:
    @functools.lru_cache(maxsize=16)
    def _cpu_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        if not _cpu_only():
            return original(sq)
        return _cpu_mask(sq)

    return get_default_causal_mask


def _make_alltoall_stream(original: Any) -> Any:
    if original is None and _cpu_only():
        return _CpuStreamPlaceholder()
    return original


def _make_alltoall_dtoh(original: Callable) -> Callable:
    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not (_cpu_only() and isinstance(self.cuda_dtoh_stream, _CpuStreamPlaceholder)):
            return original(self, point, tokens_per_expert)
        # On CPU every tensor is already host-resident: nothing to copy or wait for,
        # but upstream hands the all-to-all its split sizes as NumPy arrays (the
        # as_numpy=True copies), which expert parallelism (ep > 1) reads.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    return _maybe_dtoh_and_synchronize


class _CpuCuda:
    """``torch.cuda`` as seen by the pipeline modules on a CPU-only machine."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _cpu_device(device: Any) -> Any:
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CpuTorch:
    """``torch`` as seen by the pipeline modules on a CPU-only machine: every
    attribute is torch's, except that the factories below map a CUDA device
    to the CPU and ``cuda`` is :class:`_CpuCuda`."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def empty(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def tensor(data: Any, *, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, device=_cpu_device(device), **kwargs)

    def __repr__(self) -> str:
        return "<compass CPU stand-in for torch (megatron_cpu)>"


def _make_module_torch(original: Any) -> Any:
    if original is torch and _cpu_only():
        return _CpuTorch()
    return original


def _make_rope_cp_rank(original: Callable) -> Callable:
    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if not (_cpu_only() and pos_emb.device.type == "cpu"):
            return original(pos_emb, seq_dim, cp_group)
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])
        pos_emb = pos_emb.view(
            *pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :]
        )
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])

    return get_pos_emb_on_this_cp_rank


def _make_te_general_gemm(original: Any) -> Any:
    if original is _MISSING:
        return None
    return original


@dataclass(frozen=True)
class _Patch:
    """One declared patch: where it goes and what upstream must look like."""

    name: str
    module: str
    owner: str | None  # class name inside ``module``; None for a module attribute
    attr: str
    make: Callable[[Any], Any]
    # Source lines the upstream function must contain (what the patch works around
    # and, where the patch re-implements the body, the lines it mirrors).
    fingerprint: tuple[str, ...] = ()
    # The attribute may be absent upstream (it is then created and later deleted).
    may_be_missing: bool = False
    # Functions of ``module`` (dotted names) whose behaviour the patch changes
    # without replacing them (a module-level name they read): their sources are
    # pinned in UPSTREAM_SOURCE_SHA256 as "<patch name>:<function>".
    readers: tuple[str, ...] = ()


#: All patches, in the order they are applied.
PATCHES: tuple[_Patch, ...] = (
    _Patch(
        "router_gating",
        "megatron.core.transformer.moe.router",
        "Router",
        "gating",
        _make_router_gating,
        (
            "self.weight.data = self.weight.data.to(device=torch.cuda.current_device())",
            "if self.config.moe_router_dtype == 'fp32':",
            "elif self.config.moe_router_dtype == 'fp64':",
            "logits = router_gating_linear(input, self.weight, self.bias, router_dtype)",
            "return logits",
        ),
    ),
    _Patch(
        "rope_get_emb",
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "RotaryEmbedding",
        "get_emb",
        _make_rope_get_emb,
        (
            "self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())",
            "freqs = self.get_freqs_non_repeated(max_seq_len, offset)",
            "emb = torch.cat((freqs, freqs), dim=-1)",
            "emb = emb[:, None, None, :]",
        ),
    ),
    _Patch(
        "rng_get_state",
        "megatron.core.tensor_parallel.random",
        None,
        "_get_cuda_rng_state",
        _make_rng_get_state,
        ("return torch.cuda.random.get_rng_state(device=device)",),
    ),
    _Patch(
        "rng_set_state",
        "megatron.core.tensor_parallel.random",
        None,
        "_set_cuda_rng_state",
        _make_rng_set_state,
        ("_lazy_call(cb)",),
    ),
    _Patch(
        "rng_tracker_add",
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker",
        "add",
        _make_rng_tracker_add,
        (
            "orig_rng_state = torch.cuda.get_rng_state()",
            "torch.cuda.manual_seed(seed)",
            "self.seeds_.add(seed)",
            "self.states_[name] = torch.cuda.get_rng_state()",
        ),
    ),
    _Patch(
        "memory_buffer",
        "megatron.core.utils",
        "GlobalMemoryBuffer",
        "get_tensor",
        _make_memory_buffer_get_tensor,
        (
            "device=torch.cuda.current_device(),",
            "return self.buffer[(name, dtype)][0:required_len].view(*tensor_shape)",
        ),
    ),
    _Patch(
        "causal_mask",
        "megatron.core.fusions.fused_softmax",
        None,
        "get_default_causal_mask",
        _make_causal_mask,
        ('torch.triu(torch.ones(sq, sq, device="cuda"), diagonal=1).bool()',),
    ),
    _Patch(
        "alltoall_stream",
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher",
        "cuda_dtoh_stream",
        _make_alltoall_stream,
    ),
    _Patch(
        "alltoall_dtoh",
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher",
        "_maybe_dtoh_and_synchronize",
        _make_alltoall_dtoh,
        (
            "with torch.cuda.stream(self.cuda_dtoh_stream):",
            "self.d2h_event = self.cuda_dtoh_stream.record_event()",
            "self.d2h_event.synchronize()",
        ),
    ),
    _Patch(
        "te_general_gemm",
        "megatron.core.transformer.moe.moe_utils",
        None,
        "te_general_gemm",
        _make_te_general_gemm,
        may_be_missing=True,
    ),
    _Patch(
        "schedules_torch",
        "megatron.core.pipeline_parallel.schedules",
        None,
        "torch",
        _make_module_torch,
        readers=(
            "forward_backward_no_pipelining",
            "forward_backward_pipelining_without_interleaving",
            "forward_step",
            "backward_step",
        ),
    ),
    _Patch(
        "p2p_torch",
        "megatron.core.pipeline_parallel.p2p_communication",
        None,
        "torch",
        _make_module_torch,
        readers=("P2PCommunicator._communicate_shapes", "P2PCommunicator._communicate"),
    ),
    _Patch(
        "mappings_torch",
        "megatron.core.tensor_parallel.mappings",
        None,
        "torch",
        _make_module_torch,
        readers=(
            "_gather_along_last_dim",
            "_gather_along_first_dim",
            "_reduce_scatter_along_first_dim",
            "_AllToAll.forward",
        ),
    ),
    _Patch(
        "layers_torch",
        "megatron.core.tensor_parallel.layers",
        None,
        "torch",
        _make_module_torch,
        readers=(
            "LinearWithGradAccumulationAndAsyncCommunication.forward",
            "LinearWithGradAccumulationAndAsyncCommunication.backward",
        ),
    ),
    _Patch(
        "rope_cp_rank",
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        None,
        "get_pos_emb_on_this_cp_rank",
        _make_rope_cp_rank,
        (
            "cp_idx = torch.tensor(",
            '[cp_rank, (2 * cp_size - cp_rank - 1)], device="cpu", pin_memory=True',
            "pos_emb = pos_emb.index_select(seq_dim, cp_idx)",
        ),
    ),
)

# name -> (owner object, attr, original value or _MISSING, installed value)
_APPLIED: dict[str, tuple[Any, str, Any, Any]] = {}


def check_version() -> str:
    """Return the megatron-core version, raising if the shim does not support it.

    Raises
    ------
    ShimError
        If megatron-core is not 0.16.x or 0.19.x.
    """
    return _pin.check_version(__name__, ShimError, "patches")


#: The pins of 0.16.1 (the table below; 0.19.2 shares most of them).
_PINS_0_16_1: dict[str, str] = {
    "router_gating": "53ab132db44923b06bc2c78ac14f1adc44d28ec72517965100951e2d7d361995",
    "rope_get_emb": "871b601dcf4014e1dde066ae58fa27729599da4235263277ab817124512a13ae",
    "rng_get_state": "7ed314c65930ea397cc34038dbb483c8d828c06e32188919bb5ea9ed5ffa428c",
    "rng_set_state": "f2ef98c2a7f87a72c99f6c5384ba730930a4f761cbb6778e60bf211f3e49f9e0",
    "rng_tracker_add": "40d5ea395b6f20e1b3c5705e9acef3ce0235045cf7d77464227e7527e97a65bf",
    "memory_buffer": "09c1d73f7818f422b75f5591e53feb98554ff7f3fbd451b5819d891fd3ad9174",
    "causal_mask": "510d896df7d6deca0ddfb6c2868ec4b4c857f86c5fbc048a47f79d0effb83cb8",
    "alltoall_dtoh": "43ba412fd6e14b091545b67e0e3501fb9946f30763dea3b42200113f5096e07e",
    "schedules_torch:forward_backward_no_pipelining": (
        "09e5065480e0809138566f12f34b4c8c2452bd4a56860078f3a33341d995f26d"
    ),
    "schedules_torch:forward_backward_pipelining_without_interleaving": (
        "c116bc96a60eff6bc54c893c734599aabd444a206b2675a8d703758320f2eaf9"
    ),
    "schedules_torch:forward_step": (
        "679f915a477e3c0c923bc6e2ea1b44a7a93314603b3a822234170d739a692caf"
    ),
    "schedules_torch:backward_step": (
        "f5e9f9aacc11b62db3dc430e9ac2d8299288bc97e19d5ac223131af9d5ad3aa0"
    ),
    "p2p_torch:P2PCommunicator._communicate_shapes": (
        "f2d510984e4cc6f80d7e84510396e7882ab8f173a2926bbaee9b70fef41fafdb"
    ),
    "p2p_torch:P2PCommunicator._communicate": (
        "fa37a87e9c688c7d8c6098a6c74d44a0d37ee11188f0e69246047cecf1bfe43b"
    ),
    "mappings_torch:_gather_along_last_dim": (
        "605c2ec305a4f9b24c3b9b90d834e7148893784c2e10cb7c719345578a3e7f3f"
    ),
    "mappings_torch:_gather_along_first_dim": (
        "7d7a6b5ee66d778c2b0ae8e3ce5c3f1398b3088a653d9b774bc981ea6465726e"
    ),
    "mappings_torch:_reduce_scatter_along_first_dim": (
        "9f477d99abfc7be9f46fe416954a96fdead47e7e0b92b98a8d435326b498ae9c"
    ),
    "mappings_torch:_AllToAll.forward": (
        "350ac9ac33560f9f944568e03b764e250a67cdde5faaad982ae4e4558f204143"
    ),
    "layers_torch:LinearWithGradAccumulationAndAsyncCommunication.forward": (
        "1982cdb2c18ee6eb56550be75425a7e7585c63350f9e687423178644dd60abe0"
    ),
    "layers_torch:LinearWithGradAccumulationAndAsyncCommunication.backward": (
        "c2aef746c773366c9da87e33fac2c9a272629a2ca5c4197b790473f8dd5e5604"
    ),
    "rope_cp_rank": "adf65ad9e9521e6da0482eceaa7d0a142ec95dba7df2551c1cfa967e8fb52364",
}

#: megatron-core version -> {patch name: sha256 of the normalized upstream source
#: (:func:`_megatron_pin.source_sha256`) of the function that patch replaces}. The shim
#: re-implements those functions, so any upstream change must be reviewed:
#: apply() refuses a version without an entry here, or a function whose source
#: hash differs. Patches of plain values (a stream attribute, a missing
#: function) have no entry. To add a version after reviewing the patches
#: against it: ``python -c "from compass_kernels.integration.cpu import megatron as m;
#: print(m.upstream_source_hashes())"`` and paste the result.
UPSTREAM_SOURCE_SHA256: dict[str, dict[str, str]] = {
    "0.16.1": _PINS_0_16_1,
    # Reviewed against 0.16.1: the re-implemented functions are unchanged; of the
    # readers of the torch stand-ins, the schedules drop backward_step's model_type and
    # read the stage from the p2p communicator, _AllToAll gains an async NCCL-stream
    # option, the linear gains GTP weight re-gathering: no new CUDA device use.
    "0.19.2": {
        **_PINS_0_16_1,
        "schedules_torch:forward_backward_no_pipelining": (
            "e160fbd4671fa92f547a1cafef6795c2a4fba4b9e50b839b4418c026055ca306"
        ),
        "schedules_torch:forward_backward_pipelining_without_interleaving": (
            "5adf72a1efbb27180dff90c0803e9dcd34b7c747f1affbadd2edf045352a6d78"
        ),
        "schedules_torch:backward_step": (
            "2c918bbaf2371ffb9678562cfcae6fc76f47d6a876db5af76a9767b2ef180cb4"
        ),
        "mappings_torch:_AllToAll.forward": (
            "701cede2651a55aa72c0b73fcf8e66185fe0abb0eb85c61a804b0ed2e85f556e"
        ),
        "layers_torch:LinearWithGradAccumulationAndAsyncCommunication.forward": (
            "369ddf3fd7e4065d5f1af63d86ea345b403ea6c7116c6b08acd5f0c2238e1f81"
        ),
        "layers_torch:LinearWithGradAccumulationAndAsyncCommunication.backward": (
            "637f3aba1be7d0dd21ea1945a2256598794242e06118d8266653cc318dbd1aa0"
        ),
    },
}


def _hashed(current: Any) -> bool:
    return inspect.isfunction(current) or inspect.ismethod(current)


def upstream_source_hashes() -> dict[str, str]:
    """{patch name: sha256} of the installed megatron-core's functions the patches
    replace (to review and pin a new version in :data:`UPSTREAM_SOURCE_SHA256`)."""
    out = {}
    for patch in PATCHES:
        _, current = _locate(patch)
        if patch.name in _APPLIED:  # hash upstream's function, not ours
            current = _APPLIED[patch.name][2]
        if _hashed(current):
            out[patch.name] = _pin.source_sha256(current)
        for reader, fn in _readers(patch):
            out[f"{patch.name}:{reader}"] = _pin.source_sha256(fn)
    return out


def _readers(patch: _Patch) -> list[tuple[str, Any]]:
    """(dotted name, function) of each reader of ``patch`` (see ``_Patch.readers``)."""
    module = importlib.import_module(patch.module)
    out = []
    for dotted in patch.readers:
        obj: Any = module
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise ShimError(f"patch {patch.name}: upstream {patch.module}.{dotted} is missing")
        out.append((dotted, inspect.unwrap(obj)))
    return out


def _check_hash(patch: _Patch, current: Any, where: str, version: str) -> None:
    pinned = UPSTREAM_SOURCE_SHA256.get(version)
    how = (
        "review the patch against the new upstream source, then pin the new hashes in "
        "compass_kernels/integration/cpu/megatron.py UPSTREAM_SOURCE_SHA256 "
        "(upstream_source_hashes() "
        "prints them)"
    )
    if pinned is None:
        raise ShimError(
            f"{__name__}: no upstream source hashes pinned for megatron-core "
            f"{version} (pinned: {sorted(UPSTREAM_SOURCE_SHA256)}); {how}"
        )
    for reader, fn in _readers(patch):
        key = f"{patch.name}:{reader}"
        actual = _pin.source_sha256(fn)
        if pinned.get(key) != actual:
            raise ShimError(
                f"patch {patch.name}: upstream {patch.module}.{reader} in megatron-core {version} "
                f"is not the function this patch was reviewed against (source sha256 {actual}, "
                f"pinned {pinned.get(key)}); {how}"
            )
    if not _hashed(current):
        return
    expected = pinned.get(patch.name)
    actual = _pin.source_sha256(current)
    if expected != actual:
        raise ShimError(
            f"patch {patch.name}: upstream {where} in megatron-core {version} is not the "
            f"function this shim re-implements (source sha256 {actual}, pinned {expected}); "
            f"{how}"
        )


def _locate(patch: _Patch) -> tuple[Any, Any]:
    """(owner, current value or _MISSING) of a patch target."""
    try:
        module = importlib.import_module(patch.module)
    except ImportError as exc:
        raise ShimError(f"patch {patch.name}: cannot import {patch.module}: {exc}") from exc
    owner: Any = module
    if patch.owner is not None:
        owner = getattr(module, patch.owner, None)
        if owner is None:
            raise ShimError(f"patch {patch.name}: {patch.module}.{patch.owner} is missing")
    if patch.owner is not None:
        return owner, owner.__dict__.get(patch.attr, _MISSING)
    return owner, getattr(owner, patch.attr, _MISSING)


def _resolve(patch: _Patch, version: str) -> tuple[Any, Any]:
    """Return (owner, current value) for a patch, verifying the upstream target:
    present, the pinned source hash for ``version``, the fingerprint lines."""
    owner, current = _locate(patch)
    where = f"{patch.module}.{patch.owner + '.' if patch.owner else ''}{patch.attr}"
    if current is _MISSING and not patch.may_be_missing:
        raise ShimError(f"patch {patch.name}: upstream {where} is missing")
    _check_hash(patch, current, where, version)
    if patch.fingerprint:
        try:
            source = inspect.getsource(current)
        except (OSError, TypeError) as exc:
            raise ShimError(f"patch {patch.name}: cannot read the source of {where}") from exc
        lost = [line for line in patch.fingerprint if line not in source]
        if lost:
            raise ShimError(
                f"patch {patch.name}: upstream {where} has changed (missing {lost!r}); "
                "the shim must be reviewed for this megatron-core version"
            )
    return owner, current


def apply() -> list[str]:
    """Install every patch of :data:`PATCHES` (idempotent).

    All targets are verified before anything is changed, so a failure leaves
    megatron-core untouched.

    Returns
    -------
    list of str
        Names of the patches installed by this call (empty if already applied).

    Raises
    ------
    ShimError
        If the megatron-core version is unsupported or an upstream target is
        missing or changed.
    """
    with _LOCK:
        version = check_version()
        todo = [p for p in PATCHES if p.name not in _APPLIED]
        resolved = [(p, *_resolve(p, version)) for p in todo]
        done = []
        for patch, owner, original in resolved:
            new = patch.make(original)
            setattr(owner, patch.attr, new)
            _APPLIED[patch.name] = (owner, patch.attr, original, new)
            done.append(patch.name)
        return done


def revert() -> list[str]:
    """Restore every upstream object replaced by :func:`apply` (idempotent).

    Returns
    -------
    list of str
        Names of the patches removed by this call.

    Raises
    ------
    ShimError
        If a patched attribute was replaced again by someone else since
        :func:`apply` (it is then left alone and the patch stays recorded).
    """
    with _LOCK:
        undone = []
        for patch in reversed(PATCHES):
            if patch.name not in _APPLIED:
                continue
            owner, attr, original, new = _APPLIED[patch.name]
            if isinstance(owner, type):
                current = owner.__dict__.get(attr, _MISSING)
            else:
                current = getattr(owner, attr, _MISSING)
            # Values (a stream placeholder, None) may legitimately be reassigned by
            # upstream code; functions must still be ours.
            if callable(new) and current is not new:
                raise ShimError(
                    f"patch {patch.name}: {attr} was replaced by someone else after apply(); "
                    "not reverting it"
                )
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
            del _APPLIED[patch.name]
            undone.append(patch.name)
        return undone


def applied() -> list[str]:
    """Names of the patches currently installed."""
    return [p.name for p in PATCHES if p.name in _APPLIED]


@contextlib.contextmanager
def patched():
    """Context manager: :func:`apply` on entry, :func:`revert` of what it added on exit."""
    added = apply()
    try:
        yield
    finally:
        if added:
            revert()
