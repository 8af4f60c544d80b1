"""Test-only numerical fix of the Triton interpreter (``TRITON_INTERPRET=1`` on CPU).

The Triton 3.x interpreter runs kernels on NumPy arrays. Types NumPy lacks are
stored as raw bits (bfloat16 as ``uint16``, float8 as ``uint8``), and several
builders get them wrong (measured on triton 3.9, tests/test_triton_interpreter.py):

- ``tl.dot`` on bfloat16 operands multiplies the raw ``uint16`` bit patterns
  (``InterpreterBuilder.create_dot`` calls ``np.matmul`` on them): garbage.
- fp32 -> bf16 (``cast_impl`` via ``_convert_float`` with no rounding mode)
  truncates instead of rounding to nearest even; bf16 -> fp32 of subnormals
  is wrong.
- fp32 -> float8 (``create_fp_to_fp`` via ``_convert_float``) rounds half up,
  lets the rounding carry corrupt the exponent (some values come out halved)
  and does not saturate; e5m2 inf -> fp32 gives 65536.
- integer -> bf16 (``cast_impl``) stores the integer value as the bit pattern.
- A ``@triton.jit`` helper called from a kernel (``tl.sum``, ``tl.max``,
  ``tl.cdiv`` are such helpers) patches ``triton.language.core`` with the
  interpreter's semantics and never undoes it: ``InterpretedFunction.__call__``
  drops the ``_LangPatchScope`` that ``_patch_lang`` returns. Interpreted runs
  do not mind, but a later compile in the same process
  (``tests.aot``) then fails deep inside code generation.

- NaN: the GPU's ``tl.maximum`` / ``tl.minimum`` / ``tl.clamp`` without
  ``propagate_nan`` drop NaN (PTX ``max.f32``); Triton 3.6's interpreter keeps it
  (``np.maximum``, ``np.clip``), so a kernel that hides a NaN on the GPU passed
  here. ``create_maxnumf`` / ``create_minnumf`` / ``create_clampf`` get the GPU's
  semantics (``np.fmax`` / ``np.fmin``; NaN kept with ``PropagateNan.ALL``), as
  Triton 3.9's interpreter already has. And ``tl.reduce`` with a combine the
  interpreter has no NumPy twin for (a NaN-propagating max) ran the combine once
  per element in Python; ``ReduceOps.generic_reduce`` runs it as a tree on whole
  halves (log2 n calls).

:func:`apply` replaces ``InterpreterBuilder.create_dot``, ``cast_impl`` and
``create_fp_to_fp`` with wrappers that convert through torch, and wraps
``InterpretedFunction.__call__`` and ``_patch_lang`` so that each helper call
restores the patches it made, as a kernel launch already does. Casts use
``torch.Tensor.to`` (round to nearest even, or toward zero when the kernel asks
for ``fp_downcast_rounding="rtz"``; saturation / overflow exactly as torch:
float8_e4m3fn saturates to +-448, float8_e5m2 overflows to inf; float64 and
integer sources are rounded to odd into fp32 first, so they are rounded once,
as the GPU's ``cvt.rn.bf16.f64`` / ``cvt.rn.bf16.s32`` do, where torch alone
would round twice through fp32), dots upcast
the operands exactly and call ``torch.matmul`` in float32 (float64 for
float64 accumulators). Anything the wrappers do not cover (integer dots,
float8e4b15, integer <-> integer casts, casts between integers and NumPy-native
floats, which NumPy does right) goes to the original builder unchanged.

Opt-in: :func:`fp8_imprecise_accumulation` (a context manager) emulates the
reduced-precision accumulation of fp8 ``tl.dot`` on sm_90 (wgmma) and honours
``max_num_imprecise_acc`` as Triton's lowering does, so an FP8 GEMM that does
not promote its accumulator to fp32 fails in the interpreter as on an H100
(model and limits in its docstring). Off by default: then fp8 dots accumulate
in exact-product fp32, like every other dot here.

What the fixed interpreter still does not model (compare against the GPU, not
this, when these matter): TF32 operand rounding (``input_precision="tf32"``
dots are computed in full fp32), per-MMA-step rounding of fp16 accumulators,
GPU accumulation order, and fp8 overflow: Triton on sm_90 converts fp32 ->
e4m3 and -> e5m2 with ``cvt.rn.satfinite`` (tests/test_aot.py), so on the GPU
e5m2 saturates to +-57344 where torch (and so the fixed interpreter) gives inf.

This module patches process-global state of the installed Triton. It is meant
for tests (``tests/conftest.py`` calls :func:`apply` in a session fixture); it
is never imported by a production path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = [
    "apply",
    "revert",
    "is_applied",
    "fp8_imprecise_accumulation",
    "PATCHED_ATTRIBUTES",
]

#: What :func:`apply` replaces in ``triton.runtime.interpreter`` (``Class.method``
#: or a module-level function), with the parameter names the wrappers expect
#: (checked, so an upstream signature change fails loudly instead of misbehaving).
PATCHED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "InterpreterBuilder.create_dot": (
        "self",
        "a",
        "b",
        "d",
        "input_precision",
        "max_num_imprecise_acc",
    ),
    "InterpreterBuilder.cast_impl": ("self", "src", "dst_type"),
    "InterpreterBuilder.create_fp_to_fp": ("self", "src", "dst_type", "rounding_mode"),
    "InterpretedFunction.__call__": ("self", "args", "kwargs"),
    "_patch_lang": ("fn",),
    "InterpreterBuilder.create_maxnumf": ("self", "lhs", "rhs"),
    "InterpreterBuilder.create_minnumf": ("self", "lhs", "rhs"),
    "InterpreterBuilder.create_clampf": ("self", "arg", "lo", "hi", "propagate_nans"),
    "ReduceOps.generic_reduce": ("self", "input"),
    "InterpreterBuilder.create_fma": ("self", "x", "y", "z"),
}

_MARK = "__compass_interpreter_fix__"


def _triton_version() -> str:
    try:
        import triton
    except ImportError as exc:  # pragma: no cover - triton is a test dependency
        raise RuntimeError("tests.triton_interpreter needs triton installed") from exc
    return getattr(triton, "__version__", "unknown")


def _owner(interp: Any, key: str) -> tuple[Any, str]:
    """(object holding the attribute, attribute name) for a PATCHED_ATTRIBUTES key."""
    if "." in key:
        cls_name, name = key.split(".")
        return getattr(interp, cls_name, None), name
    return interp, key


def _interpreter_module() -> Any:
    """``triton.runtime.interpreter``, checked to hold everything the fix wraps.

    Raises
    ------
    RuntimeError
        Naming the Triton version and what is missing or changed.
    """
    version = _triton_version()
    stale = (
        "the interpreter internals this fix wraps have changed: update "
        "compass_kernels/triton_interpreter.py"
    )
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError as exc:
        raise RuntimeError(
            f"triton {version}: cannot import triton.runtime.interpreter ({exc}); "
            "tests.triton_interpreter supports the Triton 3.x interpreter"
        ) from exc
    missing = [
        f"triton.runtime.interpreter.{n}"
        for n in ("InterpreterBuilder", "InterpretedFunction", "TensorHandle", "_LangPatchScope")
        if not hasattr(interp, n)
    ]
    if not missing and not callable(getattr(interp._LangPatchScope, "restore", None)):
        missing.append("triton.runtime.interpreter._LangPatchScope.restore")
    missing += [
        f"triton.language.{n}"
        for n in ("bfloat16", "float8e4nv", "float8e5", "float8e4b8", "float8e5b16")
        if not hasattr(tl, n)
    ]
    if missing:
        raise RuntimeError(f"triton {version}: {', '.join(missing)} not found; {stale}")
    for key, params in PATCHED_ATTRIBUTES.items():
        owner, name = _owner(interp, key)
        fn = vars(owner).get(name)
        if fn is None or not callable(fn):
            raise RuntimeError(
                f"triton {version}: triton.runtime.interpreter.{key} not found; {stale}"
            )
        got = tuple(inspect.signature(getattr(fn, _MARK, fn)).parameters)
        if got != params:
            raise RuntimeError(
                f"triton {version}: {key} has parameters {got}, expected {params}; {stale}"
            )
    return interp


# --------------------------------------------------------------------------------------
# Triton scalar type <-> torch dtype. Storage: the NumPy dtype the interpreter keeps.


def _float_table() -> dict[Any, torch.dtype]:
    import triton.language as tl

    table = {
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
    # FNUZ formats (AMD); present in every torch this package supports, checked anyway.
    for tl_name, torch_name in (
        ("float8e4b8", "float8_e4m3fnuz"),
        ("float8e5b16", "float8_e5m2fnuz"),
    ):
        if hasattr(torch, torch_name):
            table[getattr(tl, tl_name)] = getattr(torch, torch_name)
    return table


# Same-width signed integer dtypes used to move raw bits between NumPy and torch.
_BITS_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS_NUMPY = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _is_numpy_native_float(tt) -> bool:
    import triton.language as tl

    return tt in (tl.float16, tl.float32, tl.float64)


def _to_torch(data: np.ndarray, tt, table: dict) -> torch.Tensor:
    """View interpreter storage ``data`` of Triton scalar type ``tt`` as a torch tensor."""
    arr = np.ascontiguousarray(data)
    if not arr.flags.writeable:  # torch.from_numpy warns on read-only arrays
        arr = arr.copy()
    if tt in table:
        width = arr.dtype.itemsize
        bits = torch.from_numpy(arr.view(_BITS_NUMPY[width]))
        return bits.view(table[tt])
    if arr.dtype == np.bool_:
        return torch.from_numpy(arr)
    if arr.dtype == np.uint64:
        # torch lacks general uint64 arithmetic; float64 is exact below 2**53.
        return torch.from_numpy(arr.astype(np.float64))
    return torch.from_numpy(arr.astype(np.int64, copy=False))


def _to_storage(t: torch.Tensor, np_dtype: np.dtype) -> np.ndarray:
    """Raw bits of ``t`` as the NumPy storage dtype the interpreter expects."""
    width = t.element_size()
    bits = t.contiguous().view(_BITS_TORCH[width]).numpy()
    return bits.view(np_dtype)


def _round_toward_zero(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Turn ``y = x.to(fmt)`` (nearest even) into round-toward-zero.

    Where rounding increased the magnitude (including a finite value rounded to
    inf), step one code down in magnitude: these formats are sign-magnitude, so
    decrementing the integer bit pattern of a nonzero value does exactly that.
    """
    x64, y64 = x.to(torch.float64), y.to(torch.float64)
    bigger = (y64.abs() > x64.abs()) & ~torch.isnan(x64)
    if not bool(bigger.any()):
        return y
    bits = y.view(_BITS_TORCH[y.element_size()])
    return torch.where(bigger, bits - 1, bits).view(y.dtype)


