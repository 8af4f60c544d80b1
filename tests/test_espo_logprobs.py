"""ck.espo token log-probs / entropy (torch CPU backend, public API) vs the float64 reference.

Triton-backend tests live in test_espo_logprobs_triton.py. Outputs are
poisoned (NaN) before each kernel runs; logits mix large positive offsets,
all-negative rows, masked (-inf) entries and a vocab tile boundary (512) +- 1.
"""

from __future__ import annotations

import math

import pytest
import torch

import compass_kernels as ck
from compass_kernels.espo.logprobs import (
    logprobs_tile_stats_op,
    token_logprobs_entropy_bwd_op,
    token_logprobs_entropy_op,
)
from compass_kernels.espo.reference_logprobs import (
    fused_linear_logprobs_entropy_reference,
    token_logprobs_entropy_reference,
)
from compass_kernels.testing import assert_verbose_allclose, empty_poisoned, make_generator

# float32 accumulation of |x| up to ~60: a few ulps of lse (6e-6) plus the
# sum's rounding; bf16 gradients are one bf16 rounding of a float32 value.
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-5, "rtol": 1e-5},
}
GRAD_TOL = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-6, "rtol": 8e-3},
}

SHAPES = [(1, 1), (3, 7), (7, 511), (5, 513), (37, 1025), (17, 4099)]


