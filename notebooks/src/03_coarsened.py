# %% [markdown]
# # 03 · Coarsening: more arithmetic per byte moved
#
# Stage 02 made every warp read global memory in full 128-byte lines. This stage rewrites the
# kernel around one idea: **each value brought closer to the FMA units must feed as many FMAs as
# possible**. Three changes serve it (see the header of `kernels/03_coarsened.cu`):
#
# 1. **FlashAttention-2 loop order.** One block per query tile walks all K/V tiles, so each row's
#    running max `m`, sum `l` and output `O` live in registers instead of round-tripping through
#    global memory.
# 2. **Thread coarsening (register tiling).** Each of 256 threads computes a 4 × 4 patch of the
#    score tile S and a 4 × D/16 patch of O, reading shared memory 16 bytes at a time.
# 3. **Padding.** K and Q rows are stored D + 4 floats apart, so the rows a warp reads at once sit
#    in different shared-memory banks.
#
# The figures and counts before the measurement are computed from the kernels' own indexing
# (`flashlab/tiling.py`) and need no GPU.

# %%
%matplotlib inline
import flashlab as fl
from flashlab import plots, tiling
from flashlab import notebook as nb
nb.banner("03_coarsened")

# %%
import math
import pandas as pd

the = nb.the_gpu()  # the one GPU this notebook's numbers come from (the banner names it)
gpu, cc, sms, roof = the.name, the.cc, the.sms, the.roof  # roof: its own measured ceilings
print(the)

# %% [markdown]
# ## 1 · Where stage 02's time goes
#
# Count what stage 02's inner loops ask of an SM. In `S = QKᵀ` each thread does one FMA per two
# 4-byte loads from shared memory. Lane `t` of a warp reads `Kj[t*d + x]`: 32 rows, `d` floats
# apart. Shared memory has 32 banks of 4 bytes, and with d = 64 all 32 addresses fall in the same
# bank, so that one load needs 32 passes (**wavefronts**). An SM retires 4 FFMA
# warp-instructions per clock (sm_90) but serves only one 128-byte wavefront per clock:

# %%
tiling.work_per_load("02_coalesced")

# %% [markdown]
# Per query row and K/V tile a warp spends 64 × 33 + 64 × 2 = 2240 clocks of shared memory on
# 128 FFMAs that the FMA pipes could retire in 128 / 4 = 32: at most **32 / 2240 ≈ 1.4 %** of the
# FFMA peak. And stage 02 launches only B·H = 64 blocks, so on a 132-SM H100 or H200 more than
# half of the SMs have nothing to do.
#
# ## 2 · Change 1: the FlashAttention-2 loop order
#
# Stages 01 and 02 follow the FlashAttention-1 paper: the outer loop runs over K/V tiles, the inner
# loop over query tiles, so between two visits of query tile *i* its partial output `O_i` and its
# `m_i`, `l_i` must wait in global memory. Swapping the loops makes each query tile's work one
# independent block that keeps `m`, `l` and `O` in registers from start to finish.

# %%
tiling.loop_orders()

# %% [markdown]
# The bytes in the footer, split by tensor (GB, teaching config). The FA-2 order re-reads K and
# V once per query tile, but one head's K and V (512 KiB) stay in L2 while its 16 blocks run; the
# FA-1 order writes and re-reads O at every step.

# %%
traffic = pd.DataFrame({o: tiling.global_bytes(o) for o in ("fa1", "fa2")}) / 1e9
traffic.loc["total"] = traffic.sum()
print(f"at the copy bandwidth ({roof['copy_tbps']:.2f} TB/s) the totals would take "
      + " and ".join(f"{traffic.loc['total', o] / roof['copy_tbps']:.2f} ms ({o})" for o in traffic))
traffic.round(3)

# %% [markdown]
# Even all of FA-1's traffic at full DRAM bandwidth is small next to stage 02's shared-memory
# bill: the teaching config's 17.2 GFLOP at ≈ 0.7 % of an H200's 67 TFLOP/s fp32 datasheet peak
# take ≈ 37 ms. What the new order buys here is **parallelism** (one block per query tile: 16 × 64 =
# 1024 blocks instead of 64) and **register residency** for `m`, `l`, `O` — which the next change
# needs, because the accumulators become a per-thread register tile.
#
# ## 3 · Change 2: thread coarsening — a register tile per thread
#
# 256 threads (`tx`, `ty` in 0..15) share a 64 × 64 score tile. Thread (`tx`, `ty`) owns scores
# at rows `ty + 16r` and keys `tx + 16c` (r, c < 4): one spot in each 16 × 16 block. At every
# step `k` of the dot product it loads 4 float4 of Q (its 4 rows) and 4 float4 of K (its 4 keys)
# and does 4 × 4 × 4 = **64 FMAs from 8 loads**. The PV product is tiled the same way: 4 float4
# of P and 4 of V feed 64 FMAs into a 4 × 4 patch of O (rows `ty + 16r`, columns `4tx .. 4tx+3`).

