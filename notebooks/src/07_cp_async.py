# %% [markdown]
# # 07 · cp.async: the next tile loads while this one is computed
#
# Up to stage 06, a block handles each K/V tile in three steps that never overlap: it **loads**
# the tile (global memory → registers → shared memory), meets at a **barrier**, and **computes**
# (`S = Q Kᵀ`, softmax, `O += P V`). While a tile is in flight — hundreds of clock cycles from
# the L2 or DRAM — the block's tensor cores have nothing to do.
#
# This stage changes one thing: **K and V are copied with `cp.async`**, an Ampere instruction
# that moves 16 bytes from global to shared memory without passing through registers and without
# making the thread wait. With two buffers for K and V, the block starts the copy of tile `j + 1`
# and computes tile `j` while it travels.
#
# The figures and counts before the measurement — the timeline model, the shared-memory sizes,
# the machine code — need no GPU.

# %%
%matplotlib inline
import re

import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import diagrams as dg
from flashlab import fragments as fr
from flashlab import notebook as nb
from flashlab import plots
from flashlab.paths import KERNELS
nb.banner("07_cp_async")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
sms, roof = here.sms, here.roof  # roof: the ceilings `flashlab run` measured on it
print(here)

# %% [markdown]
# ## 1 · Where stage 06 waits
#
# Stage 06's loop over K/V tiles starts like this:

# %%
nb.show_lines("06_swizzle", r"for \(int j = 0; j < n_tiles; j\+\+\)", r"^    __syncthreads\(\);\s*$")

# %% [markdown]
# and `load_tile` moves each 16-byte chunk through a register, `x`:

# %%
nb.show_source("06_swizzle", "load_tile")

# %% [markdown]
# Follow one thread. It issues its global loads (`LDG.E.128` in the machine code) — that is
# quick — but the store to shared memory (`STS.128`) needs the loaded value in `x`, so the
# thread **waits for the data to arrive**: a *long scoreboard* stall, in Nsight Compute's words.
# Then all 4 warps meet at `__syncthreads()` and the slowest decides: a *barrier* stall. Only
# then does the math start, and the next tile is not requested until the math is over (the
# first barrier of the next iteration makes sure nobody overwrites K and V while a warp still
# reads them). Per tile, time = load + compute.
#
# Other blocks on the same SM — the launch bounds leave room for 3 at D = 64 and 2 at D = 128,
# section 3 checks how many fit — can compute while this one waits, and that is the only overlap
# stage 06 gets.
#
# ## 2 · cp.async, commit, wait
#
# `kernels/ptx.cuh` wraps the three PTX instructions:

# %%
nb.show_source("ptx.cuh", "cp_async_16")
nb.show_lines("ptx.cuh", r"^// Close the group", r"void cp_async_commit")
nb.show_source("ptx.cuh", "cp_async_wait")

# %% [markdown]
# * **`cp.async.cg.shared.global [dst], [src], 16, src_bytes`** starts a 16-byte copy from global
#   to shared memory and returns at once. No register holds the data, so nothing in the thread
#   depends on it; `.cg` caches it in L2 only (there is no reuse in L1 to be had). With
#   `src_bytes = 0` it reads nothing and writes 16 zero bytes: the kernel uses that for key rows
#   past N, which stage 06 zeroed by hand.
# * **`cp.async.commit_group`** closes the copies this thread issued since the last commit into a
#   *group*.
# * **`cp.async.wait_group N`** waits until every group of this thread but the N most recent
#   ones is complete: at most N still in flight. It only covers the thread's own copies; a
#   `__syncthreads()` after it makes every thread's copies visible to the whole block.
#
# ## 3 · The pipeline in the kernel
#
# The copy function is stage 06's `load_tile` with `cp_async_16` in place of the load and store:

# %%
nb.show_source("07_cp_async", "load_tile_async")

# %% [markdown]
# K and V now have `STAGES` buffers each (`PIPELINE_STAGES = 2`). Before the loop, the
# **prologue** issues Q and the first `STAGES − 1` K/V tiles, one group each (Q rides with tile
# 0), waits for the first and reads Q into registers:

# %%
nb.show_lines("07_cp_async", r"// Prologue:", r"__syncthreads\(\);")

# %% [markdown]
# Then each iteration waits for tile `j`, issues tile `j + STAGES − 1` into the buffer that tile
# `j − 1` used, and computes tile `j`:

# %%
nb.show_lines("07_cp_async", r"for \(int j = 0; j < n_tiles; j\+\+\)", r"const T\* Vt = ")

