"""One job of `flashlab run` in its own process, so that a stage that crashes the CUDA context
takes only its own results with it. Usage: python -m flashlab.worker peaks|baselines|sweep|STAGE.

sweep: the stages named (already checked in their own jobs) and the baselines named, timed in
turn at each sweep config (measure.measure_interleaved); a stage or baselines job given
--sweep-elsewhere leaves those sweep configs to it."""
import argparse
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashlab.worker")
    ap.add_argument("job", help="'peaks', 'baselines', 'sweep', 'profile' or a stage such as 03")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--stage", action="append", default=[],
                    help="profile, sweep: only these stages (repeatable; profile: default every "
                    "stage)")
    ap.add_argument("--baseline", action="append", default=[],
                    help="baselines, sweep: only these (repeatable; baselines: default every "
                    "baseline)")
    ap.add_argument("--sweep-elsewhere", action="store_true",
                    help="a stage: time only its teaching configs (a sweep job times the rest); "
                    "baselines: leave the compared backends' sweep to the sweep job")
    ap.add_argument("--rounds", type=int, default=None, help="sweep: rounds in turn at each config")
    args = ap.parse_args(argv)

    from . import measure, peaks
    from .baselines import COMPARED
    from .baselines import NAMES as BASELINES
    from .bench import teaching
    from .stages import stage

    def log(msg):
        print(msg, flush=True)

    if args.job == "peaks":
        rows = peaks.measure()
        peaks.record(rows)
        for r in rows:
            log(f"{r['metric']:20} {r['value']:10.2f} {r['unit']}")
        return 0
    if args.job == "profile":
        from . import profile as prof
        from .stages import stages
        for st in (stage(k) for k in args.stage) if args.stage else stages():
            cfg = teaching(st.dtypes[0])
            df = prof.profile(st, cfg)
            log(f"{st.slug} profiled at {cfg.label}: " + ", ".join(
                f"{r.metric}={r.value:.4g}" for r in df.itertuples() if not r.metric.startswith("stall_")))
        return 0
    if args.job == "baselines":
        names = tuple(args.baseline) or BASELINES
        if not args.sweep_elsewhere:
            measure.measure_baselines(measure.baseline_configs(not args.no_sweep), names, log=log)
            return 0
        teach = measure.baseline_configs(with_sweep=False)
        measure.measure_baselines(teach, names, log=log)
        rest = tuple(n for n in names if n not in COMPARED)
        if rest and not args.no_sweep:
            measure.measure_baselines([c for c in measure.baseline_configs() if c not in teach],
                                      rest, log=log)
        return 0
    if args.job == "sweep":
        stages_ = [stage(k) for k in args.stage]
        measure.measure_interleaved(stages_, baselines=tuple(args.baseline), log=log,
                                    **({"rounds": args.rounds} if args.rounds else {}))
        return 0
    st = stage(args.job)
    configs = measure.configs_for(st)
    timed = [c for c in configs
             if not (args.no_sweep or args.sweep_elsewhere) or c == teaching(c.dtype)]
    untimed = [c for c in configs if c not in timed] if args.sweep_elsewhere else []
    chk, _ = measure.measure_stage(st, timed, log=log, untimed=untimed)
    return 0 if chk.passed else 3


if __name__ == "__main__":
    sys.exit(main())
