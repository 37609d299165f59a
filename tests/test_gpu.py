"""GPU tests: every stage against the float64 reference, bad input, compute-sanitizer."""
import importlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

import flashlab as fl
from flashlab import picks
from flashlab.check import tolerance
from flashlab.reference import reference, rel_err

from conftest import attn_for

pytestmark = pytest.mark.gpu
STAGES = [st.slug for st in fl.stages()]


def dtype_of(slug):
    """The first dtype the stage takes (float32 for the scalar stages, fp16 for tensor cores)."""
    return fl.inputs.dtype_of(fl.stage(slug).dtypes[0])


@pytest.mark.parametrize("slug", STAGES)
def test_stage_matches_reference(built, slug):
    result = fl.check(attn_for(built, slug))
    print(result)
    assert result.passed, str(result)
    assert {c.N for c in result.cases} >= {1, 17, 1000, 4096}


PICKED_BY_N = [st.slug for st in fl.stages() if picks.boundary_probes(st.text)]


@pytest.mark.parametrize("slug", PICKED_BY_N)
def test_every_shape_pick_launches_is_checked_at_a_ragged_length_it_serves(built, slug):
    """A stage whose pick() changes shape with N: each side of every boundary against float64
    (the standard N above may all fall on one side)."""
    attn = attn_for(built, slug)
    for D, causal, N in picks.boundary_probes(fl.stage(slug).text):
        result = fl.check(attn, head_dims=(D,), shapes=((1, 2, N),), causal=(causal,))
        print(result)
        assert result.passed, str(result)


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.any_head_dim])
def test_any_head_dim_that_fits(built, slug):
    result = fl.check(attn_for(built, slug), head_dims=(1, 40, 100), shapes=((1, 2, 33),))
    assert result.passed, str(result)


