"""The course commands: `flashlab student`, `flashlab grade`, `flashlab leaderboard`,
`flashlab nbgrader`.

flashlab/__main__.py (the `flashlab` console command and `python -m flashlab`) hands these to
main() below and every other command to flashlab.cli, which lists all of them in its help and in
README.md. The work is imported only when a command runs, so `flashlab --help` stays quick.
"""
import argparse
import sys
from pathlib import Path

COMMANDS = ("student", "grade", "leaderboard", "nbgrader")

STUDENT_HELP = ("Write the edition of one assignment to DIR: what an instructor hands out. It "
                "hands out the exercises (CPU labs and kernel exercises) of the stages --from MM "
                "to --through NN (default: every stage) and holds the stages up to NN, no later "
                "one: earlier stages as solved, the assignment's with each exercise region (and "
                "each later region that carries its code) replaced by a stub that compiles and "
                "fails its check, the notebooks' solutions replaced by `# YOUR CODE HERE` and the "
                "instructor's answers by `YOUR ANSWER HERE`, outputs cleared, with STUDENT.md and "
                "edition.json. It is written from the files git tracks, without tests/, tools/ or "
                "TEACHING.md, and not at all if any of its files would show a solution it hands "
                "out. The repository stays the solution edition.")
GRADE_HELP = ("Grade the edition in DIR (default: here), as a student checks their work: each "
              "lab by running its notebook in a fresh Python through the answer cell and "
              "checking the `answer` it leaves; each kernel exercise by building, checking and "
              "timing its stage, on a GPU that runs it (skipped, saying why, where there is "
              "none). With --class: grade every hand-in in a folder (folders, git clones, zips, "
              "or loose notebooks and kernels) against the edition as handed out (--edition), "
              "each in its own process within --timeout seconds, kernel exercises timed in turn "
              "with the solution on this GPU (one grading at a time per GPU); write "
              "OUT/gradebook.csv and OUT/feedback/<student>.md.")
LEADERBOARD_HELP = ("Rank a class from gradebooks (`flashlab grade --class` writes them): a ranked "
                    "table per GPU model (kernel exercises are compared only with runs on the "
                    "same model) and a figure per exercise, saved under --out. A gradebook with a "
                    "score above an exercise's points, or not a number, is refused.")
NBGRADER_HELP = ("Write an nbgrader course folder for one assignment: nbgrader_config.py and "
                 "source/<assignment>/ with the assignment's solution notebooks, which carry "
                 "nbgrader's cell metadata (each lab's answer a solution cell, its check an "
                 "autograded test, the questions' answers manually graded cells). Then, in that "
                 "folder, `nbgrader generate_assignment <assignment>` writes the release, and "
                 "`nbgrader autograde` and `nbgrader generate_feedback` grade submissions.")


def _cmd_student(args):
    from . import student
    print(student.write(Path(args.dir), root=Path(args.root), through=args.through,
                        first=args.first, force=args.force))
    return 0


def _cmd_grade(args):
    from . import grade
    if args.handins:
        if not args.edition:
            raise ValueError("--class needs --edition: the folder `flashlab student` wrote for "
                             "this assignment")
        grade.grade_class(args.handins, args.edition, out_dir=args.out, students=args.student,
                          jobs=args.jobs, timeout=args.timeout, cell_timeout=args.cell_timeout,
                          gpu=False if args.no_gpu else None, only=args.exercise)
        return 0
    grade.run(args.dir, only=args.exercise, solution=args.solution,
              cell_timeout=args.cell_timeout, as_json=args.json,
              gpu=False if args.no_gpu else None, machine_code=args.machine_code)
    return 0


def _cmd_leaderboard(args):
    from . import leaderboard
    leaderboard.run(args.inputs, out_dir=args.out)
    return 0


def _cmd_nbgrader(args):
    from . import nbgrader
    print(nbgrader.write_course(Path(args.dir), through=args.through, first=args.first,
                                force=args.force))
    return 0


def add_commands(sub):
    """Add the course commands to an argparse sub-parser set (flashlab's, or parser()'s)."""
    from .. import paths
    p = sub.add_parser("student", help="write the edition of one assignment to DIR",
                       description=STUDENT_HELP)
    p.add_argument("dir", metavar="DIR", help="where to write it (a new or empty folder)")
    p.add_argument("--through", metavar="NN", help="the assignment's last stage (default: the last)")
    p.add_argument("--from", dest="first", metavar="MM",
                   help="the assignment's first stage (default: the first)")
    p.add_argument("--root", default=str(paths.ROOT), metavar="ROOT",
                   help=f"the solution edition to start from (default: {paths.ROOT})")
    p.add_argument("--force", action="store_true",
                   help="write into DIR even if it is not empty (files there are written over)")
    p.set_defaults(fn=_cmd_student)

    p = sub.add_parser("grade", help="check an edition, or grade a class's hand-ins",
                       description=GRADE_HELP)
    p.add_argument("dir", nargs="?", default=".", metavar="DIR",
                   help="the edition to grade (default: the current folder)")
    p.add_argument("--exercise", metavar="ID", action="append",
                   help="only this exercise, e.g. 02.sectors (repeat for more)")
    p.add_argument("--class", dest="handins", metavar="HANDINS",
                   help="a folder of hand-ins, one per student, to grade as the instructor")
    p.add_argument("--edition", metavar="ED", help="with --class: the edition as handed out")
    p.add_argument("--out", default="grades", metavar="OUT",
                   help="with --class: where the gradebook and feedback go (default: ./grades)")
    p.add_argument("--student", metavar="NAME", action="append",
                   help="with --class: only this student's hand-in (repeat for more; one per "
                        "task of a Slurm array)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="with --class: hand-ins graded side by side (labs run on the CPU; kernel "
                        "timings still take the GPU one at a time)")
    p.add_argument("--timeout", type=float, default=1800, metavar="S",
                   help="with --class: seconds one hand-in may take (default 1800)")
    p.add_argument("--cell-timeout", type=float, default=None, metavar="S",
                   help="seconds one notebook cell may run before its lab times out (default 120)")
    p.add_argument("--solution", metavar="ROOT",
                   help="time kernel exercises in turn with this solution edition's stages")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-gpu", action="store_true",
                   help="skip kernel exercises even where a GPU is present")
    p.add_argument("--machine-code", action="store_true",
                   help="without a GPU: compile each kernel exercise's stage (nvcc and cuobjdump) "
                        "and say what its machine code holds of the idea (no points)")
    p.set_defaults(fn=_cmd_grade)

    p = sub.add_parser("leaderboard", help="rank a class from its gradebook; a figure per exercise",
                       description=LEADERBOARD_HELP)
    p.add_argument("inputs", nargs="+", metavar="GRADEBOOK",
                   help="gradebook CSV files, or folders holding gradebook.csv")
    p.add_argument("--out", default="leaderboard", metavar="DIR",
                   help="where the table and figures go (default: ./leaderboard)")
    p.set_defaults(fn=_cmd_leaderboard)

    p = sub.add_parser("nbgrader", help="write an nbgrader course folder for one assignment",
                       description=NBGRADER_HELP)
    p.add_argument("dir", metavar="DIR", help="the course folder (new, empty, or an nbgrader course)")
    p.add_argument("--through", metavar="NN", help="the assignment's last stage")
    p.add_argument("--from", dest="first", metavar="MM", help="the assignment's first stage")
    p.add_argument("--force", action="store_true", help="write over the assignment's source")
    p.set_defaults(fn=_cmd_nbgrader)


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
