"""The student edition: `flashlab student DIR` writes it; the repository stays the solution edition.

    from flashlab.course import student
    print(student.write("student-edition"))           # refuses a folder that is not empty
    student.write("student-edition", force=True)       # writes over what is there

What it holds: every file git lists in the solution edition (tracked, and untracked ones that
.gitignore does not exclude; left out: submissions/, any earlier student edition inside it, and
the answer keys: notebooks/answers/), with

  * kernels/NN_*.cu: every exercise region's solution replaced by its stub
    (flashlab.course.kernels: the stub compiles and fails the stage's check);
  * notebooks (the .ipynb and their jupytext percent-format sources in notebooks/src/), by
    nbgrader's conventions: the lines from `### BEGIN SOLUTION` to `### END SOLUTION` become
    `# YOUR CODE HERE` / `raise NotImplementedError()` in code (at the marker's indentation) and
    `YOUR ANSWER HERE` in markdown; `### BEGIN HIDDEN TESTS` .. `### END HIDDEN TESTS` are
    removed; a markdown cell whose first line is `**Instructor's answer.**` is removed; every
    output and execution count is cleared (the .ipynb and its source keep the same cells);
  * STUDENT.md at the top: what to do, the kernel exercises, and how `flashlab grade` scores them.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .. import paths
from .kernels import KERNEL_EXERCISES, SPEED_TOLERANCE, regions, student_text

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
CODE_STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")   # nbgrader's
TEXT_STUB = "YOUR ANSWER HERE"                                     # nbgrader's
INSTRUCTOR = "**Instructor's answer.**"
ANSWER_KEYS = ("notebooks/answers/",)     # folders of answer keys: never in the student edition
LEFT_OUT = ("submissions/",)              # graded work lying in the solution edition
MARKER = "STUDENT.md"                     # the top of a student edition


class EditionError(ValueError):
    """A notebook's or a kernel's markers are not well formed; the message says where."""


# --- notebooks -------------------------------------------------------------------------------------

def _replace_regions(lines, begin, end, replace, where):
    """lines with every region from a line containing `begin` to the next containing `end`
    replaced by replace(indent) (a list of lines). Returns (lines, regions replaced)."""
    out, n, i = [], 0, 0
    while i < len(lines):
        if begin not in lines[i]:
            if end in lines[i]:
                raise EditionError(f"{where}: '{end}' without '{begin}'")
            out.append(lines[i])
            i += 1
            continue
        indent = re.match(r"[ \t]*", lines[i]).group(0)
        j = i + 1
        while j < len(lines) and end not in lines[j]:
            if begin in lines[j]:
                raise EditionError(f"{where}: '{begin}' inside another")
            j += 1
        if j == len(lines):
            raise EditionError(f"{where}: '{begin}' has no '{end}'")
        out += replace(indent)
        n += 1
        i = j + 1
    return out, n


def student_cell(cell_type: str, source: str, where="cell"):
    """(the student's source of one cell, {"solutions": n, "hidden": n}), or (None, counts) for
    a cell the student edition leaves out (an instructor's answer)."""
    counts = {"solutions": 0, "hidden": 0}
    lines = source.split("\n")
    if cell_type == "markdown":
        first = next((ln.strip() for ln in lines if ln.strip()), "")
        if first.startswith(INSTRUCTOR):
            counts["instructor"] = 1
            return None, counts
        lines, counts["solutions"] = _replace_regions(
            lines, BEGIN_SOLUTION, END_SOLUTION, lambda ind: [TEXT_STUB], where)
    elif cell_type == "code":
        lines, counts["hidden"] = _replace_regions(
            lines, BEGIN_HIDDEN, END_HIDDEN, lambda ind: [], where)
        lines, counts["solutions"] = _replace_regions(
            lines, BEGIN_SOLUTION, END_SOLUTION, lambda ind: [ind + s for s in CODE_STUB], where)
    return "\n".join(lines), counts


def _add(total, counts):
    for k, v in counts.items():
        total[k] = total.get(k, 0) + v


def student_notebook(text: str, where="notebook"):
    """(the student's .ipynb text, counts): student_cell on every cell, outputs cleared."""
    import nbformat

    nb = nbformat.reads(text, as_version=4)
    cells, total = [], {"solutions": 0, "hidden": 0, "instructor": 0, "outputs": 0}
    for n, cell in enumerate(nb.cells):
        source, counts = student_cell(cell.cell_type, cell.source, f"{where}, cell {n + 1}")
        _add(total, counts)
        if source is None:
            continue
        cell.source = source
        if cell.cell_type == "code":
            total["outputs"] += len(cell.get("outputs", []))
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)   # run timings
            cell.metadata.pop("ExecuteTime", None)
        cells.append(cell)
    nb.cells = cells
    out = nbformat.writes(nb)
    return out if out.endswith("\n") else out + "\n", total


_CELL = re.compile(r"^# %%")


def student_source(text: str, where="source"):
    """(the student's jupytext percent-format source, counts): the same cells as
    student_notebook gives its notebook. Markdown lines there are '# text' (or '#')."""
    lines = text.split("\n")
    starts = [i for i, ln in enumerate(lines) if _CELL.match(ln)]
    out = lines[:starts[0]] if starts else lines
    total = {"solutions": 0, "hidden": 0, "instructor": 0}
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        head, body = lines[a], lines[a + 1:b]
        # jupytext ends a cell at its last non-blank line; the blank lines after it separate cells
        end = len(body)
        while end and not body[end - 1].strip():
            end -= 1
        body, gap = body[:end], body[end:]
        markdown = "[markdown]" in head or "[md]" in head
        if markdown:
            content = [ln[2:] if ln.startswith("# ") else ln[1:] if ln.startswith("#") else ln
                       for ln in body]
            new, counts = student_cell("markdown", "\n".join(content), f"{where}, line {a + 1}")
            _add(total, counts)
            if new is None:
                continue
            body = [("# " + ln) if ln else "#" for ln in new.split("\n")] if new else []
        else:
            new, counts = student_cell("code", "\n".join(body), f"{where}, line {a + 1}")
            _add(total, counts)
            body = new.split("\n") if body else []
        out += [head] + body + gap
    return "\n".join(out), total


# --- the edition -----------------------------------------------------------------------------------

def listed_files(root) -> list:
    """The solution edition's files, relative to root: what git lists (tracked, and untracked
    files .gitignore does not exclude). Without git, every file but version control, caches and
    build output."""
    root = Path(root)
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True).stdout
        names = sorted({n for n in out.decode().split("\0") if n})
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".pytest_cache", ".ipynb_checkpoints", "build", "dist"}
        names = sorted(str(p.relative_to(root)).replace(os.sep, "/") for p in root.rglob("*")
                       if p.is_file() and not skip & set(p.relative_to(root).parts)
                       and not any(part.endswith(".egg-info") for part in p.parts))
    return names


