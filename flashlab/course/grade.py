"""`flashlab grade`: a student checks an edition; an instructor grades a class's hand-ins.

    flashlab grade [DIR] [--exercise ID]                # a student, in their edition
    flashlab grade --class HANDINS --edition ED [--out GRADES] [--student NAME] [--jobs N]

An edition's exercises are those its edition.json hands out (the solution edition: all of them).
A lab is graded in its notebook's own context (flashlab.course.labrun: the notebook run in a
fresh Python through the answer cell, `answer` read back and checked here); a kernel exercise by
building, checking and timing its stage (flashlab.course.kernels), on a GPU that runs it, else
skipped with one line saying why.

--class grades every hand-in in the folder HANDINS (each a folder, a git clone, a .zip, or loose
notebooks and kernels: flashlab.course.handin) against the edition ED as handed out: each in its
own work tree, in its own process, within --timeout seconds; kernel exercises are timed in turn
with the solution (this installation's kernels) on this GPU, one grading at a time per GPU.
Nothing a student reports about their work is read. GRADES/gradebook.csv gets one row per student
and exercise (student, exercise, points, why, ...), replacing that student's earlier rows, and
GRADES/feedback/<student>.md what they are told. `flashlab leaderboard GRADES/gradebook.csv`
ranks them.
"""
import csv
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import paths
from ..env import environment, gpu_available
from . import Result, exercises

NO_GPU = "no CUDA GPU here: kernel exercises need one to be checked and timed (labs need none)"
STUDENT_TIMEOUT_S = 1800      # one hand-in, every exercise
GRADEBOOK = "gradebook.csv"
COLUMNS = ["student", "assignment", "exercise", "kind", "stage", "points", "max_points",
           "verdict", "why", "gpu", "graded", "handed_in"]
_MARK = "FLASHLAB-RESULT"


# --- one tree: an edition, or a hand-in's work tree ------------------------------------------------

def handed_out(root) -> list:
    """The exercises the edition in `root` hands out (edition.json), else every exercise."""
    from .student import read_manifest
    man = read_manifest(root)
    if man is None:
        return list(exercises.EXERCISES)
    known = {ex.id: ex for ex in exercises.EXERCISES}
    out = []
    for e in man["exercises"]:
        ex = known.get(e["id"])
        if ex is None:  # an edition of a newer solution: grade what it says with its points
            ex = exercises.Exercise(e["id"], e["stage"], e["kind"], e["title"], e["points"],
                                    e.get("notebook", ""))
        out.append(ex)
    return out


def _notebook(root: Path, slug: str):
    nb = root / "notebooks" / f"{slug}.ipynb"
    if nb.is_file():
        return nb
    src = root / "notebooks" / "src" / f"{slug}.py"
    if src.is_file():  # a source alone: its notebook, written beside the others
        from .nbtext import notebook_from_source
        return notebook_from_source(src, nb)
    return None


def grade_labs(root, labs, cell_timeout=None, parallel=4) -> dict:
    """{lab id: Result} for `labs` (Exercises) of the tree at `root`, each from its notebook; up
    to `parallel` notebooks run at once (each in a kernel of its own)."""
    from . import labrun
    from .labs import answer_check
    root = Path(root)
    out = {}
    by_stage = {}
    for ex in labs:
        by_stage.setdefault(ex.home, []).append(ex)

    def one(slug):
        exs = by_stage[slug]
        nb = _notebook(root, slug)
        if nb is None:
            return {ex.id: Result(ex.id, False, 0.0, f"no notebook notebooks/{slug}.ipynb")
                    for ex in exs}
        data = root / "data"
        got = labrun.answers(nb, [ex.id for ex in exs],
                             cell_timeout=cell_timeout or labrun.CELL_TIMEOUT_S,
                             data_dir=data if data.is_dir() else None,
                             package_root=root if (root / "flashlab").is_dir() else None)
        found = {}
        for ex in exs:
            a = got[ex.id]
            if a.status == "answered":
                r = answer_check(ex.id, a.value)
                r.exercise = ex.id
            elif a.status in ("blank", "timeout"):
                r = Result(ex.id, False, 0.0, a.why, status=a.status)
            else:
                r = Result(ex.id, False, 0.0, a.why)
            r.score = min(max(float(r.score), 0.0), ex.points) if r.ok else 0.0
            found[ex.id] = r
        return found

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(by_stage)))) as pool:
        for found in pool.map(one, sorted(by_stage)):
            out.update(found)
    return out


