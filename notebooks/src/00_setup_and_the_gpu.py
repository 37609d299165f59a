# %% [markdown]
# # 00 — Setup, the GPU, and the problem
#
# This workbook builds a FlashAttention forward kernel in CUDA, one optimisation per stage. Each
# stage is one `.cu` file in `kernels/` and one notebook, checked against a float64 reference and
# timed next to PyTorch's attention on the same GPU. This notebook measures the GPU, works out
# what attention costs, and draws the two figures every stage is placed on.
#
# ## Objectives
# After this notebook you can:
# - name the GPU's three measured ceilings and compute a ridge point from them;
# - count the FLOPs and the least HBM traffic of attention, and explain why it is compute bound
#   only when the N×N scores stay on chip;
# - run the online softmax by hand and say why its result is exact;
# - read a roofline and the stage ladder;
# - say how a stage is built, checked and timed (appendix).
#
# **Prerequisites:** Python and PyTorch; matrix products and the softmax. Reading C helps from
# notebook 01 on.
#
# **Time:** about 24 min to read, 60 min to work through.
#
# ### The ladder ahead
#
# Stages 01–03 compute in fp32 on the CUDA cores, starting from the published
# *flash-attention-minimal* kernel (**01 naive**); the later stages move to fp16 on the tensor
# cores. The table says what each stage adds:

# %%
# %matplotlib inline
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
# `nb.banner()` says which mode a notebook runs in. **Live**: a CUDA GPU and `nvcc` are here,
# and the GPU can run the stage (`fl.stage(k).min_cc`); cells build, check and time kernels,
# writing to `data/`. **Replay**: the same cells show what a real GPU recorded there, and the
# banner names it. Either way a notebook shows **one GPU** (this one when live,
# else the one that recorded last, or `FLASHLAB_GPU`): times from two GPUs never sit side by side.

# %%
nb.banner()

# %% [markdown]
# ## 1. The GPU
#
# An H100 SXM has **132 streaming multiprocessors (SMs)**, which share a 50 MB L2 cache and
# 80 GB of HBM3. Each SM has 65 536 32-bit registers, up to 228 KB of **shared memory** (32
# banks, 4 bytes wide), 128 fp32 FMA units and 4 tensor cores. Threads run in **warps** of 32
# that execute one instruction together. An SM holds up to 64 warps; each clock its 4 schedulers
# each issue one instruction from a ready warp. A warp waiting for memory (about thirty clocks
# for shared memory, several hundred for HBM) is skipped, so an SM hides latency only when it has
# other warps to run.
#
# Three measured numbers bound every kernel here:
#
# - **`matmul_fp32_tflops`**: an 8192³ fp32 matrix product with TF32 off, so cuBLAS uses the
#   CUDA cores' fp32 fused multiply-adds (FMA, 2 FLOPs each): the ceiling for stages 01–03.
# - **`matmul_fp16_tflops`**: the same product in fp16 on the **tensor cores**, which do a small
#   matrix product per instruction: the ceiling for the later stages and PyTorch's fp16 kernels.
#   The datasheet's dense fp16 peak, 989 TFLOP/s, is 132 SMs × 4 096 FLOP per clock × 1.83 GHz;
#   a measured ceiling is what a tuned library reaches.
# - **`copy_tbps`**: `dst.copy_(src)` on 1 GiB, bytes read plus written: the **HBM bandwidth**,
#   the ceiling for a kernel that does little arithmetic per byte.
#
# Each is timed like the stages (median of repeated runs, L2 flushed between them). Live, the
# next cell measures this GPU (a few seconds) and records it in `data/peaks.csv`.

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
# A kernel that performs *I* FLOPs per byte of HBM traffic runs no faster than
# **min(peak FLOP/s, I × bandwidth)**. The intensity where the two are equal, *peak / bandwidth*,
# is the **ridge point**. Below it a kernel is *memory bound*; above it, *compute bound*. The
# tensor cores raise the peak but not the bandwidth, so they move the ridge to the right.

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
# The tensors are contiguous `(B, H, N, D)` arrays: B·H independent problems. With **causal**
# masking, query *i* attends only to keys *j ≤ i* (S<sub>ij</sub> = −∞ above the diagonal), as in
# a language model predicting the next token.
#
# ### Counting FLOPs: 4·B·H·N²·D
#
# Q Kᵀ is N² dot products of length D: **2·N²·D FLOPs**. P V costs the same, so `fl.flops`
# returns 4·B·H·N²·D. By the FlashAttention papers' convention the softmax (O(N²) exponentials,
# maxima and sums) is not counted, though its exponentials cost real time once tensor cores make
# the matmuls cheap. Causal counts **exactly half**: a kernel that computes the masked half
# anyway gets no credit for it. PyTorch's FLOP counter agrees; `fl.naive_attention` computes
# the masked entries and discards them, so the counter sees the full count either way:

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
# The least any implementation moves is Q, K, V read once and O written once:
# **4·B·H·N·D·elem** bytes (*elem* = 4 for fp32, 2 for fp16). So
#
# $$I = \frac{4 B H N^2 D}{4 B H N D \cdot \text{elem}} = \frac{N}{\text{elem}}
#   \ \text{FLOP/byte} \quad (\text{half that when causal}).$$
#
# For N in the thousands that is hundreds of FLOPs per byte, above both ridge points: **attention
# is compute bound**, *provided S and P never go to HBM*. The textbook implementation writes S,
# reads it for the softmax, writes P and reads it for P V: 4·N² more elements per problem, and the
# intensity falls below D / elem whatever N is (16 FLOP/byte in fp32 at D = 64). **That is the
# whole case for FlashAttention**: keep S and P on chip.

