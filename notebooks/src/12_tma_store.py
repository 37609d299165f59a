# %% [markdown]
# # Stage 12 — the TMA stores O: a work item's output leaves while the next one is computed
#
# Stage 11's consumers finish every work item the way stage 05's warps did: each thread writes its
# part of O from its registers, 4 bytes at a time. In a long sequence that is a small tail after
# a long loop. In a short one it is not: at N = 512 and D = 128 a work item is only four key tiles,
# and the end of an item comes every four tiles. Hopper's tensor memory accelerator copies both
# ways. The tensor map that brought Q into shared memory can take O out of it: the consumers write
# O into the Q buffer they no longer need, one thread hands it to the TMA, and the warps start the
# next item while the copy runs.
#
# ## Objectives
# After this notebook you can:
# - count what stage 11's end of an item sends to memory: instructions, sectors, bytes used;
# - write a tile into shared memory in the TMA's 128-byte swizzle without bank conflicts, and
#   hand it to the TMA: `fence.proxy.async`, a named barrier, `cp.async.bulk.tensor` from shared
#   to global memory, a bulk group;
# - reuse a buffer that the TMA reads asynchronously: when `cp.async.bulk.wait_group.read` allows
#   it, and when the producer may refill it;
# - predict where the change pays (short work items) and check it in the machine code, the
#   timings over the sweep and the profile;
# - give a consumer whose rows lie past the end of the sequence no key tiles at all, so that three
#   consumers pay at D = 64 under the mask from N = 2048 on, and say what FlashAttention-3's two
#   other overlaps measured on this GPU.
#
# **Prerequisites:** notebook 11 (producer, consumers, the persistent grid) and notebook 10 (TMA,
# tensor maps, mbarriers); notebook 09's 128-byte swizzle. The kernel needs a Hopper GPU (H100,
# H200, GH200); elsewhere this notebook replays the numbers recorded on one.
#
# **Time:** about 20 min to read, 40 min to work through.

# %%
# %matplotlib inline
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import tma_store
from flashlab import notebook as nb
from flashlab import plots
nb.banner("12_tma_store")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · The end of a work item in stage 11
#
# When a consumer has multiplied its last P·V of an item, it divides O by the row sums and stores
# it, straight from the accumulator registers:

# %%
nb.show_lines("11_warpspec", r"// O / l of a finished item", r"^  \};")

# %% [markdown]
# A thread holds rows r and r + 8, and in each 8-column tile d the columns 8 d + 2 t and
# 8 d + 2 t + 1 (notebook 09's accumulator layout): 4 bytes once packed to 16 bits. So one warp
# instruction writes 16 bytes in each of 8 rows. Each row's 16 bytes lie in a sector of 32, so
# the instruction sends 8 sectors to L2, each half filled; the other half is written by the
# instruction for the neighbouring tile. Counted for one consumer's 64 × D tile:

# %%
display(pd.concat({f"D = {d}": tma_store.o_store_requests(d) for d in (64, 128)}))

# %% [markdown]
# Twice the sectors the tile needs, 128 store instructions of a warpgroup at D = 128, and a
# consumer issues them all before it can start the next item: O's registers must be read by the
# stores before the next item's first P·V overwrites them.
#
# ## 2 · O goes out the way Q came in
#
# The consumer's 64 rows of the item's Q buffer are free once its last S has read them, and they
# are exactly O's size: 64 × D 16-bit values. The TMA wrote Q there in the 128-byte swizzle, and it
# can read O from the same layout and write it to a tensor map of O, box by box. Stage 12's store:

# %%
nb.show_lines("12_tma_store", r"// O / l of a finished item", r"^  \};")

