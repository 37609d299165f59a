"""Every table flashlab records in data/, and the questions everyone asks of them. No other module
opens these files or filters their rows by hand.

  results.csv   a row per (stage or baseline, pass, config, dtype, causal, GPU, GPU count): times,
                TFLOP/s, error
  checks.csv    every correctness case of every stage's last check
  peaks.csv     the GPU's measured ceilings (matmul TFLOP/s, copy TB/s)
  profile.csv   Nsight Compute metrics (raw ncu output beside it, in profiles/)
  sass.csv      each stage's static SASS instruction mix
  tune08.csv    stage 08's tuning log
  minimal.csv   stage 01 beside the published flash-attention-minimal kernel
  model.csv     a GPT-2 run with each attention: logits against SDPA, forward time

Each is a Table: its file, key and column types, a loader that gives the same types every time,
and an upsert that holds a file lock and replaces the file by an atomic rename, so a killed run or
two notebooks writing at once never corrupt or lose it.

The results table's columns stage, dtype, B, H, N, D, causal, median_ms, tflops, rel_err, gpu,
pass, gpus are a contract outside tools may read (RESULTS.contract).

Which GPU's numbers are shown is decided in one place, gpu_shown(): every number one view (a
notebook, a figure, a table, the README) shows comes from that one GPU, and the view says which.
"""
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
from filelock import FileLock

from . import paths
from .baselines import COMPARED
from .configs import SWEEP, Config, teaching
from .dtypes import NAMES
from .env import environment, gpu_available
from .profile_schema import COLUMNS as PROFILE_COLUMNS
from .profile_schema import KEY as PROFILE_KEY
from .stages import stage as _stage
from .stages import fastest_forward as _fastest
from .stages import stages as _stages

SOFTWARE = ["compute_capability", "torch", "cuda", "commit", "time"]  # beside every recorded row


class NotRecorded(LookupError):
    """Numbers a view asks for are not in data/ yet: the message says what records them."""


def _flag(col):
    return col.map(lambda x: str(x).strip().lower() in ("true", "1", "1.0"))


class Table:
    """One CSV file of data/: its key, its columns and their types, load and upsert."""

    def __init__(self, name, key, columns, ints=(), floats=(), bools=(), contract=(), sort=None,
                 derive=None, defaults=None, view=None):
        self.name, self.key, self.columns = name, list(key), list(columns)
        # (column, value): the rows load() gives unless asked for all (results.csv: the forward
        # pass, so that no view built for forward rows meets a backward one by accident)
        self.view = view
        self.defaults = dict(defaults or {})  # {column: value} for rows recorded without it
        self.ints, self.floats, self.bools = list(ints), list(floats), list(bools)
        self.contract = list(contract)
        self.sort, self.derive = sort, derive
        typed = set(self.ints) | set(self.floats) | set(self.bools)
        # Read as text: "12.10" must not become 12.1, nor an all-digit commit hash a number.
        self.text = [c for c in self.columns if c not in typed]

    def __repr__(self):
        return f"<flashlab table {self.name}: key {', '.join(self.key)}>"

    def path(self) -> Path:
        return paths.data_dir() / self.name

    def normalise(self, df: pd.DataFrame) -> pd.DataFrame:
        """The table's columns first, in order, each with its type; any others kept after them."""
        df = df.copy()
        for col in self.columns:
            if col not in df:
                df[col] = pd.NA
        for col, value in self.defaults.items():
            df[col] = df[col].fillna(value)
        for col in self.ints:
            df[col] = pd.to_numeric(df[col]).astype("int64")
        for col in self.floats:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
        for col in self.bools:
            df[col] = _flag(df[col]).astype(bool)
        for col in self.key:
            if col in self.text:
                df[col] = df[col].astype(str)
        return df[self.columns + [c for c in df.columns if c not in self.columns]]

    def load(self, p=None, every=False) -> pd.DataFrame:
        """The table (empty, with its columns, where nothing is recorded yet): the rows of its
        view (results.csv: forward passes), or with every=True all of them."""
        p = Path(p) if p is not None else self.path()
        if not p.exists() or p.stat().st_size == 0:
            return self.normalise(pd.DataFrame(columns=self.columns))
        df = self.normalise(pd.read_csv(p, dtype={c: str for c in self.text}))
        if self.view is not None and not every:
            col, value = self.view
            df = df[df[col] == value].reset_index(drop=True)
        return df

    @contextmanager
    def locked(self, p=None):
        """Hold the table's lock; yields its path."""
        p = Path(p) if p is not None else self.path()
        p.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(p) + ".lock", timeout=120):
            yield p

    def upsert(self, rows, p=None, replace=None) -> pd.DataFrame:
        """Insert rows, replacing any with the same key; returns the whole new table.

        replace: {column: value or list of values}; old rows matching all of them are dropped
        first, for a writer that re-records a whole slice (rows it no longer produces must not
        linger)."""
        new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        with self.locked(p) as p:
            old = self.load(p, every=True)
            if new.empty and not replace:
                return old
            if replace and len(old):
                hit = pd.Series(True, index=old.index)
                for col, val in replace.items():
                    vals = val if isinstance(val, (list, tuple, set)) else [val]
                    hit &= old[col].astype(str).isin([str(v) for v in vals])
                old = old[~hit]
            parts = [df for df in (old, self.normalise(new) if len(new) else None)
                     if df is not None and len(df)]
            table = pd.concat(parts, ignore_index=True) if parts else old
            table = table.drop_duplicates(self.key, keep="last", ignore_index=True)
            if self.derive is not None:
                table = self.derive(table)
            if self.sort:
                table = table.sort_values(self.sort, kind="stable", ignore_index=True)
            _atomic_write(table, p)
            return table


