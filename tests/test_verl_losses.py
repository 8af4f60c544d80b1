"""compass policy losses inside verl 0.9.1 (compass_kernels.integration.verl).

The contract: compass_grpo / compass_gspo equal verl's own ``vanilla`` /
``gspo`` (value, gradient, metrics) for every loss_agg_mode, with and without
rollout_is_weights and the global batch normalisation; compass_espo equals
``ck.espo.espo_loss`` on the same tokens and a float64 oracle aggregated by
verl's agg_loss; registration is idempotent and version-pinned.
"""

from __future__ import annotations

import inspect
import zlib

import pytest
import torch

import compass_kernels as ck
from compass_kernels.integration import verl as cv
from compass_kernels.integration.verl import _pin
from tests.verl_helpers import F64, actor_config, core_algos, espo_oracle, padded_batch

pytestmark = pytest.mark.integration

VERL = {"grpo": core_algos.compute_policy_loss_vanilla, "gspo": core_algos.compute_policy_loss_gspo}
OURS = {"grpo": cv.compass_grpo_loss, "gspo": cv.compass_gspo_loss}
GLOBAL_INFOS = [
    {},  # local normalisation (dp 1)
    {"dp_size": 2, "batch_num_tokens": 57, "global_batch_size": 13, "loss_scale_factor": 9},
]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    cv.register()
    yield
    cv.unregister()


def _config(info, **kw):
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.5, **kw)
    cfg.global_batch_info.update(info)
    return cfg


