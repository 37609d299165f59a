// Stage 10 — TMA and mbarrier: one thread copies whole tiles, and warps wait on barriers in memory.
//
// In stage 09 every thread of the block issues cp.async copies of 16 bytes (for a 128-key tile at
// D = 128, 16 copies and their address arithmetic per thread, per tile), and the whole block
// meets at __syncthreads before each tile: the fastest warpgroup waits for the slowest.
// Hopper's tensor memory accelerator (TMA) copies a whole box of a tensor — here 64 columns x
// BC rows — described by a tensor map built once on the host (cuTensorMapEncodeTiled): one
// instruction, cp.async.bulk.tensor, from one elected thread, and the copy engine computes the
// addresses, fills rows past the end with zeros and writes the 128-byte swizzle wgmma reads.
// Completion is counted by an mbarrier, a 64-bit object in shared memory: the issuing thread
// tells it how many bytes to expect (arrive.expect_tx), the copy engine counts them in, and
// the barrier's phase flips when all have arrived; a warp waits for the phase by its parity.
//  * full[b]: tile data in buffer b has landed (1 arrival + the tile's bytes);
//  * empty[b]: every warp has retired the wgmma that read buffer b (one arrival per warp), so
//    the elected thread may refill it. The ring of STAGES buffers wraps, and each barrier is
//    waited on with the parity of its round: (tile / STAGES) & 1.
// No __syncthreads remains in the loop: each warpgroup runs at its own pace, up to the ring's
// slack ahead of the other. Everything else is stage 09.
#include <cmath>
#include "common.cuh"
#include "hopper.cuh"
#include "hopper_host.cuh"  // make_map: the tensor maps
#include "ptx.cuh"

template <int D, int BC, int WGS, int STAGES>
struct Tiles {
  static constexpr int BR = 64 * WGS;              // query rows per block
  static constexpr int THREADS = 128 * WGS;
  static constexpr int Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
  // Q + STAGES x (K, V) on 1024-byte boundaries (the 128-byte swizzle). The mbarriers take no
  // bytes of their own: they sit in the 1 KiB kept for the alignment, before Q where the padding
  // leaves room for them, else after the last V tile. Two blocks of 113 KiB then fit an SM.
  static constexpr int BARRIERS = 1 + 2 * STAGES;  // q_full, full[STAGES], empty[STAGES]
  static_assert(2 * 8 * BARRIERS <= 1024, "the mbarriers fit the alignment's padding");
  static constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES + 1024;
};

// The tensor maps of q, k and v: 4-D (D, N, H, B) with their own strides, a box of 64 columns
// (128 bytes, the most a 128-byte swizzle takes) by ROWS rows.
struct Maps {
  CUtensorMap q, k, v;
};

// Copy rows [row, row + ROWS) of (batch b, head h) into a tile: D/64 boxes of ROWS x 64, one
// after another (sw128's layout), their bytes counted on `bar`.
template <int ROWS, int D>
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                         int row, int h, int b, int3 order) {
  // BEGIN EXERCISE 10.tma_tile: the D/64 boxes of one tile: box blk holds columns 64 blk ..
  // 64 blk + 63 of rows [row, row + ROWS) and lands ROWS * 128 bytes after the one before. The
  // map's coordinates are (column, then its dims 1-3), and `order` says which of dims 1-3 are
  // the rows, the heads and the batches (sorted by stride on the host).
  auto at = [&](int k) { return order.x == k ? row : order.y == k ? h : b; };
#pragma unroll
  for (int blk = 0; blk < D / 64; blk++)
    tma_load_4d(dst + blk * ROWS * 128, &map, bar, blk * 64, at(1), at(2), at(3));
  // STUB: // TODO: every box copies the first 64 columns of batch 0, head 0, rows 0 .. ROWS - 1.
  // STUB: for (int blk = 0; blk < D / 64; blk++) tma_load_4d(dst + blk * ROWS * 128, &map, bar, 0, 0, 0, 0);
  // STUB: (void)row; (void)h; (void)b; (void)order;
  // END EXERCISE 10.tma_tile
}

