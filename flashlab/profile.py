"""Nsight Compute profiles: run one stage under `ncu` in a subprocess and keep a small set of
metrics per stage in data/profile.csv (schema: flashlab.profile_schema), the raw ncu CSV beside
it in data/profiles/.

    import flashlab.profile as prof
    prof.profile(fl.stage(2), fl.TEACHING)   # needs a GPU and ncu; records by default
    fl.tables.PROFILE.load()                 # the recorded metrics (works without a GPU)

ncu runs with --clock-control none (the GPU's clocks as the timings saw them) and profiles only
the stage's kernel (its registry entry's `kernel`), skipping its first launch as a warm-up. Metric names differ between ncu versions and chips, so flashlab asks ncu
which ones this GPU offers and requests only those.
"""
import csv
import functools
import glob
import io
import os
import re
import shutil
import subprocess
import sys

import pandas as pd

from . import paths, tables
from .configs import Config, teaching
from .env import environment, gpu_available
from .profile_schema import COLUMNS, METRICS, STALL_REASONS
from .stages import stage as _stage

# flashlab metric -> the ncu metric(s) that give it; a tuple is (numerator, denominator).
NCU = {
    "duration_ms": ["gpu__time_duration.sum"],
    "dram_throughput_pct": ["dram__throughput.avg.pct_of_peak_sustained_elapsed"],
    "dram_bytes": ["dram__bytes.sum"],
    "sm_throughput_pct": ["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
    "tensor_pipe_pct": ["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"],
    "achieved_occupancy_pct": ["sm__warps_active.avg.pct_of_peak_sustained_active"],
    "global_load_sectors_per_request": [("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
                                         "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum")],
    "global_store_sectors_per_request": [("l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
                                          "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum")],
    "smem_load_bank_conflicts": ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"],
    "smem_store_bank_conflicts": ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"],
    "smem_wavefronts": ["l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"],
    "red_sectors_per_l2_request": [("lts__t_sectors_srcunit_tex_op_red.sum",
                                    "lts__t_requests_srcunit_tex_op_red.sum")],
}
for _r in STALL_REASONS:
    NCU[f"stall_{_r}"] = [f"smsp__warp_issue_stalled_{_r}_per_warp_active.pct",
                          f"smsp__average_warps_issue_stalled_{_r}_per_issue_active.ratio"]


def ncu_path():
    """The ncu binary, or None."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = ["/usr/local/cuda/bin/ncu", *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")),
                  *sorted(glob.glob("/usr/local/cuda*/nsight-compute*/ncu"))]
    return next((c for c in candidates if os.path.exists(c)), None)


def available():
    """(True, '') when profiles can be taken here, else (False, why)."""
    if not gpu_available():
        return False, "no CUDA GPU"
    if ncu_path() is None:
        return False, "Nsight Compute (ncu) is not installed"
    return True, ""


@functools.lru_cache(maxsize=None)
def offered():
    """Base names of the metrics ncu offers for this GPU ('dram__bytes', ...)."""
    out = subprocess.run([ncu_path(), "--query-metrics"], capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines()
            if line and "__" in line.split()[0]}


def _base(metric):
    name = metric.split(".")[0]
    return name


def _choose():
    """{flashlab metric: the first ncu candidate this GPU offers (or a ratio pair)}."""
    have = offered()
    chosen = {}
    if not have:  # could not read the list: ask for every first choice, drop refusals later
        return {name: options[0] for name, options in NCU.items()}
    for name, options in NCU.items():
        for opt in options:
            parts = opt if isinstance(opt, tuple) else (opt,)
            if all(_base(p) in have for p in parts):
                chosen[name] = opt
                break
    return chosen


def parse_raw_csv(text):
    """{ncu metric: (value, unit)} from `ncu --csv --page raw` output (one profiled launch)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        raise RuntimeError("ncu printed no profile (was the kernel launched?)")
    header, units, values = rows[0], rows[1], rows[-1]
    out = {}
    for h, u, v in zip(header, units, values):
        try:
            out[h] = (float(v.replace(",", "")), u)
        except ValueError:
            continue
    return out


def _values(raw, chosen):
    """flashlab metrics from the raw ncu metrics."""
    rows = []
    for name, opt in chosen.items():
        if isinstance(opt, tuple):
            (num, _), (den, _) = raw.get(opt[0], (None, "")), raw.get(opt[1], (None, ""))
            if num is None or den is None:
                continue
            value, unit, source = (num / den if den else 0.0), METRICS[name][0], "/".join(opt)
        else:
            if opt not in raw:
                continue
            value, unit, source = raw[opt][0], raw[opt][1], opt
            if name == "duration_ms":  # ncu reports ns (or us/ms, as unit says)
                value *= {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3,
                          "ms": 1.0, "msecond": 1.0}.get(unit, 1e-6)
                unit = "ms"
            elif name == "dram_bytes":
                value *= {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)
                unit = "bytes"
            elif unit in ("%", ""):
                unit = "%" if unit == "%" else unit
        rows.append((name, value, unit, source))
    return rows


def _prepare(stage, config, variant=None):
    """The stage, or its variant's entry (flashlab.variants.stage_of), built outside ncu so the
    profiled process only loads it, and the config: by default the teaching config in the
    stage's own first dtype."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"cannot profile here: {why}; the recorded metrics are in "
                           f"{tables.PROFILE.path()} (flashlab.tables.PROFILE.load())")
    st = _stage(stage)
    cfg = config or teaching(st.dtypes[0])
    if variant is None:
        st.build()
        return st, cfg
    from . import variants
    v = st.variant(variant)
    variants.build(v)
    return variants.stage_of(v), cfg


def _ncu(st, cfg, options, timeout, pass_="forward"):
    """ncu on the second launch of the stage's kernel (the first may pay for loading) at cfg,
    with `options` choosing what it collects and prints. `st` may be a variant's entry
    (flashlab.variants.stage_of): its slug names the variant, its kernel is the variant's.
    pass_="backward": its backward kernel, in the backward pass."""
    kernel = st.backward if pass_ == "backward" else st.kernel
    cmd = [ncu_path(), "--clock-control", "none", "--kernel-name", f"regex:{kernel}",
           "--launch-skip", "1", "--launch-count", "1", *options,
           sys.executable, "-m", "flashlab.profile_target", st.slug, str(cfg.B), str(cfg.H),
           str(cfg.N), str(cfg.D), str(int(cfg.causal)), cfg.dtype, pass_]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=paths.ROOT)


def backward_name(stage) -> str:
    """How the profile of a stage's backward kernel is named in data/: "14_backward.backward"."""
    return f"{_stage(stage).slug}.backward"


def profile(stage, config: Config = None, record=True, timeout=900, variant=None,
            pass_="forward") -> pd.DataFrame:
    """Profile one launch of `stage` at `config` (default: the teaching config in its own
    dtype) under ncu; returns (and records) the metrics. variant: one of the stage's variants
    (its name), profiled in the stage's place; its rows name it ("12_tma_store+ping_pong").
    pass_="backward": the stage's backward kernel, its rows named backward_name(stage)."""
    st, cfg = _prepare(stage, config, variant)
    if pass_ == "backward" and not st.has_backward:
        raise ValueError(f"{st.slug} has no backward pass to profile")
    chosen = _choose()
    for _ in range(4):  # ncu refuses the whole run over one unknown metric: drop it and retry
        metrics = sorted({p for o in chosen.values() for p in (o if isinstance(o, tuple) else (o,))})
        proc = _ncu(st, cfg, ["--metrics", ",".join(metrics), "--csv", "--page", "raw"], timeout,
                    pass_)
        refused = set(re.findall(r"Failed to find metric\s+'?([\w.]+)", proc.stdout + proc.stderr))
        if proc.returncode == 0 or not refused:
            break
        chosen = {n: o for n, o in chosen.items()
                  if not refused & set(o if isinstance(o, tuple) else (o,))}
    if proc.returncode != 0:
        raise RuntimeError(f"ncu failed on {st.slug} ({proc.returncode}):\n{proc.stderr[-3000:]}"
                           f"\n{proc.stdout[-2000:]}")
    raw = parse_raw_csv(proc.stdout)
    env = environment()
    name = backward_name(st) if pass_ == "backward" else st.slug
    rows = [dict(stage=name, dtype=cfg.dtype, B=cfg.B, H=cfg.H, N=cfg.N, D=cfg.D,
                 causal=cfg.causal, gpu=env["gpu"], metric=m, value=v, unit=u, ncu_metric=src,
                 **{k: env[k] for k in ("compute_capability", "torch", "cuda", "commit", "time")})
            for m, v, u, src in _values(raw, chosen)]
    df = pd.DataFrame(rows, columns=COLUMNS)
    if record:
        rp = tables.profile_raw_path(name, cfg, env["gpu"])
        rp.parent.mkdir(parents=True, exist_ok=True)
        rp.write_text(proc.stdout)
        tables.PROFILE.upsert(rows)
    return df


# --- ncu's source view: shared-memory wavefronts per SASS instruction ----------------------------

def profile_source(stage, config: Config = None, record=True, timeout=900) -> pd.DataFrame:
    """One launch of `stage` under ncu's SourceCounters section, page "source": the wavefronts
    each shared-memory instruction took, the fewest it could have taken, and the excess (a
    per-instruction view of what the aggregate bank-conflict counters sum). Returns
    shared_by_instruction() of it."""
    st, cfg = _prepare(stage, config)
    proc = _ncu(st, cfg, ["--section", "SourceCounters", "--page", "source", "--csv",
                          "--print-source", "sass"], timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ncu failed on {st.slug} ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if record:
        sp = tables.profile_source_path(st.slug, cfg, environment()["gpu"])
        sp.parent.mkdir(parents=True, exist_ok=True)
        sp.write_text(proc.stdout)
    return shared_by_instruction(proc.stdout)


def shared_by_instruction(text) -> pd.DataFrame:
    """From ncu's `--page source --csv --print-source sass` output: a row per SASS instruction
    that touched shared memory, with its wavefronts, the ideal count and the excess."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header = next((r for r in rows if "L1 Wavefronts Shared" in r), None)
    if header is None:
        raise ValueError("no 'L1 Wavefronts Shared' column: not ncu's source page")
    at = {h: i for i, h in enumerate(header)}

    def num(r, col):
        try:
            return float(r[at[col]].replace(",", ""))
        except (IndexError, ValueError):
            return 0.0
    out = []
    for r in rows[rows.index(header) + 1:]:
        wavefronts = num(r, "L1 Wavefronts Shared")
        if not wavefronts:
            continue
        sass = r[at["Source"]].strip()
        words = sass.split()
        opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        out.append(dict(address=r[at["Address"]], sass=sass, opcode=opcode, wavefronts=wavefronts,
                        ideal=num(r, "L1 Wavefronts Shared Ideal"),
                        excessive=num(r, "L1 Wavefronts Shared Excessive")))
    return pd.DataFrame(out, columns=["address", "sass", "opcode", "wavefronts", "ideal",
                                      "excessive"])


def shared_by_opcode(stage, config: Config = None, gpu=None) -> pd.DataFrame:
    """The recorded source view of `stage` on `gpu` (default: the GPU shown) summed per opcode
    (LDSM, STS, LDS, ...)."""
    st = _stage(stage)
    cfg = config or teaching(st.dtypes[0])
    gpu = gpu or tables.gpu_shown(st)
    p = tables.profile_source_path(st.slug, cfg, gpu)
    if not p.exists():
        raise tables.NotRecorded(f"{st.slug}: no source view at {cfg.label} recorded on {gpu}: "
                                 f"on that GPU, flashlab.profile.profile_source({st.number})")
    df = shared_by_instruction(p.read_text())
    return df.groupby("opcode")[["wavefronts", "ideal", "excessive"]].sum()
