"""The `flashlab` command (pyproject's console script) and `python -m flashlab`.

A course-layer module: the course commands (student, grade, leaderboard) go to
flashlab.course.cli, every other command to flashlab.cli, which lists them all in its help.
"""
import sys

from . import cli
from .course import cli as course_cli


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in course_cli.COMMANDS:
        return course_cli.main(argv)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
