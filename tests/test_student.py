"""The kernel exercises and the editions: the marked regions in kernels/ (exercises, and the
later stages' copies that carry them) are well formed and only comments in the solution edition
(same machine code); an edition hands out one assignment's exercises, holds no later stage and no
solution of what it hands out (searched for in every file it writes), and its stubs compile
(sm_80, sm_90 and each stage's oldest target). On a GPU: the solution edition passes every kernel
exercise, an edition fails every one it hands out, and 13's lazy softmax without its fallback
fails."""
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

import flashlab as fl
from flashlab import build, markers, paths, ptxas, sass
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
HOMES = {ex.id: ex.stage for ex in K.KERNEL_EXERCISES}
ARCHS = [(st.slug, arch) for st in fl.stages()
         for arch in sorted({*st.static_archs, st.arch(st.min_cc)})]
# The assignments the instructor guide plans (TEACHING.md), every single stage, and the course.
PLANNED = [(n, n) for n in range(1, 14)] + [(2, 4), (5, 6), (7, 8), (9, 13), (1, 13)]


def _text(slug, root=paths.ROOT):
    return (Path(root) / "kernels" / f"{slug}.cu").read_text()


# --- the regions -----------------------------------------------------------------------------------

def test_every_stage_after_01_has_an_exercise():
    assert MARKED == [st.slug for st in fl.stages() if st.number >= 2]


@pytest.mark.parametrize("slug", MARKED)
def test_regions_are_well_formed(slug):
    found = K.regions(_text(slug), slug, solution=True)   # MarkerError if not
    own = [r for r in found if not r.carried]
    assert len(own) <= 2  # none: a stage just written by `flashlab new-stage`, carrying its
    #                       predecessor's exercises before its own is written
    for r in found:
        assert r.body and markers.unbalanced(r.body) is None, (slug, r.id)
        assert any(line.strip() and not line.strip().startswith("//") for line in r.body)
        if r.carried:   # a copy of an earlier stage's exercise, or of its own stage's exercise
            #             elsewhere in the file, with a stub of its own (13's two-blocks pass)
            assert HOMES[r.id] <= slug, f"{slug} carries {r.id}, which is not earlier"
            assert HOMES[r.id] < slug or r.stub, f"{slug} carries its own {r.id} without a stub"
            continue
        assert r.id.startswith(slug[:2] + "."), f"{r.id} is in {slug}.cu"
        assert r.task and r.stub and not r.unwritten
        assert r.stub[0].strip().startswith(K.TODO)


def test_a_notebook_with_exercises_hands_some_out():
    """A stage's notebook with an Exercises section has a lab or a kernel exercise of its stage
    (every stage of the course from 01 on has one; a new stage's skeleton has no such section)."""
    from flashlab.course.exercises import EXERCISES
    with_exercises = {ex.stage for ex in EXERCISES}
    sections = [st.slug for st in fl.stages()
                if "\n# ## Exercises" in (paths.NOTEBOOKS / "src" / f"{st.slug}.py").read_text()]
    assert len(sections) >= 13 and set(sections) <= with_exercises, set(sections) - with_exercises


def test_a_carried_region_without_a_stub_holds_its_exercise_code_unchanged():
    """Where a carried region takes its exercise's stub, its code is the exercise's own, line for
    line (indentation aside): the student copies theirs over as it is."""
    home = {r.id: r for slug in MARKED for r in K.regions(_text(slug)) if not r.carried}
    n = 0
    for slug in MARKED:
        for r in K.regions(_text(slug)):
            if r.carried and not r.stub:
                assert [ln.strip() for ln in r.body] == [ln.strip() for ln in home[r.id].body], \
                    (slug, r.id)
                n += 1
    assert n >= 10


def test_every_region_is_an_exercise_and_every_kernel_exercise_a_region():
    regions = {r.id: slug for slug in MARKED for r in K.regions(_text(slug)) if not r.carried}
    exercises = {ex.id: ex.stage for ex in K.KERNEL_EXERCISES}
    assert regions == exercises
    assert len(exercises) == len(K.KERNEL_EXERCISES)          # ids unique
    for ex in K.KERNEL_EXERCISES:
        assert isinstance(ex, Exercise) and ex.kind == "kernel" and ex.points > 0
        assert fl.stage(ex.stage).slug == ex.stage
    stages = [ex.stage for ex in K.KERNEL_EXERCISES]
    assert stages == sorted(stages)


