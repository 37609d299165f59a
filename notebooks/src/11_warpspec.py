# %% [markdown]
# # Stage 11 — warp specialization: a producer warpgroup copies, consumer warpgroups compute
#
# In stage 10 one thread both computes and issues every copy of its block, and when it waits for a
# free buffer its warpgroup waits with it. Hopper lets a block give its warpgroups different jobs
# and different register budgets: a **producer** warpgroup that only issues TMA copies and hands
# most of its registers back with `setmaxnreg`, and **consumer** warpgroups that only compute, with
# the registers the producer gave up. That split is this stage's idea.
#
# ## Objectives
# After this notebook you can:
# - say what stage 10's elected thread costs, and which waits a producer warpgroup takes over;
# - read a producer's and a consumer's loop: who waits on which `full` and `empty` barrier;
# - budget registers per role with `setmaxnreg`, say why three consumers fit at D = 64 and not at
#   D = 128, and what the producer's registers cost;
# - predict what the split buys, and check it in the machine code, the timings and the stall
#   reasons, read by role.
#
# **Prerequisites:** notebook 10 (TMA, mbarriers, full and empty barriers), notebook 09 (`wgmma`).
# The kernel needs a Hopper GPU (H100, H200, GH200); elsewhere this notebook replays the numbers
# recorded on one. Appendix 11a covers what else the kernel carries.
#
# **Time:** about 25 min to read, 40 min to work through.

# %%
# %matplotlib inline
import math

import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import warpspec
from flashlab import notebook as nb
from flashlab import picks
from flashlab import plots
nb.banner("11_warpspec")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
sms, roof = here.sms, here.roof
print(here)

# %% [markdown]
# ## 1 · What stage 10's elected thread costs
#
# Stage 10's copies are issued by thread 0, a computing thread of warpgroup 0, right after it has
# issued its own `S`:

# %%
nb.show_lines("10_tma", r"// While tile j's S is computed, the elected thread refills", r"^  \};")

# %% [markdown]
# * **It waits in the middle of its math.** `empty` completes only when every warp has released the
#   old buffer. Until then thread 0 cannot go on to its softmax, and since a `wgmma` is issued by
#   the four warps of a warpgroup together, warpgroup 0's next product waits too.
# * **Every warp is sized for the math.** The copier holds as many registers as the computing
#   threads: copying and computing cannot get different budgets.
#
# Stage 11 keeps the math and changes who does what (the last three rows are carried mechanisms,
# listed at the end of section 2):

# %%
pd.DataFrame({
    "stage 10 (D = 128)": {
        "threads a block": 256,
        "warpgroups that compute": 2,
        "who issues the copies": "thread 0 of warpgroup 0, between its S and its softmax",
        "who waits for a free buffer": "thread 0, and with it warpgroup 0",
        "registers a thread may hold": f"{warpspec.entry_registers(256)}, every thread alike",
        "blocks": "one per work item",
        "Q buffers": "1",
        "K and V": "one buffer and one barrier pair for both",
    },
    "stage 11 (D = 128)": {
        "threads a block": 384,
        "warpgroups that compute": 2,
        "who issues the copies": "thread 0 of the producer warpgroup, which does nothing else",
        "who waits for a free buffer": "the producer",
        "registers a thread may hold": f"{warpspec.consumer_registers(2)} (consumers), 40 (producer): "
                                       "setmaxnreg",
        "blocks": f"one per SM ({sms} here), each looping over work items",
        "Q buffers": "2: the next item's Q lands during this one",
        "K and V": "rings and barriers of their own",
    }})

# %% [markdown]
# ## 2 · The roles
#
# After the barriers are initialised and one `__syncthreads`, the roles split on the warpgroup
# index. **Warpgroup 0, the producer**, hands registers back; one thread works, the other 127 exit.
# For each work item it publishes the item's index and issues its Q,

# %%
nb.show_lines("11_warpspec", r"if \(wg == 0\) \{  // ---- the producer", r"tma_tile<BR, D>\(Qs")

