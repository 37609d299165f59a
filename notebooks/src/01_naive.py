# %% [markdown]
# # Stage 01 — Naive: flash-attention-minimal
#
# This stage is FlashAttention in its smallest form, the
# [flash-attention-minimal](https://github.com/tspeterkim/flash-attention-minimal) kernel. Every
# later stage is measured against it.
#
# ## Objectives
# After this notebook you can:
# - read a FlashAttention-1 kernel: which thread computes what, and where $m$, $l$ and $O$ live;
# - count shared-memory wavefronts from a kernel's indexing and turn them into a time bound;
# - predict a kernel's time from its parallelism, serial work, memory traffic and bank conflicts;
# - tell a latency-bound kernel from a throughput-bound one by a profile's stall reasons.
#
# **Prerequisites:** notebook 00 (the online softmax, the roofline); CUDA threads, blocks and
# shared memory.
#
# **Time:** about 20 min to read, 40 min to work through.
#
# Two choices define the kernel:
#
# * **FlashAttention-1 loop order.** A block per (batch, head) loads K/V tile $j$ (outer loop),
#   then visits every Q tile $i$ (inner loop), so each row's $m$, $l$ and partial $O$ go to
#   global memory and back at every visit.
# * **One thread per query row.** A block is 32 threads; thread $t$ computes row $t$'s scores,
#   softmax and outputs alone.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import diagrams, plots, tiling
from flashlab import notebook as nb
nb.banner("01_naive")

# %% [markdown]
# The order a block visits the tiles of the score matrix (a 4 × 4 corner of it); every visit is a
# global-memory round trip for that Q tile's $O$, $m$ and $l$:

# %%
diagrams.loop_order()

# %% [markdown]
# And who computes what inside one visit:

# %%
diagrams.thread_ownership("01_naive")

# %% [markdown]
# ## The kernel
#
# The whole file, since everything later is a diff against it:
#
# * A grid of $B \cdot H$ blocks (block `bh` = batch · H + head) of `Br` = 32 threads;
#   `Bc` = `Br` = 32.
# * Outer loop `j`: thread `tx` copies row `tx` of $K_j$ and $V_j$ into shared memory.
# * Inner loop `i`: thread `tx` copies its query row into `Qi`, reads its `m` and `l` from global
#   memory, computes the scores (`Bc`·`d` multiply-adds), `exp` and the row sum, and $P V_j$
#   (`d`·`Bc` multiply-adds), and writes `O`, `m` and `l` back.
# * `l` and `m` live in a global workspace of $2BHN$ floats.
#
# Stage 01 adds three things to the published kernel, none of which changes its memory access
# or loop structure: bounds checks, so any $N \ge 1$ works; the causal mask; and initialising
# $m$, $l$, $O$ on the first K/V tile instead of on the host. The three `extern "C"` functions at
# the bottom are the interface every stage implements (notebook 00's appendix).

# %%
nb.show_source("01_naive")

# %% [markdown]
# ## Resources
#
# What `ptxas -v` gave each thread (no GPU needed). Check for zero spills. The shared memory is
# dynamic, so the static column reads 0: the kernel asks at launch for
# $(3 \cdot B_c d + B_c B_r) \cdot 4 = (3 \cdot 32 \cdot 64 + 32 \cdot 32) \cdot 4$ bytes = 28 KiB
# at $d = 64$.

# %%
nb.resources("01_naive")

