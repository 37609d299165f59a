"""Kernel exercises: regions of the real kernels that the student writes, and their grading.

The regions are marked in kernels/NN_*.cu (flashlab.markers: an exercise's region in its own
stage, and the regions of later stages that carry its code). KERNEL_EXERCISES is read from the
markers of the kernels that are there, in the solution edition's form or in an edition's as
handed out: the id, the stage whose .cu holds it, the task's first clause as its title, and its
points (10, or as many as "// BEGIN EXERCISE 05.quad_sum (5 points): ..." gives).

grade_kernel(ex, root, solution=None) builds ex's stage from root/kernels/ (an edition, or a
hand-in's work tree: the edition's file with the student's regions spliced in), checks it
(flashlab.check: float64 reference, NaN-poisoned output, ragged N, both masks, each dtype this GPU
runs, the model's strided layout, and keys that grow along the sequence, so that every rescale
path and stage 13's fallback run) and, when it is right, times it at the teaching config and
under the causal mask:

    speed = the slowest of solution time / student time over those configs, the solution's stage
            (the solution edition at `solution`) timed in turn on this GPU; without a solution at
            hand (a student checking their own work), the solution's recorded speedup over the
            nearest earlier stage that passes here stands in (data/results.csv, this GPU model
            where recorded, else the GPU that recorded last), or its recorded time.
    score = 0 if the check fails, else points * min(1, speed / 0.95)

Within 5 % of the solution (timing noise) earns full points; half its speed earns about half.
Where nothing says how fast the solution is, a right answer earns full points and the message
says that speed was not scored. A wrong one names the first failing case and its first wrong
element (batch, head, row, column, got, expected).

Each stage is built, checked and timed in a child process (a crash or a hang in a student's
kernel takes only that process with it) that holds this GPU's lock (gpu_lock_path: two gradings
never time on one GPU at once), at most once per tree, stage and source text.
"""
import hashlib
import json
import math
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from .. import paths
from ..markers import (TODO, MarkerError, exercises_in, regions, strip_markers,  # noqa: F401
                       student_text)
from ..stages import stages, template_args
from . import Exercise, Result

# --- the exercises ---------------------------------------------------------------------------------

# The markers (flashlab.markers) are where an exercise is declared: KERNEL_EXERCISES is read from
# the kernels that are there, in the solution edition's form or in an edition's as handed out.


def _kernel_exercises(root=None) -> tuple:
    """One Exercise per exercise region of every stage's kernel in root/kernels/ (default: this
    package's), in stage order: the .cu file is the one place an exercise is declared (adding a
    stage stays its .cu, its registry entry and its notebook). A stage whose kernel is not there
    (a later stage, absent from an edition) has none; carried regions are not exercises."""
    found = []
    for st in stages():
        src = _source(root, st.slug) if root is not None else st.source
        if not src.is_file():
            continue
        found += [Exercise(r.id, st.slug, "kernel", r.title, r.points)
                  for r in exercises_in(src.read_text(), where=src.name)]
    return tuple(found)


KERNEL_EXERCISES = _kernel_exercises()


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
_MARK = "FLASHLAB-STAGE-REPORT"


def _source(root, slug) -> Path:
    return Path(root) / "kernels" / f"{slug}.cu"


def _timing_dtype(st, capability):
    on = st.dtypes_on(capability) if hasattr(st, "dtypes_on") else st.dtypes
    return (on or st.dtypes)[0]


def timed_configs(st, dtype) -> list:
    """The configs an exercise of stage `st` is timed at: the teaching config, and the same under
    the causal mask where the stage takes it (an order of work items, a skipped masked tile, is
    only seen there)."""
    from ..configs import teaching
    cfg = teaching(dtype)
    return [cfg] + ([replace(cfg, causal=True)] if st.causal else [])


