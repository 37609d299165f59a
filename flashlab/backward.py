"""Stage 14 on the CPU: FlashAttention-2's backward pass (its Algorithm 2), drawn, checked in
PyTorch and counted from the kernel's own indexing (no GPU needed).

kernels/14_backward.cu's bwd_kernel gives each thread block one block of BC keys: K_j and V_j sit
in shared memory (fp32), dK_j and dV_j in registers, and the block walks down the query blocks i,
recomputing P_ij from the forward's log-sum-exp, and adds dQ_i into an fp32 buffer shared by every
key block. Its products run on the CUDA cores, each multiply-add fed from shared memory; the
functions here count those loads and turn them into a bound. The tile sizes are read from the
kernel's source (BWD_BR, BWD_BC, BWD_THREADS), the loads follow bwd_kernel's indexing.

    from flashlab import backward
    backward.algorithm_figure()        # one thread block's walk down the query blocks
    backward.identities()              # the softmax's Jacobian, Δ two ways, P from the lse
    backward.demo()                    # Algorithm 2 tile by tile against float64 autograd
    backward.loop_model(D=64)          # each loop's FFMAs, loads and wavefronts, per warp
    backward.predict(sms=132, cc="9.0", fma_tflops=52.0, D=64)   # the bound shared memory sets
"""
import math
import re

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from .banks import wavefronts
from .configs import flops
from .paths import KERNELS
from .tables import NotRecorded
from .tiling import ffma_per_clock

TITLE, LABEL, TEXT = 15, 12, 11   # font sizes, as the other lessons' figures (slides)
CLOCK_GHZ = 1.98                  # boost clock of an H100 or H200 SXM, as notebooks 02-08 take it
SOURCE = KERNELS / "14_backward.cu"
COLORS = {"kv": "#6baed6", "q": "#fd8d3c", "tile": "#2171b5", "walk": "#c6dbef",
          "acc": "#74c476", "dq": "#9e9ac8", "masked": "0.85"}


def kernel_tiles(source=SOURCE) -> dict:
    """bwd_kernel's tile sizes as the kernel declares them: {"BR": query rows, "BC": keys per
    block, "THREADS": threads per block} (the line `constexpr int BWD_BR = .., BWD_BC = ..,
    BWD_THREADS = ..;`)."""
    m = re.search(r"constexpr int BWD_BR = (\d+), BWD_BC = (\d+), BWD_THREADS = (\d+);",
                  source.read_text())
    if not m:
        raise ValueError(f"{source.name}: no 'constexpr int BWD_BR = .., BWD_BC = .., "
                         f"BWD_THREADS = ..;' line")
    return dict(zip(("BR", "BC", "THREADS"), map(int, m.groups())))


# ---------------------------------------------------------------- the math, checked in PyTorch