# %%
intro.intensity_figure(ceilings);

# %% [markdown]
# The lower bounds on time at the **teaching config** `fl.TEACHING`, where every stage is
# compared, one from each ceiling:

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
# Materialising S costs memory too. The largest problem of the FlashAttention sweep
# (`fl.sweep()`), which later notebooks time:

# %%
big = max(fl.sweep("fp16"), key=lambda c: c.N)
scores = big.B * big.H * big.N**2 * 2
print(f"{big.label}: q, k, v, o take {intro.fmt_bytes(intro.min_bytes(big.N, big.D, 'fp16', big.B, big.H))}; "
      f"the fp16 score matrix alone would take {intro.fmt_bytes(scores)}")
print("so the baselines that materialise it (torch_naive, sdpa_math) are not timed past N = 8192")

# %% [markdown]
# ### The online softmax
#
# How can a kernel take a row's softmax without holding the whole row? Take one query row with
# scores s<sub>1</sub> … s<sub>N</sub> and value rows v<sub>1</sub> … v<sub>N</sub>.
# For **any** constant m,
#
# $$o = \frac{\sum_j e^{s_j - m}\, v_j}{\sum_j e^{s_j - m}} .$$
#
# m = max<sub>j</sub> s<sub>j</sub> keeps every exponent ≤ 0, so nothing overflows (e<sup>x</sup>
# overflows fp32 past x ≈ 88.7), but it is known only after every score. The **online softmax**
# keeps, over the keys seen so far:
#
# - **m**: the largest score;
# - **l** = Σ e<sup>s<sub>j</sub> − m</sup>;
# - **õ** = Σ e<sup>s<sub>j</sub> − m</sup> v<sub>j</sub>, an unnormalised output (a D-vector).
#
# When a tile of scores raises the maximum to m′, every term so far carries e<sup>−m</sup>, and
# multiplying by **α = e<sup>m − m′</sup>** (≤ 1) turns it into e<sup>−m′</sup>:
#
# $$l' = \alpha\, l + \sum_{j \in \text{tile}} e^{s_j - m'}, \qquad
#   \tilde o' = \alpha\, \tilde o + \sum_{j \in \text{tile}} e^{s_j - m'}\, v_j .$$
#
# After the last tile, **O = õ / l**, exact up to rounding, with each key and value read once.
#
# One row on the CPU, tiles of 128 keys over N = 1000 (the last ragged). α = 0 on the first tile
# (nothing summed yet), 1 where a tile does not raise the maximum, < 1 where it does:

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
# Multiply the same scores by 40, as a sharply peaked head might. Without the maximum subtracted,
# e<sup>s</sup> overflows and the softmax becomes `nan`; the online version does not:

# %%
sharp = 40 * s
naive_p = torch.exp(sharp) / torch.exp(sharp).sum()
print(f"largest score {sharp.max():.0f}; exp without the max: {torch.isinf(torch.exp(sharp)).sum()} "
      f"infinities, softmax has {torch.isnan(naive_p).sum()} NaNs")
