"""Stage 03's tiling, bank and loop-order arithmetic, computed from the kernels' own indexing.

Everything here is plain Python (numpy + matplotlib): no GPU needed. Figures are made without
pyplot, so a notebook cell that ends with one shows it once. The index formulas are the
ones in kernels/03_coarsened.cu (and 02_coalesced.cu for the comparison), written out once:

    thread = 16 * ty + tx                       (256 threads, tx, ty in 0..15)
    S patch:   rows ty + 16 r,  keys tx + 16 c  (r < TM = BR/16, c < TN = BC/16)
    O patch:   rows ty + 16 r,  columns 4 tx + 64 g + e   (g < G = D/64, e < 4)
    warp w:    lane = 16 * (ty % 2) + tx,  ty = 2 w + lane // 16
"""
import math

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from .banks import BANK_BYTES, BANKS, WAVEFRONT_BYTES, wavefronts  # noqa: F401  (re-exported)
from .stages import stage as _stage

THREADS = 256

# ---------------------------------------------------------------- who owns what


def patch_owner(BR=64, BC=64):
    """(BR, BC) array: the thread (16 ty + tx) that computes each score S[row, key] of the tile,
    filled the way the kernel's loops run (-1 would mean nobody; asserts nobody twice)."""
    owner = np.full((BR, BC), -1)
    for ty in range(16):
        for tx in range(16):
            for r in range(BR // 16):
                for c in range(BC // 16):
                    assert owner[ty + 16 * r, tx + 16 * c] == -1
                    owner[ty + 16 * r, tx + 16 * c] = 16 * ty + tx
    return owner


def o_owner(BR=64, D=64):
    """(BR, D) array: the thread that accumulates each element of the output tile O."""
    owner = np.full((BR, D), -1)
    for ty in range(16):
        for tx in range(16):
            for r in range(BR // 16):
                for g in range(D // 64):
                    cols = 4 * tx + 64 * g + np.arange(4)
                    assert (owner[ty + 16 * r, cols] == -1).all()
                    owner[ty + 16 * r, cols] = 16 * ty + tx
    return owner


def register_tiles(BR=64, BC=64, D=64, threads=((0, 0), (5, 2))):
    """Left: the BR x BC score tile. Each highlighted thread (tx, ty) owns the 4 x 4 scores at
    rows ty + 16r, keys tx + 16c: the same spot in every 16 x 16 block (grey checks). Its warp,
    tinted, covers 2 rows x 16 consecutive keys of each block. Right: the same threads' O patch,
    rows ty + 16r and the 4 columns 4tx .. 4tx+3 (+ 64g when D = 128): one float4 per row."""
    colors = ["tab:red", "tab:blue", "tab:green", "tab:orange"]
    fig = Figure(figsize=(10.5, 5.4))
    axes = fig.subplots(1, 2)
    for ax, owner, cw, title, xlabel in (
            (axes[0], patch_owner(BR, BC), 16, f"S tile {BR} x {BC}: each thread {BR // 16} x "
             f"{BC // 16} scores", "key in tile (K row tx + 16c)"),
            (axes[1], o_owner(BR, D), 4, f"O tile {BR} x {D}: each thread {BR // 16} rows x "
             f"{4 * (D // 64)} columns", "output column (4tx + 64g + e)")):
        rows, cols = np.indices(owner.shape)
        img = np.full(owner.shape + (3,), 0.94)
        img[(rows // 16 + cols // cw) % 2 == 1] = 0.85
        for (tx, ty), col in zip(threads, colors):
            rgb = np.array(to_rgb(col))
            warp = (owner >= 0) & (owner // 32 == (16 * ty + tx) // 32)
            img[warp] = 0.7 * img[warp] + 0.3 * rgb
            img[owner == 16 * ty + tx] = rgb
        ax.imshow(img, interpolation="nearest")
        for axis, size in ((ax.xaxis, owner.shape[1]), (ax.yaxis, owner.shape[0])):
            axis.set_ticks(np.arange(0, size + 1, 16) - 0.5, np.arange(0, size + 1, 16))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("query row in tile (ty + 16r)")
        ax.set_title(title, fontsize=10)
    handles = [Line2D([], [], ls="", marker="s", color=col, label=f"thread tx={tx}, ty={ty} "
                          f"(tint: its warp {(16 * ty + tx) // 32})")
               for (tx, ty), col in zip(threads, colors)]
    fig.legend(handles=handles, loc="lower center", ncol=len(threads), fontsize=9)
    fig.suptitle(f"Register tiling: {THREADS} threads (tx, ty in 0..15), thread 16ty + tx",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    return fig

# ---------------------------------------------------------------- shared-memory banks


def lanes(warp=0):
    """(tx, ty) of the 32 lanes of warp `warp` in stage 03's 256-thread block."""
    t = 32 * warp + np.arange(32)
    return t % 16, t // 16


def bank_map(stride_floats, rows=None, vector=4, k=0):
    """The banks each lane's access touches, for rows[lane] * stride_floats + k (default rows:
    stage 03's K read, key row tx = lane % 16). Returns (passes, M): M is 32 lanes x 32 banks,
    0 where untouched, else 1 + the pass that serves that lane."""
    rows = lanes()[0] if rows is None else np.asarray(rows)
    addr = rows * stride_floats + k
    n, pass_of = wavefronts(addr, vector)
    m = np.zeros((32, BANKS), dtype=int)
    for lane, a in enumerate(addr):
        m[lane, [(a + i) % BANKS for i in range(vector)]] = pass_of[lane] + 1
    return n, m


def bank_conflicts(D=64):
    """Stage 03's float4 read of 16 K rows by one warp, lanes (rows) x banks (columns), each
    touched bank coloured by the pass that serves it. Unpadded (LDK = D) every row starts in the
    same bank, so the 16 distinct 16-byte reads queue up in four banks; padded (LDK = D + 4) row
    tx starts 4 banks further along, and the 256 bytes go in the minimum two passes."""
    fig = Figure(figsize=(11, 4.8))
    axes = fig.subplots(1, 2, sharey=True)
    cmap = ListedColormap(["white"] + [matplotlib.colormaps["tab20"](i % 20) for i in range(32)])
    for ax, ld, what in ((axes[0], D, "no padding"), (axes[1], D + 4, "padded")):
        n, m = bank_map(ld)
        ax.imshow(m, cmap=cmap, vmin=0, vmax=32, interpolation="nearest", aspect="auto")
        ax.set_xticks(range(0, 32, 4))
        ax.set_xlabel("bank")
        ax.set_title(f"LDK = {ld} ({what}): {n} wavefront{'s' * (n > 1)}", fontsize=10)
        ax.set_xticks(np.arange(-0.5, 32, 4), minor=True)
        ax.grid(which="minor", axis="x", color="0.8", lw=0.5)
        ax.axhline(15.5, color="0.4", ls="--", lw=0.8)
    axes[0].text(31, 8, f"16 different K rows, each\n{4 * D} bytes apart: all start\nin bank 0, "
                 "so 16 passes", ha="right", va="center", fontsize=9)
    axes[0].text(31, 24, "lanes 16-31 (the next ty)\nread the same 16 rows:\nbroadcast, "
                 "no extra pass", ha="right", va="center", fontsize=9)
    axes[1].text(31, -0.3, "row tx starts in bank 4·tx mod 32:\n8 rows fill the 32 banks",
                 ha="right", va="top", fontsize=9)
    axes[0].set_ylabel("lane (tx = lane % 16 reads K row tx)")
    fig.suptitle("One warp reads Ks[(tx + 16c) * LDK + k] as float4: colour = the pass that "
                 "serves it", fontsize=11)
    fig.tight_layout()
    return fig

# ---------------------------------------------------------------- inner loops


def _steps(stage, D=64, pad=True):
    """{loop: (FFMA per thread per step, steps per tile, [(load, vector, addresses), ...])}: one
    step of each inner loop with every shared-memory load instruction in it, the word addresses
    of warp 0's 32 lanes taken from the kernel's indexing. A tile is 32 keys x 1 query row per
    warp in stage 02, BR x BC per block in stage 03."""
    slug = _stage(stage).slug
    if slug == "02_coalesced":
        lane = np.arange(32)  # a warp is one query row (ty = 0); lane tx scores key tx
        Bc = 32
        return {"S = QK^T": (1, D, [("Qi[ty*d + x]", 1, 0 * lane), ("Kj[tx*d + x]", 1, lane * D)]),
                "O += PV": (1, D // Bc * Bc, [("S[ty*Bc + y]", 1, 0 * lane * Bc),
                                              ("Vj[y*d + x]", 1, lane)])}
    if slug != "03_coarsened" or D not in (64, 128):
        raise ValueError(f"modelled: 02_coalesced, and 03_coarsened at D = 64 or 128; not {slug} "
                         f"at D = {D}")
    BR, BC = (64, 64) if D == 64 else (64, 32)  # as launched by 03_coarsened.cu
    TM, TN, G = BR // 16, BC // 16, D // 64
    ldq = ldk = D + 4 if pad else D
    ldp = BC + 4 if pad else BC
    tx, ty = lanes()
    qk = [(f"Qs[(ty+{16 * r})*LDQ + k]", 4, (ty + 16 * r) * ldq) for r in range(TM)] + \
         [(f"Ks[(tx+{16 * c})*LDK + k]", 4, (tx + 16 * c) * ldk) for c in range(TN)]
    pv = [(f"Ps[(ty+{16 * r})*LDP + y]", 4, (ty + 16 * r) * ldp) for r in range(TM)] + \
         [(f"Vs[(y+{yy})*LDV + 4tx+{64 * g}]", 4, yy * D + 4 * tx + 64 * g)
          for yy in range(4) for g in range(G)]
    return {"S = QK^T": (4 * TM * TN, D // 4, qk), "O += PV": (4 * 4 * G * TM, BC // 4, pv)}


def shared_loads(stage, D=64, pad=True) -> pd.DataFrame:
    """Each shared-memory load instruction in one step of a stage's inner loops: bytes per lane,
    distinct bytes per warp, and the wavefronts (128-byte passes) the warp instruction needs."""
    rows = []
    for loop, (_, _, loads) in _steps(stage, D, pad).items():
        for load, vec, addr in loads:
            rows.append(dict(loop=loop, load=load, bytes_per_lane=4 * vec,
                             distinct_bytes=4 * vec * len(set(addr.tolist())),
                             wavefronts=wavefronts(addr, vec)[0]))
    return pd.DataFrame(rows)


def work_per_load(stage, D=64, pad=True, ffma_rate=4) -> pd.DataFrame:
    """Per inner loop: FMAs per shared-memory load instruction, per byte a thread loads, and per
    wavefront a warp costs; and the share of the SM's FFMA peak that loop could reach, its limits
    being `ffma_rate` FFMA warp-instructions (4 on sm_90 and sm_86/89, 2 on A100), 4 issued
    instructions and 1 wavefront (128 B) per clock per SM (loop counters and addressing are left
    out: they lower it a little). Counts are per step (one k or y) and thread, wavefronts per
    warp."""
    out = []
    for loop, (fma, steps, loads) in _steps(stage, D, pad).items():
        clocks = _clocks(fma, loads, ffma_rate)
        limit = max(clocks, key=clocks.get)
        wf = clocks["shared memory"]
        out.append(dict(stage=_stage(stage).slug[:2], loop=loop, ffma=fma, loads=len(loads),
                        ffma_per_load=fma / len(loads),
                        ffma_per_byte=fma / sum(4 * vec for _, vec, _ in loads),
                        wavefronts=wf, ffma_per_wavefront=fma / wf, steps_per_tile=steps,
                        limit=limit, pct_of_ffma_peak=100 * clocks["FFMA pipe"] / clocks[limit]))
    return pd.DataFrame(out).round(3)


def _clocks(fma, loads, ffma_rate=4):
    """SM clocks one step of a loop needs from each limit, every warp of the SM running it."""
    return {"FFMA pipe": fma / ffma_rate, "issue": (fma + len(loads)) / 4,
            "shared memory": sum(wavefronts(addr, vec)[0] for _, vec, addr in loads)}


def inner_loop_bound(stage, D=64, pad=True, ffma_rate=4) -> float:
    """The share of the FFMA peak a stage's inner loops could reach together, one tile's worth
    of steps of each: FFMA-pipe clocks over the clocks of the busiest limit."""
    total = {}
    for fma, steps, loads in _steps(stage, D, pad).values():
        for k, v in _clocks(fma, loads, ffma_rate).items():
            total[k] = total.get(k, 0) + steps * v
    return total["FFMA pipe"] / max(total.values())


def launch_wavefronts(B=4, H=16, N=1024, D=64, returned=False) -> int:
    """Shared-memory wavefronts of a whole non-causal launch of stage 03 (what Nsight Compute's
    smem_wavefronts counts): the inner loops' loads of every warp and tile (flashlab.banks), plus
    the minimum for the K and V copies, the 2-way conflicted P stores and the Q copy.
    returned: also count the path back to the registers, which delivers 128 bytes a clock (one
    4-byte register to each of 32 lanes): a float4 load then needs 4 wavefronts whatever the
    broadcast, 2 when neighbouring lanes (l and l ^ 1, or l and l ^ 2) share their address."""
    BR, BC = (64, 64) if D == 64 else (64, 32)  # as launched by 03_coarsened.cu

    def cost(addr, vec):
        n = wavefronts(addr, vec)[0]
        if not returned:
            return n
        lane = np.arange(32)
        paired = any((addr == addr[lane ^ m]).all() for m in (1, 2))
        return max(n, vec // (2 if paired else 1))

    loops = sum(steps * sum(cost(np.asarray(addr), vec) for _, vec, addr in loads)
                for _, steps, loads in _steps("03_coarsened", D).values())
    per_tile = THREADS // 32 * loops + (2 * BC * D * 4 + 2 * BR * BC * 4) // WAVEFRONT_BYTES
    blocks, tiles = B * H * math.ceil(N / BR), math.ceil(N / BC)
    return blocks * (tiles * per_tile + BR * D * 4 // WAVEFRONT_BYTES)

# ---------------------------------------------------------------- resources and occupancy

# Per-SM limits by compute capability (CUDA programming guide, "Technical Specifications"):
# 32-bit registers, resident threads, resident blocks, shared memory (bytes).
SM_LIMITS = {"8.0": (65536, 2048, 32, 164 * 1024), "8.6": (65536, 1536, 16, 100 * 1024),
             "8.9": (65536, 1536, 24, 100 * 1024), "9.0": (65536, 2048, 32, 228 * 1024)}
# SM counts of common GPUs, for replaying without one (live runs ask the device).
SM_COUNTS = (("H100 PCIe", 114), ("H200", 132), ("H100", 132), ("A100", 108), ("L40S", 142),
             ("L4", 58), ("RTX 4090", 128), ("A10", 72))


def smem_bytes(D=64, BR=64, BC=64):
    """Dynamic shared memory of stage 03's block: Tiles::SMEM_FLOATS * 4 bytes."""
    LDQ = LDK = D + 4
    LDV, LDP = D, BC + 4
    return 4 * (BR * LDQ + BC * LDK + BC * LDV + BR * LDP)


def occupancy(registers, smem, threads=THREADS, cc="9.0") -> dict:
    """Resident blocks per SM allowed by each limit (registers are allocated per warp in units of
    256, and each block reserves 1 KiB of shared memory for the system)."""
    regs_sm, threads_sm, blocks_sm, smem_sm = SM_LIMITS.get(str(cc), SM_LIMITS["9.0"])
    warps = threads // 32
    regs_warp = math.ceil(registers * 32 / 256) * 256
    lim = {"registers": regs_sm // (regs_warp * warps), "threads": threads_sm // threads,
           "shared memory": smem_sm // (smem + 1024), "blocks": blocks_sm}
    blocks = min(lim.values())
    return dict(limits=lim, blocks=blocks, warps=blocks * warps,
                occupancy=blocks * threads / threads_sm)


def ffma_per_clock(cc="9.0"):
    """FFMA warp-instructions an SM retires per clock: 2 on A100 (sm_80: 64 FP32 lanes per SM),
    4 on sm_86, sm_89 and sm_90 (128 lanes)."""
    return 2 if str(cc) == "8.0" else 4


def sm_count(gpu=None):
    """SMs of the GPU in use (when `gpu` is None or names it), else of the named GPU from a short
    table (None if unknown)."""
    import torch
    if torch.cuda.is_available() and gpu in (None, torch.cuda.get_device_name(0)):
        return torch.cuda.get_device_properties(0).multi_processor_count
    for name, n in SM_COUNTS:
        if gpu and name in gpu:
            return n
    return None


def issue_share(occupancy_pct, selected_pct, cc="9.0", schedulers=4) -> float:
    """Share of its clocks on which a warp scheduler issued, from two profile metrics: the warps
    it holds (achieved occupancy x the SM's warp slots / `schedulers`) times the share of its
    active time each warp spends issuing (the stall reason `selected`)."""
    threads_sm = SM_LIMITS.get(str(cc), SM_LIMITS["9.0"])[1]
    return occupancy_pct / 100 * threads_sm / 32 / schedulers * selected_pct / 100


def busy_share(count, duration_ms, sms, per_clock=1.0, clock_ghz=1.98) -> float:
    """Share of the SM clocks a unit serving `per_clock` of `count` per clock per SM (shared
    memory: 1 wavefront) was busy over a profiled `duration_ms`, counted at `clock_ghz`. At the
    boost clock this is a lower bound: a GPU under load may run slower."""
    return count / per_clock / (sms * duration_ms * 1e-3 * clock_ghz * 1e9)

# ---------------------------------------------------------------- loop order


def global_bytes(order, B=4, H=16, N=1024, D=64, elem=4, tile=None):
    """Bytes each loop order moves between the SMs and global memory (causal=False).
    fa1 (stages 01/02, tile 32): K, V read once; every (K/V tile, Q tile) step reads Q_i, reads
    and writes O_i, m_i, l_i (no read on the first K/V tile).
    fa2 (stage 03, tile BR = BC = 64): Q read once, K and V read once per query tile, O written
    once."""
    heads, row = B * H, N * D * elem
    if order == "fa1":
        Tc = math.ceil(N / (tile or 32))
        per_head = {"Q": Tc * row, "K, V": 2 * row, "O": (2 * Tc - 1) * row,
                    "m, l": 2 * (2 * Tc - 1) * N * 4}
    elif order == "fa2":
        Tr = math.ceil(N / (tile or 64))
        per_head = {"Q": row, "K, V": 2 * Tr * row, "O": row, "m, l": 0}
    else:
        raise ValueError(f"order is 'fa1' or 'fa2', not {order!r}")
    return {k: heads * v for k, v in per_head.items()}


def _grid(ax, n, title):
    for i in range(n):
        for j in range(n):
            ax.add_patch(Rectangle((j, i), 0.92, 0.92, fc="0.92", ec="0.6", lw=0.6))
    ax.set_xlim(-1.9, n + 1.2)
    ax.set_ylim(n + 0.2, -1.0)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(n) + 0.46, [f"K/V {j}" for j in range(n)], fontsize=7)
    ax.set_yticks([])
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.set_title(title, fontsize=10)


def loop_orders(n=5, config=None):
    """Which (query tile, K/V tile) pair is visited when, and by whom. FA-1 (stages 01/02): one
    block per head walks down each K/V column, so between two visits of query tile i its O_i, m_i
    and l_i wait in global memory (left boxes), and the n x n steps run in sequence. FA-2
    (stage 03): one block per query tile (colours, in parallel) walks its row; m, l and O stay
    in registers and O_i is written once. Footer: grid sizes and bytes moved at `config`
    (default: the teaching config), from global_bytes()."""
    from .configs import TEACHING
    cfg = config or TEACHING
    fig = Figure(figsize=(11, 5.6))
    axes = fig.subplots(1, 2)
    ax = axes[0]
    _grid(ax, n, "FA-1 order (stages 01, 02): one block per head\n"
                 "outer loop: K/V tiles; inner loop: Q tiles")
    for j in range(n):
        ax.annotate("", (j + 0.46, n - 0.2), (j + 0.46, 0.1),
                    arrowprops=dict(arrowstyle="->", color="tab:red", lw=1.6))
        if j < n - 1:
            ax.annotate("", (j + 1.46, 0.1), (j + 0.46, n - 0.2),
                        arrowprops=dict(arrowstyle="->", color="tab:red", lw=0.8, ls=":"))
    for i in range(n):
        ax.add_patch(Rectangle((-1.75, i + 0.1), 1.1, 0.72, fc="mistyrose", ec="tab:red", lw=0.8))
        ax.text(-1.2, i + 0.46, f"O{i} m{i} l{i}", ha="center", va="center", fontsize=7)
        ax.annotate("", (-0.05, i + 0.46), (-0.62, i + 0.46),
                    arrowprops=dict(arrowstyle="<->", color="tab:red", lw=1))
        ax.text(n + 0.05, i + 0.46, f"Q tile {i}", va="center", fontsize=7)
    ax.text(-1.2, -0.2, "global\nmemory", ha="center", va="bottom", fontsize=8, color="tab:red")
    ax.text(n / 2, -0.45, f"{n * n} steps in sequence; each reads Q_i and\n"
            "reads + writes O_i, m_i, l_i", ha="center", va="bottom", fontsize=8, color="tab:red")
    ax = axes[1]
    _grid(ax, n, "FA-2 order (stage 03): one block per (query tile, head)\n"
                 "outer loop: Q tiles (the grid); inner loop: K/V tiles")
    for i in range(n):
        col = matplotlib.colormaps["viridis"](0.1 + 0.8 * i / max(1, n - 1))
        ax.annotate("", (n - 0.2, i + 0.46), (0.1, i + 0.46),
                    arrowprops=dict(arrowstyle="->", color=col, lw=2))
        ax.text(-0.15, i + 0.46, f"block {i}:\nQ tile {i}", ha="right", va="center", fontsize=7,
                color=col)
        ax.text(n + 0.05, i + 0.46, f"O{i} once", va="center", fontsize=7, color=col)
    ax.text(n / 2, -0.45, f"{n} blocks in parallel, {n} steps each;\nm, l, O in registers",
            ha="center", va="bottom", fontsize=8, color="tab:green")
    b1, b2 = (sum(global_bytes(o, cfg.B, cfg.H, cfg.N, cfg.D).values()) for o in ("fa1", "fa2"))
    heads = cfg.B * cfg.H
    least = 4 * heads * cfg.N * cfg.D * 4  # q, k, v, o once each
    fig.text(0.5, 0.03,
             f"At B={cfg.B} H={cfg.H} N={cfg.N} D={cfg.D} fp32 — grid: FA-1 {heads} blocks, FA-2 "
             f"{math.ceil(cfg.N / 64) * heads} blocks; global-memory traffic: FA-1 "
             f"{b1 / 1e9:.2f} GB, FA-2 {b2 / 1e9:.2f} GB (q, k, v, o once each: {least / 1e9:.2f} GB)",
             ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def conflict_shares(profile) -> pd.DataFrame:
    """Bank conflicts as a share of shared-memory wavefronts, one row per stage, from a profile
    table with metrics as rows and stages as columns (what nb.profile returns): a count that
    doubles from 0.01 % to 0.02 % of the traffic is noise, not a regression."""
    import pandas as pd
    wf = profile.loc["smem_wavefronts"]
    ld, st = profile.loc["smem_load_bank_conflicts"], profile.loc["smem_store_bank_conflicts"]
    return pd.DataFrame({"wavefronts": wf, "load conflicts": ld,
                         "% of wavefronts (loads)": 100 * ld / wf, "store conflicts": st,
                         "% of wavefronts (stores)": 100 * st / wf}).rename_axis("stage")