def grade_tree(root=".", only=None, gpu=None, solution=None, cell_timeout=None, each=None,
               machine_code=False) -> list:
    """[(Exercise, Result)] for the exercises the tree at `root` hands out (or only the ids in
    `only`), in course order. Without a CUDA GPU (gpu=False; None: ask torch) kernel exercises are
    skipped without building anything, or with machine_code, their kernels compiled (nvcc and
    cuobjdump, no GPU) and what their machine code says of the idea noted (Result.note, no
    points). solution: the solution edition to time kernel exercises against (class grading).
    each(ex, result) is called as each one is graded."""
    from .kernels import grade_kernel, machine_code_note
    root = Path(root)
    chosen = handed_out(root)
    if only:
        wanted = set(only)
        unknown = wanted - {ex.id for ex in chosen}
        if unknown:
            raise ValueError(f"{', '.join(sorted(unknown))}: not an exercise of this edition; its "
                             f"exercises are {', '.join(ex.id for ex in chosen)}")
        chosen = [ex for ex in chosen if ex.id in wanted]
    gpu = gpu_available() if gpu is None else gpu
    results = {}
    told = threading.Lock()

    def done(ex, r):
        results[ex.id] = r
        if each:
            with told:
                each(ex, r)

    labs = [ex for ex in chosen if ex.kind == "lab"]
    # The labs run on the CPU (a notebook kernel each) while the kernel exercises use the GPU.
    def labs_done(future):  # as soon as they are: a hand-in stopped later keeps them
        if future.exception() is None:
            for lab_id, r in future.result().items():
                done(next(ex for ex in labs if ex.id == lab_id), r)

    with ThreadPoolExecutor(max_workers=1) as pool:
        lab_results = pool.submit(grade_labs, root, labs, cell_timeout)
        lab_results.add_done_callback(labs_done)
        for ex in chosen:
            if ex.kind != "kernel":
                continue
            if not gpu:
                r = Result.skipped(ex, NO_GPU)
                if machine_code:
                    r.note = machine_code_note(ex, root)
            else:
                try:
                    r = grade_kernel(ex, root, solution=solution)
                except Exception as err:  # noqa: BLE001 -- the student's build may raise anything
                    r = Result(ex.id, False, 0.0,
                               f"the grader stopped on {type(err).__name__}: {err}")
                r.score = min(max(float(r.score), 0.0), ex.points) if r.ok else 0.0
            done(ex, r)
        lab_results.result()  # raises what grading the labs raised
    return [(ex, results[ex.id]) for ex in chosen]


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
    shown = [(ex, r) for ex, r in graded if r.ok is False or (r.ok and r.score < ex.points)]
    if shown:
        lines.append("")
        for ex, r in shown:
            lines += textwrap.wrap(f"{ex.id}: {r.message}", 98, subsequent_indent="    ")
    skipped = {}
    for ex, r in graded:
        if r.ok is None:
            skipped.setdefault(r.message, []).append(ex.id)
    if skipped:
        lines.append("")
        for why, ids in skipped.items():
            # the reason on lines of its own, whole: a longer list never splits it
            lines += textwrap.wrap(f"skipped {len(ids)} ({', '.join(ids)}):", 98,
                                   subsequent_indent="    ")
            lines += textwrap.wrap(why, 98, initial_indent="    ", subsequent_indent="    ")
    noted = [(ex, r) for ex, r in graded if r.note]
    if noted:
        lines.append("")
        for ex, r in noted:
            lines += textwrap.wrap(f"{ex.id}: {r.note}", 98, subsequent_indent="    ")
    t = totals(graded)
    lines += ["", f"total: {t['score']:g} / {t['points']} points over the {t['graded']} "
              f"exercise{'s' * (t['graded'] != 1)} graded here"
              + (f" ({t['possible'] - t['points']} more points in the {t['skipped']} skipped)"
                 if t["skipped"] else "")]
    return "\n".join(lines)


def run(root=".", only=None, out=print, gpu=None, solution=None, cell_timeout=None, as_json=False,
        machine_code=False):
    """`flashlab grade [DIR]`: grade the tree and print its table (as_json: one marked JSON line
    per exercise as it is graded, for the class grader; machine_code: without a GPU, what each
    kernel exercise's machine code says, grade_tree). Returns [(Exercise, Result)]."""
    root = Path(root)
    if not (root / "notebooks").is_dir() and not (root / "kernels").is_dir():
        raise ValueError(f"{root} is not a flashlab edition (it has no notebooks/ or kernels/)")
    if as_json:
        mark = os.environ.get("FLASHLAB_RESULT_MARK", _MARK)
        env = environment()

        def each(ex, r):
            print(f"{mark} " + json.dumps(dict(exercise=ex.id, ok=r.ok, score=r.score,
                                               message=r.message, status=r.status,
                                               gpu=env["gpu"] if ex.kind == "kernel" else "cpu")),
                  flush=True)
        return grade_tree(root, only, gpu, solution, cell_timeout, each)
    env = environment()
    out(f"flashlab grade: {root.resolve()}, on "
        f"{env['gpu'] if env['gpu'] != 'cpu' else 'a machine without a CUDA GPU'}\n")
    graded = grade_tree(root, only, gpu, solution, cell_timeout, machine_code=machine_code)
    out(table(graded))
    return graded


