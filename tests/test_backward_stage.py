"""A stage with a backward pass, without a GPU: the registry, the kernel file and the generated
binding agree on which stages have one; the forward's log-sum-exp and autograd are refused with
a clear ValueError where a stage has neither; the results table keeps backward rows apart from
forward ones; `flashlab run` plans the backward's job; training through a stage's model of the
algorithm (check_training on a PyTorch function) fails when a gradient is dropped."""
import re

import pandas as pd
import pytest
import torch

import flashlab as fl
from flashlab import build, measure, runner, tables
from flashlab.check import check_training
from flashlab.configs import flops, teaching
from flashlab.reference import naive_attention
from flashlab.runtime import Attention

BACKWARD = [st for st in fl.stages() if st.has_backward]


def test_some_stage_has_a_backward_pass():
    assert BACKWARD, "no stage has a backward pass"


@pytest.mark.parametrize("st", fl.stages(), ids=lambda st: st.slug)
def test_the_registry_says_which_kernel_files_define_a_backward(st):
    assert build.has_backward(st.source.read_text()) == st.has_backward, st.slug
    if st.has_backward:  # a backward reads the log-sum-exp its forward writes
        assert st.lse and st.backward in st.source.read_text()


def test_the_binding_gains_the_backward_entry_only_where_a_stage_has_one():
    assert "#define FLASHLAB_BACKWARD" in build.binding(True)
    assert "FLASHLAB_BACKWARD 1" not in build.binding(False)
    assert build.has_backward('extern "C" const char* flashlab_backward_launch(const P* p, void*)')
    assert not build.has_backward("// flashlab_backward_launch is not defined here")


def test_the_backward_flops_are_two_and_a_half_forwards_and_the_lse_is_free():
    cfg = teaching("fp16")
    fwd = flops(cfg.B, cfg.H, cfg.N, cfg.D)
    assert flops(cfg.B, cfg.H, cfg.N, cfg.D, pass_="backward") == 2.5 * fwd
    assert flops(cfg.B, cfg.H, cfg.N, cfg.D, True, "backward") == 1.25 * fwd
    assert flops(cfg.B, cfg.H, cfg.N, cfg.D, pass_="forward_lse") == fwd
    with pytest.raises(ValueError, match="unknown pass"):
        flops(1, 1, 1, 1, pass_="sideways")


def test_return_lse_on_a_stage_that_does_not_write_it_is_a_value_error():
    st = next(s for s in fl.stages() if not s.lse and s.dtypes != ("fp32",))
    attn = Attention(st, module=None)  # refused before anything is launched
    q = torch.randn(1, 1, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"{st.slug}: return_lse=True.*log-sum-exp"):
        attn(q, q, q, return_lse=True)


def test_training_through_a_stage_without_a_backward_is_refused_on_any_device():
    st = next(s for s in fl.stages() if not s.has_backward)
    attn = Attention(st, module=None)
    q = torch.randn(1, 1, 4, 64, requires_grad=True)
    with pytest.raises(ValueError, match="no backward pass.*a stage with a backward pass"):
        attn(q, q.detach(), q.detach())


def test_a_backward_of_a_stage_without_one_is_refused():
    st = next(s for s in fl.stages() if not s.has_backward)
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="has no backward pass"):
        Attention(st, module=None).backward(q, q, q, q, q[..., 0], q)


@pytest.mark.parametrize("st", BACKWARD, ids=lambda st: st.slug)
def test_each_kernel_of_a_backward_stage_is_held_to_its_own_evidence(st):
    fwd = st.evidence_for(f"{st.kernel}<__half, 64>")
    assert fwd == st.sass_evidence and fwd["HMMA"] is not None
    bwd = st.evidence_for(f"void {st.backward}<__half, 64>(const __half*)")
    # dQ added across key blocks: per-lane reductions, (fenced, in a deterministic stage) atomics,
    # or the TMA's bulk reductions from shared memory
    assert (bwd.get("RED") or bwd.get("ATOM") or bwd.get("UBLKRED")) is True
    assert bwd["LDL"] is False and bwd["MUFU.EX2"] is True
    assert st.evidence_for("bwd_dq_kernel<__half>") == {"LDL": False, "STL": False}
    assert st.is_forward(f"void {st.kernel}<__half, 64, 128>(...)")
    assert not st.is_forward(f"{st.backward}<__half, 64>")


