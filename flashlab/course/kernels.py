"""Kernel exercises: regions of the real kernels that the student writes, and their grading.

A region is marked in kernels/NN_*.cu (the repository is the solution edition):

    // BEGIN EXERCISE 03.coarsen_kernel: <the task, in a sentence>
    // <the task, continued: comment lines right after BEGIN belong to it>
    ...the solution code (it starts with a line that is not a comment)...
    // STUB: // TODO: <what the stub leaves undone>
    // STUB: <code that compiles and gives a wrong answer>
    // END EXERCISE 03.coarsen_kernel

The markers are where an exercise is declared: KERNEL_EXERCISES is read from them (the id, the
stage whose .cu holds it, the task's first clause as its title, and its points: 10, or as many as
"// BEGIN EXERCISE 05.quad_sum (5 points): ..." gives). Every marker line is a comment, so the
solution edition compiles to exactly the code it had before the markers. The student edition
(flashlab.course.student) keeps BEGIN, the task and END, and puts the STUB lines' code (the
text after "// STUB: ", at the markers' indentation) where the solution was: it compiles, never
hangs, never reads out of bounds, and fails the stage's check. Its first line is always a
"// TODO:" comment; a region that still holds one has not been written.

grade_kernel(ex, root) builds ex's stage from root/kernels/, checks it (flashlab.check: float64
reference, NaN-poisoned output, ragged N, both masks, each dtype this GPU runs) and, when it is
right, times it against the reference stage (the stage before, built from the same edition):

    speed = the solution's time, estimated / the student's time, where the solution's time is
            the reference's time measured now / the solution's recorded speedup over the reference
            (data/results.csv, on this GPU model where recorded, else the GPU that recorded last);
            where no reference stage of the edition passes its check, the solution's recorded time
            on this GPU model stands in.
    score = 0 if the check fails, else points * min(1, speed / 0.95)

Within 5 % of the solution (timing noise) earns full points; half the solution's speed earns
about half. Where nothing recorded says how fast the solution is, a right answer earns full
points and the message says that speed was not scored. A wrong one names the first failing case
and its first wrong element (batch, head, row, column, got, expected).

Each stage is built, checked and timed in a child process (a crash or a hang in a student's
kernel takes only that process with it), at most once per edition, stage and source text.
"""
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..stages import stages
from . import Exercise, Result

# --- the exercises ---------------------------------------------------------------------------------

# KERNEL_EXERCISES, at the end of this section: read from the kernels' own markers.

# --- the markers -----------------------------------------------------------------------------------

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)// BEGIN EXERCISE (?P<id>\S+)"
                    r"(?: \((?P<points>\d+) points?\))?: (?P<task>\S.*)$")
DEFAULT_POINTS = 10
_STUB = re.compile(r"^(?P<indent>[ \t]*)// STUB:(?: (?P<code>.*))?$")
_END = re.compile(r"^(?P<indent>[ \t]*)// END EXERCISE (?P<id>\S+)\s*$")
_ID = re.compile(r"\d\d\.[a-z][a-z0-9_]*")
TODO = "// TODO:"


class MarkerError(ValueError):
    """An exercise region is not well formed; the message names the file and line."""


@dataclass(frozen=True)
class Region:
    """One exercise region of a .cu file. Line numbers are 0-based indices into its lines."""
    id: str
    indent: str
    begin: int          # the BEGIN line
    end: int            # the END line
    task: str           # the BEGIN line's task and the comment lines after it, joined
    task_lines: int     # BEGIN and its continuation lines
    body: tuple         # the code between the task and the STUB lines (or END): the solution,
    #                     or in a student edition the student's code
    stub: tuple         # the stub's code lines ("// STUB: " removed, indentation kept); () where
    #                     the file is a student edition
    points: int = DEFAULT_POINTS  # "// BEGIN EXERCISE id (5 points): ..." gives fewer

    @property
    def title(self) -> str:
        """The task's first clause: up to its first ':', ';' or '.' that ends a word."""
        return re.split(r"(?<=\S)[:;.](?=\s|$)", self.task, maxsplit=1)[0].strip()

    @property
    def unwritten(self) -> bool:
        """True while the region's code still holds the stub's TODO line."""
        return any(line.strip().startswith(TODO) for line in self.body)


