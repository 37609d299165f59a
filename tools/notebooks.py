"""Build the notebooks from their sources, and execute them.

  python tools/notebooks.py build [NAMES]     notebooks/src/NN_x.py  ->  notebooks/NN_x.ipynb
  python tools/notebooks.py execute [NAMES]   run notebooks top to bottom, saving their outputs
                                              (--no-save: just check that they run)
  python tools/notebooks.py check             exit 1 if any .ipynb's cells differ from its source
  python tools/notebooks.py refresh-labs [NAMES]
  python tools/notebooks.py refresh-diffs [NAMES]
  python tools/notebooks.py refresh-cells NAMES --match TEXT
                                              run notebooks in replay mode on this machine (no
                                              GPU: CUDA_VISIBLE_DEVICES empty, FLASHLAB_DATA a
                                              temporary copy of data/) and copy into the
                                              committed .ipynb only the outputs of the CPU labs'
                                              cells (prompt, answer, check), of the cells
                                              showing a diff of two kernels (source text), or of
                                              the code cells holding TEXT (a CPU model's table)

NAMES are stems or prefixes: 08 selects 08_tuned and its appendix 08a_tuning_log, 08a the
appendix alone; no NAMES, every notebook.

A source is a Python file in jupytext's percent format: '# %%' starts a code cell and
'# %% [markdown]' a markdown cell whose lines each begin with '# '. Jupytext pairs each
notebooks/NN_x.ipynb with notebooks/src/NN_x.py (notebooks/jupytext.toml), so either opens as a
notebook in Jupyter, and saving one there writes both. `build` is `jupytext --update`: it takes
the cells from the source and, from the notebook already there, the outputs, execution metadata
and ids of the cells it pairs them with. A code cell keeps its outputs only if its source is
unchanged, so committed outputs survive edits to other cells and no output stays beside code
that did not produce it.
"""
import argparse
import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

try:
    import jupytext
    from jupytext.combine import combine_inputs_with_outputs, map_outputs_to_inputs
    from jupytext.config import load_jupytext_config
    from jupytext.formats import long_form_multiple_formats, long_form_one_format
    from jupytext.paired_paths import find_base_path_and_format, paired_paths
except ImportError:  # `execute` needs only nbformat and nbclient (a GPU machine may lack jupytext)
    jupytext = None

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "notebooks" / "src"
OUT = ROOT / "notebooks"
SOURCE_FORMAT = "py:percent"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def config(path: Path = SRC):
    """The jupytext configuration that applies to `path` (notebooks/jupytext.toml)."""
    if jupytext is None:
        raise SystemExit("jupytext is not installed: pip install -e \".[notebooks]\" (or \".[test]\")")
    cfg = load_jupytext_config(str(path))
    if cfg is None or not cfg.formats:
        raise SystemExit(f"no jupytext configuration with paired formats applies to {path} "
                         f"(expected {(OUT / 'jupytext.toml').relative_to(ROOT)})")
    return cfg


def source_format(cfg=None) -> dict:
    """The sources' format, with the options the configuration sets for reading them."""
    fmt = long_form_one_format(SOURCE_FORMAT)
    (cfg or config()).set_default_format_options(fmt, read=True)
    return fmt


def read_source(src: Path):
    cfg = config(src)
    return jupytext.read(src, fmt=source_format(cfg), config=cfg)


def parse(text: str):
    """[(kind, source)] cells of a percent-format script, as jupytext reads it."""
    cfg = config()
    nb = jupytext.reads(text, fmt=source_format(cfg), config=cfg)
    return [(c.cell_type, c.source) for c in nb.cells]


def target(src: Path) -> Path:
    """The notebook jupytext pairs with a source."""
    cfg = config(src)
    formats = long_form_multiple_formats(cfg.default_formats(str(src)))
    _, fmt = find_base_path_and_format(str(src), formats)
    for path, f in paired_paths(str(src), fmt, formats):
        if f["extension"] == ".ipynb":
            return Path(path)
    raise SystemExit(f"{cfg.formats} pairs {src} with no .ipynb")


def prefix(src: Path) -> str:
    """What precedes the first '_' of a source's name: '08' for 08_tuned, '08a' for an appendix."""
    return src.stem.split("_")[0]


