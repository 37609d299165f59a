"""Measured numbers in a notebook: evaluate() builds, checks, times and records a stage when the
notebook runs live, and reads the same from data/ when it replays; compare(), speedup(),
teaching_rows(), sweep_ratio() and profile() read the recorded tables. All of them show the
notebook's GPU only (flashlab.notebook.view.gpu)."""
import importlib.util
import time
from dataclasses import dataclass

import pandas as pd

from .. import measure, tables
from ..configs import teaching
from ..baselines import COMPARED
from ..dtypes import HALF
from ..stages import backward_ladder, before
from ..stages import stage as _stage
from ..stages import stages
from ..tables import at_config
from . import view
from .view import _missing, not_recorded


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
        """The row at the teaching config (the rows are one GPU's: the notebook's). Not
        recorded: NotRecorded, or with missing_ok the message printed and None."""
        r = at_config(self.rows, teaching(dtype)) if len(self.rows) else self.rows
        why = _stage(self.stage).unavailable_dtypes().get(dtype) if self.live else None
        if r.empty and why is not None:  # live on a GPU this dtype needs more than (bf16 on a T4)
            return _missing(tables.NotRecorded(f"{why}: {dtype} is not run here"), missing_ok, None)
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
    """Live (see flashlab.tables.live): build, check, time at the standard configs (or
    `configs`, the stage alone) and record. A fast stage is timed as `flashlab run` times its
    sweep: together with the stage before it (where that runs here) and SDPA's compared
    backends, config by config, run by run in turn (measure.measure_interleaved), at the
    teaching configs and over the sweep, so that the ratios a notebook shows come from one run.
    Replay: the same information as recorded on the notebook's GPU."""
    st = _stage(stage)
    if tables.live(st):
        t0 = time.perf_counter()
        attn = st.build()
        build_s = time.perf_counter() - t0
        quiet = lambda msg: None  # noqa: E731
        together = st.fast and configs is None
        standard = measure.configs_for(st)
        chk, rows = measure.measure_stage(st, [] if together else configs, log=quiet, attn=attn,
                                          untimed=standard if together else ())
        if chk.passed and together:
            prev = before(st)
            timed = [prev] if prev is not None and prev.fast and tables.live(prev) else []
            timed.append(st)
            cfgs = [c for c in standard if c == teaching(c.dtype)]
            cfgs += [c for c in measure.interleaved_configs(timed) if c not in cfgs]
            rows = measure.measure_interleaved(timed, configs=cfgs, log=quiet)
            rows = rows[rows["stage"] == st.slug] if len(rows) else rows
        # Hand back the rows as the table now holds them (with the columns that only the
        # table computes, such as % of SDPA), so live and replay give notebooks the same data.
        table = tables.recorded(st, gpu=tables.gpu_shown(st))
        if len(rows):
            keys = ["dtype", "B", "H", "N", "D", "causal"]
            rows = table.merge(rows[keys].astype(table[keys].dtypes.to_dict()), on=keys)
        return Evaluation(st.slug, True, pd.DataFrame(chk.rows()), rows, build_s)
    # Nothing recorded yet: an empty Evaluation, which prints what to run.
    gpu = view.gpu()
    return Evaluation(st.slug, False, tables.recorded_checks(st, gpu), tables.recorded(st, gpu))