# %% [markdown]
# One barrier per tile now does two jobs: after it, every thread's copies of tile `j` have
# landed, *and* every warp has finished with tile `j − 1`, so its buffer may be refilled. A
# group is committed even when there is nothing left to copy, so that "tile `j` has arrived"
# is always "at most `STAGES − 2` groups pending". With two stages that is `wait_group 0`:
# wait for everything issued so far — which, at the top of iteration `j`, is just tile `j`,
# because tile `j + 1` is only issued after the wait.
#
# Which buffer holds what, from the kernel's own expressions (`next = j + STAGES − 1`,
# `next % STAGES`, `j % STAGES`), at the teaching config's 16 K/V tiles:

# %%
source07 = (KERNELS / "07_cp_async.cu").read_text()
STAGES = int(re.search(r"PIPELINE_STAGES = (\d+);", source07).group(1))
D, BR, BC = 64, 64, 64  # the teaching config's head dim; the kernel's tile sizes
n_tiles = fl.TEACHING.N // BC
steps = [dict(step="prologue", waits_for="Q and tile 0", computes="–",
              copies=", ".join(f"tile {t} → buffer {t % STAGES}" for t in range(STAGES - 1)))]
for j in range(n_tiles):
    nxt = j + STAGES - 1
    steps.append(dict(step=f"iteration {j}", waits_for=f"tile {j}" if j else "–",
                      computes=f"tile {j} from buffer {j % STAGES}",
                      copies=f"tile {nxt} → buffer {nxt % STAGES}" if nxt < n_tiles
                      else "nothing (an empty group)"))
plan = pd.DataFrame(steps).set_index("step")
pd.concat([plan.head(4), plan.tail(2)])

# %% [markdown]
# **Shared memory.** Two buffers of K and V cost what stage 06 saved on padding and more
# (`fragments.smem_bytes`, whose test evaluates the kernels' `Tiles::SMEM_BYTES`). Whether the
# SM still holds as many blocks, `ptxas`'s registers and `tiling.occupancy` say:

# %%
layouts = {"06_swizzle": dict(pad_bytes=0), "07_cp_async": dict(pad_bytes=0, stages=STAGES)}
smem = pd.DataFrame({s: {d_: fr.smem_bytes(d_, BR, BC, **how) for d_ in (64, 128)}
                     for s, how in layouts.items()}).rename_axis("D")
with nb.unless_missing():
    display(pd.concat({s: nb.blocks_per_sm(s, smem[s].to_dict()) for s in layouts}, names=["stage"]))
smem

# %% [markdown]
# ## 4 · A timeline model
#
# How much can overlapping buy? A **model** of one block's K/V loop, with two numbers per tile:
#
# * **load**: the tile's bytes (K and V, `2 · BC · D · 2`) at the SM's share of the measured DRAM
#   copy bandwidth (`data/peaks.csv`: bandwidth / SMs, every SM loading at once);
# * **compute**: the slower of the tensor cores — the tile's `4 · BR · BC · D` FLOPs at the SM's
#   share of the measured fp16 matmul rate — and shared memory, one wavefront a clock for the
#   `ldmatrix` and copy wavefronts of `fragments.tile_cost` (notebook 05 found shared memory the
#   tighter of the two).
#
# It is a bandwidth model: no latency term, one block per SM, every tile from DRAM. The L2
# serves most tiles in reality (16 query blocks read each K/V tile, one of them from DRAM), so
# the load time below is an upper end.

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM, as in notebooks 02, 03 and 05
per_sm = {"DRAM bytes/ns": roof["copy_tbps"] * 1e3 / sms,
          "tensor FLOP/ns": roof["matmul_fp16_tflops"] * 1e3 / sms}
model = {}
for d_ in (64, 128):
    c_ = fr.tile_cost(d_, BR, BC, pad_bytes=0, swizzle=True)
    model[d_] = {"bytes": c_.global_bytes, "FLOPs": c_.flops, "wavefronts": c_.wavefronts,
                 "load ns (DRAM)": c_.global_bytes / per_sm["DRAM bytes/ns"],
                 "tensor ns": c_.flops / per_sm["tensor FLOP/ns"],
                 "shared-memory ns": c_.wavefronts / clock_ghz}
model = pd.DataFrame(model).T.rename_axis("D")
model["compute ns"] = model[["tensor ns", "shared-memory ns"]].max(axis=1)
model["bound"] = [dg.pipeline_speedup_bound(r["load ns (DRAM)"], r["compute ns"])
                  for _, r in model.iterrows()]
load_ns, compute_ns = model.at[D, "load ns (DRAM)"], model.at[D, "compute ns"]
model.round(2)

