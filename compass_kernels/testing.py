"""Numeric test helpers shared by the tests and the benches.

What is here, and why:

- a per-dtype tolerance table (`TOLERANCES`, `tolerance`), so every test of a
  kernel against its reference uses the same, documented bar;
- `assert_verbose_allclose`, which on failure says *where* and *how* two
  tensors differ (first mismatching indices, counts, NaN/Inf disagreements)
  instead of a bare ``False``;
- `assert_bitwise_equal` for ops that must be exact (integer outputs,
  pack/unpack, routing codecs, deterministic kernels);
- poisoning (`poison_`, `empty_poisoned`): fill an output buffer with a value
  no correct kernel can produce, so elements a kernel forgot to write are
  detected instead of passing because ``torch.empty`` happened to hold zeros;
- seeding (`seeded`, `make_generator`) and awkward sizes (`odd_sizes`).

Importing this module imports torch and nothing else; it changes no global
state.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "TOLERANCES",
    "tolerance",
    "assert_verbose_allclose",
    "assert_bitwise_equal",
    "poison_",
    "empty_poisoned",
    "seeded",
    "make_generator",
    "odd_sizes",
]

# (atol, rtol) per dtype, for comparing a kernel's output in that dtype with a
# reference computed in higher precision and cast to it. rtol is about one to
# two units in the last place of the format (float32: 2^-23 ~ 1.2e-7, but
# reductions reordered across threads/blocks lose a few more bits; bf16:
# 2^-8 ~ 3.9e-3 per rounding, a reduction adds a couple; fp8 e4m3: 3 mantissa
# bits -> one ulp is 2^-3 relative; e5m2: 2 bits -> 2^-2). atol covers values
# near zero where a relative bound is meaningless (cancellation in
# differences, subnormals in the fp8 formats).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 2e-2),
    torch.float16: (1e-3, 2e-3),
    torch.float8_e4m3fn: (2.0**-6, 2.0**-3),
    torch.float8_e5m2: (2.0**-6, 2.0**-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Return the default ``(atol, rtol)`` for comparing tensors of `dtype`.

    Parameters
    ----------
    dtype : torch.dtype
        Dtype of the tensor under test (the kernel's output dtype).

    Returns
    -------
    tuple of float
        ``(atol, rtol)``. Integer and bool dtypes compare exactly: ``(0, 0)``.
        Complex dtypes use the table entry of their real component.

    Raises
    ------
    KeyError
        For a floating dtype with no entry in `TOLERANCES`.
    """
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if dtype.is_complex:
        return TOLERANCES[dtype.to_real()]
    if not dtype.is_floating_point:
        return (0.0, 0.0)
    raise KeyError(f"no tolerance for {dtype}; add it to compass_kernels.testing.TOLERANCES")


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _mismatch_report(
    a: torch.Tensor,
    e: torch.Tensor,
    close: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    max_print: int,
) -> list[str]:
    """Describe where float64 tensors `a` and `e` (same shape) are not `close`."""
    bad = ~close
    n_bad = int(bad.sum())
    numel = close.numel()
    lines = [
        f"mismatched elements: {n_bad} / {numel} ({100.0 * n_bad / numel:.4g}%)"
        f" with atol={atol:g}, rtol={rtol:g}"
    ]
    abs_diff = (a - e).abs()
    rel_diff = abs_diff / e.abs()
    finite = torch.isfinite(a) & torch.isfinite(e)
    if bool(finite.any()):
        fin_abs = torch.where(finite, abs_diff, torch.zeros_like(abs_diff))
        # rel diff is inf where expected == 0 and actual != 0; keep that: it is the truth.
        fin_rel = torch.where(finite & (abs_diff > 0), rel_diff, torch.zeros_like(rel_diff))
        i_abs = int(fin_abs.flatten().argmax())
        i_rel = int(fin_rel.flatten().argmax())
        idx_abs = tuple(int(v) for v in torch.unravel_index(torch.tensor(i_abs), a.shape))
        idx_rel = tuple(int(v) for v in torch.unravel_index(torch.tensor(i_rel), a.shape))
        lines.append(
            f"max abs diff (finite pairs): {_fmt(float(fin_abs.flatten()[i_abs]))} at {idx_abs}"
        )
        lines.append(
            f"max rel diff (finite pairs): {_fmt(float(fin_rel.flatten()[i_rel]))} at {idx_rel}"
        )
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    n_nan_a = int((nan_a & ~nan_e).sum())
    n_nan_e = int((nan_e & ~nan_a).sum())
    if n_nan_a or n_nan_e:
        lines.append(
            f"NaN mismatches: actual NaN where expected is not: {n_nan_a}; "
            f"expected NaN where actual is not: {n_nan_e}"
        )
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    inf_bad = (inf_a | inf_e) & bad & ~nan_a & ~nan_e
    n_inf = int(inf_bad.sum())
    if n_inf:
        lines.append(
            f"Inf mismatches: {n_inf} (an infinity against a finite value or the "
            "opposite-signed infinity)"
        )
    if max_print > 0:
        flat_bad = bad.flatten().nonzero().flatten()[:max_print]
        lines.append(f"first {len(flat_bad)} mismatches (index: actual, expected, abs, rel):")
        coords = torch.unravel_index(flat_bad, a.shape) if a.dim() else ()
        af, ef = a.flatten(), e.flatten()
        for k, flat in enumerate(flat_bad.tolist()):
            idx = tuple(int(c[k]) for c in coords)
            av, ev = float(af[flat]), float(ef[flat])
            ad = abs(av - ev)
            rd = ad / abs(ev) if ev != 0 else (0.0 if ad == 0 else math.inf)
            lines.append(f"  {idx}: {_fmt(av)}, {_fmt(ev)}, {_fmt(ad)}, {_fmt(rd)}")
    return lines


