"""A lab graded in its notebook's own context: the notebook run top to bottom in a fresh Python
(nbclient, a Jupyter kernel of this interpreter), through the lab's answer cell, and the value
of `answer` it leaves read back, so that what the notebook says right the grader says right.

    from flashlab.course import labrun
    got = labrun.answers(Path("edition/notebooks/02_coalesced.ipynb"), ["02.sectors"])
    got["02.sectors"]          # Answer(status="answered", value=32, why="")

The student's code runs in the kernel, a process of its own: it can set `answer` and nothing
else the grader reads. The grader checks the value itself, in its own process
(flashlab.course.labs.answer_check), so a notebook that replaces the checker, or prints a verdict,
changes nothing. A cell that runs past `cell_timeout` seconds stops the run: the labs not yet
read time out. Cells that raise do not stop it (as nbgrader's autograder runs a submission):
the answer cell's own error decides whether the lab is blank or broken.

The kernel runs in replay mode (CUDA_VISIBLE_DEVICES empty): a lab needs no GPU, and grading
must not build or time kernels on the machine's GPU. Its data/ and its flashlab package are the
edition's own (package_root), as the student had them: the solution's labkeys, which computes the
labs' answers, is not importable there.
"""
import json
import os
import secrets
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import nbtext

CELL_TIMEOUT_S = 120
KERNEL_NAME = "flashlab-grade"
STATUSES = ("answered", "blank", "error", "timeout", "missing")


@dataclass(frozen=True)
class Answer:
    status: str      # one of STATUSES
    value: object = None
    why: str = ""


# The cell run after an answer cell: prints `answer` as JSON after a marker the student's code
# cannot have seen. Containers keep their kind; numpy values become Python ones.
_READ = r'''
def _flashlab_plain(x, depth=0):
    if depth > 4:
        return {"__repr__": repr(x)[:200]}
    try:
        import numpy as _np
        if isinstance(x, _np.ndarray):
            return {"__list__": [_flashlab_plain(v, depth + 1) for v in x.tolist()][:4096]}
        if isinstance(x, _np.generic):
            x = x.item()
    except ImportError:
        pass
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple, set, frozenset)):
        kind = "tuple" if isinstance(x, tuple) else "list"
        items = sorted(x, key=repr) if isinstance(x, (set, frozenset)) else list(x)
        return {f"__{kind}__": [_flashlab_plain(v, depth + 1) for v in items[:4096]]}
    return {"__repr__": repr(x)[:200]}
try:
    _flashlab_answer = {"value": _flashlab_plain(answer)}
except NameError:
    _flashlab_answer = {"missing": True}
print("%(mark)s" + __import__("json").dumps(_flashlab_answer), flush=True)
'''


def _decode(x):
    if isinstance(x, dict):
        if "__tuple__" in x:
            return tuple(_decode(v) for v in x["__tuple__"])
        if "__list__" in x:
            return [_decode(v) for v in x["__list__"]]
        if "__repr__" in x:
            return x["__repr__"]
    return x


def kernelspec_dir() -> Path:
    """A folder holding one kernel spec that runs this interpreter, whatever other kernels the
    machine has registered (a user-wide "python3" may be another environment's Python)."""
    d = Path(tempfile.mkdtemp(prefix="flashlab-kernel-"))
    spec = d / KERNEL_NAME
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "flashlab grade", "language": "python"}))
    return d