def _atomic_write(df: pd.DataFrame, p: Path):
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            df.to_csv(f, index=False, float_format="%.6g")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the tables are meant to be shared
        os.replace(tmp, p)  # atomic: readers see the old table or the new one, never half of one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --- the tables ----------------------------------------------------------------------------------

def _with_percentages(df: pd.DataFrame) -> pd.DataFrame:
    """pct_sdpa_flash and pct_sdpa_best: a row's TFLOP/s against SDPA's at the same key."""
    cfg = [k for k in RESULTS.key if k != "stage"]
    good = ok(df)
    sdpa = good[good["stage"].str.startswith("sdpa_")]
    flash = sdpa[sdpa["stage"] == "sdpa_flash"].set_index(cfg)["tflops"]
    best = sdpa.groupby(cfg)["tflops"].max()
    idx = pd.MultiIndex.from_frame(df[cfg])
    rate = pd.to_numeric(df["tflops"], errors="coerce").to_numpy(dtype=float)
    for col, ref in (("pct_sdpa_flash", flash), ("pct_sdpa_best", best)):
        ref = pd.to_numeric(ref.reindex(idx), errors="coerce").to_numpy(dtype=float)
        df[col] = 100 * rate / ref
    return df


# pass: "forward", "forward_lse" (the forward returning the log-sum-exp too) or "backward"
# (configs.PASSES), what the row times; gpus: how many GPUs one call ran on (1, or a ring's
# ranks). Rows recorded before these columns were forward, on one GPU. RESULTS.load() gives the
# forward rows (every view built before the backward reads those); load(every=True), all, and
# pass_rows() one stage's rows of another pass.
_CONTRACT = ["stage", "dtype", "B", "H", "N", "D", "causal", "median_ms", "tflops", "rel_err", "gpu",
             "pass", "gpus"]
RESULTS = Table(
    "results.csv", key=["stage", "pass", "dtype", "B", "H", "N", "D", "causal", "gpu", "gpus"],
    columns=_CONTRACT + [
        "kind",                # "stage" or "baseline"
        "status",              # "ok", "failed check", "error", "unsupported"
        "p20_ms", "p80_ms", "tflops_p20", "tflops_p80",
        "pct_sdpa_flash",      # 100 * tflops / sdpa_flash's at the same key (same dtype)
        "pct_sdpa_best",       # 100 * tflops / the fastest SDPA backend at the same key
        "runs", "timer",
        "warmup_runs",         # calls before timing began (flashlab.bench.time_fn)
        "retimes",             # timings discarded because they disagreed (see bench.time_fn)
        "registers", "smem_static_bytes", "spill_bytes",   # ptxas: the kernel that runs there
        *SOFTWARE, "note"],
    ints=["B", "H", "N", "D", "gpus"], bools=["causal"], contract=_CONTRACT,
    defaults={"pass": "forward", "gpus": 1}, view=("pass", "forward"),
    floats=["median_ms", "tflops", "rel_err", "p20_ms", "p80_ms", "tflops_p20", "tflops_p80",
            "pct_sdpa_flash", "pct_sdpa_best", "runs", "warmup_runs", "retimes", "registers",
            "smem_static_bytes", "spill_bytes"],
    sort=["gpu", "gpus", "pass", "dtype", "D", "causal", "N", "B", "H", "stage"],
    derive=_with_percentages)
CHECKS = Table(
    "checks.csv", key=["stage", "dtype", "B", "H", "N", "D", "causal", "layout", "gpu"],
    columns=["stage", "B", "H", "N", "D", "causal", "dtype", "rel_err", "tol", "passed", "gpu",
             *SOFTWARE, "layout"],
    defaults={"layout": "contiguous"},  # rows recorded before strided layouts were checked
    ints=["B", "H", "N", "D"], floats=["rel_err", "tol"], bools=["causal", "passed"])
PEAKS = Table("peaks.csv", key=["gpu", "metric"],
              columns=["metric", "value", "unit", "gpu", *SOFTWARE], floats=["value"])
PROFILE = Table("profile.csv", key=PROFILE_KEY, columns=PROFILE_COLUMNS,
                ints=["B", "H", "N", "D"], floats=["value"], bools=["causal"])
SASS = Table("sass.csv", key=["stage", "arch", "kernel", "category"],
             columns=["stage", "arch", "kernel", "category", "count", "source_hash", "nvcc",
                      "cuobjdump", "commit"], ints=["count"])
TUNE_FIELDS = ("BC", "WARPS", "WM", "STAGES", "Q_REGS", "OPTS")  # a stage 08 candidate
TUNE08 = Table(
    "tune08.csv", key=["gpu", "D", "causal", "variant", *TUNE_FIELDS, "N"],
    columns=[*TUNE_FIELDS, "D", "causal", "N", "B", "H", "variant", "tflops", "check_passed",
             "gpu", *SOFTWARE, "score", "chosen"],
    ints=[*TUNE_FIELDS, "D", "N", "B", "H"], floats=["tflops", "score"],
    bools=["causal", "check_passed", "chosen"])
# Stage 01 beside the published flash-attention-minimal kernel and variants of it, timed in one
# process by tools/compare_minimal.py (the published code is never part of this repository).
MINIMAL = Table(
    "minimal.csv", key=["gpu", "variant", "B", "H", "N", "D"],
    columns=["order", "variant", "description", "B", "H", "N", "D", "dtype", "median_ms", "p20_ms",
             "p80_ms", "tflops", "rel_err", "runs", "retimes", "published_source", "gpu",
             *SOFTWARE, "note"],
    ints=["order", "B", "H", "N", "D"],
    floats=["median_ms", "p20_ms", "p80_ms", "tflops", "rel_err", "runs", "retimes"])