def test_results_keep_backward_rows_apart(empty_data_dir):
    base = dict(dtype="fp16", B=4, H=16, N=1024, D=64, causal=False, gpu="G", kind="stage",
                status="ok", median_ms=1.0, tflops=1.0, time="t")
    rows = [dict(base, stage="14_x", **{"pass": p}) for p in ("forward", "forward_lse", "backward")]
    rows.append(dict(base, stage="sdpa_flash", kind="baseline", **{"pass": "backward"}))
    tables.RESULTS.upsert(rows)
    assert set(tables.RESULTS.load()["pass"]) == {"forward"}  # what every forward view reads
    assert len(tables.RESULTS.load(every=True)) == 4
    back = tables.pass_rows(["14_x", "sdpa_flash"], "G")
    assert sorted(back["stage"]) == ["14_x", "sdpa_flash"] and set(back["pass"]) == {"backward"}
    assert len(tables.pass_rows(["14_x"], "G", ("forward", "forward_lse"))) == 2
    tables.RESULTS.upsert([dict(base, stage="14_x", median_ms=2.0, **{"pass": "backward"})])
    every = tables.RESULTS.load(every=True)  # an upsert keeps the rows of the other passes
    assert len(every) == 4 and every.loc[every["pass"] == "backward", "median_ms"].max() == 2.0


def test_a_run_plans_the_backward_after_the_forward_checks():
    st = BACKWARD[0]
    jobs = runner.plan([st], with_baselines=True, with_sweep=False)
    back = [j for j in jobs if j.task == "backward"]
    assert len(back) == 1 and back[0].stages == (st.slug,)
    assert set(back[0].baselines) == {"sdpa_flash", "sdpa_cudnn"}
    assert set(back[0].timed) == set(measure.backward_configs(st))
    assert [j.task for j in jobs].index("backward") > [j.task for j in jobs].index("stage")
    assert runner.Job.from_json(back[0].to_json()) == back[0]
    assert not [j for j in runner.plan([fl.stage(8)]) if j.task == "backward"]
    alone = [j for j in runner.plan([st], with_baselines=False) if j.task == "backward"]
    assert set(alone[0].baselines) == {"sdpa_flash", "sdpa_cudnn"}


class _Recorded(torch.autograd.Function):
    """A CPU stand-in for a stage with a backward pass: naive attention whose backward can be
    told to drop dK (a defect check_training must catch)."""
    drop = False

    @staticmethod
    def forward(ctx, q, k, v, causal):
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return naive_attention(q, k, v, causal)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            dq, dk, dv = torch.autograd.grad(naive_attention(*leaves, ctx.causal), leaves, do)
        return dq, torch.zeros_like(dk) if _Recorded.drop else dk, dv, None


def _trained(q, k, v, causal=False):
    return _Recorded.apply(q, k, v, causal)


@pytest.mark.parametrize("drop", [False, True])
def test_check_training_passes_autograd_and_fails_a_dropped_gradient(drop, monkeypatch):
    monkeypatch.setattr(_Recorded, "drop", drop)
    res = check_training(_trained, dtype="fp32", head_dims=(16,), shapes=((1, 2, 9), (2, 1, 33)),
                         strided_shapes=((2, 2, 9),), device="cpu", seed=3)
    assert res.passed != drop, str(res)
    if drop:
        assert {c.what for c in res.failures()} == {"dk"}
    assert {c.layout for c in res.cases} == {"contiguous", "bnhd"}
    assert pd.Series([c.what for c in res.cases]).value_counts()["o"] == 6


def test_a_stage_measured_alone_elsewhere_does_not_move_the_ladder(empty_data_dir):
    """The views of every stage show the GPU that last recorded the last stage timed over the
    sweep; a stage recorded later on another GPU shows there in its own view only."""
    from flashlab.stages import fastest_forward
    last, st = fastest_forward(), BACKWARD[0]
    base = dict(dtype="fp16", B=4, H=16, N=1024, D=64, causal=False, kind="stage", status="ok",
                median_ms=1.0, tflops=1.0)
    tables.RESULTS.upsert([dict(base, stage=last.slug, gpu="A", time="2030-01-01T00:00:00Z"),
                           dict(base, stage=st.slug, gpu="B", time="2030-02-01T00:00:00Z")])
    assert tables.gpu_shown() == "A" and tables.gpu_shown(st) == "B"


