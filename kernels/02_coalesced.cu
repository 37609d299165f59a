// Stage 02 — coalesced: the same FlashAttention-1 math as stage 01, with 2-D thread blocks.
//
// Stage 01 gives each thread a whole query row, so when a warp loads a tile, lane t reads
// address t*D + x: 32 lanes, 32 rows, 32 memory sectors for one instruction. Here a block is
// Br x 32 threads and a warp is one row of the tile: lane t reads element t, t+32, ... of that row,
// so the 32 lanes read 32 consecutive floats (128 bytes, 4 sectors) and the same goes for every
// store of O. The warp splits its row's work the same way — lane t scores key t of the tile and
// produces output columns t, t+32, ... — so the row max and row sum become warp shuffles.
//
// Unchanged from stage 01: one block per (batch, head), outer loop over K/V tiles, inner loop over
// Q tiles, m and l kept in global memory, S staged through shared memory, Bc = Br = 32.
#include <cmath>
#include "common.cuh"

constexpr int Bc = 32;  // keys per K/V tile = lanes per warp
constexpr int Br = 32;  // queries per Q tile = warps per block

__device__ __forceinline__ float warp_max(float x) {
  for (int s = 16; s > 0; s >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, s));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int s = 16; s > 0; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
  return x;
}

// Copy rows [first, first + 32) of a (N, d) matrix into a 32 x d shared tile, zeros past row N.
// Consecutive threads take consecutive elements, so every warp reads one contiguous stretch.
__device__ __forceinline__ void load_tile(float* tile, const float* src, int first, int N, int d) {
  // BEGIN EXERCISE 02.tile_copy: copy the 32 x d tile with all Br x Bc threads, consecutive
  // threads taking consecutive floats (a warp reads 128 contiguous bytes); zeros past row N.
  int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  for (int e = tid; e < Bc * d; e += nthreads) {
    int r = first + e / d;
    tile[e] = r < N ? src[(size_t)first * d + e] : 0.f;
  }
  // STUB: // TODO: one thread writes zeros, so the tile never holds the data. Replace this with
  // STUB: // the coalesced copy: thread tid takes elements tid, tid + nthreads, ... of the tile.
  // STUB: if (threadIdx.x == 0 && threadIdx.y == 0)
  // STUB:   for (int e = 0; e < Bc * d; e++) tile[e] = 0.f;
  // END EXERCISE 02.tile_copy
}

__global__ void __launch_bounds__(Bc * Br) coalesced_kernel(const float* Q, const float* K, const float* V, int N, int d,
                                 int Tc, int Tr, float softmax_scale, int causal,
                                 float* l, float* m, float* O) {
  int tx = threadIdx.x;  // lane: key within the tile, and first output column
  int ty = threadIdx.y;  // warp: query row within the tile
  size_t qkv_offset = (size_t)blockIdx.x * N * d;
  size_t lm_offset = (size_t)blockIdx.x * N;
  Q += qkv_offset; K += qkv_offset; V += qkv_offset; O += qkv_offset;
  l += lm_offset; m += lm_offset;

  extern __shared__ float sram[];
  float* Qi = sram;
  float* Kj = Qi + Br * d;
  float* Vj = Kj + Bc * d;
  float* S = Vj + Bc * d;  // Br x Bc

  for (int j = 0; j < Tc; j++) {
    load_tile(Kj, K, j * Bc, N, d);
    load_tile(Vj, V, j * Bc, N, d);
    for (int i = 0; i < Tr; i++) {
      load_tile(Qi, Q, i * Br, N, d);
      __syncthreads();  // Qi (and on i == 0, Kj and Vj) complete

      int row = i * Br + ty, col = j * Bc + tx;
      float s = 0;
      for (int x = 0; x < d; x++) s += Qi[ty * d + x] * Kj[tx * d + x];
      s *= softmax_scale;
      if (col >= N || (causal && col > row)) s = -INFINITY;
      float row_m = warp_max(s);

      // Whole warps agree on these branches, so the shuffles inside stay converged.
      if (row < N && row_m != -INFINITY) {
        float row_m_prev = j == 0 ? -INFINITY : m[row];
        float row_l_prev = j == 0 ? 0.f : l[row];
        float p = __expf(s - row_m);
        float row_l = warp_sum(p);
        S[ty * Bc + tx] = p;
        __syncwarp();  // the warp reads back the whole row of P it just wrote

        float row_m_new = fmaxf(row_m_prev, row_m);
        float row_l_new = __expf(row_m_prev - row_m_new) * row_l_prev +
                          __expf(row_m - row_m_new) * row_l;
        float old_scale = row_l_prev * __expf(row_m_prev - row_m_new) / row_l_new;
        float new_scale = __expf(row_m - row_m_new) / row_l_new;
        for (int x = tx; x < d; x += Bc) {
          float pv = 0;
          for (int y = 0; y < Bc; y++) pv += S[ty * Bc + y] * Vj[y * d + x];
          float o_prev = j == 0 ? 0.f : O[(size_t)row * d + x];
          O[(size_t)row * d + x] = old_scale * o_prev + new_scale * pv;
        }
        __syncwarp();  // all lanes have read m and l before lane 0 replaces them
        if (tx == 0) { m[row] = row_m_new; l[row] = row_l_new; }
      }
      __syncthreads();  // everyone is done with Qi (and, on the last i, Kj and Vj)
    }
  }
}

static size_t smem_bytes(int d) { return ((Br + 2 * Bc) * d + Br * Bc) * sizeof(float); }

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F32) return "stage 02 computes in float32 only";
  int limit = flashlab_max_smem_per_block();
  if ((long long)smem_bytes(p->D) > limit)
    return flashlab_say("head dim %d needs %zu bytes of shared memory per block; this GPU allows %d "
                        "(largest head dim: %d)", p->D, smem_bytes(p->D), limit,
                        (int)((limit / sizeof(float) - Br * Bc) / (Br + 2 * Bc)));
  return nullptr;
}

extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem* p) {
  return 2 * sizeof(float) * (size_t)p->B * p->H * p->N;  // l and m
}

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  int Tc = flashlab_cdiv(p->N, Bc), Tr = flashlab_cdiv(p->N, Br);
  float* l = static_cast<float*>(p->workspace);
  float* m = l + (size_t)p->B * p->H * p->N;
  size_t smem = smem_bytes(p->D);
  FLASHLAB_TRY(flashlab_allow_smem(coalesced_kernel, smem));
  // 1-D grid, B * H < 2^31 blocks: flashlab rejects inputs of 2^31 elements or more.
  dim3 grid(p->B * p->H), block(Bc, Br);
  coalesced_kernel<<<grid, block, smem, (cudaStream_t)stream>>>(
      (const float*)p->q, (const float*)p->k, (const float*)p->v, p->N, p->D, Tc, Tr, p->scale,
      p->causal, l, m, (float*)p->o);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}
