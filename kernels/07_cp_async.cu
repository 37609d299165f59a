// Stage 07 — cp.async pipeline: the next K/V tiles load while this one is computed.
//
// Up to stage 06 a block stops twice per K/V tile: every warp waits for the tile's loads to
// arrive (long scoreboard), then at __syncthreads for the slowest warp (barrier), and only then
// the tensor cores run. Nothing overlaps the ~1 us of DRAM/L2 latency with the math, and the
// loads pass through registers on their way to shared memory.
// cp.async (sm_80+) copies 16 bytes from global to shared memory without a register and without
// waiting: a thread issues the copies, closes them into a group (commit), and later waits until
// at most n groups are still in flight (wait_group n). With STAGES buffers for K and V, the block
// keeps the loads of tiles j+1 .. j+STAGES-1 in flight while it computes tile j. The swizzled
// layout of stage 06 is unchanged; rows past N are zero-filled by the copy itself (src size 0).
// Everything else is stage 06.
#include <cmath>
#include "common.cuh"
#include "ptx.cuh"

template <int D, int BR, int BC, int STAGES>
struct Tiles {
  static constexpr int WARPS = BR / 16;       // a warp per 16 query rows
  static constexpr int THREADS = WARPS * 32;
  static constexpr int SMEM_BYTES = (BR + 2 * BC * STAGES) * D * 2;  // Q + STAGES x (K, V)
  // Blocks per SM to leave room for: a register cap of 65536 / (MIN_BLOCKS * THREADS). Left to
  // itself ptxas gives the D=64 kernel 128 registers and spills; 3 blocks (<= 168) spill nothing.
  static constexpr int MIN_BLOCKS = D == 64 ? 3 : 2;
};

// Element (row, col) of a swizzled tile with D columns; col must be a multiple of 8 (a chunk).
// Rows are 128 or 256 bytes, a whole number of bank rows, so a chunk's banks depend only on its
// position in the row: XOR with row % 8 gives the 8 rows of an ldmatrix phase 8 different ones.
// BEGIN CARRIED 06.swizzle: stage 06's swizzle, unchanged
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + (((col >> 3) ^ (row & 7)) << 3);
}
// END CARRIED 06.swizzle

// Start copying rows [first, first + ROWS) of an (N, D) matrix, rows ld elements apart, into a
// swizzled tile, 16 bytes per thread per step; rows past N become zeros (the copy reads 0 bytes
// of the clamped row 0).
// Returns at once: the data is there after cp_async_wait and a __syncthreads.
template <int ROWS, int D, int THREADS, typename T>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int ld, int first, int N) {
  constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
  static_assert(ROWS * CHUNKS % THREADS == 0, "tile does not split evenly over the block");
#pragma unroll
  for (int i = 0; i < ROWS * CHUNKS / THREADS; i++) {
    const int e = threadIdx.x + i * THREADS;
    const int r = e / CHUNKS, c = (e % CHUNKS) * 8;
    const bool in = first + r < N;
    cp_async_16(smem_u32(dst + swz<D>(r, c)), src + (in ? first + r : 0) * ld + c, in ? 16 : 0);
  }
}

