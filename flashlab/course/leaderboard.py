"""`flashlab leaderboard FILES_OR_DIR [--out DIR]`: a class's submissions, ranked.

Submissions (the JSON files `flashlab grade` writes) are merged, each kept: two with the same
student or team name are both counted, and the name is ranked by its best one. Runs are compared
only with runs on the same GPU model: a table per model, and a figure per exercise with a panel
per model (a kernel's time means nothing beside another GPU's). Figures are matplotlib Figures
made without pyplot, saved as PNG under --out.
"""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .exercises import ids as _registry_ids
from .grade import FORMAT

CPU = "cpu"
SAME_MODEL = ("Runs are compared only with runs on the same GPU model: each model is ranked on its "
              "own, and a figure's panels never share a GPU.")


def model_label(gpu) -> str:
    return "no GPU (CPU labs only)" if gpu == CPU else gpu


def _files(items) -> list:
    files = []
    for item in map(Path, items):
        if item.is_dir():
            files += sorted(item.rglob("*.json"))
        elif item.exists():
            files.append(item)
        else:
            raise FileNotFoundError(f"{item}: no such file or folder")
    return list(dict.fromkeys(p.resolve() for p in files))


def load(items, warn=None) -> list:
    """The submissions in `items` (files, or folders searched for *.json), each once: a file
    given twice, or two identical copies, count once; anything not a submission is skipped with a
    warning. Each is the JSON dict plus "file"."""
    warn = warn or (lambda text: print(text, file=sys.stderr))
    subs, seen = [], set()
    for path in _files(items):
        try:
            sub = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            warn(f"skipped {path}: not JSON ({err})")
            continue
        if not isinstance(sub, dict) or sub.get("format") != FORMAT or "results" not in sub:
            warn(f"skipped {path}: not a flashlab submission")
            continue
        digest = hashlib.sha256(json.dumps(sub, sort_keys=True).encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        subs.append(sub | {"file": str(path), "gpu": sub.get("gpu") or CPU})
    return subs


def results(subs) -> pd.DataFrame:
    """One row per (submission, exercise graded in it): skipped exercises are left out."""
    rows = []
    for i, sub in enumerate(subs):
        for r in sub["results"]:
            if r.get("ok") is None:
                continue
            rows.append(dict(submission=i, file=sub["file"], name=sub["name"], gpu=sub["gpu"],
                             time=sub.get("time", ""), exercise=r["exercise"],
                             kind=r.get("kind", ""), points=float(r.get("points", 0)),
                             ok=bool(r["ok"]), score=float(r.get("score", 0.0))))
    return pd.DataFrame(rows, columns=["submission", "file", "name", "gpu", "time", "exercise",
                                       "kind", "points", "ok", "score"])


def _order(exercise_ids):
    """The course's order (by stage, labs first), then ids this checkout does not know."""
    known = {e: i for i, e in enumerate(_registry_ids())}
    return sorted(exercise_ids, key=lambda e: (known.get(e, len(known)), e.split(".")[0], e))


def rank(subs) -> dict:
    """{GPU model: its ranked table}: one row per name, from that name's best submission on that
    model (the highest total; the earlier one on a tie), with how many it made there, and a
    column per exercise with that submission's score."""
    df = results(subs)
    boards = {}
    for gpu, on in df.groupby("gpu", sort=True):
        per = (on.groupby(["submission", "name", "time"], as_index=False)
               .agg(total=("score", "sum"), points=("points", "sum")))
        per = per.sort_values(["total", "time"], ascending=[False, True])
        best = per.drop_duplicates("name", keep="first").copy()
        best["submissions"] = best["name"].map(per["name"].value_counts())
        best["rank"] = best["total"].rank(method="min", ascending=False).astype(int)
        scores = on.pivot_table(index="submission", columns="exercise", values="score",
                                aggfunc="first")
        scores = scores[_order(scores.columns)]
        table = best.merge(scores, left_on="submission", right_index=True, how="left")
        cols = ["rank", "name", "total", "points", "submissions", "time", *scores.columns]
        boards[gpu] = table[cols].rename(columns={"time": "best run"}).reset_index(drop=True)
    return boards


def text(boards, subs) -> str:
    """The ranked tables, each headed by its GPU model, after the line that says models are
    never compared."""
    names = {s["name"] for s in subs}
    lines = [f"{len(subs)} submission{'s' * (len(subs) != 1)} from {len(names)} "
             f"name{'s' * (len(names) != 1)} on {len(boards)} GPU model"
             f"{'s' * (len(boards) != 1)}. {SAME_MODEL}"]
    with pd.option_context("display.width", 250, "display.max_columns", 100):
        for gpu, table in boards.items():
            n = int(table["submissions"].sum())
            shown = table.copy()
            shown["total"] = [f"{t:g} / {p:g}" for t, p in zip(shown["total"], shown["points"])]
            shown = shown.drop(columns="points")
            for col in shown.columns[5:]:  # the exercises' scores
                shown[col] = [f"{x:g}" if x == x else "-" for x in shown[col]]
            lines += ["", f"== {model_label(gpu)}: {len(table)} name{'s' * (len(table) != 1)}, "
                          f"{n} submission{'s' * (n != 1)} ==", shown.to_string(index=False,
                                                                               na_rep="-")]
    return "\n".join(lines)


def figure(exercise, df) -> Figure:
    """One exercise: a panel per GPU model, each name's best score on it there, ranked, out of
    the exercise's points."""
    mine = df[df["exercise"] == exercise]
    gpus = sorted(mine["gpu"].unique())
    n = max(len(gpus), 1)
    tallest = max([mine[mine["gpu"] == g]["name"].nunique() for g in gpus] or [1])
    fig = Figure(figsize=(4.8 * n + 0.8, 2.2 + 0.3 * tallest), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, n, squeeze=False)[0])
    points = float(mine["points"].max()) if len(mine) else 1.0
    for ax, gpu in zip(axes, gpus):
        best = (mine[mine["gpu"] == gpu].groupby("name")["score"].max()
                .sort_values(ascending=True, kind="stable"))
        y = np.arange(len(best))
        ax.barh(y, best.to_numpy(), color=["tab:green" if s >= points else "tab:blue"
                                            for s in best.to_numpy()])
        ax.set_yticks(y, best.index.tolist(), fontsize=8)
        for yy, s in zip(y, best.to_numpy()):
            ax.text(s, yy, f" {s:g}", va="center", fontsize=8)
        ax.set_xlim(0, points * 1.15)
        ax.axvline(points, color="0.5", ls="--", lw=0.8)
        ax.set_xlabel(f"score (of {points:g}; dashed: full marks)")
        ax.set_title(model_label(gpu), fontsize=9)
    if not gpus:
        axes[0].text(0.5, 0.5, "graded in no submission", ha="center", va="center",
                     transform=axes[0].transAxes)
        axes[0].set_axis_off()
    fig.suptitle(f"{exercise}: each name's best score, one panel per GPU model (runs on "
                 "different models are never compared)", fontsize=10)
    return fig


def figures(subs) -> dict:
    """{exercise id: its Figure}, for every exercise graded in at least one submission."""
    df = results(subs)
    return {ex: figure(ex, df) for ex in _order(df["exercise"].unique())}


def run(items, out_dir="leaderboard", out=print, warn=None):
    """`flashlab leaderboard`: print the ranked tables, save them as leaderboard.txt and
    leaderboard.csv and a PNG per exercise under `out_dir`. Returns (boards, figure paths)."""
    subs = load(items, warn)
    if not subs:
        raise ValueError(f"no flashlab submissions in {', '.join(map(str, items))}")
    boards = rank(subs)
    report = text(boards, subs)
    out(report)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "leaderboard.txt").write_text(report + "\n", encoding="utf-8")
    pd.concat([t.assign(gpu=g) for g, t in boards.items()]).to_csv(out_dir / "leaderboard.csv",
                                                                   index=False)
    written = []
    for ex, fig in figures(subs).items():
        path = out_dir / f"{ex}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    out(f"\nwritten to {out_dir}: leaderboard.txt, leaderboard.csv and "
        f"{len(written)} figure{'s' * (len(written) != 1)} ({', '.join(p.name for p in written)})")
    return boards, written
