# %% [markdown]
# # Stage 14 — The backward pass: FlashAttention-2's Algorithm 2, without storing P
#
# Training needs more than O: from dO, the loss's gradient with respect to O, the backward pass
# returns dQ, dK and dV, and the textbook way reads the N × N matrix of probabilities P that the
# forward kept. FlashAttention's forward never stores P, so its backward **recomputes P block by
# block** from Q, K and one number per query row that the forward saves: the row's log-sum-exp.
# This stage is stage 08's forward, which writes that number (as every forward from stage 05 can
# when asked), and FlashAttention-2's backward (its Algorithm 2) written plainly on the CUDA cores
# in fp32: the algorithm, not yet its speed.
#
# ## Objectives
# After this notebook you can:
# - derive dV, dP, dS, dQ and dK from dO, and say why Δ = rowsum(dO ∘ O) stands in for the
#   softmax's Jacobian;
# - explain how one log-sum-exp per row lets any block of P be recomputed exactly, and what
#   saving it costs the forward;
# - follow Algorithm 2's loop order (a thread block per key block, dK and dV on chip, dQ added up
#   with fp32 atomics) and count its FLOPs as FlashAttention does;
# - predict a CUDA-core kernel's speed from its shared-memory loads per FFMA, and check the count
#   in the machine code, the timings and the profile.
#
# **Prerequisites:** notebook 08 (the forward this stage extends); notebook 03 (FFMAs and
# shared-memory wavefronts per clock); notebook 02's online softmax (m and l).
#
# **Time:** about 25 min to read, 40 min to work through.

# %%
# %matplotlib inline
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import backward
from flashlab import notebook as nb
from flashlab import tiling
from flashlab.configs import teaching
nb.banner("14_backward")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · The gradients of attention
#
# Per (batch, head), with N queries and keys of head dim D:
#
# $$S = \text{scale}\cdot QK^\top,\qquad P = \text{softmax}(S)\ \text{by rows},\qquad O = PV.$$
#
# Given dO, the chain rule walks the three lines backwards:
#
# * O = PV is linear in V and in P: **dV = Pᵀ dO** and **dP = dO Vᵀ**.
# * The softmax acts on each row alone. For a row p = softmax(s), ∂p_j / ∂s_k = p_j (δ_jk − p_k),
#   so
#
# $$dS_{ik} = \sum_j dP_{ij}\,P_{ij}\,(\delta_{jk} - P_{ik}) = P_{ik}\,(dP_{ik} - \Delta_i),
# \qquad \Delta_i = \sum_j P_{ij}\,dP_{ij}.$$
#
# **dS = P ∘ (dP − Δ)**: each row's N × N Jacobian collapses into one number, Δ_i.
#
# * Δ needs no P: Σ_j P_ij dP_ij = Σ_j P_ij Σ_d dO_id V_jd = Σ_d dO_id (Σ_j P_ij V_jd) =
#   Σ_d dO_id O_id. So **Δ_i = rowsum(dO_i ∘ O_i)**: D multiply-adds a row, from O and dO, before
#   the main pass.
# * S = scale · Q Kᵀ: **dQ = scale · dS K** and **dK = scale · dSᵀ Q**.
#
# Five products of N × N × D multiply-adds (S again, dP, dV, dK, dQ) and two elementwise steps.
# The three identities, in float64 on random inputs:

# %%
backward.identities()

# %% [markdown]
# ## 2 · The log-sum-exp: P from one number a row
#
# The forward's online softmax ends each row with its running maximum m_i and its sum
# l_i = Σ_j exp(S_ij − m_i), and P_ij = exp(S_ij − m_i) / l_i. The division fits in the exponent:
#
# $$P_{ij} = \exp(S_{ij} - L_i),\qquad L_i = m_i + \log l_i = \log \sum_j e^{S_{ij}}.$$
#
# With L_i saved, any block of P is one exponential per element, exact, from that block's Q and K
# alone: no pass for the row's maximum or sum. It costs 4 bytes a row. Stage 08's kernel keeps m
# in log2 units, so the forward writes (m + log₂ l) · ln 2, parking m in shared memory when the
# loop ends (kept in registers, it would push the D = 128 kernels past 255):

# %%
nb.show_lines("14_backward", r"// The log-sum-exp of each row", r"Ls\[8 \* h \+ g\] = m\[h\];")

