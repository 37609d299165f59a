"""The kernel exercises and the student edition: the exercise regions in kernels/ are well formed
and only comments in the solution edition (same machine code), the student edition replaces
exactly those regions with stubs that compile (sm_80, sm_90 and each stage's oldest target), its
notebooks carry no outputs and no solutions, and grading names the first wrong element. On a GPU:
the solution edition passes every kernel exercise and the student edition fails every one."""
import ast
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

import flashlab as fl
from flashlab import build, paths, ptxas, sass
from flashlab.course import Exercise, Result
from flashlab.course import kernels as K
from flashlab.course import student

from conftest import NVCC, needs_nvcc

try:
    CUOBJDUMP = sass.cuobjdump()
except FileNotFoundError:
    CUOBJDUMP = None
needs_cuobjdump = pytest.mark.skipif(NVCC is None or CUOBJDUMP is None,
                                     reason="nvcc or cuobjdump not found")

KERNELS = paths.KERNELS
MARKED = sorted(K.stage_regions())                       # stages whose kernel has regions
ARCHS = [(st.slug, arch) for st in fl.stages()
         for arch in sorted({*st.static_archs, st.arch(st.min_cc)})]


def _text(slug, root=paths.ROOT):
    return (Path(root) / "kernels" / f"{slug}.cu").read_text()


# --- the regions -----------------------------------------------------------------------------------

def test_every_stage_after_01_has_an_exercise():
    assert MARKED == [st.slug for st in fl.stages() if st.number >= 2]


@pytest.mark.parametrize("slug", MARKED)
def test_regions_are_well_formed(slug):
    found = K.regions(_text(slug), slug, solution=True)   # MarkerError if not
    assert 1 <= len(found) <= 2
    for r in found:
        assert r.id.startswith(slug[:2] + "."), f"{r.id} is in {slug}.cu"
        assert r.task and r.stub and not r.unwritten
        assert r.stub[0].strip().startswith(K.TODO)
        assert any(line.strip() and not line.strip().startswith("//") for line in r.body)


def test_every_region_is_an_exercise_and_every_kernel_exercise_a_region():
    regions = {r.id: slug for slug in MARKED for r in K.regions(_text(slug))}
    exercises = {ex.id: ex.stage for ex in K.KERNEL_EXERCISES}
    assert regions == exercises
    assert len(exercises) == len(K.KERNEL_EXERCISES)          # ids unique
    for ex in K.KERNEL_EXERCISES:
        assert isinstance(ex, Exercise) and ex.kind == "kernel" and ex.points > 0
        assert fl.stage(ex.stage).slug == ex.stage
    stages = [ex.stage for ex in K.KERNEL_EXERCISES]
    assert stages == sorted(stages)


@pytest.mark.parametrize("slug", MARKED)
def test_markers_are_whole_comment_lines(slug):
    """Everything strip_markers removes is a comment line, so the solution edition's code is the
    code without the markers."""
    text = _text(slug)
    kept = K.strip_markers(text).splitlines()
    lines = text.splitlines()
    removed = list(lines)
    for line in kept:  # kept is lines minus the marker lines, in order
        removed.remove(line)
    assert removed and all(line.strip().startswith("//") for line in removed)
    assert len(kept) + len(removed) == len(lines)


SNIPPET = """\
int f(int x) {
  // BEGIN EXERCISE 09.demo: return twice x,
  // without a multiply.
  return x + x;
  // STUB: // TODO: not yet.
  // STUB: return 0;
  // END EXERCISE 09.demo
}
"""


def test_student_text_of_a_snippet():
    assert K.student_text(SNIPPET) == """\
int f(int x) {
  // BEGIN EXERCISE 09.demo: return twice x,
  // without a multiply.
  // TODO: not yet.
  return 0;
  // END EXERCISE 09.demo
}
"""
    assert K.strip_markers(SNIPPET) == "int f(int x) {\n  return x + x;\n}\n"
    (r,) = K.regions(SNIPPET, solution=True)
    assert (r.id, r.task, r.body, r.stub) == ("09.demo", "return twice x, without a multiply.",
                                              ("  return x + x;",), ("  // TODO: not yet.",
                                                                     "  return 0;"))
    (s,) = K.regions(K.student_text(SNIPPET), solution=False)
    assert s.unwritten and s.task == r.task and s.stub == ()


