"""`flashlab leaderboard GRADEBOOK... [--out DIR]`: a class, ranked from its gradebook.

The gradebook is what `flashlab grade --class` writes (one row per student and exercise, graded
by the instructor from the hand-ins); nothing a student reports is read. A row whose points are
not a number, are negative, or exceed the exercise's points (as the course registers them, or as
the row's max_points says for an exercise this installation does not know) is refused, with the
file and row named. Kernel exercises are compared only with runs on the same GPU model: a table
per model (each student's labs counting in every table they appear in), and a figure per
exercise with a panel per model. Figures are matplotlib Figures made without pyplot, saved as
PNG under --out.
"""
import csv
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .exercises import EXERCISES
from .exercises import ids as _registry_ids

CPU = "cpu"
SAME_MODEL = ("Kernel exercises are compared only with runs on the same GPU model: each model is "
              "ranked on its own, and a figure's panels never share a GPU.")
REQUIRED = ("student", "exercise", "points", "max_points", "verdict", "gpu")


def model_label(gpu) -> str:
    return "no GPU (CPU labs only)" if gpu == CPU else gpu


def _files(items) -> list:
    files = []
    for item in map(Path, items):
        if item.is_dir():
            files += sorted(item.rglob("gradebook.csv"))
        elif item.exists():
            files.append(item)
        else:
            raise FileNotFoundError(f"{item}: no such file or folder")
    return list(dict.fromkeys(p.resolve() for p in files))


def load(items) -> pd.DataFrame:
    """Every row of the gradebooks in `items`, checked (see the module's docstring); a student
    graded in two gradebooks on one exercise keeps the later row."""
    points = {ex.id: ex.points for ex in EXERCISES}
    frames = []
    for path in _files(items):
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        if rows and not set(REQUIRED) <= set(rows[0]):
            raise ValueError(f"{path} is not a flashlab gradebook (it lacks "
                             f"{', '.join(sorted(set(REQUIRED) - set(rows[0])))})")
        for n, r in enumerate(rows, start=2):
            where = f"{path}, row {n} ({r['student']}, {r['exercise']})"
            try:
                got, most = float(r["points"]), float(r["max_points"])
            except ValueError:
                raise ValueError(f"{where}: points {r['points']!r} is not a number") from None
            most = points.get(r["exercise"], most)
            if not math.isfinite(got) or got < 0 or got > most + 1e-9:
                raise ValueError(f"{where}: {got:g} points, but {r['exercise']} is worth "
                                 f"{most:g}: a gradebook never scores above an exercise's points")
            r.update(points=got, max_points=most, gpu=r.get("gpu") or CPU,
                     graded=r.get("graded", ""))
        frames.append(pd.DataFrame(rows, columns=list(rows[0]) if rows else REQUIRED))
    if not frames:
        raise ValueError(f"no gradebook in {', '.join(map(str, items))}")
    df = pd.concat(frames, ignore_index=True)
    if df.empty:
        return df
    return (df.sort_values("graded", kind="stable")
            .drop_duplicates(["student", "exercise"], keep="last").reset_index(drop=True))


def _order(exercise_ids):
    """The course's order (by stage, labs first), then ids this checkout does not know."""
    known = {e: i for i, e in enumerate(_registry_ids())}
    return sorted(exercise_ids, key=lambda e: (known.get(e, len(known)), e.split(".")[0], e))


def models(df) -> list:
    """The GPU models that timed a kernel exercise, or [cpu] where none did."""
    gpus = sorted(set(df.loc[df["gpu"] != CPU, "gpu"]))
    return gpus or [CPU]


def board(df, gpu) -> pd.DataFrame:
    """One GPU model's ranked table: a row per student graded on it (or, for the cpu board, every
    student), their total over the labs and that model's kernel exercises, a column per
    exercise. An exercise skipped (not graded: no GPU to run it) counts in neither the total nor
    the possible points, and shows as "-"."""
    df = df[df["verdict"] != "skipped"]
    mine = df[(df["gpu"] == gpu) | (df["gpu"] == CPU)] if gpu != CPU else df[df["gpu"] == CPU]
    if gpu != CPU:
        on = set(df.loc[df["gpu"] == gpu, "student"])
        mine = mine[mine["student"].isin(on)]
    per = (mine.groupby("student", as_index=False)
           .agg(total=("points", "sum"), possible=("max_points", "sum")))
    scores = mine.pivot_table(index="student", columns="exercise", values="points", aggfunc="first")
    scores = scores[_order(scores.columns)]
    table = per.merge(scores, left_on="student", right_index=True, how="left")
    table = table.sort_values(["total", "student"], ascending=[False, True])
    table.insert(0, "rank", table["total"].rank(method="min", ascending=False).astype(int))
    return table.reset_index(drop=True)


