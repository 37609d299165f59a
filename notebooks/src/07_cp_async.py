# %% [markdown]
# # Stage 07 — cp.async: the next tile loads while this one is computed
#
# Up to stage 06 a block **loads** each K/V tile, meets at a **barrier**, and **computes**, one
# after the other. This stage copies K and V with **`cp.async`**, global to shared memory without
# registers and without waiting: with two buffers, tile `j + 1` travels while tile `j` is
# computed.
#
# ## Objectives
# After this notebook you can:
# - follow a two-buffer `cp.async` pipeline through its prologue and loop;
# - bound what overlapping loads with math can buy;
# - predict with Little's law how many buffers cover the memory latency;
# - read stall reasons as shares of warp time, even one that rose while its time fell.
#
# **Prerequisites:** notebooks 05 and 06 (`mma.sync`, `ldmatrix`, the swizzled tiles).
#
# **Time:** about 20 min to read, 40 min to work through.

# %%
# %matplotlib inline
import re

import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import diagrams as dg
from flashlab import fragments as fr
from flashlab import notebook as nb
from flashlab import plots
from flashlab.paths import KERNELS
nb.banner("07_cp_async")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
sms, roof = here.sms, here.roof  # roof: the ceilings `flashlab run` measured on it
print(here)

# %% [markdown]
# ## 1 · Where stage 06 waits
#
# Stage 06's loop over K/V tiles starts like this:

# %%
nb.show_lines("06_swizzle", r"for \(int j = 0; j < n_tiles; j\+\+\)", r"^    __syncthreads\(\);\s*$")

# %% [markdown]
# and `load_tile` moves each 16-byte chunk through a register, `x`:

# %%
nb.show_source("06_swizzle", "load_tile")

# %% [markdown]
# The store to shared memory (`STS.128`) needs the loaded value in `x`, so the thread **waits for
# the data**: a *long scoreboard* stall. Then the 4 warps meet at `__syncthreads()`, the slowest
# deciding: a *barrier* stall. Then the math; the next tile is requested after it. Per tile, time
# = load + compute, and only other blocks on the SM can compute meanwhile.
#
# ## 2 · cp.async, commit, wait
#
# The three PTX instructions, as the kernels wrap them:

# %%
nb.show_source("ptx.cuh", "cp_async_16")
nb.show_lines("ptx.cuh", r"^// Close the group", r"void cp_async_commit")
nb.show_source("ptx.cuh", "cp_async_wait")

# %% [markdown]
# * **`cp.async.cg.shared.global [dst], [src], 16, src_bytes`** starts a 16-byte copy from global
#   to shared memory and returns at once; no register holds the data (`.cg`: cached in L2
#   only). With `src_bytes = 0` it writes 16 zeros without reading: the key rows past N.
# * **`cp.async.commit_group`** closes this thread's copies since the last commit into a group.
# * **`cp.async.wait_group N`** waits until at most N of this thread's groups are in flight. A
#   `__syncthreads()` after it makes every thread's copies visible to the block.
#
# ## 3 · The pipeline in the kernel
#
# The copy is stage 06's `load_tile` with `cp_async_16` in place of load and store:

# %%
nb.show_source("07_cp_async", "load_tile_async")

# %% [markdown]
# K and V now have `STAGES` buffers each (`PIPELINE_STAGES = 2`). The **prologue** issues Q and
# the first `STAGES − 1` K/V tiles, one group each, waits for the first and reads Q:

# %%
nb.show_lines("07_cp_async", r"// Prologue:", r"__syncthreads\(\);")

# %% [markdown]
# Then each iteration waits for tile `j`, issues tile `j + STAGES − 1` into the buffer tile
# `j − 1` used, and computes tile `j`:

# %%
nb.show_lines("07_cp_async", r"for \(int j = 0; j < n_tiles; j\+\+\)", r"const T\* Vt = ")

