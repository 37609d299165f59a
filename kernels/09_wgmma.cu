// Stage 09 — wgmma: the matrix products move from per-warp mma.sync to warpgroup wgmma.
//
// Up to stage 08 each warp multiplies its own 16 rows with mma.sync.m16n8k16: every 16x8x16
// step is one instruction per warp, both operands pass through registers (ldmatrix first), and
// the warp waits for each result. Hopper's tensor cores take bigger, asynchronous instructions:
// wgmma.mma_async, issued together by a warpgroup (4 consecutive warps, 128 threads), multiplies
// a 64 x N x 16 block (N up to 256) reading its operands straight from shared memory through
// 64-bit matrix descriptors, and runs in the background until wgmma.wait_group.
//  * S = Q K^T: one wgmma per 16 columns of the head dim, 64 query rows x BC keys, A (Q) and
//    B (K) both from shared memory. Both are "K-major" (the head dim is contiguous): as stored.
//  * O += P V: P is already in registers (the accumulator of S, rounded to 16 bits, has the
//    layout of an A fragment), so A comes from registers and B (V, [key][dim]) from shared
//    memory read transposed (N-major).
//  * The shared-memory tiles use the 128-byte swizzle the descriptors name: rows of 64 columns
//    (128 bytes), and the 16-byte chunk c of row r stored at c ^ (r % 8) — stage 06's XOR, now a
//    layout the hardware knows. D = 128 rows are two such 64-column blocks.
//  * Ordering: wgmma.fence before the first wgmma after ordinary code touched the accumulators,
//    commit_group after a batch, wait_group before reading the results; shared memory written
//    by cp.async is published to wgmma (the async proxy) by fence.proxy.async.
// A block is WGS warpgroups of 64 query rows each, BLOCKS blocks an SM; loads are stage 08's
// cp.async pipeline, so the comparison with stage 08 isolates the instruction. Softmax is stage 08's (FOLD_SCALE,
// SKIP_RESCALE). Needs sm_90a (-gencode arch=compute_90a,code=sm_90a).
#include <cmath>
#include "common.cuh"
#include "hopper.cuh"
#include "ptx.cuh"

template <int D, int BC, int WGS, int STAGES>
struct Tiles {
  static constexpr int BR = 64 * WGS;              // query rows per block
  static constexpr int THREADS = 128 * WGS;
  static constexpr int Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
  // Q + STAGES x (K, V), and 1 KiB to align the tiles: the 128-byte swizzle is a function of the
  // address bits 4-9, so every tile starts on a 1024-byte boundary.
  static constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES + 1024;
};

// Start copying rows [first, first + ROWS) of an (N, D) matrix, rows ld elements apart, into a
// 128-byte-swizzled tile (sw128); rows past N become zeros. Thread t copies chunk t % (D/8) of
// rows t / (D/8) + i * STEP; STEP is a multiple of 8, so each thread's chunks share one swizzle
// (three warpgroups copy 48 rows a step: the last step of a 128-row tile is partial).
template <int ROWS, int D, int THREADS, typename T>
__device__ __forceinline__ void load_tile_async(uint32_t dst, const T* src, int ld, int first,
                                                int N) {
  constexpr int CHUNKS = D / 8, STEP = THREADS / CHUNKS;
  static_assert(STEP % 8 == 0, "a thread's rows must share one swizzle");
  const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
  const uint32_t s0 = dst + sw128(ROWS, r, 8 * c);
#pragma unroll
  for (int i = 0; i < (ROWS + STEP - 1) / STEP; i++) {
    if (ROWS % STEP != 0 && r + i * STEP >= ROWS) break;
    const int row = first + r + i * STEP;  // rows past N: 0 bytes of the clamped last row
    cp_async_16(s0 + i * STEP * 128, src + min(row, N - 1) * ld + 8 * c, row < N ? 16 : 0);
  }
}

