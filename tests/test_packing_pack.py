"""ck.packing.pack / unpack (Megatron THD) on every backend against the
one-sequence-at-a-time reference: odd lengths (1 included), every dtype and
row width, cp in {1, 2, 4}, poisoned outputs, exact round trips, clear errors.
Backends: "torch" (CPU, vectorised) and "triton" (GPU; the interpreter here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compass_kernels as ck
from compass_kernels.packing import reference as ref
from compass_kernels.packing.thd import thd_pack_op, thd_positions_op, thd_unpack_op
from compass_kernels.testing import empty_poisoned

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


def make_batch(n: int, seed: int, device: str = "cpu", max_len: int = 40):
    """A jagged batch of n sequences (lengths 1..max_len) with the per-token
    tensors an RL step packs: ids, log-probs, advantages, masks, routing trace
    [T, 3 layers, 2] uint8 (6-byte rows), a bf16 [T, 5] (10-byte rows)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g)
    lengths[0] = 1
    T = int(lengths.sum())
    tensors = {
        "ids": torch.randint(0, 50000, (T,), generator=g),
        "old_logprobs": -torch.rand(T, generator=g) * 5,
        "advantages": torch.randn(T, generator=g, dtype=torch.float64),
        "mask": torch.rand(T, generator=g) < 0.7,
        "routing": torch.randint(0, 255, (T, 3, 2), generator=g, dtype=torch.uint8),
        "hidden": torch.randn(T, 5, generator=g).to(torch.bfloat16),
    }
    return lengths.tolist(), {k: v.to(device) for k, v in tensors.items()}


def _indices(n: int, seed: int) -> list[int]:
    g = np.random.default_rng(seed)
    return g.permutation(n)[: max(1, n - 2)].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cp,pad", [(1, 1), (1, 3), (2, 4), (2, 8), (4, 8), (4, 24)])
