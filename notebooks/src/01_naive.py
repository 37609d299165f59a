# %% [markdown]
# # Stage 01 — naive: flash-attention-minimal
#
# Attention computes $O = \mathrm{softmax}(QK^\top/\sqrt{d})\,V$ for every (batch, head): $N$
# queries, $N$ keys, head dim $d$. Done directly, it writes the $N \times N$ score matrix to
# memory. FlashAttention never does. It walks the score matrix in tiles small enough for on-chip
# shared memory and keeps two numbers per query row: the largest score so far, $m$, and the sum
# of exponentials, $l$. When a tile raises the maximum from $m$ to $m'$, the partial output and
# $l$ are rescaled by $e^{m - m'}$ (the *online softmax*), so the result is exact.
#
# This stage is the algorithm in its smallest form, the
# [flash-attention-minimal](https://github.com/tspeterkim/flash-attention-minimal) kernel. Two
# choices define it:
#
# * **FlashAttention-1 loop order.** A block per (batch, head) loads K/V tile $j$ once (outer
#   loop), then visits every Q tile $i$ (inner loop). Each query row is revisited once per K/V
#   tile, so its $m$, $l$ and partial $O$ go to global memory and back at every visit.
# * **One thread per query row.** A block is 32 threads; thread $t$ computes row $t$'s scores,
#   their softmax and its $d$ outputs, alone.
#
# Every later stage is measured against this one.

# %%
%matplotlib inline
import flashlab as fl
from flashlab import diagrams, plots
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
# The whole file, since everything later is a diff against it. How to read it:
#
# * `naive_kernel` runs on a one-dimensional grid of $B \cdot H$ blocks (block `bh` = batch · H +
#   head) of `Br` = 32 threads; `Bc` = `Br` = 32.
# * Outer loop `j`: thread `tx` copies row `tx` of $K_j$ and $V_j$ into shared memory.
# * Inner loop `i`: thread `tx` copies its query row into `Qi`, reads its `m` and `l` from global
#   memory, then runs three loops on its own: the scores (`Bc`·`d` multiply-adds), `exp` and the
#   row sum, and $P V_j$ (`d`·`Bc` multiply-adds), writing `O`, `m` and `l` back.
# * `l` and `m` live in a global workspace of $2BHN$ floats (`flashlab_workspace_bytes`).
#
# flashlab added three things to the published kernel, none of which changes its memory-access
# pattern or loop structure (they cost a few compares per loop): bounds checks, so that any $N \ge 1$ works (tiles past $N$ read zeros and score $-\infty$); the
# causal mask; and initialising $m$, $l$, $O$ on the first K/V tile (`j == 0`) instead of on the
# host, so the output is never read before it is written. The three `extern "C"` functions at the
# bottom are flashlab's contract with every stage (`kernels/flashlab.h`): can this problem run,
# how much scratch memory does it need, launch.

# %%
nb.show_source("01_naive")

# %% [markdown]
# ## Resources
#
# What the compiler gave each thread, from `ptxas -v` (nvcc on this machine; no GPU needed).
# Zero spills is what to check. The shared memory is dynamic, so the static column reads 0:
# the kernel asks at launch for $(3 \cdot B_c d + B_c B_r) \cdot 4$ bytes
# $= (3 \cdot 32 \cdot 64 + 32 \cdot 32) \cdot 4 = 28$ KiB at $d = 64$.

# %%
nb.resources("01_naive")

# %% [markdown]
# ## Prediction
#
# At the teaching config ($B=4$, $H=16$, $N=1024$, $d=64$, fp32) the work is
# $4BHN^2d = 4 \cdot 4 \cdot 16 \cdot 1024^2 \cdot 64 \approx 17.2$ GFLOP.
#
# **Parallelism.** The grid is $BH = 64$ blocks of one warp. An H100 or H200 has 132 SMs, each
# with room for 64 warps: 68 SMs get nothing, and each of the other 64 holds a single warp (first
# figure below). A lone warp issues at most one instruction per clock and sits out every latency
# itself.
#
# **Serial work.** Thread $t$ owns one row in each of the $T_r = N/B_r = 32$ Q tiles and meets
# each of the $T_c = N/B_c = 32$ K/V tiles, doing $B_c d + d B_c = 4096$ multiply-adds per
# visit: $32 \cdot 32 \cdot 4096 \approx 4.2$ M in a row. Even at one per clock at 2 GHz that is
# 2.1 ms, 8 TFLOP/s: the ceiling of this way of splitting the work.
#
# **Global memory.** Lane $t$ copies row $t$, so one load instruction touches 32 rows
# $4d = 256$ bytes apart: 32 sectors of 32 bytes, 4 bytes used in each (second figure). The
# volume is modest, though: $K$ and $V$ are read once ($2 \times 16.8$ MB), $Q$ once per K/V tile
# ($32 \times 16.8$ MB), $O$ read and written once per K/V tile ($2 \times 32 \times 16.8$ MB):
# about 1.6 GB, well under a millisecond at 3–5 TB/s. What hurts is latency: every miss costs
# hundreds of clocks, and one warp has nothing to do meanwhile.
#
# **Shared memory.** Every multiply-add reads two words of shared memory, and one of the two
# conflicts. Shared memory has 32 banks, 4 bytes wide; a word's bank is its index mod 32, and a bank
# delivers one word per clock. In the score loop lane $t$ reads `Qi[t*d + x]`: at $d = 64$ all 32
# lanes hit bank $x \bmod 32$, so the read takes 32 clocks (32 *wavefronts*). In $PV$ it reads
# `S[Bc*t + y]`, stride 32: 32-way again. `Kj[y*d + x]` and `Vj[y*d + x]` are one word for all lanes
# (a broadcast, 1 clock). So a multiply-add costs about 33 clocks of the SM's shared-memory pipe:
# $4096 \cdot 33 \approx 135$ k clocks per visit, $\times\,1024$ visits $\approx 1.4 \cdot 10^8$
# clocks, **about 70 ms** at 1.98 GHz.
#
# **Prediction: bank conflicts set the time** — about 70 ms of shared-memory traffic on each busy
# SM, plus the global-memory latency one warp cannot hide: 70–100 ms, about 0.2 TFLOP/s. Neither
# the uncoalesced loads nor the FLOPs come close. The cells below draw the first two points and
# make the shared-memory count from the kernel's own indexing: each access, how often a warp
# executes it per visit (`per_warp`), its `wavefronts`, and `cycles` = per_warp × wavefronts ×
# warps per block.

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
# On a GPU, `nb.evaluate` builds the kernel, checks it against a float64 reference on fresh random
# inputs ($N$ = 1, 17, 1000 and 4096; $d$ = 64 and 128; causal and not), times it at the teaching config
# and records the rows in `data/results.csv`. Without a GPU it returns the recorded rows.

