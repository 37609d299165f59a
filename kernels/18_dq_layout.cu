// Stage 18 — dQ laid out for its reductions: stage 17's backward with its fp32 dQ sum kept in the
// order the warps add into it.
//
// Every key block adds its share of dQ into an fp32 sum in global memory, by reductions (RED)
// that L2 carries out. In stage 17 that sum is row-major, as dQ is: one warp-wide float2
// reduction of a 16 x 64 block of dQ covers 8 rows x 32 bytes, eight cache lines, and the L1
// takes one pass (a wavefront) per line, on the same path as ldmatrix. Here the sum is kept in
// tiles of 16 rows x 64 columns, and inside a tile in the order of the warps' accumulators
// (dq_slot): one reduction covers 256 contiguous bytes, two lines. Without the mask, each key
// block also starts its walk at a different query block, so that the blocks of one head, which
// run side by side, add into different tiles at a time. The Δ pass zeroes the tiles; the
// conversion pass reads a tile whole and writes its rows back in dQ's order (bwd_dq_kernel).
// Everything else is stage 17's.
#include <cmath>
#include "common.cuh"
#include "ptx.cuh"

enum Opts { FOLD_SCALE = 1, SKIP_RESCALE = 2, WARP_SKIP = 4, LANE_OFFSETS = 8, ONE_KSTEP = 16,
            ALL_OPTS = 31 };

template <int D, int BC, int WARPS, int WM, int STAGES, bool Q_REGS>
struct Tiles {
  static constexpr int BR = 16 * WM * WARPS;  // query rows per block
  static constexpr int THREADS = WARPS * 32;
  static constexpr int SMEM_BYTES = (BR + 2 * BC * STAGES) * D * 2;  // Q + STAGES x (K, V)
  static constexpr int LSE_BYTES = BR * 4;  // with the log-sum-exp, its rows on their way out
};

// Element (row, col) of a swizzled tile with D columns (stage 06); col a multiple of 8.
// BEGIN CARRIED 06.swizzle: stage 06's swizzle, unchanged
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + (((col >> 3) ^ (row & 7)) << 3);
}
// END CARRIED 06.swizzle

// Start copying rows [first, first + ROWS) into a swizzled tile; rows past N become zeros (stage 07).
// Thread t copies chunk t % (D/8) of rows t / (D/8) + i * STEP. STEP is a multiple of 8, so the
// swizzle (row % 8) is the same for all of a thread's rows: one shared-memory offset, then
// constant strides.
template <int ROWS, int D, int THREADS, bool LANE, typename T>
__device__ __forceinline__ void load_tile_async(uint32_t dst, const T* src, int ld, int first,
                                                int N) {
  constexpr int CHUNKS = D / 8, STEP = THREADS / CHUNKS;
  static_assert(ROWS * CHUNKS % THREADS == 0 && STEP % 8 == 0, "tile does not split evenly");
  const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
  const uint32_t s0 = dst + 2 * swz<D>(r, 8 * c);
#pragma unroll
  for (int i = 0; i < ROWS / STEP; i++) {
    if constexpr (LANE) {  // one swizzle per thread, then constant strides in shared memory
      const int row = first + r + i * STEP;  // rows past N: 0 bytes of the clamped last row
      cp_async_16(s0 + 2 * i * STEP * D, src + min(row, N - 1) * ld + 8 * c,
                  row < N ? 16 : 0);
    } else {  // stage 07's: the whole formula for every chunk
      const int e = threadIdx.x + i * THREADS, rr = e / CHUNKS, cc = (e % CHUNKS) * 8;
      const bool in = first + rr < N;
      cp_async_16(dst + 2 * swz<D>(rr, cc), src + (in ? first + rr : 0) * ld + cc,
                  in ? 16 : 0);
    }
  }
}

// Byte offsets of one lane's ldmatrix rows in a swizzled tile (LANE_OFFSETS). The 16-byte
// chunk a lane asks for is (2m + h) ^ (row % 8), m a compile-time step, h and row % 8 the lane's:
// it equals (2m & ~7) + (2(m & 3) ^ y) with y = h ^ (row % 8), so four bases per lane cover every
// step. A (Q) and .trans B (V) reads: rows lane % 16, h = lane / 16. K reads: rows lane % 8,
// chunk 2kk + lane / 8 with kk even: two bases.
template <int D>
struct LaneOffsets {
  uint32_t av[4], k[2], kb[4];  // the compiler drops the set a kernel does not use
  __device__ __forceinline__ LaneOffsets(int lane) {
    // BEGIN CARRIED 08.lane_offsets: the LANE_OFFSETS switch: this lane's byte offsets, once,
    // so that each ldmatrix address below is a base plus a compile-time constant. av[i]: row
    // lane % 16, chunk (2i) ^ (lane / 16) ^ (row % 8); kb[i]: row lane % 8 + 8 (lane / 16),
    // chunk (2i) ^ ((lane / 8) & 1) ^ (row % 8); k[i]: row lane % 8, chunk (4i) ^ (lane / 8) ^
    // (row % 8). Rows are 2D bytes apart and chunks 16 bytes (the swizzle of swz above).
    const int rl = lane % 8, y = (lane / 16) ^ rl, x = (lane / 8) ^ rl, yk = ((lane / 8) & 1) ^ rl;
#pragma unroll
    for (int i = 0; i < 4; i++) av[i] = 2 * (lane % 16) * D + 16 * ((2 * i) ^ y);
#pragma unroll
    for (int i = 0; i < 4; i++) kb[i] = 2 * (rl + 8 * (lane / 16)) * D + 16 * ((2 * i) ^ yk);
#pragma unroll
    for (int i = 0; i < 2; i++) k[i] = 2 * rl * D + 16 * ((4 * i) ^ x);
    // STUB: // TODO: every offset is 0, so every lane reads the same row. Compute them.
    // STUB: for (int i = 0; i < 4; i++) av[i] = kb[i] = 0;
    // STUB: for (int i = 0; i < 2; i++) k[i] = 0;
    // STUB: (void)lane;
    // END CARRIED 08.lane_offsets
  }
  // Q or V rows [row0, row0 + 16) (row0 a multiple of 8), 8-column chunks 2m, 2m + 1.
  __device__ __forceinline__ uint32_t av_at(int row0, int m) const {
    return 2 * row0 * D + 16 * ((2 * m) & ~7) + av[m & 3];
  }
  // K rows [row0, row0 + 16), chunks 2kk, 2kk + 1 (ONE_KSTEP): lanes 8i..8i+7 address matrix i =
  // (rows 8(i / 2).., chunk 2kk + i % 2), so each mma's B pair comes out in adjacent registers.
  __device__ __forceinline__ uint32_t kb_at(int row0, int kk) const {
    return 2 * row0 * D + 16 * ((2 * kk) & ~7) + kb[kk & 3];
  }
  // K rows [row0, row0 + 8), chunks 2kk .. 2kk + 3 (kk even).
  __device__ __forceinline__ uint32_t k_at(int row0, int kk) const {
    return 2 * row0 * D + 16 * ((2 * kk) & ~7) + k[(kk >> 1) & 1];
  }
};

template <typename T, int D, int BC, int WARPS, int WM, int STAGES, bool Q_REGS, int OPTS,
          bool WITH_LSE>
