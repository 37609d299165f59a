"""A stage's variants: its kernel changed by a patch kept beside it (kernels/NN_name.patch), built,
checked against float64 and timed in turn with the stage, so a notebook can run an idea that did
not become a stage (notebook 12's FlashAttention-3 overlaps) instead of reporting it.

A variant patch holds no exercise's code. It is made, and applied, with every marked region of the
kernel (// BEGIN EXERCISE id ... and // BEGIN CARRIED id ...) collapsed to its marker, task and
stub lines; applying it puts each region's code back from the stage's own kernel. An edition keeps
the markers of the regions it hands out only, so it gets the variant's kernel instead of the patch
(kernels/variants/NN_x.cu, written by flashlab.course.student with those regions stubbed), and
source() puts the student's own code from the stage's kernel into them: a variant runs on the code
its student wrote.

    text = variants.source(fl.stage(12).variant("ping_pong"))   # the kernel, as a string
    attn = variants.build(fl.stage(12).variant("ping_pong"))    # an Attention, like a stage's
    variants.make_patch(stage_text, variant_text)              # what kernels/NN_x.patch holds

The registry (flashlab.stages) lists each stage's variants; flashlab.tables.VARIANTS records
their timings (measure)."""
import dataclasses
import difflib
import re
import tempfile
from pathlib import Path

from . import markers
from .paths import KERNELS
from .stages import Variant, stage as _stage


def _stub_line(line: str) -> bool:
    return line.lstrip().startswith("// STUB:")


def collapse(text: str, where="kernel") -> str:
    """`text` with the code of every marked region left out: a region keeps its BEGIN line, task
    lines, stub lines and END line."""
    lines = text.splitlines()
    out, last = [], 0
    for r in markers.regions(text, where):
        out += lines[last:r.begin + r.task_lines]
        out += [ln for ln in lines[r.begin + r.task_lines:r.end] if _stub_line(ln)]
        out.append(lines[r.end])
        last = r.end + 1
    return "\n".join(out + lines[last:]) + ("\n" if text.endswith("\n") else "")


def make_patch(stage_text: str, variant_text: str, name="variant") -> str:
    """The unified diff (3 lines of context) from the stage's kernel to the variant's, both
    collapsed: what kernels/NN_x.patch holds. The variant's regions must hold the stage's code
    exactly (the patch carries neither)."""
    theirs = {(r.kind, r.id): r.body for r in markers.regions(stage_text, "stage")}
    for r in markers.regions(variant_text, "variant"):
        if theirs.get((r.kind, r.id)) != r.body:
            raise ValueError(f"the variant's region {r.kind} {r.id} differs from the stage's (or "
                             f"the stage has none): a variant keeps each region's code as it is")
    a = collapse(stage_text).splitlines(keepends=True)
    b = collapse(variant_text).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, "stage.cu", f"{name}.cu", n=3))


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _hunks(patch: str):
    """[(old start (0-based), [(' '|'-'|'+', line)])] of a unified diff."""
    hunks = []
    for line in patch.splitlines():
        m = _HUNK.match(line)
        if m:
            hunks.append((max(int(m.group(1)) - 1, 0), []))
        elif hunks and line[:1] in (" ", "-", "+"):
            hunks[-1][1].append((line[0], line[1:]))
        elif hunks and line == "":  # an empty context line whose space was trimmed
            hunks[-1][1].append((" ", ""))
    return hunks


def apply(text: str, patch: str, where="patch") -> str:
    """`text` with the unified diff `patch` applied. Each hunk's context and removed lines must
    match exactly (near the line the hunk names); ValueError otherwise: a patch on another version
    of the file is refused, never half applied."""
    lines = text.splitlines()
    out, pos = [], 0
    for start, body in _hunks(patch):
        old = [s for op, s in body if op != "+"]
        new = [s for op, s in body if op != "-"]
        at = next((i for d in range(0, len(lines) + 1) for i in (start + d, start - d)
                   if pos <= i <= len(lines) - len(old) and lines[i:i + len(old)] == old), None)
        if at is None:
            raise ValueError(f"{where}: the hunk at line {start + 1} does not match the kernel "
                             f"(is the kernel another version than the one the patch was made on?)")
        out += lines[pos:at] + new
        pos = at + len(old)
    if not _hunks(patch):
        raise ValueError(f"{where}: no hunk found")
    return "\n".join(out + lines[pos:]) + ("\n" if text.endswith("\n") else "")