@pytest.mark.parametrize("bad, words", [
    (SNIPPET.replace("  // END EXERCISE 09.demo\n}\n", ""), "no END"),
    (SNIPPET.replace("END EXERCISE 09.demo", "END EXERCISE 09.other"), "closes exercise"),
    (SNIPPET.replace("  // STUB: return 0;\n", "  // STUB: return 0;\n  x++;\n"), "after the STUB"),
    (SNIPPET.replace("  // STUB: // TODO: not yet.\n  // STUB: return 0;\n", ""), "no STUB"),
    (SNIPPET.replace("// STUB: // TODO: not yet.", "// STUB: // not yet."), "TODO"),
    (SNIPPET + SNIPPET, "marked twice"),
    (SNIPPET.replace("  return x + x;\n", "  // BEGIN EXERCISE 09.inner: x\n"), "inside exercise"),
    (SNIPPET.replace("  // END EXERCISE", "// END EXERCISE"), "not indented"),
    (SNIPPET.replace("09.demo", "9.Demo"), "not NN.lower_case_name"),
    ("  // END EXERCISE 09.demo\n", "outside a region"),
    ("  // BEGIN EXERCISE 09.demo no colon\n", "not a well-formed marker"),
])
def test_malformed_markers_are_refused(bad, words):
    with pytest.raises(K.MarkerError, match=words):
        K.regions(bad, "demo.cu", solution=True)


# --- the first wrong element (CPU tensors) ---------------------------------------------------------

def test_first_wrong_element_is_the_first_in_batch_head_row_column_order():
    exp = torch.linspace(-1, 1, 2 * 3 * 5 * 4).reshape(2, 3, 5, 4)
    got = exp.clone()
    assert K.first_wrong_element(got, exp) is None
    got[1, 0, 2, 3] += 0.5
    got[1, 2, 0, 0] = float("nan")
    got[0, 2, 4, 1] += 1e-4              # within the bounds
    e = K.first_wrong_element(got, exp)
    assert (e.batch, e.head, e.row, e.column) == (1, 0, 2, 3)
    assert e.got == pytest.approx(float(exp[1, 0, 2, 3]) + 0.5)
    assert e.expected == pytest.approx(float(exp[1, 0, 2, 3]))
    assert str(e).startswith("batch 1, head 0, row 2, column 3: got ")
    got[0, 0, 0, 1] = float("inf")
    e = K.first_wrong_element(got, exp)
    assert (e.batch, e.head, e.row, e.column, e.got) == (0, 0, 0, 1, float("inf"))
    w = K.worst_element(got, exp)        # NaN and inf count as the worst; the first of them
    assert (w.batch, w.head, w.row, w.column) == (0, 0, 0, 1)


def test_first_wrong_element_takes_any_dtype_and_its_bounds():
    exp = torch.ones(1, 1, 2, 2, dtype=torch.float64)
    got = torch.full((1, 1, 2, 2), 1.004, dtype=torch.float16)
    assert K.first_wrong_element(got, exp, *K.ELEMENT_TOL["fp16"]) is None
    e = K.first_wrong_element(got, exp, *K.ELEMENT_TOL["fp32"])
    assert (e.batch, e.head, e.row, e.column) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="shape"):
        K.first_wrong_element(got[..., :1], exp)
    with pytest.raises(ValueError, match="B, H, N, D"):
        K.first_wrong_element(got[0], exp[0])


def test_the_score_formula():
    assert K.score(10, None) == 10                  # speed not scored
    assert K.score(10, 1.3) == 10
    assert K.score(10, K.SPEED_TOLERANCE) == 10     # timing noise costs nothing
    assert K.score(10, 0.5) == pytest.approx(10 * 0.5 / K.SPEED_TOLERANCE)
    assert K.score(5, 0.0) == 0


