# %% [markdown]
# # Stage 17 — Wide warps
#
# Stage 15 put the backward on tensor cores and reached about 0.86 of SDPA's flash backward. Its
# warps are not short of work: each has plenty to do, and a profile shows them idle two cycles in
# three, each waiting for a shared-memory load or a tensor-core result it needs next. This stage
# changes one thing: a warp owns 32 keys instead of 16. Every fragment of Q and dO it loads then
# feeds twice as many `mma.sync`, and each warp has twice the independent products in flight to
# hide a wait behind.
#
# ## Objectives
# After this notebook you can:
# - tell a latency-bound kernel from a throughput-bound one in a profile, and say what helps each;
# - count what a warp loads per `mma.sync`, and how the keys a block holds set the dQ atomics;
# - budget the registers of a warp's accumulators, and see where 32 keys a warp stop fitting;
# - split a warp's work between two warps through shared memory, and find the race that adds.
#
# **Prerequisites:** notebook 15 (the tensor-core backward); 05 (`mma.sync` fragments).
# Appendix 15a's profiles are background, not required.
#
# **Time:** about 19 min to read, 35 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import wide_warps
from flashlab import notebook as nb
nb.banner("17_wide_warps")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · Where stage 15's time goes
#
# A kernel bound by a pipe keeps that pipe busy: the tensor pipe near 100 %, or shared memory
# serving a wavefront every clock. Stage 15's profile (notebook 15, section 7) shows neither: the
# tensor pipe is busy about a third of the time, and so are the issue slots. In the cycles
# between, every warp on the SM is waiting, mostly for a result it needs next: an `ldmatrix`
# still on its way from shared memory, or an `mma.sync` whose accumulator feeds the next one.
# That is a latency-bound kernel. Issuing fewer instructions does not help it much (appendix 15a
# removed a fifth of them and gained nothing); what helps is giving each warp more independent
# work between the waits, so that one wait hides behind other useful work.
#
# ## 2 · The idea: 32 keys a warp
#
# In stage 15 warp w owns keys 16w.. of a 64-key block. For Sᵀ = K_w Q_iᵀ it loads a fragment of
# Q_i and uses it twice, once for S and once for dP with dO. Give the warp two m-tiles of 16 keys
# and the same fragment feeds four `mma.sync`: the loads per product fall, and the two m-tiles
# are independent chains the scheduler can interleave. The block now holds 128 keys (four warps
# of 32), so each dQ element is added once per 128 keys instead of once per 64: half the atomics.
#
# The price is registers. A warp's dK and dV are accumulators of its keys by the head dim; twice
# the keys is twice the floats a lane:

# %%
display(wide_warps.figure())
display(wide_warps.registers(D=64))
display(wide_warps.registers(D=128))

# %% [markdown]
# At D = 64, 192 accumulator floats a lane fit under the ceiling of 255 registers with the
# addresses and fragments beside them, once Sᵀ and dPᵀ are taken 32 queries at a time instead of
# 64. At D = 128, one warp would need 320: it cannot. So at D = 128 a *pair* of warps shares 32
# keys. Warp h of the pair computes Sᵀ and dPᵀ for half the query block (queries 32h..), and then
# dV and dK for half the head-dim columns (64h..) over the whole query block. Between the two
# halves each warp needs the other's P and dS: they go through shared memory, Pᵀ in a new tile
# beside the dSᵀ that dQ already read from there, with a barrier between writing and reading.
#
# What the loops issue, per 64 keys and a query block of 64, for the same products:

# %%
display(wide_warps.counts(D=64))
display(wide_warps.counts(D=128))

# %% [markdown]
# A quarter fewer `ldmatrix` per `mma.sync` at both head dims, and half the dQ reductions. At
# D = 128 the pairs pay for it with twice the stores to shared memory (Pᵀ beside dSᵀ) and a
# second barrier that stage 15's warps did not need between these products.
#
# One more constraint is the A100's. Built for `sm_80`, the D = 64 kernel with 32 keys a warp
# spills 32 bytes of registers to local memory, so the file keeps 16 keys a warp when any
# architecture it is compiled for is older than `sm_90`: an A100 runs stage 15's shape at D = 64,
# and the pairs at D = 128.
#
# ## 3 · What changed

# %%
nb.show_diff("15_backward_mma", "17_wide_warps", context=1)

# %% [markdown]
# Stage 15's loops, with an m-tile index `m` in each. The products of Sᵀ and dPᵀ moved into a
# function that both kernels call; one Q_i or dO_i fragment is loaded, then used by every m-tile:

# %%
nb.show_source("17_wide_warps", "scores_t")