def test_the_readme_backward_table_on_synthetic_rows(empty_data_dir):
    from flashlab import readme
    st = BACKWARD[0]
    assert "has not been measured yet" in readme.backward_table()
    t = teaching("fp16")
    base = dict(dtype="fp16", B=t.B, H=t.H, N=t.N, D=t.D, causal=False, gpu="G", status="ok",
                commit="abc", time="2030-01-01T00:00:00Z")
    rows = [dict(base, stage=st.slug, kind="stage", median_ms=ms, tflops=tf, **{"pass": p})
            for p, ms, tf in (("backward", 20.0, 13.7), ("forward", 0.4, 300.0),
                              ("forward_lse", 0.41, 293.0))]
    rows += [dict(base, stage=b, kind="baseline", median_ms=ms, tflops=tf, **{"pass": "backward"})
             for b, ms, tf in (("sdpa_flash", 1.5, 220.0), ("sdpa_cudnn", 0.9, 360.0))]
    tables.RESULTS.upsert(rows)
    table = readme.backward_table()
    assert f"| **{st.slug}** | fp16 | – | 20.000 | 13.7 | 0.400 | 0.410 |" in table
    assert "| `sdpa_flash` | fp16 | – | 1.500 | 220.0 | – | – |" in table
    assert "measured on **G** (commit `abc`)" in table


def test_a_stage_timed_at_a_config_elsewhere_keeps_its_views_on_its_sweep(empty_data_dir):
    """A stage's own views show the GPU that last timed it over the sweep: a later row at the
    teaching config on another GPU (what the log-sum-exp costs, say) does not move them. A stage
    never timed over the sweep shows where it was recorded last."""
    from flashlab.configs import sweep
    st, other = fl.stage("05"), fl.stage("01")
    s, t = sweep("fp16")[0], teaching("fp16")
    base = dict(kind="stage", status="ok", median_ms=1.0, tflops=1.0, dtype="fp16")
    at = lambda c: dict(B=c.B, H=c.H, N=c.N, D=c.D, causal=c.causal)  # noqa: E731
    tables.RESULTS.upsert([
        dict(base, stage=st.slug, gpu="A", time="2030-01-01T00:00:00Z", **at(s)),
        dict(base, stage=st.slug, gpu="B", time="2030-02-01T00:00:00Z", **at(t)),
        dict(base, stage=other.slug, gpu="A", time="2030-01-01T00:00:00Z", **at(t)),
        dict(base, stage=other.slug, gpu="B", time="2030-02-01T00:00:00Z", **at(t))])
    assert tables.gpu_shown(st) == "A" and tables.gpu_shown(other) == "B"


def test_the_readme_lse_table_pairs_rows_timed_in_one_run(empty_data_dir):
    from flashlab import readme
    assert "Not measured yet" in readme.lse_table()
    t = teaching("fp16")
    base = dict(stage="05_mma", kind="stage", dtype="fp16", B=t.B, H=t.H, N=t.N, D=t.D,
                causal=False, gpu="G", status="ok", commit="abc", time="2030-01-01T00:00:00Z")
    tables.RESULTS.upsert([dict(base, median_ms=0.40, tflops=1.0, **{"pass": "forward"}),
                           dict(base, median_ms=0.41, tflops=1.0, **{"pass": "forward_lse"})])
    table = readme.lse_table()
    assert "| 05_mma | +2.5% | – |" in table and "measured on **G** (commit `abc`)" in table
    cost = tables.lse_cost(["05_mma"])
    assert cost["forward_ms"].iloc[0] == 0.40 and cost["forward_lse_ms"].iloc[0] == 0.41
    # a later forward at that key, from another run, is not what the lse was timed against
    tables.RESULTS.upsert([dict(base, median_ms=0.30, tflops=1.0, time="2030-02-01T00:00:00Z",
                                **{"pass": "forward"})])
    assert tables.lse_cost(["05_mma"])["forward_ms"].isna().all()
    assert "Not measured yet" in readme.lse_table()


