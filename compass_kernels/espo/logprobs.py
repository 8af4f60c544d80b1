"""Token log-probs and entropy for ESPO / GRPO losses (ck.espo).

- :func:`token_logprobs_entropy`: from logits [T, V]; one pass over vocab tiles
  with a float32 online log-sum-exp; differentiable (a registered op with a
  fake, whose backward is an op of its own).
- :func:`fused_linear_logprobs_entropy`: from hidden states [T, H] and the
  lm_head weight [V, H] without ever holding [T, V] logits: token x vocab tiles
  of logits in float32, statistics merged across tiles (and across vocab
  shards of a tensor-parallel group), tiles recomputed in the backward.

Kernels: ``torch`` (CPU tensors: ``reference_logprobs.py``'s ``*_torch``,
vectorised float32) and ``triton_logprobs.py`` (CUDA, and CPU tensors under
the Triton interpreter). Spec: ``reference_logprobs.py``; the float32 state
and formulas are stated there, above the torch kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compass_kernels._op import op
from compass_kernels._validate import INT_DTYPES, as_float, check_tensor, describe, should_check
from compass_kernels.espo.reference_logprobs import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "token_logprobs_entropy",
    "fused_linear_logprobs_entropy",
    "token_logprobs_entropy_op",
    "token_logprobs_entropy_bwd_op",
    "logprobs_tile_stats_op",
]

_LOGITS_DTYPES = (torch.float32, torch.bfloat16)
_TRITON = "compass_kernels.espo.triton_logprobs:"
_TORCH = "compass_kernels.espo.reference_logprobs:"


# ---------------------------------------------------------------------- ops


class TokenLogprobs(NamedTuple):
    """Outputs of :data:`token_logprobs_entropy_op`, each [T] float32."""

    logp: torch.Tensor  # log softmax(logits / T)[targets] (0 for IGNORE_INDEX)
    entropy: torch.Tensor  # NaN unless with_entropy
    row_max: torch.Tensor  # m, the row's max logit (raw units)
    log_norm: torch.Tensor  # log s; lse = m / T + log s


@op(
    kernels={
        "torch": _TORCH + "token_logprobs_entropy_torch",
        "triton": _TRITON + "token_logprobs_entropy_triton",
    }
)
def token_logprobs_entropy_op(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> TokenLogprobs:
    """Per-token log-prob of the target and entropy of softmax(logits / temperature).

    logits : [T, V] float32 | bfloat16, unit stride along V. targets : [T] int64
    in [0, V) or IGNORE_INDEX. Differentiable w.r.t. logits (logp, entropy).
    """
    t = logits.shape[0]
    new = logits.new_empty
    f32 = torch.float32
    return TokenLogprobs(
        logp=new(t, dtype=f32),
        entropy=new(t, dtype=f32),
        row_max=new(t, dtype=f32),
        log_norm=new(t, dtype=f32),
    )


@op(
    kernels={
        "torch": _TORCH + "token_logprobs_entropy_bwd_torch",
        "triton": _TRITON + "token_logprobs_entropy_bwd_triton",
    },
    output="grad_logits",
)
def token_logprobs_entropy_bwd_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_max: torch.Tensor,
    log_norm: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    vocab_start: int,
) -> torch.Tensor:
    """d (g_l log p_y + g_h H) / d logits: grad_logits [T, V] in logits' dtype
    (an ``out`` of bfloat16 for float32 logits: the float32 gradient rounded
    once at the store, no float32 copy; the fused lm_head backward).

    logits : [T, V_tile] (vocab ids vocab_start ..); targets, row_max, log_norm,
    entropy : [T] (the forward's); grad_logprob, grad_entropy : [T] float32 or None.
    """
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@op(
    kernels={
        "torch": _TORCH + "logprobs_tile_stats_torch",
        "triton": _TRITON + "logprobs_tile_stats_triton",
    },
    output="state_out",
)
def logprobs_tile_stats_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    temperature: float,
    with_entropy: bool,
    state_in: torch.Tensor,
) -> torch.Tensor:
    """Fold the vocab tile ``logits`` [T, V_tile] (ids vocab_start ..) into the
    online state [4, T] float32 (m, s, a, target logit): state_out (may be state_in)."""
    return torch.empty_like(state_in)


def _setup_context(ctx, inputs, output):
    args = token_logprobs_entropy_op.bind(inputs)
    res = TokenLogprobs._make(output)
    ctx.save_for_backward(args["logits"], args["targets"], res.row_max, res.log_norm, res.entropy)
    ctx.temperature = args["temperature"]
    ctx.with_entropy = args["with_entropy"]
    ctx.backend = args.get("backend")
    ctx.mark_non_differentiable(res.row_max, res.log_norm)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logprob, grad_entropy, _grad_max, _grad_log_norm):
    logits, targets, row_max, log_norm, entropy = ctx.saved_tensors
    gl = _grad_vector(grad_logprob)
    gh = _grad_vector(grad_entropy) if ctx.with_entropy else None
    if gl is None and gh is None:
        return token_logprobs_entropy_op.input_grads()
    grad = torch.ops.compass.token_logprobs_entropy_bwd(
        logits=logits,
        targets=targets,
        row_max=row_max,
        log_norm=log_norm,
        entropy=entropy,
        grad_logprob=gl,
        grad_entropy=gh,
        temperature=ctx.temperature,
        vocab_start=0,
        backend=ctx.backend,
    )
    return token_logprobs_entropy_op.input_grads(logits=grad)


def _grad_vector(g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return None
    g = g if g.dtype == torch.float32 else g.to(torch.float32)
    return g if g.is_contiguous() else g.contiguous()


torch.library.register_autograd(
    "compass::token_logprobs_entropy", _backward, setup_context=_setup_context
)


# ------------------------------------------------------------- public API


def _check_targets(targets: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    check_tensor(
        "targets",
        targets,
        ndim=1,
        dtypes=INT_DTYPES,
        size=rows,
        size_what="one per token",
        device=device,
    )
    t = targets if targets.dtype == torch.int64 else targets.to(torch.int64)
    return t if t.is_contiguous() else t.contiguous()


def _check_targets_range(targets: torch.Tensor, vocab: int) -> None:
    if targets.numel() == 0:
        return
    lo, hi = torch.aminmax(targets)
    if int(lo) < 0 or int(hi) >= vocab:
        off = ((targets < 0) | (targets >= vocab)) & (targets != IGNORE_INDEX)
        if off.any():
            bad = int(off.nonzero()[0, 0])
            raise ValueError(
                f"targets: expected token ids in [0, {vocab}) or the ignore index "
                f"{IGNORE_INDEX}, got targets[{bad}] = {int(targets[bad])}"
            )


def _check_temperature(temperature: float) -> float:
    t = as_float("temperature", temperature, finite=False)  # bool / str refused
    if not (0.0 < t < float("inf")):
        raise ValueError(f"temperature: expected a finite value > 0, got {temperature!r}")
    return t


def token_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    validate: bool | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token and the entropy of each full distribution.

    Parameters
    ----------
    logits : [T, V] float32 | bfloat16, the vocab dimension contiguous (rows may
        be strided, e.g. a slice of [B, L, V]). -inf entries are masked tokens.
    targets : [T] integer token ids in [0, V), or IGNORE_INDEX (-100): a masked
        token, log-prob 0 and no log-prob gradient (its entropy is still computed).
        Any other id outside [0, V) is an error where checked (validate); unchecked
        (CUDA by default) its log-prob is NaN, and no kernel reads outside the row.
    temperature : float > 0; the distribution is softmax(logits / temperature).
    with_entropy : compute the entropy (skipping it saves ~a third of the forward).
    validate : check targets' range and that logits hold no NaN / +inf and no
        all -inf row (``_validate.should_check``): None (default) on CPU
        tensors, not on CUDA (a host sync); True everywhere; False never; never
        on fake / meta tensors or while tracing.
        NaN / Inf policy: logits finite or -inf (a masked token), not all -inf
        in a row (ValueError naming [row, column] where checked); unchecked, a
        NaN / +inf logit or an all -inf row gives NaN log-prob and entropy for
        that row only (and NaN gradients in that row).
    backend : None (CPU: "torch"; CUDA: "triton"), "torch" or "triton".

    Returns
    -------
    logprobs : [T] float32, log softmax(logits / T)[targets], never positive.
    entropy : [T] float32 (None when with_entropy is False).

    Both are differentiable with respect to ``logits``; the backward recomputes
    the softmax from the saved float32 log-sum-exp (no [T, V] saved) and keeps
    the gradient in float32 until the single store in logits' dtype.
    Accumulation is float32 throughout: vs a float64 reference, |error| <~
    1e-6 * max(1, |logit / T|) for float32 logits.
    """
    check_tensor("logits", logits, ndim=2, dtypes=_LOGITS_DTYPES)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(
            f"logits: expected a contiguous vocab dimension (stride 1), got {describe(logits)} "
            f"with strides {logits.stride()}"
        )
    if logits.shape[1] == 0 and logits.shape[0] > 0:
        raise ValueError(f"logits: expected a vocabulary of at least 1, got {describe(logits)}")
    dev = logits.device
    y = _check_targets(targets, logits.shape[0], dev)
    temp = _check_temperature(temperature)
    if should_check(validate, logits, y):
        _check_targets_range(y, logits.shape[1])
        _check_logits_values(logits)
    args = dict(logits=logits, targets=y, temperature=temp, with_entropy=bool(with_entropy))
    if logits.requires_grad and torch.is_grad_enabled():
        logp, ent, _, _ = torch.ops.compass.token_logprobs_entropy(**args, backend=backend)
    else:
        logp, ent, _, _ = token_logprobs_entropy_op(**args, backend=backend)
    return logp, (ent if with_entropy else None)


def _check_logits_values(logits: torch.Tensor) -> None:
    x = logits.detach()
    bad = torch.isnan(x) | (x == float("inf"))
    if bool(bad.any()):
        t, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"logits: expected finite or -inf values, got {float(x[t, j])} at [{t}, {j}]"
        )
    if x.shape[1] > 0:
        dead = (x == float("-inf")).all(dim=1)
        if bool(dead.any()):
            t = int(dead.nonzero()[0, 0])
            raise ValueError(
                f"logits: row {t} has every logit -inf (no distribution to take a log-prob of)"
            )


