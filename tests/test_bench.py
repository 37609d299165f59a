"""FLOP counts, the standard configs, TFLOP/s, and the timing fallback's statistics (with fake
CUDA events, so they run without a GPU)."""
import importlib
import math
import random
import statistics
import sys

import pytest
import torch

import flashlab as fl
from flashlab import configs

# `flashlab.bench` is the bench() function (fl.bench(attn, cfg)); the module is flashlab.bench too
bench_mod = importlib.import_module("flashlab.bench")


@pytest.mark.parametrize("B,H,N,D", [(1, 1, 1, 1), (4, 16, 1024, 64), (2, 3, 17, 128),
                                     (1, 16, 16384, 128)])
def test_flops(B, H, N, D):
    assert fl.flops(B, H, N, D) == 4 * B * H * N * N * D
    assert fl.flops(B, H, N, D, causal=False) == 4 * B * H * N * N * D
    assert fl.flops(B, H, N, D, causal=True) == 2 * B * H * N * N * D
    cfg = fl.Config(B, H, N, D)
    assert cfg.flops == fl.flops(B, H, N, D)
    assert fl.Config(B, H, N, D, causal=True).flops == fl.flops(B, H, N, D) / 2


def test_flops_do_not_overflow():
    assert fl.flops(16, 16, 2**20, 256) == pytest.approx(4.0 * 16 * 16 * 2**40 * 256)


def test_sweep_is_the_flashattention_papers():
    configs = fl.sweep()
    assert len(configs) == 2 * 2 * 6
    assert len(set(configs)) == len(configs)
    assert fl.SWEEP_NS == (512, 1024, 2048, 4096, 8192, 16384)
    assert sorted({c.N for c in configs}) == list(fl.SWEEP_NS)
    assert {c.D for c in configs} == {64, 128}
    assert {c.causal for c in configs} == {False, True}
    for c in configs:
        assert c.B * c.N == 16384
        assert c.H * c.D == 2048
        assert c.dtype == "fp16"
    for n in fl.SWEEP_NS:
        for d in (64, 128):
            for causal in (False, True):
                assert sum(c.N == n and c.D == d and c.causal == causal for c in configs) == 1
    assert {c.dtype for c in fl.sweep("bf16")} == {"bf16"}


def test_teaching_config():
    t = fl.TEACHING
    assert (t.B, t.H, t.N, t.D, t.causal, t.dtype) == (4, 16, 1024, 64, False, "fp32")
    assert fl.teaching() == t
    half = fl.teaching("fp16")
    assert (half.B, half.H, half.N, half.D, half.causal, half.dtype) == (4, 16, 1024, 64, False, "fp16")
    assert t.label == "B=4 H=16 N=1024 D=64 fp32"
    assert fl.Config(1, 2, 3, 4, True, "bf16").label == "B=1 H=2 N=3 D=4 bf16 causal"


def test_config_inputs_on_cpu():
    cfg = fl.Config(2, 3, 17, 8, dtype="fp32")
    q, k, v = cfg.inputs(device="cpu", seed=1)
    for x in (q, k, v):
        assert x.shape == (2, 3, 17, 8) and x.dtype == torch.float32 and x.device.type == "cpu"
        assert x.abs().sum() > 0
    assert not torch.equal(q, k) and not torch.equal(k, v)
    again = cfg.inputs(device="cpu", seed=1)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = cfg.inputs(device="cpu", seed=2)
    assert not torch.equal(q, other[0])
    assert fl.Config(1, 1, 4, 4, dtype="bf16").inputs(device="cpu")[0].dtype == torch.bfloat16


def test_tflops():
    cfg = fl.Config(4, 16, 1024, 64)
    assert configs.tflops(cfg, 1.0) == pytest.approx(cfg.flops / 1e-3 / 1e12)
    assert configs.tflops(cfg, 2.0) == pytest.approx(bench_mod.tflops(cfg, 1.0) / 2)
    # 4 * 2^20 * 2^10 * ... : B=1 H=1 N=1024 D=1000 is 4.096e9 FLOP; in 1 ms, 4.096 TFLOP/s
    assert configs.tflops(fl.Config(1, 1, 1024, 1000), 1.0) == pytest.approx(4 * 1024**2 * 1000 / 1e9)


