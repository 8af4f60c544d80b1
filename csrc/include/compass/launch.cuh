// compass::launch<kernel>(grid, block, smem, stream, args...): how our .cu
// files launch a kernel. Under nvcc it is `kernel<<<grid, block, smem,
// stream>>>(args...)`; in an emulated build (COMPASS_EMULATION, the host
// compiler, docs/emulation.md) the emulator runs every CUDA thread of it on the
// CPU before returning, with its checks. Errors surface as for <<<>>>: a bad
// configuration through cudaGetLastError (check_launch), a failed emulation
// check as an exception.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#ifdef COMPASS_EMULATION
#include "compass_emu/launch.h"
#endif

namespace compass {

template <auto Kernel, typename... Args>
inline void launch(dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, Args&&... args) {
#ifdef COMPASS_EMULATION
  (void)stream;
  emu::launch_kernel<Kernel>(grid, block, smem, std::forward<Args>(args)...);
#else
  Kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
#endif
}

// The launch's dynamic shared memory (its `smem` bytes, 16-byte aligned), as
// T*. Kernels use this instead of `extern __shared__ T name[]`, which the
// emulator cannot give per-block storage to.
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
#ifdef COMPASS_EMULATION
  return static_cast<T*>(emu::dynamic_shared());
#else
  extern __shared__ __align__(16) unsigned char compass_dynamic_smem[];
  return reinterpret_cast<T*>(compass_dynamic_smem);
#endif
}

}  // namespace compass