def _left_out(rel: str, root: Path, dest: Path) -> str | None:
    """Why `rel` stays out of the student edition, or None."""
    if any(rel.startswith(p) for p in ANSWER_KEYS):
        return "answer key"
    if any(rel.startswith(p) for p in LEFT_OUT):
        return "graded work"
    path = (root / rel).resolve()
    if dest == path or dest in path.parents:
        return "the edition being written"
    for parent in path.parents:
        if parent == root or root not in parent.parents:
            break
        if (parent / MARKER).is_file():
            return "an earlier student edition"
    return None


def _transform(rel: str, data: bytes, where: str, stats: dict):
    """The student's version of one file's bytes."""
    if rel.startswith("kernels/") and rel.endswith(".cu"):
        text = data.decode()
        found = regions(text, where)
        if found:
            stats["kernel_regions"] += len(found)
            stats["kernels"].append(rel)
            return student_text(text, where).encode()
        return data
    if rel.endswith(".ipynb"):
        text, counts = student_notebook(data.decode(), where)
        _add(stats["notebooks"], counts)
        return text.encode()
    if rel.startswith("notebooks/") and rel.endswith(".py") and b"# %%" in data:
        text, counts = student_source(data.decode(), where)
        _add(stats["sources"], counts)
        return text.encode()
    return data