# --- a class: hand-ins graded by the instructor ----------------------------------------------------

def handins(folder, students=None) -> list:
    """The hand-ins in `folder` (each folder or .zip in it, hidden ones left out), sorted by
    student; only the named students where `students` is given."""
    from .handin import student_name
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder of hand-ins")
    found = [p for p in sorted(folder.iterdir()) if not p.name.startswith((".", "_"))
             and (p.is_dir() or p.suffix.lower() == ".zip")]
    if students:
        names = set(students)
        found = [p for p in found if student_name(p) in names]
        missing = names - {student_name(p) for p in found}
        if missing:
            raise ValueError(f"no hand-in in {folder} for {', '.join(sorted(missing))}")
    return found


def grade_handin(handin, edition, manifest, timeout=STUDENT_TIMEOUT_S, cell_timeout=None,
                 solution=None, gpu=None, scratch=None, only=None) -> tuple:
    """(HandIn, [(Exercise, Result)], seconds) for one hand-in: its work tree graded in a process
    of its own, stopped after `timeout` seconds (what was not graded by then times out); only
    the exercises in `only` where it is given."""
    from .handin import make_work_tree
    scratch = Path(scratch or tempfile.mkdtemp(prefix="flashlab-class-"))
    started = time.monotonic()
    chosen = [ex for ex in handed_out(edition) if not only or ex.id in set(only)]
    try:
        h = make_work_tree(handin, edition, scratch, manifest)
    except (ValueError, OSError) as err:
        from .handin import HandIn, student_name
        h = HandIn(student_name(handin), Path(handin))
        why = f"the hand-in could not be read: {err}"
        return h, [(ex, Result(ex.id, False, 0.0, why)) for ex in chosen], 0.0
    todo = [ex.id for ex in chosen if ex.id not in h.problems]
    got, stopped = {}, None
    if todo:
        mark = f"{_MARK}-{secrets.token_hex(8)}"
        cmd = [sys.executable, "-m", "flashlab", "grade", str(h.work), "--json",
               "--solution", str(solution or paths.ROOT)]
        for ex_id in todo:
            cmd += ["--exercise", ex_id]
        if cell_timeout:
            cmd += ["--cell-timeout", str(cell_timeout)]
        if gpu is False:
            cmd += ["--no-gpu"]
        env = dict(os.environ, FLASHLAB_RESULT_MARK=mark)
        env.pop("FLASHLAB_DATA", None)  # the work tree's own data/
        try:  # run from the scratch folder: `python -m` must import this flashlab, not a copy
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                                  cwd=str(scratch))
            stdout = proc.stdout
            if proc.returncode != 0:
                stopped = (f"the grader's process failed (exit status {proc.returncode}): "
                           f"{(proc.stderr or '').strip()[-400:]}")
        except subprocess.TimeoutExpired as err:
            stdout = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            stopped = f"grading this hand-in took over {timeout} s and was stopped"
        for line in stdout.splitlines():
            if line.startswith(mark + " "):
                d = json.loads(line[len(mark) + 1:])
                got[d["exercise"]] = d
    results = []
    for ex in chosen:
        if ex.id in h.problems:
            results.append((ex, Result(ex.id, False, 0.0, h.problems[ex.id], status="blank")))
        elif ex.id in got:
            d = got[ex.id]
            score = min(max(float(d["score"]), 0.0), ex.points) if d["ok"] else 0.0
            results.append((ex, Result(ex.id, d["ok"], score, d["message"], d.get("status", ""),
                                       gpu=d.get("gpu", "cpu"))))
        else:
            why = stopped or "not graded"
            status = "timeout" if "took over" in why else ""
            results.append((ex, Result(ex.id, False, 0.0, why, status=status)))
    shutil.rmtree(h.work.parent, ignore_errors=True)
    return h, results, time.monotonic() - started


def gradebook_rows(h, results, assignment) -> list:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return [dict(student=h.name, assignment=assignment, exercise=ex.id, kind=ex.kind,
                 stage=ex.stage, points=round(r.score, 3), max_points=ex.points,
                 verdict=r.verdict, why=r.message, gpu=r.gpu or "cpu", graded=stamp,
                 handed_in=str(h.source)) for ex, r in results]


