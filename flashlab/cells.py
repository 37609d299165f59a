"""The cells of a notebook file, in either of its forms: the .ipynb (nbformat, or its JSON where
nbformat is not installed) or its jupytext percent-format source (.py). One reader for the
report's handout (the discussion questions) and the course's lab grader (the answer cells)."""
import json
from pathlib import Path


def read(path) -> list:
    """[(cell type, source text)] of a notebook file, in order."""
    path = Path(path)
    if path.suffix == ".py":
        import jupytext  # installed with the notebooks' and the tests' extras
        nb = jupytext.read(path, fmt="py:percent")
        return [(c.cell_type, c.source) for c in nb.cells]
    try:
        import nbformat
    except ImportError:
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
        join = lambda src: src if isinstance(src, str) else "".join(src)  # noqa: E731
        return [(c.get("cell_type"), join(c.get("source", ""))) for c in cells]
    return [(c.cell_type, c.source) for c in nbformat.read(str(path), as_version=4).cells]


def code(path) -> list:
    """The source of each code cell of a notebook file."""
    return [src for kind, src in read(path) if kind == "code"]
