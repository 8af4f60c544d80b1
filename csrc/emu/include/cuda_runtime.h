// The emulator's cuda_runtime.h: what an emulated .cu file sees instead of the
// CUDA toolkit's. It is first on the include path of emulated builds only
// (cmake/emu.cmake), and it is force-included like nvcc force-includes the
// real one. Device-side keywords and intrinsics are in compass_emu/device.h;
// this file adds the slice of the host runtime API our entry points use.
// Adding an API: declare it here (host) or in device.h (device) with the
// CUDA signature; see docs/emulation.md.
#pragma once

#ifndef COMPASS_EMULATION
#error "csrc/emu/include/cuda_runtime.h is the emulator's; only emulated builds may include it"
#endif

#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "compass_emu/device.h"
#include "compass_emu/runtime.h"

// ------------------------------------------------------------------ errors
typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchFailure = 719,
} cudaError_t;

inline const char* cudaGetErrorString(cudaError_t e) {
  return compass::emu::last_error_string(static_cast<int>(e));
}
inline cudaError_t cudaGetLastError() {
  return static_cast<cudaError_t>(compass::emu::take_last_error());
}
inline cudaError_t cudaPeekAtLastError() {
  return static_cast<cudaError_t>(compass::emu::peek_last_error());
}

// ----------------------------------------------------- devices and streams
// One emulated device, number 0. Streams are accepted and ignored: every
// launch runs to completion before it returns.
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

// ------------------------------------------------------------------ memory
// cudaMalloc'd blocks are device memory for the bounds check until freed.
inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  *p = std::malloc(bytes ? bytes : 1);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  compass::emu::add_device_range(*p, bytes, "cudaMalloc block");
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  compass::emu::remove_device_range(p);
  std::free(p);
  return cudaSuccess;
}

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  if (kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice) {
    compass::emu::check_host_access(src, bytes, "cudaMemcpy source");
  }
  if (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) {
    compass::emu::check_host_access(dst, bytes, "cudaMemcpy destination");
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes,
                                   cudaMemcpyKind kind, cudaStream_t = nullptr) {
  return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemset(void* dst, int value, std::size_t bytes) {
  compass::emu::check_host_access(dst, bytes, "cudaMemset destination");
  std::memset(dst, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t = nullptr) {
  return cudaMemset(dst, value, bytes);
}

// Attributes (max dynamic shared memory, carveout) have no effect here.
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
