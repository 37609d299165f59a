"""Stage 13 on the CPU: the lazy rescale's softmax, replayed and counted from the kernels' own
source (no GPU needed).

kernels/13_lazy_rescale.cu takes a tile's exponentials against the running maximum as it stands,
and takes the tile again the classic way only when a score exceeds it by more than LAZY_UNITS.
tests/test_hopper.py keeps the line of 13_lazy_rescale.cu that threshold follows.

    from flashlab import lazy_rescale
    lazy_rescale.lazy_steps(D=128)            # a thread's softmax of a tile, step by step
    lazy_rescale.lazy_fallbacks(q, k)         # how often the kernel falls back, on the CPU
"""
import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .hopper_common import LABEL, TEXT, TITLE


LAZY_UNITS = 8  # a score may exceed the running maximum by this much (log2 units) in the lazy pass
LOG2E = 1.4426950408889634


def lazy_fallbacks(q, k, causal=False, BC=128, rows=16, units=LAZY_UNITS, scale=None) -> dict:
    """How often stage 13 takes a tile the classic way, for one head's q and k ((N, D) each, any
    dtype): after each 16-row group's (a warp's) first key tile, a tile whose scores exceed some
    row's running maximum m by more than `units` (log2 units, the scale folded in) is taken again
    the classic way, and m moves to the row's new maximum; otherwise m stays. Tiles a warp's rows
    never reach under the causal mask are not counted. Returns the count of lazy tiles, of
    classic fallbacks, their share, and the largest exponential a lazy tile wrote (<= 2^units)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    n, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = (q @ k.T) * scale * LOG2E
    if causal:
        s[np.triu_indices(n, 1)] = -np.inf
    tiles = -(-k.shape[0] // BC)
    lazy = fallbacks = 0
    top = 0.0
    for r0 in range(0, n, rows):
        block = s[r0:r0 + rows]
        last = min(n, r0 + rows) - 1
        mine = min(tiles, last // BC + 1) if causal else tiles
        m = block[:, :BC].max(axis=1)
        for j in range(1, mine):
            t = block[:, j * BC:(j + 1) * BC]
            tmax = t.max(axis=1)
            if np.any(tmax > m + units):
                fallbacks += 1
                m = np.maximum(m, tmax)
            else:
                lazy += 1
                with np.errstate(invalid="ignore"):
                    e = np.exp2(t - m[:, None])
                top = max(top, float(np.nanmax(e)) if np.isfinite(e).any() else 0.0)
    total = lazy + fallbacks
    return {"tiles after the first": total, "lazy": lazy, "classic": fallbacks,
            "classic share": fallbacks / total if total else 0.0, "largest lazy P": top}


def lazy_steps(D=128, BC=128) -> pd.DataFrame:
    """One consumer thread's softmax of a key tile, step by step, in instructions counted from the
    kernels' source (stage 12's softmax() + rescale + pack(), stage 13's fast()): a thread holds
    BC/2 scores of two row halves and D/2 accumulators of O. The last column says whether the step
    must wait for the tile's row maximum."""
    v = BC // 2
    rows = [
        ("row maximum (FMNMX)", v + 2, v, False),
        ("shuffles of the maximum (SHFL)", 4, 4, False),
        ("new maximum m, factor alpha (FMUL, MUFU)", 6, 0, False),
        ("exponent arguments s * scale - m (FFMA)", v, v, True),
        ("exponentials (MUFU.EX2)", v, v, True),
        ("row sums, l (FADD, FFMA)", v + 2, v + 2, True),
        ("pack P to 16 bits (F2FP)", v // 2, v // 2, True),
        ("rescale O by alpha (FMUL)", D // 2, 0, True),
        ("threshold test and vote (FADD, FSETP, VOTE)", 0, 5, False),
    ]
    df = pd.DataFrame(rows, columns=["step", "stage 12", "stage 13",
                                     "waits for the maximum in stage 12"]).set_index("step")
    df = df.astype({"waits for the maximum in stage 12": object})  # the total row leaves it blank
    df.loc["total"] = [df["stage 12"].sum(), df["stage 13"].sum(), ""]
    return df


def lazy_chain(D=128, BC=128, mufu=8, shuffle=30) -> dict:
    """A model of one warp alone doing one tile's softmax, in cycles: one instruction a cycle,
    an exponential every `mufu` cycles (the special-function unit: 4 lanes a cycle per SM
    sub-partition, 32 lanes a warp), a shuffle's result `shuffle` cycles after it issues. Other
    instructions issue in the gaps between exponentials. Stage 12 runs the maximum, its shuffles,
    the factor, then the exponentials, then the rescale of O; stage 13 runs the maximum and its
    shuffles beside the exponentials and ends with the test and the vote.
    Returns {stage: [(step, start, length)]}."""
    steps = lazy_steps(D, BC)["stage 12"]
    v = BC // 2
    exp_phase = max(v * mufu, 3 * v + v // 2 + 2)  # MUFU-paced; FFMA, FADD, F2FP fill the gaps
    s12, t = [], 0
    for name, length in (("row maximum", steps["row maximum (FMNMX)"]), ("shuffles", 2 * shuffle),
                         ("m, alpha", 2 * mufu), ("exponentials, sums, P", exp_phase),
                         ("rescale O", D // 2)):
        s12.append((name, t, int(length)))
        t += int(length)
    s13 = [("exponentials, sums, P", 0, exp_phase),
           ("row maximum, shuffles (beside)", 0, v + 2 * shuffle),
           ("test, vote", exp_phase, 5)]
    return {"stage 12": s12, "stage 13": s13}


def lazy_figure(D=128, BC=128, mufu=8, shuffle=30):
    """Stage 12's softmax of a tile against stage 13's lazy pass (lazy_chain's model of one warp
    alone): the exponentials no longer wait for the row maximum, and O is not rescaled."""
    chain = lazy_chain(D, BC, mufu=mufu, shuffle=shuffle)
    colors = {"row maximum": "#9ecae1", "shuffles": "#6baed6", "m, alpha": "#fdae6b",
              "exponentials, sums, P": "#74c476", "rescale O": "#fb6a4a",
              "row maximum, shuffles (beside)": "#9ecae1", "test, vote": "#756bb1"}
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    ax = fig.subplots()
    lanes = {"stage 12": 1.6, "stage 13": 0.0}
    ends = {}
    for stage, steps in chain.items():
        y = lanes[stage]
        for name, start, length in steps:
            beside = "beside" in name
            yy, h = (y - 0.45, 0.35) if beside else (y, 0.7)
            ax.add_patch(Rectangle((start, yy - h / 2), length, h, fc=colors[name], ec="0.2",
                                   lw=0.8))
            if length > 100:
                ax.text(start + length / 2, yy, name, ha="center", va="center", fontsize=TEXT)
            ends[stage] = max(ends.get(stage, 0), start + length)
        ax.text(ends[stage] + 8, y, f"{ends[stage]} cycles", va="center", fontsize=LABEL)
    ax.legend(handles=[Patch(fc=c, ec="0.2", label=n) for n, c in colors.items()
                       if "beside" not in n], loc="upper right", fontsize=TEXT, ncols=3,
              frameon=False)
    ax.set_yticks(list(lanes.values()), [f"stage {s[-2:]}" for s in lanes], fontsize=LABEL)
    ax.set_ylim(-0.9, 2.9)
    ax.set_xlim(0, max(ends.values()) * 1.12)
    ax.set_xlabel(f"cycles of one warp alone (a model: one instruction a cycle, an exponential "
                  f"every {mufu}, a shuffle's result after {shuffle})", fontsize=LABEL)
    ax.set_title(f"One consumer warp's softmax of a {BC}-key tile at D = {D}: the exponentials "
                 f"wait for the row maximum, or they do not", fontsize=TITLE - 1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig
