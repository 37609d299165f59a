# %% [markdown]
# # Stage 13 — the lazy rescale: the exponentials stop waiting for the row maximum
#
# Every stage so far takes a key tile's softmax as a chain: the tile's row maximum, the new running
# maximum `m` and O's factor `α = 2^(m_old − m_new)`, then the exponentials `2^(s − m)` and their
# sums, then `O *= α`. Yet after the first few tiles a row's maximum hardly moves, and the online
# softmax does not need the exact maximum. FlashAttention-4 rescales O only when the maximum has
# grown past a threshold. Stage 13's **lazy rescale** goes one step further: a tile's exponentials
# are taken against `m` as it stands, at once, and the tile's maximum is only checked, beside them.
#
# ## Objectives
# After this notebook you can:
# - say which steps of a tile's softmax wait for the row maximum, and count them at D = 64 and 128;
# - explain why O / l does not change when `m` lags behind the true maximum, and bound how far it
#   may lag before a 16-bit P overflows;
# - write a lazy softmax pass that checks its assumption with a warp vote and falls back to the
#   classic path, and say how often the fallback runs;
# - predict where the lazy rescale pays and check it in the machine code, the timings and the
#   profile.
#
# **Prerequisites:** notebooks 12 (the kernel this one changes) and 11 (the consumers' softmax);
# notebook 02's online softmax. The kernel needs a Hopper GPU (H100, H200, GH200); elsewhere this
# notebook replays the numbers recorded on one.
#
# **Time:** about 23 min to read, 40 min to work through.

# %%
# %matplotlib inline
import numpy as np
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import lazy_rescale
from flashlab import notebook as nb
from flashlab import plots
nb.banner("13_lazy_rescale")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · A tile's softmax in stage 12
#
# A consumer thread holds BC / 2 scores of its two rows (r0 and r0 + 8, `hh = 0, 1`) after the
# wait for S. Stage 12's softmax of them:

# %%
nb.show_lines("12_tma_store", r"auto softmax = \[&\]", r"^  \};")

# %% [markdown]
# and after it, in the loop, O takes the factor and P is packed:

# %%
nb.show_lines("12_tma_store", r"softmax\(s, j \* BC\);", r"pack\(s\);")

# %% [markdown]
# Three things stand in a line. The row maximum `mx` is a chain of `fmaxf` and two shuffles across
# the 4 threads of a row; `m_new` and `alpha` need `mx`; every exponential needs `m_use`, so all 64
# wait for the whole chain. Last, O is multiplied by `alpha`, D / 2 multiplications a thread, at
# every tile, though after the first few tiles `alpha` is almost always 1. Per thread and tile:

# %%
display(pd.concat({f"D = {d}": lazy_rescale.lazy_steps(D=d) for d in (64, 128)}, axis=1))

# %% [markdown]
# ## 2 · Any maximum will do, if the exponentials stay in range
#
# The online softmax keeps, for each row, `m`, `l = Σ 2^(s − m)` and `O = Σ 2^(s − m) · v`, and
# divides at the end. Replace `m` by any `m'` and both sums take the same factor `2^(m − m')`:
# O / l does not change. `m` only keeps the exponentials in range, and P goes to the tensor cores
# in 16 bits (fp16's largest value is 65 504). So stage 13 takes every tile after an item's first
# **lazily**:
#
# 1. The exponentials are taken against `m` as it stands, without waiting, straight into P's
#    16-bit pairs and the row sums.
# 2. Beside them the tile's row maximum is still found (its instructions fill the gaps between
#    exponentials, which the special-function unit issues only one in 8 cycles per warp), and only
#    **checked**: does some score exceed `m` by more than 8 (log2 units)?
# 3. If no row of the warp has such a score (a warp vote, `__any_sync`), every exponential is at
#    most 2^8 = 256, P and the sums are right as they are, and O keeps its scale: no rescale.
# 4. Otherwise the warp takes the tile again the classic way (stage 12's softmax, rescale and
#    packing) from S, which the lazy pass did not overwrite, and `m` moves to the new maximum.
#
# An item's first tile sets `m` the classic way. `m` may then lag a row's true maximum by up to 8:
# P is at most 256, and fp16 would overflow only at 2^16. The vote makes the choice once per warp,
# so the warp never splits between the two paths.
#
# The model below puts the two side by side for one warp alone: one instruction a cycle, an
# exponential every 8 cycles (the special-function unit: 4 a cycle per sub-partition), a shuffle's
# result 30 cycles after it issues.

