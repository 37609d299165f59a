// Stage 11 — warp specialization: one warpgroup only copies, the others only compute.
//
// In stage 10 one thread of the first computing warpgroup also issues the copies: it stops its
// own softmax to wait for a free buffer, and every warp is sized for the math (up to 168
// registers a thread under one block per SM, whether it needs them or not). Here the roles are
// split by warpgroup:
//  * warpgroup 0, the producer, only issues TMA copies. One elected thread walks the work:
//    Q of a work item, then its K and V tiles into the ring, waiting on `empty` barriers; the
//    other 127 threads have nothing to do. It gives registers back with setmaxnreg.dec;
//  * warpgroups 1 .. CONSUMERS only compute (64 query rows each), waiting on `full` barriers,
//    and take the producer's registers with setmaxnreg.inc: a thread may hold 232 with two
//    consumers (D = 128), 160 with three (D = 64, stage 10's three warpgroups).
//    setmaxnreg only acts when the kernel has a register cap at entry: __launch_bounds__.
// The producer runs ahead of the math as far as the buffers allow, across work items too: Q has
// two buffers, so the next item's Q lands while this one is computed, and K and V have their
// own barriers, so a K tile is refilled as soon as S has read it. O goes straight from the
// registers to global memory (the Q buffer is the next-but-one item's by then).
// The grid is persistent: one block per SM (two at D = 64 on short causal sequences, see
// pick()), each looping over work items (a batch, head and query tile). The producer claims the
// next item from a counter in global memory (atomicAdd) and hands it to the consumers through
// shared memory with Q's barrier, so a block that drew short causal items simply draws more.
// The consumers' math is stage 10's, and so is its skip: under the causal mask a consumer runs
// only the key tiles its own rows need, and hands the item's later tiles back unread.
#include <algorithm>
#include <cmath>
#include "common.cuh"
#include "hopper.cuh"
#include "hopper_host.cuh"  // make_map (the tensor maps), sm_count
#include "ptx.cuh"

template <int D, int BC, int STAGES, int CONSUMERS_, int BLOCKS_>
struct Tiles {
  static constexpr int CONSUMERS = CONSUMERS_;     // warpgroups that compute, 64 rows each
  static constexpr int BLOCKS = BLOCKS_;           // blocks an SM
  static constexpr int BR = 64 * CONSUMERS;        // query rows per work item
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
  // 2 x Q + STAGES x (K, V) on 1024-byte boundaries, then the mbarriers and the 2 item indices.
  static constexpr int BARRIERS = 4 + 4 * STAGES;  // q_full[2], q_empty[2], k/v_full[], k/v_empty[]
  static constexpr int SMEM_BYTES = 2 * Q_BYTES + 2 * STAGES * KV_BYTES + 8 * BARRIERS + 8 + 1024;
  // Registers per thread after setmaxnreg, in multiples of 8. setmaxnreg moves registers within
  // the block: it starts with the launch cap for every thread, 65536 / BLOCKS / THREADS rounded
  // down to a multiple of 8 (168 for one block of three warpgroups, 128 of four, 80 for each of
  // two blocks of three). The consumers share what the producer leaves: 232 each for two
  // consumers (the producer keeps 40, what its loop needs at D = 128 without spilling); for
  // three, the producer gives up all but 32 so that each consumer gets 160 (with 152 ptxas
  // serializes the wgmma, C7512; 160 is enough at D = 64, not at D = 128); with two blocks an
  // SM, 32 again, and each consumer gets 104.
  static constexpr int ENTRY_REGS = 65536 / BLOCKS / THREADS / 8 * 8;
  static constexpr int PRODUCER_REGS = CONSUMERS == 3 || BLOCKS == 2 ? 32 : 40;
  static constexpr int CONSUMER_REGS = (ENTRY_REGS * (1 + CONSUMERS) - PRODUCER_REGS) / CONSUMERS / 8 * 8;
  static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= ENTRY_REGS * (1 + CONSUMERS),
                "more registers than the block has");
};

// The tensor maps of q, k and v (stage 10's).
struct Maps {
  CUtensorMap q, k, v;
};

// Copy rows [row, row + ROWS) of (batch b, head h) into a tile (stage 10's).
template <int ROWS, int D>
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap& map, uint32_t bar,
                                         int row, int h, int b, int3 order) {
  // BEGIN CARRIED 10.tma_tile: stage 10's boxes, unchanged
  auto at = [&](int k) { return order.x == k ? row : order.y == k ? h : b; };
#pragma unroll
  for (int blk = 0; blk < D / 64; blk++)
    tma_load_4d(dst + blk * ROWS * 128, &map, bar, blk * 64, at(1), at(2), at(3));
  // END CARRIED 10.tma_tile
}