__global__ void __launch_bounds__(WARPS * 32)
forward_kernel(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
             T* __restrict__ O, float* __restrict__ LSE, const FlashlabLayout L, int N,
             float scale_log2, int causal) {
  using Cfg = Tiles<D, BC, WARPS, WM, STAGES, Q_REGS>;
  constexpr int BR = Cfg::BR, THREADS = Cfg::THREADS;
  constexpr int KD = D / 16, NS = BC / 8, KS = BC / 16, NO = D / 8;
  constexpr bool kFold = OPTS & FOLD_SCALE, kSkipRescale = OPTS & SKIP_RESCALE,
                 kWarpSkip = OPTS & WARP_SKIP, kLane = OPTS & LANE_OFFSETS, kOneK = OPTS & ONE_KSTEP;
  static_assert(KD % 2 == 0 && NO % 2 == 0, "ldmatrix.x4 feeds two mma k-steps / n-tiles");
  extern __shared__ uint4 smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  const uint32_t Qs_u = smem_u32(Qs);                 // .shared addresses of the tiles
  const uint32_t Ks_u = Qs_u + 2 * BR * D;            // STAGES K tiles
  const uint32_t Vs_u = Ks_u + 2 * STAGES * BC * D;   // STAGES V tiles

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Block b: query tile b % tiles of (batch, head) b / tiles; 1-D since gridDim.y <= 65535.
  const int tiles = (N + BR - 1) / BR, bh = blockIdx.x / tiles, qt = blockIdx.x % tiles;
  const int tile = causal ? tiles - 1 - qt : qt;
  const int q0 = tile * BR;
  // This block's (batch, head) in each tensor; rows are L.q.n, L.k.n, ... elements apart (D when
  // contiguous, H * D in transformers' views). O is offset at the store: one pointer fewer held.
  const int b = bh / L.H, h = bh % L.H;
  Q += b * L.q.b + h * L.q.h; K += b * L.k.b + h * L.k.h; V += b * L.v.b + h * L.v.h;

  const int last_key = causal ? min(N, q0 + BR) : N;
  const int n_tiles = (last_key + BC - 1) / BC;
  load_tile_async<BR, D, THREADS, kLane>(Qs_u, Q, L.q.n, q0, N);
#pragma unroll
  for (int st = 0; st < STAGES - 1; st++) {
    if (st < n_tiles) {
      load_tile_async<BC, D, THREADS, kLane>(Ks_u + 2 * st * BC * D, K, L.k.n, st * BC, N);
      load_tile_async<BC, D, THREADS, kLane>(Vs_u + 2 * st * BC * D, V, L.v.n, st * BC, N);
    }
    cp_async_commit();
  }
  cp_async_wait<STAGES - 2>();
  __syncthreads();

  T* Qw = Qs + warp * WM * 16 * D;  // this warp's WM x 16 rows
  const LaneOffsets<D> lo(lane);
  // The .shared address of the A fragment (Q rows 16 w of the warp, k-step kk) or of the K/V
  // fragments: the lane's base plus constants, or the swizzle formula in full.
  auto q_addr = [&](int w, int kk) -> uint32_t {
    const int row0 = warp * WM * 16 + 16 * w;
    if constexpr (kLane) return Qs_u + lo.av_at(row0, kk);
    return Qs_u + 2 * swz<D>(row0 + lane % 16, kk * 16 + (lane / 16) * 8);
  };
  auto k_addr = [&](uint32_t Kt, int n, int kk) -> uint32_t {
    if constexpr (kLane) return Kt + lo.k_at(n * 8, kk);
    return Kt + 2 * swz<D>(n * 8 + lane % 8, kk * 16 + (lane / 8) * 8);
  };
  auto v_addr = [&](uint32_t Vt, int ks, int d) -> uint32_t {
    if constexpr (kLane) return Vt + lo.av_at(ks * 16, d / 2);
    return Vt + 2 * swz<D>(ks * 16 + lane % 16, d * 8 + (lane / 16) * 8);
  };
  // Q's A fragment for row tile w, k-step kk: from registers, or re-read from shared memory.
  uint32_t qf[Q_REGS ? WM : 1][Q_REGS ? KD : 1][4];
  if constexpr (Q_REGS) {
#pragma unroll
    for (int w = 0; w < WM; w++)
#pragma unroll
      for (int kk = 0; kk < KD; kk++) ldmatrix_x4(qf[w][kk], q_addr(w, kk));
  }

  const int r0 = q0 + warp * WM * 16 + g;  // rows r0 + 16 w (index 2w) and r0 + 16 w + 8 (2w + 1)
  float o[WM][NO][4] = {};
  float m[2 * WM], l[2 * WM];
#pragma unroll
  for (int h = 0; h < 2 * WM; h++) m[h] = -INFINITY, l[h] = 0.f;

  for (int j = 0; j < n_tiles; j++) {
    const int k0 = j * BC;
    // BEGIN CARRIED 07.pipeline: stage 07's pipeline step, on this stage's byte addresses
    if (j > 0) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
    }
    const int next = j + STAGES - 1;
    if (next < n_tiles) {
      load_tile_async<BC, D, THREADS, kLane>(Ks_u + 2 * (next % STAGES) * BC * D, K, L.k.n,
                                             next * BC, N);
      load_tile_async<BC, D, THREADS, kLane>(Vs_u + 2 * (next % STAGES) * BC * D, V, L.v.n,
                                             next * BC, N);
    }
    cp_async_commit();
    // STUB: // TODO: nothing waits and nothing loads after the prologue (stage 07's pipeline step,
    // STUB: // with this stage's load_tile_async<BC, D, THREADS, kLane> into Ks_u / Vs_u).
    // END CARRIED 07.pipeline
    const uint32_t Kt = Ks_u + 2 * (j % STAGES) * BC * D;
    const uint32_t Vt = Vs_u + 2 * (j % STAGES) * BC * D;
    // Causal: a tile that starts past this warp's last row is masked for all of its rows. The
    // block's later warps need it; this one only helps load it and meets the barrier.
    if (kWarpSkip && causal && k0 > q0 + (warp + 1) * WM * 16 - 1) continue;

    // S = Q K^T: each K fragment feeds WM row tiles.
    float s[WM][NS][4] = {};
    if constexpr (kOneK) {  // one k-step at a time: each x4 = 16 keys x 16 dims
#pragma unroll
      for (int kk = 0; kk < KD; kk++) {
        uint32_t qa[WM][4];
#pragma unroll
        for (int w = 0; w < WM; w++) {
          if constexpr (Q_REGS) {
#pragma unroll
            for (int r = 0; r < 4; r++) qa[w][r] = qf[w][kk][r];
          } else {
            ldmatrix_x4(qa[w], q_addr(w, kk));
          }
        }
#pragma unroll
        for (int n = 0; n < NS; n += 2) {
          uint32_t b[4];  // (keys n, k lo), (keys n, k hi), (keys n + 1, k lo), (keys n + 1, k hi)
          if constexpr (kLane) ldmatrix_x4(b, Kt + lo.kb_at(n * 8, kk));
          else ldmatrix_x4(b, Kt + 2 * swz<D>(n * 8 + lane % 8 + 8 * (lane / 16),
                                                kk * 16 + (lane / 8 % 2) * 8));
#pragma unroll
          for (int w = 0; w < WM; w++) {
            mma_m16n8k16<T>(s[w][n], qa[w], b[0], b[1]);
            mma_m16n8k16<T>(s[w][n + 1], qa[w], b[2], b[3]);
          }
        }
      }
    } else {  // stage 07's: two k-steps per K fragment
#pragma unroll
      for (int kk = 0; kk < KD; kk += 2) {
        uint32_t qa[WM][2][4];
#pragma unroll
        for (int w = 0; w < WM; w++)
#pragma unroll
          for (int e = 0; e < 2; e++) {
            if constexpr (Q_REGS) {
#pragma unroll
              for (int r = 0; r < 4; r++) qa[w][e][r] = qf[w][kk + e][r];
            } else {
              ldmatrix_x4(qa[w][e], q_addr(w, kk + e));
            }
          }
#pragma unroll
        for (int n = 0; n < NS; n++) {
          uint32_t b[4];
          ldmatrix_x4(b, k_addr(Kt, n, kk));
#pragma unroll
          for (int w = 0; w < WM; w++) {
            mma_m16n8k16<T>(s[w][n], qa[w][0], b[0], b[1]);
            mma_m16n8k16<T>(s[w][n], qa[w][1], b[2], b[3]);
          }
        }
      }
    }

    if constexpr (!kFold) {
#pragma unroll
      for (int w = 0; w < WM; w++)
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
          for (int i = 0; i < 4; i++) s[w][n][i] *= scale_log2;
    }
    if (k0 + BC > N || (causal && k0 + BC - 1 > q0)) {
#pragma unroll
      for (int w = 0; w < WM; w++)
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
          for (int i = 0; i < 4; i++) {
            const int key = k0 + n * 8 + 2 * t + (i & 1), row = r0 + 16 * w + (i >= 2 ? 8 : 0);
            if (key >= N || (causal && key > row)) s[w][n][i] = -INFINITY;
          }
    }

    // Online softmax on the raw scores: the max commutes with the (positive) scale, so the scale
    // goes into the exponent's FFMA, exp2(s * scale log2 e - m), instead of a multiply per score.
    float alpha[2 * WM];
#pragma unroll
    for (int w = 0; w < WM; w++)
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int h = 2 * w + hh;
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < NS; n++) mx = fmaxf(mx, fmaxf(s[w][n][2 * hh], s[w][n][2 * hh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // BEGIN CARRIED 05.online_softmax: stage 05's online softmax, with the scale folded into the exponent (kFold)
        const float m_new = fmaxf(m[h], kFold ? mx * scale_log2 : mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[h] = exp2_approx(m[h] - m_use);
        m[h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NS; n++) {
#pragma unroll
          for (int e = 0; e < 2; e++) {
            float& x = s[w][n][2 * hh + e];
            x = exp2_approx(kFold ? fmaf(x, scale_log2, -m_use) : x - m_use);
          }
          sum += s[w][n][2 * hh] + s[w][n][2 * hh + 1];
        }
        l[h] = fmaf(l[h], alpha[h], sum);
        // STUB: // TODO: P is left as the raw scores and l as it was: stage 05's online softmax update,
        // STUB: // for row tile w's row half hh (alpha[h] is read below; kFold folds the scale in).
        // STUB: alpha[h] = 1.f;
        // STUB: (void)mx;
        // END CARRIED 05.online_softmax
      }
    // Once a row's max has settled (most tiles, for long sequences) alpha is exactly 1: skip the
    // rescale of O, D/2 multiplies per row and lane, unless some lane of the warp needs it.
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2 * WM; h++) moved |= alpha[h] != 1.f;
    if (!kSkipRescale || __any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int w = 0; w < WM; w++)
#pragma unroll
        for (int d = 0; d < NO; d++) {
          o[w][d][0] *= alpha[2 * w];
          o[w][d][1] *= alpha[2 * w];
          o[w][d][2] *= alpha[2 * w + 1];
          o[w][d][3] *= alpha[2 * w + 1];
        }
    }

    // O += P V: each V fragment feeds WM row tiles.
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      uint32_t a[WM][4];
#pragma unroll
      for (int w = 0; w < WM; w++) {
        a[w][0] = pack2<T>(s[w][2 * ks][0], s[w][2 * ks][1]);
        a[w][1] = pack2<T>(s[w][2 * ks][2], s[w][2 * ks][3]);
        a[w][2] = pack2<T>(s[w][2 * ks + 1][0], s[w][2 * ks + 1][1]);
        a[w][3] = pack2<T>(s[w][2 * ks + 1][2], s[w][2 * ks + 1][3]);
      }
#pragma unroll
      for (int d = 0; d < NO; d += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_addr(Vt, ks, d));
#pragma unroll
        for (int w = 0; w < WM; w++) {
          mma_m16n8k16<T>(o[w][d], a[w], b[0], b[1]);
          mma_m16n8k16<T>(o[w][d + 1], a[w], b[2], b[3]);
        }
      }
    }
  }

  // The log-sum-exp of each row, natural log, is (m + log2 l) ln 2, m the max of the scores times
  // scale log2 e and l the sum of 2^(score scale log2 e - m). m goes to shared memory now (one
  // lane per quad), log2 l is added once l is summed across the quad, and the warp stores its
  // rows after O: kept in registers, m would push the D = 128 kernels past 255 and spill.
  float* Ls = reinterpret_cast<float*>(Qs + (BR + 2 * BC * STAGES) * D) + warp * WM * 16;
  if (WITH_LSE && t == 0) {
#pragma unroll
    for (int h = 0; h < 2 * WM; h++) Ls[8 * h + g] = m[h];
  }
  // Normalise and write through the warp's own rows of Qs (no other warp reads them), once every
  // lane is done reading Q there (with a single K/V tile no barrier has passed since).
  __syncwarp();
