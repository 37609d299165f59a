"""Pictures and counts for the notebooks, computed from the kernels' own indexing (no GPU needed).

Every function here models a line of kernels/01_naive.cu, kernels/02_coalesced.cu or
kernels/04_wmma.cu; the `source` fragments quoted below are copied from those files, and
tests/test_diagrams.py checks that they are still there. The last section models the K/V loop of
stages 06 and 07 in time: loads (a latency, then the bytes at a bandwidth) and math per tile, one
after the other or overlapped. Figures are matplotlib Figures made without pyplot: a notebook cell
that ends with one shows it once, and nothing is left open.
"""
import math
from typing import NamedTuple

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from .banks import wavefronts
from .stages import stage as _stage

WARP = 32      # lanes per warp
SECTOR = 32    # bytes: the unit L1, L2 and DRAM move global memory in
LINE = 128     # bytes: an L1 cache line, 4 sectors
BC = BR = 32   # keys per K/V tile, queries per Q tile (stages 01 and 02)
WARPS_PER_BLOCK = {"01_naive": 1, "02_coalesced": BR}   # blocks are 32 and 32 x 32 threads
CMAP = "viridis"


def _slug(stage):
    slug = _stage(stage).slug
    if slug not in WARPS_PER_BLOCK:
        raise ValueError(f"diagrams model stages 01 and 02 only, not {slug}")
    return slug


# ---------------------------------------------------------------- global memory: one warp's load

def warp_elements(stage, D=64, step=0, warp=0):
    """(row, column) in the 32 x D tile of the element each lane loads in one load instruction.

    01_naive, `Kj[(tx * d) + x] = ... K[qkv_offset + (size_t)key * d + x]`: lane t reads row t,
    column x = `step`. 02_coalesced's load_tile: thread tid = 32 * warp + lane reads element
    tid + step * 1024 of the tile, so the lanes read consecutive elements."""
    lanes = np.arange(WARP)
    if _slug(stage) == "01_naive":
        if not 0 <= step < D:
            raise ValueError(f"stage 01's loop has x = 0..{D - 1}")
        return lanes, np.full(WARP, step)
    e = step * BR * WARP + warp * WARP + lanes
    if e[0] >= BC * D:
        raise ValueError(f"load_tile has {math.ceil(BC * D / (BR * WARP))} trips at D={D}")
    return e // D, e % D  # rows >= 32: lanes idle in a last trip that ends mid-warp


def warp_addresses(stage, D=64, step=0, warp=0, elem_bytes=4):
    """Byte addresses, from the start of the tile, that the 32 lanes of `warp` touch in one load
    instruction of a K, V or Q tile load (see warp_elements). The tile is B*H*N*D*4-byte aligned
    plus whole rows, so for D a multiple of 8 it starts on a sector boundary."""
    rows, cols = warp_elements(stage, D, step, warp)
    keep = rows < BC
    return (rows[keep] * D + cols[keep]) * elem_bytes


class Request(NamedTuple):
    """What one warp-wide load costs the memory system."""
    sectors: int       # distinct 32-byte sectors: what moves between L1, L2 and DRAM
    lines: int         # distinct 128-byte L1 lines
    efficiency: float  # bytes the lanes asked for / bytes in those sectors

    def __repr__(self):
        return (f"Request(sectors={self.sectors}, lines={self.lines}, "
                f"efficiency={self.efficiency:.1%})")


