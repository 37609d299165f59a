# %% [markdown]
# # Appendix to stage 11 — what the warp-specialized kernel also carries, and its log
#
# Notebook 11 teaches one idea: a producer warpgroup that only copies and gives its registers away,
# consumer warpgroups that only compute. Its kernel carries more, listed in a table at the end of
# its section 2. This appendix treats each of those mechanisms in full, with the timed tries behind
# the kernel's shapes, the sweep taken apart shape by shape, and a trace of a consumer's tile in SM
# clock cycles that says what the next stages must change.
#
# ## Objectives
# After this notebook you can:
# - follow the six barriers of a work item: K and V on barriers of their own, Q double-buffered
#   across items;
# - say what a work counter and a longest-first order buy a persistent grid, on a toy GPU and on the
#   sweep's shapes;
# - say why stage 11 runs the shape it runs per head dim, mask and length, from the timed tries;
# - read a consumer's tile in clock cycles, and say why its two consumers taking turns at the tensor
#   cores would not pay yet.
#
# **Prerequisites:** notebook 11.
#
# **Time:** about 25 min to read, 30 min to work through.

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
# ## 1 · Q, K and V on barriers of their own
#
# In stage 10 a K tile and its V tile shared a buffer and one pair of barriers, so a buffer could be
# freed only once the *next* tile's S had retired: P·V still read V from it. In stage 11 K and V
# have rings and barriers of their own, and a consumer releases `K_j` as soon as `S_j` has retired.
# Each barrier completes one phase per round of its ring (parity `(r / STAGES) & 1` for ring
# position r, as in notebook 10):

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
# With K released right after S, the producer can load further ahead with fewer buffers: two of K
# and two of V at D = 128, against stage 10's three pairs. The `SYNCS` instructions (barrier waits
# and arrivals) more than double in notebook 11's counts, and a consumer also waits for and releases
# the tiles past its own rows under the mask.
#
# **Two Q buffers.** The producer may overwrite a Q buffer only after every consumer's last S of the
# item that used it. With one buffer, item it + 1's Q could be copied only after item it's last S,
# and the consumers would wait a round trip for Q at every item — the cost stage 10 paid per block.
# With two, item it + 1's Q is copied while item it is computed, and the producer waits only for
# item it − 1 to be done with the other buffer. A third would let it run two items ahead, which buys
# nothing while an item takes longer than a copy, and costs 32 KiB of shared memory at D = 128 (2 ×
# 32 + 4 × 32 = 192 KiB now; a third Q makes 224). O goes from the consumers' registers straight to
# global memory: the Q buffer it went through in stage 10 belongs to a later item by then.
#
# ## 2 · The persistent grid and its work counter
#
# Stage 10 launched one block per work item; stage 11 launches one block per SM (two in one shape,
# section 3), or fewer if there are fewer items, and each block loops over items it claims from a
# counter (notebook 11, section 4). Why a counter, on a toy GPU of 8 SMs with 4 heads of 8 causal
# query tiles (an item's time: the key tiles it reads)? A persistent grid *without* a counter hands
# out items statically, block b taking b, b + G, b + 2G, …; with G a multiple of the tiles per head,
# every block gets the same query tile of every head, and the block with the longest ones finishes
# last:

# %%
warpspec.claim_figure(heads=4, tiles=8, blocks=8)