@dataclass
class BackwardEvaluation:
    """What evaluate_backward() returns: the backward's checks (live) and its rows, beside SDPA's
    backwards and the stage's forward with and without the log-sum-exp, live or recorded."""
    stage: str
    live: bool
    checks: list          # CheckResults (live) or [] (replay: the rows say the check passed)
    rows: pd.DataFrame    # pass "backward", "forward" and "forward_lse" rows, at the teaching configs

    def _at(self, name, pass_, dtype, causal):
        r = self.rows
        hit = r[(r["stage"] == name) & (r["pass"] == pass_) & (r["dtype"] == dtype)
                & (r["causal"] == bool(causal))]
        if hit.empty:
            raise not_recorded(name, f" ({pass_}, {dtype}{', causal' if causal else ''}) at the "
                               "teaching config", "")
        return hit.iloc[-1]

    def ratio(self, other, dtype="fp16", causal=False) -> float:
        """The stage's backward speed relative to `other`'s backward: other's ms / the stage's,
        both of one run (timed in turn); NotRecorded where `other` was not timed in that run."""
        mine = self._at(self.stage, "backward", dtype, causal)
        r = self.rows
        run = tables.timed_with(r[(r["dtype"] == dtype) & (r["causal"] == bool(causal))],
                                self.stage)
        theirs = run[(run["stage"] == other) & (run["pass"] == "backward")]
        if theirs.empty:
            raise tables.NotRecorded(
                f"{other}'s backward was not timed in the run that timed {self.stage}'s ({dtype}"
                f"{', causal' if causal else ''}): `{tables.run_command(self.stage)}` times them "
                "in turn")
        return float(theirs.iloc[-1].median_ms / mine.median_ms)

    def versus(self, others, dtype="fp16", causal=False) -> str:
        """'0.85x sdpa_flash, 13.6x 14_backward': the stage's backward speed relative to each of
        `others` timed in the same run; those that were not are named as such."""
        parts = []
        for other in others:
            try:
                parts.append(f"{self.ratio(other, dtype, causal):.3g}x {other}")
            except tables.NotRecorded:
                parts.append(f"{other} not timed in this run")
        return ", ".join(parts)

    def lse_cost(self, dtype="fp16", causal=False) -> tuple:
        """(the forward's ms, the forward's ms when it also returns the log-sum-exp), timed in
        turn."""
        return (float(self._at(self.stage, "forward", dtype, causal).median_ms),
                float(self._at(self.stage, "forward_lse", dtype, causal).median_ms))

    def __str__(self):
        if self.rows.empty:
            return str(not_recorded(self.stage, " backward"))
        lines = []
        for chk in self.checks:
            lines.append(str(chk).splitlines()[0])
        if not self.live:
            lines.append(f"{self.stage} backward (recorded): checked against float64 before it "
                         "was timed")
        order = {"backward": 0, "forward": 1, "forward_lse": 2}
        df = self.rows.assign(_o=self.rows["pass"].map(order)).sort_values(
            ["dtype", "causal", "_o", "median_ms"], ascending=[False, True, True, True])
        for _, r in df.iterrows():
            what = {"backward": "backward", "forward": "forward", "forward_lse": "forward + lse"}
            lines.append(f"  {r.stage:12} {what[r['pass']]:14} B={r.B} H={r.H} N={r.N} D={r.D} "
                         f"{r['dtype']}{' causal' if r.causal else '       '}: {r.median_ms:8.3f} ms "
                         f"{r.tflops:7.2f} TFLOP/s  on {r.gpu}")
        return "\n".join(lines)

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731


def evaluate_backward(stage) -> BackwardEvaluation:
    """Live: check the stage's backward and those of the backward stages it builds on (dq, dk,
    dv against float64, FlashAttention's rule), their log-sum-exps and, for a deterministic
    stage, the same bits on every run; then time all these backwards beside SDPA's flash and
    cuDNN backwards, and their forwards with and without the log-sum-exp, in turn, at the
    teaching configs (causal and not), and record the rows (flashlab.measure.measure_backward).
    Replay: the same rows as recorded on the notebook's GPU. Compare rows of one run: ratio,
    versus."""
    st = _stage(stage)
    timed = backward_ladder(st)
    names = [s.slug for s in timed] + list(COMPARED)
    passes = ("backward", "forward", "forward_lse")
    if tables.live(st):
        checks, rows = measure.measure_backward(timed, log=lambda msg: None)
        gpu = tables.gpu_shown(st)
        return BackwardEvaluation(st.slug, True, checks, _teaching_only(
            tables.pass_rows(names, gpu, passes)))
    gpu = view.gpu()
    return BackwardEvaluation(st.slug, False, [], _teaching_only(
        tables.pass_rows(names, gpu, passes)))