# %% [markdown]
# then its K and V tiles in the order the consumers use them. Each copy first waits on its buffer's
# `empty` barrier — the wait stage 10's thread 0 took in the middle of its math:

# %%
nb.show_lines("11_warpspec", r"// K and V in the order the consumers need them",
              r"item = gridDim.x \+ atomicAdd")

# %% [markdown]
# **Warpgroups 1 and up, the consumers**, take registers and loop: `begin_item` waits for the next
# item's Q and index (`-1`: none left); the key loop is stage 10's math on 64 rows each, waiting on
# `full` barriers and arriving on `empty` ones, with no copy in it. Under the mask a consumer hands
# back unread the key tiles past its own rows:

# %%
nb.show_lines("11_warpspec", r"auto begin_item", r"^  \};")
nb.show_lines("11_warpspec", r"^  int ring = 0;$", r"^  \}$")

# %% [markdown]
# **What the kernel also carries.** A few more changes let the producer run further ahead; appendix
# 11a derives and measures each:
#
# | mechanism | why |
# |---|---|
# | persistent grid: a block per SM draws work items from a counter | the producer starts the next item while this one is computed: a block's start is paid once |
# | a head's longest causal item first | short items are left to even out the end of the launch |
# | K and V on barriers of their own | K goes back to the producer as soon as S has read it |
# | two Q buffers | the next item's Q lands during this one |
# | two blocks an SM (D = 64, causal, N < 2048) | items are short: one block's loads and stores overlap the other's products |

# %% [markdown]
# ## 3 · `setmaxnreg`: a register budget per role
#
# An SM has 65 536 registers. `__launch_bounds__(384, 1)` — one block of three warpgroups per SM —
# lets every thread hold 65 536 / 384 ≈ 170, rounded down to a multiple of 8: **168** (four
# warpgroups: 128). ptxas compiles each kernel for its cap:

# %%
with nb.unless_missing():
    display(nb.resources("11_warpspec"))

# %% [markdown]
# At run time `setmaxnreg.dec.sync.aligned.u32 N` gives a warpgroup's registers back to the block's
# pool down to N a thread, and `setmaxnreg.inc` takes them up to N, waiting until the pool has them.
# All four warps execute it; N is a multiple of 8 from 24 to 256. The kernel's `Tiles` sets the
# budgets:

# %%
nb.show_source("hopper.cuh", "setmaxnreg_dec")
nb.show_lines("11_warpspec", r"// Registers per thread after setmaxnreg",
              r"static_assert\(PRODUCER_REGS")
warpspec.register_budget(consumers=2)

# %% [markdown]
# The pool is what the block got at launch, 3 × 168 = 504 registers a thread position. The
# producer's loop needs 40, and the two consumers share the rest: (504 − 40) / 2 = **232**. A
# consumer's accumulators alone take 160 at D = 128 — O (64 floats), S (64), P (32 packed pairs) —
# so at the launch cap it would have 8 left for everything else; after `setmaxnreg`, 72.
#
# **Three consumers** start at 128 a thread. With the producer at 40 each would get (512 − 40) / 3 →
# 152, and ptxas serializes the `wgmma`s (its note C7512), even at D = 64 where the accumulators
# take 128: a `wgmma` in flight needs room beyond them. So the producer keeps only **32**, and each
# consumer gets **160**: 32 + 3 × 160 = 512, the whole register file. At D = 128 that is the
# accumulators alone; at D = 64 it leaves 32:

# %%
warpspec.register_figure(consumer_options=(2, 3))

# %%
warpspec.register_figure(consumer_options=(3,), D=64)

# %% [markdown]
# **What the producer costs.** At D = 64 stage 10 computes with four warpgroups an SM: two blocks of
# two, with 128-key tiles. Give each block a producer and each thread starts at 65 536 / 768 → 80
# registers, a pool of 3 × 80 = 240 a thread position. The kernel's counts for that shape are 32 for
# the producer and (240 − 32) / 2 = **104** for each consumer:

# %%
warpspec.register_budget(consumers=2, blocks=2)

# %% [markdown]
# That is below the 128 of a consumer's accumulators with 128-key tiles at D = 64, so there stage 11
# computes with three consumers an SM where stage 10 has four warpgroups (or, under the mask on
# short sequences, with 64-key tiles). At D = 128 without the mask both compute with one block of
# two.

# %% [markdown]
# ## 4 · The work tile
#
# A **work item** is one query tile of one (batch, head). Stage 10 launched a block per item; stage
# 11 launches a block per SM and zeroes a counter first:

# %%
nb.show_lines("11_warpspec", r"FLASHLAB_TRY\(cudaMemsetAsync", r"dim3 grid")

# %% [markdown]
# Block b starts with item b; after an item's copies its producer claims the next with `atomicAdd`
# and stores its index in `work[slot]` before the arrive on Q's barrier, so a consumer that sees Q
# land reads the right index. Both roles turn an index into a batch × head and first query row with
# `work_tile`, your kernel exercise:

# %%
nb.show_source("11_warpspec", "work_tile")

# %% [markdown]
# Two rules set the order. A head's items are consecutive, so the blocks working at the same time
# read the same few heads' K and V, which stay in L2. Under the causal mask a head's longest item
# (its last query tile) comes first, so the items left for the end of the launch are short.
#
# ## 5 · The schedule in time
#
# A model of both kernels on one SM, with assumed proportions at D = 128 (a tile's math about 2,
# a copy about 1 to arrive): three items of three tiles, stage 10 above, stage 11 below:

# %%
warpspec.warpspec_timeline(tiles=(3, 3, 3))

# %% [markdown]
# * **The producer spends almost all its time waiting** (its red lane): that is its job, done
#   instead of a computing warp, with 40 registers a thread.
# * **The consumers wait only for data**, and with copies quicker than the math stage 10's ring was
#   never short either: inside an item both run at the same pace.
# * **Stage 10 pays every item's start** (the red waits at each block's start); stage 11's producer
#   already copies the next item's Q and first K while the consumers finish this one.
#
# ## 6 · What changed
#
# Against stage 10: the register budgets and `setmaxnreg`, the roles split after the barriers, the
# math steps named as lambdas, O stored from registers, and section 2's carried mechanisms:

# %%
nb.show_diff("10_tma", "11_warpspec", context=1)

# %% [markdown]
# ## 7 · Prediction, before measuring
#
# Section 5's model: stage 10's time over stage 11's for items of n key tiles (at D = 128 an item of
# 128 query rows is N / 128 tiles):

# %%
h100 = dict(mma=1.0, softmax=1.0, latency=1.0, load=0.5, q_load=0.25, store=0.25, launch=0.5)
predicted = warpspec.predicted_gain(n_tiles=(4, 8, 16, 32, 64, 128), **h100)
predicted.round(3).to_frame().T

# %% [markdown]
# * **Time.** The math is unchanged, so the gain is what the elected thread and the block per item
#   cost stage 10: about 1.2× for the shortest items, fading over long ones. At the teaching config
#   (D = 64, N = 1024: 8 tiles; stage 10's two blocks an SM hide part of a block's start) 5–15 %,
#   less a ninth: N = 1024 is 5⅓ items of 192 rows, so a ninth of the rows computed are past the
#   end (1.05 · 8/9 to 1.15 · 8/9). Expect **0.93–1.02×**.
# * **Machine code:** `USETMAXREG` twice (the producer's `dec`, the consumers' `inc`), the copies
#   (`UTMALDG`) only in the producer's branch, one `BAR.SYNC`, at the start.
# * **Stall reasons:** the computing warps no longer stop for copies, so their waits on memory and
#   barriers (`long_scoreboard`, where polling an mbarrier is counted, and `barrier`) should fall,
#   and the tensor pipe should be busier.

