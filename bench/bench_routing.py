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


def torch_replay(z, ids, *, score_function, normalize, scaling, bias=None, valid=None,
                 agreement=False):  # fmt: skip
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

    r = replay_topk(z, ids, score_function=score_function, normalize=normalize, scaling=scaling,
                    expert_bias=bias, valid=valid)  # fmt: skip
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
    kw = dict(score_function=sf, normalize=norm, scaling=scaling,
              bias=bias if has_bias else None)  # fmt: skip
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
            "torch (+ native top-k, agreement)": fwd(
                torch_replay, agreement=True, valid=valid_all
            ),  # fmt: skip
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
    args = (z, ids, None, valid, 0, True, 1.0, -1.0)
    outs = replay_topk_op.outputs(*args)
    raw = replay_topk_op.kernel("cpp")

    def kernel():
        raw(*args, *outs)
        return outs[0], outs[1], outs[2]

    def op():
        r = torch.ops.compass.replay_topk(*args)
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
    return RoutingTrace(ids, cu, e, layer_ids=range(3, 3 + layers), missing=missing,
                        missing_reason=reason)  # fmt: skip


def codec_case(model: str, tokens: int) -> Case:
    """encode + decode round trip of one trace; the shape records the bits per
    (token, layer) row of each format and of the set-coding bound (x100)."""
    import math

    from compass_kernels.routing import RoutingTrace

    e, k, layers = CODEC_MODELS[model]
    tr = synthetic_trace(tokens, e, k, layers, seed=e)
    rows = tokens * layers
    set_bytes = len(tr.encode(codec="set"))
    raw_bytes = len(tr.encode(codec="raw"))

    def rt(codec: str):
        def call():
            return RoutingTrace.decode(tr.encode(codec=codec)).expert_ids.sort(-1).values

        return call

    return Case(
        name="trace codec (encode+decode)",
        shape={
            "model": model,
            "tokens": tokens,
            "layers": layers,  # type: ignore[dict-item]
            "bound_bits_x100": round(100 * math.log2(math.comb(e, k))),
            "set_bits_x100": round(800 * set_bytes / rows),
            "uint8_bits_x100": round(800 * raw_bytes / rows),
            "int16_bits": 16 * k,
        },
        providers={"raw uint8": rt("raw"), "set": rt("set")},
        baseline="raw uint8",
        device="cpu",
        model=Model(bytes=2 * k * rows, kernels=2),
    )


def codec_report(tokens: int = CODEC_TOKENS, repeat: int = 5) -> list[dict]:
    """Bytes per (token, layer) and encode / decode throughput (GB/s of uint8
    ids) of the set codec: ``python -m bench.bench_routing``."""
    import math
    import time

    from compass_kernels.routing import _setcode

    out = []
    for model, (e, k, layers) in CODEC_MODELS.items():
        tr = synthetic_trace(tokens, e, k, layers, seed=e)
        ids = tr.canonical().expert_ids
        rows = ids.shape[0] * ids.shape[1]
        payload = _setcode.encode_sets(ids, e)
        enc = dec = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            payload = _setcode.encode_sets(ids, e)
            t1 = time.perf_counter()
            back = _setcode.decode_sets(payload, rows, k, e, ids.dtype)
            t2 = time.perf_counter()
            enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
        assert torch.equal(back.reshape(ids.shape), ids.sort(-1).values)
        nbytes = ids.numel() * ids.element_size()
        out.append({
            "model": model, "E": e, "K": k, "rows": rows,
            "bound_bytes_per_row": math.log2(math.comb(e, k)) / 8,
            "set_bytes_per_row": len(payload) / rows,
            "uint8_bytes_per_row": k, "int16_bytes_per_row": 2 * k,
            "encode_GBps": nbytes / enc / 1e9, "decode_GBps": nbytes / dec / 1e9,
            "roundtrip_GBps": nbytes / (enc + dec) / 1e9,
        })  # fmt: skip
    return out


def cases(quick: bool) -> list[Case]:
    """All cases of this bench; `quick` keeps a few small ones (CI, ``--check``)."""
    device = _device()
    out: list[Case] = [overhead_case()]
    for model in MODELS:
        for t in QUICK_TOKENS if quick else TOKENS:
            out.append(replay_case(model, t, device, backward=False))
            out.append(replay_case(model, t, device, backward=True))
    for model in CODEC_MODELS:
        out.append(codec_case(model, QUICK_CODEC_TOKENS if quick else CODEC_TOKENS))
    return out


if __name__ == "__main__":
    for row in codec_report():
        print(row)