def test_pack_matches_reference_and_round_trips(backend, backend_device, cp, pad):
    n = 23
    lengths, tensors = make_batch(n, seed=cp * 100 + pad, device=backend_device)
    idx = _indices(n, cp + pad)
    fills = {"routing": 255, "ids": -1}
    batches = [
        ck.packing.pack(
            tensors,
            lengths,
            idx,
            pad_multiple=pad,
            cp_size=cp,
            cp_rank=r,
            pad_values=fills,
            backend=backend,
        )
        for r in range(cp)
    ]
    for r, b in enumerate(batches):
        for name, x in tensors.items():
            want = ref.pack_reference(
                x.cpu(),
                lengths,
                idx,
                pad_multiple=pad,
                cp_size=cp,
                cp_rank=r,
                pad_value=fills.get(name, 0),
            )
            got = b.tensors[name].cpu()
            assert got.dtype == x.dtype and got.shape == want["packed"].shape, name
            assert torch.equal(got.view(torch.uint8), want["packed"].view(torch.uint8)), name
        assert torch.equal(b.position_ids.cpu(), want["position_ids"])
        assert torch.equal(b.cu_seqlens.cpu(), want["cu_seqlens"])
        assert torch.equal(b.cu_seqlens_padded.cpu(), want["cu_seqlens_padded"])
        assert b.max_seqlen == want["max_seqlen"]
        assert b.local_tokens * cp == int(want["cu_seqlens_padded"][-1])
    # unpack inverts pack exactly, from every rank's output (list or concatenation)
    for name, x in tensors.items():
        per_rank = [b.tensors[name] for b in batches]
        out = ck.packing.unpack(per_rank, batches[0], backend=backend)
        want = torch.cat([x[sum(lengths[:i]) : sum(lengths[:i]) + lengths[i]] for i in idx])
        assert torch.equal(out.cpu().view(torch.uint8), want.cpu().view(torch.uint8)), name
        again = ck.packing.unpack(torch.cat(per_rank), batches[0], backend=backend)
        assert torch.equal(again.cpu().view(torch.uint8), out.cpu().view(torch.uint8))
        ref_out = ref.unpack_reference(
            [p.cpu() for p in per_rank], lengths, idx, pad_multiple=pad, cp_size=cp
        )
        assert torch.equal(ref_out.view(torch.uint8), want.cpu().view(torch.uint8))
        pieces = batches[0].split(out)
        assert [p.shape[0] for p in pieces] == [lengths[i] for i in idx]


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_write_every_output(backend, backend_device):
    """Outputs poisoned before the kernel; rows of several widths (1, 6, 8, 24 bytes)."""
    lengths = [1, 5, 17, 2, 33, 9, 1]
    idx, cp, pad = [6, 2, 0, 4, 1], 2, 4
    L = np.array(lengths)
    src_cu = np.concatenate([[0], np.cumsum(L)])
    seqlens = L[idx]
    local = -(-seqlens // pad) * pad // cp
    off = np.concatenate([[0], np.cumsum(local)])
    cu = np.concatenate([[0], np.cumsum(seqlens)])
    dev = backend_device
    t = lambda a: torch.tensor(a, dtype=torch.int64, device=dev)  # noqa: E731
    total = int(off[-1])
    for w in (1, 6, 8, 24):
        src = torch.randint(0, 255, (int(src_cu[-1]), w), dtype=torch.uint8, device=dev)
        for r in range(cp):
            out = empty_poisoned((total, w), torch.uint8, dev)
            thd_pack_op.run(
                src=src,
                seq_start=t(src_cu[idx]),
                seqlens=t(seqlens),
                out_offsets=t(off),
                cp_size=cp,
                cp_rank=r,
                fill=0,
                total=total,
                backend=backend,
                out=out,
            )
            want = ref.pack_reference(
                src.cpu(), lengths, idx, pad_multiple=pad, cp_size=cp, cp_rank=r
            )["packed"]
            assert torch.equal(out.cpu(), want)
        packed = torch.cat(
            [
                ref.pack_reference(
                    src.cpu(), lengths, idx, pad_multiple=pad, cp_size=cp, cp_rank=r
                )["packed"]
                for r in range(cp)
            ]
        ).to(dev)
        out = empty_poisoned((int(cu[-1]), w), torch.uint8, dev)
        thd_unpack_op.run(
            packed=packed,
            seqlens=t(seqlens),
            cu_seqlens=t(cu),
            out_offsets=t(off),
            cp_size=cp,
            total=int(cu[-1]),
            backend=backend,
            out=out,
        )
        want = torch.cat([src[src_cu[i] : src_cu[i + 1]] for i in idx]).cpu()
        assert torch.equal(out.cpu(), want)
    for r in range(cp):
        pos = empty_poisoned(total, torch.int64, dev)
        thd_positions_op.run(
            out_offsets=t(off), cp_size=cp, cp_rank=r, total=total, backend=backend, out=pos
        )
        want = ref.pack_reference(
            torch.zeros(int(src_cu[-1])), lengths, idx, pad_multiple=pad, cp_size=cp, cp_rank=r
        )["position_ids"]
        assert torch.equal(pos.cpu(), want)


def _packing_case(lengths, idx, cp, pad, seed):
    L = np.array(lengths)
    src_cu = np.concatenate([[0], np.cumsum(L)])
    seqlens = L[idx]
    local = -(-seqlens // pad) * pad // cp
    off = np.concatenate([[0], np.cumsum(local)])
    cu = np.concatenate([[0], np.cumsum(seqlens)])
    return src_cu, seqlens, off, cu


@pytest.mark.triton
@pytest.mark.parametrize(
    "w,tile",
    [
        (8, (1, 1)),
        (8, (4, 1)),
        (48, (1, 2)),
        (48, (2, 2)),
        (24, (16, 4)),
        (6, (2, 4)),
        (40, (8, 8)),
    ],
)
@pytest.mark.parametrize("cp", [1, 2])
def test_triton_tiles_cross_rows_sequences_and_programs(w, tile, cp):
    """Every tile shape the Triton wrappers can pick, forced small: one row per
    program (the wide-row path, several unit steps per row), blocks inside one
    sequence and blocks across many, programs whose rows straddle sequences."""
    from compass_kernels.packing import triton as kt
    from tests.triton_tier import DEVICE

    g = np.random.default_rng(w * 10 + tile[0] + cp)
    lengths = g.integers(1, 12, size=19).tolist()
    idx = g.permutation(19)[:15].tolist()
    pad = 2 * cp
    src_cu, seqlens, off, cu = _packing_case(lengths, idx, cp, pad, w)
    t = lambda a: torch.tensor(a, dtype=torch.int64, device=DEVICE)  # noqa: E731
    src = torch.randint(
        0, 255, (int(src_cu[-1]), w), dtype=torch.uint8, generator=torch.Generator().manual_seed(w)
    ).to(DEVICE)
    total = int(off[-1])
    packed = []
    for r in range(cp):
        out = empty_poisoned((total, w), torch.uint8, DEVICE)
        kt.thd_pack_triton(
            src=src,
            seq_start=t(src_cu[idx]),
            seqlens=t(seqlens),
            out_offsets=t(off),
            cp_size=cp,
            cp_rank=r,
            fill=0xA5,
            total=total,
            out=out,
            tile=tile,
        )
        want = ref.pack_reference(
            src.cpu(), lengths, idx, pad_multiple=pad, cp_size=cp, cp_rank=r, pad_value=0xA5
        )
        assert torch.equal(out.cpu(), want["packed"]), (r, tile)
        packed.append(out)
        pos = empty_poisoned(total, torch.int64, DEVICE)
        kt.thd_positions_triton(
            out_offsets=t(off), cp_size=cp, cp_rank=r, total=total, out=pos, block=tile[0] * 4
        )
        assert torch.equal(pos.cpu(), want["position_ids"]), (r, tile)
    out = empty_poisoned((int(cu[-1]), w), torch.uint8, DEVICE)
    kt.thd_unpack_triton(
        packed=torch.cat(packed),
        seqlens=t(seqlens),
        cu_seqlens=t(cu),
        out_offsets=t(off),
        cp_size=cp,
        total=int(cu[-1]),
        out=out,
        tile=tile,
    )
    want = torch.cat([src[src_cu[i] : src_cu[i + 1]] for i in idx]).cpu()
    assert torch.equal(out.cpu(), want), tile


def test_plan_to_packed_micro_batches():
    """A plan's micro-batches, packed for cp=2, tp=2 (pad 8): every rank's local
    tokens stay within max_tokens / cp, and every sequence comes back."""
    lengths = ref.lognormal_lengths(64, 1) // 64 + 1
    x = torch.arange(int(lengths.sum()), dtype=torch.int64)
    cp, pad, cap = 2, 8, 4096
    p = ck.packing.plan(lengths, dp_size=2, max_tokens=cap, pad_multiple=pad)
    seen = []
    for r in range(2):
        for j in range(p.num_micro_batches):
            idx = p.micro_batch(r, j)
            bs = [
                ck.packing.pack(x, p.lengths, idx, pad_multiple=pad, cp_size=cp, cp_rank=c)
                for c in range(cp)
            ]
            assert bs[0].local_tokens * cp <= cap
            out = ck.packing.unpack([b.tensors["input"] for b in bs], bs[0])
            seen.extend(out.tolist())
    assert sorted(seen) == x.tolist()


def test_megatron_packed_seq_params():
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths, tensors = make_batch(5, seed=1)
    b = ck.packing.pack(tensors["ids"], lengths, [4, 0, 2], pad_multiple=4, cp_size=2, cp_rank=0)
    params = b.packed_seq_params()
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(params.cu_seqlens_q_padded, b.cu_seqlens_padded)
    assert params.max_seqlen_q == b.max_seqlen == int(b.padded.max())


def test_registered_ops_pass_opcheck():
    lengths = [3, 1, 6]
    src = torch.randint(0, 255, (10, 6), dtype=torch.uint8)
    t = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    torch.library.opcheck(
        thd_pack_op_impl(), (src, t([0, 3, 4]), t(lengths), t([0, 4, 6, 12]), 2, 1, 0, 12)
    )
    torch.library.opcheck(torch.ops.compass.thd_positions.default, (t([0, 4, 6, 12]), 2, 0, 12))
    packed = torch.randint(0, 255, (24, 6), dtype=torch.uint8)
    args = (packed, t(lengths), t([0, 3, 4, 10]), t([0, 4, 6, 12]), 2, 10)
    torch.library.opcheck(torch.ops.compass.thd_unpack.default, args)


def thd_pack_op_impl():
    return torch.ops.compass.thd_pack.default


def test_errors_name_the_argument():
    lengths, tensors = make_batch(4, seed=2)
    x = tensors["ids"]
    with pytest.raises(ValueError, match=r"lengths: sequence 2 .* is empty"):
        ck.packing.pack(
            x[: sum(lengths) - lengths[2]], [lengths[0], lengths[1], 0, lengths[3]], [0, 2]
        )
    with pytest.raises(ValueError, match="pad_multiple: expected a multiple of 2 \\* cp_size = 4"):
        ck.packing.pack(x, lengths, [0], pad_multiple=2, cp_size=2)
    with pytest.raises(ValueError, match="cp_rank: expected 0 <= cp_rank < cp_size = 2"):
        ck.packing.pack(x, lengths, [0], pad_multiple=4, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match=r"indices: expected values in \[0, 4\), got 7"):
        ck.packing.pack(x, lengths, [1, 7])
    with pytest.raises(ValueError, match=r"tensors\['ids'\]: expected \d+ rows"):
        ck.packing.pack({"ids": x[1:]}, lengths, [1])
    with pytest.raises(ValueError, match=r"pad_values\['adv'\]: expected 0, -1"):
        ck.packing.pack({"adv": tensors["old_logprobs"]}, lengths, [1], pad_values={"adv": 5})
    with pytest.raises(ValueError, match="indices: expected at least one sequence"):
        ck.packing.pack(x, lengths, [])
    b = ck.packing.pack(x, lengths, [0, 1], pad_multiple=4, cp_size=2)
    with pytest.raises(ValueError, match="packed: expected 2 tensors"):
        ck.packing.unpack([b.tensors["input"]], b)
    with pytest.raises(ValueError, match=r"packed: expected \d+ rows \(cp_size \* local_tokens\)"):
        ck.packing.unpack(b.tensors["input"], b)


def test_torch_boundary_errors():
    """The CPU backend checks the metadata's values (host memory) and names them."""
    t = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    src, out = torch.zeros(10, 4, dtype=torch.uint8), torch.empty(8, 4, dtype=torch.uint8)
    good = dict(
        src=src,
        seq_start=t([0, 3]),
        seqlens=t([3, 4]),
        out_offsets=t([0, 4, 8]),
        cp_size=1,
        cp_rank=0,
        fill=0,
        total=8,
    )

    def pack(**changed):
        return thd_pack_op.run(**(good | changed), backend="torch", out=out)

    with pytest.raises(ValueError, match=r"seqlens: expected every sequence non-empty"):
        pack(seqlens=t([3, 0]))
    with pytest.raises(ValueError, match=r"seq_start: sequence 1 spans source rows \[8, 12\)"):
        pack(seq_start=t([0, 8]))
    with pytest.raises(ValueError, match=r"out_offsets: sequence 0 of 3 tokens has 1 local slots"):
        pack(out_offsets=t([0, 1, 8]), cp_size=2)
    with pytest.raises(ValueError, match="src: expected dtype uint8"):
        pack(src=src.float())
    with pytest.raises(ValueError, match="cp_rank: expected 0 <= cp_rank < cp_size = 2"):
        pack(cp_size=2, cp_rank=3)
    with pytest.raises(ValueError, match="out: expected size 7 in dim 0"):
        pack(total=7)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected increments equal to seqlens"):
        thd_unpack_op.run(
            packed=torch.zeros(8, 4, dtype=torch.uint8),
            seqlens=t([3, 4]),
            cu_seqlens=t([0, 3, 6]),
            out_offsets=t([0, 4, 8]),
            cp_size=1,
            total=6,
            backend="torch",
            out=torch.empty(6, 4, dtype=torch.uint8),
        )
    with pytest.raises(ValueError, match=r"out_offsets: expected 0 \.\. total = 8, got 0 \.\. 6"):
        thd_positions_op.run(
            out_offsets=t([0, 2, 6]),
            cp_size=1,
            cp_rank=0,
            total=8,
            backend="torch",
            out=torch.empty(8, dtype=torch.int64),
        )


@pytest.mark.sm90
def test_triton_kernels_compile_for_sm90_without_spills():
    """Every variant the Triton wrappers launch compiles ahead of time for sm_90a."""
    from compass_kernels.packing import triton as kt
    from tests import aot

    variants = kt.aot_variants()
    arts = [aot.compile_triton(k, sig, const, **opts) for k, sig, const, opts in variants]
    assert len(arts) == 11
    for art, (_, _, const, _) in zip(arts, variants, strict=True):
        aot.assert_no_spills(art.resource_usage)
        aot.assert_registers_at_most(art.resource_usage, 128)
        # No 64-bit divide (a ~70-instruction software routine) anywhere: rows and
        # units are separate tile axes, and unpack's one divide per row is 32-bit.
        assert "div.s64" not in art.ptx and "rem.s64" not in art.ptx, art.name
        if const.get("COLS") == kt.BLOCK:  # wide int64 rows: 16-byte loads and stores
            assert "ld.global.v2.b64" in art.ptx and "st.global.v2.b64" in art.ptx, art.name


@pytest.mark.parametrize("cp", [1, 2])
def test_unpack_backward_is_pack_of_the_gradient(cp):
    """Model outputs (log-probs) get their gradient back through unpack."""
    lengths, tensors = make_batch(7, seed=cp)
    idx = [5, 1, 3]
    b = ck.packing.pack(tensors["old_logprobs"], lengths, idx, pad_multiple=4, cp_size=cp)
    out = torch.randn(cp * b.local_tokens, dtype=torch.float64, requires_grad=True)
    y = ck.packing.unpack(out, b)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    want = torch.zeros_like(out)
    want_y = ref.unpack_reference(
        list(out.detach().chunk(cp)), lengths, idx, pad_multiple=4, cp_size=cp
    )
    assert torch.equal(y.detach(), want_y)
    # d/d out of sum(unpack(out) * w): w at each token's packed slot, 0 at padding
    seqcat = torch.zeros(sum(lengths), dtype=torch.float64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    pos = 0
    for i in idx:
        seqcat[starts[i] : starts[i] + lengths[i]] = w[pos : pos + lengths[i]]
        pos += lengths[i]
    for r in range(cp):
        want[r * b.local_tokens : (r + 1) * b.local_tokens] = ref.pack_reference(
            seqcat, lengths, idx, pad_multiple=4, cp_size=cp, cp_rank=r
        )["packed"]
    assert torch.equal(out.grad, want)
    torch.autograd.gradcheck(lambda t: ck.packing.unpack(t, b), (out.detach().requires_grad_(),))
