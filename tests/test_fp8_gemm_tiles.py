"""The CUTLASS sm_90a grouped GEMM's tile-configuration heuristic
(csrc/fp8/sm90_tiles.h), plain C++ run on the CPU through its binding,
and the tile list agreeing with the build's translation units."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from compass_kernels import _C

M64, M128 = 0, 1
H100_SMS = 132
choose = _C.fp8.choose_sm90_tile


@pytest.mark.parametrize(
    "tokens,experts,top_k,n,want",
    [
        # DeepSeek-V3 gate/up (N = 4096): decode batches -> 64-row pingpong tiles,
        # prefill chunks (mean group 128 / 512 rows) -> 128-row cooperative tiles.
        (16, 256, 8, 4096, M64),
        (128, 256, 8, 4096, M64),
        (2048, 256, 8, 4096, M64),  # mean exactly 64 rows per expert
        (4096, 256, 8, 4096, M128),
        (16384, 256, 8, 4096, M128),
        # Qwen3-30B-A3B down (N = 2048), 128 experts.
        (512, 128, 8, 2048, M64),
        (8192, 128, 8, 2048, M128),
    ],
)
def test_model_shapes(tokens, experts, top_k, n, want):
    assert choose(tokens * top_k, experts, n, H100_SMS) == want


def test_mean_group_threshold_is_64_rows():
    for e in (1, 7, 256):
        assert choose(64 * e, e, 1 << 16, H100_SMS) == M64
        assert choose(64 * e + 1, e, 1 << 16, H100_SMS) == M128


def test_small_grid_takes_64_row_tiles():
    """Large groups but too few 128-row tiles to occupy every SM once: 64-row
    tiles double the parallelism."""
    rows, n = 4 * 1000, 256  # 32 row tiles x 2 column tiles = 64 < 132
    assert choose(rows, 4, n, H100_SMS) == M64
    assert choose(rows, 4, n, 64) == M128  # 64 tiles fill 64 SMs
    assert choose(rows, 4, n, 65) == M64


def test_empty_problem_and_bad_arguments():
    assert choose(0, 8, 128, H100_SMS) == M64
    for args, what in [
        ((-1, 8, 128, 132), "rows >= 0"),
        ((8, 0, 128, 132), "experts >= 1"),
        ((8, 8, 0, 132), "n >= 1"),
        ((8, 8, 128, 0), "sm_count >= 1"),
    ]:
        with pytest.raises(ValueError, match=what):
            choose(*args)


def test_every_tile_has_its_translation_unit():
    """SM90_TILES names one grouped_gemm_sm90_<tile>.cu each, all in CMakeLists'
    CUTLASS list (one configuration per translation unit)."""
    root = Path(__file__).resolve().parents[1]
    cmake = (root / "CMakeLists.txt").read_text()
    listed = re.search(r"set\(fp8_CUTLASS_CU([^)]*)\)", cmake).group(1).split()
    want = [f"csrc/fp8/grouped_gemm_sm90_{t}.cu" for t in _C.fp8.SM90_TILES]
    assert listed == want
    for f in want:
        text = (root / f).read_text()
        assert text.count("sm90::Config<") == 1, f"{f}: one tile configuration per TU"


# ------------------------------------------------- compile-level (sm_90a build)

BUILT_WITH_CUDA = bool(_C.build_info()["cuda"])
#: Per configuration: the schedule in its kernel's name, its QGMMA shape, and
#: the register budget (3 warpgroups x 128 threads: producer + 2 consumers).
KERNELS = {
    "m64": ("KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise", "64x128x32", 168),
    "m128": ("KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise", "64x128x32", 168),
}
SM90_SHARED_LIMIT = 232448  # 227 KB opt-in dynamic shared memory per block


@pytest.mark.sm90
@pytest.mark.skipif(not BUILT_WITH_CUDA, reason="_C built without CUDA (COMPASS_CUDA=OFF)")
@pytest.mark.parametrize("tile", list(KERNELS))
def test_cutlass_config_uses_qgmma_without_spills(tile):
    """Each tile configuration's CUTLASS kernel is in the sm_90a build: FP8
    tensor-core MMA (QGMMA) in its SASS, no spills or stack, registers
    reported, no device asserts, dynamic shared memory within the sm_90 limit
    (also a static_assert in grouped_gemm_sm90.cuh)."""
    from tests import aot

    schedule, mma, regs = KERNELS[tile]
    usage = aot.resource_usage(_C.__file__, arch="sm_90a")
    gemm = [k for k in usage if schedule in k and "device_kernel" in k]
    assert len(gemm) == 1, f"the {tile} CUTLASS kernel is not (once) in the sm_90a build"
    row = usage[gemm[0]]
    aot.assert_no_spills({gemm[0]: row})
    aot.assert_registers_at_most({gemm[0]: row}, regs)
    sass = aot.sass_of(_C.__file__, function=gemm[0])
    aot.assert_sass_contains(sass, rf"QGMMA\.{mma}\.F32\.E4M3\.E4M3", kernel=f"{tile} grouped GEMM")
    assert "__assertfail" not in sass
    index = list(_C.fp8.SM90_TILES).index(tile)
    smem = _C.fp8.grouped_gemm_sm90_shared_bytes(index)
    assert 0 < smem <= SM90_SHARED_LIMIT
    ws = _C.fp8.grouped_gemm_sm90_workspace(index, 256, H100_SMS)
    print(
        f"fp8 grouped GEMM {tile} (CUTLASS, sm_90a): {row['registers']} registers, "
        f"{smem} B shared memory, workspace {ws} B at E = 256"
    )


def test_cutlass_units_build_at_most_two_at_a_time():
    """Each CUTLASS TU takes ~4 GB to compile: CMake puts them in a job pool of
    depth 2. Checked in CMakeLists.txt, and in every generated build.ninja of
    this checkout (setup.py's build tree), where both TUs must carry the pool."""
    root = Path(__file__).resolve().parents[1]
    cmake = (root / "CMakeLists.txt").read_text()
    assert "JOB_POOLS compass_cutlass=2" in cmake
    assert re.search(
        r"TARGET compass_cuda_cutlass PROPERTY JOB_POOL_COMPILE compass_cutlass", cmake
    )
    for ninja in root.glob("build/*/compass_kernels._C/build.ninja"):
        rules = (ninja.parent / "CMakeFiles" / "rules.ninja").read_text()
        assert re.search(r"pool compass_cutlass\n\s+depth = 2", rules), ninja
        text = ninja.read_text()
        for tile in _C.fp8.SM90_TILES:
            block = text.split(f"grouped_gemm_sm90_{tile}.cu.o:", 1)
            if len(block) == 2:  # a CUDA build tree
                assert "pool = compass_cutlass" in block[1].split("\nbuild ", 1)[0], (ninja, tile)


# Per-expert entry sizes of the sm_90a kernel's arrays (StrideA / B / D are
# (int64, _1, _0) strides; the scale-factor layouts are cute layouts of a few
# ints), plus odd sizes so every rounding path is exercised.
_ELEM_SIZES = [(8, 8, 8, 40, 40), (8, 8, 8, 24, 24), (24, 24, 24, 56, 56), (1, 3, 5, 7, 9)]
_CUTLASS_BYTES = [0, 64, 132 * 128, 132 * 128 + 8, 1000003]


def _layout_errors(experts, cutlass_bytes, elem, layout) -> list[str]:
    """Why `layout` ([cutlass_offset, cutlass_bytes, 5 offsets, total]) is unsafe for CUTLASS."""
    cut_off, cut_bytes, offs, total = layout[0], layout[1], layout[2:7], layout[7]
    errs = []
    if cut_off % 128:
        errs.append(f"CUTLASS region at {cut_off}, not 128-byte aligned (TMA descriptors)")
    if cut_bytes != cutlass_bytes:
        errs.append(f"CUTLASS region of {cut_bytes} B, expected {cutlass_bytes}")
    spans = [(cut_off, cut_off + cutlass_bytes)]
    for o, size in zip(offs, elem, strict=True):
        if o % 16:
            errs.append(f"array at {o}, not 16-byte aligned")
        spans.append((o, o + size * experts))
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:], strict=False):
        if a1 > b0:
            errs.append(f"regions [{a0}, {a1}) and [{b0}, ...) overlap")
    if spans[-1][1] > total:
        errs.append(f"total {total} B < end of the last region {spans[-1][1]}")
    return errs