def _to_fp32_round_to_odd(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64 or integer, exact in float64) in fp32, rounded to odd.

    Round toward zero, then set the last bit of every inexact result. A later
    round-to-nearest-even into a format with at most 22 significand bits then
    equals one direct rounding of ``x`` (no double-rounding error). Integers
    beyond 2**53 are already rounded once by the float64 conversion.
    """
    x64 = x.to(torch.float64)
    y = _round_toward_zero(x64, x64.to(torch.float32))
    inexact = (y.to(torch.float64) != x64) & torch.isfinite(x64)
    bits = y.view(torch.int32)
    return torch.where(inexact, bits | 1, bits).view(torch.float32)


def _storage_dtype(tt) -> np.dtype:
    """NumPy dtype the interpreter stores values of float type ``tt`` in."""
    if _is_numpy_native_float(tt):
        return np.dtype({16: np.float16, 32: np.float32, 64: np.float64}[tt.primitive_bitwidth])
    return np.dtype({8: np.uint8, 16: np.uint16}[tt.primitive_bitwidth])


def _torch_cast(src, dst_tt, rounding_mode, table: dict, handle_cls) -> Any:
    """Cast interpreter TensorHandle ``src`` to ``dst_tt`` through torch.

    Covers float -> float (any pair torch has) and integer -> bf16 / float8.
    Returns ``None`` for every other pair (the caller uses the original builder).
    """
    from triton._C.libtriton import ir

    src_tt, dst_tt = src.dtype.scalar, dst_tt.scalar
    float_to_float = src_tt in table and dst_tt in table
    int_to_special = src_tt.is_int() and dst_tt in table and not _is_numpy_native_float(dst_tt)
    if not (float_to_float or int_to_special):
        return None
    x = _to_torch(src.data, src_tt, table)
    dst = table[dst_tt]
    if dst.itemsize < 4 and (x.dtype == torch.float64 or not x.is_floating_point()):
        # torch converts these through float32 (two roundings); the GPU rounds
        # once (cvt.rn.bf16.s32, cvt.rn.f16.f64, ...). Round to odd into fp32
        # first: with 24 >= 11 + 2 bits, the second rounding is then exact RNE.
        x = _to_fp32_round_to_odd(x)
    y = x.to(dst)
    if rounding_mode == ir.ROUNDING_MODE.RTZ and float_to_float:
        y = _round_toward_zero(x, y)
    return handle_cls(_to_storage(y, _storage_dtype(dst_tt)), dst_tt)


def _make_cast_impl(original: Callable, table: dict, handle_cls) -> Callable:
    def cast_impl(self, src, dst_type):
        out = _torch_cast(src, dst_type, None, table, handle_cls)
        return original(self, src, dst_type) if out is None else out

    return cast_impl


def _make_fp_to_fp(original: Callable, table: dict, handle_cls) -> Callable:
    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = _torch_cast(src, dst_type, rounding_mode, table, handle_cls)
        return original(self, src, dst_type, rounding_mode) if out is None else out

    return create_fp_to_fp


# ----------------------------------------------------------------------------------
# Hopper's reduced-precision fp8 accumulation (opt-in emulation)

#: Active emulation settings, or None (off). Set by fp8_imprecise_accumulation.
_FP8_ACC: dict | None = None
_FP8_LOCK = threading.Lock()
_SM90_DEFAULT_IMPRECISE = 2**30  # CUDAOptions.max_num_imprecise_acc_default on sm_90


def _truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``x`` with its mantissa cut to ``bits`` explicit bits (toward zero)."""
    keep = ~((1 << (23 - bits)) - 1)
    return (x.contiguous().view(torch.int32) & keep).view(torch.float32)


