# %% [markdown]
# # Stage 13 — a lazy rescale: the exponentials stop waiting for the row maximum
#
# Every stage so far takes a key tile's softmax the same way, one step after another: the row
# maximum of the tile, the new running maximum `m` and O's factor `α = 2^(m_old − m_new)`, then the
# exponentials `2^(s − m)` and their sums, then `O *= α`. None of the exponentials may start
# before the maximum is known, and O is rescaled at every tile. Yet after the first few tiles a
# row's maximum hardly moves. The online softmax does not need the exact maximum: any `m` works
# as long as the exponentials stay in range, because O and the row sum `l` carry the same factor
# and O / l cancels it. FlashAttention-4 uses this to rescale O only when the maximum has grown by
# more than a threshold. Stage 13 takes it one step further on this kernel: a tile's
# exponentials are taken against `m` as it stands, at once, and the tile's maximum is only
# checked, beside them.
#
# ## Objectives
# After this notebook you can:
# - say which steps of a tile's softmax wait for the row maximum, and count the instructions a
#   thread spends on each, at D = 64 and D = 128;
# - explain why O / l does not change when `m` lags behind the true maximum, and bound how far
#   it may lag before a 16-bit P overflows;
# - write a softmax pass that checks its assumption with a warp vote and falls back to the
#   classic path when it fails, and say what that fallback costs and how often it runs;
# - predict where the change pays (D = 64, where the softmax sets the pace) and check it in the
#   machine code, the timings over the sweep and the profile.
#
# **Prerequisites:** notebook 12 (the kernel this one changes) and notebook 11 (the consumers'
# softmax traced on the SM clock); notebook 02's online softmax. The kernel needs a Hopper GPU
# (H100, H200, GH200); elsewhere this notebook replays the numbers recorded on one.
#
# **Time:** about 20 min to read, 40 min to work through.

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
# Three things stand in a line. The row maximum `mx` is a chain of `fmaxf` over the thread's
# scores and two shuffles across the 4 threads of a row. `m_new` and `alpha` need `mx`. Every
# exponential needs `m_use`, so all 64 of them wait for the whole chain. Last, O is multiplied by
# `alpha`: D / 2 multiplications a thread, 64 at D = 128, at every tile, although after the first
# few tiles `alpha` is almost always exactly 1. Counted from the source, per thread and tile:

# %%
display(pd.concat({f"D = {d}": lazy_rescale.lazy_steps(D=d) for d in (64, 128)}, axis=1))

# %% [markdown]
# ## 2 · Any maximum will do, if the exponentials stay in range
#
# The online softmax keeps, for each row, `m`, `l = Σ 2^(s − m)` and `O = Σ 2^(s − m) · v`, and
# divides at the end. Replace `m` by any `m'` and both sums take the same factor `2^(m − m')`:
# O / l does not change. `m` is there only to keep the exponentials in range. In fp32 that
# range is wide, but P goes to the tensor cores in 16 bits, and fp16's largest value is 65 504.
#
# So stage 13 takes every tile after an item's first **lazily**:
#
# 1. The exponentials are taken against `m` as it stands, `2^(s · scale − m)`, without waiting for
#    anything; they go straight into P's 16-bit pairs and into the row sums.
# 2. Beside them, the tile's row maximum is still found (its instructions fill the gaps between
#    the exponentials, which the special-function unit issues only one in 8 cycles per warp),
#    and only **checked**: does some score exceed `m` by more than 8 (log2 units)?
# 3. If no row of the warp has such a score (a warp vote, `__any_sync`), every exponential is at
#    most 2^8 = 256, P and the sums are right as they are, and `l += sum`. O keeps its scale: no
#    `alpha`, no rescale.
# 4. Otherwise the warp takes the tile again the classic way: stage 12's softmax, the rescale and
#    the packing, on S, which the lazy pass did not overwrite (where registers are too few to keep
#    it, section 4 computes S again). `m` moves to the new maximum.
#
# An item's first tile sets `m` the classic way. `m` may then lag behind a row's true maximum by
# up to 8: O and l carry a factor of up to 2^8, P is at most 256, and fp16 would overflow only at
# 2^16. The vote makes the choice one per warp, so the warp never splits between the two
# paths.
#
# The model below puts the two side by side for one warp alone: one instruction a cycle, an
# exponential every 8 cycles (the special-function unit: 16 a cycle per SM, 4 per sub-partition),
# a shuffle's result 30 cycles after it issues.

