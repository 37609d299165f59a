"""Stage 19 on the CPU: the backward's five products as warpgroup wgmma, drawn and counted from
the kernel's tile shapes (no GPU needed).

A block of kernels/19_wgmma_backward.cu is two warpgroups and 128 keys; warpgroup w owns keys
64 w.. of the block. Against a query block of BR rows (128 at D = 64, 64 at D = 128) each product
is a handful of wgmma of 64 x N x 16, where stage 18 issued mma.sync of 16 x 8 x 16, one warp at
a time, each operand first brought into registers by ldmatrix.

    from flashlab import wgmma_backward
    wgmma_backward.figure(D=128)        # the five products: shapes, and where A and B come from
    wgmma_backward.products(D=128)      # the same as a table, with instructions per query block
    wgmma_backward.instructions()       # tensor-core instructions per block and query block, 18 vs 19
"""
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

TITLE, LABEL, TEXT = 15, 12, 11     # font sizes, as the other lessons' figures
BC, WG_KEYS = 128, 64               # keys of a block, keys of a warpgroup
MMA_SYNC_MACS = 16 * 8 * 16         # one mma.sync.m16n8k16
SOURCES = {"smem": ("#4C72B0", "shared memory, as stored"),
           "smem_t": ("#8FB3E0", "shared memory, read transposed"),
           "regs": ("#DD8452", "registers (an accumulator, packed)")}


def query_rows(D) -> int:
    """BR, the rows of a query block: 128 at D = 64; at D = 128 S^T, dP^T, dK and dV would need
    2 x 64 + 2 x 64 accumulator floats a thread at BR = 128, and a thread has 255 registers."""
    if D not in (64, 128):
        raise ValueError(f"stage 19 is compiled for head dims 64 and 128, not {D}")
    return 128 if D == 64 else 64


def _products(D):
    """(name, M, N, K, A, where A comes from, B, where B comes from, result) of each product of
    one warpgroup against one query block; the sources are keys of SOURCES."""
    BR = query_rows(D)
    dq_n = 64  # a warpgroup's share of dQ_i: 64 x 64 (columns 64w.. at D = 128, rows 64w.. at 64)
    return [
        ("S^T = K_w Q_i^T", 64, BR, D, "K_w", "smem", "Q_i^T", "smem", "registers (P^T after exp)"),
        ("dP^T = V_w dO_i^T", 64, BR, D, "V_w", "smem", "dO_i^T", "smem", "registers (dS^T after Δ)"),
        ("dV_w += P^T dO_i", 64, D, BR, "P^T", "regs", "dO_i", "smem_t", "registers, all blocks"),
        ("dK_w += dS^T Q_i", 64, D, BR, "dS^T", "regs", "Q_i", "smem_t", "registers, all blocks"),
        ("dQ_i += dS K_j", 64, dq_n, BC, "dS", "smem_t", "K_j", "smem_t", "RED into dQ's fp32 sum"),
    ]


def products(D=128) -> pd.DataFrame:
    """The five products of one warpgroup against one query block: M x N x K, where its A and B
    come from, and the wgmma (64 x N x 16 each) it takes."""
    out = []
    for name, M, N, K, a, a_src, b, b_src, c in _products(D):
        out.append({"product": name, "M x N x K": f"{M} x {N} x {K}", "A": a,
                    "A from": SOURCES[a_src][1], "B": b, "B from": SOURCES[b_src][1],
                    "result": c, "wgmma": K // 16, "N of each": N})
    return pd.DataFrame(out).set_index("product")


def instructions() -> pd.DataFrame:
    """Tensor-core instructions a block issues for one query block, at each head dim: stage 18's
    mma.sync (16 x 8 x 16, one warp each) against stage 19's wgmma (64 x N x 16, one warpgroup
    each), for the same multiply-adds: 5 products of BC keys x BR queries x D."""
    out = []
    for D in (64, 128):
        BR = query_rows(D)
        macs = 5 * BC * BR * D
        wg = 2 * sum(products(D)["wgmma"])  # two warpgroups
        out.append({"D": D, "query rows BR": BR, "multiply-adds": macs,
                    "mma.sync (stage 18)": macs // MMA_SYNC_MACS, "wgmma (stage 19)": wg,
                    "multiply-adds a wgmma": macs // wg,
                    "ratio": macs // MMA_SYNC_MACS / wg})
    return pd.DataFrame(out).set_index("D")


def figure(D=128) -> Figure:
    """The five products of a warpgroup, each operand drawn to scale (A: M rows by K columns, B: K
    rows by N columns) and coloured by where wgmma reads it."""
    BR = query_rows(D)
    fig = Figure(figsize=(12, 8.5))
    ax = fig.add_subplot()
    ax.set_axis_off()
    s = 1 / 90  # drawing units per element
    y = 0.0
    for name, M, N, K, a, a_src, b, b_src, result in _products(D):
        h = max(M, K) * s
        mid = y - h / 2
        ax.text(0, mid, name, ha="left", va="center", fontsize=LABEL, family="monospace")
        x = 2.6
        for label, w, hh, key in ((a, K * s, M * s, a_src), (b, N * s, K * s, b_src)):
            ax.add_patch(Rectangle((x, mid - hh / 2), w, hh, facecolor=SOURCES[key][0], edgecolor="black",
                                   hatch="//" if key == "smem_t" else None, alpha=0.9))
            ax.text(x + w / 2, mid, label, ha="center", va="center", fontsize=TEXT,
                    color="white" if key == "smem" else "black",
                    bbox=dict(facecolor="white", alpha=0.7, lw=0) if key == "smem_t" else None)
            x += w + 0.3
            if label == a:
                ax.text(x - 0.15, mid, "×", ha="center", va="center", fontsize=LABEL)
        ax.text(6.0, mid, f"{M} x {N} x {K}: {K // 16} wgmma of 64 x {N} x 16\n→ {result}",
                ha="left", va="center", fontsize=TEXT)
        y -= h + 0.35
    for i, (key, (color, text)) in enumerate(SOURCES.items()):
        ax.add_patch(Rectangle((0.05 + 3.6 * i, y - 0.15), 0.3, 0.3, facecolor=color, edgecolor="black",
                               hatch="//" if key == "smem_t" else None))
        ax.text(0.45 + 3.6 * i, y, text, va="center", fontsize=TEXT - 1)
    ax.set_xlim(-0.1, 11.5)
    ax.set_ylim(y - 0.4, 0.5)
    ax.set_title(f"Stage 19: one warpgroup's products against a query block (D = {D}, BR = {BR})",
                 fontsize=TITLE)
    return fig
