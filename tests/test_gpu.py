"""GPU tests: every stage against the float64 reference, bad input, compute-sanitizer."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import flashlab as fl
from flashlab.inputs import dtype_of

pytestmark = pytest.mark.gpu
STAGES = [st.slug for st in fl.stages()]


@pytest.fixture(scope="module")
def built():
    return {}


def attn_for(built, slug):
    if slug not in built:
        built[slug] = fl.stage(slug).build()
    return built[slug]


@pytest.mark.parametrize("slug", STAGES)
def test_stage_matches_reference(built, slug):
    result = fl.check(attn_for(built, slug))
    print(result)
    assert result.passed, str(result)
    assert {c.N for c in result.cases} >= {1, 17, 1000, 4096}


@pytest.mark.parametrize("slug", ["01_naive", "02_coalesced"])
def test_any_head_dim_that_fits(built, slug):
    result = fl.check(attn_for(built, slug), head_dims=(1, 40, 100), shapes=((1, 2, 33),))
    assert result.passed, str(result)


def dtypes_of(slug):
    return [dtype_of(d) for d in fl.stage(slug).dtypes]


@pytest.mark.parametrize("slug", STAGES)
def test_every_output_element_written(built, slug):
    attn = attn_for(built, slug)
    for dt in dtypes_of(slug):
        q, k, v = (torch.randn(3, 2, 77, 64, device="cuda", dtype=dt) for _ in range(3))
        out = torch.full_like(q, float("nan"))
        attn(q, k, v, out=out)
        assert torch.isfinite(out).all(), dt


def _bad_inputs(dt=torch.float32):
    c = dict(device="cuda", dtype=dt)
    good = lambda *s, **kw: torch.randn(*s, **{**c, **kw})  # noqa: E731
    q = good(1, 2, 64, 64)
    other = torch.float16 if dt == torch.float32 else torch.float32
    yield "cpu", (q.cpu(), q.cpu(), q.cpu()), {}, "CUDA"
    yield "dtype", (q.double(), q.double(), q.double()), {}, "dtype"
    yield "mixed dtype", (q, q.to(other), q), {}, "dtype"
    yield "rank", (q[0], q[0], q[0]), {}, "rank 4"
    yield "shape", (q, good(1, 2, 65, 64), q), {}, "shape"
    yield "empty", (good(1, 2, 0, 64),) * 3, {}, "empty"
    yield "non-contiguous", (q.transpose(2, 3),) * 3, {}, "contiguous"
    yield "bad out", (q, q, q), {"out": good(1, 2, 64, 32)}, "shape"


@pytest.mark.parametrize("slug", STAGES)
def test_bad_input_is_a_value_error(built, slug):
    attn = attn_for(built, slug)
    dt = dtypes_of(slug)[0]
    for what, args, kwargs, words in _bad_inputs(dt):
        with pytest.raises(ValueError, match=words):
            attn(*args, **kwargs)
    # the context is still healthy afterwards
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=dt)
    assert torch.isfinite(attn(q, q, q)).all()


def test_unsupported_head_dims(built):
    q = torch.randn(1, 1, 16, 96, device="cuda")
    with pytest.raises(ValueError, match="head dim"):
        attn_for(built, "03_coarsened")(q, q, q)
    with pytest.raises(ValueError, match="head dim"):
        attn_for(built, "04_wmma")(q.half(), q.half(), q.half())
    big = torch.randn(1, 1, 16, 4096, device="cuda")
    for slug in ("01_naive", "02_coalesced"):
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
    attn_for(built, slug)  # build outside the sanitizer
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # exact allocations: OOB shows
    cmd = [SANITIZER, f"--tool={tool}", "--error-exitcode=99", "--kernel-name", f"kns={slug[3:]}_kernel",
           sys.executable, os.path.join(os.path.dirname(__file__), "sanitize_stage.py"), slug]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "ERROR SUMMARY: 0 errors" in proc.stdout or "RACECHECK SUMMARY: 0 hazards" in proc.stdout, report


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