_PICK = re.compile(r"(// PICK.*?\ntemplate <typename T>\nstatic const char\* pick\([^)]*\) \{\n)"
                   r"(.*?)(\n\}\n)", re.S)


def with_pick(text: str, spec: str) -> str:
    """The kernel `text` with its pick() replaced by `spec`: ';'-separated `D<d>[c]:<template
    arguments after T, D>` entries, `c` marking the causal shape (the non-causal one serves where
    none is given), e.g. "D64:128,3,2,true,true;D128:128,2,2,true,true"."""
    shapes = dict(part.split(":", 1) for part in spec.split(";"))
    lines = []
    for d in sorted({int(re.match(r"D(\d+)", k).group(1)) for k in shapes}):
        nc = shapes[f"D{d}"]
        c = shapes.get(f"D{d}c", nc)
        lines.append(f"  if (p->D == {d}) {{\n    if (p->causal) return launch<T, {d}, {c}>(p, s);\n"
                     f"    return launch<T, {d}, {nc}>(p, s);\n  }}")
    body = "\n".join(lines) + '\n  return "no shape for this head dim";'
    new, n = _PICK.subn(lambda m: m.group(1) + body + m.group(3), text)
    if n != 1:
        raise ValueError("no pick() found (a '// PICK' comment, then the pick function)")
    return new


def patched(stage_text: str, patch_text: str, where="patch") -> str:
    """A stage's kernel (with all its region markers: the solution's) with a variant patch
    applied, each region's code its own: the variant's kernel before its pick() is set."""
    return expand(apply(collapse(stage_text), patch_text, where=where), stage_text)


def edition_file(kernels, patch_name) -> Path:
    """Where a student's edition holds a variant's kernel: kernels/variants/NN_x.cu (the edition
    is written with the variant's kernel, its handed-out regions stubbed, in place of the patch,
    since an edition's kernels keep the markers of the exercises it hands out only)."""
    return Path(kernels) / "variants" / patch_name.replace(".patch", ".cu")


def source(variant: Variant, kernels=KERNELS) -> str:
    """The variant's kernel: its stage's kernel in `kernels` (default this checkout's) with the
    variant's patch applied and its pick() set, the regions' code the stage's own (in an
    edition: its kernels/variants/ copy, with the student's code from the stage's kernel in the
    regions it hands out)."""
    st = _stage(variant.stage)
    base = (Path(kernels) / f"{st.slug}.cu").read_text()
    copy = edition_file(kernels, variant.patch)
    if copy.is_file():
        text = copy.read_text()
        text = markers.splice(text, base, [r.id for r in markers.regions(text, str(copy))],
                              where=str(copy))
        return with_pick(text, variant.shapes)
    patch = Path(kernels) / variant.patch
    if not patch.is_file():
        raise FileNotFoundError(f"{patch}: variant {variant.name} of stage {st.slug} needs it")
    return with_pick(patched(base, patch.read_text(), where=str(patch)), variant.shapes)


def expand(collapsed: str, full: str, where="variant") -> str:
    """`collapsed` (a collapse()d text, a patch applied to it) with each region's code and stub
    lines put back from the same region of `full` (the stage's kernel, or a student's copy of
    it), indented as `collapsed` indents it. ValueError where `full` lacks a region."""
    theirs = {(r.kind, r.id): (r, full.splitlines()) for r in markers.regions(full, "stage")}
    lines = collapsed.splitlines()
    out, last = [], 0
    for r in markers.regions(collapsed, where):
        if (r.kind, r.id) not in theirs:
            raise ValueError(f"{where}: the stage's kernel has no region {r.kind} {r.id}")
        got, src = theirs[(r.kind, r.id)]
        inner = src[got.begin + got.task_lines:got.end]
        out += lines[last:r.begin + r.task_lines]
        out += [r.indent + ln[len(got.indent):] if ln.startswith(got.indent) else ln
                for ln in inner]
        out.append(lines[r.end])
        last = r.end + 1
    return "\n".join(out + lines[last:]) + ("\n" if collapsed.endswith("\n") else "")