def _imprecise_fp8_dot(at, bt, acc, n_imprecise: int, cfg: dict) -> torch.Tensor:
    """fp8 x fp8 -> fp32 dot as wgmma accumulates it on sm_90 (the model in
    :func:`fp8_imprecise_accumulation`). ``at``, ``bt``: exact float64 operands,
    ``acc``: fp32 accumulator; returns fp32."""
    k_total, step, bits = at.shape[-1], cfg["k_per_instruction"], cfg["mantissa_bits"]

    def chunk(k0):  # one wgmma: exact products, exactly summed
        return torch.matmul(at[..., k0 : k0 + step], bt[..., k0 : k0 + step, :])

    def mma(running, k0):  # accumulate into the low-precision register
        return _truncate_mantissa((running.to(torch.float64) + chunk(k0)).to(torch.float32), bits)

    if n_imprecise > k_total:
        # No partial accumulator: wgmma accumulates into the running accumulator
        # itself, so the error compounds over the kernel's whole K loop.
        for k0 in range(0, k_total, step):
            acc = mma(acc, k0)
        return acc
    # needsPartialAccumulator: a fresh partial sum, added to acc with an fp32
    # FADD every n_imprecise elements (at least every instruction) and at the end.
    partial, count = torch.zeros_like(acc), 0
    for k0 in range(0, k_total, step):
        partial, count = mma(partial, k0), count + step
        if count >= n_imprecise or k0 + step >= k_total:
            acc, partial, count = acc + partial, torch.zeros_like(acc), 0
    return acc


