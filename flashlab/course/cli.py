"""The course commands: `flashlab student`, `flashlab grade`, `flashlab leaderboard`.

flashlab/__main__.py (the `flashlab` console command and `python -m flashlab`) hands these three
to main() below and every other command to flashlab.cli, which lists all of them in its help and
in README.md. The work is imported only when a command runs, so `flashlab --help` stays quick.
"""
import argparse
import sys
from pathlib import Path

COMMANDS = ("student", "grade", "leaderboard")

STUDENT_HELP = ("Write the student edition to DIR: the repository's files, every kernel exercise "
                "region replaced by its stub (it compiles and fails its check), the notebooks' "
                "solutions replaced by `# YOUR CODE HERE` (nbgrader's markers) and their outputs "
                "cleared, hidden tests and answer keys left out. The repository stays the "
                "solution edition.")
GRADE_HELP = ("Grade the edition in DIR (default: here): the CPU labs from the notebooks' check "
              "cells, on any machine; the kernel exercises by building, checking and timing their "
              "stage against the reference stage, on a GPU that runs it (skipped, with one line "
              "saying why, where there is none). Prints a score table and writes a JSON submission "
              "to DIR/submissions/ (student or team name, GPU, torch and CUDA versions, commit, "
              "every result), never over another one.")
LEADERBOARD_HELP = ("Merge submissions (JSON files, or folders holding them) into a ranked table "
                    "per GPU model (runs are compared only with runs on the same model) and a "
                    "figure per exercise, saved under --out. No submission replaces another: a "
                    "name that submitted several times is ranked by its best.")


def _cmd_student(args):
    from . import student
    written = student.write(Path(args.dir), root=Path(args.root), force=args.force)
    if isinstance(written, str):
        print(written)
    elif written is not None:
        for path in written:
            print(path)
    return 0


def _cmd_grade(args):
    from . import grade
    grade.run(args.dir, exercise=args.exercise, name=args.name)
    return 0


def _cmd_leaderboard(args):
    from . import leaderboard
    leaderboard.run(args.inputs, out_dir=args.out)
    return 0


def add_commands(sub):
    """Add the course commands to an argparse sub-parser set (flashlab's, or parser()'s)."""
    from .. import paths
    p = sub.add_parser("student", help="write the student edition to DIR", description=STUDENT_HELP)
    p.add_argument("dir", metavar="DIR", help="where to write it (a new or empty folder)")
    p.add_argument("--root", default=str(paths.ROOT), metavar="ROOT",
                   help=f"the solution edition to start from (default: {paths.ROOT})")
    p.add_argument("--force", action="store_true",
                   help="write into DIR even if it is not empty (files there are written over)")
    p.set_defaults(fn=_cmd_student)

    p = sub.add_parser("grade", help="grade an edition; score table and JSON submission",
                       description=GRADE_HELP)
    p.add_argument("dir", nargs="?", default=".", metavar="DIR",
                   help="the edition to grade (default: the current folder)")
    p.add_argument("--exercise", metavar="ID", help="only this exercise, e.g. 02.sectors")
    p.add_argument("--name", help="student or team name (default: $FLASHLAB_STUDENT, else your "
                                  "login name)")
    p.set_defaults(fn=_cmd_grade)

    p = sub.add_parser("leaderboard", help="rank submissions per GPU model; a figure per exercise",
                       description=LEADERBOARD_HELP)
    p.add_argument("inputs", nargs="+", metavar="FILES_OR_DIR",
                   help="submission files, or folders searched for them")
    p.add_argument("--out", default="leaderboard", metavar="DIR",
                   help="where the table and figures go (default: ./leaderboard)")
    p.set_defaults(fn=_cmd_leaderboard)


def parser():
    ap = argparse.ArgumentParser(prog="flashlab", description="flashlab's course commands "
                                 "(`flashlab --help` lists every command).")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_commands(sub)
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as err:
        print(f"flashlab {args.command}: {err}", file=sys.stderr)
        return 2