def test_exercises_are_found_in_an_edition_as_handed_out_too(tmp_path):
    """An edition's kernels hold the regions without STUB lines: the exercises are read from
    them all the same, and a stage that is not there has none."""
    (tmp_path / "kernels").mkdir()
    for slug in ("02_coalesced", "05_mma"):
        (tmp_path / "kernels" / f"{slug}.cu").write_text(
            markers.edition_text(_text(slug), set(HOMES)))
    found = K._kernel_exercises(tmp_path)
    assert [ex.id for ex in found] == ["02.tile_copy", "05.online_softmax", "05.quad_sum"]
    points = {e.id: e.points for e in K.KERNEL_EXERCISES}
    assert all(ex.points == points[ex.id] for ex in found)


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
LATER = """\
int g(int y) {
    // BEGIN CARRIED 09.demo
    return y + y;
    // END CARRIED 09.demo
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
    assert (r.id, r.task, r.body, r.stub, r.kind) == (
        "09.demo", "return twice x, without a multiply.", ("  return x + x;",),
        ("  // TODO: not yet.", "  return 0;"), markers.EXERCISE)
    (s,) = K.regions(K.student_text(SNIPPET), solution=False)
    assert s.unwritten and s.task == r.task and s.stub == ()


def test_a_carried_region_takes_its_exercise_stub_and_says_where_it_comes_from():
    out = markers.edition_text(LATER, {"09.demo"}, stubs={"09.demo": list(K.regions(SNIPPET)[0].stub)},
                               homes={"09.demo": "09_wgmma"})
    assert out == """\
