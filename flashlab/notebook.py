"""What the notebooks call: one line per step, live on a GPU and replayed from data/ without one.

    from flashlab import notebook as nb
    nb.banner()                       # says which mode this is, and where recorded numbers came from
    nb.show_source("02_coalesced", "load_tile")   # a function of the .cu, highlighted
    nb.show_diff("01_naive", "02_coalesced")      # what this stage changed
    ev = nb.evaluate("02_coalesced")  # build + check + time + record (GPU) or the recorded rows
    nb.compare()                      # every stage and baseline at the teaching config
    with nb.unless_missing():         # a cell's measured part, or one line saying what to run
        ...
"""
import contextlib
import difflib
import re
import time
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd

from . import measure, ptxas, results, runner
from .bench import teaching
from .env import environment, gpu_available
from .paths import KERNELS
from .results import at_config
from .stages import stage as _stage

class NotRecorded(LookupError):
    """Numbers a notebook asks for are not in data/ yet: the message says what records them."""


def _gpu_shown():
    """The GPU whose numbers the notebooks show: this one live, else the latest recorded."""
    if gpu_available():
        return environment()["gpu"]
    from .plots import latest_gpu
    return latest_gpu(results.load()) or "any GPU"


def not_recorded(name, what="", flags="") -> NotRecorded:
    """The error for a stage (or baseline) with nothing recorded: "05_mma: not recorded yet on
    <gpu>: run `flashlab run --stage 05`"."""
    try:
        command = f"flashlab run --stage {_stage(name).number:02d}{flags}"
    except ValueError:  # a baseline: `flashlab run` times them all
        command = f"flashlab run{flags}"
    slug = getattr(name, "slug", name)
    return NotRecorded(f"{slug}{what}: not recorded yet on {_gpu_shown()}: run `{command}`")


def _missing(err, missing_ok, fallback):
    """What a helper with `missing_ok` does about NotRecorded `err`: raise it, or print it and
    give `fallback` (the cell-wide alternative is unless_missing)."""
    if not missing_ok:
        raise err
    print(err)
    return fallback


@contextlib.contextmanager
def unless_missing():
    """`with nb.unless_missing():` runs a cell's measured part, or, where a stage has not been
    recorded yet, prints what to run instead of a traceback."""
    try:
        yield
    except NotRecorded as err:
        print(err)


class GPU(NamedTuple):
    """The GPU a notebook's numbers are about (see the_gpu)."""
    name: str
    cc: str     # compute capability, "9.0"
    sms: int
    roof: dict  # its ceilings as flashlab.peaks measured them: {metric: value}

    def __str__(self):
        return (f"{self.name}: compute capability {self.cc}, {self.sms} SMs; measured ceilings: "
                + ", ".join(f"{k} = {v:.1f}" for k, v in self.roof.items()))


def the_gpu() -> GPU:
    """This GPU live, else the one of the latest recorded rows: compute capability, SMs (an
    H100's 132 for a name flashlab.tiling does not know) and measured ceilings (those of the
    latest GPU measured, where this one has none)."""
    from . import peaks, tiling
    from .plots import latest_gpu
    env = environment() if gpu_available() else \
        measure.recorded(gpu=latest_gpu(results.load())).iloc[-1]
    return GPU(env["gpu"], str(env["compute_capability"]), tiling.sm_count(env["gpu"]) or 132,
               peaks.load(env["gpu"]) or peaks.load())


def banner():
    """Print whether the notebook runs live on a GPU or replays recorded results."""
    if gpu_available():
        env = environment()
        print(f"LIVE on {env['gpu']} (compute capability {env['compute_capability']}), torch "
              f"{env['torch']}, CUDA {env['cuda']}, commit {env['commit']}.\n"
              f"Measurements below are taken now and written to {results.path()}.")
    else:
        print("REPLAY: no CUDA GPU here, so the numbers below are the ones recorded in "
              f"{results.path()}, measured on {runner.describe_recording(results.load())}.")


def _source_text(st):
    return st.source.read_text()