# %% [markdown]
# The one barrier per tile does two jobs: after it, every thread's copies of tile `j` have
# landed, *and* every warp is done with tile `j − 1`, so its buffer may be refilled. An empty
# group is committed when nothing is left to copy, so that "tile `j` has arrived" is always "at
# most `STAGES − 2` groups pending". The buffers, at the teaching config's 16 tiles:

# %%
source07 = (KERNELS / "07_cp_async.cu").read_text()
STAGES = int(re.search(r"PIPELINE_STAGES = (\d+);", source07).group(1))
D, BR, BC = 64, 64, 64  # the teaching config's head dim; the kernel's tile sizes
n_tiles = fl.TEACHING.N // BC
steps = [dict(step="prologue", waits_for="Q and tile 0", computes="–",
              copies=", ".join(f"tile {t} → buffer {t % STAGES}" for t in range(STAGES - 1)))]
for j in range(n_tiles):
    nxt = j + STAGES - 1
    steps.append(dict(step=f"iteration {j}", waits_for=f"tile {j}" if j else "–",
                      computes=f"tile {j} from buffer {j % STAGES}",
                      copies=f"tile {nxt} → buffer {nxt % STAGES}" if nxt < n_tiles
                      else "nothing (an empty group)"))
plan = pd.DataFrame(steps).set_index("step")
pd.concat([plan.head(4), plan.tail(2)])

# %% [markdown]
# **Shared memory.** Two buffers of K and V cost more than stage 06 saved. Blocks per SM, from
# registers and shared memory:

# %%
layouts = {"06_swizzle": dict(pad_bytes=0), "07_cp_async": dict(pad_bytes=0, stages=STAGES)}
smem = pd.DataFrame({s: {d_: fr.smem_bytes(d_, BR, BC, **how) for d_ in (64, 128)}
                     for s, how in layouts.items()}).rename_axis("D")
occ = None
with nb.unless_missing():
    occ = pd.concat({s: nb.blocks_per_sm(s, smem[s].to_dict()) for s in layouts}, names=["stage"])
    display(occ)
smem

# %% [markdown]
# ## 4 · A timeline model
#
# One block's K/V loop, per tile:
#
# * **load**: the tile's bytes (K and V, `2 · BC · D · 2`) at the SM's share of the measured DRAM
#   copy bandwidth;
# * **compute**: the slower of the tensor cores (`4 · BR · BC · D` FLOPs at the SM's share of the
#   measured matmul rate) and shared memory (one wavefront a clock);
# * **latency**: the round trip before a copy's first byte arrives (below).
#
# Taking every tile from DRAM is the slow end: 16 query blocks read each K/V tile, mostly from
# the L2.

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM, as in notebooks 02, 03 and 05
per_sm = {"DRAM bytes/ns": roof["copy_tbps"] * 1e3 / sms,
          "tensor FLOP/ns": roof["matmul_fp16_tflops"] * 1e3 / sms}
model = {}
for d_ in (64, 128):
    c_ = fr.tile_cost(d_, BR, BC, pad_bytes=0, swizzle=True)
    model[d_] = {"bytes": c_.global_bytes, "FLOPs": c_.flops, "wavefronts": c_.wavefronts,
                 "load ns (DRAM)": c_.global_bytes / per_sm["DRAM bytes/ns"],
                 "tensor ns": c_.flops / per_sm["tensor FLOP/ns"],
                 "shared-memory ns": c_.wavefronts / clock_ghz}
model = pd.DataFrame(model).T.rename_axis("D")
model["compute ns"] = model[["tensor ns", "shared-memory ns"]].max(axis=1)
model["bound"] = [dg.pipeline_speedup_bound(r["load ns (DRAM)"], r["compute ns"])
                  for _, r in model.iterrows()]
load_ns, compute_ns = model.at[D, "load ns (DRAM)"], model.at[D, "compute ns"]
model.round(2)

# %% [markdown]
# First without latency, a handful of tiles:

