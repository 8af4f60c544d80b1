"""FP8 weight sync on the tiny Qwen3-MoE: vLLM's block-FP8 names / dtypes /
shapes / scale layout, bit-identity with vLLM's own quantization function,
the Megatron path, streaming, the swallowed-update report, and the quality
gate (FP8 dequantized-weight forward vs the bf16 forward)."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import compass_kernels as ck  # noqa: E402
from compass_kernels.integration.megatron.convert import hf_to_megatron, load_hf_state_dict  # noqa: E402
from compass_kernels.integration.vllm.fp8_sync import (  # noqa: E402
    FP8WeightSync,
    from_megatron,
    is_block_fp8_weight,
    logprob_agreement,
    quantization_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def bf16_weights(tiny_moe_path):
    """The trainer's weights: the checkpoint in bf16 (what its forward uses)."""
    return {k: v.to(torch.bfloat16) for k, v in load_hf_state_dict(tiny_moe_path).items()}


@pytest.fixture(scope="module")
def hf_config(tiny_moe_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_moe_path)


def test_layout_matches_vllm_block_fp8(bf16_weights):
    out = FP8WeightSync().convert(bf16_weights)
    fp8 = [k for k in bf16_weights if is_block_fp8_weight(k)]
    # 3 layers x (4 attention projections + 8 experts x 3)
    assert len(fp8) == 3 * (4 + 8 * 3)
    for name in fp8:
        w, q, s = bf16_weights[name], out[name], out[name[: -len("weight")] + "weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
        assert s.dtype == torch.float32 and s.is_contiguous()
        assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    kept = [k for k in bf16_weights if not is_block_fp8_weight(k)]
    assert {
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.norm.weight",
    } <= set(kept)
    for name in kept:
        assert out[name] is bf16_weights[name]
    assert len(out) == len(bf16_weights) + len(fp8)
    assert quantization_config()["weight_block_size"] == [128, 128]


def test_refuses_the_fp32_master(bf16_weights):
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=rf"{name}: expected the bf16 weights"):
        FP8WeightSync().convert({name: bf16_weights[name].float()})


