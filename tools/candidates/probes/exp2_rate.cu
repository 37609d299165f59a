// How fast can one warp on each SM sub-partition exponentiate? A standalone probe for the
// softmax of the Hopper stages, where each consumer warpgroup puts one warp on each
// sub-partition. Each thread carries 64 independent values through `iters` rounds of
// y = 2^x - 1.5, with three ways to take 2^x:
//   MUFU       ex2.approx.ftz.f32, the special-function unit (16 results a cycle per SM);
//   FMA poly   a cubic on the FMA pipe: round x to an integer j (adding 1.5 * 2^23), a cubic
//              in x - j for 2^(x - j), then j added to the exponent bits (about 2e-4 relative
//              error, ample for a P stored in 16 bits);
//   mixed      every fourth value by the cubic, the rest by MUFU.
// It prints the cycles (clock64) per exponential per warp, with 1, 2 and 4 warps a
// sub-partition (one block of 4, 8, 16 warps on each SM).
//     nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o exp2_rate exp2_rate.cu && ./exp2_rate
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float ex2_poly(float x) {  // 2^x for x in [-127, 0], FMA and ALU only
  x = fmaxf(x, -127.f);
  const float r = x + 12582912.f;        // 1.5 * 2^23: x rounded to an integer j, in r's low bits
  const float f = x - (r - 12582912.f);  // in [-0.5, 0.5]
  const float p = fmaf(fmaf(fmaf(0.0555041f, f, 0.2402265f), f, 0.6931472f), f, 1.0f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(r) << 23));
}

template <int MODE>  // 0: MUFU, 1: FMA poly, 2: mixed
__global__ void rounds(float* out, long long* cycles, int iters) {
  float x[64];
#pragma unroll
  for (int i = 0; i < 64; i++) x[i] = -0.5f - (threadIdx.x % 32) * 1e-3f - i * 1e-4f;
  const long long t0 = clock64();
  for (int it = 0; it < iters; it++) {
#pragma unroll
    for (int i = 0; i < 64; i++) {
      const bool poly = MODE == 1 || (MODE == 2 && i % 4 == 0);
      x[i] = (poly ? ex2_poly(x[i]) : ex2(x[i])) - 1.5f;
    }
  }
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; i++) s += x[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the rounds from being optimized away
  if (threadIdx.x % 32 == 0) cycles[blockIdx.x * 32 + threadIdx.x / 32] = t1 - t0;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  long long* cycles;
  cudaMalloc(&out, sms * 512 * sizeof(float));
  cudaMalloc(&cycles, sms * 32 * sizeof(long long));
  const int iters = 200;
  const char* names[] = {"MUFU    ", "FMA poly", "mixed   "};
  void (*kernels[])(float*, long long*, int) = {rounds<0>, rounds<1>, rounds<2>};
  for (int mode = 0; mode < 3; mode++)
    for (int warps : {4, 8, 16}) {
      for (int rep = 0; rep < 2; rep++) kernels[mode]<<<sms, 32 * warps>>>(out, cycles, iters);
      if (cudaDeviceSynchronize() != cudaSuccess) {
        printf("failed: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
      }
      long long h[32];
      cudaMemcpy(h, cycles, sizeof(h), cudaMemcpyDeviceToHost);  // block 0's warps
      double mean = 0;
      for (int w = 0; w < warps; w++) mean += h[w];
      mean /= warps * iters * 64.0;
      printf("%s %d warp(s) a sub-partition: %5.2f cycles per exponential per warp, %5.2f per "
             "sub-partition\n", names[mode], warps / 4, mean, mean / (warps / 4));
    }
  return 0;
}
