# %% [markdown]
# # Stage 16 — A deterministic backward
#
# Stage 15's backward is right, and it is not repeatable: run it twice on the same inputs and dQ
# comes back with different last bits. Each key block adds its share of dQ into an fp32 sum with
# atomics, in whatever order the blocks get there, and floating-point addition does not
# associate. This stage changes one thing: at each query block's sum, the key blocks take turns.
#
# ## Objectives
# After this notebook you can:
# - explain why atomically added fp32 sums vary from run to run, and measure it;
# - make blocks of one grid take turns through a counter in global memory: spin on it, make the
#   other block's writes visible, pass it on, and say which fences that takes;
# - choose a turn order that cannot deadlock (a block only waits for blocks launched before it)
#   and that does not make blocks wait under the causal mask;
# - model what the turns cost, predict it, and measure it against the non-deterministic backward.
#
# **Prerequisites:** notebook 15 (the tensor-core backward and its dQ atomics); 14 (Algorithm 2).
#
# **Time:** about 16 min to read, 30 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import deterministic
from flashlab import notebook as nb
nb.banner("16_deterministic")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · The same sum, different bits
#
# A row of dQ is the sum of one partial sum per key block: 64 of them at N = 4096. An atomic add
# rounds after every addition, so the result depends on the order the partial sums arrive in. On
# the CPU, one row's 64 partial sums added in 8 random orders:

# %%
deterministic.orders_demo()

# %% [markdown]
# Every row takes several values, all within a few units in the last place of fp32: each is as
# right as the others. But training is then not reproducible bit for bit: two runs from one seed
# drift apart, and a bug hunt cannot replay a step. PyTorch's `torch.use_deterministic_algorithms`
# exists for this, and FlashAttention has a deterministic backward for the same reason.
#
# The check that catches it runs the backward several times on the same inputs and asks for the
# same bits (`fl.check_repeatable`). On stage 15 it fails on dQ, and only on dQ: dK and dV are
# each summed by one block, in a fixed order.

# %% [markdown]
# ## 2 · The idea: take turns
#
# Give every (batch, head, query block) a counter in global memory, zeroed before the launch. Key
# block j, when it has its share of dQ_i ready, waits until the counter reads its turn, adds its
# share (the same adds as stage 15, but never at the same time as another block's), waits until
# its adds have landed, and sets the counter to its turn plus one. Each element of dQ is then the
# same additions in the same order on every run.
#
# Each step needs its fence. The spin reads the counter through a `volatile` pointer, so that the
# compiler reads memory every time instead of once. After the spin, a fence keeps this block's
# adds from being performed before the counter was seen to change. Before the turn passes, every
# thread fences, so that its adds are performed in L2 before any other block can see the new
# counter; a barrier then lets one thread pass it on.
#
# Two rules decide the order. **It must not deadlock:** a block spinning on a counter holds its
# place on an SM; if the block it waits for has not been launched, and every place is taken by
# waiting blocks, nothing moves. GPUs place a grid's blocks in order of their index; CUDA does not
# promise it, but FlashAttention's deterministic backward relies on it too. So a block may only
# wait for blocks of lower index. **It should not make blocks wait:** without a
# mask every key block walks the query blocks from 0, so taking turns in launch order (0, 1, ...)
# costs one add's time per block at the start, and nothing after. Under the causal mask, key block
# j starts at query block j. In launch order, block j would wait at its very first query block
# until block 0 had walked there: j steps doing nothing. So stage 16 launches the causal key
# blocks last first, and at query block i takes turns in the order they arrive: i, i − 1, ..., 0.

# %%
display(deterministic.turns(nq=6, causal=True))
display(deterministic.figure())

# %% [markdown]
# ## 3 · What changed

# %%
nb.show_diff("15_backward_mma", "16_deterministic", context=1)

# %% [markdown]
# The turn of a block at a query block, and where the kernel waits and passes it: it computes its
# share of dQ first, so that the wait overlaps nothing it could have done earlier.

# %%
nb.show_lines("16_deterministic", r"// This block's turn at query block qb", r"auto turn = ")

# %% [markdown]
# ## 4 · Prediction
#
# Model one head: every key block computes a query block in one unit of time, then holds the turn
# while its adds land, `hold` units. The fence that makes them land waits for the atomics to be
# performed in L2, a round trip of about a microsecond under load, against about 4 µs of work per
# query block in stage 15 (169 TFLOP/s over 132 SMs, two blocks each): `hold` ≈ 0.25. When every
# place on the SMs is taken, as at large N, waiting is as costly as working:

# %%
for causal in (False, True):
    display(deterministic.idle(nq=64, causal=causal, hold=0.25))

# %% [markdown]
# **Prediction.** The deterministic backward keeps 0.73 of stage 15's speed without a mask and
# 0.80 with it. Taking the causal turns in launch order instead would keep 0.37.

# %% [markdown]
# ## 5 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("16_deterministic")
    print(ev)

# %%
with nb.unless_missing():
    if ev.rows.empty:
        raise nb.not_recorded("16_deterministic", " backward timings")
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "16_deterministic") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "15_backward_mma"), "fp16", causal))

