# %% [markdown]
# # 08 · Tuned: open up the shape, then let the GPU choose
#
# Stages 05–07 each added one idea and kept one shape: a block of 4 warps, each warp owning 16
# query rows, 64 keys per K/V tile, 2 buffers, Q held in registers. This stage adds no new idea.
# It takes stage 07's kernel, turns every one of those numbers into a template parameter, adds
# five small changes that can each be switched off, and **measures** which combination is
# fastest per head dim and mask (and, where one shape cannot serve every sequence length, per
# range of N). That is how production kernels are finished: FlashAttention-2 ships a table of
# tile shapes per head dim and GPU, found the same way.
#
# The notebook is a tuning log. For every change it states a **prediction** first — computed
# below from the kernel's loop counts, the bank model of notebook 05 and the GPU's measured
# ceilings — then the **measurement** from `data/tune08.csv` (written by `flashlab tune` on the
# GPU), then whether the change was **kept**. The last sections put the result against PyTorch's
# FlashAttention-2 and cuDNN kernels over the FlashAttention sweep.
#
# Everything before a measurement needs no GPU; the ptxas and SASS cells need `nvcc` (and
# `cuobjdump`) only. Where nothing has been measured yet, the measured cells say what to run.

# %%
%matplotlib inline
import math

import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import notebook as nb
from flashlab import autotune, picks, plots, tiling, tuning
nb.banner("08_tuned")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
gpu, cc, sms, roof = here
print(here)
tune = autotune  # the autotune: its candidates, switches and variant names
log = None
with nb.unless_missing():
    log = fl.tables.tune_log()  # the tuning log of this notebook's GPU
    print(f"tuning log: {len(log)} timed rows on {log['gpu'].iloc[0]}, commit "
          f"{log['commit'].iloc[0]}, {log['time'].max()}")
pick = picks.read()  # per (D, causal): the shape that serves the longest sequences
print("kernels/08_tuned.cu's pick() now:")
for (D, causal), segs in sorted(picks.read_by_n().items()):
    for below, c in segs:
        span = f"N < {below:5}" if below else "longer N " if len(segs) > 1 else "every N  "
        print(f"  D={D:3} {'causal    ' if causal else 'not causal'} {span}  {tuning.shape(c)}, "
              f"switches {tuning.options(c[-1])}")

# %% [markdown]
# ## 1 · The kernel: stage 07 with its numbers opened up
#
# The header of `kernels/08_tuned.cu` names every knob and what it trades:

# %%
nb.show_lines("08_tuned", r"^// Stage 08", r"^#include")

# %% [markdown]
# The five shape parameters are template arguments of the kernel, so each combination is its own
# compiled kernel with every loop unrolled for it. The block's rows and shared memory follow from
# them:

# %%
nb.show_source("08_tuned", "Tiles")

# %% [markdown]
# The sixth argument, `OPTS`, is a bit mask of the five small changes (`enum Opts`). `pick()`
# chooses one instantiation per head dim and mask, and per range of N where the tuner found a
# shape that wins the short sequences; its body is written by `flashlab tune --apply`
# from the recorded log (the `// TUNED:` line marks it):

# %%
nb.show_source("08_tuned", "pick")

# %% [markdown]
# **How the tuner decides** (`flashlab/autotune.py`). For each head dim it times a short list of
# candidate shapes, the first of which is stage 07's, with every switch on. A candidate's
# **score** for one head dim and mask is the geometric mean of its TFLOP/s over the sweep's
# sequence lengths (B·N = 16k tokens, H·D = 2048), so no single N dominates. The best score
# wins every N, except an N where another shape was more than 3% faster (`MARGIN`): that N gets
# its own shape, and `pick()` a branch on `p->N`. Each chosen shape is then timed again with each
# switch off in turn — and with all on once more, beside those runs, because the best of several
# noisy timings is biased high — and a switch stays on only where switching it off lost, over
# the N that shape serves. Stage 07's shape with every switch off is timed too: the log's
# starting point. Every timed row is kept in `data/tune08.csv`, the losers included.

# %%
cands = pd.DataFrame([dict(D=D, shape=tuning.shape(c), **dict(zip(tune.FIELDS, c)),
                           **tuning.block_tile(D, *c))
                      for D, cs in tune.CANDIDATES.items() for c in cs])
cands["smem_KiB"] = cands.pop("smem_bytes") / 1024
print(f"sequence lengths timed per candidate: {tune.NS}; switches: {', '.join(tune.SWITCHES)}")
cands[["D", "shape", "BR", "smem_KiB", "accumulators", "q_regs"]]

# %% [markdown]
# `accumulators` are the fp32 registers per lane that hold O and one tile of S; `q_regs` those
# that hold Q's fragments. Both grow with `WM` — the price of the first change.
#
# ## 2 · The starting point: stage 07's shape, every switch off
#
# With shape (BC 64, 4 warps, WM 1, 2 stages, Q in registers) and `OPTS = 0`, stage 08 computes
# exactly what stage 07 computes, the same way. Its score is the log's first line; each change
# below is measured against the shape and switches that precede it.

# %%
with nb.unless_missing():
    sc = tuning.scores(log)
    start = sc[sc["variant"] == tune.STAGE07].set_index(["D", "causal"])["score"]
    print("stage 07's shape, switches off — score (geometric mean TFLOP/s over N):")
    display(start.round(1).to_frame())

# %% [markdown]
# ## 3 · Change (i): open up the shape
#
# ### 3.1 Two row tiles per warp (WM = 2)
#
# In stage 07 a warp multiplies its 16 query rows by each K fragment it loads with `ldmatrix`,
# then by each V fragment. With `WM = 2` it owns 32 rows, as two row tiles, and every fragment
# it loads feeds **both**: the loops over `w` sit inside the loads.

