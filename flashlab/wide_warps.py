"""Stage 17 on the CPU: what 32 keys a warp changes in the backward, drawn and counted from the
kernels' loops (no GPU needed).

kernels/17_wide_warps.cu keeps stage 15's backward (a block per key block, dK and dV in the warps'
accumulators, dS^T through shared memory for dQ, dQ added with fp32 atomics) and gives each warp
32 keys instead of 16: two m-tiles, so each Q_i and dO_i fragment it loads feeds twice the
mma.sync, and a block holds 128 keys. At D = 128 the accumulators of 32 keys do not fit in one
warp's registers, so a pair of warps shares them (bwd_pairs). The counts below follow the loops
of both kernels, per 64 keys and 64 queries of work, so that the stages compare like for like.

    from flashlab import wide_warps
    wide_warps.figure()          # who owns which keys: stage 15, stage 17 at D = 64 and 128
    wide_warps.registers(D=64)   # accumulator floats a lane, against the 255-register ceiling
    wide_warps.counts(D=64)      # mma, ldmatrix, stores and dQ reductions per 64 x 64 of work
"""
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

TITLE, LABEL, TEXT = 15, 12, 11     # font sizes, as the other lessons' figures
BR = 64                             # queries of a query block, in both stages


def _shape(stage, D):
    """(warps, keys a warp owns, queries of S^T at a time, pairs) of a block."""
    if stage == 15:
        return 4, 16, (32 if D > 64 else 64), False
    if D > 64:
        return 8, 32, 32, True
    return 4, 32, 32, False


