# %% [markdown]
# # Ring attention — a stage on every GPU
#
# Every notebook so far ran attention on one GPU. A sequence of a million tokens is too much for
# one: at D = 128 and 16 heads, one layer's causal training step through attention is about 16
# PFLOP, some 28 s at the fastest stage's rate, and its q, k, v, O and their gradients take 34 GB
# a layer. The way out is to split the sequence across GPUs. Each GPU keeps
# its own slice of the queries, and the keys and values travel from GPU to GPU around a ring
# while every GPU computes attention against the block it holds. This is context parallelism
# (PyTorch's `context_parallel`, Megatron's and TransformerEngine's context parallelism,
# ring-flash-attention). It needs exactly two things from a kernel: its output and the
# log-sum-exp of each row, both of which the stages have written since the backward pass. This
# notebook builds the ring on `torch.distributed`, runs a flashlab stage as the attention each
# GPU computes, and asks when the ring's communication hides behind that attention.
#
# ## Objectives
# After this notebook you can:
# - merge two partial attention outputs over disjoint keys from their log-sum-exps, and say why
#   the backward needs only the merged O and log-sum-exp;
# - follow a ring step: compute against the block you hold while the next one arrives;
# - explain why a causal sequence split into contiguous slices leaves ranks idle, and how the
#   zig-zag split balances it;
# - predict from a step's FLOPs and bytes when the ring hides its communication, over NVLink and
#   across machines, and for how many GPUs;
# - read a ring's measured efficiency against that prediction, and say where the time went.
#
# **Prerequisites:** notebook 14 (the backward pass: log-sum-exp, Δ and the gradients), notebook
# 20 (the stage this ring runs on each GPU), notebook 00's FLOP count; `torch.distributed`'s
# process groups, at the level of its tutorial.
#
# **Time:** about 24 min to read, 45 min to work through.

# %%
# %matplotlib inline
import inspect
import math

import torch
from IPython.display import display

import flashlab as fl
from flashlab import ring, tables
from flashlab import ring_attention as ra
from flashlab.stages import last_backward

# %% [markdown]
# ## 1 · Splitting the sequence
#
# Take W GPUs, the ranks of a process group, and split the sequence of N tokens into W slices of
# n = N / W. Rank r holds the queries, keys and values of slice r. Its output rows need every key
# of the sequence, so the keys and values move: at step s, rank r holds the block of rank
# (r − s) mod W, computes its queries against it, and passes it on to rank r + 1 while receiving
# the next one from rank r − 1. After W steps every query has met every key, and no rank ever held
# more than its own block and two travelling ones. The left panel below shows the N × N score matrix this way: each square is
# one rank's queries against one rank's keys, labelled with the step that computes it. Each step is
# one diagonal, wrapping around.

# %%
ra.blocks(world=4)

# %% [markdown]
# The middle and right panels add the causal mask, and they are the subject of section 4: with a
# contiguous split, the ranks do not get equal shares of the scores.
#
# ## 2 · Merging partial outputs
#
# A step gives rank r its queries' attention over one block of keys only: an output o_s and a
# log-sum-exp lse_s = log Σ exp(scores) over that block. Two such results over disjoint sets of
# keys A and B combine exactly. The softmax over A ∪ B weighs each part by its share of the
# exponentials, and e^lse is that sum:
#
# $$\text{lse} = \log\left(e^{\text{lse}_A} + e^{\text{lse}_B}\right), \qquad
#   o = e^{\text{lse}_A - \text{lse}}\, o_A + e^{\text{lse}_B - \text{lse}}\, o_B .$$
#
# This is the online softmax of notebook 00 again, one block at a time. There, a tile's scores
# updated a running maximum and sum; here a whole kernel's result updates a running (o, lse). The
# merge runs in fp32 and against the larger lse, so that nothing overflows. A row that sees no key
# of a block (under the mask) has lse = −∞ there and weight 0. A check on the CPU in float64: the
# keys of one problem split in two halves, each half's attention computed alone, then merged:

# %%
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 96, 32, dtype=torch.float64) for _ in range(3))
exact = ring.reference_local().forward          # float64 attention: (o, lse)
scale = 32 ** -0.5
o_a, lse_a = exact(q, k[:, :, :40], v[:, :, :40], False, scale)   # keys 0-39
o_b, lse_b = exact(q, k[:, :, 40:], v[:, :, 40:], False, scale)   # keys 40-95
o_ab, lse_ab = ring.merge(o_a, lse_a, o_b, lse_b)
o_all, lse_all = exact(q, k, v, False, scale)
print(f"merged halves vs attention over all keys: o {(o_ab - o_all).abs().max():.1e}, "
      f"lse {(lse_ab - lse_all).abs().max():.1e}")