# %%
nb.show_lines("08_tuned", r"// S = Q K\^T: each K fragment", r"mma_m16n8k16<T>\(s\[w\]\[n\], qa\[w\]\[1\]")

# %% [markdown]
# Counting from those loops (`tuning.warp_tile`): per K/V tile a warp issues `NS·KD/2` K loads
# and `KS·NO/2` V loads whatever `WM` is, and `WM` times the FLOPs. Each `ldmatrix.x4` is 4
# shared-memory wavefronts (the swizzle of stage 06 keeps every phase conflict-free), so the
# wavefronts per FLOP halve:

# %%
rows = []
for D, BC in ((64, 64), (128, 64)):
    for WM in (1, 2):
        w = tuning.warp_tile(D, BC, WM)
        rows.append(dict(D=D, BC=BC, WM=WM, flops=w["flops"], ldmatrix_KV=w["ldmatrix_kv"],
                         wavefronts=w["wavefronts"],
                         wavefronts_per_kFLOP=1e3 * w["wavefronts"] / w["flops"],
                         registers_O_S=w["regs_o"] + w["regs_s"], registers_Q=w["regs_q"]))
wm = pd.DataFrame(rows).set_index(["D", "BC", "WM"])
wm.round(3)

# %% [markdown]
# The price is registers: O's accumulators and the tile of S double, and at D = 128 Q's
# fragments (`D/4` registers per row tile) would double too. What the halved traffic buys
# depends on which unit limits the kernel. As in notebook 05, count the SM clocks one block
# needs per K/V tile from each unit (`tuning.limits`): the tensor cores at the measured fp16
# matmul ceiling, shared memory at one wavefront per clock, instruction issue at 4 per clock
# (`tuning.issue` lists the instructions: mma and ldmatrix exact, the rest estimated). The
# largest binds.

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM, as in notebooks 02, 03 and 05
per_s = sms * clock_ghz * 1e9  # SM-clocks per second, whole GPU
tc = roof["matmul_fp16_tflops"]
tc_rate = tc * 1e12 / per_s  # FLOP per clock per SM at the measured ceiling


def bound(D, c, skipped=0.0):
    """(TFLOP/s if the binding unit were all, its name) for candidate c at head dim D."""
    lim = tuning.limits(D, c, tc_rate, skipped)
    return tuning.block_tile(D, *c[:5])["flops"] / lim.max() * per_s / 1e12, lim.idxmax()


print(tuning.issue(64, 64).to_string())
model = pd.DataFrame([dict(D=D, shape=tuning.shape(c), **tuning.limits(D, (*c, tune.ALL_OPTS), tc_rate),
                           bound_tflops=bound(D, (*c, tune.ALL_OPTS))[0],
                           binds=bound(D, (*c, tune.ALL_OPTS))[1])
                      for D, cs in tune.CANDIDATES.items() for c in cs])
model.round(0)

# %%
b1, lim1 = bound(64, (64, 4, 1, 2, 1, tune.ALL_OPTS))
b2, lim2 = bound(64, (64, 4, 2, 2, 1, tune.ALL_OPTS))
print(f"prediction, D = 64: WM = 1 is bound by {lim1} at {b1:.0f} TFLOP/s; WM = 2 halves the "
      f"ldmatrix wavefronts per FLOP and is bound by {lim2} at {b2:.0f} TFLOP/s "
      f"({b2 / b1:.2f}x; the measured fp16 matmul ceiling is {tc:.0f})")

# %% [markdown]
# ### 3.2 Q in registers, or re-read every tile
#
# Stage 07 loads Q's fragments once and keeps them: `D/4` registers per row tile. With `WM = 2`
# at D = 128 that is 64 registers for Q beside 128 for O — more than a thread can hold with S
# and the addresses. `Q_REGS = false` re-reads Q from shared memory with `ldmatrix` at every
# tile instead: `WM·KD` more loads per tile.

# %%
for D, BC in ((64, 64), (128, 64)):
    kept, reread = tuning.warp_tile(D, BC, 2, True), tuning.warp_tile(D, BC, 2, False)
    print(f"D={D}, BC={BC}, WM=2: Q re-read adds {reread['ldmatrix_q']} ldmatrix.x4 per tile to "
          f"{kept['ldmatrix']} (+{100 * reread['ldmatrix_q'] / kept['ldmatrix']:.0f}% wavefronts) "
          f"and frees {kept['regs_q']} registers per lane; wavefronts per kFLOP "
          f"{1e3 * reread['wavefronts'] / reread['flops']:.3f}, against "
          f"{wm.loc[(D, BC, 1), 'wavefronts_per_kFLOP']:.3f} with WM = 1")

# %% [markdown]
# So re-reading Q gives back part of what `WM = 2` saved, but not all: the prediction is that
# `WM = 2` with Q re-read still beats `WM = 1` where registers allow nothing else.
#
# ### 3.3 Keys per tile, warps, pipeline depth
#
# * **BC**: a longer K/V tile does the same work per key, but pays the per-tile costs — the
#   barrier, the rescale of O, the row bookkeeping, the loop — fewer times per key; it needs
#   `BC/2` more registers for S per row tile.
# * **WARPS**: 8 warps give a block 128 rows: each K/V tile copied into shared memory feeds twice
#   as many rows (half the copy traffic per FLOP), but a block needs twice the threads and the
#   grid has half as many blocks to spread over the SMs.
# * **STAGES**: a third buffer keeps two tiles in flight instead of one; it costs
#   `2·BC·D·2` bytes of shared memory, which may cost a block per SM. The clock model above
#   cannot see latency, so it predicts no change; the measurement decides.