def extract(text: str, name: str) -> str:
    """The definition of `name` (a function, kernel or struct) in C++ source text: from the line
    that declares it to its closing brace at column 0, with its leading comments."""
    lines = text.splitlines()
    pat = re.compile(rf"\b{re.escape(name)}\s*\(|\bstruct\s+{re.escape(name)}\b")
    for i, line in enumerate(lines):
        if pat.search(line) and not line.lstrip().startswith(("//", "return", "auto")) \
                and not line.rstrip().endswith(";"):
            start = i
            while start > 0 and (lines[start - 1].startswith(("//", "template", "__global__"))
                                 or lines[start - 1].startswith("__device__")):
                start -= 1
            end = i
            while end < len(lines) and not (lines[end].startswith("}")):
                end += 1
            return "\n".join(lines[start:end + 1])
    raise ValueError(f"no definition of {name!r} found")


def _code(text, language="cuda"):
    from IPython.display import Code, display
    display(Code(text, language=language))


def _text(stage):
    """A stage's .cu source, or a header in kernels/ named by its file name ("ptx.cuh")."""
    if str(stage).endswith(".cuh"):
        return (KERNELS / stage).read_text()
    return _source_text(_stage(stage))


def show_source(stage, name=None):
    """Show a stage's .cu file (or a header of kernels/, e.g. "ptx.cuh"), or just the
    definition of `name` in it."""
    text = _text(stage)
    _code(extract(text, name) if name else text)


def excerpt(text: str, start: str, stop=None) -> str:
    """The lines of `text` from the first that matches the regex `start` to the next that
    matches `stop` (just that line without one), each with its line number."""
    lines = text.splitlines()
    first = next((i for i, ln in enumerate(lines) if re.search(start, ln)), None)
    if first is None:
        raise ValueError(f"no line matches {start!r}")
    last = first if stop is None else next(
        (i for i in range(first, len(lines)) if re.search(stop, lines[i])), len(lines) - 1)
    return "\n".join(f"{i + 1:4}  {lines[i]}" for i in range(first, last + 1))


def show_lines(stage, start, stop=None):
    """Show a few numbered lines of a stage's source (see excerpt): the part a notebook is
    talking about, where it is not a whole function."""
    _code(excerpt(_text(stage), start, stop))


def show_diff(old, new, context=3):
    """A unified diff between two stages' .cu files: exactly what the newer stage changed."""
    a, b = _stage(old), _stage(new)
    diff = difflib.unified_diff(_source_text(a).splitlines(), _source_text(b).splitlines(),
                                f"kernels/{a.slug}.cu", f"kernels/{b.slug}.cu", n=context,
                                lineterm="")
    _code("\n".join(diff), "diff")


def resources(stage, archs=("sm_80", "sm_90")) -> pd.DataFrame:
    """ptxas's registers / shared memory / spills for each kernel of the stage (needs nvcc only)."""
    st = _stage(stage)
    try:
        rows = [r.__dict__ | {"kernel": r.kernel.split("(")[0].removeprefix("void "),
                              "spill_bytes": r.spill_bytes}
                for a in archs for r in ptxas.resources(st.source, a)]
        return pd.DataFrame(rows)
    except (OSError, RuntimeError) as err:
        rec = measure.recorded(st)[["gpu", "registers", "smem_static_bytes", "spill_bytes"]]
        print(f"(nvcc unavailable: {err}; showing the recorded ptxas numbers)")
        return rec.drop_duplicates()


def blocks_per_sm(stage, smem, threads=128) -> pd.DataFrame:
    """For each head dim D of `smem` ({D: shared-memory bytes per block}): the registers ptxas
    gives the stage's fp16 kernel for D (for this GPU's architecture, else sm_90) and the blocks
    per SM that registers, threads and shared memory each allow (flashlab.tiling.occupancy);
    `blocks` is the least of them, `decided_by` which."""
    from . import tiling
    res = resources(stage)
    if "kernel" not in res:  # nvcc unavailable, and the recorded rows name no kernels
        raise not_recorded(stage, " ptxas report")
    cc = the_gpu().cc
    arch = f"sm_{cc.replace('.', '')}"
    res = res[res["arch"] == (arch if arch in set(res["arch"]) else "sm_90")]
    rows = []
    for D, nbytes in smem.items():
        regs = int(res[res["kernel"].str.contains(f"__half, {D},")]["registers"].max())
        occ = tiling.occupancy(regs, int(nbytes), threads, cc)
        lim = occ["limits"]
        rows.append(dict(D=D, registers=regs, smem_bytes=int(nbytes),
                         **{f"by {k}": v for k, v in lim.items()}, blocks=occ["blocks"],
                         decided_by=min(lim, key=lim.get)))
    return pd.DataFrame(rows).set_index("D")


