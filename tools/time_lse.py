"""What the log-sum-exp costs a forward: every stage from 05 on that runs here, timed without it
and asked for it (attn(q, k, v, return_lse=True)), beside SDPA's flash and cuDNN forwards, all in
turn at each config (flashlab.measure.measure_interleaved with lse=True). Records the rows (pass
"forward" and "forward_lse") in data/results.csv and prints, per stage and config, the two medians
and the cost of asking.
Usage (on a GPU): python tools/time_lse.py [--sweep]   (default: the teaching configs, D 64 and
128, causal and not; --sweep: the fp16 sweep)"""
import sys

import pandas as pd
import torch

import flashlab as fl
from flashlab import measure

stages = [st for st in fl.stages() if st.lse and not st.has_backward
          and st.unavailable(torch.cuda.get_device_capability()) is None]
if "--sweep" in sys.argv[1:]:
    configs = list(fl.sweep("fp16"))
else:
    t = fl.teaching("fp16")
    configs = [fl.Config(t.B, t.H, t.N, D, causal, "fp16") for D in (64, 128) for causal in (False, True)]
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}  "
      f"stages {', '.join(st.slug for st in stages)}", flush=True)
rows = measure.measure_interleaved(stages, configs=configs, baselines=("sdpa_flash", "sdpa_cudnn"),
                                   lse=True)
ok = rows[(rows["status"] == "ok") & (rows["kind"] == "stage")]
wide = ok.pivot_table(index=["stage", "D", "causal", "N"], columns="pass", values="median_ms")
wide["cost of the lse"] = wide["forward_lse"] / wide["forward"] - 1
pd.set_option("display.width", 200)
print(wide.to_string(float_format=lambda x: f"{x:.4f}"))
cost = wide["cost of the lse"]
print(f"asking for the log-sum-exp: {cost.median():+.1%} median, {cost.min():+.1%} to {cost.max():+.1%}")
