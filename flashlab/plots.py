"""Figures, all drawn from the recorded tables in data/ (so they render without a GPU):
results.csv (ladder, scaling, roofline) and, once something is profiled, profile.csv (what each
stage's idea changed, stall reasons, one "what changed" panel per stage)."""
import textwrap
from functools import partial
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.textpath import text_to_path
from matplotlib.ticker import FuncFormatter
import numpy as np
import pandas as pd

from . import paths, profile_schema, tables
from .baselines import COMPARED
from .configs import SWEEP, teaching
from .stages import before as _before, stage as _stage, stages
from .tables import RESULTS, at_config, stage_at_teaching

BASELINE_STYLE = {
    "sdpa_flash": ("tab:red", "-"), "sdpa_cudnn": ("tab:purple", "-"),
    "sdpa_efficient": ("tab:orange", "--"), "sdpa_math": ("tab:brown", ":"),
    "torch_naive": ("tab:gray", ":"),
}
# One colour and one marker per stage, in registry order: neighbours differ in hue and lightness,
# none is a baseline's (reds, purples, orange, brown, grey), and the fast stages (05 on), which
# the sweep figures draw together, are the most distinct of all.
STAGE_PALETTE = ("#aec7e8", "#dbdb8d", "#9edae5", "#f7b6d2",            # 01-04
                 "#2ca02c", "#1f77b4", "#d4a017", "#17becf", "#e377c2",  # 05-09
                 "#393b79", "#98df8a", "#8c6d31", "#111111")             # 10-13
STAGE_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "d", "p", "*")


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


def _last_number(last):
    """The number of the last stage a figure shows: `last` a stage (number or slug), "00" for
    none (the baselines alone), None for every stage."""
    if last is None:
        return float("inf")
    return 0 if last in (0, "0", "00") else _stage(last).number


def _up_to(rows, last):
    """`rows` without the stages after `last` (None: every stage; "00": none); baselines stay."""
    if last is None:
        return rows
    later = {st.slug for st in stages() if st.number > _last_number(last)}
    return rows[~((rows["kind"] == "stage") & rows["stage"].isin(later))]


def _stage_colors():
    """{slug: colour} by the stage's place in the registry, so a stage keeps its colour in every
    figure, whichever stages that figure shows (last=). Stages past the palette take tab20b's
    colours, in order, none of them used already."""
    extra = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab20b"].colors]
    extra = [c for c in extra if c not in STAGE_PALETTE]
    return {st.slug: (STAGE_PALETTE + tuple(extra))[i % (len(STAGE_PALETTE) + len(extra))]
            for i, st in enumerate(stages())}


def _color_of(slug):
    return _stage_colors().get(slug, "0.4")


def _marker_of(slug):
    slugs = [st.slug for st in stages()]
    return STAGE_MARKERS[slugs.index(slug) % len(STAGE_MARKERS)] if slug in slugs else "o"


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
    fs = 9 if ax is None else 8  # a figure of its own is sized for a slide
    if ax is None:
        _, ax = _axes((10, 5.6))
    xs = range(len(st))
    bars = ax.bar(xs, st["tflops"], color=[_color_of(s) for s in st["stage"]], zorder=2)
    for bar, (_, r) in zip(bars, st.iterrows()):
        ax.annotate(f"{r.tflops:.2f}\n{r.median_ms:.3g} ms", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=fs,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(xs), [s.replace("_", "\n", 1) + ("" if d == dtype else f"\n({d})")
                             for s, d in zip(st["stage"], st["dtype"])])
    other = "fp32" if dtype == "fp16" else "fp16"  # the other dtype's fastest baselines, faint
    for d, alpha in ((dtype, 1.0), (other, 0.35)):
        base = at_config(ok, teaching(d))
        base = base[base["kind"] == "baseline"]
        if d != dtype:
            base = base[base["stage"].isin(COMPARED)]
        for _, r in base.iterrows():
            color, ls = BASELINE_STYLE.get(r.stage, ("k", "-"))
            ax.axhline(r.tflops, color=color, ls=ls, lw=1.2, alpha=alpha, zorder=1)
            ax.annotate(f"{r.stage} ({d}) {r.tflops:.1f}", (1.0, r.tflops), xycoords=("axes fraction", "data"),
                        fontsize=fs - 1, color=color, alpha=max(alpha, 0.6), va="center",
                        xytext=(3, 0), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 2.5)  # room for the two lines over the tallest bar
    ax.set_ylabel("TFLOP/s (log scale)")
    ax.set_title(f"The stage ladder in {dtype} — {cfg.label.replace(' ' + dtype, '')}\n{gpu}",
                 fontsize=11)
    ax.grid(axis="y", which="both", alpha=0.3, zorder=0)
    ax.figure.tight_layout()
    return ax.figure