def notebook_for(src: Path, old=None):
    """The notebook of a source; `old`, the notebook there now, lends its outputs and ids."""
    new = read_source(src)
    if old is None:
        nb, pairs = new, [None] * len(new.cells)
        nb.metadata = nbformat.NotebookNode(kernelspec=KERNEL, language_info={"name": "python"})
    else:
        pairs = map_outputs_to_inputs(new.cells, old.cells)  # what combine pairs each cell with
        nb = combine_inputs_with_outputs(new, old, fmt=SOURCE_FORMAT)
        for cell, j in zip(nb.cells, pairs):
            # jupytext also pairs an edited cell (by its content up to formatting, or by position)
            # and keeps its outputs: outputs recorded from other code would mislead, so drop them.
            if cell.cell_type == "code" and j is not None and old.cells[j].source != cell.source:
                cell.outputs, cell.execution_count = [], None
                cell.metadata.pop("execution", None)
        nb.metadata.setdefault("kernelspec", KERNEL)
        nb.metadata.setdefault("language_info", {"name": "python"})
    # nbgrader's cell metadata, by flashlab's rules: the committed notebooks are nbgrader's
    # source notebooks as they are (flashlab.course.nbgrader)
    from flashlab.course.nbgrader import apply
    apply(nb, src.stem)
    # A cell paired with one already there keeps its id; a new one gets the first free
    # '<prefix>-<index>' (stable ids keep diffs small).
    taken = {c.get("id") for c, j in zip(nb.cells, pairs) if j is not None}
    for i, (cell, j) in enumerate(zip(nb.cells, pairs)):
        if j is None:
            cid, k = f"{prefix(src)}-{i:03d}", 1
            while cid in taken:
                cid, k = f"{prefix(src)}-{i:03d}-{k}", k + 1
            cell["id"] = cid
            taken.add(cid)
    return nb


def wanted(src: Path, names) -> bool:
    """Whether NAMES select this source (or notebook): its stem, its prefix, or its number (so '08' selects
    08_tuned and its appendix 08a_tuning_log; '08a' the appendix alone)."""
    return not names or src.stem in names or prefix(src) in names or src.stem[:2] in names


def build(names=None):
    for src in sorted(SRC.glob("*.py")):
        if not wanted(src, names):
            continue
        dst = target(src)
        old = jupytext.read(dst, fmt="ipynb") if dst.exists() else None
        jupytext.write(notebook_for(src, old), dst, fmt="ipynb")
        print(f"built {dst.relative_to(ROOT)}")


def differences():
    """Notebooks whose cells are not what their sources say."""
    bad = []
    for src in sorted(SRC.glob("*.py")):
        dst = target(src)
        if not dst.exists():
            bad.append(f"{dst.name}: missing")
            continue
        want = [(c.cell_type, c.source) for c in read_source(src).cells]
        nb = jupytext.read(dst, fmt="ipynb")
        have = [(c.cell_type, c.source) for c in nb.cells]
        from flashlab.course.nbgrader import cell_metadata
        if [c.metadata.get("nbgrader") for c in nb.cells] != cell_metadata(nb.cells, dst.stem):
            bad.append(f"{dst.name}: its nbgrader metadata is not flashlab.course.nbgrader's "
                       "(run `python tools/notebooks.py build`)")
        if have != want:
            i = next((i for i, (h, w) in enumerate(zip(have, want)) if h != w), min(len(have), len(want)))
            bad.append(f"{dst.name}: cells differ from {src.relative_to(ROOT)} from cell {i} on "
                       f"({len(have)} cells, the source {len(want)})")
    return bad


def execute(names=None, timeout=1200, save=True):
    """Run the notebooks as they are (build them first); no jupytext needed."""
    from nbclient import NotebookClient
    for path in sorted(OUT.glob("*.ipynb")):
        if not wanted(path, names):
            continue
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        if save:
            nbformat.write(nb, path)
        print(f"executed {path.relative_to(ROOT)}", flush=True)


