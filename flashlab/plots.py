"""Figures, all drawn from the recorded tables in data/ (so they render without a GPU):
results.csv (ladder, scaling, roofline) and, once something is profiled, profile.csv (what each
stage's idea changed, stall reasons, one "what changed" panel per stage)."""
import textwrap
from functools import partial

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
import numpy as np
import pandas as pd

from . import paths, profile_schema, tables
from .bench import SWEEP, teaching
from .stages import stage as _stage, stages
from .tables import RESULTS, at_config, stage_at_teaching

BASELINE_STYLE = {
    "sdpa_flash": ("tab:red", "-"), "sdpa_cudnn": ("tab:purple", "-"),
    "sdpa_efficient": ("tab:orange", "--"), "sdpa_math": ("tab:brown", ":"),
    "torch_naive": ("tab:gray", ":"),
}
STAGE_COLORS = matplotlib.colormaps["viridis"]


def _axes(figsize, *grid, **kw):
    """A figure built without pyplot: a notebook shows the returned figure once, and scripts
    leave no open figures behind."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*grid, **kw)


def _shown(df, gpu, last=None):
    """(the results table, the GPU its figures show, that GPU's rows that ran); with `last` (a
    stage), the stages after it are left out, so notebook N shows stages up to N and the
    baselines (no spoilers)."""
    df = RESULTS.load() if df is None else df
    gpu = gpu or tables.gpu_shown(df=df)
    return df, gpu, _up_to(tables.ok(tables.on_gpu(df, gpu)), last)


def _up_to(rows, last):
    """`rows` without the stages after `last` (None: every stage; "00": none); baselines stay."""
    if last is None:
        return rows
    upto = 0 if last in (0, "0", "00") else _stage(last).number  # 0: the baselines alone
    later = {st.slug for st in stages() if st.number > upto}
    return rows[~((rows["kind"] == "stage") & rows["stage"].isin(later))]


def _stage_color(i, n):
    return STAGE_COLORS(0.15 + 0.7 * i / max(1, n - 1))


def ladder(df=None, gpu=None, dtype="fp32", ax=None, last=None):
    """TFLOP/s of every stage at the teaching config, the PyTorch baselines as lines. A stage
    that does not take `dtype` (the fp16 tensor-core stages on the fp32 ladder) stands at its
    own first dtype, named under its bar. last: the last stage to show (None: all)."""
    df, gpu, ok = _shown(df, gpu, last)
    cfg = teaching(dtype)
    here = at_config(ok, cfg)
    own = [stage_at_teaching(ok, s) for s in stages() if dtype not in s.dtypes]
    st = pd.concat([here[here["kind"] == "stage"]] + [r.iloc[-1:] for r in own if len(r)])
    st = st.sort_values("stage")
    if ax is None:
        _, ax = _axes((8, 4.8))
    xs = range(len(st))
    bars = ax.bar(xs, st["tflops"], color=[_stage_color(i, len(st)) for i in xs], zorder=2)
    for bar, (_, r) in zip(bars, st.iterrows()):
        ax.annotate(f"{r.tflops:.2f}\n{r.median_ms:.3g} ms", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(xs), [s.replace("_", "\n", 1) + ("" if d == dtype else f"\n({d})")
                             for s, d in zip(st["stage"], st["dtype"])])
    other = "fp16" if dtype == "fp32" else "fp32"
    for d, alpha in ((dtype, 1.0), (other, 0.35)):
        base = at_config(ok, teaching(d))
        base = base[base["kind"] == "baseline"]
        if d != dtype:
            base = base[base["stage"].isin(["sdpa_flash", "sdpa_cudnn"])]
        for _, r in base.iterrows():
            color, ls = BASELINE_STYLE.get(r.stage, ("k", "-"))
            ax.axhline(r.tflops, color=color, ls=ls, lw=1.2, alpha=alpha, zorder=1)
            ax.annotate(f"{r.stage} ({d}) {r.tflops:.1f}", (1.0, r.tflops), xycoords=("axes fraction", "data"),
                        fontsize=7, color=color, alpha=max(alpha, 0.6), va="center",
                        xytext=(3, 0), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s (log scale)")
    ax.set_title(f"The stage ladder — {cfg.label.replace(' ' + dtype, '')}, {dtype}\n{gpu}", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.3, zorder=0)
    ax.figure.tight_layout()
    return ax.figure


def scaling(df=None, gpu=None, dtype="fp16", last=None):
    """TFLOP/s against N over the FlashAttention sweep, one panel per head dim and mask;
    last: the last stage to show (None: all)."""
    df, gpu, _ = _shown(df, gpu)
    ok = _up_to(tables.sweep_rows(df, gpu, dtype), last)
    fig, axes = _axes((10, 7), 2, 2, sharex=True)
    stage_names = sorted(ok[ok["kind"] == "stage"]["stage"].unique())
    for ax, (d, causal) in zip(axes.flat, [(64, False), (64, True), (128, False), (128, True)]):
        panel = ok[(ok["D"] == d) & (ok["causal"] == causal)]
        for name, grp in panel.groupby("stage"):
            grp = grp.sort_values("N")
            if name in BASELINE_STYLE:
                color, ls = BASELINE_STYLE[name]
                ax.plot(grp["N"], grp["tflops"], ls, color=color, marker=".", label=name)
            else:
                i = stage_names.index(name)
                ax.plot(grp["N"], grp["tflops"], "-", color=_stage_color(i, len(stage_names)),
                        marker="o", lw=2, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(SWEEP.ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in SWEEP.ns])
        ax.set_title(f"D={d}, {'causal' if causal else 'not causal'}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel(f"sequence length N (B·N = {SWEEP.tokens // 1024}k tokens, H·D = {SWEEP.width})")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"TFLOP/s ({dtype})")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=8)
    fig.suptitle(f"Scaling with sequence length — {gpu}", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _intensity(r):
    elem = 4 if r["dtype"] == "fp32" else 2  # r.dtype would be the Series' own dtype
    min_bytes = 4 * r.B * r.H * r.N * r.D * elem  # q, k, v read once, o written once
    flops = 4.0 * r.B * r.H * r.N ** 2 * r.D / (2 if r.causal else 1)
    return flops / min_bytes


def roofline(df=None, gpu=None, ceilings=None, ax=None, last=None):
    """Every stage and baseline at the teaching configs on the GPU's measured roofline;
    last: the last stage to show (None: all)."""
    df, gpu, ok = _shown(df, gpu, last)
    ceilings = tables.peaks(gpu) if ceilings is None else ceilings
    if ax is None:
        _, ax = _axes((8, 5))
    x = np.logspace(-1, 4, 200)
    bw = ceilings.get("copy_tbps")
    roofs = [("matmul_fp16_tflops", "fp16 tensor-core matmul", "tab:red"),
             ("matmul_fp32_tflops", "fp32 matmul (CUDA cores)", "tab:blue")]
    for key, label, color in roofs:
        peak = ceilings.get(key)
        if peak and bw:
            ax.plot(x, np.minimum(peak, bw * x), color=color, lw=1.5,
                    label=f"{label}: {peak:.0f} TFLOP/s, {bw:.2f} TB/s")
    pts = pd.concat([at_config(ok, teaching("fp32")), at_config(ok, teaching("fp16"))])
    names = sorted(pts[pts["kind"] == "stage"]["stage"].unique())
    for _, r in pts.iterrows():
        if r.kind == "stage":
            color, marker = _stage_color(names.index(r.stage), len(names)), "o"
        else:
            color, marker = BASELINE_STYLE.get(r.stage, ("k", "-"))[0], "s"
        ax.scatter(_intensity(r), r.tflops, color=color, marker=marker, s=55 if r.kind == "stage" else 40,
                   zorder=4 if r.kind == "stage" else 3, edgecolor="k" if r.kind == "stage" else None)
        if r.kind == "stage":
            ax.annotate(f"{r.stage} ({r['dtype']})", (_intensity(r), r.tflops), fontsize=7,
                        xytext=(-6, 0), textcoords="offset points", ha="right", va="center")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of the unavoidable q, k, v, o traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline at the teaching config (B=4 H=16 N=1024 D=64) — {gpu}", fontsize=10)
    ax.grid(which="both", alpha=0.25)
    if ax.get_legend_handles_labels()[0]:
        roofs = ax.legend(fontsize=8, loc="upper left")
        shown = [n for n in BASELINE_STYLE if n in set(pts["stage"])]
        key = [Line2D([], [], marker="s", ls="", color=BASELINE_STYLE[n][0], label=n) for n in shown]
        ax.legend(handles=key, loc="lower right", fontsize=7.5, title="PyTorch baselines\n"
                  "(fp32 left, fp16 right)", title_fontsize=7.5)
        ax.add_artist(roofs)
    ax.figure.tight_layout()
    return ax.figure


# --- Nsight Compute profile figures (data/profile.csv, columns in flashlab.profile_schema) ---

# Counts that can differ by orders of magnitude between two stages: a linear axis would hide one.
LOG_METRICS = {"smem_load_bank_conflicts", "smem_store_bank_conflicts", "smem_wavefronts",
               "dram_bytes"}
NO_PROFILE = "no profile recorded yet"


def profile_rows(profile=None, gpu=None):
    """(the profile rows of one GPU, or None if it has none; that GPU): the given GPU, else the
    GPU shown. profile: a DataFrame in profile_schema's columns, or None to read data/."""
    gpu = gpu or tables.gpu_shown()
    return tables.profile_rows(gpu, profile), gpu