template <typename T, int D, int BC, int WGS, int STAGES, int BLOCKS, int RETIRE, bool WITH_LSE>
__global__ void __launch_bounds__(128 * WGS, BLOCKS)
wgmma_kernel(const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V,
             T* __restrict__ O, const FlashlabLayout L, int N, float scale_log2, int causal,
             float* __restrict__ LSE) {
  using Cfg = Tiles<D, BC, WGS, STAGES>;
  constexpr int BR = Cfg::BR, THREADS = Cfg::THREADS;
  constexpr int KD = D / 16;   // k-steps of S = Q K^T
  constexpr int KS = BC / 16;  // k-steps of O += P V
  constexpr int NS = BC / 8, NO = D / 8;  // 8-column tiles of S and O held per thread (4 floats each)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t Qs = (smem_u32(smem_raw) + 1023) & ~1023u;
  const uint32_t Ks = Qs + Cfg::Q_BYTES;              // STAGES K tiles
  const uint32_t Vs = Ks + STAGES * Cfg::KV_BYTES;    // STAGES V tiles

  // The warpgroup index as lane 0 reads it. wgmma takes its descriptors from uniform registers,
  // which hold one value for the whole warp. From threadIdx.x alone, ptxas cannot prove the index
  // (and so Q's descriptors) is the same across the warp; it then keeps the loop's descriptors,
  // K's and V's too, in ordinary registers and moves each over (R2UR) before its wgmma. Read from
  // lane 0, the index is uniform, and so are they.
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Block b: query tile b % tiles of (batch, head) b / tiles; causal blocks, which have the most
  // key tiles at the end of the sequence, start first.
  const int tiles = (N + BR - 1) / BR, bh = blockIdx.x / tiles, qt = blockIdx.x % tiles;
  const int q0 = (causal ? tiles - 1 - qt : qt) * BR;
  const int b = bh / L.H, h = bh % L.H;
  Q += b * L.q.b + h * L.q.h; K += b * L.k.b + h * L.k.h; V += b * L.v.b + h * L.v.h;

  const int last_key = causal ? min(N, q0 + BR) : N;
  const int n_tiles = (last_key + BC - 1) / BC;
  // K/V buffers: tile j lives in buffer j % STAGES. Tile j's P V is still running while tile
  // j + 1 is started, so one buffer is always held by it: loads run AHEAD = STAGES - 2 tiles ahead.
  // With RETIRE, each tile's P V retires before the next tile's barrier instead, and loads run one
  // tile further ahead: with few buffers or few tiles, waiting less for loads is worth more than
  // that overlap.
  // Before the first P V no buffer is held, so the first STAGES - 1 tiles are copied with Q.
  constexpr int AHEAD = RETIRE ? STAGES - 1 : STAGES - 2;
  static_assert(AHEAD >= 1, "wgmma_kernel needs STAGES >= 3, or STAGES >= 2 with RETIRE");
  load_tile_async<BR, D, THREADS>(Qs, Q, L.q.n, q0, N);
#pragma unroll
  for (int st = 0; st < STAGES - 1; st++) {
    if (st < n_tiles) {
      load_tile_async<BC, D, THREADS>(Ks + st * Cfg::KV_BYTES, K, L.k.n, st * BC, N);
      load_tile_async<BC, D, THREADS>(Vs + st * Cfg::KV_BYTES, V, L.v.n, st * BC, N);
    }
    cp_async_commit();
  }

  // This warpgroup's 64 rows of Q, as the A operand: 8-row groups 1024 bytes apart; k-step kk is
  // 32 bytes into 64-column block kk / 4.
  const uint32_t Qw = Qs + wg * 64 * 128;
  const int r0 = q0 + wg * 64 + warp * 16 + g;  // this thread's rows: r0 (index 0) and r0 + 8 (1)
  const int wg_last_row = q0 + wg * 64 + 63;
  float o[D / 2];  // O accumulator, m64nD: o[4d .. 4d+3] is 8-column tile d
#pragma unroll
  for (int i = 0; i < D / 2; i++) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  // This thread's copies of tile j have landed: publish them to the async proxy (wgmma), then
  // to every warp. Past this barrier every warpgroup has also retired tile j - 2's P V (at its
  // wait for S of tile j - 1; with RETIRE tile j - 1's, just before), so that tile's buffer takes
  // tile j + AHEAD. At j = 0 the tiles up to STAGES - 2 are in flight; after it, AHEAD of them.
  auto arrive_and_load = [&](int j) {
    if (RETIRE) wgmma_wait<0>();
    if (j == 0) cp_async_wait<STAGES - 2>();
    else cp_async_wait<AHEAD - 1>();
    fence_proxy_async();
    __syncthreads();
    const int next = j + AHEAD;
    if (next < STAGES - 1) return;  // copied with Q
    if (next < n_tiles) {
      load_tile_async<BC, D, THREADS>(Ks + (next % STAGES) * Cfg::KV_BYTES, K, L.k.n, next * BC, N);
      load_tile_async<BC, D, THREADS>(Vs + (next % STAGES) * Cfg::KV_BYTES, V, L.v.n, next * BC, N);
    }
    cp_async_commit();
  };
  // Causal: the tiles that start past this warpgroup's last row are masked for all of its rows;
  // it computes the ones before (n_mine), then only keeps the block's barriers and loads going.
  const int n_mine = causal ? min(n_tiles, wg_last_row / BC + 1) : n_tiles;
  int j = 0;
  for (; j < n_mine; j++) {
    const int k0 = j * BC;
    arrive_and_load(j);
    const uint32_t Kt = Ks + (j % STAGES) * Cfg::KV_BYTES;
    const uint32_t Vt = Vs + (j % STAGES) * Cfg::KV_BYTES;

    // S = Q K^T: KD wgmma of 64 x BC x 16, the first one overwriting S (accumulate = 0).
    float s[BC / 2];
    if (BLOCKS == 2 && !RETIRE) wgmma_wait<0>();  // two blocks an SM: P V retired before S (registers)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
      // BEGIN EXERCISE 09.descriptors: the descriptors of k-step kk's operands: this warpgroup's
      // 64 rows of Q (from Qw) and the tile's BC rows of K (from Kt), columns 16 kk .. 16 kk + 15.
      // Both tiles are sw128's layout: 64-column blocks one after another (BR and BC rows of 128
      // bytes), so the k-step starts in block kk / 4, 32 bytes per k-step into its rows; K-major
      // with the 128-byte swizzle: stride byte offset 1024 (8 rows), leading offset unused (16).
      const uint32_t blk = kk / 4, in_row = (kk % 4) * 32;
      const uint64_t a = wgmma_desc(Qw + blk * BR * 128 + in_row, 16, 1024);
      const uint64_t b = wgmma_desc(Kt + blk * BC * 128 + in_row, 16, 1024);
      // STUB: // TODO: every k-step reads the first 16 columns of Q and K. Step through the head dim.
      // STUB: const uint64_t a = wgmma_desc(Qw, 16, 1024), b = wgmma_desc(Kt, 16, 1024);
      // END EXERCISE 09.descriptors
      wgmma_ss<T, BC>(s, a, b, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();  // S, and the previous tile's P V issued before it: O is final up to tile j-1

    if (k0 + BC > N || (causal && k0 + BC - 1 > q0 + wg * 64)) {
#pragma unroll
      for (int n = 0; n < NS; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int key = k0 + n * 8 + 2 * t + (i & 1), row = r0 + (i >= 2 ? 8 : 0);
          if (key >= N || (causal && key > row)) s[4 * n + i] = -INFINITY;
        }
    }

    // Online softmax (stage 08's): max of the raw scores, the scale folded into exp2's FFMA.
    float alpha[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < NS; n++) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * hh], s[4 * n + 2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[hh], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[hh] = exp2_approx(m[hh] - m_use);
      m[hh] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NS; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
          float& x = s[4 * n + 2 * hh + e];
          x = exp2_approx(fmaf(x, scale_log2, -m_use));
        }
        sum += s[4 * n + 2 * hh] + s[4 * n + 2 * hh + 1];
      }
      l[hh] = fmaf(l[hh], alpha[hh], sum);
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int d = 0; d < NO; d++) {
        o[4 * d] *= alpha[0];
        o[4 * d + 1] *= alpha[0];
        o[4 * d + 2] *= alpha[1];
        o[4 * d + 3] *= alpha[1];
      }
    }

    // O += P V: P's 8-column tiles 2ks and 2ks + 1 are the A fragment of k-step ks; V's 16 keys
    // of k-step ks start 16 rows (2048 bytes) further, its 64-column blocks BC rows apart.
    uint32_t p[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      p[ks][0] = pack2<T>(s[8 * ks], s[8 * ks + 1]);
      p[ks][1] = pack2<T>(s[8 * ks + 2], s[8 * ks + 3]);
      p[ks][2] = pack2<T>(s[8 * ks + 4], s[8 * ks + 5]);
      p[ks][3] = pack2<T>(s[8 * ks + 6], s[8 * ks + 7]);
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
      wgmma_rs<T, D, 1>(o, p[ks], wgmma_desc(Vt + ks * 16 * 128, BC * 128, 1024), 1);
    wgmma_commit();  // no wait: P V runs on while the warps go on to the next tile's barrier
  }
  wgmma_wait<0>();
  for (; j < n_tiles; j++) arrive_and_load(j);

  // Normalise and write through this warp's own 16 rows of the Q tile (no other warp reads
  // them, and every wgmma that read Q has completed), then 16-byte stores of whole rows.
  float inv[2];
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    float sum = l[hh];
    // BEGIN CARRIED 05.quad_sum: stage 05's sum across the quad
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    // STUB: // TODO: sum is this lane's part of the row sum only: add up the quad's parts (05.quad_sum).
    // END CARRIED 05.quad_sum
    inv[hh] = sum > 0.f ? 1.f / sum : 0.f;
  }
  // The rows' log-sum-exps, natural log, where asked for (a backward recomputes P from them):
  // m is a row's max in log2 units and 1 / inv its sum of 2^(s - m): L = (m + log2 sum) ln 2.
  if (WITH_LSE && t == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++)
      if (r0 + 8 * hh < N)
        LSE[bh * N + r0 + 8 * hh] = (m[hh] - __log2f(inv[hh])) * 0.6931471805599453f;
  }
  uint8_t* Qp = smem_raw + (Qs - smem_u32(smem_raw));
  const int row_w = wg * 64 + warp * 16;  // the warp's first row in the tile
