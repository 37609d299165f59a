"""Editions: what an instructor hands out for one assignment. `flashlab student DIR --through NN
[--from MM]` writes one; the repository stays the solution edition.

    from flashlab.course import student
    print(student.write("week3", through=6, first=5))   # stages 01-06; 05 and 06 handed out
    student.write("week3", through=6, first=5, force=True)  # over what is there

An assignment hands out the exercises (CPU labs and kernel exercises) of consecutive stages
MM..NN, and the edition holds what the student needs for them, written from the files git tracks:

  * the stages up to NN, and no later one (a later stage's kernel holds this one's solution);
    before MM, every stage as solved (its assignment is past); from MM to NN, each exercise
    region with its stub (flashlab.markers: it compiles and fails its check) and each later
    region that carries a handed-out exercise's code (stage 06 keeps 05's softmax) with a stub
    too, for the student's own code to be carried forward;
  * the notebooks 00 to NN (08a from 08; of the notebooks about no one stage, each from the stage
    it builds on: ring attention, 98, from 20, the capstone 99 from 08), as flashlab.course.nbtext
    writes them: solutions `# YOUR CODE HERE`, instructor's answers `YOUR ANSWER HERE`, outputs
    cleared; their diffs are computed when run, against the kernels the student has;
  * the package, the recorded data/ (not the raw logs of data/runs/), README.md, pyproject.toml;
  * STUDENT.md (how to install, work, check and hand in) and edition.json (what is handed out).

Left out: tests/, tools/ and .ci/ (the solution's own), the instructor guide (TEACHING.md), and
anything git does not track. Before anything is written, every file of the edition is searched
for each handed-out exercise's solution: a kernel region's code lines (flashlab.markers.
solution_lines), a lab's answer code, an instructor's answer. An edition that would hold one is
not written: the error names the file and the line (a carried region is missing, say).
"""
import json
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import markers
from .. import paths
from .. import variants
from ..stages import stage as _stage
from ..stages import stages as _stages
from . import nbtext
from .nbtext import INSTRUCTOR, TEXT_STUB, EditionError  # noqa: F401 -- what tests read here

FORMAT = "flashlab-edition/1"
MANIFEST = "edition.json"                 # what an edition hands out; the top of an edition
MARKER = "STUDENT.md"                     # the students' guide, at the top of an edition
TOP_FILES = ("README.md", "pyproject.toml", "environment.yml", ".gitignore", "LICENSE")
TREES = ("flashlab/", "kernels/", "notebooks/", "data/")
LEFT_OUT = ("data/runs/", "notebooks/TEACHING.md", "notebooks/answers/")
# The notebooks about no one stage, and the stage each builds on: an edition through that stage
# has it, and its labs are handed out with that stage's exercises (Exercise.notebook).
BEYOND_STAGES = {98: 20,   # ring attention: a stage with a backward as the local attention, 20's
                 99: 8}    # the capstone: stages 05-08 in GPT-2
LAB_TRUTHS = "flashlab/course/labkeys.py"    # computes the labs' answers: never in an edition
LAB_KEYS = "flashlab/course/lab_keys.json"   # what an edition's labs check against instead
_NUMBERED = re.compile(r"^(kernels|kernels/variants|notebooks|notebooks/src)/(\d\d)[a-z]?_[^/]*$")


@dataclass(frozen=True)
class Assignment:
    """The stages an edition hands out: first..last, their labs and kernel exercises."""
    first: int
    last: int

    def __post_init__(self):
        numbers = [st.number for st in _stages()]
        for n in (self.first, self.last):
            if n not in numbers:
                raise ValueError(f"no stage {n}: the stages are {numbers[0]:02d}-{numbers[-1]:02d}")
        if self.first > self.last:
            raise ValueError(f"an assignment runs from an earlier stage to a later one, not "
                             f"{self.first:02d} to {self.last:02d}")

    @property
    def name(self) -> str:
        return f"{self.first:02d}" if self.first == self.last else f"{self.first:02d}-{self.last:02d}"

    def hands_out(self, number) -> bool:
        return self.first <= number <= self.last

    def stages(self) -> list:
        return [st for st in _stages() if self.hands_out(st.number)]

    def exercises(self, root=None) -> list:
        """The exercises handed out, in course order: the labs of these stages and the kernel
        exercises marked in their solution kernels (root/kernels/)."""
        from .exercises import EXERCISES
        from .kernels import _kernel_exercises
        kernel = {ex.id for ex in _kernel_exercises(root)} if root is not None else None
        return [ex for ex in EXERCISES if self.hands_out(_stage(ex.stage).number)
                and (ex.kind != "kernel" or kernel is None or ex.id in kernel)]