def _teaching_only(df):
    keep = pd.Series(False, index=df.index)
    for dt in HALF:
        t = teaching(dt)
        keep |= ((df["dtype"] == dt) & (df["B"] == t.B) & (df["H"] == t.H) & (df["N"] == t.N)
                 & (df["D"] == t.D))
    return df[keep].reset_index(drop=True)


def compare(dtype="fp32", names=None) -> pd.DataFrame:
    """Every stage and baseline at the teaching config on the notebook's GPU, slowest first."""
    df = tables.ok(at_config(tables.recorded(gpu=view.gpu()), teaching(dtype)))
    if names is not None:
        df = df[df["stage"].isin(names)]
    cols = ["stage", "kind", "median_ms", "tflops", "pct_sdpa_best", "rel_err", "registers",
            "spill_bytes", "gpu"]
    return df.sort_values("median_ms", ascending=False)[cols].reset_index(drop=True)


def sweep_ratio(new, old, dtype="fp16", pass_="forward") -> pd.DataFrame:
    """new's TFLOP/s over old's at every recorded point of the FlashAttention sweep on the
    notebook's GPU, forward or backward (pass_): rows (D, causal), columns N. Says so when the
    two were not timed in turn in one run (a later run re-recorded one of them)."""
    df, gpu = tables.RESULTS.load(every=True), view.gpu()
    out = tables.sweep_ratio(new, old, dtype, df=df, gpu=gpu, pass_=pass_)
    a, b = tables.sweep_runs([new, old], dtype, df=df, gpu=gpu, pass_=pass_).values()
    if a != b:
        print(f"{new} was timed at {', '.join(a)} and {old} at {', '.join(b)}: in different runs, "
              "so the ratio holds the GPU's drift between the two runs too")
    return out


# A row whose p80 is more than WIDE times its p20: its median is not the kernel's time.
WIDE = 1.1


def teaching_rows(stages, dtypes=HALF) -> pd.DataFrame:
    """The recorded rows of `stages` at the teaching config in each of `dtypes` on the notebook's
    GPU, with the spread of their timed runs (p20, p80); prints each row whose p80 is more than
    10 % above its p20 (read its median with care), or that none is."""
    rows = pd.concat([at_config(tables.recorded(s, gpu=view.gpu()), teaching(d))
                      for s in stages for d in dtypes])
    wide = rows[rows.p80_ms > WIDE * rows.p20_ms]
    for _, r in wide.iterrows():
        print(f"{r['stage']} {r['dtype']}: p80 is {r.p80_ms / r.p20_ms - 1:.0%} above p20 - a wide "
              "spread: read this row's median with care")
    if wide.empty:
        print("every row's p80 is within 10 % of its p20")
    return rows.set_index(["stage", "dtype"])[["median_ms", "p20_ms", "p80_ms", "tflops", "commit"]]


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


_SAID = set()