# ------------------------------------------------- fused linear + log-probs

#: Default tile of the fused path: 1024 tokens x 8192 vocab entries = 32 MiB of
#: float32 logits. Large enough that the matmuls run near their peak (the
#: per-tile work is three GEMMs of 1024 x 8192 x H), small enough to stay far
#: below [T, V] (4.6 GiB at T = 8192, V = 151,936).
TOKEN_CHUNK = 1024
VOCAB_CHUNK = 8192


#: ``grad_gemm_dtype`` options: the operand dtype of the gradient GEMMs
#: (d_hidden = G @ W, d_weight += G^T @ h). "input": hidden's dtype (bf16 on
#: tensor cores); "fp32": float32 operands; "auto": the input dtype on CUDA,
#: float32 on the CPU (bf16 GEMMs are slow on CPUs without AVX-512-BF16).
GRAD_GEMM_DTYPES = ("auto", "fp32", "input")
_MIXED_MM: dict[str, bool] = {}  # device type -> torch.mm(out_dtype=float32) runs there
_MIXED_ADDMM: dict[str, bool] = {}  # device type -> torch.addmm(out_dtype=float32, out=acc)
_WARNED: set[str] = set()


def mixed_mm_supported(device: torch.device) -> bool:
    """Whether torch.mm(a, b, out_dtype=torch.float32, out=...) with half
    operands runs on ``device``'s type (a run-time probe on 2 x 2 tensors,
    cached per device type; no host sync). CUDA builds have it; CPU torch
    2.13 does not."""
    kind = device.type
    if kind not in _MIXED_MM:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        try:
            torch.mm(a, a, out_dtype=torch.float32, out=a.new_empty(2, 2, dtype=torch.float32))
            _MIXED_MM[kind] = True
        except (RuntimeError, NotImplementedError, TypeError):
            _MIXED_MM[kind] = False
    return _MIXED_MM[kind]


