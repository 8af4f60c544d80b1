"""Why the tiny model's FP8 quality gate sits above the bar: measured, not guessed.

The FP8 quality gate (``tests/integration/test_fp8_sync.py``) compares the
forward of the FP8-dequantized weights with the bf16 forward on sequences the
bf16 model samples, and reports the per-token probability-ratio error
``exp|logp_fp8 - logp_bf16|``. On the tiny random-weight Qwen3-MoE its mean
is ~1.07, above the <= 1.03-1.05 others report for trained models. This
module measures the candidate causes, one factor at a time, all with the same
protocol (:func:`gate`):

- width: hidden size 128 -> 1024 (heads, experts' and dense widths scaled
  along), random weights;
- routing: the FP8 forward with the bf16 forward's expert choices replayed
  (isolates the discrete top-k flips from the continuous error);
- training: the same tiny model after Adam steps on the text its tokenizer
  was trained on (weights with structure, a peaked next-token distribution)
  and sequences of that text;
- per-GEMM error: the relative error of each FP8 linear layer's output on the
  activations it sees (does a wider K average the rounding away?).

Run ``python -m bench.fp8_quality`` (about a minute on 2 cores) for the
table quoted in docs/design.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

import compass_kernels as ck
from compass_kernels.integration.vllm.fp8_sync import (
    FP8WeightSync,
    is_block_fp8_weight,
    logprob_agreement,
)

__all__ = [
    "fp8_dequantized",
    "gate",
    "linear_errors",
    "random_model",
    "replay_routing",
    "train_on_corpus",
]


def random_model(seed: int = 0, **overrides: Any):
    """A Qwen3-MoE with the tiny generator's random weights, in memory (float32)."""
    from transformers import Qwen3MoeForCausalLM

    from compass_kernels.integration.cpu.tiny_moe import _hf_config, _init_weights, _split_options

    cfg_dict, opts = _split_options(overrides)
    config = _hf_config(cfg_dict)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    _init_weights(model, seed, float(opts["weight_scale"]), float(opts["norm_noise"]))
    return model.eval()


