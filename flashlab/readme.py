"""The README's generated parts (never typed by hand): the stages at the teaching config, the
last stage against PyTorch's FlashAttention-2 over the FlashAttention sweep and the backward
passes beside SDPA's, from data/results.csv, and the command list, from the command line's own
help.

    flashlab readme           rewrite the parts between the markers in README.md
    flashlab readme --check   exit 1 if README.md is out of date
"""
import html
import re

from . import paths, tables
from .baselines import COMPARED
from .configs import SWEEP, teaching
from .stages import fastest_forward, stages
from .tables import RESULTS, NotRecorded

START, END = "<!-- stage-table:start -->", "<!-- stage-table:end -->"
SWEEP_START, SWEEP_END = "<!-- sweep-table:start -->", "<!-- sweep-table:end -->"
COMMANDS_START, COMMANDS_END = "<!-- commands:start -->", "<!-- commands:end -->"
BACKWARD_START, BACKWARD_END = "<!-- backward-table:start -->", "<!-- backward-table:end -->"
LSE_START, LSE_END = "<!-- lse-table:start -->", "<!-- lse-table:end -->"
TRAINING_START, TRAINING_END = "<!-- training-table:start -->", "<!-- training-table:end -->"
README = paths.ROOT / "README.md"
BY = "flashlab readme"


def _fmt(x, spec):
    return "–" if x != x or x is None else format(x, spec)


def _esc(s):
    return html.escape(str(s))


# The same table goes into README.md (Markdown) and the class handout (HTML, flashlab.report):
# one function picks and formats the values, and these few marks are all that differ.
MARKUP = {
    "md": dict(text=str, bold="**{}**".format, code="`{}`".format, em="_{}_".format,
               link=lambda text, href: f"[{text}]({href})", para=str),
    "html": dict(text=_esc, bold=lambda s: f"<b>{_esc(s)}</b>",
                 code=lambda s: f"<code>{_esc(s)}</code>", em="<i>{}</i>".format,
                 link=lambda text, href: f'<a href="{_esc(href)}">{text}</a>',
                 para="<p>{}</p>".format),
}
HEADER = ["", "what it adds", "dtype", "time (ms)", "TFLOP/s", "% of fastest SDPA, same dtype",
          "rel. error vs float64", "registers"]
FIRST_NUMBER = 3  # columns from here on hold numbers and are right-aligned


def _commits(commits) -> str:
    """The commits rows were measured at, each once, in code spans: "`abc`, `def`" (a full
    hash shortened to the ten digits `git rev-parse --short=10` gives, '-dirty' kept)."""
    short = lambda c: re.sub(r"^([0-9a-f]{10})[0-9a-f]{30}", r"\1", str(c))
    return ", ".join(f"`{c}`" for c in sorted({short(c) for c in commits}))


def _grid(rows, fmt):
    """Header plus rows (cells already marked up) as a Markdown or HTML table."""
    if fmt == "md":
        line = lambda cells: "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"
        align = "|" + "|".join("---" if i < FIRST_NUMBER else "---:" for i in range(len(HEADER))) + "|"
        return "\n".join([line(HEADER), align] + [line(r) for r in rows])
    cell = lambda tag, i, c: (f'<{tag} class="num">{c}</{tag}>' if i >= FIRST_NUMBER
                              else f"<{tag}>{c}</{tag}>")
    line = lambda tag, cells: "<tr>" + "".join(cell(tag, i, c) for i, c in enumerate(cells)) + "</tr>"
    head = line("th", [html.escape(h) for h in HEADER])
    return "\n".join(["<table>", f"<thead>{head}</thead>", "<tbody>"]
                     + [line("td", r) for r in rows] + ["</tbody>", "</table>"])