# %%
occ = []
for _, r in cands.iterrows():
    smem = int(r.smem_KiB * 1024)
    occ.append(dict(D=r.D, shape=r["shape"], smem_KiB=r.smem_KiB,
                    blocks_per_SM_by_smem=tiling.occupancy(1, smem, 32 * r.WARPS, cc)["limits"][
                        "shared memory"],
                    per_tile_costs_per_key=tuning.issue(r.D, r.BC, r.WM, r.Q_REGS, r.WARPS).filter(
                        regex="rescale|bookkeeping").sum() / r.BC))
pd.DataFrame(occ).round(2)

# %% [markdown]
# `per_tile_costs_per_key`: the warp-instructions that come once per tile whatever its length —
# the rescale of O, the vote on it, the row bookkeeping, the loop and barrier — divided by the
# keys the tile holds.

# %% [markdown]
# ### 3.4 Registers and spills: measured, not excluded
#
# A shape's kernel has to fit in 255 registers a thread. `ptxas` says, per shape, how many it
# needs and how many bytes it **spills** to local memory (stores and reloads through L1). An
# earlier version of this tuner left every spilling shape out, on the reasoning that spills are
# slow; the log below shows why it no longer does. Its docstring:

# %%
print(tune.__doc__.split("\n\n")[2])

# %% [markdown]
# Compiled now (nvcc only, no GPU; cached): every candidate, all switches on, and a few shapes
# that are not candidates (Q kept in registers beside two row tiles and longer tiles), with what
# the registers allow per SM:

# %%
extra = {64: [(128, 4, 2, 2, 1), (64, 8, 1, 2, 1)], 128: [(64, 4, 2, 2, 1), (32, 4, 2, 2, 1)]}
jobs = [(D, (*c, tune.ALL_OPTS)) for D, cs in tune.CANDIDATES.items() for c in cs]
jobs += [(D, (*c, tune.ALL_OPTS)) for D, cs in extra.items() for c in cs]
res = None
with nb.unless_missing():
    res = tuning.resources(jobs)
    res["candidate"] = [c[:5] in tune.CANDIDATES[D] for D, c in jobs]
    res["blocks_per_SM"] = [tiling.occupancy(r.registers, tuning.block_tile(D, *c[:5])["smem_bytes"],
                                             32 * c[1], cc)["blocks"]
                            for r, (D, c) in zip(res.itertuples(), jobs)]
res

# %%
with nb.unless_missing():
    if res is None:
        raise nb.NotRecorded("ptxas's report: nvcc is needed for it")
    cand = res[res["candidate"]]
    print(f"{int((cand['spill_bytes'] > 0).sum())} of the {len(cand)} candidates spill, all "
          f"switches on; highest register count of a candidate: {cand['registers'].max()} "
          f"(255 is the most a thread can have)")

# %% [markdown]
# What a spill costs is a measurement, not a rule. Before `ONE_KSTEP` (section 8), the 64-key
# tile with two row tiles per warp did not fit at D = 128: `ptxas` spilled it, and the tuner
# settled on 32-key tiles. The log has both: the chosen shape **without** `ONE_KSTEP` is exactly
# that spilling kernel, and the 32-key shapes are candidates.

# %%
with nb.unless_missing():
    sc = tuning.scores(log)
    for causal in (False, True):
        c = tuning.choice(log)[(128, causal)]
        no_k = c[:-1] + (tune.ALL_OPTS & ~tune.SWITCHES["ONE_KSTEP"],)
        here = sc[(sc["D"] == 128) & (sc["causal"] == causal)]
        spilled = here[(here["variant"] == "without ONE_KSTEP") & (here["candidate"] == no_k)]["score"]
        short = here[(here["variant"] == tune.ALL) & (here["BC"] < c[0])]
        if spilled.empty or short.empty:
            continue
        best_short = short.loc[short["score"].idxmax()]
        spill = tuning.resources([(128, no_k)])["spill_bytes"].iloc[0]
        print(f"D=128 {'causal    ' if causal else 'not causal'}: {tuning.shape(c)} without "
              f"ONE_KSTEP spills {spill} bytes and scores {spilled.iloc[0]:.0f} TFLOP/s; the best "
              f"shorter-tile shape, {tuning.shape(best_short['candidate'])}, scores "
              f"{best_short['score']:.0f} without spilling")

# %% [markdown]
# A spilled value is stored once and reloaded once per K/V tile, from L1; a 32-key tile pays the
# barrier, the row max and sum, the shuffles and the rescale twice per 64 keys. Here the second
# cost was the larger, so excluding shapes for spilling had cost the tuner its best shape at
# D = 128. (`ONE_KSTEP` then removes the spill; section 8 measures it.)
#
# ### 3.5 Measured: the shapes
#
# Every candidate's score, all switches on; the chosen shape in red, stage 07's hatched:

# %%
with nb.unless_missing():
    display(tuning.candidates_figure(log))

# %% [markdown]
# One shape change at a time, each measured ratio beside the clock model's (a ratio of bounds,
# so it predicts only the units it models):

# %%
changes = {
    "WM 1 → 2": {64: ((64, 4, 1, 2, 1), (64, 4, 2, 2, 1))},
    "WM 1 → 2, Q re-read": {128: ((64, 4, 1, 2, 1), (64, 4, 2, 2, 0))},
    "Q registers → re-read": {64: ((64, 4, 2, 2, 1), (64, 4, 2, 2, 0))},
    "BC 64 → 32": {64: ((64, 4, 1, 2, 1), (32, 4, 1, 2, 1))},
    "BC 64 → 128": {64: ((64, 4, 2, 2, 0), (128, 4, 2, 2, 0))},
    "BC 32 → 64": {128: ((32, 4, 2, 2, 0), (64, 4, 2, 2, 0))},
    "4 → 8 warps": {64: ((64, 4, 2, 2, 1), (64, 8, 2, 2, 1)), 128: ((64, 4, 2, 2, 0), (64, 8, 2, 2, 0))},
    "2 → 3 stages": {64: ((64, 4, 2, 2, 1), (64, 4, 2, 3, 1)), 128: ((32, 4, 2, 2, 0), (32, 4, 2, 3, 0))},
}
predicted = pd.Series({(name, D): bound(D, (*b, tune.ALL_OPTS))[0] / bound(D, (*a, tune.ALL_OPTS))[0]
                       for name, by_d in changes.items() for D, (a, b) in by_d.items()},
                      name="predicted")