#pragma unroll
  for (int w = 0; w < WM; w++) {
    float inv[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      float sum = l[2 * w + hh];
      // BEGIN CARRIED 05.quad_sum: stage 05's sum across the quad
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      // STUB: // TODO: sum is this lane's part of the row sum only: add up the quad's parts (05.quad_sum).
      // END CARRIED 05.quad_sum
      inv[hh] = sum > 0.f ? 1.f / sum : 0.f;
      if (WITH_LSE && t == 0) Ls[16 * w + 8 * hh + g] += __log2f(sum);  // m + log2 l
    }
#pragma unroll
    for (int d = 0; d < NO; d++) {
      *reinterpret_cast<uint32_t*>(Qw + swz<D>(16 * w + g, d * 8) + 2 * t) =
          pack2<T>(o[w][d][0] * inv[0], o[w][d][1] * inv[0]);
      *reinterpret_cast<uint32_t*>(Qw + swz<D>(16 * w + g + 8, d * 8) + 2 * t) =
          pack2<T>(o[w][d][2] * inv[1], o[w][d][3] * inv[1]);
    }
  }
  __syncwarp();
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int i = 0; i < WM * 16 * CHUNKS / 32; i++) {
    const int e = lane + 32 * i, r = e / CHUNKS, c = (e % CHUNKS) * 8;
    const int row = q0 + warp * WM * 16 + r;
    if (row < N)
      *reinterpret_cast<uint4*>(O + b * L.o.b + h * L.o.h + row * L.o.n + c) =
          *reinterpret_cast<const uint4*>(Qw + swz<D>(r, c));
  }
  if (WITH_LSE) {
#pragma unroll
    for (int r = lane; r < WM * 16; r += 32) {
      const int row = q0 + warp * WM * 16 + r;
      if (row < N) LSE[(b * L.H + h) * N + row] = Ls[r] * 0.6931471805599453f;
    }
  }
}

