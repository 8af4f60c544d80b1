"""verl's sequence balancing by ck.packing.plan, on verl's own inputs.

get_seqlen_balanced_partitions: verl's return contract, and the largest
partition never above verl's Karmarkar-Karp's (on verl's workloads,
calculate_workload of random lengths, both modes). rearrange_micro_batches:
verl's return, the token cap, the VPP multiple, forced groups, and the same
micro-batch count on every data-parallel rank (two ranks in threads over a
simulated all-reduce). patch / revert reach verl's prepare_micro_batches.
"""

from __future__ import annotations

import threading

import pytest
import torch

from compass_kernels.integration.verl import balancing as bal
from tests.verl_helpers import verl  # noqa: F401  (the verl import guard)

pytest.importorskip("verl", reason="verl (the `verl` extra, scripts/setup_env.sh)")

from verl.utils import seqlen_balancing as sb  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine import utils as engine_utils  # noqa: E402

pytestmark = pytest.mark.integration


def _max_load(values, parts):
    return max(sum(values[i] for i in p) for p in parts)


@pytest.mark.parametrize("equal_size", [True, False])
def test_partitions_never_worse_than_verl_kk(equal_size):
    g = torch.Generator().manual_seed(int(equal_size))
    for trial in range(60):
        k = int(torch.randint(1, 17, (1,), generator=g))
        n = int(torch.randint(k, 260, (1,), generator=g))
        if equal_size:
            n = n // k * k
        lengths = torch.randint(1, 8192, (n,), generator=g)
        values = sb.calculate_workload(lengths).tolist() if trial % 3 else lengths.tolist()
        ours = bal.get_seqlen_balanced_partitions(values, k, equal_size)
        theirs = sb.get_seqlen_balanced_partitions(values, k, equal_size)
        assert len(ours) == k and all(ours) and all(p == sorted(p) for p in ours)
        assert sorted(i for p in ours for i in p) == list(range(n))
        assert all(isinstance(i, int) for p in ours for i in p)
        if equal_size:
            assert {len(p) for p in ours} == {n // k}
        assert _max_load(values, ours) <= _max_load(values, theirs), (n, k)


def test_partitions_bad_input():
    with pytest.raises(ValueError, match="k_partitions = 4"):
        bal.get_seqlen_balanced_partitions([3, 4, 5], 4, False)
    with pytest.raises(ValueError, match="not divisible"):
        bal.get_seqlen_balanced_partitions([3, 4, 5], 2, True)
    with pytest.raises(ValueError, match="lengths >= 1"):
        bal.get_seqlen_balanced_partitions([3, 0, 5], 2, False)


def _batch(lengths, nested=True):
    """A verl micro-batching input: nested input_ids (after left_right_2_no_padding)
    or a dense attention_mask, plus a per-sample field to follow the indices."""
    B = len(lengths)
    if nested:
        ids = torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)
        return tu.get_tensordict({"input_ids": ids, "sample": torch.arange(B)})
    S = max(lengths)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    return tu.get_tensordict(
        {
            "input_ids": torch.zeros(B, S, dtype=torch.long),
            "attention_mask": mask,
            "sample": torch.arange(B),
        }
    )


@pytest.mark.parametrize("nested", [True, False])
def test_rearrange_micro_batches_contract(nested):
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        n = int(torch.randint(4, 70, (1,), generator=g))
        lengths = torch.randint(1, 900, (n,), generator=g).tolist()
        vpp = [None, 2, 3][trial % 3]
        force = 2 if (trial % 4 == 1 and n % 2 == 0) else 1
        cap = max(lengths) * force + int(torch.randint(0, 1500, (1,), generator=g))
        kw = dict(max_token_len=cap, num_batches_divided_by=vpp, force_group_size=force)
        mbs, idx = bal.rearrange_micro_batches(_batch(lengths, nested), **kw)
        assert sorted(i for p in idx for i in p) == list(range(n))
        assert len(mbs) == len(idx) and all(idx)
        assert len(idx) % (vpp or 1) == 0
        for mb, part in zip(mbs, idx, strict=True):
            assert sum(lengths[i] for i in part) <= cap
            assert mb["sample"].tolist() == part
            if force == 2:
                assert all(part.count(i ^ 1) for i in part)  # pairs together
        _, ref_idx = sb.rearrange_micro_batches(_batch(lengths, nested), **kw)
        assert len(idx) <= len(ref_idx)  # never more micro-batches than verl's loop


def test_rearrange_min_micro_batches_and_errors():
    lengths = [5, 9, 3, 7, 2, 8]
    _, idx = bal.rearrange_micro_batches(_batch(lengths), max_token_len=100, min_num_micro_batch=4)
    assert len(idx) == 4
    with pytest.raises(ValueError, match="max_token_len: 8 < the sequence length 9"):
        bal.rearrange_micro_batches(_batch(lengths), max_token_len=8)
    with pytest.raises(ValueError, match="force_group_size: 4 does not divide"):
        bal.rearrange_micro_batches(_batch(lengths), max_token_len=100, force_group_size=4)
    with pytest.raises(ValueError, match="a forced group of 14 tokens exceeds"):
        bal.rearrange_micro_batches(_batch(lengths), max_token_len=13, force_group_size=2)


def test_same_micro_batch_count_on_every_rank(monkeypatch):
    """Two DP ranks (threads) whose own plans need 1 and 6 micro-batches both get 6."""
    barrier = threading.Barrier(2)
    slots: dict[int, list[int]] = {}
    lock = threading.Lock()

    def all_reduce(value, op, dp_group):
        with lock:
            slots.setdefault(threading.get_ident(), []).append(value)
        barrier.wait()
        vals = [v[-1] for v in slots.values()]
        barrier.wait()
        return max(vals) if op == torch.distributed.ReduceOp.MAX else min(vals)

    monkeypatch.setattr(bal, "_all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    ranks = {0: [10, 20, 30, 5, 7, 9], 1: [90, 95, 99, 97, 93, 91]}
    out = {}

    def run(r):
        out[r] = bal.rearrange_micro_batches(_batch(ranks[r]), max_token_len=100, dp_group=object())

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out[0][1]) == len(out[1][1]) == 6
    for r, (_, idx) in out.items():
        assert all(sum(ranks[r][i] for i in p) <= 100 for p in idx)


def test_patch_reaches_verl_prepare_micro_batches():
    orig_rearrange, orig_parts = sb.rearrange_micro_batches, sb.get_seqlen_balanced_partitions
    assert bal.patch_seqlen_balancing()
    try:
        assert not bal.patch_seqlen_balancing()  # idempotent
        assert engine_utils.rearrange_micro_batches is bal.rearrange_micro_batches
        import verl.trainer.ppo.ray_trainer as rt

        assert rt.get_seqlen_balanced_partitions is bal.get_seqlen_balanced_partitions
        lengths = [40, 7, 33, 12, 25, 19, 3]
        data = _batch(lengths)
        tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=60)
        mbs, idx = engine_utils.prepare_micro_batches(data, dp_group=None)
        assert idx == bal.rearrange_micro_batches(_batch(lengths), max_token_len=60)[1]
        assert all(sum(lengths[i] for i in p) <= 60 for p in idx)
    finally:
        assert bal.revert_seqlen_balancing()
    assert not bal.revert_seqlen_balancing()
    assert engine_utils.rearrange_micro_batches is orig_rearrange
    assert sb.get_seqlen_balanced_partitions is orig_parts