def test_bit_identical_to_vllm_per_block_cast_to_fp8(bf16_weights):
    """vLLM's online block-FP8 quantization (process_weights_after_loading)
    calls per_block_cast_to_fp8: our bytes and scales equal its, eagerly for
    every weight and once through its torch.compile'd form."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    eager = per_block_cast_to_fp8._torchdynamo_orig_callable
    out = FP8WeightSync().convert(bf16_weights)
    g = torch.Generator().manual_seed(0)
    extra = {"ragged": (torch.randn(300, 260, generator=g) * 0.05).to(torch.bfloat16)}
    extra["ragged"][:128, :128] = 0
    names = [k for k in bf16_weights if is_block_fp8_weight(k)]
    for name in names:
        vq, vs = eager(bf16_weights[name], [128, 128], use_ue8m0=False)
        assert torch.equal(out[name].view(torch.uint8), vq.view(torch.uint8)), name
        assert torch.equal(out[name[:-6] + "weight_scale_inv"], vs), name
    for ue8m0 in (False, True):
        vq, vs = eager(extra["ragged"], [128, 128], use_ue8m0=ue8m0)
        q, s = ck.fp8.quantize_blockwise(extra["ragged"], ue8m0=ue8m0)
        assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8)) and torch.equal(s, vs)
    vq, vs = per_block_cast_to_fp8(extra["ragged"], [128, 128], use_ue8m0=False)  # compiled
    q, s = ck.fp8.quantize_blockwise(extra["ragged"])
    assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8)) and torch.equal(s, vs)


def test_megatron_state_dict_gives_the_same_sync(bf16_weights, hf_config):
    mcore = hf_to_megatron(bf16_weights, hf_config)
    a = FP8WeightSync().convert(bf16_weights)
    b = FP8WeightSync().convert(from_megatron(mcore, hf_config))
    assert set(a) == set(b)
    for k in a:
        x, y = a[k], b[k]
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), k


def test_streams_one_tensor_at_a_time(bf16_weights):
    """The first outputs come before the second input is read; the report's
    peak is one tensor's FP8 copy and scales (at most one layer)."""
    pulled = []

    def source():
        for k, v in bf16_weights.items():
            pulled.append(k)
            yield k, v

    sync = FP8WeightSync()
    stream = sync.stream(source())
    first = next(k for k in bf16_weights if is_block_fp8_weight(k))
    for name, _ in stream:
        if name == first:
            assert pulled[-1] == first
            break
    list(stream)
    sizes = [
        v.numel() + 4 * (-(-v.shape[0] // 128)) * (-(-v.shape[1] // 128))
        for k, v in bf16_weights.items()
        if is_block_fp8_weight(k)
    ]
    assert sync.report.peak_extra_bytes == max(sizes)
    assert sync.report.fp8_bytes == sum(sizes)
    layer0 = sum(v.numel() for k, v in bf16_weights.items() if ".layers.0." in k)
    assert sync.report.peak_extra_bytes <= layer0


def test_report_counts_what_the_rounding_swallowed(bf16_weights):
    """Second sync after an update: tiny changes (well below an e4m3 step) are
    swallowed, large ones are not; the report's counts are checked by hand."""
    sync = FP8WeightSync(track_changes=True)
    first = sync.convert(bf16_weights)
    assert sync.report.changed is None
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    w = bf16_weights[name]
    new = dict(bf16_weights)
    updated = w.float()
    updated[0, :5] *= 1.01  # ~one bf16 ulp: inside an e4m3 step (2^-3 relative) -> swallowed
    updated[1, :5] *= -1.0  # sign flips: never swallowed
    new[name] = updated.to(torch.bfloat16)
    second = sync.convert(new)
    r = sync.report
    moved = new[name] != w
    q0, q1 = first[name].view(torch.uint8), second[name].view(torch.uint8)
    s0, s1 = first[name[:-6] + "weight_scale_inv"], second[name[:-6] + "weight_scale_inv"]
    same = (q0 == q1) & (s0 == s1).all()  # one block: the whole tensor shares one scale
    assert r.changed == int(moved.sum()) >= 8
    assert r.swallowed == int((moved & same).sum())
    assert 0 < r.swallowed < r.changed
    assert r.per_tensor[name] == (r.changed, r.swallowed)
    assert sum(c for c, _ in r.per_tensor.values()) == r.changed  # no other tensor moved
    assert r.swallowed_fraction == pytest.approx(r.swallowed / r.changed)
    assert 0 < r.swallowed_update_fraction < 1


def test_quality_gate_fp8_forward_vs_bf16(tiny_moe_path, bf16_weights, tmp_path):
    """FP8 (dequantized-weight) forward vs the bf16 forward on the tiny model:
    per-token probability-ratio error and KL (printed; the bar others use for
    FP8 rollouts is a ratio error <= 1.03-1.05)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = FP8WeightSync().convert(bf16_weights)
    deq = {}
    for k, v in bf16_weights.items():
        if is_block_fp8_weight(k):
            deq[k] = ck.fp8.dequantize(out[k], out[k[:-6] + "weight_scale_inv"])
        else:
            deq[k] = v.float()
    models = {}
    for tag, sd in (("bf16", {k: v.float() for k, v in bf16_weights.items()}), ("fp8", deq)):
        folder = tmp_path / tag
        shutil.copytree(tiny_moe_path, folder)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
        models[tag] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Rollout-like sequences: sampled from the bf16 model (temperature 1), 4 x 64 tokens.
    torch.manual_seed(0)
    prompts = torch.randint(0, 1000, (4, 1))
    with torch.no_grad():
        tokens = models["bf16"].generate(
            prompts,
            do_sample=True,
            max_new_tokens=64,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            min_new_tokens=64,
        )
        ref = models["bf16"](tokens[:, :-1]).logits.reshape(-1, 1024)
        new = models["fp8"](tokens[:, :-1]).logits.reshape(-1, 1024)
    m = logprob_agreement(ref, new, tokens[:, 1:].reshape(-1))
    print(
        f"\nFP8 quality gate (tiny Qwen3-MoE, {m['tokens']} sampled tokens): ratio error max "
        f"{m['ratio_err_max']:.5f} mean {m['ratio_err_mean']:.6f}, KL mean "
        f"{m['kl_mean']:.3e} max {m['kl_max']:.3e}"
    )
    # Measured here (not a bar we chose): see docs/design.md, FP8 quality gate.
    # The random-weight model sits above the 1.03-1.05 others report for trained
    # models: MoE routing flips and its near-uniform next-token distribution,
    # not its width (measured: compass_kernels/integration/fp8_quality.py, docs/design.md).
    assert 1.0 < m["ratio_err_mean"] < 1.1 and m["kl_mean"] < 1e-2
    # The gate can fail: weights dequantized with every scale doubled are far off.
    bad = {k: (v * 2 if is_block_fp8_weight(k) else v) for k, v in deq.items()}
    save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "fp8/model.safetensors"))
    worse = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    with torch.no_grad():
        bad_logits = worse(tokens[:, :-1]).logits.reshape(-1, 1024)
    worst = logprob_agreement(ref, bad_logits, tokens[:, 1:].reshape(-1))
    assert worst["kl_mean"] > 10 * m["kl_mean"] and worst["ratio_err_mean"] > m["ratio_err_mean"]
