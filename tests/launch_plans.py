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
    """The op's Triton kernel on ``args`` (the op's parameters in order) and its
    outputs, all by name (kernels take their arguments by name)."""
    out = op.outputs(*args)
    out = out if isinstance(out, tuple) else (out,)
    op.kernel("triton")(
        **dict(zip(op.params, args, strict=False)), **dict(zip(op.returns, out, strict=True))
    )


def espo_logprobs() -> Plan:
    from compass_kernels.espo import logprobs as lp

    # (tokens, vocab): Qwen3 / Qwen2.5 (151,936; 16 x 9,496), an odd vocab
    # (GPT-2's 50,257), and T x V past 2^31 (the int32 -> int64 switch of T * V)
    for t, v, dt in (
        (4096, 151936, torch.bfloat16),
        (4096, 50257, torch.bfloat16),
        (16384, 151936, torch.bfloat16),
        (4096, 151936, torch.float32),
    ):
        z = torch.empty(t, v, dtype=dt, device=META)
        y = torch.empty(t, dtype=torch.int64, device=META)
        rows = [torch.empty(t, dtype=torch.float32, device=META) for _ in range(3)]
        name = f"T={t} V={v} {str(dt).removeprefix('torch.')}"
        for ent in (True, False):
            yield (
                f"forward {name} entropy={ent}",
                lambda z=z, y=y, e=ent: _run(lp.token_logprobs_entropy_op, z, y, 1.0, e),
            )
        for gl, gh in ((True, True), (True, False), (False, True)):
            yield (
                f"backward {name} grad_logprob={gl} grad_entropy={gh}",
                (
                    lambda z=z, y=y, r=rows, gl=gl, gh=gh: _run(
                        lp.token_logprobs_entropy_bwd_op,
                        z,
                        y,
                        r[0],
                        r[1],
                        r[2],
                        r[0] if gl else None,
                        r[1] if gh else None,
                        1.0,
                        0,
                    )
                ),
            )
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
    # the fused lm_head path's GPU chunk (fused_loss.default_rows: 1 GiB of fp32
    # logits, 1766 rows at V = 151,936; the roofline's logprobs_tile_stats shape)
    r, v = 1766, 151936
    big = torch.empty(r, v, dtype=torch.float32, device=META)
    yb = torch.empty(r, dtype=torch.int64, device=META)
    sb = torch.empty(4, r, dtype=torch.float32, device=META)
    yield (
        f"tile stats {r}x{v} fp32 entropy=True",
        lambda: _run(lp.logprobs_tile_stats_op, big, yb, 0, 1.0, True, sb),
    )
    yield (
        f"fused backward tile {TOKEN_CHUNK}x{VOCAB_CHUNK} fp32",
        lambda: _run(
            lp.token_logprobs_entropy_bwd_op,
            tile,
            y,
            st[0],
            st[1],
            st[2],
            st[0],
            st[1],
            1.0,
            VOCAB_CHUNK,
        ),
    )


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
        yield (
            f"replay E={e} K=8 T={t}",
            lambda z=z, ids=ids, b=b, v=valid, s=score: _run(
                replay_topk_op, z, ids, b, v, s, True, 2.5, -1.0
            ),
        )
        g = torch.empty(t, 8, dtype=torch.float32, device=META)
        used = torch.empty(t, 8, dtype=torch.int64, device=META)
        yield (
            f"replay backward E={e} K=8 T={t}",
            lambda g=g, z=z, u=used, s=score: _run(replay_topk_backward_op, g, z, u, s, True, 2.5),
        )
    # the roofline's shape (bench/roofline.py): 64k tokens, DeepSeek-V3's routing
    t = 65536
    z = torch.empty(t, 256, dtype=torch.float32, device=META)
    ids = torch.empty(t, 8, dtype=torch.uint8, device=META)
    b = torch.empty(256, dtype=torch.float32, device=META)
    valid = torch.empty(t, dtype=torch.bool, device=META)
    yield (
        f"replay E=256 K=8 T={t}",
        lambda: _run(replay_topk_op, z, ids, b, valid, 1, True, 2.5, -1.0),
    )
    g = torch.empty(t, 8, dtype=torch.float32, device=META)
    used = torch.empty(t, 8, dtype=torch.int64, device=META)
    yield (
        f"replay backward E=256 K=8 T={t}",
        lambda: _run(replay_topk_backward_op, g, z, used, 1, True, 2.5),
    )


