// Stage 04 — WMMA tensor cores: QKᵀ and PV as 16 x 16 x 16 matrix multiplies, fp16 / bf16 in,
// fp32 accumulation.
//
// The one idea: stop multiplying one pair of numbers per lane. A warp hands the tensor cores a
// whole 16 x 16 x 16 product at once (nvcuda::wmma: load_matrix_sync, mma_sync, store_matrix_sync),
// and the tensor cores retire it many times faster than 32 lanes of FFMAs could. The structure is
// stage 03's: a block owns BR = 64 query rows (FlashAttention-2 order) and walks all K/V tiles;
// each of its 4 warps owns 16 of the rows.
//
// What changed from 03, and why:
//  1. Inputs are fp16 or bf16 (one template for both), since that is what the tensor cores take.
//  2. A WMMA fragment is opaque: which lane holds which element is left to the compiler, so that
//     the same source runs on every architecture. A warp therefore cannot find a row's maximum in
//     the accumulator of S. Each tile's S takes a round trip through shared memory instead:
//     wmma -> S (fp32, shared) -> online softmax by ordinary lanes -> P (T, shared) -> wmma.
//  3. For the same reason O cannot be rescaled by the per-row alpha while it is a fragment, so O
//     lives in shared memory (fp32) for the whole loop. The softmax lanes rescale their rows of O
//     in place, and the P·V product loads O as its accumulator and stores it back. (Storing P·V
//     to a scratch tile and adding it to O in registers would move as many bytes and need more
//     code; stage 05 removes the round trips altogether.)
//  4. Padding for 16-bit rows and for the fragment access patterns (see Tiles).
// Each warp touches only its own 16 rows of S, P and O, so those steps are separated by
// __syncwarp; __syncthreads only brackets the shared K/V tile.
// (nvcc 13 compiles fp16 fragment loads to ldmatrix, LDSM in the SASS, but bf16 ones to generic
// loads, LD.E: the same tiles, more instructions. Stage 05 writes its own ldmatrix.)
#include <cmath>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include "common.cuh"

using namespace nvcuda;

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int F = 16;  // the WMMA shape: F x F x F

// Shared memory: K and V tiles (T), the score tile S (fp32; P is written over it), O (fp32).
// Q passes through the warp's O rows once on its way into registers. The two aliases keep a
// D = 64 block at 54 KiB, so that 4 blocks (16 warps) fit on an H100 SM.
template <int D, int BR, int BC>
struct Tiles {
  static_assert(BR == F * WARPS, "each warp owns 16 query rows");
  static_assert(BC % 32 == 0 && D % 64 == 0, "the softmax lanes cover 32 keys, O 64 columns");
  // Row strides. A fragment load reads 8 rows x 16 bytes at once, so 16-bit rows must start 16
  // bytes (4 banks) apart modulo 128: +8 elements. An fp32 accumulator store writes 4 rows x 32
  // bytes per half-warp, so fp32 rows must start 32 bytes (8 banks) apart: +8 floats.
  static constexpr int LDK = D + 8;   // K, V and the staged Q (elements of T)
  static constexpr int LDS = BC + 8;  // S (floats)
  static constexpr int LDP = BC + 8;  // P (elements of T), inside the warp's rows of S
  static constexpr int LDO = D + 8;   // O (floats)
  static constexpr size_t SMEM = 2 * BC * LDK * 2 + BR * LDS * 4 + BR * LDO * 4;
  static_assert(F * LDP * 2 <= F * LDS * 4 && F * LDK * 2 <= F * LDO * 4, "aliases fit");
};

// Two floats rounded to T, packed in 32 bits (element a at the lower address).
__device__ __forceinline__ unsigned pack2(float a, float b, __half) {
  __half2 x = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&x);
}
__device__ __forceinline__ unsigned pack2(float a, float b, __nv_bfloat16) {
  __nv_bfloat162 x = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&x);
}

// 2^x in one MUFU.EX2 instruction. (exp2f adds a range check for results below 2^-126; the
// softmax only needs those to be 0.)
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Rows [first, first + ROWS) of a (N, D) matrix into shared memory with row stride LD, 16 bytes
// (8 elements) per load; zeros past N. All loads are issued before the first store.
template <int ROWS, int D, int LD, int NT, typename T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int first, int N, int t) {
  constexpr int PER_ROW = D / 8, ITERS = ROWS * PER_ROW / NT;
  static_assert(ROWS * PER_ROW % NT == 0, "whole trips");
  uint4 x[ITERS];
#pragma unroll
  for (int i = 0; i < ITERS; i++) {
    const int e = t + i * NT, r = e / PER_ROW, c = e % PER_ROW * 8;
    x[i] = first + r < N ? *reinterpret_cast<const uint4*>(src + (size_t)(first + r) * D + c)
                         : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < ITERS; i++) {
    const int e = t + i * NT;
    *reinterpret_cast<uint4*>(dst + e / PER_ROW * LD + e % PER_ROW * 8) = x[i];
  }
}

