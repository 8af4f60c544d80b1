"""``compass-rl``'s step on the ranks keeps per-token tensors where they are made:
the old-policy passes' log-probs and entropy, and the RL-ZVP token advantages,
stay on the last-stage ranks; the driver receives gap sums and per-sequence
values (``LoopAdapter``: ``old_policy_pass``, ``token_advantages``, ``train_step``).

- the shared math (``GapSums``, ``zvp_token_advantages``) over any split of the
  tokens (as ranks hold them) equals the whole-batch computation: gap sums to
  float64 rounding, token advantages bitwise (no processes);
- on dp2, cp2 and pp2 ranks: the rank-side gap statistics and token advantages equal
  the driver-side ones computed from the gathered log-probs / entropy (the
  one-process ``Trainer``'s functions and the gathered ``gap_stats`` /
  ``ck.advantages.rl_zvp``), the train step on the kept advantages equals the one
  on driver-sent advantages, and no reply to the driver holds a tensor larger
  than the batch's sequence count.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.integration.rl.batch import (
    GapSums,
    gap_stats,
    zvp_token_advantages,
)

pytestmark = pytest.mark.integration


def _zvp_case(seed: int, n: int = 9):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 12, (n,), generator=g)
    seq = torch.repeat_interleave(torch.arange(n), lens)
    ent = torch.rand(seq.numel(), generator=g) * 3
    mask = torch.rand(seq.numel(), generator=g) < 0.8
    mask[torch.cumsum(lens, 0) - 1] = True  # every sequence has a response token
    rewards = torch.randn(n, generator=g)
    zero_var = torch.rand(n, generator=g) < 0.7
    adv = torch.randn(n, generator=g)
    return g, seq, ent, mask, rewards, zero_var, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zvp_token_advantages_over_a_split_equal_the_whole(seed):
    """Tokens dealt at random to 3 "ranks" (each in its own order): each rank's
    token advantages, given the per-sequence entropy max, add up to rl_zvp over
    the whole sequences bitwise; the nonzero flags OR to the whole's."""
    g, seq, ent, mask, rewards, zero_var, adv = _zvp_case(seed)
    n = rewards.numel()
    lens = torch.bincount(seq[mask], minlength=n)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    want = ck.advantages.rl_zvp(ent[mask], cu, rewards, zero_var, alpha=0.1, advantages=adv)
    whole, nz_whole = zvp_token_advantages(ent, seq, mask, rewards, zero_var, adv, alpha=0.1)
    assert torch.equal(whole[mask], want) and not whole[~mask].any()
    assert torch.equal(
        nz_whole,
        torch.zeros(n, dtype=torch.bool).index_put_((seq[mask],), want != 0, accumulate=True),
    )
    emax = torch.full((n,), -math.inf, dtype=torch.float64)
    emax.scatter_reduce_(0, seq[mask], ent[mask].double(), "amax")
    owner = torch.randint(0, 3, (seq.numel(),), generator=g)
    got = torch.zeros_like(whole)
    nz = torch.zeros(n, dtype=torch.bool)
    for r in range(3):
        mine = (owner == r).nonzero().reshape(-1)
        mine = mine[torch.randperm(mine.numel(), generator=g)]  # any local order
        t, f = zvp_token_advantages(
            ent[mine], seq[mine], mask[mine], rewards, zero_var, adv, alpha=0.1, entropy_max=emax
        )
        got[mine] = t
        nz |= f
    assert torch.equal(got, whole)
    assert torch.equal(nz, nz_whole)
    # the global max matters: a rank's own max would give other values
    assert zero_var.any() and (rewards[zero_var] <= 0).any()


def test_zvp_token_advantages_checks_its_arguments():
    _, seq, ent, mask, rewards, zero_var, adv = _zvp_case(0)
    with pytest.raises(ValueError, match="entropy_max"):
        zvp_token_advantages(
            ent, seq, mask, rewards, zero_var, adv, alpha=0.1, entropy_max=torch.zeros(3)
        )
    with pytest.raises(ValueError, match="seq"):
        zvp_token_advantages(ent, seq, mask, rewards[:-1], zero_var[:-1], adv[:-1], alpha=0.1)
    emax = torch.zeros(rewards.numel())
    emax[0] = math.nan  # a sequence with tokens here needs a finite max
    with pytest.raises(ValueError, match="entropy"):
        zvp_token_advantages(ent, seq, mask, rewards, zero_var, adv, alpha=0.1, entropy_max=emax)


