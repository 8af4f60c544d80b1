"""megatron-core on real ranks: a parallel layout, Megatron's parallel state, this
rank's model and weights, and Megatron's gradient reduction.

One process per rank (``tp * pp * cp * dp`` of them), Megatron's
``parallel_state`` initialized with the layout (:meth:`Layout.megatron_sizes`;
expert parallelism inside it as Megatron defines it: the ``ep`` expert groups
are cut from the ``tp * cp * dp`` ranks of a pipeline stage, expert tensor
parallelism 1) by :func:`init_parallel_state`. Then, in each rank:

- :func:`build_rank_model`: this rank's ``GPTModel`` chunk (its pipeline
  stage's layers, its tensor-parallel shards, its experts), weights sliced
  from the full checkpoint by the model's own partition metadata. TP > 1 runs
  with sequence parallelism (Megatron requires it for MoE with TP and EP; it
  also splits the routers' tokens, so every token is routed on one TP rank).
  Micro-batches come THD-packed (``PackedSeqParams(qkv_format="thd")``): the
  core attention is ``thd_attention.ThdDotProductAttention``
  (the local ``DotProductAttention`` refuses packed sequences and CP; upstream's
  packed attention is Transformer Engine's).
- :func:`finalize_grads`: Megatron DDP's reduction without its buffers:
  sequence-parallel parameters summed over TP, dense gradients summed over the
  data x context-parallel group and expert gradients over the expert
  data-parallel group, both scaled by ``1 / (dp * cp)`` (DDP's
  ``gradient_scaling_factor``).
- :func:`grad_norm`: the global L2 norm, every parameter counted once.
- :func:`gather_hf_layer` / :func:`gathered_hf_state_dict`: the trained
  weights back under HF names (TP shards all-gathered, experts and layers from
  their owners).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = [
    "Layout",
    "RankInfo",
    "SequenceParallelRMSNorm",
    "TorchRMSNorm",
    "build_rank_model",
    "finalize_grads",
    "gathered_megatron_params",
    "global_name",
    "grad_norm",
    "init_parallel_state",
    "rank_info",
]


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dimensions (each >= 1).

    tp : tensor parallel (with sequence parallelism when > 1).
    pp : pipeline stages.
    ep : expert parallel, cut from the tp * cp * dp ranks of a stage.
    cp : context parallel (per-sequence zigzag split).
    dp : data parallel.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def __str__(self) -> str:
        parts = [f"{k}{v}" for k, v in self.as_dict().items() if v > 1]
        return "x".join(parts) or "single"

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "dp": self.dp}

    def check(self, hf_config: Any = None) -> Layout:
        """Raise ValueError naming the flag when the layout cannot run (on ``hf_config``)."""
        for name, v in self.as_dict().items():
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"--{name}: expected an int >= 1, got {v!r}")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise ValueError(
                f"--ep {self.ep}: expert parallelism is cut from the tp*cp*dp = "
                f"{self.tp * self.cp * self.dp} ranks of a pipeline stage; it must divide them"
            )
        if hf_config is None:
            return self
        layers = int(hf_config.num_hidden_layers)
        experts = int(getattr(hf_config, "num_experts", 0) or 0)
        heads = int(hf_config.num_attention_heads)
        groups = int(getattr(hf_config, "num_key_value_heads", heads) or heads)
        for flag, size, what, total in (
            ("pp", self.pp, "num_hidden_layers", layers),
            ("ep", self.ep, "num_experts", experts),
            ("tp", self.tp, "num_key_value_heads", groups),
            ("tp", self.tp, "vocab_size", int(hf_config.vocab_size)),
        ):
            if total % size:
                raise ValueError(f"--{flag} {size} does not divide the model's {what} ({total})")
        return self

    def megatron_sizes(self) -> dict[str, int]:
        """Keyword arguments of ``parallel_state.initialize_model_parallel``."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": 1,
        }

    def config_overrides(self) -> dict[str, Any]:
        """``TransformerConfig`` fields of this layout."""
        out: dict[str, Any] = dict(self.megatron_sizes())
        out["sequence_parallel"] = self.tp > 1
        if self.pp > 1:
            out["pipeline_dtype"] = torch.float32
            out["variable_seq_lengths"] = True  # packed micro-batches differ in length
        return out

    @property
    def pad_multiple(self) -> int:
        """Each sequence of a micro-batch is padded to a multiple of this: 2 * cp
        chunks for the zigzag split, times tp for the sequence-parallel split."""
        return (2 * self.cp if self.cp > 1 else 1) * self.tp


@dataclass(frozen=True)
class RankInfo:
    """This process's coordinates in Megatron's parallel state."""

    rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    edp: int  # expert data-parallel rank
    first_stage: bool
    last_stage: bool


