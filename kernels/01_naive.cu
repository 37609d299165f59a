// Stage 01 — naive: the flash-attention-minimal kernel as published.
//
// FlashAttention-1 loop order: one block per (batch, head) walks every K/V tile j and, inside it,
// every Q tile i. One thread owns one query row, so it computes that row's scores, softmax and
// output alone. The running max m and sum l live in global memory because a row is revisited
// once per K/V tile. Thread t loads row t of each tile, so the 32 threads of the warp read 32
// addresses D floats apart: every load instruction touches 32 different sectors (uncoalesced).
//
// Changes from the published kernel, none of which touch its memory-access pattern or its
// loop structure: loads and stores are bounds-checked so any N >= 1 works; keys past N and
// (causal) keys after the query get score -inf; m, l and O are initialised on the first K/V tile
// instead of by the host, which also means the output is never read before it is written.
#include <cmath>
#include "common.cuh"

constexpr int Bc = 32;  // keys per K/V tile
constexpr int Br = 32;  // queries per Q tile = threads per block

__global__ void naive_kernel(const float* Q, const float* K, const float* V, int N, int d,
                             int Tc, int Tr, float softmax_scale, int causal,
                             float* l, float* m, float* O) {
  int tx = threadIdx.x;
  int bh = blockIdx.x;  // batch * H + head

  // Offset into Q, K, V, O, l, m for this (batch, head).
  size_t qkv_offset = (size_t)bh * N * d;
  size_t lm_offset = (size_t)bh * N;

  extern __shared__ float sram[];
  int tile_size = Bc * d;  // size of Qi, Kj, Vj
  float* Qi = sram;
  float* Kj = &sram[tile_size];
  float* Vj = &sram[tile_size * 2];
  float* S = &sram[tile_size * 3];

  for (int j = 0; j < Tc; j++) {
    // Load Kj, Vj to SRAM: thread tx copies key row j*Bc + tx (zeros past the end).
    int key = j * Bc + tx;
    for (int x = 0; x < d; x++) {
      bool ok = key < N;
      Kj[(tx * d) + x] = ok ? K[qkv_offset + (size_t)key * d + x] : 0.f;
      Vj[(tx * d) + x] = ok ? V[qkv_offset + (size_t)key * d + x] : 0.f;
    }
    __syncthreads();  // the inner loop reads every thread's Kj, Vj rows

    for (int i = 0; i < Tr; i++) {
      int row = i * Br + tx;
      if (row >= N) continue;  // no __syncthreads inside this loop, so idle threads may skip

      // Load Qi to SRAM, l and m to registers.
      for (int x = 0; x < d; x++) Qi[(tx * d) + x] = Q[qkv_offset + (size_t)row * d + x];
      float row_m_prev = j == 0 ? -INFINITY : m[lm_offset + row];
      float row_l_prev = j == 0 ? 0.f : l[lm_offset + row];

      // S = QK^T, row_m = rowmax(S)
      float row_m = -INFINITY;
      for (int y = 0; y < Bc; y++) {
        int col = j * Bc + y;
        float sum = 0;
        for (int x = 0; x < d; x++) sum += Qi[(tx * d) + x] * Kj[(y * d) + x];
        sum *= softmax_scale;
        if (col >= N || (causal && col > row)) sum = -INFINITY;
        S[(Bc * tx) + y] = sum;
        if (sum > row_m) row_m = sum;
      }
      // Every key of this tile is masked for this row (causal, j > 0): nothing to add.
      if (row_m == -INFINITY) continue;

      // P = exp(S - row_m), row_l = rowsum(P)
      float row_l = 0;
      for (int y = 0; y < Bc; y++) {
        S[(Bc * tx) + y] = __expf(S[(Bc * tx) + y] - row_m);
        row_l += S[(Bc * tx) + y];
      }

      // Compute new m and l
      float row_m_new = fmaxf(row_m_prev, row_m);
      float row_l_new = (__expf(row_m_prev - row_m_new) * row_l_prev) +
                        (__expf(row_m - row_m_new) * row_l);

      // Write O, l, m to HBM
      for (int x = 0; x < d; x++) {
        float pv = 0;  // Pij * Vj
        for (int y = 0; y < Bc; y++) pv += S[(Bc * tx) + y] * Vj[(y * d) + x];
        size_t at = qkv_offset + (size_t)row * d + x;
        float o_prev = j == 0 ? 0.f : O[at];
        O[at] = (1 / row_l_new) * ((row_l_prev * __expf(row_m_prev - row_m_new) * o_prev) +
                                   (__expf(row_m - row_m_new) * pv));
      }
      m[lm_offset + row] = row_m_new;
      l[lm_offset + row] = row_l_new;
    }
    __syncthreads();  // otherwise a thread can overwrite Kj while another still reads it
  }
}

static size_t smem_bytes(int d) { return (3 * Bc * d + Bc * Br) * sizeof(float); }

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F32) return "stage 01 computes in float32 only";
  int limit = flashlab_max_smem_per_block();
  if ((long long)smem_bytes(p->D) > limit)
    return flashlab_say("head dim %d needs %zu bytes of shared memory per block; this GPU allows %d "
                        "(largest head dim: %d)", p->D, smem_bytes(p->D), limit,
                        (int)((limit / sizeof(float) - Bc * Br) / (3 * Bc)));
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
  FLASHLAB_TRY(flashlab_allow_smem(naive_kernel, smem));
  // 1-D grid, B * H < 2^31 blocks: flashlab rejects inputs of 2^31 elements or more.
  dim3 grid(p->B * p->H), block(Br);
  naive_kernel<<<grid, block, smem, (cudaStream_t)stream>>>(
      (const float*)p->q, (const float*)p->k, (const float*)p->v, p->N, p->D, Tc, Tr, p->scale,
      p->causal, l, m, (float*)p->o);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}