def assignment(through=None, first=None) -> Assignment:
    """--through NN [--from MM]: NN defaults to the last stage, MM to the first (the whole
    course, every exercise)."""
    numbers = [st.number for st in _stages()]
    last = numbers[-1] if through is None else _stage(through).number
    return Assignment(numbers[0] if first is None else _stage(first).number, last)


# --- which files, and how each is handed out -------------------------------------------------------

def tracked_files(root) -> list:
    """The files git tracks in root (an edition is written from these alone)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise ValueError(f"{root} is not a git checkout: an edition is written from the files "
                         f"git tracks there ({err})") from None
    return sorted(n for n in out.decode().split("\0") if n)


def number_of(rel: str):
    """The stage number a kernel or notebook file belongs to (08a -> 8, 99 -> 99), or None."""
    m = _NUMBERED.match(rel)
    return int(m.group(2)) if m else None


def left_out(rel: str, a: Assignment):
    """Why `rel` is not in the edition of assignment `a`, or None."""
    if rel in TOP_FILES:
        return None
    if rel == LAB_TRUTHS:
        return "the labs' answers (the edition has their salted keys instead)"
    if not rel.startswith(TREES):
        return "the solution's own (tests, tools, CI)" if "/" in rel else "not part of an edition"
    if rel.startswith(LEFT_OUT):
        return "for the instructor" if "TEACHING" in rel or "answers" in rel else "raw logs"
    n = number_of(rel)
    if n is not None and re.match(r"notebooks/(src/)?\d\d[a-z]_", rel) and a.hands_out(n):
        return "the appendix of a stage it hands out (it shows that stage's solution)"
    if n in BEYOND_STAGES:
        return None if a.last >= BEYOND_STAGES[n] else "after the assignment's stages"
    if n is not None and n > a.last:
        return "after the assignment's stages"
    return None


def _variant_patches() -> set:
    """The variant patches the registry names (kernels/NN_x.patch)."""
    return {f"kernels/{v.patch}" for st in _stages() for v in st.variants}


def _home_stubs(root) -> tuple:
    """({exercise id: its stub lines}, {exercise id: its stage slug}) from root's kernels."""
    stubs, homes = {}, {}
    for st in _stages():
        src = Path(root) / "kernels" / f"{st.slug}.cu"
        if src.is_file():
            for r in markers.exercises_in(src.read_text(), src.name):
                stubs[r.id], homes[r.id] = list(r.stub), st.slug
    return stubs, homes


def _transform(rel, data, ids, stubs, homes, stats):
    if rel.startswith("kernels/") and rel.endswith(".cu") and number_of(rel) is not None:
        text = data.decode()
        out = markers.edition_text(text, ids, stubs, homes, rel)
        n = sum(1 for r in markers.regions(text, rel) if r.id in ids)
        if n:
            stats["kernel_regions"] += n
            stats["kernels"].append(rel)
        return out.encode()
    if rel.endswith(".ipynb"):
        text, counts = nbtext.student_notebook(data.decode(), rel)
        nbtext._add(stats["notebooks"], counts)
        return text.encode()
    if rel.startswith("notebooks/") and rel.endswith(".py") and b"# %%" in data:
        text, counts = nbtext.student_source(data.decode(), rel)
        nbtext._add(stats["sources"], counts)
        return text.encode()
    return data


# --- the leak check --------------------------------------------------------------------------------

