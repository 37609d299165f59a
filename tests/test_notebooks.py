"""The notebooks: each matches its percent-format source, and each runs top to bottom in replay
mode (no GPU) against a temporary copy of data/, without saving and without changing the repo."""
import hashlib
import os
import subprocess
import sys

import pytest

from flashlab import paths

ROOT = paths.ROOT
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))
CELL_TIMEOUT_S = 600


def test_notebooks_match_their_sources():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "notebooks.py"), "check"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "notebooks match their sources" in proc.stdout


@pytest.mark.parametrize("src", [pytest.param(p, id=p.stem) for p in SOURCES])
def test_sources_are_what_jupytext_writes(src):
    """Each source is already in the form jupytext (notebooks/jupytext.toml) writes it, so opening
    it or its notebook in Jupyter and saving leaves it unchanged."""
    import jupytext
    from jupytext.formats import long_form_one_format
    sys.path.insert(0, str(ROOT / "tools"))
    import notebooks as nbtool

    cfg = nbtool.config(src)
    fmt = long_form_one_format(nbtool.SOURCE_FORMAT)
    cfg.set_default_format_options(fmt)
    text = src.read_text()
    assert jupytext.writes(nbtool.read_source(src), fmt=fmt, config=cfg) == text, \
        (f"jupytext writes {src.name} otherwise (magics as '# %magic', say): save it from Jupyter, or run "
         f"`jupytext --to py:percent notebooks/{src.stem}.ipynb -o notebooks/src/{src.name}` after a build")


@pytest.mark.parametrize("notebook", [pytest.param(p, id=p.stem) for p in NOTEBOOKS])
def test_the_exercises_open_a_cell_of_their_own(notebook):
    """'## Exercises' starts a markdown cell: in a source, a blank line without a '# %% [markdown]'
    marker keeps the cell going, and the exercises would hide at the end of the discussion
    before them, where a student paging through cells (and the edition) would not find them."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    inside = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
              and any(l.strip() == "## Exercises" for l in c.source.splitlines()[1:])]
    assert not inside, f"{notebook.name}: cells {inside} hold '## Exercises' after other text"


def test_every_notebook_has_a_source():
    """Notebooks are built from notebooks/src/*.py (python tools/notebooks.py build), never
    edited by hand."""
    stems = {p.stem for p in SOURCES}
    orphans = [nb.name for nb in NOTEBOOKS if nb.stem not in stems]
    assert not orphans, f"notebooks without a source in notebooks/src: {orphans}"


def _snapshot():
    """Hashes of every file under the checkout's data/: replay must read it, never write it."""
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((ROOT / "data").rglob("*")) if p.is_file() and p.suffix != ".lock"}


@pytest.mark.slow
@pytest.mark.parametrize("notebook", [pytest.param(p, id=p.stem) for p in NOTEBOOKS])
def test_notebook_runs_in_replay_mode(notebook, data_dir, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this environment: the data copy, no GPU (replay even on a GPU machine),
    # and a backend that needs no screen.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own inline backend
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    assert os.environ["FLASHLAB_DATA"] == str(data_dir)
    before = _snapshot()
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if one fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert _snapshot() == before, "executing the notebook changed the repository's data/"


def _code_lines(src):
    """The lines of a notebook source's code cells (not its markdown)."""
    code = False
    for line in src.read_text().splitlines():
        if line.startswith("# %%"):
            code = "[markdown]" not in line
        elif code:
            yield line


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_a_notebook_reads_research_logs_only_through_run_log(src):
    """A student edition ships without data/runs/: a notebook that opened a log there itself would
    stop with a traceback in every edition holding it (15a did, in stage 17's). nb.run_log says in
    one line, under nb.unless_missing(), that the log is not in this copy."""
    bare = [ln for ln in _code_lines(src) if "runs_dir(" in ln or "data/runs" in ln]
    assert not bare, f"{src.name}: read data/runs/ through nb.run_log: {bare}"


def test_run_log_reads_a_log_and_says_when_this_copy_has_none(tmp_path, monkeypatch, capsys):
    from flashlab import notebook as nb
    monkeypatch.setenv("FLASHLAB_DATA", str(tmp_path))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.log").write_text("line one\n")
    assert nb.run_log("a.log") == "line one\n"
    with nb.unless_missing():
        nb.run_log("b.log")
        raise AssertionError("run_log returned for a log this copy does not have")
    assert "b.log: a research log of the full repository" in capsys.readouterr().out
