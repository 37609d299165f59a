"""A small, made-up data/profile.csv for tests: every column of flashlab.profile_schema, the
teaching config of each stage plus rows the figures must ignore (another config, a baseline).
The numbers are invented to move the way each stage's idea should; they are never measured,
so this is written only into temporary data directories, never into data/."""
import pandas as pd

from flashlab import profile_schema
from flashlab.configs import teaching
from flashlab.stages import stages

# metric -> value per stage, in stage order (01, 02, 03, ...); the last value repeats.
INVENTED = {
    "duration_ms": [90.0, 40.0, 0.6],
    "dram_throughput_pct": [12.0, 30.0, 8.0],
    "dram_bytes": [4.0e9, 1.5e9, 6.0e7],
    "sm_throughput_pct": [20.0, 35.0, 80.0],
    "tensor_pipe_pct": [0.0, 0.0, 0.0],
    "achieved_occupancy_pct": [25.0, 60.0, 30.0],
    "global_load_sectors_per_request": [32.0, 4.0, 4.0],
    "global_store_sectors_per_request": [32.0, 4.0, 4.0],
    "smem_load_bank_conflicts": [2.0e5, 1.6e6, 0.0],   # 0: padding removes every conflict
    "smem_store_bank_conflicts": [1.0e4, 5.0e4, 0.0],
    "stall_long_scoreboard": [60.0, 40.0, 10.0],
    "stall_barrier": [5.0, 20.0, 15.0],
    "stall_short_scoreboard": [2.0, 15.0, 20.0],
    "stall_mio_throttle": [1.0, 8.0, 25.0],
    "stall_math_pipe_throttle": [0.5, 1.0, 12.0],
    "stall_wait": [3.0, 4.0, 6.0],
    "stall_not_selected": [1.0, 1.0, 5.0],
    "stall_lg_throttle": [20.0, 6.0, 0.5],
}


def rows(gpu, env=None):
    env = dict(compute_capability="9.0", torch="2.0.0+synthetic", cuda="12.0",
               commit="0000000000", time="2000-01-01T00:00:00Z", **(env or {}))
    out = []
    for i, st in enumerate(stages()):
        cfg = teaching(st.dtypes[0])
        for metric, values in INVENTED.items():
            unit = profile_schema.METRICS.get(metric, ("%",))[0]
            out.append(dict(stage=st.slug, dtype=cfg.dtype, B=cfg.B, H=cfg.H, N=cfg.N, D=cfg.D,
                            causal=cfg.causal, gpu=gpu, metric=metric,
                            value=values[min(i, len(values) - 1)], unit=unit,
                            ncu_metric="synthetic", **env))
    # rows the teaching-config figures must not pick up: another N, and a baseline
    decoy = dict(out[0], N=4096, value=1.0e9)
    baseline = dict(out[0], stage="sdpa_efficient", value=1.0e9)
    return pd.DataFrame(out + [decoy, baseline], columns=profile_schema.COLUMNS)


def write(data_dir, gpu):
    path = data_dir / "profile.csv"
    rows(gpu).to_csv(path, index=False)
    return path
