# %% [markdown]
# # Stage 09 — wgmma: a warpgroup multiplies 64 × N × 16 at once, in the background
#
# Stages 05–08 fed the tensor cores one warp-sized `mma.sync` at a time: 16 × 8 × 16, both
# operands in registers, the warp waiting for each result. Hopper's tensor cores take a bigger,
# **asynchronous** instruction, **`wgmma.mma_async`**: four warps together (a *warpgroup*)
# multiply a 64 × N × 16 block, reading the operands straight from shared memory, while the
# threads go on with other work until they ask for the result.
#
# ## Objectives
# After this notebook you can:
# - read a `wgmma` instruction: its shape, where each operand comes from, its fp32 accumulators;
# - say which thread of a warpgroup holds which accumulator element, and why stage 08's softmax
#   code carries over unchanged;
# - encode a shared-memory matrix descriptor, and recognise stage 06's XOR swizzle in the
#   128-byte layout it names;
# - order asynchronous tensor-core work with `fence`, `commit_group` and `wait_group`, and let one
#   product run on while the threads start the next tile;
# - predict what the instruction change buys from stage 08's profile, and check it.
#
# **Prerequisites:** notebooks 05–08 (mma fragments, the swizzle, cp.async, the tuned shapes).
# The kernel needs a Hopper GPU (compute capability 9.0: H100, H200, GH200); elsewhere this
# notebook replays the numbers recorded on one.
#
# **Time:** about 25 min to read, 45 min to work through.

# %%
# %matplotlib inline
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import wgmma
from flashlab import notebook as nb
from flashlab import plots
nb.banner("09_wgmma")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
sms, roof = here.sms, here.roof  # roof: the ceilings `flashlab run` measured on it
print(here)

# %% [markdown]
# ## 1 · Where stage 08 stands
#
# Stage 08 is level with PyTorch's FlashAttention-2 backend, and its profile says the tensor pipe
# is busy about half the time:

# %%
with nb.unless_missing():
    p08 = nb.profile("08_tuned")
    display(p08.loc[["duration_ms", "tensor_pipe_pct", "sm_throughput_pct", "stall_wait",
                     "stall_math_pipe_throttle", "stall_selected"]].round(2))

# %% [markdown]
# Count what one warpgroup's worth of work costs in instructions. A K/V tile of BC keys against
# 64 query rows at head dim D is two products of 64 × BC × D. With `mma.sync.m16n8k16` every warp
# issues one instruction per 16 × 8 × 16 block of its 16 rows, plus the `ldmatrix` that bring
# its operands; with `wgmma.m64nNk16` the warpgroup issues one instruction per 16 columns of the
# reduction:

# %%
def instructions_per_tile(D, BC):
    """Tensor-core instructions for S = Q Kᵀ and O += P V, 64 rows x BC keys x head dim D."""
    mma_sync = 4 * ((BC // 8) * (D // 16) + (D // 8) * (BC // 16))   # 4 warps of 16 rows
    wgmma = D // 16 + BC // 16                                         # S: k over D, PV: k over BC
    return {"mma.sync (warp instructions)": mma_sync, "wgmma (warpgroup instructions)": wgmma,
            "FLOPs per mma.sync": 2 * 16 * 8 * 16, "FLOPs per wgmma (S)": 2 * 64 * BC * 16}


pd.DataFrame({(D, BC): instructions_per_tile(D, BC) for D, BC in [(64, 64), (128, 128)]}).rename_axis(
    columns=["D", "BC"])

# %% [markdown]
# Each `mma.sync` is a few hundred FLOPs that a warp must issue, feed from registers and wait
# for; a `wgmma` of 64 × 128 × 16 is 262 144 FLOPs in one instruction. That matters twice: the
# issue slots `mma.sync` and `ldmatrix` took go back to the softmax, and `mma.sync` cannot keep
# Hopper's tensor cores fed — on an H100 it peaks near two thirds of the chip's dense fp16 rate,
# while `wgmma` is what cuBLAS's own matrix products use to reach the ceiling notebook 00
# measured:

# %%
print(f"measured fp16 matmul ceiling on {here.name}: {roof['matmul_fp16_tflops']:.0f} TFLOP/s "
      f"(datasheet dense peak of an H100 SXM: 989)")

# %% [markdown]
# ## 2 · The instruction
#
# `kernels/hopper.cuh` wraps it, once with both operands in shared memory (`SS`) and once with A
# in registers (`RS`):

# %%
nb.show_lines("hopper.cuh", r"^// D \(64 x N, fp32\) = A B", r"^#define WGMMA_RS")
nb.show_source("hopper.cuh", "wgmma_ss")

# %% [markdown]
# * **`wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {d0..d63}, descA, descB, p, 1, 1, 0, 0`**
#   — all 128 threads of the warpgroup execute it together (`.sync.aligned`); it multiplies A
#   (64 × 16) by B (16 × 128) and adds to D, 64 fp32 registers in each thread, when the predicate
#   `p` (scale-d) is true, or overwrites D when it is false: the first k-step of S needs no
#   zeroing. The immediates are the scales of A and B (1) and whether each is transposed.
# * **`descA`, `descB`** are 64-bit *matrix descriptors*: where a tile sits in shared memory and
#   how it is laid out (section 4). With `RS`, A is four 32-bit registers per thread instead.
# * It returns at once. **`wgmma.fence`** orders the registers the threads wrote before it;
#   **`wgmma.commit_group`** closes a batch into a group; **`wgmma.wait_group N`** waits until
#   at most N groups are still running, and only then are their accumulators valid.
#
# ## 3 · Who holds what
#
# The accumulator of `m64nNk16` is spread over the 128 threads exactly as four warps' `mma.sync`
# accumulators would be: warp w holds rows 16w … 16w + 15, and inside a warp each 8-column tile is
# the `m16n8` C fragment of notebook 05.

# %%
wgmma.accumulator_figure(64)

# %%
acc = wgmma.accumulator_owner(128)
print(acc[acc["thread"] == 5].head(8).to_string(index=False))

# %% [markdown]
# Thread 5 (warp 0, lane 5: `g = 1`, `t = 1`) holds rows 1 and 9, columns 2–3 of every 8-column
# tile — the lane's place in notebook 05's fragment. So the whole softmax of stage 08 — quad
# shuffles for the row max and sum, the mask, `exp2`, the rescale — runs on `s[4n + i]` as it ran
# on `s[n][i]`, and the scores rounded to 16 bits are already the A operand of P·V, the `m16n8k16`
# A fragment per warp:

# %%
nb.show_lines("09_wgmma", r"// O \+= P V: P's 8-column tiles", r"wgmma_commit\(\);  // no wait")

# %% [markdown]
# ## 4 · Operands in shared memory: the descriptor and the 128-byte swizzle
#
# A descriptor names a tile by its start address and two strides, and names its layout by a
# swizzle mode. The bit fields, from the PTX ISA's "Matrix Descriptor Format":

# %%
nb.show_source("hopper.cuh", "wgmma_desc")
q_desc = wgmma.encode_descriptor(0x10400, 16, 1024)   # a Q tile at shared address 0x10400
wgmma.descriptor_figure(q_desc)

# %% [markdown]
# * **K-major** operands — Q (A of S) and K (B of S), whose reduction dim, the head dim, is
#   contiguous — need only the *stride byte offset*: 1024 bytes from one group of 8 rows to the
#   next. The leading offset is unused with a swizzle (set to 1, i.e. 16 bytes).
# * **V** is B of P·V with its reduction dim (the keys) *not* contiguous: it is read transposed
#   (`imm-trans-b = 1`, N-major), and the *leading byte offset* says how far apart its 64-column
#   blocks are.
#
# The swizzle mode says how rows are stored: **128-byte swizzle** — rows of 64 16-bit columns,
# 8 rows to an atom of 1024 bytes, and the 16-byte chunk `c` of row `r` stored at chunk
# `c ^ (r % 8)`. That is stage 06's XOR, now applied by the hardware to address bits 4–6 from
# bits 7–9, which is why every tile must start on a 1024-byte boundary. At D = 64 the two layouts
# are the same; at D = 128 the 128-byte swizzle splits the tile into two 64-column blocks:

# %%
wgmma.swizzle_figure(D=128)

# %%
nb.show_source("hopper.cuh", "sw128")
display(wgmma.swizzle_banks(64))

# %% [markdown]
# The kernel builds one descriptor per k-step: 16 columns further is 32 bytes further inside a
# 64-column block, and the next block starts `rows · 128` bytes on. At D = 128, BC = 128, with
# Q at shared address 0 and the first K tile right after the 32 KiB of Q:

# %%
BR, BC, D = 128, 128, 128
steps = []
for kk in range(D // 16):
    blk, in_row = kk // 4, (kk % 4) * 32
    for name, base, rows in (("Q (A)", 0, BR), ("K (B)", BR * D * 2, BC)):
        d = wgmma.decode_descriptor(wgmma.encode_descriptor(base + blk * rows * 128 + in_row, 16, 1024))
        steps.append(dict(k_step=kk, operand=name, **d))
pd.DataFrame(steps).set_index(["k_step", "operand"]).head(10)

# %% [markdown]
# **Where the descriptors live.** `HGMMA` reads a descriptor from *uniform registers* (`UR`): one
# 64-bit value for the whole warp, not one per thread. Q's descriptors depend on which warpgroup
# the thread is in (its 64 rows of the tile), and computed as `threadIdx.x / 128` that index is,
# as far as the compiler can prove, different in every thread. ptxas then keeps the loop's
# descriptors (K's and V's as well) in ordinary registers and copies each into uniform registers
# (`R2UR`) before its `wgmma`, tile after tile: 48 moves a tile at D = 128. Read from lane 0 with a shuffle, the index is one value
# for the warp by construction, and the descriptors are built in uniform registers once, before
# the loop:

# %%
nb.show_lines("09_wgmma", r"// The warpgroup index as lane 0 reads it", r"const int warp =")

# %% [markdown]
# ## 5 · The loop: fence, commit, wait — and P·V left running
#
# Loads are stage 08's `cp.async`, now writing the 128-byte swizzle (`load_tile_async`), so that
# the comparison with stage 08 is about the instruction. A block is two warpgroups (128 query
# rows; one under the causal mask at D = 128, section 5). The K/V loop:

# %%
nb.show_lines("09_wgmma", r"// This thread.s copies of tile j have landed", r"// Online softmax")

# %% [markdown]
# Two things are new besides the instruction, and one thing about the causal mask.
#
# * **`fence.proxy.async`.** `wgmma` reads shared memory through the *async proxy*, a path that
#   ordinary stores (and `cp.async`) are not ordered with by `__syncthreads` alone: each thread
#   fences its copies into the async proxy before the barrier publishes them.
# * **P·V runs on.** After issuing tile `j`'s P·V the warpgroup does not wait: it goes to the next
#   tile's barrier and issues S of tile `j + 1`, and the tensor cores take P·V of `j` and S of
#   `j + 1` back to back. The `wait_group 0` after S covers both, so O is final before the rescale.
#   The price is a buffer: while P·V of tile `j` still reads V of `j`, the loads may refill only
#   the buffer of tile `j − 2`, so with `STAGES` buffers the loads run `STAGES − 2` tiles ahead.
#   Before the first P·V no buffer is held, so the first `STAGES − 1` tiles are copied with Q.
#   `pick()` chooses 3 buffers of 128 keys at D = 64 (113 KiB of shared memory, two blocks per
#   SM) and at D = 128 without the mask (225 KiB, one block per SM). Two blocks of 256 threads leave 128 registers
#   a thread: enough for S (64 a thread) and O (32) only once the last P·V, which still reads P
#   from registers, has retired. So with two blocks an SM (`BLOCKS == 2`) a warpgroup waits for it
#   before issuing S; the other block's products keep the tensor cores busy meanwhile.
# * **Each warpgroup runs its own tiles.** Under the causal mask, the key tiles past a
#   warpgroup's last row are masked for all of its rows. It counts the ones it needs (`n_mine`)
#   and computes those, then only meets the block's barriers and issues its share of the loads
#   for the rest (the other warpgroup's rows still need them). There is no test inside the tile
#   loop; a skip branch there costs 3–10 % at D = 64 even where it is never taken.
#
# Under the causal mask the tiles on the diagonal, half masked, weigh more, and so do a block's
# start and end: its first loads, the wait for the first S, the write-back. So there `pick()`
# runs more blocks per SM, each with 2 buffers of 64 keys: at D = 64 below N = 2048, four blocks
# of one warpgroup (41 KiB each); at D = 128, two blocks of two warpgroups (97 KiB each), where
# each K/V tile serves 128 query rows. One block's start and end run beside the other blocks'
# products. With two buffers, P·V running on would leave none to load into, so there each
# warpgroup retires its P·V before the next barrier (`RETIRE`): that buffer is free one tile
# sooner, the loads run `STAGES − 1` tiles ahead, and with no P·V in flight while S is computed
# the warpgroup fits in the 128 registers a thread that 512 threads an SM leave:

# %%
nb.show_lines("09_wgmma", r"// PICK", r"^}")
with nb.unless_missing():
    display(nb.resources("09_wgmma"))

# %% [markdown]
# ## 6 · What changed, line by line
#
# Against stage 08 the kernel was rewritten around the warpgroup — rows per warpgroup instead of
# per warp, descriptors instead of `ldmatrix`, the accumulators as flat arrays — and everything
# else (the pipeline, the softmax, the write-back through shared memory) kept:

# %%
nb.show_diff("08_tuned", "09_wgmma", context=1)

# %% [markdown]
# ## 7 · Prediction, before measuring
#
# Split stage 08's time into the part the tensor pipe is busy, `f` (its profile, section 1), and
# the rest. If `wgmma` does the same math `r` times faster and nothing else changes, the
# speedup is
#
# $$\text{speedup}_{09/08} = \frac{1}{(1 - f) + f / r}.$$
#
# With `r` the ratio of the measured matmul ceiling to `mma.sync`'s two-thirds of the dense peak:

# %%
f = 0.49  # stage 08's tensor pipe at the teaching config, if its profile is not recorded
with nb.unless_missing():
    f = float(nb.profile("08_tuned").at["tensor_pipe_pct", "08_tuned"]) / 100
r = roof["matmul_fp16_tflops"] / (2 / 3 * 989)
predicted = 1 / ((1 - f) + f / r)
print(f"f = {f:.2f}, r = {r:.2f} -> predicted speedup {predicted:.2f}x at the teaching config "
      f"(D = 64); more at D = 128, where the tensor share is larger")

# %% [markdown]
# * **Time:** about the speedup above at D = 64, more at D = 128. Not more, because the softmax
#   is untouched, and within a warpgroup it still waits for S and then makes the tensor cores
#   wait for P: this kernel overlaps one tile's P·V with the next tile's start, nothing else.
# * **Machine code:** `HMMA` and `LDSM` gone; `HGMMA` 64 × BC × 16 and 64 × D × 16, one per k-step;
#   `WARPGROUP.ARRIVE` (the fence) and `WARPGROUP.DEPBAR` (the wait).
# * **Profile:** the tensor pipe busier; far fewer instructions issued per FLOP.

# %% [markdown]
# ## 8 · The machine code
#
# Static counts, fp16 kernels, stage 08 then stage 09:

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("08_tuned", "09_wgmma")
    display(mix[mix.index.get_level_values("kernel").str.contains("__half")].droplevel("stage").T)

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("09_wgmma", r"HGMMA|WARPGROUP|FENCE|BAR\.SYNC",
                                  kernel=r"__half, 128,")))

# %% [markdown]
# `WARPGROUP.ARRIVE` is `wgmma.fence`; the `HGMMA` with `gdesc[UR..]` operands read both operands
# through descriptors held in uniform registers (S), the ones with an `R` operand take A from
# registers (P·V); `WARPGROUP.DEPBAR.LE gsb0, 0x0` is `wait_group 0`. The loop body:

# %%
with nb.unless_missing():
    display(nb.loop_bodies(["08_tuned", "09_wgmma"], kernel=r"__half, 128,"))

# %% [markdown]
# No `R2UR` in the loop (the column would show it): the few this kernel has move the block's
# indices into uniform registers before the loop starts.

# %%
with nb.unless_missing():
    moves = nb.sass_lines("09_wgmma", r"^R2UR", kernel=r"__half, 128,")
    body = nb.loop_bodies(["09_wgmma"], kernel=r"__half, 128,")
    print(f"R2UR in the K/V loop: {int(body.get('R2UR', pd.Series([0])).iloc[0])}; "
          f"in the whole kernel: {len(moves)}")
    print("\n".join(moves))

# %% [markdown]
# ## 9 · Measure
#
# On a Hopper GPU this builds the stage, checks it against a float64 reference, then times it
# together with stage 08 and SDPA's flash and cuDNN backends, run by run in turn at each config (the
# teaching configs, then the FlashAttention sweep), three rounds over, as `flashlab run` does, so
# that their ratios come from one run. Otherwise: the recorded rows.

# %%
ev = nb.evaluate("09_wgmma")
ev

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    gain = nb.speedup("08_tuned", "09_wgmma", "fp16")
    print(f"stage 09: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{gain:.2f}x stage 08; predicted {predicted:.2f}x")

# %% [markdown]
# Over the FlashAttention sweep (16k tokens, H · D = 2048, fp16), stage 09 over stage 08, and
# over cuDNN's attention (PyTorch's fastest), rows: head dim and mask, columns: N:

# %%
with nb.unless_missing():
    gains = nb.sweep_ratio("09_wgmma", "08_tuned")
    display(gains.round(2))
    print("mean gain by head dim: " + ", ".join(
        f"D={d_}: {g:.2f}x" for d_, g in gains.mean(axis=1).groupby(level="D").mean().items()))
    display(nb.sweep_ratio("09_wgmma", "sdpa_cudnn").round(2))

# %%
plots.scaling(last="09_wgmma")

# %% [markdown]
# ### Discussion
#
# **Time.** Predicted 1.07× at the teaching config (D = 64) and more at D = 128. Measured, with
# both stages timed in turn in this run: 1.22× at the teaching config; over the sweep 1.23–1.34× at
# D = 64 (1.30× on average) and 1.26–1.52× at D = 128 (1.40×), more on long sequences than on short
# ones. The prediction missed, and by most at D = 64, where it expected least. The model made the
# products faster and held everything else fixed; three things it left out:
#
# * **The block's shape changed with the instruction.** At D = 64 `pick()` runs 128-key tiles
#   with two blocks on each SM (section 5; the profile below shows the occupancy doubling). While
#   one block's warpgroups meet at the barrier, exponentiate or write O back, the other block's
#   products run. That time, which the model counted as fixed, is now partly hidden. The 128-key
#   tiles also halve the barriers and loop trips per key. Stage 08 runs one block an SM: its
#   fragments pass through registers, and its 256 threads take 255 each, the whole register file.
# * **Shared memory feeds the tensor cores now.** A `wgmma` with both operands in shared memory
#   reads A (64 × 16, 2 KiB) and B (N × 16) per instruction. With 128-key tiles S is
#   `m64n128k16`: 6 KiB for 262 144 FLOPs. At the tensor cores' full rate that is 96 bytes a
#   clock, against the 128 that shared memory delivers. With 64-key tiles (`m64n64k16`, 4 KiB for
#   half the FLOPs) it would be all 128: the wider tile is what leaves the rate `r` within reach.
# * **How the loop is written counts.** The descriptors come from uniform registers (section 4).
#   Built from `threadIdx.x`, they were moved there 48 times a tile at D = 128; timed in turn on
#   the H100, that kernel was 1.03–1.10× slower over the sweep than this one. In the same way, a
#   test inside the tile loop that skips the tiles past a warpgroup's rows under the mask cost
#   1.03–1.10× at D = 64, even without the mask, where it is never taken. That is why each
#   warpgroup counts its own tiles and runs them in a loop of their own.
#
# Under the mask at D = 128 the gain is largest, 1.35–1.52×, and the block's shape is most of it.
# Timed in turn on the H100 over the sweep's causal configs at D = 128, blocks of one warpgroup
# with three buffers of 64 keys, also two to an SM, ran 0.87–0.93× as fast as this shape: each
# of their K/V tiles serves 64 query rows instead of 128, so every row costs twice the loads, and
# two warpgroups on an SM instead of four leave fewer softmaxes to fill the gaps between products.
# Where the gain is smallest, 1.23× at D = 64 and N = 512 without the mask, a block has four tiles
# of 128 keys, and at D = 64 each tile's products are half as long as at D = 128 for the same
# barrier, softmax and loads: the block's fixed costs weigh most there. Under the mask at D = 64
# on short sequences the opposite trade pays: a block has one to eight tiles of 64 keys, so its
# start and end are much of its time, and four blocks of one warpgroup on each SM stagger them
# where two blocks of two warpgroups ran them together. Timed in turn on the H100, two warpgroups
# with six buffers of 64 keys ran 0.95× as fast as this shape at N = 512 and 0.99× at 1024; from
# N = 2048 on, 128-key tiles for two warpgroups are faster again.
#
# Against cuDNN, PyTorch's fastest backend, stage 09 is at 0.94–1.02× at D = 64, and at D = 128
# 0.72–0.73× without the mask and 0.84–0.92× under it. The gap is what overlapping the softmax
# with the products is worth, and it is largest where the products are the larger part of a tile.

# %% [markdown]
# ## 10 · The profile: is the tensor pipe busier?
#
# Nsight Compute at the teaching config, stage 08 against stage 09:

# %%
idea = list(fl.stage("09_wgmma").idea_metrics)
with nb.unless_missing():
    prof = nb.profile("09_wgmma")
    stall_rows = prof.index[prof.index.str.startswith("stall_")]
    display(prof.loc[[m for m in ["duration_ms", "tensor_pipe_pct", "sm_throughput_pct",
                                  "achieved_occupancy_pct", "smem_wavefronts"]
                      if m in prof.index] + list(stall_rows)].round(2))
    if "08_tuned" not in prof.columns:
        raise nb.not_recorded("08_tuned", " profile (to compare with)", " --profile")
    for m in idea:
        print(f"{m}: {prof.at[m, '08_tuned']:.1f}% -> {prof.at[m, '09_wgmma']:.1f}%")

# %%
plots.idea_metrics(only=["09_wgmma"])

# %% [markdown]
# ### Discussion
#
# * **The tensor pipe is *less* busy — 49 % → 42 % — in less time (0.058 → 0.047 ms).** The
#   counter measures the cycles the pipe is working, not the work it does in them. The kernels do
#   the same FLOPs, so each busy cycle of `wgmma` does about (49 × 0.058) / (42 × 0.047) ≈ 1.5
#   times the work of one of `mma.sync`: the two-thirds-of-peak ceiling of `mma.sync`, seen from
#   the other side. A metric that counts activity, not throughput, can fall when a kernel gets
#   better.
# * **Two blocks an SM:** achieved occupancy 11.6 % → 22.9 %, the second block `pick()` fits at
#   D = 64.
# * **Instructions:** warps were `selected` (issuing) 23 % of the time in stage 08 and 13 % now:
#   the `mma.sync` and `ldmatrix` of a loop trip became a few `wgmma` (16 at D = 128, against 256
#   `mma.sync` and 80 `ldmatrix`). Shared-memory wavefronts fell by 38 % and load bank conflicts by
#   almost two thirds (12 500 → 4 334): the hardware's swizzle.
# * **New waits:** `barrier` (2.6 → 12.1 %) and `mio_throttle` (2.8 → 12.8 %). Each tile, all 256
#   threads issue their `cp.async` copies and meet at `__syncthreads`: the slower warpgroup and the
#   copy queue now decide when the tensor cores get the next tile. That is what stage 10 removes.

# %% [markdown]
# ## 11 · What is next
#
# Every thread still issues `cp.async` copies of 16 bytes (16 a tile at D = 128) and the whole
# block meets at `__syncthreads` before each tile. **Stage 10** hands the copies to Hopper's tensor
# memory accelerator, one instruction per tile from one thread, and replaces the barrier with
# mbarriers that each warpgroup waits on by itself.

# %% [markdown]
# ## Exercises
#
# ### Lab `09.descriptor`
#
# Encode a descriptor by hand, as section 4 did for Q and K, for the transposed operand: V.

# %%
from flashlab.course import labs
print(labs.prompt("09.descriptor"))

# %%
### BEGIN SOLUTION
V0, BC, ks = 0x14000, 128, 3
answer = wgmma.encode_descriptor(V0 + ks * 16 * 128, BC * 128, 1024)
### END SOLUTION

# %%
labs.check("09.descriptor", answer)

# %% [markdown]
# ### Kernel exercise `09.descriptors` (10 points)
#
# **Where:** the S = Q Kᵀ loop of `wgmma_kernel` in `kernels/09_wgmma.cu`, between
# `// BEGIN EXERCISE 09.descriptors` and `// END EXERCISE 09.descriptors`. The stub gives every
# k-step the descriptors of the first 16 columns, so S is Q Kᵀ over 16 of the D dims, D/16 times.
#
# **What to write:** section 4's arithmetic: k-step `kk` starts in 64-column block `kk / 4`
# (`rows · 128` bytes per block: BR rows for Q, BC for K) and `(kk % 4) · 32` bytes into its rows;
# both operands K-major with the 128-byte swizzle, stride byte offset 1024, leading offset 16.
#
# **How it is judged.** `flashlab grade` builds stage 09 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, the strided layout of a model's projections, and keys whose size grows along
# the sequence, so that every row's maximum keeps rising and each rescale path runs. A wrong kernel
# scores 0, and the message names the first failing case and its first wrong element (batch, head,
# row, column, got, expected). A right one is timed at the teaching config and under the causal
# mask: when your instructor grades, in turn with the solution's stage on the same GPU, the slower
# of the two ratios counting; when you check your own work, against the solution's recorded speedup
# over stage 08. Full points within 5 % of the solution's speed, fewer below.
#
# **GPU:** compute capability 9.0 (H100, H200, GH200): `wgmma` exists nowhere else; elsewhere
# `flashlab grade` skips it with one line saying why. Run it with
#
#     flashlab grade --exercise 09.descriptors

# %% [markdown]
# ## Questions for discussion
#
# 1. Why does a `wgmma` need all four warps of a warpgroup, and what would go wrong if a block's
#    warps 2–5 formed one?
# 2. The tile at D = 128 is two 64-column blocks rather than one 256-byte row per key. What would a
#    256-byte row cost with the 128-byte swizzle mode?
# 3. S is waited for at once, P·V is not. Why can the kernel not leave S running too, as it does
#    P·V, without another change?
# 4. Which part of a tile's time did this stage leave untouched, and how would you hide it?
# 5. Replace the shuffle that reads the warpgroup index from lane 0 by `threadIdx.x / 128` and
#    rebuild. How many `R2UR` does the loop get, and why would those moves cost more than their
#    count suggests?

# %% [markdown]
# **Instructor's answer.** *1.* The instruction is warpgroup-wide: the 64 rows of A and D are split
# 16 per warp, and each warp's part runs on its SM sub-partition's tensor core, one warp per
# sub-partition. The PTX ISA requires a warpgroup to be four contiguous warps whose first warp
# index is a multiple of 4 (warps 4w … 4w + 3): warps 2–5 span two warpgroups and the behaviour
# is undefined.

# %% [markdown]
# **Instructor's answer.** *2.* The 128-byte swizzle permutes 16-byte chunks within 128 bytes, and
# its atom is 8 rows of 128 bytes. A 256-byte row is not a layout the descriptor can name with that
# mode: the "leading dimension" would have to jump inside a row. Splitting the tile into 64-column
# blocks keeps every row of the atom 128 bytes and lets the descriptor step to the second half by
# its start address (k-steps 4–7) or, for V, by its leading byte offset.

# %% [markdown]
# **Instructor's answer.** *3.* The softmax needs S: the row max, the exponentials and the sum
# read every score. To overlap S with something, the warpgroup must have other work that does not
# need it: the softmax of the *previous* tile. That is a software pipeline inside the warpgroup
# (issue S of tile j + 1, then do the softmax of tile j), with a second set of S registers — the
# overlap that the last stages build.

# %% [markdown]
# **Instructor's answer.** *4.* The softmax: between the wait for S and the issue of P·V the tensor
# cores have nothing of this warpgroup's to do, and the two warpgroups of a block run in step (the
# barrier each tile). Two ways to hide it: let another warpgroup's products run during this one's
# softmax (give the warpgroups different schedules: specialisation and ping-pong), or pipeline
# inside the warpgroup as in question 3.

# %% [markdown]
# **Instructor's answer.** *5.* 48 a tile at D = 128, 32 at D = 64 with 128-key tiles: one per
# 32-bit half of every descriptor the loop uses, Q's, K's and V's. Each `HGMMA` waits for the moves that
# produce its descriptor, and the moves sit among the products that should be issued back to
# back; the loop also grows by a tenth (945 instead of 865 instructions at D = 128). Measured on
# the H100, the uniform index made stage 09 1.03–1.10× faster over the sweep.

# %% [markdown]
# ## Summary
#
# - `wgmma.mma_async` multiplies 64 × N × 16 for a whole warpgroup in one asynchronous instruction,
#   B (and A) read from shared memory through 64-bit descriptors.
# - Its accumulator layout is four warps' `mma.sync` layouts: the softmax code did not change.
# - The 128-byte swizzle a descriptor names is stage 06's XOR in hardware; tiles are 64-column
#   blocks on 1024-byte boundaries.
# - `fence` / `commit_group` / `wait_group` order the asynchronous products; leaving P·V running
#   across the next tile's start costs a buffer.
# - Descriptors live in uniform registers: the warpgroup index they depend on must be visibly the
#   same across the warp (read from lane 0), or every tile pays for moving them there.
# - Registers set the shape: at D = 64 two blocks an SM of 128-key tiles fit 128 registers a
#   thread once each warpgroup retires its P·V before issuing the next S, and the second block's
#   products run while the first block waits or exponentiates. Under the mask at D = 128 the same
#   holds for two blocks of two warpgroups with 64-key tiles, where it is worth 1.07–1.14×.

# %%
nb.reached("09_wgmma")
