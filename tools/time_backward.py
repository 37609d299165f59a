"""Time the backward of every stage that has one beside SDPA's flash and cuDNN backwards, in turn
at each config (flashlab.bench.backward_fn: the forward once, then the backward alone), and the
forward with and without the log-sum-exp. Prints a table; the log is the record.
Usage (on a GPU): python tools/time_backward.py [N ...]"""
import sys

import torch

import flashlab as fl
from flashlab.baselines import Baseline
from flashlab.bench import backward_fn, time_interleaved, timing_row

Ns = [int(a) for a in sys.argv[1:]] or [1024, 4096]
print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
stages = {st.slug: st.build() for st in fl.stages() if st.has_backward}
base = {name: Baseline(name) for name in ("sdpa_flash", "sdpa_cudnn")}
for D in (64, 128):
    for causal in (False, True):
        for N in Ns:
            cfg = fl.Config(max(1, 16384 // N), 16 if D == 128 else 32, N, D, causal, "fp16")
            q, k, v = cfg.inputs("cuda", 0)
            fns = {name: backward_fn(f, q, k, v, causal) for name, f in {**stages, **base}.items()}
            times = time_interleaved(fns)
            line = [f"{cfg.label:<34}"]
            for name, t in times.items():
                line.append(f"{name} {t.median_ms:8.3f} ms {timing_row(cfg, t, 'backward')['tflops']:6.1f}")
            # the forward's log-sum-exp: its cost when asked, and when not
            for slug, attn in stages.items():
                fw = time_interleaved({"o": lambda: attn(q, k, v, causal=causal),
                                       "o+lse": lambda: attn(q, k, v, causal=causal, return_lse=True)})
                line.append(f"fwd {fw['o'].median_ms:.3f} / +lse {fw['o+lse'].median_ms:.3f} ms")
            print("  ".join(line), flush=True)
