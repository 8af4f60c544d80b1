"""The trainer ranks' core attention (``megatron.thd_attention.ThdDotProductAttention``)
against one reference: float64 causal attention of each whole sequence alone, on
fresh random q / k / v of odd sequence lengths (GQA), outputs and gradients, for
cp = 1 and for cp = 2 (two gloo processes, each holding its ``ck.packing`` zigzag
rows of every sequence)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

HEADS, GROUPS, DIM = 4, 2, 8


def _reference(q, k, v, lengths):
    """Per sequence: softmax(q k^T / sqrt(d) + causal) v in float64, GQA groups repeated;
    q, k, v [T, heads or groups, d] over the concatenated (padded) sequences."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs, lo = [], 0
    for n in lengths:
        qs, ks, vs = (x[lo : lo + n].double().transpose(0, 1) for x in (q, k, v))
        s = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        outs.append((s.softmax(-1) @ vs).transpose(0, 1).reshape(n, -1))
        lo += n
    return torch.cat(outs)


def _inputs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    t = int(sum(lengths))
    q = torch.randn(t, HEADS, DIM, generator=g)
    k = torch.randn(t, GROUPS, DIM, generator=g)
    v = torch.randn(t, GROUPS, DIM, generator=g)
    dout = torch.randn(t, HEADS * DIM, generator=g)
    return q, k, v, dout


def _attention_rank(rank, world_size, path, lengths, seed):
    """One rank: its zigzag rows of q / k / v / d out (``ck.packing.pack``), the
    attention forward and backward; returns its output and gradients (local rows)."""
    from megatron.core.transformer.enums import AttnMaskType
    from transformers import AutoConfig

    import compass_kernels as ck
    from compass_kernels.integration.megatron.convert import megatron_config_from_hf
    from compass_kernels.integration.megatron.thd_attention import ThdDotProductAttention

    hf = AutoConfig.from_pretrained(path)
    hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim = HEADS, GROUPS, DIM
    config = megatron_config_from_hf(hf, context_parallel_size=world_size)
    attn = ThdDotProductAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    q, k, v, dout = _inputs(lengths, seed)
    lengths = np.asarray(lengths)
    pb = ck.packing.pack(
        {"q": q, "k": k, "v": v, "d": dout},
        lengths,
        np.arange(lengths.size),
        pad_multiple=2 * world_size if world_size > 1 else 1,
        cp_size=world_size,
        cp_rank=rank,
    )
    ql, kl, vl = (pb.tensors[n].clone().requires_grad_(True) for n in "qkv")
    out = attn(ql, kl, vl, None, packed_seq_params=pb.packed_seq_params())
    out.reshape(out.shape[0], -1).backward(pb.tensors["d"])
    # numpy: pickled by value (a tensor would travel as shared memory of an exited process)
    got = (out.detach().reshape(out.shape[0], -1), ql.grad, kl.grad, vl.grad)
    return (rank, *(t.numpy() for t in got))


@pytest.mark.parametrize("cp", [1, 2])
def test_thd_attention_equals_per_sequence_reference(tiny_moe_path, cp):
    import compass_kernels as ck
    from compass_kernels.integration.cpu import megatron as shim

    lengths = [8, 4, 12] if cp == 2 else [5, 1, 9, 3]  # cp 2: multiples of 2 cp (no padding)
    seed = 11 + cp
    results = shim.run_distributed(
        _attention_rank,
        cp,
        args=(str(tiny_moe_path), lengths, seed),
        megatron={"context_parallel_size": cp},
        timeout=280,
    )
    results = sorted(results, key=lambda r: r[0])
    q, k, v, dout = _inputs(lengths, seed)
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    want = _reference(qd, kd, vd, lengths)
    want.backward(dout.double())
    n = np.asarray(lengths)
    pb = ck.packing.pack(
        q, n, np.arange(n.size), pad_multiple=2 * cp if cp > 1 else 1, cp_size=cp, cp_rank=0
    )

    def gathered(i):  # every rank's local rows, back in sequence order
        return ck.packing.unpack([torch.from_numpy(r[i]) for r in results], pb)

    for i, ref, name in (
        (1, want, "out"),
        (2, qd.grad, "dq"),
        (3, kd.grad, "dk"),
        (4, vd.grad, "dv"),
    ):
        got = gathered(i).double().reshape(ref.shape)
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_thd_attention_refuses_unpacked_input(tiny_moe_path):
    from compass_kernels.integration.cpu import megatron as shim

    with pytest.raises(Exception, match="qkv_format='thd'"):
        shim.run_distributed(
            _refuse_rank,
            1,
            args=(str(tiny_moe_path),),
            megatron={"context_parallel_size": 1},
            timeout=120,
        )


def _refuse_rank(rank, world_size, path):
    from megatron.core.transformer.enums import AttnMaskType
    from transformers import AutoConfig

    from compass_kernels.integration.megatron.convert import megatron_config_from_hf
    from compass_kernels.integration.megatron.thd_attention import ThdDotProductAttention

    config = megatron_config_from_hf(AutoConfig.from_pretrained(path))
    attn = ThdDotProductAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    x = torch.zeros(4, config.num_attention_heads, config.kv_channels)
    attn(x, x, x, None)
