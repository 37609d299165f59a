# %% [markdown]
# # Stage 03 — Coarsening: more arithmetic per byte moved
#
# Stage 02 reads global memory in full 128-byte lines, yet runs below 1 % of the FMA peak.
# This stage rewrites the kernel around one rule: **every value brought into shared memory or
# registers must feed as many FMAs as possible.**
#
# ## Objectives
# After this notebook you can:
# - count FMAs per shared-memory wavefront, and explain from that count why stage 02 is slow
# - explain what the FlashAttention-2 loop order, a register tile per thread and padded rows
#   each contribute
# - predict a CUDA-core kernel's speed from instruction issue, shared memory, occupancy and the
#   grid's tail
# - read bank conflicts as a share of wavefronts, and issue-slot use from a profile's stall
#   reasons
#
# **Prerequisites:** notebooks 01 and 02 (online softmax, coalescing, shared-memory banks).
#
# **Time:** about 24 min to read, 45 min to work through.
#
# Three changes serve the rule (see the header of `kernels/03_coarsened.cu`):
#
# 1. **FlashAttention-2 loop order**: one block per query tile, its rows' `m`, `l` and `O` in
#    registers.
# 2. **Thread coarsening (register tiling)**: each of 256 threads computes a 4 × 4 patch of the
#    score tile S and a 4 × D/16 patch of O.
# 3. **Padding**: rows D + 4 floats apart, so a warp's reads fall in different banks.
#
# Everything before the measurement comes from the kernels' own indexing (`flashlab/tiling.py`):
# no GPU needed.

# %%
# %matplotlib inline
import math

import pandas as pd

import flashlab as fl
from flashlab import plots, tiling
from flashlab import notebook as nb
nb.banner("03_coarsened")

the = nb.the_gpu()  # the GPU this notebook's numbers come from (the banner names it)
gpu, cc, sms, roof = the.name, the.cc, the.sms, the.roof  # roof: tables.peaks(gpu), recorded
print(the)

# %% [markdown]
# ## 1 · Where stage 02's time goes
#
# In stage 02's `S = QKᵀ` a thread does one FMA per two 4-byte shared-memory loads. Lane
# `t` reads `Kj[t*d + x]`: 32 rows `d` floats apart. With d = 64 all 32 addresses fall in one of
# the 32 banks, so the load needs 32 passes (**wavefronts**). An SM retires 4 FFMA
# warp-instructions per clock (sm_90) but serves one 128-byte wavefront per clock:

# %%
tiling.work_per_load("02_coalesced")

# %% [markdown]
# Per query row and K/V tile a warp spends 64 × 33 + 64 × 2 = 2240 clocks of shared memory on
# 128 FFMAs the FMA pipes could retire in 32: at most **32 / 2240 ≈ 1.4 %** of the FFMA peak.
# And stage 02 launches only B·H = 64 blocks, leaving more than half of an H100's 132 SMs idle.
#
# ## 2 · Change 1: the FlashAttention-2 loop order
#
# Stages 01 and 02 loop over K/V tiles outside and query tiles inside (FlashAttention-1), so a
# query tile's `O_i`, `m_i` and `l_i` wait in global memory between visits. Swapped, each query
# tile is an independent block that keeps them in registers.

# %%
tiling.loop_orders()

# %% [markdown]
# The footer's bytes by tensor (GB, teaching config). FA-2 re-reads K and V once per query tile,
# but a head's K and V (512 KiB) stay in L2 while its 16 blocks run; FA-1 writes and re-reads O
# at every step.

# %%
traffic = pd.DataFrame({o: tiling.global_bytes(o) for o in ("fa1", "fa2")}) / 1e9
traffic.loc["total"] = traffic.sum()
print(f"at the copy bandwidth ({roof['copy_tbps']:.2f} TB/s) the totals would take "
      + " and ".join(f"{traffic.loc['total', o] / roof['copy_tbps']:.2f} ms ({o})" for o in traffic))
