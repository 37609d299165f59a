# %% [markdown]
# # 00 — Setup, the GPU, and the problem
#
# **flashlab** builds a FlashAttention forward kernel in CUDA one optimisation at a time. Each
# stage is one `.cu` file in `kernels/` and one notebook, and differs from the stage before by a
# single idea. Every stage is checked against a float64 reference and timed next to PyTorch's own
# attention on the same GPU, in the same run. Every number goes into one table,
# `data/results.csv`, which all the notebooks and figures read.
#
# This notebook sets up the rest of the workbook:
#
# 1. **the GPU**: its measured ceilings, which say what "fast" can mean on this chip;
# 2. **the problem**: the FLOPs and bytes of attention, and the *online softmax*, which lets a
#    kernel work without ever storing the N×N score matrix;
# 3. **the references** every stage is checked against;
# 4. **the machinery**: how a stage is built, checked, timed and recorded, and a demonstration
#    that the check can fail;
# 5. **the roofline and the ladder**: the two figures on which every later stage is placed.
#
# ### The ladder ahead
#
# The first three stages compute in fp32 on the CUDA cores:
# **01 naive** is the published *flash-attention-minimal* kernel, **02 coalesced** fixes its
# memory access pattern, and **03 coarsened** changes the loop order and gives each thread a
# small block of outputs, so that every value it loads feeds several FMAs. The stages after those move to fp16 on the tensor cores: WMMA, then `mma.sync` with
# `ldmatrix`, swizzled shared memory, and `cp.async` pipelining. The stages that exist now:

# %%
%matplotlib inline
import math

import pandas as pd
import torch
from IPython.display import Code

import flashlab as fl
from flashlab import intro, paths, peaks, plots
from flashlab import notebook as nb

pd.set_option("display.max_colwidth", None)
pd.DataFrame([dict(stage=s.slug, adds=s.idea, dtypes="/".join(s.dtypes)) for s in fl.stages()])

# %% [markdown]
# ### Live or replay
#
# The notebooks run in one of two modes, and `nb.banner()` says which:
#
# - **live**: a CUDA GPU and `nvcc` are present, and the GPU can run the notebook's stage (each
#   stage names the compute capability it needs: `fl.stage(k).min_cc`). Cells compile the
#   kernels, check them, time them now and write the results to `data/`.
# - **replay**: no GPU, or one the stage cannot run on. The same cells show the numbers recorded
#   in `data/` on a real GPU, and the banner says why and names that GPU and its software.
#
# Either way, everything one notebook shows comes from **one GPU**: this one when it runs live,
# otherwise the GPU that recorded most recently (or the one you name in the environment variable
# `FLASHLAB_GPU`). Times from two different GPUs are never set side by side.
#
# Run the cells top to bottom. The prose never states a measured number; every number you see
# comes from a cell's output, so the text stays true on whichever GPU produced the data.

# %%
nb.banner()

# %% [markdown]
# ## 1. The GPU's ceilings
#
# Three numbers bound every kernel in this workbook. We measure them instead of copying them from
# a datasheet. A datasheet peak assumes clocks and conditions that a real kernel rarely gets; a
# measured ceiling is what a well-tuned library actually reaches on this machine.
#
# - **`matmul_fp32_tflops`**: an 8192 × 8192 × 8192 fp32 matrix product (`a @ b`) with TF32
#   switched off. cuBLAS then has to use the CUDA cores' fp32 fused multiply-add (FMA) units, and
#   each FMA counts as 2 FLOPs. This is the ceiling for stages 01–03, which compute in fp32 on
#   those same units.
# - **`matmul_fp16_tflops`**: the same product in fp16, which cuBLAS runs on the **tensor
#   cores**, units that each do a small matrix product per instruction. This is the ceiling for
#   the tensor-core stages to come and for PyTorch's fp16 attention kernels.
# - **`copy_tbps`**: `dst.copy_(src)` on 1 GiB, counting the bytes read plus the bytes written.
#   This is the **HBM bandwidth**, the fastest the memory can feed the chip, and the ceiling
#   for any kernel that does little arithmetic per byte.
#
# Each one is timed the same way as the stages: the median of repeated runs, with the L2 cache
# flushed between them. In live mode the next cell measures this GPU (a few seconds) and records
# the result in `data/peaks.csv`. In both modes it then shows the recorded ceilings and the
# machine they were measured on.