@contextlib.contextmanager
def fp8_imprecise_accumulation(*, mantissa_bits: int = 13, k_per_instruction: int = 32):
    """Emulate Hopper's reduced-precision fp8 ``tl.dot`` accumulation in the interpreter.

    On sm_90 an fp8 x fp8 -> fp32 ``tl.dot`` lowers to wgmma, whose accumulator
    keeps fewer bits than fp32 (about 14 significant bits, DeepSeek-V3 report,
    sec. 3.3.2). Triton's ``max_num_imprecise_acc`` (default 2**30 on sm_90 when
    the kernel does not pass it, Triton's ``CUDAOptions``) bounds how many K
    elements may accumulate that way: when it is <= the dot's K, the lowering
    (WGMMA.cpp, ``needsPartialAccumulator``) accumulates into a fresh partial
    register and adds it to the fp32 accumulator with a real FADD every
    ``max_num_imprecise_acc`` elements (at least once per instruction, at most
    once per dot); otherwise wgmma accumulates straight into the accumulator
    passed in, so ``acc = tl.dot(a, b, acc)`` in a K loop stays imprecise for
    the whole loop. An FP8 GEMM that forgets to promote (``acc += tl.dot(a, b)``,
    or ``max_num_imprecise_acc``) is then measurably less accurate on an H100;
    inside this context manager it is in the interpreter too.

    Model: per wgmma instruction (``k_per_instruction`` = 32 fp8 elements), the
    products are summed exactly, added to the running low-precision accumulator,
    and the result is truncated toward zero to ``mantissa_bits`` explicit
    mantissa bits (13: 14 significant bits). The interpreter's default for an
    unspecified ``max_num_imprecise_acc`` is set to sm_90's 2**30 meanwhile.

    Limits: the hardware's internal alignment and truncation of the addends is
    not public; this model reproduces the size and the bias (toward zero) of the
    error, not its bits. It applies to every fp8 x fp8 -> fp32 dot, also to
    shapes for which Triton would not use wgmma (M not a multiple of 64, fewer
    than 4 warps): those would be exact on the GPU, so the emulation errs toward
    failing. fp16 / bf16 dots are unchanged. Requires :func:`apply`.

    Parameters
    ----------
    mantissa_bits : int, default 13
        Explicit mantissa bits the accumulator keeps after each instruction.
    k_per_instruction : int, default 32
        K elements per wgmma instruction for fp8 (m64nNk32).
    """
    global _FP8_ACC
    if not (1 <= mantissa_bits <= 23) or k_per_instruction < 1:
        raise ValueError(
            f"mantissa_bits must be in [1, 23] and k_per_instruction >= 1, got "
            f"{mantissa_bits} and {k_per_instruction}"
        )
    interp = _interpreter_module()
    if not is_applied():
        raise RuntimeError("fp8_imprecise_accumulation needs triton_interpreter.apply() first")
    builder = interp.interpreter_builder
    with _FP8_LOCK:
        if _FP8_ACC is not None:
            raise RuntimeError("fp8_imprecise_accumulation is already active (not reentrant)")
        saved = builder.options
        builder.options = dataclasses.replace(
            saved, max_num_imprecise_acc_default=_SM90_DEFAULT_IMPRECISE
        )
        _FP8_ACC = {"mantissa_bits": mantissa_bits, "k_per_instruction": k_per_instruction}
    try:
        yield
    finally:
        with _FP8_LOCK:
            builder.options = saved
            _FP8_ACC = None