# %% [markdown]
# At D = 128 both the bytes and the work double, so the two times keep their ratio. Drawn for a
# handful of tiles (`diagrams.pipeline_schedule` plays both loops through; its test checks that
# no tile is computed before it lands and no buffer is refilled before its tile is done):

# %%
dg.pipeline_timeline(load_ns, compute_ns, tiles=6)

# %% [markdown]
# Serially a tile costs `load + compute`; overlapped, once the pipeline is full, only
# `max(load, compute)` — whichever is longer hides the other. So over many tiles
#
# $$\text{speedup}_{07/06} \;\le\; \frac{\text{load} + \text{compute}}{\max(\text{load}, \text{compute})} \;\le\; 2,$$
#
# with 2 only when the two are equal. A second buffer cannot beat that in this model: more
# stages help when load times vary (latency jitter), not when the copy is simply slower than the
# math.

# %%
bound = model.at[D, "bound"]
print(f"model at D={D}: load {load_ns:.0f} ns, compute {compute_ns:.0f} ns a tile -> speedup at "
      f"most {bound:.2f}x; if the L2 delivered tiles as fast as the math uses them: 2x")

# %% [markdown]
# ## 5 · Prediction, before measuring
#
# * **Time.** Between 1x and the bound above, for the teaching config. Not the bound itself:
#   stage 06 already overlaps one block's loads with *another* block's math on the same SM, which
#   the one-block model leaves out. The more blocks an SM holds, the more of that it gets — so
#   the gain should be **larger at D = 128** (fewer blocks per SM, section 3) than at D = 64.
# * **Stall reasons** (Nsight Compute, share of warp time): **long_scoreboard falls** — no
#   thread waits for loaded data in a register any more; what remains is the
#   `cp.async.wait_group` when a copy is late. **barrier falls** — one barrier per tile instead
#   of two, and it no longer waits for the slowest warp's loads to turn into stores.
#   **mio_throttle** may rise: the copies and `ldmatrix` now compete for the same memory
#   instruction queue while the math runs.
# * **Machine code**: `LDGSTS` (cp.async) appears and `LDG.E.128` disappears, along with the
#   `STS.128` of the tile copies; the K/V loop has one `BAR` instead of two.

# %%
gain_band = (1.0, bound)

# %% [markdown]
# ## 6 · The machine code
#
# Static counts (compiled now, or as recorded where `nvcc` is missing), fp16 kernels:

# %%
with nb.unless_missing():
    mix = pd.concat([nb.instructions("06_swizzle"), nb.instructions("07_cp_async")])
    display(mix[mix.index.get_level_values("kernel").str.contains("__half")].droplevel("stage").T)

# %% [markdown]
# One trip of the K/V loop (`flashlab.sass.loops`: the loop the backward branch around the
# `HMMA`s closes):

# %%
with nb.unless_missing():
    for d_ in (64, 128):
        display(nb.loop_bodies(["06_swizzle", "07_cp_async"], kernel=rf"__half, {d_},"))

# %% [markdown]
# The copies, waits and barriers themselves, at D = 64: the prologue's `LDGSTS` (Q, then K and
# V of tile 0 at the buffers' offsets), `LDGDEPBAR` closing the group (`commit_group`),
# `DEPBAR.LE SB0, 0x0` waiting for it (`wait_group 0`), and in the loop one wait, one
# `BAR.SYNC`, the refill and one commit. The predicate at the end of each `LDGSTS` (`!P0`, ...) is the
# kernel's `in ? 16 : 0` turned into a switch: it selects the zero fill for rows past N.

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("07_cp_async", r"LDGSTS|DEPBAR|BAR\.SYNC|\bLDS\b")))

# %% [markdown]
# The plain `LDS` that the category counts report for stage 07 are the `@!PT LDS RZ, [RZ]` lines
# above: predicated on `!PT`, "not true", they never execute, and load nothing into the zero
# register `RZ`; the compiler places them next to the copies. The opcodes whose counts changed
# from stage 06:

# %%
with nb.unless_missing():
    display(nb.opcode_changes(["06_swizzle", "07_cp_async"]))

# %% [markdown]
# ## 7 · Measure
#
# On a GPU this builds the stage, checks it against a float64 reference (N = 1, 17, 1000, 4096;
# D = 64 and 128; causal and not; fp16 and bf16), times it at the teaching config and over the
# FlashAttention sweep, and records the rows in `data/`. Without a GPU it shows the recorded rows.

# %%
ev = nb.evaluate("07_cp_async")
ev

