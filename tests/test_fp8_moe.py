"""ck.fp8.moe_mlp (permute + quantize -> gate/up GEMM -> SiLU-mul + requantize ->
down GEMM -> unpermute) on every backend against the float32 reference.

Routing gives experts exactly 0, 1, 127, 129, 0 and 3 slots (distinct experts per
token, tokens shuffled); H and I are not multiples of 128; the output is
poisoned (NaN) before the layer runs. The tolerance is shown to reject a layer
with a plausible bug (gate and up swapped, weights of the wrong expert, top-k
weights ignored).
"""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.fp8.reference_moe import moe_mlp_reference
from compass_kernels.testing import empty_poisoned, make_generator
from tests.tiers import device_for

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
COUNTS = (0, 1, 127, 129, 0, 3)


def routing_with_counts(counts, top_k: int, seed: int):
    """topk_ids [T, top_k] (T = sum(counts) / top_k) giving expert e exactly
    counts[e] slots, distinct experts per token (needs max(counts) <= T)."""
    total = sum(counts)
    assert total % top_k == 0
    t = total // top_k
    assert max(counts) <= t
    flat = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    # Column-major fill of a sorted list: an expert's run (<= T long) never
    # puts two slots in one row.
    ids = flat.reshape(top_k, t).t()
    g = make_generator(seed)
    ids = ids[torch.randperm(t, generator=g)]
    cols = torch.stack([torch.randperm(top_k, generator=g) for _ in range(t)])
    return ids.gather(1, cols)


def make_layer(
    tokens_or_counts,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    seed: int,
    dtype=torch.bfloat16,
):
    """(hidden, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale): weights
    scaled like a trained layer's (unit-variance outputs), quantized with ck.fp8."""
    g = make_generator(seed)
    if isinstance(tokens_or_counts, tuple):
        ids = routing_with_counts(tokens_or_counts, top_k, seed)
    else:
        scores = torch.rand(tokens_or_counts, experts, generator=g)
        ids = scores.topk(top_k, dim=1).indices
    t = ids.shape[0]
    x = (torch.randn(t, hidden, generator=g) * torch.exp(torch.randn(t, 1, generator=g))).to(dtype)
    w = torch.softmax(torch.randn(t, top_k, generator=g), 1)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    w13_q, w13_s = ck.fp8.quantize_blockwise(w13.to(torch.bfloat16))
    w2_q, w2_s = ck.fp8.quantize_blockwise(w2.to(torch.bfloat16))
    return x, ids, w, w13_q, w13_s, w2_q, w2_s


#: Fraction of outputs a GPU run may have outside the elementwise bound. Hopper's FP8
#: MMA accumulates in ~14 significant bits before each fp32 promotion
#: (tests/fp8_gemm_cases.py), so the intermediate activation's e4m3 rounding (a 6 %
#: step) flips for more rows than an exact fp32 sum makes it: on the H100 (docs/gpu_runs/
#: 2026-11-27-H100-issue26) 214 of 33,280 outputs (0.64 %), identically for the CUTLASS
#: and the Triton GEMMs. A flip moves one output by one e4m3 step of one term; the mean
#: bound below is unchanged, so a systematic error (a wrong scale, a dropped block)
#: still fails.
GPU_FLIP_FRACTION = 0.02


def check_moe(actual: torch.Tensor, args, *, flips: float = 0.0) -> None:
    """Against the reference with the kernels' quantization points: elementwise
    within 2^-7 of the value plus 2% of the row's RMS (the output's bf16
    rounding, and the rare bf16 / e4m3 rounding flip a different float32
    summation order causes) for all but a fraction ``flips`` of the outputs, and
    on average within 2^-8 (no systematic error)."""
    ref = moe_mlp_reference(*args)
    got = actual.cpu().to(torch.float32)
    assert got.shape == ref.shape
    err = (got - ref).abs()
    rms = ref.pow(2).mean(1, keepdim=True).sqrt()
    bound = 2.0**-7 * ref.abs() + 0.02 * rms
    bad = ~(err <= bound)  # NaN (a poisoned, unwritten element) is bad
    if bool(got.isnan().any()) or int(bad.sum()) > flips * bad.numel():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} outputs off; first at {i}: "
            f"got {got[i].item()}, expected {ref[i].item()}"
        )
    mean_err, mean_ref = float(err.mean()), float(ref.abs().mean())
    assert mean_err <= 2.0**-8 * mean_ref, f"mean error {mean_err:.3g} vs mean |ref| {mean_ref:.3g}"


def _flips(backend):
    return GPU_FLIP_FRACTION if device_for(backend) == "cuda" else 0.0


def run(args, backend, **kw):
    dev = device_for(backend)
    out = empty_poisoned(tuple(args[0].shape), args[0].dtype, dev)
    res = ck.fp8.moe_mlp(*(a.to(dev) for a in args), backend=backend, out=out, **kw)
    assert res is out
    return out.cpu()


@pytest.mark.parametrize(
    "backend,dtype",
    # The interpreter takes ~30 s per layer here: one dtype (the float32 path
    # differs only in the combine's output dtype, a torch cast).
    [
        ("torch", torch.bfloat16),
        ("torch", torch.float32),
        pytest.param("triton", torch.bfloat16, marks=pytest.mark.triton),
    ],
)
def test_odd_expert_sizes_match_reference(backend, dtype):
    args = make_layer(COUNTS, 200, 72, len(COUNTS), 2, seed=1, dtype=dtype)
    counts = torch.bincount(args[1].reshape(-1), minlength=len(COUNTS))
    assert counts.tolist() == list(COUNTS)
    check_moe(run(args, backend), args, flips=_flips(backend))


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k",
    [(1, 128, 128, 4, 1), (19, 111, 37, 7, 3), (48, 256, 192, 16, 6)],
)
def test_shapes_match_reference(tokens, hidden, inter, experts, top_k):
    args = make_layer(tokens, hidden, inter, experts, top_k, seed=tokens + hidden)
    check_moe(run(args, "torch"), args)


def test_float16_and_default_backend():
    args = make_layer(23, 136, 40, 5, 2, seed=7, dtype=torch.float16)
    out = ck.fp8.moe_mlp(*args)
    assert out.dtype == torch.float16 and out.shape == (23, 136)
    check_moe(out, args)


def test_close_to_unquantized_activations():
    """The FP8 activation path against the float32 MoE with the same dequantized
    weights: the 1x128 e4m3 quantization of x and of the SiLU-mul output costs a
    few percent (e4m3 keeps 3 mantissa bits), not more."""
    args = make_layer(40, 256, 128, 8, 2, seed=3, dtype=torch.float32)
    got = ck.fp8.moe_mlp(*args)
    exact = moe_mlp_reference(*args, quantize_activations=False)
    rel = float((got - exact).norm() / exact.norm())
    assert 1e-3 < rel < 0.06, rel


