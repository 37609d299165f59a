"""Adding a stage is three files (README.md, "Adding a stage"): its kernels/NN_slug.cu, its entry
in flashlab/stages.py and its notebook source. A toy stage after the last (stage 03 under another name) is
added to a copy of the repository in exactly those three files; the copy then lists it, compiles
it and finds its machine code, tabulates and plots it, builds its notebook and passes the
registry's own tests — and, on a GPU, builds, checks, times and records it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashlab import build, paths
from flashlab.stages import stages

NUM = max(st.number for st in stages()) + 1  # the toy comes after the last stage
NN = f"{NUM:02d}"


def _toy(text):
    return text.replace("@NUM@", str(NUM)).replace("@NN@", NN)


TOY_ENTRY = _toy('''    Stage(@NUM@, "@NN@_toy", "Toy", "stage 03 under another name, to show what a new stage takes",
          ("fp32",), (64, 128), any_head_dim=False, kernel="toy_kernel",
          template=("D", "BR", "BC"), min_cc=(7, 5), idea_metrics=("sm_throughput_pct",),
          sass={"HMMA": False, "LDG.E.128": True, "SHFL": True}),
)
''')
TOY_NOTEBOOK = _toy('''# %% [markdown]
# # @NN@ · Toy
#
# Stage 03 under another name.

# %%
from flashlab import notebook as nb
nb.banner("@NN@_toy")

# %%
print(nb.evaluate("@NN@_toy"))
''')
IN_THE_COPY = _toy(r'''
import sys
from pathlib import Path
import flashlab as fl
from flashlab import build, plots, ptxas, readme, runner, sass, tables

assert Path(fl.__file__).parent == Path.cwd() / "flashlab", fl.__file__
st = fl.stage(@NUM@)
assert fl.stages()[-1] is st and st.source == Path.cwd() / "kernels" / "@NN@_toy.cu"
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


def _copy_with_a_toy_stage(tmp_path) -> Path:
    repo = tmp_path / "repo"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for d in ("flashlab", "kernels", "notebooks/src", "tools", "tests"):
        shutil.copytree(paths.ROOT / d, repo / d, ignore=skip)
    for f in ("README.md", "pyproject.toml", "notebooks/jupytext.toml"):  # jupytext pairs the notebooks
        shutil.copy(paths.ROOT / f, repo / f)
    # 1. the kernel
    cu = (repo / "kernels" / "03_coarsened.cu").read_text()
    (repo / "kernels" / f"{NN}_toy.cu").write_text(cu.replace("coarsened_kernel", "toy_kernel")
                                                .replace("stage 03", f"stage {NN}"))
    # 2. the registry entry
    registry = repo / "flashlab" / "stages.py"
    text = registry.read_text()
    end = text.index("\n)\n", text.index("_STAGES = ("))
    registry.write_text(text[:end + 1] + TOY_ENTRY + text[end + 3:])
    # 3. the notebook source
    (repo / "notebooks" / "src" / f"{NN}_toy.py").write_text(TOY_NOTEBOOK)
    return repo


def _run(repo, tmp_path, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(repo), FLASHLAB_DATA=str(tmp_path / "data"),
               MPLBACKEND="Agg")
    env.pop("FLASHLAB_GPU", None)
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_new_stage_is_three_files(tmp_path):
    repo = _copy_with_a_toy_stage(tmp_path)
    listed = _run(repo, tmp_path, "-m", "flashlab", "list")
    assert listed.returncode == 0 and f"{NN}_toy" in listed.stdout, listed.stderr
    went = _run(repo, tmp_path, "-c", IN_THE_COPY)
    assert went.returncode == 0 and "went everywhere" in went.stdout, went.stdout + went.stderr
    built = _run(repo, tmp_path, "tools/notebooks.py", "build", NN)
    assert built.returncode == 0 and (repo / "notebooks" / f"{NN}_toy.ipynb").exists(), built.stderr
    own = _run(repo, tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/test_stages.py", "tests/test_layers.py", "tests/test_profile.py")
    assert own.returncode == 0, own.stdout[-3000:] + own.stderr[-2000:]
    if build.nvcc():
        sass = _run(repo, tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/test_sass.py", "tests/test_ptxas.py", "-k", f"{NN}_toy and not recorded")
        assert sass.returncode == 0 and " passed" in sass.stdout, sass.stdout[-3000:] + sass.stderr[-2000:]


@pytest.mark.gpu
def test_a_new_stage_runs_on_the_gpu(tmp_path):
    repo = _copy_with_a_toy_stage(tmp_path)
    went = _run(repo, tmp_path, "-c", IN_THE_COPY, "--gpu")
    assert went.returncode == 0 and "went everywhere" in went.stdout, went.stdout + went.stderr
