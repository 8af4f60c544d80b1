"""The GPU runbook's timing step (scripts/gpu_check.sh): a few CUDA-event timings
that say whether each GPU kernel is near its roofline, in about a minute.

Each row: the op, the backend, the median device time (CUDA events, L2 flushed
before each sample), the bytes or FLOPs it must move, the rate, and the share of
the ceiling of THIS device (``of_peak``), read from the one table of device
ceilings, bench/roofline.py DEVICES (H100 SXM 3.35 TB/s, H200 4.8 TB/s; bf16
989, fp8 1979 TFLOP/s dense), picked by the device's name; a GPU not in the
table gets no ``of_peak`` and says why (``ceiling``). Where bench/roofline.py
models the kernel, ``model_ms`` and ``measured_over_model`` (>= 1: how far the
kernel is from its model) follow. Rows:

- log-probs + entropy forward at 4096 x 151,936 bf16 per backend, beside torch's
  float32 log_softmax + gather + entropy (what a user writes otherwise);
- the FP8 permute + 1x128 quantize at 128k tokens x top-8 (K = 2048);
- THD pack of 1 GiB of bf16 rows;
- the FP8 grouped GEMM: device time and the host time of one call (no sync);
- the fused linear ESPO loss (forward + backward) against its floor, the three
  bf16 GEMMs of logits, d_hidden and d_weight timed with torch.mm, and the peer:
  Liger-Kernel's fused linear cross entropy (bf16 and float32 accumulation) when
  liger_kernel imports (a missing one is a row with its error, not a skip);
- the FP8 grouped GEMM at DeepGEMM's contiguous-layout shapes, TFLOP/s and GB/s
  as DeepGEMM's README reports them;
- the 1x128 quantize at 16384 x 7168 beside torch's amax + divide + cast.

Usage: python -m bench.gpu_timing [--out timing.json] [--small --device cpu]
(--small --device cpu runs every row at toy sizes on the CPU: a check of the
script itself, whose times mean nothing). Failures are recorded per row, printed,
and make the exit status 1; the other rows still run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch

import compass_kernels as ck
from bench import roofline
from bench.harness import _interleaved_samples
from compass_kernels.advantages import group_advantages_op
from compass_kernels.espo.logprobs import token_logprobs_entropy_op
from compass_kernels.espo.loss import espo_loss_forward_op
from compass_kernels.fp8 import permute_op, quantize_op, unpermute_op
from compass_kernels.fp8.grouped_gemm import grouped_gemm_op
from compass_kernels.packing.thd import thd_pack_op
from compass_kernels.routing import replay_topk_op

#: The device's ceilings (bench/roofline.py), set by main(); None: not in the table.
DEVICE: roofline.Device | None = None
DEVICE_NOTE = ""


class Timer:
    """Median seconds per call: the benches' interleaved sampler (bench/harness.py:
    CUDA events with L2 flushed on a GPU, perf_counter with GC paused on the CPU),
    after one warm-up call (compilation, caches)."""

    def __init__(self, device: str, reps: int) -> None:
        self.cuda = device == "cuda"
        self.reps = reps

    def __call__(self, fn) -> float:
        fn()
        samples = _interleaved_samples(
            {"fn": fn}, {"fn": 1}, self.reps, self.cuda, {"fn": "gpu_timing"}
        )["fn"]
        return statistics.median(samples)


def _gpu_backends(op, dev):
    """The op's GPU backends (every one it registers) on a GPU; the default on the CPU."""
    if dev != "cuda":
        return (None,)
    return tuple(b for b in op.backends if b not in ("torch", "cpp"))


def row(op, backend, seconds, *, bytes_=None, flops=None, precision="bf16", model=True, **extra):
    """One timing row; ``of_peak`` against this device's ceiling, ``model_ms`` and
    ``measured_over_model`` where bench/roofline.py models ``op`` (``model``)."""
    r = {"op": op, "backend": backend, "ms": round(seconds * 1e3, 4)}
    d = DEVICE
    if bytes_ is not None:
        r["GB/s"] = round(bytes_ / seconds / 1e9, 1)
        if d is not None:
            r["of_peak"] = round(bytes_ / seconds / d.hbm_bytes_per_s, 3)
    if flops is not None:
        r["TFLOP/s"] = round(flops / seconds / 1e12, 1)
        if d is not None:
            r["of_peak"] = round(flops / seconds / d.flops_per_s[precision], 3)
    if d is None:
        r["ceiling"] = DEVICE_NOTE
    elif model:
        m = roofline.model_for_timing_op(op, d)
        if m is not None:
            r["model_ms"] = round(m * 1e3, 4)
            r["measured_over_model"] = round(seconds / m, 2)
    r.update(extra)
    return r