def _old_layout(experts, cutlass_bytes, elem):
    """The layout before the fix: arrays first (each rounded to 16 B), CUTLASS after."""
    offs, at = [], 0
    for size in elem:
        offs.append(at)
        at += (size * experts + 15) // 16 * 16
    return [at, cutlass_bytes, *offs, at + cutlass_bytes]


def test_workspace_layout_cutlass_region_aligned_for_every_expert_count():
    """The workspace carve (csrc/fp8/sm90_workspace.h): CUTLASS's region 128-byte
    aligned, the per-expert arrays 16-byte aligned and disjoint, for E = 1..300."""
    layout_of = _C.fp8.sm90_workspace_layout
    for elem in _ELEM_SIZES:
        for cutlass_bytes in _CUTLASS_BYTES:
            for e in range(1, 301):
                lay = layout_of(e, cutlass_bytes, list(elem))
                errs = _layout_errors(e, cutlass_bytes, elem, lay)
                assert not errs, f"E = {e}, CUTLASS {cutlass_bytes} B, sizes {elem}: {errs}"


def test_workspace_layout_check_rejects_the_old_carve():
    """The check above fails the old layout (CUTLASS after the arrays, each rounded to
    16 B) for most expert counts, whatever the entry sizes: it is the test that would
    have caught the misaligned TMA descriptors."""
    for elem in _ELEM_SIZES:
        bad = [
            e
            for e in range(1, 301)
            if _layout_errors(e, 132 * 128, elem, _old_layout(e, 132 * 128, elem))
        ]
        assert len(bad) >= 150, (elem, len(bad))


def test_workspace_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="experts >= 1"):
        _C.fp8.sm90_workspace_layout(0, 64, [8] * 5)
    with pytest.raises(ValueError, match="elem_bytes: expected 5"):
        _C.fp8.sm90_workspace_layout(3, 64, [8] * 4)