# %% [markdown]
# Once the quad has summed l, each row's first lane adds log₂ l; after O, each warp stores its rows.
# `WITH_LSE`, a template argument, compiles the kernel with and without these lines; inference
# runs the one without, stage 08's kernel unchanged:

# %%
nb.show_lines("14_backward", r"Ls\[16 \* w \+ 8 \* hh \+ g\] \+= __log2f")
nb.show_lines("14_backward", r"^  if \(WITH_LSE\) \{", r"^  \}$")

# %% [markdown]
# A forward for inference does not ask for L: `LSE` is a null pointer, and these branches are
# skipped.
#
# ## 3 · Algorithm 2: a thread block per key block

# %%
backward.algorithm_figure(tiles=8, j=2, i=5, causal=True)

# %% [markdown]
# The backward makes two kinds of sums: dK_j and dV_j over a column's blocks (query blocks i),
# dQ_i over a row's (key blocks j). One kind must be shared between thread blocks.
# FlashAttention-2 puts the **key blocks outer**: a thread block owns key block j, keeps K_j and
# V_j in shared memory and dK_j and dV_j in registers for its whole walk down the column, and
# writes them once. At each step it loads Q_i, dO_i, L_i and Δ_i, recomputes S, P, dP
# and dS for one 32 × 32 block, and adds dS K_j into dQ_i, which every key block that sees row
# block i adds to as well. Those adds go with atomics to an fp32 buffer of B·H·N·D floats; a third
# kernel scales the sum and converts it to fp16 or bf16.
#
# Queries outer would share dK and dV instead: two tensors of atomics, not one. Floating-point
# addition is not associative and atomics land in whatever order the blocks run, so **dQ differs
# in its last bits from run to run**. Training tolerates that; a bit-reproducible backward needs a
# fixed order of adds, a deterministic mode (a later stage). Under the causal mask, key block j sees only query rows from its own first key on: the blocks
# above the diagonal are skipped, those on it computed in full and masked.
#
# One step, a block pair, at D = 64:

# %%
backward.steps(D=64)

# %% [markdown]
# ## 4 · Algorithm 2 in PyTorch, on the CPU
#
# `flashlab.reference.blocked_backward` runs Algorithm 2 block by block in PyTorch: Δ first, then
# for each key block each query block in turn, P recomputed from the log-sum-exp, dQ summed in fp32
# across key blocks. Against float64 autograd (`reference_backward`), with the kernel's 32 × 32
# blocks and N = 200, which neither divides:

# %%
backward.demo(N=200, D=64)

# %% [markdown]
# Algorithm 2 is exact to rounding, and in fp16 and bf16 closer to float64 than PyTorch's own
# backward through the materialised P, which rounds each product's result to 16 bits. A stage's
# backward passes its check when each gradient is within twice that autograd error.
#
# ## 5 · The kernel
#
# Three kernels run one after another. The first takes Δ, one warp a row, and zeroes the row's fp32
# dQ sum on the way:

# %%
nb.show_source("14_backward", "bwd_preprocess_kernel")

# %% [markdown]
# The second is Algorithm 2. A block of 256 threads keeps Q_i, dO_i, K_j and V_j in shared memory
# as fp32, rows D + 1 floats apart, and the current P and dS. Thread t takes row (or key)
# r = t / 8 and columns c + 8k, c = t % 8. K_j and V_j are loaded once; then the walk:

# %%
nb.show_lines("14_backward", r"// Causal: query rows before k0", r"^    __syncthreads\(\);$")

# %% [markdown]
# Each thread takes four scores and four dP values, dot products of length D from shared memory,
# and turns them into P and dS:

# %%
nb.show_lines("14_backward", r"// P_ij = exp\(scale q_r", r"^    __syncthreads\(\);$")

# %% [markdown]
# Then the three sums from P and dS in shared memory: key r's dV and dK, and row r's dQ, added
# into the fp32 buffer by `atomicAdd`:

# %%
nb.show_lines("14_backward", r"// dV_j \+= P\^T dO and dK_j", r"^  \}$")

# %% [markdown]
# Last, dK and dV are written once (dK with the scale), and the third kernel converts dQ:

# %%
nb.show_lines("14_backward", r"// dK carries the scale", r"^\}$")
nb.show_source("14_backward", "bwd_dq_kernel")

