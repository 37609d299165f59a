# %% [markdown]
# # 05 · mma.sync and ldmatrix: the FlashAttention-2 split, all in registers
#
# Stage 04 moved the two matrix products onto the tensor cores through CUDA's WMMA API, and kept
# stage 03's FlashAttention-2 structure: a block owns 64 query rows, each of its 4 warps 16 of
# them, and walks every K/V tile. This stage keeps that structure too, and changes one thing:
# **it writes the tensor-core instructions in PTX, whose register layout is published, so that
# everything a warp computes stays in its registers.**
#
# The PTX ISA says exactly which lane of a warp holds which element of the matrices of
# `mma.sync.aligned.m16n8k16` (a 16 × 16 by 16 × 8 product) and of `ldmatrix` (the instruction
# that loads them from shared memory). With that map in hand:
#
# 1. the scores S = QKᵀ stay in registers, and the online softmax runs there: the 4 lanes that
#    hold a row agree on its max and sum with two shuffles;
# 2. the softmax's output P is, register for register, already the input layout of the next
#    product P V: it is rounded to 16 bits in place and never stored;
# 3. K and V come from shared memory with `ldmatrix` (V with its `.trans` variant), each row
#    padded by 16 bytes so that the loads are free of bank conflicts.
#
# Every picture and count before the measurement is computed from the PTX ISA's rules and the
# kernel's own indexing (`flashlab/fragments.py`), and needs no GPU.

# %%
%matplotlib inline
import math

import numpy as np
import pandas as pd
from IPython.display import display

import flashlab as fl
from flashlab import fragments as fr
from flashlab import notebook as nb
from flashlab import plots, tiling
nb.banner("05_mma")

# %%
here = nb.the_gpu()  # this GPU, or the one the recorded numbers come from
gpu, cc, sms, roof = here  # roof: the ceilings `flashlab run` measured on it
print(here)

# %% [markdown]
# ## 1 · What changes from stage 04
#
# WMMA (`nvcuda::wmma`, stage 04) hands a warp a 16 × 16 tile as an **opaque fragment**: each
# lane holds `frag.num_elements` values, but which elements they are is deliberately left
# unspecified, so that the same source runs on every architecture. A product is fine with that;
# a softmax is not. It needs each row's maximum and sum, and nothing tells a lane which row its
# values belong to. So stage 04 stores every tile of S to shared memory
# (`wmma::store_matrix_sync`), lets ordinary threads run the softmax on the rows there, and
# loads P back as a fragment for the second product: two trips through shared memory per tile,
# and the barriers that go with them.
#
# PTX has its own warp-level matrix instruction, `mma.sync`, and for it the ISA **publishes the
# layout** (section "Matrix Fragments for mma.m16n8k16 with floating point type"). That is all
# this stage needs. Its header says what follows from it:

# %%
nb.show_lines("05_mma", r"^// Stage 05", r"^#include")

# %% [markdown]
# The kernel does not use a C++ API for the tensor cores: `kernels/ptx.cuh` wraps each PTX
# instruction in one line of inline assembly, named after it. The multiply-accumulate, for fp16
# (the bf16 one differs only in the type names):

# %%
nb.show_source("ptx.cuh", "mma_m16n8k16")

# %% [markdown]
# `{%4, %5, %6, %7}` is A, 16 × 16, four 32-bit registers a lane, each two 16-bit values;
# `{%8, %9}` is B, 16 × 8, two registers; the accumulator C = D, 16 × 8 in fp32, is four floats a
# lane. The next sections draw which elements those are.
#
# ## 2 · The m16n8k16 fragments
#
# The ISA numbers lane `l` of a warp by its **groupID** `g = l / 4` (0..7) and its
# **threadID_in_group** `t = l % 4` (0..3). The 4 lanes sharing `g` are a **quad**. The rules
# (`fragments.py` writes them out once and derives every figure from them):
#
# * **A** (16 × 16, row-major): lane `l` holds rows `g` and `g + 8`, columns `2t, 2t + 1` and
#   `2t + 8, 2t + 9` — eight halves `a0..a7`, two to a register.
# * **B** (16 × 8, "col": stored column by column): lane `l` holds column `g`, rows
#   `2t, 2t + 1, 2t + 8, 2t + 9` — `b0..b3`, two registers.
# * **C, D** (16 × 8, fp32): lane `l` holds rows `g` and `g + 8`, columns `2t, 2t + 1` —
#   `c0..c3`, one float a register.
#
# Each cell below names the lane (`T`) that holds the element and its number in that lane;
# the colour is the lane.

