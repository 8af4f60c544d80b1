"""Triton kernels of ck.espo's token log-probs / entropy against the float64 reference.

Runs on CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, no GPU) or
on CUDA tensors where a GPU is. Outputs are poisoned before each launch; sizes
are odd and cross the kernels' vocab BLOCK (2048, and a 16-wide block to get
many chunks per row at interpreter-friendly sizes). The sm_90 compile checks
(no spills, bounded registers) of every launched variant are here too.
"""

from __future__ import annotations

from tests.triton_tier import DEVICE, LAUNCHES

# isort: split

import pytest
import torch

import compass_kernels as ck
from compass_kernels.espo import triton_logprobs as kt
from compass_kernels.espo.reference_logprobs import token_logprobs_entropy_reference
from compass_kernels.testing import assert_verbose_allclose, empty_poisoned
from tests import aot
from tests.test_espo_logprobs import (
    GRAD_TOL,
    TOL,
    check_fused,
    make_logits,
    reference_grad,
)
from tests.tiers import INTERPRETER_ONLY
from tests.triton_tier import needs_cuobjdump

pytestmark = [
    pytest.mark.triton,
    LAUNCHES,
]


def _fwd(logits, targets, temperature, with_entropy, outs, **kw):
    """The forward wrapper by name; ``outs``: logp, entropy, row_max, log_norm."""
    names = ("logp", "entropy", "row_max", "log_norm")
    kt.token_logprobs_entropy_triton(
        logits=logits,
        targets=targets,
        temperature=temperature,
        with_entropy=with_entropy,
        **dict(zip(names, outs, strict=True)),
        **kw,
    )


def _bwd(logits, targets, m, log_s, ent, gl, gh, temperature, vocab_start, grad, **kw):
    kt.token_logprobs_entropy_bwd_triton(
        logits=logits,
        targets=targets,
        row_max=m,
        log_norm=log_s,
        entropy=ent,
        grad_logprob=gl,
        grad_entropy=gh,
        temperature=temperature,
        vocab_start=vocab_start,
        grad_logits=grad,
        **kw,
    )


def _forward(logits, targets, temperature, with_entropy, block):
    rows = logits.shape[0]
    outs = [empty_poisoned(rows, torch.float32, DEVICE) for _ in range(4)]
    _fwd(logits, targets, temperature, with_entropy, outs, block=block)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,block",
    [((1, 1), 16), ((7, 33), 16), ((13, 97), 16), ((5, 2049), 2048), ((3, 4099), 2048)],
)
def test_forward_and_backward(shape, block, dtype):
    logits, targets = make_logits(*shape, seed=31 + sum(shape), dtype=dtype)
    z, y = logits.to(DEVICE), targets.to(DEVICE)
    for temperature, with_entropy in ((1.0, True), (0.7, True), (1.2, False)):
        logp, ent, m, log_s = _forward(z, y, temperature, with_entropy, block)
        ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets, temperature)
        tol = TOL[dtype]
        assert_verbose_allclose(logp.cpu(), ref_lp.float(), name="logp", **tol)
        assert bool((logp <= 0).all())
        assert_verbose_allclose(m.cpu(), logits.float().amax(-1), name="row_max", atol=0, rtol=0)
        ref_lse = torch.logsumexp(logits.double() / temperature, -1).float()
        assert_verbose_allclose((m / temperature + log_s).cpu(), ref_lse, name="lse", **tol)
        if with_entropy:
            assert_verbose_allclose(ent.cpu(), ref_h.float(), name="entropy", **tol)
        else:
            assert bool(ent.isnan().all())
    # backward, temperature 0.7
    logp, ent, m, log_s = _forward(z, y, 0.7, True, block)
    g = torch.Generator().manual_seed(5)
    gl, gh = torch.randn(shape[0], generator=g), torch.randn(shape[0], generator=g)
    for gls, ghs in ((gl, gh), (gl, None), (None, gh)):
        grad = empty_poisoned(shape, dtype, DEVICE)
        _bwd(
            z,
            y,
            m,
            log_s,
            ent,
            None if gls is None else gls.to(DEVICE),
            None if ghs is None else ghs.to(DEVICE),
            0.7,
            0,
            grad,
            block=block,
        )
        ref = reference_grad(logits, targets, 0.7, gls, ghs)
        assert_verbose_allclose(grad.cpu(), ref.to(dtype), name="grad", **GRAD_TOL[dtype])


