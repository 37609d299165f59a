# %% [markdown]
# # Stage 20 — Warp-specialized backward
#
# Stage 19 put the backward's five products on `wgmma`. Its profile said where the rest of the
# time goes: the same warps that multiply also copy every tile in, load their rows' log-sum-exps,
# meet at a barrier before each query block, and push dQ out as thousands of small reductions.
# While a warp does any of that, its tensor cores wait. The forward met the same problem in
# notebooks 10 and 11 and answered it with the tensor memory accelerator (TMA) and a producer
# warpgroup. This stage changes one thing: a producer warpgroup moves every byte of the
# backward, in and out, and the two warpgroups that multiply only multiply.
#
# ## Objectives
# After this notebook you can:
# - split a kernel's work into roles (a loading thread, a reducing thread, two multiplying
#   warpgroups) and connect them with mbarriers that count arrivals and bytes;
# - add a block's fp32 partial sum into global memory with one bulk reduction from shared memory,
#   and lay the buffer out so that the reduction is one contiguous span;
# - budget registers across roles with `setmaxnreg`, and check in the machine code what a lower
#   register cap did to the code the compiler wrote;
# - predict from a profile's stall reasons how much a change that removes them can gain, and read
#   afterwards where the remaining time goes.
#
# **Prerequisites:** notebook 19 (the `wgmma` backward); notebooks 10 and 11 (TMA, mbarriers,
# the producer warpgroup and `setmaxnreg`); notebook 18 (dQ's tiled sum).
#
# **Time:** about 19 min to read, 30 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import warpspec_backward
from flashlab import notebook as nb
nb.banner("20_warpspec_backward")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · Who moves the bytes
#
# For each query block a backward block reads Q_i and dO_i (16-bit tiles), their rows'
# log-sum-exps and Δs, and it adds its dQ_i, in fp32, into the head's sum. In stage 19 the 256
# threads that multiply do all of it: each issues its share of `cp.async` copies of 16 bytes, the
# first BR threads load the rows' numbers into shared memory, the whole block meets at
# `__syncthreads` to know the tiles have landed, and after dQ's products every thread sends its
# 32 floats out as 16 `float2` reductions. Per query block:

# %%
display(warpspec_backward.traffic(D=64))

# %% [markdown]
# ## 2 · The idea: a producer warpgroup
#
# Give the block a third warpgroup that never multiplies. One of its threads copies with the TMA:
# K_j and V_j once, then for each query block Q_i and dO_i as boxes of 64 columns, swizzled as
# `wgmma` reads them, and the rows' log-sum-exps and Δs as two 1-D bulk copies. All four land on
# one mbarrier, `q_full[s]`, which counts the bytes in. There are two buffers, so the copies of
# block i + 1 run while block i is multiplied; every consumer thread hands its buffer back by
# arriving on `q_empty[s]` once the products that read it are done.
#
# A second thread of the producer takes dQ. The consumers write their dQ_i accumulators into a
# shared-memory buffer, in the tiled layout of stage 18, and arrive on `dq_full`. That thread
# then issues one instruction, `cp.reduce.async.bulk ... .add.f32`, which adds the whole buffer,
# element by element, into the fp32 sum in L2. That a single reduction can cover a whole query
# block is a property of stage 18's layout; the kernel exercise asks why. When the reduction has
# read the buffer, the thread arrives on `dq_empty` and the consumers may reuse it. Two dQ
# buffers let block i's reduction run while block i + 1 is multiplied.

# %%
display(warpspec_backward.figure())

# %% [markdown]
# The producer needs few registers, and the consumers need all they can get: their accumulators
# for S^T, dP^T, dK and dV alone are 192 floats a thread at D = 64. A block of 384 threads starts
# with 168 registers each. `setmaxnreg` moves them: the producer gives back all but 24, and the
# two consumer warpgroups take the rest.

# %%
display(warpspec_backward.registers())

