# The script of backward-kernels-22-cudnn-h200-20261201T0331Z.log
import collections, sys, torch
from torch.profiler import ProfilerActivity, profile
import flashlab as fl
from flashlab.baselines import Baseline
from flashlab.bench import backward_fn
from flashlab.stages import stage
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
impls = {"22": stage("22").build(), "cudnn": Baseline("sdpa_cudnn")}
for D, N, causal in [(128, 512, False), (128, 512, True), (128, 1024, False), (64, 512, False), (64, 1024, False), (128, 4096, False)]:
    cfg = fl.Config(max(1, 16384 // N), 16 if D == 128 else 32, N, D, causal, "fp16")
    q, k, v = cfg.inputs("cuda", 0)
    for name, f in impls.items():
        fn = backward_fn(f, q, k, v, causal)
        for _ in range(5): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10): fn()
            torch.cuda.synchronize()
        total = collections.Counter(); cnt = collections.Counter()
        for evt in prof.events():
            if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
                total[evt.name[:80]] += evt.time_range.elapsed_us() / 10; cnt[evt.name[:80]] += 1
        print(f"== {cfg.label} {name}: {sum(total.values()):.1f} us", flush=True)
        for n, us in total.most_common(8):
            print(f"   {us:8.1f} us x{cnt[n]//10}  {n}")