def scaling(df=None, gpu=None, dtype="fp16", last=None):
    """TFLOP/s against N over the FlashAttention sweep, one panel per head dim and mask;
    last: the last stage to show (None: all)."""
    df, gpu, _ = _shown(df, gpu)
    ok = _up_to(tables.sweep_rows(df, gpu, dtype), last)
    return _scaling_panels(ok, f"TFLOP/s ({dtype})", f"Scaling with sequence length — {gpu}")


def backward_scaling(df=None, gpu=None, dtype="fp16"):
    """The backward passes over the FlashAttention sweep (pass "backward" rows: the stages' and
    SDPA's flash and cuDNN backwards, timed in turn), TFLOP/s as FlashAttention counts the
    backward's FLOPs (2.5 times the forward's), one panel per head dim and mask; of the GPU that
    last recorded a backward over the sweep."""
    df = RESULTS.load(every=True) if df is None else df
    gpu = gpu or tables.sweep_gpu(df, "backward")
    if gpu is None:
        raise tables.NotRecorded("no backward timed over the sweep yet: "
                                 "flashlab.measure.measure_backward(stages, configs=sweep())")
    ok = tables.sweep_rows(df, gpu, dtype, "backward")
    return _scaling_panels(ok, f"backward TFLOP/s ({dtype})",
                           f"The backward pass over the sweep (its FLOPs: 2.5 × the forward's) — {gpu}")


def save_backward_scaling(df=None, outdir=None):
    """data/figures/backward_scaling.png; returns its path."""
    outdir = paths.figures_dir() if outdir is None else Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "backward_scaling.png"
    backward_scaling(df).savefig(path, dpi=110, metadata={"Software": None})
    return path