def student_md(root) -> str:
    """STUDENT.md: what to do, the kernel exercises, how they are graded."""
    from ..stages import stage

    rows = []
    found = {r.id: r for rs in _stage_regions(root).values() for r in rs}
    for ex in KERNEL_EXERCISES:
        task = found[ex.id].task if ex.id in found else ex.title
        rows.append(f"| `{ex.id}` | `kernels/{ex.stage}.cu` | {_needs(stage(ex.stage))} | "
                    f"{ex.points} | {task} |")
    table = "\n".join(rows)
    return f"""# flashlab: the student edition

This is your copy of the workbook. The kernels in `kernels/` are the real ones, except that the
heart of each stage's idea is missing: between `// BEGIN EXERCISE <id>` and `// END EXERCISE <id>`
you find the task and a stub that compiles but gives wrong answers. Write the code there (keep the
two marker lines). The notebooks' exercise cells say `# YOUR CODE HERE`.

## Setting up

    pip install -e .          # here, in this folder: flashlab then builds *your* kernels/
    flashlab grade            # see where you stand (any time; it changes nothing but submissions/)

## What to do

1. Read the notebooks in order (`notebooks/00_setup_and_the_gpu.ipynb` first). Each stage's
   notebook explains the idea that its kernel exercise asks you to write.
2. The **CPU labs** (notebooks 01, 02, 03, 05, 06, 07, 08): predict a number, write it where the cell
   says `# YOUR CODE HERE`, run the cell: `labs.check(...)` says right or wrong, and why. They
   need no GPU.
3. The **kernel exercises** (below) need a GPU that runs the stage (the table says which
   compute capability; a T4 is 7.5, an A100 8.0, an H100 9.0). Try one with

       flashlab grade --exercise 03.coarsen_kernel

   A stage's exercises are checked together (the stage is one kernel): write all of a stage's
   regions before expecting it to pass.
4. **Questions for discussion** close every notebook: answer them in the notebook.
5. Hand in: `flashlab grade --name "<your name or team>"` grades everything and writes
   `submissions/<name>-<gpu>-<time>.json`; hand in that file.

## How kernel exercises are scored

The stage is built from your `kernels/`, then checked against a float64 reference on random
inputs: every output element is first set to NaN (an element you never write fails), sequence
lengths include 1, 17, 1000 and 4096 (no tile size divides them all), causal and not, each dtype
the GPU runs. A wrong answer scores 0, and the message names the first failing case and its first
wrong element (batch, head, row, column, got, expected). A right one is timed against the stage
before it, built from this same folder (or the nearest earlier one that passes), and scored by
its speed relative to the solution's: points x min(1, speed / {SPEED_TOLERANCE}), so within
{100 - round(100 * SPEED_TOLERANCE)} % of the solution's speed earns every point. Without a usable
GPU, kernel exercises are skipped with one line saying why; the labs are graded anywhere.

`tests/` are the solution edition's tests. Until your kernels are written, the ones that read the
solution's code fail here (the static SASS evidence, the recorded registers and source hashes,
lines the lesson models quote); `flashlab grade` is what scores your work.

| exercise | file | GPU (compute capability) | points | task |
|---|---|---|---|---|
{table}
"""


