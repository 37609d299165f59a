"""Timing: warm up, flush L2 between repetitions, report the median (and p20/p80) of at least 20
CUDA-event-timed runs, and time again where two timings disagree.

The runs are queued behind a GPU sleep, so that the GPU is still busy with earlier work while the
host prepares each call, and a run the GPU had to wait for (its start event already passed when the
call had been queued) is dropped: such a run times the host's launch work, not the kernel.
triton.testing.do_bench queues the same flush / event / call sequence without that guard; with host
work per call close to the kernel's time (flashlab's wrapper took about 0.1 ms on the H100's host
when this was measured, and takes 24-60 us now, against a 0.05 ms kernel and a 0.09 ms flush), its
medians came out bimodal, 0.052 or 0.075 ms for the same kernel."""
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .configs import Config, tflops
from .reference import reference, rel_err


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


def host_ms(fn, calls=50, rounds=5, device="cuda") -> float:
    """The host's own time for one call of fn in milliseconds: how long a call takes to return
    (its work queued, the GPU not waited for), the median of `calls` calls in a row, the least of
    `rounds` such medians (what the call costs when nothing else on the host interrupts it, as
    timeit reports). Each round queues behind a GPU sleep, so the GPU never waits and no call
    finds the launch queue drained or full: what is left is the Python and the driver calls."""
    warm(fn, device, ms=0, calls=3)
    best = math.inf
    for _ in range(rounds):
        _gpu_sleep(min(MAX_SLEEP_MS, max(1.0, calls * 0.4)), device)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize(device)
        best = min(best, statistics.median(times))
    return best * 1e3


def _estimate_ms(fn, device):
    """(GPU milliseconds, host milliseconds) of one flushed call: the events' time, and the time
    the host takes to queue flush, events and call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    _flush_l2(device)
    start.record()
    fn()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    return max(start.elapsed_time(end), 1e-3), host_ms


# Runs are queued in batches of BATCH behind a GPU sleep long enough for the host to queue them
# all (SLEEP_CYCLES_PER_MS assumes a 2 GHz clock; a slower clock only sleeps longer); where the
# GPU still had to wait, the next batch's sleep is doubled, up to MAX_SLEEP_MS; a batch behind that
# longest sleep in which the GPU still waited for most runs ends the timing (a callable with more
# host work than the sleep covers, such as a model's whole forward pass). A timing asks for
# a budget of RUN_BUDGET_MS (QUICK_BUDGET_MS for a quick check) of runs, at least min_runs and at
# most MAX_RUNS.
BATCH = 20
SLEEP_CYCLES_PER_MS = 2_000_000
RUN_BUDGET_MS, QUICK_BUDGET_MS, MAX_RUNS = 100.0, 25.0, 1000
MAX_SLEEP_MS = 50.0


def _gpu_sleep(ms, device):
    """Keep the GPU busy for about ms (torch.cuda._sleep spins for a number of clock cycles); where
    this torch has no such call, the runs the GPU waited for are still dropped."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        with torch.cuda.device(device):
            sleep(int(ms * SLEEP_CYCLES_PER_MS))


def _queued_bench(fn, runs, device, host_ms=0.1) -> Timing:
    """Median / p20 / p80 of `runs` flushed, event-timed calls the GPU never waited for. Each
    batch of calls is queued behind a GPU sleep; a call whose start event has already passed when
    the call has been queued (the GPU went idle waiting for the host) is not kept. Where too few
    calls could be kept (fewer than min(runs, 20): a callable that waits for the GPU itself), every
    call is, and the note says so."""
    return _queued_many({"": fn}, runs, device, host_ms)[""]


def _queued_many(fns: dict, runs, device, host_ms=0.1, first=0) -> dict:
    """_queued_bench for several callables at once, run by run in turn (a, b, c, a, b, c, ...,
    the order rotating from batch to batch), so that whatever the GPU's clock does while they are
    timed, it does to all of them: {name: Timing}. host_ms: the host time of one call of each;
    first: where in the list of names the rotation starts."""
    sleep_ms = min(max(1.0, 2 * BATCH * host_ms * len(fns)), MAX_SLEEP_MS)
    names = list(fns)
    kept = {n: [] for n in names}
    waited = {n: [] for n in names}
    for batch in range(4 * math.ceil(runs / BATCH) + 4):
        if min(len(k) for k in kept.values()) >= runs:
            break
        at = (batch + first) % len(names)
        order = names[at:] + names[:at]
        queued = []
        _gpu_sleep(sleep_ms, device)
        for _ in range(BATCH):
            for name in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _flush_l2(device)
                start.record()
                fns[name]()
                ahead = not start.query()  # the GPU had not reached the call: it never waited
                end.record()
                queued.append((name, start, end, ahead))
        queued[-1][2].synchronize()
        for name, start, end, ok in queued:
            (kept if ok else waited)[name].append(start.elapsed_time(end))
        if 2 * sum(ok for *_, ok in queued) < len(queued) and sleep_ms >= MAX_SLEEP_MS:
            break  # the longest head start did not help: the host is what takes the time
        if not all(ok for *_, ok in queued):
            sleep_ms = min(2 * sleep_ms, MAX_SLEEP_MS)
    out = {}
    for name in names:
        k, w, note = kept[name], waited[name], ""
        if len(k) < min(runs, 20):
            k, note = k + w, f"the GPU waited for the host in {len(w)} runs; all kept"
        elif w:
            note = f"{len(w)} runs dropped: the GPU waited for the host"
        qs = statistics.quantiles(k, n=10, method="inclusive")  # a batch is BATCH runs: >= 2
        out[name] = Timing(statistics.median(k), qs[1], qs[7], len(k),
                           "cuda events, queued" + (", in turn run by run" if len(fns) > 1 else ""),
                           note=note)
    return out