# A GPT-2 built from its config with each attention (flashlab.model.measure): its logits against
# SDPA's and the forward pass's time, per dtype. impl: "sdpa", "eager" or a stage's slug.
# model "gpt2-attention": one attention call alone at the model's shape, in the model's layout
# ("bnhd": views of one (B, N, 3, H, D) projection) or contiguous; forward_ms is that call's time.
MODEL = Table(
    "model.csv", key=["gpu", "model", "impl", "dtype", "batch", "seq", "layout"],
    columns=["model", "impl", "kind", "layout", "dtype", "batch", "seq", "n_layer", "n_head",
             "head_dim",
             "max_abs_diff", "max_abs_logit", "forward_ms", "p20_ms", "p80_ms", "host_ms",
             "tokens_per_s", "tflops", "input_copies", "attention_gpu_ms", "matmul_gpu_ms", "other_gpu_ms", "busy_gpu_ms",
             "attention_kernels", "runs", "retimes", "gpu", *SOFTWARE, "note"],
    ints=["batch", "seq", "n_layer", "n_head", "head_dim"],
    floats=["max_abs_diff", "max_abs_logit", "forward_ms", "p20_ms", "p80_ms", "host_ms",
            "tokens_per_s", "tflops", "input_copies", "attention_gpu_ms", "matmul_gpu_ms", "other_gpu_ms", "busy_gpu_ms",
            "runs", "retimes"],
    defaults={"layout": "model"})
# A GPT-2 trained through an attention (flashlab.model.training_comparison): a row per
# implementation, run and step, the losses in the order the steps ran, beside the step's time.
TRAINING = Table(
    "training.csv", key=["gpu", "impl", "run", "step", "dtype", "batch", "seq", "n_layer",
                         "n_embd", "seed"],
    columns=["impl", "run", "step", "loss", "step_ms", "tokens_per_s", "dtype", "steps", "batch",
             "seq", "n_layer", "n_head", "n_embd", "lr", "seed", "gpu", *SOFTWARE],
    ints=["run", "step", "steps", "batch", "seq", "n_layer", "n_head", "n_embd", "seed"],
    floats=["loss", "step_ms", "tokens_per_s", "lr"])
# A stage's variants (flashlab.variants), timed in turn with their stage config by config in one
# run: variant is its slug ("12_tma_store+ping_pong"), ratio its TFLOP/s over the stage's.
VARIANTS = Table(
    "variants.csv", key=["gpu", "variant", "dtype", "B", "H", "N", "D", "causal"],
    columns=["variant", "stage", "dtype", "B", "H", "N", "D", "causal", "median_ms", "tflops",
             "stage_ms", "stage_tflops", "ratio", "check_passed", "max_rel_err", "gpu", *SOFTWARE],
    ints=["B", "H", "N", "D"],
    floats=["median_ms", "tflops", "stage_ms", "stage_tflops", "ratio", "max_rel_err"],
    bools=["causal", "check_passed"])
# Ring attention across `gpus` GPUs of one machine (flashlab.ring.measure, tools/ring_bench.py,
# launched by torchrun): a row per implementation, pass ("forward", or "training": forward and
# backward) and config. ms: the slowest rank's time of one call, the median over calls;
# efficiency: one GPU's time over gpus times this (where one GPU was timed); comm_ms and
# comm_bytes: the ring's communication alone, its time and the bytes a rank sent (the ring only;
# comm_bytes recorded since the last hop home of dK, dV went in the inputs' dtype); hidden: the
# share of the ring's communication that its compute covered (the ring only).
RING = Table(
    "ring.csv", key=["gpu", "gpus", "impl", "pass", "dtype", "B", "H", "N", "D", "causal"],
    columns=["impl", "pass", "gpus", "dtype", "B", "H", "N", "D", "causal", "median_ms", "tflops",
             "single_ms", "efficiency", "compute_ms", "comm_ms", "comm_bytes", "hidden", "runs",
             "gpu", *SOFTWARE],
    ints=["gpus", "B", "H", "N", "D", "runs"],
    floats=["median_ms", "tflops", "single_ms", "efficiency", "compute_ms", "comm_ms", "comm_bytes",
            "hidden"],
    bools=["causal"])
ALL = (RESULTS, CHECKS, PEAKS, PROFILE, SASS, TUNE08, MINIMAL, MODEL, VARIANTS, RING)

results = RESULTS  # `fl.results.load()`: the shared results table


def minimal_rows(gpu=None) -> pd.DataFrame:
    """The published flash-attention-minimal kernel, its variants and stage 01, as recorded on
    `gpu` (default: the GPU shown), in the order they were timed; empty if none."""
    df = MINIMAL.load()
    gpu = gpu or gpu_shown(df=RESULTS.load())
    return df[df["gpu"] == gpu].sort_values("order").reset_index(drop=True)


def model_rows(gpu=None, model="gpt2") -> pd.DataFrame:
    """The model measurements recorded on `gpu` (default: the GPU shown), SDPA first, then
    eager, then the stages in order; NotRecorded if there are none. model "gpt2-attention": the
    attention calls alone at the model's shape, in each layout."""
    df = MODEL.load()
    gpu = gpu or gpu_shown(df=RESULTS.load())
    df = df[(df["gpu"] == gpu) & (df["model"] == model)]
    if df.empty:
        raise NotRecorded(f"no model measurements on {gpu}: run `flashlab model` on a GPU "
                          "(or the capstone notebook live)")
    order = {"sdpa": 0, "eager": 1}
    df = df.assign(_o=df["impl"].map(lambda i: order.get(i, 2)))
    return df.sort_values(["dtype", "_o", "impl", "layout"]).drop(columns="_o").reset_index(drop=True)


