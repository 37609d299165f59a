# %% [markdown]
# # 04 · Tensor cores with WMMA
#
# Stage 03 made the CUDA cores' FMA pipes the limit. This stage changes the unit that does the
# arithmetic: **the two matrix products of attention, `S = QKᵀ` and `O += PV`, go to the tensor
# cores**, which multiply whole 16 × 16 × 16 tiles of fp16 or bf16 numbers and accumulate in
# fp32. The loop structure is stage 03's (a block owns 64 query rows and walks all K/V tiles);
# what changes is who multiplies, in what precision, and — the lesson of this stage — what the
# rest of the kernel has to do because the tensor cores' operands are **opaque**.
#
# The kernel is `kernels/04_wmma.cu`; its header says in a few lines what changed from 03 and why.
# Everything before the measurement is computed from the kernel's own tiling
# (`flashlab/diagrams.py`) and needs no GPU.

# %%
%matplotlib inline
import flashlab as fl
from flashlab import diagrams as dg, plots, tiling
from flashlab import notebook as nb
nb.banner("04_wmma")

# %%
import math
import numpy as np
import pandas as pd

the = nb.the_gpu()  # the one GPU this notebook's numbers come from (the banner names it)
gpu, cc, sms, roof = the.name, the.cc, the.sms, the.roof  # roof: its own measured ceilings
print(the)

# %% [markdown]
# ## 1 · Why tensor cores
#
# An SM of an H100 has 128 fp32 lanes: 128 FMAs, 256 FLOP per clock. Its four tensor cores
# retire, per clock, a dense fp16 product worth **4096 FLOP** (A100: 128 fp32 and 2048 tensor
# FLOP per clock per SM). Same chip, same clock, 16 times the arithmetic — provided the
# work comes as matrix products of 16-bit inputs. Attention is two matrix products with a
# softmax in between, so almost all of its FLOPs qualify.
#
# The datasheet numbers are peaks at the boost clock; `flashlab run` measured what a tuned matrix
# multiply reaches on this GPU (cuBLAS, 8192³): those are the ceilings this workbook compares
# against.

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM, as in notebooks 02 and 03
ffma_flop_per_clk = 32 * tiling.ffma_per_clock(cc) * 2        # per SM: lanes x 2 FLOP
tensor_flop_per_clk = {"8.0": 2048}.get(cc, 4096)              # per SM, dense fp16 (sm_90: 4096)
peak = lambda per_clk: sms * per_clk * clock_ghz / 1e3         # noqa: E731  (TFLOP/s)
fp32_ceiling, fp16_ceiling = roof["matmul_fp32_tflops"], roof["matmul_fp16_tflops"]
print(f"datasheet-style peaks at {clock_ghz} GHz: fp32 FMA {peak(ffma_flop_per_clk):.0f} TFLOP/s, "
      f"fp16 tensor {peak(tensor_flop_per_clk):.0f} TFLOP/s ({tensor_flop_per_clk // ffma_flop_per_clk}x)")
print(f"measured matmul ceilings: fp32 {fp32_ceiling:.0f} TFLOP/s, fp16 {fp16_ceiling:.0f} TFLOP/s "
      f"({fp16_ceiling / fp32_ceiling:.0f}x)")
t03 = nb.compare("fp32").set_index("stage")["tflops"].get("03_coarsened", float("nan"))
print(f"stage 03 (fp32): {t03:.1f} TFLOP/s = {100 * t03 / fp32_ceiling:.0f}% of the fp32 ceiling, "
      f"{100 * t03 / fp16_ceiling:.1f}% of the fp16 one")

