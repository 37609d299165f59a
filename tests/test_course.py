"""The course layer (flashlab.course), no GPU: the exercises are registered in stage order (the
CPU labs' own tests are in tests/test_labs.py, grading's in tests/test_grading.py), grading an
edition reads each lab from its notebook and skips the kernel exercises with a reason, and the
commands parse and reach the course through the `flashlab` entry point."""
from pathlib import Path

import pytest

from flashlab import __main__ as entry
from flashlab import cli
from flashlab.course import Exercise, exercises, grade, labs
from flashlab.course import cli as course_cli


def test_the_labs_are_registered_in_stage_order():
    assert [ex.id for ex in labs.LABS] == ["01.bank_wavefronts", "02.sectors", "03.occupancy",
                                           "05.fragment_owner", "06.bank_map",
                                           "07.pipeline_period", "08.tuning", "09.descriptor",
                                           "10.parity", "11.registers", "12.store_sectors",
                                           "13.lazy_bound", "98.merge", "98.balance", "98.hide"]
    assert all(ex.kind == "lab" and ex.points > 0 and ex.title.endswith("?") for ex in labs.LABS)
    stages = [ex.stage for ex in exercises.EXERCISES]
    assert stages == sorted(stages)
    assert set(labs.LABS) <= set(exercises.EXERCISES)
    for ex in labs.LABS:
        assert exercises.exercise(ex.id) is ex and "Set `answer`" in labs.prompt(ex.id)
    with pytest.raises(ValueError, match="02.sectors"):
        exercises.exercise("02.nope")


def test_the_lab_tests_live_in_test_labs():
    """The CPU labs' own tests (right and wrong, the keys, the notebooks' cells) are in
    tests/test_labs.py; here, how the course uses them."""
    assert (Path(__file__).parent / "test_labs.py").is_file()
    assert callable(labs.answer_check) and issubclass(labs.LabWrong, AssertionError)


# ---------------------------------------------------------------- grading an edition

SOLVED = """\
# %% [markdown]
# # Stage 02
# A markdown cell that mentions labs.check("02.sectors", 1) is not the check cell.

# %%
# %matplotlib inline
from flashlab.course import labs
print(labs.prompt("02.sectors"))

# %%
### BEGIN SOLUTION
print("working it out")
answer = 40 // 8
### END SOLUTION
labs.check("02.sectors", answer)
"""
STUB = """\
# %%
# YOUR CODE HERE
raise NotImplementedError()
labs.check("03.occupancy", answer)
"""
NO_MARKERS = """\
# %%
S = np.arange(128).reshape(16, 8)
answer = [10]
labs.check('05.fragment_owner', answer)
"""


@pytest.fixture
def edition(tmp_path):
    """A fake edition: notebook sources for three labs, nothing for the others."""
    root = tmp_path / "edition"
    (root / "notebooks" / "src").mkdir(parents=True)
    (root / "kernels").mkdir()
    (root / "notebooks" / "src" / "02_coalesced.py").write_text(SOLVED)
    (root / "notebooks" / "src" / "03_coarsened.py").write_text(STUB)
    (root / "notebooks" / "src" / "05_mma.py").write_text(NO_MARKERS)
    return root


KERNEL = Exercise("03.fake_kernel", "03_coarsened", "kernel", "write stage 03's coarsening?", 5)


def test_grade_an_edition_without_a_gpu(edition, monkeypatch, capsys):
    """Each lab from its notebook (a source alone stands in for it), run in a fresh Python: right,
    blank, wrong, and no notebook at all; the kernel exercises skipped in one line."""
    monkeypatch.setattr(exercises, "EXERCISES", exercises.EXERCISES + (KERNEL,))
    graded = grade.run(edition, gpu=False)
    by_id = {ex.id: r for ex, r in graded}
    assert by_id["02.sectors"].ok and by_id["02.sectors"].score == 2
    assert by_id["03.occupancy"].verdict == "blank" and by_id["03.occupancy"].score == 0
    assert by_id["05.fragment_owner"].verdict == "wrong"
    assert by_id["06.bank_map"].ok is False and "no notebook" in by_id["06.bank_map"].message
    kernels = [r for ex, r in graded if ex.kind == "kernel"]
    assert kernels and all(r.ok is None and r.message == grade.NO_GPU for r in kernels)
    out = capsys.readouterr().out
    assert "exercise" in out and "verdict" in out and "02.sectors" in out
    assert f"skipped {len(kernels)} (" in out and "no CUDA GPU here" in out
    assert out.count("no CUDA GPU here") == 1                  # one line, however many kernels
    assert not (edition / "submissions").exists()              # nothing self-reported is written