int g(int y) {
    // BEGIN CARRIED 09.demo: write your 09.demo here too: the code you wrote in its own stage (kernels/09_wgmma.cu), carried forward and fitted to the names here
    // TODO: not yet.
    return 0;
    // END CARRIED 09.demo
}
"""
    assert markers.edition_text(LATER, set()) == "int g(int y) {\n    return y + y;\n}\n"
    (c,) = markers.regions(out, solution=False)
    assert c.carried and c.unwritten
    with pytest.raises(markers.MarkerError, match="no STUB lines"):
        markers.edition_text(LATER, {"09.demo"})


def test_splice_takes_only_the_students_regions():
    handed = K.student_text(SNIPPET)
    mine = handed.replace("  // TODO: not yet.\n  return 0;\n", "    return x << 1;\n") \
                 .replace("int f(int x) {", "int f(int x) { evil();")
    got = markers.splice(handed, mine, {"09.demo"})
    assert "return x << 1;" in got and "evil" not in got and "TODO" not in got
    for body, why in (("  }\n  void g() {\n", "closes a '{'"), ("  #include <x>\n", "preprocessor"),
                      ("  /* x */\n", "comment"), ("  if (x) {\n", "leaves '{' open")):
        bad = handed.replace("  // TODO: not yet.\n  return 0;\n", body)
        with pytest.raises(markers.MarkerError, match=re.escape(why)):
            markers.splice(handed, bad, {"09.demo"})
    with pytest.raises(markers.MarkerError, match="missing"):
        markers.splice(handed, "int f(int x) { return 0; }\n", {"09.demo"})


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
    ("  // BEGIN EXERCISE 09.demo\n  x;\n  // END EXERCISE 09.demo\n", "states no task"),
    (LATER.replace("END CARRIED", "END EXERCISE"), "closes carried"),
])
def test_malformed_markers_are_refused(bad, words):
    with pytest.raises(K.MarkerError, match=words):
        K.regions(bad, "demo.cu", solution=True)


def test_what_counts_as_a_solution_line():
    for line in ("}", "#pragma unroll", "for (int n = 0; n < NS; n++) {", "float sum = 0.f;",
                 "if (j > 0) {", "return;"):
        assert markers.scaffold(line), line
    for line in ("const int next = j + STAGES - 1;", "if (j > 0 && lane == 0) x();",
                 "q0 = (causal ? tiles - 1 - qt : qt) * BR;"):
        assert not markers.scaffold(line), line
    (r,) = K.regions(SNIPPET)
    assert markers.solution_lines(r) == ["return x + x;"]
    assert markers.solution_lines(r, given="int h() { return x + x; }") == []
    assert markers.normalize("  a  =  b;   // c") == "a = b;"


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
    monkeypatch.setattr(K, "report", lambda root, slug, **kw: reports[slug])
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


def test_graded_by_the_instructor_a_kernel_is_timed_in_turn_with_the_solution(an_h100):
    """With the solution at hand (class grading), the student's stage and the solution's are
    timed now, at the teaching config and under the causal mask; the slower ratio counts."""
    ex = next(e for e in K.KERNEL_EXERCISES if e.id == "11.work_tile")
    calls = []

    def report(root, slug, check=True, **kw):
        calls.append((str(root), slug, check))
        times = ({"B=4 H=16 N=1024 D=64 fp16": 0.050, "B=4 H=16 N=1024 D=64 fp16 causal": 0.030}
                 if check else
                 {"B=4 H=16 N=1024 D=64 fp16": 0.050, "B=4 H=16 N=1024 D=64 fp16 causal": 0.024})
        return {**_right(slug, times["B=4 H=16 N=1024 D=64 fp16"], "fp16"), "times": times}
    K.report = report
    r = K.grade_kernel(ex, paths.ROOT, solution="/solution")
    assert calls == [(str(paths.ROOT), "11_warpspec", True), ("/solution", "11_warpspec", False)]
    assert r.ok and r.score == pytest.approx(ex.points * 0.8 / K.SPEED_TOLERANCE), r
    assert "80% of the solution's speed" in r.message and "causal: 0.03 ms against the " \
        "solution's 0.024 ms" in r.message


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


def test_a_wrong_kernel_scores_nothing_and_says_where(an_h100, tmp_path):
    edition = tmp_path
    (edition / "kernels").mkdir()
    (edition / "kernels" / "05_mma.cu").write_text(K.student_text(_text("05_mma")))
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
    assert "05.quad_sum in the same kernel still holds a stub" in r.message     # the other one
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


# --- editions --------------------------------------------------------------------------------------

def test_an_assignment_is_a_range_of_stages():
    a = student.assignment(6, 5)
    assert (a.first, a.last, a.name) == (5, 6, "05-06")
    assert [ex.id for ex in a.exercises()] == ["05.fragment_owner", "05.online_softmax",
                                               "05.quad_sum", "06.bank_map", "06.swizzle"]
    assert student.assignment(2).name == "01-02" and student.assignment("03", "03").name == "03"
    whole = student.assignment()
    assert (whole.first, whole.last) == (1, fl.stages()[-1].number)
    n = fl.stages()[-1].number + 1
    with pytest.raises(ValueError, match=f"no stage {n}"):
        student.Assignment(n, n)
    with pytest.raises(ValueError, match="earlier stage to a later one"):
        student.assignment(5, 6)


def test_what_an_edition_leaves_out():
    a = student.assignment(6, 5)
    out = {rel: student.left_out(rel, a) for rel in student.tracked_files(paths.ROOT)}
    kept = sorted(rel for rel, why in out.items() if why is None)
    assert "kernels/06_swizzle.cu" in kept and "kernels/hopper.cuh" in kept
    assert "notebooks/src/06_swizzle.py" in kept and "data/results.csv" in kept
    for rel in ("kernels/07_cp_async.cu", "notebooks/07_cp_async.ipynb", "notebooks/08a_tuning_log.ipynb",
                "notebooks/99_capstone_gpt2.ipynb", "notebooks/TEACHING.md", "tests/test_student.py",
                "tools/notebooks.py", ".ci/run", student.LAB_TRUTHS):
        assert out[rel] is not None, rel
    assert not any(rel.startswith("data/runs/") for rel in kept)
    week4 = student.assignment(8, 7)
    assert student.left_out("notebooks/99_capstone_gpt2.ipynb", week4) is None
    assert "appendix of a stage it hands out" in student.left_out("notebooks/08a_tuning_log.ipynb",
                                                                  week4)  # it works out 08's
    assert student.left_out("notebooks/src/08a_tuning_log.py", student.assignment(13, 9)) is None
    hopper = student.assignment(13, 9)  # 12's appendix goes with 12's solution, as 08a with 08's
    assert "appendix of a stage it hands out" in student.left_out("notebooks/12a_tma_store_log.ipynb",
                                                                  hopper)
    assert student.left_out("notebooks/src/12a_tma_store_log.py", student.assignment(13, 13)) is None


@pytest.fixture(scope="module")
def week3(tmp_path_factory):
    """The edition of the four-week module's third week: stages 05 and 06 handed out."""
    dest = tmp_path_factory.mktemp("week3") / "edition"
    summary = student.write(dest, through=6, first=5)
    assert "05.online_softmax" in summary and "06.swizzle" in summary
    return dest


