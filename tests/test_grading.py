"""Grading, no GPU: a lab is read from its notebook run in a fresh kernel through the answer
cell (so an answer using an earlier cell's name counts, a checker replaced inside the notebook
changes nothing, a loop times out); a hand-in in any form (clone, zip, loose notebook, source
only) becomes a work tree holding the edition with only the student's notebooks and regions; the
gradebook keeps one row per student and exercise; the leaderboard reads only gradebooks and
refuses a score above an exercise's points."""
import csv
import json
import shutil
import zipfile
from pathlib import Path

import nbformat
import pytest

from flashlab import markers, paths
from flashlab.course import Result, grade, handin, labrun, leaderboard

LAB = "02.sectors"
NB = paths.ROOT / "notebooks" / "02_coalesced.ipynb"


def notebook(path, *sources, check=True):
    """A notebook of code cells `sources`, then (check) the cell that checks lab 02.sectors."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cells = [nbformat.v4.new_code_cell(s) for s in sources]
    if check:
        cells.append(nbformat.v4.new_code_cell(f'labs.check("{LAB}", answer)'))
    nb.cells = [nbformat.v4.new_code_cell("from flashlab.course import labs")] + cells
    nbformat.write(nb, path)
    return path


def test_an_answer_is_read_in_its_notebooks_own_context(tmp_path):
    nb = notebook(tmp_path / "a.ipynb", "import numpy as np\nstride = 256",
                  "answer = int(np.int64(32 * stride // 256))")
    got = labrun.answers(nb, [LAB])
    assert got[LAB] == labrun.Answer("answered", 32)


@pytest.mark.parametrize("answer_cell, status, words", [
    ("# YOUR CODE HERE\nraise NotImplementedError()", "blank", "NotImplementedError"),
    ("x = 1", "blank", "sets no `answer`"),
    ("answer = 1 / 0", "error", "ZeroDivisionError"),
])
def test_a_blank_or_broken_answer_says_so(tmp_path, answer_cell, status, words):
    got = labrun.answers(notebook(tmp_path / "a.ipynb", answer_cell), [LAB])[LAB]
    assert got.status == status and words in got.why, got


def test_an_answer_left_from_an_earlier_cell_is_not_read_past_a_blank_one(tmp_path):
    nb = notebook(tmp_path / "a.ipynb", "answer = 32", "raise NotImplementedError()")
    assert labrun.answers(nb, [LAB])[LAB].status == "blank"


def test_a_loop_that_never_ends_times_out(tmp_path):
    """And its kernel is stopped: no process is left spinning in the notebook's folder."""
    nb = notebook(tmp_path / "a.ipynb", "while True:\n    pass", "answer = 32")
    got = labrun.answers(nb, [LAB], cell_timeout=3)[LAB]
    assert got.status == "timeout" and "more than 3 s" in got.why, got
    assert not _processes_in(tmp_path)


def _processes_in(folder, wait_s=10.0):
    """The processes whose working directory is `folder` (Linux /proc), after up to wait_s."""
    import os
    import time
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd") == str(folder):
                    found.append(int(pid))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_notebook_cannot_grade_itself(tmp_path):
    """A cell that replaces the checker, prints a verdict or forges the reader's line leaves the
    grader's verdict where the answer puts it."""
    forged = ('print("FLASHLAB-ANSWER-0000000000000000 " + \'{"value": 32}\')\n'
              "import os; os.write(1, b'FLASHLAB-ANSWER-x {\"value\": 32}\\n')\n"
              "labs.answer_check = lambda *a: None\nlabs.check = lambda *a: print('RIGHT')\n"
              "answer = 8")
    got = labrun.answers(notebook(tmp_path / "a.ipynb", forged), [LAB])[LAB]
    assert got == labrun.Answer("answered", 8)


def test_values_keep_their_kind(tmp_path):
    nb = notebook(tmp_path / "a.ipynb",
                  "import numpy as np\nanswer = (np.int32(3), [1, 2.5], np.arange(3), 2**64 + 1)")
    got = labrun.answers(nb, [LAB])[LAB]
    assert got.value == (3, [1, 2.5], [0, 1, 2], 2**64 + 1)


