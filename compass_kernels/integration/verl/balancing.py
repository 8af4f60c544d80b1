"""verl's sequence balancing by ``ck.packing.plan``.

- :func:`get_seqlen_balanced_partitions`: verl's signature and return type
  (k lists of ascending indices); the planner's rank pass (LPT with exchange
  refinement to the lower bound, a Karmarkar-Karp candidate where the bound
  is missed, the better kept): its largest partition never exceeds verl's
  Karmarkar-Karp's (tested on verl's own inputs and function).
- :func:`rearrange_micro_batches`: verl's signature and return
  ``(micro_batches, indices)``: one rank's micro-batches under the token cap
  ``max_token_len``, the same count on every data-parallel rank (an
  all-reduce MAX of the counts, then a re-plan to exactly that count, as
  verl's loop does), a multiple of ``num_batches_divided_by`` (virtual
  pipeline), ``force_group_size`` consecutive samples kept together.
- :func:`patch_seqlen_balancing` / :func:`revert_seqlen_balancing`: put both in
  verl's place (its module and every verl module that imported the names).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import torch

import compass_kernels as ck

from . import _pin, probe

__all__ = [
    "applied",
    "get_seqlen_balanced_partitions",
    "patch_seqlen_balancing",
    "rearrange_micro_batches",
    "revert_seqlen_balancing",
]


def get_seqlen_balanced_partitions(seqlen_list, k_partitions: int, equal_size: bool):
    """Partition indices of ``seqlen_list`` into ``k_partitions`` lists with
    balanced sums (verl's signature and return type).

    Parameters
    ----------
    seqlen_list : list[int] (or 1-d int array / tensor) of positive lengths or
        workloads (verl passes ``calculate_workload``'s 24576*L + L^2).
    k_partitions : number of partitions (<= len(seqlen_list)).
    equal_size : every partition gets len / k items (len must be divisible by k).

    Returns
    -------
    list of k lists of int, each ascending, together a permutation of
    range(len(seqlen_list)); none empty.
    """
    values = np.asarray(
        seqlen_list.tolist() if isinstance(seqlen_list, torch.Tensor) else seqlen_list
    )
    n = values.size
    probe.hit("partitions")
    if not isinstance(k_partitions, int | np.integer) or k_partitions < 1:
        raise ValueError(f"k_partitions: expected a positive int, got {k_partitions!r}")
    if n < k_partitions:
        raise ValueError(f"seqlen_list: {n} items < k_partitions = {k_partitions}")
    if equal_size and n % k_partitions:
        raise ValueError(
            f"equal_size: {n} items are not divisible by k_partitions = {k_partitions}"
        )
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"seqlen_list: expected integer lengths, got {values.dtype}{values.shape}")
    if n and values.min() < 1:
        raise ValueError(f"seqlen_list: expected lengths >= 1, got {int(values.min())}")
    values = values.astype(np.int64)
    k = int(k_partitions)
    plan = ck.packing.plan(
        values, dp_size=k, max_tokens=int(values.sum()), equal_samples=bool(equal_size)
    )
    parts = [sorted(plan.rank_indices(r).tolist()) for r in range(k)]
    if equal_size:  # the planner's own equal-size Karmarkar-Karp candidate covers this mode
        return parts
    # Unequal mode: the planner seeds only equal-size KK, and verl's unequal KK
    # sometimes ends a few units lower. Where the planner misses the lower bound
    # (nothing can beat it), verl's KK is a second candidate and the better is
    # kept: never worse than verl by construction. verl's trainer balances ranks
    # in equal mode; its unequal caller (rearrange_micro_batches) is replaced by
    # rearrange_micro_batches below, which does not come here.
    rank_cost = np.asarray(plan.stats["rank_cost"])  # an array (no copy)
    if rank_cost.max() > max(-(-int(values.sum()) // k), int(values.max())):
        from verl.utils.seqlen_balancing import karmarkar_karp

        other = karmarkar_karp(values.tolist(), k, False)
        if max(int(values[p].sum()) for p in other) < rank_cost.max():
            return [sorted(p) for p in other]
    return parts


def _all_reduce(value: int, op, dp_group) -> int:
    import torch.distributed as dist
    from verl.utils.device import get_device_name

    t = torch.tensor([value], device=get_device_name())
    dist.all_reduce(t, op=op, group=dp_group)
    return int(t.cpu().item())


def rearrange_micro_batches(
    batch,
    max_token_len,
    dp_group=None,
    num_batches_divided_by=None,
    same_micro_num_in_dp=True,
    min_num_micro_batch=None,
    use_dynamic_bsz_balance=True,
    force_group_size=1,
):
    """Split one rank's batch into micro-batches under ``max_token_len`` tokens
    (verl's ``rearrange_micro_batches``, same arguments and return).

    Parameters
    ----------
    batch : TensorDict with nested "input_ids" (lengths from its offsets) or
        "attention_mask" [B, S] (lengths = its row sums).
    max_token_len : the cap on a micro-batch's tokens.
    dp_group : with torch.distributed initialised and same_micro_num_in_dp, every
        rank of this group gets the same number of micro-batches.
    num_batches_divided_by : the count is a multiple of this (Megatron VPP).
    min_num_micro_batch : at least this many (pipeline parallelism).
    use_dynamic_bsz_balance : order micro-batches as verl does (by workload,
        lighter ones at both ends, for pipeline bubbles).
    force_group_size : consecutive samples of this size stay in one micro-batch.

    Returns
    -------
    (list of TensorDict, list of list of int): the micro-batches and, for each,
    the ascending indices of its samples in ``batch``.
    """
    probe.hit("micro_batches")
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import calculate_workload

    input_ids = batch["input_ids"]
    if input_ids.is_nested:
        lengths = input_ids.offsets().diff()
        max_seq_len = int(lengths.max())
    else:
        max_seq_len = batch["attention_mask"].shape[-1]
        lengths = batch["attention_mask"].sum(dim=1)
    if max_token_len < max_seq_len:
        raise ValueError(f"max_token_len: {max_token_len} < the sequence length {max_seq_len}")
    lengths = lengths.detach().cpu().to(torch.int64).numpy()
    n = lengths.size
    if force_group_size < 1 or n % force_group_size:
        raise ValueError(f"force_group_size: {force_group_size} does not divide the batch size {n}")
    num_groups = n // force_group_size
    # forced groups are the planner's items (its group_ids keep a group on one
    # rank, not in one micro-batch): plan their summed lengths, expand after
    items = (
        lengths.reshape(num_groups, force_group_size).sum(1) if force_group_size > 1 else lengths
    )
    if items.max() > max_token_len:
        raise ValueError(
            f"force_group_size: a forced group of {int(items.max())} tokens exceeds max_token_len "
            f"= {max_token_len} and cannot be split"
        )
    vpp = int(num_batches_divided_by or 1)
    sync = dist.is_initialized() and same_micro_num_in_dp and dp_group is not None
    floor = -(-int(min_num_micro_batch) // vpp) * vpp if min_num_micro_batch else 0
    multiple = vpp
    while True:
        plan = ck.packing.plan(
            items, dp_size=1, max_tokens=int(max_token_len), micro_batch_multiple=multiple
        )
        want = max(plan.num_micro_batches, floor)
        if sync:
            want = _all_reduce(want, dist.ReduceOp.MAX, dp_group)
        done = plan.num_micro_batches == want
        if sync:
            done = bool(_all_reduce(int(done), dist.ReduceOp.MIN, dp_group))
        if done:
            break
        if want > num_groups:
            raise ValueError(
                f"cannot give every data-parallel rank {want} non-empty micro-batches: this rank "
                f"has {num_groups} (groups of) samples"
            )
        multiple = want  # the count is a multiple of it and at most it: exactly it
    indices = [plan.micro_batch(0, j).tolist() for j in range(plan.num_micro_batches)]
    if force_group_size > 1:
        f = force_group_size
        indices = [[g * f + m for g in part for m in range(f)] for part in indices]
    if use_dynamic_bsz_balance:
        work = calculate_workload(torch.from_numpy(lengths)).tolist()
        indices.sort(key=lambda part: (sum(work[i] for i in part), part[0]), reverse=True)
        indices = indices[::2][::-1] + indices[1::2]
    return [tu.index_select_tensor_dict(batch, idx) for idx in indices], indices


_LOCK = threading.Lock()
_PATCHED: list[tuple[Any, str, Any]] = []  # (module, name, original)


def patch_seqlen_balancing() -> bool:
    """Replace verl's ``get_seqlen_balanced_partitions`` and
    ``rearrange_micro_batches`` in ``verl.utils.seqlen_balancing`` and in every
    loaded verl module that imported them by name (the trainer, the engines'
    ``prepare_micro_batches``). Idempotent; True if this call patched.

    Raises
    ------
    VerlVersionError
        If verl is not the reviewed version or a replaced function changed.
    """
    _pin.check("balancing")
    import verl.trainer.ppo.ray_trainer  # noqa: F401  (import the users before scanning)
    import verl.utils.seqlen_balancing as sb
    import verl.workers.engine.utils  # noqa: F401

    with _LOCK:
        if _PATCHED:
            return False
        ours = {
            "get_seqlen_balanced_partitions": get_seqlen_balanced_partitions,
            "rearrange_micro_batches": rearrange_micro_batches,
        }
        originals = {name: getattr(sb, name) for name in ours}
        for name, orig in originals.items():
            _pin.ORIGINALS[f"verl.utils.seqlen_balancing:{name}"] = orig
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
                continue
            for name, orig in originals.items():
                if getattr(mod, name, None) is orig:
                    _PATCHED.append((mod, name, orig))
                    setattr(mod, name, ours[name])
        return True


def revert_seqlen_balancing() -> bool:
    """Undo :func:`patch_seqlen_balancing`; True if it was applied."""
    with _LOCK:
        if not _PATCHED:
            return False
        for mod, name, orig in _PATCHED:
            setattr(mod, name, orig)
        _PATCHED.clear()
        for name in ("get_seqlen_balanced_partitions", "rearrange_micro_batches"):
            _pin.ORIGINALS.pop(f"verl.utils.seqlen_balancing:{name}", None)
        return True


def applied() -> bool:
    """Whether :func:`patch_seqlen_balancing` is in place."""
    return bool(_PATCHED)
