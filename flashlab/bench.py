"""Timing: warm up, flush L2 between repetitions, report the median (and p20/p80) of at least 20
CUDA-event-timed runs, and time again where two timings disagree. triton.testing.do_bench does
the timing where triton is installed (it ships with CUDA builds of torch); the fallback below does
the same by hand."""
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from .inputs import dtype_of
from .reference import reference, rel_err


@dataclass(frozen=True)
class Config:
    B: int
    H: int
    N: int
    D: int
    causal: bool = False
    dtype: str = "fp32"

    @property
    def flops(self) -> float:
        return flops(self.B, self.H, self.N, self.D, self.causal)

    @property
    def label(self) -> str:
        return f"B={self.B} H={self.H} N={self.N} D={self.D} {self.dtype}" + \
               (" causal" if self.causal else "")

    def inputs(self, device="cuda", seed=0):
        """Random q, k, v for this config (never zeros: they hide unwritten output)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return tuple(torch.randn(self.B, self.H, self.N, self.D, generator=gen, device=device,
                                 dtype=dtype_of(self.dtype)) for _ in range(3))


def flops(B, H, N, D, causal=False) -> float:
    """4·B·H·N²·D (two matmuls of 2·N²·D each), half of it when causal."""
    f = 4.0 * B * H * N * N * D
    return f / 2 if causal else f


def tflops(config: Config, ms: float) -> float:
    return config.flops / (ms * 1e-3) / 1e12


# The teaching config: small enough that stage 01 runs in well under a second.
TEACHING = Config(B=4, H=16, N=1024, D=64, causal=False, dtype="fp32")


class Sweep(NamedTuple):
    tokens: int       # B·N
    width: int        # H·D
    ns: tuple         # sequence lengths
    head_dims: tuple


# The FlashAttention paper's sweep: B·N = 16k tokens, H·D = 2048, N = 512..16k, D = 64 and 128.
SWEEP = Sweep(16384, 2048, (512, 1024, 2048, 4096, 8192, 16384), (64, 128))
SWEEP_NS = SWEEP.ns


def teaching(dtype="fp32") -> Config:
    return Config(TEACHING.B, TEACHING.H, TEACHING.N, TEACHING.D, False, dtype)


def sweep(dtype="fp16", head_dims=SWEEP.head_dims):
    """The sweep's configs in `dtype`: every N, at each head dim, causal and not."""
    return [Config(SWEEP.tokens // n, SWEEP.width // d, n, d, c, dtype)
            for d in head_dims for c in (False, True) for n in SWEEP.ns]


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    runs: int
    timer: str
    warmup_runs: int = 0   # calls before the first timing
    retimes: int = 0       # timings thrown away because they disagreed
    note: str = ""         # what the re-timing saw, if anything

    def as_dict(self):
        return asdict(self)

    @property
    def spread(self) -> float:
        """(p80 - p20) / median."""
        return (self.p80_ms - self.p20_ms) / self.median_ms


# Every callable is warmed at each config before it is timed: its first calls pay for loading,
# planning (cuDNN builds an execution plan per shape) and clocks ramping up. Then it is timed, and
# timed again quickly; where the p20-p80 spread or the two medians differ by more than AGREE, the
# timing is thrown away and taken again, at most MAX_RETIMES times.
WARMUP_MS = 100.0
WARMUP_CALLS = 10
AGREE = 0.10
MAX_RETIMES = 2
QUICK_RUNS = 10

_FLUSH = {}


def _flush_l2(device):
    """Overwrite a buffer larger than any L2 (256 MB, as do_bench does)."""
    buf = _FLUSH.get(device)
    if buf is None:
        buf = _FLUSH[device] = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=device)
    buf.zero_()


def warm(fn, device="cuda", ms=WARMUP_MS, calls=WARMUP_CALLS) -> int:
    """Call fn (waiting for each) until at least `calls` calls and `ms` milliseconds have passed;
    returns how many calls that took."""
    n, start = 0, time.perf_counter()
    while n < calls or (time.perf_counter() - start) * 1e3 < ms:
        fn()
        torch.cuda.synchronize(device)
        n += 1
    return n


def _estimate_ms(fn, device):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _flush_l2(device)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return max(start.elapsed_time(end), 1e-3)


def _events_bench(fn, runs, device):
    times = []
    for _ in range(runs):
        _flush_l2(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    qs = statistics.quantiles(times, n=10, method="inclusive")
    return Timing(statistics.median(times), qs[1], qs[7], runs, "cuda events")


def _timing(fn, min_runs, device) -> Timing:
    """One timing of an already warm fn: median / p20 / p80 of at least min_runs runs."""
    estimate = _estimate_ms(fn, device)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _events_bench(fn, min_runs, device)
    # do_bench sizes its loops from a time budget; ask for 1.5x the budget of min_runs runs.
    rep = max(25.0 if min_runs <= QUICK_RUNS else 100.0, 1.5 * min_runs * estimate)
    med, p20, p80 = do_bench(fn, warmup=max(1.0, estimate), rep=rep, quantiles=[0.5, 0.2, 0.8])
    return Timing(med, p20, p80, max(1, int(rep / estimate)), "triton.testing.do_bench")


def time_fn(fn, min_runs=20, device="cuda") -> Timing:
    """Median / p20 / p80 milliseconds of fn() on the GPU: warmed first, then timed until a
    timing has a p20-p80 spread within AGREE of its median and a quick second timing agrees with
    it within AGREE (re-timed at most MAX_RETIMES times; the Timing says what was done)."""
    warmup = warm(fn, device)
    t, retimes, notes = _timing(fn, min_runs, device), 0, []
    while True:
        quick = _timing(fn, QUICK_RUNS, device)
        off = abs(quick.median_ms / t.median_ms - 1)
        if t.spread <= AGREE and off <= AGREE:
            break
        seen = f"{t.median_ms:.4g} ms (p20-p80 spread {t.spread:.0%}, quick check {quick.median_ms:.4g} ms)"
        if retimes == MAX_RETIMES:
            notes.append(f"kept {seen}: still unsettled after {retimes} re-timings")
            break
        notes.append(f"re-timed {seen}")
        retimes += 1
        t = _timing(fn, min_runs, device)
    t.warmup_runs, t.retimes, t.note = warmup, retimes, "; ".join(notes)
    return t


def bench(attn, config: Config, min_runs=20, device="cuda", with_error=True, seed=0,
          inputs=None, ref=None) -> dict:
    """Time attn at config; returns ms, TFLOP/s and (with_error) the relative error there.

    inputs / ref let several functions share one set of inputs and one float64 reference."""
    q, k, v = inputs if inputs is not None else config.inputs(device, seed)
    row = {}
    if with_error:
        if ref is None:
            ref = reference(q, k, v, causal=config.causal)
        out = torch.full_like(q, math.nan)
        row["rel_err"] = rel_err(attn(q, k, v, causal=config.causal, out=out), ref)
        del out
    t = time_fn(lambda: attn(q, k, v, causal=config.causal), min_runs, device)
    row.update(t.as_dict())
    row["tflops"] = tflops(config, t.median_ms)
    row["tflops_p20"] = tflops(config, t.p80_ms)  # the slower time gives the lower rate
    row["tflops_p80"] = tflops(config, t.p20_ms)
    return row
