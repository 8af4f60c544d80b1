"""Side-by-side benchmark harness: a baseline and candidates, timed in one process.

Method (why each choice):

- **Interleaved repetitions.** Each repetition times every provider once, in
  the order baseline, candidate 1, candidate 2, ... then repeats. Clock
  boosts, thermal throttling and noisy neighbours then hit all providers
  alike, and the ratio stays meaningful even when absolute times drift. (The
  alternative, timing each provider to completion, as
  ``triton.testing.do_bench`` does, lets drift masquerade as speedup; that is
  why it is not used even on a GPU.)
- **Warmup** calls (interleaved too) absorb first-call costs: lazy imports,
  allocator growth, kernel compilation/autotuning, cache misses.
- **Samples of several calls.** During warmup each provider's call time is
  measured and a sample is ``inner`` back-to-back calls with
  ``inner * t_call >= target_sample_s``, so microsecond calls are not timed at
  the clock's resolution. The reported time is per call.
- **Median and IQR**, not mean and std: robust to the occasional preemption.
  ``ratio_vs_baseline`` = median(baseline) / median(provider) (> 1: faster).
- **Timers.** CUDA: a pair of CUDA events around each sample, all samples
  synchronised once at the end (no host sync inside the loop), and L2 flushed
  (a 256 MiB write) before each sample so no provider inherits a warm cache
  from the one before. CPU: ``time.perf_counter`` around the sample; the
  garbage collector is paused while timing.
- **Peak memory.** CUDA: ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus what was allocated before the call.
  CPU: torch's CPU allocator exposes no statistics and ``tracemalloc`` does
  not see it, so the CPU figure is approximate: the larger of (a) the bytes of
  the tensors the call returns and (b) the growth of the process's resident
  set high-water mark during the call (``VmHWM``, reset through
  ``/proc/self/clear_refs``; where that is not allowed, the ``statm`` RSS
  difference). Memory that malloc reuses from earlier frees is invisible to
  (b). The table labels it "rss delta (approx)".

Output: an aligned table, rows appended to a CSV (`CSV_COLUMNS`), and a PNG
per op (speedup vs shape, one line per provider). With ``COMPASS_NVTX=1`` each
timed sample is an NVTX range ``bench.<op>.<provider>`` (docs/profiling.md).
"""

from __future__ import annotations

import csv
import datetime as _dt
import gc
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.roofline import Model
from compass_kernels.profiling import nvtx_range
from compass_kernels.testing import assert_verbose_allclose, tolerance

__all__ = [
    "CSV_COLUMNS",
    "Case",
    "Row",
    "CheckFailure",
    "run_case",
    "run_cases",
    "format_table",
    "append_csv",
    "plot_results",
    "machine_name",
    "git_commit",
    "compare_outputs",
]

CSV_COLUMNS = (
    "timestamp",
    "machine",
    "commit",
    "torch_version",
    "device",
    "op",
    "provider",
    "shape",
    "median_s",
    "iqr_s",
    "ratio_vs_baseline",
    "peak_mem_bytes",
    "h100_model_s",
)

_REPO_ROOT = Path(__file__).resolve().parent.parent
_L2_FLUSH_BYTES = 256 * 2**20  # > H100/H200 L2 (50 MiB) with margin


@dataclass
class Case:
    """One benchmark point: several providers of the same computation at one shape.

    Parameters
    ----------
    name : str
        The op (table/CSV ``op`` column; one plot per distinct name).
    shape : dict of str to int
        The problem size, e.g. ``{"prompts": 128, "samples": 16}``.
    providers : dict of str to zero-argument callable
        Each call runs the computation once on pre-built inputs and returns
        its output (used by ``--check``). Insertion order is the timing order.
    baseline : str
        Key of `providers` that the others are compared with.
    device : str
        ``"cuda"`` or ``"cpu"``: where the providers run (picks the timer and
        the memory method).
    atol, rtol : float, optional
        Tolerances for ``--check``; default `compass_kernels.testing.tolerance`
        of each baseline tensor's dtype.
    model : bench.roofline.Model, optional
        Bytes / FLOPs the op must move at this shape; reported as the H100
        roofline time (a model, never a measurement) beside the timings.
    """

    name: str
    shape: dict[str, int]
    providers: dict[str, Callable[[], Any]]
    baseline: str
    device: str = "cpu"
    atol: float | None = None
    rtol: float | None = None
    model: Model | None = None

    def __post_init__(self) -> None:
        if self.baseline not in self.providers:
            raise ValueError(
                f"case {self.name}: baseline {self.baseline!r} is not a provider "
                f"({list(self.providers)})"
            )

    @property
    def shape_str(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.shape.items())


