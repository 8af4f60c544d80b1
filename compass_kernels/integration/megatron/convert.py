"""HF <-> Megatron-core weight conversion for the Qwen3-MoE family.

The HF side is the checkpoint layout (what ``save_pretrained`` writes and vLLM
reads): one tensor per expert projection,
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``. The fused
layout of transformers >= 5 modules (``mlp.experts.gate_up_proj`` [E, 2I, H]
and ``mlp.experts.down_proj`` [E, H, I]) is accepted as input too, and can be
produced with ``fused_experts=True``.

The Megatron side is a ``GPTModel`` built from local layer specs
(``get_gpt_layer_local_spec``) with ``SequentialMLP`` experts:

================================================  =================================================
HF                                                Megatron-core
================================================  =================================================
``model.embed_tokens.weight``                     ``embedding.word_embeddings.weight``
``model.layers.{i}.input_layernorm.weight``       ``decoder.layers.{i}.input_layernorm.weight``
``...self_attn.{q,k,v}_proj.weight``              ``...self_attention.linear_qkv.weight`` (fused)
``...self_attn.q_norm.weight`` / ``k_norm``       ``...self_attention.q_layernorm.weight`` / ``k_``
``...self_attn.o_proj.weight``                    ``...self_attention.linear_proj.weight``
``...post_attention_layernorm.weight``            ``...pre_mlp_layernorm.weight``
``...mlp.gate.weight``                            ``...mlp.router.weight``
``...mlp.experts.{e}.gate_proj`` + ``up_proj``    ``...mlp.experts.local_experts.{e}.linear_fc1``
``...mlp.experts.{e}.down_proj.weight``           ``...mlp.experts.local_experts.{e}.linear_fc2``
``model.norm.weight``                             ``decoder.final_layernorm.weight``
``lm_head.weight`` (untied only)                  ``output_layer.weight``
================================================  =================================================

The fused QKV weight is ordered per query group: for each of the
``num_key_value_heads`` groups, that group's query heads, then its key head,
then its value head (``head_dim`` rows each). All conversions are pure
re-layouts (``cat`` / ``view`` / slicing), so a round trip is bitwise exact.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "build_megatron_model",
    "hf_to_megatron",
    "load_hf_state_dict",
    "megatron_config_from_hf",
    "megatron_part_to_hf",
    "megatron_parts",
    "megatron_to_hf",
]

_HF_LAYER = "model.layers.{i}."
_DIM_NAMES = ("hidden", "head_dim", "groups", "heads", "experts", "ffn")
_MC_LAYER = "decoder.layers.{i}."


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def _num_experts(hf_config: Any) -> int:
    n = _get(hf_config, "num_experts")
    if n is None:
        n = _get(hf_config, "num_local_experts")
    return n


def _rope_theta(hf_config: Any) -> float:
    params = _get(hf_config, "rope_parameters")
    if isinstance(params, Mapping):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(
                f"hf_config.rope_parameters.rope_type={rope_type!r} is not supported "
                "(only default RoPE)"
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    scaling = _get(hf_config, "rope_scaling")
    if scaling:
        raise ValueError(f"hf_config.rope_scaling={scaling!r} is not supported (only default RoPE)")
    theta = _get(hf_config, "rope_theta")
    if theta is None:
        raise ValueError("hf_config has no rope_theta (neither rope_parameters nor rope_theta)")
    return float(theta)


def _dims(hf_config: Any) -> dict[str, int]:
    """Validate a Qwen3-MoE config and return the dimensions the converter needs."""
    if hf_config is None:
        raise ValueError("hf_config must be a Qwen3-MoE config, got None")
    model_type = _get(hf_config, "model_type")
    if model_type != "qwen3_moe":
        raise ValueError(f"hf_config.model_type must be 'qwen3_moe', got {model_type!r}")
    layers = int(hf_config.num_hidden_layers)
    dense = list(_get(hf_config, "mlp_only_layers", []) or [])
    step = int(_get(hf_config, "decoder_sparse_step", 1) or 1)
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if len(sparse) != layers:
        raise ValueError(
            "hf_config has dense (non-MoE) layers "
            f"(mlp_only_layers={dense}, decoder_sparse_step={step}); only all-MoE models "
            "are supported"
        )
    if _get(hf_config, "attention_bias", False):
        raise ValueError("hf_config.attention_bias=True is not supported")
    heads = int(hf_config.num_attention_heads)
    groups = int(_get(hf_config, "num_key_value_heads", heads) or heads)
    if heads % groups:
        raise ValueError(
            f"hf_config.num_key_value_heads ({groups}) must divide num_attention_heads ({heads})"
        )
    hidden = int(hf_config.hidden_size)
    head_dim = _get(hf_config, "head_dim") or hidden // heads
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "groups": groups,
        "head_dim": int(head_dim),
        "experts": int(_num_experts(hf_config)),
        "ffn": int(hf_config.moe_intermediate_size),
        "tied": bool(_get(hf_config, "tie_word_embeddings", False)),
    }


def megatron_config_from_hf(hf_config: Any, **overrides: Any):
    """Build a megatron-core ``TransformerConfig`` equivalent to a Qwen3-MoE HF config.

    Parameters
    ----------
    hf_config : transformers.Qwen3MoeConfig
        The HF configuration (``model_type == "qwen3_moe"``, all layers MoE).
    **overrides
        ``TransformerConfig`` fields to set differently (e.g.
        ``moe_token_dispatcher_type="allgather"``, ``tensor_model_parallel_size=2``).

    Returns
    -------
    megatron.core.transformer.TransformerConfig
        float32, CPU initialization, no biases, no fusions, RMSNorm, QK
        layernorm, SwiGLU experts, softmax top-k router (renormalized over the
        top-k when ``norm_topk_prob``), no aux loss, no dropout.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    d = _dims(hf_config)
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hf_config.hidden_act must be 'silu', got {hf_config.hidden_act!r}")
    kwargs: dict[str, Any] = {
        "num_layers": d["layers"],
        "hidden_size": d["hidden"],
        "num_attention_heads": d["heads"],
        "num_query_groups": d["groups"],
        "kv_channels": d["head_dim"],
        "ffn_hidden_size": int(_get(hf_config, "intermediate_size", d["ffn"])),
        "num_moe_experts": d["experts"],
        "moe_ffn_hidden_size": d["ffn"],
        "moe_router_topk": int(hf_config.num_experts_per_tok),
        "moe_router_score_function": "softmax",
        # norm_topk_prob=True: softmax over the top-k logits == renormalized top-k probs.
        # norm_topk_prob=False: softmax over all experts, then top-k (no renormalization).
        "moe_router_pre_softmax": not bool(_get(hf_config, "norm_topk_prob", False)),
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf_config.rms_norm_eps),
        "qk_layernorm": True,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "persist_layer_norm": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "attention_softmax_in_fp32": True,
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_megatron_model(
    hf_config: Any,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    **config_overrides: Any,
):
    """Build a megatron-core ``GPTModel`` for a Qwen3-MoE HF config.

    Megatron's parallel state must be initialized first (e.g. with
    :func:`compass_kernels.integration.cpu.megatron.init_single_process_gloo`), and on a
    machine without CUDA the CPU shim must be applied.

    Parameters
    ----------
    hf_config : transformers.Qwen3MoeConfig
        The HF configuration.
    state_dict : mapping of str to Tensor, optional
        HF weights (checkpoint or fused layout) to load, converted with
        :func:`hf_to_megatron`. Loading is strict: every parameter must be set.
    **config_overrides
        Passed to :func:`megatron_config_from_hf`.

    Returns
    -------
    megatron.core.models.gpt.GPTModel
        On the CPU, float32, in eval mode.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    d = _dims(hf_config)
    config = megatron_config_from_hf(hf_config, **config_overrides)
    spec = get_gpt_layer_local_spec(
        num_experts=d["experts"],
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=int(hf_config.vocab_size),
        max_sequence_length=int(hf_config.max_position_embeddings),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=d["tied"],
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=_rope_theta(hf_config),
    )
    if state_dict is not None:
        converted = hf_to_megatron(state_dict, hf_config)
        result = model.load_state_dict(converted, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"state_dict does not match the model: missing {missing}, "
                f"unexpected {result.unexpected_keys}"
            )
    return model.eval()


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` file of an HF checkpoint folder into one dict.

    Parameters
    ----------
    path : str or os.PathLike
        Checkpoint folder.

    Returns
    -------
    dict of str to Tensor
        The tensors in checkpoint layout, on the CPU.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"path {str(folder)!r} holds no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(file)))
    return out


def _layer_renames(d: dict[str, int]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Per-layer weights that only change name: (HF suffix, Megatron suffix, shape).
    Both directions read this one table."""
    h, hd, nh, ne = d["hidden"], d["head_dim"], d["heads"], d["experts"]
    return [
        ("input_layernorm.weight", "input_layernorm.weight", (h,)),
        ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", (hd,)),
        ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", (hd,)),
        ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", (h, nh * hd)),
        ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", (h,)),
        ("mlp.gate.weight", "mlp.router.weight", (ne, h)),
    ]


