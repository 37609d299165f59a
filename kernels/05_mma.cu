// Stage 05 — mma.sync + ldmatrix: the FlashAttention-2 work split, with every fragment in registers.
//
// Stage 04's WMMA fragments are opaque, so its scores made a round trip through shared memory for
// the softmax. PTX's mma.sync.m16n8k16 publishes its layout instead: lane l of a warp holds
// rows l/4 and l/4 + 8 of the 16 x 8 accumulator, columns 2(l%4) and 2(l%4)+1. Knowing that,
//  1. each warp owns 16 query rows; its Q fragments are read once (ldmatrix) and stay in registers
//     for the whole loop over K/V tiles;
//  2. S = Q K^T lands in registers, and the online softmax runs there: a row's 4 lanes (a quad)
//     agree on its max and sum with two shuffles, no shared memory, no __syncthreads;
//  3. the accumulator layout of two adjacent 16x8 tiles of P is, register for register, the A
//     operand layout of a 16x16 tile: P is rounded to fp16/bf16 and re-packed in place, never
//     stored;
//  4. K is read with ldmatrix, V with ldmatrix.trans (the mma wants V^T's rows, V is stored by key).
// Shared memory holds only Q (once), K and V, each row padded by 16 bytes so that the 8 rows an
// ldmatrix phase reads start in 8 different 16-byte bank groups (unpadded they all start in one:
// an 8-way conflict). Loads are plain and synchronous; stage 07 overlaps them with the math.
// Causal attention stops at the diagonal and masks only the tiles that straddle it or N.
#include <cmath>
#include "common.cuh"
#include "ptx.cuh"

template <int D, int BR, int BC>
struct Tiles {
  static constexpr int WARPS = BR / 16;       // a warp per 16 query rows
  static constexpr int THREADS = WARPS * 32;
  static constexpr int LD = D + 8;            // row stride in elements: +16 bytes of padding
  static constexpr int SMEM_BYTES = (BR + 2 * BC) * LD * 2;
  // Blocks per SM to leave room for: a register cap of 65536 / (MIN_BLOCKS * THREADS). Left to
  // itself ptxas gives the D=64 kernel 128 registers and spills; 3 blocks (<= 168) spill nothing.
  static constexpr int MIN_BLOCKS = D == 64 ? 3 : 2;
};

// Rows [first, first + ROWS) of an (N, D) matrix whose rows are ld elements apart into shared
// memory (row stride LD), 16 bytes per thread per step, zeros past N so the masked keys and
// padded queries hold finite values.
template <int ROWS, int D, int LD, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int ld, int first, int N) {
  constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
  static_assert(ROWS * CHUNKS % THREADS == 0, "tile does not split evenly over the block");
#pragma unroll
  for (int i = 0; i < ROWS * CHUNKS / THREADS; i++) {
    const int e = threadIdx.x + i * THREADS;
    const int r = e / CHUNKS, c = (e % CHUNKS) * 8;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (first + r < N) x = *reinterpret_cast<const uint4*>(src + (first + r) * ld + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = x;
  }
}

template <typename T, int D, int BR, int BC, bool WITH_LSE>
__global__ void __launch_bounds__(Tiles<D, BR, BC>::THREADS, Tiles<D, BR, BC>::MIN_BLOCKS)
mma_kernel(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
           T* __restrict__ O, float* __restrict__ LSE, const FlashlabLayout L, int N,
           float scale_log2, int causal) {
  using Cfg = Tiles<D, BR, BC>;
  constexpr int LD = Cfg::LD, THREADS = Cfg::THREADS;
  constexpr int KD = D / 16;   // k-steps of Q K^T (over the head dim)
  constexpr int NS = BC / 8;   // 16x8 tiles of S per warp
  constexpr int KS = BC / 16;  // k-steps of P V (over the keys)
  constexpr int NO = D / 8;    // 16x8 tiles of O per warp
  static_assert(KD % 2 == 0 && NO % 2 == 0, "ldmatrix.x4 feeds two mma k-steps / n-tiles");
  extern __shared__ uint4 smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + BR * LD;
  T* Vs = Ks + BC * LD;

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

  // Q: once through shared memory into registers, where it stays (A operand, one per k-step).
  load_tile<BR, D, LD, THREADS>(Qs, Q, L.q.n, q0, N);
  __syncthreads();
  T* Qw = Qs + warp * 16 * LD;  // this warp's 16 rows
  uint32_t qf[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; kk++)
    ldmatrix_x4(qf[kk], smem_u32(Qw + (lane % 16) * LD + kk * 16 + (lane / 16) * 8));

  // This lane's share of rows r0 = q0 + 16 warp + g and r0 + 8: indices [0] and [1] below.
  const int r0 = q0 + warp * 16 + g;
  float o[NO][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  const int last_key = causal ? min(N, q0 + BR) : N;
  const int n_tiles = (last_key + BC - 1) / BC;
  for (int j = 0; j < n_tiles; j++) {
    const int k0 = j * BC;
    __syncthreads();  // every warp is done with the previous K and V
    load_tile<BC, D, LD, THREADS>(Ks, K, L.k.n, k0, N);
    load_tile<BC, D, LD, THREADS>(Vs, V, L.v.n, k0, N);
    __syncthreads();

    // S = Q K^T: K is stored [key][d], which is exactly the "col" B operand; one ldmatrix.x4
    // covers 8 keys x 32 dims, two k-steps.
    float s[NS][4] = {};
#pragma unroll
    for (int n = 0; n < NS; n++)
#pragma unroll
      for (int kk = 0; kk < KD; kk += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_u32(Ks + (n * 8 + lane % 8) * LD + kk * 16 + (lane / 8) * 8));
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
      // BEGIN EXERCISE 05.online_softmax: the online softmax of row h in registers, given the
      // row's max over this tile (mx, agreed by the quad): the new running max m[h], the factor
      // alpha = 2^(old max - new max), this lane's scores s[n][2h], s[n][2h+1] replaced by
      // P = 2^(s - max), its share of the row sum added into l[h], and its O values rescaled.
      // A row with no key yet (max -inf) must keep P = 0, never NaN.
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
      // STUB: // TODO: P is left as the raw scores and l as 0. Replace this with the update.
      // STUB: (void)mx; (void)m;
      // END EXERCISE 05.online_softmax
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
        ldmatrix_x4_trans(b, smem_u32(Vs + (ks * 16 + lane % 16) * LD + d * 8 + (lane / 16) * 8));
        mma_m16n8k16<T>(o[d], a, b[0], b[1]);
        mma_m16n8k16<T>(o[d + 1], a, b[2], b[3]);
      }
    }
  }

  // Normalise, then write through this warp's own (now unused) rows of Qs so that global stores
  // are whole 16-byte chunks of consecutive columns.
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    // BEGIN EXERCISE 05.quad_sum (5 points): inv[h] = 1 / (the whole row's sum): each of the row's 4 lanes
    // (a quad: lanes 4g .. 4g+3) holds a part of it in l[h]; add them up across the quad with
    // warp shuffles, and give a row with no key (sum 0) inv 0.
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[h] = sum > 0.f ? 1.f / sum : 0.f;
    // STUB: // TODO: this divides by this lane's part of the sum only. Add up the quad's parts.
    // STUB: inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    // END EXERCISE 05.quad_sum
  }
  // The row's log-sum-exp, natural log, where it is asked for (a backward recomputes P from it):
  // m is the row's max in log2 units and 1 / inv its sum of 2^(s - m), so L = (m + log2 sum) ln 2.
  if (WITH_LSE && t == 0) {
#pragma unroll
    for (int i = 0; i < 2; i++)
      if (r0 + 8 * i < N)
        LSE[bh * N + r0 + 8 * i] = (m[i] - __log2f(inv[i])) * 0.6931471805599453f;
  }
