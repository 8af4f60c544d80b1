"""Compile-level checks of sm_90a code without a GPU (tests.aot).

- An fp8 tl.dot kernel compiled for sm_90 uses the Hopper tensor-core path:
  wgmma.mma_async with e4m3 operands in the PTX, QGMMA in the SASS.
- Elementwise and ck.advantages kernels compile with no register spills
  (exact ptxas spill counts); a kernel forced to spill is caught, so the
  assertion can fail.
- All of that works with TRITON_INTERPRET=1 set in the process (the tier this
  suite runs in without a GPU), and leaves the interpreter working after.
- cuobjdump reports of a shared library with an embedded sm_90a fatbin (what
  compass_kernels/_C*.so carries) are parsed per kernel; spills there are
  caught too; multi-arch libraries need arch=.
- The tool finder says where it looked when a tool is missing.
"""

from __future__ import annotations

from tests.triton_tier import triton

# isort: split

import os
import shutil
import stat
import subprocess

import pytest
import torch
import triton.language as tl

from tests import aot
from tests.tiers import INTERPRETER_ONLY
from tests.triton_tier import have_tool, needs_cuobjdump

pytestmark = pytest.mark.sm90


@triton.jit
def _fp8_dot_kernel(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], tl.dot(a, b))


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a * x + y, mask=mask)


@triton.jit
def _all_live_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    # Every loaded value stays live across the reduction: BLOCK / 32 registers
    # per thread with one warp, far above a small maxnreg.
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, x / tl.sum(x * x, axis=0))


@triton.jit
def _cast_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(y_ptr.dtype.element_ty))


FP8_DOT_SIG = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*fp32"}
FP8_DOT_SIG |= {"BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}


@pytest.fixture(scope="module")
def fp8_dot():
    return aot.compile_triton(_fp8_dot_kernel, FP8_DOT_SIG, {"BM": 64, "BN": 64, "BK": 64})


# --------------------------------------------------------------- Triton kernels


def test_fp8_dot_uses_wgmma_e4m3(fp8_dot):
    assert fp8_dot.name == "_fp8_dot_kernel"
    assert fp8_dot.arch == 90
    assert ".target sm_90a" in fp8_dot.ptx
    wgmma = [ln for ln in fp8_dot.ptx.splitlines() if "wgmma.mma_async" in ln]
    assert wgmma, "no wgmma.mma_async in the PTX"
    assert all(".f32.e4m3.e4m3" in ln for ln in wgmma), wgmma[:2]


@needs_cuobjdump
def test_fp8_dot_sass_has_qgmma(fp8_dot):
    assert fp8_dot.cubin[:4] == b"\x7fELF"
    aot.assert_sass_contains(fp8_dot.sass, r"QGMMA\.\w+\.F32\.E4M3\.E4M3", kernel=fp8_dot.name)
    with pytest.raises(
        AssertionError, match=r"_fp8_dot_kernel has no match .*HMMA.*opcodes present:.* QGMMA"
    ):
        aot.assert_sass_contains(fp8_dot.sass, r"HMMA\.", kernel=fp8_dot.name)
    aot.assert_no_spills(fp8_dot.resource_usage)


@needs_cuobjdump
def test_elementwise_kernel_has_no_spills():
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "a": "fp32", "n": "i32"}
    art = aot.compile_triton(_axpy_kernel, sig | {"BLOCK": "constexpr"}, {"BLOCK": 1024})
    usage = art.resource_usage
    assert usage["name"] == "_axpy_kernel" and usage["arch"] == "sm_90a"
    assert (usage["spill_stores"], usage["spill_loads"], usage["stack"]) == (0, 0, 0)
    assert 0 < usage["registers"] <= 64
    aot.assert_no_spills(usage)
    aot.assert_registers_at_most(usage, 64)
    with pytest.raises(AssertionError, match=rf"_axpy_kernel: {usage['registers']} registers > 4"):
        aot.assert_registers_at_most(usage, 4)
    aot.assert_sass_contains(art.sass, r"FFMA", kernel=art.name)


