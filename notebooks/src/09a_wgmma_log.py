# %% [markdown]
# # Appendix to stage 09 — the loop forms and block shapes that were timed
#
# Notebook 09 explains stage 09's kernel as it is. This appendix keeps the measurements behind four
# of its choices: the warpgroup index read from lane 0, each warpgroup's own tile loop, 128-key
# tiles at D = 64, and the block shapes under the causal mask. Each was timed on an H100 against the
# kernel it replaced.
#
# ## Objectives
# After this notebook you can:
# - read a timing in turn: variants of one kernel compared as ratios within one run;
# - say what moving the descriptors into uniform registers every tile cost, and what a test in the
#   tile loop cost even where it was never true;
# - explain from measurements why `pick()` runs 128-key tiles at D = 64 and its block shapes under
#   the mask.
#
# **Prerequisites:** notebook 09.
#
# **Time:** about 10 min to read, 15 min to work through.

# %% [markdown]
# ## How these were timed
#
# Each log named below, in `data/runs/`, is one process on an NVIDIA H100 80GB HBM3 (torch 2.11,
# CUDA 13.0) that built the variants, checked each against the float64 reference, and then timed
# them, stage 08 and SDPA's backends at every config of the fp16 FlashAttention sweep (16k tokens,
# H · D = 2048), one run of each in turn. A table below gives one variant's TFLOP/s over another's
# from the same log; rows are head dim and mask, columns N. The variants are stage 09 as it stood
# that day, so their absolute speeds are not notebook 09's.

# %% [markdown]
# ## 1 · The warpgroup index from lane 0
#
# With `wg = threadIdx.x / 128`, ptxas moved every descriptor of the loop into uniform registers
# (`R2UR`) before its `wgmma`: 48 moves a tile at D = 128, one per 32-bit half of each of its 24
# descriptors. Reading the
# index from lane 0 with `__shfl_sync` removed the moves. The kernel with the shuffle over the one
# without it (`hopper-try-20261126T2302Z-uniform-index.log`, v1 / v0):
#
# | D, mask | 512 | 1024 | 2048 | 4096 | 8192 | 16384 |
# |---|---:|---:|---:|---:|---:|---:|
# | 64 | 1.06 | 1.09 | 1.10 | 1.10 | 1.09 | 1.10 |
# | 64, causal | 1.06 | 1.08 | 1.09 | 1.10 | 1.10 | 1.11 |
# | 128 | 1.04 | 1.06 | 1.06 | 1.07 | 1.08 | 1.09 |
# | 128, causal | 1.03 | 1.04 | 1.06 | 1.07 | 1.07 | 1.07 |
#
# 1.03–1.11×, more at D = 64 than at D = 128 and more on long sequences than on short ones.

# %% [markdown]
# ## 2 · Each warpgroup's own tiles
#
# Under the causal mask the key tiles past a warpgroup's last row are masked for all of its rows.
# Stage 09 first skipped them with a test inside the tile loop; now each warpgroup counts its tiles
# (`n_mine`), computes them in one loop and keeps the barriers and loads going in a second. At
# D = 64, with the same shape (64-key tiles, two warpgroups, six buffers), the new loops over the
# old (`hopper-try-20261127T0907Z-09-10-own-loops-d64.log`, v1 / v0):
#
# | D, mask | 512 | 1024 | 2048 | 4096 | 8192 | 16384 |
# |---|---:|---:|---:|---:|---:|---:|
# | 64 | 1.06 | 1.07 | 1.08 | 1.08 | 1.09 | 1.09 |
# | 64, causal | 1.04 | 1.05 | 1.07 | 1.08 | 1.08 | 1.09 |
#
# The gain is as large without the mask, where the test is never true, as under it: what cost time
# was the test in the loop, not the tiles it skipped. At D = 128 the same change measured
# 1.00–1.02× (`hopper-try-20261127T0915Z-09-10-own-loops-d128.log`, v1 / v0).