def profile_raw_path(slug, cfg, gpu) -> Path:
    """Where ncu's raw CSV for one profiled launch is kept (data/profiles/<gpu>/...)."""
    label = f"{slug}_{cfg.dtype}_B{cfg.B}_H{cfg.H}_N{cfg.N}_D{cfg.D}" + ("_causal" if cfg.causal else "")
    return paths.data_dir() / "profiles" / re.sub(r"\W+", "-", gpu) / f"{label}.csv"


def profile_source_path(slug, cfg, gpu) -> Path:
    """Where ncu's per-instruction source view of one launch is kept, beside its raw metrics."""
    raw = profile_raw_path(slug, cfg, gpu)
    return raw.with_name(raw.stem + "_source.csv")


# --- which rows ------------------------------------------------------------------------------------

def ok(df: pd.DataFrame) -> pd.DataFrame:
    """The rows that ran (status ok; tables without a status column pass whole)."""
    if "status" not in df:
        return df
    return df[df["status"].fillna("ok") == "ok"]


def without_ptxas(df: pd.DataFrame) -> pd.DataFrame:
    """The stage rows that ran but carry no ptxas report (registers empty): the run could not
    tell which kernel ran there, and its log says `no ptxas report`."""
    df = ok(df)
    return df[(df["kind"] == "stage") & df["registers"].isna()]


def since(df: pd.DataFrame, time: str) -> pd.DataFrame:
    """The rows recorded at or after `time`, a UTC stamp as env.now() writes it
    (2026-11-27T14:41:20Z): a run's own rows, from the time it started."""
    return df[df["time"].astype(str) >= time]


def at_config(df: pd.DataFrame, cfg: Config, pass_="forward") -> pd.DataFrame:
    """The rows of df measured at config cfg, of one pass where df says (results.csv does)."""
    hit = ((df["B"] == cfg.B) & (df["H"] == cfg.H) & (df["N"] == cfg.N) & (df["D"] == cfg.D)
           & (df["causal"].astype(bool) == cfg.causal) & (df["dtype"] == cfg.dtype))
    if "pass" in df:
        hit &= df["pass"] == pass_
    return df[hit]


def on_gpu(df: pd.DataFrame, gpu) -> pd.DataFrame:
    return df[df["gpu"] == gpu]


def live(stage=None) -> bool:
    """Whether a view runs live here: a GPU is present and, for one stage's view, this GPU and
    toolkit can build and run that stage (its registry entry says what it needs)."""
    if stage is None:
        return gpu_available()
    return _stage(stage).unavailable() is None


def gpu_shown(stage=None, df=None):
    """The one GPU whose numbers a view shows — every notebook, figure and table asks here:

    1. this GPU, when the view runs live (see live());
    2. else the GPU named by the environment variable FLASHLAB_GPU, when set;
    3. else the GPU that recorded most recently (for one stage's view: that recorded the stage;
       for a view of them all: that recorded the last stage timed over the sweep, so that a
       stage measured alone on another GPU does not move the whole ladder there). Where the
       stage has rows over the sweep, only those count: a stage timed at a config or two on
       another GPU (what asking it for the log-sum-exp costs, say) leaves its views where its
       sweep is.

    None while nothing is recorded. df: the results rows to choose from (default: results.csv)."""
    if live(stage):
        return environment()["gpu"]
    if os.environ.get("FLASHLAB_GPU"):
        return os.environ["FLASHLAB_GPU"]
    rows = ok(RESULTS.load() if df is None else df)
    key = getattr(stage, "slug", stage) if stage is not None else _fastest().slug
    mine = rows[rows["stage"] == key]
    rows = mine if len(mine) else rows
    swept = rows[is_sweep(rows)]
    rows = swept if len(swept) else rows
    return rows.sort_values("time")["gpu"].iloc[-1] if len(rows) else None


def recorded(name=None, gpu=None, table=RESULTS) -> pd.DataFrame:
    """Recorded rows of `table` (default results.csv): all, or one stage's / baseline's, and of
    one GPU if given."""
    df = table.load()
    if name is not None:
        df = df[df["stage"] == getattr(name, "slug", name)]
    if gpu is not None:
        df = on_gpu(df, gpu)
    return df.reset_index(drop=True)


def pass_rows(names, gpu, passes=("backward",), df=None) -> pd.DataFrame:
    """The rows of stages or baselines `names` recorded on `gpu` for `passes` ("backward",
    "forward_lse", "forward"), that ran (status ok)."""
    df = RESULTS.load(every=True) if df is None else df
    df = ok(on_gpu(df, gpu))
    return df[df["stage"].isin(list(names)) & df["pass"].isin(list(passes))].reset_index(drop=True)


def timed_with(rows, slug, pass_="backward") -> pd.DataFrame:
    """The rows of `rows` (one config's) timed in the same run as `slug`'s latest `pass_` row
    there: those sharing its time stamp, which one run gives every row it records. Only these
    may be set beside it; empty where `slug` has no such row."""
    mine = rows[(rows["stage"] == slug) & (rows["pass"] == pass_)]
    return rows[rows["time"] == mine["time"].max()] if len(mine) else rows.iloc[:0]