# %% [markdown]
# ### Discussion
#
# On the H200, timed in turn with stage 15 and SDPA's flash backward over N = 1k to 16k (fp16,
# D = 64 and 128), the deterministic backward kept 0.56–0.73 of stage 15's speed without a mask
# and 0.66–0.74 with it; the same kernel with causal turns in launch order kept 0.32–0.44. Every
# run of stage 16 gave the same bits (five runs, fp16 and bf16, both masks, D = 64 and 128); stage
# 15 failed the same check on dQ in every case.
#
# The order of the turns came out as the model said: arrival order under the mask is worth 1.6 to
# 2 times launch order. But in arrival order the turns cost more than predicted. With `hold` ≈ 0.5
# instead of 0.25 the model gives 0.57 and 0.67, about the measured low ends: the fence after the adds waits
# for all of a block's 2 048 (D = 64) or 4 096 (D = 128) adds to be performed in L2, and four
# warps stand still meanwhile. The fence even changes the adds themselves: stage 15's
# fire-and-forget reductions (RED in the machine code) become atomics that return (ATOM). For
# launch order the model with `hold` = 0.5 says 0.29, below the 0.32–0.44 measured: it charges
# every waiting block a whole place on an SM, while the other block on the same SM runs on. The
# cost to attack is the fence: a block could pass the turn later, after its next query block's
# products, by when its adds have long landed, so that the fence finds nothing to wait for.

# %% [markdown]
# ## 6 · The profile

# %%
with nb.unless_missing():
    p = nb.profile("16_deterministic", pass_="backward")
    display(p.loc[[m for m in ("duration_ms", "tensor_pipe_pct", "achieved_occupancy_pct",
                               "stall_barrier", "stall_membar", "stall_long_scoreboard",
                               "stall_wait", "stall_short_scoreboard", "stall_branch_resolving")
                   if m in p.index]])

# %% [markdown]
# ### Discussion
#
# Set beside stage 15's profile (notebook 15, section 7: tensor pipe 32 %), the tensor pipe is busy
# 17 % of the time for the same work, and the warps wait where section 5 put them: at `barrier`
# (32 %: the block held while one thread spins on the counter, or while every warp's adds are
# fenced before the turn passes) and at `membar` (11 %: a warp at the fence, waiting for its
# reductions to be acknowledged). At this small size (16 key blocks per head) the cost is near
# its largest: 0.57 of stage 15 without the mask.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `16.turns` (10 points)
#
# **Where:** in `kernels/16_deterministic.cu`, the two functions `wait_turn` and `pass_turn`,
# between `// BEGIN EXERCISE 16.turns` and `// END EXERCISE 16.turns`. The stub takes no turns:
# the adds land in any order, as in stage 15. Every gradient is still right, and dQ's last bits
# vary.
#
# **What to write:** `wait_turn(turn, mine)`: one thread of the block reads the counter until it
# equals `mine`, each read going to memory, then makes sure that what the blocks before it added
# is visible to it; then the whole block goes on. `pass_turn(turn, mine)`: once every thread's adds
# are visible to the whole GPU, one thread sets the counter to `mine + 1`.
#
# **How it is judged.** `flashlab grade` builds stage 16 from your region, checks its forward,
# log-sum-exp and gradients against float64 as for stage 15, then runs its backward three times on
# the same inputs (N = 4096: 64 key blocks add into every row of dQ; D = 64 and 128, both masks,
# fp16 and bf16) and requires the same bits every time. Three runs on one GPU can agree even where
# nothing orders the adds, so the machine code is read too: a kernel without a fence (`MEMBAR`)
# scores 0, with that named. A kernel that hangs is stopped at the grading timeout and scores 0.
# A right one is timed in its backward: when your instructor grades,
# in turn with the solution's on the same GPU, full points within 5 % of its speed.
#
# **GPU:** compute capability 8.0 or newer. Run it with
#
#     flashlab grade --exercise 16.turns

# %% [markdown]
# ## Questions for discussion
#
# 1. Why can a block not simply wait for the block of its turn whatever its launch index? Give a
#    grid in which that deadlocks.
# 2. With the stub, every gradient passes the float64 check. What, then, is wrong with it, and why
#    does a check against float64 never find it?
# 3. Section 5 proposes passing the turn one query block later. What does that cost under the
#    causal mask, and without it?

# %% [markdown]
# **Instructor's answer.** *1.* Blocks are placed on SMs in index order as places free up (what
# GPUs do, not what CUDA promises), and a waiting block keeps its place. Take one head at N = 32k: 512 key blocks, and 264 places on an
# H100 at two blocks per SM. If blocks 0–263 all waited for blocks of higher index, none would
# finish, and block 264 would never be placed. Waiting only for lower indices means the block waited
# for is running or done, and the lowest-index block waiting always can go on.

# %% [markdown]
# **Instructor's answer.** *2.* Nothing is wrong with any single result: each order of the adds
# gives a sum within rounding of the exact one. What the stub breaks is a property of two runs,
# that they agree, and a check of one run against float64 cannot see a property of two runs. That
# is why the grader runs the backward again and compares bits.

# %% [markdown]
# **Instructor's answer.** *3.* Under the mask, block j arrives at query block i one step after
# block j + 1, so a turn passed up to a step later still comes before block j needs it: nothing is
# lost, and the fence stops costing. Without the mask, all blocks arrive together and take turns in
# launch order, so each block's late pass delays the next block by the same amount: the skew grows
# by a fraction of a step per block, 64 blocks at N = 4096. There, a smaller delay (the fence after
# the dK and dV products of the next block) is the better trade.

# %% [markdown]
# ## Summary
#
# - Atomically added fp32 sums depend on the order the additions land in: right, and not
#   repeatable. Checking one run against float64 cannot see it; running twice and comparing bits
#   can.
# - Stage 16 makes the key blocks take turns at each query block's sum through a counter in
#   global memory: spin, fence, add, fence, pass.
# - A block waits only for blocks launched before it, so the waits end; under the causal mask the
#   blocks are launched last first and take turns in the order they arrive, which is worth 1.6–2
#   times launch order.
# - The turns cost about a third of stage 15's speed on the H200, most of it the fence that waits
#   for a block's atomics to land before it passes the turn.

# %%
nb.reached("16_deterministic")  # its backward, beside the stage before it and SDPA's