def instructions(stage, arch="sm_90") -> pd.DataFrame:
    """Static SASS instruction counts by kind (flashlab.sass), a row per kernel: compiled and
    disassembled now (needs nvcc and cuobjdump, not a GPU), else as recorded in data/sass.csv."""
    from . import sass
    st = _stage(stage)
    try:
        return sass.table([st.slug], arch)
    except (OSError, RuntimeError) as err:
        print(f"(cuobjdump or nvcc unavailable: {err}; showing the recorded counts)")
    rec = sass.load()
    rec = rec[(rec["stage"] == st.slug) & (rec["arch"] == arch)]
    if rec.empty:
        raise NotRecorded(f"{st.slug}: no {arch} SASS counts recorded yet: run "
                          f"`flashlab sass {st.number:02d} --record` where nvcc is installed")
    wide = rec.pivot_table(index=["stage", "kernel"], columns="category", values="count",
                           aggfunc="sum", sort=False)
    return wide[[*sass.CATEGORIES, sass.TOTAL]].astype(int).rename_axis(columns=None)


@contextlib.contextmanager
def _disassembling():
    """Static SASS inspection beyond instructions()' categories is not recorded in data/: where
    nvcc or cuobjdump is missing, NotRecorded says so (and unless_missing prints it)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        raise NotRecorded(f"this needs nvcc and cuobjdump here ({err}); data/sass.csv keeps only "
                          f"the categories that instructions() shows") from None


def _matching(kernels, pattern, slug):
    picked = sorted(k for k in set(kernels) if re.search(pattern, k))
    if not picked:
        raise ValueError(f"{slug} has no kernel matching {pattern!r}")
    return picked[0]


def opcode_changes(stages, kernel=r"__half, 64,", arch="sm_90") -> pd.DataFrame:
    """Static SASS counts of every opcode whose count differs between the stages' kernels (the
    first kernel of each stage whose name matches the regex `kernel`), most changed first:
    finer than instructions()' categories. Compiled and disassembled now (nvcc, cuobjdump)."""
    from . import sass
    counts = {}
    with _disassembling():
        for name in stages:
            st = _stage(name)
            mix = sass.instruction_mix(st.source, arch)
            counts[st.slug] = mix[mix["kernel"] == _matching(mix["kernel"], kernel, st.slug)] \
                .set_index("opcode")["count"]
    table = pd.DataFrame(counts).fillna(0).astype(int)
    table = table[table.nunique(axis=1) > 1]
    spread = table.max(axis=1) - table.min(axis=1)
    return table.loc[spread.sort_values(ascending=False, kind="stable").index].rename_axis("opcode")


def sass_lines(stage, pattern, kernel=r"__half, 64,", arch="sm_90") -> list:
    """The machine instructions of a stage's kernel (the first whose name matches the regex
    `kernel`) that match the regex `pattern`, as cuobjdump writes them, without the encodings:
    ['/*0660*/ LDGSTS.E.BYPASS.128 [R21], desc[UR6][R10.64], !P0 ;', ...]."""
    from . import sass
    st = _stage(stage)
    with _disassembling():
        text = sass.disassemble(st.source, arch)
    parts = re.split(r"^\s*Function\s*:\s*", text, flags=re.M)[1:]
    names = map(sass.short_name, ptxas.kernel_names([p.split(None, 1)[0] for p in parts]))
    bodies = dict(zip(names, parts))
    lines = []
    for line in bodies[_matching(bodies, kernel, st.slug)].splitlines():
        m = re.match(r"\s*(/\*[0-9a-f]+\*/)\s+([^;]*;)", line)
        if m and re.search(pattern, m.group(2)):
            lines.append(f"{m.group(1)} {' '.join(m.group(2).split())}")
    return lines