# %%
fr.fragment_figure("A")

# %%
fr.fragment_figure("B")

# %%
fr.fragment_figure("C")

# %% [markdown]
# Two facts to keep from these pictures, because the whole kernel rests on them:
#
# * **A row of C lives in one quad.** Row `r` of the accumulator is spread over lanes
#   `4(r % 8) .. 4(r % 8) + 3`, two columns each per 16 × 8 tile (section 4).
# * **C's layout is A's, split in two.** The left 8 columns of A are laid out like one C tile,
#   the right 8 like another (section 5).
#
# A quick check of the rules, as numbers: a 16 × 16 matrix scattered into the lanes and
# gathered back, and one `mma` emulated on the fragments against a plain matrix product.

# %%
rng = np.random.default_rng(0)
A, B, C = (rng.standard_normal(shape) for shape in ((16, 16), (16, 8), (16, 8)))
a, b, c = fr.to_fragment(A, "A"), fr.to_fragment(B, "B"), fr.to_fragment(C, "C")
print(f"fragments a lane holds: A {a.shape[1]} halves, B {b.shape[1]} halves, C {c.shape[1]} floats")
print("lane 5 holds A elements (row, col):", list(zip(*(x[5].tolist() for x in fr.coords("A")))))
out = fr.mma(a, b, c)
print("mma on the fragments == A @ B + C:",
      np.allclose(fr.from_fragment(out, "C"), A @ B + C, atol=1e-5))

# %% [markdown]
# ## 3 · ldmatrix: from shared memory straight into the fragments
#
# A fragment could be filled with ordinary loads, one or two halves at a time, following the
# map above. `ldmatrix.sync.aligned.m8n8.x4.shared.b16` does it in one instruction: it reads
# **four 8 × 8 matrices** of 16-bit values, each of whose 8 rows is 16 contiguous bytes
# somewhere in shared memory. Lanes `8m .. 8m + 7` supply the addresses of matrix `m`'s rows,
# and lane `l` receives row `l / 4`, elements `2(l % 4)` and `2(l % 4) + 1` of every matrix, one
# register per matrix. Matrix by matrix, that is exactly one register of an A fragment:

# %%
fr.ldmatrix_figure(trans=False)

# %% [markdown]
# The kernel calls it three times, once for each operand. Q is read once, before the loop over
# K/V tiles, into `qf[kk]`, one A fragment per 16 columns (k-step `kk`) of the head dimension:

# %%
nb.show_lines("05_mma", r"uint32_t qf\[KD\]\[4\];", r"ldmatrix_x4\(qf")

# %% [markdown]
# **K.** The first product is S = Q Kᵀ, so its B operand is Kᵀ: B's column `n` is key `n`, that
# is a row of K as shared memory stores it (`Ks[key][d]`). B is wanted column by column ("col"),
# and a column of Kᵀ is a row of K: a plain `ldmatrix` of K's rows is the B fragment. The kernel
# reads **8 keys × 32 dims** per `ldmatrix.x4`: matrices 0..3 are dims 0–7, 8–15, 16–23, 24–31
# of the same 8 keys, so registers `b[0], b[1]` are the B fragment of k-step `kk` and
# `b[2], b[3]` that of k-step `kk + 1`:

# %%
nb.show_lines("05_mma", r"float s\[NS\]\[4\] = \{\};", r"qf\[kk \+ 1\], b\[2\]")

# %% [markdown]
# **V.** The second product is O = P V. Now B is V itself, 16 keys × 8 dims, and its columns are
# columns of V: 16 values a row stride apart in shared memory. `ldmatrix` reads rows, so the kernel
# asks for `.trans`: each 8 × 8 matrix is transposed on the way, and a quad receives a column
# where it would have received a row. Lanes 0–15 point at 16 consecutive keys, lanes 16–31 at the
# same keys 8 dims further, so one `ldmatrix.x4.trans` fills the B fragments of two 8-dim
# tiles of O:

# %%
fr.ldmatrix_figure(trans=True)

# %%
nb.show_lines("05_mma", r"for \(int d = 0; d < NO; d \+= 2\)", r"o\[d \+ 1\], a, b\[2\]")

# %% [markdown]
# Where each lane points, for the kernel's three calls at loop index 0
# (`fragments.KERNEL_LDMATRIX` holds the three address rules; `tests/test_fragments.py` reads
# them out of `kernels/05_mma.cu` and checks them lane by lane):