def rank(df) -> dict:
    """{GPU model: its ranked table}."""
    return {gpu: board(df, gpu) for gpu in models(df)}


def text(boards, df) -> str:
    """The ranked tables, each headed by its GPU model, after the line that says models are
    never compared."""
    students = df["student"].nunique()
    gpus = [g for g in boards if g != CPU]
    lines = [f"{students} student{'s' * (students != 1)} on {len(gpus)} GPU model"
             f"{'s' * (len(gpus) != 1)}. {SAME_MODEL}" if gpus else
             f"{students} student{'s' * (students != 1)}; no kernel exercise was graded on a GPU."]
    with pd.option_context("display.width", 250, "display.max_columns", 100):
        for gpu, table in boards.items():
            if table.empty:
                lines += ["", f"== {model_label(gpu)}: no exercise graded (every one was skipped "
                              f"where it was graded) =="]
                continue
            shown = table.copy()
            shown["total"] = [f"{t:g} / {p:g}" for t, p in zip(shown["total"], shown["possible"])]
            shown = shown.drop(columns="possible")
            for col in shown.columns[3:]:  # the exercises' scores
                shown[col] = [f"{x:g}" if x == x else "-" for x in shown[col]]
            lines += ["", f"== {model_label(gpu)}: {len(table)} student"
                          f"{'s' * (len(table) != 1)} ==", shown.to_string(index=False, na_rep="-")]
    return "\n".join(lines)


def figure(exercise, df) -> Figure:
    """One exercise: a panel per GPU model (the labs' one panel: cpu), each student's score,
    ranked, out of the exercise's points."""
    mine = df[df["exercise"] == exercise]
    gpus = sorted(mine["gpu"].unique())
    n = max(len(gpus), 1)
    tallest = max([mine[mine["gpu"] == g]["student"].nunique() for g in gpus] or [1])
    fig = Figure(figsize=(4.8 * n + 0.8, 2.2 + 0.3 * tallest), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, n, squeeze=False)[0])
    points = float(mine["max_points"].max()) if len(mine) else 1.0
    for ax, gpu in zip(axes, gpus):
        best = (mine[mine["gpu"] == gpu].groupby("student")["points"].max()
                .sort_values(ascending=True, kind="stable"))
        y = np.arange(len(best))
        ax.barh(y, best.to_numpy(), color=["tab:green" if s >= points else "tab:blue"
                                            for s in best.to_numpy()])
        ax.set_yticks(y, best.index.tolist(), fontsize=8)
        for yy, s in zip(y, best.to_numpy()):
            ax.text(s, yy, f" {s:g}", va="center", fontsize=8)
        ax.set_xlim(0, points * 1.15)
        ax.axvline(points, color="0.5", ls="--", lw=0.8)
        ax.set_xlabel(f"points (of {points:g}; dashed: full marks)")
        ax.set_title(model_label(gpu), fontsize=9)
    if not gpus:
        axes[0].text(0.5, 0.5, "graded for no student", ha="center", va="center",
                     transform=axes[0].transAxes)
        axes[0].set_axis_off()
    fig.suptitle(f"{exercise}: points by student", fontsize=10)
    return fig


def figures(df) -> dict:
    """{exercise id: its Figure}, for every exercise graded for some student (not skipped)."""
    df = df[df["verdict"] != "skipped"]
    return {ex: figure(ex, df) for ex in _order(df["exercise"].unique())}


def run(items, out_dir="leaderboard", out=print):
    """`flashlab leaderboard`: print the ranked tables, save them as leaderboard.txt and
    leaderboard.csv and a PNG per exercise under `out_dir`. Returns (boards, figure paths)."""
    df = load(items)
    if df.empty:
        raise ValueError(f"the gradebooks in {', '.join(map(str, items))} hold no rows")
    boards = rank(df)
    report = text(boards, df)
    out(report)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "leaderboard.txt").write_text(report + "\n", encoding="utf-8")
    pd.concat([t.assign(gpu=g) for g, t in boards.items()]).to_csv(out_dir / "leaderboard.csv",
                                                                   index=False)
    written = []
    for ex, fig in figures(df).items():
        path = out_dir / f"{ex}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    shown = (f"{len(written)} figure{'s' * (len(written) != 1)} "
             f"({', '.join(p.name for p in written)})" if written else "no figure (nothing graded)")
    out(f"\nwritten to {out_dir}: leaderboard.txt, leaderboard.csv and {shown}")
    return boards, written