# %%
if fl.gpu_available():
    peaks.record(peaks.measure())
ceilings = fl.tables.peaks()  # {metric: value} of the GPU this notebook shows
rows = fl.tables.peak_rows()
r = rows.iloc[0]
print(f"{r.gpu}: compute capability {r.compute_capability}, torch {r.torch}, CUDA {r.cuda}, "
      f"measured {r.time}")
rows[["metric", "value", "unit"]]

# %% [markdown]
# A kernel that performs *I* FLOPs for every byte it moves to or from HBM can run no faster than
# **min(peak FLOP/s, I × bandwidth)**. The intensity at which the two limits are equal,
# *peak / bandwidth*, is the **ridge point**. Below the ridge a kernel is *memory bound*: faster
# arithmetic would not help it. Above the ridge it is *compute bound*: only faster arithmetic
# helps. The tensor cores raise the peak but not the bandwidth, so they push the ridge to the
# right, and an fp16 kernel has to do much more work per byte before it can use them fully.

# %%
fp32, fp16, bw = (ceilings[k] for k in ("matmul_fp32_tflops", "matmul_fp16_tflops", "copy_tbps"))
print(f"The tensor cores (fp16) give {fp16 / fp32:.1f}x the fp32 rate of the CUDA cores.")
print(f"Ridge points: fp32 {fp32 / bw:.0f} FLOP/byte, fp16 {fp16 / bw:.0f} FLOP/byte "
      f"(TFLOP/s ÷ TB/s).")

# %% [markdown]
# ## 2. The problem: attention
#
# For each batch element *b* and head *h*, with **Q**, **K**, **V** ∈ ℝ<sup>N×D</sup>:
#
# $$S = Q K^\top \cdot \tfrac{1}{\sqrt D} \quad (N \times N), \qquad
#   P = \operatorname{softmax}_{\text{row}}(S), \qquad O = P V \quad (N \times D).$$
#
# flashlab's tensors are contiguous `(B, H, N, D)` arrays, which hold B·H independent problems.
# With **causal** masking, query *i* may attend only to keys *j ≤ i*: S<sub>ij</sub> is set to
# −∞ above the diagonal before the softmax. This is the mask used when a language model is
# trained to predict the next token.
#
# ### Counting FLOPs: 4·B·H·N²·D
#
# Q Kᵀ is N² dot products of length D: N²·D multiply-adds, or **2·N²·D FLOPs**. P V costs the
# same. Per problem that makes 4·N²·D, and `fl.flops` returns 4·B·H·N²·D. The softmax (N²
# exponentials, maxima and sums) is O(N²) against the matmuls' O(N²·D), and by the convention
# of the FlashAttention papers it is not counted. It is not free, though: once tensor cores make
# the matmuls cheap, the exponentials start to cost real time. With a causal mask only the
# N(N+1)/2 entries on or below the diagonal are useful, and flashlab counts **exactly half**. A
# causal kernel that computes the masked half anyway does the work without getting credit for it.
#
# PyTorch's own FLOP counter agrees. `fl.naive_attention` computes the masked entries and then
# throws them away, so the counter sees the full count even when the mask is on:

# %%
from torch.utils.flop_counter import FlopCounterMode

B, H, N, D = 2, 3, 256, 64
q, k, v = fl.Config(B, H, N, D).inputs(device="cpu")
for causal in (False, True):
    with FlopCounterMode(display=False) as counter:
        fl.naive_attention(q, k, v, causal=causal)
    print(f"causal={causal!s:5}  PyTorch counted {counter.get_total_flops():>11,}   "
          f"fl.flops {fl.flops(B, H, N, D, causal):>13,.0f}")