# %% [markdown]
# Four steps:
#
# 1. **Into shared memory, swizzled.** Each thread writes its 4-byte pairs where the TMA will look
#    for them: row `row`, 16-byte chunk `d % 8` stored at chunk `(d % 8) ^ (row % 8)` of box
#    `d / 8` (`wgmma.sw128`, notebook 09). The 8 rows of a warp instruction are 8 different rows, so
#    the XOR puts them in 8 different chunks, and the 4 lanes of a row in the 4 banks of that
#    chunk: 32 lanes, 32 banks, one wavefront (the figure below).
# 2. **`fence.proxy.async`.** The TMA reads shared memory through the *async proxy*, a different
#    path from the one `st.shared` writes through. The fence makes each thread's writes visible
#    to it; without it the TMA may read stale bytes.
# 3. **A named barrier.** All 128 threads of the warpgroup must have written before one of them
#    issues the copy. `bar.sync 1 + cw, 128` waits for this warpgroup only; the other consumer
#    goes on (barrier 0 is `__syncthreads`, which would stop the producer too).
# 4. **One thread issues the copy:** `cp.async.bulk.tensor.4d.global.shared::cta.bulk_group`, one
#    box of 64 rows × 64 columns per 64 columns of D, then `cp.async.bulk.commit_group`. Rows past
#    N are not written: the tensor map clips them, as it filled them with zeros on the way in.
#
# The copy completes on its own. Nothing waits for it until the buffer is needed again:

# %%
nb.show_lines("12_tma_store", r"if \(j == 0 && prev_slot >= 0", r"softmax\(s, j \* BC\);")

# %% [markdown]
# In stage 11 a consumer warp released its Q buffer (`q_empty`) right after the item's last S; now
# the buffer holds O until the TMA has read it. So the release moves: at the next item's first
# tile, the thread that issued the copy waits for `cp.async.bulk.wait_group.read 0` (the copy has
# *read* shared memory; its writes to global memory may still be on their way) and then arrives,
# once for its warpgroup (`q_empty` now counts one arrival per consumer, not per warp). By then
# the copy of 8–16 KiB has had a whole S = Q Kᵀ to finish. The producer needs the buffer for the
# item after next, so it does not wait either. Before the block exits, the same wait keeps shared
# memory alive until the last copy has read it.
#
# ## 3 · One warp instruction, both ways

# %%
tma_store.o_store_figure(D=64, d=0)

# %% [markdown]
# ## 4 · What changed
#
# Against stage 11: the tensor map of O and its prefetch, the TMA store and its bulk group, the
# named barrier (their wrappers are in `kernels/hopper.cuh`), `q_empty`'s count and the place it
# is arrived at, and the store itself. The producer and the math are stage 11's:

# %%
nb.show_diff("11_warpspec", "12_tma_store", context=1)

# %% [markdown]
# The diff also holds a change of shape: no key tiles for a consumer whose rows lie past the end
# of the sequence, and `pick()`. The next section says why.
#
# ## 5 · Three consumers, none past the end
#
# Stage 11 runs three consumers at D = 64 (192 query rows an item), except under the causal mask
# below N = 2048, where it runs two blocks an SM of two consumers with 64-key tiles. Under the
# mask each of its consumers already runs only the key tiles up to its own last row. One cost of a
# 192-row item is left: **the end of the sequence.** N = 512 is 2⅔ items of 192 rows, N = 1024 is
# 5⅓ and N = 2048 is 10⅔: the last item's last one or two consumers compute rows past the end,
# which are never stored. Without the mask that is an eighth more rows at N = 512 and 1 024 and a
# few per cent from N = 2048 on. Under the mask it costs more: such a consumer's last row is taken
# as N's, so it runs every key tile of the sequence, the longest item of all.
#
# Stage 12 removes it. To the count of each consumer's own tiles, `n_mine`, it adds one line: a
# consumer whose rows all lie past N gets none:

# %%
nb.show_lines("12_tma_store", r"// Under the mask this warpgroup", r"if \(wg_row0 >= N\) n_mine = 0;")