# %%
lazy_rescale.lazy_figure(D=128)

# %% [markdown]
# In stage 12 the maximum, its shuffles and the factor come first, about 140 cycles in which no
# exponential runs; the rescale of O comes last. In stage 13 the maximum runs beside the
# exponentials, and the tile ends with a compare and a vote. The model's saving is 200 cycles of
# about 700 at D = 128 and 170 of 690 at D = 64. On the GPU a consumer's softmax takes longer than
# the model (notebook 11: 950 cycles alone, 1 200–1 400 beside the other consumer), but the
# cycles removed are of the same kind: waiting for the maximum, and work on O.
#
# ## 3 · How often the classic path runs
#
# The lazy pass pays only if the fallback is rare. For one head of random inputs (the sweep's:
# q, k ~ N(0, 1), scale 1 / √D), `lazy_rescale.lazy_fallbacks` replays the kernel's decision on the CPU:
# each warp's 16 rows, 128-key tiles, the running maximum moved only when the vote says so.

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
# first tile's by 8 log2 units, about 5.5 standard deviations of a score. The largest P written
# is about 28. When the keys grow along the sequence, so does every row's maximum, and nearly all
# tiles fall back. They are then as expensive as stage 12's plus the lazy pass they threw away,
# and still exact: the largest lazy P stays below 256. The GPU tests run every fast stage on such
# inputs (`test_scores_that_grow_along_the_keys`). Real attention sits between the two. Its
# largest scores usually come early (the first token often takes a large share of the attention,
# the "attention sink"), so the maximum is set by the first tile. Measure on your own model's
# inputs before you count on the lazy path.
#
# ## 4 · What changed
#
# Against stage 12: the `fast` lambda, and the loop's softmax put under a condition; an item's
# first tile keeps stage 12's path. The two-blocks shape (at D = 64 under the mask on short
# sequences) leaves a consumer 104 registers, too few to keep S beside P, so it gets a second lazy
# pass, `fast_inplace`: the exponentials written over S, and on a failed vote S computed again
# from K, which stays in shared memory until the softmax is done (its `empty` barrier is arrived
# at after it). That fallback issues a `wgmma`, which the four warps of a warpgroup issue
# together, so its vote is taken over the warpgroup: `bar.red.or.pred` on a named barrier ORs a
# predicate over 128 threads, where `__any_sync` covers one warp:

# %%
nb.show_diff("12_tma_store", "13_lazy_rescale", context=1)

# %% [markdown]
# ## 5 · Prediction, before measuring
#
# The lazy pass removes, per thread and tile, the rescale of O (D / 2 `FMUL`), the factor (two
# `MUFU.EX2` and its arithmetic) and the wait for the maximum before the first exponential; it
# adds a compare and a vote. Where does that pay?
#
# * **D = 64.** A tile's products cost half of D = 128's and its softmax the same. Notebook 12
#   counted the three limits of a pair of tiles on a sub-partition as about level: exponentials
#   ~1 050 cycles, products ~1 020, issue ~900. Three consumers share the SM, so a shorter softmax
#   lets each return to its products sooner. Section 2's model removes a quarter of a softmax,
#   but the exponentials, which stay, are most of it: expect **1.03–1.08×** on long sequences.
# * **Short sequences.** An item's first tile is classic, and at N = 512 an item is 4 tiles: a
#   quarter of the gain. At D = 64 under the mask below N = 2048 (the two-blocks shape, 64-key
#   tiles) a tile's softmax is half as long, and the warpgroup's vote adds a barrier: 1.00–1.03×.
# * **D = 128.** The tensor cores set the pace (products twice D = 64's for the same softmax):
#   **1.00–1.03×**, though the rescale removed is twice as long.
# * **Teaching config** (D = 64, N = 1024, 8 tiles an item, 7 of them lazy): **1.02–1.06×**.
# * **Machine code:** the kernel holds both softmaxes: about twice stage 12's `MUFU.EX2`, and a
#   `VOTE.ANY` (the `__any_sync`) with a branch to the classic path.
# * **Profile:** fewer warps waiting on the short scoreboard (the shuffles of the maximum, which
#   the exponentials no longer wait behind), and the tensor pipe busier.

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
# two-blocks kernel (`64, 64, 4, 2, 2`) has a second group of `HGMMA` for S (the fallback's) and a
# `BAR.RED.OR` (the warpgroup's vote):

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("13_lazy_rescale", r"BAR\.RED|HGMMA", kernel=r"__half, 64, 64,")))

