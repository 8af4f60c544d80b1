"""ck.espo token log-probs + entropy, forward and backward, side by side (CPU).

Cases (every provider runs forward + backward, entropy included):

- ``espo_logprobs`` (from logits [T, V] float32): torch eager (log_softmax +
  gather + entropy, autograd through both) vs ``ck.espo.token_logprobs_entropy``;
  the loss is sum(g_l * logp + g_h * entropy) with fixed random g.
- ``espo_fused_linear`` (from hidden [T, H] and lm_head [V, H] float32, mode
  grpo: token ratio exp(logp - old), clip 0.2, per-sequence token mean, mean
  over sequences): torch eager (materialised logits, entropy under no_grad) vs
  Liger-Kernel's LigerFusedLinearGRPOLoss (loss_type "grpo"; it has no
  entropy) vs ``ck.espo.fused_linear_espo_loss(mode="grpo")`` with
  strategy grad_in_forward (3 GEMMs) and recompute (4 GEMMs), and the row
  ``3 GEMMs (floor)``: the three GEMMs every fused implementation must run
  (logits, d_hidden, d_weight) with the problem's true d loss / d logits
  precomputed (its outputs are the real gradients). All five interleaved in
  one case: a ratio between any two comes from the same samples (the same
  host load). ``--check`` verifies equal loss and gradients (Liger's and the
  floor's included).
- ``espo_fused_linear_espo`` (mode espo, clip 0.2): torch eager logits +
  log_softmax + entropy + ``ck.espo.espo_loss`` vs the fused loss, recompute
  and grad_in_forward (whole 1024-token sequences per chunk).

``python -m bench.bench_espo_logprobs --fused`` times the grpo case alone and
prints, per provider, wall time, the ratios vs torch eager, vs Liger and vs
the floor, process CPU seconds, run-queue wait (time runnable while another
process held the cores), minor page faults and peak memory: on a shared host
wall = (CPU + wait) / threads, and the CPU column is what load does not move.

``python -m bench.bench_espo_logprobs --model`` prints the H100 roofline model
(bytes, FLOPs) at V = 151,936, H = 7,168: a model, not a measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import time
from pathlib import Path

import torch

import compass_kernels as ck
from bench.harness import Case
from bench.roofline import H100_SXM, Model
from compass_kernels.espo.logprobs import TOKEN_CHUNK, VOCAB_CHUNK

OP = "espo_logprobs"
EPS = 0.2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------- from logits


def logits_case(rows: int, vocab: int) -> Case:
    g = _gen(0)
    logits = torch.randn(rows, vocab, generator=g) * 2
    targets = torch.randint(0, vocab, (rows,), generator=g)
    gl, gh = torch.randn(rows, generator=g), torch.randn(rows, generator=g)

    def eager():
        x = logits.detach().requires_grad_()
        logp_all = torch.log_softmax(x, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        (logp * gl + entropy * gh).sum().backward()
        return logp.detach(), entropy.detach(), x.grad

    def ours():
        x = logits.detach().requires_grad_()
        logp, entropy = ck.espo.token_logprobs_entropy(x, targets)
        (logp * gl + entropy * gh).sum().backward()
        return logp.detach(), entropy.detach(), x.grad

    # H100 model: one read in the forward, one read + one write in the backward.
    model = Model(bytes=3 * rows * vocab * 4, flops=12 * rows * vocab, precision="fp32", kernels=2)
    return Case(
        name="espo_logprobs",
        shape={"T": rows, "V": vocab},
        providers={"torch eager": eager, "ck.espo": ours},
        baseline="torch eager",
        atol=1e-4,
        rtol=1e-4,
        model=model,
    )


# ------------------------------------------------- fused linear + policy loss


def _grpo_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    """GRPO/PPO token clipping, per-sequence token mean, mean over sequences: [B, L] inputs."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


