"""Context parallelism: ck.espo.espo_loss over 2 gloo processes, each holding
half of every sequence, equals one process holding the whole batch (the
quantile over the gathered entropies, the group sums and the metrics reduced
over the CP group; each rank's loss is its part, the gradients exact)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import compass_kernels as ck
from compass_kernels.testing import assert_verbose_allclose, make_generator

CONFIGS = {
    "espo": dict(vocab_size=1000),
    "espo_seq_k3": dict(vocab_size=1000, grouping="sequence", num_groups=3, drop_low=True),
    "gspo": dict(mode="gspo", clip=(0.02, 0.03)),
    "grpo": dict(mode="grpo", dual_clip=2.0),
}


def make_batch(seed: int = 0, n: int = 9):
    """Even sequence lengths (split in two halves), per-token advantages and a mask."""
    g = make_generator(seed)
    lengths = torch.randint(0, 30, (n,), generator=g) * 2
    cu = torch.zeros(n + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1])
    old = -torch.rand(total, generator=g) * 3
    lp = old + 0.1 * torch.randn(total, generator=g)
    ent = torch.rand(total, generator=g) * 4
    adv = torch.randn(n, generator=g)
    mask = torch.rand(total, generator=g) > 0.1
    return lp, old, ent, adv, cu, mask


def shard(batch, rank: int):
    """Rank r's tokens: the r-th half of every sequence, packed; the global index of each."""
    lp, old, ent, adv, cu, mask = batch
    idx = []
    for i in range(cu.numel() - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        half = (b - a) // 2
        idx.append(torch.arange(a + rank * half, a + (rank + 1) * half))
    idx = torch.cat(idx)
    lengths = cu.diff() // 2
    local_cu = torch.zeros_like(cu)
    local_cu[1:] = lengths.cumsum(0)
    return (lp[idx], old[idx], ent[idx], adv, local_cu, mask[idx]), idx


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        batch = make_batch()
        (lp, old, ent, adv, cu, mask), _ = shard(batch, rank)
        results = {}
        for name, cfg in CONFIGS.items():
            x = lp.clone().requires_grad_()
            loss, metrics = ck.espo.espo_loss(
                x, old, ent, adv, cu, mask, cp_group=dist.group.WORLD, **cfg
            )
            loss.backward()
            results[name] = (loss.detach(), x.grad, {k: v.clone() for k, v in metrics.items()})
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_cp2_equals_one_process(cp_results, config):
    batch = make_batch()
    lp, old, ent, adv, cu, mask = batch
    x = lp.clone().requires_grad_()
    loss, metrics = ck.espo.espo_loss(x, old, ent, adv, cu, mask, **CONFIGS[config])
    loss.backward()
    parts = [cp_results[r][config] for r in range(2)]
    assert_verbose_allclose(parts[0][0] + parts[1][0], loss.detach(), atol=1e-7, rtol=1e-6)
    grad = torch.zeros_like(lp)
    for r in range(2):
        _, idx = shard(batch, r)
        grad[idx] = parts[r][1]
    assert_verbose_allclose(grad, x.grad, atol=1e-10, rtol=1e-5, name="grad")
    for r in range(2):
        for key, value in metrics.items():
            assert_verbose_allclose(parts[r][2][key], value, atol=1e-7, rtol=1e-6, name=key)
    assert float(metrics["clip_frac"]) > 0
