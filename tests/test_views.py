"""Which GPU's numbers a view shows, and whether it runs live: one rule (flashlab.tables.gpu_shown,
tables.live), checked on a small synthetic data/ with two GPUs, CPU only.

GPU A recorded everything (stages 01 and 03, peaks, checks); GPU B recorded later, stage 01 only,
and no ceilings. Nothing a view shows may mix them.
"""
import types

import pandas as pd
import pytest
import torch

import flashlab as fl
from flashlab import build, cli, measure, plots, readme, runner, tables
from flashlab import notebook as nb
from flashlab.baselines import NAMES as BASELINE_NAMES

A, B = "GPU A", "GPU B"


def result(stage, gpu, ms, time, dtype="fp32", **kw):
    cfg = fl.teaching(dtype)
    return dict(stage=stage, kind="baseline" if stage.startswith("sdpa") else "stage",
                dtype=dtype, B=cfg.B, H=cfg.H, N=cfg.N, D=cfg.D, causal=False, gpu=gpu,
                status="ok", median_ms=ms, tflops=cfg.flops / ms / 1e9, rel_err=1e-7,
                p20_ms=ms, p80_ms=ms, compute_capability="9.0" if gpu == A else "8.0",
                torch="2.11", cuda="13.0", commit="abc", time=time, **kw)


@pytest.fixture
def two_gpus(empty_data_dir, monkeypatch):
    monkeypatch.delenv("FLASHLAB_GPU", raising=False)
    tables.RESULTS.upsert([
        result("01_naive", A, 97.0, "2026-01-01T00:00:00Z"),
        result("03_coarsened", A, 0.56, "2026-01-01T00:00:01Z"),
        result("sdpa_efficient", A, 0.54, "2026-01-01T00:00:02Z"),
        result("01_naive", B, 167.0, "2026-02-01T00:00:00Z"),
    ])
    tables.PEAKS.upsert([dict(metric="matmul_fp32_tflops", value=51.0, unit="TFLOP/s", gpu=A,
                              compute_capability="9.0", torch="2.11", cuda="13.0", commit="abc",
                              time="2026-01-01T00:00:00Z")])
    tables.CHECKS.upsert([dict(stage="01_naive", B=1, H=1, N=17, D=64, causal=False, dtype="fp32",
                               rel_err=1e-7, tol=1e-4, passed=True, gpu=g, time="t")
                          for g in (A, B)])
    nb.banner(None)  # no notebook stage set by an earlier test
    return empty_data_dir


def test_the_gpu_shown_follows_one_rule(two_gpus, monkeypatch):
    assert tables.gpu_shown() == B                   # recorded most recently
    assert tables.gpu_shown("01_naive") == B
    assert tables.gpu_shown("03_coarsened") == A     # B never recorded stage 03
    monkeypatch.setenv("FLASHLAB_GPU", A)
    assert tables.gpu_shown() == tables.gpu_shown("01_naive") == A


def test_no_ceiling_of_another_gpu(two_gpus):
    """Notebook 03 divided an H200 time by the H100's ceiling: a GPU without recorded
    ceilings has none, it does not borrow the latest GPU's."""
    assert tables.peaks(B) == {} and tables.peaks() == {}
    assert tables.peaks(A) == {"matmul_fp32_tflops": 51.0}
    nb.banner("01_naive")
    assert nb.the_gpu().name == B and nb.the_gpu().roof == {}
    nb.banner("03_coarsened")
    assert nb.the_gpu() == (A, "9.0", 132, {"matmul_fp32_tflops": 51.0})


def test_a_notebook_shows_one_gpu(two_gpus, capsys):
    """Notebook 01 printed a time measured on one GPU under a banner naming another."""
    nb.banner("01_naive")
    assert f"measured on {B}" in capsys.readouterr().out
    ev = nb.evaluate("01_naive")
    assert not ev.live and set(ev.rows["gpu"]) == {B} and set(ev.check["gpu"]) == {B}
    assert ev.timing()["median_ms"] == 167.0
    assert set(nb.compare()["gpu"]) == {B}
    with pytest.raises(nb.NotRecorded, match=f"03_coarsened.*not recorded yet on {B}"):
        nb.speedup("01_naive", "03_coarsened")
    nb.banner("03_coarsened")
    assert f"measured on {A}" in capsys.readouterr().out
    assert set(nb.compare()["gpu"]) == {A}
    assert nb.speedup("01_naive", "03_coarsened") == pytest.approx(97.0 / 0.56)