# %%
lazy_rescale.lazy_figure(D=128)

# %% [markdown]
# In stage 12 the maximum, its shuffles and the factor come first, about 140 cycles in which no
# exponential runs, and the rescale of O comes last. In stage 13 the maximum runs beside the
# exponentials. The model saves 200 cycles of about 700 at D = 128 and 170 of 690 at D = 64. On the
# GPU a consumer's softmax takes longer (appendix 11a measured 1 200–1 400 cycles a tile at D = 128
# for a consumer beside the other one), but the cycles removed are of the same kind.
#
# ## 3 · How often the classic path runs
#
# The lazy pass pays only if the fallback is rare. `lazy_rescale.lazy_fallbacks` replays the
# kernel's decision on the CPU for one head (each warp's 16 rows, 128-key tiles): random inputs as
# in the sweep (q, k ~ N(0, 1), scale 1 / √D), and keys that grow along the sequence.

# %%
rng = np.random.default_rng(0)
N, D = 4096, 64
q, k = rng.standard_normal((N, D)), rng.standard_normal((N, D))
ramp = (1 + 30 * np.arange(N) / N)[:, None]  # keys whose norm grows 31-fold along the sequence
display(pd.DataFrame({"random": lazy_rescale.lazy_fallbacks(q, k),
                      "random, causal": lazy_rescale.lazy_fallbacks(q, k, causal=True),
                      "keys growing along the sequence": lazy_rescale.lazy_fallbacks(q, k * ramp)}).T)

# %% [markdown]
# On random inputs no tile after the first falls back: a tile's maximum would have to beat the
# first tile's by 8 log2 units, about 5.5 standard deviations of a score. The largest P written is
# about 28. When the keys grow along the sequence, so does every row's maximum: nearly all tiles
# fall back, each costing stage 12's softmax plus the lazy pass it threw away, and the result stays
# exact. Real attention often puts its largest scores early (the "attention sink" on the first
# token), so the first tile sets the maximum; measure on your own model's inputs all the same.
#
# ## 4 · What changed
#
# Against stage 12: the `fast` lambda, and the loop's softmax put under a condition. The two-blocks
# shape (D = 64 under the mask on short sequences) leaves a consumer 104 registers, too few to keep
# S beside P, so it gets a second lazy pass, `fast_inplace`: the exponentials written over S, and on
# a failed vote S computed again from K, still in shared memory. That fallback issues a `wgmma`,
# which a warpgroup's four warps issue together, so its vote covers the warpgroup: `bar.red.or.pred`
# on a named barrier ORs a predicate over 128 threads, where `__any_sync` covers one warp:

# %%
nb.show_diff("12_tma_store", "13_lazy_rescale", context=1)

# %% [markdown]
# ## 5 · Prediction, before measuring
#
# Per thread and tile, the lazy pass removes the rescale of O (D / 2 `FMUL`), the factor (two
# `MUFU.EX2` and its arithmetic) and the wait for the maximum; it adds a compare and a vote.
#
# * **D = 64.** A consumer's tile holds the SM's tensor cores for 2 · 64 · 128 · 64 multiply-adds at
#   4 096 FLOP a cycle (appendix 11a): 512 cycles. Its warps' 66 `MUFU.EX2` (64 exponentials and 2
#   factors) hold their sub-partitions' special-function units for 66 × 8 = 528. The softmax weighs
#   as much as the products, so a shorter one leaves the tensor cores waiting less. The model takes a
#   quarter off, but the exponentials, which stay, are most of it: **1.03–1.08×** on long sequences.
# * **Short sequences.** An item's first tile is classic: at N = 512, one of 4. At D = 64 under the
#   mask below N = 2048 (the two-blocks shape, 64-key tiles) a tile's softmax is half as long, and the
#   warpgroup's vote adds a barrier: 1.00–1.03×.
# * **D = 128.** The products take 1 024 cycles for the same 528 of exponentials: the tensor cores
#   set the pace, **1.00–1.03×**.
# * **Teaching config** (D = 64, N = 1024, 7 of an item's 8 tiles lazy): **1.02–1.06×**.
# * **Machine code:** about twice stage 12's `MUFU.EX2` (both softmaxes), and a `VOTE.ANY` with a
#   branch to the classic path.
# * **Profile:** fewer warps waiting on the short scoreboard (the maximum's shuffles), and the tensor
#   pipe busier.

