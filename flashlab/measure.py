"""Build, check, time and record: what `flashlab run` does for each stage and for the baselines,
and what each notebook calls for its own stage."""
import warnings

import pandas as pd
import torch

from . import baselines as _baselines
from . import ptxas
from .bench import ROUNDS, backward_fn, bench, error_at, time_interleaved, timing_row
from .configs import sweep, teaching
from .dtypes import HALF
from .check import FP32_TOL, check, promised_checks
from .env import environment
from .reference import grad_err, reference, reference_backward
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


def timed_tolerance(cfg) -> float:
    """The error a timed config may show: the check is the real test, this guards the config."""
    return FP32_TOL if cfg.dtype == "fp32" else 1e-2


def _ptxas_at(st, env, log):
    """A function of a config (and lse: the forward asked for the log-sum-exp): the ptxas report's
    registers and spills of the kernel timed there."""
    def at(cfg, lse=False):
        try:
            cc = tuple(int(x) for x in env["compute_capability"].split("."))
            return ptxas.summary(st, st.arch(cc), cfg, lse=lse)
        except (OSError, RuntimeError, LookupError) as err:
            log(f"{st.slug}: no ptxas report ({err})")
            return {}
    return at


def _not_timed(st, cfg, env, chk, res_at):
    return _row(st.slug, "stage", cfg, env, status="failed check", **res_at(cfg),
                note=f"not timed: check failed, max rel err {chk.max_rel_err:.2e}")


def _timed_line(name, cfg, row):
    return (f"{name:16} {cfg.label:42} {row['median_ms']:10.3f} ms {row['tflops']:8.2f} TFLOP/s"
            f"  rel_err {row['rel_err']:.1e}")


def _times_at(name, cfg) -> bool:
    """Whether a baseline is timed at cfg: those that hold the N x N scores stop at
    MAX_N_MATERIALISED."""
    return not (name in MATERIALISING and cfg.N > MAX_N_MATERIALISED)


def _refused(name, cfg, err, log):
    """A backend refused this dtype or shape, or ran out of memory: say so and free its memory."""
    log(f"{name:16} {cfg.label:42} skipped: {str(err).splitlines()[0][:100]}")
    torch.cuda.empty_cache()


def _keep(rows, record, frames):
    """A config's rows, recorded as soon as the config is done: a run killed later loses none."""
    if rows:
        df = pd.DataFrame(rows)
        if record:
            RESULTS.upsert(df)
        frames.append(df)


def _joined(frames):
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _row(name, kind, cfg, env, **values):
    row = dict(stage=name, kind=kind, dtype=cfg.dtype, B=cfg.B, H=cfg.H, N=cfg.N, D=cfg.D,
               causal=cfg.causal, **env)
    row.update(values)
    return row


def measure_stage(st: Stage, configs=None, record=True, log=print, attn=None, untimed=()):
    """Check the stage, then time it at `configs` (default: configs_for(st)) unless the check
    failed. Returns (CheckResult, DataFrame of the rows), which are also recorded in data/.
    untimed: configs timed elsewhere (measure_interleaved) that still get a "failed check" row
    here if the check fails, so that no earlier timing of a now wrong kernel stands."""
    env = environment()
    configs = configs_for(st) if configs is None else configs
    res_at = _ptxas_at(st, env, log)
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
    if not chk.passed:
        rows = [_not_timed(st, cfg, env, chk, res_at)
                for cfg in [*configs, *(c for c in untimed if c.dtype not in missing)]]
    for cfg in configs if chk.passed else ():
        try:
            m = bench(attn, cfg)
            status = "ok" if m["rel_err"] <= timed_tolerance(cfg) else "failed check"
            rows.append(_row(st.slug, "stage", cfg, env, status=status, **m, **res_at(cfg)))
            log(_timed_line(st.slug, cfg, m))
        except ValueError as err:
            log(f"{st.slug}: {cfg.label}: {err}")
    df = pd.DataFrame(rows)
    if record and rows:
        RESULTS.upsert(df)
    return chk, df


def interleaved_configs(stages, with_baselines=True):
    """The configs measure_interleaved times: every sweep config of the stages (fp16 first), and
    the baselines' fp16 sweep."""
    out = list(sweep("fp16")) if with_baselines else []
    for st in stages:
        out += [c for c in configs_for(st) if c != teaching(c.dtype) and c not in out]
    return sorted(out, key=lambda c: (c.dtype != "fp16", c.dtype, c.D, c.causal, c.N))


def by_shape(configs):
    """configs grouped by shape (B, H, N, D, mask), a group's dtypes in the order given, the groups
    in the order of their first config: what measure_interleaved times together."""
    groups = {}
    for c in configs:
        groups.setdefault((c.B, c.H, c.N, c.D, c.causal), []).append(c)
    return list(groups.values())