# %% [markdown]
# The pairs kernel at D = 128. Its loop over query blocks begins differently from stage 15's:
# stage 15 started copying the next query block into the other buffer *before* the barrier at
# the top, because every read of that buffer had ended before the previous barrier. In the
# pairs kernel dV and dK read Q_i and dO_i *after* the second barrier, so a warp that raced
# ahead would overwrite tiles another warp is still reading. It waits for this block's copies,
# meets the others at the barrier, and only then issues the next block's:

# %%
nb.show_lines("17_wide_warps", r"// dV and dK read Q_i and dO_i after the second barrier",
              r"^    \}$")

# %% [markdown]
# Every gradient check passed on the first version, which issued the copies first as stage 15
# did. `compute-sanitizer --tool racecheck` found 16 hazards in it. A race that loses only when
# one warp runs a whole block ahead of another may never show in a check, and that is why the
# backward runs under racecheck.
#
# ## 4 · Prediction
#
# The kernel is latency-bound, so there is no pipe whose rate sets a bound. Instead, the
# instructions that feed the tensor pipe fall: `ldmatrix` by about a quarter and dQ reductions by
# half per 64 keys. If the time follows them, and the tensor pipe stays as busy per instruction
# issued, stage 17 should run at about 1.3× stage 15 at D = 64. At D = 128 the second barrier and
# the round trip of Pᵀ through shared memory give some of that back: about 1.15×.
#
# **Prediction.** Stage 17 ≈ 1.3 × stage 15 at D = 64 and ≈ 1.15 × at D = 128: at D = 64 faster
# than SDPA's flash backward (stage 15 was at 0.86 of it), at D = 128 about level with it.

# %% [markdown]
# ## 5 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("17_wide_warps")
    print(ev)

# %%
with nb.unless_missing():
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "17_wide_warps") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        if mine.empty:
            raise nb.not_recorded("17_wide_warps", " backward timings")
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "sdpa_cudnn", "15_backward_mma"), "fp16", causal))

# %% [markdown]
# ### Discussion
#
# At this config (fp16, B = 4, H = 16, N = 1024, D = 64) on the H200, stage 17 ran at 212 TFLOP/s
# without the mask: 1.25 times stage 15, as predicted, and 1.07 times SDPA's flash backward. With
# the mask it gained almost nothing, 1.01 times stage 15 (125 TFLOP/s). A causal head at N = 1024
# has 8 key blocks of 128 here, walking 16, 14, …, 2 query blocks, against stage 15's 16 blocks of
# 64 walking 16, 15, …, 1. The 512 blocks of this launch fill the 264 places on the SMs about
# twice, and the last wave waits on a few long blocks; larger blocks make that tail coarser, and
# each block's first two query blocks now cross the diagonal, half their products masked away.
# Larger problems have many waves and the tail matters less.
#
# Over the FlashAttention sweep (fp16, N = 512 to 16k, B·N = 16k, timed in turn in one run with
# stage 15, stage 16 and SDPA's backwards), stage 17 ran 1.24–1.42 times stage 15 at D = 64 without
# the mask and 1.09–1.33 with it: 203–293 TFLOP/s, ahead of SDPA's flash backward at every D = 64
# config, 1.03–1.19 times without the mask and 1.04–1.24 with it. At D = 128 the pairs ran 1.13–1.23
# times stage 15 without the mask and 1.03–1.21 with it, close to the predicted 1.15, but only
# 0.88–1.09 times SDPA's flash backward: ahead at N = 512, level at 1k, 6–12 % behind from 2k.
# cuDNN's backward, built on `wgmma` (notebook 09), stays 1.3–2.1 times faster than stage 17.
#
# The prediction held because the kernel was latency-bound: the instructions that feed the tensor
# pipe fell, and the waits between them with them. At D = 128 the pairs spend part of the gain on
# what they added: the Pᵀ stores, the second barrier, and copies that no longer start before it.

# %% [markdown]
# ## 6 · The profile

# %%
with nb.unless_missing():
    p = nb.profile("17_wide_warps", pass_="backward")
    display(p.loc[[m for m in ("duration_ms", "smem_wavefronts", "tensor_pipe_pct",
                               "achieved_occupancy_pct", "stall_barrier", "stall_long_scoreboard",
                               "stall_short_scoreboard", "stall_mio_throttle", "stall_wait",
                               "stall_math_pipe_throttle") if m in p.index]])