# %% [markdown]
# Four `HGMMA` for S, the vote, four more for S again, then four for P·V.
#
#
# The order is what changed. In each kernel, from a tile's last `HGMMA` of S to the first shuffle
# of its row maximum, how many exponentials issue? Then the end of stage 13's lazy pass, up to the
# vote:

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
# In stage 12 no exponential issues before the maximum's shuffles: the first ones wait for them.
# In stage 13 ptxas interleaves the exponentials with the maximum's `FMNMX` from the start, issues
# the shuffles among them, and the last exponentials are still issuing when the compares
# (`FSETP`) and the vote (`VOTE.ANY`) come.

# %% [markdown]
# ## 7 · Measure
#
# On a Hopper GPU this builds the stage, checks it against a float64 reference, then times it
# together with stage 12 and SDPA's flash and cuDNN backends, run by run in turn at each config (the
# teaching configs, then the FlashAttention sweep), three rounds over, as `flashlab run` does, so
# that their ratios come from one run. Otherwise: the recorded rows.

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
# **Time.** The prediction was 1.03–1.08× at D = 64 on long sequences, 1.00–1.03× at D = 128,
# less on short sequences, 1.00–1.03× where the two-blocks shape runs. Measured, stages 12 and 13
# and the two baselines timed in turn at each config (the run recorded in `data/`, stages 08–11
# beside them, gave 0.999–1.056× over the same cells):
#
# * **D = 64 without the mask:** 1.01× at N = 512, rising with the length of an item to 1.06× at
#   N = 16384. From N = 4096 on (1.04–1.06×) that is inside the band, towards its top.
# * **D = 64 under the mask:** 1.02× and 1.03× at N = 512 and 1024, where the two-blocks shape runs
#   its in-place lazy pass: inside its band. From N = 2048, where three consumers run, 1.03–1.06×.
# * **D = 128:** 1.01–1.03× without the mask, inside its band; under the mask 1.00–1.02×. At
#   N = 16384 under the mask the two tie (1.01×, 0.999× in the recorded run), where without the
#   mask the lazy pass gains 1.02×. Long cells move by a few per cent from run to run
#   (notebook 12), so this one does not rank the two.
# * **Where it missed: short items.** At N = 1024 seven of an item's eight tiles are lazy, so the
#   count of lazy tiles alone says 7/8 of the long-sequence gain, about 1.05× at D = 64. Measured:
#   1.02×, the bottom of the teaching band. An item's costs that the lazy pass does not touch (its
#   first S with no P·V beside it, its last P·V with no softmax beside it, the store of O) are a
#   larger share of a short item, and the tiles it does touch are a smaller one.
#
# **The teaching config** (D = 64, N = 1024): 1.02× in fp16 and in bf16, every row tight.
#
# **Against cuDNN** stage 13 runs at 1.01–1.20× over the sweep here (1.012–1.214× in the recorded
# run), ahead at every config, and by the widest margins at D = 64, where the softmax sets the pace
# (1.09–1.20×). The narrowest is still D = 128 at N = 512 (1.01–1.02×, with and without the mask).
# In the recorded run stage 13 reaches 686 TFLOP/s at D = 128, N = 16384: 69 % of the H100's dense
# fp16 tensor peak of 989 TFLOP/s. Against FlashAttention-2 (`sdpa_flash`) it is 1.59–2.34× faster.

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
# * **Fewer waits behind the shuffles,** as predicted: `short_scoreboard` (waiting for a
#   variable-latency result, a shuffle's among them) 3.2 % → 2.8 % of the warps' time.
# * **The tensor pipe busier:** 46.7 % → 48.3 %, and the kernel 1.04× faster under the profiler
#   (0.0444 → 0.0429 ms), close to the timing above (1.02×).
# * **Fewer instructions to issue:** `wait` (the fixed latencies ptxas writes into the instruction
#   stream) 21.4 % → 20.3 %, `math_pipe_throttle` 1.5 % → 1.1 %, `selected` (issuing) 14.2 % →
#   14.0 %: two exponentials and D / 2 multiplications fewer a tile.
# * **More waiting on mbarriers:** `long_scoreboard`, where polling an mbarrier is counted, rose
#   15.8 % → 16.9 %. Consumers that finish their softmax sooner reach the wait for the next K tile
#   sooner; at this config (three consumers, N = 1024, four buffers) the producer is not always
#   ahead. A likely reading, not measured on its own.

