"""The course layer (flashlab.course), no GPU: the CPU labs say right or wrong and why, grading an
edition reads the answers from its notebooks and skips the kernel exercises with a reason, a
leaderboard of submissions from two GPU models renders and never mixes them, and the commands
parse and reach the course through the `flashlab` entry point."""
import json
import os
import time
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from flashlab import __main__ as entry
from flashlab import cli, tuning
from flashlab.course import Exercise, Result, exercises, grade, labs, leaderboard
from flashlab.course import cli as course_cli

# lab id: (a right answer, a wrong one, what the why of the wrong one must say)
LABS = {
    "01.bank_wavefronts": (32, 1, ["you said 1", "all 32 lanes are in bank 0", "32-way",
                                   "a broadcast"]),
    "02.sectors": (32, 8, ["you counted 8", "256 bytes apart", "its own sector: 32"]),
    "03.occupancy": (3, 4, ["registers limit alone", "shared memory", "holds 3"]),
    "05.fragment_owner": ([8, 9, 10, 11], [10], ["you left out 8, 9 and 11", "groupID 2",
                                                 "four lanes share a row"]),
    "06.bank_map": (8, 4, ["8·r mod 32", "2-way", "come back to bank 0"]),
    "07.pipeline_period": (700, 300, ["latency + load = 500 + 200 = 700", "the period is 700"]),
    "11.registers": ((128, 152), (128, 157), ["65 536 / 512 = 128", "157.3 each",
                                              "round the share down"]),
    "12.store_sectors": ((128, 1024, 512), (32, 1024, 512), ["4 x 32 = 128",
                                                             "one thread's count"]),
}


def _dropped(log=None):
    """The switches the tuned D = 64 non-causal kernel turns off, from the recorded log."""
    from flashlab.autotune import SWITCHES
    opts = tuning.choice(log)[(64, False)][-1]
    return sorted(name for name, bit in SWITCHES.items() if not opts & bit)


def test_the_labs_are_registered_in_stage_order():
    assert [ex.id for ex in labs.LABS] == ["01.bank_wavefronts", "02.sectors", "03.occupancy",
                                           "05.fragment_owner", "06.bank_map",
                                           "07.pipeline_period", "08.tuning", "09.descriptor",
                                           "10.parity", "11.registers", "12.store_sectors",
                                           "13.lazy_bound"]
    assert all(ex.kind == "lab" and ex.points > 0 and ex.title.endswith("?") for ex in labs.LABS)
    stages = [ex.stage for ex in exercises.EXERCISES]
    assert stages == sorted(stages)
    assert set(labs.LABS) <= set(exercises.EXERCISES)
    for ex in labs.LABS:
        assert exercises.exercise(ex.id) is ex and "Set `answer`" in labs.prompt(ex.id)
    with pytest.raises(ValueError, match="02.sectors"):
        exercises.exercise("02.nope")


@pytest.mark.parametrize("id", LABS)
def test_a_lab_says_right_or_wrong_and_why(id):
    right, wrong, why = LABS[id]
    ex = exercises.exercise(id)
    r = labs.answer_check(id, right)
    assert (r.ok, r.score, r.exercise) == (True, ex.points, id) and r.message.startswith("Right")
    r = labs.answer_check(id, wrong)
    assert (r.ok, r.score) == (False, 0) and r.message.startswith("Wrong")
    for phrase in why:
        assert phrase in r.message, (phrase, r.message)


def test_the_bank_wavefront_lab_counts_with_the_bank_model():
    from flashlab import banks
    import numpy as np
    truth = banks.wavefronts(np.arange(32) * 64)[0]
    assert truth == 32
    r = labs.answer_check("01.bank_wavefronts", truth)
    assert r.ok and "bank t: 1 wavefront" in r.message          # the padded rows, d + 1 floats
    for wrong, why in ((64, "is d, the lanes' stride"), (4, "global-memory count"),
                       (2048, "how often the warp executes"), (16, "every lane has its own word")):
        r = labs.answer_check("01.bank_wavefronts", wrong)
        assert not r.ok and why in r.message, (wrong, r.message)
    r = labs.answer_check("01.bank_wavefronts", "32-way")
    assert not r.ok and "whole number of wavefronts" in r.message