o_sharp, _ = online_softmax_row(sharp, v[0, 0])
print(f"online softmax: relative error {fl.rel_err(o_sharp, torch.softmax(sharp.double(), 0) @ v[0, 0].double()):.1e}")

# %% [markdown]
# A kernel does the same for a **tile of query rows** at once. Each step takes a Q tile
# (B<sub>r</sub> rows) and a K/V tile (B<sub>c</sub> rows), computes the B<sub>r</sub>×B<sub>c</sub>
# block S<sub>ij</sub> on chip and folds it into each row's m, l and O. Only Q, K, V and O live in
# HBM; the current tiles sit in **shared memory**, where the whole thread block reuses them;
# S<sub>ij</sub> and P<sub>ij</sub> never leave the chip. Under the causal mask, tiles above the
# diagonal are skipped and only diagonal tiles are masked.
#
# The stages differ in **loop order**. Stages 01 and 02 use FlashAttention-1's: K/V tiles outside,
# Q tiles inside, so each row's m, l and normalised O return to HBM after every K/V tile.
# Stage 03 uses FlashAttention-2's, drawn here: one block owns Q<sub>i</sub> and sweeps j, keeping
# m, l and O<sub>i</sub> in registers and dividing by l once, at the end.

# %%
intro.tiling_figure();

# %% [markdown]
# The same loop in PyTorch for every row of every head at once, with the attention signature
# `fn(q, k, v, causal=False, out=None)`, so that the appendix can check it like a kernel:

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
# ## 3. The roofline and the ladder
#
# The **roofline** places PyTorch's attention at the teaching config under the measured
# ceilings: x is section 2's intensity (N / elem, so fp16 points sit at twice the fp32 one), y the
# achieved TFLOP/s, both logarithmic. Both intensities lie right of their ridge points, under the
# flat part of the roof; the vertical gap between a point and its roof is performance left unused.
# Each stage adds its own point.

# %%
plots.roofline(last="00")

# %%
base32, base16 = (nb.compare(d).query("kind == 'baseline'").reset_index(drop=True)
                  for d in ("fp32", "fp16"))
for dtype, rows_d in (("fp32", base32), ("fp16", base16)):
    best = rows_d.sort_values("tflops").iloc[-1]
    print(f"Fastest {dtype} attention: {best.stage}, {best.tflops:.1f} TFLOP/s, "
          f"{100 * best.tflops / ceilings[f'matmul_{dtype}_tflops']:.0f}% of the {dtype} matmul ceiling.")

# %% [markdown]
# The **ladder** shows TFLOP/s at the teaching config on a log scale: PyTorch's fp32 attention
# as lines, its fp16 flash and cuDNN kernels faint above them.

# %%
plots.ladder(last="00")

# %% [markdown]
# The same baselines as tables, slowest first. `pct_sdpa_best` is the rate as a percentage of the
# fastest SDPA backend *in the same dtype*: SDPA's flash and cuDNN backends take only fp16 and
# bf16, so in fp32 that is usually `sdpa_efficient`.

# %%
base32

# %%
base16

# %% [markdown]
# ## Appendix: how a stage is built and checked
#
# ### The references
#
# - **`fl.reference(q, k, v, causal)`**: the truth every stage is checked against, in
#   **float64**, a few heads at a time (at most 2 GiB of scores a chunk).
# - **`fl.naive_attention(q, k, v, causal)`**: the textbook version in the inputs' dtype (matmul,
#   fp32 softmax, matmul), N×N matrix materialised; the baseline `torch_naive`.
# - **`fl.rel_err(out, ref)`** = ‖out − ref‖ / ‖ref‖ in float64; `inf` if `out` holds a NaN or inf.
#
# The tolerance: 1e-4 in fp32; in fp16 and bf16 FlashAttention's own rule, at most twice the
# error of PyTorch's attention in the same dtype:

# %%
from flashlab.check import tolerance

for dt in (torch.float32, torch.float16, torch.bfloat16):
    qd, kd, vd = (t.to(dt) for t in (q, k, v))
    ref = fl.reference(qd, kd, vd, causal=True)  # float64 of the rounded inputs
    err = fl.rel_err(fl.naive_attention(qd, kd, vd, causal=True), ref)
    print(f"{str(dt):15} naive_attention rel_err {err:.1e}   check tolerance "
          f"{tolerance(qd, kd, vd, True, ref):.1e}")

