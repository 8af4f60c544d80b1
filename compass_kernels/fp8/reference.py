"""Plain-torch references of ck.fp8: the executable spec every backend matches bit for bit
(explicit block loops, written for clarity), and the ops' torch backend (CPU
tensors, vectorised; the ``*_torch`` functions at the end).

Conventions (docs/design.md, section FP8), per block of ``block_rows x block_cols``
elements (ragged edges: partial blocks, exactly as zero padding would give):

- ``amax = max(max |x|, eps)`` in float32 (``eps``: the floor of an all-zero block;
  a NaN / inf in the block, unchecked, gives a NaN / inf amax and scale);
- ``scale = amax / 448`` (float32 division); with ``ue8m0`` the smallest power of
  two >= that (an exact UE8M0 exponent);
- ``q = e4m3fn(x * (1 / scale))`` (``use_div=False``: DeepGEMM's and vLLM's
  ``per_block_cast_to_fp8``, the weight convention) or ``e4m3fn(x / scale)``
  (``use_div=True``: vLLM's CUDA ``per_token_group_fp8_quant``, the activation
  convention), each product or quotient rounded to float32 first, then to e4m3fn
  with round-to-nearest-even, saturating at +-448, subnormals kept.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448.

    torch's own cast rounds to nearest even and gives NaN at >= 480; clamping
    first makes it saturating (NaN stays NaN)."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def block_scale(amax: torch.Tensor, eps: float, ue8m0: bool) -> torch.Tensor:
    """float32 scales from float32 block amaxes (see the module docstring)."""
    a = torch.clamp(amax.to(torch.float32), min=eps)
    s = a / E4M3_MAX
    if ue8m0:
        # The smallest power of two >= s: frexp gives s = m * 2^e with m in
        # [0.5, 1); s is a power of two exactly when m == 0.5.
        # A NaN / inf scale (a non-finite block, unchecked) stays NaN / inf.
        m, e = torch.frexp(s)
        p2 = torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))
        s = torch.where(torch.isfinite(s), p2, s)
    return s


def quantize_reference(
    x: torch.Tensor,
    block_rows: int,
    block_cols: int,
    *,
    eps: float,
    ue8m0: bool = False,
    use_div: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 quantization of a 2-d tensor.

    Parameters
    ----------
    x : [R, C] float32 | bfloat16 | float16, finite.
    block_rows, block_cols : block shape (128, 128) for weights, (1, 128) for
        activations (token groups).

    Returns
    -------
    q : [R, C] float8_e4m3fn.
    scales : [ceil(R / block_rows), ceil(C / block_cols)] float32, row-major
        (dequantized x = q * scales broadcast over each block).
    """
    if not torch.isfinite(x).all():
        raise ValueError("x: expected finite values")
    rows, cols = x.shape
    nb, kb = -(-rows // block_rows), -(-cols // block_cols)
    xf = x.to(torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            r = slice(i * block_rows, (i + 1) * block_rows)
            c = slice(j * block_cols, (j + 1) * block_cols)
            blk = xf[r, c]
            s = block_scale(blk.abs().amax(), eps, ue8m0)
            scales[i, j] = s
            y = blk / s if use_div else blk * (1.0 / s)
            q[r, c] = to_e4m3(y)
    return q, scales


def dequantize_reference(
    q: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    """float32 ``q * scale`` per block (exact: e4m3 times a float32 scale)."""
    rows, cols = q.shape
    s = scales.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return q.to(torch.float32) * s


def permute_quantize_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    eps: float = 1e-10,
    ue8m0: bool = False,
):
    """MoE token permutation with 1x128 quantization of the permuted rows.

    Slot ``s = t * k + j`` (token t's j-th expert ``e = topk_ids[t, j]``) goes to
    row ``dst_index[s]`` of the expert-sorted order: experts ascending, slots in
    increasing ``s`` within an expert (a stable sort), no padding.

    Returns
    -------
    q : [M*k, K] float8_e4m3fn, row p = quantized x[src_index[p] // k].
    scales : [M*k, ceil(K/128)] float32 (use_div convention, like quantize_token_groups).
    expert_offsets : [E+1] int64, rows of expert e are [offsets[e], offsets[e+1]).
    src_index : [M*k] int64 (row -> slot); dst_index : [M*k] int64 (slot -> row).
    """
    m, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts})")
    order = [s for e in range(num_experts) for s in range(m * k) if int(flat[s]) == e]
    src = torch.tensor(order, dtype=torch.int64)
    dst = torch.empty(m * k, dtype=torch.int64)
    dst[src] = torch.arange(m * k)
    counts = torch.tensor([int((flat == e).sum()) for e in range(num_experts)], dtype=torch.int64)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    rows = x[src // k] if m * k else x[:0]
    q, scales = quantize_reference(rows, 1, 128, eps=eps, ue8m0=ue8m0, use_div=True)
    return q, scales, offsets, src.reshape(m * k), dst


def unpermute_reference(
    y: torch.Tensor, dst_index: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[dst_index[t*k + j]] in float32, in j order, each
    product and sum rounded to float32 (no fused multiply-add); rows with
    dst_index < 0 are skipped. Returned in y's dtype."""
    m, k = topk_weights.shape
    acc = torch.zeros(m, y.shape[1], dtype=torch.float32)
    yf = y.to(torch.float32)
    for t in range(m):
        for j in range(k):
            p = int(dst_index[t * k + j])
            if p >= 0:
                acc[t] = acc[t] + topk_weights[t, j].to(torch.float32) * yf[p]
    return acc.to(y.dtype)


# ---------------------------------------------------------------------------
# The torch backend of the ck.fp8 ops (CPU tensors): vectorised, the same bits
# as the loop-level spec above (every product / quotient rounded to float32,
# then to e4m3fn). Calling convention of every backend: the op's arguments,
# then its outputs, written in place. Value checks (finite inputs) are the
# public functions' (compass_kernels/fp8/__init__.py), as for every backend.

PERMUTE_CHUNK = 256  # slots per chunk of the permutation's counting sort (every backend)


def quantize_torch(*, x, block_rows, block_cols, eps, ue8m0, use_div, scale_layout, q, scales):
    """``fp8_quantize`` op: ``q`` [R, C] float8_e4m3fn and ``scales``
    [ceil(R / br), ceil(C / bc)] float32 (any strides: the layout is the
    caller's), blocks of any shape; x [R, C] float32 | bfloat16 | float16."""
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return
    nb, kb = -(-rows // block_rows), -(-cols // block_cols)
    xp = torch.zeros(nb * block_rows, kb * block_cols, dtype=torch.float32)
    xp[:rows, :cols] = x  # zero padding: a partial block's amax is its elements'
    blocks = xp.view(nb, block_rows, kb, block_cols)
    s = block_scale(blocks.abs().amax(dim=(1, 3)), eps, ue8m0)
    sb = s[:, None, :, None]
    y = blocks / sb if use_div else blocks * (1.0 / sb)
    q.copy_(to_e4m3(y.reshape(nb * block_rows, kb * block_cols)[:rows, :cols]))
    scales.copy_(s)


def permute_quantize_torch(
    *,
    x,
    topk_ids,
    num_experts,
    eps,
    ue8m0,
    scale_layout,
    q,
    scales,
    expert_offsets,
    src_index,
    dst_index,
    workspace,
):
    """``fp8_permute_quantize`` op: the stable counting sort of the top-k slots by
    expert in the GPU kernels' terms (chunks of 256 slots; ``workspace`` int32
    = rank of each slot among its chunk's earlier slots of its expert [slots] |
    per-chunk expert counts [chunks, E] | their exclusive prefix over chunks
    [chunks, E]), then the 1x128 quantization of the permuted rows."""
    m, k = topk_ids.shape
    slots, e = m * k, num_experts
    flat = topk_ids.reshape(-1).to(torch.int64)
    if slots and (int(flat.min()) < 0 or int(flat.max()) >= e):
        raise ValueError(f"topk_ids: expected expert ids in [0, {e})")
    chunks = -(-slots // PERMUTE_CHUNK)
    s = torch.arange(slots, dtype=torch.int64)
    key = (s // PERMUTE_CHUNK) * e + flat  # (chunk, expert)
    counts = torch.bincount(key, minlength=chunks * e)
    order = torch.argsort(key, stable=True)
    first = counts.cumsum(0) - counts  # first sorted position of each key
    rank = torch.empty(slots, dtype=torch.int64)
    rank[order] = s - first[key[order]]
    per_chunk = counts.view(chunks, e)
    base = per_chunk.cumsum(0) - per_chunk
    expert_offsets.zero_()
    torch.cumsum(per_chunk.sum(0), 0, out=expert_offsets[1:])
    dst = expert_offsets[flat] + base.reshape(-1)[key] + rank
    dst_index.copy_(dst)
    src_index[dst] = s
    workspace.copy_(torch.cat([rank, counts, base.reshape(-1)]).to(torch.int32))
    if slots:
        rows = x[src_index // k]
        quantize_torch(
            x=rows,
            block_rows=1,
            block_cols=128,
            eps=eps,
            ue8m0=ue8m0,
            use_div=True,
            scale_layout=scale_layout,
            q=q,
            scales=scales,
        )


def unpermute_torch(*, y, dst_index, topk_weights, out):
    """``fp8_unpermute`` op: out[t] = sum_j w[t, j] * y[dst_index[t*k + j]] in
    float32, in j order, product and sum each rounded (no fused multiply-add);
    slots with dst_index < 0 are skipped. ``out`` [M, C] in y's dtype."""
    m, k = topk_weights.shape
    acc = torch.zeros(m, y.shape[1], dtype=torch.float32)
    dst = dst_index.view(m, k)
    w = topk_weights.to(torch.float32)
    for j in range(k):
        p = dst[:, j]
        rows = y[p.clamp(min=0)].to(torch.float32)
        term = w[:, j, None] * rows
        acc = torch.where((p >= 0)[:, None], acc + term, acc)
    out.copy_(acc)