template <typename T, int D, int BC, int WARPS, int WM, int STAGES, bool Q_REGS, int OPTS>
static const char* launch(const FlashlabProblem* p, cudaStream_t stream) {
  using Cfg = Tiles<D, BC, WARPS, WM, STAGES, Q_REGS>;
  // the log-sum-exp's stores only where it is asked for: without them, stage 08's kernel
  auto kernel = p->lse ? forward_kernel<T, D, BC, WARPS, WM, STAGES, Q_REGS, OPTS, true>
                       : forward_kernel<T, D, BC, WARPS, WM, STAGES, Q_REGS, OPTS, false>;
  const int smem = Cfg::SMEM_BYTES + (p->lse ? Cfg::LSE_BYTES : 0);
  FLASHLAB_TRY(flashlab_allow_smem(kernel, smem));
  // 1-D grid, tiles * B * H < 2^31 blocks: flashlab rejects inputs of 2^31 elements or more.
  dim3 grid(flashlab_cdiv(p->N, Cfg::BR) * p->B * p->H);
  kernel<<<grid, Cfg::THREADS, smem, stream>>>(
      (const T*)p->q, (const T*)p->k, (const T*)p->v, (T*)p->o, p->lse, p->layout, p->N,
      p->scale * 1.4426950408889634f, p->causal);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

// TUNED: the shapes tools/tune08.py chose (data/tune08.csv).
template <typename T>
static const char* pick(const FlashlabProblem* p, cudaStream_t s) {
  if (p->D == 64) {
    if (p->causal) {
      if (p->N < 1024) return launch<T, 64, 64, 4, 1, 2, true, 27>(p, s);
      return launch<T, 64, 128, 4, 2, 2, false, 29>(p, s);
    }
    return launch<T, 64, 128, 4, 2, 2, false, 29>(p, s);
  }
  if (p->D == 128) {
    if (p->causal) return launch<T, 128, 64, 4, 2, 2, false, 31>(p, s);
    return launch<T, 128, 64, 8, 2, 2, false, 31>(p, s);
  }
  return "no tuned shape for this head dim";
}

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F16 && p->dtype != FLASHLAB_BF16)
    return "stage 18 runs in fp16 or bf16 only, not float32";
  if (p->D != 64 && p->D != 128)
    return flashlab_say("stage 18 is compiled for head dims 64 and 128, not %d", p->D);
  return nullptr;
}

extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem*) { return 0; }

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == FLASHLAB_BF16) return pick<__nv_bfloat16>(p, s);
  return pick<__half>(p, s);
}

// --- the backward pass -----------------------------------------------------------------------------

// fp16 / bf16 <-> fp32 (torch builds with the implicit conversions switched off)
__device__ __forceinline__ float f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The backward block (bwd_kernel): WARPS warps, each owning WK m-tiles of 16 keys, so a block
// holds BC = 16 WK WARPS keys against query blocks of BR = 16 WARPS rows. Shared memory, in
// 16-bit elements: K_j, V_j, two buffers of (Q_i, dO_i), dS^T (BC x BR); then in floats two
// buffers of the query rows' log-sum-exps (log2 units) and Δs. S^T and dP^T are taken SUB
// queries at a time: 2 WK SUB / 2 accumulator floats a lane, which with dK and dV (WK D floats)
// must stay under 255 registers.
template <int D, int WARPS, int WK>
struct BwdTiles {
  static constexpr int BC = 16 * WK * WARPS, BR = 16 * WARPS, THREADS = 32 * WARPS, STAGES = 2;
  static constexpr int SUB = WK > 1 ? 32 : (D > 64 ? 32 : 64);
  static constexpr int K = 0, V = K + BC * D, Q = V + BC * D, DO = Q + STAGES * BR * D;
  static constexpr int DS = DO + STAGES * BR * D, END = DS + BC * BR;
  static constexpr int BYTES = END * 2 + 2 * STAGES * BR * 4;
};

// dQ's fp32 sum, tiled: a head's rows padded to a multiple of 64, cut into tiles of 16 rows x 64
// columns (1024 floats), tile (row / 16, col / 64) at ((row / 16) (D / 64) + col / 64) 1024. A
// warp's dQ accumulators for rows 16w.. and columns c0..c0 + 63 (dq_step) are one tile: lane l
// holds element e of n-tile n, row l / 4 + 8 (e / 2), column 8n + 2 (l % 4) + e % 2. Inside the
// tile that element sits at dq_slot(n, e, l), so that the warp's 32 lanes, each adding DQ_VEC
// neighbouring floats, cover 128 DQ_VEC contiguous bytes: 256 with float2 reductions (sm_90),
// 128 with float ones.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DQ_VEC 2
#else
#define DQ_VEC 1
#endif
__host__ __device__ __forceinline__ int dq_rows(int N) { return (N + 63) / 64 * 64; }
__device__ __forceinline__ int dq_slot(int n, int e, int lane) {
  return ((n * (4 / DQ_VEC) + e / DQ_VEC) * 32 + lane) * DQ_VEC + e % DQ_VEC;
}

// The other way: the row r and column c, inside its tile, of the element that float p of a tile
// (0 <= p < 1024, in memory order) holds. The conversion pass reads a tile in memory order.
__device__ __forceinline__ void dq_unslot(int p, int& r, int& c) {
  int n, e, lane;
  // BEGIN EXERCISE 18.dq_unslot: the n-tile n, the element e and the lane whose accumulator
  // float p of a tile holds: the inverse of dq_slot for this build's DQ_VEC (2 on sm_90, 1
  // before it). An exact inverse, or dQ is wrong.
  lane = p / DQ_VEC % 32;
  const int q = p / DQ_VEC / 32;
  n = q / (4 / DQ_VEC);
  e = q % (4 / DQ_VEC) * DQ_VEC + p % DQ_VEC;
  // STUB: // TODO: every float read as n-tile 0, element 0 of lane 0: dQ comes out wrong (18.dq_unslot).
  // STUB: n = e = lane = 0;
  // STUB: (void)p;
  // END EXERCISE 18.dq_unslot
  r = lane / 4 + 8 * (e / 2);  // where that lane's element sits in the C fragment (notebook 05)
  c = 8 * n + 2 * (lane % 4) + e % 2;
}

// 1. Δ_i = rowsum(dO_i ∘ O_i) in fp32, one warp per row of every (batch, head), and dQ's fp32 sum
//    zeroed on the way: warp rp zeroes D floats of it, the padded rows' share too. dO, O and the
//    sum are contiguous. (Stage 14's, over the padded rows.)
template <typename T, int D>
__global__ void __launch_bounds__(256)
bwd_preprocess_kernel(const T* __restrict__ O, const T* __restrict__ dO, float* __restrict__ delta,
                      float* __restrict__ dq_acc, int heads, int N) {
  const int rp = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32, Np = dq_rows(N);
  if (rp >= heads * Np) return;
#pragma unroll
  for (int d = 4 * lane; d < D; d += 128)
    *reinterpret_cast<float4*>(dq_acc + (size_t)rp * D + d) = make_float4(0.f, 0.f, 0.f, 0.f);
  if (rp % Np >= N) return;
  const int row = rp / Np * N + rp % Np;
  float sum = 0.f;
#pragma unroll
  for (int d = lane; d < D; d += 32) sum += f32(O[(size_t)row * D + d]) * f32(dO[(size_t)row * D + d]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) delta[row] = sum;
}


// The oldest architecture this file is compiled for (nvcc's __CUDA_ARCH_LIST__ is ascending):
// the host picks the backward's shape before it knows which of them runs.
template <typename... R> constexpr int flashlab_first(int a, R...) { return a; }
#ifdef __CUDA_ARCH_LIST__
constexpr int kOldestArch = flashlab_first(__CUDA_ARCH_LIST__);
#else
constexpr int kOldestArch = 0;
#endif
// Keys a warp at D = 64: 32 where every build is sm_90 or newer, else stage 15's 16.
constexpr int kWK64 = kOldestArch >= 900 ? 2 : 1;

// P and dS of accumulator element e of n-tile n, in place (stage 14's, on stage 15's fragments).
template <int NQ>
__device__ __forceinline__ void p_and_ds(float (&st)[NQ][4], float (&dpt)[NQ][4], int n, int e,
                                         bool seen, float scale_log2, const float* Lr,
                                         const float* Dr, int qi) {
  // BEGIN CARRIED 14.dscores: stage 14's P and dS, on accumulator element e: st[n][e] =
  // k_key . q_row becomes P, dpt[n][e] = v_key . dO_row becomes dS (log-sum-exp Lr[qi] in
  // log2 units, Δ in Dr[qi])
  const float p = seen ? exp2_approx(fmaf(st[n][e], scale_log2, -Lr[qi])) : 0.f;
  st[n][e] = p;
  dpt[n][e] = p * (dpt[n][e] - Dr[qi]);
  // STUB: // TODO: P and dS are left at zero: every gradient but a zero one is wrong (14.dscores).
  // STUB: st[n][e] = dpt[n][e] = 0.f;
  // STUB: (void)seen; (void)scale_log2; (void)Lr; (void)Dr; (void)qi;
  // END CARRIED 14.dscores
}

