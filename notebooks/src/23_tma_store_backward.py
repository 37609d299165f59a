# %% [markdown]
# # Stage 23 — dK and dV written by the TMA
#
# A block of stage 22's backward ends as stage 11's forward did: every consumer thread stores its
# share of dK_j and dV_j from registers, 4 bytes at a time, and the block cannot exit until the
# stores have left. One block fits on an SM, so the next one waits. This stage ends the block as
# stage 12 ends a work item: the tiles go to shared memory, and the TMA writes them out.
#
# ## Objectives
# After this notebook you can:
# - split a kernel's time into a fixed cost per block and a cost per query block;
# - say why a block's end delays the next block on its SM, and which stall shows it;
# - reuse a ring of buffers for a block's output, and wait for a TMA store only until it has
#   read shared memory;
# - predict a gain that is a fixed amount per block, and how it shrinks with N.
#
# **Prerequisites:** notebook 22 (the overlapped backward); notebook 12 (the TMA store of O);
# notebook 20 (the producer and the ring of Q_i and dO_i).
#
# **Time:** about 18 min to read, 25 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import tma_store_backward
from flashlab import notebook as nb
nb.banner("23_tma_store_backward")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · Where the time goes
#
# At N = 512, D = 128 (B = 32, H = 16, fp16) on the H200, stage 22's whole backward took 0.543 ms
# against cuDNN's 0.505. Its main kernel took 415 µs; the rest is the Δ pre-pass and the dQ
# conversion.
#
# A block owns 128 keys: the grid has B H N / 128 = 2048 blocks at every N of the sweep
# (B · N = 16k), and each walks N / 64 query blocks. At N = 1024 the main kernel took 684 µs:
# 8 more query blocks, about 34 µs each. The line through the two points meets zero query blocks
# at about 145 µs, a cost every block pays once. An SM runs 15.5 blocks one after another: about
# 9 µs a block, four query blocks' worth of work.
#
# Two modified copies of stage 22, used only for timing, take it apart: one whose blocks walk no
# query block, one that skips the stores of dK and dV
# (`data/runs/backward-22-short-diag-h200-20261201T0349Z.log`). Blocks that walk no query block
# took 133 µs. Blocks that skip the stores of dK and dV took 330 µs against 415: the stores cost
# 84 µs, 5.4 µs a block (72–84 µs at every N at D = 128, about 120 at N = 512, D = 64). One
# block's life:

# %%
tma_store_backward.block_life(N=512)

# %% [markdown]
# Why so much? A block (384 threads, about 200 KiB of shared memory) runs alone on its SM, and the
# next starts only when all its warps have exited. A warp cannot exit while its stores are still
# leaving: the stall called *drain*. The stores, counted as notebook 12 counted O's:

# %%
tma_store_backward.stores()

# %% [markdown]
# A warp instruction writes 16 bytes in each of 8 rows: 8 sectors, half filled. A block at
# D = 128 issues 512 of them.
#
# ## 2 · The idea: the block's end through shared memory
#
# Stage 12 wrote O into shared memory in the TMA's 128-byte swizzle and had one thread hand it to
# the TMA. Here the two tiles dK_j and dV_j, 128 keys × D each, go the same way:

# %%
display(tma_store_backward.figure())

# %% [markdown]
# (Stage 22 as measured; stage 23 as section 4 predicts it.) After the last query block the ring
# of Q_i and dO_i (64 KiB) is loaded no more, and it holds both tiles (64 KiB at D = 128, 32 at
# D = 64). The steps, as in stage 12:
#
# 1. a named barrier of the 256 consumer threads: the other consumer's last products may still
#    read Q_i and dO_i;
# 2. each thread writes its 64 four-byte pieces (D = 128) where `sw128` puts them: a warp's 8
#    rows in 8 different 16-byte chunks, one wavefront a store;
# 3. `fence.proxy.async`, so that the TMA (the async proxy) sees those writes;
# 4. a second named barrier: both tiles are whole;
# 5. one thread has the TMA write the tiles, and waits only until the TMA has *read* shared
#    memory: once this block's threads exit, the SM gives its shared memory to the next block.
#    The global writes finish as the next block starts.
#
# The bits do not change: the same values, rounded the same way.
#
# ## 3 · What changed

# %%
nb.show_diff("22_overlap_backward", "23_tma_store_backward", context=1)

# %% [markdown]
# `store_dk_dv` is gone; two tensor maps, of dK and dV, are made from their strides (a model's
# strided gradients need no copy); the block's end is the five steps above.
#
# ## 4 · Prediction
#
# At most the 84 µs the stores cost (N = 512, D = 128). Two things keep some of it:
#
# - the new end: 512 shared-memory stores, two barriers, the TMA's read of 64 KiB: 10–15 µs over
#   the grid;
# - the bytes still go to memory: 128 MiB, about 30 µs at notebook 00's 4.2 TB/s, now beside the
#   next block's loads, which they may slow.
#
# So 84 µs less 10–15 for the new end and some of the 30 for the bytes: about 45–70 µs saved,
# the same at every N (the same blocks). Over stage 22's whole backward:

