# %% [markdown]
# # Stage 02 — Coalesced loads
#
# Stage 01 gives each thread a whole query row, so a warp's 32 lanes read 32 different rows, and
# each SM with work holds a single warp. Stage 02 keeps the algorithm (FlashAttention-1 loop
# order, $m$ and $l$ in global memory, $B_c = B_r = 32$) and changes who does what.
#
# ## Objectives
# After this notebook you can:
# - explain coalescing and count the sectors a warp's load touches;
# - predict which bottleneck takes over once a latency-bound kernel gets enough warps;
# - check a bank-conflict count against the profiler's, and find where the count went wrong;
# - tell a latency stall (`short_scoreboard`) from a throughput stall (`mio_throttle`).
#
# **Prerequisites:** notebook 01 (its shared-memory count and its profile).
#
# **Time:** about 20 min to read, 40 min to work through.
#
# * A block is $32 \times 32$ threads. Warp `ty` owns query row `ty` of the tile; lane `tx` owns
#   key `tx` of the K/V tile for the scores, and output columns `tx`, `tx`+32, … for $O$.
# * Consecutive threads copy consecutive floats, so one load instruction of a warp reads 128
#   neighbouring bytes: 4 sectors instead of 32.
# * The row max and row sum become warp shuffles.
#
# One load instruction of warp 0, before and after:

# %%
# %matplotlib inline
import math

import flashlab as fl
from flashlab import diagrams, plots
from flashlab import notebook as nb
nb.banner("02_coalesced")

# %%
diagrams.access_comparison()

# %% [markdown]
# And the work of one (j, i) visit, coloured by the lane that does it (in stage 01, thread $t$
# did all of row $t$):

# %%
diagrams.thread_ownership("02_coalesced")

# %% [markdown]
# ## The kernel
#
# What changed since stage 01:
#
# * `load_tile`: thread `tid` of 1024 copies elements `tid`, `tid` + 1024, … of the tile, so each
#   warp reads one contiguous stretch. It loads $K_j$, $V_j$ and $Q_i$.
# * Scores: each lane computes one, `s += Qi[ty * d + x] * Kj[tx * d + x]`; `warp_max` and
#   `warp_sum` combine the row in 5 shuffle steps each.
# * $PV$: lane `tx` produces output columns `tx`, `tx` + 32, …, reading the warp's row of $P$
#   (one word for every lane) and a row of $V_j$ (32 consecutive words). Stores of $O$ are
#   coalesced the same way.
# * `__syncwarp` where a warp reads back its row of $P$; lane 0 alone writes $m$ and $l$.
# * `__launch_bounds__(Bc * Br)` keeps each thread within $65536 / 1024 = 64$ registers, so the
#   block can launch.

# %%
nb.show_diff("01_naive", "02_coalesced")

# %%
nb.show_source("02_coalesced", "load_tile")

# %% [markdown]
# ## Resources
#
# 1024 threads at 64 registers take the SM's whole register file, so an SM holds one block. That
# costs nothing here: the grid has fewer blocks (64) than the GPU has SMs.

# %%
nb.resources("02_coalesced")

# %% [markdown]
# ## Prediction
#
# Stage 01 was latency bound: one warp per SM, waiting on one load after another. Stage 02 gives
# each busy SM 32 warps, and cuts a thread's serial work per visit from $2 B_c d = 4096$
# multiply-adds to $d + (d/32) B_c = 128$. If latency alone set the time we would expect
# 10–30×. But 32 warps overlap their waits only until some pipe is full. Count shared memory again,
# per visit and per block:
#
# * **Scores.** Lane `tx` reads `Kj[tx * d + x]`: key rows $d = 64$ floats apart, so all 32
#   lanes hit the same bank: 32-way, stage 01's conflict on `Qi` moved to `Kj`. `Qi[ty * d + x]`
#   is a broadcast. 32 warps × 64 reads × (32 + 1) clocks $\approx$ 67.6 k clocks.
# * **$PV$.** `S[ty * Bc + y]` is a broadcast; `Vj[y * d + x]` with `x = tx` is 32 consecutive
#   words, one per bank. 32 warps × 64 iterations × 2 reads $\approx$ 4.1 k clocks, where stage 01
#   was charged about 67.6 k.
#
# About 72 k clocks per visit against stage 01's 140 k: the count halves, and the shared-memory
# bound is about 37 ms at 1.98 GHz. Arithmetic is no limit ($32 \times 128$ warp multiply-adds at
# 4 per clock per SM is about 1 k clocks per visit), and coalesced global loads from 32 warps
# hide their latency.
#
# **Prediction: stage 02 runs at its shared-memory bound**, about 37 ms, so about 2.6× faster
# than stage 01's measured time, with half of stage 01's bank conflicts and warps now waiting for
# the shared-memory pipe (`mio_throttle`) rather than for results. The grid is unchanged: 64
# blocks, 68 idle SMs.