# %% [markdown]
# ### Discussion
#
# Set beside stage 15's profile at the same config (notebook 15, section 7), the kernel takes
# 0.173 ms where stage 15's took 0.224, with the tensor pipe busy 41 % of the time instead of
# 32 %. Shared memory served 21.4 million wavefronts against 28.1 million, 0.76 times as many,
# near section 2's count of `ldmatrix` (0.74 times as many per 64 keys). The warps still wait most
# of their time, but less on their own loads and products: short-scoreboard stalls (a shared-memory
# result not yet back) fell from 21 % to 17 % of the samples and long-scoreboard stalls (global
# memory, among them the dQ atomics) from 14 % to 9 %. The kernel is still latency-bound, with more
# useful work between the waits.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `17.pair_operands` (10 points)
#
# **Where:** in `bwd_pairs` (`kernels/17_wide_warps.cu`), after the barrier that completes the Pᵀ
# and dSᵀ tiles: between `// BEGIN EXERCISE 17.pair_operands` and
# `// END EXERCISE 17.pair_operands`. The stub reads every fragment from the tiles' first row, so
# dK and dV are wrong at D = 128 while dQ stays right.
#
# **What to write:** for m-tile `m` and k-step `j`, `pa[m]` and `sa[m]`: the A fragments of Pᵀ and
# dSᵀ for the pair's keys `kw + 16m..` (the fragment's 16 rows) and the queries `16j..` (its 16
# columns), read with one `ldmatrix.x4` each from the tiles the two warps of the pair wrote (a key
# per row, BR queries a row, swizzled: element (key, query) at `swz<BR>(key, query)`). Work out
# which 8 × 8 matrix each group of 8 lanes addresses from notebook 05's fragment layouts: the
# four matrices must arrive as a0, a1, a2, a3 of the `mma_m16n8k16` calls below.
#
# **How it is judged.** `flashlab grade` builds stage 17 from your region, checks its forward and
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
#     flashlab grade --exercise 17.pair_operands

# %% [markdown]
# ## Questions for discussion
#
# 1. Why does 32 keys a warp halve the dQ atomics, while 32 keys a *pair* of warps (D = 128)
#    halves them too? What sets the number of dQ additions per element?
# 2. The pairs kernel waits for the copies of block i before it issues those of block i + 1, so
#    less of the copying overlaps computing. With three buffers instead of two, could it issue
#    before the barrier again? What would the third buffer cost at D = 128?
# 3. On an A100 the D = 64 kernel keeps 16 keys a warp, because 32 would spill 32 bytes. Why can
#    a spill of 32 bytes cost more than 32 keys a warp gains?

# %% [markdown]
# **Instructor's answer.** *1.* Each key block adds its share of a dQ row once, so a head's dQ
# element is added N / BC times: BC, the keys a *block* holds, sets it, not the keys a warp
# holds. Both of stage 17's kernels hold 128 keys a block (4 warps × 32, or 4 pairs × 32),
# against stage 15's 64.

# %% [markdown]
# **Instructor's answer.** *2.* Yes: with three buffers, block i + 1's copies go to a buffer
# that blocks i − 1 and i no longer read once every warp is past the barrier of block i, so they
# can be issued before it, as stage 15 did. At D = 128 a buffer of Q_i and dO_i is 2 × 64 × 128 ×
# 2 bytes = 32 KB, and the kernel already uses about 161 KB: 193 KB still fits one block an SM
# on the H100 (227 KB), but leaves no room to grow the tiles.

# %% [markdown]
# **Instructor's answer.** *3.* A spilled register is stored to local memory and loaded back,
# and local memory is cached global memory: a load from it waits hundreds of cycles when it
# misses L1, against about 30 for shared memory. In a latency-bound loop that load sits on the
# path to the next `mma.sync`, every iteration, in every warp; 32 bytes a lane is eight such
# values, reloaded each time the loop needs them.

# %% [markdown]
# ## Summary
#
# - Stage 15's backward is latency-bound: its warps wait, mostly for their own loads and
#   products, and fewer instructions alone do not help.
# - Giving a warp 32 keys instead of 16 makes each loaded Q and dO fragment feed four
#   `mma.sync` instead of two, gives the warp independent products to interleave, and, with 128
#   keys a block, halves the dQ atomics.
# - The registers set the limit: at D = 128 a pair of warps shares 32 keys, each taking half
#   the queries for S and dP and half the columns for dK and dV, with P and dS passed through
#   shared memory. That adds a barrier, and a race that only racecheck found.
# - On the H200 stage 17 ran 1.24–1.42 times stage 15 at D = 64 (without the mask) and 1.13–1.23
#   times at D = 128: ahead of SDPA's flash backward at every D = 64 config of the sweep, and
#   0.88–1.09 times it at D = 128.

# %%
nb.reached("17_wide_warps")  # its backward, beside the stages before it and SDPA's
