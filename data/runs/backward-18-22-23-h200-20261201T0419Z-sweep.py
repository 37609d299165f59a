# The script of backward-18-22-23-fp16-h200-20261201T0419Z.log and backward-22-23-bf16-h200-20261201T0419Z.log (run as .s22/sweep23.py DTYPE [STAGES])
"""The FlashAttention sweep of stage 23's backward beside 18, 22 and SDPA's backends, in turn,
recorded (flashlab.measure.measure_backward). Usage: python .s22/sweep23.py DTYPE"""
import sys
import pandas as pd
import torch
import flashlab as fl
from flashlab import measure
from flashlab.stages import stage
dt = sys.argv[1]
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
sts = [stage(s) for s in (sys.argv[2:] or ("18", "22", "23"))]
checks, rows = measure.measure_backward(sts, configs=fl.sweep(dt, (64, 128)))
b = rows[(rows["pass"] == "backward") & (rows.status == "ok")]
p = b.pivot_table(index=["D", "causal", "N"], columns="stage", values="median_ms")
p["23/22"] = p["22_overlap_backward"] / p["23_tma_store_backward"]
p["23/cudnn"] = p["sdpa_cudnn"] / p["23_tma_store_backward"]
if "18_dq_layout" in p: p["23/18"] = p["18_dq_layout"] / p["23_tma_store_backward"]
p["22/cudnn"] = p["sdpa_cudnn"] / p["22_overlap_backward"]
with pd.option_context("display.width", 250, "display.float_format", "{:.3f}".format):
    print(p.to_string())
for c in [c for c in ("23/22", "23/cudnn", "23/18") if c in p]:
    print(f"{dt} {c}: min {p[c].min():.3f} max {p[c].max():.3f}")