// The A fragments of dS (query rows 16 w.., every key of the block) for dQ_i += dS K_j, and this
// lane's row and column in a 16 x 16 block of K_j (stage 15's).
template <int BR, int KK>
__device__ __forceinline__ void dq_operands(uint32_t (&da)[KK][4], int& krow, int& kcol,
                                            uint32_t dSs_u, int w, int lane) {
  // BEGIN CARRIED 15.dq_operands: the operands of dQ_i += dS K_j, read by ldmatrix.x4.trans.
  // da[kk]: the A fragment of dS (query rows 16 w.., keys 16 kk..) from the dS^T tile (rows
  // keys, BR queries a row, element (key, query) at swz<BR>(key, query)): lanes 8i..8i+7 give
  // the row addresses of 8x8 matrix i, and a .trans matrix reaches lane l as its column l / 4.
  // krow, kcol: this lane's row and column in a 16 x 16 block of K_j, whose four matrices must
  // come out as the B fragments (b0, b1) of n-tiles 2d and 2d + 1.
#pragma unroll
  for (int kk = 0; kk < KK; kk++)
    ldmatrix_x4_trans(da[kk], dSs_u + 2 * swz<BR>(16 * kk + lane % 8 + 8 * (lane / 16),
                                                  16 * w + 8 * ((lane / 8) % 2)));
  krow = lane % 16;
  kcol = 8 * (lane / 16);
  // STUB: // TODO: every lane reads the same rows, so dQ is wrong (dK and dV are not).
  // STUB: for (int kk = 0; kk < KK; kk++) ldmatrix_x4_trans(da[kk], dSs_u);
  // STUB: krow = kcol = 0; (void)w; (void)lane;
  // END CARRIED 15.dq_operands
}

// dQ_i += dS K_j for query rows 16 w.. and head-dim columns c0..c0 + 63, over the block's BC keys
// (stage 15's products), added to the tile of dQ's fp32 sum that holds them (row16 = the first of
// the 16 rows): one reduction a lane for each DQ_VEC of its accumulators.
template <typename T, int D, int BR, int BC>
__device__ __forceinline__ void dq_step(float* dq_acc, uint32_t dSs_u, uint32_t Ks_u, int w, int c0,
                                        int row16, int lane) {
  constexpr int KK = BC / 16;
  uint32_t da[KK][4];
  int krow, kcol;
  dq_operands<BR, KK>(da, krow, kcol, dSs_u, w, lane);
  float dq[8][4] = {};
#pragma unroll
  for (int kk = 0; kk < KK; kk++) {
#pragma unroll
    for (int d = 0; d < 4; d++) {
      uint32_t kb[4];
      ldmatrix_x4_trans(kb, Ks_u + 2 * swz<D>(16 * kk + krow, c0 + 16 * d + kcol));
      mma_m16n8k16<T>(dq[2 * d], da[kk], kb[0], kb[1]);
      mma_m16n8k16<T>(dq[2 * d + 1], da[kk], kb[2], kb[3]);
    }
  }
  float* tile = dq_acc + ((size_t)(row16 / 16) * (D / 64) + c0 / 64) * 1024;
#pragma unroll
  for (int n = 0; n < 8; n++) {
#if DQ_VEC == 2
    atomicAdd(reinterpret_cast<float2*>(tile + dq_slot(n, 0, lane)), make_float2(dq[n][0], dq[n][1]));
    atomicAdd(reinterpret_cast<float2*>(tile + dq_slot(n, 2, lane)), make_float2(dq[n][2], dq[n][3]));
#else
#pragma unroll
    for (int e = 0; e < 4; e++) atomicAdd(tile + dq_slot(n, e, lane), dq[n][e]);
#endif
  }
}

// S^T = K_w Q_i^T and dP^T = V_w dO_i^T for WK m-tiles of 16 keys (kw + 16 m..) against queries
// q..q + 8 NQ - 1, fp32 accumulators: every Q_i / dO_i fragment feeds WK pairs of mma.sync.
template <typename T, int D, int WK, int NQ>
__device__ __forceinline__ void scores_t(float (&stm)[WK][NQ][4], float (&dptm)[WK][NQ][4],
                                         uint32_t Ks_u, uint32_t Vs_u, uint32_t Qs_u,
                                         uint32_t dOs_u, int kw, int q, int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; kk++) {
    uint32_t ka[WK][4], va[WK][4];
#pragma unroll
    for (int m = 0; m < WK; m++) {
      const int off = 2 * swz<D>(kw + 16 * m + lane % 16, 16 * kk + 8 * (lane / 16));
      ldmatrix_x4(ka[m], Ks_u + off);
      ldmatrix_x4(va[m], Vs_u + off);
    }
#pragma unroll
    for (int n = 0; n < NQ / 2; n++) {  // queries q + 16n.., two n-tiles per ldmatrix.x4
      uint32_t qb[4], ob[4];
      const int boff = 2 * swz<D>(q + 16 * n + lane % 8 + 8 * (lane / 16), 16 * kk + 8 * ((lane / 8) % 2));
      ldmatrix_x4(qb, Qs_u + boff);
      ldmatrix_x4(ob, dOs_u + boff);
#pragma unroll
      for (int m = 0; m < WK; m++) {
        mma_m16n8k16<T>(stm[m][2 * n], ka[m], qb[0], qb[1]);
        mma_m16n8k16<T>(stm[m][2 * n + 1], ka[m], qb[2], qb[3]);
        mma_m16n8k16<T>(dptm[m][2 * n], va[m], ob[0], ob[1]);
        mma_m16n8k16<T>(dptm[m][2 * n + 1], va[m], ob[2], ob[3]);
      }
    }
  }
}

// The block's (batch, head) and key block: the pointers moved to them; k0, the block's first
// key; base, the head's first row in the contiguous tensors (dO, the log-sum-exps, Δ, dQ's sum).
template <typename T, int D, int BC>
__device__ __forceinline__ void block_origin(const T* __restrict__& Q, const T* __restrict__& K,
                                             const T* __restrict__& V, const T* __restrict__& dO,
                                             const float* __restrict__& LSE,
                                             const float* __restrict__& delta,
                                             float* __restrict__& dq_acc, const FlashlabLayout& L,
                                             int N, int& k0, size_t& base) {
  const int key_tiles = (N + BC - 1) / BC;
  const int bh = blockIdx.x / key_tiles;
  const int b = bh / L.H, h = bh % L.H;
  k0 = (blockIdx.x % key_tiles) * BC;
  Q += b * L.q.b + h * L.q.h; K += b * L.k.b + h * L.k.h; V += b * L.v.b + h * L.v.h;
  base = (size_t)bh * N;
  dO += base * D; LSE += base; delta += base; dq_acc += (size_t)bh * dq_rows(N) * D;
}

// Start copying query block i (counted from `first`) of Q and dO into buffer i % STAGES of the
// tiles C lays out in shared memory (base_u), as one cp.async group.
template <typename C, typename T, int D>
__device__ __forceinline__ void issue_queries(uint32_t base_u, const T* Q, const T* dO,
                                              const FlashlabLayout& L, int first, int i, int N) {
  const int q0 = first + i * C::BR, s = i % C::STAGES;
  load_tile_async<C::BR, D, C::THREADS, true>(base_u + 2 * (C::Q + s * C::BR * D), Q, L.q.n, q0, N);
  load_tile_async<C::BR, D, C::THREADS, true>(base_u + 2 * (C::DO + s * C::BR * D), dO, D, q0, N);
  cp_async_commit();
}

