// Inline-PTX wrappers for the Hopper stages (09 onwards): warpgroup MMA (wgmma, sm_90a), its
// shared-memory matrix descriptors, mbarriers, the tensor memory accelerator (TMA, sm_90), a
// warpgroup's register allocation (setmaxnreg, sm_90a) and named barriers. One instruction per
// wrapper, named after it, so a kernel reads like the PTX ISA's own description: "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate Instructions" (wgmma), "Parallel Synchronization
// and Communication Instructions: mbarrier" and "... bar", "Data Movement and Conversion
// Instructions: cp.async.bulk.tensor" and "Miscellaneous Instructions: setmaxnreg".
// The lesson modules draw the layouts (flashlab/wgmma.py the descriptors and the swizzle,
// flashlab/tma.py the boxes and the ring). The host's side of the TMA (tensor maps) is in
// hopper_host.cuh.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

// ---- Blocks an SM: an sm_90 SM has 228 KiB of shared memory and keeps 1 KiB of it for each
// resident block (CUDA C++ Programming Guide, compute capability 9.0). A shape that pick() runs
// BLOCKS blocks an SM must fit them all: a byte over, and the GPU quietly runs one block fewer.
constexpr int SM90_SMEM_BYTES = 228 * 1024, SM90_SMEM_RESERVED_PER_BLOCK = 1024;
constexpr bool smem_fits(int smem_bytes, int blocks) {
  return blocks * (smem_bytes + SM90_SMEM_RESERVED_PER_BLOCK) <= SM90_SMEM_BYTES;
}

// ---- wgmma: a warpgroup (4 consecutive warps, 128 threads) multiplies 64 x N x 16 per instruction

// The 64-bit shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4          bits 32-45  stride-dimension byte offset >> 4
//   bits 16-29  leading-dimension byte offset >> 4
//   bits 49-51  base offset (0: every tile here starts on a 1024-byte boundary)
//   bits 62-63  swizzle mode: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
// Every operand here is 128-byte swizzled: rows of 64 b16 elements (128 bytes), eight rows (1024
// bytes) to a swizzle atom, and the 16-byte chunk c of row r stored at chunk c ^ (r % 8), the XOR
// of stage 06 done by the hardware on the address bits. K-major operands (Q and K: the reduction
// dim is contiguous) use the stride byte offset between 8-row groups (1024) and ignore the leading
// offset; MN-major ones (V, read transposed) also use the leading offset, between 64-column blocks.
constexpr int WGMMA_SWIZZLE_128B = 1;

__host__ __device__ constexpr uint64_t wgmma_desc(uint32_t smem_addr, uint32_t lead_bytes,
                                                  uint32_t stride_bytes) {
  return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | (uint64_t)((lead_bytes & 0x3FFFF) >> 4) << 16 |
         (uint64_t)((stride_bytes & 0x3FFFF) >> 4) << 32 | (uint64_t)WGMMA_SWIZZLE_128B << 62;
}

// Byte offset of element (row, col) in a 128-byte-swizzled tile of `rows` rows: D/64 blocks of
// rows x 64 columns, one after another (what TMA writes with a 64-column box and 128B swizzle).
__host__ __device__ constexpr uint32_t sw128(int rows, int row, int col) {
  return (uint32_t)((col / 64) * rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) +
                    (col % 8) * 2);
}

// Order this warpgroup's earlier register writes (accumulators, A fragments) before the wgmma
// that reads them; needed before the first wgmma and whenever ordinary code touched them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
// Close the group of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Wait until at most N committed groups are still running; their accumulators are then final.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by ordinary stores (or cp.async) and read next by wgmma or TMA, which use
// the async proxy: each writing thread fences before the barrier that publishes the data.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Register lists of the accumulator: N/2 floats per thread for m64nNk16 (lane l of warp w holds
// rows 16w + l/4 and 16w + l/4 + 8, columns 8j + 2(l%4) and +1, in d[4j .. 4j+3]).
#define WG_LIST_32                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_LIST_64                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WG_LIST_80                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define WG_LIST_96                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                 "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_D32(i) WG_D8(i), WG_D8(i + 8), WG_D8(i + 16), WG_D8(i + 24)
#define WG_ACC_32 WG_D32(0)
#define WG_ACC_64 WG_D32(0), WG_D32(32)
#define WG_ACC_80 WG_D32(0), WG_D32(32), WG_D8(64), WG_D8(72)
#define WG_ACC_96 WG_D32(0), WG_D32(32), WG_D32(64)

// D (64 x N, fp32) = A B (+ D when accumulate != 0); A (64 x 16) and B (16 x N) in shared memory,
// both K-major (imm-trans-a = imm-trans-b = 0). R = N/2 accumulator registers; A, B, scale-d are
// operands %R, %R+1, %R+2.
#define WGMMA_SS(N, TY, LIST, ACC, A, B, S)                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " LIST    \
               ", %" A ", %" B ", p, 1, 1, 0, 0;\n}\n"                                  \
               : ACC : "l"(desc_a), "l"(desc_b), "r"(accumulate))