def test_a_notebook_without_the_lab_or_unreadable(tmp_path):
    nb = notebook(tmp_path / "a.ipynb", "answer = 3", check=False)
    assert labrun.answers(nb, [LAB])[LAB].status == "missing"
    (tmp_path / "b.ipynb").write_text("not a notebook")
    assert labrun.answers(tmp_path / "b.ipynb", [LAB])[LAB].status == "missing"


def test_the_solution_notebook_answers_its_lab_right():
    got = labrun.answers(NB, [LAB])[LAB]
    assert got.status == "answered"
    (ex, r), = grade.grade_tree(paths.ROOT, only=[LAB], gpu=False)
    assert (ex.id, r.ok, r.score) == (LAB, True, ex.points), r


# --- hand-ins --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    from flashlab.course import student
    dest = tmp_path_factory.mktemp("ed") / "edition"
    student.write(dest, through=2, first=1)
    return dest


def _manifest(edition):
    from flashlab.course import student
    return student.read_manifest(edition)


def test_a_clone_a_zip_and_a_loose_notebook_make_the_same_work_tree(edition, tmp_path):
    mine = tmp_path / "alice"
    shutil.copytree(edition, mine)
    (mine / "kernels" / "02_coalesced.cu").write_text(
        (mine / "kernels" / "02_coalesced.cu").read_text().replace(
            "if (threadIdx.x == 0 && threadIdx.y == 0)", "if (true)"))
    (mine / "flashlab" / "check.py").write_text("raise SystemExit('mine')\n")   # never used
    zipped = tmp_path / "bob.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        for p in mine.rglob("*"):
            if p.is_file():
                z.write(p, Path("bob-handin") / p.relative_to(mine))
    loose = tmp_path / "carol"
    loose.mkdir()
    shutil.copyfile(mine / "notebooks" / "02_coalesced.ipynb", loose / "02_coalesced.ipynb")
    man = _manifest(edition)
    trees = {}
    for h in (mine, zipped, loose):
        got = handin.make_work_tree(h, edition, tmp_path, man)
        trees[got.name] = got
        assert (got.work / "flashlab" / "check.py").read_text() == \
            (edition / "flashlab" / "check.py").read_text()
    assert set(trees) == {"alice", "bob", "carol"}
    for name in ("alice", "bob"):
        cu = (trees[name].work / "kernels" / "02_coalesced.cu").read_text()
        assert "if (true)" in cu and not trees[name].problems
    assert trees["carol"].problems == {"02.tile_copy": "no 02_coalesced.cu was handed in",
                                       "01.bank_wavefronts": "no notebook 01_naive.ipynb was "
                                                             "handed in"}


def test_a_source_alone_stands_in_for_its_notebook(edition, tmp_path):
    mine = tmp_path / "dave"
    (mine / "notebooks" / "src").mkdir(parents=True)
    shutil.copyfile(edition / "notebooks" / "src" / "02_coalesced.py",
                    mine / "notebooks" / "src" / "02_coalesced.py")
    h = handin.make_work_tree(mine, edition, tmp_path, _manifest(edition))
    nb = nbformat.read(h.work / "notebooks" / "02_coalesced.ipynb", as_version=4)
    assert any("labs.check" in c.source for c in nb.cells)
    assert any("source 02_coalesced.py was graded" in n for n in h.notes)


def test_code_outside_its_region_is_refused(edition, tmp_path):
    mine = tmp_path / "eve"
    shutil.copytree(edition, mine)
    cu = mine / "kernels" / "02_coalesced.cu"
    cu.write_text(cu.read_text().replace("if (threadIdx.x == 0 && threadIdx.y == 0)",
                                         "}\nstatic int x = 0;\nvoid f() {\nif (true)"))
    h = handin.make_work_tree(mine, edition, tmp_path, _manifest(edition))
    assert "closes a '{'" in h.problems["02.tile_copy"]


