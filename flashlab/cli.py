"""The flashlab command line. Run `flashlab --help`."""
import argparse
import sys

from .bench import TEACHING

DESCRIPTION = """\
flashlab: build a FlashAttention kernel one optimisation at a time, and measure every step.

Each stage is a CUDA file in kernels/ (01_naive, 02_coalesced, ...). flashlab compiles it,
checks it against a float64 reference, times it next to PyTorch's own attention, and keeps
every number in data/results.csv, which the notebooks and figures read.

commands:
  flashlab list                 the stages, in order, and what each one adds
  flashlab run                  build, check and time everything; update data/ and the figures
                                (without a GPU: show the recorded results instead)
  flashlab check 03             check stage 03 against the reference on fresh random inputs
  flashlab bench 03 --N 4096    time stage 03 at one config (B, H, N, D, dtype, --causal)
  flashlab profile 02           profile stage 02 under Nsight Compute (data/profile.csv)
  flashlab sass 03              count stage 03's SASS instructions by kind (no GPU needed)
  flashlab plot                 redraw data/figures/*.png from data/results.csv
  flashlab table                print the recorded results
  flashlab report               one page for a class handout: provenance, the stage table and
                                every figure, drawn fresh from data/ (data/report.html)
"""


def _cmd_list(args):
    from .stages import stages
    for st in stages():
        dims = "any D that fits" if st.any_head_dim else "D=" + "/".join(map(str, st.head_dims))
        print(f"{st.slug:16} {st.title:32} {'/'.join(st.dtypes):10} {dims}")
        print(f"{'':16} {st.idea}")
    return 0


def _need_gpu(what):
    from .env import gpu_available
    if not gpu_available():
        print(f"flashlab {what} needs a CUDA GPU and none is visible; `flashlab table` and "
              f"`flashlab plot` show the recorded results.", file=sys.stderr)
        return False
    return True


def _cmd_run(args):
    from .runner import run
    df = run(args.stage or None, with_baselines=not args.no_baselines,
             with_sweep=not args.no_sweep, progress=not args.no_progress,
             with_profile=args.profile)
    return 1 if df.attrs.get("failed") else 0


def _cmd_check(args):
    if not _need_gpu("check"):
        return 2
    from .check import check
    from .stages import stage
    st = stage(args.stage)
    result = check(st.build(), dtype=args.dtype, seed=args.seed,
                   head_dims=tuple(args.D) if args.D else None)
    print(result)
    return 0 if result.passed else 1


def _cmd_bench(args):
    if not _need_gpu("bench"):
        return 2
    from . import results
    from .baselines import NAMES, Baseline
    from .bench import Config, bench
    from .env import environment
    from .stages import stage
    cfg = Config(args.B, args.H, args.N, args.D, args.causal, args.dtype)
    if args.stage in NAMES:
        attn, kind = Baseline(args.stage), "baseline"
    else:
        attn, kind = stage(args.stage).build(), "stage"
    m = bench(attn, cfg, min_runs=args.runs)
    name = attn.stage.slug if kind == "stage" else attn.name
    print(f"{name}  {cfg.label}\n  median {m['median_ms']:.4f} ms (p20 {m['p20_ms']:.4f}, "
          f"p80 {m['p80_ms']:.4f}; {m['runs']} runs, {m['timer']})\n  {m['tflops']:.2f} TFLOP/s"
          f"   relative error {m['rel_err']:.2e}")
    if args.record:
        results.upsert([dict(stage=name, kind=kind, dtype=cfg.dtype, B=cfg.B, H=cfg.H, N=cfg.N,
                             D=cfg.D, causal=cfg.causal, status="ok", **m, **environment())])
        print(f"recorded in {results.path()}")
    return 0


def _cmd_profile(args):
    import pandas as pd

    from . import profile as prof
    from .bench import Config
    ok, why = prof.available()
    if args.stage and ok:
        cfg = Config(args.B, args.H, args.N, args.D, args.causal, args.dtype)
        df = prof.profile(args.stage, cfg)
        print(df[["metric", "value", "unit"]].to_string(index=False))
        return 0
    if args.stage:
        print(f"cannot profile here ({why}); showing the recorded metrics", file=sys.stderr)
    with pd.option_context("display.width", 200, "display.max_columns", 50):
        table = prof.wide()
        print(table.T.to_string() if len(table) else "no profiles recorded yet")
    return 0


