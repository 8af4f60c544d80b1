"""lm_head + log-probs + entropy + ESPO / GSPO / GRPO loss in one call
(``ck.espo.fused_linear_espo_loss``), from hidden states, never holding [T, V].

Two strategies, the same loss and gradients (tests/test_espo_fused_loss.py):

- ``"grad_in_forward"`` (3 GEMMs per token chunk: logits, d_hidden, d_weight).
  Each chunk's logits [rows, V] are computed once, in float32, and overwritten
  in place: statistics (log-sum-exp, target logit, entropy; one read pass),
  then d loss / d logits (one read + write pass) once the per-token upstream
  coefficients are known, then the two gradient GEMMs. The coefficients are
  known in the forward when the loss separates over the chunk:
  * mode "grpo": every token is its own group; the chunks are any token
    ranges. A sequence cut by a chunk boundary keeps its weight 1/(G n_i)
    by scaling each token's advantage by n_i(chunk) / n_i (PPO's clip decision
    depends on the sign of A only, so the gradient scales exactly).
  * modes "espo" and "gspo": a group ratio needs every token of its sequence,
    and groups never cross sequences (the entropy boundaries come from the old
    policy's entropy, known in advance): chunks hold whole sequences. Possible
    when the longest sequence fits in ``token_chunk`` and no CP group splits
    sequences over ranks.
  * the entropy bonus: its per-token weight -entropy_coef / (G n_i) is fixed.
  The loss's backward only scales the stored gradients by the upstream scalar.
- ``"recompute"`` (4 GEMMs): ``fused_linear_logprobs_entropy`` (forward: logits
  tiles -> statistics; backward: recomputed tiles -> d logits -> d_hidden,
  d_weight) then ``espo_loss``. Needed with a context-parallel group (group
  sums are all-reduced over ranks before any token's coefficient is known)
  and for espo/gspo sequences longer than ``token_chunk``. Never below 4/3 of
  the 3-GEMM floor.

With a vocab tensor-parallel group grad_in_forward stays 3 GEMMs: each rank
keeps its chunk's logits tile [rows, V / tp], the per-token statistics are
all-reduced (MAX, then SUM) before the d logits of that tile are formed, and
d_hidden is summed over the group once at the end.

The espo / gspo chunk plan (whole sequences) is made on the host from
``cu_seqlens_host`` (the host copy a packer already has), or from
``cu_seqlens`` itself when it is a CPU tensor; a device ``cu_seqlens`` alone
is an error (never a hidden host sync). grpo needs no plan.

``strategy="auto"`` picks grad_in_forward whenever it applies.

Gradient GEMM precision (``grad_gemm_dtype``; docs/design.md): the d logits
tile G = coef * (softmax - onehot) / T (+ the entropy term) is always formed
in float32; with "input" (the CUDA default under "auto") it is then rounded
once to hidden's dtype and the two gradient GEMMs run on bf16 operands
(tensor cores), writing float32 through torch.mm(out_dtype=float32) where
the build has it; d_weight accumulates over chunks in float32. "fp32" (the
CPU default under "auto": bf16 GEMMs are slow without AVX-512-BF16) keeps
float32 operands.

The per-chunk coefficients come from ``espo_loss`` itself (its kernels' own
d loss / d logprobs on the chunk's tokens, with the batch's G, entropy
boundaries and per-sequence counts), and the returned loss and metrics from
one more ``espo_loss`` call over all tokens (O(T), no GEMM): one definition of
the loss for both strategies and for the unfused path.
"""

from __future__ import annotations

import numpy as np
import torch

from compass_kernels._validate import check_tensor, describe, should_check
from compass_kernels.espo import loss_config
from compass_kernels.espo.logprobs import (
    _finalize,
    _grad_mm_sum,
    _tp_info,
    check_linear_inputs,
    fused_linear_logprobs_entropy,
    logprobs_tile_stats_op,
    mixed_addmm_supported,
    mixed_mm_supported,
    resolve_grad_gemm_dtype,
    token_logprobs_entropy_bwd_op,
)
from compass_kernels.espo.loss import check_loss_inputs, entropy_thresholds, espo_loss

__all__ = ["fused_linear_espo_loss", "STRATEGIES"]