def sectors_per_request(addresses, access_bytes=4):
    """Distinct 32-byte sectors and 128-byte lines that one warp request touches, and the share of
    the sectors' bytes the lanes asked for (1.0 = perfectly coalesced)."""
    a = np.asarray(addresses, dtype=np.int64)
    ends = a + access_bytes - 1

    def count(size):
        return len(np.unique(np.concatenate([a // size, ends // size])))

    sectors = count(SECTOR)
    asked = len(np.unique(a)) * access_bytes
    return Request(sectors, count(LINE), asked / (sectors * SECTOR))


def access_pattern(stage, D=64, step=0, warp=0, ax=None):
    """A 32 x D tile of K (rows = keys, columns = head dim; V and Q load the same way): the
    elements one load instruction of one warp reads, coloured by lane; thin lines are 32-byte
    sector boundaries, red boxes the sectors the instruction touches. The title gives sectors
    per request and how much of them is used."""
    slug = _slug(stage)
    rows, cols = warp_elements(slug, D, step, warp)
    keep = rows < BC
    lane = np.full((BC, D), np.nan)
    lane[rows[keep], cols[keep]] = np.arange(WARP)[keep]
    alone = ax is None
    if alone:
        ax = Figure(figsize=(9, 5), layout="constrained").subplots()
    cm = matplotlib.colormaps[CMAP].with_extremes(bad="#f0f0f0")  # grey: not read
    im = ax.imshow(lane, cmap=cm, vmin=0, vmax=WARP - 1, interpolation="nearest")
    per = SECTOR // 4
    for c in range(per, D, per):
        ax.axvline(c - 0.5, color="0.6", lw=0.5)
    addr = warp_addresses(slug, D, step, warp)
    for s in np.unique(addr // SECTOR):
        r, c = divmod(int(s) * per, D)
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), min(per, D - c), 1, fill=False, ec="red", lw=1))
    req = sectors_per_request(addr)
    what = f"x = {step}" if slug == "01_naive" else f"warp {warp}, trip {step}"
    lines = f"{req.lines} line" + "s" * (req.lines > 1)
    ax.set_title(f"{slug}: one load instruction ({what})\n{req.sectors} sectors, {lines} per "
                 f"request; {req.efficiency:.1%} of their bytes used", fontsize=10)
    ax.set_xlabel("head-dim column of the tile (grey lines: sector boundaries, red: sectors read)")
    ax.set_ylabel("key row of the tile")
    if alone:
        ax.figure.colorbar(im, ax=ax, label="lane", shrink=0.8)
    return ax.figure


def access_comparison(D=64):
    """access_pattern of stage 01 and stage 02 side by side, one colour bar for the lane."""
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, slug in zip(axes, WARPS_PER_BLOCK):
        access_pattern(slug, D, ax=ax)
    fig.colorbar(axes[0].images[0], ax=axes, label="lane", shrink=0.8)
    return fig


# ---------------------------------------------------------------- shared memory: bank conflicts

def bank_wavefronts(addresses):
    """Wavefronts (shared-memory clock cycles) one warp-wide 4-byte shared-memory access needs:
    the most distinct words any one of the 32 banks must deliver. Lanes reading the same word
    share it (broadcast): 1 wavefront; 32 lanes in one bank at 32 different words: 32.
    `addresses` are in bytes; flashlab.banks holds the model (vector accesses too)."""
    return wavefronts(np.asarray(addresses, dtype=np.int64) // 4, vector=1)[0]


def smem_accesses(stage, D=64, with_source=False) -> pd.DataFrame:
    """Every shared-memory access in one (j, i) step of the kernel, as the source indexes it: how
    many times each warp executes it, its wavefronts (bank_wavefronts of the lanes' addresses,
    loop counters at 0: the conflict does not depend on them), warps per block, and `cycles`, their
    product: what the step costs the SM's shared-memory pipe, which serves one wavefront a clock.
    Left out: the K and V tile stores, made once per j, so 1/Tr of a step each. with_source adds
    the line of the .cu file each access comes from."""
    slug = _slug(stage)
    t, bcast = np.arange(WARP), np.zeros(WARP, dtype=np.int64)
    if slug == "01_naive":  # lane = thread tx = query row
        rows = [("Qi[(tx * d) + x] = Q[", "Qi[tx*d + x] store", "load Q_i", D, t * D),
                ("Qi[(tx * d) + x] * Kj[(y * d) + x]", "Qi[tx*d + x]", "scores", BC * D, t * D),
                ("Qi[(tx * d) + x] * Kj[(y * d) + x]", "Kj[y*d + x]", "scores", BC * D, bcast),
                ("S[(Bc * tx) + y] = sum", "S[Bc*tx + y] store", "scores", BC, t * BC),
                ("S[(Bc * tx) + y] = __expf(S[(Bc * tx) + y]", "S[Bc*tx + y] load + store", "exp",
                 2 * BC, t * BC),
                ("S[(Bc * tx) + y] * Vj[(y * d) + x]", "S[Bc*tx + y]", "P·V", D * BC, t * BC),
                ("S[(Bc * tx) + y] * Vj[(y * d) + x]", "Vj[y*d + x]", "P·V", D * BC, bcast)]
    else:  # lane tx = key of the tile for S, output column tx, tx+32, ... for O; warp ty = row
        per_lane = math.ceil(D / WARP)
        rows = [("tile[e] = ", "Qi[e] store (load_tile)", "load Q_i",
                 math.ceil(BR * D / (BR * WARP)), t),  # Br*D elements over Br*32 threads
                ("Qi[ty * d + x] * Kj[tx * d + x]", "Qi[ty*d + x]", "scores", D, bcast),
                ("Qi[ty * d + x] * Kj[tx * d + x]", "Kj[tx*d + x]", "scores", D, t * D),
                ("S[ty * Bc + tx] = p", "S[ty*Bc + tx] store", "softmax", 1, t),
                ("S[ty * Bc + y] * Vj[y * d + x]", "S[ty*Bc + y]", "P·V", per_lane * BC, bcast),
                ("S[ty * Bc + y] * Vj[y * d + x]", "Vj[y*d + x]", "P·V", per_lane * BC, t)]
    df = pd.DataFrame(rows, columns=["source", "access", "loop", "per_warp", "words"])
    df["wavefronts"] = [bank_wavefronts(w * 4) for w in df["words"]]
    df["warps"] = WARPS_PER_BLOCK[slug]
    df["cycles"] = df["per_warp"] * df["wavefronts"] * df["warps"]
    return df.drop(columns=["words"] if with_source else ["words", "source"])


def smem_bound_ms(stage, N=1024, D=64, clock_ghz=1.98):
    """A lower bound on the kernel's time from shared memory alone: smem_accesses' cycles per step
    times the Tc * Tr steps of a block, at `clock_ghz` (1.98: the boost clock of an H100 or H200
    SXM). Each block has an SM to itself here (B*H = 64 blocks, 132 SMs), so blocks run side by
    side and one block's time is the kernel's."""
    steps = math.ceil(N / BC) * math.ceil(N / BR)
    return smem_accesses(stage, D)["cycles"].sum() * steps / (clock_ghz * 1e9) * 1e3


# ---------------------------------------------------------------- who does what, and in what order

def serial_fmas(stage, D=64):
    """Multiply-adds one thread does, one after another, per (j, i) step: 01 computes its row's
    Bc scores and D outputs alone; 02 splits them over the 32 lanes."""
    if _slug(stage) == "01_naive":
        return BC * D + D * BC
    return D + math.ceil(D / WARP) * BC


def thread_ownership(stage, D=64):
    """One (j, i) step: the Br x Bc score tile S and the Br x D output tile O, each element coloured
    by the thread (01) or lane (02) that computes it; white lines separate warps. 01: thread t
    owns query row t, all its scores and outputs. 02: warp w owns row w; lane t computes score
    (w, t), and output columns t, t + 32, ..."""
    slug = _slug(stage)
    r, cs, co = np.arange(BR)[:, None], np.arange(BC)[None, :], np.arange(D)[None, :]
    if slug == "01_naive":
        tiles = np.broadcast_to(r, (BR, BC)), np.broadcast_to(r, (BR, D))
        head = "one warp per block: thread t owns query row t"
    else:
        tiles = np.broadcast_to(cs, (BR, BC)), np.broadcast_to(co % WARP, (BR, D))
        head = "32 warps per block: warp w owns row w; lane t owns key t of S, columns t, t+32 of O"
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=[BC, D])
    for ax, tile, name, xl in zip(axes, tiles, ("S = Q_i K_jᵀ   (Br × Bc)", "O_i   (Br × D)"),
                                  ("key in tile j", "head-dim column")):
        im = ax.imshow(tile, cmap=CMAP, vmin=0, vmax=WARP - 1, interpolation="nearest")
        if slug == "02_coalesced":
            for y in range(1, BR):
                ax.axhline(y - 0.5, color="white", lw=0.6)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xl)
        ax.set_ylabel("query row in tile i")
    fig.colorbar(im, ax=axes, label="thread" if slug == "01_naive" else "lane", shrink=0.9)
    fig.suptitle(f"{slug}: {head}\n{serial_fmas(slug, D)} multiply-adds per thread per (j, i) "
                 f"step, one after another", fontsize=10)
    return fig


def loop_order(order="fa1", T=4, N=1024, tile=32):
    """The score matrix as T x T tiles (rows: Q tiles i, columns: K/V tiles j), numbered in the
    order a block visits them. "fa1" (stages 01, 02): K/V tile j outer, Q tile i inner, so every
    visit reads Q_i and reads and writes O_i, m_i, l_i in global memory (red marks). "fa2": Q tile
    outer, and O_i, m_i, l_i stay on chip until the row of tiles is done. The title counts the
    round trips at sequence length N with tile x tile tiles."""
    fa1 = order == "fa1"
    visits = [(i, j) for j in range(T) for i in range(T)] if fa1 else \
             [(i, j) for i in range(T) for j in range(T)]
    fig = Figure(figsize=(7.5, 5.6), layout="constrained")
    ax = fig.subplots()
    blues = matplotlib.colormaps["Blues"]
    for n, (i, j) in enumerate(visits):
        ax.add_patch(Rectangle((j, i), 1, 1, fc=blues(0.1 + 0.5 * n / len(visits)), ec="k", lw=1))
        ax.text(j + 0.5, i + 0.4, str(n + 1), ha="center", va="center", fontsize=13)
        if fa1 or j == T - 1:
            ax.text(j + 0.5, i + 0.75, "⇅ O, m, l" if fa1 else "↑ O", ha="center", va="center",
                    color="tab:red", fontsize=8)
    for j in range(T):
        ax.text(j + 0.5, -0.15, f"K{j}, V{j}", ha="center", va="bottom", fontsize=9)
    for i in range(T):
        ax.text(-0.1, i + 0.5, f"Q{i} → O{i}, m{i}, l{i}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-2.2, T + 0.05)
    ax.set_ylim(T + 0.05, -0.7)
    ax.set_aspect("equal")
    ax.axis("off")
    t = math.ceil(N / tile)
    if fa1:
        title = (f"FlashAttention-1 order (stages 01, 02): K/V tile j outer, Q tile i inner\n"
                 f"⇅ = read Q_i, read and write O_i, m_i, l_i in global memory: at every visit,\n"
                 f"{T * T} round trips here, {t} x {t} = {t * t} per (batch, head) at N = {N}")
    else:
        title = (f"FlashAttention-2 order: Q tile i outer, K/V tile j inner\n"
                 f"O_i, m_i, l_i stay in registers; O_i is written once per row of tiles "
                 f"({t} per (batch, head) at N = {N})")
    ax.set_title(title, fontsize=10)
    return fig


def grid_fill(stages=("01_naive",), B=4, H=16, sms=132, warp_slots=64):
    """One square per SM of a 132-SM GPU (H100, H200), filled from the bottom by the share of its
    64 warp slots the kernel occupies: B*H blocks, one per SM (the block scheduler spreads them),
    grey SMs get no block at all."""
    stages = [stages] if isinstance(stages, (str, int)) else list(stages)
    cols = 12
    rows = math.ceil(sms / cols)
    fig = Figure(figsize=(4.6 * len(stages), 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(stages)))
    for ax, st in zip(axes, stages):
        slug = _slug(st)
        warps, blocks = WARPS_PER_BLOCK[slug], B * H
        for s in range(sms):
            y, x = divmod(s, cols)
            busy = s < blocks
            ax.add_patch(Rectangle((x, y), 0.9, 0.9, fc="#dbe9f6" if busy else "0.88",
                                   ec="tab:blue" if busy else "none", lw=0.6))
            if busy:
                ax.add_patch(Rectangle((x, y + 0.9), 0.9, -0.9 * warps / warp_slots, fc="tab:blue"))
        used = min(blocks, sms) * warps
        ax.set_title(f"{slug}: {blocks} blocks x {warps} warp{'s' * (warps > 1)}\n"
                     f"{min(blocks, sms)} of {sms} SMs busy; {used} of {sms * warp_slots} warp "
                     f"slots ({used / (sms * warp_slots):.1%})", fontsize=10)
        ax.set_xlim(-0.1, cols)
        ax.set_ylim(rows, -0.1)
        ax.set_aspect("equal")
        ax.axis("off")
    return fig


# ---------------------------------------------------------------- stage 04: the shared-memory round trip

WMMA = 16             # the WMMA tile: 16 x 16 x 16; one warp owns 16 query rows
WMMA_WARPS = 4        # warps per block in kernels/04_wmma.cu (BR = 64 rows)
ROUND_TRIP = "round trip"   # traffic that exists only because a fragment's layout is hidden
OPERANDS = "operands"       # K and V: a tensor-core kernel reads them however it is written


def wmma_smem_traffic(D=64, BC=64, elem=2) -> pd.DataFrame:
    """Bytes of shared memory one warp moves per K/V tile in kernels/04_wmma.cu, step by step,
    in the order the kernel runs them: its 16 rows of S, P and O, the whole K and V tiles its
    fragments read, and its quarter of the block's K/V tile stores. `kind` says whether the step
    is a ROUND_TRIP (S, P and O pass through shared memory because WMMA fragments are opaque)
    or moves OPERANDS. `source` is the call of the .cu file the step comes from (its arguments
    are stage 04's exercises)."""
    r, f32 = WMMA, 4
    rows = [
        ("copy K, V tiles (1/4 of the block's stores)", 2 * BC * D * elem // WMMA_WARPS, OPERANDS,
         "load_rows<BC, D, LDK, THREADS>(Ks, K, k0, N, threadIdx.x)"),
        ("QKᵀ: K fragments", BC * D * elem, OPERANDS,
         "wmma::load_matrix_sync(kf, ...)"),
        ("store S (fp32 accumulators)", r * BC * f32, ROUND_TRIP,
         "wmma::store_matrix_sync(Sw ...)"),
        ("softmax: load S", r * BC * f32, ROUND_TRIP,
         "*reinterpret_cast<const float2*>(Sw + softmax_row(i, h) * LDS + 2 * c + 32 * b)"),
        ("softmax: store P", r * BC * elem, ROUND_TRIP,
         "*reinterpret_cast<unsigned*>(Pw + r * LDP + 2 * c + 32 * b)"),
        ("softmax: rescale O rows by α (load + store)", 2 * r * D * f32, ROUND_TRIP,
         "scale_row<D>(Ow + r * LDO, c, alpha)"),
        ("PV: P fragments", r * BC * elem, ROUND_TRIP,
         "wmma::load_matrix_sync(pf[k], ...)"),
        ("PV: V fragments", BC * D * elem, OPERANDS,
         "wmma::load_matrix_sync(vf, ...)"),
        ("PV: load O as accumulator", r * D * f32, ROUND_TRIP,
         "wmma::load_matrix_sync(of, ...)"),
        ("PV: store O", r * D * f32, ROUND_TRIP,
         "wmma::store_matrix_sync(Ow ...)"),
    ]
    return pd.DataFrame(rows, columns=["step", "bytes", "kind", "source"])


def wmma_smem_bytes(D=64, BC=64, BR=64) -> int:
    """A block's dynamic shared memory in kernels/04_wmma.cu (Tiles::SMEM): K and V tiles of
    2-byte elements in rows of D + 8, S in fp32 rows of BC + 8 (P lives inside it), O in fp32
    rows of D + 8 (Q passes through it)."""
    return 2 * BC * (D + 8) * 2 + BR * (BC + 8) * 4 + BR * (D + 8) * 4


def wmma_flops(D=64, BC=64) -> int:
    """Tensor-core FLOPs of one warp per K/V tile: 16 x BC x D for QKᵀ and again for PV, 2 each."""
    return 2 * 2 * WMMA * BC * D


def _box(ax, x, y, text, color, w=1.9, h=1.0):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.04,rounding_size=0.12",
                                fc=color, ec="0.3", lw=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5)


def _arrow(ax, a, b, label="", color="0.2", offset=(0, 0.14), rad=0.0):
    ax.annotate("", b, a, arrowprops=dict(arrowstyle="-|>", color=color, lw=1.4,
                                          shrinkA=0, shrinkB=0, connectionstyle=f"arc3,rad={rad}"))
    if label:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], label, ha="center",
                va="bottom", fontsize=7.5, color=color)


