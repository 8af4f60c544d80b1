"""The NaN / +inf policy (docs/design.md, "Validation and non-finite values") holds
on the Triton backend exactly as on the torch backend.

Every op is called with ``validate=False`` on inputs holding a NaN or a +inf at
the places a training step produces them: at a row's target logit, elsewhere in
the row, in the entropy, in the log-ratios, in the rewards, in a weight block.
The Triton backend's outputs must have the torch backend's NaN pattern (NaN
exactly where torch has NaN), the same infinities, and agree elsewhere. On
sm_90, ``tl.maximum`` / ``tl.minimum`` / ``tl.max`` drop NaN (PTX
``max.f32``); the interpreter does the same (Triton >= 3.9: ``np.fmax``,
``np.nanmax``; older interpreters are made to, tests/triton_interpreter.py), so
a kernel that clamps or reduces without propagating NaN fails here as it would
on the GPU: a NaN log-prob turned into a finite loss hides a diverging step.
"""

from __future__ import annotations

from tests.triton_tier import DEVICE, LAUNCHES

# isort: split


import pytest
import torch

import compass_kernels as ck
from compass_kernels.routing import SCORE_FUNCTIONS

pytestmark = [pytest.mark.triton, LAUNCHES]

NAN, INF = float("nan"), float("inf")