# --- grading without a GPU -------------------------------------------------------------------------

def test_without_a_gpu_kernel_exercises_are_skipped_with_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for ex in K.KERNEL_EXERCISES:
        r = K.grade_kernel(ex, paths.ROOT)
        assert isinstance(r, Result) and r.ok is None and r.score == 0, r
        assert "no CUDA GPU" in r.message and "\n" not in r.message


def test_below_the_stage_minimum_the_exercise_is_skipped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    r = K.grade_kernel(K.KERNEL_EXERCISES[0], paths.ROOT)
    assert r.ok is None and "compute capability" in r.message and "\n" not in r.message


def test_a_kernel_without_its_region_is_wrong(tmp_path):
    (tmp_path / "kernels").mkdir()
    ex = K.KERNEL_EXERCISES[0]
    assert K.grade_kernel(ex, tmp_path).ok is False                    # no file
    (tmp_path / "kernels" / f"{ex.stage}.cu").write_text("// the markers are gone\n")
    r = K.grade_kernel(ex, tmp_path)
    assert r.ok is False and f"BEGIN EXERCISE {ex.id}" in r.message


def _fake_attention(wrong_at=None):
    """Attention in torch (CPU), with one output element spoiled when the input has N = 17."""
    from flashlab.reference import naive_attention

    def attn(q, k, v, causal=False, out=None, scale=None):
        o = naive_attention(q, k, v, causal)
        if wrong_at is not None and q.shape[2] == 17:
            o[wrong_at] += 1.0
        out.copy_(o)
        return out
    return attn


def test_a_failed_check_names_its_first_wrong_element():
    rec = K._Recording(_fake_attention(wrong_at=(1, 2, 5, 7)))
    result = fl.check(rec, shapes=((1, 1, 1), (2, 3, 17)), head_dims=(16,), device="cpu", seed=1)
    assert not result.passed and len(rec.calls) == len(result.cases) == 4
    f = K.failure(result, rec.calls)
    assert f["case"] == "B=2 H=3 N=17 D=16 fp32 causal=False" and f["failed_cases"] == 2
    assert f["element"].startswith("batch 1, head 2, row 5, column 7: got ")
    assert f["rel_err"] > f["tol"]
    ok = K._Recording(_fake_attention())
    assert fl.check(ok, shapes=((2, 3, 17),), head_dims=(16,), device="cpu").passed


