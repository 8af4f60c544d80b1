"""One verl update step on the CPU with a tiny random-weight model, through
verl 0.9.1's own functions, with the compass pieces switched on:

driver: ``RayPPOTrainer._compute_old_log_prob`` (patched: keeps the old
entropy and the batch's entropy-group boundaries) with a worker group whose
``compute_log_prob`` runs the tiny model on verl's no-padding batch;
``ray_trainer.compute_advantage`` with ``adv_estimator="compass_grpo"``;
worker: ``left_right_2_no_padding``, ``prepare_micro_batches`` (patched: the
compass planner), per micro-batch the model, ``no_padding_2_padding`` inside
verl's ``ppo_loss`` (patched: hands compass_espo the micro-batch's old
entropy) with ``policy_loss.loss_mode=compass_espo``, backward, one AdamW step.
That is what ``TrainingWorker.train_mini_batch`` -> ``FSDPEngine.
forward_backward_batch`` runs per mini-batch, minus the FSDP wrapping and
the Ray / torch.distributed plumbing (a GPU job's part; see
examples/verl/README.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compass_kernels.integration import verl as cv
from compass_kernels.integration.verl import balancing, entropy
from tests.verl_helpers import actor_config

pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/setup_env.sh)")

import verl.workers.engine_workers as engine_workers  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import PolicyLossConfig  # noqa: E402
from verl.workers.engine import utils as engine_utils  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

pytestmark = pytest.mark.integration

V, P, R, B, N = 48, 5, 9, 8, 4  # vocab, prompt / response length, responses, per prompt


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).double().eval()


@pytest.fixture(scope="module", autouse=True)
def _compass():
    cv.register(old_entropy=True, balancing=True, espo={"vocab_size": V})
    yield
    cv.unregister()
    cv.ESPO_OPTIONS.vocab_size = None


def _forward(model, micro_batch):
    """verl's model output on a no-padding micro-batch: nested log-probs (and
    entropy) where row t scores token t + 1 (no_padding_2_padding's layout)."""
    ids, pos = micro_batch["input_ids"], micro_batch["position_ids"]
    logps, ents = [], []
    for x, p in zip(ids.unbind(), pos.unbind(), strict=True):
        logits = model(input_ids=x[None], position_ids=p[None]).logits[0]
        logp = torch.log_softmax(logits[:-1], -1)  # float64 here (exact comparisons)
        lp = logp.gather(1, x[1:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        logps.append(torch.cat([lp, lp.new_zeros(1)]))
        ents.append(torch.cat([ent, ent.new_zeros(1)]))
    nest = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return nest(logps), nest(ents)


class _ActorGroup:
    """The actor worker group's compute_log_prob, run here (verl's no-padding input)."""

    def __init__(self, model):
        self.model = model

    def compute_log_prob(self, data):
        with torch.no_grad():
            lp, ent = _forward(self.model, data)
        return tu.get_tensordict(
            {"log_probs": lp, "entropy": ent}, non_tensor_dict={"metrics": {"mfu": 0.0}}
        )


def _rollout_batch(seed):
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, P + 1, (B,), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):  # prompts left-padded, responses right-padded (verl's layout)
        prompts[i, P - p_len[i] :] = torch.randint(1, V, (int(p_len[i]),), generator=g)
        responses[i, : r_len[i]] = torch.randint(1, V, (int(r_len[i]),), generator=g)
        attn[i, P - p_len[i] : P + r_len[i]] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    reward = torch.zeros(B, R)
    reward[torch.arange(B), r_len - 1] = torch.randint(0, 2, (B,), generator=g).float() + 0.5 * (
        torch.arange(B) % 3 == 0
    )
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn,
        "position_ids": pos,
        "response_mask": attn[:, P:],
        "token_level_rewards": reward,
    }
    uid = np.array([f"p{i // N}" for i in range(B)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def _driver(model, seed):
    """fit()'s old-log-prob and advantage steps, as RayPPOTrainer runs them."""
    batch = _rollout_batch(seed)
    trainer = ray_trainer.RayPPOTrainer.__new__(ray_trainer.RayPPOTrainer)
    trainer.actor_rollout_wg = _ActorGroup(model)
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"actor": {}}})
    old, _ = trainer._compute_old_log_prob(batch)
    old.batch.pop("entropys")  # as fit() does
    batch = batch.union(old)
    return ray_trainer.compute_advantage(batch, adv_estimator="compass_grpo", config=AlgoConfig())


