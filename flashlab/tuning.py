"""The lesson helpers of notebook 08 and its appendix 08a: the autotune's log (flashlab.autotune
wrote it to data/tune08.csv) as tables and figures, and the arithmetic that predicts each change
before it is timed (no GPU needed for that part).

    from flashlab import tuning
    log = fl.tables.tune_log()        # the GPU shown's tuning log (NotRecorded while none)
    tuning.candidates_figure(log)     # every shape's score per head dim and mask, the winner marked
    tuning.ablation_figure(log)       # the winner with each switch off, and stage 07's shape
    tuning.verdicts(log)              # per switch: all on, without it, kept or dropped
    tuning.warp_tile(64, 64, WM=2)    # ldmatrix and FLOPs per warp and K/V tile, from 08's loops

A candidate is (BC, WARPS, WM, STAGES, Q_REGS, OPTS), as in kernels/08_tuned.cu (flashlab.picks).
"""
import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from . import autotune as _tune
from . import picks, tables
from .stages import stages
from .tables import NotRecorded

PANELS = [(64, False), (64, True), (128, False), (128, True)]


def _log(log):
    return tables.tune_log() if log is None else log


def shape(c) -> str:
    """'BC 64 · 4 warps · WM 2 · 2 stages · Q regs' for (BC, WARPS, WM, STAGES, Q_REGS[, OPTS])."""
    bc, warps, wm, stages, q_regs = c[:5]
    return f"BC {bc} · {warps} warps · WM {wm} · {stages} stages · Q {'regs' if q_regs else 'smem'}"


def options(opts) -> str:
    """'all on', 'none', or 'without WARP_SKIP' for an OPTS bit mask."""
    sw = _tune.SWITCHES
    off = [name for name, bit in sw.items() if not opts & bit]
    return "all on" if not off else "none" if len(off) == len(sw) else "without " + ", ".join(off)


def scores(log=None) -> pd.DataFrame:
    """One row per (D, causal, variant, candidate): the recorded score (geometric mean TFLOP/s
    over N), whether it is the chosen row, and the candidate as a tuple."""
    log = _log(log)
    fields = list(_tune.FIELDS)
    out = (log.groupby(["D", "causal", "variant", *fields], sort=False)
           .agg(score=("score", "first"), chosen=("chosen", "any")).reset_index())
    out["candidate"] = list(map(tuple, out[fields].to_numpy().tolist()))
    return out


def choice(log=None) -> dict:
    """{(D, causal): the chosen candidate}, as `tune08.py --apply` writes it into pick()."""
    return _tune.chosen(_log(log))


def _score(sc, D, causal, variant, c=None):
    sel = sc[(sc["D"] == D) & (sc["causal"] == causal) & (sc["variant"] == variant)]
    if c is not None:
        sel = sel[sel["candidate"] == tuple(c)]
    return float(sel["score"].iloc[0]) if len(sel) else math.nan


def _all_on(sc, D, causal, c):
    """The winner's score with every switch on: timed again beside its ablations where the log has
    that row (the first timing won a contest, so it is biased high), else the contest's."""
    t = _tune
    full = c[:-1] + (t.ALL_OPTS,)
    again = _score(sc, D, causal, getattr(t, "RETIMED", None), full)
    return again if again == again else _score(sc, D, causal, t.ALL, full)


def candidate_table(log=None) -> pd.DataFrame:
    """Every shape's score with all switches on: rows (D, causal), a column per shape, and the
    winner of the contest (the chosen shape, whose switches may differ)."""
    t = _tune
    sc = scores(log)
    sc = sc[sc["variant"] == t.ALL]
    wide = sc.assign(shape=sc["candidate"].map(shape)).pivot_table(
        index=["D", "causal"], columns="shape", values="score", sort=False)
    return wide