def _needs(st) -> str:
    """"8.0+", or "7.5+ (bf16: 8.0+)" for a stage with a dtype that needs more."""
    cc = lambda c: ".".join(map(str, c))  # noqa: E731
    extra = getattr(st, "dtype_min_cc", {}) or {}
    more = ", ".join(f"{dt}: {cc(c)}+" for dt, c in extra.items() if tuple(c) > tuple(st.min_cc))
    return f"{cc(st.min_cc)}" + ("" if st.arch_specific else "+") + (f" ({more})" if more else "")


def _stage_regions(root) -> dict:
    out = {}
    for p in sorted(Path(root, "kernels").glob("[0-9][0-9]_*.cu")):
        try:
            found = regions(p.read_text(), str(p))
        except ValueError:
            continue
        if found:
            out[p.stem] = found
    return out


def write(dest, root=None, force=False) -> str:
    """Write the student edition of `root` (default: this repository) to `dest`; returns a summary
    of what was written and left out. FileExistsError where dest holds anything, unless force
    (then files are written over; nothing else there is removed)."""
    root = Path(root or paths.ROOT).resolve()
    dest = Path(dest).resolve()
    if dest == root or dest in root.parents:
        raise ValueError(f"the student edition cannot be written to {dest}: it holds the solution "
                         f"edition ({root})")
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} is a file")
    if dest.exists() and any(dest.iterdir()) and not force:
        raise FileExistsError(f"{dest} is not empty: choose a new folder, or pass --force to "
                              "write over what is there")
    stats = {"files": 0, "kernels": [], "kernel_regions": 0, "left_out": {},
             "notebooks": {"solutions": 0, "hidden": 0, "instructor": 0, "outputs": 0},
             "sources": {"solutions": 0, "hidden": 0, "instructor": 0}}
    plan = []
    for rel in listed_files(root):
        src = root / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        why = _left_out(rel, root, dest)
        if why:
            stats["left_out"].setdefault(why, []).append(rel)
            continue
        try:
            plan.append((rel, src, _transform(rel, src.read_bytes(), rel, stats)))
        except ValueError as err:  # a marker problem: nothing is written
            raise EditionError(f"cannot write the student edition: {err}") from err
    for rel, src, data in plan:
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        shutil.copymode(src, out)
        stats["files"] += 1
    (dest / MARKER).write_text(student_md(root))
    return _summary(dest, stats)


write_student_edition = write


def _summary(dest, s) -> str:
    nb, src = s["notebooks"], s["sources"]
    lines = [f"wrote the student edition to {dest}: {s['files']} files and {MARKER}",
             f"  kernels: {s['kernel_regions']} exercise regions stubbed in "
             f"{len(s['kernels'])} files ({', '.join(Path(k).stem for k in s['kernels'])})",
             f"  notebooks: {nb['solutions']} solution regions replaced, {nb['hidden']} hidden "
             f"test regions and {nb['instructor']} instructor's answers removed, "
             f"{nb['outputs']} outputs cleared (sources: {src['solutions']} / {src['hidden']} / "
             f"{src['instructor']})"]
    for why, rels in sorted(s["left_out"].items()):
        shown = ", ".join(rels[:4]) + (f", ... ({len(rels)} files)" if len(rels) > 4 else "")
        lines.append(f"  left out ({why}): {shown}")
    lines.append(f"next: cd {dest} && pip install -e . && flashlab grade")
    return "\n".join(lines)


def main(argv=None) -> int:
    """`flashlab student DIR [--root ROOT] [--force]`."""
    ap = argparse.ArgumentParser(prog="flashlab student",
                                 description="Write the student edition of the workbook to DIR.")
    ap.add_argument("dir", metavar="DIR", help="where to write it (a new or empty folder)")
    ap.add_argument("--root", default=str(paths.ROOT), help="the solution edition to start from")
    ap.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    args = ap.parse_args(argv)
    try:
        print(write(args.dir, root=args.root, force=args.force))
    except (FileExistsError, ValueError) as err:
        print(f"flashlab student: {err}", file=sys.stderr)
        return 1
    return 0