def identities(N=48, D=16, seed=0) -> pd.Series:
    """The three facts the backward rests on, checked in float64 on random inputs (largest
    absolute difference of each, about 1e-16 when they hold):
    - the softmax's Jacobian: a row's dS = J(p)ᵀ dP with J = diag(p) − p pᵀ equals P ∘ (dP − Δ);
    - Δ_i = Σ_j P_ij dP_ij equals Σ_d dO_id O_id (D terms a row, not N);
    - exp(S − lse) is the softmax of S, row by row."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(N, D, generator=gen, dtype=torch.float64) for _ in range(4))
    s = q @ k.T / math.sqrt(D)
    p = torch.softmax(s, dim=-1)
    o = p @ v
    dp = do @ v.T
    jac = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]      # (N, N, N): a Jacobian per row
    ds_jacobian = torch.einsum("ijk,ij->ik", jac, dp)
    delta = (p * dp).sum(-1)
    ds = p * (dp - delta[:, None])
    lse = torch.logsumexp(s, dim=-1)
    return pd.Series({
        "dS: Jacobian vs P∘(dP − Δ)": (ds_jacobian - ds).abs().max().item(),
        "Δ: rowsum(P∘dP) vs rowsum(dO∘O)": (delta - (do * o).sum(-1)).abs().max().item(),
        "P: exp(S − lse) vs softmax(S)": (torch.exp(s - lse[:, None]) - p).abs().max().item(),
    }, name="largest |difference|")


def demo(N=200, D=64, B=1, H=2, seed=0, dtypes=("fp32", "fp16", "bf16")) -> pd.DataFrame:
    """Algorithm 2 tile by tile (flashlab.reference.blocked_backward, with bwd_kernel's tile
    sizes) against float64 autograd (reference_backward), on the CPU: the relative error of dQ,
    dK and dV, beside that of PyTorch's own backward in the same dtype (autograd through the
    materialised P), whose twice is the tolerance a stage's backward is held to. N = 200 is a
    multiple of neither tile, so the ragged edges are taken too. The forward's output and
    log-sum-exp come from the float64 reference, as the checks hand them to a backward."""
    import torch

    from .inputs import dtype_of
    from .reference import (blocked_backward, grad_err, naive_backward, reference,
                            reference_backward, reference_lse)
    tiles = kernel_tiles()
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for name in dtypes:
        dt = dtype_of(name)
        q, k, v, do = (torch.randn(B, H, N, D, generator=gen).to(dt) for _ in range(4))
        for causal in (False, True):
            o = reference(q, k, v, causal).to(dt)
            lse = reference_lse(q, k, causal).float()
            exact = reference_backward(q, k, v, do, causal)
            ours = blocked_backward(q, k, v, o, lse, do, causal, BR=tiles["BR"], BC=tiles["BC"])
            theirs = naive_backward(q, k, v, do, causal)
            row = {("Algorithm 2", g): grad_err(x, r) for g, x, r in zip(("dQ", "dK", "dV"), ours, exact)}
            row |= {("autograd, same dtype", g): grad_err(x, r)
                    for g, x, r in zip(("dQ", "dK", "dV"), theirs, exact)}
            rows[(name, causal)] = row
    out = pd.DataFrame(rows).T
    out.index.names = ["dtype", "causal"]
    return out


# ---------------------------------------------------------------- what one tile costs

def steps(D=64) -> pd.DataFrame:
    """What bwd_kernel does for one (query block i, key block j) pair: each step, where its
    operands come from and its result goes, and its multiply-adds (BR x BC x D for a product).
    The five products are the FLOPs FlashAttention counts: 5 x 2 x BR x BC x D a tile."""
    t = kernel_tiles()
    br, bc = t["BR"], t["BC"]
    mac = br * bc * D
    rows = [
        ("S = Q_i K_jᵀ", "Q_i, K_j (shared)", "registers", mac),
        ("P = exp(S·scale − L_i)", "S, L_i", "shared (P)", 0),
        ("dP = dO_i V_jᵀ", "dO_i, V_j (shared)", "registers", mac),
        ("dS = P ∘ (dP − Δ_i)", "P, dP, Δ_i", "shared (dS)", 0),
        ("dV_j += Pᵀ dO_i", "P, dO_i (shared)", "registers, whole walk", mac),
        ("dK_j += dSᵀ Q_i", "dS, Q_i (shared)", "registers, whole walk", mac),
        ("dQ_i += dS K_j", "dS, K_j (shared)", "fp32 buffer, atomics", mac),
    ]
    out = pd.DataFrame(rows, columns=["step", "reads", "result in", "multiply-adds"])
    return out.set_index("step")


def flop_count(B=4, H=16, N=1024, D=64, causal=False) -> pd.Series:
    """FLOPs as FlashAttention counts them (flashlab.configs.flops): the forward's two products
    4·B·H·N²·D, the backward's five 10·B·H·N²·D, 2.5 times as many; half of each when causal. And
    what bwd_kernel does: 2 x 5 x BR x BC x D per (query block, key block) pair it visits, which
    under the mask includes the diagonal's blocks in full."""
    t = kernel_tiles()
    n_tiles = math.ceil(N / t["BC"])
    pairs = n_tiles * (n_tiles + 1) // 2 if causal else n_tiles * n_tiles
    kernel = 2 * 5 * t["BR"] * t["BC"] * D * B * H * pairs
    fwd, bwd = flops(B, H, N, D, causal), flops(B, H, N, D, causal, pass_="backward")
    return pd.Series({"forward FLOPs": fwd, "backward FLOPs": bwd, "backward / forward": bwd / fwd,
                      "bwd_kernel's FLOPs": float(kernel), "bwd_kernel / counted": kernel / bwd})


def _warp0():
    """Lane l of warp 0: row (or key) r = l / 8 and column c = l % 8, bwd_kernel's split."""
    lane = np.arange(32)
    return lane // 8, lane % 8