def stage_of(variant: Variant):
    """The registry entry a variant runs under: its stage's, with the variant's name and kernel
    (what a profile selects and a results row names)."""
    st = _stage(variant.stage)
    return dataclasses.replace(st, slug=variant.slug, kernel=variant.kernel)


def build(variant: Variant, verbose=False):
    """The variant built for this GPU, as an Attention (called as a stage is)."""
    from . import build as _build
    from .runtime import Attention, capability
    st = _stage(variant.stage)
    why = st.unavailable()
    if why is not None:
        raise RuntimeError(f"{variant.slug}: {why}")
    # One file per variant, rewritten with each build (the module cache keys on its text).
    folder = Path(tempfile.gettempdir()) / "flashlab-variants"
    folder.mkdir(exist_ok=True)
    path = folder / f"{variant.slug.replace('+', '_')}.cu"
    path.write_text(source(variant))
    module = _build.build_module(path, verbose=verbose, arch=st.arch(capability()),
                                 include_dir=KERNELS)
    return Attention(stage_of(variant), module)


def configs(stage):
    """Where a stage's variants are timed: the FlashAttention sweep's points at N = 1k, 4k and 16k,
    each head dim, with the mask and without, in the stage's first dtype."""
    from .configs import sweep
    st = _stage(stage)
    return [c for c in sweep(st.dtypes[0]) if c.N in (1024, 4096, 16384) and c.D in st.head_dims]


def measure(stage, names=None, at=None, record=True, log=print):
    """Build `stage` and its variants (all, or those `names`), check each variant against float64
    (flashlab.check: fresh random inputs, ragged N, output poisoned), then time the stage and the
    variants that passed, config by config (`at`, default configs()), run by run in turn
    (bench.time_interleaved: warmed, L2 flushed, median of at least 20 runs). Returns the rows
    (and records them in data/variants.csv): each variant's TFLOP/s beside the stage's."""
    import pandas as pd

    from . import tables
    from .bench import time_interleaved
    from .check import check
    from .configs import tflops
    from .env import environment
    st = _stage(stage)
    chosen = [st.variant(n) for n in names] if names else list(st.variants)
    attn = st.build()
    env = environment()
    soft = {k: env[k] for k in tables.SOFTWARE}
    built, checked = {}, {}
    for v in chosen:
        a = build(v)
        chk = check(a)
        checked[v.slug] = chk
        log(f"{v.slug}: check {'passed' if chk.passed else 'FAILED'} (max rel err "
            f"{chk.max_rel_err:.1e})")
        if chk.passed:
            built[v.slug] = a
        else:
            log(str(chk))
    rows = []
    for cfg in at or configs(st):
        q, k, v_ = cfg.inputs()
        args = dict(q=q, k=k, v=v_, causal=cfg.causal)
        fns = {st.slug: (lambda: attn(**args)),
               **{slug: (lambda a=a: a(**args)) for slug, a in built.items()}}
        tms = time_interleaved(fns)
        base = tms[st.slug]
        for slug in built:
            tm = tms[slug]
            rows.append(dict(variant=slug, stage=st.slug, dtype=cfg.dtype, B=cfg.B, H=cfg.H,
                             N=cfg.N, D=cfg.D, causal=cfg.causal, median_ms=tm.median_ms,
                             tflops=tflops(cfg, tm.median_ms), stage_ms=base.median_ms,
                             stage_tflops=tflops(cfg, base.median_ms),
                             ratio=base.median_ms / tm.median_ms, check_passed=True,
                             max_rel_err=checked[slug].max_rel_err, gpu=env["gpu"], **soft))
        log(f"{cfg.label}: " + ", ".join(f"{r['variant'].split('+')[1]} {r['ratio']:.2f}x"
                                         for r in rows[-len(built):]))
    rows += [dict(variant=slug, stage=st.slug, dtype=st.dtypes[0], B=0, H=0, N=0, D=0,
                  causal=False, check_passed=False, max_rel_err=chk.max_rel_err, gpu=env["gpu"],
                  **soft) for slug, chk in checked.items() if not chk.passed]
    if record and rows:
        tables.VARIANTS.upsert(rows)
    return pd.DataFrame(rows)