def make_logits(rows: int, vocab: int, seed: int, dtype=torch.float32, *, masked: bool = True):
    """Logits whose rows differ in kind: N(0, 1), scaled by 8 with a +40 offset,
    all-negative (-300 +- 3), a few entries -inf (masked), one dominant entry."""
    g = make_generator(seed)
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    for t in range(rows):
        kind = t % 5
        if kind == 1:
            z[t] = z[t] * 8 + 40
        elif kind == 2:
            z[t] = z[t] * 3 - 300
        elif kind == 3 and masked and vocab > 2:
            z[t, torch.randperm(vocab, generator=g)[: vocab // 3]] = -math.inf
        elif kind == 4:
            z[t, int(torch.randint(0, vocab, (1,), generator=g))] += 25
    targets = torch.randint(0, vocab, (rows,), generator=g)
    # A masked row's target is one of its finite entries (a -inf target is tested apart).
    for t in range(rows):
        if z[t, targets[t]] == -math.inf:
            targets[t] = int(torch.isfinite(z[t]).nonzero()[0, 0])
    return z.to(dtype), targets


def _fwd_poisoned(logits, targets, temperature, with_entropy, backend):
    rows = logits.shape[0]
    out = tuple(empty_poisoned(rows, torch.float32) for _ in range(4))
    return token_logprobs_entropy_op.run(
        logits=logits,
        targets=targets,
        temperature=temperature,
        with_entropy=with_entropy,
        backend=backend,
        out=out,
    )


def _bwd(logits, targets, m, log_s, ent, gl, gh, temperature, vocab_start, backend, out):
    """The backward op by name (poisoned ``out``)."""
    return token_logprobs_entropy_bwd_op.run(
        logits=logits,
        targets=targets,
        row_max=m,
        log_norm=log_s,
        entropy=ent,
        grad_logprob=gl,
        grad_entropy=gh,
        temperature=temperature,
        vocab_start=vocab_start,
        backend=backend,
        out=out,
    )


def check_forward(logits, targets, temperature, with_entropy, backend):
    logp, ent, m, log_s = _fwd_poisoned(logits, targets, temperature, with_entropy, backend)
    ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets, temperature)
    tol = TOL[logits.dtype]
    assert_verbose_allclose(logp, ref_lp.float(), name="logp", **tol)
    assert bool((logp <= 0).all()), "a positive log-prob"
    ref_lse = torch.logsumexp(logits.double() / temperature, -1)
    assert_verbose_allclose(m / temperature + log_s, ref_lse.float(), name="lse", **tol)
    ref_max = logits.float().amax(-1)
    assert_verbose_allclose(m, ref_max, name="row_max", atol=0, rtol=0)
    if with_entropy:
        assert_verbose_allclose(ent, ref_h.float(), name="entropy", **tol)
    else:
        assert bool(ent.isnan().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, dtype):
    logits, targets = make_logits(*shape, seed=sum(shape), dtype=dtype)
    for temperature, with_entropy in ((1.0, True), (0.7, True), (1.3, False)):
        check_forward(logits, targets, temperature, with_entropy, "torch")


def test_strided_rows():
    wide, targets = make_logits(9, 700, seed=3)
    logits = wide[:, :613]  # rows 700 apart, vocab contiguous
    targets = targets % 613
    check_forward(logits, targets, 0.9, True, "torch")


def test_all_negative_and_huge_logits():
    # Entropy from E[x] - lse cancels catastrophically for |x| >> 1 (a peer
    # kernel's bug with all-negative logits); the state relative to the max does not.
    g = make_generator(4)
    for offset in (-1e4, -50.0, 1e4):
        z = torch.randn(6, 1000, generator=g) * 2 + offset
        y = torch.randint(0, 1000, (6,), generator=g)
        check_forward(z, y, 1.0, True, "torch")


def test_never_a_positive_logprob():
    # One logit dominates by far: p(target) rounds to 1 and lse to the target's
    # logit, where x_t - lse can round above 0.
    z = torch.full((64, 33), -30.0)
    y = torch.arange(64) % 33
    z[torch.arange(64), y] = torch.linspace(10, 1e5, 64)
    logp, ent, _, _ = _fwd_poisoned(z, y, 1.0, True, "torch")
    assert bool((logp <= 0).all()) and bool((ent >= 0).all())


def test_masked_target_gives_minus_inf():
    z = torch.randn(2, 50)
    z[0, 3] = -math.inf
    logp, ent = ck.espo.token_logprobs_entropy(z, torch.tensor([3, 4]))
    ref_lp, ref_h = token_logprobs_entropy_reference(z, torch.tensor([3, 4]))
    assert logp[0] == -math.inf
    assert_verbose_allclose(logp[1:], ref_lp[1:].float(), **TOL[torch.float32])
    assert_verbose_allclose(ent, ref_h.float(), **TOL[torch.float32])


def test_large_vocab_151936():
    logits, targets = make_logits(3, 151936, seed=5, masked=False)
    check_forward(logits, targets, 1.0, True, "torch")


def test_65536_tokens():
    # T = 65,536 rows (Liger's Triton loss crashes at L >= 65536: grid axis limit);
    # row offsets are int64 throughout.
    rows, vocab = 65536, 67
    g = make_generator(6)
    logits = torch.randn(rows, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (rows,), generator=g)
    logp, ent, m, log_s = _fwd_poisoned(logits, targets, 1.0, True, "torch")
    ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets)
    assert_verbose_allclose(logp, ref_lp.float(), **TOL[torch.float32])
    assert_verbose_allclose(ent, ref_h.float(), **TOL[torch.float32])
    grad = empty_poisoned((rows, vocab), torch.float32)
    gl = torch.randn(rows, generator=g)
    _bwd(logits, targets, m, log_s, ent, gl, None, 1.0, 0, "torch", grad)
    ref = torch.softmax(logits.double(), -1).neg_()
    ref[torch.arange(rows), targets] += 1
    assert_verbose_allclose(grad, (ref * gl.double()[:, None]).float(), **GRAD_TOL[torch.float32])


# ----------------------------------------------------------------- gradients


def reference_grad(logits, targets, temperature, gl, gh):
    x = logits.detach().to(torch.float64).requires_grad_()
    lp, h = token_logprobs_entropy_reference(x, targets, temperature)
    loss = 0
    if gl is not None:
        loss = loss + (lp * gl.double()).sum()
    if gh is not None:
        loss = loss + (h * gh.double()).sum()
    loss.backward()
    return x.grad


