"""Figures, all drawn from the recorded tables in data/ (so they render without a GPU)."""
import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
import pandas as pd

from . import paths, peaks as _peaks, results
from .bench import SWEEP_NS, teaching

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


def latest_gpu(df):
    """The GPU of the most recent row: figures show one GPU at a time."""
    ok = df[df["status"].fillna("ok") == "ok"]
    return ok.sort_values("time")["gpu"].iloc[-1] if len(ok) else None


def _ok(df, gpu):
    return df[(df["gpu"] == gpu) & (df["status"].fillna("ok") == "ok")]


def _stage_color(i, n):
    return STAGE_COLORS(0.15 + 0.7 * i / max(1, n - 1))


def ladder(df=None, gpu=None, dtype="fp32", ax=None):
    """TFLOP/s of every stage at the teaching config, the PyTorch baselines as lines."""
    df = results.load() if df is None else df
    gpu = gpu or latest_gpu(df)
    ok = _ok(df, gpu)
    cfg = teaching(dtype)
    here = results.at_config(ok, cfg)
    st = here[here["kind"] == "stage"].sort_values("stage")
    if ax is None:
        _, ax = _axes((8, 4.8))
    xs = range(len(st))
    bars = ax.bar(xs, st["tflops"], color=[_stage_color(i, len(st)) for i in xs], zorder=2)
    for bar, (_, r) in zip(bars, st.iterrows()):
        ax.annotate(f"{r.tflops:.2f}\n{r.median_ms:.3g} ms", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(xs), [s.replace("_", "\n", 1) for s in st["stage"]])
    other = "fp16" if dtype == "fp32" else "fp32"
    for d, alpha in ((dtype, 1.0), (other, 0.35)):
        base = results.at_config(ok, teaching(d))
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


def scaling(df=None, gpu=None, dtype="fp16"):
    """TFLOP/s against N over the FlashAttention sweep, one panel per head dim and mask."""
    df = results.load() if df is None else df
    gpu = gpu or latest_gpu(df)
    ok = _ok(df, gpu)
    ok = ok[(ok["dtype"] == dtype) & (ok["B"] * ok["N"] == 16384) & (ok["H"] * ok["D"] == 2048)]
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
        ax.set_xticks(SWEEP_NS, [f"{n // 1024}k" if n >= 1024 else str(n) for n in SWEEP_NS])
        ax.set_title(f"D={d}, {'causal' if causal else 'not causal'}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel("sequence length N (B·N = 16k tokens, H·D = 2048)")
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


def roofline(df=None, gpu=None, ceilings=None, ax=None):
    """Every stage and baseline at the teaching configs on the GPU's measured roofline."""
    import numpy as np
    df = results.load() if df is None else df
    gpu = gpu or latest_gpu(df)
    ceilings = _peaks.load(gpu) if ceilings is None else ceilings
    ok = _ok(df, gpu)
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
    pts = pd.concat([results.at_config(ok, teaching("fp32")), results.at_config(ok, teaching("fp16"))])
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


FIGURES = {"ladder": ladder, "scaling": scaling, "roofline": roofline}


def save_all(df=None, outdir=None, gpu=None):
    """Write every figure as data/figures/NAME.png; returns the paths written."""
    df = results.load() if df is None else df
    outdir = paths.figures_dir() if outdir is None else outdir
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    if latest_gpu(df) is None:
        return written
    for name, draw in FIGURES.items():
        fig = draw(df, gpu=gpu)
        path = outdir / f"{name}.png"
        fig.savefig(path, dpi=110, metadata={"Software": None})
        written.append(path)
    return written
