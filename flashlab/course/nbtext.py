"""Notebooks as an edition hands them out, by nbgrader's conventions, and what in them is a
solution (for the edition's leak check).

  * in code cells the lines from `### BEGIN SOLUTION` to `### END SOLUTION` become
    `# YOUR CODE HERE` / `raise NotImplementedError()` (at the marker's indentation), and
    `### BEGIN HIDDEN TESTS` .. `### END HIDDEN TESTS` are removed;
  * in markdown cells a solution region becomes `YOUR ANSWER HERE`, and so does a whole cell
    whose first line is `**Instructor's answer.**` (an answer to a question for discussion: the
    student writes theirs there);
  * every output and execution count is cleared; the .ipynb and its jupytext percent-format
    source in notebooks/src/ keep the same cells.
"""
import re

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
CODE_STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")   # nbgrader's
TEXT_STUB = "YOUR ANSWER HERE"                                     # nbgrader's
INSTRUCTOR = "**Instructor's answer.**"


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


def instructor_answer(source: str) -> bool:
    """Whether a markdown cell is an instructor's answer (its first line opens with the mark)."""
    first = next((ln.strip() for ln in source.split("\n") if ln.strip()), "")
    return first.startswith(INSTRUCTOR)


def student_cell(cell_type: str, source: str, where="cell"):
    """(the student's source of one cell, {"solutions": n, "hidden": n, "instructor": n})."""
    counts = {"solutions": 0, "hidden": 0}
    lines = source.split("\n")
    if cell_type == "markdown":
        if instructor_answer(source):
            counts["instructor"] = 1
            return TEXT_STUB, counts
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
            body = [("# " + ln) if ln else "#" for ln in new.split("\n")] if new else []
        else:
            new, counts = student_cell("code", "\n".join(body), f"{where}, line {a + 1}")
            _add(total, counts)
            body = new.split("\n") if body else []
        out += [head] + body + gap
    return "\n".join(out), total




# --- what in a notebook is a solution --------------------------------------------------------------

def solution_regions(source: str) -> list:
    """The lines strictly inside each `### BEGIN SOLUTION` .. `### END SOLUTION` of a cell."""
    found, inside = [], None
    for line in source.split("\n"):
        if BEGIN_SOLUTION in line:
            inside = []
        elif END_SOLUTION in line and inside is not None:
            found.append(inside)
            inside = None
        elif inside is not None:
            inside.append(line)
    return found


def lab_of(source: str):
    """The lab id a cell checks (`labs.check("02.sectors", answer)`), or None."""
    m = re.search(r"""labs\s*\.\s*check\s*\(\s*["'](\d\d\.[a-z0-9_]+)["']""", source)
    return m.group(1) if m else None


def prompt_of(source: str):
    """The lab id whose question a cell prints (`labs.prompt("02.sectors")`), or None."""
    m = re.search(r"""labs\s*\.\s*prompt\s*\(\s*["'](\d\d\.[a-z0-9_]+)["']""", source)
    return m.group(1) if m else None


def answer_cells(cells) -> dict:
    """{lab id: index of its answer cell} in a notebook's cells: the code cell right after the
    one that prints the lab's question (labs.prompt); where that cell is gone, the code cell just
    before the one that calls labs.check(id, answer), or that cell itself where the answer is in
    it."""
    found = {}
    for i, cell in enumerate(cells):
        lab = prompt_of(cell.source) if cell.cell_type == "code" else None
        if lab and lab not in found and i + 1 < len(cells) and cells[i + 1].cell_type == "code":
            found[lab] = i + 1
    for i, cell in enumerate(cells):
        lab = lab_of(cell.source) if cell.cell_type == "code" else None
        if lab is None or lab in found:
            continue
        lines = [ln for ln in cell.source.splitlines() if ln.strip()]
        if len(lines) > 1 or i == 0 or cells[i - 1].cell_type != "code":
            found[lab] = i      # the answer and the check in one cell
        else:
            found[lab] = i - 1
    return found


def notebook_from_source(src, dest):
    """Write the notebook of a jupytext percent-format source `src` to `dest` (a hand-in or an
    edition whose .ipynb is missing: its source stands in)."""
    import jupytext
    import nbformat
    notebook = jupytext.read(src, fmt="py:percent")
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, dest)
    return dest


def python_code(line: str) -> str:
    """A Python line as the leak check compares it: its # comment dropped (outside strings),
    whitespace collapsed; "" for a comment or a blank line."""
    out, quote = [], None
    for ch in line:
        if quote:
            out.append(ch)
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            out.append(ch)
        elif ch == "#":
            break
        else:
            out.append(ch)
    return re.sub(r"\s+", " ", "".join(out)).strip()