# %% [markdown]
# ## 6 · FLOPs, as FlashAttention counts them
#
# The forward does two products, S = QKᵀ and O = PV, 2·N²·D FLOPs each per head: 4·B·H·N²·D in
# all. The backward does five (S again, dP, dV, dK, dQ), so FlashAttention counts it as
# **10·B·H·N²·D FLOPs, 2.5 times the forward's**, half that under the causal mask
# (`configs.flops(..., pass_="backward")`). Every backward TFLOP/s here, SDPA's included, is that
# count over the time; exponentials, Δ and elementwise steps are not counted. bwd_kernel does
# exactly the five products, and under the mask computes the diagonal's blocks in full:

# %%
cfg = teaching("fp16")  # B = 4, H = 16, N = 1024, D = 64
pd.DataFrame({f"causal={c}": backward.flop_count(cfg.B, cfg.H, cfg.N, cfg.D, c)
              for c in (False, True)})

# %% [markdown]
# So bwd_kernel's TFLOP/s are FlashAttention's: the same count without the mask, 3 % more work
# than counted under it at N = 1024.
#
# ## 7 · What bounds the backward
#
# ### Prediction
#
# Notebook 03's model of a CUDA-core kernel. In the loop over d a thread loads q and dO (each
# feeding 4 FFMAs) and 4 values of K and 4 of V: 10 loads for 8 FFMAs. In the loop over query rows
# it loads 3 + 3·D/8 values for 3·D/8 FFMAs. A warp's 32 lanes ask for at most 8 distinct 4-byte
# words, which rows D + 1 floats apart put in different banks: each load is one wavefront. An SM
# retires 4 FFMA warp-instructions a clock (128 lanes) but serves one wavefront: at about one load
# per FFMA, **shared memory binds near a quarter of the FFMA peak**. Per warp and block pair,
# counted from the kernel's indexing with notebook 03's bank model:

# %%
pd.concat({D: backward.loop_model(D) for D in (64, 128)}, names=["D"]).round(3)

# %% [markdown]
# The stores (Q_i, dO_i, P, dS) add 4–6 % to the wavefronts. Clocks per block pair from each
# limit, and the bound: FlashAttention's TFLOP/s are twice bwd_kernel's multiply-adds a second, so
# the bound is a share of the fp32 FMA ceiling notebook 00 measured (`matmul_fp32_tflops`), and of
# the boost clock's, the higher number:

# %%
pred = pd.DataFrame({D: backward.predict(here.sms, here.cc, here.roof.get("matmul_fp32_tflops"), D)
                     for D in (64, 128)})
side = backward.side_passes(cfg.B, cfg.H, cfg.N, cfg.D, here.roof.get("copy_tbps", 3.0))
print(f"Δ and the dQ conversion: {side['bytes'] / 1e6:.0f} MB, "
      f"{side['µs at the copy bandwidth']:.0f} µs at the copy bandwidth (teaching config)")
pred

# %% [markdown]
# Shared memory needs twice the clocks of issue and five times the FFMA pipe's: bwd_kernel can
# reach **about a fifth of the FFMA peak** at both head dims. Δ and the dQ conversion take tens of
# microseconds against bwd_kernel's milliseconds: the backward's time is bwd_kernel's.
#
# **Against SDPA.** SDPA's flash backward is FlashAttention-2's, on the tensor cores. Its forward
# was recorded in earlier notebooks; its backward loads more per FLOP (Q, dO, L and Δ at every
# step) and adds dQ with atomics too: take its speed between half its forward's and all of it.
# **The log-sum-exp** adds 4 bytes a row to O's 2·D, far below a timing's noise (notebook 08:
# about 2 %). Predicted: no measurable cost.

# %%
lo, hi = pred.loc[["TFLOP/s at the measured FMA ceiling", "TFLOP/s at the boost clock"], 64]
lo = hi if pd.isna(lo) else lo  # no FMA ceiling recorded for this GPU: the clock's bound alone
print(f"bwd_kernel, D = 64: {lo:.1f} - {hi:.1f} TFLOP/s predicted")
with nb.unless_missing():
    fwd = nb.compare("fp16").set_index("stage")
    for need in ("sdpa_flash", "14_backward"):
        if need not in fwd.index:
            raise nb.not_recorded(need, " at the fp16 teaching config")
    flash = fwd.at["sdpa_flash", "tflops"]
    print(f"sdpa_flash's forward: {flash:.0f} TFLOP/s (recorded) -> stage 14's backward / "
          f"sdpa_flash's backward predicted {lo / flash:.3f} - {hi / (flash / 2):.3f}")
    lse = backward.lse_cost(cfg.B, cfg.H, cfg.N, cfg.D, here.roof.get("copy_tbps", 3.0),
                            forward_ms=fwd.at["14_backward", "median_ms"])
    print(f"the log-sum-exp: {lse['lse bytes'] / 1024:.0f} KiB, at most "
          f"{lse['share of the forward']:.2%} of the forward's time")

