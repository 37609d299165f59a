"""Development harness for the Hopper stages (device only): build variants of a stage's pick(),
check each against float64, time them over the sweep beside stage 08 and SDPA's backends.

    python3 tools/hopper_try.py "09|D64:64,2,4;D128:128,2,3" "10|..."   [--quick] [--n=512,1024] [--d=64]

At each config the variants, stage 08 and the baselines are timed together, run by run in turn
(flashlab.bench.time_interleaved, one round). A variant is `;`-separated
`D<d>[c]:<template args after T, D>` entries; `c` marks the causal shape (the non-causal one is
used where no causal shape is given); an empty spec ("10|") runs the stage as it is. In place of a stage, a path to a .cu file ("scratch/11_x.cu|...") tries a kernel
not yet in the registry, checked with the last Hopper stage's dtypes and head dims. A file named
timing_only_*.cu is timed even when its check fails: a deliberately incomplete kernel (the
products without the softmax, say) that bounds what the real one could reach. --quick times
N in {1k, 4k, 16k} only; --n=... and --d=... keep only the sequence lengths and head dims listed.
"""
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

import flashlab as fl
from flashlab import build
from flashlab.bench import time_interleaved
from flashlab.configs import tflops
from flashlab.baselines import Baseline
from flashlab.runtime import Attention
from flashlab.variants import with_pick

def unregistered_stage(path):
    """The registry entry a kernel not yet in the registry is built and checked with: the last
    Hopper forward stage's (dtypes, head dims, target; timed over the sweep: fast), under the
    file's own name."""
    return dataclasses.replace([st for st in fl.stages() if st.arch_specific and st.fast][-1],
                               slug=Path(path).stem)


def variant_source(st, spec, text=None):
    """st's kernel (or `text`) with its pick() set to `spec` (flashlab.variants.with_pick)."""
    return with_pick(st.source.read_text() if text is None else text, spec)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick = "--quick" in sys.argv
    only = {k: {int(x) for x in v.split(",")} for a in sys.argv[1:] if a.startswith(("--n=", "--d="))
            for k, v in [a[2:].split("=")]}
    specs = args
    tmp = Path(tempfile.mkdtemp())
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
    attns = {}
    for i, arg in enumerate(specs):
        key, spec = arg.split("|")
        if key.endswith(".cu"):  # a kernel not yet in the registry, checked as the last Hopper stage is
            text = Path(key).read_text()
            st = unregistered_stage(key)
        else:
            st = fl.stage(key)
            text = st.source.read_text()
        src = tmp / f"{st.slug}_v{i}.cu"
        src.write_text(variant_source(st, spec, text) if spec else text)
        t = time.time()
        try:
            mod = build.build_module(src, arch=st.arch((9, 0)))
        except Exception as err:  # noqa: BLE001
            print(f"v{i} {arg}: BUILD FAILED {err}", flush=True)
            continue
        print(f"v{i} {arg}: built in {time.time() - t:.1f} s", flush=True)
        attn = Attention(st, mod)
        t = time.time()
        chk = fl.check(attn)
        print(f"v{i} check: {'PASS' if chk.passed else 'FAIL'} max err {chk.max_rel_err:.2e} "
              f"({time.time() - t:.1f} s)", flush=True)
        if not chk.passed:
            print(chk, flush=True)
            if not Path(key).name.startswith("timing_only_"):  # a deliberately wrong kernel,
                continue                                      # timed to bound the real one
        attns[f"v{i}"] = attn
    others = {"08": fl.stage(8).build(), "flash": Baseline("sdpa_flash"), "cudnn": Baseline("sdpa_cudnn")}
    cfgs = fl.sweep("fp16")
    if quick:
        cfgs = [c for c in cfgs if c.N in (1024, 4096, 16384)]
    cfgs = [c for c in cfgs if c.N in only.get("n", {c.N}) and c.D in only.get("d", {c.D})]
    names = list(attns) + list(others)
    print("D  causal     N  " + " ".join(f"{n:>7}" for n in names), flush=True)
    rows = []
    for cfg in cfgs:
        q, k, v = cfg.inputs()
        # every variant and baseline in one queued stream, run by run in turn: the GPU's clock
        # moves by a few per cent from second to second at long N, and moves them all alike
        tms = time_interleaved({name: (lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, causal=cfg.causal))
                                for name, fn in {**attns, **others}.items()}, rounds=1)
        row = {name: tflops(cfg, tm.median_ms) for name, tm in tms.items()}
        rows.append((cfg, row))
        print(f"{cfg.D:<3}{'c' if cfg.causal else ' ':6}{cfg.N:6}  " +
              " ".join(f"{row[n]:7.1f}" for n in names), flush=True)
        del q, k, v
    for vname in attns:
        r8 = [row[vname] / row["08"] for _, row in rows]
        rc = [row[vname] / row["cudnn"] for _, row in rows]
        print(f"{vname}: /08 min {min(r8):.2f} max {max(r8):.2f}; /cudnn min {min(rc):.2f} max {max(rc):.2f}")
    # bf16 against fp16 at a few points
    for vname, attn in attns.items():
        for cfg in [c for c in fl.sweep("bf16") if c.N == 4096 and c.D in only.get("d", {c.D})]:
            b16 = cfg.inputs()
            f16 = tuple(x.half() for x in b16)
            tm = time_interleaved({dt: (lambda x=x: attn(*x, causal=cfg.causal))
                                   for dt, x in (("bf16", b16), ("fp16", f16))}, rounds=1)
            print(f"{vname} D={cfg.D} causal={cfg.causal}: bf16/fp16 speed "
                  f"{tm['fp16'].median_ms / tm['bf16'].median_ms:.3f}")
        break


if __name__ == "__main__":
    main()
