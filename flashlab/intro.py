"""Figures and small tables for notebook 00 (setup, the GPU, the problem). None needs a GPU.

    from flashlab import intro
    intro.intensity_figure(ceilings)   # FLOP per byte of attention against N, and the ridge points
    intro.tiling_figure()              # Q tile x K/V tiles: what lives in HBM, shared memory, registers
    intro.check_matrix({"mine": fl.check(mine, device="cpu"), ...})   # cases side by side
"""
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch, Rectangle


ELEM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
ROOF_COLORS = {"fp32": "tab:blue", "fp16": "tab:red"}   # as in plots.roofline
MEMORY_COLORS = {"hbm": "#d9d9d9", "smem": "#6baed6", "regs": "#fd8d3c"}


def min_bytes(N, D, dtype="fp32", B=1, H=1):
    """The least HBM traffic of attention: read q, k, v once and write o once."""
    return 4 * B * H * N * D * ELEM_BYTES[dtype]


def intensity(N, D=64, dtype="fp32", causal=False, materialised=False):
    """FLOP per byte of HBM traffic for one head: 4·N²·D FLOPs (half when causal) over the four
    N×D tensors, plus, when `materialised`, writing and reading S and then P (4·N² elements)."""
    N = np.asarray(N, dtype=float)
    flops = 4 * N**2 * D / (2 if causal else 1)
    traffic = 4 * N * D * ELEM_BYTES[dtype]
    if materialised:
        traffic = traffic + 4 * N**2 * ELEM_BYTES[dtype]
    return flops / traffic


def intensity_figure(ceilings, D=64, mark_N=1024, Ns=None):
    """Attention's arithmetic intensity against N, with the GPU's ridge points (peak / bandwidth):
    above a ridge a kernel can be compute bound, below it it is memory bound."""
    Ns = np.asarray(Ns if Ns is not None else 2.0 ** np.arange(6, 16.01, 0.25))
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for dtype in ("fp32", "fp16"):
        color, e = ROOF_COLORS[dtype], ELEM_BYTES[dtype]
        ax.plot(Ns, intensity(Ns, D, dtype), color=color, lw=2,
                label=f"{dtype}, only q, k, v, o through HBM: N / {e}  (causal: half)")
        ax.plot(Ns, intensity(Ns, D, dtype, materialised=True), color=color, lw=1.5, ls=":",
                label=f"{dtype}, S and P through HBM too: below D / {e}")
    bw = ceilings.get("copy_tbps")
    for dtype in ("fp32", "fp16"):
        peak = ceilings.get(f"matmul_{dtype}_tflops")
        if peak and bw:
            ridge = peak / bw
            ax.axhline(ridge, color=ROOF_COLORS[dtype], lw=0.8, alpha=0.6)
            ax.annotate(f"{dtype} ridge: {ridge:.0f} FLOP/B", (Ns[0], ridge), fontsize=8,
                        color=ROOF_COLORS[dtype], xytext=(2, 3), textcoords="offset points")
    if mark_N:
        ax.axvline(mark_N, color="k", lw=0.8, ls="-.", alpha=0.5)
        ax.annotate(f"teaching\nN={mark_N}", (mark_N, 0.72), xycoords=("data", "axes fraction"),
                    fontsize=8, xytext=(4, 0), textcoords="offset points", va="center")
    ax.set_xscale("log", base=2)
    ticks = [n for n in 2 ** np.arange(6, 17, 2) if Ns[0] <= n <= Ns[-1]]
    ax.set_xticks(ticks, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ticks])
    ax.set_yscale("log")
    ax.set_xlabel(f"sequence length N (D={D}; B and H do not change the ratio)")
    ax.set_ylabel("arithmetic intensity (FLOP per byte of HBM traffic)")
    ax.set_title("Attention is compute bound — unless the N×N scores go through memory",
                 fontsize=10)
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    return fig


def _box(ax, x, y, w, h, color, label=None, hatch=None, alpha=1.0, lw=1.0, fontsize=9, **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="k", lw=lw, hatch=hatch,
                           alpha=alpha))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize, **kw)