def _cmd_sass(args):
    import pandas as pd

    from . import sass
    stages = [args.stage] if args.stage else None
    try:
        table = sass.table(stages, args.arch)
    except (FileNotFoundError, RuntimeError) as err:  # no nvcc/cuobjdump, or a compile error
        print(f"flashlab sass: {err}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 250, "display.max_columns", 50):
        print(f"static SASS instruction counts for {args.arch} (instructions in the code, not "
              f"executed):\n{table.to_string()}")
    if args.record:
        print(f"recorded in {sass.record(args.arch, stages)}")
    return 0


def _cmd_plot(args):
    from . import plots
    written = plots.save_all(gpu=args.gpu)
    print("\n".join(map(str, written)) if written else "nothing recorded to plot")
    return 0


def _cmd_table(args):
    from .runner import table
    print(table(gpu=args.gpu, teaching_only=not args.all))
    return 0


def _cmd_report(args):
    from . import report
    print(report.write(args.out, args.format))
    return 0


def parser():
    ap = argparse.ArgumentParser(prog="flashlab", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("list", help="list the stages")
    p.set_defaults(fn=_cmd_list)

    p = sub.add_parser("run", help="build, check and time every stage and baseline; record; plot",
                       description="The main job. On a CUDA GPU: for every stage, build it, check "
                       "it against the float64 reference and, if it passes, time it at the "
                       "standard configs; time PyTorch's baselines at the same configs; update "
                       "data/results.csv and data/figures/, and print the table. Each stage runs "
                       "in its own process, so one that crashes cannot take the others down. "
                       "Without a GPU: print and plot the recorded results.")
    p.add_argument("--stage", action="append", metavar="NN",
                   help="only this stage (repeatable), e.g. --stage 03")
    p.add_argument("--no-baselines", action="store_true", help="skip PyTorch's baselines and GPU peaks")
    p.add_argument("--no-sweep", action="store_true", help="only the teaching config, not the N sweep")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", action="store_true",
                   help="also profile every stage under Nsight Compute (data/profile.csv)")
    p.set_defaults(fn=_cmd_run)

    p = sub.add_parser("profile", help="profile one stage under Nsight Compute",
                       description="Run the stage once under ncu (clocks as found, only its "
                       "kernel) and record DRAM/SM/tensor throughput, occupancy, global sectors "
                       "per request, shared-memory bank conflicts and warp stall reasons in "
                       "data/profile.csv. Without a GPU or ncu: print the recorded metrics.")
    p.add_argument("stage", nargs="?", help="number or name (default: print all recorded)")
    p.add_argument("--B", type=int, default=TEACHING.B)
    p.add_argument("--H", type=int, default=TEACHING.H)
    p.add_argument("--N", type=int, default=TEACHING.N)
    p.add_argument("--D", type=int, default=TEACHING.D)
    p.add_argument("--dtype", default=TEACHING.dtype, choices=["fp32", "fp16", "bf16"])
    p.add_argument("--causal", action="store_true")
    p.set_defaults(fn=_cmd_profile)

    p = sub.add_parser("check", help="check one stage against the float64 reference",
                       description="Run a stage on fresh random inputs (N = 1, 17, 1000 and 4096, "
                       "causal and not) and compare with attention computed in float64. "
                       "Exit status 1 if any case fails.")
    p.add_argument("stage", help="number or name, e.g. 03 or 03_coarsened")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--D", type=int, action="append", help="head dim (repeatable)")
    p.add_argument("--seed", type=int)
    p.set_defaults(fn=_cmd_check)

    p = sub.add_parser("bench", help="time one stage (or baseline) at one config",
                       description="Median of at least --runs timed runs, L2 flushed between them. "
                       "STAGE may also be a baseline: sdpa_flash, sdpa_cudnn, sdpa_efficient, "
                       "sdpa_math, torch_naive.")
    p.add_argument("stage")
    p.add_argument("--B", type=int, default=TEACHING.B, help=f"batch (default {TEACHING.B})")
    p.add_argument("--H", type=int, default=TEACHING.H, help=f"heads (default {TEACHING.H})")
    p.add_argument("--N", type=int, default=TEACHING.N, help=f"sequence length (default {TEACHING.N})")
    p.add_argument("--D", type=int, default=TEACHING.D, help=f"head dim (default {TEACHING.D})")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--runs", type=int, default=20, help="at least this many timed runs (default 20)")
    p.add_argument("--record", action="store_true", help="also write the row to data/results.csv")
    p.set_defaults(fn=_cmd_bench)

    p = sub.add_parser("sass", help="count each stage's SASS instructions by kind",
                       description="Compile the stage(s) for --arch (no GPU needed), disassemble "
                       "with cuobjdump -sass and print static instruction counts per kernel, "
                       "grouped as the workbook discusses them: HMMA, LDSM, LDGSTS, LDG.E.128 "
                       "(16-byte global loads), LDG, STG, LDS.128, LDS, STS, LDL/STL (spills), "
                       "MUFU.EX2, FFMA, SHFL, BAR. Needs cuobjdump: pip install "
                       "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm.")
    p.add_argument("stage", nargs="?", help="number or name (default: every stage)")
    p.add_argument("--arch", default="sm_90", help="e.g. sm_80, sm_90 (default sm_90)")
    p.add_argument("--record", action="store_true", help="also write the counts to data/sass.csv")
    p.set_defaults(fn=_cmd_sass)

    p = sub.add_parser("plot", help="redraw the figures from the recorded results")
    p.add_argument("--gpu", help="which GPU's rows (default: the most recent)")
    p.set_defaults(fn=_cmd_plot)

    p = sub.add_parser("table", help="print the recorded results")
    p.add_argument("--gpu", help="which GPU's rows (default: the most recent)")
    p.add_argument("--all", action="store_true", help="every config, not just the teaching one")
    p.set_defaults(fn=_cmd_table)

    p = sub.add_parser("report", help="write one page for a class handout",
                       description="Write one page for a class handout: what flashlab is, where "
                       "the numbers come from (GPU, torch, CUDA, commit, time), the stage table at "
                       "the teaching config and every figure (the Nsight Compute ones once "
                       "data/profile.csv exists), all drawn fresh from data/. HTML embeds the "
                       "figures, so the one file opens offline; Markdown writes them as PNGs in a "
                       "folder beside the page.")
    p.add_argument("--out", metavar="PATH",
                   help="where to write it (default: data/report.html, or data/report.md)")
    p.add_argument("--format", choices=["html", "md"],
                   help="html or md (default: from --out's suffix, else html)")
    p.set_defaults(fn=_cmd_report)
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as err:
        print(f"flashlab: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
