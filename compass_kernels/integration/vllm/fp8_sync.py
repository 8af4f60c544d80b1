"""Trainer -> rollout FP8 weight sync: bf16 weights to vLLM's block-FP8 layout.

vLLM's block-FP8 models (``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``, e.g. the
Qwen3-MoE-FP8 and DeepSeek-V3 checkpoints) load, per linear weight ``W``
``[N, K]``: ``<name>.weight`` float8_e4m3fn ``[N, K]`` and
``<name>.weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]`` (K-major),
with ``W ~ weight * weight_scale_inv`` per 128x128 block. Embeddings,
``lm_head``, norms and the MoE router (``mlp.gate``) stay in bf16.

:class:`FP8WeightSync` turns a stream of ``(hf_name, bf16 tensor)`` pairs (an
HF state dict, or a Megatron one through :func:`from_megatron`) into that
layout, one tensor at a time (the extra memory it holds is one tensor's FP8
copy and scales, at most one layer), with ``ck.fp8.quantize_blockwise``:
bit-identical to vLLM's own ``per_block_cast_to_fp8`` (tests). It refuses
float32 inputs by default: quantizing the fp32 master instead of the bf16
weights the trainer's forward uses raised the step-2 KL 20x in one framework.

Each sync returns a :class:`SyncReport`; with ``track_changes`` it says what
fraction of the weights that changed since the last sync kept the same FP8
value (code and scale): the part of the step's update the rounding swallowed.

The arithmetic lives in ``compass_kernels.fp8``; this module is naming,
streaming and bookkeeping.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import compass_kernels as ck

__all__ = [
    "BLOCK",
    "FP8WeightSync",
    "SyncReport",
    "from_megatron",
    "is_block_fp8_weight",
    "quantization_config",
    "logprob_agreement",
]

BLOCK = (128, 128)

# Linear weights vLLM's block-FP8 Qwen3-MoE / Qwen3 / DeepSeek-style models
# hold in FP8: attention projections, dense MLPs, routed and shared experts.
_FP8_WEIGHT = re.compile(
    r"(^|\.)("
    r"self_attn\.(q_proj|k_proj|v_proj|o_proj|qkv_proj)"
    r"|mlp\.(gate_proj|up_proj|down_proj|gate_up_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts?\.(gate_proj|up_proj|down_proj)"
    r")\.weight$"
)


def is_block_fp8_weight(name: str) -> bool:
    """Whether vLLM's block-FP8 checkpoints hold HF weight ``name`` in FP8."""
    return _FP8_WEIGHT.search(name) is not None