@needs_cuobjdump
def test_spilling_kernel_is_caught():
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}
    art = aot.compile_triton(_all_live_kernel, sig, {"BLOCK": 4096}, num_warps=1, maxnreg=32)
    usage = art.resource_usage
    assert usage["registers"] <= 32
    assert usage["spill_stores"] > 0 and usage["spill_loads"] > 0
    with pytest.raises(AssertionError, match=r"_all_live_kernel: spill stores \d+ B"):
        aot.assert_no_spills(usage)


def test_fp32_to_fp8_converts_with_satfinite():
    # Documents the GPU semantics the interpreter fix is compared with: Triton on
    # sm_90 saturates both fp8 formats; torch saturates e4m3fn but overflows
    # e5m2 to inf (see tests.triton_interpreter).
    for dtype, cvt in (("fp8e4nv", "e4m3x2"), ("fp8e5", "e5m2x2")):
        sig = {"x_ptr": "*fp32", "y_ptr": f"*{dtype}", "BLOCK": "constexpr"}
        art = aot.compile_triton(_cast_kernel, sig, {"BLOCK": 256})
        assert f"cvt.rn.satfinite.{cvt}.f32" in art.ptx


def test_signature_must_cover_every_parameter():
    with pytest.raises(ValueError, match=r"lacks parameters \['n', 'BLOCK'\]"):
        aot.compile_triton(
            _axpy_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "a": "fp32"}
        )


def test_compile_under_interpreter_leaves_it_working():
    from triton.runtime.interpreter import InterpretedFunction

    if not triton.knobs.runtime.interpret:
        pytest.skip(INTERPRETER_ONLY)
    assert isinstance(_axpy_kernel, InterpretedFunction)
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "a": "fp32", "n": "i32"}
    aot.compile_triton(_axpy_kernel, sig | {"BLOCK": "constexpr"}, {"BLOCK": 128})
    assert triton.knobs.runtime.interpret
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(tl.sum, InterpretedFunction)  # the swap was undone
    x, y = torch.arange(200, dtype=torch.float32), torch.ones(200)
    out = torch.full((200,), float("nan"))
    _axpy_kernel[(2,)](x, y, out, 2.0, 200, BLOCK=128)
    torch.testing.assert_close(out, 2 * x + y, rtol=0, atol=0)


def test_compile_refuses_leftover_interpreter_patches(monkeypatch):
    # What an unfixed interpreter leaves after a tl.sum call: triton.language
    # attributes replaced by interpreter code. Compiling then would fail deep in
    # code generation (or worse); it must fail clearly instead.
    from triton.runtime import interpreter

    monkeypatch.setattr(tl.core.dtype, "to_ir", interpreter._get_np_dtype)
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "a": "fp32", "n": "i32"}
    with pytest.raises(
        RuntimeError, match=r"still patched by the Triton interpreter \(tl.dtype.to_ir"
    ):
        aot.compile_triton(_axpy_kernel, sig | {"BLOCK": "constexpr"}, {"BLOCK": 128})


@needs_cuobjdump
def test_advantages_kernels_compile_without_spills():
    from compass_kernels.advantages import triton as kt

    # The signatures and launch options come from the Triton module: every
    # variant its wrappers launch (ptxas 12.8, bundled with triton 3.6, spilled
    # the group kernel without its maxnreg budget).
    arts = [aot.compile_triton(k, sig, const, **opts) for k, sig, const, opts in kt.aot_variants()]
    assert len(arts) == 10
    for art in arts:
        aot.assert_no_spills(art.resource_usage)
        aot.assert_registers_at_most(art.resource_usage, 128)
    # float64 statistics really run in float64 (not silently demoted to fp32).
    assert "add.rn.f64" in arts[0].ptx or "add.f64" in arts[0].ptx


# ------------------------------------------------- cubins and shared libraries

