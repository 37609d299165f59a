"""Stage 08's autotune: time every candidate shape of the tuned stage's kernel on this GPU,
record all of them in data/tune08.csv, and write the winners into the kernel's pick() table.

    flashlab tune            # on the GPU: measure, record data/tune08.csv
    flashlab tune --apply    # anywhere: rewrite pick() from data/tune08.csv
    (python tools/tune08.py [--apply] does the same)

A candidate is (BC, WARPS, WM, STAGES, Q_REGS, OPTS) — see the header of kernels/08_tuned.cu. A
shape's score for one head dim and mask is the geometric mean of its TFLOP/s over the
FlashAttention sweep's sequence lengths (B·N = 16k tokens, H·D = 2048). Shapes are compared with
every OPTS bit on; the best score wins, except at a sequence length where another shape is more
than MARGIN faster: that N gets its own shape (short causal launches favour small blocks). Then
each chosen shape is timed with each bit off, one at a time (variant "without <bit>"), and with
all on again beside them (the winner of several noisy runs is biased high); a bit stays on only
where switching it off lost, over the N the shape serves. If that drops any bit, the final choice
is timed once more ("chosen"). Stage 07's shape with every bit off is timed too, as the log's
starting point. Shapes are not excluded for spilling registers: ptxas's spill report is a
prediction of a cost, and the timing says what it is (notebook 08, section 3, and its appendix 08a).
"""
import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from . import picks, tables
from .bench import bench
from .configs import SWEEP, Config
from .build import build_module
from .check import check
from .env import environment
from .picks import FIELDS, segments, tuned  # noqa: F401  (FIELDS: the candidate's fields)
from .runtime import Attention
from .tables import TUNE08

CANDIDATES = {  # (BC, WARPS, WM, STAGES, Q_REGS); the first of each is stage 07's shape
    64: [(64, 4, 1, 2, 1), (32, 4, 1, 2, 1), (64, 4, 2, 2, 1), (64, 4, 2, 3, 1),
         (64, 4, 2, 2, 0), (128, 4, 2, 2, 0), (64, 8, 2, 2, 1)],
    128: [(64, 4, 1, 2, 1), (64, 4, 1, 3, 1), (32, 4, 2, 2, 0), (32, 4, 2, 3, 0),
          (64, 4, 2, 2, 0), (64, 8, 2, 2, 0)],
}
MARGIN = 0.03  # a shape serves one N only if it beats the best-scoring shape there by this much
ALL = "all switches on"
RETIMED = "all switches on, timed again"  # beside the ablations: the best of several runs is biased high
STAGE07 = "stage 07's shape, switches off"
CHOSEN = "chosen"
SWITCHES = picks.switches()   # {name: bit}, from the kernel's own `enum Opts`
ALL_OPTS = picks.all_opts()
NS = SWEEP.ns                 # the sweep's sequence lengths (flashlab.configs.SWEEP)


def chosen_by_n(df):
    """{(D, causal): {N: candidate}} from the recorded table's chosen rows."""
    rows = df[df["chosen"]].drop_duplicates(["D", "causal", "N"])
    out = {}
    for _, r in rows.iterrows():
        out.setdefault((int(r.D), bool(r.causal)), {})[int(r.N)] = tuple(int(r[f]) for f in FIELDS)
    return out


def main_choice(by_n):
    """The candidate that serves the longest sequences: the one with no N limit in pick()."""
    return segments(by_n)[-1][1]


def chosen(df):
    """{(D, causal): the candidate that serves the longest N} from the recorded table."""
    return {k: main_choice(v) for k, v in chosen_by_n(df).items()}


def _geomean(x):
    """Geometric mean of TFLOP/s values; 0 if there are none or any run failed (NaN)."""
    return math.exp(sum(map(math.log, x)) / len(x)) if len(x) and x.notna().all() else 0.0


