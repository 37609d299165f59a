# %% [markdown]
# # Stage 15 — The backward on tensor cores
#
# Stage 14 ran FlashAttention-2's backward on the CUDA cores and was held by shared memory: about
# one wavefront for every fused multiply-add. This stage keeps its algorithm, its three kernels
# and its loop order, and changes one thing: the five products run on `mma.sync`, their operands
# read by `ldmatrix` from swizzled 16-bit tiles that `cp.async` double-buffers, as stages 05–08
# did for the forward.
#
# ## Objectives
# After this notebook you can:
# - write each product of the backward as a warp's `mma.sync` tiles, and say for each operand
#   whether it comes from registers, `ldmatrix` or `ldmatrix.trans`, and why;
# - reuse an accumulator as the next product's A fragment when the product needs the transpose a
#   warp already holds (Pᵀ, dSᵀ), and route the one that needs the other orientation (dS for dQ)
#   through shared memory;
# - count a tensor-core kernel's shared-memory wavefronts and mma instructions per tile, predict
#   which of the two binds, and check the count against a profile;
# - explain why the fp32 atomics that add dQ up cost a third of the time, and how a wider
#   reduction recovers it.
#
# **Prerequisites:** notebook 14 (the algorithm); 05 (`mma.sync` fragments, P re-packed as an A
# fragment), 06 (the swizzle), 07 (`cp.async`).
#
# **Time:** about 18 min to read, 40 min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import backward_mma, tables
from flashlab import notebook as nb
nb.banner("15_backward_mma")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
print(here)

# %% [markdown]
# ## 1 · The idea: the products are matrix products
#
# Every product of the backward is a matrix product of tiles: S = Q Kᵀ, dP = dO Vᵀ, dV += Pᵀ dO,
# dK += dSᵀ Q and dQ += dS K. Stage 14 gave each thread a few dot products from shared memory;
# here each warp gives them to the tensor cores, 16 × 8 × 16 at a time.
#
# What makes the backward harder than the forward is orientation. A block owns 64 keys, split
# among its 4 warps, 16 keys each. A warp's two on-chip accumulators, dK and dV, are rows of *its
# keys*. To feed them without moving data between warps, the warp computes the transposed scores
# Sᵀ = K_w Q_iᵀ: rows are its keys, columns the block's queries. Pᵀ and dSᵀ then come out of the
# accumulators already in the orientation that dV += Pᵀ dO and dK += dSᵀ Q take as their A
# operand: notebook 05's trick of re-packing P into an A fragment, applied twice.
#
# dQ is the one product that wants the other orientation: a row of dQ sums over *every* key of the
# block, and those keys are spread over four warps. So the warps write dSᵀ to shared memory, wait
# at a barrier, and each warp then takes 16 query rows against all 64 keys.

# %%
display(backward_mma.figure())

# %%
backward_mma.products(D=64)

# %% [markdown]
# The B operands need `ldmatrix.trans` where the reduced dimension runs down the stored rows: dV +=
# Pᵀ dO reduces over queries, and dO is stored a query per row, so its 8 × 8 pieces must arrive
# transposed, as V did in the forward's P V. The dQ product needs `.trans` on both sides: dS is
# stored as dSᵀ, K_j a key per row.
#
# ## 2 · What changed
#
# The forward and the two small kernels (Δ and the dQ conversion) are stage 14's. The block
# kernel is rewritten:

# %%
nb.show_diff("14_backward", "15_backward_mma", context=1)

# %% [markdown]
# ## 3 · The kernel, in parts
#
# The tiles stay 16-bit and swizzled; K_j and V_j are copied once, Q_i and dO_i for the next query
# block start copying before the current one is computed (two buffers, stage 07's pipeline):

# %%
nb.show_lines("15_backward_mma", r"// K_j and V_j once;", r"^    __syncthreads\(\);  // block i's tiles")

# %% [markdown]
# Sᵀ and dPᵀ share one loop: the A fragments of K_w and V_w come from one address, the B
# fragments of Q_i and dO_i from another, four `mma.sync` per pair of `ldmatrix.x4`:

