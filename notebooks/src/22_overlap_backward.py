# %% [markdown]
# # Stage 22 — Overlapped backward
#
# In stage 20 a producer warpgroup moves every byte, and the two consumer warpgroups only
# multiply. But "only multiply" is not quite what they do. Between the products of a query block
# each consumer turns S^T into P and dP^T into dS: exponentials, multiply-adds, the rows'
# log-sum-exps and Δs read from shared memory. In stage 20 a consumer waits until both S^T and
# dP^T are finished before it starts that arithmetic, and issues no product until it is done. For
# that stretch its tensor cores have nothing queued. This stage changes one thing: each consumer
# computes under its next product, as FlashAttention-3 does inside a warpgroup.
#
# ## Objectives
# After this notebook you can:
# - split `wgmma` products into commit groups and wait for some of them
#   (`wgmma.wait_group 1`), knowing that groups retire in the order they were committed;
# - schedule a warpgroup's arithmetic under its own asynchronous products, and say what a
#   schedule costs in registers;
# - find a kernel's waits in its machine code and tell an overlapped schedule from a serial one;
# - explain why an overlap that looks large on a timeline gains little when another warpgroup
#   already fills the gaps.
#
# **Prerequisites:** notebook 20 (the warp-specialized backward); notebook 12 (the two overlaps
# of FlashAttention-3 in the forward); notebook 19 (the backward's five products on `wgmma`).
#
# **Time:** about 19 min to read, 25 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import overlap_backward
from flashlab import notebook as nb
nb.banner("22_overlap_backward")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · Where a consumer waits
#
# A consumer warpgroup of stage 20 owns 64 keys of its block. For each query block it runs five
# products and two pieces of arithmetic between them:
#
# 1. S^T = K_w Q_i^T and dP^T = V_w dO_i^T, issued together as one group (a commit group: the
#    `wgmma`s issued since the last `wgmma.commit_group`; `wgmma.wait_group N` counts these);
# 2. `wgmma.wait_group 0`: both are complete;
# 3. P = exp2(S^T · scale · log2 e − L) and dS = P ∘ (dP^T − Δ), element by element;
# 4. dV += P^T dO_i and dK += dS^T Q_i, with P and dS as register operands;
# 5. dS^T to shared memory, then dQ_i = dS K_j.
#
# `wgmma` is asynchronous: the instruction only queues the product, and the warpgroup goes on
# until it waits. Step 2 waits for everything, so during step 3 the warpgroup has nothing queued.
# The timeline of one query block, with schematic lengths:

# %%
display(overlap_backward.figure())

# %% [markdown]
# ## 2 · The idea: compute under the next product
#
# Commit S^T and dP^T as two groups, S^T first. Groups retire in the order they were committed,
# so `wgmma.wait_group 1` ("at most one group still running") returns exactly when S^T is done,
# while dP^T is still being multiplied. P needs only S^T, so P is computed now. Then:
#
# - pack P into dV's A fragments and issue dV += P^T dO_i at once;
# - `wgmma.wait_group 1` again: now dP^T is done and dV's products still run;
# - compute dS under dV, then issue dK, as before.
#
# The bits do not change. Every value is computed from the same inputs by the same
# instructions; only the moment at which the warpgroup waits moves.
#
# The price is registers. A value stays alive until its last reader is done, and an operand of
# a running `wgmma` is alive until the product completes. While dS is computed under dV, a
# thread holds dK's and dV's accumulators, P (still needed for dS), dP^T, and P packed as dV's
# operand:

# %%
display(overlap_backward.live_registers())

# %% [markdown]
# At D = 128 that is 208 of the 240 registers `setmaxnreg` gives a consumer: 32 are left for
# addresses, indices and the loop. At D = 64 a query block has 128 rows, so S^T and dP^T double
# while dK's and dV's accumulators halve: 224 registers, which leaves 16. The compiler spilled there: local-memory stores and loads
# in the loop. So at D = 64 the kernel waits for dP^T and goes on as stage 20 did. The
# registers, not the idea, decide.
#
# ## 3 · What changed

# %%
nb.show_diff("20_warpspec_backward", "22_overlap_backward", context=1)

# %% [markdown]
# The arithmetic of P and dS is stage 20's, now callable in three steps: both at once (the D = 64
# path), P alone, or dS alone from the P already in place. No new instruction appears in the
# machine code. What changes is the waits. Each `wgmma.wait_group N` compiles to
# `WARPGROUP.DEPBAR.LE gsb0, N`, and counting them shows the schedule:

# %%
with nb.unless_missing():
    display(overlap_backward.waits())