def _scores(df):
    """Geometric mean TFLOP/s over N per shape, mask and variant (0 if any run failed)."""
    return (df.groupby(["D", "causal", "variant", *FIELDS])["tflops"].apply(_geomean)
            .rename("score").reset_index())


def _best(df):
    """{(D, causal): the candidate with the best score, all switches on}."""
    sc = _scores(df[df["variant"] == ALL])
    top = sc.loc[sc.groupby(["D", "causal"])["score"].idxmax()]
    return {(int(r.D), bool(r.causal)): tuple(int(r[f]) for f in FIELDS) for _, r in top.iterrows()}


def _per_n(df, best):
    """{(D, causal): {N: candidate}}: the best-scoring shape, except at an N where another shape
    (all switches on) beat it by more than MARGIN."""
    shapes = df[df["variant"] == ALL]
    out = {}
    for (D, causal), win in best.items():
        here = shapes[(shapes["D"] == D) & (shapes["causal"] == causal)]
        out[(D, causal)] = {}
        for n, at_n in here.groupby("N"):
            mine = at_n[(at_n[list(FIELDS)] == list(win)).all(axis=1)]["tflops"].iloc[0]
            top = at_n.loc[at_n["tflops"].idxmax()]
            c = tuple(int(top[f]) for f in FIELDS)
            out[(D, causal)][int(n)] = c if top["tflops"] > (1 + MARGIN) * mine else win
    return out


def _geo(df, D, causal, variant, c, ns):
    """The score of candidate c over the sequence lengths ns only."""
    sel = df[(df["D"] == D) & (df["causal"] == causal) & (df["variant"] == variant)
             & df["N"].isin(ns)]
    return _geomean(sel[(sel[list(FIELDS)] == list(c)).all(axis=1)]["tflops"])


