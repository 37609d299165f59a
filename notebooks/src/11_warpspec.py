# %% [markdown]
# # Stage 11 — warp specialization: one warpgroup copies, the others compute, and the grid stays resident
#
# In stage 10 one thread does two jobs: it is a computing thread of warpgroup 0, and it issues every
# copy of its block. Between its own `S = Q Kᵀ` and its softmax it may have to wait for a buffer to
# come free, and its warpgroup waits with it. Hopper lets a block give its warps different jobs and
# different budgets: a **producer** warpgroup that only issues TMA copies and gives most of its
# registers away with **`setmaxnreg`**, and **consumer** warpgroups that only compute, holding the
# registers the producer gave up. The block also stops being one work item: a **persistent** grid of
# one block per SM draws items from a counter, so the next item's copies land while this one is
# computed.
#
# ## Objectives
# After this notebook you can:
# - say what stage 10's elected thread costs, and which waits a producer warpgroup takes over;
# - split a block's 65 536 registers between roles with `setmaxnreg`, and say why three consumers
#   fit at D = 64 and not at D = 128;
# - follow a persistent grid's work counter, and say why a head's longest causal items go first;
# - read a producer/consumer schedule: K and V on their own barriers, Q double-buffered across work
#   items;
# - predict what the split buys, and check it in the machine code, the timings and the stall
#   reasons.
#
# **Prerequisites:** notebook 10 (TMA, mbarriers, the ring of full and empty barriers) and
# notebook 09 (`wgmma`); notebook 07's pipelines. The kernel needs a Hopper GPU (H100, H200,
# GH200); elsewhere this notebook replays the numbers recorded on one.
#
# **Time:** about 25 min to read, 45 min to work through.

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
# * **It waits in the middle of its math.** `empty` completes only when every warp of the block,
#   the other warpgroup's too, has released the old buffer. Until then thread 0 cannot go on to its
#   softmax, and since a `wgmma` is issued by all four warps of a warpgroup together, warpgroup 0's
#   next product waits for it as well.
# * **Every warp is sized for the math.** The copier is one of the computing threads, so it holds
#   as many registers as they do; a block cannot give copying and computing different budgets.
# * **A block is one work item.** It starts, loads Q and its first tile, computes, stores O and
#   ends; the next block starts only then. At D = 128 a block takes 225 KiB of shared memory, one
#   per SM: nothing hides a block's start and its first round trip to memory.
#
# Stage 11 keeps stage 10's math and changes who does what:

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
# The block is three warpgroups at D = 128, four at D = 64 (section 3). After the barriers are
# initialised and `__syncthreads`, the roles split on the warpgroup index. **Warpgroup 0, the
# producer**, hands back registers and elects one thread; the other 127 have nothing to do and
# exit. The elected thread walks the work items: for each it publishes the item's index and issues
# Q:

# %%
nb.show_lines("11_warpspec", r"if \(wg == 0\) \{  // ---- the producer", r"tma_tile<BR, D>\(Qs")

# %% [markdown]
# then the item's K and V tiles, in the order the consumers use them: `K_0`, then `K_j` with
# `V_{j−1}` (a consumer multiplies P·V of tile j − 1 right after it has S of tile j), then the last
# V, and then it claims its next item (section 4). Each copy first waits until its buffer has been
# released:

# %%
nb.show_lines("11_warpspec", r"// K and V in the order the consumers need them",
              r"item = gridDim.x \+ atomicAdd")

# %% [markdown]
# **Warpgroups 1 and up, the consumers**, take registers and then loop: `begin_item` waits for the
# next item's Q (and with it the item's index, `-1` when there is none), and the K/V loop is stage
# 10's math on 64 rows each, waiting on `full` barriers and arriving on `empty` ones. Under the
# causal mask a consumer runs only the key tiles up to its own last row, `n_mine`, as stage 10's
# warpgroups skipped the tiles past theirs; the item's later tiles it hands back unread, each once
# it has landed (the producer refilled that buffer only after every consumer had released its
# previous use, so this release counts toward this one):

# %%
nb.show_lines("11_warpspec", r"auto begin_item", r"^  \};")
nb.show_lines("11_warpspec", r"^  int ring = 0;$", r"^  \}$")

# %% [markdown]
# K and V now have barriers of their own, so a consumer releases `K_j` as soon as `S_j` has
# retired — stage 10 could free a buffer only once the *next* tile's S had retired, because P·V
# still read V from it. The barriers, each completing one phase per round of its ring (parity
# `(r / STAGES) & 1` for ring position r, as in notebook 10):