def assert_same_pattern(
    got: torch.Tensor, want: torch.Tensor, name: str, *, atol=1e-4, rtol=1e-4
) -> None:
    """NaN where want is NaN (nowhere else), the same infinities, close elsewhere."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.is_floating_point():
        assert torch.equal(got, want), f"{name}: {got} != {want}"
        return
    g, w = got.double(), want.double()
    gn, wn = torch.isnan(g), torch.isnan(w)
    if not torch.equal(gn, wn):
        idx = (gn != wn).nonzero().tolist()[:8]
        raise AssertionError(
            f"{name}: NaN pattern differs from the torch backend at {idx}: triton "
            f"{[g[tuple(i)].item() for i in idx]}, torch {[w[tuple(i)].item() for i in idx]}"
        )
    gi, wi = torch.isinf(g), torch.isinf(w)
    assert torch.equal(gi, wi) and torch.equal(g[gi], w[wi]), f"{name}: infinities differ"
    fin = ~(wn | wi)
    torch.testing.assert_close(g[fin], w[fin], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def _both(fn):
    """fn(backend, device) for torch on CPU and triton on DEVICE."""
    return fn("torch", "cpu"), fn("triton", DEVICE)


# ------------------------------------------------------------------ log-probs

# rows: clean, NaN at the target, NaN elsewhere, +inf at the target, +inf
# elsewhere, -inf elsewhere (masked token: finite), NaN in the head / tail of a
# misaligned chunk (column 1 and the last column), clean
_V = 2053  # crosses the kernel's 2048-wide block: head, body and tail


def _logits_with_specials(dtype):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(9, _V, generator=g).to(dtype)
    y = torch.randint(0, _V, (9,), generator=g)
    y[1], y[3] = 5, 2050
    z[1, 5] = NAN
    z[2, 1000] = NAN
    z[3, 2050] = INF
    z[4, 17] = INF
    z[5, 3] = -INF
    z[6, 1] = NAN
    z[7, _V - 1] = NAN
    return z, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_entropy_nan_and_inf(dtype, temperature):
    z, y = _logits_with_specials(dtype)

    def run(backend, device):
        x = z.to(device).requires_grad_(True)
        lp, h = ck.espo.token_logprobs_entropy(
            x, y.to(device), temperature=temperature, validate=False, backend=backend
        )
        # every row contributes to the gradient through both outputs; a zero weight
        # would turn NaN into 0 * NaN = NaN anyway, so weights are 1 and 0.5
        (lp.sum() + 0.5 * h.sum()).backward()
        return lp, h, x.grad

    (lp_t, h_t, g_t), (lp_k, h_k, g_k) = _both(run)
    assert torch.isnan(lp_t[[1, 2, 3, 4, 6, 7]]).all() and not torch.isnan(lp_t[[0, 5, 8]]).any()
    assert_same_pattern(lp_k, lp_t, "logp")
    assert_same_pattern(h_k, h_t, "entropy")
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    assert_same_pattern(g_k, g_t, "grad_logits", **tol)


def test_token_logprobs_entropy_backward_nan_upstream_gradient():
    # a NaN upstream gradient (a diverged loss) reaches every logit of its row
    z, y = _logits_with_specials(torch.float32)
    z = z[[0, 8]]
    y = y[[0, 8]]

    def run(backend, device):
        x = z.to(device).requires_grad_(True)
        lp, h = ck.espo.token_logprobs_entropy(x, y.to(device), validate=False, backend=backend)
        gl = torch.tensor([NAN, 1.0], device=device)
        gh = torch.tensor([1.0, INF], device=device)
        torch.autograd.backward([lp, h], [gl, gh])
        return x.grad

    g_t, g_k = _both(run)
    assert torch.isnan(g_t[0]).all()
    assert_same_pattern(g_k, g_t, "grad_logits")


@pytest.mark.parametrize("where", ["hidden", "weight", "weight_inf"])
def test_fused_linear_logprobs_entropy_nan(where):
    g = torch.Generator().manual_seed(11)
    h = torch.randn(6, 32, generator=g)
    w = torch.randn(2100, 32, generator=g) * 0.3
    y = torch.randint(0, 2100, (6,), generator=g)
    if where == "hidden":
        h[2, 4] = NAN
    elif where == "weight":
        w[1500, 7] = NAN  # a weight row: every token's statistics
    else:
        w[99, 0] = INF

    def run(backend, device):
        hh = h.to(device).requires_grad_(True)
        ww = w.to(device).requires_grad_(True)
        lp, ent = ck.espo.fused_linear_logprobs_entropy(
            hh, ww, y.to(device), vocab_chunk=1024, validate=False, backend=backend
        )
        (lp.sum() + ent.sum()).backward()
        return lp, ent, hh.grad, ww.grad

    want, got = _both(run)
    if where == "hidden":
        assert torch.isnan(want[0][2]) and not torch.isnan(want[0][[0, 1, 3, 4, 5]]).any()
    elif where == "weight":
        assert torch.isnan(want[0]).all()
    for name, a, b in zip(
        ("logp", "entropy", "grad_hidden", "grad_weight"), got, want, strict=True
    ):
        assert_same_pattern(a, b, name, atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------ ESPO loss


def _loss_inputs(case: str):
    g = torch.Generator().manual_seed(3)
    lens = [7, 12, 5, 9]
    total = sum(lens) + 2  # padding after cu[-1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    lp = -torch.rand(total, generator=g, dtype=torch.float64) * 2
    old = lp + 0.05 * torch.randn(total, generator=g, dtype=torch.float64)
    ent = torch.rand(total, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(len(lens), generator=g, dtype=torch.float64)
    if case == "logprob_nan":
        lp[9] = NAN
    elif case == "logprob_inf":  # a +inf log-ratio: clamped at log_hi by both
        lp[9] = INF
    elif case == "old_logprob_inf":  # a -inf log-ratio... and +inf
        old[3] = INF
        old[20] = -INF
    elif case == "entropy_nan":
        ent[14] = NAN
    elif case == "advantage_nan":
        adv[2] = NAN
    return lp, old, ent, adv, cu


@pytest.mark.parametrize("mode", ["espo", "gspo", "grpo"])
@pytest.mark.parametrize(
    "case", ["logprob_nan", "logprob_inf", "old_logprob_inf", "entropy_nan", "advantage_nan"]
)
def test_espo_loss_nan_and_inf(mode, case):
    lp, old, ent, adv, cu = _loss_inputs(case)
    # espo groups by entropy quantiles; the thresholds come from the finite entropy
    thr = None if mode != "espo" else torch.tensor([1.5], dtype=torch.float64)

    def run(backend, device):
        x = lp.to(device).requires_grad_(True)
        loss, metrics = ck.espo.espo_loss(
            x,
            old.to(device),
            ent.to(device),
            adv.to(device),
            cu.to(device),
            mode=mode,
            vocab_size=1000,
            entropy_threshold=None if thr is None else thr.to(device),
            validate=False,
            backend=backend,
        )
        loss.backward()
        return loss, dict(metrics), x.grad

    (loss_t, m_t, g_t), (loss_k, m_k, g_k) = _both(run)
    if case in ("logprob_nan", "advantage_nan"):
        assert torch.isnan(loss_t), "the torch backend itself hides the NaN"
    assert_same_pattern(loss_k, loss_t, "loss", atol=1e-9, rtol=1e-9)
    assert_same_pattern(g_k, g_t, "grad", atol=1e-9, rtol=1e-9)
    assert set(m_k) == set(m_t)
    for key in m_t:
        assert_same_pattern(m_k[key], m_t[key], f"metrics[{key!r}]", atol=1e-9, rtol=1e-9)


# ------------------------------------------------------------------ advantages


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_advantages_nan_and_inf_rewards(mode, dtype):
    g = torch.Generator().manual_seed(5)
    r = torch.randn(20, generator=g).to(dtype)
    r[3] = NAN  # group 0
    r[9] = INF  # group 2
    r[12] = -INF  # group 3
    ids = torch.arange(20) // 4

    def run(backend, device):
        adv, zv, stats = ck.advantages.group_advantages(
            r.to(device),
            ids.to(device),
            num_groups=5,
            mode=mode,
            validate=False,
            backend=backend,
        )
        return adv, zv, stats.group_mean, stats.group_std

    want, got = _both(run)
    assert torch.isnan(want[0][0:4]).all() and not torch.isnan(want[0][4:8]).any()
    for name, a, b in zip(("adv", "zero_var", "mean", "std"), got, want, strict=True):
        assert_same_pattern(a, b, name)


@pytest.mark.parametrize("case", ["entropy_nan", "entropy_inf", "reward_nan", "advantage_nan"])
def test_rl_zvp_nan_and_inf(case):
    g = torch.Generator().manual_seed(9)
    cu = torch.tensor([0, 5, 13, 20, 26])
    h = torch.rand(28, generator=g) * 2
    r = torch.tensor([1.0, -1.0, 0.0, 1.0])
    zv = torch.tensor([True, True, False, True])
    adv = torch.randn(4, generator=g)
    if case == "entropy_nan":
        h[7] = NAN  # a zero-variance, negative-reward sequence: max(H) is NaN
    elif case == "entropy_inf":
        h[2] = INF
        h[9] = INF
    elif case == "reward_nan":
        r[1] = NAN
    else:
        adv[2] = NAN

    def run(backend, device):
        return ck.advantages.rl_zvp(
            h.to(device),
            cu.to(device),
            r.to(device),
            zv.to(device),
            alpha=0.1,
            advantages=adv.to(device),
            validate=False,
            backend=backend,
        )

    want, got = _both(run)
    if case == "entropy_nan":
        assert torch.isnan(want[5:13]).all()
    assert_same_pattern(got, want, "token advantages")


# ------------------------------------------------------------------ routing


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("ratio", [None, 0.5])
def test_replay_topk_nan_and_inf_logits(score, normalize, ratio):
    g = torch.Generator().manual_seed(13)
    t, e, k = 10, 24, 4
    z = torch.randn(t, e, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    valid = torch.ones(t, dtype=torch.bool)
    valid[[6, 7, 8]] = False  # routed natively
    z[1, ids[1, 0]] = NAN  # at a replayed expert
    z[2, [x for x in range(e) if x not in ids[2].tolist()][0]] = NAN  # elsewhere
    z[3, ids[3, 2]] = INF
    z[4, 5] = -INF
    z[6, 11] = NAN  # a native row
    z[7, 3] = INF
    z[8] = NAN  # every logit

    def run(backend, device):
        # the op itself: on CPU the public replay_topk raises on non-finite logits
        # after the kernel ran (it always checks there); on CUDA it does not
        x = z.to(device).requires_grad_(True)
        args = (
            x,
            ids.to(device),
            None,
            valid.to(device),
            SCORE_FUNCTIONS[score],
            normalize,
            1.0,
            -1.0 if ratio is None else ratio,
        )
        w, rmap, tpe, counts, used = torch.ops.compass.replay_topk(*args, backend)
        gw = torch.linspace(0.5, 1.5, t * k, device=device).view(t, k)
        w.backward(gw)
        return (w, rmap, tpe, counts, used), x.grad

    (res_t, g_t), (res_k, g_k) = _both(run)
    assert torch.isnan(res_t[0][8]).all()
    for name, a, b in zip(
        ("weights", "routing_map", "tokens_per_expert", "counts", "expert_ids"),
        res_k,
        res_t,
        strict=True,
    ):
        assert_same_pattern(a, b, name)
    assert_same_pattern(g_k, g_t, "grad_logits")


# ------------------------------------------------------------------ fp8


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("special", [NAN, INF])
@pytest.mark.parametrize("layout", ["blockwise", "token_groups"])
def test_fp8_quantize_nan_and_inf(ue8m0, special, layout):
    g = torch.Generator().manual_seed(17)
    x = torch.randn(130, 300, generator=g).to(torch.bfloat16)
    x[5, 7] = special  # block / group (0, 0)
    x[129, 290] = special  # a ragged edge block

    def run(backend, device):
        fn = ck.fp8.quantize_blockwise if layout == "blockwise" else ck.fp8.quantize_token_groups
        q, s = fn(x.to(device), ue8m0=ue8m0, validate=False, backend=backend)
        return q.view(torch.uint8), s

    (q_t, s_t), (q_k, s_k) = _both(run)
    # the policy: those blocks' bytes are unspecified, every other block exact;
    # their scales keep the non-finite amax where the torch backend does
    assert_same_pattern(s_k, s_t, "scales", atol=0, rtol=0)
    br = 128 if layout == "blockwise" else 1
    keep = torch.ones_like(q_t, dtype=torch.bool)
    for r, c in ((5, 7), (129, 290)):
        r0, c0 = r // br * br, c // 128 * 128
        keep[r0 : r0 + br, c0 : c0 + 128] = False
    assert torch.equal(q_k.cpu()[keep], q_t[keep])