def _make_dot(original: Callable, table: dict, handle_cls) -> Callable:
    import triton.language as tl

    fp8 = {t for t in (tl.float8e4nv, tl.float8e5, tl.float8e4b8, tl.float8e5b16) if t in table}

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_tt, b_tt, d_tt = a.dtype.scalar, b.dtype.scalar, d.dtype.scalar
        if a_tt not in table or b_tt not in table or d_tt not in table:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        cfg = _FP8_ACC
        if cfg is not None and a_tt in fp8 and b_tt in fp8 and d_tt == tl.float32:
            at = _to_torch(a.data, a_tt, table).to(torch.float64)
            bt = _to_torch(b.data, b_tt, table).to(torch.float64)
            acc = _to_torch(d.data, d_tt, table).to(torch.float32)
            res = _imprecise_fp8_dot(at, bt, acc, int(max_num_imprecise_acc), cfg)
            return handle_cls(_to_storage(res, _storage_dtype(d_tt)), d_tt)
        compute = torch.float64 if d_tt == tl.float64 else torch.float32
        # Upcasts of the operands are exact, and products of 8- and 16-bit floats
        # (<= 11-bit significands) are exact in fp32: for those only the
        # accumulation order can differ from a GPU.
        at = _to_torch(a.data, a_tt, table).to(compute)
        bt = _to_torch(b.data, b_tt, table).to(compute)
        acc = _to_torch(d.data, d_tt, table).to(compute)
        res = (torch.matmul(at, bt) + acc).to(table[d_tt])
        return handle_cls(_to_storage(res, _storage_dtype(d_tt)), d_tt)

    return create_dot


