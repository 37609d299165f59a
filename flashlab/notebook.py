"""What the notebooks call: one line per step, live on a GPU and replayed from data/ without one.

    from flashlab import notebook as nb
    nb.banner()                       # says which mode this is, and where recorded numbers came from
    nb.show_source("02_coalesced", "load_tile")   # a function of the .cu, highlighted
    nb.show_diff("01_naive", "02_coalesced")      # what this stage changed
    ev = nb.evaluate("02_coalesced")  # build + check + time + record (GPU) or the recorded rows
    nb.compare()                      # every stage and baseline at the teaching config
"""
import difflib
import re
import time
from dataclasses import dataclass

import pandas as pd

from . import measure, ptxas, results, runner
from .bench import teaching
from .env import environment, gpu_available
from .results import at_config
from .stages import stage as _stage

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


def show_source(stage, name=None):
    """Show a stage's .cu file, or just the definition of `name` in it."""
    st = _stage(stage)
    text = _source_text(st)
    _code(extract(text, name) if name else text)


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


def _latest_gpu():
    from .plots import latest_gpu
    return latest_gpu(results.load()) or "any GPU"


def not_recorded(stage, what="") -> str:
    """The sentence a notebook prints in place of numbers nobody has measured yet."""
    st = _stage(stage)
    return (f"{st.slug}{' ' + what if what else ''}: not recorded yet on {_latest_gpu()}: run "
            f"`flashlab run --stage {st.number:02d}` on a GPU")


@dataclass
class Evaluation:
    """What evaluate() returns: the check cases and the timed rows, live or recorded (both
    empty when nothing is recorded for the stage yet)."""
    stage: str
    live: bool
    check: pd.DataFrame
    rows: pd.DataFrame
    build_s: float = float("nan")

    @property
    def passed(self) -> bool:
        return bool(len(self.check)) and bool(self.check["passed"].all())

    def timing(self, dtype="fp32", missing_ok=False):
        """The row at the teaching config; with missing_ok, None (and a printed note) when it
        was not recorded, instead of a LookupError."""
        r = at_config(self.rows, teaching(dtype)) if len(self.rows) else self.rows
        if r.empty:
            msg = not_recorded(self.stage, f"{dtype} teaching-config timing")
            if missing_ok:
                print(msg)
                return None
            raise LookupError(msg)
        return r.iloc[-1]

    def __str__(self):
        if self.check.empty and self.rows.empty:
            return not_recorded(self.stage)
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
    checks = measure.recorded_checks(st)
    rows = measure.recorded(st)
    return Evaluation(st.slug, False, checks, rows)  # both empty: str() says what to run


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


def speedup(slower, faster, dtype="fp32", faster_dtype=None, missing_ok=False) -> float:
    """How many times faster `faster` ran than `slower` at the teaching config (recorded), each in
    its dtype (`faster_dtype` defaults to `dtype`: fp32 stage 03 against fp16 stage 04 is
    speedup("03_coarsened", "04_wmma", "fp32", "fp16")). A missing timing raises LookupError, or
    with missing_ok prints why and gives NaN."""
    times = []
    for name, dt in ((slower, dtype), (faster, faster_dtype or dtype)):
        table = compare(dt)
        t = table.set_index("stage")["median_ms"]
        if name not in t:
            gpu = table["gpu"].iloc[0] if len(table) else _latest_gpu()
            msg = (f"no {dt} teaching-config timing of {name} on {gpu} yet: run its notebook (or "
                   f"`flashlab run`) on this GPU first")
            if missing_ok:
                print(msg)
                return float("nan")
            raise LookupError(msg)
        times.append(t[name])
    return float(times[0] / times[1])


def profile(stage, config=None, missing_ok=False) -> pd.DataFrame:
    """Nsight Compute metrics of `stage` at the teaching config, beside its predecessor's:
    profiled now when a GPU and ncu are here (and recorded), else as recorded. Without a profile
    of `stage`: LookupError, or with missing_ok a printed note and the predecessor's column."""
    from . import profile as prof
    from .stages import stages
    from .plots import _by_stage, profile_rows
    st = _stage(stage)
    cfg = config or teaching(st.dtypes[0])
    ok, why = prof.available()
    if ok:
        prof.profile(st, cfg)
    else:
        print(f"(replay: {why}; the metrics below were recorded by `flashlab run --profile`)")
    gpu = _profile_gpu(prof)
    if config is None:  # each stage at the teaching config in its own dtype (03 fp32, 04 fp16)
        table = _by_stage(profile_rows(gpu=gpu)[0]) if gpu else pd.DataFrame()
    else:
        table = prof.wide(prof.load(gpu=gpu), cfg)
    order = [s.slug for s in stages() if s.number <= st.number]
    rows = [s for s in order if s in table.index][-2:]
    if st.slug not in rows:
        msg = (f"no profile of {st.slug} at {cfg.label} recorded yet on {gpu or 'any GPU'}: run "
               f"`flashlab run --stage {st.number:02d} --profile` on a GPU with Nsight Compute")
        if not missing_ok:
            raise LookupError(msg)
        print(msg)
        rows = rows[-1:]  # the predecessor alone
    return table.loc[rows].T.sort_index()


def _profile_gpu(prof):
    df = prof.load()
    if df.empty:
        return None
    if gpu_available():
        here = environment()["gpu"]
        if here in set(df["gpu"]):
            return here
    return df.sort_values("time")["gpu"].iloc[-1]