def backward_at_teaching(df=None, dtype="fp16", baseline="sdpa_cudnn") -> pd.DataFrame:
    """Each stage with a backward pass at the teaching config in `dtype`, on the GPU that
    recorded its backward there: the backward's ms and TFLOP/s, and `baseline`'s backward timed
    in turn with it (NaN where a later run has replaced that row). Columns stage, gpu, causal,
    ms, tflops, baseline_ms, speedup (the baseline's time over the stage's); one row per stage
    and mask. Empty while no backward is recorded."""
    from dataclasses import replace
    df = ok(RESULTS.load(every=True) if df is None else df)
    out = []
    for st in [s for s in _stages() if s.has_backward]:
        for causal in (False, True):
            here = at_config(df, replace(teaching(dtype), causal=causal), pass_="backward")
            mine = here[here["stage"] == st.slug]
            if mine.empty:
                continue
            mine = mine.sort_values("time").iloc[-1]
            ran = timed_with(on_gpu(here, mine["gpu"]), st.slug)
            theirs = ran[ran["stage"] == baseline]
            base = float(theirs["median_ms"].iloc[-1]) if len(theirs) else float("nan")
            out.append(dict(stage=st.slug, gpu=mine["gpu"], causal=causal, ms=mine["median_ms"],
                            tflops=mine["tflops"], baseline_ms=base,
                            speedup=base / mine["median_ms"]))
    return pd.DataFrame(out, columns=["stage", "gpu", "causal", "ms", "tflops", "baseline_ms",
                                      "speedup"])


def recorded_checks(name=None, gpu=None) -> pd.DataFrame:
    """The recorded correctness cases (all, or one stage's, of one GPU if given)."""
    return recorded(name, gpu, CHECKS)


def teaching_rows(df, gpu) -> pd.DataFrame:
    """Every row of `gpu` at the teaching config, in each dtype (whatever its status)."""
    df = on_gpu(df, gpu)
    return pd.concat([at_config(df, teaching(d)) for d in NAMES])


def stage_at_teaching(df, st) -> pd.DataFrame:
    """A stage's rows at the teaching config, in the first of its dtypes that has any (stages
    01-03 are fp32 only, the tensor-core stages fp16 and bf16)."""
    mine = df[df["stage"] == st.slug]
    for d in st.dtypes:
        here = at_config(mine, teaching(d))
        if len(here):
            return here
    return mine.iloc[:0]


def is_sweep(df) -> pd.Series:
    """Which rows belong to the FlashAttention sweep (B·N = 16k tokens, H·D = 2048)."""
    return (df["B"] * df["N"] == SWEEP.tokens) & (df["H"] * df["D"] == SWEEP.width)


def sweep_rows(df, gpu, dtype="fp16", pass_="forward") -> pd.DataFrame:
    """The sweep's rows of `gpu` in `dtype` that ran, of one pass, on one GPU each."""
    df = ok(on_gpu(df, gpu))
    hit = (df["dtype"] == dtype) & is_sweep(df)
    if "pass" in df:
        hit &= (df["pass"] == pass_) & (df["gpus"] == 1)
    return df[hit]


def sweep_gpu(df=None, pass_="backward"):
    """The GPU that last recorded rows of `pass_` over the sweep (None: none has)."""
    df = RESULTS.load(every=True) if df is None else df
    rows = ok(df)
    rows = rows[is_sweep(rows) & (rows["pass"] == pass_)]
    return rows.sort_values("time")["gpu"].iloc[-1] if len(rows) else None


def lse_cost(slugs, df=None) -> pd.DataFrame:
    """What asking a forward for the log-sum-exp costs: for each of `slugs`, its rows of pass
    "forward_lse" that ran, on the GPU that recorded such rows last, each beside the "forward"
    row timed in turn with it (the same run: the same time stamp; NaN where a later run has
    replaced it). Columns stage, dtype, B, H, N, D, causal, forward_ms, forward_lse_ms, cost
    (forward_lse_ms / forward_ms - 1), gpu, commit; empty while none is recorded."""
    df = RESULTS.load(every=True) if df is None else df
    cols = ["stage", "dtype", "B", "H", "N", "D", "causal", "forward_ms", "forward_lse_ms", "cost",
            "gpu", "commit"]
    rows = ok(df[df["stage"].isin(list(slugs))])
    lse = rows[rows["pass"] == "forward_lse"]
    if lse.empty:
        return pd.DataFrame(columns=cols)
    gpu = lse.sort_values("time")["gpu"].iloc[-1]
    keys = ["stage", "dtype", "B", "H", "N", "D", "causal", "gpu", "time"]
    fwd = rows[rows["pass"] == "forward"][keys + ["median_ms"]]
    both = lse[lse["gpu"] == gpu].merge(fwd, on=keys, how="left", suffixes=("_lse", ""))
    both = both.rename(columns={"median_ms": "forward_ms", "median_ms_lse": "forward_lse_ms"})
    both["cost"] = both["forward_lse_ms"] / both["forward_ms"] - 1
    return both[cols].sort_values(["stage", "dtype", "D", "causal", "N"], ignore_index=True)


# SDPA's fused kernels a model is trained through beside the stages: their curves, run against
# each other, are the spread a stage's curve is judged within (the math backend, which writes the
# whole score matrix in the inputs' dtype, is no kernel a model trains on)
SDPA_TRAINED = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
# The comparison's negative control: SDPA's output, a backward that leaves Δ out of dS (dS = P∘dP),
# the classic slip of a first backward (flashlab.model.control): a verdict that calls it within
# SDPA's spread could not fail.
CONTROL = "wrong_no_delta"
# What makes one loss comparison (every seed of it, every implementation): its rows alone are judged
_TRAIN_CONFIG = ["dtype", "steps", "batch", "seq", "n_layer", "n_head", "n_embd", "lr"]


def smoothed_loss(losses, window=20) -> pd.Series:
    """A loss curve averaged over `window` steps (a trailing mean, over fewer steps at the start):
    what two training runs are compared on."""
    return pd.Series(list(losses), dtype=float).rolling(window, min_periods=1).mean()


