"""A class, played end to end on a CPU machine, from what each person receives.

The instructor clones the solution repository and writes assignment 01-02's edition from that
clone. Each student installs the edition in a fresh virtual environment exactly as its
STUDENT.md says (for a laptop without an NVIDIA GPU; the CPU wheel of PyTorch comes from this
machine's disk, as CI cannot reach download.pytorch.org), works in the notebooks, checks their
work with `flashlab grade`, and hands in: by a git repository the instructor clones, or by the
bare .ipynb files as Colab downloads them. Five students: every answer right; typical wrong
answers; blanks; a cell that loops forever; a cell that replaces the checker and answers
nonsense. The instructor grades the folder of hand-ins: full, partial, zero, a timeout and zero,
without hanging; the leaderboard, built from the gradebook, agrees with it.
"""
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import nbformat
import pytest

from flashlab import paths
from flashlab.course import nbtext

LABS = ("01.bank_wavefronts", "02.sectors")
GIT_ENV = {"GIT_AUTHOR_NAME": "s", "GIT_AUTHOR_EMAIL": "s@example.org",
           "GIT_COMMITTER_NAME": "s", "GIT_COMMITTER_EMAIL": "s@example.org"}


def sh(cmd, cwd, env=None, timeout=900, ok=True):
    # a student's or an instructor's shell: no PYTHONPATH pointing into a checkout (a suite run
    # in a copy of the repository sets one), so each imports the flashlab it installed
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**base, **GIT_ENV, **(env or {})}, shell=isinstance(cmd, str))
    if ok:
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def laptop_install(guide: str) -> list:
    """The commands STUDENT.md gives for a laptop without an NVIDIA GPU, in order."""
    part = guide.split("**A laptop without an NVIDIA GPU**", 1)[1].split("**A machine with", 1)[0]
    return [ln.strip() for ln in part.splitlines() if ln.strip().startswith("pip install")]


def right_answers():
    """{lab: the solution's answer code}, from the solution notebooks."""
    out = {}
    for lab in LABS:
        nb = nbformat.read(paths.ROOT / "notebooks" / f"{_slug(lab)}.ipynb", as_version=4)
        for cell in nb.cells:
            regions = nbtext.solution_regions(cell.source)
            if regions and lab in _labs_near(nb.cells, cell):
                out[lab] = "\n".join(regions[0])
    assert set(out) == set(LABS)
    return out


def _slug(lab):
    return {"01": "01_naive", "02": "02_coalesced"}[lab[:2]]


def _labs_near(cells, cell):
    i = cells.index(cell)
    return {nbtext.lab_of(c.source) for c in cells[i:i + 2]}


def answer(edition: Path, lab: str, code: str):
    """Put `code` in lab's answer cell of the student's .ipynb (what Jupyter or Colab saves)."""
    path = edition / "notebooks" / f"{_slug(lab)}.ipynb"
    nb = nbformat.read(path, as_version=4)
    cells = nb.cells
    i = next(i for i, c in enumerate(cells) if nbtext.lab_of(c.source) == lab)
    target = cells[i - 1] if "YOUR CODE HERE" in cells[i - 1].source else cells[i]
    assert "YOUR CODE HERE" in target.source
    target.source = target.source.replace("# YOUR CODE HERE\nraise NotImplementedError()", code)
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    """The instructor's clean clone of the solution repository."""
    clone = tmp_path_factory.mktemp("instructor") / "flashlab"
    sh(["git", "clone", "-q", str(paths.ROOT), str(clone)], cwd=clone.parent)
    return clone


@pytest.fixture(scope="module")
def laptop(tmp_path_factory):
    """A fresh virtual environment: the student's, with nothing of the solution in it."""
    home = tmp_path_factory.mktemp("laptop")
    venv.create(home / ".venv", with_pip=True)
    return home / ".venv" / "bin"