def check_backward(logits, targets, temperature, gl, gh, backend):
    _, ent, m, log_s = _fwd_poisoned(logits, targets, temperature, True, backend)
    grad = empty_poisoned(logits.shape, logits.dtype)
    _bwd(logits, targets, m, log_s, ent, gl, gh, temperature, 0, backend, grad)
    ref = reference_grad(logits, targets, temperature, gl, gh)
    assert_verbose_allclose(grad, ref.to(logits.dtype), name="grad", **GRAD_TOL[logits.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_backward_matches_reference(shape, dtype):
    logits, targets = make_logits(*shape, seed=11 + sum(shape), dtype=dtype)
    g = make_generator(12)
    gl, gh = torch.randn(shape[0], generator=g), torch.randn(shape[0], generator=g)
    for grads in ((gl, gh), (gl, None), (None, gh)):
        check_backward(logits, targets, 0.8, *grads, "torch")


def test_autograd_through_public_api():
    logits, targets = make_logits(13, 257, seed=13)
    x = logits.clone().requires_grad_()
    logp, ent = ck.espo.token_logprobs_entropy(x, targets, temperature=1.1)
    g = make_generator(14)
    gl, gh = torch.randn(13, generator=g), torch.randn(13, generator=g)
    (logp * gl + ent * gh).sum().backward()
    assert_verbose_allclose(
        x.grad, reference_grad(logits, targets, 1.1, gl, gh).float(), **GRAD_TOL[torch.float32]
    )
    # Only the log-prob used: the entropy term contributes nothing.
    x.grad = None
    logp, ent = ck.espo.token_logprobs_entropy(x, targets, temperature=1.1)
    logp.sum().backward()
    ref = reference_grad(logits, targets, 1.1, torch.ones(13), None)
    assert_verbose_allclose(x.grad, ref.float(), **GRAD_TOL[torch.float32])


def test_reference_gradcheck():
    logits, targets = make_logits(4, 9, seed=15, masked=False)
    x = logits.double().requires_grad_()
    torch.autograd.gradcheck(lambda z: token_logprobs_entropy_reference(z, targets, 0.9), (x,))


def test_small_target_gradient_survives_bf16():
    # p(target) = 0.999: in bf16 it rounds to 1.0, so softmax rounded to bf16
    # before the one-hot subtraction would give a 0 gradient at the target
    # (the bug seen in another library); float32 until the store keeps ~1e-3.
    vocab = 64
    z = torch.zeros(8, vocab)
    y = torch.arange(8)
    z[torch.arange(8), y] = math.log(0.999 * (vocab - 1) / 0.001)
    logits = z.to(torch.bfloat16)
    _, ent, m, log_s = _fwd_poisoned(logits, y, 1.0, True, "torch")
    grad = empty_poisoned(logits.shape, torch.bfloat16)
    _bwd(logits, y, m, log_s, ent, torch.ones(8), None, 1.0, 0, "torch", grad)
    ref = reference_grad(logits, y, 1.0, torch.ones(8), None)
    target_grad = grad[torch.arange(8), y].double()
    assert bool((target_grad > 5e-4).all()), target_grad
    assert_verbose_allclose(target_grad, ref[torch.arange(8), y], atol=0, rtol=1e-2)


# ------------------------------------------------------------- tile statistics


def test_tile_stats_merge_to_the_full_row():
    check_tile_stats("torch")


def check_tile_stats(backend):
    logits, targets = make_logits(11, 1000, seed=16)
    state = torch.empty(4, 11)
    state[0] = -math.inf
    state[1:] = 0
    for v0, v1 in ((0, 1), (1, 300), (300, 999), (999, 1000)):
        out = empty_poisoned((4, 11), torch.float32)
        logprobs_tile_stats_op.run(
            logits=logits[:, v0:v1],
            targets=targets,
            vocab_start=v0,
            temperature=0.9,
            with_entropy=True,
            state_in=state,
            backend=backend,
            out=out,
        )
        state = out
    m, s, a, xt = state
    ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets, 0.9)
    assert_verbose_allclose((xt - m) / 0.9 - s.log(), ref_lp.float(), **TOL[torch.float32])
    assert_verbose_allclose(s.log() - a / s, ref_h.float(), **TOL[torch.float32])


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_public_api():
    z, y = torch.randn(4, 10), torch.randint(0, 10, (4,))
    f = ck.espo.token_logprobs_entropy
    with pytest.raises(ValueError, match=r"logits: expected dtype float32 \| bfloat16"):
        f(z.half(), y)
    with pytest.raises(ValueError, match="logits: expected a 2-d tensor"):
        f(z[0], y)
    with pytest.raises(ValueError, match=r"targets: expected 4 elements"):
        f(z, y[:3])
    with pytest.raises(ValueError, match="targets: expected dtype"):
        f(z, y.float())
    with pytest.raises(ValueError, match=r"targets: expected token ids in \[0, 10\)"):
        f(z, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match=r"targets: expected token ids in \[0, 10\)"):
        f(z, torch.tensor([0, -1, 1, 2]))
    with pytest.raises(ValueError, match="temperature: expected a finite value > 0"):
        f(z, y, temperature=0.0)
    with pytest.raises(ValueError, match="temperature: expected a finite value > 0"):
        f(z, y, temperature=float("nan"))
    with pytest.raises(ValueError, match="logits: expected a contiguous vocab dimension"):
        f(torch.randn(10, 4).T, y)
    for bad in (math.nan, math.inf):
        zb = z.clone()
        zb[2, 7] = bad
        msg = r"logits: expected finite or -inf values, got .* at \[2, 7\]"
        with pytest.raises(ValueError, match=msg):
            f(zb, y)
    zb = z.clone()
    zb[1] = -math.inf
    with pytest.raises(ValueError, match="logits: row 1 has every logit -inf"):
        f(zb, y)


def test_empty_batch():
    logp, ent = ck.espo.token_logprobs_entropy(torch.empty(0, 5), torch.empty(0, dtype=torch.int64))
    assert logp.shape == (0,) and ent.shape == (0,)


# ------------------------------------------------------------ registration


def test_opcheck_registered_ops():
    logits, targets = make_logits(5, 37, seed=17, masked=False)
    x = logits.clone().requires_grad_()
    torch.library.opcheck(torch.ops.compass.token_logprobs_entropy.default, (x, targets, 0.9, True))
    _, ent, m, log_s = _fwd_poisoned(logits, targets, 0.9, True, "torch")
    g = torch.randn(5)
    bwd = torch.ops.compass.token_logprobs_entropy_bwd.default
    torch.library.opcheck(bwd, (logits, targets, m, log_s, ent, g, g, 0.9, 0))
    torch.library.opcheck(bwd, (logits, targets, m, log_s, ent, None, g, 0.9, 0))


def test_traces_under_torch_compile():
    import torch._dynamo

    assert not torch._dynamo.config.disable, "dynamo is off here (a live vLLM engine?)"
    logits, targets = make_logits(6, 41, seed=18, masked=False)

    def f(z):
        logp, ent, _, _ = torch.ops.compass.token_logprobs_entropy(z, targets, 1.0, True)
        return (logp * 2 + ent).sum()

    x = logits.clone().requires_grad_()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(x).backward()
    ref = reference_grad(logits, targets, 1.0, torch.full((6,), 2.0), torch.ones(6))
    assert_verbose_allclose(x.grad, ref.float(), **GRAD_TOL[torch.float32])


# ------------------------------------------------------- fused linear (torch)


def make_fused(rows, hidden, vocab, seed, dtype=torch.float32):
    g = make_generator(seed)
    h = (torch.randn(rows, hidden, generator=g) * 2).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) * 3).to(dtype)
    y = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, y