# %% [markdown]
# ## 9 · The overlaps, again
#
# Notebook 12 ended with FlashAttention-3's two overlaps tying with stage 11: a consumer's softmax
# (1 400–1 500 cycles beside the other consumer) was longer than the other consumer's products
# (about 1 024 at D = 128) that the turns were to hide it under. Stage 13 shortens exactly that
# softmax, by about a quarter in section 2's model, where it would have to lose about two fifths.
# Both overlaps were built again on top of stage 13: two consumers, the lazy pass of S_j running
# under P_{j−1}·V_{j−1} and writing a second P while the first is still read, a failed vote's
# classic path at the top of the next turn, and the turns on named barriers. Timed in turn with
# stage 13 (fp16, H100, `data/runs/hopper-try-20261127T2147Z-13-overlap-with-lazy-softmax.log`):
#
# * at D = 128 the in-warpgroup overlap alone ties with stage 13 (0.97–1.04×), and the turns cost
#   3–12 % on top of it;
# * at D = 64 two consumers lose to stage 13's three whatever the schedule (0.75–0.92×): two P's
#   and S do not fit beside O in the 160 registers three consumers leave.
#
# A quarter off the softmax is not yet enough for the turns on this GPU.

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
# **How it is judged.** `flashlab grade` builds stage 13 from your region in `kernels/` and compares
# it with a float64 reference: the output is filled with NaN first (an element never written fails),
# N = 1, 17, 1000 and 4096 (ragged: no tile divides the first three), D = 64 and 128, causal and
# not, fp16 and bf16, the strided layout of a model's projections, and keys whose size grows along
# the sequence, so that every row's maximum keeps rising and each rescale path runs. A wrong kernel
# scores 0, and the message names the first failing case and its first wrong element (batch, head,
# row, column, got, expected). A right one is timed at the teaching config and under the causal
# mask: when your instructor grades, in turn with the solution's stage on the same GPU, the slower
# of the two ratios counting; when you check your own work, against the solution's recorded speedup
# over stage 12. Full points within 5 % of the solution's speed, fewer below. Random inputs rarely
# take the classic path (section 3); the keys that grow along the sequence take it, so
# a pass without the check and its fallback fails there.
#
# **GPU:** compute capability 9.0 (H100, H200, GH200); elsewhere `flashlab grade` skips it with one
# line saying why. Run it with
#
#     flashlab grade --exercise 13.lazy_softmax
#
# ### A longer exercise: why the turns still lose
#
# Section 9's overlaps, built on stage 13, lose 3–12 % with the turns at D = 128. Put the lazy pass
# into the kernel of `tools/candidates/12_overlap.patch` (`patch -o 12_overlap.cu
# kernels/12_tma_store.cu tools/candidates/12_overlap.patch` writes it; its rotated loop packs P at
# the top of the next turn, so the lazy pass must write a second P while the first is still read
# by the P·V in flight), time
# it against stage 13 with `tools/hopper_try.py`, and read a consumer's turn on the SM clock with
# `tools/hopper_trace.py` (notebook 11's table). Which step of a turn is now the longest, and how
# short would it have to be for the turns to pay?