# %% [markdown]
# ## 8 · Prediction against measurement

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    gain = nb.speedup("06_swizzle", "07_cp_async", "fp16")
    where = "inside" if gain_band[0] <= gain <= gain_band[1] else \
        ("below" if gain < gain_band[0] else "above")
    print(f"stage 07: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{gain:.2f}x stage 06: {where} the predicted {gain_band[0]:.2f} - {gain_band[1]:.2f}x")
    if where == "above":
        print("Above the bound: tiles arrive faster than the DRAM rate the model assumed (the L2 "
              "serves most of them), so load and compute are closer than modelled and the bound "
              "is nearer 2x.")
    elif where == "below":
        print("Slower than stage 06: the overlap bought less than the extra cost. Check the "
              "blocks per SM (section 3) and the stall reasons (section 9): a full memory "
              "instruction queue (mio_throttle) or fewer resident blocks would do it.")

# %% [markdown]
# The gain over the whole FlashAttention sweep (16k tokens, H · D = 2048, fp16; rows: head dim
# and mask, columns: N), and the check of the D = 64 versus D = 128 prediction:

# %%
with nb.unless_missing():
    gains = nb.sweep_ratio("07_cp_async", "06_swizzle")
    by_d = gains.mean(axis=1).groupby(level="D").mean()
    display(gains.round(3))
    print("mean gain by head dim: " + ", ".join(f"D={d_}: {g:.3f}x" for d_, g in by_d.items()))
    if {64, 128} <= set(by_d.index):
        larger = 128 if by_d[128] > by_d[64] else 64
        print(f"larger at D={larger}: "
              + ("as predicted (fewer blocks per SM hide less of stage 06's wait)" if larger == 128
                 else "not as predicted: at D=64 the overlap bought more, so the blocks sharing "
                      "an SM in stage 06 hid less of each other's wait than assumed"))

# %%
plots.scaling()

# %% [markdown]
# ## 9 · Stall reasons: what the warps wait for now
#
# Nsight Compute samples what each warp is doing, and for a warp that cannot issue, why. The
# three reasons this stage's idea targets (its `idea_metrics` in the registry, `flashlab/stages.py`), stage 06
# against stage 07, in % of the time warps are active:

# %%
WHY = {
    "long_scoreboard": "warps wait for global memory: copies still arrive later than the math "
                       "needs them (load > compute, the model's case); a deeper pipeline or "
                       "larger tiles (stage 08) give them more time",
    "barrier": "warps wait for each other at the one barrier per tile",
    "mio_throttle": "the memory instruction queue is full: copies and ldmatrix compete for it",
    "short_scoreboard": "warps wait for shared-memory results (ldmatrix) or the MUFU ex2 unit",
    "math_pipe_throttle": "the tensor (or another math) pipe is busy: the kernel is math-bound",
    "wait": "fixed-latency dependencies, e.g. an mma waiting for the previous one",
    "not_selected": "warps are ready but another one issues: the scheduler is busy",
    "selected": "issuing: the scheduler is busy",
}
idea = list(fl.stage("07_cp_async").idea_metrics)
with nb.unless_missing():
    prof = nb.profile("07_cp_async")
    stall_rows = prof.index[prof.index.str.startswith("stall_")]
    display(prof.loc[[m for m in ["duration_ms", "tensor_pipe_pct", "achieved_occupancy_pct"]
                      if m in prof.index] + list(stall_rows)].round(2))
    if "06_swizzle" not in prof.columns:
        raise nb.not_recorded("06_swizzle", " profile (to compare with)", " --profile")
    for m in idea:
        before, after = prof.at[m, "06_swizzle"], prof.at[m, "07_cp_async"]
        move = "fell" if after < before else "rose" if after > before else "did not move"
        print(f"{m}: {before:.1f}% -> {after:.1f}% of warp time: {move}")
    top = prof.loc[stall_rows, "07_cp_async"].sort_values(ascending=False)
    first = top.index[0].removeprefix("stall_")
    print(f"largest stall reason left in stage 07: {first} ({top.iloc[0]:.1f}%): "
          f"{WHY.get(first, 'see the Nsight Compute profiling guide')}")

# %% [markdown]
# All stall reasons of the tensor-core stages, stacked, then the three of this stage's idea as
# paired bars:

# %%
plots.stalls(only=["05_mma", "06_swizzle", "07_cp_async"])

# %%
plots.idea_metrics(only=["07_cp_async"])

# %% [markdown]
# ## 10 · What is next
#
# Stages 05–07 kept one shape: 64 query rows a block, 16 per warp, 64 keys a tile, at both head
# dims. **Stage 08** tunes what this notebook could only bound: it picks the tile shape per head
# dim and mask, gives each warp two row tiles (halving the `ldmatrix` traffic per FLOP), tries
# deeper pipelines and a few instruction-level changes, and lets an autotune on the GPU choose.