@pytest.fixture
def an_h100(monkeypatch, data_dir):
    """A pretend H100 (the GPU data/ recorded on), and stage reports made up per test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(build, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    reports = {}
    monkeypatch.setattr(K, "report", lambda root, slug: reports[slug])
    return reports


def _right(slug, ms, dtype):
    return {"stage": slug, "built": True, "passed": True, "cases": 32, "max_rel_err": 1e-3,
            "seed": 7, "ms": ms, "dtype": dtype, "config": f"B=4 H=16 N=1024 D=64 {dtype}"}


def _recorded(slug, dtype):
    from flashlab import tables
    return K._recorded_ms(slug, dtype, tables.gpu_shown())


def test_a_right_kernel_is_scored_by_its_speed_against_the_solutions(an_h100):
    ex = next(e for e in K.KERNEL_EXERCISES if e.id == "05.online_softmax")
    sol, ref = _recorded("05_mma", "fp16"), _recorded("04_wmma", "fp16")
    an_h100["04_wmma"] = _right("04_wmma", ref, "fp16")
    an_h100["05_mma"] = _right("05_mma", sol, "fp16")            # as fast as the solution
    r = K.grade_kernel(ex, paths.ROOT)
    assert r.ok is True and r.score == ex.points, r
    assert r.message.startswith("right: 05_mma passes all 32 cases") and "100%" in r.message
    an_h100["05_mma"] = _right("05_mma", 2 * sol, "fp16")        # half as fast
    r = K.grade_kernel(ex, paths.ROOT)
    assert r.ok is True and r.score == pytest.approx(ex.points * 0.5 / K.SPEED_TOLERANCE)
    assert "50% of the solution's speed" in r.message and "the reference 04_wmma" in r.message


def test_a_wrong_reference_stage_is_passed_over(an_h100):
    ex = next(e for e in K.KERNEL_EXERCISES if e.id == "05.online_softmax")
    an_h100["04_wmma"] = {"stage": "04_wmma", "built": True, "passed": False, "error": "x"}
    an_h100["03_coarsened"] = _right("03_coarsened", _recorded("03_coarsened", "fp32"), "fp32")
    an_h100["05_mma"] = _right("05_mma", _recorded("05_mma", "fp16"), "fp16")
    r = K.grade_kernel(ex, paths.ROOT)
    assert r.ok is True and r.score == ex.points and "the reference 03_coarsened" in r.message


def test_without_a_record_of_the_solution_speed_is_not_scored(an_h100, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    ex = K.KERNEL_EXERCISES[0]
    an_h100["01_naive"] = {"stage": "01_naive", "built": True, "passed": False, "error": "x"}
    an_h100["02_coalesced"] = _right("02_coalesced", 50.0, "fp32")
    r = K.grade_kernel(ex, paths.ROOT)
    assert r.ok is True and r.score == ex.points and "speed not scored" in r.message


def test_a_wrong_kernel_scores_nothing_and_says_where(an_h100, edition):
    ex = next(e for e in K.KERNEL_EXERCISES if e.id == "05.online_softmax")
    an_h100["05_mma"] = {"stage": "05_mma", "built": True, "passed": False, "cases": 32, "seed": 7,
                         "failure": {"case": "B=2 H=3 N=17 D=64 fp16 causal=False",
                                     "rel_err": 1.0, "tol": 1e-3, "failed_cases": 30,
                                     "element": "batch 0, head 0, row 0, column 0: got nan, "
                                                "expected 0.5", "worst": "..."}}
    r = K.grade_kernel(ex, edition)
    assert r.ok is False and r.score == 0
    assert "05_mma fails its check: 30 of 32 cases wrong; the first, B=2 H=3 N=17 D=64 fp16 " \
           "causal=False" in r.message
    assert "first wrong element: batch 0, head 0, row 0, column 0: got nan, expected 0.5" \
        in r.message
    assert "05.quad_sum in the same kernel still hold" in r.message     # the other stub
    an_h100["05_mma"] = {"stage": "05_mma", "built": False, "passed": False,
                         "build_error": "building x failed:\nx.cu(3): error: y"}
    r = K.grade_kernel(ex, edition)
    assert r.ok is False and "does not compile" in r.message and "x.cu(3): error: y" in r.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this is what happens without a GPU")
def test_a_stage_report_comes_from_a_child_process(tmp_path):
    """The child runs this flashlab; whatever stops it comes back as a report with an error."""
    K._REPORTS.clear()
    rep = K.report(paths.ROOT, "02_coalesced")
    assert rep["stage"] == "02_coalesced" and rep["passed"] is False and rep["error"], rep
    assert K.report(paths.ROOT, "02_coalesced") is rep                 # remembered
    slow = K.report(tmp_path, "02_coalesced", timeout=0.01)
    assert slow["passed"] is False and "took over 0.01 s" in slow["error"]
    K._REPORTS.clear()


def test_the_build_takes_another_editions_headers(tmp_path, monkeypatch):
    """build_module(include_dir=...) hands nvcc that folder and hashes its headers."""
    import torch.utils.cpp_extension as cpp_extension
    seen = []

    def fake_load_inline(name, extra_include_paths, **kwargs):
        seen.append((name, extra_include_paths))
        return name

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    monkeypatch.setattr(build, "_load_cached", lambda *a: None)
    src = tmp_path / "kernels" / "02_coalesced.cu"
    src.parent.mkdir()
    src.write_text(_text("02_coalesced"))
    for h in KERNELS.glob("*.*h"):
        (src.parent / h.name).write_text(h.read_text())
    same = build.build_module(src, arch="sm_80", include_dir=src.parent)
    default = build.build_module(src, arch="sm_80")
    (src.parent / "common.cuh").write_text((KERNELS / "common.cuh").read_text() + "// edited\n")
    edited = build.build_module(src, arch="sm_80", include_dir=src.parent)
    assert [s[1] for s in seen] == [[str(src.parent)], [str(KERNELS)], [str(src.parent)]]
    assert same == default != edited


# --- the student edition ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    dest = tmp_path_factory.mktemp("student") / "edition"
    summary = student.write(dest)
    assert f"{len(K.KERNEL_EXERCISES)} exercise regions stubbed" in summary
    return dest


def test_the_edition_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        student.write(tmp_path)
    assert student.main([str(tmp_path)]) == 1
    with pytest.raises(ValueError, match="solution edition"):
        student.write(paths.ROOT)


def test_the_edition_holds_the_listed_files(edition):
    listed = [f for f in student.listed_files(paths.ROOT) if (paths.ROOT / f).is_file()
              and not student._left_out(f, paths.ROOT, edition)]
    written = sorted(str(p.relative_to(edition)) for p in edition.rglob("*") if p.is_file())
    assert written == sorted(listed + [student.MARKER])
    for rel in ("pyproject.toml", "flashlab/check.py", "kernels/01_naive.cu", "kernels/ptx.cuh",
                "data/results.csv"):
        assert (edition / rel).read_bytes() == (paths.ROOT / rel).read_bytes(), rel
    guide = (edition / student.MARKER).read_text()
    assert "flashlab grade" in guide and "pip install -e ." in guide
    for ex in K.KERNEL_EXERCISES:
        assert f"`{ex.id}`" in guide


@pytest.mark.parametrize("slug", MARKED)
def test_student_kernels_differ_from_the_solution_exactly_in_the_regions(edition, slug):
    sol, mine = _text(slug).splitlines(), _text(slug, edition).splitlines()
    rs, ss = K.regions("\n".join(sol), solution=True), K.regions("\n".join(mine), solution=False)
    assert [r.id for r in rs] == [s.id for s in ss]
    a = b = 0
    for r, s in zip(rs, ss):
        # the same lines up to the region's code, the stub in place of the solution
        assert sol[a:r.begin + r.task_lines] == mine[b:s.begin + s.task_lines]
        assert s.body == r.stub and s.unwritten and s.task == r.task
        assert r.body != s.body
        a, b = r.end, s.end
    assert sol[a:] == mine[b:]
    assert not any("STUB:" in line for line in mine)


def _notebook_calls(src: Path):
    """(function, literal args) of each nb.show_source / nb.show_lines call in a notebook source."""
    for m in re.finditer(r"nb\.(show_source|show_lines)\((.*)\)\s*$", src.read_text(), re.M):
        try:
            call = ast.parse(f"f({m.group(2)})").body[0].value
            yield m.group(1), [ast.literal_eval(a) for a in call.args]
        except (SyntaxError, ValueError):
            continue


def test_notebooks_still_find_the_kernel_code_they_show(edition):
    """A notebook that shows part of a kernel finds it in the student's kernels too: no region
    swallows a line a notebook quotes by pattern."""
    from flashlab.notebook.code import excerpt, extract
    shown = 0
    for src in sorted((edition / "notebooks" / "src").glob("*.py")):
        for fn, args in _notebook_calls(src):
            name = args[0] if args[0].endswith(".cuh") else f"{args[0]}.cu"
            text = (edition / "kernels" / name).read_text()
            if fn == "show_source" and len(args) > 1:
                assert extract(text, args[1]), (src.name, args)
            elif fn == "show_lines":
                assert excerpt(text, *args[1:]), (src.name, args)
            shown += 1
    assert shown


def test_student_notebooks_have_no_outputs_and_no_solutions(edition):
    import nbformat
    notebooks = sorted((edition / "notebooks").glob("*.ipynb"))
    assert notebooks
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
            for word in ("BEGIN SOLUTION", "END SOLUTION", "HIDDEN TESTS", student.INSTRUCTOR):
                assert word not in cell.source, (path.name, word)
    for path in sorted((edition / "notebooks" / "src").glob("*.py")):
        text = path.read_text()
        for word in ("BEGIN SOLUTION", "END SOLUTION", "HIDDEN TESTS", student.INSTRUCTOR):
            assert word not in text, (path.name, word)
    assert not (edition / "notebooks" / "answers").exists()


def test_student_notebooks_keep_the_cells_of_their_sources(edition):
    jupytext = pytest.importorskip("jupytext")
    import nbformat
    for path in sorted((edition / "notebooks").glob("*.ipynb")):
        src = edition / "notebooks" / "src" / f"{path.stem}.py"
        a = [(c.cell_type, c.source) for c in nbformat.read(path, as_version=4).cells]
        b = [(c.cell_type, c.source) for c in jupytext.read(src, fmt="py:percent").cells]
        assert a == b, path.name


# --- a synthetic solution edition with every kind of marker ----------------------------------------

NOTEBOOK_SOURCE = """\
# %% [markdown]
# # A lesson
#
# Predict the answer.