traffic.round(3)

# %% [markdown]
# Even FA-1's traffic at full DRAM bandwidth is small next to stage 02's shared-memory bill
# (17.2 GFLOP at ≈ 0.7 % of the 67 TFLOP/s FFMA peak is ≈ 37 ms). The new order buys
# **parallelism** — 16 × 64 = 1024 blocks instead of 64 — and **register residency**, which the
# next change needs.
#
# ## 3 · Change 2: thread coarsening — a register tile per thread
#
# 256 threads (`tx`, `ty` in 0..15) share a 64 × 64 score tile. Thread (`tx`, `ty`) owns rows
# `ty + 16r` and keys `tx + 16c` (r, c < 4). At each step `k` of the dot product it loads 4 float4
# of Q and 4 of K and does 4 × 4 × 4 = **64 FMAs from 8 loads**. `PV` is tiled alike: 4 float4
# of P and 4 of V feed 64 FMAs into a 4 × 4 patch of O.

# %%
tiling.register_tiles()

# %%
tiling.work_per_load("03_coarsened")

# %% [markdown]
# A load now feeds 8 FMAs instead of ½. Per step the FMA pipes need 64 / 4 = 16 clocks, shared
# memory 12, instruction issue (64 FFMA + 8 loads) / 4 = 18: the loops are **issue-bound at
# 16 / 18 ≈ 89 %** of the FFMA peak. The 12 wavefronts: a Q load serves 2 distinct rows (`ty`,
# `ty + 1`, 16 lanes each), 32 bytes, 1 wavefront; a K load serves 16 distinct rows, 256 bytes,
# at least 2 — *if* the rows fall in different banks.
#
# ## 4 · Change 3: padding against bank conflicts
#
# Lane `tx` reads `Ks[(tx + 16c) * LDK + k]`, 16 bytes. With `LDK = D` every row starts in bank 0,
# so the 16 rows queue up in banks 0–3. With `LDK = D + 4` row `tx` starts at bank `4·tx mod 32`,
# and 8 rows cover all 32 banks (+4, not +1, keeps rows 16-byte aligned for float4).

# %%
tiling.bank_conflicts(D=64)

# %%
for pad, label in ((False, "LDQ = LDK = D,     LDP = BC    "), (True, "LDQ = LDK = D + 4, LDP = BC + 4")):
    print(f"{label}: the inner loops can reach "
          f"{tiling.inner_loop_bound('03_coarsened', pad=pad):.0%} of the FFMA peak")

# %% [markdown]
# Unpadded, the `QKᵀ` loop would cost 4 × 2 + 4 × 16 = 72 wavefronts per 64 FFMAs. V needs no
# padding: a warp reads 16 consecutive float4 of one row.
#
# *Exercise.* The softmax stores `Ps[(ty + 16r) * LDP + tx + 16c]`, one float per lane, with
# `LDP = BC + 4`. Build warp 0's 32 addresses (`tiling.lanes()` gives `tx`, `ty`) and count the
# passes with `tiling.wavefronts(addr, vector=1)`. Which `LDP` makes it one pass while keeping
# the float4 reads of P conflict-free?
#
# ## 5 · The kernel
#
# First the tile geometry:

# %%
nb.show_source("03_coarsened", "Tiles")

# %% [markdown]
# `TM × TN` is the score patch per thread (4 × 4 at D = 64). At D = 128 the launch uses BC = 32,
# so TN = 2 and G = 2: a 4 × 8 O patch and a 4 × 2 score patch keep registers in check. `LDQ`,
# `LDK`, `LDP` are section 4's padded strides.

# %%
nb.show_source("03_coarsened", "coarsened_kernel")