# %% [markdown]
# The tiles after its own go back to the producer unread. The consumer still waits for each to
# land and arrives on its `empty` barriers, or the producer's count of releases would go wrong. A
# consumer with no tiles at all also releases the previous item's Q buffer itself (it has no first
# tile to do it at) and stores nothing:

# %%
nb.show_lines("12_tma_store", r"if \(n_mine > 0\) \{", r"prev_slot = slot;")

# %% [markdown]
# With it, three consumers win under the mask from N = 2048 on. Below that `pick()` keeps stage
# 11's two blocks an SM, which are faster there still:

# %%
nb.show_source("12_tma_store", "pick")

# %% [markdown]
# Measured at D = 64 under the mask, each kernel timed in turn with the others (fp16, H100,
# `data/runs/hopper-try-20261127T0731Z-two-blocks-own-tiles.log`), TFLOP/s at N = 512 … 16384:
#
# | | 512 | 1024 | 2048 | 4096 | 8192 | 16384 |
# |---|---|---|---|---|---|---|
# | stage 11 | 246 | 321 | 387 | 414 | 449 | 464 |
# | stage 12, three consumers everywhere | 262 | 337 | 416 | 437 | 458 | 471 |
# | stage 12, two blocks of two consumers below N = 2048 | 279 | 345 | 416 | 437 | 459 | 471 |
#
# With the consumers past the end computing nothing, three consumers also beat one block of two
# under the mask at N = 512 and 1024 (267 and 343 TFLOP/s against 247 and 326,
# `data/runs/hopper-try-20261127T0123Z-d64-consumers-past-end.log`); two blocks of two are faster
# still. Without the mask only the
# rows past the end change: 1.07× at N = 512 and 1024 and about 1.01× from N = 8192 on, stage 12
# with and without the skip timed in turn (`data/runs/hopper-try-20261126T2350Z-past-end.log`).
# Two at D = 128, where a consumer's
# accumulators take all of 160 registers. Two smaller choices ride along. Three consumers' Q
# buffers leave room for four K/V buffers instead of three (176 KB), so the producer runs further
# ahead: 1.01–1.02× where three consumers run. At D = 128 without the mask, 160-key tiles instead
# of 128 fit in two buffers (225 KB) and spread each tile's waits and issue over more keys:
# 1.01–1.03× from N = 4096, slower below, where the last tile's padding weighs more
# (`data/runs/hopper-try-20261125T1819Z-four-buffers-160-keys.log`).
#
# ## 6 · Prediction, before measuring
#
# Apart from section 5's consumers past the end, only the end of an item changes, so the gain depends on how often
# an item ends: once per N / 128 key tiles (128 keys a tile, at both head dims). Notebook 11's model of a block, with a tile's products and softmax taking 2 units (about
# 3 300 cycles at D = 128), prices the end of an item. Stage 11's stores: 8 consumer warps × D / 4
# instructions × 8 sectors is 2 048 sector writes per SM at D = 128, and 12 warps' 1 536 at D = 64,
# leaving the SM at a few a cycle at best: several hundred to a thousand cycles before the
# consumers can begin
# the next item. Call it 1 unit. Stage 12's: the same number of `st.shared` at one wavefront each, a
# barrier and one instruction: about 0.1.

# %%
h100 = dict(mma=1.0, softmax=1.0, latency=1.0, load=0.5, q_load=0.25, launch=0.5)
predicted = tma_store.store_gain(n_tiles=(4, 8, 16, 32, 64, 128), store11=1.0, store12=0.1, **h100)
predicted.round(3).to_frame().T