// Work item `item` of `tiles` query tiles per head: its batch x head index bh and first row q0.
__device__ __forceinline__ void work_tile(int item, int tiles, int causal, int BR, int& bh,
                                          int& q0) {
  // BEGIN EXERCISE 11.work_tile: the items of one head are consecutive (blocks working at the
  // same time read the same K and V, which stay in L2); under the causal mask a head's last
  // query tile, the longest (it reads every key tile), comes first, so that the items left
  // at the end of the launch are the short ones.
  bh = item / tiles;
  const int qt = item % tiles;
  q0 = (causal ? tiles - 1 - qt : qt) * BR;
  // STUB: // TODO: every item computes the first query tile of the first head.
  // STUB: bh = 0;
  // STUB: q0 = 0;
  // STUB: (void)item; (void)tiles; (void)causal; (void)BR;
  // END EXERCISE 11.work_tile
}

template <typename T, int D, int BC, int STAGES, int CONSUMERS, int BLOCKS, bool WITH_LSE>
__global__ void __launch_bounds__(Tiles<D, BC, STAGES, CONSUMERS, BLOCKS>::THREADS, BLOCKS)
warpspec_kernel(const __grid_constant__ Maps maps, T* __restrict__ O, const FlashlabLayout L,
                int N, int BH, float scale_log2, int causal, const int3 order_q,
                const int3 order_kv, int* __restrict__ next_item, float* __restrict__ LSE) {
  using Cfg = Tiles<D, BC, STAGES, CONSUMERS, BLOCKS>;
  constexpr int BR = Cfg::BR;
  constexpr int KD = D / 16;   // k-steps of S = Q K^T
  constexpr int KS = BC / 16;  // k-steps of O += P V
  constexpr int NS = BC / 8, NO = D / 8;  // 8-column tiles of S and O held per thread
  extern __shared__ uint8_t smem_raw[];
  const uint32_t Qs = (smem_u32(smem_raw) + 1023) & ~1023u;  // 2 Q tiles
  const uint32_t Ks = Qs + 2 * Cfg::Q_BYTES;                 // STAGES K tiles
  const uint32_t Vs = Ks + STAGES * Cfg::KV_BYTES;           // STAGES V tiles
  const uint32_t q_full = Vs + STAGES * Cfg::KV_BYTES, q_empty = q_full + 16;  // mbarriers
  const uint32_t k_full = q_empty + 16, v_full = k_full + 8 * STAGES;
  const uint32_t k_empty = v_full + 8 * STAGES, v_empty = k_empty + 8 * STAGES;
  int* work = reinterpret_cast<int*>(smem_raw + (v_empty + 8 * STAGES - smem_u32(smem_raw)));
  const int tiles = (N + BR - 1) / BR, items = tiles * BH;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; s++) {
      mbar_init(q_full + 8 * s, 1);                      // the producer's arrive(.expect_tx)
      mbar_init(q_empty + 8 * s, 4 * CONSUMERS);         // one arrival per consumer warp
    }
    for (int s = 0; s < STAGES; s++) {
      mbar_init(k_full + 8 * s, 1);
      mbar_init(v_full + 8 * s, 1);
      mbar_init(k_empty + 8 * s, 4 * CONSUMERS);
      mbar_init(v_empty + 8 * s, 4 * CONSUMERS);
    }
    fence_mbar_init();
  }
  __syncthreads();  // the barriers exist before anyone waits on them; the roles split here

  if (wg == 0) {  // ---- the producer
    setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      tma_prefetch_map(&maps.q);
      tma_prefetch_map(&maps.k);
      tma_prefetch_map(&maps.v);
      int ring = 0, item = blockIdx.x;  // a block's first item is its own; the rest it claims
      for (int it = 0;; it++) {
        const int slot = it & 1;  // item it's Q buffer, free once item it - 2 has been stored
        if (it >= 2) mbar_wait(q_empty + 8 * slot, ((it >> 1) - 1) & 1);
        work[slot] = item < items ? item : -1;  // published by the arrive below
        if (item >= items) {
          mbar_arrive(q_full + 8 * slot);  // no bytes: the consumers wake, read -1 and stop
          break;
        }
        int bh, q0;
        work_tile(item, tiles, causal, BR, bh, q0);
        const int b = bh / L.H, h = bh % L.H;
        const int last_key = causal ? min(N, q0 + BR) : N, n_tiles = (last_key + BC - 1) / BC;
        mbar_arrive_expect_tx(q_full + 8 * slot, Cfg::Q_BYTES);
        tma_tile<BR, D>(Qs + slot * Cfg::Q_BYTES, maps.q, q_full + 8 * slot, q0, h, b, order_q);
        // K and V in the order the consumers need them: K_0, then K_j with V_{j-1} (a consumer
        // multiplies P_{j-1} V_{j-1} right after S_j), then the last V.
        auto load = [&](uint32_t tiles_at, uint32_t full, uint32_t empty, const CUtensorMap& map,
                        int j) {
          const int r = ring + j, buf = r % STAGES;
          if (r >= STAGES) mbar_wait(empty + 8 * buf, (r / STAGES - 1) & 1);  // slot released
          mbar_arrive_expect_tx(full + 8 * buf, Cfg::KV_BYTES);
          tma_tile<BC, D>(tiles_at + buf * Cfg::KV_BYTES, map, full + 8 * buf, j * BC, h, b, order_kv);
        };
        for (int j = 0; j < n_tiles; j++) {
          load(Ks, k_full, k_empty, maps.k, j);
          if (j > 0) load(Vs, v_full, v_empty, maps.v, j - 1);
        }
        load(Vs, v_full, v_empty, maps.v, n_tiles - 1);
        ring += n_tiles;
        item = gridDim.x + atomicAdd(next_item, 1);  // claimed after the copies: one register fewer
      }
    }
    return;
  }

  // ---- the consumers: stage 10's math on 64 rows each, item after item
  setmaxnreg_inc<Cfg::CONSUMER_REGS>();
  const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;  // uniform: see stage 09
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // The work item being computed: its Q buffer (slot), batch x head, first row, K/V tiles, and
  // this thread's rows r0 and r0 + 8. begin_item waits for the next one's Q, and its index.
  int it = 0, slot = 0, bh = 0, q0 = 0, n_tiles = 0, n_mine = 0, r0 = 0, wg_row0 = 0;
  uint32_t Qw = 0;
  auto begin_item = [&]() -> bool {
    slot = it & 1;
    mbar_wait(q_full + 8 * slot, (it >> 1) & 1);
    const int item = work[slot];
    if (item < 0) return false;
    work_tile(item, tiles, causal, BR, bh, q0);
    const int last_key = causal ? min(N, q0 + BR) : N;
    n_tiles = (last_key + BC - 1) / BC;
    r0 = q0 + cw * 64 + warp * 16 + g;
    wg_row0 = q0 + cw * 64;
    // Under the mask this warpgroup's 64 rows need only the keys up to its own last row: with
    // 192-row items, the first consumers' rows end one 128-key tile before the item's do.
    // (The trip count differs between warpgroups but not within one: cw is uniform.)
    n_mine = causal ? min(n_tiles, (min(N, wg_row0 + 64) + BC - 1) / BC) : n_tiles;
    Qw = Qs + slot * Cfg::Q_BYTES + cw * 64 * 128;
    it++;
    return true;
  };

  float o[D / 2];              // O accumulator, m64nD: o[4d .. 4d+3] is 8-column tile d
  float m[2], l[2], alpha[2];  // running max and sum of rows r0, r0 + 8; O's rescale factor
  uint32_t p[KS][4];           // P as the A fragments of O += P V

  // Stage 10's steps, each named: the mask and online softmax of a tile of S (alpha: the
  // factor O must take before P V is added), P packed to 16 bits, the two products with their
  // descriptors (an address field in 16-byte units: a k-step's descriptor is the tile's first
  // plus its offset >> 4), and the normalised store of O.
  auto softmax = [&](float (&s)[BC / 2], int k0) {
    if (k0 + BC > N || (causal && k0 + BC - 1 > wg_row0)) {
#pragma unroll
      for (int n = 0; n < NS; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int key = k0 + n * 8 + 2 * t + (i & 1), row = r0 + (i >= 2 ? 8 : 0);
          if (key >= N || (causal && key > row)) s[4 * n + i] = -INFINITY;
        }
    }
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
  };
  auto pack = [&](const float (&s)[BC / 2]) {
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      p[ks][0] = pack2<T>(s[8 * ks], s[8 * ks + 1]);
      p[ks][1] = pack2<T>(s[8 * ks + 2], s[8 * ks + 3]);
      p[ks][2] = pack2<T>(s[8 * ks + 4], s[8 * ks + 5]);
      p[ks][3] = pack2<T>(s[8 * ks + 6], s[8 * ks + 7]);
    }
  };
  auto qk = [&](float (&s)[BC / 2], int buf) {
    const uint64_t dq = wgmma_desc(Qw, 16, 1024);
    const uint64_t dk = wgmma_desc(Ks + buf * Cfg::KV_BYTES, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
      // BEGIN CARRIED 09.descriptors: stage 09's descriptors, as offsets added to the loop's base descriptors
      const uint32_t blk = kk / 4, in_row = (kk % 4) * 32;
      wgmma_ss<T, BC>(s, dq + ((blk * BR * 128 + in_row) >> 4),
                      dk + ((blk * BC * 128 + in_row) >> 4), kk > 0);
      // STUB: // TODO: every k-step reads the first 16 columns of Q and K (09.descriptors: the start
      // STUB: // address moves by blk * rows * 128 + in_row bytes, added to dq and dk in 16-byte units).
      // STUB: wgmma_ss<T, BC>(s, dq, dk, kk > 0);
      // END CARRIED 09.descriptors
    }
  };
  auto pv = [&](int buf) {
    const uint64_t dv = wgmma_desc(Vs + buf * Cfg::KV_BYTES, BC * 128, 1024);
#pragma unroll
    for (int ks = 0; ks < KS; ks++) wgmma_rs<T, D, 1>(o, p[ks], dv + ((ks * 16 * 128) >> 4), 1);
  };
  // O / l of a finished item, rows r and r + 8 of (batch x head) bh_done, from registers.
  auto store = [&](int bh_done, int r, const float (&l_done)[2]) {
    float inv[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      float sum = l_done[hh];
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
        if (r + 8 * hh < N)
          LSE[bh_done * N + r + 8 * hh] = (m[hh] - __log2f(inv[hh])) * 0.6931471805599453f;
    }
    T* Ob = O + (bh_done / L.H) * L.o.b + (bh_done % L.H) * L.o.h;
#pragma unroll
    for (int d = 0; d < NO; d++) {
      if (r < N)
        *reinterpret_cast<uint32_t*>(Ob + r * L.o.n + 8 * d + 2 * t) =
            pack2<T>(o[4 * d] * inv[0], o[4 * d + 1] * inv[0]);
      if (r + 8 < N)
        *reinterpret_cast<uint32_t*>(Ob + (r + 8) * L.o.n + 8 * d + 2 * t) =
            pack2<T>(o[4 * d + 2] * inv[1], o[4 * d + 3] * inv[1]);
    }
  };

  int ring = 0;
  while (begin_item()) {
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    int j = 0;
    for (; j < n_mine; j++, ring++) {
      const int buf = ring % STAGES;
      float s[BC / 2];
      mbar_wait(k_full + 8 * buf, (ring / STAGES) & 1);
      // With two blocks an SM a consumer has 104 registers: too few to hold S while P_{j-1} V_{j-1}
      // still reads P from them (ptxas would serialize every wgmma, C7512). So it retires that
      // product first; the other block's warpgroups keep the tensor cores busy meanwhile.
      if (BLOCKS == 2) wgmma_wait<0>();
      wgmma_fence();
      qk(s, buf);
      wgmma_commit();
      wgmma_wait<0>();  // S_j, and the P V of tile j-1 before it
      // K_j and V_{j-1} are no longer read; after the item's last S, neither is its Q buffer.
      if (lane == 0) {
        mbar_arrive(k_empty + 8 * buf);
        if (j > 0) mbar_arrive(v_empty + 8 * ((ring - 1) % STAGES));
        if (j == n_mine - 1) mbar_arrive(q_empty + 8 * slot);
      }
      softmax(s, j * BC);
#pragma unroll
      for (int d = 0; d < NO; d++) {
        o[4 * d] *= alpha[0];
        o[4 * d + 1] *= alpha[0];
        o[4 * d + 2] *= alpha[1];
        o[4 * d + 3] *= alpha[1];
      }
      pack(s);
      mbar_wait(v_full + 8 * buf, (ring / STAGES) & 1);
      wgmma_fence();
      pv(buf);
      wgmma_commit();  // no wait: P V runs on while the warps go on to the next tile
    }
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(v_empty + 8 * ((ring - 1) % STAGES));
    store(bh, r0, l);
    // The item's tiles past this warpgroup's rows go back unread. Each waits for its data first:
    // the producer refilled that buffer only once every consumer had released its previous use,
    // so this arrival counts toward this use, not the one before.
    for (; j < n_tiles; j++, ring++) {
      const int buf = ring % STAGES;
      mbar_wait(k_full + 8 * buf, (ring / STAGES) & 1);
      mbar_wait(v_full + 8 * buf, (ring / STAGES) & 1);
      if (lane == 0) {
        mbar_arrive(k_empty + 8 * buf);
        mbar_arrive(v_empty + 8 * buf);
      }
    }
  }
}