# %% [markdown]
# * **Grid.** Block `b` is query tile `b % tiles` of (batch, head) `b / tiles`; it loads its Q tile
#   once.
# * **K/V loop.** `n_tiles` stops at the diagonal when causal; two barriers bracket the float4
#   copy of K and V into shared memory.
# * **`S = QKᵀ`**, section 3's loop, then the **online softmax**: mask, the row max over the 16
#   lanes sharing `ty` in 4 `__shfl_xor_sync` steps, `acc` and `l` rescaled by `alpha`, and `p`
#   written to shared memory, since `PV` needs whole rows of P.
# * **`O += PV`** after a barrier: 4 float4 of P (broadcast) and one float4 of each V row.
# * **Epilogue.** `row_sum16` adds the 16 partial `l`; O goes out as float4, once.
#
# ## 6 · Resources: registers, shared memory, occupancy

# %%
res = nb.resources("03_coarsened")
res

# %% [markdown]
# An SM has 65 536 registers and 228 KiB of shared memory (sm_90). A block of 256 threads at R
# registers needs 256·R: R ≤ 128 allows 2 blocks per SM. A block's shared memory, 4 bytes ×
# (64·68 + 64·68 + 64·64 + 64·68) = 68 608 B at D = 64, would allow 3. Registers decide:

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
# A quarter of the thread slots is low occupancy, but each thread's 16 independent score
# accumulators hide FMA latency (instruction-level parallelism); not so the three barriers per
# tile and the K/V copy.

# %% [markdown]
# ## 7 · Prediction, before measuring
#
# Per 64 × 64 tile each thread issues, at D = 64 (counted from the source; the last three
# estimate what the compiler emits):
#
# | work | instructions per thread per tile |
# |---|---|
# | `QKᵀ`: 16 steps × 64 FFMA | 1024 |
# | `PV`: 16 steps × 64 FFMA | 1024 |
# | shared-memory loads: 32 steps × 8 LDS.128 | 256 |
# | loop counters, addresses | ≈ 100 |
# | online softmax of 16 scores (mask, shuffles, exp, P stores, rescale) | ≈ 250 |
# | K, V copy: 8 float4 loads + 8 stores, bounds checks | ≈ 200 |
# | **total** | **≈ 2850, of which 2048 FFMA** |
#
# 1. **Issue.** At 4 instructions per clock per SM the FMA pipes are busy at most
#    2048 / 2850 ≈ **72 %** of the time. (Shared memory: 32 × 12 = 384 wavefronts per warp and
#    tile against 512 FMA clocks — close, not the limit.)
# 2. **Latency.** With 16 warps per SM and barriers every tile, expect half to all of that:
#    **36 – 72 %** of the FFMA peak.
# 3. **Tail.** 1024 blocks at 2 per SM on 132 SMs are 3.9 waves; the partial last one costs ≈ 3 %.
# 4. **Which peak.** Stage 03 issues FFMAs like a matrix multiply, so scale by the measured fp32
#    matmul ceiling: cuBLAS's SGEMM, at the clock the GPU holds under load.
#
# **Stage 02**, by the same model, is bound by shared-memory clocks: 1.4 % of the FFMA peak on
# 64 of 132 SMs, at the 1.98 GHz boost clock 0.0143 × 64 / 132 × 66.9 ≈ **0.46 TFLOP/s**.
#
# So: **stage 03 at 35 – 70 % of the fp32 matmul ceiling**, and a speedup over stage 02 of that
# over 0.46 TFLOP/s. For this GPU:

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
# Live, this builds the stage, checks it against float64 on fresh inputs (N = 1, 17, 1000, 4096;
# D = 64 and 128; causal and not), times it at the teaching config (B = 4, H = 16, N = 1024,
# D = 64, fp32) and records the rows; replay shows the recorded ones.

# %%
ev = nb.evaluate("03_coarsened")
ev

# %% [markdown]
# ## 9 · Prediction against measurement

# %%
t = ev.timing()
table = nb.compare().set_index("stage")
m02 = table.loc["02_coalesced", "tflops"]
print(f"stage 03: {t.tflops:.1f} TFLOP/s = {t.tflops / ceiling:.0%} of the fp32 matmul ceiling, "
      f"{t.tflops / ffma_peak:.0%} of the FFMA peak at {clock_ghz} GHz "
      f"(predicted {pred03[0]:.1f} - {pred03[1]:.1f} TFLOP/s)")