def quantization_config(block: tuple[int, int] = BLOCK) -> dict[str, Any]:
    """The ``quantization_config`` of a block-FP8 HF config.json (what vLLM reads)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }


@dataclass
class SyncReport:
    """What one sync did.

    quantized / passed : tensors converted to FP8 / passed through (bf16).
    fp8_bytes : bytes of FP8 weights and scales produced.
    peak_extra_bytes : the most bytes of output the stream held at once (one tensor).
    changed : elements of FP8 weights whose bf16 value changed since the last sync
        (None on the first sync or without ``track_changes``).
    swallowed : of those, elements whose FP8 value (code and block scale) did not change.
    swallowed_fraction : swallowed / changed.
    swallowed_update_fraction : the share of sum |delta w| over changed elements
        that falls on swallowed ones.
    per_tensor : name -> (changed, swallowed).
    """

    quantized: int = 0
    passed: int = 0
    fp8_bytes: int = 0
    peak_extra_bytes: int = 0
    changed: int | None = None
    swallowed: int | None = None
    swallowed_fraction: float | None = None
    swallowed_update_fraction: float | None = None
    per_tensor: dict[str, tuple[int, int]] = field(default_factory=dict)


class FP8WeightSync:
    """Convert bf16 weights to vLLM's block-FP8 checkpoint layout, streaming.

    Parameters
    ----------
    block : (128, 128), vLLM's ``weight_block_size``.
    ue8m0 : power-of-two scales (DeepGEMM's UE8M0 mode; vLLM's default is False).
    track_changes : keep, on the CPU, the last synced bf16 weights and their
        FP8 values (3 bytes per FP8 parameter) to report what the rounding
        swallowed. A diagnostic: off for large models unless wanted.
    require_bf16 : refuse float32 sources (see the module docstring).
    backend : ck.fp8 backend (None: default dispatch).
    """

    def __init__(
        self,
        *,
        block: tuple[int, int] = BLOCK,
        ue8m0: bool = False,
        track_changes: bool = False,
        require_bf16: bool = True,
        backend: str | None = None,
    ) -> None:
        self.block = block
        self.ue8m0 = ue8m0
        self.track_changes = track_changes
        self.require_bf16 = require_bf16
        self.backend = backend
        self._previous: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.report = SyncReport()

    def stream(
        self, named_weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` in vLLM's block-FP8 layout, one input at a time.

        FP8 weights come out as ``name`` (float8_e4m3fn) then
        ``name[:-len("weight")] + "weight_scale_inv"`` (float32); others unchanged.
        :attr:`report` is complete once the stream is exhausted.
        """
        items = named_weights.items() if isinstance(named_weights, Mapping) else named_weights
        report = self.report = SyncReport()
        changed = swallowed = 0
        delta_all = delta_swallowed = 0.0
        tracked = False
        for name, w in items:
            if not is_block_fp8_weight(name):
                report.passed += 1
                yield name, w
                continue
            if self.require_bf16 and w.dtype != torch.bfloat16:
                raise ValueError(
                    f"{name}: expected the bf16 weights the trainer's forward uses, got "
                    f"{w.dtype} (quantizing an fp32 master gives different FP8 values; pass "
                    "require_bf16=False to allow it)"
                )
            q, s = ck.fp8.quantize_blockwise(
                w.detach(), block=self.block, ue8m0=self.ue8m0, backend=self.backend
            )
            nbytes = q.numel() + 4 * s.numel()
            report.quantized += 1
            report.fp8_bytes += nbytes
            report.peak_extra_bytes = max(report.peak_extra_bytes, nbytes)
            if self.track_changes:
                stats = self._track(name, w, q, s)
                if stats is not None:
                    tracked = True
                    c, sw, d_all, d_sw = stats
                    report.per_tensor[name] = (c, sw)
                    changed, swallowed = changed + c, swallowed + sw
                    delta_all, delta_swallowed = delta_all + d_all, delta_swallowed + d_sw
            yield name, q
            yield name[: -len("weight")] + "weight_scale_inv", s
            del q, s
        if tracked:
            report.changed, report.swallowed = changed, swallowed
            report.swallowed_fraction = swallowed / changed if changed else 0.0
            report.swallowed_update_fraction = delta_swallowed / delta_all if delta_all else 0.0

    def convert(self, named_weights) -> dict[str, torch.Tensor]:
        """:meth:`stream` collected into a dict (tests, saving a checkpoint)."""
        return dict(self.stream(named_weights))

    def _track(self, name, w, q, s):
        w_cpu = w.detach().to("cpu", copy=True)
        q_cpu, s_cpu = q.to("cpu").view(torch.uint8), s.to("cpu")
        prev = self._previous.get(name)
        self._previous[name] = (w_cpu, q_cpu, s_cpu)
        if prev is None or prev[0].shape != w_cpu.shape:
            return None
        pw, pq, ps = prev
        moved = w_cpu != pw
        same_scale = _expand(s_cpu == ps, w_cpu.shape, self.block)
        kept = moved & (q_cpu == pq) & same_scale
        delta = (w_cpu.float() - pw.float()).abs()
        return int(moved.sum()), int(kept.sum()), float(delta.sum()), float(delta[kept].sum())


def _expand(blocks: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    br, bc = block
    rows, cols = shape[-2:]
    return blocks.repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]


def from_megatron(
    mcore_state_dict: Mapping[str, torch.Tensor], hf_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named bf16 weights of a megatron-core Qwen3-MoE state dict (for :meth:`stream`)."""
    from compass_kernels.integration.megatron.convert import megatron_to_hf

    yield from megatron_to_hf(mcore_state_dict, hf_config).items()


def logprob_agreement(
    logits_ref: torch.Tensor, logits_new: torch.Tensor, targets: torch.Tensor
) -> dict[str, float]:
    """The FP8 quality gate's numbers for one batch of logits [T, V] and targets [T].

    ratio_err_max / ratio_err_mean : max / mean over tokens of exp|logp_new - logp_ref|
        of the target token (the per-token probability-ratio error; NeMo's bar: <= 1.03-1.05).
    kl_mean / kl_max : KL(ref || new) of the full next-token distributions, per token.
    """
    lp_ref = torch.log_softmax(logits_ref.double(), -1)
    lp_new = torch.log_softmax(logits_new.double(), -1)
    t = targets.reshape(-1, 1)
    ratio = torch.exp((lp_new.gather(-1, t) - lp_ref.gather(-1, t)).abs()).squeeze(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_new)).sum(-1)
    return {
        "ratio_err_max": float(ratio.max()),
        "ratio_err_mean": float(ratio.mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "tokens": int(t.numel()),
    }
