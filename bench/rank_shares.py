"""Bytes each trainer rank receives (``compass_kernels.integration.rl.shares.make_shares``)
against a full broadcast of the step's batch, for a DeepSeek-V3-shaped routing trace
(61 layers, 58 MoE from layer 3, 256 experts, top-8, uint8 ids).

``python -m bench.rank_shares [--tokens N] [--seqs N]``: a counted quantity, not a
timing; the ratio is independent of the batch size (routes dominate: 58 x 8 bytes
per token against ~25 bytes of per-token tensors). No process is started: the
shares are built for every rank of the layout from Megatron's rank order.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from compass_kernels.integration.megatron.parallel import Layout, layout_rank_infos

LAYOUTS = {
    "dp8": Layout(dp=8),
    "pp8": Layout(pp=8),
    "pp4 x dp2": Layout(pp=4, dp=2),
    "tp2 x pp4 x cp2 x dp2 (ep8)": Layout(tp=2, pp=4, cp=2, dp=2, ep=8),
}


def main(argv: list[str] | None = None) -> None:
    import compass_kernels as ck
    from compass_kernels.integration.rl.batch import Batch
    from compass_kernels.integration.rl.shares import (
        StepData,
        full_broadcast_bytes,
        make_shares,
        share_bytes,
    )
    from compass_kernels.routing import RoutingTrace

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--len", type=int, default=256, help="tokens per sequence")
    args = ap.parse_args(argv)
    n, s = args.seqs, args.len
    moe = list(range(3, 61))
    rows = n * (s - 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (rows, len(moe), 8), generator=g, dtype=torch.uint8)
    cu = torch.arange(n + 1, dtype=torch.int64) * (s - 1)
    trace = RoutingTrace(ids, cu, 256, layer_ids=moe)
    T = n * s
    lengths = np.full(n, s, dtype=np.int64)
    mask = torch.ones(T, dtype=torch.bool)
    zeros = torch.zeros(T, dtype=torch.int64)
    batch = Batch(
        lengths=lengths,
        prompt_lens=np.ones(n, dtype=np.int64),
        tokens=zeros,
        targets=zeros,
        mask=mask,
        infer_logprobs=torch.zeros(T),
        seq_index=torch.arange(T) // s,
        trace=trace,
    )
    print(f"DeepSeek-V3-shaped trace: {n} x {s} tokens, 58 MoE layers x top-8 (uint8)")
    print(
        f"{'layout':30}{'ranks':>6}{'full MB':>10}{'max rank MB':>13}{'ratio':>8}"
        f"{'kept MB':>9}{'fwd reply KB':>14}{'kept reply KB':>15}"
    )
    for name, lay in LAYOUTS.items():
        plan = ck.packing.plan(lengths, dp_size=lay.dp, max_tokens=4 * s)
        data = StepData(batch, plan, torch.zeros(T), torch.zeros(T), torch.zeros(T))
        infos = layout_rank_infos(lay)
        per = 61 // lay.pp + 1
        stage = [[x for x in moe if i.pp * per <= x < (i.pp + 1) * per] for i in infos]
        if lay.pp * per < 61:
            raise SystemExit("stage split")
        shares = make_shares(data, lay, infos, stage, what="train")
        sent = share_bytes(shares)
        full = full_broadcast_bytes(data, "train")
        # old log-probs / entropy kept on the ranks (forward(keep=), train(use_kept=))
        kept = StepData(batch, plan, None, None, torch.zeros(T))
        sent_kept = share_bytes(make_shares(kept, lay, infos, stage, what="train"))
        # what a last-stage rank sends back from the no-grad pass: every token's
        # log-prob and entropy (float32), or the sums (5 numbers per micro-batch) and
        # per-sequence entropy max / min (2 float64) of the kept forward
        reply = [
            sum(8 * mb.targets.numel() for mb in mbs) if i.last_stage and i.tp == 0 else 0
            for i, mbs in zip(infos, shares, strict=True)
        ]
        reply_kept = [
            sum(40 + 16 * mb.lengths.numel() for mb in mbs) if i.last_stage and i.tp == 0 else 0
            for i, mbs in zip(infos, shares, strict=True)
        ]
        print(
            f"{name:30}{lay.world_size:>6}{full / 1e6:>10.1f}{max(sent) / 1e6:>13.2f}"
            f"{full / max(sent):>8.1f}{max(sent_kept) / 1e6:>9.2f}"
            f"{max(reply) / 1e3:>14.1f}{max(reply_kept) / 1e3:>15.2f}"
        )


if __name__ == "__main__":
    main()
