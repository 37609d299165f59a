# %% [markdown]
# # Stage 12 — the TMA stores O: a work item's output leaves while the next one is computed
#
# Stage 11's consumers end every work item as stage 05's warps did: each thread writes its part of O
# from its registers, 4 bytes at a time. After a long loop that is a small tail; on a short
# sequence it is not (at N = 512 a work item is four key tiles). Hopper's tensor memory accelerator
# copies both ways: the consumers write O into the Q buffer they no longer need, one thread hands it
# to the TMA, and the warps start the next item while the copy runs.
#
# ## Objectives
# After this notebook you can:
# - count what stage 11's end of an item sends to memory: instructions, sectors, bytes used;
# - write a tile into shared memory in the TMA's 128-byte swizzle without bank conflicts, and
#   hand it to a TMA store: `fence.proxy.async`, a named barrier, `cp.async.bulk.tensor` from
#   shared to global memory, a bulk group;
# - reuse a buffer that the TMA reads asynchronously: when `cp.async.bulk.wait_group.read` allows
#   it, and when the producer may refill it;
# - predict where the store pays (short work items) and check it in the machine code, the sweep
#   and the profile.
#
# **Prerequisites:** notebooks 11 (producer and consumer warpgroups) and 10 (TMA, tensor
# maps, mbarriers); notebook 09's 128-byte swizzle. The kernel needs a Hopper GPU (H100, H200,
# GH200); elsewhere this notebook replays the numbers recorded on one.
#
# **Time:** about 25 min to read, 45 min to work through.

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
# A thread holds rows r and r + 8 and, in each 8-column tile d, columns 8 d + 2 t and 8 d + 2 t + 1
# (notebook 09's accumulator layout): 4 bytes once packed to 16 bits. One warp instruction writes
# 16 bytes in each of 8 rows, so it sends 8 sectors of 32 bytes to L2, each half filled. Counted for
# one consumer's 64 × D tile:

# %%
display(pd.concat({f"D = {d}": tma_store.o_store_requests(d) for d in (64, 128)}))

# %% [markdown]
# Twice the sectors the tile needs, 128 store instructions at D = 128, all issued before the
# consumer can start the next item, whose first P·V overwrites O's registers.
#
# ## 2 · O goes out the way Q came in
#
# The consumer's 64 rows of the item's Q buffer are free once its last S has read them, and they
# are exactly O's size. The TMA wrote Q there in the 128-byte swizzle; it can read O from the same
# layout and write it through a tensor map of O. Stage 12's store:

# %%
nb.show_lines("12_tma_store", r"// O / l of a finished item", r"^  \};")

# %% [markdown]
# Four steps:
#
# 1. **Into shared memory, swizzled.** Each thread writes its 4-byte pairs where the TMA will look
#    for them: row `row`, 16-byte chunk `d % 8` stored at chunk `(d % 8) ^ (row % 8)` of box
#    `d / 8` (`wgmma.sw128`, notebook 09). A warp instruction's 8 rows land in 8 different chunks,
#    and a row's 4 lanes in that chunk's 4 banks: 32 lanes, 32 banks, one wavefront (the figure
#    below).
# 2. **`fence.proxy.async`.** The TMA reads shared memory through the *async proxy*, not the path
#    `st.shared` writes through; the fence makes each thread's writes visible to it.
# 3. **A named barrier.** `bar.sync 1 + cw, 128` waits for this warpgroup's 128 threads only
#    (`__syncthreads` would stop the producer and the other consumer too).
# 4. **One thread issues the copy:** `cp.async.bulk.tensor.4d.global.shared::cta.bulk_group`, one
#    box of 64 rows × 64 columns per 64 columns of D, then `cp.async.bulk.commit_group`. The tensor
#    map drops rows past N.
#
# Nothing waits for the copy until the buffer is needed again:

# %%
nb.show_lines("12_tma_store", r"if \(j == 0 && prev_slot >= 0", r"softmax\(s, j \* BC\);")

# %% [markdown]
# Stage 11 released the Q buffer (`q_empty`) after the item's last S; now it holds O until the TMA
# has read it. So at the next item's first tile the issuing thread waits for
# `cp.async.bulk.wait_group.read 0` (the copy has *read* shared memory; its global writes may still
# be on their way) and arrives once for its warpgroup. By then the 8–16 KiB copy has had a whole
# S = Q Kᵀ to finish. Before the block exits, the same wait keeps shared memory alive for the last copy.
#
# ## 3 · One warp instruction, both ways

# %%
tma_store.o_store_figure(D=64, d=0)