def wmma_dataflow(D=64, BC=64):
    """One warp, one K/V tile of kernels/04_wmma.cu: what lives where (registers, shared memory,
    tensor cores) and the bytes each arrow moves through shared memory (wmma_smem_traffic). Red
    arrows are the round trips that only exist because a WMMA fragment's layout is hidden."""
    t = wmma_smem_traffic(D, BC).set_index("step")["bytes"]
    kib = lambda *steps: f"{sum(t[s] for s in steps) / 1024:.3g} KiB"  # noqa: E731
    smem, regs, tensor, red = "#dbe9f6", "#e5f5e0", "#fde0c5", "tab:red"
    fig = Figure(figsize=(12.5, 5.2), layout="constrained")
    ax = fig.subplots()
    _box(ax, 0.9, 3.6, "Q fragments\n(registers,\nloaded once)", regs)
    _box(ax, 0.9, 1.2, f"K tile {BC}×{D}\n(shared, fp16/bf16)", smem)
    _box(ax, 3.2, 2.4, "wmma\nS = Q·Kᵀ", tensor, w=1.4)
    _box(ax, 5.5, 2.4, f"S  16×{BC}\n(shared, fp32)", smem)
    _box(ax, 7.9, 2.4, "online softmax\n(16 lanes a row:\nmax, exp2, sum;\nm, l in registers)", regs,
         h=1.3)
    _box(ax, 10.3, 2.4, f"P  16×{BC}\n(shared, fp16/bf16,\nover S)", smem)
    _box(ax, 12.5, 2.4, "wmma\nO += P·V", tensor, w=1.4)
    _box(ax, 12.5, 0.6, f"V tile {BC}×{D}\n(shared, fp16/bf16)", smem)
    _box(ax, 10.3, 4.4, f"O  16×{D}\n(shared, fp32)", smem)
    _arrow(ax, (1.85, 3.3), (2.5, 2.6))
    _arrow(ax, (1.85, 1.5), (2.5, 2.2), kib("QKᵀ: K fragments"), offset=(-0.35, 0.05))
    _arrow(ax, (3.9, 2.4), (4.55, 2.4), kib("store S (fp32 accumulators)"), red)
    _arrow(ax, (6.45, 2.4), (6.95, 2.4), kib("softmax: load S"), red, offset=(0, 0.3))
    _arrow(ax, (8.85, 2.4), (9.35, 2.4), kib("softmax: store P"), red, offset=(0, 0.3))
    _arrow(ax, (11.25, 2.4), (11.8, 2.4), kib("PV: P fragments"), red)
    _arrow(ax, (12.5, 1.1), (12.5, 1.9), kib("PV: V fragments"), offset=(0.55, -0.1))
    _arrow(ax, (8.3, 3.05), (9.35, 4.25), "× α per row\n" + kib("softmax: rescale O rows by α (load + store)"),
           red, offset=(-0.75, 0.05))
    _arrow(ax, (11.25, 4.55), (12.3, 2.9), "load as accumulator\n" + kib("PV: load O as accumulator"), red,
           offset=(0.95, 0.25), rad=-0.25)
    _arrow(ax, (12.7, 2.9), (11.25, 4.25), "store\n" + kib("PV: store O"), red, offset=(0.9, -0.45),
           rad=-0.25)
    df = wmma_smem_traffic(D, BC)
    total, trip = df["bytes"].sum(), df.loc[df["kind"] == ROUND_TRIP, "bytes"].sum()
    ax.legend(handles=[Patch(fc=regs, ec="0.3", label="registers"),
                       Patch(fc=smem, ec="0.3", label="shared memory"),
                       Patch(fc=tensor, ec="0.3", label="tensor cores"),
                       Patch(fc=red, label="round trip forced by opaque fragments")],
              loc="lower left", fontsize=8, ncol=2, bbox_to_anchor=(0.0, -0.02))
    ax.set_xlim(-0.2, 14.0)
    ax.set_ylim(-0.4, 5.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"stage 04, one warp (16 query rows) and one K/V tile, D = {D}, BC = {BC}: "
                 f"{total / 1024:.0f} KiB of shared-memory traffic\nfor {wmma_flops(D, BC) / 1e6:.2f} "
                 f"MFLOP of tensor-core work; {trip / total:.0%} of the bytes are round trips "
                 f"(red, in KiB per warp and tile)", fontsize=10)
    return fig


