"""Device tests of the GPU paths no other gpu test covers (issue 26, item 6).

Each test body runs on two devices: ``cuda`` (marked gpu: the device run,
sizes as in training) and ``cpu`` (marked triton: the same body under the
Triton interpreter here, small sizes), so the body itself is exercised on every
CPU run. Odd sizes, outputs poisoned, float64 references (byte-exact ones for
the copies).

- THD pack / unpack / positions (Triton) on rows of several unit widths,
  one wider than a program's tile, context parallelism 2;
- the Triton log-prob forward / backward at a 151,936 vocabulary in bf16, rows
  at an odd stride (the kernels' unaligned head path) and aligned;
- ``fused_linear_espo_loss`` with ``grad_gemm_dtype="input"``: on CUDA the
  gradient GEMMs run as bf16 x bf16 -> float32 (``torch.mm(out_dtype=)``),
  which CPU torch lacks;
- the Triton ESPO loss with 8 entropy groups (the most it holds), both groupings.
"""

from __future__ import annotations

from tests.triton_tier import INTERPRET

# isort: split

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.espo import triton_logprobs as kl
from compass_kernels.espo.reference_logprobs import token_logprobs_entropy_reference
from compass_kernels.packing import reference as pref
from compass_kernels.packing import triton as kp
from compass_kernels.testing import assert_verbose_allclose, empty_poisoned
from tests.tiers import INTERPRETER_ONLY