def regions(text: str, where="kernel", solution=None) -> list:
    """The exercise regions of a .cu file's text, in order. MarkerError where they are not well
    formed: BEGIN without END (or the other way), nesting, a different id at END, a repeated id,
    markers at different indentations, STUB lines that are not all just before END, an empty
    solution. solution=True also requires the STUB lines (a solution edition); False forbids them
    (a student edition); None takes either."""
    lines = text.splitlines()
    found, seen, i = [], set(), 0

    def fail(n, why):
        raise MarkerError(f"{where}:{n + 1}: {why}")

    while i < len(lines):
        line = lines[i]
        if _END.match(line) or _STUB.match(line):
            fail(i, "STUB or END EXERCISE outside a region")
        m = _BEGIN.match(line)
        if not m:
            if "EXERCISE" in line and re.search(r"//\s*(BEGIN|END)\s+EXERCISE", line):
                fail(i, f"not a well-formed marker: {line.strip()!r} (want '// BEGIN EXERCISE "
                        "NN.name: task' or '// END EXERCISE NN.name')")
            i += 1
            continue
        rid, indent, begin = m["id"], m["indent"], i
        if not _ID.fullmatch(rid):
            fail(i, f"exercise id {rid!r} is not NN.lower_case_name")
        if rid in seen:
            fail(i, f"exercise {rid} is marked twice")
        seen.add(rid)
        task = [m["task"].strip()]
        i += 1
        while i < len(lines) and lines[i].startswith(indent + "//") and not (
                _BEGIN.match(lines[i]) or _STUB.match(lines[i]) or _END.match(lines[i])
                or lines[i].strip().startswith(TODO)):
            task.append(lines[i].strip()[2:].strip())
            i += 1
        task_lines = i - begin
        body, stub = [], []
        while True:
            if i >= len(lines):
                fail(begin, f"BEGIN EXERCISE {rid} has no END EXERCISE {rid}")
            line = lines[i]
            if _BEGIN.match(line):
                fail(i, f"BEGIN EXERCISE inside exercise {rid}")
            e = _END.match(line)
            if e:
                if e["id"] != rid:
                    fail(i, f"END EXERCISE {e['id']} closes exercise {rid}")
                if e["indent"] != indent:
                    fail(i, f"END EXERCISE {rid} is not indented as its BEGIN")
                break
            s = _STUB.match(line)
            if s:
                if s["indent"] != indent:
                    fail(i, f"a STUB line of {rid} is not indented as its BEGIN")
                stub.append(indent + s["code"] if s["code"] else "")
            elif stub:
                fail(i, f"code after the STUB lines of {rid}: they must come last, before END")
            else:
                body.append(line)
            i += 1
        if solution is True:
            if not stub:
                fail(i, f"exercise {rid} has no STUB lines")
            if not any(ln.strip() for ln in body):
                fail(begin, f"exercise {rid} has no solution code")
            if not stub[0].strip().startswith(TODO):
                fail(begin, f"the stub of {rid} must start with a '{TODO} ...' line")
        if solution is False and stub:
            fail(i, f"exercise {rid} still has STUB lines: not a student edition")
        found.append(Region(rid, indent, begin, i, " ".join(task), task_lines, tuple(body),
                            tuple(stub), int(m["points"] or DEFAULT_POINTS)))
        i += 1
    return found


def _kernel_exercises() -> tuple:
    """One Exercise per marked region of every stage's kernel, in stage order: the .cu file is
    the one place an exercise is declared (adding a stage stays its .cu, its registry entry and
    its notebook)."""
    return tuple(Exercise(r.id, st.slug, "kernel", r.title, r.points)
                 for st in stages()
                 for r in regions(st.source.read_text(), where=st.source.name, solution=True))


KERNEL_EXERCISES = _kernel_exercises()


def _join(lines, text):
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def student_text(text: str, where="kernel") -> str:
    """The student edition of a solution .cu file: each region's solution and STUB lines become
    the stub's code; BEGIN, the task and END stay."""
    lines = text.splitlines()
    out, last = [], 0
    for r in regions(text, where, solution=True):
        out += lines[last:r.begin + r.task_lines]
        out += list(r.stub)
        out.append(lines[r.end])
        last = r.end + 1
    return _join(out + lines[last:], text)


def strip_markers(text: str, where="kernel") -> str:
    """A solution .cu file without its exercise markers: BEGIN, the task, STUB and END lines gone,
    the solution code left. It compiles to the same machine code (the markers are comments)."""
    lines = text.splitlines()
    drop = set()
    for r in regions(text, where, solution=True):
        drop |= set(range(r.begin, r.begin + r.task_lines))
        drop |= set(range(r.end - len(r.stub), r.end + 1))
    return _join([ln for n, ln in enumerate(lines) if n not in drop], text)


