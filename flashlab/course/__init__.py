"""The course layer, on top of everything else: exercises with checks, the editions an
instructor hands out, grading (a student's own check, and a class's hand-ins), the leaderboard
and nbgrader (`flashlab student`, `flashlab grade`, `flashlab leaderboard`, `flashlab nbgrader`).

    from flashlab.course import labs
    labs.answer_check("02.sectors", 5)      # a CPU lab: right or wrong, and why
    from flashlab.course import exercises, grade
    exercises.EXERCISES                     # every exercise, CPU labs and kernel exercises
    grade.grade_tree("week3")               # every exercise an edition hands out

The two records every module here shares are defined in this file, which imports no module of
the course, so that the registry (exercises), the labs and the kernel exercises can all import
them without an import cycle.
"""
from dataclasses import asdict, dataclass

KINDS = ("lab", "kernel")  # lab: CPU, graded anywhere; kernel: needs a GPU that runs the stage


@dataclass(frozen=True)
class Exercise:
    id: str        # "02.sectors", "05.fragment_owner", "03.coarsen_kernel", ...
    stage: str     # the stage's slug, e.g. "02_coalesced"
    kind: str      # "lab" or "kernel"
    title: str     # the question, in a line
    points: int
    # the notebook that asks a lab, where it is not its stage's own: a notebook about no one stage
    # ("98_ring_attention"), whose labs are handed out with the stage it builds on
    notebook: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"exercise {self.id}: kind is one of {KINDS}, not {self.kind!r}")
        if self.notebook and self.kind != "lab":
            raise ValueError(f"exercise {self.id}: only a lab lives in another notebook than its "
                             "stage's; a kernel exercise is a region of its stage's kernel")
        if not self.id.startswith(self.home[:2] + "."):
            raise ValueError(f"exercise {self.id}: its id starts with its notebook's number "
                             f"({self.home[:2]}.)")

    @property
    def home(self) -> str:
        """The notebook (its slug) a lab is answered in; a kernel exercise's stage."""
        return self.notebook or self.stage


VERDICTS = ("right", "wrong", "blank", "timeout", "skipped")


@dataclass
class Result:
    exercise: str        # the exercise's id
    ok: bool | None      # right / wrong; None: skipped (no GPU, nothing recorded, ...)
    score: float = 0.0   # 0 .. the exercise's points
    message: str = ""    # right or wrong and why; for kernels the first failing case and element
    status: str = ""     # "blank" or "timeout" where a wrong result is one of those; else ""
    gpu: str = ""        # the GPU model a kernel exercise was timed on ("" for a lab)
    note: str = ""       # a skipped kernel exercise's machine code, read without a GPU (no points)

    @classmethod
    def skipped(cls, exercise, why: str) -> "Result":
        """A result that could not be graded here, with the one-line reason."""
        return cls(getattr(exercise, "id", exercise), None, 0.0, why)

    @property
    def verdict(self) -> str:
        """One of VERDICTS: right, wrong (blank and timeout are wrong ones, said apart), skipped."""
        if self.ok is None:
            return "skipped"
        return "right" if self.ok else (self.status or "wrong")

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self):
        return f"{self.exercise}: {self.verdict.upper()}. {self.message}"

    def _repr_pretty_(self, p, cycle):  # a notebook cell ending in labs.check(...): one short line
        p.text(f"<Result {self.exercise}: {self.verdict}, score {self.score:g}>")


__all__ = ["Exercise", "KINDS", "Result", "VERDICTS"]