# %% [markdown]
# ### A stage, and what `build()` returns
#
# `fl.stage(k)` describes stage *k*: its `.cu` file, dtypes, head dims and the idea it adds.
# `stage.build()` compiles the file with `nvcc` (cached under a hash of its inputs) and returns
# **`attn(q, k, v, causal=False, out=None)`** for `(B, H, N, D)` CUDA tensors. The `.cu` files
# contain no PyTorch code: each implements the three C functions of `kernels/flashlab.h`, called
# by a small generated binding:

# %%
st = fl.stage(3)
print(f"{st}\n  adds: {st.idea}\n  dtypes {st.dtypes}, checked at D = {st.head_dims}, "
      f"causal: {st.causal}\n  source: kernels/{st.source.name}")
abi = (paths.KERNELS / "flashlab.h").read_text()
Code(abi[abi.index('extern "C"'):], language="c")

# %% [markdown]
# Bad input raises a `ValueError` before any kernel runs, instead of becoming a wrong answer, a
# hang or a CUDA fault:

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
# ### `fl.check`
#
# `fl.check(attn)` compares `attn` with `fl.reference` on **fresh random inputs** each call, and
# first fills the output with **NaN**, so an element the kernel never writes makes the error
# infinite instead of passing on stale zeros. It runs `(B, H, N)` = (1, 1, **1**), (2, 3, **17**),
# (1, 2, **1000**) and (1, 1, **4096**): no tile size divides the first three, and the last is
# long enough for errors that grow with N; each at every supported head dim, causal and not. It
# takes any function with the attention signature, `flash_torch` on the CPU included:

# %%
fl.check(flash_torch, device="cpu", dtype="fp32")

# %% [markdown]
# A check that cannot fail is worthless. Three plausible bugs to catch: `forgets_mask`
# ignores `causal`; `whole_tiles_only` drops the ragged last K/V tile (it would pass at
# N = 1024); `misses_last_row` never writes the last query row, which only the NaN poison exposes
# reliably.

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
# `forgets_mask` fails only causal cases with more than one key, `whole_tiles_only` wherever N is
# not a multiple of 64, `misses_last_row` everywhere. On a GPU the next cell checks stage 03; in
# replay it shows the recorded cases:

# %%
if fl.gpu_available():
    attn = fl.stage(3).build()
    display(fl.check(attn))
else:
    display(fl.recorded_checks("03_coarsened")[["B", "H", "N", "D", "causal", "dtype", "rel_err",
                                                "tol", "passed", "gpu"]])

# %% [markdown]
# ### `fl.bench`
#
# `fl.bench(attn, config)` records the relative error at that config, then times with CUDA
# events:
#
# - **warm-up** of at least 10 calls and 100 ms, so that compilation, allocation, a library's
#   per-shape planning and the clock ramp are never timed;
# - **L2 flushed** before every run (a 256 MB buffer overwritten), so no problem is timed from
#   cache;
# - the **median of at least 20 runs**, with the 20th and 80th percentiles;
# - **the GPU never waits for Python**: the runs are queued behind a short GPU sleep, and a run
#   whose start event the GPU had already reached when it was queued is dropped. Our wrapper
#   spends 24–60 µs of host time per call (notebook 99 records it for each stage), as long as a
#   0.05 ms kernel: unguarded, that time leaks into the timing whenever the host falls behind;
# - **timed twice**: where the p20–p80 spread exceeds 10% of the median, or the two medians differ
#   by more than 10%, it times again (at most twice more) and says so (`retimes`, `note`);
# - **TFLOP/s** = `fl.flops(config)` / median, the same formula for every stage and baseline.
#
# At long sequences the GPU's clock moves by a few per cent from one second to the next, enough
# to misrank two kernels timed one after the other. So compared kernels are timed
# **together**: `flashlab run` queues the stages and SDPA's flash and cuDNN backends in one
# stream, in turn (a, b, c, a, b, c, ...), three rounds over, and each keeps its median round
# (`time_interleaved` in `flashlab/bench.py`). A stage's notebook does the same when live: its
# stage, the one before and the two backends, at the teaching configs and over the sweep.
#
# Stage 03's row at the teaching config (live, a fresh measurement above it):

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
# Timed rows go into `data/results.csv`, one per (stage or baseline, config, dtype, causal,
# GPU). **`fl.results.key`** identifies a row; a new row with the same key replaces the old.
# Writes take a file lock and an atomic rename, so concurrent writers or a killed run cannot
# corrupt it. **`fl.results.contract`** lists the columns outside tools may rely on.