# %% [markdown]
# 240 is fewer than the 255 a stage 19 thread may hold. The products fit, with no spills, but a
# lower cap changes more than spills. With the mask test inside the loop that turns S^T into P,
# the compiler at 240 registers put a branch around each element's log-sum-exp load and
# exponential: 66 `BSSY`/`BSYNC` pairs in the kernel at D = 64, one for each of the 64 scores a
# thread holds and two elsewhere, where stage 19 has none. That version ran at 0.7–0.9 times
# stage 19. The kernel below compiles the loop twice, once for edge
# blocks (where the mask applies) and once for the rest, where every element is seen and no
# test remains. Read the machine code after every change to a register budget.
#
# ## 3 · What changed

# %%
nb.show_diff("19_wgmma_backward", "20_warpspec_backward", context=1)

# %% [markdown]
# The products, the masks, P and dS and the staggered start are stage 19's.
# New: the roles, the mbarriers, the TMA's tensor maps (built on the host, as in stage 10) and
# its bulk copies, dQ through shared memory, and a preprocessing pass that writes the
# log-sum-exps (in log2 units) and Δs with each head's rows padded as dQ's sum is, so that every
# bulk copy is whole. The two passes around the kernel also read wider: a row of the
# preprocessing pass has D / 8 threads that load 16 bytes each (a warp of 2-byte loads in stage
# 19), and a block of the conversion converts four tiles of dQ's sum, their loads in flight
# together. They only move bytes, and more bytes in flight move faster. The SASS shows the
# roles' instructions:

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("19_wgmma_backward", "20_warpspec_backward")
    bwd = mix[mix.index.get_level_values("kernel").str.startswith("bwd_kernel<__half")]
    display(bwd.droplevel("stage").T.loc[["HGMMA", "LDGSTS", "RED", "UTMALDG", "UBLKCP",
                                          "UBLKRED", "SYNCS", "USETMAXREG", "BAR", "total"]])

# %% [markdown]
# ## 4 · Prediction
#
# What can taking the memory work away from the consumers gain? Stage 19's profile sorts its
# warps' stalls by reason. Three of them belong to the memory work this stage moves: the long
# scoreboard (waiting for data from global memory), the LG throttle (the queue of global memory
# instructions full: the copies and the reductions) and the MIO throttle (the queue to shared
# memory and the special units). If those stalls disappeared and nothing else changed, the time
# would shrink by their share of all stall samples.

# %%
moved = ("stall_long_scoreboard", "stall_lg_throttle", "stall_mio_throttle")
share = 0.335  # stage 19's share of those stalls at the teaching config, if not recorded here
with nb.unless_missing():
    p19 = nb.profile("19_wgmma_backward", pass_="backward")
    s19 = p19.iloc[:, -1]
    stalls = s19[[m for m in s19.index if m.startswith("stall_")]].astype(float)
    share = float(stalls[list(moved)].sum() / stalls.sum())
print(f"share of stage 19's stalls the producer takes over: {share:.3f} -> at most "
      f"{1 / (1 - share):.2f}x stage 19 at the teaching config (D = 64)")

# %% [markdown]
# That is a ceiling, not an estimate: stalls overlap with one another and with the tensor cores'
# work, and the consumers gain waits of their own, on the mbarriers. The consumers' instruction
# stream does shrink, though, which the stall samples do not count.
#
# **Prediction.** Stage 20 faster than stage 19 at every config of the sweep, by less than the
# ceiling above; the gain largest where the products are the smallest share of the time (D = 64);
# the tensor pipe busier in the profile.
#
# ## 5 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("20_warpspec_backward")
    print(ev)

# %%
with nb.unless_missing():
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "20_warpspec_backward") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        if mine.empty:
            raise nb.not_recorded("20_warpspec_backward", " backward timings")
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "sdpa_cudnn", "19_wgmma_backward"), "fp16", causal))

# %% [markdown]
# Over the FlashAttention sweep (fp16, N = 512 to 16k, B·N = 16k), stage 20 over stage 19 and over
# SDPA's cuDNN backward, timed in turn in one run:

# %%
with nb.unless_missing():
    display(nb.sweep_ratio("20_warpspec_backward", "19_wgmma_backward", pass_="backward").round(3))
    display(nb.sweep_ratio("20_warpspec_backward", "sdpa_cudnn", pass_="backward").round(3))

