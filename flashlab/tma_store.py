"""Stage 12 on the CPU: the end of a work item, O from registers (stage 11) or through shared
memory and a TMA store (stage 12), counted from the kernels' own indexing (no GPU needed).

kernels/12_tma_store.cu writes O into shared memory in the 128-byte swizzle (flashlab.wgmma.sw128)
and copies it out with a TMA store, where kernels/11_warpspec.cu stores it from registers.
tests/test_hopper.py keeps the lines of both each function here follows.

    from flashlab import tma_store
    tma_store.o_store_requests(128)        # instructions, sectors and wavefronts, both ways
    tma_store.o_store_figure(D=64, d=0)    # one warp instruction, both ways
    tma_store.overlaps()                   # FlashAttention-3's overlaps beside the stage (GPU or
    tma_store.overlap_profile()            #   replay of data/variants.csv and profile.csv)
"""
import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from . import tables, variants
from .banks import BANK_BYTES, BANKS, wavefronts
from .configs import Config
from .diagrams import SECTOR, sectors_per_request
from .hopper_common import LABEL, M, TEXT, TITLE, WARP, gain
from .stages import stage as _stage
from .warpspec import warpspec_schedule
from .wgmma import sw128


def _o_words(warp, d, half):
    """The 32 lanes of one warp's write of O in 12_tma_store.cu / 11_warpspec.cu: rows
    warp * 16 + g (+ 8 for half 1), columns 8 d + 2 t and + 1 (4 bytes a lane). Returns (rows,
    cols) of each lane's first element, rows counted in the consumer's 64."""
    lane = np.arange(WARP)
    g, t = lane // 4, lane % 4
    return warp * 16 + g + 8 * half, 8 * d + 2 * t