def test_gap_sums_over_a_split_equal_gap_stats():
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(1001, generator=g) * 4
    infer = train + torch.randn(1001, generator=g)
    want = gap_stats(train, infer)
    parts = [
        GapSums.of(a, b) for a, b in zip(train.tensor_split(4), infer.tensor_split(4), strict=True)
    ]
    got = sum(parts, GapSums()).stats()
    assert got.tokens == want.tokens == 1001 and 0 < got.frac_gt_ln2 < 1
    assert got.max_abs == want.max_abs and got.frac_gt_ln2 == want.frac_gt_ln2
    for k in ("mean_abs", "k3"):
        assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-13), k
    d = train.double() - infer.double()
    assert want.k3 == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-12)
    assert math.isnan(GapSums().stats().mean_abs) and GapSums().stats().tokens == 0


# ---------------------------------------------------------------------------
# On ranks (gloo processes on the CPU)
# ---------------------------------------------------------------------------


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, np.ndarray):
        yield torch.from_numpy(x)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name))


def _token_index(lengths: np.ndarray, idx: np.ndarray) -> torch.Tensor:
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return torch.from_numpy(np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2", "cp2", "pp2"])
def test_step_stays_on_the_ranks(name):
    pytest.importorskip("megatron.core")
    from transformers import AutoConfig

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe
    from compass_kernels.integration.megatron.parallel import Layout
    from compass_kernels.integration.rl.layout_check import synthetic_batch
    from compass_kernels.integration.rl.loop_adapter import LoopAdapter

    layout = {"dp2": Layout(dp=2), "cp2": Layout(cp=2), "pp2": Layout(pp=2)}[name]
    path = cached_tiny_qwen3_moe(num_hidden_layers=4)
    cfg = AutoConfig.from_pretrained(path)
    batch, _ = synthetic_batch(cfg, num_sequences=8, seed=3)
    g = torch.Generator().manual_seed(7)
    infer = -torch.rand(batch.num_tokens, generator=g) * 8  # engine log-probs, far and near
    batch = dataclasses.replace(batch, infer_logprobs=torch.where(batch.mask, infer, 0.0))
    n = batch.num_sequences
    rewards = torch.tensor([1.0, 1.0, -0.5, -0.5, 0.3, -0.2, 0.0, 0.0])
    zero_var = torch.tensor([True, True, True, True, False, False, True, True])
    adv = torch.where(zero_var, 0.0, torch.randn(n, generator=g))

    trainer = LoopAdapter(path, layout, lr=0.0)  # lr 0: two train steps from the same weights
    replies = []
    command = trainer.distributed._command

    def spy(cmd, args):
        out = command(cmd, args)
        replies.append((cmd, out))
        return out

    try:
        pack = trainer.pack(batch, dp_size=layout.dp, max_tokens=64)
        trainer.distributed._command = spy
        old = trainer.old_policy_pass(pack)
        nonzero = trainer.token_advantages(pack, rewards, zero_var, adv, alpha=0.1)
        m_kept = trainer.train_step(pack, num_sequences=n)
        trainer.distributed._command = command
        rx = dict(trainer.rx_bytes)
        data = trainer._data
        kept = {k: trainer.distributed.kept_values(data, k) for k in ("replay", "native")}
        trainer.distributed._command = spy
        gathered = trainer.distributed.forward(data)  # the gather the loop no longer does
        trainer.distributed._command = command
        gathered_reply = replies.pop()[1]
        # the same step on driver-sent token advantages (sample order)
        data.advantages = kept["replay"]["advantages"]
        m_sent = trainer.distributed.train(data, num_sequences=n, use_kept="replay")
    finally:
        trainer.close()

    # (b) the driver received scalars and [sequences]-sized tensors only
    cmds = [c for c, _ in replies]
    assert cmds == ["forward", "forward", "token_advantages", "train"], cmds
    sizes = [t.numel() for _, out in replies for t in _tensors(out)]
    assert sizes and max(sizes) <= n, sizes
    assert m_kept["bytes_driver_rx"] == sum(rx.values())
    assert set(rx) == {"forward", "token_advantages", "train"}, rx
    # the gather the loop used to do holds per-token tensors: the size check would see them
    assert max(t.numel() for t in _tensors(gathered_reply)) > 2 * n
    assert torch.equal(gathered["logprobs"], kept["replay"]["logprobs"])  # a kept pass

    # (a) rank-side == driver-side on the gathered tensors
    mask = batch.mask
    for key, pass_ in (("gap_replay", "replay"), ("gap_native", "native")):
        got = old[key]
        want = gap_stats(kept[pass_]["logprobs"][mask], batch.infer_logprobs[mask])
        assert got.tokens == want.tokens == int(mask.sum())
        assert got.max_abs == want.max_abs and got.frac_gt_ln2 == want.frac_gt_ln2
        assert 0 < want.frac_gt_ln2 < 1
        for k in ("mean_abs", "k3"):
            assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-12), (key, k)
    ent = kept["replay"]["entropy"]
    resp = mask.sum().item()
    lens = torch.bincount(batch.seq_index[mask], minlength=n)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    want_tok = ck.advantages.rl_zvp(ent[mask], cu, rewards, zero_var, alpha=0.1, advantages=adv)
    got_tok = kept["replay"]["advantages"]
    assert want_tok.numel() == resp
    assert torch.equal(got_tok[mask], want_tok) and not got_tok[~mask].any()
    want_nz = torch.zeros(n, dtype=torch.bool).index_put_(
        (batch.seq_index[mask],), want_tok != 0, accumulate=True
    )
    assert torch.equal(nonzero, want_nz)
    assert (rewards[zero_var] <= 0).any()  # the entropy-max branch ran
    # the entropy-group boundaries the ranks selected among themselves: exactly the
    # gathered entropy's quantiles
    from compass_kernels.espo import loss_config
    from compass_kernels.espo.loss import entropy_thresholds

    levels = loss_config.resolve(vocab_size=cfg.vocab_size).levels
    resp_ent = ent[mask]
    want_thr = entropy_thresholds(resp_ent, torch.tensor([0, resp_ent.numel()]), levels=levels)
    assert len(levels) >= 1 and torch.equal(m_kept["entropy_threshold"], want_thr.reshape(-1))
    # the step on the kept advantages is the step on the sent ones
    assert m_kept["loss"] != 0.0
    assert m_kept["loss"] == pytest.approx(m_sent["loss"], rel=1e-12, abs=0)
    assert m_kept["grad_norm"] == pytest.approx(m_sent["grad_norm"], rel=1e-12)


