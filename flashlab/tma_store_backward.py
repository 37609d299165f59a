"""Stage 23 on the CPU: the end of a backward block, dK_j and dV_j stored from registers (stage 22)
or through shared memory and the TMA (stage 23), counted from the kernels' indexing and drawn on
one SM's timeline from measured costs (no GPU needed).

In kernels/22_overlap_backward.cu each consumer thread stores its dK and dV accumulators straight
to global memory, 4 bytes at a time; the block cannot exit, and the next block of the grid cannot
start on its SM, until those stores have left. In kernels/23_tma_store_backward.cu the threads
write the two tiles into the freed ring of Q_i and dO_i, 128-byte swizzled, and the TMA writes
them out: the block ends once the TMA has read shared memory.

    from flashlab import tma_store_backward
    tma_store_backward.stores()        # instructions, sectors, wavefronts of one block's end
    tma_store_backward.block_life()    # one block's start, walk and end, in microseconds
    tma_store_backward.figure()        # one SM's timeline, and the end's share of a block by N
    tma_store_backward.predicted()     # whole backward, stage 22 over stage 23, per N (D = 128)
"""
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .banks import BANK_BYTES, wavefronts
from .configs import SWEEP
from .deterministic_hopper import BC, SMS  # keys a block; SMs, one block each at a time
from .diagrams import SECTOR, sectors_per_request
from .hopper_common import LABEL, TEXT, TITLE, WARP
from .warpspec_backward import CONSUMER_THREADS
from .wgmma import sw128
from .wgmma_backward import query_rows

CONSUMER_WARPS = CONSUMER_THREADS // WARP  # two consumer warpgroups

# Measured on an NVIDIA H200, fp16, D = 128, B N = 16k, H = 16 (2048 blocks): the backward's main
# kernel in microseconds (data/runs/backward-22-short-diag-h200-20261201T0349Z.log and
# ...T0352Z.log). "no stores" is stage 22 with the dK and dV stores left out (timing only).
MAIN_US = {"22, N = 512": 414.7, "22, N = 1024": 684.5, "22 no stores, N = 512": 330.5,
           "23, N = 512": 357.9, "22 beside 23, N = 512": 417.3}
# The whole backward of stage 22 (its Δ pre-pass, main kernel, dQ conversion), timed in turn in
# the ...T0352Z run, in microseconds, D = 128 without the mask.
WHOLE_22_US = {512: 541.2, 1024: 817.7, 2048: 1428.0, 4096: 2710.4, 8192: 5211.6,
               16384: 10229.8}