# %%
tiling.register_tiles()

# %%
tiling.work_per_load("03_coarsened")

# %% [markdown]
# Each shared-memory load now feeds 8 FMAs instead of ½, and each wavefront 5.3 FMA
# instructions instead of 1/33. Shared memory is no longer the limit: per step the FMA pipes need
# 64 / 4 = 16 clocks, shared memory 12, and instruction issue (64 FFMA + 8 loads) / 4 = 18. The
# loops are now **issue-bound at 16 / 18 ≈ 89 %** of the FFMA peak.
#
# Where do those 12 wavefronts come from? A Q load serves 2 distinct rows (`ty` and `ty + 1`,
# broadcast to 16 lanes each): 32 bytes, 1 wavefront. A K load serves 16 distinct rows: 256
# bytes, at least 2 wavefronts — *if* the rows fall in different banks. 4 × 1 + 4 × 2 = 12.
#
# ## 4 · Change 3: padding against bank conflicts
#
# Lane `tx` reads `Ks[(tx + 16c) * LDK + k]`, 16 bytes. With `LDK = D` every row starts at a
# multiple of 64 floats — bank 0 — so the 16 different rows queue up in banks 0–3. With
# `LDK = D + 4` row `tx` starts at bank `4·tx mod 32`, and 8 rows cover all 32 banks.
# (+4, not +1, keeps every row 16-byte aligned for float4.)

# %%
tiling.bank_conflicts(D=64)

# %%
for pad, label in ((False, "LDQ = LDK = D,     LDP = BC    "), (True, "LDQ = LDK = D + 4, LDP = BC + 4")):
    print(f"{label}: the inner loops can reach "
          f"{tiling.inner_loop_bound('03_coarsened', pad=pad):.0%} of the FFMA peak")

# %% [markdown]
# Without padding the `QKᵀ` loop alone would cost 4 × 2 + 4 × 16 = 72 wavefronts per 64 FFMAs
# and shared memory would be the bottleneck again. V needs no padding: a warp reads one row of
# V, 16 consecutive float4 — 2 wavefronts, no conflict.
#
# *Exercise.* The softmax stores `Ps[(ty + 16r) * LDP + tx + 16c]`, one float per lane, with
# `LDP = BC + 4`. Build the 32 addresses of warp 0 (`tiling.lanes()` gives `tx`, `ty`) and count
# the passes with `tiling.wavefronts(addr, vector=1)`. Which `LDP` would make it one pass, while
# keeping the float4 reads of P conflict-free?
#
# ## 5 · The kernel
#
# A diff against stage 02 would be the whole file, so read it instead. First the tile geometry:

# %%
nb.show_source("03_coarsened", "Tiles")

# %% [markdown]
# * `TM × TN` is the score patch per thread (4 × 4 at D = 64, where the launch uses
#   BR = BC = 64). At D = 128 the launch uses BC = 32, so TN = 2 and G = 2: the O patch grows to
#   4 × 8 and the score patch shrinks to 4 × 2, which keeps registers and shared memory in check.
# * `LDQ`, `LDK`, `LDP` are the padded strides of section 4; `LDV = D` is unpadded.
# * `SMEM_FLOATS` is the dynamic shared memory of a block: Q, K, V and P tiles.

# %%
nb.show_source("03_coarsened", "coarsened_kernel")

