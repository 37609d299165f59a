"""One job of `flashlab run` in its own process, so that a stage that crashes the CUDA context
takes only its own results with it. Usage: python -m flashlab.worker JOB, JOB a runner.Job as
JSON (Job.to_json()): the runner decides what a job times; this runs it as it says.

Exit status: 0 done, 3 a stage's check failed."""
import sys


def run_job(job) -> int:
    from . import measure, peaks
    from .stages import stage

    def log(msg):
        print(msg, flush=True)

    if job.task == "peaks":
        rows = peaks.measure()
        peaks.record(rows)
        for r in rows:
            log(f"{r['metric']:20} {r['value']:10.2f} {r['unit']}")
        return 0
    if job.task == "profile":
        from . import profile as prof
        for key, cfg in zip(job.stages, job.timed):
            st = stage(key)
            for pass_ in ("forward", "backward") if st.has_backward else ("forward",):
                df = prof.profile(st, cfg, pass_=pass_)
                log(f"{st.slug} {pass_ if st.has_backward else ''} profiled at {cfg.label}: " +
                    ", ".join(f"{r.metric}={r.value:.4g}" for r in df.itertuples()
                              if not r.metric.startswith("stall_")))
        return 0
    if job.task == "baselines":
        measure.measure_baselines(list(job.timed), job.baselines, log=log)
        return 0
    if job.task == "sweep":
        measure.measure_interleaved([stage(k) for k in job.stages], configs=list(job.timed),
                                    baselines=job.baselines, log=log,
                                    **({"rounds": job.rounds} if job.rounds else {}))
        return 0
    if job.task == "backward":
        checks, _ = measure.measure_backward([stage(k) for k in job.stages], list(job.timed),
                                             baselines=job.baselines, log=log)
        return 0 if all(c.passed for c in checks) else 3
    if job.task == "stage":
        chk, _ = measure.measure_stage(stage(job.stages[0]), list(job.timed), log=log,
                                       untimed=list(job.untimed))
        return 0 if chk.passed else 3
    raise ValueError(f"unknown job {job.task!r}")


def main(argv=None):
    from .runner import Job
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    return run_job(Job.from_json(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