for n in (17, 1024, 16384):
    print(f"N={n:<6} useful part of the causal score matrix: (N+1)/2N = {(n + 1) / (2 * n):.4f}")

# %% [markdown]
# ### Counting bytes: attention should be compute bound
#
# The least any implementation has to move is: read Q, K and V once, and write O once. That is
# **4·B·H·N·D·elem** bytes, where *elem* is 4 for fp32 and 2 for fp16. Divide the FLOPs by it:
#
# $$I = \frac{4 B H N^2 D}{4 B H N D \cdot \text{elem}} = \frac{N}{\text{elem}}
#   \ \text{FLOP/byte} \quad (\text{half that when causal}).$$
#
# The intensity grows with N and does not depend on D, B or H. For N in the thousands it is
# hundreds of FLOPs per byte, well above both ridge points, so **attention is compute bound**,
# *provided that S and P never go to HBM*. The textbook implementation writes S, reads it back for
# the softmax, writes P and reads P again for P V. That adds 4·N² elements of traffic for each
# problem, and the intensity falls to below D / elem whatever N is: about 16 FLOP/byte in fp32 and
# 32 in fp16 at D = 64, far below the fp16 ridge. **This is the whole argument for
# FlashAttention**: keep S and P on chip, and attention changes from memory bound to compute bound.

# %%
intro.intensity_figure(ceilings);

# %% [markdown]
# What do these ceilings imply at the **teaching config** `fl.TEACHING`, the size at which every
# stage is compared? The cell below works out the lower bounds on time, one from each ceiling:

# %%
cfg = fl.TEACHING
traffic = intro.min_bytes(cfg.N, cfg.D, cfg.dtype, cfg.B, cfg.H)
print(f"{cfg.label}: {cfg.flops / 1e9:.1f} GFLOP, at least {intro.fmt_bytes(traffic)} of traffic, "
      f"{cfg.flops / traffic:.0f} FLOP/byte")
print(f"  at the fp32 ceiling the arithmetic takes {cfg.flops / (fp32 * 1e12) * 1e3:.3f} ms; "
      f"moving the bytes takes {traffic / (bw * 1e12) * 1e3:.3f} ms")
s_bytes = 4 * cfg.B * cfg.H * cfg.N**2 * 4
print(f"  writing and reading S and P (fp32) would move another {intro.fmt_bytes(s_bytes)}: "
      f"{s_bytes / (bw * 1e12) * 1e3:.3f} ms at full bandwidth")

# %% [markdown]
# ### The online softmax
#
# How can a kernel compute a softmax over a row of S without ever holding the whole row? Take one
# query row with scores s<sub>1</sub> … s<sub>N</sub> and value rows v<sub>1</sub> … v<sub>N</sub>.
# For **any** constant m,
#
# $$o = \frac{\sum_j e^{s_j - m}\, v_j}{\sum_j e^{s_j - m}} .$$
#
# Choosing m = max<sub>j</sub> s<sub>j</sub> keeps every exponent ≤ 0, so nothing overflows.
# This matters in practice: e<sup>x</sup> overflows fp32 once x > 88.7. The catch is that the
# maximum is not known until every score has been seen. The **online softmax** removes the catch.
# After the first few tiles of keys it keeps three things:
#
# - **m**: the largest score seen so far;
# - **l** = Σ e<sup>s<sub>j</sub> − m</sup>, summed over the keys seen so far;
# - **õ** = Σ e<sup>s<sub>j</sub> − m</sup> v<sub>j</sub>, an unnormalised output (a D-vector).
#
# When the next tile of scores arrives, the maximum may go up: m′ = max(m, max of the tile). Every
# term summed so far carries a factor e<sup>−m</sup>. Multiplying by **α = e<sup>m − m′</sup>**
# (which is ≤ 1) changes that factor to e<sup>−m′</sup>, so
#
# $$l' = \alpha\, l + \sum_{j \in \text{tile}} e^{s_j - m'}, \qquad
#   \tilde o' = \alpha\, \tilde o + \sum_{j \in \text{tile}} e^{s_j - m'}\, v_j .$$
#
# After the last tile, m is the true maximum and l the true denominator, so **O = õ / l**. The
# result is exact: only the rounding differs from a direct softmax. Each key and value is read
# once, and each row needs only m, l and one D-vector of state. Stages 01 and 02 follow
# FlashAttention-1 and normalise O after every tile; stage 03 follows FlashAttention-2 and
# divides by l once, at the end.
#
# Here is the loop for one row, on the CPU, with tiles of 128 keys over N = 1000 (the last tile is
# ragged). The table traces m, α and l from tile to tile. On the first tile α = 0, because nothing
# has been summed yet. α = 1 wherever a tile does not raise the maximum, and α < 1 wherever one
# does, which shrinks the earlier terms to match the new maximum:

# %%
def online_softmax_row(s, v, tile=128):
    """softmax(s) @ v for one query row, visiting the keys one tile at a time."""
    m, l, o = -math.inf, 0.0, torch.zeros(v.shape[1], dtype=v.dtype)
    trace = []
    for j in range(0, len(s), tile):
        s_j, v_j = s[j:j + tile], v[j:j + tile]
        m_new = max(m, s_j.max().item())
        alpha = math.exp(m - m_new)   # rescales everything summed under the old maximum
        p = torch.exp(s_j - m_new)
        l = alpha * l + p.sum().item()
        o = alpha * o + p @ v_j
        m = m_new
        trace.append(dict(keys=f"{j}–{j + len(s_j) - 1}", tile_max=s_j.max().item(), m=m, alpha=alpha, l=l))
    return o / l, pd.DataFrame(trace)

q, k, v = fl.Config(1, 1, 1000, 64).inputs(device="cpu")
s = (q[0, 0, 0] @ k[0, 0].T) / math.sqrt(64)           # the scores of query row 0
o, trace = online_softmax_row(s, v[0, 0])
exact = (torch.softmax(s.double(), 0) @ v[0, 0].double())
print(f"relative error against a float64 softmax: {fl.rel_err(o, exact):.1e}")
trace

# %% [markdown]
# The maximum matters as well as the tiling. Multiply the same scores by 40, as a sharply
# peaked attention head might produce. Without the maximum subtracted, e<sup>s</sup> overflows to
# `inf` and the softmax becomes `nan`. The online version is unaffected:

# %%
sharp = 40 * s
naive_p = torch.exp(sharp) / torch.exp(sharp).sum()
print(f"largest score {sharp.max():.0f}; exp without the max: {torch.isinf(torch.exp(sharp)).sum()} "
      f"infinities, softmax has {torch.isnan(naive_p).sum()} NaNs")
o_sharp, _ = online_softmax_row(sharp, v[0, 0])
print(f"online softmax: relative error {fl.rel_err(o_sharp, torch.softmax(sharp.double(), 0) @ v[0, 0].double()):.1e}")

# %% [markdown]
# A kernel does the same for a whole **tile of query rows** at once. Each step takes a Q tile
# (B<sub>r</sub> rows) and a K/V tile (B<sub>c</sub> rows), computes the B<sub>r</sub>×B<sub>c</sub>
# block S<sub>ij</sub> on chip, and folds it into each row's m, l and O. The figure shows one step
# and where each piece lives. Only Q, K, V and O are in HBM. The current tiles sit in **shared
# memory**, where every thread of the block can reuse them. S<sub>ij</sub> and P<sub>ij</sub>
# exist only on chip, one tile at a time. Under the causal mask, tiles entirely above the diagonal
# are skipped, and only the diagonal tiles need masking inside.
#
# The stages differ in the **loop order**. Stages 01 and 02 use the FlashAttention-1 order: the
# outer loop runs over K/V tiles and the inner loop over Q tiles, so each row's m, l and O return
# to HBM after every K/V tile. Stage 03 uses the FlashAttention-2 order shown here: one block
# owns Q<sub>i</sub> and sweeps j, so m, l and O<sub>i</sub> stay in registers from start to
# finish.

