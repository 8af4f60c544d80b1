// Small CUDA helpers: launch checks, device guard, warp/block reductions.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "compass/common.h"

namespace compass {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Sets the current device for the scope of a launch, restores it after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    restore_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool restore_ = false;
};

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Max over a block of kThreads threads (a multiple of 32); every thread gets it.
template <int kThreads>
__device__ __forceinline__ float block_max(float v) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block size");
  __shared__ float partial[kThreads / 32];
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  v = lane < kThreads / 32 ? partial[lane] : -3.402823466e38f;
  v = warp_max(v);  // every warp reduces the same partials
  __syncthreads();  // partial[] may be reused by a later call
  return v;
}

}  // namespace compass