# %% [markdown]
# Reading top to bottom:
#
# * **Grid.** One-dimensional: block `b` is query tile `b % tiles` of (batch, head) `b / tiles`,
#   so a head's query tiles are neighbours (a 2-D grid would cap B·H at 65 535). The block loads its
#   Q tile once and initialises `m`, `l`, `acc` in registers.
# * **K/V loop.** `n_tiles` stops at the diagonal when causal. Two barriers bracket the copy of
#   K and V into shared memory (`load_rows`, float4 loads, zeros past N).
# * **`S = QKᵀ`.** The loop of section 3: per 4-wide `k`, TM + TN float4 loads, TM·TN·4 FMAs.
# * **Online softmax.** Mask (key ≥ N, or past the diagonal), then the row max: the 16 threads
#   sharing a row are the 16 lanes with the same `ty`, so `row_max16` is 4 `__shfl_xor_sync`
#   steps. Each thread rescales its own `acc` and partial `l` by `alpha`, and writes its `p` to
#   shared memory, because the PV product needs whole rows of P.
# * **`O += PV`.** After a barrier, each thread reads its 4 rows of P (one float4 per row,
#   broadcast) and one float4 of each V row (consecutive across the 16 lanes).
# * **Epilogue.** `row_sum16` adds up the 16 partial `l`, and each thread writes its O rows as
#   float4 — coalesced, once.
#
# ## 6 · Resources: registers, shared memory, occupancy
#
# `ptxas` reports what each instantiation (D = 64 and D = 128) needs per thread:

# %%
res = nb.resources("03_coarsened")
res

# %% [markdown]
# An SM has 65 536 registers and 228 KiB of shared memory (sm_90; 164 KiB on A100). A block of
# 256 threads at R registers each needs 256·R registers: R ≤ 128 allows 2 blocks per SM, R ≤ 80
# would allow 3. The shared memory per block follows from `Tiles`:
# 4 bytes × (64·68 + 64·68 + 64·64 + 64·68) = 68 608 B at D = 64 — 3 blocks' worth would fit.
# So registers decide. The same arithmetic in code, for each instantiation in the table above:

# %%
arch = f"sm_{cc.replace('.', '')}" if f"sm_{cc.replace('.', '')}" in set(res["arch"]) else "sm_90"
regs_at = {D: int(res[(res["arch"] == arch) & res["kernel"].str.contains(f"<{D},")]["registers"].max())
           for D in (64, 128)}
for D, BR, BC in ((64, 64, 64), (128, 64, 32)):
    smem = tiling.smem_bytes(D, BR, BC)
    occ = tiling.occupancy(regs_at[D], smem, cc=cc)
    print(f"D={D}: {smem} B shared memory, {regs_at[D]} registers/thread -> blocks per SM allowed by "
          f"{occ['limits']}: {occ['blocks']} blocks, {occ['warps']} warps ({occ['occupancy']:.0%})")
occ = tiling.occupancy(regs_at[64], tiling.smem_bytes(), cc=cc)
blocks = math.ceil(fl.TEACHING.N / 64) * fl.TEACHING.B * fl.TEACHING.H
waves = blocks / (occ["blocks"] * sms)
print(f"teaching config: {blocks} blocks on {sms} SMs x {occ['blocks']} = {waves:.2f} waves")

