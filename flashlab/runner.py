"""`flashlab run`: build, check and time every stage and the baselines, record, plot, print.
Without a GPU it replays what data/ holds; a stage this GPU or toolkit cannot build is replayed
too, with one line saying why, and the rest run live.

What a run times is decided once, here: plan() lists its jobs, each naming the stages, baselines
and configs it times (the lists themselves are flashlab.measure's); flashlab.worker runs one job
in its own process exactly as planned; and when the run has recorded into the repository's own
data/, it rewrites README.md's tables."""
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

import pandas as pd

from . import measure, paths, plots, readme, tables
from .baselines import COMPARED
from .baselines import NAMES as BASELINES
from .configs import Config, teaching
from .env import environment, gpu_available
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


def backward_table(df=None, dtype="fp16") -> str:
    """The backward passes at the teaching config as text (tables.backward_at_teaching): each
    stage's beside SDPA's cuDNN backward timed in turn with it, on the GPU that recorded it; ""
    while none is recorded."""
    rows = tables.backward_at_teaching(df, dtype)
    if rows.empty:
        return ""
    t = teaching(dtype)
    shown = rows.rename(columns={"ms": "backward ms", "tflops": "TFLOP/s",
                                 "baseline_ms": "cuDNN ms", "speedup": "x cuDNN"})
    fmt = {"backward ms": "{:.3f}".format, "TFLOP/s": "{:.1f}".format,
           "cuDNN ms": "{:.3f}".format, "x cuDNN": "{:.3f}".format}
    return (f"backward passes, B={t.B} H={t.H} N={t.N} D={t.D} {dtype} (cuDNN's backward timed "
            f"in turn with each):\n" + shown.to_string(index=False, formatters=fmt, na_rep="-"))


def replay(out=print):
    """Print the recorded results (one GPU: tables.gpu_shown) and draw the figures that are
    missing: nothing was measured, so the recorded ones stay as their runs drew them (a clean
    clone stays clean)."""
    df = RESULTS.load()
    df.attrs["replay"] = True
    out(f"No CUDA GPU here: replaying the results recorded in {RESULTS.path()}, measured on "
        f"{tables.provenance(df)}.")
    out(table(df))
    back = backward_table()
    if back:
        out(back)
    figs = plots.save_all(df, overwrite=False)
    if figs:
        out("figures: " + ", ".join(str(f) for f in figs))
    return df


@dataclass(frozen=True)
class Job:
    """One job of a run, run by flashlab.worker in its own process (a stage that crashes the CUDA
    context takes only its own results with it).

    task "peaks": the GPU's ceilings. "stage": check stages[0], then time it at `timed` (exit 3
    if the check fails; `untimed`, the configs the sweep job times, then get a "failed check"
    row too). "sweep": the checked stages and the baselines, timed in turn at each of `timed`.
    "baselines": the baselines at `timed`. "profile": stages[i] under Nsight Compute at
    timed[i]. "backward": the stages' backward passes checked, then timed in turn with the
    compared baselines' backwards at `timed` (exit 3 if a check fails)."""
    task: str
    name: str = ""
    stages: tuple = ()      # slugs
    baselines: tuple = ()
    timed: tuple = ()       # Configs
    untimed: tuple = ()
    rounds: int = 0         # sweep: rounds in turn at each config (0: measure's default)

    def __post_init__(self):
        object.__setattr__(self, "name", self.name or self.task)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text) -> "Job":
        d = json.loads(text)
        for k in ("timed", "untimed"):
            d[k] = tuple(Config(**c) for c in d[k])
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def sweep_job(stages, compared, rounds=0) -> Job:
    """The job that times the fast stages' sweeps in turn with the compared baselines."""
    return Job("sweep", stages=tuple(s.slug for s in stages), baselines=tuple(compared),
               timed=tuple(measure.interleaved_configs(stages, bool(compared))), rounds=rounds)


