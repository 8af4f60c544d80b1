"""FP8 grouped expert GEMM with blockwise scales (``ck.fp8.grouped_gemm``).

Token-packed: the rows of expert ``e`` are ``[expert_offsets[e],
expert_offsets[e+1])`` of the permuted activations, with no padding between
experts (the layout ``ck.fp8``'s fused permute + 1x128 quantization produces).
Kernels: ``torch`` (CPU tensors: float32 dequantise + matmul), ``cuda`` (CUTLASS sm_90a
pointer-array grouped GEMM with blockwise scaling, its arguments built on the
device), ``triton`` (``triton_gemm.py``, CUDA tensors, or CPU tensors in the
interpreter). Spec: ``reference_gemm.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from compass_kernels._ext import BackendUnavailableError, load
from compass_kernels._op import op
from compass_kernels._validate import (
    check_finite,
    check_offsets,
    check_tensor,
    describe,
    should_check,
)

__all__ = [
    "grouped_gemm",
    "grouped_gemm_workspace",
    "GroupedGemmWorkspace",
    "grouped_gemm_op",
    "grouped_args_op",
    "OUT_DTYPES",
    "PTR_ROWS",
]

#: Output dtypes and their codes at the kernel boundary.
OUT_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
_FROM_CODE = {v: k for k, v in OUT_DTYPES.items()}
_FP8 = (torch.float8_e4m3fn,)
_F32 = (torch.float32,)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cutlass_entry_points():
    """(argument builder, GEMM, tile heuristic), looked up once: the builder is
    Triton (triton_args.py), the GEMM and the heuristic are in _C."""
    ext = load().fp8
    if not hasattr(ext, "grouped_gemm_sm90_cuda"):
        raise BackendUnavailableError(
            "fp8_grouped_gemm: compass_kernels._C was built without the CUTLASS kernel (no "
            "CUTLASS headers at build time): reinstall from source with nvcc on PATH and build "
            "isolation (`pip install --force-reinstall --no-deps .` adds nvidia-cutlass to the "
            "build), or set COMPASS_CUTLASS_INCLUDE; or pass backend='triton'"
        )
    try:
        from compass_kernels.fp8.triton_args import launch_grouped_args
    except ImportError as err:
        raise BackendUnavailableError(
            "fp8_grouped_gemm: the CUTLASS backend builds its per-expert arguments with a Triton "
            f"kernel, and triton is not importable ({err}): pip install 'compass_kernels[triton]'"
        ) from None
    return launch_grouped_args, ext.grouped_gemm_sm90_cuda, ext.choose_sm90_tile


@functools.lru_cache(maxsize=1024)
def _tile(rows: int, experts: int, n: int, sms: int) -> int:
    return _cutlass_entry_points()[2](rows, experts, n, sms)


#: (device index, stream, experts, tile, SMs) -> (shapes, ptrs, workspace): the
#: argument builder's outputs and the CUTLASS workspace, allocated once per key
#: and reused by every call on that stream (stream order serialises the calls
#: that share them). Filled outside CUDA-graph capture only (a capture allocates
#: from the graph's private pool: fresh buffers there, as before).
_BUFFERS: dict[tuple[int, int, int, int, int], tuple[torch.Tensor, ...]] = {}


def cutlass_launch_args(a_q, b_q, stream, sms):
    """Everything the two C++ entries need beyond the GEMM's operands:
    (shapes [E, 3] int32, ptrs [5, E] int64, workspace uint8, tile). Reused per
    (device, stream, E, tile, SMs); the tile per (rows, E, N, SMs)."""
    e, n = b_q.shape[0], b_q.shape[1]
    tile = _tile(a_q.shape[0], e, n, sms)
    dev = a_q.device
    key = (dev.index or 0, stream, e, tile, sms)
    bufs = _BUFFERS.get(key)
    if bufs is None:
        bufs = (
            torch.empty((e, 3), dtype=torch.int32, device=dev),
            torch.empty((len(PTR_ROWS), e), dtype=torch.int64, device=dev),
            torch.empty(_workspace_bytes(tile, e, sms), dtype=torch.uint8, device=dev),
        )
        if dev.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _BUFFERS[key] = bufs
    return (*bufs, tile)


def grouped_gemm_cutlass(
    *,
    a_q,
    a_scales,
    b_q,
    b_scales,
    expert_offsets,
    out_dtype,
    workspace=None,
    workspace_shapes=None,
    workspace_ptrs=None,
    out,
    stream,
):
    """The ``cuda`` backend: CUTLASS sm_90a (csrc/fp8/grouped_gemm_sm90.cuh).

    Two launches on ``stream``, no host sync: the argument builder (Triton,
    triton_args.py: problem shapes and pointer arrays from the offsets, on the
    device), then the
    grouped GEMM in the tile configuration ``fp8.choose_sm90_tile`` picks
    from shapes (64-row pingpong tiles for decode-sized groups, 128-row
    cooperative tiles for prefill). Needs K % 16 == 0, N % 8 == 0, bf16 output
    and K-major contiguous scales (checked, with a clear error, at the C++
    boundary). Host side per call: one Triton launch and one C++ entry; the
    builder's outputs, the workspace and the tile choice come from per-shape
    caches, or, with ``workspace`` / ``workspace_shapes`` / ``workspace_ptrs``
    (views of a :class:`GroupedGemmWorkspace`), from the caller: nothing is
    allocated. The Triton launch goes to torch's current stream: ``stream`` is
    that stream's handle (``_op`` passes ``cuda_stream``)."""
    build_args, gemm, _ = _cutlass_entry_points()
    sms = _sm_count(a_q.device.index or 0)
    if workspace is None:
        shapes, ptrs, ws, tile = cutlass_launch_args(a_q, b_q, stream, sms)
    else:
        e = b_q.shape[0]
        tile = _tile(a_q.shape[0], e, b_q.shape[1], sms)
        shapes, ptrs, ws = workspace_shapes, workspace_ptrs, workspace
        need = _workspace_bytes(tile, e, sms)
        if ws.numel() < need:
            raise ValueError(
                f"workspace: the CUTLASS tile configuration {tile} needs {need} bytes for "
                f"{e} experts on {sms} SMs, the workspace holds {ws.numel()}: make it with "
                "ck.fp8.grouped_gemm_workspace(num_experts, device=...) on this device"
            )
    build_args(a_q, a_scales, b_q, b_scales, expert_offsets, out, shapes, ptrs)
    gemm(
        a_q,
        a_scales,
        b_q,
        b_scales,
        expert_offsets,
        out_dtype,
        out,
        tile,
        shapes,
        ptrs,
        ws,
        sms,
        stream,
    )