# %% [markdown]
# **The profile** should show shared memory busy on nearly every clock, the tensor pipe idle, and
# the stalls of a full shared-memory pipe leading: `mio_throttle` (the queue to it full), then
# `short_scoreboard` (a load's data not yet back).
#
# ## 8 · The machine code
#
# No GPU needed. bwd_kernel beside the forward, fp16:

# %%
with nb.unless_missing():
    mix = nb.instructions("14_backward")
    mix = mix[mix.index.get_level_values("kernel").str.contains("__half")]
    display(mix[["HMMA", "LDSM", "LDGSTS", "LDS", "STS", "FFMA", "MUFU.EX2", "RED", "BAR", "total"]])

# %% [markdown]
# The forward's `HMMA` and `LDSM` are absent from bwd_kernel: `FFMA` and `LDS` do its products.
# Its two innermost loops, as the compiler unrolled them:

# %%
with nb.unless_missing():
    display(pd.concat([backward.sass_loops(D) for D in (64, 128)], keys=[64, 128], names=["D"]))

# %% [markdown]
# The loads per FFMA are the model's, exactly: 1.25 in the loop over d (4 steps a trip), 1.125 and
# 1.0625 in the loop over query rows at D = 64 and 128. The dQ sums: an `atomicAdd` whose old value
# is unused compiles to a reduction, `REDG`, which the L2 performs without answering, D / 8 a
# thread per block pair:

# %%
with nb.unless_missing():
    print("\n".join(nb.sass_lines("14_backward", r"^REDG?\b", kernel=r"bwd_kernel<__half, 64>")))

# %% [markdown]
# ## 9 · Measure
#
# On a GPU: build, check dQ, dK and dV against float64 (fp16 and bf16, ragged N, both masks),
# then time the backward in turn with SDPA's flash and cuDNN backwards, and the forward with and
# without the log-sum-exp. Otherwise: the recorded rows.

# %%
ev = None
with nb.unless_missing():
    ev = nb.evaluate_backward("14_backward")
    print(ev)

# %%
with nb.unless_missing():
    bwd = None if ev is None else ev.rows[ev.rows["pass"] == "backward"]
    if bwd is None or not (bwd["stage"] == "14_backward").any():
        raise nb.not_recorded("14_backward", " backward timings")
    table = bwd.pivot_table(index=["dtype", "D", "causal", "N"], columns="stage", values="tflops")
    table["predicted, 14_backward"] = [f"{pred.at['TFLOP/s at the measured FMA ceiling', d]:.1f}"
                                       f" - {pred.at['TFLOP/s at the boost clock', d]:.1f}"
                                       for d in table.index.get_level_values("D")]
    display(table.round(2))
    for causal in (False, True):  # its speed over theirs, timed in turn
        print(f"14_backward's backward, fp16{', causal' if causal else ''}: "
              f"{ev.versus(('sdpa_flash', 'sdpa_cudnn'), 'fp16', causal)}")
    f, f_lse = ev.lse_cost(dtype="fp16")
    print(f"forward {f:.4f} ms, with the log-sum-exp {f_lse:.4f} ms: {f_lse / f - 1:+.1%}")

