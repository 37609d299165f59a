"""nbgrader's cell metadata on the solution notebooks, and an nbgrader course folder for one
assignment (`flashlab nbgrader DIR --through NN [--from MM]`).

The rules (cell_metadata), applied to every notebook by `python tools/notebooks.py build` and
checked by tests, so that the committed notebooks are nbgrader's source notebooks as they are:

  * a lab's prompt cell (`print(labs.prompt("02.sectors"))`): read-only (grade_id 02-sectors-prompt);
  * its answer cell (`### BEGIN SOLUTION` ... `### END SOLUTION`): an autograded answer, a
    solution cell (grade_id 02-sectors);
  * its check cell (`labs.check("02.sectors", answer)`): the autograder's test, worth the lab's
    points (grade_id 02-sectors-check); it raises when the answer is wrong;
  * an instructor's answer to a question for discussion (a markdown cell opening with
    `**Instructor's answer.**`): a manually graded answer worth 0 points, which nbgrader's
    release replaces whole with `YOUR ANSWER HERE` (grade_id NN-answer-K);
  * any other cell holding a solution region: a solution cell.

In the course folder, `nbgrader generate_assignment NAME` writes the release (solutions and
instructor's answers out), `nbgrader autograde NAME` runs each submission in replay mode against
the assignment's edition (the config hides the GPU and puts the edition's package first: the
kernels a notebook shows are the students' stubs) and scores the labs, `nbgrader
generate_feedback NAME` writes each student's feedback. The kernel exercises are not nbgrader's: they need the
edition's kernels and a GPU (`flashlab grade --class`).
"""
from pathlib import Path

from .. import paths
from . import nbtext

SCHEMA = 3

CONFIG = '''\
# nbgrader's configuration for a flashlab assignment (written by `flashlab nbgrader`).
import os

c = get_config()  # noqa: F821 -- nbgrader provides it
c.CourseDirectory.course_id = "flashlab"
# Notebooks are run in replay mode when nbgrader executes them (validate, autograde): the labs
# need no GPU, and grading must not build or time kernels on this machine's GPU.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("MPLBACKEND", "Agg")
# ... and against the assignment's edition, as the students have it: its kernels hold the stubs
# (a notebook that shows a kernel shows theirs, never the solution, in the feedback too) and its
# package holds the labs' salted keys, not their answers.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [{edition!r}, *filter(None, [os.environ.get("PYTHONPATH")])])
c.ExecutePreprocessor.timeout = 300
'''


def grade_id(lab, part="") -> str:
    """nbgrader's id of a lab's cell (letters, digits, _ and - only): 02-sectors, 02-sectors-check."""
    return lab.replace(".", "-") + (f"-{part}" if part else "")


def _meta(grade_id, grade=False, solution=False, locked=False, points=None):
    m = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": SCHEMA,
         "solution": solution, "task": False}
    if grade:
        m["points"] = points
    return m


def cell_metadata(cells, stem: str) -> list:
    """The nbgrader metadata each cell of a notebook (cells: nbformat cells, or (cell_type,
    source) pairs) gets by the rules above, or None for a cell that gets none."""
    from .labs import LABS
    points = {ex.id: ex.points for ex in LABS}
    pairs = [(c.cell_type, c.source) if hasattr(c, "cell_type") else c for c in cells]
    out, answers = [], 0
    for i, (kind, source) in enumerate(pairs):
        m = None
        if kind == "markdown" and nbtext.instructor_answer(source):
            answers += 1
            m = _meta(f"{stem[:2]}-answer-{answers}", grade=True, solution=True, points=0)
        elif kind == "code" and nbtext.BEGIN_SOLUTION in source:
            nxt = pairs[i + 1][1] if i + 1 < len(pairs) else ""
            lab = nbtext.lab_of(source) or nbtext.lab_of(nxt)
            m = _meta(grade_id(lab) if lab else f"{stem[:2]}-solution-{i}", solution=True)
        elif kind == "code" and nbtext.lab_of(source):
            lab = nbtext.lab_of(source)
            m = _meta(grade_id(lab, "check"), grade=True, locked=True, points=points.get(lab, 0))
        elif kind == "code" and nbtext.prompt_of(source):
            m = _meta(grade_id(nbtext.prompt_of(source), "prompt"), locked=True)
        elif kind == "markdown" and nbtext.BEGIN_SOLUTION in source:
            m = _meta(f"{stem[:2]}-text-{i}", grade=True, solution=True, points=0)
        out.append(m)
    return out


def apply(nb, stem: str):
    """Set (or clear) every cell's nbgrader metadata by the rules; returns the notebook."""
    for cell, m in zip(nb.cells, cell_metadata(nb.cells, stem)):
        if m is None:
            cell.metadata.pop("nbgrader", None)
        else:
            cell.metadata["nbgrader"] = m
    return nb


def assignment_name(a) -> str:
    """nbgrader's name for an assignment: stage-02, or stages-05-06."""
    return f"stage-{a.name}" if a.first == a.last else f"stages-{a.name}"


def write_course(dest, through=None, first=None, force=False, root=None) -> str:
    """Write under `dest` the assignment's edition (edition-<assignment>/, as `flashlab student`
    writes it: what nbgrader runs the notebooks against), nbgrader_config.py pointing at it, and
    source/<assignment>/ with the assignment's solution notebooks (their nbgrader metadata
    applied; notebook 00 too, for an assignment that starts at stage 01)."""
    import nbformat

    from .student import assignment
    from .student import write as write_edition
    root = Path(root or paths.ROOT)
    a = assignment(through, first)
    name = assignment_name(a)
    dest = Path(dest)
    source = dest / "source" / name
    if source.exists() and any(source.iterdir()) and not force:
        raise FileExistsError(f"{source} is not empty: pass --force to write over it")
    edition = dest / f"edition-{name}"
    write_edition(edition, root=root, through=a.last, first=a.first, force=force)
    source.mkdir(parents=True, exist_ok=True)
    config = dest / "nbgrader_config.py"
    config.write_text(CONFIG.format(edition=str(edition.resolve())))
    written = []
    slugs = (["00_setup_and_the_gpu"] if a.first == 1 else []) + [st.slug for st in a.stages()]
    slugs += sorted({ex.home for ex in a.exercises(root)} - set(slugs))  # a lab's own notebook (98)
    for slug in slugs:
        nb_path = root / "notebooks" / f"{slug}.ipynb"
        if not nb_path.is_file():
            continue
        nb = apply(nbformat.read(nb_path, as_version=4), slug)
        nbformat.write(nb, source / nb_path.name)
        written.append(nb_path.name)
    labs = [ex.id for ex in a.exercises(root) if ex.kind == "lab"]
    return (f"wrote {source}: {', '.join(written)} (labs {', '.join(labs) or 'none'}), "
            f"{config.name} and the edition nbgrader runs them against, {edition.name}/\n"
            f"next: cd {dest} && nbgrader generate_assignment {name}  (the release is "
            f"release/{name}/); hand students the edition too ({edition.name}/, its STUDENT.md): "
            "its package and kernels are what the notebooks use, and its notebooks/ is where "
            "they put the release's")
