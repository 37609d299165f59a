"""Adding a stage is what README.md's "Adding a stage" says: `flashlab new-stage NN toy --from 03`
writes its kernels/NN_toy.cu, its entry in flashlab/stages.py, its notebook source and its row in
TEACHING.md's course map; the commands it prints record it. In a copy of the repository, a toy
stage added that way is listed, compiled, its machine code found, tabulated and plotted, its
notebook built — and the whole CPU suite passes there. On a GPU it builds, checks, times and
records."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashlab import build, paths, scaffold
from flashlab.stages import stage, stages

NUM = max(st.number for st in stages()) + 1  # the toy comes after the last stage
NN = f"{NUM:02d}"
FROM = "03"  # not the stage before it: the toy builds on 03 (builds_on), its kernel compiles fast


def _toy(text):
    return text.replace("@NUM@", str(NUM)).replace("@NN@", NN)


IN_THE_COPY = _toy(r'''
import sys
from pathlib import Path
import flashlab as fl
from flashlab import build, plots, ptxas, readme, runner, sass, tables

assert Path(fl.__file__).parent == Path.cwd() / "flashlab", fl.__file__
st = fl.stage(@NUM@)
assert fl.stages()[-1] is st and st.source == Path.cwd() / "kernels" / "@NN@_toy.cu"
from flashlab.stages import before
assert before(st) is fl.stage(3), before(st)
if "--gpu" in sys.argv:  # live: build, check, time and record it, then see it in the table
    chk, df = fl.measure_stage(st, [fl.teaching()], log=print)
    assert chk.passed and df["status"].tolist() == ["ok"], df
    assert len(fl.recorded("@NN@_toy", gpu=tables.gpu_shown(st))) == 1
    assert "@NN@_toy" in runner.table() and "@NN@_toy" in readme.stage_table()
else:  # replay: synthetic rows for every stage, the toy's among them
    rows = []
    for i, s in enumerate(fl.stages()):
        cfg = fl.teaching(s.dtypes[0])
        rows.append(dict(stage=s.slug, kind="stage", dtype=cfg.dtype, B=cfg.B, H=cfg.H, N=cfg.N,
                         D=cfg.D, causal=False, gpu="Toy GPU", status="ok", median_ms=1.0 / (i + 1),
                         tflops=float(i + 1), rel_err=1e-7, compute_capability="9.0",
                         time="2030-01-01T00:00:00Z"))
    tables.RESULTS.upsert(rows)
    assert "@NN@_toy" in runner.table(), runner.table()
    assert "@NN@_toy" in readme.stage_table()
    labels = [t.get_text() for t in plots.ladder().axes[0].get_xticklabels()]
    assert any(label.startswith("@NN@") for label in labels), labels
if build.nvcc():
    cfg = fl.teaching()
    k = ptxas.kernel_at(st, ptxas.resources(st.source, "sm_80"), cfg)
    assert k.kernel.startswith("void toy_kernel<64,"), k.kernel
    try:
        ev = sass.evidence(st, "sm_80")
    except FileNotFoundError:
        ev = None
    if ev is not None:
        for cat, wanted in st.sass_evidence.items():
            assert bool(ev[cat].all()) == wanted if wanted else not ev[cat].any(), cat
print("the toy stage went everywhere")
''')


def _tracked(root: Path) -> list:
    """The files a clone of the repository has (tracked, as they are in the working tree), and
    the untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def _copy(tmp_path) -> Path:
    repo = tmp_path / "repo"
    if (paths.ROOT / ".git").exists():
        for f in _tracked(paths.ROOT):
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(paths.ROOT / f, repo / f)
    else:
        shutil.copytree(paths.ROOT, repo, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _commit(repo, "the repository")
    return repo


def _commit(repo, message):
    """Commit everything in the copy (an edition is written from what git tracks)."""
    git = ["git", "-c", "user.name=flashlab", "-c", "user.email=flashlab@localhost"]
    if not (repo / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", message], cwd=repo, check=True)


def _run(repo, tmp_path, *args, timeout=600, data=True, **extra):
    env = dict(os.environ, PYTHONPATH=str(repo), MPLBACKEND="Agg", **extra)
    if data:
        env["FLASHLAB_DATA"] = str(tmp_path / "data")
    else:
        env.pop("FLASHLAB_DATA", None)
    env.pop("FLASHLAB_GPU", None)
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _with_a_toy_stage(tmp_path) -> Path:
    """A copy of the repository, and a toy stage added to it by `flashlab new-stage`."""
    repo = _copy(tmp_path)
    made = _run(repo, tmp_path, "-m", "flashlab", "new-stage", NN, "toy", "--from", FROM,
                "--title", "Toy", "--idea", "stage 03 under another name")
    assert made.returncode == 0, made.stdout + made.stderr
    assert made.stdout.startswith(f"wrote kernels/{NN}_toy.cu, flashlab/stages.py, "
                                  f"notebooks/src/{NN}_toy.py, notebooks/TEACHING.md"), made.stdout
    return repo


def test_new_stage_writes_what_readme_says_and_refuses_what_it_cannot(tmp_path):
    """README's section names the files the scaffold writes and the commands it prints; a
    number or name taken, or a bad name, is a ValueError and writes nothing."""
    readme = (paths.ROOT / "README.md").read_text()
    section = readme.split("## Adding a stage", 1)[1].split("\n## ", 1)[0]
    assert "flashlab new-stage" in section
    for step in scaffold.next_steps(NUM, "toy", stage(FROM)).splitlines():
        command = step.split("#")[0].strip().replace(NN, "NN").replace("toy", "slug")
        assert command.split(" NN")[0] in section, command
    for what in ("kernels/NN_slug.cu", "flashlab/stages.py", "notebooks/src/NN_slug.py",
                 "TEACHING.md"):
        assert what in section, what
    repo = _copy(tmp_path)
    for args, why in ((["3", "again"], "stage 03 exists"), ([NN, "Bad-Name"], "lower_case"),
                      ([NN, "toy", "--from", "77"], "no stage 77")):
        full = [*args, "--from", FROM] if "--from" not in args else args
        res = _run(repo, tmp_path, "-m", "flashlab", "new-stage", *full)
        assert res.returncode != 0 and why in res.stderr, res.stderr
    assert not (repo / "kernels" / f"{NN}_toy.cu").exists()


@pytest.mark.slow
def test_a_new_stage_goes_everywhere(tmp_path):
    repo = _with_a_toy_stage(tmp_path)
    listed = _run(repo, tmp_path, "-m", "flashlab", "list")
    assert listed.returncode == 0 and f"{NN}_toy" in listed.stdout, listed.stderr
    went = _run(repo, tmp_path, "-c", IN_THE_COPY)
    assert went.returncode == 0 and "went everywhere" in went.stdout, went.stdout + went.stderr
    built = _run(repo, tmp_path, "tools/notebooks.py", "build", NN)
    assert built.returncode == 0 and (repo / "notebooks" / f"{NN}_toy.ipynb").exists(), built.stderr


@pytest.mark.slow
@pytest.mark.skipif(not build.nvcc(), reason="recording a stage's SASS needs nvcc")
def test_a_new_stage_passes_the_whole_cpu_suite(tmp_path):
    """The scaffold, then the commands it prints that need no GPU, then every CPU test of the
    copy (but this file's, which would add a toy to the toy's copy). Cases parametrized by
    another stage are left out there (FLASHLAB_TEST_STAGES, tests/conftest.py): their code and
    kernels are the outer run's, which runs them; tests over every stage at once all run."""
    repo = _with_a_toy_stage(tmp_path)
    for step in scaffold.next_steps(NUM, "toy", stage(FROM)).splitlines():
        command = step.split("#")[0].split()
        if "GPU" in step:
            continue
        if command[0] == "git":
            _commit(repo, f"stage {NN}: toy")
            continue
        args = ["-m", "flashlab", *command[1:]] if command[0] == "flashlab" else command[1:]
        done = _run(repo, tmp_path, *args, data=False)
        assert done.returncode == 0, (step, done.stdout[-2000:], done.stderr[-2000:])
    _commit(repo, f"stage {NN}: recorded")
    suite = _run(repo, tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "-n", "auto", "--maxprocesses=4", "--ignore", "tests/test_new_stage.py",
                 timeout=3600, data=False, FLASHLAB_TEST_STAGES=NN)
    assert suite.returncode == 0, suite.stdout[-6000:] + suite.stderr[-3000:]


@pytest.mark.gpu
def test_a_new_stage_runs_on_the_gpu(tmp_path):
    repo = _with_a_toy_stage(tmp_path)
    went = _run(repo, tmp_path, "-c", IN_THE_COPY, "--gpu")
    assert went.returncode == 0 and "went everywhere" in went.stdout, went.stdout + went.stderr
