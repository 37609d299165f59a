# %% [markdown]
# # Stage 19 — wgmma backward
#
# Stage 18 brought the backward level with or ahead of SDPA's flash backward (FlashAttention-2)
# on every config of the sweep, and there it stopped: cuDNN's backward still ran 1.2 to 2 times
# faster. Both of those run the same algorithm. What cuDNN has that stage 18 lacks is the
# instruction Hopper built for matrix products, `wgmma`, which notebook 09 brought to the
# forward. This stage changes one thing: every one of the backward's five products moves from
# per-warp `mma.sync` to warpgroup `wgmma`.
#
# ## Objectives
# After this notebook you can:
# - write each of the backward's five products as `wgmma`, choosing for each operand whether it
#   comes from registers or shared memory and whether it is read as stored or transposed;
# - count the tensor-core instructions a block issues for the same multiply-adds with `mma.sync`
#   and with `wgmma`, and say what that count does and does not predict;
# - budget a warpgroup's accumulator registers and size the query block from that budget;
# - read in a profile whether the tensor cores, not the instruction issue, now set the pace.
#
# **Prerequisites:** notebook 09 (`wgmma`, descriptors, the 128-byte swizzle); notebooks 14, 15
# and 18 (the backward, its fragments, dQ's tiled sum).
#
# **Time:** about 19 min to read, 35 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import wgmma_backward
from flashlab import notebook as nb
nb.banner("19_wgmma_backward")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · What `mma.sync` costs the backward
#
# A backward block of stage 18 owns 128 keys and, for each query block, computes five products:
# S^T = K Q^T and dP^T = V dO^T (to recompute P and form dS), dV += P^T dO, dK += dS^T Q, and
# dQ += dS K. Each is made of `mma.sync.m16n8k16`: one warp, 16 × 8 × 16 multiply-adds, its A
# and B fragments first loaded into registers by `ldmatrix`. Notebook 15's appendix found stage 15
# latency-bound at a third of its issue slots: a warp issues an `ldmatrix`, waits for it, issues
# its `mma.sync`, and the same is true of SDPA's flash backward. More warps in flight (stage 17)
# and cheaper reductions (stage 18) took it to FlashAttention-2's speed, not past it.
#
# ## 2 · The idea: five products as `wgmma`
#
# `wgmma.mma_async` is issued by a warpgroup, four warps together, and multiplies 64 × N × 16 at a
# time (N up to 256). It reads B, and A too if asked, straight from shared memory through a
# descriptor that names the tile's address, its swizzle and the strides between its 8-row groups
# and its 64-column blocks; no `ldmatrix`. It runs asynchronously until `wgmma.wait_group`.
# In the forward (notebook 09) the two products were easy: S = Q K^T reads both tiles as stored,
# and P V takes P from the registers that hold S, packed to 16 bits.
#
# The backward has five, and they need more care, because the same tiles are read in two
# orientations. Give a block two warpgroups and let warpgroup w own keys 64w to 64w + 63: keys
# are then the 64 rows (M) of every product that has keys for rows, which is four of the five:
#
# - S^T = K_w Q_i^T and dP^T = V_w dO_i^T read both operands as stored: the head dim, their
#   reduction, is contiguous in K, Q, V and dO alike ("K-major").
# - dV += P^T dO_i and dK += dS^T Q_i take A from registers: the accumulator of S^T, turned into
#   P^T and packed, has the layout of an A fragment, as the forward's P had. Their reduction is
#   over queries, so B (dO_i, Q_i) is read *transposed* ("MN-major"), as the forward read V.
# - dQ_i += dS K_j has queries for rows. Both warpgroups write their rows of dS^T into one shared
#   tile, and each warpgroup reads dS out of it transposed as A, and K_j transposed as B.

# %%
display(wgmma_backward.figure(D=128))
display(wgmma_backward.products(D=128)[["M x N x K", "A from", "B from", "wgmma"]])