def _update(model, batch, loss_mode, max_tokens, loss_agg_mode="token-mean"):
    """The worker's mini-batch: micro-batches by verl's prepare_micro_batches,
    verl's ppo_loss per micro-batch, gradients accumulated (no optimizer step)."""
    data = left_right_2_no_padding(batch.to_tensordict())
    bnt = int(data["response_mask"].sum())
    tu.assign_non_tensor(
        data,
        dp_size=1,
        batch_num_tokens=bnt,
        global_batch_size=B,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=max_tokens,
    )
    micro_batches, indices = engine_utils.prepare_micro_batches(data, dp_group=None)
    cfg = actor_config(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    model.zero_grad()
    losses, metrics = [], []
    for mb in micro_batches:
        lp, _ = _forward(model, mb)
        loss, m = engine_workers.ppo_loss(cfg, {"log_probs": lp}, mb)
        loss.backward()
        losses.append(float(loss))
        metrics.append(m)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return sum(losses), grads, metrics, indices


def test_old_entropy_reaches_the_batch(model):
    batch = _driver(model, 1)
    ent = batch.batch[entropy.OLD_ENTROPY_KEY]
    mask = batch.batch["response_mask"].bool()
    assert ent.shape == (B, R) and ent[mask].gt(0).all()
    thr = batch.batch[entropy.THRESHOLD_KEY]
    assert thr.shape == (B, 1) and thr.dtype == torch.float64
    torch.testing.assert_close(thr[:, 0], torch.quantile(ent[mask].double(), 0.8).expand(B))
    assert "entropys" not in batch.batch.keys()
    adv = batch.batch["advantages"]
    assert adv[~mask].eq(0).all() and adv.abs().sum() > 0


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_update_step_compass_espo_with_planner(model, loss_agg_mode):
    batch = _driver(model, 2)
    lengths = batch.batch["attention_mask"].sum(-1)
    cap = int(lengths.max()) + 3  # several micro-batches
    loss, grads, metrics, indices = _update(model, batch, "compass_espo", cap, loss_agg_mode)
    assert len(indices) > 1 and all(sum(int(lengths[i]) for i in p) <= cap for p in indices)
    assert (
        indices
        == balancing.rearrange_micro_batches(
            left_right_2_no_padding(batch.to_tensordict()), max_token_len=cap
        )[1]
    )  # the compass planner made them
    assert np.isfinite(loss) and grads.abs().sum() > 0
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/compass/group_token_frac/g1"} <= set(
        metrics[0]
    )
    # global normalisation: one micro-batch holding everything gives the same gradient
    loss1, grads1, _, indices1 = _update(model, batch, "compass_espo", 10_000, loss_agg_mode)
    assert len(indices1) == 1
    assert loss == pytest.approx(loss1, rel=1e-10)
    torch.testing.assert_close(grads, grads1, rtol=1e-9, atol=1e-12)
    # and the optimizer step moves the weights
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    with torch.no_grad():
        for a, p in zip(before, model.parameters(), strict=True):
            p.copy_(a)


def test_update_step_compass_grpo_equals_vanilla(model):
    batch = _driver(model, 3)
    cap = int(batch.batch["attention_mask"].sum(-1).max()) + 5
    loss_c, grads_c, m_c, _ = _update(model, batch, "compass_grpo", cap)
    loss_v, grads_v, m_v, _ = _update(model, batch, "vanilla", cap)
    assert loss_c == pytest.approx(loss_v, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grads_c, grads_v, rtol=1e-9, atol=1e-12)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert m_c[0][key].values == pytest.approx(m_v[0][key].values, abs=1e-6)


def test_old_entropy_patch_is_idempotent_reversible_and_pinned(monkeypatch):
    from verl.workers.utils import losses as verl_losses

    from compass_kernels.integration.verl import _pin

    assert entropy.applied() and not entropy.patch_old_entropy()
    patched = ray_trainer.RayPPOTrainer._compute_old_log_prob
    assert entropy.revert_old_entropy() and not entropy.applied()
    assert ray_trainer.RayPPOTrainer._compute_old_log_prob is patched.__wrapped_by_compass__
    assert engine_workers.ppo_loss is verl_losses.ppo_loss
    assert verl_losses.ppo_loss.__name__ == "ppo_loss" and not hasattr(
        verl_losses.ppo_loss, "__wrapped_by_compass__"
    )
    monkeypatch.setitem(
        _pin.UPSTREAM_SOURCE_SHA256["0.9.1"], "verl.workers.utils.losses:ppo_loss", "0"
    )
    with pytest.raises(cv.VerlVersionError, match="ppo_loss changed"):
        entropy.patch_old_entropy()
    monkeypatch.undo()
    assert entropy.patch_old_entropy()


def test_plugin_reads_the_environment(monkeypatch):
    import importlib
    import sys

    monkeypatch.setenv("COMPASS_VERL_PATCHES", "old_entropy,balancing")
    monkeypatch.setenv("COMPASS_VERL_ESPO", f"rho=0.25,vocab_size={V},clip=0.1:0.2")
    monkeypatch.setenv("COMPASS_VERL_ADV", "mode=rloo")
    sys.modules.pop("compass_kernels.integration.verl.plugin", None)
    try:
        importlib.import_module("compass_kernels.integration.verl.plugin")
        assert cv.registered() and entropy.applied() and balancing.applied()
        assert cv.ESPO_OPTIONS.rho == 0.25 and cv.ESPO_OPTIONS.clip == (0.1, 0.2)
        assert cv.advantages.ADV_OPTIONS.mode == "rloo"
        monkeypatch.setenv("COMPASS_VERL_PATCHES", "entropy")
        sys.modules.pop("compass_kernels.integration.verl.plugin", None)
        with pytest.raises(ValueError, match="COMPASS_VERL_PATCHES: unknown"):
            importlib.import_module("compass_kernels.integration.verl.plugin")
    finally:
        cv.register(espo=cv.EspoOptions(vocab_size=V), advantages={"mode": "grpo"})
