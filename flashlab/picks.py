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

from .stages import stage, stages
from .tables import TUNE_FIELDS

FIELDS = TUNE_FIELDS
PICK = re.compile(r"(// TUNED:[^\n]*\n)template <typename T>\nstatic const char\* pick\(.*?\n}\n",
                  re.S)


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


_ANY_PICK = re.compile(r"\nstatic const char\* pick\(.*?\n}\n", re.S)
_ANY_LAUNCH = re.compile(r"launch<T, (\d+), ([^>]*)>")
_LAUNCH_TEMPLATE = re.compile(r"template <([^>]*)>\nstatic const char\* launch\(")


def launch_defaults(text) -> dict:
    """{template argument: its default, as a string} of the `launch` function template in a
    stage's source: the arguments a pick() may leave out (`int BLOCKS = 1, int RETIRE = 0`)."""
    m = _LAUNCH_TEMPLATE.search(text)
    out = {}
    for part in (m.group(1).split(",") if m else []):
        if "=" in part:
            name, value = part.split("=")
            out[name.split()[-1]] = value.strip()
    return out


def segments_of(block) -> dict:
    """{(D, causal): [(N below which it serves, or None for the rest; the template arguments after
    T and D, as strings)]} of one pick() function's text, as C++ runs it: in line order, a return
    under `if (p->causal)` (a line or a block) serves causal problems only, any other serves both
    masks, and a return without `if (p->N < ..)` ends the list. The shapes pick_source() writes,
    and the Hopper stages' (09 onwards)."""
    out, done, in_causal = {}, set(), False
    for line in block.splitlines():
        if re.search(r"if \(p->causal\) \{", line):
            in_causal = True
            continue
        if line.strip() == "}":
            in_causal = False
            continue
        if not (m := _ANY_LAUNCH.search(line)):
            continue
        D, args = int(m.group(1)), tuple(a.strip() for a in m.group(2).split(","))
        below = re.search(r"p->N < (\d+)", line)
        seg = (int(below.group(1)) if below else None, args)
        for causal in ((True,) if in_causal or "p->causal" in line else (False, True)):
            if (D, causal) not in done:
                out.setdefault((D, causal), []).append(seg)
                if below is None:
                    done.add((D, causal))
    return out


def read_by_n(text=None) -> dict:
    """{(D, causal): [(N below which it serves, or None for the rest; candidate)]} read out of
    the tuned stage's pick() as it stands in `text` (default: the stage's source)."""
    text = source().read_text() if text is None else text
    block = PICK.search(text)
    if not block:
        raise ValueError(f"no // TUNED: pick() block in {source().name}")
    every = _opts(text).get("ALL_OPTS")

    def candidate(args):
        *nums, q, opts = args
        return (*map(int, nums), int(q == "true"), every if opts == "ALL_OPTS" else int(opts))

    return {k: [(below, candidate(args)) for below, args in segs]
            for k, segs in segments_of(block.group(0)).items()}


def read(text=None) -> dict:
    """{(D, causal): candidate} of pick(): the one serving the longest sequences."""
    return {k: segs[-1][1] for k, segs in read_by_n(text).items()}


def _serving(segs, N):
    for below, c in segs:
        if below is None or (N is not None and N < below):
            return c
    return None


def at(D, causal, N, text=None):
    """The candidate pick() launches for head dim D, mask and sequence length N (None if none)."""
    return _serving(read_by_n(text).get((D, bool(causal)), []), N)


def launched(text, D, causal, N=None):
    """The template arguments after T and D (strings) that any stage's pick() in `text` launches
    at head dim D, mask and sequence length N (None: the longest); None where `text` has no
    pick() or it launches nothing for D. Stages 08 onwards have one."""
    block = _ANY_PICK.search(text)
    return _serving(segments_of(block.group(0)).get((D, bool(causal)), []), N) if block else None


def launched_by_name(text, template, D, causal, N=None):
    """What the pick() in `text` launches at D, mask and N, by name: {template argument: value as
    written} for the arguments after T and D, named by `template` (a registry entry's), those
    pick() leaves out at the `launch` template's defaults. None where it launches nothing."""
    args = launched(text, D, causal, N)
    if args is None:
        return None
    named = {**launch_defaults(text), **dict(zip(template[2:], args))}
    return {name: named[name] for name in template[2:] if name in named}


def shape(slug, D, causal, N=None):
    """What stage `slug`'s pick() launches at head dim D, mask and sequence length N (None: the
    longest), by name and as numbers where they are (launched_by_name). None where the stage has
    no pick() or it launches nothing for D."""
    st = stage(slug)
    named = launched_by_name(st.text, st.template, D, causal, N)
    if named is None:
        return None
    return {name: int(v) if v.lstrip("-").isdigit() else v for name, v in named.items()}


def boundary_probes(text) -> list:
    """[(D, causal, N)]: sequence lengths on both sides of every `p->N < X` boundary in the pick()
    of `text` (X - 1, and X + 67: ragged, so the last tile is partial), so that a check runs each
    shape pick() launches at a length it serves. [] where pick() does not depend on N."""
    block = _ANY_PICK.search(text)
    if not block:
        return []
    out = []
    for (D, causal), segs in sorted(segments_of(block.group(0)).items()):
        for below, _ in segs:
            if below is not None:
                out += [(D, causal, below - 1), (D, causal, below + 67)]
    return out


def kernel_name(D, c, dtype="__half") -> str:
    """The kernel candidate c compiles to at head dim D, as sass and ptxas name it (the
    instantiation without the log-sum-exp's stores: WITH_LSE false)."""
    bc, warps, wm, stages, q_regs, opts = c
    return (f"tuned_kernel<{dtype}, {D}, {bc}, {warps}, {wm}, {stages}, "
            f"{'true' if q_regs else 'false'}, {opts}, false>")


def variant_source(D, c, folder=None) -> Path:
    """A copy of the stage's .cu whose pick() runs candidate c at head dim D for both masks (what
    the autotune builds), for building, ptxas and the SASS counts."""
    folder = Path(folder or tempfile.mkdtemp(prefix="flashlab-08-"))
    src = source()
    dst = folder / "_".join(map(str, (D, *c))) / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(with_pick(src.read_text(), {(D, False): c, (D, True): c}))
    return dst