def verdicts(log=None) -> pd.DataFrame:
    """Per (D, causal) and switch: the winner's score with all switches on and without that one,
    the change switching it off made, and whether the chosen kernel keeps it."""
    t = _tune
    log = _log(log)
    sc, chosen = scores(log), choice(log)
    rows = []
    for (D, causal), c in sorted(chosen.items()):
        on = _all_on(sc, D, causal, c)
        for name, bit in t.SWITCHES.items():
            off = _score(sc, D, causal, f"without {name}", c[:-1] + (t.ALL_OPTS & ~bit,))
            rows.append(dict(D=D, causal=causal, switch=name, all_on=on, without=off,
                             off_vs_on_pct=100 * (off / on - 1), kept=bool(c[-1] & bit)))
    return pd.DataFrame(rows).set_index(["switch", "D", "causal"]).sort_index(level=0, sort_remaining=False)


def effects(changes, log=None) -> pd.DataFrame:
    """Measured score ratios of one shape change at a time, all switches on.
    changes: {name: {D: (from shape, to shape)}} with 5-field shapes; pairs the log lacks give NaN."""
    t = _tune
    sc = scores(log)
    rows = []
    for name, by_d in changes.items():
        for D, (a, b) in by_d.items():
            for causal in (False, True):
                s0, s1 = (_score(sc, D, causal, t.ALL, (*x, t.ALL_OPTS)) for x in (a, b))
                rows.append(dict(change=name, D=D, causal=causal, before=s0, after=s1,
                                 ratio=s1 / s0))
    return pd.DataFrame(rows).set_index(["change", "D", "causal"])


def per_n(log=None) -> pd.DataFrame:
    """TFLOP/s per N of the chosen kernel beside the best candidate shape at that N (all on): where
    one shape for every N costs something."""
    t = _tune
    log = _log(log)
    rows = []
    for (D, causal), c in sorted(choice(log).items()):
        here = log[(log["D"] == D) & (log["causal"] == causal)]
        mine = here[here["chosen"]].set_index("N")["tflops"]
        shapes = here[here["variant"] == t.ALL]
        best = shapes.loc[shapes.groupby("N")["tflops"].idxmax()].set_index("N")
        for n in sorted(mine.index):
            rows.append(dict(D=D, causal=causal, N=n, chosen=mine[n], best_shape=shape(
                tuple(best.loc[n, list(t.FIELDS)])), best=best.loc[n, "tflops"]))
    return pd.DataFrame(rows).set_index(["D", "causal", "N"])


# ---------------------------------------------------------------- figures