def test_a_backward_notebook_summary_reports_the_backward(empty_data_dir, capsys):
    """nb.reached on a stage with a backward: its backward (its forward is stage 08's), beside
    the previous backward stage's and SDPA's backwards timed in the same run, never another's."""
    import pandas as pd

    from flashlab import notebook as nb
    from flashlab import tables
    t = fl.teaching("fp16")
    rows = [dict(stage=s, kind=k, dtype="fp16", B=t.B, H=t.H, N=t.N, D=t.D, causal=False,
                 median_ms=ms, tflops=10.0 / ms, gpu="G", status="ok", time=when,
                 **{"pass": "backward"})
            for s, k, ms, when in (("14_backward", "stage", 4.0, "t1"),
                                   ("15_backward_mma", "stage", 1.0, "t1"),
                                   ("sdpa_flash", "baseline", 0.5, "t1"),
                                   ("sdpa_cudnn", "baseline", 0.25, "t2"))]
    rows.append({**rows[1], "pass": "forward", "median_ms": 0.1})  # the notebook's GPU: G
    rows.append({**rows[1], "dtype": "bf16"})
    tables.RESULTS.upsert(pd.DataFrame(rows))
    nb.banner("15_backward_mma")
    capsys.readouterr()
    nb.reached("15_backward_mma")
    out = capsys.readouterr().out
    assert "15_backward_mma's backward reached 10 TFLOP/s" in out, out
    assert "4.00× faster than 14_backward's" in out and "2× slower than sdpa_flash's" in out
    assert "sdpa_cudnn" not in out  # timed in another run
    assert "reached 10 TFLOP/s (1 ms) in bf16." in out, out  # nothing beside it in bf16


def test_a_backward_is_compared_only_with_what_ran_in_its_run():
    """BackwardEvaluation.ratio / versus: rows of the same run (time stamp) only; another run's
    row is named as not timed with it, never divided into."""
    import pandas as pd

    from flashlab import tables
    from flashlab.notebook.measured import BackwardEvaluation
    rows = pd.DataFrame([dict(stage=s, dtype="fp16", causal=False, median_ms=ms, time=when,
                              **{"pass": "backward"})
                         for s, ms, when in (("15_backward_mma", 1.0, "t1"), ("sdpa_flash", 0.5, "t1"),
                                             ("14_backward", 13.0, "t0"))])
    ev = BackwardEvaluation("15_backward_mma", False, [], rows)
    assert ev.ratio("sdpa_flash") == 0.5
    with pytest.raises(tables.NotRecorded, match="not timed in the run that timed 15_backward_mma"):
        ev.ratio("14_backward")
    assert ev.versus(("sdpa_flash", "14_backward")) == "0.5x sdpa_flash, 14_backward not timed in this run"


@pytest.mark.parametrize("st", [s for s in fl.stages() if s.has_backward], ids=lambda s: s.slug)
def test_the_sanitizers_backward_filter_reaches_every_backward_kernel(st):
    """tests/test_gpu.py instruments a backward under compute-sanitizer by a name substring (the
    registry's backward_prefix): every __global__ function of the file but the forward must
    contain it, or that kernel would run unchecked."""
    prefix = st.backward_prefix
    names = set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(",
                           st.text))  # the stage files it includes too (stage 13's forward)
    assert st.kernel in names and st.backward in names
    assert len(names) > 2  # the passes around the backward kernel are found too
    assert all(prefix in n for n in names - {st.kernel}), names


def test_a_backward_notebook_times_its_whole_ladder_in_one_run(monkeypatch):
    """evaluate_backward of a later rung times every earlier backward stage too: run live in
    order, the last notebook's run holds each earlier notebook's comparisons (the table keeps a
    key's latest row, so timing a stage alone would orphan the rows an earlier notebook set
    beside it)."""
    from flashlab.notebook import measured
    from flashlab.stages import backward_ladder, before
    for st in BACKWARD:
        ladder = backward_ladder(st)
        assert ladder[0] == st and all(s.has_backward for s in ladder)
        # every earlier backward, latest first: what each earlier notebook compares is in it
        assert ladder == [s for s in reversed(BACKWARD) if s.number <= st.number]
        assert all(before(s) in ladder for s in ladder if before(s).has_backward)
    seen = {}
    monkeypatch.setattr(tables, "live", lambda st: True)
    monkeypatch.setattr(tables, "gpu_shown", lambda st: "GPU")
    monkeypatch.setattr(measure, "measure_backward",
                        lambda timed, log: seen.setdefault("timed", list(timed)) and ([], None))
    last = BACKWARD[-1]
    measured.evaluate_backward(last.slug)
    assert seen["timed"] == backward_ladder(last)