print(f"stage 02: {m02:.2f} TFLOP/s (model {pred02:.2f}); speedup "
      f"{nb.speedup('02_coalesced', '03_coarsened'):.0f}x (predicted {pred_speedup[0]:.0f} - "
      f"{pred_speedup[1]:.0f}x)")
print(f"{t.pct_sdpa_best:.0f}% of the fastest fp32 PyTorch attention")

# %% [markdown]
# ### Discussion
#
# The model predicted 18–36 TFLOP/s; stage 03 ran at about 30 TFLOP/s, 59 % of the fp32 matmul
# ceiling, in the band's upper half. Stage 02 landed within a few percent of its shared-memory
# bound (about 0.44 against 0.46 TFLOP/s), so the speedup, about 68×, is inside its 39–78× band
# too. Two counts carried it across two orders of magnitude: FMAs per wavefront (1/33 → 5.3) and
# a grid 16 times larger.
#
# Stage 03 reaches about 94 % of `sdpa_efficient`, a fused fp32 CUDA-core kernel like this one.
# `sdpa_math` and `torch_naive` run cuBLAS's SGEMM, yet fall behind: they write the N × N scores
# to memory and read them back.
#
# ## 10 · The profile: did the conflicts go?
#
# Padding should remove the 32-way load conflicts of stage 02's `Kj[tx*d + x]`. Also predicted:
# 16-byte global loads make **16 sectors per request** the ideal, and occupancy should be
# **about 25 %** (section 6).

# %%
p03 = nb.profile("03_coarsened")
p03

# %%
wf = p03.loc["smem_wavefronts"]
for s in p03.columns:
    ld, st = p03.loc["smem_load_bank_conflicts", s], p03.loc["smem_store_bank_conflicts", s]
    print(f"{s}: bank conflicts, loads {ld:.2g} ({100 * ld / wf[s]:.2g}% of {wf[s]:.2g} wavefronts), "
          f"stores {st:.2g} ({100 * st / wf[s]:.2g}%)")
m = p03["03_coarsened"]
print(f"sectors per global load request {m['global_load_sectors_per_request']:.0f}; achieved "
      f"occupancy {m['achieved_occupancy_pct']:.0f}%")
print("top stalls (% of active warp time): " + ", ".join(
    f"{k.removeprefix('stall_')} {v:.0f}" for k, v in m.filter(like="stall_").nlargest(3).items()))
print(f"issue slots used: {tiling.issue_share(m['achieved_occupancy_pct'], m['stall_selected'], cc):.0%}; "
      f"shared memory busy: >= {tiling.busy_share(wf['03_coarsened'], m['duration_ms'], sms):.0%} "
      f"of the clocks at {clock_ghz} GHz")
for returned in (False, True):
    model = tiling.launch_wavefronts(returned=returned)
    print(f"wavefronts, section 3's model{' + the return path' * returned}: {model:.3g} "
          f"(measured / model: {wf['03_coarsened'] / model:.2f})")

