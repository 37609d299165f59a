# %% [markdown]
# # Stage 04 — Tensor cores with WMMA
#
# Stage 03 made the CUDA cores' FMA pipes the limit. This stage sends **the two matrix products
# of attention, `S = QKᵀ` and `O += PV`, to the tensor cores**, which multiply whole 16 × 16 × 16
# tiles of fp16 or bf16 numbers and accumulate in fp32, and shows what the rest of the kernel must
# do because the tensor cores' operands are **opaque**.
#
# ## Objectives
# After this notebook you can:
# - explain what a tensor core does per clock, and set the datasheet peak beside the measured
#   matmul ceiling
# - explain what a WMMA fragment is, and why its hidden layout sends S, P and O through shared
#   memory
# - predict the stage's speed from its shared-memory, tensor-core and issue clocks
# - check a shared-memory model against a profile's wavefronts, conflicts and tensor-pipe activity
#
# **Prerequisites:** notebook 03 (the FlashAttention-2 loop order, wavefronts, occupancy,
# prediction bands); matrix products in fp16.
#
# **Time:** about 25 min to read, 40 min to work through.
#
# The kernel, `kernels/04_wmma.cu`, keeps stage 03's loop structure. Everything before the
# measurement is computed from its tiling (`flashlab/diagrams.py`) and needs no GPU.

# %%
# %matplotlib inline
import math

import numpy as np
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import diagrams as dg, plots, tables, tiling
from flashlab import notebook as nb
nb.banner("04_wmma")

the = nb.the_gpu()  # the GPU this notebook's numbers come from (the banner names it)
gpu, cc, sms = the.name, the.cc, the.sms
print(the)

# %% [markdown]
# ## 1 · Why tensor cores
#
# An SM of an H100 has 128 fp32 lanes: 256 FLOP per clock. Its four tensor cores retire a dense
# fp16 product worth **4096 FLOP** per clock (A100: 2048): 16 times the arithmetic, provided the
# work comes as matrix products of 16-bit inputs. Attention is two matrix products with a softmax
# between them, so almost all its FLOPs qualify.
#
# A peak is that count × SMs × a clock. The H100 SXM datasheet's dense fp16/bf16 tensor figure,
# **989 TFLOP/s**, is 132 SMs × 4096 FLOP at 1.83 GHz; at the 1.98 GHz maximum boost the same count
# gives 1071, a clock the GPU does not hold under tensor-core load. What a tuned matrix multiply
# reaches (cuBLAS, 8192³) was measured once and recorded; every notebook reads that one table:

# %%
ceilings = tables.peaks(gpu)  # the recorded peaks table: the measured ceilings, never re-measured
fp32_ceiling, fp16_ceiling = ceilings["matmul_fp32_tflops"], ceilings["matmul_fp16_tflops"]
clock_ghz = 1.98  # maximum boost clock of an H100 or H200 SXM, as in notebooks 02 and 03
ffma_flop_per_clk = 32 * tiling.ffma_per_clock(cc) * 2        # per SM: lanes x 2 FLOP
tensor_flop_per_clk = {"8.0": 2048}.get(cc, 4096)              # per SM, dense fp16 (sm_90: 4096)
peak = lambda per_clk, ghz=clock_ghz: sms * per_clk * ghz / 1e3  # noqa: E731  (TFLOP/s)
print(f"fp16 tensor: {sms} SMs x {tensor_flop_per_clk} FLOP/clock = {peak(tensor_flop_per_clk, 1.83):.0f} "
      f"TFLOP/s at 1.83 GHz (datasheet), {peak(tensor_flop_per_clk):.0f} at {clock_ghz} GHz; "
      f"measured matmul ceiling {fp16_ceiling:.0f} ({fp16_ceiling / peak(tensor_flop_per_clk, 1.83):.0%} "
      f"of the datasheet figure)")
print(f"fp32 FMA:    {sms} SMs x {ffma_flop_per_clk} FLOP/clock = {peak(ffma_flop_per_clk):.0f} TFLOP/s "
      f"at {clock_ghz} GHz; measured matmul ceiling {fp32_ceiling:.0f}")
t03 = nb.compare("fp32").set_index("stage")["tflops"].get("03_coarsened", float("nan"))
print(f"stage 03 (fp32): {t03:.1f} TFLOP/s = {100 * t03 / fp32_ceiling:.0f}% of the fp32 ceiling, "
      f"{100 * t03 / fp16_ceiling:.1f}% of the fp16 one ({fp16_ceiling / fp32_ceiling:.0f}x higher)")

