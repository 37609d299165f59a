"""Without a GPU, flashlab replays what data/ holds: `flashlab run`, the other commands, and the
figures, all against a temporary copy of data/ (FLASHLAB_DATA)."""
import argparse
import os
import shutil
import subprocess
import sys
import sysconfig

import matplotlib
import pytest

matplotlib.use("Agg")  # before pyplot is imported: no screen needed

import flashlab as fl  # noqa: E402
from flashlab import cli, paths, plots, runner, tables  # noqa: E402
from flashlab.tables import RESULTS as results  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
FIGURES = ("ladder.png", "scaling.png", "roofline.png")
# `python -m flashlab` from another directory must run this checkout, not whichever flashlab
# pip last installed in editable mode.
CHECKOUT = {"PYTHONPATH": os.pathsep.join(filter(None, [str(paths.ROOT),
                                                        os.environ.get("PYTHONPATH")]))}


def drawn():
    """The figures save_all draws from the copy of data/: the three above, plus the profile's
    once data/ holds a profile.csv."""
    names = [f"{name}.png" for name in plots.drawings()]
    assert set(FIGURES) <= set(names)
    return names


def flashlab(*args, data, cwd):
    """`python -m flashlab ARGS` in a fresh process that sees no GPU, even on a machine with one."""
    env = dict(os.environ, FLASHLAB_DATA=str(data), CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg",
               PYTHONUNBUFFERED="1", **CHECKOUT)
    return subprocess.run([sys.executable, "-m", "flashlab", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def assert_png(path):
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000, path


def test_run_replays_the_recorded_table(data_dir, tmp_path):
    for name in FIGURES:
        (data_dir / "figures" / name).unlink()
    kept = {p.name: p.read_bytes() for p in (data_dir / "figures").glob("*.png")}
    assert kept  # figures a run recorded: a replay must leave them as they are
    proc = flashlab("run", data=data_dir, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("No CUDA GPU"), proc.stdout
    assert str(data_dir / "results.csv") in lines[0]
    recorded = results.load()
    gpu = tables.gpu_shown()
    assert gpu in lines[0] and lines[1] == gpu
    # then the table itself: every stage at the teaching config
    header = lines[2].split()
    assert header[:5] == ["stage", "dtype", "causal", "N", "D"]
    body = "\n".join(lines[3:])
    teaching = recorded[(recorded["gpu"] == gpu) & (recorded["N"] == 1024) & (recorded["B"] == 4)]
    for stage in teaching["stage"].unique():
        assert stage in body
    assert "Traceback" not in proc.stderr
    # and the backward passes, each beside cuDNN's backward timed in turn with it
    assert "backward passes, B=4 H=16 N=1024 D=64 fp16" in proc.stdout
    for st in [s for s in fl.stages() if s.has_backward]:
        if len(tables.backward_at_teaching().query("stage == @st.slug")):
            assert st.slug in proc.stdout.split("backward passes")[1]
    for name in FIGURES:
        assert_png(data_dir / "figures" / name)
    assert lines[-1].startswith("figures: ")
    assert {name: (data_dir / "figures" / name).read_bytes() for name in kept} == kept


def test_run_with_nothing_recorded(empty_data_dir, tmp_path):
    proc = flashlab("run", data=empty_data_dir, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("No CUDA GPU") and "nothing recorded yet" in lines[0]
    assert "(no recorded results)" in proc.stdout


def test_check_without_a_gpu_is_one_line(data_dir, tmp_path):
    proc = flashlab("check", "03", data=data_dir, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "CUDA GPU" in err[0], proc.stderr
    assert proc.stdout == ""


def test_bench_without_a_gpu_is_one_line(data_dir, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["bench", "03", "--N", "512"]) != 0
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and "CUDA GPU" in out.err


def test_help(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashlab", "--help"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env=dict(os.environ, **CHECKOUT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: flashlab")
    for command in SUBCOMMANDS:
        assert f"flashlab {command}" in proc.stdout


SUBCOMMANDS = sorted(next(a for a in cli.parser()._actions
                          if isinstance(a, argparse._SubParsersAction)).choices)


def test_the_subcommands():
    assert set(SUBCOMMANDS) == {"list", "run", "profile", "check", "bench", "plot", "table", "report",
                                "sass", "readme", "tune", "student", "grade", "leaderboard",
                                "model", "nbgrader", "new-stage"}


def test_model_without_a_gpu_shows_what_is_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHLAB_DATA", str(tmp_path))
    assert cli.main(["model", "--gpu", "NVIDIA H100 80GB HBM3"]) == 2
    assert "no model measurements on NVIDIA H100 80GB HBM3: run `flashlab model`" in \
        capsys.readouterr().err
    from flashlab import tables
    tables.MODEL.upsert([dict(model="gpt2", impl=i, kind=k, dtype="fp16", batch=8, seq=1024,
                              n_layer=12, n_head=12, head_dim=64, max_abs_diff=d, forward_ms=ms,
                              input_copies=0, gpu="NVIDIA H100 80GB HBM3", commit="abc")
                         for i, k, d, ms in (("08_tuned", "stage", 0.01, 9.0),
                                             ("sdpa", "baseline", 0.0, 10.0),
                                             ("eager", "baseline", 0.01, 20.0))])
    assert cli.main(["model", "--gpu", "NVIDIA H100 80GB HBM3"]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[0] for ln in out.splitlines()[2:]] == ["sdpa", "eager", "08_tuned"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: flashlab {command}")


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([])
    assert exit_.value.code == 2
    assert "usage: flashlab" in capsys.readouterr().err


def _script():
    """The `flashlab` console script of this Python's installation, if pip installed one."""
    here = os.path.join(sysconfig.get_path("scripts"), "flashlab")
    return here if os.path.exists(here) else shutil.which("flashlab")


@pytest.mark.skipif(_script() is None, reason="the flashlab script is not installed "
                    "(pip install -e .)")
def test_console_script(tmp_path):
    proc = subprocess.run([_script(), "list"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "01_naive" in proc.stdout


def test_list(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    import flashlab as fl
    slugs = [line.split()[0] for line in out.splitlines() if line and not line[0].isspace()]
    assert slugs == [st.slug for st in fl.stages()]
    for st in fl.stages():
        assert st.idea in out


def test_table(data_dir, capsys):
    assert cli.main(["table"]) == 0
    out = capsys.readouterr().out
    df = results.load()
    gpu = tables.gpu_shown()
    assert out.splitlines()[0] == gpu
    assert out == runner.table() + "\n"
    for col in ("stage", "TFLOP/s", "% best SDPA", "rel_err", "status"):
        assert col in out.splitlines()[1]
    assert "16384" not in out  # the teaching config only, by default
    assert cli.main(["table", "--all"]) == 0
    everything = capsys.readouterr().out
    if (df["N"] == 16384).any():
        assert "16384" in everything
    assert cli.main(["table", "--gpu", "no such GPU"]) == 0
    assert "(no recorded results on no such GPU)" in capsys.readouterr().out


def test_plot(data_dir, capsys):
    for name in FIGURES:
        (data_dir / "figures" / name).unlink()
    assert cli.main(["plot"]) == 0
    out = capsys.readouterr().out.split()
    assert sorted(out) == sorted(str(data_dir / "figures" / name) for name in drawn())
    for name in drawn():
        assert_png(data_dir / "figures" / name)


def test_plot_with_nothing_recorded(empty_data_dir, capsys):
    assert cli.main(["plot"]) == 0
    assert "nothing recorded to plot" in capsys.readouterr().out
    assert not (empty_data_dir / "figures").exists() or not list((empty_data_dir / "figures").iterdir())


def test_figures_render_from_recorded_data(data_dir, tmp_path):
    out = tmp_path / "figs"
    written = plots.save_all(outdir=out)
    assert sorted(p.name for p in written) == sorted(drawn())
    for name in drawn():
        assert_png(out / name)
    # each figure function also returns a figure for a notebook to show
    import matplotlib.pyplot as plt
    df = results.load()
    for name, draw in plots.FIGURES.items():
        fig = draw(df)
        assert fig.axes, name
        plt.close(fig)


def test_replay_in_process(data_dir):
    printed = []
    df = runner.replay(out=printed.append)
    assert printed[0].startswith("No CUDA GPU")
    assert printed[1] == runner.table(df)
    assert printed[2] == runner.backward_table() and "23_tma_store_backward" in printed[2]
    assert len(df) == len(results.load())


def test_run_times_only_the_baselines_asked_for(monkeypatch, data_dir):
    """`flashlab run --baseline sdpa_cudnn`: the baselines job gets the names; a wrong one is a
    ValueError naming the baselines there are."""
    from flashlab import runner
    monkeypatch.setattr(runner, "gpu_available", lambda: True)
    monkeypatch.setattr(runner.plots, "save_all", lambda df: [])
    jobs = []
    monkeypatch.setattr(runner, "_job", lambda job, log, out: jobs.append(job) or 0)
    runner.run(["01"], baselines=["sdpa_flash", "sdpa_cudnn"], progress=False, out=lambda m: None)
    assert {j.baselines for j in jobs if j.task == "baselines"} == {("sdpa_flash", "sdpa_cudnn")}
    with pytest.raises(ValueError, match="sdpa_flash, sdpa_cudnn"):
        runner.run(["01"], baselines=["sdpa_nope"], progress=False, out=lambda m: None)
