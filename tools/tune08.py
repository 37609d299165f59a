"""Stage 08's autotune: time every candidate shape of kernels/08_tuned.cu on this GPU, record all
of them in data/tune08.csv, and (with --apply, on any machine) write the winners into the kernel's
pick() table.

    python tools/tune08.py            # on the GPU: measure, record data/tune08.csv
    python tools/tune08.py --apply    # anywhere: rewrite pick() from data/tune08.csv

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
prediction of a cost, and the timing says what it is (notebook 08, section 3.4).
"""
import argparse
import math
import os
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KERNEL = ROOT / "kernels" / "08_tuned.cu"
FIELDS = ("BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS")
SWITCHES = {"FOLD_SCALE": 1, "SKIP_RESCALE": 2, "WARP_SKIP": 4, "LANE_OFFSETS": 8,
            "ONE_KSTEP": 16}  # enum Opts
ALL_OPTS = 31
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
NS = (512, 1024, 2048, 4096, 8192, 16384)  # the FlashAttention sweep's (flashlab.bench.SWEEP_NS)
PICK = re.compile(r"(// TUNED:[^\n]*\n)template <typename T>\nstatic const char\* pick\(.*?\n}\n",
                  re.S)


def csv_path():
    from flashlab import paths
    return paths.data_dir() / "tune08.csv"


def _launch(D, c):
    bc, warps, wm, stages, q_regs, opts = c
    return (f"launch<T, {D}, {bc}, {warps}, {wm}, {stages}, {'true' if q_regs else 'false'}, "
            f"{opts}>(p, s)")


def segments(by_n):
    """[(first N of the next segment or None, candidate)] for a candidate or {N: candidate}:
    runs of equal choices over the timed N; a segment serves every N below where the next begins."""
    if not isinstance(by_n, dict):
        return [(None, tuple(by_n))]
    ns = sorted(by_n)
    out = []
    for i, n in enumerate(ns):
        c = tuple(by_n[n])
        if out and out[-1][1] == c:
            out[-1] = (None, c)
        else:
            if out:
                out[-1] = (n, out[-1][1])
            out.append((None, c))
    return out


def pick_source(choice):
    """The pick() function for {(D, causal): candidate, or {N: candidate}}."""
    lines = ["template <typename T>",
             "static const char* pick(const FlashlabProblem* p, cudaStream_t s) {"]

    def returns(v, indent):
        segs = segments(v)
        for below, c in segs:
            cond = f"if (p->N < {below}) " if below is not None else ""
            lines.append(f"{indent}{cond}return {_launch(D, c)};")

    for D in sorted({d for d, _ in choice}):
        lines.append(f"  if (p->D == {D}) {{")
        causal = segments(choice[(D, True)])
        if len(causal) == 1:
            lines.append(f"    if (p->causal) return {_launch(D, causal[0][1])};")
        else:
            lines.append("    if (p->causal) {")
            returns(choice[(D, True)], "      ")
            lines.append("    }")
        returns(choice[(D, False)], "    ")
        lines.append("  }")
    lines.append("  return \"no tuned shape for this head dim\";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def with_pick(text, choice):
    m = PICK.search(text)
    if not m:
        raise SystemExit(f"{KERNEL}: no '// TUNED:' pick() block to rewrite")
    return text[:m.start()] + m.group(1) + pick_source(choice) + text[m.end():]


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


def apply():
    import pandas as pd
    df = pd.read_csv(csv_path())
    df["causal"] = df["causal"].astype(str).str.lower().isin(["true", "1"])
    df["chosen"] = df["chosen"].astype(str).str.lower().isin(["true", "1"])
    gpu = df.sort_values("time")["gpu"].iloc[-1]  # the GPU tuned most recently
    choice = chosen_by_n(df[df["gpu"] == gpu])
    missing = [(D, causal) for D in CANDIDATES for causal in (False, True) if (D, causal) not in choice]
    if missing:  # pick() would lose a head dim or mask: say so instead of a KeyError
        raise SystemExit(f"{csv_path()}: no chosen row on {gpu} for (D, causal) in {missing}: "
                         "re-run python tools/tune08.py on that GPU")
    print(f"the choices tuned on {gpu}")
    text = KERNEL.read_text()
    KERNEL.write_text(with_pick(text, choice))
    for (D, causal), by_n in sorted(choice.items()):
        for below, c in segments(by_n):
            span = f" N < {below}" if below is not None else ""
            print(f"D={D} causal={causal}{span}: " + ", ".join(f"{f}={v}" for f, v in zip(FIELDS, c)))
    print(f"wrote pick() in {KERNEL}")


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
    import pandas as pd
    import torch

    import flashlab as fl
    from flashlab import results
    from flashlab.bench import Config, bench
    from flashlab.build import build_module
    from flashlab.env import environment
    from flashlab.stages import Attention

    st = fl.stage("08_tuned")
    env = environment()
    text = KERNEL.read_text()
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="tune08-"))

    def build_all(jobs):
        """Compile the variants in parallel (nvcc runs outside the GIL); {job: module}."""
        def one(job):
            D, c = job[0], job[1]
            path = tmp / "_".join(map(str, (D, *c))) / "08_tuned.cu"
            path.parent.mkdir(exist_ok=True)
            path.write_text(with_pick(text, {(D, False): c, (D, True): c}))
            return build_module(path)
        shapes = list(dict.fromkeys((job[0], job[1]) for job in jobs))  # build each shape once
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            built = dict(zip(shapes, pool.map(one, shapes)))
        return {job: built[(job[0], job[1])] for job in jobs}

    def run(jobs):
        for job, module in build_all(jobs).items():
            D, c, causals, variant = job
            attn = Attention(st, module)
            chk = fl.check(attn, dtype="fp16", head_dims=(D,), shapes=((1, 2, 1000), (2, 3, 17)))
            for causal in causals:
                for n in NS:
                    cfg = Config(16384 // n, 2048 // D, n, D, causal, "fp16")
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
    path = csv_path()
    # Lock and atomic rename like the results table; this GPU's earlier rows are replaced whole.
    results.upsert_csv(df.to_dict("records"), path,
                       key=["gpu", "D", "causal", "variant", *FIELDS, "N"],
                       replace={"gpu": env["gpu"]})
    out(f"recorded {len(df)} rows in {path}")
    return df


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--apply", action="store_true",
                    help="rewrite pick() in kernels/08_tuned.cu from data/tune08.csv (no GPU)")
    args = ap.parse_args(argv)
    if args.apply:
        apply()
    else:
        measure()


if __name__ == "__main__":
    main()