def _unrecorded_rows(sts, m, notebooks):
    """Table rows for stages that have no recorded timing on this GPU yet."""
    rows = []
    for st in sts:
        name = m["bold"](st.slug)
        name = m["link"](name, f"{notebooks}{st.slug}.ipynb") if notebooks is not None else name
        rows.append([name, m["text"](st.idea), m["text"](st.dtypes[0]),
                     m["text"](f"not recorded yet: {tables.run_command(st)}"), "", "", "", ""])
    return rows


def stage_table(df=None, fmt="md", notebooks="notebooks/", by=BY) -> str:
    """Every stage and baseline at the teaching config (fp32, and fp16 baselines), with a note on
    where and how it was measured. fmt: "md" or "html"; notebooks: where the stages' notebooks
    are, relative to the page (None: no links); by: the command that wrote the page."""
    m = MARKUP[fmt]
    df = RESULTS.load() if df is None else df
    gpu = tables.gpu_shown(df=df)
    if gpu is None:
        return m["para"](m["em"](m["text"]("No results recorded yet: run ") + m["code"]("flashlab run")
                                 + m["text"](" on a GPU.")))
    df = tables.teaching_rows(df, gpu)
    titles = {s.slug: s for s in stages()}
    rows = []
    order = sorted(df.itertuples(), key=lambda r: (r.kind != "stage", r.dtype != "fp32",
                                                   r.stage if r.kind == "stage" else -r.tflops))
    seen = {r.stage for r in order if r.kind == "stage"}
    unrecorded = [st for st in stages() if st.slug not in seen]  # added since the last run
    for r in order:
        if r.kind != "stage" and unrecorded:
            rows += _unrecorded_rows(unrecorded, m, notebooks)
            unrecorded = []
        if r.kind == "stage":
            st = titles.get(r.stage)
            name = m["bold"](r.stage)
            name = m["link"](name, f"{notebooks}{r.stage}.ipynb") if notebooks is not None else name
            idea = m["text"](st.idea if st else "")
        else:
            name, idea = m["code"](r.stage), m["text"]("PyTorch baseline")
        if r.status != "ok":
            rows.append([name, idea, m["text"](r.dtype), m["text"](r.status), "", "", "", ""])
            continue
        regs = "–" if r.registers != r.registers else f"{int(r.registers)}"
        rows.append([name, idea, m["text"](r.dtype), _fmt(r.median_ms, ".3f"), _fmt(r.tflops, ".2f"),
                     _fmt(r.pct_sdpa_best, ".1f"), _fmt(r.rel_err, ".1e"), regs])
    rows += _unrecorded_rows(unrecorded, m, notebooks)
    last = df.sort_values("time").iloc[-1]
    cfg = teaching()
    note = (m["text"](f"B={cfg.B}, H={cfg.H}, N={cfg.N}, D={cfg.D}, not causal. Measured on ")
            + m["bold"](gpu) + m["text"](f" (compute capability {last.compute_capability}) with "
                                         f"torch {last.torch}, CUDA {last.cuda}, commit ")
            + m["code"](last.commit) + m["text"](f", {last.time}; median of ≥ 20 runs with L2 "
                                                 "flushed between them. Generated from ")
            + m["code"]("data/results.csv") + m["text"](" by ") + m["code"](by) + m["text"]("."))
    return _grid(rows, fmt) + "\n\n" + m["para"](note)