// Reduce across the 16 lanes of a half-warp (they share a row in the softmax).
__device__ __forceinline__ float max16(float x) {
  for (int s = 8; s > 0; s >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, s));
  return x;
}
__device__ __forceinline__ float sum16(float x) {
  for (int s = 8; s > 0; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
  return x;
}

// The softmax layout: in step i (0..7) half-warp h handles row (i & 3) + 4h + 8(i >> 2) of the
// warp's 16. The two rows of a step are 4 apart, so their P stores fall in different banks.
__device__ __forceinline__ int softmax_row(int i, int h) { return (i & 3) + 4 * h + 8 * (i >> 2); }

// Multiply the columns 4c .. 4c+3 (+ 64g) of a row of O by f: lane c's share of the row.
template <int D>
__device__ __forceinline__ void scale_row(float* row, int c, float f) {
#pragma unroll
  for (int g = 0; g < D / 64; g++) {
    float4* o = reinterpret_cast<float4*>(row + 4 * c + 64 * g);
    const float4 x = *o;
    *o = make_float4(x.x * f, x.y * f, x.z * f, x.w * f);
  }
}

template <int D, int BR, int BC, typename T>
__global__ void __launch_bounds__(THREADS, D == 64 ? 4 : 2)
wmma_kernel(const T* Q, const T* K, const T* V, T* O, int N, float scale, int causal) {
  using L = Tiles<D, BR, BC>;
  constexpr int LDK = L::LDK, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO, NP = BC / 32;
  extern __shared__ uint4 smem4[];
  T* Ks = reinterpret_cast<T*>(smem4);
  T* Vs = Ks + BC * LDK;
  float* Ss = reinterpret_cast<float*>(Vs + BC * LDK);
  float* Os = Ss + BR * LDS;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = lane / 16, c = lane % 16;
  float* Sw = Ss + F * warp * LDS;        // this warp's 16 rows of S ...
  T* Pw = reinterpret_cast<T*>(Sw);       // ... which P overwrites, with its own row stride
  float* Ow = Os + F * warp * LDO;        // this warp's 16 rows of O
  // Block b: query tile b % tiles of (batch, head) b / tiles; 1-D since gridDim.y <= 65535.
  const int tiles = (N + BR - 1) / BR, bh = blockIdx.x / tiles, qt = blockIdx.x % tiles;
  const int q0 = qt * BR, r0 = q0 + F * warp;  // first row of the block, of the warp
  const size_t base = (size_t)bh * N * D;
  Q += base; K += base; V += base;  // O is offset at the store: one pointer fewer held in the loop
  const float scale_log2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x log2 e)

  // The warp's Q rows go through its O rows into fragments, which stay in registers; then O = 0.
  wmma::fragment<wmma::matrix_a, F, F, F, T, wmma::row_major> qf[D / F];
  load_rows<F, D, LDK, 32>(reinterpret_cast<T*>(Ow), Q, r0, N, lane);
  __syncwarp();
#pragma unroll
  for (int k = 0; k < D / F; k++) wmma::load_matrix_sync(qf[k], reinterpret_cast<T*>(Ow) + F * k, LDK);
  __syncwarp();
  for (int e = lane; e < F * LDO / 4; e += 32) reinterpret_cast<float4*>(Ow)[e] = make_float4(0, 0, 0, 0);

  float m[8], l[8];  // running max (log2 units) and this lane's share of the sum, per row
#pragma unroll
  for (int i = 0; i < 8; i++) m[i] = -INFINITY, l[i] = 0.f;

  const int last_key = causal ? min(N, q0 + BR) : N;  // keys at or past this are masked for all
  const int n_tiles = (last_key + BC - 1) / BC;
  for (int j = 0; j < n_tiles; j++) {
    const int k0 = j * BC;
    __syncthreads();  // every warp is done with the previous K and V (and the O zeroing)
    load_rows<BC, D, LDK, THREADS>(Ks, K, k0, N, threadIdx.x);
    load_rows<BC, D, LDK, THREADS>(Vs, V, k0, N, threadIdx.x);
    __syncthreads();

    // S = Q Kᵀ for the warp's 16 rows: Kᵀ is K read column-major, so no transpose is stored.
    // BEGIN EXERCISE 04.qk_wmma: S = Q Kᵀ on the tensor cores: for each 16-key block n, an fp32
    // accumulator fragment summed over the head dim (qf[k] times K's 16 x 16 block read as a
    // col_major matrix_b: that is Kᵀ), stored to the warp's rows of S (Sw, row stride LDS).
#pragma unroll
    for (int n = 0; n < BC / F; n++) {
      wmma::fragment<wmma::accumulator, F, F, F, float> sf;
      wmma::fill_fragment(sf, 0.f);
#pragma unroll
      for (int k = 0; k < D / F; k++) {
        wmma::fragment<wmma::matrix_b, F, F, F, T, wmma::col_major> kf;
        wmma::load_matrix_sync(kf, Ks + F * n * LDK + F * k, LDK);
        wmma::mma_sync(sf, qf[k], kf, sf);
      }
      wmma::store_matrix_sync(Sw + F * n, sf, LDS, wmma::mem_row_major);
    }
    // STUB: // TODO: S is all zeros here, so every key gets the same weight. Replace this loop.
    // STUB: for (int e = lane; e < F * BC; e += 32) Sw[e / BC * LDS + e % BC] = 0.f;
    // END EXERCISE 04.qk_wmma
    __syncwarp();  // S is in shared memory, where every lane can find its row

    // Online softmax, 16 lanes per row, 2 scores (a float2) per lane per 32 keys.
    float2 s[8][NP];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
      for (int b = 0; b < NP; b++)
        s[i][b] = *reinterpret_cast<const float2*>(Sw + softmax_row(i, h) * LDS + 2 * c + 32 * b);
    __syncwarp();  // all of S is in registers: P may overwrite it
    const bool edge = k0 + BC > N || (causal && k0 + BC - 1 > r0);  // some key is masked
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int r = softmax_row(i, h), row = r0 + r;
      auto scaled = [&](float x, int key) {  // in log2 units; -inf for a key past N or the diagonal
        return edge && (key >= N || (causal && key > row)) ? -INFINITY : x * scale_log2;
      };
      float mx = -INFINITY;
#pragma unroll
      for (int b = 0; b < NP; b++) {
        const int key = k0 + 2 * c + 32 * b;
        s[i][b] = make_float2(scaled(s[i][b].x, key), scaled(s[i][b].y, key + 1));
        mx = fmaxf(mx, fmaxf(s[i][b].x, s[i][b].y));
      }
      const float m_new = fmaxf(m[i], max16(mx));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet stays at 0
      const float alpha = exp2_fast(m[i] - m_use);
      m[i] = m_new;
      float part = 0.f;
#pragma unroll
      for (int b = 0; b < NP; b++) {
        const float p0 = exp2_fast(s[i][b].x - m_use), p1 = exp2_fast(s[i][b].y - m_use);
        *reinterpret_cast<unsigned*>(Pw + r * LDP + 2 * c + 32 * b) = pack2(p0, p1, T());
        part += p0 + p1;
      }
      l[i] = fmaf(l[i], alpha, part);
      scale_row<D>(Ow + r * LDO, c, alpha);  // the rescale a fragment could not do
    }
    __syncwarp();  // P and the rescaled O rows are complete

    // O += P V, with O loaded from shared memory as the accumulator and stored back.
    // BEGIN EXERCISE 04.pv_wmma (5 points): O += P V on the tensor cores: P's 16 x BC rows (Pw, stride LDP)
    // as matrix_a fragments; for each 16-column block of O, load it from Ow (stride LDO) as the
    // accumulator, add P times V's blocks (row_major matrix_b from Vs), store it back.
    wmma::fragment<wmma::matrix_a, F, F, F, T, wmma::row_major> pf[BC / F];
#pragma unroll
    for (int k = 0; k < BC / F; k++) wmma::load_matrix_sync(pf[k], Pw + F * k, LDP);
#pragma unroll
    for (int n = 0; n < D / F; n++) {
      wmma::fragment<wmma::accumulator, F, F, F, float> of;
      wmma::load_matrix_sync(of, Ow + F * n, LDO, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < BC / F; k++) {
        wmma::fragment<wmma::matrix_b, F, F, F, T, wmma::row_major> vf;
        wmma::load_matrix_sync(vf, Vs + F * k * LDK + F * n, LDK);
        wmma::mma_sync(of, pf[k], vf, of);
      }
      wmma::store_matrix_sync(Ow + F * n, of, LDO, wmma::mem_row_major);
    }
    // STUB: // TODO: O is never added to, so it stays zero. Replace this with the P V product.
    // END EXERCISE 04.pv_wmma
  }

  // O /= l in place, then rows < N out as T, 16 bytes per store.
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const float sum = sum16(l[i]);
    scale_row<D>(Ow + softmax_row(i, h) * LDO, c, sum > 0.f ? 1.f / sum : 0.f);
  }
  __syncwarp();