# %%
intro.tiling_figure();

# %% [markdown]
# The same loop in PyTorch, for every row of every head at once. It has the signature that
# flashlab expects of an attention function, `fn(q, k, v, causal=False, out=None)`, which writes
# into `out`, so section 4 can check it like a kernel:

# %%
def flash_torch(q, k, v, causal=False, out=None, tile=64):
    """FlashAttention's loop in PyTorch: K/V tiles in order, a running m, l and O for each query."""
    scale = q.shape[-1] ** -0.5
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    m = torch.full(q.shape[:-1] + (1,), -math.inf, dtype=q.dtype, device=q.device)
    l, o = torch.zeros_like(m), torch.zeros_like(q)
    for j in range(0, k.shape[-2], tile):   # tile 0 holds key 0, which every query sees: m finite
        s = q @ k[..., j:j + tile, :].transpose(-1, -2) * scale
        if causal:
            cols = torch.arange(j, j + s.shape[-1], device=q.device)
            s = s.masked_fill(cols > rows, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
        l = alpha * l + p.sum(-1, keepdim=True)
        o = alpha * o + p @ v[..., j:j + tile, :]
        m = m_new
    out = torch.empty_like(q) if out is None else out
    return out.copy_(o / l)

q, k, v = fl.Config(2, 4, 300, 64).inputs(device="cpu")
for causal in (False, True):
    err = fl.rel_err(flash_torch(q, k, v, causal), fl.reference(q, k, v, causal))
    print(f"causal={causal!s:5} relative error of flash_torch against float64: {err:.1e}")

# %% [markdown]
# ## 3. The references
#
# - **`fl.reference(q, k, v, causal)`** is the truth every stage is checked against. It runs in
#   **float64**, a few heads at a time, so that the N×N scores of an N = 16k problem fit in
#   memory (at most 2 GiB of scores per chunk).
# - **`fl.naive_attention(q, k, v, causal)`** is the textbook version in the inputs' own dtype:
#   a matmul, a softmax (in fp32) and a matmul, with the whole N×N matrix materialised. The
#   baseline called `torch_naive` is this function.
# - **`fl.rel_err(out, ref)`** = ‖out − ref‖ / ‖ref‖ over the whole tensor, computed in float64.
#   It is `inf` when `out` contains any NaN or inf.
#
# How far from float64 does an honest computation land in each dtype? That error sets the
# tolerances. fp32 must come within 1e-4. For fp16 and bf16 the rule comes from FlashAttention's
# own tests: the error may be at most twice that of PyTorch's attention in the same dtype.

# %%
from flashlab.check import tolerance

for dt in (torch.float32, torch.float16, torch.bfloat16):
    qd, kd, vd = (t.to(dt) for t in (q, k, v))
    ref = fl.reference(qd, kd, vd, causal=True)  # float64 of the rounded inputs
    err = fl.rel_err(fl.naive_attention(qd, kd, vd, causal=True), ref)
    print(f"{str(dt):15} naive_attention rel_err {err:.1e}   check tolerance "
          f"{tolerance(qd, kd, vd, True, ref):.1e}")

# %% [markdown]
# Materialising S costs memory as well as time. The largest problem in the FlashAttention sweep
# that later notebooks time (`fl.sweep()`) shows how much:

# %%
big = max(fl.sweep("fp16"), key=lambda c: c.N)
scores = big.B * big.H * big.N**2 * 2
print(f"{big.label}: q, k, v, o take {intro.fmt_bytes(intro.min_bytes(big.N, big.D, 'fp16', big.B, big.H))}; "
      f"the fp16 score matrix alone would take {intro.fmt_bytes(scores)}")
print("so the baselines that materialise it (torch_naive, sdpa_math) are not timed past N = 8192")

# %% [markdown]
# ## 4. Build, check, bench, record
#
# ### A stage, and what `build()` returns
#
# `fl.stage(k)` describes stage *k*: its `.cu` file, the dtypes and head dims it supports, and
# the single idea it adds. `stage.build()` compiles the file with `nvcc` (a few seconds the first
# time; after that the build is cached under a hash of everything that went into it) and returns
# **`attn(q, k, v, causal=False, out=None)`**, which takes `(B, H, N, D)` CUDA tensors. The
# `.cu` files contain no PyTorch code. Each one implements the three C functions of
# `kernels/flashlab.h`, and flashlab generates the small Python binding that calls them:

# %%
st = fl.stage(3)
print(f"{st}\n  adds: {st.idea}\n  dtypes {st.dtypes}, checked at D = {st.head_dims}, "
      f"causal: {st.causal}\n  source: kernels/{st.source.name}")
abi = (paths.KERNELS / "flashlab.h").read_text()
Code(abi[abi.index('extern "C"'):], language="c")

# %% [markdown]
# Bad input is caught in Python before any kernel runs. A wrong call raises a `ValueError` that
# names the problem, so it never turns into a wrong answer, a hang or a CUDA fault. These checks
# need no GPU; the device is checked last:

# %%
from flashlab.inputs import validate

bad_calls = {"fp64 inputs": (q.double(), k.double(), v.double()),
             "k with a different D": (q, k[..., :32].contiguous(), v),
             "non-contiguous v": (q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2)),
             "CPU tensors": (q, k, v)}