class _Recording:
    """An attention callable that keeps every call's inputs and output, so that after a check the
    failing case's tensors are at hand (check() keeps only its relative error)."""

    def __init__(self, attn):
        self.attn, self.stage, self.calls = attn, getattr(attn, "stage", None), []

    def __call__(self, q, k, v, causal=False, out=None, scale=None):
        got = self.attn(q, k, v, causal=causal, out=out, scale=scale)
        self.calls.append((q, k, v, causal, got.clone()))
        return got


def missing_evidence(st, source, arch) -> str:
    """What the machine code of a stage's kernels built from `source` for `arch` lacks of what
    its registry entry says its idea needs (Stage.evidence_for: the categories that must appear,
    such as stage 16's fences, MEMBAR, which a kernel without them can pass a check without),
    as a sentence; "" where nothing is missing, or where cuobjdump is not here to say. What
    must not appear is not judged: a right kernel may well differ there."""
    from .. import sass
    try:
        found = sass.evidence(source, arch)
    except (OSError, RuntimeError):
        return ""
    lacking = {}
    for kernel, row in found.iterrows():
        for cat, wanted in st.evidence_for(kernel).items():
            if wanted and not row[cat]:
                lacking.setdefault(cat, kernel.split("<")[0])
    said = [f"{kernel} has no {cat} ({sass.CATEGORIES[cat]})" for cat, kernel in lacking.items()]
    return "; ".join(said + overlap_lacking(st, source, arch))


def machine_code_note(ex, root) -> str:
    """Where no GPU can check kernel exercise `ex` (flashlab grade --machine-code): what the
    machine code of its stage, built from the tree at `root` for the stage's own architecture
    (Stage.static_archs), says of the idea, read as the grader on a GPU reads it
    (missing_evidence), as a sentence. Never points: a kernel can hold every instruction its idea
    needs and still be wrong or slow. "" where nvcc or cuobjdump is not here to say."""
    from .. import sass
    from ..stages import stage

    st = stage(ex.stage)
    src = _source(root, ex.stage)
    if not src.exists():
        return ""
    arch = st.static_archs[0]
    try:  # the build, cached for missing_evidence: a compile error is said here, not swallowed
        sass.evidence(src, arch)
    except RuntimeError as err:
        first = next((ln for ln in str(err).splitlines() if "error" in ln), str(err)[:200])
        return f"its kernel does not compile for {arch}: {first.strip()}"
    except OSError:  # no nvcc or no cuobjdump (FileNotFoundError)
        return ""
    lacking = missing_evidence(st, src, arch)
    said = (f"lacks what the idea needs: {lacking}" if lacking else
            "holds the instructions the idea needs")
    return f"its machine code ({arch}) {said} (no points: rightness and speed need a GPU)"


def overlap_lacking(st, source, arch) -> list:
    """Sentences for each backward kernel of `source` that waits for its wgmma groups with some
    still running fewer times than the registry's overlapped_waits asks at its head dim (stage
    22: a right kernel that waits for every group before the arithmetic has given up the
    overlap, and no check sees it); [] where the stage asks nothing."""
    from .. import sass
    if not st.overlapped_waits:
        return []
    waits = sass.group_waits(source, arch)
    out = []
    for kernel, row in waits.iterrows():
        args = dict(zip(("T", "D"), template_args(kernel)))
        need = st.overlapped_waits.get(int(args.get("D", 0) or 0))
        if kernel.startswith(st.backward + "<") and need and row["some_running"] < need:
            n = row["some_running"]
            out.append(f"{kernel} waits for its wgmma groups with some still running {n} "
                       f"{'time' if n == 1 else 'times'}, not {need}: a warpgroup that waits for "
                       f"every group (wgmma.wait_group 0) computes nothing under its products")
    return out


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
    layout = {"contiguous": "", "bnhd": " (the model's strided layout)",
              "growing": " (keys growing along the sequence)"}.get(c.layout, f" ({c.layout})")
    return {"case": f"B={c.B} H={c.H} N={c.N} D={c.D} {c.dtype} causal={c.causal}{layout}",
            "rel_err": c.rel_err, "tol": c.tol, "failed_cases": len(result.failures()),
            "element": str(first) if first else None, "worst": str(worst_element(got, ref))}


