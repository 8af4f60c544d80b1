"""ck.fp8.permute_quantize / unpermute: every backend bit for bit against the
reference, the stable-sort contract checked from first principles, multi-chunk
and many-expert shapes, bad inputs, op registration."""

from __future__ import annotations

import pytest
import torch

import compass_kernels as ck
from compass_kernels.fp8 import SCALE_LAYOUTS, permute_op, unpermute_op
from compass_kernels.fp8.reference import permute_quantize_reference, unpermute_reference
from compass_kernels.testing import assert_bitwise_equal, make_generator, poison_

TRITON = pytest.param("triton", marks=pytest.mark.triton)
BACKENDS = ["torch", TRITON]


def dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major CPU copy (strides of size-1 dims included)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.cpu())


def make_routing(m, k, experts, seed, dtype=torch.int64, distinct=True):
    """Top-k ids: distinct per row (a router's top-k), or with repeats; skewed
    towards low experts so some experts get many slots and some none."""
    g = make_generator(seed)
    if distinct:
        scores = torch.rand(m, experts, generator=g) + torch.linspace(1, 0, experts)
        ids = scores.topk(k, dim=1).indices
    else:
        ids = torch.randint(0, experts, (m, k), generator=g)
    return ids.to(dtype)


def run_permute(x, ids, experts, layout, backend, ue8m0=False):
    args = dict(
        x=x,
        topk_ids=ids,
        num_experts=experts,
        eps=1e-10,
        ue8m0=ue8m0,
        scale_layout=SCALE_LAYOUTS[layout],
    )
    out = permute_op.outputs(**args)
    for t in out[:5]:
        poison_(t)
    return permute_op.run(**args, backend=backend, out=out)


CASES = [
    (1, 1, 1, torch.int64, "k_major"),
    (37, 2, 8, torch.int64, "mn_major"),
    (300, 3, 7, torch.int32, "k_major"),  # 900 slots: four chunks of 256
    (128, 2, 300, torch.int64, "mn_major_tma"),  # ids need 9 bits; 2 full chunks
]
# The interpreter runs ~1 ms per program: Triton gets the cases up to two chunks.
PERMUTE_PARAMS = [pytest.param("torch", *c) for c in CASES] + [
    pytest.param("triton", *c, marks=pytest.mark.triton) for c in CASES if c[0] != 300
]


@pytest.mark.parametrize(("backend", "m", "k", "experts", "id_dtype", "layout"), PERMUTE_PARAMS)
def test_permute_matches_reference(backend, m, k, experts, id_dtype, layout, backend_device):
    g = make_generator(m + k + experts)
    x = (torch.randn(m, 260, generator=g) * 3).to(torch.bfloat16)
    x[0] = 0
    ids = make_routing(m, k, experts, seed=m * k, dtype=id_dtype)
    dev = backend_device
    q, s, off, src, dst, ws = run_permute(x.to(dev), ids.to(dev), experts, layout, backend)
    rq, rs, roff, rsrc, rdst = permute_quantize_reference(x, ids, experts)
    if backend != "torch":  # the sort's intermediates: the same numbers on every backend
        cpu_ws = run_permute(x, ids, experts, layout, "torch")[5]
        assert_bitwise_equal(ws.cpu(), cpu_ws, name="workspace")
    assert_bitwise_equal(off.cpu(), roff, name="expert_offsets")
    assert_bitwise_equal(src.cpu(), rsrc, name="src_index")
    assert_bitwise_equal(dst.cpu(), rdst, name="dst_index")
    assert_bitwise_equal(dense(s), rs, name="scales")
    assert_bitwise_equal(q.cpu().view(torch.uint8), rq.view(torch.uint8), name="q")


@pytest.mark.parametrize("distinct", [True, False])
def test_permutation_contract_from_first_principles(distinct):
    """Without the reference: rows are grouped by expert in increasing order,
    slots keep their order inside an expert, offsets are the cumulative counts,
    src and dst are inverse permutations, and each row is its token's
    quantization (the bits quantize_token_groups gives)."""
    m, k, experts = 517, 4, 61
    x = torch.randn(m, 300, generator=make_generator(1)).to(torch.bfloat16)
    ids = make_routing(m, k, experts, seed=2, distinct=distinct)
    p = ck.fp8.permute_quantize(x, ids, experts)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    assert p.expert_offsets.tolist() == [0, *counts.cumsum(0).tolist()]
    keys = flat[p.src_index] * (m * k) + p.src_index  # (expert, slot) lexicographic
    assert torch.all(keys[1:] > keys[:-1])
    assert torch.equal(p.dst_index[p.src_index], torch.arange(m * k))
    tq, ts = ck.fp8.quantize_token_groups(x)
    tokens = p.src_index // k
    assert torch.equal(p.q.view(torch.uint8), tq.view(torch.uint8)[tokens])
    assert torch.equal(p.scales, ts[tokens])