def shared_loads(D=64) -> pd.DataFrame:
    """Each shared-memory instruction of one step of bwd_kernel's loops and of its stores, with
    the word addresses of warp 0's 32 lanes from the kernel's indexing (BwdSmem: fp32 tiles with
    rows LD = D + 1 floats apart, P and dS BC + 1 apart): distinct words, and wavefronts by the
    bank model (flashlab.banks). A row per instruction; `per_tile` is how often it runs for one
    (query block, key block) pair, `ffma` the FFMAs of its loop's step (first row of the step)."""
    t = kernel_tiles()
    br, bc, threads = t["BR"], t["BC"], t["THREADS"]
    LD, LP, ND = D + 1, bc + 1, D // 8
    Q, DO = 0, br * LD                    # BwdSmem's offsets, in floats
    K = DO + br * LD
    V = K + bc * LD
    P = V + bc * LD
    DS = P + br * LP
    r, c = _warp0()
    d, i = 0, 0                           # one step; the banks shift with it, the count does not
    rows = []

    def add(loop, load, addr, per_tile, ffma=0):
        addr = np.asarray(addr)
        rows.append(dict(loop=loop, instruction=load, distinct_words=len(set(addr.tolist())),
                         wavefronts=wavefronts(addr)[0], per_tile=per_tile, ffma=ffma))

    loop = "S and dP (a step per d)"
    add(loop, "LDS Qs[r·LD + d]", Q + r * LD + d, D, ffma=8)
    add(loop, "LDS dOs[r·LD + d]", DO + r * LD + d, D)
    for kk in range(4):
        add(loop, f"LDS Ks[(c+{8 * kk})·LD + d]", K + (c + 8 * kk) * LD + d, D)
        add(loop, f"LDS Vs[(c+{8 * kk})·LD + d]", V + (c + 8 * kk) * LD + d, D)
    loop = "dV, dK, dQ (a step per query row i)"
    add(loop, "LDS Ps[i·LP + r]", P + i * LP + r, br, ffma=3 * ND)
    add(loop, "LDS dSs[i·LP + r]", DS + i * LP + r, br)
    add(loop, "LDS dSs[r·LP + i]", DS + r * LP + i, br)
    for k in range(ND):
        add(loop, f"LDS dOs[i·LD + c+{8 * k}]", DO + i * LD + c + 8 * k, br)
        add(loop, f"LDS Qs[i·LD + c+{8 * k}]", Q + i * LD + c + 8 * k, br)
        add(loop, f"LDS Ks[i·LD + c+{8 * k}]", K + i * LD + c + 8 * k, br)
    loop = "stores (a tile)"
    chunks = D // 8
    per_thread = br * chunks // threads   # 8-element chunks of Q_i (and of dO_i) a thread copies
    e = np.arange(32)
    for x in range(8):
        add(loop, f"STS Qs, dOs (element {x} of a chunk)", Q + e // chunks * LD + e % chunks * 8 + x,
            2 * per_thread)
    for kk in range(4):
        add(loop, f"STS Ps, dSs[r·LP + c+{8 * kk}]", P + r * LP + c + 8 * kk, 2)
    return pd.DataFrame(rows)


def loop_model(D=64) -> pd.DataFrame:
    """Per warp and (query block, key block) pair: FFMAs, shared-memory instructions and
    wavefronts of each loop of bwd_kernel (shared_loads), and loads per FFMA. The exponential,
    the masks and the atomics are left out: a few instructions per 32 x 32 tile."""
    loads = shared_loads(D)
    out = {}
    for loop, g in loads.groupby("loop", sort=False):
        steps_ = g["per_tile"].iloc[0]
        lds = g["instruction"].str.startswith("LDS")
        out[loop] = {"FFMA": g["ffma"].sum() * steps_ if lds.any() else 0,
                     "LDS": int((g["per_tile"] * lds).sum()),
                     "STS": int((g["per_tile"] * ~lds).sum()),
                     "wavefronts": int((g["per_tile"] * g["wavefronts"]).sum())}
    table = pd.DataFrame(out).T
    table.loc["a tile, in all"] = table.sum()
    table["LDS per FFMA"] = table["LDS"] / table["FFMA"].replace(0, np.nan)
    table["wavefronts per FFMA"] = table["wavefronts"] / table["FFMA"].replace(0, np.nan)
    return table.rename_axis("per warp and block pair")