STRATEGIES = ("auto", "grad_in_forward", "recompute")
#: float32 logits held per chunk by grad_in_forward when token_chunk is None:
#: CPU 128 MiB (1024 rows at V = 32,768; 220 at V = 151,936); on a GPU 1 GiB
#: (1766 rows at V = 151,936): each chunk re-reads the weight 3 times and the
#: float32 d_weight twice, which at 220 rows would make the H100 model
#: memory-bound (bench_espo_logprobs --model; a model, not measured).
CHUNK_BYTES = 1 << 27
CHUNK_BYTES_GPU = 1 << 30
_LOSS_KEYS = (
    "mode",
    "rho",
    "alpha",
    "clip",
    "vocab_size",
    "grouping",
    "num_groups",
    "quantiles",
    "drop_low",
    "ratio_form",
    "dual_clip",
    "entropy_threshold",
)


class _StoredGrad(torch.autograd.Function):
    """loss with gradients computed in the forward: the backward scales them in
    place (no second copy of a [V, H] gradient), so it runs once per forward."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, d_hidden, d_weight):
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.used = False
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.used:
            raise RuntimeError(
                "fused_linear_espo_loss: the gradients computed in the forward were already "
                "returned (backward runs once per forward; strategy='recompute' allows more)"
            )
        ctx.used = True
        d_hidden, d_weight = ctx.saved_tensors
        g = grad.to(torch.float32)
        d_h = None if d_hidden is None else d_hidden.mul_(g)
        d_w = None if d_weight is None else d_weight.mul_(g)
        return None, d_h, d_w, None, None


def default_rows(vocab: int, device: torch.device) -> int:
    """grad_in_forward's default token chunk: CHUNK_BYTES (CHUNK_BYTES_GPU off
    the CPU) of float32 logits, 16 to 4096 rows (8192 on a GPU)."""
    if device.type == "cpu":
        return max(16, min(4096, CHUNK_BYTES // (4 * vocab)))
    return max(16, min(8192, CHUNK_BYTES_GPU // (4 * vocab)))


def _token_weights(cu: torch.Tensor, mask: torch.Tensor | None, total: int, G: int):
    """Per token: sequence id (n for tokens after cu[-1]), valid flag, and the
    seq-mean-token-mean weight 1 / (G n_i) (0 where invalid). No host sync."""
    n = cu.shape[0] - 1
    pos = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], pos, right=True)  # [0, n]
    valid = seq < n
    if mask is not None:
        valid &= mask
    counts = torch.zeros(n + 1, dtype=torch.float32, device=cu.device)
    counts.index_add_(0, seq, valid.to(torch.float32))
    weight = torch.where(valid, 1.0 / (G * counts.clamp(min=1.0))[seq], 0.0)
    return seq, valid, counts, weight


def _host_offsets(cu: torch.Tensor, cu_host, total: int, validate: bool | None) -> list[int]:
    """cu_seqlens as host ints, never read from a GPU: ``cu_seqlens_host`` when
    given (checked against cu_seqlens where that costs no sync: CPU tensors,
    or validate=True), else cu_seqlens itself when it is on the CPU."""
    if cu_host is None:
        if cu.device.type == "cpu":
            return cu.tolist()
        raise ValueError(
            "cu_seqlens_host: required with cu_seqlens on "
            f"{cu.device} for modes espo / gspo under strategy 'auto' / 'grad_in_forward' "
            "(whole-sequence chunks are planned on the host; reading cu_seqlens from the "
            "device would sync it): pass the host copy (list, NumPy array or CPU tensor; e.g. "
            "the cumulative sum of ck.packing's PackedBatch.seqlens), or strategy='recompute'"
        )
    if isinstance(cu_host, torch.Tensor):
        if cu_host.device.type != "cpu":
            raise ValueError(
                "cu_seqlens_host: expected a host (CPU) tensor, list or array, got "
                f"{describe(cu_host)}"
            )
        cu_host = cu_host.numpy()
    a = np.asarray(cu_host)
    if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(
            f"cu_seqlens_host: expected a 1-d sequence of ints, got {a.dtype}{list(a.shape)}"
        )
    if a.size != cu.shape[0]:
        raise ValueError(
            f"cu_seqlens_host: expected {cu.shape[0]} offsets (as cu_seqlens), got {a.size}"
        )
    out = a.astype(np.int64).tolist()
    if out and (out[0] != 0 or out[-1] > total or bool((np.diff(a) < 0).any())):
        raise ValueError(
            f"cu_seqlens_host: expected non-decreasing offsets from 0 to at most {total} tokens, "
            f"got {out[:8]}{'...' if len(out) > 8 else ''}"
        )
    if should_check(validate, cu):  # free on the CPU; a sync on a GPU (opt-in)
        host = cu if cu.device.type == "cpu" else cu.cpu()
        if not torch.equal(host, torch.as_tensor(out, dtype=torch.int64)):
            raise ValueError("cu_seqlens_host: expected the values of cu_seqlens, got others")
    return out


def _chunks_by_tokens(total: int, rows: int) -> list[tuple[int, int]]:
    return [(a, min(a + rows, total)) for a in range(0, total, rows)]


def _chunks_by_sequences(cu_host: list[int], total: int, rows: int) -> list[tuple[int, int]]:
    """Greedy runs of whole sequences of at most ``rows`` tokens, then the
    padding tail (no loss) in chunks of ``rows``."""
    out: list[tuple[int, int]] = []
    a = 0
    for b0, b1 in zip(cu_host[:-1], cu_host[1:], strict=True):
        if b1 - a > rows and b0 > a:
            out.append((a, b0))
            a = b0
    if cu_host[-1] > a:
        out.append((a, cu_host[-1]))
    return out + [
        (a, b)
        for a, b in _chunks_by_tokens(total - cu_host[-1], rows)
        for a, b in [(a + cu_host[-1], b + cu_host[-1])]
    ]


def fused_linear_espo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    old_entropy: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    cu_seqlens_host=None,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    strategy: str = "auto",
    token_chunk: int | None = None,
    num_sequences: int | None = None,
    advantages_per_token: bool | None = None,
    tp_group=None,
    cp_group=None,
    validate: bool | None = None,
    backend: str | None = None,
    grad_gemm_dtype: str = "auto",
    **loss_options,
):
    """ESPO / GSPO / GRPO loss of the policy ``softmax(hidden @ weight.T / temperature)``.

    Parameters
    ----------
    hidden, weight, targets, temperature, tp_group, validate, backend : as
        :func:`fused_linear_logprobs_entropy` (hidden [T, H], weight [V, H]).
        NaN / Inf policy: hidden and weight as there, the loss inputs as in
        :func:`espo_loss` (checked on CPU tensors by default, on CUDA with
        validate=True); unchecked, the loss and gradients are NaN.
    old_logprobs, old_entropy, advantages, cu_seqlens, mask, num_sequences,
    advantages_per_token, cp_group, **loss_options : as :func:`espo_loss`
        (mode, rho, alpha, clip, grouping, num_groups, quantiles, drop_low,
        ratio_form, dual_clip; ``vocab_size`` defaults to the full vocabulary).
    entropy_coef : the loss adds ``-entropy_coef * H``, H the current policy's
        entropy, seq-mean-token-mean over the loss's tokens (verl's entropy
        bonus); 0 (default): entropy computed and returned, not in the loss.
    cu_seqlens_host : the values of ``cu_seqlens`` on the host (list, NumPy
        array or CPU tensor); required for modes espo / gspo under strategy
        "auto" / "grad_in_forward" when cu_seqlens is on a GPU (the chunk plan
        is made on the host; reading a GPU tensor would sync). Checked against
        cu_seqlens where ``should_check(validate)`` says (CPU by default, a GPU
        with validate=True: a sync).
    strategy : "auto" | "grad_in_forward" | "recompute" (module docstring).
    token_chunk : tokens per chunk (default: ``default_rows``, 128 MiB of
        float32 logits on the CPU, 1 GiB on a GPU, for grad_in_forward; 1024
        for recompute).
    grad_gemm_dtype : operands of the gradient GEMMs (d_hidden = G @ W,
        d_weight += G^T @ h): "input" (hidden's dtype: bf16 on tensor cores),
        "fp32", or "auto" (default: "input" on CUDA, "fp32" on the CPU, where
        bf16 GEMMs are slow without AVX-512-BF16). Either way the gradient
        tile G = coef * (softmax - onehot) (+ the entropy term) is formed in
        float32 and rounded once to the operand dtype (its final store: a
        target gradient coef * (p - 1) with p = 1 - 1e-4 survives, which
        rounding the softmax to bf16 before subtracting the one-hot would
        erase); d_weight accumulates over chunks in float32 and is rounded to
        weight's dtype once at the end. The GEMM writes float32 where torch.mm
        has out_dtype (CUDA; probed at run time, ``logprobs.grad_gemm_info``
        says what runs); elsewhere its product is rounded to the input dtype
        before the float32 accumulation.

    Returns
    -------
    loss : 0-d float32, differentiable w.r.t. hidden and weight.
    metrics : ``espo_loss``'s metrics (a Mapping; a dict with "entropy_loss_term"
        added when entropy_coef is set).
    logprobs, entropy : [T] float32, detached (the current policy's).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    unknown = set(loss_options) - set(_LOSS_KEYS)
    if unknown:
        raise TypeError(f"fused_linear_espo_loss: unexpected keyword argument(s) {sorted(unknown)}")
    h, w, y, temp = check_linear_inputs(hidden, weight, targets, temperature, tp_group, validate)
    gd = resolve_grad_gemm_dtype(grad_gemm_dtype, h.dtype, h.device)
    if token_chunk is not None and not (isinstance(token_chunk, int) and token_chunk > 0):
        raise ValueError(f"token_chunk: expected a positive int or None, got {token_chunk!r}")
    if not (isinstance(entropy_coef, int | float) and abs(entropy_coef) < float("inf")):
        raise ValueError(f"entropy_coef: expected a finite float, got {entropy_coef!r}")
    _, world = _tp_info(tp_group)
    opts = dict(loss_options)
    threshold = opts.pop("entropy_threshold", None)
    opts.setdefault("vocab_size", w.shape[0] * world)
    cfg = loss_config.resolve(**opts)
    if threshold is not None:
        opts["entropy_threshold"] = threshold  # espo_loss checks it
    total = h.shape[0]
    check_tensor(
        "cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=h.device
    )
    common = dict(
        num_sequences=num_sequences,
        advantages_per_token=advantages_per_token,
        validate=validate,
        backend=backend,
        **opts,
    )
    # Every loss input (shapes, dtypes, options; data where should_check says)
    # checked before any GEMM, without running the loss (no kernel on a GPU).
    check_loss_inputs(
        total,
        h.device,
        old_logprobs,
        old_entropy,
        advantages,
        cu_seqlens,
        mask,
        cp_group=cp_group,
        **common,
    )
    cu = cu_seqlens.to(torch.int64)
    n = cu.shape[0] - 1
    G = n if num_sequences is None else num_sequences
    rows = token_chunk
    if rows is None:
        rows = default_rows(w.shape[0], h.device)
    cu_host: list[int] | None = None
    longest = 0
    if strategy != "recompute" and not cfg.token_groups and cp_group is None:
        # whole-sequence chunks are planned on the host (never by reading a GPU tensor)
        cu_host = _host_offsets(cu, cu_seqlens_host, total, validate)
        longest = max((b - a for a, b in zip(cu_host[:-1], cu_host[1:], strict=True)), default=0)
    fits = longest <= rows
    if strategy == "grad_in_forward" and (cp_group is not None or not fits):
        raise ValueError(
            "strategy='grad_in_forward': needs no cp_group and, for modes espo and "
            f"gspo, every sequence within token_chunk={rows} tokens; use 'recompute' or 'auto'"
        )
    ent_w = None
    if strategy == "recompute" or cp_group is not None or not fits:
        logp, ent = fused_linear_logprobs_entropy(
            h,
            w,
            y,
            temperature=temp,
            tp_group=tp_group,
            token_chunk=token_chunk or 1024,
            validate=False,
            backend=backend,
            grad_gemm_dtype=grad_gemm_dtype,
        )
        loss, metrics = espo_loss(
            logp,
            old_logprobs,
            old_entropy,
            advantages,
            cu_seqlens,
            mask,
            cp_group=cp_group,
            **common,
        )
        if entropy_coef:
            _, _, _, ent_w = _token_weights(cu, mask, total, G)
            assert ent is not None  # with_entropy defaults to True
            term = (ent * ent_w).sum()
            loss = loss - entropy_coef * term
            metrics = _with_entropy_term(metrics, term)
        assert ent is not None  # with_entropy defaults to True
        return loss, metrics, logp.detach(), ent.detach()

    grad_on = torch.is_grad_enabled()
    want_h = grad_on and hidden.requires_grad
    want_w = grad_on and weight.requires_grad
    with torch.no_grad():
        logp, ent, d_h, d_w = _grad_in_forward(
            h,
            w,
            y,
            temp,
            old_logprobs,
            old_entropy,
            advantages,
            cu,
            mask,
            cfg,
            G,
            float(entropy_coef),
            rows,
            cu_host,
            common,
            want_h,
            want_w,
            tp_group,
            gd,
        )
        loss, metrics = espo_loss(
            logp, old_logprobs, old_entropy, advantages, cu_seqlens, mask, **common
        )
        if entropy_coef:
            _, _, _, ent_w = _token_weights(cu, mask, total, G)
            term = (ent * ent_w).sum()
            loss = loss - entropy_coef * term
            metrics = _with_entropy_term(metrics, term)
    if want_h or want_w:
        loss = _StoredGrad.apply(
            loss.to(torch.float32),
            hidden,
            weight,
            d_h.to(hidden.dtype) if want_h else None,
            d_w.to(weight.dtype) if want_w else None,
        )
    return loss, metrics, logp, ent


def _with_entropy_term(metrics, term):
    out = dict(metrics)
    out["entropy_loss_term"] = term.detach()
    return out


def _grad_in_forward(
    h,
    w,
    y,
    temp,
    old_lp,
    old_ent,
    adv,
    cu,
    mask,
    cfg,
    G,
    ent_coef,
    rows,
    cu_host,
    common,
    want_h,
    want_w,
    tp_group,
    gd,
):
    """Forward statistics and the wanted gradients: up to 3 GEMMs per chunk
    (module docstring); 1 when no gradient is wanted (no_grad, frozen inputs).

    With a vocab tensor-parallel group each rank holds its shard's logits tile
    [rows, V_local] of the chunk; the per-token statistics are merged over the
    group (all-reduce MAX, then SUM: ``_finalize``) before the coefficients
    and the d logits of that same tile are formed: still 3 GEMMs per chunk.
    d_weight stays per shard; the partial d_hidden sums over the group once.

    gd: the gradient GEMMs' operand dtype (float32, or hidden's dtype: the
    float32 d logits tile is then rounded once into a gd buffer)."""
    total, vocab = h.shape[0], w.shape[0]
    rank, world = _tp_info(tp_group)
    full_vocab = vocab * world
    shard = rank * vocab  # equal contiguous shards (Megatron's vocab split)
    dev = h.device
    seq, valid, counts, tok_w = _token_weights(cu, mask, total, G)
    n = cu.shape[0] - 1
    per_tok = common["advantages_per_token"]
    if per_tok is None:
        per_tok = adv.shape[0] == total and adv.shape[0] != n
    adv32 = adv.detach().to(torch.float32)
    # Per-token advantages (0 after cu[-1]): every chunk passes advantages per token.
    adv_tok = adv32 if per_tok else torch.cat([adv32, adv32.new_zeros(1)])[seq]
    thr = common.get("entropy_threshold")
    if thr is not None:
        thr = thr.detach().to(torch.float64).reshape(-1)
    elif cfg.num_groups > 1 and not cfg.per_sequence:
        thr = entropy_thresholds(old_ent.detach(), cu, mask, levels=cfg.levels).reshape(-1)
    if cfg.token_groups:
        chunks = _chunks_by_tokens(total, rows)
        # Tokens of sequence i in this chunk / in all: keeps 1/(G n_i) exact when a
        # chunk cuts a sequence (see the module docstring).
        cid = torch.arange(total, device=dev) // rows
        key = seq * len(chunks) + cid
        part = torch.zeros((n + 1) * len(chunks), dtype=torch.float32, device=dev)
        part.index_add_(0, key, valid.to(torch.float32))
        adv_tok = adv_tok * (part[key] / counts[seq].clamp(min=1.0))
    else:
        chunks = _chunks_by_sequences(cu_host, total, rows)
    opts = {
        k: v
        for k, v in common.items()
        if k not in ("num_sequences", "advantages_per_token", "entropy_threshold")
    }
    f32 = torch.float32
    half = gd != f32
    # Logits GEMM: half operands with a float32 result where torch.mm has
    # out_dtype (CUDA: exact products, float32 sums), else float32 copies made
    # once (CPU). The fp32 gradient GEMMs reuse the copies.
    mixed = h.dtype != f32 and mixed_mm_supported(dev)
    need32 = h.dtype != f32 and (not mixed or not half)
    w32 = w.to(f32) if need32 else w
    h32 = h.to(f32) if need32 else h
    logp = torch.empty(total, dtype=f32, device=dev)
    ent = torch.empty(total, dtype=f32, device=dev)
    d_h = torch.empty(total, h.shape[1], dtype=f32, device=dev) if want_h else None
    d_w = torch.zeros(vocab, h.shape[1], dtype=f32, device=dev) if want_w else None
    max_rows = max((b - a for a, b in chunks), default=0)
    flat = torch.empty(max_rows * vocab, dtype=f32, device=dev)
    grads = want_h or want_w
    gbuf = torch.empty(max_rows * vocab, dtype=gd, device=dev) if half and grads else None
    # an fp32 [V, H] product per chunk after the first (written into d_w)
    fold = (
        half
        and want_w
        and len(chunks) > 1
        and mixed_mm_supported(dev)
        and not mixed_addmm_supported(dev)
    )  # in-place addmm needs no temporary
    tmp_w = torch.empty_like(d_w) if fold else None
    state = torch.empty(4 * max_rows, dtype=f32, device=dev)
    gh_all = -ent_coef * tok_w if ent_coef else None
    for a, b in chunks:
        r = b - a
        tile = flat[: r * vocab].view(r, vocab)
        hc = h32[a:b]
        if mixed and not need32:
            torch.mm(hc, w32.T, out_dtype=f32, out=tile)
        else:
            torch.mm(hc, w32.T, out=tile)
        st = state[: 4 * r].view(4, r)
        st[0].fill_(float("-inf"))
        st[1:].zero_()
        logprobs_tile_stats_op(
            logits=tile,
            targets=y[a:b],
            vocab_start=shard,
            temperature=temp,
            with_entropy=True,
            state_in=st,
            backend=common["backend"],
            out=st,
        )
        m, log_s, lp_c, ent_c = _finalize(st, 1.0 / temp, True, tp_group, y[a:b], full_vocab)
        logp[a:b] = lp_c
        ent[a:b] = ent_c
        if not (want_h or want_w):
            continue
        gl = _chunk_coef(lp_c, old_lp, old_ent, adv_tok, cu, mask, thr, a, b, G, opts)
        gh = None if gh_all is None else gh_all[a:b].contiguous()
        # d logits stored once: over the float32 tile, or straight to gd (rounded)
        g = gbuf[: r * vocab].view(r, vocab) if half else tile
        token_logprobs_entropy_bwd_op(
            logits=tile,
            targets=y[a:b],
            row_max=m,
            log_norm=log_s,
            entropy=ent_c,
            grad_logprob=gl,
            grad_entropy=gh,
            temperature=temp,
            vocab_start=shard,
            backend=common["backend"],
            out=g,
        )
        if half:
            if want_h:
                _grad_mm_sum(d_h[a:b], g, w, None, first=True)
            if want_w:  # the first chunk's product is the accumulator's start
                _grad_mm_sum(d_w, g.T, h[a:b], tmp_w, first=a == 0)
            continue
        if want_h:
            torch.mm(tile, w32, out=d_h[a:b])
        if want_w:
            d_w.addmm_(tile.T, hc)
    if want_h and tp_group is not None:
        import torch.distributed as dist

        # hidden states are replicated over the group: their gradient is the sum
        dist.all_reduce(d_h, op=dist.ReduceOp.SUM, group=tp_group)
    return logp, ent, d_h, d_w


def _chunk_coef(lp_c, old_lp, old_ent, adv_tok, cu, mask, thr, a, b, G, opts):
    """d loss / d logprobs of tokens [a, b) by espo_loss on the chunk (the
    sequences clipped to it, the batch's G and entropy boundaries)."""
    cu_c = cu.clamp(a, b) - a
    lp = lp_c.detach().clone().requires_grad_()
    with torch.enable_grad():
        loss_c, _ = espo_loss(
            lp,
            old_lp[a:b],
            old_ent[a:b],
            adv_tok[a:b],
            cu_c,
            None if mask is None else mask[a:b],
            num_sequences=G,
            entropy_threshold=thr,
            advantages_per_token=True,
            **opts,
        )
        (g,) = torch.autograd.grad(loss_c, lp)
    return g.to(torch.float32).contiguous()
