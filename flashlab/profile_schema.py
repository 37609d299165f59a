"""The profile table, data/profile.csv: Nsight Compute metrics, one tidy row per (stage or
baseline, config, GPU, metric). Written by flashlab.profile; read by plots, report, notebooks.

Metric names are flashlab's own (below), each mapped from one or more ncu metrics; units are in
the `unit` column. Stall reasons are `stall_<reason>` in percent of active warp time.
"""
KEY = ["stage", "dtype", "B", "H", "N", "D", "causal", "gpu", "metric"]
COLUMNS = KEY + ["value", "unit", "ncu_metric", "compute_capability", "torch", "cuda", "commit",
                 "time"]

METRICS = {
    # flashlab name: (unit, what it says)
    "duration_ms": ("ms", "kernel time under ncu (clocks not locked)"),
    "dram_throughput_pct": ("%", "DRAM throughput, % of peak"),
    "dram_bytes": ("bytes", "bytes read from and written to DRAM"),
    "sm_throughput_pct": ("%", "SM throughput (busiest unit), % of peak"),
    "tensor_pipe_pct": ("%", "tensor-core pipe active, % of peak"),
    "achieved_occupancy_pct": ("%", "active warps per SM, % of the maximum"),
    "global_load_sectors_per_request": ("sectors", "32-byte sectors per global load request"),
    "global_store_sectors_per_request": ("sectors", "32-byte sectors per global store request"),
    "smem_load_bank_conflicts": ("count", "shared-memory load bank conflicts"),
    "smem_store_bank_conflicts": ("count", "shared-memory store bank conflicts"),
    "smem_wavefronts": ("count", "shared-memory wavefronts, loads and stores (ldmatrix too): "
                                 "the traffic itself"),
    "red_sectors_per_l2_request": ("sectors", "32-byte sectors per request of global reductions "
                                              "(RED) reaching L2: 4 when a request is a whole "
                                              "128-byte line"),
}
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "barrier", "mio_throttle", "lg_throttle",
                 "math_pipe_throttle", "wait", "not_selected", "selected", "dispatch_stall",
                 "no_instruction", "membar", "drain", "sleeping", "tex_throttle",
                 "branch_resolving", "imc_miss", "misc")