def measure_interleaved(stages, configs=None, baselines=_baselines.COMPARED, rounds=ROUNDS,
                        record=True, log=print, lse=False):
    """Time the (already checked) stages and the baselines shape by shape, in turn, `rounds`
    times over (bench.time_interleaved), on one set of inputs and one float64 reference per
    config, so that their ratios hold within one run. The dtypes of one shape (fp16 and bf16) are
    timed together too, so a stage's bf16 against its fp16 is a ratio of the same run. A stage is
    timed at the configs it takes, a baseline at the fp16 ones (fp16 against fp16); each shape's
    rows are recorded as soon as it is done. configs: default interleaved_configs(stages,
    bool(baselines)): the stages' sweeps and the fp16 sweep. lse: each stage that can return the
    log-sum-exp is also timed asked for it, in the same turn (rows of pass "forward_lse", the
    kernel that writes it: what asking costs)."""
    env = environment()
    built = [(st, st.build(), _ptxas_at(st, env, log)) for st in stages]
    frames = []
    chosen = configs if configs is not None else interleaved_configs(stages, bool(baselines))
    for group in by_shape(chosen):
        fns, rows, kinds = {}, [], {}
        for cfg in group:
            inputs = cfg.inputs()
            ref = reference(*inputs, causal=cfg.causal)
            here = []
            for st, attn, res_at in built:
                if not st.takes(cfg) or cfg.dtype in st.unavailable_dtypes():
                    continue
                try:
                    err = error_at(attn, cfg, inputs, ref)
                except ValueError as e:
                    log(f"{st.slug}: {cfg.label}: {e}")
                    continue
                if not err <= timed_tolerance(cfg):
                    rows.append(_row(st.slug, "stage", cfg, env, status="failed check", rel_err=err,
                                     **res_at(cfg), note=f"not timed: rel err {err:.2e} here"))
                    log(f"{st.slug:16} {cfg.label:42} FAILED: rel err {err:.2e}")
                    continue
                here.append((st.slug, attn, ("stage", err, res_at(cfg)),
                             ("stage", err, res_at(cfg, lse=True)) if lse and st.lse else None))
            for name in baselines if cfg.dtype == "fp16" else ():  # fp16 against fp16
                if not _times_at(name, cfg):
                    continue
                b = _baselines.Baseline(name)
                try:
                    err = error_at(b, cfg, inputs, ref)
                except RuntimeError as e:
                    _refused(name, cfg, e, log)
                    continue
                here.append((name, b, ("baseline", err, {}), None))
            q, k, v = inputs
            for name, f, kind, lse_kind in here:  # lse_kind: also timed asked for the lse
                fns[(name, cfg, "forward")] = lambda f=f, q=q, k=k, v=v, c=cfg.causal: f(q, k, v,
                                                                                      causal=c)
                kinds[(name, cfg, "forward")] = kind
                if lse_kind:
                    fns[(name, cfg, "forward_lse")] = (lambda f=f, q=q, k=k, v=v, c=cfg.causal:
                                                       f(q, k, v, causal=c, return_lse=True))
                    kinds[(name, cfg, "forward_lse")] = lse_kind
        timings = time_interleaved(fns, rounds)
        for (name, cfg, pass_), t in timings.items():
            kind, err, res = kinds[(name, cfg, pass_)]
            m = dict(rel_err=err, **timing_row(cfg, t, pass_))
            rows.append(_row(name, kind, cfg, env, status="ok", **m, **res, **{"pass": pass_}))
            log((f"{pass_:11} " if lse else "") + _timed_line(name, cfg, m))
        del fns, inputs, ref, q, k, v
        torch.cuda.empty_cache()
        _keep(rows, record, frames)
    return _joined(frames)


def measure_baselines(configs=None, names=_baselines.NAMES, record=True, log=print):
    """Time PyTorch's implementations at `configs` (default: baseline_configs()), on the same
    inputs and against the same reference, config by config; each config's rows are recorded as
    soon as it is done."""
    env = environment()
    frames = []
    for cfg in configs or baseline_configs():
        here = [n for n in names if _times_at(n, cfg)]
        if not here:
            continue
        inputs = cfg.inputs()
        ref = reference(*inputs, causal=cfg.causal)
        rows = []
        for name in here:
            try:
                m = bench(_baselines.Baseline(name), cfg, inputs=inputs, ref=ref)
            except RuntimeError as err:
                _refused(name, cfg, err, log)
                continue
            rows.append(_row(name, "baseline", cfg, env, status="ok", **m))
            log(_timed_line(name, cfg, m))
        del inputs, ref
        torch.cuda.empty_cache()
        _keep(rows, record, frames)
    return _joined(frames)


# --- the backward pass -----------------------------------------------------------------------------

def backward_configs(st: Stage):
    """The configs a stage's backward is timed at: the teaching config in each of its dtypes
    (fp16 and bf16), causal and not, and for a fast stage the fp16 sweep."""
    out = []
    for dt in st.dtypes:
        t = teaching(dt)
        out += [t, type(t)(t.B, t.H, t.N, t.D, True, t.dtype)]
    if st.fast:
        out += [c for c in sweep("fp16", st.head_dims) if c not in out]
    return out


