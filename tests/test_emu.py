"""The SIMT emulator itself (csrc/emu): its execution model gives the right
answers, and each check fires on a planted fault with a message naming kernel,
block, thread and address, while the correct version of the same kernel runs
clean. Kernels: csrc/emu/tests/selftest.cu."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from tests import emu as _emu

pytestmark = pytest.mark.emulated

KERNEL = r"in kernel compass::emu_selftest::{}, block \(\d+,0,0\), thread \({},0,0\)"
SRC = r"at csrc/emu/tests/selftest\.cu:\d+"


@pytest.fixture(scope="module")
def st():
    return _emu.load().selftest


def run(fn, *args):
    """Call a self-test entry point the way an op does (errors symbolized)."""
    try:
        return fn(*args)
    except _emu.EmulationError as err:
        raise type(err)(_emu.symbolize(str(err))) from None


def test_error_classes_are_runtime_errors():
    names = ["OutOfBoundsError", "BarrierError", "InactiveLaneError", "SharedMemoryRaceError"]
    for name in [*names, "UninitializedSharedMemoryError", "LaunchError"]:
        cls = getattr(_emu, name)
        assert issubclass(cls, _emu.EmulationError) and issubclass(cls, RuntimeError), name


# ----------------------------------------------------------- shared memory


def test_shared_memory_through_barriers(st):
    x, out = torch.randn(3 * 64), torch.empty(3 * 64)
    run(st.shared_shift, x, out, 0)
    idx = (torch.arange(64) + 2) % 64
    assert torch.equal(out, 2 * x.view(3, 64)[:, idx].reshape(-1))


def test_missing_barrier_is_a_shared_memory_race(st):
    x, out = torch.randn(3 * 64), torch.empty(3 * 64)
    pattern = (
        r"shared-memory race: write of 4 bytes of static shared memory offset \d+ \(0x[0-9a-f]+\) "
        + KERNEL.format("shared_shift_kernel", 1)
        + r", which thread \(0,0,0\) read since the last barrier"
    )
    with pytest.raises(_emu.SharedMemoryRaceError, match=pattern):
        run(st.shared_shift, x, out, 1)
    run(st.shared_shift, x, out, 0)  # the emulator is usable after a failed launch


def test_read_of_unwritten_shared_memory(st):
    x, out = torch.randn(64), torch.empty(64)
    with pytest.raises(
        _emu.UninitializedSharedMemoryError,
        match=r"read of 4 bytes of static shared memory .* that no thread of the block wrote "
        + KERNEL.format("shared_shift_kernel", 0),
    ):
        run(st.shared_shift, x, out, 2)


def test_syncwarp_orders_shared_memory_within_a_warp(st):
    x, out = torch.arange(64.0), torch.empty(64)
    run(st.warp_exchange, x, out, True)
    lane = torch.arange(64) % 32
    assert torch.equal(out, (torch.arange(64) - lane + (lane + 31) % 32).float())
    with pytest.raises(_emu.EmulationError, match="shared memory"):
        run(st.warp_exchange, x, out, False)


def test_dynamic_shared_memory(st):
    x, out = torch.arange(3 * 48.0), torch.empty(3 * 48)
    run(st.dynamic_reverse, x, out, 48)
    assert torch.equal(out, x.view(3, 48).flip(1).reshape(-1))


# ------------------------------------------------------------ global memory


def test_in_bounds_writes_run_clean(st):
    x, out = torch.zeros(128), torch.empty(128)
    run(st.index_fill, x, out, 128, 0)
    assert torch.equal(out, torch.arange(128.0))


def test_out_of_bounds_write(st):
    x, out = torch.zeros(128), torch.empty(128)
    pattern = (
        r"out-of-bounds global write of 4 bytes at 0x[0-9a-f]+ "
        + KERNEL.format("index_fill_kernel", 0).replace(r"\d+", "4")
        + r": byte offset 512 of 'out' \(float32\[128\]\), 512 bytes at 0x[0-9a-f]+, past its end"
    )
    if shutil.which("addr2line"):
        pattern += " " + SRC
    with pytest.raises(_emu.OutOfBoundsError, match=pattern):
        run(st.index_fill, x, out, 129, 0)


def test_out_of_bounds_read_names_the_tensor(st):
    x, out = torch.zeros(100), torch.empty(100)
    with pytest.raises(
        _emu.OutOfBoundsError,
        match=r"global read of 4 bytes .* block \(3,0,0\), thread \(3,0,0\): "
        r"byte offset 400 of 'x' \(float32\[100\]\)",
    ):
        run(st.index_fill, x, out, 100, 1)


def test_views_are_bounded_by_their_elements_not_their_storage(st):
    """A view into a larger tensor: the bytes after it belong to the storage, not to it."""
    storage = torch.zeros(256)
    x, out = storage[:64], torch.empty(64)
    with pytest.raises(_emu.OutOfBoundsError, match="'x' \\(float32\\[64\\]\\)"):
        run(st.index_fill, x, out, 64, 1)


# ------------------------------------------------------------------ barriers


def test_uniform_barrier(st):
    out = torch.full((64,), -1, dtype=torch.int32)
    run(st.barriers, out, 0)
    assert torch.equal(out, torch.arange(64, dtype=torch.int32))


def test_barrier_not_reached_by_every_thread(st):
    with pytest.raises(
        _emu.BarrierError,
        match=r"__syncthreads\(\) at csrc/emu/tests/selftest\.cu:\d+ reached by 40 of 64 threads; "
        r"thread \(40,0,0\) exited without reaching it in kernel "
        r"compass::emu_selftest::barrier_kernel, block \(0,0,0\)",
    ):
        run(st.barriers, torch.zeros(64, dtype=torch.int32), 1)


def test_threads_at_different_barriers(st):
    with pytest.raises(
        _emu.BarrierError,
        match=r"threads of one block wait at different barriers: thread \(0,0,0\) at "
        r"__syncthreads\(\) at csrc/emu/tests/selftest\.cu:(\d+), thread \(32,0,0\) at "
        r"__syncthreads\(\) at csrc/emu/tests/selftest\.cu:(?!\1)\d+",
    ):
        run(st.barriers, torch.zeros(64, dtype=torch.int32), 2)


# --------------------------------------------------------------------- warps


def test_lockstep_warp_collectives_give_the_right_answers(st):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * 32, generator=g).round(decimals=2)
    x[:32] = torch.tensor([3.0, -1.0] * 16)  # ties for the max, exact sums
    outs = [torch.empty(8 * 32) for _ in range(3)]
    ballot, count = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int32)
    run(st.warp_collectives, x, *outs, ballot, count)
    w = x.view(8, 32).double()
    sums, maxes, scans = (o.view(8, 32) for o in outs)
    assert torch.allclose(sums.double(), w.sum(1, keepdim=True).expand(8, 32), atol=1e-4)
    assert torch.equal(maxes, x.view(8, 32).max(1, keepdim=True).values.expand(8, 32))
    assert torch.allclose(scans.double(), w.cumsum(1), atol=1e-4)
    bits = ((w > 0).long() << torch.arange(32)).sum(1)
    assert torch.equal(ballot.long() & 0xFFFFFFFF, bits)
    assert torch.equal(count.long(), (w > 0).sum(1))


def test_shuffle_naming_an_exited_lane(st):
    with pytest.raises(
        _emu.InactiveLaneError,
        match=r"__shfl_xor_sync at csrc/emu/tests/selftest\.cu:\d+ with mask 0xffffffff names "
        r"lane 20 \(20,0,0\), which has exited "
        + KERNEL.format("partial_warp_kernel", 0).replace(r"\d+", "0"),
    ):
        run(st.partial_warp, torch.arange(32.0), torch.zeros(32), 0)


def test_shuffle_reading_a_lane_outside_its_mask(st):
    with pytest.raises(
        _emu.InactiveLaneError,
        match=r"__shfl_down_sync at .* reads lane 20, which is not in its mask 0xfffff "
        r"\(it has exited\) .* thread \(4,0,0\)",
    ):
        run(st.partial_warp, torch.arange(32.0), torch.zeros(32), 1)


def test_partial_warp_with_a_correct_mask(st):
    out = torch.zeros(32)
    run(st.partial_warp, torch.arange(32.0), out, 2)
    assert torch.equal(out[:16], torch.full((16,), 120.0)) and torch.all(out[16:] == 0)


# ------------------------------------------------------------------- atomics


def test_atomics_on_shared_and_global_memory(st):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 16, (1001,), generator=g, dtype=torch.int32)
    hist = torch.zeros(16, dtype=torch.int32)
    mx, fsum = torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    run(st.atomics, x, hist, mx, fsum)
    assert torch.equal(hist, torch.bincount(x, minlength=16).int())
    assert int(mx) == int(x.max()) and float(fsum) == float(x.sum())


# -------------------------------------------------------------------- launch


def test_bad_launch_configuration_is_a_launch_error(st):
    with pytest.raises(RuntimeError, match="noop_kernel: invalid configuration argument"):
        run(st.launch_config, torch.zeros(2048), 2048)
    run(st.launch_config, torch.zeros(1024), 1024)


def test_module_lists_the_kernels_and_entry_points():
    ev = _emu.evidence()
    assert ev["built"]
    assert {"routing.encode_sets_cuda", "fp8.grouped_args_cuda"} <= set(ev["entry_points"])
    assert any("routing" in k and "encode_kernel" in k for k in ev["kernels"]), ev["kernels"]
    assert any("grouped_args_kernel" in k for k in ev["kernels"]), ev["kernels"]
    before = ev["stats"]["launches"]
    run(_emu.load().selftest.barriers, torch.zeros(64, dtype=torch.int32), 0)
    assert _emu.evidence()["stats"]["launches"] == before + 1


def test_every_planted_mutant_is_built():
    """A mutant whose pattern no longer matches its source is left out of the build
    (cmake/emu.cmake warns); this fails until its pattern is updated."""
    from tests.test_routing_codec import CODEC_MUTANTS

    assert sorted(_emu.mutants().get("routing", [])) == sorted(CODEC_MUTANTS)
    with pytest.raises(ValueError, match="unknown mutant"):
        with _emu.mutant("no_such_mutant"):
            pass


def test_symbolize_rewrites_the_code_address():
    if not shutil.which("addr2line"):
        pytest.skip("addr2line (binutils) is not installed")
    x, out = torch.zeros(8), torch.empty(8)
    try:
        _emu.load().selftest.index_fill(x, out, 9, 0)
    except _emu.OutOfBoundsError as err:
        raw = str(err)
    assert re.search(r"\[code: \S+\+0x[0-9a-f]+\]", raw)
    assert re.search(SRC + "$", _emu.symbolize(raw))