# %%
pd.DataFrame([
    ("q_full[2]", "1 (the producer's arrive.expect_tx) + Q's bytes",
     "consumers, in begin_item", "item it's Q has landed, and work[it % 2] holds its index"),
    ("q_empty[2]", "4 × CONSUMERS (a warp each)", "producer, before item it + 2's Q",
     "every consumer warp's last S of item it has retired"),
    ("k_full[STAGES]", "1 + K's bytes", "consumers, before S", "K_j has landed"),
    ("k_empty[STAGES]", "4 × CONSUMERS", "producer, before refilling",
     "S_j has retired in every consumer warp"),
    ("v_full[STAGES]", "1 + V's bytes", "consumers, before P·V", "V_j has landed"),
    ("v_empty[STAGES]", "4 × CONSUMERS", "producer, before refilling",
     "P·V of V_j has retired (seen at S_{j+1}'s wait, or at the item's end)"),
], columns=["mbarrier", "arrivals a phase", "waited on by", "a completed phase means"]).set_index(
    "mbarrier")

# %% [markdown]
# The producer runs ahead of the math as far as the buffers allow, across items too: Q has two
# buffers, so item it + 1's Q is copied while item it is computed; it waits only for item it − 1
# to be done with the other one. O goes from the consumers' registers straight to global memory
# (the Q buffer it went through in stage 10 belongs to a later item by then).
#
# ## 3 · `setmaxnreg`: registers where the work is
#
# An SM has 65 536 registers. A kernel launched with `__launch_bounds__(384, 1)` — one block of
# three warpgroups per SM — lets every thread hold at most 65 536 / 384 ≈ 170, rounded down to a
# multiple of 8: **168** (with four warpgroups, 512 threads: 128). ptxas compiles each kernel for
# its cap and reports it:

# %%
with nb.unless_missing():
    display(nb.resources("11_warpspec"))

# %% [markdown]
# At run time a warpgroup can move its threads' allocation: `setmaxnreg.dec.sync.aligned.u32 N`
# gives registers back to the block's pool down to N a thread, `setmaxnreg.inc` takes them up to N
# (waiting until the pool has them). All 128 threads of the warpgroup execute it together, N is a
# multiple of 8 from 24 to 256, and it only acts in a kernel that has a register cap at launch.
# `kernels/hopper.cuh` wraps both, and the kernel's `Tiles` sets the budgets:

# %%
nb.show_source("hopper.cuh", "setmaxnreg_dec")
nb.show_lines("11_warpspec", r"// Registers per thread after setmaxnreg",
              r"static_assert\(PRODUCER_REGS")
warpspec.register_budget(consumers=2)

# %% [markdown]
# `setmaxnreg` moves registers only within the block: its pool is what the block was given at
# launch, 168 for each of its 384 threads, 64 512 of the SM's 65 536. The producer's loop needs 40
# registers without spilling; the two consumers share the rest of its three warpgroups' 3 × 168 =
# 504 a thread position, (504 − 40) / 2 = **232**: 128 × (40 + 2 × 232) = 64 512. A consumer thread's accumulators alone take 160 registers at D = 128 — O (64 floats), S
# (64) and P (32 packed pairs) — so at the launch cap of 168 it would have 8 left for everything
# else; after `setmaxnreg` it has 72.
#
# **Three consumers** make 192 query rows a block. A block of 512 threads starts at 128 registers
# a thread. With the producer at 40, a consumer gets (512 − 40) / 3 → 152, and ptxas cannot keep a `wgmma`'s accumulators in flight while the next
# one is issued. It says so when it compiles such a kernel: *"Potential Performance Loss:
# wgmma.mma_async instructions are serialized due to insufficient register resources"* (its notes
# C7511 and C7512). It does so at D = 64 as well, where the accumulators (128) would fit in 152: a
# `wgmma` pipeline needs room beyond them. So the producer gives up more. Its loop fits in **32**
# registers once it claims its next work item after issuing the copies rather than before (one
# value fewer held across them), and each consumer then gets **160**: 32 + 3 × 160 = 512, the whole
# register file. At D = 128 that is exactly the accumulators, with no room left; at D = 64 it
# leaves 32 (the figures draw the accumulators of 128-key tiles):

# %%
warpspec.register_figure(consumer_options=(2, 3))

# %%
warpspec.register_figure(consumer_options=(3,), D=64)

# %% [markdown]
# **Two blocks an SM.** `__launch_bounds__(384, 2)` asks for two blocks of three warpgroups on each
# SM. Each then starts at 65 536 / 768 ≈ 85 registers a thread, 80 once rounded down to a
# multiple of 8, and its pool is 3 × 80 = 240 a thread position: with the producer at 32, each of
# two consumers gets (240 − 32) / 2 = **104**. That holds a consumer of 64-key tiles at D = 64 — O
# (32 floats), S (32) and P (16 pairs), 80 in all — but not with a `wgmma` in flight across the
# next one: with S issued while the previous tile's P·V still reads P, ptxas serializes every
# `wgmma` below 112 registers. So in this shape a consumer retires that P·V before it issues the
# next S (the `if (BLOCKS == 2) wgmma_wait<0>()` in the loop above): the wait costs its own
# warpgroup a little, and the other block's warpgroups keep the tensor cores busy meanwhile.