# %% [markdown]
# ## 2 · What a WMMA fragment is
#
# CUDA's C++ interface to the tensor cores is `nvcuda::wmma` (warp matrix multiply-accumulate).
# Its unit of work is a **fragment**: one 16 × 16 tile of a matrix, held collectively in the
# registers of the 32 lanes of a warp. Three calls, each made by all 32 lanes together:
#
# ```cuda
# wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;  // 16x16 of Q
# wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;  // 16x16 of Kᵀ
# wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;                 // 16x16 of S, fp32
# wmma::load_matrix_sync(a, ptr, ldm);          // the warp reads a tile (shared or global memory)
# wmma::mma_sync(c, a, b, c);                   // c += a · b: 16·16·16 multiply-adds
# wmma::store_matrix_sync(ptr, c, ldm, wmma::mem_row_major);
# ```
#
# Each lane holds `c.num_elements` = 8 of the 256 accumulator values. **Which** 8 is not
# specified: in the words of the CUDA programming guide, the mapping of matrix elements into
# fragment storage "is unspecified and subject to change in future architectures". That is
# deliberate — a Volta tensor core
# (`HMMA.884`), an Ampere or Hopper one (`HMMA.16816`) and whatever comes next want their operands
# spread over the lanes differently, and the same WMMA source compiles for all of them.
#
# The price is paid by everything that is *not* a matrix product. A lane may apply the same
# operation to all its elements (`c.x[i] *= 0.5f` for every `i`), but it cannot ask "which row is
# my element in?" — so it cannot take a **row maximum** of `S`, nor multiply **row `r` of `O` by
# its own `α_r`**, both of which the online softmax needs. The kernel therefore stores each
# score tile to shared memory, where the layout is ours again, runs the softmax there with
# ordinary lanes, writes `P` back as fp16 / bf16, and loads it as a fragment for `PV`. For the
# same reason `O` lives in shared memory (fp32) instead of in accumulator registers.
#
# ## 3 · One K/V tile, step by step
#
# Each of a block's 4 warps owns 16 query rows. Per K/V tile a warp goes around this loop; the
# numbers on the arrows are the bytes of shared memory each step moves (the model below, counted
# from the kernel's own loops):

# %%
dg.wmma_dataflow()

# %%
traffic = dg.wmma_smem_traffic()
traffic.assign(KiB=traffic["bytes"] / 1024).drop(columns=["bytes"])

# %% [markdown]
# K and V are operands: any kernel that multiplies with them reads them (each warp reads the whole
# tile, since it needs every key). Everything marked *round trip* is there only because the
# fragments are opaque: `S` out and back in, `P` out and back in, and `O` loaded, rescaled and
# stored twice per tile. In numbers:

# %%
per_kind = traffic.groupby("kind")["bytes"].sum()
print(f"per warp and K/V tile: {traffic['bytes'].sum() / 1024:.0f} KiB of shared-memory traffic, "
      f"{per_kind[dg.ROUND_TRIP] / 1024:.0f} KiB ({per_kind[dg.ROUND_TRIP] / traffic['bytes'].sum():.0%}) "
      f"of it round trips, for {dg.wmma_flops() / 1e3:.0f} kFLOP of tensor-core work")

# %% [markdown]
# ## 4 · Padding, again — for 16-bit rows and fragment loads
#
# On sm_80 and sm_90 the compiler turns an fp16 fragment load into `ldmatrix`, which reads eight
# rows of 16 bytes per pass. With unpadded K rows of D = 64 halves (128 bytes) all eight rows
# start in bank 0. The kernel pads rows to D + 8 elements (144 bytes), so consecutive rows start
# 4 banks apart and the eight rows cover all 32 banks. The fp32 accumulator store writes, per
# half-warp, 4 rows × 32 bytes (the layout WMMA hides — we look at it only to choose a padding; the
# kernel's correctness never depends on it), so fp32 rows of S and O are padded by 8 floats:

# %%
from flashlab.banks import wavefronts