# ---------------------------------------------------------------- stages 06 and 07: loads against math

def pipeline_schedule(load, compute, tiles=6, stages=2, latency=0.0) -> pd.DataFrame:
    """When one block's K/V tiles load and are computed: a tile issued at time t starts arriving
    `latency` later (the round trip to L2 or DRAM; copies in flight overlap their latencies) and
    then streams in for `load` (its bytes at the block's bandwidth; transfers share one link, in
    the order issued); it takes `compute` to be used. With latency=0 this is a pure bandwidth
    model. stages=1 is stage 06: at the top of iteration j a barrier (everyone is done with tile
    j - 1), the load of tile j into the one buffer, a barrier, the math. stages=2 (or more) is
    stage 07: tiles 0 .. stages-2 are issued before the loop; at the top of iteration j the block
    waits for tile j (cp.async.wait_group + one barrier), issues tile j + stages - 1 into the
    buffer tile j - 1 used, and computes tile j while it loads.
    Returns a row per tile: load_issue, load_start (first byte arrives), load_end, compute_start,
    compute_end."""
    if stages < 1 or tiles < 1:
        raise ValueError("stages and tiles are at least 1")
    if latency < 0:
        raise ValueError("latency is not negative")
    issue = {k: 0.0 for k in range(min(stages - 1, tiles))}
    rows, load_free, done = [], 0.0, 0.0
    for j in range(tiles):
        if stages == 1:
            issue[j] = done                     # the buffer is free once tile j - 1 is computed
        start_load = max(issue[j] + latency, load_free)
        load_free = start_load + load
        start = max(done, load_free)            # wait for tile j (and, in 06, its barrier)
        if stages > 1 and j + stages - 1 < tiles:
            issue[j + stages - 1] = start       # refill the buffer of tile j - 1
        done = start + compute
        rows.append(dict(tile=j, load_issue=issue[j], load_start=start_load, load_end=load_free,
                         compute_start=start, compute_end=done))
    return pd.DataFrame(rows).set_index("tile")