# %% [markdown]
# ## 4 · What changed
#
# Against stage 11: the tensor map of O and its prefetch, the TMA store and its bulk group, the
# named barrier (wrappers in `kernels/hopper.cuh`), `q_empty`'s count (one arrival per consumer)
# and where it is arrived at, and the store itself:

# %%
nb.show_diff("11_warpspec", "12_tma_store", context=1)

# %% [markdown]
# ## 5 · What else the kernel carries
#
# The diff also holds two changes of shape, measured in appendix 12a:
#
# | change | where | why |
# |---|---|---|
# | a consumer whose rows all lie past the end of the sequence runs no key tile, and releases the previous item's Q buffer itself | D = 64, three consumers (192 rows an item) | stage 11 computed those rows for nothing: an eighth more at N = 512 and 1024 |
# | 160-key tiles | D = 128 without the mask, from N = 4096 | two buffers still fit, and each tile's waits and issue are spread over more keys |
#
# So at D = 128 under the mask, at D = 128 without it up to N = 2048 and at D = 64 under the mask
# up to N = 1024 (two blocks of two consumers, stage 11's shape), only the store differs: there
# section 8 measures this stage's idea alone.
#
# ## 6 · Prediction, before measuring
#
# Where only the store changes, the gain depends on how often an item ends: once per N / 128 key
# tiles. Notebook 11's model of a block prices it, with a tile's products and softmax at 2 units
# (about 3 200 cycles at D = 128, appendix 12a). Stage 11's end of an item: 8 consumer warps × D / 4
# instructions × 8 sectors, 2 048 sector writes per SM at D = 128, at a few a cycle at best: several
# hundred to a thousand cycles. Call it 1 unit. Stage 12's: the same number of `st.shared` at one
# wavefront each, a barrier and one instruction: about 0.1.

# %%
h100 = dict(mma=1.0, softmax=1.0, latency=1.0, load=0.5, q_load=0.25, launch=0.5)
predicted = tma_store.store_gain(n_tiles=(4, 8, 16, 32, 64, 128), store11=1.0, store12=0.1, **h100)
predicted.round(3).to_frame().T

# %% [markdown]
# * **Time.** About 1.1× at N = 512 (4 tiles an item), 1.05× at N = 1024, below 1.02× from
#   N = 4096 on. At the teaching config (D = 64, N = 1024, 8 tiles an item) the consumers past the
#   end stop computing an eighth of the rows (stage 11 computes 1 152 for 1 024), worth up to
#   1.125× more: **1.05–1.18×**.
# * **Machine code:** no `STG`; `STS` for O, a `BAR.SYNC` on a named barrier, `UTMASTG` (the TMA
#   store, D / 64 of them) and `UTMACMDFLUSH` (the commit).
# * **Profile:** *sectors per store request* from 8 to none, the tensor pipe busier.

# %%
gain_band = (1.05, 1.18)

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
# `STG` is gone and `STS` grows by its count (1 → 33 at D = 128, 1 → 17 at D = 64): the same
# 4-byte pieces, to shared memory. `UTMASTG.4D` is the TMA store (two boxes at D = 128),
# `UTMACMDFLUSH` the commit. `BAR.SYNC.DEFER_BLOCKING R2, 0x80` is the named barrier, its id
# (1 + cw) in R2, 0x80 = 128 threads (`0x0` is the set-up's `__syncthreads`). The first
# `FENCE.VIEW.ASYNC.S` is the set-up's `fence.mbarrier_init`, the second the store's
# `fence.proxy.async.shared::cta`. The three `DEPBAR.LE SB0, 0x0` are the source's three
# `cp.async.bulk.wait_group.read 0`: at an item's first tile before the arrival on `q_empty`
# (0x0f70); where a consumer with no tiles (section 5) releases the previous item's buffer
# (0x3eb0); before the block exits (0x5b80).
#
# ## 8 · Measure
#
# On a Hopper GPU this builds and checks the stage, then times it with stage 11 and SDPA's flash
# and cuDNN backends, in turn at each config, so that their ratios come from one run; elsewhere it
# replays the recorded rows.

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
# **Where only the store changed** (section 5), stage 12 is 1.14–1.16× stage 11 at N = 512,
# 1.08–1.10× at 1024, 1.05–1.06× at 2048 and 1.04× at 4096, fading to 1.02× at 8192 and 16384: the
# predicted shape, the shorter the items the larger the gain.
#
# **Where it missed: the size.** At D = 128 without the mask the model gave 1.107, 1.055 and 1.028
# at N = 512, 1024 and 2048; measured, 1.16×, 1.09× and 1.05×, one and a half to two times the
# predicted gain: the model's 1 unit for stage 11's end of an item was too little.
#
# **The teaching config** (D = 64, N = 1024): 1.07× in fp16 and in bf16, every row tight: inside the
# predicted 1.05–1.18×. At D = 64 without the mask the consumers past the end add to the store
# (1.16× and 1.12× at N = 512 and 1024); from N = 8192, where a head's last item is one of 43 or
# more, the gain fades to 1.00×.
#
# **Against cuDNN:** 1.01–1.15× over the sweep, ahead at every config; narrowest at D = 128 on
# short sequences without the mask (1.01–1.02× up to N = 2048), where both consumers start and end
# each short item together (question 3). Against FlashAttention-2 (`sdpa_flash`):
# 1.59–2.33×.
#
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
# * **The stores are gone from the load/store path**, as predicted: 8 sectors per store request
#   become none (the TMA's writes are not the SM's requests).
# * **1.07× faster under the profiler** (0.0477 → 0.0444 ms), the tensor pipe busy about as much of
#   the time (46.4 % → 46.7 %): at this config stage 12's consumers past the end compute nothing, so
#   the tensor cores do a ninth less work in a shorter time.
# * **Fewer short waits:** `short_scoreboard` 5.5 % → 3.2 %, `lg_throttle` (a full queue of global
#   memory instructions) to zero. `long_scoreboard` rose (12 → 16 %); polling an mbarrier counts
#   there, and the consumers past the end poll the `full` barrier of every tile they hand back.
# * **A surprise: bank conflicts on shared-memory stores,** about 2.4 thousand against 52, where
#   section 2's bank map promises none (a few per cent of the `st.shared` for O); perhaps the
#   counter also counts a store that finds its bank busy with the TMA (not tested).

