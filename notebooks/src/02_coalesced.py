# %% [markdown]
# # Stage 02 — coalesced loads
#
# Stage 01 gives each thread a whole query row. So when a warp copies a tile, its 32 lanes read
# 32 different rows, and each thread does all of its row's arithmetic alone. Stage 02 keeps the
# algorithm — FlashAttention-1 loop order, $m$ and $l$ in global memory, $B_c = B_r = 32$ — and
# changes who does what:
#
# * A block is $32 \times 32$ threads. Warp `ty` owns query row `ty` of the tile; lane `tx` owns
#   key `tx` of the K/V tile for the scores, and output columns `tx`, `tx`+32, … for $O$.
# * Tiles are copied by consecutive threads taking consecutive floats, so one load instruction of a
#   warp reads 32 neighbouring floats: 128 bytes, 4 sectors, instead of 32 sectors.
# * The row max and row sum, which a thread used to loop over, become warp shuffles.
#
# One load instruction of warp 0, before and after:

# %%
%matplotlib inline
import math

import flashlab as fl
from flashlab import diagrams, plots
from flashlab import notebook as nb
nb.banner("02_coalesced")

# %%
diagrams.access_comparison()

# %% [markdown]
# And the work of one (j, i) visit, coloured by the lane that does it (compare stage 01's figure,
# where thread $t$ did all of row $t$):

# %%
diagrams.thread_ownership("02_coalesced")

# %% [markdown]
# ## The kernel
#
# What changed since stage 01:
#
# * `load_tile`: thread `tid` of 1024 copies elements `tid`, `tid` + 1024, … of the tile, so each
#   warp reads one contiguous stretch. The same function loads $K_j$, $V_j$ and $Q_i$.
# * Scores: each lane computes one, `s += Qi[ty * d + x] * Kj[tx * d + x]`; `warp_max` and
#   `warp_sum` combine the row in 5 shuffle steps each.
# * $PV$: lane `tx` produces output columns `tx`, `tx` + 32, …, reading the warp's row of $P$
#   (the same word for every lane) and a row of $V_j$ (32 consecutive words). Stores of $O$ are
#   coalesced the same way.
# * Synchronisation: `__syncthreads` once the Q tile is in and again at the end of the visit;
#   `__syncwarp` where a warp reads back the row of $P$ it just wrote. Lane 0 alone writes $m$
#   and $l$.
# * `__launch_bounds__(Bc * Br)` tells the compiler the block has 1024 threads, so it keeps each
#   thread within $65536 / 1024 = 64$ registers and the block can launch.

# %%
nb.show_diff("01_naive", "02_coalesced")

# %%
nb.show_source("02_coalesced", "load_tile")

# %% [markdown]
# ## Resources
#
# 1024 threads at up to 64 registers take the SM's whole register file (64 K registers), so an SM
# holds one block. That costs nothing here: the grid has fewer blocks (64) than the GPU has SMs.

# %%
nb.resources("02_coalesced")

