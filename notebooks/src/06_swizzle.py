# %% [markdown]
# # Stage 06 — Swizzled shared memory: conflict-free without padding
#
# Stage 05 keeps its `ldmatrix` loads free of bank conflicts by storing every row of Q, K and V
# **16 bytes longer than it is**. This stage changes one thing: **rows stay dense, and the
# 16-byte chunks inside each row are permuted instead** — logical chunk `c` of row `r` is stored
# at chunk `c XOR (r % 8)`. Same instructions, different addresses.
#
# ## Objectives
# After this notebook you can:
# - work out where an XOR swizzle stores a chunk, and why 8 rows asking for the same chunk land
#   in 8 different groups of banks;
# - count the wavefronts of a warp's shared-memory request in dense, padded and swizzled tiles;
# - predict from the machine code what a change of addresses alone does to the time;
# - read bank-conflict counters as a share of wavefronts, and tell noise from a regression.
#
# **Prerequisites:** notebook 05 (`mma.sync`, `ldmatrix`, banks and wavefronts).
#
# **Time:** about 20 min to read, 30 min to work through.
#
# Padding costs shared memory and breaks the dense, power-of-two tiles that stage 07's copies and
# Hopper's TMA unit want; CUTLASS and FlashAttention swizzle instead. Everything before the
# measurement comes from the kernels' indexing and the compiler.

# %%
# %matplotlib inline
import numpy as np
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import fragments as fr
from flashlab import notebook as nb
from flashlab import plots
nb.banner("06_swizzle")

# %%
print(nb.the_gpu())  # this GPU, or the one the recorded numbers come from

# %% [markdown]
# ## 1 · The one change
#
# Every line that differs from stage 05: the `Tiles` struct loses `LD` (the padded row stride),
# a function `swz` appears, and every `row * LD + col` becomes `swz<D>(row, col)` — the tile
# copies, the three `ldmatrix` calls and the write-out of O.

# %%
nb.show_diff("05_mma", "06_swizzle", context=1)

# %%
nb.show_source("06_swizzle", "swz")

# %% [markdown]
# Read `swz` from the inside out, for a 16-bit element at (`row`, `col`):
#
# * `col >> 3` is the 16-byte **chunk** the element is in (8 halves to a chunk);
# * `^ (row & 7)` XORs the chunk number with the row number mod 8 — a different permutation of
#   the chunks for each of 8 consecutive rows;
# * `<< 3` turns the chunk back into an element offset; `row * D` is a dense row.
#
# The position inside a chunk is untouched: each 16-byte chunk stays whole, as `ldmatrix` and
# the 16-byte copies need. At D = 128 (16 chunks a row) the XOR permutes each half-row within
# itself. Where each logical chunk of rows 0..7 is stored at D = 64: every row and every column
# is a permutation of 0..7, so 8 rows asking for the same chunk get 8 different places.