def layout_rank_infos(layout: Layout) -> list[RankInfo]:
    """Every rank's coordinates in Megatron's default rank order (tp fastest, then cp,
    dp, pp), computed from the layout alone (no process group; ep / edp left 0): what
    the driver needs to cut each rank's share of a batch."""
    out = []
    for r in range(layout.world_size):
        tp = r % layout.tp
        cp = (r // layout.tp) % layout.cp
        dp = (r // (layout.tp * layout.cp)) % layout.dp
        pp = r // (layout.tp * layout.cp * layout.dp)
        out.append(RankInfo(r, tp, pp, cp, dp, 0, 0, pp == 0, pp == layout.pp - 1))
    return out


def init_parallel_state(seed: int, **parallel_sizes: int) -> bool:
    """Initialize Megatron's parallel state (``initialize_model_parallel(**parallel_sizes)``,
    e.g. :meth:`Layout.megatron_sizes`) and its RNG tracker (``seed``) unless already
    done; the default process group must exist. Returns True if this call
    initialized it."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        return False
    parallel_state.initialize_model_parallel(**parallel_sizes)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return True


def rank_info() -> RankInfo:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return RankInfo(
        rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        edp=ps.get_expert_data_parallel_rank(),
        first_stage=ps.is_pipeline_first_stage(),
        last_stage=ps.is_pipeline_last_stage(),
    )


# ---------------------------------------------------------------------------
# The rank's model
# ---------------------------------------------------------------------------


class TorchRMSNorm:
    """``torch.nn.RMSNorm`` built from Megatron's norm arguments (as upstream's
    ``WrappedTorchNorm``, which refuses any config with sequence parallelism)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("TorchRMSNorm: only RMSNorm without zero-centered gamma")
        return torch.nn.RMSNorm(hidden_size, eps=eps)


class SequenceParallelRMSNorm:
    """:class:`TorchRMSNorm` on sequence-parallel activations: its weight is marked
    ``sequence_parallel`` (each TP rank sees its piece of the tokens, so the
    gradient is summed over TP, as Megatron's own norms)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        norm: Any = TorchRMSNorm(config, hidden_size, eps)  # __new__: a torch.nn.RMSNorm
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _is_expert(param: torch.Tensor) -> bool:
    """A routed expert's weight (marked by :func:`build_rank_model`). Not
    Megatron's ``allreduce`` flag: that is True for experts when ep == 1, where
    with expert TP 1 and TP > 1 the expert data-parallel group (the replicas)
    still spans the TP ranks."""
    return bool(getattr(param, "compass_expert", False))


def global_name(model: torch.nn.Module, name: str) -> str:
    """The full-model (one-process) name of a parameter of this rank's chunk:
    local layer index -> global layer number, local expert -> global expert."""
    from megatron.core import parallel_state as ps

    m = _LAYER.match(name)
    if m is None:
        return name
    gpt: Any = model  # a Megatron GPTModel (megatron-core is untyped)
    layer = gpt.decoder.layers[int(m.group(1))]
    out = f"decoder.layers.{int(layer.layer_number) - 1}." + name[m.end() :]
    e = _EXPERT.search(out)
    if e is not None:
        n_local = int(gpt.config.num_moe_experts) // ps.get_expert_model_parallel_world_size()
        g = ps.get_expert_model_parallel_rank() * n_local + int(e.group(1))
        out = out[: e.start()] + f".mlp.experts.local_experts.{g}." + out[e.end() :]
    return out


def _shard_dim(local: torch.Size, full: torch.Size, name: str) -> int | None:
    if tuple(local) == tuple(full):
        return None
    dims = [i for i, (a, b) in enumerate(zip(local, full, strict=True)) if a != b]
    if len(local) != len(full) or len(dims) != 1 or full[dims[0]] % local[dims[0]]:
        raise ValueError(f"{name}: local shape {tuple(local)} is no shard of {tuple(full)}")
    return dims[0]


def _shard_group(param: torch.Tensor):
    from megatron.core import parallel_state as ps

    if _is_expert(param):
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def build_rank_model(
    hf_config: Any,
    hf_state_dict: Mapping[str, torch.Tensor] | None,
    layout: Layout,
    **config_overrides: Any,
):
    """This rank's ``GPTModel`` chunk (float32, CPU, eval mode), weights sliced
    from the full HF checkpoint. Megatron's parallel state must be initialized
    with ``layout.megatron_sizes()`` (and the CPU shim applied on a CPU host)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from compass_kernels.integration.megatron.convert import (
        _dims,
        _rope_theta,
        hf_to_megatron,
        megatron_config_from_hf,
    )
    from compass_kernels.integration.megatron.thd_attention import ThdDotProductAttention

    d = _dims(hf_config)
    layout.check(hf_config)
    overrides = layout.config_overrides()
    overrides.update(config_overrides)
    config = megatron_config_from_hf(hf_config, **overrides)
    spec = get_gpt_layer_local_spec(
        num_experts=d["experts"],
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    # THD-packed micro-batches, CP or not (the local attention takes neither)
    spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    if layout.tp > 1:
        # Sequence parallelism: upstream's local (torch) norms refuse it; the same
        # torch.nn.RMSNorm, its weight marked for the TP gradient sum.
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        sub = spec.submodules
        sub.input_layernorm = SequenceParallelRMSNorm
        sub.pre_mlp_layernorm = SequenceParallelRMSNorm
        sub.self_attention.submodules.q_layernorm = TorchRMSNorm
        sub.self_attention.submodules.k_layernorm = TorchRMSNorm
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config),
            layer_norm=SequenceParallelRMSNorm,
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=int(hf_config.vocab_size),
        max_sequence_length=int(hf_config.max_position_embeddings),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=d["tied"],
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=_rope_theta(hf_config),
    )
    for name, p in model.named_parameters():
        p.compass_expert = ".mlp.experts." in name
    if hf_state_dict is not None:
        full = hf_to_megatron(hf_state_dict, hf_config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                gname = global_name(model, name)
                if gname not in full:
                    raise KeyError(
                        f"rank {dist.get_rank()}: {name} ({gname}) not in the checkpoint"
                    )
                src = full[gname]
                dim = _shard_dim(p.shape, src.shape, gname)
                if dim is not None:
                    if "linear_fc1" in gname and config.gated_linear_unit:
                        raise NotImplementedError(
                            f"{gname}: a tensor-parallel gated fc1 (interleaved gate/up shards)"
                        )
                    group = _shard_group(p)
                    src = src.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]
                p.copy_(src)
    return model.eval()


