"""Where a timed training step's GPU time goes (model.TIMED: GPT-2, seq 4096, d 512, 4 layers):
SDPA's cuDNN backend against a stage, each step under torch.profiler, the kernels that take the
most GPU time listed; then steps of SDPA's cuDNN and flash backends and the stages, a step of each
in turn (model.train_in_turn), three times over. What found the permuting copies a stage's
contiguous dO and gradients cost a transformers model (data/runs/training-profile-h200-*.log).
Usage (on a GPU): python tools/training_profile.py [STAGE [STAGE...]]   (default: the last stage with
a backward pass; the first stage named is the one profiled, every one is timed in turn)"""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashlab import model
from flashlab.stages import last_backward, stage

print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
T = model.TIMED
slugs = [stage(s).slug for s in sys.argv[1:]] or [last_backward().slug]
impls = [("sdpa_cudnn", "sdpa", "sdpa_cudnn"), *((s, model.register(s), None) for s in slugs)]
trainers = {n: model.trainer(name, b, steps=8, seed=0, dtype="bf16",
                             **{k: v for k, v in T.items() if k != "steps"})
            for n, name, b in impls[:2]}
for i in range(3):  # warm: every kernel built and tuned before the profile
    for run in trainers.values():
        run.step(i)
for n, run in trainers.items():
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(3, 6):
            run.step(i)
        torch.cuda.synchronize()
    total = collections.Counter()
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            total[evt.name[:90]] += evt.time_range.elapsed_us() / 3e3
    print(f"== {n}: GPU busy {sum(total.values()):.2f} ms a step", flush=True)
    for name, ms in total.most_common(22):
        print(f"{ms:8.3f} ms  {name}")
impls.append(("sdpa_flash", "sdpa", "sdpa_flash"))
for rep in range(3):
    res = model.train_in_turn([(name, b) for _, name, b in impls], steps=30,
                              **{k: v for k, v in T.items() if k != "steps"})
    print("in turn:", {n: round(r["step_ms"], 2) for (n, _, _), r in zip(impls, res)}, flush=True)
