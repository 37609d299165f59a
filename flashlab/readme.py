"""The README's stage table, generated from data/results.csv (never typed by hand).

    python -m flashlab.readme          rewrite the table between the markers in README.md
    python -m flashlab.readme --check  exit 1 if README.md is out of date
"""
import argparse
import sys

import pandas as pd

from . import paths, results
from .bench import teaching
from .plots import latest_gpu
from .stages import stages

START, END = "<!-- stage-table:start -->", "<!-- stage-table:end -->"
README = paths.ROOT / "README.md"


def _fmt(x, spec):
    return "–" if x != x or x is None else format(x, spec)


def stage_table(df=None) -> str:
    """Markdown: every stage and baseline at the teaching config (fp32, and fp16 baselines)."""
    df = results.load() if df is None else df
    gpu = latest_gpu(df)
    if gpu is None:
        return "_No results recorded yet: run `flashlab run` on a GPU._"
    df = df[df["gpu"] == gpu]
    df = pd.concat([results.at_config(df, teaching(d)) for d in ("fp32", "fp16", "bf16")])
    titles = {s.slug: s for s in stages()}
    lines = ["| | what it adds | dtype | time (ms) | TFLOP/s | % of fastest SDPA, same dtype | "
             "rel. error vs float64 | registers |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    order = sorted(df.itertuples(), key=lambda r: (r.kind != "stage", r.dtype != "fp32",
                                                   r.stage if r.kind == "stage" else -r.tflops))
    for r in order:
        if r.kind == "stage":
            st = titles.get(r.stage)
            name = f"[**{r.stage}**](notebooks/{r.stage}.ipynb)"
            idea = st.idea if st else ""
        else:
            name, idea = f"`{r.stage}`", "PyTorch baseline"
        if r.status != "ok":
            lines.append(f"| {name} | {idea} | {r.dtype} | {r.status} | | | | |")
            continue
        regs = "–" if r.registers != r.registers else f"{int(r.registers)}"
        lines.append(f"| {name} | {idea} | {r.dtype} | {_fmt(r.median_ms, '.3f')} | "
                     f"{_fmt(r.tflops, '.2f')} | {_fmt(r.pct_sdpa_best, '.1f')} | "
                     f"{_fmt(r.rel_err, '.1e')} | {regs} |")
    rows = df.sort_values("time")
    last = rows.iloc[-1]
    lines.append("")
    cfg = teaching()
    lines.append(f"B={cfg.B}, H={cfg.H}, N={cfg.N}, D={cfg.D}, not causal. Measured on **{gpu}** (compute capability "
                 f"{last.compute_capability}) with torch {last.torch}, CUDA {last.cuda}, commit "
                 f"`{last.commit}`, {last.time}; median of ≥ 20 runs with L2 flushed between them. "
                 f"Generated from `data/results.csv` by `python -m flashlab.readme`.")
    return "\n".join(lines)


def render(text: str, table: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"README.md lacks the markers {START} / {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = README.read_text()
    new = render(text, stage_table())
    if args.check:
        if new != text:
            print("README.md's stage table is out of date: run python -m flashlab.readme")
            return 1
        return 0
    README.write_text(new)
    print("README.md stage table updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