def test_offsets_are_int64_and_empty_experts_are_kept():
    ids = torch.tensor([[5, 2], [5, 0]])
    p = ck.fp8.permute_quantize(torch.randn(2, 128), ids, 8)
    assert p.expert_offsets.dtype == torch.int64
    assert p.expert_offsets.tolist() == [0, 1, 1, 2, 2, 2, 4, 4, 4]
    assert p.src_index.tolist() == [3, 1, 0, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_empty_batch(backend, backend_device):
    x = torch.empty(0, 256, device=backend_device)
    ids = torch.empty(0, 2, dtype=torch.int64, device=backend_device)
    p = ck.fp8.permute_quantize(x, ids, 5, backend=backend)
    assert p.q.shape == (0, 256) and p.expert_offsets.cpu().tolist() == [0] * 6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,cols", [(70, 3, 333), (37, 8, 256), (5, 1, 4096 + 16)])
def test_unpermute_matches_reference(backend, dtype, m, k, cols, backend_device):
    """Odd widths (masked columns), whole column blocks (the unmasked EVEN path:
    256 = one block, 4096 + 16 = masked past two), k = 1 / 3 / 8 (unrolled), a
    dropped slot whose weight is NaN (skipped, not multiplied by a zero row)."""
    experts = 9
    ids = make_routing(m, k, experts, seed=3 + k)
    p = ck.fp8.permute_quantize(torch.randn(m, 128), ids, experts)
    g = make_generator(4 + k)
    y = (torch.randn(m * k, cols, generator=g) * 5).to(dtype)
    w = torch.rand(m, k, generator=g) * 2 - 0.5
    dst = p.dst_index.clone()
    dst[min(5, m * k - 1)] = -1  # a dropped slot (expert parallelism: not on this rank)
    w.view(-1)[min(5, m * k - 1)] = float("nan")
    out = unpermute_op.outputs(y=y, dst_index=dst, topk_weights=w)
    poison_(out)
    dev = backend_device
    out = unpermute_op.run(
        y=y.to(dev), dst_index=dst.to(dev), topk_weights=w.to(dev), backend=backend, out=out.to(dev)
    )
    assert_bitwise_equal(out.cpu(), unpermute_reference(y, dst, w), name="out")


def test_permute_then_unpermute_is_the_weighted_sum():
    """Round trip: expert 'outputs' = the dequantized permuted rows, so the
    combine gives sum_j w[t, j] * dequant(x[t]) for every token."""
    m, k, experts = 45, 2, 6
    x = torch.randn(m, 256)
    ids = make_routing(m, k, experts, seed=5)
    w = torch.rand(m, k)
    p = ck.fp8.permute_quantize(x, ids, experts)
    y = ck.fp8.dequantize(p.q, p.scales, block=(1, 128))
    out = ck.fp8.unpermute(y, p, w)
    deq = ck.fp8.dequantize(*ck.fp8.quantize_token_groups(x), block=(1, 128))
    torch.testing.assert_close(out, deq * w.sum(1, keepdim=True), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("backend", [None, TRITON])
def test_bad_expert_ids_are_an_error(backend):
    x = torch.randn(4, 128)
    for bad in (8, -1):
        ids = torch.tensor([[0, 1], [2, 3], [4, bad], [6, 7]])
        match = r"topk_ids: expected expert ids in \[0, 8\)"
        with pytest.raises(ValueError, match=match):
            ck.fp8.permute_quantize(x, ids, 8, backend=backend)


def test_bad_permute_arguments_name_the_argument():
    x = torch.randn(4, 128)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"topk_ids: expected dtype int32 \| int64"):
        ck.fp8.permute_quantize(x, ids.to(torch.int16), 2)
    with pytest.raises(ValueError, match=r"topk_ids: expected 4 elements in dim 0"):
        ck.fp8.permute_quantize(x, ids[:3], 2)
    with pytest.raises(ValueError, match=r"num_experts: expected a positive int"):
        ck.fp8.permute_quantize(x, ids, 0)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"x: expected finite values, got nan at \[1, 3\]"):
        ck.fp8.permute_quantize(x, ids, 2)
    y = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"dst_index: expected values in \[-1, 8\)"):
        ck.fp8.unpermute(y, torch.tensor([0, 1, 2, 9]), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"dst_index: expected 4 elements"):
        ck.fp8.unpermute(y, torch.tensor([0, 1, 2]), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"y: expected dtype float32 \| bfloat16"):
        ck.fp8.unpermute(y.half(), torch.tensor([0, 1, 2, 3]), torch.ones(2, 2))


@pytest.mark.triton
def test_unchecked_bad_ids_on_the_gpu_path_are_dropped_not_written_out_of_bounds():
    """With validate=False (the GPU default) an id out of range must not write
    outside the outputs: its slot is dropped (dst_index -1)."""
    x = torch.randn(3, 128)
    ids = torch.tensor([[0, 9], [1, 0], [-4, 1]])
    from tests.triton_tier import DEVICE

    x, ids = x.to(DEVICE), ids.to(DEVICE)
    p = ck.fp8.permute_quantize(x, ids, 2, validate=False, backend="triton")
    assert p.dst_index[[1, 4]].tolist() == [-1, -1]
    assert p.expert_offsets.tolist() == [0, 2, 4]
    assert sorted(p.src_index[:4].tolist()) == [0, 2, 3, 5]