# %% [markdown]
# Stage 20 waits for every group twice a query block and for "all but one" once (after dQ's
# products, to hand Q_i back). Stage 22 at D = 128 waits for every group once, at the end, and
# three times with a group still running. A kernel that gives the right answers with the waits in
# the wrong place gives up the idea, and no check of its gradients can tell. The grader counts
# these waits for that reason.
#
# ## 4 · Prediction
#
# The figure suggests a large gain: a query block is as long as its products. It overstates it.
# An SM has four tensor-core units, one per SM sub-partition, and both consumer warpgroups have a
# warp on each. While one consumer computes P and dS, the other can keep the tensor cores busy
# with its own products, if their schedules are offset. In stage 20 they are only loosely offset:
# the two named barriers around the dS^T tile bring them back into step every query block.
#
# So the gap is partly filled already, and what the overlap can win is smaller. In stage 20's
# profile the tensor pipe was idle about 60 % of the time at the teaching config: at most that
# could be reclaimed, and only the part spent on P and dS is within the overlap's reach.
#
# **Prediction.** Stage 22 faster than stage 20 at D = 128 by a few percent, at every N of the
# sweep; unchanged at D = 64, where the schedule is stage 20's; the tensor pipe a little busier.
#
# ## 5 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("22_overlap_backward")
    print(ev)

# %%
with nb.unless_missing():
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "22_overlap_backward") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        if mine.empty:
            raise nb.not_recorded("22_overlap_backward", " backward timings")
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "sdpa_cudnn", "20_warpspec_backward"), "fp16", causal))

# %% [markdown]
# Over the FlashAttention sweep (fp16, N = 512 to 16k, B·N = 16k), stage 22 over stage 20 and over
# SDPA's cuDNN backward, timed in turn in one run:

# %%
with nb.unless_missing():
    display(nb.sweep_ratio("22_overlap_backward", "20_warpspec_backward", pass_="backward").round(3))
    display(nb.sweep_ratio("22_overlap_backward", "sdpa_cudnn", pass_="backward").round(3))

# %% [markdown]
# ### Discussion
#
# At the teaching config (fp16, B = 4, H = 16, N = 1024, D = 64) on the H200, stage 22's backward
# ran at 302 TFLOP/s without the mask, 1.01 times stage 20 and 0.95 times cuDNN's, and at 188
# TFLOP/s with it, level with both. That config is at D = 64, where the schedule is stage 20's.
#
# At D = 128 the prediction held, in size too: stage 22 ran 1.01–1.035 times stage 20 over the
# sweep, the gain growing from N = 512 to 8k. The tables above are fp16's; bf16, timed in the same
# run, agrees within 0.01. Against cuDNN's backward it moved from 0.92–1.05 to 0.93–1.08 over
# both dtypes (0.94–1.08 in fp16): ahead from N = 8k, and from 4k with the mask.
#
# At D = 64 the prediction missed. With the schedule of stage 20 it still ran 1.00–1.03 times
# stage 20, against cuDNN 0.96–1.09. The one change there is that S^T and dP^T are committed as
# two groups and the kernel waits for them one after the other: no arithmetic runs between the
# two waits. A plausible reading is that the compiler scheduled the code around the waits
# differently, for example the loads of the rows' log-sum-exps, which now issue before dP^T is
# done. The profile below is the place to look for it; a kernel you did not predict deserves a
# second measurement before you trust your story about it.
#
# What remains behind cuDNN is the short sequences: 0.93–0.99 at D = 128 up to 4k without the
# mask and up to 2k with it, and
# 0.96–0.98 up to 2k at D = 64 without the mask. There the
# overlap inside a query block cannot help, since what costs is a block's start and end (K and
# V copied in, dK and dV stored), and nothing in this stage overlaps those with another
# block's work. Notebook 23 measures them and takes away the larger part of the end.
#
# A model's training step is the other measure. In notebook 14's GPT-2 at
# sequence 4096 (D = 64, causal, bf16), stage 22's backward kernel took 6.27 ms a step under the
# profiler against cuDNN's 6.55, and in three rounds of training steps in turn the whole step took
# 57.5–57.8 ms against cuDNN's 58.0–58.2: faster, by less than 1 %, since attention is about a
# seventh of the step.

# %% [markdown]
# ## 6 · The profile

# %%
with nb.unless_missing():
    p22 = nb.profile("22_overlap_backward", pass_="backward")
    p20 = nb.profile("20_warpspec_backward", pass_="backward")
    both = p20.iloc[:, [-1]].join(p22.iloc[:, [-1]])
    display(both.loc[[m for m in ("duration_ms", "tensor_pipe_pct", "sm_throughput_pct",
                                  "stall_long_scoreboard", "stall_barrier", "stall_wait",
                                  "stall_math_pipe_throttle", "stall_short_scoreboard",
                                  "stall_mio_throttle")
                      if m in both.index]])