# %%
nb.show_lines("15_backward_mma", r"// S\^T = K_w Q_i\^T and dP\^T", r"^    \}$")

# %% [markdown]
# P and dS are computed in place, element by element of the accumulators (stage 14's formula,
# its masks only on the blocks that cross N or the diagonal). Then two accumulator tiles make one
# A fragment, and dO_i and Q_i arrive by `ldmatrix.trans`:

# %%
nb.show_lines("15_backward_mma", r"// dV_w \+= P\^T dO_i and dK_w", r"// dS\^T complete")

# %% [markdown]
# ## 4 · dQ, and its atomics
#
# After the barrier, warp w reads the A fragments of dS for its 16 query rows from the dSᵀ tile,
# and K_j by `.trans`. Its 16 × D fp32 sums are then added into the scratch that every key block
# of the head adds to: one atomic add per element per key block, N²·D / 64 of them per head.

# %%
nb.show_source("15_backward_mma", "add_pair")

# %% [markdown]
# On the H100 and H200 (`sm_90`), a 64-bit atomic adds two adjacent floats in one `RED`
# instruction; on the A100 the adds stay 32-bit. The machine code of the backward's kernels:

# %%
with nb.unless_missing():
    mix = nb.instructions("15_backward_mma")
    display(mix)

# %% [markdown]
# ## 5 · Prediction
#
# Count, per warp and query block, what the loops of section 3 issue. Each `ldmatrix.x4` moves 512
# bytes, four 128-byte wavefronts (the swizzle leaves no conflicts); each `mma.sync.m16n8k16` does
# 4 096 FLOPs.

# %%
display(backward_mma.counts(D=64))
display(backward_mma.counts(D=128))

# %% [markdown]
# Stage 14 did about 2 FLOPs per wavefront; here it is about 1 460, seven hundred times more. An SM
# serves one wavefront a clock. If mma.sync retires an m16n8k16 every two clocks per SM (2 048
# FLOPs a clock, the A100's tensor rate; Hopper's full rate needs `wgmma`, notebook 09), then
# shared memory still binds, but barely:

# %%
bound = backward_mma.predict(sms=here.sms, D=64)
print(bound)

# %% [markdown]
# **Prediction.** Shared memory binds again, at about 380 TFLOP/s on 132 SMs, with the tensor pipe
# at most 71 % busy. A block holds 4 warps and about 240 registers a thread, so an SM runs two
# blocks, 8 warps: too few to hide every `ldmatrix` and barrier. We expect half of the bound,
# 150–250 TFLOP/s, ten to twenty times stage 14, near SDPA's flash backward (FlashAttention-2).

# %% [markdown]
# ## 6 · Measure

# %%
with nb.unless_missing():
    ev = nb.evaluate_backward("15_backward_mma")
    print(ev)

# %%
with nb.unless_missing():
    if ev.rows.empty:
        raise nb.not_recorded("15_backward_mma", " backward timings")
    for causal in (False, True):  # its speed over theirs, timed in turn
        mine = ev.rows[(ev.rows["stage"] == "15_backward_mma") & (ev.rows["pass"] == "backward")
                       & (ev.rows["dtype"] == "fp16") & (ev.rows["causal"] == causal)]
        print(f"{'causal' if causal else 'full  '}: {mine['tflops'].iloc[-1]:6.1f} TFLOP/s, "
              + ev.versus(("sdpa_flash", "sdpa_cudnn", "14_backward"), "fp16", causal))