# %% [markdown]
# The counter balances the blocks, and handing out long items first balances them further. It comes
# close to the last panel, stage 10's grid of one block per item, where the hardware's block
# scheduler starts each block on the first SM that frees up.
#
# **When to claim.** The producer claims its next item once it has issued the current item's last
# copies. That waits for a free buffer, so it comes about a ring's depth of key tiles (two) before
# the item ends at D = 128: early enough for the next item's Q and first K to land in time, late
# enough that a block rarely holds a long item another block would have finished sooner. Claimed as
# an item starts, a block would hold its next item for a whole item's time, up to an item of
# imbalance at the end of the launch, and the producer would hold one more value across its copies,
# which with three consumers does not fit in its 32 registers. Claimed only once the consumers are
# done, the next item's Q and first K would be copied after the last one ended: the round trip the
# persistent grid exists to hide.
#
# On the sweep's causal shapes, with this GPU's SMs (work in key tiles; items as `pick()` launches
# the stage: 192 rows and 128-key tiles at D = 64 from N = 2048, 128 rows and 64-key tiles on two
# blocks an SM at N = 512, 128 rows and 128-key tiles at D = 128; `… over even`: how much later than
# all the work spread evenly):

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
# hardware's scheduling of separate blocks does. What the persistent block buys on top is that a
# block's start is paid once (notebook 11, section 5).
#
# ## 3 · The shapes per head dim, mask and length
#
# `pick()` chooses the shape; its comment names the tries that measured it:

# %%
nb.show_source("11_warpspec", "pick")


# %% [markdown]
# Each choice below was timed in turn against the alternatives on an H100, fp16, with
# tools/hopper_try.py (the logs are in `data/runs/`).
#
# * **D = 64: three consumers.** Three consumers of 64 rows make 192-row items, and N = 512 is 2⅔
#   items: the last item's third consumer computes rows past N that are never stored. Without the
#   mask the third consumer's softmax gains more than those rows cost: three consumers over two,
#   1.02× at N = 512 and 1024 and 1.11–1.16× from N = 2048
#   (`data/runs/hopper-try-20261127T0123Z-d64-consumers-past-end.log`).
# * **D = 64 under the mask below N = 2048: two blocks an SM.** There an item has only a few key
#   tiles, and the last item's idle consumers cost most. Stage 11 runs two blocks on each SM, each a
#   producer and two consumers of 64-key tiles. Its counts are notebook 11's section 3 budget: a
#   pool of 3 × 80 = 240 registers a thread position, 32 for the producer and (240 − 32) / 2 = 104
#   for each consumer. A smaller producer would not help: even at `setmaxnreg`'s smallest count, 24,
#   the consumers' (240 − 24) / 2 = 108 rounds down to a multiple of 8, 104 again. 104 holds a
#   consumer's accumulators of 64-key tiles at D = 64 — O (32 floats), S (32) and P (16 pairs), 80
#   in all — but not with a `wgmma` in flight across the next one: if S were issued while the
#   previous tile's P·V still reads P, ptxas would serialize every `wgmma` (C7512). So in this shape
#   a consumer retires that P·V before it issues the next S (the `if (BLOCKS == 2) wgmma_wait<0>()`
#   in its loop), and the other block's warpgroups keep the tensor cores busy meanwhile. At N = 512
#   and 1024 under the mask: 235 and 310 TFLOP/s with two blocks an SM, against 225 and 304 for one
#   block of two consumers with 128-key tiles
#   (`data/runs/hopper-try-20261127T0731Z-two-blocks-own-tiles.log`).
# * **Each consumer runs only its own key tiles.** Under the mask a consumer stops at the key tile
#   holding its own last row and hands the item's later tiles back unread. It must still wait for
#   each to land and arrive on its `empty` barriers, or the producer would wait forever for a
#   release that never comes, and keep its ring position and phase parities in step with the
#   producer's. It never applies with two consumers of 64 rows and 128-key tiles (D = 128): the
#   first consumer's rows end 64 rows before the item's, inside the item's last tile. It applies
#   with 64-key tiles and with 192-row items. Timed with and without it at D = 64 under the mask:
#   1.05× at N = 512, where the skipped tile is a large share of an item's few, falling to 1.01× at
#   N = 16384 (the same log).
# * **D = 128: two consumers of 128-key tiles in one block, with and without the mask.** Stage 10
#   runs two blocks of two warpgroups with 64-key tiles under the mask below N = 8192. Stage 11
#   cannot: its consumers would get 104 registers, fewer than the 112 of their accumulators at
#   D = 128 (O 64, S 32, P 16). With 64-key tiles in its one block it measured 0.95× its own shape
#   at N = 512 and 0.84–0.89× from N = 1024: half-width tiles do not pay without the extra
#   warpgroups (`data/runs/hopper-try-20261127T1438Z-11-12-d128-causal-64-key.log`).
#
# One more count. Under the causal mask, how many query-key scores a block computes per head, each
# stage with the tiles its `pick()` launches at D = 64 (stage 10: 64-key tiles for one warpgroup
# below N = 1024, 128-key for two from there; stage 11: 64-key tiles for two consumers below
# N = 2048, 128 for three from there), a warpgroup computing the key tiles up to its own last row:

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
# With 128-key tiles for 192-row items stage 11 computes 6 % more scores than stage 10 at N = 2048
# and 4096. At N = 1024 it computes 6 % fewer, with 64-key tiles; at N = 512 both run 64-key tiles
# and compute as many.
#
# ## 4 · The sweep, shape by shape
#
# Notebook 11's sweep, stage 11 over stage 10, over cuDNN, and stage 10 over cuDNN (the same cell
# and run):

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