#pragma unroll
  for (int e = lane; e < F * D / 8; e += 32) {
    const int r = e / (D / 8), col = e % (D / 8) * 8;
    if (r0 + r >= N) continue;
    const float4 a = *reinterpret_cast<const float4*>(Ow + r * LDO + col);
    const float4 b = *reinterpret_cast<const float4*>(Ow + r * LDO + col + 4);
    __stcg(reinterpret_cast<uint4*>(O + ((size_t)bh * N + r0 + r) * D + col),  // st.global.cg: O is written once
           make_uint4(pack2(a.x, a.y, T()), pack2(a.z, a.w, T()), pack2(b.x, b.y, T()), pack2(b.z, b.w, T())));
  }
}

template <int D, int BR, int BC, typename T>
static const char* launch(const FlashlabProblem* p, cudaStream_t stream) {
  auto kernel = wmma_kernel<D, BR, BC, T>;
  const size_t smem = Tiles<D, BR, BC>::SMEM;
  FLASHLAB_TRY(flashlab_allow_smem(kernel, smem));
  // 1-D grid, tiles * B * H < 2^31 blocks: flashlab rejects inputs of 2^31 elements or more.
  dim3 grid(flashlab_cdiv(p->N, BR) * p->B * p->H);
  kernel<<<grid, THREADS, smem, stream>>>((const T*)p->q, (const T*)p->k, (const T*)p->v,
                                          (T*)p->o, p->N, p->scale, p->causal);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

// Compute capability 7.5 (a T4) allows a block 64 KiB of shared memory and has no bf16 tensor
// cores. flashlab builds for one architecture at a time, and __CUDA_ARCH_LIST__ (unlike
// __CUDA_ARCH__) is the same in nvcc's host and device passes, so it may choose which kernels
// exist: for sm_75, 32-key tiles at D = 128 (61 KiB instead of 86) and no bf16 kernels.
#if defined(__CUDA_ARCH_LIST__) && __CUDA_ARCH_LIST__ < 800
#define WMMA_BF16 0
constexpr int BC128 = 32;
#else
#define WMMA_BF16 1
constexpr int BC128 = 64;  // keys per K/V tile at D = 128
#endif

template <typename T>
static const char* launch_dtype(const FlashlabProblem* p, cudaStream_t s) {
  return p->D == 64 ? launch<64, 64, 64, T>(p, s) : launch<128, 64, BC128, T>(p, s);
}

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F16 && p->dtype != FLASHLAB_BF16)
    return "stage 04 runs on tensor cores, which take fp16 or bf16 inputs, not float32; "
           "convert q, k and v with .half() or .bfloat16()";
  if (p->dtype == FLASHLAB_BF16 && !WMMA_BF16)
    return "stage 04 takes bf16 on compute capability 8.0 or newer (bf16 WMMA needs sm_80); "
           "this build is for 7.5: convert q, k and v with .half()";
  if (p->D != 64 && p->D != 128)
    return flashlab_say("stage 04 is compiled for head dims 64 and 128, not %d", p->D);
  const size_t smem = p->D == 64 ? Tiles<64, 64, 64>::SMEM : Tiles<128, 64, BC128>::SMEM;
  if (smem > (size_t)flashlab_max_smem_per_block())
    return flashlab_say("stage 04 needs %zu bytes of shared memory per block at head dim %d; "
                        "this GPU allows %d", smem, p->D, flashlab_max_smem_per_block());
  return nullptr;
}

extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem*) { return 0; }

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
#if WMMA_BF16
  if (p->dtype == FLASHLAB_BF16) return launch_dtype<__nv_bfloat16>(p, s);
#else
  if (p->dtype == FLASHLAB_BF16) return flashlab_unsupported(p);  // never the fp16 kernel on bf16
#endif
  return launch_dtype<__half>(p, s);
}