# %% [markdown]
# The backward needs nothing more. A block's share of the gradients is FlashAttention-2's
# backward (notebook 14) with P recomputed as exp(S − lse) from the **merged** lse, and
# Δ = rowsum(dO ∘ O) from the **merged** O. So each rank runs the ring a second time: it adds its
# queries' dQ, and the dK and dV of each block travel with that block, back to the rank that
# owns it after one last hop.
#
# ## 3 · The ring on torch.distributed
#
# `ring.ring_forward` is the loop of section 1, on `torch.distributed`'s point-to-point operations.
# At each step it starts the transfer of the block it holds (`dist.batch_isend_irecv`: a send to
# the next rank, a receive from the previous), runs the local attention on that block, merges,
# and only then waits for the next block:

# %%
print(inspect.getsource(ring.ring_forward))

# %% [markdown]
# With NCCL on GPUs the transfer runs on its own stream, so it overlaps the kernel. The local
# attention is a `ring.Local`: a flashlab stage (`ring.stage_local(attn)`: its forward with the
# log-sum-exp, its backward from stage 14 on), or the float64 reference. With the reference, the
# whole ring runs on CPUs with the `gloo` backend. `ring.check` starts W processes, gives each
# its shard of one random problem, runs the ring forward and backward, and compares every rank's
# o, lse, dQ, dK and dV with float64 attention on the whole sequence. Here with four ranks, the mask
# and a length that does not split evenly, and once with a local attention whose log-sum-exp is
# off by 0.5, which the check must catch:

# %%
good = ring.check(world=4, causal=True, shape=(1, 2, 45, 16))
bad = ring.check(world=2, causal=True, local="wrong_lse")
for name, res in (("reference", good), ("lse off by 0.5", bad)):
    worst = {g: max(r[g] for r in res.values()) for g in ("o", "lse", "dq", "dk", "dv")}
    print(f"{name:15}: " + ", ".join(f"{g} {e:.1e}" for g, e in worst.items()))

# %% [markdown]
# The wrong log-sum-exp leaves o right (each step's o is normalised on its own, and since every
# lse is off by the same 0.5, the merge's weights e^(lse_s − lse) do not change) but every
# gradient wrong: P recomputed from a wrong lse
# is off by e^0.5. The forward alone would not have caught it.
#
# On one GPU, `ring.simulate(local, q, k, v, do, world)` runs the same arithmetic in one process,
# every rank's steps in turn, with a stage as the local attention. On a Hopper GPU, the last
# backward stage (`last_backward()`, the fastest that is not a deterministic variant):

# %%
LOCAL = last_backward()  # the last stage with a backward pass that is not deterministic
if LOCAL.unavailable():
    print(f"not run here ({LOCAL.unavailable()}): the ring's measurements below are recorded")
else:
    local = ring.stage_local(LOCAL.build())
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.float16, generator=g)
                   for _ in range(4))
    got = ring.simulate(local, q, k, v, do, world=4, causal=True)
    o_ref, lse_ref = ring.reference_local().forward(q.double(), k.double(), v.double(), True,
                                                    128 ** -0.5)
    print(f"{LOCAL.slug} in a ring of 4, causal, N = 1000: o {(got[0].double() - o_ref).abs().max():.1e}, "
          f"lse {(got[1].double() - lse_ref).abs().max():.1e} (fp16 against float64)")

# %% [markdown]
# ## 4 · The mask and the zig-zag split
#
# Under the causal mask, query i sees keys 0 to i. With contiguous slices, rank 0's queries see
# only its own block, half of it, while the last rank's see every block. Back to section 1's
# figure: in the middle panel the last rank computes 44 % of all scores and rank 0 computes 6 %.
# The ranks pass their blocks on together, so every step lasts as long as its busiest rank's
# attention, and from step 1 on some rank has a whole block while others have none: the four
# ranks of the figure are busy 57 % of the ring's time, and more ranks do not make it better.
#
# The zig-zag split cuts the sequence into 2W chunks and gives rank r chunks r and 2W − 1 − r:
# one from the start, one from the end (right panel). Each rank then has as many scores as every
# other, not only in total but at every step. Against its own block it computes two
# quarter-blocks on the diagonal, each half masked, and one unmasked quarter-block. Against an
# earlier rank's block, both of its chunks see that block's first chunk. Against a later one, its
# second chunk sees both of that block's chunks. That is half a block each time. `ring.step_work` lists each rank's work at each step,
# `ring.balance` the share of the ring's time the average rank is busy:

# %%
for split in ("contiguous", "zigzag"):
    print(f"{split:10}, W = 4, causal: work per step and rank (whole blocks)\n"
          f"{ring.step_work(4, True, split)}\n  busy {ring.balance(4, True, split):.0%} of the time")

# %% [markdown]
# Stages take queries and keys of one length, so a step that pairs chunks runs them as one
# batch of chunk-sized problems: the two pairs share one launch. (PyTorch's `context_parallel`
# balances the mask with the same split, which it calls head-tail.)
#
# ## 5 · When does the ring hide its communication?
#
# A step computes on n queries and n keys and sends one block of keys and values. The work grows
# with n², the bytes with n:
#
# - compute: 4·H·n²·D FLOPs (half under the zig-zag mask), at the local attention's rate R;
# - transfer: 2·H·n·D values of 2 bytes (K and V), over a link of bandwidth L each way.
#
# The transfer hides when the compute takes longer: n ≥ 2·2·R / (4·L) tokens a GPU, doubled under
# the mask. The backward's ring sends K and V again and dK, dV in fp32 (12 bytes a token and row in
# all) against 2.5 times the FLOPs. NVLink 4 gives a GPU 450 GB/s each way to any other in the
# machine; between machines, a GPU gets one InfiniBand NDR port, 50 GB/s. At the rate one GPU
# reached on the whole sequence with stage 20 (the last recorded run's single-GPU causal training
# step, at the longest length it timed one GPU at):

# %%
rate = ra.recorded_rate(causal=True, training=True)
print(f"local attention at {rate:.0f} TFLOP/s")
for link, gbs in ring.LINKS_GBS.items():
    for training in (False, True):
        need = ring.tokens_to_hide(rate, gbs, causal=True, training=training)
        print(f"{link:8} causal {'training step' if training else 'forward      '}: hidden from "
              f"{need:7,.0f} tokens a GPU; a 1M-token sequence on up to {2 ** 20 // need:4.0f} GPUs")

# %%
ra.scaling()

# %% [markdown]
# ## Prediction
#
# Within one machine the ring hides its transfers from a few thousand tokens a GPU, far below the
# 16 384 to 131 072 tokens a GPU of the runs below (2 GPUs, 32k to 256k tokens). So on paper the
# communication costs nothing, and the ring should run at the speed of its local attention: at
# least 95 % of twice one GPU's speed. PyTorch's `context_parallel` with SDPA's cuDNN backend
# splits the sequence the same way and merges by log-sum-exps with cuDNN's kernels; by default it
# gathers every rank's keys and values at once rather than passing them around a ring, which moves
# the same bytes. The ring should therefore be ahead of it by about
# what stage 13's forward and stage 20's backward are ahead of cuDNN at these lengths: a few
# percent, and level at worst. Across machines, the figure says the same ring stops hiding its
# transfers for a causal training step beyond 38 GPUs at a million tokens, and beyond 4 at 128k.

# %% [markdown]
# ## Measurement
#
# The ring runs one process a GPU, started by `torchrun`, so it is measured outside this notebook:
#
# ```
# torchrun --nproc-per-node=2 tools/ring_bench.py --lengths 32768,131072 --dtypes fp16
# torchrun --nproc-per-node=2 tools/ring_bench.py --lengths 32768,131072 --dtypes bf16
# torchrun --nproc-per-node=2 tools/ring_bench.py --lengths 262144 --dtypes fp16
# ```
#
# times the ring with stage 20 on every GPU, `context_parallel` over SDPA's cuDNN and flash
# backends on the same GPUs in the same run, and one GPU on the whole sequence (for the
# efficiency). It also times the ring's compute without its transfers and its transfers without
# the compute. The recorded runs (D = 128, 16 heads; `vs_` is the baseline's time over the
# ring's, above 1 where the ring is faster; `hidden` is the share of the transfers' own time
# that did not add to the step's, 1 where they hid entirely):

# %%
runs = tables.ring_versus()
print(f"recorded on {runs['gpus'].iloc[-1]} x {tables.ring_rows()['gpu'].iloc[-1]}, commit "
      f"{runs['commit'].iloc[-1]}, {runs['time'].iloc[-1]}")
