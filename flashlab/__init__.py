"""flashlab: a FlashAttention kernel built one optimisation at a time, every step measured.

    import flashlab as fl
    st = fl.stage(3)                  # or fl.stage("03_coarsened"); fl.stages() lists them all
    attn = st.build()                 # compile kernels/03_coarsened.cu (cached)
    o = attn(q, k, v, causal=False)   # (B, H, N, D) CUDA tensors
    print(fl.check(attn))             # against float64, on fresh random inputs
    fl.check_backward(attn)           # a stage with a backward: dq, dk, dv against float64
    fl.bench(attn, fl.TEACHING)       # median ms, TFLOP/s
    fl.results.load()                 # the shared table, data/results.csv (flashlab.tables)
"""
from . import tables
from .bench import bench, time_fn
from .configs import SWEEP_NS, TEACHING, Config, flops, sweep, teaching
from .check import check, check_backward, check_lse, check_repeatable, check_training
from .env import environment, gpu_available
from .measure import measure_baselines, measure_stage
from .reference import naive_attention, reference, rel_err
from .stages import Stage, stage, stages
from .tables import gpu_shown, recorded, recorded_checks, results

__all__ = [
    "Config", "SWEEP_NS", "Stage", "TEACHING", "bench", "check", "check_backward", "check_lse",
    "check_repeatable", "check_training", "environment", "flops",
    "gpu_available", "gpu_shown", "measure_baselines", "measure_stage", "naive_attention",
    "recorded", "recorded_checks", "reference", "rel_err", "results", "stage", "stages", "sweep",
    "tables", "teaching", "time_fn",
]