# %%
def f(x):
    ### BEGIN SOLUTION
    return 2 * x  # the secret
    ### END SOLUTION

# %%
assert f(1) == 2
### BEGIN HIDDEN TESTS
assert f(21) == 42  # hidden
### END HIDDEN TESTS

# %% [markdown]
# **Question.** Why?
#
# ### BEGIN SOLUTION
# Because of the secret reason.
# ### END SOLUTION

# %% [markdown]
# **Instructor's answer.** The secret explanation.

# %%
print("done")
"""


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def synthetic(tmp_path):
    jupytext = pytest.importorskip("jupytext")
    import nbformat
    root = tmp_path / "solution"
    (root / "notebooks" / "src").mkdir(parents=True)
    (root / "notebooks" / "answers").mkdir()
    (root / "kernels").mkdir()
    (root / "notebooks" / "src" / "01_x.py").write_text(NOTEBOOK_SOURCE)
    nb = jupytext.read(root / "notebooks" / "src" / "01_x.py", fmt="py:percent")
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                  "language": "python"}}
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
            cell.execution_count = 1
    nbformat.write(nb, root / "notebooks" / "01_x.ipynb")
    (root / "notebooks" / "answers" / "01_x.md").write_text("the secret answers\n")
    (root / "kernels" / "09_demo.cu").write_text(SNIPPET)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "ignored.log").write_text("not part of the edition\n")
    (root / ".gitignore").write_text("*.log\n")
    _git(root, "init", "-q")
    _git(root, "add", "notebooks/src", "kernels", ".gitignore")  # the rest is untracked
    return root


def test_a_synthetic_edition(synthetic, tmp_path):
    jupytext = pytest.importorskip("jupytext")
    import nbformat
    dest = tmp_path / "out"
    summary = student.write(dest, root=synthetic)
    assert "1 exercise regions stubbed" in summary
    assert "answer key" in summary and "notebooks/answers/01_x.md" in summary
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == [".gitignore", student.MARKER, "kernels/09_demo.cu", "notebooks/01_x.ipynb",
                     "notebooks/src/01_x.py", "run.sh"]
    assert (dest / "run.sh").stat().st_mode & 0o111
    assert (dest / "kernels" / "09_demo.cu").read_text() == K.student_text(SNIPPET)
    src = (dest / "notebooks" / "src" / "01_x.py").read_text()
    nb = nbformat.read(dest / "notebooks" / "01_x.ipynb", as_version=4)
    for text in [src] + [c.source for c in nb.cells]:
        assert "secret" not in text and "hidden" not in text and "SOLUTION" not in text
    assert "    # YOUR CODE HERE\n    raise NotImplementedError()" in src
    assert "# YOUR ANSWER HERE" in src and "assert f(1) == 2" in src
    assert [(c.cell_type, c.source) for c in nb.cells] == \
        [(c.cell_type, c.source) for c in jupytext.read(dest / "notebooks" / "src" / "01_x.py",
                                                        fmt="py:percent").cells]
    assert len(nb.cells) == 5  # the instructor's answer is gone
    assert all(c.outputs == [] and c.execution_count is None
               for c in nb.cells if c.cell_type == "code")
    # written again over itself only with force; an edition inside the root is never copied
    with pytest.raises(FileExistsError):
        student.write(dest, root=synthetic)
    assert "wrote the student edition" in student.write(dest, root=synthetic, force=True)
    inner = synthetic / "class-edition"
    student.write(inner, root=synthetic)
    again = student.write(tmp_path / "again", root=synthetic)
    assert "class-edition" not in " ".join(
        str(p) for p in (tmp_path / "again").rglob("*")), again


def test_unbalanced_notebook_markers_write_nothing(synthetic, tmp_path):
    src = synthetic / "notebooks" / "src" / "01_x.py"
    src.write_text(src.read_text().replace("    ### END SOLUTION\n", "", 1))
    with pytest.raises(student.EditionError, match="no '### END SOLUTION'"):
        student.write(tmp_path / "out", root=synthetic)
    assert not (tmp_path / "out").exists()


# --- compiling: the stubs build, and the markers change no machine code ---------------------------

@needs_nvcc
@pytest.mark.parametrize("slug, arch", ARCHS)
def test_the_student_edition_compiles(edition, slug, arch):
    """Every stage of the student edition, stubs included, compiles for the architectures its
    machine code is read for (sm_80 and sm_90; sm_90a for a Hopper stage) and the oldest one its
    registry entry claims (sm_75 for 01-04)."""
    found = ptxas.resources(edition / "kernels" / f"{slug}.cu", arch)
    assert found, f"no kernel in the student's {slug} for {arch}"


def _without_markers(slug, tmp_path) -> Path:
    out = tmp_path / "kernels" / f"{slug}.cu"
    out.parent.mkdir(exist_ok=True)
    out.write_text(K.strip_markers(_text(slug)))
    return out


@needs_cuobjdump
@pytest.mark.parametrize("slug, arch", [(slug, arch) for slug in MARKED
                                        for arch in fl.stage(slug).static_archs])
def test_the_markers_change_no_machine_code(slug, arch, tmp_path):
    """The solution edition with its exercise markers compiles to the SASS, registers and shared
    memory of the same file without them."""
    bare = _without_markers(slug, tmp_path)
    marked = fl.stage(slug).source
    assert sass.disassemble(marked, arch) == sass.disassemble(bare, arch)
    assert ptxas.resources(marked, arch) == ptxas.resources(bare, arch)


# --- on a GPU: the solution passes every kernel exercise, the stubs fail every one ----------------

def _graded_here(root):
    """(exercise, result) for every kernel exercise this GPU can run; the rest must be skipped
    with a reason, because their stage cannot run here."""
    for ex in K.KERNEL_EXERCISES:
        r = K.grade_kernel(ex, root)
        print(r)
        if r.ok is None:
            assert fl.stage(ex.stage).unavailable() is not None, r
            continue
        yield ex, r


@pytest.mark.gpu
def test_the_solution_edition_passes_every_kernel_exercise():
    for ex, r in _graded_here(paths.ROOT):
        assert r.ok is True and r.score == ex.points, r  # full marks: as fast as itself
        assert r.message.startswith("right:"), r


@pytest.mark.gpu
def test_the_student_edition_fails_every_kernel_exercise(edition):
    for ex, r in _graded_here(edition):
        assert r.ok is False and r.score == 0, r
        assert "fails its check" in r.message, r
        assert re.search(r"first wrong element: batch \d+, head \d+, row \d+, column \d+: got "
                         r"\S+, expected \S+|the largest difference", r.message), r


@pytest.mark.gpu
def test_a_stage_report_names_the_failing_case(edition):
    rep = K.report(edition, "02_coalesced")
    assert rep["built"] and not rep["passed"]
    assert json.loads(json.dumps(rep)) == rep
    assert re.fullmatch(r"B=\d+ H=\d+ N=\d+ D=\d+ fp32 causal=(True|False)", rep["failure"]["case"])