with nb.unless_missing():
    eff = tuning.effects(changes, log)
    eff["predicted"] = [predicted[(name, D)] for name, D, _ in eff.index]
    display(eff.round(3))
    print("the chosen shapes (per N where one shape won short sequences by more than 3%):")
    for (D, causal), by_n in sorted(tune.chosen_by_n(log).items()):
        for below, c in tune.segments(by_n):
            span = f"N < {below:5}" if below else "longer N " if len(tune.segments(by_n)) > 1 else "every N  "
            print(f"  D={D:3} {'causal    ' if causal else 'not causal'} {span}  {tuning.shape(c)}")
    print(tuning.per_n(log).round(0).to_string())

# %% [markdown]
# Read each line as prediction against measurement: where the ratio is close to the predicted
# one, the clock model has the binding unit right; where the measured gain is larger (a third
# stage, say), the change hid latency, which the model does not count; where it is smaller, some
# unit the model leaves out — occupancy, the tail of the grid — took it back. The chosen shapes
# are kept; the five switches below are measured on them. The table under the list is the cost of
# one shape for many N: the chosen kernel at each N beside the fastest candidate there.
#
# The predictions for the switches are made for the shapes the kernel runs: the chosen ones
# once the log exists, until then those of `pick()` now.

# %%
shapes = pick
with nb.unless_missing():
    shapes = tuning.choice(log)
print("predicting for: " + "; ".join(f"D={D}{' causal' if c else ''}: {tuning.shape(s)}"
                                     for (D, c), s in sorted(shapes.items())))


def saving(switch, skipped=0.0):
    """Per (D, causal): warp-instructions per tile with all switches on, without `switch`, and
    the share of the instructions the switch removes."""
    out = {}
    for (D, causal), c in sorted(shapes.items()):
        bc, warps, wm_, _, q_regs, _ = c
        on = tuning.issue(D, bc, wm_, q_regs, warps, tune.ALL_OPTS, skipped).sum()
        off = tuning.issue(D, bc, wm_, q_regs, warps, tune.ALL_OPTS & ~tune.SWITCHES[switch],
                           skipped).sum()
        out[(D, causal)] = dict(all_on=on, without=off, saved_pct=100 * (off - on) / off,
                                binds=bound(D, c, skipped)[1])
    return pd.DataFrame(out).T.rename_axis(["D", "causal"]).infer_objects()


def measured(switch):
    """The log's verdict on `switch`: the winner all on, without it, the change, kept or not
    (rows where it was not timed left out)."""
    with nb.unless_missing():
        display(tuning.verdicts(log).loc[switch].dropna(subset=["without"]).round(2))

# %% [markdown]
# ## 4 · Change (ii): FOLD_SCALE — the scale goes into the exponent
#
# Stage 07 multiplies every score by `scale·log2 e` before the softmax: one `FMUL` per score.
# But the row max commutes with a positive scale, max(c·s) = c·max(s), so the kernel can take
# the max of the raw scores, scale only the max, and fold the scale of each score into the
# `FFMA` that computes the exponent, exp2(s·c − m). (That is why flashlab refuses a softmax scale
# that is not positive and finite: a negative one would turn the max into the min.)

# %%
nb.show_lines("08_tuned", r"const float m_new = fmaxf\(m\[h\], kFold", r"x = exp2_approx\(kFold")

# %% [markdown]
# **Prediction**: one instruction per score a lane holds, out of the tile's instruction budget
# (`tuning.issue`, per warp and tile). That share is the most it can gain, reached only if
# instruction issue were what binds; `binds` says which unit the clock model of section 3.1
# expects to bind the shape instead.

# %%
saving("FOLD_SCALE").round(1)

# %% [markdown]
# **Measured** (the winner with every switch on, then without this one):

# %%
measured("FOLD_SCALE")

# %% [markdown]
# ## 5 · Change (iii): SKIP_RESCALE — no rescale once the max has settled
#
# After each tile the online softmax rescales O by alpha = 2^(m_old − m_new): `D/2` multiplies
# per row tile and lane. Once a row's running max stops moving, alpha is exactly 1 and the
# multiplies change nothing. The kernel asks the warp (`__any_sync`) whether any of its rows
# moved, and skips the rescale if none did:

# %%
nb.show_lines("08_tuned", r"bool moved = false;", r"o\[w\]\[d\]\[3\] \*= alpha")

# %% [markdown]
# **Prediction.** How often does a warp skip? The benchmark's inputs are `randn`, so a row's
# scores are independent and identically distributed: the max of its first j tiles is in tile
# j with probability 1/j. A warp skips tile j only if none of its `16·WM` rows moved
# (`tuning.rescales_skipped`). Long sequences skip most tiles; a 32-row warp skips fewer than a
# 16-row one, and a causal launch, whose blocks see fewer tiles, fewer still.