def o_store_requests(D=128) -> pd.DataFrame:
    """How one consumer warpgroup's 64 x D tile of O (16-bit) reaches global memory, both ways,
    counted from the kernels' own indexing.
    * stage 11 (`*reinterpret_cast<uint32_t*>(Ob + r * L.o.n + 8 * d + 2 * t) = ...`): each
      thread stores 4 bytes of rows r and r + 8, 8-column tile d by tile d, with st.global; one
      warp instruction writes 16 bytes in each of 8 rows;
    * stage 12: the same 4 bytes go to shared memory in the 128-byte swizzle (sw128), then one
      thread copies the tile out in D / 64 TMA boxes of 64 rows x 64 columns.
    Columns: warp instructions of the warpgroup; 32-byte sectors written to L2 (stage 11: counted
    per instruction, as each instruction sends its own); bytes of O per sector written; for the
    shared-memory stores, the wavefronts one instruction takes (flashlab.banks: 1 = no bank
    conflict); TMA boxes."""
    if D % 64:
        raise ValueError("D is a multiple of 64 (64 or 128 in the kernels)")
    instr = sectors11 = worst = 0
    for warp in range(4):
        for d in range(D // 8):
            for half in (0, 1):
                rows, cols = _o_words(warp, d, half)
                instr += 1  # one st.global in stage 11, one st.shared in stage 12
                sectors11 += sectors_per_request(rows * 2 * D + cols * 2).sectors  # row-major O
                words = sw128(2 * M, rows, cols) // BANK_BYTES  # a 128-row item, like BR
                worst = max(worst, wavefronts(words)[0])
    tile = M * D * 2
    return pd.DataFrame([
        dict(way="stage 11: st.global from registers", instructions=instr,
             sectors=sectors11, bytes_per_sector=tile / sectors11, smem_wavefronts=np.nan,
             tma_boxes=0),
        dict(way="stage 12: st.shared, then a TMA store", instructions=instr,
             sectors=tile // SECTOR, bytes_per_sector=float(SECTOR), smem_wavefronts=worst,
             tma_boxes=D // 64)]).set_index("way")


def o_store_figure(D=64, d=0):
    """One warp instruction of the end of a work item, both ways (warp 0, 8-column tile d, rows
    0-7). Left, stage 11: the rows of O in global memory, 4-byte words, lane numbers where this
    instruction writes; red boxes: the 32-byte sectors it touches, each half used. Right, stage
    12: the same lanes' words in shared memory, one 128-byte line (all 32 banks) per row, at the
    128-byte swizzle's places: every lane in a bank of its own, one wavefront."""
    fig = Figure(figsize=(15, 4.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    rows, cols = _o_words(0, d, 0)
    lanes = np.arange(WARP)
    words_per_row = 2 * D // BANK_BYTES
    # stage 11: global memory, row-major, D * 2 bytes a row
    grid = np.full((8, words_per_row), np.nan)
    col_word = cols * 2 // BANK_BYTES
    grid[rows, col_word] = lanes
    show = min(words_per_row, 32)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.94")
    left.imshow(np.ma.masked_invalid(grid[:, :show]), cmap=cmap, vmin=0, vmax=31, aspect="equal",
                interpolation="nearest")
    for lane, r, w in zip(lanes, rows, col_word):
        left.text(w, r, lane, ha="center", va="center", fontsize=9, color="white")
    per_sector = SECTOR // BANK_BYTES
    for r in range(8):
        for s in range(show // per_sector):
            hit = np.any((rows == r) & (col_word // per_sector == s))
            left.add_patch(Rectangle((s * per_sector - 0.5, r - 0.5), per_sector, 1, fill=False,
                                     ec="red" if hit else "0.6", lw=3 if hit else 0.8))
    req = o_store_requests(D)
    left.set_title(f"Stage 11: st.global of one warp (tile d = {d})\n8 rows x 16 bytes: 8 "
                   f"sectors of 32 bytes, each half written", fontsize=LABEL + 1)
    left.set_yticks(range(8), [f"row {r}" for r in range(8)], fontsize=TEXT)
    starts = np.arange(0, show, per_sector)
    left.set_xticks(starts, [f"+{w * BANK_BYTES}" for w in starts], fontsize=TEXT)
    shown = ", first 128 shown" if show < words_per_row else ""
    left.set_xlabel(f"byte in the row of O ({2 * D} bytes a row{shown})", fontsize=LABEL)
    # stage 12: shared memory, sw128
    smem = np.full((8, 32), np.nan)
    off = sw128(2 * M, rows, cols)
    bank = (off // BANK_BYTES) % BANKS
    smem[rows, bank] = lanes
    right.imshow(np.ma.masked_invalid(smem), cmap=cmap, vmin=0, vmax=31, aspect="equal",
                 interpolation="nearest")
    for lane, r, b in zip(lanes, rows, bank):
        right.text(b, r, lane, ha="center", va="center", fontsize=9, color="white")
    for r in range(8):
        for c in range(8):
            right.add_patch(Rectangle((4 * c - 0.5, r - 0.5), 4, 1, fill=False, ec="0.6",
                                      lw=0.8))
    waves = int(req.loc["stage 12: st.shared, then a TMA store", "smem_wavefronts"])
    right.set_title(f"Stage 12: st.shared of the same warp, 128-byte swizzle\nrow r's chunk "
                    f"{d % 8} at chunk {d % 8} ^ r: 32 lanes in 32 banks, {waves} wavefront",
                    fontsize=LABEL + 1)
    right.set_yticks(range(8), [f"row {r}" for r in range(8)], fontsize=TEXT)
    right.set_xticks(range(0, 32, 4), range(0, 32, 4), fontsize=TEXT)
    right.set_xlabel("bank (4 bytes each; grey boxes: 16-byte chunks)", fontsize=LABEL)
    s11 = req.iloc[0]
    fig.suptitle(f"The end of a work item, one warp instruction (D = {D}; number: lane)\nA "
                 f"consumer warpgroup's 64 x {D} tile of O takes {int(s11.instructions)} such "
                 f"instructions: {int(s11.sectors)} half-used sectors from registers, or "
                 f"{int(req.iloc[1].sectors)} full ones written by the TMA", fontsize=TITLE - 1)
    return fig


def store_gain(n_tiles=(4, 8, 16, 32, 64, 128), items=6, store11=1.2, store12=0.2,
               **times) -> pd.Series:
    """Stage 11's time over stage 12's per number of K/V tiles in a work item: warpspec_schedule
    (the same producer and consumers) with a consumer's end of item taking `store11` (its
    st.global, and the wait for them to drain before O's registers are reused) or `store12` (its
    st.shared, a named barrier and one TMA store; the copy itself runs under the next item).
    The other times are warpspec_schedule's keyword arguments."""
    def total(store):
        return lambda tiles: warpspec_schedule(tiles=tiles, stages=2, store=store, **times).total
    return gain(n_tiles, items, "stage 11 time / stage 12 time", total(store11), total(store12))


# --- FlashAttention-3's two overlaps, run beside the stage (section 10) ----------------------------

# Where the overlaps are profiled: a point of the sweep at D = 128 without the mask, where the
# products of one consumer's tile take longest beside its softmax.
OVERLAP_PROFILED = Config(4, 16, 4096, 128, False, "fp16")
OVERLAP_METRICS = ("duration_ms", "tensor_pipe_pct", "stall_wait", "stall_barrier",
                   "stall_long_scoreboard", "stall_short_scoreboard", "stall_math_pipe_throttle",
                   "stall_selected")


def _gpu_said(st, what="each kernel timed in turn with stage 12 there"):
    """The GPU the overlaps' rows come from (tables.variant_gpu), said when it is not the GPU the
    rest of the notebook shows."""
    gpu, shown = tables.variant_gpu(st), tables.gpu_shown(st)
    if gpu != shown:
        print(f"(not recorded on {shown}: as recorded on {gpu}, {what})")
    return gpu


def overlaps(measure=None) -> pd.DataFrame:
    """Stage 12 and its three variants (the registry's: no_overlap, in_warpgroup, ping_pong),
    config by config: each variant's speed over stage 12, timed in turn with it, and each overlap
    over the kernel it is added to (in_warpgroup over no_overlap, ping_pong over in_warpgroup).
    Live on a Hopper GPU (measure=None: when the stage runs here) the variants are built,
    checked against float64 and timed now, and recorded; in replay, as recorded."""
    st = _stage(12)
    if measure if measure is not None else tables.live(st):
        variants.measure(st, log=lambda msg: None)
    gpu = _gpu_said(st)
    rows = tables.variant_rows(st, gpu)
    rows = rows[rows["check_passed"]].copy()
    rows["name"] = rows["variant"].str.split("+").str[1]
    wide = rows.pivot_table(index=["D", "causal", "N"], columns="name", values="ratio")
    wide = wide[[v.name for v in st.variants if v.name in wide.columns]]
    wide.columns = [f"{c} / 12" for c in wide.columns]
    if {"in_warpgroup / 12", "no_overlap / 12"} <= set(wide.columns):
        wide["in_warpgroup / no_overlap"] = wide["in_warpgroup / 12"] / wide["no_overlap / 12"]
    if {"ping_pong / 12", "in_warpgroup / 12"} <= set(wide.columns):
        wide["ping_pong / in_warpgroup"] = wide["ping_pong / 12"] / wide["in_warpgroup / 12"]
    return wide.round(3)


def overlap_profile(measure=None) -> pd.DataFrame:
    """Nsight Compute's view of stage 12 and its variants at OVERLAP_PROFILED: the kernel's time,
    the tensor pipe's busy share and the main stall reasons (% of warp cycles), one column per
    kernel. Profiled now where the stage runs and ncu is here (and recorded), else as recorded."""
    from . import profile as prof
    st = _stage(12)
    ok, _ = prof.available()
    if (measure if measure is not None else tables.live(st)) and ok:
        prof.profile(st, OVERLAP_PROFILED)
        for v in st.variants:
            prof.profile(st, OVERLAP_PROFILED, variant=v.name)
    gpu = _gpu_said(st, "each kernel profiled there")
    recorded = tables.profile_rows(gpu)
    names = [st.slug] + [v.slug for v in st.variants]
    wide = (tables.profile_wide(recorded, OVERLAP_PROFILED) if recorded is not None
            else pd.DataFrame())
    if st.slug not in wide.index or not any(n in wide.index for n in names[1:]):
        raise tables.NotRecorded(f"the overlaps' profile at {OVERLAP_PROFILED.label}: not "
                                 f"recorded on {gpu} yet (notebook 12 records it when it runs "
                                 f"live there, with Nsight Compute)")
    shown = [n for n in names if n in wide.index]
    table = wide.loc[shown, [m for m in OVERLAP_METRICS if m in wide.columns]].T
    table.columns = ["12" if n == st.slug else n.split("+")[1] for n in shown]
    return table.round(3)