@pytest.mark.parametrize("loss_agg_mode", cv.AGG_MODES)
@pytest.mark.parametrize("which", ["grpo", "gspo"])
@pytest.mark.parametrize("info", GLOBAL_INFOS, ids=["local", "global"])
@pytest.mark.parametrize("with_rw", [False, True], ids=["no_rw", "rw"])
def test_equals_verl_loss(loss_agg_mode, which, info, with_rw):
    g = torch.Generator().manual_seed(zlib.crc32(f"{loss_agg_mode}{which}{with_rw}".encode()))
    B, L = 7, 11
    # log-ratios up to ~1.2 so that both clips and the dual clip (c = 2.5) trigger
    old, lp0, adv, mask, rw = padded_batch(g, B, L, spread=0.6)
    rw = rw if with_rw else None
    lp0[0, 0], adv[0], mask[0, 0] = old[0, 0] + 1.5, -abs(adv[0]) - 0.1, True  # a dual clip
    cfg = _config(info)
    lp_v, lp_c = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    loss_v, m_v = VERL[which](old, lp_v, adv, mask, loss_agg_mode, cfg, rw)
    loss_c, m_c = core_algos.get_policy_loss_fn(f"compass_{which}")(
        old_log_prob=old,
        log_prob=lp_c,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        config=cfg,
        rollout_is_weights=rw,
    )
    torch.autograd.backward([loss_v, loss_c])
    assert loss_c.dtype == F64
    torch.testing.assert_close(loss_c, loss_v.to(F64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp_c.grad, lp_v.grad, rtol=1e-12, atol=1e-14)
    assert lp_c.grad[~mask].eq(0).all()
    for k, v in m_v.items():  # verl's names, verl's values (its masked means are float32)
        assert m_c[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    if which == "grpo" and loss_agg_mode == "token-mean" and info:
        assert m_v["actor/pg_clipfrac_lower"] > 0  # the dual clip was exercised
    assert {"actor/compass/clip_frac_low", "actor/compass/kl_k3"} <= set(m_c)


@pytest.mark.parametrize("which", ["grpo", "gspo"])
def test_float32_and_zero_weights(which):
    g = torch.Generator().manual_seed(3)
    old, lp0, adv, mask, rw = padded_batch(g, 6, 9, dtype=torch.float32)
    rw[0, :3] = 0.0  # rejected tokens: no loss, no gradient
    cfg = _config({})
    lp_v, lp_c = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    loss_v, _ = VERL[which](old, lp_v, adv, mask, "token-mean", cfg, rw)
    loss_c, _ = OURS[which](old, lp_c, adv, mask, "token-mean", cfg, rw)
    torch.autograd.backward([loss_v, loss_c])
    assert loss_c.dtype == torch.float32
    torch.testing.assert_close(loss_c, loss_v, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(lp_c.grad, lp_v.grad, rtol=2e-6, atol=1e-7)
    assert lp_c.grad[0, :3].eq(0).all()


def test_bad_inputs_name_the_argument():
    g = torch.Generator().manual_seed(4)
    old, lp, adv, mask, rw = padded_batch(g, 3, 5)
    cfg = _config({})
    with pytest.raises(ValueError, match=r"log_prob: expected a \[B, L\]"):
        cv.compass_grpo_loss(
            old.flatten(), lp.flatten(), adv.flatten(), mask.flatten(), "token-mean", cfg
        )
    with pytest.raises(ValueError, match="advantages: expected shape"):
        cv.compass_grpo_loss(old, lp, adv[:, :2], mask, "token-mean", cfg)
    with pytest.raises(ValueError, match="loss_agg_mode: expected one of"):
        cv.compass_grpo_loss(old, lp, adv, mask, "seq-mean", cfg)
    with pytest.raises(ValueError, match="rollout_is_weights: expected non-negative"):
        cv.compass_grpo_loss(old, lp, adv, mask, "token-mean", cfg, -rw)
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        cv.compass_grpo_loss(old, lp, adv, mask, "token-mean", _config({"dp_size": 2}))


# ------------------------------------------------------------------ ESPO


def _espo_inputs(seed, B=6, L=13):
    g = torch.Generator().manual_seed(seed)
    old, lp, adv, mask, rw = padded_batch(g, B, L, spread=0.05)
    ent = torch.rand(B, L, generator=g, dtype=F64) * 4
    return old, lp, adv, mask, rw, ent


def test_espo_policy_loss_equals_espo_loss_on_the_same_tokens():
    old, lp0, adv, mask, _, ent = _espo_inputs(5)
    lp_pad = lp0.clone().requires_grad_()
    loss, metrics = cv.espo_policy_loss(old, lp_pad, adv, mask, ent, vocab_size=50)
    loss.backward()
    # the packed batch of the valid tokens, one advantage per sequence
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    lens = torch.tensor([int(mask[i].sum()) for i in rows])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    lp_pk = lp0[mask].clone().requires_grad_()
    ref, ref_m = ck.espo.espo_loss(lp_pk, old[mask], ent[mask], adv[rows, 0], cu, vocab_size=50)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp_pad.grad[mask], lp_pk.grad, rtol=1e-12, atol=1e-14)
    assert lp_pad.grad[~mask].eq(0).all()
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(ref_m["clip_frac"]))
    assert metrics["actor/compass/group_token_frac/g1"] == pytest.approx(
        float(ref_m["group_token_frac"][1])
    )


@pytest.mark.parametrize("loss_agg_mode", cv.AGG_MODES)
@pytest.mark.parametrize("info", GLOBAL_INFOS, ids=["local", "global"])
def test_espo_every_aggregation_matches_oracle(loss_agg_mode, info):
    old, lp0, adv, mask, rw, ent = _espo_inputs(6)
    cfg = _config(info)
    lp_c, lp_o = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    loss, _ = cv.espo_policy_loss(
        old,
        lp_c,
        adv,
        mask,
        ent,
        loss_agg_mode=loss_agg_mode,
        config=cfg,
        vocab_size=50,
        rollout_is_weights=rw,
    )
    ref = espo_oracle(
        old, lp_o, adv, mask, ent, rw, loss_agg_mode, dict(info), rho=0.2, alpha=0.02, vocab=50
    )
    torch.autograd.backward([loss, ref])
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(lp_c.grad, lp_o.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["compass_grpo", "compass_espo"])
@pytest.mark.parametrize("loss_agg_mode", cv.AGG_MODES)
def test_data_parallel_invariance(name, loss_agg_mode):
    """Two ranks with verl's global batch info give, averaged, the one-rank gradient."""
    old, lp0, adv, mask, rw, ent = _espo_inputs(7, B=8)
    thr = torch.quantile(ent[mask], 0.8).reshape(1)
    info = {
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": int(mask.any(-1).sum()),
        "loss_scale_factor": 13,
    }
    fn = cv.LOSS_NAMES[name]

    def run(rows, dp):
        lp = lp0[rows].clone().requires_grad_()
        with cv.old_entropy_context(ent[rows], thr):
            loss, _ = fn(
                old[rows],
                lp,
                adv[rows],
                mask[rows],
                loss_agg_mode,
                _config({**info, "dp_size": dp}),
                rw[rows],
            )
        loss.backward()
        return loss, lp.grad

    cv.ESPO_OPTIONS.vocab_size = 50
    try:
        whole, g_whole = run(slice(None), 1)
        (l0, g0), (l1, g1) = run(slice(0, 4), 2), run(slice(4, 8), 2)
    finally:
        cv.ESPO_OPTIONS.vocab_size = None
    torch.testing.assert_close((l0 + l1) / 2, whole, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(torch.cat([g0, g1]) / 2, g_whole, rtol=1e-11, atol=1e-13)


def test_compass_espo_without_old_entropy_says_how():
    old, lp, adv, mask, _, _ = _espo_inputs(8)
    with pytest.raises(RuntimeError, match=r"register\(old_entropy=True\)"):
        core_algos.get_policy_loss_fn("compass_espo")(
            old, lp, adv, mask, "token-mean", _config({}), None
        )


# ------------------------------------------------------------ registration


def test_registry_contract():
    cv.register()  # again: idempotent
    assert cv.registered()
    for name, fn in cv.LOSS_NAMES.items():
        assert core_algos.get_policy_loss_fn(name) is fn
        assert list(inspect.signature(fn).parameters) == list(
            inspect.signature(core_algos.compute_policy_loss_vanilla).parameters
        )
    assert core_algos.get_adv_estimator_fn("compass_grpo") is not None
    other = lambda *a, **k: None  # noqa: E731
    core_algos.POLICY_LOSS_REGISTRY["compass_gspo"] = other
    try:
        with pytest.raises(ValueError, match="already holds 'compass_gspo'"):
            cv.register()
    finally:
        core_algos.POLICY_LOSS_REGISTRY["compass_gspo"] = cv.compass_gspo_loss
    cv.unregister()
    assert "compass_grpo" not in core_algos.POLICY_LOSS_REGISTRY
    assert not cv.registered()
    cv.register()
    assert cv.registered()


def test_version_and_source_pins_fail_loudly(monkeypatch):
    import verl

    original = core_algos.compute_policy_loss_vanilla

    def changed(*args, **kwargs):  # a different upstream body
        return original(*args, **kwargs)

    monkeypatch.setattr(core_algos, "compute_policy_loss_vanilla", changed)
    with pytest.raises(cv.VerlVersionError, match="compute_policy_loss_vanilla changed"):
        cv.register()
    monkeypatch.setattr(core_algos, "compute_policy_loss_vanilla", original)
    monkeypatch.setattr(verl, "__version__", "0.8.4")
    with pytest.raises(cv.VerlVersionError, match="needs verl >= 0.9"):
        cv.register()
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(cv.VerlVersionError, match="0.9.2 was not reviewed"):
        _pin.check("losses")


def test_espo_threshold_width_must_match_the_options():
    old, lp, adv, mask, _, ent = _espo_inputs(9)
    with pytest.raises(ValueError, match="entropy_threshold: expected 1 boundaries"):
        cv.espo_policy_loss(
            old, lp, adv, mask, ent, vocab_size=50, entropy_threshold=torch.ones(6, 2, dtype=F64)
        )