# %% [markdown]
# ### Discussion
#
# **Speed.** The model gave bwd_kernel about a fifth of the FFMA peak; the cell above prints
# 12.4 TFLOP/s on the H200 at the fp16 teaching config (D = 64; 10.3 causal, where the diagonal
# blocks compute masked elements), inside the predicted 10.4–13.7: above the bound at the measured
# FMA ceiling, below the one at the boost clock. Section 10's profile checks
# that the unit that binds is the one the count named.
#
# **Against SDPA.** Stage 14's backward runs at 0.063 of FlashAttention-2's speed (0.085 causal)
# and 0.040 of cuDNN's (0.055 causal), inside the predicted 0.04–0.11. The wide gap is expected:
# each multiply-add here costs a 4-byte load from shared memory, while one `mma.sync` does
# 16 × 8 × 16 multiply-adds from registers.
#
# **The log-sum-exp.** Without it the forward took 0.0604 ms, with it 0.0605 ms (+0.3 %): within
# the noise, as predicted.
#
# ## 10 · The profile
#
# Nsight Compute on bwd_kernel (`14_backward.backward`) beside the stage's forward, fp16 teaching
# config; the share of SM clocks shared memory was busy (at the boost clock: a lower bound), and
# the wavefronts the model counts for the launch:

# %%
with nb.unless_missing():
    p = nb.profile("14_backward", pass_="backward")
    display(p.loc[[m for m in ("duration_ms", "smem_wavefronts", "smem_load_bank_conflicts",
                               "tensor_pipe_pct", "achieved_occupancy_pct", "stall_short_scoreboard",
                               "stall_mio_throttle", "stall_barrier", "stall_long_scoreboard",
                               "stall_wait") if m in p.index]])
    mine = p["14_backward.backward"]  # bwd_kernel; the column "14_backward" is the forward
    modelled = backward.launch_wavefronts(cfg.B, cfg.H, cfg.N, cfg.D, cfg.causal)
    busy = tiling.busy_share(mine["smem_wavefronts"], mine["duration_ms"], here.sms)
    print(f"shared-memory wavefronts: {mine['smem_wavefronts']:.4g} measured, {modelled:.4g} "
          f"modelled; shared memory busy on {busy:.0%} of the clocks")

# %% [markdown]
# ### Discussion
#
# The measured wavefronts are 1.02 times the modelled ones: the count of section 7 is the traffic
# the kernel makes, and its loads are nearly free of bank conflicts (5.2 million of 836 million
# wavefronts). Shared memory was busy on 93 % of the clocks, the tensor pipe on 0.15 % (the
# forward: 50 %): the products run where the model put them, and the unit it named is the one
# that is full. The warps wait most on `mio_throttle` (37 %: the shared-memory queue is full),
# then on `short_scoreboard` (22 %: a load's value not back yet), as predicted.
#
# ## 11 · Training through it
#
# A stage is a model's attention in training too (`flashlab.model.register`): a byte-level GPT-2
# trained from five seeds through SDPA's fused backends and the stages (`tools/train_compare.py`).
# Right implementations round differently and training amplifies it. A stage's gap at a seed is
# its largest difference from each of SDPA's curves, averaged; it passes when the median over
# seeds is at most SDPA's largest gap with itself. A negative control leaves Δ out of dS:

# %%
with nb.unless_missing():
    from flashlab import plots
    display(plots.training())

# %%
with nb.unless_missing():
    from flashlab import tables
    match = tables.training_match().set_index("impl")
    display(match)
    mine = match.loc["14_backward"]
    print(f"14_backward: median gap {mine.distance:.2e} over {mine.seeds} seeds; SDPA's own curves "
          f"up to {mine.noise:.2e} apart: {'within' if mine.within else 'outside'} SDPA's spread")
    sdpa = match.loc[[i for i in match.index if i.startswith("sdpa_")], "per_seed"]
    print(f"the control's median gap: {match.distance.max() / mine.noise:.0f} times SDPA's spread; "
          f"seed by seed, stage 14 {mine.per_seed:.2f}, SDPA's backends "
          f"{sdpa.min():.2f}-{sdpa.max():.2f}")
    display(tables.training_step_times())

