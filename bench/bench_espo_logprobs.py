"""ck.espo token log-probs + entropy, forward and backward, side by side (CPU).

Cases (every provider runs forward + backward, entropy included):

- ``espo_logprobs`` (from logits [T, V] float32): torch eager (log_softmax +
  gather + entropy, autograd through both) vs ``ck.espo.token_logprobs_entropy``;
  the loss is sum(g_l * logp + g_h * entropy) with fixed random g.
- ``espo_fused_linear`` (from hidden [T, H] and lm_head [V, H] float32, a
  GRPO loss on top: token ratio exp(logp - old), clip 0.2, per-sequence token
  mean, mean over sequences): torch eager (materialised logits, entropy under
  no_grad) vs Liger-Kernel's LigerFusedLinearGRPOLoss (loss_type "grpo", no
  entropy: it has none) vs ``ck.espo.fused_linear_logprobs_entropy`` + the same
  loss in torch. ``--check`` verifies equal loss and gradients.
- ``espo_matmul_floor``: the three GEMMs every fused implementation must run
  (logits, d_hidden, d_weight) at the fused case's shape, alone: the floor the
  fused rows are compared with. ck's backward recomputes the logits tiles (a
  4th GEMM, see fused_linear_logprobs_entropy's notes).

``python -m bench.bench_espo_logprobs --model`` prints the H100 roofline model
(bytes, FLOPs) at V = 151,936, H = 7,168: a model, not a measurement.
"""

from __future__ import annotations

import argparse
import math

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


# ------------------------------------------------- fused linear + GRPO loss


