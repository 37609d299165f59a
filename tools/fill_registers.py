"""Fill the ptxas columns (registers, static shared memory, spills) of recorded stage rows that a
run left empty because it could not tell which kernel ran (its log says `no ptxas report`).

A recorded row's ptxas numbers are not measured: the runner compiles the stage's source with
ptxas for the GPU's arch and reads the report for the kernel pick() launches at the row's config
(flashlab.ptxas.summary). This redoes that lookup here, with the same toolkit, for the rows where
it failed, and only where the kernels then were the kernels now (`git diff <commit> -- kernels/`
is empty), so that the report is of the code that ran. Each filled row says so in its note.

    python3 tools/fill_registers.py            # fill and write data/results.csv
    python3 tools/fill_registers.py --dry-run  # list what it would fill
"""
import subprocess
import sys

import pandas as pd

import flashlab as fl
from flashlab import paths, ptxas, tables

COLUMNS = ("registers", "smem_static_bytes", "spill_bytes")


def same_kernels(commit) -> bool:
    """True if kernels/ at `commit` is kernels/ now (committed and in the working tree)."""
    done = subprocess.run(["git", "diff", "--quiet", commit, "--", "kernels/"], cwd=paths.ROOT)
    return done.returncode == 0


def filled(df) -> pd.DataFrame:
    out = []
    for commit, rows in tables.without_ptxas(df).groupby("commit"):
        if not same_kernels(commit):
            print(f"{commit}: kernels/ changed since; left as recorded")
            continue
        for _, row in rows.iterrows():
            st = fl.stage(row["stage"])
            cfg = fl.Config(int(row["B"]), int(row["H"]), int(row["N"]), int(row["D"]),
                            bool(row["causal"]), row["dtype"])
            cc = tuple(int(x) for x in str(row["compute_capability"]).split("."))
            got = ptxas.summary(st, st.arch(cc), cfg)
            new = row.copy()
            for col in COLUMNS:
                new[col] = got[col]
            note = ("ptxas columns filled after the run from the same kernels "
                    "(tools/fill_registers.py)")
            old = row["note"] if isinstance(row["note"], str) else ""
            new["note"] = f"{old}; {note}" if old else note
            out.append(new)
    return pd.DataFrame(out)


def main():
    df = tables.RESULTS.load()
    rows = filled(df)
    for _, r in rows.iterrows():
        print(f"{r['stage']:14} {r['dtype']} D={r['D']} causal={r['causal']} N={r['N']}: "
              f"{r['registers']} registers ({r['commit']})")
    if len(rows) and "--dry-run" not in sys.argv:
        tables.RESULTS.upsert(rows)
        print(f"filled {len(rows)} rows of {tables.RESULTS.path()}")


if __name__ == "__main__":
    main()