# %% [markdown]
# The measured ceilings, not the datasheet's, are what this workbook compares against.
#
# ## 2 · What a WMMA fragment is
#
# CUDA's C++ interface to the tensor cores is `nvcuda::wmma`. Its unit of work is a
# **fragment**: one 16 × 16 tile held collectively in the registers of a warp's 32 lanes. Three
# calls, each made by all 32 lanes together:
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
# Each lane holds 8 of the 256 accumulator values; **which** 8 "is unspecified and subject to
# change in future architectures" (CUDA programming guide), so one source compiles for every
# tensor-core generation.
#
# The price falls on everything that is *not* a matrix product. A lane cannot ask which row its
# element is in, so it cannot take a **row maximum** of `S`, nor multiply **row `r` of `O` by
# `α_r`** — both of which the online softmax needs. So the kernel stores each score tile to shared
# memory, runs the softmax there with ordinary lanes, writes `P` back as fp16 / bf16 and loads it
# as a fragment for `PV`; and `O` lives in shared memory (fp32), not in accumulator registers.
#
# ## 3 · One K/V tile, step by step
#
# Each of a block's 4 warps owns 16 query rows. Per K/V tile a warp goes around this loop; the
# arrows carry the shared-memory bytes of each step:

# %%
dg.wmma_dataflow()

# %%
traffic = dg.wmma_smem_traffic()
traffic.assign(KiB=traffic["bytes"] / 1024).drop(columns=["bytes"])

# %% [markdown]
# K and V are operands: any kernel reads them. Every *round trip* exists only because the
# fragments are opaque: `S` and `P` out and back in, `O` loaded, rescaled and stored twice.

# %%
per_kind = traffic.groupby("kind")["bytes"].sum()
print(f"per warp and K/V tile: {traffic['bytes'].sum() / 1024:.0f} KiB of shared-memory traffic, "
      f"{per_kind[dg.ROUND_TRIP] / 1024:.0f} KiB ({per_kind[dg.ROUND_TRIP] / traffic['bytes'].sum():.0%}) "
      f"of it round trips, for {dg.wmma_flops() / 1e3:.0f} kFLOP of tensor-core work")

# %% [markdown]
# ## 4 · Padding, again — for 16-bit rows and fragment loads
#
# On sm_80 and sm_90 an fp16 fragment load becomes `ldmatrix`, which reads eight rows of 16 bytes
# per pass. Unpadded K rows of 64 halves (128 bytes) all start in bank 0; padded to D + 8 (144
# bytes), consecutive rows start 4 banks apart and eight rows cover all 32. The fp32 accumulator
# store writes, per half-warp, 4 rows × 32 bytes (a layout WMMA hides — we look only to choose a
# padding), so fp32 rows of S and O are padded by 8 floats:

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
# (P's rows, inside the warp's rows of S, get their own stride `LDP = BC + 8` halves for the same
# reason.)
#
# ## 5 · The kernel
#
# The tile geometry and shared-memory layout:

# %%
nb.show_source("04_wmma", "Tiles")

# %% [markdown]
# Two aliases keep a block small enough for 4 blocks per SM: `P` is written over the warp's rows
# of `S`, and `Q` passes once through the warp's rows of `O` on its way into fragments, which then
# stay in registers. The kernel:

# %%
nb.show_source("04_wmma", "wmma_kernel")

# %% [markdown]
# * **K/V loop.** As in stage 03, two `__syncthreads` around the copy of K and V are the only
#   block-wide barriers; every other step touches only the warp's own rows.
# * **`S = QKᵀ`.** Per 16-key block, `D/16` `mma_sync` into a fresh fragment, stored to shared
#   memory. Kᵀ is K read *column-major*.
# * **Online softmax.** A half-warp takes two rows at a time, 4 scores a lane, scaled by
#   `scale · log₂e` so that `exp` is one `ex2.approx`. P goes out as fp16 / bf16, and the lane
#   rescales its part of the row of `O` by `α` — what a fragment cannot do.
# * **`O += PV`.** Per 16-column block of O the accumulator is *loaded from* `O`, four `mma_sync`
#   add `P·V`, and it is stored back.
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
# At D = 64 the launch bounds ask for 4 blocks per SM, capping registers at 128; shared memory
# (54 KiB a block) allows 4 too. That is 16 warps per SM, as in stage 03 — but each warp now hands
# out whole 16 × 16 × 16 products instead of single FMAs.
#
# ## 7 · Prediction, before measuring
#
# Per K/V tile, a block (4 warps) needs from each unit of the SM:
#
# 1. **Shared memory:** section 3's traffic, 4 warps' worth, at 128 bytes per clock.
# 2. **Tensor cores:** 4 × 262 144 FLOP at 4096 FLOP per clock (2048 on A100).
# 3. **Instruction issue:** the compiled loop body (non-edge tile, `cuobjdump -sass` of the D = 64
#    fp16 kernel) is ≈ 760 instructions per warp — 64 `HMMA`, 40 `LDSM`, the rest softmax,
#    shared-memory loads and stores, addresses — at 4 instructions per clock per SM.
#
# The slowest bounds the loop; as in notebook 03, latency at the barriers and unhidden K/V copies
# put the pipes between half and all of that busy, and the last partial wave costs its share.

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
      f"{pred_speedup[0]:.1f} - {pred_speedup[1]:.1f}x stage 03's {t03:.1f} (fp32); tensor pipe "
      f"busy at most {100 * pred04[1] / peak(tensor_flop_per_clk):.0f}%")
