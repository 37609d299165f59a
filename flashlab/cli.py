"""The flashlab command line. Run `flashlab --help`."""
import argparse
import sys

from . import dtypes
from .configs import TEACHING

# The command list, once: the CLI's help shows it, and README.md's copy is generated from it.
COMMANDS = [
    ("flashlab list", "the stages, in order, and what each one adds"),
    ("flashlab run", "build, check and time everything; update data/, the figures and README.md "
                     "(without a GPU: show the recorded results instead)"),
    ("flashlab run --profile", "... and profile every stage under Nsight Compute (data/profile.csv)"),
    ("flashlab run --stage 08", "only stage 08 (repeatable), with the baselines in the same run"),
    ("flashlab check 03", "check stage 03 against the float64 reference on fresh random inputs"),
    ("flashlab bench 03 --N 4096", "time stage 03 at one config (--B --H --N --D --dtype --causal)"),
    ("flashlab profile 02", "profile stage 02 under Nsight Compute, raw CSV in data/profiles/"),
    ("flashlab sass 03", "stage 03's SASS instruction counts by kind, no GPU (--arch, --record)"),
    ("flashlab tune", "stage 08's autotune on this GPU (data/tune08.csv)"),
    ("flashlab tune --apply", "write the recorded choice into kernels/08_tuned.cu's pick(), no GPU"),
    ("flashlab model", "GPT-2 from its config with SDPA, eager and each stage as its attention: "
                       "logits against SDPA and forward time (data/model.csv)"),
    ("flashlab plot", "redraw data/figures/*.png from the recorded results"),
    ("flashlab table", "print the recorded results (--all: every config)"),
    ("flashlab report", "one self-contained page (table + every figure) for a class handout"),
    ("flashlab readme", "regenerate README.md's tables and this list (--check: is it up to date?)"),
    ("flashlab new-stage 14 slug --from 13", "write a new stage's kernel, registry entry, notebook "
                                             "and course-map row from stage 13's; print what records it"),
    ("flashlab student DIR --through NN", "write the edition of one assignment (--from MM): its "
                             "exercises stubbed, later stages absent, no solution inside"),
    ("flashlab grade [DIR]", "check an edition: each lab run in its notebook, kernel exercises on "
                             "a GPU (--exercise ID)"),
    ("flashlab grade --class DIR --edition ED", "grade a class's hand-ins (clones, zips, "
                             "notebooks): gradebook.csv and feedback per student (--out, --jobs)"),
    ("flashlab leaderboard GRADEBOOK", "rank a class from its gradebook per GPU model and draw a "
                                       "figure per exercise (--out DIR)"),
    ("flashlab nbgrader DIR --through 02", "an nbgrader course folder for one assignment"),
]
COURSE = ("student", "grade", "leaderboard", "nbgrader")  # run by flashlab.course.cli (__main__)


def command_list(width=30) -> str:
    import textwrap
    lines = []
    for usage, what in COMMANDS:
        wrapped = textwrap.wrap(what, 98 - width)
        if len(usage) < width - 1:
            lines.append(f"{usage:<{width}}{wrapped[0]}")
            wrapped = wrapped[1:]
        else:  # a long usage on a line of its own
            lines.append(usage)
        lines += [" " * width + more for more in wrapped]
    return "\n".join(lines) + "\n"


DESCRIPTION = f"""\
flashlab: build a FlashAttention kernel one optimisation at a time, and measure every step.

Each stage is a CUDA file in kernels/ (01_naive, 02_coalesced, ...). flashlab compiles it,
checks it against a float64 reference, times it next to PyTorch's own attention, and keeps
every number in data/results.csv, which the notebooks and figures read.

commands:
{command_list()}"""


def _cmd_list(args):
    from .stages import stages
    for st in stages():
        dims = "any D that fits" if st.any_head_dim else "D=" + "/".join(map(str, st.head_dims))
        print(f"{st.slug:16} {st.title:32} {'/'.join(st.dtypes):10} {dims}")
        print(f"{'':16} {st.idea}")
        if st.has_backward:
            print(f"{'':16} backward pass: trains through autograd; attn(..., return_lse=True)")
        print(f"{'':16} here: {st.availability()}")
    return 0