// D = A B (+ D) with A (64 x 16) in registers (4 b16x2 per thread, the mma.sync A layout in each
// warp's 16 rows) and B (16 x N) in shared memory: K-major (TB 0: K as stored, [key][dim]) or
// N-major (TB 1: V as stored, [key][dim], read transposed).
#define WGMMA_RS(N, TY, LIST, ACC, A0, B, S, TB)                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " LIST    \
               ", {%" A0 "}, %" B ", p, 1, 1, %" TB ";\n}\n"                            \
               : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), \
                 "n"(TRANS_B))
#define WG_A4(a, b, c, d) a ", %" b ", %" c ", %" d

template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                         int accumulate) {
  constexpr bool h = std::is_same_v<T, __half>;
  static_assert(N == 64 || N == 128 || N == 160 || N == 192, "wgmma_ss: N is 64, 128, 160 or 192 here");
  if constexpr (N == 64) {
    if constexpr (h) WGMMA_SS(64, "f16", WG_LIST_32, WG_ACC_32, "32", "33", "34");
    else WGMMA_SS(64, "bf16", WG_LIST_32, WG_ACC_32, "32", "33", "34");
  } else if constexpr (N == 128) {
    if constexpr (h) WGMMA_SS(128, "f16", WG_LIST_64, WG_ACC_64, "64", "65", "66");
    else WGMMA_SS(128, "bf16", WG_LIST_64, WG_ACC_64, "64", "65", "66");
  } else if constexpr (N == 160) {
    if constexpr (h) WGMMA_SS(160, "f16", WG_LIST_80, WG_ACC_80, "80", "81", "82");
    else WGMMA_SS(160, "bf16", WG_LIST_80, WG_ACC_80, "80", "81", "82");
  } else {
    if constexpr (h) WGMMA_SS(192, "f16", WG_LIST_96, WG_ACC_96, "96", "97", "98");
    else WGMMA_SS(192, "bf16", WG_LIST_96, WG_ACC_96, "96", "97", "98");
  }
}

template <typename T, int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b, int accumulate) {
  constexpr bool h = std::is_same_v<T, __half>;
  static_assert(N == 64 || N == 128 || N == 160 || N == 192, "wgmma_rs: N is 64, 128, 160 or 192 here");
  if constexpr (N == 64) {
    if constexpr (h) WGMMA_RS(64, "f16", WG_LIST_32, WG_ACC_32, WG_A4("32", "33", "34", "35"), "36", "37", "38");
    else WGMMA_RS(64, "bf16", WG_LIST_32, WG_ACC_32, WG_A4("32", "33", "34", "35"), "36", "37", "38");
  } else if constexpr (N == 128) {
    if constexpr (h) WGMMA_RS(128, "f16", WG_LIST_64, WG_ACC_64, WG_A4("64", "65", "66", "67"), "68", "69", "70");
    else WGMMA_RS(128, "bf16", WG_LIST_64, WG_ACC_64, WG_A4("64", "65", "66", "67"), "68", "69", "70");
  } else if constexpr (N == 160) {
    if constexpr (h) WGMMA_RS(160, "f16", WG_LIST_80, WG_ACC_80, WG_A4("80", "81", "82", "83"), "84", "85", "86");
    else WGMMA_RS(160, "bf16", WG_LIST_80, WG_ACC_80, WG_A4("80", "81", "82", "83"), "84", "85", "86");
  } else {
    if constexpr (h) WGMMA_RS(192, "f16", WG_LIST_96, WG_ACC_96, WG_A4("96", "97", "98", "99"), "100", "101", "102");
    else WGMMA_RS(192, "bf16", WG_LIST_96, WG_ACC_96, WG_A4("96", "97", "98", "99"), "100", "101", "102");
  }
}

// ---- mbarrier: a 64-bit object in shared memory that counts arrivals and bytes, phase by phase

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}
// Make the initialised barriers visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also tells the barrier to expect `bytes` more bytes of TMA data this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase with this parity has completed (all arrivals and all expected bytes).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity)
      : "memory");
}

// ---- TMA: one thread copies a whole box of a tensor, described by a tensor map built on the host

// Fetch the tensor map (a kernel parameter in constant space) into the cache before first use.
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Copy the box at coordinates (c0 innermost .. c3) of a 4-D tensor into shared memory at dst;
// the bytes are counted on the mbarrier `bar`. Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, uint32_t bar, int c0,
                                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// Copy a box of shared memory at src to the tensor at coordinates (c0 innermost .. c3); rows
// outside the tensor are not written. The copies issued since the last commit form a bulk group.
__device__ __forceinline__ void tma_store_4d(const void* map, uint32_t src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Close the bulk group of the TMA stores issued since the last commit.
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Wait until every committed bulk group has read its shared memory (src may be reused; the
// writes to global memory may still be under way).
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// ---- setmaxnreg: a warpgroup moves registers between itself and the block's pool

// Move this warpgroup's register allocation down to / up to N per thread (all 128 threads).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- Named barriers, and a store to a 32-bit shared-memory address

// Named barrier `id` (1..15; 0 is __syncthreads'): waits for `threads` threads.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