def blocks(D=128) -> int:
    """Blocks of the backward's grid over the sweep: B H N / BC, the same at every N."""
    return SWEEP.tokens * (SWEEP.width // D) // BC


def _end_words(warp, n, half):
    """Rows (within the block's 128 keys, consumer warpgroup 0) and columns of one warp's 4-byte
    pieces of dK or dV in both kernels: rows 16 warp + g (+ 8 for half 1), columns 8 n + 2 t."""
    lane = np.arange(WARP)
    return 16 * warp + lane // 4 + 8 * half, 8 * n + 2 * (lane % 4)


def stores(D=(64, 128)) -> pd.DataFrame:
    """One backward block's end, both ways, per head dim: the bytes of dK_j and dV_j (16-bit), the
    warp instructions that write them (stage 22: st.global, 8 rows x 16 bytes each; stage 23:
    st.shared, the same pieces), the 32-byte sectors those global stores touch and the bytes
    used per sector, the wavefronts of the worst shared-memory store in the 128-byte swizzle
    (1 = no bank conflict), and the TMA's boxes (64 columns x 128 rows)."""
    rows = []
    for d in np.atleast_1d(D):
        d = int(d)
        tile = 2 * BC * d * 2                                    # dK and dV
        per_warp = 2 * (d // 8) * 2                              # halves x n-tiles x tensors
        sectors, worst = 0, 0
        for n in range(d // 8):
            for half in (0, 1):
                r, c = _end_words(0, n, half)
                sectors += sectors_per_request(r * 2 * d + c * 2).sectors
                worst = max(worst, wavefronts(sw128(BC, r, c) // BANK_BYTES)[0])
        sectors *= 2 * CONSUMER_WARPS                            # both tensors, every warp
        instr = per_warp * CONSUMER_WARPS
        rows += [dict(D=d, way="22: st.global", bytes=tile,
                      instructions=instr, sectors=sectors, bytes_per_sector=tile / sectors,
                      smem_wavefronts=np.nan, tma_boxes=0),
                 dict(D=d, way="23: st.shared, TMA", bytes=tile,
                      instructions=instr, sectors=tile // SECTOR,
                      bytes_per_sector=float(SECTOR), smem_wavefronts=worst,
                      tma_boxes=2 * (d // 64))]
    return pd.DataFrame(rows).set_index(["D", "way"])


def block_life(N=512, saved_us=None) -> pd.Series:
    """One block's life on its SM at D = 128, in microseconds, from MAIN_US: the kernel's time
    is a line in the query blocks each block walks (N / 64), over blocks() / SMS blocks an SM.
    Its slope is the walk; its intercept, the block's start and end; stage 22's end is what
    leaving the stores out saved. With `saved_us`, stage 23's end too: stage 22's less saved_us
    over the grid (a prediction), or "measured" for what stage 23 saved in MAIN_US."""
    per_sm = blocks(128) / SMS
    q = query_rows(128)
    walk = (MAIN_US["22, N = 1024"] - MAIN_US["22, N = 512"]) / ((1024 - 512) / q) / per_sm
    fixed = MAIN_US["22, N = 512"] / per_sm - (512 / q) * walk
    end22 = (MAIN_US["22, N = 512"] - MAIN_US["22 no stores, N = 512"]) / per_sm
    out = {"start": fixed - end22, "walk": walk * N / q, "end, stage 22": end22}
    if saved_us is not None:
        if saved_us == "measured":
            saved_us = MAIN_US["22 beside 23, N = 512"] - MAIN_US["23, N = 512"]
        out["end, stage 23"] = end22 - saved_us / per_sm
    out["query blocks"] = N / q
    return pd.Series(out, name=f"N = {N}").round(2)


def predicted(saved_us=(45.0, 70.0)) -> pd.DataFrame:
    """Stage 22's whole backward (WHOLE_22_US) over stage 23's, at D = 128 without the mask, if
    stage 23 saves `saved_us` microseconds (a low and a high guess) at every N: the grid has the
    same blocks at every N of the sweep, so the saving does not grow with N."""
    t = pd.Series(WHOLE_22_US)
    return pd.DataFrame({f"saves {s:g} µs": t / (t - s) for s in saved_us}).rename_axis("N").T


def figure(N=512, shown=3, saved_us=57.5) -> Figure:
    """Left: one SM at N (D = 128), `shown` blocks one after another in each stage: each block's
    start (K_j and V_j in), its walk over the query blocks, its end (dK_j and dV_j out); the next
    block starts when the last one exits. Right: the end's share of a block's life against N.
    Stage 22 as measured (block_life); stage 23's end saves `saved_us` over the grid: by default
    the middle of the notebook's prediction ("measured": what it saved)."""
    fig = Figure(figsize=(14, 4.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.6, 1))
    life = block_life(N, saved_us)
    colors = {"start": "#8172B3", "walk": "#4C72B0", "end": "#DD8452"}
    for y, stage in ((1.1, "22"), (0.1, "23")):
        t = 0.0
        parts = (("start", life["start"]), ("walk", life["walk"]),
                 ("end", life[f"end, stage {stage}"]))
        for _ in range(shown):
            for name, length in parts:
                left.add_patch(Rectangle((t, y), length, 0.8, fc=colors[name], ec="white", lw=1.5))
                if name == "walk" or (name == "end" and stage == "22"):
                    left.text(t + length / 2, y + 0.4, name, ha="center", va="center",
                              fontsize=TEXT - 1, color="white")
                t += length
        left.text(t + 0.5, y + 0.4, f"{t / shown:.1f} µs a block", va="center", fontsize=TEXT)
    left.legend(handles=[Rectangle((0, 0), 1, 1, fc=c, label=lab) for lab, c in
                         (("start: K_j, V_j in", colors["start"]), ("walk: query blocks",
                          colors["walk"]), ("end: dK_j, dV_j out", colors["end"]))],
                fontsize=TEXT - 1, ncols=3, loc="upper left", frameon=False)
    left.set_xlim(0, shown * (life["start"] + life["walk"] + life["end, stage 22"]) * 1.18)
    left.set_ylim(0, 2.3)
    left.set_yticks([1.5, 0.5], ["stage 22:\nstores from registers", "stage 23:\nthe TMA"],
                    fontsize=LABEL - 1)
    left.set_xlabel(f"time on one SM, µs (N = {N}, D = 128, "
                    f"{life['query blocks']:.0f} query blocks a block)", fontsize=LABEL)
    left.set_title("The next block waits for the last one's end", fontsize=LABEL, loc="left")
    ns = np.array(SWEEP.ns)
    for stage, style in (("22", "o-"), ("23", "s--")):
        lives = [block_life(n, saved_us) for n in ns]
        share = [b[f"end, stage {stage}"] / (b["start"] + b["walk"] + b[f"end, stage {stage}"])
                 for b in lives]
        right.plot(ns, 100 * np.array(share), style, label=f"stage {stage}")
    right.set_xscale("log", base=2)
    right.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
    right.set_xlabel("sequence length N", fontsize=LABEL)
    right.set_ylabel("the end's share of a block (%)", fontsize=LABEL)
    right.legend(fontsize=TEXT)
    right.set_title("A fixed cost: large where blocks are short", fontsize=LABEL,
                    loc="left")
    for ax in (left, right):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    told = ("as measured" if saved_us == "measured"
            else f"predicted: {saved_us:g} µs less over the grid")
    fig.suptitle(f"One SM of the backward's grid on the H200: stage 22 measured, stage 23 {told}",
                 fontsize=TITLE - 2)
    return fig