@dataclass
class Row:
    """One provider's result for one case (one CSV row)."""

    op: str
    provider: str
    shape: str
    device: str
    median_s: float
    iqr_s: float
    ratio_vs_baseline: float
    peak_mem_bytes: int
    is_baseline: bool = False
    model_s: float = math.nan  # H100 roofline model of the op at this shape (not measured)
    error: str = ""
    samples: list[float] = field(default_factory=list, repr=False)


class CheckFailure(AssertionError):
    """A candidate's output differs from the baseline's (``--check``)."""


# ----------------------------------------------------------------------------- environment


def machine_name() -> str:
    """Return the GPU name if CUDA is available, else the CPU model (never the hostname)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def git_commit() -> str:
    """Return ``git rev-parse --short HEAD`` of the repo, or ``"unknown"``."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


# ----------------------------------------------------------------------------- memory


def _tensor_bytes(obj: Any) -> int:
    """Bytes of all distinct tensor storages reachable in a (nested) return value."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def _read_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def _statm_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _measure_cpu_memory(fn: Callable[[], Any]) -> int:
    use_hwm = _reset_hwm()
    before = _read_status_kb("VmRSS") if use_hwm else _statm_rss_bytes()
    out = fn()
    after = _read_status_kb("VmHWM") if use_hwm else _statm_rss_bytes()
    rss_delta = max(0, after - before) if before is not None and after is not None else 0
    return max(rss_delta, _tensor_bytes(out))


def _measure_cuda_memory(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return max(0, peak)


# ----------------------------------------------------------------------------- timing


def _time_one_call(fn: Callable[[], Any], cuda: bool) -> tuple[float, Any]:
    """Seconds for one synchronised call, and its output."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _cpu_sample(fn: Callable[[], Any], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _interleaved_samples(
    providers: dict[str, Callable[[], Any]],
    inners: dict[str, int],
    reps: int,
    cuda: bool,
    range_names: dict[str, str],
) -> dict[str, list[float]]:
    """Seconds per call, `reps` samples per provider, in interleaved order.

    Each sample runs inside the NVTX range ``range_names[provider]`` (a no-op
    unless COMPASS_NVTX=1); the range is opened outside the timed window.
    """
    times: dict[str, list[float]] = {p: [] for p in providers}
    if not cuda:
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(reps):
                for p, fn in providers.items():
                    with nvtx_range(range_names[p]):
                        times[p].append(_cpu_sample(fn, inners[p]))
        finally:
            if gc_was_enabled:
                gc.enable()
        return times
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {p: [] for p in providers}
    torch.cuda.synchronize()
    for _ in range(reps):
        for p, fn in providers.items():
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with nvtx_range(range_names[p]):
                start.record()
                for _ in range(inners[p]):
                    fn()
                end.record()
            events[p].append((start, end))
    torch.cuda.synchronize()
    for p, pairs in events.items():
        times[p] = [s.elapsed_time(e) * 1e-3 / inners[p] for s, e in pairs]
    return times


def _median_iqr(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) == 1:
        return xs[0], 0.0
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q2, q3 - q1


# ----------------------------------------------------------------------------- check