# --- the timing fallback, with CUDA events faked -------------------------------------------------

class FakeClock:
    """Stands in for torch.cuda.Event: each (start, end) pair reports the next queued time; a
    start event's query() says whether the GPU had already reached it (the next of `reached`,
    False once they run out: the GPU was always behind)."""

    def __init__(self, times, reached=()):
        self.times, self.reached, self.sleeps = list(times), list(reached), []

    def event_class(clock):
        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing

            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

            def query(self):
                return clock.reached.pop(0) if clock.reached else False

            def elapsed_time(self, end):
                return clock.times.pop(0)
        return Event


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(times, reached=()):
        clock = FakeClock(times, reached)
        monkeypatch.setattr(torch.cuda, "Event", clock.event_class())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(bench_mod, "_flush_l2", lambda device: None)
        monkeypatch.setattr(bench_mod, "_gpu_sleep", lambda ms, device: clock.sleeps.append(ms))
        return clock
    return install


def test_queued_timing_statistics(fake_cuda):
    timed = [float(i) for i in range(1, 21)]
    random.Random(0).shuffle(timed)
    clock = fake_cuda(timed)
    calls = []
    t = bench_mod._queued_bench(lambda: calls.append(1), 20, device="cpu", host_ms=0.2)
    assert clock.times == [] and len(calls) == 20
    assert t.timer == "cuda events, queued" and t.runs == 20 and t.note == ""
    assert clock.sleeps == [2 * bench_mod.BATCH * 0.2]  # one batch, behind one head start
    assert t.median_ms == pytest.approx(10.5)
    assert t.p20_ms == pytest.approx(1 + 0.2 * 19)
    assert t.p80_ms == pytest.approx(1 + 0.8 * 19)
    assert t.p20_ms <= t.median_ms <= t.p80_ms


def test_runs_the_gpu_waited_for_are_dropped_and_the_head_start_doubles(fake_cuda):
    """A run whose start event the GPU had already passed when its call was queued timed the
    host's launch work (a 0.075 ms median for a 0.052 ms kernel, with do_bench): it is dropped,
    and the next batch waits behind twice the sleep."""
    b = bench_mod.BATCH
    reached = [i % 2 == 1 for i in range(b)]  # every other run of the first batch: the GPU waited
    times = [0.075 if r else 0.052 for r in reached] + [0.052] * b
    clock = fake_cuda(times, reached)
    t = bench_mod._queued_bench(lambda: None, b, device="cpu", host_ms=0.1)
    assert clock.times == [] and clock.sleeps == [4.0, 8.0]
    assert t.runs == b + b // 2 and t.median_ms == pytest.approx(0.052)
    assert t.note == f"{b // 2} runs dropped: the GPU waited for the host"


def test_a_callable_the_gpu_always_waits_for_keeps_every_run_and_says_so(fake_cuda):
    """The head start doubles up to its cap; a batch behind the cap in which the GPU still waited
    for most runs ends the timing (a model's forward pass: more host work than any sleep covers)."""
    b = bench_mod.BATCH
    clock = fake_cuda([1.0] * b * 8, [True] * b * 8)
    t = bench_mod._queued_bench(lambda: None, b, device="cpu")
    assert clock.sleeps == [4.0, 8.0, 16.0, 32.0, bench_mod.MAX_SLEEP_MS]
    assert t.runs == b * 5 and t.median_ms == 1.0
    assert "the GPU waited for the host in 100 runs" in t.note and "all kept" in t.note
    clock = fake_cuda([1.0] * b, [True] * b)  # 30 ms of host work a call: at the cap at once
    t = bench_mod._queued_bench(lambda: None, b, device="cpu", host_ms=30.0)
    assert clock.sleeps == [bench_mod.MAX_SLEEP_MS] and t.runs == b