@pytest.mark.slow
def test_kept_advantages_with_a_padding_micro_batch():
    """3 sequences on dp2 through the loop's trainer (``LoopAdapter.pack`` plans with
    ``plan_or_pad``: one rank runs a zero-token micro-batch): the packing checks pass,
    the RL-ZVP inputs, flags and kept advantages line up around it, and the step trains
    on them."""
    pytest.importorskip("megatron.core")
    from transformers import AutoConfig

    from compass_kernels.integration.cpu.tiny_moe import cached_tiny_qwen3_moe
    from compass_kernels.integration.megatron.parallel import Layout
    from compass_kernels.integration.rl.layout_check import synthetic_batch
    from compass_kernels.integration.rl.loop_adapter import LoopAdapter

    path = cached_tiny_qwen3_moe(num_hidden_layers=4)
    batch, _ = synthetic_batch(
        AutoConfig.from_pretrained(path), num_sequences=3, seed=5, min_len=20, max_len=24
    )
    rewards = torch.tensor([-1.0, 0.5, 0.25])
    zero_var = torch.tensor([True, True, False])
    adv = torch.tensor([0.0, 0.0, 0.7])
    trainer = LoopAdapter(path, Layout(dp=2), lr=1e-3)
    try:
        pack = trainer.pack(batch, dp_size=2, max_tokens=30)
        assert pack.plan.empty_micro_batches == 1 and pack.stats["micro_batches"] == 2
        assert (pack.lost, pack.duplicated, pack.token_mismatch) == (0, 0, 0)
        assert len(pack.micro_batches) == 3  # the empty one is not packed on the driver
        trainer.old_policy_pass(pack)
        nonzero = trainer.token_advantages(pack, rewards, zero_var, adv, alpha=0.1)
        kept = trainer.distributed.kept_values(trainer._data, "replay")
        m = trainer.train_step(pack, num_sequences=3)
    finally:
        trainer.close()
    mask = batch.mask
    lens = torch.bincount(batch.seq_index[mask], minlength=3)
    cu = torch.zeros(4, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    want = ck.advantages.rl_zvp(
        kept["entropy"][mask], cu, rewards, zero_var, alpha=0.1, advantages=adv
    )
    assert torch.equal(kept["advantages"][mask], want)
    assert nonzero.tolist() == [True, True, True]
    assert math.isfinite(m["loss"]) and m["loss"] != 0.0 and m["grad_norm"] > 0