# %% [markdown]
# ## 10 · FlashAttention-3's two overlaps, run by you
#
# FlashAttention-3 adds two overlaps to a kernel of this shape. In **ping-pong**, two consumer
# warpgroups take turns at the tensor cores (named barriers order the turns), so one's softmax
# runs under the other's products. In the **in-warpgroup** overlap a consumer issues S_j with
# P_{j−1}·V_{j−1} and runs tile j's softmax while that P·V is in flight. Both are *variants* of
# this stage: a patch rewrites its consumer loop (two consumers, O from registers), in
# three versions: `no_overlap`, `in_warpgroup`, and `ping_pong` (both). Carried
# regions keep your code. The loop with both:

# %%
from flashlab import variants
pingpong = variants.source(fl.stage(12).variant("ping_pong"))
print(nb.excerpt(pingpong, r"for \(int j = 1; j < my_tiles; j\+\+\) \{", r"softmax\(s, j \* BC\);"))

# %% [markdown]
# **Predict first.** A turn hides a consumer's softmax under the other's products. At D = 128
# a consumer's two products of a 128-key tile are 2 · 64·128·128 multiply-adds: about 1 024
# cycles of the SM's tensor cores. Its softmax takes 1 200–1 400 cycles a tile beside the other
# consumer (appendix 11a). At D = 64 the products halve; the softmax does not. Do the turns pay,
# at each head dim? Can the in-warpgroup overlap?
#
# On a Hopper GPU the next cell builds the variants, checks each against float64 (ragged N, both
# masks, fp16 and bf16, output poisoned) and times them in turn with stage 12: each variant over
# stage 12, then each overlap over the kernel it was added to. Elsewhere it replays them.

# %%
with nb.unless_missing():
    display(tma_store.overlaps())

# %% [markdown]
# All four under Nsight Compute, same GPU, D = 128 (B = 4, H = 16, N = 4096): time, tensor-pipe
# share, main stall reasons (% of warp cycles).

# %%
with nb.unless_missing():
    display(tma_store.overlap_profile())