# %%
tma_store_backward.predicted().round(3)

# %% [markdown]
# **Prediction.** Stage 23 over stage 22: 1.09–1.15 at N = 512, D = 128, 1.06–1.09 at 1k,
# 1.02–1.03 at 4k, nothing measurable from 8k; the same shape under the mask; at D = 64, where the
# stores cost 120 µs, at least as much. The backward kernel's machine code: no `STG`, a
# `UTMASTG`. Its profile: no global stores, and no drain stall.
#
# ## 5 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("23_tma_store_backward")
    print(ev)

# %%
with nb.unless_missing():
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "23_tma_store_backward") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        if mine.empty:
            raise nb.not_recorded("23_tma_store_backward", " backward timings")
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "sdpa_cudnn", "22_overlap_backward"), "fp16", causal))

# %% [markdown]
# Over the FlashAttention sweep (N = 512 to 16k, B·N = 16k), stage 23 over stage 22 and over
# SDPA's cuDNN backward, timed in turn in one run, fp16 first, then bf16 (against cuDNN's bf16
# backward):

# %%
with nb.unless_missing():
    display(nb.sweep_ratio("23_tma_store_backward", "22_overlap_backward", pass_="backward").round(3))
    for dtype in ("fp16", "bf16"):
        print(f"stage 23 over cuDNN's backward, {dtype}:")
        display(nb.sweep_ratio("23_tma_store_backward", "sdpa_cudnn", dtype, pass_="backward").round(3))

# %% [markdown]
# ### Discussion
#
# The sweep above was timed in turn with stages 18 and 22 and both SDPA backwards on the H200
# (`data/runs/backward-18-22-23-fp16-h200-20261201T0708Z.log`, and `…-bf16-…` for bf16; every
# gradient check passed in both dtypes, and the bits are stage 22's). At the teaching config
# (D = 64, N = 1024) it ran 1.06 times stage 22 with and without the mask. At D = 128 the
# prediction held: 1.12 at N = 512, about 57 µs of stage 22's 541, inside the band; 1.06 at 1k,
# 1.02 at 4k and nothing from 8k, a gain falling as 1/N, a little slower under the mask, where
# blocks walk fewer query blocks. At D = 64
# it missed: 1.09 at N = 512, the low edge of the band, though section 1 put the stores there at
# 120 µs. That number came from profiled kernel times, and stage 22's D = 64 kernel measured
# 501 µs in one profiled run and 571–582 in others: a weak basis for a prediction. The in-turn
# timing is the one to trust. The 0.99 at 16k, where the end does not matter, is run-to-run
# noise: an earlier run (`backward-22-short-diag-h200-20261201T0352Z.log`) put the same pair at
# 1.001.
#
# The machine code holds what was predicted: the backward kernel has `UTMASTG`s (four at
# D = 128, two at D = 64) and no `STG` (`flashlab sass 23`, which needs no GPU).
#
# Against cuDNN's backward: 1.003–1.108 over the whole fp16 sweep and 1.003–1.110 in bf16. Stage
# 22 was 0.93–0.99 below 8k at D = 128; stage 23 is above 1.0 at every length, though only level
# (1.003–1.010) from 2k to 4k at D = 128 without the mask. There the walk, not the block's end,
# sets the time, and cuDNN's walk is as fast as this one.
#
# About 85 µs of the fixed cost remain: the blocks' starts (launch, set-up, K_j and V_j in, some
# 60 µs of the grid) and what is left of their ends. That is the next target. A persistent grid,
# a block on each SM walking key block after key block, can load the next K_j and V_j while the
# TMA writes this dK_j and dV_j, as FlashAttention-3's backward does. The TMA store makes that
# possible.

# %% [markdown]
# ## 6 · The profile

# %%
with nb.unless_missing():
    p22 = nb.profile("22_overlap_backward", pass_="backward")
    p23 = nb.profile("23_tma_store_backward", pass_="backward", missing_ok=True)  # on a GPU without a profile of 23: stage 22 alone
    both = p22.iloc[:, [-1]] if p23.empty else p22.iloc[:, [-1]].join(p23.iloc[:, [-1]])
    display(both.loc[[m for m in ("duration_ms", "global_store_sectors_per_request", "stall_drain",
                                  "stall_lg_throttle", "stall_barrier", "stall_long_scoreboard",
                                  "tensor_pipe_pct", "sm_throughput_pct")
                      if m in both.index]])