# %%
skip = pd.DataFrame({(f"{16 * w} rows"): {n: tuning.rescales_skipped(16 * w, n // bc)
                                          for n in tune.NS}
                     for w, bc in ((1, 64), (2, 64))}).rename_axis("N (BC = 64)")
display(skip.round(2))
mean_skip = {(D, causal): sum(tuning.rescales_skipped(16 * c[2], max(1, n // c[0] // (2 if causal else 1)))
                              for n in tune.NS) / len(tune.NS)
             for (D, causal), c in shapes.items()}
pred = pd.concat([saving("SKIP_RESCALE", mean_skip[k]).loc[[k]] for k in sorted(shapes)])
pred.insert(0, "tiles_skipped", pd.Series(mean_skip))
pred.round(2)

# %% [markdown]
# (A causal block sees half the tiles on average; `tiles_skipped` approximates it by halving the
# tile count.) The vote is not free — `all_on` counts it — and the share above is the most the
# switch can gain, if instruction issue binds.
#
# **Measured:**

# %%
measured("SKIP_RESCALE")

# %% [markdown]
# ## 6 · Change (iv): WARP_SKIP — causal tiles a warp has no use for
#
# With a causal mask, a block's last K/V tiles straddle the diagonal. Stage 07 computes a tile
# for all the block's warps and masks the scores to −∞; but a warp whose last row is before the
# tile's first key masks **all** of it. WARP_SKIP lets that warp skip the tile's math (it still
# helps copy the tile and meets the barrier, which the other warps need):

# %%
nb.show_lines("08_tuned", r"// Causal: a tile that starts past", r"if \(kWarpSkip")

# %% [markdown]
# **Prediction.** From the kernel's own condition (`tuning.warp_tiles_skipped`): with `BR = BC`,
# as in stage 07, the diagonal tile starts at the block's first row and no warp can skip it —
# the switch can only matter where a block has more rows than a tile has keys (`WM = 2`, 8
# warps, or 32-key tiles). Even then it is a small share of a launch's (warp, tile) steps,
# largest at short N:

# %%
ws = pd.DataFrame({f"D={D} {tuning.shape(c)}": {n: tuning.warp_tiles_skipped(
    n, 16 * c[2] * c[1], c[0], c[2]) for n in tune.NS}
    for (D, causal), c in sorted(shapes.items()) if causal}).rename_axis("N")
(100 * ws).round(2).rename(columns=lambda s: s + " (% skipped)")

# %% [markdown]
# An ablation is only fair if switching the bit off changes nothing else. ptxas says whether the
# chosen shapes still fit in registers with each switch off (the tuner times exactly these):

# %%
with nb.unless_missing():
    ab = tuning.resources([(D, c[:-1] + (tune.ALL_OPTS & ~bit,)) for (D, _), c in sorted(shapes.items())
                           for bit in tune.SWITCHES.values()])
    display(ab.drop_duplicates())
    if (ab["spill_bytes"] > 0).any():
        print("Some of these spill: their 'without' timing measures the spills as well as the "
              "switch, and the switch looks better than it is.")

# %% [markdown]
# **Measured** (causal only; without a mask there is nothing to skip, and it is not timed):

# %%
measured("WARP_SKIP")

# %% [markdown]
# ## 7 · Change (v): LANE_OFFSETS — fewer integer instructions for addresses
#
# Every `ldmatrix` needs a shared-memory address per lane, and with stage 06's swizzle the
# address of 16-byte chunk `c` of row `r` is `r·D + ((c ⊕ (r mod 8))·8)` halves. Stage 07
# writes that formula out for every load: shifts, an XOR, multiplies and adds, per lane. But the
# loops are unrolled, so every load's `row0` and chunk step `m` are **compile-time constants**;
# only the lane's part varies. The chunk a lane asks for is `(2m + h) ⊕ (r mod 8)`, with `h` and
# `r mod 8` the lane's. Because `r mod 8 < 8`, the XOR only touches the low three bits, and
#
#     (2m + h) ⊕ rl  =  (2m & ~7) + (2(m & 3) ⊕ y),   y = h ⊕ rl
#
# — a constant plus one of **four** per-lane values, chosen by `m & 3` (also a constant). So each
# lane computes four bases once (two more for K read in stage 07's pairs, whose chunks step by 4;
# four for K read one k-step at a time, `ONE_KSTEP` in section 8), and every load's address is
# a base plus a constant, which `LDSM` takes as an immediate offset: no instruction at all.

# %%
nb.show_source("08_tuned", "LaneOffsets")

# %% [markdown]
# The identity, checked for every lane, row group and chunk step against the swizzle itself, for
# the A / V loads and both kinds of K loads:

# %%
from flashlab.fragments import smem_offset  # byte offset of (row, col) in a swizzled tile

for D in (64, 128):
    ok = True
    for lane in range(32):
        rl, y, x = lane % 8, (lane // 16) ^ (lane % 8), (lane // 8) ^ (lane % 8)
        av = [2 * (lane % 16) * D + 16 * ((2 * i) ^ y) for i in range(4)]
        k = [2 * rl * D + 16 * ((4 * i) ^ x) for i in range(2)]
        yk = ((lane // 8) % 2) ^ rl
        kb = [2 * (rl + 8 * (lane // 16)) * D + 16 * ((2 * i) ^ yk) for i in range(4)]
        for row0 in range(0, 64, 8):
            for m in range(D // 16):  # the A / V chunk pairs
                want = smem_offset(row0 + lane % 16, 16 * m + 8 * (lane // 16), 2 * D, True)
                ok &= 2 * row0 * D + 16 * ((2 * m) & ~7) + av[m & 3] == want
            for kk in range(0, D // 16, 2):  # the K reads: chunk 2kk + lane / 8
                want = smem_offset(row0 + lane % 8, 16 * kk + 8 * (lane // 8), 2 * D, True)
                ok &= 2 * row0 * D + 16 * ((2 * kk) & ~7) + k[(kk >> 1) & 1] == want
            for kk in range(D // 16):  # ONE_KSTEP: rows lane % 8 + 8 (lane / 16), chunk 2kk + lane / 8 % 2
                want = smem_offset(row0 + lane % 8 + 8 * (lane // 16), 16 * kk + 8 * (lane // 8 % 2),
                                   2 * D, True)
                ok &= 2 * row0 * D + 16 * ((2 * kk) & ~7) + kb[kk & 3] == want
    print(f"D={D}: LaneOffsets == the swizzle for every lane and load: {ok}")

# %% [markdown]
# The copies get the same treatment: a thread's rows in `load_tile_async` are `STEP` apart, a
# multiple of 8, so its swizzle is the same for all of them — one offset, then constant strides.
#
# **Prediction**, from the machine code: the integer instructions that compute addresses (`IMAD`
# other than its register moves, `LEA`, `LOP3`, `IADD3`, `SHF`), counted in the SASS of stage 07,
# of stage 08's D = 64 shape with all switches on, and of the same shape without LANE_OFFSETS.
# Static counts: each instruction as often as it appears in the code.

# %%
c64 = shapes[(64, False)]
mix = None
with nb.unless_missing():
    mix = tuning.address_mix({
        "07_cp_async": fl.stage("07_cp_async").source,
        f"08, {tuning.shape(c64)}, all on": picks.variant_source(64, c64[:-1] + (tune.ALL_OPTS,)),
        "08, the same without LANE_OFFSETS": picks.variant_source(
            64, c64[:-1] + (tune.ALL_OPTS & ~tune.SWITCHES["LANE_OFFSETS"],)),
    })
mix

# %%
with nb.unless_missing():
    if mix is None:
        raise nb.NotRecorded("SASS counts: they need nvcc and cuobjdump (pip install "
                             "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    on, off = mix.iloc[1], mix.iloc[2]
    fewer = (off - on)[tuning.ADDRESS_OPS].sort_values(ascending=False)
    print(f"LANE_OFFSETS removes {off['integer, together'] - on['integer, together']} integer "
          f"instructions of {off['every instruction']} in the D = 64 kernel; all instructions: "
          f"{100 * (off['every instruction'] - on['every instruction']) / off['every instruction']:.1f}% "
          f"fewer. The most: " + ", ".join(f"{op} {n:+d}" for op, n in (-fewer).head(3).items())
          + "; IMAD.MOV (register copies, not arithmetic): "
          + f"{on['IMAD.MOV (moves)'] - off['IMAD.MOV (moves)']:+d}")

# %% [markdown]
# The category counts of both stages (`nb.instructions`: tensor-core, load and spill
# instructions; recorded in `data/sass.csv` where `cuobjdump` is not installed):

# %%
with nb.unless_missing():
    display(nb.instructions("07_cp_async"))
    display(nb.instructions("08_tuned"))

# %% [markdown]
# **Measured:**

# %%
measured("LANE_OFFSETS")

# %% [markdown]
# ## 8 · Change (vi): ONE_KSTEP — one Q fragment live instead of two
#
# Stage 07 computes S = Q Kᵀ two k-steps at a time: one `ldmatrix.x4` brings 8 keys × 32 dims of
# K, the B operands of two `mma` k-steps, and so the A fragments of **both** k-steps — Q's, one
# per row tile — must be live together. Nothing forces that pairing. With ONE_KSTEP the loop
# walks the head dim one 16-wide k-step at a time, and each `ldmatrix.x4` brings 16 keys × 16
# dims instead: the same number of loads and `mma`, but one Q fragment per row tile live, 4·WM
# registers fewer. The lanes address the four 8×8 matrices in the order (keys lo, k lo), (keys
# lo, k hi), (keys hi, k lo), (keys hi, k hi), so each `mma`'s two B registers come out adjacent
# — in the other order the compiler has to copy them into pairs, one `MOV` per register.

# %%
nb.show_lines("08_tuned", r"if constexpr \(kOneK\)", r"mma_m16n8k16<T>\(s\[w\]\[n \+ 1\]")

# %% [markdown]
# **Prediction.** No instruction count changes (`saving` below finds nothing to save), so by
# the clock model nothing happens — unless registers bind. `ptxas` says what the switch does to
# the chosen shapes' registers, spills and blocks per SM:

# %%
saving("ONE_KSTEP").round(1)

# %%
with nb.unless_missing():
    bit = tune.SWITCHES["ONE_KSTEP"]
    jobs = [(D, c[:-1] + (o,)) for (D, _), c in sorted(shapes.items())
            for o in (c[-1] | bit, c[-1] & ~bit)]  # the chosen switches, with and without it
    rk = tuning.resources(list(dict.fromkeys(jobs)))
    rk["ONE_KSTEP"] = ["on" if c[-1] & tune.SWITCHES["ONE_KSTEP"] else "off"
                       for _, c in dict.fromkeys(jobs)]
    rk["blocks_per_SM"] = [tiling.occupancy(r.registers, tuning.block_tile(D, *c[:5])["smem_bytes"],
                                            32 * c[1], cc)["blocks"]
                           for r, (D, c) in zip(rk.itertuples(), dict.fromkeys(jobs))]
    display(rk)

# %% [markdown]
# Where the shape had registers to spare, the switch should change little; where the kernel
# sits at 255 registers, the eight (or four) freed registers decide between spilling and not,
# and the prediction is a gain of the size section 3.4 measured for the spill.
#
# **Measured:**

# %%
measured("ONE_KSTEP")

# %% [markdown]
# ## 9 · The log at a glance
#
# From stage 07's shape with every switch off, to the chosen shape with all on, to each switch
# off in turn; green bars are switches the kernel keeps (switching them off lost), grey ones it
# dropped:

# %%
with nb.unless_missing():
    display(tuning.ablation_figure(log))

# %%
with nb.unless_missing():
    v = tuning.verdicts(log)
    sc = tuning.scores(log)
    for (D, causal), c in sorted(tuning.choice(log).items()):
        first = sc[(sc["D"] == D) & (sc["causal"] == causal)
                   & (sc["variant"] == tune.STAGE07)]["score"].iloc[0]
        final = sc[(sc["D"] == D) & (sc["causal"] == causal) & sc["chosen"]
                   & (sc["candidate"] == c)]["score"].iloc[0]
        kept = v.xs((D, causal), level=("D", "causal"))["kept"]
        print(f"D={D:3} {'causal    ' if causal else 'not causal'}: {first:6.1f} -> {final:6.1f} "
              f"TFLOP/s ({final / first:.2f}x); {tuning.shape(c)}; keeps "
              f"{', '.join(kept[kept].index) or 'no switch'}")

# %% [markdown]
# ## 10 · Measure the tuned kernel
#
# On a GPU this builds the stage (with the `pick()` that `--apply` wrote), checks it against a
# float64 reference, times it at the teaching config and over the FlashAttention sweep, and
# records the rows. Without a GPU it shows the recorded rows.

# %%
ev = nb.evaluate("08_tuned")
ev

# %% [markdown]
# ## 11 · Against FlashAttention-2 and cuDNN
#
# PyTorch's SDPA has a FlashAttention-2 backend (`sdpa_flash`) and a cuDNN one (`sdpa_cudnn`).
# The issue that asked for this stage set its bar at **stage 08 ≥ sdpa_flash at every config of
# the FlashAttention sweep** (fp16, B·N = 16k, H·D = 2048, N = 512 … 16k, D = 64 and 128, causal
# and not):

# %%
plots.scaling()

# %%
vs = None
with nb.unless_missing():
    vs = fl.tables.versus(stage="08_tuned", gpu=gpu)
    display(vs.round(2))
    ratio = vs["÷ sdpa_flash"]
    losses = ratio[ratio < 1]
    print(f"stage 08 >= sdpa_flash at {int((ratio >= 1).sum())} of {len(ratio)} configs: "
          f"{'met' if losses.empty else 'NOT met'}; worst {ratio.min():.2f}x at "
          f"D={ratio.idxmin()[0]}, causal={ratio.idxmin()[1]}, N={ratio.idxmin()[2]}")
    if "÷ sdpa_cudnn" in vs:
        print(f"against cuDNN: {vs['÷ sdpa_cudnn'].min():.2f}x - {vs['÷ sdpa_cudnn'].max():.2f}x")

# %% [markdown]
# Where stage 08 loses, look for the reason in the data. Three candidates, each printed per
# losing config:
#
# * **the shape for this N**: one shape serves a head dim and mask unless another beat it at an
#   N by more than 3%; the tuning log says whether another shape was faster at this N;
# * **short sequences**: a block loads Q, fills the pipeline and writes O once, whatever N is;
#   with few K/V tiles per block those fixed costs weigh more;
# * **the schedule**: the sweep keeps the number of blocks the same at every N, but with a causal
#   mask their work differs — the blocks on the diagonal's far end have `N/BC` tiles, the first
#   ones one — and the last of them run while other SMs idle (`tuning.launch_efficiency`:
#   the share of the GPU's block slots the launch keeps busy).

# %%
with nb.unless_missing():
    if vs is None:
        raise nb.not_recorded("08_tuned", " over the FlashAttention sweep")
    ratio = vs["÷ sdpa_flash"]
    losing = ratio[ratio < 1]
    if losing.empty:
        print("no config to explain: stage 08 is at or above sdpa_flash everywhere")
    best = tuning.per_n(log) if log is not None else None
    rec = fl.recorded("08_tuned")
    for (D, causal, n), r in losing.items():
        c = next(c for below, c in picks.read_by_n()[(D, causal)] if not below or n < below)
        bc, warps, BR = c[0], c[1], 16 * c[2] * c[1]
        regs = pd.to_numeric(rec[rec["D"] == D]["registers"]).max()  # ptxas, as recorded
        per_sm = tiling.occupancy(int(regs) if regs == regs else 255,
                                  tuning.block_tile(D, *c[:5])["smem_bytes"], 32 * warps, cc)["blocks"]
        busy = tuning.launch_efficiency(n, (16384 // n) * (2048 // D), BR, bc, per_sm * sms, causal)
        line = (f"D={D} causal={causal} N={n}: {r:.2f}x sdpa_flash; {math.ceil(n / bc)} K/V tiles "
                f"per block at most; the schedule keeps {100 * busy:.0f}% of the {per_sm * sms} "
                f"block slots busy")
        if best is not None and (D, causal, n) in best.index:
            b = best.loc[(D, causal, n)]
            line += ("; the chosen shape was also the fastest at this N" if b.best <= b.chosen else
                     f"; at this N {b.best_shape} was faster: {b.best:.0f} TFLOP/s against the "
                     f"chosen shape's {b.chosen:.0f}")
        print(line)

# %% [markdown]
# The whole ladder at the teaching config — stages 01–03 run in fp32 only, the tensor-core
# stages in fp16 and bf16 — and every stage on the roofline:

# %%
from matplotlib.figure import Figure

ladders = Figure(figsize=(16, 5))
for ax, dtype in zip(ladders.subplots(1, 2), ("fp32", "fp16")):
    plots.ladder(dtype=dtype, ax=ax)
ladders

# %%
plots.roofline()

# %% [markdown]
# ## 12 · The profile: did the shape change what it was meant to?
#
# Opening the shape (`WM = 2` above all) was meant to cut shared-memory traffic per FLOP and so
# to keep the tensor pipe busier (its `idea_metrics` in the registry, `flashlab/stages.py`): Nsight Compute's
# counters of both, stage 07 beside stage 08, at the teaching config.

# %%
with nb.unless_missing():
    p08 = nb.profile("08_tuned")
    display(p08)
    m7, m8 = p08.get("07_cp_async"), p08["08_tuned"]
    if m7 is not None:
        print(f"shared-memory wavefronts: {m8.get('smem_wavefronts') / m7.get('smem_wavefronts'):.2f}x "
              f"stage 07's; tensor pipe {m7.get('tensor_pipe_pct'):.0f}% -> "
              f"{m8.get('tensor_pipe_pct'):.0f}% of peak")

# %%
plots.idea_metrics()

# %% [markdown]
# ## 13 · Two ideas the log did not time, and why
#
# Two more changes are standard in FlashAttention kernels. Each gets a prediction here, from
# the machine code and the recorded profile, instead of a timing — and each prediction says
# there is nothing for it to gain in this kernel.
#
# **Register double-buffering**: load the fragments of the next k-step into a second set of
# registers while the `mma` of this one run, so no `mma` waits for `ldmatrix`. In the source that
# means two sets of fragment registers; but `ptxas` schedules the unrolled loop itself, and can
# hoist a load as far ahead of its use as registers allow. `sass.load_use` reads the chosen
# kernels' machine code: for every `ldmatrix` in the main loop, how many instructions — and how
# many `mma` (HMMA) — issue between the load and the first instruction that reads its registers.

# %%
from flashlab import sass

with nb.unless_missing():
    rows = []
    for (D, causal), segs in sorted(picks.read_by_n().items()):
        for below, c in segs:
            try:
                lu = sass.load_use(fl.stage("08_tuned").source, picks.kernel_name(D, c))
            except FileNotFoundError as err:
                raise nb.NotRecorded(f"the machine code needs nvcc and cuobjdump: {err}")
            rows.append(dict(D=D, causal=causal, N=f"< {below}" if below else "rest",
                             shape=tuning.shape(c), ldmatrix_per_trip=len(lu),
                             median_instructions=lu["instructions"].median(),
                             median_mma=lu["hmma"].median(),
                             with_no_mma_between=int((lu["hmma"] == 0).sum())))
    display(pd.DataFrame(rows).drop_duplicates("shape").set_index(["D", "causal", "N"]))

# %% [markdown]
# Nearly every load already has several `mma` between it and its first use: the compiler has
# double-buffered the fragments on its own. The few loads per trip that have none (the table's
# last column) are the first of a phase: the first K and Q fragments of a tile, which cannot be loaded before the
# barrier that makes the tile visible, and the first V fragment, which waits only on the softmax
# (and has its dozens of instructions in between). Writing the double buffer by hand would add
# `4·WM + 4` registers per lane to kernels that sit at 255 — section 3.4's spills — for loads
# whose latency is already covered. Prediction: no gain; not timed.
#
# **Grid order for L2 reuse.** Every block of a head reads all of that head's K and V. Blocks
# with neighbouring indices run at the same time, and the query tile (`blockIdx.x % tiles`)
# varies fastest, so the blocks of one head run side by side and a head's K and V come from DRAM once,
# from L2 after that. The profile says how much DRAM traffic there is (teaching config):

# %%
with nb.unless_missing():
    m8 = nb.profile("08_tuned")["08_tuned"]
    B, H, N, D = 4, 16, 1024, 64  # the teaching config the profile ran
    once = 3 * B * H * N * D * 2
    print(f"DRAM bytes measured: {m8.get('dram_bytes') / 1e6:.1f} MB; reading Q, K and V once: "
          f"{once / 1e6:.1f} MB; writing O: {once / 3e6:.1f} MB (a write still in L2 when the "
          f"kernel ends is not counted)")
    jobs = sorted(set((D, c) for (D, _), c in shapes.items()))
    regs = dict(zip(jobs, tuning.resources(jobs)["registers"]))  # one ptxas pass for all shapes
    for (D, causal), c in sorted(shapes.items()):
        n = 16384
        per_sm = tiling.occupancy(int(regs[(D, c)]), tuning.block_tile(D, *c[:5])["smem_bytes"],
                                  32 * c[1], cc)["blocks"]
        tiles = n // (16 * c[2] * c[1])  # blocks per head
        heads = math.ceil(per_sm * sms / tiles) + 1
        print(f"D={D:3} {'causal    ' if causal else 'not causal'} N={n}: {per_sm * sms} blocks "
              f"resident span at most {heads} heads, whose K and V take "
              f"{heads * 2 * n * D * 2 / 2**20:.0f} MiB of L2")

# %% [markdown]
# The teaching config reads no more than Q, K and V once: L2 already serves every re-read of K
# and V, and no other block order can save DRAM traffic there. At the sweep's longest sequences
# the blocks resident at once span a handful of heads, whose K and V together still fit in the
# H100's 50 MB of L2 (the lines above). Prediction: no gain; not timed. (What order does buy is the **tail** of a
# causal launch: since stage 05 a causal grid starts with its longest blocks,
# `tile = tiles − 1 − blockIdx.x % tiles`, so the short ones fill in at the end.)

# %% [markdown]
# ## 14 · What tuning did not do
#
# Every shape here is still Ampere's way of using the tensor cores: `mma.sync` on operands a
# warp loaded itself with `ldmatrix`. Hopper has two instructions this kernel does not use —
# `wgmma`, which multiplies operands straight from shared memory for a whole warpgroup, and the
# Tensor Memory Accelerator (TMA), which copies whole tiles with one thread — and
# FlashAttention-3 is built on them. The measured fp16 matmul ceiling is `wgmma`'s; how far the
# tuned kernel stays below it, in the roofline above, is what they would buy.