def _backward_error(fn, cfg, inputs) -> float:
    """The largest relative error of dq, dk, dv (fn: a backward_fn) against float64, on the first
    (batch, head) of the timed inputs: the check is the real test, this guards the config."""
    q, k, v = inputs
    grads = fn()
    do = fn.do
    one = [t[:1, :1] for t in (q, k, v, do)]
    refs = reference_backward(*one, causal=cfg.causal)
    floor = 0.1 * max(float(r.norm()) for r in refs)
    return max(grad_err(g[:1, :1], r, floor) for g, r in zip(grads, refs))


def measure_backward(stages, configs=None, baselines=_baselines.COMPARED, rounds=ROUNDS,
                     record=True, log=print):
    """Check and time the backward passes of `stages` (those with one) beside `baselines`'
    backwards (SDPA's flash and cuDNN, in the config's own dtype: fp16 against fp16, bf16
    against bf16), config by config, run by run in turn
    (bench.time_interleaved, each callable the backward alone: bench.backward_fn), and the
    stage's forward with and without the log-sum-exp; rows of pass "backward" and "forward_lse"
    ("forward" beside them, timed in the same turn), each config's rows recorded as soon as it is
    done. Each stage is first checked for what it promises (check.promised_checks: its
    gradients and lse against float64, and a deterministic one's same bits on every run).
    Returns (the check results, the rows). A stage whose check fails is not timed; it gets a
    "failed check" row at each config instead. configs: default backward_configs of each."""
    env = environment()
    stages = [st for st in stages if st.has_backward]
    with warnings.catch_warnings():
        # autograd runs backwards on threads of its own, where cuBLAS (the float64 reference) finds
        # no current context and warns while it sets the primary one: nothing is wrong
        warnings.filterwarnings("ignore",
                                message="Attempting to run cuBLAS, but there was no current")
        built, checks = [], []
        for st in stages:
            attn = st.build()
            dtypes = [d for d in st.dtypes if d not in st.unavailable_dtypes()]
            passed = True
            for dt in dtypes:
                for run in promised_checks(st):  # the gradients, the lse, the same bits
                    chk = run(attn, dtype=dt)
                    log(str(chk).splitlines()[0])
                    checks.append(chk)
                    passed &= chk.passed
            built.append((st, attn, passed, _ptxas_at(st, env, log)))
        chosen = configs if configs is not None else [
            c for st in stages for c in backward_configs(st)]
        chosen = list(dict.fromkeys(chosen))  # in order, once each
        frames = []
        for cfg in chosen:
            inputs = cfg.inputs()
            q, k, v = inputs
            fns, kinds, rows = {}, {}, []
            for st, attn, passed, res_at in built:
                if not st.takes(cfg) or cfg.dtype in st.unavailable_dtypes():
                    continue
                if not passed:
                    rows.append(_row(st.slug, "stage", cfg, env, status="failed check",
                                     note="not timed: a check of its backward, lse or repeatability failed",
                                     **{"pass": "backward"}))
                    continue
                fn = backward_fn(attn, q, k, v, cfg.causal)
                err = _backward_error(fn, cfg, inputs)
                if not err <= timed_tolerance(cfg):
                    rows.append(_row(st.slug, "stage", cfg, env, status="failed check", rel_err=err,
                                     note=f"not timed: gradient rel err {err:.2e} here",
                                     **{"pass": "backward"}))
                    log(f"{st.slug:16} {cfg.label:42} backward FAILED: rel err {err:.2e}")
                    continue
                fns[(st.slug, "backward")] = fn
                kinds[(st.slug, "backward")] = ("stage", err, res_at(cfg))
                fns[(st.slug, "forward")] = (
                    lambda a=attn, c=cfg.causal, q=q, k=k, v=v: a(q, k, v, causal=c))
                fns[(st.slug, "forward_lse")] = (
                    lambda a=attn, c=cfg.causal, q=q, k=k, v=v:
                    a(q, k, v, causal=c, return_lse=True))
                for p in ("forward", "forward_lse"):
                    kinds[(st.slug, p)] = ("stage", float("nan"), res_at(cfg, p == "forward_lse"))
            for name in baselines if cfg.dtype in HALF and fns else ():  # the stage's dtype
                try:
                    fn = backward_fn(_baselines.Baseline(name), q, k, v, cfg.causal)
                    err = _backward_error(fn, cfg, inputs)
                except RuntimeError as e:
                    _refused(name, cfg, e, log)
                    continue
                fns[(name, "backward")] = fn
                kinds[(name, "backward")] = ("baseline", err, {})
            for (name, pass_), t in time_interleaved(fns, rounds).items():
                kind, err, res = kinds[(name, pass_)]
                m = dict(rel_err=err, **timing_row(cfg, t, pass_))
                rows.append(_row(name, kind, cfg, env, status="ok", **m, **res, **{"pass": pass_}))
                log(f"{pass_:11} " + _timed_line(name, cfg, m))
            del fns, inputs, q, k, v
            torch.cuda.empty_cache()
            _keep(rows, record, frames)
    return checks, _joined(frames)