def _once_per_cell(line):
    """print(line), once in a notebook cell that asks twice (two profiles side by side); every
    time outside IPython."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None:
        key = (shell.execution_count, line)
        if key in _SAID:
            return
        _SAID.add(key)
    print(line)


def profile(stage, config=None, missing_ok=False, pass_="forward") -> pd.DataFrame:
    """Nsight Compute metrics of `stage` at the teaching config, beside its predecessor's:
    profiled now when the notebook runs live and ncu is here (and recorded), else as recorded
    on the notebook's GPU. pass_="backward": the stage's backward kernel, beside its forward."""
    from .. import profile as prof
    st = _stage(stage)
    cfg = config or teaching(st.dtypes[0])
    ok, why = prof.available()
    if ok and view.live():
        prof.profile(st, cfg, pass_=pass_)
    else:
        _once_per_cell(f"(replay: {why or 'this stage does not run here'}; the metrics below "
                       f"were recorded by `flashlab run --profile`)")
    recorded = tables.profile_rows(view.gpu())
    recorded = tables.PROFILE.load().iloc[:0] if recorded is None else recorded
    if pass_ == "backward":
        t = tables.profile_wide(recorded, cfg)
        name = prof.backward_name(st)
        if name not in t.index:
            return _missing(not_recorded(st, f" backward profile at {cfg.label}", " --profile"),
                            missing_ok, pd.DataFrame())
        return t.loc[[n for n in (st.slug, name) if n in t.index]].T
    # Each stage at its own teaching config: fp32 stage 03 sits beside fp16 stage 04.
    found = {}
    for s in stages():
        if s.number > st.number:
            break
        t = tables.profile_wide(recorded, cfg if s.slug == st.slug else teaching(s.dtypes[0]))
        if s.slug in t.index:
            found[s.slug] = t.loc[[s.slug]]
    rows = list(found)[-2:]
    if st.slug not in rows:  # with missing_ok, the predecessor alone
        rows = _missing(not_recorded(st, f" profile at {cfg.label}", " --profile"), missing_ok,
                        rows[-1:])
    if not rows:
        return pd.DataFrame()
    return pd.concat([found[r] for r in rows]).T


def _times(ratio, other):
    """'1.53× faster than x' or '180× slower than x' (never '0.01× x')."""
    if ratio >= 1:
        return f"{ratio:.2f}× faster than {other}"
    return f"{1 / ratio:.3g}× slower than {other}"


def reached(stage, missing_ok=True) -> None:
    """Prints one line for a notebook's summary: the number `stage` reached at the teaching config on
    the notebook's GPU (each of its dtypes), against the stage before it and PyTorch's fastest
    attention in the same dtype, all from the recorded rows. A stage with a backward pass: its
    backward, against the backward of the stage before it and SDPA's flash and cuDNN backwards,
    where they were timed in the same run."""
    st = _stage(stage)
    if st.has_backward:
        return _reached_backward(st, missing_ok)
    earlier = [s for s in stages() if s.number < st.number]
    parts = []
    skipped = st.unavailable_dtypes() if tables.live(st) else {}  # bf16 of stage 04 on a T4
    for dtype in st.dtypes:
        if dtype in skipped:
            continue
        rows = compare(dtype).set_index("stage")
        if st.slug not in rows.index:
            return _missing(not_recorded(st, f" at the {dtype} teaching config"), missing_ok, "")
        r = rows.loc[st.slug]
        line = f"{st.slug} reached {r.tflops:.3g} TFLOP/s ({r.median_ms:.3g} ms) in {dtype}"
        prev = [s.slug for s in earlier if s.slug in rows.index]
        versus = []
        if prev:
            versus.append(_times(rows.loc[prev[-1], "median_ms"] / r.median_ms, prev[-1]))
        base = rows[rows["kind"] == "baseline"]
        if len(base):
            best = base.sort_values("median_ms").iloc[0]
            versus.append(f"{_times(best.median_ms / r.median_ms, best.name)} (PyTorch's fastest "
                          f"{dtype} attention)")
        if versus:
            line += ": " + " and ".join(versus)
        parts.append(line)
    parts += skipped.values()
    text = f"On {view.gpu()}, at the teaching config: " + "; ".join(parts) + "."
    print(text)
    return None


def _reached_backward(st, missing_ok):
    earlier = [s.slug for s in stages() if s.has_backward and s.number < st.number]
    rows = _teaching_only(tables.pass_rows([st.slug, *earlier, *COMPARED], view.gpu()))
    parts = []
    for dtype in st.dtypes:
        t = teaching(dtype)
        here = rows[(rows["dtype"] == dtype) & (rows["causal"] == t.causal)]
        run = tables.timed_with(here, st.slug)  # set beside only what was timed in turn with it
        if run.empty:
            return _missing(not_recorded(st, f" backward at the {dtype} teaching config"),
                            missing_ok, "")
        ms = run.groupby("stage")["median_ms"].last()
        r = run[run["stage"] == st.slug].iloc[-1]
        line = f"{st.slug}'s backward reached {r.tflops:.3g} TFLOP/s ({r.median_ms:.3g} ms) in {dtype}"
        versus = []
        # the stage it improves on (its builds_on: 22 against 20, not the deterministic 21)
        # where that was timed in the run, else the last earlier backward that was
        base = before(st)
        prev = [s for s in earlier if s in ms]
        prev = [base.slug] if base is not None and base.slug in ms else prev[-1:]
        if prev:
            versus.append(_times(ms[prev[-1]] / r.median_ms, f"{prev[-1]}'s"))
        versus += [_times(ms[b] / r.median_ms, f"{b}'s") for b in COMPARED if b in ms]
        if versus:
            line += ": " + ", ".join(versus)
        elif dtype == "fp16":
            line += (" (no other backward of that run is still recorded: "
                     f"`{tables.run_command(st.slug)}` times SDPA's in turn with it)")
        parts.append(line)
    print(f"On {view.gpu()}, at the teaching config: " + "; ".join(parts) + ".")
    return None


def published_minimal(missing_ok=True) -> pd.DataFrame:
    """The published flash-attention-minimal kernel, variants of it and stage 01, timed in one
    process on the notebook's GPU (tools/compare_minimal.py), with each one's speed-up over the
    published extension. Not recorded: the command that records it."""
    rows = tables.minimal_rows(view.gpu())
    if rows.empty:
        return _missing(tables.NotRecorded(
            f"not recorded on {view.gpu()} yet: python tools/compare_minimal.py "
            "PATH_TO_A_CHECKOUT_OF_flash-attention-minimal"), missing_ok, rows)
    out = rows[["variant", "description", "median_ms", "tflops", "rel_err"]].copy()
    out["speedup"] = rows["median_ms"].iloc[0] / rows["median_ms"]
    return out.round({"median_ms": 1, "tflops": 3, "speedup": 2})


def attention_alone() -> pd.DataFrame:
    """One attention call at GPT-2's shape, alone, in the model's layout and contiguous, as
    recorded on the notebook's GPU by in_a_model: kernel time, TFLOP/s, copies, wall time per
    call, and the host's own time per call."""
    rows = tables.model_rows(view.gpu(), model="gpt2-attention")
    out = rows[["impl", "dtype", "layout", "attention_gpu_ms", "tflops", "other_gpu_ms",
                "forward_ms", "host_ms", "input_copies"]].copy()
    for col in ("attention_gpu_ms", "other_gpu_ms", "forward_ms", "host_ms"):
        out[col.replace("_ms", "_us")] = out.pop(col) * 1e3
    return out.rename(columns={"attention_gpu_us": "kernel_us", "other_gpu_us": "copies_us",
                               "forward_us": "wall_us"})