# %% [markdown]
# ## Questions for discussion
#
# 1. The lazy pass checks the maximum after it has used `m`. What would go wrong if it skipped the
#    check and kept every tile?
# 2. Why does the threshold test use the raw maximum times `scale_log2`, and not the maximum of
#    the exponent arguments it has just computed?
# 3. The vote makes the whole warp take the classic path when one of its 16 rows needs it. Why not
#    let each thread decide for its own two rows?
# 4. In the two-blocks shape a failed vote computes S again instead of keeping it. Why is that
#    vote taken over the warpgroup with `bar.red.or.pred`, and not over the warp with
#    `__any_sync` as in the other shapes?
# 5. Attention in a trained model often puts its largest score on the first token. What does that
#    do to the lazy path, causal and not?

# %% [markdown]
# **Instructor's answer.** *1.* A score more than 16 log2 units above `m` gives an exponential
# past fp16's 65 504: P holds infinity and O becomes infinite or NaN. In bf16 P would not overflow
# below 2^128, but `m` would fall ever further behind, and O and l would grow without bound and
# lose the small terms. The check costs a compare and a vote; the fallback is rare on most inputs.

# %% [markdown]
# **Instructor's answer.** *2.* `fmaf(s, scale_log2, -m)` is the exponent argument, so testing
# `max(s) · scale_log2 > m + 8` is the same comparison; but the raw maximum can be taken beside the
# exponentials, from the scores alone, while the arguments exist one at a time inside the loop
# that packs P. Keeping the test on the raw scores also keeps `m` in the classic path's units:
# `m_new = max(m, mx · scale_log2)`, as in stage 12.

# %% [markdown]
# **Instructor's answer.** *3.* Two reasons. The classic path is a long stretch of code: split
# between lanes, the warp would run both paths one after the other for every lane anyway. And the
# two paths leave different registers live (the lazy pass has P, the classic path rebuilds it from
# S), which ptxas handles best when the branch is uniform. A vote costs one instruction.

# %% [markdown]
# **Instructor's answer.** *4.* The fallback issues a `wgmma`, and a `wgmma` is issued by the
# four warps of a warpgroup together (`.sync.aligned`). Decided per warp, one warp could take the
# fallback and issue the product alone while the others went on: undefined, and in practice a
# hang. The other shapes' fallback is per-thread arithmetic and shuffles within a warp, so a
# warp's vote is enough there. The warpgroup's vote costs a barrier across its 4 warps at every
# tile; the products already keep those warps close together.

# %% [markdown]
# **Instructor's answer.** *5.* Non-causal: the first key tile holds the sink, so the first tile,
# taken the classic way, sets each row's maximum and almost every later tile is lazy. Causal: the
# same, since every row sees key 0 in its first tile. Inputs whose largest scores come late (a
# query that attends to recent tokens only, with small scores elsewhere) fall back more often.

# %% [markdown]
# ## Summary
#
# - A tile's softmax waits for the row maximum before any exponential, and rescales O at every
#   tile: D / 2 multiplications a thread, though a row's maximum rarely moves after the first
#   tiles.
# - O / l does not depend on the `m` the exponentials are taken against; `m` only keeps them in
#   range. Stage 13 takes a tile's exponentials against `m` as it stands and checks the tile's
#   maximum beside them: if no score is more than 8 (log2 units) above `m`, P ≤ 256 and the tile
#   is done, with no rescale. Otherwise a warp vote sends the warp through stage 12's softmax.
# - Measured on the H100 (fp16, the sweep): 1.00–1.06× stage 12 (ties at D = 128 under the mask
#   at N = 512 and 16384), most at D = 64 on long sequences (1.04–1.06×); 1.01–1.20× cuDNN, and
#   686 TFLOP/s (69 % of the tensor peak) at D = 128, N = 16384 in the recorded run. Short items
#   gain less than their share of lazy tiles: their first and last tiles, and the store, are
#   untouched.
# - Where S cannot stay beside P (two blocks an SM, 104 registers) the lazy pass writes over S and
#   a failed vote computes S again; since that fallback issues a `wgmma`, the vote is taken over
#   the warpgroup (`bar.red.or.pred`), not the warp.
# - On random inputs the classic path never runs after an item's first tile; on keys that grow
#   along the sequence it runs at almost every tile, and the result is still exact.
# - Built on the lazy softmax, FlashAttention-3's in-warpgroup overlap ties at D = 128 and its
#   ping-pong still loses: a quarter off the softmax is not yet enough for the turns.

# %%
nb.reached("13_lazy_rescale")
