"""The Megatron experts hook (compass_kernels/integration/megatron/fp8_moe.py) on a real
megatron-core SequentialMLP on CPU (gloo, world size 1): under no_grad its FP8
forward agrees with Megatron's own bf16 experts forward (same weights, same
grouped rows, probs applied), the weight layout is Megatron's (a swapped GLU
would disagree), the FP8 weights follow optimizer updates, the training forward
(grad enabled) is Megatron's own, and revert restores the module."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("megatron.core")

import compass_kernels as ck  # noqa: E402
from compass_kernels.integration.megatron import fp8_moe as hook  # noqa: E402

pytestmark = pytest.mark.integration

E, H, INTER = 5, 256, 192


@pytest.fixture(scope="module")
def experts():
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from compass_kernels.integration.cpu.megatron import init_single_process_gloo

    init_single_process_gloo(seed=0)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=512,
        moe_ffn_hidden_size=INTER,
        num_moe_experts=E,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    mlp = spec.submodules.mlp  # a ModuleSpec (0.16) or a functools.partial (0.19) of MoELayer
    if isinstance(mlp, functools.partial):
        module = mlp.keywords["submodules"].experts(E, cfg, pg_collection=pgs)
    else:
        module = build_module(mlp.submodules.experts, E, cfg, pg_collection=pgs)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in module.local_experts:
            m.linear_fc1.weight.copy_(torch.randn(2 * INTER, H, generator=g) / H**0.5)
            m.linear_fc2.weight.copy_(torch.randn(H, INTER, generator=g) / INTER**0.5)
    return module


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 129, 1, 20])
    x = torch.randn(int(counts.sum()), H, generator=g).to(torch.bfloat16)
    return x, counts, torch.rand(x.shape[0], generator=g)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_forward_agrees_with_megatron(experts):
    x, counts, probs = _inputs()
    with torch.no_grad():
        ref, _ = experts(x, counts, probs)
        hook.apply(experts)
        hook.apply(experts)  # idempotent
        try:
            out, bias = experts(x, counts, probs)
            assert bias is None and out.shape == ref.shape and out.dtype == ref.dtype
            # FP8 weights and activations (e4m3: ~3.6% rms each) vs bf16: measured 0.062.
            assert _rel(out, ref) < 0.1
            # Bitwise the public op: grouped_mlp times the probs.
            off = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
            y = ck.fp8.grouped_mlp(x, off, *hook.fp8_weights(experts))
            assert torch.equal(out, (y.float() * probs[:, None]).to(x.dtype))
        finally:
            hook.revert(experts)
    assert not hook.is_applied(experts)


def test_layout_and_weight_updates_are_seen(experts):
    x, counts, probs = _inputs(2)
    fc1 = experts.local_experts[2].linear_fc1.weight
    saved = fc1.detach().clone()
    hook.apply(experts)
    try:
        with torch.no_grad():
            before, _ = experts(x, counts, probs)
            # An in-place update (the optimizer's): the FP8 copy follows. Swap
            # gate and up of expert 2: Megatron's GLU layout, so rows change.
            fc1.copy_(torch.cat([saved[INTER:], saved[:INTER]]))
            after, _ = experts(x, counts, probs)
        rows = slice(3, 132)  # expert 2's rows
        assert _rel(after[rows], before[rows]) > 0.3
        assert torch.equal(after[:3], before[:3]) and torch.equal(after[132:], before[132:])
        # Grad enabled: Megatron's own forward (bf16), not the FP8 path.
        with torch.no_grad():
            fc1.copy_(saved)
        hook.revert(experts)
        with torch.no_grad():
            native, _ = experts(x, counts, probs)
        hook.apply(experts)
        train_out, _ = experts(x, counts, probs)
        assert train_out.requires_grad and torch.equal(train_out.detach(), native)
    finally:
        with torch.no_grad():
            fc1.copy_(saved)
        hook.revert(experts)


def test_unsupported_modules_raise():
    with pytest.raises(TypeError, match="module: expected a Megatron SequentialMLP"):
        hook.apply(torch.nn.Linear(2, 2))