def stage_report(root, slug, check=True) -> dict:
    """Build `slug` from root/kernels/, check it (check=False: a trusted solution, timed only)
    and, if right, time it at timed_configs: a dict that json can carry (what the child process
    prints). The check is fl.check's, plus keys that grow along the sequence (every rescale and
    fallback path taken); a stage with a backward pass also has its log-sum-exp and its
    gradients checked (check_lse, check_backward), and its backward is what is timed. Needs a
    GPU."""
    import torch

    from .. import build
    from ..bench import backward_fn, time_fn
    from ..check import GROWING_SHAPES, STRIDED_SHAPES, check_backward, check_lse, check_repeatable
    from ..check import check as run_check
    from ..runtime import Attention
    from ..stages import stage

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
    if check:
        result = run_check(attn, growing_shapes=GROWING_SHAPES)
        torch.cuda.synchronize()
        rep.update(passed=result.passed, cases=len(result.cases), seed=result.seed,
                   max_rel_err=result.max_rel_err)
        if not result.passed:
            rep["failure"] = failure(result, attn.calls)
            return rep
        if st.has_backward:  # its backward and the log-sum-exp it reads, in each dtype here
            for dt in st.dtypes_on(cc):
                checks = [lambda: check_lse(attn.attn, dtype=dt),
                          lambda: check_backward(attn.attn, dtype=dt, strided_shapes=STRIDED_SHAPES)]
                if st.deterministic:  # and the same bits on every run
                    checks.append(lambda: check_repeatable(attn.attn, dtype=dt))
                for run_check in checks:
                    chk = run_check()
                    torch.cuda.synchronize()
                    rep["cases"] += len(chk.cases)
                    rep["max_rel_err"] = max(rep["max_rel_err"], chk.max_rel_err)
                    if not chk.passed:
                        c = chk.failures()[0]
                        rep.update(passed=False, seed=chk.seed, failure={
                            "case": f"{c.what} B={c.B} H={c.H} N={c.N} D={c.D} {c.dtype} "
                                    f"causal={c.causal}" + {
                                        "bnhd": " (the model's strided layout)",
                                        "repeat": " (a second run on the same inputs, against "
                                                  "the first: every bit must match)"}.get(c.layout, ""),
                            "rel_err": c.rel_err, "tol": c.tol,
                            "failed_cases": len(chk.failures()), "element": None,
                            "worst": None, "replay": f"fl.{'check_lse' if c.what == 'lse' else 'check_repeatable' if c.layout == 'repeat' else 'check_backward'}"
                                                      f"(attn, dtype='{c.dtype}', seed={chk.seed})"})
                        return rep
    else:
        rep["passed"] = True
    if check and (lacking := missing_evidence(st, src, st.arch(cc))):
        rep.update(passed=False, evidence=lacking)  # right answers, not by the stage's idea
        return rep
    del attn.calls[:]
    dtype = _timing_dtype(st, cc)
    rep.update(times={}, dtype=dtype, timing_notes={})
    for cfg in timed_configs(st, dtype):
        q, k, v = cfg.inputs()
        if st.has_backward:  # the pass its exercises are in: the backward alone
            t = time_fn(backward_fn(attn.attn, q, k, v, cfg.causal))
        else:
            t = time_fn(lambda: attn.attn(q, k, v, causal=cfg.causal))
        rep["times"][cfg.label] = t.median_ms
        if t.note:
            rep["timing_notes"][cfg.label] = t.note
    first = timed_configs(st, dtype)[0]
    rep.update(ms=rep["times"][first.label], config=first.label)
    return rep