def pipeline_period(load, compute, stages=2, latency=0.0) -> float:
    """Time per tile once pipeline_schedule's loop is full. Serial (stages=1): latency + load +
    compute. With `stages` buffers the slowest of three limits: the math (compute), the link
    (load), and the latency: a tile issued `stages - 1` tiles ahead must arrive in time, so
    (stages - 1) x period >= latency + load. That last one is Little's law: the tiles in flight
    must cover the bandwidth x latency product."""
    if stages == 1:
        return latency + load + compute
    return max(compute, load, (latency + load) / (stages - 1))


def pipeline_stages_needed(load, compute, latency=0.0) -> int:
    """The fewest buffers that hide the latency: (stages - 1) x max(load, compute) >= latency +
    load. Two whenever latency <= max(load, compute) - load."""
    return 1 + math.ceil((latency + load) / max(load, compute) - 1e-9)


def pipeline_speedup_bound(load, compute, latency=0.0, stages=2) -> float:
    """Per tile, serial (06) over `stages` buffers (07), once the pipeline is full
    (pipeline_period). Without latency (load + compute) / max(load, compute): at most 2, reached
    when the two are equal."""
    return (pipeline_period(load, compute, 1, latency)
            / pipeline_period(load, compute, stages, latency))


def pipeline_timeline(load, compute, tiles=6, stages=2, unit="ns", latency=0.0, versus=1):
    """pipeline_schedule with `versus` buffers (1: stage 06, serial) above `stages` buffers
    (stage 07), on one time axis: per K/V tile a bar on the copy row (global -> shared) and one
    on the math row (tensor cores, softmax); with a latency, a thin bar on a third row from each
    tile's issue to its first byte. Dashed lines are the barriers. The titles give the total and
    the time per tile; the figure's title the speedup and its bound for many tiles."""
    def name(n):
        return ("06_swizzle: load, barrier, compute" if n == 1 else
                f"{n} buffers, tile j + {n - 1} issued during tile j")
    if not 1 <= versus < stages:
        raise ValueError("versus is at least 1 and fewer buffers than stages")
    plans = {name(n): pipeline_schedule(load, compute, tiles, n, latency) for n in (versus, stages)}
    fig = Figure(figsize=(12, 5.4 if latency else 4.6), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    colors = matplotlib.colormaps["tab10"]
    for ax, (title, plan) in zip(axes, plans.items()):
        for j, r in plan.iterrows():
            for y, (a, b) in ((1, (r.load_start, r.load_end)), (0, (r.compute_start, r.compute_end))):
                ax.broken_barh([(a, b - a)], (y - 0.35, 0.7), color=colors(j % 10),
                               alpha=0.55 if y else 0.9, ec="k", lw=0.6)
                ax.text((a + b) / 2, y, f"K/V {j}", ha="center", va="center", fontsize=8)
            if latency:
                y = 2 + (0.18 if j % 2 else -0.18)   # alternate, so overlapping latencies show
                ax.broken_barh([(r.load_issue, r.load_start - r.load_issue)], (y - 0.12, 0.24),
                               color=colors(j % 10), alpha=0.5, lw=0)
            barriers = [r.compute_start] if "buffers" in title else [r.load_issue, r.compute_start]
            for x in barriers:
                ax.axvline(x, color="0.4", ls="--", lw=0.7)
        total = plan["compute_end"].iloc[-1]
        rows = ["math", "copy"] + (["latency"] if latency else [])
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_title(f"{title}: {total:.0f} {unit} for {tiles} tiles "
                     f"({total / tiles:.0f} {unit} a tile)", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel(f"time ({unit}); dashed: __syncthreads")
    serial, piped = (p["compute_end"].iloc[-1] for p in plans.values())
    lat = f", latency {latency:.0f} {unit}" if latency else ""
    bound = (pipeline_period(load, compute, versus, latency)
             / pipeline_period(load, compute, stages, latency))
    fig.suptitle(f"A model of one block's K/V loop: load {load:.0f} {unit}, compute {compute:.0f} "
                 f"{unit} a tile{lat} — {serial / piped:.2f}x faster over {tiles} tiles, at most "
                 f"{bound:.2f}x over many", fontsize=10)
    return fig


# --- the capstone: attention as a transformer calls it --------------------------------------------

QKV_COLORS = {"q": "#9ecae1", "k": "#fdd0a2", "v": "#c7e9c0"}


def projection_layout(H=4, tokens=4, head=1):
    """How a transformer lays out q, k and v: one projection of each token, (B, N, 3·H·D) —
    q's H heads, then k's, then v's, D elements each — and attention's (B, H, N, D) views of it.
    Head `head` of q is outlined in every token's row: its rows are 3·H·D elements apart, not D.
    (Drawn with H heads; GPT-2 small has H = 12, D = 64.)"""
    fig = Figure(figsize=(10, 0.9 + 0.62 * tokens))
    ax = fig.subplots()
    per = 3 * H
    for n in range(tokens):
        y = tokens - 1 - n
        for j in range(per):
            which = "qkv"[j // H]
            outline = which == "q" and j % H == head
            ax.add_patch(Rectangle((j, y), 0.94, 0.8, fc=QKV_COLORS[which],
                                   ec="#08519c" if outline else "0.55", lw=2.2 if outline else 0.6))
            ax.text(j + 0.47, y + 0.4, f"{which}{j % H}", ha="center", va="center", fontsize=8)
        ax.text(-0.3, y + 0.4, f"token {n}", ha="right", va="center", fontsize=9)
        if n < tokens - 1:
            ax.annotate("", (head + 0.47, y - 0.2), (head + 0.47, y + 0.0),
                        arrowprops=dict(arrowstyle="-|>", color="#08519c", lw=1.2))
    ax.annotate("", (per - 0.06, tokens - 0.08), (0, tokens - 0.08),
                arrowprops=dict(arrowstyle="<->", color="#08519c", lw=1.2))
    ax.text(per / 2, tokens + 0.0, "one token's row: 3·H·D elements = the row stride of every "
            "view (heads D apart, batches N·3·H·D apart)", ha="center", va="bottom", fontsize=8.5,
            color="#08519c")
    ax.set_xlim(-2.2, per + 0.2)
    ax.set_ylim(-0.3, tokens + 0.45)
    ax.axis("off")
    ax.set_title(f"One (B, N, 3·H·D) projection, seen by attention as three (B, H, N, D) views "
                 f"(H = {H} drawn)", fontsize=10)
    ax.legend(handles=[Patch(fc=c, ec="0.55", label=f"{w}: heads 0..H-1, D elements each")
                       for w, c in QKV_COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def amdahl(share, speedup) -> float:
    """The whole's time, as a fraction of before, when a part taking `share` of it runs
    `speedup`× faster (below 1: slower) and the rest is unchanged."""
    return (1 - share) + share / speedup