def measure(out=print):
    """The autotune on this GPU (see the module's docstring); records and returns the log."""
    import torch

    st = tuned()
    env = environment()
    arch = st.arch(torch.cuda.get_device_capability())
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="tune08-"))

    def build_all(jobs):
        """Compile the variants in parallel (nvcc runs outside the GIL); {job: module}."""
        def one(job):
            return build_module(picks.variant_source(job[0], job[1], tmp), arch=arch)
        shapes = list(dict.fromkeys((job[0], job[1]) for job in jobs))  # build each shape once
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            built = dict(zip(shapes, pool.map(one, shapes)))
        return {job: built[(job[0], job[1])] for job in jobs}

    def run(jobs):
        for job, module in build_all(jobs).items():
            D, c, causals, variant = job
            attn = Attention(st, module)
            chk = check(attn, dtype="fp16", head_dims=(D,), shapes=((1, 2, 1000), (2, 3, 17)))
            for causal in causals:
                for n in NS:
                    cfg = Config(SWEEP.tokens // n, SWEEP.width // D, n, D, causal, "fp16")
                    m = bench(attn, cfg, with_error=False) if chk.passed else {"tflops": math.nan}
                    rows.append(dict(zip(FIELDS, c), D=D, causal=causal, N=n, B=cfg.B, H=cfg.H,
                                     variant=variant, tflops=m["tflops"],
                                     check_passed=chk.passed, **env))
            out(f"D={D} {c} {variant}: check {'ok' if chk.passed else 'FAILED'}; " + " ".join(
                f"{r['N']}{'c' if r['causal'] else ''}={r['tflops']:.0f}"
                for r in rows[-len(causals) * len(NS):]))
            torch.cuda.empty_cache()

    # 1. shapes, every switch on; the best score per head dim and mask, and where another shape
    #    wins one N by more than MARGIN
    run([(D, (*c, ALL_OPTS), (False, True), ALL) for D, cands in CANDIDATES.items()
         for c in cands])
    contest = pd.DataFrame(rows)
    per_n = _per_n(contest, _best(contest))
    # 2. each switch off, on every chosen shape, at every N; stage 07's shape with none
    jobs = [(D, (*cands[0], 0), (False, True), STAGE07) for D, cands in CANDIDATES.items()]
    for D in CANDIDATES:
        by_shape = {}
        for causal in (False, True):
            for c in dict.fromkeys(per_n[(D, causal)].values()):
                by_shape.setdefault(c, []).append(causal)
        for c, cs in by_shape.items():
            jobs.append((D, c, tuple(cs), RETIMED))
            for sw, bit in SWITCHES.items():
                causals = tuple(x for x in cs if x or sw != "WARP_SKIP")  # no mask, nothing to skip
                if causals:
                    jobs.append((D, c[:-1] + (ALL_OPTS & ~bit,), causals, f"without {sw}"))
    run(jobs)
    # 3. keep a switch where turning it off lost, over the N its shape serves; time the final
    #    choice where it differs
    df = pd.DataFrame(rows)
    final = {}
    for (D, causal), by_n in per_n.items():
        final[(D, causal)] = {}
        for c in dict.fromkeys(by_n.values()):
            ns = [n for n, x in by_n.items() if x == c]
            opts = ALL_OPTS
            for sw, bit in SWITCHES.items():
                if sw == "WARP_SKIP" and not causal:
                    continue
                off = c[:-1] + (ALL_OPTS & ~bit,)
                if _geo(df, D, causal, f"without {sw}", off, ns) > _geo(df, D, causal, RETIMED, c, ns):
                    opts &= ~bit
            for n in ns:
                final[(D, causal)][n] = c[:-1] + (opts,)
    by_shape = {}
    for (D, causal), by_n in final.items():
        for n, c in by_n.items():
            if c != per_n[(D, causal)][n]:
                by_shape.setdefault((D, c), set()).add(causal)
    if by_shape:
        run([(D, c, tuple(sorted(cs)), CHOSEN) for (D, c), cs in by_shape.items()])
    df = pd.DataFrame(rows)
    df = df.merge(_scores(df), on=["D", "causal", "variant", *FIELDS])
    df["chosen"] = False
    for (D, causal), by_n in final.items():
        for n, c in by_n.items():
            variant = RETIMED if c == per_n[(D, causal)][n] else CHOSEN
            sel = (df["D"] == D) & (df["causal"] == causal) & (df["variant"] == variant) & (df["N"] == n)
            for f, v in zip(FIELDS, c):
                sel &= df[f] == v
            df.loc[sel, "chosen"] = True
        for below, c in segments(by_n):
            out(f"chosen D={D} causal={causal}{f' N < {below}' if below else ''}: {c}")
    # This GPU's earlier rows are replaced whole: a candidate no longer tried must not linger.
    TUNE08.upsert(df, replace={"gpu": env["gpu"]})
    out(f"recorded {len(df)} rows in {TUNE08.path()}")
    return df


def apply(gpu=None, out=print):
    """Write the choice recorded on `gpu` (default: the GPU shown) into the kernel's pick()."""
    df = tables.tune_log(gpu)
    gpu = df["gpu"].iloc[0]
    choice = chosen_by_n(df)
    missing = [(D, causal) for D in CANDIDATES for causal in (False, True) if (D, causal) not in choice]
    if missing:  # pick() would lose a head dim or mask: say so instead of a KeyError
        raise ValueError(f"{TUNE08.path()}: no chosen row on {gpu} for (D, causal) in {missing}: "
                         "re-run flashlab tune on that GPU")
    out(f"the choices tuned on {gpu}")
    src = picks.source()
    src.write_text(picks.with_pick(src.read_text(), choice))
    for (D, causal), by_n in sorted(choice.items()):
        for below, c in segments(by_n):
            span = f" N < {below}" if below is not None else ""
            out(f"D={D} causal={causal}{span}: " + ", ".join(f"{f}={v}" for f, v in zip(FIELDS, c)))
    out(f"wrote pick() in {src}")