template <typename T, int D, int BC, int WGS, int STAGES, int BLOCKS, int RETIRE, bool WITH_LSE>
__global__ void __launch_bounds__(128 * WGS, BLOCKS)
tma_kernel(const __grid_constant__ Maps maps, T* __restrict__ O, const FlashlabLayout L,
           int N, float scale_log2, int causal, const int3 order_q, const int3 order_kv,
           float* __restrict__ LSE) {
  using Cfg = Tiles<D, BC, WGS, STAGES>;
  constexpr int BR = Cfg::BR;
  constexpr int KD = D / 16;   // k-steps of S = Q K^T
  constexpr int KS = BC / 16;  // k-steps of O += P V
  constexpr int NS = BC / 8, NO = D / 8;  // 8-column tiles of S and O held per thread (4 floats each)
  extern __shared__ __align__(16) uint8_t smem_raw[];  // 16-byte aligned: the mbarriers need 8
  const uint32_t base = smem_u32(smem_raw), Qs = (base + 1023) & ~1023u;
  const uint32_t Ks = Qs + Cfg::Q_BYTES;              // STAGES K tiles
  const uint32_t Vs = Ks + STAGES * Cfg::KV_BYTES;    // STAGES V tiles
  // mbarriers, 8 bytes each: before Q, or after V when the padding before Q is shorter than them
  // (the padding is under 1024 bytes, so what is left of it after V holds them then).
  const uint32_t q_full = Qs - base >= 8 * Cfg::BARRIERS ? base : Vs + STAGES * Cfg::KV_BYTES;
  const uint32_t full = q_full + 8, empty = full + 8 * STAGES;

  const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);  // uniform: see stage 09
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int tiles = (N + BR - 1) / BR, bh = blockIdx.x / tiles, qt = blockIdx.x % tiles;
  const int q0 = (causal ? tiles - 1 - qt : qt) * BR;
  const int b = bh / L.H, h = bh % L.H;

  const int last_key = causal ? min(N, q0 + BR) : N;
  const int n_tiles = (last_key + BC - 1) / BC;
  // As in stage 09, tile j's P V still reads buffer j % STAGES while tile j + 1 starts: loads run
  // AHEAD = STAGES - 2 tiles ahead, or STAGES - 1 with RETIRE, where each warp retires tile j's
  // P V and releases its buffer before it waits for tile j + 1. The first STAGES - 1 tiles are
  // copied with Q.
  constexpr int AHEAD = RETIRE ? STAGES - 1 : STAGES - 2;
  static_assert(AHEAD >= 1, "tma_kernel needs STAGES >= 3, or STAGES >= 2 with RETIRE");
  const bool elected = threadIdx.x == 0;  // the one thread that issues every copy
  if (elected) {
    tma_prefetch_map(&maps.q);
    tma_prefetch_map(&maps.k);
    tma_prefetch_map(&maps.v);
    mbar_init(q_full, 1);
    for (int s = 0; s < STAGES; s++) {
      mbar_init(full + 8 * s, 1);            // the elected thread's arrive.expect_tx
      mbar_init(empty + 8 * s, 4 * WGS);     // one arrival per warp
    }
    fence_mbar_init();
  }
  __syncthreads();  // the barriers exist before anyone waits on them
  if (elected) {
    mbar_arrive_expect_tx(q_full, Cfg::Q_BYTES);
    tma_tile<BR, D>(Qs, maps.q, q_full, q0, h, b, order_q);
    for (int st = 0; st < STAGES - 1 && st < n_tiles; st++) {
      mbar_arrive_expect_tx(full + 8 * st, 2 * Cfg::KV_BYTES);
      tma_tile<BC, D>(Ks + st * Cfg::KV_BYTES, maps.k, full + 8 * st, st * BC, h, b, order_kv);
      tma_tile<BC, D>(Vs + st * Cfg::KV_BYTES, maps.v, full + 8 * st, st * BC, h, b, order_kv);
    }
  }

  const uint32_t Qw = Qs + wg * 64 * 128;
  const int r0 = q0 + wg * 64 + warp * 16 + g;  // this thread's rows: r0 (index 0) and r0 + 8 (1)
  const int wg_last_row = q0 + wg * 64 + 63;
  float o[D / 2];  // O accumulator, m64nD: o[4d .. 4d+3] is 8-column tile d