def mixed_addmm_supported(device: torch.device) -> bool:
    """Whether torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc) with
    half a, b and a float32 acc (in-place float32 accumulation of a half GEMM,
    no float32 temporary) runs on ``device``'s type: a cached 2 x 2 probe whose
    result is compared with the float32 sum (no host sync after the first
    call). CUDA builds of torch 2.13 have aten::addmm.dtype_out; CPU does not."""
    kind = device.type
    if kind not in _MIXED_ADDMM:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device)
        try:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _MIXED_ADDMM[kind] = bool((acc == 3.0).all())
        except (RuntimeError, NotImplementedError, TypeError):
            _MIXED_ADDMM[kind] = False
    return _MIXED_ADDMM[kind]


def resolve_grad_gemm_dtype(option: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The operand dtype of the gradient GEMMs for ``grad_gemm_dtype=option``
    with inputs of ``dtype`` on ``device`` (GRAD_GEMM_DTYPES)."""
    if option not in GRAD_GEMM_DTYPES:
        raise ValueError(f"grad_gemm_dtype: expected one of {GRAD_GEMM_DTYPES}, got {option!r}")
    if option == "fp32" or (option == "auto" and device.type == "cpu"):
        return torch.float32
    gd = dtype
    if gd != torch.float32 and not mixed_mm_supported(device) and device.type not in _WARNED:
        _WARNED.add(device.type)
        if device.type != "cpu":  # CPU torch has no mixed mm: expected, documented
            import warnings

            warnings.warn(
                f"grad_gemm_dtype={option!r}: torch.mm(out_dtype=float32) is unavailable on "
                f"{device.type} in this torch build; each gradient GEMM's product is rounded "
                f"to {dtype} before its float32 accumulation (grad_gemm_info says so)",
                stacklevel=3,
            )
    return gd


def grad_gemm_info(option: str, dtype: torch.dtype, device: torch.device) -> str:
    """How the gradient GEMMs run for these inputs, in words (benches print it)."""
    gd = resolve_grad_gemm_dtype(option, dtype, device)
    if gd == torch.float32:
        return "float32 operands, float32 out" + (
            f" (the d logits tile float32, {dtype} weight / hidden upcast)"
            if dtype != torch.float32
            else ""
        )
    if mixed_addmm_supported(device):
        how = "float32 accumulation in place (torch.addmm out_dtype=float32, out=acc)"
    elif mixed_mm_supported(device):
        how = "float32 out (torch.mm out_dtype) into a float32 temporary, then add_"
    else:
        how = f"{gd} product (no mixed mm on {device.type}), float32 accumulation"
    return f"{gd} operands (d logits tile formed in float32, rounded once), {how}"


def _grad_mm_sum(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tmp, *, first: bool) -> None:
    """One term of a float32 sum of gradient GEMMs: acc = a @ b when ``first``
    (the product written straight into the accumulator), else acc += a @ b.
    Operands of one dtype: float32 (addmm_), or half accumulated in float32
    in place by torch.addmm(out_dtype=float32, out=acc) where the build has it;
    else a float32 product into ``tmp`` (a float32 buffer of acc's shape, or
    None) then add_, else the half product."""
    if first:
        if a.dtype == torch.float32 or mixed_mm_supported(a.device):
            _mm_f32(a, b, out=acc)
        else:
            acc.copy_(torch.mm(a, b))
    elif a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif mixed_addmm_supported(a.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif tmp is not None and mixed_mm_supported(a.device):
        acc.add_(torch.mm(a, b, out_dtype=torch.float32, out=tmp))
    else:
        acc.add_(torch.mm(a, b))


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with a float32 result (float32 accumulation) for float32 or half inputs."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if mixed_mm_supported(a.device):
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)  # CPU has no mixed-dtype mm


def _tp_info(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _finalize(state: torch.Tensor, inv_t: float, with_entropy: bool, tp_group, targets, vocab):
    """(row_max, log_norm, logp, entropy) [T] from the merged per-token state [4, T]
    (m, s, a, z_target; m and z_target in raw-logit units). With a TP group, shards
    merge with all-reduce MAX of m, then SUM of (s, a, z_target) rescaled to the
    global max (the merge of reference_logprobs.logprobs_tile_stats_torch).
    ``targets`` [T] and the full ``vocab`` (all shards): an IGNORE_INDEX target
    gets log-prob 0, any other outside [0, vocab) NaN (no tile held it)."""
    m, s, a, xt = state.unbind(0)
    if tp_group is not None:
        import torch.distributed as dist

        big_m = m.clone()
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
        d = torch.clamp((m - big_m) * inv_t, min=-200.0)  # a shard of only -inf: d -> -200, c -> 0
        c = torch.exp(d)
        packed = torch.stack([c * s, c * (a + s * d), xt])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
        s, a, xt = packed.unbind(0)
        m = big_m
    log_s = torch.log(s)
    logp = torch.clamp((xt - m) * inv_t - log_s, max=0.0)  # compass/logprobs.h logprob_of
    ok = (targets >= 0) & (targets < vocab)  # elementwise, no host read (any device)
    masked = torch.where(targets == IGNORE_INDEX, 0.0, float("nan")).to(logp.dtype)
    logp = torch.where(ok, logp, masked)
    entropy = torch.clamp(log_s - a / s, min=0.0) if with_entropy else None
    return m, log_s, logp, entropy


class _TileBuffer:
    """One float32 logits tile reused by every (token, vocab) chunk; a smaller
    edge tile is a contiguous prefix of it (mm's out= wants contiguous)."""

    def __init__(self, like: torch.Tensor, token_chunk: int, vocab_chunk: int) -> None:
        rows = min(token_chunk, like.shape[0])
        self.flat = like.new_empty(rows * vocab_chunk, dtype=torch.float32)

    def get(self, rows: int, cols: int) -> torch.Tensor:
        return self.flat[: rows * cols].view(rows, cols)


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        temperature,
        with_entropy,
        tp_group,
        chunks,
        backend,
        grad_dtype,
    ):
        token_chunk, vocab_chunk = chunks
        rows, vocab = hidden.shape[0], weight.shape[0]
        rank, _ = _tp_info(tp_group)
        shard_start = rank * vocab  # equal shards, contiguous (Megatron's vocab split)
        state = hidden.new_empty((4, rows), dtype=torch.float32)
        buf = _TileBuffer(hidden, token_chunk, vocab_chunk)
        for t0 in range(0, rows, token_chunk):
            t1 = min(t0 + token_chunk, rows)
            st = hidden.new_empty((4, t1 - t0), dtype=torch.float32)
            st[0].fill_(float("-inf"))
            st[1:].zero_()
            h = hidden[t0:t1]
            y = targets[t0:t1]
            for v0 in range(0, vocab, vocab_chunk):
                v1 = min(v0 + vocab_chunk, vocab)
                tile = _mm_f32(h, weight[v0:v1].T, out=buf.get(t1 - t0, v1 - v0))
                logprobs_tile_stats_op(
                    logits=tile,
                    targets=y,
                    vocab_start=shard_start + v0,
                    temperature=temperature,
                    with_entropy=with_entropy,
                    state_in=st,
                    backend=backend,
                    out=st,
                )
            state[:, t0:t1] = st
        m, log_s, logp, entropy = _finalize(
            state, 1.0 / temperature, with_entropy, tp_group, targets, vocab * _tp_info(tp_group)[1]
        )
        ctx.save_for_backward(hidden, weight, targets, m, log_s, entropy if with_entropy else m)
        ctx.cfg = (temperature, with_entropy, tp_group, chunks, backend, shard_start, grad_dtype)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            return logp, None
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, m, log_s, entropy = ctx.saved_tensors
        temperature, with_entropy, tp_group, (token_chunk, vocab_chunk), backend, shard, gd = (
            ctx.cfg
        )
        gl = _grad_vector(grad_logprob)
        gh = _grad_vector(grad_entropy) if with_entropy else None
        if gl is None and gh is None:
            return (None,) * len(ctx.needs_input_grad)
        rows, vocab = hidden.shape[0], weight.shape[0]
        # float32 accumulators for the whole backward: the hidden and weight
        # gradients sum over vocab tiles / token tiles and round once at the end.
        want_h, want_w = ctx.needs_input_grad[:2]  # a frozen lm_head skips its GEMM
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        d_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        )
        buf = _TileBuffer(hidden, token_chunk, vocab_chunk)
        half = gd != torch.float32  # gradient GEMMs on gd operands (the tile rounded once)
        if half:
            gbuf = torch.empty_like(buf.flat, dtype=gd)
            hdim = hidden.shape[1]
            # a float32 product temporary only where addmm cannot accumulate in place
            tmp = mixed_mm_supported(hidden.device) and not mixed_addmm_supported(hidden.device)
            tmp_h = (
                hidden.new_empty((min(token_chunk, rows), hdim), dtype=torch.float32)
                if tmp
                else None
            )
            tmp_w = (
                hidden.new_empty((min(vocab_chunk, vocab), hdim), dtype=torch.float32)
                if tmp and want_w
                else None
            )
        for t0 in range(0, rows, token_chunk):
            t1 = min(t0 + token_chunk, rows)
            h = hidden[t0:t1]
            h32 = h if h.dtype == torch.float32 or half else h.float()
            per_row = dict(
                targets=targets[t0:t1],
                row_max=m[t0:t1],
                log_norm=log_s[t0:t1],
                entropy=entropy[t0:t1],
                grad_logprob=None if gl is None else gl[t0:t1],
                grad_entropy=None if gh is None else gh[t0:t1],
            )
            for v0 in range(0, vocab, vocab_chunk):
                v1 = min(v0 + vocab_chunk, vocab)
                w = weight[v0:v1]
                tile = _mm_f32(h, w.T, out=buf.get(t1 - t0, v1 - v0))
                # d logits: float32 in the kernel, stored once, in place over the
                # float32 tile, or straight to gd (rounded at the store, no copy).
                g = gbuf[: tile.numel()].view(tile.shape) if half else tile
                token_logprobs_entropy_bwd_op(
                    logits=tile,
                    **per_row,
                    temperature=temperature,
                    vocab_start=shard + v0,
                    backend=backend,
                    out=g,
                )
                if half:
                    # the first tile of a sum writes its product (no fp32 temporary)
                    if want_h or tp_group is not None:
                        th = None if tmp_h is None else tmp_h[: t1 - t0]
                        _grad_mm_sum(d_hidden[t0:t1], g, w, th, first=v0 == 0)
                    if want_w:
                        tw = None if tmp_w is None else tmp_w[: v1 - v0]
                        _grad_mm_sum(d_weight[v0:v1], g.T, h, tw, first=t0 == 0)
                    continue
                w32 = w if w.dtype == torch.float32 else w.float()
                if want_h or tp_group is not None:
                    d_hidden[t0:t1].addmm_(tile, w32)
                if want_w:
                    d_weight[v0:v1].addmm_(tile.T, h32)
        if tp_group is not None:
            import torch.distributed as dist

            # Each rank holds the gradient through its vocab shard; the hidden
            # states are replicated, so their gradient is the sum.
            dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=tp_group)
        d_h = d_hidden.to(hidden.dtype) if want_h else None
        d_w = d_weight.to(weight.dtype) if want_w else None
        return (d_h, d_w) + (None,) * (len(ctx.needs_input_grad) - 2)


