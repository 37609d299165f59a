# %% [markdown]
# # Stage 10 — TMA and mbarrier: one thread copies whole tiles, warps wait on barriers in memory
#
# In stage 09 every thread still copies 16 bytes at a time with `cp.async`, computing a swizzled
# address for each, and the whole block meets at `__syncthreads` before every tile. Hopper has a
# copy engine beside each SM, the **tensor memory accelerator (TMA)**: one instruction from one
# thread copies a whole box of a tensor, described once on the host by a *tensor map*, into
# shared memory in the layout `wgmma` reads. Its completion is counted by an **mbarrier**, a
# barrier object in shared memory that warps wait on by themselves.
#
# ## Objectives
# After this notebook you can:
# - build a tensor map for a (B, H, N, D) tensor and say what box it copies and where;
# - follow a copy from `arrive.expect_tx` through the bytes arriving to a phase flip;
# - run a ring of buffers on full and empty mbarriers, waiting by phase parity;
# - say what `fence.proxy.async` and `fence.mbarrier_init` order, and why;
# - predict what moving the copies to the TMA buys, and check it in the machine code and the
#   stall reasons.
#
# **Prerequisites:** notebook 09 (`wgmma`, descriptors, the 128-byte swizzle); notebook 07
# (pipelines, Little's law). The kernel needs a Hopper GPU (H100, H200, GH200); elsewhere this
# notebook replays the numbers recorded on one.
#
# **Time:** about 25 min to read, 45 min to work through.

# %%
# %matplotlib inline
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import tma
from flashlab import notebook as nb
from flashlab import plots
nb.banner("10_tma")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
sms, roof = here.sms, here.roof
print(here)

# %% [markdown]
# ## 1 · What stage 09 spends on copies
#
# Per K/V tile, every thread of stage 09's block issues `cp.async` copies of 16 bytes, each with
# its own swizzled address, then waits for its own copies, fences them into the async proxy and
# meets every other thread at `__syncthreads`:

# %%
def copies_per_thread(D, BC, threads):
    """cp.async of 16 bytes each thread issues for one K/V tile (K and V)."""
    return 2 * BC * D * 2 // 16 // threads


pd.DataFrame([dict(D=D, BC=BC, warpgroups=w, **{
    "cp.async per thread per tile": copies_per_thread(D, BC, 128 * w),
    "TMA instructions per tile (one thread)": 2 * (D // 64)})
    for D, BC, w in [(64, 64, 2), (64, 128, 3), (128, 128, 2)]]).set_index(["D", "BC", "warpgroups"])

# %% [markdown]
# The instructions are not the main cost; the barrier is. `__syncthreads` makes the two
# warpgroups of a block start every tile together, so the faster one waits for the slower, and
# both wait for the last thread's copies.
#
# ## 2 · The tensor map: a box of a tensor, described on the host
#
# `cuTensorMapEncodeTiled`, a CUDA driver function, describes a tensor (its address, dims and
# strides) and a **box** (how many elements of each dim one copy takes) in a 128-byte
# `CUtensorMap`. The kernel gets it as a `const __grid_constant__` parameter, so it lives in
# constant space where the TMA unit reads it. Here each of q, k and v gets a 4-D map — (D, N, H, B),
# the outer three sorted by stride, so the (B, H, N, D) view of a (B, N, H, D) projection works
# too — and a box of 64 columns by BC rows. `kernels/hopper_host.cuh` builds the maps for this
# stage and the ones after it:

# %%
nb.show_source("hopper_host.cuh", "make_map")

# %% [markdown]
# * The box's inner extent is 64 16-bit columns, **128 bytes**, the most the 128-byte swizzle
#   takes: the engine writes the same layout `sw128` describes, the one the `wgmma` descriptors
#   of notebook 09 name. A tile at D = 128 is two boxes, one after the other.
# * Rows past N are **filled with zeros** by the engine (`CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE`
#   means zeros, not NaN), and their bytes still count: every copy of a tile delivers the full
#   box.

# %%
tma.tma_box_figure(N=300, D=128, BC=128, tile=2)

# %%
display(tma.tma_boxes(N=300, D=128, BC=128, tile=2))
nb.show_source("10_tma", "tma_tile")

# %% [markdown]
# One thread issues `cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
# [dst], [map, {column, d1, d2, d3}], [mbarrier]`: copy the box at those coordinates to `dst`
# and count its bytes on the mbarrier.
#
# ## 3 · The mbarrier: arrivals, bytes and phases
#
# An mbarrier is 8 bytes of shared memory that counts two things in its current **phase**: the
# arrivals still expected and the bytes of asynchronous copies still expected. When both reach
# zero the phase completes, the barrier starts the next phase, and its **phase parity** (0, 1, 0,
# …) flips. A thread waits for a phase by its parity: `try_wait.parity` returns once the phase with
# that parity has completed.

# %%
nb.show_lines("hopper.cuh", r"^// ---- mbarrier", r"^// ---- TMA")

# %% [markdown]
# * `mbarrier.init [bar], n` — n arrivals a phase. `fence.mbarrier_init` makes the initialised
#   barrier visible to the other threads and to the copy engine before anyone uses it.
# * `mbarrier.arrive.expect_tx [bar], bytes` — one arrival, and `bytes` more to expect. The copy
#   engine's `complete_tx` subtracts them as they land.
# * `mbarrier.try_wait.parity [bar], p` — true once the phase of parity p has completed.
#
# ## 4 · The ring
#
# Stage 10 keeps stage 09's buffers — tile `j` in buffer `j % STAGES`, the first `STAGES − 1`
# copied with Q, then loads `STAGES − 2` tiles ahead because tile `j`'s P·V still reads its buffer
# while tile `j + 1` starts (`STAGES − 1` with `RETIRE`, where each warp releases tile `j − 1`
# before it waits for tile `j`) — and gives each buffer two barriers:
#
# * **full[b]** — 1 arrival (the elected thread's `arrive.expect_tx`) plus the tile's bytes:
#   completes when the tile has landed. Consumers wait with parity `(j / STAGES) & 1`.
# * **empty[b]** — one arrival per warp, after the warp's `wait_group` has retired every `wgmma`
#   that read the buffer: completes when the buffer may be refilled. The elected thread waits on
#   it before refilling.

# %%
nb.show_lines("10_tma", r"const bool elected = threadIdx.x == 0;", r"const uint32_t Qw = ")

# %%
nb.show_lines("10_tma", r"auto refill = ", r"const uint32_t Vt = ")
nb.show_lines("10_tma", r"// The tiles past this warpgroup's rows", r"^  \}$")

# %% [markdown]
# The same ring drawn in time, with a tile's copy (latency, then bytes), each warpgroup's work on
# it, and its release; φ is the parity each wait names. Three buffers, one tile ahead:

# %%
tma.ring_timeline(n_tiles=8, stages=3, load=1.0, compute=1.5, latency=1.0)

# %% [markdown]
# With one tile of lookahead a copy must arrive within one tile's compute: here latency + bytes
# (2) exceed the compute (1.5) and the ring runs at 2 a tile. A fourth buffer hides it:

# %%
sched3 = tma.ring_schedule(n_tiles=12, stages=3, load=1.0, compute=1.5, latency=1.0)
sched4 = tma.ring_schedule(n_tiles=12, stages=4, load=1.0, compute=1.5, latency=1.0)
print("per tile over the last 4 tiles: 3 buffers",
      (sched3["compute_end_wg0"].iloc[-1] - sched3["compute_end_wg0"].iloc[-5]) / 4,
      "| 4 buffers", (sched4["compute_end_wg0"].iloc[-1] - sched4["compute_end_wg0"].iloc[-5]) / 4)
sched3.head(6)

# %% [markdown]
# On the H100 a 128-key tile at D = 128 is 8.4 MFLOP of products per block, under 2 µs at the
# 610–640 TFLOP/s measured below for long sequences. A copy arriving within that needs one tile of
# lookahead, and three buffers of 64 KiB (with 32 KiB of Q) are all that 227 KiB allows.
#
# **Why no `__syncthreads`:** a warpgroup needs only its own tile to have landed (full) and tells
# the producer when it is done with one (empty). The two warpgroups of a block no longer start
# each tile together; one can be up to the ring's slack ahead of the other. Under the causal
# mask a warpgroup computes only its own tiles (`n_mine`, as in stage 09) and still waits for the
# rest and releases them, so it never runs a whole ring ahead.
#
# ## 5 · Proxies: who must fence what
#
# The copy engine and `wgmma` access shared memory through the **async proxy**; ordinary loads and
# stores through the generic proxy. Stage 09 wrote its tiles with `cp.async` (generic) and read
# them with `wgmma` (async): each thread fenced (`fence.proxy.async`) before the barrier. In stage
# 10 the copy engine writes and `wgmma` reads — both async, ordered by the mbarrier — so no proxy
# fence is left in the loop. The epilogue writes O through the Q tile with ordinary stores after
# every `wgmma` has retired, and reads it back with ordinary loads: generic on both sides.

# %% [markdown]
# ## 6 · What changed
#
# Against stage 09: the tensor maps on the host (`make_map`, in `kernels/hopper_host.cuh`), the
# barriers, the elected thread's copies and the waits in place of `load_tile_async`,
# `cp_async_wait`, the fence and `__syncthreads`. The mbarriers take no shared memory of their
# own: they sit in the padding that aligns the tiles to 1024 bytes, so that two blocks of 113 KiB
# still fit an SM (228 KiB, less 1 KiB the SM keeps for each block) at D = 64. The math is the
# same:

# %%
nb.show_diff("09_wgmma", "10_tma", context=1)

# %% [markdown]
# ## 7 · Prediction, before measuring
#
# * **Time.** The math is unchanged, so the gain is what the block-wide barrier and the copies
#   cost stage 09. On the barrier, notebook 07's lesson holds: a barrier costs the spread of the
#   warps' arrival times. Two warpgroups doing identical work arrive close together, so expect a
#   modest gain, 5–15 %, larger where tiles are short (D = 64: more barriers per FLOP).
# * **Machine code:** `LDGSTS` gone, `UTMALDG` (the bulk tensor copy) in its place, issued by one
#   thread; `SYNCS` instructions for the mbarriers; no `BAR.SYNC` in the loop.
# * **Stall reasons:** `barrier` falls to near zero; waits on the mbarriers appear as
#   `long_scoreboard` or `sleeping` while a warp polls a barrier that has not flipped.

# %%
gain_band = (1.05, 1.15)

# %% [markdown]
# ## 8 · The machine code

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("09_wgmma", "10_tma")
    display(mix[mix.index.get_level_values("kernel").str.contains("__half")].droplevel("stage").T)

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("10_tma", r"UTMA|SYNCS|BAR\.SYNC|HGMMA.*gdesc", kernel=r"__half, 128,")))

# %% [markdown]
# `UTMALDG.4D` is the bulk tensor copy (two per K or V tile at D = 128), `UTMACCTL.PF` the
# tensor-map prefetch, the seven `SYNCS.EXCH.64` the barriers' `mbarrier.init` (offset 0 `q_full`,
# `0x8`–`0x18` full, `0x20`–`0x30` empty), `SYNCS.PHASECHK.TRANS64.TRYWAIT` the parity wait.
# `SYNCS.ARRIVE.TRANS64` is an arrival whose last operand is a byte count: with a register (`R0`,
# `R8`) just before `UTMALDG`s, the elected thread's `arrive.expect_tx` on `q_full` or a full
# barrier; as `.A1T0` with `RZ` (no bytes) on an empty barrier, lane 0's plain `mbarrier.arrive`.
# The loop bodies of the two stages (one trip of the K/V loop at D = 128): stage 10's is 60
# instructions shorter, with four `UTMALDG` and four `SYNCS` where stage 09 had 16 `LDGSTS`, 7
# `LDS` and a block barrier:

# %%
with nb.unless_missing():
    display(nb.loop_bodies(["09_wgmma", "10_tma"], kernel=r"__half, 128,"))

# %% [markdown]
# ## 9 · Measure
#
# On a Hopper GPU this builds the stage, checks it against a float64 reference, then times it with
# stage 09 and SDPA's flash and cuDNN backends, run by run in turn at each config (the teaching
# configs, then the FlashAttention sweep), three rounds over, so that their ratios come from one
# run. Otherwise: the recorded rows.

# %%
ev = nb.evaluate("10_tma")
ev

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    gain = nb.speedup("09_wgmma", "10_tma", "fp16")
    print(f"stage 10: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{gain:.2f}x stage 09; predicted {gain_band[0]:.2f} - {gain_band[1]:.2f}x")

# %% [markdown]
# Over the sweep: stage 10 over stage 09, then over cuDNN's attention, PyTorch's fastest:

# %%
with nb.unless_missing():
    gains = nb.sweep_ratio("10_tma", "09_wgmma")
    display(gains.round(2))
    print("mean gain by head dim: " + ", ".join(
        f"D={d_}: {g:.2f}x" for d_, g in gains.mean(axis=1).groupby(level="D").mean().items()))
    display(nb.sweep_ratio("10_tma", "sdpa_cudnn").round(2))

# %%
plots.scaling(last="10_tma")

# %% [markdown]
# bf16 against fp16, the same kernel (teaching config):

# %%
with nb.unless_missing():
    print(f"bf16 / fp16 time: {ev.timing('bf16').median_ms / ev.timing('fp16').median_ms:.3f}")

# %% [markdown]
# ### Discussion
#
# **Time.** Predicted 1.05–1.15×, more where tiles are short. Measured: 1.05× at the teaching
# config, at the bottom of the band, and 1.01–1.39× over the sweep, 1.11× on average at D = 64 and
# 1.19× at D = 128. Roughly as predicted at the short end, with one correction: the largest gains
# are at the longest sequences (1.31–1.39× at D = 128 without the mask from N = 4096 on), not at
# the shortest tiles. A long sequence is many tiles per
# block, and every one of them paid stage 09's barrier; a short one is mostly prologue (loading Q
# and the first tiles) and epilogue, which TMA shortens little. At D = 64 the gain is smaller:
# stage 09 already runs two blocks an SM there (four under the mask on short sequences), and one
# block's barrier waits were partly hidden behind the others' products. The smallest gain, 1.01×
# under the mask at D = 128 and N = 512, is where a block has two to eight tiles of 64 keys and,
# with two buffers and each P·V retired before the next tile, never more than one tile in flight:
# there is little waiting left for mbarriers to shorten. Stage 10 runs stage 09's shape there (two
# blocks an SM of two warpgroups, 64-key tiles) below N = 8192, its own 128-key tiles from 8192.
#
# **bf16** runs as fast as fp16 (the time ratio above: 0.997): the same instruction, another
# element type.
#
# **Against cuDNN**, PyTorch's fastest attention: 0.75–1.12×. At D = 128 from N = 2048 on,
# 0.89–0.97× without the mask and 0.99–1.03× with it. At D = 64 stage 10 is ahead of cuDNN at
# every length (1.02–1.12×). What is left is the scheduling: the tensor cores still wait while a
# warpgroup exponentiates, which costs most at D = 128, where the products are the larger part of a
# tile.

# %% [markdown]
# ## 10 · Stall reasons

# %%
idea = list(fl.stage("10_tma").idea_metrics)
with nb.unless_missing():
    prof = nb.profile("10_tma")
    stall_rows = prof.index[prof.index.str.startswith("stall_")]
    display(prof.loc[[m for m in ["duration_ms", "tensor_pipe_pct", "sm_throughput_pct",
                                  "achieved_occupancy_pct"] if m in prof.index]
                     + list(stall_rows)].round(2))
    if "09_wgmma" not in prof.columns:
        raise nb.not_recorded("09_wgmma", " profile (to compare with)", " --profile")
    for m in idea:
        print(f"{m}: {prof.at[m, '09_wgmma']:.1f}% -> {prof.at[m, '10_tma']:.1f}% of warp time")

# %%
plots.stalls(only=["08_tuned", "09_wgmma", "10_tma"])

# %% [markdown]
# ### Discussion
#
# * **barrier** fell by about a quarter, from 12.1 % to 8.9 % of warp time, but not to the near zero
#   predicted, though the loop has no `BAR.SYNC`. The one left is at the start (the barriers must
#   exist before anyone waits). This profile does not say where the rest comes from. A hypothesis:
#   the four warps of a warpgroup waiting for each other at each `wgmma`, which they issue together
#   (`.sync.aligned`); a per-instruction profile would test it.
# * **long_scoreboard** rose from 6.3 % to 10.2 %, as a warp polling an mbarrier with `try_wait`
#   (`SYNCS.PHASECHK`, a shared-memory operation) would show: the wait moved from the block
#   barrier to the data.
# * **mio_throttle** fell from 12.8 % to 10.2 %: the 16-byte copies no longer crowd the memory
#   instruction queue.
# * The **tensor pipe** is busy 46 % of the time (42 % in stage 09). More than half the time the
#   tensor cores of an SM have nothing to do, because every warp of the block does everything:
#   load, multiply, exponentiate, in that order.

# %% [markdown]
# ## 11 · What is next
#
# Every warp still waits for data, multiplies and exponentiates in turn. The next stages give the
# warps different jobs — one warpgroup copies, the others compute — and schedule the computing
# warpgroups so that one's softmax runs under the other's products.

# %% [markdown]
# ## Exercises
#
# ### Lab `10.parity`
#
# The ring's bookkeeping, by hand, on a ring of four buffers (stage 10's own have two or three):
# which buffer and which phase parity.

# %%
from flashlab.course import labs
print(labs.prompt("10.parity"))

# %%
### BEGIN SOLUTION
ring, tile_j = 4, 9
refill_tile = tile_j + ring - 2
answer = (tile_j % ring, (tile_j // ring) & 1, refill_tile % ring, (refill_tile // ring - 1) & 1)
### END SOLUTION

# %%
labs.check("10.parity", answer)

# %% [markdown]
# ### Kernel exercise `10.tma_tile` (10 points)
#
# **Where:** `tma_tile` in `kernels/10_tma.cu`, between `// BEGIN EXERCISE 10.tma_tile` and
# `// END EXERCISE 10.tma_tile`. The stub issues the right number of boxes — the barrier still gets
# all its bytes, so nothing hangs — but every box copies batch 0, head 0, rows 0 … ROWS − 1,
# columns 0–63.
#
# **What to write:** section 2's boxes: for `blk` in 0 … D/64 − 1, one `tma_load_4d` to
# `dst + blk · ROWS · 128`, at column `64 · blk` and, in the map's dims 1–3, the tile's first row,
# its head and its batch, placed by `order` (which map dim each became).
#
# **How it is judged.** `flashlab grade` builds stage 10 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, the strided layout of a model's projections, and keys whose size grows along
# the sequence, so that every row's maximum keeps rising and each rescale path runs. A wrong kernel
# scores 0, and the message names the first failing case and its first wrong element (batch, head,
# row, column, got, expected). A right one is timed at the teaching config and under the causal
# mask: when your instructor grades, in turn with the solution's stage on the same GPU, the slower
# of the two ratios counting; when you check your own work, against the solution's recorded speedup
# over stage 09. Full points within 5 % of the solution's speed, fewer below.
#
# **GPU:** compute capability 9.0 (H100, H200, GH200); elsewhere `flashlab grade` skips it with one
# line saying why. Run it with
#
#     flashlab grade --exercise 10.tma_tile

# %% [markdown]
# ## Questions for discussion
#
# 1. A box's bytes count toward `expect_tx` even for rows past N. What would happen if they did
#    not, and the kernel expected only the bytes of real rows?
# 2. Why must the empty barrier count one arrival per warp rather than one per warpgroup, or one
#    per block?
# 3. With three buffers and one tile of lookahead, when would a fourth buffer pay at D = 128, and
#    what would it cost?
# 4. The two warpgroups no longer meet at a barrier each tile. Did they drift apart? What in the
#    measurements would tell you?

# %% [markdown]
# **Instructor's answer.** *1.* For a tile that crosses N the engine still writes (zero) rows and
# counts their bytes. The PTX ISA says the tx-count must be set to the total the phase tracks, yet
# a negative count is within its valid range, −(2²⁰ − 1) to 2²⁰ − 1, not undefined. A phase
# completes once the pending arrivals and the tx-count have reached zero, and nothing says in what
# order or pieces a box's bytes are counted: the phase could complete while part of the tile is
# still landing, and the surplus would count against the next phase, completing a later tile's
# phase before its data arrived. Expect exactly what the boxes copy.

# %% [markdown]
# **Instructor's answer.** *2.* A warp's `wgmma.wait_group` says that *its* part of the warpgroup's
# products has retired. Counting one arrival per warp, each after its own wait, makes "the phase
# completed" mean every warp is done with the buffer. One arrival per warpgroup would rely on the
# other three warps having retired their parts when one had; one per block would need a barrier
# among the warps first, which is what the mbarrier replaced.

# %% [markdown]
# **Instructor's answer.** *3.* When a copy takes longer than a tile's compute to arrive: a longer
# memory latency, or a shorter tile (fewer keys, smaller D) whose compute is shorter than the
# copy's latency. At D = 128 with 128-key tiles a fourth buffer needs 64 KiB more shared memory:
# 32 + 4 × 64 = 288 KiB, more than an H100 block may have. It would take 64-key tiles (more
# per-tile overhead) to afford one.

# %% [markdown]
# **Instructor's answer.** *4.* Mostly not: both warpgroups wait for the same tile to land and then
# do the same work, so they stay close together, and the tensor cores still sit idle while both run
# their softmax. A profile shows it as a tensor pipe far from busy with little barrier stall, and a
# warp-state timeline would show the two warpgroups' `HGMMA` issued at the same times. Making them
# take turns is the next stages' work.

# %% [markdown]
# ## Summary
#
# - A tensor map describes a tensor and a box once, on the host; one thread's
#   `cp.async.bulk.tensor` copies the box, zero-filling rows past the end, into the 128-byte
#   swizzle that `wgmma` reads.
# - An mbarrier completes a phase when its arrivals and expected bytes are in; warps wait by
#   phase parity, `(tile / STAGES) & 1` on a ring.
# - Full and empty barriers per buffer replace `__syncthreads`: each warpgroup runs at its own
#   pace within the ring's slack.
# - The async proxy (TMA, `wgmma`) needs a fence only where ordinary stores feed it.
# - Shared memory is counted to the byte: 56 bytes of mbarriers decide whether two blocks fit an
#   SM, so they live in the padding that aligns the tiles.

# %%
nb.reached("10_tma")