def answers(notebook: Path, labs, cell_timeout=CELL_TIMEOUT_S, data_dir=None,
            package_root=None) -> dict:
    """{lab id: Answer} for each of `labs` in `notebook` (an .ipynb), read by running the notebook
    through the last of their answer cells in a fresh kernel (see the module's docstring).
    package_root: a tree whose flashlab/ the notebook imports, ahead of any other (the edition as
    handed out, in whose package the labs' answers are not: a cell that reaches for them finds
    nothing)."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    notebook = Path(notebook)
    try:
        nb = nbformat.read(notebook, as_version=4)
    except Exception as err:  # noqa: BLE001 -- a hand-in may be any file
        return {lab: Answer("missing", why=f"{notebook.name} is not a readable notebook ({err})")
                for lab in labs}
    where = nbtext.answer_cells(nb.cells)
    out = {lab: Answer("missing", why=f"{notebook.name} has no cell that prints "
                                      f"labs.prompt(\"{lab}\") or runs labs.check(\"{lab}\", "
                                      "answer)")
           for lab in labs if lab not in where}
    wanted = sorted((where[lab], lab) for lab in labs if lab in where)
    if not wanted:
        return out
    mark = f"FLASHLAB-ANSWER-{secrets.token_hex(8)} "
    cells, reads = [], {}
    for i, cell in enumerate(nb.cells[:wanted[-1][0] + 1]):
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cells.append(cell)
        for j, lab in wanted:
            if j == i:
                reads[lab] = (len(cells) - 1, len(cells))
                cells.append(nbformat.v4.new_code_cell(_READ % {"mark": mark}))
    nb.cells = cells
    spec_dir = kernelspec_dir()
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(
        kernel_dirs=[str(spec_dir)], ensure_native_kernel=False))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_MARK")}  # the grader's own
    env.update(CUDA_VISIBLE_DEVICES="", PYDEVD_DISABLE_FILE_VALIDATION="1", MPLBACKEND="Agg")
    if data_dir is not None:
        env["FLASHLAB_DATA"] = str(data_dir)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(package_root),
                                             *filter(None, [env.get("PYTHONPATH")])])
    client = NotebookClient(nb, km=km, timeout=cell_timeout, allow_errors=True,
                            interrupt_on_timeout=False, startup_timeout=120,
                            resources={"metadata": {"path": str(notebook.parent)}})
    stopped = None
    try:
        # the kernel's own stdout and stderr go nowhere: what it prints reaches the grader only
        # through the notebook's outputs
        client.execute(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except CellTimeoutError:
        stopped = (f"a cell ran for more than {cell_timeout} s (does a loop never end?); the "
                   "notebook was stopped there")
    except DeadKernelError as err:
        stopped = f"the notebook's Python died: {err}"
    except Exception as err:  # noqa: BLE001 -- the student's notebook may fail in any way
        stopped = f"the notebook could not be run: {type(err).__name__}: {err}"
    finally:
        _stop(km)
    for lab, (ans_i, read_i) in reads.items():
        out[lab] = _read(nb.cells, ans_i, read_i, mark, stopped, lab)
    return out


def _stop(km):
    """Shut the notebook's kernel down. nbclient stops only kernels whose manager it made, and
    this one is ours: a cell stopped at its timeout would otherwise go on running, a process
    spinning for every hand-in whose loop never ends."""
    from nbclient.util import run_sync
    try:
        if run_sync(km.is_alive)():
            run_sync(km.shutdown_kernel)(now=True)
    except Exception:  # noqa: BLE001 -- a kernel that never started, or is gone already
        pass


def _read(cells, ans_i, read_i, mark, stopped, lab) -> Answer:
    printed = "".join(o.get("text", "") for o in cells[read_i].get("outputs", [])
                      if o.get("output_type") == "stream")
    lines = [ln for ln in printed.splitlines() if ln.startswith(mark)]
    if not lines:
        if stopped:
            return Answer("timeout" if "more than" in stopped else "error", why=stopped)
        return Answer("error", why="the notebook stopped before the answer could be read")
    got = json.loads(lines[-1][len(mark):])
    errors = [o for o in cells[ans_i].get("outputs", []) if o.get("output_type") == "error"]
    if any(e.get("ename") == "NotImplementedError" for e in errors):
        return Answer("blank", why="not answered yet: the answer cell still raises "
                                   "NotImplementedError (replace it with `answer = ...`)")
    if "missing" in got:
        if errors:
            e = errors[0]
            return Answer("error", why=f"the answer cell raised {e.get('ename')}: "
                                       f"{e.get('evalue')}")
        return Answer("blank", why="the answer cell sets no `answer`")
    return Answer("answered", _decode(got["value"]))
