// Host-side helpers of the Hopper stages that copy with the TMA (10 onwards): the tensor map of a
// (B, H, N, D) tensor, built with the driver's cuTensorMapEncodeTiled, and the number of SMs a
// persistent grid fills. Plain CUDA host code (no torch): the kernels' side of the TMA, the
// cp.async.bulk.tensor wrappers, is in hopper.cuh.
#pragma once
#include <algorithm>
#include <utility>
#include <cuda.h>           // CUtensorMap (a type only: the driver function is fetched at run time)
#include <cudaTypedefs.h>   // PFN_cuTensorMapEncodeTiled
#include "common.cuh"

// cuTensorMapEncodeTiled is a driver function: fetched once through the runtime, so the
// extension needs no -lcuda.
static inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }
  return fn;
}

// The tensor map of one (B, H, N, D) tensor with strides s (elements; 0 for a dim of size 1):
// dims (D, then N, H and B in order of increasing stride), boxes of 64 columns x `rows` rows,
// 128-byte swizzle, rows past N read as zeros. order: the map dims (1-3) that N, H and B became.
static inline const char* make_map(CUtensorMap* map, const void* ptr, int dtype,
                                   const FlashlabProblem* p, FlashlabStrides s, int rows,
                                   int3* order) {
  auto fn = encode_tiled();
  if (fn == nullptr) return "cuTensorMapEncodeTiled is not available from this CUDA driver";
  const long long esz = 2, size[3] = {p->N, p->H, p->B};
  long long stride[3] = {s.n * esz, s.h * esz, s.b * esz};
  long long extent = (long long)p->D * esz;  // a dim of size 1: any stride past the others
  for (int i = 0; i < 3; i++) extent = std::max(extent, stride[i] * size[i]);
  for (int i = 0; i < 3; i++)
    if (size[i] == 1) stride[i] = (extent + 15) / 16 * 16;
  int idx[3] = {0, 1, 2};  // N, H, B sorted by stride (stable)
  for (int i = 1; i < 3; i++)
    for (int k = i; k > 0 && stride[idx[k]] < stride[idx[k - 1]]; k--) std::swap(idx[k], idx[k - 1]);
  cuuint64_t dims[4] = {(cuuint64_t)p->D}, strides[3];
  cuuint32_t box[4] = {64, 1, 1, 1}, elem[4] = {1, 1, 1, 1};
  int where[3];
  for (int k = 0; k < 3; k++) {
    dims[k + 1] = size[idx[k]];
    strides[k] = stride[idx[k]];
    if (idx[k] == 0) box[k + 1] = rows;
    where[idx[k]] = k;
  }
  *order = make_int3(where[0] + 1, where[1] + 1, where[2] + 1);  // map dims 1-3
  CUresult r = fn(map, dtype == FLASHLAB_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                              : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                  4, const_cast<void*>(ptr), dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return flashlab_say("cuTensorMapEncodeTiled failed (error %d)", (int)r);
  return nullptr;
}

// The SMs of the current device (132 where it cannot say): a persistent grid (stages 11 onwards)
// launches BLOCKS blocks for each.
static inline int sm_count() {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      sms = 0;
  }
  return sms > 0 ? sms : 132;
}