# %% [markdown]
# ## Prediction
#
# The stage advertises two improvements:
#
# 1. **32 warps per block instead of 1.** A thread's serial work per visit falls from
#    $2 B_c d = 4096$ multiply-adds to $d + (d/32) B_c = 128$, and each SM has 32 warps to switch
#    between while some wait on memory.
# 2. **8× fewer sectors per load** (32 → 4), every byte used.
#
# If either set the time we would expect 10–30×. But stage 01's time was set by neither: it was
# set by shared-memory bank conflicts. Count them again, per visit and per block:
#
# * **Scores.** Lane `tx` reads `Kj[tx * d + x]`: key row `tx`, $d = 64$ floats from its
#   neighbour, so all 32 lanes hit the same bank (as they do whenever $d$ is a multiple of 32):
#   32-way, the same conflict stage 01 had on `Qi`, moved to `Kj`. `Qi[ty * d + x]` is one word
#   for the whole warp (a broadcast). 32 warps × 64 reads × (32 + 1) clocks $\approx$ 67.6 k
#   clocks.
# * **$PV$.** `S[ty * Bc + y]` is a broadcast; `Vj[y * d + x]` with `x = tx` is 32 consecutive
#   words, one per bank. 32 warps × 64 iterations × 2 reads $\approx$ 4.1 k clocks, where stage 01
#   paid about 67.6 k.
#
# About 72 k clocks per visit against stage 01's 140 k: the shared-memory bound only halves, to
# about 37 ms at 1.98 GHz. Arithmetic is no limit: $32 \times 128$ warp multiply-adds at 4 per
# clock per SM is about 1 k clocks per visit. Global loads are now coalesced, and 32 warps can hide
# their latency.
#
# **Prediction: about 2× faster**, close to the new shared-memory bound (≈ 37 ms,
# ≈ 0.46 TFLOP/s). The effect that dominates is neither the extra threads nor coalescing but the
# removal of the $PV$ bank conflict; the extra warps help only by keeping the shared-memory pipe
# busy while others wait for global memory. The bottleneck left is the 32-way conflict in
# `Kj[tx * d + x]`, which stage 03 removes. And the grid is unchanged: 64 blocks, 68 idle SMs.

# %%
diagrams.grid_fill(["01_naive", "02_coalesced"])

# %%
diagrams.smem_accesses("02_coalesced")

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM: put your GPU's here
bound = {s: diagrams.smem_bound_ms(s, fl.TEACHING.N, fl.TEACHING.D, clock_ghz)
         for s in ("01_naive", "02_coalesced")}
predicted = bound["01_naive"] / bound["02_coalesced"]
print(f"Shared-memory bound at {clock_ghz} GHz: {bound['01_naive']:.0f} ms (stage 01) → "
      f"{bound['02_coalesced']:.0f} ms (stage 02): a predicted speedup of {predicted:.2f}x.")

# %% [markdown]
# ## Measurement
#
# As in stage 01: on a GPU, build, check against float64 on fresh inputs, time at the teaching
# config and record; without one, the recorded rows. (The comparison below needs stage 01's row
# from the same GPU: on a GPU, run notebook 01 first.)

# %%
ev = nb.evaluate("02_coalesced")
ev

# %%
ev.check.pivot_table(index="N", columns=["D", "causal"], values="rel_err", aggfunc="max")

# %% [markdown]
# ## Prediction against measurement

# %%
ms = nb.compare().set_index("stage")["median_ms"]
share = {s: bound[s] / ms[s] for s in bound}
print(f"Measured speedup {nb.speedup('01_naive', '02_coalesced'):.2f}x, predicted "
      f"{predicted:.2f}x. The shared-memory bound is {share['01_naive']:.0%} of stage 01's "
      f"measured time and {share['02_coalesced']:.0%} of stage 02's.")

# %% [markdown]
# The measured speedup is the product of two factors: the predicted one, the ratio of the two
# shared-memory bounds (the $PV$ conflict removed); and the ratio of the two shares printed above,
# how close each stage runs to its bound. Stage 02 should run closer to its bound than stage 01
# does, because 32 warps keep the shared-memory pipe busy while some of them wait on global memory,
# where stage 01's lone warp stalls on every load. That second factor is all that the coalesced
# loads and the 32× more threads could buy: the large gains they promise stay locked behind the bank
# conflict in `Kj[tx * d + x]`.
#
# The lesson generalises: a change that removes a real inefficiency speeds a kernel up only as far
# as the next bottleneck allows. Count the bottleneck before you predict.

# %% [markdown]
# ## The profile: the metric this stage targets
#
# Coalescing is about one number: how many 32-byte sectors a warp's global load request touches.
# The figure at the top predicts **32 → 4** for the tile copies, an 8× cut; the loads of `m` and
# `l`, where the whole warp now reads one address, need a single sector. By section 2's count,
# shared-memory bank conflicts should roughly halve (the $PV$ conflict is gone, the `Kj` one
# stays), and occupancy should rise from one warp per busy SM to 32.

# %%
p02 = nb.profile("02_coalesced")
p02