def test_a_failing_grader_does_not_stop_the_others(monkeypatch, edition):
    from flashlab.course import kernels

    def boom(ex, root, solution=None):
        raise RuntimeError("nvcc exploded")
    monkeypatch.setattr(exercises, "EXERCISES", exercises.EXERCISES + (KERNEL,))
    monkeypatch.setattr(kernels, "grade_kernel", boom)
    (ex, r), = grade.grade_tree(edition, only=[KERNEL.id], gpu=True)
    assert r.ok is False and r.score == 0 and "nvcc exploded" in r.message


# ---------------------------------------------------------------- the commands

def test_the_course_commands_parse():
    ap = course_cli.parser()
    a = ap.parse_args(["grade", "ed", "--exercise", "02.sectors", "--exercise", "01.bank_wavefronts"])
    assert (a.command, a.dir, a.exercise) == ("grade", "ed", ["02.sectors", "01.bank_wavefronts"])
    assert ap.parse_args(["grade"]).dir == "."
    a = ap.parse_args(["grade", "--class", "handins", "--edition", "week3", "--student", "ada",
                       "--jobs", "4", "--timeout", "600", "--cell-timeout", "30"])
    assert (a.handins, a.edition, a.student, a.jobs, a.timeout, a.cell_timeout) == \
        ("handins", "week3", ["ada"], 4, 600, 30)
    a = ap.parse_args(["leaderboard", "grades/gradebook.csv", "class/", "--out", "board"])
    assert (a.inputs, a.out) == (["grades/gradebook.csv", "class/"], "board")
    a = ap.parse_args(["student", "week3", "--through", "06", "--from", "05", "--force"])
    assert (a.dir, a.through, a.first, a.force) == ("week3", "06", "05", True)
    a = ap.parse_args(["nbgrader", "course", "--through", "02"])
    assert (a.dir, a.through, a.first) == ("course", "02", None)
    listed = {usage.split()[1] for usage, _ in cli.COMMANDS}
    assert set(course_cli.COMMANDS) <= listed
    for name in course_cli.COMMANDS:
        assert f"flashlab {name}" in cli.command_list()


def test_the_entry_point_reaches_the_course(edition, monkeypatch, capsys):
    monkeypatch.setattr(grade, "gpu_available", lambda: False)
    assert entry.main(["grade", str(edition), "--exercise", "02.sectors"]) == 0
    assert "02.sectors" in capsys.readouterr().out
    assert entry.main(["grade", str(edition), "--exercise", "99.none"]) == 2
    assert "99.none: not an exercise of this edition" in capsys.readouterr().err
    assert entry.main(["grade", "--class", str(edition)]) == 2
    assert "--class needs --edition" in capsys.readouterr().err
    assert entry.main(["list"]) == 0                         # the other commands: flashlab.cli
    assert "01_naive" in capsys.readouterr().out
    assert cli.main(["grade"]) == 2                          # the tools layer only lists them
    assert "python -m flashlab grade" in capsys.readouterr().err
    text = (Path(cli.__file__).parent.parent / "pyproject.toml").read_text()
    assert 'flashlab = "flashlab.__main__:main"' in text and '"flashlab.course"' in text


def test_the_layers_hold_with_the_course_on_top():
    import test_layers
    assert test_layers.layer("flashlab.course.grade") == "course"
    assert test_layers.layer("flashlab.__main__") == "course"
    test_layers.test_every_module_has_a_layer()
    test_layers.test_no_module_imports_a_layer_above_its_own()
    test_layers.test_no_import_cycles()
    test_layers.test_the_course_layer_is_on_top()


def test_a_lab_of_a_notebook_about_no_one_stage():
    """Notebook 98 (ring attention) is no stage: its labs are handed out with the stage it builds
    on (20), are answered in it, and it is in an edition from that stage on."""
    from flashlab.course import Exercise, student
    ring = [ex for ex in labs.LABS if ex.id.startswith("98.")]
    assert ring and {(ex.stage, ex.home) for ex in ring} == {("20_warpspec_backward",
                                                               "98_ring_attention")}
    assert set(ring) <= set(student.assignment(21, 20).exercises())
    assert not set(ring) & set(student.assignment(19, 14).exercises())
    assert student.left_out("notebooks/98_ring_attention.ipynb", student.assignment(19)) is not None
    assert student.left_out("notebooks/98_ring_attention.ipynb", student.assignment(20, 20)) is None
    with pytest.raises(ValueError, match="notebook's number"):
        Exercise("20.ring", "20_warpspec_backward", "lab", "?", 2, "98_ring_attention")
    with pytest.raises(ValueError, match="only a lab"):
        Exercise("98.x", "20_warpspec_backward", "kernel", "?", 2, "98_ring_attention")