def test_the_tuning_lab_reads_the_recorded_log(data_dir):
    truth = _dropped()
    r = labs.answer_check("08.tuning", truth)
    assert r.ok and "keeps a switch only where switching it off lost" in r.message
    assert labs.answer_check("08.tuning", ", ".join(t.lower() for t in truth)).ok
    kept = next(s for s in ("FOLD_SCALE", "LANE_OFFSETS") if s not in truth)
    r = labs.answer_check("08.tuning", truth + [kept])
    assert not r.ok and f"{kept}: " in r.message and "off lost: kept" in r.message
    r = labs.answer_check("08.tuning", ["FAST"])
    assert not r.ok and "not a switch" in r.message


def test_the_tuning_lab_is_skipped_without_a_log(empty_data_dir):
    r = labs.answer_check("08.tuning", [])
    assert r.ok is None and "no tuning log" in r.message


def test_answers_of_the_wrong_kind_and_float_tolerance():
    assert labs.answer_check("07.pipeline_period", 705).ok          # within 2 %
    assert labs.answer_check("07.pipeline_period", "700 ns").ok
    assert not labs.answer_check("07.pipeline_period", 730).ok
    r = labs.answer_check("07.pipeline_period", 1000)
    assert not r.ok and "stage 06's period" in r.message
    r = labs.answer_check("02.sectors", "lots")
    assert not r.ok and "whole number of sectors" in r.message
    r = labs.answer_check("03.occupancy", 3.35)
    assert not r.ok and "rounds down" in r.message
    assert labs.answer_check("05.fragment_owner", "11, 10, 9, 8").ok
    assert not labs.answer_check("05.fragment_owner", [40]).ok
    assert not labs.answer_check("02.sectors", True).ok


def test_check_prints_the_verdict_and_returns_the_result(capsys):
    r = labs.check("02.sectors", 8)
    assert isinstance(r, Result) and r.ok is False
    out = capsys.readouterr().out
    assert out.startswith("02.sectors: WRONG.") and "256 bytes apart" in out


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
answer = 4 * 8
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


