# %% [markdown]
# # 06 · Swizzled shared memory: conflict-free without padding
#
# Stage 05 feeds the tensor cores from shared memory with `ldmatrix`, and to keep those loads
# free of bank conflicts it stores every row of Q, K and V **16 bytes longer than it is**. This
# stage changes exactly one thing: **rows stay dense, and the 16-byte chunks inside each row are
# permuted instead** — logical chunk `c` of row `r` is stored at chunk `c XOR (r % 8)`. The
# kernel computes the same thing with the same instructions; only addresses change.
#
# Why bother, if the padding already works? It costs shared memory (16 bytes on every 128-byte
# row at D = 64), it gives rows an odd stride, and the asynchronous copies of stage 07 and the
# TMA unit of Hopper GPUs work on dense, power-of-two tiles. An XOR swizzle like this one is how
# CUTLASS and FlashAttention lay out their tiles.
#
# Everything before the measurement — bank maps, wavefront counts, shared-memory sizes, the
# machine code — is computed from the kernels' own indexing (`flashlab/fragments.py`) and the
# compiler, and needs no GPU.

# %%
%matplotlib inline
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
# Here is every line that differs from stage 05. The first hunk swaps stage 05's header for this
# stage's, which says what it does and why. Then the code: the `Tiles` struct loses `LD` (the
# padded row stride), a function `swz` appears, and every place that computed `row * LD + col`
# now calls `swz<D>(row, col)` — the tile copies, the three `ldmatrix` calls and the write-out
# of O.

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
# * `<< 3` turns the chunk back into an element offset, and `row * D` is a dense row.
#
# The low 3 bits of `col`, the position inside a chunk, are not touched: every 16-byte chunk
# stays contiguous, which is what `ldmatrix` (8 rows of 16 bytes) and the 16-byte copies need.
# XOR with a number below 8 only touches the chunk number's low 3 bits, so at D = 128
# (16 chunks a row) it permutes each half of the row within itself.
#
# The table is the whole swizzle at D = 64: where each logical chunk (column) of rows 0..7 is
# stored. It is computed by `fragments.smem_offset`, which `tests/test_fragments.py` checks
# against the kernel's `swz` for every row and column. Every row is a permutation of 0..7, and
# so is every column: the 8 rows ask for the same logical chunk, and get 8 different places.