# %% [markdown]
# ## 3 · 128-key tiles at D = 64
#
# In the same log, v2 runs 128-key tiles in two blocks an SM of two warpgroups with three buffers
# each (the shape `pick()` now runs at D = 64), v1 64-key tiles with six buffers and
# `BLOCKS` = 1 (v2 / v1):
#
# | D, mask | 512 | 1024 | 2048 | 4096 | 8192 | 16384 |
# |---|---:|---:|---:|---:|---:|---:|
# | 64 | 1.05 | 1.07 | 1.07 | 1.06 | 1.06 | 1.06 |
# | 64, causal | 0.97 | 1.01 | 1.04 | 1.05 | 1.05 | 1.05 |
#
# Besides the second block, the wider tile eases shared memory. A `wgmma` with both operands there
# (S = Q Kᵀ) reads A (64 × 16, 2 KiB) and B (N × 16) per instruction: `m64n128k16` reads 6 KiB for
# 262 144 FLOPs, at the tensor cores' full rate 96 bytes a clock of the 128 that shared memory
# delivers; `m64n64k16` reads 4 KiB for half the FLOPs, all 128. The short masked sequences, where
# the wider tile lost, got a shape of their own (section 4).

# %% [markdown]
# ## 4 · Blocks under the causal mask
#
# At D = 128 stage 09 ran blocks of one warpgroup (64 query rows) with three buffers of 64 keys
# under the mask (with `RETIRE` at N = 512). Two blocks an SM of two warpgroups with two 64-key buffers and `RETIRE`, the
# shape now, over it (`hopper-try-20261127T1435Z-d128-causal-two-blocks-every-length.log`,
# v1 / v0):
#
# | D, mask | 512 | 1024 | 2048 | 4096 | 8192 | 16384 |
# |---|---:|---:|---:|---:|---:|---:|
# | 128, causal | 1.14 | 1.14 | 1.13 | 1.12 | 1.12 | 1.07 |
#
# Each K/V tile now serves 128 query rows instead of 64, half the loads per row. Without the mask
# (the shape unchanged) the two ran within 0.4 % of each other.
#
# At D = 64 stage 09 ran two warpgroups under the mask too (six 64-key buffers at N = 512, the
# 128-key shape of section 3 from N = 1024). Four blocks an SM of one warpgroup with two 64-key
# buffers and `RETIRE` over it (`hopper-try-20261127T1733Z-09-d64-causal-four-blocks-every-length.log`,
# v1 / v0):
#
# | D, mask | 512 | 1024 | 2048 | 4096 | 8192 | 16384 |
# |---|---:|---:|---:|---:|---:|---:|
# | 64, causal | 1.06 | 1.01 | 0.98 | 0.97 | 0.97 | 0.97 |
#
# So `pick()` runs the small blocks below N = 2048 only. At N = 512 a block has one to eight 64-key
# tiles, so its start and end (first loads, the wait for the first S, the write-back) are much of
# its time, and four small blocks on an SM stagger them. Three or five such blocks an SM (v3, v2)
# timed within 0.2 % of four at N = 512 and 1024. Other shapes with one warpgroup a block or
# `RETIRE` (`hopper-try-20261127T1732Z-09-d64-causal-one-warpgroup-shapes.log`) ran 0.82–0.99× as
# fast as stage 09's shape then at N = 512, this one 1.06×.

# %% [markdown]
# ## Summary
#
# - Reading the warpgroup index from lane 0 kept the descriptors in uniform registers: 1.03–1.11×
#   over the sweep.
# - A test in the tile loop cost as much where it was never true: each warpgroup's own loop gained
#   1.06–1.09× at D = 64 without the mask.
# - At D = 64, 128-key tiles two blocks an SM won by 1.05–1.07× without the mask.
# - Under the mask at D = 128, two blocks an SM of two warpgroups (a K/V tile shared by 128 rows)
#   won by 1.07–1.14× over blocks of one; at D = 64, four one-warpgroup blocks an SM won 1.06× at
#   N = 512 and lost from N = 2048.