def fused_linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    tp_group=None,
    token_chunk: int = TOKEN_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
    validate: bool | None = None,
    backend: str | None = None,
    grad_gemm_dtype: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy of ``hidden @ weight.T`` without building [T, V].

    Parameters
    ----------
    hidden : [T, H] float32 | bfloat16 (the last hidden states, before lm_head).
    weight : [V_local, H], hidden's dtype: the lm_head weight, or this rank's
        contiguous vocab shard when ``tp_group`` is given (rank r holds rows
        [r * V_local, (r + 1) * V_local) of the full vocabulary: equal shards,
        as Megatron's vocab-parallel split).
    targets : [T] integer ids in the full vocabulary [0, V_local * tp_size).
    temperature : float > 0.
    with_entropy : also return the entropy.
    tp_group : a torch.distributed group over which the vocab is sharded:
        per-token statistics are merged with one all-reduce MAX and one SUM
        ([3, T] floats), the hidden-state gradient with one SUM.
    token_chunk, vocab_chunk : the tile of float32 logits held at once.
    validate : check targets' range and that hidden / weight are finite
        (default: on for CPU tensors, off on CUDA where it costs a host sync).
        NaN / Inf policy: hidden and weight must be finite (ValueError naming
        which where checked); unchecked, a non-finite hidden row gives NaN
        for that token, a non-finite weight row NaN for every token.
    backend : kernels of the per-tile statistics: None (CPU "torch", CUDA
        "triton"), "torch" or "triton".
    grad_gemm_dtype : operands of the backward's gradient GEMMs: "input"
        (hidden's dtype: each float32 d logits tile is rounded once to it, the
        GEMM accumulates in float32 and writes float32 where torch.mm has
        out_dtype, i.e. CUDA; elsewhere its product is rounded to the input
        dtype before the float32 accumulators), "fp32", or "auto" (default:
        "input" on CUDA, "fp32" on the CPU, where bf16 GEMMs are slow without
        AVX-512-BF16). Same for float32 inputs.

    Returns
    -------
    logprobs : [T] float32 (never positive), entropy : [T] float32 or None.
    Differentiable w.r.t. hidden and weight (gradients in their dtypes).

    Notes
    -----
    The backward recomputes each logits tile (one more GEMM than a loss that
    knows its per-token gradients in the forward): the outputs are per-token
    values whose upstream gradients are unknown until the backward, and
    d_weight = sum_t g_t (onehot - p_t) h_t^T does not factor without them.
    Peak extra memory: one [token_chunk, vocab_chunk] float32 tile plus float32
    gradient accumulators of hidden's and weight's shapes.
    """
    h, w, y, temp = check_linear_inputs(hidden, weight, targets, temperature, tp_group, validate)
    for name, c in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if not (isinstance(c, int) and c > 0):
            raise ValueError(f"{name}: expected a positive int, got {c!r}")
    gd = resolve_grad_gemm_dtype(grad_gemm_dtype, h.dtype, h.device)
    return _FusedLinearLogprobs.apply(
        h, w, y, temp, bool(with_entropy), tp_group, (token_chunk, vocab_chunk), backend, gd
    )


def check_linear_inputs(hidden, weight, targets, temperature, tp_group, validate):
    """Validate the inputs of the fused-linear ops; (hidden, weight, targets as
    int64, temperature), all contiguous."""
    check_tensor("hidden", hidden, ndim=2, dtypes=_LOGITS_DTYPES)
    dev = hidden.device
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=dev)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight: expected [V, {hidden.shape[1]}] (hidden size of hidden), got "
            f"{describe(weight)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight: expected a vocabulary of at least 1, got {describe(weight)}")
    y = _check_targets(targets, hidden.shape[0], dev)
    temp = _check_temperature(temperature)
    _, world = _tp_info(tp_group)
    if should_check(validate, hidden, weight, y):
        _check_targets_range(y, weight.shape[0] * world)
        for name, t in (("hidden", hidden), ("weight", weight)):
            if not bool(torch.isfinite(t.detach()).all()):
                raise ValueError(f"{name}: expected finite values, got NaN or inf")
    h = hidden if hidden.is_contiguous() else hidden.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    return h, w, y, temp
