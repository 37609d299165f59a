"""Stage 22 on the CPU: what a consumer warpgroup of the backward does between its products, in
stage 20's order and in stage 22's, drawn and counted from the tile shapes (no GPU needed).

In kernels/20_warpspec_backward.cu a consumer issues S^T and dP^T as one group of wgmma, waits
for both, turns them into P and dS, and only then issues dV's and dK's products: while it
computes, its tensor cores have nothing queued. In kernels/22_overlap_backward.cu S^T and dP^T
are two groups, P is computed while dP^T is multiplied, dV's products are issued at once and dS
is computed while they run (at D = 128; the registers say why not at D = 64).

    from flashlab import overlap_backward
    overlap_backward.figure()          # one warpgroup's query block, in both orders
    overlap_backward.live_registers()  # what is alive while dS is computed, per head dim
    overlap_backward.waits()           # the waits in the machine code (needs cuobjdump)
"""
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .wgmma_backward import query_rows  # stages 19-22 keep the same query blocks

TITLE, LABEL, TEXT = 15, 12, 11     # font sizes, as the other lessons' figures
KEYS = 64                           # keys a consumer warpgroup holds (its share of 128)
THREADS = 128                       # threads of a warpgroup
CONSUMER_REGS = 240                 # what setmaxnreg gives a consumer thread (stage 20's)

# One query block of one warpgroup at D = 128, in the figure's time units: the products on the
# tensor cores, the arithmetic on the other pipes (proportions, not measurements).
_STEPS = {"S": 2.0, "dP": 2.0, "P": 1.6, "dV": 2.0, "dS": 1.0, "dK": 2.0, "dQ": 2.0}


def _schedule(overlapped: bool):
    """[(lane, step, start, length)] of one query block: lane 0 the tensor cores, 1 the rest."""
    t = _STEPS
    spans = [(0, "S", 0.0, t["S"]), (0, "dP", t["S"], t["dP"])]
    if not overlapped:
        c = t["S"] + t["dP"]                             # wait for both
        spans += [(1, "P", c, t["P"]), (1, "dS", c + t["P"], t["dS"])]
        c += t["P"] + t["dS"]
        spans += [(0, "dV", c, t["dV"]), (0, "dK", c + t["dV"], t["dK"]),
                  (0, "dQ", c + t["dV"] + t["dK"], t["dQ"])]
        return spans
    p0 = t["S"]                                          # S alone is in: P under dP
    spans.append((1, "P", p0, t["P"]))
    dv0 = max(p0 + t["P"], t["S"] + t["dP"])             # P packed and dP in: dV issued,
    spans += [(0, "dV", dv0, t["dV"]), (1, "dS", dv0, t["dS"])]  # dS under it
    dk0 = max(dv0 + t["dV"], dv0 + t["dS"])
    spans += [(0, "dK", dk0, t["dK"]), (0, "dQ", dk0 + t["dK"], t["dQ"])]
    return spans


def figure() -> Figure:
    """One consumer warpgroup's query block at D = 128 in stage 20's order (wait for every group,
    then compute) and stage 22's (P while dP^T runs, dS while dV's products run): the tensor
    cores' lane and the other pipes' lane. Schematic durations."""
    fig = Figure(figsize=(11, 4.6))
    axes = fig.subplots(2, 1, sharex=True)
    colors = {"S": "#4C72B0", "dP": "#4C72B0", "dV": "#4C72B0", "dK": "#4C72B0",
              "dQ": "#4C72B0", "P": "#DD8452", "dS": "#DD8452"}
    ends = []
    for ax, overlapped, name in ((axes[0], False, "stage 20: wait for both, then compute"),
                                 (axes[1], True, "stage 22: compute under the next product")):
        spans = _schedule(overlapped)
        for lane, step, start, length in spans:
            y = 1.1 if lane == 0 else 0.1
            ax.add_patch(Rectangle((start, y), length, 0.8, fc=colors[step], ec="white", lw=2))
            ax.text(start + length / 2, y + 0.4, step, ha="center", va="center",
                    fontsize=TEXT, color="white")
        end = max(s + n for _, _, s, n in spans)
        ends.append(end)
        ax.axvline(end, color="0.3", lw=1, ls="--")
        ax.set_yticks([1.5, 0.5], ["tensor cores (wgmma)", "exponentials, FMAs"],
                      fontsize=LABEL - 1)
        ax.set_ylim(0, 2.0)
        ax.set_title(name, fontsize=LABEL, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlim(0, max(ends) + 0.5)
    axes[1].set_xticks([])
    axes[1].set_xlabel("time within one query block (schematic)", fontsize=LABEL)
    fig.suptitle("One consumer warpgroup: the arithmetic between the products moves under them",
                 fontsize=TITLE - 2)
    fig.tight_layout()
    return fig


def live_registers() -> pd.DataFrame:
    """Per head dim, the fp32 values and 16-bit fragments a consumer thread holds while it
    computes dS under dV's products (stage 22's order), in 32-bit registers: the accumulators of
    dK and dV (64 keys x D), of S^T (by then P) and dP^T (64 keys x BR queries), and P packed as
    dV's A fragments (half a register a value), against the 240 setmaxnreg leaves a consumer.
    Addresses, indices and the loop's own values come on top."""
    rows = []
    for D in (64, 128):
        BR = query_rows(D)
        acc = KEYS * D // THREADS                  # dK or dV, per thread
        scores = KEYS * BR // THREADS              # S^T (P) or dP^T, per thread
        packed = scores // 2                       # P as 16-bit pairs
        total = 2 * acc + 2 * scores + packed
        rows.append(dict(D=D, query_rows=BR, dK_and_dV=2 * acc, P_and_dP=2 * scores,
                         P_packed=packed, total=total, left_of_240=CONSUMER_REGS - total))
    return pd.DataFrame(rows).set_index("D")


def waits(stages=("20_warpspec_backward", "22_overlap_backward"), arch="sm_90a") -> pd.DataFrame:
    """The wgmma.wait_group instructions of each stage's backward kernel (fp16), per head dim, as
    the machine code has them (flashlab.sass.group_waits): waits for every group (nothing left
    on the tensor cores) and waits with some still running. Needs cuobjdump."""
    from . import sass
    from .stages import stage
    parts = []
    for slug in stages:
        st = stage(slug)
        w = sass.group_waits(st.source, arch)
        w = w[w.index.str.startswith(f"{st.backward}<__half")]
        w.index = [f"{slug}, D = {k.split(',')[1].strip(' >')}" for k in w.index]
        parts.append(w)
    out = pd.concat(parts)
    out.columns = ["wait for every group", "wait with some still running"]
    return out