# %%
gain_band = (1.02, 1.06)

# %% [markdown]
# ## 6 · The machine code

# %%
with nb.unless_missing():
    mix = nb.instruction_mix("12_tma_store", "13_lazy_rescale")
    display(mix[mix.index.get_level_values("kernel").str.contains("__half")].droplevel("stage").T)

# %% [markdown]
# Static counts: the lazy kernel carries both softmaxes, so its `MUFU.EX2` count doubles (130
# instead of 66 in the three-consumer kernel at D = 64), while a tile runs one of them. The
# two-blocks kernel (`64, 64, 4, 2, 2`) has a second group of `HGMMA` for S and a `BAR.RED.OR`:

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("13_lazy_rescale", r"BAR\.RED|HGMMA", kernel=r"__half, 64, 64,")))

# %% [markdown]
# Four `HGMMA` for S, the vote, four more for S again, then four for P·V.
#
# The order is what changed. From a tile's last `HGMMA` of S to the first shuffle of its row
# maximum, how many exponentials issue? Then the end of stage 13's lazy pass, up to the vote:

# %%
with nb.unless_missing():
    pattern = r"MUFU\.EX2|FMNMX|SHFL\.BFLY|FSETP|VOTE|BRA|HGMMA"
    for slug in ("12_tma_store", "13_lazy_rescale"):
        lines = nb.sass_lines(slug, pattern, kernel=r"__half, 64, 128,")
        shfl = next(i for i, line in enumerate(lines) if "SHFL.BFLY" in line)
        top = max(i for i in range(shfl) if "HGMMA" in lines[i])
        before = lines[top + 1:shfl]
        print(f"{slug}: {sum('MUFU' in x for x in before)} MUFU.EX2 and "
              f"{sum('FMNMX' in x for x in before)} FMNMX before the first shuffle")
    vote = next(i for i, line in enumerate(lines) if "VOTE" in line)
    print("\n".join(lines[vote - 14:vote + 1]))

# %% [markdown]
# In stage 12 no exponential issues before the maximum's shuffles. In stage 13 ptxas interleaves
# the exponentials with the maximum's `FMNMX` from the start, and the last exponentials are still
# issuing when the compares (`FSETP`) and the vote (`VOTE.ANY`) come.

# %% [markdown]
# ## 7 · Measure
#
# On a Hopper GPU this builds the stage, checks it against a float64 reference, then times it with
# stage 12 and SDPA's flash and cuDNN backends, in turn at each config (the teaching configs, then
# the FlashAttention sweep), three rounds over, so that their ratios come from one run. Otherwise:
# the recorded rows.

# %%
ev = nb.evaluate("13_lazy_rescale")
ev

# %%
with nb.unless_missing():
    t = ev.timing("fp16")
    gain = nb.speedup("12_tma_store", "13_lazy_rescale", "fp16")
    print(f"stage 13: {t.median_ms:.3f} ms, {t.tflops:.0f} TFLOP/s (fp16, teaching config), "
          f"{gain:.2f}x stage 12; predicted {gain_band[0]:.2f} - {gain_band[1]:.2f}x")
    print(f"bf16: {nb.speedup('12_tma_store', '13_lazy_rescale', 'bf16'):.2f}x stage 12")

# %% [markdown]
# Both stages' rows at the teaching config, with the spread of their timed runs (p20 and p80):

# %%
with nb.unless_missing():
    display(nb.teaching_rows(["12_tma_store", "13_lazy_rescale"]))

# %% [markdown]
# Over the sweep: stage 13 over stage 12, then over cuDNN's attention and over PyTorch's
# FlashAttention-2 backend:

# %%
with nb.unless_missing():
    gains = nb.sweep_ratio("13_lazy_rescale", "12_tma_store")
    display(gains.round(3))
    print("mean gain by N: " + ", ".join(f"{n}: {g:.3f}x" for n, g in gains.mean().items()))
    display(nb.sweep_ratio("13_lazy_rescale", "sdpa_cudnn").round(2))
    fa2 = nb.sweep_ratio("13_lazy_rescale", "sdpa_flash")
    print(f"stage 13 over sdpa_flash (FlashAttention-2): {fa2.min().min():.2f}-"
          f"{fa2.max().max():.2f}x")

# %%
plots.scaling(last="13_lazy_rescale")

