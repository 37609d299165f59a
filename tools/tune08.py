"""Stage 08's autotune: time every candidate shape of kernels/08_tuned.cu on this GPU, record all
of them in data/tune08.csv, and (with --apply, on any machine) write the winners into the kernel's
pick() table.

    python tools/tune08.py            # on the GPU: measure, record data/tune08.csv
    python tools/tune08.py --apply    # anywhere: rewrite pick() from data/tune08.csv

A candidate is (BC, WARPS, WM, STAGES, Q_REGS, OPTS) — see the header of kernels/08_tuned.cu. Shapes
that spill registers on sm_90 are left out of CANDIDATES (ptxas: WM = 2 with BC = 128 at D = 64
or BC = 64 at D = 128, and 8 warps of one row tile at D = 64). The score of a candidate for one head dim and mask
is the geometric mean of its TFLOP/s over the FlashAttention sweep's sequence lengths (B·N = 16k
tokens, H·D = 2048). Shapes are compared with every OPTS bit on. Then the winning shape is timed
with each bit off, one at a time (variant "without <bit>"), and with all on again beside them (the
winner of several noisy runs is biased high); a bit stays on only where switching it off lost. If that drops any bit, the final choice is timed once more ("chosen"). Stage 07's
shape with every bit off is timed too, as the log's starting point.
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
SWITCHES = {"FOLD_SCALE": 1, "SKIP_RESCALE": 2, "WARP_SKIP": 4, "LANE_OFFSETS": 8}  # enum Opts
ALL_OPTS = 15
CANDIDATES = {  # (BC, WARPS, WM, STAGES, Q_REGS); the first of each is stage 07's shape
    64: [(64, 4, 1, 2, 1), (64, 4, 1, 3, 1), (64, 4, 2, 2, 1), (64, 4, 2, 3, 1),
         (64, 4, 2, 2, 0), (32, 4, 2, 3, 1), (64, 8, 2, 2, 1)],
    128: [(64, 4, 1, 2, 1), (64, 4, 1, 3, 1), (32, 4, 1, 2, 1), (32, 4, 2, 2, 0),
          (32, 4, 2, 3, 0), (16, 4, 2, 2, 0), (16, 4, 2, 3, 0), (32, 8, 2, 2, 0)],
}
ALL = "all switches on"
RETIMED = "all switches on, timed again"  # beside the ablations: the best of several runs is biased high
STAGE07 = "stage 07's shape, switches off"
CHOSEN = "chosen"
NS = (512, 1024, 4096, 16384)
PICK = re.compile(r"(// TUNED:[^\n]*\n)template <typename T>\nstatic const char\* pick\(.*?\n}\n",
                  re.S)


def csv_path():
    from flashlab import paths
    return paths.data_dir() / "tune08.csv"


def _launch(D, c):
    bc, warps, wm, stages, q_regs, opts = c
    return (f"launch<T, {D}, {bc}, {warps}, {wm}, {stages}, {'true' if q_regs else 'false'}, "
            f"{opts}>(p, s)")


def pick_source(choice):
    """The pick() function for {(D, causal): candidate}."""
    lines = ["template <typename T>",
             "static const char* pick(const FlashlabProblem* p, cudaStream_t s) {"]
    for D in sorted({d for d, _ in choice}):
        lines.append(f"  if (p->D == {D}) {{")
        lines.append(f"    if (p->causal) return {_launch(D, choice[(D, True)])};")
        lines.append(f"    return {_launch(D, choice[(D, False)])};")
        lines.append("  }")
    lines.append("  return \"no tuned shape for this head dim\";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def with_pick(text, choice):
    m = PICK.search(text)
    if not m:
        raise SystemExit(f"{KERNEL}: no '// TUNED:' pick() block to rewrite")
    return text[:m.start()] + m.group(1) + pick_source(choice) + text[m.end():]


def chosen(df):
    """{(D, causal): candidate} from the recorded table's chosen rows."""
    rows = df[df["chosen"]].drop_duplicates(["D", "causal"])
    return {(int(r.D), bool(r.causal)): tuple(int(r[f]) for f in FIELDS) for _, r in rows.iterrows()}


