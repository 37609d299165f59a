"""Build the notebooks from their sources, and execute them.

  python tools/notebooks.py build             notebooks/src/NN_x.py  ->  notebooks/NN_x.ipynb
  python tools/notebooks.py execute [NAMES]   run notebooks top to bottom, saving their outputs
                                              (NAMES: stems or prefixes: 08 = 08_* and 08a_*)
                                              (--no-save: just check that they run)
  python tools/notebooks.py check             exit 1 if any .ipynb's cells differ from its source

A source is a Python file in the percent format: a line '# %%' starts a code cell and
'# %% [markdown]' a markdown cell whose lines each begin with '# '. `build` keeps the outputs of
a cell whose source is unchanged, so committed outputs survive edits to other cells.
"""
import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "notebooks" / "src"
OUT = ROOT / "notebooks"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def parse(text: str):
    """[(kind, source)] cells of a percent-format script."""
    cells, kind, lines = [], None, []

    def flush():
        if kind is not None:
            body = "\n".join(lines).strip("\n")
            if kind == "markdown":
                body = "\n".join(ln[2:] if ln.startswith("# ") else ln.lstrip("#")
                                 for ln in body.splitlines())
            cells.append((kind, body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def notebook_for(src: Path, old=None):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata["language_info"] = {"name": "python"}
    previous = {}
    if old is not None:
        for c in old.cells:
            if c.cell_type == "code":
                previous.setdefault(c.source, c)
    for kind, body in parse(src.read_text()):
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(body))
        elif body in previous:
            keep = previous[body]
            cell = nbformat.v4.new_code_cell(body, outputs=keep.get("outputs", []),
                                             execution_count=keep.get("execution_count"))
            nb.cells.append(cell)
        else:
            nb.cells.append(nbformat.v4.new_code_cell(body))
    for i, c in enumerate(nb.cells):  # stable ids keep diffs small
        c["id"] = f"{prefix(src)}-{i:03d}"
    return nb


def target(src: Path) -> Path:
    return OUT / (src.stem + ".ipynb")


def prefix(src: Path) -> str:
    """What precedes the first '_' of a source's name: '08' for 08_tuned, '08a' for an appendix."""
    return src.stem.split("_")[0]


def wanted(src: Path, names) -> bool:
    """Whether NAMES select this source: its stem, its prefix, or its number (so '08' selects
    08_tuned and its appendix 08a_tuning_log; '08a' the appendix alone)."""
    return not names or src.stem in names or prefix(src) in names or src.stem[:2] in names


def build(names=None):
    for src in sorted(SRC.glob("*.py")):
        if not wanted(src, names):
            continue
        dst = target(src)
        old = nbformat.read(dst, as_version=4) if dst.exists() else None
        nbformat.write(notebook_for(src, old), dst)
        print(f"built {dst.relative_to(ROOT)}")


def differences():
    """Notebooks whose cells are not what their sources say."""
    bad = []
    for src in sorted(SRC.glob("*.py")):
        dst = target(src)
        want = [(k, s) for k, s in parse(src.read_text())]
        if not dst.exists():
            bad.append(f"{dst.name}: missing")
            continue
        have = [(c.cell_type, c.source) for c in nbformat.read(dst, as_version=4).cells]
        if have != want:
            bad.append(f"{dst.name}: cells differ from {src.relative_to(ROOT)}")
    return bad


def execute(names=None, timeout=1200, save=True):
    from nbclient import NotebookClient
    for src in sorted(SRC.glob("*.py")):
        if not wanted(src, names):
            continue
        path = target(src)
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        if save:
            nbformat.write(nb, path)
        print(f"executed {path.relative_to(ROOT)}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "execute", "check"])
    ap.add_argument("names", nargs="*", help="notebook stems or numbers (default: all)")
    ap.add_argument("--no-save", action="store_true", help="execute without writing outputs")
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.names)
    elif args.command == "execute":
        execute(args.names, save=not args.no_save)
    else:
        bad = differences()
        print("\n".join(bad) if bad else "notebooks match their sources")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