trip_free = flops_tile / (warps * per_kind[dg.OPERANDS] / 128) * sms * clock_ghz / 1e3
print(f"without the round trips (K and V traffic only) shared memory would allow {trip_free:.0f} "
      f"TFLOP/s: what stage 05 goes after")

# %% [markdown]
# So the prediction is **shared-memory bound**, with the tensor cores busy a small fraction of the
# time: they make the arithmetic nearly free, and the bytes around it, most of them round trips,
# become the cost.
#
# ## 8 · Measure
#
# On a GPU this builds the stage, checks it against the float64 reference in fp16 and bf16
# (tolerance twice PyTorch's own error in that dtype), then times it together with SDPA's flash and
# cuDNN backends, run by run in turn at each config (the teaching configs, then the FlashAttention
# sweep), three rounds over, as `flashlab run` does, so that their ratios come from one run, and
# records the rows. Without a GPU: the recorded rows.

# %%
ev = nb.evaluate("04_wmma")
ev

# %% [markdown]
# ## 9 · Prediction against measurement
#
# Stage 04 runs in fp16, stage 03 in fp32: the speedup compares each stage as it is meant to
# run. Against PyTorch, compare like with like — the fp16 baselines.

# %%
t = ev.timing("fp16", missing_ok=True)
if t is not None:
    speedup = nb.speedup("03_coarsened", "04_wmma", "fp32", "fp16")
    print(f"stage 04: {t.tflops:.1f} TFLOP/s (fp16) = {100 * t.tflops / fp16_ceiling:.0f}% of the fp16 "
          f"matmul ceiling, {100 * t.tflops / bound:.0f}% of the shared-memory bound "
          f"(predicted {pred04[0]:.0f} - {pred04[1]:.0f} TFLOP/s)")
    print(f"speedup over stage 03: {speedup:.1f}x (predicted {pred_speedup[0]:.1f} - {pred_speedup[1]:.1f}x)")
    base16 = nb.compare("fp16").set_index("stage")
    base16 = base16[base16["kind"] == "baseline"]["tflops"].sort_values()
    print("fp16 PyTorch baselines (TFLOP/s): " + ", ".join(f"{k} {v:.0f}" for k, v in base16.items()))
    bf = ev.timing("bf16", missing_ok=True)
    if bf is not None:
        print(f"bf16: {bf.tflops:.1f} TFLOP/s ({bf.tflops / t.tflops:.2f}x fp16)")

# %% [markdown]
# ### Discussion
#
# The model predicted 87–173 TFLOP/s; stage 04 ran at about 112 TFLOP/s in fp16, inside the band
# at 63 % of its shared-memory bound, and about 3.7× stage 03 (predicted 2.9–5.8×). A far higher
# roof bought less than 4×, as predicted: the bytes around the tensor cores set the pace.
#
# bf16 runs at about 0.83× fp16. The instruction counts (`nb.instructions("04_wmma")`) point at
# the fragment loads: 40 `LDSM` (`ldmatrix`) in the fp16 kernel, none in the bf16 one — nvcc
# loads bf16 WMMA fragments without `ldmatrix`.
#
# Against PyTorch, stage 04 beats `sdpa_math` and `torch_naive`, nearly matches
# `sdpa_efficient`, and reaches about 30 % of cuDNN's kernel.
#
# ## 10 · The profile: are the tensor cores busy?
#
# **Tensor-pipe utilisation** should go from about 0 (stage 03 issues no tensor-core
# instructions) to the share printed with the prediction — far from 100 %. **Shared-memory
# wavefronts** should match section 3's traffic, and **bank conflicts** stay a small share of
# them: section 4's padding makes the fragment loads and accumulator stores conflict-free.