@pytest.mark.parametrize("slug", STAGES)
def test_every_output_element_written(built, slug):
    attn = attn_for(built, slug)
    q, k, v = (torch.randn(3, 2, 77, 64, device="cuda", dtype=dtype_of(slug)) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    attn(q, k, v, out=out)
    assert torch.isfinite(out).all()


def _bad_inputs(dtype):
    c = dict(device="cuda", dtype=dtype)
    good = lambda *s, **kw: torch.randn(*s, **{**c, **kw})  # noqa: E731
    q = good(1, 2, 64, 64)
    other = torch.float32 if dtype != torch.float32 else torch.float16
    yield "cpu", (q.cpu(), q.cpu(), q.cpu()), {}, "CUDA"
    yield "dtype", (q.double(), q.double(), q.double()), {}, "dtype"
    yield "mixed dtype", (q, q.to(other), q), {}, "dtype"
    yield "dtype the stage does not take", (q.to(other),) * 3, {}, "dtype|float"
    yield "rank", (q[0], q[0], q[0]), {}, "rank 4"
    yield "shape", (q, good(1, 2, 65, 64), q), {}, "shape"
    yield "empty", (good(1, 2, 0, 64),) * 3, {}, "empty"
    yield "non-contiguous", (q.transpose(2, 3),) * 3, {}, "contiguous"
    yield "bad out", (q, q, q), {"out": good(1, 2, 64, 32)}, "shape"
    yield "negative scale", (q, q, q), {"scale": -0.125}, "scale"


@pytest.mark.parametrize("slug", STAGES)
def test_bad_input_is_a_value_error(built, slug):
    attn = attn_for(built, slug)
    for what, args, kwargs, words in _bad_inputs(dtype_of(slug)):
        with pytest.raises(ValueError, match=words):
            attn(*args, **kwargs)
    # the context is still healthy afterwards
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=dtype_of(slug))
    assert torch.isfinite(attn(q, q, q)).all()


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if not st.has_backward])
def test_no_output_silently_drops_out_of_autograd(built, slug):
    """Inputs that require grad with grad mode on, to a stage without a backward pass: a clear
    ValueError, never an output without a gradient (tests/test_backward_gpu.py: the stages with
    one). Under no_grad and inference_mode, the same inputs give the float64 answer."""
    attn = attn_for(built, slug)
    dtype = dtype_of(slug)
    q, k, v = (torch.randn(2, 3, 77, 64, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    with pytest.raises(ValueError, match=f"{slug}: q, k, v require grad.*no backward"):
        attn(q, k, v)
    with pytest.raises(ValueError, match="no backward"):
        attn(q.detach(), k.detach(), v * 1.0, causal=fl.stage(slug).causal)
    plain = [t.detach() for t in (q, k, v)]
    want = reference(*plain)
    tol = tolerance(*plain, False, want)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            o = attn(q, k, v)
        assert not o.requires_grad
        assert rel_err(o, want) < tol, (mode.__name__, rel_err(o, want), tol)
    o = attn(*plain)  # inputs that need no grad: unchanged
    assert rel_err(o, want) < tol


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.fast])
def test_scores_that_grow_along_the_keys(built, slug):
    """Keys whose norm grows along the sequence: every row's maximum keeps rising, so each tile
    takes the rescale path (stage 13's classic fallback among them), and large scores. Against
    float64, with the same tolerance as fl.check."""
    attn = attn_for(built, slug)
    st = fl.stage(slug)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for dt in st.dtypes:
        dtype = fl.inputs.dtype_of(dt)
        for D in st.head_dims:
            for causal in (False, True):
                for N, growth in ((1000, 8.0), (4096, 30.0)):
                    x = [torch.randn(2, 3, N, D, device="cuda", generator=gen) for _ in range(3)]
                    x[1] *= (1 + growth * torch.arange(N, device="cuda") / N)[:, None]
                    q, k, v = (t.to(dtype) for t in x)
                    ref = reference(q, k, v, causal)
                    out = attn(q, k, v, causal=causal)
                    err = rel_err(out, ref)
                    tol = tolerance(q, k, v, causal, ref)
                    assert torch.isfinite(out).all(), (dt, D, causal, N)
                    assert err <= tol, (dt, D, causal, N, err, tol)


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.fast])
def test_a_stage_replays_inside_a_cuda_graph(built, slug):
    """Captured once (torch.cuda.graph), replayed on new inputs copied into the same tensors: each
    replay computes the new inputs' attention. Nothing the call does on the host (checks, tensor
    maps, the launch) is repeated by a replay, and stages 11-13 zero their work counter inside the
    graph, so every replay hands out every item again."""
    attn = attn_for(built, slug)
    dtype = dtype_of(slug)
    for causal in (False, True):
        q, k, v = (torch.randn(2, 3, 777, 64, device="cuda", dtype=dtype) for _ in range(3))
        out = torch.empty_like(q)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warmed outside the capture, as torch.cuda.graph asks
            attn(q, k, v, causal=causal, out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn(q, k, v, causal=causal, out=out)
        for _ in range(2):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref = reference(q, k, v, causal)
            assert rel_err(out, ref) <= tolerance(q, k, v, causal, ref), causal


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if not st.any_head_dim])
def test_unsupported_head_dims(built, slug):
    for D in sorted({32, 96, 256} - set(fl.stage(slug).head_dims)):
        h = torch.randn(1, 1, 16, D, device="cuda", dtype=dtype_of(slug))
        with pytest.raises(ValueError, match="head dim"):
            attn_for(built, slug)(h, h, h)


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.any_head_dim])
def test_a_head_dim_too_large_for_shared_memory(built, slug):
    big = torch.randn(1, 1, 16, 4096, device="cuda", dtype=dtype_of(slug))
    with pytest.raises(ValueError, match="shared memory"):
        attn_for(built, slug)(big, big, big)


def test_bench_reports_median_and_tflops(built):
    m = fl.bench(attn_for(built, "03_coarsened"), fl.Config(1, 4, 512, 64))
    assert m["runs"] >= 20 and m["p20_ms"] <= m["median_ms"] <= m["p80_ms"]
    assert m["tflops"] == pytest.approx(fl.flops(1, 4, 512, 64) / m["median_ms"] / 1e9)
    assert m["rel_err"] < 1e-4


SANITIZER = shutil.which("compute-sanitizer") or (
    "/usr/local/cuda/bin/compute-sanitizer" if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)


@pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer not installed")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("slug", STAGES)
def test_compute_sanitizer_clean(built, slug, tool):
    _sanitize(built, slug, tool, fl.stage(slug).kernel)


