"""Bench: the packing planner (ck.packing.plan) against Karmarkar-Karp.

Baseline: Karmarkar-Karp (largest differencing) in Python, the algorithm RL
frameworks run to balance sequence lengths over data-parallel ranks (verl's
seqlen_balancing.karmarkar_karp), re-expressed from the algorithm in
``compass_kernels.packing.reference.karmarkar_karp``: the same partitions as
verl's code, ties included, and 1.5-4x faster than it (heap entries are
tuples compared in C, sets are lists; see its docstring), so the baseline is
the careful Python a framework could ship, not verl's slower classes:

- ``kk_equal (python)``: equal-size mode, the one verl's batch balancing uses;
  the baseline of every case.
- ``kk_exact (python)``: unequal-size mode; better balance, O(n * k) memory
  and time, so only where it runs in well under a second.
- ``compass.plan``: the public API with default options, returning its
  :class:`Plan` (index tensors: order and offsets, what pack() consumes; the
  nested lists KK returns are built only by ``--check``). It also packs every
  rank into micro-batches under the cap (KK does not: frameworks run a second
  pass for that), so the comparison with the rank pass alone favours the
  baseline.
- ``kk ranks+mb (python)`` (harness, n <= EXACT_MAX) and ``kk+mb (ms)``
  (speed table): ``reference.kk_pipeline``, both passes a framework runs to
  get what plan() returns (verl: the rank pass above, then
  ``rearrange_micro_batches``' pass, KK unequal-size per rank into M parts, M
  grown until no part breaks the cap). ``verl ranks+mb (python)``: the same
  with verl's own ``get_seqlen_balanced_partitions``; ``--check`` asserts its
  micro-batches are the reference pipeline's, in order, within the cap.
  Pipeline calls over PIPELINE_ONCE_S are timed once (the table says where).

``verl (ms)`` (speed table) and ``verl kk_equal (python)`` (harness):
verl's own, unmodified ``seqlen_balancing.karmarkar_karp`` (equal-size), from
an installed verl (not a dependency of this project: ``pip install --no-deps
verl`` into a bench environment; verl 0.9.1's wheel also installs top-level
``tests`` and ``scripts`` packages into site-packages, which shadow this
repository's tests package: delete those two directories after installing).
Its module imports verl.protocol (ray,
tensordict) and two verl helpers at load time; where those do not import,
the installed file is executed on its own with exactly three names stubbed
(``_VERL_STUBBED``: verl.protocol.DataProto, verl.utils.tensordict_utils,
verl.utils.device.get_device_name; the stubs raise if used), after checking
that karmarkar_karp's code looks up none of them. The table prints how it was
loaded, or that the column is absent and why. ``/verl``: verl's time over
ours.

``--check`` verifies, for every candidate, that its output is a partition of
all sequences into dp non-empty parts, for ours that its rank max/mean is no
worse than the baseline's, and for verl's that its parts are the reference's
(the `!=` of :class:`Partition`).

``python -m bench.bench_packing`` prints the speed table in thread CPU time
(interleaved, median; with ``--balance``: the balance table, exact KK too)
with the quality columns (rank max/mean of KK and ours, max over the lower
bound, micro-batches, largest micro-batch) on lognormal (mu 8, sigma 1.1,
clipped 100..65536) and bimodal lengths, n = 256..64k, dp = 8..256.
"""

from __future__ import annotations

import numpy as np

import compass_kernels as ck
from bench.harness import Case
from compass_kernels.packing import reference as ref

OP = "packing_plan"
MAX_TOKENS = 65536
SHAPES = ((256, 8), (512, 16), (4096, 64), (8192, 8), (16384, 128), (65536, 256))
QUICK_SHAPES = ((256, 8), (2048, 16))
EXACT_MAX = 4096  # kk_exact costs O(n*k) Python objects: up to this many sequences
PIPELINE_ONCE_S = 0.5  # kk_pipeline calls longer than this are timed once