#pragma unroll
  for (int i = 0; i < D / 2; i++) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  mbar_wait(q_full, 0);

  // While tile j's S is computed, the elected thread refills the buffer of tile j + AHEAD - STAGES
  // with tile j + AHEAD (unless it came with Q), once every warp has released it.
  auto refill = [&](int j) {
    if (elected && j + AHEAD < n_tiles && j + AHEAD >= STAGES - 1) {
      const int next = j + AHEAD, nb = next % STAGES;
      if (next >= STAGES) mbar_wait(empty + 8 * nb, (next / STAGES - 1) & 1);
      mbar_arrive_expect_tx(full + 8 * nb, 2 * Cfg::KV_BYTES);
      tma_tile<BC, D>(Ks + nb * Cfg::KV_BYTES, maps.k, full + 8 * nb, next * BC, h, b, order_kv);
      tma_tile<BC, D>(Vs + nb * Cfg::KV_BYTES, maps.v, full + 8 * nb, next * BC, h, b, order_kv);
    }
    __syncwarp();
  };
  // Causal: the tiles that start past this warpgroup's last row are masked for all of its rows;
  // it computes the ones before (n_mine), then only waits for and releases the rest (below).
  const int n_mine = causal ? min(n_tiles, wg_last_row / BC + 1) : n_tiles;
  int j = 0;
  for (; j < n_mine; j++) {
    const int k0 = j * BC, buf = j % STAGES;
    float s[BC / 2];
    if (RETIRE) {  // tile j - 1's P V retired: its buffer is free before tile j is waited for
      wgmma_wait<0>();
      if (j > 0 && lane == 0) mbar_arrive(empty + 8 * ((j - 1) % STAGES));
    }
    mbar_wait(full + 8 * buf, (j / STAGES) & 1);  // tile j has landed
    const uint32_t Kt = Ks + buf * Cfg::KV_BYTES;
    if (BLOCKS == 2 && !RETIRE) wgmma_wait<0>();  // two blocks an SM: P V retired before S (registers)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
      // BEGIN CARRIED 09.descriptors: stage 09's descriptors, passed straight to the wgmma
      const uint32_t blk = kk / 4, in_row = (kk % 4) * 32;  // as stage 09
      wgmma_ss<T, BC>(s, wgmma_desc(Qw + blk * BR * 128 + in_row, 16, 1024),
                      wgmma_desc(Kt + blk * BC * 128 + in_row, 16, 1024), kk > 0);
      // STUB: // TODO: every k-step reads the first 16 columns of Q and K (09.descriptors).
      // STUB: wgmma_ss<T, BC>(s, wgmma_desc(Qw, 16, 1024), wgmma_desc(Kt, 16, 1024), kk > 0);
      // END CARRIED 09.descriptors
    }
    wgmma_commit();
    refill(j);
    wgmma_wait<0>();  // S, and the previous tile's P V issued before it: O is final up to tile j-1
    // Tile j - 1 is no longer read by this warp: release its buffer.
    if (!RETIRE && j > 0 && lane == 0) mbar_arrive(empty + 8 * ((j - 1) % STAGES));
    const uint32_t Vt = Vs + buf * Cfg::KV_BYTES;

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
  // The tiles past this warpgroup's rows: it still waits for each, so that it never runs a whole
  // ring ahead of the other warpgroups and its releases count toward the right phase.
  for (; j < n_tiles; j++) {
    mbar_wait(full + 8 * (j % STAGES), (j / STAGES) & 1);
    refill(j);
    if (j > 0 && lane == 0) mbar_arrive(empty + 8 * ((j - 1) % STAGES));
  }

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
  uint8_t* Qp = smem_raw + (Qs - base);
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
  auto kernel = p->lse ? tma_kernel<T, D, BC, WGS, STAGES, BLOCKS, RETIRE, true>
                       : tma_kernel<T, D, BC, WGS, STAGES, BLOCKS, RETIRE, false>;
  Maps maps;
  int3 oq, ok, ov;
  const char* err;
  if ((err = make_map(&maps.q, p->q, p->dtype, p, p->layout.q, Cfg::BR, &oq))) return err;
  if ((err = make_map(&maps.k, p->k, p->dtype, p, p->layout.k, BC, &ok))) return err;
  if ((err = make_map(&maps.v, p->v, p->dtype, p, p->layout.v, BC, &ov))) return err;
  if (ok.x != ov.x || ok.y != ov.y || ok.z != ov.z)
    return "stage 10 needs k and v with strides in the same order";
  static_assert(smem_fits(Cfg::SMEM_BYTES, BLOCKS), "BLOCKS blocks of this shape do not fit an SM");
  FLASHLAB_TRY(flashlab_allow_smem(kernel, Cfg::SMEM_BYTES));
  dim3 grid(flashlab_cdiv(p->N, Cfg::BR) * p->B * p->H);
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(
      maps, (T*)p->o, p->layout, p->N, p->scale * 1.4426950408889634f, p->causal, oq, ok, p->lse);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

// PICK: the block shape per head dim, mask and length (keys per tile, warpgroups, buffers, blocks
// an SM, P V retired before the next tile), measured on an H100 (tools/hopper_try.py). Stage 09's
// shapes where they fit: at D = 64, two blocks an SM of two warpgroups and 128-key tiles (the
// mbarriers in the alignment's padding, so that two fit), and under the mask below N = 1024 four
// blocks an SM of one warpgroup with two buffers of 64 keys, each P V retired before the next tile
// (stage 09 keeps that shape to N = 2048; here the 128-key tiles are as fast from N = 1024). At
// D = 128 the 128-key tiles of two warpgroups, one block an SM, except under the mask below
// N = 8192: there stage 09's two blocks an SM of two warpgroups with 64-key tiles and two buffers,
// each P V retired before the next tile.
template <typename T>
static const char* pick(const FlashlabProblem* p, cudaStream_t s) {
  if (p->D == 64) {
    if (p->causal && p->N < 1024) return launch<T, 64, 64, 1, 2, 4, 1>(p, s);
    return launch<T, 64, 128, 2, 3, 2>(p, s);
  }
  if (p->causal && p->N < 8192) return launch<T, 128, 64, 2, 2, 2, 1>(p, s);
  return launch<T, 128, 128, 2, 3>(p, s);
}

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F16 && p->dtype != FLASHLAB_BF16)
    return "stage 10 runs on the tensor cores in fp16 or bf16 only, not float32";
  if (p->D != 64 && p->D != 128)
    return flashlab_say("stage 10 is compiled for head dims 64 and 128, not %d", p->D);
  return nullptr;
}

extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem*) { return 0; }

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == FLASHLAB_BF16) return pick<__nv_bfloat16>(p, s);
  return pick<__half>(p, s);
}
