"""One job of `flashlab run` in its own process, so that a stage that crashes the CUDA context
takes only its own results with it. Usage: python -m flashlab.worker peaks|baselines|STAGE."""
import argparse
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashlab.worker")
    ap.add_argument("job", help="'peaks', 'baselines', 'profile' or a stage such as 03")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--stage", action="append", default=[],
                    help="profile: only these stages (repeatable; default every stage)")
    ap.add_argument("--baseline", action="append", default=[],
                    help="baselines: only these (repeatable; default every baseline)")
    args = ap.parse_args(argv)

    from . import measure, peaks
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
        only = {"names": tuple(args.baseline)} if args.baseline else {}
        measure.measure_baselines(measure.baseline_configs(not args.no_sweep), log=log, **only)
        return 0
    st = stage(args.job)
    configs = [c for c in measure.configs_for(st) if not args.no_sweep or c == teaching(c.dtype)]
    chk, _ = measure.measure_stage(st, configs, log=log)
    return 0 if chk.passed else 3


if __name__ == "__main__":
    sys.exit(main())