template <typename T, int D, int BC, int STAGES, int CONSUMERS, int BLOCKS = 1>
static const char* launch(const FlashlabProblem* p, cudaStream_t stream) {
  using Cfg = Tiles<D, BC, STAGES, CONSUMERS, BLOCKS>;
  // the log-sum-exp's stores only where it is asked for: without them, the kernel as it was
  auto kernel = p->lse ? warpspec_kernel<T, D, BC, STAGES, CONSUMERS, BLOCKS, true>
                       : warpspec_kernel<T, D, BC, STAGES, CONSUMERS, BLOCKS, false>;
  Maps maps;
  int3 oq, ok, ov;
  const char* err;
  if ((err = make_map(&maps.q, p->q, p->dtype, p, p->layout.q, Cfg::BR, &oq))) return err;
  if ((err = make_map(&maps.k, p->k, p->dtype, p, p->layout.k, BC, &ok))) return err;
  if ((err = make_map(&maps.v, p->v, p->dtype, p, p->layout.v, BC, &ov))) return err;
  if (ok.x != ov.x || ok.y != ov.y || ok.z != ov.z)
    return "stage 11 needs k and v with strides in the same order";
  static_assert(smem_fits(Cfg::SMEM_BYTES, BLOCKS), "BLOCKS blocks of this shape do not fit an SM");
  FLASHLAB_TRY(flashlab_allow_smem(kernel, Cfg::SMEM_BYTES));
  FLASHLAB_TRY(cudaMemsetAsync(p->workspace, 0, sizeof(int), stream));  // the work counter
  const long long items = (long long)flashlab_cdiv(p->N, Cfg::BR) * p->B * p->H;
  dim3 grid((unsigned)std::min<long long>(items, (long long)BLOCKS * sm_count()));
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(
      maps, (T*)p->o, p->layout, p->N, p->B * p->H, p->scale * 1.4426950408889634f, p->causal,
      oq, ok, (int*)p->workspace, p->lse);
  FLASHLAB_TRY(cudaGetLastError());
  return nullptr;
}