# %%
lanes = [0, 1, 7, 8, 15, 16, 23, 24, 31]
loops = {"Q": dict(kk=0), "K": dict(n=0, kk=0), "V": dict(ks=0, d=0)}  # the kernel's loop variables
where = {}
for op, (addresses, trans) in fr.KERNEL_LDMATRIX.items():
    rows, cols = addresses(**loops[op])
    where[f"{op}{' (.trans)' if trans else ''}: (row, col)"] = [
        f"({rows[l]}, {cols[l]})" for l in lanes]
pd.DataFrame(where, index=pd.Index(lanes, name="lane"))

# %% [markdown]
# And the loads do what the text claims, on a random 64 × 64 tile: K's `ldmatrix` gives the B
# fragments of Kᵀ, V's `.trans` those of V, and V *without* `.trans` would not.

# %%
Kt, Vt = (rng.standard_normal((64, 64)).astype(np.float16) for _ in range(2))
n, kk = 1, 2   # keys 8..15, k-steps 2 and 3 (dims 32..63)
bk = fr.ldmatrix(Kt, *fr.k_addresses(n, kk))
print("K: b[0..1] = B of k-step 2, b[2..3] = k-step 3:",
      (bk[:, :4] == fr.to_fragment(Kt[8:16, 32:48].T, "B")).all()
      and (bk[:, 4:] == fr.to_fragment(Kt[8:16, 48:64].T, "B")).all())
ks, d = 1, 2   # keys 16..31, O tiles 2 and 3 (dims 16..31)
bv = fr.ldmatrix(Vt, *fr.v_addresses(ks, d), trans=True)
print("V with .trans: B of O tiles 2 and 3:",
      (bv[:, :4] == fr.to_fragment(Vt[16:32, 16:24], "B")).all()
      and (bv[:, 4:] == fr.to_fragment(Vt[16:32, 24:32], "B")).all())
plain = fr.ldmatrix(Vt, *fr.v_addresses(ks, d))
print(f"V without .trans: {(plain[:, :4] == fr.to_fragment(Vt[16:32, 16:24], 'B')).mean():.0%} "
      "of the B elements right")

# %% [markdown]
# ## 4 · The quad: a row's max and sum in two shuffles
#
# After `S = Q Kᵀ` a warp holds its 16 × 64 scores as 8 accumulator tiles of 16 × 8. By the C
# rule, lane `l` holds columns `2t, 2t + 1` of rows `g` and `g + 8` in *every* tile: 16 of the 64
# scores of two rows. The other 48 of each row are in the three other lanes of its quad. A lane
# first reduces its own 16 (no communication), then `__shfl_xor_sync` with mask 1 swaps with the
# neighbour (`t` ↔ `t ^ 1`) and mask 2 with the other pair: after two steps all four lanes have
# the whole row's max. The sum works the same way (the kernel adds up its per-lane sums once,
# after the last tile).

# %%
fr.quad_figure()

# %%
nb.show_lines("05_mma", r"for \(int n = 0; n < NS; n\+\+\) mx = fmaxf", r"mx, 2\)\);")

# %% [markdown]
# Stage 03 needed 4 shuffle steps for a row spread over 16 lanes, stage 02 five for a whole warp.
# Here it is two, and no shared memory and no barrier. The same in numpy, on the fragments:

# %%
S = rng.standard_normal((16, 64)).astype(np.float32)
s = np.stack([fr.to_fragment(S[:, 8 * j:8 * j + 8], "C") for j in range(8)])  # (tile, lane, c)
own = np.stack([s[..., :2].max((0, 2)), s[..., 2:].max((0, 2))], 1)   # rows g, g + 8, per lane
row_max = fr.quad_reduce(own)
print("every lane's result == numpy's row max:",
      (row_max[:, 0] == S.max(1)[np.arange(32) // 4]).all()
      and (row_max[:, 1] == S.max(1)[np.arange(32) // 4 + 8]).all())

# %% [markdown]
# ## 5 · The re-pack: P never touches shared memory
#
# The second product needs P (16 query rows × 16 keys per k-step) as an **A** fragment. The
# softmax left it in two **C** fragments, keys `16ks .. 16ks + 7` and `16ks + 8 .. 16ks + 15`.
# Compare the rules: A's `a0..a3` are rows `g`, `g + 8` at columns `2t, 2t + 1` — C's
# `c0..c3` of the left tile; `a4..a7` are the same positions 8 columns right — `c0..c3` of the
# right tile. **The same lane holds the same element in both roles**, so the re-pack is a
# conversion, two floats into one f16x2 register (`pack2`), with no data moving between lanes:

# %%
nb.show_lines("05_mma", r"const uint32_t a\[4\] = \{pack2", r"\};")

# %% [markdown]
# `fragments.repack_map()` derives this from the two layouts for all 256 elements of a 16 × 16
# block of P (and asserts it): for each element, the lane and element that hold it as A, and
# the tile, lane and element that hold it as C. Lane 5's eight:

# %%
rm = fr.repack_map()
print(f"{len(rm)} elements, every one in the same lane as A and as C: {(rm.a_lane == rm.c_lane).all()}")
rm[rm.a_lane == 5]

# %%
P = rng.standard_normal((16, 16)).astype(np.float32)
packed = fr.repack(fr.to_fragment(P[:, :8], "C"), fr.to_fragment(P[:, 8:], "C"), np.float32)
print("re-packed C fragments == P's A fragment:", (packed == fr.to_fragment(P, "A")).all())

# %% [markdown]
# In stage 04 every tile's S goes out to shared memory and P comes back from it, with the
# synchronisation around them. Here: no shared memory for S or P at all.
#
# ## 6 · One warp, one K/V tile, in numpy
#
# `fragments.warp_tile` is the kernel's loop body for one warp, written with the kernel's loops,
# loop variables and `ldmatrix` addresses and nothing else: `ldmatrix` and `mma` emulated on
# (32, registers) arrays, the softmax by quad shuffles, P re-packed. It takes a warp's 16 query
# rows and one K/V tile as shared memory holds them. Against plain numpy, `softmax(Q Kᵀ / √D) V`:

# %%
D, BR, BC = 64, 64, 64  # the teaching config's head dim; the kernel's tile sizes
q, k, v = (rng.standard_normal((rows, D)) for rows in (16, BC, BC))


def attention(q, k, v):
    s = q.astype(np.float64) @ k.T.astype(np.float64) / math.sqrt(q.shape[1])
    p = np.exp(s - s.max(1, keepdims=True))
    return p @ v / p.sum(1, keepdims=True)


exact = fr.warp_tile(q, k, v, half=np.float32)  # 32-bit operands: the layouts alone
print(f"32-bit operands: max |error| {np.abs(exact.o - attention(q, k, v)).max():.1e}")
h = [x.astype(np.float16) for x in (q, k, v)]
tile = fr.warp_tile(*h)                          # fp16 in, fp32 accumulate, P rounded to fp16
print(f"fp16 operands:   max |error| {np.abs(tile.o - attention(*h)).max():.1e} "
      f"(P rounded to fp16 before P V)")

# %% [markdown]
# What one warp does per K/V tile, step by step, and what stays in its registers (counts per
# lane; a register is 32 bits). All of it follows from `D` and the tile sizes:

# %%
KD, NS, KS, NO = D // 16, BC // 8, BC // 16, D // 8  # the kernel's constants
cost = fr.tile_cost(D, BR, BC)
steps = pd.DataFrame([
    ("Q → A fragments (once, before the loop)", f"{KD} ldmatrix.x4", f"qf[{KD}][4]: {KD * 4}"),
    ("S = Q Kᵀ", f"{NS * KD // 2} ldmatrix.x4, {NS * KD} mma", f"s[{NS}][4] floats: {NS * 4}"),
    ("softmax: row max, exp, row sum", "4 shuffles (2 per row, for the max)", "m[2], l[2]: 4"),
    ("P: C → A, rounded to 16 bits", f"{KS * 4} pack2 (cvt)", f"a[4] per k-step: {KS * 4} in all"),
    ("O += P V", f"{KS * NO // 2} ldmatrix.x4.trans, {KS * NO} mma", f"o[{NO}][4] floats: {NO * 4}"),
], columns=["step", "instructions per warp", "registers per lane"]).set_index("step")
print(f"per warp per tile: {cost.mma} mma.sync, {cost.ldmatrix} ldmatrix.x4 (+ {KD} for Q once); "
      f"registers that live across tiles: {KD * 4 + NO * 4 + 4} (Q, O, m, l)")
steps

# %% [markdown]
# ## 7 · Shared-memory banks: why stage 05 pads
#
# Shared memory serves a request in **wavefronts** of at most 128 bytes, one 4-byte word per
# bank (32 banks) per wavefront. `ldmatrix.x4` is served one 8 × 8 matrix at a time: 8 lanes'
# rows of 16 bytes, 128 bytes that fit one wavefront **if the 8 rows start in different banks**.
# At D = 64 a K row is 64 halves, 128 bytes: unpadded, every row starts in bank 0, the 8 rows of
# a matrix collide in the same 4 banks and the load takes 8 wavefronts per matrix — 8-way
# conflicted. The kernel stores rows `LD = D + 8` halves apart: 16 bytes more, so row `r` starts
# `4r` banks further and the 8 rows cover all 32 banks. Red: the 8 rows one phase reads.

# %%
fr.bank_map(2 * D)

# %%
fr.bank_map(2 * D + 16)

# %% [markdown]
# What that costs per K/V tile and block, counted from the kernel's addresses (`tile_cost`:
# each `ldmatrix` through the bank model, plus the 16-byte stores that copy K and V in, which
# are conflict-free either way). An SM serves one wavefront per clock, so FLOPs per wavefront
# times SMs times the clock is the most shared memory lets the kernel do; the clock is the
# H100/H200 SXM boost clock used in notebooks 02 and 03 (put your GPU's here).

# %%
clock_ghz = 1.98  # boost clock of an H100 or H200 SXM, as in notebooks 02 and 03
per_s = sms * clock_ghz * 1e9  # SM-clocks per second, whole GPU
layouts = {"unpadded (128-byte rows at D = 64)": dict(pad_bytes=0),
           "+16 bytes a row (stage 05)": dict(pad_bytes=16)}
rows = []
for label, how in layouts.items():
    for d_ in (64, 128):
        c_ = fr.tile_cost(d_, BR, BC, **how)
        rows.append(dict(layout=label, D=d_,
                         ways=fr.ldmatrix_wavefronts(2 * d_ + how["pad_bytes"]).ways,
                         ldmatrix_wavefronts=c_.ldmatrix_wavefronts, copy_wavefronts=c_.store_wavefronts,
                         flop_per_wavefront=c_.flops / c_.wavefronts,
                         cap_tflops=c_.flops / c_.wavefronts * per_s / 1e12))
banks = pd.DataFrame(rows).set_index(["layout", "D"])
tc = roof["matmul_fp16_tflops"]
banks["cap_pct_of_fp16_ceiling"] = 100 * banks["cap_tflops"] / tc
banks.round(1)

# %%
cap = banks["cap_tflops"].xs(64, level="D")
print(f"Unpadded, shared memory alone would cap stage 05 at {cap.iloc[0]:.0f} TFLOP/s, "
      f"{100 * cap.iloc[0] / tc:.0f}% of the measured fp16 matmul ceiling ({tc:.0f} TFLOP/s); "
      f"padded, at {cap.iloc[1]:.0f} TFLOP/s ({100 * cap.iloc[1] / tc:.0f}%).")

# %% [markdown]
# The cap is the same at D = 128: twice the FLOPs, twice the loads. The padding costs
# `(BR + 2 BC) × 16` bytes of shared memory per block and nothing else. Stage 06 gets the same
# conflict-free loads without it, by permuting where each 16-byte chunk of a row goes (an XOR
# swizzle, section 14).
#
# ## 8 · Prediction, before measuring
#
# Per K/V tile, a block of 4 warps asks its SM for (D = 64, BR = BC = 64, fp16):
#
# * **tensor cores**: 4 · BR · BC · D FLOPs, 256 `mma.sync`. Their rate per SM and clock is taken
#   from the measured fp16 matmul ceiling (cuBLAS), spread over the SMs at the boost clock.
# * **shared memory**: the padded `ldmatrix` wavefronts and the K, V copies (section 7), one
#   wavefront per clock.
# * **instruction issue**: 4 warp-instructions per clock per SM. The `mma` and `ldmatrix` counts
#   are exact (the loops are unrolled); the softmax and copies are estimated from the source, in
#   the table below.
# * **MUFU**: one `ex2` per score; the special-function units do 16 per clock per SM.
# * **global memory**: 2 · BC · D · 2 bytes of K and V. The 16 query tiles of a head run side by
#   side (the query tile varies fastest in the block index), so one of them brings a K/V tile from DRAM and the L2
#   serves the other 15: DRAM sees 1/16 of it.

# %%
warps = BR // 16
lane_scores = 16 * BC // 32   # scores a lane holds per tile
copies = 2 * BC * D * 2 // (16 * 32 * warps)  # 16-byte global loads per thread per tile, K and V
issue = pd.Series({
    "mma.sync (exact)": cost.mma,
    "ldmatrix.x4 (exact)": cost.ldmatrix,
    "softmax: scale, max, subtract, ex2, sum, per score (≈ 5)": 5 * lane_scores,
    "rescale O, pack P": 4 * NO + 4 * KS,
    "copy K and V: load, store, address (≈ 3 per 16 bytes)": 3 * copies,
    "shuffles, row bookkeeping, loop, barriers (≈)": 30,
}, name="warp-instructions per warp per tile")
issue

# %%
tc_rate = tc * 1e12 / per_s                       # FLOP per clock per SM at the measured ceiling
dram_rate = roof["copy_tbps"] * 1e12 / per_s      # bytes per clock per SM at the copy bandwidth
q_tiles = fl.TEACHING.N // BR                     # blocks that read each K/V tile
limits = pd.Series({
    "tensor cores (measured fp16 matmul ceiling)": cost.flops / tc_rate,
    "shared memory (padded, 1 wavefront per clock)": cost.wavefronts,
    "instruction issue (4 per clock, estimate)": warps * issue.sum() / 4,
    "MUFU ex2 (16 per clock)": BR * BC / 16,
    "DRAM: each K/V tile once per head": cost.global_bytes / q_tiles / dram_rate,
}, name="SM clocks per K/V tile per block")
binding = limits.idxmax()
bound = cost.flops / limits.max() * per_s / 1e12  # TFLOP/s if that limit were all
limits.round(0)

# %% [markdown]
# The largest entry is the bound; the others run at the same time on other units. Two things
# push the kernel below it, and the band below spans them as notebook 03's did: **latency** —
# loads are synchronous, so a block waits for each K/V tile with nothing of its own to do, and
# two barriers per tile stop all 4 warps; only the other blocks on the SM fill the gap — and the
# **tail**: the launch bounds ask for room for 3 blocks per SM at D = 64 (`Tiles::MIN_BLOCKS`,
# checked against `ptxas` in section 13), and the last wave runs part-full. One more reason to
# expect the lower half: `mma.sync` is Ampere's instruction; on Hopper only `wgmma`, which cuBLAS
# uses, reaches the full tensor-core rate that the measured ceiling reflects.

# %%
blocks_per_sm = 3  # Tiles<64, 64, 64>::MIN_BLOCKS, the __launch_bounds__ of the D = 64 kernel
blocks = fl.TEACHING.B * fl.TEACHING.H * math.ceil(fl.TEACHING.N / BR)
waves = blocks / (blocks_per_sm * sms)
tail = waves / math.ceil(waves)
pred05 = [0.5 * bound * tail, bound * tail]
table16 = nb.compare("fp16").set_index("stage")
flash = table16["tflops"].get("sdpa_flash", float("nan"))  # timed by `flashlab run`
need_l2 = cost.global_bytes * per_s / limits.max() / 1e12
second = limits.drop(binding).idxmax()
print(f"binding: {binding}, {limits.max():.0f} clocks per tile -> at most {bound:.0f} TFLOP/s "
      f"({100 * bound / tc:.0f}% of the fp16 matmul ceiling); next: {second}, "
      f"{limits[second]:.0f} clocks")
print(f"{blocks} blocks on {sms} SMs x {blocks_per_sm} = {waves:.2f} waves (tail: x{tail:.2f})")
print(f"predicted: stage 05 at {pred05[0]:.0f} - {pred05[1]:.0f} TFLOP/s (fp16, teaching config), "
      f"{pred05[0] / flash:.2f} - {pred05[1] / flash:.2f}x sdpa_flash's recorded {flash:.0f}")
print(f"if every K/V tile came from DRAM instead: {cost.global_bytes / dram_rate:.0f} clocks per "
      f"tile, the largest of all; the L2 must deliver {need_l2:.1f} TB/s to keep up with the "
      f"bound, {need_l2 / roof['copy_tbps']:.1f}x the DRAM copy bandwidth")

# %% [markdown]
# So the model names the binding limit and the one next to it (on the H100 and H200 of
# `data/peaks.csv`: shared memory, then the tensor cores), and expects the kernel in the band
# printed above — of the order of SDPA's FlashAttention-2 kernel at this small config, most
# likely in the lower half of the band. Two risks are named in the
# printout: the L2 has to feed every block its own copy of each K/V tile (FlashAttention-2 uses
# 128-row query tiles partly to halve that traffic), and `mma.sync` may not reach the ceiling's
# rate.
#
# ## 9 · Measure
#
# On a GPU this builds the stage, checks it against a float64 reference on fresh inputs (N = 1,
# 17, 1000, 4096; D = 64 and 128; causal and not; fp16 and bf16), times it at the teaching
# config (B = 4, H = 16, N = 1024, D = 64) and over the FlashAttention sweep, in fp16 and bf16,
# and records the rows in `data/`. Without a GPU it shows the recorded rows.

# %%
ev = nb.evaluate("05_mma")
ev

# %% [markdown]
# ## 10 · Prediction against measurement

# %%
def inside(x, band):
    return "inside" if band[0] <= x <= band[1] else ("below" if x < band[0] else "above")


with nb.unless_missing():
    t = ev.timing("fp16")
    verdict = inside(t.tflops, pred05)
    print(f"stage 05: {t.tflops:.0f} TFLOP/s = {100 * t.tflops / tc:.0f}% of the fp16 matmul "
          f"ceiling, {verdict} the predicted {pred05[0]:.0f} - {pred05[1]:.0f}; "
          f"{t.tflops / bound:.0%} of the model's {binding} bound.")
    print(f"{t.pct_sdpa_flash:.0f}% of sdpa_flash (predicted {100 * pred05[0] / flash:.0f} - "
          f"{100 * pred05[1] / flash:.0f}%), {t.pct_sdpa_best:.0f}% of the fastest SDPA backend.")
    for before, dtype in (("03_coarsened", "fp32"), ("04_wmma", "fp16")):
        with nb.unless_missing():
            print(f"speedup over {before} ({dtype}): "
                  f"{nb.speedup(before, '05_mma', dtype, faster_dtype='fp16'):.1f}x")
    if verdict == "below":
        print("Below the band: more time waiting than the model allows. The profile (section 12) "
              "says on what: long_scoreboard stalls are the synchronous K/V loads, barrier stalls "
              "the __syncthreads around them, a high tensor-pipe % would mean mma.sync's own rate.")
    elif verdict == "above":
        print("Above the band: the model's binding rate is too pessimistic; the profile's "
              "shared-memory wavefronts (section 12) check its count.")

# %%
nb.compare("fp16")

# %% [markdown]
# ## 11 · Against SDPA over the FlashAttention sweep, and on the ladder
#
# The FlashAttention paper's sweep: 16k tokens (B · N), H · D = 2048, N from 512 to 16k, D = 64
# and 128, causal and not, fp16. Stage 05 against PyTorch's SDPA backends:

# %%
plots.scaling()

# %%
with nb.unless_missing():
    sweep = fl.results.load()
    sweep = sweep[(sweep["gpu"] == gpu) & (sweep["dtype"] == "fp16")
                  & (sweep["B"] * sweep["N"] == 16384) & (sweep["H"] * sweep["D"] == 2048)
                  & (sweep["status"].fillna("ok") == "ok")]
    wide = sweep.pivot_table(index=["D", "causal", "N"], columns="stage", values="tflops")
    if "05_mma" not in wide:
        raise nb.not_recorded("05_mma", " over the FlashAttention sweep")
    ratio = (wide["05_mma"] / wide["sdpa_flash"]).unstack("N")
    print("stage 05 as a fraction of sdpa_flash (rows: D, causal; columns: N):")
    display(ratio.round(2))
    best = ratio.stack().idxmax()
    print(f"closest to sdpa_flash at D={best[0]}, causal={best[1]}, N={best[2]}: "
          f"{ratio.stack().max():.2f}x; furthest: {ratio.stack().min():.2f}x")

# %% [markdown]
# Every stage at the teaching config in fp16 (stages 01–03 are fp32-only and appear on the fp32
# ladder of notebook 03), then the roofline: at the same arithmetic intensity as SDPA, the
# stages stack up vertically, and the tensor-core stages are the first that can climb towards
# the fp16 roof.

# %%
plots.ladder(dtype="fp16")

# %%
plots.roofline()

# %% [markdown]
# ## 12 · The profile: shared-memory traffic and the tensor pipe
#
# Two counters say whether the idea worked (the stage's `idea_metrics` in the registry, `flashlab/stages.py`): **shared-memory
# wavefronts**, loads and stores, `ldmatrix` included — the model of section 7 predicts the
# number exactly for a whole launch — and the **tensor pipe**'s activity.

# %%
predicted_wavefronts = fr.launch_wavefronts(fl.TEACHING.B, fl.TEACHING.H, fl.TEACHING.N, D)
with nb.unless_missing():
    p05 = nb.profile("05_mma")
    display(p05)
    m = p05["05_mma"]
    print(f"shared-memory wavefronts: {m.get('smem_wavefronts', float('nan')):.4g} measured, "
          f"{predicted_wavefronts:.4g} predicted "
          f"({m.get('smem_wavefronts', float('nan')) / predicted_wavefronts:.2f}x)")
    print(f"tensor pipe active: {m.get('tensor_pipe_pct', float('nan')):.0f}% of peak; "
          f"achieved occupancy {m.get('achieved_occupancy_pct', float('nan')):.0f}%")
    stalls = m.filter(like="stall_").sort_values(ascending=False).head(3)
    print("top stalls (% of active warp time): "
          + ", ".join(f"{k.removeprefix('stall_')} {v:.0f}" for k, v in stalls.items()))

# %%
plots.idea_metrics()

# %% [markdown]
# ## 13 · Resources: registers, no spills, and the instructions
#
# Everything a warp keeps across tiles is in registers now — Q's fragments, O's accumulators,
# `m` and `l` — plus the 8 tiles of S while a tile is processed. `ptxas` reports what that costs
# per thread:

# %%
res = nb.resources("05_mma")
res

# %%
with nb.unless_missing():
    if "kernel" not in res:  # nvcc unavailable here and the recorded table has no kernel names
        raise nb.not_recorded("05_mma", " ptxas report")
    arch = f"sm_{cc.replace('.', '')}" if f"sm_{cc.replace('.', '')}" in set(res["arch"]) else "sm_90"
    for d_ in (64, 128):
        here = res[(res["arch"] == arch) & res["kernel"].str.contains(f", {d_}, {BR}, {BC}>")]
        regs, spills = int(here["registers"].max()), int(here["spill_bytes"].max())
        smem = (BR + 2 * BC) * (d_ + 8) * 2  # Tiles::SMEM_BYTES: Q, K, V rows of LD = D + 8
        occ = tiling.occupancy(regs, smem, threads=32 * warps, cc=cc)
        print(f"D={d_}: {regs} registers, {spills} bytes spilled, {smem} B shared memory -> "
              f"blocks per SM allowed by {occ['limits']}: {occ['blocks']} ({occ['warps']} warps)")

# %% [markdown]
# Registers decide, as in stage 03, and the launch bounds hold them where the prediction
# assumed. The machine code shows the idea directly (static counts: each instruction as often
# as it appears in the code, the loops being unrolled): `HMMA` is `mma.sync`, `LDSM` is
# `ldmatrix`, and there are no `LDL`/`STL` spills.

# %%
mix = None
with nb.unless_missing():
    mix = nb.instructions("05_mma")
mix

# %%
with nb.unless_missing():
    if mix is None:
        raise nb.not_recorded("05_mma", " SASS")
    k64 = mix[mix.index.get_level_values("kernel").str.contains(r"__half, 64, 64, 64>")].iloc[0]
    expect = {"HMMA": cost.mma, "LDSM": cost.ldmatrix + KD, "MUFU.EX2": lane_scores + 2,
              "SHFL": 8, "LDL": 0, "STL": 0}
    why = {"HMMA": "mma per warp per tile", "LDSM": "K, V per tile + Q once",
           "MUFU.EX2": "a lane's scores + 2 rescale factors", "SHFL": "2 x 2 for the max, 2 x 2 for "
           "the final sum", "LDL": "no spills", "STL": "no spills"}
    for op, n_ in expect.items():
        print(f"{op:9} {k64[op]:4} in the code, {n_:4} expected ({why[op]})")

# %% [markdown]
# ## 14 · What is next
#
# The padding that made `ldmatrix` conflict-free costs shared memory, `(BR + 2 BC) × 16` bytes a
# block, and gives every row an odd stride. **Stage 06** drops it and stores 16-byte chunk `c` of
# row `r` at chunk `c XOR (r % 8)` instead: rows are 128-byte multiples again, and the 8 rows of
# one `ldmatrix` phase still land in 8 different bank groups.

# %%
fr.bank_map(2 * D, swizzle=True)

# %%
print(f"stage 06's layout: {fr.tile_cost(D, BR, BC, pad_bytes=0, swizzle=True).wavefronts} "
      f"wavefronts per K/V tile and block, as padded ({cost.wavefronts}), with "
      f"{(BR + 2 * BC) * 16} fewer bytes of shared memory per block")

# %% [markdown]
# **Stage 07** attacks the latency the prediction could only bracket: with `cp.async` a block
# asks for the next K/V tile while it still multiplies the current one, so the copy overlaps the
# math instead of stopping the whole block every tile.