@pytest.mark.triton
@pytest.mark.parametrize(
    "chunks,experts,cb,eb",
    [(1, 1, 4, 2), (37, 13, 4, 2), (9, 16, 8, 8), (0, 5, 4, 2), (300, 3, 256, 8)],
)
def test_triton_offsets_scan_matches_cumsum(chunks, experts, cb, eb):
    """The permutation's parallel offsets scan (programs over expert blocks, a
    [cb, eb] tile of chunk counts per step) against cumsum, with many steps per
    program, partial tiles on both axes, and no chunks at all."""
    from compass_kernels.fp8 import triton as kt
    from tests.triton_tier import DEVICE

    g = make_generator(chunks * 31 + experts)
    counts = torch.randint(0, 257, (chunks, experts), generator=g, dtype=torch.int32)
    base = poison_(torch.empty(chunks, experts, dtype=torch.int32, device=DEVICE))
    offsets = poison_(torch.empty(experts + 1, dtype=torch.int64, device=DEVICE))
    kt.permute_offsets_triton(
        counts.to(DEVICE).flatten(), chunks, experts, base, offsets, scan_chunks=cb, scan_experts=eb
    )
    assert_bitwise_equal(base.cpu(), (counts.cumsum(0) - counts).int(), name="base")
    ref = torch.zeros(experts + 1, dtype=torch.int64)
    ref[1:] = counts.sum(0, dtype=torch.int64).cumsum(0)
    assert_bitwise_equal(offsets.cpu(), ref, name="expert_offsets")


# -------------------------------------------------------------- registration


def test_opcheck_registered_ops():
    x = torch.randn(20, 200).to(torch.bfloat16)
    ids = make_routing(20, 2, 5, seed=6)
    torch.library.opcheck(
        torch.ops.compass.fp8_permute_quantize.default, (x, ids, 5, 1e-10, False, 0)
    )
    p = ck.fp8.permute_quantize(x, ids, 5)
    y = torch.randn(40, 16)
    torch.library.opcheck(
        torch.ops.compass.fp8_unpermute.default, (y, p.dst_index, torch.rand(20, 2))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_permute_and_quantize(backend):
    m, k, experts = 4099, 8, 256
    x = torch.randn(m, 7168 // 4).to(torch.bfloat16)
    ids = make_routing(m, k, experts, seed=7)
    ref = ck.fp8.permute_quantize(x, ids, experts)
    p = ck.fp8.permute_quantize(x.cuda(), ids.cuda(), experts, backend=backend)
    assert_bitwise_equal(p.q.cpu().view(torch.uint8), ref.q.view(torch.uint8), name="q")
    for name in ("scales", "expert_offsets", "src_index", "dst_index"):
        assert_bitwise_equal(dense(getattr(p, name)), dense(getattr(ref, name)), name=name)
    q, s = ck.fp8.quantize_blockwise(x.cuda(), backend=backend)
    rq, rs = ck.fp8.quantize_blockwise(x)
    assert_bitwise_equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert_bitwise_equal(s.cpu(), rs)


@pytest.mark.triton
def test_triton_scatter_grid_stride_over_tokens():
    """Fewer scatter programs than tokens (each loops over its tokens, 2048-wide
    steps of a 2100-wide row: two steps, the second ragged): the same bits as
    the torch backend, every slot's row written (outputs poisoned)."""
    from compass_kernels.fp8.triton import permute_quantize_triton
    from tests.triton_tier import DEVICE

    g = make_generator(77)
    x = (torch.randn(23, 2100, generator=g) * 3).to(torch.bfloat16)
    ids = make_routing(23, 3, 5, seed=78, dtype=torch.int32, distinct=False)
    args = dict(
        x=x,
        topk_ids=ids,
        num_experts=5,
        eps=1e-10,
        ue8m0=False,
        scale_layout=SCALE_LAYOUTS["mn_major"],
    )
    want = permute_op.run(**args, backend="torch", out=permute_op.outputs(**args))
    dargs = args | {"x": x.to(DEVICE), "topk_ids": ids.to(DEVICE)}
    out = permute_op.outputs(**dargs)
    for t in out[:5]:
        poison_(t)
    permute_quantize_triton(**dargs, **out._asdict(), num_programs=2)
    for name, a, b in zip(("q", "scales", "offsets", "src", "dst"), out[:5], want[:5], strict=True):
        a = a.cpu()
        a, b = (
            (a.view(torch.uint8), b.view(torch.uint8))
            if a.is_floating_point() and a.element_size() == 1
            else (a, b)
        )
        assert_bitwise_equal(
            torch.empty(a.shape, dtype=a.dtype).copy_(a),
            torch.empty(b.shape, dtype=b.dtype).copy_(b),
            name=name,
        )
