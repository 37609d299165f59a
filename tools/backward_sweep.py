"""The backward passes of some stages over the FlashAttention sweep (B·N = 16k tokens, H·D = 2048,
N = 512 to 16k, D = 64 and 128, causal and not), beside SDPA's flash and cuDNN backwards, run by
run in turn at each config (flashlab.measure.measure_backward: every stage checked first, then
each config timed and recorded into data/results.csv as soon as it is done), in each dtype asked
for, one after the other in one process: the run issue 44's acceptance names. Prints, per dtype,
the first stage named over each of the others and over SDPA's backwards, config by config.
Usage (on a GPU): python tools/backward_sweep.py [--dtype fp16 [bf16]] STAGE [STAGE ...]
e.g.  python tools/backward_sweep.py 23 22 18   (stage 23 over 22, 18, cuDNN and flash)"""
import argparse
import time

import pandas as pd
import torch

import flashlab as fl
from flashlab import measure
from flashlab.stages import stage

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("stages", nargs="+", help="stages with a backward pass; the first is compared")
p.add_argument("--dtype", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
args = p.parse_args()
sts = [stage(s) for s in args.stages]
if not all(st.has_backward for st in sts):
    p.error("every stage named needs a backward pass: "
            + ", ".join(st.slug for st in sts if not st.has_backward) + " has none")
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
mine = sts[0].slug
for dt in args.dtype:
    t = time.monotonic()
    checks, rows = measure.measure_backward(sts, configs=fl.sweep(dt, (64, 128)))
    b = rows[(rows["pass"] == "backward") & (rows.status == "ok")]
    ms = b.pivot_table(index=["D", "causal", "N"], columns="stage", values="median_ms")
    ratio = pd.DataFrame({f"{mine} over {other}": ms[other] / ms[mine]
                          for other in ms.columns if other != mine and mine in ms})
    with pd.option_context("display.width", 250, "display.float_format", "{:.3f}".format):
        print(f"\n{dt}: backward ms\n{ms.to_string()}\n\n{dt}: speedups\n{ratio.to_string()}")
    for c in ratio:
        print(f"{dt} {c}: min {ratio[c].min():.3f} max {ratio[c].max():.3f}")
    print(f"{dt}: measured in {time.monotonic() - t:.0f} s", flush=True)