# %%
p04 = nb.profile("04_wmma", missing_ok=True)
p04

# %%
if "04_wmma" in p04.columns:
    m, wf = p04["04_wmma"], p04.loc["smem_wavefronts"]
    tiles = math.ceil(fl.TEACHING.N / 64)  # BC = 64 keys per K/V tile
    model = traffic["bytes"].sum() / 128 * warps * tiles * blocks
    print(f"tensor pipe active: {p04.loc['tensor_pipe_pct'].iloc[0]:.1f}% -> {m['tensor_pipe_pct']:.1f}% of peak")
    print(f"shared-memory wavefronts: {wf['04_wmma']:.3g} measured, {model:.3g} from section 3's "
          f"traffic ({wf['04_wmma'] / model:.2f}x); shared memory busy >= "
          f"{tiling.busy_share(wf['04_wmma'], m['duration_ms'], sms):.0%} of the clocks at {clock_ghz} GHz; "
          f"issue slots used {tiling.issue_share(m['achieved_occupancy_pct'], m['stall_selected'], cc):.0%}")
    display(tiling.conflict_shares(p04).style.format("{:.3g}"))
    print(f"achieved occupancy: {m['achieved_occupancy_pct']:.1f}%; top stalls (% of active warp "
          "time): " + ", ".join(f"{k.removeprefix('stall_')} {v:.0f}"
                                for k, v in m.filter(like="stall_").nlargest(3).items()))

# %% [markdown]
# ### Discussion
#
# The tensor pipe went from 0.4 % to about 18 % active, against at most 16 % predicted at the top
# of the band: the tensor cores idle four clocks in five. Shared memory is the busiest unit, as
# predicted: its wavefronts come within 16 % of section 3's count, and keep it busy at least
# 73 % of the clocks, while the schedulers use about 37 % of their issue slots.
#
# Padding held. Load conflicts are 0.7 % of the wavefronts and store conflicts 2.4 % — next to
# stage 03's, the raw load count rose slightly and the store count fell, but as shares of the
# traffic both are noise. Occupancy is about 24 %, the 16 warps of section 6.
#
# The top stall, `short_scoreboard` at about 42 %, is a warp waiting for a shared-memory result:
# each step is a round trip that waits for the one before (store S, load S, store P, load P, load
# O). That latency, with two barriers per tile, keeps the kernel at 63 % of its bound.
#
# ## 11 · Against every stage and baseline
#
# Each stage at the teaching config in the dtype it is built for — stages 01 to 03 in fp32,
# stage 04 in fp16 — with PyTorch's fp32 baselines as lines and the fp16 ones faded:

# %%
plots.ladder(last="04_wmma")

# %% [markdown]
# On the roofline, fp16 halves the bytes of q, k, v and o, so stage 04 sits at twice the
# arithmetic intensity of the fp32 stages, under the far higher fp16 tensor-core roof (section 1
# printed how much higher). The distance below that roof is what the remaining stages work on.

# %%
plots.roofline(last="04_wmma")

# %% [markdown]
# ## Next: stage 05
#
# **Stage 05** drops to the PTX instruction `mma.sync` and its loader `ldmatrix`, whose register
# layouts the PTX ISA documents: a lane knows its accumulator elements are rows `lane / 4` and
# `lane / 4 + 8`. The row max and sum become shuffles, `α` scales accumulator registers, S becomes
# P in registers, and only K and V touch shared memory — section 7's last line.

