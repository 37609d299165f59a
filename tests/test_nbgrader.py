"""nbgrader, for real: the solution notebooks carry nbgrader's cell metadata by flashlab's rules
(flashlab.course.nbgrader), nbgrader's own validator accepts them, and an nbgrader course folder
written by `flashlab nbgrader` runs generate_assignment, autograde and generate_feedback with no
flags: the release holds no solution and no instructor's answer, a solution submission scores
full marks and a blank one zero."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashlab import paths
from flashlab.course import nbgrader as fl_nbgrader
from flashlab.course import nbtext, student
from flashlab.course.labs import LABS

NOTEBOOKS = sorted((paths.ROOT / "notebooks").glob("*.ipynb"))
LAB_NOTEBOOKS = sorted({ex.home for ex in LABS})


def _nbgrader():
    return pytest.importorskip("nbgrader")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_committed_notebooks_carry_the_rules_metadata(path):
    nb = nbformat.read(path, as_version=4)
    want = fl_nbgrader.cell_metadata(nb.cells, path.stem)
    got = [c.metadata.get("nbgrader") for c in nb.cells]
    assert got == want, "run `python tools/notebooks.py build` to apply flashlab.course.nbgrader"


@pytest.mark.parametrize("slug", LAB_NOTEBOOKS)
def test_each_lab_is_a_read_only_prompt_an_answer_and_an_autograded_check(slug):
    _nbgrader()
    from nbgrader.nbgraderformat import MetadataValidator
    nb = nbformat.read(paths.ROOT / "notebooks" / f"{slug}.ipynb", as_version=4)
    MetadataValidator().validate_nb(nb)       # nbgrader's own rules: ids unique, points, ...
    meta = {c.metadata["nbgrader"]["grade_id"]: c.metadata["nbgrader"] for c in nb.cells
            if "nbgrader" in c.metadata}
    for ex in (ex for ex in LABS if ex.home == slug):
        gid = fl_nbgrader.grade_id(ex.id)
        assert meta[f"{gid}-prompt"]["locked"] and not meta[f"{gid}-prompt"]["grade"]
        assert meta[gid]["solution"] and not meta[gid]["grade"]
        check = meta[f"{gid}-check"]
        assert check["grade"] and check["locked"] and check["points"] == ex.points
    answers = [m for m in meta.values() if m["grade_id"].startswith(f"{slug[:2]}-answer-")]
    assert answers and all(m["solution"] and m["grade"] and m["points"] == 0 for m in answers)


def _run(cmd, cwd):
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *cmd], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    assert proc.returncode == 0, f"nbgrader {' '.join(cmd)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_an_nbgrader_course_releases_autogrades_and_gives_feedback(tmp_path):
    _nbgrader()
    course = tmp_path / "course"
    summary = fl_nbgrader.write_course(course, through=2, first=1)
    name = fl_nbgrader.assignment_name(student.assignment(2, 1))
    assert f"generate_assignment {name}" in summary
    _run(["generate_assignment", name], course)
    release = course / "release" / name
    labs = [ex for ex in LABS if ex.stage in ("01_naive", "02_coalesced")]
    for nb_path in sorted(release.glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        for cell in nb.cells:
            assert nbtext.BEGIN_SOLUTION not in cell.source and nbtext.INSTRUCTOR not in cell.source
        source = nbformat.read(course / "source" / name / nb_path.name, as_version=4)
        for cell in source.cells:
            if cell.cell_type == "markdown" and nbtext.instructor_answer(cell.source):
                assert all(cell.source not in c.source for c in nb.cells)
    for who, folder in (("solution", course / "source" / name), ("blank", release)):
        dest = course / "submitted" / who / name
        dest.mkdir(parents=True)
        for nb_path in folder.glob("*.ipynb"):
            shutil.copyfile(nb_path, dest / nb_path.name)
    _run(["autograde", name], course)
    _run(["generate_feedback", name], course)
    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        full = sum(ex.points for ex in labs)
        sol = gb.find_submission(name, "solution")
        blank = gb.find_submission(name, "blank")
        assert (sol.code_score, sol.max_code_score) == (full, full)
        assert (blank.code_score, blank.max_code_score) == (0, full)
    for who in ("solution", "blank"):
        assert list((course / "feedback" / who / name).glob("*.html"))
    # the notebooks ran against the edition: a cell that shows a kernel showed the student's
    # stub, so no feedback holds a handed-out kernel exercise's solution
    import html
    from flashlab import markers
    from flashlab.course import kernels
    secrets = [(r.id, piece) for r in markers.exercises_in(
        (paths.ROOT / "kernels" / "02_coalesced.cu").read_text())
        for line in markers.solution_lines(r) for piece in [line, *markers.fragments(line)]]
    assert secrets and kernels.KERNEL_EXERCISES
    shown_stub = False
    for page in (course / "feedback").rglob("*.html"):
        text = markers.plain(html.unescape(page.read_text()))
        assert not [s for _, s in secrets if s in text], page
        shown_stub |= "one thread writes zeros" in text      # 02's stub, as the student has it
    assert shown_stub