def stage_regions(root=paths.ROOT) -> dict:
    """{stage slug: [Region]} for every kernels/NN_*.cu of root that marks any."""
    out = {}
    for p in sorted(Path(root, "kernels").glob("[0-9][0-9]_*.cu")):
        found = regions(p.read_text(), str(p))
        if found:
            out[p.stem] = found
    return out


# --- the first wrong element -----------------------------------------------------------------------

# An element is wrong when |got - expected| > ATOL + RTOL |expected| (or got is NaN or inf).
# The check itself compares whole outputs (relative error against a per-dtype tolerance); these
# bounds only point at where to look, loose enough that a right kernel has no element past them.
ELEMENT_TOL = {"fp32": (1e-3, 1e-3), "fp16": (1e-2, 1e-2), "bf16": (5e-2, 5e-2)}


@dataclass(frozen=True)
class Element:
    batch: int
    head: int
    row: int
    column: int
    got: float
    expected: float

    def __str__(self):
        return (f"batch {self.batch}, head {self.head}, row {self.row}, column {self.column}: "
                f"got {self.got:.6g}, expected {self.expected:.6g}")


def _as_float64(got, expected):
    import torch

    if tuple(got.shape) != tuple(expected.shape):
        raise ValueError(f"got has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.dim() != 4:
        raise ValueError(f"want (B, H, N, D) tensors, got shape {tuple(got.shape)}")
    return (got.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64))


def _element(flat, g, e) -> Element:
    """The Element at flat (row-major) index `flat` of 4-d tensors g and e."""
    coords, rest = [], flat
    for size in reversed(g.shape):
        coords.append(rest % size)
        rest //= size
    b, h, r, c = coords[::-1]
    return Element(b, h, r, c, float(g[b, h, r, c]), float(e[b, h, r, c]))


def first_wrong_element(got, expected, atol=1e-3, rtol=1e-3):
    """The first element of a (B, H, N, D) output, in (batch, head, row, column) order, that is
    NaN or inf or differs from `expected` by more than atol + rtol |expected|: an Element, or
    None where every element is within bounds. Pure torch, any device, any float dtype."""
    import torch

    g, e = _as_float64(got, expected)
    bad = ~torch.isfinite(g) | ((g - e).abs() > atol + rtol * e.abs())
    hits = torch.nonzero(bad.reshape(-1))
    if len(hits) == 0:
        return None
    return _element(int(hits[0]), g, e)


def worst_element(got, expected):
    """The element with the largest |got - expected| (NaN and inf count as largest)."""
    import torch

    g, e = _as_float64(got, expected)
    diff = torch.where(torch.isfinite(g), (g - e).abs(), torch.full_like(g, math.inf))
    return _element(int(torch.argmax(diff.reshape(-1))), g, e)


# --- building, checking and timing a stage of an edition (runs in a child process) ----------------

SPEED_TOLERANCE = 0.95   # within 5 % of the solution's time earns full points
REPORT_TIMEOUT_S = 900   # one stage's build, check and timing
_MARK = "FLASHLAB-STAGE-REPORT "


def _source(root, slug) -> Path:
    return Path(root) / "kernels" / f"{slug}.cu"


def _timing_dtype(st, capability):
    on = st.dtypes_on(capability) if hasattr(st, "dtypes_on") else st.dtypes
    return (on or st.dtypes)[0]


class _Recording:
    """An attention callable that keeps every call's inputs and output, so that after a check the
    failing case's tensors are at hand (check() keeps only its relative error)."""

    def __init__(self, attn):
        self.attn, self.stage, self.calls = attn, getattr(attn, "stage", None), []

    def __call__(self, q, k, v, causal=False, out=None, scale=None):
        got = self.attn(q, k, v, causal=causal, out=out, scale=scale)
        self.calls.append((q, k, v, causal, got.clone()))
        return got


def failure(result, calls) -> dict:
    """What a failed check says about its first failing case: the case, its error and tolerance,
    how many cases failed, and the first wrong element (see first_wrong_element) or, where no
    element is past the bounds, the worst one. calls: the checked function's (q, k, v, causal,
    output) per case, in the check's order (a _Recording's)."""
    from ..reference import reference

    n = next(i for i, c in enumerate(result.cases) if not c.passed)
    c = result.cases[n]
    q, k, v, causal, got = calls[n]
    ref = reference(q, k, v, causal=causal)
    atol, rtol = ELEMENT_TOL.get(c.dtype, ELEMENT_TOL["fp32"])
    first = first_wrong_element(got, ref, atol, rtol)
    layout = "" if c.layout == "contiguous" else f" ({c.layout} layout)"
    return {"case": f"B={c.B} H={c.H} N={c.N} D={c.D} {c.dtype} causal={c.causal}{layout}",
            "rel_err": c.rel_err, "tol": c.tol, "failed_cases": len(result.failures()),
            "element": str(first) if first else None, "worst": str(worst_element(got, ref))}