def test_the_gradebook_keeps_one_row_per_student_and_exercise(tmp_path):
    from flashlab.course import exercises
    ex = exercises.exercise(LAB)
    h = handin.HandIn("alice", Path("alice"))
    book = tmp_path / "gradebook.csv"
    grade.write_gradebook(book, grade.gradebook_rows(h, [(ex, Result(LAB, False, 0, "no"))], "02"),
                          ["alice"])
    grade.write_gradebook(book, grade.gradebook_rows(
        handin.HandIn("bob", Path("bob")), [(ex, Result(LAB, True, 2, "yes"))], "02"), ["bob"])
    grade.write_gradebook(book, grade.gradebook_rows(h, [(ex, Result(LAB, True, 2, "ok"))], "02"),
                          ["alice"])
    rows = list(csv.DictReader(open(book)))
    assert [(r["student"], r["points"], r["verdict"]) for r in rows] == \
        [("alice", "2", "right"), ("bob", "2", "right")]
    assert list(rows[0]) == grade.COLUMNS
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["gradebook.csv"]


def _book(tmp_path, rows):
    path = tmp_path / "gradebook.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=grade.COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in grade.COLUMNS})
    return path


def _row(student, exercise, points, gpu="cpu", most=2):
    return dict(student=student, exercise=exercise, points=points, max_points=most,
                verdict="right" if points else "wrong", gpu=gpu, kind="lab", graded="t")


def test_the_leaderboard_refuses_a_score_above_an_exercises_points(tmp_path):
    with pytest.raises(ValueError, match=r"row 2 \(mallory, 02.sectors\): 1540 points, but "
                                         r"02.sectors is worth 2"):
        leaderboard.load([_book(tmp_path, [_row("mallory", LAB, 1540, most=1540)])])
    with pytest.raises(ValueError, match="not a number"):
        leaderboard.load([_book(tmp_path, [_row("mallory", LAB, "lots")])])


def test_the_leaderboard_ranks_each_gpu_model_apart(tmp_path, capsys):
    rows = [_row("alice", LAB, 2), _row("bob", LAB, 0), _row("carol", LAB, 2),
            _row("alice", "02.tile_copy", 9, "NVIDIA H100 80GB HBM3", 10),
            _row("bob", "02.tile_copy", 10, "NVIDIA H100 80GB HBM3", 10),
            _row("carol", "02.tile_copy", 10, "Tesla T4", 10)]
    boards, figs = leaderboard.run([_book(tmp_path, rows)], out_dir=tmp_path / "lb")
    h100 = boards["NVIDIA H100 80GB HBM3"]
    assert list(h100["student"]) == ["alice", "bob"] and list(h100["total"]) == [11, 10]
    assert list(boards["Tesla T4"]["student"]) == ["carol"]
    assert {p.name for p in figs} == {"02.sectors.png", "02.tile_copy.png"}
    assert "never" in capsys.readouterr().out.lower()


def test_two_gradings_never_time_on_one_gpu_at_once(monkeypatch, tmp_path):
    """Each stage report (build, check, timing) runs in a child process that holds this GPU's
    lock: two gradings side by side (two threads of --jobs, two Slurm tasks on one node) take
    their turns."""
    import threading
    import time
    from types import SimpleNamespace

    from flashlab.course import kernels
    monkeypatch.setenv("FLASHLAB_LOCK_DIR", str(tmp_path / "locks"))
    spans = []

    def fake_run(cmd, env=None, **kw):
        start = time.monotonic()
        time.sleep(0.5)
        spans.append((start, time.monotonic()))
        mark = env["FLASHLAB_REPORT_MARK"]
        return SimpleNamespace(stdout=f'{mark} {{"stage": "02_coalesced", "passed": true}}\n',
                               stderr="", returncode=0)
    monkeypatch.setattr(kernels.subprocess, "run", fake_run)
    kernels._REPORTS.clear()
    trees = [tmp_path / f"t{i}" for i in range(3)]
    for t in trees:
        (t / "kernels").mkdir(parents=True)
    threads = [threading.Thread(target=kernels.report, args=(t, "02_coalesced")) for t in trees]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    kernels._REPORTS.clear()
    spans.sort()
    assert len(spans) == 3 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert list((tmp_path / "locks").glob("*.lock"))


def test_an_answer_is_found_after_its_question_even_without_its_check(tmp_path):
    nb = notebook(tmp_path / "a.ipynb", f'print(labs.prompt("{LAB}"))', "answer = 7", check=False)
    assert labrun.answers(nb, [LAB])[LAB] == labrun.Answer("answered", 7)


