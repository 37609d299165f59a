# The harness of backward-22-short-diag-h200-20261201T0352Z.log (variants written by its -mkvar.py into .s22/var/). The T0349Z run used an earlier version of this file: the same builds and kernel timings, checks of the v22_kfirst candidate, and its ratios printed in place of v23's.
"""Short sequences: where stage 22's main kernel spends its fixed cost a block (timing-only
variants, kernel times from torch.profiler), and one candidate (K first, V on its own barrier)
checked and timed in turn against 22 and cuDNN."""
import collections, dataclasses, sys, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
import flashlab as fl
from flashlab import build
from flashlab.baselines import Baseline
from flashlab.bench import backward_fn, time_interleaved
from flashlab.check import check_backward
from flashlab.runtime import Attention
from flashlab.stages import stage

print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, flush=True)
st22 = stage("22")
from concurrent.futures import ThreadPoolExecutor
files = [f for f in sorted(Path(".s22/var").glob("*.cu")) if not f.name.startswith("unused")]
t = time.time()
with ThreadPoolExecutor(len(files) + 1) as ex:
    f22 = ex.submit(st22.build)
    mods = {f.stem: ex.submit(build.build_module, f, False, "sm_90a") for f in files}
    impls = {"22": f22.result()}
    for n, m in mods.items():
        impls[n] = Attention(dataclasses.replace(st22, slug=n), m.result())
print(f"built {len(impls)} in {time.time() - t:.0f} s", flush=True)
for name, a in impls.items():
    if name.startswith("v2"):
        from flashlab.check import check_training
        for dt in ("fp16", "bf16"):
            for chk in (check_backward, check_training):
                r = chk(a, dt)
                print(name, dt, chk.__name__, "PASS" if r.passed else "FAIL", f"{r.max_rel_err:.2e}", flush=True)
                if not r.passed: print(r, flush=True)
cudnn = Baseline("sdpa_cudnn")
cfgs = [(D, N, c) for D in (128, 64) for c in (False, True) for N in (512, 1024, 2048, 4096, 8192, 16384)]

def kernel_us(fn):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): fn()
        torch.cuda.synchronize()
    tot = collections.Counter()
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            tot["main" if "bwd_kernel" in e.name else ("pre" if "preprocess" in e.name else "other")] += e.time_range.elapsed_us() / 10
    return tot

for D, N, causal in cfgs:
    cfg = fl.Config(max(1, 16384 // N), 16 if D == 128 else 32, N, D, causal, "fp16")
    q, k, v = cfg.inputs("cuda", 0)
    fns = {n: backward_fn(a, q, k, v, causal) for n, a in impls.items()}
    ks = {n: kernel_us(f) for n, f in fns.items()}
    print(f"{cfg.label}: main kernel us " + "  ".join(f"{n} {t['main']:.1f}" for n, t in ks.items()), flush=True)
    real = {n: f for n, f in fns.items() if not n.startswith("timing_only")}
    real["cudnn"] = backward_fn(cudnn, q, k, v, causal)
    tm = time_interleaved(real)
    print(f"{cfg.label}: in turn ms " + "  ".join(f"{n} {t.median_ms:.4f}" for n, t in tm.items()) +
          f"  v23/22 {tm['22'].median_ms / tm['v23_tmastore'].median_ms:.3f}  22/cudnn {tm['cudnn'].median_ms / tm['22'].median_ms:.3f}"
          f"  v23/cudnn {tm['cudnn'].median_ms / tm['v23_tmastore'].median_ms:.3f}", flush=True)
    del q, k, v, fns, real