# %%
spr = p02.loc["global_load_sectors_per_request"]
bank = p02.loc["smem_load_bank_conflicts"]
occ = p02.loc["achieved_occupancy_pct"]
print(f"sectors per global load request: {spr['01_naive']:.1f} -> {spr['02_coalesced']:.1f} "
      f"({spr['01_naive'] / spr['02_coalesced']:.1f}x fewer; the tile copies alone: 32 -> 4)")
print(f"shared-memory load bank conflicts: {bank['01_naive']:.3g} -> {bank['02_coalesced']:.3g} "
      f"({bank['01_naive'] / bank['02_coalesced']:.1f}x fewer)")
print(f"achieved occupancy: {occ['01_naive']:.1f}% -> {occ['02_coalesced']:.1f}%")

# %% [markdown]
# Coalescing shows exactly where predicted. The bank-conflict prediction, though, is **wrong**:
# the count did not halve. Check it against the arithmetic of section 2. The scores alone — 64
# reads per row and visit, each 32-way, so 31 extra wavefronts — predict this many for either
# stage:

# %%
cfg = fl.TEACHING
tiles = math.ceil(cfg.N / 32)                      # Br = Bc = 32
scores_only = cfg.B * cfg.H * tiles * tiles * 32 * cfg.D * 31
print(f"QK^T reads alone: {scores_only:.3g} extra wavefronts; measured: "
      f"{bank['01_naive']:.3g} (stage 01), {bank['02_coalesced']:.3g} (stage 02)")

# %% [markdown]
# Both stages match the score reads alone, within a fraction of a percent. So stage 01 never paid
# the 32-way $PV$ conflict that section 2 charged it with: the compiler serves stage 01's reads of
# `S` far more cheaply than the source suggests (its SASS, `flashlab sass 01`, reads shared memory
# 16 bytes at a time with `LDS.128`; how it schedules those reads is a good exercise with
# `cuobjdump -sass`). Our count of stage 01's bottleneck was too pessimistic.
#
# Then where did the speedup come from? The stall reasons answer it:

# %%
stall = p02.loc[[r for r in p02.index if r.startswith("stall_")]]
top = stall.max(axis=1).sort_values(ascending=False).index[:4]
stall.loc[top].round(1)

# %% [markdown]
# Stage 01's one warp per block spends most of its time on `short_scoreboard`: it waits for the
# result of each shared-memory read, a **latency** stall, because no other warp on the SM can
# issue meanwhile. Stage 02 issues the very same conflicted reads from 32 warps, and its top
# stall becomes `mio_throttle`: the shared-memory pipe is full, a **throughput** limit. The
# conflicts cost the same number of wavefronts, but they are now served back to back instead of
# one round trip at a time. That — more warps to hide latency, not the removed conflict — is
# what the measured speedup bought, and it is why the prediction of about 2× landed close for
# the wrong reason. The next bottleneck is now plain: the 32-way `Kj` reads saturate the
# shared-memory pipe, which stage 03 attacks.
#
# The lesson of this stage: a profile checks the *reason* for a prediction, not only its number.

# %% [markdown]
# ## Against PyTorch and the earlier stage

# %%
plots.ladder()

# %%
nb.compare()

# %% [markdown]
# ## Next: stage 03
#
# Stage 03 attacks everything this stage left alone:
#
# * **Loop order.** Query tiles go outside (the FlashAttention-2 order), so $m$, $l$ and $O$ stay
#   in registers for the whole row of tiles instead of a global-memory round trip per visit; and
#   the grid gets a block per (query tile, batch, head), enough to fill every SM.
# * **Thread coarsening.** At $d = 64$ each thread computes a 4 × 4 patch of scores and a patch of
#   $O$ in registers, reading shared memory 16 bytes at a time, so every value it loads feeds
#   several multiply-adds.
# * **Padding.** Rows of the K and Q tiles are stored $d + 4$ floats apart, so the 16 key rows that
#   a half-warp reads start in different banks: the `Kj[tx * d + x]` conflict disappears.