// Query block 0's Q and dO, and its rows' log-sum-exps (log2 units) and Δs into the first of
// Ls's and Ds's buffers.
template <typename C, typename T, int D>
__device__ __forceinline__ void first_queries(uint32_t base_u, const T* Q, const T* dO,
                                              const float* LSE, const float* delta, float* Ls,
                                              float* Ds, const FlashlabLayout& L, int first, int N) {
  issue_queries<C, T, D>(base_u, Q, dO, L, first, 0, N);
  for (int r = threadIdx.x; r < C::BR; r += C::THREADS) {
    const int row = first + r;
    Ls[r] = row < N ? LSE[row] * 1.4426950408889634f : 0.f;
    Ds[r] = row < N ? delta[row] : 0.f;
  }
}

// P^T and dS^T in place for a warp's WK m-tiles of 16 keys (key0 + 16m..) against queries
// q.. (NQ n-tiles of 8; row q0 + q.. of the head): element e of n-tile n of m-tile m is key
// key0 + 16m + g (+ 8 for e >= 2), query q + 8n + 2t (+ 1 for odd e). Masks only on an edge
// block, where the block crosses N or the diagonal.
template <int WK, int NQ>
__device__ __forceinline__ void tile_p_and_ds(float (&stm)[WK][NQ][4], float (&dptm)[WK][NQ][4],
                                              int q, int q0, int key0, bool edge, int N,
                                              int causal, float scale_log2, const float* Lr,
                                              const float* Dr, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int m = 0; m < WK; m++)
#pragma unroll
    for (int n = 0; n < NQ; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int qi = q + 8 * n + 2 * t + (e & 1), key = key0 + 16 * m + g + 8 * (e / 2);
        const int row = q0 + qi;
        const bool seen = !edge || (row < N && key < N && !(causal && key > row));
        p_and_ds<NQ>(stm[m], dptm[m], n, e, seen, scale_log2, Lr, Dr, qi);
      }
}

// dK and dV of a warp's WK m-tiles of 16 keys (key0 + 16m..), head-dim columns col0 + 8n.. of
// NC n-tiles, in the inputs' dtype; dK carries the scale of S = scale Q K^T (dQ gets it in
// bwd_dq_kernel).
template <typename T, int D, int WK, int NC>
__device__ __forceinline__ void store_dk_dv(T* dK, T* dV, const float (&dk)[WK][NC][4],
                                            const float (&dv)[WK][NC][4], size_t base, int key0,
                                            int col0, int N, float scale, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int m = 0; m < WK; m++)
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      const int key = key0 + 16 * m + g + 8 * hh;
      if (key >= N) continue;
#pragma unroll
      for (int n = 0; n < NC; n++) {
        const size_t at = (base + key) * D + col0 + 8 * n + 2 * t;
        *reinterpret_cast<uint32_t*>(dK + at) = pack2<T>(dk[m][n][2 * hh] * scale, dk[m][n][2 * hh + 1] * scale);
        *reinterpret_cast<uint32_t*>(dV + at) = pack2<T>(dv[m][n][2 * hh], dv[m][n][2 * hh + 1]);
      }
    }
}