def in_a_model(**kwargs) -> pd.DataFrame:
    """Live (the notebook's stage runs here and transformers is installed): flashlab.model.measure
    (GPT-2 with SDPA, eager and each fast stage as its attention; kwargs: its options), recorded
    in data/model.csv. Replay: the rows recorded on the notebook's GPU."""
    from .. import model
    if tables.live(view.stage()) and importlib.util.find_spec("transformers") is not None:
        model.measure(log=lambda msg: None, **kwargs)
    rows = tables.model_rows(view.gpu())
    shown = ["impl", "dtype", "max_abs_diff", "forward_ms", "busy_gpu_ms", "attention_gpu_ms",
             "matmul_gpu_ms", "other_gpu_ms", "input_copies"]
    out = rows[shown + ["kind", "batch", "seq", "n_layer", "max_abs_logit", "attention_kernels",
                        "gpu", "commit"]].copy()
    for dt, sub in out.groupby("dtype"):
        sdpa = sub.loc[sub["impl"] == "sdpa", "forward_ms"]
        eager = sub.loc[sub["impl"] == "eager", "max_abs_diff"]
        busy = sub.loc[sub["impl"] == "sdpa", "busy_gpu_ms"]
        if len(sdpa):
            out.loc[sub.index, "wall_vs_sdpa"] = sub["forward_ms"] / float(sdpa.iloc[0])
        if len(busy):
            out.loc[sub.index, "gpu_vs_sdpa"] = sub["busy_gpu_ms"] / float(busy.iloc[0])
        if len(eager):
            out.loc[sub.index, "within_rule"] = sub["max_abs_diff"] <= 2 * float(eager.iloc[0])
    return out