# %% [markdown]
# ### Discussion
#
# At the teaching config (fp16, B = 4, H = 16, N = 1024, D = 64) on the H200, stage 20's backward
# ran at 289 TFLOP/s without the mask, 1.06 times stage 19 and 1.47 times SDPA's flash backward,
# and at 181 TFLOP/s with it, 1.04 times stage 19. The prediction held in its direction and
# missed in its size: the ceiling was 1.50, and the gain at this config is about a tenth of it.
#
# Over the sweep the gain grows with N, to 1.15 at D = 64 and 1.29 at D = 128. Not all of it is
# the producer's: the wider passes around the kernel save about 60 µs of each backward at D = 64
# and 25 µs at D = 128 (a profile on the H200), the same at every N here, since the sweep's B·N
# is fixed. At N = 512 and D = 64 that is almost the whole gain; at 16k it is under 1 %. The
# part of the prediction about N held. The other half did not: D = 128 gained more than D = 64. Both head dims do the same multiply-adds per query block (128 keys × 128
# queries × 64, or 128 × 64 × 128) and move the same bytes. What differs is the work this stage
# cannot touch: at D = 64 a query block has twice the scores, so each consumer takes twice the
# exponentials and computes twice the elements of P and dS for the same products. A larger share
# of D = 64's time is the consumers' own arithmetic, and moving the memory work saves a smaller
# share.
#
# Against cuDNN's backward stage 20 reaches 0.97–1.07 at D = 64 and 0.92–1.03 at D = 128. It is
# level or ahead from N = 8k (with the mask at D = 64, from 1k), and behind on short sequences,
# where each key block sees only a few query blocks. There a block's start (K and V copied in, the first Q_i awaited)
# and its end (dK and dV stored) weigh the most, and nothing in this stage overlaps them with
# another block's work.

# %% [markdown]
# ## 6 · The profile

# %%
with nb.unless_missing():
    p20 = nb.profile("20_warpspec_backward", pass_="backward")
    p19 = nb.profile("19_wgmma_backward", pass_="backward")
    both = p19.iloc[:, [-1]].join(p20.iloc[:, [-1]])
    display(both.loc[[m for m in ("duration_ms", "tensor_pipe_pct", "sm_throughput_pct",
                                  "smem_wavefronts", "stall_long_scoreboard",
                                  "stall_lg_throttle", "stall_mio_throttle",
                                  "stall_short_scoreboard", "stall_barrier", "stall_wait",
                                  "stall_branch_resolving")
                      if m in both.index]])

# %% [markdown]
# ### Discussion
#
# The backward kernel took 0.119 ms against stage 19's 0.130, and the tensor pipe was busy 41.3 %
# of it against 37.5 %. The stalls the prediction counted moved rather than vanished. The LG
# throttle fell from 12.4 % to 8.0 %; what is left of it is dK's and dV's stores at a block's
# end. The long scoreboard grew, from 12.4 % to 22.9 %. The consumers no longer load anything
# from global memory, so what waits there is their `q_full` and `dq_empty` mbarriers: the
# consumers now wait for the producer. The ring has two buffers, so the copies of block i + 2
# start only when block i hands its buffer back, and they have one block's products to land.
# The barrier stalls grew too, 13.9 % to 16.5 %, at the two named barriers around the dS^T tile.
#
# So the memory work left the consumers, and the ceiling was never in reach: the copies'
# latency is hidden only as far as the ring is deep, and the warpgroups still take turns at the
# dS^T tile. Deeper rings need shared memory the block has spent (194 KB at D = 64). The
# overlap that remains is inside a warpgroup: exponentials while a product runs.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `20.dq_span` (10 points)
#
# **Where:** in `bwd_kernel` (`kernels/20_warpspec_backward.cu`), in the producer's dQ thread:
# between `// BEGIN EXERCISE 20.dq_span` and `// END EXERCISE 20.dq_span`. The stub adds every
# query block's dQ into the head's first rows, so dK and dV are right and dQ comes out wrong.
#
# **What to write:** the one bulk reduction that adds query block i's dQ, waiting in buffer
# `dq[s]`, into the head's fp32 sum: where in the sum it lands and how many bytes it covers.
# Work it out from stage 18's tiled layout (tiles of 16 rows by 64 columns, in the order the
# comment above the region gives): which tiles hold rows q0 to q0 + BR − 1, and are they
# contiguous?
#
# **How it is judged.** `flashlab grade` builds stage 20 from your region, checks its forward and
# log-sum-exp, then dQ, dK and dV against float64 autograd: N = 1, 17, 1000 and 4096, D = 64 and
# 128, both masks, fp16 and bf16, and a model's strided layout, each gradient filled with NaN
# first. Each must be within twice the error of PyTorch's own backward in the same dtype. A wrong
# kernel scores 0; the message names the first failing gradient and case. A right one is timed in
# its backward: when your instructor grades, in turn with the solution's on the same GPU, full
# points within 5 % of its speed; checking your own work, only rightness counts.
#
# **GPU:** compute capability 9.0 exactly (an H100 or H200); without one, `flashlab grade` skips
# it with one line saying why. Run it with
#
#     flashlab grade --exercise 20.dq_span

