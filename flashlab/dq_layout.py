"""Stage 18 on the CPU: where a warp's dQ reductions land in memory, drawn and counted from the
kernels' index arithmetic (no GPU needed).

Every key block adds its share of dQ into an fp32 sum in global memory with reductions (RED),
which L2 carries out. A warp's share is a 16 x 64 block of dQ: lane l holds element e of n-tile n
(rows l / 4 and l / 4 + 8, columns 8n + 2 (l % 4) and the one after). kernels/17_wide_warps.cu
keeps the sum row-major, as dQ is, so one warp-wide float2 reduction covers 8 rows x 32 bytes:
eight 128-byte lines. kernels/18_dq_layout.cu keeps it in tiles of 16 x 64 in which that element
sits at slot(n, e, l): one reduction covers 256 contiguous bytes, two lines.

    from flashlab import dq_layout
    dq_layout.figure()             # the sectors one reduction touches, row-major and tiled
    dq_layout.footprint()          # bytes, lines and sectors of one reduction, sm_80 and sm_90
    dq_layout.counts(D=128)        # reductions and L2 requests per 64 keys x 64 queries
    dq_layout.starts(N=2048)       # the query block each key block of a head starts at
"""
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

TITLE, LABEL, TEXT = 15, 12, 11     # font sizes, as the other lessons' figures
LINE, SECTOR, FLOAT = 128, 32, 4    # bytes
BR, BC = 64, 128                    # queries of a query block, keys of a key block (both stages)


def element(n, e, lane):
    """(row, column) in the warp's 16 x 64 block of dQ of accumulator element e of n-tile n of
    `lane`: the mma.sync C fragment (notebook 05)."""
    return lane // 4 + 8 * (e // 2), 8 * n + 2 * (lane % 4) + e % 2


def slot(n, e, lane, vec=2):
    """Where stage 18 keeps that element inside its tile (in floats): the 32 lanes' `vec`
    neighbouring accumulators of one reduction side by side. vec: floats a reduction adds, 2 on
    sm_90 (float2), 1 before it."""
    return ((n * (4 // vec) + e // vec) * 32 + lane) * vec + e % vec


def _reductions(stage, vec, D):
    """One list a warp-wide reduction: the byte offsets (from the block's first element) of
    every float it adds, in the order the kernel issues them."""
    out = []
    for n in range(8):
        for e0 in range(0, 4, vec):
            addrs = []
            for lane in range(32):
                for e in range(e0, e0 + vec):
                    if stage == 17:
                        r, c = element(n, e, lane)
                        addrs.append((r * D + c) * FLOAT)
                    else:
                        addrs.append(slot(n, e, lane, vec) * FLOAT)
            out.append(addrs)
    return out


def footprint(D=128) -> pd.DataFrame:
    """One warp-wide reduction of a warp's dQ block, row-major (stage 17) and tiled (stage 18),
    with float2 reductions (sm_90) and float ones (sm_80): the bytes it adds, and the 128-byte
    lines and 32-byte sectors they fall in. The L1 takes a pass per line, and each line goes to
    L2 as one request."""
    rows = {}
    for stage in (17, 18):
        for arch, vec in (("sm_90", 2), ("sm_80", 1)):
            red = _reductions(stage, vec, D)[0]
            rows[f"stage {stage}, {arch}"] = {
                "bytes": len(red) * FLOAT,
                "lines": len({a // LINE for a in red}),
                "sectors": len({a // SECTOR for a in red}),
                "bytes a sector used": len(red) * FLOAT / len({a // SECTOR for a in red})}
    return pd.DataFrame(rows).T.rename_axis(f"one reduction, D = {D}")


def counts(D=128) -> pd.DataFrame:
    """Per 64 keys and one query block of 64 queries, on sm_90: the warp-wide reductions into
    dQ's sum, the sectors they add and the L2 requests (lines) they take, in stage 17 and 18.
    The sums are the same; only the lines they arrive in differ."""
    rows = {}
    blocks = 64 * D // (16 * 64)        # 16 x 64 blocks of dQ a query block holds
    for stage in (17, 18):
        red = _reductions(stage, 2, D)
        per_block = {"reductions": len(red),
                     "sectors": sum(len({a // SECTOR for a in r}) for r in red),
                     "L2 requests (lines)": sum(len({a // LINE for a in r}) for r in red)}
        rows[f"stage {stage}"] = {k: v * blocks * 64 // BC for k, v in per_block.items()}
    t = pd.DataFrame(rows).T
    t["sectors per request"] = t["sectors"] / t["L2 requests (lines)"]
    return t.rename_axis(f"per 64 keys x 64 queries, D = {D}")


def starts(N=2048, causal=False) -> pd.DataFrame:
    """The query block each key block of one head starts its walk at, and the walk's length, in
    stage 17 (every block at the first it sees) and stage 18 (without the mask, key block kb at
    query block kb * blocks / key blocks, then on round to where it began)."""
    key_blocks = -(-N // BC)
    rows = []
    for kb in range(key_blocks):
        first = kb * BC // BR if causal else 0
        blocks = -(-(N - first * BR) // BR)
        rot = 0 if causal else kb * blocks // key_blocks
        rows.append({"key block": kb, "stage 17 starts at": first, "stage 18 starts at": first + rot,
                     "query blocks walked": blocks})
    return pd.DataFrame(rows).set_index("key block")


def figure(D=128):
    """Two panels of the same 16 x 64 block of dQ's fp32 sum, each drawn as its memory: 16 rows
    of 256 bytes (two lines, eight sectors each). Left, row-major (stage 17): the sectors of the
    first four float2 reductions. Right, tiled (stage 18): the same four reductions."""
    fig = Figure(figsize=(13, 5.6))
    colors = ["#08519c", "#3182bd", "#6baed6", "#bdd7e7"]
    panels = [(17, "stage 17: dQ's sum row-major", "one reduction: 8 lines, one sector of each"),
              (18, "stage 18: dQ's sum in tiles", "one reduction: 2 whole lines")]
    for p, (stage, title, note) in enumerate(panels):
        ax = fig.add_axes([0.06 + 0.49 * p, 0.16, 0.42, 0.7])
        ax.set_xlim(-0.2, 8.2)
        ax.set_ylim(16.2, -0.6)
        ax.set_xticks([0, 4, 8], ["0", "128", "256"])
        ax.set_xlabel("bytes along a row of 64 floats (two 128-byte lines)", fontsize=LABEL)
        ax.set_ylabel("row of the 16 x 64 block" if stage == 17 else "256 bytes of the tile",
                      fontsize=LABEL)
        ax.set_title(f"{title}\n{note}", fontsize=TITLE - 2)
        for r in range(16):
            for s in range(8):
                ax.add_patch(Rectangle((s, r), 1, 1, facecolor="white", edgecolor="0.75", lw=0.5))
            ax.plot([4, 4], [r, r + 1], color="0.3", lw=1.2)
        for i, red in enumerate(_reductions(stage, 2, D)[:4]):
            for sec in sorted({a // SECTOR for a in red}):
                row, s = divmod(sec * SECTOR, 64 * FLOAT) if stage == 18 else divmod(sec * SECTOR, D * FLOAT)
                ax.add_patch(Rectangle((s // SECTOR, row), 1, 1, facecolor=colors[i],
                                       edgecolor="k", lw=0.6))
    fig.text(0.5, 0.005, "the sectors of a warp's first four float2 reductions (one colour each)",
             ha="center", va="bottom", fontsize=TEXT + 1)
    return fig