template <typename T, int D, int BR, int BC, int STAGES, bool WITH_LSE>
__global__ void __launch_bounds__(Tiles<D, BR, BC, STAGES>::THREADS, Tiles<D, BR, BC, STAGES>::MIN_BLOCKS)
cp_async_kernel(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
               T* __restrict__ O, float* __restrict__ LSE, const FlashlabLayout L, int N,
               float scale_log2, int causal) {
  using Cfg = Tiles<D, BR, BC, STAGES>;
  constexpr int THREADS = Cfg::THREADS;
  constexpr int KD = D / 16;   // k-steps of Q K^T (over the head dim)
  constexpr int NS = BC / 8;   // 16x8 tiles of S per warp
  constexpr int KS = BC / 16;  // k-steps of P V (over the keys)
  constexpr int NO = D / 8;    // 16x8 tiles of O per warp
  static_assert(KD % 2 == 0 && NO % 2 == 0, "ldmatrix.x4 feeds two mma k-steps / n-tiles");
  extern __shared__ uint4 smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + BR * D;               // STAGES K tiles, then STAGES V tiles
  T* Vs = Ks + STAGES * BC * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // the PTX ISA's groupID and threadID_in_group
  // Block b: query tile b % tiles of (batch, head) b / tiles; 1-D since gridDim.y <= 65535.
  const int tiles = (N + BR - 1) / BR, bh = blockIdx.x / tiles, qt = blockIdx.x % tiles;
  // Causal blocks near the end of the sequence have the most tiles: start them first.
  const int tile = causal ? tiles - 1 - qt : qt;
  const int q0 = tile * BR;
  // This block's (batch, head) in each tensor; rows are L.q.n, L.k.n, ... elements apart (D when
  // contiguous, H * D in transformers' views). O is offset at the store: one pointer fewer held.
  const int b = bh / L.H, h = bh % L.H;
  Q += b * L.q.b + h * L.q.h; K += b * L.k.b + h * L.k.h; V += b * L.v.b + h * L.v.h;

  const int last_key = causal ? min(N, q0 + BR) : N;
  const int n_tiles = (last_key + BC - 1) / BC;
  // Prologue: Q and K/V tile 0 form the first group, tiles 1 .. STAGES-2 one group each. A group
  // is committed even when there is no tile left to load, so that "tile j has arrived" is always
  // "at most STAGES-2 groups are pending".
  load_tile_async<BR, D, THREADS>(Qs, Q, L.q.n, q0, N);
#pragma unroll
  for (int st = 0; st < STAGES - 1; st++) {
    if (st < n_tiles) {
      load_tile_async<BC, D, THREADS>(Ks + st * BC * D, K, L.k.n, st * BC, N);
      load_tile_async<BC, D, THREADS>(Vs + st * BC * D, V, L.v.n, st * BC, N);
    }
    cp_async_commit();
  }
  cp_async_wait<STAGES - 2>();
  __syncthreads();
  // Q: into registers, where it stays (A operand, one per k-step).
  T* Qw = Qs + warp * 16 * D;  // this warp's 16 rows (16 is a multiple of 8: same swizzle)
  uint32_t qf[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; kk++)
    ldmatrix_x4(qf[kk], smem_u32(Qw + swz<D>(lane % 16, kk * 16 + (lane / 16) * 8)));

  // This lane's share of rows r0 = q0 + 16 warp + g and r0 + 8: indices [0] and [1] below.
  const int r0 = q0 + warp * 16 + g;
  float o[NO][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int j = 0; j < n_tiles; j++) {
    const int k0 = j * BC;
    // BEGIN EXERCISE 07.pipeline: keep STAGES - 1 tiles in flight. For j > 0, wait until tile j
    // has arrived in buffer j % STAGES (this thread's copies: cp_async_wait; everyone's, and
    // everyone done with tile j-1: __syncthreads); then start copying tile j + STAGES - 1 (if
    // there is one) into the buffer tile j-1 used, and commit a group every iteration, loads
    // or not, as the prologue does, so that the count of groups in flight stays right.
    if (j > 0) {
      cp_async_wait<STAGES - 2>();  // this thread's copies of tile j have landed ...
      __syncthreads();              // ... and everyone's; everyone is also done with tile j-1
    }
    // Refill the buffer that tile j-1 used with tile j + STAGES - 1, in the background.
    const int next = j + STAGES - 1;
    if (next < n_tiles) {
      load_tile_async<BC, D, THREADS>(Ks + next % STAGES * BC * D, K, L.k.n, next * BC, N);
      load_tile_async<BC, D, THREADS>(Vs + next % STAGES * BC * D, V, L.v.n, next * BC, N);
    }
    cp_async_commit();
    // STUB: // TODO: nothing waits and nothing loads after the prologue, so every tile past the
    // STUB: // first STAGES - 1 is computed from whatever its buffer holds. Write the step.
    // END EXERCISE 07.pipeline
    const T* Kt = Ks + j % STAGES * BC * D;
    const T* Vt = Vs + j % STAGES * BC * D;

    // S = Q K^T: K is stored [key][d], which is exactly the "col" B operand; one ldmatrix.x4
    // covers 8 keys x 32 dims, two k-steps.
    float s[NS][4] = {};
#pragma unroll
    for (int n = 0; n < NS; n++)
#pragma unroll
      for (int kk = 0; kk < KD; kk += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_u32(Kt + swz<D>(n * 8 + lane % 8, kk * 16 + (lane / 8) * 8)));
        mma_m16n8k16<T>(s[n], qf[kk], b[0], b[1]);
        mma_m16n8k16<T>(s[n], qf[kk + 1], b[2], b[3]);
      }

    // Scores in log2 units; masks only where the tile crosses N or the diagonal.
#pragma unroll
    for (int n = 0; n < NS; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) s[n][i] *= scale_log2;
    if (k0 + BC > N || (causal && k0 + BC - 1 > q0)) {
#pragma unroll
      for (int n = 0; n < NS; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int key = k0 + n * 8 + 2 * t + (i & 1), row = r0 + (i >= 2 ? 8 : 0);
          if (key >= N || (causal && key > row)) s[n][i] = -INFINITY;
        }
    }

    // Online softmax in registers. Lane holds s[n][0..1] of row r0 and s[n][2..3] of row r0 + 8;
    // the other 3 lanes of its quad hold the rest of those rows.
#pragma unroll
    for (int h = 0; h < 2; h++) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < NS; n++) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // BEGIN CARRIED 05.online_softmax: stage 05's online softmax, unchanged
      const float m_new = fmaxf(m[h], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no key yet: keep zeros
      const float alpha = exp2_approx(m[h] - m_use);
      m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NS; n++) {
        s[n][2 * h] = exp2_approx(s[n][2 * h] - m_use);
        s[n][2 * h + 1] = exp2_approx(s[n][2 * h + 1] - m_use);
        sum += s[n][2 * h] + s[n][2 * h + 1];
      }
      l[h] = fmaf(l[h], alpha, sum);  // this lane's part of the row sum; the quad adds up at the end