# %% [markdown]
# ### Discussion
#
# On the H200 they were recorded on, every variant passes the check and none beats stage 12:
# `ping_pong` runs at 0.81–0.84× at D = 64 and 0.88–0.95× at D = 128. Partly that is what the
# rewrite drops: `no_overlap` is 0.83–0.86× at D = 64 (two consumers; no TMA store) and
# 0.88–0.96× at D = 128. Against the kernel each was added to:
#
# - the in-warpgroup overlap *loses*: 0.92–0.96× at D = 64, 0.97–0.98× at D = 128;
# - the turns *gain* on top of it, most where the products are shortest: 1.02–1.07× at D = 64,
#   1.01× at D = 128.
#
# In the profile both overlaps cut the `barrier` stall (22.9 % → 10.7 % and 12.5 %), but `wait`
# (the wgmma waits among the fixed-latency ones) and `short_scoreboard` (the exponentials) rise,
# and the tensor pipe is *less* busy (75.0 % → 72.8–73.8 %; stage 12: 80.5 %). As predicted, a
# softmax longer than the products it runs under is not hidden: each turn waits for it, and the
# in-warpgroup overlap adds a second S and P to the same warps' registers and issue slots. Stage
# 13 shortens the softmax itself.

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
# swizzle: it runs, but the TMA reads the tile as swizzled, so in every row but the multiples of 8
# the 16-byte chunks come out in the wrong columns.
#
# **What to write:** the shared-memory address `at` of this thread's 4 bytes of row `row`, columns
# 8 d + 2 t and 8 d + 2 t + 1, in the layout the TMA wrote Q in (section 2, step 1; `wgmma.sw128`
# computes it in Python). The `+ 8 * 128` for row `row + 8` is already there.
#
# **How it is judged.** `flashlab grade` compares stage 12 built from your region with a float64
# reference (NaN-filled output, ragged N, both head dims, both masks, fp16 and bf16, a model's
# strided layout); a wrong kernel scores 0, and the message names the first failing case and
# element. A right one is timed at the teaching config and under the causal mask against the
# solution's stage: full points within 5 % of its speed, fewer below. Bank conflicts would show in
# the time.
#
# **GPU:** compute capability 9.0 (H100, H200, GH200); elsewhere `flashlab grade` skips it with one
# line saying why. Run it with
#
#     flashlab grade --exercise 12.o_address

# %% [markdown]
# ## Questions for discussion
#
# 1. Why must the consumer write O in the 128-byte swizzle, when a tensor map can also be made
#    without one? What would `st.shared` cost then?
# 2. Why does the issuing thread wait for `wait_group.read`, not the full `wait_group 0`, before
#    the producer may refill the buffer? What would go wrong with no wait at all?
# 3. Stage 12's gain fades as N grows. Which other costs are paid once per work item, and which
#    still leave the tensor cores waiting?
# 4. A consumer whose rows all lie past the end of the sequence has no first tile. Where must it
#    release the previous item's Q buffer, and what if it never did?
# 5. In section 10 the turns gained most at D = 64, where the in-warpgroup overlap lost most. Why,
#    from the cycle counts of its prediction?

# %% [markdown]
# **Instructor's answer.** *1.* Unswizzled, a warp instruction's 8 rows, 128 bytes apart, would hit
# the same 4 banks: 8 wavefronts instead of 1 (notebook 06). The swizzle costs nothing: the TMA
# undoes it on the way out as it applied it on the way in, and O reuses Q's buffer and layout.

# %% [markdown]
# **Instructor's answer.** *2.* `.read` returns once the TMA has read shared memory; nothing in the
# block reads the global writes, so the full wait would wait longer for nothing. With no wait, the
# producer could load a later item's Q into the buffer while the TMA still reads O from it.

# %% [markdown]
# **Instructor's answer.** *3.* Waiting for Q, the first S with no P·V beside it, the last P·V with
# no softmax beside it, O's normalisation and store. The consumers start each item together, so at
# its first tile both run their softmax while the tensor cores idle, and at its last both wait for
# their P·V. Stage 12 shortened only the store.

# %% [markdown]
# **Instructor's answer.** *4.* Right after its item's loop, after `wait_group.read` (its previous O
# may still be leaving that buffer). `q_empty` needs one arrival per consumer: without it the
# producer would wait for that buffer two items later, forever.

# %% [markdown]
# **Instructor's answer.** *5.* At D = 64 a consumer's products take about 512 cycles against a
# softmax of about 1 600 (appendix 11a): the in-warpgroup overlap has little P·V to hide the
# softmax under, and still doubles the live S and P (0.92–0.96×). The turns keep one consumer's
# products going during the other's long softmax, so the tensor pipe idles less: 1.02–1.07× on
# top, as recorded on the H200.

# %% [markdown]
# ## Summary
#
# - Stage 11 ends every work item with D / 4 four-byte stores a thread, each warp instruction
#   writing 8 half-used sectors, before the next item can start.
# - Stage 12 writes O into the item's Q buffer in the 128-byte swizzle, fences it for the async
#   proxy, gathers the warpgroup at a named barrier, and one thread copies it out with a TMA store
#   while the consumers start the next item.
# - The buffer goes back to the producer after `cp.async.bulk.wait_group.read`, at the next item's
#   first tile.
# - Where only the store changed, it gained 1.14–1.16× at N = 512, fading to 1.02× at N = 16384: the
#   predicted shape, a larger size. At the teaching config 1.07×; 1.01–1.15× cuDNN over the sweep.
# - FlashAttention-3's two overlaps, built on this stage as variants and timed beside it, did not
#   pay on the H200: a softmax longer than the products it runs under is not hidden.

# %%
nb.reached("12_tma_store")
