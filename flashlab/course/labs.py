"""The CPU labs: one predict-then-check question in each of notebooks 01-03 and 05-13, checked on
any machine. This module and flashlab.course.labdefs ship to students: labdefs holds the
questions and reads an answer into its canonical form; this one checks it against the compiled
answer keys. Neither computes a lab's answer, nor states one.

    labs.LABS, labs.prompt(id), labs.form(id)   # the registry (from labdefs)
    labs.answer_check(id, answer) -> Result     # right / wrong / skipped, printing nothing
    labs.check(id, answer)                      # a notebook's check cell (below)
    labs.keys()                                 # the compiled keys

The keys come from flashlab/course/lab_keys.json where that file exists (an edition ships it);
in the solution edition, where it does not, flashlab.course.labkeys compiles them from the
lesson models, once per process. In them each accepted answer is only a salted SHA-256 of its
canonical form, and the explanation of a right answer, like the hint for an anticipated mistake,
is encrypted with a key derived from the answer that unlocks it. A wrong answer's message says
what to reconsider and where to look, never the answer.

In a notebook, three cells (nbgrader's markers: an edition replaces the solution with
`# YOUR CODE HERE` / `raise NotImplementedError()`):

    from flashlab.course import labs
    print(labs.prompt("02.sectors"))

    ### BEGIN SOLUTION
    answer = ...
    ### END SOLUTION

    labs.check("02.sectors", answer)   # right: prints the verdict; wrong: raises LabWrong
"""
import json
from pathlib import Path

from . import Result
from .labdefs import LABS, POINTS, Lab, form, prompt  # the registry, re-exported
from .labdefs import KEYS_FORMAT, _lab_of, _Unreadable, answer_hash, unseal

KEYS_FILE = Path(__file__).with_name("lab_keys.json")

__all__ = ["KEYS_FILE", "LABS", "POINTS", "Lab", "LabWrong", "answer_check", "check", "form",
           "keys", "prompt"]


class LabWrong(AssertionError):
    """A lab's check cell, answered wrong (or not at all). Jupyter shows only the verdict, no
    traceback; nbgrader's autograder gives a test cell its points only when it raises nothing."""

    def __init__(self, message, result=None):
        super().__init__(message)
        self.result = result

    def _render_traceback_(self):
        return str(self).splitlines()


_keys = None


def keys(refresh=False) -> dict:
    """The compiled answer keys: lab_keys.json beside this file where it exists (an edition), else
    flashlab.course.labkeys.compile_keys() (the solution edition), once per process (refresh=True:
    again)."""
    global _keys
    if _keys is None or refresh:
        if KEYS_FILE.is_file():
            data = json.loads(KEYS_FILE.read_text(encoding="utf-8"))
        else:
            from . import labkeys   # the solution edition's: an edition leaves it out
            data = labkeys.compile_keys()
        if data.get("format") != KEYS_FORMAT:
            raise ValueError(f"the lab keys are not {KEYS_FORMAT} (format "
                             f"{data.get('format')!r})")
        _keys = data
    return _keys


# ---------------------------------------------------------------- checking an answer

def _result(ex, ok, message) -> Result:
    return Result(ex.id, bool(ok), float(ex.points if ok else 0), message)


def _verdict(lab, answer, data) -> Result:
    """Lab `lab`'s verdict on `answer` against the keys `data` (keys()'s format)."""
    ex = lab.exercise
    entry = data["labs"].get(ex.id)
    if entry is None:
        return Result.skipped(ex, f"lab {ex.id} is not part of this assignment: its edition has "
                                  "no key for it")
    if "skipped" in entry:
        return Result.skipped(ex, entry["skipped"])
    if answer is None or isinstance(answer, str) and not answer.strip():
        # not answered: a blank, not a wrong answer (Result.status)
        blank = _result(ex, False, f"not answered: set `answer` to {lab.form.what}")
        blank.status = "blank"
        return blank
    try:
        canon = lab.form.canonical(answer)
    except _Unreadable as err:
        return _result(ex, False, f"Wrong: {err}.")
    salt = data["salt"]
    h = answer_hash(salt, ex.id, canon)
    if h in entry["right"]:
        return _result(ex, True, unseal(entry["right"][h], salt, ex.id, canon))
    hint = entry["mistakes"].get(h)
    hint = " " + unseal(hint, salt, ex.id, canon) if hint else ""
    return _result(ex, False, entry["wrong"].replace("{said}", lab.form.said(canon))
                   .replace("{hint}", hint))


def answer_check(id, answer) -> Result:
    """Check `answer` to lab `id`, printing nothing: right (with the full why), wrong (with what to
    reconsider, never the answer), or skipped (the lab cannot be checked here). An answer of the
    wrong kind (text where a number is asked, ...) is wrong, and the message says what kind is
    wanted; None is not answered (ok False, status "blank")."""
    return _verdict(_lab_of(id), answer, keys())


def check(id, answer) -> None:
    """A notebook's check cell. Right (or a lab that cannot be checked here): print the verdict,
    and return nothing (a value would be the cell's output, which nbgrader's autograder would try
    to read as a partial score; answer_check returns the Result). Wrong or not answered: raise
    LabWrong, whose message is the verdict (so the autograder gives the cell no points)."""
    result = answer_check(id, answer)
    if result.ok is False:
        raise LabWrong(str(result), result)
    print(result)
