"""The course layer (flashlab.course), no GPU: the exercises are registered in stage order (the
CPU labs' own tests are in tests/test_labs.py), grading an edition skips the kernel exercises
with a reason, a leaderboard of submissions from two GPU models renders and never mixes them,
and the commands parse and reach the course through the `flashlab` entry point."""
import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from flashlab import __main__ as entry
from flashlab import cli
from flashlab.course import Exercise, Result, exercises, grade, labs, leaderboard
from flashlab.course import cli as course_cli


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