# %% [markdown]
# ### Discussion
#
# The profile is of the teaching config, D = 64, where the schedule is stage 20's, and it shows
# how little changed there: the kernel took 0.1180 ms against 0.1190, the tensor pipe was busy
# 41.6 % of it against 41.1 %. The stalls barely moved either. The MIO throttle (the queue to
# shared memory and the special-function units, where the exponentials go) fell from 10.2 % to
# 9.6 %, the math-pipe throttle from 2.1 % to 1.7 %, and the consumers' own waits (`stall_wait`)
# rose a little, from 15.3 % to 15.9 %. That fits the reading above: the same work, issued in a
# slightly different order. Most of both kernels' time still goes to the long scoreboard (25 %:
# the consumers on the producer's mbarriers) and the named barriers (17 %), which this stage
# does not touch. The overlap at D = 128 would show in the tensor pipe's share at that head dim.
# Question 2 asks you to profile it there.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `22.two_groups` (10 points)
#
# **Where:** in `bwd_kernel` (`kernels/22_overlap_backward.cu`), in the consumers' loop, between
# `// BEGIN EXERCISE 22.two_groups` and `// END EXERCISE 22.two_groups`. The stub multiplies only
# S^T and leaves dP^T at zero, so dV is right and dK and dQ are wrong.
#
# **What to write:** the products S^T = K_w Q_i^T and dP^T = V_w dO_i^T, KD k-steps of 16 head-dim
# columns each, issued so that the code after the region can compute P while dP^T is still
# being multiplied, and the wait that lets it. The descriptors are the ones the stub uses, with
# V and dO in place of K and Q.
#
# **How it is judged.** `flashlab grade` builds stage 22 from your region, checks its forward and
# log-sum-exp, then dQ, dK and dV against float64 autograd: N = 1, 17, 1000 and 4096, D = 64 and
# 128, both masks, fp16 and bf16, and a model's strided layout, each gradient filled with NaN
# first. Each must be within twice the error of PyTorch's own backward in the same dtype. It then
# reads your kernel's machine code: at each head dim the backward kernel must wait for its
# `wgmma` groups with some still running at least as often as the solution does. A right answer
# with every wait a `wait_group 0` scores 0, with a message that says so. A right and overlapped
# kernel is timed in its backward: when your instructor grades, in turn with the solution's on
# the same GPU, full points within 5 % of its speed; checking your own work, only rightness
# counts.
#
# **GPU:** compute capability 9.0 exactly (an H100 or H200); without one, `flashlab grade` skips
# it with one line saying why. Run it with
#
#     flashlab grade --exercise 22.two_groups

# %% [markdown]
# ## Questions for discussion
#
# 1. The second `wgmma.wait_group 1` comes after dV's products are issued. Which group does it
#    wait for, and what would `wgmma.wait_group 2` there let go wrong?
# 2. Profile stages 20 and 22 at D = 128 (`fl.Config(4, 16, 1024, 128, False, "fp16")` as the
#    `config` of `nb.profile`). Which metric should move if the overlap works, and does it?
# 3. At D = 64 the overlap needs 16 more registers than the loop has. Name two ways to find them,
#    and what each costs.

# %% [markdown]
# **Instructor's answer.** *1.* After dV's products are issued, the committed groups still
# possibly running are dP^T's and dV's, in that order. "At most one still running" can only mean
# dV's, since groups retire in commit order: so dP^T is complete, and dS may read its
# accumulators. With `wait_group 2` both could still be running, and dS would read dP^T's
# registers while the tensor cores still write them: wrong gradients, only sometimes.

# %% [markdown]
# **Instructor's answer.** *2.* The tensor pipe's share of the kernel's time should rise and
# its duration fall by about the same factor (the sweep's 1–3.5 % at D = 128). The stall the
# overlap removes is the consumers' wait on their own groups. If the share does not move, the
# other consumer was already filling those gaps, and the gain comes from somewhere else.

# %% [markdown]
# **Instructor's answer.** *3.* Smaller query blocks at D = 64 (64 rows, as at D = 128) halve S^T
# and dP^T; but dQ's product then splits differently between the two consumers and each query
# block's fixed costs (its barriers, its mbarriers, its dQ reduction) come twice as often. Or
# give the producer fewer registers: it already keeps only 24, the least `setmaxnreg` allows. A
# third way is to compute dS from P packed to 16 bits, so that P in fp32 need not stay alive. It
# changes the rounding of dS, and with it the bits of dK and dQ.

# %% [markdown]
# ## Summary
#
# - `wgmma` groups retire in commit order, so `wgmma.wait_group 1` waits for all but the last
#   group: S^T and dP^T as two groups let P be computed while dP^T runs.
# - Issuing dV's products before dS lets dS be computed under them.
# - The same bits as stage 20; only the waits moved. The machine code shows them:
#   `WARPGROUP.DEPBAR.LE gsb0, 1`.
# - Registers decide where a schedule fits: at D = 128 it does; at D = 64, with 128-row query
#   blocks, it would spill, and stage 20's order stays.
# - On the H200 stage 22 ran 1.01–1.035 times stage 20 at D = 128 and 1.00–1.03 at D = 64 over the
#   sweep, 0.93–1.09 times cuDNN's backward in fp16 and bf16: ahead from 4k–8k, behind on short sequences, where a
#   block's start and end cost the most.

# %%
nb.reached("22_overlap_backward")  # its backward, beside the stages before it and SDPA's