def _units(prof):
    units = {m: u for m, (u, _) in profile_schema.METRICS.items()}
    if prof is not None:
        units.update(prof.dropna(subset=["unit"]).drop_duplicates("metric", keep="last")
                     .set_index("metric")["unit"].to_dict())
    return units


def _label(metric, unit):
    if metric.startswith("stall_"):
        return f"stall: {metric[len('stall_'):]} ({unit or '%'} of active warp time)"
    what = profile_schema.METRICS.get(metric, (None, metric.replace("_", " ")))[1]
    return what if not unit or unit in what else f"{what} ({unit})"


def _num(v):
    if v != v or v is None:
        return "–"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _change(before, after, words=("more", "fewer")):
    """"8.0x fewer", "none left", ...: how the metric moved from before to after."""
    if before != before or after != after:
        return ""
    if before == after:
        return "unchanged"
    if after == 0:
        return "none left"
    if before == 0:
        return "from none"
    ratio = after / before
    word = words[0] if ratio > 1 else words[1]
    ratio = max(ratio, 1 / ratio)
    return f"{ratio:,.0f}x {word}" if ratio >= 100 else f"{ratio:.1f}x {word}"


def _words(unit):
    return {"%": ("higher", "lower"), "ms": ("longer", "shorter")}.get(unit, ("more", "fewer"))


