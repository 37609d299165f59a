"""The one shared results table, data/results.csv: a tidy row per (stage or baseline, config,
dtype, causal, GPU).

Outside tools read these columns, so their names and meanings are a contract:
  stage, dtype, B, H, N, D, causal, median_ms, tflops, rel_err, gpu
The rest sit beside them (see COLUMNS). Writes upsert by KEY under a file lock and replace the file
by an atomic rename, so a killed run or two notebooks writing at once never corrupt or lose it.
"""
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
from filelock import FileLock

from . import paths

KEY = ["stage", "dtype", "B", "H", "N", "D", "causal", "gpu"]
CONTRACT = ["stage", "dtype", "B", "H", "N", "D", "causal", "median_ms", "tflops", "rel_err", "gpu"]
COLUMNS = CONTRACT + [
    "kind",                # "stage" or "baseline"
    "status",              # "ok", "failed check", "error", "unsupported"
    "p20_ms", "p80_ms", "tflops_p20", "tflops_p80",
    "pct_sdpa_flash",      # 100 * tflops / sdpa_flash's at the same key (same dtype); empty if none
    "pct_sdpa_best",       # 100 * tflops / the fastest SDPA backend at the same key
    "runs", "timer",
    "registers", "smem_static_bytes", "spill_bytes",   # from ptxas, max over the stage's kernels
    "compute_capability", "torch", "cuda", "commit", "time", "note",
]
INTS = ["B", "H", "N", "D"]
# Read as text: "12.10" must not become 12.1, nor an all-digit commit hash a number.
TEXT = {c: str for c in ("stage", "dtype", "gpu", "kind", "status", "timer", "compute_capability",
                         "torch", "cuda", "commit", "time", "note")}


def path() -> Path:
    return paths.results_csv()


def _lock(p: Path) -> FileLock:
    return FileLock(str(p) + ".lock", timeout=120)


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    for col in COLUMNS:
        if col not in df:
            df[col] = pd.NA
    for col in INTS:
        df[col] = df[col].astype("int64")
    df["causal"] = df["causal"].map(lambda x: str(x).strip().lower() in ("true", "1")).astype(bool)
    for col in ("stage", "dtype", "gpu"):
        df[col] = df[col].astype(str)
    extra = [c for c in df.columns if c not in COLUMNS]
    return df[COLUMNS + extra]


def load(p=None) -> pd.DataFrame:
    """The table (empty, with the right columns, if nothing has been recorded yet)."""
    p = Path(p) if p is not None else path()
    if not p.exists():
        return _normalise(pd.DataFrame(columns=COLUMNS))
    return _normalise(pd.read_csv(p, dtype=TEXT))


def at_config(df: pd.DataFrame, cfg) -> pd.DataFrame:
    """The rows of df measured at config cfg (a flashlab.Config)."""
    return df[(df["B"] == cfg.B) & (df["H"] == cfg.H) & (df["N"] == cfg.N) & (df["D"] == cfg.D)
              & (df["causal"].astype(bool) == cfg.causal) & (df["dtype"] == cfg.dtype)]


def _with_percentages(df: pd.DataFrame) -> pd.DataFrame:
    cfg = [k for k in KEY if k != "stage"]
    ok = df[df["status"].fillna("ok") == "ok"]
    sdpa = ok[ok["stage"].str.startswith("sdpa_")]
    flash = sdpa[sdpa["stage"] == "sdpa_flash"].set_index(cfg)["tflops"]
    best = sdpa.groupby(cfg)["tflops"].max()
    idx = pd.MultiIndex.from_frame(df[cfg])
    rate = pd.to_numeric(df["tflops"], errors="coerce").to_numpy(dtype=float)
    for col, ref in (("pct_sdpa_flash", flash), ("pct_sdpa_best", best)):
        ref = pd.to_numeric(ref.reindex(idx), errors="coerce").to_numpy(dtype=float)
        df[col] = 100 * rate / ref
    return df


def _atomic_write(df: pd.DataFrame, p: Path):
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            df.to_csv(f, index=False, float_format="%.6g")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the table is meant to be shared
        os.replace(tmp, p)  # atomic: readers see the old table or the new one, never half of one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def locked(p=None):
    """Hold the table's lock; yields its path."""
    p = Path(p) if p is not None else path()
    p.parent.mkdir(parents=True, exist_ok=True)
    with _lock(p):
        yield p


def upsert(rows, p=None) -> pd.DataFrame:
    """Insert rows, replacing any with the same KEY; returns the whole new table."""
    new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    with locked(p) as p:
        if new.empty:
            return load(p)
        table = pd.concat([load(p), _normalise(new)], ignore_index=True)
        table = table.drop_duplicates(KEY, keep="last")
        table = _with_percentages(table)
        table = table.sort_values(["gpu", "dtype", "D", "causal", "N", "B", "H", "stage"],
                                  kind="stable", ignore_index=True)
        _atomic_write(table, p)
        return table


def upsert_csv(rows, p, key, replace=None, text=()) -> pd.DataFrame:
    """The same lock-and-rename upsert for the side tables (checks, GPU peaks, SASS counts).

    replace: {column: value or list of values}; old rows matching all of them are dropped first,
    for a writer that re-records a whole slice (rows it no longer produces must not linger).
    text: further columns to read back as text (hashes that may look like numbers)."""
    new = pd.DataFrame(list(rows))
    with locked(p) as p:
        dtype = {**TEXT, **{c: str for c in text}}
        old = pd.read_csv(p, dtype=dtype) if p.exists() else pd.DataFrame(columns=new.columns)
        if replace and len(old):
            hit = pd.Series(True, index=old.index)
            for col, val in replace.items():
                vals = val if isinstance(val, (list, tuple, set)) else [val]
                hit &= old[col].astype(str).isin([str(v) for v in vals])
            old = old[~hit]
        table = pd.concat([old, new], ignore_index=True)
        table = table.drop_duplicates(key, keep="last", ignore_index=True)
        _atomic_write(table, p)
        return table