# %% [markdown]
# ### Discussion
#
# Every stage lies within SDPA's spread; the control's gap is many times it (the line above says
# how many: dQ and dK gain a term in P ∘ Δ). Seed by seed (per_seed: a gap over SDPA's own
# largest at that seed), stage 14 reads under 1, as SDPA's backends do.
#
# ## 12 · What is next
#
# The five products are matrix products: the next stage moves them onto `mma.sync` and
# `ldmatrix`, as stages 05–08 did for the forward.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `14.dscores` (10 points)
#
# **Where:** in `bwd_kernel` (`kernels/14_backward.cu`), inside the loop over a thread's four keys
# that follows the dot products `s[kk]` (the score, unscaled) and `dp[kk]`: between
# `// BEGIN EXERCISE 14.dscores` and `// END EXERCISE 14.dscores`. The stub leaves P and dS at
# zero, so every gradient is wrong: dV through P, dK and dQ through dS.
#
# **What to write:** for key c + 8 kk of row r, P by section 2's identity from the score, the
# scale and the row's log-sum-exp, in the log2 units `Ls` holds it in (`exp2_approx`), and exactly
# 0 where `seen` says the pair does not count (past N, or masked); then P, and dS by section 1,
# into the block's `Ps` and `dSs` at row r and that key's column.
#
# **How it is judged.** `flashlab grade` builds stage 14 from your region, checks its forward and
# log-sum-exp, then dQ, dK and dV against float64 autograd: N = 1, 17, 1000 and 4096, D = 64 and
# 128, both masks, fp16 and bf16, and a model's strided layout, each gradient filled with NaN
# first. Each must be within twice the error of PyTorch's own backward in the same dtype (section
# 4). A wrong kernel scores 0; the message names the first failing gradient and case. A right one
# is timed in its backward: when your instructor grades, in turn with the solution's on the same
# GPU, full points within 5 % of its speed; checking your own work, only rightness counts.
#
# **GPU:** compute capability 8.0 or newer; without one, `flashlab grade` skips it with one line
# saying why. Run it with
#
#     flashlab grade --exercise 14.dscores

# %% [markdown]
# ## Questions for discussion
#
# 1. dQ is added up with fp32 atomics in no fixed order. What would a deterministic backward
#    need, and what would it cost?
# 2. The forward could save P itself, or m and l, instead of L. What would each cost at N = 16k?
#    And recomputing S is one of the backward's five products: is that a waste?
# 3. Shared memory holds bwd_kernel to a fifth of the FFMA peak. Without tensor cores, how could a
#    CUDA-core backward do more FFMAs per wavefront, and how far could that go?

# %% [markdown]
# **Instructor's answer.** *1.* A fixed order of the adds into each dQ_i. Either each key block
# writes its own fp32 partial and a later pass sums them in order of j (N / 32 partials a row: at
# N = 1024, 32 times dQ's fp32 size in traffic), or a row's key blocks take turns in order of j,
# each waiting on a counter: no memory, but blocks stall. Both are slower than atomics, which is
# why deterministic modes are optional.

# %% [markdown]
# **Instructor's answer.** *2.* P is N² values per head: at N = 16k, 512 MiB in fp16 for one head,
# written and read back. m and l are 8 bytes a row and a division per element of P; L is 4 bytes
# and one subtraction in the exponent. Recomputing S is a fifth of the backward's FLOPs, yet
# cheaper than reading 2·N² bytes a head back from HBM.

# %% [markdown]
# **Instructor's answer.** *3.* Register tiles, as in notebook 03: a thread computing a 4 × 4 block
# of S (or dP) loads 4 values of Q and 4 of K a step for 16 FFMAs, 0.5 loads per FFMA; an 8 × 8
# block, 0.25, where the FFMA pipe binds, at 64 accumulators per product and thread. That buys at
# most the step from a fifth of the fp32 FMA ceiling to all of it, which is itself an order of
# magnitude below the tensor cores' fp16 ceiling (notebook 00).

# %% [markdown]
# ## Summary
#
# - dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − Δ), dQ = scale · dS K, dK = scale · dSᵀ Q; the
#   softmax's Jacobian reduces to Δ_i = rowsum(dO_i ∘ O_i), D multiply-adds a row.
# - The forward saves L_i = m_i + log l_i, 4 bytes a row; P_ij = exp(S_ij − L_i) recomputes any
#   block exactly, so P is never stored. Saving L cost the forward nothing measurable.
# - Algorithm 2 puts the key blocks outer: dK_j and dV_j stay on chip; dQ is summed across key
#   blocks with fp32 atomics and converted by a third pass, its last bits varying run to run.
# - FlashAttention counts the backward as 10·B·H·N²·D FLOPs, 2.5 times the forward; bwd_kernel
#   does exactly those five products.
# - On the CUDA cores each FFMA needs about one shared-memory wavefront: a fifth of the FMA peak,
#   12.4 TFLOP/s on the H200, 0.063 of SDPA's flash backward.

# %%
nb.reached("14_backward")  # its backward, beside the stage before it and SDPA's