DEVICES = [
    pytest.param(
        "cpu",
        marks=[pytest.mark.triton, pytest.mark.skipif(not INTERPRET, reason=INTERPRETER_ONLY)],
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def _big(device: str) -> bool:
    return device == "cuda"


# ------------------------------------------------------------------ packing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cp", [1, 2])
def test_thd_pack_unpack_positions_on_device(device, cp):
    g = np.random.default_rng(26 + cp)
    n = 301 if _big(device) else 13
    lengths = g.integers(1, 700 if _big(device) else 40, size=n).tolist()
    idx = g.permutation(n)[: n - 4].tolist()
    pad = 2 * cp * 3
    L = np.array(lengths)
    src_cu = np.concatenate([[0], np.cumsum(L)])
    seqlens = L[idx]
    off = np.concatenate([[0], np.cumsum(-(-seqlens // pad) * pad // cp)])
    cu = np.concatenate([[0], np.cumsum(seqlens)])
    t = lambda a: torch.tensor(a, dtype=torch.int64, device=device)  # noqa: E731
    total, rows = int(off[-1]), int(src_cu[-1])
    gen = torch.Generator().manual_seed(cp)
    # bytes per row: 2 * 2051 (int16 units, wider than a tile: several steps),
    # 8 (one int64), 6 (int16 units, a partial tile row), 1
    for w in ((4102 if _big(device) else 74), 8, 6, 1):
        src = torch.randint(0, 256, (rows, w), dtype=torch.uint8, generator=gen).to(device)
        packed = []
        for r in range(cp):
            out = empty_poisoned((total, w), torch.uint8, device)
            kp.thd_pack_triton(
                src=src,
                seq_start=t(src_cu[idx]),
                seqlens=t(seqlens),
                out_offsets=t(off),
                cp_size=cp,
                cp_rank=r,
                fill=0x5A,
                total=total,
                out=out,
            )
            want = pref.pack_reference(
                src.cpu(), lengths, idx, pad_multiple=pad, cp_size=cp, cp_rank=r, pad_value=0x5A
            )
            assert torch.equal(out.cpu(), want["packed"]), (w, r)
            packed.append(out)
            pos = empty_poisoned(total, torch.int64, device)
            kp.thd_positions_triton(out_offsets=t(off), cp_size=cp, cp_rank=r, total=total, out=pos)
            assert torch.equal(pos.cpu(), want["position_ids"]), (w, r)
        out = empty_poisoned((int(cu[-1]), w), torch.uint8, device)
        kp.thd_unpack_triton(
            packed=torch.cat(packed),
            seqlens=t(seqlens),
            cu_seqlens=t(cu),
            out_offsets=t(off),
            cp_size=cp,
            total=int(cu[-1]),
            out=out,
        )
        want = torch.cat([src[src_cu[i] : src_cu[i + 1]] for i in idx]).cpu()
        assert torch.equal(out.cpu(), want), w


# ---------------------------------------------------------------- log-probs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("odd_stride", [False, True])
def test_triton_logprobs_151936_bf16_on_device(device, odd_stride):
    from tests.test_espo_logprobs import GRAD_TOL, TOL, make_logits, reference_grad

    rows, vocab = (67, 151936) if _big(device) else (2, 151936)
    logits, targets = make_logits(rows, vocab, seed=61 + odd_stride, dtype=torch.bfloat16)
    store = torch.empty(rows, vocab + (3 if odd_stride else 0), dtype=torch.bfloat16)
    store[:, :vocab] = logits
    z = store.to(device)[:, :vocab]  # odd stride: rows start off 16 bytes (the head path)
    y = targets.to(device)
    outs = [empty_poisoned(rows, torch.float32, device) for _ in range(4)]
    logp, ent, m, log_s = outs
    kl.token_logprobs_entropy_triton(
        logits=z,
        targets=y,
        temperature=0.8,
        with_entropy=True,
        logp=logp,
        entropy=ent,
        row_max=m,
        log_norm=log_s,
    )
    ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets, 0.8)
    assert_verbose_allclose(logp.cpu(), ref_lp.float(), name="logp", **TOL[torch.bfloat16])
    assert_verbose_allclose(ent.cpu(), ref_h.float(), name="entropy", **TOL[torch.bfloat16])
    gen = torch.Generator().manual_seed(7)
    gl, gh = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    grad = empty_poisoned((rows, vocab), torch.bfloat16, device)
    kl.token_logprobs_entropy_bwd_triton(
        logits=z,
        targets=y,
        row_max=m,
        log_norm=log_s,
        entropy=ent,
        grad_logprob=gl.to(device),
        grad_entropy=gh.to(device),
        temperature=0.8,
        vocab_start=0,
        grad_logits=grad,
    )
    ref = reference_grad(logits, targets, 0.8, gl, gh)
    assert_verbose_allclose(
        grad.cpu(), ref.to(torch.bfloat16), name="grad", **GRAD_TOL[torch.bfloat16]
    )


# ------------------------------------------- fused loss, bf16 gradient GEMMs


@pytest.mark.parametrize("device", DEVICES)
def test_fused_linear_espo_loss_bf16_input_grad_gemms_on_device(device):
    from tests.test_espo_fused_loss import _close_bf16, _MatmulDtypes, make_batch, reference

    lengths = (301, 7, 1, 1029, 64) if _big(device) else (7, 13, 1, 9)
    hidden, vocab = (257, 4099) if _big(device) else (17, 301)
    opts = {"mode": "espo", "num_groups": 3, "vocab_size": vocab}
    batch = make_batch(lengths, 3, hidden, vocab, seed=62, dtype=torch.bfloat16)
    h, w, y, old, old_ent, adv, cu, mask = batch
    ref_loss, ref_lp, _, ref_dh, ref_dw = reference(*batch, 0.01, 0.9, opts)
    dev = [t.to(device) for t in batch]
    hq, wq = dev[0].clone().requires_grad_(), dev[1].clone().requires_grad_()
    with _MatmulDtypes() as rec:
        loss, _, lp, _ = ck.espo.fused_linear_espo_loss(
            hq,
            wq,
            *dev[2:],
            entropy_coef=0.01,
            temperature=0.9,
            token_chunk=97 if _big(device) else 8,
            grad_gemm_dtype="input",
            **opts,
        )
        (loss * 3.0).backward()
    assert hq.grad.dtype == torch.bfloat16 and wq.grad.dtype == torch.bfloat16
    assert_verbose_allclose(lp.cpu(), ref_lp.float(), name="logprobs", atol=2e-5, rtol=1e-4)
    assert_verbose_allclose(loss.double().cpu(), ref_loss, name="loss", atol=1e-5, rtol=1e-4)
    _close_bf16(hq.grad.cpu(), 3 * ref_dh, "d_hidden")
    _close_bf16(wq.grad.cpu(), 3 * ref_dw, "d_weight")
    bf16_mms = [name for name, d in rec.calls if d == (torch.bfloat16, torch.bfloat16)]
    assert bf16_mms, rec.calls
    if device == "cuda":  # the mixed-precision GEMM: bf16 operands, float32 out
        assert any(name in ("dtype", "dtype_out") for name in bf16_mms), rec.calls


# ---------------------------------------------------- ESPO loss, 8 groups


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grouping", ["sequence", "global"])
def test_triton_espo_loss_eight_groups_on_device(device, grouping):
    from tests.test_espo_loss import _compare, _reference, _run, make_batch

    n, max_len = (257, 3000) if _big(device) else (9, 300)
    batch = make_batch(n, seed=63, max_len=max_len, pad=129, masked=0.2, device=device)
    cfg = dict(vocab_size=151936, num_groups=8, grouping=grouping, drop_low=True)
    _compare(_run("triton", batch, cfg), _reference(batch, cfg))