# %%
gain_band = (0.93, 1.02)

# %% [markdown]
# ## 8 · The machine code

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("10_tma", "11_warpspec")
    display(mix[mix.index.get_level_values("kernel").str.contains("__half")].droplevel("stage").T)

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("11_warpspec", r"USETMAXREG|ATOMG|BAR\.SYNC|UTMACCTL|EXIT",
                                  kernel=r"__half, 128,")))

# %% [markdown]
# `USETMAXREG.TRY_ALLOC.CTAPOOL 0xe8` is the consumers' `setmaxnreg.inc` to 232 (0xe8), retried
# until the producer has returned the registers; `USETMAXREG.DEALLOC.CTAPOOL 0x28` is the producer's
# `dec` to 40. The tensor maps' prefetch (`UTMACCTL.PF`) sits in the producer's branch, `BAR.SYNC`
# is the one `__syncthreads`, the `EXIT`s are the roles ending, and `ATOMG.E.ADD` claims a work
# item. In the counts, O leaves with `STG` from registers, and the `SYNCS` more than double: Q, K
# and V have barriers of their own.
#
# ## 9 · Measure
#
# On a Hopper GPU this builds and checks the stage, then times it in turn with stage 10 and SDPA's
# flash and cuDNN backends, three rounds over. Otherwise: the recorded rows.

# %%
ev = nb.evaluate("11_warpspec")
ev

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    gain = nb.speedup("10_tma", "11_warpspec", "fp16")
    print(f"stage 11: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{gain:.2f}x stage 10; predicted {gain_band[0]:.2f} - {gain_band[1]:.2f}x")
    print(f"bf16: {nb.speedup('10_tma', '11_warpspec', 'bf16'):.2f}x stage 10")

# %% [markdown]
# Both stages' rows at the teaching config, with the spread of their timed runs (p20 and p80):

# %%
with nb.unless_missing():
    display(nb.teaching_rows(["10_tma", "11_warpspec"]))

# %% [markdown]
# Over the sweep: stage 11 over stage 10 and over cuDNN, and stage 10 over cuDNN:

# %%
with nb.unless_missing():
    gains = nb.sweep_ratio("11_warpspec", "10_tma")
    display(gains.round(2))
    print("mean gain by head dim: " + ", ".join(
        f"D={d_}: {g:.2f}x" for d_, g in gains.mean(axis=1).groupby(level="D").mean().items()))
    display(nb.sweep_ratio("11_warpspec", "sdpa_cudnn").round(2))
    display(nb.sweep_ratio("10_tma", "sdpa_cudnn").round(2))
    fa2 = nb.sweep_ratio("11_warpspec", "sdpa_flash")
    print(f"stage 11 over sdpa_flash (FlashAttention-2): {fa2.min().min():.2f}-"
          f"{fa2.max().max():.2f}x")

# %%
plots.scaling(last="11_warpspec")

# %% [markdown]
# ### Discussion
#
# **The teaching config sat at the floor of the band:** 0.93× stage 10 (0.92× in bf16, just below)
# against 0.93–1.02×, every row tight. The model compared the same block in both stages; at D = 64 they do not run the same
# block. The sweep shows both sides of the idea:
#
# * **With the same computing warpgroups, the split pays.** At D = 128 without the mask stage 11 is
#   1.06–1.15× stage 10: 1.14–1.15× up to N = 1024, where a block's start weighs most, and still
#   1.06–1.09× from N = 4096, where the model gives 1.01–1.03. That rest is per tile: the copies and
#   the waits for a free buffer gone from warpgroup 0's path (K's early release, carried, also acts
#   per tile; these timings do not separate the two).
# * **Where the producer's registers cost a warpgroup or tile width, it does not pay.** At D = 64:
#   0.91–1.02× without the mask, 0.95–0.99× with it. At D = 128 under the mask below N = 8192 stage
#   10 runs two blocks of two warpgroups with 64-key tiles; stage 11's consumers would get 104
#   registers there, fewer than their 112 of accumulators (O 64, S 32, P 16). It is 0.94× at N = 512
#   and 0.97× at 1024, and 1.02–1.09× from N = 2048.
#
# A producer warpgroup gives the computing warps their time back and takes registers from them.
# Where registers set the shape, as at D = 64, more plain warpgroups can do better. Against cuDNN
# stage 11 runs at 0.87–1.13×, level or ahead from N = 4096; it is 1.38–2.31× PyTorch's
# FlashAttention-2 backend. Appendix 11a takes the sweep apart shape by shape.
#
# ## 10 · Stall reasons, by role