# %%
dg.pipeline_timeline(load_ns, compute_ns, tiles=6)

# %% [markdown]
# Serially a tile costs `load + compute`; overlapped, once the pipeline is full,
# `max(load, compute)`. So
#
# $$\text{speedup}_{07/06} \;\le\; \frac{\text{load} + \text{compute}}{\max(\text{load}, \text{compute})} \;\le\; 2.$$

# %%
bound = model.at[D, "bound"]
print(f"model at D={D}: load {load_ns:.0f} ns, compute {compute_ns:.0f} ns a tile -> speedup at "
      f"most {bound:.2f}x; if the L2 delivered tiles as fast as the math uses them: 2x")

# %% [markdown]
# **Latency.** We assume a copy's round trip from DRAM under load is about 600 ns (≈ 1 200
# clocks; microbenchmarks report roughly 500–800 ns). A tile is then in flight for latency +
# transfer, and by **Little's law** the link stays busy only if bandwidth × (latency + transfer)
# bytes are in flight. A block with S buffers keeps S − 1 tiles in flight, and hides the latency
# once (S − 1) · max(load, compute) ≥ latency + load; on an SM, all resident blocks' tiles fly
# together. Needed, against what the buffers put in flight, per SM:

# %%
latency_ns = 600  # assumed, not measured: DRAM round trip under load on an H100
with nb.unless_missing():
    if occ is None:
        raise nb.NotRecorded("blocks per SM (section 3): ptxas's report is needed")
    blocks = occ.xs("07_cp_async")["blocks"]
    tile = model["bytes"]
    depth = pd.DataFrame({
        "tile KiB": tile / 1024, "blocks per SM": blocks,
        "needed in flight KiB": (per_sm["DRAM bytes/ns"] * latency_ns + tile) / 1024,
        "in flight KiB, 2 buffers": blocks * tile / 1024,
        "in flight KiB, 3 buffers": 2 * blocks * tile / 1024,
        "buffers a block alone needs": [
            dg.pipeline_stages_needed(r["load ns (DRAM)"], r["compute ns"], latency_ns)
            for _, r in model.iterrows()]}).rename_axis("D")
    display(depth.round(1))

# %% [markdown]
# A block alone on its SM, 2 buffers against 3:

# %%
dg.pipeline_timeline(load_ns, compute_ns, tiles=8, stages=3, versus=2, latency=latency_ns)

# %% [markdown]
# ## 5 · Prediction, before measuring
#
# * **Time.** Between 1× and the bound above. More at D = 128: stage 06 already overlaps one
#   block's loads with another's math, and D = 128 has fewer blocks per SM.
# * **Buffers.** Two suffice: the SM's blocks keep more than the needed bytes in flight, even at
#   800 ns. A third buffer buys nothing; a block alone would need it. Stage 08's tuner times 2
#   against 3 buffers at shapes with 2 blocks of 16 KiB tiles per SM: 32 KiB in flight against
#   about 29 KiB needed (34 at 800 ns), the edge: a few per cent either way.
# * **Stall reasons** (share of warp time): **long_scoreboard falls**, no thread waits for data in
#   a register; **barrier falls**, one barrier per tile instead of two; **mio_throttle may rise**,
#   copies and `ldmatrix` sharing the memory-instruction queue.

# %%
gain_band = (1.0, bound)

# %% [markdown]
# ## 6 · The machine code
#
# Static counts, fp16 kernels, and one trip of the K/V loop:

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("06_swizzle", "07_cp_async")
    display(mix[mix.index.get_level_values("kernel").str.contains("__half")].droplevel("stage").T)

# %%
with nb.unless_missing():
    for d_ in (64, 128):
        display(nb.loop_bodies(["06_swizzle", "07_cp_async"], kernel=rf"__half, {d_},"))