#pragma unroll
  for (int d = 0; d < NO; d++) {
    *reinterpret_cast<uint32_t*>(Qp + sw128(BR, row_w + g, 8 * d + 2 * t)) =
        pack2<T>(o[4 * d] * inv[0], o[4 * d + 1] * inv[0]);
    *reinterpret_cast<uint32_t*>(Qp + sw128(BR, row_w + g + 8, 8 * d + 2 * t)) =
        pack2<T>(o[4 * d + 2] * inv[1], o[4 * d + 3] * inv[1]);
  }
  __syncwarp();
  constexpr int CHUNKS = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * CHUNKS / 32; i++) {
    const int e = lane + 32 * i, r = e / CHUNKS, c = (e % CHUNKS) * 8;
    const int row = q0 + row_w + r;
    if (row < N)
      *reinterpret_cast<uint4*>(O + b * L.o.b + h * L.o.h + row * L.o.n + c) =
          *reinterpret_cast<const uint4*>(Qp + sw128(BR, row_w + r, c));
  }
}

template <typename T, int D, int BC, int WGS, int STAGES, int BLOCKS = 1, int RETIRE = 0>
static const char* launch(const FlashlabProblem* p, cudaStream_t stream) {
  using Cfg = Tiles<D, BC, WGS, STAGES>;
  // the log-sum-exp's stores only where it is asked for: without them, the kernel as it was
  auto kernel = p->lse ? wgmma_kernel<T, D, BC, WGS, STAGES, BLOCKS, RETIRE, true>
                       : wgmma_kernel<T, D, BC, WGS, STAGES, BLOCKS, RETIRE, false>;
  static_assert(smem_fits(Cfg::SMEM_BYTES, BLOCKS), "BLOCKS blocks of this shape do not fit an SM");
  FLASHLAB_TRY(flashlab_allow_smem(kernel, Cfg::SMEM_BYTES));
  dim3 grid(flashlab_cdiv(p->N, Cfg::BR) * p->B * p->H);
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(
      (const T*)p->q, (const T*)p->k, (const T*)p->v, (T*)p->o, p->layout, p->N,
      p->scale * 1.4426950408889634f, p->causal, p->lse);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

// PICK: the block shape per head dim, mask and length (keys per tile, warpgroups, buffers, blocks
// an SM, P V retired before the next barrier), measured on an H100 (tools/hopper_try.py). At
// D = 64, two blocks an SM of two warpgroups and 128-key tiles, three buffers each (113 KiB): one
// block's barriers, loads and stores run while the other's wgmma keep the tensor cores busy. In 128
// registers a thread holds S only once the last P V has retired, hence the wait before S when
// BLOCKS == 2. Under the mask below N = 2048 the tiles on the diagonal are most of the work: there
// blocks of one warpgroup with two buffers of 64 keys (41 KiB), four blocks an SM, each P V retired
// before the next barrier (RETIRE) so that loads still run a tile ahead: more, smaller blocks,
// whose starts and ends run beside the other blocks' products. At D = 128 the 128-key tiles of
// 225 KiB, one block an SM; under the mask, where a block's start and end weigh more, two blocks an
// SM of two warpgroups with 64-key tiles and two buffers (97 KiB): each P V retires before the next
// barrier (RETIRE), so loads still run a tile ahead and S fits 128 registers a thread.
template <typename T>
static const char* pick(const FlashlabProblem* p, cudaStream_t s) {
  if (p->D == 64) {
    if (p->causal && p->N < 2048) return launch<T, 64, 64, 1, 2, 4, 1>(p, s);
    return launch<T, 64, 128, 2, 3, 2>(p, s);
  }
  if (p->causal) return launch<T, 128, 64, 2, 2, 2, 1>(p, s);
  return launch<T, 128, 128, 2, 3>(p, s);
}

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F16 && p->dtype != FLASHLAB_BF16)
    return "stage 09 runs on the tensor cores in fp16 or bf16 only, not float32";
  if (p->D != 64 && p->D != 128)
    return flashlab_say("stage 09 is compiled for head dims 64 and 128, not %d", p->D);
  return nullptr;
}

extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem*) { return 0; }

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == FLASHLAB_BF16) return pick<__nv_bfloat16>(p, s);
  return pick<__half>(p, s);
}
