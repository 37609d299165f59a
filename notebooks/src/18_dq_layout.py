# %% [markdown]
# # Stage 18 — dQ laid out for its reductions
#
# Stage 17 gave each warp twice the work in flight and overtook SDPA's flash backward at D = 64,
# but at D = 128 it stayed up to a tenth behind. Every product it computes, FlashAttention-2
# computes too, and both add the same partial sums into dQ. Where the two kernels differ is *where
# in memory* those sums land. This stage changes only that: dQ's fp32 sum is kept in the order in
# which the warps add into it, so that every reduction instruction fills whole cache lines.
#
# ## Objectives
# After this notebook you can:
# - follow a warp-wide global memory instruction to the cache lines and sectors it touches;
# - say why the number of lines an instruction touches costs time even when the bytes are the same;
# - choose a layout for a scratch buffer from the way it is written, and undo it when reading back;
# - spread concurrent blocks over different addresses, and say when that helps.
#
# **Prerequisites:** notebooks 15 and 17 (the tensor-core backward, its dQ reductions); 02
# (coalescing: sectors and lines); 05 (`mma.sync` fragments).
#
# **Time:** about 18 min to read, 30 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import dq_layout
from flashlab import notebook as nb
nb.banner("18_dq_layout")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · What dQ's reductions cost
#
# In stages 14 to 17 each block owns a block of keys and walks every query block. dK and dV stay
# in the warps' registers, but dQ for a query block gets a share from *every* key block, so each
# key block adds its share into an fp32 sum in global memory with reduction instructions (`RED`,
# an `atomicAdd` whose old value is not read). L2 performs the additions, so no block waits for
# another. A query block of 64 rows at D = 128 receives 64 × 128 × 4 bytes = 32 KB from each key
# block: at N = 16k, 256 query blocks from 128 key blocks, that is 1 GiB of reductions for one
# head's backward.
#
# How much time do they take? One way to find out: a kernel with the products kept and the
# reductions left out (its dQ wrong on purpose). At D = 128 on the H200, that kernel ran 1.11–1.18
# times stage 17 over the sweep, and 1.04–1.21 times SDPA's flash backward. FlashAttention-2 makes
# exactly as many reductions (the same sectors reach L2), yet pays less for them.
#
# ## 2 · The idea: a reduction's footprint
#
# A warp's dQ accumulators after `dQ_i += dS K_j` are an `mma.sync` C fragment: for its 16 rows and
# 64 columns, lane l holds rows l / 4 and l / 4 + 8, columns 2 (l % 4) and the one after, in
# each of 8 n-tiles. Stage 17 adds each lane's pair of neighbouring floats with one `float2`
# reduction, into a sum laid out row-major like dQ itself. The 32 lanes of one instruction then
# reach 8 rows, 32 bytes in each: 8 different 128-byte lines. FlashAttention-2 lays its sum out
# in the order of its atomic adds instead, so that one instruction covers consecutive floats.
#
# Stage 18 does the same with its own fragments. The sum is cut into tiles of 16 rows × 64
# columns, one tile for each warp's block, and inside a tile the floats are stored in the order
# the lanes add them: element e of n-tile n of lane l at `((n·(4/V) + e/V)·32 + l)·V + e % V`,
# where V is the floats one reduction adds (2 on `sm_90`, 1 before it). One instruction then
# covers 256 contiguous bytes: two lines.

# %%
display(dq_layout.figure())
display(dq_layout.footprint(D=128))

# %% [markdown]
# The bytes and the sectors are the same; the lines are a quarter as many. That matters twice.
# In the SM, the L1 handles a global instruction one line at a time (a *wavefront* for each line),
# on the same path that serves `ldmatrix` from shared memory, so a reduction over 8 lines holds
# that path for 8 passes. Beyond it, each line travels to L2 as its own request, and the slice of
# L2 that owns the line performs the adds. Per 64 keys and a query block of 64 queries:

# %%
display(dq_layout.counts(D=128))

# %% [markdown]
# Reading the sum back needs the inverse. The pass that converts the fp32 sum to dQ in the
# inputs' dtype now takes a tile a block: it reads the 1024 floats in memory order (coalesced),
# puts each where it belongs in a 16 × 64 tile of shared memory, and writes the rows out. The
# pass before the main kernel, which computes Δ, zeroes the sum as before, now over rows padded
# to a multiple of 64.
#
# One more change spreads the adds. Without the mask, every key block of a head walked the query
# blocks from the first, and the blocks of a head run side by side: all of them added into the
# same tile at about the same moment, and the adds to one line queue up in its L2 slice. Now key
# block kb starts at query block kb · blocks / key blocks and goes round. With the mask each key
# block already starts at its own diagonal:

# %%
display(dq_layout.starts(N=1024).T)

# %% [markdown]
# ## 3 · What changed

# %%
nb.show_diff("17_wide_warps", "18_dq_layout", context=1)

# %% [markdown]
# The products, the masks, the pipeline and the pairs of warps are stage 17's. The reductions in
# `dq_step` now go to `dq_slot` in the tile that holds the warp's block:

# %%
nb.show_source("18_dq_layout", "dq_step")

# %% [markdown]
# ## 4 · Prediction
#
# The diagnostic kernel bounds the gain: without any reductions stage 17 ran 1.11–1.18 times as
# fast at D = 128, more as N grows. The new layout keeps every reduction but cuts the lines they
# take by four, so most of that time should come back, but not all: the sectors and the adds in L2
# are unchanged. At D = 64 a warp's block is the same 16 × 64 and each block reduces the same
# bytes for each product, so the gain should be about the same.
#
# **Prediction.** Stage 18 ≈ 1.1 × stage 17 at both head dims, more at large N: at D = 128 level
# with SDPA's flash backward or ahead of it.

# %% [markdown]
# ## 5 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("18_dq_layout")
    print(ev)

# %%
with nb.unless_missing():
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "18_dq_layout") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        if mine.empty:
            raise nb.not_recorded("18_dq_layout", " backward timings")
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "sdpa_cudnn", "17_wide_warps"), "fp16", causal))

# %% [markdown]
# Over the FlashAttention sweep (fp16, N = 512 to 16k, B·N = 16k), stage 18 over stage 17 and over
# SDPA's flash backward, timed in turn in one run:

# %%
with nb.unless_missing():
    display(nb.sweep_ratio("18_dq_layout", "17_wide_warps", pass_="backward").round(3))
    display(nb.sweep_ratio("18_dq_layout", "sdpa_flash", pass_="backward").round(3))

# %% [markdown]
# ### Discussion
#
# At the teaching config (fp16, B = 4, H = 16, N = 1024, D = 64) on the H200, stage 18 ran at 225
# TFLOP/s without the mask, 1.07 times stage 17 and 1.14 times SDPA's flash backward, and at 133
# TFLOP/s with it, 1.06 times stage 17.
#
# Over the sweep the prediction held at D = 128: 1.11–1.13 times stage 17 with and without the
# mask, growing a little with N as the diagnostic's bound did. That takes the pairs from 0.89–1.09
# times SDPA's flash backward to 1.00–1.18 without the mask and 0.995–1.22 with it: ahead
# everywhere but N = 16k with the mask, where the two are level. At D = 64 the prediction missed:
# 1.05–1.08 times stage 17, not 1.1. The bound came from a kernel without reductions at D = 128
# only, and it assumed the reductions cost the D = 64 kernel the same share of its time. They cost
# it less, for a reason this notebook did not isolate; the profile below, taken at D = 64, shows
# how small a share of the waits global memory had there.
#
# cuDNN's backward, on `wgmma`, stays 1.2–2 times faster than stage 18: the next step is Hopper's
# own instructions, not the reductions.

# %% [markdown]
# ## 6 · The profile

# %%
with nb.unless_missing():
    p = nb.profile("18_dq_layout", pass_="backward")
    display(p.loc[[m for m in ("duration_ms", "red_sectors_per_l2_request", "smem_wavefronts",
                               "tensor_pipe_pct", "stall_lg_throttle", "stall_long_scoreboard",
                               "stall_short_scoreboard", "stall_mio_throttle", "stall_barrier")
                   if m in p.index]])