def _cannot(what, st=None):
    """Print why `flashlab what` cannot run here and return True, or return False."""
    from .env import gpu_available
    why = st.unavailable() if st is not None else (None if gpu_available() else "no CUDA GPU here")
    if why is None:
        return False
    print(f"flashlab {what}: {why}; `flashlab table` and `flashlab plot` show the recorded "
          f"results.", file=sys.stderr)
    return True


def _cmd_run(args):
    from .runner import run
    df = run(args.stage or None, with_baselines=not args.no_baselines,
             with_sweep=not args.no_sweep, progress=not args.no_progress,
             with_profile=args.profile, with_stages=not args.no_stages, baselines=args.baseline)
    return 1 if df.attrs.get("failed") else 0


def _cmd_readme(args):
    from . import readme
    return readme.update(command_list(), check=args.check)


def _cmd_new_stage(args):
    from . import paths, scaffold
    from .stages import stage
    written = scaffold.new_stage(args.number, args.slug, args.source, args.title, args.idea)
    print("wrote " + ", ".join(str(p.relative_to(paths.ROOT)) for p in written))
    print("then record it:\n" + scaffold.next_steps(int(args.number), args.slug, stage(args.source)))
    return 0


def _cmd_tune(args):
    from . import autotune
    if args.apply:
        autotune.apply(gpu=args.gpu)
        return 0
    if _cannot("tune", autotune.tuned()):
        return 2
    autotune.measure()
    return 0


def _cmd_model(args):
    from . import model
    from .env import gpu_available
    if not gpu_available():
        import pandas as pd

        from .tables import NotRecorded, model_rows
        try:
            rows = model_rows(args.gpu)
        except NotRecorded as err:
            print(f"flashlab model: no CUDA GPU here, and {err}", file=sys.stderr)
            return 2
        print(f"flashlab model: no CUDA GPU here; the recorded measurements on {rows['gpu'].iloc[0]}:")
        with pd.option_context("display.width", 160):
            print(rows[["impl", "dtype", "batch", "seq", "n_layer", "max_abs_diff", "forward_ms",
                        "input_copies", "commit"]].to_string(index=False))
        return 0
    model.measure(stages=args.stage or None, dtypes=args.dtype or dtypes.HALF,
                  batch=args.batch, seq=args.seq, n_layer=args.layers)
    return 0


def _cmd_check(args):
    import torch

    from .check import check, promised_checks
    from .stages import stage
    st = stage(args.stage)
    if _cannot("check", st):
        return 2
    attn = st.build()
    result = check(attn, dtype=args.dtype, seed=args.seed,
                   head_dims=tuple(args.D) if args.D else None)
    print(result)
    passed = result.passed
    # and what else the stage promises: the log-sum-exp, its gradients, the same bits every run
    more = promised_checks(st)
    head_dims = tuple(args.D) if args.D else tuple(st.head_dims)
    for dt in [args.dtype] if args.dtype else st.dtypes_on(torch.cuda.get_device_capability()):
        for run in more:
            res = run(attn, dtype=dt, seed=args.seed, head_dims=head_dims)
            print(res)
            passed &= res.passed
    return 0 if passed else 1


def _cmd_bench(args):
    from .baselines import NAMES, Baseline
    from .bench import bench
    from .configs import Config
    from .env import environment
    from .stages import stage
    from .tables import RESULTS
    st = None if args.stage in NAMES else stage(args.stage)
    if _cannot("bench", st):
        return 2
    cfg = Config(args.B, args.H, args.N, args.D, args.causal, args.dtype)
    if st is None:
        attn, kind = Baseline(args.stage), "baseline"
    else:
        attn, kind = st.build(), "stage"
    m = bench(attn, cfg, min_runs=args.runs)
    name = attn.stage.slug if kind == "stage" else attn.name
    print(f"{name}  {cfg.label}\n  median {m['median_ms']:.4f} ms (p20 {m['p20_ms']:.4f}, "
          f"p80 {m['p80_ms']:.4f}; {m['runs']} runs, {m['timer']}; warmed by {m['warmup_runs']} "
          f"calls, re-timed {m['retimes']}x)\n  {m['tflops']:.2f} TFLOP/s"
          f"   relative error {m['rel_err']:.2e}" + (f"\n  {m['note']}" if m["note"] else ""))
    if args.record:
        RESULTS.upsert([dict(stage=name, kind=kind, dtype=cfg.dtype, B=cfg.B, H=cfg.H, N=cfg.N,
                             D=cfg.D, causal=cfg.causal, status="ok", **m, **environment())])
        print(f"recorded in {RESULTS.path()}")
    return 0


