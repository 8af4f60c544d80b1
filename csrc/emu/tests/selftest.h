// Kernels that exercise the emulator's execution model and each of its
// checks (tests/test_emu.py). Entry points take CPU tensors as device memory.
#pragma once

#include <cstdint>

#include "compass/tensor_view.h"

namespace compass {
namespace emu_selftest {

// out[i] = 2 * x[block * 64 + (t + 2) % 64] through shared memory.
// mode 0: correct; 1: a __syncthreads() missing (a write-after-read race);
// 2: reads shared memory before any thread wrote it.
void shared_shift(const TensorView& x, const TensorView& out, int mode);
// out[i] = i for i < limit (limit > out.numel() writes out of bounds);
// read_offset > 0 reads x[i + read_offset] instead of i.
void index_fill(const TensorView& x, const TensorView& out, int64_t limit, int64_t read_offset);
// mode 0: every thread syncs; 1: threads >= 40 exit before the barrier;
// 2: two halves wait at different __syncthreads() calls.
void barriers(const TensorView& out, int mode);
// Per warp of x [n, 32]: xor-shuffle sum, down-shuffle max broadcast from lane
// 0, up-shuffle inclusive scan, ballot of x > 0, __reduce_add_sync count.
void warp_collectives(const TensorView& x, const TensorView& sum, const TensorView& max,
                      const TensorView& scan, const TensorView& ballot, const TensorView& count);
// mode 0: lanes >= 20 exit, the rest shuffle with a full mask (names exited
// lanes); 1: mask of lanes < 20 but shuffles down by 16 (reads lane 20+);
// 2: correct: lanes < 16 reduce with mask 0xffff, width 16.
void partial_warp(const TensorView& x, const TensorView& out, int mode);
// hist[v] += 1 for each x (int32 values in [0, bins)), through a per-block
// shared histogram and global atomics; max[0] = max x (atomicMax);
// fsum[0] = sum of x as float (atomicCAS loop).
void atomics(const TensorView& x, const TensorView& hist, const TensorView& max,
             const TensorView& fsum);
// out[w * 32 + l] = x[w * 32 + (l + 31) % 32] through shared memory, ordered by
// __syncwarp() (use_syncwarp) or not at all.
void warp_exchange(const TensorView& x, const TensorView& out, bool use_syncwarp);
// out = x reversed within blocks of `threads`, through dynamic shared memory.
void dynamic_reverse(const TensorView& x, const TensorView& out, int threads);
// Launches with `threads` per block (> 1024 is refused, as on a GPU).
void launch_config(const TensorView& out, int threads);

}  // namespace emu_selftest
}  // namespace compass
