"""The pick() table of a stage whose registry entry has `picks`: the C++ function in its .cu that
launches one instantiation of the kernel per head dim, mask and range of N. This module reads and
writes that table, and names the kernel a candidate compiles to; flashlab.autotune chooses what
goes in it.

A candidate is (BC, WARPS, WM, STAGES, Q_REGS, OPTS), the template arguments after T and D of
kernels/08_tuned.cu's tuned_kernel; OPTS is a mask of the switches in the .cu's `enum Opts`.
"""
import functools
import re
import tempfile
from pathlib import Path

from .stages import stages
from .tables import TUNE_FIELDS

FIELDS = TUNE_FIELDS
PICK = re.compile(r"(// TUNED:[^\n]*\n)template <typename T>\nstatic const char\* pick\(.*?\n}\n",
                  re.S)
_LAUNCH = re.compile(r"launch<T, (\d+), (\d+), (\d+), (\d+), (\d+), (true|false), (\w+)>")


def tuned():
    """The stage whose launch a pick() table chooses (registry: picks=True)."""
    return next(st for st in stages() if st.picks)


def source() -> Path:
    return tuned().source


@functools.lru_cache(maxsize=None)
def _opts(text):
    m = re.search(r"enum Opts\s*\{(.*?)\}", text, re.S)
    if not m:
        raise ValueError("no `enum Opts { ... }` in the tuned stage's source")
    return {name: int(value) for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", m.group(1))}


def switches() -> dict:
    """{switch: its OPTS bit}, as the kernel's `enum Opts` defines them (ALL_OPTS left out)."""
    return {k: v for k, v in _opts(source().read_text()).items() if k != "ALL_OPTS"}


def all_opts() -> int:
    """Every switch on."""
    return _opts(source().read_text()).get("ALL_OPTS", sum(switches().values()))


def launch(D, c) -> str:
    bc, warps, wm, stages, q_regs, opts = c
    return (f"launch<T, {D}, {bc}, {warps}, {wm}, {stages}, {'true' if q_regs else 'false'}, "
            f"{opts}>(p, s)")


def segments(by_n):
    """[(first N of the next segment or None, candidate)] for a candidate or {N: candidate}:
    runs of equal choices over the timed N; a segment serves every N below where the next begins."""
    if not isinstance(by_n, dict):
        return [(None, tuple(by_n))]
    out = []
    for n in sorted(by_n):
        c = tuple(by_n[n])
        if out and out[-1][1] == c:
            out[-1] = (None, c)
        else:
            if out:
                out[-1] = (n, out[-1][1])
            out.append((None, c))
    return out


def pick_source(choice) -> str:
    """The pick() function for {(D, causal): candidate, or {N: candidate}}."""
    lines = ["template <typename T>",
             "static const char* pick(const FlashlabProblem* p, cudaStream_t s) {"]

    def returns(D, v, indent):
        for below, c in segments(v):
            cond = f"if (p->N < {below}) " if below is not None else ""
            lines.append(f"{indent}{cond}return {launch(D, c)};")

    for D in sorted({d for d, _ in choice}):
        lines.append(f"  if (p->D == {D}) {{")
        causal = segments(choice[(D, True)])
        if len(causal) == 1:
            lines.append(f"    if (p->causal) return {launch(D, causal[0][1])};")
        else:
            lines.append("    if (p->causal) {")
            returns(D, choice[(D, True)], "      ")
            lines.append("    }")
        returns(D, choice[(D, False)], "    ")
        lines.append("  }")
    lines.append("  return \"no tuned shape for this head dim\";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def with_pick(text, choice) -> str:
    """`text` (the tuned stage's source) with its pick() replaced by the one for `choice`."""
    m = PICK.search(text)
    if not m:
        raise ValueError("no '// TUNED:' pick() block to rewrite")
    return text[:m.start()] + m.group(1) + pick_source(choice) + text[m.end():]


def read_by_n(text=None) -> dict:
    """{(D, causal): [(N below which it serves, or None for the rest; candidate)]} read out of
    pick() as it stands in `text` (default: the stage's source)."""
    text = source().read_text() if text is None else text
    block = PICK.search(text)
    if not block:
        raise ValueError(f"no // TUNED: pick() block in {source().name}")
    every = _opts(text).get("ALL_OPTS")
    out, in_causal = {}, False
    for line in block.group(0).splitlines():
        if re.search(r"if \(p->causal\) \{", line):
            in_causal = True
            continue
        if line.strip() == "}":
            in_causal = False
        if m := _LAUNCH.search(line):
            D, *nums, q, opts = m.groups()
            c = (*map(int, nums), int(q == "true"), every if opts == "ALL_OPTS" else int(opts))
            below = re.search(r"p->N < (\d+)", line)
            seg = (int(below.group(1)) if below else None, c)
            if "p->causal" in line or in_causal:
                out.setdefault((int(D), True), []).append(seg)
            else:
                out.setdefault((int(D), False), []).append(seg)
                if below is None:
                    out.setdefault((int(D), True), [seg])  # one return for both masks
    return out


def read(text=None) -> dict:
    """{(D, causal): candidate} of pick(): the one serving the longest sequences."""
    return {k: segs[-1][1] for k, segs in read_by_n(text).items()}


def at(D, causal, N, text=None):
    """The candidate pick() launches for head dim D, mask and sequence length N (None if none)."""
    for below, c in read_by_n(text).get((D, bool(causal)), []):
        if below is None or N < below:
            return c
    return None


_ANY_PICK = re.compile(r"\nstatic const char\* pick\(.*?\n}\n", re.S)
_ANY_LAUNCH = re.compile(r"launch<T, (\d+), ([^>]*)>")


def launched(text, D, causal, N=None):
    """The template arguments after T and D (strings) that any stage's pick() in `text` launches
    at head dim D, mask and sequence length N: for stages whose shape depends on the problem
    but that no autotune writes (09, 10); None where `text` has no pick() or it launches nothing
    for D. Reads the shapes pick_source() writes: in launch order, `if (p->causal) ...` (or a
    block of them), `if (p->N < ..) ...`, a plain `return launch<T, D, ...>` for the rest."""
    block = _ANY_PICK.search(text)
    if not block:
        return None
    in_causal = False
    for line in block.group(0).splitlines()[1:]:
        if re.search(r"if \(p->causal\) \{", line):
            in_causal = True
            continue
        if line.strip() == "}":
            in_causal = False
            continue
        m = _ANY_LAUNCH.search(line)
        if not m or int(m.group(1)) != D:  # the launch names its head dim
            continue
        if (in_causal or "p->causal" in line) and not causal:
            continue
        below = re.search(r"p->N < (\d+)", line)
        if below and N is not None and N >= int(below.group(1)):
            continue
        return tuple(a.strip() for a in m.group(2).split(","))
    return None


def kernel_name(D, c, dtype="__half") -> str:
    """The kernel candidate c compiles to at head dim D, as sass and ptxas name it."""
    bc, warps, wm, stages, q_regs, opts = c
    return (f"tuned_kernel<{dtype}, {D}, {bc}, {warps}, {wm}, {stages}, "
            f"{'true' if q_regs else 'false'}, {opts}>")


def variant_source(D, c, folder=None) -> Path:
    """A copy of the stage's .cu whose pick() runs candidate c at head dim D for both masks (what
    the autotune builds), for building, ptxas and the SASS counts."""
    folder = Path(folder or tempfile.mkdtemp(prefix="flashlab-08-"))
    src = source()
    dst = folder / "_".join(map(str, (D, *c))) / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(with_pick(src.read_text(), {(D, False): c, (D, True): c}))
    return dst