# %%
warpspec.register_budget(consumers=2, blocks=2)

# %% [markdown]
# So stage 11 runs two consumers at D = 128, the warpgroups stage 10 computes with there, each now
# without the copies. At D = 64 it runs three consumers of 128-key tiles in one block, and under the
# mask on short sequences two blocks of two consumers with 64-key tiles. Neither is stage 10's shape
# at D = 64: two blocks an SM of two warpgroups with 128-key tiles, 122 registers a thread with
# P·V retired before S. A producer in each of two blocks leaves each consumer at most
# (240 − 24) / 2 = 108 registers, even with the smallest producer `setmaxnreg` allows. The
# producer's warpgroup costs registers, and at D = 64 that decides the shape. `pick()` says where:

# %%
nb.show_source("11_warpspec", "pick")

# %% [markdown]
# Under the causal mask below N = 2048 at D = 64 an item has only a few key tiles, and three
# consumers pay least: N = 512 is 2⅔ items of 192 rows, and the last item's third consumer runs
# every key tile of the sequence for rows past N that are never stored. There stage 11 runs two
# blocks on each SM, each of two consumers of 64 rows with 64-key tiles and a producer. Timed in turn on an H100 (fp16, `data/runs/hopper-try-20261127T0731Z-two-blocks-own-tiles.log`),
# at N = 512 and 1024 under the mask: 235 and 310 TFLOP/s with two blocks an SM, against 225 and
# 304 for one block of two consumers with 128-key tiles. Without the mask the third consumer's
# softmax gains more than its rows past the end cost: three consumers over two, 1.02× at N = 512
# and 1024 and 1.11–1.16× from N = 2048
# (`data/runs/hopper-try-20261127T0123Z-d64-consumers-past-end.log`).
#
# ## 4 · A persistent grid and a work counter
#
# A **work item** is one query tile of one (batch, head): 64 query rows per consumer, 128 or 192
# in all. Stage 10 launched one block per item; stage 11 launches one block per SM (two in the
# shape above), or fewer if there are fewer items, and zeroes a counter in global memory first:

# %%
nb.show_lines("11_warpspec", r"FLASHLAB_TRY\(cudaMemsetAsync", r"dim3 grid")

# %% [markdown]
# Block b starts with item b. Once its producer has issued an item's copies it claims the next with
# `atomicAdd` (`gridDim.x +` the counter's old value), and with that item's Q it hands the index to
# the consumers: it stores it in shared memory (`work[slot]`) before the arrive on Q's barrier, so a
# consumer that sees Q's phase complete reads the right index. An index past the last item is
# published as `-1` with an arrive that carries no bytes, and the consumers stop. Which query tile
# an item is decides the order the work comes in:

# %%
nb.show_source("11_warpspec", "work_tile")

# %% [markdown]
# * **A head's items are consecutive.** The blocks working at the same time read the same few
#   heads' K and V, which stay in L2.
# * **Under the causal mask the longest item of a head comes first.** Query tile t reads key tiles
#   0 … t, so the last query tile is the longest. Handing out long items first leaves short ones for
#   the end of the launch, where they fill the gaps.
#
# Here is why a counter matters, on a toy GPU of 8 SMs with 4 heads of 8 causal query tiles (an
# item's time: the key tiles it reads). A persistent grid *without* a counter hands out items
# statically, block b taking b, b + G, b + 2G, …; with G a multiple of the tiles per head, every
# block gets the same query tile of every head, and the block with the longest ones finishes last:

# %%
warpspec.claim_figure(heads=4, tiles=8, blocks=8)

# %% [markdown]
# The counter balances the blocks, and handing out long items first balances them further. It comes
# close to the last panel, stage 10's grid of one block per item, where the hardware's block
# scheduler starts each block on the first SM that frees up. Stage 11's producer claims its next
# item once it has issued the current item's last copies: that waits for a free buffer, so it
# comes about a ring's depth of key tiles (two here) before the item ends, early enough for the next
# item's Q and first K to land in time, late enough that a block rarely holds a long item that
# another block would have finished sooner. On the sweep's causal shapes, with this GPU's SMs (work
# in key tiles and items of 64 rows per consumer as `pick()` launches the stage: 192 rows and
# 128-key tiles at D = 64 from N = 2048, at N = 512 128 rows and 64-key tiles on two blocks an
# SM, 128 rows and 128-key tiles at D = 128; `… over even`: how much later than all the work
# spread evenly):

