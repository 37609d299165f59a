"""Stage 10 on the CPU: the tensor memory accelerator's boxes and the mbarrier ring, from the
kernel's own indexing (no GPU needed).

kernels/10_tma.cu fills the 128-byte-swizzled tiles of stage 09 (flashlab.wgmma.sw128) with the
TMA (`cp.async.bulk.tensor`), one elected thread issuing, and counts their completion on a ring of
mbarriers: a full and an empty barrier per buffer, each waited on with a phase parity.
tests/test_hopper.py keeps the lines of 10_tma.cu each function here follows.

    from flashlab import tma
    tma.tma_boxes(N=300, D=128, BC=128, tile=2)     # the copies of one K/V tile
    tma.ring_timeline(n_tiles=8, stages=3)          # the ring on a time axis
"""
import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .hopper_common import LABEL, ROW_BYTES, TEXT, TITLE


def tma_boxes(N=300, D=128, BC=128, tile=2) -> pd.DataFrame:
    """The copies 10_tma.cu issues for K/V tile `tile`: D/64 boxes of 64 columns x BC rows,
    box blk from column blk * 64, row tile * BC, written blk * BC * 128 bytes into the buffer. Rows past
    N arrive as zeros and still count toward the mbarrier's expected bytes."""
    if D % 64:
        raise ValueError("a box is 64 columns (128 bytes, the most a 128-byte swizzle takes)")
    if not 1 <= BC <= 256:
        raise ValueError("a box dimension is 1 to 256 elements")
    if not 0 <= tile < math.ceil(N / BC):
        raise ValueError(f"N = {N} has {math.ceil(N / BC)} tiles of {BC} rows")
    row0 = tile * BC
    return pd.DataFrame([dict(box=b, col0=64 * b, row0=row0, rows=BC, dst=b * BC * ROW_BYTES,
                              bytes=BC * ROW_BYTES, zero_rows=max(0, row0 + BC - N))
                         for b in range(D // 64)])


BOX_COLORS = ("#6baed6", "#fd8d3c", "#74c476", "#9e9ac8")


def tma_box_figure(N=300, D=128, BC=128, tile=2):
    """Left: the K matrix of one (batch, head), N rows x D columns, cut into tiles of BC rows;
    tile `tile` is D/64 TMA boxes of 64 columns (one cp.async.bulk.tensor each), rows past N
    hatched: the copy engine writes zeros there. Right: where the boxes land in the buffer, one
    after another -- flashlab.wgmma.sw128's layout, each block a 128-byte-swizzled rows x 64
    tile."""
    boxes = tma_boxes(N, D, BC, tile)
    n_tiles = math.ceil(N / BC)
    row0, zero = tile * BC, int(boxes.zero_rows.iloc[0])
    fig = Figure(figsize=(14, 8.5), layout="constrained")
    ax = fig.subplots()
    gap = 0.6 * D
    sx = D + gap                                   # x where shared memory is drawn
    # the matrix
    ax.add_patch(Rectangle((0, 0), D, N, fc="0.95", ec="k", lw=2))
    for k in range(n_tiles):
        top = k * BC
        ax.plot([0, D], [top, top], color="0.4", lw=1, ls="--")
        ax.text(-0.02 * D, top + min(BC, N - top) / 2,
                f"tile {k}\nrows {top}–{min(N, top + BC) - 1}", ha="right", va="center",
                fontsize=TEXT, fontweight="bold" if k == tile else "normal")
    for _, b in boxes.iterrows():
        c = BOX_COLORS[b.box % 4]
        ax.add_patch(Rectangle((b.col0, row0), 64, BC, fc=c, alpha=0.55, ec="k", lw=2.5))
        ax.text(b.col0 + 32, row0 + (BC - zero) / 2,
                f"box {b.box}: columns\n{b.col0}–{b.col0 + 63}, at\n({b.col0}, {row0}, h, b)",
                ha="center", va="center", fontsize=TEXT)
        # where it lands
        y = b.box * BC
        ax.add_patch(Rectangle((sx, y), 64, BC, fc=c, alpha=0.55, ec="k", lw=2.5))
        ax.text(sx + 32, y + (BC - zero) / 2,
                f"rows {row0}–{row0 + BC - zero - 1}\n({BC - zero} rows of K)" if zero
                else f"rows {row0}–{row0 + BC - 1}", ha="center", va="center", fontsize=TEXT)
        # the whole box, zero-filled rows included: a bracket over all BC rows, labelled beside it
        bx = sx + 68
        ax.plot([bx, bx + 3, bx + 3, bx], [y + 1, y + 1, y + BC - 1, y + BC - 1], color="k",
                lw=1.5)
        ax.text(bx + 6, y + BC / 2, f"box {b.box} (all of it),\nat +{b.dst} B:\n{BC} rows × 128 B\n"
                f"= {b.bytes // 1024} KiB,\n128-byte swizzle",
                ha="left", va="center", fontsize=TEXT)
        ax.annotate("", (sx - 1.5, y + (BC - zero) / 2), (b.col0 + 32, row0 - 1),
                    arrowprops=dict(arrowstyle="-|>", color="0.2", lw=2,
                                    connectionstyle="arc3,rad=-0.25"))
        if zero:
            for x0, y0 in ((b.col0, N), (sx, y + BC - zero)):
                ax.add_patch(Rectangle((x0, y0), 64, zero, fc="white", ec="k", lw=1,
                                       hatch="//", alpha=0.9))
                ax.text(x0 + 32, y0 + zero / 2, f"zero fill\n{zero} rows", ha="center",
                        va="center", fontsize=TEXT, bbox=dict(fc="white", ec="none", pad=1))
    if zero:
        ax.text(-0.02 * D, N + zero / 2, f"rows {N}–{row0 + BC - 1}:\npast N, not in\nmemory",
                ha="right", va="center", fontsize=TEXT, color="0.3")
    ax.text(D / 2, -0.03 * N, f"K: {N} rows × {D} columns ({2 * D} B a row)", ha="center",
            va="bottom", fontsize=LABEL)
    ax.text(sx + 32, -0.03 * N, "shared memory: K buffer", ha="center", va="bottom",
            fontsize=LABEL)
    nbytes = BC * D * 2
    ax.text(sx + 32, len(boxes) * BC + 0.04 * N,
            f"{nbytes // 1024} KiB for K (and as much for V):\nfull[b] expects "
            f"2 × {nbytes} = {2 * nbytes} bytes,\nzero-filled rows included",
            ha="center", va="top", fontsize=TEXT)
    bottom = max(n_tiles * BC, len(boxes) * BC + 0.22 * N)
    ax.set_xlim(-0.42 * D, sx + 64 + 0.75 * D + 16)
    ax.set_ylim(bottom + 0.02 * N, -0.1 * N)
    ax.axis("off")
    past = f"; rows {N}–{row0 + BC - 1} are past N = {N}" if zero else ""
    how = (f"is {len(boxes)} boxes of 64 columns × {BC} rows, one cp.async.bulk.tensor each, "
           "written one after another (sw128's layout)" if len(boxes) > 1 else
           f"is one box of 64 columns × {BC} rows: one cp.async.bulk.tensor, in sw128's layout")
    ax.set_title(f"TMA: tile {tile} of K (rows {row0}–{row0 + BC - 1}{past})\n{how}",
                 fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- the mbarrier ring

def _per_wg(value, warpgroups, name):
    vals = list(value) if np.ndim(value) else [value] * warpgroups
    if len(vals) != warpgroups or min(vals) < 0:
        raise ValueError(f"{name} is a time >= 0, or one per warpgroup")
    return [float(v) for v in vals]


def ring_schedule(n_tiles=8, stages=3, load=1.0, compute=1.5, latency=1.0, warpgroups=2):
    """A discrete-event model of 10_tma.cu's K/V loop (its shapes without RETIRE). Tile j lives in
    buffer j % stages; the elected thread (thread 0, in warpgroup 0) issues tiles 0..stages-2
    with Q before the loop, while no P V holds a buffer, and, at iteration j, right after issuing
    its S wgmma, tile j + AHEAD (AHEAD = stages - 2) into the buffer of tile j - 2 unless it came
    with Q, once that tile is released:
    `if (next >= STAGES) mbar_wait(empty + 8 * nb, (next / STAGES - 1) & 1);`. A copy starts
    arriving `latency` after its issue, then streams for `load` (copies share the link in issue
    order); full[b] completes when the last byte lands, and a warpgroup waits for it with
    parity (j / STAGES) & 1. A warpgroup's tile takes `compute` (one number, or one per
    warpgroup): half S = Q Kᵀ, half P V, which runs on while the next tile's S is issued; the
    wait for tile j + 1's S therefore also retires tile j's P V, and each warp then releases
    tile j (`mbar_arrive(empty + ...)`): empty[b] completes when every warp has. The elected
    thread's warp waits on empty before its own S wait, so a lagging warpgroup holds it up.
    Q's load before the loop is left out.

    Returns a row per tile: buffer, parity, issue, arrive, compute_start_wgW and compute_end_wgW
    per warpgroup, release (when empty[buffer] completes for it; the last tile, which the kernel
    never releases: when its last P V is done) and stall (how long the elected thread waited on
    empty before issuing it)."""
    if stages < 3:
        raise ValueError("the kernel needs stages >= 3 (AHEAD = stages - 2 >= 1)")
    if n_tiles < 1 or warpgroups < 1:
        raise ValueError("n_tiles and warpgroups are at least 1")
    if load < 0 or latency < 0:
        raise ValueError("load and latency are times >= 0")
    comp = _per_wg(compute, warpgroups, "compute")
    ahead = stages - 2
    issue, arrive, stall = {}, {}, {}
    link = 0.0

    def copy(j, when, waited=0.0):
        nonlocal link
        issue[j], stall[j] = when, waited
        link = max(when + latency, link) + load
        arrive[j] = link

    for j in range(min(stages - 1, n_tiles)):
        copy(j, 0.0)
    start = np.zeros((warpgroups, n_tiles))
    end = np.zeros((warpgroups, n_tiles))
    resume = np.zeros((warpgroups, n_tiles))   # when each warpgroup's wait for S(j) returns
    release = np.zeros(n_tiles)
    for j in range(n_tiles):
        for w in range(warpgroups):
            st = max(arrive[j], end[w, j - 1] if j else 0.0)
            s_done = st + comp[w] / 2
            res = s_done
            nxt = j + ahead
            if w == 0 and stages - 1 <= nxt < n_tiles:  # the elected thread, after issuing S(j)
                when = st
                if nxt >= stages:                # the buffer held tile j - 2
                    when = max(st, release[nxt - stages])
                copy(nxt, when, when - st)
                res = max(s_done, when)
            start[w, j], resume[w, j], end[w, j] = st, res, res + comp[w] / 2
        if j:
            release[j - 1] = resume[:, j].max()
    release[-1] = end[:, -1].max()
    df = pd.DataFrame(dict(tile=range(n_tiles), buffer=[j % stages for j in range(n_tiles)],
                           parity=[(j // stages) & 1 for j in range(n_tiles)],
                           issue=[issue[j] for j in range(n_tiles)],
                           arrive=[arrive[j] for j in range(n_tiles)]))
    for w in range(warpgroups):
        df[f"compute_start_wg{w}"] = start[w]
        df[f"compute_end_wg{w}"] = end[w]
    df["release"] = release
    df["stall"] = [stall[j] for j in range(n_tiles)]
    return df.set_index("tile")


WG_COLORS = ("#3182bd", "#e6550d", "#31a354", "#756bb1")


def ring_timeline(n_tiles=8, stages=3, load=1.0, compute=1.5, latency=1.0, warpgroups=2):
    """ring_schedule on a time axis. Top lane: the elected thread, a marker per copy it issues
    (red: time spent waiting on empty first). One lane per buffer: a grey band while the buffer
    holds a tile (issue to release), the copy in flight (light: latency, hatched: queued behind
    earlier copies, dark: bytes streaming in) labelled with the tile, "full φp" where it lands
    (p: the phase parity the warps wait for), each warpgroup's compute of the tile as a thin bar,
    and a ▼ where every warp has released it (empty[b] completes that phase)."""
    df = ring_schedule(n_tiles, stages, load, compute, latency, warpgroups)
    comp = _per_wg(compute, warpgroups, "compute")
    fig = Figure(figsize=(16, 2.4 + 1.3 * (stages + 1)), layout="constrained")
    ax = fig.subplots()
    h = 0.84
    band = 0.34 / warpgroups
    for j, r in df.iterrows():
        y = r.buffer + 1                                   # lane centre; the elected thread is 0
        parity = int(r.parity)
        ax.broken_barh([(r.issue, r.release - r.issue)], (y - h / 2, h), color="0.92", lw=0)
        top = (y - 0.4, 0.34)                              # the copy, in the lane's upper half
        queued = r.arrive - load - (r.issue + latency)
        ax.broken_barh([(r.issue, latency)], top, color="#c6dbef", ec="0.3", lw=0.6)
        if queued > 1e-9:
            ax.broken_barh([(r.issue + latency, queued)], top, fc="white", ec="0.5", lw=0.6,
                           hatch="..")
        ax.broken_barh([(r.arrive - load, load)], top, color="#4292c6", ec="0.3", lw=0.6)
        ax.text((r.issue + r.arrive) / 2, y - 0.23, f"tile {j}", ha="center", va="center",
                fontsize=TEXT, fontweight="bold", bbox=dict(fc="white", ec="none", alpha=0.7,
                                                            pad=0.5))
        ax.text(r.arrive + 0.05, y - 0.23, f"full φ{parity}", ha="left", va="center",
                fontsize=TEXT, color="#08519c")
        for w in range(warpgroups):
            a, b = r[f"compute_start_wg{w}"], r[f"compute_end_wg{w}"]
            ax.broken_barh([(a, b - a)], (y + 0.02 + w * band, band * 0.85),
                           color=WG_COLORS[w % 4], lw=0)
        last = j == n_tiles - 1                            # nobody releases the last tile
        ax.plot([r.release], [y + h / 2 - 0.03], marker="|" if last else "v", color="k",
                ms=10, mew=2)
        ax.text(r.release + 0.06, y + h / 2 - 0.06, "last: done" if last else f"empty φ{parity}",
                ha="left", va="bottom", fontsize=10)
        if r.stall > 0:
            ax.broken_barh([(r.issue - r.stall, r.stall)], (-0.12, 0.24), color="tab:red", lw=0)
    for when, group in df.groupby("issue"):
        ax.plot([when], [0], marker="o", color="k", ms=8)
        ax.text(when, -0.2, "tile " + ", ".join(map(str, group.index)), ha="center",
                va="bottom", fontsize=TEXT)
    ax.set_yticks(range(stages + 1), ["elected\nthread issues"]
                  + [f"buffer {b}" for b in range(stages)], fontsize=LABEL)
    ax.set_ylim(stages + 0.5, -0.65)
    end = df[[c for c in df if c.startswith("compute_end")]].to_numpy().max()
    ax.set_xlim(-0.02 * end, end * 1.06)
    ax.set_xlabel("time", fontsize=LABEL)
    ax.tick_params(axis="x", labelsize=TEXT)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(fc="#c6dbef", ec="0.3", label="copy: latency"),
               Patch(fc="white", ec="0.5", hatch="..", label="copy: queued"),
               Patch(fc="#4292c6", ec="0.3", label="copy: bytes arriving"),
               *[Patch(fc=WG_COLORS[w % 4], label=f"warpgroup {w} computes")
                 for w in range(warpgroups)],
               Patch(fc="0.92", label="buffer held"),
               Patch(fc="tab:red", label="elected thread waits on empty")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              ncol=min(len(handles), 7), fontsize=TEXT, frameon=False)
    ends = df[[c for c in df if c.startswith("compute_end")]].max(axis=1).to_numpy()
    half = n_tiles // 2
    per = (ends[-1] - ends[half - 1]) / (n_tiles - half) if n_tiles > 1 else ends[0]
    ahead = stages - 2
    ax.set_title(f"Stage 10's mbarrier ring: {stages} buffers, loads run {ahead} tile"
                 f"{'s' * (ahead > 1)} ahead; load {load:g}, latency {latency:g}, compute "
                 f"{'/'.join(f'{c:g}' for c in comp)} per tile\n{end:.3g} for {n_tiles} tiles, "
                 f"{per:.3g} a tile over the last {n_tiles - half} (compute alone: "
                 f"{max(comp):g}); φ: the phase parity waited on", fontsize=TITLE)
    return fig