def test_teaching_rows_show_one_gpu_and_name_a_wide_spread(two_gpus, capsys):
    nb.banner("03_coarsened")
    capsys.readouterr()
    rows = nb.teaching_rows(["01_naive", "03_coarsened"], dtypes=("fp32",))
    assert list(rows.index) == [("01_naive", "fp32"), ("03_coarsened", "fp32")]
    assert rows.loc[("01_naive", "fp32"), "median_ms"] == 97.0  # GPU A's, not B's 167
    assert capsys.readouterr().out.strip() == "every row's p80 is within 10 % of its p20"
    tables.RESULTS.upsert([{**result("03_coarsened", A, 0.56, "2026-01-01T00:00:03Z"),
                            "p20_ms": 0.5, "p80_ms": 0.6}])
    nb.teaching_rows(["01_naive", "03_coarsened"], dtypes=("fp32",))
    assert "03_coarsened fp32: p80 is 20% above p20" in capsys.readouterr().out


def test_figures_and_tables_show_one_gpu(two_gpus, monkeypatch):
    monkeypatch.setenv("FLASHLAB_GPU", A)
    fig = plots.ladder()
    assert A in fig.axes[0].get_title()
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert any("03" in t for t in labels)
    text = runner.table()
    assert text.splitlines()[0] == A and B not in text
    md = readme.stage_table()
    assert f"**{A}**" in md and B not in md


# --- live or replay, per stage ----------------------------------------------------------------------

@pytest.fixture
def a_t4(monkeypatch):
    """A GPU of compute capability 7.5 (a T4), with nvcc."""
    _a_gpu(monkeypatch, (7, 5), "Tesla T4")