def logprobs_rows(t: Timer, dev: str, small: bool):
    T, V = (64, 1000) if small else (4096, 151_936)
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(T, V, device=dev, generator=g).to(torch.bfloat16)
    y = torch.randint(0, V, (T,), device=dev, generator=g)
    out = []
    for backend in _gpu_backends(token_logprobs_entropy_op, dev):
        s = t(lambda b=backend: ck.espo.token_logprobs_entropy(logits, y, backend=b))
        out.append(
            row(
                "logprobs_fwd",
                backend or "default",
                s,
                bytes_=T * V * 2,
                shape=f"{T}x{V}",
                model=not small,
            )
        )

    def torch_fwd():
        lp = torch.log_softmax(logits.float(), -1)
        return lp.gather(1, y[:, None]), -(lp.exp() * lp).sum(-1)

    s = t(torch_fwd)
    out.append(
        row("logprobs_fwd", "torch fp32", s, bytes_=T * V * 2, shape=f"{T}x{V}", model=not small)
    )
    lg = logits.clone().requires_grad_()
    gl, gh = torch.randn(T, device=dev), torch.randn(T, device=dev)
    for backend in _gpu_backends(token_logprobs_entropy_op, dev):
        lp, ent = ck.espo.token_logprobs_entropy(lg, y, backend=backend)

        def bwd(lp=lp, ent=ent):
            torch.autograd.grad((lp, ent), lg, (gl, gh), retain_graph=True)

        s = t(bwd)
        out.append(
            row(
                "logprobs_bwd",
                backend or "default",
                s,
                bytes_=T * V * 4,
                shape=f"{T}x{V}",
                model=not small,
            )
        )
    return out


