"""A roofline model of GPU time, for shapes we cannot time on a GPU.

No GPU is available to development or CI, so a bench states GPU performance as
a *model*: the minimum time an op needs on a device given the bytes it must
move through HBM, the FLOPs it must execute, the warp instructions it must
issue and the memory round trips a program makes one after another, each over
the device's published ceiling, plus one kernel-launch floor per kernel. It is
a lower bound that a good kernel approaches, never a measurement; every table
says "model".

One table of device ceilings (:data:`DEVICES`: H100 SXM, H200), shared by the
benches and by the GPU runbook's timing step (bench/gpu_timing.py picks the row
by the device's name, :func:`device_by_name`, and reports measured / model).

``python -m bench.roofline`` prints the per-kernel model (:data:`KERNELS`, one
row per Triton kernel at a realistic shape, both devices); ``--json`` the same
as JSON; ``--sass`` recompiles the kernels whose model counts instructions and
rewrites bench/sass_counts.json (see :func:`sass_profile`; each count is of the
variant the op launches at the modelled shape: :data:`SASS_SPECS`,
:func:`launched_record`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Device:
    """Published ceilings of one accelerator (dense math, no sparsity).

    ``issue_per_s``: warp instructions issued per second (SMs x 4 schedulers x
    1 instruction per clock at the boost clock). ``latency_s``: one dependent
    HBM round trip under load (assumption). ``gemm_bf16_per_s``: what cuBLAS
    reaches on the skinny bf16 GEMMs of the lm_head path (assumption, below the
    datasheet; used for the 3-GEMM floor). ``names``: substrings of
    ``torch.cuda.get_device_name()`` that select this row.
    """

    name: str
    hbm_bytes_per_s: float
    flops_per_s: dict[str, float] = field(default_factory=dict)
    launch_s: float = 3e-6  # assumption: launch + tail of a tiny kernel, CUDA graphs off
    sms: int = 132
    clock_hz: float = 1.98e9
    latency_s: float = 0.7e-6
    gemm_bf16_per_s: float = 700e12
    names: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)

    @property
    def issue_per_s(self) -> float:
        return self.sms * 4 * self.clock_hz


_HOPPER_FLOPS = {"fp8": 1979e12, "bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12, "fp64": 34e12}

# NVIDIA H100 SXM5 datasheet: HBM3 3.35 TB/s; dense tensor-core FP8 1979,
# BF16/FP16 989, TF32 494.5 TFLOP/s; CUDA-core FP32 67, FP64 34 TFLOP/s; 132
# SMs at up to 1.98 GHz. Measured on the lent H100 (KINDS.md of the device
# tool): device-to-device copy ~3.0 TB/s, an 8192^3 bf16 product 798 TFLOP/s.
H100_SXM = Device(
    name="H100-SXM",
    hbm_bytes_per_s=3.35e12,
    flops_per_s=dict(_HOPPER_FLOPS),
    names=("H100",),
    excludes=("PCIE", "NVL"),
    measured={"copy_bytes_per_s": 3.0e12, "bf16_mm_8192_per_s": 798e12},
)
# NVIDIA H200 SXM datasheet: HBM3e 4.8 TB/s, the H100's SMs, clocks and tensor
# cores (same dense TFLOP/s). Measured on lent H200s: copy ~4.3 TB/s, an
# 8192^3 bf16 product 769-798 TFLOP/s.
H200 = Device(
    name="H200",
    hbm_bytes_per_s=4.8e12,
    flops_per_s=dict(_HOPPER_FLOPS),
    names=("H200",),
    excludes=("NVL",),
    measured={"copy_bytes_per_s": 4.3e12, "bf16_mm_8192_per_s": 788e12},
)
DEVICES: dict[str, Device] = {d.name: d for d in (H100_SXM, H200)}


def device_by_name(gpu_name: str) -> Device:
    """The ceilings row of a GPU, by ``torch.cuda.get_device_name()`` (e.g. "NVIDIA
    H100 80GB HBM3" -> H100-SXM, "NVIDIA H200" -> H200). A GPU not in the table
    (H100 PCIe / NVL, anything else) is an error, never another row's ceilings."""
    up = str(gpu_name).upper()
    for d in DEVICES.values():
        if any(n in up for n in d.names) and not any(x in up for x in d.excludes):
            return d
    raise ValueError(
        f"gpu_name: {gpu_name!r} is not in bench.roofline.DEVICES ({sorted(DEVICES)}); add "
        "its datasheet ceilings there"
    )


@dataclass(frozen=True)
class Model:
    """What an op must do at one shape.

    bytes: HBM traffic; flops (of ``precision``); kernels: launches;
    instructions: warp instructions issued in all (0: not modelled);
    serial_steps: dependent HBM round trips of the longest program (a small
    grid's loop over a long sequence; 0: not modelled).
    """

    bytes: float
    flops: float = 0.0
    precision: str = "fp32"
    kernels: int = 1
    instructions: float = 0.0
    serial_steps: float = 0.0

    def times(self, device: Device = H100_SXM) -> dict[str, float]:
        """Seconds per resource: memory, math, issue, latency, launch."""
        if self.precision not in device.flops_per_s:
            raise ValueError(
                f"precision: expected one of {sorted(device.flops_per_s)}, got {self.precision!r}"
            )
        return {
            "memory": self.bytes / device.hbm_bytes_per_s,
            "math": self.flops / device.flops_per_s[self.precision],
            "issue": self.instructions / device.issue_per_s,
            "latency": self.serial_steps * device.latency_s,
            "launch": self.kernels * device.launch_s,
        }

    def seconds(self, device: Device = H100_SXM) -> float:
        """Roofline lower bound: the slowest resource + the launch floor per kernel."""
        t = self.times(device)
        return max(t["memory"], t["math"], t["issue"], t["latency"]) + t["launch"]

    def bound(self, device: Device = H100_SXM) -> str:
        """Which resource binds: memory, compute (math), issue, latency, or launch."""
        t = self.times(device)
        work = {
            "memory": t["memory"],
            "compute": t["math"],
            "issue": t["issue"],
            "latency": t["latency"],
        }
        name = max(work, key=work.get)
        return "launch" if work[name] < t["launch"] else name

    def share(self, device: Device = H100_SXM) -> float:
        """Modelled share of the ceiling the op is judged by: the memory time (or the
        math time when it is the larger) over the modelled time."""
        t = self.times(device)
        return max(t["memory"], t["math"]) / self.seconds(device)


# ------------------------------------------------------------------ SASS counts

SASS_COUNTS = Path(__file__).with_name("sass_counts.json")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_profile(sass: str) -> dict:
    """Static instruction counts of one kernel's SASS (``cuobjdump --dump-sass``).

    main: instructions from the entry to the last EXIT (code after it is the
    slow paths reached by CALL, e.g. IEEE division, and the padding); loops:
    the back-edges inside it, each (start, end, body instructions), innermost
    first by size; ops: counts by class in main (BAR, SHFL, MUFU, LDG, STG,
    LDG.128, STG.128, CALL: a call to a slow path such as an IEEE divide).
    NOPs and the trailing self-branch are not counted."""
    insns = []
    for m in _INSN.finditer(sass):
        addr, op, rest = int(m.group(1), 16), m.group(3), m.group(4)
        insns.append((addr, op, rest))
    if not insns:
        raise ValueError("sass: no instructions found (expected cuobjdump --dump-sass text)")
    exits = [a for a, op, _ in insns if op == "EXIT"]
    end = max(exits) if exits else insns[-1][0]
    main = [(a, op, r) for a, op, r in insns if a <= end and op != "NOP"]
    loops = []
    for a, op, rest in main:
        if op == "BRA":
            tgt = re.search(r"0x([0-9a-f]+)", rest)
            if tgt and int(tgt.group(1), 16) < a:
                start = int(tgt.group(1), 16)
                body = sum(1 for b, o, _ in main if start <= b <= a)
                loops.append((start, a, body))
    ops: dict[str, int] = {}

    def bump(k):
        ops[k] = ops.get(k, 0) + 1

    for _, op, _ in main:
        base = op.split(".")[0]
        if base in ("BAR", "SHFL", "MUFU", "LDG", "STG", "CALL", "LDS", "STS", "HGMMA", "QGMMA"):
            bump(base)
        if base in ("LDG", "STG") and ".128" in op:
            bump(base + ".128")
    return {"main": len(main), "loops": sorted(loops, key=lambda x: x[2]), "ops": ops}


def kernel_source_hash(module: str, kernel: str) -> str:
    """sha256 (16 hex digits) of ``kernel``'s source in compass_kernels.``module`` and
    of every @triton.jit helper it calls (recursively, by name in the module's
    globals): what the compiled code depends on besides the specialization; a count
    recorded with another hash is stale."""
    import hashlib
    import importlib
    import inspect
    import textwrap

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    jitted = (JITFunction, InterpretedFunction)  # compiled, or under TRITON_INTERPRET=1
    mod = importlib.import_module(f"compass_kernels.{module}")
    seen: dict[str, str] = {}

    def visit(name: str, obj) -> None:
        py = getattr(obj, "fn", obj)
        src = textwrap.dedent(inspect.getsource(py))
        seen[name] = src
        for ident in sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", src))):
            g = py.__globals__.get(ident)
            if ident not in seen and isinstance(g, jitted):
                visit(ident, g)

    visit(kernel, getattr(mod, kernel))
    text = "\n".join(f"{k}\n{v}" for k, v in sorted(seen.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def launched_launch(module: str, kernel: str, case: str):
    """The recorded launch (tests.aot.Launch) of ``kernel`` in the launch-plan case
    ``case`` of ``module`` (tests/launch_plans.py: the op's Triton backend called as
    a training step calls it, on meta tensors, nothing run). Exactly one launch of
    ``kernel`` in that case, else ValueError."""
    from tests import aot, launch_plans

    for name, call in launch_plans.PLANS[module]():
        if name != case:
            continue
        with aot.record_launches(execute=False) as launches:
            call()
        mine = [x for x in launches if x.name == kernel]
        if len(mine) != 1:
            raise ValueError(
                f"case: {module} {case!r} launches {kernel} {len(mine)} times, expected once"
            )
        return mine[0]
    raise ValueError(f"case: tests/launch_plans.py has no {case!r} for {module}")


def launched_record(module: str, kernel: str, case: str) -> dict:
    """What identifies the launched variant of a SASS_SPECS entry, without compiling:
    the case, Triton's specialization of the launch (``V:i32/16``, ``ss1:1``), its
    constexpr / launch keywords and the kernel's source hash. Stored beside each
    count in SASS_COUNTS; tests/test_roofline.py recomputes it and fails on a
    difference (a count from another variant, or from older code)."""
    from tests import aot

    launch = launched_launch(module, kernel, case)
    signature, constexprs, attrs, _ = aot.specialization_of(launch)
    jit = aot._as_jit_function(launch.fn)
    spec = []
    for i, (p, ty) in enumerate(signature.items()):
        if ty == "constexpr":
            if p in jit.arg_names and not jit.params[i].is_constexpr:
                spec.append(f"{p}:{constexprs.get((i,))}")
            continue
        div = any(a == ["tt.divisibility", 16] for a in attrs.get((i,), []))
        spec.append(f"{p}:{ty}{'/16' if div else ''}")
    return {
        "case": case,
        "specialization": " ".join(spec),
        "keywords": {k: launch.kwargs[k] for k in sorted(launch.kwargs)},
        "kernel_hash": kernel_source_hash(module, kernel),
    }


def _compile(module: str, kernel: str, case: str) -> tuple[dict, dict]:
    """(sass_profile, launched_record) of ``kernel`` compiled for sm_90a exactly as
    the launch-plan case ``case`` launches it (tests.aot.compile_launch: Triton's
    own binder gives the specialization)."""
    from tests import aot

    art = aot.compile_launch(launched_launch(module, kernel, case))
    return sass_profile(art.sass), launched_record(module, kernel, case)


def _sass_counts() -> dict:
    if not SASS_COUNTS.exists():
        return {}
    return json.loads(SASS_COUNTS.read_text())["kernels"]


def _warp_instructions(
    key: str, programs: float, warps: int, trips: float, loops: str = "largest"
) -> tuple[float, str]:
    """Warp instructions a launch issues, from the stored SASS counts of ``key``:
    programs x warps x (main + hot-loop body x (trips - 1)); the hot loop is the
    largest back-edge (the kernel's main loop), or with ``loops="all"`` every
    back-edge runs ``trips`` times (consecutive loops of the same trip count).
    (0, reason) without a count."""
    row = _sass_counts().get(key)
    if row is None:
        return 0.0, f"no SASS count for {key} (run python -m bench.roofline --sass)"
    prof = row["profile"]
    bodies = [b for *_, b in prof["loops"]]
    if not bodies or trips <= 1:
        body = 0
    else:
        body = sum(bodies) if loops == "all" else bodies[-1]
    per_warp = prof["main"] + body * max(trips - 1, 0)
    return programs * warps * per_warp, row["source"]


# ------------------------------------------------------------------ kernels


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel (or a fixed sequence of launches) at a realistic shape."""

    name: str
    kernels: str  # the Triton kernels (module:function) or library calls launched
    shape: str
    build: Callable[[], tuple[Model, str]]  # (model, where its instruction count comes from)
    judged: str = "memory"  # the ceiling the share is of: memory or compute
    floor: Callable[[Device], float] | None = None  # a baseline's modelled seconds
    floor_name: str = ""
    timing_op: str = ""  # bench/gpu_timing.py's row op that this model is compared to


def _no_issue(model: Model) -> Callable[[], tuple[Model, str]]:
    return lambda: (model, "")


# SASS specs: key -> (module, kernel, the tests/launch_plans.py case at the kernel's
# modelled shape): each count is of the variant that case launches (Triton's own
# specialization of its arguments, tests.aot.compile_launch), never a hand-written
# signature; tests/test_roofline.py checks SASS_COUNTS against these.
SASS_SPECS: dict[str, tuple[str, str, str]] = {
    "permute_scatter": (
        "fp8.triton",
        "_permute_scatter_kernel",
        "permute + quantize 131072 x top-8, E=256, K=2048",
    ),
    "permute_rank": (
        "fp8.triton",
        "_permute_rank_kernel",
        "permute + quantize 131072 x top-8, E=256, K=2048",
    ),
    "quantize_groups": (
        "fp8.triton",
        "_quantize_groups_kernel",
        "quantize activations 16384x7168 ue8m0=False",
    ),
    "quantize_block": (
        "fp8.triton",
        "_quantize_block_kernel",
        "quantize weight 7168x2048 ue8m0=False",
    ),
    "unpermute": ("fp8.triton", "_unpermute_kernel", "unpermute 131072 x top-8 x 2048"),
    "logprobs_fwd": (
        "espo.triton_logprobs",
        "_fwd_kernel",
        "forward T=4096 V=151936 bfloat16 entropy=True",
    ),
    "logprobs_tile": (
        "espo.triton_logprobs",
        "_tile_kernel",
        "tile stats 1766x151936 fp32 entropy=True",
    ),
    "logprobs_bwd": (
        "espo.triton_logprobs",
        "_bwd_kernel",
        "backward T=4096 V=151936 bfloat16 grad_logprob=True grad_entropy=True",
    ),
    "replay_fwd": ("routing.triton", "_replay_fwd_kernel", "replay E=256 K=8 T=65536"),
    "replay_bwd": ("routing.triton", "_replay_bwd_kernel", "replay backward E=256 K=8 T=65536"),
    "pack": ("packing.triton", "_pack_kernel", "pack 131072 x 8192 B cp=1"),
    "unpack": ("packing.triton", "_unpack_kernel", "unpack 131072 x 8192 B cp=1"),
    "group_advantages": (
        "advantages.triton",
        "_group_advantages_kernel",
        "group advantages mode=0 torch.float32 8192 groups x 16",
    ),
    "loss_forward": ("espo.triton_loss", "_forward_kernel", "espo forward n=8 T=65536"),
}


def _permute_quantize():
    M, k, K = 131_072, 8, 2048  # E = 256
    slots = M * k
    moved = M * K * 2 + slots * K + slots * (K // 128) * 4 + slots * (4 + 4 + 4 + 8 + 8)
    # the scatter: a grid-stride loop over the tokens. ptxas puts the token
    # loop's back-edge after the last EXIT, so "main" is one token's trip (its
    # k slot rows as one vector, one 2048-wide step of 16 groups quantized and
    # stored to all k rows) plus the ~64-instruction prologue: counted per token
    # (an upper bound); wider rows add trips of the step loop (the largest).
    row = _sass_counts().get("permute_scatter")
    if row is None:
        return Model(bytes=moved, kernels=4), "no SASS count for permute_scatter"
    prof = row["profile"]
    step = max((b for *_, b in prof["loops"]), default=0)
    scat = M * 4 * (prof["main"] + step * (K // 2048 - 1))
    rank, _ = _warp_instructions("permute_rank", slots / 256, 4, 256 / 16)
    return Model(bytes=moved, kernels=4, instructions=scat + rank), row["source"]


def _quantize_1x128():
    R, C = 16_384, 7168
    # one program per 32 rows x one 128-wide group (GROUP_ROWS = 32)
    ins, src = _warp_instructions("quantize_groups", (R // 32) * (C // 128), 4, 1)
    return Model(bytes=R * C * 2 + R * C + R * (C // 128) * 4, instructions=ins), src


def _quantize_128x128():
    R, C = 7168, 2048  # a weight [N, K] of the MoE FFN
    ins, src = _warp_instructions(
        "quantize_block", (R // 128) * (C // 128), 4, 128 / 32, loops="all"
    )
    # the second pass re-reads the 128 x 128 block from L2, not HBM
    return Model(bytes=R * C * 2 + R * C + (R // 128) * (C // 128) * 4, instructions=ins), src


def _unpermute():
    M, k, K = 131_072, 8, 2048
    # one program per token and 2048 columns, the k slots unrolled (k a constexpr):
    # the static count is the executed count
    ins, src = _warp_instructions("unpermute", M * (K // 2048), 4, 1)
    return Model(bytes=M * k * K * 2 + M * K * 2 + M * k * 12, instructions=ins), src


def _logprobs(key: str, passes: int, rows: int = 4096, V: int = 151_936):
    trips = math.ceil(V / 2048)
    ins, src = _warp_instructions(key, rows, 4, trips)
    return Model(bytes=passes * rows * V * 2 + rows * 32, instructions=ins), src


def _replay(key: str, fwd: bool):
    T, E, K = 65_536, 256, 8
    bt = max(1, min(64, 1024 // E))
    # the forward's K rounds (top-k argmax, replay-id checks: 2 loops of K trips;
    # the routing map is a clear + scatter of the K used ids, no loop)
    ins, src = _warp_instructions(key, T / bt, 4, K if fwd else 1, loops="all")
    if fwd:  # fp32 logits + int64 ids in; weights, int64 ids used, bool map out
        moved = T * E * 4 + T * K * 8 + T * K * 4 + T * K * 8 + T * E
    else:  # grad weights + logits + ids in; grad logits out
        moved = T * K * 4 + T * E * 4 + T * K * 8 + T * E * 4
    return Model(bytes=moved, instructions=ins), src


def _pack(key: str):
    H = 4096
    rows = (1 << 30) // (2 * H)
    upr = H * 2 // 8  # int64 units per row
    ins, src = _warp_instructions(key, rows, 4, upr / 1024)
    return Model(bytes=2 * rows * H * 2 + rows * 24, instructions=ins), src


def _espo_loss():
    T, n = 65_536, 8
    # sums: 3 fp32 in; forward: 4 fp32 in + fp32 grad out; reduce; backward: 1 in + 1 out
    moved = T * 4 * (3 + 4 + 1 + 2) + T  # + the bool mask
    from compass_kernels.espo.triton_loss import _splits

    s = _splits(T, n)  # programs per sequence (triton_loss: a (sequence, split) grid)
    trips = math.ceil(T / n / 256 / s)
    # sums + forward: trips chunks per program; each combine one step of 32 partials;
    # the reduce: one step of 32 sequences
    steps = 2 * trips + 2 * math.ceil(s / 32) + 1
    ins, src = _warp_instructions("loss_forward", n * s, 4, trips)
    # sums, combine, forward, combine, reduce, backward
    return Model(bytes=moved, kernels=6, instructions=ins, serial_steps=steps), src


def _advantages():
    groups, size = 8192, 16
    n = groups * size
    ins, src = _warp_instructions("group_advantages", groups, 4, 1)
    return Model(bytes=n * 4 * 2 + groups * 8 * 2, kernels=1, instructions=ins, serial_steps=2), src


def _rl_zvp():
    n, tokens = 8192, 3_400_000
    return Model(bytes=tokens * 4 * 2 + n * 8, kernels=1)


# The fused lm_head + log-probs + entropy (+ ESPO loss) path, grad_in_forward with
# bf16 gradient GEMMs (fused_loss.py), at T = 8192, H = 4096, V = 151,936: chunks
# of CHUNK_BYTES_GPU (1 GiB) of float32 logits (1766 rows: 5 chunks).
LM_T, LM_H, LM_V = 8192, 4096, 151_936


def _lm_chunks(T=LM_T, V=LM_V) -> int:
    return math.ceil(T / ((1 << 30) // (V * 4)))


def _lm_floor(d: Device) -> float:
    """The 3 bf16 GEMMs (logits, d_hidden, d_weight) at cuBLAS's modelled rate."""
    return 3 * 2 * LM_T * LM_H * LM_V / d.gemm_bf16_per_s


def _lm_gemms(T=LM_T, H=LM_H, V=LM_V) -> list[tuple[str, float, float]]:
    """(name, FLOPs, HBM bytes) of one chunk's 3 GEMMs, epilogue included: the
    logits GEMM's fp32 tile store, d_h's fp32 store, d_w's in-place fp32
    accumulation (read C, write D: addmm(out_dtype=float32, out=d_w))."""
    r = (1 << 30) // (V * 4)
    f = 2 * r * V * H
    return [
        ("logits", f, r * H * 2 + V * H * 2 + r * V * 4),
        ("d_hidden", f, r * V * 2 + V * H * 2 + r * H * 4),
        ("d_weight", f, r * V * 2 + r * H * 2 + 2 * V * H * 4),
    ]


def _lm_gemms_compute_bound() -> None:
    """Each GEMM's epilogue bytes hide under its math (FLOP/byte above every
    device's ridge): the floor's time holds them, none is a separate pass."""
    for d in DEVICES.values():
        ridge = d.gemm_bf16_per_s / d.hbm_bytes_per_s
        for name, f, b in _lm_gemms():
            assert f / b > ridge, (d.name, name, f / b, ridge)


def _lm_extra_bytes(T=LM_T, H=LM_H, V=LM_V, before=False) -> float:
    """HBM bytes of the passes beside the GEMMs (fused_loss.py, grad_in_forward,
    bf16 gradient GEMMs; ``before``: the code before issue 34's rewrite). Each
    is its own kernel on one stream: serial, no overlap with the GEMMs assumed.

    Per logit: _tile_kernel's fp32 read (4), _bwd_kernel's fp32 read (4) and its
    d logits store straight to bf16 (2). Before: the bwd kernel wrote fp32 over
    the tile (4) and a copy_ rounded it to bf16 (read 4, write 2). d_w: each
    chunk's GEMM accumulates in its epilogue (in the GEMM: _lm_gemms); before,
    every chunk after the first wrote an fp32 temporary (in the GEMM) then ran
    d_w.add_(tmp) (read 2, write 1 x fp32 [V, H]). The GEMMs' operand reads and
    stores are in the floor (_lm_gemms_compute_bound). Then the final fp32 ->
    bf16 casts of d_w and d_h."""
    tile = T * V
    chunks = _lm_chunks(T, V)
    per_logit = 4 + 8 + 6 if before else 4 + 4 + 2
    dw = V * H * 4
    fold = (chunks - 1) * 3 * dw if before else 0
    final = dw + V * H * 2 + T * H * 4 + T * H * 2  # d_w, d_h fp32 -> bf16
    return tile * per_logit + fold + final


def _lm_peak_extra(T=LM_T, H=LM_H, V=LM_V, before=False) -> float:
    """Peak extra bytes of the fused path beside hidden / weight / their bf16
    grads: the fp32 logits tile of one chunk, its bf16 d logits, the fp32 d_h and
    d_w accumulators (and, before, the fp32 [V, H] product temporary tmp_w)."""
    rows = (1 << 30) // (V * 4)
    live = rows * V * 4 + rows * V * 2 + T * H * 4 + V * H * 4
    return live + (V * H * 4 if before else 0)


def _lm_head():
    """Modelled as GEMMs at the floor's rate + the extra passes at HBM speed, serial
    (separate kernels on one stream): a Model over the passes; the GEMM time is
    added by ``floor``. FLOPs are the 3 GEMMs' (bf16). Kernels: per chunk the 3
    GEMMs, state fill, _tile_kernel, _bwd_kernel, the finalize / coefficient
    elementwise ops (7 counted); fixed: the loss and the casts. The input check
    launches none (check_loss_inputs; it ran the whole ESPO loss on zeros before)."""
    _lm_gemms_compute_bound()
    model = Model(bytes=_lm_extra_bytes(), precision="bf16", kernels=_lm_chunks() * 7 + 8)
    peak, was = _lm_peak_extra() / 1e9, _lm_peak_extra(before=True) / 1e9
    return model, (
        f"passes are memory-bound (no count needed); extra peak {peak:.2f} GB (was {was:.2f} GB)"
    )


def _grouped_gemm(groups: int, m: int, n: int, k: int):
    rows = groups * m
    moved = rows * k + groups * n * k + rows * n * 2 + rows * (k // 128) * 4
    moved += groups * (n // 128) * (k // 128) * 4
    return Model(bytes=moved, flops=2 * rows * n * k, precision="fp8")


def _gg(groups, m, n, k):
    return Kernel(
        f"fp8_grouped_gemm {groups}x{m}",
        "fp8.triton_gemm:_grouped_gemm_kernel / CUTLASS sm90 grouped GEMM",
        f"groups={groups} m/group={m} N={n} K={k} (DeepGEMM's contiguous-layout shape)",
        _no_issue(_grouped_gemm(groups, m, n, k)),
        judged="compute",
        timing_op="fp8_grouped_gemm",
    )


KERNELS: list[Kernel] = [
    Kernel(
        "fp8_permute_quantize",
        "fp8.triton:_permute_rank/_scan/_offsets/_scatter_kernel",
        "128k tokens x top-8, K=2048, E=256, bf16 -> e4m3 1x128",
        _permute_quantize,
        timing_op="permute_quantize",
    ),
    Kernel(
        "fp8_quantize_1x128",
        "fp8.triton:_quantize_groups_kernel",
        "16384 x 7168 bf16 -> e4m3, 1x128 groups",
        _quantize_1x128,
        timing_op="quantize_1x128",
    ),
    Kernel(
        "fp8_quantize_128x128",
        "fp8.triton:_quantize_block_kernel",
        "7168 x 2048 bf16 weight -> e4m3, 128x128 blocks",
        _quantize_128x128,
    ),
    Kernel(
        "fp8_unpermute",
        "fp8.triton:_unpermute_kernel",
        "128k tokens x top-8, K=2048 bf16",
        _unpermute,
    ),
    Kernel(
        "routing_replay_fwd",
        "routing.triton:_replay_fwd_kernel",
        "T=64k, E=256, K=8, sigmoid + bias, fp32 logits",
        lambda: _replay("replay_fwd", True),
    ),
    Kernel(
        "routing_replay_bwd",
        "routing.triton:_replay_bwd_kernel",
        "T=64k, E=256, K=8",
        lambda: _replay("replay_bwd", False),
    ),
    Kernel(
        "logprobs_fwd",
        "espo.triton_logprobs:_fwd_kernel",
        "4096 x 151,936 bf16, entropy",
        lambda: _logprobs("logprobs_fwd", 1),
        timing_op="logprobs_fwd",
    ),
    Kernel(
        "logprobs_bwd",
        "espo.triton_logprobs:_bwd_kernel",
        "4096 x 151,936 bf16",
        lambda: _logprobs("logprobs_bwd", 2),
        timing_op="logprobs_bwd",
    ),
    Kernel(
        "logprobs_tile_stats",
        "espo.triton_logprobs:_tile_kernel",
        "1766 x 151,936 fp32 tile (the fused path's chunk)",
        lambda: _logprobs("logprobs_tile", 2, rows=1766),
    ),
    Kernel(
        "espo_loss",
        "espo.triton_loss:_sums/_forward/_reduce/_backward_kernel",
        "64k tokens in 8 sequences, K=2 groups, fwd + bwd",
        _espo_loss,
    ),
    Kernel(
        "group_advantages",
        "advantages.triton:_group_advantages_kernel",
        "8192 groups x 16 rewards",
        _advantages,
    ),
    Kernel(
        "rl_zvp",
        "advantages.triton:_rl_zvp_kernel",
        "8192 sequences, 3.4M tokens",
        _no_issue(_rl_zvp()),
    ),
    Kernel(
        "thd_pack",
        "packing.triton:_pack_kernel",
        "1 GiB of bf16 rows, H=4096",
        lambda: _pack("pack"),
        timing_op="thd_pack",
    ),
    Kernel(
        "thd_unpack",
        "packing.triton:_unpack_kernel",
        "1 GiB of bf16 rows, H=4096",
        lambda: _pack("unpack"),
    ),
    Kernel(
        "fused_lmhead_logprobs_entropy",
        "torch.mm x 2 + addmm(out_dtype=fp32) per chunk + _tile_kernel + _bwd_kernel (bf16 store)",
        f"T={LM_T}, H={LM_H}, V={LM_V:,} bf16, fwd + bwd",
        _lm_head,
        judged="floor",
        floor=_lm_floor,
        floor_name="3-GEMM floor",
        timing_op="espo_fused_fwd_bwd",
    ),
    _gg(4, 8192, 4096, 7168),
    _gg(4, 8192, 7168, 2048),
    _gg(8, 4096, 4096, 7168),
    _gg(8, 4096, 7168, 2048),
]


def kernel_rows(devices: dict[str, Device] | None = None) -> list[dict]:
    """One dict per kernel: shape, bytes, FLOPs, instructions (+ source) and, per
    device, the modelled microseconds, share of the ceiling and binding resource."""
    out = []
    for k in KERNELS:
        model, source = k.build()
        row = {
            "kernel": k.name,
            "launches": k.kernels,
            "shape": k.shape,
            "bytes": model.bytes,
            "flops": model.flops,
            "precision": model.precision,
            "warp_instructions": model.instructions,
            "instruction_source": source,
            "timing_op": k.timing_op,
            "devices": {},
        }
        if k.floor is not None:
            row["flops"] = 3 * 2 * LM_T * LM_H * LM_V
        for name, d in (devices or DEVICES).items():
            t = model.times(d)
            if k.floor is not None:
                fl = k.floor(d)
                s = fl + model.seconds(d)
                dev = {
                    "model_us": s * 1e6,
                    "floor_us": fl * 1e6,
                    "over_floor": s / fl,
                    "share": fl / s,
                    "bound": f"GEMMs at {d.gemm_bf16_per_s / 1e12:.0f} "
                    f"TFLOP/s + {t['memory'] * 1e3:.1f} ms of passes",
                }
            else:
                s = model.seconds(d)
                dev = {"model_us": s * 1e6, "share": model.share(d), "bound": model.bound(d)}
            dev["times_us"] = {r: v * 1e6 for r, v in t.items()}
            row["devices"][name] = dev
        out.append(row)
    return out


def model_for_timing_op(op: str, device: Device) -> float | None:
    """Modelled seconds of the kernel whose timing op is ``op`` (bench/gpu_timing.py),
    or None when no model row names it (several: the first)."""
    for row in kernel_rows({device.name: device}):
        if row["timing_op"] == op:
            return row["devices"][device.name]["model_us"] * 1e-6
    return None


def _write_sass_counts(keys: list[str] | None = None) -> None:
    """Recompile the SASS_SPECS kernels (``keys``: only those, the other entries
    kept) and rewrite SASS_COUNTS."""
    import triton

    unknown = sorted(set(keys or ()) - set(SASS_SPECS))
    if unknown:
        raise ValueError(
            f"--sass-only: unknown keys {unknown}; expected some of {sorted(SASS_SPECS)}"
        )
    kernels = _sass_counts() if keys else {}
    for key, (module, kernel, case) in SASS_SPECS.items():
        if keys and key not in keys:
            continue
        prof, rec = _compile(module, kernel, case)
        src = (
            f"launched variant ({case}: {rec['specialization']}), "
            f"Triton {triton.__version__}, sm_90a"
        )
        kernels[key] = {"module": module, "kernel": kernel, "profile": prof, "source": src} | rec
        print(
            f"{key}: main {prof['main']}, loops {[b for *_, b in prof['loops']]}, {prof['ops']}",
            file=sys.stderr,
        )
    SASS_COUNTS.write_text(
        json.dumps({"triton": triton.__version__, "kernels": kernels}, indent=1) + "\n"
    )


def _table(rows: list[dict]) -> str:
    names = list(DEVICES)
    head = ["kernel", "shape", "MB", "GFLOP", "Mwarp-insn"]
    for n in names:
        head += [f"{n} us", f"{n} share", f"{n} bound"]
    lines = [
        "roofline MODEL (not measured; bench/roofline.py): "
        + ", ".join(
            f"{d.name} {d.hbm_bytes_per_s / 1e12:g} TB/s, bf16 {d.flops_per_s['bf16'] / 1e12:g} / "
            f"fp8 {d.flops_per_s['fp8'] / 1e12:g} TFLOP/s, {d.issue_per_s / 1e12:.3f} T warp-insn/s"
            for d in DEVICES.values()
        ),
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [
            r["kernel"],
            r["shape"],
            f"{r['bytes'] / 1e6:,.1f}",
            f"{r['flops'] / 1e9:,.1f}",
            f"{r['warp_instructions'] / 1e6:,.1f}" if r["warp_instructions"] else "-",
        ]
        for n in names:
            d = r["devices"][n]
            share = f"{d['over_floor']:.2f}x floor" if "over_floor" in d else f"{d['share']:.0%}"
            cells += [f"{d['model_us']:,.1f}", share, d["bound"]]
        lines.append("| " + " | ".join(cells) + " |")
    counted = [r for r in rows if r["warp_instructions"]]
    lines += [
        "",
        f"instruction counts (SASS, sm_90a; {SASS_COUNTS.name}): the variant each op "
        f"launches at the modelled shape, {len(counted)} kernels (SASS_SPECS: the "
        "tests/launch_plans.py case); each row's source: --json",
    ]
    return "\n".join(lines)


def _markdown(rows: list[dict]) -> str:
    """The per-kernel table of docs/perf/gpu_kernels.md (``--markdown``)."""
    names = list(DEVICES)
    head = ["kernel @ shape"]
    for n in names:
        head += [f"{n} model", f"{n} share", f"{n} binds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['kernel']} @ {r['shape']}"]
        for n in names:
            d = r["devices"][n]
            share = f"{d['over_floor']:.2f}x floor" if "over_floor" in d else f"{d['share']:.0%}"
            cells += [f"{d['model_us']:,.0f} us", share, d["bound"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--markdown", action="store_true", help="print docs/perf/gpu_kernels.md's table")
    p.add_argument(
        "--sass",
        action="store_true",
        help="recompile the counted kernels (sm_90a, tests/aot.py) and rewrite "
        f"{SASS_COUNTS.name} first",
    )
    p.add_argument(
        "--sass-only",
        metavar="KEY",
        nargs="+",
        help=f"as --sass for these SASS_SPECS keys only ({SASS_COUNTS.name}'s other entries kept)",
    )
    a = p.parse_args(argv)
    if a.sass or a.sass_only:
        _write_sass_counts(a.sass_only)
    rows = kernel_rows()
    if a.json:
        devices = {
            n: {
                "hbm_bytes_per_s": d.hbm_bytes_per_s,
                "flops_per_s": d.flops_per_s,
                "issue_per_s": d.issue_per_s,
                "latency_s": d.latency_s,
                "launch_s": d.launch_s,
                "gemm_bf16_per_s": d.gemm_bf16_per_s,
                "measured": d.measured,
            }
            for n, d in DEVICES.items()
        }
        print(
            json.dumps(
                {"model": "roofline model, not a measurement", "devices": devices, "kernels": rows},
                indent=1,
            )
        )
    elif a.markdown:
        print(_markdown(rows))
    else:
        print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