def ring_rows(rows=None, gpu=None, impl="ring") -> pd.DataFrame:
    """The recorded ring runs (data/ring.csv) of one GPU model (default: the last that recorded),
    of the implementations whose name starts with `impl` ("ring", "context_parallel", "" for
    all). Empty while none is recorded."""
    rows = RING.load() if rows is None else rows
    if rows.empty:
        return rows
    gpu = gpu or rows.sort_values("time")["gpu"].iloc[-1]
    rows = rows[(rows["gpu"] == gpu) & rows["impl"].str.startswith(impl)]
    return rows.reset_index(drop=True)


def last_ring_run(rows=None, gpu=None) -> pd.DataFrame:
    """The rows of the last recorded ring run (its time stamp) of one GPU model: one local
    attention ("ring:NN_slug"), every length, pass and mask it timed. Empty while none is
    recorded."""
    rows = ring_rows(rows, gpu)
    if rows.empty:
        return rows
    return rows[rows["time"] == rows["time"].max()].reset_index(drop=True)


def ring_versus(rows=None, gpu=None) -> pd.DataFrame:
    """Each recorded ring run beside the baselines timed in the same run (rows sharing its time
    stamp): a row per ring, pass, GPUs, dtype, length and mask, with the ring's time, each
    context_parallel backend's, `vs_<backend>` (the backend's time over the ring's: above 1, the
    ring is faster), and the ring's efficiency against one GPU and the share of its communication
    hidden. Runs without baselines are left out. Empty while none is recorded."""
    rows = ring_rows(rows, gpu, impl="")
    if rows.empty:
        return rows
    key = ["time", "pass", "gpus", "dtype", "N", "D", "causal"]
    rings = rows[rows["impl"].str.startswith("ring:")]
    base = rows[rows["impl"].str.startswith("context_parallel:")]
    out = rings[key + ["impl", "median_ms", "efficiency", "hidden", "commit"]].rename(
        columns={"median_ms": "ring_ms"})
    for impl, grp in base.groupby("impl"):
        name = impl.split(":", 1)[1]
        out = out.merge(grp[key + ["median_ms"]].rename(columns={"median_ms": f"{name}_ms"}),
                        on=key, how="inner")
        out[f"vs_{name}"] = out[f"{name}_ms"] / out["ring_ms"]
    out = out.rename(columns={"impl": "ring"})
    out["ring"] = out["ring"].str.split(":", n=1).str[1]
    return out.sort_values(["time", "causal", "N", "pass"]).reset_index(drop=True)


def training_rows(rows=None, gpu=None) -> pd.DataFrame:
    """The recorded training (data/training.csv) of one GPU (default: the last that recorded) and
    one model and run length, every seed: the one with the most steps, the loss comparison
    (shorter runs at other sizes time a step). Empty while none is recorded."""
    rows = TRAINING.load() if rows is None else rows
    if rows.empty:
        return rows
    gpu = gpu or rows.sort_values("time")["gpu"].iloc[-1]
    rows = rows[rows["gpu"] == gpu]
    longest = rows.sort_values(["steps", "time"]).iloc[-1]
    return rows[(rows[_TRAIN_CONFIG] == longest[_TRAIN_CONFIG]).all(axis=1)]


def training_curves(rows, window=20) -> dict:
    """{(impl, seed, run): (steps, loss smoothed over `window` steps)} of training rows (one
    comparison's: training_rows), as numpy arrays, in the order recorded."""
    out = {}
    for key, r in rows.groupby(["impl", "seed", "run"], sort=False):
        r = r.sort_values("step")
        out[key] = (r["step"].to_numpy(), smoothed_loss(r["loss"], window).to_numpy())
    return out


# training_gaps' row of SDPA's own pairs
SELF = "SDPA against itself"


def training_gaps(rows=None, gpu=None, window=20) -> pd.DataFrame:
    """Each implementation's gap to SDPA at each seed (training_rows): the largest difference
    between its smoothed curve and one of SDPA's curves from the same seed (every backend of
    SDPA_TRAINED, every run; a curve is not set against itself), the mean over such pairs; and
    `shift`, its curve's mean over the steps minus SDPA's (the mean of SDPA's curves). SDPA's
    pairs give rows of impl "SDPA against itself" (gap: the largest of them; shift 0).
    Columns impl, seed, gap, shift; in the order recorded."""
    rows = training_rows(rows, gpu)
    cols = ["impl", "seed", "gap", "shift"]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    curves = {key: loss for key, (_, loss) in training_curves(rows, window).items()}
    out = []
    for seed in dict.fromkeys(k[1] for k in curves):
        here = [k for k in curves if k[1] == seed]
        sdpa = [k for k in here if k[0] in SDPA_TRAINED]
        if not sdpa:
            continue
        mean = np.mean([curves[k] for k in sdpa], axis=0)

        def apart(a, b):
            return float(abs(curves[a] - curves[b]).max())

        own = [apart(a, b) for i, a in enumerate(sdpa) for b in sdpa[i + 1:]]
        if own:
            out.append(dict(impl=SELF, seed=seed, gap=max(own), shift=0.0))
        for impl in dict.fromkeys(k[0] for k in here):
            mine = [k for k in here if k[0] == impl]
            gaps = [apart(a, b) for a in mine for b in sdpa if b != a]
            if gaps:
                out.append(dict(impl=impl, seed=seed, gap=float(np.mean(gaps)),
                                shift=float(np.mean([curves[k] - mean for k in mine]))))
    return pd.DataFrame(out, columns=cols)