#pragma unroll
      for (int d = 0; d < NO; d++) {
        o[d][2 * h] *= alpha;
        o[d][2 * h + 1] *= alpha;
      }
      // END CARRIED 05.online_softmax
    }

    // O += P V. P's accumulator tiles 2ks and 2ks+1 are the A fragment of k-step ks.
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      const uint32_t a[4] = {pack2<T>(s[2 * ks][0], s[2 * ks][1]),
                             pack2<T>(s[2 * ks][2], s[2 * ks][3]),
                             pack2<T>(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             pack2<T>(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
      for (int d = 0; d < NO; d += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, smem_u32(Vt + swz<D>(ks * 16 + lane % 16, d * 8 + (lane / 16) * 8)));
        mma_m16n8k16<T>(o[d], a, b[0], b[1]);
        mma_m16n8k16<T>(o[d + 1], a, b[2], b[3]);
      }
    }
  }

  // Normalise, then write through this warp's own (now unused) rows of Qs so that global stores
  // are whole 16-byte chunks of consecutive columns. With a single K/V tile no barrier has
  // passed since the warp read its Q fragments there: __syncwarp orders that read first.
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    // BEGIN CARRIED 05.quad_sum: stage 05's sum across the quad, unchanged
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[h] = sum > 0.f ? 1.f / sum : 0.f;
    // END CARRIED 05.quad_sum
  }
  __syncwarp();
#pragma unroll
  for (int d = 0; d < NO; d++) {
    *reinterpret_cast<uint32_t*>(Qw + swz<D>(g, d * 8) + 2 * t) =
        pack2<T>(o[d][0] * inv[0], o[d][1] * inv[0]);
    *reinterpret_cast<uint32_t*>(Qw + swz<D>(g + 8, d * 8) + 2 * t) =
        pack2<T>(o[d][2] * inv[1], o[d][3] * inv[1]);
  }
  __syncwarp();
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * CHUNKS / 32; i++) {
    const int e = lane + 32 * i, r = e / CHUNKS, c = (e % CHUNKS) * 8;
    const int row = q0 + warp * 16 + r;
    if (row < N)
      *reinterpret_cast<uint4*>(O + b * L.o.b + h * L.o.h + row * L.o.n + c) =
          *reinterpret_cast<const uint4*>(Qw + swz<D>(r, c));
  }
  // The row's log-sum-exp, natural log, where it is asked for (a backward recomputes P from it):
  // m is the row's max in log2 units and 1 / inv its sum of 2^(s - m), so L = (m + log2 sum) ln 2.
  if (WITH_LSE && t == 0) {
#pragma unroll
    for (int i = 0; i < 2; i++)
      if (r0 + 8 * i < N)
        LSE[bh * N + r0 + 8 * i] = (m[i] - __log2f(inv[i])) * 0.6931471805599453f;
  }
}

template <typename T, int D, int BR, int BC, int STAGES>
static const char* launch(const FlashlabProblem* p, cudaStream_t stream) {
  using Cfg = Tiles<D, BR, BC, STAGES>;
  // the log-sum-exp's stores only where it is asked for: without them, the kernel as it was
  auto kernel = p->lse ? cp_async_kernel<T, D, BR, BC, STAGES, true>
                       : cp_async_kernel<T, D, BR, BC, STAGES, false>;
  FLASHLAB_TRY(flashlab_allow_smem(kernel, Cfg::SMEM_BYTES));
  // 1-D grid, tiles * B * H < 2^31 blocks: flashlab rejects inputs of 2^31 elements or more.
  dim3 grid(flashlab_cdiv(p->N, BR) * p->B * p->H);
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(
      (const T*)p->q, (const T*)p->k, (const T*)p->v, (T*)p->o, p->lse, p->layout, p->N,
      p->scale * 1.4426950408889634f, p->causal);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

// 64 query rows (4 warps) x 64 keys as in stage 05, and PIPELINE_STAGES buffers of K and V.
constexpr int PIPELINE_STAGES = 2;
template <typename T>
static const char* launch_dtype(const FlashlabProblem* p, cudaStream_t s) {
  if (p->D == 64) return launch<T, 64, 64, 64, PIPELINE_STAGES>(p, s);
  return launch<T, 128, 64, 64, PIPELINE_STAGES>(p, s);
}

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F16 && p->dtype != FLASHLAB_BF16)
    return "stage 07 runs on the tensor cores in fp16 or bf16 only, not float32";
  if (p->D != 64 && p->D != 128)
    return flashlab_say("stage 07 is compiled for head dims 64 and 128, not %d", p->D);
  return nullptr;
}

extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem*) { return 0; }

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == FLASHLAB_BF16) return launch_dtype<__nv_bfloat16>(p, s);
  return launch_dtype<__half>(p, s);
}