# Innermost-first slots for the patch scope of each helper call in flight (one
# list per thread; the interpreter itself runs programs sequentially).
_CALLS = threading.local()


def _make_patch_lang(original: Callable, table: dict, handle_cls) -> Callable:
    def _patch_lang(fn):
        scope = original(fn)
        slots = getattr(_CALLS, "slots", None)
        if slots and slots[-1] is None:  # the first _patch_lang of the innermost call
            slots[-1] = scope
        return scope

    return _patch_lang


def _make_call(original: Callable, table: dict, handle_cls) -> Callable:
    def __call__(self, *args, **kwargs):
        slots = _CALLS.__dict__.setdefault("slots", [])
        slots.append(None)
        try:
            return original(self, *args, **kwargs)
        finally:
            scope = slots.pop()
            if scope is not None:
                scope.restore()

    return __call__


# NaN semantics of the GPU (sm_90): tl.maximum / tl.minimum / tl.clamp without
# propagate_nan lower to PTX max.f32 / min.f32, which return the other operand
# when one is NaN (np.fmax / np.fmin); with propagate_nan=ALL to max.NaN.f32
# (np.maximum). Triton >= 3.9's interpreter already does this; 3.6's uses
# np.maximum / np.clip for both, so a kernel that drops NaN on the GPU would
# keep it here. The reductions (tl.max: np.nanmax) drop NaN in both versions.


def _make_maxnumf(original: Callable, table: dict, handle_cls) -> Callable:
    def create_maxnumf(self, lhs, rhs):
        return self.binary_op(lhs, rhs, np.fmax)

    return create_maxnumf


def _make_minnumf(original: Callable, table: dict, handle_cls) -> Callable:
    def create_minnumf(self, lhs, rhs):
        return self.binary_op(lhs, rhs, np.fmin)

    return create_minnumf


def _make_clampf(original: Callable, table: dict, handle_cls) -> Callable:
    from triton._C.libtriton import ir

    def create_clampf(self, arg, lo, hi, propagate_nans):
        if propagate_nans == ir.PROPAGATE_NAN.ALL:
            return self.binary_op(self.binary_op(arg, lo, np.maximum), hi, np.minimum)
        return self.binary_op(self.binary_op(arg, lo, np.fmax), hi, np.fmin)

    return create_clampf


def _make_generic_reduce(original: Callable, table: dict, handle_cls) -> Callable:
    """``tl.reduce`` with a combine function the interpreter has no NumPy twin for
    (a NaN-propagating max, say) runs the combine once per element in Python;
    this runs it on whole halves instead, log2(n) calls: adjacent pairs
    (x0, x1), (x2, x3), ... then pairs of those, the combine order of a tree
    (associative combines only, as Triton requires). Axes whose length is not a
    power of two (none in Triton) go to the original."""
    import triton.language as tl

    def generic_reduce(self, input):
        original_axis = self.axis
        args, axis = self.unravel(input, self.axis)
        n = args[0].handle.data.shape[axis]
        if n == 0 or n & (n - 1):
            return original(self, input)
        dtypes = [a.dtype for a in args]
        data = [np.moveaxis(a.handle.data, axis, 0) for a in args]
        while data[0].shape[0] > 1:
            lhs = [self.to_tensor(d[0::2], dt) for d, dt in zip(data, dtypes, strict=True)]
            rhs = [self.to_tensor(d[1::2], dt) for d, dt in zip(data, dtypes, strict=True)]
            out = self.combine_fn.fn(*lhs, *rhs)
            out = out if isinstance(out, tuple) else (out,)
            shape = lhs[0].handle.data.shape
            data = [
                np.broadcast_to(
                    o.handle.data if isinstance(o, tl.core.tensor) else o, shape
                ).astype(d.dtype)
                for o, d in zip(out, data, strict=True)
            ]
        ret = []
        for d, dt in zip(data, dtypes, strict=True):
            r = d[0]
            if self.keep_dims:
                r = (
                    np.expand_dims(r, axis)
                    if original_axis is not None
                    else r.reshape((1,) * len(args[0].handle.data.shape))
                )
            elif original_axis is None:
                r = r.item()
            ret.append(self.to_tensor(r, dt))
        return ret

    return generic_reduce