def _a_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(build, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")


def test_a_stage_the_gpu_cannot_run_replays_and_says_why(two_gpus, a_t4, monkeypatch, capsys):
    mma = fl.stage("05_mma")
    why = mma.unavailable()
    assert why == "05_mma needs compute capability 8.0 or newer; this GPU is 7.5"
    assert tables.live(None) and not tables.live(mma)
    monkeypatch.setattr(type(mma), "build", lambda self, verbose=False: pytest.fail("built"))
    nb.banner("05_mma")
    out = capsys.readouterr().out
    assert out.startswith(f"REPLAY ({why})")
    assert not nb.evaluate("05_mma").live
    naive = fl.stage("01_naive")
    assert naive.unavailable() is None and tables.live(naive)
    nb.banner("01_naive")
    assert capsys.readouterr().out.startswith("LIVE on Tesla T4")
    assert tables.gpu_shown(naive) == "Tesla T4"


def test_without_nvcc_nothing_builds(a_t4, monkeypatch):
    monkeypatch.setattr(build, "nvcc", lambda: None)
    assert "needs nvcc" in fl.stage(1).unavailable()


def test_run_replays_the_stages_this_gpu_cannot_run(two_gpus, a_t4, monkeypatch):
    jobs, lines = [], []
    monkeypatch.setattr(runner, "_job", lambda job, log, out: jobs.append(job.name) or 0)
    monkeypatch.setattr(runner.plots, "save_all", lambda df: [])
    df = runner.run(["05", "03"], with_baselines=False, progress=False, out=lines.append)
    assert jobs == ["03_coarsened"]
    assert df.attrs["replayed"] == {"05_mma": fl.stage(5).unavailable()}
    assert any(line.startswith("05_mma: replayed from") for line in lines)


@pytest.mark.parametrize("command", [["run", "--stage", "99"], ["check", "99"], ["bench", "99"],
                                     ["run", "--stage", "03", "--stage", "99"]])
def test_an_unknown_stage_fails_as_fl_stage_does(command, capsys, empty_data_dir):
    with pytest.raises(ValueError) as err:
        fl.stage(99)
    assert cli.main(command) == 2
    assert capsys.readouterr().err.strip() == f"flashlab: {err.value}"


def test_the_views_helpers_agree_on_rows(two_gpus):
    """tables' queries return one GPU's rows, and the recorded table round-trips its types."""
    df = tables.RESULTS.load()
    assert df["causal"].dtype == bool and df["B"].dtype == "int64"
    assert set(tables.teaching_rows(df, A)["gpu"]) == {A}
    assert tables.stage_at_teaching(df[df["gpu"] == A], fl.stage(1))["median_ms"].tolist() == [97.0]
    assert isinstance(tables.recorded_checks("01_naive", A), pd.DataFrame)


@pytest.fixture
def an_h100(monkeypatch):
    """A GPU of compute capability 9.0 (an H100), with nvcc."""
    _a_gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")


def test_run_times_the_sweep_in_one_job_in_turn_with_the_compared_backends(two_gpus, an_h100,
                                                                            monkeypatch):
    """Each stage is checked in its own job; the fast ones that pass are timed over the sweep in
    one more job beside sdpa_flash and sdpa_cudnn, which the baselines jobs then leave alone.
    The runner's plan says which configs each job times; a stage that fails its check is left
    out of the sweep job."""
    jobs = []

    def fake_job(job, log, out):
        jobs.append(job)
        return 3 if job.name == "11_warpspec" else 0  # stage 11 fails its check

    monkeypatch.setattr(runner, "_job", fake_job)
    monkeypatch.setattr(runner.plots, "save_all", lambda df: [])
    monkeypatch.setattr(runner.readme, "update_tables", lambda: False)
    teach, sweep = [fl.teaching("fp16"), fl.teaching("bf16")], fl.sweep("fp16") + fl.sweep("bf16")
    df = runner.run(["03", "11", "12"], progress=False, out=lambda m: None)
    assert [j.name for j in jobs] == ["peaks", "03_coarsened", "11_warpspec", "12_tma_store",
                                      "sweep", "baselines", "baselines (sweep)"]
    _, st03, st11, st12, swept, base, base_sweep = jobs
    assert st03.timed == (fl.teaching("fp32"),) and st03.untimed == ()
    assert list(st12.timed) == teach and set(st12.untimed) == set(sweep)
    assert swept.stages == ("12_tma_store",) and swept.baselines == ("sdpa_flash", "sdpa_cudnn")
    assert set(swept.timed) == set(sweep)
    assert list(base.timed) == measure.baseline_configs(with_sweep=False)
    assert set(base_sweep.baselines) == set(BASELINE_NAMES) - {"sdpa_flash", "sdpa_cudnn"}
    assert set(base_sweep.timed) == set(fl.sweep("fp16"))
    assert df.attrs["failed"] == ["11_warpspec"]

    jobs.clear()
    runner.run(["12"], baselines=["sdpa_math"], progress=False, out=lambda m: None)
    assert [(j.name, j.stages, j.baselines) for j in jobs[2:]] == [
        ("sweep", ("12_tma_store",), ()), ("baselines", (), ("sdpa_math",)),
        ("baselines (sweep)", (), ("sdpa_math",))]
    jobs.clear()
    runner.run(["12"], with_sweep=False, progress=False, out=lambda m: None)
    assert [j.name for j in jobs] == ["peaks", "12_tma_store", "baselines"]
    assert list(jobs[1].timed) == teach and jobs[1].untimed == ()
    jobs.clear()
    runner.run(["03"], progress=False, out=lambda m: None)  # no fast stage: no sweep job
    assert [j.name for j in jobs] == ["peaks", "03_coarsened", "baselines", "baselines (sweep)"]
    assert set(jobs[-1].timed) == set(fl.sweep("fp16")) and jobs[-1].baselines == BASELINE_NAMES


def test_the_worker_runs_a_job_as_the_plan_says(monkeypatch):
    """A job goes to the worker as JSON and comes back the same; the worker times what it names
    and nothing else."""
    from flashlab import worker
    calls = []
    monkeypatch.setattr(measure, "measure_baselines",
                        lambda configs, names, log: calls.append(("baselines", configs, names)))
    monkeypatch.setattr(measure, "measure_interleaved",
                        lambda stages, configs, baselines, log, **kw:
                        calls.append(("sweep", stages, configs, baselines, kw)))
    monkeypatch.setattr(measure, "measure_stage",
                        lambda st, configs, log, untimed: calls.append(("stage", configs, untimed))
                        or (types.SimpleNamespace(passed=False), None))
    job = runner.Job("baselines", baselines=("sdpa_flash",), timed=(fl.teaching("fp16"),))
    assert runner.Job.from_json(job.to_json()) == job
    assert worker.main([job.to_json()]) == 0
    assert calls == [("baselines", [fl.teaching("fp16")], ("sdpa_flash",))]
    calls.clear()
    job = runner.sweep_job([fl.stage(12)], ("sdpa_cudnn",), rounds=5)
    assert worker.main([job.to_json()]) == 0
    assert calls == [("sweep", [fl.stage(12)], list(job.timed), ("sdpa_cudnn",), {"rounds": 5})]
    calls.clear()
    job = runner.Job("stage", stages=("12_tma_store",), timed=(fl.teaching("fp16"),),
                     untimed=tuple(fl.sweep("fp16")))
    assert worker.main([job.to_json()]) == 3  # the check failed
    assert calls == [("stage", [fl.teaching("fp16")], fl.sweep("fp16"))]
    assert worker.main([]) == 2


def test_a_live_notebook_times_its_stage_with_the_stage_before_it(empty_data_dir, monkeypatch):
    """Live, a notebook timed its stage alone and compared it with the stage before it as
    recorded in another run, when the GPU's clock may have stood elsewhere. Now evaluate checks
    the stage and times it as `flashlab run` times the sweep: with the stage before it and SDPA's
    compared backends, run by run in turn, at the teaching configs and over the sweep."""
    from flashlab import measure
    from flashlab.stages import Stage
    calls = []
    passed = types.SimpleNamespace(passed=True, rows=lambda: [])
    monkeypatch.setattr(tables, "live", lambda st=None: True)
    monkeypatch.setattr(Stage, "build", lambda self, verbose=False: "built " + self.slug)
    monkeypatch.setattr(measure, "measure_stage",
                        lambda st, configs, log, attn, untimed: calls.append(
                            ("stage", st.slug, configs, list(untimed))) or (passed, pd.DataFrame()))
    monkeypatch.setattr(measure, "measure_interleaved",
                        lambda stages, configs, log: calls.append(
                            ("together", [s.slug for s in stages], configs)) or pd.DataFrame())
    teach = [fl.teaching("fp16"), fl.teaching("bf16")]
    sweep = fl.sweep("fp16") + fl.sweep("bf16")
    standard = measure.configs_for(fl.stage(12))  # the teaching configs and sweeps, by dtype
    assert set(standard) == set(teach + sweep) and len(standard) == len(teach + sweep)
    nb.evaluate("12_tma_store")
    assert calls == [("stage", "12_tma_store", [], standard),
                     ("together", ["11_warpspec", "12_tma_store"], teach + sweep)]
    calls.clear()
    nb.evaluate("04_wmma")  # stage 03 is not a fast stage: 04 with the backends only
    assert calls == [("stage", "04_wmma", [], standard), ("together", ["04_wmma"], teach + sweep)]
    calls.clear()
    nb.evaluate("01_naive")  # not a fast stage: its teaching configs, alone
    assert calls == [("stage", "01_naive", None, [])]
    calls.clear()
    nb.evaluate("12_tma_store", configs=teach[:1])  # configs given: those, the stage alone
    assert calls == [("stage", "12_tma_store", teach[:1], [])]
    calls.clear()
    passed.passed = False  # a failed check: nothing timed ("failed check" rows instead)
    nb.evaluate("12_tma_store")
    assert calls == [("stage", "12_tma_store", [], standard)]


def test_the_sweep_job_groups_a_shapes_dtypes():
    """measure.by_shape: fp16 and bf16 of a shape are timed together, shapes in the sweep's order."""
    from flashlab import measure
    cfgs = measure.interleaved_configs([fl.stage("12"), fl.stage("11")])
    groups = measure.by_shape(cfgs)
    assert sum(map(len, groups)) == len(cfgs)
    assert all([c.dtype for c in g] == ["fp16", "bf16"] for g in groups)
    assert all(len({(c.B, c.H, c.N, c.D, c.causal) for c in g}) == 1 for g in groups)
    assert [g[0] for g in groups] == [c for c in cfgs if c.dtype == "fp16"]