def apply():
    import pandas as pd
    df = pd.read_csv(csv_path())
    df["causal"] = df["causal"].astype(str).str.lower().isin(["true", "1"])
    df["chosen"] = df["chosen"].astype(str).str.lower().isin(["true", "1"])
    gpu = df.sort_values("time")["gpu"].iloc[-1]  # the GPU tuned most recently
    choice = chosen(df[df["gpu"] == gpu])
    missing = [(D, causal) for D in CANDIDATES for causal in (False, True) if (D, causal) not in choice]
    if missing:  # pick() would lose a head dim or mask: say so instead of a KeyError
        raise SystemExit(f"{csv_path()}: no chosen row on {gpu} for (D, causal) in {missing}: "
                         "re-run python tools/tune08.py on that GPU")
    print(f"the choices tuned on {gpu}")
    text = KERNEL.read_text()
    KERNEL.write_text(with_pick(text, choice))
    for (D, causal), c in sorted(choice.items()):
        print(f"D={D} causal={causal}: " + ", ".join(f"{f}={v}" for f, v in zip(FIELDS, c)))
    print(f"wrote pick() in {KERNEL}")


def _scores(df):
    """Geometric mean TFLOP/s over N per shape, mask and variant (0 if any run failed)."""
    geo = lambda x: math.exp(sum(map(math.log, x)) / len(x)) if x.notna().all() else 0.0  # noqa: E731
    return (df.groupby(["D", "causal", "variant", *FIELDS])["tflops"].apply(geo)
            .rename("score").reset_index())


def _best(df):
    """{(D, causal): the candidate with the best score, all switches on}."""
    sc = _scores(df[df["variant"] == ALL])
    top = sc.loc[sc.groupby(["D", "causal"])["score"].idxmax()]
    return {(int(r.D), bool(r.causal)): tuple(int(r[f]) for f in FIELDS) for _, r in top.iterrows()}


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

    def score(D, causal, c, variant):
        return _scores(pd.DataFrame(rows)).set_index(["D", "causal", "variant", *FIELDS]).loc[
            (D, causal, variant, *c), "score"]

    # 1. shapes, every switch on
    run([(D, (*c, ALL_OPTS), (False, True), ALL) for D, cands in CANDIDATES.items()
         for c in cands])
    best = _best(pd.DataFrame(rows))
    # 2. each switch off, on the winning shape; stage 07's shape with none
    jobs = [(D, (*cands[0], 0), (False, True), STAGE07) for D, cands in CANDIDATES.items()]
    for D in CANDIDATES:
        by_shape = {}
        for causal in (False, True):
            by_shape.setdefault(best[(D, causal)], []).append(causal)
        jobs += [(D, c, tuple(cs), RETIMED) for c, cs in by_shape.items()]
        for sw, bit in SWITCHES.items():
            by_shape = {}  # one build per shape; the warp skip only matters with a causal mask
            for causal in (False, True):
                if causal or sw != "WARP_SKIP":
                    by_shape.setdefault(best[(D, causal)][:-1] + (ALL_OPTS & ~bit,), []).append(causal)
            jobs += [(D, c, tuple(cs), f"without {sw}") for c, cs in by_shape.items()]
    run(jobs)
    # 3. keep a switch where turning it off lost; time the final choice if it differs
    final = {}
    for (D, causal), c in best.items():
        opts = ALL_OPTS
        for sw, bit in SWITCHES.items():
            if sw == "WARP_SKIP" and not causal:
                continue
            off = c[:-1] + (ALL_OPTS & ~bit,)
            if score(D, causal, off, f"without {sw}") > score(D, causal, c, RETIMED):
                opts &= ~bit
        final[(D, causal)] = c[:-1] + (opts,)
    by_shape = {}
    for (D, causal), c in final.items():
        if c != best[(D, causal)]:
            by_shape.setdefault((D, c), []).append(causal)
    if by_shape:
        run([(D, c, tuple(cs), CHOSEN) for (D, c), cs in by_shape.items()])
    df = pd.DataFrame(rows)
    df = df.merge(_scores(df), on=["D", "causal", "variant", *FIELDS])
    df["chosen"] = False
    for (D, causal), c in final.items():
        variant = RETIMED if c == best[(D, causal)] else CHOSEN
        sel = (df["D"] == D) & (df["causal"] == causal) & (df["variant"] == variant)
        for f, v in zip(FIELDS, c):
            sel &= df[f] == v
        df.loc[sel, "chosen"] = True
        out(f"chosen D={D} causal={causal}: {c} geomean {df.loc[sel, 'score'].iloc[0]:.1f} TFLOP/s")
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