# %% [markdown]
# * **Time.** About 1.1× at N = 512 (4 tiles an item), 1.05× at N = 1024, fading below 1.02× from
#   N = 4096 on. At D = 64, add section 5's rows past the end: without the mask up to a ninth
#   fewer at N = 512 and 1024, so up to 1.11× more; under the mask, from N = 2048, the longest
#   item of all for the consumers past the end. At the teaching config (D = 64, N = 1024: 8 tiles
#   an item, three consumers in both stages) expect the store's 1.03–1.08×, times 1.02–1.07 for
#   the rows past the end: **1.05–1.15×**.
# * **Machine code:** no `STG` left; `STS` for O, a `BAR.SYNC` on a named barrier, `UTMASTG` (the
#   TMA store, D / 64 of them) and `UTMACMDFLUSH` (the commit).
# * **Profile:** the global stores gone from the SM's load/store path, so *sectors per store
#   request* falls from 8 to nothing, and the tensor pipe is busier by the time saved.

# %%
gain_band = (1.05, 1.15)

# %% [markdown]
# ## 7 · The machine code

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("11_warpspec", "12_tma_store")
    display(mix[mix.index.get_level_values("kernel").str.contains("__half")].droplevel("stage").T)

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("12_tma_store", r"FENCE|BAR\.SYNC|UTMASTG|UTMACMDFLUSH|"
                                                  r"DEPBAR\.LE SB0", kernel=r"__half, 128,")))

# %% [markdown]
# `FENCE.VIEW.ASYNC.S` is `fence.proxy.async.shared::cta` (once after the mbarriers' set-up, once
# before each store); `BAR.SYNC.DEFER_BLOCKING R5, 0x80` the named barrier, its id in a register
# and 0x80 = 128 threads; `UTMASTG.4D` the two boxes of D = 128; `UTMACMDFLUSH` the commit;
# `DEPBAR.LE SB0, 0x0` the `wait_group.read 0`, once in the loop (at an item's first tile) and
# once before the exit. The counts above: `STG` is gone, and the `STS` count is stage 11's `STG`
# count — the same 4-byte pieces, to shared memory instead.

# %% [markdown]
# ## 8 · Measure
#
# On a Hopper GPU this builds the stage, checks it against a float64 reference, then times it
# together with stage 11 and SDPA's flash and cuDNN backends, run by run in turn at each config (the
# teaching configs, then the FlashAttention sweep), three rounds over, as `flashlab run` does, so
# that their ratios come from one run. Otherwise: the recorded rows.

# %%
ev = nb.evaluate("12_tma_store")
ev

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    gain = nb.speedup("11_warpspec", "12_tma_store", "fp16")
    print(f"stage 12: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{gain:.2f}x stage 11; predicted {gain_band[0]:.2f} - {gain_band[1]:.2f}x")
    print(f"bf16: {nb.speedup('11_warpspec', '12_tma_store', 'bf16'):.2f}x stage 11")

# %% [markdown]
# Both stages' rows at the teaching config, with the spread of their timed runs (p20 and p80):

# %%
with nb.unless_missing():
    display(nb.teaching_rows(["11_warpspec", "12_tma_store"]))

# %% [markdown]
# Over the sweep: stage 12 over stage 11, then over cuDNN's attention and over PyTorch's
# FlashAttention-2 backend:

# %%
with nb.unless_missing():
    gains = nb.sweep_ratio("12_tma_store", "11_warpspec")
    display(gains.round(2))
    print("mean gain by N: " + ", ".join(f"{n}: {g:.2f}x" for n, g in gains.mean().items()))
    display(nb.sweep_ratio("12_tma_store", "sdpa_cudnn").round(2))
    fa2 = nb.sweep_ratio("12_tma_store", "sdpa_flash")
    print(f"stage 12 over sdpa_flash (FlashAttention-2): {fa2.min().min():.2f}-"
          f"{fa2.max().max():.2f}x")

# %%
plots.scaling(last="12_tma_store")

