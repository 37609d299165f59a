# %% [markdown]
# # Appendix to stage 12 — consumers past the end, the other shape choices, and the overlaps that did not pay
#
# Notebook 12 is about the TMA store of O. Its kernel also carries two changes of shape, and
# FlashAttention-3's two other overlaps were tried beside it. This appendix keeps that record: how
# a consumer whose rows lie past the end of the sequence gets no tiles, what each shape choice
# measured, and why ping-pong and the in-warpgroup overlap lost to stage 11 on the H100, or at
# best tied.
#
# ## Objectives
# After this notebook you can:
# - say what a consumer past the end of the sequence cost stage 11, and why one with no tiles must
#   still wait for every tile it hands back and release its previous Q buffer itself;
# - read the measurements behind stage 12's `pick()`: three consumers under the mask, two blocks
#   an SM on short causal sequences, four K/V buffers, 160-key tiles;
# - explain from a consumer's cycle counts why taking turns at the tensor cores cannot hide a
#   softmax that is longer than the other consumer's products;
# - recognise when ptxas moves a `wgmma.wait_group` above the work it was meant to overlap.
#
# **Prerequisites:** notebook 12 (and notebook 11's producer, consumers and model of a block).
#
# **Time:** about 14 min to read, 20 min to work through.

# %%
# %matplotlib inline
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import tma_store
from flashlab import notebook as nb
from flashlab import plots
nb.banner("12_tma_store")

# %% [markdown]
# ## 1 · Consumers past the end of the sequence
#
# Stage 11 runs three consumers at D = 64 (192 query rows an item), except under the causal mask
# below N = 2048, where it runs two blocks an SM of two consumers with 64-key tiles. Under the mask
# each consumer already runs only the key tiles up to its own last row. One cost of a 192-row item
# is left: **the end of the sequence.** N = 512 is 2⅔ items of 192 rows, N = 1024 is 5⅓ and
# N = 2048 is 10⅔: the last item's last one or two consumers compute rows past the end, which are
# never stored. Without the mask that is an eighth more rows at N = 512 and 1024, and about 3 %
# from N = 2048 on. Under the mask it costs more: such a consumer's last row is taken as N's, so it
# runs every key tile of the sequence, as many as the longest item.
#
# Stage 12 adds one line to the count of each consumer's own tiles, `n_mine`: a consumer whose rows
# all lie past N gets none.

# %%
nb.show_lines("12_tma_store", r"// Under the mask this warpgroup", r"if \(wg_row0 >= N\) n_mine = 0;")

# %% [markdown]
# The item's tiles after a consumer's own go back to the producer unread, but not unseen: the
# consumer still waits for each tile's `full` barrier before it arrives on its `empty` ones. The
# producer refills a buffer once every consumer warp has arrived on its `empty` barrier, and it
# refilled this one only once every consumer had released its previous use; so a consumer that has
# seen `full` complete arrives for this use. One that arrived without waiting could, running ahead,
# arrive on a phase that another consumer is still reading, and the producer would overwrite the
# tile under it. A consumer with no tiles has no first tile at which to release the previous item's
# Q buffer (notebook 12, section 2), so it waits for `wait_group.read` and arrives right after its
# loop, and stores nothing:

# %%
nb.show_lines("12_tma_store", r"if \(n_mine > 0\) \{", r"prev_slot = slot;")

# %% [markdown]
# With it, three consumers win under the mask from N = 2048 on; below that `pick()` keeps stage
# 11's two blocks an SM, which are faster there still:

# %%
nb.show_source("12_tma_store", "pick")

# %% [markdown]
# Measured at D = 64 under the mask, each kernel timed in turn with the others (fp16, H100,
# `data/runs/hopper-try-20261127T0731Z-two-blocks-own-tiles.log`), TFLOP/s at N = 512 … 16384:
#
# | | 512 | 1024 | 2048 | 4096 | 8192 | 16384 |
# |---|---|---|---|---|---|---|
# | stage 11 | 246 | 321 | 387 | 414 | 449 | 464 |
# | stage 12, three consumers everywhere | 262 | 337 | 416 | 437 | 458 | 471 |
# | stage 12, two blocks of two consumers below N = 2048 | 279 | 345 | 416 | 437 | 459 | 471 |
#
# With the consumers past the end computing nothing, three consumers also beat one block of two
# under the mask at N = 512 and 1024 (267 and 343 TFLOP/s against 247 and 326,
# `data/runs/hopper-try-20261127T0123Z-d64-consumers-past-end.log`); two blocks of two are faster
# still. Without the mask only the rows past the end change: 1.07× at N = 512 and 1024 and about
# 1.01× from N = 8192 on, stage 12 with and without the skip timed in turn
# (`data/runs/hopper-try-20261126T2350Z-past-end.log`).
#
# ## 2 · Four K/V buffers and 160-key tiles
#
# Two smaller choices were timed on stage 12 with three consumers at D = 64
# (`data/runs/hopper-try-20261125T1819Z-four-buffers-160-keys.log`, each against the same kernel
# with the old choice, in the same run):
#
# * **Four K/V buffers instead of three at D = 64.** Three consumers' Q buffers leave room for a
#   fourth (176 KB), so the producer runs further ahead: 1.01–1.02× at every point where three
#   consumers ran. Stage 11 has them too.
# * **160-key tiles instead of 128 at D = 128.** Two buffers still fit (225 KB), and each tile's
#   waits and issue are spread over more keys: 1.01–1.02× from N = 4096 without the mask, but 0.87×
#   and 0.95× at N = 512 and 1024, where the last tile's padding weighs more, and 0.86–1.00× under
#   the mask. So `pick()` uses them without the mask from N = 4096 only.
#
# Against stage 10, which at D = 64 runs four warpgroups an SM with 128-key tiles (a shape the
# producer's registers keep stages 11 and 12 from, notebook 11), stage 12 is level or a few per
# cent ahead at D = 64, and ahead by up to a third at D = 128, most on short sequences without the
# mask:

# %%
with nb.unless_missing():
    display(nb.sweep_ratio("12_tma_store", "10_tma").round(2))

# %% [markdown]
# ## 3 · The overlaps that did not pay
#
# FlashAttention-3 adds two more overlaps to a kernel of stage 11's shape. The two consumers take
# turns at the tensor cores (*ping-pong*, ordered by named barriers), so that one's softmax runs
# under the other's products. Inside a consumer, the softmax of tile j runs while the products of
# tile j − 1 are still in flight. Both were built on stage 11 (the kernel is kept as
# `kernels/12_overlap.patch`, the variants notebook 12's section 10 runs) and timed against it over
# the fp16 sweep on the H100: 0.87–1.02× stage 11 with either overlap or both, losing up to 13 %
# and at best tying (`data/runs/hopper-try-20261125T0955Z.log`).
#
# Getting the second one to run at all took care. In the PTX the order was `wgmma.wait_group 1`,
# the softmax's 66 `ex2`, then `wgmma.wait_group 0`; in the SASS both `WARPGROUP.DEPBAR` came first
# and the 66 `MUFU.EX2` after them. Inside one basic block ptxas places a wait as early as it can,
# above the exponentials it was meant to overlap. Rotating the loop (the wait at the top of a turn,
# the softmax at its end) keeps the loop's back edge between the two.
#
# **Why they do not pay.** Stage 11's consumer loop, stamped with the SM clock at each step (B = 4,
# H = 16, N = 4096, D = 128, fp16, block 0,
# `data/runs/hopper-trace-20261127T0440Z-stage11-now.log`), takes a period of 3 188 and 3 184 cycles
# a tile for its two consumers, of which the softmax takes 1 402 and 1 214: **1 200–1 400 cycles a
# tile for a consumer beside the other one** (about 1 600 at D = 64: 1 615 and 1 612). The other
# consumer's products of a tile, S and P·V at D = 128, are 2 × 64 × 128 × 128 multiply-adds: about
# 1 024 cycles at the tensor cores' 4 096 FLOP a cycle per SM. Taking turns cannot hide a step
# longer than what it is hidden under. Stage 12's gain is of a different kind: it does not hide the
# softmax, it removes work from the end of every item, where both consumers stop at once.
#
# FlashAttention-3's own shape at D = 64 is three consumers with the in-warpgroup overlap. Built on
# the overlap kernel with a 24-register producer, it measured 0.96–1.02× three consumers without
# the overlap without the mask, and 0.99–1.03× under it from N = 2048
# (`data/runs/hopper-try-20261125T1752Z-d64-three-consumers.log`). Only at N = 512 and 1024 under
# the mask did it gain (1.07× and 1.10×), where three consumers lose to two anyway.
#
# At D = 64 a score costs half the multiply-adds of D = 128 and the same softmax, so the softmax's
# length sets the pace even more. Every exponential is already the special-function unit's single
# instruction; the levers left are the instructions around it. Fewer of them is not enough by
# itself: row sums taken as packed fp16 pairs measured 0.96–0.99× stage 12 at D = 64 with two
# consumers (`data/runs/hopper-try-20261125T1749Z-d64-half-sums-three-consumers.log`). What the
# softmax spends is one part; what it waits for is another. Every exponential of a tile waits for
# the tile's row maximum, and O is rescaled at every tile: stage 13 takes both off the softmax's
# path.
#
# ## Summary
#
# - A consumer whose rows all lie past the end of the sequence runs no tile in stage 12, but still
#   waits for each tile it hands back and releases its previous Q buffer itself. With it, three
#   consumers pay at D = 64 under the mask from N = 2048 on; below that two blocks an SM stay faster.
# - Four K/V buffers at D = 64 and 160-key tiles at D = 128 without the mask from N = 4096 each
#   measured a per cent or two.
# - FlashAttention-3's ping-pong and in-warpgroup overlap lose to stage 11 on the H100 or at best
#   tie (0.87–1.02×): a
#   consumer's softmax, 1 200–1 400 cycles a tile at D = 128 beside the other consumer, is longer
#   than the other consumer's products that would hide it.