# %% [markdown]
# How big may a query block be? A warpgroup's thread holds N / 2 floats of each 64 × N
# accumulator. At D = 128, S^T and dP^T for BR queries and dK and dV for 128 columns cost
# BR + 128 floats a thread; at BR = 128 that is all 256 registers, before a single address, so
# BR = 64 there. At D = 64 the same sum is BR + 64, and BR = 128 fits. dQ is split to suit: at
# D = 128 each warpgroup takes 64 of dQ's columns for all 64 query rows, at D = 64 64 of the
# query rows and all 64 columns, both a 64 × 64 product over the block's 128 keys, reduced into
# stage 18's tiled fp32 sum.
#
# Counted at the level of the tensor cores, the change is large. For one block and one query
# block, the five products are the same multiply-adds either way:

# %%
display(wgmma_backward.instructions())

# %% [markdown]
# In the machine code (static counts, fp16; stage 18's kernel at D = 128 is its pairs of warps,
# at D = 64 its warps of 32 keys):

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("18_dq_layout", "19_wgmma_backward")
    bwd = mix[mix.index.get_level_values("kernel").str.startswith("bwd_kernel<__half")]
    display(bwd.droplevel("stage").T.loc[["HMMA", "LDSM", "HGMMA", "RED", "MUFU.EX2", "total"]])

# %% [markdown]
# Forty times fewer tensor-core instructions, and no `ldmatrix` at all, for the same arithmetic.
# That count does not say how fast the kernel will be: the tensor cores take as long for the
# multiply-adds whichever instruction asked for them. It says that issuing them, and loading their
# operands into registers, stops being the work.
#
# ## 3 · What changed

# %%
nb.show_diff("18_dq_layout", "19_wgmma_backward", context=1)

# %% [markdown]
# The long removal at the top is stage 08's forward, which stages 14 to 18 carry: the forward is
# now stage 13's Hopper kernel, its file included whole, so that a model trained through this
# stage saves the log-sum-exp with the fastest forward. The Δ pass, the masks and arithmetic of P
# and dS, the staggered start and dQ's tiled sum are stage 18's; so is everything but how dO and
# the gradients are addressed (their rows as far apart as the model's tensors lay them, which
# saves a model two permuting copies). The block is new: two warpgroups, the tiles in the 128-byte swizzle
# that `wgmma`'s descriptors name (notebook 09's `sw128`), and the products one after another,
# each a short loop of `wgmma` over its k-steps. Between dK's products and dQ's, both warpgroups
# write their rows of dS^T and meet at a named barrier, since each reads the other's rows.
#
# ## 4 · Prediction
#
# Notebook 09's model: split stage 18's backward time into the share `f` in which the tensor pipe
# is busy and the rest. `wgmma` does r = 1.5 times `mma.sync`'s work per busy cycle; if nothing
# else changes, the speedup is 1 / ((1 − f) + f / r).

# %%
f = 0.435  # stage 18's backward: tensor pipe busy at the teaching config, if not recorded here
with nb.unless_missing():
    p18 = nb.profile("18_dq_layout", pass_="backward")
    f = float(p18.loc["tensor_pipe_pct"].iloc[-1]) / 100
r = 1.5
print(f"f = {f:.3f}, r = {r} -> predicted {1 / ((1 - f) + f / r):.2f}x stage 18 at the teaching "
      "config (D = 64)")

# %% [markdown]
# The model keeps "the rest" fixed, and here the rest is not fixed: the `ldmatrix` that fed every
# `mma.sync` are gone, and with them most of the instructions a warp issued. Stage 18 was
# latency-bound on exactly those. So the model's number is a floor, not an estimate. cuDNN's
# backward, on `wgmma` too, ran 1.2–2 times stage 18 in notebook 18; stage 19 has its instruction
# but none of its overlap (each product here waits for the one before it, and the exponentials of
# P and the reductions of dQ run while the tensor cores wait).
#
# **Prediction.** Stage 19 faster than the model's number above at the teaching config (D = 64),
# more at D = 128, where the products are a larger share of the time; still below cuDNN's
# backward.

# %% [markdown]
# ## 5 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("19_wgmma_backward")
    print(ev)