# %% [markdown]
# ## Prediction
#
# At the teaching config ($B=4$, $H=16$, $N=1024$, $d=64$, fp32) the work is
# $4BHN^2d \approx 17.2$ GFLOP.
#
# **Parallelism.** The grid is $BH = 64$ blocks of one warp. Of the H100's 132 SMs, each with room
# for 64 warps, 68 get nothing and 64 hold one warp (first figure below), which sits out every
# latency itself.
#
# **Serial work.** Thread $t$ owns one row in each of the $T_r = N/B_r = 32$ Q tiles and meets
# each of the $T_c = 32$ K/V tiles, doing $B_c d + d B_c = 4096$ multiply-adds per visit:
# $32 \cdot 32 \cdot 4096 \approx 4.2$ M in a row. At one per clock at 2 GHz that is 2.1 ms,
# 8 TFLOP/s: the ceiling of this way of splitting the work.
#
# **Global memory.** Lane $t$ copies row $t$, so one load instruction touches 32 rows
# $4d = 256$ bytes apart: 32 sectors, 4 bytes used in each (second figure). The volume is modest:
# about 1.6 GB ($Q$ read, $O$ read and written, once per K/V tile), under a millisecond at
# 3 TB/s. What hurts is latency: every miss costs hundreds of clocks.
#
# **Shared memory.** Shared memory has 32 banks, 4 bytes wide; a word's bank is its index mod 32,
# and a bank delivers one word per clock. In the score loop lane $t$ reads `Qi[t*d + x]`: at
# $d = 64$ all 32 lanes hit bank $x \bmod 32$, so the read takes 32 clocks (32 *wavefronts*). In
# $PV$ it reads `S[Bc*t + y]`, stride 32: 32-way again. `Kj[y*d + x]` and `Vj[y*d + x]` are one
# word for all lanes (a broadcast, 1 clock). So a multiply-add costs about 33 clocks of the SM's
# shared-memory pipe: $4096 \cdot 33 \approx 135$ k clocks per visit, $\times\,1024$ visits
# $\approx 1.4 \cdot 10^8$ clocks, **about 70 ms** at 1.98 GHz.
#
# **Prediction: bank conflicts set the time** — about 70 ms of shared-memory traffic on each busy
# SM, plus the global-memory latency one warp cannot hide: 70–100 ms, about 0.2 TFLOP/s. The
# table below makes the count from the kernel's indexing: each access, how often a warp executes
# it per visit (`per_warp`), its `wavefronts`, and `cycles` = per_warp × wavefronts × warps.

# %%
diagrams.grid_fill("01_naive")

# %%
diagrams.access_pattern("01_naive")

# %%
diagrams.smem_accesses("01_naive")

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM: put your GPU's here
bound_ms = diagrams.smem_bound_ms("01_naive", fl.TEACHING.N, fl.TEACHING.D, clock_ghz)
gflop = fl.TEACHING.flops / 1e9
print(f"{gflop:.1f} GFLOP. Shared memory alone: {bound_ms:.0f} ms at {clock_ghz} GHz, "
      f"so at most {gflop / bound_ms:.2f} TFLOP/s.")

# %% [markdown]
# ## Measurement
#
# On a GPU, `nb.evaluate` builds the kernel, checks it against float64 on fresh random inputs
# ($N$ = 1, 17, 1000, 4096; $d$ = 64, 128; causal and not), times it at the teaching config and
# records the rows. Without a GPU it returns the recorded rows.

# %%
ev = nb.evaluate("01_naive")
ev

# %% [markdown]
# The check, case by case: the largest relative error against float64 (tolerance $10^{-4}$).

# %%
ev.check.pivot_table(index="N", columns=["D", "causal"], values="rel_err", aggfunc="max")

# %% [markdown]
# ## Prediction against measurement

# %%
t = ev.timing()
print(f"Measured {t.median_ms:.1f} ms, {t.tflops:.2f} TFLOP/s, on {t.gpu}. The shared-memory "
      f"count predicted {bound_ms:.0f} ms: {bound_ms / t.median_ms:.0%} of the measured time.")

# %% [markdown]
# ### Discussion
#
# We predicted 70–100 ms; the H100 measured about 98 ms, 0.18 TFLOP/s, and the shared-memory
# count comes to about three quarters of that. The number held. Its *reason* is another matter: a
# count that lands near the measured time does not show that it sets the time. If bank conflicts
# did, the shared-memory pipe would be busy nearly all the time and warps would queue for it
# (`mio_throttle`). The profile below shows neither: the kernel is bound by latency, its single
# warp waiting for one load after another.

# %% [markdown]
# ## The profile
#
# Nsight Compute reads the hardware counters of one launch (`nb.profile`: live with a GPU and
# `ncu`, else the recorded metrics). What the prediction expects:
#
# * **about 32 sectors per global load request** (a few loads, such as `m[row]`, touch fewer);
# * **a very large count of bank conflicts**: the 32-way reads of `Qi` and `S`;
# * **achieved occupancy near 1/64**: one warp where 64 fit;
# * stalls dominated by shared memory (`mio_throttle`, `short_scoreboard`) and global memory
#   (`long_scoreboard`).

# %%
p01 = nb.profile("01_naive")
p01

# %%
m = p01["01_naive"]
stalls = m.filter(like="stall_").sort_values(ascending=False).head(3)
print(f"global load sectors per request: {m['global_load_sectors_per_request']:.1f}")
print(f"shared-memory bank conflicts: {m['smem_load_bank_conflicts']:.3g} on loads, "
      f"{m['smem_store_bank_conflicts']:.3g} on stores")