class SlowStart:
    """A callable whose first `slow` calls take `first` ms and the rest `then` ms (a library that
    plans on its first calls, clocks ramping up), and a stand-in for one timing of it: the
    median of the next `runs` calls' durations."""

    def __init__(self, first=0.121, then=0.047, slow=5):
        self.first, self.then, self.slow, self.calls = first, then, slow, 0

    def __call__(self):
        self.calls += 1
        return self.first if self.calls <= self.slow else self.then

    def timing(self, fn, runs, device):
        times = sorted(fn() for _ in range(runs))
        return bench_mod.Timing(statistics.median(times), times[len(times) // 5],
                                times[4 * len(times) // 5], runs, "fake")


@pytest.fixture
def no_gpu_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_each_callable_is_warmed_before_it_is_timed(monkeypatch, no_gpu_sync):
    """A baseline timed on its first calls (cuDNN at a new shape) read 0.121 ms where it runs
    0.047 ms: time_fn warms every callable first, and records how."""
    fn = SlowStart(slow=bench_mod.WARMUP_CALLS - 1)
    monkeypatch.setattr(bench_mod, "_timing", fn.timing)
    t = fl.time_fn(fn, device="cpu")
    assert t.median_ms == pytest.approx(0.047)
    assert t.warmup_runs >= bench_mod.WARMUP_CALLS and t.retimes == 0 and t.note == ""


def test_a_timing_that_disagrees_is_taken_again(monkeypatch, no_gpu_sync):
    queue = [bench_mod.Timing(m, m * 0.98, m * 1.02, 20, "fake") for m in (0.121, 0.047, 0.047, 0.048)]
    monkeypatch.setattr(bench_mod, "_timing", lambda fn, runs, device: queue.pop(0))
    monkeypatch.setattr(bench_mod, "warm", lambda fn, device: 10)
    t = fl.time_fn(lambda: None, device="cpu")
    assert queue == [] and t.median_ms == 0.047 and t.retimes == 1
    assert "re-timed 0.121 ms" in t.note and "quick check 0.047 ms" in t.note


def test_a_wide_spread_is_timed_again_and_an_unsettled_one_says_so(monkeypatch, no_gpu_sync):
    wide = bench_mod.Timing(1.0, 0.8, 1.3, 20, "fake")
    monkeypatch.setattr(bench_mod, "_timing", lambda fn, runs, device: wide)
    monkeypatch.setattr(bench_mod, "warm", lambda fn, device: 10)
    t = fl.time_fn(lambda: None, device="cpu")
    assert t.retimes == bench_mod.MAX_RETIMES
    assert "spread 50%" in t.note and "still unsettled" in t.note


def test_warm_runs_long_enough(monkeypatch, no_gpu_sync):
    calls = []
    n = bench_mod.warm(lambda: calls.append(1), device="cpu", ms=20, calls=3)
    assert n == len(calls) >= 3


def test_bench_row_with_fake_timer(fake_cuda, monkeypatch):
    # the first timing (an estimate of 10 ms: min_runs runs fit its budget), then its quick check
    # (one batch); they agree, so nothing is re-timed
    fake_cuda([10.0] + [2.0, 4.0] * 10 + [10.0] + [3.0] * bench_mod.BATCH)
    monkeypatch.setattr(bench_mod, "AGREE", 1.0)  # a 2-4 ms spread is wide; accept it here
    monkeypatch.setattr(bench_mod, "warm", lambda fn, device: 10)

    def attn(q, k, v, causal=False, out=None):
        o = fl.naive_attention(q, k, v, causal)
        if out is None:
            return o
        out.copy_(o)
        return out

    cfg = fl.Config(1, 2, 64, 16)
    row = fl.bench(attn, cfg, min_runs=20, device="cpu")
    assert row["median_ms"] == pytest.approx(3.0)
    assert row["tflops"] == pytest.approx(cfg.flops / 3.0e-3 / 1e12)
    assert row["tflops_p20"] <= row["tflops"] <= row["tflops_p80"]  # slower time, lower rate
    assert row["tflops_p20"] == pytest.approx(cfg.flops / (row["p80_ms"] * 1e-3) / 1e12)
    assert row["rel_err"] < 1e-5
    assert math.isfinite(row["rel_err"])
    assert statistics.median([2.0] * 10 + [4.0] * 10) == row["median_ms"]


def test_callables_compared_are_timed_run_by_run_in_turn_and_keep_their_median_round(
        fake_cuda, monkeypatch):
    """At long sequences the GPU's clock moves by a few per cent between timings and within one;
    kernels compared in one run are timed in one queued stream, run by run in turn (the order
    rotating), ROUNDS times over, each keeping its median round."""
    b = bench_mod.BATCH
    medians = {"a": [1.0, 3.0, 2.0], "b": [5.0, 4.0, 6.0]}
    orders = [["a", "b"], ["b", "a"], ["a", "b"]]  # each round starts one further along
    clock = fake_cuda([medians[n][r] for r in range(3) for _ in range(b) for n in orders[r]])
    monkeypatch.setattr(bench_mod, "warm", lambda fn, device: 10)
    monkeypatch.setattr(bench_mod, "_estimate_ms", lambda fn, device: (10.0, 0.1))
    calls = []
    out = bench_mod.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                     rounds=3, device="cpu")
    assert clock.times == []
    assert calls == [n for r in range(3) for _ in range(b) for n in orders[r]]
    assert out["a"].median_ms == 2.0 and out["b"].median_ms == 5.0 and out["a"].runs == b
    assert out["a"].warmup_runs == 10 and out["a"].retimes == 0
    assert out["a"].timer == "cuda events, queued, in turn run by run, 3 rounds"
    assert out["a"].note == "the median of 3 rounds: 1, 3, 2 ms"
    assert clock.sleeps == [2 * b * 0.1 * 2] * 3  # a head start for both callables' calls


def test_one_callable_timed_in_turn_is_timed_as_alone(fake_cuda, monkeypatch):
    clock = fake_cuda([2.0] * bench_mod.BATCH)
    monkeypatch.setattr(bench_mod, "warm", lambda fn, device: 10)
    monkeypatch.setattr(bench_mod, "_estimate_ms", lambda fn, device: (10.0, 0.1))
    one = bench_mod.time_interleaved({"a": lambda: None}, rounds=1, device="cpu")["a"]
    assert clock.times == [] and one.median_ms == 2.0
    assert one.timer == "cuda events, queued" and one.note == ""
    assert bench_mod.time_interleaved({}, device="cpu") == {}  # every stage failed there


# --- the backward, timed alone --------------------------------------------------------------------

def test_backward_fn_runs_the_backward_alone_and_again():
    from flashlab.baselines import Baseline
    from flashlab.bench import backward_fn
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    calls = []
    def attn(q, k, v, causal=False):
        calls.append(1)
        return Baseline("torch_naive")(q, k, v, causal)
    run = backward_fn(attn, q, k, v, causal=True)
    first, again = run(), run()
    assert len(calls) == 1  # the forward ran once, when the callable was made
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert [g.shape for g in first] == [q.shape] * 3


def test_backward_fn_refuses_a_function_without_a_gradient():
    from flashlab.bench import backward_fn
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    with pytest.raises(ValueError, match="no gradient"):
        backward_fn(lambda q, k, v, causal=False: (q + k + v).detach(), q, k, v)


def test_a_backward_rows_tflops_count_two_and_a_half_forwards():
    from flashlab.bench import Timing, timing_row
    cfg = fl.Config(2, 4, 1024, 64, False, "fp16")
    t = Timing(1.0, 0.9, 1.1, 20, "events")
    fwd, bwd = timing_row(cfg, t), timing_row(cfg, t, pass_="backward")
    assert bwd["tflops"] == pytest.approx(2.5 * fwd["tflops"])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_cudnn"])
def test_sdpa_backward_is_timed_alone(name):
    from flashlab.baselines import Baseline
    from flashlab.bench import bench_backward
    cfg = fl.Config(4, 16, 4096, 128, False, "fp16")  # a point of the FlashAttention sweep
    row = bench_backward(Baseline(name), cfg)
    assert 30 < row["tflops"] < 2000, row