# %%
with nb.unless_missing():
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "19_wgmma_backward") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        if mine.empty:
            raise nb.not_recorded("19_wgmma_backward", " backward timings")
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "sdpa_cudnn", "18_dq_layout"), "fp16", causal))

# %% [markdown]
# Over the FlashAttention sweep (fp16, N = 512 to 16k, B·N = 16k), stage 19 over stage 18 and over
# SDPA's cuDNN backward, timed in turn in one run:

# %%
with nb.unless_missing():
    display(nb.sweep_ratio("19_wgmma_backward", "18_dq_layout", pass_="backward").round(3))
    display(nb.sweep_ratio("19_wgmma_backward", "sdpa_cudnn", pass_="backward").round(3))

# %% [markdown]
# ### Discussion
#
# At the teaching config (fp16, B = 4, H = 16, N = 1024, D = 64) on the H200, stage 19's backward
# ran at 272 TFLOP/s without the mask, 1.21 times stage 18 and 1.39 times SDPA's flash backward,
# and at 174 TFLOP/s with it, 1.31 times stage 18. The prediction held, narrowly: the model's
# floor was 1.17.
#
# Over the sweep the gain grows with N and with the head dim, as predicted: 1.12–1.40 times stage
# 18 at D = 64 and 1.25–1.59 at D = 128. It is smallest at N = 512, where each key block walks
# only a few query blocks, so its start (K and V loaded, the accumulators zeroed) and its end (dK
# and dV stored) weigh the most. Against SDPA's flash backward that is 1.48–1.60 times at every
# config. cuDNN's backward, on the same instruction, stays ahead: stage 19 reaches 0.86–0.94 of it
# at D = 64 and 0.80–0.84 at D = 128. The model says why the gain is bounded. It kept everything
# but the products' busy time fixed, and stage 19 still takes its exponentials, meets at its
# barriers and adds its dQ reductions while the tensor cores wait. The profile shows where.

# %% [markdown]
# ## 6 · The profile

# %%
with nb.unless_missing():
    p = nb.profile("19_wgmma_backward", pass_="backward")
    p[p18.columns[-1]] = p18.iloc[:, -1]  # stage 18's backward, profiled above
    display(p.loc[[m for m in ("duration_ms", "tensor_pipe_pct", "sm_throughput_pct",
                               "smem_wavefronts", "red_sectors_per_l2_request",
                               "stall_long_scoreboard", "stall_short_scoreboard",
                               "stall_mio_throttle", "stall_barrier", "stall_wait")
                   if m in p.index]])

# %% [markdown]
# ### Discussion
#
# At the teaching config the backward kernel took 0.129 ms against stage 18's 0.163. The tensor
# pipe was busy a smaller share of that shorter time, 37.4 % against 43.5 %, each busy cycle
# doing more: the instruction's whole effect, as notebook 09 found in the forward. Shared-memory
# wavefronts halved (11.0 against 21.0 million): `wgmma` reads its operands itself, and none of
# them pass through `ldmatrix` into registers.
#
# The stalls moved. Stage 18's warps waited most on `wait` (28 % of the samples: fixed latencies
# between dependent instructions, its chains of `mma.sync`) and on the short scoreboard (17.6 %:
# `ldmatrix` results). Both fell, to 17.4 % and 5.2 %. Stage 19's grew at the barrier (14.0 %
# against 5.6 %: the two warpgroups meet twice a query block, and the one that finishes first
# waits), on the long scoreboard (12.8 % against 8.5 %: the log-sum-exps, the Δs and the tiles
# from global memory), and in the memory-input queue (8.0 % against 3.5 %: the dS^T stores and
# the reductions). That is the overlap cuDNN has and stage 19 lacks: while a warpgroup takes its
# exponentials or waits at a barrier, its tensor cores have nothing to do.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `19.dq_descriptors` (10 points)
#
# **Where:** in `bwd_kernel` (`kernels/19_wgmma_backward.cu`), inside the loop over the k-steps
# of dQ_i += dS K_j: between `// BEGIN EXERCISE 19.dq_descriptors` and
# `// END EXERCISE 19.dq_descriptors`. The stub reads the same 16 keys at every k-step, so dK and
# dV are right and dQ comes out wrong.
#
# **What to write:** the two descriptors `a` and `b` of k-step kk, for this warpgroup's share of
# dQ at both head dims. Work out, from the dS^T tile's layout and K_j's, which 64-column block
# each operand starts in for this warpgroup and how far one k-step of 16 keys moves it. The
# products above the region read their transposed operands too; the forward's P V in notebook 09
# is the closest model.
#
# **How it is judged.** `flashlab grade` builds stage 19 from your region, checks its forward and
# log-sum-exp, then dQ, dK and dV against float64 autograd: N = 1, 17, 1000 and 4096, D = 64 and
# 128, both masks, fp16 and bf16, and a model's strided layout, each gradient filled with NaN
# first. Each must be within twice the error of PyTorch's own backward in the same dtype. A wrong
# kernel scores 0; the message names the first failing gradient and case. A right one is timed in
# its backward: when your instructor grades, in turn with the solution's on the same GPU, full
# points within 5 % of its speed; checking your own work, only rightness counts.
#
# **GPU:** compute capability 9.0 exactly (an H100 or H200: `wgmma` exists nowhere else); without
# one, `flashlab grade` skips it with one line saying why. Run it with
#
#     flashlab grade --exercise 19.dq_descriptors