# ---------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------


def finalize_grads(model: torch.nn.Module) -> None:
    """Megatron DDP's gradient reduction (``finalize_model_grads`` without the
    contiguous buffers): sequence-parallel parameters (norms, routers) summed
    over TP; dense gradients over the data x context-parallel group, expert
    gradients over the expert data-parallel group, both times 1 / (dp * cp)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    edp = ps.get_expert_data_parallel_group()
    scale = 1.0 / dist.get_world_size(dp_cp)
    tp_size = dist.get_world_size(tp_group)
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
        # sequence-parallel weights and the QK norms (shared by the TP ranks' heads)
        qk_norm = "q_layernorm" in name or "k_layernorm" in name
        if tp_size > 1 and (getattr(p, "sequence_parallel", False) or qk_norm):
            dist.all_reduce(g, group=tp_group)
        group = edp if _is_expert(p) else dp_cp
        if dist.get_world_size(group) > 1:
            dist.all_reduce(g, group=group)
        if scale != 1.0:
            g.mul_(scale)


def _counted_once(p: torch.Tensor) -> bool:
    """Whether this rank's copy of ``p`` is the one the global norm counts."""
    from megatron.core import parallel_state as ps

    if _is_expert(p):
        return ps.get_expert_data_parallel_rank() == 0
    if ps.get_data_parallel_rank() != 0 or ps.get_context_parallel_rank() != 0:
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or (
        ps.get_tensor_model_parallel_rank() == 0
    )


def grad_norm(model: torch.nn.Module) -> float:
    """Global L2 norm of the (finalized) gradients over every rank, each parameter once."""
    import torch.distributed as dist

    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None and _counted_once(p):
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    return math.sqrt(float(sq))


def clip_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Clip by the global norm (as ``torch.nn.utils.clip_grad_norm_`` in one
    process); returns the norm before clipping."""
    norm = grad_norm(model)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


# ---------------------------------------------------------------------------
# Weights back to the full model
# ---------------------------------------------------------------------------


def model_part(name: str) -> str | int:
    """The part (``compass_kernels.integration.megatron.convert.megatron_parts``) a
    full-model Megatron parameter name belongs to: "embedding", a decoder layer number,
    or "final"."""
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return "final"
    raise ValueError(f"{name!r}: not a GPTModel parameter of a known part")


def gathered_megatron_params(
    model: torch.nn.Module, part: str | int | None = None
) -> dict[str, torch.Tensor]:
    """This rank's share of the full model's Megatron parameters, TP shards
    all-gathered (a collective: every rank of the TP group must call it), under
    full-model names. Only the owner of each parameter returns it (dense: dp
    and cp rank 0, tp rank 0; experts: expert data-parallel rank 0), so the
    union over ranks is the full state dict, each name once. ``part``: only
    that part's parameters (:func:`model_part`; every rank of a TP group holds the
    same names, so the gathers stay in step)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    tp_rank0 = ps.get_tensor_model_parallel_rank() == 0
    for name, p in model.named_parameters():
        if part is not None and model_part(global_name(model, name)) != part:
            continue
        t = p.detach()
        if bool(getattr(p, "tensor_model_parallel", False)):
            group = _shard_group(p)
            ws = dist.get_world_size(group)
            if ws > 1:
                parts = [torch.empty_like(t) for _ in range(ws)]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts, dim=int(cast(Any, p).partition_dim))  # set by Megatron
        if _is_expert(p):
            owner = ps.get_expert_data_parallel_rank() == 0
        else:
            owner = (
                tp_rank0
                and ps.get_data_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0
            )
        if owner:
            out[global_name(model, name)] = t.clone()
    return out