# %% [markdown]
# The copies, waits and barriers at D = 64: `LDGSTS` (cp.async, the prologue's Q and tile 0,
# then the refill), `LDGDEPBAR` closing a group, `DEPBAR.LE SB0, 0x0` waiting for it
# (`wait_group 0`), one `BAR.SYNC` a trip. The predicate of each `LDGSTS` (`!P0`, ...) is the
# kernel's `in ? 16 : 0`. The `@!PT LDS RZ, [RZ]` are predicated on "not true": they never run.

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("07_cp_async", r"LDGSTS|DEPBAR|BAR\.SYNC|\bLDS\b")))

# %%
with nb.unless_missing():
    display(nb.opcode_changes(["06_swizzle", "07_cp_async"]))

# %% [markdown]
# ## 7 · Measure
#
# On a GPU this builds the stage, checks it against a float64 reference, then times it together with
# stage 06 and SDPA's flash and cuDNN backends, run by run in turn at each config (the teaching
# configs, then the FlashAttention sweep), three rounds over, as `flashlab run` does, so that their
# ratios come from one run. Otherwise: the recorded rows.

# %%
ev = nb.evaluate("07_cp_async")
ev

# %% [markdown]
# ## 8 · Prediction against measurement

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    gain = nb.speedup("06_swizzle", "07_cp_async", "fp16")
    print(f"stage 07: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{gain:.2f}x stage 06; predicted {gain_band[0]:.2f} - {gain_band[1]:.2f}x")

# %% [markdown]
# Over the FlashAttention sweep (16k tokens, H · D = 2048, fp16; rows: head dim and mask,
# columns: N):

# %%
with nb.unless_missing():
    gains = nb.sweep_ratio("07_cp_async", "06_swizzle")
    display(gains.round(3))
    print("mean gain by head dim: " + ", ".join(
        f"D={d_}: {g:.3f}x" for d_, g in gains.mean(axis=1).groupby(level="D").mean().items()))

# %%
plots.scaling(last="07_cp_async")

# %% [markdown]
# Stage 08's tuner timed its kernel with 2 and 3 buffers, all else equal; 3 buffers' speed over
# 2's:

# %%
from flashlab import tuning

with nb.unless_missing():
    deeper = {"2 → 3 buffers": {64: ((64, 4, 2, 2, 1), (64, 4, 2, 3, 1)),
                                128: ((32, 4, 2, 2, 0), (32, 4, 2, 3, 0))}}
    display(tuning.effects(deeper, fl.tables.tune_log())["ratio"].round(3))

# %% [markdown]
# ### Discussion
#
# **Time.** Predicted 1–1.45×, more at D = 128. Measured, with both stages timed in turn: 1.36× at
# the teaching config (173 → 235 TFLOP/s), 1.21–1.43× over the sweep, on average 1.24× at D = 64 and
# 1.37× at D = 128. Both held, the second narrowly. The model's load is too slow, though: a launch
# reads about 268 MB of K/V tiles in 0.07 ms, faster than DRAM can copy, while DRAM moves about 27
# MB. The L2 serves the rest, so the true bound is nearer 2×.
#
# **Buffers.** Predicted: nothing from a third buffer, a few per cent at stage 08's edge shapes.
# Measured: +2 % at D = 64, −1 % at D = 128. It held: the tiles in flight per SM covered the
# latency. Deeper pipelines pay where one block holds an SM, its own buffers all that is in flight.

# %% [markdown]
# ## 9 · Stall reasons: what the warps wait for now
#
# Why warps cannot issue, sampled by Nsight Compute: stage 06 against stage 07, in % of the time
# warps are active:

# %%
idea = list(fl.stage("07_cp_async").idea_metrics)
with nb.unless_missing():
    prof = nb.profile("07_cp_async")
    stall_rows = prof.index[prof.index.str.startswith("stall_")]
    display(prof.loc[[m for m in ["duration_ms", "tensor_pipe_pct", "achieved_occupancy_pct",
                                  "dram_throughput_pct", "smem_wavefronts"]
                      if m in prof.index] + list(stall_rows)].round(3))
    if "06_swizzle" not in prof.columns:
        raise nb.not_recorded("06_swizzle", " profile (to compare with)", " --profile")
    for m in idea:
        print(f"{m}: {prof.at[m, '06_swizzle']:.1f}% -> {prof.at[m, '07_cp_async']:.1f}% of warp time")