# %% [markdown]
# ## Questions for discussion
#
# 1. At D = 128 the query block is 64 rows because of the registers. Which of the four
#    accumulators could live elsewhere, and what would that cost?
# 2. A warpgroup computes S^T and dP^T, waits, and only then takes the exponentials of P. Which
#    product could be in flight while they run, and what must not be touched until it is done?
# 3. dQ is the only product whose result leaves the SM every query block. Why does the block
#    still wait for its `wgmma` before the next query block, and who else could do the reductions?

# %% [markdown]
# **Instructor's answer.** *1.* dK and dV are the long-lived ones: 64 floats a thread each at
# D = 128, held across every query block. Kept in shared memory instead, each query block would
# add its product into them through the shared memory the tiles need (64 KB more for the two, at
# fp32), and `wgmma` cannot accumulate into shared memory: each update would be a load, an add and
# a store. S^T and dP^T live only inside one query block and cannot move at all.

# %% [markdown]
# **Instructor's answer.** *2.* Commit S^T and dP^T as two groups and wait for the first only
# (`wgmma.wait_group 1`): P's exponentials then run while dP^T is multiplied. Issue dV's product as
# soon as P is packed, and compute dS while it runs. dP^T's accumulators may not be read, and P's
# packed registers may not be changed, until their groups are done; ptxas warns (C7514) when code
# reads an accumulator it cannot prove ready, and serializes the products.

# %% [markdown]
# **Instructor's answer.** *3.* The dS^T tile is rewritten at the next query block, and the
# other warpgroup's dQ product reads all of it, so every dQ product must be complete before the
# barrier that starts the next block; and the reductions need dQ's registers. FlashAttention-3
# gives dQ to a separate warp: the consumers write their dQ into shared memory, and that warp adds
# it into the fp32 sum with the TMA's reduce-add (`cp.reduce.async.bulk`), so the consumers go on.

# %% [markdown]
# ## Summary
#
# - The backward's five products run as `wgmma`: two warpgroups of 64 keys, S^T and dP^T with
#   both operands from shared memory, dV and dK with P^T and dS^T from registers, dQ with dS and
#   K_j both read transposed from shared memory.
# - For the same multiply-adds, a block issues 40 times fewer tensor-core instructions and no
#   `ldmatrix`.
# - The query block is as large as the accumulators allow: 128 rows at D = 64, 64 at D = 128.
# - On the H200 stage 19 ran 1.12–1.40 times stage 18 at D = 64 and 1.25–1.59 at D = 128 over the
#   sweep: 1.48–1.60 times SDPA's flash backward, 0.80–0.94 times cuDNN's. The tensor pipe is busy
#   a smaller share of a shorter time, and the barriers and exponentials now stand in its way.

# %%
nb.reached("19_wgmma_backward")  # its backward, beside the stages before it and SDPA's