# %% [markdown]
# ## Exercises
#
# Stage 04 has no CPU lab; its two kernel exercises are the two matrix products. They are checked
# together, since the stage is one kernel: `04.qk_wmma` passes only once `04.pv_wmma` is written
# too, and `flashlab grade` says which region still holds its stub.
#
# ### Kernel exercise `04.qk_wmma` (10 points)
#
# **Where:** the `S = Q Kᵀ` step of `wmma_kernel` in `kernels/04_wmma.cu`, between
# `// BEGIN EXERCISE 04.qk_wmma` and `// END EXERCISE 04.qk_wmma`. The stub writes zeros to S.
#
# **What to write:** for each 16-key block `n`, an fp32 accumulator fragment filled with zeros and
# summed over the head dim: `qf[k]` (Q's fragments, already loaded) times K's 16 × 16 block, loaded
# as a `col_major` `matrix_b` (that is Kᵀ, stride `LDK`); then store it to the warp's rows of S
# (`Sw`, row stride `LDS`). Section 2's three calls are all it takes.
#
# ### Kernel exercise `04.pv_wmma` (5 points)
#
# **Where:** the `O += P V` step, between `// BEGIN EXERCISE 04.pv_wmma` and
# `// END EXERCISE 04.pv_wmma`. The stub never adds to O.
#
# **What to write:** P's 16 × `BC` rows (`Pw`, stride `LDP`) as `matrix_a` fragments; for each
# 16-column block of O, the accumulator loaded from `Ow` (stride `LDO`), P times V's blocks
# (`row_major` `matrix_b` from `Vs`) added, and the block stored back.
#
# **How it is judged.** `flashlab grade` builds stage 04 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, and keys whose size grows along the sequence, so that every row's maximum
# keeps rising and each rescale path runs. A wrong kernel scores 0, and the message names the first
# failing case and its first wrong element (batch, head, row, column, got, expected). A right one is
# timed at the teaching config and under the causal mask: when your instructor grades, in turn with
# the solution's stage on the same GPU, the slower of the two ratios counting; when you check your
# own work, against the solution's recorded speedup over stage 03. Full points within 5 % of the
# solution's speed, fewer below.
#
# **GPU:** compute capability 7.5 or newer: a T4 checks fp16 only, 8.0 checks bf16 too; without
# one, `flashlab grade` skips it with one line saying why. Run them with
#
#     flashlab grade --exercise 04.qk_wmma
#     flashlab grade --exercise 04.pv_wmma

# %% [markdown]
# ## Questions for discussion
#
# 1. The tensor cores idle four clocks in five. Would a bigger tile per warp (32 query rows
#    instead of 16) help this kernel, given that the round trips scale with it?
# 2. The measured fp16 ceiling is about three quarters of the datasheet's 989 TFLOP/s. Which of
#    the two should a kernel's efficiency be quoted against, and why?
# 3. WMMA code compiles for every tensor-core generation; `mma.sync` code does not. When is
#    portability worth the speed it costs?

# %% [markdown]
# **Instructor's answer.** *1.* Little. Of the 48 KiB a warp moves per K/V tile, 20 KiB are K and V
# operands, which 32 rows would share, and 28 KiB are round trips of S, P and O, which grow with
# the rows. Traffic per FLOP falls from 48 to (20 + 2 · 28) / 2 = 38 KiB per 262 kFLOP: a bound
# about 1.26× higher, paid for with twice the shared memory for S, P and O and more registers (128
# already cap 4 blocks), so fewer warps; with `short_scoreboard` at 42 % that can lose more than it
# gains. The round trips, 58 % of the traffic, are the target (stage 05).

# %% [markdown]
# **Instructor's answer.** *2.* The measured ceiling, 745 TFLOP/s: it is what a tuned product
# reaches on this GPU at the clock it holds under tensor-core load, so the gap to it is a gap a
# kernel can hope to close (stage 04's 112 TFLOP/s is 15 % of it, 11 % of 989). The datasheet's
# figure assumes 1.83 GHz sustained; quote it beside papers that use it, and say which one you
# quote. Note that cuBLAS reaches its ceiling with `wgmma`, which WMMA and `mma.sync` cannot use.

# %% [markdown]
# **Instructor's answer.** *3.* When the code must run on GPUs you cannot tune for (a course's T4s
# and H100s, a library's fallback), and when something other than the tensor cores bounds the
# kernel anyway. Here the price is concrete: the opaque fragments cost 28 of every 48 KiB of
# shared-memory traffic, and `mma.sync` ran 1.5× faster on the same GPU (stage 05). Production
# kernels keep a per-architecture hot loop and a portable path for the rest.

# %% [markdown]
# ## Summary
#
# - An H100 SM's tensor cores do 4096 dense fp16 FLOP per clock, 16 times its FMA lanes; the
#   datasheet's 989 TFLOP/s assumes 1.83 GHz, and cuBLAS measures lower.
# - WMMA fragments hide which lane holds which element, so the row-wise softmax and the rescaling
#   of O need S, P and O in shared memory: round trips that are over half of the traffic.
# - Counting shared-memory clocks predicted a shared-memory-bound kernel at 87–173 TFLOP/s; it ran
#   at about 112, with the tensor pipe about 18 % active.
# - Bank conflicts are judged as a share of wavefronts: here under 3 %, conflict-free in practice.

# %%
nb.reached("04_wmma")