def fused_reference_grads(h, w, y, temperature, gl, gh):
    hh = h.detach().double().requires_grad_()
    ww = w.detach().double().requires_grad_()
    lp, ent = fused_linear_logprobs_entropy_reference(hh, ww, y, temperature)
    (lp * gl.double() + ent * gh.double()).sum().backward()
    return lp, ent, hh.grad, ww.grad


def check_fused(rows, hidden, vocab, chunks, dtype, backend, seed=0, device="cpu"):
    h, w, y = make_fused(rows, hidden, vocab, seed, dtype)
    hq, wq = h.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
    logp, ent = ck.espo.fused_linear_logprobs_entropy(
        hq,
        wq,
        y.to(device),
        temperature=0.9,
        token_chunk=chunks[0],
        vocab_chunk=chunks[1],
        backend=backend,
    )
    g = make_generator(seed + 1)
    gl, gh = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    (logp * gl.to(device) + ent * gh.to(device)).sum().backward()
    logp, ent = logp.detach().cpu(), ent.detach().cpu()
    hq_grad, wq_grad = hq.grad.cpu(), wq.grad.cpu()
    ref_lp, ref_h, ref_dh, ref_dw = fused_reference_grads(h, w, y, 0.9, gl, gh)
    assert_verbose_allclose(logp, ref_lp.float(), name="logp", atol=5e-5, rtol=1e-5)
    assert_verbose_allclose(ent, ref_h.float(), name="entropy", atol=5e-5, rtol=1e-5)
    assert bool((logp <= 0).all())
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2e-2}
    assert hq_grad.dtype == dtype and wq_grad.dtype == dtype
    assert_verbose_allclose(hq_grad, ref_dh.to(dtype), name="d_hidden", **tol)
    assert_verbose_allclose(wq_grad, ref_dw.to(dtype), name="d_weight", **tol)