def _ipynb(source):
    return json.dumps({"cells": [{"cell_type": "code", "id": "lab-cell", "metadata": {},
                                  "outputs": [], "execution_count": None,
                                  "source": source.splitlines(True)}],
                       "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


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


def test_grade_lab_reads_the_answer_from_the_notebook(edition):
    ex = exercises.exercise
    r = labs.grade_lab(ex("02.sectors"), edition)
    assert r.ok and r.score == 2
    r = labs.grade_lab(ex("03.occupancy"), edition)
    assert r.ok is False and "not answered yet" in r.message and "NotImplementedError" in r.message
    r = labs.grade_lab(ex("05.fragment_owner"), edition)     # no markers: the code above check()
    assert r.ok is False and "you left out 8, 9 and 11" in r.message
    r = labs.grade_lab(ex("06.bank_map"), edition)
    assert r.ok is False and "no cell calls labs.check(\"06.bank_map\"" in r.message


def test_grade_lab_takes_the_newer_of_source_and_notebook(edition):
    src = edition / "notebooks" / "src" / "05_mma.py"
    nb = edition / "notebooks" / "05_mma.ipynb"
    nb.write_text(_ipynb(NO_MARKERS.replace("[10]", "[8, 9, 10, 11]").replace("# %%\n", "")))
    old = time.time() - 100
    os.utime(src, (old, old))
    assert labs.grade_lab(exercises.exercise("05.fragment_owner"), edition).ok
    os.utime(nb, (old - 100, old - 100))
    assert not labs.grade_lab(exercises.exercise("05.fragment_owner"), edition).ok


def test_grade_lab_reports_the_students_error(edition):
    cell = "# %%\n### BEGIN SOLUTION\n{}\n### END SOLUTION\nlabs.check('{}', {})\n"
    (edition / "notebooks" / "src" / "06_swizzle.py").write_text(
        cell.format("answer = 1 / 0", "06.bank_map", "answer"))
    (edition / "notebooks" / "src" / "07_cp_async.py").write_text(
        cell.format("x = 700", "07.pipeline_period", "x"))
    r = labs.grade_lab(exercises.exercise("06.bank_map"), edition)
    assert r.ok is False and "ZeroDivisionError" in r.message
    r = labs.grade_lab(exercises.exercise("07.pipeline_period"), edition)
    assert r.ok is False and "sets no `answer`" in r.message


KERNEL = Exercise("03.fake_kernel", "03_coarsened", "kernel", "write stage 03's coarsening?", 5)


def test_grade_an_edition_without_a_gpu(edition, monkeypatch, capsys, data_dir):
    monkeypatch.setattr(exercises, "EXERCISES", exercises.EXERCISES + (KERNEL,))
    monkeypatch.setenv("FLASHLAB_STUDENT", "Team Rocket")
    graded, path = grade.run(edition, gpu=False)
    by_id = {ex.id: r for ex, r in graded}
    assert by_id["02.sectors"].ok and by_id["02.sectors"].score == 2
    assert by_id["03.occupancy"].ok is False and by_id["06.bank_map"].ok is False
    kernels = [r for ex, r in graded if ex.kind == "kernel"]
    assert kernels and all(r.ok is None and r.message == grade.NO_GPU for r in kernels)
    out = capsys.readouterr().out
    assert "exercise" in out and "verdict" in out and "02.sectors" in out
    assert f"skipped {len(kernels)} (" in out and "no CUDA GPU here" in out
    assert out.count("no CUDA GPU here") == 1                  # one line, however many kernels
    sub = json.loads(path.read_text())
    assert path.parent == edition / "submissions" and path.name.startswith("team-rocket-cpu-")
    assert sub["name"] == "Team Rocket" and sub["gpu"] == "cpu"
    assert {"torch", "cuda", "commit", "time", "results"} <= set(sub)
    assert sub["score"] == 2 and sub["points"] == 2 * len(labs.LABS)
    assert {r["exercise"]: r["ok"] for r in sub["results"]}["03.fake_kernel"] is None
    # a second run, same second and all, never overwrites the first
    _, again = grade.run(edition, exercise="02.sectors", name="Team Rocket", gpu=False)
    assert again != path and path.exists() and len(list(path.parent.glob("*.json"))) == 2
    assert [r["exercise"] for r in json.loads(again.read_text())["results"]] == ["02.sectors"]


def test_write_submission_never_overwrites(tmp_path):
    sub = dict(name="Ada", gpu="NVIDIA H100 80GB HBM3", time="2030-01-01T00:00:00Z", results=[])
    paths = [grade.write_submission(sub, tmp_path) for _ in range(3)]
    assert len(set(paths)) == 3
    assert paths[0].name == "ada-nvidia-h100-80gb-hbm3-20300101T000000Z.json"
    assert paths[2].name.endswith("-3.json")


def test_a_failing_grader_does_not_stop_the_others(monkeypatch, edition):
    def boom(ex, root):
        raise RuntimeError("nvcc exploded")
    monkeypatch.setattr(exercises.labs, "grade_lab", boom)
    r = exercises.grade("02.sectors", edition)
    assert r.ok is False and r.score == 0 and "nvcc exploded" in r.message


# ---------------------------------------------------------------- the leaderboard

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"


def _submission(name, gpu, scores, when):
    env = dict(gpu=gpu, compute_capability="9.0", torch="2.13.0", cuda="12.8", commit="abc",
               time=when)
    scores = list(scores) + [0] * (len(labs.LABS) - len(scores))   # labs not listed: 0
    graded = [(ex, Result(ex.id, s > 0, float(s), "synthetic"))
              for ex, s in zip(labs.LABS, scores)]
    graded.append((KERNEL, Result(KERNEL.id, True, 4.0, "synthetic")))
    return grade.submission(graded, name, ".", env)


@pytest.fixture
def submissions(tmp_path):
    folder = tmp_path / "class"
    subs = [("Ada", H100, [2, 2, 2, 2, 2, 2], "2030-01-01T10:00:00Z"),
            ("Ada", A100, [2, 0, 0, 0, 0, 0], "2030-01-01T10:00:00Z"),
            ("Bob", H100, [2, 2, 0, 0, 0, 0], "2030-01-01T10:00:00Z"),
            ("Bob", H100, [2, 2, 2, 2, 0, 0], "2030-01-01T10:00:00Z"),   # same name, same time
            ("Cy", A100, [2, 2, 2, 0, 0, 0], "2030-01-01T11:00:00Z")]
    for name, gpu, scores, when in subs:
        grade.write_submission(_submission(name, gpu, scores, when), folder)
    (folder / "submissions" / "notes.json").write_text('{"not": "a submission"}')
    return folder


def test_a_leaderboard_ranks_each_gpu_model_apart(submissions, tmp_path, capsys):
    files = sorted((submissions / "submissions").glob("*.json"))
    assert len(files) == 6                                  # Bob's second run did not overwrite
    out_dir = tmp_path / "board"
    boards, written = leaderboard.run([submissions, files[0]], out_dir, warn=lambda _: None)
    assert set(boards) == {H100, A100}
    h100, a100 = boards[H100], boards[A100]
    assert list(h100["name"]) == ["Ada", "Bob"] and list(a100["name"]) == ["Cy", "Ada"]
    assert list(h100["total"]) == [16, 12] and list(h100["submissions"]) == [1, 2]
    assert list(a100["total"]) == [10, 6]                   # Ada's H100 run is not her A100 score
    assert list(h100["rank"]) == [1, 2]
    out = capsys.readouterr().out
    assert "compared only with runs on the same GPU model" in out
    assert f"== {H100}: 2 names, 3 submissions ==" in out and f"== {A100}: 2 names, 2" in out
    pngs = {f"{ex.id}.png" for ex in labs.LABS} | {"03.fake_kernel.png"}
    assert {p.name for p in written} == pngs
    assert all(p.stat().st_size > 1000 for p in written)
    assert (out_dir / "leaderboard.txt").read_text().startswith("5 submissions from 3 names")


def test_a_figure_per_exercise_never_mixes_models(submissions):
    subs = leaderboard.load([submissions], warn=lambda _: None)
    figs = leaderboard.figures(subs)
    fig = figs["02.sectors"]
    assert isinstance(fig, Figure)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert sorted(ax.get_title() for ax in axes) == sorted([A100, H100])
    for ax in axes:
        names = {t.get_text() for t in ax.get_yticklabels()}
        assert names == ({"Ada", "Bob"} if ax.get_title() == H100 else {"Ada", "Cy"})
    assert "never compared" in fig._suptitle.get_text()


def test_a_leaderboard_with_nothing_to_rank(tmp_path):
    with pytest.raises(ValueError, match="no flashlab submissions"):
        leaderboard.run([tmp_path], tmp_path / "out", warn=lambda _: None)


# ---------------------------------------------------------------- the commands

def test_the_course_commands_parse():
    ap = course_cli.parser()
    a = ap.parse_args(["grade", "ed", "--exercise", "02.sectors", "--name", "Ada"])
    assert (a.command, a.dir, a.exercise, a.name) == ("grade", "ed", "02.sectors", "Ada")
    assert ap.parse_args(["grade"]).dir == "."
    a = ap.parse_args(["leaderboard", "a.json", "class/", "--out", "board"])
    assert (a.inputs, a.out) == (["a.json", "class/"], "board")
    a = ap.parse_args(["student", "student-edition", "--force"])
    assert (a.dir, a.force) == ("student-edition", True)
    listed = {usage.split()[1] for usage, _ in cli.COMMANDS}
    assert set(course_cli.COMMANDS) <= listed
    for name in course_cli.COMMANDS:
        assert f"flashlab {name}" in cli.command_list()


def test_the_entry_point_reaches_the_course(edition, monkeypatch, capsys):
    monkeypatch.setattr(grade, "gpu_available", lambda: False)
    assert entry.main(["grade", str(edition), "--exercise", "02.sectors", "--name", "Ada"]) == 0
    assert "02.sectors" in capsys.readouterr().out
    assert entry.main(["grade", str(edition), "--exercise", "99.none"]) == 2
    assert "no exercise '99.none'" in capsys.readouterr().err
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