# The backward's kernels: every kernel named with the registry's backward_prefix.
@pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer not installed")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.has_backward])
def test_compute_sanitizer_clean_backward(built, slug, tool):
    out = _sanitize(built, slug, tool, fl.stage(slug).backward_prefix)
    assert "backward done" in out


def _sanitize(built, slug, tool, kernel_substring):
    """Run tests/sanitize_stage.py under compute-sanitizer's `tool`, instrumenting the kernels
    whose names contain `kernel_substring`; assert it found nothing. Returns its stdout."""
    attn_for(built, slug)  # build outside the sanitizer
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # exact allocations: OOB shows
    cmd = [SANITIZER, f"--tool={tool}", "--error-exitcode=99", "--kernel-name", f"kns={kernel_substring}",
           sys.executable, os.path.join(os.path.dirname(__file__), "sanitize_stage.py"), slug]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "ERROR SUMMARY: 0 errors" in proc.stdout or "RACECHECK SUMMARY: 0 hazards" in proc.stdout, report
    return proc.stdout


RING = """
import sys, torch, flashlab as fl
attn = fl.stage(sys.argv[1]).build()
for D in (64, 128):
    for causal in (False, True):
        q, k, v = (torch.randn(1, 2, 16384, D, device="cuda", dtype=torch.float16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        err = fl.rel_err(attn(q, k, v, causal=causal), ref)
        assert err < 2e-3, (D, causal, err)
torch.cuda.synchronize()
print("wrapped")
"""


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.arch_specific])
def test_a_long_sequence_wraps_the_pipeline_without_hanging(built, slug):
    """N = 16384: more than a hundred K/V tiles, so every buffer of the ring is refilled dozens of
    times and each barrier's phase parity flips as often. A parity bug hangs rather than fails:
    the run is a child process with a time limit."""
    attn_for(built, slug)  # build here, so the child loads from the cache
    proc = subprocess.run([sys.executable, "-c", RING, slug], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "wrapped" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_compile_error_names_the_cu_file_and_line(tmp_path):
    from flashlab.build import BuildError, build_module
    src = fl.stage(1).source.read_text().replace("int tx = threadIdx.x;", "int tx = threadIdx.x")
    broken = tmp_path / "99_broken.cu"
    broken.write_text(src)
    with pytest.raises(BuildError) as err:
        build_module(broken)
    assert f"{broken}(" in str(err.value) or f"{broken}:" in str(err.value), str(err.value)


def test_profile_shows_coalescing():
    from flashlab import profile as prof
    if prof.ncu_path() is None:
        pytest.skip("Nsight Compute (ncu) not installed")
    cfg = fl.Config(1, 2, 256, 64)
    spr = {}
    for slug in ("01_naive", "02_coalesced"):
        df = prof.profile(slug, cfg, record=False).set_index("metric")["value"]
        assert df["duration_ms"] > 0
        spr[slug] = df["global_load_sectors_per_request"]
    assert spr["01_naive"] > 2 * spr["02_coalesced"], spr


def test_the_timer_drops_runs_that_timed_the_host():
    """A call with far more host work than GPU work (a 0.3 ms host spin around a tiny kernel):
    queued behind the sleep, none of its runs times the host; a callable that waits for the GPU
    itself cannot be queued, and its timing says so."""
    import time
    x = torch.zeros(1024, device="cuda")

    def host_heavy():
        end = time.perf_counter() + 3e-4
        while time.perf_counter() < end:
            pass
        x.add_(1)

    t = fl.time_fn(host_heavy)
    assert t.median_ms < 0.1, t  # the 0.3 ms of host work is not in it
    assert "all kept" not in t.note

    def syncing():
        x.add_(1)
        torch.cuda.synchronize()

    bench = importlib.import_module("flashlab.bench")  # fl.bench is the function
    t = bench._queued_bench(syncing, 20, "cuda")
    assert "the GPU waited for the host" in t.note and "all kept" in t.note


def test_the_sweep_job_times_stages_and_baselines_in_turn_and_guards_each_config(data_dir,
                                                                                  monkeypatch):
    """measure_interleaved: one set of inputs and one reference per config, a row per callable
    with its rounds in the note, recorded as each config is done; a stage that is wrong at a
    config gets a "failed check" row there and is not timed."""
    import types

    from flashlab import measure, tables
    cfg = fl.Config(2, 4, 1000, 64, True, "fp16")
    st = fl.stage("07")
    df = measure.measure_interleaved([st], configs=[cfg], baselines=("sdpa_flash",), rounds=2,
                                     log=lambda m: None)
    assert sorted(df["stage"]) == ["07_cp_async", "sdpa_flash"]
    assert (df["status"] == "ok").all() and (df["rel_err"] < 1e-2).all()
    assert df["note"].str.contains("median of 2 rounds").all()
    assert len(tables.at_config(tables.RESULTS.load(), cfg)) == 2

    attn = st.build()

    def wrong(q, k, v, causal=False, out=None, scale=None):  # right kernel, output scaled
        return attn(q, k, v, causal=causal, out=out, scale=scale).mul_(1.5)

    fake = types.SimpleNamespace(slug="07_wrong", build=lambda: wrong, takes=st.takes,
                                 unavailable_dtypes=lambda: {})
    monkeypatch.setattr(measure, "_ptxas_at", lambda s, env, log: lambda c: {})
    df = measure.measure_interleaved([fake], configs=[cfg], baselines=(), rounds=1,
                                     log=lambda m: None)
    assert list(df["status"]) == ["failed check"] and df["rel_err"].iloc[0] > 0.1


def test_the_sweep_job_times_a_shapes_dtypes_in_turn(data_dir):
    """fp16 and bf16 of one shape are timed in one turn (a stage's bf16 ÷ fp16 is a ratio of one
    run): a row for the stage in each dtype, the baseline in fp16 only."""
    from flashlab import measure
    cfgs = [fl.Config(2, 4, 1000, 64, False, dt) for dt in ("fp16", "bf16")]
    df = measure.measure_interleaved([fl.stage("07")], configs=cfgs, baselines=("sdpa_flash",),
                                     rounds=2, log=lambda m: None)
    assert sorted(zip(df["stage"], df["dtype"])) == [("07_cp_async", "bf16"), ("07_cp_async", "fp16"),
                                                     ("sdpa_flash", "fp16")]
    assert (df["status"] == "ok").all() and (df["rel_err"] < 1e-2).all()


def test_a_live_notebook_times_its_stage_in_turn_with_the_one_before(data_dir, monkeypatch):
    """nb.evaluate, live: the stage is checked, then timed with the stage before it and SDPA's
    compared backends, run by run in turn, at the teaching config and the sweep's configs (here
    one of each, to keep the test short); every row comes from that one run."""
    from flashlab import measure, tables
    from flashlab import notebook as nb
    from flashlab.baselines import COMPARED
    sweep_cfg = fl.Config(2, 4, 1000, 64, True, "fp16")
    teach = fl.teaching("fp16")
    monkeypatch.setattr(measure, "configs_for", lambda st: [teach, sweep_cfg])
    monkeypatch.setattr(measure, "interleaved_configs", lambda stages, with_baselines=True: [sweep_cfg])
    ev = nb.evaluate("07_cp_async")
    assert ev.live and ev.passed
    assert set(ev.rows["stage"]) == {"07_cp_async"} and len(ev.rows) == 2
    run = ev.rows["time"].iloc[0]  # the rows of one measure_interleaved run share its time
    df = tables.RESULTS.load()
    for cfg in (teach, sweep_cfg):
        rows = tables.at_config(df[df["time"] == run], cfg)
        assert set(rows["stage"]) == {"06_swizzle", "07_cp_async", *COMPARED}, rows["stage"].tolist()
        assert rows["note"].str.contains("median of 3 rounds").all()


def test_the_check_command_checks_what_a_stage_promises():
    """`flashlab check 16`: its forward, its log-sum-exp, its gradients and the same bits on every
    run, each a result of its own, the exit status 0 only where all pass."""
    proc = subprocess.run([sys.executable, "-m", "flashlab", "check", "16", "--dtype", "fp16"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": PASS") == 4, proc.stdout