// 2. One block per (key block j, batch, head), dK_j and dV_j in the warps' accumulators. At D = 64
//    (bwd_warps): WARPS warps of WK x 16 keys each, query blocks of BR = 16 WARPS rows (stage
//    15's block at WK = 1). At D = 128 (bwd_pairs below): pairs of warps share 32 keys.
template <typename T, int D, int WARPS, int WK>
__device__ __forceinline__ void
bwd_warps(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
          const T* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ delta,
          float* __restrict__ dq_acc, T* __restrict__ dK, T* __restrict__ dV,
          const FlashlabLayout L, int N, float scale, int causal) {
  using C = BwdTiles<D, WARPS, WK>;
  constexpr int BC = C::BC, BR = C::BR;
  constexpr int NQ = C::SUB / 8, ND = D / 8, KQ = C::SUB / 16;
  extern __shared__ uint4 smem_raw[];
  T* sm = reinterpret_cast<T*>(smem_raw);
  T* dSs = sm + C::DS;
  float* Ls = reinterpret_cast<float*>(sm + C::END);  // [STAGES][BR], then Δ: [STAGES][BR]
  float* Ds = Ls + C::STAGES * BR;
  const uint32_t base_u = smem_u32(sm);
  const uint32_t Ks_u = base_u + 2 * C::K, Vs_u = base_u + 2 * C::V, dSs_u = base_u + 2 * C::DS;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  int k0;
  size_t base;
  block_origin<T, D, BC>(Q, K, V, dO, LSE, delta, dq_acc, L, N, k0, base);
  const float scale_log2 = scale * 1.4426950408889634f;

  // K_j and V_j once; then query blocks from the first that sees a key of this block.
  load_tile_async<BC, D, C::THREADS, true>(Ks_u, K, L.k.n, k0, N);
  load_tile_async<BC, D, C::THREADS, true>(Vs_u, V, L.v.n, k0, N);
  const int first = causal ? k0 : 0, blocks = (N - first + BR - 1) / BR;
  // without the mask, key block kb starts at query block kb * blocks / key_tiles, so that the
  // blocks of one head add into different tiles of dQ at a time
  const int key_tiles = (N + BC - 1) / BC;
  const int rot = causal ? 0 : (int)(((long long)(blockIdx.x % key_tiles) * blocks) / key_tiles);
  auto qb = [&](int i) { const int r = i + rot; return r >= blocks ? r - blocks : r; };
  first_queries<C, T, D>(base_u, Q, dO, LSE, delta, Ls, Ds, L, first + qb(0) * BR, N);

  float dv[WK][ND][4] = {}, dk[WK][ND][4] = {};
  const int kw = 16 * WK * warp;  // this warp's first key in the block
  for (int i = 0; i < blocks; i++) {
    const int q0 = first + qb(i) * BR, s = i % C::STAGES;
    const uint32_t Qs_u = base_u + 2 * (C::Q + s * BR * D), dOs_u = base_u + 2 * (C::DO + s * BR * D);
    // The next block's tiles go into the other buffer, last read before the previous barrier;
    // its log-sum-exps and Δs wait in registers until this block's are read.
    float l_next = 0.f, d_next = 0.f;
    const int r_next = threadIdx.x, row_next = first + qb(i + 1) * BR + r_next;
    if (i + 1 < blocks) {
      issue_queries<C, T, D>(base_u, Q, dO, L, first + (qb(i + 1) - (i + 1)) * BR, i + 1, N);
      if (r_next < BR && row_next < N) {
        l_next = LSE[row_next] * 1.4426950408889634f;
        d_next = delta[row_next];
      }
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // block i's tiles are in; every warp is done with the last dS^T

    const float* Lr = Ls + s * BR;
    const float* Dr = Ds + s * BR;
    // A block of BC keys can cross the diagonal of a query block of BR < BC rows that starts
    // after its first key: the mask is needed wherever the two overlap.
    const bool edge = (causal && q0 < k0 + BC) || q0 + BR > N || k0 + BC > N;
#pragma unroll 1
    for (int q = 0; q < BR; q += C::SUB) {  // queries q.. of the block
    float stm[WK][NQ][4] = {}, dptm[WK][NQ][4] = {};
    scores_t<T, D, WK, NQ>(stm, dptm, Ks_u, Vs_u, Qs_u, dOs_u, kw, q, lane);

    tile_p_and_ds<WK, NQ>(stm, dptm, q, q0, k0 + kw, edge, N, causal, scale_log2, Lr, Dr, lane);

    // dV_w += P^T dO_i and dK_w += dS^T Q_i. The accumulators of n-tiles 2j and 2j + 1 are the
    // A fragment of k-step j (queries 16j..), packed to 16 bits; dO_i and Q_i by ldmatrix.trans,
    // each fragment feeding the WK m-tiles.
#pragma unroll
    for (int j = 0; j < KQ; j++) {
      uint32_t pa[WK][4], sa[WK][4];
#pragma unroll
      for (int m = 0; m < WK; m++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
          const int n = 2 * j + r / 2, e = 2 * (r % 2);
          pa[m][r] = pack2<T>(stm[m][n][e], stm[m][n][e + 1]);
          sa[m][r] = pack2<T>(dptm[m][n][e], dptm[m][n][e + 1]);
        }
#pragma unroll
      for (int d = 0; d < ND / 2; d++) {  // head-dim columns 16d.., two n-tiles per ldmatrix.x4
        uint32_t ob[4], qb[4];
        const int off = 2 * swz<D>(q + 16 * j + lane % 16, 16 * d + 8 * (lane / 16));
        ldmatrix_x4_trans(ob, dOs_u + off);
        ldmatrix_x4_trans(qb, Qs_u + off);
#pragma unroll
        for (int m = 0; m < WK; m++) {
          mma_m16n8k16<T>(dv[m][2 * d], pa[m], ob[0], ob[1]);
          mma_m16n8k16<T>(dv[m][2 * d + 1], pa[m], ob[2], ob[3]);
          mma_m16n8k16<T>(dk[m][2 * d], sa[m], qb[0], qb[1]);
          mma_m16n8k16<T>(dk[m][2 * d + 1], sa[m], qb[2], qb[3]);
        }
      }
      // dS^T to shared memory for dQ: rows are keys, BR queries a row, swizzled like the tiles.
#pragma unroll
      for (int m = 0; m < WK; m++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int n = 2 * j + e / 2, key = kw + 16 * m + g + 8 * (e % 2);
          *reinterpret_cast<uint32_t*>(dSs + swz<BR>(key, q + 8 * n) + 2 * t) = sa[m][e];
        }
    }
    }
    if (i + 1 < blocks && r_next < BR) {  // the next block's rows, into the buffer read last time
      Ls[(1 - s) * BR + r_next] = l_next;
      Ds[(1 - s) * BR + r_next] = d_next;
    }
    __syncthreads();  // dS^T complete

    // dQ_i += dS K_j: warp w takes query rows 16w.. against the block's BC keys, 64 columns at
    // a time.
#pragma unroll
    for (int half = 0; half < D / 64; half++)
      dq_step<T, D, BR, BC>(dq_acc, dSs_u, Ks_u, warp, 64 * half, q0 + 16 * warp, lane);
  }

  store_dk_dv<T, D, WK, ND>(dK, dV, dk, dv, base, k0 + kw, 0, N, scale, lane);
}

// D = 128: pairs of warps. BC = 128 keys, BR = 64 queries, 8 warps; pair p owns keys 32p..
//    Shared memory as bwd_kernel's, with a P^T tile (BC x BR) beside dS^T.
template <int D>
struct PairTiles {
  static constexpr int WARPS = 8, THREADS = 256, BC = 128, BR = 64, STAGES = 2, DH = D / 2;
  static constexpr int K = 0, V = K + BC * D, Q = V + BC * D, DO = Q + STAGES * BR * D;
  static constexpr int PT = DO + STAGES * BR * D, DS = PT + BC * BR, END = DS + BC * BR;
  static constexpr int BYTES = END * 2 + 2 * STAGES * BR * 4;
};

template <typename T, int D>
__device__ __forceinline__ void
bwd_pairs(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
          const T* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ delta,
          float* __restrict__ dq_acc, T* __restrict__ dK, T* __restrict__ dV,
          const FlashlabLayout L, int N, float scale, int causal) {
  using C = PairTiles<D>;
  constexpr int BC = C::BC, BR = C::BR, DH = C::DH;
  constexpr int NQ = 4, NH = DH / 8, KQ = BR / 16;
  extern __shared__ uint4 smem_raw[];
  T* sm = reinterpret_cast<T*>(smem_raw);
  T* Pts = sm + C::PT;
  T* dSs = sm + C::DS;
  float* Ls = reinterpret_cast<float*>(sm + C::END);
  float* Ds = Ls + C::STAGES * BR;
  const uint32_t base_u = smem_u32(sm);
  const uint32_t Ks_u = base_u + 2 * C::K, Vs_u = base_u + 2 * C::V;
  const uint32_t Pts_u = base_u + 2 * C::PT, dSs_u = base_u + 2 * C::DS;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int pair = warp / 2, hq = warp % 2;  // keys 32 pair..; query half (then column half) hq
  int k0;
  size_t base;
  block_origin<T, D, BC>(Q, K, V, dO, LSE, delta, dq_acc, L, N, k0, base);
  const float scale_log2 = scale * 1.4426950408889634f;

  load_tile_async<BC, D, C::THREADS, true>(Ks_u, K, L.k.n, k0, N);
  load_tile_async<BC, D, C::THREADS, true>(Vs_u, V, L.v.n, k0, N);
  const int first = causal ? k0 : 0, blocks = (N - first + BR - 1) / BR;
  // without the mask, key block kb starts at query block kb * blocks / key_tiles, so that the
  // blocks of one head add into different tiles of dQ at a time
  const int key_tiles = (N + BC - 1) / BC;
  const int rot = causal ? 0 : (int)(((long long)(blockIdx.x % key_tiles) * blocks) / key_tiles);
  auto qb = [&](int i) { const int r = i + rot; return r >= blocks ? r - blocks : r; };
  first_queries<C, T, D>(base_u, Q, dO, LSE, delta, Ls, Ds, L, first + qb(0) * BR, N);

  float dv[2][NH][4] = {}, dk[2][NH][4] = {};
  const int kw = 32 * pair;
  for (int i = 0; i < blocks; i++) {
    const int q0 = first + qb(i) * BR, s = i % C::STAGES;
    const uint32_t Qs_u = base_u + 2 * (C::Q + s * BR * D), dOs_u = base_u + 2 * (C::DO + s * BR * D);
    // dV and dK read Q_i and dO_i after the second barrier, so the next block's copies may start
    // only once every warp is past this one: wait for block i's, then issue block i + 1's.
    cp_async_wait<0>();
    __syncthreads();  // block i's tiles are in; every warp is done with block i - 1's
    float l_next = 0.f, d_next = 0.f;
    const int r_next = threadIdx.x, row_next = first + qb(i + 1) * BR + r_next;
    if (i + 1 < blocks) {
      issue_queries<C, T, D>(base_u, Q, dO, L, first + (qb(i + 1) - (i + 1)) * BR, i + 1, N);
      if (r_next < BR && row_next < N) {
        l_next = LSE[row_next] * 1.4426950408889634f;
        d_next = delta[row_next];
      }
    }

    const float* Lr = Ls + s * BR;
    const float* Dr = Ds + s * BR;
    const bool edge = (causal && q0 < k0 + BC) || q0 + BR > N || k0 + BC > N;
    const int q = 32 * hq;
    {
      float stm[2][NQ][4] = {}, dptm[2][NQ][4] = {};
      scores_t<T, D, 2, NQ>(stm, dptm, Ks_u, Vs_u, Qs_u, dOs_u, kw, q, lane);
      tile_p_and_ds<2, NQ>(stm, dptm, q, q0, k0 + kw, edge, N, causal, scale_log2, Lr, Dr, lane);
      // P^T and dS^T of keys kw + 16m.., queries q.. to shared memory, in 16-bit pairs
#pragma unroll
      for (int m = 0; m < 2; m++) {
#pragma unroll
        for (int n = 0; n < NQ; n++)
#pragma unroll
          for (int hh = 0; hh < 2; hh++) {
            const int key = kw + 16 * m + g + 8 * hh, at = swz<BR>(key, q + 8 * n) + 2 * t;
            *reinterpret_cast<uint32_t*>(Pts + at) = pack2<T>(stm[m][n][2 * hh], stm[m][n][2 * hh + 1]);
            *reinterpret_cast<uint32_t*>(dSs + at) = pack2<T>(dptm[m][n][2 * hh], dptm[m][n][2 * hh + 1]);
          }
      }
    }
    if (i + 1 < blocks && r_next < BR) {
      Ls[(1 - s) * BR + r_next] = l_next;
      Ds[(1 - s) * BR + r_next] = d_next;
    }
    __syncthreads();  // P^T and dS^T complete

    // dV += P^T dO_i, dK += dS^T Q_i: the pair's keys kw.. (two m-tiles), head-dim columns
    // DH hq.., over all BR queries. P^T and dS^T come back from shared memory as A fragments.
#pragma unroll
    for (int j = 0; j < KQ; j++) {  // queries 16j..
      uint32_t pa[2][4], sa[2][4];
#pragma unroll
      for (int m = 0; m < 2; m++) {
        // BEGIN CARRIED 17.pair_operands: stage 17's operands of P^T and dS^T, unchanged
        const int off = 2 * swz<BR>(kw + 16 * m + lane % 16, 16 * j + 8 * (lane / 16));
        ldmatrix_x4(pa[m], Pts_u + off);
        ldmatrix_x4(sa[m], dSs_u + off);
        // END CARRIED 17.pair_operands
      }
#pragma unroll
      for (int d = 0; d < NH / 2; d++) {
        uint32_t ob[4], qb[4];
        const int off = 2 * swz<D>(16 * j + lane % 16, DH * hq + 16 * d + 8 * (lane / 16));
        ldmatrix_x4_trans(ob, dOs_u + off);
        ldmatrix_x4_trans(qb, Qs_u + off);
#pragma unroll
        for (int m = 0; m < 2; m++) {
          mma_m16n8k16<T>(dv[m][2 * d], pa[m], ob[0], ob[1]);
          mma_m16n8k16<T>(dv[m][2 * d + 1], pa[m], ob[2], ob[3]);
          mma_m16n8k16<T>(dk[m][2 * d], sa[m], qb[0], qb[1]);
          mma_m16n8k16<T>(dk[m][2 * d + 1], sa[m], qb[2], qb[3]);
        }
      }
    }

    // dQ_i += dS K_j: warp w takes queries 16 (w % 4).., columns 64 (w / 4).., all BC keys.
    dq_step<T, D, BR, BC>(dq_acc, dSs_u, Ks_u, warp % 4, 64 * (warp / 4), q0 + 16 * (warp % 4), lane);
  }

  store_dk_dv<T, D, 2, NH>(dK, dV, dk, dv, base, k0 + kw, DH * hq, N, scale, lane);
}

// The backward's main kernel: bwd_warps, or at PAIRS bwd_pairs (8 warps).
template <typename T, int D, int WARPS, int WK, bool PAIRS>
__global__ void __launch_bounds__(WARPS * 32)
bwd_kernel(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
           const T* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ delta,
           float* __restrict__ dq_acc, T* __restrict__ dK, T* __restrict__ dV,
           const FlashlabLayout L, int N, float scale, int causal) {
  if constexpr (PAIRS)
    bwd_pairs<T, D>(Q, K, V, dO, LSE, delta, dq_acc, dK, dV, L, N, scale, causal);
  else
    bwd_warps<T, D, WARPS, WK>(Q, K, V, dO, LSE, delta, dq_acc, dK, dV, L, N, scale, causal);
}

// 3. dQ = scale · (the fp32 sum), in the inputs' dtype: a block per tile of the sum, read whole in
//    memory order, put back in row order in shared memory, written a row of 64 columns at a time.
template <typename T, int D>
__global__ void __launch_bounds__(256)
bwd_dq_kernel(const float* __restrict__ dq_acc, T* __restrict__ dQ, float scale, int N) {
  __shared__ float tile[16][64 + 4];
  constexpr int CT = D / 64;
  const int Np = dq_rows(N), per_head = Np / 16 * CT;
  const int bh = blockIdx.x / per_head, tt = blockIdx.x % per_head, row0 = tt / CT * 16, col0 = tt % CT * 64;
  const float4 v = reinterpret_cast<const float4*>(dq_acc + (size_t)blockIdx.x * 1024)[threadIdx.x];
  const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    int r, c;
    dq_unslot(4 * threadIdx.x + j, r, c);
    tile[r][c] = vals[j];
  }
  __syncthreads();
  const int r = threadIdx.x / 16, c = threadIdx.x % 16 * 4;
  if (row0 + r < N) {
    T* out = dQ + ((size_t)bh * N + row0 + r) * D + col0 + c;
    *reinterpret_cast<uint32_t*>(out) = pack2<T>(tile[r][c] * scale, tile[r][c + 1] * scale);
    *reinterpret_cast<uint32_t*>(out + 2) = pack2<T>(tile[r][c + 2] * scale, tile[r][c + 3] * scale);
  }
}

