"""Build, check, time and record: what `flashlab run` does for each stage and for the baselines,
and what each notebook calls for its own stage."""
import pandas as pd
import torch

from . import baselines as _baselines
from . import ptxas
from .bench import bench, sweep, teaching
from .check import FP32_TOL, check
from .env import environment
from .reference import reference
from .stages import Stage
from .tables import CHECKS, RESULTS
# Baselines that hold the N x N scores in memory are skipped past this N (tens of GB).
MATERIALISING = ("sdpa_math", "torch_naive")
MAX_N_MATERIALISED = 8192


def configs_for(st: Stage):
    """The standard configs a stage is timed at: the teaching config in each of its dtypes, and
    for the fast stages the FlashAttention paper's sweep at its head dims."""
    out = []
    for dt in st.dtypes:
        out.append(teaching(dt))
        if st.fast:
            out += sweep(dt, st.head_dims)
    return out


def baseline_configs(with_sweep=True):
    return [teaching("fp32"), teaching("fp16")] + (sweep("fp16") if with_sweep else [])


def _row(name, kind, cfg, env, **values):
    row = dict(stage=name, kind=kind, dtype=cfg.dtype, B=cfg.B, H=cfg.H, N=cfg.N, D=cfg.D,
               causal=cfg.causal, **env)
    row.update(values)
    return row


def measure_stage(st: Stage, configs=None, record=True, log=print, attn=None):
    """Check the stage, then time it at `configs` (default: configs_for(st)) unless the check
    failed. Returns (CheckResult, DataFrame of the rows), which are also recorded in data/."""
    env = environment()
    configs = configs_for(st) if configs is None else configs
    def res_at(cfg):
        try:
            cc = tuple(int(x) for x in env["compute_capability"].split("."))
            return ptxas.summary(st, st.arch(cc), cfg)
        except (OSError, RuntimeError, LookupError) as err:
            log(f"{st.slug}: no ptxas report ({err})")
            return {}

    attn = attn or st.build()
    missing = st.unavailable_dtypes()  # stage 04 on a T4: bf16 needs compute capability 8.0
    for why in missing.values():
        log(f"{why}: not checked or timed here")
    configs = [cfg for cfg in configs if cfg.dtype not in missing]
    chk = check(attn)
    log(str(chk))
    if record:
        CHECKS.upsert([dict(stage=st.slug, **c, **env) for c in chk.rows()])
    rows = []
    for cfg in configs:
        if not chk.passed:
            rows.append(_row(st.slug, "stage", cfg, env, status="failed check", **res_at(cfg),
                             note=f"not timed: check failed, max rel err {chk.max_rel_err:.2e}"))
            continue
        try:
            m = bench(attn, cfg)
            # the check above is the real test; this guards the timed config itself
            status = "ok" if m["rel_err"] <= (FP32_TOL if cfg.dtype == "fp32" else 1e-2) else "failed check"
            rows.append(_row(st.slug, "stage", cfg, env, status=status, **m, **res_at(cfg)))
            log(f"{st.slug:16} {cfg.label:42} {m['median_ms']:10.3f} ms {m['tflops']:8.2f} TFLOP/s"
                f"  rel_err {m['rel_err']:.1e}")
        except ValueError as err:
            log(f"{st.slug}: {cfg.label}: {err}")
    df = pd.DataFrame(rows)
    if record and rows:
        RESULTS.upsert(df)
    return chk, df


def measure_baselines(configs=None, names=_baselines.NAMES, record=True, log=print):
    """Time PyTorch's implementations at `configs` (default: baseline_configs()), on the same
    inputs and against the same reference, config by config."""
    env = environment()
    rows = []
    for cfg in configs or baseline_configs():
        inputs = cfg.inputs()
        ref = reference(*inputs, causal=cfg.causal)
        for name in names:
            if name in MATERIALISING and cfg.N > MAX_N_MATERIALISED:
                continue
            try:
                m = bench(_baselines.Baseline(name), cfg, inputs=inputs, ref=ref)
            except RuntimeError as err:  # backend refuses this dtype/shape, or out of memory
                log(f"{name:16} {cfg.label:42} skipped: {str(err).splitlines()[0][:100]}")
                torch.cuda.empty_cache()
                continue
            rows.append(_row(name, "baseline", cfg, env, status="ok", **m))
            log(f"{name:16} {cfg.label:42} {m['median_ms']:10.3f} ms {m['tflops']:8.2f} TFLOP/s"
                f"  rel_err {m['rel_err']:.1e}")
        del inputs, ref
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    if record and rows:
        RESULTS.upsert(df)
    return df