def render(text: str, table: str, start=START, end=END) -> str:
    if start not in text or end not in text:
        raise ValueError(f"README.md lacks the markers {start} / {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


def sweep_table(df=None, stage=None, baselines=COMPARED, by=BY) -> str:
    """`stage` (default: the last) ÷ each of `baselines` (PyTorch's FlashAttention-2 and cuDNN
    backends) in TFLOP/s over the FlashAttention sweep (fp16): per baseline, a row per head dim
    and mask, a column per N, as Markdown; says what to run where unrecorded."""
    df = RESULTS.load() if df is None else df
    stage = stage or fastest_forward().slug  # the last stage timed over the sweep
    gpu = tables.gpu_shown(df=df)
    try:
        vs = tables.versus(df, stage, tuple(baselines), gpu)
    except NotRecorded:
        return f"_{stage} has not been measured over the sweep yet: {tables.run_command(stage)}_"
    sweep = tables.sweep_rows(df, gpu)

    def commit(name):
        return ", ".join(f"`{c}`" for c in sorted(set(sweep[sweep["stage"] == name]["commit"].astype(str))))

    parts = []
    for baseline in baselines:
        col = f"÷ {baseline}"
        if col not in vs:
            parts.append(f"_{baseline} has not been measured over the sweep yet: "
                         f"{tables.run_command(baseline)}_")
            continue
        ratio = vs[col].unstack("N")
        ns = list(ratio.columns)
        lines = ["| | " + " | ".join(f"N = {n}" for n in ns) + " |",
                 "|---|" + "---:|" * len(ns)]
        for (D, causal), r in ratio.iterrows():
            lines.append(f"| D = {D}{', causal' if causal else ''} | "
                         + " | ".join(_fmt(x, ".2f") + "×" if x == x else "–" for x in r) + " |")
        when = ("in the same run, commit " + commit(stage) if commit(stage) == commit(baseline) else
                f"{stage} at commit {commit(stage)}, {baseline} at {commit(baseline)}")
        lines += ["", f"{stage} ÷ {baseline} (TFLOP/s), fp16, B·N = {SWEEP.tokens // 1024}k tokens, "
                  f"H·D = {SWEEP.width}, measured on **{gpu}** ({when}); worst {vs[col].min():.2f}×, "
                  f"best {vs[col].max():.2f}×."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + f"\n\nGenerated from `data/results.csv` by `{by}`."


def backward_table(df=None, baselines=COMPARED, by=BY) -> str:
    """The stages with a backward pass at the teaching config (fp16, then bf16; causal and not):
    the backward's time and TFLOP/s (FLOPs counted as FlashAttention counts the backward's, 2.5
    times the forward's) beside SDPA's backwards timed in turn with it, and the forward's time
    with and without the log-sum-exp, all of the GPU that recorded the stage; Markdown."""
    df = RESULTS.load(every=True) if df is None else df
    parts = []
    for st in [s for s in stages() if s.has_backward]:
        mine = df[df["stage"] == st.slug]
        gpu = tables.gpu_shown(st, df=mine[mine["pass"] == "backward"]) if len(mine) else None
        rows = tables.pass_rows([st.slug, *baselines], gpu, ("backward", "forward", "forward_lse"),
                                df=df) if gpu else mine.iloc[:0]
        # the baselines' backwards only: their forward rows come from other runs
        rows = rows[(rows["stage"] == st.slug) | (rows["pass"] == "backward")]
        if rows.empty or not (rows["pass"] == "backward").any():
            parts.append(f"_{st.slug}'s backward has not been measured yet: "
                         f"{tables.run_command(st.slug)}_")
            continue
        lines = ["| | dtype | mask | backward (ms) | backward TFLOP/s | forward (ms) | "
                 "forward + lse (ms) |", "|---|---|---|---:|---:|---:|---:|"]
        shown = set()  # the commits of the rows the table shows (not of the stage's other rows)
        replaced = False  # SDPA's rows of the stage's run since replaced by a later run's
        for dtype in ("fp16", "bf16"):
            t = teaching(dtype)
            for causal in (False, True):
                here = rows[(rows["dtype"] == dtype) & (rows["causal"] == causal)
                            & (rows["B"] == t.B) & (rows["H"] == t.H) & (rows["N"] == t.N)
                            & (rows["D"] == t.D)]
                # SDPA's rows only where timed in turn with the stage's backward
                ran = here.index.isin(tables.timed_with(here, st.slug).index)
                theirs = here["stage"] != st.slug
                replaced |= bool(ran.any() and (theirs & ~ran).any())
                here = here[~theirs | ran]
                for name in [st.slug, *baselines]:
                    r = here[here["stage"] == name].set_index("pass")
                    if "backward" not in r.index:
                        continue
                    get = lambda p, c: r.loc[p, c] if p in r.index else float("nan")  # noqa: E731
                    shown |= set(r["commit"].astype(str))
                    label = f"**{name}**" if name == st.slug else f"`{name}`"
                    lines.append(f"| {label} | {dtype} | {'causal' if causal else '–'} | "
                                 f"{_fmt(get('backward', 'median_ms'), '.3f')} | "
                                 f"{_fmt(get('backward', 'tflops'), '.1f')} | "
                                 f"{_fmt(get('forward', 'median_ms'), '.3f')} | "
                                 f"{_fmt(get('forward_lse', 'median_ms'), '.3f')} |")
        commits = _commits(shown)
        t = teaching("fp16")
        later = (f" SDPA's rows of that run have since been replaced by a later run's, so they are "
                 f"not shown: `{tables.run_command(st.slug)}` times them in turn again."
                 if replaced else "")
        lines += ["", f"B={t.B}, H={t.H}, N={t.N}, D={t.D}. The backward alone (the forward run "
                  f"once before it), timed in turn with SDPA's backwards; measured on **{gpu}** "
                  f"(commit {commits}).{later} Generated from `data/results.csv` by `{by}`."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def lse_table(df=None, by=BY) -> str:
    """What asking for the log-sum-exp costs the forwards that have no backward of their own
    (tables.lse_cost): at the teaching shape in fp16, D = 64 and 128, causal and not, the time
    with it over the time without, the two timed in turn in one run; Markdown."""
    names = [st.slug for st in stages() if st.lse and not st.has_backward]
    t = teaching("fp16")
    cost = tables.lse_cost(names, df)
    cost = cost[(cost["dtype"] == "fp16") & (cost["B"] == t.B) & (cost["H"] == t.H)
                & (cost["N"] == t.N)].dropna(subset=["cost"])
    if cost.empty:
        return "_Not measured yet: python tools/time_lse.py_"
    heads = [(D, c) for D in sorted(cost["D"].unique()) for c in (False, True)]
    lines = ["| | " + " | ".join(f"D = {D}{', causal' if c else ''}" for D, c in heads) + " |",
             "|---|" + "---:|" * len(heads)]
    for name in [n for n in names if n in set(cost["stage"])]:
        mine = cost[cost["stage"] == name].set_index(["D", "causal"])["cost"]
        lines.append(f"| {name} | " + " | ".join(
            f"{mine[h]:+.1%}" if h in mine.index else "–" for h in heads) + " |")
    commits = _commits(cost["commit"])
    lines += ["", f"Forward + lse over the forward alone, timed in turn in one run "
              f"(`python tools/time_lse.py`), fp16, B={t.B}, H={t.H}, N={t.N}, measured on "
              f"**{cost['gpu'].iloc[0]}** (commit {commits}): median {cost['cost'].median():+.1%}, "
              f"{cost['cost'].min():+.1%} to {cost['cost'].max():+.1%}. Generated from "
              f"`data/results.csv` by `{by}`."]
    return "\n".join(lines)


def training_table(rows=None, by=BY) -> str:
    """The recorded training (data/training.csv, tables.training_match and training_step_times):
    for each implementation its seeds and runs, its median gap to SDPA's curves of the same seed
    against SDPA's own largest gap, its mean shift from SDPA's curves, and a step's median time
    at each model size; Markdown."""
    rows = tables.TRAINING.load() if rows is None else rows
    match = tables.training_match(rows)
    if match.empty:
        return "_Not measured yet: python tools/train_compare.py_"
    times = tables.training_step_times(rows)
    sizes = list(times.columns)
    lines = ["| | seeds × runs | gap to SDPA (median) | within SDPA's spread | seed by seed | shift | "
             + " | ".join(f"step, {s} (ms)" for s in sizes) + " |",
             "|---|---:|---:|:---:|---:|---:|" + "---:|" * len(sizes)]
    for r in match.itertuples():
        step = [_fmt(times.at[r.impl, s] if r.impl in times.index else float("nan"), ".1f")
                for s in sizes]
        lines.append(f"| {r.impl} | {r.seeds} × {r.runs // max(r.seeds, 1)} | {r.distance:.2e} | "
                     f"{'yes' if r.within else '**no**'} | {_fmt(r.per_seed, '.2f')} | {r.shift:+.1e} | "
                     + " | ".join(step) + " |")
    timed_only = [i for i in times.index if i not in set(match["impl"])]  # not yet compared
    for impl in timed_only:
        lines.append(f"| {impl} | – | – | – | – | – | "
                     + " | ".join(_fmt(times.at[impl, s], ".1f") for s in sizes) + " |")
    shown = tables.training_rows(rows)
    r0 = shown.iloc[0]
    commits = _commits(rows[rows["gpu"] == r0.gpu]["commit"])  # the comparison's and the steps'
    lines += ["", f"Loss smoothed over 20 steps, {r0.steps} steps of a {r0.n_layer}-layer GPT-2 "
              f"(d = {r0.n_embd}, seq {r0.seq}, batch {r0.batch}, {r0['dtype']}) from "
              f"{shown['seed'].nunique()} seeds. An implementation's gap at a seed is its largest "
              f"difference from each of SDPA's curves of that seed, averaged; it lies within "
              f"SDPA's spread when the median over seeds is at most the largest gap between two of "
              f"SDPA's own curves of one seed ({match['noise'].iloc[0]:.2e}: "
              f"{', '.join(tables.SDPA_TRAINED)}). Seed by seed, the stricter reading: its gap at "
              f"a seed over SDPA's own largest gap at that seed, the median over seeds (at most 1: "
              f"as near SDPA's curves as they lie to one another). Shift: its curve minus SDPA's, the mean over "
              f"steps and seeds. {tables.CONTROL} is SDPA's forward with a backward that leaves Δ "
              f"out of dS: a wrong backward, the check's negative control. "
              + ("A row of dashes before the step times: timed, not yet in the loss comparison. "
                 if timed_only else "")
              + f"Measured on "
              f"**{r0.gpu}** (commit {commits}). Generated from `data/training.csv` by `{by}`."]
    return "\n".join(lines)


def commands_block(commands) -> str:
    """The command list, as the command line's help gives it, in a text block."""
    return "```text\n" + commands.rstrip("\n") + "\n```"


def _tables(text: str) -> str:
    text = render(render(text, stage_table()), sweep_table(), SWEEP_START, SWEEP_END)
    if BACKWARD_START in text:
        text = render(text, backward_table(), BACKWARD_START, BACKWARD_END)
    if LSE_START in text:
        text = render(text, lse_table(), LSE_START, LSE_END)
    if TRAINING_START in text:
        text = render(text, training_table(), TRAINING_START, TRAINING_END)
    return text


def update_tables() -> bool:
    """Rewrite README.md's two tables from data/results.csv (what `flashlab run` does after it
    has recorded); True where they changed."""
    text = README.read_text()
    new = _tables(text)
    if new != text:
        README.write_text(new)
    return new != text


def update(commands, check=False) -> int:
    """Rewrite README.md's generated parts (commands: the CLI's command list); with check, only
    say whether they are out of date (exit status 1)."""
    text = README.read_text()
    new = render(_tables(text), commands_block(commands), COMMANDS_START, COMMANDS_END)
    if check:
        if new != text:
            print("README.md's generated parts are out of date: run flashlab readme")
            return 1
        print("README.md is up to date")
        return 0
    README.write_text(new)
    print("README.md tables and command list updated")
    return 0
