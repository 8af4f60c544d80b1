"""Zero-size shapes in every public op (no experts, no tokens, K = 0, no prompts):
the right empty result (shape, dtype), per op and per backend (torch; Triton in
the interpreter here, on the GPU where there is one), never a crash.

Outputs of ops that return per-token values are compared with the float64
reference where one exists (an empty reference result: same shape and dtype).
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.routing import RoutingTrace

TRITON = pytest.param("triton", marks=pytest.mark.triton)
BACKENDS = ["torch", TRITON]
F8 = torch.float8_e4m3fn


def _empty(t: torch.Tensor, shape, dtype=None) -> None:
    assert isinstance(t, torch.Tensor)
    assert tuple(t.shape) == tuple(shape), (tuple(t.shape), shape)
    if dtype is not None:
        assert t.dtype == dtype


# ------------------------------------------------------------------- fp8
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape, scale_shape",
    [
        ((0, 256, 128), (0, 2, 1)),  # no experts (the torch.stack crash)
        ((3, 0, 128), (3, 0, 1)),  # no rows
        ((3, 256, 0), (3, 2, 0)),  # K = 0
        ((0, 128), (0, 1)),
        ((128, 0), (1, 0)),
    ],
)
@pytest.mark.parametrize("layout", ["k_major", "mn_major"])
def test_quantize_blockwise_zero_size(backend, backend_device, shape, scale_shape, layout):
    w = torch.randn(shape, device=backend_device).to(torch.bfloat16)
    q, s = ck.fp8.quantize_blockwise(w, backend=backend, scale_layout=layout)
    _empty(q, shape, F8)
    _empty(s, scale_shape, torch.float32)
    d = ck.fp8.dequantize(q, s)
    _empty(d, shape, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, scale_shape", [((0, 256), (0, 2)), ((5, 0), (5, 0))])
def test_quantize_token_groups_zero_size(backend, backend_device, shape, scale_shape):
    x = torch.randn(shape, device=backend_device).to(torch.bfloat16)
    q, s = ck.fp8.quantize_token_groups(x, backend=backend)
    _empty(q, shape, F8)
    _empty(s, scale_shape, torch.float32)


def _moe_weights(E: int, H: int, inter: int, device):
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, generator=g).to(device=device, dtype=torch.bfloat16)
    w2 = torch.randn(E, H, inter, generator=g).to(device=device, dtype=torch.bfloat16)
    w13_q, w13_s = ck.fp8.quantize_blockwise(w13)
    w2_q, w2_s = ck.fp8.quantize_blockwise(w2)
    return w13_q, w13_s, w2_q, w2_s


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_ops_no_tokens(backend, backend_device):
    """moe_mlp / permute_quantize / unpermute / grouped_mlp / grouped_gemm with 0 tokens."""
    E, H, inter, k = 4, 128, 128, 2
    dev = backend_device
    weights = _moe_weights(E, H, inter, dev)
    hidden = torch.empty(0, H, dtype=torch.bfloat16, device=dev)
    ids = torch.empty(0, k, dtype=torch.int32, device=dev)
    wts = torch.empty(0, k, dtype=torch.float32, device=dev)
    out = ck.fp8.moe_mlp(hidden, ids, wts, *weights, backend=backend)
    _empty(out, (0, H), torch.bfloat16)
    pt = ck.fp8.permute_quantize(hidden, ids, E, backend=backend)
    _empty(pt.q, (0, H), F8)
    assert pt.expert_offsets.tolist() == [0] * (E + 1)
    y = torch.empty(0, H, dtype=torch.bfloat16, device=dev)
    _empty(ck.fp8.unpermute(y, pt, wts, backend=backend), (0, H))
    x = torch.empty(0, H, dtype=torch.bfloat16, device=dev)
    off = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    _empty(ck.fp8.grouped_mlp(x, off, *weights, backend=backend), (0, H))
    a_q, a_s = ck.fp8.quantize_token_groups(x)
    b_q, b_s = weights[0], weights[1]
    out = ck.fp8.grouped_gemm(a_q, a_s, b_q, b_s, off, backend=backend)
    _empty(out, (0, 2 * inter), torch.bfloat16)


# ------------------------------------------------------------------ espo
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_entropy_no_tokens(backend, backend_device):
    logits = torch.randn(0, 50, device=backend_device)
    targets = torch.empty(0, dtype=torch.int64, device=backend_device)
    lp, ent = ck.espo.token_logprobs_entropy(logits, targets, backend=backend)
    _empty(lp, (0,), torch.float32)
    _empty(ent, (0,), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_logprobs_no_tokens(backend, backend_device):
    h = torch.randn(0, 16, device=backend_device, requires_grad=True)
    w = torch.randn(40, 16, device=backend_device, requires_grad=True)
    y = torch.empty(0, dtype=torch.int64, device=backend_device)
    lp, ent = ck.espo.fused_linear_logprobs_entropy(h, w, y, backend=backend)
    _empty(lp, (0,))
    lp.sum().backward()
    _empty(h.grad, (0, 16))
    assert torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["espo", "gspo", "grpo"])
def test_espo_loss_no_tokens_no_sequences(backend, backend_device, mode):
    dev = backend_device
    e = torch.empty(0, device=dev, requires_grad=True)
    z = torch.empty(0, device=dev)
    cu = torch.zeros(1, dtype=torch.int64, device=dev)
    loss, metrics = ck.espo.espo_loss(
        e, z, z, z, cu, mode=mode, vocab_size=100, backend=backend, advantages_per_token=False
    )
    assert loss.shape == () and float(loss) == 0.0
    loss.backward()
    _empty(e.grad, (0,))


# --------------------------------------------------------------- routing
@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_topk_no_tokens(backend, backend_device):
    logits = torch.randn(0, 8, device=backend_device)
    ids = torch.empty(0, 2, dtype=torch.int64, device=backend_device)
    res = ck.routing.replay_topk(logits, ids, backend=backend)
    probs = res[0] if isinstance(res, tuple) else res.probs
    _empty(probs, (0, 2))


@pytest.mark.parametrize("codec", ["raw", "set"])
@pytest.mark.parametrize("rows, cols", [(0, 2), (5, 0), (0, 0)])
def test_trace_codec_no_rows_no_layers(codec, rows, cols):
    ids = torch.zeros(rows, cols, 2, dtype=torch.uint8)
    ids[..., 1] = 1
    t = RoutingTrace(ids, torch.tensor([0, rows]), 8)
    got = RoutingTrace.decode(t.encode(codec=codec))
    assert got == t and got.num_tokens == rows and got.num_moe_layers == cols


# -------------------------------------------------------------- advantages
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_no_samples(backend, backend_device, mode):
    r = torch.empty(0, device=backend_device)
    adv, zv, stats = ck.advantages.group_advantages(r, group_size=4, mode=mode, backend=backend)
    _empty(adv, (0,), torch.float32)
    _empty(zv, (0,), torch.bool)
    assert stats.num_groups == 0
    gid = torch.empty(0, dtype=torch.int64, device=backend_device)
    adv, zv, stats = ck.advantages.group_advantages(r, gid, mode=mode, backend=backend)
    _empty(adv, (0,))
    assert stats.num_groups == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_zvp_no_sequences(backend, backend_device):
    dev = backend_device
    cu = torch.zeros(1, dtype=torch.int64, device=dev)
    e, zv = torch.empty(0, device=dev), torch.empty(0, dtype=torch.bool, device=dev)
    out = ck.advantages.rl_zvp(e, cu, e, zv, backend=backend)
    _empty(out, (0,))


def test_host_ops_no_prompts():
    e = torch.empty(0)
    _empty(
        ck.advantages.overlong_penalty(torch.empty(0, dtype=torch.int64), max_len=8, cache_len=2),
        (0,),
    )
    n, st = ck.advantages.allocate_rollouts(e, e, 100, return_stats=True)
    _empty(n, (0,), torch.int64)
    assert st.spent == 0 and st.skipped == 0
    _empty(ck.advantages.informative_probability(e, e, torch.empty(0, dtype=torch.int64)), (0,))


# ---------------------------------------------------------------- packing
@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_zero_width_rows(backend, backend_device):
    """K = 0 feature columns: the packed tensor is [tokens, 0] (nothing to move)."""
    x = torch.empty(9, 0, device=backend_device)
    b = ck.packing.pack({"x": x}, [4, 5], [1, 0], pad_multiple=4, backend=backend)
    _empty(b.tensors["x"] if hasattr(b, "tensors") else b["x"], (12, 0))
