"""Bench: router replay (ck.routing.replay_topk) and the trace codec.

replay_topk cases: per MoE layer and micro-batch, router logits [T, E] and the
trace's ids [T, K] -> gating weights, routing map, tokens per expert.

Providers:

- ``torch (unfused replay)``, the baseline: what Megatron-core's RouterReplay
  does today, written from its math: scores = softmax / sigmoid over the full
  logits, ``gather`` at the replayed ids, renormalise, ``scatter`` into the
  [T, E] routing map, ``sum(0)`` for tokens per expert (one kernel each).
- ``torch (+ native top-k, agreement)``: the same plus what compass also
  returns in its single pass: the native top-k (``torch.topk``), the overlap
  with the replayed sets and the missing-row fallback (``torch.where``).
- ``compass``: ``ck.routing.replay_topk`` (default dispatch, all statistics).

``fwd+bwd`` cases time forward and backward (``(weights * g).sum().backward()``)
for both. Shapes: DeepSeek-V3 (E=256, K=8, sigmoid + expert bias, scaling
2.5) and Qwen3-MoE (E=128, K=8, softmax, renormalised), T = tokens of one
micro-batch per rank (4k, 16k).

The ``overhead`` case times a tiny call (T=16, E=64, K=4) through each layer:
the raw compiled kernel (arguments prepared once), the ``torch.ops.compass``
op, the public API; ``vs base`` is the host overhead above the kernel.

Codec cases (``codec``): bytes per (token, layer) row and encode + decode
time of ``RoutingTrace.encode(codec=...)`` on synthetic traces with skewed
expert popularity (Zipf-like), vs the raw uint8 layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench.harness import Case
from bench.roofline import Model

OP = "routing"

MODELS = {
    # name: (E, K, score_function, normalize, scaling, bias)
    "deepseek_v3": (256, 8, "sigmoid", True, 2.5, True),
    "qwen3_moe": (128, 8, "softmax", True, 1.0, False),
}
TOKENS, QUICK_TOKENS = (4096, 16384), (1024,)
OVERHEAD = (16, 64, 4)
ATOL, RTOL = 1e-5, 1e-5


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(t: int, e: int, k: int, seed: int, device: str, *, drift: float = 0.3):
    """Router logits and a trace whose sets match the native top-k except for a
    fraction ``drift`` of rows (one expert swapped), 2% missing rows."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(t, e, generator=g)
    native = torch.topk(z, k).indices
    ids = native.clone()
    swap = torch.rand(t, generator=g) < drift
    ids[swap, -1] = torch.topk(z[swap], k + 1).indices[:, -1]
    valid = torch.rand(t, generator=g) > 0.02
    bias = torch.randn(e, generator=g) * 1e-3
    return z.to(device), ids.to(torch.uint8).to(device), valid.to(device), bias.to(device)


def torch_replay(
    z, ids, *, score_function, normalize, scaling, bias=None, valid=None, agreement=False
):
    """The unfused torch path. Returns (weights, routing_map, tokens_per_expert)."""
    t, e = z.shape
    k = ids.shape[1]
    scores = torch.softmax(z, -1) if score_function == "softmax" else torch.sigmoid(z)
    idx = ids.long()
    if agreement:
        sel = scores if bias is None else scores + bias
        native = torch.topk(sel, k, dim=-1).indices
        overlap = (idx[:, :, None] == native[:, None, :]).any(-1).sum(-1)
        _ = (overlap * valid).sum() if valid is not None else overlap.sum()
        if valid is not None:
            idx = torch.where(valid[:, None], idx, native)
    if score_function == "softmax" and normalize:
        w = torch.softmax(torch.gather(z, 1, idx), -1)
    else:
        w = torch.gather(scores, 1, idx)
        if score_function == "sigmoid" and normalize and k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * scaling
    routing_map = torch.zeros(t, e, dtype=torch.bool, device=z.device).scatter_(1, idx, True)
    return w, routing_map, routing_map.sum(0)


def _compass(z, ids, *, score_function, normalize, scaling, bias=None, valid=None):
    from compass_kernels.routing import replay_topk

    r = replay_topk(
        z,
        ids,
        score_function=score_function,
        normalize=normalize,
        scaling=scaling,
        expert_bias=bias,
        valid=valid,
    )
    return r.weights, r.routing_map, r.tokens_per_expert


def _model(t: int, e: int, k: int, backward: bool) -> Model:
    # fwd: read logits (fp32), ids (u8), valid; write weights fp32, used ids i64, map (bool),
    # tokens_per_expert; bwd: read grad_w, logits, used; write grad logits.
    fwd = 4 * t * e + t * k + t + 4 * t * k + 8 * t * k + t * e + 8 * e
    bwd = 4 * t * k + 4 * t * e + 8 * t * k + 4 * t * e
    return Model(bytes=fwd + (bwd if backward else 0), kernels=2 if backward else 1)