rows = []
for what, ld_bytes in (("ldmatrix: 8 rows x 16 B, rows of 64 halves", 128),
                       ("ldmatrix: 8 rows x 16 B, rows of 64 + 8 halves (LDK)", 144)):
    rows.append((what, wavefronts(np.arange(8) * ld_bytes // 4, vector=4)[0], 1))
lane = np.arange(16)  # the half-warp of one STS.64: rows lane // 4, columns 2 (lane % 4)
for pad in (0, 4, 8):
    words = (lane // 4) * (64 + pad) + 2 * (lane % 4)
    rows.append((f"accumulator store: 4 rows x 32 B, rows of 64 + {pad} floats", wavefronts(words, vector=2)[0], 1))
pd.DataFrame(rows, columns=["access", "wavefronts", "minimum"])

# %% [markdown]
# (P gets its own row stride inside the warp's rows of S, `LDP = BC + 8` halves, for the same
# reason; a stride of two S rows would put P's rows 8 banks apart and make every P load
# 2-way conflicted.)
#
# ## 5 · The kernel
#
# First the tile geometry and the shared-memory layout:

# %%
nb.show_source("04_wmma", "Tiles")

# %% [markdown]
# Two aliases keep a block small enough for 4 blocks per SM: `P` is written over the warp's rows
# of `S` (every lane first reads its scores into registers, then a `__syncwarp`, then the writes),
# and `Q` passes once through the warp's rows of `O` on its way into fragments, which then stay in
# registers for the whole loop. The kernel:

# %%
nb.show_source("04_wmma", "wmma_kernel")

# %% [markdown]
# Reading top to bottom:
#
# * **Prologue.** Each warp copies its 16 rows of Q (16-byte loads, zeros past N) into its rows of
#   `O`, loads them as `D/16` fragments, then zeroes `O`.
# * **K/V loop.** As in stage 03: `__syncthreads`, all 128 threads copy the K and V tiles,
#   `__syncthreads`. These two are the only block-wide barriers — every other step touches only
#   the warp's own rows, so `__syncwarp` is enough.
# * **`S = QKᵀ`.** For each 16-key block `n`, `D/16` `mma_sync` calls accumulate into a fresh
#   fragment, which goes to shared memory. Kᵀ is K read as a *column-major* matrix — no transpose
#   is ever stored.
# * **Online softmax.** Half-warp `h` takes two rows at a time (rows 4 apart, so their P stores
#   miss each other's banks); each of its 16 lanes holds 4 scores of a row. Scores are scaled by
#   `scale · log₂e` so that `exp` is one `ex2.approx` instruction; keys past N or past the diagonal
#   become `-inf` (only on the tiles where that can happen). The row max takes 4 shuffles; each
#   lane keeps its share of the row sum, reduced once at the end. Then P goes out as fp16 / bf16
#   and the lane multiplies its part of the row of `O` by `α` — the step a fragment could not do.
# * **`O += PV`.** P's 4 fragments are loaded once; for each 16-column block of O, the
#   accumulator is *loaded from* `O`, four `mma_sync` add `P·V`, and it is stored back.
# * **Epilogue.** `O /= l` in place, then rows < N go out as fp16 / bf16, 16 bytes per store.
#
# ## 6 · Resources: registers, shared memory, occupancy

# %%
res = nb.resources("04_wmma")
res

# %%
arch = f"sm_{cc.replace('.', '')}" if f"sm_{cc.replace('.', '')}" in set(res.get("arch", [])) else "sm_90"
for D in (64, 128):
    mine = res[(res["arch"] == arch) & res["kernel"].str.contains(f"<{D},")] if "arch" in res else res
    regs = int(mine["registers"].max()) if len(mine) else 128
    smem = dg.wmma_smem_bytes(D)
    occ = tiling.occupancy(regs, smem, threads=128, cc=cc)
    print(f"D={D}: {smem} B shared memory, {regs} registers/thread -> blocks per SM allowed by "
          f"{occ['limits']}: {occ['blocks']} blocks, {occ['warps']} warps ({occ['occupancy']:.0%})")
occ = tiling.occupancy(128, dg.wmma_smem_bytes(64), threads=128, cc=cc)
blocks = math.ceil(fl.TEACHING.N / 64) * fl.TEACHING.B * fl.TEACHING.H
waves = blocks / (occ["blocks"] * sms)
print(f"teaching config: {blocks} blocks on {sms} SMs x {occ['blocks']} = {waves:.2f} waves")

# %% [markdown]
# At D = 64 the launch bounds ask for 4 blocks per SM, which caps registers at 128; shared memory
# (54 KiB a block) allows 4 too. That is 16 warps per SM, as in stage 03 — but each warp now
# hands out whole 16 × 16 × 16 products instead of single FMAs.
#
# ## 7 · Prediction, before measuring
#
# Per K/V tile, a block (4 warps) needs from each unit of the SM:
#
# 1. **Shared memory:** the traffic of section 3, 4 warps' worth, at 128 bytes per clock.
# 2. **Tensor cores:** 4 × 262 144 FLOP at 4096 FLOP per clock (2048 on A100).
# 3. **Instruction issue:** the compiled loop body (non-edge tile, `cuobjdump -sass` of the D = 64
#    fp16 kernel at this commit) is ≈ 760 instructions per warp — 64 `HMMA`, 40 `LDSM`, the rest
#    softmax, shared-memory loads and stores, addresses — at 4 instructions per clock per SM.
#
# The slowest of the three bounds the loop; then, as in notebook 03, latency at the two barriers
# and unhidden K/V copies put the pipes between half and all of that busy, and the last partial
# wave costs its share.

# %%
warps = dg.WMMA_WARPS
flops_tile = warps * dg.wmma_flops()
clocks = {"shared memory": warps * traffic["bytes"].sum() / 128,
          "tensor cores": flops_tile / tensor_flop_per_clk,
          "issue": warps * 760 / 4}
bound_unit = max(clocks, key=clocks.get)
bound = flops_tile / clocks[bound_unit] * sms * clock_ghz / 1e3  # TFLOP/s
tail = waves / math.ceil(waves)
pred04 = [bound * busy * tail for busy in (0.5, 1.0)]
pred_speedup = [p / t03 for p in pred04]
print("clocks per block and K/V tile: " + ", ".join(f"{k} {v:.0f}" for k, v in clocks.items()))
print(f"bound by {bound_unit}: {bound:.0f} TFLOP/s at {clock_ghz} GHz "
      f"({100 * bound / fp16_ceiling:.0f}% of the measured fp16 matmul ceiling)")
print(f"predicted: stage 04 {pred04[0]:.0f} - {pred04[1]:.0f} TFLOP/s (fp16), "
      f"{pred_speedup[0]:.1f} - {pred_speedup[1]:.1f}x stage 03's {t03:.1f} (fp32)")
trip_free = flops_tile / (warps * per_kind[dg.OPERANDS] / 128) * sms * clock_ghz / 1e3
print(f"without the round trips (K and V traffic only) shared memory would allow {trip_free:.0f} "
      f"TFLOP/s: what stage 05 goes after")

# %% [markdown]
# So the prediction is **shared-memory bound**, at a small fraction of what the tensor cores
# could do: a tensor-pipe utilisation of roughly the predicted TFLOP/s over the tensor peak —
# around a tenth. Tensor cores make the arithmetic nearly free; now the bytes around it are
# the cost, and most of those bytes are the round trips of section 3.
#
# ## 8 · Measure
#
# On a GPU this builds the stage, checks it against the float64 reference (fp16 and bf16, N = 1,
# 17, 1000, 4096; D = 64 and 128; causal and not; the tolerance is twice the error PyTorch's own
# attention makes in the same dtype), times it at the teaching config in fp16 and bf16 and over
# the FlashAttention sweep, and records the rows. Without a GPU it shows the recorded rows.

# %%
ev = nb.evaluate("04_wmma")
ev

# %% [markdown]
# ## 9 · Prediction against measurement
#
# Stage 04 runs in fp16, stage 03 in fp32: the speedup below compares the two stages as each is
# meant to run. Against PyTorch, compare like with like — the fp16 baselines.

# %%
t = ev.timing("fp16", missing_ok=True)
speedup = nb.speedup("03_coarsened", "04_wmma", "fp32", "fp16", missing_ok=True)


def inside(x, band):
    return "inside" if band[0] <= x <= band[1] else "outside"


if t is not None:
    print(f"stage 04: {t.tflops:.1f} TFLOP/s (fp16) = {100 * t.tflops / fp16_ceiling:.0f}% of the fp16 "
          f"matmul ceiling, {inside(t.tflops, pred04)} the predicted {pred04[0]:.0f} - {pred04[1]:.0f}; "
          f"{100 * t.tflops / bound:.0f}% of the shared-memory bound.")
    print(f"speedup over stage 03: {speedup:.1f}x, {inside(speedup, pred_speedup)} the predicted "
          f"{pred_speedup[0]:.1f} - {pred_speedup[1]:.1f}x.")
    base16 = nb.compare("fp16").set_index("stage")
    base16 = base16[base16["kind"] == "baseline"]["tflops"]
    print(f"{t.pct_sdpa_best:.0f}% of the fastest fp16 SDPA backend; faster than: "
          f"{', '.join(base16[base16 < t.tflops].index) or 'none'}.")
    bf = ev.timing("bf16", missing_ok=True)
    if bf is not None:
        print(f"bf16: {bf.tflops:.1f} TFLOP/s ({bf.tflops / t.tflops:.2f}x fp16; nvcc loads bf16 "
              f"fragments without ldmatrix).")

# %% [markdown]
# **Reading the result.** The prediction says where the time should go: not into the tensor
# cores but into shared memory, most of it the round trips. If the measurement sits inside the
# band, that model explains the stage; below it, look first at what the model leaves out —
# the K/V copy each block waits for at its barriers, and the softmax's instructions, which
# compete with the loads for issue slots. The profile below measures both.
#
# ## 9b · The profile: are the tensor cores busy?
#
# Two counters tell this stage's story. **Tensor-pipe utilisation** goes from about 0 (stage 03
# issues no tensor-core instructions) to roughly the share computed in section 7 — far from
# 100 %, because shared memory, not the tensor cores, sets the pace. **Shared-memory bank
# conflicts** should stay low: section 4's padding makes the fragment loads and accumulator stores
# conflict-free.

# %%
p04 = nb.profile("04_wmma", missing_ok=True)
p04

# %%
if "04_wmma" in p04.columns:
    m = p04["04_wmma"]
    stalls = m.filter(like="stall_").sort_values(ascending=False).head(3)
    before = p04["03_coarsened"] if "03_coarsened" in p04 else pd.Series(dtype=float)
    nan = float("nan")
    print(f"tensor pipe active: {before.get('tensor_pipe_pct', nan):.1f}% -> "
          f"{m.get('tensor_pipe_pct', nan):.1f}% of peak (section 7 predicted about "
          f"{100 * pred04[1] / peak(tensor_flop_per_clk):.0f}% at the top of the band)")
    print(f"shared-memory bank conflicts, loads / stores: {m.get('smem_load_bank_conflicts', nan):.3g}"
          f" / {m.get('smem_store_bank_conflicts', nan):.3g}")
    print(f"achieved occupancy: {m.get('achieved_occupancy_pct', nan):.1f}%")
    print("top stalls (% of active warp time): "
          + ", ".join(f"{k.removeprefix('stall_')} {v:.0f}" for k, v in stalls.items()))

# %% [markdown]
# ## 10 · Against every stage and baseline
#
# The ladder shows each stage at the teaching config in the dtype it is built for — stages 01 to
# 03 in fp32, stage 04 in fp16 — with PyTorch's fp32 baselines as lines and the fp16 ones faded:

# %%
plots.ladder()

# %% [markdown]
# On the roofline, fp16 halves the bytes of q, k, v and o, so stage 04 sits at twice the
# arithmetic intensity of the fp32 stages — and, more to the point, under a roof about 13 times
# higher (section 1): the fp16 tensor-core line. Stage 03 was measured against the blue roof,
# stage 04 against the red one; the distance below the red roof is what the remaining stages
# work on.

# %%
plots.roofline()

# %%
nb.compare("fp16")

# %% [markdown]
# ## 11 · What is next
#
# WMMA hid the fragment layout, so every per-row step — the softmax's max and sum, the
# rescaling of O — had to go through shared memory, and section 3 showed that those round trips
# are most of the kernel's shared-memory traffic. **Stage 05** drops one level, to the PTX
# instruction `mma.sync` and its loader `ldmatrix`, whose register layouts *are* documented (in
# the PTX ISA): a lane knows that its accumulator elements are rows `lane / 4` and `lane / 4 + 8`.
# Then the row max and sum are a few shuffles within a quad of lanes, `α` multiplies accumulator
# registers directly, the S accumulators are converted to P fragments in registers, and S, P
# and O never touch shared memory — only K and V do. Section 7's last line is the shared-memory
# bound that leaves.