# %% [markdown]
# ### Discussion
#
# On the H200 the backward ran at 170 TFLOP/s at this config (fp16, B = 4, H = 16, N = 1024,
# D = 64), 12–14 times stage 14: inside the predicted range at its low end. The causal case, at
# 124, fell below it: a causal key block walks fewer query blocks, so its fixed costs (loading
# K_j and V_j, writing dK and dV) weigh more, and the diagonal blocks do masked work that is not
# counted. At this size a launch has 1 024 blocks for 264 places (132 SMs × 2), four waves with
# a ragged last one. Timed beside SDPA over larger problems (N = 1k to 16k, both head dims,
# fp16), it reached 190–224 TFLOP/s without the mask and 159–223 with it: 0.72–1.03 times SDPA's
# flash backward, level with it only on the short causal problems and 22–28 % behind at 16k, and
# 0.38–0.63 times cuDNN's.
#
# With one 32-bit atomic per float instead of section 4's pairs, the same kernel ran at 118–156
# TFLOP/s on those problems: the atomics, not the products, were the largest cost once the
# tensor cores came in. A 128-bit reduction (lanes trade halves with a shuffle first, so that
# each holds four adjacent floats) measured 3–7 % slower than the 64-bit one: the shuffles cost
# more than the fewer reductions saved. Fewer atomics need larger key blocks (each dQ element is
# added once per key block), which need more registers or more warps per block.

# %% [markdown]
# ## 7 · The profile

# %%
with nb.unless_missing():
    p = nb.profile("15_backward_mma", pass_="backward")
    display(p.loc[[m for m in ("duration_ms", "smem_wavefronts", "smem_load_bank_conflicts",
                               "smem_store_bank_conflicts", "tensor_pipe_pct",
                               "achieved_occupancy_pct", "stall_barrier", "stall_long_scoreboard",
                               "stall_short_scoreboard", "stall_mio_throttle", "stall_wait",
                               "stall_math_pipe_throttle") if m in p.index]])
    mine = p["15_backward_mma.backward"]  # bwd_kernel; the column "15_backward_mma" is the forward
    cfg = fl.Config(4, 16, 1024, 64, False, "fp16")
    modelled = backward_mma.launch_wavefronts(cfg.B, cfg.H, cfg.N, cfg.D, cfg.causal)
    print(f"shared-memory wavefronts: {mine['smem_wavefronts']:.4g} measured, {modelled:.4g} "
          f"modelled (loads and stores, not the cp.async copies)")

# %% [markdown]
# ### Discussion
#
# The wavefronts measured are 0.96 of those counted in section 5: the count is the traffic. But
# shared memory is not what binds: the warps wait on `mio_throttle` (a full shared-memory queue)
# 2 % of the time, against stage 14's 37 %. The tensor pipe is busy 32 % of the time, and the SM's
# warp slots are 12 % full: 8 warps of 64, the two blocks per SM that 240 registers a thread allow.
# The stalls name latency instead: `wait` (26 %, an instruction's fixed latency, here one `mma`
# feeding the next), `short_scoreboard` (20 %, an `ldmatrix` not back yet), `long_scoreboard`
# (14 %, global memory, where the atomics and the row statistics go) and the two barriers per
# query block (7 %). With so few warps, each such wait leaves the SM idle.
#
# That is where the rest of the speed is: more independent work per warp between barriers (32 keys
# a warp, so that each B fragment feeds two `mma`: stage 17), fewer atomics (larger key blocks), and on
# Hopper, `wgmma`, which reads its operands from shared memory itself and runs asynchronously.

# %% [markdown]
# ## 8 · What is next
#
# The next stages take the backward onto Hopper's instructions, as 09–13 took the forward:
# `wgmma` reading K, V, Q and dO from shared memory through descriptors, the TMA bringing the tiles
# in on an mbarrier ring, and dQ reduced by the TMA into fp32 without per-element atomics.