def training_match(rows=None, gpu=None, window=20) -> pd.DataFrame:
    """How far each implementation's loss curves lie from SDPA's, over every seed of the
    comparison (training_gaps): distance, the median over seeds of its gap to SDPA's curves of
    the same seed; noise, the largest gap between two of SDPA's own curves of one seed, over every
    seed (SDPA's backends round differently, and training amplifies it); within: distance <=
    noise, a verdict a few large gaps of single batches do not move. shift: the mean over seeds
    of its curve minus SDPA's (a bias, where it is of one sign seed after seed; shift_max the
    largest of them in size). per_seed: the stricter reading, seed by seed: its gap at a seed over
    SDPA's own largest gap at that seed, the median over seeds (at most 1: as near SDPA's curves as
    they lie to one another, seed for seed). Beside them its seeds, runs, mean final loss and
    median step time. One row per implementation, in the order recorded; empty while none is
    recorded."""
    rows = training_rows(rows, gpu)
    cols = ["impl", "seeds", "runs", "distance", "noise", "within", "per_seed", "shift",
            "shift_max", "final_loss", "step_ms"]
    gaps = training_gaps(rows, window=window)
    if gaps.empty:
        return pd.DataFrame(columns=cols)
    own = gaps[gaps["impl"] == SELF]
    noise = float(own["gap"].max()) if len(own) else float("nan")
    own_at = dict(zip(own["seed"], own["gap"]))
    out = []
    for impl, g in gaps[gaps["impl"] != SELF].groupby("impl", sort=False):
        r = rows[rows["impl"] == impl]
        dist = float(g["gap"].median())
        last = r.sort_values("step").groupby(["seed", "run"])["loss"].last()
        ratios = [gap / own_at[seed] for seed, gap in zip(g["seed"], g["gap"])
                  if own_at.get(seed, 0) > 0]
        out.append(dict(impl=impl, seeds=len(g), runs=len(last), distance=dist, noise=noise,
                        within=bool(dist <= noise),
                        per_seed=float(np.median(ratios)) if ratios else float("nan"),
                        shift=float(g["shift"].mean()),
                        shift_max=float(g["shift"].abs().max()), final_loss=float(last.mean()),
                        step_ms=float(r.groupby(["seed", "run"])["step_ms"].first().median())))
    return pd.DataFrame(out, columns=cols)


def training_step_times(rows=None, gpu=None) -> pd.DataFrame:
    """A training step's median time (ms) by implementation (rows) and model size (columns, 'seq
    S, d E, L layers'), from data/training.csv on one GPU (default: the last that recorded), the
    median over seeds and runs."""
    rows = TRAINING.load() if rows is None else rows
    if rows.empty:
        return pd.DataFrame()
    gpu = gpu or rows.sort_values("time")["gpu"].iloc[-1]
    rows = rows[rows["gpu"] == gpu].copy()
    rows["size"] = [f"seq {r.seq}, d {r.n_embd}, {r.n_layer} layers, batch {r.batch}"
                    for r in rows.itertuples()]
    first = rows.drop_duplicates(["impl", "seed", "run", "size"])
    table = first.groupby(["impl", "size"], sort=False)["step_ms"].median().unstack("size")
    return table.reindex(list(dict.fromkeys(first["impl"])))


def sweep_at(N, D, causal, dtype="fp16", gpu=None, df=None) -> pd.Series:
    """TFLOP/s of every stage and baseline recorded at one point of the sweep, by name."""
    df = RESULTS.load() if df is None else df
    gpu = gpu or gpu_shown(df=df)
    rows = sweep_rows(df, gpu, dtype)
    rows = rows[(rows["N"] == N) & (rows["D"] == D) & (rows["causal"] == bool(causal))]
    return rows.set_index("stage")["tflops"]


def versus(df=None, stage=None, others=COMPARED, gpu=None,
           dtype="fp16", pass_="forward") -> pd.DataFrame:
    """`stage` (default: the last) against `others` over the sweep: TFLOP/s of each and the
    stage's ratio to each ("÷ other"), rows (D, causal, N); others not recorded are left out.
    pass_: "forward" or "backward". NotRecorded if the stage has no sweep rows on the GPU shown."""
    df = RESULTS.load(every=pass_ != "forward") if df is None else df
    stage = getattr(stage, "slug", stage) or _fastest().slug
    gpu = gpu or gpu_shown(df=df)
    wide = sweep_rows(df, gpu, dtype, pass_).pivot_table(index=["D", "causal", "N"], columns="stage",
                                                  values="tflops")
    if stage not in wide:
        what = "" if pass_ == "forward" else f" ({pass_})"
        raise not_recorded(stage, f" over the {dtype} FlashAttention sweep{what}", gpu=gpu)
    out = wide[[stage, *[o for o in others if o in wide]]].copy()
    for o in others:
        if o in wide:
            out[f"÷ {o}"] = wide[stage] / wide[o]
    return out


def sweep_ratio(new, old, dtype="fp16", df=None, gpu=None, pass_="forward") -> pd.DataFrame:
    """new's TFLOP/s over old's at every point of the sweep (of `pass_`): rows (D, causal),
    columns N."""
    vs = versus(df, new, (old,), gpu, dtype, pass_)
    if f"÷ {old}" not in vs:
        raise not_recorded(old, f" over the {dtype} FlashAttention sweep", gpu=gpu)
    return vs[f"÷ {old}"].unstack("N")


def sweep_runs(stages, dtype="fp16", df=None, gpu=None, pass_="forward") -> dict:
    """{stage: the time stamps of its recorded sweep rows (of `pass_`, in `dtype`, on `gpu`)}:
    a run's rows share one, so two stages with the same single stamp were timed in turn in one
    run, and two with different ones were not (a later run re-recorded one of them)."""
    df = RESULTS.load(every=pass_ != "forward") if df is None else df
    rows = sweep_rows(df, gpu or gpu_shown(df=df), dtype, pass_)
    slugs = [getattr(s, "slug", s) for s in stages]
    return {s: sorted(set(rows.loc[rows["stage"] == s, "time"])) for s in slugs}