def _grpo_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    """GRPO/PPO token clipping, per-sequence token mean, mean over sequences: [B, L] inputs."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def fused_case(seqs: int, seq_len: int, hidden: int, vocab: int) -> Case:
    rows = seqs * seq_len
    g = _gen(1)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) * 2
    y = torch.randint(0, vocab, (rows,), generator=g)
    with torch.no_grad():  # old log-probs near the current ones: ratios around 1, some clipped
        old = torch.log_softmax(h @ w.T, -1).gather(-1, y[:, None]).view(seqs, seq_len)
        old += torch.randn(seqs, seq_len, generator=g) * 0.1
    adv = torch.randn(seqs, generator=g)
    mask = torch.ones(seqs, seq_len)
    mask[0, seq_len // 2 :] = 0  # one shorter response

    def eager():
        hq, wq = h.detach().requires_grad_(), w.detach().requires_grad_()
        logp_all = torch.log_softmax(hq @ wq.T, dim=-1)
        logp = logp_all.gather(-1, y[:, None]).view(seqs, seq_len)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        loss = _grpo_loss(logp, old, adv, mask)
        loss.backward()
        del entropy
        return loss.detach(), hq.grad, wq.grad

    def ours():
        hq, wq = h.detach().requires_grad_(), w.detach().requires_grad_()
        logp, entropy = ck.espo.fused_linear_logprobs_entropy(hq, wq, y)
        loss = _grpo_loss(logp.view(seqs, seq_len), old, adv, mask)
        loss.backward()
        return loss.detach(), hq.grad, wq.grad

    providers = {"torch eager": eager}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as err:  # a bench-only dependency: an error row, never a silent gap
        missing = err

        def liger():
            raise ImportError(
                f"liger-kernel is not installed ({missing}): "
                "pip install --no-deps liger-kernel==0.8.5 (scripts/setup_env.sh does)"
            )

    else:
        liger_loss = LigerFusedLinearGRPOLoss(
            beta=0.0, use_ref_model=False, compiled=False, loss_type="grpo",
            epsilon_low=EPS, epsilon_high=EPS, chunk_size=1,
        )  # fmt: skip

        def liger():
            hq, wq = h.detach().requires_grad_(), w.detach().requires_grad_()
            loss, _ = liger_loss(
                hq.view(seqs, seq_len, hidden), wq, y.view(seqs, seq_len), mask, adv,
                old_per_token_logps=old,
            )  # fmt: skip
            loss.backward()
            return loss.detach(), hq.grad, wq.grad

    providers["liger GRPO"] = liger
    providers["ck.espo fused"] = ours
    gemm = 2 * rows * hidden * vocab
    # H100 model, bf16 inputs: 4 GEMMs (forward logits, recomputed logits,
    # d_hidden, d_weight) on tensor cores; HBM traffic of the weight and hidden
    # states (each read per GEMM) and the fp32 gradient accumulators.
    model = Model(
        bytes=4 * (vocab * hidden * 2 + rows * hidden * 2) + (vocab + rows) * hidden * 4,
        flops=4 * gemm,
        precision="bf16",
        kernels=4,
    )
    return Case(
        name="espo_fused_linear",
        shape={"T": rows, "H": hidden, "V": vocab},
        providers=providers,
        baseline="torch eager",
        atol=1e-4,
        rtol=1e-3,
        model=model,
    )


def floor_case(rows: int, hidden: int, vocab: int) -> Case:
    g = _gen(2)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g)
    grad = torch.randn(rows, vocab, generator=g)

    def three_gemms():
        logits = h @ w.T
        d_hidden = grad @ w
        d_weight = grad.T @ h
        return logits.shape, d_hidden.shape, d_weight.shape

    return Case(
        name="espo_matmul_floor",
        shape={"T": rows, "H": hidden, "V": vocab},
        providers={"3 GEMMs (floor)": three_gemms},
        baseline="3 GEMMs (floor)",
        model=Model(bytes=0, flops=3 * 2 * rows * hidden * vocab, precision="bf16", kernels=3),
    )


def cases(quick: bool) -> list[Case]:
    if quick:
        return [logits_case(256, 4096), fused_case(4, 64, 64, 2048), floor_case(256, 64, 2048)]
    return [
        logits_case(8192, 32768),
        fused_case(8, 1024, 1024, 32768),
        floor_case(8192, 1024, 32768),
    ]


# ------------------------------------------------------------- GPU model


def gpu_model(rows: int = 8192, hidden: int = 7168, vocab: int = 151936) -> str:
    """The H100 roofline model (a model, never a measurement) of both ops at a
    large-vocab shape, bf16 inputs, float32 statistics."""
    d = H100_SXM
    lines = [f"H100-SXM roofline MODEL (not measured): T={rows}, H={hidden}, V={vocab}, bf16 in"]
    tv = rows * vocab
    logits = Model(bytes=3 * tv * 2, flops=12 * tv, precision="fp32", kernels=2)
    eager = Model(bytes=tv * (2 + 4 * 2 + 4 * 3 + 4 * 3), flops=12 * tv, precision="fp32",
                  kernels=8)  # fmt: skip
    gemm = 2 * rows * hidden * vocab
    w_bytes, h_bytes = vocab * hidden * 2, rows * hidden * 2
    # As implemented (token chunks of TOKEN_CHUNK): each of the 4 GEMMs reads
    # the weight once per token chunk, and the fp32 d_weight accumulator is
    # read and written once per token chunk.
    chunks = math.ceil(rows / TOKEN_CHUNK)
    fused = Model(
        bytes=4 * (chunks * w_bytes + h_bytes) + chunks * vocab * hidden * 4 * 2,
        flops=4 * gemm,
        precision="bf16",
        kernels=4 * chunks * math.ceil(vocab / VOCAB_CHUNK),
    )
    floor = Model(bytes=3 * (w_bytes + h_bytes), flops=3 * gemm, precision="bf16", kernels=3)
    for name, m in (
        ("token_logprobs_entropy fwd+bwd (1 read fwd, 1 read + 1 write bwd)", logits),
        ("eager log_softmax+gather+entropy fwd+bwd (fp32 [T,V] temporaries)", eager),
        ("fused_linear fwd+bwd as tiled (4 GEMMs: logits, recomputed logits, dH, dW)", fused),
        ("3-GEMM floor", floor),
    ):
        lines.append(
            f"  {name}: {m.bytes / 1e9:.1f} GB, {m.flops / 1e12:.1f} TFLOP -> "
            f"{m.seconds(d) * 1e3:.2f} ms ({m.bound(d)}-bound)"
        )
    lines.append(f"  [T,V] fp32 logits that the fused path never holds: {tv * 4 / 2**30:.1f} GiB")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="store_true", help="print the H100 roofline model")
    args = ap.parse_args()
    print(gpu_model())