def stage_report(root, slug) -> dict:
    """Build `slug` from root/kernels/, check it and, if right, time it at its teaching config:
    a dict that json can carry (what the child process prints). Needs a GPU."""
    import torch

    from .. import build
    from ..bench import teaching, time_fn
    from ..check import check as run_check
    from ..stages import Attention, stage

    st = stage(slug)
    src = _source(root, slug)
    rep = {"stage": slug, "built": False, "passed": False}
    cc = torch.cuda.get_device_capability()
    try:
        module = build.build_module(src, arch=st.arch(cc), include_dir=src.parent)
    except build.BuildError as err:
        rep["build_error"] = str(err)
        return rep
    rep["built"] = True
    attn = _Recording(Attention(st, module))
    result = run_check(attn)
    torch.cuda.synchronize()
    rep.update(passed=result.passed, cases=len(result.cases), seed=result.seed,
               max_rel_err=result.max_rel_err)
    if not result.passed:
        rep["failure"] = failure(result, attn.calls)
        return rep
    del attn.calls[:]
    cfg = teaching(_timing_dtype(st, cc))
    q, k, v = cfg.inputs()
    t = time_fn(lambda: attn.attn(q, k, v, causal=cfg.causal))
    rep.update(ms=t.median_ms, config=cfg.label, dtype=cfg.dtype, timing_note=t.note)
    return rep


def _report_main(root, slug):
    """The child process: print the stage report as one marked JSON line."""
    try:
        rep = stage_report(root, slug)
    except Exception as err:  # noqa: BLE001 -- the student's kernel may fail in any way
        rep = {"stage": slug, "built": True, "passed": False,
               "error": f"{type(err).__name__}: {err}"}
    print(_MARK + json.dumps(rep), flush=True)


_REPORTS = {}


def _digest(root, slug) -> str:
    h = hashlib.sha256()
    kernels = Path(root) / "kernels"
    for p in [_source(root, slug), *sorted(kernels.glob("*.h")), *sorted(kernels.glob("*.cuh"))]:
        if p.exists():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def report(root, slug, timeout=REPORT_TIMEOUT_S) -> dict:
    """stage_report(root, slug), run in a child process and remembered for this edition, stage
    and source text. A crash or a timeout becomes a report with an "error"."""
    root = Path(root).resolve()
    key = (str(root), slug, _digest(root, slug))
    if key in _REPORTS:
        return _REPORTS[key]
    code = ("import sys; from flashlab.course.kernels import _report_main; "
            "_report_main(sys.argv[1], sys.argv[2])")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(paths.ROOT), *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(root), slug], capture_output=True,
                              text=True, timeout=timeout, cwd=str(paths.ROOT), env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
        if lines:
            rep = json.loads(lines[-1][len(_MARK):])
        else:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
            rep = {"stage": slug, "built": True, "passed": False,
                   "error": f"the stage's process ended (exit status {proc.returncode}) without "
                            f"a report: " + " | ".join(tail)}
    except subprocess.TimeoutExpired:
        rep = {"stage": slug, "built": True, "passed": False,
               "error": f"building, checking and timing the stage took over {timeout} s: "
                        "does a loop never end, or a barrier wait for threads that never come?"}
    _REPORTS[key] = rep
    return rep


# --- the score -------------------------------------------------------------------------------------

def score(points, speed) -> float:
    """points * min(1, speed / SPEED_TOLERANCE); full points where speed is None (not scored)."""
    if speed is None or not math.isfinite(speed):
        return float(points)
    return float(points) * min(1.0, max(0.0, speed) / SPEED_TOLERANCE)


def _recorded_ms(slug, cfg_dtype, gpu):
    from .. import tables
    from ..bench import teaching

    rows = tables.ok(tables.recorded(slug, gpu))
    at = tables.at_config(rows, teaching(cfg_dtype))
    return float(at["median_ms"].iloc[-1]) if len(at) else None


def _recorded_gpus(this_gpu):
    """This GPU model first, then the others that recorded, most recent first."""
    from .. import tables

    rows = tables.ok(tables.recorded())
    others = list(dict.fromkeys(rows.sort_values("time")["gpu"].iloc[::-1])) if len(rows) else []
    return [this_gpu] + [g for g in others if g != this_gpu]