# %% [markdown]
# ## Exercises
#
# ### Kernel exercise `15.dq_operands` (10 points)
#
# **Where:** in `bwd_kernel` (`kernels/15_backward_mma.cu`), after the barrier that completes the
# dSᵀ tile: between `// BEGIN EXERCISE 15.dq_operands` and `// END EXERCISE 15.dq_operands`. The
# stub reads every fragment from the tile's first rows, so dQ is wrong while dK and dV stay right.
#
# **What to write:** the two operands of dQ_i += dS K_j, both read with `ldmatrix.x4.trans`. For
# each k-step kk (keys 16 kk..), `da[kk]` is the A fragment of dS at this warp's 16 query rows,
# read from the dSᵀ tile (a key per row, `swz<BR>(key, query)`). `krow` and `kcol` are the row
# and column of a 16 × 16 block of K_j whose address this lane gives, so that the four matrices
# come out as the B fragments of two n-tiles, in the order the `mma_m16n8k16` calls below take
# them. Work out which 8 × 8 matrix each group of 8 lanes addresses from notebook 05's fragment
# layouts, and what `.trans` does to each.
#
# **How it is judged.** `flashlab grade` builds stage 15 from your region, checks its forward and
# log-sum-exp, then dQ, dK and dV against float64 autograd: N = 1, 17, 1000 and 4096, D = 64 and
# 128, both masks, fp16 and bf16, and a model's strided layout, each gradient filled with NaN
# first. Each must be within twice the error of PyTorch's own backward in the same dtype. A wrong
# kernel scores 0; the message names the first failing gradient and case. A right one is timed in
# its backward: when your instructor grades, in turn with the solution's on the same GPU, full
# points within 5 % of its speed; checking your own work, only rightness counts.
#
# **GPU:** compute capability 8.0 or newer; without one, `flashlab grade` skips it with one line
# saying why. Run it with
#
#     flashlab grade --exercise 15.dq_operands

# %% [markdown]
# ## Questions for discussion
#
# 1. Why does each warp own keys rather than queries? What would change if warp w owned 16 query
#    rows and the block walked over key blocks instead?
# 2. Section 5 counts 64 LDS per warp and query block for the log-sum-exps and Δs, one per
#    accumulator element. How could they be read with fewer instructions, and what would that buy
#    against the `ldmatrix` traffic?
# 3. dQ is added once per key block. With key blocks of 128 instead of 64, what halves, what
#    doubles, and what stops it fitting?

# %% [markdown]
# **Instructor's answer.** *1.* dK and dV are sums over queries for fixed keys; keeping them in
# registers needs a warp to own keys for the whole walk, and Pᵀ, dSᵀ then come out of its
# accumulators ready to be A operands. Owning queries would give the warp dQ in registers (the
# forward's orientation) but dK and dV would be sums across warps and blocks: atomics or a
# reduction on dK and dV instead of dQ, twice the traffic, since two gradients need it instead of
# one.

# %% [markdown]
# **Instructor's answer.** *2.* A lane's queries are 8n + 2t and 8n + 2t + 1 for each n-tile, so
# one 64-bit LDS brings both log-sum-exps (and one both Δs), and the values are the same for both
# accumulator rows: 16 LDS instead of 64 at D = 64. That saves about 48 of 448 wavefronts per warp
# and query block, 11 %, and the shared-memory bound rises by as much.

# %% [markdown]
# **Instructor's answer.** *3.* Halves: the dQ atomics (each element is added once per key block)
# and the Q_i and dO_i traffic per key. Doubles: the dK and dV accumulators if each warp keeps 16
# keys (8 warps, so the query block grows too, and with it the dSᵀ tile and the buffers: 128 KiB
# at D = 64, beyond what fits twice on an SM) or the registers if each warp takes 32 keys (dK and
# dV alone would need 2 D floats a lane: 256 at D = 128, more than a thread has).

# %% [markdown]
# ## Summary
#
# - The backward's five products run on `mma.sync`: each warp owns 16 keys and computes Sᵀ and
#   dPᵀ, so that Pᵀ and dSᵀ are already the A fragments of dV and dK, re-packed in registers.
# - Operands whose reduced dimension runs down the stored rows come by `ldmatrix.trans`: dO and Q
#   for dV and dK, and both operands of dQ.
# - dQ needs dS across the block's keys: it goes through shared memory once per query block, and
#   the fp32 sums are added with atomics, two floats per instruction on `sm_90`.
# - Shared memory moves about 1 460 FLOPs per wavefront instead of stage 14's 2; the bound is near
#   380 TFLOP/s, and the kernel reaches about half of it, held by latency with 8 warps an SM.

# %%
nb.reached("15_backward_mma")  # its backward, beside the stage before it and SDPA's