def permute_rows(t: Timer, dev: str, small: bool):
    M, K, k, E = (512, 256, 8, 16) if small else (131_072, 2048, 8, 256)
    x = torch.randn(M, K, device=dev).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(8)])[
        torch.randint(0, 8, (M,), device=dev)
    ].to(torch.int32)
    moved = M * K * 2 + M * k * K * 1 + M * k * (K // 128) * 4
    out = []
    for backend in _gpu_backends(permute_op, dev):
        s = t(lambda b=backend: ck.fp8.permute_quantize(x, ids, E, backend=b))
        out.append(
            row(
                "permute_quantize",
                backend or "default",
                s,
                bytes_=moved,
                shape=f"{M}x{k} K={K} E={E}",
                model=not small,
            )
        )

    def torch_permute():  # what a user writes otherwise: sort the slots, gather, quantize
        order = ids.flatten().argsort(stable=True)
        g = x[order // k].float().view(M * k, K // 128, 128)
        sc = g.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
        return (g / sc).to(torch.float8_e4m3fn), sc, order

    s = t(torch_permute)
    out.append(
        row(
            "permute_quantize",
            "torch sort + gather + quantize",
            s,
            bytes_=moved,
            shape=f"{M}x{k} K={K} E={E}",
            model=not small,
        )
    )
    dst = ck.fp8.permute_quantize(x, ids, E).dst_index
    y = torch.randn(M * k, K, device=dev).to(torch.bfloat16)
    w = torch.rand(M, k, device=dev)
    un_moved = M * k * K * 2 + M * K * 2 + M * k * 12
    for backend in _gpu_backends(unpermute_op, dev):
        s = t(lambda b=backend: ck.fp8.unpermute(y, dst, w, backend=b))
        out.append(
            row(
                "unpermute",
                backend or "default",
                s,
                bytes_=un_moved,
                shape=f"{M}x{k} K={K}",
                model=not small,
            )
        )
    return out


def routing_rows(t: Timer, dev: str, small: bool):
    T, E, K = (256, 64, 4) if small else (65_536, 256, 8)
    g = torch.Generator(device=dev).manual_seed(3)
    logits = torch.randn(T, E, device=dev, generator=g)
    ids = torch.rand(T, E, device=dev, generator=g).argsort(-1)[:, :K].contiguous()
    bias = torch.randn(E, device=dev, generator=g) * 0.01
    moved = T * E * 4 + T * K * 8 + T * K * 4 + T * K * 8 + T * E
    out = []
    for backend in _gpu_backends(replay_topk_op, dev):
        s = t(
            lambda b=backend: ck.routing.replay_topk(
                logits, ids, score_function="sigmoid", expert_bias=bias, backend=b
            )
        )
        out.append(
            row(
                "routing_replay_fwd",
                backend or "default",
                s,
                bytes_=moved,
                shape=f"T={T} E={E} K={K}",
                model=not small,
            )
        )

    def torch_replay():  # Megatron's sigmoid router at fixed experts
        sc = torch.sigmoid(logits)
        wsel = sc.gather(1, ids)
        wsel = wsel / wsel.sum(-1, keepdim=True)
        rmap = torch.zeros(T, E, dtype=torch.bool, device=dev).scatter_(1, ids, True)
        return wsel, rmap, rmap.sum(0)

    s = t(torch_replay)
    out.append(
        row(
            "routing_replay_fwd",
            "torch",
            s,
            bytes_=moved,
            shape=f"T={T} E={E} K={K}",
            model=not small,
        )
    )
    return out


def advantages_rows(t: Timer, dev: str, small: bool):
    G, S = (64, 16) if small else (8192, 16)
    r = torch.rand(G * S, device=dev)
    out = []
    for backend in _gpu_backends(group_advantages_op, dev):
        s = t(lambda b=backend: ck.advantages.group_advantages(r, group_size=S, backend=b))
        out.append(
            row(
                "group_advantages",
                backend or "default",
                s,
                bytes_=G * S * 8 + G * 16,
                shape=f"{G} groups x {S}",
                model=not small,
            )
        )

    def torch_adv():
        v = r.view(G, S).double()
        m, sd = v.mean(1, keepdim=True), v.std(1, keepdim=True)
        return ((v - m) / (sd + 1e-6)).float(), sd.squeeze(1) < 1e-6

    s = t(torch_adv)
    out.append(
        row(
            "group_advantages",
            "torch",
            s,
            bytes_=G * S * 8 + G * 16,
            shape=f"{G} groups x {S}",
            model=not small,
        )
    )
    return out


def espo_loss_rows(t: Timer, dev: str, small: bool):
    T, n = (512, 4) if small else (65_536, 8)
    g = torch.Generator(device=dev).manual_seed(4)
    cu = torch.arange(0, T + 1, T // n, device=dev, dtype=torch.int64)
    old = -torch.rand(T, device=dev, generator=g) * 4
    lp = (old + torch.randn(T, device=dev, generator=g) * 0.1).requires_grad_()
    ent = torch.rand(T, device=dev, generator=g) * 4
    adv = torch.randn(n, device=dev, generator=g)
    out = []
    for backend in _gpu_backends(espo_loss_forward_op, dev):

        def step(b=backend):
            loss, _ = ck.espo.espo_loss(lp, old, ent, adv, cu, vocab_size=151_936, backend=b)
            loss.backward()

        s = t(step)
        out.append(
            row(
                "espo_loss",
                backend or "default",
                s,
                bytes_=T * 4 * 10,
                shape=f"{T} tokens in {n} sequences",
                model=not small,
            )
        )
    return out


def quantize_rows(t: Timer, dev: str, small: bool):
    R, C = (64, 512) if small else (16_384, 7168)
    x = torch.randn(R, C, device=dev).to(torch.bfloat16)
    moved = R * C * 2 + R * C + R * (C // 128) * 4
    out = []
    for backend in _gpu_backends(quantize_op, dev):
        s = t(lambda b=backend: ck.fp8.quantize_token_groups(x, backend=b))
        out.append(
            row(
                "quantize_1x128",
                backend or "default",
                s,
                bytes_=moved,
                shape=f"{R}x{C}",
                model=not small,
            )
        )

    def torch_q():
        g = x.float().view(R, C // 128, 128)
        s_ = g.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
        return (g / s_).to(torch.float8_e4m3fn), s_

    s = t(torch_q)
    out.append(row("quantize_1x128", "torch", s, bytes_=moved, shape=f"{R}x{C}", model=False))
    return out


def pack_rows(t: Timer, dev: str, small: bool):
    H = 64 if small else 4096
    T = (1 << 16) // (2 * H) if small else (1 << 30) // (2 * H)
    n_seq = max(4, T // 512)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 2 * (T // n_seq), (n_seq,), generator=g).tolist()
    total = sum(lengths)
    x = torch.randn(total, H, device=dev).to(torch.bfloat16)
    idx = list(range(len(lengths)))[::-1]
    out = []
    for backend in _gpu_backends(thd_pack_op, dev):
        s = t(lambda b=backend: ck.packing.pack(x, lengths, idx, pad_multiple=8, backend=b))
        out.append(
            row(
                "thd_pack",
                backend or "default",
                s,
                bytes_=2 * total * H * 2,
                shape=f"{len(lengths)} seqs, {total * H * 2 / 2**30:.2f} GiB",
                model=not small,
            )
        )
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    gather = torch.cat([torch.arange(int(starts[i]), int(starts[i]) + lengths[i]) for i in idx])
    gather = gather.to(dev)
    s = t(lambda: x.index_select(0, gather))
    out.append(
        row(
            "thd_pack",
            "torch index_select",
            s,
            bytes_=2 * total * H * 2,
            shape=f"{len(lengths)} seqs",
            model=not small,
        )
    )
    return out


#: DeepGEMM's README, "Grouped GEMMs for MoE models (contiguous layout)": groups, M per
#: group, N, K (it reports TFLOP/s and GB/s; so does this row).
DEEPGEMM_SHAPES = (
    (4, 8192, 4096, 7168),
    (4, 8192, 7168, 2048),
    (8, 4096, 4096, 7168),
    (8, 4096, 7168, 2048),
)


def gemm_rows(t: Timer, dev: str, small: bool):
    out = _gemm_rows(
        t, dev, *((4, 256, 256, 300) if small else (64, 4096, 7168, 16_384)), model=False
    )
    for groups, m, n, k in ((2, 128, 256, 256),) if small else DEEPGEMM_SHAPES:
        out += _gemm_rows(
            t,
            dev,
            groups,
            n,
            k,
            groups * m,
            model=not small,
            layout=f"DeepGEMM contiguous {groups}x{m}",
        )
    return out


def _gemm_rows(
    t: Timer, dev: str, E: int, N: int, K: int, rows: int, *, model: bool, layout: str = ""
):
    x = torch.randn(rows, K, device=dev)
    w = torch.randn(E, N, K, device=dev)
    a_q, a_s = ck.fp8.quantize_token_groups(x)
    b_q, b_s = ck.fp8.quantize_blockwise(w)
    counts = torch.full((E,), rows // E, dtype=torch.int64)
    counts[-1] += rows - int(counts.sum())
    off = torch.zeros(E + 1, dtype=torch.int64)
    off[1:] = counts.cumsum(0)
    off = off.to(dev)
    flops = 2 * rows * N * K
    moved = rows * K + E * N * K + rows * N * 2 + rows * (K // 128) * 4
    out = []
    for backend in _gpu_backends(grouped_gemm_op, dev):

        def call(b=backend):
            return ck.fp8.grouped_gemm(a_q, a_s, b_q, b_s, off, backend=b)

        s = t(call)
        call()
        if dev == "cuda":
            torch.cuda.synchronize()
        host = []
        for _ in range(20):
            t0 = time.perf_counter()
            call()
            host.append(time.perf_counter() - t0)
        if dev == "cuda":
            torch.cuda.synchronize()
        r = row(
            "fp8_grouped_gemm",
            backend or "default",
            s,
            flops=flops,
            precision="fp8",
            model=False,
            host_us=round(statistics.median(host) * 1e6, 1),
            shape=f"E={E} rows={rows} N={N} K={K}",
            layout=layout,
        )
        r["GB/s"] = round(moved / s / 1e9, 1)
        if model and DEVICE is not None:
            mod = roofline._grouped_gemm(E, rows // E, N, K).seconds(DEVICE)
            r["model_ms"] = round(mod * 1e3, 4)
            r["measured_over_model"] = round(s / mod, 2)
        out.append(r)
    if layout:  # the baseline: one bf16 torch.mm per group on dequantized operands
        a16 = x.to(torch.bfloat16)
        w16 = w.to(torch.bfloat16)
        offs = off.tolist()

        def per_group():
            for e in range(E):
                torch.mm(a16[offs[e] : offs[e + 1]], w16[e].T)

        s = t(per_group)
        out.append(
            row(
                "fp8_grouped_gemm",
                "torch bf16 mm per group",
                s,
                flops=flops,
                model=False,
                shape=f"E={E} rows={rows} N={N} K={K}",
                layout=layout,
            )
        )
    return out


def espo_rows(t: Timer, dev: str, small: bool):
    T, H, V, S = (96, 64, 1000, 6) if small else (8192, 4096, 151_936, 16)
    dt = torch.bfloat16
    h = (torch.randn(T, H, device=dev) / H**0.5).to(dt).requires_grad_()
    w = (torch.randn(V, H, device=dev) / 4).to(dt).requires_grad_()
    y = torch.randint(0, V, (T,), device=dev)
    cu_host = [i * (T // S) for i in range(S)] + [T]
    cu = torch.tensor(cu_host, device=dev, dtype=torch.int32)
    old_lp = -torch.rand(T, device=dev) * 5
    old_ent = torch.rand(T, device=dev) * 3
    adv = torch.randn(S, device=dev)

    def loss_step():
        loss, *_ = ck.espo.fused_linear_espo_loss(
            h, w, y, old_lp, old_ent, adv, cu, cu_seqlens_host=cu_host
        )
        loss.backward()

    s = t(loss_step)
    g = torch.randn(T, V, device=dev, dtype=dt)

    def floor():
        torch.mm(h.detach(), w.detach().t())
        torch.mm(g, w.detach())
        torch.mm(g.t(), h.detach())

    f = t(floor)
    flops = 3 * 2 * T * H * V
    shape = f"T={T} H={H} V={V}"
    model = not small and (T, H, V) == (roofline.LM_T, roofline.LM_H, roofline.LM_V)
    out = [
        row(
            "espo_fused_fwd_bwd",
            "default",
            s,
            flops=flops,
            floor_ms=round(f * 1e3, 4),
            over_floor=round(s / f, 2),
            shape=shape,
            model=model,
        ),
        row("espo_3gemm_floor", "torch.mm", f, flops=flops, shape=shape, model=False),
    ]
    # The peer: Liger-Kernel's fused linear cross entropy (the same 3 GEMMs + softmax
    # gradient in place; a cross-entropy loss, not ESPO's, so the comparison is of cost).
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # recorded as a row: the peer did not run here
        return out + [{"op": "liger_flce_fwd_bwd", "error": f"{type(e).__name__}: {e}"[:300]}]
    if dev != "cuda":  # Liger's kernels are Triton launches: a GPU's (imported above)
        return out + [{"op": "liger_flce_fwd_bwd", "backend": "liger", "note": "GPU only"}]
    for accum in (None, torch.float32):
        lce = LigerFusedLinearCrossEntropyLoss(accum_dtype=accum)

        def peer(lce=lce):
            hh = h.detach().clone().requires_grad_()
            ww = w.detach().clone().requires_grad_()
            lce(ww, hh, y).backward()

        p = t(peer)
        out.append(
            row(
                "liger_flce_fwd_bwd",
                f"liger {'fp32' if accum else 'bf16'} accum",
                p,
                flops=flops,
                over_floor=round(p / f, 2),
                shape=shape,
                model=False,
            )
        )
    return out


SECTIONS = {
    "logprobs": logprobs_rows,
    "permute": permute_rows,
    "quantize": quantize_rows,
    "routing": routing_rows,
    "advantages": advantages_rows,
    "espo_loss": espo_loss_rows,
    "pack": pack_rows,
    "grouped_gemm": gemm_rows,
    "espo": espo_rows,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument(
        "--jsonl", default=None, help="append each row here as a JSON line when measured"
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="toy sizes (a check of the script)")
    p.add_argument("--reps", type=int, default=10, help="timed samples per row")
    p.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="sections to run")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_timing: FAIL: torch sees no CUDA device (use --small --device cpu to check "
            "the script on a CPU)",
            file=sys.stderr,
        )
        return 2
    global DEVICE, DEVICE_NOTE
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    try:
        DEVICE = roofline.device_by_name(name)
    except ValueError as e:
        DEVICE, DEVICE_NOTE = None, f"none: {name!r} not in bench.roofline.DEVICES"
        print(f"# {e}", flush=True)
    print(f"# device {name}: ceilings {DEVICE.name if DEVICE else DEVICE_NOTE}", flush=True)
    t = Timer(a.device, a.reps)
    rows, failed = [], []
    for name in a.only or SECTIONS:
        t0 = time.perf_counter()
        try:
            got = SECTIONS[name](t, a.device, a.small)
        except Exception as e:  # a row's failure is recorded and reported, not hidden
            traceback.print_exc()
            failed.append(name)
            got = [{"op": name, "error": f"{type(e).__name__}: {e}"[:500]}]
        for r in got:
            print(json.dumps(r), flush=True)
            if a.jsonl:
                with open(a.jsonl, "a") as f:
                    f.write(json.dumps(r) + "\n")
        rows += got
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "device": name,
                    "ceilings": DEVICE.name if DEVICE else DEVICE_NOTE,
                    "rows": rows,
                    "failed": failed,
                },
                f,
                indent=1,
            )
    if failed:
        print(f"gpu_timing: FAILED sections: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