def peak_rows(gpu=None) -> pd.DataFrame:
    """The measured ceilings of `gpu` (default: the GPU shown): metric, value, unit and the
    software they were measured with. Empty where that GPU has none: never another GPU's."""
    gpu = gpu or gpu_shown()
    return on_gpu(PEAKS.load(), gpu).reset_index(drop=True)


def peaks(gpu=None) -> dict:
    """{metric: value} of peak_rows(gpu); {} if none recorded."""
    rows = peak_rows(gpu)
    return dict(zip(rows["metric"], rows["value"]))


def profile_rows(gpu=None, df=None):
    """The Nsight Compute rows of `gpu` (default: the GPU shown), or None if it has none.
    df: profile rows to use instead of profile.csv (a synthetic table, say)."""
    gpu = gpu or gpu_shown()
    prof = PROFILE.load() if df is None else PROFILE.normalise(df)
    prof = on_gpu(prof, gpu)
    return prof if len(prof) else None


def variant_rows(stage, gpu=None) -> pd.DataFrame:
    """The recorded timings of `stage`'s variants on `gpu` (default: the GPU shown), or
    NotRecorded."""
    st = _stage(stage)
    df = VARIANTS.load()
    gpu = gpu or gpu_shown(st, df=RESULTS.load())
    df = df[(df["stage"] == st.slug) & (df["gpu"] == gpu)] if len(df) else df
    if not len(df):
        raise NotRecorded(f"{st.slug}'s variants: not recorded on {gpu} yet ({VARIANTS.name}; "
                          f"its notebook records them when it runs live on that GPU)")
    return df.reset_index(drop=True)


def variant_gpu(stage) -> str:
    """The GPU whose rows of `stage`'s variants a notebook shows: the GPU shown, where they are
    recorded on it; else the GPU they were last recorded on (a variant is compared only with its
    stage timed in turn with it, so its ratios stand on their own GPU); the GPU shown when none."""
    st = _stage(stage)
    shown = gpu_shown(st, df=RESULTS.load())
    df = VARIANTS.load()
    df = df[df["stage"] == st.slug] if len(df) else df
    if not len(df) or (df["gpu"] == shown).any():
        return shown
    return df.sort_values("time")["gpu"].iloc[-1]


def tune_log(gpu=None) -> pd.DataFrame:
    """Stage 08's tuning log on `gpu` (default: the GPU shown); NotRecorded if it has none."""
    gpu = gpu or gpu_shown(next(st for st in _stages() if st.picks))
    df = TUNE08.load()
    if df.empty:
        raise NotRecorded(f"stage 08's tuning log: not recorded yet ({TUNE08.name} does not "
                          "exist): run `flashlab tune` on a GPU, then `flashlab tune --apply`")
    mine = on_gpu(df, gpu)
    if mine.empty:
        raise NotRecorded(f"stage 08's tuning log: nothing recorded on {gpu}: run `flashlab tune` "
                          "there")
    return mine.reset_index(drop=True)


def _stage_or_none(name):
    """The stage `name` names, or None for a baseline."""
    try:
        return _stage(name)
    except ValueError:
        return None


def run_command(name, flags="") -> str:
    """The command that records `name`: `flashlab run --stage 05` for a stage, `flashlab run`
    for a baseline (it times them all)."""
    st = _stage_or_none(name)
    return f"flashlab run{f' --stage {st.number:02d}' if st else ''}{flags}"


def not_recorded(name, what="", flags="", gpu=None) -> NotRecorded:
    """The error for numbers not recorded yet: "05_mma: not recorded yet on <gpu>: run
    `flashlab run --stage 05`"."""
    slug = getattr(name, "slug", name)
    gpu = gpu or gpu_shown(_stage_or_none(name)) or "any GPU"
    return NotRecorded(f"{slug}{what}: not recorded yet on {gpu}: run `{run_command(name, flags)}`")


def provenance(df=None, gpu=None) -> str:
    """Where the rows of `gpu` (default: the GPU shown) come from: "NVIDIA H100 ... (compute
    capability 9.0), torch ..., CUDA ..., commit ..., <time>" (of its newest row)."""
    df = RESULTS.load() if df is None else df
    gpu = gpu or gpu_shown(df=df)
    rows = on_gpu(df, gpu).sort_values("time")
    if gpu is None or rows.empty:
        return "nothing recorded yet"
    last = rows.iloc[-1]
    return (f"{gpu} (compute capability {last.compute_capability}), torch {last.torch}, "
            f"CUDA {last.cuda}, commit {last.commit}, {last.time}")


def profile_wide(df=None, config=None) -> pd.DataFrame:
    """Profile rows at `config` (default: the fp32 teaching config) as a stages x metrics table."""
    df = PROFILE.load() if df is None else df
    df = at_config(df, config or teaching())
    return df.pivot_table(index="stage", columns="metric", values="value", aggfunc="last")


def profile_by_stage(prof) -> pd.DataFrame:
    """Each stage's profile at the teaching config in its own dtype (stage_at_teaching), as a
    stages x metrics table in stage order; empty for None."""
    if prof is None:
        return pd.DataFrame()
    rows = {}
    for st in _stages():
        here = stage_at_teaching(prof, st).sort_values("time").drop_duplicates("metric", keep="last")
        if len(here):
            rows[st.slug] = here.set_index("metric")["value"]
    return pd.DataFrame(rows).T