def compare_outputs(
    actual: Any, expected: Any, *, atol: float | None, rtol: float | None, where: str
) -> None:
    """Assert a candidate's (nested) output matches the baseline's.

    Tensors are compared with `assert_verbose_allclose` (NaN == NaN, dtypes may
    differ; default tolerances from the baseline tensor's dtype; integer and
    bool tensors always exactly), dicts by
    keys then values, lists/tuples by length then items, numbers with the same
    tolerances, anything else with ``==``.

    Raises
    ------
    CheckFailure
        Naming the first differing element's path, e.g. ``out[0]``.
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise CheckFailure(f"{where}: expected a tensor, got {type(actual).__name__}")
        a_tol, r_tol = tolerance(expected.dtype)
        if expected.dtype.is_floating_point or expected.dtype.is_complex:
            a_tol = a_tol if atol is None else atol
            r_tol = r_tol if rtol is None else rtol
        # else: integer / bool outputs (ids, masks) compare exactly, whatever the case's tolerance
        try:
            assert_verbose_allclose(
                actual,
                expected.to(actual.device),
                atol=a_tol,
                rtol=r_tol,
                equal_nan=True,
                check_dtype=False,
                name=where,
            )
        except AssertionError as e:
            raise CheckFailure(str(e)) from None
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            got = sorted(actual) if isinstance(actual, dict) else type(actual).__name__
            raise CheckFailure(f"{where}: expected keys {sorted(expected)}, got {got}")
        for k in expected:
            compare_outputs(actual[k], expected[k], atol=atol, rtol=rtol, where=f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            n = len(actual) if isinstance(actual, (list, tuple)) else type(actual).__name__
            raise CheckFailure(f"{where}: expected {len(expected)} items, got {n}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            compare_outputs(a, e, atol=atol, rtol=rtol, where=f"{where}[{i}]")
    elif isinstance(expected, float) and isinstance(actual, (int, float)):
        a_tol, r_tol = tolerance(torch.float64)
        if not math.isclose(
            actual,
            expected,
            abs_tol=a_tol if atol is None else atol,
            rel_tol=r_tol if rtol is None else rtol,
        ):
            raise CheckFailure(f"{where}: {actual!r} != {expected!r}")
    elif actual != expected:
        raise CheckFailure(f"{where}: {actual!r} != {expected!r}")


# ----------------------------------------------------------------------------- running


def _error_rows(case: Case, errors: dict[str, str]) -> list[Row]:
    return [
        Row(
            case.name,
            p,
            case.shape_str,
            case.device,
            math.nan,
            math.nan,
            math.nan,
            0,
            is_baseline=p == case.baseline,
            error=msg,
        )
        for p, msg in errors.items()
    ]


def run_case(
    case: Case,
    *,
    reps: int = 15,
    warmup: int = 3,
    target_sample_s: float = 2e-3,
    max_inner: int = 1000,
    check: bool = False,
) -> list[Row]:
    """Time every provider of `case`, interleaved, and return one `Row` each.

    Parameters
    ----------
    case : Case
        What to run.
    reps : int
        Timed samples per provider.
    warmup : int
        Untimed interleaved rounds first (at least 1: it also calibrates the
        number of calls per sample).
    target_sample_s : float
        Minimum duration of one sample; ``0`` makes every sample one call.
    max_inner : int
        Upper bound on calls per sample.
    check : bool
        Compare each candidate's output (from its first call) with the
        baseline's; raise `CheckFailure` on a difference or a provider error.

    Returns
    -------
    list of Row
        In provider order. A provider that raised gets a row with `error` set
        and NaN times (unless `check`, where it raises `CheckFailure`).
    """
    cuda = case.device.startswith("cuda")
    errors: dict[str, str] = {}
    outputs: dict[str, Any] = {}
    call_s: dict[str, float] = {}
    # First call of each provider (interleaved like the rest): catches errors
    # and keeps the outputs for --check before any timing.
    for p, fn in case.providers.items():
        try:
            call_s[p], outputs[p] = _time_one_call(fn, cuda)
        except Exception as e:  # a broken provider must not take down the others
            errors[p] = f"{type(e).__name__}: {e}"
    if check:
        if errors:
            raise CheckFailure(f"{case.name} [{case.shape_str}]: provider error(s): {errors}")
        for p in case.providers:
            if p != case.baseline:
                compare_outputs(
                    outputs[p],
                    outputs[case.baseline],
                    atol=case.atol,
                    rtol=case.rtol,
                    where=f"{case.name}[{case.shape_str}] {p}",
                )
    outputs.clear()
    live = {p: fn for p, fn in case.providers.items() if p not in errors}
    for _ in range(max(0, warmup - 1)):
        for p, fn in live.items():
            call_s[p] = min(call_s[p], _time_one_call(fn, cuda)[0])
    inners = {
        p: max(1, min(max_inner, math.ceil(target_sample_s / max(call_s[p], 1e-9)))) for p in live
    }
    range_names = {p: f"bench.{case.name}.{p}" for p in live}
    samples = _interleaved_samples(live, inners, reps, cuda, range_names) if live else {}
    measure = _measure_cuda_memory if cuda else _measure_cpu_memory
    gc.collect()  # once per case: a full collection costs ~0.1 s with torch loaded
    rows: list[Row] = []
    base_median = math.nan
    if case.baseline in samples:
        base_median = _median_iqr(samples[case.baseline])[0]
    for p in case.providers:
        if p in errors:
            rows.extend(_error_rows(case, {p: errors[p]}))
            continue
        med, iqr = _median_iqr(samples[p])
        rows.append(
            Row(
                op=case.name,
                provider=p,
                shape=case.shape_str,
                device=case.device,
                median_s=med,
                iqr_s=iqr,
                ratio_vs_baseline=base_median / med if med > 0 else math.nan,
                peak_mem_bytes=measure(case.providers[p]),
                is_baseline=p == case.baseline,
                model_s=case.model.seconds() if case.model else math.nan,
                samples=samples[p],
            )
        )
    return rows


def run_cases(
    cases: Iterable[Case],
    *,
    reps: int = 15,
    warmup: int = 3,
    check: bool = False,
    progress: bool = True,
    **kwargs: Any,
) -> list[Row]:
    """Run `run_case` over `cases` with a tqdm progress bar; return all rows.

    With `check`, every case is run and compared; the failures are raised
    together at the end as one `CheckFailure`.
    """
    from tqdm import tqdm

    cases = list(cases)
    rows: list[Row] = []
    failures: list[str] = []
    bar = tqdm(cases, desc="bench", unit="case", disable=not progress, leave=False)
    for case in bar:
        bar.set_postfix_str(f"{case.name} {case.shape_str}"[:60])
        try:
            rows.extend(run_case(case, reps=reps, warmup=warmup, check=check, **kwargs))
        except CheckFailure as e:
            failures.append(str(e))
    if failures:
        raise CheckFailure(f"{len(failures)} case(s) failed --check:\n" + "\n\n".join(failures))
    return rows


# ----------------------------------------------------------------------------- output


def _fmt_time(s: float) -> str:
    if math.isnan(s):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def format_table(rows: Sequence[Row]) -> str:
    """Return an aligned text table of `rows` (one line per provider)."""
    devices = {r.device.split(":")[0] for r in rows}
    mem_head = "peak mem" if devices == {"cuda"} else "peak mem (cpu: rss delta (approx))"
    head = (
        "op",
        "shape",
        "provider",
        "median",
        "IQR",
        "vs base",
        "speedup",
        mem_head,
        "H100 model",
    )
    body = []
    for r in rows:
        if r.error:
            body.append((r.op, r.shape, r.provider, "ERROR", r.error[:60], "-", "-", "-", "-"))
            continue
        speed = "baseline" if r.is_baseline else f"{r.ratio_vs_baseline:.2f}x"
        # median minus the baseline's: e.g. the host overhead above a raw kernel
        delta = "-"
        if not r.is_baseline and r.ratio_vs_baseline > 0:
            base_s = r.median_s * r.ratio_vs_baseline
            diff = r.median_s - base_s
            delta = ("+" if diff >= 0 else "-") + _fmt_time(abs(diff))
        body.append(
            (
                r.op,
                r.shape,
                r.provider,
                _fmt_time(r.median_s),
                _fmt_time(r.iqr_s),
                delta,
                speed,
                _fmt_bytes(r.peak_mem_bytes),
                _fmt_time(r.model_s),
            )
        )
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    right = {3, 4, 5, 6, 7, 8}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    out = [line(head), sep, *(line(b) for b in body)]
    out.append("vs base: median minus the baseline's median (same case); speedup: their ratio")
    if any(not math.isnan(r.model_s) for r in rows):
        out.append(
            "H100 model: roofline lower bound of the op (bench/roofline.py: HBM bytes and FLOPs "
            "over H100 SXM ceilings + launch floor), a model, not a measurement"
        )
    return "\n".join(out)


def append_csv(rows: Sequence[Row], path: str | os.PathLike[str]) -> Path:
    """Append `rows` to the CSV at `path` (header written when the file is new).

    Rows of providers that raised are not written. Raises ``ValueError`` when
    an existing file has a different header (move it aside first).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), None)
        if tuple(header or ()) != CSV_COLUMNS:
            raise ValueError(f"{path} has columns {header}, expected {list(CSV_COLUMNS)}")
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    common = (stamp, machine_name(), git_commit(), torch.__version__)
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(CSV_COLUMNS)
        for r in rows:
            if r.error:
                continue
            w.writerow(
                (
                    *common,
                    r.device,
                    r.op,
                    r.provider,
                    r.shape,
                    f"{r.median_s:.6e}",
                    f"{r.iqr_s:.6e}",
                    f"{r.ratio_vs_baseline:.4f}",
                    r.peak_mem_bytes,
                    "" if math.isnan(r.model_s) else f"{r.model_s:.6e}",
                )
            )
    return path


def plot_results(rows: Sequence[Row], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``<out_dir>/<op>.png`` per op: speedup vs shape, one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for op in dict.fromkeys(r.op for r in rows):
        op_rows = [r for r in rows if r.op == op and not r.error]
        if not op_rows:
            continue
        shapes = list(dict.fromkeys(r.shape for r in op_rows))
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(shapes)), 4.5))
        ratios = []
        for prov in dict.fromkeys(r.provider for r in op_rows):
            by_shape = {r.shape: r.ratio_vs_baseline for r in op_rows if r.provider == prov}
            ys = [by_shape.get(s, math.nan) for s in shapes]
            ratios.extend(y for y in ys if y > 0)
            base = all(r.is_baseline for r in op_rows if r.provider == prov)
            ax.plot(range(len(shapes)), ys, marker="o", label=prov, linestyle="--" if base else "-")
        if ratios and max(ratios) / min(ratios) > 20:
            ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)), [s.replace(",", "\n") for s in shapes], fontsize=8)
        ax.set_ylabel("speedup vs baseline (median time ratio)")
        ax.set_title(f"{op} on {machine_name()} ({op_rows[0].device})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{op.replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
