"""Every exercise of the course, in stage order, and the one function that grades any of them.

    from flashlab.course import exercises
    exercises.EXERCISES                        # (Exercise, ...): CPU labs and kernel exercises
    ex = exercises.exercise("05.fragment_owner")
    exercises.grade(ex, Path("student-edition"))   # Result(ok, score, message)

Two kinds (Exercise.kind): "lab", a predict-then-check cell in a notebook, graded on any machine
(flashlab.course.labs); "kernel", a region of a stage's kernel the student writes, graded by
building and checking that stage on a GPU that runs it (flashlab.course.kernels).
"""
from pathlib import Path

from . import Exercise, Result, kernels, labs

__all__ = ["EXERCISES", "Exercise", "Result", "exercise", "grade", "ids"]


def _ordered(*groups) -> tuple:
    """The exercises by stage (sorted is stable: within a stage, labs before kernel exercises)."""
    every = tuple(ex for group in groups for ex in group)
    seen = {}
    for ex in every:
        if ex.id in seen:
            raise ValueError(f"two exercises have the id {ex.id}")
        seen[ex.id] = ex
    return tuple(sorted(every, key=lambda ex: ex.stage))


EXERCISES = _ordered(labs.LABS, kernels.KERNEL_EXERCISES)


def ids(kind=None) -> list:
    """The exercises' ids, in order; only those of one kind if `kind` is given."""
    return [ex.id for ex in EXERCISES if kind in (None, ex.kind)]


def exercise(id) -> Exercise:
    """The exercise with this id ("02.sectors"); also takes an Exercise. ValueError names them all
    when there is none."""
    if isinstance(id, Exercise):
        return id
    for ex in EXERCISES:
        if ex.id == id:
            return ex
    raise ValueError(f"no exercise {id!r}; the exercises are: {', '.join(ids())}")


def grade(ex, root: Path) -> Result:
    """Grade exercise `ex` (an Exercise or its id) in the edition rooted at `root`: a lab from its
    notebook cell, a kernel exercise by building, checking and timing its stage. The score is
    clamped to 0 .. ex.points, and is 0 unless the result is right; a grader that raises gives a
    wrong result naming the error, so one exercise cannot stop the others being graded."""
    ex = exercise(ex)
    root = Path(root)
    grader = labs.grade_lab if ex.kind == "lab" else kernels.grade_kernel
    try:
        result = grader(ex, root)
    except Exception as err:  # noqa: BLE001 -- the student's code or build may raise anything
        return Result(ex.id, False, 0.0, f"the grader stopped on {type(err).__name__}: {err}")
    result.exercise = ex.id
    # correctness is required: only a right answer (or a kernel that passes its check) scores
    result.score = min(max(float(result.score), 0.0), ex.points) if result.ok else 0.0
    return result