# tl.fma rounds once on the GPU (fma.rn.f32). Triton 3.8's interpreter computes x * y + z
# in the operands' dtype (two roundings), so a kernel built on an exact fma (the FP8
# quantizers' correctly rounded quotient) differs from the GPU there; 3.9's rounds once.
# float32: the product is exact in float64, the sum is made round-to-odd (TwoSum error
# folded into the last bit), then rounded to float32 once: correctly rounded.
def _make_fma(original: Callable, table: dict, handle_cls) -> Callable:
    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return original(self, x, y, z)
        a, b, c = (np.asarray(t.data, dtype=np.float64) for t in (x, y, z))
        a, b, c = np.broadcast_arrays(a, b, c)
        with np.errstate(invalid="ignore", over="ignore"):
            p = a * b
            s = p + c
            bp = s - c
            e = (p - bp) + (c - (s - bp))
            odd = (s.view(np.int64) & 1) == 1
            fix = np.isfinite(s) & np.isfinite(e) & (e != 0) & ~odd
            s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
            return handle_cls(s.astype(np.float32), z.dtype.scalar)

    return create_fma


_FACTORIES = {
    "InterpreterBuilder.create_dot": _make_dot,
    "InterpreterBuilder.cast_impl": _make_cast_impl,
    "InterpreterBuilder.create_fp_to_fp": _make_fp_to_fp,
    "InterpretedFunction.__call__": _make_call,
    "_patch_lang": _make_patch_lang,
    "InterpreterBuilder.create_maxnumf": _make_maxnumf,
    "InterpreterBuilder.create_minnumf": _make_minnumf,
    "InterpreterBuilder.create_clampf": _make_clampf,
    "ReduceOps.generic_reduce": _make_generic_reduce,
    "InterpreterBuilder.create_fma": _make_fma,
}


def is_applied() -> bool:
    """Whether the fix is currently installed in ``triton.runtime.interpreter``.

    Returns
    -------
    bool
        True when every attribute in :data:`PATCHED_ATTRIBUTES` is the patched one.
    """
    interp = _interpreter_module()
    return all(hasattr(getattr(*_owner(interp, key)), _MARK) for key in PATCHED_ATTRIBUTES)


def apply() -> None:
    """Install the fix. Idempotent: a second call is a no-op.

    Works whether or not ``TRITON_INTERPRET=1`` was set before Triton was
    imported: the patches are on the interpreter's classes and module, which
    every interpreted launch uses.

    Raises
    ------
    RuntimeError
        If the interpreter internals it wraps (:data:`PATCHED_ATTRIBUTES`,
        ``TensorHandle``, ``_LangPatchScope.restore``, their signatures) are not
        found in the installed Triton; the message names the Triton version.
    """
    interp = _interpreter_module()
    table = _float_table()
    for key, factory in _FACTORIES.items():
        owner, name = _owner(interp, key)
        current = vars(owner)[name]
        if hasattr(current, _MARK):
            continue
        wrapper = factory(current, table, interp.TensorHandle)
        setattr(wrapper, _MARK, current)
        wrapper.__name__ = name
        wrapper.__qualname__ = key
        wrapper.__doc__ = f"{key}, fixed by tests.triton_interpreter."
        setattr(owner, name, wrapper)


def revert() -> None:
    """Restore the original interpreter attributes. Idempotent.

    Raises
    ------
    RuntimeError
        As :func:`apply`, if the interpreter internals are not found.
    """
    interp = _interpreter_module()
    for key in PATCHED_ATTRIBUTES:
        owner, name = _owner(interp, key)
        original = getattr(vars(owner)[name], _MARK, None)
        if original is not None:
            setattr(owner, name, original)