def lab_cells(nb) -> dict:
    """{lab id: (prompt, answer, check) cell indices} of a notebook whose labs follow the
    three-cell form: `print(labs.prompt(ID))`, the solution between the markers, then
    `labs.check(ID, answer)` alone. A lab whose cells are not so laid out is an error."""
    found = {}
    for i, cell in enumerate(nb.cells):
        from flashlab.course.nbtext import prompt_of
        lab = prompt_of(cell.source) if cell.cell_type == "code" else None
        if not lab:
            continue
        answer, check = (nb.cells[j] if j < len(nb.cells) else None for j in (i + 1, i + 2))
        if (answer is None or check is None or answer.cell_type != "code"
                or not answer.source.startswith("### BEGIN SOLUTION")
                or not answer.source.rstrip().endswith("### END SOLUTION")
                or check.source.strip() != f'labs.check("{lab}", answer)'):
            raise SystemExit(f"lab {lab}: not the three cells prompt, answer, check (cell {i})")
        found[lab] = (i, i + 1, i + 2)
    return found


def diff_cells(nb) -> dict:
    """{"diff": indices of the cells that show a diff of two kernels (nb.show_diff)}: their
    output is the kernels' source text, the same on any machine."""
    found = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "nb.show_diff(" in c.source]
    return {"diff": tuple(found)} if found else {}


def refresh_labs(names=None, timeout=1200, select=lab_cells):
    """Execute each selected notebook that has labs (or the cells `select` picks), as it is, in
    replay mode (no GPU; data/ copied to a temporary folder, so the recorded tables are not
    touched), and copy into the notebook on disk the outputs, execution counts and timings of
    those cells only: cells whose output is computed on the CPU from the source tree (a lab's
    question and check, a diff of two kernels). Every other cell keeps the outputs of the run
    that recorded them."""
    from nbclient import NotebookClient
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "FLASHLAB_DATA")}
    with tempfile.TemporaryDirectory(prefix="flashlab-labs-") as tmp:
        shutil.copytree(ROOT / "data", Path(tmp) / "data")
        os.environ.update(CUDA_VISIBLE_DEVICES="", FLASHLAB_DATA=str(Path(tmp) / "data"))
        try:
            for path in sorted(OUT.glob("*.ipynb")):
                if not wanted(path, names):
                    continue
                nb = nbformat.read(path, as_version=4)
                labs = select(nb)
                if not labs:
                    continue
                run = copy.deepcopy(nb)
                NotebookClient(run, timeout=timeout, kernel_name="python3", allow_errors=True,
                               resources={"metadata": {"path": str(path.parent)}}).execute()
                others = [f"cell {i} ({o.ename})" for i, c in enumerate(run.cells)
                          if c.cell_type == "code" for o in c.get("outputs", [])
                          if o.output_type == "error"]
                if others:
                    print(f"{path.name}: errors in replay (outputs not copied): "
                          + ", ".join(others), flush=True)
                for lab, cells in labs.items():
                    for i in cells:
                        errors = [o for o in run.cells[i].outputs if o.output_type == "error"]
                        if errors:
                            raise SystemExit(f"{path.name}, lab {lab}, cell {i}: "
                                             f"{errors[0].ename}: {errors[0].evalue}")
                        nb.cells[i].outputs = run.cells[i].outputs
                        nb.cells[i].execution_count = run.cells[i].execution_count
                        if "execution" in run.cells[i].metadata:
                            nb.cells[i].metadata["execution"] = run.cells[i].metadata["execution"]
                nbformat.write(nb, path)
                print(f"refreshed the {select.__name__.replace('_', ' ')} of {path.relative_to(ROOT)}: "
                      f"{', '.join(labs)}", flush=True)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "execute", "check", "refresh-labs", "refresh-diffs",
                                        "refresh-cells"])
    ap.add_argument("--match", help="refresh-cells: the text a code cell's source holds")
    ap.add_argument("names", nargs="*", help="notebook stems or numbers (default: all)")
    ap.add_argument("--no-save", action="store_true", help="execute without writing outputs")
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.names)
    elif args.command == "execute":
        execute(args.names, save=not args.no_save)
    elif args.command == "refresh-labs":
        refresh_labs(args.names)
    elif args.command == "refresh-diffs":
        refresh_labs(args.names, select=diff_cells)
    elif args.command == "refresh-cells":
        if not args.match:
            raise SystemExit("refresh-cells needs --match TEXT")

        def matching_cells(nb):
            found = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and args.match in c.source]
            return {args.match: tuple(found)} if found else {}
        refresh_labs(args.names, select=matching_cells)
    else:
        bad = differences()
        print("\n".join(bad) if bad else "notebooks match their sources")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