def _cmd_profile(args):
    import pandas as pd

    from . import profile as prof
    from . import tables
    from .configs import Config
    ok, why = prof.available()
    if args.stage and ok:
        cfg = Config(args.B, args.H, args.N, args.D, args.causal, args.dtype)
        df = prof.profile(args.stage, cfg)
        print(df[["metric", "value", "unit"]].to_string(index=False))
        return 0
    if args.stage:
        print(f"cannot profile here ({why}); showing the recorded metrics", file=sys.stderr)
    with pd.option_context("display.width", 200, "display.max_columns", 50):
        gpu = tables.gpu_shown()
        rows = tables.profile_rows(gpu)  # None: nothing profiled on this GPU
        table = tables.profile_wide(rows) if rows is not None else pd.DataFrame()
        print(f"{gpu}:\n{table.T.to_string()}" if len(table) else
              f"no profiles recorded yet on {gpu}")
    return 0


def _cmd_sass(args):
    import pandas as pd

    from . import sass
    from .stages import stage
    stages = [args.stage] if args.stage else None
    try:  # default: sm_90, or a Hopper stage's own sm_90a
        args.arch = args.arch or (stage(args.stage).static_archs[-1] if args.stage else "sm_90")
        if args.stage and args.arch not in stage(args.stage).static_archs:
            st = stage(args.stage)
            raise ValueError(f"{st.slug} is built for {' and '.join(st.static_archs)}, not "
                             f"{args.arch}")
        table = sass.table(stages, args.arch)
    except (FileNotFoundError, RuntimeError, ValueError) as err:  # no nvcc/cuobjdump, a compile error, no such stage
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


GPU_DEFAULT = "the GPU shown: this one, else $FLASHLAB_GPU, else the one recorded last"
GPU_HELP = f"which GPU's rows (default: {GPU_DEFAULT})"
TUNE_HELP = ("On a GPU: time every candidate shape of the tuned stage over the FlashAttention sweep, "
             "each switch off in turn on the winners, and record it all in data/tune08.csv. With "
             "--apply (anywhere): write the recorded choice into the kernel's pick() table.")