class Partition:
    """A provider's output: per-rank index lists over ``values``.

    ``candidate != baseline`` (what ``--check`` evaluates) is False only when
    the candidate is a partition of range(n) into dp non-empty parts and, if
    it claims balance (``claims_balance``: ours), its max/mean is no worse than
    the baseline's; if it claims the baseline's partition (``claims_same``:
    verl's code against the reference), its parts are the baseline's, in
    order (each part's indices compared as sorted lists).
    """

    def __init__(self, parts, values, claims_balance: bool = False, claims_same: bool = False):
        self._parts = parts  # lists, or a Plan (flattened on first use)
        self.values = values
        self.claims_balance = claims_balance
        self.claims_same = claims_same

    @property
    def parts(self) -> list[list[int]]:
        if not isinstance(self._parts, list):
            self._parts = [[i for mb in mbs for i in mb] for mbs in self._parts.assignment]
        return self._parts

    def imbalance(self) -> float:
        return ref.imbalance(self.values, self.parts)

    def valid(self, dp: int) -> bool:
        flat = sorted(i for p in self.parts for i in p)
        return len(self.parts) == dp and all(self.parts) and flat == list(range(len(self.values)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        if not self.valid(len(other.parts)):
            return False
        if self.claims_same and [sorted(p) for p in self.parts] != other.parts:
            return False
        return not self.claims_balance or self.imbalance() <= other.imbalance() + 1e-12

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __repr__(self) -> str:
        return f"Partition(parts={len(self.parts)}, imbalance={self.imbalance():.6f})"


class PlanPartition(Partition):
    """A two-pass pipeline's output: ``[rank][micro-batch] -> indices``.
    Equal to the baseline (KK's rank partition) when, on top of
    :class:`Partition`'s checks, every rank has the same number of non-empty
    micro-batches, each within the cap, and, given ``same_as`` (a callable
    returning the expected nested lists), every micro-batch is the expected
    one, in order."""

    def __init__(self, nested, values, same_as=None):
        super().__init__([[i for mb in mbs for i in mb] for mbs in nested], values, False, True)
        self.nested, self.same_as = nested, same_as

    def __eq__(self, other) -> bool:
        if not super().__eq__(other):
            return False
        m = len(self.nested[0])
        v = self.values
        if any(len(mbs) != m or not all(mbs) for mbs in self.nested):
            return False
        if any(sum(int(v[i]) for i in mb) > MAX_TOKENS for mbs in self.nested for mb in mbs):
            return False
        return self.same_as is None or self.nested == self.same_as()


def _ours(lengths: np.ndarray, dp: int) -> Partition:
    return Partition(ck.packing.plan(lengths, dp_size=dp, max_tokens=MAX_TOKENS), lengths, True)


def case(dist: str, n: int, dp: int) -> Case:
    lengths = ref.DISTRIBUTIONS[dist](n, n + dp)
    as_list = lengths.tolist()
    providers = {
        "kk_equal (python)": lambda: Partition(ref.karmarkar_karp(as_list, dp, True), lengths),
        "compass.plan": lambda: _ours(lengths, dp),
    }
    verl = _verl_kk()[0]
    if verl is not None:
        providers["verl kk_equal (python)"] = lambda: Partition(
            verl.karmarkar_karp(as_list, dp, True), lengths, claims_same=True
        )
    if n <= EXACT_MAX:
        providers["kk_exact (python)"] = lambda: Partition(
            ref.karmarkar_karp(as_list, dp, False), lengths
        )
        providers["kk ranks+mb (python)"] = lambda: PlanPartition(
            ref.kk_pipeline(as_list, dp, MAX_TOKENS), lengths
        )
        if verl is not None:  # verl's own two passes: the same micro-batches as ours
            providers["verl ranks+mb (python)"] = lambda: PlanPartition(
                ref.kk_pipeline(as_list, dp, MAX_TOKENS, partition=verl.partitions),
                lengths,
                same_as=lambda: ref.kk_pipeline(as_list, dp, MAX_TOKENS),
            )
    return Case(
        name=f"{OP}_{dist}",
        shape={"n": n, "dp": dp},
        providers=providers,
        baseline="kk_equal (python)",
        device="cpu",
    )


def cases(quick: bool) -> list[Case]:
    shapes = QUICK_SHAPES if quick else SHAPES
    return [case(d, n, dp) for d in ref.DISTRIBUTIONS for n, dp in shapes]


class _Times(dict):
    """name -> seconds per call, and ``once``: the names timed by one call."""

    once: list[str]


def _cpu_times(
    fns: dict, reps: int, min_sample_s: float = 2e-3, once_s: float | None = None
) -> _Times:
    """Median thread CPU seconds per call of each fn, interleaved repetitions,
    garbage collector paused (the harness's method, CPU time instead of wall
    time: on a shared host whose load average is several times its core count,
    wall time measures the scheduler, not the code). A fn whose first call
    takes over ``once_s`` is timed by that call alone (seconds-long Python:
    one call is its own stable sample); their names are in ``.once``."""
    import gc
    import statistics
    import time

    inner, once = {}, {}
    samples: dict[str, list[float]] = {}
    was = gc.isenabled()
    gc.disable()
    try:
        for name, fn in fns.items():  # warm up; calls per sample
            t = time.thread_time()
            fn()
            t = time.thread_time() - t
            if once_s is not None and t > once_s:
                once[name] = t
            else:
                inner[name] = max(1, int(min_sample_s / max(t, 1e-7)))
                samples[name] = []
        for _ in range(reps):
            for name in samples:
                fn = fns[name]
                t = time.thread_time()
                for _ in range(inner[name]):
                    fn()
                samples[name].append((time.thread_time() - t) / inner[name])
    finally:
        if was:
            gc.enable()
    out = _Times({name: statistics.median(v) for name, v in samples.items()} | once)
    out.once = list(once)
    return out


# What seqlen_balancing.py imports at module level from verl besides its own
# code: verl.protocol (pulls in ray and tensordict), verl.utils (its package
# __init__ pulls in more) and two helpers. karmarkar_karp touches none of them.
_VERL_STUBBED = (
    "verl.protocol.DataProto",
    "verl.utils.tensordict_utils",
    "verl.utils.device.get_device_name",
)


def _verl_names(code) -> set[str]:
    """Global names a function's code (nested code objects too) looks up."""
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _verl_names(c)
    return names


def _load_verl_kk():
    """verl's unmodified ``seqlen_balancing.karmarkar_karp`` and a note on how
    it was loaded. A plain import where verl's dependencies are installed;
    otherwise the installed file is executed as a module of its own, with the
    three names it imports from verl (``_VERL_STUBBED``) bound to stubs that
    raise if used, placed in ``sys.modules`` only while the file executes.
    Refuses (raises) if karmarkar_karp's code, nested classes included, looks
    up any stubbed name or torch, so the stubs cannot change what is timed."""
    import importlib.metadata
    import importlib.util
    import sys
    import types

    version = importlib.metadata.version("verl")  # PackageNotFoundError: not installed
    try:
        from verl.utils import seqlen_balancing

        return _VerlKK(seqlen_balancing), f"verl {version}, imported"
    except ImportError as e:
        why = f"{type(e).__name__}: {e}"
    spec = importlib.util.find_spec("verl")  # locates the package, runs nothing
    path = f"{spec.submodule_search_locations[0]}/utils/seqlen_balancing.py"

    def unusable(*_args, **_kwargs):
        raise RuntimeError("a stub of the bench's verl loader was used")

    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            unusable()

    stubs = {
        "verl": types.ModuleType("verl"),
        "verl.protocol": types.ModuleType("verl.protocol"),
        "verl.utils": types.ModuleType("verl.utils"),
        "verl.utils.tensordict_utils": _Stub("verl.utils.tensordict_utils"),
        "verl.utils.device": types.ModuleType("verl.utils.device"),
    }
    stubs["verl.protocol"].DataProto = type("DataProto", (), {"__init__": unusable})
    stubs["verl.utils"].tensordict_utils = stubs["verl.utils.tensordict_utils"]
    stubs["verl.utils.device"].get_device_name = unusable
    saved = {name: sys.modules.pop(name, None) for name in stubs}
    sys.modules.update(stubs)
    try:
        mod_spec = importlib.util.spec_from_file_location("_bench_verl_seqlen_balancing", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    for fn in (mod.karmarkar_karp, mod.get_seqlen_balanced_partitions):
        used = _verl_names(fn.__code__) & {"DataProto", "tu", "get_device_name", "dist", "torch"}
        if used:
            raise RuntimeError(f"verl's {fn.__name__} uses stubbed names {sorted(used)}")
    return _VerlKK(mod), (
        f"verl {version}, {path} run with {', '.join(_VERL_STUBBED)} stubbed "
        f"(the import failed: {why}; karmarkar_karp and get_seqlen_balanced_partitions "
        "use none of them)"
    )


class _VerlKK:
    """verl's two entry points: ``karmarkar_karp(values, k, equal_size)`` (what
    the rank column times) and ``partitions(values, k, equal_size)``, its
    ``get_seqlen_balanced_partitions`` (KK plus its checks and sorted parts:
    what verl's trainer and ``rearrange_micro_batches`` call)."""

    def __init__(self, mod):
        self.karmarkar_karp = mod.karmarkar_karp
        self.partitions = mod.get_seqlen_balanced_partitions


_VERL = None


def _verl_kk():
    """(verl's KK entry points (_VerlKK), how they were loaded), or (None, why
    they are absent)."""
    global _VERL
    if _VERL is None:
        try:
            _VERL = _load_verl_kk()
        except Exception as e:  # not installed, or its file no longer loads this way
            _VERL = None, f"{type(e).__name__}: {e}"
    return _VERL


def call_floor(reps: int = 7) -> str:
    """The Python call floor, measured: ck.packing.plan on 4 sequences (the
    whole Python entry, one C++ call, the Plan) and a bare pybind11 call that
    crosses two NumPy arrays by DLPack (karmarkar_karp_cpu on one item)."""
    from compass_kernels.packing.planner import _C

    L = np.array([100, 200, 300, 400], dtype=np.int64)
    c, r = np.ones(1), np.zeros(1, dtype=np.int64)
    kk_cpu = _C().karmarkar_karp_cpu
    t = _cpu_times(
        {
            "plan": lambda: ck.packing.plan(L, dp_size=2, max_tokens=MAX_TOKENS),
            "bare": lambda: kk_cpu(c, 1, r),
        },
        reps,
    )
    return (
        f"call floor: plan() of 4 sequences {t['plan'] * 1e6:.2f} us; "
        f"a bare pybind11 call with 2 DLPack arrays {t['bare'] * 1e6:.2f} us"
    )


def _quality(lengths, dp: int) -> tuple[float, dict, float]:
    """The quality columns of one (lengths, dp): KK's (equal-size) rank
    max/mean, our default plan's stats, and our equal_samples max/mean."""
    kk = ref.imbalance(lengths, ref.karmarkar_karp(lengths.tolist(), dp, True))
    p = ck.packing.plan(lengths, dp_size=dp, max_tokens=MAX_TOKENS)
    q = ck.packing.plan(lengths, dp_size=dp, max_tokens=MAX_TOKENS, equal_samples=True)
    return kk, p.stats, q.stats["imbalance"]


def speed_table(shapes=SHAPES, reps: int = 7) -> str:
    """Per (dist, n, dp): median thread CPU time of Python KK's rank pass
    (equal-size), of verl's where verl imports, of the whole two-pass pipeline
    (``ref.kk_pipeline``: ranks, then each rank's micro-batches under the cap,
    what verl runs to get what plan() returns) and of ck.packing.plan; the
    ratios, and the quality columns: rank max/mean of KK and ours (default and
    equal_samples), ours over the lower bound, the micro-batch count and the
    largest micro-batch (cap 65536)."""
    from tqdm import tqdm

    verl, why = _verl_kk()
    vcol = f" {'verl (ms)':>9}" if verl else ""
    vratio = f" {'/verl':>7}" if verl else ""
    head = (
        f"{'dist':9} {'n':>6} {'dp':>4} {'kk (ms)':>9}{vcol} {'kk+mb (ms)':>11} {'plan (ms)':>9} "
        f"{'/kk':>7}{vratio} {'/kk+mb':>8} "
        f"{'kk max/mean':>11} {'ours':>9} {'ours(eq)':>9} {'max/LB':>9} {'M':>4} {'max_mb':>7}"
    )
    lines = [head]
    once = []
    todo = [(d, n, dp) for d in ref.DISTRIBUTIONS for n, dp in shapes]
    for dist, n, dp in tqdm(todo, desc="bench_packing", leave=False):
        L = ref.DISTRIBUTIONS[dist](n, n + dp)
        as_list = L.tolist()
        fns = {
            "kk": lambda a=as_list, k=dp: ref.karmarkar_karp(a, k, True),
            "plan": lambda x=L, k=dp: ck.packing.plan(x, dp_size=k, max_tokens=MAX_TOKENS),
        }
        if verl:
            fns["verl"] = lambda a=as_list, k=dp: verl.karmarkar_karp(a, k, True)
        fns["kk+mb"] = lambda a=as_list, k=dp: ref.kk_pipeline(a, k, MAX_TOKENS)
        t = _cpu_times(fns, reps, once_s=PIPELINE_ONCE_S)
        tp = t["kk+mb"]
        if "kk+mb" in t.once:
            once.append(f"{dist} {n}/{dp}")
        vt = f" {t['verl'] * 1e3:9.3f}" if verl else ""
        vr = f" {t['verl'] / t['plan']:6.1f}x" if verl else ""
        kk, s, eq = _quality(L, dp)
        lines.append(
            f"{dist:9} {n:6d} {dp:4d} {t['kk'] * 1e3:9.3f}{vt} {tp * 1e3:11.1f} "
            f"{t['plan'] * 1e3:9.3f} {t['kk'] / t['plan']:6.1f}x{vr} {tp / t['plan']:7.0f}x "
            f"{kk:11.6f} {s['imbalance']:9.6f} "
            f"{eq:9.6f} {s['max_over_lower_bound']:9.6f} "
            f"{s['num_micro_batches']:4d} {s['max_mb_tokens']:7d}"
        )
    if verl:
        lines.append(f"verl (ms): {why}; /kk: kk / plan, /verl: verl / plan")
    else:
        lines.append(f"verl (ms) column absent: verl's seqlen_balancing does not load: {why}")
    lines.append(
        "kk+mb: ref.kk_pipeline with the Python KK above (verl's rank pass + "
        "rearrange_micro_batches' pass: KK unequal-size per rank, M grown until no "
        "micro-batch breaks the cap); /kk+mb: kk+mb / plan"
        + (f"; one call (over {PIPELINE_ONCE_S:g} s) on {', '.join(once)}" if once else "")
    )
    lines.append(call_floor(reps))
    return "\n".join(lines)


def balance_table(shapes=SHAPES) -> str:
    """Rank max/mean of KK (equal, exact where affordable) and ours, with the
    plan's micro-batch count, largest micro-batch and max/lower bound, and the
    same micro-batch figures for the two-pass pipeline (``ref.kk_pipeline``):
    its M, and micro-batch max/mean (over all dp * M micro-batches) beside
    ours."""
    from tqdm import tqdm

    head = (
        f"{'dist':9} {'n':>6} {'dp':>4} {'kk_equal':>9} {'kk_exact':>9} {'ours':>9} "
        f"{'ours(eq)':>9} {'max/LB':>8} {'M':>4} {'max_mb':>7} {'kk+mb M':>7} "
        f"{'mb max/mean':>11} {'kk+mb':>7}"
    )
    lines = [head]
    todo = [(d, n, dp) for d in ref.DISTRIBUTIONS for n, dp in shapes]
    for dist, n, dp in tqdm(todo, desc="bench_packing --balance", leave=False):
        L = ref.DISTRIBUTIONS[dist](n, n + dp)
        kk, s, eq = _quality(L, dp)
        ex = ref.imbalance(L, ref.karmarkar_karp(L.tolist(), dp, False)) if n <= 2048 else None
        exs = f"{ex:9.5f}" if ex is not None else f"{'-':>9}"
        nested = ref.kk_pipeline(L.tolist(), dp, MAX_TOKENS)
        sums = [int(L[mb].sum()) for mbs in nested for mb in mbs]
        lines.append(
            f"{dist:9} {n:6d} {dp:4d} {kk:9.5f} {exs} {s['imbalance']:9.5f} "
            f"{eq:9.5f} {s['max_over_lower_bound']:8.5f} "
            f"{s['num_micro_batches']:4d} {s['max_mb_tokens']:7d} {len(nested[0]):7d} "
            f"{s['mb_imbalance']:11.4f} {max(sums) / (sum(sums) / len(sums)):7.4f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(balance_table() if "--balance" in sys.argv else speed_table())