def _swap_gate_up(w, s):
    i = w.shape[1] // 2
    return torch.cat([w[:, i:], w[:, :i]], 1), torch.cat(
        [s[:, s.shape[1] // 2 :], s[:, : s.shape[1] // 2]], 1
    )


@pytest.mark.parametrize("bug", ["gate_up_swapped", "wrong_expert", "weights_ignored"])
def test_tolerance_rejects_plausible_bugs(bug):
    """check_moe can fail: a layer with one plausible bug is rejected, also with the
    GPU's allowance for rounding flips."""
    x, ids, w, w13, s13, w2, s2 = make_layer(30, 256, 128, 6, 2, seed=5)
    if bug == "gate_up_swapped":  # block-aligned I: swapping rows swaps whole scale blocks
        w13b, s13b = _swap_gate_up(w13, s13)
        got = ck.fp8.moe_mlp(x, ids, w, w13b, s13b, w2, s2)
    elif bug == "wrong_expert":
        got = ck.fp8.moe_mlp(x, (ids + 1) % 6, w, w13, s13, w2, s2)
    else:
        got = ck.fp8.moe_mlp(x, ids, torch.ones_like(w) / 2, w13, s13, w2, s2)
    for flips in (0.0, GPU_FLIP_FRACTION):
        with pytest.raises(AssertionError):
            check_moe(got, (x, ids, w, w13, s13, w2, s2), flips=flips)


def test_rows_are_independent_of_batch():
    """A token's output does not depend on the other tokens in the batch (no
    cross-row leakage through the packing): bitwise the same alone or batched."""
    args = make_layer(33, 144, 48, 5, 2, seed=11)
    full = ck.fp8.moe_mlp(*args)
    for t in (0, 17, 32):
        one = ck.fp8.moe_mlp(args[0][t : t + 1], args[1][t : t + 1], args[2][t : t + 1], *args[3:])
        assert torch.equal(one[0], full[t])


# ------------------------------------------------------------------ bad input

_GOOD = make_layer(6, 64, 32, 4, 2, seed=2)
_NAMES = ("hidden", "topk_ids", "topk_weights", "w13_weight", "w13_scale", "w2_weight", "w2_scale")


def _bad(**change):
    args = dict(zip(_NAMES, _GOOD, strict=True))
    args.update(change)
    return [args[k] for k in _NAMES]


BAD = [
    ({"hidden": _GOOD[0].to(torch.float64)}, "hidden: expected dtype"),
    ({"hidden": _GOOD[0][None]}, "hidden: expected a 2-d tensor"),
    ({"topk_ids": _GOOD[1].float()}, "topk_ids: expected dtype int32 | int64"),
    ({"topk_ids": _GOOD[1][:5]}, r"topk_ids: expected 6 elements in dim 0 \(one row per token"),
    ({"topk_weights": _GOOD[2][:, :1]}, r"topk_weights: expected shape \[6, 2\]"),
    ({"w13_weight": _GOOD[3].float()}, "w13_weight: expected dtype float8_e4m3fn"),
    ({"w13_weight": _GOOD[3][:, :63]}, "w13_weight: expected .* an even 2I"),
    ({"w13_weight": _GOOD[3][:, :, :32]}, r"w13_weight: expected H = 64 \(hidden.shape\[1\]\)"),
    ({"w2_weight": _GOOD[5][:3]}, r"w2_weight: expected shape \[4, 64, 32\] = \[E, H, I\]"),
    ({"w2_weight": _GOOD[5].transpose(1, 2)}, r"w2_weight: expected shape \[4, 64, 32\]"),
    ({"w13_scale": _GOOD[4][:, :, :0]}, r"w13_scale: expected shape \[4, 1, 1\]"),
    ({"w2_scale": _GOOD[6].double()}, "w2_scale: expected dtype float32"),
    ({"topk_ids": _GOOD[1] + 3}, r"topk_ids: expected expert ids in \[0, 4\)"),
    ({"topk_ids": _GOOD[1] - 1}, r"topk_ids: expected expert ids in \[0, 4\)"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,match", BAD)
def test_bad_input_names_the_argument(backend, change, match):
    with pytest.raises(ValueError, match=match):
        ck.fp8.moe_mlp(*_bad(**change), backend=backend)


def test_bad_out_and_grad():
    with pytest.raises(ValueError, match=r"out: expected shape \[6, 64\]"):
        ck.fp8.moe_mlp(*_GOOD, out=torch.empty(6, 65, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out: expected dtype bfloat16"):
        ck.fp8.moe_mlp(*_GOOD, out=torch.empty(6, 64))
    with pytest.raises(ValueError, match="hidden: moe_mlp is forward-only"):
        ck.fp8.moe_mlp(_GOOD[0].float().requires_grad_(), *_GOOD[1:])


def test_routing_helper_counts():
    ids = routing_with_counts((0, 3, 1, 2), 2, seed=0)
    assert torch.bincount(ids.reshape(-1), minlength=4).tolist() == [0, 3, 1, 2]
    assert all(len(set(r)) == 2 for r in ids.tolist())


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backends_match_reference(backend):
    args = make_layer(COUNTS, 256, 192, len(COUNTS), 2, seed=8)
    dev = [a.cuda() for a in args]
    out = ck.fp8.moe_mlp(*dev, backend=backend)
    check_moe(out, args, flips=GPU_FLIP_FRACTION)


# ------------------------------------------------------------------ grouped_mlp


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mlp_matches_reference(backend):
    """Rows already grouped by expert (Megatron's experts interface): each row
    is the reference layer with one expert and weight 1."""
    counts = (2, 0, 129, 1)
    x, _, _, w13, s13, w2, s2 = make_layer(5, 200, 72, len(counts), 1, seed=12)
    g = make_generator(3)
    rows = torch.randn(sum(counts), 200, generator=g).to(torch.bfloat16)
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(counts).cumsum(0)
    dev = device_for(backend)
    got = ck.fp8.grouped_mlp(
        *(t.to(dev) for t in (rows, off, w13, s13, w2, s2)), backend=backend
    ).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == rows.shape
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))[:, None]
    check_moe(got, (rows, ids, torch.ones(ids.shape), w13, s13, w2, s2), flips=_flips(backend))


def test_moe_mlp_is_unpermute_of_grouped_mlp():
    args = make_layer(COUNTS, 136, 40, len(COUNTS), 2, seed=4)
    x, ids, w = args[:3]
    p = ck.fp8.permute_quantize(x, ids, len(COUNTS))
    y = ck.fp8.grouped_mlp(x[p.src_index // 2], p.expert_offsets, *args[3:])
    assert torch.equal(ck.fp8.unpermute(y, p, w), ck.fp8.moe_mlp(*args))


def test_grouped_mlp_bad_input():
    x, _, _, w13, s13, w2, s2 = _GOOD
    off = torch.tensor([0, 2, 2, 5, 6])
    with pytest.raises(ValueError, match="expert_offsets: expected 5 elements in dim 0"):
        ck.fp8.grouped_mlp(x, off[:4], w13, s13, w2, s2)
    with pytest.raises(ValueError, match="expert_offsets: expected non-decreasing"):
        ck.fp8.grouped_mlp(x, torch.tensor([0, 3, 2, 5, 6]), w13, s13, w2, s2)
    with pytest.raises(ValueError, match=r"expert_offsets: expected expert_offsets\[-1\] == 6"):
        ck.fp8.grouped_mlp(x, torch.tensor([0, 2, 2, 5, 5]), w13, s13, w2, s2)
    with pytest.raises(ValueError, match=r"w13_weight: expected H = 32 \(x.shape\[1\]\)"):
        ck.fp8.grouped_mlp(x[:, :32], off, w13, s13, w2, s2)