@pytest.mark.parametrize("st", [s for s in fl.stages() if s.has_backward], ids=lambda s: s.slug)
def test_a_stage_that_says_grad_strides_reads_them(st):
    """The registry's grad_strides and the .cu agree: a stage given dO and gradients laid out as
    its model's tensors must read dO and write every gradient with the problem's strides (a stage
    that ignored them would read or write a contiguous tensor where it lies otherwise)."""
    names = ["dq_strides", "dk_strides", "dv_strides", "dout_strides"]
    reads = [name for name in names if name in st.text]
    assert reads == (names if st.grad_strides else []), st.slug
    if st.grad_strides:
        assert st.row_strides  # its inputs are views a model hands over too


def _setmaxnreg_budget(text):
    """(threads, producer, consumer registers) of a warp-specialized backward's block, as its .cu
    sets them, or None where it sets none."""
    threads = re.search(r"static constexpr int THREADS = (\d+);", text)
    regs = re.search(r"static constexpr int PRODUCER_REGS = (\d+), CONSUMER_REGS = (\d+);", text)
    return (int(threads[1]), int(regs[1]), int(regs[2])) if threads and regs else None


def _consumers_get_their_registers(threads, producer, consumer):
    """setmaxnreg.inc only takes what setmaxnreg.dec gave back: the launch holds `threads` x
    (65536 / threads, down to a multiple of 8) registers, and nothing more is ever added. A block
    that asks for more waits forever (stage 20 with a 32-register producer and 240-register
    consumers hung on the H200). The rule is stage 11's, warpspec.consumer_registers."""
    from flashlab import warpspec
    return consumer <= warpspec.consumer_registers((threads - 128) // 128, producer)


def test_the_setmaxnreg_rule_tells_a_block_that_would_hang():
    assert _consumers_get_their_registers(384, 24, 240)
    assert _consumers_get_their_registers(384, 56, 224)
    assert not _consumers_get_their_registers(384, 32, 240)  # (65536 - 128 x 32) / 256 is 240
    assert not _consumers_get_their_registers(384, 48, 232)


@pytest.mark.parametrize("st", [st for st in BACKWARD if "setmaxnreg_inc" in st.source.read_text()],
                         ids=lambda st: st.slug)
def test_a_warp_specialized_backward_gives_its_consumers_only_what_its_producer_gave_back(st):
    text = st.source.read_text()
    budget = _setmaxnreg_budget(text)
    assert budget, f"{st.slug}: THREADS, PRODUCER_REGS and CONSUMER_REGS not found in its block"
    assert _consumers_get_their_registers(*budget), f"{st.slug}: setmaxnreg.inc would wait forever"
    assert "the consumers would wait for registers" in text  # and nvcc says so too


def test_the_lesson_splits_the_registers_as_stage_20_does():
    from flashlab import warpspec_backward
    threads, producer, consumer = _setmaxnreg_budget(fl.stage(20).source.read_text())
    after = warpspec_backward.registers().loc["20: after setmaxnreg"]
    assert (after["a producer thread"], after["a consumer thread"]) == (producer, consumer)


def test_the_backward_sweep_tool_refuses_a_stage_without_a_backward():
    """tools/backward_sweep.py (the acceptance run of the Hopper backward, on a GPU): a stage with
    no backward pass is refused in one line, before anything is built or timed."""
    import subprocess
    import sys
    from flashlab import paths
    proc = subprocess.run([sys.executable, str(paths.ROOT / "tools" / "backward_sweep.py"), "23", "13"],
                          capture_output=True, text=True, cwd=paths.ROOT, timeout=120)
    assert proc.returncode == 2, proc
    assert "13_lazy_rescale has none" in proc.stderr and "Traceback" not in proc.stderr