# %% [markdown]
# ## Questions for discussion
#
# 1. The consumers arrive on `q_empty[s]` after waiting for dV's and dK's products, before dQ's.
#    Why may they hand Q_i and dO_i back then, and what would go wrong one step earlier?
# 2. The dQ thread waits until its reduction has *read* the buffer, not until the additions are
#    done in global memory. Why is that enough inside the kernel, and what must it wait for before
#    the block ends?
# 3. Two warpgroups still meet at two named barriers per query block, around the dS^T tile. What
#    would a second dS^T buffer remove, and what does it cost in shared memory at D = 64?

# %% [markdown]
# **Instructor's answer.** *1.* Q_i and dO_i are read by S^T's and dP^T's products (done before
# P is formed) and by dV's and dK's (B operands); dQ's product reads only the dS^T tile and K_j.
# So once `wgmma.wait_group 1` has retired dV's and dK's group, nothing will read the buffer
# again. One step earlier, with dV and dK still in flight, the TMA could overwrite dO_i and Q_i
# under them: the gradients would be wrong only sometimes, the worst kind of wrong.

# %% [markdown]
# **Instructor's answer.** *2.* The consumers only need the buffer free; the sum in global memory
# is read by nobody until the conversion pass, a later kernel, which sees every write of this one.
# But shared memory belongs to the block: before the thread returns it waits for its whole bulk
# group (`cp.async.bulk.wait_group 0`), so that no reduction still reads a buffer the next block
# on the SM may reuse.

# %% [markdown]
# **Instructor's answer.** *3.* Each warpgroup must not overwrite dS^T while the other's dQ product
# still reads it (the first barrier), and must not read it before the other has written its rows
# (the second). With two buffers, alternating by query block, the first barrier goes: a warpgroup
# writes buffer (i mod 2) while the other may still read the other one. At D = 64 a dS^T tile is
# 128 × 128 × 2 bytes = 32 KB, and the block already uses 194 KB of the 227 available.

# %% [markdown]
# ## Summary
#
# - A producer warpgroup moves every byte: one thread copies K, V, Q, dO, the log-sum-exps and Δs
#   with the TMA onto a ring of two buffers and mbarriers, another adds each query block's dQ into
#   the fp32 sum with one bulk reduction from shared memory.
# - The consumers only multiply: no copies, no reductions and no `__syncthreads` in their loop;
#   `setmaxnreg` gives them 240 registers a thread.
# - A lower register cap changed the compiled code without spilling: read the SASS.
# - On the H200 stage 20 ran 1.10–1.15 times stage 19 at D = 64 and 1.13–1.29 at D = 128 over the
#   sweep (the wider passes around the kernel part of it), 1.59–2.13 times SDPA's flash backward
#   and 0.92–1.07 times cuDNN's: level with or ahead of cuDNN from N = 8k, behind on short
#   sequences.
# - The stalls moved: the consumers now wait on the producer's mbarriers, not on memory.

# %%
nb.reached("20_warpspec_backward")  # its backward, beside the stages before it and SDPA's