def test_an_edition_holds_the_stages_up_to_its_last(week3):
    files = sorted(str(p.relative_to(week3)) for p in week3.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("kernels/") and f.endswith(".cu")] == \
        [f"kernels/{st.slug}.cu" for st in fl.stages() if st.number <= 6]
    assert {Path(f).stem for f in files if f.startswith("notebooks/") and f.endswith(".ipynb")} == \
        {"00_setup_and_the_gpu", "01_naive", "02_coalesced", "03_coarsened", "04_wmma", "05_mma",
         "06_swizzle"}
    for rel in ("pyproject.toml", "flashlab/check.py", "kernels/ptx.cuh", "data/results.csv"):
        assert (week3 / rel).read_bytes() == (paths.ROOT / rel).read_bytes(), rel
    assert not (week3 / "tests").exists() and not (week3 / "tools").exists()
    assert not (week3 / student.LAB_TRUTHS).exists() and (week3 / student.LAB_KEYS).is_file()
    man = student.read_manifest(week3)
    assert man["assignment"] == "05-06" and man["first"] == 5 and man["last"] == 6
    assert [e["id"] for e in man["exercises"]] == [ex.id for ex in student.assignment(6, 5).exercises()]
    assert man["solution_commit"]


def test_earlier_stages_are_solved_and_the_assignments_stubbed(week3):
    for slug in ("02_coalesced", "03_coarsened", "04_wmma"):   # past assignments: plain code
        assert (week3 / "kernels" / f"{slug}.cu").read_text() == K.strip_markers(_text(slug))
    for slug in ("05_mma", "06_swizzle"):
        sol, mine = _text(slug), _text(slug, week3)
        found = K.regions(mine, solution=False)
        assert found and all(r.unwritten for r in found), slug
        assert not any("STUB:" in line for line in mine.splitlines())
        assert K.strip_markers(mine) != K.strip_markers(sol)
    carried = [r for r in K.regions(_text("06_swizzle", week3)) if r.carried]
    assert {r.id for r in carried} == {"05.online_softmax", "05.quad_sum"}
    assert all("kernels/05_mma.cu" in r.task for r in carried)


def test_a_notebooks_diff_in_an_edition_shows_no_solution(week3):
    """Notebook 06's diff against 05, computed from the edition's kernels: the stubs on both
    sides, so 05's solution is not among its lines."""
    out = subprocess.run(["python", "-c", "import flashlab.notebook.code as c; "
                          "print(c.diff('05_mma', '06_swizzle'))"], cwd=week3, capture_output=True,
                         text=True, env={**__import__("os").environ, "PYTHONPATH": str(week3)})
    assert out.returncode == 0, out.stderr
    shown = out.stdout
    assert "swz" in shown
    for r in K.regions(_text("05_mma")):
        for line in markers.solution_lines(r):
            assert line not in markers.plain(shown), line


def test_a_later_stage_is_not_in_the_edition(week3):
    out = subprocess.run(["python", "-c", "import flashlab as fl; print(fl.stage('07').unavailable())"],
                         cwd=week3, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(week3)})
    assert "kernels/07_cp_async.cu is not in this edition" in out.stdout, out.stderr


def test_student_notebooks_have_no_outputs_and_no_solutions(week3):
    import nbformat
    notebooks = sorted((week3 / "notebooks").glob("*.ipynb"))
    assert notebooks
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
            for word in ("BEGIN SOLUTION", "END SOLUTION", "HIDDEN TESTS", student.INSTRUCTOR):
                assert word not in cell.source, (path.name, word)
    for path in sorted((week3 / "notebooks" / "src").glob("*.py")):
        text = path.read_text()
        for word in ("BEGIN SOLUTION", "END SOLUTION", "HIDDEN TESTS", student.INSTRUCTOR):
            assert word not in text, (path.name, word)
        assert text.count(student.TEXT_STUB) >= 1


def test_student_notebooks_keep_the_cells_of_their_sources(week3):
    jupytext = pytest.importorskip("jupytext")
    import nbformat
    for path in sorted((week3 / "notebooks").glob("*.ipynb")):
        src = week3 / "notebooks" / "src" / f"{path.stem}.py"
        a = [(c.cell_type, c.source) for c in nbformat.read(path, as_version=4).cells]
        b = [(c.cell_type, c.source) for c in jupytext.read(src, fmt="py:percent").cells]
        assert a == b, path.name