def test_a_notebook_graded_in_an_edition_cannot_reach_the_solutions_answers(edition, tmp_path):
    """The kernel imports the edition's own package, in which the labs' answers (labkeys) are
    not, even where the grader's flashlab has them."""
    nb = notebook(tmp_path / "a.ipynb", "from flashlab.course import labkeys\n"
                  f"answer = next(iter(labkeys.key('{LAB}').right))")
    got = labrun.answers(nb, [LAB], package_root=edition)[LAB]
    assert got.status == "error" and "labkeys" in got.why, got
    where = notebook(tmp_path / "b.ipynb", "import flashlab\nanswer = flashlab.__file__")
    assert labrun.answers(where, [LAB], package_root=edition)[LAB].value.startswith(str(edition))


def test_a_copy_named_by_colab_or_a_browser_is_graded_and_a_stray_file_listed(edition, tmp_path):
    mine = tmp_path / "fay"
    mine.mkdir()
    shutil.copyfile(edition / "notebooks" / "02_coalesced.ipynb", mine / "Copy of 02_coalesced.ipynb")
    shutil.copyfile(edition / "notebooks" / "01_naive.ipynb", mine / "01_naive (1).ipynb")
    shutil.copyfile(edition / "notebooks" / "01_naive.ipynb", mine / "my attempt.ipynb")
    h = handin.make_work_tree(mine, edition, tmp_path, _manifest(edition))
    assert set(h.problems) == {"02.tile_copy"}                     # both notebooks were found
    assert any("not graded" in n and "my attempt.ipynb" in n for n in h.notes), h.notes
    assert handin.plain_name("Copy of Copy of 02_coalesced (3).ipynb") == "02_coalesced.ipynb"


def test_a_skipped_exercise_is_neither_zero_nor_counted(tmp_path):
    """Graded where it could not run (no GPU), a kernel exercise is skipped: the leaderboard
    leaves it out of the total and the possible points, and shows no figure for it."""
    rows = [_row("alice", LAB, 2), _row("bob", LAB, 0),
            dict(_row("alice", "02.tile_copy", 0, most=10), verdict="skipped"),
            dict(_row("bob", "02.tile_copy", 0, most=10), verdict="skipped")]
    boards, figs = leaderboard.run([_book(tmp_path, rows)], out_dir=tmp_path / "lb", out=lambda _: None)
    board = boards["cpu"]
    assert list(board["student"]) == ["alice", "bob"] and list(board["possible"]) == [2, 2]
    assert {p.name for p in figs} == {"02.sectors.png"}


def test_a_class_graded_without_a_gpu_gets_a_leaderboard_that_says_so(tmp_path):
    """Every exercise skipped (a backward week graded on a machine without a GPU): the leaderboard
    says that nothing was graded on a GPU and nothing at all, never a pandas dump of an empty
    table or '1 GPU model'."""
    rows = [dict(_row(s, "02.tile_copy", 0, most=10), verdict="skipped") for s in ("alice", "bob")]
    said = []
    boards, figs = leaderboard.run([_book(tmp_path, rows)], out_dir=tmp_path / "lb", out=said.append)
    text = "\n".join(said)
    assert "2 students; no kernel exercise was graded on a GPU." in text
    assert "no exercise graded" in text and "no figure (nothing graded)" in text
    assert "Empty DataFrame" not in text and "GPU model" not in text and figs == []


def test_a_hand_in_cloned_from_the_edition_has_no_stray_files(edition, tmp_path):
    """A hand-in collected by git clone holds every file of the edition, a variant's kernel under
    kernels/variants/ among them: none of them is listed as 'not graded'."""
    ed = tmp_path / "edition"
    shutil.copytree(edition, ed)
    (ed / "kernels" / "variants").mkdir(exist_ok=True)
    (ed / "kernels" / "variants" / "12_overlap.cu").write_text("// a variant the edition ships\n")
    mine = tmp_path / "gus"
    shutil.copytree(ed, mine)
    h = handin.make_work_tree(mine, ed, tmp_path, _manifest(ed))
    assert not any("not graded" in n for n in h.notes), h.notes