@pytest.mark.parametrize(
    "rows,hidden,vocab,chunks",
    [
        (1, 3, 5, (1024, 8192)),
        (37, 19, 1001, (10, 300)),
        (64, 33, 517, (64, 517)),
        (29, 8, 2000, (7, 1999)),
    ],
)
def test_fused_linear_matches_reference(rows, hidden, vocab, chunks):
    check_fused(rows, hidden, vocab, chunks, torch.float32, None, seed=rows)


def test_fused_linear_bf16():
    check_fused(23, 16, 700, (8, 256), torch.bfloat16, None, seed=3)


def test_fused_linear_without_entropy():
    h, w, y = make_fused(9, 7, 100, seed=4)
    hq = h.clone().requires_grad_()
    logp, ent = ck.espo.fused_linear_logprobs_entropy(hq, w, y, with_entropy=False, vocab_chunk=33)
    assert ent is None
    logp.sum().backward()
    hh = h.double().requires_grad_()
    ref_lp, _ = fused_linear_logprobs_entropy_reference(hh, w, y)
    ref_lp.sum().backward()
    assert_verbose_allclose(logp, ref_lp.float(), atol=5e-5, rtol=1e-5)
    assert_verbose_allclose(hq.grad, hh.grad.float(), atol=1e-4, rtol=1e-4)


def test_fused_linear_bad_inputs():
    h, w, y = make_fused(4, 6, 10, seed=5)
    f = ck.espo.fused_linear_logprobs_entropy
    with pytest.raises(ValueError, match=r"weight: expected \[V, 6\]"):
        f(h, w[:, :5], y)
    with pytest.raises(ValueError, match="weight: expected dtype float32"):
        f(h, w.double(), y)
    with pytest.raises(ValueError, match=r"targets: expected token ids in \[0, 10\)"):
        f(h, w, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="token_chunk: expected a positive int"):
        f(h, w, y, token_chunk=0)
    hb = h.clone()
    hb[0, 0] = math.nan
    with pytest.raises(ValueError, match="hidden: expected finite values"):
        f(hb, w, y)


# ------------------------------------------- vocab tensor parallelism (gloo)

TP_SHAPE = (23, 10, 602)  # rows, hidden, vocab (two shards of 301)


def _tp_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        rows, hidden, vocab = TP_SHAPE
        h, w, y = make_fused(rows, hidden, vocab, seed=41)
        shard = vocab // world
        hq = h.clone().requires_grad_()
        wq = w[rank * shard : (rank + 1) * shard].clone().requires_grad_()
        logp, ent = ck.espo.fused_linear_logprobs_entropy(
            hq, wq, y, temperature=0.8, tp_group=dist.group.WORLD, token_chunk=8, vocab_chunk=128
        )
        g = make_generator(42)
        gl, gh = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
        (logp * gl + ent * gh).sum().backward()
        torch.save(
            {"logp": logp, "ent": ent, "dh": hq.grad, "dw": wq.grad}, f"{out_dir}/rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


def test_vocab_tensor_parallel_two_gloo_ranks_equal_one_process(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_tp_worker, args=(world, f"file://{tmp_path}/store", str(tmp_path)), nprocs=world)
    rows, hidden, vocab = TP_SHAPE
    h, w, y = make_fused(rows, hidden, vocab, seed=41)
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = ck.espo.fused_linear_logprobs_entropy(hq, wq, y, temperature=0.8)
    g = make_generator(42)
    gl, gh = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    (logp * gl + ent * gh).sum().backward()
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    tol = {"atol": 2e-5, "rtol": 1e-5}
    for r, part in enumerate(parts):
        assert_verbose_allclose(part["logp"], logp, name=f"rank {r} logp", **tol)
        assert_verbose_allclose(part["ent"], ent, name=f"rank {r} entropy", **tol)
        assert_verbose_allclose(part["dh"], hq.grad, name=f"rank {r} d_hidden", **tol)
    d_weight = torch.cat([p["dw"] for p in parts])
    assert_verbose_allclose(d_weight, wq.grad, name="d_weight shards", **tol)
    # and the single process agrees with the float64 reference
    ref_lp, ref_h, _, _ = fused_reference_grads(h, w, y, 0.8, gl, gh)
    assert_verbose_allclose(logp, ref_lp.float(), atol=5e-5, rtol=1e-5)