# %%
D, BR, BC = 64, 64, 64  # the teaching config's head dim; the kernel's tile sizes
rows8, chunks = np.indices((8, D // 8))
where = fr.smem_offset(rows8, 8 * chunks, 2 * D, swizzle=True) % (2 * D) // 16
pd.DataFrame(where, index=pd.Index(range(8), name="row"),
             columns=pd.Index(range(D // 8), name="logical chunk → stored at chunk"))

# %% [markdown]
# XOR is its own inverse (`(c ^ r) ^ r = c`), so nothing else is needed to read a tile back: the
# reader applies the same `swz`. And a row is 128 bytes at D = 64 — exactly one row of the 32
# banks — so a chunk's position in its row decides its banks: chunk `k` is banks `4k .. 4k + 3`.
#
# ## 2 · Banks: dense, padded, swizzled
#
# Notebook 05 (section 7) introduced the model: shared memory serves a warp's request in
# **wavefronts**, passes of at most 128 bytes with at most one 4-byte word per bank (32 banks);
# `ldmatrix.x4` is served one 8 × 8 matrix at a time, 8 lanes each pointing at a 16-byte row.
# Below, the first 8 rows of a tile in the three layouts: dense rows (stage 05 without its
# padding), stage 05's padded rows, and this stage's swizzle. Each chunk is labelled with the
# first bank it lands in; the red box is what one `ldmatrix` phase reads, the same logical chunk
# of 8 consecutive rows.

# %%
fr.bank_maps(D)

# %% [markdown]
# Dense, the red column sits in banks 0–3 eight times over: 8 wavefronts for one phase. The
# padding shifts row `r` by `4r` banks; the swizzle moves chunk 0 of row `r` to chunk `r`. Both
# spread the column over all 32 banks.
#
# The same comparison lane by lane, for each of the kernel's shared-memory requests
# (`fragments.warp_access` holds the kernel's addresses): a row per lane, a column per bank, and
# the number in a lane's cells is the wavefront that serves it. First the `ldmatrix.x4` that
# reads K for `S = Q Kᵀ` (8 keys × 32 dims), its 4 phases between the thick lines:

# %%
fr.bank_comparison("ldmatrix K", D)

# %% [markdown]
# The `ldmatrix.x4` of Q, and the `.trans` one of V, read a 16 × 16 block: each phase is 8
# consecutive rows of one 8-column half. Same story:

# %%
fr.bank_comparison("ldmatrix Q, V", D)

# %% [markdown]
# **The 16-byte stores that fill a tile.** `load_tile` hands consecutive chunks to consecutive
# threads, so at D = 64 lanes 0–7 write all 8 chunks of one row, lanes 8–15 the next row, and so
# on. A row is 128 bytes in 32 different banks whatever order its chunks are in, so all three
# layouts store a warp's 512 bytes in the minimum of 4 wavefronts. (The write-out reads O's rows
# back from shared memory with the same addresses.)

# %%
fr.bank_comparison("tile rows", D)

# %% [markdown]
# **The write-out of O.** At the end, each lane stores its accumulators as 4-byte pairs: lane
# (`g`, `t`) writes row `g`, columns `2t, 2t + 1` of each 8-column tile. The 8 groups `g` write
# the same logical chunk of 8 consecutive rows — in dense rows, 8 times the same 4 banks. The
# padding and the swizzle both spread them over all 32:

# %%
fr.bank_comparison("O stores", D)

# %% [markdown]
# Every request of the kernel, in wavefronts per warp, at D = 64 and D = 128 (with
# `tests/test_fragments.py` checking that every other loop index, warp and copy trip costs the
# same as the one counted):

# %%
for d_ in (64, 128):
    display(fr.access_table(d_))

# %% [markdown]
# Summed over a whole launch at the teaching config (B = 4, H = 16, N = 1024), with each
# request's count per K/V tile and block (`fragments.launch_wavefronts`, as in notebook 05):

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
# 06 in rows of `D`. `fragments.smem_bytes` computes both (its test evaluates the kernels'
# `Tiles::SMEM_BYTES` expressions, so the numbers below are the kernels'):

# %%
layouts = {"05_mma": dict(pad_bytes=16), "06_swizzle": dict(pad_bytes=0)}
smem = pd.DataFrame({s: {d_: fr.smem_bytes(d_, BR, BC, **how) for d_ in (64, 128)}
                     for s, how in layouts.items()}).rename_axis("D")
smem["saved"] = smem["05_mma"] - smem["06_swizzle"]
smem["saved_%"] = (100 * smem["saved"] / smem["05_mma"]).round(1)
smem

# %% [markdown]
# Whether that buys more resident blocks depends on which limit binds. `ptxas` reports the
# registers; `tiling.occupancy` turns registers and shared memory into blocks per SM:

# %%
with nb.unless_missing():
    display(pd.concat({s: nb.blocks_per_sm(s, smem[s].to_dict()) for s in layouts}, names=["stage"]))

# %% [markdown]
# Where registers decide, the saved bytes change nothing today: they are headroom. Stage 07
# spends them, on a second buffer for K and V.
#
# **A dense, power-of-two layout.** With the swizzle, row `r` of a tile starts at `r · 2D` bytes
# and a tile is a plain `rows × 2D`-byte block. That is what the next stages want: `cp.async`
# (stage 07) copies 16-byte chunks to any such address, and Hopper's TMA unit, which copies
# whole tiles, can apply this very XOR pattern itself (its 128-byte swizzle mode) — but only to
# dense tiles. A padded layout fits neither as neatly.
#
# ## 4 · Prediction, before measuring
#
# Stage 06 runs the same instructions as stage 05 on different addresses. The compiler can say
# whether that holds: the instruction categories of the two kernels (static counts, each
# instruction as often as it appears in the code; compiled now, or as recorded where `nvcc` is
# missing), for fp16 (bf16 compiles to the same counts):

# %%
with nb.unless_missing():
    mix = pd.concat([nb.instructions("05_mma"), nb.instructions("06_swizzle")]).droplevel("stage")
    display(mix[mix.index.str.contains("__half")].T)
    for d_ in (64, 128):
        a, b = (mix.loc[f"{k}<__half, {d_}, {BR}, {BC}>"] for k in ("mma_kernel", "swizzle_kernel"))
        differ = [c for c in mix.columns if c != "total" and a[c] != b[c]]
        print(f"D={d_}: categories that differ: {', '.join(differ) or 'none'}; "
              f"total {a['total']} -> {b['total']}")

# %% [markdown]
# Where the totals differ, it is integer work the categories do not name: computing
# `c ^ (r % 8)` takes instructions that `r * LD + c` folded into address offsets. The opcodes
# whose counts changed:

# %%
with nb.unless_missing():
    display(nb.opcode_changes(["05_mma", "06_swizzle"]))

# %% [markdown]
# What matters is what runs once per K/V tile. `flashlab.sass.loops` finds the K/V loop in the
# machine code (the backward branch around the `HMMA`s) and counts one trip of it:

# %%
with nb.unless_missing():
    totals = pd.concat([nb.instructions("05_mma"), nb.instructions("06_swizzle")])["total"]
    for d_ in (64, 128):
        body = nb.loop_bodies(["05_mma", "06_swizzle"], kernel=rf"__half, {d_},")
        display(body)
        kernel = totals[totals.index.get_level_values("kernel").isin(body["kernel"])].droplevel("kernel")
        loop = body["instructions"]
        print(f"D={d_}: stage 06 has {kernel['06_swizzle'] - kernel['05_mma']:+d} instructions in "
              f"the whole kernel, {loop['06_swizzle'] - loop['05_mma']:+d} of them in the K/V loop "
              f"({loop['06_swizzle'] / loop['05_mma'] - 1:+.1%} per trip)")

# %% [markdown]
# The swizzled addresses depend on the lane and on the indices of the unrolled `ldmatrix` loops,
# not on which K/V tile is in the buffer, so the compiler can compute them before the K/V loop
# starts; the printout says how many of the extra instructions it left inside. So, before
# measuring:
#
# * **time: the same as stage 05**, within a few per cent (we call a ratio between 0.97 and 1.03
#   "the same") at the teaching config and over the whole sweep;
# * **bank conflicts: about zero in both stages**, loads and stores alike;
# * **shared-memory wavefronts: the same in both**, the launch totals of section 2.

# %%
same = (0.97, 1.03)  # time(05) / time(06) that counts as "the same"

# %% [markdown]
# ## 5 · Measure
#
# On a GPU this builds the stage, checks it against a float64 reference (N = 1, 17, 1000, 4096;
# D = 64 and 128; causal and not; fp16 and bf16), times it at the teaching config (B = 4,
# H = 16, N = 1024, D = 64) and over the FlashAttention sweep, and records the rows in `data/`.
# Without a GPU it shows the recorded rows.

# %%
ev = nb.evaluate("06_swizzle")
ev

# %% [markdown]
# ## 6 · Prediction against measurement

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    ratio = nb.speedup("05_mma", "06_swizzle", "fp16")
    verdict = "the same, as predicted" if same[0] <= ratio <= same[1] else \
        ("faster than predicted" if ratio > same[1] else "slower than predicted")
    print(f"stage 06: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config); "
          f"{ratio:.3f}x stage 05's speed: {verdict}.")
    if ratio < same[0]:
        print("Slower: the swizzle's extra integer instructions cost issue slots, or a layout "
              "change moved conflicts somewhere; the profile (section 7) tells which.")
    elif ratio > same[1]:
        print("Faster: not from the banks (both are conflict-free in the model); look at "
              "occupancy and the instruction counts above, and at run-to-run noise "
              "(p20/p80 in the evaluation above).")

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
nb.compare("fp16")

# %% [markdown]
# ## 7 · The profile: bank conflicts
#
# Nsight Compute counts shared-memory **bank conflicts** per direction,
# `l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum` and `..._op_st.sum` (flashlab's
# `smem_load_bank_conflicts`, `smem_store_bank_conflicts`): the wavefronts beyond the fewest
# each request could have taken — the model's "wavefronts − ideal". Next to them the
# wavefronts themselves, which the model predicts for the whole launch.

# %%
shown = ["smem_load_bank_conflicts", "smem_store_bank_conflicts", "smem_wavefronts",
         "duration_ms", "tensor_pipe_pct", "achieved_occupancy_pct"]
predicted = {"05_mma": padded, "06_swizzle": swizzled}
with nb.unless_missing():
    prof = nb.profile("06_swizzle")
    display(prof.loc[[m for m in shown if m in prof.index]])
    conflicts = {}
    for s in [c for c in layouts if c in prof.columns]:
        m = prof[s]
        conflicts[s] = m.get("smem_load_bank_conflicts", np.nan) + m.get("smem_store_bank_conflicts", np.nan)
        wf = m.get("smem_wavefronts", np.nan)
        print(f"{s}: {conflicts[s]:.4g} bank conflicts = {conflicts[s] / wf:.2%} of its {wf:.4g} "
              f"wavefronts; the model: 0 conflicts, {predicted[s]:.4g} wavefronts "
              f"(measured / model = {wf / predicted[s]:.3f})")
    c06, c05 = conflicts["06_swizzle"], conflicts.get("05_mma", np.nan)
    if c06 / prof["06_swizzle"].get("smem_wavefronts", np.nan) < 0.01:
        print("As predicted: the swizzle leaves (practically) no conflicts, without a byte of "
              "padding.")
    elif c05 != c05:
        print("Conflicts where the model predicts none; stage 05 is not profiled to compare "
              "with: `flashlab run 05 --profile`.")
    elif c06 <= 1.1 * c05:
        print("Not zero, but no more than stage 05's padded layout has: the swizzle matches the "
              "padding, and both leave conflicts the per-request model does not see. Nsight "
              "Compute's source view (per instruction) says which requests they come from.")
    else:
        print("More conflicts than predicted, and more than stage 05: some request's addresses "
              "are not what fragments.warp_access models. The larger of the load and store "
              "counts above says which direction; the source view of Nsight Compute, which "
              "instruction.")

# %% [markdown]
# The aggregate counters are hardware counts for the whole shared-memory pipe, and a small
# residue in them need not belong to any one instruction's addresses (accesses of different warps
# in flight together can also collide). Nsight Compute's
# **source view** (section `SourceCounters`, recorded beside the metrics by
# `flashlab.profile.profile_source`) splits the traffic per SASS instruction: wavefronts taken,
# the fewest possible (ideal), and the excess. Summed per opcode:

# %%
from flashlab import profile as prof

for s in ("05_mma", "06_swizzle"):
    try:
        by_op = prof.shared_by_opcode(s)
    except FileNotFoundError as err:
        print(err)
        continue
    print(s)
    display(by_op)
    ldsm = by_op.loc["LDSM"] if "LDSM" in by_op.index else None
    if ldsm is not None:
        print(f"{s}: ldmatrix took {ldsm.wavefronts:.4g} wavefronts, {ldsm.excessive:.4g} more "
              f"than the ideal {ldsm.ideal:.4g}" + (": conflict-free, instruction by instruction."
                                                    if ldsm.excessive == 0 else "."))

# %% [markdown]
# The same two counters as paired bars, stage 05 against stage 06 (the stage's
# `idea_metrics` in the registry, `flashlab/stages.py`, name them):

# %%
plots.idea_metrics(only=["06_swizzle"])

# %% [markdown]
# ## 8 · What is next
#
# Stage 06 made the tiles dense without changing how they are filled: every thread loads 16
# bytes from global memory into registers, waits for them, stores them to shared memory, and the
# block meets at a barrier before any math starts. For the whole time a K/V tile is in flight,
# the block's tensor cores have nothing to do. **Stage 07** copies global memory straight into
# shared memory with `cp.async`, in the background, into a second buffer: the next tile loads
# while this one is computed. The second buffer costs shared memory — per block, in bytes:

# %%
pd.DataFrame({"06_swizzle": smem["06_swizzle"],
              "07_cp_async (2 buffers)": {d_: fr.smem_bytes(d_, BR, BC, pad_bytes=0, stages=2)
                                          for d_ in (64, 128)}}).rename_axis("D")