display(runs[["ring", "dtype", "pass", "N", "causal", "ring_ms", "sdpa_cudnn_ms", "vs_sdpa_cudnn",
              "vs_sdpa_flash", "efficiency", "hidden"]].round(3))

# %% [markdown]
# ### Discussion
#
# **Against `context_parallel` the prediction held.** The ring was 1.05–1.14 times
# `context_parallel` over cuDNN in the forward and 1.004–1.06 in the training step, at every
# length, in both dtypes, with and without the mask. The closest call is the fp16 training step at
# 32k with the mask, 1.004: level, as the prediction allowed at worst. The ring ran 1.61–1.89 times
# `context_parallel` over SDPA's flash backend, whose FlashAttention-2 kernels are not written for
# Hopper.
#
# **Against twice one GPU it held only on long sequences.** At 256k tokens the ring reached
# 95–101 % of twice one GPU's speed, as predicted, and at 128k 91–96 %. At 32k it reached 80–91 %
# without the mask and only 68–78 % with it. The transfers are not what went wrong: the next
# section shows the ring's compute *alone* was already slow. Each rank's work is then a
# 16k-token causal problem and two 8k-token chunk pairs: short problems, where a kernel's fixed
# costs weigh more (notebook 20's sweep runs stage 20 below cuDNN up to 4k). And every step's
# merge passes twice over the shard's fp32 output in unfused PyTorch operations. How much each of
# these costs is exercise 5's question.
#
# **The prediction got the direction right and the amount wrong.** "The ring runs at its local
# attention's speed" held where the local problems were long. Where they were short, the local
# attention ran below the rate the model took from one GPU's whole-sequence run.

# %% [markdown]
# ## The profile: compute alone, transfers alone
#
# The run timed each ring step's pieces apart. `compute_ideal` is one GPU's time on the whole
# sequence over 2, against the ring's compute alone: below 1, the local work itself is slower
# than its share. The transfers alone are set against the model's (at 450 GB/s), which gives the
# bandwidth the ring's point-to-point sends reached; `exposed_ms` is the step's time beyond its
# compute alone:

# %%
paper = ring.model_vs_runs()
paper = paper[paper["impl"] == runs["ring"].map("ring:{}".format).iloc[-1]].copy()
display(paper[["dtype", "pass", "N", "causal", "comm_ms", "comm_ms_paper", "link_gbs_measured", "compute_ideal",
               "exposed_ms", "efficiency"]].round(3))

# %% [markdown]
# ### Discussion
#
# **The local work is where most of the efficiency went.** Where the efficiency fell furthest, at
# 32k with the mask, `compute_ideal` accounts for nearly all of it in the forward (0.71–0.72
# against an efficiency of 0.68–0.69) and for over half of it in the training step (0.89–0.91
# against 0.76–0.78; the rest is the 2.4–2.6 ms the transfers added). The ring's compute alone,
# with no transfer at all, was already that far from ideal.
#
# **The transfers took 1.3 to 2.7 times the model's time**, and still did not decide the result.
# The forward's K/V block crossed NVLink at 168–329 GB/s, and the training step's larger
# transfers at 236–350 GB/s, not at 450: the longer the sequence, the closer. The transfers
# alone were at most 22 % of the compute alone (32k, with the mask, training step), 2–5 % at 128k
# and 1–2 % at 256k.
#
# **Overlapping in time is not hiding.** At 128k and 256k the step ran up to 51 ms longer than
# its compute alone: up to 2.8 times as long as the transfers alone took, although they ran beside
# the kernels. One likely cause, which these runs do not separate: NCCL copies with kernels of
# its own, on SMs the attention kernel then lacks. Exercise 4 tests it. Either way it is at most
# 5 % of a step there; at 32k with the mask the exposed time was 0.1–0.3 ms in the forward and
# 2.4–2.6 ms in the training step.

# %% [markdown]
# ## Exercises
#
# ### Lab `98.merge`
#
# Section 2's merge, by hand.

# %%
from flashlab.course import labs
print(labs.prompt("98.merge"))

# %%
### BEGIN SOLUTION
w_b = 3.0                                       # e^(lse_B - lse_A) = e^(ln 3)
answer = (1 / (1 + w_b), 2 * w_b / (1 + w_b), 0.5 + math.log(1 + w_b))
### END SOLUTION

