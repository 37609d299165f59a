// Small host-side helpers every stage shares. A stage's own device code stays in its own file, so
// that a reader sees the whole kernel in one place; frozen device wrappers that several stages
// use unchanged are in ptx.cuh and hopper.cuh.
#pragma once
#include <cuda_runtime.h>
#include <cstdarg>
#include <cstdio>
#include "flashlab.h"

// Return the CUDA error string from the enclosing flashlab_* function if `expr` fails.
#define FLASHLAB_TRY(expr)                                   \
  do {                                                       \
    cudaError_t flashlab_err_ = (expr);                      \
    if (flashlab_err_ != cudaSuccess) return cudaGetErrorString(flashlab_err_); \
  } while (0)

static inline int flashlab_cdiv(int a, int b) { return (a + b - 1) / b; }

// A formatted message that outlives the call (the binding copies it at once).
static inline const char* flashlab_say(const char* fmt, ...) {
  static thread_local char buf[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

// The most dynamic shared memory one block may ask for on the current device (after opting in).
static inline int flashlab_max_smem_per_block() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 48 * 1024;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 48 * 1024;
  return bytes;
}

// Blocks may use more than 48 KiB of dynamic shared memory only after they ask for it.
template <typename Kernel>
static inline cudaError_t flashlab_allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}