# %% [markdown]
# ### Discussion
#
# Padding worked. Load conflicts were 90 % of stage 02's 4.6·10⁹ wavefronts and are 0.2 % of
# stage 03's 1.1·10⁸: the share, not the 20 000-fold fall in the raw count, says the loads now
# take their minimum passes. Store conflicts *rose*, from 0.7·10⁶ to 2.4·10⁶, yet are 2 % of the
# wavefronts: the 2-way P store of section 4's exercise, not a regression. Sectors per request
# (16) and occupancy (24 %) came out as predicted.
#
# The wavefront total did not: it is about **twice** section 3's count, within 3 % once the path
# back to the registers is counted. That path carries 128 bytes a clock, 4 bytes a lane, so a
# float4 load costs a warp 4 passes however few addresses it has (2 when neighbouring lanes share
# one, as Q's and P's do). Shared memory then needs 768 wavefronts per warp and tile against
# ≈ 712 issue clocks: **shared memory, not issue, is the tighter limit**, busy at least three
# clocks in four.
#
# The stalls agree: the largest, `short_scoreboard` (28 %), is a warp waiting for a shared-memory
# load. A warp issues (`selected`) 18 % of its time, with about 3.8 warps per scheduler: two issue
# slots in three used; with 2048 of ≈ 2850 instructions FFMA, the pipes are ≈ 48 % busy, close
# to the measured 45 % of the FFMA peak. The prediction held, partly for the wrong reason.
#
# ## 11 · Against every stage and baseline
#
# Each stage at the teaching config, with PyTorch's implementations as lines (fp16 ones faded):

# %%
plots.ladder(last="03_coarsened")

# %% [markdown]
# On the roofline the fp32 stages share one intensity, far right of the ridge, and stack
# vertically:

# %%
plots.roofline(last="03_coarsened")

# %% [markdown]
# ## Next: stage 04
#
# On the CUDA cores, the fp32 FMA rate is stage 03's roof. The tensor cores' is far higher:

# %%
tc = roof["matmul_fp16_tflops"]
print(f"fp16 tensor-core matmul ceiling: {tc:.0f} TFLOP/s = {tc / ceiling:.0f}x the fp32 CUDA-core "
      f"one; stage 03 runs at {100 * t.tflops / tc:.1f}% of it.")

# %% [markdown]
# Tuning stage 03 could at best close the gap to the fp32 ceiling. **Stage 04** changes the roof:
# on this FA-2 structure, `QKᵀ` and `PV` become WMMA tensor-core instructions, a warp multiplying
# whole 16 × 16 fp16 fragments into fp32.

# %% [markdown]
# ## Exercises
#
# ### Lab `03.occupancy`
#
# Section 6 found registers deciding stage 03's occupancy at about 120 a thread. Suppose a better
# compiler got the kernel down to 64, and that at D = 128 the launch kept D = 64's 64 × 64 tiles
# instead of its 32-key ones: how many blocks would an SM hold then, and which limit would decide?
# Work it out from each limit, then check it with `tiling.occupancy`.

# %%
from flashlab.course import labs
print(labs.prompt("03.occupancy"))