# %% [markdown]
# All stall reasons of the tensor-core stages, stacked, then the three predicted ones as pairs:

# %%
plots.stalls(only=["05_mma", "06_swizzle", "07_cp_async"])

# %%
plots.idea_metrics(only=["07_cp_async"])

# %% [markdown]
# ### Discussion
#
# * **long_scoreboard** fell from 21 % to 6 %, as predicted. What is left is most likely the wait
#   for late copies (`DEPBAR`): each block's first tile, with nothing to overlap, and late tiles.
# * **barrier** rose from 4.7 % to 5.3 %, against the prediction. These are shares, and the kernel
#   got 1.35× shorter at unchanged occupancy: 4.7 % of 0.096 ms and 5.3 % of 0.071 ms are about the
#   same barrier time, about 17 % less, not half. A barrier costs the spread of arrival times, not
#   its count: the one barrier now waits for every warp's copies (a thread's `wait_group` covers
#   only its own) and for the slowest warp's math on the previous tile.
# * **mio_throttle** fell from 4.3 % to 1.6 %, against the prediction, whose premise was wrong: the
#   copies are global-memory instructions (their queue's throttle, lg_throttle, stays 0), and the
#   tiles' `STS.128` are gone: shared-memory wavefronts fell from 11.1 M to 9.1 M, about the
#   2.2 M those stores took.
#
# The tensor pipe is busier (31 → 41 %); the largest reason left, wait (23 %), is fixed-latency
# dependencies between `mma`s.

# %% [markdown]
# ## 10 · What is next
#
# Stages 05–07 kept one shape: 64 query rows, 64 keys a tile. **Stage 08** tunes shape, pipeline
# depth and instructions per head dim and mask, timed on the GPU.

# %% [markdown]
# ## Exercises
#
# ### Lab `07.pipeline_period`
#
# Section 4's timeline with round numbers: a tile's copy arrives 500 ns after it is issued and
# streams for 200 ns, and its math takes 300 ns. How long is a tile once the two-buffer loop is
# full? Work it out from section 4's condition, then draw it with `dg.pipeline_timeline`.

# %%
from flashlab.course import labs
print(labs.prompt("07.pipeline_period"))

# %%
### BEGIN SOLUTION
load, compute, latency, buffers = 200, 300, 500, 2
# tile j + 1 is issued when tile j's math starts and needs latency + load to arrive
answer = max(compute, load, (latency + load) / (buffers - 1))   # 700 ns: latency-bound
### END SOLUTION

# %%
labs.check("07.pipeline_period", answer)

# %% [markdown]
# ### Kernel exercise `07.pipeline` (10 points)
#
# **Where:** the top of the K/V loop of `cp_async_kernel` in `kernels/07_cp_async.cu`, between
# `// BEGIN EXERCISE 07.pipeline` and `// END EXERCISE 07.pipeline`. The stub neither waits nor
# loads after the prologue, so later tiles are computed from whatever their buffer holds.
#
# **What to write:** section 3's step. For `j > 0`, wait until tile `j` is in buffer `j % STAGES`:
# `cp_async_wait<STAGES - 2>()` for this thread's copies, then `__syncthreads()` for everyone's
# (after it, every warp is also done with tile `j − 1`). Then start copying tile `j + STAGES − 1`,
# if there is one, into the buffer tile `j − 1` used (`load_tile_async`, K and V), and commit a
# group every iteration, loads or not, as the prologue does.
#
# **How it is judged.** `flashlab grade` builds stage 07 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, the strided layout of a model's projections, and keys whose size grows along
# the sequence, so that every row's maximum keeps rising and each rescale path runs. A wrong kernel
# scores 0, and the message names the first failing case and its first wrong element (batch, head,
# row, column, got, expected). A right one is timed at the teaching config and under the causal
# mask: when your instructor grades, in turn with the solution's stage on the same GPU, the slower
# of the two ratios counting; when you check your own work, against the solution's recorded speedup
# over stage 06. Full points within 5 % of the solution's speed, fewer below. A missing wait may
# pass by luck on one run and fail on the next: make the order right by construction.
#
# **GPU:** compute capability 8.0 or newer (an A100, L4, RTX 30 or 40 series, H100); without one,
# `flashlab grade` skips it with one line saying why. Run it with
#
#     flashlab grade --exercise 07.pipeline

