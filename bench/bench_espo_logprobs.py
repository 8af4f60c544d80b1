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
  strategy grad_in_forward (3 GEMMs) and recompute (4 GEMMs). ``--check``
  verifies equal loss and gradients (Liger's included).
- ``espo_fused_linear_espo`` (mode espo, clip 0.2): torch eager logits +
  log_softmax + entropy + ``ck.espo.espo_loss`` vs the fused loss, recompute
  and grad_in_forward (whole 1024-token sequences per chunk).
- ``espo_matmul_floor``: the three GEMMs every fused implementation must run
  (logits, d_hidden, d_weight) at the same shape, with the GRPO problem's true
  d loss / d logits precomputed (so its outputs are the real gradients), vs
  the grad-in-forward loss: the ratio is floor / ours.

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

    def ours(self, mode: str, strategy: str, grads_only: bool = False):
        def run():
            hq, wq = self.leaves()
            loss, _, _, _ = ck.espo.fused_linear_espo_loss(
                hq, wq, self.y, self.old.view(-1), self.old_ent, self.adv, self.cu,
                self.mask.view(-1).bool(), mode=mode, clip=EPS, strategy=strategy,
            )  # fmt: skip
            loss.backward()
            return (hq.grad, wq.grad) if grads_only else (loss.detach(), hq.grad, wq.grad)

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
                    logp, self.old.view(-1), self.old_ent, self.adv, self.cu,
                    self.mask.view(-1).bool(), mode=mode, clip=EPS,
                )  # fmt: skip
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
            beta=0.0, use_ref_model=False, compiled=False, loss_type="grpo",
            epsilon_low=EPS, epsilon_high=EPS, chunk_size=1,
        )  # fmt: skip

        def run():
            hq, wq = self.leaves()
            loss, _ = liger_loss(
                hq.view(seqs, seq_len, hidden), wq, self.y.view(seqs, seq_len), self.mask,
                self.adv, old_per_token_logps=self.old,
            )  # fmt: skip
            loss.backward()
            return loss.detach(), hq.grad, wq.grad

        return run

    def floor(self):
        """The three GEMMs of the GRPO problem (logits, d_hidden, d_weight) with its
        true d loss / d logits precomputed: outputs equal to the real gradients."""
        hq, wq = self.leaves()
        logits = hq @ wq.T
        loss = _grpo_loss(
            torch.log_softmax(logits, -1).gather(-1, self.y[:, None]).view(self.old.shape),
            self.old, self.adv, self.mask,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logits)
        del logits, loss
        h, w = self.h, self.w
        out_logits = torch.empty(grad.shape)

        def run():
            torch.mm(h, w.T, out=out_logits)
            return grad @ w, grad.T @ h

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


def fused_cases(seqs: int, seq_len: int, hidden: int, vocab: int) -> list[Case]:
    """Three cases on one problem: mode grpo (vs eager and Liger), mode espo (vs
    eager logits + the same loss op), and the 3-GEMM floor vs grad-in-forward."""
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
        Case(
            name="espo_matmul_floor",
            shape=shape,
            providers={
                "3 GEMMs (floor)": p.floor(),
                "ck grpo grad-in-fwd": p.ours("grpo", "grad_in_forward", grads_only=True),
            },
            baseline="3 GEMMs (floor)",
            model=_fused_model(rows, hidden, vocab, 3),
            **tol,
        ),
    ]


def cases(quick: bool) -> list[Case]:
    if quick:
        return [logits_case(256, 4096), *fused_cases(4, 64, 64, 2048)]
    return [logits_case(8192, 32768), *fused_cases(8, 1024, 1024, 32768)]


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
    # As implemented by the recompute strategy (token chunks of TOKEN_CHUNK):
    # each of the 4 GEMMs reads the weight once per token chunk, and the fp32
    # d_weight accumulator is read and written once per token chunk.
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
        ("fused_linear recompute fwd+bwd as tiled (4 GEMMs: logits, again, dH, dW)", fused),
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