# %% [markdown]
# A quarter of the SM's thread slots is low occupancy, but each thread carries 16 independent
# score accumulators (and 16 output ones), so FMA latency is covered by instruction-level
# parallelism. What 16 warps cannot fully cover are the three barriers per tile and the K/V
# copy, which each block waits for unhelped by its own work — only the other block on the SM can
# fill those gaps.
#
# ## 7 · Prediction, before measuring
#
# Per 64 × 64 tile each thread issues, at D = 64 (counts from the source; the last three are
# estimates of what the compiler emits — `cuobjdump -sass` shows them):
#
# | work | instructions per thread per tile |
# |---|---|
# | `QKᵀ`: 16 steps × 64 FFMA | 1024 |
# | `PV`: 16 steps × 64 FFMA | 1024 |
# | shared-memory loads: 32 steps × 8 LDS.128 | 256 |
# | loop counters, addresses | ≈ 100 |
# | online softmax of 16 scores (mask, 4 × 4 shuffles, 16 exp, P stores, rescale) | ≈ 250 |
# | K, V copy: 8 float4 global loads + 8 shared stores, bounds checks | ≈ 200 |
# | **total** | **≈ 2850, of which 2048 FFMA** |
#
# 1. **Issue.** 4 schedulers issue 4 instructions per clock, so the FMA pipes are busy at most
#    2048 / 2850 ≈ **72 %** of the time. (Shared memory: 32 × 12 = 384 wavefronts per warp per
#    tile against 2048 / 4 = 512 FMA clocks — close, but not the limit.)
# 2. **Latency.** With 16 warps per SM and barriers every tile, expect the pipes busy between
#    half and all of that: **36 – 72 %** of the FFMA peak.
# 3. **Tail.** 1024 blocks at 2 per SM on 132 SMs are 3.9 waves; the partial last one costs
#    ≈ 3 %: **≈ 35 – 70 % of the FFMA peak.**
# 4. **Which peak.** Stage 03 is limited by issuing FFMAs, like a matrix multiply, so scale it
#    by the measured fp32 matmul ceiling: cuBLAS's SGEMM, the same FFMA-from-shared-memory loop
#    tuned, at the clock the GPU holds under that load.
#
# **Stage 02**, by the same model, is limited by shared memory — a count of *clocks*: 1.4 % of the
# FFMA peak on 64 of 132 SMs. At the 1.98 GHz boost clock of an H100 or H200 SXM the FFMA peak is
# 132 SMs × 128 lanes × 2 FLOP × 1.98 GHz = 66.9 TFLOP/s, so stage 02 should run at
# 0.0143 × 64 / 132 × 66.9 ≈ **0.46 TFLOP/s** (notebook 02's prediction, counted the same way).
#
# So: **stage 03 at 35 – 70 % of the fp32 matmul ceiling**, and a speedup over stage 02 of that
# divided by 0.46 TFLOP/s. The project's target — at least 8 TFLOP/s at the teaching config —
# needs only a ceiling above 8 / 0.35 ≈ 23 TFLOP/s. In numbers, for this GPU:

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM, as in notebook 02: put your GPU's here
rate = tiling.ffma_per_clock(cc)  # FFMA warp-instructions per clock per SM (2 on A100)
ffma_peak = sms * 32 * rate * 2 * clock_ghz / 1e3  # TFLOP/s
ceiling = roof["matmul_fp32_tflops"]
issue = (2048 / rate) / max(2048 / rate, 2850 / 4)  # on A100 the FMA pipe, not issue, binds
tail = waves / math.ceil(waves)
pred03 = [ceiling * issue * busy * tail for busy in (0.5, 1.0)]
heads = fl.TEACHING.B * fl.TEACHING.H  # stage 02's grid: one block per head
pred02 = ffma_peak * tiling.inner_loop_bound("02", ffma_rate=rate) * min(1, heads / sms)
pred_speedup = [p / pred02 for p in pred03]
print(f"FFMA peak at {clock_ghz} GHz: {ffma_peak:.1f} TFLOP/s; measured fp32 matmul ceiling: "
      f"{ceiling:.1f} TFLOP/s ({ceiling / ffma_peak:.0%} of it)\n"
      f"predicted: stage 03 {pred03[0]:.1f} - {pred03[1]:.1f} TFLOP/s, stage 02 {pred02:.2f} TFLOP/s, "
      f"speedup {pred_speedup[0]:.0f} - {pred_speedup[1]:.0f}x")

# %% [markdown]
# ## 8 · Measure
#
# On a GPU this builds the stage, checks it against a float64 reference on fresh inputs
# (N = 1, 17, 1000, 4096; D = 64 and 128; causal and not), times it at the teaching config
# (B = 4, H = 16, N = 1024, D = 64, fp32) and records the rows in `data/`. Without a GPU it
# shows the recorded rows.

# %%
ev = nb.evaluate("03_coarsened")
ev

# %% [markdown]
# ## 9 · Prediction against measurement

# %%
t = ev.timing()
speedup = nb.speedup("02_coalesced", "03_coarsened")
table = nb.compare().set_index("stage")
m02 = table.loc["02_coalesced", "tflops"]
baselines = table[table["kind"] == "baseline"]["tflops"]


def inside(x, band):
    return "inside" if band[0] <= x <= band[1] else "outside"


print(f"stage 03: {t.tflops:.1f} TFLOP/s = {100 * t.tflops / ceiling:.0f}% of the fp32 matmul "
      f"ceiling, {inside(t.tflops, pred03)} the predicted {pred03[0]:.1f} - {pred03[1]:.1f}.")
print(f"stage 02: {m02:.2f} TFLOP/s, {m02 / pred02:.2f}x its model's {pred02:.2f}.")
print(f"speedup over stage 02: {speedup:.0f}x, {inside(speedup, pred_speedup)} the predicted "
      f"{pred_speedup[0]:.0f} - {pred_speedup[1]:.0f}x.")
sdpa = baselines.filter(like="sdpa_")
if len(sdpa):  # baselines are timed by `flashlab run`
    print(f"{t.pct_sdpa_best:.0f}% of {sdpa.idxmax()}, the fastest fp32 SDPA backend here; "
          f"faster than: {', '.join(baselines[baselines < t.tflops].index) or 'none'}.")
print(f"target of 8 TFLOP/s: {'met' if t.tflops >= 8 else 'NOT met'}.")