def _scaling_panels(ok, ylabel, title):
    """scaling()'s four panels (D = 64, 128; causal or not) of `ok`'s sweep rows, a line each."""
    fig, axes = _axes((10, 7), 2, 2, sharex=True)
    for ax, (d, causal) in zip(axes.flat, [(64, False), (64, True), (128, False), (128, True)]):
        panel = ok[(ok["D"] == d) & (ok["causal"] == causal)]
        for name, grp in panel.groupby("stage"):
            grp = grp.sort_values("N")
            if name in BASELINE_STYLE:
                color, ls = BASELINE_STYLE[name]
                ax.plot(grp["N"], grp["tflops"], ls, color=color, marker=".", label=name)
            else:
                ax.plot(grp["N"], grp["tflops"], "-", color=_color_of(name), marker=_marker_of(name),
                        lw=2, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(SWEEP.ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in SWEEP.ns])
        ax.set_title(f"D={d}, {'causal' if causal else 'not causal'}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel(f"sequence length N (B·N = {SWEEP.tokens // 1024}k tokens, H·D = {SWEEP.width})")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    ncol = min(6, max(1, len(labels)))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9)
    fig.suptitle(title, fontsize=11)
    rows = -(-len(labels) // ncol)  # the legend's rows, kept clear of the axes' labels
    fig.tight_layout(rect=(0, 0.01 + 0.035 * rows, 1, 1))
    return fig


def _intensity(r):
    elem = 4 if r["dtype"] == "fp32" else 2  # r.dtype would be the Series' own dtype
    min_bytes = 4 * r.B * r.H * r.N * r.D * elem  # q, k, v read once, o written once
    flops = 4.0 * r.B * r.H * r.N ** 2 * r.D / (2 if r.causal else 1)
    return flops / min_bytes


ROOF_LABEL_PT = 9  # the stage labels on the roofline


def roofline(df=None, gpu=None, ceilings=None, ax=None, last=None):
    """Every stage and baseline at the teaching configs on the GPU's measured roofline;
    last: the last stage to show (None: all). The stage labels stand in a column beside their
    points, never on top of each other (leader lines where a label had to move), and the
    legends stand outside the axes."""
    df, gpu, ok = _shown(df, gpu, last)
    ceilings = tables.peaks(gpu) if ceilings is None else ceilings
    if ax is None:
        _, ax = _axes((11, 6))
    x = np.logspace(-1, 4, 200)
    bw = ceilings.get("copy_tbps")
    roofs = [("matmul_fp16_tflops", "fp16 tensor-core matmul", "tab:red"),
             ("matmul_fp32_tflops", "fp32 matmul (CUDA cores)", "tab:blue")]
    for key, label, color in roofs:
        peak = ceilings.get(key)
        if peak and bw:
            ax.plot(x, np.minimum(peak, bw * x), color=color, lw=1.5,
                    label=f"{label}\n{peak:.0f} TFLOP/s, {bw:.2f} TB/s")
    pts = pd.concat([at_config(ok, teaching("fp32")), at_config(ok, teaching("fp16"))])
    labels = []
    for _, r in pts.iterrows():
        if r.kind == "stage":
            color, marker = _color_of(r.stage), "o"
            labels.append((_intensity(r), r.tflops, f"{r.stage} ({r['dtype']})"))
        else:
            color, marker = BASELINE_STYLE.get(r.stage, ("k", "-"))[0], "s"
        ax.scatter(_intensity(r), r.tflops, color=color, marker=marker, s=55 if r.kind == "stage" else 40,
                   zorder=4 if r.kind == "stage" else 3, edgecolor="k" if r.kind == "stage" else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of the unavoidable q, k, v, o traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline at the teaching config (B=4 H=16 N=1024 D=64) — {gpu}", fontsize=11)
    ax.grid(which="both", alpha=0.25)
    roofs = None
    if ax.get_legend_handles_labels()[0]:
        roofs = ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0,
                          title="measured ceilings", title_fontsize=9)
    shown = [n for n in BASELINE_STYLE if n in set(pts["stage"])]
    key = [Line2D([], [], marker="s", ls="", color=BASELINE_STYLE[n][0], label=n) for n in shown]
    if key:
        ax.legend(handles=key, loc="lower left", bbox_to_anchor=(1.02, 0), borderaxespad=0,
                  fontsize=9, title="PyTorch baselines\n(fp32 left, fp16 right)", title_fontsize=9)
        if roofs is not None:
            ax.add_artist(roofs)
            roofs.set_clip_on(False)  # an artist added to the axes is clipped to them: not this one
    ax.figure.tight_layout()
    _label_points(ax, labels, ROOF_LABEL_PT)
    return ax.figure


def _spread(targets, gap, lo, hi):
    """Positions for labels that want to stand at `targets` (ascending): each at least `gap`
    above the one below, as near its target as that allows (a crowd of labels is centred on its
    targets' mean), and kept within [lo, hi] where they fit."""
    clusters = []  # [the lowest position, the number of labels, the sum of their targets]
    for t in targets:
        clusters.append([t, 1, t])
        while len(clusters) > 1 and clusters[-2][0] + clusters[-2][1] * gap > clusters[-1][0]:
            (_, n0, s0), (_, n1, s1) = clusters.pop(-2), clusters.pop()
            n, total = n0 + n1, s0 + s1
            clusters.append([total / n - (n - 1) * gap / 2, n, total])
    pos = [low + k * gap for low, n, _ in clusters for k in range(n)]
    last = len(pos) - 1
    pos = [max(p, lo + k * gap) for k, p in enumerate(pos)]  # both keep the gaps
    return [min(p, hi - (last - k) * gap) for k, p in enumerate(pos)]


def _make_room(ax, left_x, right_xs, left_pt, right_pt, width):
    """Widen the x limits (in the axis' own scale) until `left_pt` points fit left of left_x and
    `right_pt` points right of every one of right_xs; then freeze them."""
    scale = ax.xaxis.get_transform()
    u0, u1 = scale.transform(ax.get_xlim())
    need_l, need_r = left_pt / width, right_pt / width if right_xs else 0
    if need_l + need_r < 0.9:
        ul = scale.transform([left_x])[0]
        ur = max(scale.transform(right_xs)) if right_xs else ul
        for _ in range(50):  # a fixed point: the margins are fractions of the widened span
            span = u1 - u0
            u0, u1 = min(u0, ul - need_l * span), max(u1, ur + need_r * span)
    ax.set_xlim(*scale.inverted().transform([u0, u1]))


def _label_points(ax, points, fontsize):
    """Label (x, y, text) data points without overlaps, once the axes are laid out: the points of
    the leftmost column of x get their labels on the left, the others on the right, and the
    labels of one side are spread vertically as one stack (_spread), so no two labels of a side
    share a height and the two sides never meet; a leader line joins each label to its point.
    The axes limits are frozen first: the positions are worked out in points, from the axes'
    size, so the figure must not be laid out again afterwards."""
    if not points:
        return []
    fig = ax.figure
    width, height = (ax.bbox.width * 72 / fig.dpi, ax.bbox.height * 72 / fig.dpi)
    gap, dx = 1.45 * fontsize, 20
    # the glyph paths' advance; drawn, a label stands a few per cent wider (hinting, the underscores)
    text_width = lambda s: 1.08 * text_to_path.get_text_width_height_descent(
        s, FontProperties(size=fontsize), ismath=False)[0]
    left_x = min(x for x, _, _ in points)
    _make_room(ax, left_x, [x for x, _, _ in points if x != left_x],
               max((text_width(t) for x, _, t in points if x == left_x), default=0) + dx + 4,
               max((text_width(t) for x, _, t in points if x != left_x), default=0) + dx + 4, width)
    ax.set_ylim(ax.get_ylim())
    to_axes = ax.transData + ax.transAxes.inverted()
    out = []
    for side in (-1, 1):
        mine = sorted(((x, y, text, *(to_axes.transform((x, y)) * (width, height)))
                       for x, y, text in points if (x == left_x) == (side < 0)),
                      key=lambda p: (p[4], p[2]))
        if not mine:
            continue
        for (x, y, text, px, py), ty in zip(mine, _spread([p[4] for p in mine], gap, gap / 2,
                                                          height - gap / 2)):
            room = (width - px if side > 0 else px) - text_width(text) - 2  # stay inside the axes
            out.append(ax.annotate(
                text, (x, y), fontsize=fontsize, xytext=(side * max(4, min(dx, room)), ty - py),
                textcoords="offset points", ha="left" if side > 0 else "right", va="center",
                zorder=5, arrowprops=dict(arrowstyle="-", color="0.45", lw=0.7, shrinkA=1,
                                          shrinkB=4)))
    return out


# --- Nsight Compute profile figures (data/profile.csv, columns in flashlab.profile_schema) ---

# Counts that can differ by orders of magnitude between two stages: on a log axis where the two
# stages compared are LOG_SPAN or more apart (a linear axis would hide one), else on a linear one
# (on a log axis, bars 2x apart look alike).
LOG_METRICS = {"smem_wavefronts", "dram_bytes"}
LOG_SPAN = 100
# Counts shown as a share of the traffic they are part of, where that traffic is recorded: each
# bank conflict is one more shared-memory wavefront, so conflicts / wavefronts is the share of the
# shared-memory traffic that conflicts cost. 1 205 -> 3 091 conflicts out of 11 million
# wavefronts is 0.011 % -> 0.028 %, nothing, where "2.6x more" would read like a regression.
# Without the wavefronts: the counts, on a linear axis. metric: (the traffic, the share's label).
SHARES = {
    "smem_load_bank_conflicts": ("smem_wavefronts", "load bank conflicts, % of shared-memory wavefronts"),
    "smem_store_bank_conflicts": ("smem_wavefronts", "store bank conflicts, % of shared-memory wavefronts"),
}
SHARE = "_share"  # a share's column beside its count's: smem_load_bank_conflicts_share
NO_PROFILE = "no profile recorded yet"
PANELS_PER_ROW = 4  # idea_metrics: panels in one row of the grid


def profile_rows(profile=None, gpu=None):
    """(the profile rows of one GPU, or None if it has none; that GPU): the given GPU, else the
    GPU shown. profile: a DataFrame in profile_schema's columns, or None to read data/."""
    gpu = gpu or tables.gpu_shown()
    return tables.profile_rows(gpu, profile), gpu


def _with_shares(vals):
    """The stages x metrics table plus a METRIC_share column (in %) for each of SHARES whose
    traffic is recorded: NaN for a stage without it."""
    vals = vals.copy()
    for metric, (total, _) in SHARES.items():
        if metric in vals.columns and total in vals.columns:
            vals[metric + SHARE] = 100 * vals[metric] / vals[total].where(vals[total] > 0)
    return vals


def _get(vals, slug, metric):
    return vals.at[slug, metric] if slug in vals.index and metric in vals.columns else np.nan


def _shown_as(vals, slugs, metric):
    """The column that shows `metric` for these stages: its share (SHARES) where every one of
    them that has the count has the share too, else the count itself."""
    share = metric + SHARE
    counted = [s for s in slugs if _get(vals, s, metric) == _get(vals, s, metric)]
    if metric in SHARES and counted and all(_get(vals, s, share) == _get(vals, s, share)
                                            for s in counted):
        return share
    return metric


def _units(prof):
    units = {m: u for m, (u, _) in profile_schema.METRICS.items()}
    if prof is not None:
        units.update(prof.dropna(subset=["unit"]).drop_duplicates("metric", keep="last")
                     .set_index("metric")["unit"].to_dict())
    units.update({m + SHARE: "%" for m in SHARES})
    return units


def _label(metric, unit):
    if metric.endswith(SHARE) and metric[:-len(SHARE)] in SHARES:
        return SHARES[metric[:-len(SHARE)]][1]
    if metric.startswith("stall_"):
        return f"stall: {metric[len('stall_'):]} ({unit or '%'} of active warp time)"
    what = profile_schema.METRICS.get(metric, (None, metric.replace("_", " ")))[1]
    return what if not unit or unit in what else f"{what} ({unit})"


def _num(v):
    if v != v or v is None:
        return "–"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _pct(v):
    """A share in %: "89.8 %", "0.028 %"."""
    if v != v or v is None:
        return "–"
    return "< 0.001 %" if 0 < v < 0.001 else f"{v:.3g} %"


def _short(v):
    """A count in a few characters: "3,077", "11.1 M", "4.64 G"."""
    for scale, suffix in ((1e9, "G"), (1e6, "M")):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {suffix}"
    return _num(v)


def _change(before, after, words=("more", "fewer"), share=False):
    """"8.0x fewer", "none left", ...: how the metric moved from before to after. share: the
    values are shares in % (SHARES), and the change is their difference in percentage points,
    since the ratio of two tiny shares ("2.2x more" for 0.013 % -> 0.028 %) would read like a
    big change."""
    if before != before or after != after:
        return ""
    if before == after:
        return "unchanged"
    if after == 0:
        return "none left"
    if share:
        return f"{after - before:+.2g} percentage points".replace("-", "−")
    if before == 0:
        return "from none"
    ratio = after / before
    word = words[0] if ratio > 1 else words[1]
    ratio = max(ratio, 1 / ratio)
    return f"{ratio:,.0f}x {word}" if ratio >= 100 else f"{ratio:.1f}x {word}"


def _words(unit):
    return {"%": ("higher", "lower"), "ms": ("longer", "shorter")}.get(unit, ("more", "fewer"))


def _value(vals, slug, shown):
    """One stage's value as a table cell: a share with its count ("0.028 % (3,077)", "89.8 % (4.17 G)")."""
    v = _get(vals, slug, shown)
    if not shown.endswith(SHARE) or v != v:
        return _num(v)
    return f"{_pct(v)} ({_short(_get(vals, slug, shown[:-len(SHARE)]))})"


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


def _shown_up_to(last):
    return "the baselines alone" if _last_number(last) == 0 else f"stages up to {_stage(last).slug}"


def _before_after(ax, vals, before, after, metric, unit):
    """One panel: `metric` in the stage before and after, as two bars; a count of SHARES as its
    share (0-100 %) where the traffic is recorded; a LOG_METRICS count on a log axis where the
    two are LOG_SPAN or more apart."""
    shown = _shown_as(vals, (before, after), metric)
    share = shown != metric
    pair = [_get(vals, before, shown), _get(vals, after, shown)]
    drawn = [v for v in pair if v == v]
    log = (shown in LOG_METRICS and len(drawn) == 2 and min(drawn) > 0
           and max(drawn) / min(drawn) >= LOG_SPAN)
    colors = _stage_colors()
    for x, (slug, v) in enumerate(zip((before, after), pair)):
        if v == v:
            ax.bar(x, v, color=colors[slug], width=0.6, zorder=2)
        if v != v:
            text = "not profiled"
        elif share:
            total = _get(vals, slug, SHARES[metric][0])
            text = f"{_pct(v)}\n{_short(_get(vals, slug, metric))} of {_short(total)}"
        else:
            text = _num(v)
        ax.annotate(text, (x, v if v == v else 0), xycoords="data" if v == v else ("data", "axes fraction"),
                    ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    if log:
        ax.set_yscale("log")
    if share:  # a share on its whole scale: 0.03 % of the traffic looks like nothing, as it is
        ax.set_ylim(0, 125)
        ax.set_yticks([0, 25, 50, 75, 100], ["0", "25 %", "50 %", "75 %", "100 %"])
    else:
        ax.margins(y=0.2)
        if not log and max(drawn, default=0) >= 1e6:  # "30 M", not an offset "1e7" over the axis
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v) if v else "0"))
    ax.tick_params(labelsize=9)
    ax.set_xticks([0, 1], [s.replace("_", "\n", 1) for s in (before, after)], fontsize=9)
    ax.set_title("\n".join(textwrap.wrap(_label(shown, unit if not share else "%")
                                         + (" — log scale" if log else ""), 34,
                                         break_on_hyphens=False)), fontsize=9)
    ax.set_xlabel(_change(*pair, words=_words(unit), share=share), fontweight="bold", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.3, zorder=0)


def _rows(widths, per_row):
    """Consecutive groups of `widths` panels packed into rows of at most `per_row` panels (a
    group wider than that gets a row of its own): [[group index, ...], ...]."""
    rows, used = [], per_row
    for i, w in enumerate(widths):
        if used + w > per_row:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += w
    return rows


def idea_metrics(profile=None, gpu=None, only=None, last=None):
    """For each stage after the first, the metrics its idea moves (its registry entry's
    idea_metrics) in the previous stage and in this one, as paired bars, one group of panels per
    transition, wrapped into rows of at most PANELS_PER_ROW panels. only: just the transitions
    into these stages (slugs); last: no transition into a stage after this one (None: all)."""
    prof, gpu = profile_rows(profile, gpu)
    title = "The metric each stage's idea targets, before and after (teaching config)"
    order = stages()
    vals = _with_shares(tables.profile_by_stage(prof))
    pairs = [(_before(st).slug, st.slug, list(st.idea_metrics)) for st in order[1:]
             if st.idea_metrics and {st.slug, _before(st).slug} & set(vals.index)
             and (only is None or st.slug in only)]
    shown = [p for p in pairs if _stage(p[1]).number <= _last_number(last)]
    if not shown:
        if pairs:
            return _message(f"no stage to compare with the one before it: {_shown_up_to(last)}", title)
        return _message(_nothing_on(gpu) if only is None else
                        f"{', '.join(only)} and the stage before: {_nothing_on(gpu)}", title)
    units = _units(prof)
    widths = [len(metrics) for *_, metrics in shown]
    rows = _rows(widths, PANELS_PER_ROW)
    ncols = max(sum(widths[i] for i in row) for row in rows)
    fig = Figure(figsize=(0.6 + 3.15 * ncols, 0.9 + 3.4 * len(rows)), layout="constrained")
    grid = fig.add_gridspec(len(rows), ncols)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            before, after, metrics = shown[i]
            sub = fig.add_subfigure(grid[r, col:col + len(metrics)])
            col += len(metrics)
            sub.suptitle("\n".join(textwrap.wrap(f"{before} → {after}: {_stage(after).title.lower()}",
                                                 40 * len(metrics))), fontsize=10)
            for ax, metric in zip(np.atleast_1d(sub.subplots(1, len(metrics))), metrics):
                _before_after(ax, vals, before, after, metric, units.get(metric))
    fig.suptitle(f"{title}\n{gpu}", fontsize=12)
    return fig


def _stall_table(vals):
    cols = [c for c in vals.columns if c.startswith("stall_")]
    return vals.loc[vals[cols].notna().any(axis=1), cols].fillna(0) if cols else pd.DataFrame()


def stalls(profile=None, gpu=None, top=8, only=None, last=None):
    """Why warps wait: stall reasons per stage at the teaching config, stacked; the `top` largest
    reasons overall by name, the rest as "other". only: just these stages (slugs); last: no
    stage after this one (None: all)."""
    prof, gpu = profile_rows(profile, gpu)
    title = "Where warps wait: stall reasons per stage (teaching config)"
    table = _stall_table(tables.profile_by_stage(prof))
    if only is not None:
        table = table.loc[[s for s in table.index if s in only]]
    if not table.empty and last is not None:
        shown = table.loc[[s for s in table.index if _stage(s).number <= _last_number(last)]]
        if shown.empty:
            return _message(f"no stage profiled: {_shown_up_to(last)}", title)
        table = shown
    if table.empty:
        return _message(_nothing_on(gpu) if only is None else
                        f"{', '.join(only)}: {_nothing_on(gpu)}", title)
    order = table.sum().sort_values(ascending=False).index
    shown, rest = list(order[:top]), table[order[top:]].sum(axis=1)
    fig = Figure(figsize=(10, 2.4 + 0.5 * len(table)), layout="constrained")
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
    fig.legend(loc="outside lower center", ncol=min(5, len(shown) + 1), fontsize=9)
    ax.set_title(f"{title}\n{gpu}", fontsize=11)
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
    prev = _before(st)
    pair = [s for s in (prev, st) if s is not None]
    df, gpu, ok = _shown(df, gpu)
    res = {s.slug: stage_at_teaching(ok, s) for s in pair}
    prof, gpu = profile_rows(profile, gpu)
    vals, units = _with_shares(tables.profile_by_stage(prof)), _units(prof)
    cell = lambda s, get: _num(get(s.slug)) if s is not None else "–"
    rows = []
    for label, col, words in PANEL_RESULTS:
        get = lambda slug: float(res[slug][col].iloc[0]) if len(res.get(slug, [])) else np.nan
        rows.append([label, cell(prev, get), cell(st, get),
                     _change(get(prev.slug), get(st.slug), words) if prev else ""])
    stall_cols = list(_stall_table(vals).columns)
    top = (vals.loc[st.slug, stall_cols].dropna().sort_values(ascending=False).index[:3]
           if st.slug in vals.index and stall_cols else [])
    if prof is None or not len(vals):
        rows.append(["Nsight Compute profile", "", _nothing_on(gpu), ""])
    for m in ([] if prof is None else PANEL_METRICS + list(top)):
        shown = _shown_as(vals, [s.slug for s in pair], m)
        get = partial(_get, vals, metric=shown)
        rows.append([_label(shown, units.get(shown)),
                     *(_value(vals, s.slug, shown) if s is not None else "–" for s in (prev, st)),
                     _change(get(prev.slug), get(st.slug), _words(units.get(shown)),
                             share=shown != m) if prev else ""])
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


def save_all(df=None, outdir=None, gpu=None, profile=None, overwrite=True):
    """Write every figure as data/figures/NAME.png; returns the paths of the figures there.
    overwrite=False (a replay: nothing was measured) draws only the figures missing, and leaves
    those a run recorded as they are."""
    outdir = paths.figures_dir() if outdir is None else Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in drawings(df, profile, gpu).items():
        path = outdir / f"{name}.png"
        if overwrite or not path.exists():
            draw().savefig(path, dpi=110, metadata={"Software": None})
        written.append(path)
    return written


def model_forward(rows=None, gpu=None):
    """A GPT-2 forward pass with each attention (data/model.csv): the time the GPU spent in kernels,
    by kind of kernel (attention, matmul, other; torch.profiler, one pass), stacked, and the
    pass's elapsed time as a dot (forward_ms: bench.time_fn's CUDA events before and after one
    pass, median of its runs: the kernels plus every gap in which the GPU waited for the host to
    launch the next one), one panel per dtype. Each row's text names both."""
    rows = tables.model_rows(gpu) if rows is None else rows
    dtypes = sorted(dict.fromkeys(rows["dtype"]), key=lambda d: d != "fp16")
    n = rows.groupby("dtype").size().max()
    fig, axes = _axes((5.6 * len(dtypes), 1.7 + 0.45 * n), 1, len(dtypes), squeeze=False)
    kinds = (("attention_gpu_ms", "attention kernels", "#d62728"),
             ("matmul_gpu_ms", "matmul kernels", "#9ecae1"),
             ("other_gpu_ms", "other kernels (norms, GELU, adds, copies)", "#d9d9d9"))
    for ax, dt in zip(axes[0], dtypes):
        sub = rows[rows["dtype"] == dt].reset_index(drop=True)
        y = np.arange(len(sub))[::-1]
        left = np.zeros(len(sub))
        for col, label, color in kinds:
            vals = pd.to_numeric(sub[col], errors="coerce").fillna(0).to_numpy()
            ax.barh(y, vals, left=left, color=color, height=0.7, label=label)
            left += vals
        ax.plot(sub["forward_ms"], y, "o", color="0.15", ms=4,
                label="elapsed time of the pass (CUDA events: kernels + GPU idle between them)")
        for yi, r, busy in zip(y, sub.itertuples(), left):
            att = getattr(r, "attention_gpu_ms", float("nan"))
            text = (f" elapsed {r.forward_ms:.1f} ms; in kernels {busy:.1f}"
                    + (f" (attention {att:.2f})" if att and att == att else ""))
            ax.text(max(busy, r.forward_ms), yi, text, va="center", fontsize=7.5)
        ax.set_yticks(y, sub["impl"])
        ax.set_xlim(0, max(left.max(), sub["forward_ms"].max()) * 1.75)
        ax.set_xlabel("ms per forward pass")
        r0 = sub.iloc[0]
        ax.set_title(f"GPT-2, {r0.n_layer} layers, {r0.batch}×{r0.seq} tokens, {dt}", fontsize=10)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Where a forward pass spends the GPU, with each attention ({rows['gpu'].iloc[0]})",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


_SDPA_GREYS = {"sdpa_flash": "#555555", "sdpa_cudnn": "#bbbbbb", "sdpa_efficient": "#888888"}


def _training_style(impl):
    if impl in _stage_colors():
        return dict(color=_color_of(impl), lw=1.3)
    if impl == tables.CONTROL:
        return dict(color="#d62728", lw=1.0, ls=":")
    return dict(color=_SDPA_GREYS.get(impl, "0.5"), lw=1.0)


def training(rows=None, gpu=None, window=20):
    """A byte-level GPT-2 trained through each attention (data/training.csv, one GPU): the loss
    per step smoothed over `window` steps from the first seed, each implementation a line; each
    implementation's gap to SDPA's curves at every seed (tables.training_gaps: a dot a seed, a
    bar at the median, the verdict's distance) against SDPA's largest gap with itself (the
    dashed line, tables.training_match's noise); beside it a step's median time at each
    recorded model size."""
    rows = tables.TRAINING.load() if rows is None else rows
    curves = tables.training_rows(rows, gpu)
    if curves.empty:
        raise tables.NotRecorded("no training recorded yet: run `python tools/train_compare.py` "
                                 "on a GPU")
    gpu = curves["gpu"].iloc[0]
    seed = int(curves["seed"].iloc[0])
    fig, (ax, dx, bx) = _axes((15, 4.2), 1, 3, gridspec_kw={"width_ratios": [1.4, 1.4, 1]})
    for (impl, s, run), (x, y) in tables.training_curves(curves, window).items():
        if s == seed:
            ax.plot(x, y, label=impl if run == 0 else None, **_training_style(impl),
                    **({"ls": "--"} if run else {}))
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of {window} steps), seed {seed}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    gaps = tables.training_gaps(curves, window=window)
    match = tables.training_match(curves, window=window)
    order = [tables.SELF, *match["impl"]]
    for i, impl in enumerate(order):
        g = gaps[gaps["impl"] == impl]
        style = _training_style(impl) if impl != tables.SELF else dict(color="0.3")
        dx.scatter(g["gap"], [i] * len(g), s=14, color=style["color"], alpha=0.7, zorder=3)
        if impl != tables.SELF and len(g):
            dx.plot([g["gap"].median()] * 2, [i - 0.3, i + 0.3], color=style["color"], lw=2.5)
    if len(match):
        dx.axvline(match["noise"].iloc[0], color="0.3", ls="--", lw=1)
        dx.set_title("dashed: SDPA's largest gap with itself, at any seed", fontsize=9)
    dx.set_yticks(range(len(order)), order, fontsize=8)
    dx.invert_yaxis()
    dx.set_xscale("log")  # rounding's gaps and a wrong backward's, orders of magnitude apart
    dx.set_xlabel("largest gap to SDPA's curves of the seed (a dot a seed, bar: median)")
    dx.grid(alpha=0.3, axis="x", which="both")
    times = tables.training_step_times(rows, gpu)
    times.plot.barh(ax=bx, color=["#9ecae1", "#3182bd", "#08519c"][:len(times.columns)])
    for cont in bx.containers:
        bx.bar_label(cont, fmt=" %.1f ms", fontsize=7)
    bx.set_xlabel("median step time (ms)")
    bx.set_ylabel("")
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1)
    bx.invert_yaxis()
    r0 = curves.iloc[0]
    fig.suptitle(f"A byte-level GPT-2 ({r0.n_layer} layers, d = {r0.n_embd}, {r0.n_head} heads, "
                 f"seq {r0.seq}, batch {r0.batch}, {r0['dtype']}) trained from "
                 f"{curves['seed'].nunique()} seeds — {gpu}", fontsize=10)
    fig.tight_layout()
    return fig


def save_training(rows=None, outdir=None):
    """data/figures/training.png from data/training.csv; returns its path."""
    outdir = paths.figures_dir() if outdir is None else Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "training.png"
    training(rows).savefig(path, dpi=110, metadata={"Software": None})
    return path