# %%
labs.check("98.merge", answer)

# %% [markdown]
# ### Lab `98.balance`
#
# Section 4's count, for a larger ring.

# %%
from flashlab.course import labs
print(labs.prompt("98.balance"))

# %%
### BEGIN SOLUTION
shares = [r + 0.5 for r in range(8)]            # rank r: r whole blocks and half its own
answer = (max(shares) / (sum(shares) / 8), (sum(shares) / 8) / (0.5 + 7))
### END SOLUTION

# %%
labs.check("98.balance", answer)

# %% [markdown]
# ### Lab `98.hide`
#
# Section 5's model, between machines.

# %%
from flashlab.course import labs
print(labs.prompt("98.hide"))

# %%
### BEGIN SOLUTION
forward_needs = 2 * 2 * 500e12 / (4 * 0.5 * 50e9)
backward_needs = 12 * 500e12 / (10 * 0.5 * 50e9)
answer = (int(max(forward_needs, backward_needs)), int(2 ** 20 // max(forward_needs, backward_needs)))
### END SOLUTION

# %%
labs.check("98.hide", answer)

# %% [markdown]
# ### More exercises (ungraded)
#
# 4. **NCCL's share of the SMs** (two GPUs). Run `tools/ring_bench.py` at 128k tokens as above,
#    then again with `NCCL_MAX_NCHANNELS=1` in the environment. Predict what happens to the
#    transfers alone and to `exposed_ms`, then compare. Does the step get closer to its compute
#    alone?
# 5. **Where the short problems lose** (two GPUs, or one with `ring.simulate`). Profile one ring
#    forward at 32k tokens with the mask (`torch.profiler`, as notebook 20 profiles its passes) and
#    sort the GPU time into the local kernels, the merges and everything else. Which would you
#    remove first, and how?
# 6. **Ring or all-gather** (no GPU needed). A rank of this ring holds its own block and two
#    travelling ones. A rank could instead gather every rank's keys and values at once
#    (`dist.all_gather`, `context_parallel`'s default) and run one kernel. Write the memory for
#    keys and values each rank needs both ways, for W GPUs and N tokens, and say at which length
#    the gathered keys and values of one layer alone fill a 141 GB GPU (D = 128, 16 heads, fp16).

# %% [markdown]
# ## Questions for discussion
#
# 1. The zig-zag split balances a causal mask. Which masks would it not balance (a sliding
#    window, a document mask of packed sequences), and what would you do instead?
# 2. The model treats a ring step as the longer of its compute and its transfer. What does it
#    leave out that the measurement found?

# %% [markdown]
# **Instructor's answer.** *1.* A sliding window of w keys gives every query the same work
# wherever it sits, so a contiguous split is already balanced, and a rank only needs the blocks
# within w of its own: the ring can stop after ⌈w / n⌉ + 1 steps. Packed documents give each
# rank work that depends on where the document boundaries fall; split by counting each
# document's scores (sorting documents by length onto ranks), as systems for packed long-context
# training do, rather than by position.

# %% [markdown]
# **Instructor's answer.** *2.* The local attention's rate is not a constant: on short chunks it
# is lower than on the whole sequence, so the compute alone exceeds its share. Also left out are
# the merges (memory-bound passes beside the kernel), the transfers' own use of the GPU (NCCL's
# kernels take SMs), and the bandwidth a point-to-point send actually reaches: 168–350 GB/s here,
# not NVLink's 450.

# %% [markdown]
# ## Summary
#
# - Ring attention splits the sequence across W GPUs; keys and values travel around the ring,
#   one block a step, while each GPU computes against the block it holds.
# - Partial outputs over disjoint keys merge exactly from their log-sum-exps, in fp32. The
#   backward needs only the merged O and lse: P from the lse, Δ from O, and dK, dV travel home with
#   their block.
# - Under the causal mask a contiguous split keeps the ring a little over half busy. The zig-zag
#   split (chunks r and 2W − 1 − r) gives every rank half a block at every step.
# - A step's compute grows with n², its bytes with n: over NVLink a few thousand tokens a GPU hide
#   the transfers; over InfiniBand nine times as many.
# - On two H200s the ring with stage 20 ran 1.004–1.14 times `context_parallel` over cuDNN, in fp16
#   and bf16 from 32k to 256k tokens. It reached 95–101 % of twice one GPU at 256k, 91–96 % at
#   128k and 68–91 % at 32k, where the short local problems, not the transfers, cost it.