for what, args in bad_calls.items():
    try:
        validate(st.slug, *args, dtypes=st.dtypes)
    except ValueError as err:
        print(f"{what:22} ValueError: {err}")

# %% [markdown]
# ### `fl.check`: a test designed to catch the usual kernel bugs
#
# `fl.check(attn)` compares `attn` with `fl.reference` on **fresh random inputs** each time it is
# called, so a kernel cannot pass by accident on one fixed input. Before every call it fills the
# output with **NaN**, so a single element the kernel never writes makes the error infinite.
# Without the poison, that element might hold zeros or a previous call's result and pass by
# luck. It runs each shape in `(B, H, N)` = (1, 1, **1**), (2, 3, **17**), (1, 2, **1000**) and
# (1, 1, **4096**): no tile size divides the first three, and the last is long enough for errors
# that grow with N to show. Each shape runs at every head dim the stage supports, with and
# without the causal mask. The tolerance is a relative error of 1e-4 in fp32; in fp16 and bf16
# it is FlashAttention's own rule, at most twice the error of PyTorch's attention computed in the
# same dtype.
#
# It works on any function with the attention signature, including `flash_torch` on the CPU:

# %%
fl.check(flash_torch, device="cpu", dtype="fp32")

# %% [markdown]
# A check that cannot fail is worthless. Here are three plausible bugs, each of which `fl.check`
# has to catch:
#
# - `forgets_mask` ignores `causal`. It is right in every unmasked case.
# - `whole_tiles_only` drops the ragged last K/V tile, a common bug when N is assumed to be a
#   multiple of the tile size. It would pass at N = 1024.
# - `misses_last_row` never writes the last query row, an off-by-one in the row loop. Only the
#   NaN poison exposes it reliably.

# %%
def forgets_mask(q, k, v, causal=False, out=None):
    return flash_torch(q, k, v, causal=False, out=out)

def whole_tiles_only(q, k, v, causal=False, out=None, tile=64):
    n = k.shape[-2] // tile * tile
    return flash_torch(q, k[..., :n, :], v[..., :n, :], causal, out)