def loop_bodies(stages, kernel=r"__half, 64,", arch="sm_90") -> pd.DataFrame:
    """The K/V loop of each stage's kernel (the first matching the regex `kernel`), read off its
    machine code (flashlab.sass.loops: the loop with the most HMMA): instructions in one trip
    and the categories among them, a row per stage; categories that are 0 everywhere left out."""
    from . import sass
    rows = {}
    with _disassembling():
        for name in stages:
            st = _stage(name)
            found = sass.loops(st.source, arch)
            mine = found[found["kernel"] == _matching(found["kernel"], kernel, st.slug)]
            rows[st.slug] = mine.sort_values("HMMA").iloc[-1]
    table = pd.DataFrame(rows).T.drop(columns=["first", "last"])
    kernel_col = table.pop("kernel")
    table = table.astype(int)
    table = table.loc[:, (table != 0).any()]
    table.insert(0, "kernel", kernel_col)
    return table.rename_axis("stage")


@dataclass
class Evaluation:
    """What evaluate() returns: the check cases and the timed rows, live or recorded."""
    stage: str
    live: bool
    check: pd.DataFrame
    rows: pd.DataFrame
    build_s: float = float("nan")

    @property
    def passed(self) -> bool:
        return bool(len(self.check)) and bool(self.check["passed"].all())

    def timing(self, dtype="fp32", missing_ok=False):
        """The row at the teaching config. Not recorded: NotRecorded, or with missing_ok the
        message printed and None."""
        r = at_config(self.rows, teaching(dtype)) if len(self.rows) else self.rows
        if r.empty:
            return _missing(not_recorded(self.stage, f" at the {dtype} teaching config"),
                            missing_ok, None)
        return r.iloc[-1]

    def __str__(self):
        if not (len(self.check) or len(self.rows)):
            return str(not_recorded(self.stage))
        mode = "measured now" if self.live else "recorded"
        lines = [f"{self.stage} ({mode}): check {'PASSED' if self.passed else 'FAILED'} on "
                 f"{len(self.check)} cases, max relative error {self.check['rel_err'].max():.2e}"]
        if self.live and self.build_s == self.build_s:
            lines.append(f"build (or load from cache): {self.build_s:.1f} s")
        for _, r in self.rows.iterrows():
            if r.get("status", "ok") != "ok":
                lines.append(f"  B={r.B} H={r.H} N={r.N} D={r.D} {r['dtype']}: {r.status}")
                continue
            # r["dtype"]: r.dtype would be the row's own pandas dtype
            lines.append(f"  B={r.B} H={r.H} N={r.N} D={r.D} {r['dtype']}{' causal' if r.causal else ''}: "
                         f"{r.median_ms:.3f} ms (p20 {r.p20_ms:.3f}, p80 {r.p80_ms:.3f}), "
                         f"{r.tflops:.2f} TFLOP/s, rel err {r.rel_err:.1e}, on {r.gpu}")
        return "\n".join(lines)

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731


def evaluate(stage, configs=None) -> Evaluation:
    """On a GPU: build, check, time at the standard configs (or `configs`) and record.
    Without one: the same information from the recorded tables."""
    st = _stage(stage)
    if gpu_available():
        t0 = time.perf_counter()
        attn = st.build()
        build_s = time.perf_counter() - t0
        chk, rows = measure.measure_stage(st, configs, log=lambda msg: None, attn=attn)
        # Hand back the rows as the table now holds them (with the columns that only the
        # table computes, such as % of SDPA), so live and replay give notebooks the same data.
        table = measure.recorded(st, gpu=environment()["gpu"])
        if len(rows):
            keys = ["dtype", "B", "H", "N", "D", "causal"]
            rows = table.merge(rows[keys].astype(table[keys].dtypes.to_dict()), on=keys)
        return Evaluation(st.slug, True, pd.DataFrame(chk.rows()), rows, build_s)
    # Nothing recorded yet: an empty Evaluation, which prints what to run.
    return Evaluation(st.slug, False, measure.recorded_checks(st), measure.recorded(st))