@pytest.mark.slow
def test_a_class_end_to_end(solution, laptop, tmp_path):
    flashlab = [sys.executable, "-m", "flashlab"]          # the instructor's, in the clone
    edition = tmp_path / "assignment-01-02"
    sh(flashlab + ["student", str(edition), "--through", "02", "--from", "01"], cwd=solution)
    guide = (edition / "STUDENT.md").read_text()
    steps = laptop_install(guide)
    assert steps[0] == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert steps[1:] == ['pip install -e ".[notebooks]"'], steps

    # Students: each starts from the edition (a repository of their own), installs it in the
    # fresh environment as STUDENT.md says, and works in the .ipynb files.
    sh([str(laptop / "python"), "-m", "pip", "install", "-q", "torch==2.13.0"], cwd=tmp_path,
       timeout=1200)
    right = right_answers()
    work = {
        "ada": {lab: right[lab] for lab in LABS},                   # every answer right
        "ben": {LABS[0]: right[LABS[0]], LABS[1]: "answer = 4"},    # a typical wrong one
        "cal": {},                                                  # blanks
        "dee": {LABS[1]: "while True:\n    pass"},                  # a loop that never ends
        "eve": {LABS[1]: "labs.answer_check = lambda *a, **k: None\n"
                         "labs.check = lambda *a, **k: print('02.sectors: RIGHT.')\n"
                         "answer = 1540"},                          # replaces the checker
    }
    handins = tmp_path / "handins"
    handins.mkdir()
    for name, answers in work.items():
        mine = tmp_path / "students" / name
        shutil.copytree(edition, mine)
        sh("git init -q && git add -A && git commit -qm 'as handed out'", cwd=mine)
        for lab, code in answers.items():
            answer(mine, lab, code)
        sh("git commit -qam 'my answers' --allow-empty", cwd=mine)
        if name in ("cal", "eve"):        # Colab: the notebooks, downloaded
            (handins / name).mkdir()
            for nb in (mine / "notebooks").glob("0[12]_*.ipynb"):
                shutil.copyfile(nb, handins / name / nb.name)
        else:                             # a repository, cloned by the instructor
            sh(["git", "clone", "-q", str(mine), str(handins / name)], cwd=tmp_path)

    # One student installs the edition as STUDENT.md says and checks their work.
    ada = tmp_path / "students" / "ada"
    sh([str(laptop / "python"), "-m"] + steps[1].replace('".[notebooks]"', ".[notebooks]").split(),
       cwd=ada, timeout=1200)
    mine = sh([str(laptop / "flashlab"), "grade"], cwd=ada, timeout=600)
    assert re.search(r"01\.bank_wavefronts\s+lab\s+2\s+2\s+right", mine.stdout), mine.stdout
    assert re.search(r"02\.sectors\s+lab\s+2\s+2\s+right", mine.stdout), mine.stdout
    assert re.search(r"02\.tile_copy\s+kernel\s+10\s+-\s+skipped", mine.stdout), mine.stdout
    where = sh([str(laptop / "python"), "-c", "import flashlab; print(flashlab.__file__)"], cwd=tmp_path)
    assert str(ada) in where.stdout                        # the edition, not the solution

    # The instructor grades the hand-ins.
    grades = tmp_path / "grades"
    proc = sh(flashlab + ["grade", "--class", str(handins), "--edition", str(edition), "--out",
                          str(grades), "--jobs", "2", "--cell-timeout", "60", "--timeout", "400"],
              cwd=solution, timeout=900)
    print(proc.stdout)
    with open(grades / "gradebook.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    book = {(r["student"], r["exercise"]): r for r in rows}
    verdicts = {s: [book[(s, lab)]["verdict"] for lab in LABS] for s in work}
    assert verdicts == {"ada": ["right", "right"], "ben": ["right", "wrong"],
                        "cal": ["blank", "blank"], "dee": ["blank", "timeout"],
                        "eve": ["blank", "wrong"]}, verdicts
    total = {s: sum(float(book[(s, lab)]["points"]) for lab in LABS) for s in work}
    assert total == {"ada": 4, "ben": 2, "cal": 0, "dee": 0, "eve": 0}
    kernel = {s: book[(s, "02.tile_copy")] for s in work}
    assert all(kernel[s]["verdict"] == "skipped" for s in ("ada", "ben", "dee"))   # no GPU here
    assert all(kernel[s]["verdict"] == "blank" and "no 02_coalesced.cu was handed in" in
               kernel[s]["why"] for s in ("cal", "eve"))                        # notebooks only
    assert book[("eve", "02.sectors")]["why"].startswith("Wrong: you said 1 540")
    from flashlab.course import labkeys
    wrong = book[("ben", "02.sectors")]["why"]
    assert wrong.startswith("Wrong: you said 4")            # why, without the right answer
    assert not labkeys.leaks("02.sectors", wrong, list(labkeys.key("02.sectors").right))
    feedback = (grades / "feedback" / "dee.md").read_text()
    assert "timeout" in feedback and "0 of 4 points" in feedback and "1 not graded here" in feedback

    board = sh(flashlab + ["leaderboard", str(grades / "gradebook.csv"), "--out",
                           str(tmp_path / "lb")], cwd=solution)
    ranked = list(csv.DictReader(open(tmp_path / "lb" / "leaderboard.csv")))
    assert {r["student"]: float(r["total"]) for r in ranked} == total
    assert [r["student"] for r in ranked][0] == "ada" and "ada" in board.stdout