def fp8_gemm() -> Plan:
    from compass_kernels.fp8.grouped_gemm import grouped_gemm_op

    f8 = torch.float8_e4m3fn
    # DeepSeek-V3 MoE GEMMs (E 256, N x K = 4096 x 7168 and 7168 x 2048), the
    # decode-sized 64-row tile, and K past 16,384 (256 K-groups of 128)
    for m, e, n, k in (
        (65536, 256, 4096, 7168),
        (65536, 256, 7168, 2048),
        (8192, 256, 4096, 7168),
        (16384, 32, 4096, 32768),
        (65536, 256, 4096, 32768),
        (16384, 32, 4096, 16448),
    ):
        kb, nb = -(-k // 128), -(-n // 128)
        args = (
            torch.empty(m, k, dtype=f8, device=META),
            torch.empty(m, kb, device=META),
            torch.empty(e, n, k, dtype=f8, device=META),
            torch.empty(e, nb, kb, device=META),
            torch.empty(e + 1, dtype=torch.int64, device=META),
            0,
        )
        yield f"grouped GEMM M={m} E={e} N={n} K={k}", lambda a=args: _run(grouped_gemm_op, *a)


def espo_loss() -> Plan:
    from compass_kernels.espo import loss as lo
    from compass_kernels.espo import triton_loss as tk

    def forward(lp, old, ent, adv, cu, mask, thr, sums, k, flags, n) -> None:
        # the op's scalars after the flags: the default ESPO's clip / ratio constants,
        # then the 1 / n sequence weight
        _run(
            lo.espo_loss_forward_op,
            *(lp, old, ent, adv, cu, mask, thr, sums, k, flags),
            *(0.2, 0.28, 1.0, 0.0, -20.0, 20.0, 1.0 / n, 1),
        )

    # 512 sequences x ~4k tokens (2M tokens), fp32 log-probs, a mask; the default
    # ESPO (2 entropy groups, adaptive eps), GSPO-token and GRPO configurations
    n, t = 512, 2_000_000
    f32 = {"dtype": torch.float32, "device": META}
    lp, old, ent = (torch.empty(t, **f32) for _ in range(3))
    adv = torch.empty(n, **f32)
    cu = torch.empty(n + 1, dtype=torch.int64, device=META)
    mask = torch.empty(t, dtype=torch.bool, device=META)
    for name, k, flags in (
        ("espo", 2, tk._FLAG_ADAPTIVE),
        ("gspo", 1, tk._FLAG_GSPO),
        ("grpo", 1, tk._FLAG_GSPO | tk._FLAG_TOKEN),
    ):
        thr = torch.empty(k - 1, dtype=torch.float64, device=META)
        sums = torch.empty(n * k * 3, dtype=torch.float64, device=META)
        yield (
            f"{name} group sums n={n} T={t}",
            lambda k=k, f=flags, thr=thr: _run(
                lo.espo_group_sums_op, ent, lp, old, cu, mask, thr, k, f
            ),
        )
        yield (
            f"{name} forward n={n} T={t}",
            lambda k=k, f=flags, thr=thr, sums=sums, n=n: forward(
                lp, old, ent, adv, cu, mask, thr, sums, k, f, n
            ),
        )
    g = torch.empty((), **f32)
    yield f"backward T={t}", lambda: _run(lo.espo_loss_backward_op, g, lp)
    # the roofline's shape (bench/roofline.py): 64k tokens in 8 sequences, ESPO
    n, t = 8, 65536
    lp, old, ent = (torch.empty(t, **f32) for _ in range(3))
    adv = torch.empty(n, **f32)
    cu = torch.empty(n + 1, dtype=torch.int64, device=META)
    mask = torch.empty(t, dtype=torch.bool, device=META)
    thr = torch.empty(1, dtype=torch.float64, device=META)
    sums = torch.empty(n * 2 * 3, dtype=torch.float64, device=META)
    yield (
        f"espo forward n={n} T={t}",
        lambda: forward(lp, old, ent, adv, cu, mask, thr, sums, 2, tk._FLAG_ADAPTIVE, n),
    )


def advantages() -> Plan:
    from compass_kernels.advantages import group_advantages_op, rl_zvp_op

    # the roofline's shape (bench/roofline.py): 8192 groups x 16 rewards
    r = torch.empty(8192 * 16, dtype=torch.float32, device=META)
    order = torch.empty(8192 * 16, dtype=torch.int64, device=META)
    offsets = torch.empty(8192 + 1, dtype=torch.int64, device=META)
    yield (
        "group advantages mode=0 torch.float32 8192 groups x 16",
        lambda: _run(group_advantages_op, r, order, offsets, 0, 1e-6, 1e-6),
    )
    # 512 prompts x 16 rollouts; RL-ZVP over their 8M response tokens
    n, g, t = 8192, 512, 8_000_000
    for dt in (torch.float32, torch.float64):
        r = torch.empty(n, dtype=dt, device=META)
        order = torch.empty(n, dtype=torch.int64, device=META)
        offsets = torch.empty(g + 1, dtype=torch.int64, device=META)
        for mode in (0, 1, 2):
            yield (
                f"group advantages mode={mode} {dt}",
                (
                    lambda r=r, o=order, f=offsets, m=mode: _run(
                        group_advantages_op, r, o, f, m, 1e-6, 1e-6
                    )
                ),
            )
        h = torch.empty(t, dtype=torch.float32, device=META)
        cu = torch.empty(n + 1, dtype=torch.int64, device=META)
        zv = torch.empty(n, dtype=torch.bool, device=META)
        for adv in (r, None):
            yield (
                f"rl_zvp T={t} {dt} advantages={adv is not None}",
                (lambda h=h, cu=cu, r=r, zv=zv, a=adv: _run(rl_zvp_op, h, cu, r, zv, a, 0.1)),
            )


def fp8_quant() -> Plan:
    from compass_kernels.fp8 import permute_op, quantize_op, unpermute_op

    bf16 = {"dtype": torch.bfloat16, "device": META}
    # a DeepSeek-V3 expert weight (7168 x 2048 bf16, 128 x 128 blocks), 16k
    # tokens of 7168-wide activations (1 x 128 groups), their top-8 permutation
    # over 256 experts, and the unpermute of the 2048-wide expert outputs
    w = torch.empty(7168, 2048, **bf16)
    x = torch.empty(16384, 7168, **bf16)
    for ue8m0 in (False, True):
        yield (
            f"quantize weight 7168x2048 ue8m0={ue8m0}",
            lambda u=ue8m0: _run(quantize_op, w, 128, 128, 1e-4, u, False, 0),
        )
        yield (
            f"quantize activations 16384x7168 ue8m0={ue8m0}",
            lambda u=ue8m0: _run(quantize_op, x, 1, 128, 1e-10, u, True, 0),
        )
    # and at the roofline's shape (bench/roofline.py): 128k tokens of 2048 columns
    for m, kc in ((16384, 7168), (131072, 2048)):
        xm = x if kc == 7168 else torch.empty(m, kc, **bf16)
        ids = torch.empty(m, 8, dtype=torch.int32, device=META)
        yield (
            f"permute + quantize {m} x top-8, E=256" + ("" if kc == 7168 else f", K={kc}"),
            lambda xm=xm, ids=ids: _run(permute_op, xm, ids, 256, 1e-10, False, 0),
        )
    for m in (16384, 131072):
        y = torch.empty(m * 8, 2048, **bf16)
        dst = torch.empty(m * 8, dtype=torch.int64, device=META)
        tw = torch.empty(m, 8, dtype=torch.float32, device=META)
        yield (
            f"unpermute {m} x top-8 x 2048",
            lambda y=y, dst=dst, tw=tw: _run(unpermute_op, y, dst, tw),
        )


def packing() -> Plan:
    from compass_kernels.packing.thd import thd_pack_op, thd_positions_op, thd_unpack_op

    # a micro-batch of 256 sequences, 1M tokens: 7168-wide bf16 hidden states
    # (14,336-byte rows), int64 token ids (8-byte rows), and a 24-byte odd row;
    # context parallelism 1 and 2
    m, t = 256, 1 << 20
    i64 = {"dtype": torch.int64, "device": META}
    ss, sl, cu = torch.empty(m, **i64), torch.empty(m, **i64), torch.empty(m + 1, **i64)
    oo = torch.empty(m + 1, **i64)
    for w in (14336, 8, 24):
        src = torch.empty(t, w, dtype=torch.uint8, device=META)
        for cp, rank in ((1, 0), (2, 1)):
            yield (
                f"pack {t} x {w} B cp={cp}",
                lambda src=src, cp=cp, r=rank: _run(
                    thd_pack_op, src, ss, sl, oo, cp, r, 0, t // cp
                ),
            )
            yield (
                f"unpack {t} x {w} B cp={cp}",
                lambda src=src, cp=cp: _run(thd_unpack_op, src, sl, cu, oo, cp, t),
            )
    yield f"positions {t} cp=2", lambda: _run(thd_positions_op, oo, 2, 1, t // 2)
    # the roofline's shape (bench/roofline.py): 1 GiB of 4096-wide bf16 rows
    rows = 1 << 17
    src = torch.empty(rows, 8192, dtype=torch.uint8, device=META)
    yield (
        f"pack {rows} x 8192 B cp=1",
        lambda: _run(thd_pack_op, src, ss, sl, oo, 1, 0, 0, rows),
    )
    yield f"unpack {rows} x 8192 B cp=1", lambda: _run(thd_unpack_op, src, sl, cu, oo, 1, rows)


def routing_setcode() -> Plan:
    import math

    from compass_kernels.routing import _setcode
    from compass_kernels.routing import triton_setcode as ts

    # a step's trace: 61 MoE layers x 8k tokens; DeepSeek-V3 (E 256, top-8, uint8
    # ids, missing rows), Kimi-K2 (E 384: int16 ids), Qwen3-MoE (E 128), and a
    # G > 1 layout (E 8, top-2: 13 rows per pack). The checks are C++ on real
    # tensors: the launches alone here, with the layout they return.
    rows = 61 * 8192
    for e, k, dt, miss in (
        (256, 8, torch.uint8, True),
        (384, 8, torch.int16, False),
        (128, 8, torch.uint8, False),
        (8, 2, torch.uint8, False),
    ):
        ids = torch.empty(rows, k, dtype=dt, device=META)
        missing = torch.empty(rows, dtype=torch.bool, device=META) if miss else None
        outs = _setcode.encode_sets_op.outputs(ids, e, missing)
        layout = (*_setcode.layout(e, k), math.comb(e, k))
        yield (
            f"set encode E={e} K={k} rows={rows} missing={miss}",
            (lambda i=ids, e=e, m=missing, o=outs, lay=layout: ts.launch_encode(i, e, m, *o, lay)),
        )


def fp8_gemm_args() -> Plan:
    from compass_kernels.fp8.grouped_gemm import grouped_args_op
    from compass_kernels.fp8.triton_args import launch_grouped_args

    f8 = torch.float8_e4m3fn
    # the CUTLASS path's argument builder at DeepSeek-V3 (E 256), Kimi-K2 (E 384)
    # and a small-E model (E 8); the checks are C++ on real tensors: the launch alone
    for m, e, n, k in ((65536, 256, 4096, 7168), (16384, 384, 4096, 7168), (8192, 8, 7168, 2048)):
        kb, nb = -(-k // 128), -(-n // 128)
        args = (
            torch.empty(m, k, dtype=f8, device=META),
            torch.empty(m, kb, device=META),
            torch.empty(e, n, k, dtype=f8, device=META),
            torch.empty(e, nb, kb, device=META),
            torch.empty(e + 1, dtype=torch.int64, device=META),
            torch.empty(m, n, dtype=torch.bfloat16, device=META),
        )
        outs = grouped_args_op.outputs(*args)
        yield (
            f"grouped GEMM args M={m} E={e} N={n} K={k}",
            (lambda a=args, o=outs: launch_grouped_args(*a, *o)),
        )


PLANS: dict[str, Callable[[], Plan]] = {
    "espo.triton_logprobs": espo_logprobs,
    "routing.triton": routing,
    "fp8.triton_gemm": fp8_gemm,
    "fp8.triton": fp8_quant,
    "espo.triton_loss": espo_loss,
    "advantages.triton": advantages,
    "packing.triton": packing,
    "routing.triton_setcode": routing_setcode,
    "fp8.triton_args": fp8_gemm_args,
}