def _report_main(root, slug, check="1"):
    """The child process: print the stage report as one JSON line after the mark it was given
    (in its environment, which a kernel's device code cannot read)."""
    try:
        rep = stage_report(root, slug, check=check == "1")
    except Exception as err:  # noqa: BLE001 -- the student's kernel may fail in any way
        rep = {"stage": slug, "built": True, "passed": False,
               "error": f"{type(err).__name__}: {err}"}
    print(os.environ.get("FLASHLAB_REPORT_MARK", _MARK) + " " + json.dumps(rep), flush=True)


_REPORTS = {}


def _digest(root, slug) -> str:
    h = hashlib.sha256()
    for p in paths.kernel_inputs(_source(root, slug), Path(root) / "kernels"):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def gpu_lock_path() -> Path:
    """The lock file of the GPU this process times on: one per GPU of this host (its UUID where
    torch gives one), under the host's temporary folder, shared by every grading on the host."""
    import tempfile

    import torch
    ident = "gpu0"
    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        ident = str(getattr(props, "uuid", "") or f"{props.name}-{torch.cuda.current_device()}")
    except Exception:  # noqa: BLE001 -- no GPU: the lock is never contended
        pass
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", ident)
    folder = Path(os.environ.get("FLASHLAB_LOCK_DIR", Path(tempfile.gettempdir()) / "flashlab-gpu"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{safe}.lock"


def report(root, slug, timeout=REPORT_TIMEOUT_S, check=True, log=None) -> dict:
    """stage_report(root, slug, check), run in a child process that holds this GPU's lock (two
    gradings never time on one GPU at once), remembered for this tree, stage and source text. A
    crash or a timeout becomes a report with an "error"."""
    from filelock import FileLock, Timeout

    root = Path(root).resolve()
    key = (str(root), slug, _digest(root, slug), check)
    if key in _REPORTS:
        return _REPORTS[key]
    mark = f"{_MARK}-{secrets.token_hex(8)}"
    code = ("import sys; from flashlab.course.kernels import _report_main; "
            "_report_main(sys.argv[1], sys.argv[2], sys.argv[3])")
    env = dict(os.environ, FLASHLAB_REPORT_MARK=mark)
    env["PYTHONPATH"] = os.pathsep.join([str(paths.ROOT), *filter(None, [env.get("PYTHONPATH")])])
    lock = FileLock(str(gpu_lock_path()))
    try:
        try:
            lock.acquire(timeout=5)
        except Timeout:
            (log or print)(f"waiting for the GPU: another grading holds {lock.lock_file}")
            lock.acquire()
        try:
            proc = subprocess.run([sys.executable, "-c", code, str(root), slug, "1" if check else "0"],
                                  capture_output=True, text=True, timeout=timeout,
                                  cwd=str(paths.ROOT), env=env)
        finally:
            lock.release()
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark + " ")]
        if lines:
            rep = json.loads(lines[-1][len(mark) + 1:])
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
    from ..configs import teaching

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
        if prev.unavailable() is not None or not _source(root, prev.slug).is_file():
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
    return [("carried " if r.carried else "") + r.id for r in found
            if r.id != ex.id and r.unwritten]


def _failure_message(ex, rep, root) -> str:
    if rep.get("build_error"):
        lines = rep["build_error"].splitlines()
        shown = "\n".join(lines[:8]) + (f"\n... ({len(lines) - 8} more lines)" if len(lines) > 8 else "")
        msg = f"{ex.stage} does not compile:\n{shown}"
    elif rep.get("error"):
        msg = f"{ex.stage} failed to run: {rep['error']}"
    elif rep.get("evidence"):
        msg = (f"{ex.stage} passes its check, but its machine code lacks what the stage's idea "
               f"needs: {rep['evidence']}. A check on one GPU cannot show every ordering the "
               f"idea must rule out; the instructions can.")
    else:
        f = rep["failure"]
        if f.get("replay"):  # a gradient or the log-sum-exp: judged as a whole tensor
            where, replay = f"the whole {f['case'].split()[0]} is judged", f["replay"]
        else:
            where = (f"first wrong element: {f['element']}" if f.get("element") else
                     f"no single element is far off; the largest difference: {f['worst']}")
            replay = f"fl.check(..., seed={rep['seed']})"
        msg = (f"{ex.stage} fails its check: {f['failed_cases']} of {rep['cases']} cases wrong; the "
               f"first, {f['case']}: relative error {f['rel_err']:.3g} (tolerance {f['tol']:.1g}); "
               f"{where}. Replay it with {replay}.")
    others = _others_unwritten(root, ex)
    if others:
        msg += (f" Note: {', '.join(others)} in the same kernel still hold"
                f"{'s' if len(others) == 1 else ''} a stub; the stage is checked as a whole, so "
                f"write {'it' if len(others) == 1 else 'them'} too.")
    return msg