@pytest.mark.parametrize("shape,block", [((7, 33), 16), ((3, 4099), 2048)])
def test_backward_fp32_logits_bf16_grad(shape, block):
    """The fused lm_head backward's store: float32 logits tile, d logits
    written straight to bf16 (poisoned first). One rounding: bit-equal to the
    float32 d logits rounded to bf16, and within bf16 tolerance of float64.
    Other dtype pairs are refused."""
    logits, targets = make_logits(*shape, seed=41 + sum(shape), dtype=torch.float32)
    z, y = logits.to(DEVICE), targets.to(DEVICE)
    logp, ent, m, log_s = _forward(z, y, 0.7, True, block)
    g = torch.Generator().manual_seed(6)
    gl, gh = torch.randn(shape[0], generator=g), torch.randn(shape[0], generator=g)
    gl, gh = gl.to(DEVICE), gh.to(DEVICE)
    g32 = empty_poisoned(shape, torch.float32, DEVICE)
    _bwd(z, y, m, log_s, ent, gl, gh, 0.7, 0, g32, block=block)
    g16 = empty_poisoned(shape, torch.bfloat16, DEVICE)
    _bwd(z, y, m, log_s, ent, gl, gh, 0.7, 0, g16, block=block)
    assert torch.equal(g16.cpu(), g32.cpu().to(torch.bfloat16))
    ref = reference_grad(logits, targets, 0.7, gl.cpu(), gh.cpu())
    assert_verbose_allclose(
        g16.cpu(), ref.to(torch.bfloat16), name="grad", **GRAD_TOL[torch.bfloat16]
    )
    with pytest.raises(ValueError, match="grad_logits"):
        _bwd(
            z,
            y,
            m,
            log_s,
            ent,
            gl,
            gh,
            0.7,
            0,
            torch.empty(shape, dtype=torch.float16, device=DEVICE),
        )
    with pytest.raises(ValueError, match="grad_logits"):
        _bwd(z.to(torch.bfloat16), y, m, log_s, ent, gl, gh, 0.7, 0, g32)


def test_large_vocab_151936():
    logits, targets = make_logits(2, 151936, seed=35, masked=False)
    logp, ent, m, log_s = _forward(logits.to(DEVICE), targets.to(DEVICE), 1.0, True, kt.BLOCK)
    ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets)
    assert_verbose_allclose(logp.cpu(), ref_lp.float(), **TOL[torch.float32])
    assert_verbose_allclose(ent.cpu(), ref_h.float(), **TOL[torch.float32])


def test_tile_stats_and_vocab_offset():
    logits, targets = make_logits(9, 300, seed=32)
    z, y = logits.to(DEVICE), targets.to(DEVICE)
    state = torch.zeros(4, 9, device=DEVICE)
    state[0] = float("-inf")
    for v0, v1 in ((0, 100), (100, 101), (101, 300)):
        out = empty_poisoned((4, 9), torch.float32, DEVICE)
        kt.logprobs_tile_stats_triton(
            logits=z[:, v0:v1],
            targets=y,
            vocab_start=v0,
            temperature=1.3,
            with_entropy=True,
            state_in=state,
            state_out=out,
            block=16,
        )
        state = out
    m, s, a, zt = state.cpu()
    ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets, 1.3)
    assert_verbose_allclose((zt - m) / 1.3 - s.log(), ref_lp.float(), **TOL[torch.float32])
    assert_verbose_allclose(s.log() - a / s, ref_h.float(), **TOL[torch.float32])
    # Backward of one tile with its vocab offset: the one-hot lands only where
    # the target falls inside the tile.
    logp, ent, m, log_s = _forward(z, y, 1.3, True, 16)
    gl = torch.ones(9, device=DEVICE)
    full = empty_poisoned((9, 300), torch.float32, DEVICE)
    _bwd(z, y, m, log_s, ent, gl, None, 1.3, 0, full, block=16)
    tile = empty_poisoned((9, 200), torch.float32, DEVICE)
    _bwd(z[:, 100:], y, m, log_s, ent, gl, None, 1.3, 100, tile, block=16)
    assert_verbose_allclose(tile, full[:, 100:], atol=0, rtol=0)