# %% [markdown]
# ### Discussion
#
# **Time.** Predicted: 1.03–1.08× at D = 64 on long sequences, 1.00–1.03× at D = 128 and in the
# two-blocks shape, less on short sequences. Measured:
#
# * **D = 64 without the mask:** 1.01× at N = 512, rising with an item's length to 1.06× at
#   N = 16384; from N = 4096 on (1.04–1.06×) inside the band.
# * **D = 64 under the mask:** 1.015× and 1.030× at N = 512 and 1024 (the two-blocks shape): inside
#   its band. From N = 2048, where three consumers run, 1.03–1.06×.
# * **D = 128:** 1.01–1.03× without the mask, 1.00–1.02× under it: inside the band. Long cells move
#   by a few per cent from run to run (notebook 00), so the smallest of these rank nothing.
# * **Where it missed: short items.** At N = 1024 seven of an item's eight tiles are lazy: 7/8 of
#   the long-sequence gain would be about 1.05×. Measured: 1.02×, the bottom of the band. What the
#   lazy pass does not touch (an item's first S with no P·V beside it, its last P·V with no softmax
#   beside it, the store of O) is a larger share of a short item.
#
# **Against cuDNN** stage 13 is ahead at every config, 1.01–1.20×, most at D = 64 (1.09–1.20×);
# against FlashAttention-2 (`sdpa_flash`) 1.59–2.34×.

# %% [markdown]
# ## 8 · The profile

# %%
idea = list(fl.stage("13_lazy_rescale").idea_metrics)
with nb.unless_missing():
    prof = nb.profile("13_lazy_rescale")
    stall_rows = prof.index[prof.index.str.startswith("stall_")]
    display(prof.loc[[m for m in ["duration_ms", "tensor_pipe_pct", "sm_throughput_pct"]
                      if m in prof.index] + list(stall_rows)].round(2))
    if "12_tma_store" not in prof.columns:
        raise nb.not_recorded("12_tma_store", " profile (to compare with)", " --profile")
    for m in idea + ["stall_math_pipe_throttle", "stall_wait", "stall_selected"]:
        print(f"{m}: {prof.at[m, '12_tma_store']:.2f} -> {prof.at[m, '13_lazy_rescale']:.2f}")
    d12, d13 = prof.at["duration_ms", "12_tma_store"], prof.at["duration_ms", "13_lazy_rescale"]
    print(f"duration under Nsight Compute: {d12:.4f} -> {d13:.4f} ms ({d12 / d13:.2f}x)")

# %%
plots.idea_metrics(only=["13_lazy_rescale"])

# %% [markdown]
# ### Discussion
#
# * **Fewer waits behind the shuffles,** as predicted: `short_scoreboard` 3.2 % → 2.8 % of the
#   warps' time.
# * **The tensor pipe busier:** 46.7 % → 48.3 %, and the kernel 1.04× faster under the profiler
#   (0.0444 → 0.0429 ms), close to the timing (1.02×).
# * **Fewer instructions to issue:** `wait` (fixed latencies in the instruction stream) 21.4 % →
#   20.3 %, `math_pipe_throttle` 1.5 % → 1.1 %.
# * **More waiting on mbarriers:** `long_scoreboard` 15.8 % → 16.9 %. A consumer that finishes its
#   softmax sooner reaches the wait for the next K tile sooner, and the producer is not always ahead
#   (a likely reading, not measured on its own).
#
# Notebook 12's section 10 lets you run FlashAttention-3's two overlaps on your own GPU: their
# turns must hide a consumer's softmax under the other's products, and stage 13 shortens exactly
# that softmax.

# %% [markdown]
# ## Exercises
#
# ### Lab `13.lazy_bound`
#
# Section 2's bound, for another threshold and an 8-bit P.

# %%
from flashlab.course import labs
print(labs.prompt("13.lazy_bound"))

# %%
### BEGIN SOLUTION
largest_lazy_p = 2 ** 10                 # no score more than 10 above m
e4m3_overflow_units = np.log2(448)      # 448 = 2^8.807, e4m3's largest finite value
answer = (largest_lazy_p, e4m3_overflow_units)
### END SOLUTION

# %%
labs.check("13.lazy_bound", answer)