def registers(D=64) -> pd.DataFrame:
    """Accumulator floats a lane: dK and dV (the warp's keys x its share of D, over 32 lanes) and
    S^T and dP^T (its keys x the queries taken at once), in stage 15, in stage 17, and in stage
    17's shape at D = 128 without the pairs. Beside them each lane needs its addresses, its
    fragments and the log-sum-exps: about 60 registers more, under the ceiling of 255."""
    rows = {}
    for name, keys, cols, sub in (("stage 15", 16, D, _shape(15, D)[2]),
                                  ("stage 17", 32, D // 2 if D > 64 else D, 32),
                                  ("32 keys, one warp, all D columns", 32, D, 32)):
        if name.startswith("32 keys") and D == 64:
            continue
        dkdv = 2 * keys * cols // 32
        sdp = 2 * keys * sub // 32
        rows[name] = {"dK + dV": dkdv, "S^T + dP^T": sdp, "accumulators": dkdv + sdp}
    return pd.DataFrame(rows).T.rename_axis(f"floats a lane, D = {D}")


def _per_warp(stage, D):
    """mma.sync, ldmatrix.x4, 32-bit STS and dQ reductions (add_pair, each lane) of one warp and
    one query block, loop by loop as the kernel runs them."""
    warps, keys, sub, pairs = _shape(stage, D)
    wk, kd, nq = keys // 16, D // 16, sub // 8
    if pairs:   # S^T for half the queries; dV, dK for half the columns over all queries
        cols = D // 2
        s = {"mma": kd * (nq // 2) * wk * 4, "ldmatrix": kd * (2 * wk + nq)}
        sts = wk * nq * 2 * 2                     # P^T and dS^T
        dvdk = {"mma": (BR // 16) * (cols // 16) * wk * 4,
                "ldmatrix": (BR // 16) * (2 * wk + cols // 8)}
        kk = warps * keys // 2 // 16              # a pair's keys are shared: 128 keys a block
        dq = {"mma": kk * 8, "ldmatrix": kk + kk * 4, "red": 16}
    else:
        subs, kq, nd = BR // sub, sub // 16, D // 8
        s = {"mma": subs * kd * nq * 2 * wk, "ldmatrix": subs * kd * (2 * wk + nq)}
        sts = subs * kq * 4 * wk                  # dS^T
        dvdk = {"mma": subs * kq * nd * 2 * wk, "ldmatrix": subs * kq * nd}
        kk = warps * keys // 16
        dq = {"mma": (D // 64) * kk * 8, "ldmatrix": kk + (D // 64) * kk * 4,
              "red": (D // 64) * 16}
    return {"mma": s["mma"] + dvdk["mma"] + dq["mma"],
            "ldmatrix.x4": s["ldmatrix"] + dvdk["ldmatrix"] + dq["ldmatrix"],
            "STS": sts, "dQ reductions": dq["red"] * 32}


def counts(D=64) -> pd.DataFrame:
    """Per 64 keys and one query block of 64 queries, in stage 15 and stage 17: mma.sync,
    ldmatrix.x4, 32-bit stores to shared memory and the 64-bit dQ reductions to global memory
    (add_pair, one a lane per call), and ldmatrix per mma.sync. The products are the same; what
    changes is how often a loaded fragment is used, and how many keys each dQ sum carries."""
    rows = {}
    for st in (15, 17):
        warps, keys, _, pairs = _shape(st, D)
        block_keys = warps * keys // (2 if pairs else 1)
        per = _per_warp(st, D)
        rows[f"stage {st}"] = {k: v * warps * 64 // block_keys for k, v in per.items()}
    t = pd.DataFrame(rows).T
    t["ldmatrix per mma"] = t["ldmatrix.x4"] / t["mma"]
    return t.rename_axis(f"per 64 keys x 64 queries, D = {D}")


def figure():
    """Three blocks side by side: stage 15's 64 keys in 4 warps of 16; stage 17's 128 keys in 4
    warps of 32 at D = 64; and at D = 128, 128 keys in 4 pairs of warps, each warp of a pair
    taking half the queries for S and dP and half the head-dim columns for dK and dV."""
    fig = Figure(figsize=(13, 5.4))
    colors = ["#c6dbef", "#6baed6", "#9ecae1", "#deebf7"]
    panels = [("stage 15: 64 keys, 4 warps", 16, 4, False),
              ("stage 17, D = 64: 128 keys, 4 warps", 32, 4, False),
              ("stage 17, D = 128: 128 keys, 4 pairs", 32, 4, True)]
    for p, (title, keys, groups, pairs) in enumerate(panels):
        ax = fig.add_axes([0.02 + 0.33 * p, 0.08, 0.3, 0.8])
        ax.set_xlim(-26, BR + 2)
        ax.set_ylim(150, -10)
        ax.axis("off")
        ax.set_title(title, fontsize=TITLE - 2)
        for w in range(groups):
            y = keys * w
            if pairs:
                for hq in range(2):
                    ax.add_patch(Rectangle((32 * hq, y), 32, keys, facecolor=colors[w],
                                           edgecolor="k", lw=0.8, hatch="//" if hq else None))
                    ax.text(32 * hq + 16, y + keys / 2, f"warp {2 * w + hq}", ha="center",
                            va="center", fontsize=TEXT - 1)
                label = f"pair {w}\nkeys {y}–{y + keys - 1}"
            else:
                ax.add_patch(Rectangle((0, y), BR, keys, facecolor=colors[w], edgecolor="k",
                                       lw=0.8))
                label = f"warp {w}\nkeys {y}–{y + keys - 1}"
            ax.text(-1, y + keys / 2, label, ha="right", va="center", fontsize=TEXT - 1)
        ax.text(BR / 2, -2, "64 queries (a query block)", ha="center", fontsize=TEXT)
        notes = {0: "each Q, dO fragment: 2 mma.sync",
                 1: "each Q, dO fragment: 4 mma.sync\nhalf the dQ sums a key",
                 2: "S, dP: warp h, queries 32h..\ndK, dV: warp h, columns 64h..\n"
                    "P, dS through shared memory"}
        ax.text(BR / 2, groups * keys + 3, notes[p], ha="center", va="top", fontsize=TEXT)
    return fig