# %%
### BEGIN SOLUTION
smem_d128_64x64 = 4 * (64 * 132 + 64 * 132 + 64 * 128 + 64 * 68)   # Q, K, V, P rows
limits_d128_64x64 = {"registers": 65536 // (64 * 256), "threads": 2048 // 256, "blocks": 32,
                     "shared memory": 233472 // (smem_d128_64x64 + 1024)}
answer = min(limits_d128_64x64.values())   # shared memory decides: 118 784 bytes a block
### END SOLUTION

# %%
labs.check("03.occupancy", answer)

# %% [markdown]
# ### Kernel exercise `03.coarsen_kernel` (10 points)
#
# **Where:** the `S = QKᵀ` loop of `coarsened_kernel` in `kernels/03_coarsened.cu`, between
# `// BEGIN EXERCISE 03.coarsen_kernel` and `// END EXERCISE 03.coarsen_kernel`. The student
# edition's stub leaves `s` at zero, so every key gets the same score.
#
# **What to write:** section 3's loop: accumulate the thread's `TM × TN` patch `s[r][c]` from rows
# `ty + 16r` of `Qs` and keys `tx + 16c` of `Ks`, four dims a step, each operand read as one
# `float4` from the padded rows (strides `T::LDQ`, `T::LDK`), so that every value loaded feeds `TN`
# or `TM` FMAs. Use the tile constants: at D = 128, and on a 7.5 GPU, a tile holds fewer keys.
#
# **How it is judged.** `flashlab grade` builds stage 03 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp32, and keys whose size grows along the sequence, so that every row's maximum keeps rising
# and each rescale path runs. A wrong kernel scores 0, and the message names the first failing case
# and its first wrong element (batch, head, row, column, got, expected). A right one is timed at the
# teaching config and under the causal mask: when your instructor grades, in turn with the
# solution's stage on the same GPU, the slower of the two ratios counting; when you check your own
# work, against the solution's recorded speedup over stage 02. Full points within 5 % of the
# solution's speed, fewer below.
#
# **GPU:** compute capability 7.5 or newer (a T4 will do); without one, `flashlab grade` skips it
# with one line saying why. Run it with
#
#     flashlab grade --exercise 03.coarsen_kernel

# %% [markdown]
# ## Questions for discussion
#
# 1. The profile says shared memory is busier than the issue slots. Would a 4 × 8 score patch per
#    thread help or hurt? Count FMAs per wavefront, registers and occupancy.
# 2. The P store costs 2 % of the wavefronts. Is it worth fixing before anything else the profile
#    shows? What would you fix first?
# 3. The band was scaled by a measured SGEMM ceiling, not by the FFMA peak at the boost clock.
#    When is a measured ceiling the better yardstick, and when can it mislead?
# 4. The prediction held while one of its counts was wrong by 2×. What should a student conclude
#    from a prediction that lands inside its band?

# %% [markdown]
# **Instructor's answer.** *1.* Probably hurt. A 4 × 8 patch loads 4 + 8 float4 for 4 · 8 · 4 = 128
# FMAs, 10.7 a load instead of 8: a third fewer wavefronts per FMA. But S's accumulators double
# (16 → 32), pushing past 128 registers: one 256-thread block per SM, 8 warps instead of 16, with
# `short_scoreboard` already the top stall (28 %) and barriers to cover. Occupancy, not the pipe,
# may then set the time; measure it.

# %% [markdown]
# **Instructor's answer.** *2.* No: conflicts that are 2 % of the wavefronts cost at most about 2 %
# of a pipe's time. The profile points at larger items: shared memory busy at least 76 % of the
# clocks, a float4 load costing a warp 4 passes back to the registers (twice the counted
# wavefronts), and `short_scoreboard` at 28 %. Fix the shared-memory bytes per FMA first, or
# change the roof: the tensor cores' is 13× higher (stage 04).

# %% [markdown]
# **Instructor's answer.** *3.* A measured ceiling includes what the datasheet leaves out (the
# clock held under load, issue limits, the power cap), so it suits a kernel doing the same work:
# stage 03 issues FFMAs like SGEMM, whose 51.7 TFLOP/s is 77 % of the FFMA peak at 1.98 GHz. It
# misleads when the library falls short of the hardware (an untuned shape), uses instructions the
# kernel cannot, or when the kernel is bound by something else, such as shared memory or latency.

# %% [markdown]
# **Instructor's answer.** *4.* That nothing is grossly wrong, not that each count is right: a band
# 2× wide absorbs a 2× error. Here the wavefront count was off by 1.91×, moving the binding unit
# from issue to shared memory, and the time still fell in the band. Check each term against its
# counter before trusting the model for the next change.

# %% [markdown]
# ## Summary
#
# - Stage 02 was bound by FMAs per shared-memory wavefront (1/33); a 4 × 4 register tile per
#   thread raises it to 5.3 by the bank model, and padding keeps the K reads at the minimum.
# - The FlashAttention-2 loop order, one block per query tile, gives 16 times the blocks and keeps
#   `m`, `l`, `O` in registers.
# - Clocks counted per unit gave a band, 18–36 TFLOP/s; stage 03 measured 30 (68× stage 02).
# - Read bank conflicts as a share of the wavefronts: 0.2 % is conflict-free in practice,
#   whatever the raw count.
# - The profile checks a model's reasons: float4 loads cost twice the counted wavefronts, so
#   shared memory, with issue, limits the CUDA cores.

# %%
nb.reached("03_coarsened")