def misses_last_row(q, k, v, causal=False, out=None):
    out[..., :-1, :] = flash_torch(q, k, v, causal)[..., :-1, :]
    return out

fns = [flash_torch, forgets_mask, whole_tiles_only, misses_last_row]
intro.check_matrix({f.__name__: fl.check(f, device="cpu", dtype="fp32") for f in fns})

# %% [markdown]
# Each bug is caught, and on the cases you would expect. `forgets_mask` fails only the causal
# cases with more than one key: a single key needs no mask. `whole_tiles_only` fails wherever N
# is not a multiple of 64, which is every N in the check. `misses_last_row` fails every case
# with an infinite error, because the NaN poison is still in the row it never wrote.
#
# On a GPU the next cell runs the real check on stage 03. In replay mode it shows the cases
# recorded when stage 03 was last checked:

# %%
if fl.gpu_available():
    attn = fl.stage(3).build()
    display(fl.check(attn))
else:
    display(fl.recorded_checks("03_coarsened")[["B", "H", "N", "D", "causal", "dtype", "rel_err",
                                                "tol", "passed", "gpu"]])

# %% [markdown]
# ### `fl.bench`: timing that can be trusted
#
# `fl.bench(attn, config)` generates seeded inputs for the config and first records the relative
# error *at that config*. It then times the kernel with `triton.testing.do_bench` (or, without
# triton, CUDA events by hand):
#
# - **warm-up** runs first, at every config, for at least 10 calls and 100 ms, so compilation,
#   module loading, allocation, a library's per-shape planning (cuDNN builds an execution plan
#   the first time it sees a shape) and the clocks ramping up are never timed;
# - **the L2 cache is flushed** before every run by overwriting a 256 MB buffer, because a problem
#   small enough to stay in L2 would otherwise be timed reading from cache instead of HBM, which
#   no real workload gets;
# - it reports the **median of at least 20 runs**, with the 20th and 80th percentiles as the
#   spread. The median is robust to the odd run that gets interrupted;
# - **it times twice**: the timing above, then a quick second one. Where the p20–p80 spread is
#   wider than 10% of the median, or the two medians differ by more than 10%, the timing is
#   thrown away and taken again (at most twice more). The row records how many warm-up calls
#   ran (`warmup_runs`), how many timings were thrown away (`retimes`) and what they saw
#   (`note`), so a number that needed re-timing says so;
# - **TFLOP/s** = `fl.flops(config)` / median time. Every stage and baseline is counted with the
#   same formula, so their rates can be compared directly.
#
# The timed row of stage 03 at the teaching config (in live mode, a fresh measurement is shown
# above it):

# %%
cols = ["median_ms", "p20_ms", "p80_ms", "tflops", "rel_err", "runs", "warmup_runs", "retimes", "timer"]
rec = fl.tables.at_config(fl.recorded("03_coarsened", gpu=nb.the_gpu().name), fl.TEACHING)
table = rec[cols + ["gpu"]].assign(source="recorded")
if fl.gpu_available():
    now = pd.DataFrame([fl.bench(attn, fl.TEACHING)])[cols].assign(gpu=torch.cuda.get_device_name(),
                                                                   source="measured now")
    table = pd.concat([now, table])
table.set_index("source")

# %% [markdown]
# ### The results table
#
# Every timed row goes into `data/results.csv`: one tidy row per (stage or baseline, config,
# dtype, causal, GPU). **`fl.results.key`** identifies a row; writing a row with the same key
# replaces the old one. The table is written under a file lock and replaced by an atomic rename,
# so two notebooks writing at once, or a run killed halfway, can never corrupt it.
# **`fl.results.contract`** lists the columns that outside tools may rely on. The other columns
# (p20/p80, percentages of SDPA, registers and spills from `ptxas`, versions, commit, time) sit
# beside them.