# %% [markdown]
# ## Questions for discussion
#
# 1. At a latency of 1 500 ns, how many buffers would stage 07's blocks need at D = 64? A block
#    alone on its SM?
# 2. Stage 07 gained 1.36× at the teaching config (D = 64), 1.21–1.27× over the sweep at D = 64.
#    What differs between those launches?
# 3. Barrier stalls rose as a share but fell as time. Comparing kernels of different durations,
#    which should you compare?
# 4. At which head dim or tile size would a third buffer cost a block per SM, and would it pay?

# %% [markdown]
# **Instructor's answer.** *1.* Per SM the tiles in flight must hold bandwidth × latency plus a
# tile: 22.8 bytes/ns × 1 500 ns + 16 KiB ≈ 49 KiB at D = 64. Three blocks with two buffers keep
# 48 KiB in flight, just short; three buffers (96 KiB) cover it, and shared memory allows it
# (56 KiB a block). A block alone needs (S − 1) · 720 ns ≥ 1 500 + 720 ns: five buffers
# (`dg.pipeline_stages_needed(720, 323, 1500)`).

# %% [markdown]
# **Instructor's answer.** *2.* Mostly the size of the launch. The teaching config is 1 024 blocks,
# 2.6 waves at 3 blocks per SM; the sweep's launches have 4 to 8 times the blocks. With few waves,
# stage 06 has fewer other blocks to compute while one waits for its copy, so more of each copy is
# exposed and overlapping it inside the block buys more; at D = 64 the sweep's N = 512 points, with
# few tiles per block, gain the most (1.25–1.27×).

# %% [markdown]
# **Instructor's answer.** *3.* Time: share × duration, or the stall samples themselves, which
# count warp-time. Barrier stalls were 4.1 % of 0.096 ms and 5.4 % of 0.068 ms, about the same
# time. A share answers "what limits this kernel now"; time answers "what did the change remove".

# %% [markdown]
# **Instructor's answer.** *4.* A third buffer adds 2 · BC · D · 2 bytes: 16 KiB at D = 64, 32 KiB
# at D = 128. At D = 64 a block then needs 56 KiB, 4 blocks by shared memory where registers allow
# 3: no cost. At D = 128 it needs 112 KiB; two still fit, with about 1 KiB to spare, so any larger
# tile or a fourth buffer drops it to one block, 4 warps per SM. It pays only where the tiles in
# flight fall short of Little's law (a block alone on an SM, a longer latency); the tuner measured
# +2 % at D = 64 and −1 % at D = 128.

# %% [markdown]
# ## Summary
#
# - `cp.async` copies global → shared without registers or waiting; with two buffers tile `j + 1`
#   loads while tile `j` is computed: 1.36× stage 06 at the teaching config.
# - Overlap buys at most (load + compute) / max(load, compute) ≤ 2 per tile.
# - Buffers cover latency: by Little's law the tiles in flight per SM, blocks × (S − 1), must hold
#   bandwidth × latency plus a tile. Here two buffers did.
# - Stall reasons are shares of warp time: in a shorter kernel an unchanged stall grows.

# %%
nb.reached("07_cp_async")
