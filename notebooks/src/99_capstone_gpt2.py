# %% [markdown]
# # Capstone — your kernel inside GPT-2
#
# Every stage so far was timed alone, on random contiguous q, k and v. A model calls attention
# differently: twelve times per forward pass, between the matrix multiplies that make its inputs
# and use its output, on **views** of a projection rather than tensors of their own, with a causal
# mask and its own scale. This notebook runs the stages as the attention of a GPT-2 built from its
# configuration, checks the model's logits against PyTorch's attention and asks what a faster
# attention kernel buys a whole model.
#
# ## Objectives
# After this notebook you can:
# - run a flashlab stage as a transformers attention implementation, with SDPA's signature
# - explain the memory layout a model hands to attention, and why a kernel that reads row strides
#   needs no copy of it
# - judge a kernel inside a model by its logits, against the difference PyTorch's own two
#   attentions show
# - predict from FLOPs and measured rates how much of a forward pass attention is, and read the
#   answer off a profile of the pass
#
# **Prerequisites:** notebooks 05–08 (the kernels this one runs on any recent GPU; on a Hopper GPU
# it runs stages 09–13 too); notebook 00's timing method and roofline.
#
# **Time:** about 23 min to read, 40 min to work through.

# %%
# %matplotlib inline
import torch
from IPython.display import display

import flashlab as fl
from flashlab import diagrams, model, plots
from flashlab import notebook as nb
# the last forward stage that reads a model's layout on any GPU from compute capability 8.0 (the
# Hopper stages after it need one GPU family)
LAST = [st for st in fl.stages() if st.row_strides and st.fast and not st.arch_specific][-1].slug
NEWEST = [st for st in fl.stages() if st.fast][-1].slug  # the fastest forward, where this GPU runs it
nb.banner(LAST)

# %% [markdown]
# ## 1 · Attention as a model calls it
#
# GPT-2 computes q, k and v for all heads with one matrix multiply, `c_attn`: each token's
# hidden vector (768 numbers) becomes 3 × 768 numbers, q for 12 heads of 64, then k, then v. The
# attention layer then *views* that output as three (B, H, N, D) tensors: a split, a reshape and a
# transpose, none of which moves data. In memory, consecutive rows of one head are a whole
# projection row apart, 3 · 12 · 64 = 2 304 elements, not 64:

# %%
diagrams.projection_layout()