# %%
df = fl.results.load()
print("key:     ", ", ".join(fl.results.key))
print("contract:", ", ".join(fl.results.contract))
print(f"{len(df)} rows: {(df.kind == 'stage').sum()} stage rows and {(df.kind == 'baseline').sum()} "
      f"baseline rows, from {df.gpu.nunique()} GPU(s)")
df[fl.results.contract].head(3)

# %% [markdown]
# ## 5. The roofline, and the road ahead
#
# The **roofline** places every stage and baseline at the teaching config against the measured
# ceilings. The x-axis is the intensity from section 2 (N / elem: fp32 points sit at one
# intensity, fp16 points at twice it), and the y-axis is the achieved TFLOP/s. Both are log
# scales. Circles are stages; squares are PyTorch's baselines. Compare the intensities with the ridge points printed in section 1: a point to the
# right of its ridge sits under the flat part of its roof, the matmul peak of its dtype. The
# vertical gap between a point and the roof above it is performance left unused.
#
# - **Stages 01 and 02** sit far below even the fp32 roof. The total traffic is not what limits
#   them. They are limited by how they use memory and threads: 01's loads are uncoalesced, and
#   both send m, l and O back through HBM after every K/V tile and do little arithmetic per load.
# - **Stage 03** shows how far CUDA-core techniques go: the cell below the figure prints how close
#   it gets to the fp32 roof and to PyTorch's fp32 attention.
# - **PyTorch's fp16 kernels** (`sdpa_flash`, `sdpa_cudnn`) sit far higher, under the tensor-core
#   roof. That gap is what the rest of the workbook closes, with fp16, tensor cores, and the memory
#   pipeline that keeps them fed.
#
# The figures and tables below show the notebook's one GPU (the banner names it). In a live
# session that is yours: until the stage notebooks or `flashlab run` have recorded rows for it,
# they say what to run instead.

# %%
plots.roofline()

# %%
fp32_rows, fp16_rows = nb.compare("fp32"), nb.compare("fp16")
roof = fl.tables.peaks(fp32_rows["gpu"].iloc[0])
best = fp32_rows[fp32_rows["kind"] == "stage"].sort_values("tflops").iloc[-1]
sdpa16 = fp16_rows[fp16_rows["stage"].str.startswith("sdpa_")].sort_values("tflops").iloc[-1]
print(f"Best stage so far: {best.stage} at {best.tflops:.1f} TFLOP/s, "
      f"{100 * best.tflops / roof['matmul_fp32_tflops']:.0f}% of the fp32 roof and "
      f"{best.pct_sdpa_best:.0f}% of the fastest fp32 SDPA backend.")
print(f"Fastest fp16 attention: {sdpa16.stage} at {sdpa16.tflops:.0f} TFLOP/s, "
      f"{sdpa16.tflops / best.tflops:.0f}x the best stage and "
      f"{100 * sdpa16.tflops / roof['matmul_fp16_tflops']:.0f}% of the tensor-core roof.")

# %% [markdown]
# The **ladder** is the map of the journey: each stage's TFLOP/s at the teaching config on a log
# scale, with PyTorch's fp32 baselines drawn as lines and its fp16 flash and cuDNN kernels shown
# faintly as the targets. Every stage notebook adds one bar.

# %%
plots.ladder()

# %% [markdown]
# The same numbers as tables, slowest first. `pct_sdpa_best` is the rate as a percentage of the
# fastest SDPA backend *in the same dtype*. fp32 stages are compared with fp32 baselines, and
# fp16 with fp16. SDPA's flash and cuDNN backends accept only fp16 and bf16, so in fp32 the
# fastest backend is usually `sdpa_efficient`.

# %%
nb.compare()

# %%
nb.compare("fp16")

# %% [markdown]
# **Next: [01 — naive](01_naive.ipynb).** The starting point is the published
# flash-attention-minimal kernel: the FlashAttention-1 loop order, with one thread per query row.