#pragma unroll
  for (int d = 0; d < NO; d++) {
    *reinterpret_cast<uint32_t*>(Qw + g * LD + d * 8 + 2 * t) =
        pack2<T>(o[d][0] * inv[0], o[d][1] * inv[0]);
    *reinterpret_cast<uint32_t*>(Qw + (g + 8) * LD + d * 8 + 2 * t) =
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
          *reinterpret_cast<const uint4*>(Qw + r * LD + c);
  }
}

template <typename T, int D, int BR, int BC>
static const char* launch(const FlashlabProblem* p, cudaStream_t stream) {
  using Cfg = Tiles<D, BR, BC>;
  // the log-sum-exp's stores only where it is asked for: without them, the kernel as it was
  auto kernel = p->lse ? mma_kernel<T, D, BR, BC, true>
                       : mma_kernel<T, D, BR, BC, false>;
  FLASHLAB_TRY(flashlab_allow_smem(kernel, Cfg::SMEM_BYTES));
  // 1-D grid, tiles * B * H < 2^31 blocks: flashlab rejects inputs of 2^31 elements or more.
  dim3 grid(flashlab_cdiv(p->N, BR) * p->B * p->H);
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(
      (const T*)p->q, (const T*)p->k, (const T*)p->v, (T*)p->o, p->lse, p->layout, p->N,
      p->scale * 1.4426950408889634f, p->causal);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

// 64 query rows (4 warps) x 64 keys: measured on an H100 against 128x64, 128x128 (D=64),
// 128x32 (D=128) and 64x128, it was the fastest at every point of the sweep.
template <typename T>
static const char* launch_dtype(const FlashlabProblem* p, cudaStream_t s) {
  if (p->D == 64) return launch<T, 64, 64, 64>(p, s);
  return launch<T, 128, 64, 64>(p, s);
}

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F16 && p->dtype != FLASHLAB_BF16)
    return "stage 05 runs on the tensor cores in fp16 or bf16 only, not float32";
  if (p->D != 64 && p->D != 128)
    return flashlab_say("stage 05 is compiled for head dims 64 and 128, not %d", p->D);
  return nullptr;
}

extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem*) { return 0; }

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == FLASHLAB_BF16) return launch_dtype<__nv_bfloat16>(p, s);
  return launch_dtype<__half>(p, s);
}
