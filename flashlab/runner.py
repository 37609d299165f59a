"""`flashlab run`: build, check and time every stage and the baselines, record, plot, print.
Without a GPU it replays what data/ holds; a stage this GPU or toolkit cannot build is replayed
too, with one line saying why, and the rest run live."""
import os
import subprocess
import sys
from datetime import datetime, timezone

import pandas as pd

from . import paths, plots, tables
from .baselines import COMPARED
from .baselines import NAMES as BASELINES
from .env import environment, gpu_available
from .measure import configs_for
from .stages import stage as get_stage
from .stages import stages as all_stages
from .tables import RESULTS

JOB_TIMEOUT_S = 1800
TABLE_COLUMNS = ["stage", "dtype", "causal", "N", "D", "median_ms", "tflops", "pct_sdpa_best",
                 "rel_err", "registers", "spill_bytes", "status"]


def table(df=None, gpu=None, teaching_only=True) -> str:
    """The results as text: one GPU, the teaching configs by default."""
    df = RESULTS.load() if df is None else df
    gpu = gpu or tables.gpu_shown(df=df)
    df = tables.teaching_rows(df, gpu) if teaching_only else tables.on_gpu(df, gpu)
    if df.empty:
        return f"(no recorded results{f' on {gpu}' if gpu else ''})"
    df = df.sort_values(["dtype", "causal", "N", "D", "kind", "stage"], ascending=[False, True, True, True, False, True])
    shown = df[TABLE_COLUMNS].rename(columns={"median_ms": "ms", "tflops": "TFLOP/s",
                                              "pct_sdpa_best": "% best SDPA", "registers": "regs",
                                              "spill_bytes": "spills"})
    fmt = {"ms": "{:.3f}".format, "TFLOP/s": "{:.2f}".format, "% best SDPA": "{:.1f}".format,
           "rel_err": "{:.1e}".format}
    header = f"{gpu}"
    return header + "\n" + shown.to_string(index=False, formatters=fmt, na_rep="-")


def replay(out=print):
    """Print the recorded results (one GPU: tables.gpu_shown) and draw the figures."""
    df = RESULTS.load()
    df.attrs["replay"] = True
    out(f"No CUDA GPU here: replaying the results recorded in {RESULTS.path()}, measured on "
        f"{tables.provenance(df)}.")
    out(table(df))
    figs = plots.save_all(df)
    if figs:
        out("figures: " + ", ".join(str(f) for f in figs))
    return df


def _job(args, log, out):
    """Run one worker, copying its output to the log and the screen; returns its exit code."""
    cmd = [sys.executable, "-u", "-m", "flashlab.worker", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log.write(f"$ {' '.join(cmd)}\n")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=paths.ROOT) as proc:
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                out(line.rstrip())
            return proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            return -9