def _bf16_values(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def fp8_dequantized(model):
    """(bf16 copy, FP8-dequantized copy) of ``model``, both computing in float32.

    The bf16 copy holds the weights rounded to bf16 (what the trainer's
    forward uses); the FP8 copy holds ``q * scale`` of those, quantized per
    checkpoint tensor (one expert projection at a time, as vLLM's block-FP8
    checkpoints are) by :class:`compass_kernels.integration.vllm.fp8_sync.FP8WeightSync`.
    """
    import copy

    from compass_kernels.integration.megatron.convert import hf_to_megatron, megatron_to_hf

    cfg = model.config
    bf16 = _bf16_values(model)
    layout = megatron_to_hf(hf_to_megatron(bf16, cfg), cfg)
    out = FP8WeightSync().convert(layout)
    deq = {
        k: (
            ck.fp8.dequantize(out[k], out[k[:-6] + "weight_scale_inv"])
            if is_block_fp8_weight(k)
            else v.float()
        )
        for k, v in layout.items()
    }
    m_bf16 = copy.deepcopy(model)
    m_bf16.load_state_dict({k: v.float() for k, v in bf16.items()})
    m_fp8 = copy.deepcopy(model)
    m_fp8.load_state_dict(megatron_to_hf(hf_to_megatron(deq, cfg), cfg, fused_experts=True))
    return m_bf16.eval(), m_fp8.eval()


@contextlib.contextmanager
def replay_routing(record_from, replay_into) -> Iterator[None]:
    """Inside: each forward of ``record_from`` records every MoE layer's
    top-k expert ids; the next forward of ``replay_into`` uses those ids
    (gate weights recomputed from its own router logits at those ids)."""
    recorded: list[list[torch.Tensor]] = [[] for _ in record_from.model.layers]
    handles = []

    def rec(i):
        gate = record_from.model.layers[i].mlp.gate
        orig = gate.forward

        def forward(h):
            logits, scores, idx = orig(h)
            recorded[i].append(idx)
            return logits, scores, idx

        gate.forward = forward
        return gate, orig

    def rep(i):
        gate = replay_into.model.layers[i].mlp.gate
        orig = gate.forward

        def forward(h):
            logits, _, _ = orig(h)
            idx = recorded[i].pop(0)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            w = probs.gather(-1, idx)
            if gate.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(logits.dtype), idx

        gate.forward = forward
        return gate, orig

    for i in range(len(recorded)):
        handles.append(rec(i))
        handles.append(rep(i))
    try:
        yield
    finally:
        for gate, orig in handles:
            gate.forward = orig


def _routing_flips(m_ref, m_new, tokens) -> float:
    """Fraction of (token, layer) whose top-k expert set differs."""
    sets: dict[int, list[torch.Tensor]] = {}
    for tag, m in (("ref", m_ref), ("new", m_new)):
        got = []
        hooks = [
            layer.mlp.gate.register_forward_hook(lambda _m, _i, out, got=got: got.append(out[2]))
            for layer in m.model.layers
        ]
        with torch.no_grad():
            m(tokens)
        for h in hooks:
            h.remove()
        sets[tag == "ref"] = got
    diff = total = 0
    for a, b in zip(sets[True], sets[False], strict=True):
        sa, _ = a.sort(-1)
        sb, _ = b.sort(-1)
        diff += int((sa != sb).any(-1).sum())
        total += sa.shape[0]
    return diff / total


def gate(
    m_bf16,
    m_fp8,
    tokens: torch.Tensor | None = None,
    *,
    n_seq: int = 16,
    seq_len: int = 64,
    seed: int = 0,
    freeze_routing: bool = False,
) -> dict[str, float]:
    """The quality gate's numbers (see
    :func:`compass_kernels.integration.vllm.fp8_sync.logprob_agreement`)
    on ``tokens`` [B, T], or on ``n_seq`` sequences the bf16 model samples
    (temperature 1) from random one-token prompts; plus the routing-flip rate,
    the logit RMS error and the bf16 model's mean next-token entropy."""
    vocab = m_bf16.config.vocab_size
    if tokens is None:
        torch.manual_seed(seed)
        prompts = torch.randint(0, min(vocab, 1000), (n_seq, 1))
        with torch.no_grad():
            tokens = m_bf16.generate(
                prompts,
                do_sample=True,
                max_new_tokens=seq_len,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                min_new_tokens=seq_len,
                pad_token_id=0,
            )
    inp, tgt = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    with torch.no_grad():
        ref = m_bf16(inp).logits.reshape(-1, vocab)
        if freeze_routing:
            with replay_routing(m_bf16, m_fp8):
                m_bf16(inp)
                new = m_fp8(inp).logits.reshape(-1, vocab)
        else:
            new = m_fp8(inp).logits.reshape(-1, vocab)
    out = logprob_agreement(ref, new, tgt)
    lp = torch.log_softmax(ref.double(), -1)
    out["entropy"] = float(-(lp.exp() * lp).sum(-1).mean())
    out["logit_rms_err"] = float((new - ref).double().pow(2).mean().sqrt())
    out["logit_rms"] = float(ref.double().std())
    out["routing_flips"] = 0.0 if freeze_routing else _routing_flips(m_bf16, m_fp8, inp)
    return out


def linear_errors(m_bf16, m_fp8, tokens: torch.Tensor) -> dict[str, float]:
    """Mean over the FP8 linear layers of ||x W_fp8^T - x W^T|| / ||x W^T||,
    with x the activations each layer sees in the bf16 forward (experts: the
    tokens routed to them), and the relative weight error ||W_fp8 - W|| / ||W||."""
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, mod in m_bf16.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            hooks.append(
                mod.register_forward_hook(
                    lambda _m, i, _o, name=name: inputs.setdefault(name, []).append(i[0])
                )
            )
        if name.endswith("mlp.experts"):
            hooks.append(
                mod.register_forward_hook(
                    lambda _m, i, _o, name=name: inputs.setdefault(name, []).append(i)
                )
            )
    with torch.no_grad():
        m_bf16(tokens)
    for h in hooks:
        h.remove()
    mods_new = dict(m_fp8.named_modules())
    out_err, w_err = [], []
    with torch.no_grad():
        for name, mod in m_bf16.named_modules():
            if name not in inputs:
                continue
            if not name.endswith("mlp.experts"):
                x = inputs[name][0].reshape(-1, mod.weight.shape[1])
                pairs = [(x, mod.weight, mods_new[name].weight)]
            else:
                h, idx, _ = inputs[name][0]
                pairs = []
                for e in range(mod.gate_up_proj.shape[0]):
                    x = h[(idx == e).any(-1)]
                    if x.shape[0] == 0:
                        continue
                    pairs.append((x, mod.gate_up_proj[e], mods_new[name].gate_up_proj[e]))
            for x, w, wq in pairs:
                y = x @ w.T
                out_err.append(float((x @ wq.T - y).norm() / y.norm()))
                w_err.append(float((wq - w).norm() / w.norm()))
    return {"gemm_rel_err": sum(out_err) / len(out_err), "weight_rel_err": sum(w_err) / len(w_err)}


def train_on_corpus(
    model,
    tokenizer_path,
    *,
    steps: int = 300,
    lr: float = 3e-3,
    batch: int = 16,
    seq_len: int = 64,
    seed: int = 0,
):
    """Adam steps of next-token loss on the tiny tokenizer's generated text.

    Returns (model, held-out token batch [16, seq_len + 1])."""
    from transformers import AutoTokenizer

    from compass_kernels.integration.cpu.tiny_moe import _corpus

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    text = " ".join(_corpus(seed + 1, 4000))
    ids = torch.tensor(tok(text)["input_ids"])
    n = seq_len + 1
    chunks = ids[: ids.numel() // n * n].view(-1, n)
    held, train = chunks[:16], chunks[16:]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    try:
        from tqdm import tqdm

        it = tqdm(range(steps), desc="train", leave=False)
    except ImportError:  # pragma: no cover
        it = range(steps)
    for _ in it:
        rows = train[torch.randint(0, train.shape[0], (batch,), generator=g)]
        loss = model(rows, labels=rows).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, held, float(loss.detach())


def _main() -> None:
    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe

    torch.set_num_threads(1)  # tiny GEMMs: threads only contend (10x slower on a loaded host)
    rows = []

    def row(label, m, tokens=None, extra=None):
        b, f = fp8_dequantized(m)
        g = gate(b, f, tokens)
        frozen = gate(b, f, tokens, freeze_routing=True)
        probe = tokens if tokens is not None else torch.randint(0, 1000, (8, 64))
        lin = linear_errors(b, f, probe)
        rows.append((label, g, frozen, lin, extra or ""))
        print(
            f"{label:28s} ratio mean {g['ratio_err_mean']:.4f} max {g['ratio_err_max']:.3f} "
            f"KL {g['kl_mean']:.2e} | frozen routing: mean {frozen['ratio_err_mean']:.4f} "
            f"| flips {g['routing_flips']:.1%} | entropy {g['entropy']:.2f} nats, logit rms "
            f"{g['logit_rms']:.2f} err {g['logit_rms_err']:.3f} | gemm rel err "
            f"{lin['gemm_rel_err']:.4f} weight rel err {lin['weight_rel_err']:.4f} {extra or ''}",
            flush=True,
        )

    for h in (128, 256, 512, 1024):
        scale = h // 128
        model = random_model(
            hidden_size=h,
            num_attention_heads=4 * scale,
            num_key_value_heads=2 * scale,
            moe_intermediate_size=64 * scale,
            intermediate_size=256 * scale,
        )
        row(f"random, hidden {h}", model)
    path = cached_tiny_qwen3_moe()
    model = random_model()
    trained, held, loss = train_on_corpus(model, path)
    row("trained 300 steps, own samples", trained, extra=f"(train loss {loss:.2f})")
    row("trained 300 steps, held-out text", trained, tokens=held)
    ln = math.log(1024)
    print(f"(uniform next-token entropy: {ln:.2f} nats)")


if __name__ == "__main__":
    _main()