def predict(sms, cc="9.0", fma_tflops=None, D=64, clock_ghz=CLOCK_GHZ) -> pd.Series:
    """The bound on bwd_kernel's speed from one tile's counts (loop_model): an SM issues 4
    instructions a clock, retires ffma_per_clock(cc) FFMA warp-instructions (4 on sm_86 to sm_90,
    2 on A100) and serves 1 shared-memory wavefront; the largest of the three clock counts binds,
    and the share of the FFMA peak is the FFMA pipe's clocks over it. Since the kernel does the
    five products and nothing else of size, FlashAttention's TFLOP/s are 2 x its multiply-adds a
    second: the share of the fp32 FMA ceiling. Two numbers: at the measured ceiling `fma_tflops`
    (what sustained FMAs reach on this GPU; NaN if not given) and at the boost clock (an upper
    one)."""
    m = loop_model(D).loc["a tile, in all"]
    clocks = {"FFMA pipe": m["FFMA"] / ffma_per_clock(cc), "shared memory": m["wavefronts"],
              "issue": (m["FFMA"] + m["LDS"] + m["STS"]) / 4}
    binds = max(clocks, key=clocks.get)
    share = clocks["FFMA pipe"] / clocks[binds]
    clock_peak = sms * clock_ghz * 1e9 * 32 * ffma_per_clock(cc) * 2 / 1e12
    return pd.Series({
        "FFMA-pipe clocks a tile": clocks["FFMA pipe"], "shared-memory clocks": clocks["shared memory"],
        "issue clocks": clocks["issue"], "binds": binds, "share of FFMA peak": share,
        "TFLOP/s at the measured FMA ceiling": share * fma_tflops if fma_tflops else float("nan"),
        "TFLOP/s at the boost clock": share * clock_peak}, name=f"D = {D}")