_CU_SOURCE = r"""
extern "C" __global__ void add_one(const float* a, float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i] + 1.f;
}
// 32 values live at once under a 16-register cap (ptxas raises it to 24): spills.
extern "C" __global__ void __maxnreg__(16) spills(const float* a, float* b, int n) {
  float v[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) v[k] = a[k * n + threadIdx.x];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i)
#pragma unroll
    for (int j = 0; j < 32; ++j) s += v[i] * v[(i + j) & 31];
  b[threadIdx.x] = s;
}
"""


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for cand in (os.path.join(home, "bin", "nvcc"), shutil.which("nvcc")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.fixture(scope="module")
def fatbin_library(tmp_path_factory):
    """A shared library embedding sm_80 and sm_90a cubins, as the extension build does."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME)")
    if not have_tool("cuobjdump"):
        pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    tmp = tmp_path_factory.mktemp("fatbin")
    (tmp / "k.cu").write_text(_CU_SOURCE)
    cmd = [
        nvcc,
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90a,code=sm_90a",
        "-Xcompiler",
        "-fPIC",
        "-shared",
        str(tmp / "k.cu"),
        "-o",
        str(tmp / "libk.so"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return tmp / "libk.so"


def test_shared_library_resource_usage(fatbin_library):
    assert aot.functions_in(fatbin_library) == ["add_one", "spills"]
    with pytest.raises(
        ValueError, match=r"kernel \w+ is embedded for sm_80 and sm_90a; pass arch="
    ):
        aot.resource_usage(fatbin_library)
    usage = aot.resource_usage(fatbin_library, arch="sm_90a")
    assert set(usage) == {"add_one", "spills"}
    assert usage["add_one"]["arch"] == "sm_90a"
    assert 0 < usage["add_one"]["registers"] <= 16 and usage["add_one"]["stack"] == 0
    assert usage["spills"]["stack"] > 0
    aot.assert_no_spills({"add_one": usage["add_one"]})
    with pytest.raises(AssertionError, match=r"spills: spills unknown.*stack \d+ B") as exc:
        aot.assert_no_spills(usage)
    assert "add_one" not in str(exc.value)
    with pytest.raises(AssertionError, match=r"spills: \d+ registers > 16"):
        aot.assert_registers_at_most(usage, 16)


def test_shared_library_sass(fatbin_library):
    sass = aot.sass_of(fatbin_library, function="add_one")
    assert "add_one" in sass and "spills" not in sass
    aot.assert_sass_contains(sass, r"FADD", kernel="add_one")


def test_parse_resource_usage_of_a_bare_cubin():
    text = (
        "\nResource usage:\n Common:\n  GLOBAL:0\n Function k:\n"
        "  REG:63 STACK:8 SHARED:1024 LOCAL:4 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    )
    assert aot.parse_resource_usage(text) == [
        {
            "name": "k",
            "arch": None,
            "registers": 63,
            "stack": 8,
            "shared": 1024,
            "local": 4,
            "constant": 568,
        }
    ]


# ------------------------------------------------------------------ tool finder


def test_find_tool_finds_cuobjdump_and_ptxas():
    for tool in ("cuobjdump", "ptxas"):
        if not have_tool(tool):
            continue
        path = aot.find_tool(tool)
        assert path.name == tool and os.access(path, os.X_OK)


def test_find_tool_prefers_cuda_home(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "cuobjdump"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert aot.find_tool("cuobjdump") == fake


def test_find_tool_error_lists_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(aot.ToolNotFoundError) as exc:
        aot.find_tool("no-such-cuda-tool")
    msg = str(exc.value)
    assert msg.startswith("no-such-cuda-tool not found")
    assert f"$CUDA_HOME/bin: {tmp_path / 'bin'}" in msg
    assert "/usr/local/cuda/bin" in msg
    assert f"PATH: {tmp_path / 'nowhere'}" in msg
    assert "triton wheel:" in msg
    with pytest.raises(FileNotFoundError):  # ToolNotFoundError is a FileNotFoundError
        aot.find_tool("no-such-cuda-tool")
    with pytest.raises(ValueError, match="bare tool name"):
        aot.find_tool("/usr/bin/cuobjdump")