def _message(msg, title, figsize=(8, 2.5)):
    """A figure that says why there is nothing to draw, in place of raising."""
    fig = Figure(figsize=figsize)
    ax = fig.subplots()
    ax.axis("off")
    ax.text(0.5, 0.5, msg, ha="center", va="center", fontsize=12, color="0.35", transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    return fig


def _nothing_on(gpu):
    return NO_PROFILE + (f" on {gpu}" if gpu else "")


def _stage_colors():
    slugs = [st.slug for st in stages()]
    return {s: _stage_color(i, len(slugs)) for i, s in enumerate(slugs)}


def _before_after(ax, vals, before, after, metric, unit):
    get = lambda s: vals.at[s, metric] if s in vals.index and metric in vals.columns else np.nan
    pair = [get(before), get(after)]
    log = metric in LOG_METRICS and any(v > 0 for v in pair)
    colors = _stage_colors()
    for x, (slug, v) in enumerate(zip((before, after), pair)):
        drawn = v == v and not (log and v <= 0)  # 0 has no place on a log axis: say it instead
        if drawn:
            ax.bar(x, v, color=colors[slug], width=0.6, zorder=2)
        ax.annotate("not profiled" if v != v else _num(v), (x, v if drawn else 0),
                    xycoords="data" if drawn else ("data", "axes fraction"), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.15)
    ax.set_xticks([0, 1], [s.replace("_", "\n", 1) for s in (before, after)], fontsize=8)
    ax.set_title("\n".join(textwrap.wrap(_label(metric, unit) + (" — log scale" if log else ""), 30)),
                 fontsize=8)
    ax.set_xlabel(_change(*pair, words=_words(unit)), fontweight="bold", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.3, zorder=0)


def idea_metrics(profile=None, gpu=None, only=None):
    """For each stage after the first, the metrics its idea moves (its registry entry's
    idea_metrics) in the previous stage and in this one, as paired bars, one panel per
    transition; `only`: just the transitions into these stages (slugs)."""
    prof, gpu = profile_rows(profile, gpu)
    title = "The metric each stage's idea targets, before and after (teaching config)"
    slugs = [st.slug for st in stages()]
    vals = tables.profile_by_stage(prof)
    pairs = [(slugs[i - 1], st.slug, list(st.idea_metrics)) for i, st in enumerate(stages())
             if i and st.idea_metrics and {st.slug, slugs[i - 1]} & set(vals.index)
             and (only is None or st.slug in only)]
    if not pairs:
        return _message(_nothing_on(gpu) if only is None else
                        f"{', '.join(only)} and the stage before: {_nothing_on(gpu)}", title)
    units = _units(prof)
    widths = [len(metrics) for *_, metrics in pairs]
    fig = Figure(figsize=(1.2 + 2.6 * sum(widths), 4.6), layout="constrained")
    subs = fig.subfigures(1, len(pairs), width_ratios=widths, squeeze=False)[0]
    for sub, (before, after, metrics) in zip(subs, pairs):
        sub.suptitle(f"{before} → {after}: {_stage(after).title.lower()}", fontsize=9)
        for ax, metric in zip(np.atleast_1d(sub.subplots(1, len(metrics))), metrics):
            _before_after(ax, vals, before, after, metric, units.get(metric))
    fig.suptitle(f"{title}\n{gpu}", fontsize=10)
    return fig


def _stall_table(vals):
    cols = [c for c in vals.columns if c.startswith("stall_")]
    return vals.loc[vals[cols].notna().any(axis=1), cols].fillna(0) if cols else pd.DataFrame()


def stalls(profile=None, gpu=None, top=8, only=None):
    """Why warps wait: stall reasons per stage at the teaching config, stacked; the `top` largest
    reasons overall by name, the rest as "other"; `only`: just these stages (slugs)."""
    prof, gpu = profile_rows(profile, gpu)
    title = "Where warps wait: stall reasons per stage (teaching config)"
    table = _stall_table(tables.profile_by_stage(prof))
    if only is not None:
        table = table.loc[[s for s in table.index if s in only]]
    if table.empty:
        return _message(_nothing_on(gpu) if only is None else
                        f"{', '.join(only)}: {_nothing_on(gpu)}", title)
    order = table.sum().sort_values(ascending=False).index
    shown, rest = list(order[:top]), table[order[top:]].sum(axis=1)
    fig = Figure(figsize=(9, 2.2 + 0.5 * len(table)), layout="constrained")
    ax = fig.subplots()
    y, left = np.arange(len(table)), np.zeros(len(table))
    colors = matplotlib.colormaps["tab10"]
    for i, col in enumerate(shown):
        ax.barh(y, table[col], left=left, color=colors(i % 10), label=col[len("stall_"):], zorder=2)
        left += table[col].to_numpy()
    if rest.any():
        ax.barh(y, rest, left=left, color="0.8", label="other", zorder=2)
    ax.set_yticks(y, table.index)
    ax.invert_yaxis()  # the first stage on top, as in the notebooks' order
    unit = _units(prof).get(shown[0]) or "%"
    ax.set_xlabel(f"{unit} of active warp time, by stall reason (stacked)")
    ax.grid(axis="x", alpha=0.3, zorder=0)
    fig.legend(loc="outside lower center", ncol=min(5, len(shown) + 1), fontsize=7.5)
    ax.set_title(f"{title}\n{gpu}", fontsize=10)
    return fig


# (label, results.csv column, words for the change); then the profile metrics the panel shows.
PANEL_RESULTS = [("TFLOP/s", "tflops", ("higher", "lower")),
                 ("time (ms)", "median_ms", ("longer", "shorter")),
                 ("registers per thread", "registers", ("more", "fewer")),
                 ("spilled bytes", "spill_bytes", ("more", "fewer"))]
PANEL_METRICS = ["duration_ms", "dram_throughput_pct", "sm_throughput_pct", "achieved_occupancy_pct",
                 "global_load_sectors_per_request", "smem_load_bank_conflicts"]


def stage_panel(stage, df=None, profile=None, gpu=None):
    """What changed from the previous stage to this one: speed, registers and spills from
    results.csv, then the profile's metrics and top 3 stall reasons side by side, and the stall
    reasons of both as bars."""
    st = _stage(stage)
    order = stages()
    prev = order[[s.slug for s in order].index(st.slug) - 1] if st.slug != order[0].slug else None
    pair = [s for s in (prev, st) if s is not None]
    df, gpu, ok = _shown(df, gpu)
    res = {s.slug: stage_at_teaching(ok, s) for s in pair}
    prof, gpu = profile_rows(profile, gpu)
    vals, units = tables.profile_by_stage(prof), _units(prof)
    cell = lambda s, get: _num(get(s.slug)) if s is not None else "–"
    rows = []
    for label, col, words in PANEL_RESULTS:
        get = lambda slug: float(res[slug][col].iloc[0]) if len(res.get(slug, [])) else np.nan
        rows.append([label, cell(prev, get), cell(st, get),
                     _change(get(prev.slug), get(st.slug), words) if prev else ""])
    pv = lambda slug, m: vals.at[slug, m] if slug in vals.index and m in vals.columns else np.nan
    stall_cols = list(_stall_table(vals).columns)
    top = (vals.loc[st.slug, stall_cols].dropna().sort_values(ascending=False).index[:3]
           if st.slug in vals.index and stall_cols else [])
    if prof is None or not len(vals):
        rows.append(["Nsight Compute profile", "", _nothing_on(gpu), ""])
    for m in ([] if prof is None else PANEL_METRICS + list(top)):
        get = partial(pv, m=m)
        rows.append([_label(m, units.get(m)), cell(prev, get), cell(st, get),
                     _change(get(prev.slug), get(st.slug), _words(units.get(m))) if prev else ""])
    fig = Figure(figsize=(12, 1.6 + 0.3 * len(rows)), layout="constrained")
    ax_t, ax_s = fig.subplots(1, 2, width_ratios=[2.2, 1])
    ax_t.axis("off")
    tab = ax_t.table([[textwrap.shorten(r[0], 58)] + r[1:] for r in rows],
                     colLabels=["", prev.slug if prev else "(first stage)", st.slug, "change"],
                     colWidths=[0.5, 0.16, 0.16, 0.22], loc="center", cellLoc="right")
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    tab.scale(1, 1.25)
    for (r, c), cell_ in tab.get_celld().items():
        cell_.set_edgecolor("0.85")
        if c == 0:
            cell_.set_text_props(ha="left")
        if r == 0:
            cell_.set_text_props(fontweight="bold")
    _stall_pairs(ax_s, vals, [s.slug for s in pair], units)
    fig.suptitle("\n".join(textwrap.wrap(f"{st.slug}: {st.title} — {st.idea}", 110))
                 + f"\nversus {prev.slug if prev else 'nothing (the first stage)'}, teaching config, "
                 f"{gpu}", fontsize=10)
    return fig


def _stall_pairs(ax, vals, slugs, units):
    """The top 3 stall reasons of each stage, as horizontal bars side by side."""
    table = _stall_table(vals)
    table = table.loc[[s for s in slugs if s in table.index]]
    if table.empty:
        ax.axis("off")
        ax.text(0.5, 0.5, "no stall reasons profiled", ha="center", va="center", color="0.35",
                transform=ax.transAxes)
        return
    reasons = list(dict.fromkeys(r for s in table.index
                                 for r in table.loc[s].sort_values(ascending=False).index[:3]))
    colors = _stage_colors()
    h = 0.8 / len(table)
    for i, slug in enumerate(table.index):
        ax.barh(np.arange(len(reasons)) + i * h, table.loc[slug, reasons], height=h,
                color=colors[slug], label=slug, zorder=2)
    ax.set_yticks(np.arange(len(reasons)) + h * (len(table) - 1) / 2,
                  [r[len("stall_"):] for r in reasons], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{units.get(reasons[0]) or '%'} of active warp time", fontsize=8)
    ax.set_title("top stall reasons", fontsize=9)
    ax.legend(fontsize=7.5)
    ax.grid(axis="x", alpha=0.3, zorder=0)


FIGURES = {"ladder": ladder, "scaling": scaling, "roofline": roofline}
PROFILE_FIGURES = {"idea_metrics": idea_metrics, "stalls": stalls}


def drawings(df=None, profile=None, gpu=None):
    """name -> a function of no arguments that draws that figure, for every figure the recorded
    data supports: always the results figures; the profile figures and one stage panel per
    profiled stage once profile.csv holds rows for the GPU shown. save_all and flashlab.report
    both draw this list, so the figures on disk and in the report are the same set."""
    df, gpu, _ = _shown(df, gpu)
    if gpu is None:
        return {}
    out = {name: partial(draw, df, gpu=gpu) for name, draw in FIGURES.items()}
    prof, _ = profile_rows(profile, gpu)
    if prof is not None:
        out.update({name: partial(draw, prof, gpu=gpu) for name, draw in PROFILE_FIGURES.items()})
        profiled = set(prof["stage"])
        out.update({f"stage_{st.slug}": partial(stage_panel, st, df, prof, gpu=gpu)
                    for st in stages()[1:] if st.slug in profiled})
    return out


def save_all(df=None, outdir=None, gpu=None, profile=None):
    """Write every figure as data/figures/NAME.png; returns the paths written."""
    outdir = paths.figures_dir() if outdir is None else outdir
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in drawings(df, profile, gpu).items():
        path = outdir / f"{name}.png"
        draw().savefig(path, dpi=110, metadata={"Software": None})
        written.append(path)
    return written