def launch_wavefronts(B=4, H=16, N=1024, D=64, causal=False) -> int:
    """Shared-memory wavefronts of one bwd_kernel launch, as Nsight Compute's smem_wavefronts
    counts them: loop_model's per warp and tile, times the warps of a block, the (query block,
    key block) pairs each (batch, head) visits, and the heads; the K_j and V_j copies added."""
    t = kernel_tiles()
    n_tiles = math.ceil(N / t["BC"])
    pairs = n_tiles * (n_tiles + 1) // 2 if causal else n_tiles * n_tiles
    warps = t["THREADS"] // 32
    per_tile = warps * loop_model(D).loc["a tile, in all", "wavefronts"]
    copies = n_tiles * warps * 2 * 2 * (t["BC"] * D // t["THREADS"])  # ~2 wavefronts a store
    return int(B * H * (pairs * per_tile + copies))


def lse_cost(B=4, H=16, N=1024, D=64, copy_tbps=3.0, forward_ms=None) -> pd.Series:
    """What saving the log-sum-exp adds to a forward: 4 bytes a row written (beside the O row's
    2·D), their time at the measured copy bandwidth (`copy_tbps`, bytes read plus written a
    second), and that time's share of `forward_ms` (NaN if not given). An upper bound on the
    stores' cost: the forward is not bound by DRAM, so they overlap its math."""
    rows = B * H * N
    lse_bytes, o_bytes = 4 * rows, 2 * D * rows
    us = lse_bytes / (copy_tbps * 1e12) * 1e6
    return pd.Series({"lse bytes": lse_bytes, "O bytes": o_bytes, "lse / O bytes": lse_bytes / o_bytes,
                      "µs at the copy bandwidth": us,
                      "share of the forward": us / (forward_ms * 1e3) if forward_ms else float("nan")})


def side_passes(B=4, H=16, N=1024, D=64, copy_tbps=3.0) -> pd.Series:
    """The two small kernels around bwd_kernel, by the bytes they move at the measured copy
    bandwidth (`copy_tbps`, read plus written): bwd_preprocess_kernel reads O and dO (2 bytes an
    element each) and zeroes the fp32 dQ sum (4), bwd_dq_kernel reads the sum (4) and writes dQ
    (2): 14 bytes per element of Q."""
    nbytes = 14 * B * H * N * D
    return pd.Series({"bytes": nbytes, "µs at the copy bandwidth": nbytes / (copy_tbps * 1e12) * 1e6})


# ---------------------------------------------------------------- the machine code

def sass_loops(D=64, dtype="__half", arch="sm_90") -> pd.DataFrame:
    """bwd_kernel's innermost loops in its machine code (flashlab.sass.loops: a loop that holds
    no other), those with FFMAs: the products' two loops, in the order the kernel has them, with
    their FFMA and LDS counts per trip, the steps of the source loop a trip holds (the compiler
    unrolls) and LDS per FFMA, to set beside loop_model's. Needs nvcc and cuobjdump (not a GPU);
    without them NotRecorded."""
    from . import sass
    try:
        found = sass.loops(SOURCE, arch, kernel=f"bwd_kernel<{dtype}, {D}>")
    except (OSError, RuntimeError) as err:
        raise NotRecorded(f"bwd_kernel's machine code needs nvcc and cuobjdump here ({err})") from None
    spans = [(int(f, 16), int(last, 16)) for f, last in zip(found["first"], found["last"])]
    inner = np.array([not any(f <= a and b <= last and (a, b) != (f, last) for a, b in spans)
                      for f, last in spans], dtype=bool)
    loops_ = found[inner & (found["FFMA"] > 0).to_numpy()].sort_values("first", key=lambda x: x.map(
        lambda h: int(h, 16)))
    out = loops_[["first", "last", "instructions", "FFMA", "LDS", "STS", "MUFU.EX2", "RED"]].copy()
    names = list(loop_model(D).index[:2])
    if len(out) == len(names):
        out.index = names
        out.insert(3, "steps a trip", out["FFMA"] // np.array([8, 3 * D // 8]))
    out["LDS per FFMA"] = out["LDS"] / out["FFMA"]
    return out.rename_axis("loop")


# ---------------------------------------------------------------- the figure

def algorithm_figure(tiles=8, j=2, i=5, causal=True):
    """FlashAttention-2's Algorithm 2 as bwd_kernel runs it: the score matrix of one (batch, head)
    cut into tiles x tiles blocks (query blocks i down, key blocks j across). One thread block owns
    key block `j`: K_j and V_j in shared memory, dK_j and dV_j in registers; it walks down the
    query blocks, at each loading Q_i, dO_i, L_i and Δ_i and recomputing that block of S, P, dP and
    dS, and adds dQ_i into an fp32 buffer that every key block adds to. Causal: the blocks above
    the diagonal are skipped, and block j starts at query block j."""
    if not (0 <= j < tiles and 0 <= i < tiles) or (causal and i < j):
        raise ValueError(f"query block i = {i} must be one key block j = {j} visits")
    t = kernel_tiles()
    fig = Figure(figsize=(15, 9.5), layout="constrained")
    ax = fig.subplots()
    first = j if causal else 0
    for a in range(tiles):            # a: query block (row), b: key block (column)
        for b in range(tiles):
            masked = causal and b > a
            if b == j and a == i:
                fc, hatch = COLORS["tile"], None
            elif b == j and a >= first:
                fc, hatch = COLORS["walk"], None
            elif masked:
                fc, hatch = "white", "///"
            else:
                fc, hatch = "0.96", None
            ax.add_patch(Rectangle((b, a), 1, 1, fc=fc, ec="0.55", lw=0.8, hatch=hatch))
    ax.add_patch(Rectangle((j, 0), 1, tiles, fill=False, ec=COLORS["tile"], lw=3))
    ax.text(j + 0.44, i + 0.5, "S, P,\ndP, dS", ha="center", va="center", color="white",
            fontsize=TEXT, fontweight="bold")
    for b in range(tiles):
        ax.text(b + 0.5, -0.12, str(b), ha="center", va="bottom", fontsize=TEXT)
        ax.text(-0.12, b + 0.5, str(b), ha="right", va="center", fontsize=TEXT)
    ax.text(tiles / 2, -0.55, f"key blocks j → (BC = {t['BC']} keys each)", ha="center",
            va="bottom", fontsize=LABEL)
    ax.text(-0.1, -0.55, f"query blocks i ↓\n(BR = {t['BR']} rows each)", ha="right",
            va="bottom", fontsize=LABEL)
    # the walk down the column
    if tiles - first > 1:
        ax.add_patch(FancyArrowPatch((j + 0.9, first + 0.2), (j + 0.9, tiles - 0.2),
                                     arrowstyle="-|>", mutation_scale=22, color="0.15", lw=2))
    # K_j, V_j above the column; dK_j, dV_j below it
    ax.add_patch(Rectangle((j - 0.45, -2.35), 1.9, 1.1, fc=COLORS["kv"], ec="k", lw=1.5))
    ax.text(j + 0.5, -1.8, "K_j, V_j", ha="center", va="center", fontsize=LABEL, fontweight="bold")
    ax.text(j + 1.6, -1.8, "in shared memory (fp32),\nloaded once", ha="left", va="center",
            fontsize=TEXT)
    ax.add_patch(Rectangle((j - 0.65, tiles + 0.3), 2.3, 1.1, fc=COLORS["acc"], ec="k", lw=1.5))
    ax.text(j + 0.5, tiles + 0.85, "dK_j, dV_j", ha="center", va="center", fontsize=LABEL,
            fontweight="bold")
    ax.text(j + 1.8, tiles + 0.85, "in registers the whole walk,\nwritten once at its end",
            ha="left", va="center", fontsize=TEXT)
    # Q_i, dO_i, L_i, Δ_i left of row i
    ax.add_patch(Rectangle((-3.9, i + 0.05), 3.0, 0.9, fc=COLORS["q"], ec="k", lw=1.5))
    ax.text(-2.4, i + 0.5, "Q_i, dO_i, L_i, Δ_i", ha="center", va="center", fontsize=TEXT,
            fontweight="bold")
    ax.text(-2.4, i + 1.05, "loaded at every step", ha="center", va="top", fontsize=TEXT)
    ax.add_patch(FancyArrowPatch((-0.85, i + 0.5), (j - 0.05, i + 0.5), arrowstyle="-|>",
                                 mutation_scale=18, color=COLORS["q"], lw=2.5))
    # the fp32 dQ buffer, right of the matrix: every key block that sees row block i adds to dQ_i
    x0 = tiles + 1.6
    for a in range(tiles):
        ax.add_patch(Rectangle((x0, a), 1.2, 1, fc=COLORS["dq"] if a == i else "0.97", ec="0.55",
                               lw=0.8))
    ax.add_patch(Rectangle((x0, 0), 1.2, tiles, fill=False, ec="k", lw=1.5))
    ax.text(x0 + 0.6, i + 0.5, "dQ_i", ha="center", va="center", fontsize=TEXT, fontweight="bold")
    ax.text(x0 + 0.6, -0.12, "dQ, fp32", ha="center", va="bottom", fontsize=LABEL)
    senders = [b for b in range(tiles) if not (causal and b > i)]
    for b in senders:
        ax.add_patch(Rectangle((b + 0.06, i + 0.06), 0.88, 0.88, fill=False, ec=COLORS["dq"],
                               lw=3))
    start = senders[-1] + 1
    ax.add_patch(FancyArrowPatch((start, i + 0.5), (x0 - 0.05, i + 0.5), arrowstyle="-|>",
                                 mutation_scale=20, color=COLORS["dq"], lw=3))
    ax.text(x0 + 1.4, i + 0.5, f"+= dS K_j from each of the\n{len(senders)} key blocks that see "
            f"row block {i}:\nfp32 atomics (RED), in no\nfixed order", ha="left", va="center",
            fontsize=TEXT)
    ax.text(x0 + 1.4, tiles - 0.3, "then bwd_dq_kernel:\ndQ = scale · the sum,\nin fp16 / bf16",
            ha="left", va="bottom", fontsize=TEXT)
    ax.text(-3.9, tiles + 0.85, "before: Δ = rowsum(dO ∘ O)\n(bwd_preprocess_kernel)",
            ha="left", va="center", fontsize=TEXT)
    handles = [Patch(fc=COLORS["walk"], ec="0.55", label=f"blocks key block {j}'s thread block visits"),
               Patch(fc=COLORS["tile"], ec="0.55", label=f"the step shown: query block {i}"),
               Patch(fc="0.96", ec="0.55", label="visited by other thread blocks"),
               Patch(fc="white", ec=COLORS["dq"], lw=3, label=f"blocks that add into dQ_{i}")]
    if causal:
        handles.append(Patch(fc="white", ec="0.55", hatch="///",
                             label="above the diagonal: masked, skipped"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, -0.02), fontsize=TEXT,
              frameon=False, ncols=2)
    ax.set_xlim(-4.1, x0 + 5.6)
    ax.set_ylim(tiles + 2.6, -2.7)
    ax.set_aspect("equal")
    ax.axis("off")
    mask = ", causal" if causal else ""
    ax.set_title(f"Algorithm 2{mask}: a thread block per key block j, walking down the query "
                 f"blocks i\nS, P, dP and dS exist one {t['BR']} x {t['BC']} block at a time, "
                 "on chip, and are never stored", fontsize=TITLE)
    return fig
