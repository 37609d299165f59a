"""A student's hand-in, made gradable: whatever form it came in, the edition as handed out with
the student's work put in its place, and nothing else of theirs.

A hand-in is one of
  * a folder: a `git clone` of the student's repository, an unpacked zip, or loose files;
  * a .zip file;
holding, for each stage the assignment hands out, the notebook (`NN_slug.ipynb`, anywhere in
it; `notebooks/NN_slug.ipynb` first; "Copy of NN_slug.ipynb" and "NN_slug (1).ipynb" count as
it) and the kernel (`NN_slug.cu`; `kernels/NN_slug.cu` first). Notebooks and kernels named after
no stage of the edition are listed in the notes, never graded.
Where a notebook's .ipynb is missing, its jupytext twin (`notebooks/src/NN_slug.py`) stands in;
where both are there the .ipynb is what is graded (Colab saves only that one, and a clone's file
times say nothing).

make_work_tree copies the edition as handed out (the instructor's copy, with edition.json) and
puts in it: each handed-out notebook as the student's; each handed-out stage's kernel as the
edition's file with the student's code spliced into its exercise and carried regions
(flashlab.markers.splice: code that could reach outside its region is refused). Headers, other
stages, the package and the data stay the edition's.
"""
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import markers
from . import nbtext

SKIP = {".git", ".ipynb_checkpoints", "__pycache__", ".venv", "venv", "node_modules"}


@dataclass
class HandIn:
    name: str                   # the student (the folder's or the zip's name)
    source: Path                # what was handed in
    work: Path = None           # the tree that is graded
    notes: list = field(default_factory=list)       # what was found, and what was not
    problems: dict = field(default_factory=dict)    # {exercise id: why it cannot be graded}


def student_name(path: Path) -> str:
    path = Path(path)
    return path.stem if path.suffix.lower() == ".zip" else path.name


def _unpack(zip_path: Path, into: Path) -> Path:
    """Extract a zip safely (no absolute paths, no '..'); returns the folder."""
    with zipfile.ZipFile(zip_path) as z:
        for info in z.infolist():
            target = (into / info.filename).resolve()
            if into.resolve() not in target.parents and target != into.resolve():
                raise ValueError(f"{zip_path.name}: {info.filename} would land outside the folder")
        z.extractall(into)
    return into


def _files(root: Path) -> list:
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).parts
        if p.is_file() and not SKIP & set(rel) and not any(part.startswith(".") for part in rel):
            out.append(p)
    return out


def plain_name(name: str) -> str:
    """A file's name as it was handed out: "Copy of 02_coalesced.ipynb" (Colab's copy) and
    "02_coalesced (1).ipynb" (a browser's second download) are 02_coalesced.ipynb."""
    stem, dot, ext = name.rpartition(".")
    stem = re.sub(r"^(Copy of\s+)+", "", stem if dot else name)
    stem = re.sub(r"\s*\(\d+\)$", "", stem).strip()
    return f"{stem}.{ext}" if dot else stem


def find(files, name, prefer) -> Path | None:
    """The file called `name` among `files`, or named as a copy of it (plain_name): the exact
    name first, then one under a folder called `prefer`, then the shortest path."""
    hits = [p for p in files if plain_name(p.name) == name]
    if not hits:
        return None
    return min(hits, key=lambda p: (p.name != name, p.parent.name != prefer, len(p.parts), str(p)))


def _notebook(files, slug, dest: Path, notes):
    nb = find(files, f"{slug}.ipynb", "notebooks")
    if nb is not None:
        shutil.copyfile(nb, dest)
        notes.append(f"{slug}: notebook {nb.name}")
        return True
    notes.append(f"{slug}: no {slug}.ipynb handed in")
    src = find(files, f"{slug}.py", "src")
    if src is not None:
        nbtext.notebook_from_source(src, dest)
        notes[-1] += f"; its source {src.name} was graded instead"
        return True
    return False


def make_work_tree(handin: Path, edition: Path, into: Path, manifest: dict) -> HandIn:
    """The gradable tree of one hand-in (see the module's docstring), written under `into`."""
    handin, edition = Path(handin), Path(edition)
    h = HandIn(student_name(handin), handin)
    scratch = Path(tempfile.mkdtemp(prefix="handin-", dir=into))
    if handin.is_file() and handin.suffix.lower() == ".zip":
        root = _unpack(handin, scratch / "unpacked")
    elif handin.is_dir():
        root = handin
    elif handin.is_file() and handin.suffix.lower() in (".ipynb", ".cu", ".py"):
        root = scratch / "loose"
        root.mkdir()
        shutil.copyfile(handin, root / handin.name)
    else:
        raise ValueError(f"{handin}: a hand-in is a folder, a .zip, or a notebook or kernel file")
    files = _files(root)
    work = scratch / "work"
    shutil.copytree(edition, work, ignore=shutil.ignore_patterns(".git", "__pycache__",
                                                                 "*.egg-info", ".ipynb_checkpoints"))
    h.work = work
    exercises = manifest["exercises"]
    handed = {ex["id"] for ex in exercises}
    known = ({p.stem for p in (edition / "notebooks").glob("*.ipynb")}
             | {p.stem for p in (edition / "kernels").rglob("*.cu")})  # variants/ too
    stray = [p for p in files if p.suffix in (".ipynb", ".cu")
             and plain_name(p.name).rsplit(".", 1)[0] not in known]
    if stray:
        h.notes.append("not graded (not named as a notebook or kernel of this edition): "
                       + ", ".join(str(p.relative_to(root)) for p in stray[:8])
                       + (f" and {len(stray) - 8} more" if len(stray) > 8 else ""))
    home = {ex["id"]: ex.get("notebook") or ex["stage"] for ex in exercises}  # a lab's notebook
    for slug in sorted(set(home.values()) | {ex["stage"] for ex in exercises}):
        labs = [ex["id"] for ex in exercises if home[ex["id"]] == slug and ex["kind"] == "lab"]
        if labs and not _notebook(files, slug, work / "notebooks" / f"{slug}.ipynb", h.notes):
            for lab in labs:
                h.problems[lab] = f"no notebook {slug}.ipynb was handed in"
        kernel_ids = [ex["id"] for ex in exercises if ex["stage"] == slug and ex["kind"] == "kernel"]
        carried = _carried_ids(work / "kernels" / f"{slug}.cu", handed)
        if not kernel_ids and not carried:
            continue
        mine = find(files, f"{slug}.cu", "kernels")
        theirs = work / "kernels" / f"{slug}.cu"
        if mine is None:
            h.notes.append(f"{slug}: no kernel handed in")
            for kid in kernel_ids:
                h.problems[kid] = f"no {slug}.cu was handed in"
            continue
        try:
            spliced = markers.splice(theirs.read_text(), mine.read_text(errors="replace"),
                                     set(kernel_ids) | carried, where=f"{slug}.cu")
        except markers.MarkerError as err:
            for kid in kernel_ids:
                h.problems[kid] = f"the exercise markers are broken: {err}"
            continue
        theirs.write_text(spliced)
        h.notes.append(f"{slug}: kernel {mine.name}, regions {', '.join(sorted(set(kernel_ids) | carried))}")
    return h


def _carried_ids(path: Path, handed) -> set:
    """The handed-out exercises whose code a kernel of the edition carries."""
    if not path.is_file():
        return set()
    return {r.id for r in markers.regions(path.read_text(), path.name) if r.carried and r.id in handed}