def _panels(title):
    fig = Figure(figsize=(13, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    fig.suptitle(title, fontsize=11)
    return fig, axes.flat


def _bars(ax, labels, values, colors, notes, title):
    y = np.arange(len(labels))
    ax.barh(y, values, color=colors, zorder=2)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    top = np.nanmax(values) if np.isfinite(values).any() else 1.0
    for yi, v, note in zip(y, values, notes):
        text = "not timed" if v != v else f"{v:.0f} {note}".rstrip()
        ax.annotate(text, (0 if v != v else v, yi), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_xlim(0, top * 1.3)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("score: geometric mean TFLOP/s over N (fp16)", fontsize=8)
    ax.grid(axis="x", alpha=0.3, zorder=0)


def candidates_figure(log=None):
    """(a) every candidate shape's score per head dim and mask, all switches on: the contest's
    winner (the chosen shape) in red, stage 07's shape hatched."""
    t = _tune
    log = _log(log)
    sc, chosen = scores(log), choice(log)
    fig, axes = _panels(f"Stage 08's candidate shapes, all switches on — {log['gpu'].iloc[0]}")
    for ax, (D, causal) in zip(axes, PANELS):
        cands = t.CANDIDATES.get(D, [])
        vals = np.array([_score(sc, D, causal, t.ALL, (*c, t.ALL_OPTS)) for c in cands])
        win = chosen.get((D, causal), (None,) * 6)[:-1]
        colors = ["tab:red" if c == win else "tab:blue" for c in cands]
        notes = ["← chosen" if c == win else "" for c in cands]
        labels = [shape(c) + ("\n(stage 07's shape)" if i == 0 else "") for i, c in enumerate(cands)]
        _bars(ax, labels, vals, colors, notes, f"D = {D}, {'causal' if causal else 'not causal'}")
        if ax.patches:
            ax.patches[0].set_hatch("//")  # the first candidate is stage 07's shape
    return fig


def ablation_figure(log=None):
    """(b) the chosen shape with all switches on, with each switch off in turn, and stage 07's
    shape with all off as the starting point; green: the switch is kept, grey: dropped."""
    t = _tune
    log = _log(log)
    sc, chosen = scores(log), choice(log)
    fig, axes = _panels(f"Stage 08's switches, one off at a time — {log['gpu'].iloc[0]}")
    for ax, (D, causal) in zip(axes, PANELS):
        c = chosen.get((D, causal))
        if c is None:
            ax.axis("off")
            ax.text(0.5, 0.5, f"D = {D}, causal = {causal}: no chosen row", ha="center",
                    transform=ax.transAxes, color="0.4")
            continue
        on = _all_on(sc, D, causal, c)
        labels = ["stage 07's shape, all off", "chosen shape, all on"]
        vals = [_score(sc, D, causal, t.STAGE07), on]
        colors = ["0.6", "tab:blue"]
        for name, bit in t.SWITCHES.items():
            if name == "WARP_SKIP" and not causal:
                continue  # a mask-free launch never skips a tile: not timed
            labels.append(f"without {name}")
            vals.append(_score(sc, D, causal, f"without {name}", c[:-1] + (t.ALL_OPTS & ~bit,)))
            colors.append("tab:green" if c[-1] & bit else "0.75")
        if c[-1] != t.ALL_OPTS:
            labels.append(f"chosen: {options(c[-1])}")
            vals.append(_score(sc, D, causal, t.CHOSEN, c))
            colors.append("tab:red")
        vals = np.array(vals)
        notes = [f"({100 * (v / on - 1):+.1f}%)" if i != 1 else "" for i, v in enumerate(vals)]
        _bars(ax, labels, vals, colors, notes,
              f"D = {D}, {'causal' if causal else 'not causal'}: {shape(c)}")
    return fig


# ---------------------------------------------------------------- predictions, no GPU


def warp_tile(D, BC, WM=1, Q_REGS=True) -> dict:
    """What one warp of stage 08 does per K/V tile, counted from its loops (KD = D/16 k-steps,
    NS = BC/8 score tiles, KS = BC/16 P·V k-steps, NO = D/8 output tiles): FLOPs, mma.sync,
    ldmatrix.x4 for K, V and Q re-reads, their shared-memory wavefronts (4 per x4: the swizzle
    makes every phase conflict-free), and the registers its accumulators and Q hold per lane."""
    from .fragments import ldmatrix_wavefronts
    KD, NS, KS, NO = D // 16, BC // 8, BC // 16, D // 8
    ldsm = {"K": NS * KD // 2, "V": KS * NO // 2, "Q": 0 if Q_REGS else WM * KD}
    x4 = ldmatrix_wavefronts(2 * D, swizzle=True).wavefronts
    return dict(flops=4 * 16 * WM * BC * D, mma=WM * (NS * KD + KS * NO),
                ldmatrix=sum(ldsm.values()), ldmatrix_kv=ldsm["K"] + ldsm["V"],
                ldmatrix_q=ldsm["Q"], wavefronts=x4 * sum(ldsm.values()),
                regs_o=WM * NO * 4, regs_s=WM * NS * 4, regs_q=WM * KD * 4 if Q_REGS else 0)


def block_tile(D, BC, WARPS, WM, STAGES, Q_REGS=True) -> dict:
    """warp_tile for a whole block, plus the cp.async stores of its K and V tiles (16 bytes a
    lane, 4 wavefronts per warp-instruction when conflict-free) and its shared memory."""
    w = warp_tile(D, BC, WM, Q_REGS)
    copy = 2 * BC * D * 2 // 128
    smem = (16 * WM * WARPS + 2 * BC * STAGES) * D * 2  # Tiles::SMEM_BYTES
    return dict(BR=16 * WM * WARPS, flops=WARPS * w["flops"],
                wavefronts=WARPS * w["wavefronts"] + copy, smem_bytes=smem,
                accumulators=w["regs_o"] + w["regs_s"], q_regs=w["regs_q"])


def issue(D, BC, WM=1, Q_REGS=True, WARPS=4, opts=15, rescale_skipped=0.0) -> pd.Series:
    """Warp-instructions one warp issues per K/V tile, step by step, as notebook 05 counted them
    for stage 05: mma.sync and ldmatrix exact (the loops are unrolled), the rest estimated from the
    source (≈). `opts` removes what the switches remove; `rescale_skipped` is the fraction of tiles
    on which SKIP_RESCALE skips the rescale (rescales_skipped)."""
    sw = _tune.SWITCHES
    w = warp_tile(D, BC, WM, Q_REGS)
    scores = w["regs_s"]  # the scores a lane holds per tile, WM NS 4
    copies = 2 * BC * D * 2 // (16 * 32 * WARPS)  # 16-byte cp.async per lane per tile, K and V
    skip = opts & sw["SKIP_RESCALE"]
    return pd.Series({
        "mma.sync (exact)": w["mma"],
        "ldmatrix.x4 (exact)": w["ldmatrix"],
        "scale every score (an FMUL; none with FOLD_SCALE)": 0 if opts & sw["FOLD_SCALE"] else scores,
        "softmax: max, exponent, ex2, sum (≈ 4 per score)": 4 * scores,
        "rescale O (an FMUL per accumulator, where needed)":
            w["regs_o"] * (1 - (rescale_skipped if skip else 0)),
        "vote on the rescale (SKIP_RESCALE, ≈ 2 per row tile + 2)": 2 * WM + 2 if skip else 0,
        "pack P to 16 bits": WM * (BC // 16) * 4,
        "cp.async of K and V with addresses (≈ 3 per 16 bytes)": 3 * copies,
        "shuffles, row bookkeeping, loop, barrier (≈)": 16 * WM + 14,
    }, name="warp-instructions per warp per K/V tile")


def limits(D, c, tc_rate, rescale_skipped=0.0) -> pd.Series:
    """SM clocks one block of candidate c = (BC, WARPS, WM, STAGES, Q_REGS, OPTS) needs per K/V
    tile from each unit, if it had the SM to itself: the tensor cores at `tc_rate` FLOP per clock
    (from the measured matmul ceiling), shared memory at one wavefront per clock, instruction issue
    at 4 warp-instructions per clock. The largest binds; the others overlap with it."""
    bc, warps, wm, stages, q_regs, opts = c
    b = block_tile(D, bc, warps, wm, stages, q_regs)
    return pd.Series({
        "tensor cores": b["flops"] / tc_rate,
        "shared memory": b["wavefronts"],
        "instruction issue": warps * issue(D, bc, wm, q_regs, warps, opts, rescale_skipped).sum() / 4,
    }, name="SM clocks per K/V tile per block")


def rescales_skipped(rows, tiles) -> float:
    """The expected fraction of a warp's `tiles` K/V tiles on which no one of its `rows` rows sees
    its running max move, so that alpha == 1 for all of them and SKIP_RESCALE skips the rescale of
    O. For the benchmark's randn inputs a row's scores are i.i.d., so the max of tiles 1..j is in
    tile j with probability 1/j; rows taken as independent. The first tile always rescales
    (alpha = 0: there was nothing to keep)."""
    j = np.arange(2, tiles + 1)
    return float(((1 - 1 / j) ** rows).sum() / tiles)


def warp_tiles_skipped(N, BR, BC, WM) -> float:
    """The fraction of a causal launch's (warp, K/V tile) steps that WARP_SKIP drops: the kernel
    skips tile k0 for a warp when k0 > q0 + (warp + 1) WM 16 - 1."""
    done = skipped = 0
    for q0 in range(0, N, BR):
        tiles = (min(N, q0 + BR) + BC - 1) // BC
        for warp in range(BR // (16 * WM)):
            last = q0 + (warp + 1) * WM * 16 - 1
            skip = sum(1 for j in range(tiles) if j * BC > last)
            done += tiles
            skipped += skip
    return skipped / done


def launch_efficiency(N, heads, BR, BC, slots, causal) -> float:
    """How busy a launch keeps the GPU: the ideal time (all K/V tiles of all blocks spread evenly
    over `slots` = SMs x blocks per SM) over the time of the block schedule, blocks dispatched in
    grid order (query tiles of head 0 first: for a causal mask the kernel numbers the longest
    first) each to the slot that frees first, a block's time its number of K/V tiles. 1: no
    slot idles; a causal launch's last, short blocks cannot fill what its long ones leave."""
    import heapq
    q_tiles = math.ceil(N / BR)
    work = [math.ceil((min(N, (q_tiles - 1 - x) * BR + BR) if causal else N) / BC)
            for x in range(q_tiles)] * heads
    free = [0] * min(slots, len(work))
    for w in work:
        heapq.heappush(free, heapq.heappop(free) + w)
    return sum(work) / slots / max(free)


def resources(jobs, arch="sm_90") -> pd.DataFrame:
    """ptxas's registers and spills for each (D, candidate) in `jobs`, compiled now (nvcc only;
    cached). One row per job: its fp16 kernel (bf16's is the same code)."""
    from concurrent.futures import ThreadPoolExecutor

    from . import ptxas

    def one(job):  # `folder` is the temporary one below
        D, c = job
        found = [r for r in ptxas.resources(picks.variant_source(D, c, folder), arch)
                 if r.kernel.split("(")[0].removeprefix("void ") == picks.kernel_name(D, c)]
        r = found[0]
        return dict(D=D, shape=shape(c), OPTS=options(c[-1]), registers=r.registers,
                    spill_bytes=r.spill_bytes, stack_bytes=r.stack_bytes)

    with tempfile.TemporaryDirectory(prefix="flashlab-08-") as tmp, \
            ThreadPoolExecutor(max_workers=4) as pool:
        folder = Path(tmp)
        try:
            return pd.DataFrame(list(pool.map(one, jobs)))
        except FileNotFoundError as err:  # no nvcc here
            raise NotRecorded(f"ptxas's report of stage 08's candidates: {err}") from None


ADDRESS_OPS = ["IMAD", "LEA", "LOP3", "IADD3", "SHF"]


def address_mix(sources, arch="sm_90") -> pd.DataFrame:
    """Static counts of the integer instructions that compute addresses, per labelled .cu file
    ({label: path}), fp16 kernel at head dim 64: IMAD less its register moves (IMAD.MOV is how
    ptxas copies a register), LEA, LOP3, IADD3, SHF; then the moves and every instruction.
    Needs nvcc and cuobjdump (flashlab.sass)."""
    from . import sass
    rows = {}
    for label, src in sources.items():
        try:
            mix = sass.instruction_mix(src, arch)
        except FileNotFoundError as err:  # no nvcc or cuobjdump here
            raise NotRecorded(f"SASS counts: {err}") from None
        # not a forward's WITH_LSE instantiation, which runs only when the lse is asked for
        lse = mix["kernel"].map(lambda k: any(st.writes_lse(k) for st in stages()))
        mix = mix[mix["kernel"].str.contains(r"<__half, 64\b") & ~lse]
        base = mix["opcode"].str.split(".").str[0]
        moves = mix["opcode"].str.startswith("IMAD.MOV")
        row = {op: int(mix.loc[(base == op) & ~moves, "count"].sum()) for op in ADDRESS_OPS}
        row["integer, together"] = sum(row.values())
        row["IMAD.MOV (moves)"] = int(mix.loc[moves, "count"].sum())
        row["every instruction"] = int(mix["count"].sum())
        rows[label] = row
    return pd.DataFrame(rows).T