# %% [markdown]
# ### Discussion
#
# **Time.** The prediction was a gain that shrinks as items grow, about 1.1× at N = 512 and 1.05×
# at N = 1024, plus section 5's at D = 64. Measured, with stages 11 and 12 and the two baselines
# timed in turn at each config (the run recorded in `data/`, stages 08–10 beside them, gave the same
# table to within 0.02): 1.14–1.16× at N = 512 and 1.08–1.12× at N = 1024, then 1.05–1.08× at
# N = 2048 and 1.00–1.06× from N = 4096 on. That is the predicted shape, a little above the
# model at the short end at both head dims: 1.15× at N = 512 where the model gives 1.11.
#
# * **At D = 64 without the mask** the store and the rows past the end add up to 1.16× and 1.12×
#   at N = 512 and 1024, and fade to 1.00× from N = 8192, where a sequence is 43–85 items and
#   only the last one has rows past its end. There stage 12 runs stage 11's kernel with another
#   store, and the two tie.
# * **At D = 64 under the mask** both stages run two blocks of two consumers at N = 512 and 1024,
#   and only the store differs: 1.14× and 1.08×. From N = 2048 both run three consumers, and the
#   consumers past the end, which ran the longest item of all in stage 11, add to the store: 1.08×
#   at N = 2048 and 1.06× at 4096, fading to 1.01–1.02× as the last item's share of the work
#   falls.
# * **Where it missed.** At D = 128, where only the store changes, the model says 1.01–1.03× from
#   N = 4096 on. Without the mask the measured cells agree: 1.03–1.04×, with 160-key tiles
#   adding their 1.00–1.02× (section 5). Under the mask they agree too (1.02–1.04×), though a
#   causal item is on average half as long as a non-causal one. At long N the GPU's clock moves by
#   a few per cent from second to second, which is why the run times the kernels together, run by
#   run in turn: timed one after the other, each for its own third of a second, the same two
#   kernels can come out in either order at one cell.
#
# **The teaching config** (D = 64, N = 1024: 8 tiles an item, three consumers in both stages):
# 1.07× in fp16 and in bf16 here, 1.08× and 1.07× in the recorded run, every row tight (the
# check above): inside the predicted band of 1.05–1.15×.
#
# **Against stage 10.** At D = 64 stage 10 runs four warpgroups an SM with 128-key tiles, a shape
# the producer's registers keep stages 11 and 12 from (notebook 11). There stage 12 is 1.00–1.07×
# stage 10 in the recorded run: the store and the consumers past the end win back what the
# registers cost on short sequences, and the two are level from N = 4096 on (1.00–1.02×). At
# D = 128 stage 12 is 1.07–1.33× stage 10.
#
# **Against cuDNN** stage 12 runs at 1.01–1.15× here (1.00–1.15× in the recorded run): ahead at
# every config of the sweep. The margin is widest at D = 64 (1.06–1.13×), where three consumers
# keep more softmaxes beside the tensor cores, and narrowest at D = 128 on short sequences without the mask (1.01–1.02× at
# N = 512 to 2048). There an item is a few tiles, the two consumers start
# and end it together, and cuDNN's warpgroups take turns (section 10) where these do not. Stage
# 11 was 0.87–1.14×. Against FlashAttention-2 (`sdpa_flash`) stage 12 is 1.59–2.33× faster.

# %% [markdown]
# ## 9 · The profile

# %%
idea = list(fl.stage("12_tma_store").idea_metrics)
with nb.unless_missing():
    prof = nb.profile("12_tma_store")
    stall_rows = prof.index[prof.index.str.startswith("stall_")]
    display(prof.loc[[m for m in ["duration_ms", "tensor_pipe_pct", "sm_throughput_pct",
                                  "global_store_sectors_per_request", "smem_store_bank_conflicts",
                                  "smem_wavefronts"] if m in prof.index]
                     + list(stall_rows)].round(2))
    if "11_warpspec" not in prof.columns:
        raise nb.not_recorded("11_warpspec", " profile (to compare with)", " --profile")
    for m in idea + ["stall_short_scoreboard", "stall_lg_throttle"]:
        print(f"{m}: {prof.at[m, '11_warpspec']:.2f} -> {prof.at[m, '12_tma_store']:.2f}")
    d11, d12 = prof.at["duration_ms", "11_warpspec"], prof.at["duration_ms", "12_tma_store"]
    print(f"duration under Nsight Compute: {d11:.4f} -> {d12:.4f} ms ({d11 / d12:.2f}x)")

