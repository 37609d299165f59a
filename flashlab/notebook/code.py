"""A stage's source in a notebook: a whole file, one definition, a few numbered lines, or the
diff against the stage before (what the stage's one idea changed)."""
import difflib
import re

from ..markers import strip_markers
from ..paths import KERNELS, runs_dir
from ..tables import NotRecorded
from ..stages import stage as _stage


def _source_text(st):
    return st.source.read_text()


def extract(text: str, name: str) -> str:
    """The definition of `name` (a function, kernel or struct) in C++ source text: from the line
    that declares it to its closing brace at column 0, with its leading comments."""
    lines = text.splitlines()
    pat = re.compile(rf"\b{re.escape(name)}\s*\(|\bstruct\s+{re.escape(name)}\b")
    for i, line in enumerate(lines):
        if pat.search(line) and not line.lstrip().startswith(("//", "return", "auto")) \
                and not line.rstrip().endswith(";"):
            start = i
            while start > 0 and (lines[start - 1].startswith(("//", "template", "__global__"))
                                 or lines[start - 1].startswith("__device__")):
                start -= 1
            end = i
            while end < len(lines) and not (lines[end].startswith("}")):
                end += 1
            return "\n".join(lines[start:end + 1])
    raise ValueError(f"no definition of {name!r} found")


def _code(text, language="cuda"):
    from IPython.display import Code, display
    display(Code(text, language=language))


def _text(stage):
    """A stage's .cu source, or a header in kernels/ named by its file name ("ptx.cuh")."""
    if str(stage).endswith(".cuh"):
        return (KERNELS / stage).read_text()
    return _source_text(_stage(stage))


def show_source(stage, name=None):
    """Show a stage's .cu file (or a header of kernels/, e.g. "ptx.cuh"), or just the
    definition of `name` in it."""
    text = _text(stage)
    _code(extract(text, name) if name else text)


def run_log(name: str) -> str:
    """The text of a research log in data/runs/ (an appendix reads its runs through this).
    NotRecorded, which `nb.unless_missing()` prints as one line, where this copy has no such log:
    a student edition ships without data/runs/."""
    path = runs_dir() / name
    if not path.exists():
        raise NotRecorded(f"{name}: a research log of the full repository (data/runs/), not in "
                          f"this copy; the text around this cell says what it recorded")
    return path.read_text()


def excerpt(text: str, start: str, stop=None) -> str:
    """The lines of `text` from the first that matches the regex `start` to the next that
    matches `stop` (just that line without one), each with its line number."""
    lines = text.splitlines()
    first = next((i for i, ln in enumerate(lines) if re.search(start, ln)), None)
    if first is None:
        raise ValueError(f"no line matches {start!r}")
    last = first if stop is None else next(
        (i for i in range(first, len(lines)) if re.search(stop, lines[i])), None)
    if last is None:  # a pattern that never matches would show the rest of the file
        raise ValueError(f"no line after {start!r} matches {stop!r} (one line at a time)")
    return "\n".join(f"{i + 1:4}  {lines[i]}" for i in range(first, last + 1))


def show_lines(stage, start, stop=None):
    """Show a few numbered lines of a stage's source (see excerpt): the part a notebook is
    talking about, where it is not a whole function."""
    _code(excerpt(_text(stage), start, stop))


def diff(old, new, context=3) -> str:
    """A unified diff between two stages' .cu files as they are here, exercise markers left out:
    exactly what the newer stage changed. In an edition it compares the kernels the student has
    (a stub where an exercise is handed out, their own code once written), so it never shows a
    solution the edition leaves out."""
    a, b = _stage(old), _stage(new)
    return "\n".join(_elide_removals(list(difflib.unified_diff(
        strip_markers(_source_text(a)).splitlines(), strip_markers(_source_text(b)).splitlines(),
        f"kernels/{a.slug}.cu", f"kernels/{b.slug}.cu", n=context, lineterm=""))))


# A removal longer than this many lines (a whole kernel that the newer stage takes from another
# stage's file instead, say) is shown by its first and last lines and a count.
LONG_REMOVAL = 24


def _elide_removals(lines, keep=(4, 2)) -> list:
    """A unified diff's lines with each run of more than LONG_REMOVAL removed lines cut to its
    first keep[0] and last keep[1], a line saying how many lie between. Only removals: every
    added line is shown."""
    out, run = [], []

    def flush():
        if len(run) > LONG_REMOVAL:
            out.extend(run[:keep[0]])
            out.append(f"-… {len(run) - sum(keep)} more lines removed …")
            out.extend(run[-keep[1]:])
        else:
            out.extend(run)
        run.clear()

    for line in lines:
        if line.startswith("-") and not line.startswith("---"):
            run.append(line)
        else:
            flush()
            out.append(line)
    flush()
    return out


def show_diff(old, new, context=3):
    """Show diff(old, new): what the newer stage changed."""
    _code(diff(old, new, context), "diff")