// PICK: the shape per head dim, mask and sequence length (keys per tile, K/V buffers, consumer
// warpgroups, blocks an SM), measured on an H100 (tools/hopper_try.py). Two consumers of 64 rows
// and 128-key tiles, as many buffers as fit, except at D = 64: three consumers (192 rows an item,
// stage 10's three warpgroups) with four buffers, so a third softmax runs while the tensor cores
// would wait. Under the mask below N = 2048 an item has only a few key tiles: there two blocks an
// SM of two consumers each, with 64-key tiles (stage 10's shape there), so that one block's first
// loads and last stores overlap the other's products.
template <typename T>
static const char* pick(const FlashlabProblem* p, cudaStream_t s) {
  if (p->D == 64) {
    if (p->causal && p->N < 2048) return launch<T, 64, 64, 4, 2, 2>(p, s);
    return launch<T, 64, 128, 4, 3>(p, s);
  }
  return launch<T, 128, 128, 2, 2>(p, s);
}

extern "C" const char* flashlab_unsupported(const FlashlabProblem* p) {
  if (p->dtype != FLASHLAB_F16 && p->dtype != FLASHLAB_BF16)
    return "stage 11 runs on the tensor cores in fp16 or bf16 only, not float32";
  if (p->D != 64 && p->D != 128)
    return flashlab_say("stage 11 is compiled for head dims 64 and 128, not %d", p->D);
  return nullptr;
}

// The work counter the producers claim items from.
extern "C" size_t flashlab_workspace_bytes(const FlashlabProblem*) { return sizeof(int); }

extern "C" const char* flashlab_launch(const FlashlabProblem* p, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == FLASHLAB_BF16) return pick<__nv_bfloat16>(p, s);
  return pick<__half>(p, s);
}