def plan(stages, with_baselines=True, with_sweep=True, with_profile=False, baselines=None) -> list:
    """The jobs of a run over `stages` (those this machine runs), in order: the peaks, a job a
    stage, the sweep (the fast stages in turn with SDPA's compared backends at each config),
    the profiles, the baselines (at the teaching configs, then over the sweep those the sweep job
    did not time)."""
    names = tuple(b for b in BASELINES if b in (baselines or BASELINES)) if with_baselines else ()
    compared = tuple(b for b in COMPARED if b in names)
    interleave = with_sweep and any(s.fast for s in stages)
    jobs = [Job("peaks")] if with_baselines else []
    for st in stages:
        configs = measure.configs_for(st)  # the teaching configs, and a fast stage's sweeps
        alone = [c for c in configs if c == teaching(c.dtype)]
        elsewhere = [c for c in configs if c not in alone] if interleave else []
        jobs.append(Job("stage", st.slug, stages=(st.slug,), timed=tuple(alone),
                        untimed=tuple(elsewhere)))
    if interleave:
        jobs.append(sweep_job([s for s in stages if s.fast], compared))
    trained = [s for s in stages if s.has_backward]
    if trained:
        timed = [c for s in trained for c in measure.backward_configs(s)
                 if with_sweep or c == teaching(c.dtype) or c == _causal(teaching(c.dtype))]
        # SDPA's backwards are timed in turn with the stages' even without the other baselines:
        # a backward row means nothing without them (the forward's come from the sweep job)
        jobs.append(Job("backward", stages=tuple(s.slug for s in trained), baselines=COMPARED,
                        timed=tuple(dict.fromkeys(timed))))
    if with_profile:
        jobs.append(Job("profile", stages=tuple(s.slug for s in stages),
                        timed=tuple(teaching(s.dtypes[0]) for s in stages)))
    if names:
        teach = measure.baseline_configs(with_sweep=False)
        jobs.append(Job("baselines", stages=(), baselines=names, timed=tuple(teach)))
        rest = tuple(n for n in names if n not in compared) if interleave else names
        if with_sweep and rest:
            jobs.append(Job("baselines", "baselines (sweep)", baselines=rest,
                            timed=tuple(c for c in measure.baseline_configs() if c not in teach)))
    return jobs


def _causal(cfg):
    return Config(cfg.B, cfg.H, cfg.N, cfg.D, True, cfg.dtype)


def _job(job, log, out):
    """Run one worker, copying its output to the log and the screen; returns its exit code."""
    cmd = [sys.executable, "-u", "-m", "flashlab.worker", job.to_json()]
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
    planned = plan(chosen, with_baselines, with_sweep, with_profile, baselines)
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
        passed = set()
        for job in planned:
            if job.task == "sweep":  # only the stages that passed their checks
                job = sweep_job([get_stage(k) for k in job.stages if k in passed], job.baselines,
                                job.rounds)
                if not job.stages and not job.baselines:
                    bar.update()
                    continue
            if job.task == "backward":  # a forward that failed its check is not trained through
                job = replace(job, stages=tuple(k for k in job.stages if k in passed))
                if not job.stages:
                    bar.update()
                    continue
            bar.set_postfix_str(job.name)
            code = _job(job, log, say)
            bar.update()
            if code == 0 and job.task == "stage":
                passed.add(job.stages[0])
            elif code != 0:
                failed.append(job.name)
                msg = f"{job.name}: {'check failed' if code == 3 else f'crashed (exit {code})'}"
                log.write(msg + "\n")
                say(msg)
                if code != 3 and job.task == "stage":
                    _record_crash(job, env, code)
        bar.close()
    df = RESULTS.load()
    figs = plots.save_all(df)
    out(table(df))
    out(f"log: {log_path}")
    out("figures: " + ", ".join(str(f) for f in figs))
    if paths.data_dir() == paths.ROOT / "data":  # the repository's own table changed
        readme.update_tables()
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


def _record_crash(job, env, code):
    """A stage's job crashed: every config it was to be timed at (here or by the sweep job) says
    so, so that no earlier timing of it stands as this commit's."""
    rows = [dict(stage=job.stages[0], kind="stage", dtype=c.dtype, B=c.B, H=c.H, N=c.N, D=c.D,
                 causal=c.causal, status="error", note=f"worker exited with {code}", **env)
            for c in (*job.timed, *job.untimed)]
    RESULTS.upsert(pd.DataFrame(rows))