def write_gradebook(path, rows, students, exercises=None) -> None:
    """Put `rows` in the gradebook CSV at `path`, replacing those of `students` (only of the
    `exercises` given, where they are); under a lock beside it (a hidden file), so that gradings
    running side by side (a Slurm array) each add their own."""
    from filelock import FileLock
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_name(f".{path.name}.lock"))):
        kept = []
        if path.is_file():
            with open(path, newline="", encoding="utf-8") as f:
                kept = [r for r in csv.DictReader(f) if r["student"] not in set(students)
                        or (exercises is not None and r["exercise"] not in set(exercises))]
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for r in sorted(kept + rows, key=lambda r: (r["student"], _order(r["exercise"]))):
                w.writerow({k: r.get(k, "") for k in COLUMNS})
        os.replace(tmp, path)


def _order(ex_id):
    ids = exercises.ids()
    return ids.index(ex_id) if ex_id in ids else len(ids)


def feedback(h, results, assignment) -> str:
    """What a student is told: their score, each exercise's verdict and why, what was read."""
    t = totals(results)
    lines = [f"# {h.name}: assignment {assignment}", "",
             f"**{t['score']:g} of {t['points']} points** over the {t['graded']} "
             f"exercise{'s' * (t['graded'] != 1)} graded"
             + (f"; {t['skipped']} not graded here ({t['possible'] - t['points']} points), "
                "to be graded where they can run" if t["skipped"] else ""), "",
             "| exercise | points | verdict |", "|---|---:|---|"]
    lines += [f"| `{ex.id}` | {'-' if r.ok is None else f'{r.score:g}'} / {ex.points} | "
              f"{r.verdict} |" for ex, r in results]
    lines.append("")
    for ex, r in results:
        lines += [f"## {ex.id} ({ex.title})", "", r.message or "-", ""]
    if h.notes:
        lines += ["## What was graded", ""] + [f"- {n}" for n in h.notes] + [""]
    return "\n".join(lines)


def _safe(name) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "student"


def grade_class(handins_dir, edition, out_dir="grades", students=None, jobs=1,
                timeout=STUDENT_TIMEOUT_S, cell_timeout=None, gpu=None, out=print,
                only=None) -> list:
    """`flashlab grade --class`: grade every hand-in (see the module's docstring). Returns
    [(HandIn, [(Exercise, Result)], seconds)]."""
    from .student import read_manifest
    edition = Path(edition)
    manifest = read_manifest(edition)
    if manifest is None:
        raise ValueError(f"{edition} is not an edition as handed out (no edition.json): pass the "
                         "folder `flashlab student` wrote")
    items = handins(handins_dir, students)
    if not items:
        raise ValueError(f"no hand-ins in {handins_dir}")
    out_dir = Path(out_dir)
    (out_dir / "feedback").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="flashlab-class-"))
    out(f"grading {len(items)} hand-in{'s' * (len(items) != 1)} of assignment "
        f"{manifest['assignment']} ({len(manifest['exercises'])} exercises), {jobs} at a time")

    if only:
        unknown = set(only) - {e["id"] for e in manifest["exercises"]}
        if unknown:
            raise ValueError(f"{', '.join(sorted(unknown))}: not an exercise of assignment "
                             f"{manifest['assignment']}")

    def one(item):
        return grade_handin(item, edition, manifest, timeout, cell_timeout, gpu=gpu,
                            scratch=scratch, only=only)

    done = []
    with ThreadPoolExecutor(max_workers=max(1, int(jobs))) as pool:
        for h, results, secs in pool.map(one, items):
            rows = gradebook_rows(h, results, manifest["assignment"])
            write_gradebook(out_dir / GRADEBOOK, rows, [h.name],
                            exercises=[ex.id for ex, _ in results] if only else None)
            (out_dir / "feedback" / f"{_safe(h.name)}.md").write_text(
                feedback(h, results, manifest["assignment"]), encoding="utf-8")
            t = totals(results)
            verdicts = {}
            for _, r in results:
                verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
            unjudged = (f"; {t['possible'] - t['points']} more in the {t['skipped']} not graded "
                        f"here" if t['skipped'] else "")
            out(f"  {h.name}: {t['score']:g} / {t['points']} points over the {t['graded']} "
                f"graded{unjudged} ({', '.join(f'{n} {v}' for v, n in verdicts.items())}) "
                f"in {secs:.0f} s")
            done.append((h, results, secs))
    shutil.rmtree(scratch, ignore_errors=True)
    out(f"gradebook: {out_dir / GRADEBOOK}; feedback: {out_dir / 'feedback'}/")
    return done