def compare(dtype="fp32", names=None) -> pd.DataFrame:
    """Every stage and baseline at the teaching config, slowest first, as recorded now."""
    df = results.load()
    from .plots import latest_gpu
    gpu = latest_gpu(df)
    df = at_config(df[df["gpu"] == gpu], teaching(dtype))
    df = df[df["status"].fillna("ok") == "ok"]
    if names is not None:
        df = df[df["stage"].isin(names)]
    cols = ["stage", "kind", "median_ms", "tflops", "pct_sdpa_best", "rel_err", "registers",
            "spill_bytes", "gpu"]
    return df.sort_values("median_ms", ascending=False)[cols].reset_index(drop=True)


def sweep_ratio(new, old, dtype="fp16") -> pd.DataFrame:
    """new's TFLOP/s over old's at every recorded point of the FlashAttention sweep (B·N = 16k,
    H·D = 2048) on the GPU the notebooks show: rows (D, causal), columns N."""
    df = results.load()
    df = df[(df["gpu"] == the_gpu().name) & (df["dtype"] == dtype)
            & (df["B"] * df["N"] == 16384) & (df["H"] * df["D"] == 2048)
            & (df["status"].fillna("ok") == "ok")]
    wide = df.pivot_table(index=["D", "causal", "N"], columns="stage", values="tflops")
    for name in (new, old):
        if name not in wide:
            raise not_recorded(name, f" over the {dtype} FlashAttention sweep")
    return (wide[new] / wide[old]).unstack("N")


def speedup(slower, faster, dtype="fp32", faster_dtype=None, missing_ok=False) -> float:
    """How many times faster `faster` ran than `slower` at the teaching config (recorded), each
    in `dtype`, or `faster` in `faster_dtype` (fp32 stage 03 against an fp16 stage, say). Not
    recorded: NotRecorded, or with missing_ok the message printed and NaN."""
    times = []
    for name, d in ((slower, dtype), (faster, faster_dtype or dtype)):
        t = compare(d).set_index("stage")["median_ms"]
        if name not in t:
            return _missing(not_recorded(name, f" at the {d} teaching config"), missing_ok,
                            float("nan"))
        times.append(t[name])
    return float(times[0] / times[1])


def profile(stage, config=None, missing_ok=False) -> pd.DataFrame:
    """Nsight Compute metrics of `stage` at the teaching config, beside its predecessor's:
    profiled now when a GPU and ncu are here (and recorded), else as recorded."""
    from . import profile as prof
    from .stages import stages
    st = _stage(stage)
    cfg = config or teaching(st.dtypes[0])
    ok, why = prof.available()
    if ok:
        prof.profile(st, cfg)
    else:
        print(f"(replay: {why}; the metrics below were recorded by `flashlab run --profile`)")
    recorded = prof.load(gpu=_profile_gpu(prof))
    # Each stage at its own teaching config: fp32 stage 03 sits beside fp16 stage 04.
    tables = {}
    for s in stages():
        if s.number > st.number:
            break
        t = prof.wide(recorded, cfg if s.slug == st.slug else teaching(s.dtypes[0]))
        if s.slug in t.index:
            tables[s.slug] = t.loc[[s.slug]]
    rows = list(tables)[-2:]
    if st.slug not in rows:  # with missing_ok, the predecessor alone
        rows = _missing(not_recorded(st, f" profile at {cfg.label}", " --profile"), missing_ok,
                        rows[-1:])
    if not rows:
        return pd.DataFrame()
    return pd.concat([tables[r] for r in rows]).T


def _profile_gpu(prof):
    df = prof.load()
    if df.empty:
        return None
    if gpu_available():
        here = environment()["gpu"]
        if here in set(df["gpu"]):
            return here
    return df.sort_values("time")["gpu"].iloc[-1]