def run(stage_keys=None, with_baselines=True, with_sweep=True, progress=True, out=print,
        with_profile=False, with_stages=True, baselines=None):
    """The main job. Returns the results table; df.attrs["failed"] lists the jobs that failed,
    df.attrs["replayed"] the stages this machine could not run (and why). with_stages=False:
    only the peaks and the baselines (to re-time them beside stages that notebooks record).
    baselines: only these (e.g. the fastest, sdpa_flash and sdpa_cudnn); default every one."""
    asked = {get_stage(k) for k in stage_keys or ()}  # ValueError names a stage that does not exist
    unknown = sorted(set(baselines or ()) - set(BASELINES))
    if unknown:
        raise ValueError(f"no baseline {', '.join(unknown)}; the baselines are {', '.join(BASELINES)}")
    if not with_stages and (asked or not with_baselines):
        raise ValueError("no stages and no baselines: nothing to run")
    chosen = [s for s in all_stages() if with_stages and (not asked or s in asked)]
    if not gpu_available():
        return replay(out)
    from tqdm.auto import tqdm

    replayed = {s.slug: why for s in chosen if (why := s.unavailable()) is not None}
    for slug, why in replayed.items():
        out(f"{slug}: replayed from {RESULTS.path()}, not run: {why}")
    chosen = [s for s in chosen if s.slug not in replayed]
    # The fast stages' sweep is timed in one job, in turn with SDPA's compared backends at each
    # config, once every stage has passed its check in its own job.
    interleave = with_sweep and any(s.fast for s in chosen)
    compared = [b for b in COMPARED if b in (baselines or BASELINES)] if with_baselines else []
    planned = (["peaks"] if with_baselines else []) + [s.slug for s in chosen] \
        + (["sweep"] if interleave else []) + (["profile"] if with_profile else []) \
        + (["baselines"] if with_baselines else [])
    paths.runs_dir().mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    log_path = paths.runs_dir() / f"run-{stamp}.log"
    env = environment()
    failed = []
    with open(log_path, "w") as log:
        log.write(f"flashlab run on {env['gpu']} (cc {env['compute_capability']}), torch "
                  f"{env['torch']}, CUDA {env['cuda']}, commit {env['commit']}, {env['time']}\n")
        bar = tqdm(total=len(planned), desc="flashlab run", unit="job", disable=not progress,
                   file=sys.stderr)
        say = bar.write if progress else out

        def job(name, args):
            bar.set_postfix_str(name)
            code = _job(args, log, say)
            bar.update()
            if code != 0:
                failed.append(name)
                msg = f"{name}: {'check failed' if code == 3 else f'crashed (exit {code})'}"
                log.write(msg + "\n")
                say(msg)
                if code != 3 and name not in ("peaks", "baselines", "profile", "sweep"):
                    _record_crash(name, env, code)
            return code == 0

        if with_baselines:
            job("peaks", ["peaks"])
        passed = [s for s in chosen if job(s.slug, [s.slug] + (
            ["--no-sweep"] if not with_sweep else ["--sweep-elsewhere"] if s.fast else []))]
        if interleave:
            fast = [s.slug for s in passed if s.fast]
            if fast or compared:
                job("sweep", ["sweep"] + [a for k in fast for a in ("--stage", k)]
                    + [a for b in compared for a in ("--baseline", b)])
            else:
                bar.update()
        if with_profile:
            job("profile", ["profile"] + [a for s in chosen for a in ("--stage", s.slug)])
        if with_baselines:
            job("baselines", ["baselines"] + (["--sweep-elsewhere"] if interleave and compared
                                              else ["--no-sweep"] * (not with_sweep))
                + [a for b in baselines or () for a in ("--baseline", b)])
        bar.close()
    df = RESULTS.load()
    figs = plots.save_all(df)
    out(table(df))
    out(f"log: {log_path}")
    out("figures: " + ", ".join(str(f) for f in figs))
    unreported = unreported_registers(df, env["time"])
    if unreported:
        out(unreported)
        failed.append("ptxas")
    if failed:
        out("FAILED: " + ", ".join(failed))
    df.attrs["failed"] = failed
    df.attrs["replayed"] = replayed
    return df


def unreported_registers(df, started) -> str:
    """A line naming the stage rows this run (started at `started`) recorded without registers,
    because the ptxas report of the kernel that ran could not be found; "" when there are none.
    The timings stand, but the run fails so that the gap is seen (tools/fill_registers.py)."""
    rows = tables.without_ptxas(tables.since(df, started))
    if rows.empty:
        return ""
    return (f"no ptxas report: {len(rows)} rows of {', '.join(sorted(rows['stage'].unique()))} "
            f"carry no registers (the log says which kernel was not found)")


def _record_crash(slug, env, code):
    rows = [dict(stage=slug, kind="stage", dtype=c.dtype, B=c.B, H=c.H, N=c.N, D=c.D,
                 causal=c.causal, status="error", note=f"worker exited with {code}", **env)
            for c in configs_for(get_stage(slug))]
    RESULTS.upsert(pd.DataFrame(rows))