# %%
diagrams.grid_fill(["01_naive", "02_coalesced"])

# %%
diagrams.smem_accesses("02_coalesced")

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM: put your GPU's here
bound = {s: diagrams.smem_bound_ms(s, fl.TEACHING.N, fl.TEACHING.D, clock_ghz)
         for s in ("01_naive", "02_coalesced")}
t01 = nb.compare().set_index("stage").loc["01_naive", "median_ms"]  # recorded by notebook 01
predicted = t01 / bound["02_coalesced"]
print(f"Shared-memory bound at {clock_ghz} GHz: {bound['01_naive']:.0f} ms (stage 01) → "
      f"{bound['02_coalesced']:.0f} ms (stage 02). Stage 01 measured {t01:.0f} ms: "
      f"a predicted speedup of {predicted:.2f}x.")

# %% [markdown]
# ## Measurement
#
# As in stage 01: on a GPU, build, check against float64 on fresh inputs, time at the teaching
# config and record; without one, the recorded rows. (The comparison needs stage 01's row from
# the same GPU: on a GPU, run notebook 01 first.)

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
      f"{predicted:.2f}x (stage 02 at its shared-memory bound). The counted bound is "
      f"{share['02_coalesced']:.0%} of stage 02's measured time and {share['01_naive']:.0%} of "
      f"stage 01's.")

# %% [markdown]
# ### Discussion
#
# We predicted about 2.6×, with stage 02 at its shared-memory bound; the H100 measured about
# 2.5× (about 39 ms, 0.44 TFLOP/s), within a few percent of the bound. The number held: 32 warps
# hid the latency that held stage 01 back. The 10–30× that the extra threads and coalescing
# seemed to promise stays locked behind the next bottleneck, the 32-way conflict in
# `Kj[tx * d + x]`. A change that removes a real inefficiency speeds a kernel up only as far as
# the next bottleneck allows. Whether the *reason* held too, which reads conflict, is for the
# profile to say.

# %% [markdown]
# ## The profile: the metric this stage targets
#
# Coalescing is about one number: how many 32-byte sectors a warp's global load request touches.
# The figure at the top predicts **32 → 4** for the tile copies; the loads of `m` and `l`, where
# the whole warp reads one address, need one sector. By the count above, bank conflicts should
# halve, and occupancy should rise from one warp per busy SM to 32.

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
# ### Discussion
#
# Coalescing and occupancy come out as predicted. The bank-conflict prediction, though, is
# **wrong**: the count did not halve. Check it against the arithmetic. The scores alone, 64 reads
# per row and visit, each 32-way (31 extra wavefronts), predict this many for either stage:

# %%
cfg = fl.TEACHING
tiles = math.ceil(cfg.N / 32)                      # Br = Bc = 32
scores_only = cfg.B * cfg.H * tiles * tiles * 32 * cfg.D * 31
print(f"QK^T reads alone: {scores_only:.3g} extra wavefronts; measured: "
      f"{bank['01_naive']:.3g} (stage 01), {bank['02_coalesced']:.3g} (stage 02)")

# %% [markdown]
# Both stages match the score reads alone, within a fraction of a percent. So stage 01 never paid
# the 32-way $PV$ conflict it was charged with. Notebook 01 found why, beside the published
# kernel: with the tile size a compile-time constant, the compiler loads a thread's 32
# probabilities into registers once per visit (eight `LDS.128`) instead of reading `S` for every
# output column. Our count for stage 01 was too pessimistic. That agrees with notebook 01's profile: a pipe with
# half the counted work was busy well under half the time, and stage 01 waited on latency, not on
# conflicts. The stall reasons side by side:

# %%
stall = p02.loc[[r for r in p02.index if r.startswith("stall_")]]
top = stall.max(axis=1).sort_values(ascending=False).index[:4]
stall.loc[top].round(1)

# %% [markdown]
# Stage 01's one warp spends most of its time on `short_scoreboard`, waiting for each
# shared-memory read: a **latency** stall. Stage 02 issues the very same conflicted reads from 32
# warps, and its top stall becomes `mio_throttle`: the shared-memory pipe is full, a
# **throughput** limit. The same wavefronts are now served back to back instead of one round trip
# at a time. So the speedup came from more warps hiding latency, not from a removed conflict; the
# predicted bound for stage 02 was right, the story of where stage 01's time went was not. A
# profile checks the *reason* for a prediction, not only its number.

# %% [markdown]
# ## Against PyTorch and the earlier stage

# %%
plots.ladder(last="02_coalesced")

# %%
nb.compare().query("kind == 'baseline' or stage in ['01_naive', '02_coalesced']").reset_index(drop=True)

# %% [markdown]
# ## Next: stage 03
#
# Stage 03 attacks what this stage left alone: the FlashAttention-2 loop order keeps $m$, $l$
# and $O$ in registers and gives every SM blocks; each thread computes a patch of outputs, so
# every value it loads feeds several multiply-adds; and padded tile rows remove the
# `Kj[tx * d + x]` conflict.