# %% [markdown]
# * **D = 128 without the mask: the gain fades, but less than the model says.** 1.14–1.15× up to
#   N = 1024 and still 1.06–1.09× from N = 4096, where notebook 11's model gives 1.01–1.03: an item
#   of many tiles pays one start, and the model has no per-tile gain because, with its copies
#   quicker than a tile's math, stage 10's ring is never short of data. Give the model copies
#   slightly slower than a tile's math (latency 1.5 and bytes 0.75 against 2 of math), and stage
#   10's warpgroups wait a little before every tile while stage 11's do not:

# %%
h100 = dict(mma=1.0, softmax=1.0, latency=1.0, load=0.5, q_load=0.25, store=0.25, launch=0.5)

# %%
slow = dict(h100, latency=1.5, load=0.75)
display(warpspec.predicted_gain(n_tiles=(4, 8, 16, 32, 64, 128), **slow).round(3).to_frame().T)
warpspec.warpspec_timeline(tiles=(3, 3, 3), **slow)

# %% [markdown]
# Under a whole GPU's load that is plausible, and K released right after S is what lets stage 11's
# producer keep ahead with fewer buffers. These measurements alone do not separate it from the other
# per-tile change, the copies and the wait on `empty` gone from warpgroup 0's path.
#
# * **D = 128 under the mask: the gain grows with the length.** 0.94× at N = 512, 0.97× at 1024,
#   then 1.02–1.09×. Below N = 8192 stage 10 computes with four warpgroups an SM and tiles on the
#   diagonal half as wide (section 3). Where a head is a few items, the second block's warpgroups
#   are worth more than the copies leaving the computing warps; from N = 2048 the loop is long
#   enough for specialization to win.
# * **D = 64: the producer's registers decide.** Stage 10 runs four warpgroups on each SM, two
#   blocks of two with 128-key tiles (under the mask at N = 512, four blocks of one with 64-key
#   tiles). Stage 11 runs three consumers of 128-key tiles in one block, or under the mask on short
#   sequences two blocks of two consumers with 64-key tiles. Three computing warpgroups an SM
#   instead of four, or tiles half as wide, cost more than the copies leaving the computing warps
#   save, except on the longest sequences without the mask (1.02× from N = 8192). Under the mask
#   section 3's count adds to it: 6 % more scores at N = 2048 and 4096. At N = 1024 stage 11
#   computes 6 % fewer and is still 0.96× stage 10: half-width tiles pay the per-tile work (the
#   barriers, the loop, the waits) twice per key. At N = 512 both run 64-key tiles and compute as
#   many scores; stage 11's two blocks of two consumers and a producer run 0.95× as fast as stage
#   10's four blocks of one warpgroup, which give no registers to a producer.
# * **Without the mask at D = 64, N = 512 and 1024 (0.91–0.92×)** there is also the work past the
#   end: N = 512 is 2⅔ items of 192 rows and N = 1024 5⅓, and the last item's idle consumers still
#   compute rows that are never stored.
# * **Against cuDNN** stage 11 runs at 0.87–1.13×: level with it or ahead from N = 4096 on
#   (1.00–1.13×; at D = 64, 1.03–1.13×), and 0.87–0.98× at N = 512, where an item is a few tiles and
#   everything that is not the loop weighs most. Against PyTorch's FlashAttention-2 backend it is
#   1.38–2.31× faster.
#
# The teaching config is one launch of about 50 µs. Such a launch is barely longer than the host's
# work to make it (checks, the output and the counter's allocation, three tensor maps, a memset, the
# launch: notebook 99 measures it), which is why `fl.bench` queues its runs behind a GPU sleep
# (notebook 00).
#
# ## 5 · A consumer's tile in clock cycles
#
# Each consumer runs a tile strictly in order: products, wait, softmax, products.
# tools/hopper_trace.py builds stage 11 with SM clock stamps around the steps of its consumer loop
# and reports the mean cycles per tile of block 0's consumers 0 and 1, fp16 on an H100
# (`data/runs/hopper-trace-20261127T0440Z-stage11-now.log`):
#
# | shape | consumer | K wait | issue S | S wait | softmax | rescale O, pack P | V wait | issue P·V | period |
# |---|---|---:|---:|---:|---:|---:|---:|---:|---:|
# | B=4 H=16 N=4096 D=128 | 0 | 124 | 383 | 574 | 1 402 | 208 | 104 | 166 | 3 188 |
# | | 1 | 136 | 282 | 578 | 1 214 | 299 | 111 | 288 | 3 184 |
# | B=4 H=32 N=4096 D=64 | 0 | 103 | 142 | 396 | 1 615 | 219 | 105 | 163 | 2 974 |
# | | 1 | 111 | 138 | 409 | 1 612 | 233 | 90 | 176 | 2 970 |
#
# The softmax is the longest step: **1 200–1 400 cycles a tile at D = 128 for a consumer beside the
# other one** (1 402 and 1 214), and about 1 600 at D = 64 (1 615 and 1 612; there these are two of
# the three consumers).
#
# **Would taking turns pay?** FlashAttention-3 schedules against this in two ways: the two consumers
# take turns at the tensor cores (ping-pong), so that one's softmax runs under the other's products,
# and inside a consumer the softmax of tile j runs while the product of tile j − 1 is still in
# flight. The other consumer's two products for its tile, 2 × 64·128·128 multiply-adds at D = 128,
# keep the tensor cores busy for about 1 024 cycles at their peak of 4 096 FLOP a cycle per SM, and
# a consumer's own P·V, run under its softmax, 512 more: about 1 536. A consumer's softmax with its
# rescale and packing takes 1 513–1 610 cycles here, and with its waits for K and V about
# 1 760–1 840. So with turns the tensor cores would still idle, by this count for 200–300 cycles
# each turn, the period set by a consumer's chain rather than by the products. Fewer instructions on
# that chain, or wider key tiles that spread its fixed costs over more keys, come first.
#
# One cost is not in the table, because it is paid once per work item rather than per tile: the end
# of an item, where each consumer stores O from its registers before it starts the next. At N = 512
# and D = 128 an item is four tiles long, and that is where stage 11 trails cuDNN most (0.87×).
# Stage 12 starts there.
#
# ## Summary
#
# - K and V on barriers of their own let K go back to the producer as soon as S has read it; two Q
#   buffers let the next item's Q land during this one.
# - A work counter keeps a persistent grid within about 1–7 % of an even split on the sweep's causal
#   shapes, where a static split loses 8 to 80 %; longest items first leave short ones for the end
#   of a launch.
# - The shapes follow the registers: two consumers at D = 128; three at D = 64; two blocks of two
#   under the mask on short sequences at D = 64, at 104 registers a consumer (32 for the producer;
#   `setmaxnreg`'s smallest, 24, would give 104 too), with P·V retired before the next S.
# - Stage 11 gains on stage 10 where both compute with the same warpgroups, and loses where the
#   producer's registers cost a warpgroup or half the tile width.
# - A consumer's softmax takes 1 200–1 400 cycles a tile at D = 128 beside the other consumer:
#   longer than the other's products, so taking turns at the tensor cores does not pay yet.