# %%
B, N, H, D = 8, 1024, 12, 64
x = torch.empty(B, N, 3 * H * D, dtype=torch.float16)  # c_attn's output (no GPU needed)
q, k, v = (t.view(B, N, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
print(f"q: shape {tuple(q.shape)}, strides {q.stride()}, contiguous: {q.is_contiguous()}")
print(f"k starts {(k.data_ptr() - q.data_ptr()) // 2} elements after q: the same rows, later columns")

# %% [markdown]
# ## 2 · What the kernel reads
#
# Stages 01–04 index their inputs as contiguous (B, H, N, D): row `n` of head `bh` at
# `(bh · N + n) · D`. Handed these views, they would read the wrong numbers, so flashlab refuses
# them, and the adapter below copies each one first: three copies per layer. From stage 05 on,
# the kernels take the strides with the pointers (`FlashlabLayout` in `kernels/flashlab.h`: batch,
# head and row strides of q, k, v and the output) and do the indexing themselves. This is the
# whole change, in stage 08:

# %%
nb.show_lines(LAST, r"This block's \(batch, head\)", r"const int last_key")

# %% [markdown]
# The loads then step by the row stride instead of `D` (`src + row · ld + c`), and the output is
# written the same way, straight into the (B, N, H, D) tensor that the model's next matrix
# multiply reads. Two rules keep it safe, and flashlab checks both before any kernel runs: every
# row starts on a 16-byte boundary (the kernels move 16 bytes per instruction), and every
# element lies fewer than 2³¹ elements past its pointer (the kernels index in 32-bit integers,
# which costs fewer registers than 64-bit ones: stage 08 has none to spare).

# %%
for slug in ("04_wmma", LAST):
    st = fl.stage(slug)
    print(f"{slug}: " + (fl.inputs.layout_problem(slug, "q", q, st.row_strides) or
                         "reads q in place"))

# %% [markdown]
# `fl.check` checks every stage with row strides on this layout too: q, k and v sliced from one
# packed (B, N, 3, H, D) tensor, the output written into a (B, N, H, D) one, with B and H above 1
# so that a kernel that mixed up the batch, head or row stride would read other rows and fail.
#
# ## 3 · A stage as transformers' attention
#
# transformers lets a model's attention be any function with its attention interface's
# signature. `flashlab.model` wraps a stage in SDPA's signature, refuses what a flashlab kernel
# cannot compute (masks other than causal, dropout, grouped heads, a key/value cache) with a
# `ValueError`, and registers it:
#
# ```python
# name = model.register("08_tuned")                    # "fl_08_tuned"
# gpt2 = model.gpt2(attn_implementation=name).cuda().half()
# ```
#
# `model.gpt2` builds GPT-2 small's architecture (12 layers, 12 heads of 64) from its
# configuration with random weights: nothing is downloaded, and logits of random weights test
# attention as well as trained ones. `model.measure` runs the same tokens through the same
# weights with SDPA (PyTorch's fused attention, the model's default), eager (PyTorch's
# attention written as matrix multiplies and a softmax) and each stage.

# %% [markdown]
# ## Prediction
#
# **Logits.** Two correct attentions in fp16 differ by rounding, and the model amplifies it through
# twelve layers. The reference for "correct" is how far eager's logits are from SDPA's: a stage
# passes if its difference is at most twice that (the FlashAttention tests' rule, applied to the
# whole model). bf16 keeps 8 bits of mantissa to fp16's 11, so its differences should be about
# 2³ = 8 times larger.
#
# **Time.** Count the FLOPs of one forward pass of 8 sequences of 1 024 tokens, and place each
# part at a rate recorded earlier: the matrix multiplies at the measured fp16 ceiling, attention
# at the rate each kernel reached at the nearest sweep point (D = 64, causal, N = 1 024).

# %%
f = model.flops(n_layer=12, n_embd=H * D, seq=N, batch=B)
total = sum(f.values())
print(", ".join(f"{k} {v / 1e12:.3f} TFLOP ({v / total:.1%})" for k, v in f.items()))
gpu, cc, sms, roof = nb.the_gpu()
ceiling = roof["matmul_fp16_tflops"]
rest_ms = (f["matmuls"] + f["lm_head"]) / (ceiling * 1e12) * 1e3
rates = fl.tables.sweep_at(N, D, True, gpu=gpu)
names = [s for s in dict.fromkeys(("sdpa_flash", "sdpa_cudnn", "04_wmma", LAST, NEWEST)) if s in rates]
att_ms = {s: f["attention"] / (rates[s] * 1e12) * 1e3 for s in names}
print(f"the matrix multiplies at the {ceiling:.0f} TFLOP/s ceiling: at least {rest_ms:.2f} ms")
for s in names:
    print(f"  attention as {s:12} ({rates[s]:5.0f} TFLOP/s in the sweep): {att_ms[s]:.2f} ms, "
          f"{att_ms[s] / (att_ms[s] + rest_ms):.1%} of the pass")
copy_gb = 3 * 12 * 2 * B * N * H * D * 2 / 1e9  # stage 04: q, k, v copied in 12 layers, read + written
print(f"stage 04's copies: {copy_gb:.2f} GB moved, {copy_gb / roof['copy_tbps']:.2f} ms at the "
      f"{roof['copy_tbps']:.1f} TB/s copy rate")

# %% [markdown]
# **Prediction:** attention is 7 % of the forward pass's FLOPs. With the matrix multiplies at the
# ceiling it is 15–21 % of the pass's time for SDPA's two backends, 18 % for stage 08, 14 % for
# stage 13 and 38 % for stage 04, whose copies add 0.3 ms more. So stage 08 should land within a few
# percent of SDPA, stage 13 within one percent, and stage 04 a third slower. The logits of every
# stage fall within twice eager's difference, about 8 times larger in bf16.

# %% [markdown]
# ## Measurement

# %%
rows = nb.in_a_model()  # live: GPT-2 with each attention, recorded in data/model.csv
display(rows[["impl", "dtype", "max_abs_diff", "within_rule", "input_copies", "forward_ms",
              "busy_gpu_ms", "attention_gpu_ms", "gpu_vs_sdpa"]].round(4))
print("SDPA's attention kernels:", ", ".join(
    rows.loc[rows["impl"] == "sdpa", "attention_kernels"].dropna().unique()) or "not recorded")

# %%
plots.model_forward(rows)

# %% [markdown]
# The bars are the time the GPU spent inside kernels in one profiled pass (`torch.profiler`), by
# kind of kernel. The dot is not kernel time: it is the pass's elapsed time, from a CUDA event
# recorded before the pass to one after it (`bench.time_fn`: warmed, median of 20 passes), kernels
# and the gaps between them.
#
# ### Discussion
#
# **The logits held.** In fp16 eager's logits differ from SDPA's by 0.0049 at most, and every stage
# lands at 0.0049–0.0059: not twice eager's difference but about once, the rounding of two correct
# attentions. In bf16 eager is 0.043 away and the stages 0.035–0.041, about 8.8 times the fp16
# figures, as the 2³ from the mantissa widths said. The check on random tensors carried over to a
# model that feeds each layer's output into the next.
#
# **The time prediction missed, and in the good direction for the lesson.** It assumed the matrix
# multiplies run at the 750 TFLOP/s ceiling, 2.70 ms, and found attention 14–38 % of the pass. The
# profile says otherwise. In fp16 the GPU was busy 14.6 ms with SDPA: matrix multiplies 9.5 ms (2.0
# TFLOP at about 210 TFLOP/s, 28 % of the ceiling: GPT-2's matrices are only 768 wide, and its
# Conv1D layers add a bias in the same call), 4.5 ms of small kernels the FLOP count leaves out
# (layer norms, GELU, residual adds, each a pass over the activations), and attention 0.56 ms: 3.8 %
# of the GPU's time. With so little at stake:
# - stages 07 and 08 (0.81 and 0.78 ms of attention) cost the pass 1.5–1.8 % of GPU time against
#   SDPA, and stages 05 and 06 (1.0 ms) 3 %;
# - the Hopper stages take attention from 0.60 ms (stage 09) to 0.56 ms (stage 13), with stage 11
#   (0.61 ms) behind stage 10 (0.59 ms), as in the sweep at D = 64, and the pass from 0.2–0.4 %
#   over SDPA's GPU time (stages 09–11) to level: stage 13's 14.64 ms against SDPA's 14.64 (13.83
#   against 13.85 in bf16). Its attention is level with cuDNN's in fp16 (0.559 against 0.562 ms)
#   and 3 % shorter in bf16 (0.539 against 0.557); the other kernels of the pass vary by as much or
#   more from one pass to the next (the matrix multiplies took 9.52–9.54 ms);
# - stage 04 costs 16 % (19 % in bf16): 2.0 ms of attention and 1.0 ms more of "other", its 36
#   copies. The copies took three times the predicted 0.30 ms: they gather 128-byte rows 4.6 KB
#   apart, not one stream, and reached about 0.9 TB/s of the 3.0 the copy test gets;
# - eager's matrix multiplies and softmax cost 72–76 %: it writes all 12 × 96 score matrices.
#
# SDPA chose cuDNN here (its kernel is named above: `…sm90_flash_fprop_wgmma_f16`), the backend
# that led the sweep at this point among SDPA's, with Hopper's `wgmma` instructions. Stages 09–13
# use them too; at this sweep point stage 13 reached 1.09 of cuDNN's rate (360 against 331 TFLOP/s).
#
# **The elapsed time is not the kernels' time.** The dots sit 0.6–3.9 ms to the right of the bars
# and move between stages by more than any stage's whole attention: in fp16 stage 07's pass took
# 18.7 ms elapsed and stage 08's 16.3, each with 14.9 ms of kernels. The difference is the GPU
# waiting for Python to launch the next kernel, which varies from pass to pass; the timer's notes
# in `data/model.csv` say the GPU waited for the host in every timing. A kernel's effect on a model
# is measured in its kernels' time (the profile), or after removing the launches (CUDA graphs), not
# by timing passes of a few milliseconds.

# %% [markdown]
# ## The profile: one attention call, alone
#
# The pass's profile says how long attention's kernels ran; timing one attention call at the
# model's shape (B = 8, H = 12, N = 1 024, D = 64, causal) separates the kernel from its layout
# and from the Python around it. Each stage and SDPA, in the model's layout and contiguous:

# %%
alone = nb.attention_alone()
display(alone[alone["dtype"] == "fp16"].round(1).reset_index(drop=True))

# %% [markdown]
# ### Discussion
#
# **Reading strided rows costs nothing measurable.** In the model's layout stage 08's kernel took
# 63.9 µs, contiguous 64.4 µs; stages 05–13 differ by about 2 % at most, either way, as does cuDNN,
# which also reads the views directly (the TMA of stages 10–13 takes the row stride in its tensor
# map). Each 16-byte load fetches a row segment of a K or V tile whichever way the rows are spaced,
# and the tiles are read once per query tile from L2, so the spacing only changes addresses. Stage
# 04 pays 60 µs per call for its three copies, 37 % on top of its 163 µs kernel.
#
# **The model's shape is not the sweep's.** Stage 08 reached 201 TFLOP/s here against 254 at the
# sweep point with the same N, D and mask; cuDNN 284 against 331. The sweep runs B·H = 512 heads of
# 1 024 tokens, the model 96: stage 08's 768 blocks of 128 query rows fill the H100's 132 SMs about
# three times over, so the last, unevenly long causal blocks leave SMs idle for a larger share of
# the call. Stage 13's persistent grid, 264 blocks (two an SM) that claim 768 items of 128 rows
# longest first, loses almost as much as stage 08 (292 against 360 TFLOP/s, 19 % where stage 08
# loses 21 %) and more than cuDNN (14 %): the last items still end unevenly, and each block pays its
# start once per call. It is still the fastest here, 1.03 of cuDNN's rate, where the sweep point
# said 1.09. Rates measured on one shape predict another only as far as the grid fills the GPU
# alike.
#
# **The timer hides the Python call; it does not remove it.** Timed call after call (`wall_us`),
# stage 08 took 68 µs per call for 64 µs of kernel, stage 13 49 µs for 44 and cuDNN 50 µs for 45.
# `time_fn` queues the calls behind a short GPU sleep, so the GPU runs them back to back, and what
# shows is the kernel plus the 3–5 µs between two kernels. The host's own time per call is the last
# column (`host_us`: how long the Python call takes to return, its kernel queued): about 30 µs for
# SDPA, 24–68 µs for the stages, 36–39 µs for stage 13. That is checking the inputs (remembered per
# layout, so a model's repeated calls are checked in a few microseconds), allocating the output,
# and for stages 10–13 encoding three TMA tensor maps; stages 11–13 also zero the counter their
# persistent blocks claim items from. Against a 44 µs kernel the host keeps ahead, but only just:
# in the model those launches queue behind other work, and the GPU waits for them whenever Python
# falls behind, so the profile, not the elapsed time, decides between kernels.

# %% [markdown]
# ## Exercises
#
# These use a GPU with transformers installed (`pip install -e ".[model]"`); exercise 3's reasoning
# needs none.
#
# 1. **The copies.** Register stage 04 and run one forward pass: `adapter =
#    model.register.adapters[model.register("04_wmma")]`, then read `adapter.copies`. Explain the
#    number from the model's shape, and estimate their time from the copy rate printed above.
#    Check it against the profile's "other" time for stage 04 and SDPA.
# 2. **Shorter sequences.** Predict attention's share of the pass at N = 256 with the FLOP model
#    above, then measure: `model.measure(stages=[LAST], dtypes=["fp16"], seq=256,
#    record=False)`. Which part of the pass does not shrink with N?
# 3. **Break the strides on purpose.** In your copy of `kernels/05_mma.cu`, load K with `D` as its
#    row stride instead of `L.k.n`. Predict which cases of `fl.check(fl.stage("05").build())` fail
#    and which still pass, and why; then run it on a GPU. (Restore the line afterwards.)
# 4. **Remove the launches.** Capture one forward pass in a CUDA graph. Build the model on a stage
#    (`m = model.gpt2(model.register(NEWEST), n_layer=12).cuda().half()`, or `LAST` off Hopper),
#    run it three times on a side stream (`torch.cuda.Stream()`) to warm it, then, under
#    `torch.no_grad()`: `g = torch.cuda.CUDAGraph()` and `with torch.cuda.graph(g): logits =
#    m(tokens, use_cache=False).logits`. `g.replay()` runs the pass again on whatever
#    `tokens` holds, with no Python in between. Check the logits against an ordinary pass, time
#    `g.replay` with `fl.bench.time_fn` for the stage and for SDPA, and set both against the
#    elapsed and kernel times above. Which of a stage's host-side steps does a replay skip, and which
#    GPU-side step must the graph hold for stages 11–13 to hand out their items again?

# %% [markdown]
# ## Questions for discussion
#
# 1. A faster attention kernel changed this model's forward pass by a few percent. For which
#    models and inputs would the same kernel change it by half? Name two properties of the input.
# 2. A pass's elapsed time moved between stages by more than stage 08's attention takes in total.
#    What else runs in a forward pass besides the GPU's kernels, and how would you remove it?
# 3. Twice eager's difference is a rule for the logits of one model on one input. What would it
#    fail to catch, and what would you add before trusting a kernel for training?

# %% [markdown]
# **Instructor's answer.** *1.* Attention's FLOPs grow with N² and the rest with N, so its share
# grows with the sequence length: at N = 8 192 and the same width, attention is about as many
# FLOPs as the rest; and with a smaller model width d (attention is 4·N²·d, the matrix multiplies
# 24·N·d²), the ratio N/d decides. Long contexts and narrow models, then; and inference prefill
# rather than decoding one token, where attention reads a cache instead.

# %% [markdown]
# **Instructor's answer.** *2.* Python and the CPU: each layer launches a few dozen kernels, and
# the GPU waits whenever launching falls behind computing, so the elapsed time carries the CPU's
# noise. CUDA graphs (`torch.cuda.graphs`, or `torch.compile(mode="reduce-overhead")`) record the
# launches once and replay them; larger batches also hide launches behind longer kernels.

# %% [markdown]
# **Instructor's answer.** *3.* Errors that one input does not reach (a head dim, a sequence length
# or a batch shape not tried, N not a multiple of the tile), errors in the backward pass (these
# kernels have none), and slow drift that a single forward pass hides but training accumulates.
# Check each supported shape against float64 (as `fl.check` does), test gradients if there is a
# backward pass, and compare a short training run's loss curve.

# %% [markdown]
# ## Summary
#
# - A model hands attention views of one projection: rows 3·H·D elements apart. Stages 05 on read
#   those strides directly (`FlashlabLayout`) and write the output where the model reads it, so
#   nothing is copied; stages 01–04 need a copy of each input.
# - Inside GPT-2 every stage's logits stay within twice eager's difference from SDPA's, in fp16
#   and bf16: the check on random tensors carried over to a whole model.
# - Attention was 7 % of this forward pass's FLOPs and 4 % of its GPU time, so attention kernels up
#   to 4.3× apart moved the pass's GPU time by 0–19 %; stage 13 left it level with SDPA's. GPT-2's
#   narrow matrix multiplies, the small kernels around them and the CPU launching them decide the
#   rest.
# - Reading strided rows cost nothing measurable; a smaller grid than the sweep's cost stage 08 a
#   fifth of its rate (stage 13's persistent grid 19 %, cuDNN 14 %); copying the inputs cost stage
#   04 a third of its kernel time.
# - A call's own host time (30 µs for SDPA, 36–39 µs for stage 13) is close to the kernel's at a
#   model's shape: the GPU waits for Python whenever the launches fall behind.