# %%
def items(D, N):
    """(heads, query tiles, rows, keys, N) of stage 11 under the mask, as its pick() runs it, and
    its blocks an SM."""
    shape = picks.shape("11_warpspec", D, True, N)
    rows = 64 * shape["CONSUMERS"]
    return (16384 // N * (2048 // D), -(-N // rows), rows, shape["BC"], N), shape.get("BLOCKS", 1)


causal_shapes = {(D, N): items(D, N) for D in (64, 128) for N in (512, 2048, 8192, 16384)}
spans = pd.concat([warpspec.claim_makespans([shape], blocks=sms * per_sm)
                   for shape, per_sm in causal_shapes.values()])
spans.index = pd.MultiIndex.from_tuples(list(causal_shapes), names=["D", "N"])
spans[["items", "even_split", "static over even", "counter over even",
       "hardware over even"]].round(3)

# %% [markdown]
# A static split loses anything from 8 to 80 %, depending on how a head's tiles line up with the
# number of SMs. The counter stays within about 1–7 % of an even split whatever the shape, as the
# hardware's scheduling of separate blocks does. What the persistent block buys on top is in the
# next figure.
#
# ## 5 · The schedule in time
#
# A discrete-event model of both kernels on one SM, in illustrative units with the proportions
# notebook 10 gave for D = 128 on an H100 (a tile's math about 2 µs, a copy about 1 µs to
# arrive): three work items of three tiles. Stage 10 above, a block per item; stage 11
# below, with the producer's copies, its two Q buffers held from Q's copy to the item's last S,
# and the two consumers:

# %%
warpspec.warpspec_timeline(tiles=(3, 3, 3))

# %% [markdown]
# * **Stage 10 pays every item's start**: the block starts, its Q and first tile make a round trip
#   to memory, and only then does the math begin (the long red waits at each block's start); its
#   O is stored before the next block can begin.
# * **Stage 11 pays it once.** Item 1's Q and first K land while item 0 is still computed, so
#   the consumers go from one item's store straight to the next item's S.
# * **The producer spends almost all its time waiting** (its red lane): that is its job, and it
#   waits instead of a computing warp. Its thread holds 40 registers to do it (32 beside three
#   consumers).
# * Inside an item both kernels run the same math at the same pace here: with a copy quicker than
#   a tile's math, stage 10's ring (one tile of lookahead) was already never short of data.
# * The two consumers run in step: both wait for the same tiles, multiply together and
#   exponentiate together, so during their softmax the tensor cores have nothing to do.

# %% [markdown]
# ## 6 · What changed
#
# Against stage 10: the `Tiles` of a producer and consumers with their register budgets, the
# `setmaxnreg` calls (wrapped in `kernels/hopper.cuh`), `work_tile`, the roles split after the
# barriers (the producer's loop over items, the consumers' `begin_item`), stage 10's steps of the
# math named as lambdas, the skipped tiles handed back unread, O stored from registers, the
# persistent launch with its counter, and a second block an SM in one shape. The math itself is
# stage 10's:

# %%
nb.show_diff("10_tma", "11_warpspec", context=1)

# %% [markdown]
# ## 7 · Prediction, before measuring
#
# The model of section 5 puts a number on the per-item saving. Stage 10's time over stage 11's
# for items of n K/V tiles, at the same proportions (at D = 128 an item of 128 query rows is
# N / 128 tiles: N = 512 is 4, N = 16384 is 128):

# %%
h100 = dict(mma=1.0, softmax=1.0, latency=1.0, load=0.5, q_load=0.25, store=0.25, launch=0.5)
predicted = warpspec.predicted_gain(n_tiles=(4, 8, 16, 32, 64, 128), **h100)
predicted.round(3).to_frame().T

# %% [markdown]
# * **Time.** The math is unchanged, so the gain is what the elected thread and the block per item
#   cost stage 10: by the model about 1.2× for the shortest items, fading to nothing at 128 tiles,
#   where one prologue is spread over a long item. At the teaching config (D = 64, N = 1024: 8
#   tiles an item; stage 10 runs two blocks an SM there, which hides part of a block's start)
#   that is 5–15 %, less the rows past the end: three consumers make N = 1024 5⅓ items of 192
#   rows, and the last item's second and third consumers compute 128 rows that are never stored,
#   a ninth more work. Expect 1.05/1.11 to 1.15/1.11: **0.95–1.04×**.
# * **Machine code:** `USETMAXREG` twice (the producer's `dec`, the consumers' `inc`), an atomic
#   add on the counter, the copies (`UTMALDG`) only in the producer's branch, one `BAR.SYNC` (at
#   the start, once per block, not per item).
# * **Stall reasons:** the computing warps no longer stop for copies, so their waits on memory and
#   barriers (`long_scoreboard`, where polling an mbarrier is counted, and `barrier`) should fall,
#   and the tensor pipe should be busier.

# %%
gain_band = (0.95, 1.04)

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
# `USETMAXREG.TRY_ALLOC.CTAPOOL 0xe8` is the consumers' `setmaxnreg.inc.u32 232` (0xe8): try to
# take registers from the block's pool, and retry until the producer has returned them;
# `USETMAXREG.DEALLOC.CTAPOOL 0x28` is the producer's `dec` to 40 (in the D = 64 kernel with three
# consumers, `0xa0` and `0x20`: 160 and 32; in the one of two blocks an SM, `0x68` and `0x20`: 104
# and 32). `ATOMG.E.ADD` is the claim,
# `UTMACCTL.PF` the tensor maps' prefetch, now in the producer's branch, `BAR.SYNC` the one
# `__syncthreads` before the roles split, and the `EXIT`s are the roles ending: the producer's
# idle threads at once, its elected thread and the consumers after the last item. In the counts
# above, the `UTMALDG` copies all sit in the producer's branch; the `SYNCS` (waits and arrivals)
# are five to six times stage 10's: K, V and Q each have their own barriers, and a consumer also
# waits for and releases the tiles past its rows under the mask. O is written with `STG` from
# registers instead of `STS` and `LDS.128` through shared memory.

# %% [markdown]
# ## 9 · Measure
#
# On a Hopper GPU this builds the stage, checks it against a float64 reference, then times it
# together with stage 10 and SDPA's flash and cuDNN backends, run by run in turn at each config (the
# teaching configs, then the FlashAttention sweep), three rounds over, as `flashlab run` does, so
# that their ratios come from one run. Otherwise: the recorded rows.

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
# Both stages' rows at the teaching config, each with the spread of its timed runs (p20 and p80:
# a fifth of the runs were faster, a fifth slower):

# %%
with nb.unless_missing():
    display(nb.teaching_rows(["10_tma", "11_warpspec"]))

# %% [markdown]
# Over the sweep: stage 11 over stage 10, then over cuDNN's attention, PyTorch's fastest, and
# where stage 10 stood against cuDNN:

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
# One more count for the discussion. Under the causal mask, how many query-key scores a block
# computes per head, each stage with the tiles its `pick()` launches at D = 64 (stage 10: 64-key
# tiles for one warpgroup below N = 1024, 128-key for two from there; stage 11: 64-key tiles for
# two consumers below N = 2048, 128 for three from there). A warpgroup of either computes the key
# tiles up to its own last row:

# %%
def scores_computed(N, BC, rows=64, groups=2, skip=False):
    """Query-key scores computed for one head under the causal mask: items of `groups` warpgroups
    of `rows` rows; a warpgroup computes the key tiles up to its item's last row, or with `skip`
    only those up to its own last row."""
    BR, total = rows * groups, 0
    for q0 in range(0, N, BR):
        for g in range(groups):
            last = min(N, q0 + (g + 1) * rows if skip else q0 + BR)
            total += rows * math.ceil(last / BC) * BC
    return total


def stage_scores(slug, N):
    """scores_computed for a stage's shape at D = 64 under the mask, as its pick() launches it:
    keys per tile, and warpgroups (stage 10) or consumers (stage 11) a block."""
    shape = picks.shape(slug, 64, True, N)
    groups = shape.get("CONSUMERS", shape.get("WGS"))
    return scores_computed(N, shape["BC"], groups=groups, skip=True)


pd.Series({N: stage_scores("11_warpspec", N) / stage_scores("10_tma", N)
           for N in (512, 1024, 2048, 4096)},
          name="stage 11 / stage 10 scores, D = 64, causal").round(3)

# %% [markdown]
# ### Discussion
#
# **Time.** Predicted 0.95–1.04× at the teaching config, and over the sweep a gain that fades with
# the length of an item. Measured over the sweep, with both stages timed in turn in this run: at
# D = 128 1.06–1.15× without the mask and 0.94–1.09× under it (1.07× on average), and at D = 64
# 0.91–1.02× (0.97×): there stage 11 is slower than stage 10 at every length but the two longest
# without the mask. The run recorded in `data/` gave
# the same table to within 0.02. The prediction holds at D = 128 without the mask and misses
# elsewhere, because the model compared the same block in both stages, and where it misses the
# two stages do not run the same block.
#
# * **At D = 128 without the mask the gain fades, but less than the model says.** It is
#   1.14–1.15× up to N = 1024 and still 1.06–1.09× from N = 4096 on, where the model gives 1.01
#   for long items. An item of 128 tiles pays one prologue; what is left is per tile, and the
#   model had none because, with its copies quicker than a tile's math, stage 10's ring was never
#   short of data. Give the model copies slightly slower than a tile's math (below) and stage 10's
#   warpgroups wait a little before every tile while stage 11's do not: K and V on their own
#   barriers, K released right after S, let the producer load further ahead with fewer buffers
#   (two of K and two of V against stage 10's three pairs). Under a whole GPU's load that is
#   plausible; these measurements alone do not separate it from the other per-tile change, the
#   copy instructions and the wait on `empty` gone from warpgroup 0's path.
# * **At D = 128 under the mask the gain grows with the length:** 0.94× at N = 512, 0.97× at
#   1024, then 1.02–1.09×. Below N = 8192 stage 10 runs two blocks an SM of two warpgroups with
#   64-key tiles: four computing warpgroups an SM, and tiles on the diagonal half as wide. Stage
#   11 runs one block of two consumers with 128-key tiles. It cannot run two: a producer and two
#   consumers in each of two blocks leave a consumer 104 registers, too few for O and S at
#   D = 128. With 64-key tiles in its one block it measured 0.95× its own shape at N = 512 and
#   0.84–0.89× from N = 1024 (timed in turn on the H100): half-width tiles do not pay without the
#   extra warpgroups. Where a head is a few items, the second block's warpgroups are worth more
#   than the copies leaving the computing warps; from N = 2048 the loop is long enough for
#   specialization to win.
# * **At D = 64 the producer's registers decide.** Stage 10 runs four warpgroups on each SM, two
#   blocks of two with 128-key tiles (under the mask at N = 512, four blocks of one with 64-key
#   tiles). Stage 11 cannot (section 3): it runs three consumers of 128-key tiles in one block, or
#   under the mask on short sequences two blocks of two consumers with 64-key tiles. Three computing
#   warpgroups an SM instead of four, or tiles half as wide, cost more than the copies leaving the
#   computing warps save, except on the longest sequences without the mask (1.02× from N = 8192).
#   Under the mask the count above adds to it: with 128-key tiles for 192-row items, stage 11
#   computes 6 % more scores than stage 10 at N = 2048 and 4096. At N = 1024 it computes 6 % fewer,
#   with 64-key tiles, and is still 0.96× stage 10: half-width tiles pay the per-tile work (the
#   barriers, the loop, the waits) twice per key. At N = 512 both run 64-key tiles and compute as
#   many scores; stage 11's two blocks of two consumers and a producer run 0.95× as fast as stage
#   10's four blocks of one warpgroup, which give no registers to a producer.
# * **Without the mask at N = 512 and 1024 (0.91–0.92×)** there is also the work past the end:
#   three consumers make N = 512 2⅔ items of 192 rows and N = 1024 5⅓, and the last item's idle
#   consumers still compute rows that are never stored (section 4).
#
# The lesson is the cost side of specialization. A producer warpgroup gives the computing warps
# their time back, and takes registers from them. Where registers set the shape, as at D = 64 on
# this GPU, more plain warpgroups that each load their own tiles can do better. The scheduling of
# the next stage is what has to win the time back.
#
# **The teaching config** is one launch of about 50 µs at D = 64, N = 1024: predicted 0.95–1.04×,
# measured 0.93× (0.92× in bf16; 0.93× and 0.93× in the recorded run), every row tight (the check
# above): below the band, for the reason above.
#
# Such a launch is barely longer than the host's work to make it. This stage's Python wrapper and
# launch function spend 35–56 µs per call on the H100's host (checks, the output and the
# counter's allocation, three tensor maps, a memset, the launch; notebook 99 records it), against
# 0.05 ms of GPU time. Timed naively, with an event before and after each call, the GPU sits idle
# whenever the host falls behind, and the event pair then measures Python as well as the kernel.
# `fl.bench` queues its runs behind a GPU sleep and drops any run whose start the GPU reached
# before the call was queued (notebook 00). In a model, the same cost is why short kernels are
# launched from CUDA graphs.
#
# **Against cuDNN** stage 11 runs at 0.87–1.14× here (0.87–1.14× in the recorded run): level with
# it or ahead from N = 4096 on (1.00–1.13×; at D = 64, 1.03–1.13×), and 0.87–0.98× at N = 512,
# where an item is a few tiles and everything that is not the loop weighs most. Against PyTorch's
# FlashAttention-2 backend (`sdpa_flash`) it is 1.38–2.31× faster.
#
# The model again, with a copy that takes longer than a tile's math to arrive (latency 1.5 and
# bytes 0.75 against 2 of math):

# %%
slow = dict(h100, latency=1.5, load=0.75)
display(warpspec.predicted_gain(n_tiles=(4, 8, 16, 32, 64, 128), **slow).round(3).to_frame().T)
warpspec.warpspec_timeline(tiles=(3, 3, 3), **slow)

# %% [markdown]
# ## 10 · Stall reasons

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
# * **The tensor pipe is about as busy, 46.1 % → 46.4 % of the time, over a longer time** (0.0438
#   → 0.0477 ms under Nsight Compute). At this shape stage 11 computes with three consumers of 64
#   rows, and N = 1024 is 5⅓ items of 192 rows: its tensor cores also multiply the 128 rows past the
#   end, a ninth more work, and stage 10's four warpgroups an SM are three.
# * **Waiting rose, against the prediction:** `long_scoreboard` 10.1 → 12.3 %, `barrier` 9.0 →
#   9.4 %, `short_scoreboard` 3.1 → 5.5 % of warp time. Count the warps before reading the shares.
#   A stage 11 block keeps thirteen warps alive — twelve consumer warps and the producer's warp 0
#   (its other three warps exit at once) — where stage 10 ran two blocks of eight on an SM
#   (occupancy 22.6 % → 19.9 % of 64 warps). The producer's warp is a thirteenth of the warp time,
#   and it spends nearly all of it waiting on `empty` barriers, as its red lane in section 5 did:
#   by itself about 7 of these points. Its waiting is not time lost — it has nothing else to do —
#   but a share of warp time cannot tell it from a consumer's. The rest is the consumers', whose
#   three warpgroups wait for the same tiles and, at each warpgroup-wide `wgmma`, for their four
#   warps. Nsight Compute's source view, which splits the stall samples by instruction, would say
#   which waits belong to which role.
# * Fewer warps compete to issue: `not_selected` fell from 13.6 % to 10.5 %, and
#   `math_pipe_throttle` from 3.1 % to 1.4 %.
#
# The prediction's mistake is the lesson of a specialized kernel: its warps have different jobs,
# and a waiting producer is doing its job. Read stall shares by role, not for the block.

# %% [markdown]
# ## 11 · What is next
#
# Each consumer still runs a tile strictly in order: products, wait, softmax, products. The
# softmax is the longest of these steps. While one consumer exponentiates, only the other's
# products can keep the tensor cores busy. FlashAttention-3 schedules against that in two ways.
# The two consumers take turns at the tensor cores (ping-pong), so that one's softmax runs under
# the other's products. Inside a consumer, the softmax of tile j runs while the product of tile
# j − 1 is still in flight.
#
# Measure before building either. Read from the SM's clock, a stage 11 consumer at D = 128,
# N = 4096 spends these cycles on one key tile (fp16, H100; the two consumers of block 0):
#
# | K wait | issue S | S wait | softmax | rescale O, pack P | V wait | issue P V | period |
# |---|---|---|---|---|---|---|---|
# | 124 / 136 | 383 / 282 | 574 / 578 | 1402 / 1214 | 208 / 299 | 104 / 111 | 166 / 288 | 3188 |
#
# The other consumer's two products for its tile, 2 × 64·128·128 multiply-adds, keep the tensor
# cores busy for about 1 024 cycles at their peak of 4 096 FLOP a cycle per SM, and a consumer's
# own P V, run under its softmax, 512 more. Taking turns hides a softmax only if, with its
# rescale, packing and waits, it is shorter than that. The softmax alone takes 1 200–1 400
# cycles here, and with the rest about 1 600–1 700.
#
# Why is it so long? Its 66 exponentials are not the reason: one warp on each sub-partition
# exponentiates at 8.35 cycles a warp instruction, the special-function unit's full rate (16
# results a cycle per SM), so they need about 550 cycles. With one consumer warpgroup and no
# products running during its softmax, the same softmax takes 950 cycles. Beside a second
# warpgroup's products it takes half as long again. cuDNN's attention kernel has the same shape
# as stage 11: 384 threads, one block per SM, the same count of exponentials. At D = 128 and
# N = 4096 its tensor pipe is active 76 % of the time, against stage 11's 74 %. Where it leads
# (short sequences, D = 64), its warps wait at barriers about twice as often as stage 11's: its
# warpgroups take turns. So the turns can pay on this GPU, but only once the softmax fits under
# the other consumer's products. Fewer instructions on its critical path, or wider key tiles that
# spread its fixed costs over more keys, come first.
#
# One cost is not in the table, because it is paid once per work item, not per tile: the end of
# an item, where each consumer stores O from its registers before it starts the next. At N = 512
# an item is four tiles long, and that is where stage 11 trails cuDNN most. Stage 12 starts
# there.

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
# 2. Why does Q need two buffers for the producer to run ahead across items? What would one buffer
#    cost, and what would three buy?
# 3. The producer claims its next item once it has issued the current item's copies, a couple of
#    key tiles before the item ends. What would claiming as it starts an item (before its copies)
#    cost at the end of a launch, and what would claiming only once the consumers are done cost?
# 4. Under the causal mask a consumer skips the key tiles past its own rows, as stage 10's
#    warpgroups did. What must it still do for a tile it skips? At which shapes does the skip never
#    apply, and where does it pay most?
# 5. Section 11's trace gives a consumer 1 200–1 400 cycles of softmax a tile and the other
#    consumer's products about 1 024. Draw two tiles of a ping-pong schedule for the two consumers:
#    where are the tensor cores idle, and how short must the softmax (with its rescale and
#    packing) become before they are not?

# %% [markdown]
# **Instructor's answer.** *1.* 65 536 / 288 ≈ 227, so 224 registers a thread at launch — almost
# the consumers' 232, with no `setmaxnreg` at all. The producer warp would hold 32 × 224 = 7 168
# registers for a loop that needs 40 a thread, against 128 × 40 = 5 120 for stage 11's producer
# warpgroup after `setmaxnreg.dec`: nearly the same. (The warp would have to come after the
# consumers: a warpgroup for `wgmma` is four warps starting at a multiple of four.) `setmaxnreg`
# acts on whole warpgroups, so a producer *warpgroup* is what lets the budget move at run time;
# its three idle warps hold only 40 registers a thread, and a later kernel can give them work
# (storing O with TMA, say) without changing the budget.

# %% [markdown]
# **Instructor's answer.** *2.* The producer may overwrite a Q buffer only after every consumer's
# last S of the item that used it. With one buffer, item it + 1's Q could only be copied after item
# it's last S: the consumers would wait a whole round trip for Q at every item, the cost stage 10
# paid per block. With two, Q of item it + 1 is copied during item it. A third would let the
# producer run two items ahead, which buys nothing while an item takes longer than a copy, and
# costs 32 KiB of shared memory at D = 128 (2 × 32 + 4 × 32 = 192 KiB now; a third Q makes 224).

# %% [markdown]
# **Instructor's answer.** *3.* Claimed as an item starts, a block holds its next item for a whole
# item's time: a block that claimed a long item just before the others ran out of work still has to
# compute it, up to one item of imbalance at the end. On section 4's toy GPU that ends at 22 units
# instead of 19 (`warpspec.claim_schedule(4, 8, 8, ahead=100)`; handing out long items first keeps the
# late ones short). It also holds one more value in the producer's registers across the copies,
# which with three consumers does not fit in 32. Claiming only once the consumers are done would
# balance as well as the hardware (18 there) but leave the next item's Q and first K to be copied
# after the last one ended: the round trip the persistent grid exists to hide. A ring's depth
# ahead is both: the copies of the next item start while the current one finishes.

# %% [markdown]
# **Instructor's answer.** *4.* A consumer that skips a tile must still wait for it to land and
# arrive on its `empty` barriers (K's and V's), or the producer would wait forever for a release
# that never comes; and it must not skip the waits that keep its ring position and phase parities
# in step with the producer's. It never applies with two consumers of 64 rows and 128-key tiles
# (D = 128): the first consumer's rows end 64 rows before the item's, inside the item's last tile,
# so both need every tile. It applies with 64-key tiles, where the first consumer stops a tile
# early, and with 192-row items, where the first consumer's rows end 128 rows before the item's.
# Timed on an H100 at D = 64 under the mask, with it and without it in turn: 1.05× at N = 512,
# where the skipped tile is a large share of an item's few, falling to 1.01× at N = 16384
# (`data/runs/hopper-try-20261127T0731Z-two-blocks-own-tiles.log`).

# %% [markdown]
# **Instructor's answer.** *5.* Consumer A's S runs, then its softmax. Meanwhile the tensor cores
# run A's P V and then B's S and P V: 512 + 1 024 cycles. A is ready to issue again only after
# its softmax, rescale and packing (about 1 300 + 250 cycles) and its waits, so the tensor cores
# idle for the difference, a hundred cycles or more every turn, and the period is set by A's chain,
# not by the products. They stop idling when a consumer's softmax, rescale, packing and waits fit
# in the other consumer's products plus its own P V, about 1 500 cycles. The softmax alone (950
# cycles with no products beside it) would fit, but the products slow it by half. So the
# instructions between the two products must get fewer or cheaper before the turns pay.

# %% [markdown]
# ## Summary
#
# - A producer warpgroup issues every copy and waits for every free buffer, so the computing
#   warpgroups wait only for data.
# - `setmaxnreg` moves registers between warpgroups at run time: 40 for the producer and 232 for
#   each of two consumers at D = 128, where the launch cap gave everyone 168; 32 and 160 for each
#   of three at D = 64. With the producer at 40, three would get 152 and ptxas would serialize
#   their `wgmma`.
# - A persistent grid of one block per SM claims work items from a counter, longest causal items
#   first, and copies the next item's Q during the current one: a block's start is paid once.
#   Under the mask on short sequences at D = 64, two such blocks share an SM, 104 registers for
#   each consumer, as stage 10's two blocks did.
# - K and V on their own barriers let K go back to the producer as soon as S has read it.
# - The producer's registers have a price. Stage 10's two blocks an SM of two warpgroups do not
#   fit with a producer in each block: at D = 64 (128-key tiles) stage 11 is 0.91–1.02× stage 10,
#   and at D = 128 under the mask on short sequences (64-key tiles) 0.94–0.97×; at D = 128 where
#   both run two computing warpgroups an SM, it is 1.02–1.14×.
# - In a specialized kernel a waiting warp may be doing its job: read stall reasons by role.
# - The next schedule, consumers taking turns at the tensor cores, pays only once a consumer's
#   softmax is shorter than the other's products. Here, read from the SM clock, it is longer:
#   1 200–1 400 cycles against about 1 024.

# %%
nb.reached("11_warpspec")