# %%
plots.idea_metrics(only=["12_tma_store"])

# %% [markdown]
# ### Discussion
#
# * **The stores are gone from the load/store path**, as predicted: stage 11's 8 sectors per store
#   request (the half-filled sectors of section 1) become no request at all. The only global
#   stores left are the TMA's, which Nsight Compute does not count as the SM's requests.
# * **The kernel is 1.07× faster under the profiler** (0.0477 → 0.0444 ms), the tensor pipe busy
#   about as much of the time (46.4 % → 46.7 %). Both compute with three consumers here, so the
#   tensor cores do a ninth less work in stage 12, whose consumers past the end of the sequence
#   compute nothing (section 5): the same share of a shorter time is the products that remain.
# * **Fewer short waits:** `short_scoreboard` (waiting for shared memory and other variable-latency
#   units) 5.5 % → 3.2 %, and `lg_throttle` (a full queue of global memory instructions) goes
#   to zero. `long_scoreboard` rose (12 → 16 %). Polling an mbarrier is counted there, and the
#   consumers past the end poll the `full` barrier of every tile they hand back: a likely reason,
#   not measured on its own.
# * **A surprise: bank conflicts on shared-memory stores,** about 2.4 thousand against stage 11's
#   52, where section 2's bank map promises none. They are few: the kernel issues tens of
#   thousands of warp-wide `st.shared` for O at this config, so they add a few per cent to those
#   stores' wavefronts, and O's stores are a small part of all shared-memory traffic
#   (`smem_wavefronts`). The addresses are not the cause: each instruction's 32 words are in 32
#   banks. One possible cause, not tested here: the counter may also count a store that finds its
#   bank busy with other traffic, such as the TMA writing the next tiles. At a few per cent of
#   these stores it does not matter for the time.

# %% [markdown]
# ## 10 · The overlaps that did not pay
#
# FlashAttention-3 adds two more overlaps to a kernel of stage 11's shape. The two consumers take
# turns at the tensor cores (*ping-pong*, ordered by named barriers), so that one's softmax runs
# under the other's products. Inside a consumer, the softmax of tile j runs while the products of
# tile j − 1 are still in flight. Both were built on top of stage 11 and measured against it on
# this GPU, over the same sweep. They tie: 0.84–1.03× stage 11, with either overlap or both, with
# two or three consumers, with 128 or 160 keys a tile. Getting the second one to run at all took
# care: inside one basic block, ptxas places a `wgmma.wait_group` as early as it can, above the
# exponentials it was meant to overlap. Rotating the loop (the wait at the top of a turn, the
# softmax at its end) keeps the loop's back edge between the two.
#
# Notebook 11 measured why they tie. A consumer's softmax takes 1 400–1 500 cycles per tile beside
# the other consumer, while that consumer's products take about 1 024. Taking turns cannot hide a
# step longer than what it is hidden under. Stage 12's gain is of a different kind. It does not
# hide the softmax; it removes work from the end of every item, and the end of an item is where
# both consumers stop at once.
#
# FlashAttention-3's own shape at D = 64 is three consumers with the in-warpgroup overlap. Built
# on the overlap kernel above with a 24-register producer, it timed no better than three consumers
# without the overlap: 0.94–1.04× over the D = 64 sweep
# (`data/runs/hopper-try-20261125T1752Z-d64-three-consumers.log`).
#
# The narrowest margins left against cuDNN are at the shortest sequences without the mask: at
# D = 128 (1.01–1.03× up to N = 2048) and at D = 64, N = 1024 (1.04–1.07× from run to run). At
# D = 64 a score costs half the multiply-adds of D = 128 and the same softmax, so the softmax's
# length sets the pace even more. Every exponential is already the special-function unit's single instruction. The remaining
# levers are the instructions around it: the row maximum, the row sum and the rescale of O.
# Fewer of them is not enough by itself: row sums taken as packed fp16 pairs (in the kernel's
# machine code, 34 `HADD2` in place of 74 `FADD`) measured 0.96–0.99× stage 12 at D = 64
# (`data/runs/hopper-try-20261125T1749Z-d64-half-sums-three-consumers.log`). What the softmax
# spends is one part; what it waits for is another. Every exponential of a tile waits for the
# tile's row maximum, and O is rescaled at every tile: stage 13 takes both off the softmax's path.