def test_public_api_and_autograd():
    logits, targets = make_logits(11, 129, seed=33)
    x = logits.to(DEVICE).requires_grad_()
    logp, ent = ck.espo.token_logprobs_entropy(
        x, targets.to(DEVICE), temperature=0.9, backend="triton"
    )
    (logp * 3 - ent).sum().backward()
    ref = reference_grad(logits, targets, 0.9, torch.full((11,), 3.0), torch.full((11,), -1.0))
    assert_verbose_allclose(x.grad.cpu(), ref.float(), **GRAD_TOL[torch.float32])


def test_public_api_checks_data_for_triton_on_cpu():
    if DEVICE != "cpu":
        pytest.skip(INTERPRETER_ONLY)  # the default data checks are for CPU tensors
    z = torch.randn(3, 10)
    with pytest.raises(ValueError, match=r"targets: expected token ids in \[0, 10\)"):
        ck.espo.token_logprobs_entropy(z, torch.tensor([0, 11, 1]), backend="triton")
    z[1, 2] = float("nan")
    with pytest.raises(ValueError, match="logits: expected finite or -inf values"):
        ck.espo.token_logprobs_entropy(z, torch.tensor([0, 1, 1]), backend="triton")


def test_fused_linear_triton_tiles():
    check_fused(19, 12, 301, (8, 100), torch.float32, "triton", seed=7, device=DEVICE)


def test_bad_inputs_triton_wrappers():
    z, y = torch.randn(3, 10, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE)
    outs = [torch.empty(3, device=DEVICE) for _ in range(4)]
    with pytest.raises(ValueError, match="targets: expected dtype int64"):
        _fwd(z, y.int(), 1.0, True, outs)
    with pytest.raises(ValueError, match="temperature: expected a finite value > 0"):
        _fwd(z, y, 0.0, True, outs)
    with pytest.raises(ValueError, match="log_norm: expected 3 elements"):
        _fwd(z, y, 1.0, True, [*outs[:3], torch.empty(2, device=DEVICE)])
    with pytest.raises(ValueError, match="grad_logits: expected shape"):
        _bwd(z, y, *outs[2:], outs[1], None, None, 1.0, 0, torch.empty(3, 9, device=DEVICE))


# ------------------------------------------------------------ sm_90 compile