def test_the_guide_says_what_to_install_do_and_hand_in(week3):
    guide = (week3 / student.MARKER).read_text()
    for ex in student.assignment(6, 5).exercises():
        assert f"`{ex.id}`" in guide
    for words in ("download.pytorch.org/whl/cpu", 'pip install -e ".[notebooks]"', "Colab",
                  "flashlab grade", "BEGIN CARRIED", "git clone", ".ipynb", "zip"):
        assert words in guide, words
    assert "TEACHING" not in guide


def _scan(dest, a) -> list:
    """An edition's files searched for what it must not hold, independently of the writer's own
    check: every handed-out exercise's solution lines (less what the student is given), every
    handed-out lab's answer code, every instructor's answer."""
    import nbformat
    from flashlab.course import nbtext
    secrets, given = [], ""
    for st in fl.stages():
        mine = Path(dest) / "kernels" / f"{st.slug}.cu"
        if not mine.is_file():
            continue
        given += "\n" + markers.flat(markers.strip_markers(mine.read_text()))
        if a.hands_out(st.number):
            for r in K.regions(_text(st.slug)):
                if not r.carried:
                    for s in markers.solution_lines(r, given):
                        secrets += [(r.id, piece) for piece in [s, *markers.fragments(s, given)]]
    labs = {ex.id for ex in a.exercises() if ex.kind == "lab"}
    for path in sorted((paths.ROOT / "notebooks").glob("*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        for i, cell in enumerate(cells):
            if cell.cell_type == "markdown" and nbtext.instructor_answer(cell.source):
                secrets += [("instructor", markers.plain(ln.replace(nbtext.INSTRUCTOR, "")))
                            for ln in cell.source.split("\n") if len(ln.strip()) >= 40]
            lab = nbtext.lab_of(cell.source) or (
                nbtext.lab_of(cells[i + 1].source) if i + 1 < len(cells) else None)
            if cell.cell_type == "code" and lab in labs:
                for region in nbtext.solution_regions(cell.source):
                    secrets += [(lab, nbtext.python_code(ln)) for ln in region if nbtext.python_code(ln)]
    assert secrets
    found = []
    for p in sorted(Path(dest).rglob("*")):
        if not p.is_file():
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        if p.suffix == ".ipynb":
            nb = json.loads(text)
            text = "\n".join("".join(c["source"]) for c in nb["cells"])
        flat = markers.plain(text)
        found += [(str(p.relative_to(dest)), what, s) for what, s in secrets if s in flat]
    return found


@pytest.mark.parametrize("first, last", PLANNED, ids=[f"{f:02d}-{l:02d}" for f, l in PLANNED])
def test_no_edition_holds_a_solution_it_hands_out(first, last, tmp_path):
    a = student.assignment(last, first)
    student.write(tmp_path / "ed", through=last, first=first)
    assert _scan(tmp_path / "ed", a) == []


def test_an_edition_that_would_show_a_solution_is_not_written(tmp_path):
    """Take the carried markers out of stage 06 (its copy of 05's softmax then stays solved): the
    edition handing out 05 with 06 is refused, naming the file, and nothing is written."""
    root = tmp_path / "solution"
    subprocess.run(["git", "clone", "-q", str(paths.ROOT), str(root)], check=True)
    src = root / "kernels" / "06_swizzle.cu"
    src.write_text("\n".join(ln for ln in src.read_text().split("\n")
                             if "CARRIED 05.online_softmax" not in ln))
    subprocess.run(["git", "-C", str(root), "commit", "-qam", "no carried markers"], check=True,
                   env={**__import__("os").environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    with pytest.raises(student.EditionError, match=r"kernels/06_swizzle.cu:\d+ holds exercise "
                                                   r"05.online_softmax"):
        student.write(tmp_path / "out", root=root, through=6, first=5)
    assert not (tmp_path / "out").exists()
    student.write(tmp_path / "ok", root=root, through=6, first=6)   # 05 given solved: fine


def test_an_edition_is_written_from_tracked_files_only(tmp_path):
    root = tmp_path / "solution"
    subprocess.run(["git", "clone", "-q", str(paths.ROOT), str(root)], check=True)
    (root / "leaderboard").mkdir()
    (root / "leaderboard" / "scores.csv").write_text("alice,10\n")
    (root / "data" / "private-notes.txt").write_text("names and scores\n")
    student.write(tmp_path / "ed", root=root, through=2, first=2)
    assert not (tmp_path / "ed" / "leaderboard").exists()
    assert not (tmp_path / "ed" / "data" / "private-notes.txt").exists()


def test_an_edition_is_not_written_from_an_edition(week3, tmp_path):
    with pytest.raises(ValueError, match="not the solution"):
        student.write(tmp_path / "again", root=week3, through=6, first=5)


def test_the_edition_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        student.write(tmp_path, through=2)
    with pytest.raises(ValueError, match="solution edition"):
        student.write(paths.ROOT)


# --- compiling: the stubs build, and the markers change no machine code ---------------------------

@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """The whole course's edition: every exercise handed out, carried regions stubbed too."""
    dest = tmp_path_factory.mktemp("course") / "edition"
    student.write(dest)
    return dest


@needs_nvcc
@pytest.mark.parametrize("slug, arch", ARCHS)
def test_the_edition_compiles(course, slug, arch):
    """Every stage of the whole course's edition, stubs and carried stubs included, compiles for
    the architectures its machine code is read for (sm_80 and sm_90; sm_90a for a Hopper stage)
    and the oldest one its registry entry claims (sm_75 for 01-04)."""
    found = ptxas.resources(course / "kernels" / f"{slug}.cu", arch)
    assert found, f"no kernel in the edition's {slug} for {arch}"


def _without_markers(slug, tmp_path) -> Path:
    out = tmp_path / "kernels" / f"{slug}.cu"
    out.parent.mkdir(exist_ok=True)
    out.write_text(K.strip_markers(_text(slug)))
    return out


@needs_cuobjdump
@pytest.mark.parametrize("slug, arch", [(slug, arch) for slug in MARKED
                                        for arch in fl.stage(slug).static_archs])
def test_the_markers_change_no_machine_code(slug, arch, tmp_path):
    """The solution edition with its markers compiles to the SASS, registers and shared memory
    of the same file without them."""
    bare = _without_markers(slug, tmp_path)
    marked = fl.stage(slug).source
    assert sass.disassemble(marked, arch) == sass.disassemble(bare, arch)
    assert ptxas.resources(marked, arch) == ptxas.resources(bare, arch)


# --- on a GPU: the solution passes every kernel exercise, the stubs fail every one ----------------

def _graded_here(ex, root, solution=None):
    """Kernel exercise `ex` graded in the tree at `root`; one whose stage cannot run on this GPU
    must be skipped with a reason (and the test is skipped)."""
    r = K.grade_kernel(ex, root, solution=solution)
    print(r)
    if r.ok is None:
        assert fl.stage(ex.stage).unavailable() is not None, r
        pytest.skip(r.message)
    return r


BY_EXERCISE = pytest.mark.parametrize("ex", K.KERNEL_EXERCISES, ids=lambda ex: ex.id)


@pytest.mark.gpu
@BY_EXERCISE
def test_the_solution_edition_scores_full_marks_on_every_kernel_exercise(ex):
    """Graded as an instructor grades: timed in turn with itself, config by config (one exercise
    per test: -k 23.dkdv_boxes grades that one)."""
    r = _graded_here(ex, paths.ROOT, solution=paths.ROOT)
    assert r.ok is True and r.score == ex.points, r  # full marks: as fast as itself
    assert r.message.startswith("right:"), r


@pytest.mark.gpu
@BY_EXERCISE
def test_an_edition_fails_every_kernel_exercise_it_hands_out(course, ex):
    r = _graded_here(ex, course)
    assert r.ok is False and r.score == 0, r
    assert "fails its check" in r.message, r
    assert re.search(r"first wrong element: batch \d+, head \d+, row \d+, column \d+: got "
                     r"\S+, expected \S+|the largest difference|the whole (dq|dk|dv|lse) is "
                     r"judged\. Replay it with fl\.check_(backward|lse)", r.message), r


def _graded_with(tmp_path, exercise, hacked):
    """Grade `exercise` as an instructor would, in an edition that hands it out (stages up to its
    own) where the student wrote `hacked` (the stage's source, solution regions altered) into its
    region: the edition's file with only that region spliced in, timed against the solution."""
    ex = next(e for e in K.KERNEL_EXERCISES if e.id == exercise)
    st = fl.stage(ex.stage)
    tree = tmp_path / "tree"
    student.write(tree, through=st.number, first=st.number)
    path = tree / "kernels" / st.source.name
    path.write_text(markers.splice(path.read_text(), hacked, {exercise}))
    got = K.grade_kernel(ex, tree, solution=paths.ROOT)
    print(got)
    return got


LAZY_WITHOUT_FALLBACK = r"""    bool grow = false;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      float x = mx[hh];
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
      grow |= x * scale_log2 > m[hh] + 8.f;  // some exponential above 2^8
    }
    if (__any_sync(0xffffffffu, grow)) return false;  // one path per warp
"""


@pytest.mark.gpu
def test_the_lazy_softmax_without_its_fallback_fails(tmp_path):
    """13.lazy_softmax written without the vote and the fallback (every tile kept lazily): right
    on random inputs, and so faster; the keys that grow along the sequence make it fail."""
    if fl.stage("13").unavailable():
        pytest.skip(fl.stage("13").unavailable())
    mine = markers.strip_markers(_text("13_lazy_rescale"))
    assert LAZY_WITHOUT_FALLBACK in mine
    (r,) = [r for r in K.regions(_text("13_lazy_rescale"))
            if r.id == "13.lazy_softmax" and not r.carried]
    lazy = "\n".join(r.body) + "\n"
    assert LAZY_WITHOUT_FALLBACK in lazy
    hacked = _text("13_lazy_rescale").replace(lazy, lazy.replace(LAZY_WITHOUT_FALLBACK, "    (void)mx;\n"))
    got = _graded_with(tmp_path, "13.lazy_softmax", hacked)
    assert got.ok is False and got.score == 0, got
    assert "keys growing along the sequence" in got.message, got


@pytest.mark.gpu
def test_the_lazy_softmax_not_yet_carried_to_the_two_blocks_pass_is_still_right(tmp_path):
    """13.lazy_softmax written in fast() but not carried to fast_inplace(), which keeps its stub:
    the two-blocks shape (D = 64 under the mask, N < 2048) takes the classic path at every tile
    after an item's first, and the stage is still right everywhere."""
    st = fl.stage("13")
    if st.unavailable():
        pytest.skip(st.unavailable())
    text = _text("13_lazy_rescale")
    (r,) = [r for r in K.regions(text) if r.id == "13.lazy_softmax" and r.carried]
    lines = text.splitlines()
    lines[r.begin + r.task_lines:r.end] = list(r.stub)  # the stub's code in place of the pass
    src = tmp_path / "13_lazy_rescale.cu"
    src.write_text(markers.strip_markers("\n".join(lines) + "\n"))
    from flashlab.runtime import Attention
    attn = Attention(st, build.build_module(src, arch=st.arch(st.min_cc)))
    res = fl.check(attn, head_dims=(64,), causal=(True,), growing_shapes=((2, 3, 1000),))
    assert res.passed, str(res)


@pytest.mark.gpu
def test_a_stage_report_names_the_failing_case(course):
    rep = K.report(course, "02_coalesced")
    assert rep["built"] and not rep["passed"]
    assert json.loads(json.dumps(rep)) == rep
    assert re.fullmatch(r"B=\d+ H=\d+ N=\d+ D=\d+ fp32 causal=(True|False)( \(.*\))?",
                        rep["failure"]["case"])


@needs_cuobjdump
def test_a_kernel_without_the_instructions_its_idea_needs_is_told_so(tmp_path):
    """16.turns written without its fences can pass the repeat check on one GPU; its machine code
    shows what is missing: no MEMBAR in the backward kernel. The solution lacks nothing."""
    st = fl.stage("16")
    src = tmp_path / st.source.name
    src.write_text(markers.strip_markers(_text(st.slug)).replace("__threadfence();", ""))
    lacking = K.missing_evidence(st, src, "sm_90")
    assert "bwd_kernel has no MEMBAR" in lacking, lacking
    assert K.missing_evidence(st, st.source, "sm_90") == ""


@pytest.mark.gpu
def test_the_turns_without_fences_are_graded_wrong(tmp_path):
    """16.turns with the turns taken but no __threadfence: wrong, whether a repeat happened to
    catch an add out of order or (as a run usually goes) the machine code shows the missing
    fences."""
    st = fl.stage("16")
    if st.unavailable():
        pytest.skip(st.unavailable())
    got = _graded_with(tmp_path, "16.turns", _text(st.slug).replace("__threadfence();", ""))
    assert got.ok is False and got.score == 0, got
    assert "has no MEMBAR" in got.message or "check_repeatable" in got.message, got


@pytest.mark.gpu
def test_the_tma_store_of_one_box_is_graded_wrong(tmp_path):
    """23.dkdv_boxes writing only the first box of 64 columns: right at D = 64, where one box is
    the whole row, and wrong at D = 128, where the right half of dK and dV is never written; the
    grader's check takes both head dims, so the answer fails."""
    st = fl.stage("23")
    if st.unavailable():
        pytest.skip(st.unavailable())
    loop = "for (int blk = 0; blk < D / 64; blk++) {"
    assert _text(st.slug).count(loop) == 1
    got = _graded_with(tmp_path, "23.dkdv_boxes",
                       _text(st.slug).replace(loop, "for (int blk = 0; blk < 1; blk++) {"))
    assert got.ok is False and got.score == 0, got
    assert "fails its check" in got.message and "D=128" in got.message.replace(" ", ""), got


def test_student_md_explains_only_the_kinds_of_exercise_the_assignment_has():
    """The backward week (14-17) hands out kernel exercises only: its STUDENT.md explains kernel
    exercises and how to compile one without a GPU (flashlab sass), and no labs; the first
    week's has both kinds."""
    from flashlab.course import student
    backward = student.student_md(student.assignment(through=17, first=14))
    assert "A **kernel exercise**" in backward and "A **lab**" not in backward
    assert "flashlab sass NN" in backward and "nvidia-cuda-cuobjdump" in backward
    first = student.student_md(student.assignment(through=2, first=1))
    assert "A **kernel exercise**" in first and "A **lab**" in first


@needs_cuobjdump
def test_turns_that_are_never_taken_are_told_so(tmp_path):
    """21.turns's stub takes no turns: dQ's reductions land in any order, which only a check that
    runs twice can see, and on a lucky GPU it may not. Its machine code shows it: no load of the
    counter (the kernel reads global memory through the TMA otherwise). The solution lacks
    nothing."""
    st = fl.stage("21")
    src = tmp_path / st.source.name
    src.write_text(markers.strip_markers(markers.edition_text(_text(st.slug), {"21.turns"})))
    lacking = K.missing_evidence(st, src, "sm_90a")
    assert lacking.startswith("bwd_kernel has no LDG"), lacking
    assert K.missing_evidence(st, st.source, "sm_90a") == ""


@needs_cuobjdump
def test_an_overlap_written_as_a_wait_for_every_group_is_told_so(tmp_path):
    """22.two_groups written with `wgmma.wait_group 0` where S^T alone should be waited for gives
    the right gradients (every check passes) and no overlap; the machine code shows it: fewer
    waits with a group still running than the registry asks (stage 20's kernel has the same
    shortfall). The solution lacks nothing."""
    st = fl.stage("22")
    text = markers.strip_markers(_text(st.slug))
    serial = text.replace("    wgmma_wait<1>();\n\n    // Then, at D = 128",
                          "    wgmma_wait<0>();\n\n    // Then, at D = 128")
    assert serial != text
    src = tmp_path / st.source.name
    src.write_text(serial)
    lacking = K.missing_evidence(st, src, "sm_90a")
    assert "bwd_kernel<__half, 128> waits for its wgmma groups with some still running 2 times, " \
           "not 3" in lacking, lacking
    assert "bwd_kernel<__half, 64>" in lacking, lacking
    assert "with some still running 1 time, not 3" in K.missing_evidence(
        st, fl.stage("20").source, "sm_90a")
    assert K.missing_evidence(st, st.source, "sm_90a") == ""


def test_an_edition_without_nbformat_says_what_to_install(tmp_path, monkeypatch):
    # an instructor who installed flashlab without its extras: a sentence naming the install,
    # not a traceback from the first notebook, and nothing written
    import sys
    monkeypatch.setitem(sys.modules, "nbformat", None)  # import nbformat raises ImportError
    with pytest.raises(ValueError, match=r'pip install -e "\.\[grading\]"'):
        student.write(tmp_path / "ed", through=2)
    assert not (tmp_path / "ed").exists()


@needs_cuobjdump
def test_without_a_gpu_grade_can_read_the_machine_code(week3):
    """flashlab grade --machine-code on a machine without a GPU: each kernel exercise is still
    skipped (no points), with what its stage's machine code holds of the idea, as the grader on a
    GPU reads it (missing_evidence)."""
    from flashlab.course import grade
    out = []
    graded = grade.run(week3, only=["06.swizzle"], out=out.append, gpu=False, machine_code=True)
    (ex, r), = graded
    assert r.ok is None and r.score == 0 and r.note.startswith("its machine code (sm_80)")
    assert "no points" in r.note and f"{ex.id}: its machine code" in out[-1]
    # and without asking, nothing is compiled and nothing noted
    (_, plain), = grade.grade_tree(week3, only=["06.swizzle"], gpu=False)
    assert plain.note == ""