# %% [markdown]
# ### Discussion
#
# The profile is of the teaching config (B = 4, H = 16, N = 1024, D = 64): 512 blocks, about four
# an SM. Stage 22's shows its stores: 8 sectors per store request, the half-filled sectors of
# section 1, warps stalled on *drain* 2.8 % of their active time and on *LG throttle* (the queue
# to global memory full) 5.9 %. In stage 23 no store request is left (0 sectors), *drain* fell to
# 0.1 % and *LG throttle* to 0, as predicted. What the blocks gained went to the tensor pipe, busy
# 44.9 % of the time against 41.5; the barrier and long-scoreboard stalls rose a little, since the
# walk is now a larger share of a shorter kernel.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `23.dkdv_boxes` (10 points)
#
# **Where:** in `bwd_kernel` (`kernels/23_tma_store_backward.cu`), at the consumers' end,
# between `// BEGIN EXERCISE 23.dkdv_boxes` and `// END EXERCISE 23.dkdv_boxes`. The first
# consumer thread runs it once both tiles are whole at `dKs` and `dVs`. The stub writes nothing:
# dK and dV keep what they held, dQ is right.
#
# **What to write:** have the TMA write the two tiles as this block's rows of dK and dV. Each
# tile lies in D / 64 boxes of 64 columns, as the loop above wrote them, and goes out through its
# gradient's tensor map, `maps.dk` or `maps.dv`, whose dimensions 1–3 hold rows, heads and
# batches in the order `maps.odk` or `maps.odv` says. Then close the bulk group, and wait until
# the TMA has read shared memory. Notebook 12's store of O is the model.
#
# **How it is judged.** As in notebook 22: `flashlab grade` builds stage 23 from your region and
# checks dQ, dK and dV against float64 autograd (N = 1 to 4096, both head dims, masks and dtypes,
# a model's strided layout, each gradient filled with NaN first), within twice the error of
# PyTorch's own backward. Then the machine code: the backward kernel must hold the TMA's store
# (`UTMASTG`); a right kernel that writes the tiles another way scores 0, and says why. Your
# `22.two_groups`, carried into this kernel, is judged with it, its waits too. Your
# instructor times a right kernel in turn with the solution's: full points within 5 % of its
# speed. Checking your own work, only rightness counts.
#
# **GPU:** compute capability 9.0 exactly (an H100 or H200); without one, `flashlab grade` skips
# it with one line saying why. Run it with
#
#     flashlab grade --exercise 23.dkdv_boxes

# %% [markdown]
# ## Questions for discussion
#
# 1. Take away the first named barrier. What can go wrong, and why would a check on one GPU
#    often not see it?
# 2. In stage 23's profile, which metrics should not move, and what would it mean if the tensor
#    pipe's share fell?
# 3. From `tma_store_backward.block_life(saved_us="measured")`, bound what a persistent grid
#    could gain at N = 512, D = 128 if it hid every block's start and end under work. What could
#    it not hide?

# %% [markdown]
# **Instructor's answer.** *1.* The first consumer to finish would write over Q_i and dO_i while
# the other's last dK += dS^T Q_i and dV += P^T dO_i may still read them: that warpgroup's dK and
# dV go wrong, but only when the two drift apart by more than those products, which depends on
# timing. One run on one GPU can easily pass.

# %% [markdown]
# **Instructor's answer.** *2.* The walk is unchanged: the tensor pipe's busy cycles should stay,
# and the shared-memory wavefronts grow only by the end's stores, a small part of the loop's. The
# barrier stall may rise a little (a consumer now waits for the other at the end). The tensor
# pipe's share of a shorter kernel should rise; if it fell, something in the loop changed
# (registers, code placement): look in the machine code.

# %% [markdown]
# **Instructor's answer.** *3.* A stage 23 block lives about 22.9 µs: 3.9 start, 17.4 walk, 1.6
# end. Hiding both gives at most 22.9 / 17.4 ≈ 1.3 in the main kernel, less over the whole
# backward. Each SM still loads its first K_j and V_j and sets itself up, and the copies share
# the memory system with the walk.

# %% [markdown]
# ## Summary
#
# - A kernel's time against the query blocks per block is a line; its intercept is each block's
#   fixed cost: in stage 22 about 9 µs, 5.4 of them the stores of dK and dV.
# - With one block an SM, a block's end delays the next; a warp exits only once its stores have
#   left (drain).
# - Stage 23 puts dK_j and dV_j in the free ring of Q_i and dO_i and has the TMA write them,
#   waiting only for its read. Same bits.
# - On the H200: 1.12 times stage 22 at N = 512, D = 128, falling as 1/N, as predicted, and at
#   or above cuDNN's backward over the whole fp16 sweep. Most of the blocks' fixed cost, their
#   starts, remains.

# %%
nb.reached("23_tma_store_backward")  # its backward, beside the stages before it and SDPA's