# %% [markdown]
# ### Discussion
#
# Stage 17's backward, profiled at the same config, made requests of 1.0 sector each: every
# reduction split into 8 one-sector requests, as section 2 counted. Stage 18's requests carry 4.0
# sectors, whole lines. The kernel took 0.163 ms against stage 17's 0.174, with the tensor pipe
# busy 43.5 % of the time against 41.0 %. Its shared-memory traffic is the same (21.0 million
# wavefronts against 21.3): the products did not change, only what the reductions cost around
# them. Stalls on global memory were a small share at this head dim, in both kernels: 8.3 % of
# the samples in long-scoreboard waits (8.9 % in stage 17), 1.9 % in the load/store queue's
# throttle (2.1 %). That is why D = 64 gained less than D = 128.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `18.dq_unslot` (10 points)
#
# **Where:** in `dq_unslot` (`kernels/18_dq_layout.cu`), which the conversion pass calls for
# every float of a tile it reads: between `// BEGIN EXERCISE 18.dq_unslot` and
# `// END EXERCISE 18.dq_unslot`. The stub reads every float as the same accumulator element, so
# dK and dV are right and dQ comes out wrong.
#
# **What to write:** given p, the position of a float in a tile in memory order (0 ≤ p < 1024),
# set n, e and lane to the n-tile, the accumulator element and the lane whose value is stored
# there: the inverse of `dq_slot`, for the build's `DQ_VEC` (2 on `sm_90`, 1 before it). The
# lines after the region turn them into the row and column of the tile.
#
# **How it is judged.** `flashlab grade` builds stage 18 from your region, checks its forward and
# log-sum-exp, then dQ, dK and dV against float64 autograd: N = 1, 17, 1000 and 4096, D = 64 and
# 128, both masks, fp16 and bf16, and a model's strided layout, each gradient filled with NaN
# first. Each must be within twice the error of PyTorch's own backward in the same dtype. A wrong
# kernel scores 0; the message names the first failing gradient and case. A right one is timed in
# its backward: when your instructor grades, in turn with the solution's on the same GPU, full
# points within 5 % of its speed; checking your own work, only rightness counts.
#
# **GPU:** compute capability 8.0 or newer; without one, `flashlab grade` skips it with one line
# saying why. Run it with
#
#     flashlab grade --exercise 18.dq_unslot

# %% [markdown]
# ## Questions for discussion
#
# 1. Any layout of the tile that the reductions and the conversion agree on gives the right dQ.
#    Which property of the layout sets the speed, and what would a layout that put each lane's
#    floats 128 bytes apart cost?
# 2. On `sm_90` the reductions add two floats a lane. The `float4` reduction exists there too and
#    would halve the instructions. What would it change in the lines and the sectors, and why
#    might it not be faster?
# 3. The staggered start spreads a head's key blocks over its query blocks. Why does it change
#    nothing with the causal mask, and what would it do if a head had fewer key blocks than there
#    are places for blocks on the GPU?

# %% [markdown]
# **Instructor's answer.** *1.* The number of distinct 128-byte lines (and 32-byte sectors) one
# warp-wide instruction touches: the L1 takes a pass per line and sends a request per line to L2,
# while the bytes are fixed by the sum. Lanes 128 bytes apart put each lane in its own line: 32
# lines for one instruction, four times stage 17's 8, each request carrying 8 useful bytes of a
# 32-byte sector.

# %% [markdown]
# **Instructor's answer.** *2.* With `float4` the 32 lanes cover 512 contiguous bytes, four whole
# lines: half the instructions, the same sectors and the same lines in all, so the L2 does the
# same work. It also gathers a lane's four floats from two rows of the fragment, which is only
# free because the layout may put them anywhere. On the H200 it ran 1–2 % slower than `float2`
# at D = 128 and about level at D = 64: the instructions were not what cost.

# %% [markdown]
# **Instructor's answer.** *3.* With the mask, key block kb starts at its diagonal, query block
# 2kb, so the blocks of a head already add into different tiles at any moment. Without it, when a
# head's key blocks do not fill the GPU, blocks of several heads run side by side; those of
# different heads add into different sums anyway, so the stagger spreads only the blocks of one
# head, and gains little when there are few of them.

# %% [markdown]
# ## Summary
#
# - A warp-wide global instruction costs a pass in the L1 and a request to L2 for every line it
#   touches, whatever the bytes: stage 17's dQ reductions touched 8 lines for 256 bytes.
# - Keeping dQ's fp32 sum in the order the lanes add into it (tiles of 16 × 64, the C fragment's
#   order inside) makes each reduction two whole lines; the conversion pass undoes the layout.
# - Key blocks that start at different query blocks add into different tiles at a time.
# - On the H200 stage 18 ran 1.11–1.13 times stage 17 at D = 128 and 1.05–1.08 times at D = 64 over
#   the sweep: 1.00–1.22 times SDPA's flash backward at D = 128 (level at N = 16k with the mask)
#   and 1.10–1.32 times at D = 64.

# %%
nb.reached("18_dq_layout")  # its backward, beside the stages before it and SDPA's