# %%
ev = nb.evaluate("01_naive")
ev

# %% [markdown]
# The check, case by case: the largest relative error against float64 (the tolerance is $10^{-4}$).

# %%
ev.check.pivot_table(index="N", columns=["D", "causal"], values="rel_err", aggfunc="max")

# %% [markdown]
# ## Prediction against measurement

# %%
t = ev.timing()
print(f"Measured {t.median_ms:.1f} ms, {t.tflops:.2f} TFLOP/s, on {t.gpu}. The shared-memory "
      f"count predicted {bound_ms:.0f} ms: {bound_ms / t.median_ms:.0%} of the measured time.")

# %% [markdown]
# The count of bank-conflicted shared-memory reads, made without running anything, accounts for most
# of the measured time: this kernel is bound by shared-memory bank conflicts on the 64 SMs that have
# work. The rest is mostly latency that a single warp per SM cannot hide: every visit starts by
# loading a query row, $m$ and $l$ from global memory, and every output element reads and writes $O$
# there, with no other warp to run in the meantime. The uncoalesced loads cost through that latency,
# not through bandwidth.
#
# For scale, two figures quoted in the project's issue (not measured here): the published
# flash-attention-minimal kernel took 168.7 ms (0.10 TFLOP/s) on an H100 at this config, and the
# fastest scalar kernel of a public progression built on it took 20.0 ms (0.86 TFLOP/s). They
# come from other timing harnesses on another GPU, so compare orders of magnitude, not digits;
# ours come from the GPU named above.

# %% [markdown]
# ## The profile
#
# Nsight Compute reads the hardware counters of one launch of the kernel (`nb.profile`, which
# `flashlab run --profile` also runs for every stage; live here if this machine has a GPU and
# `ncu`, else the recorded metrics). What the analysis above predicts it will show:
#
# * **about 32 sectors per global load request** — every tile copy is one row per lane
#   (a few loads, such as `m[row]`, touch fewer);
# * **a very large count of shared-memory bank conflicts** — the 32-way reads of `Qi` and `S`;
# * **achieved occupancy near 1/64** on the SMs that have work — one warp where 64 fit;
# * stalls dominated by waiting on shared memory (`mio_throttle`, `short_scoreboard`) and on
#   global memory (`long_scoreboard`), with nobody else to switch to.

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
      + ", ".join(f"{k.removeprefix('stall_')} {v:.0f}" for k, v in stalls.items()))

# %% [markdown]
# ## Against PyTorch
#
# Every stage and PyTorch's attention at the teaching config, on the GPU the table was recorded on.
# Bars are the stages; horizontal lines are PyTorch's fp32 implementations, with its fp16 flash
# and cuDNN kernels faded for reference:

# %%
plots.ladder()

# %%
cmp = nb.compare()
cmp

# %%
best = cmp[cmp["kind"] == "baseline"].iloc[-1]
print(f"The fastest PyTorch fp32 attention ({best.stage}) is "
      f"{nb.speedup('01_naive', best.stage):.0f}x faster than stage 01.")

# %% [markdown]
# ## Next: stage 02
#
# Stage 02 keeps the algorithm and changes who does what. A block becomes 32 warps: warp $w$ owns
# query row $w$, and lane $t$ owns key $t$ of the K/V tile for the scores and output columns
# $t, t+32, \dots$ for $O$. Tile copies go by consecutive elements, so a warp's load reads 32
# consecutive floats (4 sectors instead of 32), each thread's serial work per visit drops 32×,
# and the $PV$ loop stops conflicting in shared memory. It does not change the grid (still 64
# blocks), the FlashAttention-1 round trips, or the 32-way conflict in the score loop.