def _timing(fn, min_runs, device) -> Timing:
    """One timing of an already warm fn: median / p20 / p80 of at least min_runs runs, as many
    as fit a time budget (the GPU time of one call estimated first)."""
    estimate, host_ms = _estimate_ms(fn, device)
    budget = QUICK_BUDGET_MS if min_runs <= QUICK_RUNS else RUN_BUDGET_MS
    return _queued_bench(fn, _runs_for(estimate, min_runs, budget), device, host_ms)


def _runs_for(estimate_ms, min_runs, budget_ms=RUN_BUDGET_MS) -> int:
    """How many runs a timing takes: as many as fit the budget, at least min_runs, at most
    MAX_RUNS."""
    return min(MAX_RUNS, max(min_runs, int(budget_ms / estimate_ms)))


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
    t.warmup_runs, t.retimes, t.note = warmup, retimes, "; ".join(filter(None, [*notes, t.note]))
    return t


# Callables compared in one run (the stages and SDPA's backends over the sweep) are timed together
# at each config, run by run in turn, ROUNDS times over: at long sequences the GPU's clock moves by
# 5-10 % between timings a few seconds apart, and even within one, and what moved between two
# kernels timed apart would be read as a difference between them. Each keeps its median round.
ROUNDS = 3


def time_interleaved(fns: dict, rounds=ROUNDS, min_runs=20, device="cuda") -> dict:
    """{name: Timing}: every fn warmed, then timed run by run in turn with the others (one queued
    stream: a, b, c, a, b, c, ...; bench._queued_many), `rounds` times over; each keeps the round
    with its median time, and its note lists every round's median."""
    if not fns:
        return {}
    warmups = {name: warm(fn, device) for name, fn in fns.items()}
    estimates = {name: _estimate_ms(fn, device) for name, fn in fns.items()}
    runs = _runs_for(max(gpu for gpu, _ in estimates.values()), min_runs)
    host_ms = max(host for _, host in estimates.values())
    seen = {name: [] for name in fns}
    for r in range(rounds):
        for name, t in _queued_many(fns, runs, device, host_ms, first=r).items():
            seen[name].append(t)
    out = {}
    for name, ts in seen.items():
        t = sorted(ts, key=lambda x: x.median_ms)[(len(ts) - 1) // 2]
        rounds_note = (f"the median of {len(ts)} rounds: " + ", ".join(f"{x.median_ms:.4g}" for x in ts)
                       + " ms")
        out[name] = Timing(t.median_ms, t.p20_ms, t.p80_ms, t.runs,
                           t.timer + (f", {len(ts)} rounds" if len(ts) > 1 else ""),
                           warmups[name], 0,
                           "; ".join(filter(None, [rounds_note if len(ts) > 1 else "", t.note])))
    return out


def error_at(attn, config: Config, inputs, ref) -> float:
    """attn's relative error against the float64 reference `ref`, into an output poisoned with
    NaN first (an element it never writes cannot pass)."""
    q, k, v = inputs
    out = torch.full_like(q, math.nan)
    return rel_err(attn(q, k, v, causal=config.causal, out=out), ref)


def timing_row(config: Config, t: Timing, pass_="forward") -> dict:
    """A timing as a results row's values: the Timing's fields and TFLOP/s at its p20/median/p80
    (FLOPs of `pass_`: the backward counts 2.5 times the forward's)."""
    row = t.as_dict()
    row["tflops"] = tflops(config, t.median_ms, pass_)
    row["tflops_p20"] = tflops(config, t.p80_ms, pass_)  # the slower time gives the lower rate
    row["tflops_p80"] = tflops(config, t.p20_ms, pass_)
    return row


def backward_fn(attn, q, k, v, causal=False, do=None):
    """A callable that runs attn's backward alone at (q, k, v), as FlashAttention times it: the
    forward runs once here, with grad on, and each call takes the gradients of sum(o ∘ do) from
    the graph it keeps (retain_graph). ValueError where attn's output carries no gradient (a
    stage without a backward refuses sooner, saying so)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        o = attn(*leaves, causal=causal)
    if not o.requires_grad:
        raise ValueError(f"{getattr(attn, '__name__', attn)}: its output carries no gradient, "
                         f"so it has no backward to time")
    do = torch.randn_like(o) if do is None else do
    fn = lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)  # noqa: E731
    fn.do = do  # the gradient it takes: what a caller checks the result against
    return fn


def bench_backward(attn, config: Config, min_runs=20, device="cuda", seed=0, inputs=None) -> dict:
    """Time attn's backward alone at config (backward_fn): ms and TFLOP/s, the FLOPs counted as
    FlashAttention counts the backward's (2.5 times the forward's, half of it causal)."""
    q, k, v = inputs if inputs is not None else config.inputs(device, seed)
    t = time_fn(backward_fn(attn, q, k, v, config.causal), min_runs, device)
    return timing_row(config, t, pass_="backward")


def bench(attn, config: Config, min_runs=20, device="cuda", with_error=True, seed=0,
          inputs=None, ref=None) -> dict:
    """Time attn at config; returns ms, TFLOP/s and (with_error) the relative error there.

    inputs / ref let several functions share one set of inputs and one float64 reference."""
    q, k, v = inputs = inputs if inputs is not None else config.inputs(device, seed)
    row = {}
    if with_error:
        if ref is None:
            ref = reference(q, k, v, causal=config.causal)
        row["rel_err"] = error_at(attn, config, inputs, ref)
    t = time_fn(lambda: attn(q, k, v, causal=config.causal), min_runs, device)
    row.update(timing_row(config, t))
    return row
