"""The ignore index (-100) and out-of-range targets in every log-prob kernel.

Policy (``ck.espo.IGNORE_INDEX``): a target of -100 is a masked token:
log-prob 0, no log-prob gradient (its entropy and the entropy's gradient are
computed as for any row). Any other target outside [0, V) is invalid: the
public functions raise where they check (CPU by default, validate=True),
naming ``targets``; the kernels (torch, Triton) never read outside the row and
write a NaN log-prob.
Every backend against the float64 reference, outputs poisoned first.
"""

from __future__ import annotations

from tests.triton_tier import DEVICE as TRITON_DEVICE

# isort: split

import pytest
import torch

import compass_kernels as ck
from compass_kernels.espo.logprobs import token_logprobs_entropy_bwd_op, token_logprobs_entropy_op
from compass_kernels.espo.reference_logprobs import IGNORE_INDEX, token_logprobs_entropy_reference
from compass_kernels.testing import assert_verbose_allclose, empty_poisoned, make_generator
from tests.test_espo_logprobs import GRAD_TOL, TOL, make_logits, reference_grad

BACKENDS = [
    pytest.param("torch", "cpu", id="torch"),
    pytest.param("triton", TRITON_DEVICE, id="triton", marks=pytest.mark.triton),
]
#: Backends that check targets themselves (raise) instead of writing NaN: none
#: (the public functions check).
CHECKING: set[str] = set()


def _problem(rows=9, vocab=1025, dtype=torch.float32, seed=0):
    logits, y = make_logits(rows, vocab, seed=seed, dtype=dtype, masked=False)
    y[[1, 4, rows - 1]] = IGNORE_INDEX
    return logits, y


def _run_fwd(logits, y, backend, device):
    out = tuple(empty_poisoned(logits.shape[0], torch.float32, device) for _ in range(4))
    res = token_logprobs_entropy_op.run(
        logits=logits.to(device),
        targets=y.to(device),
        temperature=0.9,
        with_entropy=True,
        backend=backend,
        out=out,
    )
    return [t.cpu() for t in res]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_ignore_index_forward_and_backward(backend, device, dtype):
    logits, y = _problem(dtype=dtype)
    logp, ent, m, log_s = _run_fwd(logits, y, backend, device)
    ref_lp, ref_h = token_logprobs_entropy_reference(logits, y, 0.9)
    ignored = y == IGNORE_INDEX
    assert bool((logp[ignored] == 0).all()), logp[ignored]
    assert_verbose_allclose(logp, ref_lp.float(), name="logp", **TOL[dtype])
    assert_verbose_allclose(ent, ref_h.float(), name="entropy", **TOL[dtype])
    g = make_generator(1)
    gl, gh = torch.randn(9, generator=g), torch.randn(9, generator=g)
    for grads in ((gl, gh), (gl, None)):
        grad = empty_poisoned(logits.shape, dtype, device)
        gl_d, gh_d = (None if t is None else t.to(device) for t in grads)
        token_logprobs_entropy_bwd_op.run(
            logits=logits.to(device),
            targets=y.to(device),
            row_max=m.to(device),
            log_norm=log_s.to(device),
            entropy=ent.to(device),
            grad_logprob=gl_d,
            grad_entropy=gh_d,
            temperature=0.9,
            vocab_start=0,
            backend=backend,
            out=grad,
        )
        ref = reference_grad(logits, y, 0.9, *grads)
        assert_verbose_allclose(grad.cpu(), ref.to(dtype), name="grad", **GRAD_TOL[dtype])
        if grads[1] is None:  # log-prob gradient only: the ignored rows get none
            assert bool((grad.cpu()[ignored] == 0).all())


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_invalid_target_raises_or_gives_nan(backend, device):
    logits, y = _problem()
    for bad in (-1, -101, 1025, 1 << 40):
        y_bad = y.clone()
        y_bad[2] = bad
        if backend in CHECKING:
            with pytest.raises(
                ValueError,
                match=r"targets: expected token ids in \[0, 1025\).* "
                r"or the ignore index -100",
            ):
                _run_fwd(logits, y_bad, backend, device)
            continue
        logp, ent, _, _ = _run_fwd(logits, y_bad, backend, device)
        assert bool(logp[2].isnan()), logp
        ref_lp, ref_h = token_logprobs_entropy_reference(logits, y_bad, 0.9)
        keep = torch.arange(9) != 2
        assert_verbose_allclose(logp[keep], ref_lp.float()[keep], **TOL[torch.float32])
        assert_verbose_allclose(ent, ref_h.float(), **TOL[torch.float32])


def test_public_api_accepts_ignore_index_and_names_bad_targets():
    logits, y = _problem()
    for backend in (None, "triton"):
        dev = "cpu" if backend is None else TRITON_DEVICE
        lp, _ = ck.espo.token_logprobs_entropy(
            logits.to(dev), y.to(dev), backend=backend, validate=True
        )
        assert bool((lp.cpu()[y == IGNORE_INDEX] == 0).all())
        y_bad = y.clone()
        y_bad[3] = -7
        with pytest.raises(ValueError, match=r"targets\[3\] = -7"):
            ck.espo.token_logprobs_entropy(
                logits.to(dev), y_bad.to(dev), backend=backend, validate=True
            )
    assert ck.espo.IGNORE_INDEX == -100


@pytest.mark.parametrize("backend", [None, pytest.param("triton", marks=pytest.mark.triton)])
def test_fused_linear_ignore_index(backend):
    """The tile statistics + finalisation path (vocab-tiled, no [T, V] logits)."""
    g = make_generator(5)
    dev = "cpu" if backend is None else TRITON_DEVICE
    h = torch.randn(7, 24, generator=g, dtype=torch.float64)
    w = torch.randn(301, 24, generator=g, dtype=torch.float64)
    y = torch.randint(0, 301, (7,), generator=g)
    y[[0, 5]] = IGNORE_INDEX
    hq = h.float().to(dev).requires_grad_()
    wq = w.float().to(dev).requires_grad_()
    lp, ent = ck.espo.fused_linear_logprobs_entropy(
        hq, wq, y.to(dev), token_chunk=4, vocab_chunk=100, backend=backend
    )
    gl = torch.randn(7, generator=g)
    (lp * gl.to(dev)).sum().backward()
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_lp, _ = token_logprobs_entropy_reference(h64 @ w64.T, y)
    (ref_lp * gl.double()).sum().backward()
    assert bool((lp.detach().cpu()[[0, 5]] == 0).all())
    assert_verbose_allclose(lp.detach().cpu(), ref_lp.float(), atol=5e-5, rtol=1e-5)
    assert_verbose_allclose(hq.grad.cpu(), h64.grad.float(), atol=5e-5, rtol=1e-4)
    assert_verbose_allclose(wq.grad.cpu(), w64.grad.float(), atol=5e-5, rtol=1e-4)