class _Reader:
    """Reads one source state dict by key with a shape check, remembering what
    was read so that leftover (unknown) keys can be reported."""

    def __init__(self, sd: Mapping[str, torch.Tensor], arg: str) -> None:
        if not isinstance(sd, Mapping):
            raise TypeError(f"{arg} must be a mapping, got {type(sd).__name__}")
        self.used: set[str] = set()
        self.sd, self.arg = sd, arg

    def __contains__(self, key: str) -> bool:
        return key in self.sd

    def __call__(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in self.sd:
            raise KeyError(f"{self.arg} is missing {key!r}")
        t = self.sd[key]
        if tuple(t.shape) != shape:
            raise ValueError(f"{self.arg}[{key!r}] has shape {tuple(t.shape)}, expected {shape}")
        self.used.add(key)
        return t

    def check_consumed(self) -> None:
        extra = sorted(
            k
            for k in self.sd
            if k not in self.used and not k.endswith("_extra_state") and "rotary_emb" not in k
        )
        if extra:
            raise ValueError(f"{self.arg} has unexpected keys (first 5): {extra[:5]}")


def hf_to_megatron(
    hf_state_dict: Mapping[str, torch.Tensor], hf_config: Any
) -> dict[str, torch.Tensor]:
    """Convert Qwen3-MoE HF weights to a megatron-core ``GPTModel`` state dict.

    Parameters
    ----------
    hf_state_dict : mapping of str to Tensor
        HF weights in checkpoint layout (per-expert tensors) or in the fused
        transformers-module layout.
    hf_config : transformers.Qwen3MoeConfig
        The model's configuration.

    Returns
    -------
    dict of str to Tensor
        Megatron parameter names to tensors (no ``_extra_state`` entries).

    Raises
    ------
    KeyError
        If a required weight is missing.
    ValueError
        If a weight has the wrong shape or an unknown key is present.
    """
    take = _Reader(hf_state_dict, "hf_state_dict")
    d = _dims(hf_config)
    h, hd, ng, nh, ne, ffn = (d[k] for k in _DIM_NAMES)
    vocab = int(hf_config.vocab_size)
    out: dict[str, torch.Tensor] = {}

    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight", (vocab, h))
    per_group = nh // ng
    for i in range(d["layers"]):
        src, dst = _HF_LAYER.format(i=i), _MC_LAYER.format(i=i)
        for hf_name, mc_name, shape in _layer_renames(d):
            out[dst + mc_name] = take(src + hf_name, shape)
        q = take(src + "self_attn.q_proj.weight", (nh * hd, h)).reshape(ng, per_group * hd, h)
        k = take(src + "self_attn.k_proj.weight", (ng * hd, h)).reshape(ng, hd, h)
        v = take(src + "self_attn.v_proj.weight", (ng * hd, h)).reshape(ng, hd, h)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        fused = src + "mlp.experts.gate_up_proj" in take
        if fused:
            gate_up = take(src + "mlp.experts.gate_up_proj", (ne, 2 * ffn, h))
            down = take(src + "mlp.experts.down_proj", (ne, h, ffn))
        for e in range(ne):
            exp_dst = dst + f"mlp.experts.local_experts.{e}."
            if fused:
                fc1, fc2 = gate_up[e], down[e]
            else:
                exp_src = src + f"mlp.experts.{e}."
                gate = take(exp_src + "gate_proj.weight", (ffn, h))
                up = take(exp_src + "up_proj.weight", (ffn, h))
                fc1 = torch.cat([gate, up], dim=0)
                fc2 = take(exp_src + "down_proj.weight", (h, ffn))
            out[exp_dst + "linear_fc1.weight"] = fc1.contiguous()
            out[exp_dst + "linear_fc2.weight"] = fc2.contiguous()
    out["decoder.final_layernorm.weight"] = take("model.norm.weight", (h,))
    if not d["tied"]:
        out["output_layer.weight"] = take("lm_head.weight", (vocab, h))
    elif "lm_head.weight" in take:
        take.used.add("lm_head.weight")  # tied copy some checkpoints store; the embedding wins
    take.check_consumed()
    return out


def megatron_to_hf(
    mcore_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    fused_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """Convert a megatron-core ``GPTModel`` state dict to Qwen3-MoE HF weights.

    Parameters
    ----------
    mcore_state_dict : mapping of str to Tensor
        ``GPTModel.state_dict()`` (``_extra_state`` entries are ignored) or the
        output of :func:`hf_to_megatron`.
    hf_config : transformers.Qwen3MoeConfig
        The model's configuration.
    fused_experts : bool, default False
        False: checkpoint layout (per-expert ``gate_proj`` / ``up_proj`` /
        ``down_proj``). True: the fused layout of transformers modules
        (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).

    Returns
    -------
    dict of str to Tensor
        HF names to tensors (views of the inputs where possible).
    """
    take = _Reader(mcore_state_dict, "mcore_state_dict")
    out: dict[str, torch.Tensor] = {}
    for part in megatron_parts(hf_config):
        out.update(_to_hf_part(take, hf_config, part, fused_experts))
    take.check_consumed()
    return out


def megatron_parts(hf_config: Any) -> list[str | int]:
    """The parts :func:`megatron_part_to_hf` converts, in model order:
    "embedding", each decoder layer number (0-based int), "final" (final norm and,
    untied, the output layer). Their union is the whole model."""
    return ["embedding", *range(int(hf_config.num_hidden_layers)), "final"]


def megatron_part_to_hf(
    mcore_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    part: str | int,
    *,
    fused_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """:func:`megatron_to_hf` of one part (see :func:`megatron_parts`):
    ``mcore_state_dict`` holds exactly that part's megatron-core tensors (full,
    TP-gathered, full-model names); returns its HF tensors. A layer-by-layer
    weight sync converts one part at a time (peak extra memory: one layer)."""
    take = _Reader(mcore_state_dict, "mcore_state_dict")
    out = _to_hf_part(take, hf_config, part, fused_experts)
    take.check_consumed()
    return out


def _to_hf_part(
    take: _Reader, hf_config: Any, part: str | int, fused_experts: bool
) -> dict[str, torch.Tensor]:
    d = _dims(hf_config)
    h, hd, ng, nh, ne, ffn = (d[k] for k in _DIM_NAMES)
    vocab = int(hf_config.vocab_size)
    out: dict[str, torch.Tensor] = {}
    if part == "embedding":
        out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight", (vocab, h))
        return out
    if part == "final":
        out["model.norm.weight"] = take("decoder.final_layernorm.weight", (h,))
        if not d["tied"]:
            out["lm_head.weight"] = take("output_layer.weight", (vocab, h))
        return out
    if not isinstance(part, int) or not 0 <= part < d["layers"]:
        raise ValueError(
            f"part must be 'embedding', 'final' or a layer in [0, {d['layers']}), got {part!r}"
        )
    per_group = nh // ng
    qkv_rows = (per_group + 2) * hd
    i = part
    src, dst = _MC_LAYER.format(i=i), _HF_LAYER.format(i=i)
    for hf_name, mc_name, shape in _layer_renames(d):
        out[dst + hf_name] = take(src + mc_name, shape)
    qkv = take(src + "self_attention.linear_qkv.weight", (ng * qkv_rows, h)).reshape(
        ng, qkv_rows, h
    )
    q, k, v = torch.split(qkv, [per_group * hd, hd, hd], dim=1)
    out[dst + "self_attn.q_proj.weight"] = q.reshape(nh * hd, h).contiguous()
    out[dst + "self_attn.k_proj.weight"] = k.reshape(ng * hd, h).contiguous()
    out[dst + "self_attn.v_proj.weight"] = v.reshape(ng * hd, h).contiguous()
    fc1s, fc2s = [], []
    for e in range(ne):
        exp_src = src + f"mlp.experts.local_experts.{e}."
        fc1s.append(take(exp_src + "linear_fc1.weight", (2 * ffn, h)))
        fc2s.append(take(exp_src + "linear_fc2.weight", (h, ffn)))
    if fused_experts:
        out[dst + "mlp.experts.gate_up_proj"] = torch.stack(fc1s)
        out[dst + "mlp.experts.down_proj"] = torch.stack(fc2s)
    else:
        for e in range(ne):
            exp_dst = dst + f"mlp.experts.{e}."
            gate, up = torch.split(fc1s[e], [ffn, ffn], dim=0)
            out[exp_dst + "gate_proj.weight"] = gate.contiguous()
            out[exp_dst + "up_proj.weight"] = up.contiguous()
            out[exp_dst + "down_proj.weight"] = fc2s[e]
    return out