# %% [markdown]
# ## Exercises
#
# ### Lab `12.store_sectors`
#
# Section 1's count, for a head dim of 256.

# %%
from flashlab.course import labs
print(labs.prompt("12.store_sectors"))

# %%
### BEGIN SOLUTION
pairs_a_thread = 2 * 256 // 8                 # 2 rows x 32 tiles of 8 columns
store_instructions = 4 * pairs_a_thread      # one per store, in each of 4 warps
answer = (store_instructions, store_instructions * 8, 64 * 256 * 2 // 32)
### END SOLUTION

# %%
labs.check("12.store_sectors", answer)

# %% [markdown]
# ### Kernel exercise `12.o_address` (10 points)
#
# **Where:** the `store` lambda in `kernels/12_tma_store.cu`, between `// BEGIN EXERCISE
# 12.o_address` and `// END EXERCISE 12.o_address`. The stub writes O row-major, without the
# swizzle. It compiles and runs and the TMA copies it out, but the TMA reads the tile as swizzled:
# in every row but the multiples of 8, the 16-byte chunks come out in the wrong columns.
#
# **What to write:** the shared-memory address `at` of this thread's 4 bytes of row `row`, columns
# 8 d + 2 t and 8 d + 2 t + 1, in the layout the TMA wrote Q in (section 2, step 1; `wgmma.sw128`
# computes it in Python). The `+ 8 * 128` for row `row + 8` is already there.
#
# **How it is judged.** `flashlab grade` builds stage 12 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, the strided layout of a model's projections, and keys whose size grows along
# the sequence, so that every row's maximum keeps rising and each rescale path runs. A wrong kernel
# scores 0, and the message names the first failing case and its first wrong element (batch, head,
# row, column, got, expected). A right one is timed at the teaching config and under the causal
# mask: when your instructor grades, in turn with the solution's stage on the same GPU, the slower
# of the two ratios counting; when you check your own work, against the solution's recorded speedup
# over stage 11. Full points within 5 % of the solution's speed, fewer below. A layout with bank
# conflicts would show in the time.
#
# **GPU:** compute capability 9.0 (H100, H200, GH200); elsewhere `flashlab grade` skips it with one
# line saying why. Run it with
#
#     flashlab grade --exercise 12.o_address

# %% [markdown]
# ## Questions for discussion
#
# 1. Why must the consumer write O in the 128-byte swizzle, when a TMA tensor map can also be
#    made with no swizzle at all? What would `st.shared` cost then?
# 2. The thread that issued the copy waits for `wait_group.read` before the producer may refill
#    the buffer. Why `.read` and not the full `wait_group 0`? What would go wrong with no wait at
#    all?
# 3. Where else could O go? The producer warpgroup has three idle warps: what would it take for
#    them to store O instead of the consumers?
# 4. Stage 12's gain fades as N grows. Which other costs of a work item are paid once per item,
#    and which of them are still paid while the tensor cores wait?
# 5. A consumer past the end of the sequence hands every tile of its item back unread. Why must it
#    still wait for each tile's `full` barrier before it arrives on its `empty` ones, and why must
#    it release the previous item's Q buffer itself?

# %% [markdown]
# **Instructor's answer.** *1.* Without the swizzle a warp's instruction would write 8 rows at the
# same chunk of 8 lines 128 bytes apart: the same 4 banks for all 8 rows, 8 wavefronts instead of
# 1 (notebook 06's conflict). The swizzle is free here because the TMA undoes it on the way out,
# as it applied it on the way in; and it lets O reuse Q's buffer and Q's layout.

# %% [markdown]
# **Instructor's answer.** *2.* `.read` returns once the TMA has read the shared memory; the writes
# to global memory may still be in flight, and nothing in the block needs them (the kernel's end
# makes them visible). The full wait would also wait for the global writes to complete, longer and
# for nothing. With no wait, the producer could copy the next-but-one item's Q into the buffer
# while the TMA is still reading O from it: O would be written with parts of Q.

# %% [markdown]
# **Instructor's answer.** *3.* O is in the consumers' registers, and registers cannot be read by
# another warp: O would have to go through shared memory anyway, which is what the consumers now
# write. The producer's warps could issue the copy (after a barrier shared with the consumer that
# wrote it), but issuing is one instruction; the work is the writing into shared memory, and only
# the register owners can do it.

# %% [markdown]
# **Instructor's answer.** *4.* Per item: waiting for Q, the first S before any softmax (no P·V is
# in flight yet), the last P·V with no softmax beside it, and the normalisation and store of O.
# The two consumers start each item together, so at the first tile both run their softmax at the
# same time and the tensor cores idle; at the last tile both wait for their last P·V. Stage 12
# shortened the store; the start and the end of an item are still paid with idle tensor cores.

# %% [markdown]
# **Instructor's answer.** *5.* The producer refills a buffer once every consumer warp has arrived
# on its `empty` barrier: a consumer that never arrived would leave it waiting forever. The
# arrival must also count toward this use of the buffer. The producer refilled it only once every
# consumer had released its previous use, so a consumer that has seen `full` complete for this use
# arrives for this use; one that arrived without waiting could, running ahead, arrive on a phase
# that another consumer is still reading, and the producer would overwrite the tile under it.
# Q is the same: its buffer goes back at the next item's first tile, after the TMA has read O out
# of it (`wait_group.read`). A consumer with no tiles has no first tile, so it waits and arrives
# right after its item's loop instead, or the producer would wait for that buffer two items later,
# and hang.

# %% [markdown]
# ## Summary
#
# - Stage 11 ends every work item with D / 4 four-byte stores per thread from registers; each warp
#   instruction writes 8 half-used sectors, and the consumers issue them all before they can go
#   on.
# - Stage 12 writes O into its warpgroup's rows of the item's Q buffer, in the 128-byte swizzle
#   (one wavefront a warp instruction), makes the writes visible to the TMA with
#   `fence.proxy.async`, gathers its 4 warps at a named barrier, and one thread copies the tile out
#   with a TMA store; the consumers start the next item at once.
# - The buffer goes back to the producer only after `cp.async.bulk.wait_group.read`, at the next
#   item's first tile.
# - The gain is largest where items are short, 1.15× at N = 512 (about 1.1× by the model of a
#   block), and fades as N grows; against cuDNN the stage runs at 1.00–1.15× over the sweep, ahead
#   at every config.
# - A consumer whose rows lie past the end of the sequence runs no tile: with it, three consumers
#   of 64 rows pay at D = 64 on every sequence but the short causal ones, where stage 11's two
#   blocks an SM stay faster. It still waits for each tile it hands back, so that the producer's
#   count of releases stays right.
# - FlashAttention-3's ping-pong and in-warpgroup overlap tie with stage 11 on this GPU: a
#   consumer's softmax is longer than the other consumer's products that would hide it.

# %%
nb.reached("12_tma_store")