print(f"achieved occupancy: {m['achieved_occupancy_pct']:.1f}% of the warp slots "
      f"(1/64 = {100 / 64:.1f}%)")
print("top stalls (% of active warp time): "
      + ", ".join(f"{k.removeprefix('stall_')} {v:.0f}" for k, v in stalls.items())
      + f"; mio_throttle {m['stall_mio_throttle']:.0f}, long_scoreboard {m['stall_long_scoreboard']:.0f}")
sms = fl.TEACHING.B * fl.TEACHING.H  # SMs with a block: one warp each
busy = tiling.busy_share(m["smem_wavefronts"], m["duration_ms"], sms, clock_ghz=clock_ghz)
print(f"shared-memory pipe busy {busy:.0%} of the kernel's time (1 wavefront per clock per SM "
      f"at {clock_ghz} GHz)")

# %% [markdown]
# ### Discussion
#
# Sectors per request (about 32) and occupancy (1.6 %) are as predicted. The rest is not:
#
# * **Bank conflicts**, about $4.2 \cdot 10^9$, are half what the count charged: the score reads
#   of `Qi` alone. The $PV$ reads of `S` did not conflict (the next section shows why).
# * **The shared-memory pipe is busy about 40 % of the time.**
# * **`mio_throttle` is 0**: no warp ever waited for room in that pipe, as warps of a
#   conflict-bound kernel would.
# * **`short_scoreboard` is about 69 %** of the warp's time: waiting for the result of a
#   shared-memory load (or an `exp`). `wait`, about 17 %, is the fixed latency between dependent
#   instructions; `long_scoreboard`, waiting on global memory, only about 4 %.
#
# So stage 01 is **latency bound**: its one warp per SM issues a load, waits for it, computes,
# and issues the next, with no other warp to run meanwhile. The conflicts lengthen each wait on
# `Qi`, but the pipe is idle most of the time. The cure is more warps per SM, or more
# independent work per warp.

# %% [markdown]
# ## Stage 01 beside the published kernel
#
# Stage 01 has the published kernel's algorithm, tiles and access pattern, yet on the H100 it
# runs about 1.7× faster. `tools/compare_minimal.py` finds out why. It builds the published code
# the way its README does and times it in the same process as stage 01, then times variants of
# its kernel, each one edit further from the original (the edits are made to a checkout in a
# temporary directory). The `speedup` column is over the published extension:

# %%
nb.published_minimal()

# %% [markdown]
# ### Discussion
#
# * **The host side costs nothing.** The published `forward()` allocates `l` and `m` on the CPU,
#   copies them to the GPU, queries a device attribute and prints a line on every call. Against
#   the kernel alone that is about 0.5 ms of 167.
# * **Compiler flags change nothing.** `-O2` or `-O3`: nvcc's `-O` sets the host compiler's
#   level, and `ptxas` optimises device code at `-O3` either way.
# * **The whole difference is one line: the tile sizes are constants.** The published kernel
#   receives `Bc` and `Br` as kernel arguments; stage 01 declares `constexpr int Bc = 32`. With
#   the trip count known, the compiler unrolls the loops over a tile's 32 keys, and in $PV$ it
#   loads the thread's 32 probabilities from `S` into registers once per visit (eight `LDS.128`,
#   four floats each; the kernel grows from 32 to 56 registers). The published kernel re-reads
#   `S[Bc*tx + y]` from shared memory for every one of the $d$ output columns: $32 \cdot 64$
#   conflicted loads per visit instead of 8. That is the $PV$ conflict the profile did not find.
# * **64-bit offsets cost about 4 %.** Stage 01 computes its offsets in `size_t`, so tensors of
#   $2^{31}$ elements or more index correctly; its bounds checks and masks cost under 1 % more.
#
# Sizes the compiler can see are worth more than any flag. Every later stage takes its tile
# shape as template parameters for this reason.

# %% [markdown]
# ## Against PyTorch
#
# Stage 01 and PyTorch's attention at the teaching config. The bar is the stage; lines are
# PyTorch's fp32 implementations, with its fp16 flash and cuDNN kernels faded:

# %%
plots.ladder(last="01_naive")

# %%
cmp = nb.compare().query("kind == 'baseline' or stage == '01_naive'").reset_index(drop=True)
cmp

# %%
best = cmp[cmp["kind"] == "baseline"].iloc[-1]
print(f"The fastest PyTorch fp32 attention ({best.stage}) is "
      f"{nb.speedup('01_naive', best.stage):.0f}x faster than stage 01.")

