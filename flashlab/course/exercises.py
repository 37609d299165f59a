"""Every exercise of the course, in stage order.

    from flashlab.course import exercises
    exercises.EXERCISES                        # (Exercise, ...): CPU labs and kernel exercises
    ex = exercises.exercise("05.fragment_owner")

Two kinds (Exercise.kind): "lab", a predict-then-check cell in a notebook, graded on any machine
(flashlab.course.labs); "kernel", a region of a stage's kernel the student writes, graded by
building and checking that stage on a GPU that runs it (flashlab.course.kernels).
flashlab.course.grade grades them.
"""
from . import Exercise, Result, kernels, labs

__all__ = ["EXERCISES", "Exercise", "Result", "exercise", "ids"]


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