# %% [markdown]
# **What the model gets right.** The jump comes from one quantity — FMAs per shared-memory
# wavefront, from 1/33 in stage 02's `QKᵀ` loop to 5.3 — plus a 16 times larger grid. Those two
# numbers alone predict two orders of magnitude, before any timing. The PyTorch baselines it
# is compared with are fp32 too: `torch_naive` and `sdpa_math` run cuBLAS's SGEMM but write the
# N × N scores to memory and read them back; `sdpa_efficient` is a fused CUDA-core kernel like
# this one.
#
# **Where to look when it is off.** The two stages are scaled by different peaks, because they
# are limited by different things. Stage 02's bound counts shared-memory clocks at the boost
# clock: its ratio above says how well that held. Stage 03's band is scaled by the matmul
# ceiling, which already sits below the FFMA peak at the boost clock (printed with the
# prediction): a kernel issuing FFMAs flat out draws the most power, and the clock drops. Within
# the band, the distance to its top — the 72 % issue bound — is what the model could only
# bracket: latency at the three barriers per tile, and K/V copies that no block overlaps with
# its own math. Reading the instruction mix of the compiled kernel (`cuobjdump -sass`) or
# profiling its stall reasons (Nsight Compute) turns that bracket into a measurement.

# %% [markdown]
# ## 9b · The profile: did the bank conflicts go?
#
# Padding targets one counter: shared-memory load bank conflicts. Stage 02's `Kj[tx*d + x]`
# read was 32-way on every multiply-add; the padded float4 reads of stage 03 need the minimum
# number of wavefronts (section 4), so the count should **fall by orders of magnitude**. (The
# 2-way conflicted store of P shows in the separate store counter, and it happens once per
# score, not once per multiply-add.) Two more predictions: global load requests are now 16 bytes a
# lane, 512 bytes a warp, so **16 sectors per request** is the ideal here (not a regression);
# and **achieved occupancy around 25%** (2 blocks of 8 warps on 64 slots, section 6).

# %%
p03 = nb.profile("03_coarsened")
p03

# %%
bank = p03.loc["smem_load_bank_conflicts"]
spr = p03.loc["global_load_sectors_per_request"]
occ = p03.loc["achieved_occupancy_pct"]
m = p03["03_coarsened"]
stalls = m.filter(like="stall_").sort_values(ascending=False).head(3)
print(f"shared-memory load bank conflicts: {bank['02_coalesced']:.3g} -> {bank['03_coarsened']:.3g}"
      f" ({bank['02_coalesced'] / max(bank['03_coarsened'], 1):.0f}x fewer)")
print(f"sectors per global load request: {spr['03_coarsened']:.1f} (16 = every byte of a "
      f"float4-per-lane request used)")
print(f"achieved occupancy: {occ['02_coalesced']:.1f}% -> {occ['03_coarsened']:.1f}%")
print("top stalls (% of active warp time): "
      + ", ".join(f"{k.removeprefix('stall_')} {v:.0f}" for k, v in stalls.items()))

# %% [markdown]
# ## 10 · Against every stage and baseline
#
# Each stage at the teaching config, with PyTorch's implementations as lines (fp16 ones faded):

# %%
plots.ladder()

# %% [markdown]
# On the roofline, every fp32 kernel at this config has the same arithmetic intensity — the
# FLOPs over the bytes of q, k, v and o read or written once (fp16 ones sit at twice it) — so the
# stages stack up vertically: the climb is all about how much of the compute roof a kernel
# reaches, and all of them are far to the right of the ridge point, where bandwidth would matter.

# %%
plots.roofline()

# %%
nb.compare()

# %% [markdown]
# ## 11 · What is next
#
# Stage 03 runs on the CUDA cores, so the fp32 FMA rate is its roof: the printout of section 9
# shows how much of it is left. The tensor cores have a far higher one:

# %%
tc = roof["matmul_fp16_tflops"]
print(f"fp16 tensor-core matmul ceiling: {tc:.0f} TFLOP/s = {tc / ceiling:.0f}x the fp32 CUDA-core "
      f"one; stage 03 runs at {100 * t.tflops / tc:.1f}% of it.")

# %% [markdown]
# Tuning stage 03 further — double-buffered K/V copies, fewer barriers, bigger patches — could
# at best close the gap to the fp32 ceiling. **Stage 04** changes the roof instead: on top of this
# stage's FA-2 structure it computes `QKᵀ` and `PV` with WMMA tensor-core instructions, fp16
# inputs and fp32 accumulation — a warp multiplies whole 16 × 16 fragments where here each lane
# does one FMA at a time.