# %% [markdown]
# ### Kernel exercise `13.lazy_softmax` (10 points)
#
# **Where:** the `fast` lambda in `kernels/13_lazy_rescale.cu`, between `// BEGIN EXERCISE
# 13.lazy_softmax` and `// END EXERCISE 13.lazy_softmax`. The stub fills P with zeros and says the
# tile is done: every tile after an item's first adds nothing to O or l, and the check fails
# wherever a row has more than 128 keys.
#
# **What to write:** for each of the thread's BC / 2 scores, the exponential against the running
# maximum of its row half, `exp2_approx(fmaf(s, scale_log2, -m[hh]))`, packed in pairs into
# `p[ks][q]` as `pack()` packs them (register q of k-step ks holds columns 8 ks + 2 q and
# 8 ks + 2 q + 1, row half q & 1), and summed per row half; beside them each row half's raw
# maximum, then across the 4 threads of the row (two `__shfl_xor_sync`). Return false if any row
# of the warp has `max · scale_log2 > m + 8` (`__any_sync`), before touching `l`; otherwise add the
# sums to `l` and return true.
#
# **How it is judged.** `flashlab grade` compares your stage with a float64 reference (NaN-filled
# output, ragged N, D = 64 and 128, both masks, fp16 and bf16, a model's strided layout) and on keys
# that grow along the sequence, where a pass without the check and its fallback fails. A wrong
# kernel scores 0, and the message names the first failing case and its first wrong element. A
# right one is timed at the teaching config and under the mask, the slower of the two ratios
# counting, against the solution's stage (when your instructor grades) or its recorded speedup over
# stage 12 (when you check your own work): full points within 5 % of the solution's speed, fewer
# below.
#
# **GPU:** compute capability 9.0 (H100, H200, GH200); elsewhere `flashlab grade` skips it with one
# line saying why. Run it with
#
#     flashlab grade --exercise 13.lazy_softmax

# %% [markdown]
# ## Questions for discussion
#
# 1. The lazy pass checks the maximum after it has used `m`. What would go wrong if it skipped the
#    check and kept every tile?
# 2. The vote sends the whole warp down the classic path when one of its 16 rows needs it. Why not
#    let each thread decide for its own two rows?
# 3. In the two-blocks shape, why is the vote taken over the warpgroup with `bar.red.or.pred`, and
#    not over the warp with `__any_sync` as elsewhere?
# 4. Attention in a trained model often puts its largest score on the first token. What does that
#    do to the lazy path, causal and not?

# %% [markdown]
# **Instructor's answer.** *1.* A score more than 16 log2 units above `m` gives an exponential
# past fp16's 65 504: P holds infinity, and O becomes infinite or NaN. In bf16 P would not overflow,
# but `m` would fall ever further behind, and O and l would grow without bound.

# %% [markdown]
# **Instructor's answer.** *2.* Split between lanes, the warp would run both paths one after the
# other anyway, and the classic path is long. A uniform branch also lets ptxas keep each path's
# registers apart. A vote costs one instruction.

# %% [markdown]
# **Instructor's answer.** *3.* That fallback computes S again with a `wgmma`, which a
# warpgroup's four warps issue together (`.sync.aligned`). Voted per warp, one warp could issue it
# alone: undefined, in practice a hang. Elsewhere the fallback is arithmetic and shuffles within a
# warp, so a warp's vote is enough.

# %% [markdown]
# **Instructor's answer.** *4.* The first key tile holds the sink, so the first tile, taken the
# classic way, sets each row's maximum and almost every later tile is lazy; under the mask too,
# since every row sees key 0 in its first tile. Inputs whose largest scores come late fall back
# more often.

# %% [markdown]
# ## Summary
#
# - Stage 12's softmax waits for the row maximum before any exponential and rescales O at every
#   tile, though a row's maximum rarely moves after the first tiles.
# - O / l does not depend on the `m` the exponentials are taken against. The lazy rescale takes
#   them against `m` as it stands and checks the tile's maximum beside them: if no score is more
#   than 8 (log2 units) above `m`, P ≤ 256 and O is not rescaled; otherwise a warp vote sends the
#   warp through stage 12's softmax. Where S cannot stay beside P (two blocks an SM) the fallback
#   computes S again, and its vote covers the warpgroup.
# - What it did on the H100 (fp16): 1.00–1.06× stage 12 over the sweep, most at D = 64 on long
#   sequences (1.04–1.06×), where the softmax weighs as much as the products; 1.02× at the teaching
#   config. The exponentials no longer wait for the maximum's shuffles, and the tensor pipe got
#   busier.
# - On random inputs the classic path never runs after an item's first tile; on keys that grow
#   along the sequence it runs at almost every tile, and the result stays exact.

# %%
nb.reached("13_lazy_rescale")