def assert_verbose_allclose(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    equal_nan: bool = False,
    check_dtype: bool = True,
    name: str = "",
    max_print: int = 10,
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` element-wise, verbosely.

    Infinities compare equal only to the same-signed infinity; a NaN on either
    side is a mismatch unless both are NaN and `equal_nan` is true.

    Parameters
    ----------
    actual : torch.Tensor
        Output under test, any shape, dtype and device.
    expected : torch.Tensor
        Reference, same shape (and same dtype when `check_dtype`).
    atol, rtol : float, optional
        Tolerances; each defaults to ``tolerance(actual.dtype)``.
    equal_nan : bool
        Treat NaN == NaN as equal. Off by default: a NaN in an output usually
        means a bug (or an unwritten poisoned element).
    check_dtype : bool
        Fail when the dtypes differ. Turn off to compare, e.g., a bf16 output
        with a float32 reference directly (both are upcast to float64).
    name : str
        Prefix for the failure message (what is compared).
    max_print : int
        How many mismatching elements to list, first in row-major order.

    Raises
    ------
    AssertionError
        With a report: shape/dtype mismatch, or the count and fraction of
        mismatches, max abs/rel diff, NaN/Inf disagreements and the first
        `max_print` mismatching indices with actual, expected, abs and rel diff.
    """
    prefix = f"{name}: " if name else ""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs expected "
            f"{tuple(expected.shape)}"
        )
    if check_dtype and actual.dtype != expected.dtype:
        raise AssertionError(
            f"{prefix}dtype mismatch: actual {actual.dtype} vs expected {expected.dtype}"
        )
    d_atol, d_rtol = tolerance(actual.dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    if actual.numel() == 0:
        return
    # float64 on the host: exact for every dtype up to float64 / int53, and
    # the report needs host values anyway. Complex tensors compare as their
    # (real, imag) pairs.
    a = actual.detach().cpu()
    e = expected.detach().cpu()
    if a.is_complex() or e.is_complex():
        a = torch.view_as_real(a.to(torch.complex128))
        e = torch.view_as_real(e.to(torch.complex128))
    exact_ints = not (a.is_floating_point() or e.is_floating_point()) and atol == rtol == 0
    # Integers compare in their own dtype: float64 would merge int64 values above 2^53.
    int_close = (a == e) if exact_ints else None
    a = a.to(torch.float64)
    e = e.to(torch.float64)
    close = (
        int_close
        if int_close is not None  # exact_ints
        else torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
    )
    if bool(close.all()):
        return
    lines = _mismatch_report(a, e, close, atol=atol, rtol=rtol, max_print=max_print)
    what = f"{tuple(actual.shape)} {actual.dtype}"
    raise AssertionError(f"{prefix}tensors not close ({what})\n" + "\n".join(lines))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View `t` as ``[numel, itemsize]`` uint8 (a copy only if not contiguous)."""
    flat = t.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def assert_bitwise_equal(
    actual: torch.Tensor, expected: torch.Tensor, *, name: str = "", max_print: int = 10
) -> None:
    """Assert two tensors have the same shape, dtype and bytes.

    Stricter than ``torch.equal``: ``-0.0 != 0.0`` and NaN payloads must match,
    which is what a deterministic kernel or a lossless codec promises.

    Parameters
    ----------
    actual, expected : torch.Tensor
        Tensors to compare, any dtype and device.
    name : str
        Prefix for the failure message.
    max_print : int
        How many differing elements to list.

    Raises
    ------
    AssertionError
        On a shape or dtype mismatch, or listing the differing elements.
    """
    prefix = f"{name}: " if name else ""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs expected "
            f"{tuple(expected.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise AssertionError(
            f"{prefix}dtype mismatch: actual {actual.dtype} vs expected {expected.dtype}"
        )
    if actual.numel() == 0:
        return
    ba, be = _as_bytes(actual.cpu()), _as_bytes(expected.cpu())
    diff = (ba != be).any(dim=1)
    n = int(diff.sum())
    if n == 0:
        return
    lines = [f"{prefix}bitwise mismatch in {n} / {diff.numel()} elements ({actual.dtype})"]
    flat_bad = diff.nonzero().flatten()[:max_print]
    coords = torch.unravel_index(flat_bad, actual.shape) if actual.dim() else ()
    af, ef = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    for k, flat in enumerate(flat_bad.tolist()):
        idx = tuple(int(c[k]) for c in coords)
        hex_a, hex_e = bytes(ba[flat].tolist()[::-1]).hex(), bytes(be[flat].tolist()[::-1]).hex()
        lines.append(
            f"  {idx}: actual {af[flat].item()!r} (0x{hex_a}), "
            f"expected {ef[flat].item()!r} (0x{hex_e})"
        )
    raise AssertionError("\n".join(lines))


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` in place with a value a correct kernel cannot produce; return it.

    - floating (incl. fp8) and complex: NaN;
    - integer: the dtype's maximum (``0x7F..`` for signed, ``0xFF..`` for
      unsigned), far outside any index, count or id range a kernel writes;
    - bool: every byte ``0xFF`` (through a uint8 view). It reads as True, but
      differs bitwise from a True a kernel writes (``0x01``), so
      `assert_bitwise_equal` against a reference catches an unwritten element
      even where the reference is True.

    Parameters
    ----------
    t : torch.Tensor
        Any dtype, layout with unit element stride not required.

    Returns
    -------
    torch.Tensor
        `t` itself.
    """
    if t.dtype == torch.bool:
        t.view(torch.uint8).fill_(0xFF)
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max)
    return t


def empty_poisoned(
    shape: Sequence[int] | int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``torch.empty(shape)`` filled by `poison_`: an output buffer for kernel tests.

    Parameters
    ----------
    shape : int or sequence of int
        Tensor shape.
    dtype : torch.dtype
        Element type.
    device : torch.device or str
        Where to allocate.

    Returns
    -------
    torch.Tensor
        A contiguous poisoned tensor.
    """
    if isinstance(shape, int):
        shape = (shape,)
    return poison_(torch.empty(tuple(shape), dtype=dtype, device=device))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with torch (CPU and every CUDA device) and ``random`` seeded.

    The previous RNG states are restored on exit, so a seeded test does not
    change the randomness of the tests after it. NumPy's global RNG is seeded
    and restored too, but only when NumPy is already imported (this helper
    never imports it).

    Parameters
    ----------
    seed : int
        The seed.
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        random.seed(seed)
        if np is not None:
            np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a ``torch.Generator`` on `device` seeded with `seed`.

    Prefer passing a generator to ``torch.rand(..., generator=g)`` over global
    seeding: it is local, thread-safe and independent of test order.
    """
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# Sizes chosen to break kernels that assume a multiple of a block or warp:
# 1 (degenerate), primes, and powers of two +- a little (one element past or
# short of a full tile), up to sizes with several tiles of 128 / 1024.
_ODD_SIZES = (1, 2, 3, 7, 17, 37, 63, 127, 129, 131, 255, 257, 1000, 1023, 1025, 4099)


def odd_sizes(max_size: int | None = None) -> list[int]:
    """Return awkward sizes for parametrising shape tests, ascending.

    Parameters
    ----------
    max_size : int, optional
        Drop sizes above this (e.g. 256 for tests under the Triton interpreter).

    Returns
    -------
    list of int
        A fresh list (callers may modify it).
    """
    return [s for s in _ODD_SIZES if max_size is None or s <= max_size]
