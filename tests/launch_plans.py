"""The calls tests.aot.launched_variants makes: each op's Triton backend at the
op's typical and largest shapes, as a training step calls it.

Each plan yields (case, call); ``call()`` runs the op's Triton kernel function
(``op.kernel("triton")``, the backend the public functions dispatch to) on
``meta`` tensors (no memory: T x V past 2^31 costs nothing) or small CPU
tensors, under ``tests.aot.record_launches(execute=False)``: the launches are
recorded, not run, and their arguments give the specialization. Only shapes,
dtypes and layouts are written here; strides, integer arguments and which of
them Triton specializes come from the calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

Plan = Iterator[tuple[str, Callable[[], None]]]
META = torch.device("meta")


def _run(op, *args) -> None:
    op.kernel("triton")(*args, *op.outputs(*args))


def espo_logprobs() -> Plan:
    from compass_kernels.espo import logprobs as lp

    # (tokens, vocab): Qwen3 / Qwen2.5 (151,936; 16 x 9,496), an odd vocab
    # (GPT-2's 50,257), and T x V past 2^31 (the int32 -> int64 switch of T * V)
    for t, v, dt in ((4096, 151936, torch.bfloat16), (4096, 50257, torch.bfloat16),
                     (16384, 151936, torch.bfloat16), (4096, 151936, torch.float32)):  # fmt: skip
        z = torch.empty(t, v, dtype=dt, device=META)
        y = torch.empty(t, dtype=torch.int64, device=META)
        rows = [torch.empty(t, dtype=torch.float32, device=META) for _ in range(3)]
        name = f"T={t} V={v} {str(dt).removeprefix('torch.')}"
        for ent in (True, False):
            yield f"forward {name} entropy={ent}", lambda z=z, y=y, e=ent: _run(
                lp.token_logprobs_entropy_op, z, y, 1.0, e)  # fmt: skip
        for gl, gh in ((True, True), (True, False), (False, True)):
            yield f"backward {name} grad_logprob={gl} grad_entropy={gh}", (
                lambda z=z, y=y, r=rows, gl=gl, gh=gh: _run(
                    lp.token_logprobs_entropy_bwd_op, z, y, r[0], r[1], r[2],
                    r[0] if gl else None, r[1] if gh else None, 1.0, 0))  # fmt: skip
    # the fused linear path: [token_chunk, vocab_chunk] fp32 tiles of logits
    from compass_kernels.espo.logprobs import TOKEN_CHUNK, VOCAB_CHUNK

    tile = torch.empty(TOKEN_CHUNK, VOCAB_CHUNK, dtype=torch.float32, device=META)
    y = torch.empty(TOKEN_CHUNK, dtype=torch.int64, device=META)
    st = torch.empty(4, TOKEN_CHUNK, dtype=torch.float32, device=META)
    for ent in (True, False):
        yield (
            f"tile stats {TOKEN_CHUNK}x{VOCAB_CHUNK} fp32 entropy={ent}",
            (lambda e=ent: _run(lp.logprobs_tile_stats_op, tile, y, VOCAB_CHUNK, 1.0, e, st)),
        )
    yield (f"fused backward tile {TOKEN_CHUNK}x{VOCAB_CHUNK} fp32", lambda: _run(
        lp.token_logprobs_entropy_bwd_op, tile, y, st[0], st[1], st[2], st[0], st[1], 1.0,
        VOCAB_CHUNK))  # fmt: skip


def routing() -> Plan:
    from compass_kernels.routing import replay_topk_backward_op, replay_topk_op

    # DeepSeek-V3 (E 256, top-8, sigmoid + bias), Kimi-K2 (E 384, top-8),
    # Qwen3-MoE (E 128, top-8, softmax): 8k tokens per micro-batch
    t = 8192
    for e, score, bias in ((256, 1, True), (384, 1, True), (128, 0, False)):
        z = torch.empty(t, e, dtype=torch.float32, device=META)
        ids = torch.empty(t, 8, dtype=torch.uint8 if e <= 256 else torch.int16, device=META)
        b = torch.empty(e, dtype=torch.float32, device=META) if bias else None
        valid = torch.empty(t, dtype=torch.bool, device=META)
        yield f"replay E={e} K=8 T={t}", lambda z=z, ids=ids, b=b, v=valid, s=score: _run(
            replay_topk_op, z, ids, b, v, s, True, 2.5, -1.0)  # fmt: skip
        g = torch.empty(t, 8, dtype=torch.float32, device=META)
        used = torch.empty(t, 8, dtype=torch.int64, device=META)
        yield f"replay backward E={e} K=8 T={t}", lambda g=g, z=z, u=used, s=score: _run(
            replay_topk_backward_op, g, z, u, s, True, 2.5)  # fmt: skip


def fp8_gemm() -> Plan:
    from compass_kernels.fp8.grouped_gemm import grouped_gemm_op

    f8 = torch.float8_e4m3fn
    # DeepSeek-V3 MoE GEMMs (E 256, N x K = 4096 x 7168 and 7168 x 2048), the
    # decode-sized 64-row tile, and K past 16,384 (256 K-groups of 128)
    for m, e, n, k in ((65536, 256, 4096, 7168), (65536, 256, 7168, 2048),
                       (8192, 256, 4096, 7168), (16384, 32, 4096, 32768),
                       (65536, 256, 4096, 32768), (16384, 32, 4096, 16448)):  # fmt: skip
        kb, nb = -(-k // 128), -(-n // 128)
        args = (
            torch.empty(m, k, dtype=f8, device=META), torch.empty(m, kb, device=META),
            torch.empty(e, n, k, dtype=f8, device=META), torch.empty(e, nb, kb, device=META),
            torch.empty(e + 1, dtype=torch.int64, device=META), 0,
        )  # fmt: skip
        yield f"grouped GEMM M={m} E={e} N={n} K={k}", lambda a=args: _run(grouped_gemm_op, *a)


PLANS: dict[str, Callable[[], Plan]] = {
    "espo.triton_logprobs": espo_logprobs,
    "routing.triton": routing,
    "fp8.triton_gemm": fp8_gemm,
}