def _cmd_course(args):
    """The course commands live a layer above this module: flashlab.__main__ runs them."""
    print(f"flashlab {args.command}: a course command; run it as `flashlab {args.command}` or "
          f"`python -m flashlab {args.command}` (flashlab.__main__ hands it to flashlab.course)",
          file=sys.stderr)
    return 2


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
                       "data/results.csv and data/figures/, and print the table. Each stage is "
                       "checked in its own process, so one that crashes cannot take the others "
                       "down; the fast stages that pass are then timed over the sweep together "
                       "with SDPA's flash and cuDNN backends, run by run in turn at each config, "
                       "three rounds over. "
                       "Without a GPU: print and plot the recorded results.")
    p.add_argument("--stage", action="append", metavar="NN",
                   help="only this stage (repeatable), e.g. --stage 03")
    p.add_argument("--no-baselines", action="store_true", help="skip PyTorch's baselines and GPU peaks")
    p.add_argument("--baseline", action="append", metavar="NAME",
                   help="only this baseline (repeatable), e.g. --baseline sdpa_cudnn; the others "
                   "keep their recorded rows")
    p.add_argument("--no-stages", action="store_true",
                   help="only PyTorch's baselines and the GPU peaks (the notebooks time the stages)")
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
    p.add_argument("--dtype", default=TEACHING.dtype, choices=dtypes.NAMES)
    p.add_argument("--causal", action="store_true")
    p.set_defaults(fn=_cmd_profile)

    p = sub.add_parser("check", help="check one stage against the float64 reference",
                       description="Run a stage on fresh random inputs (N = 1, 17, 1000 and 4096, "
                       "causal and not) and compare with attention computed in float64; where the "
                       "stage has them, its log-sum-exp and its gradients too, and for a "
                       "deterministic backward the same bits on every run. "
                       "Exit status 1 if any case fails.")
    p.add_argument("stage", help="number or name, e.g. 03 or 03_coarsened")
    p.add_argument("--dtype", choices=dtypes.NAMES)
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
    p.add_argument("--dtype", default="fp32", choices=dtypes.NAMES)
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
    p.add_argument("--arch", help="e.g. sm_80, sm_90, sm_90a (default sm_90, or sm_90a for a "
                   "stage that needs it; without a stage, the stages built for that arch)")
    p.add_argument("--record", action="store_true", help="also write the counts to data/sass.csv")
    p.set_defaults(fn=_cmd_sass)

    p = sub.add_parser("model", help="GPT-2 with each stage as its attention (data/model.csv)",
                       description="Build a GPT-2 from its config (random weights, nothing "
                       "downloaded; needs transformers) and run the same tokens with SDPA, eager "
                       "and each fast stage as its attention: the largest logit difference from "
                       "SDPA, the inputs the adapter had to copy, and the forward pass's time. "
                       "Records data/model.csv. Without a GPU: print the recorded rows.")
    p.add_argument("--stage", action="append", metavar="NN", help="only this stage (repeatable)")
    p.add_argument("--dtype", action="append", choices=dtypes.HALF,
                   help="fp16 or bf16 (repeatable; default both)")
    p.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--layers", type=int, default=12, help="transformer layers (default 12)")
    p.add_argument("--gpu", help=GPU_HELP)
    p.set_defaults(fn=_cmd_model)

    p = sub.add_parser("plot", help="redraw the figures from the recorded results")
    p.add_argument("--gpu", help=GPU_HELP)
    p.set_defaults(fn=_cmd_plot)

    p = sub.add_parser("table", help="print the recorded results")
    p.add_argument("--gpu", help=GPU_HELP)
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

    p = sub.add_parser("readme", help="regenerate README.md's tables and command list",
                       description="Rewrite the parts of README.md between its generated-part "
                       "markers: the stage table and the sweep table from data/results.csv, the "
                       "command list from this program's help.")
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    p.set_defaults(fn=_cmd_readme)

    p = sub.add_parser("new-stage", help="write a new stage's files from the stage it builds on",
                       description="Write kernels/NN_slug.cu (stage MM's, its kernel renamed and "
                       "its exercises carried), the stage's entry in flashlab/stages.py (MM's, "
                       "renamed), a notebook skeleton notebooks/src/NN_slug.py in the notebook "
                       "conventions and its row in notebooks/TEACHING.md's course map; then print "
                       "the commands that record it. README.md, 'Adding a stage', says the rest.")
    p.add_argument("number", type=int, help="the new stage's number, e.g. 14")
    p.add_argument("slug", help="its name, lower_case: 14 backward -> 14_backward")
    p.add_argument("--from", dest="source", required=True, help="the stage it builds on (MM)")
    p.add_argument("--title", help="its title (default: from the name)")
    p.add_argument("--idea", help="the one technique it adds, in a sentence")
    p.set_defaults(fn=_cmd_new_stage)

    p = sub.add_parser("tune", help="stage 08's autotune (data/tune08.csv); --apply writes pick()",
                       description=TUNE_HELP)
    p.add_argument("--apply", action="store_true",
                   help="rewrite pick() in the tuned stage's .cu from data/tune08.csv (no GPU)")
    p.add_argument("--gpu", help="--apply: which GPU's tuning log (default: " + GPU_DEFAULT + ")")
    p.set_defaults(fn=_cmd_tune)

    # Listed here for the help and README; flashlab.__main__ hands them to flashlab.course.cli
    listed = set()
    for usage, what in COMMANDS:
        name = usage.split()[1]
        if name in COURSE and name not in listed:
            listed.add(name)
            p = sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}. A "
                               f"course command: run it as `flashlab {name}` or `python -m "
                               f"flashlab {name}`, whose --help lists its options.")
            p.add_argument("args", nargs=argparse.REMAINDER, metavar="...", help="its arguments")
            p.set_defaults(fn=_cmd_course)
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as err:  # bad input, e.g. a stage that does not exist
        print(f"flashlab: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