def tiling_figure(tiles=6, i=3, j=2):
    """One step of the FlashAttention loop: query tile i meets key/value tile j.

    S = Q Kᵀ is drawn as a tiles × tiles grid; the row of tiles i is swept left to right, the
    causal mask's upper triangle is hatched. Colours say where each piece lives."""
    T, d = tiles, 1.3  # grid size in tiles; drawn width of a head dim
    hbm, smem, regs = MEMORY_COLORS["hbm"], MEMORY_COLORS["smem"], MEMORY_COLORS["regs"]
    fig, ax = plt.subplots(figsize=(11, 6.2))
    x_q, x_s, x_v, x_o = 0.0, d + 0.6, d + 0.6 + T + 0.8, d + 0.6 + T + 0.8 + d + 1.2
    y_s, y_k = 0.0, -d - 0.6  # y grows downwards: Kᵀ sits above S
    # HBM operands
    _box(ax, x_q, y_s, d, T, hbm)
    _box(ax, x_s, y_k, T, d, hbm)
    _box(ax, x_v, y_s, d, T, hbm)
    _box(ax, x_o, y_s, d, T, hbm)
    ax.text(x_q + d / 2, y_s + T + 0.25, "Q  (N×D)", ha="center", va="top", fontsize=10)
    ax.text(x_s - 0.15, y_k + d / 2, "Kᵀ  (D×N)", ha="right", va="center", fontsize=10)
    ax.text(x_v + d / 2, y_s + T + 0.25, "V  (N×D)", ha="center", va="top", fontsize=10)
    ax.text(x_o + d / 2, y_s + T + 0.25, "O  (N×D)", ha="center", va="top", fontsize=10)
    # the score matrix: never stored whole
    for r in range(T):
        for c in range(T):
            above = c > r
            if r == i and c < j:
                color, alpha = regs, 0.25       # done: folded into m, l, O_i
            elif r == i and c == j:
                color, alpha = regs, 1.0        # now
            else:
                color, alpha = "white", 1.0     # still to come, or another block's row
            _box(ax, x_s + c, y_s + r, 1, 1, color, alpha=alpha, lw=0.5)
            if above:
                _box(ax, x_s + c, y_s + r, 1, 1, "none", hatch="///", lw=0.5, alpha=0.35)
    for c in range(T):  # diagonal tiles are half masked
        ax.plot([x_s + c, x_s + c + 1], [y_s + c, y_s + c + 1], color="k", lw=0.6, alpha=0.5)
    ax.text(x_s + j + 0.5, y_s + i + 0.5, "S$_{ij}$, P$_{ij}$", ha="center", va="center",
            fontsize=9, weight="bold")
    ax.annotate("", (x_s + T - 0.05, y_s + i + 0.5), (x_s + j + 1.05, y_s + i + 0.5),
                arrowprops=dict(arrowstyle="->", lw=1.5))
    ax.text(x_s + T / 2, y_s + T + 0.25, "S = Q Kᵀ · scale  (N×N): only one Br×Bc tile exists at a "
            "time", ha="center", va="top", fontsize=9.5)
    ax.text(x_s + T - 0.1, y_s + 0.5, "masked\nwhen causal\n(skipped)", ha="right", va="center",
            fontsize=8, color="0.3", bbox=dict(facecolor="white", edgecolor="none", pad=1))
    for c in range(j):
        ax.text(x_s + c + 0.5, y_s + i + 0.5, "done", ha="center", va="center", fontsize=8,
                color="0.35")
    # the tiles on chip
    _box(ax, x_q, y_s + i, d, 1, smem, "Q$_i$")
    _box(ax, x_s + j, y_k, 1, d, smem, "K$_j$ᵀ")
    _box(ax, x_v, y_s + j, d, 1, smem, "V$_j$")
    _box(ax, x_o, y_s + i, d, 1, regs, "O$_i$ acc.")
    _box(ax, x_o + d + 0.1, y_s + i, 0.3, 1, regs, "m", fontsize=8)
    _box(ax, x_o + d + 0.45, y_s + i, 0.3, 1, regs, "l", fontsize=8)
    ax.annotate("", (x_o - 0.05, y_s + i + 0.5), (x_v + d + 0.05, y_s + j + 0.5),
                arrowprops=dict(arrowstyle="->", lw=1, color="0.3", connectionstyle="arc3,rad=-0.2"))
    ax.text(x_o + d / 2 + 0.35, y_s + i + 1.25, "O$_i$ ← α·O$_i$ + P$_{ij}$ V$_j$\n"
            "l ← α·l + rowsum(P$_{ij}$)", fontsize=8.5, ha="center", va="top",
            bbox=dict(facecolor="white", edgecolor="0.6", pad=2))
    ax.text(x_s + (j + 1 + T) / 2, y_s + i + 0.35, "next j", fontsize=8, ha="center", va="bottom")
    ax.legend(handles=[Patch(facecolor=hbm, edgecolor="k", label="HBM (global memory): "
                             "the whole tensors"),
                       Patch(facecolor=smem, edgecolor="k", label="shared memory: the current "
                             "tiles, reused by every thread of the block"),
                       Patch(facecolor=regs, edgecolor="k", label="registers / on chip: "
                             "S$_{ij}$, P$_{ij}$, and (stage 03 on) O$_i$, m, l")],
              loc="upper left", bbox_to_anchor=(x_v / (x_o + d + 1.0), 1.0), fontsize=8.5,
              frameon=False)
    ax.set_xlim(-0.3, x_o + d + 1.0)
    ax.set_ylim(y_s + T + 1.0, y_k - 0.3)  # inverted: row 0 of every matrix on top
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"One step of the loop: query tile i={i} against key/value tile j={j}",
                 fontsize=11)
    fig.tight_layout()
    return fig


def check_matrix(results: dict) -> pd.DataFrame:
    """{name: CheckResult} -> one row per case, one column per function: 'ok 2.1e-07' or
    'FAIL inf' (relative error against float64), so that failures stand out side by side; the
    last row is each function's verdict."""
    cols, index = {}, None
    for name, res in results.items():
        rows = res.rows()
        keys = [f"B={r['B']} H={r['H']} N={r['N']} D={r['D']} {r['dtype']}"
                f"{' causal' if r['causal'] else ''}" for r in rows]
        index = index or keys
        if keys != index:
            raise ValueError(f"{name} was checked on different cases")
        cols[name] = [f"{'ok' if r['passed'] else 'FAIL'} {r['rel_err']:.1e}" for r in rows]
        cols[name].append("PASS" if res.passed else "FAIL")
    return pd.DataFrame(cols, index=pd.Index((index or []) + ["verdict"], name="case"))


def fmt_bytes(n: float) -> str:
    """1.5e9 -> '1.50 GB' (decimal units, as bandwidths are quoted)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


__all__ = ["min_bytes", "intensity", "intensity_figure", "tiling_figure",
           "check_matrix", "fmt_bytes"]