def solution_speedup(slug, ref_slug, dtype, ref_dtype, this_gpu):
    """(recorded time of ref / recorded time of the solution, the GPU they were recorded on), at
    the teaching configs, on the first GPU of _recorded_gpus that has both; (None, None)."""
    for gpu in _recorded_gpus(this_gpu):
        sol, ref = _recorded_ms(slug, dtype, gpu), _recorded_ms(ref_slug, ref_dtype, gpu)
        if sol and ref:
            return ref / sol, gpu
    return None, None


def _reference(root, st):
    """The nearest earlier stage of the edition that passes its check (its report), or None."""

    for prev in reversed([s for s in stages() if s.number < st.number]):
        if prev.unavailable() is not None:
            continue
        rep = report(root, prev.slug)
        if rep.get("passed") and rep.get("ms"):
            return prev, rep
    return None, None


def _others_unwritten(root, ex) -> list:
    try:
        found = regions(_source(root, ex.stage).read_text())
    except (OSError, MarkerError):
        return []
    return [r.id for r in found if r.id != ex.id and r.unwritten]


def _failure_message(ex, rep, root) -> str:
    if rep.get("build_error"):
        lines = rep["build_error"].splitlines()
        shown = "\n".join(lines[:8]) + (f"\n... ({len(lines) - 8} more lines)" if len(lines) > 8 else "")
        msg = f"{ex.stage} does not compile:\n{shown}"
    elif rep.get("error"):
        msg = f"{ex.stage} failed to run: {rep['error']}"
    else:
        f = rep["failure"]
        where = (f"first wrong element: {f['element']}" if f.get("element") else
                 f"no single element is far off; the largest difference: {f['worst']}")
        msg = (f"{ex.stage} fails its check: {f['failed_cases']} of {rep['cases']} cases wrong; the "
               f"first, {f['case']}: relative error {f['rel_err']:.3g} (tolerance {f['tol']:.1g}); "
               f"{where}. Replay it with fl.check(..., seed={rep['seed']}).")
    others = _others_unwritten(root, ex)
    if others:
        msg += (f" Note: {', '.join(others)} in the same kernel still hold their stub; the stage "
                f"is checked as a whole, so write {'it' if len(others) == 1 else 'them'} too.")
    return msg


def grade_kernel(ex, root) -> Result:
    """Grade kernel exercise `ex` in the edition at `root` (see the module's docstring)."""
    from ..stages import stage

    root = Path(root)
    st = stage(ex.stage)
    src = _source(root, ex.stage)
    if not src.exists():
        return Result(ex.id, False, 0.0, f"{src} does not exist")
    try:
        mine = [r for r in regions(src.read_text(), str(src)) if r.id == ex.id]
    except MarkerError as err:
        return Result(ex.id, False, 0.0, f"the exercise markers are broken: {err}")
    if not mine:
        return Result(ex.id, False, 0.0, f"{src} has no region '// BEGIN EXERCISE {ex.id}' ... "
                                         f"'// END EXERCISE {ex.id}' (keep the markers)")
    why = st.unavailable()
    if why is not None:
        return Result.skipped(ex, f"{ex.id} needs a GPU that runs {st.slug}: {why}")

    rep = report(root, st.slug)
    if not rep.get("passed"):
        return Result(ex.id, False, 0.0, _failure_message(ex, rep, root))

    import torch

    this_gpu = torch.cuda.get_device_name()
    right = (f"right: {st.slug} passes all {rep['cases']} cases (max relative error "
             f"{rep['max_rel_err']:.2g}); {rep['ms']:.4g} ms at {rep['config']}")
    ref, ref_rep = _reference(root, st)
    speed, how = None, ""
    if ref is not None:
        ratio, gpu = solution_speedup(st.slug, ref.slug, rep["dtype"], ref_rep["dtype"],
                                      this_gpu)
        if ratio:
            mine_ratio = ref_rep["ms"] / rep["ms"]
            speed = mine_ratio / ratio
            how = (f"; {mine_ratio:.3g}x the reference {ref.slug} ({ref_rep['ms']:.4g} ms now), "
                   f"the solution {ratio:.3g}x (recorded on {gpu})")
    if speed is None:
        sol = _recorded_ms(st.slug, rep["dtype"], this_gpu)
        if sol:
            speed = sol / rep["ms"]
            how = f"; the solution's recorded time on this GPU model: {sol:.4g} ms"
    points = score(ex.points, speed)
    if speed is None:
        tail = "; speed not scored: nothing recorded says how fast the solution is on a GPU here"
    else:
        tail = f"{how}: {speed:.0%} of the solution's speed"
    return Result(ex.id, True, points, f"{right}{tail}; {points:.3g}/{ex.points} points")