# %%
df = fl.results.load()
print("key:     ", ", ".join(fl.results.key))
print("contract:", ", ".join(fl.results.contract))
print(f"{len(df)} rows: {(df.kind == 'stage').sum()} stage rows and {(df.kind == 'baseline').sum()} "
      f"baseline rows, from {df.gpu.nunique()} GPU(s)")
df[fl.results.contract].head(3)

# %% [markdown]
# ## Next: stage 01
#
# **[01 — naive](01_naive.ipynb)** starts from the published flash-attention-minimal kernel: the
# FlashAttention-1 loop order, one thread per query row.

# %% [markdown]
# ## Questions for discussion
#
# 1. The measured fp16 matmul ceiling is well below the datasheet's 989 TFLOP/s. Which of the
#    datasheet's assumptions would you test first, and how?
# 2. Causal attention is credited with half the FLOPs. Should a causal kernel that computes the
#    masked half anyway be credited with the full count? What does each convention reward?
# 3. The intensity N / elem does not depend on D. What would make D = 128 behave differently from
#    D = 64 on a real kernel, and where would that show on the roofline?
# 4. `fl.check` poisons the output and draws fresh inputs every call. Describe a kernel bug that
#    could still pass it.

# %% [markdown]
# **Instructor's answer.** *1.* The clock. 989 TFLOP/s is 132 SMs × 4 096 FLOP at 1.83 GHz; the
# measured 730 TFLOP/s (the best of six timings, two sizes three times each; another run that day
# read 763, and single timings went as low as 676) is that count at about 1.35 GHz. Log the SM
# clock and power while the 8192³ product runs
# (`nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv -lms 100`): if the clock sags under
# the power cap, the clock assumption fails; if it holds, the issue rate does (the instructions
# and tiles the library picks), which other sizes or another library test.

# %% [markdown]
# **Instructor's answer.** *2.* Half the count credits only useful work: a kernel that computes the
# masked half shows half the TFLOP/s of one that skips it, so it rewards doing less, which users
# want. The full count measures how busy the hardware is and rewards computing what is thrown
# away: such a kernel looks as fast as a non-causal one while taking twice the time it needs.
# Quote the time too, and name the count (PyTorch's counter, above, credits the full one).

# %% [markdown]
# **Instructor's answer.** *3.* Everything the least-traffic count leaves out. Registers and shared
# memory per tile grow with D, so an SM holds fewer warps (stage 05: 12 at D = 64, 8 at D = 128);
# the exponentials, one per score, weigh half as much next to 4·N²·D FLOPs at D = 128; and K and V
# are re-read per query tile, so real traffic depends on tile sizes, which D constrains. On the
# roofline both points sit at the same intensity; these effects show as different heights.

# %% [markdown]
# **Instructor's answer.** *4.* A kernel that never subtracts the row max passes: `randn` inputs
# give scores of order 1, far from `exp`'s overflow at 88.7, yet it returns NaN for a sharply
# peaked head such as section 2's scores × 40. Others: a 32-bit index that overflows only for
# tensors of 2³¹ elements or more; a race whose window the tested shapes rarely open; a bug at a
# head dim or an N the check does not run.

# %% [markdown]
# ## Summary
#
# - Three measured ceilings bound every kernel: the fp32 CUDA-core matmul, the fp16 tensor-core
#   matmul (over ten times faster) and the HBM bandwidth; peak over bandwidth is the ridge point.
# - Attention does 4·B·H·N²·D FLOPs (half when causal) on at least 4·B·H·N·D·elem bytes:
#   N / elem FLOP per byte, compute bound only if S and P never reach HBM.
# - The online softmax keeps a running maximum m and sum l and rescales by α = e<sup>m − m′</sup>:
#   exact up to rounding, it reads each key and value once.
# - PyTorch's attention sits below its roofs on the roofline and the ladder, where every stage
#   adds a point and a bar.
# - A stage is a plain `.cu` behind three C functions, checked against float64 on fresh
#   NaN-poisoned outputs, and timed as the median of at least 20 runs with L2 flushed.