# %%
idea = list(fl.stage("11_warpspec").idea_metrics)
with nb.unless_missing():
    prof = nb.profile("11_warpspec")
    stall_rows = prof.index[prof.index.str.startswith("stall_")]
    display(prof.loc[[m for m in ["duration_ms", "tensor_pipe_pct", "sm_throughput_pct",
                                  "achieved_occupancy_pct"] if m in prof.index]
                     + list(stall_rows)].round(2))
    if "10_tma" not in prof.columns:
        raise nb.not_recorded("10_tma", " profile (to compare with)", " --profile")
    for m in idea + ["stall_barrier", "achieved_occupancy_pct"]:
        print(f"{m}: {prof.at[m, '10_tma']:.1f}% -> {prof.at[m, '11_warpspec']:.1f}%")
    d10, d11 = prof.at["duration_ms", "10_tma"], prof.at["duration_ms", "11_warpspec"]
    print(f"duration under Nsight Compute: {d10:.4f} -> {d11:.4f} ms ({d10 / d11:.2f}x)")

# %%
plots.stalls(only=["09_wgmma", "10_tma", "11_warpspec"])

# %% [markdown]
# ### Discussion
#
# * **The tensor pipe is about as busy, 46.1 % → 46.4 % of the time, over a longer time** (0.0438 →
#   0.0477 ms under Nsight Compute): three consumers where stage 10 had four warpgroups.
# * **Waiting rose, against the prediction:** `long_scoreboard` 10.1 → 12.3 %, `barrier` 9.0 →
#   9.4 %, `short_scoreboard` 3.1 → 5.5 % of warp time. Count the warps first: occupancy fell from
#   22.6 % to 19.9 % of 64 warps, about 13, twelve consumer warps and the producer's warp 0 (its
#   other three exit at once). That warp is a thirteenth of the warp time, and section 5's model
#   has it waiting on `empty` barriers nearly all of it. Its waiting is its job, but a share of warp
#   time cannot tell it from a consumer's.
# * Fewer warps compete to issue: `not_selected` 13.6 → 10.5 %, `math_pipe_throttle` 3.1 → 1.4 %.
#
# That is the lesson of a specialized kernel: a waiting producer is doing its job. Read stall
# reasons by role, not for the block.

# %% [markdown]
# ## Exercises
#
# ### Lab `11.registers`
#
# Section 3's budget, for a block of four consumers.

# %%
from flashlab.course import labs
print(labs.prompt("11.registers"))

# %%
### BEGIN SOLUTION
threads_four = 128 * (1 + 4)
launch_cap_four = 65536 // threads_four // 8 * 8
consumer_four = (launch_cap_four * (1 + 4) - 40) // 4 // 8 * 8
answer = (launch_cap_four, consumer_four)
### END SOLUTION

# %%
labs.check("11.registers", answer)