def _speed_against_solution(rep, sol) -> tuple:
    """(speed, how) from this run's times of the student's stage and the solution's, config by
    config: the slowest ratio counts."""
    ratios = {label: sol["times"][label] / ms for label, ms in rep["times"].items()
              if label in sol.get("times", {}) and ms > 0}
    if not ratios:
        return None, ""
    label = min(ratios, key=ratios.get)
    parts = "; ".join(f"{lb}: {rep['times'][lb]:.4g} ms against the solution's "
                      f"{sol['times'][lb]:.4g} ms" for lb in ratios)
    return ratios[label], f"; timed in turn with the solution on this GPU ({parts}); the slowest"


def grade_kernel(ex, root, solution=None) -> Result:
    """Grade kernel exercise `ex` in the tree at `root` (an edition, or a hand-in's work tree):
    build, check and time its stage; where `solution` (the solution edition's root) is given,
    time the solution's stage in turn on this GPU and score against it config by config, else
    against the solution's recorded speedup over the nearest earlier stage that passes here."""
    from ..stages import stage

    root = Path(root)
    st = stage(ex.stage)
    src = _source(root, ex.stage)
    if not src.exists():
        return Result(ex.id, False, 0.0, f"{src} does not exist")
    try:
        mine = [r for r in regions(src.read_text(), str(src)) if r.id == ex.id and not r.carried]
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
             f"{rep['max_rel_err']:.2g}); {rep['ms']:.4g} ms at {rep['config']}"
             f"{' (the backward)' if st.has_backward else ''}")
    speed, how = None, ""
    if solution is not None:
        sol = report(solution, st.slug, check=False)
        if sol.get("times"):
            speed, how = _speed_against_solution(rep, sol)
    # A stage with a backward pass is timed in its backward, which no earlier stage has and the
    # recorded forward rows do not time: only the solution timed now can say how fast it is.
    if speed is None and not st.has_backward:
        ref, ref_rep = _reference(root, st)
        if ref is not None:
            ratio, gpu = solution_speedup(st.slug, ref.slug, rep["dtype"], ref_rep["dtype"],
                                          this_gpu)
            if ratio:
                mine_ratio = ref_rep["ms"] / rep["ms"]
                speed = mine_ratio / ratio
                how = (f"; {mine_ratio:.3g}x the reference {ref.slug} ({ref_rep['ms']:.4g} ms "
                       f"now), the solution {ratio:.3g}x (recorded on {gpu})")
    if speed is None and not st.has_backward:
        sol_ms = _recorded_ms(st.slug, rep["dtype"], this_gpu)
        if sol_ms:
            speed = sol_ms / rep["ms"]
            how = f"; the solution's recorded time on this GPU model: {sol_ms:.4g} ms"
    points = score(ex.points, speed)
    if speed is None:
        tail = "; speed not scored: nothing recorded says how fast the solution is on a GPU here"
    else:
        tail = f"{how}: {speed:.0%} of the solution's speed"
    return Result(ex.id, True, points, f"{right}{tail}; {points:.3g}/{ex.points} points")
