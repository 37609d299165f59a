"""`flashlab grade [DIR] [--exercise ID] [--name NAME]`: grade a student's edition.

Every exercise (or one) of the edition in DIR is graded: the CPU labs from the notebooks' check
cells on any machine, the kernel exercises by building, checking and timing their stage on a GPU
that runs it (skipped, with one line saying why, where there is none). A score table is printed
and a JSON submission written to DIR/submissions/<name>-<gpu>-<time>.json, never over another
one: `flashlab leaderboard` merges them.
"""
import getpass
import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

from .. import paths
from ..env import environment, gpu_available
from . import exercises

FORMAT = "flashlab-submission/1"   # the submission files' "format" field
NO_GPU = "no CUDA GPU here: kernel exercises need one (the CPU labs are graded anywhere)"


def student_name(name=None) -> str:
    """Who is graded: `name`, else $FLASHLAB_STUDENT, else the login name."""
    if name and name.strip():
        return name.strip()
    if os.environ.get("FLASHLAB_STUDENT", "").strip():
        return os.environ["FLASHLAB_STUDENT"].strip()
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 -- no login name in some containers
        return "student"


def grade_all(root=".", exercise=None, gpu=None) -> list:
    """[(Exercise, Result)] for every exercise of the edition in `root`, or only `exercise` (an
    id). Without a CUDA GPU (gpu=False; None: ask torch) the kernel exercises are skipped
    without building anything."""
    root = Path(root)
    chosen = [exercises.exercise(exercise)] if exercise else list(exercises.EXERCISES)
    gpu = gpu_available() if gpu is None else gpu
    graded = []
    for ex in chosen:
        if ex.kind == "kernel" and not gpu:
            graded.append((ex, exercises.Result.skipped(ex, NO_GPU)))
        else:
            graded.append((ex, exercises.grade(ex, root)))
    return graded


def totals(graded) -> dict:
    """Score and points over the graded (not skipped) exercises, and over all of them."""
    done = [(ex, r) for ex, r in graded if r.ok is not None]
    return dict(score=sum(r.score for _, r in done), points=sum(ex.points for ex, _ in done),
                possible=sum(ex.points for ex, _ in graded), graded=len(done),
                skipped=len(graded) - len(done))


def table(graded) -> str:
    """The score table (exercise, kind, points, score, verdict), why each wrong answer is
    wrong, one line per reason exercises were skipped, and the total."""
    rows = [("exercise", "kind", "points", "score", "verdict")]
    rows += [(ex.id, ex.kind, str(ex.points), "-" if r.ok is None else f"{r.score:g}", r.verdict)
             for ex, r in graded]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) if i < 2 or i == 4 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    wrong = [(ex, r) for ex, r in graded if r.ok is False]
    if wrong:
        lines.append("")
        for ex, r in wrong:
            lines += textwrap.wrap(f"{ex.id}: {r.message}", 98, subsequent_indent="    ")
    skipped = {}
    for ex, r in graded:
        if r.ok is None:
            skipped.setdefault(r.message, []).append(ex.id)
    if skipped:
        lines.append("")
        for why, ids in skipped.items():
            lines += textwrap.wrap(f"skipped {len(ids)} ({', '.join(ids)}): {why}", 98,
                                   subsequent_indent="    ")
    t = totals(graded)
    lines += ["", f"total: {t['score']:g} / {t['points']} points over the {t['graded']} "
              f"exercise{'s' * (t['graded'] != 1)} graded here"
              + (f" ({t['possible'] - t['points']} more points in the {t['skipped']} skipped)"
                 if t["skipped"] else "")]
    return "\n".join(lines)


def _git_commit(root: Path):
    try:
        return subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def submission(graded, name, root=".", env=None) -> dict:
    """The JSON record of one grading run: who, on which GPU (or "cpu"), with which torch, CUDA
    and flashlab commit, and every exercise's result."""
    env = environment() if env is None else env
    root = Path(root).resolve()
    sub = dict(format=FORMAT, name=name, gpu=env.get("gpu") or "cpu",
               compute_capability=env.get("compute_capability", ""), torch=env.get("torch", ""),
               cuda=env.get("cuda", ""), commit=env.get("commit", ""), time=env.get("time", ""),
               edition=str(root))
    if root != paths.ROOT.resolve():  # flashlab graded another tree: record that one's commit too
        sub["edition_commit"] = _git_commit(root)
    sub |= totals(graded)
    sub["results"] = [dict(exercise=ex.id, stage=ex.stage, kind=ex.kind, title=ex.title,
                           points=ex.points, ok=r.ok, score=r.score, message=r.message)
                      for ex, r in graded]
    return sub


def _slug(text) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", str(text)).strip("-").lower() or "x"


def write_submission(sub, root=".") -> Path:
    """Write `sub` to root/submissions/<name>-<gpu>-<time>.json; a name already taken gets -2,
    -3, ...: a submission never replaces another."""
    folder = Path(root) / "submissions"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = re.sub(r"[^0-9TZ]", "", sub.get("time", "")) or "now"
    stem = f"{_slug(sub['name'])}-{_slug(sub['gpu'])}-{stamp}"
    text = json.dumps(sub, indent=1) + "\n"
    for i in range(1, 10_000):
        path = folder / (f"{stem}.json" if i == 1 else f"{stem}-{i}.json")
        try:
            with open(path, "x", encoding="utf-8") as f:  # "x": fails if it exists
                f.write(text)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"{folder}: too many submissions named {stem}")


def run(root=".", exercise=None, name=None, out=print, gpu=None):
    """`flashlab grade`: grade, print the table, write the submission. Returns (graded, path)."""
    root = Path(root)
    if not (root / "notebooks").is_dir() and not (root / "kernels").is_dir():
        raise ValueError(f"{root} is not a flashlab edition (it has no notebooks/ or kernels/)")
    name = student_name(name)
    graded = grade_all(root, exercise, gpu)
    env = environment()
    out(f"flashlab grade: {name}, {root.resolve()}, on "
        f"{env['gpu'] if env['gpu'] != 'cpu' else 'a machine without a CUDA GPU'}\n")
    out(table(graded))
    path = write_submission(submission(graded, name, root, env), root)
    out(f"\nsubmission written to {path}")
    return graded, path