def replay_case(model: str, t: int, device: str, backward: bool) -> Case:
    e, k, sf, norm, scaling, has_bias = MODELS[model]
    z, ids, valid, bias = make_inputs(t, e, k, seed=t + e, device=device)
    kw = dict(score_function=sf, normalize=norm, scaling=scaling, bias=bias if has_bias else None)
    g = torch.randn(t, k, device=device)

    def fwd(fn: Callable[..., Any], **extra: Any) -> Callable[[], Any]:
        if not backward:
            return lambda: fn(z, ids, **kw, **extra)

        def call():
            x = z.detach().requires_grad_(True)
            w, rmap, tpe = fn(x, ids, **kw, **extra)
            (w * g).sum().backward()
            return x.grad, rmap, tpe

        return call

    valid_all = torch.ones(t, dtype=torch.bool, device=device)
    return Case(
        name="replay_topk fwd+bwd" if backward else "replay_topk",
        shape={"model": model, "tokens": t, "experts": e, "top_k": k},  # type: ignore[dict-item]
        providers={
            "torch (unfused replay)": fwd(torch_replay),
            "torch (+ native top-k, agreement)": fwd(torch_replay, agreement=True, valid=valid_all),
            "compass": fwd(_compass, valid=valid_all),
        },
        baseline="torch (unfused replay)",
        device=device,
        atol=ATOL,
        rtol=RTOL,
        model=_model(t, e, k, backward),
    )


def overhead_case() -> Case:
    """Host overhead per call on a tiny CPU input, layer by layer (``vs base``)."""
    from compass_kernels.routing import replay_topk, replay_topk_op

    t, e, k = OVERHEAD
    z, ids, valid, _ = make_inputs(t, e, k, seed=1, device="cpu")
    args = dict(
        logits=z,
        expert_ids=ids,
        expert_bias=None,
        valid=valid,
        score_function=0,
        normalize=True,
        scaling=1.0,
        min_score_ratio=-1.0,
    )
    outs = replay_topk_op.outputs(**args)._asdict()
    raw = replay_topk_op.kernel("torch")

    def kernel():
        raw(**args, **outs)
        return outs["weights"], outs["routing_map"], outs["tokens_per_expert"]

    def op():
        r = torch.ops.compass.replay_topk(**args)
        return r[0], r[1], r[2]

    def api():
        r = replay_topk(z, ids, valid=valid)
        return r.weights, r.routing_map, r.tokens_per_expert

    def baseline():
        return torch_replay(z, ids, score_function="softmax", normalize=True, scaling=1.0)

    return Case(
        name="overhead",
        shape={"tokens": t, "experts": e, "top_k": k},
        providers={
            "kernel (raw binding)": kernel,
            "torch.ops.compass": op,
            "api": api,
            "torch (unfused replay)": baseline,
        },
        baseline="kernel (raw binding)",
        device="cpu",
        atol=ATOL,
        rtol=RTOL,
    )


# ------------------------------------------------------------------ codec

CODEC_MODELS = {"deepseek_v3": (256, 8, 58), "qwen3_moe": (128, 8, 48)}  # E, K, MoE layers
CODEC_TOKENS, QUICK_CODEC_TOKENS = 8192, 512
TINY_TOKENS, QUICK_TINY_TOKENS = 8192, 512