class _Problem:
    """A packed batch of ``seqs`` responses of ``seq_len`` tokens (the first one
    half masked), hidden states, lm_head, old log-probs near the current ones
    (ratios around 1, some clipped) and the old policy's entropy."""

    def __init__(self, seqs: int, seq_len: int, hidden: int, vocab: int) -> None:
        rows = seqs * seq_len
        g = _gen(1)
        self.shape = (seqs, seq_len, hidden, vocab)
        self.h = torch.randn(rows, hidden, generator=g)
        self.w = torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) * 2
        self.y = torch.randint(0, vocab, (rows,), generator=g)
        with torch.no_grad():
            lp, ent = ck.espo.fused_linear_logprobs_entropy(self.h, self.w, self.y)
        self.old = lp.view(seqs, seq_len) + torch.randn(seqs, seq_len, generator=g) * 0.1
        self.old_ent = ent + torch.rand(rows, generator=g) * 0.2
        self.adv = torch.randn(seqs, generator=g)
        self.mask = torch.ones(seqs, seq_len)
        self.mask[0, seq_len // 2 :] = 0  # one shorter response
        self.cu = torch.arange(0, rows + 1, seq_len)

    def leaves(self):
        return self.h.detach().requires_grad_(), self.w.detach().requires_grad_()

    def ours(self, mode: str, strategy: str):
        cu_host = self.cu.tolist()  # the packer's host copy (no read of cu_seqlens)

        def run():
            hq, wq = self.leaves()
            loss, _, _, _ = ck.espo.fused_linear_espo_loss(
                hq,
                wq,
                self.y,
                self.old.view(-1),
                self.old_ent,
                self.adv,
                self.cu,
                self.mask.view(-1).bool(),
                mode=mode,
                clip=EPS,
                strategy=strategy,
                cu_seqlens_host=cu_host,
            )
            loss.backward()
            return loss.detach(), hq.grad, wq.grad

        return run

    def eager(self, mode: str):
        seqs, seq_len, _, _ = self.shape

        def run():
            hq, wq = self.leaves()
            logp_all = torch.log_softmax(hq @ wq.T, dim=-1)
            logp = logp_all.gather(-1, self.y[:, None]).view(-1)
            with torch.no_grad():
                entropy = -(logp_all.exp() * logp_all).sum(-1)
            if mode == "grpo":
                loss = _grpo_loss(logp.view(seqs, seq_len), self.old, self.adv, self.mask)
            else:  # logits materialised, then the same loss op as ours
                loss, _ = ck.espo.espo_loss(
                    logp,
                    self.old.view(-1),
                    self.old_ent,
                    self.adv,
                    self.cu,
                    self.mask.view(-1).bool(),
                    mode=mode,
                    clip=EPS,
                )
            loss.backward()
            del entropy
            return loss.detach(), hq.grad, wq.grad

        return run

    def liger(self):
        seqs, seq_len, hidden, _ = self.shape
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        except ImportError as err:  # a bench-only dependency: an error row, never a silent gap
            missing = err

            def unavailable():
                raise ImportError(
                    f"liger-kernel is not installed ({missing}): "
                    "pip install --no-deps liger-kernel==0.8.5 (scripts/setup_env.sh does)"
                )

            return unavailable
        liger_loss = LigerFusedLinearGRPOLoss(
            beta=0.0,
            use_ref_model=False,
            compiled=False,
            loss_type="grpo",
            epsilon_low=EPS,
            epsilon_high=EPS,
            chunk_size=1,
        )

        def run():
            hq, wq = self.leaves()
            loss, _ = liger_loss(
                hq.view(seqs, seq_len, hidden),
                wq,
                self.y.view(seqs, seq_len),
                self.mask,
                self.adv,
                old_per_token_logps=self.old,
            )
            loss.backward()
            return loss.detach(), hq.grad, wq.grad

        return run

    def floor(self):
        """The three GEMMs of the GRPO problem (logits, d_hidden, d_weight) with its
        true d loss / d logits precomputed: outputs (the precomputed loss, d_hidden,
        d_weight) equal to the real ones. Holds [T, V] twice (outside the timing)."""
        hq, wq = self.leaves()
        logits = hq @ wq.T
        loss = _grpo_loss(
            torch.log_softmax(logits, -1).gather(-1, self.y[:, None]).view(self.old.shape),
            self.old,
            self.adv,
            self.mask,
        )
        (grad,) = torch.autograd.grad(loss, logits)
        loss = loss.detach()
        del logits
        h, w = self.h, self.w
        out_logits = torch.empty(grad.shape)

        def run():
            torch.mm(h, w.T, out=out_logits)
            return loss, grad @ w, grad.T @ h

        return run


def _fused_model(rows: int, hidden: int, vocab: int, gemms: int) -> Model:
    # H100 model, bf16 inputs: GEMMs on tensor cores; HBM traffic of the weight
    # and hidden states (read per GEMM) and the fp32 gradient accumulators.
    return Model(
        bytes=gemms * (vocab * hidden * 2 + rows * hidden * 2) + (vocab + rows) * hidden * 4,
        flops=gemms * 2 * rows * hidden * vocab,
        precision="bf16",
        kernels=gemms,
    )


FLOOR = "3 GEMMs (floor)"


def fused_cases(seqs: int, seq_len: int, hidden: int, vocab: int) -> list[Case]:
    """Two cases on one problem: mode grpo (torch eager, Liger, ours both
    strategies, and the 3-GEMM floor: all interleaved, so every ratio between
    them comes from the same samples) and mode espo (vs eager logits + the same
    loss op)."""
    p = _Problem(seqs, seq_len, hidden, vocab)
    rows = seqs * seq_len
    shape = {"T": rows, "H": hidden, "V": vocab}
    tol = {"atol": 1e-4, "rtol": 1e-3}
    return [
        Case(
            name="espo_fused_linear",
            shape=shape,
            providers={
                "torch eager": p.eager("grpo"),
                "liger GRPO (no entropy)": p.liger(),
                "ck grpo grad-in-fwd": p.ours("grpo", "grad_in_forward"),
                "ck grpo recompute": p.ours("grpo", "recompute"),
                FLOOR: p.floor(),
            },
            baseline="torch eager",
            model=_fused_model(rows, hidden, vocab, 3),
            **tol,
        ),
        Case(
            name="espo_fused_linear_espo",
            shape=shape,
            providers={
                "torch eager + espo_loss": p.eager("espo"),
                "ck espo recompute": p.ours("espo", "recompute"),
                "ck espo grad-in-fwd": p.ours("espo", "grad_in_forward"),
            },
            baseline="torch eager + espo_loss",
            model=_fused_model(rows, hidden, vocab, 3),
            **tol,
        ),
    ]


def cases(quick: bool) -> list[Case]:
    if quick:
        return [logits_case(256, 4096), *fused_cases(4, 64, 64, 2048)]
    return [logits_case(8192, 32768), *fused_cases(8, 1024, 1024, 32768)]


# ------------------------------------------------------------- GPU model


def _model_line(name: str, nbytes: float, flops: dict[str, float], kernels: int) -> str:
    """One roofline row: max(HBM time, the sum of the math times of each precision)
    + a launch floor per kernel, on the H100 SXM (a model, never a measurement)."""
    d = H100_SXM
    memory = nbytes / d.hbm_bytes_per_s
    math_s = sum(f / d.flops_per_s[p] for p, f in flops.items())
    total = max(memory, math_s) + kernels * d.launch_s
    bound = "memory" if memory >= math_s else "compute"
    what = " + ".join(f"{f / 1e12:.1f} TFLOP {p}" for p, f in flops.items())
    return f"  {name}: {nbytes / 1e9:.1f} GB, {what} -> {total * 1e3:.1f} ms ({bound}-bound)"


def gpu_model(rows: int = 8192, hidden: int = 7168, vocab: int = 151936) -> str:
    """The H100 roofline model (a model, never a measurement) of the ops at a
    large-vocab shape, bf16 inputs, float32 statistics."""
    from compass_kernels.espo.fused_loss import default_rows

    lines = [f"H100-SXM roofline MODEL (not measured): T={rows}, H={hidden}, V={vocab}, bf16 in"]
    tv = rows * vocab
    gemm = 2 * rows * hidden * vocab
    w2, w4 = vocab * hidden * 2, vocab * hidden * 4  # weight bf16 / a float32 [V, H]
    h2 = rows * hidden * 2
    lines += [
        _model_line(
            "token_logprobs_entropy fwd+bwd (1 read fwd, 1 read + 1 write bwd)",
            3 * tv * 2,
            {"fp32": 12 * tv},
            2,
        ),
        _model_line(
            "eager log_softmax+gather+entropy fwd+bwd (fp32 [T,V] temporaries)",
            tv * (2 + 4 * 2 + 4 * 3 + 4 * 3),
            {"fp32": 12 * tv},
            8,
        ),
    ]
    # Gradient GEMMs as implemented with grad_gemm_dtype="auto" on CUDA ("input":
    # bf16 operands; the fp32 d-logits tile rounded once to a bf16 copy; the GEMM
    # writes fp32 through torch.mm(out_dtype=float32), assumed present in CUDA
    # builds: probed at run time) and with grad_gemm_dtype="fp32" (the previous
    # behaviour: fp32 d-logits tile and fp32 weight / hidden operands, fp32 GEMMs
    # on CUDA cores unless torch allows TF32).
    #
    # recompute (TOKEN_CHUNK x VOCAB_CHUNK tiles; the weight read by each GEMM
    # once per token chunk; each fp32 tile written by its GEMM, read by the
    # statistics, read + written by the d-logits pass). "fp32": d_weight / d_hidden
    # accumulated by addmm_ (fp32 accumulator read + written per token chunk).
    # "input": the tile read once more and written as bf16, read by the two GEMMs;
    # each GEMM writes an fp32 product that add_ folds into the fp32 accumulator
    # (product written + read, accumulator read + written: 4 passes per token
    # chunk for d_weight, per vocab chunk for d_hidden), except the first of
    # each sum, written into the (zero-filled) accumulator: 2 passes.
    tc, vc = math.ceil(rows / TOKEN_CHUNK), math.ceil(vocab / VOCAB_CHUNK)
    hf = rows * hidden * 4  # a float32 [T, H]
    tiles = 4 * tc * vc
    rec32 = 2 * tc * w2 + 2 * tc * w4 + 2 * tc * w4 + 4 * h2 + 2 * 4 * tv * 4
    rec16 = (
        4 * tc * w2
        + vc * h2
        + 4 * tv * 4
        + tv * (4 + 2)
        + 2 * tv * 2
        + (4 * tc - 2) * w4
        + (4 * vc - 2) * hf
    )
    lines.append(
        _model_line(
            f"fused_linear recompute, grad_gemm_dtype='fp32' (before; 4 GEMMs, {tc} token chunks: "
            "2 bf16, 2 fp32)",
            rec32,
            {"bf16": 2 * gemm, "fp32": 2 * gemm},
            tiles,
        )
    )
    lines.append(
        _model_line(
            f"fused_linear recompute as implemented, CUDA auto = 'input' (4 bf16 GEMMs, {tc} token "
            "chunks)",
            rec16,
            {"bf16": 4 * gemm},
            tiles + 3 * tc * vc,
        )
    )
    # grad-in-forward, per chunk of r rows (default_rows of fp32 logits): the tile
    # written by the logits GEMM, read by the statistics, read + written by the
    # d-logits pass (+ ~2 passes of the small per-token work: ~6 r V fp32 passes).
    # "fp32": float32 copies of weight and hidden once, 3 fp32 GEMMs per chunk
    # each reading the fp32 weight, d_weight read + written by addmm_ per chunk.
    # "input": bf16 logits GEMM (fp32 out), the tile read + written as bf16, two
    # bf16 GEMMs reading the bf16 weight; d_weight's fp32 product written + read
    # and the fp32 accumulator read + written per chunk, but the first chunk's
    # product written into the zero-filled accumulator (2 passes).
    for r, label in (
        (default_rows(vocab, torch.device("cpu")), "CPU default chunk"),
        (default_rows(vocab, torch.device("cuda")), "GPU default chunk"),
    ):
        c = math.ceil(rows / r)
        gif32 = (w2 + w4 + 3 * h2) + c * (3 * w4 + 2 * w4) + 6 * 4 * tv
        gif16 = c * 3 * w2 + (4 * c - 2) * w4 + 3 * h2 + hf + 6 * 4 * tv + (4 + 2) * tv + 2 * 2 * tv
        lines.append(
            _model_line(
                f"fused grad-in-forward, grad_gemm_dtype='fp32' (before), {label} ({r} rows x {c}: "
                "3 fp32 GEMMs each)",
                gif32,
                {"fp32": 3 * gemm},
                c * 5,
            )
        )
        lines.append(
            _model_line(
                "fused grad-in-forward as implemented, CUDA auto = 'input', "
                f"{label} ({r} rows x {c}: 3 bf16 GEMMs each)",
                gif16,
                {"bf16": 3 * gemm},
                c * 7,
            )
        )
    lines.append(
        _model_line(
            "3-GEMM floor (bf16, each operand read once)", 3 * (w2 + h2), {"bf16": 3 * gemm}, 3
        )
    )
    lines.append(f"  [T,V] fp32 logits that the fused path never holds: {tv * 4 / 2**30:.1f} GiB")
    return "\n".join(lines)


# ------------------------------------------- per-call process statistics (CPU)


def runq_wait_s() -> float:
    """Seconds this process's threads spent runnable but not running
    (``/proc/self/task/*/schedstat`` field 2): the cost of other processes
    holding the cores."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def proc_snapshot() -> tuple[float, float, float, int, float]:
    """(wall, CPU user + system of all threads, system, minor faults, run-queue wait)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (
        time.perf_counter(),
        ru.ru_utime + ru.ru_stime,
        ru.ru_stime,
        ru.ru_minflt,
        runq_wait_s(),
    )


def recorded(fn, log: list):
    """``fn`` appending (wall, cpu, sys, minflt, wait) deltas of each call to ``log``."""

    def run():
        a = proc_snapshot()
        out = fn()
        b = proc_snapshot()
        log.append(tuple(y - x for x, y in zip(a, b, strict=True)))
        return out

    return run


def fused_table(shape: tuple[int, int, int, int], reps: int) -> str:
    """The grpo fused-linear case (harness-timed, interleaved) with per-provider
    CPU seconds, run-queue wait, page faults and the ratios vs eager, Liger and
    the floor."""
    from bench.harness import format_table, run_case

    case = fused_cases(*shape)[0]
    logs: dict[str, list] = {p: [] for p in case.providers}
    case.providers = {p: recorded(fn, logs[p]) for p, fn in case.providers.items()}
    rows = run_case(case, reps=reps, warmup=1, target_sample_s=0.0)
    med = {r.provider: r.median_s for r in rows if not r.error}
    ref = {
        "eager": med.get("torch eager"),
        "liger": med.get("liger GRPO (no entropy)"),
        "floor": med.get(FLOOR),
    }
    head = (
        "provider",
        "wall",
        "vs eager",
        "vs liger",
        "floor/this",
        "cpu s",
        "sys s",
        "runq wait",
        "minflt",
        "peak mem",
    )
    body = []
    for r in rows:
        if r.error:
            body.append((r.provider, "ERROR", r.error[:50], *("-",) * 7))
            continue
        timed = logs[r.provider][1 : 1 + reps]  # after the first (warmup) call
        cpu, sys_s, flt, wait = (statistics.median(c[i] for c in timed) for i in (1, 2, 3, 4))
        ratio = {k: f"{v / r.median_s:.2f}x" if v else "-" for k, v in ref.items()}
        body.append(
            (
                r.provider,
                f"{r.median_s:.2f} s",
                ratio["eager"],
                ratio["liger"],
                ratio["floor"],
                f"{cpu:.2f}",
                f"{sys_s:.2f}",
                f"{wait:.2f} s",
                f"{int(flt)}",
                f"{r.peak_mem_bytes / 2**20:.0f} MiB",
            )
        )
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(x, widths, strict=True))
        )
        for x in [head, *body]
    ]
    rows_, hidden, vocab = shape[0] * shape[1], shape[2], shape[3]
    return "\n".join(
        [
            format_table(rows),
            "",
            f"espo_fused_linear T={rows_} H={hidden} V={vocab}, {torch.get_num_threads()} threads, "
            f"{reps} interleaved samples, medians; load1 at the end {os.getloadavg()[0]:.2f}",
            *lines,
            "vs X: X's median / this median (> 1: faster than X); floor/this: the fraction of "
            "the 3-GEMM floor's speed; cpu s: process CPU (all threads); runq wait: time runnable "
            "while other processes held the cores (wall ~ (cpu + wait) / threads)",
        ]
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="store_true", help="print the H100 roofline model")
    ap.add_argument(
        "--fused", action="store_true", help="time the grpo fused-linear case, CPU / wait columns"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shape", default="8,1024,1024,32768", help="seqs,seq_len,H,V")
    args = ap.parse_args()
    if args.fused:
        print(fused_table(tuple(int(x) for x in args.shape.split(",")), args.reps))
    if args.model or not args.fused:
        print(gpu_model())
        from compass_kernels.espo.logprobs import grad_gemm_info

        for opt in ("auto", "input"):
            how = grad_gemm_info(opt, torch.bfloat16, torch.device("cpu"))
            print(f"  this machine (CPU), bf16 inputs, grad_gemm_dtype={opt!r}: {how}")