# %% [markdown]
# ## Next: stage 02
#
# Stage 02 keeps the algorithm and gives a block 32 warps: warp $w$ owns query row $w$, lane $t$
# key $t$ of the tile. Each busy SM gets 32 warps to switch between, and tile copies read 32
# consecutive floats (4 sectors instead of 32). The grid, the round trips and the 32-way conflict
# in the score loop stay.

# %% [markdown]
# ## Exercises
#
# ### Lab `01.bank_wavefronts`
#
# The prediction charged the score loop's read of `Qi[t*d + x]` as 32-way at $d = 64$, where
# every row starts in the same bank. Other models use other head dims: count the same read at
# $d = 80$ with the bank model. Which bank does each lane's word fall in, and how many wavefronts
# does one such read of the warp take? Work it out by hand first. Then try rows of $d + 1$ and
# $d + 2$ floats: what would padding `Qi`'s rows buy?

# %%
from flashlab.course import labs
print(labs.prompt("01.bank_wavefronts"))

# %%
### BEGIN SOLUTION
from flashlab import banks as bank_model
qi_words_d80 = [80 * lane for lane in range(32)]   # lane t reads word 80 t + x, at x = 0
answer = bank_model.wavefronts(qi_words_d80)[0]    # bank 16 t mod 32: 0 or 16, 16 words each
### END SOLUTION

# %%
labs.check("01.bank_wavefronts", answer)

# %% [markdown]
# ## Questions for discussion
#
# 1. The shared-memory count came within a quarter of the measured time, yet did not set it.
#    Without a profiler, what experiment would have told you?
# 2. Loads touch 32 sectors per request, yet `long_scoreboard` is a few percent. Why does
#    uncoalesced access cost so little here?
# 3. With one warp per SM, which helps more: removing the conflict on `Qi`, or giving each thread
#    two independent query rows? Argue from the stall reasons.
# 4. If $B \cdot H$ were 132, what would change in the time, and in the profile?

# %% [markdown]
# **Instructor's answer.** *1.* Give each busy SM twice the work without changing what a warp does:
# at B·H = 264 every SM holds two blocks. A kernel bound by its shared-memory pipe then takes about
# twice as long; a latency-bound one, whose pipe idles 60 % of the time, about as long as before,
# its two warps waiting side by side. Timing B·H = 64 against 264 takes two runs and no counters.

# %% [markdown]
# **Instructor's answer.** *2.* Uncoalesced loads waste bandwidth, and this kernel uses almost none
# (DRAM busy 0.12 %). Per visit a thread loads its row of Q and its m and l once, against 4 096
# multiply-adds that each wait on shared memory, so global loads are a small part of the chain; and
# most of them hit the L2: DRAM moved about 0.4 GB of the 1.6 GB the loads ask for. A request's 32
# sectors are fetched in parallel, so it costs about one latency, not 32.

# %% [markdown]
# **Instructor's answer.** *3.* Two independent rows. The stalls say the warp waits for results
# (`short_scoreboard` 69 %, `wait` 17 %) while no pipe is full (`mio_throttle` 0, shared memory
# busy 40 %): a second chain of work fills those waits, up to about 2× before the shared-memory
# pipe fills. Removing the conflict shortens each `Qi` read by its 31 extra wavefronts, but the
# warp still waits for every read and for everything else in its chain. Stage 02 takes the first
# road, with 32 warps, and gains 2.5×.

# %% [markdown]
# **Instructor's answer.** *4.* The time would stay about 98 ms: each block still runs alone on its
# SM, one warp in 64, so the 68 new blocks fill idle SMs and TFLOP/s rises by 132 / 64 ≈ 2.1×, to
# about 0.36. Per SM the profile would not change (1.6 % occupancy, `short_scoreboard` on top);
# only GPU-wide counters, such as `sm_throughput_pct` and DRAM traffic, would about double.

# %% [markdown]
# ## Summary
#
# - Stage 01 is FlashAttention-1 with one thread per query row: 64 blocks of one warp, 68 SMs
#   idle.
# - Counting wavefronts from the indexing bounds the time (about 73 ms); the kernel measured
#   about 98 ms, 0.18 TFLOP/s.
# - The profile shows a **latency-bound** kernel: `short_scoreboard` about 69 % of warp time,
#   `mio_throttle` 0, the shared-memory pipe busy well under half the time.
# - A prediction's number can land while its reason is wrong; the stall reasons test the reason.

# %%
nb.reached("01_naive")