// Δ, the main kernel (BC keys a block, BYTES of shared memory), then the dQ conversion.
template <typename T, int D, int BC, int BYTES, typename Kernel>
static const char* launch_backward(const FlashlabProblem* p, cudaStream_t stream, Kernel kernel,
                                   int threads) {
  float* dq_acc = static_cast<float*>(p->workspace);
  const size_t scratch = (size_t)p->B * p->H * dq_rows(p->N) * D;
  float* delta = dq_acc + scratch;
  bwd_preprocess_kernel<T, D><<<flashlab_cdiv(p->B * p->H * dq_rows(p->N), 8), 256, 0, stream>>>(
      (const T*)p->o, (const T*)p->dout, delta, dq_acc, p->B * p->H, p->N);
  FLASHLAB_TRY(cudaGetLastError());
  FLASHLAB_TRY(flashlab_allow_smem(kernel, BYTES));
  dim3 grid(flashlab_cdiv(p->N, BC) * p->B * p->H);
  kernel<<<grid, threads, BYTES, stream>>>(
      (const T*)p->q, (const T*)p->k, (const T*)p->v, (const T*)p->dout, p->lse, delta, dq_acc,
      (T*)p->dk, (T*)p->dv, p->layout, p->N, p->scale, p->causal);
  FLASHLAB_TRY(cudaGetLastError());
  bwd_dq_kernel<T, D><<<(unsigned)(scratch / 1024), 256, 0, stream>>>(dq_acc, (T*)p->dq, p->scale, p->N);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

template <typename T>
static const char* backward(const FlashlabProblem* p, cudaStream_t s) {
  if (p->D == 64) {
    using C = BwdTiles<64, 4, kWK64>;
    return launch_backward<T, 64, C::BC, C::BYTES>(p, s, bwd_kernel<T, 64, 4, kWK64, false>,
                                                   C::THREADS);
  }
  if (p->D == 128) {
    using C = PairTiles<128>;
    return launch_backward<T, 128, C::BC, C::BYTES>(p, s, bwd_kernel<T, 128, C::WARPS, 2, true>,
                                                    C::THREADS);
  }
  return "stage 18's backward is compiled for head dims 64 and 128";
}

// Scratch: the fp32 dQ sum (B H rows D floats, rows = N padded to a multiple of 64), then Δ (B H N floats).
extern "C" size_t flashlab_backward_workspace_bytes(const FlashlabProblem* p) {
  return (size_t)p->B * p->H * ((size_t)dq_rows(p->N) * p->D + p->N) * sizeof(float);
}

extern "C" const char* flashlab_backward_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  return p->dtype == FLASHLAB_BF16 ? backward<__nv_bfloat16>(p, s) : backward<__half>(p, s);
}