def _searchable(rel, data) -> str | None:
    """A file's text as the leak check reads it (a notebook: its cells and outputs), or None
    for a binary file."""
    if rel.endswith(".ipynb"):
        nb = json.loads(data)
        parts = []
        for cell in nb.get("cells", []):
            parts.append("".join(cell.get("source", "")))
            for out in cell.get("outputs", []):
                parts.append("".join(out.get("text", "")))
                parts += ["".join(v) for v in out.get("data", {}).values() if isinstance(v, (str, list))]
        return "\n".join(parts)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def hidden(root, a: Assignment, plan: dict) -> list:
    """[(what, normalized line)] that the edition of `a` must not contain: each handed-out kernel
    exercise's solution lines (less what the student has anyway: its stage's file outside the
    regions and the stages before it, as handed out), each handed-out lab's answer code, and
    every instructor's answer of the notebooks."""
    root = Path(root)
    found = []
    given = ""
    for st in _stages():
        rel = f"kernels/{st.slug}.cu"
        src = root / rel
        if not src.is_file():
            continue
        if rel in plan:
            given += "\n" + markers.flat(markers.strip_markers(plan[rel].decode()))
        if not a.hands_out(st.number):
            continue
        for r in markers.exercises_in(src.read_text(), rel):
            for line in markers.solution_lines(r, given):
                found += [(f"exercise {r.id}", piece)
                          for piece in [line, *markers.fragments(line, given)]]
    import nbformat
    handed = {ex.id for ex in a.exercises() if ex.kind == "lab"}
    for nb_path in sorted((root / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown" and nbtext.instructor_answer(cell.source):
                for line in cell.source.split("\n"):
                    n = markers.plain(line.replace(nbtext.INSTRUCTOR, ""))
                    if len(n) >= 40:
                        found.append((f"an instructor's answer in {nb_path.name}", n))
        for lab, i in nbtext.answer_cells(nb.cells).items():
            if lab in handed:
                for region in nbtext.solution_regions(nb.cells[i].source):
                    found += [(f"lab {lab}", code) for code in map(nbtext.python_code, region)
                              if code]
    return found


def leaks(plan: dict, found: list) -> list:
    """[(file, line number, what)] for each place the edition's files hold one of `found`."""
    out = []
    for rel, data in sorted(plan.items()):
        text = _searchable(rel, data)
        if text is None:
            continue
        lines = markers.plain(text).split("\n")
        for what, secret in found:
            for i, line in enumerate(lines):
                if secret in line:
                    out.append((rel, i + 1, what))
    return sorted(set(out))


# --- the edition -----------------------------------------------------------------------------------

def plan(root, a: Assignment, stats=None) -> tuple:
    """({path: bytes} of the edition of `a`, {path: why left out}), nothing written yet."""
    root = Path(root)
    stats = _new_stats() if stats is None else stats
    ids = {ex.id for ex in a.exercises(root) if ex.kind == "kernel"}
    stubs, homes = _home_stubs(root)
    files, out = {}, {}
    for rel in tracked_files(root):
        src = root / rel
        if not src.is_file():
            continue
        why = left_out(rel, a)
        if why:
            out[rel] = why
            continue
        try:
            if rel in _variant_patches():  # the edition gets the variant's kernel instead
                stage_text = (root / f"kernels/{_stage(number_of(rel)).slug}.cu").read_text()
                copy = variants.edition_file("kernels", Path(rel).name).as_posix()
                text = variants.patched(stage_text, src.read_text(), where=rel)
                files[copy] = _transform(copy, text.encode(), ids, stubs, homes, stats)
                out[rel] = f"a variant patch: the edition has the variant's kernel, {copy}"
                continue
            files[rel] = _transform(rel, src.read_bytes(), ids, stubs, homes, stats)
        except ValueError as err:  # a marker problem: nothing is written
            raise EditionError(f"cannot write the edition: {err}") from err
    from .labkeys import compile_keys
    keys = compile_keys(salt=secrets.token_hex(16))   # the assignment's labs only
    labs = {ex.id for ex in a.exercises(root) if ex.kind == "lab"}
    keys["labs"] = {lab: entry for lab, entry in keys["labs"].items() if lab in labs}
    files[LAB_KEYS] = (json.dumps(keys, indent=1) + "\n").encode()
    files["README.md"] = readme(a).encode()
    files[MANIFEST] = (json.dumps(manifest(root, a), indent=1) + "\n").encode()
    files[MARKER] = student_md(a, root).encode()
    return files, out


def manifest(root, a: Assignment) -> dict:
    """edition.json: the assignment, its exercises, and the solution it was written from."""
    return dict(format=FORMAT, assignment=a.name, first=a.first, last=a.last,
                stages=[st.slug for st in _stages() if st.number <= a.last],
                exercises=[dict(id=ex.id, kind=ex.kind, stage=ex.stage, points=ex.points,
                                title=ex.title, **({"notebook": ex.notebook} if ex.notebook else {}))
                           for ex in a.exercises(root)],
                solution_commit=_commit(root))


def read_manifest(root):
    """An edition's edition.json as a dict, or None where root is not an edition."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a flashlab edition manifest ({FORMAT})")
    return data


def _commit(root):
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _new_stats():
    return {"kernels": [], "kernel_regions": 0,
            "notebooks": {"solutions": 0, "hidden": 0, "instructor": 0, "outputs": 0},
            "sources": {"solutions": 0, "hidden": 0, "instructor": 0}}


def write(dest, root=None, through=None, first=None, force=False) -> str:
    """Write the edition of assignment --from `first` --through `through` (default: every stage)
    of `root` (default: this repository) to `dest`; returns a summary. FileExistsError where dest
    holds anything, unless force (files are written over; nothing else there is removed).
    EditionError, and nothing written, where the edition would hold a solution it hands out."""
    try:
        import nbformat  # noqa: F401 -- every notebook is rewritten cell by cell
    except ImportError:
        raise ValueError("writing an edition rewrites its notebooks with nbformat, which this "
                         "Python lacks: install flashlab with the course's extras, "
                         "pip install -e \".[grading]\" (or \".[notebooks]\")") from None
    root = Path(root or paths.ROOT).resolve()
    dest = Path(dest).resolve()
    if read_manifest(root) is not None:
        raise ValueError(f"{root} is an edition as handed out, not the solution: an edition is "
                         "written from the solution repository")
    a = assignment(through, first)
    if dest == root or dest in root.parents:
        raise ValueError(f"an edition cannot be written to {dest}: it holds the solution edition "
                         f"({root})")
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} is a file")
    if dest.exists() and any(dest.iterdir()) and not force:
        raise FileExistsError(f"{dest} is not empty: choose a new folder, or pass --force to "
                              "write over what is there")
    stats = _new_stats()
    files, out = plan(root, a, stats)
    found = leaks(files, hidden(root, a, files))
    if found:
        shown = "; ".join(f"{rel}:{n} holds {what}" for rel, n, what in found[:8])
        raise EditionError(f"assignment {a.name} cannot be written: {len(found)} place"
                           f"{'s' * (len(found) != 1)} would show a solution it hands out: {shown}"
                           + (" ..." if len(found) > 8 else ""))
    for rel, data in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        src = root / rel
        if src.is_file():
            shutil.copymode(src, path)
    return _summary(dest, a, stats, files, out)


def _count(n, noun) -> str:
    """'1 exercise', '3 exercises'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _summary(dest, a, s, files, out) -> str:
    nb = s["notebooks"]
    ex = a.exercises()
    lines = [f"wrote assignment {a.name} to {dest}: {len(files)} files, stages "
             f"01-{a.last:02d}, handing out {_count(len(ex), 'exercise')} "
             f"({', '.join(e.id for e in ex)})",
             f"  kernels: {_count(s['kernel_regions'], 'region')} stubbed in "
             f"{_count(len(s['kernels']), 'file')} "
             f"({', '.join(Path(k).stem for k in s['kernels']) or 'none'})",
             f"  notebooks: {nb['solutions']} solution regions and {nb['instructor']} "
             f"instructor's answers replaced, {nb['hidden']} hidden tests removed, "
             f"{nb['outputs']} outputs cleared"]
    by_why = {}
    for rel, why in out.items():
        by_why.setdefault(why, []).append(rel)
    for why, rels in sorted(by_why.items()):
        shown = ", ".join(rels[:3]) + (f", ... ({len(rels)} files)" if len(rels) > 3 else "")
        lines.append(f"  left out ({why}): {shown}")
    lines.append(f"next: give students this folder (a repository of its own, or a zip); they "
                 f"follow its {MARKER}")
    return "\n".join(lines)


# --- README.md and STUDENT.md ----------------------------------------------------------------------

def readme(a: Assignment) -> str:
    """The edition's README: what the folder is, and where to start (the solution's README
    describes files an edition leaves out)."""
    rows = "\n".join(f"| [{st.number:02d} — {st.title}](notebooks/{st.slug}.ipynb) | "
                     f"{'this assignment' if a.hands_out(st.number) else 'solved'} |"
                     for st in _stages() if st.number <= a.last)
    return f"""# flashlab, assignment {a.name}

A workbook that builds a FlashAttention kernel one optimisation at a time, and proves every step
with measurements: each stage is one CUDA file in `kernels/` and one notebook in `notebooks/`.
This folder is the edition of one assignment. **Start with [STUDENT.md](STUDENT.md)**: how to
install it, what to do, how to check your work and how to hand it in.

| stage | |
|---|---|
| [00 — setup and the GPU](notebooks/00_setup_and_the_gpu.ipynb) | read first |
{rows}

`data/` holds the measurements the notebooks replay where this machine cannot run a stage.
"""


# --- STUDENT.md ------------------------------------------------------------------------------------

def _needs(st) -> str:
    """"8.0+", or "7.5+ (bf16: 8.0+)" for a stage with a dtype that needs more."""
    cc = lambda c: ".".join(map(str, c))  # noqa: E731
    extra = getattr(st, "dtype_min_cc", {}) or {}
    more = ", ".join(f"{dt}: {cc(c)}+" for dt, c in extra.items() if tuple(c) > tuple(st.min_cc))
    return f"{cc(st.min_cc)}" + (" only" if st.arch_specific else "+") + (f" ({more})" if more else "")


# STUDENT.md's bullets for the kinds of exercise an assignment has, and for kernel exercises
# what a machine without a GPU can still check.
LAB_TEXT = """- A **lab** is three cells in the notebook's Exercises section: the question, the answer cell
  (predict the number, then replace `# YOUR CODE HERE` with `answer = ...`), and the check,
  which says right or wrong and why; a wrong answer stops *Run All* there, as an error does.
  Labs need no GPU.
"""
KERNEL_TEXT = """- A **kernel exercise** is a region of a stage's kernel, between `// BEGIN EXERCISE <id>` and
  `// END EXERCISE <id>`, holding a stub that compiles but gives wrong answers: write the code
  there and keep the two marker lines. It needs a GPU of the compute capability in the table
  (a T4 is 7.5, an A100 8.0, an H100 9.0). A stage's regions are checked together.{carried}
"""
COMPILE_ONLY = """

Without a GPU you can still compile a stage with your regions in it and read its machine code:
`flashlab sass NN` (NN the stage's number) needs the CUDA toolkit's `nvcc` and
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`; a compile error names the line. With
those, `flashlab grade --machine-code` also says of each kernel exercise whether its machine
code holds the instructions the stage's idea needs, as the grader reads it on a GPU (no points:
only a GPU can say whether it is right and how fast)."""


def student_md(a: Assignment, root=None) -> str:
    """STUDENT.md for assignment `a`: what is handed out and where, how to install on a laptop
    without a GPU, on Colab and on a GPU machine, how to check the work and how to hand it in."""
    from .kernels import SPEED_TOLERANCE
    root = Path(root or paths.ROOT)
    exs = a.exercises(root)
    tasks = {}
    for st in a.stages():
        src = root / "kernels" / f"{st.slug}.cu"
        if src.is_file():
            tasks.update({r.id: r.title for r in markers.exercises_in(src.read_text(), src.name)})
    rows = []
    for ex in exs:
        st = _stage(ex.stage)
        if ex.kind == "lab":
            where, gpu = f"`notebooks/{ex.home}.ipynb`, section Exercises", "none (CPU)"
        else:
            where, gpu = f"`kernels/{st.slug}.cu`", _needs(st)
        rows.append(f"| `{ex.id}` | {ex.kind} | {where} | {gpu} | {ex.points} | "
                    f"{tasks.get(ex.id, ex.title)} |")
    total = sum(ex.points for ex in exs)
    numbers = [f"{st.number:02d}" for st in a.stages()]
    its, which = (("its", f"stage {numbers[0]}") if len(numbers) == 1 else
                  ("their", f"stages {', '.join(numbers[:-1])} and {numbers[-1]}"))
    tasks_done = [f"read {its} notebook{'s' if len(numbers) > 1 else ''}"]
    if any(ex.kind == "lab" for ex in exs):
        tasks_done.append(f"answer {its} labs")
    if any(ex.kind != "lab" for ex in exs):
        tasks_done.append(f"write {its} kernel exercises")
    notebooks = f"{which}: " + (", ".join(tasks_done[:-1]) + " and " + tasks_done[-1]
                                if len(tasks_done) > 1 else tasks_done[0])
    carried = ""
    if any(markers.regions(p.read_text(), p.name) and any(
            r.carried and r.id in {e.id for e in exs} for r in markers.regions(p.read_text()))
           for p in sorted((root / "kernels").glob("[0-9][0-9]_*.cu"))
           if a.hands_out(number_of(f"kernels/{p.name}") or 0)):
        carried = ("\n  A later stage of this assignment keeps an earlier one's code: where its kernel\n"
                   "  says `// BEGIN CARRIED <id>`, write the code of exercise `<id>` again (copy\n"
                   "  yours from that exercise's own stage and fit it to the names around it). The\n"
                   "  later stage is checked with it, so it passes only once that region is written\n"
                   "  too.")
    kinds = ""
    if any(ex.kind == "lab" for ex in exs):
        kinds += LAB_TEXT
    if any(ex.kind != "lab" for ex in exs):
        kinds += KERNEL_TEXT.format(carried=carried)
    compile_only = COMPILE_ONLY if any(ex.kind != "lab" for ex in exs) else ""
    return f"""# flashlab, assignment {a.name}

This folder is your copy of the workbook for this assignment: stages 01 to {a.last:02d}, their
notebooks, and the recorded measurements the notebooks replay. You work on
{notebooks}.

| exercise | kind | where | GPU (compute capability) | points | task |
|---|---|---|---|---|---|
{chr(10).join(rows)}

{total} points in all.

{kinds}- The **questions for discussion** at the end of each notebook have a cell `YOUR ANSWER HERE`
  under them: write your answer there.

## Installing

You need Python 3.10 or newer. Make a virtual environment in this folder first:

    python3 -m venv .venv              # Windows: python -m venv .venv
    source .venv/bin/activate          # Windows: .venv\\Scripts\\activate

(`.gitignore` keeps `.venv/` out of your repository.)

**A laptop without an NVIDIA GPU** (every notebook replays the recorded measurements, and the
labs work): install PyTorch's CPU build first, then this folder with Jupyter.

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    pip install -e ".[notebooks]"

On a Mac, `pip install torch` is already the CPU build.

**A machine with an NVIDIA GPU and the CUDA toolkit** (`nvcc --version` works): PyTorch from
PyPI brings CUDA.

    pip install -e ".[notebooks]"

**Colab** (*Runtime → Change runtime type → T4 GPU* for stages 01-04 live): a notebook's first
cell clones your copy and installs it; Colab already has PyTorch and Jupyter.

    %cd /content
    !git clone -q <your copy's URL> flashlab
    %cd /content/flashlab
    !pip install -q -e .

Installing with `-e` matters: flashlab then builds the kernels in *this* folder's `kernels/`.
Open the notebooks with `jupyter lab notebooks/`.

## Checking your work

    flashlab grade                               # every exercise of this assignment
    flashlab grade --exercise {exs[0].id if exs else 'NN.name'}

`flashlab grade` grades what is in this folder the way your instructor will: each lab by
running its notebook top to bottom in a fresh Python, through the lab's answer cell (so an
answer that uses a name an earlier cell defines works, and one that needs a cell you have not
run does not); each kernel exercise by building its stage from your region, checking it and
timing it. Without a GPU the kernel exercises are skipped, saying why.{compile_only}

A kernel is checked against a float64 reference on random inputs and on inputs made to exercise
its idea (scores that grow along the keys, so that every rescale and fallback path runs; the
causal mask): every output element is first set to NaN, sequence lengths include 1, 17, 1000
and 4096, causal and not, each dtype the GPU runs. A wrong answer scores 0 and names the first
failing case and its first wrong element (batch, head, row, column, got, expected). A kernel
that passes is also read in its machine code: an instruction its stage's idea needs (stage 16's
fences, say) must be there, or it scores 0 with the missing one named. A right one is timed
against the stage before it, and scores points x min(1, speed / {SPEED_TOLERANCE}) of
the solution's speed: within {100 - round(100 * SPEED_TOLERANCE)} % of it earns every point. A
backward stage (14 on) is timed in its backward, which no earlier stage has: checking your own
work there, only rightness counts, and your instructor's grading times it against the solution.

## Handing in

Hand in this folder as your instructor asks:

- **a repository**: if you got this folder as a zip, make it one first (`git init`, `git add -A`,
  `git commit -m "assignment {a.name}"`), then push it where your instructor says
  (`git remote add origin <URL>`, `git push -u origin HEAD`); they `git clone` it;
- **a zip** of this folder, without `.venv/`;
- **from Colab**: download the notebooks you worked in (*File → Download → Download .ipynb*)
  and the kernels you changed, keeping their names (a copy named "Copy of ..." is fine).

What is graded is what you hand in: the notebooks (`.ipynb`; a notebook's `notebooks/src/*.py`
twin is read only where the `.ipynb` is missing) and your code between the exercise markers.
Nothing else you change counts, and no score you report yourself is read.
"""


write_student_edition = write