# %% [markdown]
# ## Exercises
#
# ### Lab `02.sectors`
#
# Stage 02's tile copy reads 128 neighbouring bytes a warp, and the count of sectors above assumed
# they start on a sector boundary. Nothing forces a tensor to: a view that starts partway into its
# buffer shifts every row with it. How many 32-byte sectors does one load instruction of the warp
# touch then? Predict it from the lanes' byte addresses, then check.

# %%
from flashlab.course import labs
print(labs.prompt("02.sectors"))

# %%
### BEGIN SOLUTION
misaligned_bytes = [16 + 4 * lane for lane in range(32)]   # counted from a sector boundary
answer = diagrams.sectors_per_request(misaligned_bytes).sectors   # bytes 16..143: sectors 0-4
### END SOLUTION

# %%
labs.check("02.sectors", answer)

# %% [markdown]
# ### Kernel exercise `02.tile_copy` (10 points)
#
# **Where:** `load_tile` in `kernels/02_coalesced.cu`, between `// BEGIN EXERCISE 02.tile_copy` and
# `// END EXERCISE 02.tile_copy`. The student edition holds a stub there that compiles and leaves
# the tile empty.
#
# **What to write:** the copy of rows `first` … `first + 31` of an (N, d) matrix into the 32 × d
# tile by all `Br × Bc` = 1024 threads: thread `tid` takes elements `tid`, `tid + 1024`, … of the
# tile, so that each warp reads 128 contiguous bytes; rows at or past N become zeros.
#
# **How it is judged.** `flashlab grade` builds stage 02 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp32, and keys whose size grows along the sequence, so that every row's maximum keeps rising
# and each rescale path runs. A wrong kernel scores 0, and the message names the first failing case
# and its first wrong element (batch, head, row, column, got, expected). A right one is timed at the
# teaching config and under the causal mask: when your instructor grades, in turn with the
# solution's stage on the same GPU, the slower of the two ratios counting; when you check your own
# work, against the solution's recorded speedup over stage 01. Full points within 5 % of the
# solution's speed, fewer below.
#
# **GPU:** compute capability 7.5 or newer (a T4 will do); without one, `flashlab grade` skips it
# with one line saying why. Run it with
#
#     flashlab grade --exercise 02.tile_copy

# %% [markdown]
# ## Questions for discussion
#
# 1. Stage 02 runs at its shared-memory bound with 68 SMs idle. Which of the two would you fix
#    first, and what speedup would each give on its own?
# 2. The count charged stage 01 a $PV$ conflict that the hardware never paid. What in the source
#    would have had to be different for it to be paid?
# 3. The prediction's number held while part of its reasoning failed. When is a prediction with
#    the right number and a wrong reason still useful?

# %% [markdown]
# **Instructor's answer.** *1.* The conflict. Rows padded to d + 1 floats turn the `Kj` read from
# 32-way into one wavefront, so a step of the score loop costs 2 wavefronts instead of 33 and the
# count per visit falls from about 72 k to about 8 k clocks: a bound about 9× lower, though latency
# and FA-1's round trips of O, m and l take over well before it. Filling the 68 idle SMs (two
# blocks or more per head) gives at most 132 / 64 ≈ 2.1×, since each busy SM is already at its
# bound. Stage 03 does both.

# %% [markdown]
# **Instructor's answer.** *2.* The tile size. With `Bc` a compile-time constant the compiler
# unrolls the loop over a tile's 32 keys and loads the thread's 32 probabilities into registers
# once per visit (eight `LDS.128`). With `Bc` a kernel argument, as in the published kernel, it
# re-reads `S[Bc*tx + y]` for each of the d output columns: 32 · 64 conflicted loads per visit, the
# cost the count charged. Notebook 01 measured it: 168 ms published against 93 ms with constant
# tiles.

# %% [markdown]
# **Instructor's answer.** *3.* As a bound and a budget: stage 02's count capped what more warps
# could buy and named the pipe that would fill, which is what choosing the next step needs. As a
# diagnosis it misleads: a "conflict-bound" stage 01 would have sent us to padding, while the
# profile shows latency. A right number with a wrong reason predicts the next change badly, so
# check the reason (stall reasons, counters) before building on it.

# %% [markdown]
# ## Summary
#
# - Letting consecutive lanes copy consecutive floats cut sectors per global load from about 32
#   to about 3.
# - 32 warps per busy SM hid the latency that bound stage 01: about 2.5× faster, at about 96 % of
#   the shared-memory bound.
# - Stage 02's top stall is `mio_throttle`: the 32-way conflict on `Kj` now limits throughput.
# - Bank conflicts did not halve: stage 01 never paid its counted $PV$ conflict, so a
#   source-level count must be checked against the profiler's.

# %%
nb.reached("02_coalesced")