def synthetic_trace(tokens: int, e: int, k: int, layers: int, seed: int):
    """A trace with skewed expert popularity (Zipf s=0.8 per layer, a different
    permutation of the experts per layer) and 1% missing tokens."""
    from compass_kernels.routing import MissingReason, RoutingTrace, ids_dtype

    g = torch.Generator().manual_seed(seed)
    pop = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 0.8
    cols = []
    for _ in range(layers):
        p = pop[torch.randperm(e, generator=g)]
        cols.append(torch.multinomial(p.expand(tokens, e), k, generator=g))
    ids = torch.stack(cols, 1).to(ids_dtype(e))
    n_seq = max(1, tokens // 1024)
    cu = torch.linspace(0, tokens, n_seq + 1).long()
    tok = torch.rand(tokens, generator=g) < 0.01
    missing = tok[:, None].expand(tokens, layers).clone()
    reason = tok.to(torch.uint8) * int(MissingReason.PREFIX_CACHE)
    return RoutingTrace(
        ids, cu, e, layer_ids=range(3, 3 + layers), missing=missing, missing_reason=reason
    )


def tiny_model_trace(tokens: int, seed: int = 0):
    """The routing of the tiny Qwen3-MoE checkpoint (compass_kernels/integration/cpu/tiny_moe.py,
    E=8, K=2, 3 MoE layers): a transformers forward over random tokens, each
    layer's top-k of its router logits (what vLLM captures on the same weights,
    tests/integration)."""
    from transformers import AutoModelForCausalLM

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe
    from compass_kernels.routing import RoutingTrace

    model = AutoModelForCausalLM.from_pretrained(cached_tiny_qwen3_moe(), dtype=torch.float32)
    cfg = model.config
    seq = 512
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (max(1, tokens // seq), seq), generator=g)
    with torch.no_grad():
        out = model.eval()(x, output_router_logits=True)
    k = cfg.num_experts_per_tok
    ids = torch.stack([lg.topk(k, -1).indices for lg in out.router_logits], 1).to(torch.uint8)
    cu = torch.arange(0, x.numel() + 1, seq)
    return RoutingTrace(ids, cu, cfg.num_experts, layer_ids=range(cfg.num_hidden_layers))


class _Encoded:
    """An encoded trace that compares by content (``--check``): two encodings
    are equal when they decode to the same sets."""

    def __init__(self, decode: Callable[[], torch.Tensor]):
        self.decode = decode

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Encoded) and torch.equal(
            self.decode().sort(-1).values, other.decode().sort(-1).values
        )

    __hash__ = None  # type: ignore[assignment]


def _codec_trace(model: str, tokens: int):
    if model == "tiny_qwen3_moe":
        return tiny_model_trace(tokens)
    e, k, layers = CODEC_MODELS[model]
    return synthetic_trace(tokens, e, k, layers, seed=e)


def _sizes(tr) -> dict[str, int]:
    """Bits per (token, layer) row x100: the set-coding bound, the set payload,
    the whole encoded trace (header, layer keys, missing mask), uint8, int16, zlib."""
    import math
    import zlib

    from compass_kernels.routing import _setcode

    e, k = tr.num_experts, tr.top_k
    rows = tr.expert_ids.shape[0] * tr.expert_ids.shape[1]
    raw = tr.canonical(sort=False).expert_ids.contiguous().numpy().tobytes()
    return {
        "bound_bits_x100": round(100 * math.log2(math.comb(e, k))),
        "set_bits_x100": round(800 * _setcode.payload_bytes(rows, e, k) / rows),
        "trace_bits_x100": round(800 * len(tr.encode(codec="set")) / rows),
        "uint8_bits": 8 * k,
        "int16_bits": 16 * k,
        "zlib1_bits_x100": round(800 * len(zlib.compress(raw, 1)) / rows),
    }


def codec_cases(model: str, tokens: int) -> list[Case]:
    """Encode and decode of the ids of one trace: compass's set codec kernel vs
    zlib level 1 of the uint8 ids (the stdlib compressor a user would reach
    for; its size is in the shape), and the end-to-end RoutingTrace.encode /
    decode (header, CRC32, missing mask) round trip vs the raw uint8 layout.
    Throughput in GB/s of uint8 ids = rows * K / time (the ``model`` bytes)."""
    import zlib

    from compass_kernels.routing import RoutingTrace, _setcode

    tr = _codec_trace(model, tokens)
    e, k = tr.num_experts, tr.top_k
    ids = tr.canonical(sort=False).expert_ids.reshape(-1, k).contiguous()
    rows = ids.shape[0]
    raw = ids.numpy().tobytes()
    shape = {"model": model, "tokens": tr.num_tokens, "layers": tr.num_moe_layers}
    shape.update(_sizes(tr))
    payload = torch.empty(_setcode.payload_bytes(rows, e, k), dtype=torch.uint8)
    _setcode.encode_into(ids, e, payload)
    z = zlib.compress(raw, 1)
    out = torch.empty_like(ids)
    ids_bytes = Model(bytes=rows * k * ids.element_size(), kernels=1)

    def unzip() -> torch.Tensor:
        return torch.frombuffer(bytearray(zlib.decompress(z)), dtype=ids.dtype).view(rows, k)

    def enc_zlib():
        z2 = zlib.compress(ids.numpy().tobytes(), 1)
        return _Encoded(
            lambda: torch.frombuffer(bytearray(zlib.decompress(z2)), dtype=ids.dtype).view(rows, k)
        )

    def enc_set():
        _setcode.encode_into(ids, e, payload)
        p = payload.clone()
        return _Encoded(lambda: _setcode.decode_sets(p.numpy().tobytes(), rows, k, e, ids.dtype))

    def dec_zlib():
        x = unzip()
        return _Encoded(lambda: x)

    def dec_set():
        _setcode.decode_into(payload, e, out)
        return _Encoded(lambda: out)

    def rt(codec: str):
        def call():
            return RoutingTrace.decode(tr.encode(codec=codec)).expert_ids.sort(-1).values

        return call

    enc_case = Case(
        name="trace codec encode",
        shape=shape,
        providers={"zlib -1 (uint8 ids)": enc_zlib, "compass set": enc_set},
        baseline="zlib -1 (uint8 ids)",
        device="cpu",
        model=ids_bytes,
    )
    dec_case = Case(
        name="trace codec decode",
        shape=shape,
        providers={"zlib -1 (uint8 ids)": dec_zlib, "compass set": dec_set},
        baseline="zlib -1 (uint8 ids)",
        device="cpu",
        model=ids_bytes,
    )
    rt_case = Case(
        name="trace codec round trip (RoutingTrace.encode+decode)",
        shape=shape,
        providers={"raw uint8": rt("raw"), "set": rt("set")},
        baseline="raw uint8",
        device="cpu",
        model=Model(bytes=2 * rows * k * ids.element_size(), kernels=2),
    )
    return [enc_case, dec_case, rt_case]


def _time_codec(tr, ids, payload, back, repeat: int) -> dict[str, tuple[float, float]]:
    """Best (wall, process CPU) seconds of each codec step over ``repeat``."""
    import math
    import time

    from compass_kernels.routing import RoutingTrace, _setcode

    e = tr.num_experts
    data = tr.encode(codec="set")
    steps = {
        "encode": lambda: _setcode.encode_into(ids, e, payload),
        "decode": lambda: _setcode.decode_into(payload, e, back),
        "decode_base": lambda: _setcode.decode_into(payload, e, back, impl=1),  # x86-64 baseline
        "trace_encode": lambda: tr.encode(codec="set"),
        "trace_decode": lambda: RoutingTrace.decode(data),
    }
    best = {name: (math.inf, math.inf) for name in steps}
    for _ in range(repeat):
        for name, fn in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            w1, c1 = time.perf_counter(), time.process_time()
            best[name] = (min(best[name][0], w1 - w0), min(best[name][1], c1 - c0))
    return best


def codec_report(tokens: int = CODEC_TOKENS, repeat: int = 7, threads=(1, 2)) -> list[dict]:
    """Bytes per (token, layer) and encode / decode throughput of the set codec
    kernel and of RoutingTrace.encode / decode, per thread count: ``python -m
    bench.bench_routing``. GB/s = bytes of the uint8 (E <= 256) / int16 id
    array in (encode) or out (decode) per second; best of ``repeat``. ``cpu``
    columns: process CPU time, which contention inflates less than wall time.
    ``decode_base``: the same decode in the x86-64 baseline build (impl=1: the
    level-by-level unrank), timed in the same loop."""
    import math

    from compass_kernels.routing import _setcode

    models = ["deepseek_v3", "qwen3_moe", "tiny_qwen3_moe"]
    out = []
    for model in models:
        tr = _codec_trace(model, tokens)
        e, k = tr.num_experts, tr.top_k
        ids = tr.canonical(sort=False).expert_ids.reshape(-1, k).contiguous()
        rows = ids.shape[0]
        nbytes = ids.numel() * ids.element_size()
        payload = torch.empty(_setcode.payload_bytes(rows, e, k), dtype=torch.uint8)
        back = torch.empty_like(ids)
        row = {
            "model": model,
            "E": e,
            "K": k,
            "rows": rows,
            "bound_B_per_row": math.log2(math.comb(e, k)) / 8,
            "set_B_per_row": payload.numel() / rows,
            "trace_B_per_row": len(tr.encode(codec="set")) / rows,
            "uint8_B_per_row": k,
            "int16_B_per_row": 2 * k,
        }
        row["set_vs_bound"] = row["set_B_per_row"] / row["bound_B_per_row"] - 1
        for nt in threads:
            prev = _setcode.set_threads(nt)
            try:
                best = _time_codec(tr, ids, payload, back, repeat)
            finally:
                _setcode.set_threads(prev)
            assert torch.equal(back, ids.sort(-1).values)
            for name, (wall, cpu) in best.items():
                row[f"{name}_GBps_{nt}t"] = nbytes / wall / 1e9
                row[f"{name}_cpu_ns_per_row_{nt}t"] = cpu / rows * 1e9
        out.append(row)
    return out


def cases(quick: bool) -> list[Case]:
    """All cases of this bench; `quick` keeps a few small ones (CI, ``--check``)."""
    device = _device()
    out: list[Case] = [overhead_case()]
    for model in MODELS:
        for t in QUICK_TOKENS if quick else TOKENS:
            out.append(replay_case(model, t, device, backward=False))
            out.append(replay_case(model, t, device, backward=True))
    for model in [*CODEC_MODELS, "tiny_qwen3_moe"]:
        out.extend(codec_cases(model, QUICK_CODEC_TOKENS if quick else CODEC_TOKENS))
    return out


if __name__ == "__main__":
    for row in codec_report():
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