@pytest.mark.sm90
def test_kernels_compile_for_sm90_without_spills():
    arts = [aot.compile_triton(k, sig, const, **opts) for k, sig, const, opts in kt.aot_variants()]
    assert len(arts) == 17  # 14 + the float32-logits / bf16-grad backward (fused lm_head)
    for art in arts:
        aot.assert_no_spills(art.resource_usage)
        aot.assert_registers_at_most(art.resource_usage, 128)
    # The exps run on the SFU (ex2.approx), the row offsets in 64-bit; the forward's
    # are exp2 with flush-to-zero (one MUFU.EX2 each, no denormal fix-up).
    assert "ex2.approx.ftz.f32" in arts[0].ptx and "ex2.approx.f32" not in arts[0].ptx
    assert "mul.wide.s32" in arts[0].ptx or "mul.lo.s64" in arts[0].ptx
    # The vocab body is read (and the backward's grad written) 16 bytes per access
    # (8 bf16 / 4 fp32) with V and the row stride unspecialized: the kernels' own
    # head / body / tail split, not V % 16 == 0, gives the alignment. A plain
    # masked loop over the row compiles to 16 ld.global.b16 per thread instead.
    for art, (_, sig, _, _) in zip(arts, kt.aot_variants(), strict=True):
        vec_loads = art.ptx.count("ld.global.v4.b32")
        per_thread = kt.BLOCK // (32 * kt.LAUNCH["num_warps"])  # elements per loop step
        elem = 4 if sig["logits_ptr"] == "*fp32" else 2
        assert vec_loads == per_thread * elem // 16, (art.name, sig["logits_ptr"], vec_loads)
        if art.name == "_bwd_kernel" and sig["grad_ptr"] == sig["logits_ptr"]:
            assert art.ptx.count("st.global.v4.b32") == vec_loads, art.name
        elif art.name == "_bwd_kernel":  # float32 in, bf16 out: half the bytes per store
            assert art.ptx.count("st.global.v2.b32") == vec_loads, (art.name, sig)


@pytest.mark.sm90
@needs_cuobjdump
def test_sm90_sass_has_128_bit_vocab_loads():
    # The same in the SASS ptxas emits: LDG.E.128 in every kernel, STG.E.128 in the
    # backward, no spills (checked above).
    for k, sig, const, opts in kt.aot_variants():
        if sig["logits_ptr"] != "*bf16" or False in (const.get("ENT"), const.get("HAS_GH")):
            continue
        art = aot.compile_triton(k, sig, const, **opts)
        aot.assert_sass_contains(art.sass, r"LDG\.E\.128", kernel=art.name)
        if art.name == "_bwd_kernel":
            aot.assert_sass_contains(art.sass, r"STG\.E\.128", kernel=art.name)


@pytest.mark.sm90
@needs_cuobjdump
def test_forward_vocab_loop_has_no_cross_thread_reduction():
    """The launched forward / tile-statistics kernels keep per-lane online state: the
    vocab loop (the largest back-edge) has no barrier and no shuffle, and one
    MUFU.EX2 per element plus one per lane (the rescale) per thread."""
    import re

    from bench.roofline import sass_profile

    insn = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
    seen = set()
    for v in aot.launched_variants("espo.triton_logprobs"):
        if v.name not in ("_fwd_kernel", "_tile_kernel") or "151936" not in v.case:
            continue
        seen.add(v.name)
        start, end, _ = sass_profile(v.sass)["loops"][-1]
        ops = [op for a, op in insn.findall(v.sass) if start <= int(a, 16) <= end]
        where = f"{v.name} ({v.case})"
        assert not [op for op in ops if op.startswith(("BAR", "SHFL"))], where
        vec = 8 if "bfloat16" in v.case else 4
        per_thread = kt.BLOCK // (32 * kt.LAUNCH["num_warps"])
        assert ops.count("MUFU.EX2") <= per_thread + per_thread // vec, (
            where,
            ops.count("MUFU.EX2"),
        )
    assert seen == {"_fwd_kernel", "_tile_kernel"}


@pytest.mark.gpu
def test_gpu_large_shapes():
    # 65,536 tokens (one program per token on grid axis 0) and a 151,936 vocab.
    for rows, vocab in ((65536, 64), (5, 151936)):
        logits, targets = make_logits(rows, vocab, seed=34, masked=False)
        logp, ent = ck.espo.token_logprobs_entropy(logits.cuda(), targets.cuda())
        ref_lp, ref_h = token_logprobs_entropy_reference(logits, targets)
        assert_verbose_allclose(logp.cpu(), ref_lp.float(), **TOL[torch.float32])
        assert_verbose_allclose(ent.cpu(), ref_h.float(), **TOL[torch.float32])