# %% [markdown]
# ### Kernel exercise `11.work_tile` (10 points)
#
# **Where:** `work_tile` in `kernels/11_warpspec.cu`, between `// BEGIN EXERCISE 11.work_tile` and
# `// END EXERCISE 11.work_tile`. The stub gives every work item the first query tile of the first
# head: producer and consumers agree on it, so nothing hangs, but every head except the first is
# never computed.
#
# **What to write:** section 4's mapping of item `item` to its batch × head index `bh` (the items of
# a head are consecutive, `tiles` of them) and its first query row `q0`: the query tile
# `item % tiles` times `BR`, counted from the last tile under the causal mask, so that a head's
# longest item comes first.
#
# **How it is judged.** `flashlab grade` builds stage 11 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, the strided layout of a model's projections, and keys whose size grows along
# the sequence, so that every row's maximum keeps rising and each rescale path runs. A wrong kernel
# scores 0, and the message names the first failing case and its first wrong element (batch, head,
# row, column, got, expected). A right one is timed at the teaching config and under the causal
# mask: when your instructor grades, in turn with the solution's stage on the same GPU, the slower
# of the two ratios counting; when you check your own work, against the solution's recorded speedup
# over stage 10. Full points within 5 % of the solution's speed, fewer below. Any mapping that
# computes every item once is right; the order is scored by the time under the causal mask, where a
# head's query tiles differ in length.
#
# **GPU:** compute capability 9.0 (H100, H200, GH200); elsewhere `flashlab grade` skips it with one
# line saying why. Run it with
#
#     flashlab grade --exercise 11.work_tile

# %% [markdown]
# ## Questions for discussion
#
# 1. The producer warpgroup has 128 threads and one of them works. A block of two consumer
#    warpgroups and a single producer *warp* (288 threads) would need no `setmaxnreg`: what would
#    each thread hold, and what would the producer warp cost in registers?
# 2. With two blocks an SM the kernel's producer keeps 32 registers. Would a producer that needed
#    only 24, `setmaxnreg`'s smallest count, let each consumer hold 128-key tiles at D = 64?
# 3. Appendix 11a measured 1 200–1 400 cycles of softmax a tile at D = 128 for a consumer beside the
#    other one; the other consumer's two products for its tile keep the tensor cores busy for about
#    1 024. If the consumers took turns at the tensor cores, would one's products hide the other's
#    softmax?

# %% [markdown]
# **Instructor's answer.** *1.* 65 536 / 288 ≈ 227: 224 a thread at launch, nearly the consumers'
# 232 without `setmaxnreg`. The producer warp would hold 32 × 224 = 7 168 registers, against 128 ×
# 40 = 5 120 for the producer warpgroup after `setmaxnreg.dec`: about the same. (`wgmma` needs
# warpgroups starting at a multiple of four warps, so the warp would come after the consumers.) A
# producer warpgroup is what lets the budget move at run time, and its idle warps could later be
# given work without changing it.

# %% [markdown]
# **Instructor's answer.** *2.* No. The pool is 3 × 80 = 240 a thread position; with the producer at
# 24 each consumer would get 216 / 2 = 108, rounded down to a multiple of 8: 104, what the kernel's
# 32 already gives. A consumer of 128-key tiles at D = 64 needs 128 for its accumulators alone.

# %% [markdown]
# **Instructor's answer.** *3.* Not yet. While consumer A exponentiates, the tensor cores can run
# B's two products and A's own P·V: about 1 024 + 512 cycles. A's softmax alone, 1 200–1 400 cycles,
# would fit, but its rescale, packing and waits come on top, so the tensor cores would still idle
# for part of every turn. The instructions between a consumer's two products must get fewer first.

# %% [markdown]
# ## Summary
#
# - A producer warpgroup issues every copy and takes every wait for a free buffer; consumer
#   warpgroups only compute and wait only for data.
# - `setmaxnreg` moves registers between the roles at run time: 40 for the producer and 232 for each
#   of two consumers at D = 128 (the launch cap: 168); 32 and 160 for each of three at D = 64.
# - With the same computing warpgroups as stage 10 (D = 128, no mask) the split is worth 1.06–1.15×.
#   Its price is the producer's registers: at D = 64 they cost stage 10's fourth warpgroup an SM (or
#   half-width tiles), and stage 11 is 0.91–1.02× stage 10 (0.93× at the teaching config).
# - A waiting warp may be doing its job: read stall reasons by role.

# %%
nb.reached("11_warpspec")