@functools.cache
def _workspace_bytes(tile: int, experts: int, sms: int) -> int:
    return load().fp8.grouped_gemm_sm90_workspace(tile, experts, sms)


#: Alignment of each region of a GroupedGemmWorkspace (CUTLASS's TMA descriptors
#: need 128 bytes, csrc/fp8/sm90_workspace.h).
_ALIGN = 128
#: CUTLASS tile configurations (csrc/fp8/sm90_tiles.h: kNumSm90Tiles).
_NUM_TILES = 2


def _round_up(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


def _gemm_region_bytes(num_experts: int, sms: int) -> int:
    """Bytes of CUTLASS workspace that serve every tile configuration for up to
    ``num_experts`` experts on ``sms`` SMs (the largest over tiles; the per-call
    check in :func:`grouped_gemm_cutlass` holds the rest of the contract)."""
    return max(_workspace_bytes(tile, num_experts, sms) for tile in range(_NUM_TILES))


class GroupedGemmWorkspace:
    """Every buffer a :func:`grouped_gemm` call with up to ``num_experts`` experts
    needs beyond its operands and output, on one device: made by
    :func:`grouped_gemm_workspace`, passed as ``grouped_gemm(..., workspace=)``.

    One uint8 ``buffer``: the argument builder's pointer arrays ([5, E] int64)
    at offset 0, its problem shapes ([E, 3] int32), then CUTLASS's region
    (``gemm_bytes``: the largest any tile configuration needs at ``num_experts``
    on this device's SM count; 0 on CPU, where CUTLASS does not run), each at a
    128-byte boundary. The Triton and torch backends need no scratch. A call
    with E <= ``num_experts`` experts uses views of it (made once per E and
    kept here), so it allocates nothing but its output (nothing with ``out=``)
    and can be captured in a CUDA graph. Calls sharing a workspace must be
    ordered (one stream, or a graph's order), as calls sharing an output are.
    """

    __slots__ = ("buffer", "num_experts", "gemm_bytes", "_views")

    def __init__(self, buffer: torch.Tensor, num_experts: int, gemm_bytes: int) -> None:
        self.buffer = buffer
        self.num_experts = num_experts
        self.gemm_bytes = gemm_bytes
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def device(self) -> torch.device:
        """The device of ``buffer`` (a call's operands must be on it)."""
        return self.buffer.device

    @staticmethod
    @functools.cache
    def nbytes_for(num_experts: int, gemm_bytes: int) -> int:
        """Bytes of the buffer: pointer arrays, shapes, CUTLASS's region (cached:
        the per-call check reads it)."""
        ptrs, shapes = _round_up(8 * len(PTR_ROWS) * num_experts), _round_up(12 * num_experts)
        return ptrs + shapes + _round_up(gemm_bytes)

    def views(self, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(shapes [E, 3] int32, ptrs [5, E] int64, CUTLASS region uint8) for a call
        with ``experts`` experts (1 <= E <= num_experts; views, kept per E)."""
        v = self._views.get(experts)
        if v is None:
            cap, buf = self.num_experts, self.buffer
            at = _round_up(8 * len(PTR_ROWS) * cap)
            ptrs = buf[: 8 * len(PTR_ROWS) * experts].view(torch.int64)
            shapes = buf[at : at + 12 * experts].view(torch.int32).view(experts, 3)
            gemm = buf[at + _round_up(12 * cap) :]
            v = self._views[experts] = (shapes, ptrs.view(len(PTR_ROWS), experts), gemm)
        return v

    def __repr__(self) -> str:
        return (
            f"GroupedGemmWorkspace(num_experts={self.num_experts}, device={self.device}, "
            f"{self.buffer.numel()} bytes, CUTLASS region {self.gemm_bytes} bytes)"
        )


def grouped_gemm_workspace(
    num_experts: int, *, device: torch.device | str | int | None = None
) -> GroupedGemmWorkspace:
    """The buffers of :func:`grouped_gemm` calls with up to ``num_experts`` experts.

    Parameters
    ----------
    num_experts : E >= 1, the largest expert count of the calls it serves
        (``b_q.shape[0]``).
    device : the operands' device (default: the current CUDA device). On CUDA
        the CUTLASS region is sized for this device's SM count and every tile
        configuration, so any token count fits (the rows do not enter its size);
        on CPU it is empty (no backend there needs scratch).

    Returns
    -------
    :class:`GroupedGemmWorkspace`, one allocation (67 KiB at E = 8, 95 KiB at
    E = 256 on an H100's 132 SMs, most of it CUTLASS's per-SM state; 512 bytes
    at E = 8 on CPU). Pass it as ``grouped_gemm(..., workspace=ws, out=out)``: the
    call then allocates nothing and reads nothing back to the host.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        ext = load().fp8
        gemm_bytes = 0
        if hasattr(ext, "grouped_gemm_sm90_workspace"):  # a build with CUTLASS
            gemm_bytes = _gemm_region_bytes(num_experts, _sm_count(dev.index))
    elif dev.type == "cpu":
        gemm_bytes = 0
    else:
        raise ValueError(f"device: expected a cpu or cuda device, got {dev}")
    nbytes = GroupedGemmWorkspace.nbytes_for(num_experts, gemm_bytes)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    if dev.type == "cuda" and buf.data_ptr() % _ALIGN:
        raise ValueError(
            f"device: the allocator returned a workspace at {buf.data_ptr():#x}, not on "
            f"{_ALIGN} bytes (CUTLASS's TMA descriptors need it)"
        )
    return GroupedGemmWorkspace(buf, num_experts, gemm_bytes)


def _check_workspace(workspace, dev: torch.device, experts: int) -> None:
    """Metadata only (no sync): always checked, ``validate`` does not turn it off."""
    if not isinstance(workspace, GroupedGemmWorkspace):
        raise ValueError(
            "workspace: expected a ck.fp8.GroupedGemmWorkspace (from "
            f"ck.fp8.grouped_gemm_workspace), got {type(workspace).__name__}"
        )
    buf = workspace.buffer
    if buf.device != dev:
        raise ValueError(
            f"workspace: expected a workspace on {dev} (a_q's device), got one on {buf.device}"
        )
    if experts > workspace.num_experts:
        raise ValueError(
            f"workspace: holds buffers for up to {workspace.num_experts} experts, the call has "
            f"{experts} (b_q.shape[0]): make one with grouped_gemm_workspace({experts}, ...)"
        )
    want = GroupedGemmWorkspace.nbytes_for(workspace.num_experts, workspace.gemm_bytes)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() < want:
        raise ValueError(
            f"workspace: expected its buffer to be a contiguous 1-d uint8 tensor of >= {want} "
            f"bytes, got {describe(buf)}"
        )


@op(
    kernels={
        "torch": "compass_kernels.fp8.reference_gemm:grouped_gemm_torch",
        "cuda": "compass_kernels.fp8.grouped_gemm:grouped_gemm_cutlass",
        "triton": "compass_kernels.fp8.triton_gemm:grouped_gemm_triton",
    },
    name="fp8_grouped_gemm",
)
def grouped_gemm_op(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: int,
    workspace: torch.Tensor | None = None,
    workspace_shapes: torch.Tensor | None = None,
    workspace_ptrs: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [M, N] (OUT_DTYPES code) = per expert e, rows o[e]..o[e+1] of a_q [M, K]
    times b_q[e] [N, K] transposed, blockwise scales (see :func:`grouped_gemm`).
    ``workspace`` (uint8, CUTLASS's region), ``workspace_shapes`` [E, 3] int32 and
    ``workspace_ptrs`` [5, E] int64: the caller's buffers of the ``cuda`` backend
    (views of a :class:`GroupedGemmWorkspace`, all or none); None: its own caches.
    The other backends need no scratch and ignore them."""
    return a_q.new_empty((a_q.shape[0], b_q.shape[1]), dtype=_FROM_CODE[out_dtype])


#: Rows of the pointer arrays the argument builder writes (compass/fp8.h: PtrRow).
PTR_ROWS = ("a", "b", "a_scales", "b_scales", "out")


class GroupedArgs(NamedTuple):
    """Outputs of :data:`grouped_args_op`."""

    shapes: torch.Tensor  # [E, 3] int32 problem shapes (m, n, k)
    ptrs: torch.Tensor  # [5, E] int64 pointer arrays, rows PTR_ROWS


# The device-side argument builder of a pointer-array grouped GEMM (CUTLASS's
# problem shapes and ptr_A/B/SFA/SFB/D arrays) from the expert offsets: no
# host sync, CUDA-graph safe. Internal; the cpp backend is the reference the
# triton one (triton_args.py) is held to (tests/test_fp8_gemm_args.py).
@op(
    kernels={
        "cpp": "fp8.grouped_args_cpu",
        "triton": "compass_kernels.fp8.triton_args:grouped_args_triton",
    },
    name="fp8_grouped_gemm_args",
)
def grouped_args_op(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    gemm_out: torch.Tensor,
) -> GroupedArgs:
    """Problem shapes and pointer arrays of the grouped GEMM writing ``gemm_out``
    (the C++ entry point's ``out``)."""
    e = b_q.shape[0]
    return GroupedArgs(
        shapes=a_q.new_empty((e, 3), dtype=torch.int32),
        ptrs=a_q.new_empty((len(PTR_ROWS), e), dtype=torch.int64),
    )


def _check_shapes(a_q, a_scales, b_q, b_scales, expert_offsets) -> None:
    check_tensor("a_q", a_q, ndim=2, dtypes=_FP8)
    m, k = a_q.shape
    dev = a_q.device
    check_tensor("b_q", b_q, ndim=3, dtypes=_FP8, device=dev)
    e, n, kb_ = b_q.shape
    # The offsets come from the permutation (the routing's expert count): when the two
    # disagree, the weights are the ones for another model or layer.
    check_tensor("expert_offsets", expert_offsets, ndim=1, dtypes=(torch.int64,), device=dev)
    if expert_offsets.shape[0] < 2:
        raise ValueError(
            f"expert_offsets: expected E + 1 >= 2 elements, got {describe(expert_offsets)}"
        )
    if e != expert_offsets.shape[0] - 1:
        raise ValueError(
            f"b_q: expected weights for {expert_offsets.shape[0] - 1} experts in dim 0 "
            f"(expert_offsets has {expert_offsets.shape[0]} = E + 1 entries), got {describe(b_q)}"
        )
    if kb_ != k:
        raise ValueError(f"b_q: expected K = {k} (a_q.shape[1]) in dim 2, got {describe(b_q)}")
    if k == 0 or e == 0:
        raise ValueError(
            f"a_q, b_q: expected K >= 1 and E >= 1, got {describe(a_q)}, {describe(b_q)}"
        )
    if (a_q.stride(1) != 1 and k > 1) or (b_q.stride(2) != 1 and k > 1):
        raise ValueError(
            f"a_q, b_q: expected unit stride along K, got strides {a_q.stride()} and {b_q.stride()}"
        )
    kb, nb = -(-k // 128), -(-n // 128)
    check_tensor("a_scales", a_scales, ndim=2, dtypes=_F32, device=dev)
    if tuple(a_scales.shape) != (m, kb):
        raise ValueError(
            f"a_scales: expected shape [{m}, {kb}] = [M, ceil(K/128)], got {describe(a_scales)}"
        )
    check_tensor("b_scales", b_scales, ndim=3, dtypes=_F32, device=dev)
    if tuple(b_scales.shape) != (e, nb, kb):
        raise ValueError(
            f"b_scales: expected shape [{e}, {nb}, {kb}] = [E, ceil(N/128), "
            f"ceil(K/128)], got {describe(b_scales)}"
        )


def grouped_gemm(
    a_q: torch.Tensor,
    a_scales: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    validate: bool | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
    workspace: GroupedGemmWorkspace | None = None,
) -> torch.Tensor:
    """``out[m] = dequant(a_q[m]) @ dequant(b_q[e]).T`` for the rows m of each expert e.

    Parameters
    ----------
    a_q : [M, K] float8_e4m3fn, unit stride along K; rows sorted by expert.
    a_scales : [M, ceil(K/128)] float32, one scale per row and 128 of K; any
        strides (K-major, or the MN-major / TMA-aligned column layouts).
    b_q : [E, N, K] float8_e4m3fn, unit stride along K.
    b_scales : [E, ceil(N/128), ceil(K/128)] float32 (128x128 blocks), any strides.
    expert_offsets : [E+1] int64, 0 = o[0] <= o[1] <= ... <= o[E] = M. Experts
        with no rows cost nothing.
    out_dtype : torch.bfloat16 (default) or torch.float32.
    validate : check the offsets' contents and the scales, as
        ``_validate.should_check`` says: None (default) on CPU tensors, not on
        CUDA (a host sync; bad offsets are then undefined behaviour, as in every
        varlen kernel); True everywhere; False never; never on fake / meta
        tensors or while tracing.
    NaN / Inf policy: ``a_scales`` and ``b_scales`` must be finite; checked as
        ``validate`` says (one float64 sum of the small scale tensors); unchecked, a non-finite
        scale makes the output rows / columns of its block NaN / Inf. NaN
        encodings in ``a_q`` / ``b_q`` (e4m3fn 0x7f / 0xff) are never checked
        (a pass over the operands): they give NaN in the rows / columns they touch.
    backend : None (default dispatch: torch on CPU, cuda = CUTLASS on CUDA), "torch",
        "cuda" or "triton". The CUTLASS kernel needs bf16 output, K % 16 == 0,
        N % 8 == 0 and K-major contiguous scales; the Triton kernel takes any.
    out : [M, N] output to write (tests pass poisoned buffers).
    workspace : a :class:`GroupedGemmWorkspace` (:func:`grouped_gemm_workspace`)
        on a_q's device for >= E experts: the call takes every scratch buffer
        from it, so with ``out`` too it allocates nothing (decode under CUDA
        graphs). Checked always (metadata, no sync): device, expert capacity,
        buffer dtype and size, and (backend ``cuda``) the CUTLASS region's size
        for the chosen tile. None (default): the backend's own caches.

    K and N need not be multiples of 128 (partial last blocks use their own
    scales, as the quantizer's ragged blocks do).

    Returns
    -------
    out : [M, N] ``out_dtype``; fp32 accumulation promoted every 128 of K.
    """
    _check_shapes(a_q, a_scales, b_q, b_scales, expert_offsets)
    code = OUT_DTYPES.get(out_dtype)
    if code is None:
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    dev = a_q.device
    if should_check(validate, a_q, expert_offsets, a_scales, b_scales):
        check_offsets("expert_offsets", expert_offsets, a_q.shape[0], exact=True)
        check_finite("a_scales", a_scales.reshape(-1))
        check_finite("b_scales", b_scales.reshape(-1))
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(out_dtype,), device=dev)
        m, n = a_q.shape[0], b_q.shape[1]
        if tuple(out.shape) != (m, n) or (out.stride(1) != 1 and n > 1):
            raise ValueError(
                f"out: expected shape [{m}, {n}] with unit stride along N, got "
                f"{describe(out)} strides {out.stride()}"
            )
    if backend == "cuda" or (backend is None and dev.type == "cuda"):
        _check_tma_alignment(a_q=a_q, b_q=b_q, out=out)
    ws = shapes = ptrs = None
    if workspace is not None:
        e = b_q.shape[0]
        _check_workspace(workspace, dev, e)
        shapes, ptrs, ws = workspace.views(e)
    return grouped_gemm_op(
        a_q=a_q,
        a_scales=a_scales,
        b_q=b_q,
        b_scales=b_scales,
        expert_offsets=expert_offsets,
        out_dtype=code,
        workspace=ws,
        workspace_shapes=shapes,
        workspace_ptrs=ptrs,
        backend=backend,
        out=out,
    )


def _check_tma_alignment(**tensors: torch.Tensor | None) -> None:
    """The CUTLASS kernel reads a_q, b_q and writes out through TMA from their base
    addresses: each must start on 16 bytes. With device-side problem shapes CUTLASS
    skips its own per-group checks, so a misaligned view (``a_q[1:]``) would reach
    TMA; checked here from metadata (no sync), and again in C++."""
    for name, t in tensors.items():
        if t is not None and t.data_ptr() % 16:
            raise ValueError(
                f"{name}: the CUTLASS kernel (backend 'cuda') needs a 16-byte aligned start "
                f"(TMA), got address {t.data_ptr():#x} ({describe(t)}, storage offset "
                f"{t.storage_offset()}): pass a contiguous copy, or backend='triton'"
            )