# %%
D, BR, BC = 64, 64, 64  # the teaching config's head dim; the kernel's tile sizes
rows8, chunks = np.indices((8, D // 8))
where = fr.smem_offset(rows8, 8 * chunks, 2 * D, swizzle=True) % (2 * D) // 16
pd.DataFrame(where, index=pd.Index(range(8), name="row"),
             columns=pd.Index(range(D // 8), name="logical chunk → stored at chunk"))

# %% [markdown]
# XOR is its own inverse (`(c ^ r) ^ r = c`): the reader applies the same `swz`. A row is 128
# bytes at D = 64, one row of the 32 banks, so chunk `k` of a row is banks `4k .. 4k + 3`.
#
# ## 2 · Banks: dense, padded, swizzled
#
# As in notebook 05: a warp's request is served in **wavefronts**, passes of at most 128 bytes
# and one 4-byte word per bank; `ldmatrix.x4` is served one 8 × 8 matrix (8 rows of 16 bytes) at
# a time. The first 8 rows of a tile, dense, padded and swizzled, each chunk labelled with its
# first bank; red: what one `ldmatrix` phase reads.

# %%
fr.bank_maps(D)

# %% [markdown]
# Dense, the red column sits in banks 0–3 eight times over: 8 wavefronts for one phase. The
# padding shifts row `r` by `4r` banks; the swizzle moves chunk 0 of row `r` to chunk `r`. Both
# spread the column over all 32 banks.
#
# Lane by lane, for each of the kernel's shared-memory requests: a row per lane, a column per
# bank, and the number in a cell is the wavefront that serves it. First the `ldmatrix.x4` that
# reads K for `S = Q Kᵀ` (8 keys × 32 dims), its 4 phases between the thick lines:

# %%
fr.bank_comparison("ldmatrix K", D)

# %% [markdown]
# The `ldmatrix.x4` of Q, and the `.trans` one of V, read a 16 × 16 block: each phase is 8
# consecutive rows of one 8-column half. Same story:

# %%
fr.bank_comparison("ldmatrix Q, V", D)

# %% [markdown]
# **The 16-byte stores that fill a tile.** Consecutive threads take consecutive chunks, so at
# D = 64 lanes 0–7 write the 8 chunks of one row, lanes 8–15 the next row, and so on. A row's 128
# bytes cover all 32 banks in any chunk order, so all three layouts store a warp's 512 bytes in
# the minimum of 4 wavefronts.

# %%
fr.bank_comparison("tile rows", D)

# %% [markdown]
# **The write-out of O.** Lane (`g`, `t`) stores row `g`, columns `2t, 2t + 1` of each 8-column
# tile as a 4-byte pair. The 8 groups `g` write the same logical chunk of 8 consecutive rows —
# dense, 8 times the same 4 banks. Padding and swizzle both spread them over all 32:

# %%
fr.bank_comparison("O stores", D)

# %% [markdown]
# Every request of the kernel, in wavefronts per warp, at D = 64 and D = 128:

# %%
for d_ in (64, 128):
    display(fr.access_table(d_))

# %% [markdown]
# Summed over a whole launch at the teaching config (B = 4, H = 16, N = 1024):

# %%
cfg = fl.TEACHING
launch = pd.Series({name: fr.launch_wavefronts(cfg.B, cfg.H, cfg.N, D, BR, BC, **how)
                    for name, how in fr.LAYOUTS.items()}, name="shared-memory wavefronts, one launch")
padded, swizzled, dense = (launch[k] for k in ("+16 bytes a row (05)", "XOR swizzle (06)",
                                                 "dense rows"))
print(f"the swizzle needs {swizzled / padded:.3f}x the padded layout's wavefronts; dense rows "
      f"would need {dense / padded:.2f}x")
launch

# %% [markdown]
# ## 3 · What it buys
#
# **Shared memory.** Stage 05 stores Q, K and V in `(BR + 2 BC)` rows of `D + 8` halves; stage
# 06 in rows of `D`:

# %%
layouts = {"05_mma": dict(pad_bytes=16), "06_swizzle": dict(pad_bytes=0)}
smem = pd.DataFrame({s: {d_: fr.smem_bytes(d_, BR, BC, **how) for d_ in (64, 128)}
                     for s, how in layouts.items()}).rename_axis("D")
smem["saved"] = smem["05_mma"] - smem["06_swizzle"]
smem["saved_%"] = (100 * smem["saved"] / smem["05_mma"]).round(1)
smem

# %% [markdown]
# Whether that buys more resident blocks depends on which limit binds: registers (from
# `ptxas`) and shared memory, turned into blocks per SM:

# %%
with nb.unless_missing():
    display(pd.concat({s: nb.blocks_per_sm(s, smem[s].to_dict()) for s in layouts}, names=["stage"]))

# %% [markdown]
# Registers decide, so the saved bytes are headroom; stage 07 spends them on a second buffer.
# And a swizzled tile is a plain `rows × 2D`-byte block: Hopper's TMA unit, which copies whole
# tiles, can apply this very XOR pattern itself (its 128-byte swizzle mode), but only to dense
# tiles.
#
# ## 4 · Prediction, before measuring
#
# Stage 06 should run the same instructions as stage 05 on different addresses. The compiler
# says whether it does: the instruction categories of both kernels (static counts; fp16, bf16
# compiles to the same):

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("05_mma", "06_swizzle").droplevel("stage")
    display(mix[mix.index.str.contains("__half")].T)
    for d_ in (64, 128):
        a, b = (mix.loc[f"{k}<__half, {d_}, {BR}, {BC}>"] for k in ("mma_kernel", "swizzle_kernel"))
        differ = [c for c in mix.columns if c != "total" and a[c] != b[c]]
        print(f"D={d_}: categories that differ: {', '.join(differ) or 'none'}; "
              f"total {a['total']} -> {b['total']}")

# %% [markdown]
# Where the totals differ, it is integer work the categories do not name: `c ^ (r % 8)` takes
# instructions that `r * LD + c` folded into address offsets. The opcodes whose counts changed:

# %%
with nb.unless_missing():
    display(nb.opcode_changes(["05_mma", "06_swizzle"]))

# %% [markdown]
# What matters is what runs once per K/V tile: one trip of the K/V loop (the backward branch
# around the `HMMA`s) in the machine code:

# %%
with nb.unless_missing():
    totals = nb.instruction_mix("05_mma", "06_swizzle")["total"]
    for d_ in (64, 128):
        body = nb.loop_bodies(["05_mma", "06_swizzle"], kernel=rf"__half, {d_},")
        display(body)
        kernel = totals[totals.index.get_level_values("kernel").isin(body["kernel"])].droplevel("kernel")
        loop = body["instructions"]
        print(f"D={d_}: stage 06 has {kernel['06_swizzle'] - kernel['05_mma']:+d} instructions in "
              f"the whole kernel, {loop['06_swizzle'] - loop['05_mma']:+d} of them in the K/V loop "
              f"({loop['06_swizzle'] / loop['05_mma'] - 1:+.1%} per trip)")

# %% [markdown]
# The swizzled addresses depend on the lane and the unrolled `ldmatrix` indices, not on which
# K/V tile is in the buffer, so the compiler computes most of them before the loop. So, before
# measuring:
#
# * **time: the same as stage 05** (a ratio between 0.97 and 1.03) at the teaching config and
#   over the whole sweep;
# * **bank conflicts: about zero in both stages**, loads and stores alike;
# * **shared-memory wavefronts: the same in both**, the launch totals of section 2.

# %%
same = (0.97, 1.03)  # time(05) / time(06) that counts as "the same"

# %% [markdown]
# ## 5 · Measure
#
# On a GPU this builds the stage, checks it against a float64 reference, then times it together with
# stage 05 and SDPA's flash and cuDNN backends, run by run in turn at each config (the teaching
# configs, then the FlashAttention sweep), three rounds over, as `flashlab run` does, so that their
# ratios come from one run (the teaching config is B = 4, H = 16, N = 1024, D = 64). Without one:
# the recorded rows.

# %%
ev = nb.evaluate("06_swizzle")
ev

# %% [markdown]
# ## 6 · Prediction against measurement

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    ratio = nb.speedup("05_mma", "06_swizzle", "fp16")
    print(f"stage 06: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{ratio:.3f}x stage 05's speed; predicted {same[0]} - {same[1]}x")

# %% [markdown]
# Over the FlashAttention sweep (16k tokens, H · D = 2048, fp16), stage 06's speed as a multiple
# of stage 05's:

# %%
with nb.unless_missing():
    ratios = nb.sweep_ratio("06_swizzle", "05_mma")
    display(ratios.round(3))
    flat = ratios.stack()
    inside = flat.between(*same).mean()
    print(f"{inside:.0%} of the sweep's points are within {same[0]}-{same[1]}; range "
          f"{flat.min():.3f}x (D={flat.idxmin()[0]}, causal={flat.idxmin()[1]}, "
          f"N={flat.idxmin()[2]}) to {flat.max():.3f}x")

# %%
nb.compare("fp16", names=["sdpa_efficient", "04_wmma", "05_mma", "06_swizzle", "sdpa_flash"])

# %% [markdown]
# ### Discussion
#
# Predicted: stage 05's time (0.97–1.03×). Measured, with both stages timed in turn: 1.03× at the
# teaching config (169 → 174 TFLOP/s), at the edge of the band, and 0.98–1.07× over the sweep, in
# two directions. At D = 128 stage 06 is 0.5–2 % slower at every point, about what its extra integer
# instructions cost (+1.0 % a loop trip). At D = 64 it is faster the longer the sequence, 1.01–1.07×
# from N = 2048 on, far more than its +0.9 % of extra instructions would take back; the model
# counted the same wavefronts for both and does not explain that gain, nor does occupancy (three
# blocks an SM for both, the table in section 3). Timed in separate runs, one stage after the other,
# the two come out equal within 2 % everywhere: the GPU's clock, which drifts by a few per cent
# between runs, hid both effects. The single launch that Nsight Compute profiles (section 7) has
# stage 06 2 % shorter.

# %% [markdown]
# ## 7 · The profile: bank conflicts
#
# Nsight Compute counts **bank conflicts** per direction: the wavefronts beyond the fewest each
# request could have taken. A count means little alone; below it, each as a share of all
# shared-memory wavefronts, and the wavefronts measured over the model's.

# %%
shown = ["smem_load_bank_conflicts", "smem_store_bank_conflicts", "smem_wavefronts",
         "duration_ms", "tensor_pipe_pct", "achieved_occupancy_pct"]
predicted = pd.Series({"05_mma": padded, "06_swizzle": swizzled})
with nb.unless_missing():
    prof = nb.profile("06_swizzle")
    display(prof.loc[[m for m in shown if m in prof.index]])
    wf = prof.loc["smem_wavefronts"]
    display(pd.DataFrame({
        "load conflicts, % of wavefronts": 100 * prof.loc["smem_load_bank_conflicts"] / wf,
        "store conflicts, % of wavefronts": 100 * prof.loc["smem_store_bank_conflicts"] / wf,
        "wavefronts, measured / model": wf / predicted}).T.round(3))

# %% [markdown]
# These counters cover the whole shared-memory pipe. Nsight Compute's **source view** splits the
# traffic per SASS instruction instead: wavefronts taken, the fewest possible (ideal), and the
# excess, here summed per opcode:

# %%
from flashlab import profile as ncu

for s in ("05_mma", "06_swizzle"):
    try:
        by_op = ncu.shared_by_opcode(s)
    except FileNotFoundError as err:
        print(err)
        continue
    print(f"{s}: {by_op['wavefronts'].sum():.0f} wavefronts, {by_op['excessive'].sum():.0f} "
          f"beyond the ideal; the model: {predicted[s]:.0f}")
    display(by_op)

# %% [markdown]
# ### Discussion
#
# Predicted: about zero conflicts, and stage 05's wavefronts. Measured: stage 06 has about 6 700
# conflicts (2 700 on loads, 3 900 on stores) in 1.1·10⁷ wavefronts, 0.06 %; stage 05 about
# 57 000, 0.51 %. Load conflicts rose, 700 → 2 700, but that is 0.006 % → 0.025 % of the
# wavefronts: noise, not a regression. A real conflict costs whole multiples (dense rows: 6.6×
# the wavefronts). Both predictions held.
#
# The source view is sharper: in both stages every `LDSM`, `STS` and `LDS` took exactly its ideal
# wavefronts, summing to the model's 10 747 904. The aggregate counter sees 3 % more wavefronts
# and a residue of conflicts no instruction's addresses explain: requests also compete for the
# banks with other traffic in flight (shared memory and the L1 cache share them).

# %% [markdown]
# ## 8 · What is next
#
# Stage 06 still fills a tile through registers (load, wait, store) and meets at a barrier
# before any math: while a K/V tile is in flight the tensor cores idle. **Stage 07** copies
# global memory straight into shared memory with `cp.async`, into a second buffer, so the next
# tile loads while this one is computed. The second buffer's cost, bytes per block:

# %%
pd.DataFrame({"06_swizzle": smem["06_swizzle"],
              "07_cp_async (2 buffers)": {d_: fr.smem_bytes(d_, BR, BC, pad_bytes=0, stages=2)
                                          for d_ in (64, 128)}}).rename_axis("D")

# %% [markdown]
# ## Exercises
#
# ### Lab `06.bank_map`
#
# Section 2 set 16 bytes of padding beside the swizzle. What would padding by 32 bytes do? Draw its
# bank map, `fr.bank_map(2 * D + 32)`, and count the wavefronts of one `ldmatrix.x4` before
# checking.

# %%
from flashlab.course import labs
print(labs.prompt("06.bank_map"))

# %%
### BEGIN SOLUTION
first_bank = [(160 * r // 4) % 32 for r in range(8)]           # 0, 8, 16, 24, 0, 8, 16, 24
ways = max(first_bank.count(b) for b in first_bank)            # rows r and r + 4 collide: 2-way
answer = 4 * ways                                              # 4 phases of 2 wavefronts: 8
### END SOLUTION

# %%
labs.check("06.bank_map", answer)

# %% [markdown]
# ### Kernel exercise `06.swizzle` (10 points)
#
# **Where:** the function `swz` in `kernels/06_swizzle.cu`, between `// BEGIN EXERCISE 06.swizzle`
# and `// END EXERCISE 06.swizzle`. The stub puts every element at offset 0.
#
# **What to write:** the offset, in elements, of element (`row`, `col`) of a dense tile with `D`
# columns: rows `D` elements apart, and within a row the 16-byte chunk `col / 8` stored at chunk
# `(col / 8) XOR (row % 8)`. Every tile access goes through `swz`, so the check passes with any
# one-to-one layout; the time says whether yours is free of bank conflicts.
#
# **How it is judged.** `flashlab grade` builds stage 06 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, the strided layout of a model's projections, and keys whose size grows along
# the sequence, so that every row's maximum keeps rising and each rescale path runs. A wrong kernel
# scores 0, and the message names the first failing case and its first wrong element (batch, head,
# row, column, got, expected). A right one is timed at the teaching config and under the causal
# mask: when your instructor grades, in turn with the solution's stage on the same GPU, the slower
# of the two ratios counting; when you check your own work, against the solution's recorded speedup
# over stage 05. Full points within 5 % of the solution's speed, fewer below.
#
# **GPU:** compute capability 8.0 or newer (an A100, L4, RTX 30 or 40 series, H100); without one,
# `flashlab grade` skips it with one line saying why. Run it with
#
#     flashlab grade --exercise 06.swizzle

# %% [markdown]
# ## Questions for discussion
#
# 1. At D = 128 a row has 16 chunks. Why is `row % 8` still enough for `ldmatrix`, and what
#    would `row % 16` change?
# 2. At what share of the wavefronts would you start hunting for a conflict's cause, and which
#    measurement would you look at first?
# 3. The swizzle added 88 instructions to the D = 64 kernel but 4 to its K/V loop. What would
#    keep more of them in the loop, and when would the time show it?
# 4. The 3 KiB saved per block change no occupancy today. For which change to the kernel would
#    they decide the blocks per SM?

# %% [markdown]
# **Instructor's answer.** *1.* A phase reads one logical chunk from 8 consecutive rows. At D = 128
# a row is 256 bytes, two rows of banks, so chunk c lies in banks 4 (c mod 8) to 4 (c mod 8) + 3 in
# either half; XOR with `row % 8` gives the 8 rows 8 different values of c mod 8, hence 8 bank
# groups, all a phase needs. `row % 16` would also flip bit 3 of the chunk for rows 8–15, moving it
# to the other half of the row, into the same banks: no conflict removed, an instruction more, and
# at D = 64 (8 chunks a row) an offset outside the row.

# %% [markdown]
# **Instructor's answer.** *2.* At a few per cent, and only if the time moves: the residue here is
# 0.06–0.46 %, while a real conflict costs whole multiples (dense rows: 6.6× the wavefronts). Look
# first at the source view's wavefronts beyond the ideal, per SASS instruction: it names the
# instruction whose addresses conflict (here every `LDSM`, `STS` and `LDS` took its ideal); then
# compute that instruction's addresses with the bank model.

# %% [markdown]
# **Instructor's answer.** *3.* The offsets depend only on the lane and the unrolled indices, so
# the compiler computes them once. They would stay in the loop if they depended on the tile (a
# buffer picked at run time, as stage 07's `j % STAGES`) or if registers ran short, so that the
# compiler recomputes instead of holding them. The time shows it when the loop is bound by issue or
# by its dependent chains: stage 08's `LANE_OFFSETS`, which computes each lane's swizzled offsets
# once at 255 registers, gained 11–19 %.

# %% [markdown]
# **Instructor's answer.** *4.* A change that makes shared memory the binding limit: more buffers
# or bigger tiles. With three K/V buffers at D = 128 a padded block needs 121 856 bytes and a
# swizzled one 114 688: one block per SM against two (each block also reserves 1 KiB of the
# 228 KiB), if registers allow two. At D = 64 with three buffers: 3 blocks against 4, if registers
# fell to 128 a thread.

# %% [markdown]
# ## Summary
#
# - An XOR swizzle (`chunk ^ row % 8`) gives the 8 rows of an `ldmatrix` phase 8 different bank
#   groups with dense rows: the padding's 4 wavefronts a request, 3 KiB less shared memory.
# - Changing addresses alone costs integer instructions, mostly moved out of the K/V loop by the
#   compiler: the time moves by a few per cent, 1–2 % slower at D = 128 and up to 6 % faster at
#   D = 64's long sequences, where the traffic model sees no difference.
# - Bank conflicts are read as a share of wavefronts; the per-instruction source view says
#   whether an instruction's addresses conflict.
# - Dense power-of-two tiles are what `cp.async` (stage 07) and TMA copy into.

# %%
nb.reached("06_swizzle")
